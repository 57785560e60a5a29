/* The encoder phase of a step: waiting requests, first come first served,
 * get cross-attention blocks and one batched encoder run, then join the
 * running set (encode_only ones finish here and hand their blocks over).
 * Requests whose input the encoder cache holds share its blocks and skip
 * the run (enccache.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "engine/internal.h"

/* Moves the head of the queue into e->enc_batch while it fits: *n groups
 * (set on failure too), *tokens encoder tokens. A group whose input the
 * encoder cache holds shares its blocks and needs no encoder run. */
static td_status admit(td_engine *e, int *n, int *tokens) {
  int budget = e->o.max_enc_tokens, max_seqs = td_model_get_opts(e->m)->max_enc_seqs;
  *n = *tokens = 0;
  /* FIFO admission: the head waits rather than being overtaken. */
  int free_self = td_kv_pool_num_free(e->self);
  while (e->wait.n > 0 && *n < max_seqs) {
    group *g = e->wait.v[0];
    centry *hit = eng_cache_find(e, g);
    int need_cross = hit ? 0 : eng_blocks_for(g->enc_len, e->bs);
    int enc_tokens = hit ? 0 : g->enc_len;
    int need_self = 0;
    for (int i = 0; i < g->n_s && !g->encode_only; i++) need_self += eng_blocks_for(g->s[i]->tok.n + 1, e->bs);
    if (*tokens + enc_tokens > budget) break;
    if (need_self > free_self) break;
    /* Running requests keep first claim on self blocks when they are scarce. */
    if (!g->encode_only && e->run.n >= e->o.max_running) break;
    /* blocks only the cache holds go before any request waits for them */
    if (need_cross > td_kv_pool_num_free(e->cross)) td_engine_cache_reclaim(e, need_cross);
    if (need_cross > td_kv_pool_num_free(e->cross)) break;
    TD_TRY(td_i32vec_reserve(&g->cross, hit ? hit->n_blocks : need_cross));
    g->hit = hit != NULL;
    if (hit) {
      eng_cache_use(e, hit, g);
    } else {
      TD_TRY(td_kv_alloc(e->cross, need_cross, g->cross.v));
      g->cross.n = need_cross;
      /* cached now, so that the same input later in this batch shares it */
      eng_cache_insert(e, g);
    }
    free_self -= need_self;
    *tokens += enc_tokens;
    e->enc_batch[(*n)++] = g;
    td_ptrvec_remove(&e->wait, g);
  }
  return TD_OK;
}

/* Room for nb windows of nf floats: the page-locked stage (made at the
 * first run, as large as the largest batch the encoder takes; tried once)
 * where it fits, else ordinary memory (the caller frees what is not the
 * stage). */
static float *feat_buffer(td_engine *e, size_t nf, int nb) {
  if (!e->feat_stage_tried) {
    e->feat_stage_tried = true;
    const td_model_opts *mo = td_model_get_opts(e->m);
    int enc_len = e->max_src > 0 ? e->max_src : 1, seqs = e->o.max_enc_tokens / enc_len;
    if (seqs > mo->max_enc_seqs) seqs = mo->max_enc_seqs;
    if (seqs < 1) seqs = 1;
    void *p = NULL;
    if (td_host_alloc(e->b, sizeof(float) * nf * (size_t)seqs, &p) == TD_OK) {
      e->feat_stage = p;
      e->feat_stage_n = nf * (size_t)seqs;
    }
  }
  size_t n = nf * (size_t)nb;
  if (e->feat_stage && n <= e->feat_stage_n) return e->feat_stage;
  return malloc(sizeof(float) * n);
}

/* One encoder run over the batch's groups that missed the cache, each
 * sequence's output into its cross blocks. */
static td_status encode(td_engine *e, group **all, int n_all, int tokens) {
  group **batch = malloc(sizeof(group *) * (size_t)n_all);
  if (!batch) return td_err(TD_ERR_NOMEM, "encode batch: out of memory");
  int nb = 0;
  for (int i = 0; i < n_all; i++)
    if (!all[i]->hit) batch[nb++] = all[i];
  if (nb == 0) {
    free(batch);
    return TD_OK;
  }
  bool whisper = e->cfg->family == TD_FAMILY_WHISPER;
  int32_t *lens = malloc(sizeof(int32_t) * (size_t)nb);
  int32_t *toks = malloc(sizeof(int32_t) * (size_t)(tokens + 1));
  int32_t *slots = malloc(sizeof(int32_t) * (size_t)tokens);
  size_t nf = whisper ? (size_t)e->cfg->num_mel_bins * td_model_input_frames(e->m) : 0;
  float *feats = whisper ? feat_buffer(e, nf, nb) : NULL;
  td_status s = TD_OK;
  if (!lens || !toks || !slots || (whisper && !feats)) {
    s = td_err(TD_ERR_NOMEM, "encode batch: out of memory");
  } else {
    int k = 0;
    for (int i = 0; i < nb; i++) {
      group *g = batch[i];
      lens[i] = g->n_input;
      if (whisper)
        memcpy(feats + nf * (size_t)i, g->features, sizeof(float) * nf);
      else
        memcpy(toks + k, g->input, sizeof(int32_t) * (size_t)g->n_input);
      eng_cross_slots(g->cross.v, g->enc_len, e->bs, slots + k);
      k += g->enc_len;
    }
    td_encode_input in = {.n_seqs = nb, .lens = lens, .tokens = toks, .features = feats, .cross_slots = slots};
    int64_t t0 = td_now_ns();
    s = td_model_encode(e->m, &in, NULL);
    e->st.encode_runs++;
    /* timed: wait for the device (the next step would wait for it anyway) */
    if (s == TD_OK && e->o.time_encoder) s = td_sync(e->b);
    if (s == TD_OK && e->o.time_encoder) e->st.encode_ms += (double)(td_now_ns() - t0) / 1e6;
  }
  free(lens);
  free(toks);
  free(slots);
  if (feats != e->feat_stage) free(feats);
  free(batch);
  return s;
}

/* Two running sets: the sequences each holds. */
static void set_sizes(const td_engine *e, int n[2]) {
  n[0] = n[1] = 0;
  for (int i = 0; i < e->run.n; i++) {
    const group *g = e->run.v[i];
    n[g->set & 1] += g->n_s > 0 ? g->n_s : 1;
  }
}

int eng_pick_set(const td_engine *e) {
  if (!e->two_sets) return 0;
  int n[2];
  set_sizes(e, n);
  return n[e->cur] <= n[1 - e->cur] ? e->cur : 1 - e->cur;
}

/* Two running sets: put the encoder run off while both sets run and few
 * wait, up to opts.encode_defer_steps steps (each run drains the pipeline:
 * a run a step for one or two arrivals kept the stages idle). */
static bool defer_encode(td_engine *e) {
  if (!e->two_sets || e->wait.n == 0 || e->o.encode_defer_steps < 0 || e->enc_deferred >= e->o.encode_defer_steps)
    return false;
  if (e->wait.n >= (td_model_get_opts(e->m)->max_enc_seqs + 1) / 2) return false;
  int n[2];
  set_sizes(e, n);
  return n[0] > 0 && n[1] > 0;
}

td_status eng_encode_phase(td_engine *e) {
  if (defer_encode(e)) {
    e->enc_deferred++;
    return TD_OK;
  }
  e->enc_deferred = 0;
  int nb, tokens;
  td_status as = admit(e, &nb, &tokens); /* failing, the engine fails */
  td_status s = as == TD_OK && nb ? encode(e, e->enc_batch, nb, tokens) : as;
  char msg[1024] = "";
  if (s != TD_OK) snprintf(msg, sizeof msg, "%s", td_errmsg());
  for (int i = 0; i < nb; i++) {
    group *g = e->enc_batch[i];
    if (s != TD_OK) { /* in no queue now: group_finish finds it in the handle table only */
      eng_cache_forget(e, g); /* its blocks hold no encoder output */
      eng_group_fail(e, g, s, msg);
      continue;
    }
    if (!g->hit) e->st.encodes++;
    if (g->encode_only) {
      eng_group_finish(e, g, TD_OK, NULL, TD_FINISH_STOP);
      continue;
    }
    g->state = G_RUNNING;
    g->set = eng_pick_set(e);
    if (!e->o.recompute_cross) { /* the cross KV is what the decoder needs now */
      eng_release_features(e, g);
    }
    if (td_ptrvec_insert(&e->run, e->run.n, g) != TD_OK) {
      eng_group_fail(e, g, TD_ERR_NOMEM, "out of memory");
      continue;
    }
  }
  return as == TD_OK ? TD_OK : td_err(as, "%s", msg);
}
