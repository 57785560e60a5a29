/* A placed request's progress as its workers report it: the reservations
 * that start the encoder and prefill jobs, the end of each stage, the
 * tokens streamed to the client (offsets continue across attempts) and the
 * result, or a failure that is retried or reported. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "proto/check.h"
#include "router/internal.h"

/* A worker's message about request q breaks a limit (proto/check.c) or
 * disagrees with the request: that attempt ends (its workers are told to
 * let go) and the request gets another elsewhere, or fails naming the
 * message once its attempts are spent. */
static void bad_news(td_router *r, worker *w, rreq *q, const char *what) {
  char msg[600];
  snprintf(msg, sizeof msg, "worker %s sent an invalid message: %s", w->id, what);
  TD_LOG_ABOUT(q->cid, TD_WARN, "request %s (rid %llu): %s", q->cid, (unsigned long long)q->rid, msg);
  if (!strcmp(w->id, q->dec_w)) snprintf(q->avoid_dec, sizeof q->avoid_dec, "%s", w->id);
  rtr_req_retry(r, q, msg);
}

static int cmp_i32(const void *a, const void *b) {
  int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  return (x > y) - (x < y);
}

/* A reservation against what the request needs of it: the worker's own id,
 * its block count for the tokens, ids inside its pool, each once. */
static bool target_ok(const char *name, const Tandem__Cluster__KvTarget *t, const worker *w, int bs, int tokens,
                      int pool, char *why, size_t cap) {
  int want = (tokens + bs - 1) / bs;
  if (strcmp(t->worker_id, w->id)) {
    snprintf(why, cap, "%s.worker_id %s is not the worker that reserved (%s)", name, t->worker_id, w->id);
    return false;
  }
  if (t->tokens != (uint32_t)tokens || t->n_blocks != (size_t)want) {
    snprintf(why, cap, "%s holds %zu blocks for %u tokens, the request needs %d blocks for %d", name, t->n_blocks,
             t->tokens, want, tokens);
    return false;
  }
  int32_t *sorted = malloc(sizeof *sorted * t->n_blocks);
  if (!sorted) {
    snprintf(why, cap, "out of memory");
    return false;
  }
  memcpy(sorted, t->blocks, sizeof *sorted * t->n_blocks);
  qsort(sorted, t->n_blocks, sizeof *sorted, cmp_i32);
  bool ok = true;
  for (size_t i = 0; i < t->n_blocks && ok; i++) {
    if (sorted[i] >= pool) {
      snprintf(why, cap, "%s.blocks holds block %d, the worker registered %d", name, sorted[i], pool);
      ok = false;
    } else if (i && sorted[i] == sorted[i - 1]) {
      snprintf(why, cap, "%s.blocks holds block %d twice", name, sorted[i]);
      ok = false;
    }
  }
  free(sorted);
  return ok;
}

/* The decode worker reserves the cross KV and, with a prefill worker, the
 * prompt KV but its last token; a prefill worker the cross KV only. */
static bool reservation_ok(const td_router *r, const rreq *q, const worker *w, const Tandem__Cluster__Reserved *res,
                           bool from_dec, char *why, size_t cap) {
  if (!target_ok("Reserved.cross", res->cross, w, r->block_size, q->sh.enc_len, w->pl.cross_blocks, why, cap))
    return false;
  bool want_self = from_dec && q->with_prefill;
  if (!want_self && res->self) {
    snprintf(why, cap, "Reserved.self for a request whose prompt KV is not pushed there");
    return false;
  }
  if (!want_self) return true;
  if (!res->self) {
    snprintf(why, cap, "no Reserved.self for the prompt KV the prefill worker sends");
    return false;
  }
  int prefill = q->sh.n_prompt + (q->multi ? 0 : q->streamed.n) - 1;
  return target_ok("Reserved.self", res->self, w, r->block_size, prefill, w->self_blocks, why, cap);
}

static void on_reserved(td_router *r, worker *w, Tandem__Cluster__WorkerMessage *m) {
  Tandem__Cluster__Reserved *res = m->reserved;
  rreq *q = rtr_req_for(r, res->rid, w);
  if (!q || q->st != ST_RESERVING) return;
  bool from_dec = !strcmp(w->id, q->dec_w), from_pre = q->with_prefill && !strcmp(w->id, q->pre_w);
  if (!from_dec && !from_pre) return;
  char why[320];
  if (!reservation_ok(r, q, w, res, from_dec, why, sizeof why)) {
    bad_news(r, w, q, why);
    return;
  }
  /* keep the reservation: detach it from the message */
  Tandem__Cluster__Reserved **slot = from_dec ? &q->dres : &q->pres;
  if (from_dec) q->t_reserved = td_now_ms();
  if (*slot) tandem__cluster__reserved__free_unpacked(*slot, NULL);
  *slot = res;
  m->reserved = NULL;
  m->body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY__NOT_SET;
  /* with a prefill worker, it reserves next (its job names the decode worker's
   * self blocks); the encoder goes once every cross target is known */
  if (from_dec && q->with_prefill)
    rtr_send_prefill(r, q);
  else
    rtr_send_encode(r, q);
}

static void on_encode_done(td_router *r, worker *w, const Tandem__Cluster__EncodeDone *done) {
  rreq *q = rtr_req_for(r, done->rid, w);
  if (!q || strcmp(w->id, q->enc_w)) return;
  q->encoded = true;
  q->encode_ms = done->ms;
  q->t_encoded = td_now_ms();
  rtr_role_done(r, q, RTR_ENCODE);
  rtr_mark_decoding(r, q);
  q->st = q->with_prefill && !q->prefilled ? ST_PREFILLING : ST_DECODING;
  q->t_stage = td_now_ms();
}

static void on_prefill_done(td_router *r, worker *w, const Tandem__Cluster__PrefillDone *done) {
  rreq *q = rtr_req_for(r, done->rid, w);
  if (!q || !q->with_prefill || strcmp(w->id, q->pre_w)) return;
  q->prefilled = true;
  q->prefill_ms = done->ms;
  rtr_role_done(r, q, RTR_PREFILL);
  worker *d = rtr_find_worker(r, q->dec_w);
  Tandem__Cluster__PrefillResult pr = TANDEM__CLUSTER__PREFILL_RESULT__INIT;
  pr.rid = q->rid;
  pr.first_token = done->first_token;
  pr.first_logprob = done->first_logprob;
  Tandem__Cluster__RouterMessage rm = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  rm.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL_RESULT;
  rm.prefill_result = &pr;
  if (d) (void)rtr_send_worker(r, d, &rm);
  q->st = ST_DECODING;
  q->t_stage = td_now_ms();
}

/* Keeps a chunk for flush_chunks; false (send it now) when out of memory. */
static bool hold_chunk(td_router *r, const rreq *q, const Tandem__TokenChunk *c, char *text) {
  if (r->n_outbox == r->cap_outbox) {
    int cap = r->cap_outbox ? 2 * r->cap_outbox : 64;
    chunk_out *g = realloc(r->outbox, sizeof *g * (size_t)cap);
    if (!g) return false;
    r->outbox = g;
    r->cap_outbox = cap;
  }
  char *cid = strdup(q->cid); /* the request may end before the flush */
  if (!cid) return false;
  chunk_out *o = &r->outbox[r->n_outbox++];
  memcpy(o->client, q->client, q->client_len);
  o->client_len = q->client_len;
  o->cid = cid;
  o->text = text;
  o->chunk = *c;
  return true;
}

/* Sends the held chunks: one message a client (a plain chunk when it has one). */
static void flush_chunks(td_router *r) {
  int n = r->n_outbox;
  bool *sent = calloc((size_t)(n ? n : 1), sizeof *sent);
  Tandem__RequestChunk *items = calloc((size_t)(n ? n : 1), sizeof *items);
  Tandem__RequestChunk **ptrs = calloc((size_t)(n ? n : 1), sizeof *ptrs);
  for (int i = 0; i < n; i++) {
    if (sent && sent[i]) continue;
    chunk_out *o = &r->outbox[i];
    int k = 0;
    for (int j = i; j < n && items && ptrs && sent; j++) {
      chunk_out *p = &r->outbox[j];
      if (sent[j] || p->client_len != o->client_len || memcmp(p->client, o->client, o->client_len)) continue;
      sent[j] = true;
      tandem__request_chunk__init(&items[k]);
      items[k].request_id = p->cid;
      items[k].chunk = &p->chunk;
      ptrs[k] = &items[k];
      k++;
    }
    Tandem__ServerMessage sm = TANDEM__SERVER_MESSAGE__INIT;
    Tandem__ChunkBatch cb = TANDEM__CHUNK_BATCH__INIT;
    if (k > 1) {
      cb.items = ptrs;
      cb.n_items = (size_t)k;
      sm.request_id = "";
      sm.body_case = TANDEM__SERVER_MESSAGE__BODY_CHUNKS;
      sm.chunks = &cb;
    } else { /* one chunk, or no memory to group: each on its own */
      sm.request_id = o->cid;
      sm.body_case = TANDEM__SERVER_MESSAGE__BODY_TOKENS;
      sm.tokens = &o->chunk;
    }
    rtr_send_client(r, o->client, o->client_len, &sm);
  }
  for (int i = 0; i < n; i++) {
    free(r->outbox[i].cid);
    free(r->outbox[i].text);
  }
  free(sent);
  free(items);
  free(ptrs);
  r->n_outbox = 0;
}

static void on_tokens(td_router *r, worker *w, const Tandem__Cluster__Tokens *t) {
  rreq *q = rtr_req_for(r, t->rid, w);
  if (!q || strcmp(w->id, q->dec_w)) return;
  char why[200];
  if (q->multi ? t->sequence >= (uint32_t)q->sh.width : q->streamed.n + t->n_tokens > (size_t)q->sh.max_new) {
    if (q->multi)
      snprintf(why, sizeof why, "Tokens.sequence %u of a request of %d sequences", t->sequence, q->sh.width);
    else
      snprintf(why, sizeof why, "Tokens: %zu tokens after %d, past max_new_tokens %d", t->n_tokens, q->streamed.n,
               q->sh.max_new);
    bad_news(r, w, q, why);
    return;
  }
  if (q->st < ST_DECODING) q->st = ST_DECODING;
  if (q->detecting) return; /* the language token is the router's, not the client's */
  if (!q->t_first_ns && t->n_tokens) q->t_first_ns = td_now_ns();
  if (t->n_tokens) {
    rtr_local_encode_done(r, q);
    rtr_mark_decoding(r, q);
  }
  /* A single sequence's tokens are kept so that another worker can resume
   * it; its offsets continue across attempts. */
  uint32_t off = t->offset;
  if (!q->multi) {
    off = (uint32_t)q->streamed.n;
    for (size_t i = 0; i < t->n_tokens; i++)
      if (td_i32vec_push(&q->streamed, t->tokens[i]) != TD_OK ||
          td_f32vec_push(&q->streamed_lp, i < t->n_logprobs ? t->logprobs[i] : 0.0f) != TD_OK) {
        rtr_req_fail(r, q, TANDEM__ERROR_CODE__ERROR_INTERNAL, "out of memory");
        return;
      }
  }
  if (!q->g->stream) return;
  Tandem__TokenChunk c = TANDEM__TOKEN_CHUNK__INIT;
  c.sequence = t->sequence;
  c.offset = off;
  c.tokens = t->tokens;
  c.n_tokens = t->n_tokens;
  c.logprobs = t->logprobs;
  c.n_logprobs = q->g->sampling && q->g->sampling->logprobs ? t->n_logprobs : 0;
  char *text = rtr_stream_text(r, q, t->sequence, t->tokens, t->n_tokens);
  if (text) {
    c.text = text;
    c.has_text = true;
  }
  if (r->batching && hold_chunk(r, q, &c, text)) return;
  Tandem__ServerMessage sm = TANDEM__SERVER_MESSAGE__INIT;
  sm.request_id = q->cid;
  sm.body_case = TANDEM__SERVER_MESSAGE__BODY_TOKENS;
  sm.tokens = &c;
  rtr_send_client(r, q->client, q->client_len, &sm);
  free(text);
}

void rtr_req_result(td_router *r, rreq *q, Tandem__SequenceOutput **outs, size_t n_out, double decode_ms,
                    double worker_first_ms) {
  if (q->detecting) {
    rtr_detect_done(r, q, outs, n_out);
    return;
  }
  /* copies: the text set on them is ours, the worker's message keeps its own */
  Tandem__SequenceOutput *copies = calloc(n_out ? n_out : 1, sizeof *copies);
  Tandem__SequenceOutput **ptrs = calloc(n_out ? n_out : 1, sizeof *ptrs);
  if (!copies || !ptrs) {
    free(copies);
    free(ptrs);
    rtr_req_fail(r, q, TANDEM__ERROR_CODE__ERROR_INTERNAL, "out of memory");
    return;
  }
  for (size_t i = 0; i < n_out; i++) {
    copies[i] = *outs[i];
    ptrs[i] = &copies[i];
  }
  /* a resumed sequence: earlier attempts' tokens come first */
  int prior = !q->multi && n_out ? q->streamed.n - (int)outs[0]->n_tokens : 0;
  bool want_lp = q->g->sampling && q->g->sampling->logprobs;
  if (prior > 0) {
    copies[0].tokens = q->streamed.v;
    copies[0].n_tokens = (size_t)q->streamed.n;
    copies[0].logprobs = want_lp ? q->streamed_lp.v : NULL;
    copies[0].n_logprobs = want_lp ? (size_t)q->streamed_lp.n : 0;
  }
  outs = ptrs;
  rtr_result_extras extras;
  rtr_result_text(r, q, outs, n_out, &extras);
  if (q->g->stream) rtr_stream_text_finish(r, q);
  Tandem__Timings tm = TANDEM__TIMINGS__INIT;
  const int64_t placed_ms = q->t_placed_ns / 1000000;
  tm.queue_ms = (double)(placed_ms - q->t_arrival);
  tm.encode_ms = q->encode_ms;
  tm.prefill_ms = q->prefill_ms;
  tm.decode_ms = decode_ms;
  tm.total_ms = (double)(td_now_ms() - q->t_arrival);
  if (q->t_reserved) tm.reserve_ms = (double)(q->t_reserved - placed_ms);
  if (q->t_encode_sent && q->t_encoded) {
    double wait_push = (double)(q->t_encoded - q->t_encode_sent) - q->encode_ms;
    tm.transfer_ms = wait_push > 0 ? wait_push : 0;
  }
  if (q->t_first_ns) tm.first_token_ms = (double)(q->t_first_ns - q->t_placed_ns) / 1e6;
  /* the decode worker's part of it, never more than the whole (a report is the worker's word); only where
   * that worker's first token was the request's: one attempt, no prefill worker sampling it */
  if (q->t_first_ns && worker_first_ms > 0 && q->attempts == 1 && q->prefill_ms <= 0)
    tm.worker_first_token_ms = worker_first_ms < tm.first_token_ms ? worker_first_ms : tm.first_token_ms;
  tm.attempts = (uint32_t)q->attempts;
  Tandem__GenerateResult gr = TANDEM__GENERATE_RESULT__INIT;
  gr.outputs = outs;
  gr.n_outputs = n_out;
  gr.timings = &tm;
  Tandem__ServerMessage sm = TANDEM__SERVER_MESSAGE__INIT;
  sm.request_id = q->cid;
  sm.body_case = TANDEM__SERVER_MESSAGE__BODY_RESULT;
  sm.result = &gr;
  rtr_send_client(r, q->client, q->client_len, &sm);
  rtr_metrics_result(r, q, outs, n_out, &tm);
  TD_LOG_ABOUT(q->cid, TD_DEBUG, "request %s done in %.0f ms (attempts %d)", q->cid, tm.total_ms, q->attempts);
  rtr_result_extras_free(&extras, outs);
  free(ptrs);
  free(copies);
  rtr_req_free(r, q);
}

static void on_finished(td_router *r, worker *w, const Tandem__Cluster__Finished *fin) {
  rreq *q = rtr_req_for(r, fin->rid, w);
  if (!q || strcmp(w->id, q->dec_w)) return;
  char why[200] = "";
  if (fin->n_outputs > (size_t)q->sh.width)
    snprintf(why, sizeof why, "Finished.outputs holds %zu sequences, the request runs %d", fin->n_outputs, q->sh.width);
  for (size_t k = 0; k < fin->n_outputs && !why[0]; k++)
    if (fin->outputs[k]->n_tokens > (size_t)q->sh.max_new)
      snprintf(why, sizeof why, "Finished.outputs[%zu] holds %zu tokens, past max_new_tokens %d", k,
               fin->outputs[k]->n_tokens, q->sh.max_new);
  if (why[0]) {
    bad_news(r, w, q, why);
    return;
  }
  rtr_req_result(r, q, fin->outputs, fin->n_outputs, fin->decode_ms, fin->first_token_ms);
}

static void on_failed(td_router *r, worker *w, const Tandem__Cluster__Failed *f) {
  rreq *q = rtr_req_for(r, f->rid, w);
  if (!q) return;
  /* only a worker the request was placed on may end it */
  if (strcmp(w->id, q->dec_w) && strcmp(w->id, q->enc_w) && strcmp(w->id, q->pre_w)) {
    TD_WARN("worker %s: dropped a Failed for request %s, which it does not hold", w->id, q->cid);
    return;
  }
  const char *msg = f->message ? f->message : "worker error";
  if (f->retryable && !strcmp(w->id, q->dec_w)) snprintf(q->avoid_dec, sizeof q->avoid_dec, "%s", w->id);
  if (f->retryable && rtr_req_kv_loading(q))
    rtr_req_kv_failed(r, q, msg);
  else if (f->retryable)
    rtr_req_retry(r, q, msg);
  else
    rtr_req_fail(r, q, f->code ? f->code : TANDEM__ERROR_CODE__ERROR_INTERNAL, msg);
}

/* The request a worker's message is about (0: none). */
static uint64_t rid_of(const Tandem__Cluster__WorkerMessage *m) {
  switch (m->body_case) {
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED: return m->reserved->rid;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_ENCODE_DONE: return m->encode_done->rid;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_PREFILL_DONE: return m->prefill_done->rid;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS: return m->tokens->rid;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FINISHED: return m->finished->rid;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED: return m->failed->rid;
    default: return 0;
  }
}

/* A message that breaks a field's limit: dropped, and the request it is
 * about (when this worker works on it) gets another attempt. */
static void invalid(td_router *r, worker *w, uint64_t rid, const char *why) {
  rreq *q = rid ? rtr_req_for(r, rid, w) : NULL;
  if (q && (!strcmp(w->id, q->dec_w) || !strcmp(w->id, q->enc_w) || !strcmp(w->id, q->pre_w)))
    bad_news(r, w, q, why);
  else
    TD_WARN("worker %s: dropped an invalid message: %s", w->id, why);
}

void rtr_on_progress(td_router *r, worker *w, Tandem__Cluster__WorkerMessage *m) {
  int vocab = r->have_model ? (int)r->model.vocab_size : 0;
  char why[320];
  if (m->body_case != TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS_BATCH &&
      !td_check_worker_message(m, vocab, why, sizeof why)) {
    invalid(r, w, rid_of(m), why);
    return;
  }
  switch (m->body_case) {
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED: on_reserved(r, w, m); break;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_ENCODE_DONE: on_encode_done(r, w, m->encode_done); break;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_PREFILL_DONE: on_prefill_done(r, w, m->prefill_done); break;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS: on_tokens(r, w, m->tokens); break;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS_BATCH:
      r->batching = true;
      for (size_t i = 0; i < m->tokens_batch->n_items; i++) {
        const Tandem__Cluster__Tokens *t = m->tokens_batch->items[i];
        char name[48];
        snprintf(name, sizeof name, "TokensBatch.items[%zu]", i);
        if (td_check_tokens(name, t, vocab, why, sizeof why))
          on_tokens(r, w, t);
        else
          invalid(r, w, t ? t->rid : 0, why);
      }
      r->batching = false;
      flush_chunks(r);
      break;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FINISHED: on_finished(r, w, m->finished); break;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED: on_failed(r, w, m->failed); break;
    default: break;
  }
}
