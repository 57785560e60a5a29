/* The NCCL path's chunk pipeline (gather, send, receive, scatter, bounce
 * slots, grant order, failures) over the fake GPU and fake NCCL of
 * gpu_fake.c: two engines in one process, "device memory" in host memory,
 * sends matched with receives in order. Runs in CI without a GPU. */
#include "kvx_testutil.h"

#include "kvtransfer/wire.h"

enum { POOL = 2, POOL_B = 3, NB = 64 };

typedef struct side {
  kt_rx rx;
  td_kvx *k;
  uint8_t *mem, *mem_b;
  size_t bb, bb_b;
} side;

/* Pool POOL has geometry g, POOL_B geometry gb (another block size). */
static void side_open(side *s, const char *name, int device, size_t chunk, td_kvx_geom g, td_kvx_geom gb,
                      uint64_t seed) {
  memset(s, 0, sizeof *s);
  td_kvx_opts o = kt_opts(name, &s->rx);
  o.cuda_device = device;
  o.nccl_chunk_bytes = chunk;
  cr_assert_eq(td_kvx_create(&o, &s->k), TD_OK, "%s", td_errmsg());
  s->bb = td_kvx_block_bytes(&g);
  s->bb_b = td_kvx_block_bytes(&gb);
  s->mem = malloc(s->bb * NB);
  s->mem_b = malloc(s->bb_b * NB);
  kt_fill_random(s->mem, s->bb * NB, seed);
  kt_fill_random(s->mem_b, s->bb_b * NB, seed + 1);
  td_kvx_pool_desc a = {POOL, TD_KVX_MEM_CUDA, s->mem, NB, g}, b = {POOL_B, TD_KVX_MEM_CUDA, s->mem_b, NB, gb};
  cr_assert_eq(td_kvx_register_pool(s->k, &a), TD_OK, "%s", td_errmsg());
  cr_assert_eq(td_kvx_register_pool(s->k, &b), TD_OK, "%s", td_errmsg());
}

static void side_close(side *s) {
  td_kvx_destroy(s->k);
  free(s->mem);
  free(s->mem_b);
}

static td_kvx_peer *link_to(side *from, side *to) {
  uint8_t *desc;
  size_t n;
  cr_assert_eq(td_kvx_export(to->k, &desc, &n), TD_OK);
  td_kvx_peer *p;
  cr_assert_eq(td_kvx_connect(from->k, desc, n, &p), TD_OK, "%s", td_errmsg());
  cr_assert(td_kvx_peer_info(p)->nccl);
  free(desc);
  return p;
}

/* Block ids: sources in order or scattered, destinations scattered (a
 * contiguous run first) or in order. */
static void ids(int n, bool src_scattered, bool dst_scattered, int32_t *src, int32_t *dst) {
  for (int i = 0; i < n; i++) {
    src[i] = src_scattered ? (i * 13 + 5) % NB : i;
    dst[i] = !dst_scattered ? NB - n + i : i < 6 ? NB - 6 + i : ((i - 6) * 5 + 1) % (NB - 6); /* 5 is coprime with 58 */
  }
}

static void check_blocks(side *s, side *r, uint32_t pool, const int32_t *src, const int32_t *dst, int n) {
  const uint8_t *sm = pool == POOL ? s->mem : s->mem_b, *rm = pool == POOL ? r->mem : r->mem_b;
  size_t bb = pool == POOL ? s->bb : s->bb_b;
  for (int i = 0; i < n; i++)
    cr_assert_eq(memcmp(rm + (size_t)dst[i] * bb, sm + (size_t)src[i] * bb, bb), 0, "pool %u block %d (%d -> %d) differs",
                 pool, i, src[i], dst[i]);
}

/* One NCCL transfer, driven to both ends; checks every block. */
static void move(side *s, side *r, td_kvx_peer *p, uint32_t pool, int n, bool src_sc, bool dst_sc) {
  int32_t src[NB], dst[NB];
  ids(n, src_sc, dst_sc, src, dst);
  td_kvx_xfer x = {7, 0, pool, pool, src, dst, n, 20000, TD_KVX_NCCL, NULL, {0}};
  kt_move(s->k, r->k, &r->rx, p, &x, "NCCL");
  cr_assert_eq(r->rx.last_bytes, (uint64_t)n * (pool == POOL ? r->bb : r->bb_b));
  check_blocks(s, r, pool, src, dst, n);
}

static td_kvx_geom small_block(void) { return kt_geom(0, 2, 0, 4, 16, 8, 2); }  /* 8 KiB */
static td_kvx_geom large_block(void) { return kt_geom(0, 6, 0, 4, 16, 8, 2); }  /* 24 KiB */

/* Scattered and contiguous sides, blocks of two sizes, chunks smaller and
 * larger than a block (bounce slots reused many times). */
Test(kvx_nccl, scattered_blocks_both_sizes, .timeout = 120) {
  size_t chunks[] = {4096, 20000, 64 << 10};
  for (int c = 0; c < 3; c++) {
    side s, r;
    side_open(&s, "nccl-s", 0, chunks[c], small_block(), large_block(), 1 + (uint64_t)c);
    side_open(&r, "nccl-r", 1, chunks[c], small_block(), large_block(), 100 + (uint64_t)c);
    td_kvx_peer *p = link_to(&s, &r);
    for (int pool = POOL; pool <= POOL_B; pool++) {
      move(&s, &r, p, (uint32_t)pool, 30, false, true); /* gather-free sender, scattering receiver */
      move(&s, &r, p, (uint32_t)pool, 30, true, false); /* gathering sender, receive in place */
      move(&s, &r, p, (uint32_t)pool, 30, true, true);
      move(&s, &r, p, (uint32_t)pool, 1, false, false);
    }
    td_kvx_stats st = td_kvx_get_stats(s.k);
    cr_assert_eq(st.nccl_xfers, 8);
    cr_assert_eq(st.xfers_ok, 8);
    td_kvx_disconnect(p);
    side_close(&s);
    side_close(&r);
  }
}

/* A sender with larger chunks than the receiver's slots: the GRANT settles
 * on the receiver's. */
Test(kvx_nccl, receiver_lowers_the_chunking, .timeout = 120) {
  side s, r;
  side_open(&s, "nccl-s", 0, 256 << 10, small_block(), large_block(), 3);
  side_open(&r, "nccl-r", 1, 8192, small_block(), large_block(), 300);
  td_kvx_peer *p = link_to(&s, &r);
  move(&s, &r, p, POOL_B, 40, true, true);
  td_kvx_disconnect(p);
  side_close(&s);
  side_close(&r);
}

/* Re-sliced (TP and PP): pieces smaller than a block on both sides. */
Test(kvx_nccl, resliced, .timeout = 120) {
  td_kvx_geom sg = kt_geom(0, 4, 0, 8, 8, 4, 2), rg = kt_geom(2, 4, 2, 6, 8, 4, 2);
  side s, r;
  side_open(&s, "nccl-s", 0, 4096, sg, sg, 4);
  side_open(&r, "nccl-r", 1, 4096, rg, rg, 400);
  td_kvx_peer *p = link_to(&s, &r);
  int32_t src[20], dst[20];
  for (int i = 0; i < 20; i++) {
    src[i] = (i * 3) % NB;
    dst[i] = NB - 1 - 2 * i;
  }
  td_kvx_xfer x = {1, 0, POOL, POOL, src, dst, 20, 20000, TD_KVX_NCCL, NULL, {0}};
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(p, &x, kt_done_cb, &d, NULL), TD_OK, "%s", td_errmsg());
  td_kvx *ks[2] = {s.k, r.k};
  cr_assert(kt_drive(ks, 2, &d.calls, 20000));
  cr_assert_eq(d.status, TD_OK, "%s", d.msg);
  size_t row = 4 * 8 * 2;
  for (int i = 0; i < 20; i++)
    for (int l = 2; l < 4; l++)
      for (int kv = 0; kv < 2; kv++)
        for (int h = 2; h < 6; h++)
          cr_assert_eq(memcmp(r.mem + (size_t)dst[i] * r.bb + (((size_t)(l - 2) * 2 + (size_t)kv) * 4 + (size_t)(h - 2)) * row,
                              s.mem + (size_t)src[i] * s.bb + (((size_t)l * 2 + (size_t)kv) * 8 + (size_t)h) * row, row),
                       0, "block %d layer %d kv %d head %d", i, l, kv, h);
  td_kvx_disconnect(p);
  side_close(&s);
  side_close(&r);
}

/* Transfers posted together go in grant order, sharing the slots. */
Test(kvx_nccl, queued_transfers, .timeout = 120) {
  side s, r;
  side_open(&s, "nccl-s", 0, 8192, small_block(), large_block(), 5);
  side_open(&r, "nccl-r", 1, 8192, small_block(), large_block(), 500);
  td_kvx_peer *p = link_to(&s, &r);
  enum { NX = 6, PER = 10 };
  int32_t src[NX][PER], dst[NX][PER];
  kt_done d[NX];
  memset(d, 0, sizeof d);
  for (int t = 0; t < NX; t++) {
    for (int i = 0; i < PER; i++) {
      src[t][i] = (t * PER + i * 7) % NB;
      dst[t][i] = t * PER + (i * 3) % PER; /* disjoint per transfer */
    }
    uint32_t pool = t % 2 ? POOL_B : POOL;
    td_kvx_xfer x = {(uint64_t)t, 0, pool, pool, src[t], dst[t], PER, 20000, TD_KVX_NCCL, NULL, {0}};
    cr_assert_eq(td_kvx_post(p, &x, kt_done_cb, &d[t], NULL), TD_OK, "%s", td_errmsg());
  }
  td_kvx *ks[2] = {s.k, r.k};
  for (int t = 0; t < NX; t++) {
    cr_assert(kt_drive(ks, 2, &d[t].calls, 20000), "transfer %d", t);
    cr_assert_eq(d[t].status, TD_OK, "transfer %d: %s", t, d[t].msg);
  }
  int64_t end = td_now_ms() + 5000;
  while (r.rx.events < NX && td_now_ms() < end) {
    td_kvx_progress(s.k);
    td_kvx_progress(r.k);
  }
  cr_assert_eq(r.rx.events, NX);
  for (int t = 0; t < NX; t++) check_blocks(&s, &r, t % 2 ? POOL_B : POOL, src[t], dst[t], PER);
  td_kvx_disconnect(p);
  side_close(&s);
  side_close(&r);
}

/* Two senders into one receiver at once: two communicators, one set of
 * receive slots. */
Test(kvx_nccl, two_senders, .timeout = 120) {
  side a, b, r;
  side_open(&a, "nccl-a", 0, 4096, small_block(), large_block(), 6);
  side_open(&b, "nccl-b", 2, 12288, small_block(), large_block(), 7);
  side_open(&r, "nccl-r", 1, 8192, small_block(), large_block(), 600);
  td_kvx_peer *pa = link_to(&a, &r), *pb = link_to(&b, &r);
  int32_t sa[20], da[20], sb[20], db[20];
  for (int i = 0; i < 20; i++) {
    sa[i] = sb[i] = (i * 5) % NB;
    da[i] = 2 * i;
    db[i] = 2 * i + 1;
  }
  td_kvx_xfer xa = {1, 0, POOL_B, POOL_B, sa, da, 20, 20000, TD_KVX_NCCL, NULL, {0}};
  td_kvx_xfer xb = {2, 0, POOL_B, POOL_B, sb, db, 20, 20000, TD_KVX_NCCL, NULL, {0}};
  kt_done d1 = {0}, d2 = {0};
  cr_assert_eq(td_kvx_post(pa, &xa, kt_done_cb, &d1, NULL), TD_OK, "%s", td_errmsg());
  cr_assert_eq(td_kvx_post(pb, &xb, kt_done_cb, &d2, NULL), TD_OK, "%s", td_errmsg());
  td_kvx *ks[3] = {a.k, b.k, r.k};
  cr_assert(kt_drive(ks, 3, &d1.calls, 20000));
  cr_assert(kt_drive(ks, 3, &d2.calls, 20000));
  cr_assert_eq(d1.status, TD_OK, "%s", d1.msg);
  cr_assert_eq(d2.status, TD_OK, "%s", d2.msg);
  for (int i = 0; i < 20; i++) {
    cr_assert_eq(memcmp(r.mem_b + (size_t)da[i] * r.bb_b, a.mem_b + (size_t)sa[i] * a.bb_b, a.bb_b), 0);
    cr_assert_eq(memcmp(r.mem_b + (size_t)db[i] * r.bb_b, b.mem_b + (size_t)sb[i] * b.bb_b, b.bb_b), 0);
  }
  td_kvx_disconnect(pa);
  td_kvx_disconnect(pb);
  side_close(&a);
  side_close(&b);
  side_close(&r);
}

/* The receiver stops progressing after granting: the sender times out and
 * aborts the communicator; the receiver, once it runs again, ends the grant
 * with an error and frees its slots; a new transfer then works (new
 * communicator). */
Test(kvx_nccl, receiver_stalls_then_recovery, .timeout = 120) {
  side s, r;
  side_open(&s, "nccl-s", 0, 4096, small_block(), large_block(), 8);
  side_open(&r, "nccl-r", 1, 4096, small_block(), large_block(), 800);
  td_kvx_peer *p = link_to(&s, &r);
  int32_t src[NB], dst[NB];
  ids(40, true, true, src, dst);
  td_kvx_xfer x = {9, 0, POOL_B, POOL_B, src, dst, 40, 400, TD_KVX_NCCL, NULL, {0}};
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(p, &x, kt_done_cb, &d, NULL), TD_OK, "%s", td_errmsg());
  while (r.rx.grants == 0) {
    td_kvx_progress(s.k);
    td_kvx_progress(r.k);
  }
  for (int i = 0; i < 20; i++) { /* the receiver posts its first receives, then stops */
    td_kvx_progress(s.k);
    td_kvx_progress(r.k);
  }
  td_kvx *ks1[1] = {s.k};
  cr_assert(kt_drive(ks1, 1, &d.calls, 10000));
  cr_assert_eq(d.status, TD_ERR_TIMEOUT, "%s: %s", td_status_str(d.status), d.msg);
  cr_assert_eq(r.rx.events, 0);
  td_kvx *ks2[1] = {r.k};
  cr_assert(kt_drive(ks2, 1, &r.rx.events, 10000), "the grant never ended");
  cr_assert_neq(r.rx.last_status, TD_OK);
  td_kvx_stats st = td_kvx_get_stats(r.k);
  cr_assert_eq(st.grants, 0);
  /* The same peer handle makes a new communicator; the slots came back. */
  move(&s, &r, p, POOL_B, 40, true, true);
  move(&s, &r, p, POOL, 40, true, true);
  td_kvx_disconnect(p);
  side_close(&s);
  side_close(&r);
}

/* Cancelling mid-transfer aborts the communicator on both sides; the next
 * transfer runs on a new one. */
Test(kvx_nccl, cancel_mid_transfer, .timeout = 120) {
  side s, r;
  side_open(&s, "nccl-s", 0, 4096, small_block(), large_block(), 9);
  side_open(&r, "nccl-r", 1, 4096, small_block(), large_block(), 900);
  td_kvx_peer *p = link_to(&s, &r);
  int32_t src[NB], dst[NB];
  ids(50, true, true, src, dst);
  td_kvx_xfer x = {10, 0, POOL_B, POOL_B, src, dst, 50, 20000, TD_KVX_NCCL, NULL, {0}};
  kt_done d = {0};
  uint64_t id;
  cr_assert_eq(td_kvx_post(p, &x, kt_done_cb, &d, &id), TD_OK, "%s", td_errmsg());
  while (r.rx.grants == 0) {
    td_kvx_progress(s.k);
    td_kvx_progress(r.k);
  }
  for (int i = 0; i < 6; i++) {
    td_kvx_progress(s.k);
    td_kvx_progress(r.k);
  }
  cr_assert_eq(d.calls, 0);
  cr_assert_eq(td_kvx_cancel(s.k, id), TD_OK);
  td_kvx *ks[2] = {s.k, r.k};
  cr_assert(kt_drive(ks, 2, &d.calls, 10000));
  cr_assert_eq(d.status, TD_ERR_CANCELLED, "%s", d.msg);
  cr_assert(kt_drive(ks, 2, &r.rx.events, 10000));
  cr_assert_neq(r.rx.last_status, TD_OK);
  cr_assert_lt(r.rx.last_bytes, (uint64_t)50 * r.bb_b);
  move(&s, &r, p, POOL_B, 50, true, true);
  td_kvx_disconnect(p);
  side_close(&s);
  side_close(&r);
}

/* Destroying both engines with transfers in flight leaks nothing (ASan). */
Test(kvx_nccl, destroy_mid_transfer, .timeout = 120) {
  side s, r;
  side_open(&s, "nccl-s", 0, 4096, small_block(), large_block(), 10);
  side_open(&r, "nccl-r", 1, 4096, small_block(), large_block(), 1000);
  td_kvx_peer *p = link_to(&s, &r);
  int32_t src[NB], dst[NB];
  ids(50, true, true, src, dst);
  td_kvx_xfer x = {11, 0, POOL_B, POOL_B, src, dst, 50, 20000, TD_KVX_NCCL, NULL, {0}};
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(p, &x, kt_done_cb, &d, NULL), TD_OK, "%s", td_errmsg());
  while (r.rx.grants == 0) {
    td_kvx_progress(s.k);
    td_kvx_progress(r.k);
  }
  for (int i = 0; i < 6; i++) {
    td_kvx_progress(s.k);
    td_kvx_progress(r.k);
  }
  td_kvx_disconnect(p);
  side_close(&r);
  side_close(&s);
  cr_assert_eq(d.calls, 1);
  cr_assert_neq(d.status, TD_OK);
}
