/* Token streaming, on the main thread: tokens of roles that stream go to
 * the router as they come, consecutive tokens of one sequence in one
 * message, each message with the offset of its first token in that
 * sequence (the router puts them in order and resumes a retried request
 * from them). The counts are this worker's, per (request, sequence). */
#include <stdlib.h>
#include <string.h>

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

void w_stream_flush(td_worker *w) {
  if (!w->run.n) return;
  Tandem__Cluster__Tokens t = TANDEM__CLUSTER__TOKENS__INIT;
  t.rid = w->run.rid;
  t.sequence = (uint32_t)w->run.seq;
  t.offset = (uint32_t)tok_offset(w, w->run.rid, w->run.seq, w->run.n);
  t.tokens = w->run.tok;
  t.n_tokens = (size_t)w->run.n;
  t.logprobs = w->run.lp;
  t.n_logprobs = (size_t)w->run.n;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS;
  m.tokens = &t;
  td_worker_send(w, &m);
  w->run.n = 0;
}

void w_stream_token(td_worker *w, uint64_t rid, int seq, int32_t token, float logprob) {
  int cap = (int)(sizeof w->run.tok / sizeof w->run.tok[0]);
  if (w->run.n && (w->run.rid != rid || w->run.seq != seq || w->run.n == cap)) w_stream_flush(w);
  w->run.rid = rid;
  w->run.seq = seq;
  w->run.tok[w->run.n] = token;
  w->run.lp[w->run.n] = logprob;
  w->run.n++;
}

void w_stream_forget(td_worker *w, uint64_t rid) {
  if (w->run.n && w->run.rid == rid) w->run.n = 0;
  tokcount *t, *tmp;
  HASH_ITER(hh, w->tokcounts, t, tmp) if (t->key.rid == rid) {
    HASH_DEL(w->tokcounts, t);
    free(t);
  }
}

void w_stream_free(td_worker *w) {
  tokcount *t, *tmp;
  HASH_ITER(hh, w->tokcounts, t, tmp) {
    HASH_DEL(w->tokcounts, t);
    free(t);
  }
}
