/* GPU checks of kvtransfer, run on the GPU machine (not in CI):
 *   gpu_kvx gather   GPU 0: the gather / scatter kernel against a CPU
 *                    reference on random pieces (odd sizes, unaligned
 *                    offsets, many small and a few large), and its speed
 *                    (gpu_kvx_gather.c)
 *   gpu_kvx staged   two processes on GPU 0: UCX staged path (GPU->GPU,
 *                    host->GPU, GPU->host, re-sliced), receiver killed
 *                    while the sender waits for staging credits
 *   gpu_kvx nccl     the gather checks, then sender on GPU 0, receiver on
 *                    GPU 1: chunked NCCL transfers (64 KiB and 1.5 MiB
 *                    blocks, scattered and contiguous, re-sliced, small
 *                    chunks), a receiver that stops answering (timeout +
 *                    ncclCommAbort), then recovery with a new one
 *   gpu_kvx ipc      CUDA IPC: two processes on GPU 0, then GPU 0 to GPU 1
 *                    when there are two: AUTO takes it, every byte checked
 *                    (64 KiB and 1.5 MiB blocks, scattered and contiguous,
 *                    re-sliced, one block), UCX and NCCL still when asked,
 *                    a sender with IPC off stages, a receiver killed mid-
 *                    transfer (peer failure), a new receiver afterwards
 *   gpu_kvx all      all of the above
 * Prints PASS / FAIL lines; exits with the number of failures. */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/settings.h"
#include "gpu_kvx.h"
#include "kvtransfer/gpu.h"
#include "kvtransfer/kvtransfer.h"

/* BIG: Flan-T5-large cross-attention blocks (1.5 MiB), NB_BIG of them. */
enum { HOST = 1, GPU = 2, GPU_SLICE = 3, BIG = 4, NB = 512, NB_BIG = 64 };


static td_kvx_geom geom(int l0, int l1, int h0, int h1) {
  td_kvx_geom g = {{l1 - l0, h1 - h0, 64, 16, 0, 0}, 2, l0, l1, h0, h1}; /* bf16, 64 KiB when 2 x 8 heads */
  return g;
}
static const td_kvx_geom *full_geom(void) {
  static td_kvx_geom g;
  g = geom(0, 2, 0, 8);
  return &g;
}
static const td_kvx_geom *slice_geom(void) {
  static td_kvx_geom g;
  g = geom(1, 2, 4, 8);
  return &g;
}
static const td_kvx_geom *big_geom(void) {
  static td_kvx_geom g;
  g = geom(0, 24, 0, 16);
  return &g;
}
static int pool_blocks(uint32_t pool) { return pool == BIG ? NB_BIG : NB; }
static const td_kvx_geom *pool_geom(uint32_t pool) {
  return pool == BIG ? big_geom() : pool == GPU_SLICE ? slice_geom() : full_geom();
}

static uint64_t fnv(const void *p, size_t n) {
  const uint8_t *b = p;
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

void fill(uint8_t *p, size_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = (uint8_t)(x >> 24);
  }
}

static void wr(int fd, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n) {
    ssize_t w = write(fd, b, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) _exit(91);
    b += w;
    n -= (size_t)w;
  }
}

static bool rd(int fd, void *p, size_t n, td_kvx *k, int ms) {
  uint8_t *b = p;
  int64_t end = td_now_ms() + ms;
  while (n) {
    if (k) td_kvx_progress(k);
    struct pollfd pf = {fd, POLLIN, 0};
    if (poll(&pf, 1, k ? 0 : 20) > 0) {
      ssize_t r = read(fd, b, n);
      if (r <= 0) return false;
      b += r;
      n -= (size_t)r;
    }
    if (td_now_ms() > end) return false;
  }
  return true;
}

/* ---- receiver process ---- */

typedef struct rxapp {
  int grants, events;
  int out;
  bool hang_next;
  td_kvx *k;
} rxapp;

static td_status rx_authorize(void *ctx, const td_kvx_grant_req *r) {
  ((rxapp *)ctx)->grants++;
  return TD_OK;
}

static void rx_event(void *ctx, const td_kvx_recv_event *ev) {
  rxapp *a = ctx;
  a->events++;
  int32_t st = ev->status;
  wr(a->out, "E", 1);
  wr(a->out, &st, 4);
  wr(a->out, &ev->request_id, 8);
  wr(a->out, &ev->bytes, 8);
}

/* Commands: 'H' pool n ids -> n hashes; 'X' hang after the next grant;
 * 'Q' quit. */
static int receiver(int device, size_t chunk, int in, int out) {
  rxapp a = {0};
  a.out = out;
  td_log_set_name("gpu-rx");
  td_kvx_opts o;
  memset(&o, 0, sizeof o);
  o.name = "gpu-rx";
  o.cuda_device = device;
  o.authorize = rx_authorize;
  o.on_recv = rx_event;
  o.ctx = &a;
  o.nccl_chunk_bytes = chunk;
  if (cudaSetDevice(device) != cudaSuccess) return 40;
  if (td_kvx_create(&o, &a.k) != TD_OK) {
    fprintf(stderr, "receiver: %s\n", td_errmsg());
    return 41;
  }
  size_t bb = td_kvx_block_bytes(full_geom()), sbb = td_kvx_block_bytes(slice_geom());
  size_t bbb = td_kvx_block_bytes(big_geom());
  uint8_t *host = calloc(NB, bb);
  void *gpu = NULL, *gsl = NULL, *gbig = NULL;
  if (cudaMalloc(&gpu, bb * NB) != cudaSuccess || cudaMalloc(&gsl, sbb * NB) != cudaSuccess ||
      cudaMalloc(&gbig, bbb * NB_BIG) != cudaSuccess)
    return 42;
  cudaMemset(gpu, 0, bb * NB);
  cudaMemset(gsl, 0, sbb * NB);
  cudaMemset(gbig, 0, bbb * NB_BIG);
  td_kvx_pool_desc pd[4] = {{HOST, TD_KVX_MEM_HOST, host, NB, *full_geom()},
                            {GPU, TD_KVX_MEM_CUDA, gpu, NB, *full_geom()},
                            {GPU_SLICE, TD_KVX_MEM_CUDA, gsl, NB, *slice_geom()},
                            {BIG, TD_KVX_MEM_CUDA, gbig, NB_BIG, *big_geom()}};
  for (int i = 0; i < 4; i++)
    if (td_kvx_register_pool(a.k, &pd[i]) != TD_OK) {
      fprintf(stderr, "receiver: %s\n", td_errmsg());
      return 43;
    }
  uint8_t *desc;
  size_t n;
  if (td_kvx_export(a.k, &desc, &n) != TD_OK) return 44;
  uint64_t len = n;
  wr(out, &len, 8);
  wr(out, desc, n);
  free(desc);
  uint8_t *tmp = malloc(bbb);
  for (;;) {
    td_kvx_progress(a.k);
    if (a.hang_next && a.grants > 0) {
      int64_t end = td_now_ms() + 2000;
      while (td_kvx_get_stats(a.k).ops > 0 && td_now_ms() < end) td_kvx_progress(a.k);
      wr(out, "G", 1);
      for (;;) pause();
    }
    struct pollfd pf = {in, POLLIN, 0};
    if (poll(&pf, 1, 0) <= 0) continue;
    char c;
    if (read(in, &c, 1) != 1) return 45;
    if (c == 'Q') break;
    if (c == 'X') {
      a.hang_next = true;
      a.grants = 0;
    }
    if (c == 'H') {
      uint32_t pool, cnt;
      if (!rd(in, &pool, 4, NULL, 5000) || !rd(in, &cnt, 4, NULL, 5000) || cnt > NB) return 46;
      int32_t ids[NB];
      if (!rd(in, ids, 4 * cnt, NULL, 5000)) return 47;
      size_t b = td_kvx_block_bytes(pool_geom(pool));
      uint8_t *base = pool == GPU ? gpu : pool == BIG ? gbig : gsl;
      for (uint32_t i = 0; i < cnt; i++) {
        if (pool == HOST)
          memcpy(tmp, host + (size_t)ids[i] * b, b);
        else
          cudaMemcpy(tmp, base + (size_t)ids[i] * b, b, cudaMemcpyDeviceToHost);
        uint64_t h = fnv(tmp, b);
        wr(out, &h, 8);
      }
    }
  }
  td_kvx_destroy(a.k);
  cudaFree(gpu);
  cudaFree(gsl);
  cudaFree(gbig);
  free(host);
  free(tmp);
  return 0;
}

typedef struct child {
  pid_t pid;
  int in, out; /* parent reads in, writes out */
} child;

/* CUDA and UCX are not fork-safe once initialised: the receiver is a
 * fresh exec of this program. */
static child spawn(int device, size_t chunk) {
  int up[2], down[2];
  if (pipe(up) || pipe(down)) exit(2);
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    close(up[0]);
    close(down[1]);
    char dev[16], ck[32], in[16], out[16];
    snprintf(dev, sizeof dev, "%d", device);
    snprintf(ck, sizeof ck, "%zu", chunk);
    snprintf(in, sizeof in, "%d", down[0]);
    snprintf(out, sizeof out, "%d", up[1]);
    execl("/proc/self/exe", "gpu_kvx", "--receiver", dev, ck, in, out, (char *)NULL);
    _exit(99);
  }
  close(up[1]);
  close(down[0]);
  return (child){pid, up[0], down[1]};
}

/* ---- sender ---- */

typedef struct tx {
  td_kvx *k;
  uint8_t *host, *hsrc, *hbig; /* hsrc, hbig: host copies of the GPU pools' contents */
  void *gpu, *big;
  size_t bb, bbb;
  int peer_events;
} tx;

typedef struct done {
  int calls;
  td_status st;
  char msg[256];
} done;

static void done_cb(void *arg, uint64_t id, td_status s, const char *msg) {
  done *d = arg;
  d->calls++;
  d->st = s;
  snprintf(d->msg, sizeof d->msg, "%s", msg);
}

static void tx_peer(void *ctx, td_kvx_peer *p, uint64_t uuid, td_status s, const char *msg) {
  ((tx *)ctx)->peer_events++;
}

static void tx_open(tx *t, int device, bool no_ipc) {
  memset(t, 0, sizeof *t);
  cudaSetDevice(device);
  td_kvx_opts o;
  memset(&o, 0, sizeof o);
  o.name = "gpu-tx";
  o.cuda_device = device;
  o.no_ipc = no_ipc;
  o.on_peer = tx_peer;
  o.ctx = t;
  if (td_kvx_create(&o, &t->k) != TD_OK) {
    printf("FAIL engine: %s\n", td_errmsg());
    exit(1);
  }
  t->bb = td_kvx_block_bytes(full_geom());
  t->bbb = td_kvx_block_bytes(big_geom());
  t->host = malloc(t->bb * NB);
  t->hsrc = malloc(t->bb * NB);
  t->hbig = malloc(t->bbb * NB_BIG);
  fill(t->host, t->bb * NB, 1);
  fill(t->hsrc, t->bb * NB, 2);
  fill(t->hbig, t->bbb * NB_BIG, 3);
  if (cudaMalloc(&t->gpu, t->bb * NB) != cudaSuccess || cudaMalloc(&t->big, t->bbb * NB_BIG) != cudaSuccess) exit(3);
  cudaMemcpy(t->gpu, t->hsrc, t->bb * NB, cudaMemcpyHostToDevice);
  cudaMemcpy(t->big, t->hbig, t->bbb * NB_BIG, cudaMemcpyHostToDevice);
  td_kvx_pool_desc h = {HOST, TD_KVX_MEM_HOST, t->host, NB, *full_geom()};
  td_kvx_pool_desc d = {GPU, TD_KVX_MEM_CUDA, t->gpu, NB, *full_geom()};
  td_kvx_pool_desc b = {BIG, TD_KVX_MEM_CUDA, t->big, NB_BIG, *big_geom()};
  if (td_kvx_register_pool(t->k, &h) != TD_OK || td_kvx_register_pool(t->k, &d) != TD_OK ||
      td_kvx_register_pool(t->k, &b) != TD_OK) {
    printf("FAIL pools: %s\n", td_errmsg());
    exit(1);
  }
}

static void tx_close(tx *t) {
  td_kvx_destroy(t->k);
  cudaFree(t->gpu);
  cudaFree(t->big);
  free(t->host);
  free(t->hsrc);
  free(t->hbig);
}

static td_kvx_peer *tx_connect(tx *t, child *c) {
  uint64_t len;
  if (!rd(c->in, &len, 8, NULL, 60000) || len > (1u << 20)) return NULL;
  uint8_t *desc = malloc(len);
  td_kvx_peer *p = NULL;
  if (rd(c->in, desc, len, NULL, 10000) && td_kvx_connect(t->k, desc, len, &p) != TD_OK) p = NULL;
  free(desc);
  return p;
}

static bool wait_done(tx *t, done *d, int ms) {
  int64_t end = td_now_ms() + ms;
  while (!d->calls && td_now_ms() < end) td_kvx_progress(t->k);
  return d->calls > 0;
}

/* The receiver's event for a request: 'E' status request bytes. */
static bool wait_event(tx *t, child *c, td_status *st, uint64_t *bytes) {
  char tag;
  int32_t s;
  uint64_t req;
  if (!rd(c->in, &tag, 1, t->k, 20000) || tag != 'E') return false;
  if (!rd(c->in, &s, 4, t->k, 5000) || !rd(c->in, &req, 8, t->k, 5000) || !rd(c->in, bytes, 8, t->k, 5000))
    return false;
  *st = (td_status)s;
  return true;
}

static bool hashes(tx *t, child *c, uint32_t pool, const int32_t *ids, uint32_t n, uint64_t *out) {
  wr(c->out, "H", 1);
  wr(c->out, &pool, 4);
  wr(c->out, &n, 4);
  wr(c->out, ids, 4 * n);
  return rd(c->in, out, 8 * n, t->k, 30000);
}

/* Moves n blocks from a local pool to the child's pool and checks every
 * destination block's bytes: scattered sources and destinations, or both
 * in order (contiguous: no gather or scatter on either side). */
static bool move_ex(tx *t, child *c, td_kvx_peer *p, uint32_t sp, uint32_t dp, td_kvx_transport tr, int n,
                    bool contiguous) {
  static int32_t src[NB], dst[NB];
  int nb = pool_blocks(dp);
  for (int i = 0; i < n; i++) {
    src[i] = contiguous ? i : (i * 5 + 2) % nb;
    dst[i] = contiguous ? nb - n + i : (i * 37 + 11) % nb; /* 5 and 37 are coprime with 512 and 64 */
  }
  td_kvx_xfer x = {(uint64_t)(1000 + sp * 10 + dp), 0, sp, dp, src, dst, n, 15000, tr, NULL, {0}};
  done d = {0};
  int64_t t0 = td_now_ns();
  CHECK(td_kvx_post(p, &x, done_cb, &d, NULL) == TD_OK, "post: %s", td_errmsg());
  CHECK(wait_done(t, &d, 25000), "no completion");
  double ms = (double)(td_now_ns() - t0) / 1e6;
  CHECK(d.st == TD_OK, "transfer: %s: %s", td_status_str(d.st), d.msg);
  td_status st;
  uint64_t bytes;
  CHECK(wait_event(t, c, &st, &bytes), "no receiver event");
  CHECK(st == TD_OK, "receiver status %s", td_status_str(st));
  const td_kvx_geom *rg = pool_geom(dp);
  size_t rbb = td_kvx_block_bytes(rg), sbb = td_kvx_block_bytes(pool_geom(sp));
  CHECK(bytes == rbb * (size_t)n, "receiver got %" PRIu64 " bytes", bytes);
  uint64_t *h = malloc(8 * (size_t)n);
  CHECK(hashes(t, c, dp, dst, (uint32_t)n, h), "no hashes");
  const uint8_t *sbase = sp == HOST ? t->host : sp == BIG ? t->hbig : t->hsrc;
  uint8_t *want = malloc(rbb);
  for (int i = 0; i < n; i++) {
    const uint8_t *sb = sbase + (size_t)src[i] * sbb;
    if (dp == GPU_SLICE) {
      td_kvx_slice sl[16];
      int ns = 0;
      td_kvx_slice_plan(full_geom(), rg, sl, 16, &ns);
      for (int j = 0; j < ns; j++) memcpy(want + sl[j].dst_off, sb + sl[j].src_off, sl[j].len);
    } else {
      memcpy(want, sb, rbb);
    }
    if (fnv(want, rbb) != h[i]) {
      printf("  block %d (%d -> %d) differs\n", i, src[i], dst[i]);
      free(h);
      free(want);
      return false;
    }
  }
  free(h);
  free(want);
  printf("  %d blocks, %.1f MB in %.2f ms (%.2f GB/s, first-call costs included)\n", n, (double)bytes / 1e6, ms,
         (double)bytes / ms / 1e6);
  return true;
}

static bool move(tx *t, child *c, td_kvx_peer *p, uint32_t sp, uint32_t dp, td_kvx_transport tr, int n) {
  return move_ex(t, c, p, sp, dp, tr, n, false);
}

static int failures;
void report(const char *name, bool ok) {
  printf("%s %s\n", ok ? "PASS" : "FAIL", name);
  fflush(stdout);
  if (!ok) failures++;
}

static void quit(child *c) {
  wr(c->out, "Q", 1);
  waitpid(c->pid, NULL, 0);
  close(c->in);
  close(c->out);
}

/* Receiver asked to hang after granting; the sender's transfer then
 * stalls and the receiver is killed (or left to time out). */
static bool stalled(tx *t, child *c, td_kvx_peer *p, td_kvx_transport tr, int timeout_ms, bool kill_it,
                    td_status want) {
  static int32_t ids[NB];
  for (int i = 0; i < NB; i++) ids[i] = i;
  wr(c->out, "X", 1);
  td_kvx_xfer x = {77, 0, GPU, GPU, ids, ids, NB, timeout_ms, tr, NULL, {0}};
  done d = {0};
  CHECK(td_kvx_post(p, &x, done_cb, &d, NULL) == TD_OK, "post: %s", td_errmsg());
  char g;
  CHECK(rd(c->in, &g, 1, t->k, 30000) && g == 'G', "receiver never granted");
  for (int i = 0; i < 1000; i++) td_kvx_progress(t->k);
  CHECK(d.calls == 0, "ended before the failure: %s %s", td_status_str(d.st), d.msg);
  int64_t t0 = td_now_ms();
  if (kill_it) {
    kill(c->pid, SIGKILL);
    waitpid(c->pid, NULL, 0);
  }
  CHECK(wait_done(t, &d, 30000), "no error reported");
  int64_t dt = td_now_ms() - t0;
  printf("  error after %lld ms: %s: %s\n", (long long)dt, td_status_str(d.st), d.msg);
  CHECK(d.st == want, "status %s, expected %s", td_status_str(d.st), td_status_str(want));
  CHECK(dt < 15000, "took %lld ms", (long long)dt);
  td_kvx_stats s = td_kvx_get_stats(t->k);
  CHECK(s.xfers == 0, "%d transfers left", s.xfers);
  if (!kill_it) {
    kill(c->pid, SIGKILL);
    waitpid(c->pid, NULL, 0);
  }
  close(c->in);
  close(c->out);
  return true;
}

static void run_staged(void) {
  tx t;
  tx_open(&t, 0, false);
  child c = spawn(0, 0);
  td_kvx_peer *p = tx_connect(&t, &c);
  report("staged: connect", p != NULL);
  if (!p) return;
  printf("  UCX CUDA memory support: %s (staged path %s)\n", td_kvx_cuda_direct(t.k) ? "yes" : "no",
         td_kvx_cuda_direct(t.k) ? "not needed" : "in use");
  report("staged: GPU -> GPU", move(&t, &c, p, GPU, GPU, TD_KVX_UCX, 300));
  report("staged: AUTO on one GPU never takes NCCL",
         move(&t, &c, p, GPU, GPU, TD_KVX_AUTO, 100) && td_kvx_get_stats(t.k).nccl_xfers == 0);
  report("staged: GPU -> GPU again (warm)", move(&t, &c, p, GPU, GPU, TD_KVX_UCX, 500));
  report("staged: host -> GPU", move(&t, &c, p, HOST, GPU, TD_KVX_UCX, 300));
  report("staged: GPU -> host", move(&t, &c, p, GPU, HOST, TD_KVX_UCX, 300));
  report("staged: GPU -> GPU re-sliced (layers [1,2), heads [4,8))", move(&t, &c, p, GPU, GPU_SLICE, TD_KVX_UCX, 300));
  quit(&c);
  td_kvx_disconnect(p);
  child c2 = spawn(0, 0);
  td_kvx_peer *p2 = tx_connect(&t, &c2);
  report("staged: receiver killed while the sender waits for credits",
         p2 && stalled(&t, &c2, p2, TD_KVX_UCX, 60000, true, TD_ERR_PEER));
  report("staged: peer failure event", t.peer_events == 1);
  if (p2) td_kvx_disconnect(p2);
  tx_close(&t);
}

static void run_nccl(void) {
  int n = 0;
  cudaGetDeviceCount(&n);
  if (n < 2) {
    printf("SKIP nccl: %d GPU(s)\n", n);
    return;
  }
  tx t;
  tx_open(&t, 0, true); /* IPC off: AUTO between two GPUs is NCCL's */
  report("nccl: compiled in", td_kvx_nccl_available(t.k));
  child c = spawn(1, 0);
  td_kvx_peer *p = tx_connect(&t, &c);
  report("nccl: connect", p != NULL);
  if (!p) return;
  /* Default chunking (8 MiB, first 2 MiB): 300 x 64 KiB = 4 chunks, 60 x
   * 1.5 MiB = 13 chunks; scattered: gather and scatter through the slots. */
  report("nccl: GPU0 -> GPU1 (communicator made on demand)", move(&t, &c, p, GPU, GPU, TD_KVX_NCCL, 300));
  report("nccl: GPU0 -> GPU1 again (warm)", move(&t, &c, p, GPU, GPU, TD_KVX_NCCL, 500));
  report("nccl: 1.5 MiB blocks, scattered", move(&t, &c, p, BIG, BIG, TD_KVX_NCCL, 60));
  report("nccl: 1.5 MiB blocks, contiguous (no bounce)", move_ex(&t, &c, p, BIG, BIG, TD_KVX_NCCL, 50, true));
  report("nccl: 64 KiB blocks, contiguous (no bounce)", move_ex(&t, &c, p, GPU, GPU, TD_KVX_NCCL, 400, true));
  report("nccl: one block", move(&t, &c, p, GPU, GPU, TD_KVX_NCCL, 1));
  uint64_t before = td_kvx_get_stats(t.k).nccl_xfers;
  bool ok = move(&t, &c, p, GPU, GPU, TD_KVX_AUTO, 200);
  report("nccl: AUTO picks NCCL between two GPUs (IPC off)", ok && td_kvx_get_stats(t.k).nccl_xfers == before + 1);
  report("nccl: re-sliced", move(&t, &c, p, GPU, GPU_SLICE, TD_KVX_NCCL, 300));
  report("nccl: UCX staged between the two GPUs too", move(&t, &c, p, GPU, GPU, TD_KVX_UCX, 200));
  quit(&c);
  td_kvx_disconnect(p);
  child c2 = spawn(1, 0);
  td_kvx_peer *p2 = tx_connect(&t, &c2);
  report("nccl: receiver stops answering -> timeout, communicator aborted",
         p2 && stalled(&t, &c2, p2, TD_KVX_NCCL, 2000, false, TD_ERR_TIMEOUT));
  if (p2) td_kvx_disconnect(p2);
  /* A receiver with 96 KiB chunks: the grant lowers the sender's; pieces of
   * 64 KiB blocks straddle chunks, slots cycle many times. */
  child c3 = spawn(1, 96 << 10);
  td_kvx_peer *p3 = tx_connect(&t, &c3);
  report("nccl: a new receiver works after the abort", p3 && move(&t, &c3, p3, GPU, GPU, TD_KVX_NCCL, 100));
  report("nccl: small chunks, 64 KiB blocks", p3 && move(&t, &c3, p3, GPU, GPU, TD_KVX_NCCL, 300));
  report("nccl: small chunks, 1.5 MiB blocks", p3 && move(&t, &c3, p3, BIG, BIG, TD_KVX_NCCL, 20));
  report("nccl: small chunks, re-sliced", p3 && move(&t, &c3, p3, GPU, GPU_SLICE, TD_KVX_NCCL, 200));
  if (p3) {
    quit(&c3);
    td_kvx_disconnect(p3);
  }
  tx_close(&t);
}

/* The receiver killed while the sender's IPC copies into its pool are in
 * flight (not yet seen complete, DONE not sent): the transfer ends with a
 * peer failure after its copies, and the sender's device stays usable (the
 * next check moves blocks again). */
static bool ipc_killed(tx *t, child *c, td_kvx_peer *p) {
  static int32_t ids[NB_BIG];
  for (int i = 0; i < NB_BIG; i++) ids[i] = (i * 5) % NB_BIG;
  td_kvx_xfer x = {78, 0, BIG, BIG, ids, ids, NB_BIG, 60000, TD_KVX_IPC, NULL, {0}};
  done d = {0};
  CHECK(td_kvx_post(p, &x, done_cb, &d, NULL) == TD_OK, "post: %s", td_errmsg());
  int64_t end = td_now_ms() + 30000;
  while (td_kvx_get_stats(t->k).ipc_chunks == 0 && !d.calls && td_now_ms() < end) td_kvx_progress(t->k);
  CHECK(td_kvx_get_stats(t->k).ipc_chunks > 0, "no copy in flight: %s %s", td_status_str(d.st), d.msg);
  kill(c->pid, SIGKILL);
  waitpid(c->pid, NULL, 0);
  int64_t t0 = td_now_ms();
  CHECK(wait_done(t, &d, 30000), "no error reported");
  printf("  error after %lld ms: %s: %s\n", (long long)(td_now_ms() - t0), td_status_str(d.st), d.msg);
  CHECK(d.st == TD_ERR_PEER, "status %s", td_status_str(d.st));
  td_kvx_stats s = td_kvx_get_stats(t->k);
  CHECK(s.xfers == 0 && s.ipc_chunks == 0, "%d transfers, %d chunks left", s.xfers, s.ipc_chunks);
  CHECK(cudaGetLastError() == cudaSuccess, "CUDA error on the sender");
  close(c->in);
  close(c->out);
  return true;
}

/* CUDA IPC to a receiver on `device`: the checks of one pair. */
static void ipc_pair(tx *t, int device) {
  char what[160];
  const char *where = device == 0 ? "one GPU" : "GPU0 -> GPU1";
  child c = spawn(device, 0);
  td_kvx_peer *p = tx_connect(t, &c);
  const td_kvx_desc_info *info = p ? td_kvx_peer_info(p) : NULL;
  snprintf(what, sizeof what, "ipc %s: the receiver exports its GPU pools", where);
  report(what, info && info->ipc && info->n_pools == 4);
  if (!p) return;
  td_kvx_stats st0 = td_kvx_get_stats(t->k);
  snprintf(what, sizeof what, "ipc %s: AUTO takes CUDA IPC (first transfer maps the pool)", where);
  bool ok = move(t, &c, p, GPU, GPU, TD_KVX_AUTO, 300);
  td_kvx_stats st = td_kvx_get_stats(t->k);
  report(what, ok && st.ipc_xfers == st0.ipc_xfers + 1 && st.nccl_xfers == st0.nccl_xfers);
  snprintf(what, sizeof what, "ipc %s: again (warm), 500 blocks", where);
  report(what, move(t, &c, p, GPU, GPU, TD_KVX_IPC, 500));
  snprintf(what, sizeof what, "ipc %s: 1.5 MiB blocks, scattered", where);
  report(what, move(t, &c, p, BIG, BIG, TD_KVX_IPC, 60));
  snprintf(what, sizeof what, "ipc %s: 1.5 MiB blocks, contiguous", where);
  report(what, move_ex(t, &c, p, BIG, BIG, TD_KVX_IPC, 50, true));
  snprintf(what, sizeof what, "ipc %s: 64 KiB blocks, contiguous", where);
  report(what, move_ex(t, &c, p, GPU, GPU, TD_KVX_IPC, 400, true));
  snprintf(what, sizeof what, "ipc %s: one block", where);
  report(what, move(t, &c, p, GPU, GPU, TD_KVX_IPC, 1));
  snprintf(what, sizeof what, "ipc %s: re-sliced (layers [1,2), heads [4,8))", where);
  report(what, move(t, &c, p, GPU, GPU_SLICE, TD_KVX_IPC, 300));
  st0 = td_kvx_get_stats(t->k);
  snprintf(what, sizeof what, "ipc %s: staged UCX when asked", where);
  ok = move(t, &c, p, GPU, GPU, TD_KVX_UCX, 200);
  report(what, ok && td_kvx_get_stats(t->k).ipc_xfers == st0.ipc_xfers);
  if (device != 0 && td_kvx_nccl_available(t->k)) {
    snprintf(what, sizeof what, "ipc %s: NCCL when asked", where);
    ok = move(t, &c, p, GPU, GPU, TD_KVX_NCCL, 200);
    report(what, ok && td_kvx_get_stats(t->k).nccl_xfers == st0.nccl_xfers + 1);
  }
  quit(&c);
  td_kvx_disconnect(p);
  child c2 = spawn(device, 0);
  td_kvx_peer *p2 = tx_connect(t, &c2);
  snprintf(what, sizeof what, "ipc %s: receiver killed with copies into its pool in flight", where);
  report(what, p2 && ipc_killed(t, &c2, p2));
  if (p2) td_kvx_disconnect(p2);
  child c3 = spawn(device, 0);
  td_kvx_peer *p3 = tx_connect(t, &c3);
  snprintf(what, sizeof what, "ipc %s: a new receiver afterwards", where);
  report(what, p3 && move(t, &c3, p3, BIG, BIG, TD_KVX_IPC, 64) && move(t, &c3, p3, GPU, GPU, TD_KVX_IPC, 300));
  if (p3) {
    quit(&c3);
    td_kvx_disconnect(p3);
  }
}

static void run_ipc(void) {
  int n = 0;
  cudaGetDeviceCount(&n);
  tx t;
  tx_open(&t, 0, false);
  ipc_pair(&t, 0);
  if (n >= 2)
    ipc_pair(&t, 1);
  else
    printf("SKIP ipc GPU0 -> GPU1: %d GPU(s)\n", n);
  report("ipc: peer failure events (one a killed receiver)", t.peer_events == (n >= 2 ? 2 : 1));
  tx_close(&t);
  /* IPC switched off on the sender: AUTO stages on one GPU. */
  tx_open(&t, 0, true);
  child c = spawn(0, 0);
  td_kvx_peer *p = tx_connect(&t, &c);
  bool ok = p && move(&t, &c, p, GPU, GPU, TD_KVX_AUTO, 100);
  td_kvx_stats st = td_kvx_get_stats(t.k);
  report("ipc off (TANDEM_KVX_IPC=off): AUTO on one GPU stages", ok && st.ipc_xfers == 0 && st.nccl_xfers == 0);
  if (p) {
    quit(&c);
    td_kvx_disconnect(p);
  }
  tx_close(&t);
}

int main(int argc, char **argv) {
  td_settings settings;
  if (td_settings_from_env(&settings) != TD_OK) {
    fprintf(stderr, "gpu_kvx: %s\n", td_errmsg());
    return 2;
  }
  td_settings_apply(&settings);
  setvbuf(stdout, NULL, _IOLBF, 0);
  signal(SIGPIPE, SIG_IGN);
  const char *what = argc > 1 ? argv[1] : "all";
  if (!strcmp(what, "--receiver") && argc == 6)
    return receiver(atoi(argv[2]), (size_t)strtoull(argv[3], NULL, 10), atoi(argv[4]), atoi(argv[5]));
  td_log_set_name("gpu-tx");
  if (!strcmp(what, "gather") || !strcmp(what, "nccl") || !strcmp(what, "all")) run_gather();
  if (!strcmp(what, "staged") || !strcmp(what, "all")) run_staged();
  if (!strcmp(what, "nccl") || !strcmp(what, "all")) run_nccl();
  if (!strcmp(what, "ipc") || !strcmp(what, "all")) run_ipc();
  printf("%d failure(s)\n", failures);
  return failures;
}
