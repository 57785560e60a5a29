/* Language detection in the gateway, as transformers' detect_language and
 * tandem-generate: audio without a language (on a multilingual checkpoint
 * that names no default) costs one router request first, the first
 * window's features after <|startoftranscript|>, one greedy token over the
 * language tokens; the transcription then runs as if that language had
 * been given. The request goes through the shared link as a long-form
 * window does: the connection's thread waits on its batch, the link thread
 * never waits on it. */
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "gateway/internal.h"

bool gw_detect_language(gw_conn *c, const float *window, gw_error *e) {
  const gw_model *m = gw_gateway_model(c->g);
  gw_io *io = gw_gateway_io(c->g);
  gw_sub *s;
  gw_batch *b = gw_window_batch(io, (size_t)td_mel_n_mels(m->mel) * td_mel_window_frames(m->mel), 1, &s, e);
  if (!b) return false;
  td_json_request *r = &s->req;
  memcpy(r->features, window, sizeof *r->features * r->n_features);
  r->prompt[0] = m->sot;
  r->n_prompt = 1;
  /* greedy (the batch's defaults) over the language tokens alone */
  r->params.max_new_tokens = 1;
  r->params.allowed_ids = m->langs; /* the model's: outlives the request */
  r->params.n_allowed = m->n_langs;
  gw_metrics_language_detection(gw_gateway_metrics(c->g), gw_route_name(c->route));
  int64_t deadline = td_now_ms() + gw_gateway_timeout_ms(c->g) + TD_GATEWAY_WAIT_GRACE_MS;
  TD_DEBUG("gateway: %s: language detection sent", c->cid);
  gw_io_submit(io, b);
  pthread_mutex_lock(&b->mu);
  bool timed_out = gw_sub_wait(b, s, deadline);
  int32_t id = -1;
  bool ok = !timed_out && s->status == TD_OK;
  if (!timed_out && s->status != TD_OK) gw_error_from_status(e, s->status, s->error);
  if (ok && s->n_out > 0 && s->out[0].tok.n > 0) id = s->out[0].tok.v[0];
  pthread_mutex_unlock(&b->mu);
  if (timed_out) {
    gw_io_cancel(io, b);
    gw_error_set(e, 504, NULL, "no answer from the cluster to the language detection within the request's deadline");
  }
  gw_batch_release(b);
  if (!ok) return false;
  if (id < 0) {
    gw_error_set(e, 502, NULL, "the cluster answered the language detection with no token");
    return false;
  }
  if (!gw_audio_set_language(&c->audio, m, id, e)) return false;
  TD_DEBUG("gateway: %s: language detected: %s", c->cid, c->audio.language);
  return true;
}
