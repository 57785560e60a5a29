/* Sampling a step's logit rows on the backend: each row's parameters
 * (temperature, top-k / top-p, the seed's stream and step, forced BOS /
 * EOS, suppressed tokens), then td_sample for sampled and greedy rows and
 * td_topk_logprobs for beam rows; the results come back to the host. */
#include <math.h>
#include <stdlib.h>

#include "common/defaults.h"
#include "engine/internal.h"

td_status eng_sampler_init(td_engine *e) {
  eng_sampler *sm = &e->smp;
  size_t R = (size_t)e->max_rows;
  int beams = e->max_width < TD_ENGINE_MAX_BEAMS ? e->max_width : TD_ENGINE_MAX_BEAMS;
  sm->max_k = 2 * beams < e->V ? 2 * beams : e->V;
  sm->cap_bans = e->max_rows * (1 + e->gen->n_suppress + e->gen->n_begin_suppress) + 1;
  sm->h_rows = malloc(sizeof *sm->h_rows * R);
  sm->h_tok = malloc(sizeof(int32_t) * R);
  sm->h_lp = malloc(sizeof(float) * R);
  sm->h_ids = malloc(sizeof(int32_t) * R * (size_t)sm->max_k);
  sm->h_vals = malloc(sizeof(float) * R * (size_t)sm->max_k);
  sm->h_logits = malloc(sizeof(float) * (size_t)e->V);
  sm->h_bans = malloc(sizeof(int32_t) * (size_t)sm->cap_bans);
  if (!sm->h_rows || !sm->h_tok || !sm->h_lp || !sm->h_ids || !sm->h_vals || !sm->h_logits || !sm->h_bans)
    return td_err(TD_ERR_NOMEM, "engine buffers: out of memory");
  size_t row_words = (sizeof(td_sample_row) * R + 3) / 4;
  TD_TRY(td_alloc(e->b, TD_BUF_I32, row_words, (void **)&sm->d_rows));
  TD_TRY(td_alloc(e->b, TD_BUF_I32, (size_t)sm->cap_bans, (void **)&sm->d_bans));
  TD_TRY(td_alloc(e->b, TD_BUF_I32, R, (void **)&sm->d_tok));
  TD_TRY(td_alloc(e->b, TD_BUF_F32, R, (void **)&sm->d_lp));
  TD_TRY(td_alloc(e->b, TD_BUF_I32, R * (size_t)sm->max_k, (void **)&sm->d_ids));
  TD_TRY(td_alloc(e->b, TD_BUF_F32, R * (size_t)sm->max_k, (void **)&sm->d_vals));
  return TD_OK;
}

void eng_sampler_free(td_engine *e) {
  eng_sampler *sm = &e->smp;
  void *h[] = {sm->h_rows, sm->h_tok, sm->h_lp, sm->h_ids, sm->h_vals, sm->h_logits, sm->h_bans};
  for (size_t i = 0; i < sizeof h / sizeof h[0]; i++) free(h[i]);
  void *d[] = {sm->d_rows, sm->d_bans, sm->d_tok, sm->d_lp, sm->d_ids, sm->d_vals};
  for (size_t i = 0; i < sizeof d / sizeof d[0]; i++) td_free(e->b, d[i]);
}

static void ban_range(int32_t *bans, int *n_bans, int32_t lo, int32_t hi) {
  for (int32_t t = lo; t < hi; t++) bans[(*n_bans)++] = t;
}

/* log(sum(exp(x[lo..hi)))), and the maximum of x[lo..hi). */
static double lse(const float *x, int lo, int hi, double *mx) {
  double m = -INFINITY, s = 0.0;
  for (int j = lo; j < hi; j++) m = x[j] > m ? x[j] : m;
  *mx = m;
  if (m == -INFINITY) return -INFINITY;
  for (int j = lo; j < hi; j++) s += exp((double)x[j] - m);
  return m + log(s);
}

/* Whisper's timestamp rules (transformers' WhisperTimeStampLogitsProcessor)
 * as bans on the row of sequence s: no <|notimestamps|>; timestamps in pairs
 * (but one before EOS); never decreasing; the first token a timestamp, at most
 * max_initial_timestamp; and when the timestamps together are likelier than
 * any text token, a timestamp. The last needs the row's log-probs after the
 * other bans, so the row comes to the host (row_dev: its logits). */
static td_status ts_bans(td_engine *e, const group *g, const seq *s, const float *row_dev, int ban_start,
                         int *n_bans) {
  int32_t *bans = e->smp.h_bans, tb = g->p.timestamp_begin, V = e->V, eos = e->gen->eos_ids[0];
  int begin = g->n_prompt - (int)g->step_offset; /* the request's own prompt: earlier tokens are output */
  const int32_t *out = s->tok.v + begin;
  int n = s->tok.n - begin;
  bans[(*n_bans)++] = tb - 1;
  bool last_ts = n >= 1 && out[n - 1] >= tb, penult_ts = n < 2 || out[n - 2] >= tb;
  if (last_ts) ban_range(bans, n_bans, penult_ts ? tb : 0, penult_ts ? V : eos);
  int32_t last = -1;
  for (int i = n - 1; i >= 0 && last < 0; i--)
    if (out[i] >= tb) last = out[i];
  if (last >= 0) ban_range(bans, n_bans, tb, last_ts && !penult_ts ? last : last + 1);
  if (n == 0) {
    ban_range(bans, n_bans, 0, tb);
    if (g->p.max_initial_timestamp >= 0) ban_range(bans, n_bans, tb + g->p.max_initial_timestamp + 1, V);
  }
  float *x = e->smp.h_logits;
  TD_TRY(td_download(e->b, TD_BUF_F32, row_dev, x, (size_t)V));
  for (int i = ban_start; i < *n_bans; i++) x[bans[i]] = -INFINITY;
  double max_text, unused;
  double ts = lse(x, tb, V, &unused);
  (void)lse(x, 0, tb, &max_text);
  if (ts > max_text) ban_range(bans, n_bans, 0, tb); /* log_softmax shifts both alike */
  return TD_OK;
}

/* Row parameters for the next token of sequence s; its bans go to h_bans. */
static td_sample_row make_row(td_engine *e, group *g, const seq *s, int stream, int *n_bans) {
  int k = s->tok.n - g->n_prompt;   /* tokens generated so far by this attempt */
  int kk = k + (int)g->step_offset; /* ... and by earlier ones */
  td_sample_row r = {.temperature = g->p.temperature, .top_k = g->p.top_k, .top_p = g->p.top_p, .forced = -1,
                     .stream = (uint32_t)stream, .step = (uint32_t)kk, .seed = g->p.seed};
  if (k == 0 && g->n_prompt == 1 && g->forced_bos >= 0) r.forced = g->forced_bos;
  if (k == g->max_new - 1 && g->forced_eos >= 0) r.forced = g->forced_eos;
  r.ban_start = *n_bans;
  const td_gen_config *gen = e->gen;
  int32_t *bans = e->smp.h_bans;
  for (int i = 0; i < gen->n_suppress; i++) bans[(*n_bans)++] = gen->suppress[i];
  if (kk == 0)
    for (int i = 0; i < gen->n_begin_suppress; i++) bans[(*n_bans)++] = gen->begin_suppress[i];
  /* an allowed list bans the rest (the backends' one mechanism for it) */
  for (int t = 0, a = 0; g->p.n_allowed && t < e->V; t++) {
    while (a < g->p.n_allowed && g->allowed[a] < t) a++;
    if (a == g->p.n_allowed || g->allowed[a] != t) bans[(*n_bans)++] = t;
  }
  r.ban_count = *n_bans - r.ban_start;
  return r;
}

/* Room for the bans of this step's rows: an allowed list can ban the whole
 * vocabulary, so the buffers grow when such a request runs. */
static td_status reserve_bans(td_engine *e) {
  const eng_batch *bt = e->bt;
  eng_sampler *sm = &e->smp;
  size_t need = 1;
  for (int r = 0; r < bt->n_rows; r++) {
    const group *g = bt->ouse[r].g;
    need += (size_t)e->gen->n_suppress + (size_t)e->gen->n_begin_suppress + (g->p.n_allowed ? (size_t)e->V : 0) +
            (g->p.timestamp_begin > 0 ? 3 * (size_t)e->V + 1 : 0);
  }
  if (need <= (size_t)sm->cap_bans) return TD_OK;
  int32_t *h = realloc(sm->h_bans, sizeof(int32_t) * need);
  if (!h) return td_err(TD_ERR_NOMEM, "engine bans: out of memory");
  sm->h_bans = h;
  td_free(e->b, sm->d_bans);
  sm->d_bans = NULL;
  TD_TRY(td_alloc(e->b, TD_BUF_I32, need, (void **)&sm->d_bans));
  sm->cap_bans = (int)need;
  return TD_OK;
}

td_status eng_sample(td_engine *e, float *logits) {
  const eng_batch *bt = e->bt;
  eng_sampler *sm = &e->smp;
  int n_rows = bt->n_rows, n_samp = bt->n_samp, k = bt->k;
  TD_TRY(reserve_bans(e));
  /* the k-th copy of a forking prompt row is sample k */
  int n_bans = 0;
  for (int r = 0; r < n_rows; r++) {
    group *g = bt->ouse[r].g;
    int stream = !g->forked && !g->beam ? r - g->row0 : g->s[bt->ouse[r].seq]->stream;
    const seq *sq = g->s[bt->ouse[r].seq];
    sm->h_rows[r] = make_row(e, g, sq, stream, &n_bans);
    if (g->p.timestamp_begin > 0 && sm->h_rows[r].forced < 0) {
      TD_TRY(ts_bans(e, g, sq, logits + (size_t)r * e->V, sm->h_rows[r].ban_start, &n_bans));
      sm->h_rows[r].ban_count = n_bans - sm->h_rows[r].ban_start;
    }
  }
  TD_TRY(td_copy_h2d(e->b, sm->d_rows, sm->h_rows, sizeof(td_sample_row) * (size_t)n_rows));
  if (n_bans) TD_TRY(td_copy_h2d(e->b, sm->d_bans, sm->h_bans, sizeof(int32_t) * (size_t)n_bans));
  if (n_samp) {
    TD_TRY(td_sample(e->b, logits, n_samp, e->V, sm->d_rows, sm->d_bans, sm->d_tok, sm->d_lp));
    TD_TRY(td_copy_d2h(e->b, sm->h_tok, sm->d_tok, sizeof(int32_t) * (size_t)n_samp));
    TD_TRY(td_copy_d2h(e->b, sm->h_lp, sm->d_lp, sizeof(float) * (size_t)n_samp));
  }
  int n_beam_rows = n_rows - n_samp;
  if (n_beam_rows) {
    TD_TRY(td_topk_logprobs(e->b, logits + (size_t)n_samp * e->V, n_beam_rows, e->V, sm->d_rows + n_samp,
                            sm->d_bans, k, sm->d_ids, sm->d_vals));
    TD_TRY(td_copy_d2h(e->b, sm->h_ids, sm->d_ids, sizeof(int32_t) * (size_t)n_beam_rows * k));
    TD_TRY(td_copy_d2h(e->b, sm->h_vals, sm->d_vals, sizeof(float) * (size_t)n_beam_rows * k));
  }
  return td_sync(e->b);
}
