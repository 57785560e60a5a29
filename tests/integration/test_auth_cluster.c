/* CURVE across a cluster of real processes on loopback: with keys, requests
 * go client -> router -> encoder and decode workers, KV over ZeroMQ, and
 * give transformers' tokens; a client without a key or with an unknown
 * one, a client key registering as a worker, and a worker with an unknown
 * key are refused and logged by the router, a listed worker key cannot
 * take another worker's id while it is away, KV pushes from an unknown key
 * or into no reservation are refused, and the cluster serves on;
 * tandem-admin needs a key on the admin list. A TP group with keys serves,
 * and its own sockets admit its ranks only. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <criterion/criterion.h>

#include "../unit/fixture.h"
#include "cluster_util.h"
#include "common/clock.h"
#include "proto/auth.h"
#include "proto/wire.h"

static char keys[64];

static void keygen(const char *name) {
  char pub[128], sec[128];
  snprintf(pub, sizeof pub, "%s/%s.pub", keys, name);
  snprintf(sec, sizeof sec, "%s/%s.key", keys, name);
  cr_assert(td_auth_keygen(pub, sec) == TD_OK, "%s", td_errmsg());
}

static void pub_of(const char *name, char out[TD_AUTH_KEY_Z85]) {
  char p[128];
  snprintf(p, sizeof p, "%s/%s.pub", keys, name);
  cr_assert(td_auth_read_key(p, false, out) == TD_OK, "%s", td_errmsg());
}

static void write_list(const char *file, const char *const *names, int n) {
  char p[128], k[TD_AUTH_KEY_Z85];
  snprintf(p, sizeof p, "%s/%s", keys, file);
  FILE *f = fopen(p, "w");
  cr_assert(f);
  for (int i = 0; i < n; i++) {
    pub_of(names[i], k);
    fprintf(f, "%s\n", k);
  }
  fclose(f);
}

static td_auth *client_auth(const char *name) {
  char sec[128], rk[128];
  snprintf(sec, sizeof sec, "%s/%s.key", keys, name);
  snprintf(rk, sizeof rk, "%s/router.pub", keys);
  td_auth_opts o = {.secret_file = sec, .router_key_file = rk};
  td_auth *a = NULL;
  cr_assert(td_auth_create(&o, &a) == TD_OK && a, "%s", td_errmsg());
  return a;
}

static bool wait_log(cluster *c, const char *name, const char *text, int timeout_ms) {
  for (int64_t end = td_now_ms() + timeout_ms; td_now_ms() < end; usleep(100000))
    if (cluster_log_has(c, name, text)) return true;
  return false;
}

static bool registered(cluster *c, const char *id) {
  td_client_health h;
  if (!cluster_health(c, &h)) return false;
  for (int i = 0; i < h.n_workers; i++)
    if (!strcmp(h.workers[i].id, id)) return true;
  return false;
}

/* decode-0's KV endpoint and public key, from its start line
 * "KV endpoint zmq:tcp://HOST:PORT KEY" */
static void kv_endpoint(cluster *c, const char *name, char ep[128], char key[TD_AUTH_KEY_Z85]) {
  char path[600], line[4096];
  snprintf(path, sizeof path, "%s/%s.log", c->dir, name);
  FILE *f = fopen(path, "r");
  cr_assert(f);
  bool found = false;
  while (!found && fgets(line, sizeof line, f)) {
    char *p = strstr(line, "KV endpoint zmq:");
    if (p) found = sscanf(p, "KV endpoint zmq:%127s %40s", ep, key) == 2;
  }
  fclose(f);
  cr_assert(found, "no CURVE KV endpoint in %s's log", name);
}

/* Pushes one block into a reservation that does not exist, as a listed
 * worker key (or a stranger's); returns the KvAck's ok, or -1 when no
 * answer came (the handshake was refused). */
static int fake_push(const char *ep, const char *server_key, const char *as) {
  td_auth *a = client_auth(as);
  void *ctx = zmq_ctx_new(), *d = zmq_socket(ctx, ZMQ_DEALER);
  int linger = 0;
  zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
  cr_assert(td_auth_client(a, d, server_key) == TD_OK, "%s", td_errmsg());
  cr_assert(zmq_connect(d, ep) == 0);
  Tandem__Cluster__KvPush h = TANDEM__CLUSTER__KV_PUSH__INIT;
  int32_t blocks[1] = {0};
  uint8_t block[64] = {0};
  h.version = TD_PROTOCOL_VERSION;
  h.rid = 987654321;
  h.reservation = 4242;
  h.cross = true;
  h.blocks = blocks;
  h.n_blocks = 1;
  h.block_bytes = sizeof block;
  h.push_id = 1;
  uint8_t hb[128];
  size_t hl = tandem__cluster__kv_push__pack(&h, hb);
  zmq_send(d, hb, hl, ZMQ_SNDMORE);
  zmq_send(d, block, sizeof block, 0);
  int ok = -1;
  zmq_pollitem_t it = {.socket = d, .events = ZMQ_POLLIN};
  if (zmq_poll(&it, 1, 3000) > 0) {
    uint8_t ab[512];
    int n = zmq_recv(d, ab, sizeof ab, 0);
    Tandem__Cluster__KvAck *ack = n > 0 ? tandem__cluster__kv_ack__unpack(NULL, (size_t)n, ab) : NULL;
    cr_assert(ack, "a malformed KvAck");
    ok = ack->ok;
    tandem__cluster__kv_ack__free_unpacked(ack, NULL);
  }
  zmq_close(d);
  zmq_ctx_term(ctx);
  td_auth_destroy(a);
  return ok;
}

Test(auth, curve_cluster_serves_listed_keys_and_refuses_others, .timeout = 300) {
  snprintf(keys, sizeof keys, "/tmp/td-keys-XXXXXX");
  cr_assert(mkdtemp(keys));
  const char *names[] = {"router", "encoder-0", "decode-0", "client", "operator", "stranger", "intruder", "thief"};
  for (int i = 0; i < 8; i++) keygen(names[i]);
  const char *workers[] = {"encoder-0", "decode-0", "thief"}, *clients[] = {"client", "operator"},
             *admins[] = {"operator"};
  write_list("workers.list", workers, 3);
  write_list("clients.list", clients, 2);
  write_list("admins.list", admins, 1);
  td_auth *ca = client_auth("client");
  fixture fx;
  fx_load("t5-tiny", &fx);
  cluster c;
  cluster_opts o = {.model = fx.dir, .encoders = 1, .decodes = 1, .keys = keys, .auth = ca};
  cluster_start(&c, &o);
  cr_expect(cluster_log_has(&c, "router", "CURVE on the client and worker endpoints"));

  /* end to end: the encoder's cross KV reaches the decode worker over ZeroMQ (CURVE) */
  expect_fixture_greedy(&c, &fx);
  kv_count k;
  cr_assert(cluster_kv_count(&c, "decode-0", 5000, &k));
  cr_expect(k.in_zmq > 0 && k.in_ucx == 0, "decode-0 took %llu blocks over ZeroMQ, %llu over UCX",
            (unsigned long long)k.in_zmq, (unsigned long long)k.in_ucx);

  /* clients: no key, an unknown key; both get no answer and the router logs them */
  td_client *cl = NULL;
  cr_expect(td_client_connect_wait(c.client_ep, 1500, &cl) == TD_ERR_PEER, "a client without a key got an answer");
  /* libzmq reports the keyless handshake as a mechanism mismatch, or as
   * another protocol error when the peer hangs up first: either is logged */
  cr_expect(wait_log(&c, "router", "on the client endpoint", 5000),
            "no refusal of the keyless client in the router's log");
  td_auth *sa = client_auth("stranger");
  cr_expect(td_client_connect_wait_auth(c.client_ep, sa, 1500, &cl) == TD_ERR_PEER, "an unknown key got an answer");
  char sk[TD_AUTH_KEY_Z85], line[200];
  pub_of("stranger", sk);
  snprintf(line, sizeof line, "refused key %s on tandem-clients", sk);
  cr_expect(wait_log(&c, "router", line, 5000), "the router did not log the unknown client key");
  td_auth_destroy(sa);

  /* a client key registering as a worker (a worker process given the
   * client's secret), and a worker with an unknown key: neither registers */
  char src[128], dst[128], cmd[400];
  snprintf(src, sizeof src, "%s/client.key", keys);
  snprintf(dst, sizeof dst, "%s/fake-worker.key", keys);
  snprintf(cmd, sizeof cmd, "cp -p %s %s", src, dst);
  cr_assert(system(cmd) == 0);
  int fake = cluster_add_worker(&c, "fake-worker", "decode", 4);
  int intruder = cluster_add_worker(&c, "intruder", "encode,decode", 4);
  char ck[TD_AUTH_KEY_Z85], ik[TD_AUTH_KEY_Z85];
  pub_of("client", ck);
  pub_of("intruder", ik);
  snprintf(line, sizeof line, "refused key %s on tandem-workers", ck);
  cr_expect(wait_log(&c, "router", line, 20000), "the router did not log the client key on its worker socket");
  snprintf(line, sizeof line, "refused key %s on tandem-workers", ik);
  cr_expect(wait_log(&c, "router", line, 20000), "the router did not log the unknown worker key");
  sleep(1);
  cr_expect(!registered(&c, "fake-worker"), "a client key registered a worker");
  cr_expect(!registered(&c, "intruder"), "an unknown worker key registered");
  cr_expect(registered(&c, "decode-0") && registered(&c, "encoder-0"));
  cluster_kill(&c, fake);
  cluster_kill(&c, intruder);

  /* a listed worker key cannot take over decode-0's id while decode-0 is
   * away (stopped past the router's liveness); decode-0 comes back under it */
  int d0 = -1;
  for (int i = 0; i < c.n; i++)
    if (!strcmp(c.p[i].name, "decode-0")) d0 = i;
  cr_assert(d0 >= 0);
  kill(c.p[d0].pid, SIGSTOP);
  cr_assert(wait_log(&c, "router", "worker decode-0 is gone", 10000), "decode-0 was not declared gone");
  snprintf(c.worker_extra, sizeof c.worker_extra, "--id decode-0");
  int thief = cluster_add_worker(&c, "thief", "decode", 4);
  c.worker_extra[0] = 0;
  cr_expect(wait_log(&c, "router", "worker id decode-0 belongs to another key", 20000),
            "the router did not refuse decode-0's id under another key");
  cr_expect(!registered(&c, "decode-0"), "another key registered decode-0");
  kill(c.p[d0].pid, SIGCONT);
  cluster_kill(&c, thief);
  int64_t back = td_now_ms() + 20000;
  while (!registered(&c, "decode-0") && td_now_ms() < back) usleep(100000);
  cr_expect(registered(&c, "decode-0"), "decode-0 did not register again under its own key");

  /* KV pushes into decode-0: a stranger's key never gets through the
   * handshake; a listed worker key's push into a reservation that does not
   * exist is refused and logged, and the requests after it are right */
  char kep[128], kkey[TD_AUTH_KEY_Z85];
  kv_endpoint(&c, "decode-0", kep, kkey);
  cr_expect_eq(fake_push(kep, kkey, "stranger"), -1, "a stranger's KV push was answered");
  snprintf(line, sizeof line, "refused key %s on tandem-kv", sk);
  cr_expect(wait_log(&c, "decode-0", line, 5000), "decode-0 did not log the stranger's key");
  cr_expect_eq(fake_push(kep, kkey, "thief"), 0, "a push into no reservation was accepted");
  cr_expect(wait_log(&c, "decode-0", "refused a KV push for request 987654321", 5000));
  /* counted, and the count reaches the router's health with the next heartbeats */
  bool counted = false;
  for (int64_t end = td_now_ms() + 5000; !counted && td_now_ms() < end; usleep(100000)) {
    td_client_health hh;
    if (!cluster_health(&c, &hh)) continue;
    for (int i = 0; i < hh.n_workers; i++)
      if (!strcmp(hh.workers[i].id, "decode-0") && hh.workers[i].kv_refused >= 1) counted = true;
  }
  cr_expect(counted, "decode-0's refused push is not counted in the health answer");

  /* admin requests: a client key is refused, the operator's key admitted */
  char cmd2[1200];
  snprintf(cmd2, sizeof cmd2,
           "%s/tandem-admin --router %s --curve-secret %s/client.key --router-key %s/router.pub list >/dev/null 2>&1",
           TD_BIN_DIR, c.client_ep, keys, keys);
  int rc = system(cmd2);
  cr_expect(WIFEXITED(rc) && WEXITSTATUS(rc) == 1, "tandem-admin with a client key: status %d", rc);
  snprintf(cmd2, sizeof cmd2,
           "%s/tandem-admin --router %s --curve-secret %s/operator.key --router-key %s/router.pub list >/dev/null 2>&1",
           TD_BIN_DIR, c.client_ep, keys, keys);
  rc = system(cmd2);
  cr_expect(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "tandem-admin with the admin key: status %d", rc);

  /* the cluster still serves the listed client */
  expect_fixture_greedy(&c, &fx);
  cr_expect(cluster_stop(&c), "unclean stop (logs in %s)", c.dir);
  td_auth_destroy(ca);
  fx_free(&fx);
}

/* The address of a group's endpoint from its leader's start line
 * "group NAME: communicator tcp://H:P, mirror tcp://H:P". */
static void group_endpoint(cluster *c, const char *leader, const char *which, char ep[128]) {
  char path[600], line[4096], want[32];
  snprintf(path, sizeof path, "%s/%s.log", c->dir, leader);
  snprintf(want, sizeof want, "%s tcp://", which);
  FILE *f = fopen(path, "r");
  cr_assert(f);
  bool found = false;
  while (!found && fgets(line, sizeof line, f)) {
    char *p = strstr(line, want);
    if (p) found = sscanf(p + strlen(which) + 1, "%127[^,; ]", ep) == 1;
  }
  fclose(f);
  cr_assert(found, "no %s endpoint in %s's log", which, leader);
}

/* Whether a CURVE handshake with `as`'s keys to a group's socket (the
 * leader's key the server's) goes through: the socket's own monitor says so
 * (ZMQ_EVENT_HANDSHAKE_SUCCEEDED). */
static bool group_handshake(const char *ep, const char *server_pub, const char *as) {
  td_auth *a = client_auth(as);
  void *ctx = zmq_ctx_new(), *d = zmq_socket(ctx, ZMQ_DEALER);
  int linger = 0;
  zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
  cr_assert(zmq_socket_monitor(d, "inproc://hs", ZMQ_EVENT_HANDSHAKE_SUCCEEDED) == 0);
  void *mon = zmq_socket(ctx, ZMQ_PAIR);
  cr_assert(zmq_connect(mon, "inproc://hs") == 0);
  cr_assert(td_auth_client(a, d, server_pub) == TD_OK, "%s", td_errmsg());
  cr_assert(zmq_connect(d, ep) == 0); /* nothing sent: a running group's sockets take no stray message */
  zmq_pollitem_t it = {.socket = mon, .events = ZMQ_POLLIN};
  bool ok = zmq_poll(&it, 1, 2000) > 0;
  zmq_close(mon);
  zmq_close(d);
  zmq_ctx_term(ctx);
  td_auth_destroy(a);
  return ok;
}

/* A GroupJoin for `group`'s rank `rank` over the router's worker endpoint
 * with `as`'s keys; the GroupInfo's error ("" when accepted), or NULL when
 * no answer came. */
static char *join_as(cluster *c, const char *group, unsigned rank, unsigned world, const char *as) {
  td_auth *a = client_auth(as);
  void *ctx = zmq_ctx_new(), *d = zmq_socket(ctx, ZMQ_DEALER);
  td_wire_setup_socket(d);
  cr_assert(td_auth_client(a, d, NULL) == TD_OK, "%s", td_errmsg());
  cr_assert(zmq_connect(d, c->worker_ep) == 0);
  Tandem__Cluster__GroupJoin j = TANDEM__CLUSTER__GROUP_JOIN__INIT;
  j.group = (char *)group;
  j.rank = rank;
  j.world = world;
  j.endpoint = "tcp://127.0.0.1:9";
  j.cross_mode = "auto";
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.version = TD_PROTOCOL_VERSION;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_GROUP_JOIN;
  m.group_join = &j;
  cr_assert(td_wire_send(d, NULL, 0, &m.base) == TD_OK);
  char *err = NULL;
  zmq_pollitem_t it = {.socket = d, .events = ZMQ_POLLIN};
  for (int64_t end = td_now_ms() + 3000; !err && td_now_ms() < end;) {
    if (zmq_poll(&it, 1, 200) <= 0) continue;
    td_wire_frame f;
    if (td_wire_recv(d, false, false, &f) != TD_OK) continue;
    Tandem__Cluster__RouterMessage *rm = NULL;
    uint32_t ver;
    if (td_wire_unpack_router(&f, &rm, &ver) == TD_OK && rm->body_case == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO)
      err = strdup(rm->group_info->ok ? "" : rm->group_info->error);
    if (rm) tandem__cluster__router_message__free_unpacked(rm, NULL);
    td_wire_frame_free(&f);
  }
  zmq_close(d);
  zmq_ctx_term(ctx);
  td_auth_destroy(a);
  return err;
}

/* A tensor-parallel decode group on the CPU with keys: its ranks find each
 * other through the router, which names their keys; the group's mirror and
 * communicator take CURVE handshakes from its ranks only (a stranger's key
 * and another listed worker's are refused and logged by the leader); a
 * listed key cannot take a rank at the router; the group serves with
 * transformers' tokens throughout. */
Test(auth, curve_tp_group_admits_its_ranks_only, .timeout = 300) {
  snprintf(keys, sizeof keys, "/tmp/td-keys-XXXXXX");
  cr_assert(mkdtemp(keys));
  const char *names[] = {"router", "encoder-0", "decode-0", "decode-0-rank1", "client", "operator", "thief", "stranger"};
  for (int i = 0; i < 8; i++) keygen(names[i]);
  const char *workers[] = {"encoder-0", "decode-0", "decode-0-rank1", "thief"}, *clients[] = {"client", "operator"},
             *admins[] = {"operator"};
  write_list("workers.list", workers, 4);
  write_list("clients.list", clients, 2);
  write_list("admins.list", admins, 1);
  td_auth *ca = client_auth("client");
  fixture fx;
  fx_load("t5-tiny", &fx);
  cluster c;
  cluster_opts o = {.model = fx.dir, .encoders = 1, .decodes = 1, .group_tp = 2, .keys = keys, .auth = ca};
  cluster_start(&c, &o);
  cr_expect(cluster_log_has(&c, "decode-0", "(CURVE: the group's ranks only)"), "the group's sockets are plain");
  expect_fixture_greedy(&c, &fx);

  char leader[TD_AUTH_KEY_Z85], mirror[128], comm[128], line[200];
  pub_of("decode-0", leader);
  group_endpoint(&c, "decode-0", "mirror", mirror);
  group_endpoint(&c, "decode-0", "communicator", comm);
  /* its follower's key passes (the leader admits its ranks) */
  cr_expect(group_handshake(comm, leader, "decode-0-rank1"), "the group's own rank key was refused");
  /* a stranger and a listed worker that is not one of its ranks do not */
  cr_expect(!group_handshake(mirror, leader, "stranger"), "a stranger's key passed the mirror's handshake");
  cr_expect(!group_handshake(comm, leader, "thief"), "another worker's key passed the communicator's handshake");
  char sk[TD_AUTH_KEY_Z85], tk[TD_AUTH_KEY_Z85];
  pub_of("stranger", sk);
  pub_of("thief", tk);
  snprintf(line, sizeof line, "refused key %s on tandem-group", sk);
  cr_expect(wait_log(&c, "decode-0", line, 5000), "the leader did not log the stranger's key");
  snprintf(line, sizeof line, "refused key %s on tandem-group", tk);
  cr_expect(wait_log(&c, "decode-0", line, 5000), "the leader did not log the other worker's key");
  cr_expect(cluster_log_has(&c, "decode-0", "not a rank of this group"));
  /* at the router: a listed key cannot take the group's rank 1 */
  char *err = join_as(&c, "decode-0", 1, 2, "thief");
  cr_assert_not_null(err, "no answer to the thief's join");
  cr_expect(strstr(err, "group decode-0 rank 1 belongs to another key"), "the thief's join: '%s'", err);
  free(err);
  cr_expect(wait_log(&c, "router", "refused rank 1 of worker group decode-0", 5000));

  expect_fixture_greedy(&c, &fx);
  cr_expect(cluster_stop(&c), "unclean stop (logs in %s)", c.dir);
  td_auth_destroy(ca);
  fx_free(&fx);
}
