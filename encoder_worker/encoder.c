/* The encode role: batch encoder work across requests (the engine's encode
 * phase), then push each request's cross-attention KV into the blocks its
 * decode (and prefill) workers reserved, and tell the router. */
#include "encoder_worker/encoder.h"

static void encode_job(td_worker *w, Tandem__Cluster__RouterMessage *m) {
  const Tandem__Cluster__EncodeJob *ej = m->encode;
  td_job *j = td_job_take(w, &td_role_encode, m, ej->req, ej->n_targets > 0);
  if (!j) return;
  td_job_run run = {.encode_only = true, .push_to = ej->targets, .n_push_to = ej->n_targets};
  td_status s = td_job_run_request(w, j, &run);
  if (s != TD_OK) td_job_fail(w, j, s, td_errmsg());
}

static void encode_done(td_worker *w, td_job *j, const td_done *d) {
  const Tandem__Cluster__EncodeJob *ej = td_job_msg(j)->encode;
  td_job_push(w, j, ej->targets, ej->n_targets);
}

static void encode_pushed(td_worker *w, td_job *j, const char *error) {
  if (error) {
    td_job_fail(w, j, TD_ERR_PEER, error);
    return;
  }
  Tandem__Cluster__EncodeDone d = TANDEM__CLUSTER__ENCODE_DONE__INIT;
  d.rid = td_job_rid(j);
  d.ms = td_job_compute_ms(j);
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_ENCODE_DONE;
  m.encode_done = &d;
  td_worker_send(w, &m);
  td_job_end(w, j);
}

const td_role td_role_encode = {
    .name = "encode",
    .id = TANDEM__CLUSTER__ROLE__ROLE_ENCODE,
    .job = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE,
    .streams = false,
    .hands_over = TD_POOL_CROSS,
    .self_kv = false,
    .in_group = false,
    .group_self = true,
    .on_job = encode_job,
    .on_done = encode_done,
    .on_pushed = encode_pushed,
};
