#include "kernels/cuda/cuda_policy.h"

#include <limits.h>
#include <stddef.h>

#include "common/defaults.h"

/* td_cuda_tuning's conventions: a switch 0 takes its default; a count 0
 * its default, below 0 (TD_OFF) none */
static bool on(int v, bool def) { return v == 0 ? def : v > 0; }
static int count(int v, int def) { return v == 0 ? def : v < 0 ? 0 : v; }

void td_cu_tune_resolve(const td_cuda_tuning *t, td_cu_tune *r) {
  r->verbose = on(t->verbose, false);
  r->autotune = on(t->autotune, false);
  r->autotune_min = count(t->autotune_min, TD_CUDA_DEFAULT_AUTOTUNE_MIN);
  r->pdl = on(t->pdl, true);
  r->pdl_late = t->pdl_late == 0 ? -1 : t->pdl_late < 0 ? 0 : t->pdl_late;
  r->skinny = on(t->skinny, true);
  r->skinny_bulk = on(t->skinny_bulk, true);
  r->weight_hint = on(t->weight_hint, true);
  int rows = count(t->skinny_rows, TD_CUDA_DEFAULT_SKINNY_ROWS);
  r->skinny_rows = rows < 8 ? 8 : rows > 16 ? 16 : rows;
  r->gemv_maxv = count(t->gemv_maxv, TD_CUDA_DEFAULT_GEMV_MAXV);
  r->gemv_maxn = count(t->gemv_maxn, TD_CUDA_DEFAULT_GEMV_MAXN);
  r->gemv_rows = r->gemv_maxv > 0 ? count(t->gemv_rows, TD_CUDA_DEFAULT_GEMV_ROWS) : 0;
  r->gemv_rows_n = count(t->gemv_rows_n, TD_CUDA_DEFAULT_GEMV_ROWS_N);
  int fuse = count(t->fuse_rows, TD_CUDA_DEFAULT_FUSE_ROWS);
  r->fuse = fuse > TD_CU_FUSE_MAX_ROWS ? TD_CU_FUSE_MAX_ROWS : fuse;
  r->fuse_mask = count(t->fuse_mask, TD_CUDA_DEFAULT_FUSE_MASK) & 15;
  int d64 = t->dense64_warps;
  r->dense64_warps = (d64 >= 1 && d64 <= 5) || d64 == 8 ? d64 : 0;
  r->dense64_wave = t->dense64_wave == 2 || t->dense64_wave == 5 ? t->dense64_wave : TD_CUDA_DEFAULT_DENSE64_WAVE;
  r->dense_splits = t->dense_splits > 0 && t->dense_splits <= 8 ? t->dense_splits : 0;
  r->decode_warp = count(t->decode_warp, TD_CUDA_DEFAULT_DECODE_WARP);
  r->decode_small = count(t->decode_small, TD_CUDA_DEFAULT_DECODE_SMALL);
  r->decode_small_min = count(t->decode_small_min, TD_CUDA_DEFAULT_DECODE_SMALL_MIN);
  r->decode_small_ctx = count(t->decode_small_ctx, TD_CUDA_DEFAULT_DECODE_SMALL_CTX);
  r->decode_bulk = count(t->decode_bulk, TD_CUDA_DEFAULT_DECODE_BULK);
  r->decode_bulk_all = count(t->decode_bulk_all, TD_CUDA_DEFAULT_DECODE_BULK_ALL);
  r->decode_bulk_shape = t->decode_bulk_shape > 0 ? t->decode_bulk_shape : 0;
  r->decode_bulk_early = count(t->decode_bulk_early, TD_CUDA_DEFAULT_DECODE_BULK_EARLY);
  int carve = t->decode_bulk_carve == 0 ? TD_CUDA_DEFAULT_DECODE_BULK_CARVE : t->decode_bulk_carve;
  r->decode_bulk_carve = carve > 100 ? 100 : carve < 0 ? -1 : carve;
  r->kvpf_seqs = count(t->kvpf_seqs, TD_CUDA_DEFAULT_KVPF_SEQS);
  r->kvpf_mb = t->kvpf_mb == 0 ? -1 : t->kvpf_mb < 0 ? 0 : t->kvpf_mb;
  r->states_generic = on(t->states_generic, false);
  r->states_ws = on(t->states_ws, true);
  r->states_planes = on(t->states_planes, true);
  r->states_waves = on(t->states_waves, true);
  r->states_pl32 = on(t->states_pl32, true);
  r->states_splits = t->states_splits > 0 ? t->states_splits : 0;
  r->states_warps = t->states_warps == 8 || t->states_warps == 16 ? t->states_warps : 0;
  r->heads_lt = on(t->heads_lt, false);
  r->custom_allreduce = on(t->custom_allreduce, true);
  r->fuse_allreduce = on(t->fuse_allreduce, true);
  r->custom_allgather = on(t->custom_allgather, true);
  r->plan_bucket = on(t->plan_bucket, true);
}

td_dense_plan td_cu_dense_policy(const td_cu_tune *t, int head_dim, bool aligned, int n_tokens, int max_len) {
  td_dense_plan p = {TD_DENSE_GENERIC, 0, 0};
  if (!aligned || (head_dim != 64 && head_dim != 128)) return p;
  /* block rows: 16 per warp along queries; the tile map uses the same count */
  bool wide = head_dim == 64 && t->dense64_warps != 4;
  int bm = wide ? 128 : 64, len = max_len < 1 || max_len > n_tokens ? n_tokens : max_len;
  p.qtiles = (len + bm - 1) / bm; /* max_len bounds every length */
  p.rows = bm;
  int k = t->dense64_warps;
  p.kernel = wide && (k == 0 || k == 1) ? TD_DENSE_64_PIPE
             : wide && k == 2           ? TD_DENSE_64_PIPE1
             : wide && k == 5           ? TD_DENSE_64_HALVES
             : wide && k == 3           ? TD_DENSE_64_WGMMA
             : wide                     ? TD_DENSE_64
             : head_dim == 64             ? TD_DENSE_64_SMALL
                                          : TD_DENSE_128;
  return p;
}

/* By default the pipelined wgmma kernel runs two blocks an SM, and where
 * the whole grid fits in one wave of one block an SM, one block of 16 warps
 * whose two halves take half the keys each (dense64_wave 5): a TP=2 rank's
 * 750 query rows of a 1500-position input (120 blocks) 24.9 us against 27.4
 * at one block of 8 warps and 36.4 at two an SM; one BART-large input of
 * 512 (64 blocks) 10.8 against 11.2; of 352 (48) 9.5 against 9.2 (level);
 * TP=1's 240 blocks 42.1 at two an SM against 53.2 at one (H200,
 * bench/RESULTS.md). */
td_dense_kernel td_cu_dense_fit(const td_cu_tune *t, td_dense_kernel k, long blocks, int splits, int sms) {
  if (t->dense64_warps != 0 || k != TD_DENSE_64_PIPE || blocks <= 0 || blocks * splits > sms) return k;
  /* the halves form splits a block's keys itself: never beside key splits */
  return t->dense64_wave == 5 && splits == 1 ? TD_DENSE_64_HALVES : TD_DENSE_64_PIPE1;
}

/* Key splits of dense attention only when asked for (dense_splits > 1):
 * they timed slower wherever measured, where two blocks would share an SM
 * (the 120 blocks of a TP=2 rank's 1500-position Whisper encoder: 29.6 us
 * alone, 36.7 us as 240 halves) and where half the SMs idled (BART-large,
 * one input of 512: an encoder of 0.98 ms against 0.87; H200,
 * bench/RESULTS.md). Never for causal prefill. */
int td_cu_dense_splits(const td_cu_tune *t, long blocks, int keys, bool causal) {
  if (causal || blocks <= 0 || t->dense_splits <= 1) return 1;
  int most = keys / 256 > 1 ? keys / 256 : 1; /* at least four 64-key tiles a split */
  return t->dense_splits < most ? t->dense_splits : most;
}

/* Decode, one query a sequence, on warps: over self K/V with enough
 * (sequence, head) pairs, two warps a pair; with fewer pairs, 2-8 warps a
 * pair by the context bound, and 16 for longer contexts when the pairs are
 * neither too many nor too few and the context not too long (decode_small*):
 * elsewhere the tiled kernel's key splits spread the K/V over more SMs.
 * Many pairs over static K/V: a pair a block, K/V by bulk copies (the
 * kv_static_past re-read of the query's own key is the warp kernels'); over
 * self K/V too up to decode_bulk_all pairs. Why each bound sits where it
 * does: docs/cuda.md, "The decode policy". */
static td_paged_kernel decode_kernel(const td_cu_tune *t, const td_paged_shape *s, bool fast) {
  long pairs = (long)s->n_seqs * s->heads;
  if (!fast || s->head_dim != 64 || s->max_q != 1 || t->decode_warp <= 0) return TD_PAGED_TILED;
  bool small = t->decode_small > 0 && pairs < (long)t->decode_warp;
  if (t->decode_bulk > 0 && pairs >= t->decode_bulk && (s->kv_static || pairs <= t->decode_bulk_all) &&
      pairs <= 2147483647L)
    return TD_PAGED_BULK;
  if (!s->kv_static && pairs >= (long)t->decode_warp) return TD_PAGED_W2P4;
  if (small && s->max_ctx <= 64) return TD_PAGED_W2P4;
  if (small && s->max_ctx <= 128) return TD_PAGED_W4P2;
  if (small && s->max_ctx <= 256) return TD_PAGED_W8;
  if (small && pairs <= t->decode_small && pairs >= t->decode_small_min && s->max_ctx <= t->decode_small_ctx)
    return TD_PAGED_W16;
  return TD_PAGED_TILED;
}

td_paged_plan td_cu_paged_policy(const td_cu_tune *t, int sm_count, const td_paged_shape *s) {
  td_paged_plan p = {0};
  p.carve = -1;
  p.splits = 1;
  const int dh = s->head_dim, H = s->heads;
  bool fast = (dh == 64 || dh == 128) && s->q_ok && s->out_ok && s->pool_ok && s->blocks_ok;
  td_paged_kernel dec = decode_kernel(t, s, fast);
  /* int8 K/V: where the tiled kernel would split the keys, 16 warps a pair;
   * the tiled kernel reads bf16 only */
  if (s->kv8 && dec == TD_PAGED_TILED && fast && dh == 64 && s->max_q == 1 && t->decode_warp > 0)
    dec = (long)s->n_seqs * H >= (long)t->decode_warp ? TD_PAGED_W2P4 : TD_PAGED_W16;
  if (s->kv8 && dec == TD_PAGED_TILED) fast = false;
  bool decode = dec != TD_PAGED_TILED;
  /* the query norm: in the decode kernels (aligned rows), else q scaled
   * into the staging buffer first, whose rows are dense and aligned */
  p.qn_inside = s->q_norm && decode && s->q_norm_vec;
  p.qn_before = s->q_norm && !p.qn_inside;
  if (p.qn_before) fast = (dh == 64 || dh == 128) && H * dh % 8 == 0 && s->out_ok && s->pool_ok && s->blocks_ok;
  if (s->kv8 && !decode) fast = false;
  if (!fast) {
    p.kernel = TD_PAGED_GENERIC;
    p.qtiles = s->max_q;
    return p;
  }
  long pairs = (long)s->n_seqs * H;
  if (decode) {
    p.kernel = dec;
    /* early loads: all of a static K/V, or the keys before the query
     * (causal self-attention); on the bulk kernel up to decode_bulk_early
     * pairs (beyond, they crowd the QKV GEMM's weight stream) */
    bool st = s->kv_static || (s->kv_static_past && s->causal);
    p.early = dec == TD_PAGED_BULK ? s->kv_static || (st && pairs <= t->decode_bulk_early) : st;
    if (dec == TD_PAGED_BULK) {
      /* two warps (16 KB of slots, eight blocks an SM) when the pairs would
       * not all be resident with four (32 KB, six an SM), so that they run
       * in one wave; up to three blocks an SM, an L1 carveout holds them */
      int shape = t->decode_bulk_shape ? t->decode_bulk_shape : pairs > 6L * sm_count ? 2 : 1;
      p.bulk_warps = shape == 2 || shape == 3 ? 2 : 4;
      p.bulk_slots = shape == 3 ? 3 : 2;
      p.carve = t->decode_bulk_carve >= 0 && shape == 1 && pairs <= 3L * sm_count ? t->decode_bulk_carve : -1;
    }
    return p;
  }
  p.kernel = TD_PAGED_TILED;
  p.qtiles = (s->max_q + 15) / 16;
  long base = (long)s->n_seqs * p.qtiles * H;
  /* flash-decoding when few blocks would run: split the keys so that the
   * GPU fills; each (query tile, head) merges its splits in its last block */
  if (base < 2L * sm_count && base <= TD_CU_ATTN_COUNTERS) {
    int splits = (int)((2L * sm_count + base - 1) / base);
    int by_ctx = (s->max_ctx + TD_CU_ATTN_BN - 1) / TD_CU_ATTN_BN;
    splits = splits > by_ctx ? by_ctx : splits;
    splits = splits > 64 ? 64 : splits < 1 ? 1 : splits;
    size_t per = (size_t)s->n_tokens * H * (dh + 1) * sizeof(float);
    while (splits > 1 && per * splits > TD_CU_SPLIT_BYTES) splits--;
    p.splits = splits;
  }
  return p;
}

td_states_plan td_cu_states_policy(const td_cu_tune *t, int sm_count, const td_states_avail *k,
                                   const td_states_shape *s) {
  td_states_plan p = {0};
  p.kernel = TD_STATES_GENERIC;
  /* 8 warps where a kernel for this D exists, else 16 */
  td_states_kernel ci = k->has[TD_STATES_MMA8] ? TD_STATES_MMA8 : TD_STATES_MMA16;
  if (!k->has[ci] || !s->aligned || !s->kv_static || t->states_generic) return p;
  const int npairs = s->max_q * s->heads;
  p.groups = (npairs + 15) / 16;
  long base = (long)s->n_seqs * p.groups;
  /* More than 16 pairs a sequence (Whisper-large's 20 heads): each group of
   * 16 streamed all of the sequence's states, as many bytes as the per-layer
   * K/V at two groups. Groups of 32 pairs on a cluster of two blocks, each
   * holding half of D, read them once, where their blocks fill at least
   * half the SMs (no key splits: fewer sequences keep the split kernels). */
  if (t->states_pl32 && k->has[TD_STATES_PL32] && p.groups >= 2 && !t->states_warps && t->states_splits <= 0 &&
      k->clusters[TD_STATES_PL32][1] > 0) {
    const int g32 = (npairs + 31) / 32;
    const long blocks = (long)s->n_seqs * g32 * 2;
    if (2 * blocks >= sm_count) {
      p.kernel = TD_STATES_PL32;
      p.groups = g32;
      p.blocks = blocks;
      p.cluster = 2;
      p.n_splits = 1;
      return p;
    }
  }
  /* key splits: a cluster of that many blocks a group, merged in shared
   * memory; the most (a power of two, at most 8) that still fit the GPU in
   * one wave */
  int tiles = (s->max_ctx + TD_CU_STATES_TILE - 1) / TD_CU_STATES_TILE, splits = 1;
  if (t->states_splits > 0) {
    while (splits * 2 <= t->states_splits && splits * 2 <= TD_CU_STATES_MAX_SPLITS && splits * 2 <= tiles)
      splits *= 2;
  } else {
    for (int c = 1; c < TD_CU_STATES_CLUSTERS; c++)
      if ((1 << c) <= tiles && base * (1 << c) <= sm_count && base <= k->clusters[ci][c]) splits = 1 << c;
  }
  /* 16 warps where each block streams a quarter or more of a sequence's
   * states (its shorter phases then pay); 8 warps where the splits are
   * more: their blocks fit beside the W_k product's blocks and start
   * copying during it */
  int lg = 0;
  while ((1 << lg) < splits) lg++;
  bool w16 = t->states_warps ? t->states_warps == 16 : splits <= 2;
  /* of the 16-warp kernels, the warp-specialised one where its three
   * stages fit (D <= 1024) */
  td_states_kernel c16 = k->has[TD_STATES_WS] && t->states_ws ? TD_STATES_WS : TD_STATES_MMA16;
  td_states_kernel kern = ci;
  /* (a tuned count of warps or splits takes its kernel in waves too) */
  bool told = t->states_warps || t->states_splits > 0;
  if (w16 && k->has[c16] && lg < TD_CU_STATES_CLUSTERS && (told || base <= k->clusters[c16][lg])) kern = c16;
  /* two key splits on the warp-specialised kernel: D split instead, no merge */
  bool planes = kern == TD_STATES_WS && splits == 2 && k->has[TD_STATES_PL] && t->states_planes &&
                (told || base <= k->clusters[TD_STATES_PL][1]);
  /* More groups than one wave of 16-warp blocks holds: the warp-specialised
   * kernel in waves, or the plane pairs (half a sequence's work a block) in
   * waves, whichever takes fewer whole waves, a pair's wave counted as half
   * a 16-warp block's; the 8-warp kernel in waves was the slowest of the
   * three (H200, 2026-11-29: at 160 groups 78 us, 67 in 16-warp waves, 62 in
   * pairs; at 256 82, 79, 97). */
  const long ws1 = k->clusters[TD_STATES_WS][0], pl2 = k->clusters[TD_STATES_PL][1];
  if (t->states_waves && !told && kern == ci && splits == 1 && k->has[TD_STATES_WS] && t->states_ws && ws1 > 0 && base > ws1) {
    const bool pairs = k->has[TD_STATES_PL] && t->states_planes && pl2 > 0 && tiles >= 2 &&
                       (base + pl2 - 1) / pl2 < 2 * ((base + ws1 - 1) / ws1);
    kern = TD_STATES_WS;
    planes = pairs;
    splits = pairs ? 2 : 1;
  }
  if (planes) kern = TD_STATES_PL;
  p.kernel = kern;
  p.blocks = base * splits;
  p.cluster = splits;
  p.n_splits = planes ? 1 : splits;
  return p;
}

/* The crossover measured on H100 with Flan-T5-large (D 1024, docs/cuda.md,
 * "Cross-attention over encoder states"); above 1024 only on the 32-pair
 * plane kernel (Whisper-large's 1280: as two groups of 16 pairs a sequence
 * the states were slower than the K/V at every batch on an H200). */
int td_cu_states_switch_rows(int D, bool fits, bool fits32, bool kv8) {
  if (!fits || kv8 || D <= 0) return INT_MAX;
  return D <= 1024 || fits32 ? 48 : INT_MAX;
}

/* Above 1024 the 32-pair plane kernel streams a whole sequence a block pair
 * (no key splits), so a step pays whole waves of cap32 resident blocks:
 * it beat the K/V where the last wave was at least 80 % full (H200,
 * Whisper-large, 2026-11-29: 0.91x at 64 rows, 0.88x at 128) and lost at
 * 73 % (1.03x at 48, 1.01x at 96). */
bool td_cu_states_switch_takes(int D, int heads, bool fits, bool fits32, bool kv8, int rows, int cap32) {
  if (rows < td_cu_states_switch_rows(D, fits, fits32, kv8)) return false;
  if (D <= 1024) return true;
  if (heads <= 16 || cap32 <= 0) return false;
  const long blocks = 2L * rows * ((heads + 31) / 32), waves = (blocks + cap32 - 1) / cap32;
  return 2 * blocks >= cap32 && 5 * blocks >= 4 * waves * cap32;
}

/* Past a quarter of L2 the prefetched layer no longer waits there for its
 * attention and takes DRAM time from the kernels beside it: on an H200
 * steps were 5-33 % shorter without it from 17 MB a layer, 0.5-1.8 % longer
 * up to 10 MB (2026-11-29, bench/RESULTS.md). */
size_t td_cu_kvpf_bytes(const td_cu_tune *t, size_t l2_bytes) {
  if (t->kvpf_mb == 0) return 0;
  if (t->kvpf_mb > 0) return (size_t)t->kvpf_mb << 20;
  return l2_bytes / 4 > 0 ? l2_bytes / 4 : 1;
}

int td_cu_plan_rows(const td_cu_tune *t, int m) {
  if (!t->plan_bucket || m <= TD_CU_PLAN_EXACT_ROWS) return m;
  int lg = 0;
  while ((m >> (lg + 1)) > 0) lg++; /* 2^lg <= m < 2^(lg + 1) */
  long step = 1L << (lg - 3);
  long r = ((long)m + step - 1) / step * step;
  return r > INT_MAX ? m : (int)r;
}
