/* Binding one address and advertising another (--advertise): a router and
 * workers bound to the wildcard, telling peers 127.0.0.1, serve with
 * transformers' tokens, KV over UCX included; a worker that advertises an
 * address nobody listens on, or one no interface here carries (NAT, where
 * UCX cannot follow), is refused by the router with the reason when it
 * dials that address, and requests go on on the other workers. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <criterion/criterion.h>

#include "../unit/fixture.h"
#include "cluster_util.h"
#include "common/clock.h"

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

/* The port of the KV endpoint a worker's start line advertises at host. */
static int kv_port(cluster *c, const char *name, const char *host) {
  char path[600], line[4096], want[128];
  snprintf(path, sizeof path, "%s/%s.log", c->dir, name);
  snprintf(want, sizeof want, "KV endpoint zmq:tcp://%s:", host);
  FILE *f = fopen(path, "r");
  cr_assert(f);
  int port = 0;
  while (!port && fgets(line, sizeof line, f)) {
    char *p = strstr(line, want);
    if (p) port = atoi(p + strlen(want));
  }
  fclose(f);
  return port;
}

static bool dial(const char *addr, int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  inet_pton(AF_INET, addr, &a.sin_addr);
  bool ok = connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
  close(fd);
  return ok;
}

/* Waits for process idx to exit on its own; its exit status (-1: it did not). */
static int wait_exit(cluster *c, int idx, int timeout_ms) {
  for (int64_t end = td_now_ms() + timeout_ms; td_now_ms() < end; usleep(100000)) {
    int st;
    if (waitpid(c->p[idx].pid, &st, WNOHANG) == c->p[idx].pid) {
      c->p[idx].exited = true;
      c->p[idx].status = st;
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
  }
  return -1;
}

Test(advertise, wildcard_binds_advertising_loopback_serve, .timeout = 300) {
  fixture fx;
  fx_load("t5-tiny", &fx);
  cluster c;
  cluster_opts o = {.model = fx.dir, .encoders = 1, .decodes = 1, .router_bind = "0.0.0.0",
                    .router_extra = "--advertise 127.0.0.1", .worker_extra = "--host 0.0.0.0 --advertise 127.0.0.1"};
  cluster_start(&c, &o);
  /* the router says where it is dialled, not the wildcard it bound */
  char line[200];
  snprintf(line, sizeof line, "router serving clients on %s, workers on %s", c.client_ep, c.worker_ep);
  cr_expect(cluster_log_has(&c, "router", line), "the router does not name its advertised endpoints");
  /* a worker's KV endpoint: advertised at 127.0.0.1, bound to every address (127.0.0.3 reaches it too) */
  int port = kv_port(&c, "decode-0", "127.0.0.1");
  cr_assert_gt(port, 0, "decode-0 does not advertise its KV endpoint at 127.0.0.1");
  cr_expect(dial("127.0.0.3", port), "decode-0's KV endpoint is not bound to the wildcard");
  expect_fixture_greedy(&c, &fx);
  /* UCX followed the advertised address: the cross KV went over it */
  kv_count k;
  cr_assert(cluster_kv_count(&c, "decode-0", 5000, &k));
  cr_expect(k.in_ucx > 0, "decode-0 took %llu blocks over UCX, %llu over ZeroMQ", (unsigned long long)k.in_ucx,
            (unsigned long long)k.in_zmq);
  cr_expect(cluster_stop(&c), "unclean stop (logs in %s)", c.dir);
  fx_free(&fx);
}

Test(advertise, a_worker_advertising_where_nobody_listens_is_refused, .timeout = 300) {
  fixture fx;
  fx_load("t5-tiny", &fx);
  cluster c;
  cluster_opts o = {.model = fx.dir, .encoders = 1, .decodes = 1, .router_extra = "--probe-timeout-ms 1500"};
  cluster_start(&c, &o);
  /* bound to 127.0.0.1, telling peers 127.0.0.2: nothing listens there */
  snprintf(c.extra_worker, sizeof c.extra_worker, "decode-lost");
  snprintf(c.extra_flags, sizeof c.extra_flags, "--host 127.0.0.1 --advertise 127.0.0.2");
  int lost = cluster_add_worker(&c, "decode-lost", "decode", 4);
  cr_expect(wait_log(&c, "router", "refused worker decode-lost: the router cannot reach the KV endpoint it "
                     "advertises, tcp://127.0.0.2:", 20000), "the router did not refuse decode-lost (logs in %s)", c.dir);
  cr_expect(cluster_log_has(&c, "router", "Connection refused"), "the refusal does not say why");
  cr_expect_eq(wait_exit(&c, lost, 10000), 1, "decode-lost did not exit with an error");
  cr_expect(cluster_log_has(&c, "decode-lost", "the router refused this worker: the router cannot reach"));
  /* behind NAT: an address no interface here carries; UCX cannot advertise it (ZeroMQ only), the router's dial
   * gets no answer */
  snprintf(c.extra_worker, sizeof c.extra_worker, "decode-nat");
  snprintf(c.extra_flags, sizeof c.extra_flags, "--host 127.0.0.1 --advertise 192.0.2.1");
  int nat = cluster_add_worker(&c, "decode-nat", "decode", 4);
  cr_expect(wait_log(&c, "decode-nat", "UCX did not start", 20000), "decode-nat's UCX started (logs in %s)", c.dir);
  cr_expect(cluster_log_has(&c, "decode-nat", "no interface here carries 192.0.2.1"));
  cr_expect(wait_log(&c, "router", "refused worker decode-nat: the router cannot reach the KV endpoint it "
                     "advertises, tcp://192.0.2.1:", 20000), "the router did not refuse decode-nat (logs in %s)", c.dir);
  cr_expect_eq(wait_exit(&c, nat, 10000), 1, "decode-nat did not exit with an error");
  cr_expect(!registered(&c, "decode-lost") && !registered(&c, "decode-nat"), "an unreachable worker registered");
  /* the others serve on */
  expect_fixture_greedy(&c, &fx);
  cr_expect(cluster_stop(&c), "unclean stop (logs in %s)", c.dir);
  fx_free(&fx);
}
