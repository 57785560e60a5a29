/* The role tables (encoder_worker/, prefill_worker/, decode_worker/) against
 * a fake runtime: this file implements worker/role.h and records what the
 * roles ask of it. Every role reports a job it cannot go on with (a
 * refused reservation, a request the engine cannot take, a failed push)
 * to the router and ends it, the same way. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "decode_worker/decode.h"
#include "encoder_worker/encoder.h"
#include "prefill_worker/prefill.h"

/* ---------------------------------------------------------------- fake runtime */

struct td_job {
  uint64_t rid;
  Tandem__Cluster__RouterMessage *m;
  const Tandem__Cluster__RequestSpec *spec;
};

static struct {
  int taken, refused, ended, failed, reserves, runs, pushes, sent;
  td_status fail_code;
  char fail_msg[256];
  int cross_tokens, self_tokens;
  td_job_run run;
  td_request adjusted;
  Tandem__Cluster__KvTarget *const *push_to;
  size_t n_push_to;
  Tandem__Cluster__WorkerMessage__BodyCase sent_body;
  uint64_t sent_rid;
  td_status reserve_result, run_result;
  const Tandem__Cluster__KvSender *cross_from, *self_from; /* what the role named for its reservations */
  bool kv_ready;
  td_job *job;
} rt;

static void rt_reset(void) {
  memset(&rt, 0, sizeof rt);
}

td_job *td_job_take(td_worker *w, const td_role *r, Tandem__Cluster__RouterMessage *m,
                    const Tandem__Cluster__RequestSpec *spec, bool well_formed) {
  if (!spec || !well_formed) {
    rt.refused++;
    return NULL; /* m is the test's */
  }
  td_job *j = calloc(1, sizeof *j);
  j->rid = spec->rid;
  j->m = m;
  j->spec = spec;
  rt.taken++;
  rt.job = j;
  return j;
}

td_job *td_job_find(td_worker *w, uint64_t rid, const td_role *r) { return rt.job && rt.job->rid == rid ? rt.job : NULL; }
uint64_t td_job_rid(const td_job *j) { return j->rid; }
const Tandem__Cluster__RouterMessage *td_job_msg(const td_job *j) { return j->m; }
const Tandem__Cluster__RequestSpec *td_job_spec(const td_job *j) { return j->spec; }
double td_job_compute_ms(const td_job *j) { return 1.5; }

void td_job_end(td_worker *w, td_job *j) {
  rt.ended++;
  if (rt.job == j) rt.job = NULL;
  free(j);
}

void td_job_fail(td_worker *w, td_job *j, td_status code, const char *msg) {
  rt.failed++;
  rt.fail_code = code;
  snprintf(rt.fail_msg, sizeof rt.fail_msg, "%s", msg ? msg : "");
  td_job_end(w, j);
}

td_status td_job_reserve(td_worker *w, td_job *j, int cross_tokens, int self_tokens,
                         const Tandem__Cluster__KvSender *cross_from, const Tandem__Cluster__KvSender *self_from) {
  rt.reserves++;
  rt.cross_tokens = cross_tokens;
  rt.self_tokens = self_tokens;
  rt.cross_from = cross_from;
  rt.self_from = self_from;
  return rt.reserve_result == TD_OK ? TD_OK : td_err(rt.reserve_result, "no room for the reservation");
}

bool td_job_kv_ready(const td_job *j) { return rt.kv_ready; }

td_status td_job_run_request(td_worker *w, td_job *j, const td_job_run *run) {
  rt.runs++;
  rt.run = *run;
  if (run->adjust) {
    td_request_params_default(&rt.adjusted.params);
    rt.adjusted.params.n = 4;
    rt.adjusted.params.num_beams = 3;
    rt.adjusted.params.temperature = 0.7f;
    run->adjust(&rt.adjusted);
  }
  return rt.run_result == TD_OK ? TD_OK : td_err(rt.run_result, "the engine cannot take it");
}

void td_job_push(td_worker *w, td_job *j, Tandem__Cluster__KvTarget *const *targets, size_t n_targets) {
  rt.pushes++;
  rt.push_to = targets;
  rt.n_push_to = n_targets;
}

void td_worker_send(td_worker *w, Tandem__Cluster__WorkerMessage *m) {
  rt.sent++;
  rt.sent_body = m->body_case;
  if (m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_ENCODE_DONE) rt.sent_rid = m->encode_done->rid;
  if (m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_PREFILL_DONE) rt.sent_rid = m->prefill_done->rid;
  if (m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FINISHED) rt.sent_rid = m->finished->rid;
}

void td_worker_send_failed(td_worker *w, uint64_t rid, td_status code, const char *msg, bool retryable) {
  cr_assert_fail("roles report failures through td_job_fail");
}

bool td_worker_draining(const td_worker *w) { return false; }

/* ---------------------------------------------------------------- messages */

typedef struct msgs {
  Tandem__Cluster__RouterMessage m;
  Tandem__Cluster__RequestSpec spec;
  Tandem__Cluster__DecodeJob dj;
  Tandem__Cluster__PrefillJob pj;
  Tandem__Cluster__EncodeJob ej;
  Tandem__Cluster__KvTarget target;
  Tandem__Cluster__KvTarget *targets[1];
  Tandem__Cluster__KvSender from_enc, from_pre;
} msgs;

static void msgs_init(msgs *x, Tandem__Cluster__RouterMessage__BodyCase body, uint64_t rid) {
  memset(x, 0, sizeof *x);
  tandem__cluster__router_message__init(&x->m);
  tandem__cluster__request_spec__init(&x->spec);
  tandem__cluster__decode_job__init(&x->dj);
  tandem__cluster__prefill_job__init(&x->pj);
  tandem__cluster__encode_job__init(&x->ej);
  tandem__cluster__kv_target__init(&x->target);
  x->spec.rid = rid;
  x->spec.enc_len = 40;
  x->targets[0] = &x->target;
  x->m.body_case = body;
  x->dj.req = x->pj.req = x->ej.req = &x->spec;
  x->m.decode = &x->dj;
  if (body == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL) x->m.prefill = &x->pj;
  if (body == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE) x->m.encode = &x->ej;
  x->pj.self_target = &x->target;
  x->pj.prefill_tokens = 20;
  x->ej.targets = x->targets;
  x->ej.n_targets = 1;
  tandem__cluster__kv_sender__init(&x->from_enc);
  tandem__cluster__kv_sender__init(&x->from_pre);
  x->from_enc.worker_id = "encoder-0";
  x->from_pre.worker_id = "prefill-0";
  x->dj.cross_from = x->pj.cross_from = &x->from_enc;
  x->dj.self_from = &x->from_pre;
}

static const td_done done_ok = {.ms = 2.0};

/* ---------------------------------------------------------------- the tables */

Test(worker_roles, tables_say_what_the_runtime_needs) {
  cr_expect_str_eq(td_role_encode.name, "encode");
  cr_expect_str_eq(td_role_prefill.name, "prefill");
  cr_expect_str_eq(td_role_decode.name, "decode");
  cr_expect_eq(td_role_encode.job, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE);
  cr_expect_eq(td_role_prefill.job, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL);
  cr_expect_eq(td_role_decode.job, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE);
  cr_expect_eq(td_role_encode.hands_over, TD_POOL_CROSS);
  cr_expect_eq(td_role_prefill.hands_over, TD_POOL_SELF);
  cr_expect_eq(td_role_decode.hands_over, TD_POOL_NONE);
  cr_expect(td_role_decode.streams && !td_role_encode.streams && !td_role_prefill.streams);
  cr_expect(td_role_decode.in_group && !td_role_encode.in_group && !td_role_prefill.in_group);
  cr_expect(!td_role_encode.self_kv && td_role_prefill.self_kv && td_role_decode.self_kv);
  cr_expect(td_role_encode.on_pushed && td_role_prefill.on_pushed && !td_role_decode.on_pushed);
  cr_expect(!td_role_encode.on_arrival && td_role_prefill.on_arrival && td_role_decode.on_arrival);
  cr_expect_eq(td_role_decode.notice, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL_RESULT);
}

/* ---------------------------------------------------------------- decode */

Test(worker_roles, decode_reports_a_refused_reservation) {
  rt_reset();
  rt.reserve_result = TD_ERR_NOMEM;
  msgs x;
  msgs_init(&x, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, 7);
  td_role_decode.on_job(NULL, &x.m);
  cr_expect_eq(rt.reserves, 1);
  cr_expect_eq(rt.failed, 1, "the refused reservation was not reported");
  cr_expect_eq(rt.fail_code, TD_ERR_NOMEM);
  cr_expect(strstr(rt.fail_msg, "no room"), "message: %s", rt.fail_msg);
  cr_expect_eq(rt.ended, 1, "the job was left behind");
  cr_expect_null(rt.job);
}

Test(worker_roles, decode_reserves_cross_and_prompt_kv) {
  rt_reset();
  msgs x;
  msgs_init(&x, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, 8);
  x.dj.with_prefill = true;
  x.dj.prefill_tokens = 25;
  td_role_decode.on_job(NULL, &x.m);
  cr_expect_eq(rt.reserves, 1);
  cr_expect_eq(rt.cross_tokens, 40);
  cr_expect_eq(rt.self_tokens, 25);
  /* each reservation is bound to the sender the router named for it */
  cr_expect_eq(rt.cross_from, &x.from_enc);
  cr_expect_eq(rt.self_from, &x.from_pre);
  cr_expect_eq(rt.runs, 0);
  /* nothing runs until every block arrived */
  td_role_decode.on_arrival(NULL, rt.job);
  cr_expect_eq(rt.runs, 0);
  rt.kv_ready = true;
  td_role_decode.on_arrival(NULL, rt.job);
  cr_expect_eq(rt.runs, 1);
  cr_expect(rt.run.reserved_kv);
  td_role_decode.on_done(NULL, rt.job, &done_ok);
  cr_expect_eq(rt.sent_body, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FINISHED);
  cr_expect_eq(rt.sent_rid, 8);
  cr_expect_eq(rt.ended, 1);
}

Test(worker_roles, decode_encodes_locally_without_reservation) {
  rt_reset();
  msgs x;
  msgs_init(&x, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, 9);
  x.dj.local_encode = true;
  td_role_decode.on_job(NULL, &x.m);
  cr_expect_eq(rt.reserves, 0);
  cr_expect_eq(rt.runs, 1);
  cr_expect(!rt.run.reserved_kv && !rt.run.encode_only);
  td_job_end(NULL, rt.job);
}

Test(worker_roles, decode_reports_a_request_the_engine_refuses) {
  rt_reset();
  rt.run_result = TD_ERR_INVALID;
  msgs x;
  msgs_init(&x, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, 10);
  td_role_decode.on_job(NULL, &x.m);
  rt.kv_ready = true;
  td_role_decode.on_arrival(NULL, rt.job);
  cr_expect_eq(rt.failed, 1);
  cr_expect_eq(rt.fail_code, TD_ERR_INVALID);
  cr_expect_eq(rt.ended, 1);
}

/* ---------------------------------------------------------------- prefill */

Test(worker_roles, prefill_reports_a_refused_reservation) {
  rt_reset();
  rt.reserve_result = TD_ERR_NO_BLOCKS;
  msgs x;
  msgs_init(&x, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL, 11);
  td_role_prefill.on_job(NULL, &x.m);
  cr_expect_eq(rt.failed, 1);
  cr_expect_eq(rt.fail_code, TD_ERR_NO_BLOCKS);
  cr_expect_eq(rt.ended, 1);
}

Test(worker_roles, prefill_runs_the_prompt_once_and_pushes_it) {
  rt_reset();
  msgs x;
  msgs_init(&x, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL, 12);
  td_role_prefill.on_job(NULL, &x.m);
  cr_expect_eq(rt.cross_tokens, 40);
  cr_expect_eq(rt.self_tokens, 0);
  cr_expect_eq(rt.cross_from, &x.from_enc);
  cr_expect_null(rt.self_from);
  rt.kv_ready = true;
  td_role_prefill.on_arrival(NULL, rt.job);
  cr_expect_eq(rt.runs, 1);
  cr_expect(rt.run.reserved_kv);
  cr_expect_eq(rt.run.prefill_tokens, 20);
  cr_expect_eq(rt.run.n_push_to, 1);
  cr_expect_eq(rt.run.push_to[0], &x.target);
  /* one greedy sequence, whatever the request asked */
  cr_expect_eq(rt.adjusted.params.n, 1);
  cr_expect_eq(rt.adjusted.params.num_beams, 1);
  cr_expect_eq(rt.adjusted.params.temperature, 0.0f);
  td_role_prefill.on_done(NULL, rt.job, &done_ok);
  cr_expect_eq(rt.pushes, 1);
  cr_expect_eq(rt.push_to[0], &x.target);
  td_role_prefill.on_pushed(NULL, rt.job, NULL);
  cr_expect_eq(rt.sent_body, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_PREFILL_DONE);
  cr_expect_eq(rt.sent_rid, 12);
  cr_expect_eq(rt.ended, 1);
}

Test(worker_roles, prefill_without_target_is_refused) {
  rt_reset();
  msgs x;
  msgs_init(&x, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL, 13);
  x.pj.self_target = NULL;
  td_role_prefill.on_job(NULL, &x.m);
  cr_expect_eq(rt.refused, 1);
  cr_expect_eq(rt.reserves, 0);
}

/* ---------------------------------------------------------------- encode */

Test(worker_roles, encode_reports_a_request_the_engine_refuses) {
  rt_reset();
  rt.run_result = TD_ERR_INVALID;
  msgs x;
  msgs_init(&x, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE, 14);
  td_role_encode.on_job(NULL, &x.m);
  cr_expect_eq(rt.runs, 1);
  cr_expect(rt.run.encode_only && !rt.run.reserved_kv);
  cr_expect_eq(rt.failed, 1);
  cr_expect_eq(rt.ended, 1);
}

Test(worker_roles, encode_reports_a_failed_push) {
  rt_reset();
  msgs x;
  msgs_init(&x, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE, 15);
  td_role_encode.on_job(NULL, &x.m);
  cr_expect_eq(rt.run.n_push_to, 1);
  td_role_encode.on_done(NULL, rt.job, &done_ok);
  cr_expect_eq(rt.pushes, 1);
  td_role_encode.on_pushed(NULL, rt.job, "KV push failed: receiver gone");
  cr_expect_eq(rt.failed, 1);
  cr_expect_eq(rt.fail_code, TD_ERR_PEER);
  cr_expect_str_eq(rt.fail_msg, "KV push failed: receiver gone");
  cr_expect_eq(rt.sent, 0, "a failed push was reported as done");
}

Test(worker_roles, encode_reports_done_after_the_pushes) {
  rt_reset();
  msgs x;
  msgs_init(&x, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE, 16);
  td_role_encode.on_job(NULL, &x.m);
  td_role_encode.on_done(NULL, rt.job, &done_ok);
  cr_expect_eq(rt.sent, 0);
  td_role_encode.on_pushed(NULL, rt.job, NULL);
  cr_expect_eq(rt.sent_body, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_ENCODE_DONE);
  cr_expect_eq(rt.sent_rid, 16);
  cr_expect_eq(rt.ended, 1);
}
