/* CUDA IPC between GPU pools, over the fake GPU (gpu_fake.c): shareable
 * "device memory" is a memfd that a peer maps from its handle, in this
 * process or another, and copies into a mapped pool run only when their
 * event completes, so DONE or ABORT sent before the copies ended, or a
 * mapping closed under a copy, shows up as wrong bytes or a counted
 * violation. Every re-slicing case, one and two processes, cancel and
 * timeout mid-copy, a receiver killed mid-copy, the fallbacks to the
 * staged path, the choice among IPC, NCCL and staged UCX. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu_fake.h"
#include "kvtransfer/gpu.h"
#include "kvtransfer/wire.h"
#include "kvx_testutil.h"

#include <criterion/redirect.h>

enum { GPU = 2, GPU2 = 3 };

typedef struct side {
  kt_rx rx; /* first: kt_on_recv's context */
  td_kvx *k;
  uint8_t *alloc, *mem; /* mem: the pool, at an offset in alloc */
  bool shared;
  size_t bb, off;
  int nb;
  uint8_t *snap; /* the pool at the last recv event */
} side;

typedef struct sopts {
  int device;
  bool no_ipc, malloced;
  size_t off; /* the pool's offset in its allocation */
  int pieces; /* td_kvx_opts.ipc_chunk_pieces */
} sopts;

static void on_recv(void *ctx, const td_kvx_recv_event *ev) {
  side *s = ctx;
  kt_on_recv(&s->rx, ev);
  memcpy(s->snap, s->mem, s->bb * (size_t)s->nb);
}

static void side_open(side *s, const char *name, td_kvx_geom g, int nb, sopts so, uint64_t seed) {
  memset(s, 0, sizeof *s);
  td_kvx_opts o = kt_opts(name, &s->rx);
  o.on_recv = on_recv;
  o.ctx = s;
  o.cuda_device = so.device;
  o.no_ipc = so.no_ipc;
  o.ipc_chunk_pieces = so.pieces;
  o.staging_slots = 3;
  o.staging_slot_bytes = 40 << 10;
  cr_assert_eq(td_kvx_create(&o, &s->k), TD_OK, "%s", td_errmsg());
  s->bb = td_kvx_block_bytes(&g);
  s->nb = nb;
  s->off = so.off;
  s->shared = !so.malloced;
  size_t bytes = s->bb * (size_t)nb + so.off + 512;
  s->alloc = s->shared ? kvx_fake_dev_alloc(bytes) : malloc(bytes);
  cr_assert_not_null(s->alloc);
  s->mem = s->alloc + so.off;
  s->snap = malloc(s->bb * (size_t)nb);
  kt_fill_random(s->alloc, bytes, seed);
  td_kvx_pool_desc d = {GPU, TD_KVX_MEM_CUDA, s->mem, nb, g};
  cr_assert_eq(td_kvx_register_pool(s->k, &d), TD_OK, "%s", td_errmsg());
}

static void side_close(side *s) {
  td_kvx_destroy(s->k);
  if (s->shared)
    kvx_fake_dev_free(s->alloc);
  else
    free(s->alloc);
  free(s->snap);
}

static uint8_t *export_of(side *s, size_t *n) {
  uint8_t *desc;
  cr_assert_eq(td_kvx_export(s->k, &desc, n), TD_OK);
  return desc;
}

static td_kvx_peer *link_to(side *from, side *to) {
  size_t n;
  uint8_t *desc = export_of(to, &n);
  td_kvx_peer *p;
  cr_assert_eq(td_kvx_connect(from->k, desc, n, &p), TD_OK, "%s", td_errmsg());
  free(desc);
  return p;
}

/* What the receiver's pool must hold after src blocks went to dst blocks:
 * its old bytes with the plan's slices of each source block (a CPU
 * reference of the re-slicing). */
static uint8_t *expected(const side *s, const td_kvx_geom *sg, const side *r, const td_kvx_geom *rg,
                         const int32_t *src, const int32_t *dst, int n) {
  size_t rbytes = r->bb * (size_t)r->nb;
  uint8_t *want = malloc(rbytes);
  memcpy(want, r->mem, rbytes);
  td_kvx_slice sl[256];
  int ns = 0;
  cr_assert_eq(td_kvx_slice_plan(sg, rg, sl, 256, &ns), TD_OK, "%s", td_errmsg());
  for (int i = 0; i < n; i++)
    for (int j = 0; j < ns; j++)
      memcpy(want + (size_t)dst[i] * r->bb + sl[j].dst_off, s->mem + (size_t)src[i] * s->bb + sl[j].src_off,
             sl[j].len);
  return want;
}

/* Posts src -> dst over transport tr and checks every byte of the
 * receiver's pool (moved blocks and untouched ones alike). */
static void move(side *s, const td_kvx_geom *sg, side *r, const td_kvx_geom *rg, td_kvx_peer *p,
                 td_kvx_transport tr, const int32_t *src, const int32_t *dst, int n) {
  uint8_t *want = expected(s, sg, r, rg, src, dst, n);
  td_kvx_xfer x = {77, 0, GPU, GPU, src, dst, n, 20000, tr, NULL, {0}};
  kt_move(s->k, r->k, &r->rx, p, &x, "move");
  for (size_t b = 0; b < (size_t)r->nb; b++)
    cr_assert_eq(memcmp(r->mem + b * r->bb, want + b * r->bb, r->bb), 0, "receiver block %zu differs", b);
  cr_assert_eq(memcmp(r->snap, r->mem, r->bb * (size_t)r->nb), 0, "written after the recv event");
  free(want);
}

/* A scattered block list: a contiguous run (merged copies), then scattered. */
static void blocks(int32_t *src, int32_t *dst, int n, int nb_src, int nb_dst) {
  for (int i = 0; i < n; i++) {
    src[i] = (i * 7 + 3) % nb_src;
    dst[i] = i < n / 3 ? nb_dst - n / 3 + i : ((i - n / 3) * 5) % (nb_dst - n / 3);
  }
}

static td_kvx_geom with_states(td_kvx_geom g, int w) {
  g.layout.states = w;
  return g;
}

/* Every re-slicing case of the staged tests and more: the same ranges,
 * other layers (pipeline), other heads (tensor), both, a states tail, a
 * pool of states only; each from the sender's whole block, AUTO and IPC
 * alike, into a pool placed at an offset in its allocation. */
Test(kvx_ipc, every_geometry_in_one_process, .timeout = 120) {
  td_kvx_geom full = kt_geom(0, 4, 0, 8, 8, 4, 2);
  struct {
    td_kvx_geom s, r;
  } cases[] = {
      {full, full},
      {full, kt_geom(2, 4, 0, 8, 8, 4, 2)},
      {full, kt_geom(0, 4, 4, 8, 8, 4, 2)},
      {full, kt_geom(1, 3, 2, 6, 8, 4, 2)},
      {kt_geom(2, 4, 0, 4, 8, 4, 2), kt_geom(0, 4, 0, 8, 8, 4, 2)}, /* a shard into a whole block */
      {with_states(full, 32), with_states(kt_geom(2, 4, 4, 8, 8, 4, 2), 32)},
      {with_states(full, 32), with_states(kt_geom(0, 0, 0, 8, 8, 4, 2), 32)},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    side s, r;
    side_open(&s, "ipc-s", cases[c].s, 40, (sopts){0}, 10 + c);
    side_open(&r, "ipc-r", cases[c].r, 48, (sopts){.off = 8192 + 64 * c}, 100 + c);
    td_kvx_peer *p = link_to(&s, &r);
    int32_t src[30], dst[30];
    blocks(src, dst, 30, 40, 48);
    move(&s, &cases[c].s, &r, &cases[c].r, p, TD_KVX_AUTO, src, dst, 30);
    move(&s, &cases[c].s, &r, &cases[c].r, p, TD_KVX_IPC, src + 20, dst + 20, 10);
    td_kvx_stats st = td_kvx_get_stats(s.k);
    cr_assert_eq(st.ipc_xfers, 2, "case %zu: %" PRIu64 " IPC transfers", c, st.ipc_xfers);
    cr_assert_eq(st.ipc_blocks, 40);
    cr_assert_eq(st.nccl_xfers, 0);
    cr_assert_eq(st.xfers_ok, 2);
    cr_assert_eq(td_kvx_get_stats(r.k).grants_ok, 2);
    cr_assert_eq(kvx_fake_ipc_mapped(), 1);
    td_kvx_disconnect(p);
    cr_assert_eq(kvx_fake_ipc_mapped(), 0, "mapping left after disconnect");
    side_close(&s);
    side_close(&r);
  }
  cr_assert_eq(kvx_fake_ipc_violations(), 0);
}

/* Many small scattered pieces: several chunks in flight, polled (the
 * context must not sleep meanwhile), then more issued as they complete;
 * chunks of 1,000 pieces (the default) or of 16 (ipc_chunk_pieces). */
static void many_chunks(int pieces) {
  td_kvx_geom g = kt_geom(0, 1, 0, 1, 16, 8, 2); /* 512-byte blocks */
  side s, r;
  side_open(&s, "ipc-s", g, 7001, (sopts){.pieces = pieces}, 1);
  side_open(&r, "ipc-r", g, 7001, (sopts){0}, 2);
  td_kvx_peer *p = link_to(&s, &r);
  static int32_t src[6000], dst[6000];
  for (int i = 0; i < 6000; i++) {
    src[i] = (i * 7) % 7001;
    dst[i] = (i * 11) % 7001; /* every piece apart: 6000 copies, 8 chunks (32, 250, then 1000s: KVX_IPC_RAMP) */
  }
  uint8_t *want = expected(&s, &g, &r, &g, src, dst, 6000);
  td_kvx_xfer x = {1, 0, GPU, GPU, src, dst, 6000, 20000, TD_KVX_IPC, NULL, {0}};
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(p, &x, kt_done_cb, &d, NULL), TD_OK, "%s", td_errmsg());
  int most = 0;
  bool slept_in_flight = false;
  while (!d.calls) {
    td_kvx_progress(s.k);
    td_kvx_progress(r.k);
    int ops = td_kvx_get_stats(s.k).ipc_chunks;
    if (ops > most) most = ops;
    if (ops > 0 && td_kvx_arm(s.k)) slept_in_flight = true;
  }
  cr_assert_eq(d.status, TD_OK, "%s", d.msg);
  cr_assert_not(slept_in_flight, "td_kvx_arm let the loop sleep with copies in flight");
  cr_assert_geq(most, 2, "chunks never overlapped");
  cr_assert_leq(most, 4, "more chunks in flight than the window");
  td_kvx *ks[2] = {s.k, r.k};
  cr_assert(kt_drive(ks, 2, &r.rx.events, 5000));
  cr_assert_eq(memcmp(r.mem, want, r.bb * 7001), 0);
  free(want);
  td_kvx_disconnect(p);
  side_close(&s);
  side_close(&r);
}

Test(kvx_ipc, many_chunks_polled, .timeout = 120) { many_chunks(0); }
Test(kvx_ipc, many_small_chunks_polled, .timeout = 120) { many_chunks(16); }

/* A transfer stopped while its copies are in flight (cancel, a
 * disconnect, or its deadline while the loop was busy elsewhere): the stop
 * waits for the copies, then ABORT; the receiver's event comes after the
 * last write, and the mapping goes after the copies. */
typedef enum { CANCEL, DISCONNECT, DEADLINE } stop_how;

static void stop_mid_copy(stop_how how) {
  bool cancel = how != DEADLINE;
  td_kvx_geom g = kt_geom(0, 1, 0, 1, 16, 8, 2);
  side s, r;
  side_open(&s, "ipc-s", g, 600, (sopts){0}, 3);
  side_open(&r, "ipc-r", g, 600, (sopts){0}, 4);
  td_kvx_peer *p = link_to(&s, &r);
  static int32_t src[500], dst[500];
  for (int i = 0; i < 500; i++) {
    src[i] = i;
    dst[i] = (i * 7) % 600;
  }
  td_kvx_xfer x = {2, 0, GPU, GPU, src, dst, 500, cancel ? 20000 : 300, TD_KVX_IPC, NULL, {0}};
  kt_done d = {0};
  uint64_t id;
  cr_assert_eq(td_kvx_post(p, &x, kt_done_cb, &d, &id), TD_OK, "%s", td_errmsg());
  while (r.rx.grants == 0) {
    td_kvx_progress(s.k);
    td_kvx_progress(r.k);
  }
  int64_t end = td_now_ms() + 5000;
  while (td_kvx_get_stats(s.k).ipc_chunks == 0 && td_now_ms() < end) td_kvx_progress(s.k);
  cr_assert_gt(td_kvx_get_stats(s.k).ipc_chunks, 0, "no copy in flight");
  if (how == CANCEL)
    cr_assert_eq(td_kvx_cancel(s.k, id), TD_OK);
  else if (how == DISCONNECT)
    td_kvx_disconnect(p);
  else
    usleep(400 * 1000); /* past the deadline, copies still pending */
  td_kvx *ks[2] = {s.k, r.k};
  cr_assert(kt_drive(ks, 2, &d.calls, 20000));
  cr_assert_eq(d.status, cancel ? TD_ERR_CANCELLED : TD_ERR_TIMEOUT, "%s", d.msg);
  cr_assert(kt_drive(ks, 2, &r.rx.events, 20000));
  cr_assert_eq(r.rx.last_status, cancel ? TD_ERR_CANCELLED : TD_ERR_TIMEOUT, "%s", r.rx.last_msg);
  cr_assert_not(td_kvx_reservation_busy(r.k, 0));
  cr_assert_eq(td_kvx_get_stats(s.k).ipc_chunks, 0);
  /* Nothing lands after the event: not while the sender winds down, not
   * when its context (and the fake's queued copies) go. */
  for (int i = 0; i < 50; i++) td_kvx_progress(s.k);
  if (how != DISCONNECT) td_kvx_disconnect(p);
  cr_assert_eq(kvx_fake_ipc_mapped(), 0);
  side_close(&s);
  cr_assert_eq(memcmp(r.snap, r.mem, r.bb * 600), 0, "written after the recv event");
  cr_assert_eq(kvx_fake_ipc_violations(), 0);
  side_close(&r);
}

/* A chunk's copies issued but its event not recorded: the transfer fails,
 * and its ABORT (so the receiver's event) still comes after those copies. */
Test(kvx_ipc, failed_event_record, .timeout = 120) {
  td_kvx_geom g = kt_geom(0, 1, 0, 1, 16, 8, 2);
  side s, r;
  side_open(&s, "ipc-s", g, 600, (sopts){0}, 5);
  side_open(&r, "ipc-r", g, 600, (sopts){0}, 6);
  td_kvx_peer *p = link_to(&s, &r);
  static int32_t src[500], dst[500];
  for (int i = 0; i < 500; i++) {
    src[i] = i;
    dst[i] = (i * 7) % 600;
  }
  kvx_fake_fail_record(KVX_S_IPC);
  td_kvx_xfer x = {3, 0, GPU, GPU, src, dst, 500, 20000, TD_KVX_IPC, NULL, {0}};
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(p, &x, kt_done_cb, &d, NULL), TD_OK, "%s", td_errmsg());
  td_kvx *ks[2] = {s.k, r.k};
  cr_assert(kt_drive(ks, 2, &d.calls, 20000));
  kvx_fake_fail_record(-1);
  cr_assert_eq(d.status, TD_ERR_CUDA, "%s", d.msg);
  cr_assert(kt_drive(ks, 2, &r.rx.events, 20000));
  cr_assert_neq(r.rx.last_status, TD_OK);
  td_kvx_disconnect(p);
  for (int i = 0; i < 50; i++) td_kvx_progress(s.k);
  side_close(&s);
  cr_assert_eq(kvx_fake_ipc_violations(), 0, "a mapping closed under a copy");
  cr_assert_eq(memcmp(r.snap, r.mem, r.bb * 600), 0, "written after the recv event");
  side_close(&r);
}

Test(kvx_ipc, cancel_mid_copy, .timeout = 120) { stop_mid_copy(CANCEL); }
Test(kvx_ipc, disconnect_mid_copy, .timeout = 120) { stop_mid_copy(DISCONNECT); }
Test(kvx_ipc, timeout_mid_copy, .timeout = 120) { stop_mid_copy(DEADLINE); }

/* The receiver authorises IPC writes too: a sender whose descriptor (a
 * forged one here) maps another pool's allocation for a pool the receiver
 * never exported is denied, and nothing is written. */
Test(kvx_ipc, receiver_refuses_ipc_into_a_pool_it_did_not_export, .timeout = 120) {
  td_kvx_geom g = kt_geom(0, 2, 0, 4, 16, 8, 2);
  side s, r;
  side_open(&s, "ipc-s", g, 16, (sopts){0}, 13);
  side_open(&r, "ipc-r", g, 16, (sopts){0}, 14);
  uint8_t *other = malloc(r.bb * 16);
  kt_fill_random(other, r.bb * 16, 15);
  td_kvx_pool_desc d2 = {GPU2, TD_KVX_MEM_CUDA, other, 16, g};
  cr_assert_eq(td_kvx_register_pool(r.k, &d2), TD_OK, "%s", td_errmsg());
  size_t n;
  uint8_t *desc = export_of(&r, &n), *forged;
  kvx_desc kd;
  cr_assert_eq(kvx_desc_decode(desc, n, &kd), TD_OK);
  int shared = kd.pools[0].info.pool_id == GPU ? 0 : 1;
  cr_assert(kd.pools[shared].info.ipc);
  cr_assert_not(kd.pools[1 - shared].info.ipc);
  kd.pools[1 - shared].info.ipc = true;
  kd.pools[1 - shared].ipc_handle = kd.pools[shared].ipc_handle;
  kd.pools[1 - shared].ipc_off = kd.pools[shared].ipc_off;
  cr_assert_eq(kvx_desc_encode(&kd, &forged, &n), TD_OK);
  td_kvx_peer *p;
  cr_assert_eq(td_kvx_connect(s.k, forged, n, &p), TD_OK, "%s", td_errmsg());
  free(desc);
  free(forged);
  uint8_t *before = malloc(r.bb * 16);
  memcpy(before, r.mem, r.bb * 16);
  int32_t ids[4] = {0, 5, 9, 12};
  td_kvx_xfer x = {8, 0, GPU, GPU2, ids, ids, 4, 20000, TD_KVX_IPC, NULL, {0}};
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(p, &x, kt_done_cb, &d, NULL), TD_OK, "%s", td_errmsg());
  td_kvx *ks[2] = {s.k, r.k};
  cr_assert(kt_drive(ks, 2, &d.calls, 20000));
  cr_assert_eq(d.status, TD_ERR_INVALID, "%s: %s", td_status_str(d.status), d.msg);
  cr_assert(strstr(d.msg, "no CUDA IPC into pool"), "%s", d.msg);
  cr_assert_eq(r.rx.grants, 0);
  cr_assert_eq(memcmp(before, r.mem, r.bb * 16), 0, "written without a grant");
  free(before);
  td_kvx_disconnect(p);
  side_close(&s);
  side_close(&r);
  free(other);
}

/* The receiver checks every destination block of a request, whatever the
 * path (it may come from a sender that does not): one asked twice, or one
 * past its pool (a forged descriptor claims more blocks), is denied with
 * nothing written; its scratch of seen blocks is clear afterwards, so a
 * valid request to the same blocks is granted. */
Test(kvx_ipc, receiver_checks_every_destination_block, .timeout = 120) {
  td_kvx_geom g = kt_geom(0, 2, 0, 4, 16, 8, 2);
  side s, r;
  side_open(&s, "ipc-s", g, 64, (sopts){0}, 16);
  side_open(&r, "ipc-r", g, 64, (sopts){0}, 17);
  size_t n;
  uint8_t *desc = export_of(&r, &n), *forged;
  kvx_desc kd;
  cr_assert_eq(kvx_desc_decode(desc, n, &kd), TD_OK);
  kd.pools[0].info.n_blocks = 100; /* more than the receiver has: the sender's own check passes */
  kd.pools[0].info.ipc = false;    /* no mapping to bound it either: UCX */
  cr_assert_eq(kvx_desc_encode(&kd, &forged, &n), TD_OK);
  td_kvx_peer *p = link_to(&s, &r), *pf;
  cr_assert_eq(td_kvx_connect(s.k, forged, n, &pf), TD_OK, "%s", td_errmsg());
  free(desc);
  free(forged);
  uint8_t *before = malloc(r.bb * 64);
  memcpy(before, r.mem, r.bb * 64);
  td_kvx *ks[2] = {s.k, r.k};
  static const struct {
    td_kvx_transport tr;
    bool forged;
    int32_t dst[5];
    const char *why;
  } bad[] = {{TD_KVX_IPC, false, {3, 9, 40, 9, 11}, "destination block 9 appears twice"},
             {TD_KVX_UCX, false, {3, 9, 40, 9, 11}, "destination block 9 appears twice"},
             {TD_KVX_UCX, true, {3, 70, 40, 9, 11}, "block 70 outside pool"}};
  int32_t src[5] = {0, 1, 2, 3, 4};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    td_kvx_xfer x = {9, 0, GPU, GPU, src, bad[i].dst, 5, 20000, bad[i].tr, NULL, {0}};
    kt_done d = {0};
    cr_assert_eq(td_kvx_post(bad[i].forged ? pf : p, &x, kt_done_cb, &d, NULL), TD_OK, "%s", td_errmsg());
    cr_assert(kt_drive(ks, 2, &d.calls, 20000));
    cr_assert_neq(d.status, TD_OK, "case %zu granted", i);
    cr_assert(strstr(d.msg, bad[i].why), "case %zu: %s", i, d.msg);
  }
  cr_assert_eq(r.rx.grants, 0);
  cr_assert_eq(memcmp(before, r.mem, r.bb * 64), 0, "written without a grant");
  int32_t good[5] = {3, 9, 40, 10, 11};
  move(&s, &g, &r, &g, p, TD_KVX_IPC, src, good, 5);
  move(&s, &g, &r, &g, p, TD_KVX_UCX, src, good, 5);
  free(before);
  td_kvx_disconnect(p);
  td_kvx_disconnect(pf);
  side_close(&s);
  side_close(&r);
}

/* The application's ready event: the copies wait for the work that
 * produced the source blocks (here a queued device copy on another
 * context's stream, which runs only when something waits for it). */
Test(kvx_ipc, copies_wait_for_the_ready_event, .timeout = 120) {
  td_kvx_geom g = kt_geom(0, 2, 0, 4, 16, 8, 2);
  side s, r;
  side_open(&s, "ipc-s", g, 16, (sopts){0}, 5);
  side_open(&r, "ipc-r", g, 16, (sopts){0}, 6);
  td_kvx_peer *p = link_to(&s, &r);
  uint8_t *fresh = malloc(s.bb * 8);
  kt_fill_random(fresh, s.bb * 8, 77);
  kvx_gpu *app;
  cr_assert_eq(kvx_gpu_create(0, &app), TD_OK);
  void *dsts[1] = {s.mem};
  const void *srcs[1] = {fresh};
  size_t sizes[1] = {s.bb * 8};
  void *ready;
  cr_assert_eq(kvx_gpu_copy_d2d(app, KVX_S_GATHER, dsts, srcs, sizes, 1), TD_OK);
  cr_assert_eq(kvx_gpu_record(app, KVX_S_GATHER, &ready), TD_OK);
  int32_t src[8] = {0, 1, 2, 3, 4, 5, 6, 7}, dst[8] = {15, 3, 9, 1, 12, 6, 0, 10};
  td_kvx_xfer x = {3, 0, GPU, GPU, src, dst, 8, 20000, TD_KVX_AUTO, ready, {0}};
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(p, &x, kt_done_cb, &d, NULL), TD_OK, "%s", td_errmsg());
  td_kvx *ks[2] = {s.k, r.k};
  cr_assert(kt_drive(ks, 2, &d.calls, 20000));
  cr_assert_eq(d.status, TD_OK, "%s", d.msg);
  cr_assert_eq(td_kvx_get_stats(s.k).ipc_xfers, 1);
  for (int i = 0; i < 8; i++)
    cr_assert_eq(memcmp(r.mem + (size_t)dst[i] * r.bb, fresh + (size_t)i * s.bb, r.bb), 0,
                 "block %d copied before its ready event", i);
  kvx_gpu_release(app, ready);
  kvx_gpu_destroy(app);
  free(fresh);
  td_kvx_disconnect(p);
  side_close(&s);
  side_close(&r);
}

/* Two GPUs of the host: AUTO prefers IPC over NCCL; NCCL and UCX when
 * asked for; all three deliver the same bytes. */
Test(kvx_ipc, choice_between_two_gpus, .timeout = 120) {
  td_kvx_geom g = kt_geom(0, 2, 0, 4, 16, 8, 2);
  side s, r;
  side_open(&s, "ipc-s", g, 48, (sopts){.device = 0}, 7);
  side_open(&r, "ipc-r", g, 48, (sopts){.device = 1}, 8);
  td_kvx_peer *p = link_to(&s, &r);
  int32_t src[30], dst[30];
  blocks(src, dst, 30, 48, 48);
  move(&s, &g, &r, &g, p, TD_KVX_AUTO, src, dst, 30);
  td_kvx_stats st = td_kvx_get_stats(s.k);
  cr_assert_eq(st.ipc_xfers, 1);
  cr_assert_eq(st.nccl_xfers, 0);
  blocks(dst, src, 30, 48, 48);
  move(&s, &g, &r, &g, p, TD_KVX_NCCL, src, dst, 30);
  st = td_kvx_get_stats(s.k);
  cr_assert_eq(st.ipc_xfers, 1);
  cr_assert_eq(st.nccl_xfers, 1);
  move(&s, &g, &r, &g, p, TD_KVX_UCX, dst, src, 30);
  st = td_kvx_get_stats(s.k);
  cr_assert_eq(st.ipc_xfers, 1);
  cr_assert_eq(st.nccl_xfers, 1);
  cr_assert_eq(st.xfers_ok, 3);
  /* A transport that does not exist is refused. */
  td_kvx_xfer bad = {9, 0, GPU, GPU, src, dst, 1, 1000, (td_kvx_transport)7, NULL, {0}};
  cr_assert_eq(td_kvx_post(p, &bad, kt_done_cb, NULL, NULL), TD_ERR_INVALID);
  td_kvx_disconnect(p);
  side_close(&s);
  side_close(&r);
}

/* Peers that cannot do IPC get the staged path under AUTO and a clear
 * refusal when IPC is asked for; the log says why once per peer. */
typedef enum { NO_IPC_RECEIVER, NO_IPC_SENDER, OLD_DESCRIPTOR, OPEN_REFUSED, NOT_SHAREABLE, POOL_OUTSIDE } fallback;

static void run_fallback(fallback f) {
  td_kvx_geom g = kt_geom(0, 2, 0, 4, 16, 8, 2);
  side s, r;
  side_open(&s, "ipc-s", g, 48, (sopts){.no_ipc = f == NO_IPC_SENDER}, 11);
  side_open(&r, "ipc-r", g, 48, (sopts){.no_ipc = f == NO_IPC_RECEIVER, .malloced = f == NOT_SHAREABLE}, 12);
  size_t n;
  uint8_t *desc = export_of(&r, &n);
  kvx_desc kd;
  cr_assert_eq(kvx_desc_decode(desc, n, &kd), TD_OK, "%s", td_errmsg());
  cr_assert_eq(kd.pools[0].info.ipc, f != NO_IPC_RECEIVER && f != NOT_SHAREABLE);
  uint8_t *forged = NULL;
  if (f == OLD_DESCRIPTOR || f == POOL_OUTSIDE) {
    if (f == OLD_DESCRIPTOR) kd.version = 2;
    if (f == POOL_OUTSIDE) kd.pools[0].ipc_off += 1024; /* claims bytes past its allocation */
    cr_assert_eq(kvx_desc_encode(&kd, &forged, &n), TD_OK);
  }
  if (f == OPEN_REFUSED) kvx_fake_ipc_refuse(true);
  td_kvx_peer *p;
  cr_assert_eq(td_kvx_connect(s.k, forged ? forged : desc, n, &p), TD_OK, "%s", td_errmsg());
  free(desc);
  free(forged);
  int32_t src[30], dst[30];
  blocks(src, dst, 30, 48, 48);
  td_kvx_xfer x = {5, 0, GPU, GPU, src, dst, 30, 20000, TD_KVX_IPC, NULL, {0}};
  cr_assert_eq(td_kvx_post(p, &x, kt_done_cb, NULL, NULL), TD_ERR_UNSUPPORTED);
  cr_log_info("IPC refused: %s", td_errmsg());
  if (f == POOL_OUTSIDE) cr_assert(strstr(td_errmsg(), "outside"), "%s", td_errmsg());
  move(&s, &g, &r, &g, p, TD_KVX_AUTO, src, dst, 30);
  blocks(dst, src, 30, 48, 48);
  move(&s, &g, &r, &g, p, TD_KVX_AUTO, src, dst, 30);
  td_kvx_stats st = td_kvx_get_stats(s.k);
  cr_assert_eq(st.ipc_xfers, 0);
  cr_assert_eq(st.xfers_ok, 2);
  cr_assert_eq(kvx_fake_ipc_mapped(), 0);
  kvx_fake_ipc_refuse(false);
  td_kvx_disconnect(p);
  side_close(&s);
  side_close(&r);
}

/* The reason is logged once per peer (the sender's own switch is not a
 * peer's doing: not logged). */
static void logged_once(const char *want, bool logged) {
  fflush(stderr);
  FILE *f = cr_get_redirected_stderr();
  char line[1024];
  int said = 0;
  bool match = false;
  while (fgets(line, sizeof line, f)) {
    if (!strstr(line, "no CUDA IPC (")) continue;
    said++;
    match |= strstr(line, want) != NULL;
  }
  cr_assert_eq(said, logged ? 1 : 0, "said %d times why IPC is off", said);
  if (logged) cr_assert(match, "the log does not say: %s", want);
}

Test(kvx_ipc, receiver_without_ipc, .init = cr_redirect_stderr, .timeout = 120) {
  run_fallback(NO_IPC_RECEIVER);
  logged_once("exports no IPC handles", true);
}
Test(kvx_ipc, sender_without_ipc, .init = cr_redirect_stderr, .timeout = 120) {
  run_fallback(NO_IPC_SENDER);
  logged_once("", false);
}
Test(kvx_ipc, old_descriptor, .init = cr_redirect_stderr, .timeout = 120) {
  run_fallback(OLD_DESCRIPTOR);
  logged_once("older build", true);
}
Test(kvx_ipc, handle_cannot_be_opened, .init = cr_redirect_stderr, .timeout = 120) {
  run_fallback(OPEN_REFUSED);
  logged_once("cudaIpcOpenMemHandle", true);
}
Test(kvx_ipc, pool_memory_not_shareable, .init = cr_redirect_stderr, .timeout = 120) {
  run_fallback(NOT_SHAREABLE);
  logged_once("no IPC handle for pool", true);
}
Test(kvx_ipc, pool_outside_its_allocation, .init = cr_redirect_stderr, .timeout = 120) {
  run_fallback(POOL_OUTSIDE);
  logged_once("outside the allocation", true);
}

/* ---- two processes (fork): the receiver is the child ---- */

enum { PNB = 3000, PN = 2500 /* pieces: chunks of 32, 250, 1000, 1000, 218 (KVX_IPC_RAMP) */ };

/* The child: a receiver with a shareable pool; sends its descriptor, then
 * either its pool after the recv event, or 'G' once it granted and hangs. */
static int receiver_child(int wfd, int rfd, bool hang) {
  td_kvx_geom g = kt_geom(0, 1, 0, 1, 16, 8, 2);
  side r;
  side_open(&r, "ipc-child", g, PNB, (sopts){.off = 4096}, 31);
  size_t n;
  uint8_t *desc = export_of(&r, &n);
  uint64_t len = n;
  if (write(wfd, &len, 8) != 8 || write(wfd, desc, n) != (ssize_t)n) return 33;
  free(desc);
  td_kvx *ks[1] = {r.k};
  if (hang) {
    if (!kt_drive(ks, 1, &r.rx.grants, 30000)) return 34;
    int64_t end = td_now_ms() + 2000;
    while (td_kvx_get_stats(r.k).ops > 0 && td_now_ms() < end) td_kvx_progress(r.k);
    if (write(wfd, "G", 1) != 1) return 35;
    for (;;) pause();
  }
  if (!kt_drive(ks, 1, &r.rx.events, 30000)) return 36;
  if (r.rx.last_status != TD_OK) return 37;
  size_t bytes = r.bb * PNB;
  if (write(wfd, r.mem, bytes) != (ssize_t)bytes) return 38;
  char c;
  if (read(rfd, &c, 1) != 1) return 39;
  side_close(&r);
  return 0;
}

typedef struct child {
  pid_t pid;
  int rd, wr;
} child;

static child spawn(bool hang) {
  int up[2], down[2];
  cr_assert_eq(pipe(up), 0);
  cr_assert_eq(pipe(down), 0);
  fflush(NULL);
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0) {
    close(up[0]);
    close(down[1]);
    _exit(receiver_child(up[1], down[0], hang));
  }
  close(up[1]);
  close(down[0]);
  return (child){pid, up[0], down[1]};
}

static td_kvx_peer *connect_child(side *s, child *c) {
  uint64_t len;
  cr_assert(kt_read_full(c->rd, &len, 8, NULL, 30000), "child did not start");
  cr_assert_lt(len, 1u << 20);
  uint8_t *desc = malloc(len);
  cr_assert(kt_read_full(c->rd, desc, len, NULL, 10000));
  td_kvx_peer *p;
  cr_assert_eq(td_kvx_connect(s->k, desc, len, &p), TD_OK, "%s", td_errmsg());
  free(desc);
  return p;
}

Test(kvx_ipc, two_processes, .timeout = 120) {
  td_kvx_geom g = kt_geom(0, 1, 0, 1, 16, 8, 2);
  child c = spawn(false);
  side s;
  side_open(&s, "ipc-parent", g, PNB, (sopts){0}, 32);
  td_kvx_peer *p = connect_child(&s, &c);
  static int32_t src[PN], dst[PN];
  for (int i = 0; i < PN; i++) {
    src[i] = (i * 7) % PNB;
    dst[i] = (i * 11 + 1) % PNB;
  }
  td_kvx_xfer x = {6, 0, GPU, GPU, src, dst, PN, 30000, TD_KVX_AUTO, NULL, {0}};
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(p, &x, kt_done_cb, &d, NULL), TD_OK, "%s", td_errmsg());
  td_kvx *ks[1] = {s.k};
  cr_assert(kt_drive(ks, 1, &d.calls, 30000));
  cr_assert_eq(d.status, TD_OK, "%s", d.msg);
  cr_assert_eq(td_kvx_get_stats(s.k).ipc_xfers, 1);
  uint8_t *got = malloc(s.bb * PNB);
  cr_assert(kt_read_full(c.rd, got, s.bb * PNB, s.k, 30000));
  for (int i = 0; i < PN; i++)
    cr_assert_eq(memcmp(got + (size_t)dst[i] * s.bb, s.mem + (size_t)src[i] * s.bb, s.bb), 0, "block %d", i);
  free(got);
  cr_assert_eq(write(c.wr, "q", 1), 1);
  int ws;
  while (waitpid(c.pid, &ws, WNOHANG) == 0) td_kvx_progress(s.k);
  cr_assert(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "child exit %d", WEXITSTATUS(ws));
  td_kvx_disconnect(p);
  cr_assert_eq(kvx_fake_ipc_mapped(), 0);
  side_close(&s);
  close(c.rd);
  close(c.wr);
}

/* The receiver dies with copies into its pool in flight: the sender ends
 * the transfer with a peer failure, waits for its copies (the mapping of a
 * dead process stays valid until closed), then closes the mapping. */
Test(kvx_ipc, receiver_killed_mid_copy, .timeout = 120) {
  td_kvx_geom g = kt_geom(0, 1, 0, 1, 16, 8, 2);
  child c = spawn(true);
  side s;
  side_open(&s, "ipc-parent", g, PNB, (sopts){0}, 33);
  td_kvx_peer *p = connect_child(&s, &c);
  static int32_t ids[PN];
  for (int i = 0; i < PN; i++) ids[i] = (i * 7) % PNB;
  td_kvx_xfer x = {7, 0, GPU, GPU, ids, ids, PN, 30000, TD_KVX_IPC, NULL, {0}};
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(p, &x, kt_done_cb, &d, NULL), TD_OK, "%s", td_errmsg());
  /* Progress until the grant arrived and the copies were issued, not a
   * poll more; the receiver says when it granted and hangs. */
  int64_t end = td_now_ms() + 30000;
  while (td_kvx_get_stats(s.k).ipc_chunks == 0 && td_now_ms() < end) td_kvx_progress(s.k);
  cr_assert_eq(td_kvx_get_stats(s.k).ipc_chunks, 4, "copies in flight: %d (the window)", td_kvx_get_stats(s.k).ipc_chunks);
  char gch;
  cr_assert(kt_read_full(c.rd, &gch, 1, NULL, 30000), "receiver never granted");
  cr_assert_eq(kvx_fake_ipc_mapped(), 1);
  kill(c.pid, SIGKILL);
  waitpid(c.pid, NULL, 0);
  usleep(100 * 1000); /* the closed socket is seen before any copy is polled again */
  td_kvx *ks[1] = {s.k};
  cr_assert(kt_drive(ks, 1, &d.calls, 20000), "no error after the receiver died");
  cr_assert_eq(d.status, TD_ERR_PEER, "%s: %s", td_status_str(d.status), d.msg);
  td_kvx_stats st = td_kvx_get_stats(s.k);
  cr_assert_lt(st.bytes_sent, (uint64_t)PN * s.bb, "the copies had all completed before the failure");
  cr_assert_eq(st.xfers, 0);
  cr_assert_leq(st.ops, st.orphan_ops);
  cr_assert_eq(kvx_fake_ipc_mapped(), 0, "the dead receiver's pool is still mapped");
  cr_assert_eq(kvx_fake_ipc_violations(), 0, "a mapping closed under a copy");
  cr_assert_eq(td_kvx_post(p, &x, kt_done_cb, &d, NULL), TD_ERR_PEER);
  td_kvx_disconnect(p);
  side_close(&s);
  close(c.rd);
  close(c.wr);
}
