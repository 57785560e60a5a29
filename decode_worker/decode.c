/* The decode role: reserve blocks for KV that other workers push, admit the
 * request into the continuous batch once it has all arrived (or encode it
 * here), stream tokens back (the runtime does, as the table says), report
 * the result. */
#include "decode_worker/decode.h"

#include "common/log.h"

static void decode_job(td_worker *w, Tandem__Cluster__RouterMessage *m) {
  const Tandem__Cluster__DecodeJob *dj = m->decode;
  td_job *j = td_job_take(w, &td_role_decode, m, dj->req, true);
  if (!j) return;
  td_status s;
  if (dj->local_encode) {
    td_job_run run = {.reserved_kv = false};
    s = td_job_run_request(w, j, &run);
  } else {
    int prompt = dj->with_prefill && dj->prefill_tokens > 0 ? (int)dj->prefill_tokens : 0;
    s = td_job_reserve(w, j, (int)dj->req->enc_len, prompt, dj->cross_from, dj->self_from);
  }
  if (s != TD_OK) td_job_fail(w, j, s, td_errmsg());
}

static void decode_arrival(td_worker *w, td_job *j) {
  if (!td_job_kv_ready(j)) return;
  td_job_run run = {.reserved_kv = true};
  td_status s = td_job_run_request(w, j, &run);
  if (s != TD_OK) td_job_fail(w, j, s, td_errmsg());
}

/* The prompt KV's arrival is what admits the request; this only confirms it. */
static void decode_prefill_result(td_worker *w, const Tandem__Cluster__RouterMessage *m) {
  const Tandem__Cluster__PrefillResult *pr = m->prefill_result;
  if (td_job_find(w, pr->rid, &td_role_decode))
    TD_DEBUG("request %llu: prefill done", (unsigned long long)pr->rid);
}

static void decode_done(td_worker *w, td_job *j, const td_done *d) {
  Tandem__Cluster__Finished f = TANDEM__CLUSTER__FINISHED__INIT;
  f.rid = td_job_rid(j);
  f.outputs = d->outputs;
  f.n_outputs = (size_t)d->n_outputs;
  f.decode_ms = d->ms;
  f.first_token_ms = d->first_ms;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FINISHED;
  m.finished = &f;
  td_worker_send(w, &m);
  td_job_end(w, j);
}

const td_role td_role_decode = {
    .name = "decode",
    .id = TANDEM__CLUSTER__ROLE__ROLE_DECODE,
    .job = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE,
    .streams = true,
    .hands_over = TD_POOL_NONE,
    .self_kv = true,
    .in_group = true,
    .on_job = decode_job,
    .on_arrival = decode_arrival,
    .on_done = decode_done,
    .notice = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL_RESULT,
    .on_notice = decode_prefill_result,
};
