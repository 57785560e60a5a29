/* The encoder cache (docs/encoder-cache.md) against the fixtures: a
 * repeated input skips its encoder run and decodes the same tokens and
 * logits as an uncached run; different inputs never share, even under one
 * hash; the budget holds, and a pool short of blocks evicts the cache
 * before anything waits; cancel and preemption leak no block. */
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "engine/engine.h"
#include "engine/internal.h"
#include "fixture.h"

#define MAXR 32
#define MAXT 64

typedef struct out {
  bool finished;
  td_status status;
  int n_out;
  int32_t tok[4][MAXT];
  int len[4];
  float *logits;
  int rows;
  int32_t blocks[64]; /* encode_only: handed over */
  int n_blocks;
} out;

typedef struct harness {
  fixture fx;
  td_backend *b;
  td_model *m;
  td_engine *e;
  out o[MAXR];
} harness;

static void on_finish(void *ctx, const td_result *r) {
  harness *h = ctx;
  out *o = &h->o[(intptr_t)r->user];
  o->finished = true;
  o->status = r->status;
  o->n_out = r->n_outputs < 4 ? r->n_outputs : 4;
  for (int i = 0; i < o->n_out; i++) {
    o->len[i] = r->outputs[i].n_tokens < MAXT ? r->outputs[i].n_tokens : MAXT;
    memcpy(o->tok[i], r->outputs[i].tokens, sizeof(int32_t) * (size_t)o->len[i]);
  }
  free(o->logits);
  o->logits = NULL;
  if (r->logits) {
    size_t n = (size_t)r->n_logit_rows * (size_t)h->fx.vocab;
    o->logits = malloc(sizeof(float) * n);
    memcpy(o->logits, r->logits, sizeof(float) * n);
    o->rows = r->n_logit_rows;
  }
  o->n_blocks = r->n_blocks < 64 ? r->n_blocks : 64;
  if (r->blocks) memcpy(o->blocks, r->blocks, sizeof(int32_t) * (size_t)o->n_blocks);
}

typedef struct cfg {
  double fraction;
  int cross_blocks, self_blocks, max_batch, max_tokens, block_size;
  bool recompute_cross;
  td_cross_mode cross_mode;
} cfg;

static void open_h(harness *h, const char *model, const cfg *c) {
  memset(h, 0, sizeof *h);
  fx_load(model, &h->fx);
  td_backend_opts bo = {.kind = TD_BACKEND_CPU};
  cr_assert(td_backend_create(&bo, &h->b) == TD_OK);
  int mb = c->max_batch ? c->max_batch : 16, mt = c->max_tokens ? c->max_tokens : 128;
  td_model_opts mo = {.block_size = c->block_size ? c->block_size : 4, .max_seqs = mb, .max_tokens = mt,
                      .max_logits = mt, .max_enc_tokens = 256, .max_enc_seqs = 8, .cross_mode = c->cross_mode};
  cr_assert(td_model_load(h->fx.dir, h->b, &mo, &h->m) == TD_OK, "%s", td_errmsg());
  td_engine_opts eo = {.self_blocks = c->self_blocks ? c->self_blocks : 256,
                       .cross_blocks = c->cross_blocks ? c->cross_blocks : 256, .max_running = mb,
                       .max_step_tokens = mt, .recompute_cross = c->recompute_cross,
                       .encoder_cache_fraction = c->fraction};
  td_engine_callbacks cb = {.on_finish = on_finish, .ctx = h};
  cr_assert(td_engine_create(h->m, &eo, &cb, &h->e) == TD_OK, "%s", td_errmsg());
}

/* Every block back in the pools once the cache lets go. */
static void close_h(harness *h) {
  td_engine_cache_clear(h->e);
  cr_expect_eq(td_engine_get_stats(h->e).cache_blocks, 0);
  td_kv_pool *cp = td_engine_cross_pool(h->e), *sp = td_engine_self_pool(h->e);
  cr_expect_eq(td_kv_pool_num_free(cp), td_kv_pool_get_stats(cp).n_blocks, "cross blocks leaked");
  cr_expect_eq(td_kv_pool_num_free(sp), td_kv_pool_get_stats(sp).n_blocks, "self blocks leaked");
  td_engine_destroy(h->e);
  td_model_destroy(h->m);
  td_backend_destroy(h->b);
  for (int i = 0; i < MAXR; i++) free(h->o[i].logits);
  fx_free(&h->fx);
}

typedef enum mode { GREEDY, BEAM, SAMPLE } mode;

/* Queues fixture request i as slot `slot`. */
static uint64_t add(harness *h, int i, int slot, mode md, bool encode_only) {
  const fx_request *q = &h->fx.req[i];
  td_request r = {.id = "r", .input_ids = q->input_ids, .n_input = q->n_input, .prompt = q->prompt,
                  .n_prompt = q->n_prompt, .user = (void *)(intptr_t)slot, .encode_only = encode_only};
  if (h->fx.features) r.features = h->fx.features + (size_t)i * h->fx.mels * h->fx.frames;
  td_request_params_default(&r.params);
  if (md == GREEDY) {
    r.params.max_new_tokens = h->fx.max_new;
    r.params.forced_bos = r.params.forced_eos = -1; /* the reference is plain argmax */
    r.params.all_logits = !encode_only;
  } else if (md == BEAM) {
    r.params.max_new_tokens = 10;
    r.params.num_beams = 4;
    r.params.num_return_sequences = 4;
  } else {
    r.params.max_new_tokens = 8;
    r.params.temperature = 1.3f; /* the same window again, hotter */
    r.params.seed = 99;
    r.params.has_seed = true;
    r.params.n = 3;
  }
  h->o[slot].finished = false;
  uint64_t hd;
  cr_assert(td_engine_add(h->e, &r, &hd) == TD_OK, "%s", td_errmsg());
  return hd;
}

static void drain(harness *h) {
  for (int steps = 0; !td_engine_idle(h->e); steps++) {
    cr_assert(td_engine_step(h->e) == TD_OK, "%s", td_errmsg());
    cr_assert(td_engine_check(h->e) == TD_OK, "%s", td_errmsg());
    cr_assert(steps < 5000, "engine does not finish");
  }
}

static void same_output(const out *a, const out *b, const char *what, int i) {
  cr_assert(a->finished && b->finished && a->status == TD_OK && b->status == TD_OK, "%s %d: not finished", what, i);
  cr_assert_eq(a->n_out, b->n_out, "%s %d: %d vs %d outputs", what, i, a->n_out, b->n_out);
  for (int k = 0; k < a->n_out; k++) {
    cr_assert_eq(a->len[k], b->len[k], "%s %d output %d: lengths differ", what, i, k);
    cr_assert_arr_eq(a->tok[k], b->tok[k], sizeof(int32_t) * (size_t)a->len[k], "%s %d output %d: tokens differ",
                     what, i, k);
  }
}

static void greedy_tokens_are_reference(const harness *h, int slot, int i) {
  const fx_request *q = &h->fx.req[i];
  const out *o = &h->o[slot];
  cr_assert(o->finished && o->status == TD_OK, "request %d (slot %d) did not finish", i, slot);
  cr_expect_eq(o->len[0], q->n_greedy, "request %d: %d tokens, reference %d", i, o->len[0], q->n_greedy);
  cr_expect_arr_eq(o->tok[0], q->greedy, sizeof(int32_t) * (size_t)q->n_greedy, "request %d: tokens differ", i);
}

static void greedy_is_reference(const harness *h, int slot, int i) {
  greedy_tokens_are_reference(h, slot, i);
  const fx_request *q = &h->fx.req[i];
  const out *o = &h->o[slot];
  int rows = q->n_prompt + q->n_greedy - 1;
  cr_assert_eq(o->rows, rows);
  double e = fx_rel_err(o->logits, h->fx.logits + q->logits_off * h->fx.vocab, (size_t)rows * h->fx.vocab);
  cr_expect(e <= 1e-4, "request %d: logits error %.3g", i, e);
}

/* Each input twice, the second time from the cache: one encoder run an
 * input, the reference's tokens and logits both times, bit-equal to the
 * first; and beams and samples over a cached input as over a fresh one. */
static void check_hits(const char *model) {
  harness h, plain;
  cfg c = {.fraction = 0.5};
  open_h(&h, model, &c);
  int n = h.fx.n;
  cr_assert(3 * n <= MAXR);
  for (int i = 0; i < n; i++) add(&h, i, i, GREEDY, false);
  drain(&h);
  td_engine_stats st = td_engine_get_stats(h.e);
  cr_expect_eq(st.encodes, n);
  cr_expect_eq(st.cache_hits, 0);
  cr_expect_eq(st.cache_misses, n);
  cr_expect_eq(st.cache_entries, n);
  /* the cached blocks count as free for admission and placement */
  cr_expect_eq(st.cross.n_free, st.cross.n_blocks);
  cr_expect_lt(td_kv_pool_num_free(td_engine_cross_pool(h.e)), st.cross.n_blocks);
  for (int i = 0; i < n; i++) add(&h, i, n + i, GREEDY, false);
  drain(&h);
  st = td_engine_get_stats(h.e);
  cr_expect_eq(st.encodes, n, "%s: %lld encoder runs for %d inputs asked twice", model, (long long)st.encodes, n);
  cr_expect_eq(st.cache_hits, n);
  for (int i = 0; i < n; i++) {
    greedy_is_reference(&h, i, i);
    greedy_is_reference(&h, n + i, i);
    same_output(&h.o[i], &h.o[n + i], "cached greedy", i);
    cr_expect_arr_eq(h.o[i].logits, h.o[n + i].logits, sizeof(float) * (size_t)h.o[i].rows * h.fx.vocab,
                     "%s request %d: cached logits differ", model, i);
  }
  /* beams and samples (n > 1) of cached inputs against an engine without the cache */
  c.fraction = 0;
  open_h(&plain, model, &c);
  for (int i = 0; i < n; i++) {
    add(&h, i, i, BEAM, false);
    add(&h, i, n + i, SAMPLE, false);
    add(&plain, i, i, BEAM, false);
    add(&plain, i, n + i, SAMPLE, false);
  }
  drain(&h);
  drain(&plain);
  st = td_engine_get_stats(h.e);
  cr_expect_eq(st.encodes, n);
  cr_expect_eq(st.cache_hits, 3 * n);
  td_engine_stats ps = td_engine_get_stats(plain.e);
  cr_expect_eq(ps.encodes, 2 * n);
  cr_expect_eq(ps.cache_hits + ps.cache_misses + ps.cache_entries, 0);
  for (int i = 0; i < 2 * n; i++) same_output(&h.o[i], &plain.o[i], "cached vs uncached", i);
  close_h(&plain);
  close_h(&h);
}

Test(enccache, t5_tiny_hits) { check_hits("t5-tiny"); }
Test(enccache, bart_tiny_hits) { check_hits("bart-tiny"); }
Test(enccache, whisper_tiny_hits) { check_hits("whisper-tiny"); }

/* Whatever the cross pool holds (per-layer K/V, encoder states, both): the
 * cache shares block ids only, and the tokens stay the reference's. */
Test(enccache, every_cross_mode) {
  const td_cross_mode modes[] = {TD_CROSS_KV, TD_CROSS_STATES, TD_CROSS_DUAL};
  const char *models[] = {"t5-tiny", "whisper-tiny"};
  for (int k = 0; k < 2; k++)
    for (int mi = 0; mi < 3; mi++) {
      harness h;
      cfg c = {.fraction = 0.5, .cross_mode = modes[mi]};
      open_h(&h, models[k], &c);
      int n = h.fx.n;
      for (int round = 0; round < 2; round++) {
        for (int i = 0; i < n; i++) add(&h, i, round * n + i, GREEDY, false);
        drain(&h);
      }
      td_engine_stats st = td_engine_get_stats(h.e);
      cr_expect_eq(st.encodes, n, "%s, cross mode %d: %lld encoder runs", models[k], (int)modes[mi],
                   (long long)st.encodes);
      cr_expect_eq(st.cache_hits, n);
      for (int i = 0; i < 2 * n; i++) greedy_tokens_are_reference(&h, i, i % n);
      close_h(&h);
    }
}

/* One input asked three times in one batch: encoded once, shared at once. */
Test(enccache, same_batch_shares) {
  harness h;
  cfg c = {.fraction = 0.25};
  open_h(&h, "t5-tiny", &c);
  for (int k = 0; k < 3; k++) add(&h, 0, k, GREEDY, false);
  drain(&h);
  td_engine_stats st = td_engine_get_stats(h.e);
  cr_expect_eq(st.encodes, 1);
  cr_expect_eq(st.cache_hits, 2);
  for (int k = 0; k < 3; k++) greedy_is_reference(&h, k, 0);
  close_h(&h);
}

/* Every input under one hash: the full comparison keeps them apart. */
static void check_collisions(const char *model) {
  harness h;
  cfg c = {.fraction = 1};
  open_h(&h, model, &c);
  eng_cache_set_hash_mask(h.e, 0);
  int n = h.fx.n;
  for (int i = 0; i < n; i++) add(&h, i, i, GREEDY, false); /* together: each displaces the last */
  drain(&h);
  for (int i = 0; i < n; i++) {
    add(&h, i, n + i, GREEDY, false); /* one at a time: a miss, unless the entry is its own */
    drain(&h);
  }
  td_engine_stats st = td_engine_get_stats(h.e);
  cr_expect_eq(st.cache_entries, 1);
  cr_expect_eq(st.cache_hits, n > 1 ? 0 : 1, "%s: %lld hits among different inputs", model, (long long)st.cache_hits);
  cr_expect_eq(st.encodes, n > 1 ? 2 * n : 1);
  for (int i = 0; i < n; i++) {
    greedy_is_reference(&h, i, i);
    greedy_is_reference(&h, n + i, i);
  }
  add(&h, n - 1, 0, GREEDY, false); /* the same input as the one cached */
  drain(&h);
  cr_expect_eq(td_engine_get_stats(h.e).cache_hits, st.cache_hits + 1);
  greedy_is_reference(&h, 0, n - 1);
  close_h(&h);
}

Test(enccache, t5_collisions_never_share) { check_collisions("t5-tiny"); }
Test(enccache, whisper_collisions_never_share) { check_collisions("whisper-tiny"); }

/* The budget holds: LRU eviction keeps the cached blocks within it, and
 * evicted blocks go back to the pool. */
Test(enccache, budget_respected) {
  harness h;
  fixture probe;
  fx_load("t5-tiny", &probe);
  int bs = 4, most = 0, second = 0, fits = 0;
  for (int i = 0; i < probe.n; i++) {
    int b = (probe.req[i].n_input + bs - 1) / bs;
    if (b > most) {
      second = most;
      most = b;
    } else if (b > second) {
      second = b;
    }
  }
  /* room for the second-longest input and a little: the inputs that fit
   * the budget at all outgrow it together, so older ones are evicted */
  int want = second + 2;
  for (int i = 0; i < probe.n; i++) {
    int b = (probe.req[i].n_input + bs - 1) / bs;
    fits += b <= want ? b : 0;
  }
  fx_free(&probe);
  cr_assert_gt(fits, want, "the fixture's inputs fit the budget together");
  cfg c = {.cross_blocks = 64, .fraction = (want + 0.5) / 64};
  open_h(&h, "t5-tiny", &c);
  int n = h.fx.n;
  cr_assert(n >= 3, "the fixture has %d requests", n);
  int budget = td_engine_get_stats(h.e).cache_budget;
  cr_expect_eq(budget, want);
  for (int round = 0; round < 2; round++)
    for (int i = 0; i < n; i++) {
      add(&h, i, i, GREEDY, false);
      drain(&h);
      greedy_is_reference(&h, i, i);
      td_engine_stats st = td_engine_get_stats(h.e);
      cr_assert_leq(st.cache_blocks, budget, "%d cached blocks, budget %d", st.cache_blocks, budget);
      /* nothing runs: every block not free is the cache's */
      cr_expect_eq(td_kv_pool_num_free(td_engine_cross_pool(h.e)) + st.cache_blocks, st.cross.n_blocks);
    }
  td_engine_stats st = td_engine_get_stats(h.e);
  cr_expect_gt(st.cache_evictions, 0);
  cr_expect_lt(st.cache_entries, n);
  cr_expect_eq(st.cache_hits + st.cache_misses, 2 * n);
  cr_expect_eq(st.encodes, st.cache_misses);
  close_h(&h);
}

/* A cross pool the cache fills entirely: new inputs evict it rather than
 * wait, and nothing is preempted for it. */
Test(enccache, pressure_evicts_first) {
  harness h;
  fixture probe;
  fx_load("t5-tiny", &probe);
  int most = 0, bs = 4;
  for (int i = 0; i < probe.n; i++) most = probe.req[i].n_input > most ? probe.req[i].n_input : most;
  fx_free(&probe);
  int per = (most + bs - 1) / bs;
  cfg c = {.cross_blocks = per, .fraction = 1}; /* one input at a time */
  open_h(&h, "t5-tiny", &c);
  int n = h.fx.n;
  for (int i = 0; i < n; i++) add(&h, i, i, GREEDY, false);
  drain(&h);
  for (int i = 0; i < n; i++) greedy_is_reference(&h, i, i);
  td_engine_stats st = td_engine_get_stats(h.e);
  cr_expect_eq(st.preemptions, 0);
  cr_expect_eq(st.encodes, n);
  cr_expect_geq(st.cache_evictions, n - 1);
  cr_expect_eq(st.cross.n_free, st.cross.n_blocks, "cached blocks count as used");
  /* a reservation (a KV transfer) gets its blocks from the cache too */
  td_engine_cache_reclaim(h.e, per);
  cr_expect_eq(td_kv_pool_num_free(td_engine_cross_pool(h.e)), per);
  close_h(&h);
}

/* Cancelled requests, cache hits among them, and preemption with the cross
 * KV recomputed: every block comes back. Whisper's entries borrow their
 * groups' features as keys (kept by a preempted group, handed to the entry
 * when the group lets go; ASan checks the hand-overs). */
static void leak_nothing(const char *model) {
  harness h;
  fixture probe;
  fx_load(model, &probe);
  int n = probe.n, self_blocks = 0;
  /* the smallest self pool admission takes (the longest request), which
   * several requests together outgrow (as test_engine's tight budget) */
  for (int i = 0; i < n; i++) {
    int need = (probe.req[i].n_prompt + probe.max_new + 1) / 2 + 1;
    self_blocks = need > self_blocks ? need : self_blocks;
  }
  fx_free(&probe);
  cfg c = {.fraction = 0.5, .block_size = 2, .self_blocks = self_blocks, .cross_blocks = 96, .max_batch = 3,
           .max_tokens = 5, .recompute_cross = true};
  open_h(&h, model, &c);
  for (int i = 0; i < n; i++) {
    add(&h, i, 2 * i, GREEDY, false);
    add(&h, i, 2 * i + 1, GREEDY, false);
  }
  drain(&h);
  for (int i = 0; i < n; i++) { /* (preempted all_logits rows repeat: tokens only) */
    greedy_tokens_are_reference(&h, 2 * i, i);
    greedy_tokens_are_reference(&h, 2 * i + 1, i);
  }
  td_engine_stats st = td_engine_get_stats(h.e);
  cr_expect_gt(st.preemptions, 0, "the tight pool preempted nothing");
  cr_expect_gt(st.cache_hits, 0);
  cr_expect_lt(st.encodes, 2 * n);
  /* cancel: one hit running, one waiting */
  uint64_t a = add(&h, 0, 0, GREEDY, false), b = add(&h, 1, 1, GREEDY, false);
  uint64_t hs[6];
  for (int i = 0; i < 6; i++) hs[i] = add(&h, i % n, 2 + i, GREEDY, false);
  cr_assert(td_engine_step(h.e) == TD_OK, "%s", td_errmsg());
  cr_assert(td_engine_cancel(h.e, a) == TD_OK);
  cr_assert(td_engine_cancel(h.e, hs[5]) == TD_OK);
  cr_assert(td_engine_check(h.e) == TD_OK, "%s", td_errmsg());
  drain(&h);
  cr_expect(h.o[0].finished && h.o[0].status == TD_ERR_CANCELLED);
  cr_expect(h.o[1].finished && h.o[1].status == TD_OK);
  (void)b;
  close_h(&h);
}
Test(enccache, cancel_and_preemption_leak_nothing) { leak_nothing("bart-tiny"); }
Test(enccache, whisper_cancel_and_preemption_leak_nothing) { leak_nothing("whisper-tiny"); }

/* encode_only (an encoder worker's job): a repeated input hands over the
 * cached blocks without an encoder run; both hand-overs released, nothing
 * leaks. */
Test(enccache, encode_only_shares) {
  harness h;
  cfg c = {.fraction = 0.5};
  open_h(&h, "whisper-tiny", &c);
  add(&h, 0, 0, GREEDY, true);
  drain(&h);
  add(&h, 0, 1, GREEDY, true);
  drain(&h);
  cr_assert(h.o[0].finished && h.o[1].finished && h.o[0].status == TD_OK && h.o[1].status == TD_OK);
  td_engine_stats st = td_engine_get_stats(h.e);
  cr_expect_eq(st.encodes, 1);
  cr_expect_eq(st.cache_hits, 1);
  cr_assert_eq(h.o[0].n_blocks, h.o[1].n_blocks);
  cr_expect_arr_eq(h.o[0].blocks, h.o[1].blocks, sizeof(int32_t) * (size_t)h.o[0].n_blocks);
  cr_assert(td_engine_check(h.e) == TD_OK, "%s", td_errmsg());
  td_engine_release(h.e, true, h.o[0].blocks, h.o[0].n_blocks);
  td_engine_release(h.e, true, h.o[1].blocks, h.o[1].n_blocks);
  cr_assert(td_engine_check(h.e) == TD_OK, "%s", td_errmsg());
  close_h(&h);
}

/* The fraction is checked at create, loudly. */
Test(enccache, fraction_limits) {
  fixture fx;
  fx_load("t5-tiny", &fx);
  td_backend_opts bo = {.kind = TD_BACKEND_CPU};
  td_backend *b;
  cr_assert(td_backend_create(&bo, &b) == TD_OK);
  td_model_opts mo = {.block_size = 4, .max_seqs = 4, .max_tokens = 64};
  td_model *m;
  cr_assert(td_model_load(fx.dir, b, &mo, &m) == TD_OK, "%s", td_errmsg());
  const double bad[] = {-0.1, 1.5};
  for (int i = 0; i < 2; i++) {
    td_engine_opts eo = {.encoder_cache_fraction = bad[i]};
    td_engine *e = NULL;
    cr_expect_eq(td_engine_create(m, &eo, NULL, &e), TD_ERR_INVALID);
    cr_expect(strstr(td_errmsg(), "encoder_cache_fraction"), "%s", td_errmsg());
    cr_expect_null(e);
  }
  td_engine_opts eo = {.encoder_cache_fraction = 1, .cross_blocks = 40};
  td_engine *e;
  cr_assert(td_engine_create(m, &eo, NULL, &e) == TD_OK, "%s", td_errmsg());
  cr_expect_eq(td_engine_get_stats(e).cache_budget, 40);
  td_engine_destroy(e);
  td_model_destroy(m);
  td_backend_destroy(b);
  fx_free(&fx);
}
