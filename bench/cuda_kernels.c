/* CUDA kernel benchmarks on a Flan-T5-large shape (d_model 1024, 16 heads
 * of 64, gated FFN 2816, vocab 32128, 24+24 layers, encoder length 512).
 *
 * Two ceilings are measured in the same run: the copy bandwidth (a large
 * device-to-device copy, bytes read + written) and the bf16 matrix rate
 * (an 8192^3 GEMM through cuBLASLt). Each row is timed as CUDA-graph
 * replays (median of several rounds) and set against its floor: bytes that
 * must move / bandwidth for memory-bound work, FLOPs / matrix rate for
 * matrix work. Operands are rotated over more memory than L2 holds, so no
 * figure comes from cache. Prints a table and appends it, with date,
 * device and commit, to bench/RESULTS.md (or --results FILE).
 *
 *   bench_cuda_kernels [--results FILE] [--commit ID] [--quick] [--only SUBSTR]
 *
 * The environment's CUDA tuning (TANDEM_CUDA_*, read once in main) applies
 * to every row; the alternatives at the end change one field of it. One
 * program over ~800 lines: each benchmark is a short function over the
 * shared setup, timing and table above them. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/half.h"
#include "common/settings.h"
#include "common/status.h"
#include "kernels/ops.h"

#ifndef TD_GIT_COMMIT
#define TD_GIT_COMMIT "unknown"
#endif

enum { D = 1024, NH = 16, DH = 64, FF = 2816, VOCAB = 32128, LAYERS = 24, ENC_LEN = 512, BS = 16 };

static td_backend *B;
static int quick;
static const char *only; /* --only SUBSTR: just the rows whose name holds it */

static bool skip(const char *what) { return only && !strstr(what, only); }

#define CHECK(x)                                                                      \
  do {                                                                                \
    td_status s_ = (x);                                                               \
    if (s_ != TD_OK) {                                                                \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, td_errmsg());       \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Work that enqueues ops on the backend stream. */
typedef td_status (*work_fn)(void *ctx);

/* Captures fn once into a graph; returns the median time of one replay. */
static double time_work(work_fn fn, void *ctx) {
  td_graph *g;
  CHECK(fn(ctx)); /* eager once: plans, warm caches */
  CHECK(td_sync(B));
  CHECK(td_graph_begin(B));
  td_status s = fn(ctx);
  td_status s2 = td_graph_end(B, &g);
  CHECK(s);
  CHECK(s2);
  for (int i = 0; i < 3; i++) CHECK(td_graph_launch(B, g));
  CHECK(td_sync(B));
  /* replays per round: enough to cover ~20 ms */
  double t0 = now();
  CHECK(td_graph_launch(B, g));
  CHECK(td_sync(B));
  double one = now() - t0;
  int reps = (int)(0.02 / (one > 1e-6 ? one : 1e-6));
  reps = reps < 1 ? 1 : reps > 2000 ? 2000 : reps;
  enum { ROUNDS = 9 };
  double t[ROUNDS];
  for (int r = 0; r < (quick ? 3 : ROUNDS); r++) {
    t0 = now();
    for (int i = 0; i < reps; i++) CHECK(td_graph_launch(B, g));
    CHECK(td_sync(B));
    t[r] = (now() - t0) / reps;
  }
  int n = quick ? 3 : ROUNDS;
  qsort(t, n, sizeof t[0], cmp_d);
  td_graph_destroy(B, g);
  return t[n / 2];
}

/* ------------------------------------------------------------ buffers */

static void *chunk;                    /* random bf16 source */
static const size_t CHUNK = 16u << 20; /* elements */

static void *act(size_t n) {
  void *p;
  CHECK(td_alloc(B, TD_BUF_ACT, n, &p));
  for (size_t off = 0; off < n; off += CHUNK) {
    size_t c = n - off < CHUNK ? n - off : CHUNK;
    CHECK(td_copy_d2d(B, (char *)p + off * 2, chunk, c * 2));
  }
  return p;
}

static void *f32(size_t n, float v) {
  float *h = malloc(sizeof(float) * n);
  for (size_t i = 0; i < n; i++) h[i] = v;
  void *p;
  CHECK(td_alloc(B, TD_BUF_F32, n, &p));
  CHECK(td_upload(B, TD_BUF_F32, p, h, n));
  free(h);
  return p;
}

static void *i32(const int32_t *h, size_t n) {
  void *p;
  CHECK(td_alloc(B, TD_BUF_I32, n, &p));
  CHECK(td_upload(B, TD_BUF_I32, p, (const float *)h, n));
  return p;
}

/* ------------------------------------------------------------ results */

typedef struct row {
  char what[48], shape[48];
  double t, floor;
  const char *bound; /* "mem" or "mma" */
  double achieved;   /* TB/s or TFLOP/s */
} row;

static row rows[160];
static int n_rows;
static double BW, RATE; /* bytes/s, FLOP/s */

static void add(const char *what, const char *shape, double t, double bytes, double flops) {
  if (n_rows == (int)(sizeof rows / sizeof rows[0])) n_rows--; /* full: the last row is overwritten */
  row *r = &rows[n_rows++];
  snprintf(r->what, sizeof r->what, "%s", what);
  snprintf(r->shape, sizeof r->shape, "%s", shape);
  r->t = t;
  double fm = bytes / BW, fc = flops / RATE;
  r->floor = fm > fc ? fm : fc;
  r->bound = fm >= fc ? "mem" : "mma";
  r->achieved = fm >= fc ? bytes / t / 1e12 : flops / t / 1e12;
  printf("%-28s %-30s %10.1f us  floor %9.1f us  %5.2fx  %7.1f %s\n", r->what, r->shape, t * 1e6, r->floor * 1e6,
         t / r->floor, r->achieved, fm >= fc ? "TB/s" : "TFLOP/s");
  fflush(stdout);
}

/* ------------------------------------------------------------ ceilings */

typedef struct copy_ctx {
  void *a, *b;
  size_t bytes;
} copy_ctx;
static td_status copy_work(void *p) {
  copy_ctx *c = p;
  return td_copy_d2d(B, c->b, c->a, c->bytes);
}

typedef struct gemm_ctx {
  void **x, **w, **y;
  int nx, nw, ny; /* rotation counts */
  const float *bias;
  int m, n, k, calls;
  td_act act;
  unsigned flags;
} gemm_ctx;
static td_status gemm_work(void *p) {
  gemm_ctx *c = p;
  for (int i = 0; i < c->calls; i++)
    TD_TRY(td_gemm(B, c->x[i % c->nx], c->w[i % c->nw], c->bias, c->y[i % c->ny], c->m, c->n, c->k, c->act,
                   c->flags));
  return TD_OK;
}

typedef struct gather_ctx {
  void *a, *b, *rows;
  int n, d;
} gather_ctx;
static td_status gather_work(void *p) {
  gather_ctx *c = p;
  return td_gather_rows(B, c->a, c->rows, c->b, c->n, c->d);
}

/* bf16 GEMM rate of cuBLASLt on 8192^3 (median of the rounds). */
static double matrix_rate(void) {
  int N = 8192;
  void *x = act((size_t)N * N), *w = act((size_t)N * N), *y = act((size_t)N * N);
  gemm_ctx g = {&x, &w, &y, 1, 1, 1, NULL, N, N, N, 1, TD_ACT_NONE, 0};
  double t = time_work(gemm_work, &g);
  td_free(B, x);
  td_free(B, w);
  td_free(B, y);
  return 2.0 * N * (double)N * N / t;
}

static void ceilings(void) {
  copy_ctx cc = {NULL, NULL, (size_t)1 << 30};
  CHECK(td_alloc(B, TD_BUF_F32, cc.bytes / 4, &cc.a));
  CHECK(td_alloc(B, TD_BUF_F32, cc.bytes / 4, &cc.b));
  CHECK(td_copy_d2d(B, cc.a, chunk, CHUNK * 2));
  double t = time_work(copy_work, &cc);
  double bw_copy = 2.0 * cc.bytes / t;
  /* the same bytes through a kernel with 16-byte loads and stores (gather_rows, identity rows) */
  gather_ctx gc = {cc.a, cc.b, NULL, (int)(cc.bytes / 16384), 8192};
  int32_t *ids = malloc(sizeof(int32_t) * gc.n);
  for (int i = 0; i < gc.n; i++) ids[i] = i;
  gc.rows = i32(ids, gc.n);
  free(ids);
  t = time_work(gather_work, &gc);
  double bw_kernel = 2.0 * cc.bytes / t;
  BW = bw_copy > bw_kernel ? bw_copy : bw_kernel;
  printf("copy bandwidth: cudaMemcpy %.2f TB/s, copy kernel %.2f TB/s (1 GiB, read + write); floors use %.2f\n",
         bw_copy / 1e12, bw_kernel / 1e12, BW / 1e12);
  td_free(B, gc.rows);
  td_free(B, cc.a);
  td_free(B, cc.b);
  RATE = matrix_rate();
  printf("bf16 matrix rate %.1f TFLOP/s (8192^3 cuBLASLt, bf16 in/out, fp32 accumulate)\n\n", RATE / 1e12);
}

/* ------------------------------------------------------------ GEMMs */

static void bench_gemm(const char *what, int m, int n, int k, unsigned flags) {
  if (skip(what)) return;
  /* rotate weights over > 100 MB so that L2 never holds them */
  size_t wsz = (size_t)n * k * 2;
  int nw = (int)(150e6 / wsz) + 1;
  nw = nw > 64 ? 64 : nw;
  if (m >= 4096) nw = 1; /* matrix-bound: the weights stay hot anyway */
  void *wl[64], *x = act((size_t)m * k), *y;
  for (int i = 0; i < nw; i++) wl[i] = act((size_t)n * k);
  CHECK(td_alloc(B, (flags & TD_GEMM_OUT_F32) ? TD_BUF_F32 : TD_BUF_ACT, (size_t)m * n, &y));
  int calls = nw < 8 ? 8 : nw;
  gemm_ctx g = {&x, wl, &y, 1, nw, 1, NULL, m, n, k, calls, TD_ACT_NONE, flags};
  double t = time_work(gemm_work, &g) / calls;
  double ysz = (flags & TD_GEMM_OUT_F32) ? 4.0 : 2.0;
  double bytes = (double)wsz + (double)m * k * 2 + (double)m * n * ysz;
  char shape[48];
  snprintf(shape, sizeof shape, "m=%d n=%d k=%d", m, n, k);
  add(what, shape, t, bytes, 2.0 * m * (double)n * k);
  for (int i = 0; i < nw; i++) td_free(B, wl[i]);
  td_free(B, x);
  td_free(B, y);
}

/* A Flan-T5-XL rank's decode GEMMs under TP=2 (d_model 2048, 16 of 32
 * heads, half of the gated FFN's 5120) at batch 32, 64 and 128: the
 * GEMMs issue 38's batch-64 step spends most of its excess on */
static void bench_xl_tp2(void) {
  static const struct {
    const char *what;
    int n, k;
  } g[] = {{"gemm xl tp2 qkv", 3072, 2048},
           {"gemm xl tp2 o", 2048, 1024},
           {"gemm xl tp2 ffn in", 5120, 2048},
           {"gemm xl tp2 ffn out", 2048, 2560}};
  static const int ms[] = {32, 64, 128};
  for (size_t i = 0; i < sizeof ms / sizeof *ms; i++)
    for (size_t j = 0; j < sizeof g / sizeof *g; j++) bench_gemm(g[j].what, ms[i], g[j].n, g[j].k, 0);
}

/* td_gemm_ex as the model calls it: RMSNorm fused, GLU (gated GELU) for the
 * FFN input projection. */
typedef struct gex_ctx {
  void *x, **w, *y, *xn, *glu, *nw;
  int nwc, m, n, k, calls;
  bool norm, glu_on;
} gex_ctx;
static td_status gex_work(void *p) {
  gex_ctx *c = p;
  for (int i = 0; i < c->calls; i++) {
    td_gemm_args a = {.x = c->x, .w = c->w[i % c->nwc], .y = c->y, .m = c->m, .n = c->n, .k = c->k,
                      .act = c->glu_on ? TD_ACT_GELU_TANH : TD_ACT_NONE, .flags = c->glu_on ? TD_GEMM_GLU : 0,
                      .norm_plain = c->norm, .norm_eps = 1e-6f, .norm_rms = true, .scratch_norm = c->xn,
                      .scratch_glu = c->glu}; /* the model's folded norm */
    TD_TRY(td_gemm_ex(B, &a));
  }
  return TD_OK;
}

static void bench_gemm_ex(const char *what, int m, int n, int k, bool norm, bool glu) {
  if (skip(what)) return;
  size_t wsz = (size_t)n * k * 2;
  int nw = (int)(150e6 / wsz) + 1;
  nw = nw > 64 ? 64 : nw;
  void *wl[64];
  for (int i = 0; i < nw; i++) wl[i] = act((size_t)n * k);
  gex_ctx g = {act((size_t)m * k), wl, act((size_t)m * n), act((size_t)m * k), act((size_t)m * n), f32(k, 1.0f),
               nw, m, n, k, nw < 8 ? 8 : nw, norm, glu};
  double t = time_work(gex_work, &g) / g.calls;
  double bytes = (double)wsz + (double)m * k * 2 + (double)m * (glu ? n / 2 : n) * 2;
  char shape[48];
  snprintf(shape, sizeof shape, "m=%d n=%d k=%d", m, n, k);
  add(what, shape, t, bytes, 2.0 * m * (double)n * k);
  for (int i = 0; i < nw; i++) td_free(B, wl[i]);
  td_free(B, g.x);
  td_free(B, g.y);
  td_free(B, g.xn);
  td_free(B, g.glu);
  td_free(B, g.nw);
}

/* ------------------------------------------------------------ bandwidth kernels */

typedef struct ew_ctx {
  void *x, *y, *w;
  int m, n;
  bool gated;
} ew_ctx;
static td_status ew_work(void *p) {
  ew_ctx *c = p;
  if (c->gated) return td_gated_act(B, c->x, c->y, c->m, c->n, TD_ACT_GELU_TANH);
  return td_norm(B, c->x, c->w, NULL, c->y, c->m, c->n, 1e-6f, true);
}

static void bench_ew(const char *what, int m, int n, bool gated) {
  if (skip(what)) return;
  ew_ctx c = {act((size_t)m * n * (gated ? 2 : 1)), act((size_t)m * n), f32(n, 1.0f), m, n, gated};
  double t = time_work(ew_work, &c);
  char shape[48];
  snprintf(shape, sizeof shape, "%d x %d", m, n);
  add(what, shape, t, (double)m * n * 2 * (gated ? 3 : 2), 0.0);
  td_free(B, c.x);
  td_free(B, c.y);
  td_free(B, c.w);
}

/* The cost of one dependent kernel boundary: a chain of row norms, each
 * reading the previous one's output (one 1 x 1024 row). */
typedef struct hop_ctx {
  void *a, *b, *w;
  int n;
} hop_ctx;
static td_status hop_work(void *p) {
  hop_ctx *c = p;
  for (int i = 0; i < c->n; i++)
    TD_TRY(td_norm(B, i % 2 ? c->b : c->a, c->w, NULL, i % 2 ? c->a : c->b, 1, D, 1e-6f, true));
  return TD_OK;
}

static void bench_hop(void) {
  if (skip("hop")) return;
  hop_ctx c = {act(D), act(D), f32(D, 1.0f), 240};
  add("hop: dependent rmsnorm", "1 x 1024, chain of 240", time_work(hop_work, &c) / c.n, 4.0 * D, 0.0);
  td_free(B, c.a);
  td_free(B, c.b);
  td_free(B, c.w);
}

/* ------------------------------------------------------------ attention */

typedef struct dense_ctx {
  void *qkv, *out, *cu, *lut;
  int n_seqs, len, calls;
  bool causal;
} dense_ctx;
static td_status dense_work(void *p) {
  dense_ctx *c = p;
  td_relbias rb = {c->lut, 128};
  for (int i = 0; i < c->calls; i++)
    TD_TRY(td_attn_dense(B, c->qkv, c->out, c->cu, c->n_seqs, c->n_seqs * c->len, c->len, NH, DH, 1.0f, c->causal,
                         c->lut ? &rb : NULL));
  return TD_OK;
}

static void bench_dense(int n_seqs, int len, bool causal, bool bias) {
  char what[48], shape[48];
  snprintf(what, sizeof what, "attn_dense%s%s", causal ? " causal" : "", bias ? " +T5 bias" : "");
  if (skip(what)) return;
  int T = n_seqs * len;
  int32_t *cu = malloc(sizeof(int32_t) * (n_seqs + 1));
  for (int s = 0; s <= n_seqs; s++) cu[s] = s * len;
  dense_ctx c = {act((size_t)T * 3 * D), act((size_t)T * D), i32(cu, n_seqs + 1),
                 bias ? f32(NH * 257, 0.1f) : NULL, n_seqs, len, 4, causal};
  double t = time_work(dense_work, &c) / c.calls;
  double flops = 4.0 * n_seqs * (double)len * len * NH * DH * (causal ? 0.5 : 1.0);
  double bytes = (double)T * 4 * D * 2;
  snprintf(shape, sizeof shape, "%dx%d tok, %dx%d", n_seqs, len, NH, DH);
  add(what, shape, t, bytes, flops);
  td_free(B, c.qkv);
  td_free(B, c.out);
  td_free(B, c.cu);
  if (c.lut) td_free(B, c.lut);
  free(cu);
}

/* One rank of a row-split encoder (Whisper-large: 20 heads, one input of
 * `len`): query rows [0, len / 2) over every key (120 blocks of 128 rows
 * for 1500: one an SM), against the whole input (TP=1: two an SM). */
typedef struct rows_ctx {
  void *qkv, *out, *cu;
  int len, heads, half;
} rows_ctx;
static td_status rows_work(void *p) {
  rows_ctx *c = p;
  for (int i = 0; i < 4; i++)
    TD_TRY(td_attn_dense_rows(B, c->qkv, c->out, c->cu, 1, c->len, c->len, c->heads, DH, 0.125f, false, NULL, 0,
                              c->half ? c->len / 2 : c->len));
  return TD_OK;
}

static void bench_dense_rows(int len) {
  static const char *const names[] = {"attn_dense rows: all", "attn_dense rows: half"};
  int heads = 20;
  int32_t cu[2] = {0, len};
  for (int half = 0; half < 2; half++) {
    if (skip(names[half])) continue;
    rows_ctx c = {act((size_t)len * 3 * heads * DH), act((size_t)len * heads * DH), i32(cu, 2), len, heads, half};
    double t = time_work(rows_work, &c) / 4;
    double rows_q = half ? len / 2 : len;
    char shape[48];
    snprintf(shape, sizeof shape, "%g x %d keys, %dx%d", rows_q, len, heads, DH);
    add(names[half], shape, t, (double)len * 2 * heads * DH * 2, 4.0 * rows_q * len * heads * DH);
    td_free(B, c.qkv);
    td_free(B, c.out);
    td_free(B, c.cu);
  }
}

/* One short input (BART-large: 16 heads; 352 tokens is 48 blocks of 128 rows, 512 is 64): a grid of
 * fewer blocks than SMs, what a first token at low load waits on. */
static void bench_dense_one(int len, int heads) {
  const char *name = "attn_dense one input";
  if (skip(name)) return;
  int32_t cu[2] = {0, len};
  rows_ctx c = {act((size_t)len * 3 * heads * DH), act((size_t)len * heads * DH), i32(cu, 2), len, heads, 0};
  double t = time_work(rows_work, &c) / 4;
  char shape[48];
  snprintf(shape, sizeof shape, "%d x %d keys, %dx%d", len, len, heads, DH);
  add(name, shape, t, (double)len * 4 * heads * DH * 2, 4.0 * len * len * heads * DH);
  td_free(B, c.qkv);
  td_free(B, c.out);
  td_free(B, c.cu);
}

typedef struct paged_ctx {
  void *q, *out, *pool, *lut;
  td_kv_layout l;
  td_paged_meta m;
  bool causal;
  int ldq;
} paged_ctx;
static td_status paged_work(void *p) {
  paged_ctx *c = p;
  td_relbias rb = {c->lut, 128};
  for (int layer = 0; layer < c->l.n_layers; layer++)
    TD_TRY(td_attn_paged(B, c->q, c->ldq, c->out, c->pool, &c->l, layer, &c->m, 0.125f, c->causal,
                         c->lut ? &rb : NULL));
  return TD_OK;
}

/* Pool and metadata for `batch` sequences of ctx keys each (one query row). */
static void paged_setup(paged_ctx *c, int batch, int ctx, int bound, bool causal) {
  int nb = (ctx + BS - 1) / BS, stride = (bound + BS - 1) / BS;
  c->l = (td_kv_layout){LAYERS, NH, DH, BS, 0, 0};
  c->pool = act(td_kv_block_elems(&c->l) * (size_t)batch * nb);
  int32_t *qs = malloc(sizeof(int32_t) * (batch + 1)), *cl = malloc(sizeof(int32_t) * batch),
          *tab = malloc(sizeof(int32_t) * (size_t)batch * stride);
  for (int s = 0; s <= batch; s++) qs[s] = s;
  for (int s = 0; s < batch; s++) {
    cl[s] = ctx;
    for (int i = 0; i < stride; i++) tab[(size_t)s * stride + i] = i < nb ? s * nb + i : 0;
  }
  /* cross-attention K/V are static within a step (kv_static), self-attention's keys before the query too */
  c->m = (td_paged_meta){batch, batch, 1, bound, i32(qs, batch + 1), i32(cl, batch), i32(tab, (size_t)batch * stride),
                         stride, !causal, causal, NULL, 0, 0.0f};
  c->causal = causal;
  free(qs);
  free(cl);
  free(tab);
}

static void paged_free(paged_ctx *c) {
  td_free(B, c->pool);
  td_free(B, (void *)c->m.q_start);
  td_free(B, (void *)c->m.ctx_len);
  td_free(B, (void *)c->m.block_table);
}

static void bench_paged(int batch, int ctx, bool causal) {
  char what[48], shape[48];
  snprintf(what, sizeof what, "attn_paged decode %s", causal ? "self+bias" : "cross");
  if (skip(what)) return;
  paged_ctx c = {0};
  paged_setup(&c, batch, ctx, 512, causal);
  c.ldq = causal ? 3 * D : D;
  c.q = act((size_t)batch * c.ldq);
  c.out = act((size_t)batch * D);
  c.lut = causal ? f32(NH * 257, 0.1f) : NULL;
  double t = time_work(paged_work, &c) / LAYERS;
  double bytes = (double)batch * ctx * 2 * D * 2 + (double)batch * D * 2 * 2;
  snprintf(shape, sizeof shape, "batch %d, ctx %d, bound 512", batch, ctx);
  add(what, shape, t, bytes, 4.0 * batch * ctx * D);
  td_free(B, c.q);
  td_free(B, c.out);
  if (c.lut) td_free(B, c.lut);
  paged_free(&c);
}

/* td_attn_states as a decode step calls it: every layer over its own copy
 * of the states (so that L2 never holds them), one query row a sequence. */
typedef struct states_ctx {
  void *q, *out, *pool, *qn;
  td_kv_layout l;
  td_paged_meta m[LAYERS];
} states_ctx;
static td_status states_work(void *p) {
  states_ctx *c = p;
  for (int layer = 0; layer < LAYERS; layer++)
    TD_TRY(td_attn_states(B, c->q, NH * D, c->out, c->pool, &c->l, NH, &c->m[layer], 0.125f));
  return TD_OK;
}

static void bench_states(int batch, int ctx) {
  const char *what = "attn_states decode";
  if (skip(what)) return;
  states_ctx c = {0};
  int nb = (ctx + BS - 1) / BS;
  c.l = (td_kv_layout){0, 1, D / 2, BS, D, 0};
  c.pool = act(td_kv_block_elems(&c.l) * (size_t)batch * nb * LAYERS);
  c.q = act((size_t)batch * NH * D);
  c.out = act((size_t)batch * NH * D);
  c.qn = act((size_t)batch * D); /* the cross query's norm, left to the kernel as in a step */
  int32_t *qs = malloc(sizeof(int32_t) * (batch + 1)), *cl = malloc(sizeof(int32_t) * batch),
          *tab = malloc(sizeof(int32_t) * (size_t)batch * nb);
  for (int s = 0; s <= batch; s++) qs[s] = s;
  for (int s = 0; s < batch; s++) cl[s] = ctx;
  void *dqs = i32(qs, batch + 1), *dcl = i32(cl, batch);
  for (int layer = 0; layer < LAYERS; layer++) {
    for (int s = 0; s < batch; s++)
      for (int i = 0; i < nb; i++) tab[(size_t)s * nb + i] = (layer * batch + s) * nb + i;
    c.m[layer] = (td_paged_meta){batch, batch, 1, ctx, dqs, dcl, i32(tab, (size_t)batch * nb), nb, true, false,
                                 c.qn, D, 1e-6f};
  }
  double t = time_work(states_work, &c) / LAYERS;
  double bytes = (double)batch * ctx * D * 2 + (double)batch * NH * D * 2 * 2;
  char shape[48];
  snprintf(shape, sizeof shape, "batch %d, ctx %d, D %d", batch, ctx, D);
  add(what, shape, t, bytes, 4.0 * batch * NH * (double)ctx * D);
  for (int layer = 0; layer < LAYERS; layer++) td_free(B, (void *)c.m[layer].block_table);
  td_free(B, dqs);
  td_free(B, dcl);
  td_free(B, c.pool);
  td_free(B, c.q);
  td_free(B, c.out);
  td_free(B, c.qn);
  free(qs);
  free(cl);
  free(tab);
}

/* td_gemm_heads both ways round the states (W_k into state space, W_v back),
 * each layer's weights its own */
typedef struct heads_ctx {
  void *x, *y, *w[LAYERS];
  int m, n, k;
  bool w_t;
} heads_ctx;
static td_status heads_work(void *p) {
  heads_ctx *c = p;
  for (int layer = 0; layer < LAYERS; layer++)
    TD_TRY(td_gemm_heads(B, c->x, c->w[layer], NULL, c->y, c->m, NH, c->n, c->k, c->w_t));
  return TD_OK;
}

static void bench_heads(int m, bool back) {
  const char *what = back ? "gemm_heads W_v" : "gemm_heads W_k";
  if (skip(what)) return;
  heads_ctx c = {.m = m, .n = back ? DH : D, .k = back ? D : DH, .w_t = back};
  c.x = act((size_t)m * NH * c.k);
  c.y = act((size_t)m * NH * c.n);
  for (int layer = 0; layer < LAYERS; layer++) c.w[layer] = act((size_t)NH * DH * D);
  double t = time_work(heads_work, &c) / LAYERS;
  double bytes = (double)NH * DH * D * 2 + (double)m * NH * (c.k + c.n) * 2;
  char shape[48];
  snprintf(shape, sizeof shape, "m=%d heads=%d n=%d k=%d", m, NH, c.n, c.k);
  add(what, shape, t, bytes, 2.0 * m * NH * (double)DH * D);
  for (int layer = 0; layer < LAYERS; layer++) td_free(B, c.w[layer]);
  td_free(B, c.x);
  td_free(B, c.y);
}

/* ------------------------------------------------------------ whole passes */

typedef struct layer_w {
  void *qkv, *o, *cq, *co, *wi, *wo;
  void *n1, *n2, *n3;
} layer_w;

typedef struct step_ctx {
  int batch;
  bool unfused; /* norm, GEMM, gated activation and KV write as separate ops */
  layer_w L[LAYERS];
  void *head, *fnorm, *lut;
  paged_ctx self, cross;
  void *h, *x, *qkv, *q, *att, *ff, *ff1, *logits, *slots, *ids, *rows, *tok;
} step_ctx;

static td_status step_work(void *p) {
  step_ctx *c = p;
  int Bn = c->batch;
  td_relbias rb = {c->lut, 128};
  TD_TRY(td_embed(B, c->ids, c->ids, c->head, NULL, 1.0f, c->h, Bn, D));
  for (int l = 0; l < LAYERS && !c->unfused; l++) { /* as model/forward.c calls the ops (norm weights folded into W) */
    layer_w *w = &c->L[l];
    td_gemm_args qa = {.x = c->h, .w = w->qkv, .y = c->qkv, .m = Bn, .n = 3 * D, .k = D, .norm_plain = true,
                       .norm_eps = 1e-6f, .norm_rms = true, .scratch_norm = c->x, .kv_pool = c->self.pool,
                       .kv_layout = &c->self.l, .kv_layer = l, .kv_col = D, .kv_slots = c->slots};
    TD_TRY(td_gemm_ex(B, &qa));
    TD_TRY(td_attn_paged(B, c->qkv, 3 * D, c->att, c->self.pool, &c->self.l, l, &c->self.m, 1.0f, true, &rb));
    TD_TRY(td_gemm(B, c->att, w->o, NULL, c->h, Bn, D, D, TD_ACT_NONE, TD_GEMM_ACCUM));
    td_gemm_args ca = {.x = c->h, .w = w->cq, .y = c->q, .m = Bn, .n = D, .k = D, .norm_plain = true,
                       .norm_eps = 1e-6f, .norm_rms = true, .scratch_norm = c->x};
    TD_TRY(td_gemm_ex(B, &ca));
    TD_TRY(td_attn_paged(B, c->q, D, c->att, c->cross.pool, &c->cross.l, l, &c->cross.m, 1.0f, false, NULL));
    TD_TRY(td_gemm(B, c->att, w->co, NULL, c->h, Bn, D, D, TD_ACT_NONE, TD_GEMM_ACCUM));
    td_gemm_args fa = {.x = c->h, .w = w->wi, .y = c->ff1, .m = Bn, .n = 2 * FF, .k = D, .act = TD_ACT_GELU_TANH,
                       .flags = TD_GEMM_GLU, .norm_plain = true, .norm_eps = 1e-6f, .norm_rms = true,
                       .scratch_norm = c->x, .scratch_glu = c->ff};
    TD_TRY(td_gemm_ex(B, &fa));
    TD_TRY(td_gemm(B, c->ff1, w->wo, NULL, c->h, Bn, D, FF, TD_ACT_NONE, TD_GEMM_ACCUM));
  }
  for (int l = 0; l < LAYERS && c->unfused; l++) {
    layer_w *w = &c->L[l];
    TD_TRY(td_norm(B, c->h, w->n1, NULL, c->x, Bn, D, 1e-6f, true));
    TD_TRY(td_gemm(B, c->x, w->qkv, NULL, c->qkv, Bn, 3 * D, D, TD_ACT_NONE, 0));
    TD_TRY(td_kv_write(B, (char *)c->qkv + D * 2, (char *)c->qkv + 2 * D * 2, 3 * D, c->self.pool, &c->self.l, l,
                       c->slots, Bn));
    TD_TRY(td_attn_paged(B, c->qkv, 3 * D, c->att, c->self.pool, &c->self.l, l, &c->self.m, 1.0f, true, &rb));
    TD_TRY(td_gemm(B, c->att, w->o, NULL, c->h, Bn, D, D, TD_ACT_NONE, TD_GEMM_ACCUM));
    TD_TRY(td_norm(B, c->h, w->n2, NULL, c->x, Bn, D, 1e-6f, true));
    TD_TRY(td_gemm(B, c->x, w->cq, NULL, c->q, Bn, D, D, TD_ACT_NONE, 0));
    TD_TRY(td_attn_paged(B, c->q, D, c->att, c->cross.pool, &c->cross.l, l, &c->cross.m, 1.0f, false, NULL));
    TD_TRY(td_gemm(B, c->att, w->co, NULL, c->h, Bn, D, D, TD_ACT_NONE, TD_GEMM_ACCUM));
    TD_TRY(td_norm(B, c->h, w->n3, NULL, c->x, Bn, D, 1e-6f, true));
    TD_TRY(td_gemm(B, c->x, w->wi, NULL, c->ff, Bn, 2 * FF, D, TD_ACT_NONE, 0));
    TD_TRY(td_gated_act(B, c->ff, c->ff1, Bn, FF, TD_ACT_GELU_TANH));
    TD_TRY(td_gemm(B, c->ff1, w->wo, NULL, c->h, Bn, D, FF, TD_ACT_NONE, TD_GEMM_ACCUM));
  }
  TD_TRY(td_norm(B, c->h, c->fnorm, NULL, c->x, Bn, D, 1e-6f, true));
  TD_TRY(td_gemm(B, c->x, c->head, NULL, c->logits, Bn, VOCAB, D, TD_ACT_NONE, TD_GEMM_OUT_F32));
  return td_sample(B, c->logits, Bn, VOCAB, c->rows, NULL, c->tok, NULL);
}

static void alloc_layers(layer_w *L, bool decoder) {
  for (int l = 0; l < LAYERS; l++) {
    L[l].qkv = act((size_t)3 * D * D);
    L[l].o = act((size_t)D * D);
    L[l].cq = decoder ? act((size_t)D * D) : NULL;
    L[l].co = decoder ? act((size_t)D * D) : NULL;
    L[l].wi = act((size_t)2 * FF * D);
    L[l].wo = act((size_t)D * FF);
    L[l].n1 = f32(D, 1.0f);
    L[l].n2 = f32(D, 1.0f);
    L[l].n3 = f32(D, 1.0f);
  }
}

static void free_layers(layer_w *L) {
  for (int l = 0; l < LAYERS; l++) {
    void *p[] = {L[l].qkv, L[l].o, L[l].cq, L[l].co, L[l].wi, L[l].wo, L[l].n1, L[l].n2, L[l].n3};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) td_free(B, p[i]);
  }
}

static void bench_step(step_ctx *c, int batch, int self_ctx) {
  if (skip("decode step")) return;
  c->batch = batch;
  paged_setup(&c->self, batch, self_ctx, 512, true);
  paged_setup(&c->cross, batch, ENC_LEN, 512, false);
  c->h = act((size_t)batch * D);
  c->x = act((size_t)batch * D);
  c->qkv = act((size_t)batch * 3 * D);
  c->q = act((size_t)batch * D);
  c->att = act((size_t)batch * D);
  c->ff = act((size_t)batch * 2 * FF);
  c->ff1 = act((size_t)batch * FF);
  CHECK(td_alloc(B, TD_BUF_F32, (size_t)batch * VOCAB, &c->logits));
  int32_t *h = malloc(sizeof(int32_t) * batch);
  for (int i = 0; i < batch; i++) h[i] = i * ((self_ctx + BS - 1) / BS) * BS + self_ctx - 1; /* last slot */
  c->slots = i32(h, batch);
  for (int i = 0; i < batch; i++) h[i] = (i * 7919) % VOCAB;
  c->ids = i32(h, batch);
  CHECK(td_alloc(B, TD_BUF_I32, (size_t)batch, &c->tok));
  td_sample_row *sr = calloc(batch, sizeof *sr);
  for (int i = 0; i < batch; i++) sr[i] = (td_sample_row){.forced = -1, .top_p = 1.0f};
  CHECK(td_alloc(B, TD_BUF_F32, batch * sizeof *sr / 4, &c->rows));
  CHECK(td_upload(B, TD_BUF_F32, c->rows, (const float *)sr, batch * sizeof *sr / 4));
  double t = time_work(step_work, c);
  double wbytes = (double)LAYERS * (6.0 * D * D + 3.0 * FF * D) * 2 + (double)VOCAB * D * 2;
  double kv = (double)batch * LAYERS * 2 * D * 2 * (ENC_LEN + self_ctx);
  double flops = 2.0 * batch * (LAYERS * (6.0 * D * D + 3.0 * FF * D) + (double)VOCAB * D);
  char shape[48];
  snprintf(shape, sizeof shape, "batch %d, cross %d, self %d", batch, ENC_LEN, self_ctx);
  add("decode step (24 layers, graph)", shape, t, wbytes + kv, flops);
  printf("    weights %.0f MB + KV %.0f MB; %.0f tokens/s\n", wbytes / 1e6, kv / 1e6, batch / t);
  paged_free(&c->self);
  paged_free(&c->cross);
  void *p[] = {c->h, c->x, c->qkv, c->q, c->att, c->ff, c->ff1, c->logits, c->slots, c->ids, c->tok, c->rows};
  for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) td_free(B, p[i]);
  free(h);
  free(sr);
}

typedef struct enc_ctx {
  layer_w L[LAYERS];
  void *lut, *cu, *h, *x, *qkv, *att, *ff, *ff1;
  int n_seqs, len;
} enc_ctx;

static td_status enc_work(void *p) {
  enc_ctx *c = p;
  int T = c->n_seqs * c->len;
  td_relbias rb = {c->lut, 128};
  for (int l = 0; l < LAYERS; l++) {
    layer_w *w = &c->L[l];
    TD_TRY(td_norm(B, c->h, w->n1, NULL, c->x, T, D, 1e-6f, true));
    TD_TRY(td_gemm(B, c->x, w->qkv, NULL, c->qkv, T, 3 * D, D, TD_ACT_NONE, 0));
    TD_TRY(td_attn_dense(B, c->qkv, c->att, c->cu, c->n_seqs, T, c->len, NH, DH, 1.0f, false, &rb));
    TD_TRY(td_gemm(B, c->att, w->o, NULL, c->h, T, D, D, TD_ACT_NONE, TD_GEMM_ACCUM));
    TD_TRY(td_norm(B, c->h, w->n2, NULL, c->x, T, D, 1e-6f, true));
    TD_TRY(td_gemm(B, c->x, w->wi, NULL, c->ff, T, 2 * FF, D, TD_ACT_NONE, 0));
    TD_TRY(td_gated_act(B, c->ff, c->ff1, T, FF, TD_ACT_GELU_TANH));
    TD_TRY(td_gemm(B, c->ff1, w->wo, NULL, c->h, T, D, FF, TD_ACT_NONE, TD_GEMM_ACCUM));
  }
  return TD_OK;
}

static void bench_encoder(int n_seqs, int len) {
  if (skip("encoder forward")) return;
  /* the rate varies with the card's power state: measure it again next to
   * the encoder and keep the higher figure (the stricter floor) */
  double r2 = matrix_rate();
  printf("bf16 matrix rate again: %.1f TFLOP/s; floors use %.1f\n", r2 / 1e12, (r2 > RATE ? r2 : RATE) / 1e12);
  RATE = r2 > RATE ? r2 : RATE;
  enc_ctx *c = calloc(1, sizeof *c);
  alloc_layers(c->L, false);
  int T = n_seqs * len;
  int32_t *cu = malloc(sizeof(int32_t) * (n_seqs + 1));
  for (int s = 0; s <= n_seqs; s++) cu[s] = s * len;
  c->cu = i32(cu, n_seqs + 1);
  c->lut = f32(NH * 257, 0.1f);
  c->n_seqs = n_seqs;
  c->len = len;
  c->h = act((size_t)T * D);
  c->x = act((size_t)T * D);
  c->qkv = act((size_t)T * 3 * D);
  c->att = act((size_t)T * D);
  c->ff = act((size_t)T * 2 * FF);
  c->ff1 = act((size_t)T * FF);
  double t = time_work(enc_work, c);
  double flops = 2.0 * T * LAYERS * (4.0 * D * D + 3.0 * FF * D) + LAYERS * 4.0 * n_seqs * (double)len * len * D;
  char shape[48];
  snprintf(shape, sizeof shape, "%dx%d tokens", n_seqs, len);
  add("encoder forward (24 layers)", shape, t, 0.0, flops);
  printf("    %.1f%% of the measured bf16 matrix rate\n", 100.0 * flops / t / RATE);
  free_layers(c->L);
  void *p[] = {c->cu, c->lut, c->h, c->x, c->qkv, c->att, c->ff, c->ff1};
  for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) td_free(B, p[i]);
  free(cu);
  free(c);
}

/* The alternatives the backend can be switched to, for comparison: GEMMs
 * of m <= 16 on cuBLASLt, dense attention head_dim 64 on 64-row tiles and
 * on the unpipelined wgmma kernel,
 * and the decode step without programmatic dependent launch: a backend
 * each, with main's tuning and that change. */
static td_backend *alt_backend(const td_cuda_tuning *t) {
  td_backend *alt;
  td_backend_opts o = {.kind = TD_BACKEND_CUDA, .device = 0, .cuda = *t};
  CHECK(td_backend_create(&o, &alt));
  return alt;
}

static void variants(step_ctx *step, const td_cuda_tuning *base) {
  td_backend *main_b = B;
  td_cuda_tuning t = *base;
  t.dense64_warps = 4;
  B = alt_backend(&t);
  printf("-- alternatives\n");
  bench_dense(64, 512, false, true);
  snprintf(rows[n_rows - 1].what, sizeof rows[0].what, "alt: attn_dense 64-row tiles");
  td_backend_destroy(B);
  t = *base;
  t.dense64_warps = 3;
  B = alt_backend(&t);
  bench_dense(64, 512, false, true);
  snprintf(rows[n_rows - 1].what, sizeof rows[0].what, "alt: attn_dense wgmma unpipelined");
  td_backend_destroy(B);
  t = *base;
  t.skinny = TD_OFF;
  B = alt_backend(&t);
  static const int ms[] = {1, 16, 64};
  for (int i = 0; i < 3; i++) {
    bench_gemm("alt: cuBLASLt decode qkv", ms[i], 3 * D, D, 0);
    bench_gemm("alt: cuBLASLt decode o", ms[i], D, D, 0);
    bench_gemm("alt: cuBLASLt decode ffn in", ms[i], 2 * FF, D, 0);
    bench_gemm("alt: cuBLASLt decode ffn out", ms[i], D, FF, 0);
  }
  td_backend_destroy(B);
  B = main_b;
  if (step) {
    step->unfused = true;
    bench_step(step, 1, 64);
    snprintf(rows[n_rows - 1].what, sizeof rows[0].what, "alt: decode step, unfused ops");
    bench_step(step, 64, 64);
    snprintf(rows[n_rows - 1].what, sizeof rows[0].what, "alt: decode step, unfused ops");
    step->unfused = false;
    t = *base;
    t.pdl = TD_OFF;
    B = alt_backend(&t);
    bench_step(step, 1, 64);
    snprintf(rows[n_rows - 1].what, sizeof rows[0].what, "alt: decode step, no PDL");
    bench_step(step, 64, 64);
    snprintf(rows[n_rows - 1].what, sizeof rows[0].what, "alt: decode step, no PDL");
    td_backend_destroy(B);
  }
  B = main_b;
}

/* ------------------------------------------------------------ main */

static void write_results(const char *path, const char *commit) {
  FILE *f = fopen(path, "a+");
  if (!f) {
    fprintf(stderr, "cannot open %s\n", path);
    return;
  }
  fseek(f, 0, SEEK_END);
  if (ftell(f) == 0)
    fprintf(f, "# Benchmark results\n\nAppended by the programs under bench/; newest last. Each section names its "
               "program, date, device and commit.\n");
  char date[32];
  time_t tt = time(NULL);
  strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", gmtime(&tt));
  fprintf(f, "\n## bench_cuda_kernels — %s, %s, commit %s\n\n", date, td_backend_name(B), commit);
  fprintf(f, "Ceilings measured in the run: copy %.2f TB/s (read + write), bf16 GEMM %.0f TFLOP/s (8192^3). "
             "Flan-T5-large shape; times are medians of CUDA-graph replays.\n\n",
          BW / 1e12, RATE / 1e12);
  fprintf(f, "| what | shape | time (us) | floor (us) | x floor | achieved |\n|---|---|---:|---:|---:|---:|\n");
  for (int i = 0; i < n_rows; i++) {
    row *r = &rows[i];
    fprintf(f, "| %s | %s | %.1f | %.1f | %.2f | %.1f %s |\n", r->what, r->shape, r->t * 1e6, r->floor * 1e6,
            r->t / r->floor, r->achieved, strcmp(r->bound, "mem") ? "TFLOP/s" : "TB/s");
  }
  fclose(f);
  printf("\nappended to %s\n", path);
}

int main(int argc, char **argv) {
  td_settings settings;
  if (td_settings_from_env(&settings) != TD_OK) {
    fprintf(stderr, "bench: %s\n", td_errmsg());
    return 2;
  }
  td_settings_apply(&settings);
  const char *results = "bench/RESULTS.md", *commit = getenv("TD_COMMIT");
  if (!commit) commit = TD_GIT_COMMIT;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--results") && i + 1 < argc) results = argv[++i];
    else if (!strcmp(argv[i], "--commit") && i + 1 < argc) commit = argv[++i];
    else if (!strcmp(argv[i], "--quick")) quick = 1;
    else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else {
      fprintf(stderr, "usage: %s [--results FILE] [--commit ID] [--quick] [--only SUBSTR]\n", argv[0]);
      return 2;
    }
  }
  td_backend_opts o = {.kind = TD_BACKEND_CUDA, .device = 0, .cuda = settings.cuda};
  CHECK(td_backend_create(&o, &B));
  printf("%s, commit %s\n", td_backend_name(B), commit);
  /* random bf16 source, N(0,1)/32-ish: weights and activations stay finite */
  {
    float *h = malloc(sizeof(float) * CHUNK);
    uint64_t s = 0x1234567;
    for (size_t i = 0; i < CHUNK; i++) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      h[i] = ((float)(s >> 40) / 16777216.0f - 0.5f) * 0.1f;
    }
    CHECK(td_alloc(B, TD_BUF_ACT, CHUNK, &chunk));
    CHECK(td_upload(B, TD_BUF_ACT, chunk, h, CHUNK));
    free(h);
  }
  if (only) { /* nominal H100 ceilings; nothing is written to the results */
    BW = 3.0e12;
    RATE = 7.5e14;
  } else {
    ceilings();
  }

  printf("%-28s %-30s %13s  %15s  %6s  %s\n", "what", "shape", "time", "floor", "x", "achieved");
  bench_dense(64, 512, false, true);
  bench_dense(64, 512, false, false);
  bench_dense(64, 512, true, false);
  bench_dense_rows(1500);
  bench_dense_rows(3000);
  bench_dense_one(352, 16);
  bench_dense_one(512, 16);
  static const int batches[] = {1, 16, 64};
  for (int i = 0; i < 3; i++) bench_paged(batches[i], ENC_LEN, false);
  for (int i = 0; i < 3; i++) bench_paged(batches[i], 64, true);
  static const int sbatches[] = {1, 4, 16, 64, 128, 160, 192, 256};
  for (int i = 0; i < 8; i++) bench_states(sbatches[i], ENC_LEN);
  for (int i = 0; i < 3; i++) {
    bench_heads(batches[i], false);
    bench_heads(batches[i], true);
  }
  for (int i = 0; i < 3; i++) {
    int m = batches[i];
    bench_gemm("gemm decode qkv", m, 3 * D, D, 0);
    bench_gemm("gemm decode o", m, D, D, 0);
    bench_gemm("gemm decode ffn in", m, 2 * FF, D, 0);
    bench_gemm("gemm decode ffn out", m, D, FF, 0);
    bench_gemm("gemm decode lm head f32", m, VOCAB, D, TD_GEMM_OUT_F32);
    bench_gemm_ex("gemm_ex decode qkv+rms", m, 3 * D, D, true, false);
    bench_gemm_ex("gemm_ex decode ffn in+rms+glu", m, 2 * FF, D, true, true);
  }
  bench_xl_tp2();
  bench_hop();
  bench_ew("rmsnorm", 32768, D, false);
  bench_ew("gated gelu", 32768, FF, true);
  bench_ew("rmsnorm", 64, D, false);
  bench_ew("gated gelu", 64, FF, true);
  bench_gemm("gemm encoder qkv", 32768, 3 * D, D, 0);
  bench_gemm("gemm encoder ffn in", 32768, 2 * FF, D, 0);
  bench_gemm("gemm encoder ffn out", 32768, D, FF, 0);
  step_ctx *step = NULL;
  if (!skip("decode step")) {
    step = calloc(1, sizeof *step);
    alloc_layers(step->L, true);
    step->head = act((size_t)VOCAB * D);
    step->fnorm = f32(D, 1.0f);
    step->lut = f32(NH * 257, 0.1f);
    for (int i = 0; i < 3; i++) bench_step(step, batches[i], 64);
  }
  bench_encoder(64, 512);
  if (!only) {
    variants(step, &settings.cuda);
    write_results(results, commit);
  }
  if (step) {
    free_layers(step->L);
    td_free(B, step->head);
    td_free(B, step->fnorm);
    td_free(B, step->lut);
    free(step);
  }
  td_free(B, chunk);
  td_backend_destroy(B);
  return 0;
}
