/* Building a decoder step (in-flight batching): running groups in order,
 * each with a chunk of its sequences' uncomputed tokens under the step's
 * token, sequence and logit-row budgets; blocks grown for the chunk
 * (copy-on-write of a shared last block), and when blocks run short the
 * newest running requests are preempted by recompute. */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/internal.h"

td_status eng_batch_init(td_engine *e, eng_batch *bt) {
  size_t T = (size_t)e->o.max_step_tokens, S = (size_t)e->o.max_running, R = (size_t)e->max_rows;
  bt->tok = malloc(sizeof(int32_t) * T);
  bt->pos = malloc(sizeof(int32_t) * T);
  bt->slots = malloc(sizeof(int32_t) * T);
  bt->qs = malloc(sizeof(int32_t) * (S + 1));
  bt->ctx = malloc(sizeof(int32_t) * S);
  bt->clen = malloc(sizeof(int32_t) * S);
  bt->tab = malloc(sizeof(int32_t) * S * (size_t)e->self_stride);
  bt->ctab = malloc(sizeof(int32_t) * S * (size_t)e->cross_stride);
  bt->chunks = malloc(sizeof(int) * S);
  bt->sched = malloc(sizeof(group *) * S);
  bt->rows = malloc(sizeof(int32_t) * R);
  bt->extra_rows = malloc(sizeof(int32_t) * R);
  bt->ordered = malloc(sizeof(int32_t) * R);
  bt->use = malloc(sizeof(row_use) * R);
  bt->ouse = malloc(sizeof(row_use) * R);
  bt->extra_group = malloc(sizeof(group *) * R);
  if (!bt->tok || !bt->pos || !bt->slots || !bt->qs || !bt->ctx || !bt->clen || !bt->tab || !bt->ctab ||
      !bt->chunks || !bt->sched || !bt->rows || !bt->extra_rows || !bt->ordered || !bt->use || !bt->ouse ||
      !bt->extra_group)
    return td_err(TD_ERR_NOMEM, "engine buffers: out of memory");
  return TD_OK;
}

void eng_batch_free(eng_batch *bt) {
  void *p[] = {bt->tok, bt->pos, bt->slots, bt->qs, bt->ctx, bt->clen, bt->tab, bt->ctab,
               bt->chunks, bt->sched, bt->rows, bt->extra_rows, bt->ordered, bt->use, bt->ouse, bt->extra_group};
  for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) free(p[i]);
  memset(bt, 0, sizeof *bt);
}

/* Frees a group's self KV so it recomputes later (and its cross KV when so
 * configured, which sends it back to the encoder queue; short of memory for
 * that, it keeps its cross KV and stays running). */
static void preempt(td_engine *e, group *g) {
  for (int i = 0; i < g->n_s; i++) eng_seq_release_blocks(e, g->s[i]);
  e->st.preemptions++;
  if (e->o.recompute_cross && (g->input || g->features) && td_ptrvec_insert(&e->wait, 0, g) == TD_OK) {
    td_kv_unref_all(e->cross, g->cross.v, g->cross.n);
    g->cross.n = 0;
    td_ptrvec_remove(&e->run, g);
    g->state = G_WAITING;
  }
  TD_DEBUG("preempted request %s", g->id);
}

/* Blocks a sequence needs to hold positions [n_computed, n_computed + chunk). */
static int seq_block_need(td_engine *e, const seq *s, int chunk) {
  int need = eng_blocks_for(s->n_computed + chunk, e->bs) - s->blk.n;
  if (need < 0) need = 0;
  if (s->n_computed % e->bs && s->n_computed / e->bs < s->blk.n &&
      td_kv_refcount(e->self, s->blk.v[s->n_computed / e->bs]) > 1)
    need++;
  return need;
}

static td_status seq_grow(td_engine *e, seq *s, int chunk) {
  int first = s->n_computed / e->bs;
  if (s->n_computed % e->bs && first < s->blk.n) {
    bool copied;
    TD_TRY(td_kv_make_private(e->self, &s->blk.v[first], &copied));
  }
  int want = eng_blocks_for(s->n_computed + chunk, e->bs);
  if (want > s->blk.n) {
    TD_TRY(td_i32vec_reserve(&s->blk, want));
    TD_TRY(td_kv_alloc(e->self, want - s->blk.n, s->blk.v + s->blk.n));
    s->blk.n = want;
  }
  return TD_OK;
}

/* Rows needed from a group whose chunk completes: one per live sequence, or
 * `width` copies of the prompt row when it forks into samples. */
static int group_sample_rows(const group *g) { return !g->forked && !g->beam ? g->width : g->n_s; }

/* The probe's row has not run yet (it runs with the prompt, once, where the
 * request decodes: encoder and prefill work leaves it alone). */
static bool probe_pending(const group *g) {
  return g->p.probe && !g->probe_done && !g->forked && !g->prefill_only && !g->encode_only;
}

/* Plans chunk sizes for a group; returns false when it does not fit now.
 * A group alone in a step always fits: admission keeps its width within
 * the step's sequences, tokens and logit rows. */
static bool plan_group(td_engine *e, group *g, int tok_left, int seq_left, int row_left, int *chunks, bool *completes) {
  if (g->n_s > seq_left) return false;
  int total = 0;
  for (int i = 0; i < g->n_s; i++) total += g->s[i]->tok.n - g->s[i]->n_computed;
  if (g->prefill_only) {
    const seq *s = g->s[0];
    int rem = g->prefill_only - s->n_computed;
    chunks[0] = rem < tok_left ? rem : tok_left;
    *completes = false;
    return chunks[0] > 0;
  }
  if (g->n_s == 1) {
    const seq *s = g->s[0];
    int rem = s->tok.n - s->n_computed;
    int chunk = rem < tok_left ? rem : tok_left;
    if (g->p.all_logits && chunk > row_left - 1) chunk = row_left - 1;
    int pp = probe_pending(g) ? g->p.probe_position - s->n_computed : -1; /* in this chunk when >= 0 */
    /* a probe inside a completing chunk takes a row beside the sample rows:
     * short of rows, the chunk ends at the probe and the rest runs next step */
    if (pp >= 0 && pp < chunk - 1 && chunk == rem && group_sample_rows(g) + 1 > row_left) chunk = pp + 1;
    if (chunk <= 0) return false;
    chunks[0] = chunk;
    *completes = chunk == rem;
    int probe_rows = pp >= 0 && pp < chunk && !(*completes && pp == chunk - 1);
    if (*completes && group_sample_rows(g) + probe_rows > row_left - (g->p.all_logits ? chunk - 1 : 0)) return false;
    if (probe_rows > row_left) return false;
    return true;
  }
  if (total <= tok_left && g->n_s <= row_left) {
    for (int i = 0; i < g->n_s; i++) chunks[i] = g->s[i]->tok.n - g->s[i]->n_computed;
    *completes = true;
    return true;
  }
  /* Recomputing beams: catch up, leaving each one's last token for a step
   * that runs them all together. */
  int used = 0;
  bool any = false;
  for (int i = 0; i < g->n_s; i++) {
    int rem = g->s[i]->tok.n - g->s[i]->n_computed - 1;
    int c = rem < tok_left - used ? rem : tok_left - used;
    chunks[i] = c > 0 ? c : 0;
    used += chunks[i];
    any |= chunks[i] > 0;
  }
  *completes = false;
  return any;
}

/* Preempts the newest running groups after position gi that hold blocks
 * until `need` blocks are free; false when that is not enough. */
static bool make_room(td_engine *e, int gi, int need) {
  while (need > td_kv_pool_num_free(e->self)) {
    group *victim = NULL;
    for (int vi = e->run.n - 1; vi > gi && !victim; vi--) {
      group *v = e->run.v[vi];
      if (e->two_sets && v->set != e->cur) continue; /* the other set's step may be in flight */
      for (int i = 0; i < v->n_s && !victim; i++)
        if (v->s[i]->blk.n > 0) victim = v;
    }
    if (!victim) break;
    preempt(e, victim);
  }
  return need <= td_kv_pool_num_free(e->self);
}

/* Appends g's planned chunks to the batch: model input rows, block tables,
 * all_logits rows and, when the chunk completes, its sample rows. */
static td_status add_group(td_engine *e, group *g, bool completes) {
  eng_batch *bt = e->bt;
  const int *chunks = bt->chunks;
  int first_seq = bt->n_seq;
  for (int i = 0; i < g->n_s; i++) {
    seq *s = g->s[i];
    if (chunks[i] == 0) continue;
    TD_TRY(seq_grow(e, s, chunks[i]));
    for (int t = 0; t < chunks[i]; t++) {
      int p = s->n_computed + t;
      bt->tok[bt->n_tok + t] = s->tok.v[p];
      bt->pos[bt->n_tok + t] = p;
      bt->slots[bt->n_tok + t] = s->blk.v[p / e->bs] * e->bs + p % e->bs;
    }
    memcpy(bt->tab + (size_t)bt->n_seq * e->self_stride, s->blk.v, sizeof(int32_t) * (size_t)s->blk.n);
    bt->ctx[bt->n_seq] = s->n_computed + chunks[i];
    bt->clen[bt->n_seq] = g->enc_len;
    memcpy(bt->ctab + (size_t)bt->n_seq * e->cross_stride, g->cross.v, sizeof(int32_t) * (size_t)g->cross.n);
    int pp = probe_pending(g) ? g->p.probe_position - s->n_computed : -1;
    if (pp >= 0 && pp < chunks[i]) {
      if (completes && pp == chunks[i] - 1) {
        g->probe_x = -2; /* the sample row: its logits before sampling */
      } else {
        g->probe_x = bt->n_extra;
        bt->extra_rows[bt->n_extra] = bt->n_tok + pp;
        bt->extra_group[bt->n_extra++] = g;
      }
    }
    if (g->p.all_logits) {
      int keep = chunks[i] - (completes ? 1 : 0);
      for (int t = 0; t < keep; t++) {
        bt->extra_rows[bt->n_extra] = bt->n_tok + t;
        bt->extra_group[bt->n_extra++] = g;
      }
    }
    if (s->n_computed < g->n_prompt) e->st.prompt_tokens += chunks[i];
    bt->n_tok += chunks[i];
    bt->qs[++bt->n_seq] = bt->n_tok;
  }
  if (completes) {
    /* the last query row of each sequence; a prompt that forks into
     * samples repeats its row once per sample */
    int nr = group_sample_rows(g);
    for (int r = 0; r < nr; r++) {
      int si = nr == g->n_s ? r : 0;
      bt->rows[bt->n_rows + r] = bt->qs[first_seq + si + 1] - 1;
      bt->use[bt->n_rows + r] = (row_use){g, si};
    }
    bt->n_rows += nr;
    g->completes = true;
  }
  g->scheduled = true;
  for (int i = 0; i < g->n_s; i++) g->s[i]->n_computed += chunks[i];
  bt->sched[bt->n_sched++] = g;
  return TD_OK;
}

td_status eng_schedule(td_engine *e) {
  eng_batch *bt = e->bt;
  int T = e->o.max_step_tokens, S = e->o.max_running, R = e->max_rows;
  bt->n_tok = bt->n_seq = bt->n_rows = bt->n_extra = bt->n_sched = 0;
  bt->qs[0] = 0;
  /* each scheduled group adds at least one sequence, so n_sched <= S */
  for (int gi = 0; gi < e->run.n && bt->n_sched < S; gi++) {
    group *g = e->run.v[gi];
    if (e->two_sets && g->set != e->cur) continue;
    g->scheduled = g->completes = false;
    g->probe_x = -1;
    bool completes = false;
    if (!plan_group(e, g, T - bt->n_tok, S - bt->n_seq, R - bt->n_rows - bt->n_extra, bt->chunks, &completes)) break;
    int need = 0;
    for (int i = 0; i < g->n_s; i++) need += seq_block_need(e, g->s[i], bt->chunks[i]);
    /* Make room by preempting the newest running requests. */
    if (!make_room(e, gi, need)) {
      if (bt->n_sched == 0 && gi == 0 && e->run.n == 1) {
        eng_group_fail(e, g, TD_ERR_NO_BLOCKS, "the self-attention pool cannot hold this request");
        return TD_OK;
      }
      break;
    }
    TD_TRY(add_group(e, g, completes));
  }
  return TD_OK;
}
