/* KV transfer benchmark: bandwidth and latency of kvtransfer against
 * transfer size and block size, for each transport and memory kind this
 * machine has, next to the peak of the same path measured in the same run
 * (memcpy for host puts, pinned cudaMemcpy D2H / H2D for the staged GPU
 * path, cudaMemcpy device to device for CUDA IPC on one GPU,
 * cudaMemcpyPeer for CUDA IPC and NCCL between GPUs). Prints a table and appends
 * it to a results file (bench/RESULTS.md by default).
 *
 *   kv_transfer [--quick] [--max-mb N] [--results FILE] [--no-append]
 *               [--commit SHA] [--slots N] [--slot-mb N] [--stage-chunk-kb N]
 *               [--nccl-chunk-kb N] [--only host|tcp|staged|nccl|ipc]
 *               [--ipc-copy auto|kernel|engines] [--ipc-pieces N] [--trace]
 *
 * --nccl-chunk-kb: the NCCL pipeline's largest chunk on both sides (the
 * transfer context's default when absent); --only: measure one path;
 * --ipc-copy: how CUDA IPC copies (td_kvx_ipc_copy; auto when absent).
 * --ipc-pieces N: pieces per IPC chunk, one gather launch each (td_kvx_opts.ipc_chunk_pieces).
 * --trace: both sides keep td_kvx_opts.trace and print it on stderr at the
 * end ("kvx-trace NAME NS XID EVENT ARG"): where a transfer's time went.
 *
 * Receivers are separate processes (this program re-executed), one per
 * GPU in use. Time is from td_kvx_post to the sender's callback, which
 * fires after the receiver acknowledged that every byte landed. */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifdef TD_KVX_BENCH_CUDA
#include <cuda_runtime_api.h>
#endif
#ifdef TD_KVX_BENCH_NCCL
#include <nccl.h>
#endif

#include "common/clock.h"
#include "common/log.h"
#include "common/settings.h"
#include "kvtransfer/kvtransfer.h"

enum { KIND_HOST = 1, KIND_GPU = 2, N_BS = 2 };

/* Block sizes: a small block (2 layers x 8 heads x 64 x 16 slots, bf16:
 * 64 KiB) and a Flan-T5-large cross-attention block (24 layers x 16 heads,
 * 1.5 MiB). */
static td_kvx_geom bs_geom(int i) {
  td_kvx_geom g = {{2, 8, 64, 16, 0, 0}, 2, 0, 2, 0, 8};
  if (i == 1) g = (td_kvx_geom){{24, 16, 64, 16, 0, 0}, 2, 0, 24, 0, 16};
  return g;
}
static const char *bs_name(int i) { return i == 0 ? "64 KiB" : "1.5 MiB"; }
static uint32_t pool_id(int kind, int bs) { return (uint32_t)(kind * 10 + bs); }

static size_t g_max_bytes = (size_t)256 << 20;
static int g_slots = 8;
static size_t g_slot_bytes = (size_t)4 << 20;
static size_t g_stage_chunk; /* --stage-chunk-kb: the sender's steady staged chunk; 0: the context's default */
static size_t g_nccl_chunk; /* 0: the context's default */
static bool g_trace; /* --trace: td_kvx_opts.trace on both sides */

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

static bool rd(int fd, void *p, size_t n, int ms) {
  uint8_t *b = p;
  int64_t end = td_now_ms() + ms;
  while (n) {
    struct pollfd pf = {fd, POLLIN, 0};
    if (poll(&pf, 1, 20) > 0) {
      ssize_t r = read(fd, b, n);
      if (r <= 0) return false;
      b += r;
      n -= (size_t)r;
    }
    if (td_now_ms() > end) return false;
  }
  return true;
}

/* Memory for every block size's pool: one buffer per kind, registered once
 * per geometry. */
static void *alloc_kind(int kind, size_t bytes) {
  if (kind == KIND_HOST) {
    void *p = NULL;
    if (posix_memalign(&p, 4096, bytes)) return NULL;
    memset(p, 1, bytes); /* touch: no page faults in the timings */
    return p;
  }
#ifdef TD_KVX_BENCH_CUDA
  void *p = NULL;
  if (cudaMalloc(&p, bytes) != cudaSuccess) return NULL;
  cudaMemset(p, 1, bytes);
  cudaDeviceSynchronize();
  return p;
#else
  return NULL;
#endif
}

static td_status register_pools(td_kvx *k, void *host, void *gpu) {
  for (int b = 0; b < N_BS; b++) {
    td_kvx_geom g = bs_geom(b);
    int n = (int)(g_max_bytes / td_kvx_block_bytes(&g)) + 1;
    td_kvx_pool_desc h = {pool_id(KIND_HOST, b), TD_KVX_MEM_HOST, host, n, g};
    TD_TRY(td_kvx_register_pool(k, &h));
    if (gpu) {
      td_kvx_pool_desc d = {pool_id(KIND_GPU, b), TD_KVX_MEM_CUDA, gpu, n, g};
      TD_TRY(td_kvx_register_pool(k, &d));
    }
  }
  return TD_OK;
}

static size_t pool_bytes(void) {
  size_t m = 0;
  for (int b = 0; b < N_BS; b++) {
    td_kvx_geom g = bs_geom(b);
    size_t bb = td_kvx_block_bytes(&g);
    size_t need = ((g_max_bytes / bb) + 1) * bb;
    if (need > m) m = need;
  }
  return m;
}

/* ---- receiver process ---- */

static td_status grant_all(void *ctx, const td_kvx_grant_req *r) { return TD_OK; }

static int receiver(int device, int in, int out) {
  td_log_set_name("kvx-bench-rx");
  td_kvx_opts o;
  memset(&o, 0, sizeof o);
  o.name = "bench-rx";
  o.cuda_device = device;
  o.authorize = grant_all;
  o.staging_slots = g_slots;
  o.staging_slot_bytes = g_slot_bytes;
  o.nccl_chunk_bytes = g_nccl_chunk;
  o.trace = g_trace;
#ifdef TD_KVX_BENCH_CUDA
  if (device >= 0 && cudaSetDevice(device) != cudaSuccess) return 40;
#endif
  td_kvx *k;
  if (td_kvx_create(&o, &k) != TD_OK) {
    fprintf(stderr, "bench receiver: %s\n", td_errmsg());
    return 41;
  }
  size_t bytes = pool_bytes();
  void *host = alloc_kind(KIND_HOST, bytes), *gpu = device >= 0 ? alloc_kind(KIND_GPU, bytes) : NULL;
  if (!host || (device >= 0 && !gpu) || register_pools(k, host, gpu) != TD_OK) {
    fprintf(stderr, "bench receiver: %s\n", td_errmsg());
    return 42;
  }
  uint8_t *desc;
  size_t n;
  if (td_kvx_export(k, &desc, &n) != TD_OK) return 43;
  uint64_t len = n;
  wr(out, &len, 8);
  wr(out, desc, n);
  free(desc);
  for (;;) {
    td_kvx_progress(k);
    struct pollfd pf = {in, POLLIN, 0};
    if (poll(&pf, 1, 0) > 0) break; /* any byte or EOF: quit */
  }
  td_kvx_destroy(k);
  free(host);
#ifdef TD_KVX_BENCH_CUDA
  if (gpu) cudaFree(gpu);
#endif
  return 0;
}

typedef struct child {
  pid_t pid;
  int in, out;
} child;

static child spawn(int device) {
  int up[2], down[2];
  if (pipe(up) || pipe(down)) exit(2);
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    close(up[0]);
    close(down[1]);
    char a[8][32];
    snprintf(a[0], 32, "%d", device);
    snprintf(a[1], 32, "%d", down[0]);
    snprintf(a[2], 32, "%d", up[1]);
    snprintf(a[3], 32, "%zu", g_max_bytes);
    snprintf(a[4], 32, "%d", g_slots);
    snprintf(a[5], 32, "%zu", g_slot_bytes);
    snprintf(a[6], 32, "%zu", g_nccl_chunk);
    snprintf(a[7], 32, "%d", g_trace ? 1 : 0);
    execl("/proc/self/exe", "bench_kv_transfer", "--receiver", a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7],
          (char *)NULL);
    _exit(99);
  }
  close(up[1]);
  close(down[0]);
  return (child){pid, up[0], down[1]};
}

static void stop_child(child *c) {
  if (c->pid <= 0) return;
  wr(c->out, "q", 1);
  waitpid(c->pid, NULL, 0);
  close(c->in);
  close(c->out);
  c->pid = 0;
}

/* ---- sender ---- */

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

static td_kvx_peer *connect_to(td_kvx *k, child *c) {
  uint64_t len;
  if (!rd(c->in, &len, 8, 120000) || len > (1u << 20)) return NULL;
  uint8_t *desc = malloc(len);
  td_kvx_peer *p = NULL;
  if (!rd(c->in, desc, len, 10000) || td_kvx_connect(k, desc, len, &p) != TD_OK) p = NULL;
  free(desc);
  return p;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* One transfer of n blocks (scattered destinations); seconds, or < 0. */
static double one(td_kvx *k, td_kvx_peer *p, uint32_t sp, uint32_t dp, td_kvx_transport tr, int n, int32_t *src,
                  int32_t *dst) {
  td_kvx_xfer x = {1, 0, sp, dp, src, dst, n, 20000, tr, NULL, {0}};
  done d = {0};
  int64_t t0 = td_now_ns();
  if (td_kvx_post(p, &x, done_cb, &d, NULL) != TD_OK) {
    fprintf(stderr, "post: %s\n", td_errmsg());
    return -1;
  }
  while (!d.calls) td_kvx_progress(k);
  double s = (double)(td_now_ns() - t0) / 1e9;
  if (d.st != TD_OK) {
    fprintf(stderr, "transfer: %s: %s\n", td_status_str(d.st), d.msg);
    return -1;
  }
  return s;
}

typedef struct row {
  const char *path;
  int bs;
  double mb, ms, gbs, pct;
  double pipe; /* staged path: the bare CUDA pipeline of the same bytes (GB/s), 0 elsewhere */
} row;

/* The staged path's ceiling on this link: D2H of each chunk into pinned
 * memory, then its H2D on a second stream as soon as it landed, no
 * protocol and no second process (NULL where there is no GPU). */
static double (*g_pipe)(size_t bytes);
static size_t pipe_chunk = (size_t)2 << 20; /* the context's steady staged chunk */

static row rows[256];
static int n_rows;
static double lat_us[8];
static const char *lat_path[8];
static int n_lat;

static void measure_path(const char *name, td_kvx *k, td_kvx_peer *p, int kind_s, int kind_d, td_kvx_transport tr,
                         double peak, bool quick) {
  static const int sizes_mb[] = {1, 4, 16, 64, 256, 512, 1024};
  int32_t *src = malloc(sizeof(int32_t) * 20000), *dst = malloc(sizeof(int32_t) * 20000);
  for (int b = 0; b < N_BS; b++) {
    td_kvx_geom g = bs_geom(b);
    size_t bb = td_kvx_block_bytes(&g);
    int nblk = (int)(g_max_bytes / bb) + 1;
    for (size_t si = 0; si < sizeof sizes_mb / sizeof sizes_mb[0]; si++) {
      size_t want = (size_t)sizes_mb[si] << 20;
      if (want > g_max_bytes) break;
      int n = (int)((want + bb - 1) / bb);
      if (n > nblk) n = nblk;
      /* Sources in order, destinations scattered (a reservation's blocks
       * are rarely contiguous): one put per block, no coalescing. */
      for (int i = 0; i < n; i++) {
        src[i] = i;
        dst[i] = (int)(((int64_t)i * 7919) % nblk);
      }
      /* 7919 is prime; keep destinations distinct when nblk is a multiple of it. */
      if (nblk % 7919 == 0)
        for (int i = 0; i < n; i++) dst[i] = i;
      int reps = quick ? 2 : (want >= ((size_t)64 << 20) ? 5 : 10);
      double t[16];
      if (one(k, p, pool_id(kind_s, b), pool_id(kind_d, b), tr, n, src, dst) < 0) goto out; /* warm-up */
      for (int r = 0; r < reps; r++) {
        t[r] = one(k, p, pool_id(kind_s, b), pool_id(kind_d, b), tr, n, src, dst);
        if (t[r] < 0) goto out;
      }
      qsort(t, (size_t)reps, sizeof t[0], cmp_d);
      double med = t[reps / 2];
      double bytes = (double)n * (double)bb;
      row *rw = &rows[n_rows++];
      rw->path = name;
      rw->bs = b;
      rw->mb = bytes / 1048576.0;
      rw->ms = med * 1e3;
      rw->gbs = bytes / med / 1e9;
      rw->pct = peak > 0 ? 100.0 * rw->gbs / peak : 0;
      rw->pipe = tr == TD_KVX_UCX && kind_s == KIND_GPU && g_pipe ? g_pipe((size_t)bytes) : 0;
      printf("%-22s %-8s %8.1f MB %9.3f ms %8.2f GB/s %6.1f%% of peak", name, bs_name(b), rw->mb, rw->ms, rw->gbs,
             rw->pct);
      if (rw->pipe > 0) printf(" %6.1f%% of the bare pipeline (%.2f GB/s)", 100.0 * rw->gbs / rw->pipe, rw->pipe);
      printf("\n");
      fflush(stdout);
    }
  }
  /* Latency: one 64 KiB block, median of 100. */
  {
    int reps = quick ? 20 : 100;
    double t[100];
    src[0] = 0;
    dst[0] = 1;
    for (int r = 0; r < reps; r++) {
      t[r] = one(k, p, pool_id(kind_s, 0), pool_id(kind_d, 0), tr, 1, src, dst);
      if (t[r] < 0) goto out;
    }
    qsort(t, (size_t)reps, sizeof t[0], cmp_d);
    lat_path[n_lat] = name;
    lat_us[n_lat++] = t[reps / 2] * 1e6;
    printf("%-22s latency of one 64 KiB block: %.1f us (median of %d)\n", name, t[reps / 2] * 1e6, reps);
  }
out:
  free(src);
  free(dst);
}

/* ---- peaks ---- */

static double peak_memcpy(void) {
  size_t n = g_max_bytes;
  uint8_t *a = alloc_kind(KIND_HOST, n), *b = alloc_kind(KIND_HOST, n);
  double best = 1e30;
  for (int r = 0; r < 5; r++) {
    int64_t t0 = td_now_ns();
    memcpy(b, a, n);
    double s = (double)(td_now_ns() - t0) / 1e9;
    if (s < best) best = s;
  }
  volatile uint8_t sink = b[n / 2];
  (void)sink;
  free(a);
  free(b);
  return (double)n / best / 1e9;
}

#ifdef TD_KVX_BENCH_CUDA
static double time_copy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind, int peer_dev, int src_dev) {
  double best = 1e30;
  for (int r = 0; r < 5; r++) {
    cudaDeviceSynchronize();
    int64_t t0 = td_now_ns();
    if (peer_dev >= 0)
      cudaMemcpyPeer(dst, peer_dev, src, src_dev, n);
    else
      cudaMemcpy(dst, src, n, kind);
    cudaDeviceSynchronize();
    double s = (double)(td_now_ns() - t0) / 1e9;
    if (s < best) best = s;
  }
  return (double)n / best / 1e9;
}

/* Device-to-host and host-to-device at once on two streams (what a
 * pipelined staged transfer does on one link): GB/s per direction. */
static double time_bidir(void *h_dst, const void *d_src, void *d_dst, const void *h_src, size_t n) {
  cudaStream_t s0, s1;
  cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking);
  double best = 1e30;
  for (int r = 0; r < 5; r++) {
    cudaDeviceSynchronize();
    int64_t t0 = td_now_ns();
    cudaMemcpyAsync(h_dst, d_src, n, cudaMemcpyDeviceToHost, s0);
    cudaMemcpyAsync(d_dst, h_src, n, cudaMemcpyHostToDevice, s1);
    cudaDeviceSynchronize();
    double t = (double)(td_now_ns() - t0) / 1e9;
    if (t < best) best = t;
  }
  cudaStreamDestroy(s0);
  cudaStreamDestroy(s1);
  return (double)n / best / 1e9;
}

static void *pipe_d0, *pipe_d1, *pipe_h;
static double time_pipe(size_t n) {
  cudaStream_t s0, s1;
  cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking);
  size_t nc = (n + pipe_chunk - 1) / pipe_chunk;
  cudaEvent_t *ev = malloc(sizeof(cudaEvent_t) * nc);
  for (size_t i = 0; i < nc; i++) cudaEventCreateWithFlags(&ev[i], cudaEventDisableTiming);
  double best = 1e30;
  for (int r = 0; r < 5; r++) {
    cudaDeviceSynchronize();
    int64_t t0 = td_now_ns();
    for (size_t i = 0; i < nc; i++) {
      size_t off = i * pipe_chunk, len = n - off < pipe_chunk ? n - off : pipe_chunk;
      cudaMemcpyAsync((uint8_t *)pipe_h + off, (const uint8_t *)pipe_d0 + off, len, cudaMemcpyDeviceToHost, s0);
      cudaEventRecord(ev[i], s0);
      cudaStreamWaitEvent(s1, ev[i], 0);
      cudaMemcpyAsync((uint8_t *)pipe_d1 + off, (const uint8_t *)pipe_h + off, len, cudaMemcpyHostToDevice, s1);
    }
    cudaDeviceSynchronize();
    double t = (double)(td_now_ns() - t0) / 1e9;
    if (t < best) best = t;
  }
  for (size_t i = 0; i < nc; i++) cudaEventDestroy(ev[i]);
  free(ev);
  cudaStreamDestroy(s0);
  cudaStreamDestroy(s1);
  return (double)n / best / 1e9;
}
#endif

#ifdef TD_KVX_BENCH_NCCL
/* NCCL's own send/recv between GPU 0 and GPU 1 (one process, two
 * communicators): the NCCL path's peak without our protocol. */
static double peak_nccl(size_t n) {
  ncclComm_t comms[2];
  int devs[2] = {0, 1};
  if (ncclCommInitAll(comms, 2, devs) != ncclSuccess) return 0;
  void *b[2] = {NULL, NULL};
  cudaStream_t s[2];
  for (int i = 0; i < 2; i++) {
    cudaSetDevice(i);
    cudaMalloc(&b[i], n);
    cudaStreamCreate(&s[i]);
  }
  double best = 1e30;
  for (int r = 0; r < 6; r++) {
    int64_t t0 = td_now_ns();
    ncclGroupStart();
    ncclSend(b[0], n, ncclUint8, 1, comms[0], s[0]);
    ncclRecv(b[1], n, ncclUint8, 0, comms[1], s[1]);
    ncclGroupEnd();
    for (int i = 0; i < 2; i++) {
      cudaSetDevice(i);
      cudaStreamSynchronize(s[i]);
    }
    double t = (double)(td_now_ns() - t0) / 1e9;
    if (r > 0 && t < best) best = t; /* the first one sets up the connection */
  }
  for (int i = 0; i < 2; i++) {
    ncclCommDestroy(comms[i]);
    cudaSetDevice(i);
    cudaFree(b[i]);
    cudaStreamDestroy(s[i]);
  }
  cudaSetDevice(0);
  return (double)n / best / 1e9;
}
#endif

static void git_commit(char *out, size_t cap) {
  snprintf(out, cap, "unknown");
  FILE *f = popen("git rev-parse --short HEAD 2>/dev/null", "r");
  if (!f) return;
  if (fgets(out, (int)cap, f)) out[strcspn(out, "\n")] = 0;
  if (!out[0]) snprintf(out, cap, "unknown");
  pclose(f);
}

static void cpu_name(char *out, size_t cap) {
  snprintf(out, cap, "cpu");
  FILE *f = fopen("/proc/cpuinfo", "r");
  if (!f) return;
  char line[256];
  while (fgets(line, sizeof line, f)) {
    if (!strncmp(line, "model name", 10)) {
      char *c = strchr(line, ':');
      if (c) snprintf(out, cap, "%s", c + 2);
      out[strcspn(out, "\n")] = 0;
      break;
    }
  }
  fclose(f);
}

int main(int argc, char **argv) {
  td_settings settings;
  if (td_settings_from_env(&settings) != TD_OK) {
    fprintf(stderr, "bench: %s\n", td_errmsg());
    return 2;
  }
  td_settings_apply(&settings);
  setvbuf(stdout, NULL, _IOLBF, 0);
  signal(SIGPIPE, SIG_IGN);
  if (argc == 10 && !strcmp(argv[1], "--receiver")) {
    g_max_bytes = strtoull(argv[5], NULL, 10);
    g_slots = atoi(argv[6]);
    g_slot_bytes = strtoull(argv[7], NULL, 10);
    g_nccl_chunk = strtoull(argv[8], NULL, 10);
    g_trace = atoi(argv[9]) != 0;
    return receiver(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]));
  }
  bool quick = false, append = true;
  const char *results = "bench/RESULTS.md", *only = NULL, *ipc_copy = "auto";
  int ipc_pieces = 0; /* 0: the context's default */
  char commit[64] = "";
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--quick")) {
      quick = true;
    } else if (!strcmp(argv[i], "--no-append")) {
      append = false;
    } else if (!strcmp(argv[i], "--max-mb") && i + 1 < argc) {
      g_max_bytes = strtoull(argv[++i], NULL, 10) << 20;
    } else if (!strcmp(argv[i], "--results") && i + 1 < argc) {
      results = argv[++i];
    } else if (!strcmp(argv[i], "--commit") && i + 1 < argc) {
      snprintf(commit, sizeof commit, "%s", argv[++i]);
    } else if (!strcmp(argv[i], "--slots") && i + 1 < argc) {
      g_slots = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--slot-mb") && i + 1 < argc) {
      g_slot_bytes = strtoull(argv[++i], NULL, 10) << 20;
    } else if (!strcmp(argv[i], "--stage-chunk-kb") && i + 1 < argc) {
      g_stage_chunk = strtoull(argv[++i], NULL, 10) << 10;
    } else if (!strcmp(argv[i], "--nccl-chunk-kb") && i + 1 < argc) {
      g_nccl_chunk = strtoull(argv[++i], NULL, 10) << 10;
    } else if (!strcmp(argv[i], "--ipc-copy") && i + 1 < argc &&
               (!strcmp(argv[i + 1], "auto") || !strcmp(argv[i + 1], "kernel") || !strcmp(argv[i + 1], "engines"))) {
      ipc_copy = argv[++i];
    } else if (!strcmp(argv[i], "--trace")) {
      g_trace = true;
    } else if (!strcmp(argv[i], "--ipc-pieces") && i + 1 < argc) {
      ipc_pieces = atoi(argv[++i]);
      if (ipc_pieces < 16 || ipc_pieces > 1000) {
        fprintf(stderr, "%s: --ipc-pieces: 16 to 1000 pieces a chunk\n", argv[0]);
        return 2;
      }
    } else if (!strcmp(argv[i], "--only") && i + 1 < argc &&
               (!strcmp(argv[i + 1], "host") || !strcmp(argv[i + 1], "tcp") || !strcmp(argv[i + 1], "staged") ||
                !strcmp(argv[i + 1], "nccl") || !strcmp(argv[i + 1], "ipc"))) {
      only = argv[++i];
    } else {
      fprintf(stderr, "usage: %s [--quick] [--max-mb N] [--results FILE] [--no-append] [--commit SHA] [--slots N] "
                      "[--slot-mb N] [--stage-chunk-kb N] [--nccl-chunk-kb N] [--only host|tcp|staged|nccl|ipc] [--ipc-copy auto|kernel|engines] "
                      "[--ipc-pieces N] [--trace]\n",
              argv[0]);
      return 2;
    }
  }
  if (!commit[0]) git_commit(commit, sizeof commit);
  td_log_set_name("kvx-bench");
  int ngpu = 0;
  char device[256];
  cpu_name(device, sizeof device);
  double p_memcpy = peak_memcpy(), p_d2h = 0, p_h2d = 0, p_bidir = 0, p_peer = 0, p_staged = 0, p_nccl = 0, p_d2d = 0;
  printf("peak memcpy (one thread, %zu MB): %.2f GB/s\n", g_max_bytes >> 20, p_memcpy);
#ifdef TD_KVX_BENCH_CUDA
  if (cudaGetDeviceCount(&ngpu) != cudaSuccess) ngpu = 0;
  if (ngpu > 0) {
    struct cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    char cpu[200];
    snprintf(cpu, sizeof cpu, "%s", device);
    snprintf(device, sizeof device, "%d x %s, %s", ngpu, prop.name, cpu);
    cudaSetDevice(0);
    void *h = NULL, *d = NULL;
    cudaHostAlloc(&h, g_max_bytes, cudaHostAllocPortable);
    cudaMalloc(&d, g_max_bytes);
    p_d2h = time_copy(h, d, g_max_bytes, cudaMemcpyDeviceToHost, -1, -1);
    p_h2d = time_copy(d, h, g_max_bytes, cudaMemcpyHostToDevice, -1, -1);
    p_staged = p_d2h < p_h2d ? p_d2h : p_h2d;
    printf("peak pinned D2H %.2f GB/s, H2D %.2f GB/s (staged path peak %.2f)\n", p_d2h, p_h2d, p_staged);
    {
      size_t half = g_max_bytes / 2;
      p_bidir = time_bidir(h, d, (uint8_t *)d + half, (uint8_t *)h + half, half);
      printf("pinned D2H and H2D at once: %.2f GB/s each\n", p_bidir);
    }
    if (cudaMalloc(&pipe_d0, g_max_bytes) == cudaSuccess && cudaMalloc(&pipe_d1, g_max_bytes) == cudaSuccess &&
        cudaHostAlloc(&pipe_h, g_max_bytes, cudaHostAllocPortable) == cudaSuccess) {
      if (g_stage_chunk) pipe_chunk = g_stage_chunk;
      g_pipe = time_pipe;
    }
    cudaGetLastError();
    void *d2 = NULL;
    if (cudaMalloc(&d2, g_max_bytes) == cudaSuccess) {
      p_d2d = time_copy(d2, d, g_max_bytes, cudaMemcpyDeviceToDevice, -1, -1);
      printf("peak cudaMemcpy device to device on GPU 0: %.2f GB/s (CUDA IPC on one GPU)\n", p_d2d);
      cudaFree(d2);
    }
    cudaGetLastError();
    if (ngpu >= 2) {
      void *d1 = NULL;
      cudaSetDevice(1);
      cudaMalloc(&d1, g_max_bytes);
      cudaDeviceEnablePeerAccess(0, 0);
      cudaSetDevice(0);
      cudaDeviceEnablePeerAccess(1, 0);
      cudaGetLastError();
      p_peer = time_copy(d1, d, g_max_bytes, cudaMemcpyDefault, 1, 0);
      printf("peak cudaMemcpyPeer GPU0 -> GPU1: %.2f GB/s\n", p_peer);
      cudaFree(d1);
#ifdef TD_KVX_BENCH_NCCL
      p_nccl = peak_nccl(g_max_bytes);
      printf("peak NCCL send/recv GPU0 -> GPU1 (one process): %.2f GB/s\n", p_nccl);
#endif
    }
    cudaFreeHost(h);
    cudaFree(d);
  }
#endif

  /* Receivers first (they allocate and register while we wait). */
  child rx0 = spawn(ngpu > 0 ? 0 : -1), rx1 = {0};
  if (ngpu >= 2) rx1 = spawn(1);

  td_kvx_opts o;
  memset(&o, 0, sizeof o);
  o.name = "bench-tx";
  o.cuda_device = ngpu > 0 ? 0 : -1;
  o.staging_slots = g_slots;
  o.staging_slot_bytes = g_slot_bytes;
  o.staging_chunk_bytes = g_stage_chunk;
  o.nccl_chunk_bytes = g_nccl_chunk;
  o.ipc_copy = !strcmp(ipc_copy, "kernel")    ? TD_KVX_IPC_COPY_KERNEL
               : !strcmp(ipc_copy, "engines") ? TD_KVX_IPC_COPY_ENGINES
                                              : TD_KVX_IPC_COPY_AUTO;
  o.ipc_chunk_pieces = ipc_pieces;
  o.trace = g_trace;
  td_kvx *k = NULL, *ktcp = NULL;
  td_kvx_opts ot = o;
  ot.name = "bench-tx-tcp";
  ot.local_path = TD_KVX_LOCAL_OFF;
  ot.cuda_device = -1;
  if (td_kvx_create(&o, &k) != TD_OK || td_kvx_create(&ot, &ktcp) != TD_OK) {
    fprintf(stderr, "engine: %s\n", td_errmsg());
    return 1;
  }
  size_t bytes = pool_bytes();
  void *host = alloc_kind(KIND_HOST, bytes), *gpu = ngpu > 0 ? alloc_kind(KIND_GPU, bytes) : NULL;
  if (register_pools(k, host, gpu) != TD_OK || register_pools(ktcp, host, NULL) != TD_OK) {
    fprintf(stderr, "pools: %s\n", td_errmsg());
    return 1;
  }
  uint8_t *d0 = NULL;
  size_t d0n = 0;
  {
    uint64_t len;
    if (!rd(rx0.in, &len, 8, 120000)) return 1;
    d0 = malloc(len);
    d0n = len;
    if (!rd(rx0.in, d0, len, 10000)) return 1;
  }
  td_kvx_peer *p0 = NULL, *p0tcp = NULL, *p1 = NULL;
  if (td_kvx_connect(k, d0, d0n, &p0) != TD_OK || td_kvx_connect(ktcp, d0, d0n, &p0tcp) != TD_OK) {
    fprintf(stderr, "connect: %s\n", td_errmsg());
    return 1;
  }
  free(d0);
  if (ngpu >= 2) p1 = connect_to(k, &rx1);

  printf("\n%-22s %-8s %11s %12s %13s\n", "path", "block", "size", "median", "bandwidth");
#define WANT(name) (!only || !strcmp(only, name))
  if (WANT("host")) measure_path("UCX host->host", k, p0, KIND_HOST, KIND_HOST, TD_KVX_UCX, p_memcpy, quick);
  if (WANT("tcp")) measure_path("UCX host->host tcp", ktcp, p0tcp, KIND_HOST, KIND_HOST, TD_KVX_UCX, p_memcpy, true);
  if (ngpu > 0 && WANT("staged"))
    measure_path("UCX GPU->GPU staged", k, p0, KIND_GPU, KIND_GPU, TD_KVX_UCX, p_staged, quick);
  if (p1 && WANT("nccl"))
    measure_path("NCCL GPU0->GPU1", k, p1, KIND_GPU, KIND_GPU, TD_KVX_NCCL, p_nccl > 0 ? p_nccl : p_peer, quick);
  /* CUDA IPC: the receiver's pool mapped here, device-to-device copies. */
  char ipc_one[64], ipc_two[64];
  char pcs[16] = "";
  if (ipc_pieces) snprintf(pcs, sizeof pcs, " /%d", ipc_pieces);
  snprintf(ipc_one, sizeof ipc_one, "IPC GPU->GPU one GPU %s%s", ipc_copy, pcs);
  snprintf(ipc_two, sizeof ipc_two, "IPC GPU0->GPU1 %s%s", ipc_copy, pcs);
  if (ngpu > 0 && WANT("ipc")) measure_path(ipc_one, k, p0, KIND_GPU, KIND_GPU, TD_KVX_IPC, p_d2d, quick);
  if (p1 && WANT("ipc")) measure_path(ipc_two, k, p1, KIND_GPU, KIND_GPU, TD_KVX_IPC, p_peer, quick);

  td_kvx_disconnect(p0);
  td_kvx_disconnect(p0tcp);
  if (p1) td_kvx_disconnect(p1);
  td_kvx_destroy(k);
  td_kvx_destroy(ktcp);
  stop_child(&rx0);
  stop_child(&rx1);

  /* Target: >= 80% of the path's peak from 16 MB up. */
  printf("\n");
  const char *paths[] = {"UCX host->host",  "UCX host->host tcp",   "UCX GPU->GPU staged",
                         "NCCL GPU0->GPU1", "IPC GPU->GPU one GPU", "IPC GPU0->GPU1"};
  enum { N_PATHS = sizeof paths / sizeof paths[0] };
  char verdict[N_PATHS][160];
  for (int pi = 0; pi < N_PATHS; pi++) {
    double lo = 1e9;
    int cnt = 0;
    for (int i = 0; i < n_rows; i++)
      if (!strcmp(rows[i].path, paths[pi]) && rows[i].mb >= 16) {
        if (rows[i].pct < lo) lo = rows[i].pct;
        cnt++;
      }
    if (cnt)
      snprintf(verdict[pi], sizeof verdict[pi], "%s: lowest %.0f%% of peak from 16 MB up (%s)", paths[pi], lo,
               lo >= 80 ? "meets the 80% target" : "below the 80% target");
    else
      verdict[pi][0] = 0;
    if (verdict[pi][0]) printf("%s\n", verdict[pi]);
  }

  if (append) {
    FILE *f = fopen(results, "a+");
    if (!f) {
      fprintf(stderr, "%s: %s\n", results, strerror(errno));
      return 1;
    }
    fseek(f, 0, SEEK_END);
    if (ftell(f) == 0) fprintf(f, "# Benchmark results\n\nAppended by the programs in `bench/` (date, device, commit, figures). Newest last.\n");
    char when[64];
    time_t now = time(NULL);
    strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", gmtime(&now));
    fprintf(f, "\n## kv_transfer — %s, %s, commit %s\n\n", when, device, commit);
    fprintf(f, "Peaks measured in this run: memcpy (one thread) %.2f GB/s", p_memcpy);
    if (ngpu > 0)
      fprintf(f, "; pinned D2H %.2f GB/s, H2D %.2f GB/s (staged path peak = the lower); both at once %.2f GB/s each; "
                 "cudaMemcpy device to device %.2f GB/s (the IPC path's peak on one GPU)",
              p_d2h, p_h2d, p_bidir, p_d2d);
    if (ngpu > 1)
      fprintf(f, "; cudaMemcpyPeer GPU0->GPU1 %.2f GB/s (the IPC path's peak between GPUs); NCCL send/recv "
                 "GPU0->GPU1 in one process %.2f GB/s (the NCCL path's peak)", p_peer, p_nccl);
    if (g_nccl_chunk) fprintf(f, ". NCCL chunks up to %zu KiB", g_nccl_chunk >> 10);
    if (g_pipe)
      fprintf(f, ". Bare pipeline: the same bytes as D2H chunks of %zu KiB, each followed by its H2D on a second "
                 "stream, one process, no protocol (the staged path's ceiling on this link)", pipe_chunk >> 10);
    fprintf(f, ". Staging: %d slots of %zu MiB, chunks up to %s. Time from post to the sender's callback (after the "
               "receiver's acknowledgement), median; destinations scattered (one copy per block).\n\n",
            g_slots, g_slot_bytes >> 20, g_stage_chunk ? "--stage-chunk-kb" : "the engine's default");
    fprintf(f, "| path | block | MB | ms | GB/s | %% of path peak | bare pipeline GB/s | %% of it |\n"
               "|---|---|---:|---:|---:|---:|---:|---:|\n");
    for (int i = 0; i < n_rows; i++) {
      fprintf(f, "| %s | %s | %.1f | %.3f | %.2f | %.0f |", rows[i].path, bs_name(rows[i].bs), rows[i].mb, rows[i].ms,
              rows[i].gbs, rows[i].pct);
      if (rows[i].pipe > 0) fprintf(f, " %.2f | %.0f |\n", rows[i].pipe, 100.0 * rows[i].gbs / rows[i].pipe);
      else fprintf(f, " - | - |\n");
    }
    fprintf(f, "\nLatency, one 64 KiB block (median):");
    for (int i = 0; i < n_lat; i++) fprintf(f, "%s %s %.1f us", i ? ";" : "", lat_path[i], lat_us[i]);
    fprintf(f, ".\n");
    for (int pi = 0; pi < N_PATHS; pi++)
      if (verdict[pi][0]) fprintf(f, "\n- %s", verdict[pi]);
    fprintf(f, "\n");
    fclose(f);
    printf("appended to %s\n", results);
  }
  free(host);
#ifdef TD_KVX_BENCH_CUDA
  if (pipe_d0) cudaFree(pipe_d0);
  if (pipe_d1) cudaFree(pipe_d1);
  if (pipe_h) cudaFreeHost(pipe_h);
  if (gpu) cudaFree(gpu);
#endif
  return 0;
}
