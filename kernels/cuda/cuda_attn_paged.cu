/* td_attn_paged: queries over the paged K/V pools (decoder self- and
 * cross-attention). td_cu_paged_policy (cuda_policy.c) picks the kernel:
 * the decode kernels on warps or bulk copies (cuda_attn_decode_*.cu), the
 * tiled kernel with its key splits (cuda_attn_tiled.cuh), or the generic
 * one; this file fills their arguments and launches. */
#include "kernels/cuda/cuda_attn_tiled.cuh"

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

td_status td_cu_attn_paged_init(td_cuda *c) {
  TD_TRY(set_smem(c, Paged64()));
  return set_smem(c, Paged128());
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
  a.layer_off = td_kv_layer_span(l, layer).off;
  a.kv8 = l->int8;
  a.bs = bs;
  a.q_start = m->q_start;
  a.ctx_len = m->ctx_len;
  a.block_table = m->block_table;
  a.max_blocks = m->max_blocks;
  a.kv_static = m->kv_static;
  a.kv_past = m->kv_static_past;
  a.pdl_late = c->tune.pdl_late > 0 && (c->tune.pdl_late & 1) != 0;
  a.n_splits = 1;
  td_paged_shape sh = {};
  sh.n_seqs = m->n_seqs;
  sh.n_tokens = m->n_tokens;
  sh.heads = H;
  sh.head_dim = dh;
  sh.max_q = max_q;
  sh.max_ctx = max_ctx;
  sh.causal = causal;
  sh.kv_static = m->kv_static;
  sh.kv_static_past = m->kv_static_past;
  sh.q_ok = ldq % 8 == 0 && td_aligned16(q);
  sh.out_ok = td_aligned16(out);
  sh.pool_ok = td_aligned16(pool);
  sh.blocks_ok = a.block_elems % 8 == 0; /* every block 16-byte aligned (a states tail may not keep it) */
  sh.q_norm = m->q_norm != NULL;
  sh.q_norm_vec = m->q_norm_dim % 8 == 0 && td_aligned16(m->q_norm);
  sh.kv8 = l->int8 != 0;
  const td_paged_plan p = td_cu_paged_policy(&c->tune, c->sm_count, &sh);
  /* the query norm: in the decode kernels, else q scaled into the staging
   * buffer first (used otherwise only by synchronous copies) */
  if (p.qn_inside) {
    a.qn = (const bf16 *)m->q_norm;
    a.qn_dim = m->q_norm_dim;
    a.qn_eps = m->q_norm_eps;
  } else if (p.qn_before) {
    int width = H * dh;
    if ((size_t)m->n_tokens * width * sizeof(bf16) > TD_CU_STAGE_BYTES)
      return td_err(TD_ERR_UNSUPPORTED, "attn_paged: %d query rows of %d too many for the query norm", m->n_tokens,
                    width);
    bf16 *qs = (bf16 *)c->stage;
    (void)td_launch(c, q_norm_kernel, (unsigned)m->n_tokens, 256, 0, (const bf16 *)q, ldq, (const bf16 *)m->q_norm,
                    m->q_norm_dim, m->q_norm_eps, qs, width);
    TD_CU_LAUNCHED("attn_paged (query norm)");
    a.q = qs;
    a.ldq = width;
  }
  const long pairs = (long)m->n_seqs * H;
  if (p.kernel == TD_PAGED_GENERIC) {
    a.qtiles = p.qtiles;
    long rows = (long)m->n_seqs * max_q;
    td_cu_attn_generic(c, dim3((unsigned)((rows + 3) / 4), (unsigned)H), a, dh, true);
    TD_CU_LAUNCHED("attn_paged");
    return TD_OK;
  }
  if (p.kernel == TD_PAGED_BULK) {
    td_cu_attn_decode_bulk(c, p, pairs, a);
    TD_CU_LAUNCHED("attn_paged");
    return TD_OK;
  }
  if (p.kernel != TD_PAGED_TILED) {
    td_cu_attn_decode_warp(c, p.kernel, p.early, pairs, a);
    TD_CU_LAUNCHED("attn_paged");
    return TD_OK;
  }
  a.qtiles = p.qtiles;
  const int splits = p.splits;
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
