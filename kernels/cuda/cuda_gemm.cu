/* GEMMs through cuBLASLt: y[m,n] = act(x[m,k] W[n,k]^T + bias) (+ y).
 * Row-major y is column-major y^T = W x^T, so A = W (transposed), B = x,
 * D = y with leading dimension n: the "TN" layout Hopper kernels favour.
 * Bias and activation go into the cuBLASLt epilogue when it has the exact
 * function (ReLU; GELU, which cuBLASLt computes with the tanh formula);
 * exact GELU, SiLU and quick GELU get a fused bias+activation pass.
 * Plans (descriptors + heuristic algorithm) are cached per shape, so the
 * heuristic runs once per shape, never on the replay path.
 *
 * Decode GEMMs of a few rows are weight streaming: there a "skinny"
 * tensor-core kernel reads W once (cuda_gemm_skinny.cu); more rows go to
 * cuBLASLt. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uthash.h>

#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/cuda_ptx.cuh"

extern "C" {
#include "kernels/act.h"
}

enum { MODE_LT = 0, MODE_LT_POST = 1, MODE_FALLBACK = 2 };

typedef struct td_gemm_plan {
  bool used;
  uint64_t stamp; /* last use, for eviction within a set */
  /* key */
  int m, n, k, act;
  unsigned flags;
  int bias;       /* 0 none, 1 float32, 2 float32 with a bf16 copy for the epilogue */
  unsigned align; /* log2 alignments of x, w, y, bias */
  /* plan */
  int mode;
  bool lt_bias;  /* the bias goes to cuBLASLt's epilogue */
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulAlgo_t algo;
  int rows; /* the row count its layouts hold now (the key's m or fewer: td_cu_plan_rows) */
} td_gemm_plan;

static unsigned align_log2(const void *p) {
  uintptr_t a = (uintptr_t)p;
  unsigned l = 0;
  while (l < 8 && !(a & ((uintptr_t)1 << l))) l++;
  return l; /* 8 means 256 bytes or more (or NULL) */
}

static void plan_release(td_gemm_plan *p) {
  td_cu_lt_release(p->op, p->la, p->lb, p->lc);
  memset(p, 0, sizeof *p);
}

td_status td_cu_gemm_init(td_cuda *c) {
  c->plans = (td_gemm_plan *)calloc(TD_CU_GEMM_CACHE, sizeof(td_gemm_plan));
  if (!c->plans) return td_err(TD_ERR_NOMEM, "cuda gemm: plan cache");
  TD_TRY(td_cu_skinny_init(c));
  return td_cu_skf_init(c);
}

/* cuBLASLt's BIAS epilogues take a bias of the output's type (cublasLt.h,
 * CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE): with our float32 biases and a bf16
 * output every bias went to a separate pass after the GEMM (39 % of a
 * Whisper-large-v3 encoder run). So each bias a bf16-output GEMM meets gets a
 * bf16 copy, made on its first eager use (never while capturing: that GEMM
 * takes the pass) and kept until its memory is freed (td_cu_bias16_drop).
 * Biases are weights: they do not change while their memory lives. The copy
 * rounds the bias to bf16, as transformers' bf16 Linear layers hold it. */
struct cu_bias16 {
  const float *f32;
  bf16 *b16;
  int n;
  UT_hash_handle hh;
};

__global__ void bias16_kernel(bf16 *y, const float *__restrict__ x, int n) {
  td_pdl_start();
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2bfloat16(x[i]);
}

static const bf16 *bias16_get(td_cuda *c, const float *bias, int n) {
  struct cu_bias16 *e = NULL;
  HASH_FIND_PTR(c->bias16, &bias, e);
  if (e && e->n >= n) return e->b16;
  if (e || td_cu_capturing(c)) return NULL;
  if (!(e = (struct cu_bias16 *)calloc(1, sizeof *e))) return NULL;
  if (cudaMalloc((void **)&e->b16, sizeof(bf16) * (size_t)n) != cudaSuccess) {
    (void)cudaGetLastError();
    free(e);
    return NULL;
  }
  if (td_launch(c, bias16_kernel, (n + 255) / 256, 256, 0, e->b16, bias, n) != cudaSuccess) {
    (void)cudaGetLastError();
    (void)cudaFree(e->b16);
    free(e);
    return NULL;
  }
  e->f32 = bias;
  e->n = n;
  HASH_ADD_PTR(c->bias16, f32, e);
  return e->b16;
}

void td_cu_bias16_drop(td_cuda *c, const void *p, size_t bytes) {
  struct cu_bias16 *e, *t;
  uintptr_t lo = (uintptr_t)p, hi = lo + bytes;
  HASH_ITER(hh, c->bias16, e, t) {
    uintptr_t a = (uintptr_t)e->f32;
    if (a < lo || a >= hi) continue;
    HASH_DEL(c->bias16, e);
    (void)cudaFree(e->b16); /* cudaFree waits for the work that may still read it */
    free(e);
  }
}

void td_cu_gemm_destroy(td_cuda *c) {
  td_cu_bias16_drop(c, NULL, SIZE_MAX);
  if (!c->plans) return;
  for (int i = 0; i < TD_CU_GEMM_CACHE; i++)
    if (c->plans[i].used) plan_release(&c->plans[i]);
  free(c->plans);
  c->plans = NULL;
}

/* Builds descriptors for one epilogue and asks the heuristic; false when
 * cuBLASLt has no algorithm for it (descriptors released). */
enum { LT_CANDIDATES = 8 };

static bool lt_try(td_cuda *c, td_gemm_plan *p, cublasLtEpilogue_t epi, bool lt_bias, const void *bias,
                   cublasLtMatmulHeuristicResult_t *res, int *n_res) {
  cudaDataType_t out = (p->flags & TD_GEMM_OUT_F32) ? CUDA_R_32F : CUDA_R_16BF;
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  bool ok = cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) ==
                CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) ==
                CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi) ==
                CUBLAS_STATUS_SUCCESS;
  if (ok && lt_bias) {
    int32_t bt = p->bias == 2 ? CUDA_R_16BF : CUDA_R_32F; /* the bias has the output's type (2: a bf16 copy) */
    ok = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt) ==
             CUBLAS_STATUS_SUCCESS &&
         cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias) ==
             CUBLAS_STATUS_SUCCESS;
  }
  ok = ok && cublasLtMatrixLayoutCreate(&p->la, CUDA_R_16BF, p->k, p->n, p->k) == CUBLAS_STATUS_SUCCESS &&
       cublasLtMatrixLayoutCreate(&p->lb, CUDA_R_16BF, p->k, p->m, p->k) == CUBLAS_STATUS_SUCCESS &&
       cublasLtMatrixLayoutCreate(&p->lc, out, p->n, p->m, p->n) == CUBLAS_STATUS_SUCCESS;
  cublasLtMatmulPreference_t pref = NULL;
  int found = 0;
  memset(res, 0, sizeof *res * LT_CANDIDATES);
  if (ok && cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS) {
    uint64_t ws = TD_CU_LT_WORKSPACE;
    /* alignments in bytes of x (B), w (A), y (C and D), capped at 256 */
    uint32_t ax = 1u << ((p->align >> 0) & 15), aw = 1u << ((p->align >> 4) & 15),
             ay = 1u << ((p->align >> 8) & 15);
    ok = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws) ==
             CUBLAS_STATUS_SUCCESS &&
         cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aw, sizeof aw) ==
             CUBLAS_STATUS_SUCCESS &&
         cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ax, sizeof ax) ==
             CUBLAS_STATUS_SUCCESS &&
         cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ay, sizeof ay) ==
             CUBLAS_STATUS_SUCCESS &&
         cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ay, sizeof ay) ==
             CUBLAS_STATUS_SUCCESS;
    ok = ok &&
         cublasLtMatmulAlgoGetHeuristic(c->lt, p->op, p->la, p->lb, p->lc, p->lc, pref, LT_CANDIDATES, res, &found) ==
             CUBLAS_STATUS_SUCCESS &&
         found > 0 && res[0].state == CUBLAS_STATUS_SUCCESS;
    cublasLtMatmulPreferenceDestroy(pref);
  } else {
    ok = false;
  }
  if (!ok) {
    td_gemm_plan keep = *p;
    plan_release(p);
    /* keep the key, drop the descriptors */
    p->m = keep.m, p->n = keep.n, p->k = keep.k, p->act = keep.act, p->flags = keep.flags, p->bias = keep.bias,
    p->align = keep.align;
    return false;
  }
  p->algo = res[0].algo;
  p->lt_bias = lt_bias;
  *n_res = found;
  return true;
}

/* td_cuda_tuning.autotune: large GEMMs time the heuristic's candidates once
 * on their own operands (a synchronisation on the plan's first use, never
 * while capturing) and keep the fastest. Not for TD_GEMM_ACCUM, whose
 * output the timing runs would change. */
static void lt_autotune(td_cuda *c, td_gemm_plan *p, const cublasLtMatmulHeuristicResult_t *res, int found,
                        const void *x, const void *w, void *y) {
  cudaEvent_t e0 = NULL, e1 = NULL;
  if (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess) {
    (void)cudaGetLastError();
    if (e0) cudaEventDestroy(e0);
    return;
  }
  float alpha = 1.0f, beta = 0.0f, best = 1e30f;
  int bi = 0;
  for (int i = 0; i < found; i++) {
    if (res[i].state != CUBLAS_STATUS_SUCCESS || res[i].workspaceSize > TD_CU_LT_WORKSPACE) continue;
    bool ok = true;
    for (int r = 0; r < 4 && ok; r++) { /* one warm-up, three timed */
      if (r == 1) ok = cudaEventRecord(e0, c->stream) == cudaSuccess;
      ok = ok && cublasLtMatmul(c->lt, p->op, &alpha, w, p->la, x, p->lb, &beta, y, p->lc, y, p->lc, &res[i].algo,
                                c->lt_ws, TD_CU_LT_WORKSPACE, c->stream) == CUBLAS_STATUS_SUCCESS;
    }
    float ms = 0.0f;
    ok = ok && cudaEventRecord(e1, c->stream) == cudaSuccess && cudaEventSynchronize(e1) == cudaSuccess &&
         cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess;
    if (!ok) {
      (void)cudaGetLastError();
      (void)cudaStreamSynchronize(c->stream);
      continue;
    }
    if (c->tune.verbose)
      fprintf(stderr, "tandem cuda gemm m=%d n=%d k=%d candidate %d: %.1f us\n", p->m, p->n, p->k, i, ms * 1e3f / 3);
    if (ms < best) {
      best = ms;
      bi = i;
    }
  }
  p->algo = res[bi].algo;
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

/* Points the plan's x and y layouts at m rows (the key's or fewer). */
static bool plan_rows(td_gemm_plan *p, int m) {
  if (p->rows == m) return true;
  uint64_t v = (uint64_t)m;
  if (cublasLtMatrixLayoutSetAttribute(p->lb, CUBLASLT_MATRIX_LAYOUT_COLS, &v, sizeof v) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutSetAttribute(p->lc, CUBLASLT_MATRIX_LAYOUT_COLS, &v, sizeof v) != CUBLAS_STATUS_SUCCESS)
    return false;
  p->rows = m;
  return true;
}

/* The plan for an m-row GEMM, keyed by td_cu_plan_rows(m) (exact: by m),
 * its layouts at m rows (a false plan_rows leaves the fallback kernel). */
static td_gemm_plan *plan_get(td_cuda *c, int m, bool exact, int n, int k, int act, unsigned flags, const void *x,
                              const void *w, const float *bias, const bf16 *b16, void *y) {
  int rows = m;
  m = exact ? m : td_cu_plan_rows(&c->tune, m);
  int kind = !bias ? 0 : b16 ? 2 : 1;
  const void *lb = b16 ? (const void *)b16 : (const void *)bias;
  unsigned align = align_log2(x) | align_log2(w) << 4 | align_log2(y) << 8 | (bias ? align_log2(lb) : 8) << 12;
  uint64_t h = (uint64_t)m * 0x9E3779B97F4A7C15ull ^ (uint64_t)n * 0xC2B2AE3D27D4EB4Full ^
               (uint64_t)k * 0x165667B19E3779F9ull ^ ((uint64_t)act << 40 | (uint64_t)flags << 48 |
                                                      (uint64_t)kind << 56 | (uint64_t)align << 20);
  /* a full mix: n and k are often multiples of 512, which left the low
   * bits that pick the set to m alone */
  h ^= h >> 30, h *= 0xBF58476D1CE4E5B9ull, h ^= h >> 27, h *= 0x94D049BB133111EBull, h ^= h >> 31;
  /* set-associative: a direct-mapped cache let two hot shapes evict each
   * other on every call, re-running the heuristic (eager pipeline steps
   * ran several times slower) */
  td_gemm_plan *set = &c->plans[(h % (TD_CU_GEMM_CACHE / TD_CU_GEMM_WAYS)) * TD_CU_GEMM_WAYS], *p = set;
  for (int i = 0; i < TD_CU_GEMM_WAYS; i++) {
    td_gemm_plan *q = &set[i];
    if (q->used && q->m == m && q->n == n && q->k == k && q->act == act && q->flags == flags &&
        q->bias == kind && q->align == align) {
      q->stamp = ++c->plan_clock;
      if (q->mode != MODE_FALLBACK && !plan_rows(q, rows)) q->mode = MODE_FALLBACK;
      return q;
    }
    if (!q->used ? p->used : p->used && q->stamp < p->stamp) p = q;
  }
  if (p->used) plan_release(p);
  p->stamp = ++c->plan_clock;
  c->plans_made++;
  p->used = true;
  p->m = m, p->n = n, p->k = k, p->act = act, p->flags = flags, p->bias = kind, p->align = align;
  cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
  switch (act) {
    case TD_ACT_NONE: epi = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT; break;
    case TD_ACT_RELU: epi = bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU; break;
    case TD_ACT_GELU_TANH: epi = bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU; break;
    default: epi = CUBLASLT_EPILOGUE_DEFAULT; break; /* erf GELU, SiLU, quick GELU: our own pass */
  }
  bool post = epi == CUBLASLT_EPILOGUE_DEFAULT && (bias || act != TD_ACT_NONE);
  bool lt_bias = bias && epi != CUBLASLT_EPILOGUE_DEFAULT;
  cublasLtMatmulHeuristicResult_t res[LT_CANDIDATES];
  int found = 0;
  if (lt_try(c, p, epi, lt_bias, lb, res, &found)) {
    p->mode = post ? MODE_LT_POST : MODE_LT;
  } else if (epi != CUBLASLT_EPILOGUE_DEFAULT && lt_try(c, p, CUBLASLT_EPILOGUE_DEFAULT, false, NULL, res, &found)) {
    p->mode = MODE_LT_POST;
  } else {
    p->mode = MODE_FALLBACK;
  }
  p->used = true;
  p->rows = m;
  if (p->mode != MODE_FALLBACK && !plan_rows(p, rows)) p->mode = MODE_FALLBACK;
  if (p->mode != MODE_FALLBACK && c->tune.autotune && found > 1 && !(flags & TD_GEMM_ACCUM) &&
      (double)m * n * k >= (double)c->tune.autotune_min * 1e6 && !td_cu_capturing(c))
    lt_autotune(c, p, res, found, x, w, y);
  if (c->tune.verbose)
    fprintf(stderr, "tandem cuda gemm plan m=%d n=%d k=%d act=%d flags=%u bias=%d align=%03x: %s\n", m, n, k, act,
            flags, kind, align,
            p->mode == MODE_LT ? "cuBLASLt, fused epilogue"
                               : p->mode == MODE_LT_POST ? "cuBLASLt + bias/activation pass" : "fallback kernel");
  return p;
}

/* y = act(y + bias) over [m, n], any shape: the scalar form. */
template <typename T>
__global__ void bias_act_kernel(T *y, const float *__restrict__ bias, int m, int n, int act) {
  td_pdl_start();
  size_t total = (size_t)m * n;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
    float v = (float)y[i];
    if (bias) v += bias[i % n];
    y[i] = (T)td_act_apply(act, v);
  }
}

/* The same where a row is whole 16-byte vectors (n % 8 == 0 for bf16, % 4
 * for float32, y aligned), the activation a template argument. This pass
 * follows every cuBLASLt GEMM whose epilogue cannot carry the bias or
 * activation (the Whisper and BART encoders' biases and erf GELU; the
 * scalar form ran at a fifth of the memory bandwidth and took 39 % of a
 * Whisper-large-v3 encoder run). A thread keeps one column vector, its
 * bias in registers, and walks the rows two at a time (both loads in flight
 * before either is computed); blockDim.x threads a row, blockDim.y rows. */
template <typename T, int ACT>
__global__ void bias_act_vec_kernel(T *y, const float *__restrict__ bias, unsigned nv, unsigned m) {
  constexpr int V = 16 / sizeof(T);
  td_pdl_start();
  unsigned c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= nv) return;
  float b[V];
#pragma unroll
  for (int j = 0; j < V; j++) b[j] = bias ? __ldg(bias + (size_t)c * V + j) : 0.0f;
  uint4 *base = reinterpret_cast<uint4 *>(y) + c;
  auto apply = [&](uint4 &raw) {
    T *e = reinterpret_cast<T *>(&raw);
#pragma unroll
    for (int j = 0; j < V; j++) e[j] = (T)td_act_apply(ACT, (float)e[j] + b[j]);
  };
  const unsigned stride = gridDim.y * blockDim.y;
  unsigned r = blockIdx.y * blockDim.y + threadIdx.y;
  for (; r + stride < m; r += 2 * stride) {
    uint4 *p0 = base + (size_t)r * nv, *p1 = base + (size_t)(r + stride) * nv;
    uint4 v0 = *p0, v1 = *p1;
    apply(v0);
    apply(v1);
    *p0 = v0;
    *p1 = v1;
  }
  if (r < m) {
    uint4 *p0 = base + (size_t)r * nv;
    uint4 v0 = *p0;
    apply(v0);
    *p0 = v0;
  }
}

template <typename T>
static void bias_act(td_cuda *c, T *y, const float *bias, int m, int n, int act) {
  constexpr int V = 16 / sizeof(T);
  if (n % V || !td_aligned16(y)) {
    (void)td_launch(c, bias_act_kernel<T>, td_blocks((size_t)m * n, 256), 256, 0, y, bias, m, n, act);
    return;
  }
  /* 32 column vectors by 8 rows a block, about 8 rows a thread (blocks small enough for an even tail), but
   * at least four blocks an SM where the rows allow: a decode step's 64-256 rows would otherwise get a
   * few dozen blocks (BART-large's FFN at 188 rows: 48, its serving 1-3 % slower) */
  unsigned nv = (unsigned)(n / V), gx = (nv + 31) / 32, gy = (unsigned)((m + 63) / 64);
  unsigned want = ((unsigned)c->sm_count * 4 + gx - 1) / gx, most = (unsigned)((m + 7) / 8);
  if (gy < want) gy = want < most ? want : most;
  if (gy > 65535) gy = 65535;
  dim3 grid(gx, gy), block(32, 8);
  switch (act) {
#define CASE(A) \
  case A: (void)td_launch(c, bias_act_vec_kernel<T, A>, grid, block, 0, y, bias, nv, (unsigned)m); break;
    CASE(TD_ACT_NONE)
    CASE(TD_ACT_RELU)
    CASE(TD_ACT_GELU)
    CASE(TD_ACT_GELU_TANH)
    CASE(TD_ACT_SILU)
    CASE(TD_ACT_QUICK_GELU)
#undef CASE
    default: (void)td_launch(c, bias_act_kernel<T>, td_blocks((size_t)m * n, 256), 256, 0, y, bias, m, n, act);
  }
}

/* Any alignment, any size; only used where cuBLASLt declines. */
template <typename T>
__global__ void gemm_fallback_kernel(const bf16 *__restrict__ x, const bf16 *__restrict__ w,
                                     const float *__restrict__ bias, T *y, int m, int n, int k, int act,
                                     bool accum) {
  td_pdl_start();
  __shared__ float xs[16][17], ws[16][17];
  int tx = threadIdx.x, ty = threadIdx.y;
  int row = blockIdx.y * 16 + ty, col = blockIdx.x * 16 + tx;
  float acc = 0.0f;
  for (int k0 = 0; k0 < k; k0 += 16) {
    int xr = blockIdx.y * 16 + ty, wr = blockIdx.x * 16 + ty, kc = k0 + tx;
    xs[ty][tx] = xr < m && kc < k ? __bfloat162float(x[(size_t)xr * k + kc]) : 0.0f;
    ws[ty][tx] = wr < n && kc < k ? __bfloat162float(w[(size_t)wr * k + kc]) : 0.0f;
    __syncthreads();
#pragma unroll
    for (int q = 0; q < 16; q++) acc += xs[ty][q] * ws[tx][q];
    __syncthreads();
  }
  if (row < m && col < n) {
    T *o = y + (size_t)row * n + col;
    if (bias) acc += bias[col];
    if (accum) acc += (float)*o;
    *o = (T)td_act_apply(act, acc);
  }
}


/* ar: the all-reduce the GEMM ends in (NULL: none) */
static td_status skinny_gemm(td_cuda *c, const void *x, const void *w, const float *bias, void *y, int m, int n, int k,
                             int act, unsigned flags, const td_cu_ar_dev *ar) {
  td_skinny_args a = {};
  a.x = (const bf16 *)x;
  a.w = (const bf16 *)w;
  a.bias = bias;
  a.y = y;
  a.m = m, a.n = n, a.k = k, a.act = act;
  a.accum = (flags & TD_GEMM_ACCUM) != 0;
  if (ar) a.ar = *ar;
  return td_cu_skinny(c, &a, (flags & TD_GEMM_OUT_F32) != 0, false, false);
}

bool td_cu_gemm_ar_fits(td_backend *b, const void *x, const void *w, const void *y, int m, int n, int k,
                        unsigned flags, int world) {
  const td_cuda *c = td_cu(b);
  return c->tune.fuse_allreduce && c->tune.skinny && !(flags & ~(unsigned)TD_GEMM_ACCUM) && m >= 1 && k % 8 == 0 &&
         td_aligned16(x) && td_aligned16(w) && td_aligned16(y) && td_cu_skinny_ar_fits(c, m, n, k, world);
}

td_status td_cu_gemm_ar(td_backend *b, const td_cu_ar_dev *d, const void *x, const void *w, const float *bias, void *y,
                        int m, int n, int k, unsigned flags) {
  td_cuda *c = td_cu(b);
  td_cu_bind(c);
  return skinny_gemm(c, x, w, bias, y, m, n, k, TD_ACT_NONE, flags, d);
}

td_status td_cu_gemm(td_backend *b, const void *x, const void *w, const float *bias, void *y, int m, int n, int k,
                     td_act act, unsigned flags) {
  td_cu_bind(td_cu(b));
  td_cuda *c = td_cu(b);
  if ((unsigned)act > TD_ACT_QUICK_GELU) return td_err(TD_ERR_INVALID, "gemm: unknown activation %d", (int)act);
  if (flags & ~(unsigned)(TD_GEMM_ACCUM | TD_GEMM_OUT_F32)) return td_err(TD_ERR_INVALID, "gemm: unknown flags %#x", flags);
  bool f32 = flags & TD_GEMM_OUT_F32;
  /* ahead of cuBLASLt up to 8 rows, and up to 16 while the weight is narrow
   * enough that re-reading x stays cheap (docs/cuda.md, "GEMMs") */
  if (c->tune.skinny && (m <= 8 || (m <= c->tune.skinny_rows && n <= 2048)) && k % 8 == 0 && td_aligned16(x) && td_aligned16(w))
    return skinny_gemm(c, x, w, bias, y, m, n, k, act, flags, NULL);
  /* a bf16 output's bias goes to cuBLASLt as a bf16 copy (bias16_get) where an epilogue can take it */
  bool epi_bias = act == TD_ACT_NONE || act == TD_ACT_RELU || act == TD_ACT_GELU_TANH;
  const bf16 *b16 = bias && !f32 && epi_bias ? bias16_get(c, bias, n) : NULL;
  td_gemm_plan *p = plan_get(c, m, false, n, k, act, flags, x, w, bias, b16, y);
  float alpha = 1.0f, beta = (flags & TD_GEMM_ACCUM) ? 1.0f : 0.0f;
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  for (int exact = p->m == m; p->mode != MODE_FALLBACK; exact = 1) {
    const void *lb = p->bias == 2 ? (const void *)b16 : (const void *)bias;
    if (p->lt_bias &&
        cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &lb, sizeof lb) !=
            CUBLAS_STATUS_SUCCESS)
      return td_err(TD_ERR_CUDA, "gemm: cannot set the bias pointer");
    st = cublasLtMatmul(c->lt, p->op, &alpha, w, p->la, x, p->lb, &beta, y, p->lc, y, p->lc, &p->algo, c->lt_ws,
                        TD_CU_LT_WORKSPACE, c->stream);
    if (st == CUBLAS_STATUS_SUCCESS || exact) break;
    /* the algorithm chosen for the bucket's rows declined these: a plan of their own */
    p = plan_get(c, m, true, n, k, act, flags, x, w, bias, b16, y);
  }
  if (p->mode == MODE_FALLBACK) {
    dim3 grid((n + 15) / 16, (m + 15) / 16), blk(16, 16);
    if (grid.y > 65535) return td_err(TD_ERR_UNSUPPORTED, "gemm: %d rows need cuBLASLt, which declined", m);
    if (f32)
      (void)td_launch(c, gemm_fallback_kernel<float>, grid, blk, 0, (const bf16 *)x, (const bf16 *)w, bias, (float *)y, m,
                                                               n, k, act, flags & TD_GEMM_ACCUM);
    else
      (void)td_launch(c, gemm_fallback_kernel<bf16>, grid, blk, 0, (const bf16 *)x, (const bf16 *)w, bias, (bf16 *)y, m,
                                                              n, k, act, flags & TD_GEMM_ACCUM);
    TD_CU_LAUNCHED("gemm (fallback)");
    return TD_OK;
  }
  if (st != CUBLAS_STATUS_SUCCESS)
    return td_err(TD_ERR_CUDA, "gemm: cublasLtMatmul failed (status %d) for m=%d n=%d k=%d", (int)st, m, n, k);
  if (p->mode == MODE_LT_POST) {
    if (f32) bias_act(c, (float *)y, bias, m, n, act);
    else bias_act(c, (bf16 *)y, bias, m, n, act);
    TD_CU_LAUNCHED("gemm bias/activation");
  }
  return TD_OK;
}
