/* The answers to API requests: router requests built from a parsed body,
 * then either one JSON (or text) answer once every request ended, or a
 * stream of server-sent events written as tokens arrive. The connection's
 * thread waits on its batch (libmicrohttpd runs a thread a connection),
 * copies what arrived out of it under its mutex, and detokenizes and
 * formats outside it, so the router link's thread, shared by every
 * request, never waits on that work. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>
#include <microhttpd.h>

#include "common/clock.h"
#include "common/log.h"
#include "gateway/internal.h"

static const char *finish_name(const gw_choice *ch) {
  if (ch->t.stopped) return "stop";
  return ch->finish == TD_FINISH_LENGTH ? "length" : "stop";
}

static void start(gw_conn *c, const char *prefix) {
  static _Atomic unsigned long long seq;
  c->created = (long long)time(NULL);
  snprintf(c->cid, sizeof c->cid, "%s-%llx%llx", prefix, (unsigned long long)td_now_ns() & 0xffffffffull, ++seq);
  c->deadline_ms = td_now_ms() + gw_gateway_timeout_ms(c->g) + TD_GATEWAY_WAIT_GRACE_MS;
}

void gw_conn_free(gw_conn *c) {
  if (c->b) {
    pthread_mutex_lock(&c->b->mu);
    bool running = c->b->n_done < c->b->n;
    pthread_mutex_unlock(&c->b->mu);
    if (running) gw_io_cancel(gw_gateway_io(c->g), c->b); /* the client left */
  }
  for (int i = 0; i < c->n_ch; i++) {
    gw_text_free(&c->ch[i].t);
    td_i32vec_free(&c->ch[i].tok);
    td_f32vec_free(&c->ch[i].lp);
  }
  free(c->ch);
  gw_longform_free(c);
  gw_batch_release(c->b);
  gw_completion_free(&c->comp);
  gw_buf_free(&c->body);
  gw_buf_free(&c->value);
  gw_buf_free(&c->out);
  free(c->audio.prompt);
  free(c);
}

/* Sets up a choice per (sub, sequence). */
static bool choices(gw_conn *c, int per_sub, const char *const *stop, int n_stop, gw_error *e) {
  c->per_sub = per_sub;
  c->n_ch = c->b->n * per_sub;
  c->ch = calloc((size_t)c->n_ch, sizeof *c->ch);
  if (!c->ch) {
    gw_error_set(e, 500, NULL, "out of memory");
    return false;
  }
  for (int i = 0; i < c->n_ch; i++) {
    c->ch[i].o = &c->b->subs[i / per_sub].out[i % per_sub];
    if (gw_text_init(&c->ch[i].t, gw_gateway_model(c->g)->tok, stop, n_stop) != TD_OK) {
      gw_error_set(e, 500, NULL, "%s", td_errmsg());
      return false;
    }
  }
  return true;
}

static bool sub_done(const gw_conn *c, int i) { return c->b->subs[i / c->per_sub].done; }

/* Copies what arrived into the choices (under b->mu: short, so the router
 * link is not held up); true when any choice moved. */
static bool snapshot(gw_conn *c, gw_error *e) {
  bool moved = false;
  for (int i = 0; i < c->n_ch; i++) {
    gw_choice *ch = &c->ch[i];
    const gw_out *o = ch->o;
    if (o->tok.n > ch->tok.n) {
      int from = ch->tok.n, n = o->tok.n - from;
      if (td_i32vec_reserve(&ch->tok, o->tok.n) != TD_OK) {
        gw_error_set(e, 500, NULL, "out of memory");
        return moved;
      }
      memcpy(ch->tok.v + from, o->tok.v + from, (size_t)n * sizeof *o->tok.v);
      ch->tok.n = o->tok.n;
      moved = true;
    }
    if (o->lp.n > ch->lp.n && td_f32vec_append(&ch->lp, o->lp.v + ch->lp.n, o->lp.n - ch->lp.n) != TD_OK) {
      gw_error_set(e, 500, NULL, "out of memory");
      return moved;
    }
    if (!ch->done && sub_done(c, i)) {
      ch->done = true;
      ch->finish = o->finish;
      moved = true;
    }
  }
  return moved;
}

/* Detokenizes what was copied (outside the mutex). */
static void feed(gw_conn *c, gw_error *e) {
  for (int i = 0; i < c->n_ch && !e->http; i++) {
    gw_choice *ch = &c->ch[i];
    while (ch->used < ch->tok.n && !ch->t.stopped) {
      if (gw_text_push(&ch->t, ch->tok.v[ch->used]) != TD_OK) {
        gw_error_set(e, 500, NULL, "detokenizing: %s", td_errmsg());
        return;
      }
      ch->used++;
    }
  }
}

/* The first failed sub's error, if any (under b->mu). */
static bool failed(const gw_conn *c, gw_error *e) {
  for (int i = 0; i < c->b->n; i++) {
    const gw_sub *s = &c->b->subs[i];
    if (s->done && s->status != TD_OK) {
      gw_error_from_status(e, s->status, s->error);
      return true;
    }
  }
  return false;
}

/* Token strings and log-probs of tokens [from, to) of a choice. */
static cJSON *logprobs_json(const gw_conn *c, const gw_choice *ch, int from, int to, size_t text_off) {
  const gw_model *m = gw_gateway_model(c->g);
  cJSON *o = cJSON_CreateObject(), *toks = cJSON_AddArrayToObject(o, "tokens"),
        *lps = cJSON_AddArrayToObject(o, "token_logprobs"), *offs = cJSON_AddArrayToObject(o, "text_offset");
  cJSON *top = c->comp.logprobs >= 1 ? cJSON_AddArrayToObject(o, "top_logprobs") : NULL;
  if (!top) cJSON_AddNullToObject(o, "top_logprobs");
  for (int k = from; k < to; k++) {
    char *s = NULL;
    size_t len = 0;
    int32_t id = ch->tok.v[k];
    if (td_tokenizer_decode(m->tok, &id, 1, false, &s, &len) != TD_OK) s = NULL;
    double lp = k < ch->lp.n ? ch->lp.v[k] : 0.0;
    cJSON_AddItemToArray(toks, cJSON_CreateString(s ? s : ""));
    cJSON_AddItemToArray(lps, cJSON_CreateNumber(isfinite(lp) ? lp : -9999.0));
    cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)text_off));
    if (top) {
      cJSON *t = cJSON_CreateObject();
      cJSON_AddNumberToObject(t, s ? s : "", isfinite(lp) ? lp : -9999.0);
      cJSON_AddItemToArray(top, t);
    }
    text_off += len;
    free(s);
  }
  return o;
}

static cJSON *choice_json(int index, const char *text, size_t len, cJSON *logprobs, const char *finish) {
  cJSON *ch = cJSON_CreateObject();
  char *t = strndup(text, len);
  cJSON_AddStringToObject(ch, "text", t ? t : "");
  free(t);
  cJSON_AddNumberToObject(ch, "index", index);
  if (logprobs)
    cJSON_AddItemToObject(ch, "logprobs", logprobs);
  else
    cJSON_AddNullToObject(ch, "logprobs");
  if (finish)
    cJSON_AddStringToObject(ch, "finish_reason", finish);
  else
    cJSON_AddNullToObject(ch, "finish_reason");
  return ch;
}

static cJSON *completion_obj(const gw_conn *c) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "id", c->cid);
  cJSON_AddStringToObject(o, "object", "text_completion");
  cJSON_AddNumberToObject(o, "created", (double)c->created);
  cJSON_AddStringToObject(o, "model", gw_gateway_model(c->g)->name);
  return o;
}

static cJSON *usage_json(const gw_conn *c) {
  int out = 0;
  for (int i = 0; i < c->n_ch; i++) out += c->ch[i].t.n_tokens;
  cJSON *u = cJSON_CreateObject();
  cJSON_AddNumberToObject(u, "prompt_tokens", c->prompt_tokens);
  cJSON_AddNumberToObject(u, "completion_tokens", out);
  cJSON_AddNumberToObject(u, "total_tokens", c->prompt_tokens + out);
  return u;
}

static bool all_stopped(const gw_conn *c) {
  for (int i = 0; i < c->n_ch; i++)
    if (!c->ch[i].t.stopped && !c->ch[i].done) return false;
  return true;
}

/* Waits until every sub ended, or every choice stopped at a stop string,
 * and takes their outputs; false with *e filled on a failure or timeout. */
static bool wait_all(gw_conn *c, gw_error *e) {
  pthread_mutex_lock(&c->b->mu);
  bool ok = true;
  for (;;) {
    if (c->b->n_done == c->b->n) break;
    if (c->comp.n_stop && snapshot(c, e)) {
      /* stop strings: cut early (the rest is cancelled) */
      pthread_mutex_unlock(&c->b->mu);
      feed(c, e);
      pthread_mutex_lock(&c->b->mu);
      if (e->http || all_stopped(c)) break;
      continue;
    }
    if (e->http) break;
    if (!gw_batch_wait(c->b, c->deadline_ms)) {
      ok = false;
      break;
    }
  }
  if (ok && !e->http) snapshot(c, e);
  if (ok && !e->http) failed(c, e);
  pthread_mutex_unlock(&c->b->mu);
  if (!ok) gw_error_set(e, 504, NULL, "no answer from the cluster within the request's deadline");
  if (ok && !e->http) feed(c, e);
  return ok && !e->http;
}

/* ---------------------------------------------------------------- streaming */

typedef enum { ST_COMPLETION, ST_TRANSCRIPT } stream_kind;

/* Appends the events of what arrived; true when the stream has ended. */
static bool stream_step(gw_conn *c, stream_kind kind) {
  gw_error e = {0};
  pthread_mutex_lock(&c->b->mu);
  for (;;) {
    bool all_done = c->b->n_done == c->b->n;
    if (!all_done && td_now_ms() < c->hold_until_ms) {
      /* coalesce: tokens gather without waking this thread; an end still wakes it */
      c->b->quiet = true;
      gw_batch_wait(c->b, c->hold_until_ms < c->deadline_ms ? c->hold_until_ms : c->deadline_ms);
      c->b->quiet = false;
      continue;
    }
    bool moved = snapshot(c, &e);
    if (e.http || moved || all_done) break;
    if (!gw_batch_wait(c->b, c->deadline_ms)) {
      gw_error_set(&e, 504, NULL, "no answer from the cluster within the request's deadline");
      break;
    }
  }
  if (!e.http) failed(c, &e);
  pthread_mutex_unlock(&c->b->mu);
  if (!e.http) feed(c, &e);
  bool all_done = true, all_fin = true;
  for (int i = 0; i < c->n_ch; i++) {
    all_done &= c->ch[i].done;
    all_fin &= c->ch[i].t.stopped || c->ch[i].done;
  }
  /* the events, from the connection's copies */
  for (int i = 0; i < c->n_ch && !e.http; i++) {
    gw_choice *ch = &c->ch[i];
    if (ch->finished) continue;
    bool fin = ch->t.stopped || ch->done;
    if (fin && !ch->t.stopped && gw_text_finish(&ch->t) != TD_OK) gw_error_set(&e, 500, NULL, "%s", td_errmsg());
    size_t before = ch->t.sent;
    const char *p;
    size_t n;
    gw_text_take(&ch->t, fin, &p, &n);
    bool lp = c->comp.logprobs >= 0 && ch->lp_sent < ch->used;
    /* every arrival is an event, text or not, so a client sees its first token when it comes */
    bool fresh = ch->shown < ch->used;
    ch->shown = ch->used;
    if (!n && !fin && !lp && !(fresh && kind == ST_COMPLETION)) continue;
    if (kind == ST_TRANSCRIPT) {
      gw_sse_transcript(&c->out, p, n, fin ? (ch->t.text.s ? ch->t.text.s : "") : NULL);
    } else {
      cJSON *o = completion_obj(c);
      cJSON *l = lp ? logprobs_json(c, ch, ch->lp_sent, ch->used, before) : NULL;
      ch->lp_sent = ch->used;
      cJSON_AddItemToArray(cJSON_AddArrayToObject(o, "choices"), choice_json(i, p, n, l, fin ? finish_name(ch) : NULL));
      char *s = cJSON_PrintUnformatted(o);
      cJSON_Delete(o);
      if (s) gw_sse_data(&c->out, s);
      free(s);
    }
    ch->finished = fin;
    int iv = gw_gateway_stream_interval_ms(c->g);
    if (iv) c->hold_until_ms = td_now_ms() + iv;
  }
  if (e.http) {
    char *s = gw_error_json(&e);
    if (s) gw_sse_data(&c->out, s);
    free(s);
  } else if (!all_fin) {
    return false;
  }
  if (!all_done && !c->cancelled) {
    gw_io_cancel(gw_gateway_io(c->g), c->b); /* every choice stopped at a stop string */
    c->cancelled = true;
  }
  if (kind == ST_COMPLETION && c->comp.include_usage && !e.http) {
    cJSON *o = completion_obj(c);
    cJSON_AddArrayToObject(o, "choices");
    cJSON_AddItemToObject(o, "usage", usage_json(c));
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (s) gw_sse_data(&c->out, s);
    free(s);
  }
  if (kind == ST_COMPLETION) gw_buf_str(&c->out, "data: [DONE]\n\n");
  return true;
}

/* Where a stream's first event spent its time, as the gateway saw it:
 * arrival to the request handed to the router, the router's answer (its
 * first token or result), and that answer to the event handed to the HTTP
 * server (docs/metrics.md). Of the batch's request that answered first
 * (the first event is whichever prompt's token came first). */
static void first_stages(gw_conn *c) {
  c->staged = true;
  int64_t sent = 0, first = 0;
  pthread_mutex_lock(&c->b->mu);
  for (int i = 0; i < c->b->n; i++) {
    const gw_sub *s = &c->b->subs[i];
    if (s->first_ns && s->sent_ns && (!first || s->first_ns < first)) first = s->first_ns, sent = s->sent_ns;
  }
  pthread_mutex_unlock(&c->b->mu);
  if (!sent || !first || first < sent) return;
  gw_metrics_stages(gw_gateway_metrics(c->g), gw_route_name(c->route), (double)(sent - c->arrived_ns) / 1e9,
                    (double)(first - sent) / 1e9, (double)(td_now_ns() - first) / 1e9);
}

static ssize_t read_stream(void *cls, uint64_t pos, char *buf, size_t max, stream_kind kind) {
  gw_conn *c = cls;
  while (c->out_pos == c->out.n) {
    if (c->ended) return MHD_CONTENT_READER_END_OF_STREAM;
    c->out.n = c->out_pos = 0;
    c->ended = stream_step(c, kind);
    if (c->out.oom) return MHD_CONTENT_READER_END_WITH_ERROR;
  }
  size_t n = c->out.n - c->out_pos;
  if (n > max) n = max;
  if (!c->staged) first_stages(c);
  memcpy(buf, c->out.s + c->out_pos, n);
  c->out_pos += n;
  return (ssize_t)n;
}

static ssize_t read_completion(void *cls, uint64_t pos, char *buf, size_t max) {
  return read_stream(cls, pos, buf, max, ST_COMPLETION);
}

static ssize_t read_transcript(void *cls, uint64_t pos, char *buf, size_t max) {
  return read_stream(cls, pos, buf, max, ST_TRANSCRIPT);
}

/* A stream's status goes out with its first event; a refusal by the router
 * comes before any token, so waiting for the first token or end lets it be
 * answered as an HTTP error rather than an event after a 200. */
static bool first_event(gw_conn *c, gw_error *e) {
  pthread_mutex_lock(&c->b->mu);
  bool ok = true;
  for (;;) {
    if (failed(c, e)) {
      ok = false;
      break;
    }
    bool any = c->b->n_done > 0;
    for (int i = 0; i < c->n_ch && !any; i++) any = c->ch[i].o->tok.n > 0;
    if (any) break;
    if (!gw_batch_wait(c->b, c->deadline_ms)) {
      gw_error_set(e, 504, NULL, "no answer from the cluster within the request's deadline");
      ok = false;
      break;
    }
  }
  pthread_mutex_unlock(&c->b->mu);
  return ok;
}

static int reply_stream(gw_conn *c, struct MHD_Connection *mc, stream_kind kind) {
  gw_error e = {0};
  if (!first_event(c, &e)) return gw_reply_error(mc, &e);
  struct MHD_Response *r = MHD_create_response_from_callback(
      MHD_SIZE_UNKNOWN, 16 * 1024, kind == ST_COMPLETION ? read_completion : read_transcript, c, NULL);
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

/* ---------------------------------------------------------------- /v1/completions */

int gw_serve_completions(gw_conn *c, struct MHD_Connection *mc) {
  const gw_model *m = gw_gateway_model(c->g);
  gw_error e = {0};
  gw_completion *q = &c->comp;
  if (!gw_completion_parse(c->body.s ? c->body.s : "", c->body.n, m, q, &e)) return gw_reply_error(mc, &e);
  c->b = gw_batch_create(gw_gateway_io(c->g), q->n_prompts);
  if (!c->b) {
    gw_error_set(&e, 500, NULL, "out of memory");
    return gw_reply_error(mc, &e);
  }
  for (int i = 0; i < q->n_prompts; i++) {
    gw_sub *s = &c->b->subs[i];
    td_json_request *r = &s->req;
    snprintf(r->id, sizeof r->id, "%s", s->id);
    r->params = q->params;
    r->input_ids = q->prompts[i].v; /* moved */
    r->n_input = q->prompts[i].n;
    q->prompts[i] = (td_i32vec){0};
    c->prompt_tokens += r->n_input;
    if (q->stop_ids.n) {
      r->stop_ids = malloc((size_t)q->stop_ids.n * sizeof *r->stop_ids);
      if (!r->stop_ids) {
        gw_error_set(&e, 500, NULL, "out of memory");
        return gw_reply_error(mc, &e);
      }
      memcpy(r->stop_ids, q->stop_ids.v, (size_t)q->stop_ids.n * sizeof *r->stop_ids);
      r->n_stop_ids = q->stop_ids.n;
      r->params.stop_ids = r->stop_ids;
      r->params.n_stop_ids = r->n_stop_ids;
    }
    s->stream = q->stream || q->n_stop; /* stop strings are looked for as tokens arrive */
  }
  if (!choices(c, q->n, (const char *const *)q->stop, q->n_stop, &e)) return gw_reply_error(mc, &e);
  start(c, "cmpl");
  gw_io_submit(gw_gateway_io(c->g), c->b);
  if (q->stream) return reply_stream(c, mc, ST_COMPLETION);
  if (!wait_all(c, &e)) return gw_reply_error(mc, &e);
  cJSON *o = completion_obj(c), *arr = cJSON_AddArrayToObject(o, "choices");
  bool all_done = true;
  for (int i = 0; i < c->n_ch && !e.http; i++) {
    gw_choice *ch = &c->ch[i];
    all_done &= ch->done;
    if (!ch->t.stopped && gw_text_finish(&ch->t) != TD_OK) gw_error_set(&e, 500, NULL, "%s", td_errmsg());
    const char *p;
    size_t n;
    gw_text_take(&ch->t, true, &p, &n);
    cJSON *l = q->logprobs >= 0 ? logprobs_json(c, ch, 0, ch->t.n_tokens, 0) : NULL;
    cJSON_AddItemToArray(arr, choice_json(i, p, n, l, finish_name(ch)));
  }
  if (!all_done) {
    gw_io_cancel(gw_gateway_io(c->g), c->b); /* every choice stopped at a stop string */
    c->cancelled = true;
  }
  if (e.http) {
    cJSON_Delete(o);
    return gw_reply_error(mc, &e);
  }
  cJSON_AddItemToObject(o, "usage", usage_json(c));
  char *s = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  if (!s) return MHD_NO;
  return gw_reply(mc, 200, "application/json", s, strlen(s));
}

/* ---------------------------------------------------------------- /v1/audio */

static cJSON *verbose_json(const gw_conn *c, const char *text, const gw_segment *seg, int n_seg, const int32_t *tok,
                           const float *lp, int n_lp) {
  cJSON *v = cJSON_CreateObject();
  cJSON_AddStringToObject(v, "task", c->audio.translate ? "translate" : "transcribe");
  cJSON_AddStringToObject(v, "language", c->audio.language[0] ? c->audio.language : "en");
  cJSON_AddNumberToObject(v, "duration", c->duration);
  cJSON_AddStringToObject(v, "text", text);
  cJSON *arr = cJSON_AddArrayToObject(v, "segments");
  for (int i = 0; i < n_seg; i++) {
    const gw_segment *s = &seg[i];
    cJSON *x = cJSON_CreateObject();
    cJSON_AddNumberToObject(x, "id", i);
    cJSON_AddNumberToObject(x, "seek", s->stats ? s->seek : 0);
    cJSON_AddNumberToObject(x, "start", s->start);
    cJSON_AddNumberToObject(x, "end", s->end);
    cJSON_AddStringToObject(x, "text", s->text);
    cJSON *toks = cJSON_AddArrayToObject(x, "tokens");
    double sum = 0;
    int n = 0;
    for (int k = s->first; k < s->first + s->n_tokens; k++) {
      cJSON_AddItemToArray(toks, cJSON_CreateNumber(tok[k]));
      if (k < n_lp && isfinite(lp[k])) sum += lp[k], n++;
    }
    if (s->stats) {
      /* its window's, as transformers judged it (EOS included) */
      cJSON_AddNumberToObject(x, "temperature", s->temperature);
      cJSON_AddNumberToObject(x, "avg_logprob", isfinite(s->avg_logprob) ? s->avg_logprob : 0.0);
      cJSON_AddNumberToObject(x, "compression_ratio", isfinite(s->compression_ratio) ? s->compression_ratio : 0.0);
      if (isfinite(s->no_speech_prob)) cJSON_AddNumberToObject(x, "no_speech_prob", s->no_speech_prob);
    } else {
      cJSON_AddNumberToObject(x, "temperature", c->audio.has_temperature ? c->audio.temperature : 0.0);
      cJSON_AddNumberToObject(x, "avg_logprob", n ? sum / n : 0.0);
    }
    cJSON_AddItemToArray(arr, x);
  }
  return v;
}

static bool empty_text(const char *t) {
  while (*t == ' ') t++;
  return !*t;
}

int gw_audio_reply(gw_conn *c, struct MHD_Connection *mc, const char *text, const gw_segment *seg, int n_seg,
                   const int32_t *tok, const float *lp, int n_lp) {
  gw_error e = {0};
  gw_buf b = {0};
  const char *ctype = "text/plain; charset=utf-8";
  /* subtitles skip segments without text (long-form keeps transformers' list in verbose_json) */
  gw_segment *cues = malloc(sizeof *cues * (size_t)(n_seg + 1));
  int n_cues = 0;
  for (int i = 0; cues && i < n_seg; i++)
    if (!empty_text(seg[i].text)) cues[n_cues++] = seg[i];
  cJSON *j = NULL;
  if (!cues) {
    b.oom = true;
  } else {
    switch (c->audio.format) {
      case GW_FMT_JSON:
        j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "text", text);
        break;
      case GW_FMT_VERBOSE: j = verbose_json(c, text, seg, n_seg, tok, lp, n_lp); break;
      case GW_FMT_TEXT: gw_buf_printf(&b, "%s\n", text); break;
      case GW_FMT_SRT: gw_format_srt(&b, cues, n_cues); break;
      case GW_FMT_VTT: gw_format_vtt(&b, cues, n_cues); break;
    }
  }
  free(cues);
  if (j) {
    char *s = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (s) gw_buf_str(&b, s);
    b.oom |= !s;
    free(s);
    ctype = "application/json";
  }
  if (b.oom) {
    gw_buf_free(&b);
    gw_error_set(&e, 500, NULL, "out of memory");
    return gw_reply_error(mc, &e);
  }
  return gw_reply(mc, 200, ctype, b.s ? b.s : strdup(""), b.n);
}

/* Fills the request of short audio (one window): its features and prompt. */
static bool audio_request(gw_conn *c, const td_audio *a, td_json_request *r, gw_error *e) {
  const gw_model *m = gw_gateway_model(c->g);
  size_t n = (size_t)td_mel_n_mels(m->mel) * td_mel_window_frames(m->mel);
  r->features = malloc(n * sizeof *r->features);
  td_status s = r->features ? td_mel_window(m->mel, a->samples, a->n, 0, r->features) : TD_ERR_NOMEM;
  if (s != TD_OK) {
    gw_error_set(e, 500, NULL, "log-mel features: %s", s == TD_ERR_NOMEM ? "out of memory" : td_errmsg());
    return false;
  }
  r->n_features = n;
  /* the prompt is checked before any work; a detected language builds it again */
  td_i32vec p = {0};
  bool ok = gw_audio_prompt(&c->audio, m, &p, e);
  if (ok && gw_audio_detects(&c->audio, m))
    ok = gw_detect_language(c, r->features, e) && gw_audio_prompt(&c->audio, m, &p, e);
  if (!ok) {
    td_i32vec_free(&p);
    return false;
  }
  r->prompt = p.v;
  r->n_prompt = p.n;
  td_request_params_default(&r->params);
  if (c->audio.has_temperature) r->params.temperature = c->audio.temperature;
  r->params.logprobs = c->audio.format == GW_FMT_VERBOSE;
  if (c->audio.seg_timestamps) { /* transformers' WhisperTimeStampLogitsProcessor on every step */
    r->params.timestamp_begin = m->notimestamps + 1;
    r->params.max_initial_timestamp = m->max_initial_timestamp;
  }
  return true;
}

int gw_serve_audio(gw_conn *c, struct MHD_Connection *mc) {
  const gw_model *m = gw_gateway_model(c->g);
  gw_error e = {0};
  if (!c->have_file || !c->body.n) {
    gw_error_set(&e, 400, "file", "file is required (the audio, as a multipart/form-data part)");
    return gw_reply_error(mc, &e);
  }
  if (!gw_audio_check(&c->audio, m, &e)) return gw_reply_error(mc, &e);
  td_audio a = {0};
  td_audio_limits lim = {.max_seconds = gw_gateway_max_audio_seconds(c->g)};
  if (td_audio_decode_memory(c->body.s, c->body.n, "file", &lim, &a) != TD_OK) {
    gw_error_set(&e, 400, "file", "%s", td_errmsg());
    return gw_reply_error(mc, &e);
  }
  gw_conn_drop_upload(c); /* decoded: the upload is no longer needed */
  c->duration = (double)a.n / TD_AUDIO_RATE;
  /* more frames than the window: long-form, as transformers decides it */
  if (a.n / TD_MEL_HOP > td_mel_window_frames(m->mel)) {
    int q = gw_serve_longform(c, mc, &a);
    td_audio_free(&a);
    return q;
  }
  c->b = gw_batch_create(gw_gateway_io(c->g), 1);
  if (!c->b) {
    td_audio_free(&a);
    gw_error_set(&e, 500, NULL, "out of memory");
    return gw_reply_error(mc, &e);
  }
  gw_sub *sub = &c->b->subs[0];
  snprintf(sub->req.id, sizeof sub->req.id, "%s", sub->id);
  start(c, "trsc");
  bool ok = audio_request(c, &a, &sub->req, &e);
  td_audio_free(&a);
  if (!ok) return gw_reply_error(mc, &e);
  sub->stream = c->audio.stream;
  c->comp.logprobs = -1;
  if (!choices(c, 1, NULL, 0, &e)) return gw_reply_error(mc, &e);
  /* the transcription has the request's whole time, after any detection */
  c->deadline_ms = td_now_ms() + gw_gateway_timeout_ms(c->g) + TD_GATEWAY_WAIT_GRACE_MS;
  gw_io_submit(gw_gateway_io(c->g), c->b);
  if (c->audio.stream) return reply_stream(c, mc, ST_TRANSCRIPT);
  if (!wait_all(c, &e)) return gw_reply_error(mc, &e);
  gw_segment *seg = NULL;
  int n_seg = 0;
  char *text = NULL;
  const gw_choice *o = &c->ch[0];
  if (gw_segments(m, o->tok.v, o->tok.n, c->duration, c->audio.seg_timestamps, &seg, &n_seg, &text) != TD_OK) {
    gw_error_set(&e, 500, NULL, "%s", td_errmsg());
    return gw_reply_error(mc, &e);
  }
  int q = gw_audio_reply(c, mc, text, seg, n_seg, o->tok.v, o->lp.v, o->lp.n);
  gw_segments_free(seg, n_seg);
  free(text);
  return q;
}
