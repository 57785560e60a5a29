/* The BART family (BART, mBART, Marian, Whisper): its checkpoint layout
 * (biased projections, pre- or post-norm LayerNorms, pre-norms folded into
 * the decoder's linear layers), learned or sinusoidal positions, and
 * Whisper's convolution weights. The graph itself is forward.c's, shared by
 * all families. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "model/internal.h"

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
  if (ld->c->k_bias && !ld_find(ld, bk, true)) return TD_ERR_FORMAT;
  if (!ld_find(ld, bq, true) || !ld_find(ld, bv, true) || !ld_find(ld, bo, true)) return TD_ERR_FORMAT;
  if (with_qkv) {
    const char *names[3] = {nq, nk, nv}, *bnames[3] = {bq, bk, bv};
    int rows[3] = {hdim, hdim, hdim};
    TD_TRY(ld_lin(ld, 3, names, bnames, rows, d, SPLIT_ROWS, qkv));
  } else {
    TD_TRY(ld_lin1(ld, nq, bq, hdim, d, SPLIT_ROWS, q));
    const char *names[2] = {nk, nv}, *bnames[2] = {bk, bv};
    int rows[2] = {hdim, hdim};
    TD_TRY(ld_lin(ld, 2, names, bnames, rows, d, SPLIT_ROWS, kv));
  }
  return ld_lin1(ld, no, bo, d, hdim, SPLIT_COLS, o);
}

static td_status load_ffn_bart(loader *ld, const char *pre, int ff, lin *wi, lin *wo) {
  int d = ld->c->d_model;
  char w1[256], b1[256], w2[256], b2[256];
  snprintf(w1, sizeof w1, "%s.fc1.weight", pre);
  snprintf(b1, sizeof b1, "%s.fc1.bias", pre);
  snprintf(w2, sizeof w2, "%s.fc2.weight", pre);
  snprintf(b2, sizeof b2, "%s.fc2.bias", pre);
  if (!ld_find(ld, b1, true) || !ld_find(ld, b2, true)) return TD_ERR_FORMAT;
  TD_TRY(ld_lin1(ld, w1, b1, ff, d, SPLIT_ROWS, wi));
  return ld_lin1(ld, w2, b2, d, ff, SPLIT_COLS, wo);
}

static td_status load_bart_decoder(td_model *m, loader *ld, const char *P, float *fw, float *fb) {
  const td_model_config *c = &m->cfg;
  char pre[256], name[256];
  for (int i = m->d.l0; i < m->d.l1; i++) {
    dec_layer *L = &m->dec[i - m->d.l0];
    /* each norm is loaded (and with fw folded) before the layer it feeds */
    snprintf(name, sizeof name, "%sdecoder.layers.%d.self_attn_layer_norm", P, i);
    TD_TRY(ld_norm_fold(ld, name, c->d_model, &L->ln_self, fw, fb));
    snprintf(pre, sizeof pre, "%sdecoder.layers.%d.self_attn", P, i);
    TD_TRY(load_attn_bart(ld, pre, c->dec_heads, c->dec_head_dim, true, &L->qkv, NULL, NULL, &L->o));
    snprintf(name, sizeof name, "%sdecoder.layers.%d.encoder_attn_layer_norm", P, i);
    TD_TRY(ld_norm_fold(ld, name, c->d_model, &L->ln_cross, fw, fb));
    snprintf(pre, sizeof pre, "%sdecoder.layers.%d.encoder_attn", P, i);
    TD_TRY(load_attn_bart(ld, pre, c->dec_heads, c->dec_head_dim, false, NULL, &L->cq, &L->ckv, &L->co));
    snprintf(name, sizeof name, "%sdecoder.layers.%d.final_layer_norm", P, i);
    TD_TRY(ld_norm_fold(ld, name, c->d_model, &L->ln_ffn, fw, fb));
    snprintf(pre, sizeof pre, "%sdecoder.layers.%d", P, i);
    TD_TRY(load_ffn_bart(ld, pre, c->dec_ffn, &L->wi, &L->wo));
  }
  return TD_OK;
}

td_status bart_load(td_model *m, loader *ld, const char *P) {
  const td_model_config *c = &m->cfg;
  char pre[256], name[256];
  loader_encoder_begin(m, ld);
  for (int i = m->d.e0; i < m->d.e1; i++) {
    enc_layer *L = &m->enc[i - m->d.e0];
    snprintf(pre, sizeof pre, "%sencoder.layers.%d.self_attn", P, i);
    TD_TRY(load_attn_bart(ld, pre, c->enc_heads, c->enc_head_dim, true, &L->qkv, NULL, NULL, &L->o));
    snprintf(name, sizeof name, "%sencoder.layers.%d.self_attn_layer_norm", P, i);
    TD_TRY(ld_norm(ld, name, c->d_model, &L->ln_attn));
    snprintf(pre, sizeof pre, "%sencoder.layers.%d", P, i);
    TD_TRY(load_ffn_bart(ld, pre, c->enc_ffn, &L->wi, &L->wo));
    snprintf(name, sizeof name, "%sencoder.layers.%d.final_layer_norm", P, i);
    TD_TRY(ld_norm(ld, name, c->d_model, &L->ln_ffn));
  }
  loader_encoder_end(m, ld);
  /* Pre-norm LayerNorms of the decoder go into the linear layers they
   * feed, as T5's RMSNorms do (t5_load); norm_fold TD_OFF keeps them
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
    TD_TRY(ld_norm(ld, name, c->d_model, &m->enc_ln_emb));
    snprintf(name, sizeof name, "%sdecoder.layernorm_embedding", P);
    TD_TRY(ld_norm(ld, name, c->d_model, &m->dec_ln_emb));
  }
  if (c->final_norm) {
    snprintf(name, sizeof name, "%sencoder.layer_norm", P);
    TD_TRY(ld_norm(ld, name, c->d_model, &m->enc_final));
    snprintf(name, sizeof name, "%sdecoder.layer_norm", P);
    TD_TRY(ld_norm(ld, name, c->d_model, &m->dec_final));
  }
  int d = c->d_model;
  if (c->family == TD_FAMILY_WHISPER) {
    int mels = c->num_mel_bins;
    int64_t s1[3] = {d, mels, 3}, s2[3] = {d, d, 3}, sb[1] = {d};
    snprintf(name, sizeof name, "%sencoder.conv1.weight", P);
    TD_TRY(ld_read_f32(ld, name, 3, s1));
    TD_TRY(ld_upload(ld, TD_BUF_ACT, ld->tmp, (size_t)d * mels * 3, &m->conv1.w));
    snprintf(name, sizeof name, "%sencoder.conv2.weight", P);
    TD_TRY(ld_read_f32(ld, name, 3, s2));
    TD_TRY(ld_upload(ld, TD_BUF_ACT, ld->tmp, (size_t)d * d * 3, &m->conv2.w));
    snprintf(name, sizeof name, "%sencoder.conv1.bias", P);
    TD_TRY(ld_read_f32(ld, name, 1, sb));
    TD_TRY(ld_upload(ld, TD_BUF_F32, ld->tmp, (size_t)d, (void **)&m->conv1.b));
    snprintf(name, sizeof name, "%sencoder.conv2.bias", P);
    TD_TRY(ld_read_f32(ld, name, 1, sb));
    TD_TRY(ld_upload(ld, TD_BUF_F32, ld->tmp, (size_t)d, (void **)&m->conv2.b));
    snprintf(name, sizeof name, "%sencoder.embed_positions.weight", P);
    TD_TRY(ld_table(ld, name, c->max_source_len, d, 0, &m->enc_pos_mem));
    snprintf(name, sizeof name, "%sdecoder.embed_positions.weight", P);
    TD_TRY(ld_table(ld, name, c->max_target_len, d, 0, &m->dec_pos_mem));
  } else if (c->pos_kind == TD_POS_LEARNED) {
    int rows = c->max_source_len + c->pos_offset;
    snprintf(name, sizeof name, "%sencoder.embed_positions.weight", P);
    TD_TRY(ld_table(ld, name, rows, d, c->pos_offset, &m->enc_pos_mem));
    snprintf(name, sizeof name, "%sdecoder.embed_positions.weight", P);
    TD_TRY(ld_table(ld, name, rows, d, c->pos_offset, &m->dec_pos_mem));
  } else { /* sinusoidal: the stored table when present, else built as transformers does */
    for (int e = 0; e < 2; e++) {
      snprintf(name, sizeof name, "%s%s.embed_positions.weight", P, e ? "decoder" : "encoder");
      void **dst = e ? &m->dec_pos_mem : &m->enc_pos_mem;
      int rows = e ? c->max_target_len : c->max_source_len;
      if (ld_find(ld, name, false)) {
        TD_TRY(ld_table(ld, name, rows, d, 0, dst));
      } else {
        TD_TRY(ld_fit(&ld->tmp, &ld->cap, (size_t)rows * d));
        sinusoidal(ld->tmp, rows, d);
        TD_TRY(ld_upload(ld, TD_BUF_ACT, ld->tmp, (size_t)rows * d, dst));
      }
    }
  }
  m->enc_pos = m->enc_pos_mem;
  m->dec_pos = m->dec_pos_mem;
  return TD_OK;
}
