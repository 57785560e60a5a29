/* Paged decode attention on warps (cuda_attn_decode.cuh describes it). */
#include "kernels/cuda/cuda_attn_decode.cuh"

/* at most 128 registers: two blocks of 8 warps an SM. Q8: int8 K/V rows
 * with their scales (td_kv_layout.int8; static cross K/V only). */
template <int SPLIT, int PAIRS, bool EARLY, bool Q8>
__global__ void __launch_bounds__(32 * SPLIT * PAIRS, 512 / (32 * SPLIT * PAIRS)) attn_decode_warp_kernel(const AttnArgs a) {
  static_assert(SPLIT >= 2 && SPLIT * PAIRS <= 16, "warps per block");
  __shared__ float4 mrg[PAIRS][SPLIT][8][3]; /* per warp and dim group: o[8], then m, l */
  constexpr bool early = EARLY; /* kv_static: the first chunk loads before the wait */
  if (!early) td_pdl_start_if(a.pdl_late);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, H = a.H;
  const int cg = lane & 7, kq = lane >> 3; /* dim group, key within four */
  const int pw = warp % PAIRS, sub = warp / PAIRS; /* which pair, which of its chunk streams */
  const long gp = (long)blockIdx.x * PAIRS + pw;
  const int s = (int)(gp / H), h = (int)(gp % H);
  int qs, qpos, kend;
  const bool live = dw_bounds(a, s, qs, qpos, kend);
  const int32_t *table = live ? a.block_table + (size_t)s * a.max_blocks : a.block_table;
  const float *L = a.lut ? a.lut + (size_t)h * (2 * a.md + 1) : nullptr;
  const size_t vstride = (size_t)H * a.bs * 64;
  const bf16 *head = a.pool + a.layer_off + (size_t)h * a.bs * 64 + cg * 8;
  /* int8: a layer is [K|V][head][slot] rows of 64 bytes (a plane of vstride
   * bytes), then [K|V][head][slot] float scales */
  const char *lay8 = (const char *)(a.pool + a.layer_off);
  const size_t bbytes = a.block_elems * sizeof(bf16), hrow = (size_t)h * a.bs;
  using R = typename DwRow<Q8>::T;
  R kr[8], vr[8];
  float ks[8], vs[8];
  auto key_at = [&](int j) { return head + (size_t)table[j / a.bs] * a.block_elems + (size_t)(j % a.bs) * 64; };
  auto load = [&](int c0) {
    int j = c0 + kq, b = j / a.bs, r = j % a.bs; /* key 4 i + kq: block b, row r */
#pragma unroll
    for (int i = 0; i < 8; i++) {
      if constexpr (Q8) {
        if (j < kend) {
          const char *bp = lay8 + (size_t)table[b] * bbytes, *kp = bp + (hrow + r) * 64 + cg * 8;
          kr[i] = *(const uint2 *)kp;
          vr[i] = *(const uint2 *)(kp + vstride);
          const float *sp = (const float *)(bp + 2 * vstride) + hrow + r;
          ks[i] = sp[0];
          vs[i] = sp[(size_t)H * a.bs];
        } else {
          kr[i] = vr[i] = make_uint2(0u, 0u);
          ks[i] = vs[i] = 0.0f;
        }
      } else if (j < kend) {
        const bf16 *kp = head + (size_t)table[b] * a.block_elems + (size_t)r * 64;
        kr[i] = *(const uint4 *)kp;
        vr[i] = *(const uint4 *)(kp + vstride);
      } else {
        kr[i] = vr[i] = make_uint4(0u, 0u, 0u, 0u);
      }
      j += 4;
      r += 4;
      while (r >= a.bs) {
        r -= a.bs;
        b++;
      }
    }
  };
  if (early) {
    load(sub * 32);
    td_pdl_start_if(a.pdl_late);
    /* kv_static_past: the query's own key was just written; read it again
     * (int8 pools are static cross K/V: none) */
    if constexpr (!Q8) {
      const int d = qpos - sub * 32;
      if (!a.kv_static && d >= 0 && d < 32 && (d & 3) == kq && qpos < kend) {
        const bf16 *kp = key_at(qpos);
        dw_own_row(kr, vr, d >> 2, *(const uint4 *)kp, *(const uint4 *)(kp + vstride));
      }
    }
  }
  float qf[8], qsc = 0.0f;
  dw_load_q(qf, a, qs, h, cg, live);
  uint2 qq = make_uint2(0u, 0u);
  if constexpr (Q8) dw_q8(qf, qq, qsc);
  float m = -INFINITY, l = 0.0f, o[8];
#pragma unroll
  for (int e = 0; e < 8; e++) o[e] = 0.0f;
  for (int c0 = sub * 32; c0 < kend; c0 += 32 * SPLIT) {
    if (!early || c0 != sub * 32) load(c0);
    dw_chunk_q<8, Q8>(kr, vr, ks, vs, c0, kq, kend, qpos, qf, qq, qsc, L, a.md, m, l, o);
  }
  dw_finish<SPLIT>(mrg[pw], sub, cg, kq, m, l, o, live, a.out + ((size_t)qs * H + h) * 64 + cg * 8);
}

/* decode warp kernel: PAIRS (sequence, head) pairs a block */
template <int SPLIT, int PAIRS>
static void launch_dw(const td_cuda *c, bool kv_static, long pairs, const AttnArgs &a) {
  unsigned blocks = (unsigned)((pairs + PAIRS - 1) / PAIRS);
  if (a.kv8)
    (void)td_launch(c, kv_static ? attn_decode_warp_kernel<SPLIT, PAIRS, true, true>
                                 : attn_decode_warp_kernel<SPLIT, PAIRS, false, true>,
                    blocks, 32 * SPLIT * PAIRS, 0, a);
  else
    (void)td_launch(c, kv_static ? attn_decode_warp_kernel<SPLIT, PAIRS, true, false>
                                 : attn_decode_warp_kernel<SPLIT, PAIRS, false, false>,
                    blocks, 32 * SPLIT * PAIRS, 0, a);
}

void td_cu_attn_decode_warp(const td_cuda *c, td_paged_kernel k, bool early, long pairs, const AttnArgs &a) {
  if (k == TD_PAGED_W2P4) launch_dw<2, 4>(c, early, pairs, a);
  else if (k == TD_PAGED_W4P2) launch_dw<4, 2>(c, early, pairs, a);
  else if (k == TD_PAGED_W8) launch_dw<8, 1>(c, early, pairs, a);
  else launch_dw<16, 1>(c, early, pairs, a);
}
