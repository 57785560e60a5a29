/* NCCL communicators of the CUDA backend: two ranks, one thread and one GPU
 * each, all-reduce (bf16, float32, int32; bf16 at many sizes through the
 * one-shot kernel and NCCL), all-gather and send/recv, eager and inside a
 * captured graph. Needs two GPUs; skipped with fewer. */
#include <criterion/criterion.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "common/settings.h"
#include "gpu_main.h"
#include "kernels/ops.h"

enum { N = 4099, WORLD = 2 };

static td_cuda_tuning cuda_tuning; /* from the environment, in every test process */
static void read_env(void) { td_gpu_read_env(&cuda_tuning); }
TD_GPU_ENV(read_env)

typedef struct rank_arg {
  int rank;
  const uint8_t *id;
  char fail[256]; /* empty: passed */
} rank_arg;

#define FAIL(...)                                           \
  do {                                                      \
    snprintf(a->fail, sizeof a->fail, __VA_ARGS__);         \
    goto out;                                               \
  } while (0)
#define OK(x, what)                                                      \
  do {                                                                   \
    if ((x) != TD_OK) FAIL("rank %d: %s: %s", a->rank, what, td_errmsg()); \
  } while (0)

/* A rank's end: its communicator aborted after a failure (so the peer's
 * waits end) or destroyed, then its backend. */
static void rank_close(td_backend *b, td_comm *c, bool failed) {
  if (c) {
    if (failed) td_comm_abort(c);
    else td_comm_destroy(c);
  }
  if (b) td_backend_set_comm(b, NULL);
  td_backend_destroy(b);
}

static void *rank_main(void *p) {
  rank_arg *a = p;
  td_backend *b = NULL;
  td_comm *c = NULL;
  void *f = NULL, *h = NULL, *i32 = NULL, *g = NULL;
  float *x = malloc(sizeof(float) * N * WORLD), *y = malloc(sizeof(float) * N * WORLD);
  td_backend_opts o = {.kind = TD_BACKEND_CUDA, .device = a->rank, .cuda = cuda_tuning};
  OK(td_backend_create(&o, &b), "backend");
  OK(td_comm_create_nccl(b, a->id, a->rank, WORLD, &c), "communicator");
  td_backend_set_comm(b, c);
  OK(td_alloc(b, TD_BUF_F32, N, &f), "alloc");
  OK(td_alloc(b, TD_BUF_ACT, N, &h), "alloc");
  OK(td_alloc(b, TD_BUF_I32, N, &i32), "alloc");
  OK(td_alloc(b, TD_BUF_F32, (size_t)N * WORLD, &g), "alloc");
  for (int i = 0; i < N; i++) x[i] = (float)((i % 97) - 40 + a->rank * 3); /* exact in bf16 */
  OK(td_upload(b, TD_BUF_F32, f, x, N), "upload");
  OK(td_upload(b, TD_BUF_ACT, h, x, N), "upload");
  int32_t *xi = (int32_t *)y;
  for (int i = 0; i < N; i++) xi[i] = i * 7 + a->rank;
  OK(td_upload(b, TD_BUF_I32, i32, (const float *)xi, N), "upload");
  OK(td_allreduce_sum(b, f, TD_BUF_F32, N), "allreduce f32");
  OK(td_allreduce_sum(b, h, TD_BUF_ACT, N), "allreduce bf16");
  OK(td_allreduce_sum(b, i32, TD_BUF_I32, N), "allreduce i32");
  OK(td_allgather(b, f, g, TD_BUF_F32, N), "allgather");
  OK(td_sync(b), "sync");
  OK(td_download(b, TD_BUF_F32, f, y, N), "download");
  for (int i = 0; i < N; i++)
    if (y[i] != (float)(2 * ((i % 97) - 40) + 3)) FAIL("rank %d: f32 sum[%d] = %g", a->rank, i, y[i]);
  OK(td_download(b, TD_BUF_ACT, h, y, N), "download");
  for (int i = 0; i < N; i++)
    if (y[i] != (float)(2 * ((i % 97) - 40) + 3)) FAIL("rank %d: bf16 sum[%d] = %g", a->rank, i, y[i]);
  OK(td_download(b, TD_BUF_I32, i32, y, N), "download");
  for (int i = 0; i < N; i++)
    if (xi[i] != 14 * i + 1) FAIL("rank %d: i32 sum[%d] = %d", a->rank, i, xi[i]);
  OK(td_download(b, TD_BUF_F32, g, y, (size_t)N * WORLD), "download");
  for (int r = 0; r < WORLD; r++)
    for (int i = 0; i < N; i++)
      if (y[r * N + i] != (float)(2 * ((i % 97) - 40) + 3)) FAIL("rank %d: gather[%d][%d] = %g", a->rank, r, i, y[r * N + i]);
  /* point to point, captured in a graph and replayed twice */
  for (int i = 0; i < N; i++) x[i] = (float)(i + 1000 * a->rank);
  OK(td_upload(b, TD_BUF_F32, f, x, N), "upload");
  td_graph *gr = NULL;
  OK(td_graph_begin(b), "graph begin");
  td_status s1 = a->rank == 0 ? td_send(b, f, TD_BUF_F32, N, 1) : td_recv(b, f, TD_BUF_F32, N, 0);
  td_status s2 = td_graph_end(b, &gr);
  OK(s1, "send/recv capture");
  OK(s2, "graph end");
  for (int rep = 0; rep < 2; rep++) OK(td_graph_launch(b, gr), "graph launch");
  OK(td_sync(b), "sync");
  td_graph_destroy(b, gr);
  OK(td_download(b, TD_BUF_F32, f, y, N), "download");
  for (int i = 0; i < N; i++)
    if (y[i] != (float)i) FAIL("rank %d: received[%d] = %g", a->rank, i, y[i]);
  /* a send and a receive in one group, both ranks at once: f goes out, g[0, N) comes in */
  for (int i = 0; i < N; i++) x[i] = (float)(7 * i + 1000 * a->rank);
  OK(td_upload(b, TD_BUF_F32, f, x, N), "upload");
  OK(td_sendrecv(b, f, TD_BUF_F32, N, 1 - a->rank, g, TD_BUF_F32, N, 1 - a->rank), "sendrecv");
  OK(td_sync(b), "sync");
  OK(td_download(b, TD_BUF_F32, g, y, N), "download");
  for (int i = 0; i < N; i++)
    if (y[i] != (float)(7 * i + 1000 * (1 - a->rank))) FAIL("rank %d: sendrecv got [%d] = %g", a->rank, i, y[i]);
out:
  if (b) {
    td_free(b, f);
    td_free(b, h);
    td_free(b, i32);
    td_free(b, g);
  }
  rank_close(b, c, a->fail[0]);
  free(x);
  free(y);
  return NULL;
}

/* WORLD ranks on threads, one GPU each, joined by one NCCL id; each rank's failure reported */
static void run_ranks(void *(*fn)(void *)) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < WORLD) cr_skip_test("needs %d GPUs, %d visible", WORLD, n);
  uint8_t id[TD_NCCL_ID_BYTES];
  cr_assert(td_comm_nccl_id(id) == TD_OK, "%s", td_errmsg());
  rank_arg args[WORLD];
  pthread_t th[WORLD];
  for (int r = 0; r < WORLD; r++) {
    args[r] = (rank_arg){.rank = r, .id = id};
    cr_assert(pthread_create(&th[r], NULL, fn, &args[r]) == 0);
  }
  for (int r = 0; r < WORLD; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < WORLD; r++) cr_expect(args[r].fail[0] == 0, "%s", args[r].fail);
}

Test(cuda_comm, two_ranks, .timeout = 120) {
  run_ranks(rank_main);
}

/* The bf16 all-reduce at the sizes decoding uses and odd ones, eager and in
 * a graph replayed many times (the one-shot kernel's slots rotate with
 * every call), against a CPU sum in rank order: the one-shot path must
 * give these bits on every rank; larger messages go through NCCL. */
enum { SEQ = 4, REPS = 40 };
static const size_t sizes[] = {1, 7, 8, 2048, 4099, 131075, 524288 + 9, 1500 * 1280, 2097152 + 9};
#define N_SIZES (sizeof sizes / sizeof sizes[0])
static const size_t seq_sizes[SEQ] = {2048, 7, 131075, 2048};

static float rnd(uint64_t *s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  uint32_t r = (uint32_t)(*s >> 33);
  if (r % 61 == 0) return -0.0f; /* the one-shot kernel's "not arrived" mark must pass as a value */
  return ((float)(r % 20001) - 10000.0f) / 977.0f;
}

/* the inputs of rank r for (size, rep), rounded to bf16 by the backend */
static void inputs(int r, size_t n, int rep, float *x) {
  uint64_t s = 0x9e3779b97f4a7c15ull ^ ((uint64_t)r << 40) ^ ((uint64_t)n << 8) ^ (uint64_t)rep;
  for (size_t i = 0; i < n; i++) x[i] = rnd(&s);
}

static float to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  memcpy(&f, &u, 4);
  return f;
}

/* the expected sum: bf16 inputs summed in float in rank order, rounded once */
static void expected(size_t n, int rep, float *want, float *tmp) {
  for (size_t i = 0; i < n; i++) want[i] = 0.0f;
  for (int r = 0; r < WORLD; r++) {
    inputs(r, n, rep, tmp);
    for (size_t i = 0; i < n; i++) want[i] += to_bf16(tmp[i]);
  }
  for (size_t i = 0; i < n; i++) want[i] = to_bf16(want[i]);
}

typedef struct sum_arg {
  int rank;
  const uint8_t *id;
  float *got[N_SIZES + SEQ]; /* each rank's results, compared across ranks by the test */
  char fail[256];
} sum_arg;

static void *sum_main(void *p) {
  sum_arg *a = p;
  td_backend *b = NULL;
  td_comm *c = NULL;
  td_graph *gr = NULL;
  void *buf[SEQ] = {0};
  size_t big = sizes[N_SIZES - 1];
  float *x = malloc(sizeof(float) * big), *want = malloc(sizeof(float) * big), *tmp = malloc(sizeof(float) * big);
  td_backend_opts o = {.kind = TD_BACKEND_CUDA, .device = a->rank, .cuda = cuda_tuning};
  if (td_backend_create(&o, &b) != TD_OK) {
    snprintf(a->fail, sizeof a->fail, "rank %d: backend: %s", a->rank, td_errmsg());
    goto out;
  }
  if (td_comm_create_nccl(b, a->id, a->rank, WORLD, &c) != TD_OK) {
    snprintf(a->fail, sizeof a->fail, "rank %d: communicator: %s", a->rank, td_errmsg());
    goto out;
  }
  td_backend_set_comm(b, c);
  for (int k = 0; k < SEQ; k++)
    if (td_alloc(b, TD_BUF_ACT, big, &buf[k]) != TD_OK) {
      snprintf(a->fail, sizeof a->fail, "alloc: %s", td_errmsg());
      goto out;
    }
  /* eager, every size */
  for (size_t si = 0; si < N_SIZES; si++) {
    size_t n = sizes[si];
    inputs(a->rank, n, 0, x);
    if (td_upload(b, TD_BUF_ACT, buf[0], x, n) != TD_OK || td_allreduce_sum(b, buf[0], TD_BUF_ACT, n) != TD_OK ||
        td_sync(b) != TD_OK || td_download(b, TD_BUF_ACT, buf[0], x, n) != TD_OK) {
      snprintf(a->fail, sizeof a->fail, "rank %d: size %zu: %s", a->rank, n, td_errmsg());
      goto out;
    }
    expected(n, 0, want, tmp);
    for (size_t i = 0; i < n; i++)
      if (fabsf(x[i] - want[i]) > (n * 2 > (4u << 20) ? 0.01f * fabsf(want[i]) + 1e-3f : 0.0f)) {
        snprintf(a->fail, sizeof a->fail, "rank %d: size %zu: sum[%zu] = %g, want %g", a->rank, n, i, x[i], want[i]);
        goto out;
      }
    a->got[si] = malloc(sizeof(float) * n);
    memcpy(a->got[si], x, sizeof(float) * n);
  }
  /* a graph of four all-reduces of mixed sizes, replayed with fresh inputs */
  if (td_graph_begin(b) != TD_OK) {
    snprintf(a->fail, sizeof a->fail, "graph begin: %s", td_errmsg());
    goto out;
  }
  td_status cs = TD_OK;
  for (int k = 0; k < SEQ && cs == TD_OK; k++) cs = td_allreduce_sum(b, buf[k], TD_BUF_ACT, seq_sizes[k]);
  td_status es = td_graph_end(b, &gr);
  if (cs != TD_OK || es != TD_OK) {
    snprintf(a->fail, sizeof a->fail, "rank %d: capture: %s", a->rank, td_errmsg());
    goto out;
  }
  for (int rep = 1; rep <= REPS; rep++) {
    for (int k = 0; k < SEQ; k++) {
      inputs(a->rank, seq_sizes[k], rep * SEQ + k, x);
      if (td_upload(b, TD_BUF_ACT, buf[k], x, seq_sizes[k]) != TD_OK) goto io;
    }
    if (td_graph_launch(b, gr) != TD_OK || td_sync(b) != TD_OK) goto io;
    for (int k = 0; k < SEQ; k++) {
      size_t n = seq_sizes[k];
      if (td_download(b, TD_BUF_ACT, buf[k], x, n) != TD_OK) goto io;
      expected(n, rep * SEQ + k, want, tmp);
      for (size_t i = 0; i < n; i++)
        if (x[i] != want[i]) {
          snprintf(a->fail, sizeof a->fail, "rank %d: replay %d, all-reduce %d (%zu values): sum[%zu] = %g, want %g",
                   a->rank, rep, k, n, i, x[i], want[i]);
          goto out;
        }
      if (rep == REPS) {
        a->got[N_SIZES + k] = malloc(sizeof(float) * n);
        memcpy(a->got[N_SIZES + k], x, sizeof(float) * n);
      }
    }
  }
  goto out;
io:
  snprintf(a->fail, sizeof a->fail, "rank %d: %s", a->rank, td_errmsg());
out:
  if (gr) td_graph_destroy(b, gr);
  for (int k = 0; k < SEQ; k++)
    if (buf[k]) td_free(b, buf[k]);
  rank_close(b, c, a->fail[0]);
  free(x);
  free(want);
  free(tmp);
  return NULL;
}

Test(cuda_comm, allreduce_sizes_and_replays, .timeout = 300) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < WORLD) cr_skip_test("needs %d GPUs, %d visible", WORLD, n);
  uint8_t id[TD_NCCL_ID_BYTES];
  cr_assert(td_comm_nccl_id(id) == TD_OK, "%s", td_errmsg());
  sum_arg args[WORLD];
  pthread_t th[WORLD];
  for (int r = 0; r < WORLD; r++) {
    args[r] = (sum_arg){.rank = r, .id = id};
    cr_assert(pthread_create(&th[r], NULL, sum_main, &args[r]) == 0);
  }
  for (int r = 0; r < WORLD; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < WORLD; r++) cr_expect(args[r].fail[0] == 0, "%s", args[r].fail);
  /* every rank holds the same bits */
  for (size_t k = 0; k < N_SIZES + SEQ; k++) {
    size_t len = k < N_SIZES ? sizes[k] : seq_sizes[k - N_SIZES];
    if (args[0].got[k] && args[1].got[k])
      cr_expect(memcmp(args[0].got[k], args[1].got[k], sizeof(float) * len) == 0, "ranks differ in result %zu", k);
    for (int r = 0; r < WORLD; r++) free(args[r].got[k]);
  }
}

/* td_allgather_rows: over the P2P slots (aligned, a rank's block within a
 * slot) and through NCCL (larger blocks, unaligned columns), between
 * all-reduces that share the slots' phases. Values exact in bf16. */
typedef struct ag_case {
  int rows, width, col0, ncols;
} ag_case;
static const ag_case ag_cases[] = {{1500, 3840, 1280, 2560}, {1500, 1280, 0, 1280}, {7, 24, 8, 8},
                                   {3000, 3840, 1280, 2560}, {33, 10, 3, 5},         {1, 16, 0, 16}};
#define N_AG (sizeof ag_cases / sizeof ag_cases[0])

static float ag_value(int i, int j, int r) { return (float)((i * 31 + j * 7 + r * 1000) % 512 - 256); }

static void *ag_main(void *p) {
  rank_arg *a = p;
  td_backend *b = NULL;
  td_comm *c = NULL;
  void *buf = NULL, *ar = NULL;
  size_t big = (size_t)3000 * 3840;
  float *x = malloc(sizeof(float) * big);
  td_backend_opts o = {.kind = TD_BACKEND_CUDA, .device = a->rank, .cuda = cuda_tuning};
  OK(td_backend_create(&o, &b), "backend");
  OK(td_comm_create_nccl(b, a->id, a->rank, WORLD, &c), "communicator");
  td_backend_set_comm(b, c);
  OK(td_alloc(b, TD_BUF_ACT, big, &buf), "alloc");
  OK(td_alloc(b, TD_BUF_ACT, 4096, &ar), "alloc");
  for (int rep = 0; rep < 2; rep++)
    for (size_t k = 0; k < N_AG; k++) {
      const ag_case *t = &ag_cases[k];
      for (int i = 0; i < t->rows; i++)
        for (int j = 0; j < t->width; j++) x[(size_t)i * t->width + j] = ag_value(i, j, a->rank);
      OK(td_upload(b, TD_BUF_ACT, buf, x, (size_t)t->rows * t->width), "upload");
      OK(td_allreduce_sum(b, ar, TD_BUF_ACT, 4096), "allreduce between");
      OK(td_allgather_rows(b, buf, TD_BUF_ACT, t->rows, t->width, t->col0, t->ncols), "allgather_rows");
      OK(td_sync(b), "sync");
      OK(td_download(b, TD_BUF_ACT, buf, x, (size_t)t->rows * t->width), "download");
      for (int owner = 0; owner < WORLD; owner++) {
        td_row_split sp = td_rows_split(t->rows, WORLD, owner);
        for (int i = sp.lo; i < sp.hi; i++)
          for (int j = 0; j < t->width; j++) {
            bool moved = j >= t->col0 && j < t->col0 + t->ncols;
            float want = ag_value(i, j, moved ? owner : a->rank), got = x[(size_t)i * t->width + j];
            if (got != want)
              FAIL("rank %d, case %zu (%d x %d, columns %d+%d), round %d: [%d][%d] = %g, want %g", a->rank, k, t->rows,
                   t->width, t->col0, t->ncols, rep, i, j, got, want);
          }
      }
    }
  /* back to back, rank 1 holding no rows (it still meets rank 0 every call:
   * a rank that never waited would run ahead into phases not yet emptied) */
  enum { CHAIN = 12, CROWS = 2, CW = 16 };
  for (int k = 0; k < CHAIN; k++) {
    for (int i = 0; i < CROWS * CW; i++) x[i] = ag_value(i / CW, i % CW + k, a->rank);
    OK(td_upload(b, TD_BUF_ACT, (char *)buf + (size_t)k * CROWS * CW * 2, x, CROWS * CW), "upload");
  }
  OK(td_sync(b), "sync");
  for (int k = 0; k < CHAIN; k++)
    OK(td_allgather_rows(b, (char *)buf + (size_t)k * CROWS * CW * 2, TD_BUF_ACT, CROWS, CW, 0, CW), "chain");
  OK(td_sync(b), "sync");
  OK(td_download(b, TD_BUF_ACT, buf, x, (size_t)CHAIN * CROWS * CW), "download");
  for (int k = 0; k < CHAIN; k++)
    for (int i = 0; i < CROWS * CW; i++)
      if (x[k * CROWS * CW + i] != ag_value(i / CW, i % CW + k, 0))
        FAIL("rank %d: chained all-gather %d: [%d][%d] = %g, want %g", a->rank, k, i / CW, i % CW,
             x[k * CROWS * CW + i], ag_value(i / CW, i % CW + k, 0));
out:
  if (buf) td_free(b, buf);
  if (ar) td_free(b, ar);
  rank_close(b, c, a->fail[0]);
  free(x);
  return NULL;
}

Test(cuda_comm, allgather_rows_slots_and_nccl, .timeout = 120) {
  run_ranks(ag_main);
}

/* td_gemm_allreduce: a row-parallel GEMM that ends in the all-reduce,
 * against td_gemm then td_allreduce_sum on the same inputs (the same bits
 * on every rank) and a CPU sum (bf16 tolerance); one kernel a call where
 * the fused path takes the shape (the bulk-copy kernel at 1-8 rows; the
 * warp-per-column kernel, one or two rows, from four ranks), two where it
 * falls back (16 rows, 64 rows, n not a multiple of 8; the default tuning). Calls eager, then a graph of all of them replayed with
 * the plain all-reduce between (the slots' phases rotate through both).
 * On two ranks, and on four where four GPUs are visible. */
typedef struct gar_case {
  int m, n, k;
  int fused_from; /* ranks from which it is one kernel (0: never) */
} gar_case;
static const gar_case gar_cases[] = {
    {1, 2048, 512, 4},   /* a TP=4 Flan-T5-XL attention output: warp per column */
    {1, 2048, 1280, 4},  /* its FFN output (k <= 2048: wider W pieces) */
    {1, 2048, 2560, 2},  /* TP=2's FFN output: bulk copies */
    {2, 1024, 1024, 4},  {3, 1000, 520, 2}, {4, 24, 8, 2}, {5, 2048, 2560, 2}, {8, 1032, 1000, 2},
    {16, 2048, 1024, 0}, {64, 1024, 512, 0}, {1, 1004, 512, 0}, {1, 1, 8, 0},
};
#define N_GAR (sizeof gar_cases / sizeof gar_cases[0])
enum { GAR_MAX_WORLD = 4 };

/* A rank of `world` on its thread and GPU (the tests below) */
typedef struct world_arg {
  int rank, world;
  const uint8_t *id;
  float *got[N_GAR]; /* results compared across ranks (gemm_allreduce) */
  char fail[256];
} world_arg;

/* world ranks running fn, joined by one NCCL id; each rank's failure reported */
static void run_world(int world, void *(*fn)(void *), world_arg *args) {
  uint8_t id[TD_NCCL_ID_BYTES];
  cr_assert(td_comm_nccl_id(id) == TD_OK, "%s", td_errmsg());
  pthread_t th[GAR_MAX_WORLD];
  for (int r = 0; r < world; r++) {
    args[r] = (world_arg){.rank = r, .world = world, .id = id};
    cr_assert(pthread_create(&th[r], NULL, fn, &args[r]) == 0);
  }
  for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < world; r++) cr_expect(args[r].fail[0] == 0, "%d ranks: %s", world, args[r].fail);
}

static float gar_value(uint64_t seed, size_t i) {
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + i * 0xbf58476d1ce4e5b9ull;
  s ^= s >> 31;
  s *= 0x94d049bb133111ebull;
  s ^= s >> 29;
  return ((float)(s % 2001) - 1000.0f) / 1000.0f;
}
/* x of rank r, W of rank r, the bias (rank 0), the residual (rank 0) */
static void gar_fill(float *v, size_t n, int what, int r, size_t ci) {
  for (size_t i = 0; i < n; i++) v[i] = to_bf16(gar_value(ci * 64 + (size_t)what * 8 + (size_t)r, i));
}

static void *gar_main(void *p) {
  world_arg *a = p;
  td_backend *b = NULL;
  td_comm *c = NULL;
  td_graph *gr = NULL;
  void *x[N_GAR] = {0}, *w[N_GAR] = {0}, *y[N_GAR] = {0}, *y2[N_GAR] = {0}, *plain = NULL;
  float *bias[N_GAR] = {0};
  size_t cap = (size_t)2048 * 2560;
  float *hx = malloc(sizeof(float) * cap), *hy = malloc(sizeof(float) * cap), *hy2 = malloc(sizeof(float) * cap),
        *ref = malloc(sizeof(float) * cap), *tol = malloc(sizeof(float) * cap), *tx = malloc(sizeof(float) * cap), *tw = malloc(sizeof(float) * cap);
  td_backend_opts o = {.kind = TD_BACKEND_CUDA, .device = a->rank, .cuda = cuda_tuning};
  OK(td_backend_create(&o, &b), "backend");
  OK(td_comm_create_nccl(b, a->id, a->rank, a->world, &c), "communicator");
  td_backend_set_comm(b, c);
  OK(td_alloc(b, TD_BUF_ACT, 4096, &plain), "alloc");
  for (size_t ci = 0; ci < N_GAR; ci++) {
    const gar_case *t = &gar_cases[ci];
    size_t mk = (size_t)t->m * t->k, nk = (size_t)t->n * t->k, mn = (size_t)t->m * t->n;
    OK(td_alloc(b, TD_BUF_ACT, mk, &x[ci]), "alloc");
    OK(td_alloc(b, TD_BUF_ACT, nk, &w[ci]), "alloc");
    OK(td_alloc(b, TD_BUF_ACT, mn, &y[ci]), "alloc");
    OK(td_alloc(b, TD_BUF_ACT, mn, &y2[ci]), "alloc");
    gar_fill(hx, mk, 0, a->rank, ci);
    OK(td_upload(b, TD_BUF_ACT, x[ci], hx, mk), "upload");
    gar_fill(hx, nk, 1, a->rank, ci);
    OK(td_upload(b, TD_BUF_ACT, w[ci], hx, nk), "upload");
    if (a->rank == 0 && ci % 2 == 0) {
      OK(td_alloc(b, TD_BUF_F32, (size_t)t->n, (void **)&bias[ci]), "alloc");
      gar_fill(hx, (size_t)t->n, 2, 0, ci);
      OK(td_upload(b, TD_BUF_F32, bias[ci], hx, (size_t)t->n), "upload");
    }
  }
  for (int round = 0; round < 2; round++) {
    /* round 0 eager; round 1 one graph of every case, replayed three times */
    int reps = round ? 3 : 1;
    if (round) {
      for (size_t ci = 0; ci < N_GAR; ci++) {
        const gar_case *t = &gar_cases[ci];
        gar_fill(hx, (size_t)t->m * t->n, 3, a->rank, ci);
        OK(td_upload(b, TD_BUF_ACT, y[ci], hx, (size_t)t->m * t->n), "upload");
      }
      OK(td_graph_begin(b), "graph begin");
      td_status cs = TD_OK;
      for (size_t ci = 0; ci < N_GAR && cs == TD_OK; ci++) {
        const gar_case *t = &gar_cases[ci];
        cs = td_gemm_allreduce(b, x[ci], w[ci], bias[ci], y[ci], t->m, t->n, t->k, a->rank == 0 ? TD_GEMM_ACCUM : 0);
        if (cs == TD_OK && ci % 3 == 0) cs = td_allreduce_sum(b, plain, TD_BUF_ACT, 4096 - ci);
      }
      td_status es = td_graph_end(b, &gr);
      OK(cs, "capture");
      OK(es, "graph end");
    }
    for (int rep = 0; rep < reps; rep++) {
      for (size_t ci = 0; ci < N_GAR; ci++) {
        const gar_case *t = &gar_cases[ci];
        size_t mn = (size_t)t->m * t->n;
        unsigned fl = a->rank == 0 ? TD_GEMM_ACCUM : 0;
        /* the residual (a replay accumulates onto the last result: start each from it) */
        gar_fill(hx, mn, 3, a->rank, ci);
        OK(td_upload(b, TD_BUF_ACT, y[ci], hx, mn), "upload");
        OK(td_upload(b, TD_BUF_ACT, y2[ci], hx, mn), "upload");
        if (!round) {
          td_graph *one = NULL;
          OK(td_graph_begin(b), "graph begin");
          td_status s1 = td_gemm_allreduce(b, x[ci], w[ci], bias[ci], y[ci], t->m, t->n, t->k, fl);
          td_status s2 = td_graph_end(b, &one);
          OK(s1, "gemm_allreduce capture");
          OK(s2, "graph end");
          int kern = td_graph_kernels(b, one);
          td_status s3 = td_graph_launch(b, one);
          td_graph_destroy(b, one);
          OK(s3, "graph launch");
          bool fused = t->fused_from && a->world >= t->fused_from && cuda_tuning.fuse_allreduce != TD_OFF &&
                       cuda_tuning.custom_allreduce != TD_OFF;
          if (fused ? kern != 1 : kern < 2)
            FAIL("rank %d of %d, %d x %d x %d: %d kernels, want %s", a->rank, a->world, t->m, t->n, t->k, kern,
                 fused ? "one" : "two or more");
        }
      }
      if (round) OK(td_graph_launch(b, gr), "graph launch");
      for (size_t ci = 0; ci < N_GAR; ci++) {
        const gar_case *t = &gar_cases[ci];
        OK(td_gemm(b, x[ci], w[ci], bias[ci], y2[ci], t->m, t->n, t->k, TD_ACT_NONE, a->rank == 0 ? TD_GEMM_ACCUM : 0),
           "gemm");
        OK(td_allreduce_sum(b, y2[ci], TD_BUF_ACT, (size_t)t->m * t->n), "allreduce");
      }
      OK(td_sync(b), "sync");
      for (size_t ci = 0; ci < N_GAR; ci++) {
        const gar_case *t = &gar_cases[ci];
        size_t mn = (size_t)t->m * t->n;
        OK(td_download(b, TD_BUF_ACT, y[ci], hy, mn), "download");
        OK(td_download(b, TD_BUF_ACT, y2[ci], hy2, mn), "download");
        for (size_t i = 0; i < mn; i++)
          if (memcmp(&hy[i], &hy2[i], sizeof(float)))
            FAIL("rank %d, round %d, %d x %d x %d: [%zu] = %g, the GEMM then the all-reduce %g", a->rank, round, t->m,
                 t->n, t->k, i, hy[i], hy2[i]);
        /* the CPU's sum: every rank's bf16 partial (rank 0's with bias and residual), in rank order */
        /* each rank's partial is rounded to bf16 before the sum (an ulp, 2^-7 of it, where the GPU's
         * order of products flips a rounding), the sum once more; a GEMM's own error scales with its
         * products' root sum of squares (cuBLASLt's split-K sums partial tiles in bf16), not its result */
        for (size_t i = 0; i < mn; i++) ref[i] = 0.0f, tol[i] = 0.0f;
        for (int r = 0; r < a->world; r++) {
          gar_fill(tx, (size_t)t->m * t->k, 0, r, ci);
          gar_fill(tw, (size_t)t->n * t->k, 1, r, ci);
          float *bb = r == 0 && ci % 2 == 0 ? hx : NULL;
          if (bb) gar_fill(bb, (size_t)t->n, 2, 0, ci);
          for (int i = 0; i < t->m; i++)
            for (int j = 0; j < t->n; j++) {
              double acc = 0.0, sq = 0.0;
              for (int q = 0; q < t->k; q++) {
                double pq = (double)tx[(size_t)i * t->k + q] * tw[(size_t)j * t->k + q];
                acc += pq;
                sq += pq * pq;
              }
              if (bb) acc += bb[j];
              if (r == 0) acc += to_bf16(gar_value(ci * 64 + 3 * 8, (size_t)i * t->n + j));
              ref[(size_t)i * t->n + j] += (float)acc;
              tol[(size_t)i * t->n + j] += (float)(fabs(acc) + sqrt(sq)) / 128.0f;
            }
        }
        for (size_t i = 0; i < mn; i++)
          if (fabsf(hy[i] - ref[i]) > tol[i] + fabsf(ref[i]) / 128.0f + 1e-6f)
            FAIL("rank %d, round %d, %d x %d x %d: [%zu] = %g, the CPU's %g", a->rank, round, t->m, t->n, t->k, i,
                 hy[i], ref[i]);
        if (round && rep == reps - 1) {
          a->got[ci] = malloc(sizeof(float) * mn);
          memcpy(a->got[ci], hy, sizeof(float) * mn);
        }
      }
    }
  }
out:
  if (gr) td_graph_destroy(b, gr);
  if (b) {
    for (size_t ci = 0; ci < N_GAR; ci++) {
      td_free(b, x[ci]);
      td_free(b, w[ci]);
      td_free(b, y[ci]);
      td_free(b, y2[ci]);
      if (bias[ci]) td_free(b, bias[ci]);
    }
    if (plain) td_free(b, plain);
  }
  rank_close(b, c, a->fail[0]);
  free(hx);
  free(hy);
  free(hy2);
  free(ref);
  free(tol);
  free(tx);
  free(tw);
  return NULL;
}

static void gar_run(int world) {
  world_arg args[GAR_MAX_WORLD];
  run_world(world, gar_main, args);
  for (size_t ci = 0; ci < N_GAR; ci++) {
    size_t mn = (size_t)gar_cases[ci].m * gar_cases[ci].n;
    for (int r = 1; r < world; r++)
      if (args[0].got[ci] && args[r].got[ci])
        cr_expect(memcmp(args[0].got[ci], args[r].got[ci], sizeof(float) * mn) == 0, "%d ranks: rank %d differs in case %zu",
                  world, r, ci);
    for (int r = 0; r < world; r++) free(args[r].got[ci]);
  }
}

/* td_allgather of float32 (a vocabulary split's logits) over the one-shot
 * slots (16-byte vectors where n % 4 == 0, else a word at a time) and,
 * past a slot, NCCL: every rank's values in rank order, exact (the slots'
 * mark, bits 0x80008000, arrives as -0.0), eager and replayed in a graph
 * between bf16 all-reduces that share the slots' phases. */
static const size_t agw_sizes[] = {1, 3, 4, 4099, 16064, 64 * 8032, 64 * 16064 + 4};
#define N_AGW (sizeof agw_sizes / sizeof agw_sizes[0])

static uint32_t agw_word(int r, size_t i, int rep) {
  if (i % 97 == 5) return 0x80008000u; /* the mark */
  if (i % 89 == 7) return 0x80000000u; /* -0.0 */
  float f = (float)((int)((i * 7 + (size_t)r * 131 + (size_t)rep * 17) % 2001) - 1000) / 64.0f;
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static void *agw_main(void *p) {
  world_arg *a = p;
  td_backend *b = NULL;
  td_comm *c = NULL;
  td_graph *gr = NULL;
  void *send = NULL, *recv = NULL, *plain = NULL;
  size_t big = agw_sizes[N_AGW - 1];
  uint32_t *h = malloc(sizeof(uint32_t) * big * (size_t)a->world);
  td_backend_opts o = {.kind = TD_BACKEND_CUDA, .device = a->rank, .cuda = cuda_tuning};
  OK(td_backend_create(&o, &b), "backend");
  OK(td_comm_create_nccl(b, a->id, a->rank, a->world, &c), "communicator");
  td_backend_set_comm(b, c);
  OK(td_alloc(b, TD_BUF_F32, big, &send), "alloc");
  OK(td_alloc(b, TD_BUF_F32, big * (size_t)a->world, &recv), "alloc");
  OK(td_alloc(b, TD_BUF_ACT, 4096, &plain), "alloc");
  for (int round = 0; round < 2; round++)
    for (size_t si = 0; si < N_AGW; si++) {
      size_t n = agw_sizes[si];
      int reps = round ? 3 : 1;
      if (round) { /* a graph: all-reduce, all-gather, all-reduce */
        OK(td_graph_begin(b), "graph begin");
        td_status s1 = td_allreduce_sum(b, plain, TD_BUF_ACT, 4096);
        if (s1 == TD_OK) s1 = td_allgather(b, send, recv, TD_BUF_F32, n);
        if (s1 == TD_OK) s1 = td_allreduce_sum(b, plain, TD_BUF_ACT, 7);
        td_status s2 = td_graph_end(b, &gr);
        OK(s1, "capture");
        OK(s2, "graph end");
      }
      for (int rep = 0; rep < reps; rep++) {
        for (size_t i = 0; i < n; i++) h[i] = agw_word(a->rank, i, rep);
        OK(td_upload(b, TD_BUF_F32, send, (const float *)h, n), "upload");
        if (round) OK(td_graph_launch(b, gr), "graph launch");
        else OK(td_allgather(b, send, recv, TD_BUF_F32, n), "allgather");
        OK(td_sync(b), "sync");
        OK(td_download(b, TD_BUF_F32, recv, (float *)h, n * (size_t)a->world), "download");
        /* the slots take up to 4 MiB a rank on two ranks, 1 MiB on more (docs/cuda.md) */
        bool slots = cuda_tuning.custom_allgather != TD_OFF && cuda_tuning.custom_allreduce != TD_OFF &&
                     n * 4 <= (a->world <= 2 ? (4u << 20) : (1u << 20));
        for (int r = 0; r < a->world; r++)
          for (size_t i = 0; i < n; i++) {
            uint32_t want = agw_word(r, i, rep), got = h[(size_t)r * n + i];
            if (want == 0x80008000u && slots) want = 0x80000000u;
            if (got != want)
              FAIL("rank %d of %d, round %d, %zu words, rep %d: [%d][%zu] = %#x, want %#x", a->rank, a->world, round, n,
                   rep, r, i, got, want);
          }
      }
      if (gr) td_graph_destroy(b, gr);
      gr = NULL;
    }
out:
  if (gr) td_graph_destroy(b, gr);
  if (b) {
    if (send) td_free(b, send);
    if (recv) td_free(b, recv);
    if (plain) td_free(b, plain);
  }
  rank_close(b, c, a->fail[0]);
  free(h);
  return NULL;
}

Test(cuda_comm, allgather_f32_slots_and_nccl, .timeout = 300) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) cr_skip_test("needs 2 GPUs, %d visible", n);
  world_arg args[GAR_MAX_WORLD];
  run_world(2, agw_main, args);
  if (n >= 4) run_world(4, agw_main, args);
}

Test(cuda_comm, gemm_allreduce_as_gemm_then_allreduce, .timeout = 300) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) cr_skip_test("needs 2 GPUs, %d visible", n);
  gar_run(2);
  if (n >= 4) gar_run(4);
}

int main(int argc, char *argv[]) { return td_gpu_test_main(argc, argv, &cuda_tuning); }
