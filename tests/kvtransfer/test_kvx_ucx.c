/* The request / grant protocol over UCX, two engines in one process:
 * transfers, re-slicing, refusals, cancellation, timeouts. */
#include <unistd.h>

#include "kvx_testutil.h"

typedef struct pair {
  kt_rx srx, rrx;
  td_kvx *s, *r;
  td_backend *cpu;
  td_kv_pool *kv; /* receiver bookkeeping and memory */
  void *smem;
  td_kvx_geom sg, rg;
  size_t sbb, rbb;
  td_kvx_peer *peer;
} pair;

enum { SPOOL = 1, RPOOL = 2, NS = 96, NR = 96 };

static void pair_open(pair *p, td_kvx_geom sg, td_kvx_geom rg, td_kvx_local_path local) {
  memset(p, 0, sizeof *p);
  p->sg = sg;
  p->rg = rg;
  td_kvx_opts so = kt_opts("sender", &p->srx), ro = kt_opts("receiver", &p->rrx);
  so.local_path = ro.local_path = local;
  cr_assert_eq(td_kvx_create(&so, &p->s), TD_OK, "%s", td_errmsg());
  cr_assert_eq(td_kvx_create(&ro, &p->r), TD_OK, "%s", td_errmsg());
  td_backend_opts bo = {.kind = TD_BACKEND_CPU, .threads = 1};
  cr_assert_eq(td_backend_create(&bo, &p->cpu), TD_OK, "%s", td_errmsg());
  cr_assert_eq((size_t)rg.elem_size, td_buf_elem_size(p->cpu, TD_BUF_ACT));
  cr_assert_eq(td_kv_pool_create(p->cpu, &rg.layout, NR, &p->kv), TD_OK, "%s", td_errmsg());
  p->rrx.pool = p->kv;
  p->sbb = td_kvx_block_bytes(&sg);
  p->rbb = td_kvx_block_bytes(&rg);
  cr_assert_eq(p->rbb, td_kv_pool_block_bytes(p->kv));
  p->smem = malloc(p->sbb * NS);
  kt_fill_random(p->smem, p->sbb * NS, 1234);
  memset(td_kv_pool_memory(p->kv), 0, p->rbb * NR);
  td_kvx_pool_desc sd = {SPOOL, TD_KVX_MEM_HOST, p->smem, NS, sg};
  td_kvx_pool_desc rd = {RPOOL, TD_KVX_MEM_HOST, td_kv_pool_memory(p->kv), NR, rg};
  cr_assert_eq(td_kvx_register_pool(p->s, &sd), TD_OK, "%s", td_errmsg());
  cr_assert_eq(td_kvx_register_pool(p->r, &rd), TD_OK, "%s", td_errmsg());
  uint8_t *desc;
  size_t n;
  cr_assert_eq(td_kvx_export(p->r, &desc, &n), TD_OK);
  cr_assert_eq(td_kvx_connect(p->s, desc, n, &p->peer), TD_OK, "%s", td_errmsg());
  free(desc);
}

static void pair_close(pair *p) {
  if (p->peer) td_kvx_disconnect(p->peer);
  td_kvx_destroy(p->s);
  td_kvx_destroy(p->r);
  cr_assert_eq(td_kv_pool_check(p->kv), TD_OK, "%s", td_errmsg());
  td_kv_pool_destroy(p->kv);
  td_backend_destroy(p->cpu);
  free(p->smem);
}

static bool drive2(pair *p, const int *flag, int ms) {
  td_kvx *ks[2] = {p->s, p->r};
  return kt_drive(ks, 2, flag, ms);
}

/* Distinct random source blocks. */
static void pick_blocks(int32_t *ids, int n, int total, uint64_t seed) {
  int32_t *all = malloc(sizeof *all * (size_t)total);
  for (int i = 0; i < total; i++) all[i] = i;
  uint64_t x = seed | 1;
  for (int i = total - 1; i > 0; i--) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    int j = (int)(x % (uint64_t)(i + 1));
    int32_t t = all[i];
    all[i] = all[j];
    all[j] = t;
  }
  memcpy(ids, all, sizeof *ids * (size_t)n);
  free(all);
}

static void run_basic(td_kvx_local_path local) {
  pair p;
  td_kvx_geom g = kt_geom(0, 4, 0, 4, 16, 8, 4);
  pair_open(&p, g, g, local);
  int n = 40;
  int32_t src[40], dst[40];
  uint64_t res;
  cr_assert_eq(td_kv_reserve(p.kv, n, td_now_ms() + 60000, &res, dst), TD_OK);
  pick_blocks(src, n, NS, 99);
  /* A contiguous run, to exercise coalescing. */
  for (int i = 0; i < 8; i++) src[i] = 50 + i;
  td_kvx_xfer x = {77, res, SPOOL, RPOOL, src, dst, n, 20000, TD_KVX_UCX, NULL, {0}};
  kt_done d = {0};
  uint64_t id = 0;
  cr_assert_eq(td_kvx_post(p.peer, &x, kt_done_cb, &d, &id), TD_OK, "%s", td_errmsg());
  cr_assert_neq(id, 0);
  cr_assert(drive2(&p, &d.calls, 20000), "no completion");
  cr_assert_eq(d.status, TD_OK, "%s", d.msg);
  cr_assert(drive2(&p, &p.rrx.events, 5000), "no receive event");
  cr_assert_eq(p.rrx.last_status, TD_OK, "%s", p.rrx.last_msg);
  cr_assert_eq(p.rrx.last_request, 77);
  cr_assert_eq(p.rrx.last_bytes, (uint64_t)n * p.rbb);
  const uint8_t *rm = td_kv_pool_memory(p.kv);
  for (int i = 0; i < n; i++)
    cr_assert_eq(memcmp(rm + (size_t)dst[i] * p.rbb, (uint8_t *)p.smem + (size_t)src[i] * p.sbb, p.rbb), 0,
                 "block %d (%d -> %d) differs", i, src[i], dst[i]);
  cr_assert_not(td_kvx_reservation_busy(p.r, res));
  td_kvx_stats ss = td_kvx_get_stats(p.s), rs = td_kvx_get_stats(p.r);
  cr_assert_eq(ss.xfers, 0);
  cr_assert_eq(ss.xfers_ok, 1);
  cr_assert_eq(rs.grants, 0);
  cr_assert_eq(rs.grants_ok, 1);
  cr_assert_eq(rs.bytes_received, (uint64_t)n * p.rbb);
  cr_assert_eq(rs.rpeers, 1);
  /* Pins were dropped: the reservation can be claimed. */
  for (int i = 0; i < n; i++) cr_assert_eq(td_kv_refcount(p.kv, dst[i]), 1);
  cr_assert_eq(td_kv_reservation_release(p.kv, res), TD_OK);
  pair_close(&p);
}

Test(kvx_ucx, host_blocks_arrive_identical, .timeout = 120) { run_basic(TD_KVX_LOCAL_AUTO); }
Test(kvx_ucx, host_blocks_over_the_control_endpoint, .timeout = 120) { run_basic(TD_KVX_LOCAL_OFF); }

/* Several puts (more than one 8 MiB put window) and concurrent transfers. */
Test(kvx_ucx, large_and_concurrent, .timeout = 180) {
  pair p;
  td_kvx_geom g = kt_geom(0, 8, 0, 8, 64, 16, 4); /* 256 KiB blocks */
  pair_open(&p, g, g, TD_KVX_LOCAL_AUTO);
  int32_t src1[48], dst1[48], src2[40], dst2[40];
  uint64_t r1, r2;
  cr_assert_eq(td_kv_reserve(p.kv, 48, td_now_ms() + 60000, &r1, dst1), TD_OK);
  cr_assert_eq(td_kv_reserve(p.kv, 40, td_now_ms() + 60000, &r2, dst2), TD_OK);
  for (int i = 0; i < 48; i++) src1[i] = i;
  pick_blocks(src2, 40, NS, 3);
  td_kvx_xfer a = {1, r1, SPOOL, RPOOL, src1, dst1, 48, 60000, TD_KVX_AUTO, NULL, {0}};
  td_kvx_xfer b = {2, r2, SPOOL, RPOOL, src2, dst2, 40, 60000, TD_KVX_AUTO, NULL, {0}};
  kt_done da = {0}, db = {0};
  cr_assert_eq(td_kvx_post(p.peer, &a, kt_done_cb, &da, NULL), TD_OK, "%s", td_errmsg());
  cr_assert_eq(td_kvx_post(p.peer, &b, kt_done_cb, &db, NULL), TD_OK, "%s", td_errmsg());
  cr_assert(drive2(&p, &da.calls, 60000));
  cr_assert(drive2(&p, &db.calls, 60000));
  cr_assert_eq(da.status, TD_OK, "%s", da.msg);
  cr_assert_eq(db.status, TD_OK, "%s", db.msg);
  const uint8_t *rm = td_kv_pool_memory(p.kv);
  for (int i = 0; i < 48; i++)
    cr_assert_eq(memcmp(rm + (size_t)dst1[i] * p.rbb, (uint8_t *)p.smem + (size_t)src1[i] * p.sbb, p.rbb), 0);
  for (int i = 0; i < 40; i++)
    cr_assert_eq(memcmp(rm + (size_t)dst2[i] * p.rbb, (uint8_t *)p.smem + (size_t)src2[i] * p.sbb, p.rbb), 0);
  int64_t end = td_now_ms() + 5000;
  while (p.rrx.events < 2 && td_now_ms() < end) {
    td_kvx_progress(p.s);
    td_kvx_progress(p.r);
  }
  cr_assert_eq(p.rrx.events, 2);
  pair_close(&p);
}

/* A sender holding all heads and layers feeds a receiver rank holding
 * layers [1, 3) and heads [4, 8): only its slices arrive. */
Test(kvx_ucx, resliced_transfer, .timeout = 120) {
  pair p;
  td_kvx_geom sg = kt_geom(0, 4, 0, 8, 8, 4, 4), rg = kt_geom(1, 3, 4, 8, 8, 4, 4);
  pair_open(&p, sg, rg, TD_KVX_LOCAL_AUTO);
  int n = 12;
  int32_t src[12], dst[12];
  uint64_t res;
  cr_assert_eq(td_kv_reserve(p.kv, n, td_now_ms() + 60000, &res, dst), TD_OK);
  pick_blocks(src, n, NS, 17);
  td_kvx_xfer x = {5, res, SPOOL, RPOOL, src, dst, n, 20000, TD_KVX_UCX, NULL, {0}};
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(p.peer, &x, kt_done_cb, &d, NULL), TD_OK, "%s", td_errmsg());
  cr_assert(drive2(&p, &d.calls, 20000));
  cr_assert_eq(d.status, TD_OK, "%s", d.msg);
  const uint8_t *rm = td_kv_pool_memory(p.kv);
  size_t row = 4 * 8 * 4; /* one head: slots x head_dim x 4 bytes */
  for (int i = 0; i < n; i++) {
    const uint8_t *sb = (uint8_t *)p.smem + (size_t)src[i] * p.sbb, *rb = rm + (size_t)dst[i] * p.rbb;
    for (int l = 1; l < 3; l++)
      for (int kv = 0; kv < 2; kv++)
        for (int h = 4; h < 8; h++)
          cr_assert_eq(memcmp(rb + (((size_t)(l - 1) * 2 + (size_t)kv) * 4 + (size_t)(h - 4)) * row,
                              sb + (((size_t)l * 2 + (size_t)kv) * 8 + (size_t)h) * row, row),
                       0, "block %d layer %d kv %d head %d", i, l, kv, h);
  }
  cr_assert(drive2(&p, &p.rrx.events, 5000));
  cr_assert_eq(p.rrx.last_bytes, (uint64_t)n * p.rbb);
  pair_close(&p);
}

Test(kvx_ucx, expired_reservation_is_refused, .timeout = 60) {
  pair p;
  td_kvx_geom g = kt_geom(0, 2, 0, 2, 8, 4, 4);
  pair_open(&p, g, g, TD_KVX_LOCAL_AUTO);
  int32_t src[4] = {0, 1, 2, 3}, dst[4];
  uint64_t res;
  cr_assert_eq(td_kv_reserve(p.kv, 4, td_now_ms() + 5, &res, dst), TD_OK);
  usleep(30 * 1000);
  td_kvx_xfer x = {9, res, SPOOL, RPOOL, src, dst, 4, 10000, TD_KVX_UCX, NULL, {0}};
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(p.peer, &x, kt_done_cb, &d, NULL), TD_OK);
  cr_assert(drive2(&p, &d.calls, 10000));
  cr_assert_eq(d.status, TD_ERR_INVALID, "%s: %s", td_status_str(d.status), d.msg);
  cr_assert(strstr(d.msg, "expired"), "%s", d.msg);
  cr_assert_eq(p.rrx.grants, 0);
  cr_assert_eq(p.rrx.events, 0);
  const uint8_t *rm = td_kv_pool_memory(p.kv);
  for (int b = 0; b < 4; b++)
    for (size_t i = 0; i < p.rbb; i++) cr_assert_eq(rm[(size_t)dst[b] * p.rbb + i], 0);
  /* An unknown reservation, and blocks outside the reservation, likewise. */
  uint64_t res2;
  int32_t dst2[4];
  cr_assert_eq(td_kv_reserve(p.kv, 4, td_now_ms() + 60000, &res2, dst2), TD_OK);
  td_kvx_xfer y = {10, res2 + 1000, SPOOL, RPOOL, src, dst2, 4, 10000, TD_KVX_UCX, NULL, {0}};
  kt_done e = {0};
  cr_assert_eq(td_kvx_post(p.peer, &y, kt_done_cb, &e, NULL), TD_OK);
  cr_assert(drive2(&p, &e.calls, 10000));
  cr_assert_eq(e.status, TD_ERR_INVALID, "%s", e.msg);
  int32_t other[4] = {dst2[0], dst2[1], dst2[2], 90};
  td_kvx_xfer z = {11, res2, SPOOL, RPOOL, src, other, 4, 10000, TD_KVX_UCX, NULL, {0}};
  kt_done f = {0};
  cr_assert_eq(td_kvx_post(p.peer, &z, kt_done_cb, &f, NULL), TD_OK);
  cr_assert(drive2(&p, &f.calls, 10000));
  cr_assert_eq(f.status, TD_ERR_INVALID, "%s", f.msg);
  cr_assert_eq(p.rrx.grants, 0);
  pair_close(&p);
}

/* The sender's token travels in REQ to the receiver's authorize: a
 * transfer with another token is refused before a byte moves, one with the
 * reservation's token is granted. */
Test(kvx_ucx, sender_token_reaches_authorize, .timeout = 60) {
  pair p;
  td_kvx_geom g = kt_geom(0, 2, 0, 2, 8, 4, 4);
  pair_open(&p, g, g, TD_KVX_LOCAL_AUTO);
  static const uint8_t token[TD_KV_TOKEN_BYTES] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  p.rrx.want_token = token;
  int32_t src[4] = {0, 1, 2, 3}, dst[4];
  uint64_t res;
  cr_assert_eq(td_kv_reserve(p.kv, 4, td_now_ms() + 60000, &res, dst), TD_OK);
  td_kvx_xfer x = {12, res, SPOOL, RPOOL, src, dst, 4, 10000, TD_KVX_UCX, NULL, {0}};
  x.token[0] = 1; /* the rest differs */
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(p.peer, &x, kt_done_cb, &d, NULL), TD_OK);
  cr_assert(drive2(&p, &d.calls, 10000));
  cr_assert_eq(d.status, TD_ERR_INVALID, "%s: %s", td_status_str(d.status), d.msg);
  cr_assert(strstr(d.msg, "sender token"), "%s", d.msg);
  cr_assert_eq(p.rrx.grants, 0);
  const uint8_t *rm = td_kv_pool_memory(p.kv);
  for (int b = 0; b < 4; b++)
    for (size_t i = 0; i < p.rbb; i++) cr_assert_eq(rm[(size_t)dst[b] * p.rbb + i], 0, "a refused transfer wrote");
  memcpy(x.token, token, sizeof token);
  x.request_id = 13;
  kt_move(p.s, p.r, &p.rrx, p.peer, &x, "with the token");
  cr_assert_eq(p.rrx.grants, 1);
  cr_assert_eq(td_kv_reservation_release(p.kv, res), TD_OK);
  pair_close(&p);
}

Test(kvx_ucx, refusals_at_post, .timeout = 60) {
  pair p;
  td_kvx_geom g = kt_geom(0, 2, 0, 2, 8, 4, 4);
  pair_open(&p, g, g, TD_KVX_LOCAL_AUTO);
  int32_t src[2] = {0, 1}, dst[2] = {0, 1};
  td_kvx_xfer x = {1, 1, SPOOL, 99, src, dst, 2, 0, TD_KVX_UCX, NULL, {0}};
  cr_assert_eq(td_kvx_post(p.peer, &x, NULL, NULL, NULL), TD_ERR_NOT_FOUND);
  x.dst_pool = RPOOL;
  x.src_pool = 42;
  cr_assert_eq(td_kvx_post(p.peer, &x, NULL, NULL, NULL), TD_ERR_NOT_FOUND);
  x.src_pool = SPOOL;
  int32_t far[2] = {0, NR};
  x.dst_blocks = far;
  cr_assert_eq(td_kvx_post(p.peer, &x, NULL, NULL, NULL), TD_ERR_INVALID);
  x.dst_blocks = dst;
  x.n_blocks = 0;
  cr_assert_eq(td_kvx_post(p.peer, &x, NULL, NULL, NULL), TD_ERR_INVALID);
  x.n_blocks = 2;
  x.transport = TD_KVX_NCCL;
  cr_assert_eq(td_kvx_post(p.peer, &x, NULL, NULL, NULL), TD_ERR_INVALID);
  cr_assert_eq(td_kvx_cancel(p.s, 12345), TD_ERR_NOT_FOUND);
  cr_assert_eq(td_kvx_get_stats(p.s).xfers, 0);
  pair_close(&p);
}

/* A receiver without an authorize callback refuses everything. */
Test(kvx_ucx, receiver_without_authorization, .timeout = 60) {
  kt_rx rx = {0};
  td_kvx_opts so = kt_opts("s", &rx), ro = kt_opts("r", &rx);
  ro.authorize = NULL;
  td_kvx *s, *r;
  cr_assert_eq(td_kvx_create(&so, &s), TD_OK);
  cr_assert_eq(td_kvx_create(&ro, &r), TD_OK);
  td_kvx_geom g = kt_geom(0, 1, 0, 1, 8, 4, 4);
  size_t bb = td_kvx_block_bytes(&g);
  void *a = calloc(4, bb), *b = calloc(4, bb);
  td_kvx_pool_desc sd = {1, TD_KVX_MEM_HOST, a, 4, g}, rd = {1, TD_KVX_MEM_HOST, b, 4, g};
  cr_assert_eq(td_kvx_register_pool(s, &sd), TD_OK);
  cr_assert_eq(td_kvx_register_pool(r, &rd), TD_OK);
  uint8_t *desc;
  size_t n;
  cr_assert_eq(td_kvx_export(r, &desc, &n), TD_OK);
  td_kvx_peer *peer;
  cr_assert_eq(td_kvx_connect(s, desc, n, &peer), TD_OK);
  free(desc);
  int32_t ids[1] = {2};
  td_kvx_xfer x = {1, 1, 1, 1, ids, ids, 1, 5000, TD_KVX_UCX, NULL, {0}};
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(peer, &x, kt_done_cb, &d, NULL), TD_OK);
  td_kvx *ks[2] = {s, r};
  cr_assert(kt_drive(ks, 2, &d.calls, 10000));
  cr_assert_eq(d.status, TD_ERR_UNSUPPORTED, "%s", d.msg);
  td_kvx_disconnect(peer);
  td_kvx_destroy(s);
  td_kvx_destroy(r);
  free(a);
  free(b);
}

Test(kvx_ucx, cancel_before_grant, .timeout = 60) {
  pair p;
  td_kvx_geom g = kt_geom(0, 2, 0, 2, 8, 4, 4);
  pair_open(&p, g, g, TD_KVX_LOCAL_AUTO);
  int32_t src[4] = {0, 1, 2, 3}, dst[4];
  uint64_t res;
  cr_assert_eq(td_kv_reserve(p.kv, 4, td_now_ms() + 60000, &res, dst), TD_OK);
  td_kvx_xfer x = {3, res, SPOOL, RPOOL, src, dst, 4, 10000, TD_KVX_UCX, NULL, {0}};
  kt_done d = {0};
  uint64_t id;
  cr_assert_eq(td_kvx_post(p.peer, &x, kt_done_cb, &d, &id), TD_OK);
  cr_assert_eq(td_kvx_cancel(p.s, id), TD_OK);
  cr_assert_eq(d.calls, 0); /* callbacks only from progress */
  cr_assert(drive2(&p, &d.calls, 10000));
  cr_assert_eq(d.status, TD_ERR_CANCELLED);
  /* The receiver either refused nothing yet or ends its grant as cancelled. */
  int64_t end = td_now_ms() + 2000;
  while (td_now_ms() < end && (p.rrx.grants != p.rrx.events)) {
    td_kvx_progress(p.s);
    td_kvx_progress(p.r);
  }
  cr_assert_eq(p.rrx.grants, p.rrx.events);
  if (p.rrx.events) cr_assert_eq(p.rrx.last_status, TD_ERR_CANCELLED);
  cr_assert_not(td_kvx_reservation_busy(p.r, res));
  cr_assert_eq(td_kvx_cancel(p.s, id), TD_ERR_NOT_FOUND);
  pair_close(&p);
}

/* Puts over the control endpoint need the receiver's progress, so a
 * receiver that stops calling progress leaves the transfer mid-copy. */
Test(kvx_ucx, cancel_mid_transfer, .timeout = 120) {
  pair p;
  td_kvx_geom g = kt_geom(0, 8, 0, 8, 64, 16, 4); /* 256 KiB blocks */
  pair_open(&p, g, g, TD_KVX_LOCAL_OFF);
  int n = 64;
  int32_t src[64], dst[64];
  uint64_t res;
  cr_assert_eq(td_kv_reserve(p.kv, n, td_now_ms() + 60000, &res, dst), TD_OK);
  for (int i = 0; i < n; i++) src[i] = i;
  td_kvx_xfer x = {4, res, SPOOL, RPOOL, src, dst, n, 60000, TD_KVX_UCX, NULL, {0}};
  kt_done d = {0};
  uint64_t id;
  cr_assert_eq(td_kvx_post(p.peer, &x, kt_done_cb, &d, &id), TD_OK);
  /* Until the grant is out and some bytes went. */
  int64_t end = td_now_ms() + 20000;
  while (td_kvx_get_stats(p.s).bytes_sent == 0 && td_now_ms() < end) {
    td_kvx_progress(p.s);
    td_kvx_progress(p.r);
  }
  cr_assert_gt(td_kvx_get_stats(p.s).bytes_sent, 0);
  cr_assert(td_kvx_reservation_busy(p.r, res));
  cr_assert_eq(td_kvx_cancel(p.s, id), TD_OK);
  cr_assert(drive2(&p, &d.calls, 20000));
  cr_assert(d.status == TD_ERR_CANCELLED || d.status == TD_OK, "%s", d.msg);
  cr_assert(drive2(&p, &p.rrx.events, 10000));
  cr_assert_eq(p.rrx.last_status, d.status, "receiver: %s", p.rrx.last_msg);
  cr_assert_not(td_kvx_reservation_busy(p.r, res));
  for (int i = 0; i < n; i++) cr_assert_eq(td_kv_refcount(p.kv, dst[i]), 1);
  pair_close(&p);
}

/* A receiver that stops answering: the sender's transfer times out, and
 * its resources are freed. */
Test(kvx_ucx, timeout_when_receiver_hangs, .timeout = 120) {
  pair p;
  td_kvx_geom g = kt_geom(0, 8, 0, 8, 64, 16, 4);
  pair_open(&p, g, g, TD_KVX_LOCAL_OFF);
  int n = 64;
  int32_t src[64], dst[64];
  uint64_t res;
  cr_assert_eq(td_kv_reserve(p.kv, n, td_now_ms() + 60000, &res, dst), TD_OK);
  for (int i = 0; i < n; i++) src[i] = i;
  td_kvx_xfer x = {6, res, SPOOL, RPOOL, src, dst, n, 400, TD_KVX_UCX, NULL, {0}};
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(p.peer, &x, kt_done_cb, &d, NULL), TD_OK);
  while (p.rrx.grants == 0) {
    td_kvx_progress(p.s);
    td_kvx_progress(p.r);
  }
  int64_t t0 = td_now_ms();
  td_kvx *ks[2] = {p.s, NULL};
  cr_assert(kt_drive(ks, 2, &d.calls, 15000), "no timeout");
  cr_assert_eq(d.status, TD_ERR_TIMEOUT, "%s: %s", td_status_str(d.status), d.msg);
  cr_assert_lt(td_now_ms() - t0, 10000);
  td_kvx_stats s = td_kvx_get_stats(p.s);
  cr_assert_eq(s.xfers, 0);
  cr_assert_eq(s.xfers_failed, 1);
  pair_close(&p);
}

Test(kvx_ucx, disconnect_cancels, .timeout = 60) {
  pair p;
  td_kvx_geom g = kt_geom(0, 2, 0, 2, 8, 4, 4);
  pair_open(&p, g, g, TD_KVX_LOCAL_AUTO);
  int32_t src[4] = {0, 1, 2, 3}, dst[4];
  uint64_t res;
  cr_assert_eq(td_kv_reserve(p.kv, 4, td_now_ms() + 60000, &res, dst), TD_OK);
  td_kvx_xfer x = {3, res, SPOOL, RPOOL, src, dst, 4, 10000, TD_KVX_UCX, NULL, {0}};
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(p.peer, &x, kt_done_cb, &d, NULL), TD_OK);
  td_kvx_disconnect(p.peer);
  p.peer = NULL;
  cr_assert(drive2(&p, &d.calls, 10000));
  cr_assert_eq(d.status, TD_ERR_CANCELLED);
  int64_t end = td_now_ms() + 3000;
  while (td_now_ms() < end && td_kvx_get_stats(p.r).rpeers > 0) {
    td_kvx_progress(p.s);
    td_kvx_progress(p.r);
  }
  cr_assert_eq(td_kvx_get_stats(p.r).rpeers, 0);
  cr_assert_eq(td_kvx_get_stats(p.s).peers, 0);
  cr_assert_eq(p.rrx.grants, p.rrx.events);
  pair_close(&p);
}
