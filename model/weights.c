/* The loader: checkpoint tensors into backend buffers, each rank's
 * tensor-parallel slice, pre-norms folded into the layer they feed; the
 * token tables and the output head, which every family shares. The
 * families' layer layouts are in t5.c and bart.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/half.h"
#include "model/internal.h"

td_status ld_fit(float **buf, size_t *cap, size_t n) {
  if (n <= *cap) return TD_OK;
  float *p = realloc(*buf, n * sizeof *p);
  if (!p) return td_err(TD_ERR_NOMEM, "cannot allocate %zu floats for weight conversion", n);
  *buf = p;
  *cap = n;
  return TD_OK;
}

const td_tensor_info *ld_find(loader *ld, const char *name, bool required) {
  const td_tensor_info *t = td_checkpoint_find(ld->ck, name);
  if (!t && required) td_err(TD_ERR_FORMAT, "%s: tensor \"%s\" is missing from the checkpoint", ld->dir, name);
  return t;
}

/* Reads a tensor into ld->tmp after checking its shape. */
td_status ld_read_f32(loader *ld, const char *name, int ndim, const int64_t *shape) {
  const td_tensor_info *t = ld_find(ld, name, true);
  if (!t) return TD_ERR_FORMAT;
  TD_TRY(ld_fit(&ld->tmp, &ld->cap, (size_t)t->numel));
  return td_tensor_read_f32(t, ndim, shape, ld->tmp);
}

td_status ld_upload(loader *ld, td_buf_type type, const float *src, size_t n, void **out) {
  TD_TRY(td_alloc(ld->b, type, n, out));
  return td_upload(ld->b, type, *out, src, n);
}

static td_status ld_vec(loader *ld, const char *name, int n, bool required, float **out) {
  *out = NULL;
  if (!required && !ld_find(ld, name, false)) return TD_OK;
  int64_t shape[1] = {n};
  TD_TRY(ld_read_f32(ld, name, 1, shape));
  return ld_upload(ld, TD_BUF_F32, ld->tmp, (size_t)n, (void **)out);
}

td_status ld_norm(loader *ld, const char *prefix, int n, norm_w *out) {
  char name[256];
  snprintf(name, sizeof name, "%s.weight", prefix);
  TD_TRY(ld_vec(ld, name, n, true, &out->w));
  out->b = NULL;
  if (!ld->c->rmsnorm) {
    snprintf(name, sizeof name, "%s.bias", prefix);
    TD_TRY(ld_vec(ld, name, n, true, &out->b));
  }
  return TD_OK;
}

/* A decoder pre-norm right before a linear layer: loaded, and with fw
 * (scratch for its weight) folded into that layer, the next ld_lin:
 * RMSNorm(x) W^T = (x / rms(x)) (W diag(g))^T; a LayerNorm's bias too (fb:
 * scratch for it), LayerNorm(x) W^T + b = x_hat (W diag(g))^T + (b + W
 * beta), x_hat the plainly normalised x. */
td_status ld_norm_fold(loader *ld, const char *prefix, int n, norm_w *out, float *fw, float *fb) {
  TD_TRY(ld_norm(ld, prefix, n, out));
  if (!fw) return TD_OK;
  char name[256];
  int64_t shape[1] = {n};
  snprintf(name, sizeof name, "%s.weight", prefix);
  TD_TRY(ld_read_f32(ld, name, 1, shape));
  memcpy(fw, ld->tmp, sizeof(float) * (size_t)n);
  if (fb) {
    snprintf(name, sizeof name, "%s.bias", prefix);
    TD_TRY(ld_read_f32(ld, name, 1, shape));
    memcpy(fb, ld->tmp, sizeof(float) * (size_t)n);
  }
  out->folded = true;
  ld->fold = fw;
  ld->fold_b = fb;
  return TD_OK;
}


/* A linear layer whose weight is the row-concatenation of parts
 * (e.g. q, k, v), each [rows, in] in the file. With tensor parallelism,
 * SPLIT_ROWS keeps this rank's share of each part's rows (column-parallel),
 * SPLIT_COLS this rank's share of the input columns (row-parallel; the bias
 * then lives on rank 0 only). bias names may be NULL (no bias) and absent
 * optional biases read as zeros. */
td_status ld_lin(loader *ld, int n_parts, const char *const *wnames, const char *const *bnames, const int *rows,
                 int in, split sp, lin *out) {
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
  TD_TRY(ld_fit(&ld->tmp2, &ld->cap2, (size_t)out_rows * in_local + 2 * (size_t)out_rows));
  float *w = ld->tmp2, *bias = ld->tmp2 + (size_t)out_rows * in_local, *fb = bias + out_rows;
  bool any_bias = false;
  int row = 0;
  for (int i = 0; i < n_parts; i++) {
    int64_t shape[2] = {rows[i], in};
    TD_TRY(ld_read_f32(ld, wnames[i], 2, shape));
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
    const td_tensor_info *bt = bnames && bnames[i] ? ld_find(ld, bnames[i], false) : NULL;
    if (bt && !(sp == SPLIT_COLS && r != 0)) {
      int64_t bshape[1] = {rows[i]};
      TD_TRY(ld_read_f32(ld, bnames[i], 1, bshape));
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
    TD_TRY(ld_upload(ld, TD_BUF_F32, fb, (size_t)out_rows, (void **)&out->wsum));
  }
  TD_TRY(ld_upload(ld, TD_BUF_ACT, w, (size_t)out_rows * in_local, &out->w));
  if (any_bias) TD_TRY(ld_upload(ld, TD_BUF_F32, bias, (size_t)out_rows, (void **)&out->b));
  return TD_OK;
}

void loader_encoder_begin(const td_model *m, loader *ld) {
  if (m->opts.tp_size > 1 && m->opts.enc_rows) ld->rank = 0, ld->tp = 1;
}

void loader_encoder_end(const td_model *m, loader *ld) {
  ld->rank = m->opts.tp_rank;
  ld->tp = m->opts.tp_size;
}

/* One-part shorthand. */
td_status ld_lin1(loader *ld, const char *wname, const char *bname, int rows, int in, split sp, lin *out) {
  const char *w[1] = {wname}, *bn[1] = {bname};
  int r[1] = {rows};
  return ld_lin(ld, 1, w, bname ? bn : NULL, r, in, sp, out);
}

/* A [rows, d] table uploaded whole (embeddings, positions). */
td_status ld_table(loader *ld, const char *name, int rows, int d, int skip_rows, void **out) {
  int64_t shape[2] = {rows, d};
  TD_TRY(ld_read_f32(ld, name, 2, shape));
  return ld_upload(ld, TD_BUF_ACT, ld->tmp + (size_t)skip_rows * d, (size_t)(rows - skip_rows) * d, out);
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
  const char *enc_src = ld_find(ld, enc, false) ? enc : shared;
  const char *dec_src = ld_find(ld, dec, false) ? dec : shared;
  if (c->family != TD_FAMILY_WHISPER) {
    if (!ld_find(ld, enc_src, true)) return TD_ERR_FORMAT;
    TD_TRY(ld_table(ld, enc_src, V, d, 0, &m->enc_tok));
  }
  if (!ld_find(ld, dec_src, true)) return TD_ERR_FORMAT;
  if (c->family != TD_FAMILY_WHISPER && !strcmp(enc_src, dec_src))
    m->dec_tok = m->enc_tok;
  else
    TD_TRY(ld_table(ld, dec_src, V, d, 0, &m->dec_tok));
  /* The head: its own tensor when stored, else tied to the decoder table.
   * With tensor parallelism each rank holds a slice of the vocabulary. */
  const char *head_src = ld_find(ld, head, false) ? head : NULL;
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
    TD_TRY(ld_read_f32(ld, head_src, 2, shape));
    TD_TRY(ld_fit(&ld->tmp2, &ld->cap2, (size_t)per * d));
    memset(ld->tmp2, 0, sizeof(float) * (size_t)per * d);
    memcpy(ld->tmp2, ld->tmp + (size_t)m->d.v0 * d, sizeof(float) * (size_t)real * d);
    TD_TRY(ld_upload(ld, TD_BUF_ACT, ld->tmp2, (size_t)per * d, &m->head));
  }
  /* final_logits_bias (BART family), zeros otherwise. */
  const char *fb = "final_logits_bias";
  float *bias = malloc(sizeof(float) * (size_t)per);
  if (!bias) return td_err(TD_ERR_NOMEM, "out of memory");
  for (int i = 0; i < per; i++) bias[i] = i < real ? 0.0f : -1e30f;
  td_status s = TD_OK;
  if (ld_find(ld, fb, false)) {
    int64_t shape[2] = {1, V};
    s = ld_read_f32(ld, fb, 2, shape);
    if (s == TD_OK) memcpy(bias, ld->tmp + m->d.v0, sizeof(float) * (size_t)real);
  }
  if (s == TD_OK) s = ld_upload(ld, TD_BUF_F32, bias, (size_t)per, (void **)&m->logits_bias);
  free(bias);
  return s;
}

td_status weights_load(td_model *m, const char *dir) {
  const td_model_config *c = &m->cfg;
  td_backend *b = m->b;
  loader ld = {.b = b, .dir = dir, .c = c, .rank = m->opts.tp_rank, .tp = m->opts.tp_size};
  td_status s = td_checkpoint_open(dir, &ld.ck);
  if (s != TD_OK) return s;
  const char *P = "";
  if (c->family != TD_FAMILY_T5 && td_checkpoint_find(ld.ck, "model.encoder.layers.0.self_attn.q_proj.weight"))
    P = "model.";
  s = c->family == TD_FAMILY_T5 ? t5_load(m, &ld) : bart_load(m, &ld, P);
  if (s == TD_OK) s = load_embeddings(m, &ld, P);
  if (s == TD_OK && c->scale_decoder_outputs) {
    /* Fold T5's d_model^-0.5 output scaling into the final norm weight. */
    int64_t shape[1] = {c->d_model};
    s = ld_read_f32(&ld, "decoder.final_layer_norm.weight", 1, shape);
    if (s == TD_OK) {
      float sc = 1.0f / sqrtf((float)c->d_model);
      for (int i = 0; i < c->d_model; i++) ld.tmp[i] *= sc;
      s = td_upload(b, TD_BUF_F32, m->dec_final.w, ld.tmp, (size_t)c->d_model);
    }
  }
  td_checkpoint_close(ld.ck);
  free(ld.tmp);
  free(ld.tmp2);
  return s;
}
