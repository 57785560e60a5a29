/* The encoder role: batch encoder work across requests (the engine's encode
 * phase), then push each request's cross-attention KV into the blocks its
 * decode (and prefill) workers reserved. */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "worker/internal.h"

void encoder_on_job(td_worker *w, Tandem__Cluster__RouterMessage *m) {
  Tandem__Cluster__EncodeJob *ej = m->encode;
  Tandem__Cluster__RequestSpec *sp = ej->req;
  if (!sp || w_draining(w) || !w_opts(w)->encode || !ej->n_targets || w_job_find(w, sp->rid, ROLE_ENCODE)) {
    if (sp) w_send_failed(w, sp->rid, TD_ERR_OVERLOADED, "this worker takes no encode work now", true);
    tandem__cluster__router_message__free_unpacked(m, NULL);
    return;
  }
  job *j = w_job_new(w, sp->rid, ROLE_ENCODE, m, sp);
  cmd *c = j ? w_add_cmd(w, j) : NULL;
  if (!c) {
    w_send_failed(w, sp->rid, TD_ERR_INVALID, "bad request data", false);
    if (j)
      w_job_drop(w, j);
    else
      tandem__cluster__router_message__free_unpacked(m, NULL);
    return;
  }
  c->req.encode_only = true;
  c->req.enc_len = 0;
  c->host_copy = w_kv_host_copy(w, ej->targets, ej->n_targets, true);
  j->added = true;
  w_post(w, c);
}

void encoder_on_done(td_worker *w, job *j, wev *e) {
  if (e->status != TD_OK) {
    if (e->status != TD_ERR_CANCELLED)
      w_send_failed(w, j->rid, e->status, e->error ? e->error : "encode failed",
                    e->status != TD_ERR_INVALID && e->status != TD_ERR_UNSUPPORTED);
    w_job_drop(w, j);
    return;
  }
  j->out_blocks = e->blocks;
  j->n_out = e->n_blocks;
  j->out_cross = true;
  e->blocks = NULL;
  j->out_host = e->host;
  j->out_bb = e->block_bytes;
  e->host = NULL;
  j->compute_ms = e->ms;
  w_push_all(w, j, j->msg->encode->targets, j->msg->encode->n_targets);
}

