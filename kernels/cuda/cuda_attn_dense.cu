/* td_attn_dense: the encoder's and the prefill's attention over packed
 * sequences, on the tiled kernel (cuda_attn_tiled.cuh) or the generic one. */
#include "kernels/cuda/cuda_attn_tiled.cuh"

td_status td_cu_attn_dense_init(td_cuda *c) {
  TD_TRY(set_smem(c, Dense64w()));
  TD_TRY(set_smem(c, Dense64p()));
  TD_TRY(set_smem(c, Dense64p1()));
  TD_TRY(set_smem(c, Dense64h()));
  TD_TRY(set_smem(c, Dense64()));
  TD_TRY(set_smem(c, Dense64s()));
  return set_smem(c, Dense128());
}

td_status td_cu_attn_dense(td_backend *b, const void *qkv, void *out, const int32_t *cu_seqlens, int n_seqs,
                           int n_tokens, int max_len, int heads, int head_dim, float scale, bool causal,
                           const td_relbias *bias, int q_lo, int q_hi) {
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
  a.q_lo = q_lo;
  a.q_hi = q_hi;
  a.n_splits = 1;
  td_dense_plan p =
      td_cu_dense_policy(&c->tune, head_dim, td_aligned16(qkv) && td_aligned16(out), n_tokens, max_len);
  a.qtiles = p.qtiles; /* query tiles per sequence */
  if (n_seqs == 1 && p.kernel != TD_DENSE_GENERIC) { /* only the tiles of the rows wanted */
    a.tile0 = q_lo / p.rows;
    a.qtiles = (q_hi + p.rows - 1) / p.rows - a.tile0;
  }
  long blocks = (long)n_seqs * a.qtiles * heads;
  int keys = n_seqs == 1 ? n_tokens : max_len > 0 && max_len < n_tokens ? max_len : n_tokens;
  /* the halves form merges its own two halves and leaves no warps for the last block's merge */
  int splits = p.kernel == TD_DENSE_GENERIC || p.kernel == TD_DENSE_64_HALVES
                   ? 1
                   : td_cu_dense_splits(&c->tune, blocks, keys, causal);
  /* the partial outputs (by token, head and split) and one counter a (tile, head) must fit */
  if (splits > 1 && ((size_t)n_tokens * heads * splits * (head_dim + 1) * sizeof(float) > TD_CU_SPLIT_BYTES ||
                     (long)n_seqs * a.qtiles * heads > TD_CU_ATTN_COUNTERS))
    splits = 1;
  if (splits > 1) {
    a.n_splits = splits;
    a.part_o = c->split;
    a.part_lse = c->split + (size_t)n_tokens * heads * splits * head_dim;
    a.counters = c->counters + TD_CU_GEMM_COUNTERS;
  }
  p.kernel = td_cu_dense_fit(&c->tune, p.kernel, blocks, splits, c->sm_count);
  dim3 grid((unsigned)((long)n_seqs * a.qtiles), (unsigned)heads, (unsigned)splits);
  switch (p.kernel) {
    case TD_DENSE_64_WGMMA: launch(Dense64w(), grid, lut_bytes(bias), c, a); break;
    case TD_DENSE_64_PIPE: launch(Dense64p(), grid, lut_bytes(bias), c, a); break;
    case TD_DENSE_64_PIPE1: launch(Dense64p1(), grid, lut_bytes(bias), c, a); break;
    case TD_DENSE_64_HALVES: launch(Dense64h(), grid, lut_bytes(bias), c, a); break;
    case TD_DENSE_64: launch(Dense64(), grid, lut_bytes(bias), c, a); break;
    case TD_DENSE_64_SMALL: launch(Dense64s(), grid, lut_bytes(bias), c, a); break;
    case TD_DENSE_128: launch(Dense128(), grid, lut_bytes(bias), c, a); break;
    case TD_DENSE_GENERIC:
      td_cu_attn_generic(c, dim3((unsigned)((n_tokens + 3) / 4), (unsigned)heads), a, head_dim, false);
      break;
  }
  TD_CU_LAUNCHED("attn_dense");
  return TD_OK;
}
