/* Token streaming, on the main thread: the tokens of a loop turn (a step of
 * every running sequence, or several) go to the router in one message,
 * consecutive tokens of one sequence as one run with the offset of its
 * first token in that sequence (the router puts them in order and resumes
 * a retried request from them); a turn of one sequence sends a plain
 * Tokens message. One message a step, not one a sequence: at 256
 * sequences and ~2 ms a step that is 128,000 messages a second fewer
 * through the router. The counts are this worker's, per (request, sequence). */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

#include "worker/internal.h"

typedef struct tok_key {
  uint64_t rid;
  uint64_t seq;
} tok_key;

struct tokcount {
  tok_key key;
  int n; /* tokens sent */
  UT_hash_handle hh;
};

/* The offset of the next `add` tokens of (rid, seq); counts them as sent. */
static int tok_offset(td_worker *w, uint64_t rid, int seq, int add) {
  tok_key k = {rid, (uint64_t)seq};
  tokcount *t = NULL;
  HASH_FIND(hh, w->tokcounts, &k, sizeof k, t);
  if (!t) {
    t = calloc(1, sizeof *t);
    if (!t) return 0;
    t->key = k;
    HASH_ADD(hh, w->tokcounts, key, sizeof t->key, t);
  }
  int off = t->n;
  t->n += add;
  return off;
}

/* What one message carries at most: a step of every sequence fits. */
#define MAX_RUNS 4096
#define MAX_TOKENS 65536

static void send_tokens(td_worker *w, Tandem__Cluster__Tokens *items, Tandem__Cluster__Tokens **ptrs, int n) {
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  Tandem__Cluster__TokensBatch b = TANDEM__CLUSTER__TOKENS_BATCH__INIT;
  if (n == 1) { /* one sequence: the plain message */
    m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS;
    m.tokens = &items[0];
  } else {
    b.items = ptrs;
    b.n_items = (size_t)n;
    m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS_BATCH;
    m.tokens_batch = &b;
  }
  td_worker_send(w, &m);
}

void w_stream_flush(td_worker *w) {
  int n = 0;
  Tandem__Cluster__Tokens *items = calloc((size_t)(w->out.n_runs ? w->out.n_runs : 1), sizeof *items);
  Tandem__Cluster__Tokens **ptrs = calloc((size_t)(w->out.n_runs ? w->out.n_runs : 1), sizeof *ptrs);
  if (!items || !ptrs) {
    TD_ERROR("out of memory: %d streamed token runs dropped", w->out.n_runs);
  } else {
    for (int i = 0; i < w->out.n_runs; i++) {
      const struct tok_run *r = &w->out.runs[i];
      if (!r->n) continue; /* forgotten */
      Tandem__Cluster__Tokens *t = &items[n];
      tandem__cluster__tokens__init(t);
      t->rid = r->rid;
      t->sequence = (uint32_t)r->seq;
      t->offset = (uint32_t)tok_offset(w, r->rid, r->seq, r->n);
      t->tokens = w->out.tok.v + r->at;
      t->n_tokens = (size_t)r->n;
      t->logprobs = w->out.lp.v + r->at;
      t->n_logprobs = (size_t)r->n;
      ptrs[n++] = t;
    }
    if (n) send_tokens(w, items, ptrs, n);
  }
  free(items);
  free(ptrs);
  w->out.n_runs = w->out.tok.n = w->out.lp.n = 0;
}

void w_stream_token(td_worker *w, uint64_t rid, int seq, int32_t token, float logprob) {
  if (w->out.n_runs >= MAX_RUNS || w->out.tok.n >= MAX_TOKENS) w_stream_flush(w);
  struct tok_run *last = w->out.n_runs ? &w->out.runs[w->out.n_runs - 1] : NULL;
  if (!last || last->rid != rid || last->seq != seq || last->at + last->n != w->out.tok.n) {
    if (w->out.n_runs == w->out.cap_runs) {
      int cap = w->out.cap_runs ? 2 * w->out.cap_runs : 64;
      struct tok_run *g = realloc(w->out.runs, sizeof *g * (size_t)cap);
      if (!g) {
        TD_ERROR("out of memory: a streamed token of request %llu dropped", (unsigned long long)rid);
        return;
      }
      w->out.runs = g;
      w->out.cap_runs = cap;
    }
    last = &w->out.runs[w->out.n_runs++];
    *last = (struct tok_run){.rid = rid, .seq = seq, .at = w->out.tok.n, .n = 0};
  }
  if (td_i32vec_push(&w->out.tok, token) != TD_OK || td_f32vec_push(&w->out.lp, logprob) != TD_OK) {
    TD_ERROR("out of memory: a streamed token of request %llu dropped", (unsigned long long)rid);
    w->out.tok.n = w->out.lp.n = last->at + last->n;
    return;
  }
  last->n++;
}

void w_stream_forget(td_worker *w, uint64_t rid) {
  for (int i = 0; i < w->out.n_runs; i++)
    if (w->out.runs[i].rid == rid) w->out.runs[i].n = 0;
  tokcount *t, *tmp;
  HASH_ITER(hh, w->tokcounts, t, tmp) if (t->key.rid == rid) {
    HASH_DEL(w->tokcounts, t);
    free(t);
  }
}

void w_stream_free(td_worker *w) {
  free(w->out.runs);
  w->out.runs = NULL;
  w->out.n_runs = w->out.cap_runs = 0;
  td_i32vec_free(&w->out.tok);
  td_f32vec_free(&w->out.lp);
  tokcount *t, *tmp;
  HASH_ITER(hh, w->tokcounts, t, tmp) {
    HASH_DEL(w->tokcounts, t);
    free(t);
  }
}
