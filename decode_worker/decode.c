/* The decode role: reserve blocks for KV that other workers push, admit the
 * request into the continuous batch once it has all arrived (or encode it
 * here), stream tokens back, report the result. */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "worker/internal.h"

static int blocks_for(int tokens, int bs) { return (tokens + bs - 1) / bs; }

void decode_on_job(td_worker *w, Tandem__Cluster__RouterMessage *m) {
  Tandem__Cluster__DecodeJob *dj = m->decode;
  Tandem__Cluster__RequestSpec *sp = dj->req;
  if (!sp || w_draining(w) || !w_opts(w)->decode || w_job_find(w, sp ? sp->rid : 0, ROLE_DECODE)) {
    if (sp) w_send_failed(w, sp->rid, TD_ERR_OVERLOADED, "this worker takes no decode work now", true);
    tandem__cluster__router_message__free_unpacked(m, NULL);
    return;
  }
  job *j = w_job_new(w, sp->rid, ROLE_DECODE, m, sp);
  if (!j) {
    w_send_failed(w, sp->rid, TD_ERR_NOMEM, "out of memory", true);
    tandem__cluster__router_message__free_unpacked(m, NULL);
    return;
  }
  if (dj->local_encode) {
    cmd *c = w_add_cmd(w, j);
    if (!c) {
      w_send_failed(w, j->rid, TD_ERR_INVALID, "bad request data", false);
      w_job_drop(w, j);
      return;
    }
    c->req.enc_len = 0;
    j->added = true;
    w_post(w, c);
    return;
  }
  int bs = w_block_size(w);
  cmd *c = w_cmd(CMD_RESERVE, j->rid, ROLE_DECODE);
  if (!c) return;
  c->n_cross = blocks_for((int)sp->enc_len, bs);
  if (dj->with_prefill && dj->prefill_tokens > 0) {
    j->self_expected = (int)dj->prefill_tokens;
    c->n_self = blocks_for(j->self_expected, bs);
  }
  w_post(w, c);
}

void decode_on_arrival(td_worker *w, job *j) {
  if (j->added || !j->reserved || j->cross_got < j->n_cross) return;
  if (j->self_expected && j->self_got < j->n_self) return;
  cmd *c = w_add_cmd(w, j);
  if (!c) {
    w_send_failed(w, j->rid, TD_ERR_INVALID, "bad request data", false);
    return;
  }
  c->cross_res = j->cross_res;
  c->self_res = j->self_expected ? j->self_res : 0;
  c->req.n_computed = j->self_expected;
  j->added = true;
  w_post(w, c);
}

void decode_on_prefill_result(td_worker *w, Tandem__Cluster__PrefillResult *pr) {
  /* The prompt KV's arrival is what admits the request; this only confirms it. */
  job *j = w_job_find(w, pr->rid, ROLE_DECODE);
  if (j) TD_DEBUG("request %llu: prefill done (%d of %d prompt blocks here)", (unsigned long long)pr->rid, j->self_got,
                  j->n_self);
}

void decode_on_done(td_worker *w, job *j, wev *e) {
  if (e->status == TD_OK) {
    Tandem__Cluster__Finished f = TANDEM__CLUSTER__FINISHED__INIT;
    f.rid = j->rid;
    f.outputs = e->outputs;
    f.n_outputs = (size_t)e->n_outputs;
    f.decode_ms = e->ms;
    Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
    m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FINISHED;
    m.finished = &f;
    w_send(w, &m);
  } else if (e->status != TD_ERR_CANCELLED) {
    /* bad input fails for good; a lost reservation or full pool may fit elsewhere */
    bool retry = e->status != TD_ERR_INVALID && e->status != TD_ERR_UNSUPPORTED;
    w_send_failed(w, j->rid, e->status, e->error ? e->error : "decode failed", retry);
  }
  w_job_drop(w, j);
}
