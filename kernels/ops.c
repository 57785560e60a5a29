#include <limits.h>

#include "kernels/ops.h"

#include <stdlib.h>
#include <string.h>

#include "kernels/backend_impl.h"

td_status td_backend_create(const td_backend_opts *opts, td_backend **out) {
  *out = NULL;
  switch (opts->kind) {
    case TD_BACKEND_CPU: return td_backend_cpu_create(opts, out);
    case TD_BACKEND_CUDA:
      if (!td_backend_cuda_available())
        return td_err(TD_ERR_UNSUPPORTED, "this build has no CUDA backend (nvcc was not found at build time)");
      return td_backend_cuda_create(opts, out);
  }
  return td_err(TD_ERR_INVALID, "unknown backend kind %d", (int)opts->kind);
}

td_status td_backend_memory_info(td_backend *b, td_backend_memory *out) {
  *out = (td_backend_memory){0};
  if (!b->vt->memory) return td_err(TD_ERR_UNSUPPORTED, "memory info: %s sizes its pools from the model", b->name);
  return b->vt->memory(b, out);
}

td_status td_backend_set_cuda_tuning(td_backend *b, const td_cuda_tuning *t) {
  if (!b->vt->set_cuda_tuning)
    return td_err(TD_ERR_UNSUPPORTED, "set_cuda_tuning: %s is not a CUDA backend", b->name);
  return b->vt->set_cuda_tuning(b, t);
}

void td_backend_destroy(td_backend *b) {
  if (b) b->vt->destroy(b);
}

td_backend_kind td_backend_get_kind(const td_backend *b) { return b->kind; }
const char *td_backend_name(const td_backend *b) { return b->name; }

size_t td_buf_elem_size(const td_backend *b, td_buf_type t) { return t == TD_BUF_ACT ? b->act_size : 4; }

/* one layer's K and V planes in elements; int8: H x bs x dh bytes a plane and
 * H x bs float scales a plane, in 2-byte elements */
static size_t layer_elems(const td_kv_layout *l) {
  size_t rows = (size_t)l->n_heads * (size_t)l->block_size;
  return l->int8 ? rows * ((size_t)l->head_dim + 4) : 2 * rows * (size_t)l->head_dim;
}

size_t td_kv_block_elems(const td_kv_layout *l) {
  return (size_t)l->n_layers * layer_elems(l) + (size_t)l->block_size * (size_t)l->states;
}

td_kv_span td_kv_layer_span(const td_kv_layout *l, int layer) {
  size_t off = (size_t)layer * layer_elems(l);
  if (layer == l->n_layers) return (td_kv_span){off, 1, l->states / 2};
  return (td_kv_span){off, l->n_heads, l->head_dim};
}

bool td_kv_layout_valid(const td_kv_layout *l) {
  return l && l->n_layers >= 0 && l->n_heads > 0 && l->head_dim > 0 && l->block_size > 0 && l->states >= 0 &&
         l->states % 2 == 0 && (l->n_layers > 0 || l->states > 0) &&
         (!l->int8 || (l->int8 == 1 && l->n_layers > 0 && l->head_dim % 16 == 0 && l->block_size % 4 == 0));
}

td_status td_alloc(td_backend *b, td_buf_type t, size_t n, void **out) {
  *out = NULL;
  return b->vt->alloc(b, (n ? n : 1) * td_buf_elem_size(b, t), out);
}
void td_free(td_backend *b, void *p) {
  if (p) b->vt->free(b, p);
}
td_status td_host_alloc(td_backend *b, size_t bytes, void **out) { return b->vt->host_alloc(b, bytes ? bytes : 1, out); }
void td_host_free(td_backend *b, void *p) {
  if (p) b->vt->host_free(b, p);
}
td_status td_upload(td_backend *b, td_buf_type t, void *dst, const float *src, size_t n) {
  return n ? b->vt->upload(b, t, dst, src, n) : TD_OK;
}
td_status td_download(td_backend *b, td_buf_type t, const void *src, float *dst, size_t n) {
  return n ? b->vt->download(b, t, src, dst, n) : TD_OK;
}
td_status td_copy_h2d(td_backend *b, void *dst, const void *src, size_t bytes) {
  return bytes ? b->vt->copy(b, dst, src, bytes, 0) : TD_OK;
}
td_status td_copy_d2h(td_backend *b, void *dst, const void *src, size_t bytes) {
  return bytes ? b->vt->copy(b, dst, src, bytes, 1) : TD_OK;
}
td_status td_copy_d2d(td_backend *b, void *dst, const void *src, size_t bytes) {
  return bytes ? b->vt->copy(b, dst, src, bytes, 2) : TD_OK;
}
td_status td_sync(td_backend *b) { return b->vt->sync(b); }

static td_status bad(const char *op, const char *what) {
  return td_err(TD_ERR_INVALID, "%s: %s", op, what);
}

td_status td_gemm(td_backend *b, const void *x, const void *w, const float *bias, void *y, int m, int n, int k,
                  td_act act, unsigned flags) {
  if (m < 0 || n <= 0 || k <= 0) return bad("gemm", "sizes must be positive");
  if (!x || !w || !y) return bad("gemm", "null buffer");
  if ((flags & TD_GEMM_ACCUM) && act != TD_ACT_NONE) return bad("gemm", "accumulate with an activation");
  if (m == 0) return TD_OK;
  return b->vt->gemm(b, x, w, bias, y, m, n, k, act, flags);
}

td_status td_gemm_ex(td_backend *b, const td_gemm_args *a) {
  if (!a) return bad("gemm_ex", "no arguments");
  bool glu = a->flags & TD_GEMM_GLU;
  if (a->m < 0 || a->n <= 0 || a->k <= 0 || !a->x || !a->w || !a->y) return bad("gemm_ex", "bad sizes or buffers");
  if ((a->flags & TD_GEMM_ACCUM) && (a->act != TD_ACT_NONE || glu)) return bad("gemm_ex", "accumulate with an activation");
  if (glu && ((a->n & 1) || !a->scratch_glu || (a->flags & TD_GEMM_OUT_F32))) return bad("gemm_ex", "GLU needs an even n, scratch and bf16/f32 activations");
  if ((a->norm_w || a->norm_plain) && !a->scratch_norm) return bad("gemm_ex", "a fused norm needs scratch_norm");
  if (a->norm_plain && (a->norm_w || a->norm_b)) return bad("gemm_ex", "a plain norm has no weights");
  if (a->norm_plain && !a->norm_rms && !a->norm_wsum) return bad("gemm_ex", "a plain LayerNorm needs W's row sums");
  if (a->kv_pool) {
    const td_kv_layout *l = a->kv_layout;
    if (glu || (a->flags & TD_GEMM_OUT_F32) || !td_kv_layout_valid(l) || a->kv_layer < 0 ||
        a->kv_layer >= l->n_layers || !a->kv_slots || a->kv_col < 0 ||
        a->kv_col + 2 * l->n_heads * l->head_dim > a->n)
      return bad("gemm_ex", "bad KV write (layout, columns, slots, or with GLU / float32 output)");
  }
  if (a->m == 0) return TD_OK;
  if (b->vt->gemm_ex) return b->vt->gemm_ex(b, a);
  return td_gemm_ex_unfused(b, a);
}

int td_attn_states_rows(const td_backend *b, int D, bool kv8) {
  return b->vt->states_rows && D > 0 ? b->vt->states_rows(b, D, kv8) : INT_MAX;
}

bool td_attn_states_takes(const td_backend *b, int D, int heads, bool kv8, int rows) {
  if (rows < td_attn_states_rows(b, D, kv8)) return false;
  return b->vt->states_takes ? b->vt->states_takes(b, D, heads, kv8, rows) : true;
}

bool td_attn_states_fast(const td_backend *b, int D) {
  return b->vt->states_fast && D > 0 && b->vt->states_fast(b, D);
}

int td_backend_fused_norm_rows(const td_backend *b) { return b->vt->fused_norm_rows ? b->vt->fused_norm_rows(b) : 0; }
int64_t td_backend_gemm_plans_made(const td_backend *b) { return b->vt->gemm_plans_made ? b->vt->gemm_plans_made(b) : 0; }
int td_backend_gemm_plan_rows(const td_backend *b, int m) {
  return b->vt->gemm_plan_rows && m > 0 ? b->vt->gemm_plan_rows(b, m) : 0;
}

td_status td_gemm_ex_unfused(td_backend *b, const td_gemm_args *a) {
  bool glu = a->flags & TD_GEMM_GLU;
  const void *x = a->x;
  if (a->norm_w || a->norm_plain) {
    TD_TRY(td_norm(b, a->x, a->norm_w, a->norm_b, a->scratch_norm, a->m, a->k, a->norm_eps, a->norm_rms));
    x = a->scratch_norm;
  }
  if (glu) {
    TD_TRY(td_gemm(b, x, a->w, a->bias, a->scratch_glu, a->m, a->n, a->k, TD_ACT_NONE, 0));
    return td_gated_act(b, a->scratch_glu, a->y, a->m, a->n / 2, a->act);
  }
  TD_TRY(td_gemm(b, x, a->w, a->bias, a->y, a->m, a->n, a->k, a->act, a->flags));
  if (!a->kv_pool) return TD_OK;
  size_t es = td_buf_elem_size(b, TD_BUF_ACT), hd = (size_t)a->kv_layout->n_heads * a->kv_layout->head_dim;
  const char *k = (const char *)a->y + (size_t)a->kv_col * es;
  return td_kv_write(b, k, k + hd * es, a->n, a->kv_pool, a->kv_layout, a->kv_layer, a->kv_slots, a->m);
}

td_status td_norm(td_backend *b, const void *x, const float *w, const float *bias, void *y, int m, int n, float eps,
                  bool rms) {
  if (m < 0 || n <= 0 || !x || !y) return bad("norm", "bad sizes or null buffer");
  if (m == 0) return TD_OK;
  return b->vt->norm(b, x, w, bias, y, m, n, eps, rms);
}

td_status td_gated_act(td_backend *b, const void *x, void *y, int m, int f, td_act act) {
  if (m < 0 || f <= 0 || !x || !y || x == y) return bad("gated_act", "bad sizes or buffers");
  if (m == 0) return TD_OK;
  return b->vt->gated_act(b, x, y, m, f, act);
}

td_status td_embed(td_backend *b, const int32_t *ids, const int32_t *positions, const void *tok, const void *pos,
                   float scale, void *y, int n, int d) {
  if (n < 0 || d <= 0 || !ids || !tok || !y || (pos && !positions)) return bad("embed", "bad sizes or buffers");
  if (n == 0) return TD_OK;
  return b->vt->embed(b, ids, positions, tok, pos, scale, y, n, d);
}

td_status td_add_pos(td_backend *b, void *y, const void *pos, int n_seqs, int len, int d) {
  if (n_seqs < 0 || len <= 0 || d <= 0 || !y || !pos) return bad("add_pos", "bad sizes or buffers");
  if (n_seqs == 0) return TD_OK;
  return b->vt->add_pos(b, y, pos, n_seqs, len, d);
}

td_status td_gather_rows(td_backend *b, const void *x, const int32_t *rows, void *y, int n, int d) {
  if (n < 0 || d <= 0 || !x || !rows || !y) return bad("gather_rows", "bad sizes or buffers");
  if (n == 0) return TD_OK;
  return b->vt->gather_rows(b, x, rows, y, n, d);
}

td_status td_im2col1d(td_backend *b, const void *x, void *y, int batch, int c, int t_in, int k, int stride, int pad,
                      bool channels_first) {
  if (batch < 0 || c <= 0 || t_in <= 0 || k <= 0 || stride <= 0 || pad < 0 || t_in + 2 * pad < k || !x || !y)
    return bad("im2col1d", "bad sizes or buffers");
  if (batch == 0) return TD_OK;
  return b->vt->im2col1d(b, x, y, batch, c, t_in, k, stride, pad, channels_first);
}

td_status td_attn_dense_rows(td_backend *b, const void *qkv, void *out, const int32_t *cu_seqlens, int n_seqs,
                             int n_tokens, int max_len, int heads, int head_dim, float scale, bool causal,
                             const td_relbias *bias, int q_lo, int q_hi) {
  if (n_seqs < 0 || n_tokens < 0 || max_len < 0 || heads <= 0 || head_dim <= 0 || !qkv || !out || !cu_seqlens)
    return bad("attn_dense", "bad sizes or buffers");
  if (bias && (!bias->lut || bias->max_distance <= 0)) return bad("attn_dense", "bad relative bias");
  if (q_lo < 0 || q_hi < q_lo || q_hi > n_tokens) return bad("attn_dense", "query rows outside the tokens");
  if (n_seqs == 0 || n_tokens == 0 || q_lo == q_hi) return TD_OK;
  return b->vt->attn_dense(b, qkv, out, cu_seqlens, n_seqs, n_tokens, max_len, heads, head_dim, scale, causal,
                           bias, q_lo, q_hi);
}

td_status td_attn_dense(td_backend *b, const void *qkv, void *out, const int32_t *cu_seqlens, int n_seqs,
                        int n_tokens, int max_len, int heads, int head_dim, float scale, bool causal,
                        const td_relbias *bias) {
  return td_attn_dense_rows(b, qkv, out, cu_seqlens, n_seqs, n_tokens, max_len, heads, head_dim, scale, causal,
                            bias, 0, n_tokens < 0 ? 0 : n_tokens);
}

/* a K/V layer of l, or (tail) its states tail */
static bool layout_ok(const td_kv_layout *l, int layer, bool tail) {
  return td_kv_layout_valid(l) && layer >= 0 &&
         (layer < l->n_layers || (tail && layer == l->n_layers && l->states > 0));
}

/* int8 K/V: the CUDA backend's kernels only */
static td_status int8_here(const td_backend *b, const td_kv_layout *l, const char *op) {
  if (l->int8 && b->kind != TD_BACKEND_CUDA)
    return td_err(TD_ERR_UNSUPPORTED, "%s: int8 K/V pools need the CUDA backend", op);
  return TD_OK;
}

td_status td_kv_write(td_backend *b, const void *k, const void *v, int ld, void *pool, const td_kv_layout *l,
                      int layer, const int32_t *slots, int n) {
  if (!layout_ok(l, layer, true) || n < 0 || !k || !v || !pool || !slots)
    return bad("kv_write", "bad layout, sizes or buffers");
  td_kv_span sp = td_kv_layer_span(l, layer);
  if (ld < sp.heads * sp.dim)
    return td_err(TD_ERR_INVALID, "kv_write: row stride %d under the layer's %d columns", ld, sp.heads * sp.dim);
  TD_TRY(int8_here(b, l, "kv_write"));
  if (n == 0) return TD_OK;
  return b->vt->kv_write(b, k, v, ld, pool, l, layer, slots, n);
}

td_status td_kv_write_layers(td_backend *b, const void *k, const void *v, int ld, size_t lcols, void *pool,
                             const td_kv_layout *l, int layer0, int n_layers, const int32_t *slots, int n) {
  if (!td_kv_layout_valid(l) || layer0 < 0 || n_layers < 1 || n_layers > l->n_layers - layer0 || n < 0 || !k || !v ||
      !pool || !slots)
    return bad("kv_write_layers", "bad layout, layers, sizes or buffers");
  td_kv_span sp = td_kv_layer_span(l, layer0);
  size_t cols = (size_t)sp.heads * sp.dim;
  if (n_layers > 1 && lcols < cols)
    return td_err(TD_ERR_INVALID, "kv_write_layers: layers %zu columns apart, under a layer's %zu", lcols, cols);
  if ((size_t)ld < (size_t)(n_layers - 1) * lcols + cols)
    return td_err(TD_ERR_INVALID, "kv_write_layers: row stride %d under %d layers of %zu columns, %zu apart", ld,
                  n_layers, cols, lcols);
  TD_TRY(int8_here(b, l, "kv_write_layers"));
  if (n == 0) return TD_OK;
  if (n_layers > 1 && b->vt->kv_write_layers)
    return b->vt->kv_write_layers(b, k, v, ld, lcols, pool, l, layer0, n_layers, slots, n);
  size_t es = td_buf_elem_size(b, TD_BUF_ACT);
  for (int j = 0; j < n_layers; j++)
    TD_TRY(b->vt->kv_write(b, (const char *)k + j * lcols * es, (const char *)v + j * lcols * es, ld, pool, l,
                           layer0 + j, slots, n));
  return TD_OK;
}

td_status td_kv_read(td_backend *b, const void *pool, const td_kv_layout *l, int layer, const int32_t *slots,
                     int n, void *k, void *v, int ld) {
  if (!layout_ok(l, layer, true) || n < 0 || !k || !v || !pool || !slots)
    return bad("kv_read", "bad layout, sizes or buffers");
  td_kv_span sp = td_kv_layer_span(l, layer);
  if (ld < sp.heads * sp.dim)
    return td_err(TD_ERR_INVALID, "kv_read: row stride %d under the layer's %d columns", ld, sp.heads * sp.dim);
  TD_TRY(int8_here(b, l, "kv_read"));
  if (n == 0) return TD_OK;
  return b->vt->kv_read(b, pool, l, layer, slots, n, k, v, ld);
}

td_status td_attn_paged(td_backend *b, const void *q, int ldq, void *out, const void *pool, const td_kv_layout *l,
                        int layer, const td_paged_meta *m, float scale, bool causal, const td_relbias *bias) {
  if (!layout_ok(l, layer, false) || !m || !q || !out || !pool || ldq < l->n_heads * l->head_dim || m->n_seqs < 0 ||
      m->n_tokens < 0 || m->max_blocks <= 0 || !m->q_start || !m->ctx_len || !m->block_table)
    return bad("attn_paged", "bad layout, metadata or buffers");
  if (bias && (!bias->lut || bias->max_distance <= 0)) return bad("attn_paged", "bad relative bias");
  if (m->q_norm && (m->q_norm_dim <= 0 || !(m->q_norm_eps >= 0.0f)))
    return bad("attn_paged", "a query norm needs a positive row width and a non-negative epsilon");
  TD_TRY(int8_here(b, l, "attn_paged"));
  if (m->n_seqs == 0 || m->n_tokens == 0) return TD_OK;
  return b->vt->attn_paged(b, q, ldq, out, pool, l, layer, m, scale, causal, bias);
}

td_status td_attn_states(td_backend *b, const void *q, int ldq, void *out, const void *pool, const td_kv_layout *l,
                         int heads, const td_paged_meta *m, float scale) {
  if (!td_kv_layout_valid(l) || l->states <= 0 || heads <= 0 || !m || !q || !out || !pool ||
      (long)ldq < (long)heads * l->states || m->n_seqs < 0 || m->n_tokens < 0 || m->max_blocks <= 0 ||
      !m->q_start || !m->ctx_len || !m->block_table)
    return bad("attn_states", "bad layout, heads, metadata or buffers");
  if (m->q_norm && (m->q_norm_dim <= 0 || !(m->q_norm_eps >= 0.0f)))
    return bad("attn_states", "a query norm needs a positive row width and a non-negative epsilon");
  TD_TRY(int8_here(b, l, "attn_states"));
  if (m->n_seqs == 0 || m->n_tokens == 0) return TD_OK;
  if (!b->vt->attn_states) return td_err(TD_ERR_UNSUPPORTED, "attn_states: not on this backend");
  return b->vt->attn_states(b, q, ldq, out, pool, l, heads, m, scale);
}

td_status td_gemm_heads(td_backend *b, const void *x, const void *w, const float *bias, void *y, int m, int heads,
                        int n, int k, bool w_t) {
  if (m < 0 || heads <= 0 || n <= 0 || k <= 0 || !x || !w || !y) return bad("gemm_heads", "bad sizes or buffers");
  if (m == 0) return TD_OK;
  if (!b->vt->gemm_heads) return td_err(TD_ERR_UNSUPPORTED, "gemm_heads: not on this backend");
  return b->vt->gemm_heads(b, x, w, bias, y, m, heads, n, k, w_t);
}

td_status td_kv_prefetch(td_backend *b, const void *pool, const td_kv_layout *l, int layer, const td_paged_meta *m) {
  if (!layout_ok(l, layer, false) || !pool || !m || !m->ctx_len || !m->block_table || m->n_seqs < 0 || m->max_blocks <= 0)
    return bad("kv_prefetch", "bad arguments");
  if (!b->vt->kv_prefetch || m->n_seqs == 0) return TD_OK;
  return b->vt->kv_prefetch(b, pool, l, layer, m);
}

td_status td_kv_copy_blocks(td_backend *b, void *pool, const td_kv_layout *l, const int32_t *pairs, int n_pairs) {
  if (!td_kv_layout_valid(l) || !pool || n_pairs < 0 || (n_pairs && !pairs)) return bad("kv_copy_blocks", "bad arguments");
  TD_TRY(int8_here(b, l, "kv_copy_blocks"));
  if (n_pairs == 0) return TD_OK;
  return b->vt->kv_copy_blocks(b, pool, l, pairs, n_pairs);
}

td_status td_sample(td_backend *b, float *logits, int n, int vocab, const td_sample_row *rows, const int32_t *bans,
                    int32_t *tokens, float *logprobs) {
  if (n < 0 || vocab <= 0 || !logits || !rows || !tokens) return bad("sample", "bad sizes or buffers");
  if (n == 0) return TD_OK;
  return b->vt->sample(b, logits, n, vocab, rows, bans, tokens, logprobs);
}

td_status td_topk_logprobs(td_backend *b, float *logits, int n, int vocab, const td_sample_row *rows,
                           const int32_t *bans, int k, int32_t *ids, float *vals) {
  if (n < 0 || vocab <= 0 || k <= 0 || k > vocab || !logits || !rows || !ids || !vals)
    return bad("topk_logprobs", "bad sizes or buffers");
  if (n == 0) return TD_OK;
  return b->vt->topk_logprobs(b, logits, n, vocab, rows, bans, k, ids, vals);
}

bool td_backend_has_graphs(const td_backend *b) { return b->vt->graph_begin != NULL; }

td_status td_graph_begin(td_backend *b) {
  if (!b->vt->graph_begin) return td_err(TD_ERR_UNSUPPORTED, "%s: no graph capture", b->name);
  return b->vt->graph_begin(b);
}

td_status td_graph_end(td_backend *b, td_graph **out) {
  if (!b->vt->graph_end) return td_err(TD_ERR_UNSUPPORTED, "%s: no graph capture", b->name);
  return b->vt->graph_end(b, out);
}

td_status td_graph_launch(td_backend *b, td_graph *g) {
  if (!b->vt->graph_launch || !g) return td_err(TD_ERR_UNSUPPORTED, "%s: no graph to launch", b->name);
  return b->vt->graph_launch(b, g);
}

int td_graph_kernels(td_backend *b, const td_graph *g) {
  return g && b->vt->graph_kernels ? b->vt->graph_kernels(b, g) : -1;
}

void td_graph_destroy(td_backend *b, td_graph *g) {
  if (g && b->vt->graph_destroy) b->vt->graph_destroy(b, g);
}

/* ---- collectives ---- */

void td_backend_set_comm(td_backend *b, td_comm *c) { b->comm = c; }
td_comm *td_backend_comm(const td_backend *b) { return b->comm; }
int td_comm_rank(const td_comm *c) { return c ? c->rank : 0; }
int td_comm_world(const td_comm *c) { return c ? c->world : 1; }

void td_comm_abort(td_comm *c) {
  if (c && c->vt->abort) c->vt->abort(c);
}

void td_comm_destroy(td_comm *c) {
  if (c) c->vt->destroy(c);
}

static td_status need_comm(const td_backend *b, const char *op) {
  return b->comm ? TD_OK : td_err(TD_ERR_INVALID, "%s: no communicator attached", op);
}

td_status td_allreduce_sum(td_backend *b, void *buf, td_buf_type t, size_t n) {
  TD_TRY(need_comm(b, "allreduce"));
  if (b->comm->world == 1 || n == 0) return TD_OK;
  return b->comm->vt->allreduce(b->comm, b, buf, t, n);
}

td_status td_gemm_allreduce(td_backend *b, const void *x, const void *w, const float *bias, void *y, int m, int n,
                            int k, unsigned flags) {
  TD_TRY(need_comm(b, "gemm_allreduce"));
  if (flags & ~(unsigned)TD_GEMM_ACCUM) return bad("gemm_allreduce", "flags other than TD_GEMM_ACCUM");
  if (m < 0 || n <= 0 || k <= 0) return bad("gemm_allreduce", "sizes must be positive");
  if (!x || !w || !y) return bad("gemm_allreduce", "null buffer");
  if (m == 0) return TD_OK;
  if (b->comm->world > 1 && b->comm->vt->gemm_allreduce)
    return b->comm->vt->gemm_allreduce(b->comm, b, x, w, bias, y, m, n, k, flags);
  TD_TRY(b->vt->gemm(b, x, w, bias, y, m, n, k, TD_ACT_NONE, flags));
  return td_allreduce_sum(b, y, TD_BUF_ACT, (size_t)m * n);
}

td_status td_allgather(td_backend *b, const void *send, void *recv, td_buf_type t, size_t n) {
  TD_TRY(need_comm(b, "allgather"));
  if (n == 0) return TD_OK;
  return b->comm->vt->allgather(b->comm, b, send, recv, t, n);
}

td_row_split td_rows_split(int n, int world, int rank) {
  td_row_split r = {0, 0, 0};
  if (n <= 0 || world <= 0 || rank < 0 || rank >= world) return r;
  long per = ((long)n + world - 1) / world;
  /* whole 64-row shares when each is large: a query tile of one sequence
   * that straddles two ranks is computed by both (a 1500-position
   * encoder's 768 + 732 rows are whole 128-row tiles) */
  int align = per >= 512 ? 64 : 8;
  per = (per + align - 1) / align * align;
  r.per = (int)per;
  r.lo = (int)(per * rank < n ? per * rank : n);
  r.hi = (int)(per * (rank + 1) < n ? per * (rank + 1) : n);
  return r;
}

/* CPU communicators: the rank's block packed, all-gathered, unpacked */
static td_status allgather_rows_packed(td_backend *b, void *buf, td_buf_type t, int rows, int width, int col0,
                                       int ncols) {
  int world = b->comm->world, rank = b->comm->rank;
  size_t es = td_buf_elem_size(b, t);
  td_row_split me = td_rows_split(rows, world, rank);
  size_t blk = (size_t)me.per * (size_t)ncols;
  char *send = calloc(blk ? blk : 1, es), *recv = calloc(blk * (size_t)world + 1, es);
  td_status s = send && recv ? TD_OK : td_err(TD_ERR_NOMEM, "allgather_rows: out of memory");
  char *B = buf;
  for (int i = me.lo; s == TD_OK && i < me.hi; i++)
    memcpy(send + (size_t)(i - me.lo) * ncols * es, B + ((size_t)i * width + col0) * es, (size_t)ncols * es);
  if (s == TD_OK && blk) s = b->comm->vt->allgather(b->comm, b, send, recv, t, blk);
  for (int r = 0; s == TD_OK && r < world; r++) {
    td_row_split o = td_rows_split(rows, world, r);
    if (r == rank) continue;
    for (int i = o.lo; i < o.hi; i++)
      memcpy(B + ((size_t)i * width + col0) * es, recv + ((size_t)r * blk + (size_t)(i - o.lo) * ncols) * es,
             (size_t)ncols * es);
  }
  free(send);
  free(recv);
  return s;
}

td_status td_allgather_rows(td_backend *b, void *buf, td_buf_type t, int rows, int width, int col0, int ncols) {
  TD_TRY(need_comm(b, "allgather_rows"));
  if (!buf || rows < 0 || width <= 0 || col0 < 0 || ncols < 0 || col0 + (long)ncols > width)
    return bad("allgather_rows", "bad sizes or buffers");
  if (b->comm->world == 1 || rows == 0 || ncols == 0) return TD_OK;
  if (b->comm->vt->allgather_rows)
    return b->comm->vt->allgather_rows(b->comm, b, buf, t, rows, width, col0, ncols);
  return allgather_rows_packed(b, buf, t, rows, width, col0, ncols);
}

td_status td_send(td_backend *b, const void *buf, td_buf_type t, size_t n, int peer) {
  TD_TRY(need_comm(b, "send"));
  if (peer < 0 || peer >= b->comm->world || peer == b->comm->rank) return bad("send", "bad peer");
  return n ? b->comm->vt->send(b->comm, b, buf, t, n, peer) : TD_OK;
}

td_status td_recv(td_backend *b, void *buf, td_buf_type t, size_t n, int peer) {
  TD_TRY(need_comm(b, "recv"));
  if (peer < 0 || peer >= b->comm->world || peer == b->comm->rank) return bad("recv", "bad peer");
  return n ? b->comm->vt->recv(b->comm, b, buf, t, n, peer) : TD_OK;
}

td_status td_sendrecv(td_backend *b, const void *send, td_buf_type send_t, size_t send_n, int to, void *recv,
                      td_buf_type recv_t, size_t recv_n, int from) {
  TD_TRY(need_comm(b, "sendrecv"));
  const td_comm *c = b->comm;
  if (to < 0 || to >= c->world || to == c->rank || from < 0 || from >= c->world || from == c->rank)
    return bad("sendrecv", "bad peer");
  if ((send_n && !send) || (recv_n && !recv)) return bad("sendrecv", "no buffer");
  if (!send_n) return td_recv(b, recv, recv_t, recv_n, from);
  if (!recv_n) return td_send(b, send, send_t, send_n, to);
  if (c->vt->sendrecv) return c->vt->sendrecv(b->comm, b, send, send_t, send_n, to, recv, recv_t, recv_n, from);
  TD_TRY(c->vt->send(b->comm, b, send, send_t, send_n, to));
  return c->vt->recv(b->comm, b, recv, recv_t, recv_n, from);
}

td_status td_unshard_cols(td_backend *b, const float *parts, float *out, int tp, int rows, int per, int cols) {
  if (tp <= 0 || rows < 0 || per <= 0 || cols <= 0 || cols > tp * per || !parts || !out)
    return bad("unshard_cols", "bad sizes or buffers");
  if (rows == 0) return TD_OK;
  if (b->vt->unshard_cols) return b->vt->unshard_cols(b, parts, out, tp, rows, per, cols);
  for (int r = 0; r < rows; r++)
    for (int k = 0; k < tp; k++) {
      int c0 = k * per, n = cols - c0 < per ? cols - c0 : per;
      if (n > 0)
        memcpy(out + (size_t)r * cols + c0, parts + ((size_t)k * rows + r) * per, sizeof(float) * (size_t)n);
    }
  return TD_OK;
}
