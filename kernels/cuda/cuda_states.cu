/* Cross-attention over encoder states (td_attn_states) and the per-head
 * products around it (td_gemm_heads).
 *
 * A decode step's cross-attention reads, for each sequence, its states E
 * (ctx x D, D = d_model) once a layer instead of K and V (2 x ctx x D):
 * every head's query is already W_k,h^T q_h, so all heads of a sequence
 * attend to the same rows (multi-query attention with K = V = E, head
 * width D). One block takes 16 (row, head) pairs of a sequence (the mma
 * M) and a range of its states; E comes in tiles of ST rows by bulk
 * copies (a row's two halves, one per pool plane, into padded shared
 * memory; the mma takes the states in an order whose ldmatrix rows meet
 * no bank conflicts), requested before the PDL wait (the states are
 * static in a step). Per tile the 8 or 16 warps split the scores'
 * reduction over D (the query's A fragments held in registers), then the
 * mix's columns; with 16 warps, where three stages fit, one group of 8
 * takes the scores while the other mixes the tile before. A group's key
 * ranges (splits) run as one thread-block cluster and merge through
 * distributed shared memory; where that would be two splits, a cluster
 * of two blocks splits D instead and exchanges partial scores, with no
 * merge: H100, Flan-T5-large, 512 states, batch 1 11 us, batch 64 27.4 us
 * for 64 MB; docs/cuda.md, passes 13-16, 20 and 21. */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/cuda_ptx.cuh"

#include <cooperative_groups.h>

#define LOG2E_F 1.4426950408889634f

typedef struct StatesArgs {
  const bf16 *q, *pool, *qn;
  bf16 *out;
  const int32_t *q_start, *ctx_len, *block_table;
  int ldq, heads, D, bs, max_blocks, qn_dim, max_q, max_ctx, groups, n_splits;
  size_t block_elems;
  float scale_log2, qn_eps;
  bool late, qn_vec;
} StatesArgs;

/* 1 / rms of the query norm's row, or 1 (one warp). Rows of whole 16-byte
 * vectors are read four vectors a lane at a time, so that a row of 1024
 * takes one memory round trip, not one a 32 columns. */
__device__ __forceinline__ float states_qn(const StatesArgs &a, int row) {
  if (!a.qn) return 1.0f;
  const bf16 *x = a.qn + (size_t)row * a.qn_dim;
  const int lane = threadIdx.x & 31;
  float ss = 0.0f;
  if (a.qn_vec) {
    for (int j0 = lane * 8; j0 < a.qn_dim; j0 += 4 * 256) {
      td_bf16x8 v[4];
#pragma unroll
      for (int i = 0; i < 4; i++)
        v[i].u = j0 + i * 256 < a.qn_dim ? *(const uint4 *)(x + j0 + i * 256) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int i = 0; i < 4; i++)
#pragma unroll
        for (int t = 0; t < 4; t++) {
          const float2 f = __bfloat1622float2(v[i].h[t]);
          ss = fmaf(f.x, f.x, fmaf(f.y, f.y, ss));
        }
    }
  } else {
    for (int j = lane; j < a.qn_dim; j += 32) {
      const float v = __bfloat162float(x[j]);
      ss = fmaf(v, v, ss);
    }
  }
  ss = td_warp_sum(ss);
  return rsqrtf(ss / (float)a.qn_dim + a.qn_eps);
}

__device__ __forceinline__ const bf16 *states_row(const StatesArgs &a, const int32_t *table, int j, int plane) {
  const int b = j / a.bs;
  return a.pool + (size_t)table[b] * a.block_elems + ((size_t)plane * a.bs + (j - b * a.bs)) * (a.D / 2);
}

/* Any D: a block per (row, head); warps over keys, lanes over D. */
__global__ void __launch_bounds__(128) states_generic_kernel(const StatesArgs a) {
  extern __shared__ float sc[]; /* [max ctx] */
  __shared__ float red[32];
  td_pdl_start();
  const int s = (int)blockIdx.x / a.max_q, i = (int)blockIdx.x % a.max_q, h = (int)blockIdx.y;
  const int q0 = a.q_start[s], qn = a.q_start[s + 1] - q0, ctx = min(a.ctx_len[s], a.max_ctx);
  if (i >= qn) return;
  const int row = q0 + i, half = a.D / 2, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int32_t *table = a.block_table + (size_t)s * a.max_blocks;
  const bf16 *q = a.q + (size_t)row * a.ldq + (size_t)h * a.D;
  const float qs = a.scale_log2 * states_qn(a, row);
  for (int j = warp; j < ctx; j += 4) {
    const bf16 *ek = states_row(a, table, j, 0), *ev = states_row(a, table, j, 1);
    float d = 0.0f;
    for (int c = lane; c < half; c += 32) {
      d = fmaf(__bfloat162float(q[c]), __bfloat162float(ek[c]), d);
      d = fmaf(__bfloat162float(q[half + c]), __bfloat162float(ev[c]), d);
    }
    d = td_warp_sum(d);
    if (lane == 0) sc[j] = d * qs;
  }
  __syncthreads();
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < ctx; j += blockDim.x) mx = fmaxf(mx, sc[j]);
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  mx = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
  float sum = 0.0f;
  for (int j = threadIdx.x; j < ctx; j += blockDim.x) {
    float p = exp2f(sc[j] - mx);
    sc[j] = p;
    sum += p;
  }
  sum = td_block_sum(sum, red); /* its barriers also publish sc */
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  bf16 *o = a.out + ((size_t)row * a.heads + h) * a.D;
  for (int c = threadIdx.x; c < a.D; c += blockDim.x) {
    const int plane = c >= half, cc = c - plane * half;
    float acc = 0.0f;
    for (int j = 0; j < ctx; j++) acc = fmaf(sc[j], __bfloat162float(states_row(a, table, j, plane)[cc]), acc);
    o[c] = __float2bfloat16(acc * inv);
  }
}

/* Pieces both tensor-core kernels share. Stage layout: [plane][ST / 2]
 * pairs of rows of HALF columns, each pair padded to PAIR (see StatesSmem). */
template <int HALF, int PAIR>
__device__ __forceinline__ int states_erow(int r) { return (r >> 1) * PAIR + (r & 1) * HALF; }

/* The mma's state order within a tile: 8-row group g of a 16-row span
 * takes its even (g even) or odd states, one a pair, so an ldmatrix's 8
 * rows fall in 8 bank groups (consecutive states share a pair's bank
 * group). */
__device__ __forceinline__ int states_perm(int x) { return (x & ~15) + ((x >> 3) & 1) + 2 * (x & 7); }

/* Rows [nval, ST) of a stage (of PLANES planes) were not copied: zeroed
 * (0 x stale NaN is NaN) by threads tid of nthr. */
template <int ST, int HALF, int PAIR, int PLANES = 2>
__device__ __forceinline__ void states_zero_tail(bf16 *E, int nval, int tid, int nthr) {
  constexpr int PLANE = (ST / 2) * PAIR;
  for (int e = tid; e < PLANES * (ST - nval) * (HALF / 8); e += nthr) {
    const int pl = e / ((ST - nval) * (HALF / 8)), rem = e % ((ST - nval) * (HALF / 8));
    const int r = nval + rem / (HALF / 8), c = (rem % (HALF / 8)) * 8;
    *(uint4 *)(E + (size_t)pl * PLANE + states_erow<HALF, PAIR>(r) + c) = make_uint4(0u, 0u, 0u, 0u);
  }
}

/* A warp's partial scores of a tile over D columns [k0, k0 + KW), into its
 * rows of red ([16][RST] fp32). */
template <int ST, int KW, int HALF, int PAIR, int RST>
__device__ __forceinline__ void states_scores(const bf16 *E, const uint32_t (&qf)[KW / 16][4], int k0, float *rw) {
  constexpr int PLANE = (ST / 2) * PAIR;
  const int lane = threadIdx.x & 31, lr = lane & 7, lm = lane >> 3, gr = lane >> 2, gc = (lane & 3) * 2;
  float sacc[ST / 8][4];
#pragma unroll
  for (int j = 0; j < ST / 8; j++) sacc[j][0] = sacc[j][1] = sacc[j][2] = sacc[j][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < KW; kk += 16) {
    const int k = k0 + kk, pl = k >= HALF, kc = k - pl * HALF;
#pragma unroll
    for (int j = 0; j < ST / 8; j += 2) {
      uint32_t b0, b1, b2, b3;
      ldsm_x4(b0, b1, b2, b3,
              E + (size_t)pl * PLANE + states_erow<HALF, PAIR>(states_perm(j * 8 + (lm >> 1) * 8 + lr)) + kc + (lm & 1) * 8);
      mma16816(sacc[j], qf[kk / 16], b0, b1);
      mma16816(sacc[j + 1], qf[kk / 16], b2, b3);
    }
  }
#pragma unroll
  for (int j = 0; j < ST / 8; j++) {
    *(float2 *)&rw[gr * RST + j * 8 + gc] = make_float2(sacc[j][0], sacc[j][1]);
    *(float2 *)&rw[(gr + 8) * RST + j * 8 + gc] = make_float2(sacc[j][2], sacc[j][3]);
  }
}

/* A warp's mix of a tile: its accumulators (16 rows x 8 MT columns from
 * c0, within one plane) rescaled by alpha (per row), then += P E over the
 * tile's states (P [16][ST + 8] bf16). */
template <int ST, int MT, int HALF, int PAIR>
__device__ __forceinline__ void states_mix(float (&acc)[MT][4], const bf16 *E, const bf16 *P, const float *alpha, int c0) {
  constexpr int PLANE = (ST / 2) * PAIR;
  const int lane = threadIdx.x & 31, lr = lane & 7, lm = lane >> 3, gr = lane >> 2;
  const float a0 = alpha[gr], a1 = alpha[gr + 8];
#pragma unroll
  for (int j = 0; j < MT; j++) {
    acc[j][0] *= a0;
    acc[j][1] *= a0;
    acc[j][2] *= a1;
    acc[j][3] *= a1;
  }
  const int pl = c0 >= HALF, cc0 = c0 - pl * HALF;
#pragma unroll
  for (int kk = 0; kk < ST; kk += 16) {
    uint32_t af[4];
    ldsm_x4(af[0], af[1], af[2], af[3], P + (size_t)(lr + (lm & 1) * 8) * (ST + 8) + kk + (lm >> 1) * 8);
#pragma unroll
    for (int j = 0; j < MT; j += 2) {
      uint32_t b0, b1, b2, b3;
      ldsm_x4_t(b0, b1, b2, b3,
                E + (size_t)pl * PLANE + states_erow<HALF, PAIR>(states_perm(kk + (lm & 1) * 8 + lr)) + cc0 + j * 8 +
                    (lm >> 1) * 8);
      mma16816(acc[j], af, b0, b1);
      if (j + 1 < MT) mma16816(acc[j + 1], af, b2, b3);
    }
  }
}

/* This block's part: a cluster of n_splits blocks per group of 16 pairs
 * (sequence s, group g), block `split` taking tiles [t0, t1) of ST states. */
struct StatesBlock {
  int split, s, g, ctx, t0, t1;
  const int32_t *table;
};
template <int ST>
__device__ __forceinline__ StatesBlock states_block(const StatesArgs &a) {
  StatesBlock k;
  const int sg = (int)blockIdx.x / a.n_splits;
  k.split = (int)blockIdx.x % a.n_splits;
  k.s = sg / a.groups;
  k.g = sg % a.groups;
  k.ctx = a.ctx_len[k.s];
  k.table = a.block_table + (size_t)k.s * a.max_blocks;
  const int nt = (k.ctx + ST - 1) / ST;
  k.t0 = (int)((long)nt * k.split / a.n_splits);
  k.t1 = (int)((long)nt * (k.split + 1) / a.n_splits);
  return k;
}

/* Tile t of ST states into a stage by bulk copies, one a row and plane (two
 * rows where they share a paged block), by threads lt < 4 ST of the issuing
 * group (lanes 0 and 1 of each 8) for both planes, lt < 2 ST (lane 0 of
 * each 4) for plane `plane0` alone; lt 0 arms the stage's barrier. */
template <int ST, int HALF, int PAIR, int PLANES = 2>
__device__ __forceinline__ void states_issue(const StatesArgs &a, const int32_t *table, int ctx, int t, bf16 *stage,
                                             uint64_t *bar, uint64_t pol, int lt, int plane0 = 0) {
  constexpr int PLANE = (ST / 2) * PAIR, SH = PLANES == 2 ? 3 : 2;
  const int k0 = t * ST, n = min(ST, ctx - k0), r = 2 * (lt >> SH), pl = lt & ((1 << SH) - 1);
  if (lt == 0) mbar_arrive_tx(bar, (uint32_t)n * (uint32_t)(PLANES * HALF) * 2u);
  if (r < n && pl < PLANES) {
    bf16 *dst = stage + (size_t)pl * PLANE + states_erow<HALF, PAIR>(r);
    const bf16 *src = states_row(a, table, k0 + r, plane0 + pl);
    const bool two = r + 1 < n && (k0 + r) / a.bs == (k0 + r + 1) / a.bs;
    bulk_g2s_hint(dst, src, (two ? 2u : 1u) * HALF * 2u, bar, pol);
    if (r + 1 < n && !two)
      bulk_g2s_hint(dst + HALF, states_row(a, table, k0 + r + 1, plane0 + pl), HALF * 2, bar, pol);
  }
}

/* The 16 pairs' queries (pair p = g * 16 + r is row q0 + p / heads, head
 * p % heads), columns [k0, k0 + KW), straight into mma A fragments. */
template <int KW, int D>
__device__ __forceinline__ void states_load_q(uint32_t (&qf)[KW / 16][4], const StatesArgs &a, int g, int q0, int npairs,
                                              int k0) {
  const int lane = threadIdx.x & 31, gr = lane >> 2, gc = (lane & 3) * 2, p0 = g * 16 + gr, p1 = p0 + 8;
  const bf16 *s0 = p0 < npairs ? a.q + (size_t)(q0 + p0 / a.heads) * a.ldq + (size_t)(p0 % a.heads) * D : nullptr;
  const bf16 *s1 = p1 < npairs ? a.q + (size_t)(q0 + p1 / a.heads) * a.ldq + (size_t)(p1 % a.heads) * D : nullptr;
#pragma unroll
  for (int i = 0; i < KW / 16; i++) {
    const int k = k0 + i * 16 + gc;
    qf[i][0] = s0 ? *(const uint32_t *)(s0 + k) : 0u;
    qf[i][1] = s1 ? *(const uint32_t *)(s1 + k) : 0u;
    qf[i][2] = s0 ? *(const uint32_t *)(s0 + k + 8) : 0u;
    qf[i][3] = s1 ? *(const uint32_t *)(s1 + k + 8) : 0u;
  }
}

/* The score scale (the query norm's 1 / rms times scale_log2) of pair rows
 * [rpw w, rpw (w + 1)) by warp w, into st_q. */
__device__ __forceinline__ void states_qscale(const StatesArgs &a, int g, int q0, int npairs, float *st_q, int rpw) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = rpw * warp; r < rpw * warp + rpw; r++) {
    const int p = g * 16 + r;
    const float f = p < npairs ? states_qn(a, q0 + p / a.heads) : 0.0f;
    if (lane == 0) st_q[r] = f * a.scale_log2;
  }
}

/* A warp's accumulators (16 rows x 8 MT columns from c0): the output,
 * normalised by l, when the block holds the whole key range, else its
 * partial sums into mine ([16][PST] fp32) for the cluster's merge. */
template <int MT, int PST, typename OutAt>
__device__ __forceinline__ void states_store(const float (&acc)[MT][4], bool whole, OutAt out_at, const float *st_l,
                                             float *mine, int c0) {
  const int lane = threadIdx.x & 31, gr = lane >> 2, gc = (lane & 3) * 2;
#pragma unroll
  for (int hr = 0; hr < 2; hr++) {
    const int r = gr + 8 * hr;
    if (whole) {
      bf16 *o = out_at(r);
      const float l = st_l[r], inv = l > 0.0f ? 1.0f / l : 0.0f;
      if (o)
#pragma unroll
        for (int j = 0; j < MT; j++)
          *(uint32_t *)&o[c0 + j * 8 + gc] = pack_bf16(acc[j][2 * hr] * inv, acc[j][2 * hr + 1] * inv);
    } else {
#pragma unroll
      for (int j = 0; j < MT; j++)
        *(float2 *)&mine[r * PST + c0 + j * 8 + gc] = make_float2(acc[j][2 * hr], acc[j][2 * hr + 1]);
    }
  }
}

/* The start every tensor-core kernel shares once thread 0 has initialised
 * its barriers: the 16 rows' running max and sum reset, the barriers
 * published to the block, and where the block exchanges with its cluster,
 * its arrival on the cluster barrier that the first remote access waits
 * for (states_merge, the plane kernel's exchange). */
__device__ __forceinline__ void states_start(float *st_m, float *st_l, bool cluster) {
  if (threadIdx.x < 16) {
    st_m[threadIdx.x] = -INFINITY;
    st_l[threadIdx.x] = 0.0f;
  }
  __syncthreads();
  if (cluster) cluster_arrive();
}

/* A group's key splits merged across its cluster: every block has left its
 * partial sums in mine ([16][PST] fp32); block `split` of S writes columns
 * [split D / S, (split + 1) D / S) of all 16 rows. Each block's (m, l) is
 * pushed into every block's table ml ([S][16]) by posted stores, so the
 * weights read local memory only; those stores may only target a block
 * known to have started, so every thread of the block arrives on the
 * cluster barrier at the start (cluster_arrive) and calls this. */
template <int D, int PST, int NTHR, typename OutAt>
__device__ __forceinline__ void states_merge(float *mine, float2 *ml, const float *st_m, const float *st_l, int S,
                                             int split, OutAt out_at) {
  float *wk = mine + 16 * PST; /* [16][S]: merge weights, 1 / L folded in */
  namespace cg = cooperative_groups;
  cg::cluster_group cl = cg::this_cluster();
  const int tid = threadIdx.x;
  cluster_wait(); /* every block of the cluster has started (the kernel's cluster_arrive) */
  if (tid < 16)
    for (int k = 0; k < S; k++) *cl.map_shared_rank(ml + split * 16 + tid, k) = make_float2(st_m[tid], st_l[tid]);
  cl.sync(); /* the partials and every block's m, l visible to the cluster */
  if (tid < 16) {
    float M = -INFINITY, Ls = 0.0f;
    for (int k = 0; k < S; k++) M = fmaxf(M, ml[k * 16 + tid].x);
    for (int k = 0; k < S; k++) {
      const float2 f = ml[k * 16 + tid];
      const float w = f.x == -INFINITY ? 0.0f : exp2f(f.x - M);
      wk[tid * S + k] = w;
      Ls += w * f.y;
    }
    const float inv = Ls > 0.0f ? 1.0f / Ls : 0.0f;
    for (int k = 0; k < S; k++) wk[tid * S + k] *= inv;
  }
  __syncthreads();
  const int cw = D / S, n4 = 16 * (cw / 4); /* this block's float4s: 16 rows x cw / 4 */
  for (int e = tid; e < n4; e += NTHR) {
    const int r = e / (cw / 4), c = split * cw + (e % (cw / 4)) * 4;
    float4 m4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int k = 0; k < S; k++) {
      const float w = wk[r * S + k];
      const float4 f = *(const float4 *)cl.map_shared_rank(mine + r * PST + c, k);
      m4.x = fmaf(w, f.x, m4.x);
      m4.y = fmaf(w, f.y, m4.y);
      m4.z = fmaf(w, f.z, m4.z);
      m4.w = fmaf(w, f.w, m4.w);
    }
    bf16 *o = out_at(r);
    if (o) *(uint2 *)&o[c] = make_uint2(pack_bf16(m4.x, m4.y), pack_bf16(m4.z, m4.w));
  }
  cl.sync(); /* no block leaves while another still reads its shared memory */
}

/* The tensor-core kernel: D = 64 NT, ST states a tile, NSTG tiles in
 * flight, SW warps. */
enum { ST = 32, NSTG = 2, STATES_MAX_SPLITS = 16 };

template <int NT, int ST, int NSTG, int SW>
struct StatesSmem {
  /* a plane's rows in pairs (one bulk copy of 2 rows where they share a
   * paged block: half the copies of one a row), the pairs padded by 16
   * bytes */
  static constexpr int D = NT * 64, HALF = D / 2, PAIR = 2 * HALF + 8;
  static constexpr size_t STAGE = 2 * (ST / 2) * (size_t)PAIR * 2; /* [plane][ST / 2][PAIR] bf16 */
  /* per-warp partial scores, rows padded by 8 floats: a warp's stores of
   * 4 rows at a time meet no bank conflicts */
  static constexpr int RST = ST + 8;
  static constexpr size_t RED = SW * 16 * (size_t)RST * 4;
  static constexpr size_t P = 16 * (ST + 8) * 2;                 /* probabilities, bf16 */
  static constexpr size_t STATS = 3 * 16 * 4;                    /* m, l, alpha */
  static constexpr size_t ML = STATES_MAX_SPLITS * 16 * 8;       /* every split's (m, l), pushed before the merge */
  static constexpr size_t BYTES = NSTG * STAGE + RED + P + STATS + ML + NSTG * 8;
  /* after the last tile the stages hold the block's partial sums for the
   * cluster's merge: [16][D + 4] fp32, then 16 x STATES_MAX_SPLITS weights */
  static constexpr int PST = D + 4;
  static_assert(NSTG * STAGE >= (16 * (size_t)PST + 16 * STATES_MAX_SPLITS) * 4, "merge buffer");
};

template <int NT, int ST, int NSTG, int SW>
__global__ void __launch_bounds__(32 * SW, 1) states_mma_kernel(const StatesArgs a) {
  using L = StatesSmem<NT, ST, NSTG, SW>;
  static_assert(SW == 8 || SW == 16, "warps a block");
  constexpr int TPR = 2 * SW, RPW = 16 / SW; /* softmax threads a row; query-scale rows a warp */
  constexpr int D = L::D, HALF = L::HALF, PAIR = L::PAIR, KW = D / SW; /* each warp's score slice of D */
  constexpr int PLANE = (ST / 2) * PAIR, SSTAGE = 2 * PLANE;
  static_assert(ST % 16 == 0, "tile of whole 16-state spans");
  extern __shared__ __align__(128) unsigned char smem[];
  bf16 *stage = (bf16 *)smem;
  float *red = (float *)(smem + NSTG * L::STAGE);
  bf16 *ps = (bf16 *)((char *)red + L::RED);
  float *st_m = (float *)((char *)ps + L::P), *st_l = st_m + 16, *st_a = st_l + 16;
  float2 *ml = (float2 *)(st_m + 48); /* [split][16] */
  uint64_t *bar = (uint64_t *)((char *)ml + L::ML);
  const int warp = threadIdx.x >> 5, tid = threadIdx.x;
  const StatesBlock kb = states_block<ST>(a);
  const int split = kb.split, s = kb.s, g = kb.g, ctx = kb.ctx, t0 = kb.t0, t1 = kb.t1;
  const int32_t *table = kb.table;
  if (tid == 0)
    for (int i = 0; i < NSTG; i++) mbar_init(&bar[i], 1);
  states_start(st_m, st_l, a.n_splits > 1);
  /* tile t into stage buffer b by every thread that has copies to issue
   * (spread over the warps: a warp issues its bulk copies one after another) */
  const uint64_t pol = l2_evict_first();
  auto issue = [&](int t, int b) {
    states_issue<ST, HALF, PAIR>(a, table, ctx, t, stage + (size_t)b * SSTAGE, &bar[b], pol, tid);
  };
  for (int i = 0; i < NSTG && t0 + i < t1; i++) issue(t0 + i, i);
  td_pdl_start_if(a.late);
  const int q0 = a.q_start[s], npairs = (a.q_start[s + 1] - q0) * a.heads;
  uint32_t qf[KW / 16][4]; /* this warp's slice of D */
  states_load_q<KW, D>(qf, a, g, q0, npairs, warp * KW);
  /* score scale of each pair row (the query norm's 1 / rms), warp w rows RPW w + [0, RPW) */
  float *st_q = red; /* borrowed until the first tile's partials */
  states_qscale(a, g, q0, npairs, st_q, RPW);
  __syncthreads();
  float rs = st_q[tid / TPR]; /* the softmax phase's row */
  __syncthreads();

  constexpr int MT = D / SW / 8; /* each warp's mix columns in n8 tiles */
  float acc[MT][4];
#pragma unroll
  for (int j = 0; j < MT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  for (int t = t0, use = 0; t < t1; t++, use++) {
    const int b = use % NSTG;
    const bf16 *E = stage + (size_t)b * SSTAGE;
    mbar_wait(&bar[b], (unsigned)(use / NSTG) & 1u);
    const int nval = min(ST, ctx - t * ST);
    if (nval < ST) {
      states_zero_tail<ST, HALF, PAIR>((bf16 *)E, nval, tid, 32 * SW);
      __syncthreads();
    }
    /* scores: warp w sums over D columns [w KW, (w + 1) KW) */
    states_scores<ST, KW, HALF, PAIR, L::RST>(E, qf, warp * KW, red + (size_t)warp * 16 * L::RST);
    __syncthreads();
    { /* softmax over the tile: thread tid takes row tid / TPR, columns CPT (tid % TPR) + [0, CPT) */
      constexpr int CPT = ST / TPR;
      const int r = tid / TPR, c = (tid % TPR) * CPT;
      float v[CPT];
#pragma unroll
      for (int i = 0; i < CPT; i++) v[i] = 0.0f;
#pragma unroll
      for (int w = 0; w < SW; w++) {
        const float *rr = red + ((size_t)w * 16 + r) * L::RST + c;
        if constexpr (CPT % 2 == 0) { /* float2: a half-warp a row, no bank conflicts */
#pragma unroll
          for (int i = 0; i < CPT; i += 2) {
            const float2 f = *(const float2 *)&rr[i];
            v[i] += f.x;
            v[i + 1] += f.y;
          }
        } else {
#pragma unroll
          for (int i = 0; i < CPT; i++) v[i] += rr[i];
        }
      }
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < CPT; i++) {
        v[i] = states_perm(c + i) < nval ? v[i] * rs : -INFINITY;
        mx = fmaxf(mx, v[i]);
      }
#pragma unroll
      for (int o = TPR / 2; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float mo = st_m[r], mn = fmaxf(mo, mx);
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < CPT; i++) {
        v[i] = mn == -INFINITY ? 0.0f : exp2f(v[i] - mn);
        sum += v[i];
        ps[r * (ST + 8) + c + i] = __float2bfloat16(v[i]);
      }
#pragma unroll
      for (int o = TPR / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      __syncwarp();
      if (tid % TPR == 0) {
        const float al = mo == -INFINITY ? 0.0f : exp2f(mo - mn);
        st_a[r] = al;
        st_l[r] = st_l[r] * al + sum;
        st_m[r] = mn;
      }
    }
    __syncthreads();
    /* mix: warp w owns columns [w D / SW, (w + 1) D / SW), all in one plane */
    states_mix<ST, MT, HALF, PAIR>(acc, E, ps, st_a, warp * (D / SW));
    __syncthreads(); /* every warp is done with the stage and the probabilities */
    if (t + NSTG < t1) {
      fence_proxy_async(); /* this thread's reads of the stage before the copy engine's writes */
      issue(t + NSTG, b);
    }
  }

  /* out: this block's sums (one split) or the merge of the cluster's */
  const int c0 = warp * (D / SW);
  auto out_at = [&](int r) -> bf16 * {
    const int p = g * 16 + r;
    return p < npairs ? a.out + ((size_t)(q0 + p / a.heads) * a.heads + p % a.heads) * D : nullptr;
  };
  /* the output, or the partial sums into the stages (all copies have
   * landed) and the cluster's merge */
  float *mine = (float *)stage;
  states_store<MT, L::PST>(acc, a.n_splits == 1, out_at, st_l, mine, c0);
  if (a.n_splits == 1) return;
  states_merge<D, L::PST, 32 * SW>(mine, ml, st_m, st_l, a.n_splits, split, out_at);
}

/* The same product with the phases on separate warps, where the policy
 * takes 16 warps and three stages fit (D <= 1024; td_cuda_tuning.states_ws
 * off: the kernel above): warps 0-7 take the scores and the softmax of tile u
 * while warps 8-15 mix tile u - 1, the probabilities handed over through
 * two buffers and mbarriers, each group on its own named barrier, so that
 * neither waits for the other's phase and a third stage fits in the
 * shared memory the first kernel's 16 warps of partial scores took. The
 * mix group refills the stage it has finished. D = 64 NT, 512 threads.
 * H100, Flan-T5-large, 512 states: batch 64 31.7 -> 30.7 us alone, the
 * step 2.243-2.261 -> 2.211-2.215 ms (docs/cuda.md, pass 20). */
template <int NT>
struct StatesWsSmem {
  static constexpr int ST = 32, NSTG = 3, D = NT * 64, HALF = D / 2, PAIR = 2 * HALF + 8, RST = ST + 8;
  static constexpr size_t STAGE = 2 * (ST / 2) * (size_t)PAIR * 2;
  static constexpr size_t RED = 8 * 16 * (size_t)RST * 4;
  static constexpr size_t P = 2 * 16 * (ST + 8) * 2;              /* two buffers */
  static constexpr size_t STATS = (16 + 16 + 32 + 16) * 4;        /* m, l, alpha [2][16], query scale */
  static constexpr size_t ML = STATES_MAX_SPLITS * 16 * 8;
  static constexpr size_t BARS = (NSTG + 4) * 8;                  /* full[NSTG], pfull[2], pempty[2] */
  static constexpr size_t BYTES = NSTG * STAGE + RED + P + STATS + ML + BARS;
  static constexpr int PST = D + 4;
  static_assert(NSTG * STAGE >= (16 * (size_t)PST + 16 * STATES_MAX_SPLITS) * 4, "merge buffer");
};

/* Barriers that the two warp groups reach from different code: the
 * non-aligned form (bar.sync, __syncthreads, require every thread of the
 * block at the same instruction) */
__device__ __forceinline__ void named_sync(int id) { asm volatile("barrier.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void block_sync() { asm volatile("barrier.sync 0;\n" ::: "memory"); }

/* The mix group's part of the warp-specialised kernels (threads 256-511):
 * stages FIRST.. requested once the first has landed, then per tile the
 * wait for its probabilities, the mix, and the refill of the stage it
 * frees (issue(t, stage, thread of 128)); stages sstage elements apart. */
template <int ST, int MT, int HALF, int PAIR, int NSTG, int FIRST, typename Issue>
__device__ __forceinline__ void states_mix_loop(float (&acc)[MT][4], const bf16 *stage, size_t sstage, int t0, int t1,
                                                const bf16 *ps, const float *st_a, int c0, uint64_t *full,
                                                uint64_t *pfull, uint64_t *pempty, Issue issue) {
  constexpr int PB = 16 * (ST + 8);
  const int tid = threadIdx.x;
  if (t0 + FIRST < t1 && tid - 256 < 128) {
    mbar_wait(&full[0], 0u);
    for (int i = FIRST; i < NSTG && t0 + i < t1; i++) issue(t0 + i, i, tid - 256);
  }
  for (int t = t0, u = 0; t < t1; t++, u++) {
    const int b = u % NSTG;
    mbar_wait(&pfull[u & 1], (unsigned)(u >> 1) & 1u);
    states_mix<ST, MT, HALF, PAIR>(acc, stage + (size_t)b * sstage, ps + (u & 1) * PB, st_a + (u & 1) * 16, c0);
    named_sync(2); /* the group is done with the stage and the probabilities */
    if (tid == 256) mbar_arrive(&pempty[u & 1]);
    if (t + NSTG < t1 && tid - 256 < 128) {
      fence_proxy_async();
      issue(t + NSTG, b, tid - 256);
    }
  }
}

/* 120 registers (512 threads): a block then fits beside one of the self
 * K/V prefetch's 4 blocks (td_kv_prefetch), which otherwise keep 4 SMs
 * from the states kernel's 128 blocks at batch 64 (step 2.211-2.231 ->
 * 2.201-2.210 ms). */
template <int NT>
__global__ void __maxnreg__(120) states_ws_kernel(const StatesArgs a) {
  using L = StatesWsSmem<NT>;
  constexpr int ST = L::ST, NSTG = L::NSTG, D = L::D, HALF = L::HALF, PAIR = L::PAIR, RST = L::RST;
  constexpr int KW = D / 8, MT = D / 8 / 8, PLANE = (ST / 2) * PAIR, SSTAGE = 2 * PLANE, PB = 16 * (ST + 8);
  extern __shared__ __align__(128) unsigned char smem[];
  bf16 *stage = (bf16 *)smem;
  float *red = (float *)(smem + NSTG * L::STAGE);
  bf16 *ps = (bf16 *)((char *)red + L::RED);
  float *st_m = (float *)((char *)ps + L::P), *st_l = st_m + 16, *st_a = st_l + 16, *st_q = st_a + 32;
  float2 *ml = (float2 *)(st_q + 16);
  uint64_t *full = (uint64_t *)((char *)ml + L::ML), *pfull = full + NSTG, *pempty = pfull + 2;
  const int warp = threadIdx.x >> 5, tid = threadIdx.x;
  const bool sw = warp < 8;
  const StatesBlock kb = states_block<ST>(a);
  const int split = kb.split, s = kb.s, g = kb.g, ctx = kb.ctx, t0 = kb.t0, t1 = kb.t1;
  const int32_t *table = kb.table;
  if (tid == 0) {
    for (int i = 0; i < NSTG; i++) mbar_init(&full[i], 1);
    for (int i = 0; i < 2; i++) {
      mbar_init(&pfull[i], 1);
      mbar_init(&pempty[i], 1);
    }
  }
  states_start(st_m, st_l, a.n_splits > 1);
  const uint64_t pol = l2_evict_first();
  /* tile t into stage b by threads lt < 128 of a group */
  auto issue = [&](int t, int b, int lt) {
    states_issue<ST, HALF, PAIR>(a, table, ctx, t, stage + (size_t)b * SSTAGE, &full[b], pol, lt);
  };
  /* two tiles at once, the third once the first has landed: requested
   * together, the first's bytes would share the start's DRAM queue with it
   * (H100, Flan-T5-large batch 64: the step 2.251-2.263 -> 2.207-2.229 ms) */
  constexpr int first = 2;
  if (tid < 128)
    for (int i = 0; i < first && t0 + i < t1; i++) issue(t0 + i, i, tid);
  td_pdl_start_if(a.late);
  const int q0 = a.q_start[s], npairs = (a.q_start[s + 1] - q0) * a.heads;
  auto out_at = [&](int r) -> bf16 * {
    const int p = g * 16 + r;
    return p < npairs ? a.out + ((size_t)(q0 + p / a.heads) * a.heads + p % a.heads) * D : nullptr;
  };
  float *mine = (float *)stage;
  if (sw) {
    /* scores and softmax: warp w sums over D columns [w KW, (w + 1) KW) */
    uint32_t qf[KW / 16][4];
    states_load_q<KW, D>(qf, a, g, q0, npairs, warp * KW);
    states_qscale(a, g, q0, npairs, st_q, 2);
    named_sync(1);
    const int sr = tid / 16, scol = (tid % 16) * 2; /* the softmax's row and two columns */
    const float rs = st_q[sr];
    for (int t = t0, u = 0; t < t1; t++, u++) {
      const int b = u % NSTG;
      const bf16 *E = stage + (size_t)b * SSTAGE;
      mbar_wait(&full[b], (unsigned)(u / NSTG) & 1u);
      const int nval = min(ST, ctx - t * ST);
      if (nval < ST) { /* (read by both groups) */
        states_zero_tail<ST, HALF, PAIR>((bf16 *)E, nval, tid, 256);
        named_sync(1);
      }
      states_scores<ST, KW, HALF, PAIR, RST>(E, qf, warp * KW, red + (size_t)warp * 16 * RST);
      named_sync(1);
      if (u >= 2) mbar_wait(&pempty[u & 1], (unsigned)((u >> 1) - 1) & 1u); /* the mix of tile u - 2 is done */
      {
        float v0 = 0.0f, v1 = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; w++) {
          const float2 f = *(const float2 *)&red[((size_t)w * 16 + sr) * RST + scol];
          v0 += f.x;
          v1 += f.y;
        }
        v0 = states_perm(scol) < nval ? v0 * rs : -INFINITY;
        v1 = states_perm(scol + 1) < nval ? v1 * rs : -INFINITY;
        float mx = fmaxf(v0, v1);
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float mo = st_m[sr], mn = fmaxf(mo, mx);
        v0 = mn == -INFINITY ? 0.0f : exp2f(v0 - mn);
        v1 = mn == -INFINITY ? 0.0f : exp2f(v1 - mn);
        *(uint32_t *)&ps[(u & 1) * PB + sr * (ST + 8) + scol] = pack_bf16(v0, v1);
        float sum = v0 + v1;
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (tid % 16 == 0) {
          const float al = mo == -INFINITY ? 0.0f : exp2f(mo - mn);
          st_a[(u & 1) * 16 + sr] = al;
          st_l[sr] = st_l[sr] * al + sum;
          st_m[sr] = mn;
        }
      }
      named_sync(1); /* the partials read, the probabilities written */
      if (tid == 0) mbar_arrive(&pfull[u & 1]);
    }
    block_sync(); /* every tile consumed; m, l final (the mix group meets it below) */
  } else {
    /* mix: warp 8 + w owns columns [w D / 8, (w + 1) D / 8), all in one plane */
    const int c0 = (warp - 8) * (D / 8);
    float acc[MT][4];
#pragma unroll
    for (int j = 0; j < MT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    states_mix_loop<ST, MT, HALF, PAIR, NSTG, first>(acc, stage, SSTAGE, t0, t1, ps, st_a, c0, full, pfull, pempty, issue);
    block_sync(); /* every tile consumed; m, l final */
    states_store<MT, L::PST>(acc, a.n_splits == 1, out_at, st_l, mine, c0);
  }
  if (a.n_splits == 1) return;
  states_merge<D, L::PST, 512>(mine, ml, st_m, st_l, a.n_splits, split, out_at);
}

/* The same two groups with D split instead of the keys: a cluster of two
 * blocks a group of 16 pairs, block p holding pool plane p (columns
 * [p D / 2, (p + 1) D / 2)) of every state, so that both blocks stream
 * the whole key range and no partial sums are merged. A tile is 64 states
 * of one plane (the bytes of the kernel above's 32 of both); warps 0-7
 * take its partial scores (two halves of the states by four quarters of
 * the plane), sum them, and exchange the 16 x 64 sums with the other
 * block by st.async, so that both add the same two numbers and agree on
 * the softmax bit for bit; warps 8-15 mix the tile before over their
 * eighth of the plane, and each block writes its half of the columns. */
template <int NT>
struct StatesPlSmem {
  static constexpr int ST = 64, NSTG = 3, D = NT * 64, HALF = D / 2, PAIR = 2 * HALF + 8, RST = ST + 8;
  static constexpr size_t STAGE = (ST / 2) * (size_t)PAIR * 2; /* one plane: [ST / 2][PAIR] bf16 */
  static constexpr size_t RED = 4 * 16 * (size_t)RST * 4;      /* [quarter][16][RST] fp32 */
  static constexpr size_t P = 2 * 16 * (ST + 8) * 2;            /* two buffers */
  static constexpr size_t XB = 2 * 16 * (size_t)ST * 4;         /* the other plane's sums, two buffers */
  static constexpr size_t STATS = (16 + 16 + 32 + 16) * 4;      /* m, l, alpha [2][16], query scale */
  static constexpr size_t BARS = (NSTG + 6) * 8;                /* full[NSTG], pfull[2], pempty[2], xfull[2] */
  static constexpr size_t BYTES = NSTG * STAGE + RED + P + XB + STATS + BARS;
};

template <int NT>
__global__ void __maxnreg__(120) states_pl_kernel(const StatesArgs a) {
  using L = StatesPlSmem<NT>;
  constexpr int ST = L::ST, NSTG = L::NSTG, HALF = L::HALF, PAIR = L::PAIR, RST = L::RST;
  constexpr int KW = HALF / 4, MT = HALF / 8 / 8, PB = 16 * (ST + 8);
  static_assert(KW % 16 == 0 && MT >= 1, "plane width");
  extern __shared__ __align__(128) unsigned char smem[];
  bf16 *stage = (bf16 *)smem;
  float *red = (float *)(smem + NSTG * L::STAGE);
  bf16 *ps = (bf16 *)((char *)red + L::RED);
  float *xb = (float *)((char *)ps + L::P);
  float *st_m = (float *)((char *)xb + L::XB), *st_l = st_m + 16, *st_a = st_l + 16, *st_q = st_a + 32;
  uint64_t *full = (uint64_t *)(st_q + 16), *pfull = full + NSTG, *pempty = pfull + 2, *xfull = pempty + 2;
  const int warp = threadIdx.x >> 5, tid = threadIdx.x;
  const bool sw = warp < 8;
  const int sg = (int)blockIdx.x >> 1, plane = (int)blockIdx.x & 1, s = sg / a.groups, g = sg % a.groups;
  const int ctx = a.ctx_len[s], t1 = (ctx + ST - 1) / ST;
  const int32_t *table = a.block_table + (size_t)s * a.max_blocks;
  if (tid == 0) {
    for (int i = 0; i < NSTG; i++) mbar_init(&full[i], 1);
    for (int i = 0; i < 2; i++) {
      mbar_init(&pfull[i], 1);
      mbar_init(&pempty[i], 1);
      mbar_init(&xfull[i], 1);
    }
    fence_mbar_init_cluster();
  }
  states_start(st_m, st_l, true); /* the other block's barriers are ready once its arrival completes */
  const uint64_t pol = l2_evict_first();
  auto issue = [&](int t, int b, int lt) {
    states_issue<ST, HALF, PAIR, 1>(a, table, ctx, t, stage + (size_t)b * (L::STAGE / 2), &full[b], pol, lt, plane);
  };
  constexpr int first = 2; /* the third once the first has landed (see states_ws_kernel) */
  if (tid < 128)
    for (int i = 0; i < first && i < t1; i++) issue(i, i, tid);
  td_pdl_start_if(a.late);
  const int q0 = a.q_start[s], npairs = (a.q_start[s + 1] - q0) * a.heads;
  if (sw) {
    /* warp w: states [32 (w & 1), +32) of a tile over plane columns [KW (w >> 1), +KW) */
    const int sh = warp & 1, qt = warp >> 1;
    uint32_t qf[KW / 16][4];
    states_load_q<KW, L::D>(qf, a, g, q0, npairs, plane * HALF + qt * KW);
    states_qscale(a, g, q0, npairs, st_q, 2);
    named_sync(1);
    const int sr = tid / 16, scol = (tid % 16) * 4; /* the softmax's row and four columns */
    const float rs = st_q[sr];
    const uint32_t rxb = dsmem_map(xb + sr * ST + scol, (unsigned)(plane ^ 1));
    const uint32_t rxf = dsmem_map(xfull, (unsigned)(plane ^ 1));
    cluster_wait();
    for (int t = 0, u = 0; t < t1; t++, u++) {
      const int b = u % NSTG, x = u & 1;
      const bf16 *E = stage + (size_t)b * (L::STAGE / 2);
      mbar_wait(&full[b], (unsigned)(u / NSTG) & 1u);
      const int nval = min(ST, ctx - t * ST);
      if (nval < ST) { /* (read by both groups) */
        states_zero_tail<ST, HALF, PAIR, 1>((bf16 *)E, nval, tid, 256);
        named_sync(1);
      }
      states_scores<32, KW, HALF, PAIR, RST>(E + (size_t)sh * 16 * PAIR, qf, qt * KW,
                                             red + (size_t)qt * 16 * RST + sh * 32);
      named_sync(1);
      float4 v = *(const float4 *)&red[sr * RST + scol];
#pragma unroll
      for (int q = 1; q < 4; q++) {
        const float4 f = *(const float4 *)&red[((size_t)q * 16 + sr) * RST + scol];
        v.x += f.x;
        v.y += f.y;
        v.z += f.z;
        v.w += f.w;
      }
      st_async16(rxb + (uint32_t)(x * 16 * ST * 4), v, rxf + (uint32_t)(x * 8));
      if (tid == 0) mbar_arrive_tx(&xfull[x], 16 * ST * 4);
      if (u >= 2) mbar_wait(&pempty[x], (unsigned)((u >> 1) - 1) & 1u); /* the mix of tile u - 2 is done */
      mbar_wait_cluster(&xfull[x], (unsigned)(u >> 1) & 1u);
      {
        const float4 o = *(const float4 *)&xb[x * 16 * ST + sr * ST + scol];
        float vv[4] = {v.x + o.x, v.y + o.y, v.z + o.z, v.w + o.w}; /* the other block adds o + v: the same */
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < 4; i++) {
          vv[i] = states_perm(scol + i) < nval ? vv[i] * rs : -INFINITY;
          mx = fmaxf(mx, vv[i]);
        }
#pragma unroll
        for (int o2 = 8; o2 > 0; o2 >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o2));
        const float mo = st_m[sr], mn = fmaxf(mo, mx);
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
          vv[i] = mn == -INFINITY ? 0.0f : exp2f(vv[i] - mn);
          sum += vv[i];
        }
        *(uint2 *)&ps[x * PB + sr * (ST + 8) + scol] = make_uint2(pack_bf16(vv[0], vv[1]), pack_bf16(vv[2], vv[3]));
#pragma unroll
        for (int o2 = 8; o2 > 0; o2 >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o2);
        if (tid % 16 == 0) {
          const float al = mo == -INFINITY ? 0.0f : exp2f(mo - mn);
          st_a[x * 16 + sr] = al;
          st_l[sr] = st_l[sr] * al + sum;
          st_m[sr] = mn;
        }
      }
      named_sync(1); /* the partials and the other block's sums read, the probabilities written */
      if (tid == 0) mbar_arrive(&pfull[x]);
    }
    block_sync(); /* every tile consumed; l final */
  } else {
    /* mix: warp 8 + w owns plane columns [w HALF / 8, (w + 1) HALF / 8) */
    const int c0 = (warp - 8) * (HALF / 8);
    float acc[MT][4];
#pragma unroll
    for (int j = 0; j < MT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    states_mix_loop<ST, MT, HALF, PAIR, NSTG, first>(acc, stage, L::STAGE / 2, 0, t1, ps, st_a, c0, full, pfull, pempty,
                                                   issue);
    cluster_wait(); /* (completed long ago: pairs this group's arrival) */
    block_sync();
    auto out_at = [&](int r) -> bf16 * {
      const int p = g * 16 + r;
      return p < npairs ? a.out + ((size_t)(q0 + p / a.heads) * a.heads + p % a.heads) * L::D + plane * HALF
                        : nullptr;
    };
    states_store<MT, 0>(acc, true, out_at, st_l, nullptr, c0);
  }
}

/* The tensor-core kernel for one D (NT = D / 64) and warp count, and how
 * many of its clusters of 1, 2, 4 and 8 blocks the GPU holds at once. */
typedef struct states_cfg {
  int nt, sw;
  bool ws; /* states_ws_kernel (16 warps in two groups) */
  bool pl; /* states_pl_kernel (the same, D split over a cluster of two) */
  size_t bytes;
  const void *fn;
  void (*launch)(const td_cuda *c, dim3 grid, int cluster, const StatesArgs &a);
} states_cfg;

template <int NT, int SW>
static void states_launch(const td_cuda *c, dim3 grid, int cluster, const StatesArgs &a) {
  (void)td_launch_ex(c, cluster, -1, states_mma_kernel<NT, ST, NSTG, SW>, grid, 32 * SW,
                     StatesSmem<NT, ST, NSTG, SW>::BYTES, a);
}

template <int NT>
static void states_ws_launch(const td_cuda *c, dim3 grid, int cluster, const StatesArgs &a) {
  (void)td_launch_ex(c, cluster, -1, states_ws_kernel<NT>, grid, 512, StatesWsSmem<NT>::BYTES, a);
}
template <int NT>
static void states_pl_launch(const td_cuda *c, dim3 grid, int cluster, const StatesArgs &a) {
  (void)td_launch_ex(c, cluster, -1, states_pl_kernel<NT>, grid, 512, StatesPlSmem<NT>::BYTES, a);
}
#define TD_STATES_WS(nt) \
  {nt, 16, true, false, StatesWsSmem<nt>::BYTES, (const void *)states_ws_kernel<nt>, states_ws_launch<nt>},
#define TD_STATES_PL(nt) \
  {nt, 16, true, true, StatesPlSmem<nt>::BYTES, (const void *)states_pl_kernel<nt>, states_pl_launch<nt>},

#define TD_STATES_CFG(nt, sw) \
  {nt, sw, false, false, StatesSmem<nt, ST, NSTG, sw>::BYTES, (const void *)states_mma_kernel<nt, ST, NSTG, sw>, \
   states_launch<nt, sw>},
static const states_cfg STATES_CFGS[] = {TD_STATES_CFG(8, 8) TD_STATES_CFG(12, 8) TD_STATES_CFG(16, 8) TD_STATES_CFG(20, 8)
                                             TD_STATES_CFG(8, 16) TD_STATES_CFG(12, 16) TD_STATES_CFG(16, 16)
                                                 TD_STATES_CFG(20, 16)
                                                     TD_STATES_WS(8) TD_STATES_WS(12) TD_STATES_WS(16)
                                                         TD_STATES_PL(8) TD_STATES_PL(12) TD_STATES_PL(16)};
#undef TD_STATES_CFG
#undef TD_STATES_WS
#undef TD_STATES_PL
enum { STATES_NCFG = (int)(sizeof STATES_CFGS / sizeof STATES_CFGS[0]), STATES_CLUSTERS = 4 };
static_assert(STATES_NCFG <= (int)(sizeof(((td_cuda *)0)->states_clusters) / sizeof(((td_cuda *)0)->states_clusters[0])),
              "a states_clusters row per kernel");


/* H100, Flan-T5-large shape (docs/cuda.md, pass 22): where a tensor-core
 * kernel takes D the states path loses at 32 rows (1.80 against 1.72 ms)
 * and wins from 48 (2.01 against 2.09; the 64-row graph bucket 2.16
 * against 2.36); the generic kernel never pays */
int td_cu_states_rows(const td_backend *b, int D) {
  const td_cuda *c = td_cu((td_backend *)b);
  for (int i = 0; i < STATES_NCFG; i++)
    if (D == STATES_CFGS[i].nt * 64 && STATES_CFGS[i].bytes <= c->smem_optin) return 48;
  return INT_MAX;
}

td_status td_cu_attn_states(td_backend *b, const void *q, int ldq, void *out, const void *pool,
                            const td_kv_layout *l, int heads, const td_paged_meta *m, float scale) {
  td_cuda *c = td_cu(b);
  td_cu_bind(c);
  int D = l->states, bs = l->block_size;
  if ((long)m->max_blocks * bs > 2147483647L) return td_err(TD_ERR_INVALID, "attn_states: block table too wide");
  int max_q = m->max_q < 1 ? 1 : m->max_q > m->n_tokens ? m->n_tokens : m->max_q;
  int max_ctx = m->max_ctx < 1 || m->max_ctx > m->max_blocks * bs ? m->max_blocks * bs : m->max_ctx;
  StatesArgs a = {};
  a.q = (const bf16 *)q;
  a.pool = (const bf16 *)pool + td_kv_layer_span(l, l->n_layers).off; /* the states tail */
  a.out = (bf16 *)out;
  a.q_start = m->q_start;
  a.ctx_len = m->ctx_len;
  a.block_table = m->block_table;
  a.ldq = ldq;
  a.heads = heads;
  a.D = D;
  a.bs = bs;
  a.max_blocks = m->max_blocks;
  a.max_q = max_q;
  a.max_ctx = max_ctx;
  a.block_elems = td_kv_block_elems(l);
  a.scale_log2 = scale * LOG2E_F;
  a.late = c->tune.pdl_late > 0 && (c->tune.pdl_late & 1) != 0;
  if (m->q_norm) {
    a.qn = (const bf16 *)m->q_norm;
    a.qn_dim = m->q_norm_dim;
    a.qn_eps = m->q_norm_eps;
    a.qn_vec = m->q_norm_dim % 8 == 0 && td_aligned16(m->q_norm);
  }
  /* the kernels for this D with 8 and 16 warps, and the warp-specialised one */
  int c8 = STATES_NCFG, c16 = STATES_NCFG, cws = STATES_NCFG, cpl = STATES_NCFG;
  for (int i = 0; i < STATES_NCFG; i++)
    if (D == STATES_CFGS[i].nt * 64 && STATES_CFGS[i].bytes <= c->smem_optin)
      *(STATES_CFGS[i].pl ? &cpl : STATES_CFGS[i].ws ? &cws : STATES_CFGS[i].sw == 8 ? &c8 : &c16) = i;
  int ci = c8 < STATES_NCFG ? c8 : c16;
  const states_cfg *cfg = ci < STATES_NCFG ? &STATES_CFGS[ci] : NULL;
  bool fast = cfg && ldq % 8 == 0 && td_aligned16(q) && td_aligned16(a.pool) && a.block_elems % 8 == 0 &&
              td_aligned16(out) && m->kv_static && !c->tune.states_generic;
  if (!fast) {
    size_t sm = ((size_t)max_ctx + 8) * sizeof(float);
    if (sm > c->smem_optin) return td_err(TD_ERR_UNSUPPORTED, "attn_states: %d states", max_ctx);
    if (sm > 48 * 1024)
      TD_CU_CHECK(cudaFuncSetAttribute(states_generic_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm),
                  "attn_states");
    dim3 grid((unsigned)(m->n_seqs * max_q), (unsigned)heads);
    (void)td_launch(c, states_generic_kernel, grid, 128, sm, a);
    TD_CU_LAUNCHED("attn_states");
    return TD_OK;
  }
  a.groups = (max_q * heads + 15) / 16;
  long base = (long)m->n_seqs * a.groups;
  /* key splits: a cluster of that many blocks a group, merged in shared
   * memory; the most (a power of two, at most 8) that still fit the GPU in
   * one wave */
  int tiles = (max_ctx + ST - 1) / ST, splits = 1;
  if (c->tune.states_splits > 0) {
    int want = c->tune.states_splits;
    while (splits * 2 <= want && splits * 2 <= STATES_MAX_SPLITS && splits * 2 <= tiles) splits *= 2;
  } else {
    for (int k = 1; k < STATES_CLUSTERS; k++)
      if ((1 << k) <= tiles && base * (1 << k) <= c->sm_count && base <= c->states_clusters[ci][k]) splits = 1 << k;
  }
  /* 16 warps where each block streams a quarter or more of a sequence's
   * states (its shorter phases then pay); 8 warps where the splits are
   * more: their blocks fit beside the W_k product's blocks and start
   * copying during it (H100, Flan-T5-large: docs/cuda.md, pass 16) */
  int lg = 0;
  while ((1 << lg) < splits) lg++;
  bool w16 = c->tune.states_warps ? c->tune.states_warps == 16 : splits <= 2;
  /* of the 16-warp kernels, the warp-specialised one where its three stages
   * fit (D <= 1024; the tuning's states_ws off: the other) */
  if (cws < STATES_NCFG && c->tune.states_ws) c16 = cws;
  if (w16 && c16 < STATES_NCFG && lg < STATES_CLUSTERS && base <= c->states_clusters[c16][lg]) cfg = &STATES_CFGS[c16];
  if (base * splits > 2147483647L) return td_err(TD_ERR_UNSUPPORTED, "attn_states: %ld blocks", base * splits);
  /* two key splits on the warp-specialised kernel: D split instead, no
   * merge (the tuning's states_planes off: the key splits) */
  const bool planes = cws < STATES_NCFG && cfg == &STATES_CFGS[cws] && splits == 2 && cpl < STATES_NCFG &&
                      c->tune.states_planes && base <= c->states_clusters[cpl][1];
  if (planes) cfg = &STATES_CFGS[cpl];
  a.n_splits = planes ? 1 : splits; /* the plane kernel's cluster of two holds every key */
  cfg->launch(c, dim3((unsigned)(base * splits)), splits, a);
  TD_CU_LAUNCHED("attn_states");
  return TD_OK;
}

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

void td_cu_states_destroy(td_cuda *c) {
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
 * lets the next launch start at once (cuBLASLt's kernels do neither):
 * batch 1 of Flan-T5-large 1.16 -> 1.07 ms a step with the states pool. */
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
     * rows (H100, Flan-T5-large's W_v product: the split kernel wins at 1-4
     * rows, loses to cuBLASLt's from 16; docs/cuda.md, pass 14) */
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

td_status td_cu_states_init(td_cuda *c) {
  const size_t h1 = heads_smem(true, HEADS_MAX_KS), h2 = heads_smem(false, HEADS_MAX_KS);
  const int hsm = (int)(h1 > h2 ? h1 : h2);
  TD_CU_CHECK(cudaFuncSetAttribute(heads_mma_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, hsm),
              "gemm_heads");
  TD_CU_CHECK(cudaFuncSetAttribute(heads_mma_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, hsm),
              "gemm_heads");
  for (int i = 0; i < STATES_NCFG; i++) {
    const states_cfg *s = &STATES_CFGS[i];
    if (s->bytes > c->smem_optin) continue;
    TD_CU_CHECK(cudaFuncSetAttribute(s->fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)s->bytes),
                "attn_states");
    TD_CU_CHECK(cudaFuncSetAttribute(s->fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1), "attn_states");
    for (int k = 0; k < STATES_CLUSTERS; k++) {
      cudaLaunchConfig_t lc = {};
      cudaLaunchAttribute at = td_cluster_attr(1 << k);
      lc.gridDim = dim3(1u << k);
      lc.blockDim = dim3(32 * (unsigned)s->sw);
      lc.dynamicSmemBytes = s->bytes;
      lc.attrs = &at;
      lc.numAttrs = 1;
      int n = 0;
      TD_CU_CHECK(cudaOccupancyMaxActiveClusters(&n, s->fn, &lc), "attn_states");
      c->states_clusters[i][k] = n;
    }
  }
  return TD_OK;
}
