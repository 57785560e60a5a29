/* Sequences and groups (a request's sequences): forking, giving blocks
 * back, and the final report through on_finish, which hands encode_only /
 * prefill_only blocks over to the caller. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/internal.h"

void eng_seq_free(td_engine *e, seq *s) {
  if (!s) return;
  td_kv_unref_all(e->self, s->blk.v, s->blk.n);
  td_i32vec_free(&s->tok);
  td_i32vec_free(&s->blk);
  td_f32vec_free(&s->lp);
  free(s);
}

void eng_seq_release_blocks(td_engine *e, seq *s) {
  td_kv_unref_all(e->self, s->blk.v, s->blk.n);
  s->blk.n = 0;
  s->n_computed = 0;
}

td_status eng_seq_fork(td_engine *e, const seq *parent, int32_t tok, float lp, int stream, seq **out) {
  seq *s = calloc(1, sizeof *s);
  if (!s) return td_err(TD_ERR_NOMEM, "out of memory");
  td_status st = td_i32vec_assign(&s->tok, parent->tok.v, parent->tok.n);
  if (st == TD_OK) st = td_i32vec_push(&s->tok, tok);
  if (st == TD_OK) st = td_i32vec_assign(&s->blk, parent->blk.v, parent->blk.n);
  if (st == TD_OK) st = td_f32vec_append(&s->lp, parent->lp.v, parent->lp.n);
  if (st == TD_OK) st = td_f32vec_push(&s->lp, lp);
  if (st != TD_OK) {
    s->blk.n = 0; /* no reference taken yet */
    eng_seq_free(e, s);
    return st;
  }
  for (int i = 0; i < s->blk.n; i++) (void)td_kv_ref(e->self, s->blk.v[i]);
  s->n_computed = parent->n_computed;
  s->sum_lp = parent->sum_lp + lp;
  s->stream = stream;
  *out = s;
  return TD_OK;
}

void eng_group_free(td_engine *e, group *g) {
  if (!g) return;
  for (int i = 0; i < g->n_s; i++) eng_seq_free(e, g->s[i]);
  for (int i = 0; i < g->n_done; i++) eng_seq_free(e, g->done[i]);
  for (int i = 0; i < g->n_hyps; i++) {
    free(g->hyps[i].tok);
    free(g->hyps[i].lp);
  }
  td_kv_unref_all(e->cross, g->cross.v, g->cross.n);
  td_i32vec_free(&g->cross);
  free(g->s);
  free(g->done);
  free(g->hyps);
  td_f32vec_free(&g->logits);
  free(g->id);
  free(g->stop_ids);
  free(g->allowed);
  free(g->input);
  eng_release_features(e, g);
  free(g->prompt);
  free(g);
}

bool eng_is_stop(const td_engine *e, const group *g, int32_t t) {
  if (!g->p.ignore_eos && td_gen_is_eos(e->gen, t)) return true;
  for (int i = 0; i < g->p.n_stop_ids; i++)
    if (g->stop_ids[i] == t) return true;
  return false;
}

static int cmp_seq_logprob(const void *a, const void *b) {
  const seq *x = *(seq *const *)a, *y = *(seq *const *)b;
  return x->sum_lp > y->sum_lp ? -1 : x->sum_lp < y->sum_lp;
}

/* Finished samples as outputs, most likely first (outs holds n_done). */
static int sample_outputs(group *g, td_seq_output *outs) {
  qsort(g->done, (size_t)g->n_done, sizeof *g->done, cmp_seq_logprob);
  for (int i = 0; i < g->n_done; i++) {
    const seq *s = g->done[i];
    outs[i] = (td_seq_output){.tokens = s->tok.v + g->n_prompt, .n_tokens = s->tok.n - g->n_prompt,
                              .logprobs = g->p.logprobs ? s->lp.v : NULL, .score = s->sum_lp,
                              .cum_logprob = s->sum_lp, .finish = s->finish};
  }
  return g->n_done;
}

void eng_group_finish(td_engine *e, group *g, td_status status, const char *error, td_finish why) {
  td_ptrvec_remove(&e->wait, g);
  td_ptrvec_remove(&e->run, g);
  HASH_DEL(e->by_handle, g);
  td_seq_output *outs = NULL;
  int n = 0;
  if (status == TD_OK && why != TD_FINISH_CANCELLED) {
    outs = calloc((size_t)(g->beam ? g->n_hyps : g->n_done) + 1, sizeof *outs);
    if (!outs) {
      status = TD_ERR_NOMEM;
      error = "out of memory";
    } else {
      n = g->beam ? eng_beam_outputs(e, g, outs) : sample_outputs(g, outs);
      for (int i = 0; i < n && g->probe_done; i++) {
        outs[i].has_probe = true;
        outs[i].probe_prob = g->probe_prob;
      }
    }
  }
  td_result r = {.handle = g->handle, .id = g->id, .user = g->user, .status = status, .error = error,
                 .n_outputs = n, .outputs = outs, .logits = g->logits.v, .n_logit_rows = g->n_logit_rows};
  /* hand-over: the caller owns these references from now on */
  td_i32vec *give = NULL;
  int *ext = NULL;
  if (status == TD_OK && g->encode_only) {
    give = &g->cross;
    ext = e->ext_cross;
  } else if (status == TD_OK && g->prefill_only && g->n_s == 1) {
    give = &g->s[0]->blk;
    ext = e->ext_self;
  }
  if (give) {
    r.blocks = give->v;
    r.n_blocks = give->n;
    for (int i = 0; i < give->n; i++) ext[give->v[i]]++;
  }
  if (why == TD_FINISH_CANCELLED) r.status = TD_ERR_CANCELLED;
  if (e->cb.on_finish) e->cb.on_finish(e->cb.ctx, &r);
  if (give) give->n = 0;
  free(outs);
  eng_group_free(e, g);
}

void eng_group_fail(td_engine *e, group *g, td_status s, const char *msg) {
  TD_WARN("request %s failed: %s", g->id, msg);
  char buf[1024]; /* msg may be the thread's error, which on_finish may overwrite */
  snprintf(buf, sizeof buf, "%s", msg);
  eng_group_finish(e, g, s, buf, TD_FINISH_ERROR);
}
