/* td_gemm_ex on the GPU: the decode GEMM (m <= 8 rows by default) with
 * what surrounds it in a layer fused: the gated activation (GLU), the KV
 * write of a QKV projection, and the row norm; whatever is not fused runs
 * as its own op.
 *
 * Which kernel: without a weighted norm, the skinny kernels of
 * cuda_gemm_skinny.cu (td_cu_skinny: W by bulk copies, or through a cp.async
 * ring), which take the plain norm (the model folded the RMSNorm weight
 * into W: scale by 1 / rms(x), sums of squares from the MMA fragments),
 * the KV write, and GLU on the bulk variant. With a weighted norm (or GLU
 * where the bulk variant does not fit), "skf" below: the skinny layout
 * with x staged whole in shared memory per block (m rows, columns >= k
 * zero), so the norm is applied there in place, exactly as td_norm
 * computes it; its W stages are requested before the PDL wait too.
 *
 * Defaults (td_cuda_tuning.fuse_rows / fuse_mask; docs/cuda.md, "Fused
 * decode GEMM"): 8 rows, all three fusions. The in-place weighted norm of
 * skf measured slower than a norm kernel (every block renormalises every
 * row after the wait), and beyond 8 rows these kernels lose to cuBLASLt
 * (x re-read per 16 columns).
 *
 * Tried and dropped: a split-K variant for up to 64 rows whose blocks
 * exchanged partials through distributed shared memory in clusters,
 * slower than cuBLASLt at every row count (the remote stores of the
 * partial tiles dominate; docs/cuda.md, "Tried and dropped"). */
#include <stdio.h>
#include <stdlib.h>

#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/cuda_ptx.cuh"

extern "C" {
#include "kernels/act.h"
}

enum { SF_KC = 64, SF_ROW = SF_KC + 8, SF_STAGES = 5, SF_WARPS = 4, SF_MAXM = 16 };
enum { SF_NORM_NONE = 0, SF_NORM_RMS = 1, SF_NORM_LN = 2, SF_NORM_PLAIN = 3 };
enum { SF_FUSE_NORM = 1, SF_FUSE_GLU = 2, SF_FUSE_KV = 4, SF_RMS_AFTER = 8 };
/* the tuning's fuse rows and mask (td_cuda_tuning.fuse_rows / fuse_mask) are these */
static_assert((int)SF_MAXM == (int)TD_CU_FUSE_MAX_ROWS &&
                  (SF_FUSE_NORM | SF_FUSE_GLU | SF_FUSE_KV | SF_RMS_AFTER) == 15,
              "fused kernel rows and fusions");
constexpr size_t SF_RING = (size_t)SF_WARPS * SF_STAGES * 16 * SF_ROW * sizeof(bf16);

struct SfArgs {
  const bf16 *x, *w;
  const float *bias;
  bf16 *y;
  int m, n, k; /* n: rows of W (both halves with GLU) */
  int ldy;     /* columns of y: n, or n / 2 with GLU */
  int act, accum, glu, norm;
  const float *nw, *nb;
  float eps;
  int kq, xs; /* K per warp; staged row length of x */
  td_kv_dest kv; /* fused KV write (kv.pool != NULL) */
};


union sf_bf16x8 {
  uint4 u;
  __nv_bfloat162 h[4];
};

__global__ void __launch_bounds__(32 * SF_WARPS) skf_kernel(const SfArgs a) {
  extern __shared__ __align__(16) unsigned char sf_raw[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
  const int XS = a.xs;
  bf16 *ring = (bf16 *)sf_raw, *mine = ring + (size_t)warp * SF_STAGES * 16 * SF_ROW;
  bf16 *xs = (bf16 *)(sf_raw + SF_RING);
  const int half = a.n / 2;
  const int kb = warp * a.kq, ke = min(a.k, kb + a.kq);
  const int nst = ke > kb ? (ke - kb + SF_KC - 1) / SF_KC : 0;
  /* tile row r -> W row (GLU: rows 0-7 of W_a, 8-15 the same rows of W_b) */
  auto w_row = [&](int r, bool &ok) -> int {
    if (a.glu) {
      int j = blockIdx.x * 8 + (r & 7);
      ok = j < half;
      return r < 8 ? j : half + j;
    }
    int j = blockIdx.x * 16 + r;
    ok = j < a.n;
    return j;
  };
  auto load_w = [&](int st, int buf) {
    int k0 = kb + st * SF_KC;
    bf16 *ws = mine + (size_t)buf * 16 * SF_ROW;
#pragma unroll
    for (int i = 0; i < 4; i++) { /* 16 rows x 8 chunks */
      int c = lane + 32 * i, r = c >> 3, kk = k0 + (c & 7) * 8;
      bool ok;
      int wr = w_row(r, ok);
      ok = ok && kk < ke;
      cp_async16(ws + r * SF_ROW + (c & 7) * 8, ok ? a.w + (size_t)wr * a.k + kk : a.w, ok);
    }
  };

  /* W does not depend on the previous kernel: request it before waiting */
#pragma unroll
  for (int st = 0; st < SF_STAGES - 1; st++) {
    if (st < nst) load_w(st, st);
    cp_async_commit();
  }
  td_pdl_start();

  /* x, whole: m rows of XS - 8 columns, zeros past k (W is zero there, and
   * 0 * garbage could be NaN). Rows m..15 stay unwritten: an MMA row of
   * the output depends only on its own row of x, and those are not stored.
   * Plain loads, not cp.async: waiting for a cp.async group waits for every
   * older one too, i.e. for all of the W prefetch, before the norm. */
  const int pieces = (XS - 8) / 8;
  for (int c = threadIdx.x; c < a.m * pieces; c += 32 * SF_WARPS) {
    int r = c / pieces, q = c % pieces, col = q * 8;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (col < a.k) v = *(const uint4 *)(a.x + (size_t)r * a.k + col);
    *(uint4 *)(xs + r * XS + col) = v;
  }
  __syncthreads();

  /* only m rows of x are staged: MMA rows past m read row 0 (never stored) */
  const int xrow = (lane & 15) < a.m ? (lane & 15) : 0;
  /* plain RMSNorm (weight folded into W): the epilogue scales by 1 / rms,
   * the sums of squares from the MMA fragments */
  float *ssq = (float *)(sf_raw + SF_RING + (size_t)a.m * XS * sizeof(bf16)); /* [warp][row], after x */
  float ss = 0.0f, ss8 = 0.0f;
  /* the norm in place, as td_norm: full-row statistics, x * inv * w */
  if (a.norm == SF_NORM_RMS || a.norm == SF_NORM_LN) {
    for (int r = warp; r < a.m; r += SF_WARPS) {
      bf16 *xr = xs + r * XS;
      float mean = 0.0f;
      if (a.norm == SF_NORM_LN) {
        float s = 0.0f;
        for (int i = lane * 8; i < a.k; i += 256) {
          sf_bf16x8 v;
          v.u = *(const uint4 *)(xr + i);
#pragma unroll
          for (int j = 0; j < 4; j++) {
            float2 f = __bfloat1622float2(v.h[j]);
            s += f.x + f.y;
          }
        }
        mean = td_warp_sum(s) / (float)a.k;
      }
      float s2 = 0.0f;
      for (int i = lane * 8; i < a.k; i += 256) {
        sf_bf16x8 v;
        v.u = *(const uint4 *)(xr + i);
#pragma unroll
        for (int j = 0; j < 4; j++) {
          float2 f = __bfloat1622float2(v.h[j]);
          s2 += (f.x - mean) * (f.x - mean) + (f.y - mean) * (f.y - mean);
        }
      }
      float inv = rsqrtf(td_warp_sum(s2) / (float)a.k + a.eps);
      for (int i = lane * 8; i < a.k; i += 256) {
        sf_bf16x8 v;
        v.u = *(const uint4 *)(xr + i);
#pragma unroll
        for (int j = 0; j < 4; j++) {
          float2 f = __bfloat1622float2(v.h[j]);
          float p0 = (f.x - mean) * inv * __ldg(a.nw + i + 2 * j);
          float p1 = (f.y - mean) * inv * __ldg(a.nw + i + 2 * j + 1);
          if (a.norm == SF_NORM_LN && a.nb) {
            p0 += __ldg(a.nb + i + 2 * j);
            p1 += __ldg(a.nb + i + 2 * j + 1);
          }
          v.h[j] = __floats2bfloat162_rn(p0, p1);
        }
        *(uint4 *)(xr + i) = v.u;
      }
    }
    __syncthreads();
  }

  /* each warp: its K range, W through its ring, no block barrier */
  float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
  for (int st = 0; st < nst; st++) {
    cp_async_wait<SF_STAGES - 2>();
    __syncwarp();
    if (st + SF_STAGES - 1 < nst) load_w(st + SF_STAGES - 1, (st + SF_STAGES - 1) % SF_STAGES);
    cp_async_commit();
    const bf16 *ws = mine + (size_t)(st % SF_STAGES) * 16 * SF_ROW;
    const int k0 = kb + st * SF_KC;
#pragma unroll
    for (int ks = 0; ks < SF_KC / 16; ks++) {
      uint32_t b0, b1, b2, b3, af[4];
      ldsm_x4(b0, b1, b2, b3, ws + ((lane & 7) + ((lane >> 4) << 3)) * SF_ROW + ks * 16 + ((lane >> 3) & 1) * 8);
      ldsm_x4(af[0], af[1], af[2], af[3], xs + xrow * XS + k0 + ks * 16 + (lane >> 4) * 8);
      mma16816(acc[0], af, b0, b1);
      mma16816(acc[1], af, b2, b3);
      if (a.norm == SF_NORM_PLAIN) sq_sums_add(af, ss, ss8);
    }
    __syncwarp(); /* the stage is rewritten by the next iteration's load */
  }
  if (a.norm == SF_NORM_PLAIN) sq_sums_store(ssq + warp * SF_MAXM, ss, ss8, lane);
  cp_async_wait<0>();
  __syncthreads();
  float *red = (float *)sf_raw; /* [warp][16 rows][16 cols], over the rings */
#pragma unroll
  for (int j = 0; j < 2; j++)
#pragma unroll
    for (int e = 0; e < 4; e++) red[(warp * 16 + g + 8 * (e >> 1)) * 16 + j * 8 + 2 * t4 + (e & 1)] = acc[j][e];
  __syncthreads();

  const int oc = a.glu ? 8 : 16; /* outputs of this block per row */
  for (int i = threadIdx.x; i < a.m * oc; i += 32 * SF_WARPS) {
    int row = i / oc, c = i % oc, j = blockIdx.x * oc + c;
    if (j >= a.ldy) continue;
    float v = 0.0f, vb = 0.0f;
#pragma unroll
    for (int q = 0; q < SF_WARPS; q++) {
      v += red[(q * 16 + row) * 16 + c];
      if (a.glu) vb += red[(q * 16 + row) * 16 + 8 + c];
    }
    if (a.norm == SF_NORM_PLAIN) {
      float s2 = 0.0f;
#pragma unroll
      for (int q = 0; q < SF_WARPS; q++) s2 += ssq[q * SF_MAXM + row];
      float inv = rsqrtf(s2 / (float)a.k + a.eps);
      v *= inv;
      vb *= inv;
    }
    if (a.glu) {
      if (a.bias) {
        v += __ldg(a.bias + j);
        vb += __ldg(a.bias + half + j);
      }
      v = td_act_apply(a.act, v) * vb;
    } else {
      if (a.bias) v += __ldg(a.bias + j);
      v = td_act_apply(a.act, v);
    }
    size_t o = (size_t)row * a.ldy + j;
    if (a.accum) v += __bfloat162float(a.y[o]);
    bf16 hv = __float2bfloat16_rn(v);
    a.y[o] = hv;
    td_kv_store(a.kv, row, j, hv);
  }
}

/* ------------------------------------------------------------ host side */

td_status td_cu_skf_init(td_cuda *c) {
  TD_CU_CHECK(cudaFuncSetAttribute(skf_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)c->smem_optin),
              "gemm init (fused decode kernel)");
  return TD_OK;
}

static td_kv_dest kv_dest(const td_gemm_args *ga) {
  const td_kv_layout *l = ga->kv_layout;
  td_kv_dest d = {};
  d.pool = (bf16 *)ga->kv_pool;
  d.slots = ga->kv_slots;
  d.col = ga->kv_col;
  d.H = l->n_heads;
  d.dh = l->head_dim;
  d.hd = l->n_heads * l->head_dim;
  d.bs = l->block_size;
  d.block_elems = td_kv_block_elems(l);
  d.layer_off = (size_t)ga->kv_layer * 2 * l->n_heads * l->block_size * l->head_dim;
  return d;
}

/* The separate KV write of a QKV projection whose kernel did not store it. */
static td_status kv_after(td_backend *b, const td_gemm_args *ga) {
  const td_kv_layout *l = ga->kv_layout;
  size_t hd = (size_t)l->n_heads * l->head_dim;
  const bf16 *kp = (const bf16 *)ga->y + ga->kv_col;
  return td_kv_write(b, kp, kp + hd, ga->n, ga->kv_pool, l, ga->kv_layer, ga->kv_slots, ga->m);
}

/* ------------------------------------------------------------ the norm after the GEMM */

/* Beyond the fused kernels' rows the GEMM is cuBLASLt's, which takes no
 * norm: a plain RMSNorm (its weight folded into W) commutes with it,
 * norm(x) W^T = (x W^T) / rms(x), so the GEMM runs on x itself and the
 * kernel that follows it anyway (the gated activation, the KV write)
 * scales each row by 1 / rms(x): the norm kernel before the GEMM goes
 * (docs/history/cuda-passes.md, pass 6). */
/* 1 / rms of row x[0, k) (k % 8 == 0, 16-byte aligned), for every thread of the block */
__device__ float sr_inv_rms(const bf16 *x, int k, float eps) {
  __shared__ float red[32];
  return rsqrtf(td_block_sum(td_sumsq8(x, k, threadIdx.x * 8, blockDim.x * 8), red) / (float)k + eps);
}

/* y[row] = act(r a) * (r b) over g = [a | b] (2 f columns), r = 1 / rms(x[row]); grid (column chunks, rows) */
__global__ void __launch_bounds__(256) sr_gated_kernel(const bf16 *__restrict__ g, bf16 *__restrict__ y,
                                                       const bf16 *__restrict__ x, int k, float eps, int f, int act) {
  td_pdl_start();
  const int row = blockIdx.y;
  const float r = sr_inv_rms(x + (size_t)row * k, k, eps);
  const bf16 *a = g + (size_t)row * 2 * f;
  for (int j = (blockIdx.x * blockDim.x + threadIdx.x) * 8; j < f; j += gridDim.x * blockDim.x * 8) {
    td_bf16x8 va, vb, vo;
    va.u = *(const uint4 *)(a + j);
    vb.u = *(const uint4 *)(a + f + j);
#pragma unroll
    for (int t = 0; t < 4; t++) {
      float2 fa = __bfloat1622float2(va.h[t]), fb = __bfloat1622float2(vb.h[t]);
      vo.h[t] = __floats2bfloat162_rn(td_act_apply(act, r * fa.x) * (r * fb.x), td_act_apply(act, r * fa.y) * (r * fb.y));
    }
    *(uint4 *)(y + (size_t)row * f + j) = vo.u;
  }
}

/* y[row] *= 1 / rms(x[row]) in place, and its K/V columns into the pool
 * (one block a row; dh, col multiples of 8, so 8 columns stay in one head) */
__global__ void __launch_bounds__(256) sr_kv_kernel(bf16 *__restrict__ y, int n, const bf16 *__restrict__ x, int k,
                                                    float eps, td_kv_dest d) {
  td_pdl_start();
  const int row = blockIdx.x;
  const float r = sr_inv_rms(x + (size_t)row * k, k, eps);
  const int slot = d.slots[row];
  bf16 *yr = y + (size_t)row * n;
  for (int j = threadIdx.x * 8; j < n; j += blockDim.x * 8) {
    td_bf16x8 v;
    v.u = *(const uint4 *)(yr + j);
#pragma unroll
    for (int t = 0; t < 4; t++) {
      float2 f = __bfloat1622float2(v.h[t]);
      v.h[t] = __floats2bfloat162_rn(r * f.x, r * f.y);
    }
    *(uint4 *)(yr + j) = v.u;
    const int u = j - d.col;
    if (slot >= 0 && u >= 0 && u < 2 * d.hd) *(uint4 *)td_kv_at(d, slot, u) = v.u;
  }
}

/* Whether rms_after takes this call: beyond the fused rows, a plain
 * RMSNorm, no bias, and a GLU or a KV write (no activation) after it. */
static bool rms_after_fits(const td_cuda *c, const td_gemm_args *ga) {
  bool glu = ga->flags & TD_GEMM_GLU;
  if (!(c->tune.fuse_mask & SF_RMS_AFTER) || ga->m <= c->tune.fuse || !ga->norm_plain || !ga->norm_rms || ga->norm_w ||
      ga->bias || (ga->flags & (TD_GEMM_ACCUM | TD_GEMM_OUT_F32)) || ga->k % 8 || ga->n % 16 ||
      !td_aligned16(ga->x) || !td_aligned16(ga->y))
    return false;
  if (glu) return td_aligned16(ga->scratch_glu);
  const td_kv_layout *l = ga->kv_layout;
  return ga->kv_pool && ga->act == TD_ACT_NONE && l->head_dim % 8 == 0 && ga->kv_col % 8 == 0 &&
         td_kv_block_elems(l) % 8 == 0 && td_aligned16(ga->kv_pool) && !l->int8;
}

static td_status rms_after(td_backend *b, const td_gemm_args *ga) {
  td_cuda *c = td_cu(b);
  const bf16 *x = (const bf16 *)ga->x;
  if (ga->flags & TD_GEMM_GLU) {
    int f = ga->n / 2;
    TD_TRY(td_gemm(b, ga->x, ga->w, NULL, ga->scratch_glu, ga->m, ga->n, ga->k, TD_ACT_NONE, 0));
    dim3 grid((unsigned)((f / 8 + 255) / 256), (unsigned)ga->m);
    (void)td_launch(c, sr_gated_kernel, grid, 256, 0, (const bf16 *)ga->scratch_glu, (bf16 *)ga->y, x, ga->k,
                    ga->norm_eps, f, (int)ga->act);
    TD_CU_LAUNCHED("gemm_ex (gated activation with the norm)");
    return TD_OK;
  }
  TD_TRY(td_gemm(b, ga->x, ga->w, NULL, ga->y, ga->m, ga->n, ga->k, TD_ACT_NONE, 0));
  (void)td_launch(c, sr_kv_kernel, (unsigned)ga->m, 256, 0, (bf16 *)ga->y, ga->n, x, ga->k, ga->norm_eps,
                  kv_dest(ga));
  TD_CU_LAUNCHED("gemm_ex (KV write with the norm)");
  return TD_OK;
}

/* Without GLU: the skinny kernel, with the plain norm and the KV write in
 * it where the policy says so; what it leaves out runs as its own op. */
static td_status gemm_ex_skinny(td_backend *b, const td_gemm_args *ga, bool fuse_norm, bool fuse_kv, bool glu) {
  td_cuda *c = td_cu(b);
  const void *x = ga->x;
  if (ga->norm_plain && !fuse_norm) {
    TD_TRY(td_norm(b, ga->x, NULL, NULL, ga->scratch_norm, ga->m, ga->k, ga->norm_eps, ga->norm_rms));
    x = ga->scratch_norm;
  }
  td_skinny_args a = {};
  a.x = (const bf16 *)x;
  a.w = (const bf16 *)ga->w;
  a.bias = ga->bias;
  a.y = ga->y;
  a.m = ga->m, a.n = ga->n, a.k = ga->k, a.act = (int)ga->act;
  a.eps = ga->norm_eps;
  a.wsum = fuse_norm && !ga->norm_rms ? ga->norm_wsum : NULL;
  if (fuse_kv) a.kv = kv_dest(ga);
  TD_TRY(td_cu_skinny(c, &a, false, fuse_norm, glu));
  return ga->kv_pool && !fuse_kv ? kv_after(b, ga) : TD_OK;
}

/* Up to 8 rows the fused kernel takes a plain norm; up to 16 the projection
 * still runs on a skinny kernel (td_cu_gemm) where leaving the cross query's
 * norm to the attention measured slower (the attention's K/V stream then
 * starts a kernel earlier, beside latency-bound ones:
 * docs/history/cuda-passes.md, pass 6); beyond, cuBLASLt's GEMM cannot
 * take it. */
int td_cu_fused_norm_rows(const td_backend *b) {
  const td_cuda *c = (const td_cuda *)b->impl;
  return c->tune.skinny && c->tune.skinny_rows > c->tune.fuse ? c->tune.skinny_rows : c->tune.fuse;
}

int td_cu_gemm_plan_rows(const td_backend *b, int m) {
  const td_cuda *c = (const td_cuda *)b->impl;
  int r = td_cu_plan_rows(&c->tune, m);
  return r < m ? m : r;
}

int64_t td_cu_gemm_plans_made(const td_backend *b) { return ((const td_cuda *)b->impl)->plans_made; }

td_status td_cu_gemm_ex(td_backend *b, const td_gemm_args *ga) {
  td_cuda *c = td_cu(b);
  td_cu_bind(c);
  if ((unsigned)ga->act > TD_ACT_QUICK_GELU)
    return td_err(TD_ERR_INVALID, "gemm_ex: unknown activation %d", (int)ga->act);
  bool glu = ga->flags & TD_GEMM_GLU;
  int k = ga->k, mask = c->tune.fuse_mask;
  bool eligible = ga->m <= c->tune.fuse && !(ga->flags & (TD_GEMM_OUT_F32 | TD_GEMM_ACCUM)) && k % 8 == 0 &&
                  td_aligned16(ga->x) && td_aligned16(ga->w) &&
                  (!(ga->norm_w || ga->norm_plain) || td_aligned16(ga->scratch_norm));
  /* the fused stores are 16-byte: every block must start aligned */
  /* int8 pools take td_kv_write's quantizing kernel after the GEMM */
  bool fuse_kv = ga->kv_pool && (mask & SF_FUSE_KV) && td_kv_block_elems(ga->kv_layout) % 8 == 0 && !ga->kv_layout->int8;
  if (!eligible && rms_after_fits(c, ga)) return rms_after(b, ga);
  if (!eligible || (glu && !(mask & SF_FUSE_GLU))) return td_gemm_ex_unfused(b, ga);
  /* a plain norm (weight folded into W) costs the kernel next to nothing */
  if (!glu && !ga->norm_w) {
    bool fuse_norm = ga->norm_plain && (mask & SF_FUSE_NORM);
    if (!fuse_norm && !fuse_kv) return td_gemm_ex_unfused(b, ga);
    return gemm_ex_skinny(b, ga, fuse_norm, fuse_kv, false);
  }
  /* GLU with a plain norm or none: the bulk-copy skinny kernel where it fits */
  if (glu && !ga->norm_w && td_cu_skinny_bulk(c, ga->m, k))
    return gemm_ex_skinny(b, ga, ga->norm_plain && (mask & SF_FUSE_NORM), false, true);
  /* GLU, or a weighted norm: the kernel that stages x whole (its plain
   * norm is RMS only: a plain LayerNorm runs as its own kernel there) */
  bool fuse_norm = (ga->norm_w || (ga->norm_plain && ga->norm_rms)) && (mask & SF_FUSE_NORM);
  if (!glu && !fuse_norm && !fuse_kv) return td_gemm_ex_unfused(b, ga);
  int kq = ((k + SF_WARPS - 1) / SF_WARPS + 15) / 16 * 16;
  /* the last warp's chunks may read past k: stage (and zero) that far */
  int xs = 3 * kq + (kq + SF_KC - 1) / SF_KC * SF_KC + 8;
  /* x for m rows only (more blocks resident at once), the plain norm's sums */
  size_t smem = SF_RING + (size_t)ga->m * xs * sizeof(bf16) + (size_t)SF_WARPS * SF_MAXM * sizeof(float);
  if (smem > c->smem_optin) return td_gemm_ex_unfused(b, ga);
  const void *x = ga->x;
  if ((ga->norm_w || ga->norm_plain) && !fuse_norm) { /* the norm as its own kernel */
    TD_TRY(td_norm(b, ga->x, ga->norm_w, ga->norm_b, ga->scratch_norm, ga->m, k, ga->norm_eps, ga->norm_rms));
    x = ga->scratch_norm;
  }
  SfArgs a = {};
  a.x = (const bf16 *)x;
  a.w = (const bf16 *)ga->w;
  a.bias = ga->bias;
  a.y = (bf16 *)ga->y;
  a.m = ga->m, a.n = ga->n, a.k = k;
  a.ldy = glu ? ga->n / 2 : ga->n;
  a.act = (int)ga->act;
  a.glu = glu;
  a.norm = !fuse_norm ? SF_NORM_NONE : ga->norm_plain ? SF_NORM_PLAIN : ga->norm_rms ? SF_NORM_RMS : SF_NORM_LN;
  a.nw = ga->norm_w;
  a.nb = ga->norm_rms ? NULL : ga->norm_b;
  a.eps = ga->norm_eps;
  a.kq = kq;
  a.xs = xs;
  if (fuse_kv) a.kv = kv_dest(ga);
  unsigned grid = glu ? (unsigned)((ga->n / 2 + 7) / 8) : (unsigned)((ga->n + 15) / 16);
  (void)td_launch(c, skf_kernel, grid, 32 * SF_WARPS, smem, a);
  TD_CU_LAUNCHED("gemm_ex (fused decode kernel)");
  return ga->kv_pool && !fuse_kv ? kv_after(b, ga) : TD_OK;
}
