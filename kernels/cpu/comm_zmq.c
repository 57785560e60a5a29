/* Communicators between processes over ZeroMQ, for the CPU backend (tensor
 * and pipeline parallel groups of CPU workers). Every rank binds a ROUTER
 * and connects a DEALER to each other rank. Collectives go through rank 0
 * (sums in rank order, so every rank gets the same bits); messages that
 * arrive before they are wanted wait in per-sender queues. */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "common/clock.h"
#include "kernels/backend_impl.h"

#define MAX_WORLD 16

enum { OP_P2P = 1, OP_UP = 2, OP_DOWN = 3 };

typedef struct qmsg {
  int op;
  zmq_msg_t body;
  struct qmsg *next;
} qmsg;

struct td_comm_zmq_boot {
  void *ctx, *rx;
  bool own_ctx;
  td_comm_zmq_sec sec; /* zeroed: plain */
  char endpoint[256];
};

typedef struct zcomm {
  void *ctx, *rx;
  bool own_ctx;
  void *tx[MAX_WORLD];
  qmsg *q[MAX_WORLD]; /* received, not yet consumed, by sender */
  int timeout_ms;
  atomic_bool aborted;
  float *acc;
  size_t acc_cap;
} zcomm;

td_status td_comm_zmq_bind(const char *host, const td_comm_zmq_sec *sec, td_comm_zmq_boot **out) {
  *out = NULL;
  td_comm_zmq_boot *b = calloc(1, sizeof *b);
  if (!b) return td_err(TD_ERR_NOMEM, "out of memory");
  if (sec) b->sec = *sec;
  b->own_ctx = !b->sec.zmq_ctx;
  b->ctx = b->own_ctx ? zmq_ctx_new() : b->sec.zmq_ctx;
  b->rx = b->ctx ? zmq_socket(b->ctx, ZMQ_ROUTER) : NULL;
  char ep[300];
  snprintf(ep, sizeof ep, "tcp://%s:*", host ? host : "127.0.0.1");
  int linger = 0;
  if (b->rx) zmq_setsockopt(b->rx, ZMQ_LINGER, &linger, sizeof linger);
  td_status s = b->rx ? TD_OK : td_err(TD_ERR_NETWORK, "comm: %s", zmq_strerror(zmq_errno()));
  if (s == TD_OK && b->sec.server) s = b->sec.server(b->sec.arg, b->rx);
  if (s == TD_OK && zmq_bind(b->rx, ep) != 0)
    s = td_err(TD_ERR_NETWORK, "comm: cannot bind %s: %s", ep, zmq_strerror(zmq_errno()));
  if (s != TD_OK) {
    if (b->rx) zmq_close(b->rx);
    if (b->own_ctx && b->ctx) zmq_ctx_term(b->ctx);
    free(b);
    return s;
  }
  size_t l = sizeof b->endpoint;
  zmq_getsockopt(b->rx, ZMQ_LAST_ENDPOINT, b->endpoint, &l);
  *out = b;
  return TD_OK;
}

const char *td_comm_zmq_endpoint(const td_comm_zmq_boot *boot) { return boot->endpoint; }

void td_comm_zmq_boot_free(td_comm_zmq_boot *b) {
  if (!b) return;
  if (b->rx) zmq_close(b->rx);
  if (b->own_ctx && b->ctx) zmq_ctx_term(b->ctx);
  free(b);
}

static void z_destroy(td_comm *c);

static td_status z_sendmsg(zcomm *z, int peer, int op, const void *buf, size_t bytes) {
  int32_t hdr = op;
  if (zmq_send(z->tx[peer], &hdr, sizeof hdr, ZMQ_SNDMORE) < 0 || zmq_send(z->tx[peer], buf, bytes, 0) < 0)
    return td_err(TD_ERR_PEER, "comm: send to rank %d: %s", peer, zmq_strerror(zmq_errno()));
  return TD_OK;
}

/* Reads one arrived message into its sender's queue; false on timeout. */
static bool pump(td_comm *c, int wait_ms) {
  zcomm *z = c->impl;
  zmq_pollitem_t it = {.socket = z->rx, .events = ZMQ_POLLIN};
  if (zmq_poll(&it, 1, wait_ms) <= 0) return false;
  zmq_msg_t id, hd;
  zmq_msg_init(&id);
  zmq_msg_init(&hd);
  qmsg *m = calloc(1, sizeof *m);
  if (!m || zmq_msg_recv(&id, z->rx, 0) < 0 || zmq_msg_recv(&hd, z->rx, 0) < 0) {
    free(m);
    zmq_msg_close(&id);
    zmq_msg_close(&hd);
    return true;
  }
  zmq_msg_init(&m->body);
  zmq_msg_recv(&m->body, z->rx, 0);
  int src = -1;
  if (zmq_msg_size(&id) > 5 && !memcmp(zmq_msg_data(&id), "rank-", 5)) {
    char tmp[16] = {0};
    memcpy(tmp, (char *)zmq_msg_data(&id) + 5, zmq_msg_size(&id) - 5 < 15 ? zmq_msg_size(&id) - 5 : 15);
    src = atoi(tmp);
  }
  int32_t op = 0;
  if (zmq_msg_size(&hd) == sizeof op) memcpy(&op, zmq_msg_data(&hd), sizeof op);
  zmq_msg_close(&id);
  zmq_msg_close(&hd);
  if (src < 0 || src >= c->world) {
    zmq_msg_close(&m->body);
    free(m);
    return true;
  }
  m->op = op;
  qmsg **tail = &z->q[src];
  while (*tail) tail = &(*tail)->next;
  *tail = m;
  return true;
}

/* The next message of kind op from rank src, copied into buf. */
static td_status z_take(td_comm *c, int src, int op, void *buf, size_t bytes) {
  zcomm *z = c->impl;
  int64_t end = td_now_ms() + z->timeout_ms;
  for (;;) {
    if (atomic_load(&z->aborted)) return td_err(TD_ERR_PEER, "communicator aborted (a rank failed)");
    for (qmsg **p = &z->q[src]; *p; p = &(*p)->next) {
      if ((*p)->op != op) continue;
      qmsg *m = *p;
      *p = m->next;
      td_status s = TD_OK;
      if (zmq_msg_size(&m->body) != bytes)
        s = td_err(TD_ERR_INTERNAL, "comm: %zu bytes from rank %d, expected %zu", zmq_msg_size(&m->body), src, bytes);
      else
        memcpy(buf, zmq_msg_data(&m->body), bytes);
      zmq_msg_close(&m->body);
      free(m);
      return s;
    }
    if (td_now_ms() > end) return td_err(TD_ERR_PEER, "comm: rank %d sent nothing for %d ms", src, z->timeout_ms);
    pump(c, 50);
  }
}

static td_status z_allreduce(td_comm *c, td_backend *b, void *buf, td_buf_type t, size_t n) {
  zcomm *z = c->impl;
  size_t bytes = 4 * n;
  if (c->rank != 0) {
    TD_TRY(z_sendmsg(z, 0, OP_UP, buf, bytes));
    return z_take(c, 0, OP_DOWN, buf, bytes);
  }
  if (n > z->acc_cap) {
    free(z->acc);
    z->acc = malloc(bytes);
    z->acc_cap = z->acc ? n : 0;
    if (!z->acc) return td_err(TD_ERR_NOMEM, "allreduce scratch");
  }
  /* in rank order: (((x0 + x1) + x2) + ...) */
  float *x = buf;
  for (int r = 1; r < c->world; r++) {
    TD_TRY(z_take(c, r, OP_UP, z->acc, bytes));
    if (t == TD_BUF_I32)
      for (size_t i = 0; i < n; i++) ((int32_t *)x)[i] += ((int32_t *)z->acc)[i];
    else
      for (size_t i = 0; i < n; i++) x[i] += z->acc[i];
  }
  for (int r = 1; r < c->world; r++) TD_TRY(z_sendmsg(z, r, OP_DOWN, buf, bytes));
  return TD_OK;
}

static td_status z_allgather(td_comm *c, td_backend *b, const void *send, void *recv, td_buf_type t, size_t n) {
  zcomm *z = c->impl;
  size_t bytes = 4 * n;
  if (c->rank != 0) {
    TD_TRY(z_sendmsg(z, 0, OP_UP, send, bytes));
    return z_take(c, 0, OP_DOWN, recv, bytes * (size_t)c->world);
  }
  memcpy(recv, send, bytes);
  for (int r = 1; r < c->world; r++) TD_TRY(z_take(c, r, OP_UP, (char *)recv + bytes * (size_t)r, bytes));
  for (int r = 1; r < c->world; r++) TD_TRY(z_sendmsg(z, r, OP_DOWN, recv, bytes * (size_t)c->world));
  return TD_OK;
}

static td_status z_send(td_comm *c, td_backend *b, const void *buf, td_buf_type t, size_t n, int peer) {
  return z_sendmsg(c->impl, peer, OP_P2P, buf, 4 * n);
}

static td_status z_recv(td_comm *c, td_backend *b, void *buf, td_buf_type t, size_t n, int peer) {
  return z_take(c, peer, OP_P2P, buf, 4 * n);
}

static void z_abort(td_comm *c) { atomic_store(&((zcomm *)c->impl)->aborted, true); }

static void z_destroy(td_comm *c) {
  zcomm *z = c->impl;
  if (z) {
    for (int r = 0; r < MAX_WORLD; r++) {
      if (z->tx[r]) zmq_close(z->tx[r]);
      while (z->q[r]) {
        qmsg *m = z->q[r];
        z->q[r] = m->next;
        zmq_msg_close(&m->body);
        free(m);
      }
    }
    if (z->rx) zmq_close(z->rx);
    if (z->own_ctx && z->ctx) zmq_ctx_term(z->ctx);
    free(z->acc);
    free(z);
  }
  free(c);
}

static const td_comm_vt zmq_vt = {z_allreduce, z_allgather, z_send, z_recv, NULL, z_abort, z_destroy, NULL, NULL};

td_status td_comm_zmq_connect(td_comm_zmq_boot *boot, int rank, int world, const char *const *endpoints,
                              int timeout_ms, td_comm **out) {
  *out = NULL;
  td_comm *c = calloc(1, sizeof *c);
  zcomm *z = calloc(1, sizeof *z);
  if (!c || !z || world < 1 || world > MAX_WORLD || rank < 0 || rank >= world) {
    free(c);
    free(z);
    td_comm_zmq_boot_free(boot);
    return td_err(TD_ERR_INVALID, "comm: rank %d of %d", rank, world);
  }
  c->vt = &zmq_vt;
  c->rank = rank;
  c->world = world;
  c->impl = z;
  z->ctx = boot->ctx;
  z->rx = boot->rx;
  z->own_ctx = boot->own_ctx;
  z->timeout_ms = timeout_ms > 0 ? timeout_ms : 60000;
  td_comm_zmq_sec sec = boot->sec;
  free(boot);
  char id[32];
  snprintf(id, sizeof id, "rank-%d", rank);
  int linger = 0;
  for (int r = 0; r < world; r++) {
    if (r == rank) continue;
    z->tx[r] = zmq_socket(z->ctx, ZMQ_DEALER);
    if (!z->tx[r]) {
      z_destroy(c);
      return td_err(TD_ERR_NETWORK, "comm: %s", zmq_strerror(zmq_errno()));
    }
    zmq_setsockopt(z->tx[r], ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(z->tx[r], ZMQ_ROUTING_ID, id, strlen(id));
    td_status cs = sec.client ? sec.client(sec.arg, z->tx[r], r) : TD_OK;
    if (cs != TD_OK) {
      z_destroy(c);
      return cs;
    }
    if (zmq_connect(z->tx[r], endpoints[r]) != 0) {
      td_status s = td_err(TD_ERR_NETWORK, "comm: cannot connect to rank %d at %s", r, endpoints[r]);
      z_destroy(c);
      return s;
    }
  }
  /* meet once, so that every connection is up before the first op */
  int32_t one = 1;
  td_status s = z_allreduce(c, NULL, &one, TD_BUF_I32, 1);
  if (s == TD_OK && one != world) s = td_err(TD_ERR_INTERNAL, "comm: %d of %d ranks met", one, world);
  if (s != TD_OK) {
    z_destroy(c);
    return s;
  }
  *out = c;
  return TD_OK;
}
