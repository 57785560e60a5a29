/* The front end at the router: a request's text becomes input_ids and its
 * audio log-mel features and Whisper's decoder prompt at admission; results
 * and streamed chunks get their text. All of it runs in the router's one
 * loop, so each request's cost is bounded by the limits of common/defaults.h
 * (TD_MAX_TEXT_BYTES, TD_MAX_AUDIO_BYTES, TD_MAX_AUDIO_SECONDS; docs/frontend.md). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "router/internal.h"

#define INVALID TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT
#define INTERNAL TANDEM__ERROR_CODE__ERROR_INTERNAL

static Tandem__ErrorCode fail(Tandem__ErrorCode code, char *err, size_t cap, const char *what) {
  snprintf(err, cap, "%s", what);
  return code;
}

static Tandem__ErrorCode convert_text(td_router *r, Tandem__GenerateRequest *g, char *err, size_t cap) {
  int32_t *ids = NULL;
  size_t n = 0;
  /* add_special: the post-processor's tokens, as transformers' tokenizer(text) */
  if (td_tokenizer_encode(r->o.tokenizer, g->text, strlen(g->text), true, &ids, &n) != TD_OK) {
    snprintf(err, cap, "text: %s", td_errmsg());
    return INVALID;
  }
  if (!n) return fail(INVALID, err, cap, "text: the tokenizer gives no tokens for it");
  g->input_ids = ids;
  g->n_input_ids = n;
  return TANDEM__ERROR_CODE__ERROR_NONE;
}

static void free_features(void *data, void *hint) {
  (void)hint;
  free(data);
}

static Tandem__ErrorCode convert_audio(td_router *r, Tandem__GenerateRequest *g, rtr_feat_frame *feat, bool *detect,
                                       char *err,
                                       size_t cap) {
  const td_mel *mel = r->o.mel;
  int n_mels = td_mel_n_mels(mel);
  size_t frames = td_mel_window_frames(mel);
  if (r->have_model && (r->model.mel_bins != (uint32_t)n_mels || r->model.frames != frames)) {
    snprintf(err, cap,
             "the router's preprocessor_config.json gives %d x %zu features, the served model takes %u x %u "
             "(tandem-router --tokenizer names another checkpoint)",
             n_mels, frames, r->model.mel_bins, r->model.frames);
    return INTERNAL;
  }
  int32_t prompt[TD_WHISPER_PROMPT_MAX];
  int n_prompt = 0;
  td_status ps = td_whisper_prompt_build(r->o.whisper, g->language, g->task, g->timestamps, prompt, &n_prompt);
  if (ps == TD_ERR_NOT_FOUND) {
    /* no language: detected by a first step; a stand-in checks the request's shape now */
    int n_langs;
    const int32_t *langs = td_whisper_languages(r->o.whisper, &n_langs);
    const char *first = langs ? td_tokenizer_id_to_token(r->o.tokenizer, langs[0]) : NULL;
    ps = first ? td_whisper_prompt_build(r->o.whisper, first, g->task, g->timestamps, prompt, &n_prompt)
               : td_err(TD_ERR_INTERNAL, "no language token to detect from");
    *detect = ps == TD_OK;
  }
  if (ps != TD_OK) return fail(INVALID, err, cap, td_errmsg());
  Tandem__AudioFeatures *af = malloc(sizeof *af);
  int32_t *dp = malloc(sizeof *dp * (size_t)n_prompt);
  float *v = NULL;
  size_t nv = 0;
  if (!af || !dp) {
    free(af);
    free(dp);
    return fail(INTERNAL, err, cap, "out of memory");
  }
  td_status s = td_mel_features_from_audio(mel, g->audio.data, g->audio.len, "audio", &v, &nv);
  if (s != TD_OK) {
    free(af);
    free(dp);
    return fail(s == TD_ERR_NOMEM || s == TD_ERR_INTERNAL ? INTERNAL : INVALID, err, cap, td_errmsg());
  }
  if (g->timestamps) { /* transformers' timestamp rules act on every step */
    if (!g->sampling) {
      if (!(g->sampling = malloc(sizeof *g->sampling))) {
        free(af);
        free(dp);
        free(v);
        return fail(INTERNAL, err, cap, "out of memory");
      }
      tandem__sampling_params__init(g->sampling);
    }
    int max_initial;
    td_whisper_timestamp_rules(r->o.whisper, &g->sampling->timestamp_begin, &max_initial);
    g->sampling->has_max_initial_timestamp = max_initial >= 0;
    g->sampling->max_initial_timestamp_index = max_initial >= 0 ? max_initial : 0;
  }
  tandem__audio_features__init(af);
  af->mel_bins = (uint32_t)n_mels;
  af->frames = (uint32_t)frames;
  g->features = af;
  /* a frame that owns v: every job that encodes the request sends it by reference */
  zmq_msg_t m;
  if (zmq_msg_init_data(&m, v, sizeof *v * nv, free_features, NULL) != 0) {
    free(v);
    free(dp);
    return fail(INTERNAL, err, cap, "out of memory");
  }
  rtr_feat_adopt_msg(g, feat, &m);
  memcpy(dp, prompt, sizeof *dp * (size_t)n_prompt);
  g->decoder_prompt = dp;
  g->n_decoder_prompt = (size_t)n_prompt;
  /* the file is not needed again: a queued request holds only its features */
  free(g->audio.data);
  g->audio.data = NULL;
  g->audio.len = 0;
  return TANDEM__ERROR_CODE__ERROR_NONE;
}

Tandem__ErrorCode rtr_convert_input(td_router *r, Tandem__GenerateRequest *g, rtr_feat_frame *feat, bool *detect,
                                    char *err, size_t cap) {
  *detect = false;
  bool text = g->text && g->text[0], audio = g->audio.len > 0;
  if (!text && !audio) return TANDEM__ERROR_CODE__ERROR_NONE;
  int64_t t0 = td_now_ns();
  Tandem__ErrorCode code = text ? convert_text(r, g, err, cap) : convert_audio(r, g, feat, detect, err, cap);
  TD_DEBUG("request %s: %s converted in %.2f ms", g->request_id, text ? "text" : "audio",
           (double)(td_now_ns() - t0) / 1e6);
  return code;
}

/* ------------------------------------------------------------ language detection */

/* As transformers' detect_language: one decoder step from <|startoftranscript|>,
 * the best of the language tokens (greedy over them alone). The request then
 * runs with that language as if the client had given it. */
bool rtr_detect_begin(td_router *r, rreq *q) {
  Tandem__GenerateRequest *g = q->g;
  int n_langs;
  const int32_t *langs = td_whisper_languages(r->o.whisper, &n_langs);
  if (!langs || !g->n_decoder_prompt) return false;
  q->user_sampling = g->sampling;
  q->user_max_new = g->max_new_tokens;
  q->user_stream = g->stream;
  tandem__sampling_params__init(&q->detect_sp);
  q->detect_sp.allowed_token_ids = (int32_t *)langs;
  q->detect_sp.n_allowed_token_ids = (size_t)n_langs;
  g->sampling = &q->detect_sp;
  g->max_new_tokens = 1;
  g->stream = false;
  g->n_decoder_prompt = 1; /* <|startoftranscript|>: the stand-in's first id */
  q->detecting = true;
  char err[256];
  if (td_admit_request(&r->model, r->block_size, g, &q->sh, err, sizeof err) != TD_OK) {
    TD_WARN("request %s: language detection: %s", q->cid, err);
    return false;
  }
  q->multi = false;
  return true;
}

void rtr_detect_undo(rreq *q) {
  if (!q->detecting) return;
  q->g->sampling = q->user_sampling;
  q->g->max_new_tokens = q->user_max_new;
  q->g->stream = q->user_stream;
  q->detecting = false;
}

void rtr_detect_done(td_router *r, rreq *q, Tandem__SequenceOutput **outs, size_t n_out) {
  Tandem__GenerateRequest *g = q->g;
  int32_t lang = n_out && outs[0]->n_tokens ? outs[0]->tokens[0] : -1;
  const char *tok = lang >= 0 ? td_tokenizer_id_to_token(r->o.tokenizer, lang) : NULL;
  rtr_detect_undo(q);
  int32_t prompt[TD_WHISPER_PROMPT_MAX];
  int n = 0;
  char err[320];
  int32_t *dp = NULL;
  if (!tok || td_whisper_prompt_build(r->o.whisper, tok, g->task, g->timestamps, prompt, &n) != TD_OK ||
      !(dp = malloc(sizeof *dp * (size_t)n))) {
    snprintf(err, sizeof err, "language detection gave token %d, not a language: %s", lang, tok ? td_errmsg() : "");
    rtr_req_fail(r, q, INTERNAL, err);
    return;
  }
  memcpy(dp, prompt, sizeof *prompt * (size_t)n);
  free(g->decoder_prompt);
  g->decoder_prompt = dp;
  g->n_decoder_prompt = (size_t)n;
  if (td_admit_request(&r->model, r->block_size, g, &q->sh, err, sizeof err) != TD_OK) {
    rtr_req_fail(r, q, INVALID, err);
    return;
  }
  q->multi = q->sh.width > 1;
  q->free_attempts++;
  TD_DEBUG("request %s: language %s detected", q->cid, tok);
  rtr_req_requeue(r, q, true);
}

/* ------------------------------------------------------------ text out */

char *rtr_stream_text(td_router *r, rreq *q, uint32_t seq, const int32_t *tokens, size_t n) {
  if (!r->o.tokenizer || seq >= (uint32_t)q->sh.width) return NULL;
  if (seq >= (uint32_t)q->n_detok) {
    td_detok **nd = realloc(q->detok, sizeof *nd * (seq + 1));
    if (!nd) return NULL;
    for (uint32_t i = (uint32_t)q->n_detok; i <= seq; i++) nd[i] = NULL;
    q->detok = nd;
    q->n_detok = (int)seq + 1;
  }
  if (!q->detok[seq] && td_detok_create(r->o.tokenizer, true, &q->detok[seq]) != TD_OK) return NULL;
  size_t len = 0, cap = 64;
  char *out = malloc(cap);
  if (!out) return NULL;
  out[0] = 0;
  for (size_t i = 0; i < n; i++) {
    const char *piece;
    size_t pl;
    if (td_detok_push(q->detok[seq], tokens[i], &piece, &pl) != TD_OK) {
      TD_DEBUG("request %s: no text for token %d: %s", q->cid, tokens[i], td_errmsg());
      continue;
    }
    if (len + pl + 1 > cap) {
      while (len + pl + 1 > cap) cap *= 2;
      char *no = realloc(out, cap);
      if (!no) {
        free(out);
        return NULL;
      }
      out = no;
    }
    memcpy(out + len, piece, pl);
    len += pl;
    out[len] = 0;
  }
  return out;
}

void rtr_stream_text_finish(td_router *r, rreq *q) {
  for (int i = 0; i < q->n_detok; i++) {
    const char *piece;
    size_t pl;
    if (!q->detok[i] || td_detok_finish(q->detok[i], &piece, &pl) != TD_OK || !pl) continue;
    char *text = strndup(piece, pl);
    if (!text) continue;
    Tandem__TokenChunk c = TANDEM__TOKEN_CHUNK__INIT;
    c.sequence = (uint32_t)i;
    c.offset = !q->multi && i == 0 ? (uint32_t)q->streamed.n : 0;
    c.text = text;
    c.has_text = true;
    Tandem__ServerMessage sm = TANDEM__SERVER_MESSAGE__INIT;
    sm.request_id = q->cid;
    sm.body_case = TANDEM__SERVER_MESSAGE__BODY_TOKENS;
    sm.tokens = &c;
    rtr_send_client(r, q->client, q->client_len, &sm);
    free(text);
  }
}

void rtr_stream_text_reset(rreq *q) {
  for (int i = 0; i < q->n_detok; i++) td_detok_destroy(q->detok[i]);
  free(q->detok);
  q->detok = NULL;
  q->n_detok = 0;
}

void rtr_result_text(td_router *r, const rreq *q, Tandem__SequenceOutput **outs, size_t n, rtr_result_extras *x) {
  memset(x, 0, sizeof *x);
  if (!r->o.tokenizer || !n) return;
  x->n = n;
  x->texts = calloc(n, sizeof *x->texts);
  int32_t tb = q->g->sampling ? q->g->sampling->timestamp_begin : 0;
  if (tb > 0) {
    x->segs = calloc(n, sizeof *x->segs);
    x->seg_ptrs = calloc(n, sizeof *x->seg_ptrs);
  }
  for (size_t i = 0; x->texts && i < n; i++) {
    size_t len;
    if (td_tokenizer_decode(r->o.tokenizer, outs[i]->tokens, outs[i]->n_tokens, true, &x->texts[i], &len) != TD_OK) {
      TD_DEBUG("a result has no text: %s", td_errmsg());
      x->texts[i] = NULL;
      continue;
    }
    outs[i]->text = x->texts[i];
    outs[i]->has_text = true;
    td_whisper_segment *ws;
    size_t nw;
    if (!x->segs || !x->seg_ptrs ||
        td_whisper_segments(r->o.tokenizer, outs[i]->tokens, outs[i]->n_tokens, tb, &ws, &nw) != TD_OK)
      continue;
    x->segs[i] = calloc(nw ? nw : 1, sizeof **x->segs);
    x->seg_ptrs[i] = calloc(nw ? nw : 1, sizeof **x->seg_ptrs);
    if (!x->segs[i] || !x->seg_ptrs[i]) {
      td_whisper_segments_free(ws, nw);
      continue;
    }
    for (size_t k = 0; k < nw; k++) {
      tandem__segment__init(&x->segs[i][k]);
      x->segs[i][k].start = ws[k].start;
      x->segs[i][k].end = ws[k].end;
      x->segs[i][k].text = ws[k].text; /* kept: freed with the extras */
      ws[k].text = NULL;
      x->seg_ptrs[i][k] = &x->segs[i][k];
    }
    td_whisper_segments_free(ws, nw);
    outs[i]->segments = x->seg_ptrs[i];
    outs[i]->n_segments = nw;
    outs[i]->has_segments = true;
  }
}

void rtr_result_extras_free(rtr_result_extras *x, Tandem__SequenceOutput **outs) {
  for (size_t i = 0; i < x->n; i++) {
    if (x->texts) free(x->texts[i]);
    if (x->segs && x->segs[i])
      for (size_t k = 0; k < outs[i]->n_segments; k++) free(x->segs[i][k].text);
    if (x->segs) free(x->segs[i]);
    if (x->seg_ptrs) free(x->seg_ptrs[i]);
  }
  free(x->texts);
  free(x->segs);
  free(x->seg_ptrs);
}
