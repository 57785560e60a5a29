/* proto/auth: key files, lists, and real CURVE handshakes over loopback
 * TCP through the ZAP handler: listed keys get through under their domain,
 * others (no key, an unknown key, a key of the other list) do not. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <criterion/criterion.h>
#include <zmq.h>

#include "proto/auth.h"

static char dir[64];

static void mk_dir(void) {
  snprintf(dir, sizeof dir, "/tmp/td-auth-XXXXXX");
  cr_assert(mkdtemp(dir));
}

static void path(char *out, size_t cap, const char *name) { snprintf(out, cap, "%s/%s", dir, name); }

static void keygen(const char *name) {
  char pub[128], sec[128];
  snprintf(pub, sizeof pub, "%s/%s.pub", dir, name);
  snprintf(sec, sizeof sec, "%s/%s.key", dir, name);
  cr_assert(td_auth_keygen(pub, sec) == TD_OK, "%s", td_errmsg());
}

static void write_file(const char *name, const char *text) {
  char p[128];
  path(p, sizeof p, name);
  FILE *f = fopen(p, "w");
  cr_assert(f);
  fputs(text, f);
  fclose(f);
}

static void read_pub(const char *name, char out[TD_AUTH_KEY_Z85]) {
  char p[128];
  snprintf(p, sizeof p, "%s/%s.pub", dir, name);
  cr_assert(td_auth_read_key(p, false, out) == TD_OK, "%s", td_errmsg());
}

/* "a.pub b.pub" -> a list file of those public keys */
static void write_list(const char *name, const char *a, const char *b) {
  char ka[TD_AUTH_KEY_Z85], kb[TD_AUTH_KEY_Z85] = "", text[256];
  read_pub(a, ka);
  if (b) read_pub(b, kb);
  snprintf(text, sizeof text, "# comment\n\n%s\n%s\n", ka, kb);
  write_file(name, text);
}

static td_auth *load(const char *secret, const char *router, const char *workers, const char *clients) {
  char s[128], r[128], w[128], c[128];
  td_auth_opts o = {0};
  if (secret) snprintf(s, sizeof s, "%s/%s.key", dir, secret), o.secret_file = s;
  if (router) snprintf(r, sizeof r, "%s/%s.pub", dir, router), o.router_key_file = r;
  if (workers) path(w, sizeof w, workers), o.worker_keys_file = w;
  if (clients) path(c, sizeof c, clients), o.client_keys_file = c;
  td_auth *a = NULL;
  cr_assert(td_auth_create(&o, &a) == TD_OK, "%s", td_errmsg());
  cr_assert(a);
  return a;
}

Test(auth, keygen_files_and_refusals) {
  cr_assert(td_auth_available(), "libzmq without CURVE");
  mk_dir();
  keygen("a");
  char pub[128], sec[128];
  snprintf(pub, sizeof pub, "%s/a.pub", dir);
  snprintf(sec, sizeof sec, "%s/a.key", dir);
  struct stat st;
  cr_assert(stat(sec, &st) == 0);
  cr_expect_eq(st.st_mode & 0777, 0600, "secret mode %o", st.st_mode & 0777);
  cr_assert(stat(pub, &st) == 0);
  cr_expect_eq(st.st_size, 41, "one key and a newline");
  /* never overwrites either file */
  cr_expect(td_auth_keygen(pub, sec) == TD_ERR_INVALID);
  cr_expect(strstr(td_errmsg(), "never overwritten"), "%s", td_errmsg());
  char other[128];
  snprintf(other, sizeof other, "%s/b.key", dir);
  cr_expect(td_auth_keygen(pub, other) == TD_ERR_INVALID);
  cr_expect(access(other, F_OK) != 0, "a half pair was left");
  /* the secret matches the public key */
  char k[TD_AUTH_KEY_Z85], p[TD_AUTH_KEY_Z85];
  cr_assert(td_auth_read_key(pub, false, p) == TD_OK);
  td_auth *a = load("a", NULL, NULL, NULL);
  cr_expect_str_eq(td_auth_public_key(a), p);
  td_auth_destroy(a);
  /* a secret readable by others is refused, and so are malformed files */
  chmod(sec, 0644);
  cr_expect(td_auth_read_key(sec, true, k) == TD_ERR_INVALID);
  cr_expect(strstr(td_errmsg(), "readable by others"), "%s", td_errmsg());
  write_file("bad.pub", "not a key\n");
  path(other, sizeof other, "bad.pub");
  cr_expect(td_auth_read_key(other, false, k) == TD_ERR_FORMAT);
  write_file("list", "# x\nshort\n");
  td_auth_opts o = {.secret_file = other, .client_keys_file = other};
  td_auth *none = NULL;
  cr_expect(td_auth_create(&o, &none) != TD_OK && !none);
  chmod(sec, 0600);
  char lp[128];
  path(lp, sizeof lp, "list");
  o = (td_auth_opts){.secret_file = sec, .client_keys_file = lp};
  cr_expect(td_auth_create(&o, &none) == TD_ERR_FORMAT && !none);
  cr_expect(strstr(td_errmsg(), "line 2"), "names the line: %s", td_errmsg());
  /* a list past TD_AUTH_MAX_KEYS is refused, naming the limit; at it, taken */
  FILE *lf = fopen(lp, "w");
  cr_assert(lf);
  for (int i = 0; i <= TD_AUTH_MAX_KEYS; i++) {
    char kp[TD_AUTH_KEY_Z85], ks[TD_AUTH_KEY_Z85];
    cr_assert(zmq_curve_keypair(kp, ks) == 0);
    if (i == TD_AUTH_MAX_KEYS) {
      fclose(lf);
      o = (td_auth_opts){.secret_file = sec, .client_keys_file = lp};
      cr_expect(td_auth_create(&o, &none) == TD_OK && none, "%d keys: %s", TD_AUTH_MAX_KEYS, td_errmsg());
      td_auth_destroy(none);
      lf = fopen(lp, "a");
    }
    fprintf(lf, "%s\n", kp);
  }
  fclose(lf);
  cr_expect(td_auth_create(&o, &none) == TD_ERR_INVALID && !none);
  cr_expect(strstr(td_errmsg(), "more than 4096 keys"), "%s", td_errmsg());
  /* lists without a secret are refused; nothing configured is no auth */
  o = (td_auth_opts){.client_keys_file = lp};
  cr_expect(td_auth_create(&o, &none) == TD_ERR_INVALID && !none);
  o = (td_auth_opts){0};
  cr_expect(td_auth_create(&o, &none) == TD_OK && !none);
}

/* A server (ROUTER) of the given domain and a client (DEALER) with keys;
 * true when the client's message arrives, with the sender's key in *who. */
static bool exchange(void *ctx, void *srv_sock, const char *ep, const td_auth *cli, char who[TD_AUTH_KEY_Z85]) {
  void *d = zmq_socket(ctx, ZMQ_DEALER);
  int linger = 0;
  zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
  if (cli) cr_assert(td_auth_client(cli, d, NULL) == TD_OK, "%s", td_errmsg());
  cr_assert(zmq_connect(d, ep) == 0);
  zmq_send(d, "hi", 2, ZMQ_DONTWAIT);
  zmq_pollitem_t it = {.socket = srv_sock, .events = ZMQ_POLLIN};
  bool got = zmq_poll(&it, 1, 700) > 0;
  who[0] = 0;
  if (got) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    zmq_msg_recv(&m, srv_sock, 0); /* identity */
    zmq_msg_close(&m);
    zmq_msg_init(&m);
    zmq_msg_recv(&m, srv_sock, 0);
    cr_assert(td_auth_msg_key(&m, who), "no User-Id on a CURVE message");
    zmq_msg_close(&m);
  }
  zmq_close(d);
  return got;
}

Test(auth, zap_admits_listed_keys_per_domain) {
  mk_dir();
  keygen("router");
  keygen("worker");
  keygen("client");
  keygen("stranger");
  write_list("workers.list", "worker", NULL);
  write_list("clients.list", "client", NULL);
  td_auth *ra = load("router", NULL, "workers.list", "clients.list");
  td_auth *wa = load("worker", "router", NULL, NULL), *ca = load("client", "router", NULL, NULL);
  td_auth *sa = load("stranger", "router", NULL, NULL);
  void *ctx = zmq_ctx_new(), *cctx = zmq_ctx_new();
  td_zap *zap;
  cr_assert(td_zap_create(ra, ctx, &zap) == TD_OK, "%s", td_errmsg());
  void *cs = zmq_socket(ctx, ZMQ_ROUTER), *ws = zmq_socket(ctx, ZMQ_ROUTER);
  int linger = 0;
  zmq_setsockopt(cs, ZMQ_LINGER, &linger, sizeof linger);
  zmq_setsockopt(ws, ZMQ_LINGER, &linger, sizeof linger);
  cr_assert(td_auth_server(ra, cs, TD_AUTH_DOMAIN_CLIENTS) == TD_OK);
  cr_assert(td_auth_server(ra, ws, TD_AUTH_DOMAIN_WORKERS) == TD_OK);
  cr_assert(td_zap_watch(zap, cs, "client") == TD_OK && td_zap_watch(zap, ws, "worker") == TD_OK);
  cr_assert(zmq_bind(cs, "tcp://127.0.0.1:*") == 0 && zmq_bind(ws, "tcp://127.0.0.1:*") == 0);
  char cep[64], wep[64];
  size_t l = sizeof cep;
  zmq_getsockopt(cs, ZMQ_LAST_ENDPOINT, cep, &l);
  l = sizeof wep;
  zmq_getsockopt(ws, ZMQ_LAST_ENDPOINT, wep, &l);
  char who[TD_AUTH_KEY_Z85], k[TD_AUTH_KEY_Z85];
  /* listed keys, each on its own socket; the server sees who sent */
  cr_expect(exchange(cctx, cs, cep, ca, who), "the client key was refused");
  read_pub("client", k);
  cr_expect_str_eq(who, k);
  cr_expect(exchange(cctx, ws, wep, wa, who), "the worker key was refused");
  read_pub("worker", k);
  cr_expect_str_eq(who, k);
  cr_expect_eq(td_zap_refused(zap), 0);
  /* a client key on the worker socket, a worker key on the client socket,
   * an unknown key, and no key at all: nothing arrives */
  cr_expect(!exchange(cctx, ws, wep, ca, who), "a client key registered as a worker");
  cr_expect(!exchange(cctx, cs, cep, wa, who), "a worker key got in as a client");
  cr_expect(!exchange(cctx, cs, cep, sa, who), "an unknown key got in");
  cr_expect(!exchange(cctx, cs, cep, NULL, who), "a plain connection got in");
  usleep(300000); /* the monitor's event of the plain one */
  cr_expect(td_zap_refused(zap) >= 4, "refusals %lu", td_zap_refused(zap)); /* the plain one retries */
  cr_expect(exchange(cctx, cs, cep, ca, who), "the client key is refused after the strangers");
  zmq_close(cs);
  zmq_close(ws);
  td_zap_destroy(zap);
  zmq_ctx_term(ctx);
  zmq_ctx_term(cctx);
  td_auth_destroy(ra);
  td_auth_destroy(wa);
  td_auth_destroy(ca);
  td_auth_destroy(sa);
}

/* A client of the router (client, gateway, admin) with a secret needs the router's key. */
Test(auth, a_client_secret_needs_the_router_key) {
  td_auth *a = NULL;
  td_auth_opts o = {.secret_file = "/nonexistent/client.key"};
  cr_expect_eq(td_auth_create_client(&o, &a), TD_ERR_INVALID);
  cr_expect(strstr(td_errmsg(), "--router-key"), "%s", td_errmsg());
  cr_expect_null(a);
  td_auth_opts none = {0};
  cr_expect_eq(td_auth_create_client(&none, &a), TD_OK, "no keys: in the clear");
  cr_expect_null(a);
}

/* A group's own sockets (TD_AUTH_DOMAIN_GROUP): a rank that connects before
 * the rendezvous named the ranks waits (it is not refused: a refusal ends
 * its connection for good), and gets in once they are named; a listed
 * worker that is not a rank, and a stranger, are refused. */
Test(auth, group_domain_waits_for_its_ranks_then_admits_them_only) {
  mk_dir();
  const char *names[] = {"r0", "r1", "other", "stranger"};
  for (int i = 0; i < 4; i++) keygen(names[i]);
  write_list("workers.list", "r1", "other"); /* "other" a listed worker: no rank all the same */
  td_auth *leader = load("r0", NULL, "workers.list", NULL);
  td_auth *r1 = load("r1", "r0", NULL, NULL), *other = load("other", "r0", NULL, NULL);
  td_auth *stranger = load("stranger", "r0", NULL, NULL);
  void *ctx = zmq_ctx_new(), *cctx = zmq_ctx_new();
  td_zap *zap;
  cr_assert(td_zap_create(leader, ctx, &zap) == TD_OK, "%s", td_errmsg());
  void *gs = zmq_socket(ctx, ZMQ_ROUTER);
  int linger = 0;
  zmq_setsockopt(gs, ZMQ_LINGER, &linger, sizeof linger);
  cr_assert(td_auth_server(leader, gs, TD_AUTH_DOMAIN_GROUP) == TD_OK);
  cr_assert(zmq_bind(gs, "tcp://127.0.0.1:*") == 0);
  char ep[64];
  size_t l = sizeof ep;
  zmq_getsockopt(gs, ZMQ_LAST_ENDPOINT, ep, &l);
  /* rank 1 before the ranks are named: its message waits */
  void *d = zmq_socket(cctx, ZMQ_DEALER);
  zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
  cr_assert(td_auth_client(r1, d, NULL) == TD_OK, "%s", td_errmsg());
  cr_assert(zmq_connect(d, ep) == 0);
  zmq_send(d, "hi", 2, ZMQ_DONTWAIT);
  zmq_pollitem_t it = {.socket = gs, .events = ZMQ_POLLIN};
  cr_expect_eq(zmq_poll(&it, 1, 500), 0, "a rank got in before the ranks were named");
  char k0[TD_AUTH_KEY_Z85], k1[TD_AUTH_KEY_Z85];
  read_pub("r0", k0);
  read_pub("r1", k1);
  const char *ranks[] = {k0, k1};
  cr_assert(td_zap_set_group(zap, ranks, 2) == TD_OK, "%s", td_errmsg());
  cr_expect_gt(zmq_poll(&it, 1, 3000), 0, "the waiting rank was not let in once named");
  zmq_close(d);
  char who[TD_AUTH_KEY_Z85];
  if (it.revents) { /* its message */
    zmq_msg_t m;
    zmq_msg_init(&m);
    zmq_msg_recv(&m, gs, 0);
    zmq_msg_close(&m);
    zmq_msg_init(&m);
    zmq_msg_recv(&m, gs, 0);
    cr_expect(td_auth_msg_key(&m, who) && !strcmp(who, k1), "the message is not rank 1's");
    zmq_msg_close(&m);
  }
  unsigned long before = td_zap_refused(zap);
  cr_expect(!exchange(cctx, gs, ep, other, who), "a listed worker that is no rank got in");
  cr_expect(!exchange(cctx, gs, ep, stranger, who), "a stranger got in");
  cr_expect_geq(td_zap_refused(zap), before + 2);
  cr_expect(exchange(cctx, gs, ep, r1, who), "the rank is refused after the others");
  /* a set past the ranks a group has is refused */
  const char *many[TD_GROUP_MAX_RANKS + 1];
  for (int i = 0; i <= TD_GROUP_MAX_RANKS; i++) many[i] = k0;
  cr_expect_eq(td_zap_set_group(zap, many, TD_GROUP_MAX_RANKS + 1), TD_ERR_INVALID);
  zmq_close(gs);
  td_zap_destroy(zap);
  zmq_ctx_term(ctx);
  zmq_ctx_term(cctx);
  td_auth_destroy(leader);
  td_auth_destroy(r1);
  td_auth_destroy(other);
  td_auth_destroy(stranger);
}
