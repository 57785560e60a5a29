/* The staged GPU path (device-to-host, puts into the receiver's staging
 * slots, CHUNK / CREDIT, host-to-device) with a fake GPU whose "device
 * memory" is host memory (gpu_fake.c): runs in CI without a GPU. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvx_testutil.h"

#include <criterion/redirect.h>

enum { HOST = 1, GPU = 2, NB = 48 };

typedef struct side {
  kt_rx rx;
  td_kvx *k;
  uint8_t *host, *gpu;
  size_t bb;
} side;

/* what the next side_open passes in td_kvx_opts.trace / ucx_tls */
static bool g_trace;
static const char *g_ucx_tls;

static void side_open(side *s, const char *name, td_kvx_geom g, td_kvx_local_path local, uint64_t seed) {
  memset(s, 0, sizeof *s);
  td_kvx_opts o = kt_opts(name, &s->rx);
  o.cuda_device = 0;
  o.local_path = local;
  o.trace = g_trace;
  o.ucx_tls = g_ucx_tls;
  o.staging_slots = 3;              /* fewer slots than chunks: credits cycle */
  o.staging_slot_bytes = 40 << 10;  /* not a multiple of the block size */
  cr_assert_eq(td_kvx_create(&o, &s->k), TD_OK, "%s", td_errmsg());
  s->bb = td_kvx_block_bytes(&g);
  s->host = malloc(s->bb * NB);
  s->gpu = malloc(s->bb * NB);
  kt_fill_random(s->host, s->bb * NB, seed);
  kt_fill_random(s->gpu, s->bb * NB, seed + 1);
  td_kvx_pool_desc h = {HOST, TD_KVX_MEM_HOST, s->host, NB, g}, d = {GPU, TD_KVX_MEM_CUDA, s->gpu, NB, g};
  cr_assert_eq(td_kvx_register_pool(s->k, &h), TD_OK, "%s", td_errmsg());
  cr_assert_eq(td_kvx_register_pool(s->k, &d), TD_OK, "%s", td_errmsg());
}

static void side_close(side *s) {
  td_kvx_destroy(s->k);
  free(s->host);
  free(s->gpu);
}

static td_kvx_peer *link_to(side *from, side *to) {
  uint8_t *desc;
  size_t n;
  cr_assert_eq(td_kvx_export(to->k, &desc, &n), TD_OK);
  td_kvx_desc_info info;
  cr_assert_eq(td_kvx_desc_parse(desc, n, &info), TD_OK);
  cr_assert(info.staging);
  cr_assert_eq(info.n_pools, 2);
  td_kvx_peer *p;
  cr_assert_eq(td_kvx_connect(from->k, desc, n, &p), TD_OK, "%s", td_errmsg());
  free(desc);
  return p;
}

static void move(side *s, side *r, td_kvx_peer *p, uint32_t sp, uint32_t rp) {
  int32_t src[NB], dst[NB];
  int n = 30;
  for (int i = 0; i < n; i++) {
    src[i] = (i * 7 + 3) % NB;
    dst[i] = (i < 10) ? 30 + i : ((i - 10) * 7) % 29; /* a contiguous run, then scattered */
  }
  /* Distinct destinations. */
  for (int i = 0; i < n; i++)
    for (int j = 0; j < i; j++) cr_assert_neq(dst[i], dst[j]);
  td_kvx_xfer x = {100 + sp * 10 + rp, 0, sp, rp, src, dst, n, 20000, TD_KVX_UCX, NULL, {0}};
  char what[32];
  snprintf(what, sizeof what, "%u -> %u", sp, rp);
  kt_move(s->k, r->k, &r->rx, p, &x, what);
  cr_assert_eq(r->rx.last_bytes, (uint64_t)n * r->bb);
  const uint8_t *sb = sp == HOST ? s->host : s->gpu, *rb = rp == HOST ? r->host : r->gpu;
  for (int i = 0; i < n; i++)
    cr_assert_eq(memcmp(rb + (size_t)dst[i] * r->bb, sb + (size_t)src[i] * s->bb, r->bb), 0,
                 "%u -> %u: block %d differs", sp, rp, i);
}

static void run_all_directions(td_kvx_local_path local) {
  td_kvx_geom g = kt_geom(0, 2, 0, 4, 16, 8, 2); /* 8 KiB blocks */
  side s, r;
  side_open(&s, "stg-s", g, local, 1);
  side_open(&r, "stg-r", g, local, 100);
  td_kvx_peer *p = link_to(&s, &r);
  move(&s, &r, p, GPU, GPU);
  move(&s, &r, p, HOST, GPU);
  move(&s, &r, p, GPU, HOST);
  move(&s, &r, p, HOST, HOST);
  td_kvx_stats st = td_kvx_get_stats(s.k);
  cr_assert_eq(st.xfers_ok, 4);
  cr_assert_eq(st.ops, 0);
  td_kvx_disconnect(p);
  side_close(&s);
  side_close(&r);
}

Test(kvx_staged, every_direction_with_puts, .timeout = 120) { run_all_directions(TD_KVX_LOCAL_AUTO); }
Test(kvx_staged, every_direction_with_messages, .timeout = 120) { run_all_directions(TD_KVX_LOCAL_OFF); }
/* td_kvx_opts.trace: each protocol step of a staged transfer is recorded
 * on both sides and printed at destroy, in time order per engine; the
 * copies' records add up to the transfer. */
static const char *trace_events[] = {"post_in", "post", "grant", "d2h", "d2h_done", "chunk", "credit", "done", "ack", "cb",
                                     "r_req", "r_grant", "r_chunk", "r_h2d_done", "r_done", "r_ack"};
enum { N_TRACE_EVENTS = sizeof trace_events / sizeof trace_events[0] };

Test(kvx_staged, trace_records_each_step, .init = cr_redirect_stderr, .timeout = 120) {
  g_trace = true;
  td_kvx_geom g = kt_geom(0, 2, 0, 4, 16, 8, 2);
  side s, r;
  side_open(&s, "trace-s", g, TD_KVX_LOCAL_AUTO, 1);
  side_open(&r, "trace-r", g, TD_KVX_LOCAL_AUTO, 100);
  g_trace = false;
  td_kvx_peer *p = link_to(&s, &r);
  move(&s, &r, p, GPU, GPU);
  uint64_t total = (uint64_t)30 * s.bb;
  td_kvx_disconnect(p);
  side_close(&s);
  side_close(&r);
  fflush(stderr);
  FILE *f = cr_get_redirected_stderr();
  char line[512], who[64], ev[32];
  long long ns, last[2] = {0, 0};
  unsigned long long xid, arg;
  int seen[N_TRACE_EVENTS] = {0};
  uint64_t d2h = 0, h2d = 0;
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, "kvx-trace ", 10) != 0) continue;
    cr_assert_eq(sscanf(line + 10, "%63s %lld %llu %31s %llu", who, &ns, &xid, ev, &arg), 5, "bad record: %s", line);
    int side_i = !strcmp(who, "trace-r");
    cr_assert(side_i || !strcmp(who, "trace-s"), "record of an unknown engine: %s", line);
    cr_assert_geq(ns, last[side_i], "records out of time order: %s", line);
    last[side_i] = ns;
    int e = -1;
    for (int i = 0; i < N_TRACE_EVENTS; i++)
      if (!strcmp(ev, trace_events[i])) e = i;
    cr_assert_geq(e, 0, "unknown event: %s", line);
    cr_assert_eq(side_i, e >= 10, "event on the wrong side: %s", line);
    seen[e]++;
    if (!strcmp(ev, "post")) cr_assert_eq(arg, total);
    if (!strcmp(ev, "d2h")) d2h += arg;
    if (!strcmp(ev, "r_h2d_done")) h2d += arg;
  }
  for (int i = 0; i < N_TRACE_EVENTS; i++) cr_assert_gt(seen[i], 0, "no %s record", trace_events[i]);
  cr_assert_eq(seen[0], 1);
  cr_assert_eq(seen[8], 1);
  cr_assert_eq(d2h, total);
  cr_assert_eq(h2d, total);
}

/* Without shared memory UCX cannot map the peer's staging: puts (CMA)
 * carry every chunk through the local staging slots. */
Test(kvx_staged, every_direction_without_mapping, .timeout = 120) {
  setenv("UCX_TLS", "tcp,cma", 1); /* for UCX itself */
  g_ucx_tls = "tcp,cma";
  run_all_directions(TD_KVX_LOCAL_AUTO);
  g_ucx_tls = NULL;
}

Test(kvx_staged, resliced_gpu_to_gpu, .timeout = 120) {
  td_kvx_geom sg = kt_geom(0, 4, 0, 8, 8, 4, 2), rg = kt_geom(2, 4, 0, 4, 8, 4, 2);
  side s, r;
  side_open(&s, "stg-s", sg, TD_KVX_LOCAL_AUTO, 3);
  side_open(&r, "stg-r", rg, TD_KVX_LOCAL_AUTO, 300);
  td_kvx_peer *p = link_to(&s, &r);
  int32_t src[20], dst[20];
  for (int i = 0; i < 20; i++) {
    src[i] = i;
    dst[i] = NB - 1 - i;
  }
  td_kvx_xfer x = {1, 0, GPU, GPU, src, dst, 20, 20000, TD_KVX_AUTO, NULL, {0}};
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(p, &x, kt_done_cb, &d, NULL), TD_OK, "%s", td_errmsg());
  td_kvx *ks[2] = {s.k, r.k};
  cr_assert(kt_drive(ks, 2, &d.calls, 20000));
  cr_assert_eq(d.status, TD_OK, "%s", d.msg);
  size_t row = 4 * 8 * 2;
  for (int i = 0; i < 20; i++)
    for (int l = 2; l < 4; l++)
      for (int kv = 0; kv < 2; kv++)
        for (int h = 0; h < 4; h++)
          cr_assert_eq(memcmp(r.gpu + (size_t)dst[i] * r.bb + (((size_t)(l - 2) * 2 + (size_t)kv) * 4 + (size_t)h) * row,
                              s.gpu + (size_t)src[i] * s.bb + (((size_t)l * 2 + (size_t)kv) * 8 + (size_t)h) * row, row),
                       0);
  td_kvx_disconnect(p);
  side_close(&s);
  side_close(&r);
}

/* Cancelling a staged transfer that waits for credits the receiver never
 * returns (it stopped progressing), then letting the receiver resume. */
Test(kvx_staged, cancel_waiting_for_credits, .timeout = 120) {
  td_kvx_geom g = kt_geom(0, 2, 0, 4, 16, 8, 2);
  side s, r;
  side_open(&s, "stg-s", g, TD_KVX_LOCAL_AUTO, 5);
  side_open(&r, "stg-r", g, TD_KVX_LOCAL_AUTO, 500);
  td_kvx_peer *p = link_to(&s, &r);
  int32_t ids[NB];
  for (int i = 0; i < NB; i++) ids[i] = i;
  td_kvx_xfer x = {2, 0, GPU, GPU, ids, ids, NB, 20000, TD_KVX_UCX, NULL, {0}};
  kt_done d = {0};
  uint64_t id;
  cr_assert_eq(td_kvx_post(p, &x, kt_done_cb, &d, &id), TD_OK);
  while (r.rx.grants == 0) {
    td_kvx_progress(s.k);
    td_kvx_progress(r.k);
  }
  for (int i = 0; i < 200; i++) td_kvx_progress(s.k); /* uses up the granted slots */
  cr_assert_eq(d.calls, 0);
  cr_assert_gt(td_kvx_get_stats(s.k).bytes_sent, 0);
  cr_assert_eq(td_kvx_cancel(s.k, id), TD_OK);
  td_kvx *ks[2] = {s.k, r.k};
  cr_assert(kt_drive(ks, 2, &d.calls, 20000));
  cr_assert_eq(d.status, TD_ERR_CANCELLED);
  cr_assert(kt_drive(ks, 2, &r.rx.events, 20000));
  cr_assert_eq(r.rx.last_status, TD_ERR_CANCELLED, "%s", r.rx.last_msg);
  cr_assert_lt(r.rx.last_bytes, (uint64_t)NB * r.bb);
  /* The staging slots came back: another transfer runs. */
  move(&s, &r, p, GPU, GPU);
  td_kvx_disconnect(p);
  side_close(&s);
  side_close(&r);
}

/* Two processes: a staged transfer, and the receiver killed while the
 * sender waits for staging credits. */
static int receiver_child(int wfd, int rfd, bool hang) {
  side r;
  td_kvx_geom g = kt_geom(0, 2, 0, 4, 16, 8, 2);
  memset(&r, 0, sizeof r);
  td_kvx_opts o = kt_opts("stg-child", &r.rx);
  o.cuda_device = 0;
  o.staging_slots = 2;
  o.staging_slot_bytes = 32 << 10;
  if (td_kvx_create(&o, &r.k) != TD_OK) return 30;
  r.bb = td_kvx_block_bytes(&g);
  r.gpu = calloc(NB, r.bb);
  td_kvx_pool_desc d = {GPU, TD_KVX_MEM_CUDA, r.gpu, NB, g};
  if (td_kvx_register_pool(r.k, &d) != TD_OK) return 31;
  uint8_t *desc;
  size_t n;
  if (td_kvx_export(r.k, &desc, &n) != TD_OK) return 32;
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
  if (write(wfd, r.gpu, r.bb * NB) != (ssize_t)(r.bb * NB)) return 38;
  char c;
  if (read(rfd, &c, 1) != 1) return 39;
  side_close(&r);
  return 0;
}

static void run_child(bool hang) {
  int up[2], down[2];
  cr_assert_eq(pipe(up), 0);
  cr_assert_eq(pipe(down), 0);
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    close(up[0]);
    close(down[1]);
    _exit(receiver_child(up[1], down[0], hang));
  }
  close(up[1]);
  close(down[0]);
  td_kvx_geom g = kt_geom(0, 2, 0, 4, 16, 8, 2);
  side s;
  side_open(&s, "stg-parent", g, TD_KVX_LOCAL_AUTO, 9);
  uint64_t len;
  cr_assert(kt_read_full(up[0], &len, 8, NULL, 60000));
  uint8_t *desc = malloc(len);
  cr_assert(kt_read_full(up[0], desc, len, NULL, 10000));
  td_kvx_peer *p;
  cr_assert_eq(td_kvx_connect(s.k, desc, len, &p), TD_OK, "%s", td_errmsg());
  free(desc);
  int32_t src[NB], dst[NB];
  for (int i = 0; i < NB; i++) {
    src[i] = i;
    dst[i] = (i * 5 + 1) % NB;
  }
  td_kvx_xfer x = {3, 0, GPU, GPU, src, dst, NB, 30000, TD_KVX_UCX, NULL, {0}};
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(p, &x, kt_done_cb, &d, NULL), TD_OK, "%s", td_errmsg());
  td_kvx *ks[1] = {s.k};
  if (hang) {
    char c;
    cr_assert(kt_read_full(up[0], &c, 1, s.k, 30000));
    for (int i = 0; i < 200; i++) td_kvx_progress(s.k);
    cr_assert_eq(d.calls, 0, "%s", d.msg);
    int64_t t0 = td_now_ms();
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    cr_assert(kt_drive(ks, 1, &d.calls, 20000));
    cr_assert_eq(d.status, TD_ERR_PEER, "%s", d.msg);
    cr_assert_lt(td_now_ms() - t0, 10000);
    td_kvx_stats st = td_kvx_get_stats(s.k);
    cr_assert_eq(st.xfers, 0);
    cr_assert_leq(st.ops, st.orphan_ops);
  } else {
    cr_assert(kt_drive(ks, 1, &d.calls, 30000));
    cr_assert_eq(d.status, TD_OK, "%s", d.msg);
    uint8_t *got = malloc(s.bb * NB);
    cr_assert(kt_read_full(up[0], got, s.bb * NB, s.k, 30000));
    for (int i = 0; i < NB; i++)
      cr_assert_eq(memcmp(got + (size_t)dst[i] * s.bb, s.gpu + (size_t)src[i] * s.bb, s.bb), 0, "block %d", i);
    free(got);
    cr_assert_eq(write(down[1], "q", 1), 1);
    int ws;
    while (waitpid(pid, &ws, WNOHANG) == 0) td_kvx_progress(s.k);
    cr_assert(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "child exit %d", WEXITSTATUS(ws));
  }
  td_kvx_disconnect(p);
  side_close(&s);
  close(up[0]);
  close(down[1]);
}

Test(kvx_staged, two_processes, .timeout = 120) { run_child(false); }
Test(kvx_staged, receiver_killed_waiting_for_credits, .timeout = 120) { run_child(true); }

/* The sender dies mid staged transfer while the receiver still copies
 * chunks out and returns credits (to a dead process): the grant ends with
 * a peer failure, nothing crashes, the slots come back. */
Test(kvx_staged, sender_killed_mid_transfer, .timeout = 120) {
  td_kvx_geom g = kt_geom(0, 2, 0, 4, 16, 8, 2);
  int up[2], down[2];
  cr_assert_eq(pipe(up), 0);
  cr_assert_eq(pipe(down), 0);
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    close(up[0]);
    close(down[1]);
    side s;
    side_open(&s, "stg-child-tx", g, TD_KVX_LOCAL_AUTO, 21);
    uint64_t len;
    if (!kt_read_full(down[0], &len, 8, NULL, 30000) || len > (1u << 20)) _exit(50);
    uint8_t *desc = malloc(len);
    if (!kt_read_full(down[0], desc, len, NULL, 10000)) _exit(51);
    td_kvx_peer *p;
    if (td_kvx_connect(s.k, desc, len, &p) != TD_OK) _exit(52);
    int32_t ids[NB];
    for (int i = 0; i < NB; i++) ids[i] = i;
    td_kvx_xfer x = {9, 0, GPU, GPU, ids, ids, NB, 30000, TD_KVX_UCX, NULL, {0}};
    kt_done d = {0};
    if (td_kvx_post(p, &x, kt_done_cb, &d, NULL) != TD_OK) _exit(53);
    int64_t end = td_now_ms() + 30000;
    while (td_kvx_get_stats(s.k).bytes_sent == 0 && td_now_ms() < end) td_kvx_progress(s.k);
    if (write(up[1], "S", 1) != 1) _exit(54);
    for (;;) pause();
  }
  close(up[1]);
  close(down[0]);
  side r;
  side_open(&r, "stg-parent-rx", g, TD_KVX_LOCAL_AUTO, 22);
  uint8_t *desc;
  size_t n;
  cr_assert_eq(td_kvx_export(r.k, &desc, &n), TD_OK);
  uint64_t len = n;
  cr_assert_eq(write(down[1], &len, 8), 8);
  cr_assert_eq(write(down[1], desc, n), (ssize_t)n);
  free(desc);
  char c;
  cr_assert(kt_read_full(up[0], &c, 1, r.k, 30000));
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  td_kvx *ks[1] = {r.k};
  cr_assert(kt_drive(ks, 1, &r.rx.events, 20000), "grant never ended");
  cr_assert_eq(r.rx.last_status, TD_ERR_PEER, "%s: %s", td_status_str(r.rx.last_status), r.rx.last_msg);
  td_kvx_stats st = td_kvx_get_stats(r.k);
  cr_assert_eq(st.grants, 0);
  cr_assert_eq(st.rpeers, 0);
  cr_assert_leq(st.ops, st.orphan_ops);
  side_close(&r);
  close(up[0]);
  close(down[1]);
}
