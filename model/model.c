#include "model/model.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/half.h"
#include "common/log.h"
#include "model/safetensors.h"

typedef struct lin {
  void *w;     /* TD_BUF_ACT [out, in] */
  float *b;    /* TD_BUF_F32 [out] or NULL */
  float *wsum; /* TD_BUF_F32 [out]: row sums of w as stored, when a LayerNorm is folded into it; else NULL */
  int out, in;
} lin;

typedef struct norm_w {
  float *w, *b; /* TD_BUF_F32; b NULL for RMSNorm */
  bool folded;  /* norm whose weight (and bias) is folded into the next layer: that GEMM normalises plainly */
} norm_w;

typedef struct enc_layer {
  norm_w ln_attn, ln_ffn;
  lin qkv, o, wi, wo;
} enc_layer;

typedef struct dec_layer {
  norm_w ln_self, ln_cross, ln_ffn;
  lin qkv, o, cq, ckv, co, wi, wo;
} dec_layer;

/* A per-rank view of the sizes: heads and FFN width are this rank's slice. */
typedef struct dims {
  int d, vocab;
  int eh, edh, eff; /* encoder heads, head dim, FFN width */
  int dh_, ddh, dff; /* decoder heads, head dim, FFN width */
  int v0, v1;        /* vocabulary rows of this rank's head */
  int e0, e1, l0, l1; /* encoder and decoder layers of this pipeline stage */
  int stage, stages;
} dims;

struct td_model {
  td_model_config cfg;
  td_gen_config gen;
  td_model_opts opts;
  td_backend *b;
  dims d;
  int max_src, max_tgt;
  int self_stride, cross_stride; /* block-table row widths */

  /* weights */
  void *enc_tok, *dec_tok, *head; /* may alias */
  void *enc_pos, *dec_pos;        /* row 0 = position 0 (offset applied) */
  void *enc_pos_mem, *dec_pos_mem;
  norm_w enc_ln_emb, dec_ln_emb, enc_final, dec_final;
  float *logits_bias; /* [v1 - v0] */
  float *enc_lut, *dec_lut;
  lin conv1, conv2;
  enc_layer *enc;
  dec_layer *dec;

  void *self_pool, *cross_pool;

  /* scratch */
  void *e_h, *e_x, *e_qkv, *e_attn, *e_ff, *e_ff1, *w_col1, *w_c1, *w_col2, *w_feat;
  void *d_h, *d_x, *d_qkv, *d_attn, *d_q, *d_ff, *d_ff1, *d_lx;
  void *d_qs, *d_us; /* the states path: per-head queries and mixes over the states [T, heads, d] */
  float *logits;                    /* [max_logits, vocab] */
  float *logits_part, *logits_all; /* tensor parallel: this rank's columns, all ranks' */
  int32_t *meta_dev, *meta_host;
  size_t meta_cap;
  /* decode graphs by batch bucket */
  int buckets[16];
  int n_buckets;
  td_graph *graphs[16];
  /* decode steps of more rows leave the cross query's folded RMSNorm to
   * the attention (td_paged_meta.q_norm): the backend's
   * td_backend_fused_norm_rows, or td_model_tuning.qnorm_rows */
  int q_norm_rows;
  /* steps of at least this many rows attend over the cross pool's states
   * (0 in STATES, INT_MAX in KV) */
  int states_rows;
  td_model_mirror mirror;
};

void td_model_opts_default(td_model_opts *o) {
  if (o->block_size <= 0) o->block_size = 16;
  if (o->max_seqs <= 0) o->max_seqs = 64;
  if (o->max_tokens <= 0) o->max_tokens = 1024;
  if (o->max_tokens < o->max_seqs) o->max_tokens = o->max_seqs;
  if (o->max_logits <= 0) o->max_logits = o->max_seqs;
  if (o->max_enc_seqs <= 0) o->max_enc_seqs = 16;
  if (o->max_enc_tokens <= 0) o->max_enc_tokens = 4096;
  if (o->tp_size <= 0) o->tp_size = 1;
  if (o->pp_size <= 0) o->pp_size = 1;
}

/* ---------------------------------------------------------------- loading */

typedef struct loader {
  td_checkpoint *ck;
  td_backend *b;
  const td_model_config *c;
  const char *dir;
  int rank, tp;
  float *tmp, *tmp2;
  size_t cap, cap2;
  const float *fold;   /* the next load_lin scales W's input columns by this (then clears it) */
  const float *fold_b; /* ... and adds W times this to its bias, and keeps W's row sums (a LayerNorm's bias) */
} loader;

static td_status fit(float **buf, size_t *cap, size_t n) {
  if (n <= *cap) return TD_OK;
  float *p = realloc(*buf, n * sizeof *p);
  if (!p) return td_err(TD_ERR_NOMEM, "cannot allocate %zu floats for weight conversion", n);
  *buf = p;
  *cap = n;
  return TD_OK;
}

static const td_tensor_info *find(loader *ld, const char *name, bool required) {
  const td_tensor_info *t = td_checkpoint_find(ld->ck, name);
  if (!t && required) td_err(TD_ERR_FORMAT, "%s: tensor \"%s\" is missing from the checkpoint", ld->dir, name);
  return t;
}

/* Reads a tensor into ld->tmp after checking its shape. */
static td_status read_f32(loader *ld, const char *name, int ndim, const int64_t *shape) {
  const td_tensor_info *t = find(ld, name, true);
  if (!t) return TD_ERR_FORMAT;
  TD_TRY(fit(&ld->tmp, &ld->cap, (size_t)t->numel));
  return td_tensor_read_f32(t, ndim, shape, ld->tmp);
}

static td_status upload_new(loader *ld, td_buf_type type, const float *src, size_t n, void **out) {
  TD_TRY(td_alloc(ld->b, type, n, out));
  return td_upload(ld->b, type, *out, src, n);
}

static td_status load_vec(loader *ld, const char *name, int n, bool required, float **out) {
  *out = NULL;
  if (!required && !find(ld, name, false)) return TD_OK;
  int64_t shape[1] = {n};
  TD_TRY(read_f32(ld, name, 1, shape));
  return upload_new(ld, TD_BUF_F32, ld->tmp, (size_t)n, (void **)out);
}

static td_status load_norm(loader *ld, const char *prefix, int n, norm_w *out) {
  char name[256];
  snprintf(name, sizeof name, "%s.weight", prefix);
  TD_TRY(load_vec(ld, name, n, true, &out->w));
  out->b = NULL;
  if (!ld->c->rmsnorm) {
    snprintf(name, sizeof name, "%s.bias", prefix);
    TD_TRY(load_vec(ld, name, n, true, &out->b));
  }
  return TD_OK;
}

/* A decoder pre-norm right before a linear layer: loaded, and with fw
 * (scratch for its weight) folded into that layer, the next load_lin:
 * RMSNorm(x) W^T = (x / rms(x)) (W diag(g))^T; a LayerNorm's bias too (fb:
 * scratch for it), LayerNorm(x) W^T + b = x_hat (W diag(g))^T + (b + W
 * beta), x_hat the plainly normalised x. */
static td_status load_norm_fold(loader *ld, const char *prefix, int n, norm_w *out, float *fw, float *fb) {
  TD_TRY(load_norm(ld, prefix, n, out));
  if (!fw) return TD_OK;
  char name[256];
  int64_t shape[1] = {n};
  snprintf(name, sizeof name, "%s.weight", prefix);
  TD_TRY(read_f32(ld, name, 1, shape));
  memcpy(fw, ld->tmp, sizeof(float) * (size_t)n);
  if (fb) {
    snprintf(name, sizeof name, "%s.bias", prefix);
    TD_TRY(read_f32(ld, name, 1, shape));
    memcpy(fb, ld->tmp, sizeof(float) * (size_t)n);
  }
  out->folded = true;
  ld->fold = fw;
  ld->fold_b = fb;
  return TD_OK;
}

typedef enum split { SPLIT_NONE, SPLIT_ROWS, SPLIT_COLS } split;

/* A linear layer whose weight is the row-concatenation of parts
 * (e.g. q, k, v), each [rows, in] in the file. With tensor parallelism,
 * SPLIT_ROWS keeps this rank's share of each part's rows (column-parallel),
 * SPLIT_COLS this rank's share of the input columns (row-parallel; the bias
 * then lives on rank 0 only). bias names may be NULL (no bias) and absent
 * optional biases read as zeros. */
static td_status load_lin(loader *ld, int n_parts, const char *const *wnames, const char *const *bnames,
                          const int *rows, int in, split sp, lin *out) {
  int tp = ld->tp, r = ld->rank;
  int out_rows = 0;
  for (int i = 0; i < n_parts; i++) {
    if (sp == SPLIT_ROWS && rows[i] % tp)
      return td_err(TD_ERR_UNSUPPORTED, "%s: tensor \"%s\" has %d rows, not divisible by tensor parallel %d",
                    ld->dir, wnames[i], rows[i], tp);
    out_rows += sp == SPLIT_ROWS ? rows[i] / tp : rows[i];
  }
  if (sp == SPLIT_COLS && in % tp)
    return td_err(TD_ERR_UNSUPPORTED, "%s: tensor \"%s\" has %d columns, not divisible by tensor parallel %d",
                  ld->dir, wnames[0], in, tp);
  int in_local = sp == SPLIT_COLS ? in / tp : in;
  const float *fold = ld->fold, *fold_b = ld->fold_b;
  ld->fold = ld->fold_b = NULL;
  TD_TRY(fit(&ld->tmp2, &ld->cap2, (size_t)out_rows * in_local + 2 * (size_t)out_rows));
  float *w = ld->tmp2, *bias = ld->tmp2 + (size_t)out_rows * in_local, *fb = bias + out_rows;
  bool any_bias = false;
  int row = 0;
  for (int i = 0; i < n_parts; i++) {
    int64_t shape[2] = {rows[i], in};
    TD_TRY(read_f32(ld, wnames[i], 2, shape));
    int r0 = 0, nr = rows[i];
    if (sp == SPLIT_ROWS) {
      nr = rows[i] / tp;
      r0 = r * nr;
    }
    int c0 = sp == SPLIT_COLS ? r * in_local : 0;
    for (int k = 0; k < nr; k++) {
      float *wr = w + (size_t)(row + k) * in_local;
      memcpy(wr, ld->tmp + (size_t)(r0 + k) * in + c0, sizeof(float) * (size_t)in_local);
      double wb = 0.0; /* (x_hat g + beta) W^T = x_hat (W diag(g))^T + W beta */
      if (fold_b)
        for (int j = 0; j < in_local; j++) wb += (double)wr[j] * fold_b[c0 + j];
      fb[row + k] = (float)wb;
      if (fold)
        for (int j = 0; j < in_local; j++) wr[j] *= fold[c0 + j];
    }
    const td_tensor_info *bt = bnames && bnames[i] ? find(ld, bnames[i], false) : NULL;
    if (bt && !(sp == SPLIT_COLS && r != 0)) {
      int64_t bshape[1] = {rows[i]};
      TD_TRY(read_f32(ld, bnames[i], 1, bshape));
      memcpy(bias + row, ld->tmp + r0, sizeof(float) * (size_t)nr);
      any_bias = true;
    } else {
      memset(bias + row, 0, sizeof(float) * (size_t)nr);
    }
    row += nr;
  }
  out->out = out_rows;
  out->in = in_local;
  out->b = out->wsum = NULL;
  if (fold_b) { /* the bias gains W beta; the row sums are of W as a bf16 backend holds it */
    bool bf16 = td_buf_elem_size(ld->b, TD_BUF_ACT) == 2;
    for (int k = 0; k < out_rows; k++) {
      double s = 0.0;
      const float *wr = w + (size_t)k * in_local;
      for (int j = 0; j < in_local; j++) s += bf16 ? td_bf16_to_f32(td_f32_to_bf16(wr[j])) : wr[j];
      bias[k] += fb[k];
      fb[k] = (float)s;
    }
    any_bias = true;
    TD_TRY(upload_new(ld, TD_BUF_F32, fb, (size_t)out_rows, (void **)&out->wsum));
  }
  TD_TRY(upload_new(ld, TD_BUF_ACT, w, (size_t)out_rows * in_local, &out->w));
  if (any_bias) TD_TRY(upload_new(ld, TD_BUF_F32, bias, (size_t)out_rows, (void **)&out->b));
  return TD_OK;
}

/* One-part shorthand. */
static td_status load_lin1(loader *ld, const char *wname, const char *bname, int rows, int in, split sp, lin *out) {
  const char *w[1] = {wname}, *bn[1] = {bname};
  int r[1] = {rows};
  return load_lin(ld, 1, w, bname ? bn : NULL, r, in, sp, out);
}

/* A [rows, d] table uploaded whole (embeddings, positions). */
static td_status load_table(loader *ld, const char *name, int rows, int d, int skip_rows, void **out) {
  int64_t shape[2] = {rows, d};
  TD_TRY(read_f32(ld, name, 2, shape));
  return upload_new(ld, TD_BUF_ACT, ld->tmp + (size_t)skip_rows * d, (size_t)(rows - skip_rows) * d, out);
}

/* transformers' T5 bucket function, in float32 as torch computes it. */
static int t5_bucket(int rel, bool bidirectional, int nb, int max_distance) {
  int ret = 0, n;
  if (bidirectional) {
    nb /= 2;
    if (rel > 0) ret += nb;
    n = rel < 0 ? -rel : rel;
  } else {
    n = rel < 0 ? -rel : 0;
  }
  int max_exact = nb / 2;
  if (n < max_exact) return ret + n;
  float v = logf((float)n / (float)max_exact) / (float)log((double)max_distance / max_exact) * (float)(nb - max_exact);
  int large = max_exact + (int)v;
  if (large > nb - 1) large = nb - 1;
  return ret + large;
}

/* Per-head bias lookup over relative positions [-max_distance, max_distance]
 * for this rank's heads [h0, h0 + nh). */
static td_status load_relbias(loader *ld, const char *name, bool bidirectional, int h_total, int h0, int nh,
                              float **out) {
  const td_model_config *c = ld->c;
  int64_t shape[2] = {c->rel_buckets, h_total};
  TD_TRY(read_f32(ld, name, 2, shape));
  int md = c->rel_max_distance, w = 2 * md + 1;
  float *lut = malloc(sizeof *lut * (size_t)w * nh);
  if (!lut) return td_err(TD_ERR_NOMEM, "out of memory");
  for (int rel = -md; rel <= md; rel++) {
    int bk = t5_bucket(rel, bidirectional, c->rel_buckets, md);
    for (int h = 0; h < nh; h++) lut[(size_t)h * w + rel + md] = ld->tmp[(size_t)bk * h_total + h0 + h];
  }
  td_status s = upload_new(ld, TD_BUF_F32, lut, (size_t)w * nh, (void **)out);
  free(lut);
  return s;
}

/* Marian's table: sin over the first half of the dims, cos over the rest. */
static void sinusoidal(float *t, int n_pos, int d) {
  int half = (d + 1) / 2;
  for (int p = 0; p < n_pos; p++)
    for (int j = 0; j < d; j++) {
      int pair = j < half ? 2 * j : 2 * (j - half) + 1;
      double angle = p / pow(10000.0, 2.0 * (pair / 2) / d);
      t[(size_t)p * d + j] = (float)(j < half ? sin(angle) : cos(angle));
    }
}

static td_status load_ffn_t5(loader *ld, const char *pre, int ff, lin *wi, lin *wo) {
  const td_model_config *c = ld->c;
  char n0[256], n1[256], no[256];
  snprintf(no, sizeof no, "%s.DenseReluDense.wo.weight", pre);
  if (c->gated_ffn) {
    snprintf(n0, sizeof n0, "%s.DenseReluDense.wi_0.weight", pre);
    snprintf(n1, sizeof n1, "%s.DenseReluDense.wi_1.weight", pre);
    const char *names[2] = {n0, n1};
    int rows[2] = {ff, ff};
    TD_TRY(load_lin(ld, 2, names, NULL, rows, c->d_model, SPLIT_ROWS, wi));
  } else {
    snprintf(n0, sizeof n0, "%s.DenseReluDense.wi.weight", pre);
    TD_TRY(load_lin1(ld, n0, NULL, ff, c->d_model, SPLIT_ROWS, wi));
  }
  return load_lin1(ld, no, NULL, c->d_model, ff, SPLIT_COLS, wo);
}

static td_status load_attn_t5(loader *ld, const char *pre, int heads, int hd, bool with_qkv, lin *qkv, lin *q,
                              lin *kv, lin *o) {
  int d = ld->c->d_model, hdim = heads * hd;
  char nq[256], nk[256], nv[256], no[256];
  snprintf(nq, sizeof nq, "%s.q.weight", pre);
  snprintf(nk, sizeof nk, "%s.k.weight", pre);
  snprintf(nv, sizeof nv, "%s.v.weight", pre);
  snprintf(no, sizeof no, "%s.o.weight", pre);
  if (with_qkv) {
    const char *names[3] = {nq, nk, nv};
    int rows[3] = {hdim, hdim, hdim};
    TD_TRY(load_lin(ld, 3, names, NULL, rows, d, SPLIT_ROWS, qkv));
  } else {
    TD_TRY(load_lin1(ld, nq, NULL, hdim, d, SPLIT_ROWS, q));
    const char *names[2] = {nk, nv};
    int rows[2] = {hdim, hdim};
    TD_TRY(load_lin(ld, 2, names, NULL, rows, d, SPLIT_ROWS, kv));
  }
  return load_lin1(ld, no, NULL, d, hdim, SPLIT_COLS, o);
}

static td_status load_t5(td_model *m, loader *ld) {
  const td_model_config *c = &m->cfg;
  char pre[256], name[256];
  for (int i = m->d.e0; i < m->d.e1; i++) {
    enc_layer *L = &m->enc[i - m->d.e0];
    snprintf(pre, sizeof pre, "encoder.block.%d.layer.0.SelfAttention", i);
    TD_TRY(load_attn_t5(ld, pre, c->enc_heads, c->enc_head_dim, true, &L->qkv, NULL, NULL, &L->o));
    snprintf(name, sizeof name, "encoder.block.%d.layer.0.layer_norm", i);
    TD_TRY(load_norm(ld, name, c->d_model, &L->ln_attn));
    snprintf(pre, sizeof pre, "encoder.block.%d.layer.1", i);
    TD_TRY(load_ffn_t5(ld, pre, c->enc_ffn, &L->wi, &L->wo));
    snprintf(name, sizeof name, "encoder.block.%d.layer.1.layer_norm", i);
    TD_TRY(load_norm(ld, name, c->d_model, &L->ln_ffn));
  }
  /* The decoder's pre-norms are RMSNorms right before a linear layer:
   * their weights go into that layer's W (norm(x) W^T = (x / rms(x))
   * (W diag(w))^T), so a decode GEMM normalises by scaling its output.
   * td_model_tuning.norm_fold TD_OFF keeps them apart. */
  bool fold = c->pre_norm && c->rmsnorm && m->opts.tuning.norm_fold != TD_OFF;
  float *fw = fold ? malloc(sizeof(float) * (size_t)c->d_model) : NULL;
  if (fold && !fw) return td_err(TD_ERR_NOMEM, "out of memory");
  td_status st = TD_OK;
  for (int i = m->d.l0; i < m->d.l1 && st == TD_OK; i++) {
    dec_layer *L = &m->dec[i - m->d.l0];
    norm_w *ln[3] = {&L->ln_self, &L->ln_cross, &L->ln_ffn};
    for (int j = 0; j < 3 && st == TD_OK; j++) {
      snprintf(name, sizeof name, "decoder.block.%d.layer.%d.layer_norm", i, j);
      st = load_norm_fold(ld, name, c->d_model, ln[j], fw, NULL);
      if (st != TD_OK) break;
      if (j == 0) {
        snprintf(pre, sizeof pre, "decoder.block.%d.layer.0.SelfAttention", i);
        st = load_attn_t5(ld, pre, c->dec_heads, c->dec_head_dim, true, &L->qkv, NULL, NULL, &L->o);
      } else if (j == 1) {
        snprintf(pre, sizeof pre, "decoder.block.%d.layer.1.EncDecAttention", i);
        st = load_attn_t5(ld, pre, c->dec_heads, c->dec_head_dim, false, NULL, &L->cq, &L->ckv, &L->co);
      } else {
        snprintf(pre, sizeof pre, "decoder.block.%d.layer.2", i);
        st = load_ffn_t5(ld, pre, c->dec_ffn, &L->wi, &L->wo);
      }
      ld->fold = NULL;
    }
  }
  free(fw);
  TD_TRY(st);
  TD_TRY(load_norm(ld, "encoder.final_layer_norm", c->d_model, &m->enc_final));
  TD_TRY(load_norm(ld, "decoder.final_layer_norm", c->d_model, &m->dec_final));
  int tp = ld->tp;
  TD_TRY(load_relbias(ld, "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", true, c->enc_heads,
                      ld->rank * (c->enc_heads / tp), c->enc_heads / tp, &m->enc_lut));
  TD_TRY(load_relbias(ld, "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", false,
                      c->dec_heads, ld->rank * (c->dec_heads / tp), c->dec_heads / tp, &m->dec_lut));
  return TD_OK;
}

/* BART / mBART / Marian / Whisper attention block. */
static td_status load_attn_bart(loader *ld, const char *pre, int heads, int hd, bool with_qkv, lin *qkv, lin *q,
                                lin *kv, lin *o) {
  int d = ld->c->d_model, hdim = heads * hd;
  char nq[256], nk[256], nv[256], no[256], bq[256], bk[256], bv[256], bo[256];
  snprintf(nq, sizeof nq, "%s.q_proj.weight", pre);
  snprintf(nk, sizeof nk, "%s.k_proj.weight", pre);
  snprintf(nv, sizeof nv, "%s.v_proj.weight", pre);
  snprintf(no, sizeof no, "%s.out_proj.weight", pre);
  snprintf(bq, sizeof bq, "%s.q_proj.bias", pre);
  snprintf(bk, sizeof bk, "%s.k_proj.bias", pre);
  snprintf(bv, sizeof bv, "%s.v_proj.bias", pre);
  snprintf(bo, sizeof bo, "%s.out_proj.bias", pre);
  if (ld->c->k_bias && !find(ld, bk, true)) return TD_ERR_FORMAT;
  if (!find(ld, bq, true) || !find(ld, bv, true) || !find(ld, bo, true)) return TD_ERR_FORMAT;
  if (with_qkv) {
    const char *names[3] = {nq, nk, nv}, *bnames[3] = {bq, bk, bv};
    int rows[3] = {hdim, hdim, hdim};
    TD_TRY(load_lin(ld, 3, names, bnames, rows, d, SPLIT_ROWS, qkv));
  } else {
    TD_TRY(load_lin1(ld, nq, bq, hdim, d, SPLIT_ROWS, q));
    const char *names[2] = {nk, nv}, *bnames[2] = {bk, bv};
    int rows[2] = {hdim, hdim};
    TD_TRY(load_lin(ld, 2, names, bnames, rows, d, SPLIT_ROWS, kv));
  }
  return load_lin1(ld, no, bo, d, hdim, SPLIT_COLS, o);
}

static td_status load_ffn_bart(loader *ld, const char *pre, int ff, lin *wi, lin *wo) {
  int d = ld->c->d_model;
  char w1[256], b1[256], w2[256], b2[256];
  snprintf(w1, sizeof w1, "%s.fc1.weight", pre);
  snprintf(b1, sizeof b1, "%s.fc1.bias", pre);
  snprintf(w2, sizeof w2, "%s.fc2.weight", pre);
  snprintf(b2, sizeof b2, "%s.fc2.bias", pre);
  if (!find(ld, b1, true) || !find(ld, b2, true)) return TD_ERR_FORMAT;
  TD_TRY(load_lin1(ld, w1, b1, ff, d, SPLIT_ROWS, wi));
  return load_lin1(ld, w2, b2, d, ff, SPLIT_COLS, wo);
}

static td_status load_bart_decoder(td_model *m, loader *ld, const char *P, float *fw, float *fb) {
  const td_model_config *c = &m->cfg;
  char pre[256], name[256];
  for (int i = m->d.l0; i < m->d.l1; i++) {
    dec_layer *L = &m->dec[i - m->d.l0];
    /* each norm is loaded (and with fw folded) before the layer it feeds */
    snprintf(name, sizeof name, "%sdecoder.layers.%d.self_attn_layer_norm", P, i);
    TD_TRY(load_norm_fold(ld, name, c->d_model, &L->ln_self, fw, fb));
    snprintf(pre, sizeof pre, "%sdecoder.layers.%d.self_attn", P, i);
    TD_TRY(load_attn_bart(ld, pre, c->dec_heads, c->dec_head_dim, true, &L->qkv, NULL, NULL, &L->o));
    snprintf(name, sizeof name, "%sdecoder.layers.%d.encoder_attn_layer_norm", P, i);
    TD_TRY(load_norm_fold(ld, name, c->d_model, &L->ln_cross, fw, fb));
    snprintf(pre, sizeof pre, "%sdecoder.layers.%d.encoder_attn", P, i);
    TD_TRY(load_attn_bart(ld, pre, c->dec_heads, c->dec_head_dim, false, NULL, &L->cq, &L->ckv, &L->co));
    snprintf(name, sizeof name, "%sdecoder.layers.%d.final_layer_norm", P, i);
    TD_TRY(load_norm_fold(ld, name, c->d_model, &L->ln_ffn, fw, fb));
    snprintf(pre, sizeof pre, "%sdecoder.layers.%d", P, i);
    TD_TRY(load_ffn_bart(ld, pre, c->dec_ffn, &L->wi, &L->wo));
  }
  return TD_OK;
}

static td_status load_bart(td_model *m, loader *ld, const char *P) {
  const td_model_config *c = &m->cfg;
  char pre[256], name[256];
  for (int i = m->d.e0; i < m->d.e1; i++) {
    enc_layer *L = &m->enc[i - m->d.e0];
    snprintf(pre, sizeof pre, "%sencoder.layers.%d.self_attn", P, i);
    TD_TRY(load_attn_bart(ld, pre, c->enc_heads, c->enc_head_dim, true, &L->qkv, NULL, NULL, &L->o));
    snprintf(name, sizeof name, "%sencoder.layers.%d.self_attn_layer_norm", P, i);
    TD_TRY(load_norm(ld, name, c->d_model, &L->ln_attn));
    snprintf(pre, sizeof pre, "%sencoder.layers.%d", P, i);
    TD_TRY(load_ffn_bart(ld, pre, c->enc_ffn, &L->wi, &L->wo));
    snprintf(name, sizeof name, "%sencoder.layers.%d.final_layer_norm", P, i);
    TD_TRY(load_norm(ld, name, c->d_model, &L->ln_ffn));
  }
  /* Pre-norm LayerNorms of the decoder go into the linear layers they
   * feed, as T5's RMSNorms do (load_t5); norm_fold TD_OFF keeps them
   * apart. Post-norm models normalise the residual itself: nothing to fold. */
  bool fold = c->pre_norm && !c->rmsnorm && m->opts.tuning.norm_fold != TD_OFF;
  float *fw = fold ? malloc(sizeof(float) * 2 * (size_t)c->d_model) : NULL;
  if (fold && !fw) return td_err(TD_ERR_NOMEM, "out of memory");
  td_status st = load_bart_decoder(m, ld, P, fw, fw ? fw + c->d_model : NULL);
  ld->fold = ld->fold_b = NULL;
  free(fw);
  TD_TRY(st);
  if (c->layernorm_embedding) {
    snprintf(name, sizeof name, "%sencoder.layernorm_embedding", P);
    TD_TRY(load_norm(ld, name, c->d_model, &m->enc_ln_emb));
    snprintf(name, sizeof name, "%sdecoder.layernorm_embedding", P);
    TD_TRY(load_norm(ld, name, c->d_model, &m->dec_ln_emb));
  }
  if (c->final_norm) {
    snprintf(name, sizeof name, "%sencoder.layer_norm", P);
    TD_TRY(load_norm(ld, name, c->d_model, &m->enc_final));
    snprintf(name, sizeof name, "%sdecoder.layer_norm", P);
    TD_TRY(load_norm(ld, name, c->d_model, &m->dec_final));
  }
  int d = c->d_model;
  if (c->family == TD_FAMILY_WHISPER) {
    int mels = c->num_mel_bins;
    int64_t s1[3] = {d, mels, 3}, s2[3] = {d, d, 3}, sb[1] = {d};
    snprintf(name, sizeof name, "%sencoder.conv1.weight", P);
    TD_TRY(read_f32(ld, name, 3, s1));
    TD_TRY(upload_new(ld, TD_BUF_ACT, ld->tmp, (size_t)d * mels * 3, &m->conv1.w));
    snprintf(name, sizeof name, "%sencoder.conv2.weight", P);
    TD_TRY(read_f32(ld, name, 3, s2));
    TD_TRY(upload_new(ld, TD_BUF_ACT, ld->tmp, (size_t)d * d * 3, &m->conv2.w));
    snprintf(name, sizeof name, "%sencoder.conv1.bias", P);
    TD_TRY(read_f32(ld, name, 1, sb));
    TD_TRY(upload_new(ld, TD_BUF_F32, ld->tmp, (size_t)d, (void **)&m->conv1.b));
    snprintf(name, sizeof name, "%sencoder.conv2.bias", P);
    TD_TRY(read_f32(ld, name, 1, sb));
    TD_TRY(upload_new(ld, TD_BUF_F32, ld->tmp, (size_t)d, (void **)&m->conv2.b));
    snprintf(name, sizeof name, "%sencoder.embed_positions.weight", P);
    TD_TRY(load_table(ld, name, c->max_source_len, d, 0, &m->enc_pos_mem));
    snprintf(name, sizeof name, "%sdecoder.embed_positions.weight", P);
    TD_TRY(load_table(ld, name, c->max_target_len, d, 0, &m->dec_pos_mem));
  } else if (c->pos_kind == TD_POS_LEARNED) {
    int rows = c->max_source_len + c->pos_offset;
    snprintf(name, sizeof name, "%sencoder.embed_positions.weight", P);
    TD_TRY(load_table(ld, name, rows, d, c->pos_offset, &m->enc_pos_mem));
    snprintf(name, sizeof name, "%sdecoder.embed_positions.weight", P);
    TD_TRY(load_table(ld, name, rows, d, c->pos_offset, &m->dec_pos_mem));
  } else { /* sinusoidal: the stored table when present, else built as transformers does */
    for (int e = 0; e < 2; e++) {
      snprintf(name, sizeof name, "%s%s.embed_positions.weight", P, e ? "decoder" : "encoder");
      void **dst = e ? &m->dec_pos_mem : &m->enc_pos_mem;
      int rows = e ? c->max_target_len : c->max_source_len;
      if (find(ld, name, false)) {
        TD_TRY(load_table(ld, name, rows, d, 0, dst));
      } else {
        TD_TRY(fit(&ld->tmp, &ld->cap, (size_t)rows * d));
        sinusoidal(ld->tmp, rows, d);
        TD_TRY(upload_new(ld, TD_BUF_ACT, ld->tmp, (size_t)rows * d, dst));
      }
    }
  }
  m->enc_pos = m->enc_pos_mem;
  m->dec_pos = m->dec_pos_mem;
  return TD_OK;
}

/* Token tables, the output head and its bias. */
static td_status load_embeddings(td_model *m, loader *ld, const char *P) {
  const td_model_config *c = &m->cfg;
  int d = c->d_model, V = c->vocab_size;
  char shared[256], enc[256], dec[256], head[256];
  if (c->family == TD_FAMILY_T5) {
    snprintf(shared, sizeof shared, "shared.weight");
    snprintf(enc, sizeof enc, "encoder.embed_tokens.weight");
    snprintf(dec, sizeof dec, "decoder.embed_tokens.weight");
    snprintf(head, sizeof head, "lm_head.weight");
  } else {
    snprintf(shared, sizeof shared, "%sshared.weight", P);
    snprintf(enc, sizeof enc, "%sencoder.embed_tokens.weight", P);
    snprintf(dec, sizeof dec, "%sdecoder.embed_tokens.weight", P);
    snprintf(head, sizeof head, c->family == TD_FAMILY_WHISPER ? "proj_out.weight" : "lm_head.weight");
  }
  const char *enc_src = find(ld, enc, false) ? enc : shared;
  const char *dec_src = find(ld, dec, false) ? dec : shared;
  if (c->family != TD_FAMILY_WHISPER) {
    if (!find(ld, enc_src, true)) return TD_ERR_FORMAT;
    TD_TRY(load_table(ld, enc_src, V, d, 0, &m->enc_tok));
  }
  if (!find(ld, dec_src, true)) return TD_ERR_FORMAT;
  if (c->family != TD_FAMILY_WHISPER && !strcmp(enc_src, dec_src))
    m->dec_tok = m->enc_tok;
  else
    TD_TRY(load_table(ld, dec_src, V, d, 0, &m->dec_tok));
  /* The head: its own tensor when stored, else tied to the decoder table.
   * With tensor parallelism each rank holds a slice of the vocabulary. */
  const char *head_src = find(ld, head, false) ? head : NULL;
  if (!head_src) {
    if (!c->tie_word_embeddings)
      return td_err(TD_ERR_FORMAT, "%s: tensor \"%s\" is missing and tie_word_embeddings is false", ld->dir, head);
    head_src = dec_src;
  }
  /* Each rank holds `per` rows of the head; rows past the vocabulary are
   * zero with a -1e30 bias, so that they are never chosen. */
  int tp = ld->tp, per = (V + tp - 1) / tp;
  m->d.v0 = ld->rank * per;
  m->d.v1 = m->d.v0 + per;
  int real = V - m->d.v0 < per ? (V - m->d.v0 > 0 ? V - m->d.v0 : 0) : per;
  if (tp == 1 && head_src == dec_src) {
    m->head = m->dec_tok;
  } else {
    int64_t shape[2] = {V, d};
    TD_TRY(read_f32(ld, head_src, 2, shape));
    TD_TRY(fit(&ld->tmp2, &ld->cap2, (size_t)per * d));
    memset(ld->tmp2, 0, sizeof(float) * (size_t)per * d);
    memcpy(ld->tmp2, ld->tmp + (size_t)m->d.v0 * d, sizeof(float) * (size_t)real * d);
    TD_TRY(upload_new(ld, TD_BUF_ACT, ld->tmp2, (size_t)per * d, &m->head));
  }
  /* final_logits_bias (BART family), zeros otherwise. */
  const char *fb = "final_logits_bias";
  float *bias = malloc(sizeof(float) * (size_t)per);
  if (!bias) return td_err(TD_ERR_NOMEM, "out of memory");
  for (int i = 0; i < per; i++) bias[i] = i < real ? 0.0f : -1e30f;
  td_status s = TD_OK;
  if (find(ld, fb, false)) {
    int64_t shape[2] = {1, V};
    s = read_f32(ld, fb, 2, shape);
    if (s == TD_OK) memcpy(bias, ld->tmp + m->d.v0, sizeof(float) * (size_t)real);
  }
  if (s == TD_OK) s = upload_new(ld, TD_BUF_F32, bias, (size_t)per, (void **)&m->logits_bias);
  free(bias);
  return s;
}

static td_status alloc_scratch(td_model *m) {
  td_backend *b = m->b;
  const td_model_opts *o = &m->opts;
  const td_model_config *c = &m->cfg;
  const dims *d = &m->d;
  size_t E = (size_t)o->max_enc_tokens, T = (size_t)o->max_tokens, L = (size_t)o->max_logits;
  size_t ehd = (size_t)d->eh * d->edh, dhd = (size_t)d->dh_ * d->ddh;
  size_t eqkv = 3 * ehd > 2 * dhd ? 3 * ehd : 2 * dhd;
  int g = c->gated_ffn ? 2 : 1;
  struct {
    void **p;
    td_buf_type t;
    size_t n;
  } bufs[] = {
      {&m->e_h, TD_BUF_ACT, E * d->d},
      {&m->e_x, TD_BUF_ACT, E * d->d},
      {&m->e_qkv, TD_BUF_ACT, E * eqkv},
      {&m->e_attn, TD_BUF_ACT, E * ehd},
      {&m->e_ff, TD_BUF_ACT, E * d->eff * g},
      {&m->e_ff1, TD_BUF_ACT, c->gated_ffn ? E * d->eff : 1},
      {&m->d_h, TD_BUF_ACT, T * d->d},
      {&m->d_x, TD_BUF_ACT, T * d->d},
      {&m->d_qkv, TD_BUF_ACT, T * 3 * dhd},
      {&m->d_attn, TD_BUF_ACT, T * dhd},
      {&m->d_q, TD_BUF_ACT, T * dhd},
      {&m->d_ff, TD_BUF_ACT, T * d->dff * g},
      {&m->d_ff1, TD_BUF_ACT, c->gated_ffn ? T * d->dff : 1},
      {&m->d_lx, TD_BUF_ACT, L * d->d},
      {&m->d_qs, TD_BUF_ACT, m->states_rows <= (int)T ? T * d->dh_ * (size_t)d->d : 1},
      {&m->d_us, TD_BUF_ACT, m->states_rows <= (int)T ? T * d->dh_ * (size_t)d->d : 1},
      {(void **)&m->logits, TD_BUF_F32, L * (size_t)d->vocab},
      {(void **)&m->logits_part, TD_BUF_F32, o->tp_size > 1 ? L * (size_t)(d->v1 - d->v0) : 1},
      {(void **)&m->logits_all, TD_BUF_F32, o->tp_size > 1 ? L * (size_t)(d->v1 - d->v0) * o->tp_size : 1},
  };
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) TD_TRY(td_alloc(b, bufs[i].t, bufs[i].n, bufs[i].p));
  if (c->family == TD_FAMILY_WHISPER) {
    size_t frames = 2 * E; /* input frames for E output frames */
    TD_TRY(td_alloc(b, TD_BUF_ACT, frames * c->num_mel_bins, &m->w_feat));
    TD_TRY(td_alloc(b, TD_BUF_ACT, frames * c->num_mel_bins * 3, &m->w_col1));
    TD_TRY(td_alloc(b, TD_BUF_ACT, frames * d->d, &m->w_c1));
    TD_TRY(td_alloc(b, TD_BUF_ACT, E * d->d * 3, &m->w_col2));
  }
  /* metadata: the larger of the step's and the encoder's needs */
  size_t S = (size_t)o->max_seqs;
  size_t step = 4 * T + 3 * S + 1 + S * (size_t)(m->self_stride + m->cross_stride) + L;
  size_t enc = 3 * E + (size_t)o->max_enc_seqs + 1;
  m->meta_cap = step > enc ? step : enc;
  TD_TRY(td_alloc(b, TD_BUF_I32, m->meta_cap, (void **)&m->meta_dev));
  TD_TRY(td_host_alloc(b, m->meta_cap * sizeof(int32_t), (void **)&m->meta_host));
  return TD_OK;
}

td_status td_model_load(const char *dir, td_backend *b, const td_model_opts *opts_in, td_model **out) {
  *out = NULL;
  td_model *m = calloc(1, sizeof *m);
  if (!m) return td_err(TD_ERR_NOMEM, "out of memory");
  m->b = b;
  m->opts = *opts_in;
  td_model_opts_default(&m->opts);
  loader ld = {.b = b, .dir = dir, .c = &m->cfg, .rank = m->opts.tp_rank, .tp = m->opts.tp_size};
  td_status s = td_model_config_load(dir, &m->cfg);
  if (s != TD_OK) goto fail;
  s = td_gen_config_load(dir, &m->cfg, &m->gen);
  if (s != TD_OK) goto fail;
  const td_model_config *c = &m->cfg;
  int tp = m->opts.tp_size;
  if (m->opts.tp_rank < 0 || m->opts.tp_rank >= tp) {
    s = td_err(TD_ERR_INVALID, "tensor-parallel rank %d outside [0, %d)", m->opts.tp_rank, tp);
    goto fail;
  }
  if (c->enc_heads % tp || c->dec_heads % tp || c->enc_ffn % tp || c->dec_ffn % tp) {
    s = td_err(TD_ERR_UNSUPPORTED, "%s: heads (%d, %d) and FFN widths (%d, %d) must divide by tensor parallel %d",
               dir, c->enc_heads, c->dec_heads, c->enc_ffn, c->dec_ffn, tp);
    goto fail;
  }
  int pp = m->opts.pp_size;
  if (m->opts.pp_rank < 0 || m->opts.pp_rank >= pp || (pp > 1 && tp > 1)) {
    s = td_err(TD_ERR_UNSUPPORTED, "pipeline stage %d of %d with tensor parallel %d: a worker group is either "
               "tensor- or pipeline-parallel", m->opts.pp_rank, pp, tp);
    goto fail;
  }
  if (pp > c->dec_layers) {
    s = td_err(TD_ERR_UNSUPPORTED, "%s: %d pipeline stages for %d decoder layers", dir, pp, c->dec_layers);
    goto fail;
  }
  if (pp > 1 && td_comm_world(td_backend_comm(b)) != pp) {
    s = td_err(TD_ERR_INVALID, "pipeline parallel %d needs a communicator of %d ranks attached to the backend", pp, pp);
    goto fail;
  }
  if (tp > 1 && td_comm_world(td_backend_comm(b)) != tp) {
    s = td_err(TD_ERR_INVALID, "tensor parallel %d needs a communicator of %d ranks attached to the backend", tp, tp);
    goto fail;
  }
  m->d = (dims){.d = c->d_model, .vocab = c->vocab_size, .eh = c->enc_heads / tp, .edh = c->enc_head_dim,
                .eff = c->enc_ffn / tp, .dh_ = c->dec_heads / tp, .ddh = c->dec_head_dim, .dff = c->dec_ffn / tp,
                .stage = m->opts.pp_rank, .stages = pp};
  m->d.e0 = c->enc_layers * m->d.stage / pp;
  m->d.e1 = c->enc_layers * (m->d.stage + 1) / pp;
  m->d.l0 = c->dec_layers * m->d.stage / pp;
  m->d.l1 = c->dec_layers * (m->d.stage + 1) / pp;
  m->max_src = m->opts.max_source_len > 0 && m->opts.max_source_len < c->max_source_len ? m->opts.max_source_len
                                                                                        : c->max_source_len;
  m->max_tgt = m->opts.max_target_len > 0 && m->opts.max_target_len < c->max_target_len ? m->opts.max_target_len
                                                                                        : c->max_target_len;
  if (c->family == TD_FAMILY_T5) { /* relative positions: any length the caller allows */
    if (m->opts.max_source_len > 0) m->max_src = m->opts.max_source_len;
    if (m->opts.max_target_len > 0) m->max_tgt = m->opts.max_target_len;
  }
  if (m->opts.cross_mode == TD_CROSS_AUTO) m->opts.cross_mode = c->d_model % 2 ? TD_CROSS_KV : TD_CROSS_DUAL;
  if (m->opts.cross_mode < TD_CROSS_AUTO || m->opts.cross_mode > TD_CROSS_DUAL) {
    s = td_err(TD_ERR_INVALID, "cross pool mode %d", (int)m->opts.cross_mode);
    goto fail;
  }
  if (m->opts.cross_mode != TD_CROSS_KV && c->d_model % 2) {
    s = td_err(TD_ERR_UNSUPPORTED, "%s: cross states need an even d_model (%d); use --cross-mode kv", dir,
               c->d_model);
    goto fail;
  }
  /* the fewest rows that take the states path */
  m->states_rows = m->opts.cross_mode == TD_CROSS_STATES ? 0
                   : m->opts.cross_mode == TD_CROSS_KV || m->opts.states_rows < 0 ? INT_MAX
                   : m->opts.states_rows > 0 ? m->opts.states_rows
                                             : td_attn_states_rows(b, c->d_model);
  int bs = m->opts.block_size;
  m->self_stride = (m->max_tgt + bs - 1) / bs;
  m->cross_stride = (m->max_src + bs - 1) / bs;
  if (c->family == TD_FAMILY_WHISPER && m->opts.max_enc_tokens < m->max_src) m->opts.max_enc_tokens = m->max_src;
  m->enc = calloc((size_t)(m->d.e1 - m->d.e0) + 1, sizeof *m->enc);
  m->dec = calloc((size_t)(m->d.l1 - m->d.l0) + 1, sizeof *m->dec);
  if (!m->enc || !m->dec) {
    s = td_err(TD_ERR_NOMEM, "out of memory");
    goto fail;
  }
  s = td_checkpoint_open(dir, &ld.ck);
  if (s != TD_OK) goto fail;
  const char *P = "";
  if (c->family != TD_FAMILY_T5 && td_checkpoint_find(ld.ck, "model.encoder.layers.0.self_attn.q_proj.weight"))
    P = "model.";
  s = c->family == TD_FAMILY_T5 ? load_t5(m, &ld) : load_bart(m, &ld, P);
  if (s == TD_OK) s = load_embeddings(m, &ld, P);
  if (s == TD_OK && c->scale_decoder_outputs) {
    /* Fold T5's d_model^-0.5 output scaling into the final norm weight. */
    int64_t shape[1] = {c->d_model};
    s = read_f32(&ld, "decoder.final_layer_norm.weight", 1, shape);
    if (s == TD_OK) {
      float sc = 1.0f / sqrtf((float)c->d_model);
      for (int i = 0; i < c->d_model; i++) ld.tmp[i] *= sc;
      s = td_upload(b, TD_BUF_F32, m->dec_final.w, ld.tmp, (size_t)c->d_model);
    }
  }
  td_checkpoint_close(ld.ck);
  free(ld.tmp);
  free(ld.tmp2);
  if (s != TD_OK) goto fail;
  s = alloc_scratch(m);
  if (s != TD_OK) goto fail;
  if (td_backend_has_graphs(b) && !m->opts.no_graphs && m->opts.pp_size == 1)
    for (int bk = 1; bk <= m->opts.max_seqs && m->n_buckets < 16; bk *= 2) m->buckets[m->n_buckets++] = bk;
  if (m->n_buckets && m->buckets[m->n_buckets - 1] < m->opts.max_seqs && m->n_buckets < 16)
    m->buckets[m->n_buckets++] = m->opts.max_seqs;
  int qr = m->opts.tuning.qnorm_rows;
  m->q_norm_rows = qr > 0 ? qr : qr < 0 ? 0 : td_backend_fused_norm_rows(b);
  s = td_sync(b);
  if (s != TD_OK) goto fail;
  TD_INFO("loaded %s (%s, d_model %d, %d+%d layers, vocab %d) on %s", dir, c->model_type, c->d_model, c->enc_layers,
          c->dec_layers, c->vocab_size, td_backend_name(b));
  *out = m;
  return TD_OK;
fail:
  td_model_destroy(m);
  return s;
}

static void free_lin(td_backend *b, lin *l) {
  td_free(b, l->w);
  td_free(b, l->b);
  td_free(b, l->wsum);
}

static void free_norm(td_backend *b, norm_w *n) {
  td_free(b, n->w);
  td_free(b, n->b);
}

void td_model_destroy(td_model *m) {
  if (!m) return;
  td_backend *b = m->b;
  void *scratch[] = {m->e_h, m->e_x, m->e_qkv, m->e_attn, m->e_ff, m->e_ff1, m->w_col1, m->w_c1, m->w_col2,
                     m->w_feat, m->d_h, m->d_x, m->d_qkv, m->d_attn, m->d_q, m->d_ff, m->d_ff1, m->d_lx, m->d_qs, m->d_us,
                     m->logits, m->logits_part, m->logits_all, m->meta_dev};
  for (size_t i = 0; i < sizeof scratch / sizeof scratch[0]; i++) td_free(b, scratch[i]);
  td_host_free(b, m->meta_host);
  for (int i = 0; i < m->n_buckets; i++) td_graph_destroy(b, m->graphs[i]);
  for (int i = 0; m->enc && i < m->d.e1 - m->d.e0; i++) {
    enc_layer *L = &m->enc[i];
    free_norm(b, &L->ln_attn);
    free_norm(b, &L->ln_ffn);
    free_lin(b, &L->qkv);
    free_lin(b, &L->o);
    free_lin(b, &L->wi);
    free_lin(b, &L->wo);
  }
  for (int i = 0; m->dec && i < m->d.l1 - m->d.l0; i++) {
    dec_layer *L = &m->dec[i];
    free_norm(b, &L->ln_self);
    free_norm(b, &L->ln_cross);
    free_norm(b, &L->ln_ffn);
    lin *ls[] = {&L->qkv, &L->o, &L->cq, &L->ckv, &L->co, &L->wi, &L->wo};
    for (size_t k = 0; k < 7; k++) free_lin(b, ls[k]);
  }
  free(m->enc);
  free(m->dec);
  if (m->head != m->dec_tok) td_free(b, m->head);
  if (m->dec_tok != m->enc_tok) td_free(b, m->dec_tok);
  td_free(b, m->enc_tok);
  td_free(b, m->enc_pos_mem);
  td_free(b, m->dec_pos_mem);
  free_norm(b, &m->enc_ln_emb);
  free_norm(b, &m->dec_ln_emb);
  free_norm(b, &m->enc_final);
  free_norm(b, &m->dec_final);
  td_free(b, m->logits_bias);
  td_free(b, m->enc_lut);
  td_free(b, m->dec_lut);
  free_lin(b, &m->conv1);
  free_lin(b, &m->conv2);
  td_gen_config_free(&m->gen);
  free(m);
}

const td_model_config *td_model_get_config(const td_model *m) { return &m->cfg; }
const td_gen_config *td_model_get_gen(const td_model *m) { return &m->gen; }
const td_model_opts *td_model_get_opts(const td_model *m) { return &m->opts; }
td_backend *td_model_backend(const td_model *m) { return m->b; }
int td_model_max_source_len(const td_model *m) { return m->max_src; }
int td_model_max_target_len(const td_model *m) { return m->max_tgt; }

int td_model_states_rows(const td_model *m) { return m->states_rows; }

td_kv_layout td_model_self_layout(const td_model *m) {
  return (td_kv_layout){m->d.l1 - m->d.l0, m->d.dh_, m->d.ddh, m->opts.block_size, 0};
}
td_kv_layout td_model_cross_layout(const td_model *m) {
  td_cross_mode cm = m->opts.cross_mode;
  return (td_kv_layout){cm == TD_CROSS_STATES ? 0 : m->d.l1 - m->d.l0, m->d.dh_, m->d.ddh, m->opts.block_size,
                        cm == TD_CROSS_KV ? 0 : m->d.d};
}

int td_model_encoder_out_len(const td_model *m, int input_len) {
  return m->cfg.family == TD_FAMILY_WHISPER ? m->max_src : input_len;
}

int td_model_input_frames(const td_model *m) {
  return m->cfg.family == TD_FAMILY_WHISPER ? 2 * m->cfg.max_source_len : 0;
}

void td_model_set_pools(td_model *m, void *self_pool, void *cross_pool) {
  m->self_pool = self_pool;
  m->cross_pool = cross_pool;
}

/* ---------------------------------------------------------------- forward */

static td_status publish_encode(td_model *m, const td_encode_input *in);
static td_status publish_step(td_model *m, const td_step_input *in);

static td_status norm(td_model *m, const norm_w *n, const void *x, void *y, int rows) {
  return td_norm(m->b, x, n->w, n->b, y, rows, m->d.d, m->cfg.norm_eps, m->cfg.rmsnorm);
}

static td_status linear(td_model *m, const lin *l, const void *x, void *y, int rows, td_act act, unsigned flags) {
  return td_gemm(m->b, x, l->w, l->b, y, rows, l->out, l->in, act, flags);
}

/* h += x W^T for a row-parallel layer: every rank adds its partial sum and
 * rank 0 the residual and bias, then an all-reduce. */
static td_status row_parallel(td_model *m, const lin *l, const void *x, void *h, int rows) {
  bool tp = m->opts.tp_size > 1;
  TD_TRY(linear(m, l, x, h, rows, TD_ACT_NONE, !tp || m->opts.tp_rank == 0 ? TD_GEMM_ACCUM : 0));
  return tp ? td_allreduce_sum(m->b, h, TD_BUF_ACT, (size_t)rows * m->d.d) : TD_OK;
}

/* y = act(norm(x) W^T + b), the norm fused where the backend can (pre-norm
 * layers pass n; post-norm NULL). xn: scratch for the normalised rows. */
static td_gemm_args norm_linear_args(td_model *m, const norm_w *n, const lin *l, const void *x, void *y, void *xn,
                                     int rows, td_act act, unsigned flags, void *glu_scratch) {
  bool plain = n && n->folded;
  td_gemm_args a = {.x = x, .w = l->w, .bias = l->b, .y = y, .m = rows, .n = l->out, .k = l->in, .act = act,
                    .flags = flags, .norm_w = n && !plain ? n->w : NULL, .norm_b = n && !plain ? n->b : NULL,
                    .norm_eps = m->cfg.norm_eps, .norm_rms = m->cfg.rmsnorm, .norm_plain = plain,
                    .norm_wsum = plain ? l->wsum : NULL, .scratch_norm = xn,
                    .scratch_glu = glu_scratch};
  return a;
}

static td_status norm_linear(td_model *m, const norm_w *n, const lin *l, const void *x, void *y, void *xn, int rows,
                             td_act act, unsigned flags, void *glu_scratch) {
  td_gemm_args a = norm_linear_args(m, n, l, x, y, xn, rows, act, flags, glu_scratch);
  return td_gemm_ex(m->b, &a);
}

/* h += FFN(norm(h)) (pre-norm, n given) or FFN(h) (post-norm, n NULL). */
static td_status ffn(td_model *m, const norm_w *n, const lin *wi, const lin *wo, void *h, void *xn, void *ff,
                     void *ff1, int rows) {
  if (m->cfg.gated_ffn) {
    TD_TRY(norm_linear(m, n, wi, h, ff1, xn, rows, m->cfg.act, TD_GEMM_GLU, ff));
    return row_parallel(m, wo, ff1, h, rows);
  }
  TD_TRY(norm_linear(m, n, wi, h, ff, xn, rows, m->cfg.act, 0, NULL));
  return row_parallel(m, wo, ff, h, rows);
}

td_status td_model_encode(td_model *m, const td_encode_input *in, float *enc_out) {
  const td_model_config *c = &m->cfg;
  const dims *d = &m->d;
  td_backend *b = m->b;
  int B = in->n_seqs;
  if (B <= 0 || B > m->opts.max_enc_seqs)
    return td_err(TD_ERR_INVALID, "encode: %d sequences (1 to %d allowed)", B, m->opts.max_enc_seqs);
  if (!m->cross_pool) return td_err(TD_ERR_INVALID, "encode: no cross-attention pool set");
  bool whisper = c->family == TD_FAMILY_WHISPER;
  int E = 0, max_len = 0;
  for (int s = 0; s < B; s++) {
    int len = whisper ? m->max_src : in->lens[s];
    if (len <= 0 || len > m->max_src)
      return td_err(TD_ERR_INVALID, "encode: sequence %d has %d tokens (1 to %d allowed)", s, len, m->max_src);
    E += len;
    max_len = len > max_len ? len : max_len;
  }
  if (E > m->opts.max_enc_tokens)
    return td_err(TD_ERR_INVALID, "encode: %d tokens in one call, more than the %d configured", E,
                  m->opts.max_enc_tokens);
  if (whisper ? !in->features : !in->tokens) return td_err(TD_ERR_INVALID, "encode: no input");
  /* metadata: tokens | positions | cu_seqlens | cross slots */
  int32_t *hm = m->meta_host;
  int32_t *tok = hm, *pos = hm + E, *cu = hm + 2 * E, *slots = cu + B + 1;
  cu[0] = 0;
  for (int s = 0, k = 0; s < B; s++) {
    int len = whisper ? m->max_src : in->lens[s];
    cu[s + 1] = cu[s] + len;
    for (int t = 0; t < len; t++, k++) {
      if (!whisper) {
        int32_t id = in->tokens[k];
        if (id < 0 || id >= c->vocab_size)
          return td_err(TD_ERR_INVALID, "encode: token id %d at position %d of sequence %d is outside the vocabulary of %d",
                        id, t, s, c->vocab_size);
        tok[k] = id;
      }
      pos[k] = t;
    }
  }
  memcpy(slots, in->cross_slots, sizeof(int32_t) * (size_t)E);
  TD_TRY(publish_encode(m, in));
  size_t n_meta = (size_t)(3 * E + B + 1);
  TD_TRY(td_copy_h2d(b, m->meta_dev, hm, n_meta * sizeof(int32_t)));
  const int32_t *dtok = m->meta_dev, *dpos = m->meta_dev + E, *dcu = m->meta_dev + 2 * E,
                *dslots = m->meta_dev + 2 * E + B + 1;

  bool first = d->stage == 0, last = d->stage == d->stages - 1;
  if (!first) {
    TD_TRY(td_recv(b, m->e_h, TD_BUF_ACT, (size_t)E * d->d, d->stage - 1));
  } else if (whisper) {
    int F = 2 * m->max_src, mels = c->num_mel_bins;
    TD_TRY(td_upload(b, TD_BUF_ACT, m->w_feat, in->features, (size_t)B * mels * F));
    TD_TRY(td_im2col1d(b, m->w_feat, m->w_col1, B, mels, F, 3, 1, 1, true));
    TD_TRY(td_gemm(b, m->w_col1, m->conv1.w, m->conv1.b, m->w_c1, B * F, d->d, mels * 3, TD_ACT_GELU, 0));
    TD_TRY(td_im2col1d(b, m->w_c1, m->w_col2, B, d->d, F, 3, 2, 1, false));
    TD_TRY(td_gemm(b, m->w_col2, m->conv2.w, m->conv2.b, m->e_h, E, d->d, d->d * 3, TD_ACT_GELU, 0));
    TD_TRY(td_add_pos(b, m->e_h, m->enc_pos, B, m->max_src, d->d));
  } else {
    TD_TRY(td_embed(b, dtok, dpos, m->enc_tok, c->pos_kind == TD_POS_RELATIVE ? NULL : m->enc_pos, c->embed_scale,
                    m->e_h, E, d->d));
    if (c->layernorm_embedding) TD_TRY(norm(m, &m->enc_ln_emb, m->e_h, m->e_h, E));
  }
  td_relbias eb = {m->enc_lut, c->rel_max_distance};
  const td_relbias *bias = m->enc_lut ? &eb : NULL;
  for (int l = 0; l < d->e1 - d->e0; l++) {
    const enc_layer *L = &m->enc[l];
    TD_TRY(norm_linear(m, c->pre_norm ? &L->ln_attn : NULL, &L->qkv, m->e_h, m->e_qkv, m->e_x, E, TD_ACT_NONE, 0, NULL));
    TD_TRY(td_attn_dense(b, m->e_qkv, m->e_attn, dcu, B, E, max_len, d->eh, d->edh, c->enc_attn_scale, false, bias));
    TD_TRY(row_parallel(m, &L->o, m->e_attn, m->e_h, E));
    if (!c->pre_norm) TD_TRY(norm(m, &L->ln_attn, m->e_h, m->e_h, E));
    TD_TRY(ffn(m, c->pre_norm ? &L->ln_ffn : NULL, &L->wi, &L->wo, m->e_h, m->e_x, m->e_ff, m->e_ff1, E));
    if (!c->pre_norm) TD_TRY(norm(m, &L->ln_ffn, m->e_h, m->e_h, E));
  }
  /* pipeline: the last stage's output goes to every stage's cross KV */
  if (!last) TD_TRY(td_send(b, m->e_h, TD_BUF_ACT, (size_t)E * d->d, d->stage + 1));
  const void *eo = m->e_h;
  if (last && c->final_norm) {
    TD_TRY(norm(m, &m->enc_final, m->e_h, m->e_x, E));
    eo = m->e_x;
  }
  if (last)
    for (int st = 0; st < d->stages - 1; st++) TD_TRY(td_send(b, eo, TD_BUF_ACT, (size_t)E * d->d, st));
  else {
    TD_TRY(td_recv(b, m->e_x, TD_BUF_ACT, (size_t)E * d->d, d->stages - 1));
    eo = m->e_x;
  }
  td_kv_layout cl = td_model_cross_layout(m);
  int hd = d->dh_ * d->ddh;
  for (int l = 0; l < cl.n_layers; l++) {
    TD_TRY(linear(m, &m->dec[l].ckv, eo, m->e_qkv, E, TD_ACT_NONE, 0));
    TD_TRY(td_kv_write(b, m->e_qkv, (const char *)m->e_qkv + (size_t)hd * td_buf_elem_size(b, TD_BUF_ACT), 2 * hd,
                       m->cross_pool, &cl, l, dslots, E));
  }
  if (cl.states) /* the states once, split over the tail's K and V planes */
    TD_TRY(td_kv_write(b, eo, (const char *)eo + (size_t)(d->d / 2) * td_buf_elem_size(b, TD_BUF_ACT), d->d,
                       m->cross_pool, &cl, cl.n_layers, dslots, E));
  if (enc_out) TD_TRY(td_download(b, TD_BUF_ACT, eo, enc_out, (size_t)E * d->d));
  return td_sync(b);
}

/* Offsets of the step's metadata in the staging buffers; they depend only
 * on the row, sequence and logit counts, so a captured graph keeps them. */
typedef struct step_layout {
  size_t tok, pos, qs, ctx, slots, tab, clen, ctab, rows, total;
} step_layout;

static step_layout layout_for(const td_model *m, int T, int S, int NL) {
  step_layout L;
  size_t off = 0;
  L.tok = off, off += (size_t)T;
  L.pos = off, off += (size_t)T;
  L.qs = off, off += (size_t)S + 1;
  L.ctx = off, off += (size_t)S;
  L.slots = off, off += (size_t)T;
  L.tab = off, off += (size_t)S * m->self_stride;
  L.clen = off, off += (size_t)S;
  L.ctab = off, off += (size_t)S * m->cross_stride;
  L.rows = off, off += (size_t)(NL ? NL : 1);
  L.total = off;
  return L;
}

typedef struct step_bounds {
  int T, S, NL, max_q, max_ctx, max_cross;
  const int32_t *hq_start; /* host copy of q_start (pipeline micro-batches) */
} step_bounds;

static void *rows_at(const td_model *m, const void *p, int row, int width) {
  return (char *)p + (size_t)row * (size_t)width * td_buf_elem_size(m->b, TD_BUF_ACT);
}

/* This stage's decoder layers over query rows [t0, t1) of sequences
 * [s0, s1). Row offsets in the metadata stay absolute, so n_tokens, which
 * bounds them, is t1 (with t1 - t0 the GPU's attention would take a later
 * micro-batch's rows for padding). */
static td_status decoder_layers(td_model *m, const td_paged_meta *self_all, const td_paged_meta *cross_all,
                                const int32_t *dslots, int s0, int s1, int t0, int t1) {
  const td_model_config *c = &m->cfg;
  const dims *d = &m->d;
  td_backend *b = m->b;
  int T = t1 - t0, hd = d->dh_ * d->ddh;
  td_paged_meta self_m = *self_all, cross_m = *cross_all;
  self_m.n_seqs = cross_m.n_seqs = s1 - s0;
  self_m.n_tokens = cross_m.n_tokens = t1;
  self_m.q_start += s0;
  self_m.ctx_len += s0;
  self_m.block_table += (size_t)s0 * m->self_stride;
  cross_m.q_start += s0;
  cross_m.ctx_len += s0;
  cross_m.block_table += (size_t)s0 * m->cross_stride;
  void *h = rows_at(m, m->d_h, t0, d->d), *x = rows_at(m, m->d_x, t0, d->d);
  void *qkv = rows_at(m, m->d_qkv, t0, 3 * hd), *att = rows_at(m, m->d_attn, t0, hd), *q = rows_at(m, m->d_q, t0, hd);
  int g = c->gated_ffn ? 2 : 1;
  void *ff = rows_at(m, m->d_ff, t0, d->dff * g), *ff1 = rows_at(m, m->d_ff1, t0, c->gated_ffn ? d->dff : 0);
  td_relbias db = {m->dec_lut, c->rel_max_distance};
  const td_relbias *bias = m->dec_lut ? &db : NULL;
  td_kv_layout sl = td_model_self_layout(m), cl = td_model_cross_layout(m);
  /* decode: each layer's self K/V is requested into L2 beside the GEMMs
   * before its attention (td_kv_prefetch, a hint) */
  int nl = d->l1 - d->l0;
  bool pf = self_m.max_q == 1, states = T >= m->states_rows;
  if (pf) TD_TRY(td_kv_prefetch(b, m->self_pool, &sl, 0, &self_m));
  for (int l = 0; l < d->l1 - d->l0; l++) {
    const dec_layer *L = &m->dec[l];
    /* the projection also writes the new K/V rows into the self pool */
    td_gemm_args qa =
        norm_linear_args(m, c->pre_norm ? &L->ln_self : NULL, &L->qkv, h, qkv, x, T, TD_ACT_NONE, 0, NULL);
    qa.kv_pool = m->self_pool;
    qa.kv_layout = &sl;
    qa.kv_layer = l;
    qa.kv_col = hd;
    qa.kv_slots = dslots + t0;
    TD_TRY(td_gemm_ex(b, &qa));
    /* attention reads q rows at the metadata's absolute offsets */
    TD_TRY(td_attn_paged(b, m->d_qkv, 3 * hd, m->d_attn, m->self_pool, &sl, l, &self_m, c->dec_attn_scale, true,
                         bias));
    TD_TRY(row_parallel(m, &L->o, att, h, T));
    if (!c->pre_norm) TD_TRY(norm(m, &L->ln_self, h, h, T));
    /* a folded RMSNorm before the cross query commutes with its projection:
     * in decode steps beyond the rows where the backend's projection takes
     * it at no cost, the attention scales each query by 1 / rms(h) instead
     * of a norm running before the projection */
    td_paged_meta cm = cross_m;
    if (c->pre_norm && c->rmsnorm && L->ln_cross.folded && !L->cq.b && T > m->q_norm_rows && cross_m.max_q == 1) {
      TD_TRY(td_gemm(b, h, L->cq.w, NULL, q, T, L->cq.out, L->cq.in, TD_ACT_NONE, 0));
      cm.q_norm = m->d_h; /* rows at the metadata's absolute offsets, like q */
      cm.q_norm_dim = d->d;
      cm.q_norm_eps = c->norm_eps;
    } else {
      TD_TRY(norm_linear(m, c->pre_norm ? &L->ln_cross : NULL, &L->cq, h, q, x, T, TD_ACT_NONE, 0, NULL));
    }
    if (states) {
      /* q . k_j = (W_k,h^T q_h) . E_j, and W_v,h (sum_j p_j E_j) + b_v the
       * head's output (the K bias shifts a head's scores alike) */
      size_t es = td_buf_elem_size(b, TD_BUF_ACT);
      int wd = d->dh_ * d->d;
      const char *wk = L->ckv.w, *wv = wk + (size_t)hd * d->d * es;
      TD_TRY(td_gemm_heads(b, q, wk, NULL, rows_at(m, m->d_qs, t0, wd), T, d->dh_, d->d, d->ddh, false));
      TD_TRY(td_attn_states(b, m->d_qs, wd, m->d_us, m->cross_pool, &cl, d->dh_, &cm, c->dec_attn_scale));
      TD_TRY(td_gemm_heads(b, rows_at(m, m->d_us, t0, wd), wv, L->ckv.b ? L->ckv.b + hd : NULL, att, T, d->dh_,
                           d->ddh, d->d, true));
    } else {
      TD_TRY(td_attn_paged(b, m->d_q, hd, m->d_attn, m->cross_pool, &cl, l, &cm, c->dec_attn_scale, false, NULL));
    }
    TD_TRY(row_parallel(m, &L->co, att, h, T));
    if (!c->pre_norm) TD_TRY(norm(m, &L->ln_cross, h, h, T));
    TD_TRY(ffn(m, c->pre_norm ? &L->ln_ffn : NULL, &L->wi, &L->wo, h, x, ff, ff1, T));
    if (!c->pre_norm) TD_TRY(norm(m, &L->ln_ffn, h, h, T));
    if (pf && l + 1 < nl) TD_TRY(td_kv_prefetch(b, m->self_pool, &sl, l + 1, &self_m));
  }
  return TD_OK;
}

/* The decoder over staged metadata: it only enqueues work, so it can be
 * captured in a graph. With pipeline stages the step's sequences go
 * through in micro-batches, so that every stage has work. */
static td_status decoder_forward(td_model *m, const step_layout *ly, const step_bounds *sb) {
  const td_model_config *c = &m->cfg;
  const dims *d = &m->d;
  td_backend *b = m->b;
  int T = sb->T, NL = sb->NL, S = sb->S;
  const int32_t *D = m->meta_dev;
  const int32_t *dtok = D + ly->tok, *dpos = D + ly->pos, *dslots = D + ly->slots, *drows = D + ly->rows;
  td_paged_meta self_m = {.n_seqs = S, .n_tokens = T, .max_q = sb->max_q, .max_ctx = sb->max_ctx,
                          .q_start = D + ly->qs, .ctx_len = D + ly->ctx, .block_table = D + ly->tab,
                          .max_blocks = m->self_stride};
  self_m.kv_static_past = true; /* earlier steps wrote the keys before this step's queries */
  td_paged_meta cross_m = self_m;
  cross_m.max_ctx = sb->max_cross;
  cross_m.ctx_len = D + ly->clen;
  cross_m.block_table = D + ly->ctab;
  cross_m.max_blocks = m->cross_stride;
  cross_m.kv_static_past = false;
  cross_m.kv_static = true; /* the encoder wrote the cross KV before this step's metadata upload */
  bool first = d->stage == 0, last = d->stage == d->stages - 1;
  if (first) {
    TD_TRY(td_embed(b, dtok, dpos, m->dec_tok, c->pos_kind == TD_POS_RELATIVE ? NULL : m->dec_pos, c->embed_scale,
                    m->d_h, T, d->d));
    if (c->layernorm_embedding) TD_TRY(norm(m, &m->dec_ln_emb, m->d_h, m->d_h, T));
  }
  int M = d->stages > 1 ? (S < d->stages ? S : d->stages) : 1;
  for (int mb = 0; mb < M; mb++) {
    int s0 = S * mb / M, s1 = S * (mb + 1) / M;
    int t0 = M == 1 ? 0 : sb->hq_start[s0], t1 = M == 1 ? T : sb->hq_start[s1];
    void *h = rows_at(m, m->d_h, t0, d->d);
    if (!first) TD_TRY(td_recv(b, h, TD_BUF_ACT, (size_t)(t1 - t0) * d->d, d->stage - 1));
    TD_TRY(decoder_layers(m, &self_m, &cross_m, dslots, s0, s1, t0, t1));
    if (!last) TD_TRY(td_send(b, h, TD_BUF_ACT, (size_t)(t1 - t0) * d->d, d->stage + 1));
  }
  if (NL && last) {
    TD_TRY(td_gather_rows(b, m->d_h, drows, m->d_lx, NL, d->d));
    if (c->final_norm) TD_TRY(norm(m, &m->dec_final, m->d_lx, m->d_lx, NL));
    int per = d->v1 - d->v0;
    if (m->opts.tp_size == 1) {
      TD_TRY(td_gemm(b, m->d_lx, m->head, m->logits_bias, m->logits, NL, per, d->d, TD_ACT_NONE, TD_GEMM_OUT_F32));
    } else {
      /* each rank's vocabulary columns, gathered and put back in order */
      TD_TRY(td_gemm(b, m->d_lx, m->head, m->logits_bias, m->logits_part, NL, per, d->d, TD_ACT_NONE,
                     TD_GEMM_OUT_F32));
      TD_TRY(td_allgather(b, m->logits_part, m->logits_all, TD_BUF_F32, (size_t)NL * per));
      TD_TRY(td_unshard_cols(b, m->logits_all, m->logits, m->opts.tp_size, NL, per, d->vocab));
    }
  }
  /* the leader (stage 0) samples */
  if (NL && d->stages > 1) {
    if (last) TD_TRY(td_send(b, m->logits, TD_BUF_F32, (size_t)NL * d->vocab, 0));
    if (first) TD_TRY(td_recv(b, m->logits, TD_BUF_F32, (size_t)NL * d->vocab, d->stages - 1));
  }
  return TD_OK;
}

td_status td_model_step(td_model *m, const td_step_input *in, const float **logits) {
  const td_model_config *c = &m->cfg;
  td_backend *b = m->b;
  const td_model_opts *o = &m->opts;
  int S = in->n_seqs, T = in->n_tokens, NL = in->n_logits;
  if (S <= 0 || S > o->max_seqs || T < S || T > o->max_tokens || NL < 0 || NL > o->max_logits)
    return td_err(TD_ERR_INVALID, "step: %d sequences, %d tokens, %d logit rows (limits %d, %d, %d)", S, T, NL,
                  o->max_seqs, o->max_tokens, o->max_logits);
  if (!m->self_pool || !m->cross_pool) return td_err(TD_ERR_INVALID, "step: KV pools not set");
  if (in->block_stride <= 0 || in->block_stride > m->self_stride || in->cross_stride <= 0 ||
      in->cross_stride > m->cross_stride)
    return td_err(TD_ERR_INVALID, "step: block table widths %d and %d exceed %d and %d", in->block_stride,
                  in->cross_stride, m->self_stride, m->cross_stride);
  if (in->q_start[0] != 0 || in->q_start[S] != T) return td_err(TD_ERR_INVALID, "step: q_start must span 0..%d", T);
  int max_q = 0, max_ctx = 0, max_cross = 0, bs = o->block_size;
  for (int s = 0; s < S; s++) {
    int qn = in->q_start[s + 1] - in->q_start[s];
    if (qn <= 0 || in->ctx_len[s] < qn || in->ctx_len[s] > in->block_stride * bs || in->cross_len[s] < 0 ||
        in->cross_len[s] > in->cross_stride * bs)
      return td_err(TD_ERR_INVALID, "step: sequence %d has %d queries, %d keys, %d cross keys", s, qn,
                    in->ctx_len[s], in->cross_len[s]);
    max_q = qn > max_q ? qn : max_q;
    max_ctx = in->ctx_len[s] > max_ctx ? in->ctx_len[s] : max_ctx;
    max_cross = in->cross_len[s] > max_cross ? in->cross_len[s] : max_cross;
  }
  for (int t = 0; t < T; t++) {
    if (in->tokens[t] < 0 || in->tokens[t] >= c->vocab_size)
      return td_err(TD_ERR_INVALID, "step: token id %d is outside the vocabulary of %d", in->tokens[t], c->vocab_size);
    if (in->positions[t] < 0 || in->positions[t] >= m->max_tgt)
      return td_err(TD_ERR_INVALID, "step: position %d is outside the %d the decoder allows", in->positions[t],
                    m->max_tgt);
  }
  for (int i = 0; i < NL; i++)
    if (in->logit_rows[i] < 0 || in->logit_rows[i] >= T)
      return td_err(TD_ERR_INVALID, "step: logit row %d outside [0, %d)", in->logit_rows[i], T);
  TD_TRY(publish_step(m, in));
  /* A pure decode step (one row and one logit row per sequence) replays
   * the CUDA graph of the smallest batch bucket that holds it, padded with
   * rows that attend to nothing and write nothing. */
  bool decode_only = T == S && NL == S;
  for (int i = 0; decode_only && i < NL; i++) decode_only = in->logit_rows[i] == i;
  int B = S, gi = -1;
  for (int k = 0; decode_only && k < m->n_buckets && gi < 0; k++)
    if (m->buckets[k] >= S) gi = k;
  if (gi >= 0) B = m->buckets[gi];
  /* metadata, repacked at the model's fixed table widths */
  int32_t *hm = m->meta_host;
  step_layout L = layout_for(m, gi >= 0 ? B : T, gi >= 0 ? B : S, gi >= 0 ? B : NL);
  memcpy(hm + L.tok, in->tokens, sizeof(int32_t) * (size_t)T);
  memcpy(hm + L.pos, in->positions, sizeof(int32_t) * (size_t)T);
  memcpy(hm + L.qs, in->q_start, sizeof(int32_t) * (size_t)(S + 1));
  memcpy(hm + L.ctx, in->ctx_len, sizeof(int32_t) * (size_t)S);
  memcpy(hm + L.slots, in->slots, sizeof(int32_t) * (size_t)T);
  memcpy(hm + L.clen, in->cross_len, sizeof(int32_t) * (size_t)S);
  for (int s = 0; s < S; s++) {
    memcpy(hm + L.tab + (size_t)s * m->self_stride, in->block_table + (size_t)s * in->block_stride,
           sizeof(int32_t) * (size_t)in->block_stride);
    memcpy(hm + L.ctab + (size_t)s * m->cross_stride, in->cross_table + (size_t)s * in->cross_stride,
           sizeof(int32_t) * (size_t)in->cross_stride);
  }
  if (NL) memcpy(hm + L.rows, in->logit_rows, sizeof(int32_t) * (size_t)NL);
  for (int s = S; s < B; s++) { /* padding rows */
    hm[L.tok + s] = 0;
    hm[L.pos + s] = 0;
    hm[L.qs + s + 1] = s + 1;
    hm[L.ctx + s] = 0;
    hm[L.slots + s] = -1;
    hm[L.clen + s] = 0;
    memset(hm + L.tab + (size_t)s * m->self_stride, 0, sizeof(int32_t) * (size_t)m->self_stride);
    memset(hm + L.ctab + (size_t)s * m->cross_stride, 0, sizeof(int32_t) * (size_t)m->cross_stride);
    hm[L.rows + s] = s;
  }
  TD_TRY(td_copy_h2d(b, m->meta_dev, hm, L.total * sizeof(int32_t)));
  if (gi >= 0) {
    if (!m->graphs[gi]) {
      /* captured once per bucket, with bounds that hold for any step */
      step_bounds gb = {.T = B, .S = B, .NL = B, .max_q = 1, .max_ctx = m->self_stride * o->block_size,
                        .max_cross = m->cross_stride * o->block_size};
      TD_TRY(td_graph_begin(b));
      td_status cs = decoder_forward(m, &L, &gb);
      td_graph *g = NULL;
      td_status es = td_graph_end(b, &g);
      if (cs != TD_OK || es != TD_OK) {
        td_graph_destroy(b, g);
        return cs != TD_OK ? cs : es;
      }
      m->graphs[gi] = g;
    }
    TD_TRY(td_graph_launch(b, m->graphs[gi]));
  } else {
    step_bounds sb = {.T = T, .S = S, .NL = NL, .max_q = max_q, .max_ctx = max_ctx, .max_cross = max_cross,
                      .hq_start = in->q_start};
    TD_TRY(decoder_forward(m, &L, &sb));
  }
  *logits = m->logits;
  return TD_OK;
}

/* ---------------------------------------------------------------- mirror */

enum { MIRROR_ENCODE = 1, MIRROR_STEP = 2, MIRROR_COPY = 3, MIRROR_MAGIC = 0x54444d52 };

typedef struct mbuf {
  uint8_t *p;
  size_t n, cap;
  bool oom;
} mbuf;

static void put(mbuf *b, const void *src, size_t n) {
  if (b->oom) return;
  if (b->n + n > b->cap) {
    size_t nc = b->cap ? b->cap : 4096;
    while (nc < b->n + n) nc *= 2;
    uint8_t *q = realloc(b->p, nc);
    if (!q) {
      b->oom = true;
      return;
    }
    b->p = q;
    b->cap = nc;
  }
  if (n) memcpy(b->p + b->n, src, n);
  b->n += n;
}

static void put_i32(mbuf *b, int32_t v) { put(b, &v, 4); }
static void put_arr(mbuf *b, const int32_t *v, int n) {
  put_i32(b, n);
  if (n > 0) put(b, v, sizeof(int32_t) * (size_t)n);
}

typedef struct rbuf {
  const uint8_t *p;
  size_t n, off;
  bool bad;
} rbuf;

static int32_t get_i32(rbuf *r) {
  int32_t v = 0;
  if (r->off + 4 > r->n) {
    r->bad = true;
    return 0;
  }
  memcpy(&v, r->p + r->off, 4);
  r->off += 4;
  return v;
}

/* A view into the buffer: no copy, valid while bytes are. */
static const void *get_arr(rbuf *r, int elem, int *count) {
  int32_t n = get_i32(r);
  *count = n;
  if (n < 0 || r->off + (size_t)n * (size_t)elem > r->n) {
    r->bad = true;
    return NULL;
  }
  const void *v = r->p + r->off;
  r->off += (size_t)n * (size_t)elem;
  return v;
}

void td_model_set_mirror(td_model *m, const td_model_mirror *mirror) {
  if (mirror)
    m->mirror = *mirror;
  else
    memset(&m->mirror, 0, sizeof m->mirror);
}

static td_status publish_encode(td_model *m, const td_encode_input *in) {
  if (!m->mirror.publish) return TD_OK;
  mbuf b = {0};
  put_i32(&b, MIRROR_MAGIC);
  put_i32(&b, MIRROR_ENCODE);
  put_i32(&b, in->n_seqs);
  bool whisper = m->cfg.family == TD_FAMILY_WHISPER;
  int E = 0, tok = 0;
  for (int s = 0; s < in->n_seqs; s++) {
    E += whisper ? m->max_src : in->lens[s];
    tok += whisper ? 0 : in->lens[s];
  }
  put_arr(&b, in->lens, whisper ? 0 : in->n_seqs);
  put_arr(&b, in->tokens, whisper ? 0 : tok);
  int nf = whisper ? in->n_seqs * m->cfg.num_mel_bins * 2 * m->max_src : 0;
  put_i32(&b, nf);
  if (nf) put(&b, in->features, sizeof(float) * (size_t)nf);
  put_arr(&b, in->cross_slots, E);
  td_status s = b.oom ? td_err(TD_ERR_NOMEM, "mirror: out of memory") : m->mirror.publish(m->mirror.ctx, b.p, b.n);
  free(b.p);
  return s;
}

static td_status publish_step(td_model *m, const td_step_input *in) {
  if (!m->mirror.publish) return TD_OK;
  mbuf b = {0};
  int S = in->n_seqs, T = in->n_tokens;
  put_i32(&b, MIRROR_MAGIC);
  put_i32(&b, MIRROR_STEP);
  put_i32(&b, S);
  put_i32(&b, T);
  put_i32(&b, in->block_stride);
  put_i32(&b, in->cross_stride);
  put_arr(&b, in->tokens, T);
  put_arr(&b, in->positions, T);
  put_arr(&b, in->q_start, S + 1);
  put_arr(&b, in->ctx_len, S);
  put_arr(&b, in->slots, T);
  put_arr(&b, in->block_table, S * in->block_stride);
  put_arr(&b, in->cross_len, S);
  put_arr(&b, in->cross_table, S * in->cross_stride);
  put_arr(&b, in->logit_rows, in->n_logits);
  td_status s = b.oom ? td_err(TD_ERR_NOMEM, "mirror: out of memory") : m->mirror.publish(m->mirror.ctx, b.p, b.n);
  free(b.p);
  return s;
}

static td_status replay_aligned(td_model *m, const void *bytes, size_t len);

td_status td_model_copy_self_blocks(td_model *m, const int32_t *pairs, int n_pairs) {
  if (!m->self_pool) return td_err(TD_ERR_INVALID, "copy: no self-attention pool set");
  if (m->mirror.publish) {
    mbuf b = {0};
    put_i32(&b, MIRROR_MAGIC);
    put_i32(&b, MIRROR_COPY);
    put_arr(&b, pairs, 2 * n_pairs);
    td_status s = b.oom ? td_err(TD_ERR_NOMEM, "mirror: out of memory") : m->mirror.publish(m->mirror.ctx, b.p, b.n);
    free(b.p);
    TD_TRY(s);
  }
  td_kv_layout sl = td_model_self_layout(m);
  return td_kv_copy_blocks(m->b, m->self_pool, &sl, pairs, n_pairs);
}

td_status td_model_replay(td_model *m, const void *bytes, size_t len) {
  if (!((uintptr_t)bytes & 3)) return replay_aligned(m, bytes, len);
  /* the arrays are read in place: give them their alignment */
  void *copy = malloc(len ? len : 1);
  if (!copy) return td_err(TD_ERR_NOMEM, "out of memory");
  memcpy(copy, bytes, len);
  td_status s = replay_aligned(m, copy, len);
  free(copy);
  return s;
}

static td_status replay_aligned(td_model *m, const void *bytes, size_t len) {
  rbuf r = {bytes, len, 0, false};
  if (get_i32(&r) != MIRROR_MAGIC) return td_err(TD_ERR_FORMAT, "mirror: not a model call");
  int kind = get_i32(&r);
  int n;
  if (kind == MIRROR_ENCODE) {
    td_encode_input in = {0};
    in.n_seqs = get_i32(&r);
    in.lens = get_arr(&r, 4, &n);
    in.tokens = get_arr(&r, 4, &n);
    int nf = get_i32(&r);
    if (nf < 0 || r.off + (size_t)nf * 4 > r.n) return td_err(TD_ERR_FORMAT, "mirror: truncated encode");
    in.features = nf ? (const float *)(r.p + r.off) : NULL;
    r.off += (size_t)nf * 4;
    in.cross_slots = get_arr(&r, 4, &n);
    if (r.bad) return td_err(TD_ERR_FORMAT, "mirror: truncated encode");
    return td_model_encode(m, &in, NULL);
  }
  if (kind == MIRROR_COPY) {
    const int32_t *pairs = get_arr(&r, 4, &n);
    if (r.bad || n % 2) return td_err(TD_ERR_FORMAT, "mirror: truncated copy");
    td_kv_layout sl = td_model_self_layout(m);
    TD_TRY(td_kv_copy_blocks(m->b, m->self_pool, &sl, pairs, n / 2));
    return td_sync(m->b);
  }
  if (kind != MIRROR_STEP) return td_err(TD_ERR_FORMAT, "mirror: unknown call %d", kind);
  td_step_input in = {0};
  in.n_seqs = get_i32(&r);
  in.n_tokens = get_i32(&r);
  in.block_stride = get_i32(&r);
  in.cross_stride = get_i32(&r);
  in.tokens = get_arr(&r, 4, &n);
  in.positions = get_arr(&r, 4, &n);
  in.q_start = get_arr(&r, 4, &n);
  in.ctx_len = get_arr(&r, 4, &n);
  in.slots = get_arr(&r, 4, &n);
  in.block_table = get_arr(&r, 4, &n);
  in.cross_len = get_arr(&r, 4, &n);
  in.cross_table = get_arr(&r, 4, &n);
  in.logit_rows = get_arr(&r, 4, &in.n_logits);
  if (r.bad) return td_err(TD_ERR_FORMAT, "mirror: truncated step");
  const float *lg;
  TD_TRY(td_model_step(m, &in, &lg));
  return td_sync(m->b);
}
