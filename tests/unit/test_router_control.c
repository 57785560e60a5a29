/* The router's control plane in one process: td_router on inproc://
 * endpoints in a thread, fake workers and a client written here on raw
 * sockets. Registration, placement of a Generate, tokens and results back
 * with their offsets (across a retry too), cancel, stage timeouts,
 * deadlines, worker death, group rendezvous, the refusal of a request
 * no registered decode worker can run, and the bounds against peers: a
 * GroupJoin flood, the bytes of requests held, the wait for a role no live
 * worker has (--capacity-wait-ms). */
#include <criterion/criterion.h>
#include <malloc.h>
#include <math.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <signal.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/defaults.h"
#include "common/log.h"
#include "proto/link.h"
#include "proto/wire.h"
#include "client/client.h"
#include "router/router.h"

#if defined(__SANITIZE_ADDRESS__)
size_t __sanitizer_get_current_allocated_bytes(void); /* sanitizer/allocator_interface.h, not shipped with gcc here */
#endif

#define WAIT_MS 3000 /* what a test waits for a message that must come */

typedef struct harness {
  void *ctx;
  td_router *r;
  pthread_t th;
  volatile sig_atomic_t stop;
  td_status run_status; /* td_router_run's, checked once it returned */
  char cep[64], wep[64];
  void *client;
} harness;

static void *run_router(void *arg) {
  harness *h = arg;
  h->run_status = td_router_run(h->r, &h->stop);
  return NULL;
}

static void *dealer(harness *h, const char *ep, const char *id) {
  void *s = zmq_socket(h->ctx, ZMQ_DEALER);
  td_wire_setup_socket(s);
  if (id) zmq_setsockopt(s, ZMQ_ROUTING_ID, id, strlen(id));
  cr_assert_eq(zmq_connect(s, ep), 0);
  return s;
}

/* The router on inproc endpoints with o as given (0: its defaults). */
static void start_as_is(harness *h, td_router_opts o) {
  memset(h, 0, sizeof *h);
  td_log_set_level(TD_LOG_ERROR);
  h->ctx = zmq_ctx_new();
  snprintf(h->cep, sizeof h->cep, "inproc://router-clients");
  snprintf(h->wep, sizeof h->wep, "inproc://router-workers");
  o.client_endpoint = h->cep;
  o.worker_endpoint = h->wep;
  o.zmq_ctx = h->ctx;
  cr_assert_eq(td_router_create(&o, &h->r), TD_OK, "%s", td_errmsg());
  pthread_create(&h->th, NULL, run_router, h);
  h->client = dealer(h, h->cep, NULL);
}

/* Heartbeats both ways are slow unless a test asks: a fake worker that
 * sends none stays alive. */
static void start(harness *h, td_router_opts o) {
  if (!o.heartbeat_ms) o.heartbeat_ms = 1000;
  if (!o.dead_after) o.dead_after = 30;
  start_as_is(h, o);
}

static void finish(harness *h, void **socks, int n) {
  h->stop = 1;
  pthread_join(h->th, NULL);
  cr_expect_eq(h->run_status, TD_OK, "the router's loop failed: %s", td_errmsg());
  td_router_destroy(h->r);
  for (int i = 0; i < n; i++) zmq_close(socks[i]);
  zmq_close(h->client);
  zmq_ctx_term(h->ctx);
}

/* ------------------------------------------------------------ fake workers */

typedef struct fake_opts {
  const char *roles; /* "e", "p", "d" */
  int max_running, cross_blocks;
  const char *cross_mode;
  int block_size;
  bool no_start_token; /* register without the model's decoder start token */
  int enc_batch;       /* encoder positions a run (0: not registered) */
  const char *route;   /* the connection's routing identity (NULL: the id) */
  void (*mutate)(Tandem__Cluster__WorkerInfo *); /* changes the registration before it goes */
} fake_opts;

#define START_TOKEN 3 /* the fake model's decoder start token */
#define EOS_TOKEN 2   /* the fake model's EOS */

static void wsend(void *s, Tandem__Cluster__WorkerMessage *m) {
  m->version = TD_PROTOCOL_VERSION;
  cr_assert_eq(td_wire_send(s, NULL, 0, &m->base), TD_OK);
}

/* The next message from the router that is not a heartbeat, or NULL. */
static Tandem__Cluster__RouterMessage *wrecv(void *s, int timeout_ms) {
  int64_t end = td_now_ms() + timeout_ms;
  for (;;) {
    int64_t left = end - td_now_ms();
    zmq_pollitem_t it = {.socket = s, .events = ZMQ_POLLIN};
    if (left < 0 || zmq_poll(&it, 1, (long)left) <= 0) return NULL;
    td_wire_frame f;
    if (td_wire_recv(s, false, false, &f) != TD_OK) continue;
    Tandem__Cluster__RouterMessage *m = NULL;
    uint32_t ver;
    td_status st = td_wire_unpack_router(&f, &m, &ver);
    td_wire_frame_free(&f);
    cr_assert_eq(st, TD_OK);
    if (m->body_case != TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_HEARTBEAT) return m;
    tandem__cluster__router_message__free_unpacked(m, NULL);
  }
}

static Tandem__Cluster__RouterMessage *wexpect(void *s, Tandem__Cluster__RouterMessage__BodyCase want,
                                               const char *what) {
  Tandem__Cluster__RouterMessage *m = wrecv(s, WAIT_MS);
  cr_assert(m, "%s: nothing came", what);
  cr_assert_eq(m->body_case, want, "%s: message %d, want %d", what, m->body_case, want);
  return m;
}

static void wfree(Tandem__Cluster__RouterMessage *m) { tandem__cluster__router_message__free_unpacked(m, NULL); }

/* A registration as a worker sends it, whatever carries it: every part
 * lives in the struct (the message points into it). */
typedef struct fake_reg {
  Tandem__ModelInfo mi;
  Tandem__TokenId start;
  int32_t eos[1];
  Tandem__Cluster__Role roles[3];
  Tandem__Cluster__WorkerInfo in;
  Tandem__Cluster__Register reg;
  Tandem__Cluster__WorkerMessage m;
} fake_reg;

static void fill_register(fake_reg *r, const char *id, fake_opts fo) {
  memset(r, 0, sizeof *r);
  r->mi = (Tandem__ModelInfo)TANDEM__MODEL_INFO__INIT;
  r->mi.model_type = "t5";
  r->mi.vocab_size = 100;
  r->mi.max_source_len = 64;
  r->mi.max_target_len = 32;
  r->start = (Tandem__TokenId)TANDEM__TOKEN_ID__INIT;
  r->start.id = START_TOKEN;
  if (!fo.no_start_token) r->mi.decoder_start = &r->start;
  r->eos[0] = EOS_TOKEN;
  r->mi.eos_token_ids = r->eos;
  r->mi.n_eos_token_ids = 1;
  size_t nr = 0;
  if (strchr(fo.roles, 'e')) r->roles[nr++] = TANDEM__CLUSTER__ROLE__ROLE_ENCODE;
  if (strchr(fo.roles, 'p')) r->roles[nr++] = TANDEM__CLUSTER__ROLE__ROLE_PREFILL;
  if (strchr(fo.roles, 'd')) r->roles[nr++] = TANDEM__CLUSTER__ROLE__ROLE_DECODE;
  r->in = (Tandem__Cluster__WorkerInfo)TANDEM__CLUSTER__WORKER_INFO__INIT;
  r->in.worker_id = (char *)id;
  r->in.roles = r->roles;
  r->in.n_roles = nr;
  r->in.model = &r->mi;
  r->in.block_size = fo.block_size ? (uint32_t)fo.block_size : 16;
  r->in.self_blocks = 1000;
  r->in.cross_blocks = fo.cross_blocks ? (uint32_t)fo.cross_blocks : 1000;
  r->in.max_running = fo.max_running ? (uint32_t)fo.max_running : 32;
  r->in.cross_mode = (char *)(fo.cross_mode ? fo.cross_mode : "auto");
  r->in.encode_batch_tokens = (uint32_t)fo.enc_batch;
  if (fo.mutate) fo.mutate(&r->in);
  r->reg = (Tandem__Cluster__Register)TANDEM__CLUSTER__REGISTER__INIT;
  r->reg.info = &r->in;
  r->m = (Tandem__Cluster__WorkerMessage)TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  r->m.version = TD_PROTOCOL_VERSION;
  r->m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_REGISTER;
  r->m.register_ = &r->reg;
}

/* Connects and registers; returns the socket and the router's answer. */
static void *fake_register(harness *h, const char *id, fake_opts fo, Tandem__Cluster__RouterMessage **ack) {
  void *s = dealer(h, h->wep, fo.route ? fo.route : id);
  fake_reg r;
  fill_register(&r, id, fo);
  wsend(s, &r.m);
  *ack = wexpect(s, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ACK, "registration");
  return s;
}

static void *fake_worker(harness *h, const char *id, fake_opts fo) {
  Tandem__Cluster__RouterMessage *ack;
  void *s = fake_register(h, id, fo, &ack);
  cr_assert(ack->ack->accepted, "%s refused: %s", id, ack->ack->reason);
  wfree(ack);
  return s;
}

static void send_tokens(void *s, uint64_t rid, uint32_t offset, const int32_t *t, size_t n) {
  Tandem__Cluster__Tokens tk = TANDEM__CLUSTER__TOKENS__INIT;
  tk.rid = rid;
  tk.offset = offset;
  tk.tokens = (int32_t *)t;
  tk.n_tokens = n;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS;
  m.tokens = &tk;
  wsend(s, &m);
}

static void send_finished_first(void *s, uint64_t rid, const int32_t *t, size_t n, double first_ms) {
  Tandem__SequenceOutput o = TANDEM__SEQUENCE_OUTPUT__INIT;
  o.tokens = (int32_t *)t;
  o.n_tokens = n;
  o.finish_reason = TANDEM__FINISH_REASON__FINISH_LENGTH;
  Tandem__SequenceOutput *op = &o;
  Tandem__Cluster__Finished fin = TANDEM__CLUSTER__FINISHED__INIT;
  fin.rid = rid;
  fin.outputs = &op;
  fin.n_outputs = 1;
  fin.first_token_ms = first_ms;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FINISHED;
  m.finished = &fin;
  wsend(s, &m);
}

static void send_finished(void *s, uint64_t rid, const int32_t *t, size_t n) { send_finished_first(s, rid, t, n, 0); }

static void send_body(void *s, Tandem__Cluster__WorkerMessage *m) { wsend(s, m); }

/* A reservation as a worker reports it: its own id, a ZeroMQ descriptor,
 * the blocks for `tokens` encoder tokens (the test's requests have 3). */
static void kv_target(Tandem__Cluster__KvTarget *kt, const char *worker, int32_t *blocks, size_t n, uint32_t tokens) {
  static const char desc[] = "zmq:tcp://127.0.0.1:9";
  kt->worker_id = (char *)worker;
  kt->desc.data = (uint8_t *)desc;
  kt->desc.len = sizeof desc - 1;
  kt->blocks = blocks;
  kt->n_blocks = n;
  kt->tokens = tokens;
}

/* The decode worker "dec" on socket d reports its reservation for request
 * rid: one cross block for `tokens` encoder tokens. */
static void send_reserved(void *d, uint64_t rid, int32_t block, uint32_t tokens) {
  int32_t blocks[1] = {block};
  Tandem__Cluster__KvTarget kt = TANDEM__CLUSTER__KV_TARGET__INIT;
  kv_target(&kt, "dec", blocks, 1, tokens);
  Tandem__Cluster__Reserved res = TANDEM__CLUSTER__RESERVED__INIT;
  res.rid = rid;
  res.cross = &kt;
  Tandem__Cluster__WorkerMessage rm = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  rm.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED;
  rm.reserved = &res;
  send_body(d, &rm);
}

/* The worker gave up on an attempt that another may take. */
static void send_retryable(void *s, uint64_t rid, const char *why) {
  Tandem__Cluster__Failed f = TANDEM__CLUSTER__FAILED__INIT;
  f.rid = rid;
  f.retryable = true;
  f.message = (char *)why;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED;
  m.failed = &f;
  wsend(s, &m);
}

/* ------------------------------------------------------------ the client */

typedef struct gen {
  const char *id;
  int n, max_new;
  bool stream;
  uint32_t timeout_ms;
  const int32_t *prompt; /* decoder prompt (NULL: the model's start token) */
  int n_prompt;
  const int32_t *stop; /* stop_token_ids */
  int n_stop;
  int n_input; /* encoder tokens (0: 3) */
} gen;

static void generate(harness *h, gen q) {
  static int32_t ids[32] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20};
  Tandem__SamplingParams sp = TANDEM__SAMPLING_PARAMS__INIT;
  sp.n = (uint32_t)q.n;
  sp.temperature = q.n > 1 ? 1.0f : 0.0f;
  Tandem__GenerateRequest g = TANDEM__GENERATE_REQUEST__INIT;
  g.request_id = (char *)q.id;
  g.input_ids = ids;
  g.n_input_ids = q.n_input ? (size_t)q.n_input : 3;
  g.sampling = &sp;
  g.max_new_tokens = (uint32_t)q.max_new;
  g.stream = q.stream;
  g.timeout_ms = q.timeout_ms;
  g.decoder_prompt = (int32_t *)q.prompt;
  g.n_decoder_prompt = (size_t)q.n_prompt;
  g.stop_token_ids = (int32_t *)q.stop;
  g.n_stop_token_ids = (size_t)q.n_stop;
  Tandem__ClientMessage m = TANDEM__CLIENT_MESSAGE__INIT;
  m.version = TD_PROTOCOL_VERSION;
  m.body_case = TANDEM__CLIENT_MESSAGE__BODY_GENERATE;
  m.generate = &g;
  cr_assert_eq(td_wire_send(h->client, NULL, 0, &m.base), TD_OK);
}

static void cancel(harness *h, const char *id) {
  Tandem__CancelRequest c = TANDEM__CANCEL_REQUEST__INIT;
  c.request_id = (char *)id;
  Tandem__ClientMessage m = TANDEM__CLIENT_MESSAGE__INIT;
  m.version = TD_PROTOCOL_VERSION;
  m.body_case = TANDEM__CLIENT_MESSAGE__BODY_CANCEL;
  m.cancel = &c;
  cr_assert_eq(td_wire_send(h->client, NULL, 0, &m.base), TD_OK);
}

static Tandem__ServerMessage *crecv(harness *h, int timeout_ms) {
  zmq_pollitem_t it = {.socket = h->client, .events = ZMQ_POLLIN};
  if (zmq_poll(&it, 1, timeout_ms) <= 0) return NULL;
  td_wire_frame f;
  cr_assert_eq(td_wire_recv(h->client, false, false, &f), TD_OK);
  Tandem__ServerMessage *m = NULL;
  uint32_t ver;
  cr_assert_eq(td_wire_unpack_server(&f, &m, &ver), TD_OK);
  td_wire_frame_free(&f);
  return m;
}

static Tandem__ServerMessage *cexpect(harness *h, Tandem__ServerMessage__BodyCase want, const char *what) {
  Tandem__ServerMessage *m = crecv(h, WAIT_MS);
  cr_assert(m, "%s: nothing came to the client", what);
  cr_assert_eq(m->body_case, want, "%s: message %d, want %d (%s)", what, m->body_case, want,
               m->body_case == TANDEM__SERVER_MESSAGE__BODY_ERROR ? m->error->message : "");
  return m;
}

static void cfree(Tandem__ServerMessage *m) { tandem__server_message__free_unpacked(m, NULL); }

static void expect_error(harness *h, const char *id, Tandem__ErrorCode code, const char *says) {
  Tandem__ServerMessage *m = cexpect(h, TANDEM__SERVER_MESSAGE__BODY_ERROR, id);
  cr_expect_str_eq(m->request_id, id);
  cr_expect_eq(m->error->code, code, "code %d, want %d: %s", m->error->code, code, m->error->message);
  cr_expect(strstr(m->error->message, says), "\"%s\" does not say \"%s\"", m->error->message, says);
  cfree(m);
}

/* Chunks arrive one a message or several in a ChunkBatch; they are taken
 * in order, a message read when none is held. */
typedef struct held_chunk {
  char id[64];
  uint32_t offset;
  int32_t t[64];
  size_t n;
} held_chunk;
static held_chunk held[256];
static int n_held, at_held, batches_seen;

static void hold(const char *id, const Tandem__TokenChunk *c) {
  cr_assert_lt(n_held, 256);
  held_chunk *x = &held[n_held++];
  snprintf(x->id, sizeof x->id, "%s", id);
  x->offset = c->offset;
  cr_assert_leq(c->n_tokens, 64);
  x->n = c->n_tokens;
  memcpy(x->t, c->tokens, sizeof *x->t * c->n_tokens);
}

static void expect_chunk(harness *h, const char *id, uint32_t offset, const int32_t *t, size_t n) {
  if (at_held == n_held) {
    n_held = at_held = 0;
    Tandem__ServerMessage *m = crecv(h, WAIT_MS);
    cr_assert_not_null(m, "a token chunk: nothing came");
    if (m->body_case == TANDEM__SERVER_MESSAGE__BODY_TOKENS) {
      hold(m->request_id, m->tokens);
    } else {
      cr_assert_eq(m->body_case, TANDEM__SERVER_MESSAGE__BODY_CHUNKS, "a token chunk: message %d", (int)m->body_case);
      batches_seen++;
      for (size_t i = 0; i < m->chunks->n_items; i++) hold(m->chunks->items[i]->request_id, m->chunks->items[i]->chunk);
    }
    cfree(m);
  }
  held_chunk *x = &held[at_held++];
  cr_expect_str_eq(x->id, id);
  cr_expect_eq(x->offset, offset, "chunk at offset %u, want %u", x->offset, offset);
  cr_assert_eq(x->n, n);
  cr_expect_arr_eq(x->t, t, sizeof *t * n);
}

static void expect_result(harness *h, const char *id, const int32_t *t, size_t n, uint32_t attempts) {
  Tandem__ServerMessage *m = cexpect(h, TANDEM__SERVER_MESSAGE__BODY_RESULT, "the result");
  cr_expect_str_eq(m->request_id, id);
  cr_assert_eq(m->result->n_outputs, 1);
  cr_assert_eq(m->result->outputs[0]->n_tokens, n, "%zu tokens, want %zu", m->result->outputs[0]->n_tokens, n);
  cr_expect_arr_eq(m->result->outputs[0]->tokens, t, sizeof *t * n);
  cr_expect_eq(m->result->timings->attempts, attempts);
  cfree(m);
}

static void expect_quiet(harness *h, int ms) {
  Tandem__ServerMessage *m = crecv(h, ms);
  cr_expect(!m, "the client got message %d", m ? (int)m->body_case : 0);
  if (m) cfree(m);
}

static Tandem__HealthResponse *health(harness *h, Tandem__ServerMessage **holder) {
  Tandem__HealthRequest hr = TANDEM__HEALTH_REQUEST__INIT;
  Tandem__ClientMessage m = TANDEM__CLIENT_MESSAGE__INIT;
  m.version = TD_PROTOCOL_VERSION;
  m.body_case = TANDEM__CLIENT_MESSAGE__BODY_HEALTH;
  m.health = &hr;
  cr_assert_eq(td_wire_send(h->client, NULL, 0, &m.base), TD_OK);
  *holder = cexpect(h, TANDEM__SERVER_MESSAGE__BODY_HEALTH, "health");
  return (*holder)->health;
}

static const fake_opts enc_dec = {.roles = "ed"};

/* ------------------------------------------------------------ tests */

Test(router_control, registration_refusals_and_health, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){.heartbeat_ms = 700, .dead_after = 9});
  Tandem__Cluster__RouterMessage *ack;
  void *w = fake_register(&h, "w0", enc_dec, &ack);
  cr_expect(ack->ack->accepted);
  cr_expect_eq(ack->ack->heartbeat_ms, 700);
  cr_expect_eq(ack->ack->dead_after, 9);
  wfree(ack);
  void *other = fake_register(&h, "w1", (fake_opts){.roles = "d", .cross_mode = "states"}, &ack);
  cr_expect(!ack->ack->accepted);
  cr_expect(strstr(ack->ack->reason, "cross pool mode differs"), "%s", ack->ack->reason);
  wfree(ack);
  void *blocks = fake_register(&h, "w2", (fake_opts){.roles = "d", .block_size = 32}, &ack);
  cr_expect(!ack->ack->accepted);
  cr_expect(strstr(ack->ack->reason, "block size 32, the cluster uses 16"), "%s", ack->ack->reason);
  wfree(ack);
  void *nostart = fake_register(&h, "w3", (fake_opts){.roles = "d", .no_start_token = true}, &ack);
  cr_expect(!ack->ack->accepted);
  cr_expect(strstr(ack->ack->reason, "decoder start token"), "%s", ack->ack->reason);
  wfree(ack);
  Tandem__ServerMessage *hm;
  Tandem__HealthResponse *hr = health(&h, &hm);
  cr_expect_eq(hr->decoders, 1);
  cr_expect_eq(hr->encoders, 1);
  cr_assert_eq(hr->n_workers, 1);
  cr_expect_str_eq(hr->workers[0]->id, "w0");
  cfree(hm);
  void *socks[] = {w, other, blocks, nostart};
  finish(&h, socks, 4);
}

Test(router_control, generate_is_placed_and_tokens_flow_back_with_offsets, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){0});
  void *w = fake_worker(&h, "w0", enc_dec);
  generate(&h, (gen){.id = "a", .max_new = 3, .stream = true});
  Tandem__Cluster__RouterMessage *job = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "the decode job");
  const Tandem__Cluster__RequestSpec *sp = job->decode->req;
  cr_expect(job->decode->local_encode, "the decode worker encodes too");
  cr_expect(!job->decode->with_prefill);
  cr_expect_eq(sp->n_input_ids, 3);
  cr_expect_eq(sp->max_new_tokens, 3);
  cr_expect_eq(sp->step_offset, 0);
  cr_expect_eq(sp->enc_len, 3);
  cr_expect_str_eq(sp->client_id, "a");
  uint64_t rid = sp->rid;
  wfree(job);
  int32_t t[3] = {7, 8, 9};
  send_tokens(w, rid, 0, t, 1);
  send_tokens(w, rid, 1, t + 1, 2);
  send_finished(w, rid, t, 3);
  expect_chunk(&h, "a", 0, t, 1);
  expect_chunk(&h, "a", 1, t + 1, 2);
  expect_result(&h, "a", t, 3, 1);
  void *socks[] = {w};
  finish(&h, socks, 1);
}

/* Timings: the first token at the router measured below the millisecond,
 * the decode worker's part of it as it reports (a report past the router's
 * own measure is cut to it: a worker's word), none where it reports none. */
Test(router_control, first_token_timings_carry_the_workers_part, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){0});
  void *w = fake_worker(&h, "w0", enc_dec);
  static const double claims[] = {4.5, 1e6, 0};
  for (int i = 0; i < 3; i++) {
    char id[8];
    snprintf(id, sizeof id, "f%d", i);
    generate(&h, (gen){.id = id, .max_new = 2});
    Tandem__Cluster__RouterMessage *job = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "the decode job");
    uint64_t rid = job->decode->req->rid;
    wfree(job);
    usleep(12000);
    int32_t t[2] = {7, 8};
    send_tokens(w, rid, 0, t, 2);
    send_finished_first(w, rid, t, 2, claims[i]);
    Tandem__ServerMessage *m = cexpect(&h, TANDEM__SERVER_MESSAGE__BODY_RESULT, "the result");
    const Tandem__Timings *tm = m->result->timings;
    cr_assert_not_null(tm);
    cr_expect(tm->first_token_ms >= 12.0 && tm->first_token_ms < 5000, "%s: first token %g ms", id, tm->first_token_ms);
    cr_expect(tm->first_token_ms != (double)(int64_t)tm->first_token_ms, "%s: %g ms, whole milliseconds", id,
              tm->first_token_ms);
    double want = i == 0 ? 4.5 : i == 1 ? tm->first_token_ms : 0;
    cr_expect_float_eq(tm->worker_first_token_ms, want, 1e-9, "%s: the worker's part %g, want %g", id,
                       tm->worker_first_token_ms, want);
    cfree(m);
  }
  void *socks[] = {w};
  finish(&h, socks, 1);
}

/* --spin-us: a loop that polls without sleeping after work serves as one
 * that sleeps; a window past TD_MAX_SPIN_US is refused at creation. */
Test(router_control, a_spinning_router_serves_and_absurd_spins_are_refused, .timeout = 30) {
  td_router *bad = NULL;
  td_router_opts bo = {.client_endpoint = "inproc://spin-c", .worker_endpoint = "inproc://spin-w",
                       .spin_us = TD_MAX_SPIN_US + 1};
  cr_expect_eq(td_router_create(&bo, &bad), TD_ERR_INVALID);
  cr_expect(strstr(td_errmsg(), "spin_us 100001 is outside 0 to 100000"), "%s", td_errmsg());
  cr_expect_null(bad);
  harness h;
  start(&h, (td_router_opts){.spin_us = 2000});
  void *w = fake_worker(&h, "w0", enc_dec);
  for (int k = 0; k < 3; k++) {
    char id[8];
    snprintf(id, sizeof id, "s%d", k);
    generate(&h, (gen){.id = id, .max_new = 2, .stream = true});
    Tandem__Cluster__RouterMessage *job = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "the decode job");
    uint64_t rid = job->decode->req->rid;
    wfree(job);
    int32_t t[2] = {7, 8};
    send_tokens(w, rid, 0, t, 2);
    send_finished(w, rid, t, 2);
    expect_chunk(&h, id, 0, t, 2);
    expect_result(&h, id, t, 2, 1);
  }
  void *socks[] = {w};
  finish(&h, socks, 1);
}

/* A worker's step of many sequences comes as one TokensBatch: each item
 * reaches its own request, in order, and a client's chunks of the batch
 * go to it as one ChunkBatch. */
Test(router_control, a_batch_of_tokens_reaches_each_request, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){0});
  void *w = fake_worker(&h, "w0", enc_dec);
  generate(&h, (gen){.id = "a", .max_new = 2, .stream = true});
  generate(&h, (gen){.id = "b", .max_new = 2, .stream = true});
  uint64_t rid[2];
  for (int i = 0; i < 2; i++) {
    Tandem__Cluster__RouterMessage *job = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "a decode job");
    rid[i] = job->decode->req->rid;
    cr_expect_str_eq(job->decode->req->client_id, i ? "b" : "a");
    wfree(job);
  }
  int32_t ta[2] = {7, 8}, tb[2] = {5, 6};
  Tandem__Cluster__Tokens items[4];
  Tandem__Cluster__Tokens *ptrs[4];
  for (int k = 0; k < 4; k++) { /* two steps of both: a, b, a, b */
    tandem__cluster__tokens__init(&items[k]);
    items[k].rid = rid[k % 2];
    items[k].offset = (uint32_t)(k / 2);
    items[k].tokens = (k % 2 ? tb : ta) + k / 2;
    items[k].n_tokens = 1;
    ptrs[k] = &items[k];
  }
  Tandem__Cluster__TokensBatch b = TANDEM__CLUSTER__TOKENS_BATCH__INIT;
  b.items = ptrs;
  b.n_items = 4;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS_BATCH;
  m.tokens_batch = &b;
  send_body(w, &m);
  batches_seen = 0;
  expect_chunk(&h, "a", 0, ta, 1);
  expect_chunk(&h, "b", 0, tb, 1);
  expect_chunk(&h, "a", 1, ta + 1, 1);
  expect_chunk(&h, "b", 1, tb + 1, 1);
  cr_expect_eq(batches_seen, 1, "the batch's four chunks came in %d ChunkBatch messages, want one", batches_seen);
  send_finished(w, rid[0], ta, 2);
  expect_result(&h, "a", ta, 2, 1);
  send_finished(w, rid[1], tb, 2);
  expect_result(&h, "b", tb, 2, 1);
  void *socks[] = {w};
  finish(&h, socks, 1);
}

Test(router_control, a_retry_resumes_the_sequence_and_its_offsets_continue, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){0});
  void *w = fake_worker(&h, "w0", enc_dec);
  generate(&h, (gen){.id = "a", .max_new = 5, .stream = true});
  Tandem__Cluster__RouterMessage *job = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "first attempt");
  uint64_t rid1 = job->decode->req->rid;
  wfree(job);
  int32_t t[5] = {7, 8, 9, 10, 11};
  send_tokens(w, rid1, 0, t, 2);
  expect_chunk(&h, "a", 0, t, 2);
  send_retryable(w, rid1, "transfer failed");
  Tandem__Cluster__RouterMessage *c = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL, "the first's cancel");
  cr_expect_eq(c->cancel->rid, rid1);
  wfree(c);
  job = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "second attempt");
  const Tandem__Cluster__RequestSpec *sp = job->decode->req;
  uint64_t rid2 = sp->rid;
  cr_expect_neq(rid2, rid1, "every attempt has its own rid");
  /* the request gave no prompt: the model's start token, then what was streamed */
  int32_t resumed[3] = {START_TOKEN, 7, 8};
  cr_assert_eq(sp->n_decoder_prompt, 3, "the start token and the streamed tokens become the prompt");
  cr_expect_arr_eq(sp->decoder_prompt, resumed, sizeof resumed);
  cr_expect_eq(sp->step_offset, 2);
  cr_expect_eq(sp->max_new_tokens, 3);
  wfree(job);
  /* a late message of the first attempt is not the request's */
  send_tokens(w, rid1, 2, t + 2, 1);
  c = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL, "a stale attempt's cancel");
  cr_expect_eq(c->cancel->rid, rid1);
  wfree(c);
  send_tokens(w, rid2, 0, t + 2, 3); /* the worker counts from its own start */
  send_finished(w, rid2, t + 2, 3);
  expect_chunk(&h, "a", 2, t + 2, 3);
  expect_result(&h, "a", t, 5, 2);
  void *socks[] = {w};
  finish(&h, socks, 1);
}

/* A request with its own decoder prompt resumes from that prompt and the
 * streamed tokens, with no start token added. */
Test(router_control, a_retry_keeps_the_requests_own_prompt, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){0});
  void *w = fake_worker(&h, "w0", enc_dec);
  static const int32_t own[2] = {50, 51};
  generate(&h, (gen){.id = "p", .max_new = 4, .stream = true, .prompt = own, .n_prompt = 2});
  Tandem__Cluster__RouterMessage *job = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "first attempt");
  uint64_t rid1 = job->decode->req->rid;
  cr_assert_eq(job->decode->req->n_decoder_prompt, 2);
  wfree(job);
  int32_t t[1] = {9};
  send_tokens(w, rid1, 0, t, 1);
  expect_chunk(&h, "p", 0, t, 1);
  send_retryable(w, rid1, "worker lost");
  wfree(wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL, "the first's cancel"));
  job = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "second attempt");
  int32_t resumed[3] = {50, 51, 9};
  cr_assert_eq(job->decode->req->n_decoder_prompt, 3);
  cr_expect_arr_eq(job->decode->req->decoder_prompt, resumed, sizeof resumed);
  cr_expect_eq(job->decode->req->step_offset, 1);
  wfree(job);
  void *socks[] = {w};
  finish(&h, socks, 1);
}

/* A sequence whose every token was streamed before its worker failed is
 * done: it ends with those tokens (at its length, at a stop token it
 * asked for, or at the model's EOS) instead of going to another worker with nothing left to
 * generate. */
Test(router_control, a_retry_after_the_last_token_ends_the_request, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){0});
  void *w = fake_worker(&h, "w0", enc_dec);
  static const int32_t stop[1] = {9};
  const gen reqs[3] = {{.id = "len", .max_new = 2, .stream = true},
                       {.id = "stop", .max_new = 5, .stream = true, .stop = stop, .n_stop = 1},
                       {.id = "eos", .max_new = 5, .stream = true}};
  const char *ids[3] = {"len", "stop", "eos"};
  int32_t t[3][2] = {{7, 8}, {7, 9}, {7, EOS_TOKEN}};
  Tandem__FinishReason want[3] = {TANDEM__FINISH_REASON__FINISH_LENGTH, TANDEM__FINISH_REASON__FINISH_STOP,
                                  TANDEM__FINISH_REASON__FINISH_STOP};
  for (int k = 0; k < 3; k++) {
    generate(&h, reqs[k]);
    Tandem__Cluster__RouterMessage *job = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, ids[k]);
    uint64_t rid = job->decode->req->rid;
    cr_expect_str_eq(job->decode->req->client_id, ids[k]);
    wfree(job);
    send_tokens(w, rid, 0, t[k], 2);
    expect_chunk(&h, ids[k], 0, t[k], 2);
    send_retryable(w, rid, "worker lost");
    Tandem__ServerMessage *m = cexpect(&h, TANDEM__SERVER_MESSAGE__BODY_RESULT, ids[k]);
    cr_expect_str_eq(m->request_id, ids[k]);
    cr_assert_eq(m->result->n_outputs, 1);
    cr_assert_eq(m->result->outputs[0]->n_tokens, 2);
    cr_expect_arr_eq(m->result->outputs[0]->tokens, t[k], sizeof t[k]);
    cr_expect_eq(m->result->outputs[0]->finish_reason, want[k], "%s: finish %d", ids[k],
                 m->result->outputs[0]->finish_reason);
    cr_expect_eq(m->result->timings->attempts, 1);
    cfree(m);
    Tandem__Cluster__RouterMessage *c = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL, "the cancel");
    cr_expect_eq(c->cancel->rid, rid);
    wfree(c);
  }
  Tandem__Cluster__RouterMessage *more = wrecv(w, 200);
  cr_expect(!more, "a finished request went to a worker again (message %d)", more ? (int)more->body_case : 0);
  if (more) wfree(more);
  void *socks[] = {w};
  finish(&h, socks, 1);
}

/* A ROUTER identity is bytes; the router keys workers by a string, so a
 * peer whose identity is empty or holds a zero byte (a socket without a
 * routing id gets one that starts with zero) is refused, not registered. */
Test(router_control, a_worker_without_a_string_identity_is_refused, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){0});
  Tandem__Cluster__RouterMessage *ack;
  void *anon = fake_register(&h, NULL, enc_dec, &ack);
  cr_expect(!ack->ack->accepted, "a worker without an id was registered");
  cr_expect(strstr(ack->ack->reason, "worker id"), "%s", ack->ack->reason);
  wfree(ack);
  void *ctl = fake_register(&h, "bad\nid", (fake_opts){.roles = "ed", .route = "r-ctl"}, &ack);
  cr_expect(!ack->ack->accepted, "a worker id with a control character was registered");
  wfree(ack);
  Tandem__ServerMessage *hm;
  cr_expect_eq(health(&h, &hm)->n_workers, 0);
  cfree(hm);
  void *socks[] = {anon, ctl};
  finish(&h, socks, 2);
}

/* A second connection claiming a live worker's id is refused (the worker
 * retries on that answer) and takes the id once the first falls silent;
 * the first, heard again, is unknown. The router never aborts: before,
 * ROUTER_HANDOVER let the second take the identity, and libzmq aborted. */
Test(router_control, a_duplicate_worker_id_is_refused_while_the_first_lives, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){.heartbeat_ms = 100, .dead_after = 3, .capacity_wait_ms = 300});
  Tandem__Cluster__RouterMessage *ack;
  void *first = fake_register(&h, "w0", (fake_opts){.roles = "ed", .route = "w0.1"}, &ack);
  cr_assert(ack->ack->accepted);
  wfree(ack);
  void *second = fake_register(&h, "w0", (fake_opts){.roles = "ed", .route = "w0.2"}, &ack);
  cr_expect(!ack->ack->accepted, "a live worker's id was taken");
  cr_expect(strstr(ack->ack->reason, TD_ROUTER_ID_IN_USE), "%s", ack->ack->reason);
  wfree(ack);
  /* a request still goes to the first */
  generate(&h, (gen){.id = "a", .max_new = 2});
  Tandem__Cluster__RouterMessage *job = wexpect(first, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "the job");
  uint64_t rid = job->decode->req->rid;
  wfree(job);
  /* the first falls silent (no heartbeats for 3 x 100 ms): it is dead,
   * its request fails (no other decode worker), the id is free */
  expect_error(&h, "a", TANDEM__ERROR_CODE__ERROR_UNAVAILABLE, "no decode worker");
  void *third = fake_register(&h, "w0", (fake_opts){.roles = "ed", .route = "w0.3"}, &ack);
  cr_expect(ack->ack->accepted, "refused after the first fell silent: %s", ack->ack->reason);
  wfree(ack);
  Tandem__Cluster__RouterMessage *m;
  /* the first wakes up: unknown now */
  int32_t t[1] = {7};
  send_tokens(first, rid, 0, t, 1);
  bool told = false;
  for (int k = 0; k < 20 && !told; k++) {
    m = wrecv(first, 200);
    if (!m) break;
    told = m->body_case == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ACK && !m->ack->accepted &&
           strstr(m->ack->reason, "unknown worker");
    wfree(m);
  }
  cr_expect(told, "the silent first connection was not told it is unknown");
  void *socks[] = {first, second, third};
  finish(&h, socks, 3);
}

Test(router_control, a_cancel_reaches_the_worker, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){0});
  void *w = fake_worker(&h, "w0", enc_dec);
  generate(&h, (gen){.id = "a", .max_new = 5});
  Tandem__Cluster__RouterMessage *job = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "the decode job");
  uint64_t rid = job->decode->req->rid;
  wfree(job);
  cancel(&h, "a");
  expect_error(&h, "a", TANDEM__ERROR_CODE__ERROR_CANCELLED, "cancelled by the client");
  Tandem__Cluster__RouterMessage *c = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL, "the cancel");
  cr_expect_eq(c->cancel->rid, rid);
  wfree(c);
  /* what the worker had on the way goes nowhere */
  int32_t t[1] = {7};
  send_finished(w, rid, t, 1);
  expect_quiet(&h, 200);
  cancel(&h, "a");
  expect_error(&h, "a", TANDEM__ERROR_CODE__ERROR_NOT_FOUND, "no such request");
  void *socks[] = {w};
  finish(&h, socks, 1);
}

/* A Whisper-shaped model: 2 mel bins x 4 frames of features, 2 encoder positions. */
static void whisper_shape(Tandem__Cluster__WorkerInfo *in) {
  in->model->model_type = "whisper";
  in->model->mel_bins = 2;
  in->model->frames = 4;
  in->model->max_source_len = 2;
}

static void generate_features(harness *h, const char *id) {
  static float v[8] = {0.5f, -1, 2, 0, 1, 1, -0.25f, 3};
  Tandem__AudioFeatures af = TANDEM__AUDIO_FEATURES__INIT;
  af.values = v;
  af.n_values = 8;
  Tandem__GenerateRequest g = TANDEM__GENERATE_REQUEST__INIT;
  g.request_id = (char *)id;
  g.features = &af;
  g.max_new_tokens = 2;
  Tandem__ClientMessage m = TANDEM__CLIENT_MESSAGE__INIT;
  m.version = TD_PROTOCOL_VERSION;
  m.body_case = TANDEM__CLIENT_MESSAGE__BODY_GENERATE;
  m.generate = &g;
  cr_assert_eq(td_wire_send(h->client, NULL, 0, &m.base), TD_OK);
}

/* Audio features travel to the worker that encodes them and nowhere else:
 * the decode job of a request an encoder-only worker encodes holds none
 * (its cross KV arrives pushed), the encode job all of them; a lone worker
 * that encodes for itself gets them in its decode job. */
Test(router_control, features_go_only_where_they_are_encoded, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){0});
  void *d = fake_worker(&h, "dec", (fake_opts){.roles = "d", .mutate = whisper_shape});
  void *e = fake_worker(&h, "enc", (fake_opts){.roles = "e", .mutate = whisper_shape});
  generate_features(&h, "a");
  Tandem__Cluster__RouterMessage *job = wexpect(d, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "the decode job");
  cr_expect(!job->decode->local_encode);
  cr_expect_null(job->decode->req->features, "the decode worker got features it does not encode");
  uint64_t rid = job->decode->req->rid;
  wfree(job);
  send_reserved(d, rid, 4, 2);
  job = wexpect(e, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE, "the encode job");
  const Tandem__AudioFeatures *af = job->encode->req->features;
  cr_assert_not_null(af, "the encoder got no features");
  cr_assert_eq(af->n_values, 8);
  cr_expect_float_eq(af->values[0], 0.5f, 0);
  cr_expect_float_eq(af->values[7], 3.0f, 0);
  wfree(job);
  void *socks[] = {d, e};
  finish(&h, socks, 2);

  harness h2;
  start(&h2, (td_router_opts){0});
  void *lone = fake_worker(&h2, "lone", (fake_opts){.roles = "ed", .mutate = whisper_shape});
  generate_features(&h2, "b");
  job = wexpect(lone, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "the lone worker's decode job");
  cr_expect(job->decode->local_encode);
  cr_assert_not_null(job->decode->req->features, "a worker that encodes for itself got no features");
  cr_expect_eq(job->decode->req->features->n_values, 8);
  wfree(job);
  finish(&h2, &lone, 1);
}

/* Features in a frame of their own (AudioFeatures.values_in_frame): n
 * floats (bad_bytes > 0: a frame of that many bytes instead), or no frame
 * at all (no_frame), or a frame the message does not claim (unclaimed). */
typedef struct framed {
  const char *id;
  const float *v;
  size_t n, bad_bytes;
  bool no_frame, unclaimed;
} framed;

static void generate_framed(harness *h, framed q) {
  Tandem__AudioFeatures af = TANDEM__AUDIO_FEATURES__INIT;
  af.values_in_frame = !q.unclaimed;
  static int32_t ids[1] = {1};
  Tandem__GenerateRequest g = TANDEM__GENERATE_REQUEST__INIT;
  g.request_id = (char *)q.id;
  if (q.unclaimed) { /* input ids, and a frame nothing asked for */
    g.input_ids = ids;
    g.n_input_ids = 1;
  } else {
    g.features = &af;
  }
  g.max_new_tokens = 2;
  Tandem__ClientMessage m = TANDEM__CLIENT_MESSAGE__INIT;
  m.version = TD_PROTOCOL_VERSION;
  m.body_case = TANDEM__CLIENT_MESSAGE__BODY_GENERATE;
  m.generate = &g;
  zmq_msg_t x;
  size_t bytes = q.bad_bytes ? q.bad_bytes : sizeof(float) * q.n;
  cr_assert_eq(zmq_msg_init_size(&x, bytes), 0);
  memset(zmq_msg_data(&x), 0, bytes);
  if (!q.bad_bytes) memcpy(zmq_msg_data(&x), q.v, bytes);
  cr_assert_eq(td_wire_send_extra(h->client, NULL, 0, &m.base, q.no_frame ? NULL : &x), TD_OK);
  zmq_msg_close(&x);
}

/* A worker's frame read as a job (freed here): its message, NULL for a
 * heartbeat; the floats of the frame after it in *n_extra (0: none), copied
 * to extra when they fit cap. */
static Tandem__Cluster__RouterMessage *frame_job(td_wire_frame *f, Tandem__Cluster__RouterMessage__BodyCase want,
                                                 float *extra, size_t cap, size_t *n_extra) {
  Tandem__Cluster__RouterMessage *m = NULL;
  uint32_t ver;
  cr_assert_eq(td_wire_unpack_router(f, &m, &ver), TD_OK, "%s", td_errmsg());
  *n_extra = f->has_extra ? zmq_msg_size(&f->extra) / sizeof(float) : 0;
  if (f->has_extra && *n_extra <= cap) memcpy(extra, zmq_msg_data(&f->extra), zmq_msg_size(&f->extra));
  td_wire_frame_free(f);
  if (m->body_case == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_HEARTBEAT) {
    wfree(m);
    return NULL;
  }
  cr_assert_eq(m->body_case, want, "message %d, want %d", m->body_case, want);
  return m;
}

/* A worker's next job and the bytes of the frame after it (*n_extra: 0 when none). */
static Tandem__Cluster__RouterMessage *wexpect_frame(void *s, Tandem__Cluster__RouterMessage__BodyCase want,
                                                     float *extra, size_t cap, size_t *n_extra) {
  zmq_pollitem_t it = {.socket = s, .events = ZMQ_POLLIN};
  for (;;) {
    cr_assert_gt(zmq_poll(&it, 1, WAIT_MS), 0, "no job came");
    td_wire_frame f;
    cr_assert_eq(td_wire_recv(s, false, false, &f), TD_OK);
    Tandem__Cluster__RouterMessage *m = frame_job(&f, want, extra, cap, n_extra);
    if (m) return m;
  }
}

/* Features a client sends in a frame of their own go to the encoding
 * worker in a frame (the same bytes, by reference), to the decode worker
 * not at all, and again on a retry; admission reads them where they are
 * (their count, NaN); a frame that is missing, unclaimed or of the wrong
 * size is refused naming why. The frames here are small (32 bytes), the
 * size ZeroMQ keeps inside a message's handle: moved, they change address. */
Test(router_control, features_in_a_frame_go_on_by_reference, .timeout = 30) {
  static const float v[8] = {0.5f, -1, 2, 0, 1, 1, -0.25f, 3};
  harness h;
  start(&h, (td_router_opts){0});
  void *d = fake_worker(&h, "dec", (fake_opts){.roles = "d", .mutate = whisper_shape});
  void *e = fake_worker(&h, "enc", (fake_opts){.roles = "e", .mutate = whisper_shape});
  generate_framed(&h, (framed){.id = "a", .v = v, .n = 8});
  float got[16];
  size_t n;
  Tandem__Cluster__RouterMessage *job = wexpect_frame(d, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, got, 16, &n);
  cr_expect_null(job->decode->req->features, "the decode worker got features it does not encode");
  cr_expect_eq(n, 0, "the decode worker got a frame");
  uint64_t rid = job->decode->req->rid;
  wfree(job);
  send_reserved(d, rid, 4, 2);
  job = wexpect_frame(e, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE, got, 16, &n);
  const Tandem__AudioFeatures *af = job->encode->req->features;
  cr_assert_not_null(af, "the encoder got no features");
  cr_expect(af->values_in_frame);
  cr_expect_eq(af->n_values, 0);
  cr_assert_eq(n, 8, "the encoder's frame holds %zu floats", n);
  cr_expect_arr_eq(got, v, sizeof v);
  wfree(job);
  void *socks[] = {d, e};
  finish(&h, socks, 2);

  /* a lone worker that encodes for itself; a retry sends the frame again */
  harness h2;
  start(&h2, (td_router_opts){0});
  void *w1 = fake_worker(&h2, "w1", (fake_opts){.roles = "ed", .mutate = whisper_shape});
  generate_framed(&h2, (framed){.id = "b", .v = v, .n = 8});
  job = wexpect_frame(w1, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, got, 16, &n);
  cr_expect(job->decode->local_encode);
  cr_expect(job->decode->req->features && job->decode->req->features->values_in_frame);
  cr_assert_eq(n, 8);
  cr_expect_arr_eq(got, v, sizeof v);
  uint64_t rid1 = job->decode->req->rid;
  wfree(job);
  /* bad ones, each refused with its reason while b runs */
  static const float nan_v[8] = {0, 0, 0, NAN, 0, 0, 0, 0};
  generate_framed(&h2, (framed){.id = "nan", .v = nan_v, .n = 8});
  expect_error(&h2, "nan", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, "audio features contain NaN or infinity");
  generate_framed(&h2, (framed){.id = "short", .v = v, .n = 6});
  expect_error(&h2, "short", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, "takes audio features of 2 x 4 floats, got 6");
  generate_framed(&h2, (framed){.id = "odd", .bad_bytes = 30});
  expect_error(&h2, "", TANDEM__ERROR_CODE__ERROR_MALFORMED, "not a whole number of float32");
  generate_framed(&h2, (framed){.id = "none", .v = v, .n = 8, .no_frame = true});
  expect_error(&h2, "", TANDEM__ERROR_CODE__ERROR_MALFORMED, "no frame follows the message");
  generate_framed(&h2, (framed){.id = "extra", .v = v, .n = 8, .unclaimed = true});
  expect_error(&h2, "", TANDEM__ERROR_CODE__ERROR_MALFORMED, "which no field of it claims");
  send_retryable(w1, rid1, "encoder failed");
  wfree(wexpect(w1, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL, "the first attempt's cancel"));
  job = wexpect_frame(w1, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, got, 16, &n);
  cr_expect_neq(job->decode->req->rid, rid1);
  cr_expect(job->decode->local_encode);
  cr_assert_eq(n, 8, "the retry's frame holds %zu floats", n);
  cr_expect_arr_eq(got, v, sizeof v);
  wfree(job);
  finish(&h2, &w1, 1);
}

/* A burst of requests is placed as it comes in, not once the router has
 * taken in all of it: a wake-up takes client messages for about a
 * millisecond, then the queue is placed. 6,000 requests sent at once (from
 * a thread of their own) reach the worker steadily: its first job within a
 * few ms of a burst that takes ~130 ms (taking in up to 1,024 requests a
 * wake-up, as before, the first job came after ~10 % of it). */
enum { BURST_N = 6000 };
static void *send_burst(void *arg) {
  harness *h = arg;
  for (int i = 0; i < BURST_N; i++) {
    char id[16];
    snprintf(id, sizeof id, "r%d", i);
    generate(h, (gen){.id = id, .max_new = 2, .n_input = 20});
  }
  return NULL;
}

Test(router_control, a_burst_is_placed_as_it_comes_in, .timeout = 60) {
  harness h;
  start(&h, (td_router_opts){.max_queue = 10000, .max_in_flight = 10000});
  void *d = fake_worker(&h, "lone", (fake_opts){.roles = "ed", .max_running = 2048, .cross_blocks = 100000});
  int64_t t0 = td_now_ns(), first = 0, last = 0;
  pthread_t th;
  cr_assert_eq(pthread_create(&th, NULL, send_burst, &h), 0);
  for (int got = 0; got < BURST_N; got++) {
    Tandem__Cluster__RouterMessage *job = wexpect(d, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "a decode job");
    int64_t t = td_now_ns();
    if (!got) first = t - t0;
    last = t - t0;
    wfree(job);
  }
  pthread_join(th, NULL);
  cr_expect(first * 18 < last, "the first job after %.1f ms, the last after %.1f ms", first / 1e6, last / 1e6);
  finish(&h, &d, 1);
}

Test(router_control, reservations_start_the_encoder_and_a_stage_timeout_retries, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){.stage_timeout_ms = 300, .max_attempts = 2});
  void *d = fake_worker(&h, "dec", (fake_opts){.roles = "d"});
  void *e = fake_worker(&h, "enc", (fake_opts){.roles = "e"});
  generate(&h, (gen){.id = "a", .max_new = 2});
  /* first attempt: the decode worker reserves, the encoder never reports */
  Tandem__Cluster__RouterMessage *job = wexpect(d, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "the decode job");
  cr_expect(!job->decode->local_encode);
  uint64_t rid1 = job->decode->req->rid;
  /* the decode worker hears who pushes its cross KV: the encoder placement chose, with a token */
  const Tandem__Cluster__KvSender *from = job->decode->cross_from;
  cr_assert_not_null(from, "the decode job names no sender for its cross blocks");
  cr_expect_str_eq(from->worker_id, "enc");
  cr_expect_str_eq(from->key, "", "a key named without CURVE");
  cr_assert_eq(from->token.len, TD_KV_TOKEN_BYTES);
  cr_expect_null(job->decode->self_from, "a sender named for prompt KV no prefill worker sends");
  uint8_t tok1[TD_KV_TOKEN_BYTES];
  memcpy(tok1, from->token.data, sizeof tok1);
  wfree(job);
  int32_t blocks[1] = {4};
  int64_t t0 = td_now_ms();
  send_reserved(d, rid1, blocks[0], 3);
  job = wexpect(e, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE, "the encode job");
  cr_expect_eq(job->encode->req->rid, rid1);
  cr_assert_eq(job->encode->n_targets, 1);
  cr_assert_eq(job->encode->targets[0]->n_blocks, 1);
  cr_expect_arr_eq(job->encode->targets[0]->blocks, blocks, sizeof blocks);
  /* ... and the encoder gets the same token with the target */
  cr_assert_eq(job->encode->targets[0]->token.len, TD_KV_TOKEN_BYTES);
  cr_expect_arr_eq(job->encode->targets[0]->token.data, tok1, sizeof tok1, "the encoder's token is not the decode worker's");
  wfree(job);
  Tandem__Cluster__RouterMessage *c = wexpect(e, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL, "the encoder's cancel");
  cr_expect_eq(c->cancel->rid, rid1);
  cr_expect_geq(td_now_ms() - t0, 300, "the encode stage timed out early");
  wfree(c);
  c = wexpect(d, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL, "the decode worker's cancel");
  cr_expect_eq(c->cancel->rid, rid1);
  wfree(c);
  /* second attempt: this time the stages end and decoding has no stage timeout */
  job = wexpect(d, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "the second attempt");
  uint64_t rid2 = job->decode->req->rid;
  /* a new attempt, a new token: a late push of the first attempt is refused */
  cr_assert(job->decode->cross_from && job->decode->cross_from->token.len == TD_KV_TOKEN_BYTES);
  cr_expect(memcmp(job->decode->cross_from->token.data, tok1, sizeof tok1), "the retry kept the first attempt's token");
  uint8_t tok2[TD_KV_TOKEN_BYTES];
  memcpy(tok2, job->decode->cross_from->token.data, sizeof tok2);
  wfree(job);
  send_reserved(d, rid2, blocks[0], 3);
  job = wexpect(e, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE, "the second encode job");
  cr_expect_arr_eq(job->encode->targets[0]->token.data, tok2, sizeof tok2);
  wfree(job);
  Tandem__Cluster__EncodeDone ed = TANDEM__CLUSTER__ENCODE_DONE__INIT;
  ed.rid = rid2;
  Tandem__Cluster__WorkerMessage em = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  em.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_ENCODE_DONE;
  em.encode_done = &ed;
  send_body(e, &em);
  usleep(600 * 1000);
  int32_t t[2] = {3, 4};
  send_finished(d, rid2, t, 2);
  expect_result(&h, "a", t, 2, 2);
  /* a third request whose stages never end gives up after max_attempts */
  generate(&h, (gen){.id = "b", .max_new = 2});
  expect_error(&h, "b", TANDEM__ERROR_CODE__ERROR_UNAVAILABLE,
               "gave up after 2 attempts: stage reserving took more than 300 ms");
  void *socks[] = {d, e};
  finish(&h, socks, 2);
}

/* With a prefill worker, three reservations and three tokens: the encoder
 * pushes into the decode and the prefill workers' cross blocks, the
 * prefill worker into the decode worker's self blocks; each receiver is
 * told the token its pusher gets, and no two are the same. */
Test(router_control, each_reservation_names_its_pusher_with_its_own_token, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){.prefill_threshold = 4});
  void *d = fake_worker(&h, "dec", (fake_opts){.roles = "d"});
  void *e = fake_worker(&h, "enc", (fake_opts){.roles = "e"});
  void *p = fake_worker(&h, "pre", (fake_opts){.roles = "p"});
  static const int32_t prompt[6] = {3, 10, 11, 12, 13, 14};
  generate(&h, (gen){.id = "a", .max_new = 2, .prompt = prompt, .n_prompt = 6});
  Tandem__Cluster__RouterMessage *dj = wexpect(d, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "the decode job");
  cr_assert(dj->decode->with_prefill, "the long prompt did not go to the prefill worker");
  const Tandem__Cluster__KvSender *dc = dj->decode->cross_from, *ds = dj->decode->self_from;
  cr_assert(dc && ds, "the decode job does not name both senders");
  cr_expect_str_eq(dc->worker_id, "enc");
  cr_expect_str_eq(ds->worker_id, "pre");
  cr_assert(dc->token.len == TD_KV_TOKEN_BYTES && ds->token.len == TD_KV_TOKEN_BYTES);
  int32_t cb[1] = {4}, sb[1] = {5}, pb[1] = {6};
  Tandem__Cluster__KvTarget kc = TANDEM__CLUSTER__KV_TARGET__INIT, ks = TANDEM__CLUSTER__KV_TARGET__INIT;
  kv_target(&kc, "dec", cb, 1, 3);
  kv_target(&ks, "dec", sb, 1, 5);
  Tandem__Cluster__Reserved res = TANDEM__CLUSTER__RESERVED__INIT;
  res.rid = dj->decode->req->rid;
  res.cross = &kc;
  res.self = &ks;
  Tandem__Cluster__WorkerMessage rm = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  rm.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED;
  rm.reserved = &res;
  send_body(d, &rm);
  /* the prefill worker: the encoder named for its cross blocks, the decode worker's token for its push */
  Tandem__Cluster__RouterMessage *pj = wexpect(p, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL, "the prefill job");
  const Tandem__Cluster__KvSender *pc = pj->prefill->cross_from;
  cr_assert(pc && pc->token.len == TD_KV_TOKEN_BYTES, "the prefill job names no sender for its cross blocks");
  cr_expect_str_eq(pc->worker_id, "enc");
  cr_assert_eq(pj->prefill->self_target->token.len, TD_KV_TOKEN_BYTES);
  cr_expect_arr_eq(pj->prefill->self_target->token.data, ds->token.data, TD_KV_TOKEN_BYTES);
  Tandem__Cluster__KvTarget kp = TANDEM__CLUSTER__KV_TARGET__INIT;
  kv_target(&kp, "pre", pb, 1, 3);
  res.cross = &kp;
  res.self = NULL;
  send_body(p, &rm);
  /* the encoder: both targets, each with its receiver's token */
  Tandem__Cluster__RouterMessage *ej = wexpect(e, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE, "the encode job");
  cr_assert_eq(ej->encode->n_targets, 2);
  Tandem__Cluster__KvTarget *const *t = ej->encode->targets;
  cr_expect_str_eq(t[0]->worker_id, "dec");
  cr_expect_str_eq(t[1]->worker_id, "pre");
  cr_assert(t[0]->token.len == TD_KV_TOKEN_BYTES && t[1]->token.len == TD_KV_TOKEN_BYTES);
  cr_expect_arr_eq(t[0]->token.data, dc->token.data, TD_KV_TOKEN_BYTES);
  cr_expect_arr_eq(t[1]->token.data, pc->token.data, TD_KV_TOKEN_BYTES);
  cr_expect(memcmp(dc->token.data, pc->token.data, TD_KV_TOKEN_BYTES) &&
            memcmp(dc->token.data, ds->token.data, TD_KV_TOKEN_BYTES) &&
            memcmp(pc->token.data, ds->token.data, TD_KV_TOKEN_BYTES), "two reservations share a token");
  wfree(ej);
  wfree(pj);
  wfree(dj);
  void *socks[] = {d, e, p};
  finish(&h, socks, 3);
}

/* The decode worker reserves, the encoder's push fails; returns the rid. */
static uint64_t encode_then_push_fails(void *d, void *e) {
  Tandem__Cluster__RouterMessage *job = wexpect(d, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "the decode job");
  uint64_t rid = job->decode->req->rid;
  wfree(job);
  send_reserved(d, rid, 7, 3);
  Tandem__Cluster__RouterMessage *m; /* the encoder's cancel of an earlier attempt may come first */
  while ((m = wrecv(e, WAIT_MS)) && m->body_case == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL) wfree(m);
  cr_assert(m, "the encode job: nothing came");
  cr_assert_eq(m->body_case, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE, "the encode job: message %d", m->body_case);
  wfree(m);
  send_retryable(e, rid, "KV push failed: KV receiver dec failed");
  return rid;
}

/* --kv-load-failure: a push of the cross KV that fails gives the request
 * another attempt, encoded again (recompute, the default), or ends it with
 * an error that names the policy (fail); the decode worker lets go either way. */
Test(router_control, a_failed_kv_push_is_recomputed_or_fails_by_the_policy, .timeout = 30) {
  for (int fail = 0; fail < 2; fail++) {
    harness h;
    start(&h, (td_router_opts){.kv_load_failure = fail ? TD_KV_LOAD_FAIL : TD_KV_LOAD_RECOMPUTE});
    void *d = fake_worker(&h, "dec", (fake_opts){.roles = "d"});
    void *e = fake_worker(&h, "enc", (fake_opts){.roles = "e"});
    generate(&h, (gen){.id = "a", .max_new = 2});
    uint64_t rid = encode_then_push_fails(d, e);
    Tandem__Cluster__RouterMessage *c = wexpect(d, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL, "the cancel");
    cr_expect_eq(c->cancel->rid, rid);
    wfree(c);
    if (fail) {
      expect_error(&h, "a", TANDEM__ERROR_CODE__ERROR_UNAVAILABLE,
                   "KV load failed: KV push failed: KV receiver dec failed (--kv-load-failure fail)");
      expect_quiet(&h, 200);
    } else { /* the second attempt reserves and encodes again, and ends */
      uint64_t rid2 = encode_then_push_fails(d, e);
      cr_expect_neq(rid2, rid);
      wfree(wexpect(d, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL, "the second cancel"));
      wfree(wexpect(d, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "the third attempt"));
    }
    void *socks[] = {d, e};
    finish(&h, socks, 2);
  }
  td_router *r;
  cr_expect_eq(td_router_create(&(td_router_opts){.kv_load_failure = (td_kv_load_failure)7}, &r), TD_ERR_INVALID);
}

/* An encoder-only worker and a decode worker that encodes share a burst,
 * each queue at most TD_DEFAULT_ENCODE_RUNS runs deep; the rest waits at
 * the router and goes to whichever frees up first. */
Test(router_control, encoders_share_a_burst_and_their_queues_are_bounded, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){0});
  enum { RUN = 3, RUNS = TD_DEFAULT_ENCODE_RUNS, SENT = 2 * RUNS + 1 }; /* 3 input ids: 3 positions */
  void *both = fake_worker(&h, "both", (fake_opts){.roles = "ed", .enc_batch = RUN});
  void *e = fake_worker(&h, "enc", (fake_opts){.roles = "e", .enc_batch = RUN});
  char ids[SENT][8];
  for (int i = 0; i < SENT; i++) {
    snprintf(ids[i], sizeof ids[i], "r%d", i);
    generate(&h, (gen){.id = ids[i], .max_new = 2});
  }
  int local = 0, remote = 0;
  uint64_t local_rid = 0;
  for (int i = 0; i < 2 * RUNS; i++) {
    Tandem__Cluster__RouterMessage *job = wexpect(both, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "a decode job");
    if (job->decode->local_encode) local++, local_rid = job->decode->req->rid;
    else remote++;
    wfree(job);
  }
  cr_expect_eq(local, RUNS, "the decode worker encodes its share");
  cr_expect_eq(remote, RUNS, "the encoder-only worker takes the other");
  Tandem__Cluster__RouterMessage *more = wrecv(both, 300);
  cr_expect(!more, "a request went past two full encoder queues");
  if (more) wfree(more);
  /* the first token of a local request: its encoder run is over */
  int32_t t[1] = {7};
  send_tokens(both, local_rid, 0, t, 1);
  Tandem__Cluster__RouterMessage *job = wexpect(both, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "the last job");
  cr_expect(job->decode->local_encode, "the decode worker's queue freed first");
  wfree(job);
  void *socks[] = {both, e};
  finish(&h, socks, 2);
}

Test(router_control, a_deadline_fails_the_request_and_frees_the_worker, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){0});
  void *w = fake_worker(&h, "w0", enc_dec);
  int64_t t0 = td_now_ms();
  generate(&h, (gen){.id = "a", .max_new = 5, .timeout_ms = 200});
  Tandem__Cluster__RouterMessage *job = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "the decode job");
  uint64_t rid = job->decode->req->rid;
  wfree(job);
  expect_error(&h, "a", TANDEM__ERROR_CODE__ERROR_TIMEOUT, "deadline exceeded");
  cr_expect_geq(td_now_ms() - t0, 200);
  Tandem__Cluster__RouterMessage *c = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL, "the cancel");
  cr_expect_eq(c->cancel->rid, rid);
  wfree(c);
  void *socks[] = {w};
  finish(&h, socks, 1);
}

Test(router_control, wider_than_every_decode_worker_is_refused_at_admission, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){0});
  /* room for one request's cross KV: a second one waits at the queue's head */
  void *w = fake_worker(&h, "w0", (fake_opts){.roles = "ed", .max_running = 4, .cross_blocks = 1});
  generate(&h, (gen){.id = "fits", .n = 4, .max_new = 2});
  Tandem__Cluster__RouterMessage *job = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "the decode job");
  cr_expect_eq(job->decode->req->sampling->n, 4);
  uint64_t rid = job->decode->req->rid;
  wfree(job);
  generate(&h, (gen){.id = "waits", .max_new = 2});
  /* refused at once, not queued behind "waits" */
  generate(&h, (gen){.id = "wide", .n = 8, .max_new = 2});
  expect_error(&h, "wide", TANDEM__ERROR_CODE__ERROR_UNAVAILABLE, "8 sequences at once");
  int32_t t[2] = {1, 2};
  send_finished(w, rid, t, 2);
  cfree(cexpect(&h, TANDEM__SERVER_MESSAGE__BODY_RESULT, "fits"));
  job = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "the waiting request, placed once there is room");
  cr_expect_str_eq(job->decode->req->client_id, "waits");
  wfree(job);
  void *socks[] = {w};
  finish(&h, socks, 1);
}

Test(router_control, a_queued_request_that_no_worker_left_can_run_is_refused, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){0});
  /* "wide" runs 8 sequences but has room for one request's cross KV; "narrow" runs 2 */
  void *wide = fake_worker(&h, "wide", (fake_opts){.roles = "ed", .max_running = 8, .cross_blocks = 1});
  void *narrow = fake_worker(&h, "narrow", (fake_opts){.roles = "ed", .max_running = 2});
  generate(&h, (gen){.id = "b", .n = 8, .max_new = 2});
  wfree(wexpect(wide, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "b"));
  generate(&h, (gen){.id = "c", .n = 8, .max_new = 2}); /* waits for a cross block on "wide" */
  expect_quiet(&h, 200);
  Tandem__Cluster__Deregister dr = TANDEM__CLUSTER__DEREGISTER__INIT;
  dr.reason = "going away";
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_DEREGISTER;
  m.deregister = &dr;
  send_body(wide, &m);
  for (int i = 0; i < 2; i++) {
    Tandem__ServerMessage *sm = cexpect(&h, TANDEM__SERVER_MESSAGE__BODY_ERROR, "b and c refused");
    cr_expect_eq(sm->error->code, TANDEM__ERROR_CODE__ERROR_UNAVAILABLE);
    cr_expect_str_eq(sm->request_id, i ? "c" : "b", "b is retried first");
    cr_expect(strstr(sm->error->message, "8 sequences at once") && strstr(sm->error->message, "widest runs 2"),
              "%s: %s", sm->request_id, sm->error->message);
    cfree(sm);
  }
  void *socks[] = {wide, narrow};
  finish(&h, socks, 2);
}

Test(router_control, a_silent_worker_dies_and_its_request_fails_without_another, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){.heartbeat_ms = 100, .dead_after = 5, .capacity_wait_ms = 300});
  void *w = fake_worker(&h, "w0", enc_dec);
  generate(&h, (gen){.id = "a", .max_new = 5});
  wfree(wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "the decode job"));
  /* w0 sends nothing more */
  expect_error(&h, "a", TANDEM__ERROR_CODE__ERROR_UNAVAILABLE, "no decode worker is registered (waited");
  Tandem__ServerMessage *hm;
  cr_expect_eq(health(&h, &hm)->decoders, 0);
  cfree(hm);
  void *socks[] = {w};
  finish(&h, socks, 1);
}

static void group_join_split(void *s, const char *group, uint32_t rank, uint32_t world, const char *cross_mode,
                             bool encoder_states, const char *split) {
  Tandem__Cluster__GroupJoin j = TANDEM__CLUSTER__GROUP_JOIN__INIT;
  j.encoder_split = (char *)split;
  j.group = (char *)group;
  j.rank = rank;
  j.world = world;
  j.endpoint = rank ? "tcp://follower" : "tcp://leader";
  j.cross_mode = (char *)cross_mode;
  j.encoder_states = encoder_states;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_GROUP_JOIN;
  m.group_join = &j;
  wsend(s, &m);
}

static void group_join_as(void *s, const char *group, uint32_t rank, uint32_t world, const char *cross_mode,
                          bool encoder_states) {
  group_join_split(s, group, rank, world, cross_mode, encoder_states, "");
}

static void group_join(void *s, const char *group, uint32_t rank, uint32_t world) {
  group_join_as(s, group, rank, world, "auto", false);
}

/* An encoder group runs the states cross mode (it pushes encoder states) and says so: the router
 * (cross mode auto) takes its ranks; a states join that does not say so is refused as before. */
Test(router_control, an_encoder_group_joins_in_states_mode, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){0});
  void *odd = dealer(&h, h.wep, "odd-rank0");
  group_join_as(odd, "d", 0, 2, "states", false);
  Tandem__Cluster__RouterMessage *gi = wexpect(odd, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO, "refused");
  cr_expect(!gi->group_info->ok);
  cr_expect(strstr(gi->group_info->error, "cross pool mode differs"), "%s", gi->group_info->error);
  wfree(gi);
  void *leader = dealer(&h, h.wep, "e-rank0"), *follower = dealer(&h, h.wep, "e-rank1");
  group_join_as(follower, "e", 1, 2, "states", true);
  group_join_as(leader, "e", 0, 2, "states", true);
  for (int k = 0; k < 2; k++) {
    gi = wexpect(k ? leader : follower, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO, "the rendezvous");
    cr_expect(gi->group_info->ok, "%s", gi->group_info->error);
    wfree(gi);
  }
  void *socks[] = {odd, leader, follower};
  finish(&h, socks, 3);
}

/* The ranks of a group split the encoder alike (--tp-encoder): a rank that
 * differs from those before it is refused and every rank hears why; an
 * unknown split is a bad join; ranks that agree on rows form the group. */
Test(router_control, a_group_splits_its_encoder_alike, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){0});
  void *odd = dealer(&h, h.wep, "odd-rank0");
  group_join_split(odd, "x", 0, 2, "auto", false, "diagonal");
  Tandem__Cluster__RouterMessage *gi = wexpect(odd, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO, "refused");
  cr_expect(!gi->group_info->ok);
  cr_expect(strstr(gi->group_info->error, "encoder split \"diagonal\" (rows or heads)"), "%s", gi->group_info->error);
  wfree(gi);
  void *a1 = dealer(&h, h.wep, "m-rank1"), *a0 = dealer(&h, h.wep, "m-rank0");
  group_join_split(a1, "m", 1, 2, "auto", false, "rows");
  group_join_split(a0, "m", 0, 2, "auto", false, "heads");
  for (int k = 0; k < 2; k++) {
    gi = wexpect(k ? a1 : a0, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO, "the refusal");
    cr_expect(!gi->group_info->ok, "rank %d: a group of mixed encoder splits formed", k ? 1 : 0);
    /* the two joins may reach the router in either order */
    cr_expect(strstr(gi->group_info->error, "splits the encoder by heads, the ranks before it by rows") ||
                  strstr(gi->group_info->error, "splits the encoder by rows, the ranks before it by heads"),
              "%s", gi->group_info->error);
    wfree(gi);
  }
  void *b1 = dealer(&h, h.wep, "r-rank1"), *b0 = dealer(&h, h.wep, "r-rank0");
  group_join_split(b1, "r", 1, 2, "auto", false, "rows");
  group_join_split(b0, "r", 0, 2, "auto", false, "rows");
  for (int k = 0; k < 2; k++) {
    gi = wexpect(k ? b0 : b1, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO, "the rendezvous");
    cr_expect(gi->group_info->ok, "%s", gi->group_info->error);
    wfree(gi);
  }
  void *socks[] = {odd, a1, a0, b1, b0};
  finish(&h, socks, 5);
}

/* A rank that loads its model for long after the rendezvous is not silent;
 * one that heartbeat and then stopped is. */
Test(router_control, a_group_forms_and_a_silent_rank_takes_it_out, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){.heartbeat_ms = 100, .dead_after = 5});
  void *bad = dealer(&h, h.wep, "bad-rank");
  group_join(bad, "g", 0, 17);
  Tandem__Cluster__RouterMessage *gi = wexpect(bad, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO, "a bad join");
  cr_expect(!gi->group_info->ok);
  cr_expect(strstr(gi->group_info->error, "world 17, a group has 1 to 16 ranks"), "%s", gi->group_info->error);
  wfree(gi);
  void *follower = dealer(&h, h.wep, "g-rank1");
  group_join(follower, "g", 1, 2);
  void *leader = fake_worker(&h, "g-rank0", enc_dec);
  group_join(leader, "g", 0, 2);
  for (int k = 0; k < 2; k++) {
    gi = wexpect(k ? leader : follower, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO, "the rendezvous");
    cr_expect(gi->group_info->ok, "%s", gi->group_info->error);
    cr_assert_eq(gi->group_info->n_endpoints, 2);
    cr_expect_str_eq(gi->group_info->endpoints[0], "tcp://leader");
    cr_expect_str_eq(gi->group_info->endpoints[1], "tcp://follower");
    wfree(gi);
  }
  /* the follower loads its model (no heartbeat yet) for longer than the
   * silence bound (5 x 100 ms): the group stands; it heartbeats once, then
   * goes silent while the leader heartbeats: the group fails */
  Tandem__Cluster__Heartbeat hb = TANDEM__CLUSTER__HEARTBEAT__INIT;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_HEARTBEAT;
  m.heartbeat = &hb;
  gi = NULL;
  for (int64_t end = td_now_ms() + 1200; !gi && td_now_ms() < end;) {
    send_body(leader, &m);
    gi = wrecv(leader, 20);
  }
  cr_assert(!gi, "a rank still loading its model was taken for dead: %s",
            gi->body_case == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO ? gi->group_info->error : "?");
  send_body(follower, &m);
  for (int64_t end = td_now_ms() + WAIT_MS; !gi && td_now_ms() < end;) {
    send_body(leader, &m);
    gi = wrecv(leader, 20);
  }
  cr_assert(gi, "the leader never heard of the failure");
  cr_assert_eq(gi->body_case, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO);
  cr_expect(strstr(gi->group_info->error, "rank 1 of group g is silent"), "%s", gi->group_info->error);
  wfree(gi);
  Tandem__ServerMessage *hm;
  cr_expect_eq(health(&h, &hm)->decoders, 0, "the group's leader left the pool");
  cfree(hm);
  void *socks[] = {bad, follower, leader};
  finish(&h, socks, 3);
}

Test(router_control, defaults_and_the_limits_of_the_options, .timeout = 30) {
  td_router *r = NULL;
  td_router_opts o = {.client_endpoint = "inproc://c", .worker_endpoint = "inproc://w",
                      .max_attempts = TD_ROUTER_MAX_ATTEMPTS + 1};
  cr_expect_eq(td_router_create(&o, &r), TD_ERR_INVALID);
  cr_expect(strstr(td_errmsg(), "max_attempts 256 exceeds 255"), "%s", td_errmsg());
  cr_expect(!r);
  o.max_attempts = 0;
  o.local_encode_pct = 101;
  cr_expect_eq(td_router_create(&o, &r), TD_ERR_INVALID);
  cr_expect(strstr(td_errmsg(), "local_encode_pct 101"), "%s", td_errmsg());
  o.local_encode_pct = 0;
  o.local_encode_margin = -0.5;
  cr_expect_eq(td_router_create(&o, &r), TD_ERR_INVALID);
  cr_expect(strstr(td_errmsg(), "local_encode_margin -0.5"), "%s", td_errmsg());
  o.local_encode_margin = NAN;
  cr_expect_eq(td_router_create(&o, &r), TD_ERR_INVALID);
  o.local_encode_margin = 0;
  o.encode_runs = -1;
  cr_expect_eq(td_router_create(&o, &r), TD_ERR_INVALID);
  cr_expect(strstr(td_errmsg(), "encode_runs -1"), "%s", td_errmsg());
  cr_expect(!r);
  o.encode_runs = 0;
  o.io_threads = TD_ROUTER_MAX_IO_THREADS + 1;
  cr_expect_eq(td_router_create(&o, &r), TD_ERR_INVALID);
  cr_expect(strstr(td_errmsg(), "io_threads 17"), "%s", td_errmsg());
  o.io_threads = -1;
  cr_expect_eq(td_router_create(&o, &r), TD_ERR_INVALID);
  cr_expect(!r);
  harness h;
  start_as_is(&h, (td_router_opts){0});
  Tandem__Cluster__RouterMessage *ack;
  void *w = fake_register(&h, "w0", enc_dec, &ack);
  cr_expect(ack->ack->accepted);
  cr_expect_eq(ack->ack->heartbeat_ms, TD_DEFAULT_HEARTBEAT_MS);
  cr_expect_eq(ack->ack->dead_after, TD_DEFAULT_DEAD_AFTER);
  wfree(ack);
  void *socks[] = {w};
  finish(&h, socks, 1);
}

/* ------------------------------------------------------------ local links */

static void lsend(td_link *k, ProtobufCMessage *m, zmq_msg_t *extra) {
  cr_assert_eq(td_link_send(k, m, extra), TD_OK, "%s", td_errmsg());
  for (int i = 0; i < 3000 && td_link_wants_write(k); i++) {
    zmq_pollitem_t it = {.fd = td_link_fd(k), .events = ZMQ_POLLOUT};
    (void)zmq_poll(&it, 1, 1);
    cr_assert_eq(td_link_flush(k), TD_OK, "%s", td_errmsg());
  }
}

/* The next frame (*f the caller's to free), or TD_ERR_TIMEOUT. */
static td_status lrecv(td_link *k, int timeout_ms, td_wire_frame *f) {
  for (int64_t end = td_now_ms() + timeout_ms; td_now_ms() < end;) {
    td_status s = td_link_recv(k, f);
    if (s != TD_ERR_NOT_FOUND) return s;
    zmq_pollitem_t it = {.fd = td_link_fd(k), .events = ZMQ_POLLIN};
    (void)zmq_poll(&it, 1, 10);
  }
  return TD_ERR_TIMEOUT;
}

/* The same over a link. */
static Tandem__Cluster__RouterMessage *lwexpect(td_link *k, Tandem__Cluster__RouterMessage__BodyCase want,
                                                float *extra, size_t cap, size_t *n_extra) {
  for (;;) {
    td_wire_frame f;
    cr_assert_eq(lrecv(k, WAIT_MS, &f), TD_OK, "the worker's link: %s", td_errmsg());
    Tandem__Cluster__RouterMessage *m = frame_job(&f, want, extra, cap, n_extra);
    if (m) return m;
  }
}

static Tandem__ServerMessage *lcexpect(td_link *k, Tandem__ServerMessage__BodyCase want, const char *what) {
  td_wire_frame f;
  cr_assert_eq(lrecv(k, WAIT_MS, &f), TD_OK, "%s: %s", what, td_errmsg());
  Tandem__ServerMessage *m;
  uint32_t ver;
  cr_assert_eq(td_wire_unpack_server(&f, &m, &ver), TD_OK, "%s", td_errmsg());
  td_wire_frame_free(&f);
  cr_assert_eq(m->body_case, want, "%s: message %d, want %d (%s)", what, m->body_case, want,
               m->body_case == TANDEM__SERVER_MESSAGE__BODY_ERROR ? m->error->message : "");
  return m;
}

static void lhealth(td_link *c, int *workers) {
  Tandem__HealthRequest hr = TANDEM__HEALTH_REQUEST__INIT;
  Tandem__ClientMessage m = TANDEM__CLIENT_MESSAGE__INIT;
  m.version = TD_PROTOCOL_VERSION;
  m.body_case = TANDEM__CLIENT_MESSAGE__BODY_HEALTH;
  m.health = &hr;
  lsend(c, &m.base, NULL);
  Tandem__ServerMessage *sm = lcexpect(c, TANDEM__SERVER_MESSAGE__BODY_HEALTH, "health");
  *workers = (int)sm->health->n_workers;
  cfree(sm);
}

/* 30 s of audio at 128 mel bins: 1.5 MB a request */
static void long_audio_shape(Tandem__Cluster__WorkerInfo *in) {
  in->model->model_type = "whisper";
  in->model->mel_bins = 128;
  in->model->frames = 3000;
  in->model->max_source_len = 1500;
}

enum { LINK_JOBS = 12, LINK_MEL = 128 * 3000 };

/* Workers and clients of the router's host over its local links (Unix
 * sockets, proto/link.h): registration, jobs with their features' frame
 * (twelve of 1.5 MB, more than a socket holds: the router writes the rest
 * as the worker reads), tokens and results back; a worker whose link
 * closes is gone at once, not after its missed heartbeats; a client that
 * sends garbage loses its link and nobody else notices; the ZeroMQ
 * endpoints serve beside them; paths too long and keys are refused. */
Test(router_control, workers_and_clients_over_local_links, .timeout = 60) {
  char dir[] = "/tmp/td-rlink-XXXXXX", cs[128], ws[128];
  cr_assert_not_null(mkdtemp(dir));
  snprintf(cs, sizeof cs, "%s/c.sock", dir);
  snprintf(ws, sizeof ws, "%s/w.sock", dir);
  harness h;
  start(&h, (td_router_opts){.client_socket = cs, .worker_socket = ws});
  td_link *w, *c;
  cr_assert_eq(td_link_connect(ws, &w), TD_OK, "%s", td_errmsg());
  cr_assert_eq(td_link_connect(cs, &c), TD_OK, "%s", td_errmsg());
  /* the registration, as a worker sends it */
  fake_reg lreg;
  fill_register(&lreg, "lw", (fake_opts){.roles = "ed", .cross_blocks = 4000, .mutate = long_audio_shape});
  lsend(w, &lreg.m.base, NULL);
  size_t n = 0;
  Tandem__Cluster__RouterMessage *ack = lwexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ACK, NULL, 0, &n);
  cr_assert(ack->ack->accepted, "%s", ack->ack->reason);
  wfree(ack);
  /* requests with their features in a frame, from the client's link */
  zmq_msg_t x;
  cr_assert_eq(zmq_msg_init_size(&x, sizeof(float) * LINK_MEL), 0);
  float *v = zmq_msg_data(&x);
  for (int i = 0; i < LINK_MEL; i++) v[i] = (float)(i % 1000) * 0.5f;
  for (int k = 0; k < LINK_JOBS; k++) {
    char id[16];
    snprintf(id, sizeof id, "a%d", k);
    Tandem__AudioFeatures af = TANDEM__AUDIO_FEATURES__INIT;
    af.values_in_frame = true;
    Tandem__GenerateRequest g = TANDEM__GENERATE_REQUEST__INIT;
    g.request_id = id;
    g.features = &af;
    g.max_new_tokens = 2;
    Tandem__ClientMessage cm = TANDEM__CLIENT_MESSAGE__INIT;
    cm.version = TD_PROTOCOL_VERSION;
    cm.body_case = TANDEM__CLIENT_MESSAGE__BODY_GENERATE;
    cm.generate = &g;
    lsend(c, &cm.base, &x);
  }
  zmq_msg_close(&x);
  uint64_t rids[LINK_JOBS];
  float *got = malloc(sizeof(float) * LINK_MEL);
  cr_assert_not_null(got);
  for (int k = 0; k < LINK_JOBS; k++) {
    Tandem__Cluster__RouterMessage *job = lwexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, got, LINK_MEL, &n);
    cr_expect(job->decode->local_encode);
    cr_assert_eq(n, LINK_MEL, "job %d's frame holds %zu floats", k, n);
    for (int i = 0; i < LINK_MEL; i += 4999) cr_assert_float_eq(got[i], (float)(i % 1000) * 0.5f, 0, "job %d, value %d", k, i);
    cr_expect_float_eq(got[LINK_MEL - 1], (float)((LINK_MEL - 1) % 1000) * 0.5f, 0);
    rids[k] = job->decode->req->rid;
    wfree(job);
  }
  free(got);
  for (int k = 0; k < LINK_JOBS; k++) {
    int32_t t[2] = {7, 8};
    Tandem__SequenceOutput so = TANDEM__SEQUENCE_OUTPUT__INIT, *sop = &so;
    so.tokens = t;
    so.n_tokens = 2;
    so.finish_reason = TANDEM__FINISH_REASON__FINISH_LENGTH;
    Tandem__Cluster__Finished fin = TANDEM__CLUSTER__FINISHED__INIT;
    fin.rid = rids[k];
    fin.outputs = &sop;
    fin.n_outputs = 1;
    Tandem__Cluster__WorkerMessage fm = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
    fm.version = TD_PROTOCOL_VERSION;
    fm.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FINISHED;
    fm.finished = &fin;
    lsend(w, &fm.base, NULL);
  }
  for (int k = 0; k < LINK_JOBS; k++) {
    Tandem__ServerMessage *r = lcexpect(c, TANDEM__SERVER_MESSAGE__BODY_RESULT, "a result");
    cr_expect_eq(r->result->outputs[0]->n_tokens, 2);
    cfree(r);
  }
  /* a burst larger than a wake-up takes (its time budget): what stays in the link's buffer is read on
     the next turns, though the socket has nothing new to say */
  enum { N_HEALTH = 3000 }; /* ~48 KB in one write: one read of the router's takes them all */
  Tandem__HealthRequest hq = TANDEM__HEALTH_REQUEST__INIT;
  Tandem__ClientMessage hm0 = TANDEM__CLIENT_MESSAGE__INIT;
  hm0.version = TD_PROTOCOL_VERSION;
  hm0.body_case = TANDEM__CLIENT_MESSAGE__BODY_HEALTH;
  hm0.health = &hq;
  size_t one = protobuf_c_message_get_packed_size(&hm0.base), at = 0;
  uint8_t *burst = malloc((12 + one) * N_HEALTH);
  cr_assert_not_null(burst);
  for (int k = 0; k < N_HEALTH; k++, at += 12 + one) {
    const uint8_t hdr[12] = {'T', 'D', 'L', '1', (uint8_t)one, 0, 0, 0, 0xff, 0xff, 0xff, 0xff};
    memcpy(burst + at, hdr, 12);
    protobuf_c_message_pack(&hm0.base, burst + at + 12);
  }
  for (size_t off = 0; off < at;) {
    ssize_t wr = write(td_link_fd(c), burst + off, at - off);
    if (wr > 0) off += (size_t)wr;
    else (void)zmq_poll(&(zmq_pollitem_t){.fd = td_link_fd(c), .events = ZMQ_POLLOUT}, 1, 100);
  }
  free(burst);
  for (int k = 0; k < N_HEALTH; k++) cfree(lcexpect(c, TANDEM__SERVER_MESSAGE__BODY_HEALTH, "a burst's health answer"));
  /* the ZeroMQ endpoint still serves, beside the links */
  int nw = -1;
  lhealth(c, &nw);
  cr_expect_eq(nw, 1);
  Tandem__ServerMessage *hm;
  cr_expect_eq(health(&h, &hm)->n_workers, 1);
  cfree(hm);
  /* garbage on another client's link: that link closes, the rest goes on */
  td_link *g;
  cr_assert_eq(td_link_connect(cs, &g), TD_OK);
  cr_assert_eq(write(td_link_fd(g), "GET / HTTP/1.1\r\n\r\n", 18), 18);
  td_wire_frame f;
  cr_expect_eq(lrecv(g, WAIT_MS, &f), TD_ERR_PEER, "the router kept a link that sent garbage");
  td_link_destroy(g);
  /* the worker's link closes: gone at once (its heartbeats would take 30 s) */
  td_link_destroy(w);
  int64_t t0 = td_now_ms();
  do lhealth(c, &nw);
  while (nw != 0 && td_now_ms() - t0 < 2000);
  cr_expect_eq(nw, 0, "a worker whose link closed is still registered");
  td_link_destroy(c);
  finish(&h, NULL, 0);
  struct stat st;
  cr_expect_neq(stat(cs, &st), 0, "the router left its socket file");
  rmdir(dir);

  td_router *r = NULL;
  char lng[200];
  memset(lng, 'x', sizeof lng - 1);
  lng[0] = '/';
  lng[sizeof lng - 1] = 0;
  td_router_opts o = {.client_endpoint = "inproc://lc", .worker_endpoint = "inproc://lw", .worker_socket = lng};
  cr_expect_eq(td_router_create(&o, &r), TD_ERR_INVALID);
  cr_expect(strstr(td_errmsg(), "longer than"), "%s", td_errmsg());
  cr_expect(!r);
}

/* ------------------------------------------------------------ floods */

/* Bytes the heap holds live: ASan's count under the sanitizer (its
 * quarantine of freed blocks is not memory a flood kept), glibc's else. */
static size_t live_heap(void) {
#if defined(__SANITIZE_ADDRESS__)
  return __sanitizer_get_current_allocated_bytes();
#else
  struct mallinfo2 mi = mallinfo2();
  return mi.uordblks + mi.hblkhd;
#endif
}

/* Every message waiting on s read and dropped; how many. */
static int drain_socket(void *s, int quiet_ms) {
  int n = 0;
  for (;;) {
    zmq_pollitem_t it = {.socket = s, .events = ZMQ_POLLIN};
    if (zmq_poll(&it, 1, quiet_ms) <= 0) return n;
    zmq_msg_t m;
    zmq_msg_init(&m);
    zmq_msg_recv(&m, s, 0);
    zmq_msg_close(&m);
    n++;
  }
}

/* 100,000 GroupJoins of distinct groups from one peer (half of one rank,
 * which complete at once, half waiting for a second rank): a peer holds one
 * rank of one group, so the router keeps one rendezvous, not 100,000 (which
 * took 550 MB and, found by a scan per message, minutes of CPU). Measured:
 * the heap grows by under 1 MB across the flood; bound 16 MB. A real group
 * forms after it, and TD_ROUTER_MAX_GROUPS rendezvous from distinct peers
 * are the most the router holds: the next is refused saying so. */
Test(router_control, a_group_join_flood_holds_one_rendezvous_a_peer, .timeout = 60) {
  harness h;
  start(&h, (td_router_opts){0});
  void *flood = dealer(&h, h.wep, "flooder");
  enum { N = 100000 };
  /* a first join and its answer: the router's own structures exist before the baseline */
  group_join(flood, "warm", 0, 1);
  wfree(wexpect(flood, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO, "the first join"));
  size_t before = live_heap();
  int64_t t0 = td_now_ms();
  int answers = 0;
  for (int i = 0; i < N; i++) {
    char name[32];
    snprintf(name, sizeof name, "flood-%d", i);
    group_join(flood, name, 0, i % 2 ? 2 : 1);
    if (i % 1000 == 999) answers += drain_socket(flood, 0);
  }
  group_join(flood, "last", 0, 1);
  Tandem__Cluster__RouterMessage *last = NULL;
  while (!last) {
    Tandem__Cluster__RouterMessage *m = wexpect(flood, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO, "the flood");
    answers++;
    if (!strcmp(m->group_info->group, "last")) last = m;
    else wfree(m);
  }
  cr_expect(last->group_info->ok, "%s", last->group_info->error);
  wfree(last);
  int64_t took = td_now_ms() - t0;
  size_t after = live_heap();
  /* each one-rank group ("warm" too): its GroupInfo, and "failed" when its rank joins the next */
  cr_expect_eq(answers, N + 2, "%d answers", answers);
  cr_log_info("%d group joins in %lld ms: the heap grew by %zd kB", N, (long long)took,
              ((ssize_t)after - (ssize_t)before) / 1024);
  cr_expect_lt(after > before ? after - before : 0, (size_t)16 << 20,
               "%d group joins left the heap %zu kB larger", N, (after - before) >> 10);
  cr_expect_lt(took, 20000, "the flood took %lld ms", (long long)took);
  /* a real group still forms */
  void *follower = dealer(&h, h.wep, "g-rank1");
  void *leader = dealer(&h, h.wep, "g-rank0");
  group_join(follower, "g", 1, 2);
  group_join(leader, "g", 0, 2);
  for (int k = 0; k < 2; k++) {
    Tandem__Cluster__RouterMessage *gi =
        wexpect(k ? leader : follower, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO, "the real group");
    cr_expect(gi->group_info->ok, "%s", gi->group_info->error);
    wfree(gi);
  }
  /* distinct peers: at most TD_ROUTER_MAX_GROUPS rendezvous (two are held: "last" and "g") */
  enum { PEERS = TD_ROUTER_MAX_GROUPS - 2 };
  void *peers[PEERS + 1];
  for (int i = 0; i <= PEERS; i++) {
    char id[32], name[32];
    snprintf(id, sizeof id, "peer-%d", i);
    snprintf(name, sizeof name, "pending-%d", i);
    peers[i] = dealer(&h, h.wep, id);
    group_join(peers[i], name, 0, 2);
  }
  Tandem__Cluster__RouterMessage *gi =
      wexpect(peers[PEERS], TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO, "the join past the bound");
  cr_expect(!gi->group_info->ok);
  cr_expect(strstr(gi->group_info->error, "TD_ROUTER_MAX_GROUPS"), "%s", gi->group_info->error);
  wfree(gi);
  Tandem__Cluster__RouterMessage *none = wrecv(peers[0], 100);
  cr_expect(!none, "a pending rendezvous was answered");
  if (none) wfree(none);
  for (int i = 0; i <= PEERS; i++) zmq_close(peers[i]);
  void *socks[] = {flood, follower, leader};
  finish(&h, socks, 3);
}

/* ------------------------------------------------------------ failing fast */

/* A request that needs an encoder where none is registered waits
 * --capacity-wait-ms for one, then fails ERROR_UNAVAILABLE naming what is
 * missing (it waited for its whole deadline, 600 s by default, before); an
 * encoder that comes within the wait takes it. */
Test(router_control, a_request_without_an_encoder_fails_after_the_capacity_wait, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){.capacity_wait_ms = 300});
  void *d = fake_worker(&h, "dec", (fake_opts){.roles = "d"});
  int64_t t0 = td_now_ms();
  generate(&h, (gen){.id = "a", .max_new = 2});
  expect_error(&h, "a", TANDEM__ERROR_CODE__ERROR_UNAVAILABLE, "no encoder is registered");
  int64_t took = td_now_ms() - t0;
  cr_expect(took >= 300 && took < 300 + 1000, "failed after %lld ms, the wait is 300", (long long)took);
  /* within the wait an encoder comes: the request is placed */
  generate(&h, (gen){.id = "b", .max_new = 2});
  usleep(100000);
  void *e = fake_worker(&h, "enc", (fake_opts){.roles = "e"});
  Tandem__Cluster__RouterMessage *job = wexpect(d, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "b's decode job");
  cr_expect_str_eq(job->decode->req->client_id, "b");
  wfree(job);
  expect_quiet(&h, 500);
  void *socks[] = {d, e};
  finish(&h, socks, 2);
}

/* Encoders that are busy are load, not missing capacity: a request waits
 * past --capacity-wait-ms for a full encoder queue and is placed once it
 * frees. */
Test(router_control, full_encoder_queues_are_waited_for_past_the_capacity_wait, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){.capacity_wait_ms = 100});
  enum { RUN = 3, RUNS = TD_DEFAULT_ENCODE_RUNS, SENT = 2 * RUNS + 1 };
  void *both = fake_worker(&h, "both", (fake_opts){.roles = "ed", .enc_batch = RUN});
  void *e = fake_worker(&h, "enc", (fake_opts){.roles = "e", .enc_batch = RUN});
  char ids[SENT][8];
  for (int i = 0; i < SENT; i++) {
    snprintf(ids[i], sizeof ids[i], "r%d", i);
    generate(&h, (gen){.id = ids[i], .max_new = 2});
  }
  uint64_t local_rid = 0;
  for (int i = 0; i < 2 * RUNS; i++) {
    Tandem__Cluster__RouterMessage *job = wexpect(both, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "a decode job");
    if (job->decode->local_encode) local_rid = job->decode->req->rid;
    wfree(job);
  }
  expect_quiet(&h, 400); /* the last one waits for a queue, past the capacity wait, with no error */
  int32_t t[1] = {7};
  send_tokens(both, local_rid, 0, t, 1);
  Tandem__Cluster__RouterMessage *job = wexpect(both, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "the last job");
  cr_expect_str_eq(job->decode->req->client_id, ids[SENT - 1]);
  wfree(job);
  void *socks[] = {both, e};
  finish(&h, socks, 2);
}

/* ------------------------------------------------------------ bytes held */

/* A Generate of `pad` more bytes: an unknown field protobuf-c keeps, as a
 * peer may send. */
static void generate_padded(harness *h, const char *id, size_t pad) {
  static int32_t ids[3] = {1, 2, 3};
  Tandem__GenerateRequest g = TANDEM__GENERATE_REQUEST__INIT;
  g.request_id = (char *)id;
  g.input_ids = ids;
  g.n_input_ids = 3;
  g.max_new_tokens = 2;
  Tandem__ClientMessage m = TANDEM__CLIENT_MESSAGE__INIT;
  m.version = TD_PROTOCOL_VERSION;
  m.body_case = TANDEM__CLIENT_MESSAGE__BODY_GENERATE;
  m.generate = &g;
  size_t n = tandem__client_message__get_packed_size(&m);
  uint8_t *buf = calloc(1, n + pad + 16);
  cr_assert_not_null(buf);
  size_t k = tandem__client_message__pack(&m, buf);
  size_t vals[2] = {1000 << 3 | 2, pad}; /* field 1000, length-delimited; its length */
  for (int i = 0; i < 2; i++)
    for (size_t v = vals[i];; v >>= 7) {
      buf[k++] = (uint8_t)((v & 0x7f) | (v >> 7 ? 0x80 : 0));
      if (!(v >> 7)) break;
    }
  cr_assert_eq(zmq_send(h->client, buf, k + pad, 0), (int)(k + pad));
  free(buf);
}

/* The requests a router holds are bounded in bytes together
 * (max_held_bytes), not only one message at a time: past it a request is
 * refused ERROR_OVERLOADED saying so, and one finished makes room. */
Test(router_control, the_bytes_of_requests_held_are_bounded_together, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){.max_held_bytes = 8 << 20});
  void *w = fake_worker(&h, "w0", enc_dec);
  uint64_t rid[2];
  for (int i = 0; i < 2; i++) {
    generate_padded(&h, i ? "b" : "a", 3 << 20);
    Tandem__Cluster__RouterMessage *job = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "a decode job");
    rid[i] = job->decode->req->rid;
    wfree(job);
  }
  generate_padded(&h, "c", 3 << 20);
  expect_error(&h, "c", TANDEM__ERROR_CODE__ERROR_OVERLOADED, "bytes of client messages");
  int32_t t[2] = {1, 2};
  send_finished(w, rid[0], t, 2);
  cfree(cexpect(&h, TANDEM__SERVER_MESSAGE__BODY_RESULT, "a"));
  generate_padded(&h, "d", 3 << 20);
  Tandem__Cluster__RouterMessage *job = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "d, once a finished");
  cr_expect_str_eq(job->decode->req->client_id, "d");
  wfree(job);
  void *socks[] = {w};
  finish(&h, socks, 1);
}

/* ------------------------------------------------------------ large client messages */

/* This process's resident memory, kB: field "VmRSS:" of /proc/self/status. */
static long rss_kb(void) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  long kb = -1;
  while (f && fgets(line, sizeof line, f))
    if (!strncmp(line, "VmRSS:", 6)) kb = atol(line + 6);
  if (f) fclose(f);
  return kb;
}

/* A loopback port free a moment ago (a plain socket: closed at once). */
static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  cr_assert_geq(fd, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t l = sizeof a;
  cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &l), 0);
  close(fd);
  return ntohs(a.sin_port);
}

/* The router with its client socket on a loopback tcp port (the size
 * limits hold on tcp, not inproc; other processes' clients reach it). */
static void start_tcp(harness *h) {
  memset(h, 0, sizeof *h);
  td_log_set_level(TD_LOG_ERROR);
  h->ctx = zmq_ctx_new();
  snprintf(h->cep, sizeof h->cep, "tcp://127.0.0.1:%d", free_port());
  snprintf(h->wep, sizeof h->wep, "inproc://router-workers");
  td_router_opts o = {.client_endpoint = h->cep, .worker_endpoint = h->wep, .zmq_ctx = h->ctx, .heartbeat_ms = 1000,
                      .dead_after = 30};
  cr_assert_eq(td_router_create(&o, &h->r), TD_OK, "%s", td_errmsg());
  pthread_create(&h->th, NULL, run_router, h);
  h->client = dealer(h, h->cep, NULL);
}

/* Four clients send a 60 MB message each over tcp (the size limits hold
 * on tcp, not inproc): the client socket takes TD_CLIENT_MAX_MSG_BYTES
 * (17 MiB), so each connection is dropped at its frame's header and the
 * router's process grows by under 64 MB (with the 64 MiB limit of every
 * socket it took the four: 4 x 60 MB in libzmq, then a copy each). The
 * messages point into a read-only anonymous mapping: nothing of them is
 * allocated here. The router answers a health request after. */
Test(router_control, four_60mb_client_messages_leave_the_router_bounded, .timeout = 60) {
  harness h;
  start_tcp(&h);
  Tandem__ServerMessage *hm;
  health(&h, &hm);
  cfree(hm);
  const size_t big = 60u << 20;
  void *zero = mmap(NULL, big, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  cr_assert_neq(zero, MAP_FAILED);
  long before = rss_kb(), peak = before;
  void *c[4];
  for (int i = 0; i < 4; i++) {
    c[i] = zmq_socket(h.ctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(c[i], ZMQ_LINGER, &linger, sizeof linger);
    cr_assert_eq(zmq_connect(c[i], h.cep), 0);
    zmq_msg_t m;
    zmq_msg_init_data(&m, zero, big, NULL, NULL);
    cr_assert_eq(zmq_msg_send(&m, c[i], 0), (int)big);
  }
  for (int64_t end = td_now_ms() + 2000; td_now_ms() < end; usleep(10000)) {
    long now = rss_kb();
    if (now > peak) peak = now;
  }
  for (int i = 0; i < 4; i++) zmq_close(c[i]);
  munmap(zero, big);
  cr_log_info("4 x 60 MB client messages: the process grew by %ld kB", peak - before);
  cr_expect_lt(peak - before, 64 << 10, "4 x 60 MB messages took the router's process from %ld to %ld kB", before,
               peak);
  cr_expect_gt(health(&h, &hm)->decoders + 1, 0, "the router answers");
  cfree(hm);
  finish(&h, NULL, 0);
}

/* ------------------------------------------------------------ the client library */

/* td_client_poll_fd wakes for the caller's descriptor at once (the gateway
 * hands its router thread work that way) and says which woke it. */
Test(router_control, the_client_poll_wakes_for_a_descriptor, .timeout = 30) {
  harness h;
  start_tcp(&h);
  td_client *cl = NULL;
  cr_assert_eq(td_client_connect_wait(h.cep, 5000, &cl), TD_OK, "%s", td_errmsg());
  int fd = eventfd(0, EFD_NONBLOCK);
  cr_assert_geq(fd, 0);
  bool ready = true;
  cr_assert_eq(td_client_poll_fd(cl, fd, 50, NULL, &ready), TD_OK);
  cr_expect(!ready, "an unwritten descriptor was ready");
  uint64_t one = 1;
  cr_assert_eq(write(fd, &one, sizeof one), (ssize_t)sizeof one);
  int64_t t0 = td_now_ms();
  cr_assert_eq(td_client_poll_fd(cl, fd, 5000, NULL, &ready), TD_OK);
  cr_expect(ready);
  cr_expect_lt(td_now_ms() - t0, 1000, "the poll did not return when the descriptor was written");
  close(fd);
  td_client_close(cl);
  finish(&h, NULL, 0);
}

/* td_client_connect_wait reports a router that is not there within its
 * timeout, naming the endpoint, and finds one that is; the library refuses
 * a request larger than a router takes (whose socket would drop the
 * connection without a word) before sending it. */
Test(router_control, the_client_reports_an_unreachable_router_and_an_oversized_request, .timeout = 30) {
  char ep[64];
  snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", free_port());
  td_client *cl = NULL;
  int64_t t0 = td_now_ms();
  cr_expect_eq(td_client_connect_wait(ep, 500, &cl), TD_ERR_PEER);
  int64_t took = td_now_ms() - t0;
  cr_expect(took >= 500 && took < 1500, "reported after %lld ms, the timeout is 500", (long long)took);
  char want[128];
  snprintf(want, sizeof want, "no router answers at %s within 500 ms", ep);
  cr_expect(strstr(td_errmsg(), want), "%s", td_errmsg());
  cr_expect(!cl);
  harness h;
  start_tcp(&h);
  cr_assert_eq(td_client_connect_wait(h.cep, 5000, &cl), TD_OK, "%s", td_errmsg());
  td_json_request *q = calloc(1, sizeof *q);
  snprintf(q->id, sizeof q->id, "big");
  q->audio_len = TD_CLIENT_MAX_MSG_BYTES + 1;
  q->audio = calloc(1, q->audio_len);
  cr_expect_eq(td_client_generate(cl, q, false, 0), TD_ERR_INVALID);
  cr_expect(strstr(td_errmsg(), "TD_CLIENT_MAX_MSG_BYTES"), "%s", td_errmsg());
  cr_expect_eq(td_client_pending(cl), 0);
  free(q->audio);
  free(q);
  td_client_close(cl);
  finish(&h, NULL, 0);
}

/* ------------------------------------------------------------ admin */

static void admin(harness *h, Tandem__AdminAction a, const char *worker, const char *rid) {
  Tandem__AdminRequest ar = TANDEM__ADMIN_REQUEST__INIT;
  ar.action = a;
  ar.worker_id = (char *)(worker ? worker : "");
  ar.request_id = (char *)rid;
  Tandem__ClientMessage m = TANDEM__CLIENT_MESSAGE__INIT;
  m.version = TD_PROTOCOL_VERSION;
  m.body_case = TANDEM__CLIENT_MESSAGE__BODY_ADMIN;
  m.admin = &ar;
  cr_assert_eq(td_wire_send(h->client, NULL, 0, &m.base), TD_OK);
}

static void admin_ok(harness *h, Tandem__AdminAction a, const char *worker, const char *says) {
  admin(h, a, worker, "op");
  Tandem__ServerMessage *m = cexpect(h, TANDEM__SERVER_MESSAGE__BODY_ADMIN, says);
  cr_expect_str_eq(m->request_id, "op");
  cr_expect(strstr(m->admin->message, says), "'%s' does not say '%s'", m->admin->message, says);
  cfree(m);
}

static const Tandem__WorkerStatus *status_of(const Tandem__HealthResponse *hr, const char *id) {
  for (size_t i = 0; i < hr->n_workers; i++)
    if (!strcmp(hr->workers[i]->id, id)) return hr->workers[i];
  return NULL;
}

/* An operator drains a worker (nothing new placed there, the worker told),
 * takes it back, removes it while it holds a request (the request goes to
 * the other worker as a new attempt, the worker is told to leave); every
 * refusal names its cause and echoes the request id. */
Test(router_control, admin_drain_undrain_remove_and_their_refusals, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){0});
  void *w0 = fake_worker(&h, "w0", enc_dec), *w1 = fake_worker(&h, "w1", enc_dec);
  admin(&h, TANDEM__ADMIN_ACTION__ADMIN_LIST, NULL, "l1");
  Tandem__ServerMessage *m = cexpect(&h, TANDEM__SERVER_MESSAGE__BODY_ADMIN, "list");
  cr_expect_str_eq(m->request_id, "l1");
  cr_assert(m->admin->health);
  cr_expect_eq(m->admin->health->n_workers, 2);
  cfree(m);
  admin(&h, TANDEM__ADMIN_ACTION__ADMIN_DRAIN, "nope", "e1");
  expect_error(&h, "e1", TANDEM__ERROR_CODE__ERROR_NOT_FOUND, "no worker 'nope' is registered");
  admin(&h, TANDEM__ADMIN_ACTION__ADMIN_UNDRAIN, "w0", "e2");
  expect_error(&h, "e2", TANDEM__ERROR_CODE__ERROR_FAILED_PRECONDITION, "worker w0 is not draining");
  admin(&h, (Tandem__AdminAction)42, "w0", "e3");
  expect_error(&h, "e3", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, "unknown admin action");

  admin_ok(&h, TANDEM__ADMIN_ACTION__ADMIN_DRAIN, "w0", "worker w0 is draining");
  wfree(wexpect(w0, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DRAIN, "the drain"));
  admin(&h, TANDEM__ADMIN_ACTION__ADMIN_DRAIN, "w0", "e4");
  expect_error(&h, "e4", TANDEM__ERROR_CODE__ERROR_FAILED_PRECONDITION, "worker w0 is already draining");
  Tandem__ServerMessage *hm;
  const Tandem__WorkerStatus *ws = status_of(health(&h, &hm), "w0");
  cr_assert(ws);
  cr_expect(ws->draining && ws->drain_requested && !ws->stopping);
  cfree(hm);
  /* nothing new goes to w0, though its queue is the shorter */
  generate(&h, (gen){.id = "a", .max_new = 3});
  Tandem__Cluster__RouterMessage *job = wexpect(w1, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "a on w1");
  wfree(job);
  Tandem__Cluster__RouterMessage *none = wrecv(w0, 200);
  cr_expect(!none, "the draining worker got message %d", none ? (int)none->body_case : 0);
  if (none) wfree(none);

  admin_ok(&h, TANDEM__ADMIN_ACTION__ADMIN_UNDRAIN, "w0", "worker w0 serves again");
  wfree(wexpect(w0, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_UNDRAIN, "the undrain"));
  generate(&h, (gen){.id = "b", .max_new = 3});
  job = wexpect(w0, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "b on w0 again");
  uint64_t rid_b = job->decode->req->rid;
  wfree(job);

  admin_ok(&h, TANDEM__ADMIN_ACTION__ADMIN_REMOVE, "w0", "worker w0 removed; its 1 requests are retried");
  Tandem__Cluster__RouterMessage *rm = wexpect(w0, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_REMOVE, "the remove");
  cr_expect(strstr(rm->remove->reason, "operator"), "%s", rm->remove->reason);
  wfree(rm);
  job = wexpect(w1, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "b's next attempt on w1");
  cr_expect_str_eq(job->decode->req->client_id, "b");
  cr_expect_neq(job->decode->req->rid, rid_b);
  wfree(job);
  cr_expect(!status_of(health(&h, &hm), "w0"), "the removed worker is still listed");
  cfree(hm);
  admin(&h, TANDEM__ADMIN_ACTION__ADMIN_REMOVE, "w0", "e5");
  expect_error(&h, "e5", TANDEM__ERROR_CODE__ERROR_NOT_FOUND, "no worker 'w0'");

  /* a worker that drains on its own (a signal) cannot be taken back */
  Tandem__Cluster__Load ld = TANDEM__CLUSTER__LOAD__INIT;
  ld.draining = ld.stopping = true;
  ld.free_self_blocks = ld.free_cross_blocks = 1000;
  Tandem__Cluster__Heartbeat hb = TANDEM__CLUSTER__HEARTBEAT__INIT;
  hb.load = &ld;
  Tandem__Cluster__WorkerMessage wm = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  wm.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_HEARTBEAT;
  wm.heartbeat = &hb;
  send_body(w1, &wm);
  for (int64_t end = td_now_ms() + WAIT_MS; td_now_ms() < end;) {
    ws = status_of(health(&h, &hm), "w1");
    bool stopping = ws && ws->stopping;
    cfree(hm);
    if (stopping) break;
    usleep(10000);
  }
  admin(&h, TANDEM__ADMIN_ACTION__ADMIN_UNDRAIN, "w1", "e6");
  expect_error(&h, "e6", TANDEM__ERROR_CODE__ERROR_FAILED_PRECONDITION, "drains on its own");
  admin(&h, TANDEM__ADMIN_ACTION__ADMIN_DRAIN, "w1", "e7");
  expect_error(&h, "e7", TANDEM__ERROR_CODE__ERROR_FAILED_PRECONDITION, "already draining (it was told to stop)");
  void *socks[] = {w0, w1};
  finish(&h, socks, 2);
}

/* ------------------------------------------------------------ every field past its limit, end to end */

/* The next job for w that is not a cancel (cancels of earlier attempts may come first). */
static Tandem__Cluster__RouterMessage *next_job(void *w, const char *what) {
  Tandem__Cluster__RouterMessage *m;
  while ((m = wrecv(w, WAIT_MS)) && m->body_case == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL) wfree(m);
  cr_assert(m, "%s: nothing came", what);
  return m;
}

/* A request served start to end by decode worker w, which encodes too: the cluster still serves. */
static void serve_one(harness *h, void *w, const char *id) {
  generate(h, (gen){.id = id, .max_new = 2});
  Tandem__Cluster__RouterMessage *job = next_job(w, "the decode job");
  cr_assert_eq(job->body_case, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE);
  uint64_t rid = job->decode->req->rid;
  wfree(job);
  int32_t t[2] = {7, 8};
  send_tokens(w, rid, 0, t, 2);
  send_finished(w, rid, t, 2);
  expect_result(h, id, t, 2, 1);
}

typedef struct reg_row {
  const char *says;
  void (*bad)(Tandem__Cluster__WorkerInfo *);
} reg_row;

static void rg_vocab(Tandem__Cluster__WorkerInfo *in) { in->model->vocab_size = 0x80000000u; }
static void rg_target(Tandem__Cluster__WorkerInfo *in) { in->model->max_target_len = 0xffffffffu; }
static void rg_start(Tandem__Cluster__WorkerInfo *in) { in->model->decoder_start->id = 100; }
static void rg_eos(Tandem__Cluster__WorkerInfo *in) {
  static int32_t eos[1] = {-7};
  in->model->eos_token_ids = eos;
}
static void rg_self(Tandem__Cluster__WorkerInfo *in) { in->self_blocks = 0x80000000u; }
static void rg_running(Tandem__Cluster__WorkerInfo *in) { in->max_running = 1u << 20; }
static void rg_role(Tandem__Cluster__WorkerInfo *in) { in->roles[0] = (Tandem__Cluster__Role)9; }
static void rg_block(Tandem__Cluster__WorkerInfo *in) { in->block_size = 0; }
static void rg_batch(Tandem__Cluster__WorkerInfo *in) { in->encode_batch_tokens = 0x80000000u; }
static void rg_desc(Tandem__Cluster__WorkerInfo *in) {
  static uint8_t junk[2] = {0xff, 0x01};
  in->transfer_desc.data = junk;
  in->transfer_desc.len = 2;
}
static void rg_device(Tandem__Cluster__WorkerInfo *in) {
  static char dev[300];
  memset(dev, 'd', sizeof dev - 1);
  in->device = dev;
}

/* A registration past a field's limit is refused with the field named in
 * the RegisterAck; the router registers nothing of it and serves on. */
Test(router_control, registrations_past_a_fields_limit_are_refused_naming_it, .timeout = 30) {
  static const reg_row rows[] = {
      {"ModelInfo.vocab_size 2147483648 is outside 1 to 16777216", rg_vocab},
      {"ModelInfo.max_target_len 4294967295 is outside 2 to", rg_target},
      {"ModelInfo.decoder_start[0] 100 is outside the vocabulary of 100", rg_start},
      {"ModelInfo.eos_token_ids[0] -7 is outside", rg_eos},
      {"WorkerInfo.self_blocks 2147483648 exceeds 268435456", rg_self},
      {"WorkerInfo.max_running 1048576 exceeds 65536", rg_running},
      {"WorkerInfo.roles[0] 9 is no role", rg_role},
      {"WorkerInfo.block_size 0 is outside 1 to", rg_block},
      {"WorkerInfo.encode_batch_tokens 2147483648 exceeds", rg_batch},
      {"WorkerInfo.transfer_desc", rg_desc},
      {"WorkerInfo.device has 299 bytes", rg_device},
  };
  enum { N = sizeof rows / sizeof *rows };
  harness h;
  start(&h, (td_router_opts){0});
  void *socks[N + 1];
  for (int i = 0; i < N; i++) {
    char id[16];
    snprintf(id, sizeof id, "bad-%d", i);
    Tandem__Cluster__RouterMessage *ack;
    socks[i] = fake_register(&h, id, (fake_opts){.roles = "ed", .mutate = rows[i].bad}, &ack);
    cr_expect(!ack->ack->accepted, "row %d registered", i);
    cr_expect(strstr(ack->ack->reason, rows[i].says), "row %d: \"%s\" does not say \"%s\"", i, ack->ack->reason,
              rows[i].says);
    wfree(ack);
  }
  Tandem__ServerMessage *hm;
  cr_expect_eq(health(&h, &hm)->n_workers, 0, "a refused registration left a worker");
  cfree(hm);
  socks[N] = fake_worker(&h, "w0", enc_dec);
  serve_one(&h, socks[N], "after");
  finish(&h, socks, N + 1);
}

/* What a decode worker sends back about request rid, broken one way. */
typedef enum { BAD_TOKEN, BAD_LOGPROB, BAD_PAST_MAX, BAD_BATCH, BAD_SCORE, BAD_TEXT, BAD_OUTPUTS, BAD_RESULT_LEN,
               BAD_CODE, BAD_MS, BAD_KINDS } bad_kind;

static void send_bad(void *w, uint64_t rid, bad_kind k) {
  int32_t t[3] = {7, 8, 9}, oov[1] = {100};
  float nan_lp[1] = {NAN};
  Tandem__Cluster__Tokens tk = TANDEM__CLUSTER__TOKENS__INIT;
  tk.rid = rid;
  tk.tokens = t;
  tk.n_tokens = 1;
  Tandem__Cluster__Tokens *items[1] = {&tk};
  Tandem__Cluster__TokensBatch tb = TANDEM__CLUSTER__TOKENS_BATCH__INIT;
  Tandem__SequenceOutput o = TANDEM__SEQUENCE_OUTPUT__INIT, *os[2] = {&o, &o};
  o.tokens = t;
  o.n_tokens = 2;
  o.finish_reason = TANDEM__FINISH_REASON__FINISH_LENGTH;
  Tandem__Cluster__Finished fin = TANDEM__CLUSTER__FINISHED__INIT;
  fin.rid = rid;
  fin.outputs = os;
  fin.n_outputs = 1;
  Tandem__Cluster__Failed fl = TANDEM__CLUSTER__FAILED__INIT;
  fl.rid = rid;
  fl.code = (Tandem__ErrorCode)99;
  fl.message = "?";
  fl.retryable = false;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS;
  m.tokens = &tk;
  switch (k) {
    case BAD_TOKEN: tk.tokens = oov; break;
    case BAD_LOGPROB: tk.logprobs = nan_lp, tk.n_logprobs = 1; break;
    case BAD_PAST_MAX: tk.n_tokens = 3; break;
    case BAD_BATCH:
      tk.tokens = oov;
      tb.items = items;
      tb.n_items = 1;
      m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS_BATCH;
      m.tokens_batch = &tb;
      break;
    case BAD_CODE:
      m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED;
      m.failed = &fl;
      break;
    default:
      if (k == BAD_SCORE) o.score = NAN;
      if (k == BAD_TEXT) o.text = "forged", o.has_text = true;
      if (k == BAD_OUTPUTS) fin.n_outputs = 2;
      if (k == BAD_RESULT_LEN) o.n_tokens = 3;
      if (k == BAD_MS) fin.decode_ms = -1;
      m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FINISHED;
      m.finished = &fin;
      break;
  }
  send_body(w, &m);
}

/* A worker's message past a field's limit, or at odds with the request it
 * names, costs that request its attempt (one here, so it ends with the
 * message named), the worker is told to let go, and the router serves on. */
Test(router_control, a_workers_invalid_messages_end_the_attempt_naming_the_field, .timeout = 60) {
  static const char *says[BAD_KINDS] = {
      [BAD_TOKEN] = "Tokens.tokens[0] 100 is outside the vocabulary of 100",
      [BAD_LOGPROB] = "Tokens.logprobs[0] is nan",
      [BAD_PAST_MAX] = "Tokens: 3 tokens after 0, past max_new_tokens 2",
      [BAD_BATCH] = "TokensBatch.items[0].tokens[0] 100 is outside",
      [BAD_SCORE] = "Finished.outputs[0].score is nan",
      [BAD_TEXT] = "Finished.outputs[0] carries text or segments",
      [BAD_OUTPUTS] = "Finished.outputs holds 2 sequences, the request runs 1",
      [BAD_RESULT_LEN] = "Finished.outputs[0] holds 3 tokens, past max_new_tokens 2",
      [BAD_CODE] = "Failed.code 99 is no error code",
      [BAD_MS] = "Finished.decode_ms -1",
  };
  harness h;
  start(&h, (td_router_opts){.max_attempts = 1});
  void *w = fake_worker(&h, "w0", enc_dec);
  for (int k = 0; k < BAD_KINDS; k++) {
    char id[16];
    snprintf(id, sizeof id, "bad-%d", k);
    generate(&h, (gen){.id = id, .max_new = 2});
    Tandem__Cluster__RouterMessage *job = next_job(w, "the decode job");
    cr_assert_eq(job->body_case, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE);
    uint64_t rid = job->decode->req->rid;
    wfree(job);
    send_bad(w, rid, (bad_kind)k);
    char want[200];
    snprintf(want, sizeof want, "gave up after 1 attempts: worker w0 sent an invalid message: %s", says[k]);
    expect_error(&h, id, TANDEM__ERROR_CODE__ERROR_UNAVAILABLE, want);
    Tandem__Cluster__RouterMessage *c = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL, "the worker's cancel");
    cr_expect_eq(c->cancel->rid, rid);
    wfree(c);
  }
  serve_one(&h, w, "after");
  void *socks[] = {w};
  finish(&h, socks, 1);
}

/* Reservations at odds with the request: another worker's id, too many
 * blocks, a block past the pool, one block twice, a target without a
 * descriptor, prompt blocks nobody asked for. No encode job goes out; the
 * request ends naming it. */
Test(router_control, reservations_at_odds_with_the_request_end_the_attempt, .timeout = 60) {
  enum { OTHER_ID, TOO_MANY, PAST_POOL, TWICE, NO_DESC, SELF, ROWS };
  static const char *says[ROWS] = {
      [OTHER_ID] = "Reserved.cross.worker_id enc is not the worker that reserved (dec)",
      [TOO_MANY] = "Reserved.cross holds 2 blocks for 3 tokens, the request needs 1 blocks for 3",
      [PAST_POOL] = "Reserved.cross.blocks holds block 1000, the worker registered 1000",
      [TWICE] = "Reserved.cross.blocks holds block 4 twice",
      [NO_DESC] = "Reserved.cross.desc: the KV descriptor is empty",
      [SELF] = "Reserved.self for a request whose prompt KV is not pushed there",
  };
  harness h;
  start(&h, (td_router_opts){.max_attempts = 1});
  void *d = fake_worker(&h, "dec", (fake_opts){.roles = "d"});
  void *e = fake_worker(&h, "enc", (fake_opts){.roles = "e"});
  for (int k = 0; k < ROWS; k++) {
    char id[16];
    snprintf(id, sizeof id, "res-%d", k);
    generate(&h, (gen){.id = id, .max_new = 2, .n_input = k == TWICE ? 20 : 3});
    Tandem__Cluster__RouterMessage *job = next_job(d, "the decode job");
    uint64_t rid = job->decode->req->rid;
    wfree(job);
    int32_t blocks[2] = {4, 5};
    Tandem__Cluster__KvTarget kt = TANDEM__CLUSTER__KV_TARGET__INIT, self = TANDEM__CLUSTER__KV_TARGET__INIT;
    kv_target(&kt, "dec", blocks, 1, 3);
    kv_target(&self, "dec", blocks + 1, 1, 3);
    Tandem__Cluster__Reserved res = TANDEM__CLUSTER__RESERVED__INIT;
    res.rid = rid;
    res.cross = &kt;
    if (k == OTHER_ID) kt.worker_id = "enc";
    if (k == TOO_MANY) kt.n_blocks = 2;
    if (k == PAST_POOL) blocks[0] = 1000;
    if (k == TWICE) blocks[1] = 4, kt.n_blocks = 2, kt.tokens = 20;
    if (k == NO_DESC) kt.desc.len = 0;
    if (k == SELF) res.self = &self;
    Tandem__Cluster__WorkerMessage rm = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
    rm.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED;
    rm.reserved = &res;
    send_body(d, &rm);
    char want[200];
    snprintf(want, sizeof want, "gave up after 1 attempts: worker dec sent an invalid message: %s", says[k]);
    expect_error(&h, id, TANDEM__ERROR_CODE__ERROR_UNAVAILABLE, want);
    Tandem__Cluster__RouterMessage *c = wexpect(d, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL, "the cancel");
    wfree(c);
  }
  Tandem__Cluster__RouterMessage *m; /* cancels of the attempts placed there, no job */
  while ((m = wrecv(e, 200))) {
    cr_expect_eq(m->body_case, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL, "the encoder got message %d",
                 (int)m->body_case);
    wfree(m);
  }
  /* a good reservation still starts the encoder */
  generate(&h, (gen){.id = "good", .max_new = 2});
  Tandem__Cluster__RouterMessage *job = next_job(d, "the decode job");
  uint64_t rid = job->decode->req->rid;
  wfree(job);
  send_reserved(d, rid, 4, 3);
  job = next_job(e, "the encode job");
  cr_expect_eq(job->body_case, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE);
  wfree(job);
  void *socks[] = {d, e};
  finish(&h, socks, 2);
}

/* A client's request with one field past its limit, through the live
 * router: refused with the limit named; then a request is served. */
typedef struct client_row {
  const char *says;
  Tandem__ErrorCode code;
  void (*bad)(Tandem__GenerateRequest *, Tandem__SamplingParams *);
} client_row;

static void c_max_new_2g(Tandem__GenerateRequest *g, Tandem__SamplingParams *sp) { (void)sp, g->max_new_tokens = 0x80000000u; }
static void c_max_new_4g(Tandem__GenerateRequest *g, Tandem__SamplingParams *sp) { (void)sp, g->max_new_tokens = 0xffffffffu; }
static void c_temp_nan(Tandem__GenerateRequest *g, Tandem__SamplingParams *sp) { (void)g, sp->temperature = NAN; }
static void c_top_p_inf(Tandem__GenerateRequest *g, Tandem__SamplingParams *sp) { (void)g, sp->top_p = INFINITY; }
static void c_top_p_nan(Tandem__GenerateRequest *g, Tandem__SamplingParams *sp) { (void)g, sp->top_p = NAN; }
static void c_top_k(Tandem__GenerateRequest *g, Tandem__SamplingParams *sp) { (void)g, sp->top_k = 101; }
static void c_lp(Tandem__GenerateRequest *g, Tandem__SamplingParams *sp) {
  (void)g;
  sp->has_length_penalty = true;
  sp->length_penalty = -INFINITY;
}
static void c_n(Tandem__GenerateRequest *g, Tandem__SamplingParams *sp) { (void)g, sp->n = 0x80000000u; }
static void c_bos(Tandem__GenerateRequest *g, Tandem__SamplingParams *sp) {
  (void)g;
  sp->set_forced_bos = true;
  sp->forced_bos_token_id = -5;
}
static void c_eos(Tandem__GenerateRequest *g, Tandem__SamplingParams *sp) {
  (void)g;
  sp->set_forced_eos = true;
  sp->forced_eos_token_id = 100;
}
static void c_init_ts(Tandem__GenerateRequest *g, Tandem__SamplingParams *sp) {
  (void)g;
  sp->has_max_initial_timestamp = true;
  sp->max_initial_timestamp_index = 0x7fffffff;
}
static void c_stops(Tandem__GenerateRequest *g, Tandem__SamplingParams *sp) {
  (void)sp;
  static int32_t stop[TD_ROUTER_MAX_STOP_IDS + 1];
  g->stop_token_ids = stop;
  g->n_stop_token_ids = TD_ROUTER_MAX_STOP_IDS + 1;
}
static void c_model(Tandem__GenerateRequest *g, Tandem__SamplingParams *sp) {
  (void)sp;
  static char name[301];
  memset(name, 'm', 300);
  g->model = name;
}
static void c_input(Tandem__GenerateRequest *g, Tandem__SamplingParams *sp) {
  (void)sp;
  static int32_t ids[1] = {-1};
  g->input_ids = ids;
  g->n_input_ids = 1;
}
static void c_id(Tandem__GenerateRequest *g, Tandem__SamplingParams *sp) {
  (void)sp;
  static char id[300];
  memset(id, 'i', sizeof id - 1);
  g->request_id = id;
}

Test(router_control, a_clients_fields_past_their_limits_are_refused_naming_them, .timeout = 30) {
  static const client_row rows[] = {
      {"prompt 1 + max_new_tokens 2147483648 exceeds the model's 32 positions", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT,
       c_max_new_2g},
      {"prompt 1 + max_new_tokens 4294967295 exceeds", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, c_max_new_4g},
      {"temperature must be a finite number >= 0", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, c_temp_nan},
      {"top_p must be a finite number >= 0 (0 or >= 1: off), got inf", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT,
       c_top_p_inf},
      {"top_p must be a finite number >= 0 (0 or >= 1: off), got nan", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT,
       c_top_p_nan},
      {"top_k must be 0 (off) to the vocabulary's 100, got 101", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, c_top_k},
      {"length_penalty must be a finite number, got -inf", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, c_lp},
      {"n = 2147483648 exceeds the limit of 64", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, c_n},
      {"forced_bos_token_id -5 is outside the vocabulary of 100 (-1: none)", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT,
       c_bos},
      {"forced_eos_token_id 100 is outside", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, c_eos},
      {"max_initial_timestamp_index must be 0 to the vocabulary's 100, got 2147483647",
       TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, c_init_ts},
      {"1025 stop_token_ids exceed the limit of 1024", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, c_stops},
      {"model of 300 bytes exceeds the limit of 255", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, c_model},
      {"input token -1 (at 0) is outside the vocabulary", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, c_input},
      {"request_id of 299 bytes exceeds 255", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, c_id},
  };
  harness h;
  start(&h, (td_router_opts){0});
  void *w = fake_worker(&h, "w0", enc_dec);
  for (size_t i = 0; i < sizeof rows / sizeof *rows; i++) {
    char id[16];
    snprintf(id, sizeof id, "c%zu", i);
    static int32_t ids[3] = {1, 2, 3};
    Tandem__SamplingParams sp = TANDEM__SAMPLING_PARAMS__INIT;
    Tandem__GenerateRequest g = TANDEM__GENERATE_REQUEST__INIT;
    g.request_id = id;
    g.input_ids = ids;
    g.n_input_ids = 3;
    g.sampling = &sp;
    g.max_new_tokens = 2;
    rows[i].bad(&g, &sp);
    Tandem__ClientMessage m = TANDEM__CLIENT_MESSAGE__INIT;
    m.version = TD_PROTOCOL_VERSION;
    m.body_case = TANDEM__CLIENT_MESSAGE__BODY_GENERATE;
    m.generate = &g;
    cr_assert_eq(td_wire_send(h.client, NULL, 0, &m.base), TD_OK);
    /* an id past its limit is not echoed */
    expect_error(&h, rows[i].bad == c_id ? "" : id, rows[i].code, rows[i].says);
  }
  cancel(&h, "");
  expect_error(&h, "", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, "request_id is empty");
  Tandem__AdminRequest ar = TANDEM__ADMIN_REQUEST__INIT;
  char long_id[300];
  memset(long_id, 'a', sizeof long_id - 1);
  long_id[sizeof long_id - 1] = 0;
  ar.request_id = long_id;
  Tandem__ClientMessage am = TANDEM__CLIENT_MESSAGE__INIT;
  am.version = TD_PROTOCOL_VERSION;
  am.body_case = TANDEM__CLIENT_MESSAGE__BODY_ADMIN;
  am.admin = &ar;
  cr_assert_eq(td_wire_send(h.client, NULL, 0, &am.base), TD_OK);
  expect_error(&h, "", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, "request_id of 299 bytes exceeds 255");
  Tandem__ServerMessage *hm;
  cr_expect_eq(health(&h, &hm)->in_flight + hm->health->queued, 0, "a refused request is held");
  cfree(hm);
  serve_one(&h, w, "after");
  void *socks[] = {w};
  finish(&h, socks, 1);
}

/* A router that just started knows no model until a worker registers (its
 * clients' queued requests may come first, as after a restart): a request
 * waits --capacity-wait-ms for one and is then admitted and served, or
 * fails naming the wait; a cancel reaches it meanwhile. */
Test(router_control, a_request_before_any_worker_waits_for_one, .timeout = 30) {
  harness h;
  start(&h, (td_router_opts){.capacity_wait_ms = 2000});
  generate(&h, (gen){.id = "early", .max_new = 2});
  generate(&h, (gen){.id = "gone", .max_new = 2});
  cancel(&h, "gone");
  expect_error(&h, "gone", TANDEM__ERROR_CODE__ERROR_CANCELLED, "cancelled by the client");
  Tandem__ServerMessage *hm;
  cr_expect_eq(health(&h, &hm)->queued, 1, "the request waiting for a worker is queued");
  cfree(hm);
  expect_quiet(&h, 200);
  void *w = fake_worker(&h, "w0", enc_dec);
  Tandem__Cluster__RouterMessage *job = wexpect(w, TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE, "the decode job");
  cr_expect_str_eq(job->decode->req->client_id, "early");
  uint64_t rid = job->decode->req->rid;
  wfree(job);
  int32_t t[2] = {7, 8};
  send_finished(w, rid, t, 2);
  expect_result(&h, "early", t, 2, 1);
  void *socks[] = {w};
  finish(&h, socks, 1);
  /* and without a worker, the wait ends with the reason */
  start(&h, (td_router_opts){.capacity_wait_ms = 300});
  int64_t t0 = td_now_ms();
  generate(&h, (gen){.id = "alone", .max_new = 2});
  expect_error(&h, "alone", TANDEM__ERROR_CODE__ERROR_UNAVAILABLE,
               "no decode worker is registered (waited");
  cr_expect_geq(td_now_ms() - t0, 300, "refused before its wait");
  finish(&h, NULL, 0);
}
