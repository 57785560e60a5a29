/* td_gemm_heads, the per-head products around td_attn_states: a
 * tensor-core kernel for n % 64 == 0 and k % 16 == 0 (its K split over a
 * cluster where blocks are few), else one strided-batched cuBLASLt matmul
 * over the heads. */
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/cuda_ptx.cuh"

#include <cooperative_groups.h>

/* ---- td_gemm_heads: one strided-batched cuBLASLt matmul over the heads.
 * Row-major y_h = x_h W_h is column-major y_h^T = W_h^T x_h^T: A = W_h
 * ([k, n] rows: column-major n x k, no transpose; w_t: [n, k] rows,
 * transposed), B = x_h^T (k x m, leading dimension heads k), C = y_h^T
 * (n x m, leading dimension heads n). Plans are cached per shape. */
enum { HEADS_PLANS = 32 };
typedef struct td_heads_plan {
  int m, heads, n, k;
  bool w_t, used;
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulAlgo_t algo;
} td_heads_plan;

__global__ void heads_bias_kernel(bf16 *y, const float *__restrict__ bias, int m, int w) {
  td_pdl_start();
  size_t n = (size_t)m * w;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    y[i] = __float2bfloat16(__bfloat162float(y[i]) + bias[i % w]);
}

static void heads_plan_free(td_heads_plan *p) {
  td_cu_lt_release(p->op, p->la, p->lb, p->lc);
  memset(p, 0, sizeof *p);
}

void td_cu_heads_destroy(td_cuda *c) {
  td_heads_plan *ps = (td_heads_plan *)c->heads_plans;
  if (!ps) return;
  for (int i = 0; i < HEADS_PLANS; i++) heads_plan_free(&ps[i]);
  free(ps);
  c->heads_plans = NULL;
}

static bool heads_layout(cublasLtMatrixLayout_t *l, uint64_t rows, uint64_t cols, int64_t ld, int batch,
                         int64_t stride) {
  int32_t bc = batch;
  return cublasLtMatrixLayoutCreate(l, CUDA_R_16BF, rows, cols, ld) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc) ==
             CUBLAS_STATUS_SUCCESS &&
         cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride) ==
             CUBLAS_STATUS_SUCCESS;
}

static td_status heads_plan_get(td_cuda *c, int m, int heads, int n, int k, bool w_t, td_heads_plan **out) {
  if (!c->heads_plans) {
    c->heads_plans = calloc(HEADS_PLANS, sizeof(td_heads_plan));
    if (!c->heads_plans) return td_err(TD_ERR_NOMEM, "gemm_heads: plans");
  }
  td_heads_plan *ps = (td_heads_plan *)c->heads_plans, *slot = NULL;
  for (int i = 0; i < HEADS_PLANS; i++) {
    td_heads_plan *p = &ps[i];
    if (p->used && p->m == m && p->heads == heads && p->n == n && p->k == k && p->w_t == w_t) {
      *out = p;
      return TD_OK;
    }
    if (!p->used && !slot) slot = p;
  }
  if (!slot) { /* full: start over (shapes are few: two a model and row count) */
    for (int i = 0; i < HEADS_PLANS; i++) heads_plan_free(&ps[i]);
    slot = &ps[0];
  }
  td_heads_plan *p = slot;
  memset(p, 0, sizeof *p);
  p->m = m;
  p->heads = heads;
  p->n = n;
  p->k = k;
  p->w_t = w_t;
  cublasOperation_t ta = w_t ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
  bool ok = cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) ==
                CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) ==
                CUBLAS_STATUS_SUCCESS;
  ok = ok && (w_t ? heads_layout(&p->la, (uint64_t)k, (uint64_t)n, k, heads, (int64_t)n * k)
                  : heads_layout(&p->la, (uint64_t)n, (uint64_t)k, n, heads, (int64_t)n * k));
  ok = ok && heads_layout(&p->lb, (uint64_t)k, (uint64_t)m, (int64_t)heads * k, heads, k);
  ok = ok && heads_layout(&p->lc, (uint64_t)n, (uint64_t)m, (int64_t)heads * n, heads, n);
  cublasLtMatmulPreference_t pref = NULL;
  size_t ws = TD_CU_LT_WORKSPACE;
  ok = ok && cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS &&
       cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws) ==
           CUBLAS_STATUS_SUCCESS;
  cublasLtMatmulHeuristicResult_t res;
  int found = 0;
  ok = ok && cublasLtMatmulAlgoGetHeuristic(c->lt, p->op, p->la, p->lb, p->lc, p->lc, pref, 1, &res, &found) ==
                 CUBLAS_STATUS_SUCCESS &&
       found > 0;
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  if (!ok) {
    heads_plan_free(p);
    return td_err(TD_ERR_CUDA, "gemm_heads: no cuBLASLt plan for %d rows, %d heads, %d x %d", m, heads, n, k);
  }
  p->algo = res.algo;
  p->used = true;
  *out = p;
  return TD_OK;
}

/* The per-head products on tensor cores, for n % 64 == 0 and k % 16 == 0:
 * a block per (64 output columns, head, 64 rows) and, where that leaves
 * SMs idle, per K range: S blocks a cluster, their fp32 partials summed
 * in shared memory. W is requested before the PDL wait and the kernel
 * lets the next launch start at once (cuBLASLt's kernels do neither;
 * docs/cuda.md, "Per-head products"). */
enum { HB = 64, HEADS_MAX_KS = 256, HEADS_PST = HB + 4, HEADS_SPLIT_ROWS = 4 };

static size_t heads_smem(bool w_t, int ks) {
  size_t tiles = ((size_t)HB * (ks + 8) + (w_t ? (size_t)HB * (ks + 8) : (size_t)ks * (HB + 8))) * 2;
  size_t part = (size_t)HB * HEADS_PST * 4;
  return tiles > part ? tiles : part;
}

template <bool WT>
__global__ void __launch_bounds__(128) heads_mma_kernel(const bf16 *__restrict__ x, const bf16 *__restrict__ w,
                                                        const float *__restrict__ bias, bf16 *__restrict__ y, int m,
                                                        int heads, int n, int k, int S) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int KS = k / S, LD = KS + 8, LDW = WT ? KS + 8 : HB + 8;
  bf16 *xs = (bf16 *)smem, *ws = xs + HB * LD;
  const int rank = (int)blockIdx.x % S, c0 = ((int)blockIdx.x / S) * HB, h = (int)blockIdx.y, r0 = (int)blockIdx.z * HB;
  const int k0 = rank * KS, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const bf16 *W = w + (size_t)h * n * k;
  if (WT) /* W_h [n, k]: rows c0 + [0, 64), columns k0 + [0, KS) */
    for (int e = tid; e < HB * (KS / 8); e += 128) {
      const int r = e / (KS / 8), cc = (e % (KS / 8)) * 8;
      cp_async16(ws + r * LDW + cc, W + (size_t)(c0 + r) * k + k0 + cc, true);
    }
  else /* W_h [k, n]: rows k0 + [0, KS), columns c0 + [0, 64) */
    for (int e = tid; e < KS * (HB / 8); e += 128) {
      const int r = e / (HB / 8), cc = (e % (HB / 8)) * 8;
      cp_async16(ws + r * LDW + cc, W + (size_t)(k0 + r) * n + c0 + cc, true);
    }
  cp_async_commit();
  td_pdl_start();
  const size_t ldx = (size_t)heads * k, ldy = (size_t)heads * n;
  for (int e = tid; e < HB * (KS / 8); e += 128) {
    const int r = e / (KS / 8), cc = (e % (KS / 8)) * 8;
    const bool in = r0 + r < m;
    cp_async16(xs + r * LD + cc, in ? x + (size_t)(r0 + r) * ldx + (size_t)h * k + k0 + cc : x, in);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  float acc[HB / 8][4];
#pragma unroll
  for (int j = 0; j < HB / 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  const int lr = lane & 7, lm = lane >> 3;
  if (r0 + warp * 16 < m)
    for (int kk = 0; kk < KS; kk += 16) {
      uint32_t af[4];
      ldsm_x4(af[0], af[1], af[2], af[3], xs + (warp * 16 + lr + (lm & 1) * 8) * LD + kk + (lm >> 1) * 8);
#pragma unroll
      for (int j = 0; j < HB / 8; j += 2) {
        uint32_t b0, b1, b2, b3;
        if (WT)
          ldsm_x4(b0, b1, b2, b3, ws + (j * 8 + (lm >> 1) * 8 + lr) * LDW + kk + (lm & 1) * 8);
        else
          ldsm_x4_t(b0, b1, b2, b3, ws + (kk + (lm & 1) * 8 + lr) * LDW + j * 8 + (lm >> 1) * 8);
        mma16816(acc[j], af, b0, b1);
        mma16816(acc[j + 1], af, b2, b3);
      }
    }
  const int gr = lane >> 2, gc = (lane & 3) * 2;
  if (S == 1) {
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
      const int row = r0 + warp * 16 + gr + 8 * hr;
      if (row >= m) continue;
#pragma unroll
      for (int j = 0; j < HB / 8; j++) {
        const int col = c0 + j * 8 + gc;
        float v0 = acc[j][2 * hr], v1 = acc[j][2 * hr + 1];
        if (bias) {
          v0 += bias[(size_t)h * n + col];
          v1 += bias[(size_t)h * n + col + 1];
        }
        *(uint32_t *)&y[(size_t)row * ldy + (size_t)h * n + col] = pack_bf16(v0, v1);
      }
    }
    return;
  }
  /* split K: partials into shared memory, then rank r sums rows
   * [r 64 / S, (r + 1) 64 / S) over the cluster */
  namespace cg = cooperative_groups;
  cg::cluster_group cl = cg::this_cluster();
  __syncthreads(); /* every warp is done with the tiles */
  float *part = (float *)smem;
#pragma unroll
  for (int hr = 0; hr < 2; hr++)
#pragma unroll
    for (int j = 0; j < HB / 8; j++)
      *(float2 *)&part[(warp * 16 + gr + 8 * hr) * HEADS_PST + j * 8 + gc] =
          make_float2(acc[j][2 * hr], acc[j][2 * hr + 1]);
  cl.sync();
  const int rows = HB / S;
  for (int e = tid; e < rows * (HB / 4); e += 128) {
    const int rr = rank * rows + e / (HB / 4), cc = (e % (HB / 4)) * 4, row = r0 + rr;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int q = 0; q < S; q++) {
      const float4 f = *(const float4 *)cl.map_shared_rank(part + rr * HEADS_PST + cc, q);
      v.x += f.x;
      v.y += f.y;
      v.z += f.z;
      v.w += f.w;
    }
    if (row < m) {
      const int col = c0 + cc;
      if (bias) {
        const float *bb = bias + (size_t)h * n + col;
        v.x += bb[0];
        v.y += bb[1];
        v.z += bb[2];
        v.w += bb[3];
      }
      *(uint2 *)&y[(size_t)row * ldy + (size_t)h * n + col] = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
    }
  }
  cl.sync(); /* no block leaves while another still reads its partials */
}

td_status td_cu_gemm_heads(td_backend *b, const void *x, const void *w, const float *bias, void *y, int m, int heads,
                           int n, int k, bool w_t) {
  td_cuda *c = td_cu(b);
  td_cu_bind(c);
  if (n % HB == 0 && k % 16 == 0 && td_aligned16(x) && td_aligned16(w) && td_aligned16(y) && !c->tune.heads_lt) {
    /* K split over a cluster while the blocks would leave SMs idle, each
     * range a multiple of 16 and at most HEADS_MAX_KS; split only at a few
     * rows, where it beats cuBLASLt's (docs/cuda.md, "Per-head products") */
    long blocks = (long)(n / HB) * heads * ((m + HB - 1) / HB);
    int S = 1;
    while (S < 8 && k % (32 * S) == 0 && blocks * S * 2 <= c->sm_count) S *= 2;
    while (k / S > HEADS_MAX_KS && S < 8 && k % (32 * S) == 0) S *= 2;
    if (k / S <= HEADS_MAX_KS && (S == 1 || m <= HEADS_SPLIT_ROWS) && (m + HB - 1) / HB <= 65535 &&
        heads <= 65535) {
      dim3 grid((unsigned)(n / HB * S), (unsigned)heads, (unsigned)((m + HB - 1) / HB));
      size_t sm = heads_smem(w_t, k / S);
      if (w_t)
        (void)td_launch_ex(c, S, -1, heads_mma_kernel<true>, grid, 128, sm, (const bf16 *)x, (const bf16 *)w, bias,
                           (bf16 *)y, m, heads, n, k, S);
      else
        (void)td_launch_ex(c, S, -1, heads_mma_kernel<false>, grid, 128, sm, (const bf16 *)x, (const bf16 *)w, bias,
                           (bf16 *)y, m, heads, n, k, S);
      TD_CU_LAUNCHED("gemm_heads");
      return TD_OK;
    }
  }
  td_heads_plan *p = NULL;
  TD_TRY(heads_plan_get(c, m, heads, n, k, w_t, &p));
  const float alpha = 1.0f, beta = 0.0f;
  cublasStatus_t st = cublasLtMatmul(c->lt, p->op, &alpha, w, p->la, x, p->lb, &beta, y, p->lc, y, p->lc, &p->algo,
                                     c->lt_ws, TD_CU_LT_WORKSPACE, c->stream);
  if (st != CUBLAS_STATUS_SUCCESS) return td_err(TD_ERR_CUDA, "gemm_heads: cuBLASLt status %d", (int)st);
  if (bias) {
    int wd = heads * n;
    (void)td_launch(c, heads_bias_kernel, td_blocks((size_t)m * wd, 256), 256, 0, (bf16 *)y, bias, m, wd);
    TD_CU_LAUNCHED("gemm_heads bias");
  }
  return TD_OK;
}

td_status td_cu_heads_init(td_cuda *c) {
  const size_t h1 = heads_smem(true, HEADS_MAX_KS), h2 = heads_smem(false, HEADS_MAX_KS);
  const int hsm = (int)(h1 > h2 ? h1 : h2);
  TD_CU_CHECK(cudaFuncSetAttribute(heads_mma_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, hsm),
              "gemm_heads");
  TD_CU_CHECK(cudaFuncSetAttribute(heads_mma_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, hsm),
              "gemm_heads");
  return TD_OK;
}
