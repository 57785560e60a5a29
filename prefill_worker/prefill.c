/* The prefill role: reserve cross-attention blocks for the encoder's push,
 * run the decoder prompt once they arrive, and push the prompt's KV into
 * the blocks the decode worker reserved. The decode worker runs the last
 * prompt token itself, so that every decoding method takes its first
 * logits in one place. */
#include <stdlib.h>
#include <string.h>

#include "worker/internal.h"

void prefill_on_job(td_worker *w, Tandem__Cluster__RouterMessage *m) {
  Tandem__Cluster__PrefillJob *pj = m->prefill;
  Tandem__Cluster__RequestSpec *sp = pj->req;
  if (!sp || w_draining(w) || !w_opts(w)->prefill || !pj->self_target || !pj->prefill_tokens ||
      w_job_find(w, sp->rid, ROLE_PREFILL)) {
    if (sp) w_send_failed(w, sp->rid, TD_ERR_OVERLOADED, "this worker takes no prefill work now", true);
    tandem__cluster__router_message__free_unpacked(m, NULL);
    return;
  }
  job *j = w_job_new(w, sp->rid, ROLE_PREFILL, m, sp);
  cmd *c = j ? w_cmd(CMD_RESERVE, sp->rid, ROLE_PREFILL) : NULL;
  if (!c) {
    if (j) w_job_drop(w, j);
    w_send_failed(w, sp->rid, TD_ERR_NOMEM, "out of memory", true);
    return;
  }
  int bs = w_block_size(w);
  c->n_cross = ((int)sp->enc_len + bs - 1) / bs;
  w_post(w, c);
}

void prefill_on_arrival(td_worker *w, job *j) {
  if (j->added || !j->reserved || j->cross_got < j->n_cross) return;
  cmd *c = w_add_cmd(w, j);
  if (!c) {
    w_send_failed(w, j->rid, TD_ERR_INVALID, "bad request data", false);
    return;
  }
  c->cross_res = j->cross_res;
  c->req.prefill_only = (int)j->msg->prefill->prefill_tokens;
  /* only the prompt's KV is made here: how it is decoded does not matter */
  c->req.params.num_beams = c->req.params.n = 1;
  c->req.params.num_return_sequences = 0;
  c->req.params.temperature = 0;
  c->host_copy = w_kv_host_copy(w, &j->msg->prefill->self_target, 1, false);
  j->added = true;
  w_post(w, c);
}

void prefill_on_done(td_worker *w, job *j, wev *e) {
  if (e->status != TD_OK) {
    if (e->status != TD_ERR_CANCELLED)
      w_send_failed(w, j->rid, e->status, e->error ? e->error : "prefill failed",
                    e->status != TD_ERR_INVALID && e->status != TD_ERR_UNSUPPORTED);
    w_job_drop(w, j);
    return;
  }
  j->out_blocks = e->blocks;
  j->n_out = e->n_blocks;
  j->out_cross = false;
  e->blocks = NULL;
  j->out_host = e->host;
  j->out_bb = e->block_bytes;
  e->host = NULL;
  j->compute_ms = e->ms;
  Tandem__Cluster__KvTarget *t = j->msg->prefill->self_target;
  w_push_all(w, j, &t, 1);
}
