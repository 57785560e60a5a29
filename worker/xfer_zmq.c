/* KV pushes over ZeroMQ between workers whose pools are in host memory:
 * [KvPush header][one frame per block, owned by the message], answered by a KvAck once the receiver has checked the reservation
 * and copied the blocks in. A push with no answer within the timeout fails
 * (the peer died or vanished). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "worker/internal.h"

#define MAX_PEERS 64
#define DESC_PREFIX "zmq:"

typedef struct peer {
  char ep[256];
  void *sock;
} peer;

typedef struct pending {
  uint64_t push_id, rid;
  int role;
  int64_t deadline;
} pending;

struct xfer {
  void *ctx, *rx;
  char desc[300];
  xfer_hooks hooks;
  int timeout_ms;
  peer peers[MAX_PEERS];
  int n_peers;
  pending *pend;
  int n_pend, cap_pend;
  uint64_t next_push;
};

td_status xfer_create(const char *host, const xfer_hooks *hooks, int timeout_ms, xfer **out) {
  *out = NULL;
  xfer *x = calloc(1, sizeof *x);
  if (!x) return td_err(TD_ERR_NOMEM, "out of memory");
  x->hooks = *hooks;
  x->timeout_ms = timeout_ms;
  x->next_push = 1;
  x->ctx = zmq_ctx_new();
  x->rx = x->ctx ? zmq_socket(x->ctx, ZMQ_ROUTER) : NULL;
  if (!x->rx) {
    xfer_destroy(x);
    return td_err(TD_ERR_NETWORK, "zmq: %s", zmq_strerror(zmq_errno()));
  }
  td_wire_setup_socket(x->rx);
  int64_t max = -1; /* KV messages are as large as the blocks */
  zmq_setsockopt(x->rx, ZMQ_MAXMSGSIZE, &max, sizeof max);
  char ep[300];
  snprintf(ep, sizeof ep, "tcp://%s:*", host);
  if (zmq_bind(x->rx, ep) != 0) {
    td_status s = td_err(TD_ERR_NETWORK, "cannot bind the KV endpoint %s: %s", ep, zmq_strerror(zmq_errno()));
    xfer_destroy(x);
    return s;
  }
  char last[256];
  size_t ll = sizeof last;
  zmq_getsockopt(x->rx, ZMQ_LAST_ENDPOINT, last, &ll);
  snprintf(x->desc, sizeof x->desc, DESC_PREFIX "%s", last);
  *out = x;
  return TD_OK;
}

void xfer_destroy(xfer *x) {
  if (!x) return;
  for (int i = 0; i < x->n_peers; i++) zmq_close(x->peers[i].sock);
  if (x->rx) zmq_close(x->rx);
  if (x->ctx) zmq_ctx_term(x->ctx);
  free(x->pend);
  free(x);
}

const char *xfer_desc(const xfer *x) { return x->desc; }

static peer *get_peer(xfer *x, const uint8_t *desc, size_t len) {
  size_t pl = strlen(DESC_PREFIX);
  if (len <= pl || len >= sizeof x->peers[0].ep + pl || memcmp(desc, DESC_PREFIX, pl)) {
    td_err(TD_ERR_INVALID, "KV descriptor is not a ZeroMQ endpoint");
    return NULL;
  }
  char ep[256];
  memcpy(ep, desc + pl, len - pl);
  ep[len - pl] = 0;
  for (int i = 0; i < x->n_peers; i++)
    if (!strcmp(x->peers[i].ep, ep)) return &x->peers[i];
  if (x->n_peers == MAX_PEERS) {
    /* recycle the oldest connection */
    zmq_close(x->peers[0].sock);
    memmove(x->peers, x->peers + 1, sizeof *x->peers * (MAX_PEERS - 1));
    x->n_peers--;
  }
  peer *p = &x->peers[x->n_peers];
  p->sock = zmq_socket(x->ctx, ZMQ_DEALER);
  if (!p->sock) {
    td_err(TD_ERR_NETWORK, "zmq: %s", zmq_strerror(zmq_errno()));
    return NULL;
  }
  td_wire_setup_socket(p->sock);
  int64_t max = -1;
  zmq_setsockopt(p->sock, ZMQ_MAXMSGSIZE, &max, sizeof max);
  if (zmq_connect(p->sock, ep) != 0) {
    td_err(TD_ERR_NETWORK, "cannot connect to %s: %s", ep, zmq_strerror(zmq_errno()));
    zmq_close(p->sock);
    return NULL;
  }
  snprintf(p->ep, sizeof p->ep, "%s", ep);
  x->n_peers++;
  return p;
}

td_status xfer_push(xfer *x, uint64_t rid, int role, const uint8_t *peer_desc, size_t peer_len, uint64_t reservation,
                    bool cross, const void *const *src, size_t block_bytes, const int32_t *dst, int n) {
  peer *p = get_peer(x, peer_desc, peer_len);
  if (!p) return TD_ERR_INVALID;
  if (x->n_pend == x->cap_pend) {
    int nc = x->cap_pend ? 2 * x->cap_pend : 32;
    pending *np = realloc(x->pend, sizeof *np * (size_t)nc);
    if (!np) return td_err(TD_ERR_NOMEM, "out of memory");
    x->pend = np;
    x->cap_pend = nc;
  }
  Tandem__Cluster__KvPush h = TANDEM__CLUSTER__KV_PUSH__INIT;
  h.version = TD_PROTOCOL_VERSION;
  h.rid = rid;
  h.reservation = reservation;
  h.cross = cross;
  h.blocks = (int32_t *)dst;
  h.n_blocks = (size_t)n;
  h.block_bytes = block_bytes;
  h.push_id = x->next_push++;
  size_t hl = protobuf_c_message_get_packed_size(&h.base);
  zmq_msg_t m;
  if (zmq_msg_init_size(&m, hl) != 0) return td_err(TD_ERR_NOMEM, "out of memory");
  protobuf_c_message_pack(&h.base, zmq_msg_data(&m));
  if (zmq_msg_send(&m, p->sock, n ? ZMQ_SNDMORE : 0) < 0) {
    zmq_msg_close(&m);
    return td_err(TD_ERR_NETWORK, "KV push: %s", zmq_strerror(zmq_errno()));
  }
  for (int i = 0; i < n; i++) {
    /* copied: a push that times out or is forgotten leaves its frames
     * queued on the socket after the job freed its buffer */
    zmq_msg_t b;
    if (zmq_msg_init_size(&b, block_bytes) != 0) return td_err(TD_ERR_NOMEM, "out of memory");
    memcpy(zmq_msg_data(&b), src[i], block_bytes);
    if (zmq_msg_send(&b, p->sock, i + 1 < n ? ZMQ_SNDMORE : 0) < 0) {
      zmq_msg_close(&b);
      return td_err(TD_ERR_NETWORK, "KV push: %s", zmq_strerror(zmq_errno()));
    }
  }
  x->pend[x->n_pend++] = (pending){h.push_id, rid, role, td_now_ms() + x->timeout_ms};
  return TD_OK;
}

int xfer_poll_items(xfer *x, void *items, int cap) {
  zmq_pollitem_t *it = items;
  int n = 0;
  if (n < cap) it[n++] = (zmq_pollitem_t){.socket = x->rx, .events = ZMQ_POLLIN};
  for (int i = 0; i < x->n_peers && n < cap; i++) it[n++] = (zmq_pollitem_t){.socket = x->peers[i].sock, .events = ZMQ_POLLIN};
  return n;
}

static bool more(void *s) {
  int v = 0;
  size_t l = sizeof v;
  zmq_getsockopt(s, ZMQ_RCVMORE, &v, &l);
  return v != 0;
}

static void ack(xfer *x, const zmq_msg_t *id, uint64_t push_id, bool ok, const char *err) {
  Tandem__Cluster__KvAck a = TANDEM__CLUSTER__KV_ACK__INIT;
  a.version = TD_PROTOCOL_VERSION;
  a.push_id = push_id;
  a.ok = ok;
  a.error = (char *)(err ? err : "");
  size_t n = protobuf_c_message_get_packed_size(&a.base);
  uint8_t buf[600];
  if (n > sizeof buf) return;
  protobuf_c_message_pack(&a.base, buf);
  zmq_send(x->rx, zmq_msg_data((zmq_msg_t *)id), zmq_msg_size((zmq_msg_t *)id), ZMQ_SNDMORE | ZMQ_DONTWAIT);
  zmq_send(x->rx, buf, n, ZMQ_DONTWAIT);
}

/* One incoming push: [identity][header][blocks...]. */
static void receive_one(xfer *x) {
  zmq_msg_t id, hd;
  zmq_msg_init(&id);
  if (zmq_msg_recv(&id, x->rx, ZMQ_DONTWAIT) < 0) {
    zmq_msg_close(&id);
    return;
  }
  zmq_msg_init(&hd);
  if (!more(x->rx) || zmq_msg_recv(&hd, x->rx, 0) < 0) {
    zmq_msg_close(&hd);
    zmq_msg_close(&id);
    return;
  }
  Tandem__Cluster__KvPush *h = tandem__cluster__kv_push__unpack(NULL, zmq_msg_size(&hd), zmq_msg_data(&hd));
  char why[256] = "";
  bool ok = h && h->version == TD_PROTOCOL_VERSION && h->n_blocks <= 65536;
  if (!ok) snprintf(why, sizeof why, h ? "KV push of protocol version %u" : "malformed KV push", h ? h->version : 0);
  if (ok)
    ok = x->hooks.accept(x->hooks.ctx, h->rid, h->reservation, h->cross, h->blocks, (int)h->n_blocks,
                         (size_t)h->block_bytes, why, sizeof why);
  size_t n = ok ? h->n_blocks : 0, got = 0;
  zmq_msg_t *frames = n ? calloc(n, sizeof *frames) : NULL;
  const void **ptrs = n ? calloc(n, sizeof *ptrs) : NULL;
  if (n && (!frames || !ptrs)) {
    ok = false;
    snprintf(why, sizeof why, "out of memory");
  }
  while (more(x->rx)) {
    zmq_msg_t b;
    zmq_msg_init(&b);
    if (zmq_msg_recv(&b, x->rx, 0) < 0) {
      zmq_msg_close(&b);
      break;
    }
    if (ok && got < n && zmq_msg_size(&b) == h->block_bytes) {
      zmq_msg_init(&frames[got]); /* kept until delivered */
      zmq_msg_move(&frames[got], &b);
      zmq_msg_close(&b);
      ptrs[got] = zmq_msg_data(&frames[got]);
    } else {
      if (ok) snprintf(why, sizeof why, "KV push frame %zu has %zu bytes", got, zmq_msg_size(&b));
      ok = false;
      zmq_msg_close(&b);
    }
    got++;
  }
  if (ok && got != n) {
    snprintf(why, sizeof why, "KV push announced %zu blocks, carried %zu", n, got);
    ok = false;
  }
  if (ok) x->hooks.deliver(x->hooks.ctx, h->cross, h->blocks, (int)n, ptrs, (size_t)h->block_bytes);
  for (size_t i = 0; i < got && i < n; i++)
    if (ptrs && ptrs[i]) zmq_msg_close(&frames[i]);
  free(frames);
  free(ptrs);
  if (h) {
    ack(x, &id, h->push_id, ok, ok ? NULL : why);
    if (ok) x->hooks.arrived(x->hooks.ctx, h->rid, h->reservation, h->cross, (int)h->n_blocks);
    else TD_WARN("refused a KV push for request %llu: %s", (unsigned long long)h->rid, why);
    tandem__cluster__kv_push__free_unpacked(h, NULL);
  }
  zmq_msg_close(&hd);
  zmq_msg_close(&id);
}

static void finish_push(xfer *x, int i, bool ok, const char *err) {
  pending p = x->pend[i];
  x->pend[i] = x->pend[--x->n_pend];
  x->hooks.pushed(x->hooks.ctx, p.rid, p.role, ok, err);
}

void xfer_progress(xfer *x) {
  for (int k = 0; k < 256; k++) {
    int ev = 0;
    size_t l = sizeof ev;
    zmq_getsockopt(x->rx, ZMQ_EVENTS, &ev, &l);
    if (!(ev & ZMQ_POLLIN)) break;
    receive_one(x);
  }
  for (int i = 0; i < x->n_peers; i++) {
    for (int k = 0; k < 256; k++) {
      uint8_t buf[600];
      int n = zmq_recv(x->peers[i].sock, buf, sizeof buf, ZMQ_DONTWAIT);
      if (n < 0) break;
      while (more(x->peers[i].sock)) zmq_recv(x->peers[i].sock, buf, 0, 0);
      Tandem__Cluster__KvAck *a = n <= (int)sizeof buf ? tandem__cluster__kv_ack__unpack(NULL, (size_t)n, buf) : NULL;
      if (!a) continue;
      for (int p = 0; p < x->n_pend; p++)
        if (x->pend[p].push_id == a->push_id) {
          finish_push(x, p, a->ok, a->error);
          break;
        }
      tandem__cluster__kv_ack__free_unpacked(a, NULL);
    }
  }
  int64_t t = td_now_ms();
  for (int p = x->n_pend - 1; p >= 0; p--)
    if (t > x->pend[p].deadline) finish_push(x, p, false, "no answer from the receiving worker (dead or gone)");
}

void xfer_forget(xfer *x, uint64_t rid) {
  for (int p = x->n_pend - 1; p >= 0; p--)
    if (x->pend[p].rid == rid) x->pend[p] = x->pend[--x->n_pend];
}

int xfer_pending(const xfer *x) { return x->n_pend; }
