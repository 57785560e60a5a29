/* T5 / Flan-T5 / mT5: their checkpoint layout (gated or plain FFN, RMSNorms
 * folded into the decoder's linear layers) and the relative-position bias
 * tables the attention adds. The graph itself is forward.c's, shared by all
 * families. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "model/internal.h"

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
  TD_TRY(ld_read_f32(ld, name, 2, shape));
  int md = c->rel_max_distance, w = 2 * md + 1;
  float *lut = malloc(sizeof *lut * (size_t)w * nh);
  if (!lut) return td_err(TD_ERR_NOMEM, "out of memory");
  for (int rel = -md; rel <= md; rel++) {
    int bk = t5_bucket(rel, bidirectional, c->rel_buckets, md);
    for (int h = 0; h < nh; h++) lut[(size_t)h * w + rel + md] = ld->tmp[(size_t)bk * h_total + h0 + h];
  }
  td_status s = ld_upload(ld, TD_BUF_F32, lut, (size_t)w * nh, (void **)out);
  free(lut);
  return s;
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
    TD_TRY(ld_lin(ld, 2, names, NULL, rows, c->d_model, SPLIT_ROWS, wi));
  } else {
    snprintf(n0, sizeof n0, "%s.DenseReluDense.wi.weight", pre);
    TD_TRY(ld_lin1(ld, n0, NULL, ff, c->d_model, SPLIT_ROWS, wi));
  }
  return ld_lin1(ld, no, NULL, c->d_model, ff, SPLIT_COLS, wo);
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
    TD_TRY(ld_lin(ld, 3, names, NULL, rows, d, SPLIT_ROWS, qkv));
  } else {
    TD_TRY(ld_lin1(ld, nq, NULL, hdim, d, SPLIT_ROWS, q));
    const char *names[2] = {nk, nv};
    int rows[2] = {hdim, hdim};
    TD_TRY(ld_lin(ld, 2, names, NULL, rows, d, SPLIT_ROWS, kv));
  }
  return ld_lin1(ld, no, NULL, d, hdim, SPLIT_COLS, o);
}

td_status t5_load(td_model *m, loader *ld) {
  const td_model_config *c = &m->cfg;
  char pre[256], name[256];
  loader_encoder_begin(m, ld);
  for (int i = m->d.e0; i < m->d.e1; i++) {
    enc_layer *L = &m->enc[i - m->d.e0];
    snprintf(pre, sizeof pre, "encoder.block.%d.layer.0.SelfAttention", i);
    TD_TRY(load_attn_t5(ld, pre, c->enc_heads, c->enc_head_dim, true, &L->qkv, NULL, NULL, &L->o));
    snprintf(name, sizeof name, "encoder.block.%d.layer.0.layer_norm", i);
    TD_TRY(ld_norm(ld, name, c->d_model, &L->ln_attn));
    snprintf(pre, sizeof pre, "encoder.block.%d.layer.1", i);
    TD_TRY(load_ffn_t5(ld, pre, c->enc_ffn, &L->wi, &L->wo));
    snprintf(name, sizeof name, "encoder.block.%d.layer.1.layer_norm", i);
    TD_TRY(ld_norm(ld, name, c->d_model, &L->ln_ffn));
  }
  /* the encoder's relative bias: its heads, as its layers */
  TD_TRY(load_relbias(ld, "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", true, c->enc_heads,
                      ld->rank * (c->enc_heads / ld->tp), c->enc_heads / ld->tp, &m->enc_lut));
  loader_encoder_end(m, ld);
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
      st = ld_norm_fold(ld, name, c->d_model, ln[j], fw, NULL);
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
  TD_TRY(ld_norm(ld, "encoder.final_layer_norm", c->d_model, &m->enc_final));
  TD_TRY(ld_norm(ld, "decoder.final_layer_norm", c->d_model, &m->dec_final));
  int tp = ld->tp;
  TD_TRY(load_relbias(ld, "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", false,
                      c->dec_heads, ld->rank * (c->dec_heads / tp), c->dec_heads / tp, &m->dec_lut));
  return TD_OK;
}

