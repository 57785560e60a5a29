/* Attention on tensor cores (mma.sync m16n8k16 bf16, float32 accumulation,
 * online softmax in the exp2 domain), FlashAttention-2 style:
 *
 *  - dense: packed variable-length sequences (cu_seqlens), 128 query rows
 *    per block for head_dim 64 (8 warps x 16 rows; 64 for head_dim 128),
 *    K/V tiles of 64 keys in a cp.async pipeline; ceil(max_len / rows)
 *    blocks per sequence, those past its real length exit at once.
 *  - paged: queries of a sequence (16 rows per block) over K/V gathered from
 *    paged blocks through the block table, 3 cp.async stages; the 4 warps
 *    split each 64-key tile and merge their softmax states at the end, so
 *    decode (1 query row) keeps every warp loading. When few blocks would
 *    run, the keys are split over gridDim.z (flash-decoding); the last
 *    block of each (query tile, head) to finish (arrival counter) merges
 *    the partials by their log-sum-exp. Real lengths come from device
 *    ctx_len / q_start: the grid is sized from the host bounds max_q /
 *    max_ctx, and blocks beyond what the real lengths need exit at once.
 *
 * The T5 relative bias is looked up per score from the head's LUT (copied
 * to shared memory), never materialised. head_dim 64 and 128 take these
 * kernels; other head sizes or unaligned buffers take a simple warp-per-row
 * kernel with the same semantics. */
#include <math.h>

#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/cuda_ptx.cuh"

#define LOG2E 1.4426950408889634f
/* The bias table goes to shared memory pre-scaled by log2(e) and padded
 * with LUT_PAD saturated entries each side, so that a row's keys of a tile
 * read it from one clamped start without per-key checks; a second copy
 * shifted by one entry lets every row read key pairs as aligned float2. */
enum { LUT_CAP = 1024, BN = 64, LUT_PAD = 64 };

struct AttnArgs {
  int H;
  float scale_log2; /* scale * log2(e) */
  const float *lut; /* relative bias table, NULL without */
  int md;
  int causal;
  bf16 *out;
  int n_tokens;
  /* dense */
  const bf16 *qkv;
  const int32_t *cu;
  int n_seqs;
  /* paged */
  const bf16 *q;
  int ldq;
  const bf16 *pool;
  size_t block_elems, layer_off;
  int bs;
  const int32_t *q_start, *ctx_len, *block_table;
  int max_blocks;
  int qtiles; /* query tiles per sequence (generic kernel: query rows per sequence) */
  int n_splits;
  float *part_o, *part_lse;
  int *counters; /* split-KV arrival counters, one per (query tile, head) */
  int kv_static;  /* paged: K/V and metadata may be read before the previous kernel ends */
  int kv_past;    /* paged: so may the metadata and the K/V before each sequence's query (decode warp kernel) */
  int pdl_late;   /* decode warp kernel: trigger the next launch after the wait */
  const bf16 *qn; /* decode warp and bulk kernels: rows whose 1 / rms scales q (td_paged_meta.q_norm), or NULL */
  int qn_dim;
  float qn_eps;
};

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float lut_at(const float *L, int md, int rel) {
  rel = rel < -md ? -md : rel > md ? md : rel;
  return L[rel + md];
}

/* ------------------------------------------------------------ tiled kernel */

/* Tile configurations: head size, warps along queries (WM) and keys (WN),
 * cp.async stages, blocks per SM the registers must allow. */
template <int DH, int WM, int WN, int STAGES, int MINB, bool PAGED, bool WG>
struct Cfg {};
typedef Cfg<64, 8, 1, 3, 2, false, true> Dense64w;  /* 128 query rows, wgmma (two warpgroups) */
typedef Cfg<64, 8, 1, 3, 2, false, false> Dense64;  /* 128 rows, mma.sync (td_cuda_tuning.dense64_warps 8) */
typedef Cfg<64, 4, 1, 2, 3, false, false> Dense64s; /* 64 rows (dense64_warps 4) */
typedef Cfg<128, 4, 1, 2, 2, false, false> Dense128;
typedef Cfg<64, 1, 4, 2, 4, true, false> Paged64;
typedef Cfg<128, 1, 4, 3, 2, true, false> Paged128;

/* wgmma variant: K/V tiles of 64 x 64 in the 128-byte swizzle (8 KiB,
 * 1024-byte aligned, after an alignment pad), then Q and the bias table */
enum { WG_TILE = BN * 64 * 2, WG_PAD = 1024 };

template <int DH, int WM, int WN, int STAGES, int MINB, bool PAGED, bool WG>
__host__ __device__ constexpr size_t attn_smem_base(Cfg<DH, WM, WN, STAGES, MINB, PAGED, WG>) {
  return WG ? (size_t)WG_PAD + 2 * STAGES * WG_TILE + (size_t)16 * WM * (DH + 8) * sizeof(bf16)
            : (size_t)(16 * WM + 2 * STAGES * BN) * (DH + 8) * sizeof(bf16);
}

template <int DH, int WM, int WN, int STAGES, int MINB, bool PAGED, bool WG>
__global__ void __launch_bounds__(32 * WM * WN, MINB) attn_kernel(const AttnArgs a) {
  /* static K/V (cross-attention): the first tiles stream in before waiting
   * for the previous kernel, which produces only Q */
  const bool early = PAGED && a.kv_static;
  if (!early) td_pdl_start();
  constexpr int BM = 16 * WM, SROW = DH + 8, NTH = 32 * WM * WN;
  constexpr int KW = BN / WN; /* keys per warp per tile */
  constexpr int NT = KW / 8;  /* n8 tiles of S per warp */
  constexpr int KS = KW / 16; /* k16 steps of P.V per warp */
  constexpr int DT = DH / 8;  /* n8 tiles of O */
  constexpr int DK = DH / 16; /* k16 steps of Q.K */
  constexpr int CH = DH / 8;  /* 16-byte chunks per row */
  static_assert(WM == 1 || WN == 1, "warps split queries or keys");
  static_assert(!WG || (DH == 64 && WN == 1 && WM % 4 == 0 && !PAGED), "wgmma: dense, head_dim 64, warpgroups of rows");
  __shared__ int is_last;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16 *Qs, *Ks, *Vs;
  float *lut_s;
  constexpr int KVST = WG ? BN * 64 : BN * SROW; /* elements per K or V stage */
  if (WG) { /* swizzled 64 x 64 K/V tiles first, 1024-byte aligned in the shared window */
    Ks = (bf16 *)(smem_raw + ((WG_PAD - (smem_u32(smem_raw) & (WG_PAD - 1))) & (WG_PAD - 1)));
    Vs = Ks + STAGES * KVST;
    Qs = Vs + STAGES * KVST;
    lut_s = (float *)(Qs + BM * SROW);
  } else {
    Qs = (bf16 *)smem_raw;
    Ks = Qs + BM * SROW;
    Vs = Ks + STAGES * BN * SROW;
    lut_s = (float *)(Vs + STAGES * BN * SROW);
  }
  /* row r, 16-byte chunk cc of a K/V tile */
  auto kv_at = [](int r, int cc) { return WG ? r * 64 + ((cc ^ (r & 7)) << 3) : r * SROW + cc * 8; };

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WN, wn = warp % WN;
  const int g = lane >> 2, t4 = lane & 3;
  const int h = blockIdx.y, H = a.H;

  /* ---- what this block computes */
  int qlen, q0, pos_off, kbeg, kend, eff = 1;
  size_t row0;
  const int32_t *table = nullptr;
  if (!PAGED) {
    int s = blockIdx.x / a.qtiles, start = a.cu[s];
    q0 = (blockIdx.x % a.qtiles) * BM;
    qlen = min(a.cu[s + 1], a.n_tokens) - start;
    if (start < 0 || q0 >= qlen) return;
    row0 = (size_t)start;
    pos_off = 0;
    kbeg = 0;
    kend = a.causal ? min(qlen, q0 + BM) : qlen;
  } else {
    int s = blockIdx.x / a.qtiles;
    q0 = (blockIdx.x % a.qtiles) * BM;
    int qs = a.q_start[s];
    qlen = min(a.q_start[s + 1], a.n_tokens) - qs;
    if (qs < 0 || q0 >= qlen) return;
    row0 = (size_t)qs;
    int ctx = a.ctx_len[s];
    int nk = min(max(ctx, 0), a.max_blocks * a.bs);
    pos_off = ctx - qlen;
    int kmax = a.causal ? min(nk, max(pos_off + min(q0 + BM, qlen), 0)) : nk;
    /* splits actually used: no more than the real keys need (the host
     * sized the grid from bounds) */
    eff = min(a.n_splits, max(1, (kmax + BN - 1) / BN));
    if ((int)blockIdx.z >= eff) return;
    int chunk = ((kmax + eff - 1) / eff + BN - 1) / BN * BN;
    kbeg = blockIdx.z * chunk;
    kend = min(kmax, kbeg + chunk);
    table = a.block_table + (size_t)s * a.max_blocks;
  }
  const int n_tiles = kend > kbeg ? (kend - kbeg + BN - 1) / BN : 0;
  const size_t qkv_row = (size_t)3 * H * DH;

  /* ---- relative bias table of this head */
  const float *L = nullptr; /* global table when too large for shared memory */
  const int md = a.md;
  const int lut_n = 2 * md + 1 + 2 * LUT_PAD, lut_n2 = (lut_n + 1) & ~1; /* entries; second copy's offset */
  const bool lut_sh = a.lut && lut_n <= LUT_CAP;
  if (a.lut) {
    const float *src = a.lut + (size_t)h * (2 * md + 1);
    if (lut_sh) {
      if (n_tiles > 0)
        for (int i = tid; i < lut_n2 + lut_n; i += NTH) {
          int k = i < lut_n ? i : i < lut_n2 ? lut_n - 1 : i - lut_n2 + 1;
          lut_s[i] = src[min(max(k - LUT_PAD, 0), 2 * md)] * LOG2E;
        }
    } else {
      L = src;
    }
  }

  /* ---- loads (none for an empty split) */
  auto load_q = [&]() {
    for (int c = tid; c < (n_tiles > 0 ? BM * CH : 0); c += NTH) {
      int r = c / CH, cc = c % CH, qi = q0 + r;
      bool v = qi < qlen;
      size_t row = row0 + (v ? qi : 0);
      const bf16 *src =
          PAGED ? a.q + row * a.ldq + (size_t)h * DH + cc * 8 : a.qkv + row * qkv_row + (size_t)h * DH + cc * 8;
      cp_async16(Qs + r * SROW + cc * 8, src, v);
    }
  };
  /* dense: this thread's K rows advance by BN rows a tile (NTH is a multiple of CH) */
  const bf16 *kdense = PAGED ? nullptr : a.qkv + (row0 + kbeg + tid / CH) * qkv_row + (size_t)(H + h) * DH + (tid % CH) * 8;
  auto load_kv = [&](int kt, int st) {
    int key0 = kbeg + kt * BN;
    bf16 *ks = Ks + st * KVST, *vs = Vs + st * KVST;
    if (!PAGED) {
      const bf16 *kp = kdense + (size_t)kt * BN * qkv_row;
#pragma unroll
      for (int i = 0; i < BN * CH / NTH; i++) {
        int r = tid / CH + i * (NTH / CH);
        bool v = key0 + r < kend;
        const bf16 *src = v ? kp + (size_t)i * (NTH / CH) * qkv_row : a.qkv;
        cp_async16(ks + kv_at(r, tid % CH), src, v);
        cp_async16(vs + kv_at(r, tid % CH), v ? src + (size_t)H * DH : a.qkv, v);
      }
    } else { /* paged: each row through the block table */
      for (int c = tid; c < BN * CH; c += NTH) {
        int r = c / CH, cc = c % CH, j = key0 + r;
        bool v = j < kend;
        int jj = v ? j : kbeg;
        int blk = table[jj / a.bs];
        const bf16 *kp =
            a.pool + (size_t)blk * a.block_elems + a.layer_off + ((size_t)h * a.bs + jj % a.bs) * DH + cc * 8;
        cp_async16(ks + r * SROW + cc * 8, kp, v);
        cp_async16(vs + r * SROW + cc * 8, kp + (size_t)H * a.bs * DH, v);
      }
    }
  };
  if (early) {
    /* groups 0 .. STAGES-2: tiles; then Q after the wait (the loop's first
     * iteration waits for everything) */
#pragma unroll
    for (int st = 0; st < STAGES - 1; st++) {
      if (st < n_tiles) load_kv(st, st);
      cp_async_commit();
    }
    td_pdl_start();
    load_q();
    cp_async_commit();
  } else {
    load_q();
    if (n_tiles > 0) load_kv(0, 0);
    cp_async_commit(); /* group 0: Q and tile 0 */
#pragma unroll
    for (int st = 1; st < STAGES - 1; st++) {
      if (st < n_tiles) load_kv(st, st);
      cp_async_commit();
    }
  }

  float o[DT][4];
#pragma unroll
  for (int d = 0; d < DT; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};
  int qpos_r[2];
  qpos_r[0] = pos_off + q0 + wm * 16 + g;
  qpos_r[1] = qpos_r[0] + 8;
  const int qpos_min = pos_off + q0;
  uint32_t qf[DK][4];

  for (int kt = 0; kt < n_tiles; kt++) {
    if (early && kt == 0) cp_async_wait<0>();
    else cp_async_wait<STAGES - 2>();
    if (WG) fence_proxy_async();
    __syncthreads();
    if (kt + STAGES - 1 < n_tiles) load_kv(kt + STAGES - 1, (kt + STAGES - 1) % STAGES);
    cp_async_commit();
    /* wgmma: reloaded per tile (ptxas does not keep register A operands
     * that are only conditionally loaded live across the loop) */
    if (WG || kt == 0) {
#pragma unroll
      for (int dk = 0; dk < DK; dk++)
        ldsm_x4(qf[dk][0], qf[dk][1], qf[dk][2], qf[dk][3],
                Qs + (wm * 16 + (lane & 15)) * SROW + dk * 16 + (lane >> 4) * 8);
    }
    const bf16 *ks = Ks + (kt % STAGES) * KVST, *vs = Vs + (kt % STAGES) * KVST;

    /* S = Q K^T for this warp's keys */
    float sc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
    if (WG) {
      float(&s32)[32] = *reinterpret_cast<float(*)[32]>(&sc[0][0]);
      wg_hold(s32);
      wg_hold(qf);
      wg_fence();
#pragma unroll
      for (int dk = 0; dk < DK; dk++) wgmma64_rs<0>(s32, qf[dk], wg_desc_sw128(ks + dk * 16, 16, 1024), 1);
      wg_commit();
      wg_wait<0>();
      wg_hold(s32);
    }
#pragma unroll
    for (int dk = 0; dk < (WG ? 0 : DK); dk++) {
#pragma unroll
      for (int jn = 0; jn < NT / 2; jn++) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4(b0, b1, b2, b3,
                ks + (wn * KW + jn * 16 + (lane & 7) + ((lane >> 4) << 3)) * SROW + dk * 16 + ((lane >> 3) & 1) * 8);
        mma16816(sc[2 * jn], qf[dk], b0, b1);
        mma16816(sc[2 * jn + 1], qf[dk], b2, b3);
      }
    }

    /* scale, bias, masks (log2 domain) */
    const int tile0 = kbeg + kt * BN, key0 = tile0 + wn * KW;
    const bool need_mask = tile0 + BN > kend || (a.causal && tile0 + BN - 1 > qpos_min);
    /* bias of row r at key key0 + 8 j + 2 t4 + e: brow[r][8 j + e]. The
     * start is clamped into the padding, which holds the saturated values
     * (a row's offsets stay below LUT_PAD), and taken from the copy where
     * it is even, so each key pair is one float2 load. */
    if (lut_sh) {
      const float *brow[2];
#pragma unroll
      for (int r = 0; r < 2; r++) {
        int st = min(max(key0 + 2 * t4 - qpos_r[r] + md + LUT_PAD, 0), 2 * md + LUT_PAD + 1);
        brow[r] = (st & 1) ? lut_s + lut_n2 + st - 1 : lut_s + st;
      }
#pragma unroll
      for (int j = 0; j < NT; j++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
          float2 b = *(const float2 *)(brow[r] + j * 8);
          sc[j][2 * r] = fmaf(sc[j][2 * r], a.scale_log2, b.x);
          sc[j][2 * r + 1] = fmaf(sc[j][2 * r + 1], a.scale_log2, b.y);
        }
    } else if (L) {
#pragma unroll
      for (int j = 0; j < NT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          sc[j][e] = fmaf(sc[j][e], a.scale_log2, lut_at(L, md, key0 + j * 8 + 2 * t4 + (e & 1) - qpos_r[e >> 1]) * LOG2E);
    } else {
#pragma unroll
      for (int j = 0; j < NT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) sc[j][e] *= a.scale_log2;
    }
    /* block-uniform: only the tiles that cross an end; a per-row key limit
     * (one compare per score), and a branch rather than predicated code
     * that every tile would pay for */
    if (__builtin_expect(need_mask, 0)) {
      int lim[2];
#pragma unroll
      for (int r = 0; r < 2; r++) lim[r] = (a.causal ? min(kend, qpos_r[r] + 1) : kend) - (key0 + 2 * t4);
#pragma unroll
      for (int j = 0; j < NT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          if (j * 8 + (e & 1) >= lim[e >> 1]) sc[j][e] = -INFINITY;
    }

    /* online softmax; a thread holds rows g and g+8, a quad shares a row */
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
      float mx = m_r[r];
#pragma unroll
      for (int j = 0; j < NT; j++) mx = fmaxf(mx, fmaxf(sc[j][2 * r], sc[j][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      float mu = mx == -INFINITY ? 0.0f : mx;
      alpha[r] = fast_exp2(m_r[r] - mu);
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < NT; j++) {
        float p0 = fast_exp2(sc[j][2 * r] - mu), p1 = fast_exp2(sc[j][2 * r + 1] - mu);
        sc[j][2 * r] = p0;
        sc[j][2 * r + 1] = p1;
        sum += p0 + p1;
      }
      l_r[r] = l_r[r] * alpha[r] + sum;
      m_r[r] = mx;
    }
    /* once the row maxima settle, alpha is 1: skip the rescale */
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
      for (int d = 0; d < DT; d++) {
        o[d][0] *= alpha[0];
        o[d][1] *= alpha[0];
        o[d][2] *= alpha[1];
        o[d][3] *= alpha[1];
      }
    }

    /* O += P V */
    if (WG) {
      uint32_t pa[KS][4];
#pragma unroll
      for (int kk = 0; kk < KS; kk++) {
        pa[kk][0] = pack_bf16(sc[2 * kk][0], sc[2 * kk][1]);
        pa[kk][1] = pack_bf16(sc[2 * kk][2], sc[2 * kk][3]);
        pa[kk][2] = pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
        pa[kk][3] = pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
      }
      float(&o32)[32] = *reinterpret_cast<float(*)[32]>(&o[0][0]);
      wg_hold(o32);
      wg_hold(pa);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < KS; kk++) wgmma64_rs<1>(o32, pa[kk], wg_desc_sw128(vs + kk * 16 * 64, 1024, 1024), 1);
      wg_commit();
      wg_wait<0>();
      wg_hold(o32);
    }
#pragma unroll
    for (int kk = 0; kk < (WG ? 0 : KS); kk++) {
      uint32_t pa[4] = {pack_bf16(sc[2 * kk][0], sc[2 * kk][1]), pack_bf16(sc[2 * kk][2], sc[2 * kk][3]),
                        pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                        pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < DH / 16; dp++) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(b0, b1, b2, b3,
                  vs + (wn * KW + kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * SROW + dp * 16 + (lane >> 4) * 8);
        mma16816(o[2 * dp], pa, b0, b1);
        mma16816(o[2 * dp + 1], pa, b2, b3);
      }
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int r = 0; r < 2; r++) {
    l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 1);
    l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 2);
  }

  if (WN == 1) {
    /* each warp owns its 16 rows: stage bf16 in its rows of Qs, then 16-byte stores */
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 2; r++) {
      float inv = l_r[r] > 0.0f ? 1.0f / l_r[r] : 0.0f;
      bf16 *dst = Qs + (wm * 16 + g + 8 * r) * SROW + 2 * t4;
#pragma unroll
      for (int d = 0; d < DT; d++)
        *(__nv_bfloat162 *)(dst + d * 8) = __floats2bfloat162_rn(o[d][2 * r] * inv, o[d][2 * r + 1] * inv);
    }
    __syncwarp();
    for (int c = lane; c < 16 * CH; c += 32) {
      int r = c / CH, cc = c % CH, qi = q0 + wm * 16 + r;
      if (qi < qlen)
        *(uint4 *)(a.out + ((row0 + qi) * H + h) * DH + cc * 8) = *(const uint4 *)(Qs + (wm * 16 + r) * SROW + cc * 8);
    }
    return;
  }

  /* WN > 1: merge the warps' softmax states through shared memory */
  constexpr int OSTR = DH + 4;
  __syncthreads(); /* everyone is done with the K/V stages */
  float *red_m = (float *)Ks, *red_l = red_m + WN * BM, *ored = red_l + WN * BM;
  if (t4 == 0) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
      red_m[wn * BM + wm * 16 + g + 8 * r] = m_r[r];
      red_l[wn * BM + wm * 16 + g + 8 * r] = l_r[r];
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < 2; r++) {
    int row = wm * 16 + g + 8 * r;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < WN; w++) M = fmaxf(M, red_m[w * BM + row]);
    float own = m_r[r] == -INFINITY ? 0.0f : exp2f(m_r[r] - M);
    float *dst = ored + (size_t)(wn * BM + row) * OSTR + 2 * t4;
#pragma unroll
    for (int d = 0; d < DT; d++) {
      dst[d * 8] = o[d][2 * r] * own;
      dst[d * 8 + 1] = o[d][2 * r + 1] * own;
    }
  }
  __syncthreads();
  const bool split = eff > 1;
  for (int c = tid; c < BM * (DH / 4); c += NTH) {
    int row = c / (DH / 4), d = (c % (DH / 4)) * 4, qi = q0 + row;
    if (qi >= qlen) continue;
    float M = -INFINITY, Lsum = 0.0f;
#pragma unroll
    for (int w = 0; w < WN; w++) M = fmaxf(M, red_m[w * BM + row]);
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < WN; w++) {
        float mw = red_m[w * BM + row];
        if (mw != -INFINITY) Lsum += red_l[w * BM + row] * exp2f(mw - M);
      }
    }
    float inv = Lsum > 0.0f ? 1.0f / Lsum : 0.0f;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int w = 0; w < WN; w++) {
      float4 p = *(const float4 *)(ored + (size_t)(w * BM + row) * OSTR + d);
      v.x += p.x;
      v.y += p.y;
      v.z += p.z;
      v.w += p.w;
    }
    v.x *= inv;
    v.y *= inv;
    v.z *= inv;
    v.w *= inv;
    size_t grow = (row0 + qi) * H + h;
    if (split) {
      size_t pi = grow * a.n_splits + blockIdx.z;
      *(float4 *)(a.part_o + pi * DH + d) = v;
      if (d == 0) a.part_lse[pi] = Lsum > 0.0f ? M + log2f(Lsum) : -INFINITY;
    } else {
      __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi2 = __floats2bfloat162_rn(v.z, v.w);
      uint2 u;
      u.x = *(uint32_t *)&lo;
      u.y = *(uint32_t *)&hi2;
      *(uint2 *)(a.out + grow * DH + d) = u;
    }
  }
  if (!split) return;
  /* the last split block of this (query tile, head) merges the partials */
  __threadfence();
  __syncthreads();
  int *cnt = a.counters + (size_t)blockIdx.x * H + h;
  if (tid == 0) is_last = atomicAdd(cnt, 1) == eff - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int c = tid; c < BM * (DH / 4); c += NTH) {
    int row = c / (DH / 4), d = (c % (DH / 4)) * 4, qi = q0 + row;
    if (qi >= qlen) continue;
    size_t grow = (row0 + qi) * H + h, pi = grow * a.n_splits;
    float M = -INFINITY;
    for (int z = 0; z < eff; z++) M = fmaxf(M, __ldcg(a.part_lse + pi + z));
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float wsum = 0.0f;
    if (M != -INFINITY)
      for (int z = 0; z < eff; z++) {
        float w = exp2f(__ldcg(a.part_lse + pi + z) - M);
        if (w > 0.0f) {
          float4 p = __ldcg((const float4 *)(a.part_o + (pi + z) * DH + d));
          v.x += w * p.x;
          v.y += w * p.y;
          v.z += w * p.z;
          v.w += w * p.w;
          wsum += w;
        }
      }
    float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
    __nv_bfloat162 lo = __floats2bfloat162_rn(v.x * inv, v.y * inv), hi2 = __floats2bfloat162_rn(v.z * inv, v.w * inv);
    uint2 u;
    u.x = *(uint32_t *)&lo;
    u.y = *(uint32_t *)&hi2;
    *(uint2 *)(a.out + grow * DH + d) = u;
  }
  if (tid == 0) *cnt = 0;
}

/* ------------------------------------------------------------ generic kernel */

enum { GEN_MAX_DH = 256 };

/* One warp per (query row, head): any head size up to 256, any alignment. */
__global__ void __launch_bounds__(128) attn_generic_kernel(const AttnArgs a, int DH, bool paged) {
  td_pdl_start();
  __shared__ float qsh[4][GEN_MAX_DH];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, h = blockIdx.y, H = a.H;
  int rid = blockIdx.x * 4 + warp;
  int qi, qlen, kend, qpos;
  size_t row0;
  const int32_t *table = nullptr;
  if (!paged) {
    if (rid >= a.n_tokens) return;
    int lo = 0, hi = a.n_seqs - 1;
    while (lo < hi) { /* last s with cu[s] <= rid */
      int mid = (lo + hi + 1) >> 1;
      if (a.cu[mid] <= rid) lo = mid;
      else hi = mid - 1;
    }
    row0 = (size_t)a.cu[lo];
    qlen = a.cu[lo + 1] - a.cu[lo];
    qi = rid - a.cu[lo];
    if (qi >= qlen) return;
    qpos = qi;
    kend = a.causal ? qi + 1 : qlen;
  } else {
    int s = rid / a.qtiles;
    qi = rid % a.qtiles;
    if (s >= a.n_seqs) return;
    int qs = a.q_start[s];
    qlen = min(a.q_start[s + 1], a.n_tokens) - qs;
    if (qs < 0 || qi >= qlen) return;
    row0 = (size_t)qs;
    int ctx = a.ctx_len[s];
    int nk = min(max(ctx, 0), a.max_blocks * a.bs);
    qpos = ctx - qlen + qi;
    kend = a.causal ? min(nk, qpos + 1) : nk;
    table = a.block_table + (size_t)s * a.max_blocks;
  }
  size_t qkv_row = (size_t)3 * H * DH;
  const bf16 *qp = paged ? a.q + (row0 + qi) * a.ldq + (size_t)h * DH : a.qkv + (row0 + qi) * qkv_row + (size_t)h * DH;
  for (int d = lane; d < DH; d += 32) qsh[warp][d] = __bfloat162float(qp[d]);
  __syncwarp();
  const float *L = a.lut ? a.lut + (size_t)h * (2 * a.md + 1) : nullptr;
  float m = -INFINITY, l = 0.0f, acc[GEN_MAX_DH / 32];
#pragma unroll
  for (int i = 0; i < GEN_MAX_DH / 32; i++) acc[i] = 0.0f;
  for (int c0 = 0; c0 < kend; c0 += 32) {
    int j = c0 + lane;
    float sc = -INFINITY;
    if (j < kend) {
      const bf16 *kp = paged ? a.pool + (size_t)table[j / a.bs] * a.block_elems + a.layer_off +
                                   ((size_t)h * a.bs + j % a.bs) * DH
                             : a.qkv + (row0 + j) * qkv_row + (size_t)(H + h) * DH;
      float dot = 0.0f;
      for (int d = 0; d < DH; d++) dot += qsh[warp][d] * __bfloat162float(kp[d]);
      sc = dot * a.scale_log2;
      if (L) sc += lut_at(L, a.md, j - qpos) * LOG2E;
    }
    float cmax = sc;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, o));
    float nm = fmaxf(m, cmax), mu = nm == -INFINITY ? 0.0f : nm;
    float alpha = exp2f(m - mu), p = j < kend ? exp2f(sc - mu) : 0.0f, ps = p;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
    l = l * alpha + ps;
    m = nm;
#pragma unroll
    for (int i = 0; i < GEN_MAX_DH / 32; i++) acc[i] *= alpha;
    int cnt = min(32, kend - c0);
    for (int kk = 0; kk < cnt; kk++) {
      float pk = __shfl_sync(0xffffffffu, p, kk);
      int jj = c0 + kk;
      const bf16 *vp = paged ? a.pool + (size_t)table[jj / a.bs] * a.block_elems + a.layer_off +
                                   ((size_t)(H + h) * a.bs + jj % a.bs) * DH
                             : a.qkv + (row0 + jj) * qkv_row + (size_t)(2 * H + h) * DH;
#pragma unroll
      for (int i = 0; i < GEN_MAX_DH / 32; i++) {
        int d = lane + 32 * i;
        if (d < DH) acc[i] += pk * __bfloat162float(vp[d]);
      }
    }
  }
  float inv = l > 0.0f ? 1.0f / l : 0.0f;
  bf16 *op = a.out + ((row0 + qi) * H + h) * DH;
#pragma unroll
  for (int i = 0; i < GEN_MAX_DH / 32; i++) {
    int d = lane + 32 * i;
    if (d < DH) op[d] = __float2bfloat16_rn(acc[i] * inv);
  }
}

/* Decode attention, one query per sequence, head_dim 64: SPLIT warps per
 * (sequence, head) taking interleaved 32-key chunks, their softmax states
 * merged through shared memory at the end; PAIRS pairs per block. Within a
 * chunk, lane l holds dims 8 (l % 8) .. + 8 of keys 4 i + l / 8 (i < 8),
 * so that each load instruction of the warp reads four whole 128-byte key
 * rows (with one key row a lane, every instruction touched 32 lines, and
 * the self-attention at batch 64 ran at a third of the DRAM rate, ncu on
 * H100). A key's score is summed over its 8 lanes (3
 * shuffles), p V over the 4 lanes of a dim group (2 shuffles a dim); each
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

/* One chunk of 4 N keys starting at c0 (which is below kend): lane (cg, kq)
 * holds dims 8 cg of keys c0 + 4 i + kq in kr / vr (zeros past kend); the
 * online softmax state (m, l, o) advances over them. */
template <int N>
__device__ __forceinline__ void dw_chunk(const uint4 (&kr)[N], const uint4 (&vr)[N], int c0, int kq, int kend, int qpos,
                                         const float (&qf)[8], const float *L, int md, float &m, float &l, float (&o)[8]) {
  float sc[N];
#pragma unroll
  for (int i = 0; i < N; i++) {
    td_bf16x8 k2;
    k2.u = kr[i];
    float dot = 0.0f;
#pragma unroll
    for (int t = 0; t < 4; t++) {
      float2 f = __bfloat1622float2(k2.h[t]);
      dot = fmaf(qf[2 * t], f.x, dot);
      dot = fmaf(qf[2 * t + 1], f.y, dot);
    }
    sc[i] = dot;
  }
#pragma unroll
  for (int i = 0; i < N; i++)
#pragma unroll
    for (int x = 1; x < 8; x <<= 1) sc[i] += __shfl_xor_sync(0xffffffffu, sc[i], x);
  float cmax = -INFINITY;
#pragma unroll
  for (int i = 0; i < N; i++) {
    const int j = c0 + 4 * i + kq;
    sc[i] = j < kend ? (L ? sc[i] + lut_at(L, md, j - qpos) * LOG2E : sc[i]) : -INFINITY;
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
#pragma unroll
  for (int i = 0; i < N; i++) {
    const float p = sc[i] == -INFINITY ? 0.0f : fast_exp2(sc[i] - m);
    ps += p;
    td_bf16x8 v2;
    v2.u = vr[i];
#pragma unroll
    for (int t = 0; t < 4; t++) {
      float2 f = __bfloat1622float2(v2.h[t]);
      acc[2 * t] = fmaf(p, f.x, acc[2 * t]);
      acc[2 * t + 1] = fmaf(p, f.y, acc[2 * t + 1]);
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

/* at most 128 registers: two blocks of 8 warps an SM */
template <int SPLIT, int PAIRS, bool EARLY>
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
  uint4 kr[8], vr[8];
  auto key_at = [&](int j) { return head + (size_t)table[j / a.bs] * a.block_elems + (size_t)(j % a.bs) * 64; };
  auto load = [&](int c0) {
    int j = c0 + kq, b = j / a.bs, r = j % a.bs; /* key 4 i + kq: block b, row r */
#pragma unroll
    for (int i = 0; i < 8; i++) {
      if (j < kend) {
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
    /* kv_static_past: the query's own key was just written; read it again */
    const int d = qpos - sub * 32;
    if (!a.kv_static && d >= 0 && d < 32 && (d & 3) == kq && qpos < kend) {
      const bf16 *kp = key_at(qpos);
      dw_own_row(kr, vr, d >> 2, *(const uint4 *)kp, *(const uint4 *)(kp + vstride));
    }
  }
  float qf[8];
  dw_load_q(qf, a, qs, h, cg, live);
  float m = -INFINITY, l = 0.0f, o[8];
#pragma unroll
  for (int e = 0; e < 8; e++) o[e] = 0.0f;
  for (int c0 = sub * 32; c0 < kend; c0 += 32 * SPLIT) {
    if (!early || c0 != sub * 32) load(c0);
    dw_chunk(kr, vr, c0, kq, kend, qpos, qf, L, a.md, m, l, o);
  }
  dw_finish<SPLIT>(mrg[pw], sub, cg, kq, m, l, o, live, a.out + ((size_t)qs * H + h) * 64 + cg * 8);
}

/* Decode attention fed by bulk copies (the TMA engine), for many pairs
 * over long static contexts (cross-attention at large batch): one
 * (sequence, head) pair a block of W warps; warp w takes the key stages
 * w, w + W, ... of BULK_NK keys, each warp with NS stages in flight in
 * its own NS slots and mbarriers (no block barrier before the merge).
 * A stage's K and V rows of a paged block are one contiguous copy each
 * (one 2 KB copy at block size 16). The tiled kernel's 16-byte cp.async
 * gathers reached ~2.45 TB/s on the H100 here. With static K/V (kv_static),
 * or the keys before the query (kv_static_past, causal), the first stages
 * are requested before waiting for the query. */
enum { BULK_NK = 16 };

template <int W, int NS, bool EARLY>
__global__ void __launch_bounds__(32 * W) attn_decode_bulk_kernel(const AttnArgs a) {
  static_assert(W >= 2 && W <= 4 && NS >= 2, "bulk decode attention shape");
  __shared__ __align__(128) bf16 ring[W][NS][2][BULK_NK * 64]; /* warp, slot, K / V */
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
  const size_t vstride = (size_t)H * a.bs * 64;
  const bf16 *head = a.pool + a.layer_off + (size_t)h * a.bs * 64;
  const int nst = (kend + BULK_NK - 1) / BULK_NK;
  if (lane == 0)
    for (int i = 0; i < NS; i++) mbar_init(&bar[warp][i], 1);
  __syncwarp();
  /* lane 0: stage t's K and V rows into the slot, one copy per paged block;
   * read once a step, so evicted from L2 first (H100, Flan-T5-large batch
   * 16: 1.295-1.309 -> 1.281-1.297 ms; 32 and 64 even) */
  const uint64_t pol = l2_evict_first();
  auto issue = [&](int t, int slot) {
    const int k0 = t * BULK_NK, k1 = min(k0 + BULK_NK, kend);
    mbar_arrive_tx(&bar[warp][slot], (uint32_t)(k1 - k0) * 256u);
    for (int j = k0; j < k1;) {
      const int b = j / a.bs, r = j - b * a.bs, n = min(a.bs - r, k1 - j);
      const bf16 *src = head + (size_t)table[b] * a.block_elems + (size_t)r * 64;
      bulk_g2s_hint(&ring[warp][slot][0][(j - k0) * 64], src, (uint32_t)n * 128u, &bar[warp][slot], pol);
      bulk_g2s_hint(&ring[warp][slot][1][(j - k0) * 64], src + vstride, (uint32_t)n * 128u, &bar[warp][slot], pol);
      j += n;
    }
  };
  if (lane == 0)
    for (int i = 0; i < NS && warp + i * W < nst; i++) issue(warp + i * W, i);
  if (EARLY) td_pdl_start_if(a.pdl_late);
  float qf[8];
  dw_load_q(qf, a, qs, h, cg, live);
  /* kv_static_past: the stage copied before the wait may hold a stale row
   * at the query's own position; the lanes that hold that row read it again */
  const int qt = qpos / BULK_NK;
  const bool fix = EARLY && !a.kv_static && qpos < kend && qt < nst && qt % W == warp && (qpos & 3) == kq;
  uint4 nk = make_uint4(0u, 0u, 0u, 0u), nv = nk;
  if (fix) { /* requested now, used when its stage arrives */
    const bf16 *kp = head + (size_t)table[qpos / a.bs] * a.block_elems + (size_t)(qpos % a.bs) * 64 + cg * 8;
    nk = *(const uint4 *)kp;
    nv = *(const uint4 *)(kp + vstride);
  }
  float m = -INFINITY, l = 0.0f, o[8];
#pragma unroll
  for (int e = 0; e < 8; e++) o[e] = 0.0f;
  for (int t = warp, use = 0, slot = 0; t < nst; t += W, use++, slot = slot + 1 == NS ? 0 : slot + 1) {
    const int c0 = t * BULK_NK;
    mbar_wait(&bar[warp][slot], (unsigned)(use / NS) & 1u);
    uint4 kr[BULK_NK / 4], vr[BULK_NK / 4];
#pragma unroll
    for (int i = 0; i < BULK_NK / 4; i++) {
      const int r = 4 * i + kq;
      const bool in = c0 + r < kend; /* rows past kend were not copied */
      kr[i] = in ? *(const uint4 *)&ring[warp][slot][0][r * 64 + cg * 8] : make_uint4(0u, 0u, 0u, 0u);
      vr[i] = in ? *(const uint4 *)&ring[warp][slot][1][r * 64 + cg * 8] : make_uint4(0u, 0u, 0u, 0u);
    }
    if (fix && t == qt) dw_own_row(kr, vr, (qpos - c0) >> 2, nk, nv);
    __syncwarp();
    if (lane == 0 && t + NS * W < nst) {
      fence_proxy_async(); /* the lanes' reads of the slot before the copy engine's writes */
      issue(t + NS * W, slot);
    }
    dw_chunk(kr, vr, c0, kq, kend, qpos, qf, L, a.md, m, l, o);
  }
  dw_finish<W>(mrg, warp, cg, kq, m, l, o, live, a.out + ((size_t)qs * H + h) * 64 + cg * 8);
}

/* The query norm where the attention kernel does not apply it: q rows
 * scaled by 1 / rms of their qn rows into out (one block a row). */
__global__ void __launch_bounds__(256) q_norm_kernel(const bf16 *__restrict__ q, int ldq, const bf16 *__restrict__ qn,
                                                     int dim, float eps, bf16 *__restrict__ out, int width) {
  __shared__ float red[32];
  td_pdl_start();
  const int row = blockIdx.x;
  const bf16 *x = qn + (size_t)row * dim;
  float ss = 0.0f;
  for (int j = threadIdx.x; j < dim; j += blockDim.x) {
    const float v = __bfloat162float(x[j]);
    ss = fmaf(v, v, ss);
  }
  const float r = rsqrtf(td_block_sum(ss, red) / (float)dim + eps);
  for (int j = threadIdx.x; j < width; j += blockDim.x)
    out[(size_t)row * width + j] = __float2bfloat16_rn(__bfloat162float(q[(size_t)row * ldq + j]) * r);
}

/* ------------------------------------------------------------ launchers */

template <int DH, int WM, int WN, int STAGES, int MINB, bool PAGED, bool WG>
static td_status set_smem(td_cuda *c, Cfg<DH, WM, WN, STAGES, MINB, PAGED, WG> cfg) {
  size_t bytes = attn_smem_base(cfg) + 2 * LUT_CAP * sizeof(float);
  if (bytes > c->smem_optin)
    return td_err(TD_ERR_UNSUPPORTED, "attention: needs %zu bytes of shared memory, the device allows %zu", bytes,
                  c->smem_optin);
  TD_CU_CHECK(cudaFuncSetAttribute(attn_kernel<DH, WM, WN, STAGES, MINB, PAGED, WG>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
              "attention init");
  return TD_OK;
}

template <int DH, int WM, int WN, int STAGES, int MINB, bool PAGED, bool WG>
static void launch(Cfg<DH, WM, WN, STAGES, MINB, PAGED, WG> cfg, dim3 grid, size_t lut, const td_cuda *c,
                   const AttnArgs &a) {
  (void)td_launch(c, attn_kernel<DH, WM, WN, STAGES, MINB, PAGED, WG>, grid, 32 * WM * WN, attn_smem_base(cfg) + lut, a);
}

/* decode warp kernel: PAIRS (sequence, head) pairs a block */
template <int SPLIT, int PAIRS>
static void launch_dw(const td_cuda *c, bool kv_static, long pairs, const AttnArgs &a) {
  unsigned blocks = (unsigned)((pairs + PAIRS - 1) / PAIRS);
  (void)td_launch(c, kv_static ? attn_decode_warp_kernel<SPLIT, PAIRS, true> : attn_decode_warp_kernel<SPLIT, PAIRS, false>,
                  blocks, 32 * SPLIT * PAIRS, 0, a);
}

/* bulk-copy decode attention: a pair a block; two warps (16 KB of slots,
 * eight blocks an SM) when the pairs would not all be resident with four
 * (32 KB, six an SM), so that they run in one wave (the tuning's
 * decode_bulk_shape picks one: 1 four warps x 2 slots, 2 two x 2, 3 two x 3) */
template <int W, int NS>
static void launch_bulk_as(const td_cuda *c, bool early, long pairs, int carveout, const AttnArgs &a) {
  (void)td_launch_ex(c, 0, carveout,
                     early ? attn_decode_bulk_kernel<W, NS, true> : attn_decode_bulk_kernel<W, NS, false>,
                     (unsigned)pairs, 32 * W, 0, a);
}

static void launch_bulk(const td_cuda *c, bool early, long pairs, const AttnArgs &a) {
  int shape = c->tune.decode_bulk_shape ? c->tune.decode_bulk_shape : pairs > 6L * c->sm_count ? 2 : 1;
  /* up to three blocks an SM, a 75 % shared-memory carveout holds them and
   * measured faster there (H100, Flan-T5-large batch 8: 1.080-1.090 ->
   * 1.028-1.038 ms; 25 % slower, no effect at other batches) */
  int carve = c->tune.decode_bulk_carve >= 0 && shape == 1 && pairs <= 3L * c->sm_count ? c->tune.decode_bulk_carve : -1;
  if (shape == 2) launch_bulk_as<2, 2>(c, early, pairs, -1, a);
  else if (shape == 3) launch_bulk_as<2, 3>(c, early, pairs, -1, a);
  else launch_bulk_as<4, 2>(c, early, pairs, carve, a);
}

td_status td_cu_attn_init(td_cuda *c) {
  TD_TRY(set_smem(c, Dense64w()));
  TD_TRY(set_smem(c, Dense64()));
  TD_TRY(set_smem(c, Dense64s()));
  TD_TRY(set_smem(c, Dense128()));
  TD_TRY(set_smem(c, Paged64()));
  TD_TRY(set_smem(c, Paged128()));
  return TD_OK;
}

static size_t lut_bytes(const td_relbias *bias) {
  size_t n = bias ? (size_t)(2 * bias->max_distance + 1 + 2 * LUT_PAD) : 0;
  return n && n <= LUT_CAP ? (2 * n + (n & 1)) * sizeof(float) : 0; /* two copies, the second at an even offset */
}

td_status td_cu_attn_dense(td_backend *b, const void *qkv, void *out, const int32_t *cu_seqlens, int n_seqs,
                           int n_tokens, int max_len, int heads, int head_dim, float scale, bool causal,
                           const td_relbias *bias) {
  td_cu_bind(td_cu(b));
  td_cuda *c = td_cu(b);
  if (head_dim > GEN_MAX_DH)
    return td_err(TD_ERR_UNSUPPORTED, "attn_dense: head_dim %d (at most %d)", head_dim, GEN_MAX_DH);
  if (heads > 65535) return td_err(TD_ERR_UNSUPPORTED, "attn_dense: %d heads", heads);
  AttnArgs a = {};
  a.H = heads;
  a.scale_log2 = scale * LOG2E;
  a.lut = bias ? bias->lut : nullptr;
  a.md = bias ? bias->max_distance : 0;
  a.causal = causal;
  a.out = (bf16 *)out;
  a.n_tokens = n_tokens;
  a.qkv = (const bf16 *)qkv;
  a.cu = cu_seqlens;
  a.n_seqs = n_seqs;
  bool fast = (head_dim == 64 || head_dim == 128) && td_aligned16(qkv) && td_aligned16(out);
  if (fast) {
    /* block rows: 16 per warp along queries; the tile map uses the same count */
    bool wide = head_dim == 64 && c->tune.dense64_warps != 4;
    int bm = wide ? 128 : 64, len = max_len < 1 || max_len > n_tokens ? n_tokens : max_len;
    a.qtiles = (len + bm - 1) / bm; /* query tiles per sequence: max_len bounds every length */
    dim3 grid((unsigned)((long)n_seqs * a.qtiles), (unsigned)heads);
    if (wide && c->tune.dense64_warps == 0) launch(Dense64w(), grid, lut_bytes(bias), c, a);
    else if (wide) launch(Dense64(), grid, lut_bytes(bias), c, a);
    else if (head_dim == 64) launch(Dense64s(), grid, lut_bytes(bias), c, a);
    else launch(Dense128(), grid, lut_bytes(bias), c, a);
  } else {
    dim3 grid((unsigned)((n_tokens + 3) / 4), (unsigned)heads);
    (void)td_launch(c, attn_generic_kernel, grid, 128, 0, a, head_dim, false);
  }
  TD_CU_LAUNCHED("attn_dense");
  return TD_OK;
}

td_status td_cu_attn_paged(td_backend *b, const void *q, int ldq, void *out, const void *pool,
                           const td_kv_layout *l, int layer, const td_paged_meta *m, float scale, bool causal,
                           const td_relbias *bias) {
  td_cu_bind(td_cu(b));
  td_cuda *c = td_cu(b);
  int H = l->n_heads, dh = l->head_dim, bs = l->block_size;
  if (dh > GEN_MAX_DH) return td_err(TD_ERR_UNSUPPORTED, "attn_paged: head_dim %d (at most %d)", dh, GEN_MAX_DH);
  if (H > 65535) return td_err(TD_ERR_UNSUPPORTED, "attn_paged: %d heads", H);
  if ((long)m->max_blocks * bs > 2147483647L) return td_err(TD_ERR_INVALID, "attn_paged: block table too wide");
  /* host bounds only size the grid; clamp them to what the buffers allow */
  int max_q = m->max_q < 1 ? 1 : m->max_q > m->n_tokens ? m->n_tokens : m->max_q;
  int max_ctx = m->max_ctx < 1 || m->max_ctx > m->max_blocks * bs ? m->max_blocks * bs : m->max_ctx;
  AttnArgs a = {};
  a.H = H;
  a.scale_log2 = scale * LOG2E;
  a.lut = bias ? bias->lut : nullptr;
  a.md = bias ? bias->max_distance : 0;
  a.causal = causal;
  a.out = (bf16 *)out;
  a.n_tokens = m->n_tokens;
  a.n_seqs = m->n_seqs;
  a.q = (const bf16 *)q;
  a.ldq = ldq;
  a.pool = (const bf16 *)pool;
  a.block_elems = td_kv_block_elems(l);
  a.layer_off = (size_t)layer * 2 * H * bs * dh;
  a.bs = bs;
  a.q_start = m->q_start;
  a.ctx_len = m->ctx_len;
  a.block_table = m->block_table;
  a.max_blocks = m->max_blocks;
  a.kv_static = m->kv_static;
  a.kv_past = m->kv_static_past;
  a.pdl_late = c->tune.pdl_late > 0 && (c->tune.pdl_late & 1) != 0;
  a.n_splits = 1;
  bool fast = (dh == 64 || dh == 128) && ldq % 8 == 0 && td_aligned16(q) && td_aligned16(out) && td_aligned16(pool) &&
              a.block_elems % 8 == 0; /* every block 16-byte aligned (a states tail may not keep it) */
  /* decode, one query per sequence, on warps: over self KV with enough
   * (sequence, head) pairs, two warps a pair; with fewer pairs, 2-8 warps
   * a pair by the context bound, and 16 for longer contexts when the pairs
   * are neither too many nor too few and the context not too long
   * (c->tune.decode_small*): elsewhere the tiled kernel's key splits spread the
   * K/V over more SMs (H100: 20 or 40 pairs over 1500 keys faster split;
   * 16-64 over 512 faster on warps since their merge is by shuffles;
   * docs/cuda.md). Many pairs over static K/V: a pair a block, K/V by bulk
   * copies (the kv_static_past re-read of the query's own key is the warp
   * kernels'); over self K/V too up to decode_bulk_all pairs (H100: batch
   * 12-16 faster, 64 slower). */
  enum { DEC_NONE, DEC_BULK, DEC_W2P4, DEC_W4P2, DEC_W8, DEC_W16 } dec = DEC_NONE;
  long pairs = (long)m->n_seqs * H;
  if (fast && dh == 64 && max_q == 1 && c->tune.decode_warp > 0) {
    bool small = c->tune.decode_small > 0 && pairs < (long)c->tune.decode_warp;
    if (c->tune.decode_bulk > 0 && pairs >= c->tune.decode_bulk && (m->kv_static || pairs <= c->tune.decode_bulk_all) &&
        pairs <= 2147483647L)
      dec = DEC_BULK;
    else if (!m->kv_static && pairs >= (long)c->tune.decode_warp) dec = DEC_W2P4;
    else if (small && max_ctx <= 64) dec = DEC_W2P4;
    else if (small && max_ctx <= 128) dec = DEC_W4P2;
    else if (small && max_ctx <= 256) dec = DEC_W8;
    else if (small && pairs <= c->tune.decode_small && pairs >= c->tune.decode_small_min && max_ctx <= c->tune.decode_small_ctx)
      dec = DEC_W16;
  }
  /* the query norm: in the decode kernels (aligned rows), else q scaled into
   * the staging buffer first (used otherwise only by synchronous copies) */
  if (m->q_norm && dec != DEC_NONE && m->q_norm_dim % 8 == 0 && td_aligned16(m->q_norm)) {
    a.qn = (const bf16 *)m->q_norm;
    a.qn_dim = m->q_norm_dim;
    a.qn_eps = m->q_norm_eps;
  } else if (m->q_norm) {
    int width = H * dh;
    if ((size_t)m->n_tokens * width * sizeof(bf16) > TD_CU_STAGE_BYTES)
      return td_err(TD_ERR_UNSUPPORTED, "attn_paged: %d query rows of %d too many for the query norm", m->n_tokens,
                    width);
    bf16 *qs = (bf16 *)c->stage;
    (void)td_launch(c, q_norm_kernel, (unsigned)m->n_tokens, 256, 0, (const bf16 *)q, ldq, (const bf16 *)m->q_norm,
                    m->q_norm_dim, m->q_norm_eps, qs, width);
    TD_CU_LAUNCHED("attn_paged (query norm)");
    a.q = qs;
    a.ldq = ldq = width;
    fast = (dh == 64 || dh == 128) && ldq % 8 == 0 && td_aligned16(out) && td_aligned16(pool);
  }
  if (!fast) {
    a.qtiles = max_q;
    long rows = (long)m->n_seqs * max_q;
    dim3 grid((unsigned)((rows + 3) / 4), (unsigned)H);
    (void)td_launch(c, attn_generic_kernel, grid, 128, 0, a, dh, true);
    TD_CU_LAUNCHED("attn_paged");
    return TD_OK;
  }
  if (dec != DEC_NONE) {
    /* early loads: all of a static K/V, or the keys before the query (causal
     * self-attention); on the bulk kernel up to decode_bulk_early pairs (H100,
     * Flan-T5-large batch 8, 128 pairs: 1.078-1.084 -> 1.042-1.046 ms; at
     * batch 12 and 16 slower, 1.213-1.219 -> 1.277-1.280 and 1.281-1.284 ->
     * 1.323-1.334: there they crowd the QKV GEMM's weight stream) */
    bool st = m->kv_static || (m->kv_static_past && a.causal);
    if (dec == DEC_BULK) launch_bulk(c, m->kv_static || (st && pairs <= c->tune.decode_bulk_early), pairs, a);
    else if (dec == DEC_W2P4) launch_dw<2, 4>(c, st, pairs, a);
    else if (dec == DEC_W4P2) launch_dw<4, 2>(c, st, pairs, a);
    else if (dec == DEC_W8) launch_dw<8, 1>(c, st, pairs, a);
    else launch_dw<16, 1>(c, st, pairs, a);
    TD_CU_LAUNCHED("attn_paged");
    return TD_OK;
  }
  a.qtiles = (max_q + 15) / 16;
  long base = (long)m->n_seqs * a.qtiles * H;
  /* flash-decoding when few blocks would run: split the keys so that the
   * GPU fills; each (query tile, head) merges its splits in its last block */
  int splits = 1;
  if (base < 2L * c->sm_count && base <= TD_CU_ATTN_COUNTERS) {
    splits = (int)((2L * c->sm_count + base - 1) / base);
    int by_ctx = (max_ctx + BN - 1) / BN;
    splits = splits > by_ctx ? by_ctx : splits;
    splits = splits > 64 ? 64 : splits < 1 ? 1 : splits;
    size_t per = (size_t)m->n_tokens * H * (dh + 1) * sizeof(float);
    while (splits > 1 && per * splits > TD_CU_SPLIT_BYTES) splits--;
  }
  a.n_splits = splits;
  a.part_o = c->split;
  a.part_lse = c->split + (size_t)m->n_tokens * H * splits * dh;
  a.counters = c->counters + TD_CU_GEMM_COUNTERS;
  dim3 grid((unsigned)(m->n_seqs * a.qtiles), (unsigned)H, (unsigned)splits);
  if (dh == 64) launch(Paged64(), grid, lut_bytes(bias), c, a);
  else launch(Paged128(), grid, lut_bytes(bias), c, a);
  TD_CU_LAUNCHED("attn_paged");
  return TD_OK;
}
