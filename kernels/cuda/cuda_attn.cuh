/* Attention on tensor cores (mma.sync m16n8k16 bf16, float32 accumulation,
 * online softmax in the exp2 domain), FlashAttention-2 style; one file a
 * kernel family, as ggml-cuda's fattn-*.cuh:
 *
 *  - cuda_attn_tiled.cuh: the tiled kernel. Dense: packed variable-length
 *    sequences (cu_seqlens), 128 query rows per block for head_dim 64
 *    (8 warps x 16 rows, on wgmma or mma.sync; 64 for head_dim 128), K/V
 *    tiles of 64 keys in a cp.async pipeline; ceil(max_len / rows) blocks
 *    per sequence, those past its real length exit at once. Paged: queries
 *    of a sequence (16 rows per block) over K/V gathered from paged blocks
 *    through the block table, 3 cp.async stages; the 4 warps split each
 *    64-key tile and merge their softmax states at the end, so decode
 *    (1 query row) keeps every warp loading. When few blocks would run,
 *    the keys are split over gridDim.z (flash-decoding); the last block of
 *    each (query tile, head) to finish (arrival counter) merges the
 *    partials by their log-sum-exp. Real lengths come from device ctx_len /
 *    q_start: the grid is sized from the host bounds max_q / max_ctx, and
 *    blocks beyond what the real lengths need exit at once.
 *  - cuda_attn_generic.cu: other head sizes or unaligned buffers, a warp a
 *    query row, the same semantics.
 *  - cuda_attn_decode.cuh, cuda_attn_decode_warp.cu, cuda_attn_decode_bulk.cu:
 *    paged decode (one query a sequence, head_dim 64) on warps, and fed by
 *    bulk copies.
 *  - cuda_attn_dense.cu, cuda_attn_paged.cu: the ops, which take their
 *    kernel from the launch policy (cuda_policy.c).
 *
 * The T5 relative bias is looked up per score from the head's LUT (copied
 * to shared memory), never materialised. */
#ifndef TD_KERNELS_CUDA_ATTN_CUH
#define TD_KERNELS_CUDA_ATTN_CUH

#include <math.h>

#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/cuda_ptx.cuh"

#define LOG2E 1.4426950408889634f
/* The bias table goes to shared memory pre-scaled by log2(e) and padded
 * with LUT_PAD saturated entries each side, so that a row's keys of a tile
 * read it from one clamped start without per-key checks; a second copy
 * shifted by one entry lets every row read key pairs as aligned float2. */
enum { LUT_CAP = 1024, BN = TD_CU_ATTN_BN, LUT_PAD = 64 };

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
  int q_lo, q_hi; /* dense: the query rows wanted (tiles wholly outside are skipped) */
  int tile0;      /* dense, one sequence: the first query tile of the grid */
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
  int kv8;        /* paged: int8 K/V with per-row scales (td_kv_layout.int8): the decode and generic kernels */
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

enum { GEN_MAX_DH = TD_CU_ATTN_MAX_DH };

/* Shared memory of the bias table for the tiled kernel: two copies, the
 * second at an even offset; 0 where it stays in global memory. */
static inline size_t lut_bytes(const td_relbias *bias) {
  size_t n = bias ? (size_t)(2 * bias->max_distance + 1 + 2 * LUT_PAD) : 0;
  return n && n <= LUT_CAP ? (2 * n + (n & 1)) * sizeof(float) : 0; /* two copies, the second at an even offset */
}

/* The kernel families' launchers (one file each). */
void td_cu_attn_generic(const td_cuda *c, dim3 grid, const AttnArgs &a, int DH, bool paged);
void td_cu_attn_decode_warp(const td_cuda *c, td_paged_kernel k, bool early, long pairs, const AttnArgs &a);
void td_cu_attn_decode_bulk(const td_cuda *c, const td_paged_plan &p, long pairs, const AttnArgs &a);

#endif
