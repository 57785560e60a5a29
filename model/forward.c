/* The forward graph, one for every family (config flags choose pre- or
 * post-norm, RMSNorm or LayerNorm, relative or absolute positions, gated
 * FFN): td_model_encode (encoder, then every decoder layer's cross K/V into
 * the cross pool) and td_model_step (decoder rows over the paged pools,
 * CUDA graphs by batch bucket, pipeline micro-batches, sharded logits). */
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "model/internal.h"

static void *rows_at(const td_model *m, const void *p, int row, int width);

static td_status norm(td_model *m, const norm_w *n, const void *x, void *y, int rows) {
  return td_norm(m->b, x, n->w, n->b, y, rows, m->d.d, m->cfg.norm_eps, m->cfg.rmsnorm);
}

static td_status linear(td_model *m, const lin *l, const void *x, void *y, int rows, td_act act, unsigned flags) {
  return td_gemm(m->b, x, l->w, l->b, y, rows, l->out, l->in, act, flags);
}

/* h += x W^T for a row-parallel layer: every rank adds its partial sum and
 * rank 0 the residual and bias, then an all-reduce; whole: W is not split
 * (an encoder split by rows), a plain accumulate. */
static td_status row_parallel(td_model *m, const lin *l, const void *x, void *h, int rows, bool whole) {
  bool tp = m->opts.tp_size > 1 && !whole;
  if (tp) /* one kernel where the backend can */
    return td_gemm_allreduce(m->b, x, l->w, l->b, h, rows, l->out, l->in, m->opts.tp_rank == 0 ? TD_GEMM_ACCUM : 0);
  return linear(m, l, x, h, rows, TD_ACT_NONE, TD_GEMM_ACCUM);
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
                     void *ff1, int rows, bool whole) {
  if (m->cfg.gated_ffn) {
    TD_TRY(norm_linear(m, n, wi, h, ff1, xn, rows, m->cfg.act, TD_GEMM_GLU, ff));
    return row_parallel(m, wo, ff1, h, rows, whole);
  }
  TD_TRY(norm_linear(m, n, wi, h, ff, xn, rows, m->cfg.act, 0, NULL));
  return row_parallel(m, wo, ff, h, rows, whole);
}

/* Two running sets: the receive of the set launched last, when no launch
 * posted it yet (at most one set is in that state). */
static td_status post_pending(td_model *m) {
  for (int k = 0; k < 2; k++)
    if (m->set_out[k] && !m->set_posted[k]) {
      TD_TRY(td_recv(m->b, k ? m->logits1 : m->logits, TD_BUF_F32, (size_t)m->set_rows[k] * m->d.vocab,
                     m->d.stages - 1));
      m->set_posted[k] = true;
    }
  return TD_OK;
}

/* The encoder layers of a tensor-parallel rank that holds the whole
 * encoder and runs its rows (td_model_opts.enc_rows): everything on its
 * own rows, but attention's keys and values, which are all-gathered each
 * layer; then the layers' output rows all-gathered, so that every rank
 * goes on as after the head split. qkv rows stay at their own index (the
 * attention's queries of other rows are never read). */
static td_status encoder_layers_rows(td_model *m, void *eh, int E, const int32_t *kcu, int B, int maxk,
                                     const td_relbias *bias) {
  const td_model_config *c = &m->cfg;
  const dims *d = &m->d;
  td_backend *b = m->b;
  td_row_split me = td_rows_split(E, m->opts.tp_size, m->opts.tp_rank);
  int n = me.hi - me.lo, hd = d->eh * d->edh;
  void *h = rows_at(m, eh, me.lo, d->d), *xn = rows_at(m, m->e_x, me.lo, d->d);
  void *qkv = rows_at(m, m->e_qkv, me.lo, 3 * hd), *att = rows_at(m, m->e_attn, me.lo, hd);
  for (int l = 0; l < d->e1 - d->e0; l++) {
    const enc_layer *L = &m->enc[l];
    if (n) TD_TRY(norm_linear(m, c->pre_norm ? &L->ln_attn : NULL, &L->qkv, h, qkv, xn, n, TD_ACT_NONE, 0, NULL));
    TD_TRY(td_allgather_rows(b, m->e_qkv, TD_BUF_ACT, E, 3 * hd, hd, 2 * hd));
    TD_TRY(td_attn_dense_rows(b, m->e_qkv, m->e_attn, kcu, B, E, maxk, d->eh, d->edh, c->enc_attn_scale, false, bias,
                              me.lo, me.hi));
    if (!n) continue;
    TD_TRY(row_parallel(m, &L->o, att, h, n, true));
    if (!c->pre_norm) TD_TRY(norm(m, &L->ln_attn, h, h, n));
    TD_TRY(ffn(m, c->pre_norm ? &L->ln_ffn : NULL, &L->wi, &L->wo, h, xn, m->e_ff, m->e_ff1, n, true));
    if (!c->pre_norm) TD_TRY(norm(m, &L->ln_ffn, h, h, n));
  }
  return td_allgather_rows(b, eh, TD_BUF_ACT, E, d->d, 0, d->d);
}

/* Every decoder layer's cross K/V of E rows of x (the encoder's output or
 * the states) into the cross pool at slots. Where the weights are one
 * matrix (m->ckv_w), as many layers as e_ff holds at E rows go through one
 * GEMM: a short input's GEMM a layer (a 1,500-row Whisper input's 2,560
 * columns, 18 us at half the GEMM rate) is latency, not FLOPs. */
static td_status project_cross_kv(td_model *m, const void *x, int E, const int32_t *slots) {
  td_backend *b = m->b;
  td_kv_layout cl = td_model_cross_layout(m);
  size_t es = td_buf_elem_size(b, TD_BUF_ACT);
  int nl = cl.n_layers, hd = m->d.dh_ * m->d.ddh;
  if (nl == 0 || E <= 0) return TD_OK;
  const lin *f = &m->dec[0].ckv; /* out = 2 hd */
  size_t per = (size_t)E * f->out;
  int G = m->ckv_w && per <= m->e_ff_n ? (int)(m->e_ff_n / per < (size_t)nl ? m->e_ff_n / per : (size_t)nl) : 1;
  for (int l0 = 0; l0 < nl; l0 += G) {
    int g = nl - l0 < G ? nl - l0 : G;
    /* one layer: e_qkv, which always holds one, and the layer's own bias (NULL where it has none) */
    char *y = g > 1 ? m->e_ff : m->e_qkv;
    const float *bias = g > 1 ? (m->ckv_b ? m->ckv_b + (size_t)l0 * f->out : NULL) : m->dec[l0].ckv.b;
    TD_TRY(td_gemm(b, x, m->dec[l0].ckv.w, bias, y, E, g * f->out, f->in, TD_ACT_NONE, 0));
    TD_TRY(td_kv_write_layers(b, y, y + (size_t)hd * es, g * f->out, (size_t)f->out, m->cross_pool, &cl, l0, g, slots,
                              E));
  }
  return TD_OK;
}

/* One encoder run as enqueued work: its sizes, its host cu_seqlens (the
 * micro-batches' bounds) and its metadata on the device. */
typedef struct enc_run {
  int B, E, M;
  const int32_t *cu;     /* host [B + 1] */
  const int32_t *mcu_at; /* host [M]: each micro-batch's offsets in dmcu */
  const int32_t *dtok, *dpos, *dcu, *dslots, *dmcu;
} enc_run;

/* The encoder over staged metadata, from the embeddings (or the features
 * uploaded to w_feat) to the cross K/V: it only enqueues work, so that a
 * graph can hold it. Its output rows: *out (e_h or e_x). */
static td_status encoder_forward(td_model *m, const enc_run *r, const void **out) {
  const td_model_config *c = &m->cfg;
  const dims *d = &m->d;
  td_backend *b = m->b;
  bool whisper = c->family == TD_FAMILY_WHISPER;
  bool first = d->stage == 0, last = d->stage == d->stages - 1;
  int B = r->B, E = r->E, M = r->M, F = 2 * m->max_src, mels = c->num_mel_bins;
  const int32_t *cu = r->cu;
  td_relbias eb = {m->enc_lut, c->rel_max_distance};
  const td_relbias *bias = m->enc_lut ? &eb : NULL;
  for (int mb = 0; mb < M; mb++) {
    int s0 = B * mb / M, s1 = B * (mb + 1) / M, Bk = s1 - s0;
    int t0 = cu[s0], Ek = cu[s1] - cu[s0], maxk = 0;
    for (int s = s0; s < s1; s++) maxk = cu[s + 1] - cu[s] > maxk ? cu[s + 1] - cu[s] : maxk;
    const int32_t *kcu = M > 1 ? r->dmcu + r->mcu_at[mb] : r->dcu;
    void *eh = rows_at(m, m->e_h, t0, d->d);
    if (!first) {
      TD_TRY(td_recv(b, eh, TD_BUF_ACT, (size_t)Ek * d->d, d->stage - 1));
    } else if (whisper) {
      TD_TRY(td_im2col1d(b, rows_at(m, m->w_feat, s0 * mels, F), m->w_col1, Bk, mels, F, 3, 1, 1, true));
      TD_TRY(td_gemm(b, m->w_col1, m->conv1.w, m->conv1.b, m->w_c1, Bk * F, d->d, mels * 3, TD_ACT_GELU, 0));
      TD_TRY(td_im2col1d(b, m->w_c1, m->w_col2, Bk, d->d, F, 3, 2, 1, false));
      TD_TRY(td_gemm(b, m->w_col2, m->conv2.w, m->conv2.b, eh, Ek, d->d, d->d * 3, TD_ACT_GELU, 0));
      TD_TRY(td_add_pos(b, eh, m->enc_pos, Bk, m->max_src, d->d));
    } else {
      TD_TRY(td_embed(b, r->dtok + t0, r->dpos + t0, m->enc_tok,
                      c->pos_kind == TD_POS_RELATIVE ? NULL : m->enc_pos, c->embed_scale, eh, Ek, d->d));
      if (c->layernorm_embedding) TD_TRY(norm(m, &m->enc_ln_emb, eh, eh, Ek));
    }
    bool by_rows = m->opts.tp_size > 1 && m->opts.enc_rows; /* TP: one stage, one micro-batch */
    if (by_rows) TD_TRY(encoder_layers_rows(m, eh, Ek, kcu, Bk, maxk, bias));
    for (int l = 0; !by_rows && l < d->e1 - d->e0; l++) {
      const enc_layer *L = &m->enc[l];
      TD_TRY(norm_linear(m, c->pre_norm ? &L->ln_attn : NULL, &L->qkv, eh, m->e_qkv, m->e_x, Ek, TD_ACT_NONE, 0, NULL));
      TD_TRY(td_attn_dense(b, m->e_qkv, m->e_attn, kcu, Bk, Ek, maxk, d->eh, d->edh, c->enc_attn_scale, false, bias));
      TD_TRY(row_parallel(m, &L->o, m->e_attn, eh, Ek, false));
      if (!c->pre_norm) TD_TRY(norm(m, &L->ln_attn, eh, eh, Ek));
      TD_TRY(ffn(m, c->pre_norm ? &L->ln_ffn : NULL, &L->wi, &L->wo, eh, m->e_x, m->e_ff, m->e_ff1, Ek, false));
      if (!c->pre_norm) TD_TRY(norm(m, &L->ln_ffn, eh, eh, Ek));
    }
    if (!last) TD_TRY(td_send(b, eh, TD_BUF_ACT, (size_t)Ek * d->d, d->stage + 1));
  }
  /* pipeline: the last stage's output goes to every stage's cross KV */
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
  TD_TRY(project_cross_kv(m, eo, E, r->dslots));
  if (cl.states) /* the states once, split over the tail's K and V planes */
    TD_TRY(td_kv_write(b, eo, (const char *)eo + (size_t)(d->d / 2) * td_buf_elem_size(b, TD_BUF_ACT), d->d,
                       m->cross_pool, &cl, cl.n_layers, r->dslots, E));
  *out = eo;
  return TD_OK;
}

/* Encoder graphs: one text input of up to enc_graph_max tokens runs as the
 * graph of its bucket (TD_ENC_GRAPH_ROWS rows a bucket), padded with rows
 * that attend to nothing and write nothing, so that its first token waits
 * on the GPU and not on ~120 launches from the host. Single-rank models
 * only (a group's ranks meet in collectives run by run). */
static bool enc_graphs_apply(const td_model *m) {
  return m->n_enc_graphs > 0 && m->cfg.family != TD_FAMILY_WHISPER && m->opts.tp_size == 1 && m->d.stages == 1;
}

/* An encoder graph's run over Ep rows: tokens | positions | cu_seqlens (2)
 * | slots in meta_dev, as enc_graph_meta stages them. */
static enc_run enc_graph_run(const td_model *m, int Ep, int32_t *cu_host) {
  cu_host[0] = 0;
  cu_host[1] = Ep;
  const int32_t *D = m->meta_dev;
  return (enc_run){.B = 1, .E = Ep, .M = 1, .cu = cu_host, .dtok = D, .dpos = D + Ep, .dcu = D + 2 * Ep,
                   .dslots = D + 2 * Ep + 2};
}

/* One input of E tokens staged for the graph of Ep rows: padding rows take
 * token 0 at positions below the bound and write no slot; the attention
 * reads the real length from cu_seqlens, so they attend to nothing real and
 * no real row attends to them. Returns the values to copy. */
static size_t enc_graph_meta(td_model *m, int Ep, int E, const int32_t *tokens, const int32_t *slots) {
  int32_t *hm = m->meta_host, *tok = hm, *pos = hm + Ep, *cu = hm + 2 * Ep, *sl = cu + 2;
  for (int t = 0; t < Ep; t++) {
    tok[t] = t < E ? tokens[t] : 0;
    pos[t] = t;
    sl[t] = t < E ? slots[t] : -1;
  }
  cu[0] = 0;
  cu[1] = E;
  return (size_t)3 * Ep + 2;
}

static int enc_graph_rows(const td_model *m, int k) {
  int Ep = (k + 1) * TD_ENC_GRAPH_ROWS;
  return Ep < m->enc_graph_max ? Ep : m->enc_graph_max;
}

/* Ends a capture begun with td_graph_begin over work that returned cs: the
 * graph into *slot, or the first error (and no graph). */
static td_status capture_end(td_model *m, td_status cs, td_graph **slot) {
  td_graph *g = NULL;
  td_status es = td_graph_end(m->b, &g);
  if (cs != TD_OK || es != TD_OK) {
    td_graph_destroy(m->b, g);
    return cs != TD_OK ? cs : es;
  }
  *slot = g;
  return TD_OK;
}

td_status td_model_capture_encoder_graphs(td_model *m) {
  if (!m->cross_pool) return td_err(TD_ERR_INVALID, "capture: no cross-attention pool set");
  if (!enc_graphs_apply(m)) return TD_OK;
  int64_t t0 = td_now_ns();
  for (int k = 0; k < m->n_enc_graphs; k++) {
    if (m->enc_graphs[k]) continue;
    int32_t cu[2];
    int Ep = enc_graph_rows(m, k);
    enc_run r = enc_graph_run(m, Ep, cu);
    const void *eo;
    /* first eagerly, rows of nothing (no slot written): the GEMM plans and the bf16 bias copies the graph
     * would otherwise take without (cuda_gemm.cu, bias16_get), so that graph and eager runs match */
    size_t n = enc_graph_meta(m, Ep, 0, NULL, NULL);
    TD_TRY(td_copy_h2d(m->b, m->meta_dev, m->meta_host, n * sizeof(int32_t)));
    TD_TRY(encoder_forward(m, &r, &eo));
    TD_TRY(td_sync(m->b));
    TD_TRY(td_graph_begin(m->b));
    TD_TRY(capture_end(m, encoder_forward(m, &r, &eo), &m->enc_graphs[k]));
  }
  TD_INFO("captured the encoder of one input in %d graphs of up to %d rows in %.0f ms", m->n_enc_graphs,
          m->enc_graph_max, (double)(td_now_ns() - t0) / 1e6);
  return TD_OK;
}

int td_model_encoder_graph_rows(const td_model *m) {
  return enc_graphs_apply(m) && m->enc_graphs[m->n_enc_graphs - 1] ? m->enc_graph_max : 0;
}

td_status td_model_encode(td_model *m, const td_encode_input *in, float *enc_out) {
  /* the last stage sends a launched set's logits before it takes this run: receive them first */
  TD_TRY(post_pending(m));
  const td_model_config *c = &m->cfg;
  const dims *d = &m->d;
  td_backend *b = m->b;
  int B = in->n_seqs;
  if (B <= 0 || B > m->opts.max_enc_seqs)
    return td_err(TD_ERR_INVALID, "encode: %d sequences (1 to %d allowed)", B, m->opts.max_enc_seqs);
  if (!m->cross_pool) return td_err(TD_ERR_INVALID, "encode: no cross-attention pool set");
  bool whisper = c->family == TD_FAMILY_WHISPER;
  int E = 0;
  for (int s = 0; s < B; s++) {
    int len = whisper ? m->max_src : in->lens[s];
    if (len <= 0 || len > m->max_src)
      return td_err(TD_ERR_INVALID, "encode: sequence %d has %d tokens (1 to %d allowed)", s, len, m->max_src);
    E += len;
  }
  if (E > m->opts.max_enc_tokens)
    return td_err(TD_ERR_INVALID, "encode: %d tokens in one call, more than the %d configured", E,
                  m->opts.max_enc_tokens);
  if (whisper ? !in->features : !in->tokens) return td_err(TD_ERR_INVALID, "encode: no input");
  for (int s = 0, k = 0; !whisper && s < B; s++)
    for (int t = 0; t < in->lens[s]; t++, k++)
      if (in->tokens[k] < 0 || in->tokens[k] >= c->vocab_size)
        return td_err(TD_ERR_INVALID, "encode: token id %d at position %d of sequence %d is outside the vocabulary of %d",
                      in->tokens[k], t, s, c->vocab_size);
  TD_TRY(mirror_publish_encode(m, in));
  const void *eo;
  int gk = B == 1 && enc_graphs_apply(m) && E <= m->enc_graph_max ? (E - 1) / TD_ENC_GRAPH_ROWS : -1;
  if (gk >= 0 && m->enc_graphs[gk]) {
    size_t n = enc_graph_meta(m, enc_graph_rows(m, gk), E, in->tokens, in->cross_slots);
    TD_TRY(td_copy_h2d(b, m->meta_dev, m->meta_host, n * sizeof(int32_t)));
    TD_TRY(td_graph_launch(b, m->enc_graphs[gk]));
    eo = c->final_norm ? m->e_x : m->e_h; /* as encoder_forward leaves it on one stage */
  } else {
    /* metadata: tokens | positions | cu_seqlens | cross slots */
    int32_t *hm = m->meta_host;
    int32_t *tok = hm, *pos = hm + E, *cu = hm + 2 * E, *slots = cu + B + 1;
    cu[0] = 0;
    for (int s = 0, k = 0; s < B; s++) {
      int len = whisper ? m->max_src : in->lens[s];
      cu[s + 1] = cu[s] + len;
      for (int t = 0; t < len; t++, k++) {
        if (!whisper) tok[k] = in->tokens[k];
        pos[k] = t;
      }
    }
    memcpy(slots, in->cross_slots, sizeof(int32_t) * (size_t)E);
    /* Pipeline stages take the encoder in micro-batches of whole sequences, as
     * the decoder's steps: stage s runs micro-batch k while stage s + 1 runs
     * k - 1 (one batch went through the stages one after the other, the
     * other stages idle). Each has its own cu_seqlens from 0. */
    int M = d->stages < B ? d->stages : B;
    if (M > TD_ENC_MICRO_BATCHES) M = TD_ENC_MICRO_BATCHES;
    int32_t *mcu = slots + E; /* per micro-batch: its sequences' offsets from its first token */
    int mcu_at[TD_ENC_MICRO_BATCHES];
    for (int mb = 0, at = 0; mb < M; mb++) {
      int s0 = B * mb / M, s1 = B * (mb + 1) / M;
      mcu_at[mb] = at;
      for (int s = s0; s <= s1; s++) mcu[at++] = cu[s] - cu[s0];
    }
    size_t n_meta = (size_t)(3 * E + B + 1) + (M > 1 ? (size_t)(B + M) : 0);
    TD_TRY(td_copy_h2d(b, m->meta_dev, hm, n_meta * sizeof(int32_t)));
    const int32_t *D = m->meta_dev;
    enc_run r = {.B = B, .E = E, .M = M, .cu = cu, .mcu_at = mcu_at, .dtok = D, .dpos = D + E, .dcu = D + 2 * E,
                 .dslots = D + 2 * E + B + 1, .dmcu = D + 3 * E + B + 1};
    if (d->stage == 0 && whisper)
      TD_TRY(td_upload(b, TD_BUF_ACT, m->w_feat, in->features, (size_t)B * c->num_mel_bins * 2 * m->max_src));
    TD_TRY(encoder_forward(m, &r, &eo));
  }
  if (enc_out) TD_TRY(td_download(b, TD_BUF_ACT, eo, enc_out, (size_t)E * d->d));
  return td_sync(b);
}

td_status td_model_project_cross(td_model *m, const int32_t *cross_slots, int n) {
  td_backend *b = m->b;
  const dims *d = &m->d;
  td_kv_layout cl = td_model_cross_layout(m);
  if (!m->cross_pool) return td_err(TD_ERR_INVALID, "project cross: no cross-attention pool set");
  if (cl.n_layers == 0 || cl.states == 0)
    return td_err(TD_ERR_INVALID, "project cross: the cross pool (%s) holds no %s", td_cross_mode_name(m->opts.cross_mode),
                  cl.states ? "per-layer K/V to project into" : "encoder states to project from");
  if (n < 0 || (n > 0 && !cross_slots)) return td_err(TD_ERR_INVALID, "project cross: %d rows", n);
  /* no collective inside: each rank's ckv weights and pool are its own heads (TP) or layers (PP) */
  TD_TRY(mirror_publish_project(m, cross_slots, n));
  size_t es = td_buf_elem_size(b, TD_BUF_ACT);
  /* chunks of the encoder's workspace: every decoder layer's K/V GEMM over all of a chunk's rows */
  for (int r0 = 0; r0 < n; r0 += m->opts.max_enc_tokens) {
    int E = n - r0 < m->opts.max_enc_tokens ? n - r0 : m->opts.max_enc_tokens;
    memcpy(m->meta_host, cross_slots + r0, sizeof(int32_t) * (size_t)E);
    TD_TRY(td_copy_h2d(b, m->meta_dev, m->meta_host, sizeof(int32_t) * (size_t)E));
    TD_TRY(td_kv_read(b, m->cross_pool, &cl, cl.n_layers, m->meta_dev, E, m->e_x,
                      (char *)m->e_x + (size_t)(d->d / 2) * es, d->d));
    TD_TRY(project_cross_kv(m, m->e_x, E, m->meta_dev));
    /* the next chunk rewrites the metadata and the workspace */
    if (r0 + E < n) TD_TRY(td_sync(b));
  }
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
  bool pf = self_m.max_q == 1, states = td_model_takes_states(m, T);
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
    TD_TRY(row_parallel(m, &L->o, att, h, T, false));
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
    TD_TRY(row_parallel(m, &L->co, att, h, T, false));
    if (!c->pre_norm) TD_TRY(norm(m, &L->ln_cross, h, h, T));
    TD_TRY(ffn(m, c->pre_norm ? &L->ln_ffn : NULL, &L->wi, &L->wo, h, x, ff, ff1, T, false));
    if (!c->pre_norm) TD_TRY(norm(m, &L->ln_ffn, h, h, T));
    if (pf && l + 1 < nl) TD_TRY(td_kv_prefetch(b, m->self_pool, &sl, l + 1, &self_m));
  }
  return TD_OK;
}

/* The decoder over staged metadata: it only enqueues work, so it can be
 * captured in a graph. With pipeline stages the step's sequences go
 * through in micro-batches, so that every stage has work. */
/* Two running sets, the first stage: where this step's logits go, and the
 * other set's logits to receive with this step's send (NULL: none). */
typedef struct set_io {
  float *logits;
  float *other_logits;
  int other_rows;
} set_io;

static td_status decoder_forward(td_model *m, const step_layout *ly, const step_bounds *sb, const int32_t *D,
                                 const set_io *sio) {
  const td_model_config *c = &m->cfg;
  const dims *d = &m->d;
  td_backend *b = m->b;
  int T = sb->T, NL = sb->NL, S = sb->S;
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
  /* two running sets: a step goes through whole (the other set fills the stages) */
  int M = d->stages > 1 && m->opts.pp_sets < 2 ? (S < d->stages ? S : d->stages) : 1;
  for (int mb = 0; mb < M; mb++) {
    int s0 = S * mb / M, s1 = S * (mb + 1) / M;
    int t0 = M == 1 ? 0 : sb->hq_start[s0], t1 = M == 1 ? T : sb->hq_start[s1];
    void *h = rows_at(m, m->d_h, t0, d->d);
    if (!first) TD_TRY(td_recv(b, h, TD_BUF_ACT, (size_t)(t1 - t0) * d->d, d->stage - 1));
    TD_TRY(decoder_layers(m, &self_m, &cross_m, dslots, s0, s1, t0, t1));
    if (!last && sio && sio->other_logits)
      TD_TRY(td_sendrecv(b, h, TD_BUF_ACT, (size_t)(t1 - t0) * d->d, d->stage + 1, sio->other_logits, TD_BUF_F32,
                         (size_t)sio->other_rows * d->vocab, d->stages - 1));
    else if (!last)
      TD_TRY(td_send(b, h, TD_BUF_ACT, (size_t)(t1 - t0) * d->d, d->stage + 1));
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
  /* the leader (stage 0) samples; with two sets it takes these logits later (collect) */
  if (NL && d->stages > 1) {
    if (last) TD_TRY(td_send(b, m->logits, TD_BUF_F32, (size_t)NL * d->vocab, 0));
    if (first && !sio) TD_TRY(td_recv(b, m->logits, TD_BUF_F32, (size_t)NL * d->vocab, d->stages - 1));
  }
  return TD_OK;
}

/* The decode step of bucket gi as a graph, captured once with bounds that
 * hold for any step (it reads its metadata at fixed addresses: L). */
static td_status capture(td_model *m, int gi, const step_layout *L) {
  if (m->graphs[gi]) return TD_OK;
  int B = m->buckets[gi];
  step_bounds gb = {.T = B, .S = B, .NL = B, .max_q = 1, .max_ctx = m->self_stride * m->opts.block_size,
                    .max_cross = m->cross_stride * m->opts.block_size};
  TD_TRY(td_graph_begin(m->b));
  return capture_end(m, decoder_forward(m, L, &gb, m->meta_dev, NULL), &m->graphs[gi]);
}

td_status td_model_capture_graphs(td_model *m) {
  if (!m->self_pool || !m->cross_pool) return td_err(TD_ERR_INVALID, "capture: KV pools not set");
  /* a group's ranks capture as their steps come, in the same order */
  if (m->opts.tp_size > 1 || m->opts.pp_size > 1) return TD_OK;
  for (int gi = 0; gi < m->n_buckets; gi++) {
    int B = m->buckets[gi];
    step_layout L = layout_for(m, B, B, B);
    TD_TRY(capture(m, gi, &L));
  }
  return TD_OK;
}

/* A step's checks, its metadata into hm / dm, and the decoder (a graph where one fits). */
static td_status step_run(td_model *m, const td_step_input *in, int32_t *hm_buf, int32_t *dm, const set_io *sio) {
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
  TD_TRY(mirror_publish_step(m, in));
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
  int32_t *hm = hm_buf;
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
  TD_TRY(td_copy_h2d(b, dm, hm, L.total * sizeof(int32_t)));
  if (gi >= 0) {
    TD_TRY(capture(m, gi, &L));
    TD_TRY(td_graph_launch(b, m->graphs[gi]));
  } else {
    step_bounds sb = {.T = T, .S = S, .NL = NL, .max_q = max_q, .max_ctx = max_ctx, .max_cross = max_cross,
                      .hq_start = in->q_start};
    TD_TRY(decoder_forward(m, &L, &sb, dm, sio));
  }
  return TD_OK;
}

static bool sets_out(const td_model *m) { return m->set_out[0] || m->set_out[1]; }

td_status td_model_step(td_model *m, const td_step_input *in, const float **logits) {
  if (sets_out(m)) return td_err(TD_ERR_INVALID, "step: a running set's logits are still out (collect them first)");
  TD_TRY(step_run(m, in, m->meta_host, m->meta_dev, NULL));
  *logits = m->logits;
  return TD_OK;
}

static float *set_logits(td_model *m, int set) { return set ? m->logits1 : m->logits; }

td_status td_model_step_launch(td_model *m, const td_step_input *in, int set) {
  if (m->opts.pp_sets != 2 || m->d.stage != 0)
    return td_err(TD_ERR_INVALID, "step launch: for the first stage of a pipeline with two running sets");
  if (set < 0 || set > 1) return td_err(TD_ERR_INVALID, "step launch: set %d is not 0 or 1", set);
  if (m->set_out[set]) return td_err(TD_ERR_INVALID, "step launch: set %d's logits are still out", set);
  int other = 1 - set;
  set_io sio = {.logits = set_logits(m, set)};
  if (m->set_out[other] && !m->set_posted[other]) {
    sio.other_logits = set_logits(m, other);
    sio.other_rows = m->set_rows[other];
  }
  TD_TRY(step_run(m, in, set ? m->meta_host1 : m->meta_host, set ? m->meta_dev1 : m->meta_dev, &sio));
  if (sio.other_logits) m->set_posted[other] = true;
  m->set_out[set] = in->n_logits > 0;
  m->set_posted[set] = false;
  m->set_rows[set] = in->n_logits;
  return TD_OK;
}

td_status td_model_step_collect(td_model *m, int set, const float **logits) {
  *logits = NULL;
  if (set < 0 || set > 1 || !m->set_out[set]) return td_err(TD_ERR_INVALID, "step collect: set %d is not out", set);
  float *lg = set_logits(m, set);
  if (!m->set_posted[set])
    TD_TRY(td_recv(m->b, lg, TD_BUF_F32, (size_t)m->set_rows[set] * m->d.vocab, m->d.stages - 1));
  m->set_out[set] = m->set_posted[set] = false;
  *logits = lg;
  return TD_OK;
}
