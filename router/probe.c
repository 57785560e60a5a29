/* The check of a registering worker's address: before the router admits a
 * worker it dials the KV endpoint the worker advertises (a TCP connect,
 * nothing sent), so that a worker that advertises an address nobody
 * reaches (a wrong --advertise, NAT) is refused at once with the reason,
 * rather than placed and failing every push to it. The connects are
 * non-blocking, in an epoll set the loop watches; their registrations wait
 * here (the worker's retries meanwhile are dropped). Only numeric
 * addresses are dialled: resolving a host name would block the loop. */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/net.h"
#include "router/internal.h"

struct probe {
  uint8_t route[TD_WIRE_MAX_ID];
  size_t route_len;
  char key[TD_AUTH_KEY_Z85];
  bool keyed;
  Tandem__Cluster__Register *reg; /* owned */
  char ep[TD_NET_MAX_HOST + 16];
  int fd;
  int64_t started, deadline;
  UT_hash_handle hh; /* by route */
};

static void probe_free(td_router *r, probe *p) {
  HASH_DEL(r->probes, p);
  r->n_probes--;
  if (p->fd >= 0) {
    epoll_ctl(r->probe_fd, EPOLL_CTL_DEL, p->fd, NULL);
    close(p->fd);
  }
  if (p->reg) tandem__cluster__register__free_unpacked(p->reg, NULL);
  free(p);
}

bool rtr_probe_pending(td_router *r, const uint8_t *id, size_t id_len) {
  probe *p = NULL;
  HASH_FIND(hh, r->probes, id, id_len, p);
  return p != NULL;
}

/* The tcp endpoint of a worker's TransferDesc ("zmq:tcp://HOST:PORT[ KEY]"):
 * its host and port; false when it has none to dial. */
static bool kv_endpoint(const Tandem__Cluster__WorkerInfo *in, char *ep, size_t cap, char host[TD_NET_MAX_HOST],
                        int *port) {
  if (!in->transfer_desc.len) return false;
  Tandem__Cluster__TransferDesc *d =
      tandem__cluster__transfer_desc__unpack(NULL, in->transfer_desc.len, in->transfer_desc.data);
  bool ok = d && d->zmq && !strncmp(d->zmq, "zmq:", 4);
  if (ok) {
    snprintf(ep, cap, "%s", d->zmq + 4);
    char *sp = strchr(ep, ' '); /* the CURVE key after it */
    if (sp) *sp = 0;
    ok = td_net_split_tcp(ep, host, port);
  }
  if (d) tandem__cluster__transfer_desc__free_unpacked(d, NULL);
  return ok;
}

/* The registration goes on (the endpoint answered) or is refused (it did not). */
static void finish(td_router *r, probe *p, int err) {
  Tandem__Cluster__Register *reg = p->reg;
  const char *wid = reg->info && reg->info->worker_id ? reg->info->worker_id : "";
  if (!err) {
    TD_DEBUG("worker %s: its KV endpoint %s answered in %lld ms", wid, p->ep, (long long)(td_now_ms() - p->started));
    p->reg = NULL;
    uint8_t route[TD_WIRE_MAX_ID];
    size_t rl = p->route_len;
    char key[TD_AUTH_KEY_Z85];
    bool keyed = p->keyed;
    memcpy(route, p->route, rl);
    memcpy(key, p->key, sizeof key);
    probe_free(r, p);
    rtr_register_checked(r, route, rl, keyed ? key : NULL, reg);
    tandem__cluster__register__free_unpacked(reg, NULL);
    return;
  }
  char why[600];
  snprintf(why, sizeof why, "the router cannot reach the KV endpoint it advertises, %s: %s (check its --host and "
           "--advertise: peers dial that address)", p->ep,
           err == ETIMEDOUT ? "no answer in time" : strerror(err));
  rtr_register_refuse(r, p->route, p->route_len, wid, why);
  probe_free(r, p);
}

bool rtr_probe_start(td_router *r, const uint8_t *id, size_t id_len, const char *key, Tandem__Cluster__Register *reg,
                     bool *answered) {
  *answered = false;
  char ep[TD_NET_MAX_HOST + 16], host[TD_NET_MAX_HOST];
  int port = 0;
  if (r->o.probe_timeout_ms < 0 || !reg || !reg->info || !kv_endpoint(reg->info, ep, sizeof ep, host, &port) ||
      !td_net_is_numeric(host))
    return false;
  const char *wid = reg->info->worker_id ? reg->info->worker_id : "";
  if (r->n_probes >= TD_ROUTER_MAX_PROBES) {
    /* its next retry finds room */
    TD_WARN("worker %s waits: %d registrations are being checked (TD_ROUTER_MAX_PROBES)", wid, r->n_probes);
    *answered = true;
    return false;
  }
  struct sockaddr_storage sa;
  memset(&sa, 0, sizeof sa);
  socklen_t sl;
  struct sockaddr_in *a4 = (struct sockaddr_in *)&sa;
  struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&sa;
  if (inet_pton(AF_INET, host, &a4->sin_addr) == 1) {
    a4->sin_family = AF_INET;
    a4->sin_port = htons((uint16_t)port);
    sl = sizeof *a4;
  } else if (inet_pton(AF_INET6, host, &a6->sin6_addr) == 1) {
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons((uint16_t)port);
    sl = sizeof *a6;
  } else {
    return false;
  }
  probe *p = calloc(1, sizeof *p);
  if (!p) return false; /* no check rather than no worker */
  memcpy(p->route, id, id_len);
  p->route_len = id_len;
  p->keyed = key != NULL;
  if (key) snprintf(p->key, sizeof p->key, "%s", key);
  snprintf(p->ep, sizeof p->ep, "%s", ep);
  p->started = td_now_ms();
  p->deadline = p->started + r->o.probe_timeout_ms;
  p->fd = socket(sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  HASH_ADD(hh, r->probes, route, p->route_len, p);
  r->n_probes++;
  p->reg = reg;
  int err = p->fd < 0 ? errno : 0;
  if (!err && connect(p->fd, (struct sockaddr *)&sa, sl) != 0) err = errno;
  if (err == EINPROGRESS) {
    struct epoll_event ev = {.events = EPOLLOUT, .data.ptr = p};
    if (epoll_ctl(r->probe_fd, EPOLL_CTL_ADD, p->fd, &ev) == 0) return true;
    err = errno;
  }
  if (!err) { /* connected at once (loopback): go on now, the caller keeps its registration */
    p->reg = NULL;
    probe_free(r, p);
    return false;
  }
  finish(r, p, err); /* refused at once: the registration goes with the probe */
  return true;
}

void rtr_probes_ready(td_loop *l, void *ctx) {
  (void)l;
  td_router *r = ctx;
  struct epoll_event evs[32];
  int n = epoll_wait(r->probe_fd, evs, 32, 0);
  for (int i = 0; i < n; i++) {
    probe *p = evs[i].data.ptr;
    int err = 0;
    socklen_t el = sizeof err;
    if (getsockopt(p->fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0) err = errno;
    finish(r, p, err);
  }
}

int rtr_probes_tick(td_loop *l, void *ctx) {
  (void)l;
  td_router *r = ctx;
  int64_t t = td_now_ms();
  probe *p, *tmp;
  HASH_ITER(hh, r->probes, p, tmp) if (t > p->deadline) finish(r, p, ETIMEDOUT);
  return TD_ROUTER_TICK_MS;
}

void rtr_probes_free(td_router *r) {
  probe *p, *tmp;
  HASH_ITER(hh, r->probes, p, tmp) probe_free(r, p);
  if (r->probe_fd >= 0) close(r->probe_fd);
  r->probe_fd = -1;
}
