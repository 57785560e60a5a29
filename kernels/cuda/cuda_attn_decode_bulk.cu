/* Decode attention fed by bulk copies (the TMA engine), for many pairs
 * over long static contexts (cross-attention at large batch): one
 * (sequence, head) pair a block of W warps; warp w takes the key stages
 * w, w + W, ... of BULK_NK keys, each warp with NS stages in flight in
 * its own NS slots and mbarriers (no block barrier before the merge).
 * A stage's K and V rows of a paged block are one contiguous copy each
 * (one 2 KB copy at block size 16), faster than the tiled kernel's 16-byte
 * cp.async gathers (docs/cuda.md, "Decode by bulk copies"). With static
 * K/V (kv_static), or the keys before the query (kv_static_past, causal),
 * the first stages are requested before waiting for the query. */
#include "kernels/cuda/cuda_attn_decode.cuh"

enum { BULK_NK = 16 };

template <int W, int NS, bool EARLY, bool Q8>
__global__ void __launch_bounds__(32 * W) attn_decode_bulk_kernel(const AttnArgs a) {
  static_assert(W >= 2 && W <= 4 && NS >= 2, "bulk decode attention shape");
  /* a stage: NK K rows, NK V rows (bf16: 128 bytes a row; int8: 64), then,
   * int8, the K and V rows' scales. int8 stages hold twice the keys, so
   * that a warp's copies in flight carry as many bytes as bf16's: at half
   * the bytes a key, 16 keys a stage took as long as bf16's stages */
  constexpr int NK = Q8 ? 2 * BULK_NK : BULK_NK;
  constexpr int ROW = Q8 ? 64 : 128, SC = 2 * NK * ROW, STAGE = SC + (Q8 ? 2 * NK * 4 : 0);
  __shared__ __align__(128) char ring[W][NS][STAGE];
  __shared__ uint64_t bar[W][NS];
  __shared__ float4 mrg[W][8][3];
  if (!EARLY) td_pdl_start_if(a.pdl_late);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, H = a.H;
  const int cg = lane & 7, kq = lane >> 3;
  const int s = (int)(blockIdx.x / (unsigned)H), h = (int)(blockIdx.x % (unsigned)H);
  int qs, qpos, kend;
  const bool live = dw_bounds(a, s, qs, qpos, kend);
  const int32_t *table = live ? a.block_table + (size_t)s * a.max_blocks : a.block_table;
  const float *L = a.lut ? a.lut + (size_t)h * (2 * a.md + 1) : nullptr;
  /* a plane: H x bs rows, in elements (bf16) or bytes (int8): the same count */
  const size_t vstride = (size_t)H * a.bs * 64;
  const bf16 *head = a.pool + a.layer_off + (size_t)h * a.bs * 64;
  const char *lay8 = (const char *)(a.pool + a.layer_off);
  const size_t bbytes = a.block_elems * sizeof(bf16), hrow = (size_t)h * a.bs;
  const int nst = (kend + NK - 1) / NK;
  if (lane == 0)
    for (int i = 0; i < NS; i++) mbar_init(&bar[warp][i], 1);
  __syncwarp();
  /* lane 0: stage t's K and V rows into the slot, one copy per paged block
   * (int8: and their scales, whole 16-byte groups of 4: the block's slots
   * come in fours); read once a step, so evicted from L2 first
   * (docs/cuda.md, "Decode by bulk copies") */
  const uint64_t pol = l2_evict_first();
  auto issue = [&](int t, int slot) {
    const int k0 = t * NK, k1 = min(k0 + NK, kend);
    char *st = ring[warp][slot];
    uint32_t tx = (uint32_t)(k1 - k0) * 2u * ROW;
    /* braces: nvcc dropped the statement after an unbraced if constexpr's loop */
    if constexpr (Q8) {
      for (int j = k0; j < k1;) {
        const int r = j % a.bs, n = min(a.bs - r, k1 - j);
        tx += 2u * (uint32_t)((n + 3) & ~3) * 4u;
        j += n;
      }
    }
    mbar_arrive_tx(&bar[warp][slot], tx);
    for (int j = k0; j < k1;) {
      const int b = j / a.bs, r = j - b * a.bs, n = min(a.bs - r, k1 - j);
      if constexpr (Q8) {
        const char *bp = lay8 + (size_t)table[b] * bbytes, *src = bp + (hrow + r) * 64;
        bulk_g2s_hint(st + (j - k0) * 64, src, (uint32_t)n * 64u, &bar[warp][slot], pol);
        bulk_g2s_hint(st + NK * 64 + (j - k0) * 64, src + vstride, (uint32_t)n * 64u, &bar[warp][slot], pol);
        const float *sp = (const float *)(bp + 2 * vstride) + hrow + r;
        const uint32_t sb = (uint32_t)((n + 3) & ~3) * 4u;
        bulk_g2s_hint(st + SC + (j - k0) * 4, sp, sb, &bar[warp][slot], pol);
        bulk_g2s_hint(st + SC + NK * 4 + (j - k0) * 4, sp + (size_t)H * a.bs, sb, &bar[warp][slot], pol);
      } else {
        const bf16 *src = head + (size_t)table[b] * a.block_elems + (size_t)r * 64;
        bulk_g2s_hint(st + (j - k0) * 128, src, (uint32_t)n * 128u, &bar[warp][slot], pol);
        bulk_g2s_hint(st + NK * 128 + (j - k0) * 128, src + vstride, (uint32_t)n * 128u, &bar[warp][slot], pol);
      }
      j += n;
    }
  };
  if (lane == 0)
    for (int i = 0; i < NS && warp + i * W < nst; i++) issue(warp + i * W, i);
  if (EARLY) td_pdl_start_if(a.pdl_late);
  float qf[8], qsc = 0.0f;
  dw_load_q(qf, a, qs, h, cg, live);
  uint2 qq = make_uint2(0u, 0u);
  if constexpr (Q8) dw_q8(qf, qq, qsc);
  /* kv_static_past: the stage copied before the wait may hold a stale row
   * at the query's own position; the lanes that hold that row read it again
   * (int8 pools are static cross K/V: never) */
  const int qt = qpos / NK;
  const bool fix = !Q8 && EARLY && !a.kv_static && qpos < kend && qt < nst && qt % W == warp && (qpos & 3) == kq;
  uint4 nk = make_uint4(0u, 0u, 0u, 0u), nv = nk;
  if (fix) { /* requested now, used when its stage arrives */
    const bf16 *kp = head + (size_t)table[qpos / a.bs] * a.block_elems + (size_t)(qpos % a.bs) * 64 + cg * 8;
    nk = *(const uint4 *)kp;
    nv = *(const uint4 *)(kp + vstride);
  }
  float m = -INFINITY, l = 0.0f, o[8];
#pragma unroll
  for (int e = 0; e < 8; e++) o[e] = 0.0f;
  using R = typename DwRow<Q8>::T;
  for (int t = warp, use = 0, slot = 0; t < nst; t += W, use++, slot = slot + 1 == NS ? 0 : slot + 1) {
    const int c0 = t * NK;
    mbar_wait(&bar[warp][slot], (unsigned)(use / NS) & 1u);
    const char *st = ring[warp][slot];
    R kr[NK / 4], vr[NK / 4];
    float ks[NK / 4], vs[NK / 4];
#pragma unroll
    for (int i = 0; i < NK / 4; i++) {
      const int r = 4 * i + kq;
      const bool in = c0 + r < kend; /* rows past kend were not copied */
      const char *kp = st + r * ROW + cg * 8 * (ROW / 64);
      if constexpr (Q8) {
        kr[i] = in ? *(const uint2 *)kp : make_uint2(0u, 0u);
        vr[i] = in ? *(const uint2 *)(kp + NK * ROW) : make_uint2(0u, 0u);
        ks[i] = in ? ((const float *)(st + SC))[r] : 0.0f;
        vs[i] = in ? ((const float *)(st + SC))[NK + r] : 0.0f;
      } else {
        kr[i] = in ? *(const uint4 *)kp : make_uint4(0u, 0u, 0u, 0u);
        vr[i] = in ? *(const uint4 *)(kp + NK * ROW) : make_uint4(0u, 0u, 0u, 0u);
        ks[i] = vs[i] = 0.0f;
      }
    }
    if constexpr (!Q8) {
      if (fix && t == qt) dw_own_row(kr, vr, (qpos - c0) >> 2, nk, nv);
    }
    __syncwarp();
    if (lane == 0 && t + NS * W < nst) {
      fence_proxy_async(); /* the lanes' reads of the slot before the copy engine's writes */
      issue(t + NS * W, slot);
    }
    dw_chunk_q<NK / 4, Q8>(kr, vr, ks, vs, c0, kq, kend, qpos, qf, qq, qsc, L, a.md, m, l, o);
  }
  dw_finish<W>(mrg, warp, cg, kq, m, l, o, live, a.out + ((size_t)qs * H + h) * 64 + cg * 8);
}

/* bulk-copy decode attention: a pair a block; two warps (16 KB of slots,
 * eight blocks an SM) when the pairs would not all be resident with four
 * (32 KB, six an SM), so that they run in one wave (the tuning's
 * decode_bulk_shape picks one: 1 four warps x 2 slots, 2 two x 2, 3 two x 3) */
template <int W, int NS>
static void launch_bulk_as(const td_cuda *c, bool early, long pairs, int carveout, const AttnArgs &a) {
  if (a.kv8)
    (void)td_launch_ex(c, 0, carveout,
                       early ? attn_decode_bulk_kernel<W, NS, true, true> : attn_decode_bulk_kernel<W, NS, false, true>,
                       (unsigned)pairs, 32 * W, 0, a);
  else
    (void)td_launch_ex(c, 0, carveout,
                       early ? attn_decode_bulk_kernel<W, NS, true, false> : attn_decode_bulk_kernel<W, NS, false, false>,
                       (unsigned)pairs, 32 * W, 0, a);
}

void td_cu_attn_decode_bulk(const td_cuda *c, const td_paged_plan &p, long pairs, const AttnArgs &a) {
  if (p.bulk_warps == 2 && p.bulk_slots == 2) launch_bulk_as<2, 2>(c, p.early, pairs, p.carve, a);
  else if (p.bulk_warps == 2) launch_bulk_as<2, 3>(c, p.early, pairs, p.carve, a);
  else launch_bulk_as<4, 2>(c, p.early, pairs, p.carve, a);
}
