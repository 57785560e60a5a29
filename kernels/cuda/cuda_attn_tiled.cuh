/* The tiled attention kernel (cuda_attn.cuh describes it), a template for
 * the dense and the paged configurations, which cuda_attn_dense.cu and
 * cuda_attn_paged.cu instantiate; its tile products on wgmma and on
 * mma.sync are separate device functions. */
#ifndef TD_KERNELS_CUDA_ATTN_TILED_CUH
#define TD_KERNELS_CUDA_ATTN_TILED_CUH

#include "kernels/cuda/cuda_attn.cuh"

/* Tile configurations: head size, warps along queries (WM) and keys (WN),
 * cp.async stages, blocks per SM the registers must allow, the tile
 * products (WG: 0 mma.sync, 1 wgmma, 2 wgmma pipelined: a tile's softmax
 * runs beside the previous tile's P.V, so that the tensor cores work
 * beside it when one block holds an SM; 3 the same with the block's keys
 * in two halves, each on its own warps and K/V stages, merged at the end:
 * twice the warps an SM where one block holds it). */
template <int DH, int WM, int WN, int STAGES, int MINB, bool PAGED, int WG>
struct Cfg {};
typedef Cfg<64, 8, 1, 3, 2, false, 1> Dense64w; /* 128 query rows, wgmma (two warpgroups) */
typedef Cfg<64, 8, 1, 4, 2, false, 2> Dense64p;  /* the same, pipelined (dense64_warps 1) */
typedef Cfg<64, 8, 1, 4, 1, false, 2> Dense64p1; /* ... in registers for one block an SM (dense64_warps 2) */
typedef Cfg<64, 8, 1, 4, 1, false, 3> Dense64h;  /* ... the keys in two halves, 16 warps (dense64_warps 5) */
typedef Cfg<64, 8, 1, 3, 2, false, 0> Dense64;  /* 128 rows, mma.sync (td_cuda_tuning.dense64_warps 8) */
typedef Cfg<64, 4, 1, 2, 3, false, 0> Dense64s; /* 64 rows (dense64_warps 4) */
typedef Cfg<128, 4, 1, 2, 2, false, 0> Dense128;
typedef Cfg<64, 1, 4, 2, 4, true, 0> Paged64;
typedef Cfg<128, 1, 4, 3, 2, true, 0> Paged128;

/* wgmma variant: K/V tiles of 64 x 64 in the 128-byte swizzle (8 KiB,
 * 1024-byte aligned, after an alignment pad), then Q and the bias table */
enum { WG_TILE = BN * 64 * 2, WG_PAD = 1024 };

/* WG 3: the keys' halves, each with its threads and stages */
__host__ __device__ constexpr int attn_halves(int wg) { return wg == 3 ? 2 : 1; }

template <int DH, int WM, int WN, int STAGES, int MINB, bool PAGED, int WG>
__host__ __device__ constexpr size_t attn_smem_base(Cfg<DH, WM, WN, STAGES, MINB, PAGED, WG>) {
  return WG ? (size_t)WG_PAD + (size_t)attn_halves(WG) * 2 * STAGES * WG_TILE + (size_t)16 * WM * (DH + 8) * sizeof(bf16)
            : (size_t)(16 * WM + 2 * STAGES * BN) * (DH + 8) * sizeof(bf16);
}

/* A tile's two products for one warp's 16 query rows: S = Q K^T over its
 * KW keys (NT n8 tiles; qf the query's A fragments), then O += P V with P
 * the probabilities left in sc. On wgmma (a warpgroup's asynchronous
 * m64n64k16 products, K/V 64 x 64 tiles in the 128-byte swizzle; P's A
 * fragments packed by p_frags into an array of the kernel's scope, where
 * ptxas schedules them as before the split) or on mma.sync (K/V rows of
 * SROW elements through ldmatrix). */
/* The wgmma products issued and committed, not waited for (the pipelined
 * kernel waits itself); over: the first product overwrites the scores.
 * From a tile's descriptor (wg_desc_sw128 of its first element): a k16
 * step of K is 32 bytes on, of V 16 rows (2 KiB); the address field counts
 * 16-byte units and cannot carry within a tile. */
template <int DK>
__device__ __forceinline__ void scores_issue(float (&s32)[32], uint32_t (&qf)[DK][4], uint64_t kd, bool over) {
  wg_hold(s32);
  wg_hold(qf);
  wg_fence();
#pragma unroll
  for (int dk = 0; dk < DK; dk++) wgmma64_rs<0>(s32, qf[dk], kd + (uint64_t)(dk * 2), over && dk == 0 ? 0 : 1);
  wg_commit();
}
template <int KS>
__device__ __forceinline__ void pv_issue(float (&o32)[32], uint32_t (&pa)[KS][4], uint64_t vd) {
  wg_hold(o32);
  wg_hold(pa);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < KS; kk++) wgmma64_rs<1>(o32, pa[kk], vd + (uint64_t)(kk * 128), 1);
  wg_commit();
}
__device__ __forceinline__ uint64_t k_desc(const bf16 *ks) { return wg_desc_sw128(ks, 16, 1024); }
__device__ __forceinline__ uint64_t v_desc(const bf16 *vs) { return wg_desc_sw128(vs, 1024, 1024); }

template <int DK>
__device__ __forceinline__ void scores_wgmma(float (&sc)[8][4], uint32_t (&qf)[DK][4], const bf16 *ks) {
  float(&s32)[32] = *reinterpret_cast<float(*)[32]>(&sc[0][0]);
  scores_issue<DK>(s32, qf, k_desc(ks), false);
  wg_wait<0>();
  wg_hold(s32);
}

template <int DK, int NT, int KW, int SROW>
__device__ __forceinline__ void scores_mma(float (&sc)[NT][4], const uint32_t (&qf)[DK][4], const bf16 *ks, int wn) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int dk = 0; dk < DK; dk++) {
#pragma unroll
    for (int jn = 0; jn < NT / 2; jn++) {
      uint32_t b0, b1, b2, b3;
      ldsm_x4(b0, b1, b2, b3,
              ks + (wn * KW + jn * 16 + (lane & 7) + ((lane >> 4) << 3)) * SROW + dk * 16 + ((lane >> 3) & 1) * 8);
      mma16816(sc[2 * jn], qf[dk], b0, b1);
      mma16816(sc[2 * jn + 1], qf[dk], b2, b3);
    }
  }
}

template <int KS>
__device__ __forceinline__ void p_frags(uint32_t (&pa)[KS][4], const float (&sc)[2 * KS][4]) {
#pragma unroll
  for (int kk = 0; kk < KS; kk++) {
    pa[kk][0] = pack_bf16(sc[2 * kk][0], sc[2 * kk][1]);
    pa[kk][1] = pack_bf16(sc[2 * kk][2], sc[2 * kk][3]);
    pa[kk][2] = pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
    pa[kk][3] = pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
  }
}
template <int KS>
__device__ __forceinline__ void pv_wgmma(float (&o)[8][4], uint32_t (&pa)[KS][4], const bf16 *vs) {
  float(&o32)[32] = *reinterpret_cast<float(*)[32]>(&o[0][0]);
  pv_issue<KS>(o32, pa, v_desc(vs));
  wg_wait<0>();
  wg_hold(o32);
}

template <int DH, int KS, int KW, int SROW>
__device__ __forceinline__ void pv_mma(float (&o)[DH / 8][4], const float (&sc)[2 * KS][4], const bf16 *vs, int wn) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int kk = 0; kk < KS; kk++) {
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

template <int DH, int WM, int WN, int STAGES, int MINB, bool PAGED, int WG>
__global__ void __launch_bounds__(32 * WM * WN * attn_halves(WG), MINB) attn_kernel(const AttnArgs a) {
  /* static K/V (cross-attention): the first tiles stream in before waiting
   * for the previous kernel, which produces only Q */
  const bool early = PAGED && a.kv_static;
  if (!early) td_pdl_start();
  constexpr int BM = 16 * WM, SROW = DH + 8, NTH = 32 * WM * WN; /* NTH: threads of one key half */
  constexpr int KH = attn_halves(WG), NTA = NTH * KH;
  constexpr int KW = BN / WN; /* keys per warp per tile */
  constexpr int NT = KW / 8;  /* n8 tiles of S per warp */
  constexpr int KS = KW / 16; /* k16 steps of P.V per warp */
  constexpr int DT = DH / 8;  /* n8 tiles of O */
  constexpr int DK = DH / 16; /* k16 steps of Q.K */
  constexpr int CH = DH / 8;  /* 16-byte chunks per row */
  /* pipelined: tiles kt and kt + 1 in use at tile kt */
  static_assert(WG < 2 || STAGES >= 3, "pipelined: two tiles in use, one ahead");
  static_assert(WM == 1 || WN == 1, "warps split queries or keys");
  static_assert(WG == 0 || (DH == 64 && WN == 1 && WM % 4 == 0 && !PAGED), "wgmma: dense, head_dim 64, warpgroups of rows");
  __shared__ int is_last;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16 *Qs, *Ks, *Vs, *kv0 = nullptr;
  float *lut_s;
  constexpr int KVST = WG ? BN * 64 : BN * SROW; /* elements per K or V stage */
  const int half = KH == 2 ? (int)threadIdx.x / NTH : 0;
  if (WG) { /* swizzled 64 x 64 K/V tiles first (each half's), 1024-byte aligned in the shared window */
    kv0 = (bf16 *)(smem_raw + ((WG_PAD - (smem_u32(smem_raw) & (WG_PAD - 1))) & (WG_PAD - 1)));
    Ks = kv0 + half * 2 * STAGES * KVST;
    Vs = Ks + STAGES * KVST;
    Qs = kv0 + KH * 2 * STAGES * KVST;
    lut_s = (float *)(Qs + BM * SROW);
  } else {
    Qs = (bf16 *)smem_raw;
    Ks = Qs + BM * SROW;
    Vs = Ks + STAGES * BN * SROW;
    lut_s = (float *)(Vs + STAGES * BN * SROW);
  }
  /* row r, 16-byte chunk cc of a K/V tile */
  auto kv_at = [](int r, int cc) { return WG ? r * 64 + ((cc ^ (r & 7)) << 3) : r * SROW + cc * 8; };

  /* tid: within the key half (all of the block but for WG 3); tida: the block's */
  const int tida = threadIdx.x, tid = KH == 2 ? tida % NTH : tida, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WN, wn = warp % WN;
  const int g = lane >> 2, t4 = lane & 3;
  const int h = blockIdx.y, H = a.H;

  /* ---- what this block computes */
  int qlen, q0, pos_off, kbeg, kend, eff = 1;
  size_t row0;
  const int32_t *table = nullptr;
  if (!PAGED) {
    int s = blockIdx.x / a.qtiles, start = a.cu[s];
    q0 = (blockIdx.x % a.qtiles + a.tile0) * BM;
    qlen = min(a.cu[s + 1], a.n_tokens) - start;
    if (start < 0 || q0 >= qlen || start + q0 >= a.q_hi || start + min(q0 + BM, qlen) <= a.q_lo) return;
    row0 = (size_t)start;
    pos_off = 0;
    /* key splits (never causal: td_cu_dense_splits) */
    int kmax = a.causal ? min(qlen, q0 + BM) : qlen;
    eff = min(a.n_splits, max(1, (kmax + BN - 1) / BN));
    if ((int)blockIdx.z >= eff) return;
    int chunk = ((kmax + eff - 1) / eff + BN - 1) / BN * BN;
    kbeg = blockIdx.z * chunk;
    kend = min(kmax, kbeg + chunk);
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
  /* the block's tiles (Q and the bias table are loaded when there are any);
   * WG 3: the first half of them to half 0, the rest to half 1 */
  const int blk_tiles = kend > kbeg ? (kend - kbeg + BN - 1) / BN : 0;
  if (KH == 2) {
    int mid = min(kend, kbeg + (blk_tiles + 1) / 2 * BN);
    if (half == 0) kend = mid;
    else kbeg = mid;
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
      if (blk_tiles > 0)
        for (int i = tida; i < lut_n2 + lut_n; i += NTA) {
          int k = i < lut_n ? i : i < lut_n2 ? lut_n - 1 : i - lut_n2 + 1;
          lut_s[i] = src[min(max(k - LUT_PAD, 0), 2 * md)] * LOG2E;
        }
    } else {
      L = src;
    }
  }

  /* ---- loads (none for an empty split) */
  auto load_q = [&]() {
    for (int c = tida; c < (blk_tiles > 0 ? BM * CH : 0); c += NTA) {
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
  /* a thread's rows of a tile lie NTH / CH rows apart (a multiple of the
   * swizzle's 8): its offsets in a stage are one start plus multiples */
  static_assert(PAGED || (NTH / CH) % 8 == 0, "dense loads: the swizzle repeats every 8 rows");
  constexpr int RSTEP = (NTH / CH) * (WG ? 64 : SROW);
  const size_t tile_step = (size_t)BN * qkv_row, row_step = (size_t)(NTH / CH) * qkv_row;
  const int kv_so = kv_at(tid / CH, tid % CH);
  auto load_kv = [&](int kt, int st) {
    int key0 = kbeg + kt * BN;
    bf16 *ks = Ks + st * KVST, *vs = Vs + st * KVST;
    if (!PAGED) {
      const bf16 *kp = kdense + (size_t)kt * tile_step;
      if (key0 + BN <= kend) { /* a whole tile: no predicates, this thread's offsets fixed */
#pragma unroll
        for (int i = 0; i < BN * CH / NTH; i++) {
          const bf16 *src = kp + i * row_step;
          cp_async16(ks + kv_so + i * RSTEP, src, true);
          cp_async16(vs + kv_so + i * RSTEP, src + (size_t)H * DH, true);
        }
        return;
      }
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
  auto load_qf = [&]() {
#pragma unroll
    for (int dk = 0; dk < DK; dk++)
      ldsm_x4(qf[dk][0], qf[dk][1], qf[dk][2], qf[dk][3],
              Qs + (wm * 16 + (lane & 15)) * SROW + dk * 16 + (lane >> 4) * 8);
  };

  /* scale, bias, masks (log2 domain), the online softmax of tile kt's
   * scores; alpha: the factor O must take before this tile's P.V */
  const float sf = a.lut || !(a.scale_log2 > 0.0f) ? 1.0f : a.scale_log2;
  auto soften = [&](float(&sc)[NT][4], int kt, float(&alpha)[2]) {
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
    } else if (sf == 1.0f) { /* else raw scores: the scale is folded into the exponent's FMA below */
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

    /* online softmax; a thread holds rows g and g+8, a quad shares a row.
     * m_r is in the log2 domain; without a bias the row maximum is taken
     * over the raw scores (the scale is positive) and each exponent is one
     * FMA, exp2(s * scale - m), instead of a multiply and a subtraction. */
#pragma unroll
    for (int r = 0; r < 2; r++) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < NT; j++) mx = fmaxf(mx, fmaxf(sc[j][2 * r], sc[j][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      mx = fmaxf(m_r[r], mx * sf);
      float mu = mx == -INFINITY ? 0.0f : mx;
      alpha[r] = fast_exp2(m_r[r] - mu);
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < NT; j++) {
        float p0 = fast_exp2(fmaf(sc[j][2 * r], sf, -mu)), p1 = fast_exp2(fmaf(sc[j][2 * r + 1], sf, -mu));
        sc[j][2 * r] = p0;
        sc[j][2 * r + 1] = p1;
        sum += p0 + p1;
      }
      l_r[r] = l_r[r] * alpha[r] + sum;
      m_r[r] = mx;
    }
  };
  /* once the row maxima settle, alpha is 1: skip the rescale */
  auto rescale = [&](const float(&alpha)[2]) {
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
      for (int d = 0; d < DT; d++) {
        o[d][0] *= alpha[0];
        o[d][1] *= alpha[0];
        o[d][2] *= alpha[1];
        o[d][3] *= alpha[1];
      }
    }
  };

  if constexpr (WG >= 2) {
    /* Tile kt: the scores of tile kt + 1 go to the tensor cores first,
     * then tile kt's P.V; tile kt + 1's softmax runs beside that P.V. At
     * the end of a tile no product is in flight (ptxas serialises every
     * product when an accumulator is live across the loop's edge). Stage of
     * tile j: j % STAGES, reloaded once every warpgroup (of the key half)
     * left tile j. */
    float sc[NT][4], alpha[2];
    uint32_t pa[KS][4];
    float(&s32)[32] = *reinterpret_cast<float(*)[32]>(&sc[0][0]);
    float(&o32)[32] = *reinterpret_cast<float(*)[32]>(&o[0][0]);
    /* the first product overwrites: no zeroing of an accumulator */
    /* stage st's tiles: the first stage's descriptors plus st stages (16-byte units) */
    const uint64_t kd0 = k_desc(Ks), vd0 = v_desc(Vs);
    constexpr uint32_t ST16 = KVST * sizeof(bf16) / 16;
    auto issue_s = [&](int kt) {
      load_qf();
      scores_issue<DK>(s32, qf, kd0 + (uint64_t)((kt % STAGES) * ST16), true);
    };
    auto issue_pv = [&](int kt) { pv_issue<KS>(o32, pa, vd0 + (uint64_t)((kt % STAGES) * ST16)); };
    /* a tile's barrier: the key half's threads (named barrier 1 + half) */
    auto bar_tile = [&]() {
      if constexpr (KH == 2) {
        if (half == 0) asm volatile("bar.sync 1, %0;\n" ::"n"(NTH) : "memory");
        else asm volatile("bar.sync 2, %0;\n" ::"n"(NTH) : "memory");
      } else {
        __syncthreads();
      }
    };
    if (KH == 2 || n_tiles > 0) { /* the halves meet here even when one has no tiles */
      cp_async_wait<STAGES - 2>(); /* Q (every thread's share) and tile 0 */
      fence_proxy_async();
      __syncthreads();
    }
    if (n_tiles > 0) {
      wg_hold(o32); /* zeroed before any product is in flight */
      issue_s(0);
      wg_wait<0>();
      wg_hold(s32);
      soften(sc, 0, alpha);
      p_frags<KS>(pa, sc);
      for (int kt = 0; kt + 1 < n_tiles; kt++) {
        cp_async_wait<STAGES - 3>(); /* tile kt + 1 */
        fence_proxy_async();
        bar_tile();
        if (kt + STAGES - 1 < n_tiles) load_kv(kt + STAGES - 1, (kt + STAGES - 1) % STAGES);
        cp_async_commit();
        issue_s(kt + 1);
        rescale(alpha);
        issue_pv(kt);
        wg_wait<1>(); /* tile kt + 1's scores */
        wg_hold(s32);
        soften(sc, kt + 1, alpha);
        wg_wait<0>(); /* tile kt's P.V */
        wg_hold(o32);
        wg_hold(pa);
        p_frags<KS>(pa, sc);
      }
      rescale(alpha);
      issue_pv(n_tiles - 1);
      wg_wait<0>();
      wg_hold(o32);
    }
    if constexpr (KH == 2) {
      /* half 1's state through half 0's stages, then half 0 merges it:
       * the row maxima, sums and outputs rescaled to the larger maximum */
      cp_async_wait<0>();
      __syncthreads();
      float *mg = (float *)kv0;
      if (half == 1) {
#pragma unroll
        for (int i = 0; i < 32; i++) mg[i * NTH + tid] = o32[i];
#pragma unroll
        for (int r = 0; r < 2; r++) {
          mg[(32 + r) * NTH + tid] = m_r[r];
          mg[(34 + r) * NTH + tid] = l_r[r];
        }
      }
      __syncthreads();
      if (half == 1) return;
      float f0[2], f1[2];
#pragma unroll
      for (int r = 0; r < 2; r++) {
        float m1 = mg[(32 + r) * NTH + tid], l1 = mg[(34 + r) * NTH + tid], m = fmaxf(m_r[r], m1);
        f0[r] = m_r[r] == -INFINITY ? 0.0f : exp2f(m_r[r] - m);
        f1[r] = m1 == -INFINITY ? 0.0f : exp2f(m1 - m);
        l_r[r] = l_r[r] * f0[r] + l1 * f1[r];
        m_r[r] = m;
      }
#pragma unroll
      for (int i = 0; i < 32; i++) o32[i] = o32[i] * f0[(i & 3) >> 1] + mg[i * NTH + tid] * f1[(i & 3) >> 1];
    }
  } else {
    for (int kt = 0; kt < n_tiles; kt++) {
      if (early && kt == 0) cp_async_wait<0>();
      else cp_async_wait<STAGES - 2>();
      if (WG != 0) fence_proxy_async();
      __syncthreads();
      if (kt + STAGES - 1 < n_tiles) load_kv(kt + STAGES - 1, (kt + STAGES - 1) % STAGES);
      cp_async_commit();
      /* wgmma: reloaded per tile (ptxas does not keep register A operands
       * that are only conditionally loaded live across the loop) */
      if (WG != 0 || kt == 0) load_qf();
      const bf16 *ks = Ks + (kt % STAGES) * KVST, *vs = Vs + (kt % STAGES) * KVST;

      /* S = Q K^T for this warp's keys */
      float sc[NT][4];
#pragma unroll
      for (int j = 0; j < NT; j++) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
      if constexpr (WG != 0) scores_wgmma<DK>(sc, qf, ks);
      else scores_mma<DK, NT, KW, SROW>(sc, qf, ks, wn);

      float alpha[2];
      soften(sc, kt, alpha);
      rescale(alpha);

      /* O += P V */
      if constexpr (WG != 0) {
        uint32_t pa[KS][4];
        p_frags<KS>(pa, sc);
        pv_wgmma<KS>(o, pa, vs);
      }
      else pv_mma<DH, KS, KW, SROW>(o, sc, vs, wn);
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int r = 0; r < 2; r++) {
    l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 1);
    l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 2);
  }

  /* key splits: the last split block of this (query tile, head) merges the partials */
  const bool split = eff > 1;
  auto merge = [&]() {
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
  };

  if (WN == 1 && split) { /* each row's partial output and its log-sum-exp */
#pragma unroll
    for (int r = 0; r < 2; r++) {
      int qi = q0 + wm * 16 + g + 8 * r;
      if (qi >= qlen) continue;
      size_t pi = ((row0 + qi) * H + h) * a.n_splits + blockIdx.z;
      float inv = l_r[r] > 0.0f ? 1.0f / l_r[r] : 0.0f;
#pragma unroll
      for (int d = 0; d < DT; d++)
        *(float2 *)(a.part_o + pi * DH + d * 8 + 2 * t4) = make_float2(o[d][2 * r] * inv, o[d][2 * r + 1] * inv);
      if (t4 == 0) a.part_lse[pi] = l_r[r] > 0.0f ? m_r[r] + log2f(l_r[r]) : -INFINITY;
    }
    merge();
    return;
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
  if (split) merge();
}

template <int DH, int WM, int WN, int STAGES, int MINB, bool PAGED, int WG>
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

template <int DH, int WM, int WN, int STAGES, int MINB, bool PAGED, int WG>
static void launch(Cfg<DH, WM, WN, STAGES, MINB, PAGED, WG> cfg, dim3 grid, size_t lut, const td_cuda *c,
                   const AttnArgs &a) {
  (void)td_launch(c, attn_kernel<DH, WM, WN, STAGES, MINB, PAGED, WG>, grid, 32 * WM * WN * attn_halves(WG),
                  attn_smem_base(cfg) + lut, a);
}

#endif
