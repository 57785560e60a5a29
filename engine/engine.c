#include "engine/engine.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <uthash.h>

#include "common/clock.h"
#include "common/log.h"

/* ------------------------------------------------------------ containers */

typedef struct i32vec {
  int32_t *v;
  int n, cap;
} i32vec;

static td_status i32_reserve(i32vec *a, int cap) {
  if (cap <= a->cap) return TD_OK;
  int nc = a->cap ? a->cap : 8;
  while (nc < cap) nc *= 2;
  int32_t *p = realloc(a->v, sizeof *p * (size_t)nc);
  if (!p) return td_err(TD_ERR_NOMEM, "out of memory");
  a->v = p;
  a->cap = nc;
  return TD_OK;
}

static td_status i32_push(i32vec *a, int32_t x) {
  TD_TRY(i32_reserve(a, a->n + 1));
  a->v[a->n++] = x;
  return TD_OK;
}

static td_status i32_copy(i32vec *dst, const int32_t *src, int n) {
  TD_TRY(i32_reserve(dst, n));
  if (n) memcpy(dst->v, src, sizeof *src * (size_t)n);
  dst->n = n;
  return TD_OK;
}

typedef struct f32vec {
  float *v;
  int n, cap;
} f32vec;

static td_status f32_push(f32vec *a, float x) {
  if (a->n == a->cap) {
    int nc = a->cap ? 2 * a->cap : 8;
    float *p = realloc(a->v, sizeof *p * (size_t)nc);
    if (!p) return td_err(TD_ERR_NOMEM, "out of memory");
    a->v = p;
    a->cap = nc;
  }
  a->v[a->n++] = x;
  return TD_OK;
}

/* ------------------------------------------------------------ state */

typedef struct seq {
  i32vec tok;     /* prompt + generated */
  i32vec blk;     /* self-attention blocks */
  f32vec lp;      /* per generated token */
  int n_computed; /* tokens whose KV is in the cache */
  double sum_lp;
  int stream;
  td_finish finish;
} seq;

typedef struct hyp {
  int32_t *tok; /* generated tokens */
  float *lp;
  int n;
  double score, sum_lp;
} hyp;

typedef enum gstate { G_WAITING, G_RUNNING } gstate;

typedef struct group {
  uint64_t handle;
  char *id;
  void *user;
  td_request_params p;
  int32_t *stop_ids;
  int32_t *input;
  int n_input;
  float *features;
  int enc_len;
  int32_t *prompt;
  int n_prompt;
  int max_new;
  int forced_bos, forced_eos;
  bool beam; /* beam search */
  int width; /* samples or beams */
  i32vec cross;
  seq **s; /* live sequences */
  int n_s;
  seq **done; /* finished samples */
  int n_done;
  hyp *hyps; /* finished beam hypotheses, at most width */
  int n_hyps;
  f32vec logits; /* all_logits */
  int n_logit_rows;
  gstate state;
  bool forked; /* prompt done and split into samples / beams */
  bool encode_only;
  int prefill_only;
  uint32_t step_offset;
  /* per step */
  bool scheduled, completes;
  UT_hash_handle hh;
} group;

/* What one logit row is for. */
typedef struct row_use {
  group *g;
  int seq;    /* index into g->s */
} row_use;

struct td_engine {
  td_model *m;
  td_backend *b;
  td_engine_opts o;
  td_engine_callbacks cb;
  td_kv_pool *self, *cross;
  int bs, V, max_src, max_tgt;
  int self_stride, cross_stride;
  const td_model_config *cfg;
  const td_gen_config *gen;
  uint64_t next_handle;
  group *by_handle;
  group **wait;
  int n_wait, cap_wait;
  group **run;
  int n_run, cap_run;
  /* step metadata (host) */
  int max_rows;
  int32_t *tok, *pos, *qs, *ctx, *slots, *tab, *clen, *ctab, *rows;
  row_use *use;
  int32_t *extra_rows; /* all_logits rows besides sample rows */
  group **extra_group;
  /* sampling buffers: backend and host */
  td_sample_row *d_rows, *h_rows;
  int32_t *d_bans, *h_bans;
  int cap_bans;
  int32_t *d_tok, *h_tok;
  float *d_lp, *h_lp;
  int32_t *d_ids, *h_ids;
  float *d_vals, *h_vals;
  int max_k;
  float *h_logits; /* downloaded rows for all_logits */
  int *ext_self, *ext_cross; /* references held by callers (handed-over blocks) */
  td_engine_stats st;
};

const char *td_finish_name(td_finish f) {
  switch (f) {
    case TD_FINISH_STOP: return "stop";
    case TD_FINISH_LENGTH: return "length";
    case TD_FINISH_CANCELLED: return "cancelled";
    case TD_FINISH_ERROR: return "error";
    default: return "none";
  }
}

void td_request_params_default(td_request_params *p) {
  memset(p, 0, sizeof *p);
  p->top_p = 1.0f;
  p->n = 1;
  p->num_beams = 1;
  p->num_return_sequences = 0;
  p->length_penalty = 1.0f;
  p->early_stopping = 0;
  p->forced_bos = -2;
  p->forced_eos = -2;
}

/* ------------------------------------------------------------ sequences */

static void seq_free(td_engine *e, seq *s) {
  if (!s) return;
  td_kv_unref_all(e->self, s->blk.v, s->blk.n);
  free(s->tok.v);
  free(s->blk.v);
  free(s->lp.v);
  free(s);
}

static void seq_release_blocks(td_engine *e, seq *s) {
  td_kv_unref_all(e->self, s->blk.v, s->blk.n);
  s->blk.n = 0;
  s->n_computed = 0;
}

/* A copy of parent sharing its blocks (copy-on-write), plus token tok. */
static td_status seq_fork(td_engine *e, const seq *parent, int32_t tok, float lp, int stream, seq **out) {
  seq *s = calloc(1, sizeof *s);
  if (!s) return td_err(TD_ERR_NOMEM, "out of memory");
  td_status st = i32_copy(&s->tok, parent->tok.v, parent->tok.n);
  if (st == TD_OK) st = i32_push(&s->tok, tok);
  if (st == TD_OK) st = i32_copy(&s->blk, parent->blk.v, parent->blk.n);
  for (int i = 0; st == TD_OK && i < parent->lp.n; i++) st = f32_push(&s->lp, parent->lp.v[i]);
  if (st == TD_OK) st = f32_push(&s->lp, lp);
  if (st != TD_OK) {
    free(s->tok.v);
    free(s->blk.v);
    free(s->lp.v);
    free(s);
    return st;
  }
  for (int i = 0; i < s->blk.n; i++) (void)td_kv_ref(e->self, s->blk.v[i]);
  s->n_computed = parent->n_computed;
  s->sum_lp = parent->sum_lp + lp;
  s->stream = stream;
  *out = s;
  return TD_OK;
}

/* ------------------------------------------------------------ groups */

static void group_free(td_engine *e, group *g) {
  if (!g) return;
  for (int i = 0; i < g->n_s; i++) seq_free(e, g->s[i]);
  for (int i = 0; i < g->n_done; i++) seq_free(e, g->done[i]);
  for (int i = 0; i < g->n_hyps; i++) {
    free(g->hyps[i].tok);
    free(g->hyps[i].lp);
  }
  td_kv_unref_all(e->cross, g->cross.v, g->cross.n);
  free(g->cross.v);
  free(g->s);
  free(g->done);
  free(g->hyps);
  free(g->logits.v);
  free(g->id);
  free(g->stop_ids);
  free(g->input);
  free(g->features);
  free(g->prompt);
  free(g);
}

static void list_remove(group **arr, int *n, group *g) {
  for (int i = 0; i < *n; i++)
    if (arr[i] == g) {
      memmove(arr + i, arr + i + 1, sizeof *arr * (size_t)(*n - i - 1));
      (*n)--;
      return;
    }
}

static td_status list_insert(group ***arr, int *n, int *cap, int at, group *g) {
  if (*n == *cap) {
    int nc = *cap ? 2 * *cap : 16;
    group **p = realloc(*arr, sizeof *p * (size_t)nc);
    if (!p) return td_err(TD_ERR_NOMEM, "out of memory");
    *arr = p;
    *cap = nc;
  }
  memmove(*arr + at + 1, *arr + at, sizeof **arr * (size_t)(*n - at));
  (*arr)[at] = g;
  (*n)++;
  return TD_OK;
}

static int cmp_seq_logprob(const void *a, const void *b) {
  const seq *x = *(seq *const *)a, *y = *(seq *const *)b;
  return x->sum_lp > y->sum_lp ? -1 : x->sum_lp < y->sum_lp;
}

static int cmp_hyp(const void *a, const void *b) {
  const hyp *x = a, *y = b;
  return x->score > y->score ? -1 : x->score < y->score;
}

/* Reports and frees a group that left the engine. */
static void group_finish(td_engine *e, group *g, td_status status, const char *error, td_finish why) {
  list_remove(e->wait, &e->n_wait, g);
  list_remove(e->run, &e->n_run, g);
  HASH_DEL(e->by_handle, g);
  td_seq_output outs[64];
  int n = 0;
  if (status == TD_OK && why != TD_FINISH_CANCELLED) {
    if (g->beam) {
      qsort(g->hyps, (size_t)g->n_hyps, sizeof *g->hyps, cmp_hyp);
      int want = g->p.num_return_sequences > 0 ? g->p.num_return_sequences : 1;
      for (int i = 0; i < g->n_hyps && n < want && n < 64; i++, n++) {
        const hyp *h = &g->hyps[i];
        bool stop = h->n > 0 && (td_gen_is_eos(e->gen, h->tok[h->n - 1]) && !g->p.ignore_eos);
        for (int k = 0; !stop && h->n > 0 && k < g->p.n_stop_ids; k++) stop = h->tok[h->n - 1] == g->stop_ids[k];
        outs[n] = (td_seq_output){.tokens = h->tok, .n_tokens = h->n, .logprobs = g->p.logprobs ? h->lp : NULL,
                                  .score = h->score, .cum_logprob = h->sum_lp,
                                  .finish = stop ? TD_FINISH_STOP : TD_FINISH_LENGTH};
      }
    } else {
      qsort(g->done, (size_t)g->n_done, sizeof *g->done, cmp_seq_logprob);
      for (int i = 0; i < g->n_done && n < 64; i++, n++) {
        const seq *s = g->done[i];
        outs[n] = (td_seq_output){.tokens = s->tok.v + g->n_prompt, .n_tokens = s->tok.n - g->n_prompt,
                                  .logprobs = g->p.logprobs ? s->lp.v : NULL, .score = s->sum_lp,
                                  .cum_logprob = s->sum_lp, .finish = s->finish};
      }
    }
  }
  td_result r = {.handle = g->handle, .id = g->id, .user = g->user, .status = status, .error = error,
                 .n_outputs = n, .outputs = outs, .logits = g->logits.v, .n_logit_rows = g->n_logit_rows};
  /* hand-over: the caller owns these references from now on */
  i32vec *give = NULL;
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
  group_free(e, g);
}

static void group_fail(td_engine *e, group *g, td_status s, const char *msg) {
  TD_WARN("request %s failed: %s", g->id, msg);
  char buf[1024];
  snprintf(buf, sizeof buf, "%s", msg);
  group_finish(e, g, s, buf, TD_FINISH_ERROR);
}

/* ------------------------------------------------------------ create */

static td_status copy_via_model(void *ctx, const int32_t *pairs, int n_pairs) {
  return td_model_copy_self_blocks(ctx, pairs, n_pairs);
}

void td_engine_default_blocks(const td_model *m, const td_engine_opts *o, int *self_blocks, int *cross_blocks) {
  const td_model_opts *mo = td_model_get_opts(m);
  int bs = mo->block_size;
  int run = o->max_running > 0 && o->max_running <= mo->max_seqs ? o->max_running : mo->max_seqs;
  int ss = (td_model_max_target_len(m) + bs - 1) / bs, cs = (td_model_max_source_len(m) + bs - 1) / bs;
  *self_blocks = o->self_blocks > 0 ? o->self_blocks : run * (ss + 1);
  *cross_blocks = o->cross_blocks > 0 ? o->cross_blocks : run * cs;
}

td_status td_engine_create(td_model *m, const td_engine_opts *opts, const td_engine_callbacks *cb, td_engine **out) {
  *out = NULL;
  td_engine *e = calloc(1, sizeof *e);
  if (!e) return td_err(TD_ERR_NOMEM, "out of memory");
  e->m = m;
  e->b = td_model_backend(m);
  e->o = *opts;
  if (cb) e->cb = *cb;
  e->cfg = td_model_get_config(m);
  e->gen = td_model_get_gen(m);
  const td_model_opts *mo = td_model_get_opts(m);
  e->bs = mo->block_size;
  e->V = e->cfg->vocab_size;
  e->max_src = td_model_max_source_len(m);
  e->max_tgt = td_model_max_target_len(m);
  e->self_stride = (e->max_tgt + e->bs - 1) / e->bs;
  e->cross_stride = (e->max_src + e->bs - 1) / e->bs;
  td_engine_opts *o = &e->o;
  if (o->max_running <= 0 || o->max_running > mo->max_seqs) o->max_running = mo->max_seqs;
  if (o->max_step_tokens <= 0 || o->max_step_tokens > mo->max_tokens) o->max_step_tokens = mo->max_tokens;
  if (o->max_enc_tokens <= 0 || o->max_enc_tokens > mo->max_enc_tokens) o->max_enc_tokens = mo->max_enc_tokens;
  if (o->max_queue <= 0) o->max_queue = 4096;
  td_engine_default_blocks(m, o, &o->self_blocks, &o->cross_blocks);
  e->max_rows = mo->max_logits;
  e->next_handle = 1;
  td_status s;
  td_kv_layout sl = td_model_self_layout(m), cl = td_model_cross_layout(m);
  s = td_kv_pool_create(e->b, &sl, o->self_blocks, &e->self);
  if (s == TD_OK) s = td_kv_pool_create(e->b, &cl, o->cross_blocks, &e->cross);
  if (s != TD_OK) goto fail;
  td_model_set_pools(m, td_kv_pool_memory(e->self), td_kv_pool_memory(e->cross));
  /* copy-on-write goes through the model, so that follower ranks copy too */
  td_kv_pool_set_copier(e->self, copy_via_model, m);
  e->ext_self = calloc((size_t)o->self_blocks, sizeof *e->ext_self);
  e->ext_cross = calloc((size_t)o->cross_blocks, sizeof *e->ext_cross);
  if (!e->ext_self || !e->ext_cross) {
    s = td_err(TD_ERR_NOMEM, "engine buffers: out of memory");
    goto fail;
  }
  int T = o->max_step_tokens, S = o->max_running, R = e->max_rows;
  e->tok = malloc(sizeof(int32_t) * (size_t)T);
  e->pos = malloc(sizeof(int32_t) * (size_t)T);
  e->slots = malloc(sizeof(int32_t) * (size_t)T);
  e->qs = malloc(sizeof(int32_t) * (size_t)(S + 1));
  e->ctx = malloc(sizeof(int32_t) * (size_t)S);
  e->clen = malloc(sizeof(int32_t) * (size_t)S);
  e->tab = malloc(sizeof(int32_t) * (size_t)S * e->self_stride);
  e->ctab = malloc(sizeof(int32_t) * (size_t)S * e->cross_stride);
  e->rows = malloc(sizeof(int32_t) * (size_t)R);
  e->use = malloc(sizeof *e->use * (size_t)R);
  e->extra_rows = malloc(sizeof(int32_t) * (size_t)R);
  e->extra_group = malloc(sizeof *e->extra_group * (size_t)R);
  e->h_rows = malloc(sizeof *e->h_rows * (size_t)R);
  e->h_tok = malloc(sizeof(int32_t) * (size_t)R);
  e->h_lp = malloc(sizeof(float) * (size_t)R);
  e->max_k = 2 * (S < 32 ? S : 32);
  if (e->max_k > e->V) e->max_k = e->V;
  e->h_ids = malloc(sizeof(int32_t) * (size_t)R * e->max_k);
  e->h_vals = malloc(sizeof(float) * (size_t)R * e->max_k);
  e->h_logits = malloc(sizeof(float) * (size_t)e->V);
  e->cap_bans = R * (1 + e->gen->n_suppress + e->gen->n_begin_suppress) + 1;
  e->h_bans = malloc(sizeof(int32_t) * (size_t)e->cap_bans);
  if (!e->tok || !e->pos || !e->slots || !e->qs || !e->ctx || !e->clen || !e->tab || !e->ctab || !e->rows ||
      !e->use || !e->extra_rows || !e->extra_group || !e->h_rows || !e->h_tok || !e->h_lp || !e->h_ids ||
      !e->h_vals || !e->h_logits || !e->h_bans) {
    s = td_err(TD_ERR_NOMEM, "engine buffers: out of memory");
    goto fail;
  }
  size_t row_words = (sizeof(td_sample_row) * (size_t)R + 3) / 4;
  s = td_alloc(e->b, TD_BUF_I32, row_words, (void **)&e->d_rows);
  if (s == TD_OK) s = td_alloc(e->b, TD_BUF_I32, (size_t)e->cap_bans, (void **)&e->d_bans);
  if (s == TD_OK) s = td_alloc(e->b, TD_BUF_I32, (size_t)R, (void **)&e->d_tok);
  if (s == TD_OK) s = td_alloc(e->b, TD_BUF_F32, (size_t)R, (void **)&e->d_lp);
  if (s == TD_OK) s = td_alloc(e->b, TD_BUF_I32, (size_t)R * e->max_k, (void **)&e->d_ids);
  if (s == TD_OK) s = td_alloc(e->b, TD_BUF_F32, (size_t)R * e->max_k, (void **)&e->d_vals);
  if (s != TD_OK) goto fail;
  *out = e;
  return TD_OK;
fail:
  td_engine_destroy(e);
  return s;
}

void td_engine_destroy(td_engine *e) {
  if (!e) return;
  while (e->n_run) group_finish(e, e->run[0], TD_ERR_CANCELLED, "engine shut down", TD_FINISH_CANCELLED);
  while (e->n_wait) group_finish(e, e->wait[0], TD_ERR_CANCELLED, "engine shut down", TD_FINISH_CANCELLED);
  if (e->m) td_model_set_pools(e->m, NULL, NULL);
  td_kv_pool_destroy(e->self);
  td_kv_pool_destroy(e->cross);
  void *hb[] = {e->tok, e->pos, e->slots, e->qs, e->ctx, e->clen, e->tab, e->ctab, e->rows, e->use,
                e->extra_rows, e->extra_group, e->h_rows, e->h_tok, e->h_lp, e->h_ids, e->h_vals, e->h_logits,
                e->h_bans, e->wait, e->run, e->ext_self, e->ext_cross};
  for (size_t i = 0; i < sizeof hb / sizeof hb[0]; i++) free(hb[i]);
  void *db[] = {e->d_rows, e->d_bans, e->d_tok, e->d_lp, e->d_ids, e->d_vals};
  for (size_t i = 0; i < sizeof db / sizeof db[0]; i++) td_free(e->b, db[i]);
  free(e);
}

/* ------------------------------------------------------------ add / cancel */

static int blocks_for(int tokens, int bs) { return (tokens + bs - 1) / bs; }

td_status td_engine_add(td_engine *e, const td_request *r, uint64_t *handle) {
  const td_model_config *c = e->cfg;
  const td_request_params *p = &r->params;
  const char *id = r->id ? r->id : "";
  bool whisper = c->family == TD_FAMILY_WHISPER;
  if (e->n_wait + e->n_run >= e->o.max_queue)
    return td_err(TD_ERR_OVERLOADED, "request %s: %d requests queued, the limit", id, e->o.max_queue);
  bool ext_cross = r->cross_blocks != NULL;
  if (ext_cross) {
    int want = blocks_for(r->enc_len, e->bs);
    if (r->enc_len <= 0 || r->enc_len > e->max_src || r->n_cross_blocks != want || r->encode_only)
      return td_err(TD_ERR_INVALID, "request %s: %d cross blocks for an encoder output of %d tokens", id,
                    r->n_cross_blocks, r->enc_len);
    for (int i = 0; i < r->n_cross_blocks; i++)
      if (td_kv_refcount(e->cross, r->cross_blocks[i]) <= 0)
        return td_err(TD_ERR_INVALID, "request %s: cross block %d is not allocated", id, r->cross_blocks[i]);
  } else if (whisper) {
    if (!r->features) return td_err(TD_ERR_INVALID, "request %s: Whisper needs input features", id);
  } else {
    if (!r->input_ids || r->n_input <= 0)
      return td_err(TD_ERR_INVALID, "request %s: empty encoder input", id);
    if (r->n_input > e->max_src)
      return td_err(TD_ERR_INVALID, "request %s: encoder input of %d tokens exceeds the model's %d", id, r->n_input,
                    e->max_src);
    for (int i = 0; i < r->n_input; i++)
      if (r->input_ids[i] < 0 || r->input_ids[i] >= c->vocab_size)
        return td_err(TD_ERR_INVALID, "request %s: input token %d (at %d) is outside the vocabulary of %d", id,
                      r->input_ids[i], i, c->vocab_size);
  }
  int n_prompt = r->n_prompt > 0 ? r->n_prompt : 1;
  if (n_prompt >= e->max_tgt)
    return td_err(TD_ERR_INVALID, "request %s: decoder prompt of %d tokens leaves no room in the model's %d positions",
                  id, n_prompt, e->max_tgt);
  for (int i = 0; i < r->n_prompt; i++)
    if (r->prompt[i] < 0 || r->prompt[i] >= c->vocab_size)
      return td_err(TD_ERR_INVALID, "request %s: decoder prompt token %d is outside the vocabulary of %d", id,
                    r->prompt[i], c->vocab_size);
  if (p->temperature < 0 || !isfinite(p->temperature) || p->top_p <= 0 || !(p->top_p <= 1.0f || p->top_p > 1.0f) ||
      p->top_k < 0)
    return td_err(TD_ERR_INVALID, "request %s: temperature must be >= 0, top_p in (0, 1], top_k >= 0", id);
  if (p->n < 1 || p->num_beams < 1 || p->n > e->o.max_running || p->num_beams > e->o.max_running ||
      p->num_beams > 32)
    return td_err(TD_ERR_INVALID, "request %s: n = %d and num_beams = %d must be between 1 and %d", id, p->n,
                  p->num_beams, e->o.max_running < 32 ? e->o.max_running : 32);
  bool beam = p->num_beams > 1;
  if (beam && (p->n > 1 || p->temperature > 0))
    return td_err(TD_ERR_UNSUPPORTED, "request %s: beam search with sampling (n or temperature) is not supported", id);
  int nret = p->num_return_sequences > 0 ? p->num_return_sequences : 1;
  if (beam && nret > p->num_beams)
    return td_err(TD_ERR_INVALID, "request %s: num_return_sequences %d exceeds num_beams %d", id, nret, p->num_beams);
  if (!beam && p->num_return_sequences > 1 && p->num_return_sequences != p->n)
    return td_err(TD_ERR_INVALID, "request %s: num_return_sequences needs num_beams > 1 (use n for samples)", id);
  if (p->all_logits && (beam || p->n > 1))
    return td_err(TD_ERR_INVALID, "request %s: all logits are kept for single greedy or sampled requests only", id);
  if (beam && 2 * p->num_beams > e->max_k)
    return td_err(TD_ERR_INVALID, "request %s: num_beams %d too large for this engine", id, p->num_beams);
  for (int i = 0; i < p->n_stop_ids; i++)
    if (p->stop_ids[i] < 0 || p->stop_ids[i] >= c->vocab_size)
      return td_err(TD_ERR_INVALID, "request %s: stop token %d is outside the vocabulary", id, p->stop_ids[i]);
  int forced_bos = p->forced_bos == -2 ? e->gen->forced_bos_token_id : p->forced_bos;
  int forced_eos = p->forced_eos == -2 ? e->gen->forced_eos_token_id : p->forced_eos;
  if (forced_bos >= c->vocab_size || forced_eos >= c->vocab_size)
    return td_err(TD_ERR_INVALID, "request %s: forced token outside the vocabulary", id);
  int room = e->max_tgt - n_prompt;
  int max_new = p->max_new_tokens;
  if (max_new <= 0) max_new = e->gen->max_length > n_prompt ? e->gen->max_length - n_prompt : room;
  if (max_new > room) {
    if (p->max_new_tokens > 0)
      return td_err(TD_ERR_INVALID, "request %s: prompt %d + max_new_tokens %d exceeds the model's %d positions", id,
                    n_prompt, p->max_new_tokens, e->max_tgt);
    max_new = room;
  }
  if (r->self_blocks) {
    if (r->n_computed <= 0 || r->n_computed >= n_prompt + (r->prefill_only ? 1 : 0) ||
        r->n_self_blocks != blocks_for(r->n_computed, e->bs))
      return td_err(TD_ERR_INVALID, "request %s: %d self blocks for %d computed prompt tokens", id, r->n_self_blocks,
                    r->n_computed);
    for (int i = 0; i < r->n_self_blocks; i++)
      if (td_kv_refcount(e->self, r->self_blocks[i]) <= 0)
        return td_err(TD_ERR_INVALID, "request %s: self block %d is not allocated", id, r->self_blocks[i]);
  }
  if (r->prefill_only && (r->prefill_only > n_prompt || beam || p->n > 1))
    return td_err(TD_ERR_INVALID, "request %s: prefill of %d tokens for a prompt of %d", id, r->prefill_only,
                  n_prompt);
  if (r->encode_only && (r->prefill_only || r->self_blocks))
    return td_err(TD_ERR_INVALID, "request %s: encode_only excludes other work", id);
  int enc_len = ext_cross ? r->enc_len : whisper ? e->max_src : r->n_input;
  int width = beam ? p->num_beams : p->n;
  int need_self = width * (blocks_for(n_prompt + max_new, e->bs) + 1);
  int need_cross = blocks_for(enc_len, e->bs);
  if ((!r->encode_only && need_self > e->o.self_blocks) || need_cross > e->o.cross_blocks)
    return td_err(TD_ERR_NO_BLOCKS,
                  "request %s needs up to %d self-attention and %d cross-attention blocks; the pools hold %d and %d", id,
                  need_self, need_cross, e->o.self_blocks, e->o.cross_blocks);
  if (!ext_cross && enc_len > e->o.max_enc_tokens)
    return td_err(TD_ERR_INVALID, "request %s: encoder input of %d tokens exceeds the %d per step", id, enc_len,
                  e->o.max_enc_tokens);

  group *g = calloc(1, sizeof *g);
  if (!g) return td_err(TD_ERR_NOMEM, "out of memory");
  td_status s = TD_OK;
  g->id = strdup(id);
  g->p = *p;
  g->user = r->user;
  g->beam = beam;
  g->width = width;
  g->max_new = max_new;
  g->forced_bos = forced_bos;
  g->forced_eos = forced_eos;
  g->enc_len = enc_len;
  g->n_prompt = n_prompt;
  g->encode_only = r->encode_only;
  g->prefill_only = r->prefill_only;
  g->step_offset = r->step_offset;
  g->prompt = malloc(sizeof(int32_t) * (size_t)n_prompt);
  g->stop_ids = malloc(sizeof(int32_t) * (size_t)(p->n_stop_ids + 1));
  g->s = calloc((size_t)width + 1, sizeof *g->s);
  g->done = calloc((size_t)width + 1, sizeof *g->done);
  g->hyps = calloc((size_t)width + 1, sizeof *g->hyps);
  if (!g->id || !g->prompt || !g->stop_ids || !g->s || !g->done || !g->hyps) {
    s = td_err(TD_ERR_NOMEM, "out of memory");
    goto fail;
  }
  if (r->n_prompt > 0)
    memcpy(g->prompt, r->prompt, sizeof(int32_t) * (size_t)n_prompt);
  else
    g->prompt[0] = e->gen->decoder_start_token_id;
  if (p->n_stop_ids) memcpy(g->stop_ids, p->stop_ids, sizeof(int32_t) * (size_t)p->n_stop_ids);
  g->p.stop_ids = NULL;
  if (!g->p.has_seed) g->p.seed = (uint64_t)td_now_ns() ^ ((uint64_t)e->next_handle << 32);
  if (ext_cross) {
    /* nothing to encode */
  } else if (whisper) {
    size_t nf = (size_t)c->num_mel_bins * td_model_input_frames(e->m);
    g->features = malloc(sizeof(float) * nf);
    if (!g->features) {
      s = td_err(TD_ERR_NOMEM, "out of memory");
      goto fail;
    }
    memcpy(g->features, r->features, sizeof(float) * nf);
  } else {
    g->input = malloc(sizeof(int32_t) * (size_t)r->n_input);
    if (!g->input) {
      s = td_err(TD_ERR_NOMEM, "out of memory");
      goto fail;
    }
    memcpy(g->input, r->input_ids, sizeof(int32_t) * (size_t)r->n_input);
    g->n_input = r->n_input;
  }
  seq *s0 = calloc(1, sizeof *s0);
  if (!s0 || i32_copy(&s0->tok, g->prompt, n_prompt) != TD_OK) {
    free(s0);
    s = td_err(TD_ERR_NOMEM, "out of memory");
    goto fail;
  }
  g->s[0] = s0;
  g->n_s = 1;
  if (r->self_blocks) {
    if (i32_copy(&s0->blk, r->self_blocks, r->n_self_blocks) != TD_OK) {
      s = td_err(TD_ERR_NOMEM, "out of memory");
      goto fail;
    }
    s0->n_computed = r->n_computed;
  }
  if (ext_cross && i32_copy(&g->cross, r->cross_blocks, r->n_cross_blocks) != TD_OK) {
    s0->blk.n = 0;
    s = td_err(TD_ERR_NOMEM, "out of memory");
    goto fail;
  }
  g->state = ext_cross ? G_RUNNING : G_WAITING;
  g->handle = e->next_handle++;
  if (ext_cross)
    s = list_insert(&e->run, &e->n_run, &e->cap_run, e->n_run, g);
  else
    s = list_insert(&e->wait, &e->n_wait, &e->cap_wait, e->n_wait, g);
  if (s != TD_OK) {
    /* the caller keeps its blocks */
    s0->blk.n = 0;
    g->cross.n = 0;
    goto fail;
  }
  HASH_ADD(hh, e->by_handle, handle, sizeof g->handle, g);
  *handle = g->handle;
  return TD_OK;
fail:
  group_free(e, g);
  return s;
}

td_status td_engine_cancel(td_engine *e, uint64_t handle) {
  group *g = NULL;
  HASH_FIND(hh, e->by_handle, &handle, sizeof handle, g);
  if (!g) return td_err(TD_ERR_NOT_FOUND, "no request with handle %llu", (unsigned long long)handle);
  group_finish(e, g, TD_ERR_CANCELLED, "cancelled", TD_FINISH_CANCELLED);
  return TD_OK;
}

bool td_engine_idle(const td_engine *e) { return e->n_wait == 0 && e->n_run == 0; }

td_engine_stats td_engine_get_stats(const td_engine *e) {
  td_engine_stats st = e->st;
  st.waiting = e->n_wait;
  st.running = e->n_run;
  st.self = td_kv_pool_get_stats(e->self);
  st.cross = td_kv_pool_get_stats(e->cross);
  return st;
}

/* ------------------------------------------------------------ encode */

static td_status encode_phase(td_engine *e) {
  int budget = e->o.max_enc_tokens, max_seqs = td_model_get_opts(e->m)->max_enc_seqs;
  group *batch[256];
  int nb = 0, tokens = 0;
  /* FIFO admission: the head waits rather than being overtaken. */
  int free_self = td_kv_pool_num_free(e->self);
  while (e->n_wait > 0 && nb < max_seqs && nb < 256) {
    group *g = e->wait[0];
    int need_cross = blocks_for(g->enc_len, e->bs);
    int need_self = 0;
    for (int i = 0; i < g->n_s && !g->encode_only; i++) need_self += blocks_for(g->s[i]->tok.n + 1, e->bs);
    if (tokens + g->enc_len > budget) break;
    if (need_cross > td_kv_pool_num_free(e->cross) || need_self > free_self) break;
    /* Running requests keep first claim on self blocks when they are scarce. */
    if (!g->encode_only && e->n_run >= e->o.max_running) break;
    TD_TRY(i32_reserve(&g->cross, need_cross));
    TD_TRY(td_kv_alloc(e->cross, need_cross, g->cross.v));
    g->cross.n = need_cross;
    free_self -= need_self;
    tokens += g->enc_len;
    batch[nb++] = g;
    list_remove(e->wait, &e->n_wait, g);
  }
  if (nb == 0) return TD_OK;
  bool whisper = e->cfg->family == TD_FAMILY_WHISPER;
  int32_t *lens = malloc(sizeof(int32_t) * (size_t)nb);
  int32_t *toks = malloc(sizeof(int32_t) * (size_t)(tokens + 1));
  int32_t *slots = malloc(sizeof(int32_t) * (size_t)tokens);
  size_t nf = whisper ? (size_t)e->cfg->num_mel_bins * td_model_input_frames(e->m) : 0;
  float *feats = whisper ? malloc(sizeof(float) * nf * (size_t)nb) : NULL;
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
      for (int t = 0; t < g->enc_len; t++) slots[k + t] = g->cross.v[t / e->bs] * e->bs + t % e->bs;
      k += g->enc_len;
    }
    td_encode_input in = {.n_seqs = nb, .lens = lens, .tokens = toks, .features = feats, .cross_slots = slots};
    s = td_model_encode(e->m, &in, NULL);
  }
  free(lens);
  free(toks);
  free(slots);
  free(feats);
  for (int i = 0; i < nb; i++) {
    group *g = batch[i];
    if (s != TD_OK) {
      /* put it back so group_finish finds it nowhere but the handle table */
      group_fail(e, g, s, td_errmsg());
      continue;
    }
    e->st.encodes++;
    if (g->encode_only) {
      group_finish(e, g, TD_OK, NULL, TD_FINISH_STOP);
      continue;
    }
    g->state = G_RUNNING;
    if (!e->o.recompute_cross) { /* the cross KV is what the decoder needs now */
      free(g->features);
      g->features = NULL;
    }
    if (list_insert(&e->run, &e->n_run, &e->cap_run, e->n_run, g) != TD_OK) {
      group_fail(e, g, TD_ERR_NOMEM, "out of memory");
      continue;
    }
  }
  return TD_OK;
}

/* ------------------------------------------------------------ schedule */

/* Frees a group's self KV so it recomputes later (and its cross KV when so
 * configured, which sends it back to the encoder queue). */
static void preempt(td_engine *e, group *g) {
  for (int i = 0; i < g->n_s; i++) seq_release_blocks(e, g->s[i]);
  e->st.preemptions++;
  if (e->o.recompute_cross && (g->input || g->features)) {
    td_kv_unref_all(e->cross, g->cross.v, g->cross.n);
    g->cross.n = 0;
    list_remove(e->run, &e->n_run, g);
    g->state = G_WAITING;
    (void)list_insert(&e->wait, &e->n_wait, &e->cap_wait, 0, g);
  }
  TD_DEBUG("preempted request %s", g->id);
}

/* Blocks a sequence needs to hold positions [n_computed, n_computed + chunk). */
static int seq_block_need(td_engine *e, const seq *s, int chunk) {
  int need = blocks_for(s->n_computed + chunk, e->bs) - s->blk.n;
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
  int want = blocks_for(s->n_computed + chunk, e->bs);
  if (want > s->blk.n) {
    TD_TRY(i32_reserve(&s->blk, want));
    TD_TRY(td_kv_alloc(e->self, want - s->blk.n, s->blk.v + s->blk.n));
    s->blk.n = want;
  }
  return TD_OK;
}

/* Rows needed from a group whose chunk completes: one per live sequence, or
 * `width` copies of the prompt row when it forks into samples. */
static int group_sample_rows(const group *g) { return !g->forked && !g->beam ? g->width : g->n_s; }

/* Plans chunk sizes for a group; returns false when it does not fit now. */
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
    if (chunk <= 0) return false;
    chunks[0] = chunk;
    *completes = chunk == rem;
    if (*completes && group_sample_rows(g) > row_left - (g->p.all_logits ? chunk - 1 : 0)) return false;
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

static td_sample_row make_row(td_engine *e, group *g, const seq *s, int stream, int *n_bans) {
  int k = s->tok.n - g->n_prompt; /* tokens generated so far by this attempt */
  int kk = k + (int)g->step_offset; /* ... and by earlier ones */
  td_sample_row r = {.temperature = g->p.temperature, .top_k = g->p.top_k, .top_p = g->p.top_p, .forced = -1,
                     .stream = (uint32_t)stream, .step = (uint32_t)kk, .seed = g->p.seed};
  if (k == 0 && g->n_prompt == 1 && g->forced_bos >= 0) r.forced = g->forced_bos;
  if (k == g->max_new - 1 && g->forced_eos >= 0) r.forced = g->forced_eos;
  r.ban_start = *n_bans;
  const td_gen_config *gen = e->gen;
  for (int i = 0; i < gen->n_suppress; i++) e->h_bans[(*n_bans)++] = gen->suppress[i];
  if (kk == 0)
    for (int i = 0; i < gen->n_begin_suppress; i++) e->h_bans[(*n_bans)++] = gen->begin_suppress[i];
  r.ban_count = *n_bans - r.ban_start;
  return r;
}

static bool is_stop(const td_engine *e, const group *g, int32_t t) {
  if (!g->p.ignore_eos && td_gen_is_eos(e->gen, t)) return true;
  for (int i = 0; i < g->p.n_stop_ids; i++)
    if (g->stop_ids[i] == t) return true;
  return false;
}

/* Appends token t to live sequence i; finishes it when a stop condition holds. */
static td_status sample_append(td_engine *e, group *g, int i, int32_t t, float lp) {
  seq *s = g->s[i];
  TD_TRY(i32_push(&s->tok, t));
  TD_TRY(f32_push(&s->lp, lp));
  s->sum_lp += lp;
  e->st.tokens_generated++;
  if (e->cb.on_token) e->cb.on_token(e->cb.ctx, g->handle, g->user, s->stream, t, lp);
  int gen = s->tok.n - g->n_prompt;
  td_finish f = is_stop(e, g, t) ? TD_FINISH_STOP : gen >= g->max_new ? TD_FINISH_LENGTH : TD_FINISH_NONE;
  if (f != TD_FINISH_NONE) {
    s->finish = f;
    seq_release_blocks(e, s);
    g->done[g->n_done++] = s;
    memmove(g->s + i, g->s + i + 1, sizeof *g->s * (size_t)(g->n_s - i - 1));
    g->n_s--;
  }
  return TD_OK;
}

/* Adds a finished hypothesis, keeping the best `width`. */
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

/* One beam-search step for a group from its rows' top-k log-probs:
 * transformers' rules (candidates from the best 2 x beams; an EOS among the
 * first `beams` candidates finishes a hypothesis; early stopping). Returns
 * whether the group is done. */
static td_status beam_step(td_engine *e, group *g, const int32_t *ids, const float *vals, int k, bool *done) {
  int B = g->width, m = g->n_s;
  cand *c = malloc(sizeof *c * (size_t)m * k);
  seq **next = calloc((size_t)B + 1, sizeof *next);
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
  int n_next = 0;
  for (int r = 0; r < nc && r < 2 * B && n_next < B; r++) {
    if (is_stop(e, g, c[r].tok)) {
      if (r >= B) continue;
      st = add_hyp(g, g->s[c[r].beam], g->n_prompt, c[r].tok, c[r].lp, c[r].score, gen_len);
      if (st != TD_OK) goto out;
      continue;
    }
    st = seq_fork(e, g->s[c[r].beam], c[r].tok, c[r].lp, n_next, &next[n_next]);
    if (st != TD_OK) goto out;
    n_next++;
    e->st.tokens_generated++;
  }
  double best_running = n_next ? next[0]->sum_lp : -INFINITY;
  for (int i = 0; i < m; i++) seq_free(e, g->s[i]);
  for (int i = 0; i < n_next; i++) g->s[i] = next[i];
  g->n_s = n_next;
  g->forked = true;
  bool full = g->n_hyps >= B;
  bool finished = false;
  if (n_next == 0) {
    finished = true;
  } else if (gen_len >= g->max_new) {
    /* out of room: the running beams become hypotheses */
    for (int i = 0; i < g->n_s && st == TD_OK; i++)
      st = add_hyp(g, g->s[i], g->n_prompt, -1, 0.0f, g->s[i]->sum_lp, gen_len);
    finished = true;
  } else if (full) {
    double worst = INFINITY;
    for (int i = 0; i < g->n_hyps; i++) worst = g->hyps[i].score < worst ? g->hyps[i].score : worst;
    double lpen = g->p.length_penalty;
    if (g->p.early_stopping == 1)
      finished = true;
    else if (g->p.early_stopping == 0)
      finished = worst >= best_running / pow((double)gen_len, lpen);
    else
      finished = worst >= best_running / pow((double)(lpen > 0 ? g->max_new : gen_len), lpen);
  }
  *done = finished;
out:
  free(c);
  free(next);
  return st;
}

/* Downloads rows [first, first + n) of the logits into g's all_logits store. */
static td_status keep_logits(td_engine *e, group *g, const float *logits, int first, int n) {
  for (int r = 0; r < n; r++) {
    TD_TRY(td_download(e->b, TD_BUF_F32, logits + (size_t)(first + r) * e->V, e->h_logits, (size_t)e->V));
    for (int j = 0; j < e->V; j++) TD_TRY(f32_push(&g->logits, e->h_logits[j]));
    g->n_logit_rows++;
  }
  return TD_OK;
}

td_status td_engine_step(td_engine *e) {
  TD_TRY(encode_phase(e));
  if (e->n_run == 0) return TD_OK;
  int T = e->o.max_step_tokens, S = e->o.max_running, R = e->max_rows;
  int chunks[64];
  int n_rows = 0;
  int n_sched = 0;
  group *sched_g[512];
  int n_tok = 0, n_seq = 0, n_extra = 0;
  e->qs[0] = 0;
  for (int gi = 0; gi < e->n_run && n_sched < 512; gi++) {
    group *g = e->run[gi];
    g->scheduled = g->completes = false;
    bool completes = false;
    if (g->n_s > 64) continue;
    if (!plan_group(e, g, T - n_tok, S - n_seq, R - n_rows - n_extra, chunks, &completes)) break;
    int need = 0;
    for (int i = 0; i < g->n_s; i++) need += seq_block_need(e, g->s[i], chunks[i]);
    /* Make room by preempting the newest running requests. */
    while (need > td_kv_pool_num_free(e->self)) {
      group *victim = NULL;
      for (int vi = e->n_run - 1; vi > gi; vi--) {
        bool has = false;
        for (int i = 0; i < e->run[vi]->n_s; i++) has |= e->run[vi]->s[i]->blk.n > 0;
        if (has) {
          victim = e->run[vi];
          break;
        }
      }
      if (!victim) break;
      preempt(e, victim);
    }
    if (need > td_kv_pool_num_free(e->self)) {
      if (n_sched == 0 && gi == 0 && e->n_run == 1) {
        group_fail(e, g, TD_ERR_NO_BLOCKS, "the self-attention pool cannot hold this request");
        return TD_OK;
      }
      break;
    }
    int first_seq = n_seq;
    for (int i = 0; i < g->n_s; i++) {
      seq *s = g->s[i];
      if (chunks[i] == 0) continue;
      TD_TRY(seq_grow(e, s, chunks[i]));
      for (int t = 0; t < chunks[i]; t++) {
        int p = s->n_computed + t;
        e->tok[n_tok + t] = s->tok.v[p];
        e->pos[n_tok + t] = p;
        e->slots[n_tok + t] = s->blk.v[p / e->bs] * e->bs + p % e->bs;
      }
      memcpy(e->tab + (size_t)n_seq * e->self_stride, s->blk.v, sizeof(int32_t) * (size_t)s->blk.n);
      e->ctx[n_seq] = s->n_computed + chunks[i];
      e->clen[n_seq] = g->enc_len;
      memcpy(e->ctab + (size_t)n_seq * e->cross_stride, g->cross.v, sizeof(int32_t) * (size_t)g->cross.n);
      if (g->p.all_logits) {
        int keep = chunks[i] - (completes ? 1 : 0);
        for (int t = 0; t < keep; t++) {
          e->extra_rows[n_extra] = n_tok + t;
          e->extra_group[n_extra++] = g;
        }
      }
      if (s->n_computed < g->n_prompt) e->st.prompt_tokens += chunks[i];
      n_tok += chunks[i];
      e->qs[++n_seq] = n_tok;
    }
    if (completes) {
      /* the last query row of each sequence; a prompt that forks into
       * samples repeats its row once per sample */
      int nr = group_sample_rows(g);
      for (int r = 0; r < nr; r++) {
        int si = nr == g->n_s ? r : 0;
        e->rows[n_rows + r] = e->qs[first_seq + si + 1] - 1;
        e->use[n_rows + r] = (row_use){g, si};
      }
      n_rows += nr;
      g->completes = true;
    }
    g->scheduled = true;
    for (int i = 0; i < g->n_s; i++) g->s[i]->n_computed += chunks[i];
    sched_g[n_sched++] = g;
  }
  if (n_tok == 0) return TD_OK;
  /* Sample rows first (non-beam, then beam), then the all_logits rows. */
  int32_t *ordered = malloc(sizeof(int32_t) * (size_t)(n_rows + n_extra + 1));
  row_use *ouse = malloc(sizeof *ouse * (size_t)(n_rows + 1));
  if (!ordered || !ouse) {
    free(ordered);
    free(ouse);
    return td_err(TD_ERR_NOMEM, "out of memory");
  }
  int w = 0, n_samp = 0;
  for (int pass = 0; pass < 2; pass++)
    for (int r = 0; r < n_rows; r++)
      if (e->use[r].g->beam == (pass == 1)) {
        ordered[w] = e->rows[r];
        ouse[w] = e->use[r];
        w++;
        n_samp += pass == 0;
      }
  for (int i = 0; i < n_extra; i++) ordered[w + i] = e->extra_rows[i];
  int n_logits = n_rows + n_extra;
  td_step_input in = {.n_seqs = n_seq, .n_tokens = n_tok, .tokens = e->tok, .positions = e->pos, .q_start = e->qs,
                      .ctx_len = e->ctx, .slots = e->slots, .block_table = e->tab, .block_stride = e->self_stride,
                      .cross_len = e->clen, .cross_table = e->ctab, .cross_stride = e->cross_stride,
                      .n_logits = n_logits, .logit_rows = ordered};
  const float *lg = NULL;
  td_status s = td_model_step(e->m, &in, &lg);
  e->st.steps++;
  if (s != TD_OK) goto failed;
  float *logits = (float *)lg;
  /* all_logits: prompt rows first (in order), then the sample row, before sampling edits it */
  for (int i = 0; i < n_sched; i++) {
    group *g = sched_g[i];
    if (!g->p.all_logits) continue;
    int first = -1, cnt = 0;
    for (int x = 0; x < n_extra; x++)
      if (e->extra_group[x] == g) {
        if (first < 0) first = n_rows + x;
        cnt++;
      }
    if (cnt && (s = keep_logits(e, g, logits, first, cnt)) != TD_OK) break;
    if (g->completes)
      for (int r = 0; r < n_rows; r++)
        if (ouse[r].g == g) {
          s = keep_logits(e, g, logits, r, 1);
          break;
        }
  }
  /* sampling parameters; the k-th copy of a forking prompt row is sample k */
  int n_bans = 0;
  for (int r = 0; r < n_rows && s == TD_OK; r++) {
    group *g = ouse[r].g;
    int stream = g->s[ouse[r].seq]->stream;
    if (!g->forked && !g->beam) {
      stream = 0;
      for (int q = 0; q < r; q++) stream += ouse[q].g == g;
    }
    e->h_rows[r] = make_row(e, g, g->s[ouse[r].seq], stream, &n_bans);
  }
  if (s == TD_OK) s = td_copy_h2d(e->b, e->d_rows, e->h_rows, sizeof(td_sample_row) * (size_t)n_rows);
  if (s == TD_OK && n_bans) s = td_copy_h2d(e->b, e->d_bans, e->h_bans, sizeof(int32_t) * (size_t)n_bans);
  if (s == TD_OK && n_samp) {
    s = td_sample(e->b, logits, n_samp, e->V, e->d_rows, e->d_bans, e->d_tok, e->d_lp);
    if (s == TD_OK) s = td_copy_d2h(e->b, e->h_tok, e->d_tok, sizeof(int32_t) * (size_t)n_samp);
    if (s == TD_OK) s = td_copy_d2h(e->b, e->h_lp, e->d_lp, sizeof(float) * (size_t)n_samp);
  }
  int n_beam_rows = n_rows - n_samp;
  int k = 0;
  for (int r = n_samp; r < n_rows; r++) k = 2 * ouse[r].g->width > k ? 2 * ouse[r].g->width : k;
  if (s == TD_OK && n_beam_rows) {
    s = td_topk_logprobs(e->b, logits + (size_t)n_samp * e->V, n_beam_rows, e->V, e->d_rows + n_samp,
                         e->d_bans, k, e->d_ids, e->d_vals);
    if (s == TD_OK) s = td_copy_d2h(e->b, e->h_ids, e->d_ids, sizeof(int32_t) * (size_t)n_beam_rows * k);
    if (s == TD_OK) s = td_copy_d2h(e->b, e->h_vals, e->d_vals, sizeof(float) * (size_t)n_beam_rows * k);
  }
  if (s == TD_OK) s = td_sync(e->b);
  if (s != TD_OK) goto failed;
  /* apply results per group */
  for (int i = 0; i < n_sched; i++) {
    group *g = sched_g[i];
    if (g->prefill_only && g->s[0]->n_computed >= g->prefill_only) {
      group_finish(e, g, TD_OK, NULL, TD_FINISH_STOP);
      continue;
    }
    if (!g->completes) continue;
    td_status gs = TD_OK;
    bool done = false;
    int first = -1;
    for (int r = 0; r < n_rows; r++)
      if (ouse[r].g == g) {
        first = r;
        break;
      }
    if (g->beam) {
      gs = beam_step(e, g, e->h_ids + (size_t)(first - n_samp) * k, e->h_vals + (size_t)(first - n_samp) * k, k,
                     &done);
    } else if (!g->forked && g->width > 1) {
      seq *parent = g->s[0];
      g->n_s = 0;
      for (int r = 0; r < g->width && gs == TD_OK; r++) {
        seq *child = NULL;
        int32_t t = e->h_tok[first + r];
        float lp = e->h_lp[first + r];
        gs = seq_fork(e, parent, t, lp, r, &child);
        if (gs != TD_OK) break;
        /* seq_fork appended; undo so sample_append handles stops uniformly */
        child->tok.n--;
        child->lp.n--;
        child->sum_lp -= lp;
        g->s[g->n_s++] = child;
      }
      seq_free(e, parent);
      g->forked = true;
      for (int r = g->width - 1; r >= 0 && gs == TD_OK; r--)
        gs = sample_append(e, g, r, e->h_tok[first + r], e->h_lp[first + r]);
      done = g->n_s == 0;
    } else {
      g->forked = true;
      for (int r = g->n_s - 1; r >= 0 && gs == TD_OK; r--)
        gs = sample_append(e, g, r, e->h_tok[first + r], e->h_lp[first + r]);
      done = g->n_s == 0;
    }
    if (gs != TD_OK) {
      group_fail(e, g, gs, td_errmsg());
      continue;
    }
    if (done) group_finish(e, g, TD_OK, NULL, TD_FINISH_STOP);
  }
  free(ordered);
  free(ouse);
  return TD_OK;
failed: {
  /* the step's requests fail; the engine goes on */
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", td_errmsg());
  for (int i = 0; i < n_sched; i++) group_fail(e, sched_g[i], s, msg);
  free(ordered);
  free(ouse);
  return TD_OK;
}
}

td_status td_engine_check(const td_engine *e) {
  TD_TRY(td_kv_pool_check(e->self));
  TD_TRY(td_kv_pool_check(e->cross));
  td_kv_pool_stats ss = td_kv_pool_get_stats(e->self), cs = td_kv_pool_get_stats(e->cross);
  int *refs = calloc((size_t)ss.n_blocks, sizeof *refs), *crefs = calloc((size_t)cs.n_blocks, sizeof *crefs);
  if (!refs || !crefs) {
    free(refs);
    free(crefs);
    return td_err(TD_ERR_NOMEM, "out of memory");
  }
  for (int l = 0; l < 2; l++) {
    group **arr = l ? e->run : e->wait;
    int n = l ? e->n_run : e->n_wait;
    for (int i = 0; i < n; i++) {
      const group *g = arr[i];
      for (int k = 0; k < g->n_s; k++)
        for (int b = 0; b < g->s[k]->blk.n; b++) refs[g->s[k]->blk.v[b]]++;
      for (int b = 0; b < g->cross.n; b++) crefs[g->cross.v[b]]++;
    }
  }
  td_status s = TD_OK;
  for (int i = 0; i < ss.n_blocks && s == TD_OK; i++) {
    refs[i] += e->ext_self[i] + td_kv_is_reserved(e->self, i);
    if (refs[i] != td_kv_refcount(e->self, i))
      s = td_err(TD_ERR_INTERNAL, "self block %d: %d holders, refcount %d", i, refs[i], td_kv_refcount(e->self, i));
  }
  for (int i = 0; i < cs.n_blocks && s == TD_OK; i++)
    if ((crefs[i] += e->ext_cross[i] + td_kv_is_reserved(e->cross, i)) != td_kv_refcount(e->cross, i))
      s = td_err(TD_ERR_INTERNAL, "cross block %d: %d holders, refcount %d", i, crefs[i],
                 td_kv_refcount(e->cross, i));
  free(refs);
  free(crefs);
  return s;
}

td_kv_pool *td_engine_self_pool(td_engine *e) { return e->self; }
td_kv_pool *td_engine_cross_pool(td_engine *e) { return e->cross; }

void td_engine_release(td_engine *e, bool cross, const int32_t *blocks, int n) {
  td_kv_pool *p = cross ? e->cross : e->self;
  int *ext = cross ? e->ext_cross : e->ext_self;
  for (int i = 0; i < n; i++) {
    if (blocks[i] < 0 || td_kv_refcount(p, blocks[i]) <= 0 || ext[blocks[i]] <= 0) continue;
    ext[blocks[i]]--;
    (void)td_kv_unref(p, blocks[i]);
  }
}
