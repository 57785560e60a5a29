/* Beam search as transformers runs it: candidates from the best 2 x beams
 * of each step's top-k log-probs, an EOS among the first `beams` candidates
 * finishes a hypothesis, hypotheses scored by sum / length^length_penalty,
 * and its three early-stopping rules. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/internal.h"

/* Adds a finished hypothesis (parent's tokens, plus t when t >= 0), keeping
 * the best `width`. */
static td_status add_hyp(group *g, const seq *parent, int n_prompt, int32_t t, float lp, double sum, int gen_len) {
  double score = sum / pow((double)gen_len, (double)g->p.length_penalty);
  if (g->n_hyps == g->width) {
    int worst = 0;
    for (int i = 1; i < g->n_hyps; i++)
      if (g->hyps[i].score < g->hyps[worst].score) worst = i;
    if (score <= g->hyps[worst].score) return TD_OK;
    free(g->hyps[worst].tok);
    free(g->hyps[worst].lp);
    g->hyps[worst] = g->hyps[--g->n_hyps];
  }
  int ng = parent->tok.n - n_prompt;
  int n = ng + (t >= 0 ? 1 : 0);
  hyp h = {.tok = malloc(sizeof(int32_t) * (size_t)(n + 1)), .lp = malloc(sizeof(float) * (size_t)(n + 1)), .n = n,
           .score = score, .sum_lp = sum};
  if (!h.tok || !h.lp) {
    free(h.tok);
    free(h.lp);
    return td_err(TD_ERR_NOMEM, "out of memory");
  }
  memcpy(h.tok, parent->tok.v + n_prompt, sizeof(int32_t) * (size_t)ng);
  memcpy(h.lp, parent->lp.v, sizeof(float) * (size_t)ng);
  if (t >= 0) {
    h.tok[ng] = t;
    h.lp[ng] = lp;
  }
  g->hyps[g->n_hyps++] = h;
  return TD_OK;
}

typedef struct cand {
  double score;
  int beam;
  int32_t tok;
  float lp;
} cand;

static int cand_cmp(const void *a, const void *b) {
  const cand *x = a, *y = b;
  if (x->score != y->score) return x->score > y->score ? -1 : 1;
  if (x->beam != y->beam) return x->beam < y->beam ? -1 : 1;
  return x->tok < y->tok ? -1 : x->tok > y->tok;
}

/* Whether no running beam can beat the worst kept hypothesis any more. */
static bool beams_done(const group *g, double best_running, int gen_len) {
  double worst = INFINITY;
  for (int i = 0; i < g->n_hyps; i++) worst = g->hyps[i].score < worst ? g->hyps[i].score : worst;
  double lpen = g->p.length_penalty;
  if (g->p.early_stopping == 1) return true;
  if (g->p.early_stopping == 0) return worst >= best_running / pow((double)gen_len, lpen);
  return worst >= best_running / pow((double)(lpen > 0 ? g->max_new : gen_len), lpen);
}

td_status eng_beam_step(td_engine *e, group *g, const int32_t *ids, const float *vals, int k, bool *done) {
  int B = g->width, m = g->n_s, n_next = 0;
  cand *c = malloc(sizeof *c * (size_t)m * k);
  seq **next = calloc((size_t)B + 1, sizeof *next); /* the forks, until g takes them */
  td_status st = TD_OK;
  if (!c || !next) {
    st = td_err(TD_ERR_NOMEM, "out of memory");
    goto out;
  }
  int nc = 0;
  for (int i = 0; i < m; i++)
    for (int j = 0; j < k; j++) {
      float lp = vals[(size_t)i * k + j];
      if (lp == -INFINITY) continue;
      c[nc++] = (cand){g->s[i]->sum_lp + lp, i, ids[(size_t)i * k + j], lp};
    }
  qsort(c, (size_t)nc, sizeof *c, cand_cmp);
  int gen_len = g->s[0]->tok.n - g->n_prompt + 1;
  for (int r = 0; r < nc && r < 2 * B && n_next < B; r++) {
    if (eng_is_stop(e, g, c[r].tok)) {
      if (r >= B) continue;
      st = add_hyp(g, g->s[c[r].beam], g->n_prompt, c[r].tok, c[r].lp, c[r].score, gen_len);
      if (st != TD_OK) goto out;
      continue;
    }
    st = eng_seq_fork(e, g->s[c[r].beam], c[r].tok, c[r].lp, n_next, &next[n_next]);
    if (st != TD_OK) goto out;
    n_next++;
    e->st.tokens_generated++;
  }
  double best_running = n_next ? next[0]->sum_lp : -INFINITY;
  for (int i = 0; i < m; i++) eng_seq_free(e, g->s[i]);
  for (int i = 0; i < n_next; i++) g->s[i] = next[i];
  g->n_s = n_next;
  n_next = 0;
  g->forked = true;
  bool finished = false;
  if (g->n_s == 0) {
    finished = true;
  } else if (gen_len >= g->max_new) {
    /* out of room: the running beams become hypotheses */
    for (int i = 0; i < g->n_s && st == TD_OK; i++)
      st = add_hyp(g, g->s[i], g->n_prompt, -1, 0.0f, g->s[i]->sum_lp, gen_len);
    finished = true;
  } else if (g->n_hyps >= B) {
    finished = beams_done(g, best_running, gen_len);
  }
  *done = finished;
out:
  for (int i = 0; i < n_next; i++) eng_seq_free(e, next[i]); /* failed before g took them */
  free(c);
  free(next);
  return st;
}

static int cmp_hyp(const void *a, const void *b) {
  const hyp *x = a, *y = b;
  return x->score > y->score ? -1 : x->score < y->score;
}

int eng_beam_outputs(const td_engine *e, group *g, td_seq_output *outs) {
  qsort(g->hyps, (size_t)g->n_hyps, sizeof *g->hyps, cmp_hyp);
  int want = g->p.num_return_sequences > 0 ? g->p.num_return_sequences : 1;
  int n = 0;
  for (int i = 0; i < g->n_hyps && n < want; i++, n++) {
    const hyp *h = &g->hyps[i];
    bool stop = h->n > 0 && eng_is_stop(e, g, h->tok[h->n - 1]);
    outs[n] = (td_seq_output){.tokens = h->tok, .n_tokens = h->n, .logprobs = g->p.logprobs ? h->lp : NULL,
                              .score = h->score, .cum_logprob = h->sum_lp,
                              .finish = stop ? TD_FINISH_STOP : TD_FINISH_LENGTH};
  }
  return n;
}
