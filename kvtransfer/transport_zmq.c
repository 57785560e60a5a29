/* The ZeroMQ KV transport (td_kvt_zmq): pushes host copies of the blocks,
 * [KvPush header][one frame per block], answered by a KvAck once the
 * receiver has checked the reservation (the accept hook) and handed the
 * bytes over (the deliver hook). A push with no answer within the timeout
 * fails (the peer died or vanished). Its descriptor is "zmq:ENDPOINT". */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/defaults.h"
#include "common/log.h"
#include "common/net.h"
#include "kvtransfer/transport.h"
#include "proto/wire.h"

/* connections kept to receivers; the oldest is closed for a new one */
#define MAX_PEERS 64
/* messages handled per socket and turn, so that one busy peer cannot stall the loop */
#define BURST 256
#define DESC_PREFIX "zmq:"
#define EP_MAX 256 /* a peer's endpoint, with its NUL */
/* with CURVE a descriptor is "zmq:ENDPOINT KEY": the receiver's public key
 * after one space (an endpoint holds none) */
#define KEY_SEP ' '

typedef struct peer {
  char ep[EP_MAX];
  char key[TD_AUTH_KEY_Z85]; /* the receiver's public key ("" without CURVE) */
  void *sock;
  int ev; /* its loop event (0: none) */
} peer;

typedef struct pending {
  uint64_t push_id, rid;
  int tag, n;
  int64_t deadline;
} pending;

typedef struct zx {
  td_kvt *t;
  void *ctx, *rx;
  const td_auth *auth;
  td_zap *zap; /* admits the worker list's pushes (NULL without keys) */
  int rx_ev;
  td_loop *loop;
  char desc[EP_MAX + TD_AUTH_KEY_Z85 + 8];
  int timeout_ms;
  size_t max_block; /* the largest block frame taken and sent */
  peer peers[MAX_PEERS];
  int n_peers;
  pending *pend;
  int n_pend, cap_pend;
  uint64_t next_push;
} zx;

static void on_readable(td_loop *l, void *ctx) {
  (void)l;
  td_kvt_progress(ctx);
}

static void zx_destroy(td_kvt *t) {
  zx *x = t->ctx;
  if (!x) return;
  (void)t->iface->watch(t, NULL);
  for (int i = 0; i < x->n_peers; i++) zmq_close(x->peers[i].sock);
  if (x->rx) zmq_close(x->rx);
  td_zap_destroy(x->zap);
  if (x->ctx) zmq_ctx_term(x->ctx);
  free(x->pend);
  free(x);
  t->ctx = NULL;
}

static td_status zx_create(td_kvt *t, const td_kvt_opts *o) {
  zx *x = calloc(1, sizeof *x);
  if (!x) return td_err(TD_ERR_NOMEM, "out of memory");
  t->ctx = x;
  x->t = t;
  x->timeout_ms = o->timeout_ms > 0 ? o->timeout_ms : TD_DEFAULT_TRANSFER_TIMEOUT_MS;
  x->next_push = 1;
  x->auth = o->auth;
  x->ctx = zmq_ctx_new();
  x->rx = x->ctx ? zmq_socket(x->ctx, ZMQ_ROUTER) : NULL;
  if (!x->rx) {
    td_status s = td_err(TD_ERR_NETWORK, "zmq: %s", zmq_strerror(zmq_errno()));
    zx_destroy(t);
    return s;
  }
  td_wire_setup_socket(x->rx);
  td_status as = td_zap_create(x->auth, x->ctx, &x->zap);
  if (as == TD_OK) as = td_auth_server(x->auth, x->rx, TD_AUTH_DOMAIN_KV);
  if (as == TD_OK) as = td_zap_watch(x->zap, x->rx, "KV");
  if (as != TD_OK) {
    zx_destroy(t);
    return as;
  }
  /* a frame is a header or one block: a larger one (a 1 GiB frame) drops
   * the peer's connection before libzmq buffers it. libzmq bounds frames,
   * not the parts of a message: a peer sending endless block frames is
   * bounded by nothing here (docs/limits.md) */
  x->max_block = o->max_block_bytes ? o->max_block_bytes : TD_KV_DEFAULT_MAX_FRAME_BYTES;
  int64_t max = (int64_t)(x->max_block > TD_KV_HEADER_MAX_BYTES ? x->max_block : TD_KV_HEADER_MAX_BYTES);
  zmq_setsockopt(x->rx, ZMQ_MAXMSGSIZE, &max, sizeof max);
  char ep[300];
  snprintf(ep, sizeof ep, "tcp://%s:*", o->listen_host ? o->listen_host : TD_DEFAULT_LISTEN_HOST);
  td_auth_warn_open(x->auth, ep, "KV");
  if (zmq_bind(x->rx, ep) != 0) {
    td_status s = td_err(TD_ERR_NETWORK, "cannot bind the KV endpoint %s: %s", ep, zmq_strerror(zmq_errno()));
    zx_destroy(t);
    return s;
  }
  char bound[256], last[EP_MAX];
  size_t ll = sizeof bound;
  zmq_getsockopt(x->rx, ZMQ_LAST_ENDPOINT, bound, &ll);
  /* peers dial the advertised address, at the port bound */
  td_status es = td_net_advertised(bound, o->advertise, last, sizeof last);
  if (es != TD_OK) {
    zx_destroy(t);
    return es;
  }
  if (x->auth)
    snprintf(x->desc, sizeof x->desc, DESC_PREFIX "%s%c%s", last, KEY_SEP, td_auth_public_key(x->auth));
  else
    snprintf(x->desc, sizeof x->desc, DESC_PREFIX "%s", last);
  return TD_OK;
}

static const uint8_t *zx_desc(const td_kvt *t, size_t *len) {
  const zx *x = t->ctx;
  *len = strlen(x->desc);
  return (const uint8_t *)x->desc;
}

static td_status zx_watch(td_kvt *t, td_loop *l) {
  zx *x = t->ctx;
  if (x->loop) {
    td_loop_remove(x->loop, x->rx_ev);
    for (int i = 0; i < x->n_peers; i++) td_loop_remove(x->loop, x->peers[i].ev);
  }
  x->rx_ev = 0;
  for (int i = 0; i < x->n_peers; i++) x->peers[i].ev = 0;
  x->loop = l;
  if (!l) return TD_OK;
  TD_TRY(td_loop_add_socket(l, x->rx, on_readable, t, &x->rx_ev));
  for (int i = 0; i < x->n_peers; i++) TD_TRY(td_loop_add_socket(l, x->peers[i].sock, on_readable, t, &x->peers[i].ev));
  return TD_OK;
}

/* The endpoint and key ("" when none) of a "zmq:ENDPOINT[ KEY]" descriptor;
 * false when desc is not one. */
static bool desc_endpoint(const uint8_t *desc, size_t len, char ep[EP_MAX], char key[TD_AUTH_KEY_Z85]) {
  size_t pl = strlen(DESC_PREFIX);
  key[0] = 0;
  if (len <= pl || memcmp(desc, DESC_PREFIX, pl)) return false;
  const uint8_t *sep = memchr(desc + pl, KEY_SEP, len - pl);
  size_t el = sep ? (size_t)(sep - desc) - pl : len - pl;
  if (!el || el >= EP_MAX) return false;
  if (sep) {
    size_t kl = len - (size_t)(sep + 1 - desc);
    if (kl != TD_AUTH_KEY_Z85 - 1) return false;
    memcpy(key, sep + 1, kl);
    key[kl] = 0;
  }
  memcpy(ep, desc + pl, el);
  ep[el] = 0;
  return true;
}

/* The connection to a receiver's "zmq:ENDPOINT"; NULL with td_err. */
static peer *get_peer(zx *x, const uint8_t *desc, size_t len) {
  char ep[EP_MAX], key[TD_AUTH_KEY_Z85];
  if (!desc_endpoint(desc, len, ep, key)) {
    td_err(TD_ERR_INVALID, "KV descriptor is not a ZeroMQ endpoint");
    return NULL;
  }
  /* never blocks in the clear to a receiver that wants keys, nor the reverse */
  if (x->auth && !key[0]) {
    td_err(TD_ERR_INVALID, "the KV endpoint %s has no CURVE key and this worker has keys: not sending in the clear", ep);
    return NULL;
  }
  if (!x->auth && key[0]) {
    td_err(TD_ERR_INVALID, "the KV endpoint %s takes CURVE only and this worker has no keys", ep);
    return NULL;
  }
  for (int i = 0; i < x->n_peers; i++)
    if (!strcmp(x->peers[i].ep, ep) && !strcmp(x->peers[i].key, key)) return &x->peers[i];
  if (x->n_peers == MAX_PEERS) {
    /* recycle the oldest connection */
    if (x->loop) td_loop_remove(x->loop, x->peers[0].ev);
    zmq_close(x->peers[0].sock);
    memmove(x->peers, x->peers + 1, sizeof *x->peers * (MAX_PEERS - 1));
    x->n_peers--;
  }
  peer *p = &x->peers[x->n_peers];
  *p = (peer){.sock = zmq_socket(x->ctx, ZMQ_DEALER)};
  if (!p->sock) {
    td_err(TD_ERR_NETWORK, "zmq: %s", zmq_strerror(zmq_errno()));
    return NULL;
  }
  td_wire_setup_socket(p->sock);
  int64_t max = TD_KV_ACK_MAX_BYTES; /* only KvAcks come back */
  zmq_setsockopt(p->sock, ZMQ_MAXMSGSIZE, &max, sizeof max);
  if (td_auth_client(x->auth, p->sock, key[0] ? key : NULL) != TD_OK) { /* td_err set */
    zmq_close(p->sock);
    return NULL;
  }
  if (zmq_connect(p->sock, ep) != 0) {
    td_err(TD_ERR_NETWORK, "cannot connect to %s: %s", ep, zmq_strerror(zmq_errno()));
    zmq_close(p->sock);
    return NULL;
  }
  if (x->loop && td_loop_add_socket(x->loop, p->sock, on_readable, x->t, &p->ev) != TD_OK) {
    zmq_close(p->sock);
    return NULL;
  }
  snprintf(p->ep, sizeof p->ep, "%s", ep);
  snprintf(p->key, sizeof p->key, "%s", key);
  x->n_peers++;
  return p;
}

static td_status zx_push(td_kvt *t, const td_kvt_push *q) {
  zx *x = t->ctx;
  if (q->n > TD_KV_PUSH_MAX_BLOCKS)
    return td_err(TD_ERR_INVALID, "a KV push carries at most %d blocks over ZeroMQ, this one %d", TD_KV_PUSH_MAX_BLOCKS,
                  q->n);
  if (q->n > 0 && !q->src_host) return td_err(TD_ERR_INVALID, "the blocks are not in host memory");
  /* the receiver's socket would drop the connection without a word */
  if (q->block_bytes > x->max_block)
    return td_err(TD_ERR_INVALID, "KV blocks of %zu bytes exceed the ZeroMQ frame limit of %zu bytes", q->block_bytes,
                  x->max_block);
  peer *p = get_peer(x, q->peer_desc, q->peer_desc_len);
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
  h.rid = q->rid;
  h.reservation = q->reservation;
  h.cross = q->cross;
  h.blocks = (int32_t *)q->dst;
  h.n_blocks = (size_t)q->n;
  h.block_bytes = q->block_bytes;
  h.push_id = x->next_push++;
  if (q->token) h.token = (ProtobufCBinaryData){TD_KV_TOKEN_BYTES, (uint8_t *)q->token};
  size_t hl = protobuf_c_message_get_packed_size(&h.base);
  zmq_msg_t m;
  if (zmq_msg_init_size(&m, hl) != 0) return td_err(TD_ERR_NOMEM, "out of memory");
  protobuf_c_message_pack(&h.base, zmq_msg_data(&m));
  if (zmq_msg_send(&m, p->sock, q->n ? ZMQ_SNDMORE : 0) < 0) {
    zmq_msg_close(&m);
    return td_err(TD_ERR_NETWORK, "KV push: %s", zmq_strerror(zmq_errno()));
  }
  for (int i = 0; i < q->n; i++) {
    /* copied: a push that times out or is forgotten leaves its frames
     * queued on the socket after the job freed its buffer */
    zmq_msg_t b;
    if (zmq_msg_init_size(&b, q->block_bytes) != 0) return td_err(TD_ERR_NOMEM, "out of memory");
    memcpy(zmq_msg_data(&b), q->src_host + (size_t)i * q->block_bytes, q->block_bytes);
    if (zmq_msg_send(&b, p->sock, i + 1 < q->n ? ZMQ_SNDMORE : 0) < 0) {
      zmq_msg_close(&b);
      return td_err(TD_ERR_NETWORK, "KV push: %s", zmq_strerror(zmq_errno()));
    }
  }
  x->pend[x->n_pend++] = (pending){h.push_id, q->rid, q->tag, q->n, td_now_ms() + x->timeout_ms};
  return TD_OK;
}

static bool more(void *s) {
  int v = 0;
  size_t l = sizeof v;
  zmq_getsockopt(s, ZMQ_RCVMORE, &v, &l);
  return v != 0;
}

static void ack(zx *x, const zmq_msg_t *id, uint64_t push_id, bool ok, const char *err) {
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
static void receive_one(zx *x) {
  const td_kvt_hooks *hk = &x->t->hooks;
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
  char why[512] = ""; /* a refusal names two keys (KvAck's buffer holds 600 bytes) */
  bool ok = h && h->version == TD_PROTOCOL_VERSION;
  if (!ok)
    snprintf(why, sizeof why, h ? "KV push of protocol version %u" : "malformed KV push", h ? h->version : 0);
  if (ok && h->n_blocks > TD_KV_PUSH_MAX_BLOCKS) {
    snprintf(why, sizeof why, "a KV push carries at most %d blocks over ZeroMQ, this one %zu", TD_KV_PUSH_MAX_BLOCKS,
             h->n_blocks);
    ok = false;
  }
  if (ok) {
    /* the sender as CURVE proved it (the ZAP handler's User-Id); none without keys */
    char key[TD_AUTH_KEY_Z85];
    bool keyed = td_auth_msg_key(&hd, key);
    td_kvt_offer o = {.rid = h->rid, .reservation = h->reservation, .cross = h->cross, .blocks = h->blocks,
                      .n = (int)h->n_blocks, .block_bytes = (size_t)h->block_bytes,
                      .token = h->token.len == TD_KV_TOKEN_BYTES ? h->token.data : NULL,
                      .sender_key = keyed ? key : NULL};
    ok = hk->accept(hk->ctx, &o, why, sizeof why);
  }
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
  if (ok) hk->deliver(hk->ctx, h->cross, h->blocks, (int)n, ptrs, (size_t)h->block_bytes);
  for (size_t i = 0; i < got && i < n; i++)
    if (ptrs && ptrs[i]) zmq_msg_close(&frames[i]);
  free(frames);
  free(ptrs);
  if (h) {
    ack(x, &id, h->push_id, ok, ok ? NULL : why);
    if (ok)
      hk->arrived(hk->ctx, x->t, h->rid, h->reservation, h->cross, h->blocks, (int)h->n_blocks);
    else
      TD_WARN("refused a KV push for request %llu: %s", (unsigned long long)h->rid, why);
    tandem__cluster__kv_push__free_unpacked(h, NULL);
  }
  zmq_msg_close(&hd);
  zmq_msg_close(&id);
}

static void finish_push(zx *x, int i, bool ok, const char *err) {
  pending p = x->pend[i];
  x->pend[i] = x->pend[--x->n_pend];
  const td_kvt_hooks *hk = &x->t->hooks;
  hk->pushed(hk->ctx, x->t, p.rid, p.tag, p.n, ok, err);
}

static void zx_progress(td_kvt *t) {
  zx *x = t->ctx;
  for (int k = 0; k < BURST; k++) {
    int ev = 0;
    size_t l = sizeof ev;
    zmq_getsockopt(x->rx, ZMQ_EVENTS, &ev, &l);
    if (!(ev & ZMQ_POLLIN)) break;
    receive_one(x);
  }
  for (int i = 0; i < x->n_peers; i++) {
    for (int k = 0; k < BURST; k++) {
      uint8_t buf[600];
      int n = zmq_recv(x->peers[i].sock, buf, sizeof buf, ZMQ_DONTWAIT);
      if (n < 0) break;
      while (more(x->peers[i].sock)) zmq_recv(x->peers[i].sock, buf, 0, 0);
      Tandem__Cluster__KvAck *a = n <= (int)sizeof buf ? tandem__cluster__kv_ack__unpack(NULL, (size_t)n, buf) : NULL;
      if (a && a->version != TD_PROTOCOL_VERSION) { /* another version's answer: its push times out */
        TD_WARN("dropped a KvAck of protocol version %u", a->version);
        tandem__cluster__kv_ack__free_unpacked(a, NULL);
        a = NULL;
      }
      if (!a) continue;
      for (int p = 0; p < x->n_pend; p++)
        if (x->pend[p].push_id == a->push_id) {
          finish_push(x, p, a->ok, a->error);
          break;
        }
      tandem__cluster__kv_ack__free_unpacked(a, NULL);
    }
  }
  int64_t now = td_now_ms();
  for (int p = x->n_pend - 1; p >= 0; p--)
    if (now > x->pend[p].deadline) finish_push(x, p, false, "no answer from the receiving worker (dead or gone)");
}

/* The blocks were copied when pushed: nothing to hold. */
static bool zx_forget(td_kvt *t, uint64_t rid, int tag, bool cross, int32_t *blocks, int n) {
  zx *x = t->ctx;
  for (int p = x->n_pend - 1; p >= 0; p--)
    if (x->pend[p].rid == rid && x->pend[p].tag == tag) x->pend[p] = x->pend[--x->n_pend];
  return false;
}

static bool zx_busy(const td_kvt *t, uint64_t reservation) { return false; }
static int zx_pending(const td_kvt *t) { return ((const zx *)t->ctx)->n_pend; }
static bool zx_arm(td_kvt *t) { return true; }

static bool zx_route(td_kvt *t, const char *peer_id, const uint8_t *desc, size_t len, bool cross, char *why,
                     size_t cap) {
  char ep[EP_MAX], key[TD_AUTH_KEY_Z85];
  if (!desc_endpoint(desc, len, ep, key)) {
    snprintf(why, cap, "no ZeroMQ endpoint");
    return false;
  }
  if (!key[0] != !((zx *)t->ctx)->auth) {
    snprintf(why, cap, key[0] ? "its KV endpoint takes CURVE and this worker has no keys"
                              : "its KV endpoint has no CURVE key and this worker has keys");
    return false;
  }
  return true;
}

const td_kvt_i td_kvt_zmq = {
    .name = "zmq",
    .kind = TD_KVT_ZMQ,
    .host_copy = true,
    .create = zx_create,
    .destroy = zx_destroy,
    .desc = zx_desc,
    .route = zx_route,
    .push = zx_push,
    .forget = zx_forget,
    .busy = zx_busy,
    .pending = zx_pending,
    .watch = zx_watch,
    .arm = zx_arm,
    .progress = zx_progress,
};
