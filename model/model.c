/* The model's life: options and their defaults, td_model_load (checks the
 * configuration against the options, this rank's tensor- or pipeline-
 * parallel share of heads and layers, scratch sized from the limits),
 * td_model_destroy and the accessors. Weights: weights.c, t5.c, bart.c;
 * the graph: forward.c; followers: mirror.c. */
#include <limits.h>
#include <stdlib.h>

#include "common/defaults.h"
#include "common/log.h"
#include "model/internal.h"

void td_model_opts_default(td_model_opts *o) {
  if (o->block_size <= 0) o->block_size = TD_DEFAULT_BLOCK_SIZE;
  if (o->max_seqs <= 0) o->max_seqs = TD_DEFAULT_MAX_SEQS;
  if (o->max_tokens <= 0) o->max_tokens = TD_DEFAULT_MAX_TOKENS;
  if (o->max_tokens < o->max_seqs) o->max_tokens = o->max_seqs;
  if (o->max_logits <= 0) o->max_logits = o->max_seqs;
  if (o->max_enc_seqs <= 0) o->max_enc_seqs = TD_DEFAULT_MAX_ENC_SEQS;
  if (o->max_enc_tokens <= 0) o->max_enc_tokens = TD_DEFAULT_MAX_ENC_TOKENS;
  if (o->tp_size <= 0) o->tp_size = 1;
  if (o->pp_size <= 0) o->pp_size = 1;
}

/* The decoder layers' cross K/V weights moved into one matrix (m->ckv_w,
 * m->ckv_b), each layer's lin a view of its rows: an encoder run of few
 * rows then projects several layers' K/V in one GEMM instead of a GEMM of
 * a few microseconds each (project_cross_kv in forward.c). */
static td_status ckv_contiguous(td_model *m) {
  td_backend *b = m->b;
  int nl = m->d.l1 - m->d.l0;
  if (nl < 2 || m->opts.tuning.ckv_batch == TD_OFF) return TD_OK;
  const lin *f = &m->dec[0].ckv;
  bool bias = false;
  for (int l = 0; l < nl; l++) {
    const lin *k = &m->dec[l].ckv;
    if (!k->w || k->wsum || k->out != f->out || k->in != f->in) return TD_OK; /* not one shape: per layer */
    bias |= k->b != NULL;
  }
  size_t es = td_buf_elem_size(b, TD_BUF_ACT), wn = (size_t)f->out * f->in;
  float *zeros = NULL;
  td_status s = td_alloc(b, TD_BUF_ACT, (size_t)nl * wn, &m->ckv_w);
  if (s == TD_OK && bias) {
    s = td_alloc(b, TD_BUF_F32, (size_t)nl * f->out, (void **)&m->ckv_b);
    if (s == TD_OK && !(zeros = calloc((size_t)f->out, sizeof(float)))) s = td_err(TD_ERR_NOMEM, "out of memory");
  }
  for (int l = 0; l < nl && s == TD_OK; l++) {
    const lin *k = &m->dec[l].ckv;
    s = td_copy_d2d(b, (char *)m->ckv_w + (size_t)l * wn * es, k->w, wn * es);
    if (s == TD_OK && bias)
      s = k->b ? td_copy_d2d(b, m->ckv_b + (size_t)l * f->out, k->b, sizeof(float) * (size_t)f->out)
               : td_upload(b, TD_BUF_F32, m->ckv_b + (size_t)l * f->out, zeros, (size_t)f->out);
  }
  free(zeros);
  if (s == TD_OK) s = td_sync(b); /* the copies done before their sources go */
  if (s != TD_OK) { /* the layers still own their weights */
    td_free(b, m->ckv_w);
    td_free(b, m->ckv_b);
    m->ckv_w = NULL;
    m->ckv_b = NULL;
    return s;
  }
  for (int l = 0; l < nl; l++) {
    lin *k = &m->dec[l].ckv;
    td_free(b, k->w);
    k->w = (char *)m->ckv_w + (size_t)l * wn * es;
    if (k->b) {
      td_free(b, k->b);
      k->b = m->ckv_b + (size_t)l * f->out;
    }
  }
  return TD_OK;
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
  m->e_ff_n = E * d->eff * g;
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
  /* tokens, positions, cu_seqlens, cross slots, then each pipeline micro-batch's own cu_seqlens */
  size_t enc = 3 * E + 2 * (size_t)o->max_enc_seqs + 1 + TD_ENC_MICRO_BATCHES;
  m->meta_cap = step > enc ? step : enc;
  TD_TRY(td_alloc(b, TD_BUF_I32, m->meta_cap, (void **)&m->meta_dev));
  TD_TRY(td_host_alloc(b, m->meta_cap * sizeof(int32_t), (void **)&m->meta_host));
  if (o->pp_sets == 2 && o->pp_rank == 0) {
    TD_TRY(td_alloc(b, TD_BUF_I32, m->meta_cap, (void **)&m->meta_dev1));
    TD_TRY(td_host_alloc(b, m->meta_cap * sizeof(int32_t), (void **)&m->meta_host1));
    TD_TRY(td_alloc(b, TD_BUF_F32, L * (size_t)d->vocab, (void **)&m->logits1));
  }
  return TD_OK;
}

td_status td_model_load(const char *dir, td_backend *b, const td_model_opts *opts_in, td_model **out) {
  *out = NULL;
  td_model *m = calloc(1, sizeof *m);
  if (!m) return td_err(TD_ERR_NOMEM, "out of memory");
  m->b = b;
  m->opts = *opts_in;
  td_model_opts_default(&m->opts);
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
  bool enc_rows = tp > 1 && m->opts.enc_rows;
  if (!enc_rows && (c->enc_heads % tp || c->enc_ffn % tp)) {
    s = td_err(TD_ERR_UNSUPPORTED, "%s: encoder heads (%d) and FFN width (%d) must divide by tensor parallel %d "
               "(or the encoder split by rows)", dir, c->enc_heads, c->enc_ffn, tp);
    goto fail;
  }
  if (c->dec_heads % tp || c->dec_ffn % tp) {
    s = td_err(TD_ERR_UNSUPPORTED, "%s: decoder heads (%d) and FFN width (%d) must divide by tensor parallel %d",
               dir, c->dec_heads, c->dec_ffn, tp);
    goto fail;
  }
  int pp = m->opts.pp_size;
  if (m->opts.pp_rank < 0 || m->opts.pp_rank >= pp || (pp > 1 && tp > 1)) {
    s = td_err(TD_ERR_UNSUPPORTED, "pipeline stage %d of %d with tensor parallel %d: a worker group is either "
               "tensor- or pipeline-parallel", m->opts.pp_rank, pp, tp);
    goto fail;
  }
  if (m->opts.pp_sets < 0 || m->opts.pp_sets > 2 || (m->opts.pp_sets == 2 && pp < 2)) {
    s = td_err(TD_ERR_INVALID, "%d running sets with %d pipeline stages: two sets are for pipelines", m->opts.pp_sets,
               pp);
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
  int etp = enc_rows ? 1 : tp;
  m->d = (dims){.d = c->d_model, .vocab = c->vocab_size, .eh = c->enc_heads / etp, .edh = c->enc_head_dim,
                .eff = c->enc_ffn / etp, .dh_ = c->dec_heads / tp, .ddh = c->dec_head_dim, .dff = c->dec_ffn / tp,
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
  if (m->opts.cross_int8) {
    const char *why = td_backend_get_kind(b) != TD_BACKEND_CUDA ? "needs a CUDA device"
                      : m->opts.cross_mode == TD_CROSS_STATES    ? "quantizes the per-layer K/V, which cross mode states does not hold"
                      : tp > 1 || pp > 1                         ? "runs on one rank only (a group's ranks exchange bf16 blocks)"
                      : c->dec_head_dim % 16                     ? "needs a head size that is a multiple of 16"
                      : m->opts.block_size % 4                   ? "needs a block size that is a multiple of 4"
                                                                 : NULL;
    if (why) {
      s = td_err(TD_ERR_UNSUPPORTED, "%s: int8 cross K/V %s", dir, why);
      goto fail;
    }
  }
  /* the fewest rows that take the states path */
  m->states_rows = m->opts.cross_mode == TD_CROSS_STATES ? 0
                   : m->opts.cross_mode == TD_CROSS_KV || m->opts.states_rows < 0 ? INT_MAX
                   : m->opts.states_rows > 0 ? m->opts.states_rows
                                             : td_attn_states_rows(b, c->d_model, m->opts.cross_int8);
  /* the backend's choice: past the fewest rows, it also says which row counts */
  m->states_auto = m->opts.cross_mode == TD_CROSS_DUAL && m->opts.states_rows == 0;
  if (m->opts.cross_mode == TD_CROSS_STATES && td_backend_get_kind(b) == TD_BACKEND_CUDA &&
      !td_attn_states_fast(b, c->d_model))
    TD_WARN("%s: cross mode states with d_model %d: this GPU has no tensor-core states kernel for that width, so "
            "every decode step takes the generic one (tens of times slower at large batches: bench/RESULTS.md); "
            "--cross-mode dual or kv keep the K/V path", dir, c->d_model);
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
  s = weights_load(m, dir);
  if (s != TD_OK) goto fail;
  s = ckv_contiguous(m);
  if (s != TD_OK) goto fail;
  s = alloc_scratch(m);
  if (s != TD_OK) goto fail;
  if (td_backend_has_graphs(b) && !m->opts.no_graphs && m->opts.pp_size == 1)
    for (int bk = 1; bk <= m->opts.max_seqs && m->n_buckets < MAX_GRAPHS; bk *= 2) m->buckets[m->n_buckets++] = bk;
  if (m->n_buckets && m->buckets[m->n_buckets - 1] < m->opts.max_seqs && m->n_buckets < MAX_GRAPHS)
    m->buckets[m->n_buckets++] = m->opts.max_seqs;
  if (td_backend_has_graphs(b) && !m->opts.no_graphs && m->opts.tuning.enc_graphs != TD_OFF &&
      m->opts.tp_size == 1 && m->opts.pp_size == 1 && c->family != TD_FAMILY_WHISPER) {
    int most = TD_ENC_GRAPHS * TD_ENC_GRAPH_ROWS;
    most = m->max_src < most ? m->max_src : most;
    m->enc_graph_max = m->opts.max_enc_tokens < most ? m->opts.max_enc_tokens : most;
    m->n_enc_graphs = (m->enc_graph_max + TD_ENC_GRAPH_ROWS - 1) / TD_ENC_GRAPH_ROWS;
  }
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
                     m->logits, m->logits_part, m->logits_all, m->meta_dev, m->meta_dev1, m->logits1};
  for (size_t i = 0; i < sizeof scratch / sizeof scratch[0]; i++) td_free(b, scratch[i]);
  td_host_free(b, m->meta_host);
  td_host_free(b, m->meta_host1);
  for (int i = 0; i < m->n_buckets; i++) td_graph_destroy(b, m->graphs[i]);
  for (int i = 0; i < m->n_enc_graphs; i++) td_graph_destroy(b, m->enc_graphs[i]);
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
    lin *ls[] = {&L->qkv, &L->o, &L->cq, &L->co, &L->wi, &L->wo, &L->ckv};
    for (size_t k = 0; k < (m->ckv_w ? 6u : 7u); k++) free_lin(b, ls[k]); /* views of ckv_w: freed below */
  }
  td_free(b, m->ckv_w);
  td_free(b, m->ckv_b);
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

bool td_model_takes_states(const td_model *m, int rows) {
  if (rows < m->states_rows) return false;
  return !m->states_auto || td_attn_states_takes(m->b, m->cfg.d_model, m->d.dh_, m->opts.cross_int8, rows);
}

int td_model_states_ranges(const td_model *m, int max_rows, int (*r)[2], int n) {
  int k = 0, lo = 0;
  for (int rows = 1; rows <= max_rows + 1; rows++) {
    bool in = rows <= max_rows && td_model_takes_states(m, rows);
    if (in && !lo) lo = rows;
    if (!in && lo) {
      if (k < n) r[k][0] = lo, r[k][1] = rows - 1;
      k++;
      lo = 0;
    }
  }
  return k;
}

td_kv_layout td_model_self_layout(const td_model *m) {
  return (td_kv_layout){m->d.l1 - m->d.l0, m->d.dh_, m->d.ddh, m->opts.block_size, 0, 0};
}
td_kv_layout td_model_cross_layout(const td_model *m) {
  td_cross_mode cm = m->opts.cross_mode;
  return (td_kv_layout){cm == TD_CROSS_STATES ? 0 : m->d.l1 - m->d.l0, m->d.dh_, m->d.ddh, m->opts.block_size,
                        cm == TD_CROSS_KV ? 0 : m->d.d, m->opts.cross_int8 && cm != TD_CROSS_STATES};
}

int td_model_encoder_out_len(const td_model *m, int input_len) {
  return m->cfg.family == TD_FAMILY_WHISPER ? m->max_src : input_len;
}

int td_model_input_frames(const td_model *m) {
  return m->cfg.family == TD_FAMILY_WHISPER ? 2 * m->cfg.max_source_len : 0;
}

void td_model_set_pools(td_model *m, void *self_pool, void *cross_pool) {
  /* captured steps hold the pools' addresses: other pools, other graphs */
  if (self_pool != m->self_pool || cross_pool != m->cross_pool) {
    for (int i = 0; i < m->n_buckets; i++) {
      td_graph_destroy(m->b, m->graphs[i]);
      m->graphs[i] = NULL;
    }
    for (int i = 0; i < m->n_enc_graphs; i++) {
      td_graph_destroy(m->b, m->enc_graphs[i]);
      m->enc_graphs[i] = NULL;
    }
  }
  m->self_pool = self_pool;
  m->cross_pool = cross_pool;
}
