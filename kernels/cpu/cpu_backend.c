/* The CPU backend: float32 everywhere, GEMMs through BLAS. It is the
 * numerical reference for the CUDA backend. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/act.h"
#include "kernels/backend_impl.h"

static void cpu_destroy(td_backend *b) { free(b); }

static td_status cpu_alloc(td_backend *b, size_t bytes, void **out) {
  /* 64-byte alignment for vector loads; size rounded as aligned_alloc requires. */
  size_t n = (bytes + 63) & ~(size_t)63;
  *out = aligned_alloc(64, n);
  if (!*out) return td_err(TD_ERR_NOMEM, "cannot allocate %zu bytes", bytes);
  /* Touched now, as a GPU's memory is committed at allocation: a KV pool's
   * pages were otherwise first touched by the first burst to reach them, so
   * a worker's memory grew mid-run (an hour's soak: +6 MB at minute 55) and a
   * machine short of memory would fail then rather than at start. */
  memset(*out, 0, n);
  return TD_OK;
}

static void cpu_free(td_backend *b, void *p) { free(p); }

static td_status cpu_upload(td_backend *b, td_buf_type t, void *dst, const float *src, size_t n) {
  memcpy(dst, src, n * 4); /* every CPU type is 4 bytes; I32 callers pass raw words */
  return TD_OK;
}

static td_status cpu_download(td_backend *b, td_buf_type t, const void *src, float *dst, size_t n) {
  memcpy(dst, src, n * 4);
  return TD_OK;
}

static td_status cpu_copy(td_backend *b, void *dst, const void *src, size_t bytes, int dir) {
  memmove(dst, src, bytes);
  return TD_OK;
}

static td_status cpu_sync(td_backend *b) { return TD_OK; }

static td_status cpu_gemm(td_backend *b, const void *x, const void *w, const float *bias, void *y, int m, int n,
                          int k, td_act act, unsigned flags) {
  float *Y = y;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, x, k, w, k,
              (flags & TD_GEMM_ACCUM) ? 1.0f : 0.0f, Y, n);
  if (bias || act != TD_ACT_NONE) {
    for (int i = 0; i < m; i++) {
      float *row = Y + (size_t)i * n;
      for (int j = 0; j < n; j++) row[j] = td_act_apply(act, row[j] + (bias ? bias[j] : 0.0f));
    }
  }
  return TD_OK;
}

static td_status cpu_norm(td_backend *b, const void *x, const float *w, const float *bias, void *y, int m, int n,
                          float eps, bool rms) {
  for (int i = 0; i < m; i++) {
    const float *xr = (const float *)x + (size_t)i * n;
    float *yr = (float *)y + (size_t)i * n;
    double mean = 0.0, var = 0.0;
    if (!rms) {
      for (int j = 0; j < n; j++) mean += xr[j];
      mean /= n;
    }
    for (int j = 0; j < n; j++) var += (xr[j] - mean) * (xr[j] - mean);
    var /= n;
    float inv = (float)(1.0 / sqrt(var + eps));
    for (int j = 0; j < n; j++) {
      float v = (float)(xr[j] - mean) * inv * (w ? w[j] : 1.0f);
      yr[j] = rms || !bias ? v : v + bias[j];
    }
  }
  return TD_OK;
}

static td_status cpu_gated_act(td_backend *b, const void *x, void *y, int m, int f, td_act act) {
  for (int i = 0; i < m; i++) {
    const float *xr = (const float *)x + (size_t)i * 2 * f;
    float *yr = (float *)y + (size_t)i * f;
    for (int j = 0; j < f; j++) yr[j] = td_act_apply(act, xr[j]) * xr[f + j];
  }
  return TD_OK;
}

static td_status cpu_embed(td_backend *b, const int32_t *ids, const int32_t *positions, const void *tok,
                           const void *pos, float scale, void *y, int n, int d) {
  for (int i = 0; i < n; i++) {
    const float *t = (const float *)tok + (size_t)ids[i] * d;
    float *yr = (float *)y + (size_t)i * d;
    for (int j = 0; j < d; j++) yr[j] = t[j] * scale;
    if (pos) {
      const float *p = (const float *)pos + (size_t)positions[i] * d;
      for (int j = 0; j < d; j++) yr[j] += p[j];
    }
  }
  return TD_OK;
}

static td_status cpu_add_pos(td_backend *b, void *y, const void *pos, int n_seqs, int len, int d) {
  for (int s = 0; s < n_seqs; s++)
    for (int t = 0; t < len; t++) {
      float *yr = (float *)y + ((size_t)s * len + t) * d;
      const float *p = (const float *)pos + (size_t)t * d;
      for (int j = 0; j < d; j++) yr[j] += p[j];
    }
  return TD_OK;
}

static td_status cpu_gather_rows(td_backend *b, const void *x, const int32_t *rows, void *y, int n, int d) {
  for (int i = 0; i < n; i++)
    memcpy((float *)y + (size_t)i * d, (const float *)x + (size_t)rows[i] * d, (size_t)d * 4);
  return TD_OK;
}

static td_status cpu_im2col1d(td_backend *b, const void *x, void *y, int batch, int c, int t_in, int k, int stride,
                              int pad, bool channels_first) {
  int t_out = (t_in + 2 * pad - k) / stride + 1;
  const float *X = x;
  float *Y = y;
  for (int s = 0; s < batch; s++)
    for (int t = 0; t < t_out; t++) {
      float *row = Y + ((size_t)s * t_out + t) * c * k;
      for (int ch = 0; ch < c; ch++)
        for (int j = 0; j < k; j++) {
          int ti = t * stride + j - pad;
          float v = 0.0f;
          if (ti >= 0 && ti < t_in)
            v = channels_first ? X[((size_t)s * c + ch) * t_in + ti] : X[((size_t)s * t_in + ti) * c + ch];
          row[ch * k + j] = v;
        }
    }
  return TD_OK;
}

static inline float rel_bias(const td_relbias *bias, int h, int rel) {
  int md = bias->max_distance;
  if (rel > md) rel = md;
  if (rel < -md) rel = -md;
  return bias->lut[(size_t)h * (2 * md + 1) + rel + md];
}

/* Softmax-weighted sum over n_keys keys fetched by key_at / val_at. */
typedef struct attn_scratch {
  float *s;
  int cap;
} attn_scratch;

static td_status scratch_fit(attn_scratch *sc, int n) {
  if (n <= sc->cap) return TD_OK;
  float *p = realloc(sc->s, sizeof *p * (size_t)n);
  if (!p) return td_err(TD_ERR_NOMEM, "attention scratch of %d floats", n);
  sc->s = p;
  sc->cap = n;
  return TD_OK;
}

static void softmax_inplace(float *s, int n) {
  float mx = -INFINITY;
  for (int j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
  double sum = 0.0;
  for (int j = 0; j < n; j++) {
    s[j] = expf(s[j] - mx);
    sum += s[j];
  }
  float inv = (float)(1.0 / sum);
  for (int j = 0; j < n; j++) s[j] *= inv;
}

static float dot(const float *a, const float *b, int n) {
  float acc = 0.0f;
  for (int i = 0; i < n; i++) acc += a[i] * b[i];
  return acc;
}

static td_status cpu_attn_dense(td_backend *b, const void *qkv, void *out, const int32_t *cu, int n_seqs,
                                int n_tokens, int max_len, int H, int dh, float scale, bool causal,
                                const td_relbias *bias, int q_lo, int q_hi) {
  const float *QKV = qkv;
  float *O = out;
  size_t row = (size_t)3 * H * dh;
  attn_scratch sc = {0};
  for (int s = 0; s < n_seqs; s++) {
    int start = cu[s], len = cu[s + 1] - cu[s];
    TD_TRY(scratch_fit(&sc, len));
    for (int h = 0; h < H; h++)
      for (int i = 0; i < len; i++) {
        if (start + i < q_lo || start + i >= q_hi) continue;
        const float *q = QKV + (size_t)(start + i) * row + (size_t)h * dh;
        int nk = causal ? i + 1 : len;
        for (int j = 0; j < nk; j++) {
          const float *kk = QKV + (size_t)(start + j) * row + (size_t)(H + h) * dh;
          sc.s[j] = dot(q, kk, dh) * scale + (bias ? rel_bias(bias, h, j - i) : 0.0f);
        }
        softmax_inplace(sc.s, nk);
        float *o = O + (size_t)(start + i) * H * dh + (size_t)h * dh;
        memset(o, 0, sizeof *o * (size_t)dh);
        for (int j = 0; j < nk; j++) {
          const float *v = QKV + (size_t)(start + j) * row + (size_t)(2 * H + h) * dh;
          for (int e = 0; e < dh; e++) o[e] += sc.s[j] * v[e];
        }
      }
  }
  free(sc.s);
  return TD_OK;
}

/* Where one layer (layer == n_layers: the states tail) of every block
 * sits, worked out once an op rather than at every key. */
typedef struct kv_at {
  size_t block_elems, off;
  int heads, dim, bs;
} kv_at;

static kv_at kv_at_layer(const td_kv_layout *l, int layer) {
  td_kv_span sp = td_kv_layer_span(l, layer);
  return (kv_at){td_kv_block_elems(l), sp.off, sp.heads, sp.dim, l->block_size};
}

static inline size_t kv_offset(const kv_at *a, int block, int kv, int h, int slot) {
  return (size_t)block * a->block_elems + a->off + (((size_t)kv * a->heads + h) * a->bs + slot) * a->dim;
}

static td_status cpu_kv_write(td_backend *b, const void *k, const void *v, int ld, void *pool,
                              const td_kv_layout *l, int layer, const int32_t *slots, int n) {
  float *P = pool;
  kv_at at = kv_at_layer(l, layer);
  for (int i = 0; i < n; i++) {
    if (slots[i] < 0) continue;
    int blk = slots[i] / l->block_size, slot = slots[i] % l->block_size;
    for (int h = 0; h < at.heads; h++) {
      memcpy(P + kv_offset(&at, blk, 0, h, slot), (const float *)k + (size_t)i * ld + (size_t)h * at.dim,
             sizeof(float) * (size_t)at.dim);
      memcpy(P + kv_offset(&at, blk, 1, h, slot), (const float *)v + (size_t)i * ld + (size_t)h * at.dim,
             sizeof(float) * (size_t)at.dim);
    }
  }
  return TD_OK;
}

static td_status cpu_kv_read(td_backend *b, const void *pool, const td_kv_layout *l, int layer,
                             const int32_t *slots, int n, void *k, void *v, int ld) {
  const float *P = pool;
  kv_at at = kv_at_layer(l, layer);
  for (int i = 0; i < n; i++) {
    if (slots[i] < 0) continue;
    int blk = slots[i] / l->block_size, slot = slots[i] % l->block_size;
    for (int h = 0; h < at.heads; h++) {
      memcpy((float *)k + (size_t)i * ld + (size_t)h * at.dim, P + kv_offset(&at, blk, 0, h, slot),
             sizeof(float) * (size_t)at.dim);
      memcpy((float *)v + (size_t)i * ld + (size_t)h * at.dim, P + kv_offset(&at, blk, 1, h, slot),
             sizeof(float) * (size_t)at.dim);
    }
  }
  return TD_OK;
}

static td_status cpu_attn_paged(td_backend *b, const void *q, int ldq, void *out, const void *pool,
                                const td_kv_layout *l, int layer, const td_paged_meta *m, float scale, bool causal,
                                const td_relbias *bias) {
  const float *P = pool;
  int H = l->n_heads, dh = l->head_dim, bs = l->block_size;
  kv_at at = kv_at_layer(l, layer);
  attn_scratch sc = {0};
  for (int s = 0; s < m->n_seqs; s++) {
    int q0 = m->q_start[s], qn = m->q_start[s + 1] - q0, ctx = m->ctx_len[s];
    const int32_t *table = m->block_table + (size_t)s * m->max_blocks;
    TD_TRY(scratch_fit(&sc, ctx > 0 ? ctx : 1));
    for (int i = 0; i < qn; i++) {
      int pos = ctx - qn + i;
      int nk = causal ? pos + 1 : ctx;
      float qs = scale;
      if (m->q_norm) { /* the query's projection input, normalised: 1 / rms of its row scales q */
        const float *xr = (const float *)m->q_norm + (size_t)(q0 + i) * m->q_norm_dim;
        qs = scale / sqrtf(dot(xr, xr, m->q_norm_dim) / (float)m->q_norm_dim + m->q_norm_eps);
      }
      for (int h = 0; h < H; h++) {
        const float *qr = (const float *)q + (size_t)(q0 + i) * ldq + (size_t)h * dh;
        for (int j = 0; j < nk; j++) {
          const float *kk = P + kv_offset(&at, table[j / bs], 0, h, j % bs);
          sc.s[j] = dot(qr, kk, dh) * qs + (bias ? rel_bias(bias, h, j - pos) : 0.0f);
        }
        float *o = (float *)out + (size_t)(q0 + i) * H * dh + (size_t)h * dh;
        memset(o, 0, sizeof *o * (size_t)dh);
        if (nk <= 0) continue;
        softmax_inplace(sc.s, nk);
        for (int j = 0; j < nk; j++) {
          const float *v = P + kv_offset(&at, table[j / bs], 1, h, j % bs);
          for (int e = 0; e < dh; e++) o[e] += sc.s[j] * v[e];
        }
      }
    }
  }
  free(sc.s);
  return TD_OK;
}

static td_status cpu_attn_states(td_backend *b, const void *q, int ldq, void *out, const void *pool,
                                 const td_kv_layout *l, int heads, const td_paged_meta *m, float scale) {
  const float *P = pool;
  int half = l->states / 2, D = l->states, bs = l->block_size;
  kv_at at = kv_at_layer(l, l->n_layers); /* the states tail */
  attn_scratch sc = {0};
  float *e = malloc(sizeof(float) * (size_t)D);
  if (!e) return td_err(TD_ERR_NOMEM, "attn_states: scratch");
  for (int s = 0; s < m->n_seqs; s++) {
    int q0 = m->q_start[s], qn = m->q_start[s + 1] - q0, ctx = m->ctx_len[s];
    const int32_t *table = m->block_table + (size_t)s * m->max_blocks;
    td_status st = scratch_fit(&sc, ctx > 0 ? ctx : 1);
    if (st != TD_OK) {
      free(e);
      free(sc.s);
      return st;
    }
    for (int i = 0; i < qn; i++) {
      float qs = scale;
      if (m->q_norm) {
        const float *xr = (const float *)m->q_norm + (size_t)(q0 + i) * m->q_norm_dim;
        qs = scale / sqrtf(dot(xr, xr, m->q_norm_dim) / (float)m->q_norm_dim + m->q_norm_eps);
      }
      for (int h = 0; h < heads; h++) {
        const float *qr = (const float *)q + (size_t)(q0 + i) * ldq + (size_t)h * D;
        for (int j = 0; j < ctx; j++) {
          const float *ek = P + kv_offset(&at, table[j / bs], 0, 0, j % bs);
          const float *ev = P + kv_offset(&at, table[j / bs], 1, 0, j % bs);
          sc.s[j] = (dot(qr, ek, half) + dot(qr + half, ev, half)) * qs;
        }
        float *o = (float *)out + ((size_t)(q0 + i) * heads + h) * D;
        memset(o, 0, sizeof *o * (size_t)D);
        if (ctx <= 0) continue;
        softmax_inplace(sc.s, ctx);
        for (int j = 0; j < ctx; j++) {
          memcpy(e, P + kv_offset(&at, table[j / bs], 0, 0, j % bs), sizeof(float) * (size_t)half);
          memcpy(e + half, P + kv_offset(&at, table[j / bs], 1, 0, j % bs), sizeof(float) * (size_t)half);
          for (int c = 0; c < D; c++) o[c] += sc.s[j] * e[c];
        }
      }
    }
  }
  free(e);
  free(sc.s);
  return TD_OK;
}

static td_status cpu_gemm_heads(td_backend *b, const void *x, const void *w, const float *bias, void *y, int m,
                                int heads, int n, int k, bool w_t) {
  for (int h = 0; h < heads; h++) {
    const float *X = (const float *)x + (size_t)h * k, *W = (const float *)w + (size_t)h * k * n;
    float *Y = (float *)y + (size_t)h * n;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, w_t ? CblasTrans : CblasNoTrans, m, n, k, 1.0f, X, heads * k, W,
                w_t ? k : n, 0.0f, Y, heads * n);
    if (bias)
      for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) Y[(size_t)i * heads * n + j] += bias[(size_t)h * n + j];
  }
  return TD_OK;
}

static td_status cpu_kv_copy_blocks(td_backend *b, void *pool, const td_kv_layout *l, const int32_t *pairs,
                                    int n_pairs) {
  size_t be = td_kv_block_elems(l);
  for (int i = 0; i < n_pairs; i++)
    memcpy((float *)pool + (size_t)pairs[2 * i + 1] * be, (const float *)pool + (size_t)pairs[2 * i] * be,
           be * sizeof(float));
  return TD_OK;
}

static td_status cpu_host_alloc(td_backend *b, size_t bytes, void **out) { return cpu_alloc(b, bytes, out); }

static const td_backend_vt cpu_vt = {
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_free,
    .upload = cpu_upload,
    .download = cpu_download,
    .copy = cpu_copy,
    .sync = cpu_sync,
    .gemm = cpu_gemm,
    .norm = cpu_norm,
    .gated_act = cpu_gated_act,
    .embed = cpu_embed,
    .add_pos = cpu_add_pos,
    .gather_rows = cpu_gather_rows,
    .im2col1d = cpu_im2col1d,
    .attn_dense = cpu_attn_dense,
    .kv_write = cpu_kv_write,
    .kv_read = cpu_kv_read,
    .attn_paged = cpu_attn_paged,
    .attn_states = cpu_attn_states,
    .gemm_heads = cpu_gemm_heads,
    .kv_copy_blocks = cpu_kv_copy_blocks,
    .sample = td_cpu_sample,
    .topk_logprobs = td_cpu_topk_logprobs,
};

td_status td_backend_cpu_create(const td_backend_opts *opts, td_backend **out) {
  td_backend *b = calloc(1, sizeof *b);
  if (!b) return td_err(TD_ERR_NOMEM, "out of memory");
  b->vt = &cpu_vt;
  b->kind = TD_BACKEND_CPU;
  b->act_size = 4;
  if (opts->threads > 0) openblas_set_num_threads(opts->threads);
  snprintf(b->name, sizeof b->name, "cpu");
  *out = b;
  return TD_OK;
}
