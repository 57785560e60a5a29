/* Shared helpers of the kvtransfer tests: a receiver application backed by
 * a kvcache pool, a sender completion record, and progress loops. */
#ifndef TD_TESTS_KVX_TESTUTIL_H
#define TD_TESTS_KVX_TESTUTIL_H

#include <criterion/criterion.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "kvcache/kvcache.h"
#include "kvtransfer/kvtransfer.h"

/* Receiver side: authorises against a kvcache reservation, pins the blocks
 * with a reference for the grant's lifetime, unpins on the recv event. */
typedef struct kt_rx {
  td_kv_pool *pool; /* NULL: grant everything */
  const uint8_t *want_token; /* non-NULL: grant only transfers whose REQ carries it */
  int grants, events, peer_events;
  td_status last_status;
  uint64_t last_bytes, last_request;
  char last_msg[256];
} kt_rx;

static inline td_status kt_authorize(void *ctx, const td_kvx_grant_req *r) {
  kt_rx *rx = ctx;
  if (rx->want_token && (!r->token || memcmp(r->token, rx->want_token, TD_KV_TOKEN_BYTES)))
    return td_err(TD_ERR_INVALID, "not the reservation's sender token");
  if (rx->pool) {
    if (!td_kv_reservation_valid(rx->pool, r->reservation_id, r->blocks, r->n_blocks, td_now_ms()))
      return td_err(TD_ERR_INVALID, "reservation %" PRIu64 " expired or unknown", r->reservation_id);
    for (int i = 0; i < r->n_blocks; i++) td_kv_ref(rx->pool, r->blocks[i]);
  }
  rx->grants++;
  return TD_OK;
}

static inline void kt_on_recv(void *ctx, const td_kvx_recv_event *ev) {
  kt_rx *rx = ctx;
  rx->events++;
  rx->last_status = ev->status;
  rx->last_bytes = ev->bytes;
  rx->last_request = ev->request_id;
  snprintf(rx->last_msg, sizeof rx->last_msg, "%s", ev->message ? ev->message : "");
  if (rx->pool)
    for (int i = 0; i < ev->n_blocks; i++) td_kv_unref(rx->pool, ev->blocks[i]);
}

static inline void kt_on_peer(void *ctx, td_kvx_peer *p, uint64_t uuid, td_status s, const char *msg) {
  kt_rx *rx = ctx;
  rx->peer_events++;
}

/* Sender side. */
typedef struct kt_done {
  int calls;
  td_status status;
  char msg[256];
  int64_t at_ms;
} kt_done;

static inline void kt_done_cb(void *arg, uint64_t id, td_status s, const char *msg) {
  kt_done *d = arg;
  d->calls++;
  d->status = s;
  d->at_ms = td_now_ms();
  snprintf(d->msg, sizeof d->msg, "%s", msg ? msg : "");
}

static inline td_kvx_opts kt_opts(const char *name, kt_rx *rx) {
  td_kvx_opts o;
  memset(&o, 0, sizeof o);
  o.name = name;
  o.cuda_device = -1;
  o.authorize = kt_authorize;
  o.on_recv = kt_on_recv;
  o.on_peer = kt_on_peer;
  o.ctx = rx;
  return o;
}

/* Progresses the engines (NULL entries skipped) until *flag != 0 or the
 * time runs out; sleeps on the engines' descriptors when idle. */
static inline bool kt_drive(td_kvx **ks, int n, const int *flag, int timeout_ms) {
  int64_t end = td_now_ms() + timeout_ms;
  while (!*flag) {
    if (td_now_ms() > end) return false;
    int work = 0;
    for (int i = 0; i < n; i++)
      if (ks[i]) work += td_kvx_progress(ks[i]);
    if (work || *flag) continue;
    struct pollfd pf[4];
    int np = 0;
    bool armed = true;
    for (int i = 0; i < n && armed; i++) {
      if (!ks[i]) continue;
      armed = td_kvx_arm(ks[i]);
      pf[np].fd = td_kvx_fd(ks[i]);
      pf[np].events = POLLIN;
      np++;
    }
    if (armed) poll(pf, (nfds_t)np, 20);
  }
  return true;
}

/* Posts x to peer p of sender s and drives s and receiver r (whose
 * callbacks count into rx) until the transfer ended well on both sides. */
static inline void kt_move(td_kvx *s, td_kvx *r, kt_rx *rx, td_kvx_peer *p, const td_kvx_xfer *x, const char *what) {
  int before = rx->events;
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(p, x, kt_done_cb, &d, NULL), TD_OK, "%s: %s", what, td_errmsg());
  td_kvx *ks[2] = {s, r};
  cr_assert(kt_drive(ks, 2, &d.calls, 20000), "%s: no completion", what);
  cr_assert_eq(d.status, TD_OK, "%s: %s", what, d.msg);
  int64_t end = td_now_ms() + 5000;
  while (rx->events == before && td_now_ms() < end) {
    td_kvx_progress(s);
    td_kvx_progress(r);
  }
  cr_assert_eq(rx->last_status, TD_OK, "%s: %s", what, rx->last_msg);
}

/* Reads n bytes from a pipe within ms, progressing k (when given) meanwhile. */
static inline bool kt_read_full(int fd, void *p, size_t n, td_kvx *k, int ms) {
  uint8_t *b = p;
  int64_t end = td_now_ms() + ms;
  while (n && td_now_ms() < end) {
    if (k) td_kvx_progress(k);
    struct pollfd pf = {fd, POLLIN, 0};
    if (poll(&pf, 1, 1) > 0) {
      ssize_t got = read(fd, b, n);
      if (got <= 0) return false;
      b += got;
      n -= (size_t)got;
    }
  }
  return n == 0;
}

static inline void kt_fill_random(void *p, size_t n, uint64_t seed) {
  uint8_t *b = p;
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b[i] = (uint8_t)(x >> 24);
  }
}

static inline td_kvx_geom kt_geom(int l0, int l1, int h0, int h1, int head_dim, int slots, int elem) {
  td_kvx_geom g = {{l1 - l0, h1 - h0, head_dim, slots, 0, 0}, elem, l0, l1, h0, h1};
  return g;
}

#endif
