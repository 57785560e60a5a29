/* The engine against the fixtures: batched equals one-at-a-time, greedy
 * and beam search match transformers, tight KV budgets still finish with
 * the same tokens and leak no block. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "engine/engine.h"
#include "fixture.h"

#define MAXR 16
#define MAXO 8

typedef struct got {
  int n_out;
  int32_t tok[MAXO][64];
  int len[MAXO];
  double score[MAXO];
  float *logits;
  int rows;
  td_status status;
  bool finished;
} got;

typedef struct run_ctx {
  got g[MAXR];
  int vocab;
  int tokens_streamed;
} run_ctx;

static void on_finish(void *ctx, const td_result *r) {
  run_ctx *c = ctx;
  got *g = &c->g[(intptr_t)r->user];
  g->finished = true;
  g->status = r->status;
  g->n_out = r->n_outputs;
  for (int i = 0; i < r->n_outputs && i < MAXO; i++) {
    g->len[i] = r->outputs[i].n_tokens;
    memcpy(g->tok[i], r->outputs[i].tokens, sizeof(int32_t) * (size_t)(g->len[i] < 64 ? g->len[i] : 64));
    g->score[i] = r->outputs[i].score;
  }
  if (r->logits) {
    g->logits = malloc(sizeof(float) * (size_t)r->n_logit_rows * c->vocab);
    memcpy(g->logits, r->logits, sizeof(float) * (size_t)r->n_logit_rows * c->vocab);
    g->rows = r->n_logit_rows;
  }
}

static void on_token(void *ctx, uint64_t h, void *user, int seq, int32_t t, float lp) { ((run_ctx *)ctx)->tokens_streamed++; }

typedef struct setup {
  int block_size, self_blocks, cross_blocks, max_batch, max_tokens;
  bool recompute_cross;
} setup;

typedef enum mode { GREEDY, BEAM, SAMPLE } mode;

static void fill_params(const fixture *fx, mode md, td_request_params *p) {
  td_request_params_default(p);
  if (md == GREEDY) {
    p->max_new_tokens = fx->max_new;
    p->forced_bos = p->forced_eos = -1; /* the reference is plain argmax */
    p->all_logits = true;
  } else if (md == BEAM) {
    p->max_new_tokens = 10;
    p->num_beams = 4;
    p->num_return_sequences = 4;
    p->early_stopping = 1;
    p->length_penalty = 1.0f;
  } else {
    p->max_new_tokens = 8;
    p->temperature = 0.9f;
    p->top_k = 40;
    p->top_p = 0.9f;
    p->seed = 1234;
    p->has_seed = true;
    p->n = 2;
  }
}

/* Runs the requests `which` (indices into fx) together through one engine. */
static void run(const fixture *fx, const setup *su, mode md, const int *which, int n, run_ctx *c) {
  memset(c, 0, sizeof *c);
  c->vocab = fx->vocab;
  td_backend_opts bo = {.kind = TD_BACKEND_CPU};
  td_backend *b;
  cr_assert(td_backend_create(&bo, &b) == TD_OK);
  td_model_opts mo = {.block_size = su->block_size, .max_seqs = su->max_batch, .max_tokens = su->max_tokens,
                      .max_logits = su->max_tokens, .max_enc_tokens = 256, .max_enc_seqs = 8};
  td_model *m;
  cr_assert(td_model_load(fx->dir, b, &mo, &m) == TD_OK, "%s", td_errmsg());
  td_engine_opts eo = {.self_blocks = su->self_blocks, .cross_blocks = su->cross_blocks,
                       .max_running = su->max_batch, .max_step_tokens = su->max_tokens,
                       .recompute_cross = su->recompute_cross};
  td_engine_callbacks cb = {.on_finish = on_finish, .on_token = on_token, .ctx = c};
  td_engine *e;
  cr_assert(td_engine_create(m, &eo, &cb, &e) == TD_OK, "%s", td_errmsg());
  for (int k = 0; k < n; k++) {
    int i = which[k];
    const fx_request *q = &fx->req[i];
    td_request r = {.id = "r", .input_ids = q->input_ids, .n_input = q->n_input, .prompt = q->prompt,
                    .n_prompt = q->n_prompt, .user = (void *)(intptr_t)i};
    if (fx->features) r.features = fx->features + (size_t)i * fx->mels * fx->frames;
    fill_params(fx, md, &r.params);
    uint64_t h;
    cr_assert(td_engine_add(e, &r, &h) == TD_OK, "%s", td_errmsg());
  }
  int steps = 0;
  while (!td_engine_idle(e)) {
    cr_assert(td_engine_step(e) == TD_OK, "%s", td_errmsg());
    cr_assert(td_engine_check(e) == TD_OK, "%s", td_errmsg());
    cr_assert(++steps < 5000, "engine does not finish");
  }
  td_engine_stats st = td_engine_get_stats(e);
  cr_expect_eq(st.self.n_free, st.self.n_blocks, "self blocks leaked: %d of %d free", st.self.n_free,
               st.self.n_blocks);
  cr_expect_eq(st.cross.n_free, st.cross.n_blocks, "cross blocks leaked");
  td_engine_destroy(e);
  td_model_destroy(m);
  td_backend_destroy(b);
}

static void free_run(run_ctx *c) {
  for (int i = 0; i < MAXR; i++) free(c->g[i].logits);
}

static void same_tokens(const run_ctx *a, const run_ctx *b, int i, const char *what) {
  cr_assert_eq(a->g[i].n_out, b->g[i].n_out, "%s request %d: %d vs %d outputs", what, i, a->g[i].n_out,
               b->g[i].n_out);
  for (int o = 0; o < a->g[i].n_out; o++) {
    cr_assert_eq(a->g[i].len[o], b->g[i].len[o], "%s request %d output %d: lengths differ", what, i, o);
    cr_assert_arr_eq(a->g[i].tok[o], b->g[i].tok[o], sizeof(int32_t) * (size_t)a->g[i].len[o],
                     "%s request %d output %d: tokens differ", what, i, o);
  }
}

static void check_greedy(const char *name) {
  fixture fx;
  fx_load(name, &fx);
  int all[MAXR];
  for (int i = 0; i < fx.n; i++) all[i] = i;
  setup big = {.block_size = 4, .self_blocks = 256, .cross_blocks = 256, .max_batch = 16, .max_tokens = 128};
  run_ctx batched, single;
  run(&fx, &big, GREEDY, all, fx.n, &batched);
  for (int i = 0; i < fx.n; i++) {
    const fx_request *q = &fx.req[i];
    got *g = &batched.g[i];
    cr_assert(g->finished && g->status == TD_OK, "%s request %d did not finish", name, i);
    cr_assert_eq(g->n_out, 1);
    cr_expect_eq(g->len[0], q->n_greedy, "%s request %d: %d tokens, reference %d", name, i, g->len[0], q->n_greedy);
    cr_expect_arr_eq(g->tok[0], q->greedy, sizeof(int32_t) * (size_t)q->n_greedy, "%s request %d: greedy tokens differ",
                     name, i);
    int rows = q->n_prompt + q->n_greedy - 1;
    cr_assert_eq(g->rows, rows, "%s request %d: %d logit rows, expected %d", name, i, g->rows, rows);
    double e = fx_rel_err(g->logits, fx.logits + q->logits_off * fx.vocab, (size_t)rows * fx.vocab);
    cr_expect(e <= 1e-4, "%s request %d: logits error %.3g", name, i, e);
  }
  for (int i = 0; i < fx.n; i++) {
    run(&fx, &big, GREEDY, &i, 1, &single);
    same_tokens(&batched, &single, i, "batched vs single");
    free_run(&single);
  }
  /* tight budgets: few blocks, small steps (chunked prompts, preemption) */
  setup tight = {.block_size = 2, .self_blocks = 24, .cross_blocks = 48, .max_batch = 3, .max_tokens = 5};
  run_ctx small;
  run(&fx, &tight, GREEDY, all, fx.n, &small);
  for (int i = 0; i < fx.n; i++) same_tokens(&batched, &small, i, "tight budget");
  free_run(&small);
  tight.recompute_cross = true;
  run(&fx, &tight, GREEDY, all, fx.n, &small);
  for (int i = 0; i < fx.n; i++) same_tokens(&batched, &small, i, "tight budget, cross recomputed");
  free_run(&small);
  free_run(&batched);
  fx_free(&fx);
}

static void check_beam(const char *name) {
  fixture fx;
  fx_load(name, &fx);
  if (!fx.beam) {
    fx_free(&fx);
    return;
  }
  int all[MAXR];
  for (int i = 0; i < fx.n; i++) all[i] = i;
  setup big = {.block_size = 4, .self_blocks = 512, .cross_blocks = 256, .max_batch = 32, .max_tokens = 128};
  run_ctx batched;
  run(&fx, &big, BEAM, all, fx.n, &batched);
  for (int i = 0; i < fx.n; i++) {
    const fx_beam *ref = &fx.beam[i];
    got *g = &batched.g[i];
    cr_assert(g->finished && g->status == TD_OK);
    cr_expect_eq(g->n_out, ref->n_seq, "%s request %d: %d beams returned, reference %d", name, i, g->n_out,
                 ref->n_seq);
    for (int o = 0; o < g->n_out && o < ref->n_seq; o++) {
      cr_expect_eq(g->len[o], ref->seq_len[o], "%s request %d beam %d: length %d, reference %d", name, i, o,
                   g->len[o], ref->seq_len[o]);
      cr_expect_arr_eq(g->tok[o], ref->seq[o], sizeof(int32_t) * (size_t)ref->seq_len[o],
                       "%s request %d beam %d: tokens differ", name, i, o);
      cr_expect(fabs(g->score[o] - ref->score[o]) <= 1e-4 * (1 + fabs(ref->score[o])),
                "%s request %d beam %d: score %.6f, reference %.6f", name, i, o, g->score[o], ref->score[o]);
    }
  }
  run_ctx single;
  for (int i = 0; i < fx.n; i++) {
    run(&fx, &big, BEAM, &i, 1, &single);
    same_tokens(&batched, &single, i, "beam batched vs single");
  }
  setup tight = {.block_size = 2, .self_blocks = 48, .cross_blocks = 48, .max_batch = 8, .max_tokens = 9};
  run_ctx small;
  run(&fx, &tight, BEAM, all, fx.n, &small);
  for (int i = 0; i < fx.n; i++) same_tokens(&batched, &small, i, "beam, tight budget");
  fx_free(&fx);
}

#define ENGINE_TESTS(id, name)                   \
  Test(engine_greedy, id) { check_greedy(name); } \
  Test(engine_beam, id) { check_beam(name); }

ENGINE_TESTS(t5_tiny, "t5-tiny")
ENGINE_TESTS(bart_tiny, "bart-tiny")
ENGINE_TESTS(whisper_tiny, "whisper-tiny")
ENGINE_TESTS(t5v11_gated, "t5v11-gated-untied")
ENGINE_TESTS(mt5_silu, "mt5-silu-tied")
ENGINE_TESTS(mbart_prenorm, "mbart-prenorm-sharded")
ENGINE_TESTS(marian_sinusoidal, "marian-sinusoidal")
ENGINE_TESTS(bart_untied, "bart-untied-gelunew")
ENGINE_TESTS(whisper_128mel, "whisper-128mel")

Test(engine_sample, seed_reproduces_whatever_the_batch) {
  fixture fx;
  fx_load("bart-tiny", &fx);
  int all[MAXR];
  for (int i = 0; i < fx.n; i++) all[i] = i;
  setup su = {.block_size = 4, .self_blocks = 256, .cross_blocks = 256, .max_batch = 16, .max_tokens = 64};
  run_ctx batched, single;
  run(&fx, &su, SAMPLE, all, fx.n, &batched);
  for (int i = 0; i < fx.n; i++) {
    cr_assert_eq(batched.g[i].n_out, 2);
    run(&fx, &su, SAMPLE, &i, 1, &single);
    same_tokens(&batched, &single, i, "sampled, batched vs single");
  }
  fx_free(&fx);
}

/* ---- disaggregation: encode here, prefill there, decode elsewhere ---- */

typedef struct handover {
  int32_t blocks[64];
  int n;
  bool done;
  got g;
} handover;

static void on_handover(void *ctx, const td_result *r) {
  handover *h = ctx;
  h->done = true;
  h->g.status = r->status;
  h->n = r->n_blocks;
  if (r->n_blocks) memcpy(h->blocks, r->blocks, sizeof(int32_t) * (size_t)r->n_blocks);
  h->g.n_out = r->n_outputs;
  for (int i = 0; i < r->n_outputs && i < MAXO; i++) {
    h->g.len[i] = r->outputs[i].n_tokens;
    memcpy(h->g.tok[i], r->outputs[i].tokens, sizeof(int32_t) * (size_t)r->outputs[i].n_tokens);
  }
}

typedef struct node {
  td_backend *b;
  td_model *m;
  td_engine *e;
  handover h;
} node;

static void node_open(node *n, const char *dir) {
  memset(n, 0, sizeof *n);
  td_backend_opts bo = {.kind = TD_BACKEND_CPU};
  cr_assert(td_backend_create(&bo, &n->b) == TD_OK);
  td_model_opts mo = {.block_size = 4, .max_seqs = 4, .max_tokens = 64, .max_enc_tokens = 256, .max_enc_seqs = 4};
  cr_assert(td_model_load(dir, n->b, &mo, &n->m) == TD_OK, "%s", td_errmsg());
  td_engine_opts eo = {.self_blocks = 64, .cross_blocks = 64};
  td_engine_callbacks cb = {.on_finish = on_handover, .ctx = &n->h};
  cr_assert(td_engine_create(n->m, &eo, &cb, &n->e) == TD_OK, "%s", td_errmsg());
}

static void node_run(node *n) {
  n->h.done = false;
  for (int i = 0; i < 1000 && !n->h.done; i++) cr_assert(td_engine_step(n->e) == TD_OK, "%s", td_errmsg());
  cr_assert(n->h.done && n->h.g.status == TD_OK, "%s", td_errmsg());
}

static void node_close(node *n) {
  td_engine_stats st = td_engine_get_stats(n->e);
  cr_expect_eq(st.self.n_free, st.self.n_blocks, "self blocks leaked");
  cr_expect_eq(st.cross.n_free, st.cross.n_blocks, "cross blocks leaked");
  td_engine_destroy(n->e);
  td_model_destroy(n->m);
  td_backend_destroy(n->b);
}

/* What a KV transfer does: block contents into reserved blocks of another pool. */
static void move_blocks(td_kv_pool *from, const int32_t *src, td_kv_pool *to, const int32_t *dst, int n) {
  size_t bb = td_kv_pool_block_bytes(from);
  for (int i = 0; i < n; i++)
    memcpy((char *)td_kv_pool_memory(to) + (size_t)dst[i] * bb, (char *)td_kv_pool_memory(from) + (size_t)src[i] * bb, bb);
}

static void check_disaggregated(const char *name) {
  fixture fx;
  fx_load(name, &fx);
  node enc, pre, dec;
  node_open(&enc, fx.dir);
  node_open(&pre, fx.dir);
  node_open(&dec, fx.dir);
  for (int i = 0; i < fx.n; i++) {
    const fx_request *q = &fx.req[i];
    td_request r = {.id = "x", .input_ids = q->input_ids, .n_input = q->n_input, .prompt = q->prompt,
                    .n_prompt = q->n_prompt};
    if (fx.features) r.features = fx.features + (size_t)i * fx.mels * fx.frames;
    fill_params(&fx, GREEDY, &r.params);
    r.params.all_logits = false;
    uint64_t h;
    /* encoder */
    td_request er = r;
    er.encode_only = true;
    cr_assert(td_engine_add(enc.e, &er, &h) == TD_OK, "%s", td_errmsg());
    node_run(&enc);
    int ncb = enc.h.n;
    /* the decode worker reserves; the encoder's blocks move there */
    uint64_t dres, pres;
    int32_t dcross[64], pcross[64];
    cr_assert(td_kv_reserve(td_engine_cross_pool(dec.e), ncb, INT64_MAX, &dres, dcross) == TD_OK);
    move_blocks(td_engine_cross_pool(enc.e), enc.h.blocks, td_engine_cross_pool(dec.e), dcross, ncb);
    bool prefill = q->n_prompt > 1;
    int32_t dself[64];
    int nsb = 0;
    if (prefill) {
      cr_assert(td_kv_reserve(td_engine_cross_pool(pre.e), ncb, INT64_MAX, &pres, pcross) == TD_OK);
      move_blocks(td_engine_cross_pool(enc.e), enc.h.blocks, td_engine_cross_pool(pre.e), pcross, ncb);
    }
    td_engine_release(enc.e, true, enc.h.blocks, ncb);
    if (prefill) {
      int n_claim;
      cr_assert(td_kv_reservation_claim(td_engine_cross_pool(pre.e), pres, pcross, 64, &n_claim) == TD_OK);
      td_request pr = r;
      pr.cross_blocks = pcross;
      pr.n_cross_blocks = ncb;
      pr.enc_len = q->enc_len;
      pr.prefill_only = q->n_prompt - 1;
      cr_assert(td_engine_add(pre.e, &pr, &h) == TD_OK, "%s", td_errmsg());
      node_run(&pre);
      nsb = pre.h.n;
      uint64_t sres;
      cr_assert(td_kv_reserve(td_engine_self_pool(dec.e), nsb, INT64_MAX, &sres, dself) == TD_OK);
      move_blocks(td_engine_self_pool(pre.e), pre.h.blocks, td_engine_self_pool(dec.e), dself, nsb);
      td_engine_release(pre.e, false, pre.h.blocks, nsb);
      cr_assert(td_kv_reservation_claim(td_engine_self_pool(dec.e), sres, dself, 64, &n_claim) == TD_OK);
    }
    int n_claim;
    cr_assert(td_kv_reservation_claim(td_engine_cross_pool(dec.e), dres, dcross, 64, &n_claim) == TD_OK);
    td_request dr = r;
    dr.cross_blocks = dcross;
    dr.n_cross_blocks = ncb;
    dr.enc_len = q->enc_len;
    if (prefill) {
      dr.self_blocks = dself;
      dr.n_self_blocks = nsb;
      dr.n_computed = q->n_prompt - 1;
    }
    cr_assert(td_engine_add(dec.e, &dr, &h) == TD_OK, "%s", td_errmsg());
    node_run(&dec);
    cr_assert_eq(dec.h.g.len[0], q->n_greedy, "%s request %d: %d tokens", name, i, dec.h.g.len[0]);
    cr_expect_arr_eq(dec.h.g.tok[0], q->greedy, sizeof(int32_t) * (size_t)q->n_greedy,
                     "%s request %d: disaggregated tokens differ", name, i);
    cr_assert(td_engine_check(dec.e) == TD_OK, "%s", td_errmsg());
  }
  node_close(&enc);
  node_close(&pre);
  node_close(&dec);
  fx_free(&fx);
}

Test(engine_disaggregated, t5_tiny) { check_disaggregated("t5-tiny"); }
Test(engine_disaggregated, mbart) { check_disaggregated("mbart-prenorm-sharded"); }
Test(engine_disaggregated, whisper_128mel) { check_disaggregated("whisper-128mel"); }
