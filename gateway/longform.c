/* Long-form transcription in the gateway (docs/gateway.md): audio longer
 * than the model's window, transcribed window after window by td_longform
 * in the connection's thread. Each decode is one router request through
 * the shared link, so the windows of concurrent transcriptions are in
 * flight together and the decode workers batch them; the workers see
 * ordinary requests (features, a decoder prompt, the timestamp rules, a
 * probe for the no-speech probability). The form's options and the
 * answer's segments are here too (pure, unit-tested). */
#include <math.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include <cjson/cJSON.h>
#include <microhttpd.h>

#include "common/clock.h"
#include "common/log.h"
#include "gateway/internal.h"

static char *decode(const gw_model *m, const int32_t *tok, int n) {
  char *text = NULL;
  size_t len = 0;
  return td_tokenizer_decode(m->tok, tok, (size_t)n, true, &text, &len) == TD_OK ? text : NULL;
}

static bool is_ts(const gw_model *m, int32_t id) { return m->ts_begin >= 0 && id >= m->ts_begin; }

#define BAD(param, ...)                      \
  do {                                       \
    gw_error_set(e, 400, param, __VA_ARGS__); \
    return false;                            \
  } while (0)

bool gw_longform_opts(const gw_audio_req *a, const gw_model *m, const td_i32vec *ids, td_longform_opts *o,
                      gw_error *e) {
  *o = (td_longform_opts){.window_frames = (int)td_mel_window_frames(m->mel), .input_stride = 2,
                          .max_target_positions = m->max_target, .vocab_size = m->model_vocab ? m->model_vocab : m->vocab,
                          .timestamp_begin = m->notimestamps + 1, .eos = m->eos, .no_speech = m->notimestamps - 1,
                          .prev_sot = m->prev_sot, .prompt_ids = ids->v, .n_prompt_ids = ids->n};
  int32_t lid = gw_language_id(m, a->language[0] ? a->language : "en");
  if (lid < 0) BAD("language", "language '%s' is not one this model knows", a->language[0] ? a->language : "en");
  o->init[0] = m->sot;
  o->init[1] = lid;
  o->init[2] = a->translate ? m->translate : m->transcribe;
  o->n_init = 3;
  if (td_longform_apply(&a->lf, a->has_temperature ? a->temperature : 0.0f, o) != TD_OK ||
      td_longform_check(o) != TD_OK) {
    /* the message starts with the field it is about */
    static const char *const fields[] = {"temperature_increment_on_fallback", "temperature",
                                         "compression_ratio_threshold", "logprob_threshold", "no_speech_threshold",
                                         "prompt"};
    const char *param = NULL;
    for (size_t i = 0; i < sizeof fields / sizeof *fields && !param; i++)
      if (!strncmp(td_errmsg(), fields[i], strlen(fields[i]))) param = fields[i];
    BAD(param, "%s", td_errmsg());
  }
  return true;
}

td_status gw_longform_segments(const gw_model *m, const td_longform *lf, int32_t **tok, int *n_tok,
                               gw_segment **segs, int *n_segs, char **text) {
  *tok = NULL;
  *segs = NULL;
  *text = NULL;
  *n_tok = *n_segs = 0;
  int n;
  const td_longform_segment *ls = td_longform_segments(lf, &n);
  size_t total = 0;
  for (int i = 0; i < n; i++) total += (size_t)ls[i].n_tokens;
  int32_t *all = malloc(sizeof *all * (total + 1)), *plain = malloc(sizeof *plain * (total + 1));
  gw_segment *s = calloc((size_t)n + 1, sizeof *s);
  td_status st = all && plain && s ? TD_OK : td_err(TD_ERR_NOMEM, "out of memory");
  int at = 0, k = 0;
  for (int i = 0; i < n && st == TD_OK; i++) {
    memcpy(all + at, ls[i].tokens, sizeof *all * (size_t)ls[i].n_tokens);
    int kk = 0;
    for (int j = 0; j < ls[i].n_tokens; j++)
      if (!is_ts(m, ls[i].tokens[j])) plain[k + kk++] = ls[i].tokens[j];
    s[i] = (gw_segment){.start = ls[i].start, .end = ls[i].end, .first = at, .n_tokens = ls[i].n_tokens,
                        .stats = true, .seek = ls[i].seek, .temperature = ls[i].temperature,
                        .avg_logprob = ls[i].avg_logprob, .compression_ratio = ls[i].compression_ratio,
                        .no_speech_prob = ls[i].no_speech_prob};
    if (!(s[i].text = decode(m, plain + k, kk))) st = td_err_ctx(TD_ERR_INVALID, "decoding a segment: ");
    at += ls[i].n_tokens;
    k += kk;
    *n_segs = i + 1;
  }
  if (st == TD_OK && !(*text = decode(m, plain, k))) st = td_err_ctx(TD_ERR_INVALID, "decoding the output: ");
  free(plain);
  if (st != TD_OK) {
    gw_segments_free(s, *n_segs);
    free(all);
    *n_segs = 0;
    return st;
  }
  /* the whole text without the leading space Whisper's first token carries, as OpenAI answers it */
  size_t a = 0, z = strlen(*text);
  while ((*text)[a] == ' ') a++;
  while (z > a && ((*text)[z - 1] == ' ' || (*text)[z - 1] == '\n')) z--;
  memmove(*text, *text + a, z - a);
  (*text)[z - a] = 0;
  *tok = all;
  *n_tok = at;
  *segs = s;
  return TD_OK;
}

/* The client closed its connection: nothing more is decoded for it. */
static bool client_gone(struct MHD_Connection *mc) {
  const union MHD_ConnectionInfo *ci = MHD_get_connection_info(mc, MHD_CONNECTION_INFO_CONNECTION_FD);
  if (!ci) return false;
  struct pollfd p = {.fd = ci->connect_fd, .events = POLLIN | POLLRDHUP};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) return true;
  char x;
  return (p.revents & POLLIN) && recv(ci->connect_fd, &x, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

/* Runs one decode of the transcription through the router and feeds its
 * outcome; false with *e filled. */
static bool run_window(gw_conn *c, const td_longform_window *w, gw_error *e) {
  const gw_model *m = gw_gateway_model(c->g);
  gw_io *io = gw_gateway_io(c->g);
  int n_mels = td_mel_n_mels(m->mel), frames = (int)td_mel_window_frames(m->mel);
  gw_sub *s;
  gw_batch *b = gw_window_batch(io, (size_t)n_mels * (size_t)frames, w->n_prompt, &s, e);
  if (!b) return false;
  td_json_request *r = &s->req;
  td_longform_window_features(c->whole, n_mels, c->whole_frames, w->seek, w->n_frames, frames, r->features);
  memcpy(r->prompt, w->prompt, sizeof *r->prompt * (size_t)w->n_prompt);
  r->n_prompt = w->n_prompt;
  td_request_params *p = &r->params;
  p->max_new_tokens = w->max_new_tokens;
  p->temperature = w->temperature;
  p->top_k = w->temperature > 0 ? TD_LONGFORM_SAMPLE_TOP_K : 0;
  p->logprobs = w->want_logprobs;
  p->timestamp_begin = m->notimestamps + 1;
  p->max_initial_timestamp = m->max_initial_timestamp;
  if (w->probe_position >= 0) {
    p->probe = true;
    p->probe_token = w->probe_token;
    p->probe_position = w->probe_position;
  }
  c->prompt_tokens += w->n_prompt;
  /* each window has the request's time: the transcription as a whole has as many as it has windows */
  c->deadline_ms = td_now_ms() + gw_gateway_timeout_ms(c->g) + TD_GATEWAY_WAIT_GRACE_MS;
  TD_DEBUG("gateway: %s: window %d sent (frame %d, temperature %.1f)", c->cid, w->index, w->seek,
           (double)w->temperature);
  gw_io_submit(io, b);
  pthread_mutex_lock(&b->mu);
  bool timed_out = gw_sub_wait(b, s, c->deadline_ms);
  td_i32vec tok = {0};
  td_f32vec lp = {0};
  double probe = NAN;
  bool ok = !timed_out && s->status == TD_OK;
  if (!timed_out && s->status != TD_OK) gw_error_from_status(e, s->status, s->error);
  if (ok && s->n_out > 0) {
    const gw_out *o = &s->out[0];
    if (td_i32vec_assign(&tok, o->tok.v, o->tok.n) != TD_OK || td_f32vec_append(&lp, o->lp.v, o->lp.n) != TD_OK) {
      gw_error_set(e, 500, NULL, "out of memory");
      ok = false;
    }
    if (o->has_probe) probe = o->probe;
  } else if (ok) {
    gw_error_set(e, 502, NULL, "the cluster answered a window with no output");
    ok = false;
  }
  pthread_mutex_unlock(&b->mu);
  if (timed_out) {
    gw_io_cancel(io, b);
    gw_error_set(e, 504, NULL, "no answer from the cluster for window %d within the request's deadline", w->index);
  }
  gw_batch_release(b);
  if (ok && lp.n != tok.n && w->want_logprobs) {
    gw_error_set(e, 502, NULL, "the cluster answered %d tokens with %d log-probabilities", tok.n, lp.n);
    ok = false;
  }
  if (ok) {
    c->generated += tok.n;
    if (td_longform_feed(c->lf, tok.v, tok.n, lp.n ? lp.v : NULL, probe) != TD_OK) {
      gw_error_set(e, 502, NULL, "window %d: %s", w->index, td_errmsg());
      ok = false;
    }
    TD_DEBUG("gateway: %s: window %d done: %d tokens", c->cid, w->index, tok.n);
  }
  td_i32vec_free(&tok);
  td_f32vec_free(&lp);
  return ok;
}

/* The text of segments settled since the stream last gave some out. */
static void stream_new_text(gw_conn *c, bool final, gw_error *e) {
  const gw_model *m = gw_gateway_model(c->g);
  int n;
  const td_longform_segment *s = td_longform_segments(c->lf, &n);
  for (; c->lf_fed < n && !e->http; c->lf_fed++)
    for (int k = 0; k < s[c->lf_fed].n_tokens && !e->http; k++) {
      int32_t id = s[c->lf_fed].tokens[k];
      if (m->ts_begin >= 0 && id >= m->ts_begin) continue;
      if (gw_text_push(&c->lf_text, id) != TD_OK) gw_error_set(e, 500, NULL, "detokenizing: %s", td_errmsg());
    }
  if (final && !e->http && gw_text_finish(&c->lf_text) != TD_OK) gw_error_set(e, 500, NULL, "%s", td_errmsg());
  if (e->http) return;
  const char *p;
  size_t len;
  gw_text_take(&c->lf_text, final, &p, &len);
  gw_sse_transcript(&c->out, p, len, final ? (c->lf_text.text.s ? c->lf_text.text.s : "") : NULL);
}

/* The stream: a window a turn, its text as a delta event. */
static ssize_t read_longform(void *cls, uint64_t pos, char *buf, size_t max) {
  gw_conn *c = cls;
  while (c->out_pos == c->out.n) {
    if (c->ended) return MHD_CONTENT_READER_END_OF_STREAM;
    c->out.n = c->out_pos = 0;
    gw_error e = {0};
    td_longform_window w;
    bool more = td_longform_next(c->lf, &w);
    if (more && run_window(c, &w, &e)) {
      stream_new_text(c, false, &e);
    } else if (!more) {
      stream_new_text(c, true, &e);
      c->ended = true;
    }
    if (e.http) {
      char *s = gw_error_json(&e);
      if (s) gw_sse_data(&c->out, s);
      free(s);
      c->ended = true;
    }
    if (c->out.oom) return MHD_CONTENT_READER_END_WITH_ERROR;
  }
  size_t n = c->out.n - c->out_pos;
  if (n > max) n = max;
  memcpy(buf, c->out.s + c->out_pos, n);
  c->out_pos += n;
  return (ssize_t)n;
}

int gw_serve_longform(gw_conn *c, struct MHD_Connection *mc, const td_audio *a) {
  const gw_model *m = gw_gateway_model(c->g);
  gw_error e = {0};
  static _Atomic unsigned long long seq;
  c->created = (long long)time(NULL);
  snprintf(c->cid, sizeof c->cid, "trsc-%llx%llx", (unsigned long long)td_now_ns() & 0xffffffffull, ++seq);
  td_i32vec ids = {0};
  td_longform_opts o;
  /* the options are checked before any work; a detected language sets them again */
  if (!gw_audio_prompt_ids(&c->audio, m, &ids, &e) || !gw_longform_opts(&c->audio, m, &ids, &o, &e)) {
    td_i32vec_free(&ids);
    return gw_reply_error(mc, &e);
  }
  /* the whole audio's features, as transformers takes them for long-form */
  int n_mels = td_mel_n_mels(m->mel);
  c->whole_frames = (int)(a->n / TD_MEL_HOP);
  size_t bytes = sizeof(float) * (size_t)n_mels * (size_t)c->whole_frames;
  if (!gw_gateway_hold(c->g, bytes)) {
    td_i32vec_free(&ids);
    gw_error_set(&e, 503, "file", "the gateway holds %zu bytes of uploads and features, its limit: try again shortly",
                 gw_gateway_max_held_bytes(c->g));
    return gw_reply_error(mc, &e);
  }
  c->whole_held = bytes;
  td_status s = (c->whole = malloc(bytes)) ? td_mel_whole(m->mel, a->samples, a->n, c->whole) : TD_ERR_NOMEM;
  if (s == TD_OK && gw_audio_detects(&c->audio, m)) {
    /* the first window of the whole audio's features, as transformers (and
     * tandem-generate) detect from; then the loop starts in that language */
    int frames = (int)td_mel_window_frames(m->mel);
    float *w = malloc(sizeof *w * (size_t)n_mels * (size_t)frames);
    if (!w) s = TD_ERR_NOMEM;
    if (w) td_longform_window_features(c->whole, n_mels, c->whole_frames, 0, frames, frames, w);
    bool ok = w && gw_detect_language(c, w, &e) && gw_longform_opts(&c->audio, m, &ids, &o, &e);
    free(w);
    if (w && !ok) {
      td_i32vec_free(&ids);
      return gw_reply_error(mc, &e);
    }
  }
  if (s == TD_OK) s = td_longform_create(&o, c->whole_frames, &c->lf);
  td_i32vec_free(&ids);
  if (s != TD_OK) {
    gw_error_set(&e, s == TD_ERR_INVALID ? 400 : 500, NULL, "long-form: %s",
                 s == TD_ERR_NOMEM ? "out of memory" : td_errmsg());
    return gw_reply_error(mc, &e);
  }
  TD_DEBUG("gateway: %s: long-form, %.2f s of audio, %d frames in windows of %d", c->cid, c->duration,
           c->whole_frames, o.window_frames);
  if (c->audio.stream) {
    if (gw_text_init(&c->lf_text, m->tok, NULL, 0) != TD_OK) {
      gw_error_set(&e, 500, NULL, "%s", td_errmsg());
      return gw_reply_error(mc, &e);
    }
    c->lf_text_init = true;
    /* the first window before the status: the cluster's refusal is an HTTP error */
    td_longform_window w;
    if (td_longform_next(c->lf, &w) && !run_window(c, &w, &e)) return gw_reply_error(mc, &e);
    stream_new_text(c, false, &e);
    if (e.http) return gw_reply_error(mc, &e);
    struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, read_longform, c, NULL);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    enum MHD_Result q = MHD_queue_response(mc, MHD_HTTP_OK, r);
    MHD_destroy_response(r);
    if (q == MHD_YES) {
      gw_note_status(MHD_HTTP_OK);
      gw_metrics_first_event(gw_gateway_metrics(c->g), gw_route_name(c->route),
                             (double)(td_now_ms() - c->arrived_ms) / 1e3);
    }
    return q;
  }
  td_longform_window w;
  while (td_longform_next(c->lf, &w)) {
    if (client_gone(mc)) {
      TD_DEBUG("gateway: %s: the client left at window %d", c->cid, w.index);
      return MHD_NO; /* no one to answer */
    }
    if (!run_window(c, &w, &e)) return gw_reply_error(mc, &e);
  }
  int32_t *tok = NULL;
  int n_tok = 0, n_seg = 0;
  gw_segment *seg = NULL;
  char *text = NULL;
  if (gw_longform_segments(m, c->lf, &tok, &n_tok, &seg, &n_seg, &text) != TD_OK) {
    gw_error_set(&e, 500, NULL, "%s", td_errmsg());
    return gw_reply_error(mc, &e);
  }
  int windows, decodes, skipped;
  td_longform_counts(c->lf, &windows, &decodes, &skipped);
  TD_DEBUG("gateway: %s: %d windows, %d decodes, %d skipped as no speech, %d segments", c->cid, windows, decodes,
           skipped, n_seg);
  int q = gw_audio_reply(c, mc, text, seg, n_seg, tok, NULL, 0);
  gw_segments_free(seg, n_seg);
  free(tok);
  free(text);
  return q;
}

void gw_longform_free(gw_conn *c) {
  td_longform_destroy(c->lf);
  c->lf = NULL;
  free(c->whole);
  c->whole = NULL;
  if (c->whole_held) gw_gateway_release(c->g, c->whole_held);
  c->whole_held = 0;
  if (c->lf_text_init) gw_text_free(&c->lf_text);
  c->lf_text_init = false;
}
