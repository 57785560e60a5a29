/* The prefill role: reserve cross-attention blocks for the encoder's push,
 * run the decoder prompt once they arrive, and push the prompt's KV into
 * the blocks the decode worker reserved. The decode worker runs the last
 * prompt token itself, so that every decoding method takes its first
 * logits in one place. */
#include "prefill_worker/prefill.h"

static void prefill_job(td_worker *w, Tandem__Cluster__RouterMessage *m) {
  const Tandem__Cluster__PrefillJob *pj = m->prefill;
  td_job *j = td_job_take(w, &td_role_prefill, m, pj->req, pj->self_target && pj->prefill_tokens);
  if (!j) return;
  td_status s = td_job_reserve(w, j, (int)pj->req->enc_len, 0, pj->cross_from, NULL);
  if (s != TD_OK) td_job_fail(w, j, s, td_errmsg());
}

/* Only the prompt's KV is made here: how it is decoded does not matter. */
static void one_greedy_sequence(td_request *r) {
  r->params.num_beams = r->params.n = 1;
  r->params.num_return_sequences = 0;
  r->params.temperature = 0;
}

static void prefill_arrival(td_worker *w, td_job *j) {
  if (!td_job_kv_ready(j)) return;
  const Tandem__Cluster__PrefillJob *pj = td_job_msg(j)->prefill;
  td_job_run run = {.reserved_kv = true, .prefill_tokens = (int)pj->prefill_tokens,
                    .push_to = &pj->self_target, .n_push_to = 1, .adjust = one_greedy_sequence};
  td_status s = td_job_run_request(w, j, &run);
  if (s != TD_OK) td_job_fail(w, j, s, td_errmsg());
}

static void prefill_done(td_worker *w, td_job *j, const td_done *d) {
  const Tandem__Cluster__PrefillJob *pj = td_job_msg(j)->prefill;
  td_job_push(w, j, &pj->self_target, 1);
}

static void prefill_pushed(td_worker *w, td_job *j, const char *error) {
  if (error) {
    td_job_fail(w, j, TD_ERR_PEER, error);
    return;
  }
  Tandem__Cluster__PrefillDone d = TANDEM__CLUSTER__PREFILL_DONE__INIT;
  d.rid = td_job_rid(j);
  d.first_token = -1;
  d.ms = td_job_compute_ms(j);
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_PREFILL_DONE;
  m.prefill_done = &d;
  td_worker_send(w, &m);
  td_job_end(w, j);
}

const td_role td_role_prefill = {
    .name = "prefill",
    .id = TANDEM__CLUSTER__ROLE__ROLE_PREFILL,
    .job = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL,
    .streams = false,
    .hands_over = TD_POOL_SELF,
    .self_kv = true,
    .in_group = false,
    .on_job = prefill_job,
    .on_arrival = prefill_arrival,
    .on_done = prefill_done,
    .on_pushed = prefill_pushed,
};
