/* The engine's lifetime and its public calls: create / destroy, add (a
 * validated request becomes a waiting or running group), cancel, stats,
 * the block accounting check, and blocks handed over to the caller. What a
 * step does is in step.c; see internal.h for the map of the files. */
#include "engine/engine.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/defaults.h"
#include "engine/internal.h"

void td_request_from_json(const td_json_request *j, td_request *r) {
  memset(r, 0, sizeof *r);
  r->id = j->id;
  r->input_ids = j->input_ids;
  r->n_input = j->n_input;
  r->features = j->features;
  r->prompt = j->prompt;
  r->n_prompt = j->n_prompt;
  r->params = j->params;
  r->params.stop_ids = j->stop_ids;
  r->params.n_stop_ids = j->n_stop_ids;
}

static int cmp_i32(const void *a, const void *b) {
  int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  return (x > y) - (x < y);
}

/* ------------------------------------------------------------ create */

static td_status copy_via_model(void *ctx, const int32_t *pairs, int n_pairs) {
  return td_model_copy_self_blocks(ctx, pairs, n_pairs);
}

void td_engine_default_blocks(const td_model *m, const td_engine_opts *o, int *self_blocks, int *cross_blocks) {
  const td_model_opts *mo = td_model_get_opts(m);
  int bs = mo->block_size;
  int run = o->max_running > 0 && o->max_running <= mo->max_seqs ? o->max_running : mo->max_seqs;
  int ss = eng_blocks_for(td_model_max_target_len(m), bs), cs = eng_blocks_for(td_model_max_source_len(m), bs);
  *self_blocks = o->self_blocks > 0 ? o->self_blocks : run * (ss + 1);
  *cross_blocks = o->cross_blocks > 0 ? o->cross_blocks : run * cs;
}

td_status td_engine_plan_pools(const td_pool_plan *p, int *self_blocks, int *cross_blocks) {
  *self_blocks = *cross_blocks = 0;
  if (p->self_per_seq <= 0 || p->cross_per_seq < 0 || !p->self_block_bytes || (p->cross_per_seq && !p->cross_block_bytes))
    return td_err(TD_ERR_INVALID, "pool plan: blocks of %zu / %zu bytes, %d / %d a sequence", p->self_block_bytes,
                  p->cross_block_bytes, p->self_per_seq, p->cross_per_seq);
  double per_seq = (double)p->self_per_seq * (double)p->self_block_bytes +
               (double)p->cross_per_seq * (double)p->cross_block_bytes;
  double n = p->budget > 0 ? floor(p->budget / per_seq) : 0;
  if (n < 1)
    return td_err(TD_ERR_NO_BLOCKS,
                  "KV pools: %.0f MiB left for them holds no sequence at the model's longest (%.1f MiB: %d self "
                  "blocks of %.2f MiB, %d cross blocks of %.2f MiB); raise --gpu-memory-fraction or give "
                  "--kv-blocks and --cross-blocks",
                  p->budget / 1048576.0, per_seq / 1048576.0, p->self_per_seq, p->self_block_bytes / 1048576.0,
                  p->cross_per_seq, p->cross_block_bytes / 1048576.0);
  /* block ids are int32: at most INT32_MAX blocks a pool */
  double cap = 2147483647.0 / (p->self_per_seq > p->cross_per_seq ? p->self_per_seq : p->cross_per_seq);
  if (n > cap) n = cap;
  *self_blocks = (int)(n * p->self_per_seq);
  *cross_blocks = (int)(n * p->cross_per_seq);
  return TD_OK;
}

td_status td_engine_memory_budget(td_backend *b, double fraction, double *budget) {
  *budget = 0;
  if (!(fraction > 0 && fraction <= 1))
    return td_err(TD_ERR_INVALID, "gpu_memory_fraction %g: in (0, 1]", fraction);
  td_backend_memory mem;
  TD_TRY(td_backend_memory_info(b, &mem));
  double share = fraction * (double)mem.total - (double)mem.allocated - (double)TD_GPU_RESERVE_BYTES;
  double free_now = (double)mem.free - (double)TD_GPU_HEADROOM_BYTES;
  *budget = share < free_now ? share : free_now;
  if (*budget < 0) *budget = 0;
  return TD_OK;
}

/* Pools from the device's memory (opts.gpu_memory_fraction), when asked and
 * the backend can tell: the pools left at zero share what the fraction
 * leaves after the weights, the workspace and any pool given a size; else
 * the model's defaults. */
static td_status size_pools(td_engine *e, td_engine_opts *o) {
  if (o->gpu_memory_fraction > 0 && (!o->self_blocks || !o->cross_blocks)) {
    double budget;
    td_status s = td_engine_memory_budget(e->b, o->gpu_memory_fraction, &budget);
    if (s == TD_OK) {
      td_kv_layout sl = td_model_self_layout(e->m), cl = td_model_cross_layout(e->m);
      size_t es = td_buf_elem_size(e->b, TD_BUF_ACT);
      td_pool_plan p = {.budget = budget, .self_block_bytes = td_kv_block_elems(&sl) * es,
                        .cross_block_bytes = td_kv_block_elems(&cl) * es, .self_per_seq = e->self_stride + 1,
                        .cross_per_seq = e->cross_stride};
      if (!o->self_blocks && !o->cross_blocks) return td_engine_plan_pools(&p, &o->self_blocks, &o->cross_blocks);
      /* one pool given a size: it takes its bytes, the other the rest */
      bool self_given = o->self_blocks > 0;
      double rest = budget - (self_given ? (double)o->self_blocks * (double)p.self_block_bytes
                                         : (double)o->cross_blocks * (double)p.cross_block_bytes);
      size_t bb = self_given ? p.cross_block_bytes : p.self_block_bytes;
      int per_seq = self_given ? p.cross_per_seq : p.self_per_seq;
      double n = rest > 0 ? fmin(floor(rest / (double)bb), 2147483647.0) : 0;
      if (n < per_seq)
        return td_err(TD_ERR_NO_BLOCKS,
                      "KV pools: %.0f MiB left for the %s pool holds no sequence at the model's longest (%d blocks "
                      "of %.2f MiB); raise --gpu-memory-fraction or give both pool sizes",
                      (rest > 0 ? rest : 0) / 1048576.0, self_given ? "cross" : "self", per_seq, bb / 1048576.0);
      *(self_given ? &o->cross_blocks : &o->self_blocks) = (int)n;
      return TD_OK;
    }
    if (s != TD_ERR_UNSUPPORTED) return s;
  }
  td_engine_default_blocks(e->m, o, &o->self_blocks, &o->cross_blocks);
  return TD_OK;
}

/* The widest request a step always fits: sequences, query rows (one each
 * when decoding) and logit rows (one each when a prompt forks). */
static void set_width(td_engine *e) {
  e->max_width = e->o.max_running;
  e->width_limit = "max_running, the sequences a step";
  if (e->o.max_step_tokens < e->max_width) {
    e->max_width = e->o.max_step_tokens;
    e->width_limit = "max_step_tokens, the decoder rows a step";
  }
  if (e->max_rows < e->max_width) {
    e->max_width = e->max_rows;
    e->width_limit = "max_logits, the logit rows a step";
  }
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
  e->self_stride = eng_blocks_for(e->max_tgt, e->bs);
  e->cross_stride = eng_blocks_for(e->max_src, e->bs);
  td_engine_opts *o = &e->o;
  if (o->max_running <= 0 || o->max_running > mo->max_seqs) o->max_running = mo->max_seqs;
  if (o->max_step_tokens <= 0 || o->max_step_tokens > mo->max_tokens) o->max_step_tokens = mo->max_tokens;
  if (o->max_enc_tokens <= 0 || o->max_enc_tokens > mo->max_enc_tokens) o->max_enc_tokens = mo->max_enc_tokens;
  if (o->max_queue <= 0) o->max_queue = TD_DEFAULT_ENGINE_QUEUE;
  if (o->encode_defer_steps == 0) o->encode_defer_steps = TD_DEFAULT_ENGINE_ENCODE_DEFER;
  if (!(o->encoder_cache_fraction >= 0 && o->encoder_cache_fraction <= 1)) {
    double f = o->encoder_cache_fraction;
    free(e);
    return td_err(TD_ERR_INVALID, "encoder_cache_fraction %g: in [0, 1] (0 disables the encoder cache)", f);
  }
  td_status s = size_pools(e, o);
  if (s != TD_OK) {
    free(e);
    return s;
  }
  e->max_rows = mo->max_logits;
  set_width(e);
  e->next_handle = 1;
  td_kv_layout sl = td_model_self_layout(m), cl = td_model_cross_layout(m);
  s = td_kv_pool_create(e->b, &sl, o->self_blocks, &e->self);
  if (s == TD_OK) s = td_kv_pool_create(e->b, &cl, o->cross_blocks, &e->cross);
  if (s != TD_OK) goto fail;
  td_model_set_pools(m, td_kv_pool_memory(e->self), td_kv_pool_memory(e->cross));
  if ((s = td_model_capture_graphs(m)) != TD_OK) goto fail;
  /* copy-on-write goes through the model, so that follower ranks copy too */
  td_kv_pool_set_copier(e->self, copy_via_model, m);
  eng_cache_init(e);
  e->ext_self = calloc((size_t)o->self_blocks, sizeof *e->ext_self);
  e->ext_cross = calloc((size_t)o->cross_blocks, sizeof *e->ext_cross);
  e->enc_batch = malloc(sizeof *e->enc_batch * (size_t)mo->max_enc_seqs);
  if (!e->ext_self || !e->ext_cross || !e->enc_batch) {
    s = td_err(TD_ERR_NOMEM, "engine buffers: out of memory");
    goto fail;
  }
  e->bt = &e->batch;
  e->two_sets = mo->pp_sets == 2 && mo->pp_rank == 0;
  s = eng_batch_init(e, &e->batch);
  if (s == TD_OK && e->two_sets) s = eng_batch_init(e, &e->batch1);
  if (s == TD_OK) s = eng_sampler_init(e);
  if (s == TD_OK) s = eng_warm_encoder(e);
  if (s == TD_OK) s = td_model_capture_encoder_graphs(m);
  if (s != TD_OK) goto fail;
  *out = e;
  return TD_OK;
fail:
  td_engine_destroy(e);
  return s;
}

void td_engine_destroy(td_engine *e) {
  if (!e) return;
  while (e->run.n) eng_group_finish(e, e->run.v[0], TD_ERR_CANCELLED, "engine shut down", TD_FINISH_CANCELLED);
  while (e->wait.n) eng_group_finish(e, e->wait.v[0], TD_ERR_CANCELLED, "engine shut down", TD_FINISH_CANCELLED);
  td_engine_cache_clear(e);
  if (e->m) td_model_set_pools(e->m, NULL, NULL);
  td_kv_pool_destroy(e->self);
  td_kv_pool_destroy(e->cross);
  eng_batch_free(&e->batch);
  eng_batch_free(&e->batch1);
  eng_sampler_free(e);
  td_ptrvec_free(&e->wait);
  td_ptrvec_free(&e->run);
  free(e->enc_batch);
  if (e->feat_stage) td_host_free(e->b, e->feat_stage);
  free(e->ext_self);
  free(e->ext_cross);
  free(e);
}

/* ------------------------------------------------------------ add / cancel */

/* A validated request as a group: its inputs copied, its one sequence the
 * decoder prompt (with the KV handed in, if any). */
static td_status group_new(td_engine *e, const td_request *r, const eng_admit *a, group **out) {
  const td_request_params *p = &r->params;
  group *g = calloc(1, sizeof *g);
  if (!g) return td_err(TD_ERR_NOMEM, "out of memory");
  *out = g;
  g->id = strdup(r->id ? r->id : "");
  g->p = *p;
  g->user = r->user;
  g->beam = a->beam;
  g->width = a->width;
  g->max_new = a->max_new;
  g->forced_bos = a->forced_bos;
  g->forced_eos = a->forced_eos;
  g->enc_len = a->enc_len;
  g->n_prompt = a->n_prompt;
  g->encode_only = r->encode_only;
  g->prefill_only = r->prefill_only;
  g->step_offset = r->step_offset;
  g->prompt = malloc(sizeof(int32_t) * (size_t)a->n_prompt);
  g->stop_ids = malloc(sizeof(int32_t) * (size_t)(p->n_stop_ids + 1));
  g->s = calloc((size_t)a->width + 1, sizeof *g->s);
  g->done = calloc((size_t)a->width + 1, sizeof *g->done);
  g->hyps = calloc((size_t)a->width + 1, sizeof *g->hyps);
  if (!g->id || !g->prompt || !g->stop_ids || !g->s || !g->done || !g->hyps)
    return td_err(TD_ERR_NOMEM, "out of memory");
  if (r->n_prompt > 0)
    memcpy(g->prompt, r->prompt, sizeof(int32_t) * (size_t)a->n_prompt);
  else
    g->prompt[0] = e->gen->decoder_start_token_id;
  if (p->n_stop_ids) memcpy(g->stop_ids, p->stop_ids, sizeof(int32_t) * (size_t)p->n_stop_ids);
  g->p.stop_ids = NULL;
  if (p->n_allowed) {
    if (!(g->allowed = malloc(sizeof(int32_t) * (size_t)p->n_allowed))) return td_err(TD_ERR_NOMEM, "out of memory");
    memcpy(g->allowed, p->allowed_ids, sizeof(int32_t) * (size_t)p->n_allowed);
    qsort(g->allowed, (size_t)p->n_allowed, sizeof(int32_t), cmp_i32);
  }
  g->p.allowed_ids = NULL;
  if (!g->p.has_seed) g->p.seed = (uint64_t)td_now_ns() ^ ((uint64_t)e->next_handle << 32);
  if (a->ext_cross) {
    /* nothing to encode */
  } else if (a->whisper) {
    size_t nf = (size_t)e->cfg->num_mel_bins * td_model_input_frames(e->m);
    g->features = malloc(sizeof(float) * nf);
    if (!g->features) return td_err(TD_ERR_NOMEM, "out of memory");
    memcpy(g->features, r->features, sizeof(float) * nf);
  } else {
    g->input = malloc(sizeof(int32_t) * (size_t)r->n_input);
    if (!g->input) return td_err(TD_ERR_NOMEM, "out of memory");
    memcpy(g->input, r->input_ids, sizeof(int32_t) * (size_t)r->n_input);
    g->n_input = r->n_input;
  }
  seq *s0 = calloc(1, sizeof *s0);
  if (!s0) return td_err(TD_ERR_NOMEM, "out of memory");
  g->s[0] = s0;
  g->n_s = 1;
  TD_TRY(td_i32vec_assign(&s0->tok, g->prompt, a->n_prompt));
  /* the blocks handed in are taken over only once the group is queued */
  if (r->self_blocks) {
    TD_TRY(td_i32vec_assign(&s0->blk, r->self_blocks, r->n_self_blocks));
    s0->n_computed = r->n_computed;
  }
  if (a->ext_cross) TD_TRY(td_i32vec_assign(&g->cross, r->cross_blocks, r->n_cross_blocks));
  return TD_OK;
}

td_status td_engine_add(td_engine *e, const td_request *r, uint64_t *handle) {
  eng_admit a;
  TD_TRY(eng_validate(e, r, &a));
  group *g = NULL;
  td_status s = group_new(e, r, &a, &g);
  if (s == TD_OK) {
    g->state = a.ext_cross ? G_RUNNING : G_WAITING;
    g->set = eng_pick_set(e);
    g->handle = e->next_handle++;
    td_ptrvec *q = a.ext_cross ? &e->run : &e->wait;
    s = td_ptrvec_insert(q, q->n, g);
  }
  if (s != TD_OK) {
    if (g) { /* the caller keeps its blocks */
      if (g->n_s) g->s[0]->blk.n = 0;
      g->cross.n = 0;
    }
    eng_group_free(e, g);
    return s;
  }
  HASH_ADD(hh, e->by_handle, handle, sizeof g->handle, g);
  *handle = g->handle;
  return TD_OK;
}

td_status td_engine_cancel(td_engine *e, uint64_t handle) {
  group *g = NULL;
  HASH_FIND(hh, e->by_handle, &handle, sizeof handle, g);
  if (!g) return td_err(TD_ERR_NOT_FOUND, "no request with handle %llu", (unsigned long long)handle);
  if (e->two_sets && g->state == G_RUNNING && g->scheduled && e->out[g->set]) {
    g->cancel_pending = true; /* its set's step is in flight: it ends when that step's logits come */
    return TD_OK;
  }
  eng_group_finish(e, g, TD_ERR_CANCELLED, "cancelled", TD_FINISH_CANCELLED);
  return TD_OK;
}

int td_engine_max_width(const td_engine *e) { return e->max_width; }

bool td_engine_idle(const td_engine *e) { return e->wait.n == 0 && e->run.n == 0 && !e->out[0] && !e->out[1]; }

td_engine_stats td_engine_get_stats(const td_engine *e) {
  td_engine_stats st = e->st;
  st.waiting = e->wait.n;
  st.running = e->run.n;
  st.self = td_kv_pool_get_stats(e->self);
  st.cross = td_kv_pool_get_stats(e->cross);
  st.cross.n_free += eng_cache_idle_blocks(e);
  st.cache_entries = e->cache.n_entries;
  st.cache_blocks = e->cache.n_blocks;
  st.cache_budget = e->cache.budget;
  return st;
}

/* ------------------------------------------------------------ blocks */

/* Each block's holders (refs: the groups' and the encoder cache's; ext: the caller's) and its
 * reservation against its reference count. */
static td_status check_holders(const td_kv_pool *p, int *refs, const int *ext, const char *which) {
  int n = td_kv_pool_get_stats(p).n_blocks;
  for (int i = 0; i < n; i++) {
    refs[i] += ext[i] + td_kv_is_reserved(p, i);
    if (refs[i] != td_kv_refcount(p, i))
      return td_err(TD_ERR_INTERNAL, "%s block %d: %d holders, refcount %d", which, i, refs[i],
                    td_kv_refcount(p, i));
  }
  return TD_OK;
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
  const td_ptrvec *lists[2] = {&e->wait, &e->run};
  for (int l = 0; l < 2; l++)
    for (int i = 0; i < lists[l]->n; i++) {
      const group *g = lists[l]->v[i];
      for (int k = 0; k < g->n_s; k++)
        for (int b = 0; b < g->s[k]->blk.n; b++) refs[g->s[k]->blk.v[b]]++;
      for (int b = 0; b < g->cross.n; b++) crefs[g->cross.v[b]]++;
    }
  eng_cache_holders(e, crefs);
  td_status s = check_holders(e->self, refs, e->ext_self, "self");
  if (s == TD_OK) s = check_holders(e->cross, crefs, e->ext_cross, "cross");
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
