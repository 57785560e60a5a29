/* The decode GEMMs of a few rows (td_cu_skinny), which stream W once: a
 * tensor-core kernel with W through a cp.async ring or by bulk copies, and
 * a warp per output column for one to four rows. td_gemm takes them up to
 * the tuning's rows (cuda_gemm.cu), td_gemm_ex with its fusions
 * (cuda_gemm_ex.cu). */
#include "kernels/cuda/cuda_allreduce.cuh"
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/cuda_ptx.cuh"

extern "C" {
#include "kernels/act.h"
}

/* ------------------------------------------------------------ skinny GEMM */

/* m <= 16 rows (decode): NT output columns per block, the 4 warps split K
 * and each streams its quarter of the NT weight rows through its own
 * cp.async ring of S stages (no block barrier in the loop); the warps'
 * sums meet in shared memory in a fixed order. S - 1 stages of W are
 * requested before the PDL wait, so the ring is sized to hold a warp's
 * whole share of W where that fits (S = 5 up to k = 1024, 12 up to 2816):
 * with launches running ahead (td_pdl_start) the weights then arrive
 * while earlier kernels run. After the wait, the residual (ACCUM) and the
 * bias are loaded at once, beside x, not after the products.
 *
 * NORM (td_gemm_ex with norm_plain): the model folded the RMSNorm weight
 * into W, so norm(x) W^T = (x W^T) / rms(x): each warp sums the squares of
 * the x it streams anyway, and the epilogue scales by 1 / rms. No pass
 * over x before the products, no separate norm kernel. A folded LayerNorm
 * (wsum != NULL): the warps also sum x, and the epilogue computes
 * (x W^T - mean * wsum) / std, wsum holding W's row sums.
 * KV (pool != NULL): the epilogue also stores the K/V columns of a QKV
 * projection into the paged pool (no separate KV write).
 *
 * NT = 16 columns a block (8, doubling the blocks of narrow matrices so
 * that more SMs stream W, was slower: docs/cuda.md, "Tried and dropped"). */
enum { SK_KC = 64, SK_ROW = SK_KC + 8, SK_WARPS = 4, SK_S_SMALL = 5, SK_S_LARGE = 12 };
constexpr size_t sk_smem_bytes(int stages, int nt) {
  return (size_t)SK_WARPS * stages * (nt + 16) * SK_ROW * sizeof(bf16);
}

/* A plain norm's statistics of x row `row` from the warps' sums (fixed
 * order): RMS (s1q NULL: mean 0) or LayerNorm (mean from the sums of x,
 * variance E[x^2] - mean^2). */
__device__ __forceinline__ void plain_norm(const float *ssq, const float *s1q, int row, int k, float eps, float &mean,
                                           float &inv) {
  float s2 = 0.0f, s1 = 0.0f;
#pragma unroll
  for (int q = 0; q < SK_WARPS; q++) {
    s2 += ssq[q * 16 + row];
    if (s1q) s1 += s1q[q * 16 + row];
  }
  mean = s1 / (float)k;
  inv = rsqrtf(fmaxf(s2 / (float)k - mean * mean, 0.0f) + eps);
}

/* The skinny kernels' output at o (row, col): float32, or bf16 with the
 * KV write of a QKV projection; and the residual there (ACCUM). */
__device__ __forceinline__ void sk_store(const td_skinny_args &a, bool f32, bool kv, int row, int col, size_t o,
                                         float v) {
  if (f32) {
    ((float *)a.y)[o] = v;
  } else {
    bf16 hv = __float2bfloat16_rn(v);
    ((bf16 *)a.y)[o] = hv;
    if (kv) td_kv_store(a.kv, row, col, hv);
  }
}
__device__ __forceinline__ float sk_residual(const td_skinny_args &a, bool f32, size_t o) {
  return f32 ? ((const float *)a.y)[o] : __bfloat162float(((const bf16 *)a.y)[o]);
}

template <bool F32, int SK_STAGES, bool NORM>
__global__ void __launch_bounds__(32 * SK_WARPS) skinny_kernel(const td_skinny_args a) {
  constexpr int NT = 16;
  extern __shared__ __align__(16) unsigned char sk_smem[];
  constexpr int STAGE = (NT + 16) * SK_ROW; /* [W NT rows | x 16 rows][SK_ROW] */
  constexpr int PER = 16 * NT / (32 * SK_WARPS); /* outputs per thread in the epilogue */
  const bf16 *__restrict__ x = a.x, *__restrict__ w = a.w;
  const int m = a.m, n = a.n, k = a.k, kq = a.kq;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
  bf16 *mine = (bf16 *)sk_smem + (size_t)warp * SK_STAGES * STAGE;
  const int n0 = blockIdx.x * NT;
  const int kb = warp * kq, ke = min(k, kb + kq);
  const int nst = ke > kb ? (ke - kb + SK_KC - 1) / SK_KC : 0;
  auto load_w = [&](int st, int buf) {
    int k0 = kb + st * SK_KC;
    bf16 *ws = mine + (size_t)buf * STAGE;
#pragma unroll
    for (int i = 0; i < NT / 4; i++) { /* NT rows x 8 chunks */
      int c = lane + 32 * i, r = c >> 3, kk = k0 + (c & 7) * 8;
      bool vw = n0 + r < n && kk < ke;
      cp_async16(ws + r * SK_ROW + (c & 7) * 8, vw ? w + (size_t)(n0 + r) * k + kk : w, vw);
    }
  };
  auto load_x = [&](int st, int buf) {
    int k0 = kb + st * SK_KC;
    bf16 *xs = mine + (size_t)buf * STAGE + NT * SK_ROW;
#pragma unroll
    for (int i = 0; i < 4; i++) { /* rows >= m are left as they are: their outputs are never stored */
      int c = lane + 32 * i, r = c >> 3, kk = k0 + (c & 7) * 8;
      bool vx = kk < ke;
      if (r < m) cp_async16(xs + r * SK_ROW + (c & 7) * 8, vx ? x + (size_t)r * k + kk : x, vx);
    }
  };
  /* W is a model constant: its first stages stream while earlier kernels
   * run; x (the previous kernel's output) only after the wait. Groups:
   * W0..W(S-2), X0..X(S-2), then one per stage, so waiting for all but the
   * newest S-2 groups still finds stage st complete. */
#pragma unroll
  for (int st = 0; st < SK_STAGES - 1; st++) {
    if (st < nst) load_w(st, st);
    cp_async_commit();
  }
  float pb[PER], pr[PER], pw[PER]; /* bias, residual and W row sum (LayerNorm) of this thread's outputs, read early */
#pragma unroll
  for (int t = 0; t < PER; t++) {
    int i = threadIdx.x + t * 32 * SK_WARPS, col = n0 + i % NT;
    pb[t] = a.bias && col < n ? __ldg(a.bias + col) : 0.0f;
    pw[t] = NORM && a.wsum && col < n ? __ldg(a.wsum + col) : 0.0f;
  }
  td_pdl_start_if(a.late);
#pragma unroll
  for (int st = 0; st < SK_STAGES - 1; st++) {
    if (st < nst) load_x(st, st);
    cp_async_commit();
  }
#pragma unroll
  for (int t = 0; t < PER; t++) {
    int i = threadIdx.x + t * 32 * SK_WARPS, row = i / NT, col = n0 + i % NT;
    pr[t] = 0.0f;
    if (a.accum && row < m && col < n) {
      pr[t] = sk_residual(a, F32, (size_t)row * n + col);
    }
  }
  /* one accumulator chain per k step of a stage: with a single chain every
   * dependent mma.sync of the K loop is on the critical path (faster at
   * 12-16 rows; the same in skb_kernel was slower: docs/cuda.md, "Tried and
   * dropped") */
  float acc[SK_KC / 16][2][4] = {};
  float ss = 0.0f, ss8 = 0.0f, s1 = 0.0f, s18 = 0.0f; /* NORM: squares (and sums) of x rows g, g + 8 in this lane's A fragments */
  for (int st = 0; st < nst; st++) {
    cp_async_wait<SK_STAGES - 2>();
    __syncwarp();
    if (st + SK_STAGES - 1 < nst) {
      load_w(st + SK_STAGES - 1, (st + SK_STAGES - 1) % SK_STAGES);
      load_x(st + SK_STAGES - 1, (st + SK_STAGES - 1) % SK_STAGES);
    }
    cp_async_commit();
    const bf16 *ws = mine + (size_t)(st % SK_STAGES) * STAGE, *xs = ws + NT * SK_ROW;
#pragma unroll
    for (int ks = 0; ks < SK_KC / 16; ks++) {
      uint32_t b0, b1, b2, b3, af[4];
      ldsm_x4(b0, b1, b2, b3, ws + ((lane & 7) + ((lane >> 4) << 3)) * SK_ROW + ks * 16 + ((lane >> 3) & 1) * 8);
      ldsm_x4(af[0], af[1], af[2], af[3], xs + (lane & 15) * SK_ROW + ks * 16 + (lane >> 4) * 8);
      mma16816(acc[ks][0], af, b0, b1);
      mma16816(acc[ks][1], af, b2, b3);
      if (NORM) sq_sums_add(af, ss, ss8);
      if (NORM && a.wsum) x_sums_add(af, s1, s18);
    }
    __syncwarp(); /* the stage is rewritten by the next iteration's load */
  }
#pragma unroll
  for (int c = 1; c < SK_KC / 16; c++)
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) acc[0][j][e] += acc[c][j][e];
  cp_async_wait<0>();
  __syncthreads();
  float *red = (float *)sk_smem;              /* [warp][16 rows][NT cols] */
  float *ssq = red + SK_WARPS * 16 * NT;      /* [warp][16 rows] */
  float *s1q = ssq + SK_WARPS * 16;           /* [warp][16 rows] (LayerNorm) */
#pragma unroll
  for (int j = 0; j < NT / 8; j++)
#pragma unroll
    for (int e = 0; e < 4; e++) red[(warp * 16 + g + 8 * (e >> 1)) * NT + j * 8 + 2 * t4 + (e & 1)] = acc[0][j][e];
  if (NORM) sq_sums_store(ssq + warp * 16, ss, ss8, lane);
  if (NORM && a.wsum) sq_sums_store(s1q + warp * 16, s1, s18, lane);
  __syncthreads();
#pragma unroll
  for (int t = 0; t < PER; t++) {
    int i = threadIdx.x + t * 32 * SK_WARPS, row = i / NT, col = n0 + i % NT;
    if (row >= m || col >= n) continue;
    float v = red[i];
#pragma unroll
    for (int q = 1; q < SK_WARPS; q++) v += red[q * 16 * NT + i];
    if (NORM) {
      float mean, inv;
      plain_norm(ssq, a.wsum ? s1q : nullptr, row, k, a.eps, mean, inv);
      v = (v - mean * pw[t]) * inv;
    }
    v = td_act_apply(a.act, v + pb[t]) + pr[t];
    sk_store(a, F32, true, row, col, (size_t)row * n + col, v);
  }
}

/* Whole-W variant (the default where it fits): a block's 16 W rows come
 * in as one bulk copy each (the TMA engine, one thread issuing 16
 * instructions, completing on an mbarrier), all requested before the PDL
 * wait; x is staged whole after it. One SM moves far more bytes at once
 * this way than through per-thread cp.async (docs/cuda.md, "GEMMs"), and
 * the block needs no pipeline: it waits for its W once.
 * Also does GLU (tile rows 0-7 from W_a, 8-15 the same rows of W_b), the
 * plain norm and the KV write, as the kernels above. */
constexpr size_t SKB_MAX_SMEM = 160 << 10;
static inline int skb_ld(int kq) { return 4 * kq + 8; }
static inline size_t skb_smem(int m, int kq) {
  return 128 + (size_t)(16 + m) * skb_ld(kq) * sizeof(bf16) + (size_t)SK_WARPS * 16 * (16 + 2) * sizeof(float);
}

template <bool F32, bool NORM, bool GLU, bool AR = false>
__global__ void __launch_bounds__(32 * SK_WARPS) skb_kernel(const td_skinny_args a) {
  extern __shared__ __align__(128) unsigned char sb[];
  constexpr int PER = 16 * 16 / (32 * SK_WARPS); /* epilogue outputs per thread (16 columns) */
  const int m = a.m, n = a.n, k = a.k, kq = a.kq, KP = 4 * kq, LD = KP + 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
  uint64_t *bar = (uint64_t *)sb;
  bf16 *ws = (bf16 *)(sb + 128);               /* [16][LD] */
  bf16 *xs = ws + 16 * LD;                     /* [m][LD] */
  float *ssq = (float *)(xs + (size_t)m * LD); /* [warp][16] */
  float *s1q = ssq + SK_WARPS * 16;            /* [warp][16] (LayerNorm) */
  float *red = s1q + SK_WARPS * 16;            /* [warp][16][16] */
  const int half = n / 2, oc = GLU ? 8 : 16, ldy = GLU ? half : n;
  auto w_row = [&](int r, bool &ok) -> int {
    if (GLU) {
      int j = blockIdx.x * 8 + (r & 7);
      ok = j < half;
      return r < 8 ? j : half + j;
    }
    int j = blockIdx.x * 16 + r;
    ok = j < n;
    return j;
  };
  if (threadIdx.x == 0) {
    mbar_init(bar, 1);
    uint32_t bytes = 0;
    for (int r = 0; r < 16; r++) {
      bool ok;
      (void)w_row(r, ok);
      bytes += ok ? (uint32_t)k * 2u : 0u;
    }
    mbar_arrive_tx(bar, bytes);
    /* W is read once a step: evict it first, so that it does not push
     * activations and prefetched K/V out of L2 */
    const uint64_t pol = a.hint ? l2_evict_first() : 0;
    for (int r = 0; r < 16; r++) {
      bool ok;
      int wr = w_row(r, ok);
      if (!ok) continue;
      if (a.hint) bulk_g2s_hint(ws + (size_t)r * LD, a.w + (size_t)wr * k, (uint32_t)k * 2u, bar, pol);
      else bulk_g2s(ws + (size_t)r * LD, a.w + (size_t)wr * k, (uint32_t)k * 2u, bar);
    }
  }
  /* columns k..KP of W: zeros (x is zero there too, and 0 * garbage could be NaN) */
  for (int i = threadIdx.x; i < 16 * (KP - k); i += 32 * SK_WARPS)
    ws[(i / (KP - k)) * LD + k + i % (KP - k)] = __float2bfloat16_rn(0.0f);
  /* bias, W row sums (LayerNorm; GLU: both halves) and residual of this thread's outputs */
  float pb[PER], pb2[PER], pr[PER], pw[PER], pw2[PER];
#pragma unroll
  for (int t = 0; t < PER; t++) {
    int c = (threadIdx.x + t * 32 * SK_WARPS) % oc, j = blockIdx.x * oc + c;
    pb[t] = a.bias && j < ldy ? __ldg(a.bias + j) : 0.0f;
    pb2[t] = GLU && a.bias && j < ldy ? __ldg(a.bias + half + j) : 0.0f;
    pw[t] = NORM && a.wsum && j < ldy ? __ldg(a.wsum + j) : 0.0f;
    pw2[t] = GLU && NORM && a.wsum && j < ldy ? __ldg(a.wsum + half + j) : 0.0f;
  }
  td_pdl_start_if(a.late);
  const uint32_t phase = AR ? ar_open(a.ar) : 0u;
#pragma unroll
  for (int t = 0; t < PER; t++) {
    int i = threadIdx.x + t * 32 * SK_WARPS, row = i / oc, j = blockIdx.x * oc + i % oc;
    pr[t] = 0.0f;
    if (!GLU && a.accum && row < m && j < ldy) pr[t] = sk_residual(a, F32, (size_t)row * ldy + j);
  }
  const int pieces = KP / 8;
  for (int c = threadIdx.x; c < m * pieces; c += 32 * SK_WARPS) {
    int r = c / pieces, col = (c % pieces) * 8;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (col < k) v = *(const uint4 *)(a.x + (size_t)r * k + col);
    *(uint4 *)(xs + (size_t)r * LD + col) = v;
  }
  __syncthreads();
  const int kb = warp * kq;
  mbar_wait(bar, 0);
  float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
  float ss = 0.0f, ss8 = 0.0f, s1 = 0.0f, s18 = 0.0f; /* NORM: squares (and sums) of x rows g, g + 8 in this lane's A fragments */
  const int xr = (lane & 15) < m ? (lane & 15) : 0; /* only m rows staged; MMA rows past m are not stored */
  const bf16 *wp = ws + ((lane & 7) + ((lane >> 4) << 3)) * LD + ((lane >> 3) & 1) * 8;
  const bf16 *xp = xs + (size_t)xr * LD + (lane >> 4) * 8;
#pragma unroll 4
  for (int k0 = kb; k0 < kb + kq; k0 += 16) {
    uint32_t b0, b1, b2, b3, af[4];
    ldsm_x4(b0, b1, b2, b3, wp + k0);
    ldsm_x4(af[0], af[1], af[2], af[3], xp + k0);
    mma16816(acc[0], af, b0, b1);
    mma16816(acc[1], af, b2, b3);
    if (NORM) sq_sums_add(af, ss, ss8);
    if (NORM && a.wsum) x_sums_add(af, s1, s18);
  }
#pragma unroll
  for (int j = 0; j < 2; j++)
#pragma unroll
    for (int e = 0; e < 4; e++) red[(warp * 16 + g + 8 * (e >> 1)) * 16 + j * 8 + 2 * t4 + (e & 1)] = acc[j][e];
  if (NORM) sq_sums_store(ssq + warp * 16, ss, ss8, lane);
  if (NORM && a.wsum) sq_sums_store(s1q + warp * 16, s1, s18, lane);
  __syncthreads();
  uint16_t *hs = (uint16_t *)ws; /* AR: the block's values [m][16], W's stage no longer read */
#pragma unroll
  for (int t = 0; t < PER; t++) {
    int i = threadIdx.x + t * 32 * SK_WARPS, row = i / oc, c = i % oc, j = blockIdx.x * oc + c;
    if (row >= m || j >= ldy) continue;
    float v = 0.0f, vb = 0.0f;
#pragma unroll
    for (int q = 0; q < SK_WARPS; q++) {
      v += red[(q * 16 + row) * 16 + c];
      if (GLU) vb += red[(q * 16 + row) * 16 + 8 + c];
    }
    if (NORM) {
      float mean, inv;
      plain_norm(ssq, a.wsum ? s1q : nullptr, row, k, a.eps, mean, inv);
      v = (v - mean * pw[t]) * inv;
      vb = (vb - mean * pw2[t]) * inv;
    }
    if (GLU) v = td_act_apply(a.act, v + pb[t]) * (vb + pb2[t]);
    else v = td_act_apply(a.act, v + pb[t]) + pr[t];
    if (AR) {
      hs[row * 16 + c] = ar_bits(v);
      continue;
    }
    sk_store(a, F32, !GLU, row, j, (size_t)row * ldy + j, v);
  }
  if (AR) { /* each row's 16 columns, two vectors (ldy % 8 == 0: a vector is all in or all out) */
    __syncthreads();
    const int row = threadIdx.x >> 1, j = blockIdx.x * 16 + (threadIdx.x & 1) * 8;
    if (row < m && j < ldy)
      ar_exchange_vec(a.ar, phase, ((size_t)row * ldy + j) / 8, *(const uint4 *)(hs + row * 16 + (threadIdx.x & 1) * 8),
                      a.y);
    ar_close(a.ar, phase, (uint32_t)m * (uint32_t)ldy);
  }
}

template <bool F32, bool NORM, bool GLU, bool AR = false>
static void skb_launch(td_cuda *c, const td_skinny_args &a, size_t smem) {
  unsigned grid = GLU ? (unsigned)((a.n / 2 + 7) / 8) : (unsigned)((a.n + 15) / 16);
  (void)td_launch(c, skb_kernel<F32, NORM, GLU, AR>, grid, 32 * SK_WARPS, smem, a);
}

template <bool F32, int S, bool NORM>
static void skinny_launch(td_cuda *c, const td_skinny_args &a) {
  unsigned grid = (unsigned)((a.n + 15) / 16);
  (void)td_launch(c, skinny_kernel<F32, S, NORM>, grid, 32 * SK_WARPS, sk_smem_bytes(S, 16), a);
}

template <bool NORM>
static void skinny_launch_all(td_cuda *c, bool f32, bool large, const td_skinny_args &a) {
  if (f32 && large) skinny_launch<true, SK_S_LARGE, NORM>(c, a);
  else if (f32) skinny_launch<true, SK_S_SMALL, NORM>(c, a);
  else if (large) skinny_launch<false, SK_S_LARGE, NORM>(c, a);
  else skinny_launch<false, SK_S_SMALL, NORM>(c, a);
}

/* --------------------------------------------------- a warp per column */

/* One or two rows (decode at batch 1-2): a warp per output column holds
 * its W row in registers, loaded before the PDL wait, and reads x straight
 * from global (the block's other warps hit L1); the dot product, and a
 * plain norm's sums over the x it reads anyway, are reduced by shuffles.
 * No shared memory, no block barrier, no MMA padding of one row to
 * sixteen: after the wait a column costs one L2 round trip for x, the
 * products and five shuffles. Early trigger: the launch behind it can only
 * start once registers free up, which bounds the run-ahead by itself.
 * Faster for every GEMM of k <= 1024 (docs/cuda.md, "GEMMs"). The FFN
 * output (k = 2816) and the LM head stay on the bulk-copy kernel, faster
 * there: W in registers for k = 2816 takes 120 registers a thread and
 * keeps the next kernels out, and W in shared memory by bulk copies was
 * slower in every placement tried. V: 16-byte pieces of a W row
 * per lane (k <= 256 V); GLU: rows j and n / 2 + j, V = 4 only (two rows
 * of 8 pieces spill). */
enum { GV_WARPS = 8 };

static inline int gemv_v(int k) { return k <= 1024 ? 4 : k <= 2048 ? 8 : 0; }

__device__ __forceinline__ void dot8(const uint4 &xv, const uint4 &wv, float &acc) {
  const __nv_bfloat162 *xa = (const __nv_bfloat162 *)&xv, *wa = (const __nv_bfloat162 *)&wv;
#pragma unroll
  for (int j = 0; j < 4; j++) {
    float2 fx = __bfloat1622float2(xa[j]), fw = __bfloat1622float2(wa[j]);
    acc = fmaf(fx.x, fw.x, fmaf(fx.y, fw.y, acc));
  }
}

/* R rows (1, 2 or 4): every row's x requested at once, one accumulator
 * per row (faster at 2 rows, even at 3-4, so by default up to 2). Three blocks an SM (80 registers) up to 2 rows:
 * a 352-block FFN input resident in one wave. The gated FFN input takes
 * two W rows, which at 2 rows would need two waves: one row only. */
template <int V, int R, bool GLU, bool NORM, bool AR = false>
__global__ void __launch_bounds__(32 * GV_WARPS, V <= 4 && R <= 2 ? 3 : 2)
    gemv_kernel(const td_skinny_args a, bool f32) {
  const int lane = threadIdx.x & 31, k = a.k, half = a.n / 2, ldy = GLU ? half : a.n;
  const int j = blockIdx.x * GV_WARPS + (threadIdx.x >> 5);
  /* an exited warp counts as triggered (AR: launched only where every warp
   * has a column, as its barrier needs them all) */
  if (!AR && j >= ldy) return;
  const uint64_t pol = a.hint ? l2_evict_first() : 0;
  const bf16 *wr = a.w + (size_t)j * k, *wr2 = a.w + (size_t)(half + j) * k;
  uint4 w[V], w2[GLU ? V : 1];
#pragma unroll
  for (int i = 0; i < V; i++) {
    const int c = (lane + 32 * i) * 8;
    w[i] = make_uint4(0u, 0u, 0u, 0u);
    if (GLU) w2[i] = make_uint4(0u, 0u, 0u, 0u);
    if (c < k) {
      w[i] = a.hint ? ldg_hint(wr + c, pol) : __ldg((const uint4 *)(wr + c));
      if (GLU) w2[i] = a.hint ? ldg_hint(wr2 + c, pol) : __ldg((const uint4 *)(wr2 + c));
    }
  }
  /* lane r runs row r's epilogue */
  float pb = 0.0f, pb2 = 0.0f, pw = 0.0f, pw2 = 0.0f;
  if (lane < R) {
    if (a.bias) pb = __ldg(a.bias + j), pb2 = GLU ? __ldg(a.bias + half + j) : 0.0f;
    if (NORM && a.wsum) pw = __ldg(a.wsum + j), pw2 = GLU ? __ldg(a.wsum + half + j) : 0.0f;
  }
  td_pdl_start_if(a.late);
  const uint32_t phase = AR ? ar_open(a.ar) : 0u;
  const int m = a.m;
  float acc[R], acc2[R], ss[R], s1[R];
#pragma unroll
  for (int r = 0; r < R; r++) acc[r] = acc2[r] = ss[r] = s1[r] = 0.0f;
#pragma unroll
  for (int i = 0; i < V; i++) {
    const int c = (lane + 32 * i) * 8;
#pragma unroll
    for (int r = 0; r < R; r++) {
      const uint4 xv = c < k && r < m ? *(const uint4 *)(a.x + (size_t)r * k + c) : make_uint4(0u, 0u, 0u, 0u);
      dot8(xv, w[i], acc[r]);
      if (GLU) dot8(xv, w2[i], acc2[r]);
      if (NORM) {
        dot8(xv, xv, ss[r]);
        const __nv_bfloat162 *xa = (const __nv_bfloat162 *)&xv;
#pragma unroll
        for (int q = 0; q < 4; q++) {
          float2 f = __bfloat1622float2(xa[q]);
          s1[r] += f.x + f.y;
        }
      }
    }
  }
#pragma unroll
  for (int o = 16; o; o >>= 1)
#pragma unroll
    for (int r = 0; r < R; r++) {
      acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
      if (GLU) acc2[r] += __shfl_xor_sync(0xffffffffu, acc2[r], o);
      if (NORM) ss[r] += __shfl_xor_sync(0xffffffffu, ss[r], o), s1[r] += __shfl_xor_sync(0xffffffffu, s1[r], o);
    }
  if (!AR && (lane >= R || lane >= m)) return;
  const bool live = lane < R && lane < m;
  const int row = lane;
  float v = acc[0], vb = acc2[0], q2 = ss[0], q1 = s1[0];
#pragma unroll
  for (int r = 1; r < R; r++)
    if (row == r) v = acc[r], vb = acc2[r], q2 = ss[r], q1 = s1[r];
  if (NORM) {
    const float mean = a.wsum ? q1 / (float)k : 0.0f;
    const float inv = rsqrtf(fmaxf(q2 / (float)k - mean * mean, 0.0f) + a.eps);
    v = (v - mean * pw) * inv;
    vb = (vb - mean * pw2) * inv;
  }
  const size_t o = (size_t)row * ldy + j;
  if (AR) { /* bf16, no activation, no GLU: the block's 8 columns of each row, a vector, to the peers, then the sum */
    __shared__ __align__(16) uint16_t hs[R][GV_WARPS];
    if (live) hs[row][threadIdx.x >> 5] = ar_bits(v + pb + (a.accum ? sk_residual(a, false, o) : 0.0f));
    __syncthreads();
    if (threadIdx.x < m && threadIdx.x < R)
      ar_exchange_vec(a.ar, phase, ((size_t)threadIdx.x * ldy + (size_t)blockIdx.x * GV_WARPS) / 8,
                      *(const uint4 *)hs[threadIdx.x], a.y);
    ar_close(a.ar, phase, (uint32_t)m * (uint32_t)ldy);
    return;
  }
  if (GLU) v = td_act_apply(a.act, v + pb) * (vb + pb2);
  else v = td_act_apply(a.act, v + pb) + (a.accum ? sk_residual(a, f32, o) : 0.0f);
  sk_store(a, f32, !GLU, row, j, o, v);
}

template <int V, int R, bool GLU>
static void gemv_launch(td_cuda *c, const td_skinny_args &a, bool f32, bool norm) {
  unsigned cols = (unsigned)(GLU ? a.n / 2 : a.n), grid = (cols + GV_WARPS - 1) / GV_WARPS;
  if (!GLU && a.ar.world > 1) (void)td_launch(c, gemv_kernel<V, R, false, false, true>, grid, 32 * GV_WARPS, 0, a, false);
  else if (norm) (void)td_launch(c, gemv_kernel<V, R, GLU, true>, grid, 32 * GV_WARPS, 0, a, f32);
  else (void)td_launch(c, gemv_kernel<V, R, GLU, false>, grid, 32 * GV_WARPS, 0, a, f32);
}

/* whether td_cu_skinny takes the warp-per-column kernel */
static bool gemv_fits(const td_cuda *c, int m, int n, int k, bool glu) {
  const int v = gemv_v(k);
  if (m > 1) /* several rows: k <= 1024, no GLU, up to rows_n outputs */
    return m <= c->tune.gemv_rows && m <= 4 && v == 4 && !glu && n <= c->tune.gemv_rows_n;
  return m == 1 && v > 0 && v <= c->tune.gemv_maxv && (!glu || v <= 4) && (glu ? n / 2 : n) <= c->tune.gemv_maxn;
}

bool td_cu_skinny_ar_fits(const td_cuda *c, int m, int n, int k, int world) {
  if (n % 8 || world < 2) return false; /* the exchange is by 16-byte vectors of 8 columns */
  if (gemv_fits(c, m, n, k, false)) return world >= 4;
  return td_cu_skinny_bulk(c, m, k);
}

bool td_cu_skinny_bulk(const td_cuda *c, int m, int k) {
  int kq = ((k + SK_WARPS - 1) / SK_WARPS + 15) / 16 * 16;
  /* beyond 8 rows, staging x whole before the products costs more than the
   * ring's pipelining (docs/cuda.md, "GEMMs") */
  return c->tune.skinny_bulk && m <= 8 && skb_smem(m, kq) <= SKB_MAX_SMEM && skb_smem(m, kq) <= c->smem_optin;
}

td_status td_cu_skinny(td_cuda *c, td_skinny_args *a, bool f32, bool norm, bool glu) {
  a->kq = ((a->k + SK_WARPS - 1) / SK_WARPS + 15) / 16 * 16;
  if (a->ar.world > 1 && (f32 || norm || glu || a->act != TD_ACT_NONE || a->kv.pool ||
                          !td_cu_skinny_ar_fits(c, a->m, a->n, a->k, a->ar.world)))
    return td_err(TD_ERR_UNSUPPORTED, "gemm: this GEMM cannot end in the all-reduce");
  /* which skinny GEMMs let the launches behind them start only after their
   * own wait (docs/cuda.md, "Programmatic dependent launch and the
   * run-ahead"): the normed ones (QKV, cross q, FFN in), and at 1-2 rows
   * every one. Deeper run-ahead let later kernels' weight prefetches crowd
   * the running kernel's memory traffic. The warp-per-column kernel
   * triggers early (its registers bound it). */
  const int pl = c->tune.pdl_late;
  const bool gemv = gemv_fits(c, a->m, a->n, a->k, glu);
  a->late = pl < 0 ? !gemv && (norm || a->m <= 2) : (pl & 2) != 0 || (norm ? (pl & 4) : (pl & 8)) != 0;
  a->hint = c->tune.weight_hint != 0;
  if (gemv) {
    if (a->m > 2) gemv_launch<4, 4, false>(c, *a, f32, norm);
    else if (a->m == 2) gemv_launch<4, 2, false>(c, *a, f32, norm);
    else if (gemv_v(a->k) == 8) gemv_launch<8, 1, false>(c, *a, f32, norm);
    else if (glu) gemv_launch<4, 1, true>(c, *a, f32, norm);
    else gemv_launch<4, 1, false>(c, *a, f32, norm);
    TD_CU_LAUNCHED("gemm (a warp per column)");
    return TD_OK;
  }
  if (td_cu_skinny_bulk(c, a->m, a->k)) {
    size_t smem = skb_smem(a->m, a->kq);
    if (glu && norm) skb_launch<false, true, true>(c, *a, smem);
    else if (glu) skb_launch<false, false, true>(c, *a, smem);
    else if (a->ar.world > 1) skb_launch<false, false, false, true>(c, *a, smem);
    else if (f32 && norm) skb_launch<true, true, false>(c, *a, smem);
    else if (f32) skb_launch<true, false, false>(c, *a, smem);
    else if (norm) skb_launch<false, true, false>(c, *a, smem);
    else skb_launch<false, false, false>(c, *a, smem);
    TD_CU_LAUNCHED("gemm (skinny, bulk copies)");
    return TD_OK;
  }
  if (glu) return td_err(TD_ERR_UNSUPPORTED, "gemm: GLU on the skinny kernel needs its bulk-copy variant");
  bool large = (a->kq + SK_KC - 1) / SK_KC > SK_S_SMALL - 1;
  if (norm) skinny_launch_all<true>(c, f32, large, *a);
  else skinny_launch_all<false>(c, f32, large, *a);
  TD_CU_LAUNCHED("gemm (skinny)");
  return TD_OK;
}

template <bool F32, int S, bool NORM>
static td_status skinny_attr(void) {
  TD_CU_CHECK(cudaFuncSetAttribute(skinny_kernel<F32, S, NORM>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)sk_smem_bytes(S, 16)),
              "gemm init");
  return TD_OK;
}

template <bool F32, bool NORM, bool GLU, bool AR = false>
static td_status skb_attr(void) {
  TD_CU_CHECK(cudaFuncSetAttribute(skb_kernel<F32, NORM, GLU, AR>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)SKB_MAX_SMEM),
              "gemm init");
  return TD_OK;
}

td_status td_cu_skinny_init(td_cuda *c) {
  TD_TRY((skb_attr<false, false, false>()));
  TD_TRY((skb_attr<false, true, false>()));
  TD_TRY((skb_attr<true, false, false>()));
  TD_TRY((skb_attr<true, true, false>()));
  TD_TRY((skb_attr<false, false, true>()));
  TD_TRY((skb_attr<false, true, true>()));
  TD_TRY((skb_attr<false, false, false, true>()));
  TD_TRY((skinny_attr<false, SK_S_SMALL, false>()));
  TD_TRY((skinny_attr<false, SK_S_SMALL, true>()));
  TD_TRY((skinny_attr<true, SK_S_SMALL, false>()));
  TD_TRY((skinny_attr<true, SK_S_SMALL, true>()));
  TD_TRY((skinny_attr<false, SK_S_LARGE, false>()));
  TD_TRY((skinny_attr<false, SK_S_LARGE, true>()));
  TD_TRY((skinny_attr<true, SK_S_LARGE, false>()));
  return skinny_attr<true, SK_S_LARGE, true>();
}
