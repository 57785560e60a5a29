/* Two real processes on loopback: blocks arrive identical; a receiver or
 * a sender killed mid-transfer is reported as a peer failure in bounded
 * time and everything is released. */
#include <errno.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvx_testutil.h"

enum { POOL = 1, NBLK = 64 };

static void write_all(int fd, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n) {
    ssize_t w = write(fd, b, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) _exit(90);
    b += w;
    n -= (size_t)w;
  }
}

/* Reads exactly n bytes, progressing an engine (if any) while waiting. */
static bool read_all(int fd, void *p, size_t n, td_kvx *k, int timeout_ms) {
  uint8_t *b = p;
  int64_t end = td_now_ms() + timeout_ms;
  while (n) {
    struct pollfd pf = {fd, POLLIN, 0};
    if (k) td_kvx_progress(k);
    int r = poll(&pf, 1, k ? 1 : 50);
    if (r > 0) {
      ssize_t got = read(fd, b, n);
      if (got <= 0) return false;
      b += got;
      n -= (size_t)got;
    }
    if (td_now_ms() > end) return false;
  }
  return true;
}

static uint64_t hash_bytes(const void *p, size_t n) {
  const uint8_t *b = p;
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

typedef enum { RX_NORMAL, RX_HANG_AFTER_GRANT } rx_mode;

/* The receiver process: a kvcache pool, a reservation, the descriptor to
 * the parent; then either reports what arrived or hangs after granting. */
static int receiver_main(int to_parent, int from_parent, rx_mode mode, td_kvx_geom g, int nres,
                         td_kvx_local_path local) {
  kt_rx rx = {0};
  td_kvx_opts o = kt_opts("rx-proc", &rx);
  o.local_path = local;
  td_kvx *k;
  if (td_kvx_create(&o, &k) != TD_OK) return 10;
  td_backend *cpu;
  td_backend_opts bo = {.kind = TD_BACKEND_CPU, .threads = 1};
  if (td_backend_create(&bo, &cpu) != TD_OK) return 11;
  td_kv_pool *kv;
  if (td_kv_pool_create(cpu, &g.layout, NBLK, &kv) != TD_OK) return 12;
  rx.pool = kv;
  size_t bb = td_kvx_block_bytes(&g);
  memset(td_kv_pool_memory(kv), 0, bb * NBLK);
  td_kvx_pool_desc pd = {POOL, TD_KVX_MEM_HOST, td_kv_pool_memory(kv), NBLK, g};
  if (td_kvx_register_pool(k, &pd) != TD_OK) return 13;
  uint64_t res;
  int32_t ids[NBLK];
  if (td_kv_reserve(kv, nres, td_now_ms() + 120000, &res, ids) != TD_OK) return 14;
  uint8_t *desc;
  size_t n;
  if (td_kvx_export(k, &desc, &n) != TD_OK) return 15;
  uint64_t len = n;
  write_all(to_parent, &len, 8);
  write_all(to_parent, desc, n);
  write_all(to_parent, &res, 8);
  write_all(to_parent, ids, sizeof(int32_t) * (size_t)nres);
  free(desc);
  if (mode == RX_HANG_AFTER_GRANT) {
    td_kvx *ks[1] = {k};
    if (!kt_drive(ks, 1, &rx.grants, 30000)) return 16;
    /* Let the GRANT go out, then stop answering (the parent kills us). */
    int64_t end = td_now_ms() + 2000;
    while (td_kvx_get_stats(k).ops > 0 && td_now_ms() < end) td_kvx_progress(k);
    write_all(to_parent, "G", 1);
    for (;;) pause();
  }
  td_kvx *ks[1] = {k};
  if (!kt_drive(ks, 1, &rx.events, 60000)) return 17;
  int32_t st = rx.last_status;
  uint64_t bytes = rx.last_bytes;
  write_all(to_parent, &st, 4);
  write_all(to_parent, &bytes, 8);
  const uint8_t *mem = td_kv_pool_memory(kv);
  for (int i = 0; i < nres; i++) {
    uint64_t h = hash_bytes(mem + (size_t)ids[i] * bb, bb);
    write_all(to_parent, &h, 8);
  }
  /* Small transfers: the bytes themselves too. */
  if (bb * (size_t)nres <= (1u << 20))
    for (int i = 0; i < nres; i++) write_all(to_parent, mem + (size_t)ids[i] * bb, bb);
  char c;
  if (!read_all(from_parent, &c, 1, k, 60000)) return 18;
  td_kvx_destroy(k);
  for (int i = 0; i < nres; i++)
    if (td_kv_refcount(kv, ids[i]) != 1) return 19;
  td_kv_pool_destroy(kv);
  td_backend_destroy(cpu);
  return 0;
}

typedef struct child {
  pid_t pid;
  int rd, wr;
} child;

static child spawn_receiver(rx_mode mode, td_kvx_geom g, int nres, td_kvx_local_path local) {
  int up[2], down[2];
  cr_assert_eq(pipe(up), 0);
  cr_assert_eq(pipe(down), 0);
  fflush(NULL);
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0) {
    close(up[0]);
    close(down[1]);
    _exit(receiver_main(up[1], down[0], mode, g, nres, local));
  }
  close(up[1]);
  close(down[0]);
  return (child){pid, up[0], down[1]};
}

typedef struct sender {
  kt_rx rx;
  td_kvx *k;
  void *mem;
  td_kvx_peer *peer;
  uint64_t res;
  int32_t dst[NBLK];
} sender;

/* The sender's engine and pool, and the receiver's descriptor (malloc'd),
 * reservation and blocks, not yet connected. */
static uint8_t *sender_prepare(sender *s, child *c, td_kvx_geom g, int nres, td_kvx_local_path local, uint64_t *len) {
  memset(s, 0, sizeof *s);
  td_kvx_opts o = kt_opts("tx-proc", &s->rx);
  o.local_path = local;
  cr_assert_eq(td_kvx_create(&o, &s->k), TD_OK, "%s", td_errmsg());
  size_t bb = td_kvx_block_bytes(&g);
  s->mem = malloc(bb * NBLK);
  kt_fill_random(s->mem, bb * NBLK, (uint64_t)getpid());
  td_kvx_pool_desc pd = {POOL, TD_KVX_MEM_HOST, s->mem, NBLK, g};
  cr_assert_eq(td_kvx_register_pool(s->k, &pd), TD_OK, "%s", td_errmsg());
  cr_assert(read_all(c->rd, len, 8, NULL, 60000), "receiver did not start");
  cr_assert_lt(*len, 1u << 20);
  uint8_t *desc = malloc(*len);
  cr_assert(read_all(c->rd, desc, *len, NULL, 10000));
  cr_assert(read_all(c->rd, &s->res, 8, NULL, 10000));
  cr_assert(read_all(c->rd, s->dst, sizeof(int32_t) * (size_t)nres, NULL, 10000));
  return desc;
}

static void sender_open(sender *s, child *c, td_kvx_geom g, int nres, td_kvx_local_path local) {
  uint64_t len;
  uint8_t *desc = sender_prepare(s, c, g, nres, local, &len);
  cr_assert_eq(td_kvx_connect(s->k, desc, len, &s->peer), TD_OK, "%s", td_errmsg());
  free(desc);
}

static void run_identical(td_kvx_geom g, int nres, td_kvx_local_path local) {
  child c = spawn_receiver(RX_NORMAL, g, nres, local);
  sender s;
  sender_open(&s, &c, g, nres, local);
  size_t bb = td_kvx_block_bytes(&g);
  int32_t src[NBLK];
  for (int i = 0; i < nres; i++) src[i] = (i * 37 + 5) % NBLK;
  td_kvx_xfer x = {4242, s.res, POOL, POOL, src, s.dst, nres, 60000, TD_KVX_UCX, NULL, {0}};
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(s.peer, &x, kt_done_cb, &d, NULL), TD_OK, "%s", td_errmsg());
  td_kvx *ks[1] = {s.k};
  cr_assert(kt_drive(ks, 1, &d.calls, 60000), "no completion");
  cr_assert_eq(d.status, TD_OK, "%s", d.msg);
  int32_t st;
  uint64_t bytes;
  cr_assert(read_all(c.rd, &st, 4, s.k, 30000));
  cr_assert(read_all(c.rd, &bytes, 8, s.k, 10000));
  cr_assert_eq(st, TD_OK);
  cr_assert_eq(bytes, bb * (size_t)nres);
  for (int i = 0; i < nres; i++) {
    uint64_t h;
    cr_assert(read_all(c.rd, &h, 8, s.k, 10000));
    cr_assert_eq(h, hash_bytes((uint8_t *)s.mem + (size_t)src[i] * bb, bb), "block %d differs", i);
  }
  if (bb * (size_t)nres <= (1u << 20)) {
    uint8_t *got = malloc(bb);
    for (int i = 0; i < nres; i++) {
      cr_assert(read_all(c.rd, got, bb, s.k, 10000));
      cr_assert_eq(memcmp(got, (uint8_t *)s.mem + (size_t)src[i] * bb, bb), 0, "block %d differs", i);
    }
    free(got);
  }
  write_all(c.wr, "q", 1);
  int64_t end = td_now_ms() + 30000;
  int ws = 0;
  while (waitpid(c.pid, &ws, WNOHANG) == 0 && td_now_ms() < end) td_kvx_progress(s.k);
  cr_assert(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "receiver exited with %d", WEXITSTATUS(ws));
  td_kvx_disconnect(s.peer);
  td_kvx_destroy(s.k);
  free(s.mem);
  close(c.rd);
  close(c.wr);
}

Test(kvx_proc, random_blocks_identical, .timeout = 120) {
  run_identical(kt_geom(0, 2, 0, 4, 16, 8, 4), 48, TD_KVX_LOCAL_AUTO);
}

Test(kvx_proc, random_blocks_identical_tcp_only, .timeout = 120) {
  run_identical(kt_geom(0, 2, 0, 4, 16, 8, 4), 48, TD_KVX_LOCAL_OFF);
}

/* 40 blocks of 512 KiB: several 8 MiB puts. */
Test(kvx_proc, large_blocks_identical, .timeout = 180) {
  run_identical(kt_geom(0, 8, 0, 8, 64, 16, 4), 40, TD_KVX_LOCAL_AUTO);
}

static void run_receiver_killed(td_kvx_local_path local) {
  td_kvx_geom g = kt_geom(0, 8, 0, 8, 64, 16, 4);
  child c = spawn_receiver(RX_HANG_AFTER_GRANT, g, 48, local);
  sender s;
  sender_open(&s, &c, g, 48, local);
  int32_t src[48];
  for (int i = 0; i < 48; i++) src[i] = i;
  td_kvx_xfer x = {7, s.res, POOL, POOL, src, s.dst, 48, 60000, TD_KVX_UCX, NULL, {0}};
  kt_done d = {0};
  cr_assert_eq(td_kvx_post(s.peer, &x, kt_done_cb, &d, NULL), TD_OK, "%s", td_errmsg());
  char gch;
  cr_assert(read_all(c.rd, &gch, 1, s.k, 30000), "receiver never granted");
  for (int i = 0; i < 100; i++) td_kvx_progress(s.k);
  cr_assert_eq(d.calls, 0, "finished before the kill: %s", d.msg);
  cr_assert_eq(td_kvx_get_stats(s.k).xfers, 1);
  int64_t t0 = td_now_ms();
  kill(c.pid, SIGKILL);
  int ws;
  waitpid(c.pid, &ws, 0);
  td_kvx *ks[1] = {s.k};
  cr_assert(kt_drive(ks, 1, &d.calls, 20000), "no error after the receiver died");
  int64_t dt = td_now_ms() - t0;
  cr_assert_eq(d.status, TD_ERR_PEER, "%s: %s", td_status_str(d.status), d.msg);
  cr_assert_lt(dt, 10000, "took %lld ms", (long long)dt);
  cr_assert_eq(s.rx.peer_events, 1);
  cr_assert_eq(td_kvx_peer_status(s.peer), TD_ERR_PEER);
  /* Posting to a dead peer fails at once. */
  cr_assert_eq(td_kvx_post(s.peer, &x, kt_done_cb, &d, NULL), TD_ERR_PEER);
  td_kvx_stats st = td_kvx_get_stats(s.k);
  cr_assert_eq(st.xfers, 0);
  cr_assert_eq(st.xfers_failed, 1);
  cr_assert_leq(st.ops, st.orphan_ops, "%d operations still tied to transfers", st.ops - st.orphan_ops);
  td_kvx_disconnect(s.peer);
  td_kvx_destroy(s.k);
  free(s.mem);
  close(c.rd);
  close(c.wr);
  cr_log_info("sender saw the receiver's death after %lld ms", (long long)dt);
}

Test(kvx_proc, receiver_killed_mid_transfer, .timeout = 120) { run_receiver_killed(TD_KVX_LOCAL_AUTO); }
Test(kvx_proc, receiver_killed_mid_transfer_tcp_only, .timeout = 120) { run_receiver_killed(TD_KVX_LOCAL_OFF); }

/* The receiver dies between publishing its descriptor and the sender's
 * connect: the connect is refused, or a transfer ends with an error in
 * bounded time; nothing hangs, nothing stays behind (LeakSanitizer checks
 * this process at exit), and no shared-memory path is set up to a
 * process that is gone. */
Test(kvx_proc, connect_to_a_receiver_that_is_gone, .timeout = 120) {
  td_kvx_geom g = kt_geom(0, 8, 0, 8, 64, 16, 4);
  child c = spawn_receiver(RX_HANG_AFTER_GRANT, g, 8, TD_KVX_LOCAL_AUTO);
  sender s;
  uint64_t len;
  uint8_t *desc = sender_prepare(&s, &c, g, 8, TD_KVX_LOCAL_AUTO, &len);
  kill(c.pid, SIGKILL);
  int ws;
  waitpid(c.pid, &ws, 0);
  td_status cs = td_kvx_connect(s.k, desc, len, &s.peer);
  free(desc);
  if (cs == TD_OK) {
    cr_assert(!td_kvx_get_stats(s.k).local_path, "a shared-memory endpoint to a process that is gone");
    int32_t src[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    td_kvx_xfer x = {9, s.res, POOL, POOL, src, s.dst, 8, 10000, TD_KVX_UCX, NULL, {0}};
    kt_done d = {0};
    td_status ps = td_kvx_post(s.peer, &x, kt_done_cb, &d, NULL);
    if (ps == TD_OK) {
      td_kvx *ks[1] = {s.k};
      cr_assert(kt_drive(ks, 1, &d.calls, 20000), "no end to a transfer to a dead receiver");
      cr_assert_neq(d.status, TD_OK);
    } else {
      td_err_clear();
    }
    td_kvx_disconnect(s.peer);
  } else {
    cr_assert_eq(cs, TD_ERR_NETWORK, "%s: %s", td_status_str(cs), td_errmsg());
    td_err_clear();
  }
  cr_assert_eq(td_kvx_get_stats(s.k).xfers, 0);
  td_kvx_destroy(s.k);
  free(s.mem);
  close(c.rd);
  close(c.wr);
}

/* The sender process dies after its transfer was granted: the receiver
 * ends the grant with a peer failure and the blocks are unpinned. */
Test(kvx_proc, sender_killed_mid_transfer, .timeout = 120) {
  td_kvx_geom g = kt_geom(0, 8, 0, 8, 64, 16, 4);
  int up[2], down[2];
  cr_assert_eq(pipe(up), 0);
  cr_assert_eq(pipe(down), 0);
  fflush(NULL);
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0) {
    /* Child: the sender. Reads the descriptor, posts, and once bytes are
     * moving stops progressing. */
    close(up[0]);
    close(down[1]);
    kt_rx rx = {0};
    td_kvx_opts o = kt_opts("tx-child", &rx);
    o.local_path = TD_KVX_LOCAL_OFF;
    td_kvx *k;
    if (td_kvx_create(&o, &k) != TD_OK) _exit(20);
    size_t bb = td_kvx_block_bytes(&g);
    void *mem = calloc(NBLK, bb);
    td_kvx_pool_desc pd = {POOL, TD_KVX_MEM_HOST, mem, NBLK, g};
    if (td_kvx_register_pool(k, &pd) != TD_OK) _exit(21);
    uint64_t len, res;
    int32_t dst[48], src[48];
    if (!read_all(down[0], &len, 8, NULL, 30000) || len > (1u << 20)) _exit(22);
    uint8_t *desc = malloc(len);
    if (!read_all(down[0], desc, len, NULL, 10000) || !read_all(down[0], &res, 8, NULL, 10000) ||
        !read_all(down[0], dst, sizeof dst, NULL, 10000))
      _exit(23);
    td_kvx_peer *peer;
    if (td_kvx_connect(k, desc, len, &peer) != TD_OK) _exit(24);
    for (int i = 0; i < 48; i++) src[i] = i;
    td_kvx_xfer x = {8, res, POOL, POOL, src, dst, 48, 60000, TD_KVX_UCX, NULL, {0}};
    kt_done d = {0};
    if (td_kvx_post(peer, &x, kt_done_cb, &d, NULL) != TD_OK) _exit(25);
    int64_t end = td_now_ms() + 30000;
    while (td_kvx_get_stats(k).bytes_sent == 0 && td_now_ms() < end) td_kvx_progress(k);
    write_all(up[1], "S", 1);
    for (;;) pause();
  }
  close(up[1]);
  close(down[0]);
  kt_rx rx = {0};
  td_kvx_opts o = kt_opts("rx-parent", &rx);
  td_kvx *k;
  cr_assert_eq(td_kvx_create(&o, &k), TD_OK, "%s", td_errmsg());
  td_backend *cpu;
  td_backend_opts bo = {.kind = TD_BACKEND_CPU, .threads = 1};
  cr_assert_eq(td_backend_create(&bo, &cpu), TD_OK);
  td_kv_pool *kv;
  cr_assert_eq(td_kv_pool_create(cpu, &g.layout, NBLK, &kv), TD_OK);
  rx.pool = kv;
  td_kvx_pool_desc pd = {POOL, TD_KVX_MEM_HOST, td_kv_pool_memory(kv), NBLK, g};
  cr_assert_eq(td_kvx_register_pool(k, &pd), TD_OK);
  uint64_t res;
  int32_t ids[48];
  cr_assert_eq(td_kv_reserve(kv, 48, td_now_ms() + 120000, &res, ids), TD_OK);
  uint8_t *desc;
  size_t n;
  cr_assert_eq(td_kvx_export(k, &desc, &n), TD_OK);
  uint64_t len = n;
  write_all(down[1], &len, 8);
  write_all(down[1], desc, n);
  write_all(down[1], &res, 8);
  write_all(down[1], ids, sizeof ids);
  free(desc);
  char sc;
  cr_assert(read_all(up[0], &sc, 1, k, 30000), "sender never started copying");
  cr_assert_eq(rx.grants, 1);
  cr_assert(td_kvx_reservation_busy(k, res));
  int64_t t0 = td_now_ms();
  kill(pid, SIGKILL);
  int ws;
  waitpid(pid, &ws, 0);
  td_kvx *ks[1] = {k};
  cr_assert(kt_drive(ks, 1, &rx.events, 20000), "grant never ended");
  int64_t dt = td_now_ms() - t0;
  cr_assert_eq(rx.last_status, TD_ERR_PEER, "%s: %s", td_status_str(rx.last_status), rx.last_msg);
  cr_assert_lt(dt, 10000);
  cr_assert_eq(rx.peer_events, 1);
  cr_assert_not(td_kvx_reservation_busy(k, res));
  for (int i = 0; i < 48; i++) cr_assert_eq(td_kv_refcount(kv, ids[i]), 1);
  td_kvx_stats st = td_kvx_get_stats(k);
  cr_assert_eq(st.grants, 0);
  cr_assert_eq(st.rpeers, 0);
  cr_assert_eq(td_kv_reservation_release(kv, res), TD_OK);
  td_kvx_destroy(k);
  td_kv_pool_destroy(kv);
  td_backend_destroy(cpu);
  close(up[0]);
  close(down[1]);
  cr_log_info("receiver saw the sender's death after %lld ms", (long long)dt);
}
