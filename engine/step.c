/* One iteration: the encoder phase, then one decoder step over the batch
 * that schedule.c builds: the model run, all_logits kept, sampling, and
 * each group's results applied (tokens appended, samples forked, beams
 * advanced, finished requests reported). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/internal.h"

/* The logit rows the model returns: sampled rows first, then beam rows,
 * then the all_logits rows; the beam rows' top-k width. A group's rows
 * stay together (add_group adds them in a run), so each group's first row
 * is where its run starts. */
static void order_rows(td_engine *e) {
  eng_batch *bt = e->bt;
  int w = 0;
  bt->n_samp = 0;
  for (int pass = 0; pass < 2; pass++)
    for (int r = 0; r < bt->n_rows; r++)
      if (bt->use[r].g->beam == (pass == 1)) {
        if (w == 0 || bt->ouse[w - 1].g != bt->use[r].g) bt->use[r].g->row0 = w;
        bt->ordered[w] = bt->rows[r];
        bt->ouse[w] = bt->use[r];
        w++;
        bt->n_samp += pass == 0;
      }
  for (int i = 0; i < bt->n_extra; i++) bt->ordered[w + i] = bt->extra_rows[i];
  bt->k = 0;
  for (int r = bt->n_samp; r < bt->n_rows; r++) {
    int want = 2 * bt->ouse[r].g->width;
    bt->k = want > bt->k ? want : bt->k;
  }
}

/* The model's input for the step in bt. */
static td_step_input step_input(const td_engine *e, const eng_batch *bt) {
  return (td_step_input){.n_seqs = bt->n_seq, .n_tokens = bt->n_tok, .tokens = bt->tok, .positions = bt->pos,
                         .q_start = bt->qs, .ctx_len = bt->ctx, .slots = bt->slots, .block_table = bt->tab,
                         .block_stride = e->self_stride, .cross_len = bt->clen, .cross_table = bt->ctab,
                         .cross_stride = e->cross_stride, .n_logits = bt->n_rows + bt->n_extra,
                         .logit_rows = bt->ordered};
}

static td_status run_model(td_engine *e, const float **logits) {
  td_step_input in = step_input(e, e->bt);
  td_status s = td_model_step(e->m, &in, logits);
  e->st.steps++;
  return s;
}

/* Downloads rows [first, first + n) of the logits into g's all_logits store. */
static td_status keep_logits(td_engine *e, group *g, const float *logits, int first, int n) {
  for (int r = 0; r < n; r++) {
    TD_TRY(td_download(e->b, TD_BUF_F32, logits + (size_t)(first + r) * e->V, e->smp.h_logits, (size_t)e->V));
    TD_TRY(td_f32vec_append(&g->logits, e->smp.h_logits, e->V));
    g->n_logit_rows++;
  }
  return TD_OK;
}

/* all_logits: prompt rows first (in order), then the sample row, before
 * sampling edits it. */
static td_status keep_all_logits(td_engine *e, const float *logits) {
  const eng_batch *bt = e->bt;
  for (int i = 0; i < bt->n_sched; i++) {
    group *g = bt->sched[i];
    if (!g->p.all_logits) continue;
    int first = -1, cnt = 0;
    for (int x = 0; x < bt->n_extra; x++)
      if (bt->extra_group[x] == g) {
        if (first < 0) first = bt->n_rows + x;
        cnt++;
      }
    if (cnt) TD_TRY(keep_logits(e, g, logits, first, cnt));
    if (g->completes) TD_TRY(keep_logits(e, g, logits, g->row0, 1));
  }
  return TD_OK;
}

/* Probes whose row ran this step: softmax of the raw row at the probe's token. */
static td_status keep_probes(td_engine *e, const float *logits) {
  const eng_batch *bt = e->bt;
  for (int i = 0; i < bt->n_sched; i++) {
    group *g = bt->sched[i];
    if (g->probe_x == -1) continue;
    int row = g->probe_x == -2 ? g->row0 : bt->n_rows + g->probe_x;
    float *x = e->smp.h_logits;
    TD_TRY(td_download(e->b, TD_BUF_F32, logits + (size_t)row * e->V, x, (size_t)e->V));
    double mx = -INFINITY, sum = 0.0;
    for (int j = 0; j < e->V; j++) mx = x[j] > mx ? x[j] : mx;
    for (int j = 0; j < e->V; j++) sum += exp((double)x[j] - mx);
    g->probe_prob = exp((double)x[g->p.probe_token] - mx) / sum;
    g->probe_done = true;
  }
  return TD_OK;
}

/* Appends token t to live sequence i; finishes it when a stop condition holds. */
static td_status sample_append(td_engine *e, group *g, int i, int32_t t, float lp) {
  seq *s = g->s[i];
  TD_TRY(td_i32vec_push(&s->tok, t));
  TD_TRY(td_f32vec_push(&s->lp, lp));
  s->sum_lp += lp;
  e->st.tokens_generated++;
  if (e->cb.on_token) e->cb.on_token(e->cb.ctx, g->handle, g->user, s->stream, t, lp);
  int gen = s->tok.n - g->n_prompt;
  td_finish f = eng_is_stop(e, g, t) ? TD_FINISH_STOP : gen >= g->max_new ? TD_FINISH_LENGTH : TD_FINISH_NONE;
  if (f != TD_FINISH_NONE) {
    s->finish = f;
    eng_seq_release_blocks(e, s);
    g->done[g->n_done++] = s;
    memmove(g->s + i, g->s + i + 1, sizeof *g->s * (size_t)(g->n_s - i - 1));
    g->n_s--;
  }
  return TD_OK;
}

/* A prompt done: its one sequence splits into `width` samples, whose first
 * tokens are rows [first, first + width). */
static td_status fork_samples(td_engine *e, group *g, int first) {
  const eng_sampler *sm = &e->smp;
  td_status gs = TD_OK;
  seq *parent = g->s[0];
  g->n_s = 0;
  for (int r = 0; r < g->width && gs == TD_OK; r++) {
    seq *child = NULL;
    float lp = sm->h_lp[first + r];
    gs = eng_seq_fork(e, parent, sm->h_tok[first + r], lp, r, &child);
    if (gs != TD_OK) break;
    /* eng_seq_fork appended; undo so sample_append handles stops uniformly */
    child->tok.n--;
    child->lp.n--;
    child->sum_lp -= lp;
    g->s[g->n_s++] = child;
  }
  eng_seq_free(e, parent);
  g->forked = true;
  for (int r = g->width - 1; r >= 0 && gs == TD_OK; r--)
    gs = sample_append(e, g, r, sm->h_tok[first + r], sm->h_lp[first + r]);
  return gs;
}

/* The step's results for one scheduled group; finishes it when done. */
static void apply_group(td_engine *e, group *g) {
  const eng_batch *bt = e->bt;
  const eng_sampler *sm = &e->smp;
  if (g->prefill_only && g->s[0]->n_computed >= g->prefill_only) {
    eng_group_finish(e, g, TD_OK, NULL, TD_FINISH_STOP);
    return;
  }
  if (!g->completes) return;
  td_status gs = TD_OK;
  bool done = false;
  int first = g->row0;
  if (g->beam) {
    size_t at = (size_t)(first - bt->n_samp) * bt->k;
    gs = eng_beam_step(e, g, sm->h_ids + at, sm->h_vals + at, bt->k, &done);
  } else if (!g->forked && g->width > 1) {
    gs = fork_samples(e, g, first);
    done = g->n_s == 0;
  } else {
    g->forked = true;
    for (int r = g->n_s - 1; r >= 0 && gs == TD_OK; r--)
      gs = sample_append(e, g, r, sm->h_tok[first + r], sm->h_lp[first + r]);
    done = g->n_s == 0;
  }
  if (gs != TD_OK)
    eng_group_fail(e, g, gs, td_errmsg());
  else if (done)
    eng_group_finish(e, g, TD_OK, NULL, TD_FINISH_STOP);
}

/* A step's logits, sampled and applied to its groups; a failure fails them and the engine goes on. */
static void finish_step(td_engine *e, float *logits, td_status s) {
  eng_batch *bt = e->bt;
  if (s == TD_OK) s = keep_all_logits(e, logits);
  if (s == TD_OK) s = keep_probes(e, logits);
  if (s == TD_OK && bt->n_rows) s = eng_sample(e, logits);
  if (s != TD_OK) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", td_errmsg());
    for (int i = 0; i < bt->n_sched; i++) eng_group_fail(e, bt->sched[i], s, msg);
    return;
  }
  for (int i = 0; i < bt->n_sched; i++) {
    group *g = bt->sched[i];
    if (g->cancel_pending)
      eng_group_finish(e, g, TD_ERR_CANCELLED, "cancelled", TD_FINISH_CANCELLED);
    else
      apply_group(e, g);
  }
}

/* Two running sets: the current set's step is launched into the pipeline,
 * then the other set's logits (launched a step ago) are collected and
 * applied while the later stages run the current one. */
static td_status step_two_sets(td_engine *e) {
  TD_TRY(eng_encode_phase(e)); /* the model posts a launched set's logits receive first */
  int cur = e->cur, other = 1 - cur;
  eng_batch *mine = cur ? &e->batch1 : &e->batch, *theirs = other ? &e->batch1 : &e->batch;
  e->bt = mine;
  mine->n_tok = mine->n_sched = mine->n_rows = mine->n_extra = 0;
  if (e->run.n) TD_TRY(eng_schedule(e));
  bool launched = false;
  if (mine->n_tok) {
    order_rows(e);
    td_step_input in = step_input(e, mine);
    td_status s = td_model_step_launch(e->m, &in, cur);
    e->st.steps++;
    if (s != TD_OK) {
      finish_step(e, NULL, s);
    } else if (in.n_logits == 0) {
      finish_step(e, NULL, TD_OK); /* nothing to sample: prompt chunks only */
    } else {
      launched = true;
    }
  }
  if (e->out[other]) {
    e->out[other] = false;
    e->bt = theirs;
    const float *lg = NULL;
    td_status s = td_model_step_collect(e->m, other, &lg);
    finish_step(e, (float *)lg, s);
  }
  e->out[cur] = launched;
  e->bt = &e->batch;
  e->cur = other;
  return TD_OK;
}

td_status td_engine_step(td_engine *e) {
  if (e->two_sets) return step_two_sets(e);
  TD_TRY(eng_encode_phase(e));
  if (e->run.n == 0) return TD_OK;
  TD_TRY(eng_schedule(e));
  eng_batch *bt = e->bt;
  if (bt->n_tok == 0) return TD_OK;
  order_rows(e);
  const float *lg = NULL;
  td_status s = run_model(e, &lg);
  finish_step(e, (float *)lg, s); /* sampling processes the rows in place; a failure fails the step's requests */
  return TD_OK;
}
