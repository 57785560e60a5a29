/* The worker's control plane in-process: a real td_worker (t5-tiny on the
 * CPU, on a thread) against a fake router on a loopback ZeroMQ socket, and
 * a fake KV receiver. Registration and the heartbeat period the ack names,
 * reservation expiry, a refused job that no pool could hold, a cancel
 * while a push waits for its answer, token offsets per sequence (a step's
 * tokens of every sequence in one message), token
 * counts past an int, a push of blocks of the wrong size refused, the
 * load reported as soon as the engine goes idle, a 1 GiB KV frame
 * refused by the socket's size limit, and KV pushes taken only from the
 * sender the router named for the reservation (its token over ZeroMQ and
 * UCX, its key with CURVE), with a real encoder worker as the pusher. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/defaults.h"
#include "decode_worker/decode.h"
#include "encoder_worker/encoder.h"
#include "proto/wire.h"
#include "worker/worker.h"

#define BS 16
#define CROSS_BLOCKS 8

typedef Tandem__Cluster__WorkerMessage wmsg;

/* ---------------------------------------------------------------- fake router */

typedef struct fake {
  void *zctx, *sock;
  td_zap *zap; /* with CURVE: the fake router's ZAP handler */
  char ep[128];
  uint8_t id[TD_WIRE_MAX_ID];
  size_t id_len;
} fake;

/* auth: a CURVE server admitting the worker list (NULL: plain) */
static void bind_router_auth(void *zctx, void **sock, char *ep, size_t cap, const td_auth *auth) {
  *sock = zmq_socket(zctx, ZMQ_ROUTER);
  cr_assert_not_null(*sock);
  int linger = 0;
  zmq_setsockopt(*sock, ZMQ_LINGER, &linger, sizeof linger);
  int64_t max = -1;
  zmq_setsockopt(*sock, ZMQ_MAXMSGSIZE, &max, sizeof max);
  cr_assert_eq(td_auth_server(auth, *sock, TD_AUTH_DOMAIN_WORKERS), TD_OK, "%s", td_errmsg());
  cr_assert_eq(zmq_bind(*sock, "tcp://127.0.0.1:*"), 0);
  size_t len = cap;
  zmq_getsockopt(*sock, ZMQ_LAST_ENDPOINT, ep, &len);
}

static void bind_router(void *zctx, void **sock, char *ep, size_t cap) { bind_router_auth(zctx, sock, ep, cap, NULL); }

/* The next message from the worker (NULL when none came in time). */
static wmsg *fake_recv(fake *f, int timeout_ms) {
  zmq_pollitem_t it = {.socket = f->sock, .events = ZMQ_POLLIN};
  if (zmq_poll(&it, 1, timeout_ms) <= 0) return NULL;
  td_wire_frame fr;
  if (td_wire_recv(f->sock, true, false, &fr) != TD_OK) return NULL;
  memcpy(f->id, fr.id, fr.id_len);
  f->id_len = fr.id_len;
  wmsg *m = NULL;
  uint32_t ver;
  cr_assert_eq(td_wire_unpack_worker(&fr, &m, &ver), TD_OK, "a malformed message from the worker");
  td_wire_frame_free(&fr);
  return m;
}

/* The next message of `body` (heartbeats and others skipped), or NULL. */
static wmsg *fake_expect(fake *f, Tandem__Cluster__WorkerMessage__BodyCase body, int timeout_ms) {
  int64_t end = td_now_ms() + timeout_ms;
  for (int64_t left; (left = end - td_now_ms()) > 0;) {
    wmsg *m = fake_recv(f, (int)left);
    if (!m) return NULL;
    if (m->body_case == body) return m;
    tandem__cluster__worker_message__free_unpacked(m, NULL);
  }
  return NULL;
}

static void fake_send(fake *f, Tandem__Cluster__RouterMessage *m) {
  m->version = TD_PROTOCOL_VERSION;
  cr_assert_eq(td_wire_send(f->sock, f->id, f->id_len, &m->base), TD_OK);
}

/* dead_after: heartbeat periods of silence before the worker calls the router silent */
static void send_ack_dead(fake *f, uint32_t heartbeat_ms, uint32_t dead_after) {
  Tandem__Cluster__RegisterAck a = TANDEM__CLUSTER__REGISTER_ACK__INIT;
  a.accepted = true;
  a.heartbeat_ms = heartbeat_ms;
  a.dead_after = dead_after;
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ACK;
  m.ack = &a;
  fake_send(f, &m);
}

static void send_ack(fake *f, uint32_t heartbeat_ms) {
  send_ack_dead(f, heartbeat_ms, 1000); /* the test may be slow to answer: never call the router silent */
}

static void send_cancel(fake *f, uint64_t rid) {
  Tandem__Cluster__Cancel c = TANDEM__CLUSTER__CANCEL__INIT;
  c.rid = rid;
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL;
  m.cancel = &c;
  fake_send(f, &m);
}

/* ---------------------------------------------------------------- a worker on a thread */

typedef struct wrun {
  fake f;
  td_worker *w;
  pthread_t th;
  volatile sig_atomic_t stop;
  td_status s;
  wmsg *reg; /* its registration */
} wrun;

static void *run_main(void *arg) {
  wrun *r = arg;
  r->s = td_worker_run(r->w, &r->stop);
  return NULL;
}

static char model_dir[600];

/* Starts worker `id` with these roles (auth: its CURVE keys, and
 * router_auth the fake router's; NULL: plain) and answers its registration
 * with an ack naming heartbeat_ms. */
static void worker_start_as(wrun *r, const td_role *const *roles, int n_roles, const char *transfer, int ttl_ms,
                            uint32_t heartbeat_ms, const char *id, const td_auth *auth, const td_auth *router_auth) {
  memset(r, 0, sizeof *r);
  snprintf(model_dir, sizeof model_dir, "%s/t5-tiny", TD_TEST_DATA);
  r->f.zctx = zmq_ctx_new();
  cr_assert_eq(td_zap_create(router_auth, r->f.zctx, &r->f.zap), TD_OK, "%s", td_errmsg());
  bind_router_auth(r->f.zctx, &r->f.sock, r->f.ep, sizeof r->f.ep, router_auth);
  td_worker_opts o = {.router = r->f.ep, .id = id, .roles = roles, .n_roles = n_roles, .model_dir = model_dir,
                      .device = TD_BACKEND_CPU, .block_size = BS, .cross_blocks = CROSS_BLOCKS, .self_blocks = 16,
                      .max_batch = 4, .threads = 1, .reservation_ttl_ms = ttl_ms, .transfer = transfer,
                      .transfer_timeout_ms = 20000, .auth = auth};
  cr_assert_eq(td_worker_create(&o, &r->w), TD_OK, "%s", td_errmsg());
  cr_assert_eq(pthread_create(&r->th, NULL, run_main, r), 0);
  r->reg = fake_expect(&r->f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_REGISTER, 10000);
  cr_assert_not_null(r->reg, "no registration");
  send_ack(&r->f, heartbeat_ms);
}

static void worker_start(wrun *r, const td_role *const *roles, int n_roles, const char *transfer, int ttl_ms,
                         uint32_t heartbeat_ms) {
  worker_start_as(r, roles, n_roles, transfer, ttl_ms, heartbeat_ms, "w-test", NULL, NULL);
}

static void worker_stop(wrun *r) {
  Tandem__Cluster__Shutdown sd = TANDEM__CLUSTER__SHUTDOWN__INIT;
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_SHUTDOWN;
  m.shutdown = &sd;
  fake_send(&r->f, &m); /* drops what is left, so the drain ends at once */
  r->stop = SIGTERM;
  pthread_join(r->th, NULL);
  cr_expect_eq(r->s, TD_OK, "%s", td_errmsg());
  wmsg *d = fake_expect(&r->f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_DEREGISTER, 2000);
  cr_expect_not_null(d, "no deregistration");
  if (d) tandem__cluster__worker_message__free_unpacked(d, NULL);
  td_worker_destroy(r->w);
  tandem__cluster__worker_message__free_unpacked(r->reg, NULL);
  zmq_close(r->f.sock);
  td_zap_destroy(r->f.zap);
  zmq_ctx_term(r->f.zctx);
}

/* The next heartbeat whose load satisfies ok (NULL: any), or NULL. */
static wmsg *heartbeat_where(fake *f, bool (*ok)(const Tandem__Cluster__Load *), int timeout_ms) {
  int64_t end = td_now_ms() + timeout_ms;
  for (int64_t left; (left = end - td_now_ms()) > 0;) {
    wmsg *m = fake_expect(f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_HEARTBEAT, (int)left);
    if (!m) return NULL;
    if (!ok || (m->heartbeat->load && ok(m->heartbeat->load))) return m;
    tandem__cluster__worker_message__free_unpacked(m, NULL);
  }
  return NULL;
}

static bool cross_pool_free(const Tandem__Cluster__Load *l) { return l->free_cross_blocks == CROSS_BLOCKS; }
static bool one_block_reserved(const Tandem__Cluster__Load *l) { return l->free_cross_blocks == CROSS_BLOCKS - 1; }
static bool one_pushing(const Tandem__Cluster__Load *l) { return l->kv_pushing == 1; }
static bool nothing_pushing(const Tandem__Cluster__Load *l) {
  return l->kv_pushing == 0 && l->free_cross_blocks == CROSS_BLOCKS;
}

/* ---------------------------------------------------------------- jobs */

static int32_t input_ids[] = {10, 5, 9, 1};
static int32_t prompt[] = {0};

typedef struct job_msg {
  Tandem__Cluster__RouterMessage m;
  Tandem__Cluster__RequestSpec sp;
  Tandem__SamplingParams sa;
  Tandem__Cluster__DecodeJob dj;
  Tandem__Cluster__EncodeJob ej;
  Tandem__Cluster__KvTarget t;
  Tandem__Cluster__KvTarget *ts[1];
  int32_t dst[4];
} job_msg;

static void spec_init(job_msg *x, uint64_t rid, uint32_t enc_len) {
  memset(x, 0, sizeof *x);
  tandem__cluster__router_message__init(&x->m);
  tandem__cluster__request_spec__init(&x->sp);
  tandem__sampling_params__init(&x->sa);
  x->sp.rid = rid;
  x->sp.input_ids = input_ids;
  x->sp.n_input_ids = 4;
  x->sp.decoder_prompt = prompt;
  x->sp.n_decoder_prompt = 1;
  x->sp.max_new_tokens = 6;
  x->sp.enc_len = enc_len;
  x->sp.client_id = "test";
}

/* The sender send_decode names for the cross blocks: what the router would
 * tell the decode worker about the encoder it chose. */
static uint8_t sender_token[TD_KV_TOKEN_BYTES] = {7, 7, 7};
static const char *sender_key = "";

static void send_decode(fake *f, uint64_t rid, uint32_t enc_len, bool local_encode, int n_samples) {
  job_msg x;
  spec_init(&x, rid, enc_len);
  tandem__cluster__decode_job__init(&x.dj);
  Tandem__Cluster__KvSender from = TANDEM__CLUSTER__KV_SENDER__INIT;
  from.worker_id = "enc-test";
  from.token = (ProtobufCBinaryData){TD_KV_TOKEN_BYTES, sender_token};
  from.key = (char *)sender_key;
  if (!local_encode) x.dj.cross_from = &from;
  if (n_samples > 1) {
    x.sa.n = (uint32_t)n_samples;
    x.sa.temperature = 1.0f;
    x.sa.seed = 7;
    x.sa.has_seed = true;
    x.sa.ignore_eos = true;
    x.sp.sampling = &x.sa;
  }
  x.dj.req = &x.sp;
  x.dj.local_encode = local_encode;
  x.m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE;
  x.m.decode = &x.dj;
  fake_send(f, &x.m);
}

static uint64_t failed_rid(const wmsg *m) { return m->failed->rid; }

/* ---------------------------------------------------------------- tests */

Test(worker_control, registers_and_heartbeats_at_the_acked_period, .timeout = 60) {
  static const td_role *const roles[] = {&td_role_decode};
  wrun r;
  worker_start(&r, roles, 1, "auto", 0, 40);
  Tandem__Cluster__WorkerInfo *in = r.reg->register_->info;
  cr_expect_str_eq(in->worker_id, "w-test");
  cr_assert_eq(in->n_roles, 1);
  cr_expect_eq(in->roles[0], TANDEM__CLUSTER__ROLE__ROLE_DECODE);
  cr_expect_eq(in->block_size, BS);
  cr_expect_eq(in->cross_blocks, CROSS_BLOCKS);
  Tandem__Cluster__TransferDesc *d = tandem__cluster__transfer_desc__unpack(NULL, in->transfer_desc.len,
                                                                             in->transfer_desc.data);
  cr_assert_not_null(d, "the transfer descriptor does not unpack");
  cr_expect_eq(d->version, TD_PROTOCOL_VERSION);
  cr_expect(!strncmp(d->zmq, "zmq:tcp://127.0.0.1:", 20), "zmq endpoint %s", d->zmq);
  cr_expect_gt(d->kvx.len, 0, "no UCX descriptor with --kv-transport auto");
  cr_expect_eq(d->ranks, 1);
  tandem__cluster__transfer_desc__free_unpacked(d, NULL);
  /* every 40 ms from the ack on: within the default period (500 ms), several */
  int64_t t0 = td_now_ms();
  int n = 0;
  uint64_t seq = 0;
  for (int64_t left; (left = t0 + 400 - td_now_ms()) > 0;) {
    wmsg *m = fake_expect(&r.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_HEARTBEAT, (int)left);
    if (!m) break;
    cr_expect_gt(m->heartbeat->seq, seq);
    seq = m->heartbeat->seq;
    n++;
    tandem__cluster__worker_message__free_unpacked(m, NULL);
  }
  cr_expect_geq(n, 5, "%d heartbeats in 400 ms at a 40 ms period", n);
  worker_stop(&r);
}

Test(worker_control, unclaimed_reservation_expires_with_a_clear_failure, .timeout = 60) {
  static const td_role *const roles[] = {&td_role_decode};
  wrun r;
  worker_start(&r, roles, 1, "zmq", 300, 100);
  send_decode(&r.f, 21, 20, false, 1);
  wmsg *m = fake_expect(&r.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED, 5000);
  cr_assert_not_null(m, "nothing reserved");
  cr_expect_eq(m->reserved->rid, 21);
  cr_expect_eq(m->reserved->cross->n_blocks, 2);
  cr_expect_null(m->reserved->self);
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  int64_t t0 = td_now_ms();
  m = fake_expect(&r.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED, 5000);
  cr_assert_not_null(m, "the reservation never expired");
  cr_expect_geq(td_now_ms() - t0, 200, "expired before its time");
  cr_expect_eq(failed_rid(m), 21);
  cr_expect_eq(m->failed->code, TANDEM__ERROR_CODE__ERROR_TIMEOUT);
  cr_expect(m->failed->retryable);
  cr_expect(strstr(m->failed->message, "did not arrive before the reservation expired"), "%s", m->failed->message);
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  m = heartbeat_where(&r.f, cross_pool_free, 5000);
  cr_expect_not_null(m, "the expired reservation's blocks did not come back");
  if (m) tandem__cluster__worker_message__free_unpacked(m, NULL);
  worker_stop(&r);
}

/* Whether a message of `body` comes within 5 s (dropped). */
static bool arrives(fake *f, Tandem__Cluster__WorkerMessage__BodyCase body) {
  wmsg *m = fake_expect(f, body, 5000);
  if (m) tandem__cluster__worker_message__free_unpacked(m, NULL);
  return m != NULL;
}

/* The router falls silent (SIGSTOP), the worker stops counting itself
 * registered and asks again; a job the router sent before it took the
 * worker back (it retried that request elsewhere) reserves blocks that no
 * one will claim or cancel: the worker drops it when the router answers. */
Test(worker_control, jobs_from_before_a_re_registration_are_dropped, .timeout = 60) {
  static const td_role *const roles[] = {&td_role_decode};
  wrun r;
  worker_start(&r, roles, 1, "zmq", 60000, 100);
  send_ack_dead(&r.f, 100, 3); /* the same, but silence after three heartbeats of nothing */
  cr_assert(arrives(&r.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_REGISTER), "the worker did not ask again after the silence");
  /* a job of the old view, then the answer to the new registration */
  send_decode(&r.f, 41, 20, false, 1);
  cr_assert(arrives(&r.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED), "nothing reserved");
  send_ack(&r.f, 100);
  wmsg *m = heartbeat_where(&r.f, cross_pool_free, 3000);
  cr_expect_not_null(m, "the old job's blocks stayed reserved after the router took the worker back");
  if (m) tandem__cluster__worker_message__free_unpacked(m, NULL);
  /* a job after the answer is served as usual */
  send_decode(&r.f, 42, 20, false, 1);
  cr_expect(arrives(&r.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED), "a job after the registration was not taken");
  worker_stop(&r);
}

Test(worker_control, job_larger_than_the_pool_is_refused_naming_it, .timeout = 60) {
  static const td_role *const roles[] = {&td_role_decode};
  wrun r;
  worker_start(&r, roles, 1, "zmq", 0, 100);
  send_decode(&r.f, 31, CROSS_BLOCKS * BS + 1, false, 1);
  wmsg *m = fake_expect(&r.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED, 5000);
  cr_assert_not_null(m, "an over-limit job was not refused");
  cr_expect_eq(failed_rid(m), 31);
  cr_expect(strstr(m->failed->message, "cross pool holds 8"), "%s", m->failed->message);
  cr_expect(m->failed->retryable, "a worker with a larger pool may take it");
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  /* the refused job is gone: the same request fits when it is smaller */
  send_decode(&r.f, 31, BS, false, 1);
  m = fake_expect(&r.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED, 5000);
  cr_assert_not_null(m, "the request's earlier, refused job still blocks it");
  cr_expect_eq(m->reserved->rid, 31);
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  m = heartbeat_where(&r.f, one_block_reserved, 5000);
  cr_assert_not_null(m, "the reservation does not show");
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  send_cancel(&r.f, 31);
  m = heartbeat_where(&r.f, cross_pool_free, 5000);
  cr_expect_not_null(m, "the cancelled reservation's blocks did not come back");
  if (m) tandem__cluster__worker_message__free_unpacked(m, NULL);
  worker_stop(&r);
}

/* Token counts past what an int holds (the router's message is trusted
 * for nothing): refused naming them on receipt (proto/check.c), never
 * wrapped into a small or negative reservation or a "model default"
 * max_new_tokens; within the limits, past the pool: refused naming it. */
Test(worker_control, job_with_token_counts_past_int_is_refused, .timeout = 60) {
  static const td_role *const roles[] = {&td_role_decode};
  wrun r;
  worker_start(&r, roles, 1, "zmq", 0, 100);
  send_decode(&r.f, 35, TD_MODEL_MAX_POSITIONS, false, 1);
  wmsg *m = fake_expect(&r.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED, 5000);
  cr_assert_not_null(m, "an over-limit job was not refused");
  cr_expect_eq(failed_rid(m), 35);
  cr_expect(strstr(m->failed->message, "needs 65536 cross-attention blocks"), "%s", m->failed->message);
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  static const uint32_t past[] = {0x7fffffffu, 0x80000000u, 0xffffffffu};
  for (int i = 0; i < 3; i++) {
    send_decode(&r.f, 36 + (uint64_t)i, past[i], false, 1);
    m = fake_expect(&r.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED, 5000);
    cr_assert_not_null(m, "a job of %u encoder tokens was not refused", past[i]);
    cr_expect_eq(failed_rid(m), 36 + (uint64_t)i);
    cr_expect_eq(m->failed->code, TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT);
    cr_expect(!m->failed->retryable);
    char want[96];
    snprintf(want, sizeof want, "invalid job: RequestSpec.enc_len %u exceeds %d", past[i], TD_MODEL_MAX_POSITIONS);
    cr_expect(strstr(m->failed->message, want), "%s", m->failed->message);
    tandem__cluster__worker_message__free_unpacked(m, NULL);
  }
  /* max_new_tokens past an int was "the model's default" once the worker cast it */
  job_msg x;
  spec_init(&x, 40, 4);
  tandem__cluster__decode_job__init(&x.dj);
  x.sp.max_new_tokens = 0x80000000u;
  x.dj.req = &x.sp;
  x.dj.local_encode = true;
  x.m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE;
  x.m.decode = &x.dj;
  fake_send(&r.f, &x.m);
  m = fake_expect(&r.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED, 5000);
  cr_assert_not_null(m, "max_new_tokens 2^31 was not refused");
  cr_expect_eq(failed_rid(m), 40);
  cr_expect(strstr(m->failed->message, "RequestSpec.max_new_tokens 2147483648 exceeds"), "%s", m->failed->message);
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  m = heartbeat_where(&r.f, cross_pool_free, 5000);
  cr_expect_not_null(m, "a refused job holds blocks");
  if (m) tandem__cluster__worker_message__free_unpacked(m, NULL);
  worker_stop(&r);
}

Test(worker_control, job_for_a_role_not_served_is_refused, .timeout = 60) {
  static const td_role *const roles[] = {&td_role_decode};
  wrun r;
  worker_start(&r, roles, 1, "zmq", 0, 100);
  job_msg x;
  spec_init(&x, 41, 4);
  tandem__cluster__encode_job__init(&x.ej);
  tandem__cluster__kv_target__init(&x.t);
  static const char desc[] = "zmq:tcp://127.0.0.1:9";
  x.t.worker_id = "w-peer";
  x.t.desc.data = (uint8_t *)desc;
  x.t.desc.len = sizeof desc - 1;
  x.t.blocks = x.dst;
  x.t.n_blocks = 1;
  x.t.tokens = 4;
  x.ts[0] = &x.t;
  x.ej.targets = x.ts;
  x.ej.n_targets = 1;
  x.ej.req = &x.sp;
  x.m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE;
  x.m.encode = &x.ej;
  fake_send(&r.f, &x.m);
  wmsg *m = fake_expect(&r.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED, 5000);
  cr_assert_not_null(m);
  cr_expect_eq(failed_rid(m), 41);
  cr_expect_eq(m->failed->code, TANDEM__ERROR_CODE__ERROR_OVERLOADED);
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  worker_stop(&r);
}

Test(worker_control, token_offsets_count_per_sequence, .timeout = 60) {
  static const td_role *const roles[] = {&td_role_decode};
  wrun r;
  worker_start(&r, roles, 1, "zmq", 0, 100);
  enum { N = 3 };
  send_decode(&r.f, 51, 4, true, N);
  int32_t got[N][64];
  int n_got[N] = {0}, n_batches = 0;
  wmsg *fin = NULL;
  while (!fin) {
    wmsg *m = fake_recv(&r.f, 10000);
    cr_assert_not_null(m, "no result");
    bool one = m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS;
    if (one || m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS_BATCH) {
      size_t n_items = one ? 1 : m->tokens_batch->n_items;
      if (!one) n_batches++;
      for (size_t k = 0; k < n_items; k++) {
        Tandem__Cluster__Tokens *t = one ? m->tokens : m->tokens_batch->items[k];
        cr_assert_eq(t->rid, 51);
        cr_assert_lt(t->sequence, N);
        int s = (int)t->sequence;
        cr_expect_eq(t->offset, n_got[s], "sequence %d: offset %u after %d tokens", s, t->offset, n_got[s]);
        cr_assert_leq(n_got[s] + (int)t->n_tokens, 64);
        memcpy(got[s] + n_got[s], t->tokens, sizeof(int32_t) * t->n_tokens);
        n_got[s] += (int)t->n_tokens;
      }
    } else if (m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FINISHED) {
      fin = m;
      continue;
    } else {
      cr_assert_neq(m->body_case, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED, "failed: %s", m->failed->message);
    }
    tandem__cluster__worker_message__free_unpacked(m, NULL);
  }
  cr_assert_eq(fin->finished->n_outputs, N);
  cr_expect_gt(n_batches, 0, "a step of %d sequences came as one message", N);
  /* every output is one streamed sequence, token for token */
  bool used[N] = {false};
  for (int o = 0; o < N; o++) {
    const Tandem__SequenceOutput *so = fin->finished->outputs[o];
    cr_expect_eq(so->n_tokens, 6);
    bool found = false;
    for (int s = 0; s < N && !found; s++)
      if (!used[s] && n_got[s] == (int)so->n_tokens && !memcmp(got[s], so->tokens, sizeof(int32_t) * so->n_tokens))
        used[s] = found = true;
    cr_expect(found, "output %d was not streamed as one sequence", o);
  }
  tandem__cluster__worker_message__free_unpacked(fin, NULL);
  worker_stop(&r);
}

static bool idle_and_free(const Tandem__Cluster__Load *l) {
  return !l->running && !l->queued && l->free_cross_blocks == CROSS_BLOCKS && l->free_self_blocks == 16;
}

/* A worker whose engine goes idle says so at once, not at its next
 * heartbeat (60 s away here): the router's view of it is never stale. */
Test(worker_control, going_idle_is_reported_at_once, .timeout = 60) {
  static const td_role *const roles[] = {&td_role_decode};
  wrun r;
  worker_start(&r, roles, 1, "zmq", 0, 60000);
  wmsg *first = heartbeat_where(&r.f, NULL, 5000); /* the one at the ack */
  cr_assert_not_null(first);
  tandem__cluster__worker_message__free_unpacked(first, NULL);
  send_decode(&r.f, 61, 4, true, 1);
  /* the idle report may overtake the result on the way (it is sent after it) */
  bool idle_seen = false;
  for (bool done = false; !done;) {
    wmsg *m = fake_recv(&r.f, 10000);
    cr_assert_not_null(m, "no result");
    cr_assert_neq(m->body_case, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED, "failed: %s", m->failed->message);
    done = m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FINISHED;
    idle_seen |= m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_HEARTBEAT && m->heartbeat->load &&
                 idle_and_free(m->heartbeat->load);
    tandem__cluster__worker_message__free_unpacked(m, NULL);
  }
  wmsg *hb = idle_seen ? NULL : heartbeat_where(&r.f, idle_and_free, 2000);
  cr_expect(idle_seen || hb, "no load report within 2 s of going idle");
  if (hb) tandem__cluster__worker_message__free_unpacked(hb, NULL);
  worker_stop(&r);
}

/* ---------------------------------------------------------------- a push and a cancel */

typedef struct receiver {
  void *sock;
  char ep[128];
} receiver;

/* One KvPush: its identity, header and block frames; checks the framing. */
static Tandem__Cluster__KvPush *receive_push(receiver *k, zmq_msg_t *id, size_t *n_frames, size_t *frame_bytes) {
  zmq_pollitem_t it = {.socket = k->sock, .events = ZMQ_POLLIN};
  if (zmq_poll(&it, 1, 10000) <= 0) return NULL;
  zmq_msg_init(id);
  cr_assert_geq(zmq_msg_recv(id, k->sock, 0), 0);
  zmq_msg_t hd;
  zmq_msg_init(&hd);
  cr_assert_geq(zmq_msg_recv(&hd, k->sock, 0), 0);
  Tandem__Cluster__KvPush *h = tandem__cluster__kv_push__unpack(NULL, zmq_msg_size(&hd), zmq_msg_data(&hd));
  zmq_msg_close(&hd);
  *n_frames = 0;
  int more = 1;
  size_t l = sizeof more;
  for (zmq_getsockopt(k->sock, ZMQ_RCVMORE, &more, &l); more; zmq_getsockopt(k->sock, ZMQ_RCVMORE, &more, &l)) {
    zmq_msg_t b;
    zmq_msg_init(&b);
    zmq_msg_recv(&b, k->sock, 0);
    *frame_bytes = zmq_msg_size(&b);
    (*n_frames)++;
    zmq_msg_close(&b);
  }
  return h;
}

static void send_kv_ack(receiver *k, zmq_msg_t *id, uint64_t push_id) {
  Tandem__Cluster__KvAck a = TANDEM__CLUSTER__KV_ACK__INIT;
  a.version = TD_PROTOCOL_VERSION;
  a.push_id = push_id;
  a.ok = true;
  a.error = "";
  uint8_t buf[256];
  size_t n = protobuf_c_message_pack(&a.base, buf);
  zmq_send(k->sock, zmq_msg_data(id), zmq_msg_size(id), ZMQ_SNDMORE);
  zmq_send(k->sock, buf, n, 0);
  zmq_msg_close(id);
}

static void send_encode(fake *f, uint64_t rid, const uint8_t *desc, size_t len) {
  job_msg x;
  spec_init(&x, rid, 4);
  tandem__cluster__encode_job__init(&x.ej);
  tandem__cluster__kv_target__init(&x.t);
  x.t.worker_id = "fake-decode";
  x.t.desc.data = (uint8_t *)desc;
  x.t.desc.len = len;
  x.t.reservation = 70 + rid;
  x.dst[0] = 3;
  x.t.blocks = x.dst;
  x.t.n_blocks = 1;
  x.t.tokens = 4;
  x.ts[0] = &x.t;
  x.ej.req = &x.sp;
  x.ej.targets = x.ts;
  x.ej.n_targets = 1;
  x.m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE;
  x.m.encode = &x.ej;
  fake_send(f, &x.m);
}

Test(worker_control, cancel_while_a_push_waits_for_its_answer, .timeout = 60) {
  static const td_role *const roles[] = {&td_role_encode};
  wrun r;
  worker_start(&r, roles, 1, "zmq", 0, 100);
  receiver k;
  bind_router(r.f.zctx, &k.sock, k.ep, sizeof k.ep);
  char zep[160];
  snprintf(zep, sizeof zep, "zmq:%s", k.ep);
  Tandem__Cluster__TransferDesc d = TANDEM__CLUSTER__TRANSFER_DESC__INIT;
  d.version = TD_PROTOCOL_VERSION;
  d.zmq = zep;
  d.ranks = 1;
  uint8_t desc[256];
  size_t dlen = tandem__cluster__transfer_desc__pack(&d, desc);

  /* the push arrives as the wire says: header, one frame a block */
  send_encode(&r.f, 61, desc, dlen);
  zmq_msg_t id;
  size_t frames = 0, fbytes = 0;
  Tandem__Cluster__KvPush *h = receive_push(&k, &id, &frames, &fbytes);
  cr_assert_not_null(h, "no KV push");
  cr_expect_eq(h->version, TD_PROTOCOL_VERSION);
  cr_expect_eq(h->rid, 61);
  cr_expect_eq(h->reservation, 131);
  cr_expect(h->cross);
  cr_assert_eq(h->n_blocks, 1);
  cr_expect_eq(h->blocks[0], 3);
  cr_expect_eq(frames, 1);
  cr_expect_eq(fbytes, h->block_bytes);
  /* cancelled before the answer (a heartbeat after the one that shows the
   * push pending shows the cancel done): the late answer reports nothing */
  wmsg *m = heartbeat_where(&r.f, one_pushing, 5000);
  cr_assert_not_null(m, "the push is not pending");
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  send_cancel(&r.f, 61);
  m = heartbeat_where(&r.f, nothing_pushing, 5000);
  cr_expect_not_null(m, "the cancelled push is still pending or holds its blocks");
  if (m) tandem__cluster__worker_message__free_unpacked(m, NULL);
  send_kv_ack(&k, &id, h->push_id);
  tandem__cluster__kv_push__free_unpacked(h, NULL);

  /* the same again, answered: now the encoder reports done */
  send_encode(&r.f, 62, desc, dlen);
  h = receive_push(&k, &id, &frames, &fbytes);
  cr_assert_not_null(h, "no second KV push");
  send_kv_ack(&k, &id, h->push_id);
  tandem__cluster__kv_push__free_unpacked(h, NULL);
  for (;;) {
    m = fake_recv(&r.f, 5000);
    cr_assert_not_null(m, "no EncodeDone for the answered push");
    if (m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_ENCODE_DONE) break;
    cr_expect_neq(m->body_case, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED, "failed: %s", m->failed->message);
    tandem__cluster__worker_message__free_unpacked(m, NULL);
  }
  cr_expect_eq(m->encode_done->rid, 62, "the cancelled request was reported done");
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  m = heartbeat_where(&r.f, nothing_pushing, 5000);
  cr_assert_not_null(m);
  cr_expect_eq(m->heartbeat->load->kv_out_zmq, 1, "blocks counted as pushed: %llu",
               (unsigned long long)m->heartbeat->load->kv_out_zmq);
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  zmq_close(k.sock);
  worker_stop(&r);
}

/* ---------------------------------------------------------------- a push refused */

/* A KvPush whose header says its blocks have 0 bytes: nothing matches this
 * model's blocks, so it is refused before a byte is written (0 must not
 * pass the size check as "unchecked"). */
Test(worker_control, zmq_push_of_empty_blocks_is_refused, .timeout = 60) {
  static const td_role *const roles[] = {&td_role_decode};
  wrun r;
  worker_start(&r, roles, 1, "zmq", 0, 100);
  send_decode(&r.f, 81, 4, false, 1);
  wmsg *m = fake_expect(&r.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED, 5000);
  cr_assert_not_null(m, "nothing reserved");
  const Tandem__Cluster__KvTarget *t = m->reserved->cross;
  cr_assert_eq(t->n_blocks, 1);
  Tandem__Cluster__TransferDesc *d = tandem__cluster__transfer_desc__unpack(NULL, t->desc.len, t->desc.data);
  cr_assert(d && d->zmq && !strncmp(d->zmq, "zmq:", 4));
  void *s = zmq_socket(r.f.zctx, ZMQ_DEALER);
  int linger = 0;
  zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
  cr_assert_eq(zmq_connect(s, d->zmq + 4), 0);
  Tandem__Cluster__KvPush h = TANDEM__CLUSTER__KV_PUSH__INIT;
  h.version = TD_PROTOCOL_VERSION;
  h.rid = 81;
  h.reservation = t->reservation;
  h.cross = true;
  h.blocks = t->blocks;
  h.n_blocks = 1;
  h.block_bytes = 0;
  h.push_id = 9;
  uint8_t buf[256];
  size_t n = protobuf_c_message_pack(&h.base, buf);
  cr_assert_eq(zmq_send(s, buf, n, ZMQ_SNDMORE), (int)n);
  cr_assert_eq(zmq_send(s, "", 0, 0), 0);
  zmq_pollitem_t it = {.socket = s, .events = ZMQ_POLLIN};
  cr_assert_gt(zmq_poll(&it, 1, 10000), 0, "no answer to the push");
  int got = zmq_recv(s, buf, sizeof buf, 0);
  cr_assert_gt(got, 0);
  Tandem__Cluster__KvAck *a = tandem__cluster__kv_ack__unpack(NULL, (size_t)got, buf);
  cr_assert_not_null(a);
  cr_expect_eq(a->push_id, 9);
  cr_expect(!a->ok, "a push of 0-byte blocks was taken");
  cr_expect(a->error && strstr(a->error, "blocks of 0 bytes"), "%s", a->error ? a->error : "(no error)");
  tandem__cluster__kv_ack__free_unpacked(a, NULL);
  zmq_close(s);
  tandem__cluster__transfer_desc__free_unpacked(d, NULL);
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  worker_stop(&r);
}

/* One ZeroMQ KvPush of n blocks of bb bytes (zeros) into reservation res;
 * returns the receiver's answer (its error in err). */
static bool kv_push_once(void *s, uint64_t rid, uint64_t res, const int32_t *blocks, size_t n, size_t bb,
                         uint64_t push_id, char *err, size_t cap) {
  Tandem__Cluster__KvPush h = TANDEM__CLUSTER__KV_PUSH__INIT;
  h.version = TD_PROTOCOL_VERSION;
  h.rid = rid;
  h.reservation = res;
  h.cross = true;
  h.blocks = (int32_t *)blocks;
  h.n_blocks = n;
  h.block_bytes = bb;
  h.push_id = push_id;
  h.token = (ProtobufCBinaryData){TD_KV_TOKEN_BYTES, sender_token}; /* the sender send_decode named */
  uint8_t buf[256];
  size_t hn = protobuf_c_message_pack(&h.base, buf);
  cr_assert_eq(zmq_send(s, buf, hn, n ? ZMQ_SNDMORE : 0), (int)hn);
  void *zeros = calloc(1, bb ? bb : 1);
  for (size_t i = 0; i < n; i++) cr_assert_eq(zmq_send(s, zeros, bb, i + 1 < n ? ZMQ_SNDMORE : 0), (int)bb);
  free(zeros);
  zmq_pollitem_t it = {.socket = s, .events = ZMQ_POLLIN};
  cr_assert_gt(zmq_poll(&it, 1, 10000), 0, "no answer to push %llu", (unsigned long long)push_id);
  int got = zmq_recv(s, buf, sizeof buf, 0);
  cr_assert_gt(got, 0);
  Tandem__Cluster__KvAck *a = tandem__cluster__kv_ack__unpack(NULL, (size_t)got, buf);
  cr_assert_not_null(a);
  cr_expect_eq(a->push_id, push_id);
  bool ok = a->ok;
  snprintf(err, cap, "%s", a->error ? a->error : "");
  tandem__cluster__kv_ack__free_unpacked(a, NULL);
  return ok;
}

/* A block counts once: a push that names one block twice, or a block that
 * arrived already, is refused before a byte is written, so that a request
 * never starts with a block of its reservation unwritten. */
Test(worker_control, a_kv_block_pushed_twice_is_refused, .timeout = 60) {
  static const td_role *const roles[] = {&td_role_decode};
  wrun r;
  worker_start(&r, roles, 1, "zmq", 0, 100);
  send_decode(&r.f, 91, 2 * BS, false, 1);
  wmsg *m = fake_expect(&r.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED, 5000);
  cr_assert_not_null(m, "nothing reserved");
  const Tandem__Cluster__KvTarget *t = m->reserved->cross;
  cr_assert_eq(t->n_blocks, 2);
  Tandem__Cluster__TransferDesc *d = tandem__cluster__transfer_desc__unpack(NULL, t->desc.len, t->desc.data);
  cr_assert(d && d->zmq && !strncmp(d->zmq, "zmq:", 4));
  void *s = zmq_socket(r.f.zctx, ZMQ_DEALER);
  int linger = 0;
  zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
  cr_assert_eq(zmq_connect(s, d->zmq + 4), 0);
  char err[256];
  /* the block size, from the refusal of a push of empty blocks */
  cr_assert(!kv_push_once(s, 91, t->reservation, t->blocks, 1, 0, 1, err, sizeof err));
  const char *at = strstr(err, "this model's are ");
  cr_assert_not_null(at, "%s", err);
  size_t bb = (size_t)atol(at + strlen("this model's are "));
  cr_assert_gt(bb, 0);
  int32_t twice[2] = {t->blocks[0], t->blocks[0]};
  cr_expect(!kv_push_once(s, 91, t->reservation, twice, 2, bb, 2, err, sizeof err), "a block twice in a push was taken");
  cr_expect(strstr(err, "appears twice in one push"), "%s", err);
  cr_expect(kv_push_once(s, 91, t->reservation, t->blocks, 1, bb, 3, err, sizeof err), "%s", err);
  cr_expect(!kv_push_once(s, 91, t->reservation, t->blocks, 1, bb, 4, err, sizeof err), "a block pushed again was taken");
  cr_expect(strstr(err, "arrived already"), "%s", err);
  cr_expect(kv_push_once(s, 91, t->reservation, t->blocks + 1, 1, bb, 5, err, sizeof err), "%s", err);
  zmq_close(s);
  tandem__cluster__transfer_desc__free_unpacked(d, NULL);
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  send_cancel(&r.f, 91);
  m = heartbeat_where(&r.f, cross_pool_free, 5000);
  cr_expect_not_null(m, "the request's blocks did not come back");
  if (m) tandem__cluster__worker_message__free_unpacked(m, NULL);
  worker_stop(&r);
}

/* ---------------------------------------------------------------- a 1 GiB frame */

/* This process's resident memory, kB (/proc/self/status VmRSS). */
static long rss_kb(void) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  long kb = -1;
  while (f && fgets(line, sizeof line, f))
    if (!strncmp(line, "VmRSS:", 6)) kb = atol(line + 6);
  if (f) fclose(f);
  return kb;
}

/* A push whose block frame declares 1 GiB reaches a decode worker's KV
 * socket: the socket's size limit (the model's block bytes) drops the
 * connection at the frame's header, so the worker's memory stays within
 * 64 MB of where it was (without the limit libzmq buffered the whole GiB:
 * +1 GiB), and the worker goes on answering pushes. The GiB is never
 * allocated here: the frame points into a read-only anonymous mapping,
 * zero pages that count for nothing. */
Test(worker_control, a_1gib_kv_frame_is_refused_and_memory_stays_bounded, .timeout = 60) {
  static const td_role *const roles[] = {&td_role_decode};
  wrun r;
  worker_start(&r, roles, 1, "zmq", 0, 100);
  send_decode(&r.f, 91, 4, false, 1);
  wmsg *m = fake_expect(&r.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED, 5000);
  cr_assert_not_null(m, "nothing reserved");
  const Tandem__Cluster__KvTarget *t = m->reserved->cross;
  Tandem__Cluster__TransferDesc *d = tandem__cluster__transfer_desc__unpack(NULL, t->desc.len, t->desc.data);
  cr_assert(d && d->zmq && !strncmp(d->zmq, "zmq:", 4));
  long before = rss_kb();
  const size_t giga = (size_t)1 << 30;
  void *zero = mmap(NULL, giga, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  cr_assert_neq(zero, MAP_FAILED);
  void *s = zmq_socket(r.f.zctx, ZMQ_DEALER);
  int linger = 0;
  zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
  cr_assert_eq(zmq_connect(s, d->zmq + 4), 0);
  Tandem__Cluster__KvPush h = TANDEM__CLUSTER__KV_PUSH__INIT;
  h.version = TD_PROTOCOL_VERSION;
  h.rid = 91;
  h.reservation = t->reservation;
  h.cross = true;
  h.blocks = t->blocks;
  h.n_blocks = 1;
  h.block_bytes = giga;
  h.push_id = 5;
  uint8_t buf[256];
  size_t n = protobuf_c_message_pack(&h.base, buf);
  cr_assert_eq(zmq_send(s, buf, n, ZMQ_SNDMORE), (int)n);
  zmq_msg_t big;
  zmq_msg_init_data(&big, zero, giga, NULL, NULL);
  cr_assert_eq(zmq_msg_send(&big, s, 0), (int)giga);
  long peak = before;
  for (int64_t end = td_now_ms() + 3000; td_now_ms() < end; usleep(20000)) {
    long now = rss_kb();
    if (now > peak) peak = now;
  }
  zmq_close(s); /* nothing of the GiB was sent while it could read the mapping */
  munmap(zero, giga);
  cr_log_info("a 1 GiB KV frame: the worker's process grew by %ld kB", peak - before);
  cr_expect_lt(peak - before, 64 << 10, "a 1 GiB KV frame took the worker from %ld to %ld kB", before, peak);
  /* the KV socket still answers: a push of 0-byte blocks on a new connection is refused with a reason */
  s = zmq_socket(r.f.zctx, ZMQ_DEALER);
  zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
  cr_assert_eq(zmq_connect(s, d->zmq + 4), 0);
  h.block_bytes = 0;
  n = protobuf_c_message_pack(&h.base, buf);
  cr_assert_eq(zmq_send(s, buf, n, ZMQ_SNDMORE), (int)n);
  cr_assert_eq(zmq_send(s, "", 0, 0), 0);
  zmq_pollitem_t it = {.socket = s, .events = ZMQ_POLLIN};
  cr_assert_gt(zmq_poll(&it, 1, 10000), 0, "the worker no longer answers pushes");
  int got = zmq_recv(s, buf, sizeof buf, 0);
  cr_assert_gt(got, 0);
  Tandem__Cluster__KvAck *a = tandem__cluster__kv_ack__unpack(NULL, (size_t)got, buf);
  cr_assert_not_null(a);
  cr_expect(!a->ok && a->error && strstr(a->error, "blocks of 0 bytes"), "%s", a->error ? a->error : "(no error)");
  tandem__cluster__kv_ack__free_unpacked(a, NULL);
  zmq_close(s);
  tandem__cluster__transfer_desc__free_unpacked(d, NULL);
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  worker_stop(&r);
}

/* ---------------------------------------------------------------- drain, undrain, remove */

static void send_body(fake *f, Tandem__Cluster__RouterMessage__BodyCase body) {
  Tandem__Cluster__Drain d = TANDEM__CLUSTER__DRAIN__INIT;
  Tandem__Cluster__Undrain u = TANDEM__CLUSTER__UNDRAIN__INIT;
  Tandem__Cluster__Remove rm = TANDEM__CLUSTER__REMOVE__INIT;
  rm.reason = "removed by an operator";
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  m.body_case = body;
  if (body == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DRAIN) m.drain = &d;
  if (body == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_UNDRAIN) m.undrain = &u;
  if (body == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_REMOVE) m.remove = &rm;
  fake_send(f, &m);
}

static bool draining_asked(const Tandem__Cluster__Load *l) { return l->draining && !l->stopping; }
static bool serving(const Tandem__Cluster__Load *l) { return !l->draining; }
static bool stopping(const Tandem__Cluster__Load *l) { return l->draining && l->stopping; }

static void expect_load(fake *f, bool (*ok)(const Tandem__Cluster__Load *), const char *what) {
  wmsg *m = heartbeat_where(f, ok, 3000);
  cr_expect_not_null(m, "no heartbeat shows %s", what);
  if (m) tandem__cluster__worker_message__free_unpacked(m, NULL);
}

/* The router's Drain: the worker says it drains, refuses new jobs and keeps
 * the one it holds; Undrain: it serves again; Remove: it leaves at once,
 * without a deregistration (the router already forgot it). */
Test(worker_control, drain_undrain_and_remove_from_the_router, .timeout = 60) {
  static const td_role *const roles[] = {&td_role_decode};
  wrun r;
  worker_start(&r, roles, 1, "zmq", 60000, 50);
  cr_expect(strlen(r.reg->register_->info->version) > 0, "no build version in the registration");
  send_decode(&r.f, 71, 20, false, 1); /* reserved; its KV never comes, so the job stays */
  wmsg *m = fake_expect(&r.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED, 5000);
  cr_assert_not_null(m, "nothing reserved");
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  send_body(&r.f, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DRAIN);
  expect_load(&r.f, draining_asked, "the drain");
  send_decode(&r.f, 72, 4, true, 1);
  m = fake_expect(&r.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED, 3000);
  cr_assert_not_null(m, "a draining worker took a new job");
  cr_expect_eq(failed_rid(m), 72);
  cr_expect(m->failed->retryable);
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  send_body(&r.f, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_UNDRAIN);
  expect_load(&r.f, serving, "serving again");
  send_decode(&r.f, 73, 4, true, 1);
  m = fake_expect(&r.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FINISHED, 10000);
  cr_expect_not_null(m, "no result after the undrain");
  if (m) tandem__cluster__worker_message__free_unpacked(m, NULL);
  /* a signal's drain is not the router's to undo */
  r.stop = SIGTERM;
  expect_load(&r.f, stopping, "the signal's drain");
  send_body(&r.f, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_UNDRAIN);
  usleep(200 * 1000);
  expect_load(&r.f, stopping, "still stopping after an undrain");
  send_body(&r.f, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_REMOVE);
  int64_t t0 = td_now_ms();
  pthread_join(r.th, NULL);
  cr_expect_eq(r.s, TD_OK, "%s", td_errmsg());
  cr_expect_lt(td_now_ms() - t0, 2000, "the removed worker took %lld ms to leave", (long long)(td_now_ms() - t0));
  m = fake_expect(&r.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_DEREGISTER, 300);
  cr_expect_null(m, "a removed worker deregistered");
  if (m) tandem__cluster__worker_message__free_unpacked(m, NULL);
  td_worker_destroy(r.w);
  tandem__cluster__worker_message__free_unpacked(r.reg, NULL);
  zmq_close(r.f.sock);
  td_zap_destroy(r.f.zap);
  zmq_ctx_term(r.f.zctx);
}

/* ---------------------------------------------------------------- pushes from the named sender only */

/* A decode worker and an encoder worker, each against its own fake router:
 * the test plays the router, naming a sender for each reservation and
 * handing the encoder the target with whatever token the case needs. */
typedef struct kv_pair {
  wrun dec, enc;
} kv_pair;

static const td_role *const dec_roles[] = {&td_role_decode};
static const td_role *const enc_roles[] = {&td_role_encode};

static void pair_start(kv_pair *p, const char *transfer, const td_auth *dec_auth, const td_auth *enc_auth,
                       const td_auth *router_auth) {
  worker_start_as(&p->dec, dec_roles, 1, transfer, 60000, 50, "dec-test", dec_auth, router_auth);
  worker_start_as(&p->enc, enc_roles, 1, transfer, 0, 50, "enc-test", enc_auth, router_auth);
}

static void pair_stop(kv_pair *p) {
  worker_stop(&p->enc);
  worker_stop(&p->dec);
}

/* An encode job whose one target is t with `token` (NULL: none). */
static void send_encode_into(fake *f, uint64_t rid, const Tandem__Cluster__KvTarget *t, const uint8_t *token) {
  job_msg x;
  spec_init(&x, rid, t->tokens);
  tandem__cluster__encode_job__init(&x.ej);
  x.t = *t;
  x.t.token = (ProtobufCBinaryData){token ? TD_KV_TOKEN_BYTES : 0, (uint8_t *)token};
  x.ts[0] = &x.t;
  x.ej.req = &x.sp;
  x.ej.targets = x.ts;
  x.ej.n_targets = 1;
  x.m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE;
  x.m.encode = &x.ej;
  fake_send(f, &x.m);
}

/* The decode worker reserves for rid with `named` as its sender's token
 * (and sender_key); the Reserved message (the caller frees it). */
static wmsg *reserve_for(kv_pair *p, uint64_t rid, const uint8_t *named) {
  memcpy(sender_token, named, TD_KV_TOKEN_BYTES);
  send_decode(&p->dec.f, rid, 4, false, 1);
  wmsg *m = fake_expect(&p->dec.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED, 5000);
  cr_assert_not_null(m, "nothing reserved for %llu", (unsigned long long)rid);
  cr_assert_eq(m->reserved->rid, rid);
  return m;
}

/* The encoder's answer to its job: EncodeDone or Failed. */
static wmsg *encoder_outcome(kv_pair *p, uint64_t rid) {
  for (int64_t end = td_now_ms() + 20000; td_now_ms() < end;) {
    wmsg *m = fake_recv(&p->enc.f, 1000);
    if (!m) continue;
    if ((m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_ENCODE_DONE && m->encode_done->rid == rid) ||
        (m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED && m->failed->rid == rid))
      return m;
    tandem__cluster__worker_message__free_unpacked(m, NULL);
  }
  cr_assert_fail("the encoder never answered its job for %llu", (unsigned long long)rid);
  return NULL;
}

/* The encoder pushes into rid's reservation (named: the token the decode
 * worker was told, carried: the one the encoder got); true when the push
 * was refused, whose reason must hold `why`. A refused request is cancelled
 * on the decode worker; an accepted one runs to its result there. */
static bool encoder_push(kv_pair *p, uint64_t rid, const uint8_t *named, const uint8_t *carried, const char *why) {
  wmsg *res = reserve_for(p, rid, named);
  send_encode_into(&p->enc.f, rid, res->reserved->cross, carried);
  tandem__cluster__worker_message__free_unpacked(res, NULL);
  wmsg *m = encoder_outcome(p, rid);
  bool refused = m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED;
  if (refused) {
    cr_expect(strstr(m->failed->message, why), "request %llu: %s", (unsigned long long)rid, m->failed->message);
    send_cancel(&p->dec.f, rid);
  } else {
    wmsg *fin = fake_expect(&p->dec.f, TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FINISHED, 20000);
    cr_expect_not_null(fin, "request %llu: no result after its KV arrived", (unsigned long long)rid);
    if (fin) tandem__cluster__worker_message__free_unpacked(fin, NULL);
  }
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  return refused;
}

static uint64_t want_refused;
static bool refused_as_wanted(const Tandem__Cluster__Load *l) {
  return l->kv_refused == want_refused && l->free_cross_blocks == CROSS_BLOCKS;
}

/* The decode worker's heartbeat counts n refused pushes, and every block is back. */
static void expect_refused(kv_pair *p, uint64_t n) {
  want_refused = n;
  wmsg *m = heartbeat_where(&p->dec.f, refused_as_wanted, 5000);
  cr_expect_not_null(m, "no heartbeat counts %llu refused pushes with the pool free", (unsigned long long)n);
  if (m) tandem__cluster__worker_message__free_unpacked(m, NULL);
}

/* One raw KvPush into t from a socket of the test's (CURVE with `as`'s keys
 * to server_key when given); the KvAck's error ("" when ok), or NULL when
 * nothing answered within 2 s. *ok: the KvAck's verdict. */
static char *raw_push(void *zctx, const Tandem__Cluster__KvTarget *t, uint64_t rid, size_t block_bytes,
                      const td_auth *as, const char *server_key, bool *ok) {
  Tandem__Cluster__TransferDesc *d = tandem__cluster__transfer_desc__unpack(NULL, t->desc.len, t->desc.data);
  cr_assert(d && d->zmq && !strncmp(d->zmq, "zmq:", 4));
  char ep[256];
  snprintf(ep, sizeof ep, "%s", d->zmq + 4);
  char *sp = strchr(ep, ' '); /* "ENDPOINT KEY" with CURVE */
  if (sp) *sp = 0;
  tandem__cluster__transfer_desc__free_unpacked(d, NULL);
  void *s = zmq_socket(zctx, ZMQ_DEALER);
  int linger = 0;
  zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
  cr_assert_eq(td_auth_client(as, s, server_key), TD_OK, "%s", td_errmsg());
  cr_assert_eq(zmq_connect(s, ep), 0);
  Tandem__Cluster__KvPush h = TANDEM__CLUSTER__KV_PUSH__INIT;
  h.version = TD_PROTOCOL_VERSION;
  h.rid = rid;
  h.reservation = t->reservation;
  h.cross = true;
  h.blocks = t->blocks;
  h.n_blocks = t->n_blocks;
  h.block_bytes = block_bytes;
  h.push_id = 3;
  uint8_t hb[256];
  size_t n = protobuf_c_message_pack(&h.base, hb);
  cr_assert_eq(zmq_send(s, hb, n, t->n_blocks ? ZMQ_SNDMORE : 0), (int)n);
  uint8_t *block = calloc(1, block_bytes ? block_bytes : 1);
  for (size_t i = 0; i < t->n_blocks; i++)
    zmq_send(s, block, block_bytes, i + 1 < t->n_blocks ? ZMQ_SNDMORE : 0);
  free(block);
  char *err = NULL;
  zmq_pollitem_t it = {.socket = s, .events = ZMQ_POLLIN};
  if (zmq_poll(&it, 1, 2000) > 0) {
    uint8_t ab[1024];
    int got = zmq_recv(s, ab, sizeof ab, 0);
    Tandem__Cluster__KvAck *a = got > 0 ? tandem__cluster__kv_ack__unpack(NULL, (size_t)got, ab) : NULL;
    cr_assert_not_null(a, "a malformed KvAck");
    *ok = a->ok;
    err = strdup(a->error ? a->error : "");
    tandem__cluster__kv_ack__free_unpacked(a, NULL);
  }
  zmq_close(s);
  return err;
}

static const uint8_t named_a[TD_KV_TOKEN_BYTES] = {0xa1, 0xa2, 0xa3, 0xa4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
static const uint8_t named_b[TD_KV_TOKEN_BYTES] = {0xb1, 0xb2, 0xb3, 0xb4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
static const uint8_t stale[TD_KV_TOKEN_BYTES] = {0xa1, 0xa2, 0xa3, 0xa4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0};

/* Without keys over ZeroMQ: a stranger's push (no token), the encoder's push
 * with a token of another attempt, and with none, are refused before a byte
 * is written and counted; the encoder's push with the reservation's token
 * is taken and the request runs. */
Test(worker_control, kv_pushes_only_from_the_named_sender_over_zmq, .timeout = 120) {
  kv_pair p;
  pair_start(&p, "zmq", NULL, NULL, NULL);
  /* a stranger who learned the reservation: its blocks' size from a probe, then a push of them without a token */
  wmsg *res = reserve_for(&p, 201, named_a);
  bool ok = true;
  char *err = raw_push(p.dec.f.zctx, res->reserved->cross, 201, 0, NULL, NULL, &ok);
  cr_assert_not_null(err, "no answer to the probe");
  size_t bb = 0;
  const char *at = strstr(err, "this model's are ");
  cr_assert(at && sscanf(at, "this model's are %zu", &bb) == 1 && bb > 0, "%s", err);
  free(err);
  err = raw_push(p.dec.f.zctx, res->reserved->cross, 201, bb, NULL, NULL, &ok);
  cr_assert_not_null(err, "no answer to the stranger's push");
  cr_expect(!ok, "a push without the reservation's token was taken");
  cr_expect(strstr(err, "takes cross KV from enc-test only") && strstr(err, "no token"), "%s", err);
  free(err);
  send_cancel(&p.dec.f, 201);
  tandem__cluster__worker_message__free_unpacked(res, NULL);
  /* the encoder with the token of an attempt that is over, and with none */
  cr_expect(encoder_push(&p, 202, named_a, stale, "another token"), "a stale token was taken");
  cr_expect(encoder_push(&p, 203, named_b, NULL, "no token"), "a push without a token was taken");
  /* the named sender */
  cr_expect(!encoder_push(&p, 204, named_b, named_b, ""), "the named sender's push was refused");
  expect_refused(&p, 4); /* the probe, the stranger, the stale token, no token */
  pair_stop(&p);
}

/* The same over UCX (the token travels in the transfer's request). */
Test(worker_control, kv_pushes_only_from_the_named_sender_over_ucx, .timeout = 120) {
  kv_pair p;
  pair_start(&p, "ucx", NULL, NULL, NULL);
  cr_expect(encoder_push(&p, 301, named_a, NULL, "no token"), "a push without a token was taken");
  cr_expect(encoder_push(&p, 302, named_a, named_b, "another token"), "another worker's token was taken");
  cr_expect(!encoder_push(&p, 303, named_a, named_a, ""), "the named sender's push was refused");
  expect_refused(&p, 2);
  wmsg *m = heartbeat_where(&p.dec.f, NULL, 3000);
  cr_assert_not_null(m);
  cr_expect_gt(m->heartbeat->load->kv_in_ucx, 0, "the accepted push did not come over UCX");
  cr_expect_eq(m->heartbeat->load->kv_in_zmq, 0);
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  pair_stop(&p);
}

static char key_dir[64];

static td_auth *keys_of(const char *name, bool router) {
  char sec[128], rk[128], wl[128];
  snprintf(sec, sizeof sec, "%s/%s.key", key_dir, name);
  snprintf(rk, sizeof rk, "%s/router.pub", key_dir);
  snprintf(wl, sizeof wl, "%s/workers.list", key_dir);
  td_auth_opts o = {.secret_file = sec, .router_key_file = router ? NULL : rk, .worker_keys_file = wl};
  td_auth *a = NULL;
  cr_assert_eq(td_auth_create(&o, &a), TD_OK, "%s", td_errmsg());
  return a;
}

static void pub_key(const char *name, char out[TD_AUTH_KEY_Z85]) {
  char p[128];
  snprintf(p, sizeof p, "%s/%s.pub", key_dir, name);
  cr_assert_eq(td_auth_read_key(p, false, out), TD_OK, "%s", td_errmsg());
}

/* With CURVE: the reservation names the sender's key too. The encoder's
 * push with the right token is refused when the reservation names another
 * listed worker's key; a stranger's key never gets through the handshake;
 * the named key with its token is taken. */
Test(worker_control, kv_pushes_bound_to_the_named_key_with_curve, .timeout = 120) {
  snprintf(key_dir, sizeof key_dir, "/tmp/td-kvkeys-XXXXXX");
  cr_assert(mkdtemp(key_dir));
  const char *names[] = {"router", "dec", "enc", "other", "stranger"};
  for (int i = 0; i < 5; i++) {
    char pub[128], sec[128];
    snprintf(pub, sizeof pub, "%s/%s.pub", key_dir, names[i]);
    snprintf(sec, sizeof sec, "%s/%s.key", key_dir, names[i]);
    cr_assert_eq(td_auth_keygen(pub, sec), TD_OK, "%s", td_errmsg());
  }
  char list[128], k[TD_AUTH_KEY_Z85];
  snprintf(list, sizeof list, "%s/workers.list", key_dir);
  FILE *f = fopen(list, "w");
  cr_assert_not_null(f);
  for (int i = 1; i < 4; i++) {
    pub_key(names[i], k);
    fprintf(f, "%s\n", k);
  }
  fclose(f);
  td_auth *ra = keys_of("router", true), *da = keys_of("dec", false), *ea = keys_of("enc", false),
          *sa = keys_of("stranger", false);
  char enc_key[TD_AUTH_KEY_Z85], other_key[TD_AUTH_KEY_Z85], dec_key[TD_AUTH_KEY_Z85];
  pub_key("enc", enc_key);
  pub_key("other", other_key);
  pub_key("dec", dec_key);
  kv_pair p;
  pair_start(&p, "zmq", da, ea, ra);
  /* the right token from the wrong key: another listed worker's reservation */
  sender_key = other_key;
  cr_expect(encoder_push(&p, 401, named_a, named_a, "the push came from key "), "a push from another key was taken");
  /* a stranger's key: refused at the handshake, never counted as a push */
  wmsg *res = reserve_for(&p, 402, named_b);
  bool ok = true;
  char *err = raw_push(p.dec.f.zctx, res->reserved->cross, 402, 64, sa, dec_key, &ok);
  cr_expect_null(err, "a stranger's key got an answer: %s", err ? err : "");
  free(err);
  send_cancel(&p.dec.f, 402);
  tandem__cluster__worker_message__free_unpacked(res, NULL);
  /* the named key with its token */
  sender_key = enc_key;
  cr_expect(!encoder_push(&p, 403, named_b, named_b, ""), "the named sender's push was refused");
  expect_refused(&p, 1);
  sender_key = "";
  pair_stop(&p);
  td_auth_destroy(ra);
  td_auth_destroy(da);
  td_auth_destroy(ea);
  td_auth_destroy(sa);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", key_dir);
  cr_expect_eq(system(cmd), 0);
}
