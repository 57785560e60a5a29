/* Cross-attention over encoder states (td_attn_states).
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
 * merge (docs/cuda.md, "Cross-attention over encoder states").
 *
 * Files: this header (the arguments and the pieces the tensor-core kernels
 * share), cuda_states_mma.cu (8 or 16 warps), cuda_states_ws.cu (16 warps
 * in two specialised groups), cuda_states_pl.cu (the same, D split over a
 * cluster of two), cuda_states.cu (the generic kernel, and the op: the
 * policy's kernel, cuda_policy.c). The per-head products around it are
 * cuda_gemm_heads.cu. */
#ifndef TD_KERNELS_CUDA_STATES_CUH
#define TD_KERNELS_CUDA_STATES_CUH

#include <math.h>

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
 * its barriers: the rows' running max and sum reset (16, or the 32-pair
 * kernel's 32), the barriers published to the block, and where the block
 * exchanges with its cluster, its arrival on the cluster barrier that the
 * first remote access waits for (states_merge, the plane kernels' exchange). */
__device__ __forceinline__ void states_start(float *st_m, float *st_l, bool cluster, int rows = 16) {
  if ((int)threadIdx.x < rows) {
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

/* The tensor-core kernels' tile: ST states, NSTG tiles in flight (the
 * warp-specialised kernels set their own); a group's key splits at most. */
enum { ST = TD_CU_STATES_TILE, NSTG = 2, STATES_MAX_SPLITS = TD_CU_STATES_MAX_SPLITS };

/* Barriers that the two warp groups reach from different code: the
 * non-aligned form (bar.sync, __syncthreads, require every thread of the
 * block at the same instruction) */
__device__ __forceinline__ void named_sync(int id) { asm volatile("barrier.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void block_sync() { asm volatile("barrier.sync 0;\n" ::: "memory"); }

/* The plane kernels' barriers, by thread 0: full[NSTG] (a stage landed),
 * pfull / pempty[2] (probabilities handed to the mix group and back),
 * xfull[2] (the other plane's sums arrived), visible to the cluster */
template <int NSTG>
__device__ __forceinline__ void states_plane_bars(uint64_t *full, uint64_t *pfull, uint64_t *pempty, uint64_t *xfull) {
  if (threadIdx.x != 0) return;
  for (int i = 0; i < NSTG; i++) mbar_init(&full[i], 1);
  for (int i = 0; i < 2; i++) {
    mbar_init(&pfull[i], 1);
    mbar_init(&pempty[i], 1);
    mbar_init(&xfull[i], 1);
  }
  fence_mbar_init_cluster();
}

/* The plane kernels' score group at a tile: its stage landed (use u of
 * stage b), the rows past nval zeroed where the tile is short (the mix
 * group reads them too) */
template <int ST, int HALF, int PAIR, int NSTG>
__device__ __forceinline__ void states_plane_tile(uint64_t *full, int b, int u, bf16 *E, int nval) {
  mbar_wait(&full[b], (unsigned)(u / NSTG) & 1u);
  if (nval < ST) {
    states_zero_tail<ST, HALF, PAIR, 1>(E, nval, threadIdx.x, 256);
    named_sync(1);
  }
}

/* ... and a thread's four columns scol of row sr summed over the four
 * plane quarters' partials (red: [quarter][rows][RST]) */
template <int ROWS, int RST>
__device__ __forceinline__ float4 states_quarter_sum(const float *red, int sr, int scol) {
  float4 v = *(const float4 *)&red[sr * RST + scol];
#pragma unroll
  for (int q = 1; q < 4; q++) {
    const float4 f = *(const float4 *)&red[((size_t)q * ROWS + sr) * RST + scol];
    v.x += f.x;
    v.y += f.y;
    v.z += f.z;
    v.w += f.w;
  }
  return v;
}

/* The plane kernels' softmax over one tile, a thread's four columns scol of
 * its row: v (this plane's partial scores) plus o (the other plane's, so
 * that both blocks add the same two numbers), scaled by rs and masked past
 * nval; TPR threads a row (a power of two, adjacent lanes). The
 * probabilities go to prow; the row's first thread updates its m and l and
 * writes its rescale factor to alpha. */
template <int TPR>
__device__ __forceinline__ void states_plane_softmax(float4 v, float4 o, float rs, int scol, int nval, float *m,
                                                     float *l, float *alpha, bf16 *prow) {
  float vv[4] = {v.x + o.x, v.y + o.y, v.z + o.z, v.w + o.w}; /* the other block adds o + v: the same */
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    vv[i] = states_perm(scol + i) < nval ? vv[i] * rs : -INFINITY;
    mx = fmaxf(mx, vv[i]);
  }
#pragma unroll
  for (int o2 = TPR / 2; o2 > 0; o2 >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o2));
  const float mo = *m, mn = fmaxf(mo, mx);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    vv[i] = mn == -INFINITY ? 0.0f : exp2f(vv[i] - mn);
    sum += vv[i];
  }
  *(uint2 *)prow = make_uint2(pack_bf16(vv[0], vv[1]), pack_bf16(vv[2], vv[3]));
#pragma unroll
  for (int o2 = TPR / 2; o2 > 0; o2 >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o2);
  if (threadIdx.x % TPR == 0) {
    const float al = mo == -INFINITY ? 0.0f : exp2f(mo - mn);
    *alpha = al;
    *l = *l * al + sum;
    *m = mn;
  }
}

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

/* A tensor-core kernel for one D (NT = D / 64) and warp count: its shared
 * memory, the kernel and its launch (a grid of clusters of `cluster`
 * blocks). Each kernel file lists its own. */
typedef struct states_cfg {
  int nt, sw;
  bool ws; /* states_ws_kernel (16 warps in two groups) */
  bool pl; /* states_pl_kernel (the same, D split over a cluster of two) */
  size_t bytes;
  const void *fn;
  void (*launch)(const td_cuda *c, dim3 grid, int cluster, const StatesArgs &a);
  int rows; /* pairs a group: 16, or 32 (states_pl32_kernel) */
} states_cfg;
enum { STATES_N_MMA = 8, STATES_N_WS = 3, STATES_N_PL = 3, STATES_N_PL32 = 1 };
extern const states_cfg td_states_mma_cfgs[STATES_N_MMA]; /* D = 512, 768, 1024, 1280 by 8 and 16 warps */
extern const states_cfg td_states_ws_cfgs[STATES_N_WS];   /* D = 512, 768, 1024 */
extern const states_cfg td_states_pl_cfgs[STATES_N_PL];
extern const states_cfg td_states_pl32_cfgs[STATES_N_PL32]; /* D = 1280 */

#endif
