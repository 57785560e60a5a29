/* Paged decode attention's shared pieces (cuda_attn_decode_warp.cu,
 * cuda_attn_decode_bulk.cu). */
#ifndef TD_KERNELS_CUDA_ATTN_DECODE_CUH
#define TD_KERNELS_CUDA_ATTN_DECODE_CUH

#include "kernels/cuda/cuda_attn.cuh"

/* Decode attention, one query per sequence, head_dim 64: SPLIT warps per
 * (sequence, head) taking interleaved 32-key chunks, their softmax states
 * merged through shared memory at the end; PAIRS pairs per block. Within a
 * chunk, lane l holds dims 8 (l % 8) .. + 8 of keys 4 i + l / 8 (i < 8),
 * so that each load instruction of the warp reads four whole 128-byte key
 * rows (with one key row a lane, every instruction touched 32 lines and
 * the kernel ran far below the DRAM rate). A key's score is summed over its
 * 8 lanes (3 shuffles), p V over the 4 lanes of a dim group (2 shuffles a dim); each
 * lane keeps its 8 dims of q in registers, so no block barrier precedes
 * the products. Online softmax over 32-key chunks in the exp2 domain. Two
 * warps a pair when the pairs fill the GPU; up to 16 when few pairs have
 * long contexts (small-batch cross-attention), where the tiled kernel
 * would split the keys over blocks and merge through global memory. With
 * static K/V (kv_static) each warp's first chunk is loaded before waiting
 * for the previous kernel, which produces only the query; with
 * kv_static_past (causal self-attention) too, the query's own key, which
 * the previous kernel wrote, read again after the wait. */
/* this lane's dims of the query (cg: dim group), scaled into the exp2
 * domain, and with a query norm by 1 / rms of the row qs of a.qn (the whole
 * warp reads it: rows of qn_dim % 8 == 0, 16-byte aligned) */
__device__ __forceinline__ void dw_load_q(float (&qf)[8], const AttnArgs &a, int qs, int h, int cg, bool live) {
  float scale_log2 = a.scale_log2;
  if (a.qn && live) {
    const float ss = td_warp_sum(td_sumsq8(a.qn + (size_t)qs * a.qn_dim, a.qn_dim, (threadIdx.x & 31) * 8, 256));
    scale_log2 *= rsqrtf(ss / (float)a.qn_dim + a.qn_eps);
  }
  td_bf16x8 qv;
  qv.u = live ? *(const uint4 *)(a.q + (size_t)qs * a.ldq + (size_t)h * 64 + cg * 8) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int t = 0; t < 4; t++) {
    float2 f = __bfloat1622float2(qv.h[t]);
    qf[2 * t] = f.x * scale_log2;
    qf[2 * t + 1] = f.y * scale_log2;
  }
}

/* A lane's 8 values of a K or V row: bf16 (uint4) or int8 (uint2, td_kv_layout.int8). */
template <bool Q8> struct DwRow { using T = uint4; };
template <> struct DwRow<true> { using T = uint2; };

__device__ __forceinline__ void dw_vals(const uint4 &u, float (&f)[8]) {
  td_bf16x8 x;
  x.u = u;
#pragma unroll
  for (int t = 0; t < 4; t++) {
    const float2 g = __bfloat1622float2(x.h[t]);
    f[2 * t] = g.x;
    f[2 * t + 1] = g.y;
  }
}
/* int8 to float without a conversion instruction: the byte, its sign bit
 * flipped, as the low mantissa bits of 2^23, less 2^23 + 128 */
__device__ __forceinline__ void dw_vals(const uint2 &u, float (&f)[8]) {
  const uint32_t w[2] = {u.x ^ 0x80808080u, u.y ^ 0x80808080u};
#pragma unroll
  for (int t = 0; t < 2; t++)
#pragma unroll
    for (int b = 0; b < 4; b++) f[4 * t + b] = __uint_as_float(__byte_perm(w[t], 0x4B000000u, 0x7540u + b)) - 8388736.0f;
}

/* Over int8 keys the query is int8 too: the lane's 8 dims (qf, already in
 * the exp2 domain) rounded to the row's largest magnitude over its 64 dims /
 * 127 (*qsc), so that a key's dot is two dp4a over its bytes, times the
 * key's scale and *qsc (the conversions of the key's bytes were half of the
 * int8 kernel's instructions). */
__device__ __forceinline__ void dw_q8(const float (&qf)[8], uint2 &qq, float &qsc) {
  float amax = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; e++) amax = fmaxf(amax, fabsf(qf[e]));
#pragma unroll
  for (int x = 1; x < 8; x <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, x)); /* the 8 dim groups */
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int e = 0; e < 8; e++)
    w[e / 4] |= (uint32_t)(uint8_t)(int8_t)max(-127, min(127, __float2int_rn(qf[e] * inv))) << (8 * (e % 4));
  qq = make_uint2(w[0], w[1]);
  qsc = amax / 127.0f;
}

/* p V over a lane's N int8 value rows: each key's weight (its probability
 * times its row's scale) rounded to 0..127 of the lane's largest in the
 * chunk, the rows' bytes transposed four keys at a time so that a dim's
 * four values share a register, and a dim's sum two dp4a a group of four
 * keys, exact in int32; the weights' scale multiplies it once. The
 * probabilities' sum (ps) stays float. */
template <int N>
__device__ __forceinline__ void dw_pv8(const uint2 (&vr)[N], const float (&vs)[N], const float (&sc)[N], float m,
                                       float &ps, float (&acc)[8]) {
  static_assert(N % 4 == 0, "int8 value rows in groups of four keys");
  float w[N], wmax = 0.0f;
#pragma unroll
  for (int i = 0; i < N; i++) {
    const float p = sc[i] == -INFINITY ? 0.0f : fast_exp2(sc[i] - m);
    ps += p;
    w[i] = p * vs[i];
    wmax = fmaxf(wmax, w[i]);
  }
  const float inv = wmax > 0.0f ? 127.0f / wmax : 0.0f;
  int dot[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
  for (int g = 0; g < N; g += 4) {
    uint32_t q = 0u;
#pragma unroll
    for (int k = 0; k < 4; k++) q |= (uint32_t)min(127, __float2int_rn(w[g + k] * inv)) << (8 * k);
#pragma unroll
    for (int half = 0; half < 2; half++) { /* dims 0-3 (.x), 4-7 (.y) */
      const uint32_t a = half ? vr[g].y : vr[g].x, b = half ? vr[g + 1].y : vr[g + 1].x;
      const uint32_t c = half ? vr[g + 2].y : vr[g + 2].x, d = half ? vr[g + 3].y : vr[g + 3].x;
      const uint32_t t0 = __byte_perm(a, b, 0x5140), t1 = __byte_perm(c, d, 0x5140); /* a0 b0 a1 b1, c0 d0 c1 d1 */
      const uint32_t t2 = __byte_perm(a, b, 0x7362), t3 = __byte_perm(c, d, 0x7362); /* a2 b2 a3 b3, c2 d2 c3 d3 */
      dot[4 * half + 0] = __dp4a((int)__byte_perm(t0, t1, 0x5410), (int)q, dot[4 * half + 0]);
      dot[4 * half + 1] = __dp4a((int)__byte_perm(t0, t1, 0x7632), (int)q, dot[4 * half + 1]);
      dot[4 * half + 2] = __dp4a((int)__byte_perm(t2, t3, 0x5410), (int)q, dot[4 * half + 2]);
      dot[4 * half + 3] = __dp4a((int)__byte_perm(t2, t3, 0x7632), (int)q, dot[4 * half + 3]);
    }
  }
  const float ws = wmax / 127.0f;
#pragma unroll
  for (int e = 0; e < 8; e++) acc[e] = ws * (float)dot[e];
}

/* One chunk of 4 N keys starting at c0 (which is below kend): lane (cg, kq)
 * holds dims 8 cg of keys c0 + 4 i + kq in kr / vr (zeros past kend; int8
 * rows with their scales ks / vs, zero past kend, and the query as dw_q8
 * gives it, qq and qsc); the online softmax state (m, l, o) advances over
 * them. */
template <int N, bool Q8, typename R>
__device__ __forceinline__ void dw_chunk_q(const R (&kr)[N], const R (&vr)[N], const float (&ks)[N],
                                           const float (&vs)[N], int c0, int kq, int kend, int qpos,
                                           const float (&qf)[8], const uint2 qq, float qsc, const float *L, int md,
                                           float &m, float &l, float (&o)[8]) {
  float sc[N];
#pragma unroll
  for (int i = 0; i < N; i++) {
    if constexpr (Q8) {
      sc[i] = (float)__dp4a((int)kr[i].y, (int)qq.y, __dp4a((int)kr[i].x, (int)qq.x, 0)); /* exact: |sum| < 2^24 */
    } else {
      float f[8];
      dw_vals(kr[i], f);
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < 8; e++) dot = fmaf(qf[e], f[e], dot);
      sc[i] = dot;
    }
  }
#pragma unroll
  for (int i = 0; i < N; i++)
#pragma unroll
    for (int x = 1; x < 8; x <<= 1) sc[i] += __shfl_xor_sync(0xffffffffu, sc[i], x);
  float cmax = -INFINITY;
#pragma unroll
  for (int i = 0; i < N; i++) {
    const int j = c0 + 4 * i + kq;
    const float d = Q8 ? sc[i] * (ks[i] * qsc) : sc[i]; /* an int8 key's and the query's scales, the whole dot */
    sc[i] = j < kend ? (L ? d + lut_at(L, md, j - qpos) * LOG2E : d) : -INFINITY;
    cmax = fmaxf(cmax, sc[i]);
  }
  cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, 8));
  cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, 16));
  /* the chunk starts below kend, so cmax is finite */
  const float alpha = m == -INFINITY ? 0.0f : fast_exp2(m - fmaxf(m, cmax));
  m = fmaxf(m, cmax);
  float ps = 0.0f, acc[8];
#pragma unroll
  for (int e = 0; e < 8; e++) acc[e] = 0.0f;
  if constexpr (Q8) {
    dw_pv8<N>(vr, vs, sc, m, ps, acc);
  } else {
#pragma unroll
    for (int i = 0; i < N; i++) {
      const float p = sc[i] == -INFINITY ? 0.0f : fast_exp2(sc[i] - m);
      ps += p;
      float f[8];
      dw_vals(vr[i], f);
#pragma unroll
      for (int e = 0; e < 8; e++) acc[e] = fmaf(p, f[e], acc[e]);
    }
  }
  ps += __shfl_xor_sync(0xffffffffu, ps, 8);
  ps += __shfl_xor_sync(0xffffffffu, ps, 16);
  l = l * alpha + ps;
#pragma unroll
  for (int e = 0; e < 8; e++) {
    acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], 8);
    acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], 16);
    o[e] = o[e] * alpha + acc[e];
  }
}

template <int N>
__device__ __forceinline__ void dw_chunk(const uint4 (&kr)[N], const uint4 (&vr)[N], int c0, int kq, int kend, int qpos,
                                         const float (&qf)[8], const float *L, int md, float &m, float &l, float (&o)[8]) {
  const float none[N] = {};
  dw_chunk_q<N, false>(kr, vr, none, none, c0, kq, kend, qpos, qf, make_uint2(0u, 0u), 0.0f, L, md, m, l, o);
}

/* kv_static_past: the query's own K/V row (nk, nv), which the kernel
 * before wrote, in place of row i of kr / vr as loaded before the wait
 * (selects: a dynamic index would put kr / vr in local memory) */
template <int N>
__device__ __forceinline__ void dw_own_row(uint4 (&kr)[N], uint4 (&vr)[N], int i, uint4 nk, uint4 nv) {
#pragma unroll
  for (int j = 0; j < N; j++) {
    kr[j] = j == i ? nk : kr[j];
    vr[j] = j == i ? nv : vr[j];
  }
}

/* The SPLIT warps of a pair merge their softmax states and write the
 * output (dst: the pair's row, this lane's dim group). Every warp writes
 * its state to shared memory (lanes 0-7: a dim group each); the first
 * warp's lanes merge warps kq, kq + 4, ... and then their four partial
 * states by shuffles: at 16 warps a pair four steps and two exchanges on
 * the critical path instead of fifteen steps. Called by every thread of
 * the block (one block barrier). */
template <int SPLIT>
__device__ __forceinline__ void dw_finish(float4 (*mrg)[8][3], int sub, int cg, int kq, float m, float l,
                                          float (&o)[8], bool live, bf16 *dst) {
  if (kq == 0) {
    float4 *d = mrg[sub][cg];
    d[0] = make_float4(o[0], o[1], o[2], o[3]);
    d[1] = make_float4(o[4], o[5], o[6], o[7]);
    d[2] = make_float4(m, l, 0.0f, 0.0f);
  }
  __syncthreads();
  if (sub > 0) return;
  auto join = [&](float om, float ol, const float (&oo)[8]) {
    const float nm = fmaxf(m, om);
    const float a0 = m == -INFINITY ? 0.0f : fast_exp2(m - nm), a1 = om == -INFINITY ? 0.0f : fast_exp2(om - nm);
    l = l * a0 + ol * a1;
#pragma unroll
    for (int e = 0; e < 8; e++) o[e] = o[e] * a0 + oo[e] * a1;
    m = nm;
  };
  m = -INFINITY;
  l = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; e++) o[e] = 0.0f;
#pragma unroll
  for (int w = 0; w < SPLIT; w += 4) {
    if (w + kq < SPLIT) {
      const float4 *d = mrg[w + kq][cg];
      const float4 x0 = d[0], x1 = d[1], x2 = d[2];
      const float oo[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
      join(x2.x, x2.y, oo);
    }
  }
#pragma unroll
  for (int x = 8; x < 32; x <<= 1) {
    float oo[8];
#pragma unroll
    for (int e = 0; e < 8; e++) oo[e] = __shfl_xor_sync(0xffffffffu, o[e], x);
    const float om = __shfl_xor_sync(0xffffffffu, m, x), ol = __shfl_xor_sync(0xffffffffu, l, x);
    join(om, ol, oo);
  }
  if (!live || kq != 0) return;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  td_bf16x8 ov;
#pragma unroll
  for (int t = 0; t < 4; t++) ov.h[t] = __floats2bfloat162_rn(o[2 * t] * inv, o[2 * t + 1] * inv);
  *(uint4 *)dst = ov.u;
}

/* A decode pair's sequence bounds: the query row qs, its position qpos and
 * the keys it sees (kend); live is false for padding rows. */
__device__ __forceinline__ bool dw_bounds(const AttnArgs &a, int s, int &qs, int &qpos, int &kend) {
  qs = qpos = kend = 0;
  if (s >= a.n_seqs) return false;
  qs = a.q_start[s];
  const int qlen = min(a.q_start[s + 1], a.n_tokens) - qs;
  const bool live = qs >= 0 && qlen > 0;
  const int ctx = a.ctx_len[s], nk = min(max(ctx, 0), a.max_blocks * a.bs);
  qpos = ctx - qlen; /* the sequence's one query (host bound max_q == 1) */
  kend = live ? (a.causal ? min(nk, qpos + 1) : nk) : 0;
  return live;
}

#endif
