/* The engine against the fixtures: batched equals one-at-a-time, greedy
 * and beam search match transformers, tight KV budgets preempt and still
 * finish with the same tokens and leak no block; every limit is refused
 * at admission with an error naming it, and a request at the limit runs. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "engine/engine.h"
#include "common/jsonl.h"
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
  bool has_probe[MAXO];
  double probe[MAXO];
} got;

typedef struct run_ctx {
  got g[MAXR];
  int vocab;
  int tokens_streamed;
  td_engine_stats st; /* at the end of the run */
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
    g->has_probe[i] = r->outputs[i].has_probe;
    g->probe[i] = r->outputs[i].probe_prob;
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
  int probe_pos;      /* > 0: probe position probe_pos - 1 (at most the prompt's last) */
  int32_t probe_tok;
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
    if (su->probe_pos > 0) {
      r.params.probe = true;
      r.params.probe_token = su->probe_tok;
      r.params.probe_position = su->probe_pos - 1 < q->n_prompt ? su->probe_pos - 1 : q->n_prompt - 1;
      r.params.all_logits = false;
    }
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
  c->st = st;
  cr_expect_eq(st.self.n_free, st.self.n_blocks, "self blocks leaked: %d of %d free", st.self.n_free,
               st.self.n_blocks);
  cr_expect_eq(st.cross.n_free, st.cross.n_blocks, "cross blocks leaked");
  td_engine_destroy(e);
  td_model_destroy(m);
  td_backend_destroy(b);
}

/* The smallest self pool admission accepts for these requests: the widest
 * one's full length. Several of them together then outgrow it, so the
 * engine must preempt. */
static int min_self_blocks(const fixture *fx, mode md, int bs) {
  td_request_params p;
  fill_params(fx, md, &p);
  int width = p.num_beams > 1 ? p.num_beams : p.n, most = 0;
  for (int i = 0; i < fx->n; i++) {
    int need = width * ((fx->req[i].n_prompt + p.max_new_tokens + bs - 1) / bs + 1);
    most = need > most ? need : most;
  }
  return most;
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
  /* tight budgets: small steps (chunked prompts) and the smallest pool
   * admission accepts, which the requests together outgrow: the engine
   * preempts, and the tokens stay the same */
  setup tight = {.block_size = 2, .self_blocks = min_self_blocks(&fx, GREEDY, 2), .cross_blocks = 48, .max_batch = 3,
                 .max_tokens = 5};
  run_ctx small;
  run(&fx, &tight, GREEDY, all, fx.n, &small);
  for (int i = 0; i < fx.n; i++) same_tokens(&batched, &small, i, "tight budget");
  cr_expect(small.st.preemptions > 0, "%s: the tight budget preempted nothing", name);
  free_run(&small);
  tight.recompute_cross = true;
  run(&fx, &tight, GREEDY, all, fx.n, &small);
  for (int i = 0; i < fx.n; i++) same_tokens(&batched, &small, i, "tight budget, cross recomputed");
  cr_expect(small.st.preemptions > 0, "%s: the tight budget preempted nothing (cross recomputed)", name);
  cr_expect(small.st.encodes > fx.n, "%s: %lld encodes of %d requests: no cross KV was recomputed", name,
            (long long)small.st.encodes, fx.n);
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
  /* small steps: prompts in chunks, two beam groups a step */
  setup tight = {.block_size = 2, .self_blocks = 48, .cross_blocks = 48, .max_batch = 8, .max_tokens = 9};
  run_ctx small;
  run(&fx, &tight, BEAM, all, fx.n, &small);
  for (int i = 0; i < fx.n; i++) same_tokens(&batched, &small, i, "beam, tight budget");
  /* each request three times over the smallest pool admission accepts:
   * beams share their prefixes, so it takes this many to preempt */
  int thrice[3 * MAXR];
  for (int i = 0; i < 3 * fx.n; i++) thrice[i] = i % fx.n;
  setup crowded = {.block_size = 2, .self_blocks = min_self_blocks(&fx, BEAM, 2), .cross_blocks = 96,
                   .max_batch = 24, .max_tokens = 24};
  run(&fx, &crowded, BEAM, thrice, 3 * fx.n, &small);
  for (int i = 0; i < fx.n; i++) same_tokens(&batched, &small, i, "beam, crowded pool");
  cr_expect(small.st.preemptions > 0, "%s: the crowded pool preempted no beams", name);
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
ENGINE_TESTS(t5_four_layers, "t5-four-layers")
ENGINE_TESTS(whisper_four_layers, "whisper-four-layers")

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

/* ---- limits: refused at admission with the limit named; at the limit, run ---- */

typedef struct lim {
  fixture fx;
  td_backend *b;
  td_model *m;
  td_engine *e;
  run_ctx c;
  int finished;
} lim;

static void lim_finish(void *ctx, const td_result *r) {
  lim *L = ctx;
  L->finished++;
  L->c.g[0].status = r->status;
  L->c.g[0].n_out = r->n_outputs;
  for (int i = 0; i < r->n_outputs && i < MAXO; i++) {
    L->c.g[0].len[i] = r->outputs[i].n_tokens;
    int n = r->outputs[i].n_tokens < 64 ? r->outputs[i].n_tokens : 64;
    memcpy(L->c.g[0].tok[i], r->outputs[i].tokens, sizeof(int32_t) * (size_t)n);
  }
}

static void lim_open(lim *L, const td_model_opts *mo_in, const td_engine_opts *eo) {
  memset(L, 0, sizeof *L);
  fx_load("t5-tiny", &L->fx);
  td_backend_opts bo = {.kind = TD_BACKEND_CPU};
  cr_assert(td_backend_create(&bo, &L->b) == TD_OK);
  td_model_opts mo = *mo_in;
  mo.block_size = 4;
  cr_assert(td_model_load(L->fx.dir, L->b, &mo, &L->m) == TD_OK, "%s", td_errmsg());
  td_engine_callbacks cb = {.on_finish = lim_finish, .ctx = L};
  cr_assert(td_engine_create(L->m, eo, &cb, &L->e) == TD_OK, "%s", td_errmsg());
}

static void lim_close(lim *L) {
  cr_assert(td_engine_check(L->e) == TD_OK, "%s", td_errmsg());
  td_engine_stats st = td_engine_get_stats(L->e);
  cr_expect_eq(st.self.n_free, st.self.n_blocks, "self blocks leaked");
  td_engine_destroy(L->e);
  td_model_destroy(L->m);
  td_backend_destroy(L->b);
  fx_free(&L->fx);
}

/* Request 0 of the fixture, greedy, a few tokens. */
static td_request lim_request(const lim *L) {
  const fx_request *q = &L->fx.req[0];
  td_request r = {.id = "lim", .input_ids = q->input_ids, .n_input = q->n_input};
  td_request_params_default(&r.params);
  r.params.max_new_tokens = 3;
  return r;
}

static void refused(lim *L, const td_request *r, td_status want, const char *says) {
  uint64_t h;
  td_status s = td_engine_add(L->e, r, &h);
  cr_expect_eq(s, want, "status %s, expected %s (%s)", td_status_str(s), td_status_str(want), td_errmsg());
  cr_expect(strstr(td_errmsg(), says), "error \"%s\" lacks \"%s\"", td_errmsg(), says);
  cr_expect(td_engine_idle(L->e), "a refused request was queued");
}

/* Adds r and steps until it finishes: the request at the limit runs. */
static void runs(lim *L, const td_request *r, int outputs) {
  uint64_t h;
  cr_assert(td_engine_add(L->e, r, &h) == TD_OK, "%s", td_errmsg());
  int before = L->finished;
  for (int i = 0; i < 1000 && L->finished == before; i++) {
    cr_assert(td_engine_step(L->e) == TD_OK, "%s", td_errmsg());
    cr_assert(td_engine_check(L->e) == TD_OK, "%s", td_errmsg());
  }
  cr_assert(L->finished > before, "the request at the limit never finished");
  cr_expect_eq(L->c.g[0].status, TD_OK);
  cr_expect_eq(L->c.g[0].n_out, outputs, "%d outputs, expected %d", L->c.g[0].n_out, outputs);
}

Test(engine_limits, n_and_beams_above_max_running) {
  lim L;
  td_model_opts mo = {.max_seqs = 8};
  td_engine_opts eo = {.max_running = 8};
  lim_open(&L, &mo, &eo);
  cr_expect_eq(td_engine_max_width(L.e), 8);
  td_request r = lim_request(&L);
  r.params.n = 9;
  r.params.temperature = 1.0f;
  refused(&L, &r, TD_ERR_INVALID, "n 9: at most 8 (this engine's max_running");
  r.params.n = 0;
  refused(&L, &r, TD_ERR_INVALID, "n 0: at least 1");
  r.params.n = 8;
  runs(&L, &r, 8);
  r = lim_request(&L);
  r.params.num_beams = 9;
  refused(&L, &r, TD_ERR_INVALID, "num_beams 9: at most 8 (this engine's max_running");
  r.params.num_beams = 0;
  refused(&L, &r, TD_ERR_INVALID, "num_beams 0: at least 1");
  r.params.num_beams = 8;
  r.params.num_return_sequences = 8;
  runs(&L, &r, 8);
  lim_close(&L);
}

/* More samples than 64 (a width the scheduler once skipped for good). */
Test(engine_limits, n_above_64_runs) {
  lim L;
  td_model_opts mo = {.max_seqs = 80};
  td_engine_opts eo = {.max_running = 80};
  lim_open(&L, &mo, &eo);
  td_request r = lim_request(&L);
  r.params.n = 70;
  r.params.temperature = 1.0f;
  r.params.seed = 5;
  r.params.has_seed = true;
  runs(&L, &r, 70);
  r.params.n = 81;
  refused(&L, &r, TD_ERR_INVALID, "n 81: at most 80 (this engine's max_running");
  lim_close(&L);
}

Test(engine_limits, beams_above_32) {
  lim L;
  td_model_opts mo = {.max_seqs = 64};
  td_engine_opts eo = {0};
  lim_open(&L, &mo, &eo);
  td_request r = lim_request(&L);
  r.params.num_beams = 40;
  refused(&L, &r, TD_ERR_INVALID, "num_beams 40: at most 32 (this engine's limit)");
  r.params.num_beams = 32;
  r.params.num_return_sequences = 2;
  runs(&L, &r, 2);
  lim_close(&L);
}

/* The width a step always fits is also bounded by its query rows and its
 * logit rows (a prompt forking into n samples needs n of them). */
Test(engine_limits, width_above_step_tokens_or_logit_rows) {
  lim L;
  td_model_opts mo = {.max_seqs = 8};
  td_engine_opts eo = {.max_running = 8, .max_step_tokens = 5};
  lim_open(&L, &mo, &eo);
  td_request r = lim_request(&L);
  r.params.temperature = 1.0f;
  r.params.n = 6;
  refused(&L, &r, TD_ERR_INVALID, "n 6: at most 5 (this engine's max_step_tokens");
  r.params.n = 5;
  runs(&L, &r, 5);
  lim_close(&L);
  mo = (td_model_opts){.max_seqs = 8, .max_logits = 4};
  eo = (td_engine_opts){.max_running = 8};
  lim_open(&L, &mo, &eo);
  r = lim_request(&L);
  r.params.num_beams = 5;
  refused(&L, &r, TD_ERR_INVALID, "num_beams 5: at most 4 (this engine's max_logits");
  r.params.num_beams = 4;
  runs(&L, &r, 1);
  lim_close(&L);
  mo = (td_model_opts){.max_seqs = 1};
  eo = (td_engine_opts){0};
  lim_open(&L, &mo, &eo);
  r = lim_request(&L);
  r.params.all_logits = true;
  refused(&L, &r, TD_ERR_INVALID, "all logits need 2 logit rows a step; this engine has 1");
  lim_close(&L);
}

Test(engine_limits, queue_full) {
  lim L;
  td_model_opts mo = {0};
  td_engine_opts eo = {.max_queue = 1};
  lim_open(&L, &mo, &eo);
  td_request r = lim_request(&L);
  uint64_t h;
  cr_assert(td_engine_add(L.e, &r, &h) == TD_OK, "%s", td_errmsg());
  cr_expect_eq(td_engine_add(L.e, &r, &h), TD_ERR_OVERLOADED);
  cr_expect(strstr(td_errmsg(), "1 requests queued, the limit"), "%s", td_errmsg());
  lim_close(&L);
}

/* Out of range or not a number: refused, never clamped or ignored. */
Test(engine_limits, bad_parameters_refused) {
  lim L;
  td_model_opts mo = {0};
  td_engine_opts eo = {0};
  lim_open(&L, &mo, &eo);
  const int32_t stop[1] = {5};
  td_request r;
#define BAD(field, value, says)              \
  r = lim_request(&L);                       \
  r.field = value;                           \
  refused(&L, &r, TD_ERR_INVALID, says)
  BAD(params.temperature, NAN, "temperature nan: must be a finite number >= 0");
  BAD(params.temperature, INFINITY, "temperature inf");
  BAD(params.temperature, -1.0f, "temperature -1");
  BAD(params.top_p, NAN, "top_p nan");
  BAD(params.top_p, 0.0f, "top_p 0");
  BAD(params.top_k, -1, "top_k -1");
  BAD(params.length_penalty, NAN, "length_penalty nan");
  BAD(params.length_penalty, -INFINITY, "length_penalty -inf");
  BAD(params.early_stopping, 2, "early_stopping 2");
  BAD(params.num_return_sequences, -1, "num_return_sequences -1");
  BAD(params.n_stop_ids, -1, "-1 stop token ids");
  BAD(params.n_stop_ids, 1, "1 stop token ids given no ids");
  BAD(params.forced_bos, -3, "forced BOS -3");
  BAD(params.forced_eos, 100000, "outside the vocabulary");
  BAD(n_prompt, -1, "decoder prompt of -1 tokens");
  BAD(n_prompt, 2, "decoder prompt of 2 tokens given no tokens");
  BAD(prefill_only, -1, "prefill of -1 tokens");
  BAD(params.n_allowed, -1, "-1 allowed token ids");
  BAD(params.n_allowed, 2, "2 allowed token ids given no ids");
  r = lim_request(&L);
  const int32_t outside[2] = {5, 100000};
  r.params.allowed_ids = outside;
  r.params.n_allowed = 2;
  refused(&L, &r, TD_ERR_INVALID, "allowed token 100000 is outside the vocabulary");
#undef BAD
  r = lim_request(&L);
  r.params.stop_ids = stop;
  r.params.n_stop_ids = 1;
  r.prefill_only = 1;
  r.params.all_logits = true;
  refused(&L, &r, TD_ERR_INVALID, "all logits are kept for decoding requests only");
  lim_close(&L);
}

/* Only the allowed tokens come out (Whisper's language detection), greedy
 * and sampled, with the model's suppressed tokens still applied; the ban
 * buffers grow to the vocabulary for it. */
Test(engine_limits, allowed_tokens_only) {
  lim L;
  td_model_opts mo = {0};
  td_engine_opts eo = {0};
  lim_open(&L, &mo, &eo);
  const int32_t allowed[3] = {77, 5, 42};
  for (int k = 0; k < 2; k++) {
    td_request r = lim_request(&L);
    r.params.allowed_ids = allowed;
    r.params.n_allowed = 3;
    r.params.max_new_tokens = 6;
    r.params.ignore_eos = true;
    if (k) {
      r.params.temperature = 1.0f;
      r.params.seed = 7;
      r.params.has_seed = true;
      r.params.n = 3;
    }
    runs(&L, &r, k ? 3 : 1);
    for (int o = 0; o < L.c.g[0].n_out; o++) {
      cr_expect_eq(L.c.g[0].len[o], 6);
      for (int t = 0; t < L.c.g[0].len[o]; t++) {
        int32_t x = L.c.g[0].tok[o][t];
        cr_expect(x == 5 || x == 42 || x == 77, "output %d token %d is %d, not an allowed one", o, t, x);
      }
    }
  }
  lim_close(&L);
}

/* Whisper's timestamp rules (any model: they are bans on ids): the first
 * token a timestamp within max_initial, no <|notimestamps|>, never three
 * timestamps in a row (nor two at the start), timestamps never decreasing
 * (and only a pair's second may repeat the first). */
Test(engine_limits, timestamp_rules) {
  lim L;
  td_model_opts mo = {0};
  td_engine_opts eo = {0};
  lim_open(&L, &mo, &eo);
  const int32_t tb = 250, max_initial = 3;
  for (int k = 0; k < 3; k++) {
    td_request r = lim_request(&L);
    r.params.timestamp_begin = tb;
    r.params.max_initial_timestamp = max_initial;
    r.params.max_new_tokens = 16;
    r.params.ignore_eos = true;
    if (k) {
      r.params.temperature = 1.5f;
      r.params.seed = (uint64_t)k;
      r.params.has_seed = true;
      r.params.n = 2;
    }
    runs(&L, &r, k ? 2 : 1);
    for (int o = 0; o < L.c.g[0].n_out; o++) {
      const int32_t *t = L.c.g[0].tok[o];
      int n = L.c.g[0].len[o];
      cr_assert_eq(n, 16);
      cr_expect(t[0] >= tb && t[0] <= tb + max_initial, "run %d output %d: first token %d", k, o, t[0]);
      cr_expect(t[1] < tb, "run %d output %d: a timestamp right after the first", k, o);
      int32_t last = -1;
      for (int i = 0; i < n; i++) {
        cr_expect_neq(t[i], tb - 1, "<|notimestamps|> generated");
        if (t[i] < tb) continue;
        cr_expect(!(i >= 2 && t[i - 1] >= tb && t[i - 2] >= tb), "run %d output %d: three timestamps at %d", k, o, i);
        bool closes_pair = i >= 1 && t[i - 1] >= tb && !(i >= 2 && t[i - 2] >= tb);
        if (last >= 0)
          cr_expect(closes_pair ? t[i] >= last : t[i] > last, "run %d output %d: timestamp %d after %d", k, o, t[i],
                    last);
        last = t[i];
      }
    }
  }
  td_request r = lim_request(&L);
  r.params.timestamp_begin = 100000;
  refused(&L, &r, TD_ERR_INVALID, "timestamp_begin 100000 is outside the vocabulary");
  lim_close(&L);
}

/* A JSON number is a double: a seed above 2^53 would arrive rounded. */
Test(engine_limits, json_seed_above_2_53) {
  td_json_request j;
  const char *ok = "{\"input_ids\": [5, 1], \"seed\": 9007199254740992}";
  cr_expect_eq(td_json_request_parse(ok, strlen(ok), NULL, 1, &j), TD_OK, "%s", td_errmsg());
  cr_expect_eq(j.params.seed, 9007199254740992ull);
  td_json_request_free(&j);
  const char *big = "{\"input_ids\": [5, 1], \"seed\": 1e19}";
  cr_expect_eq(td_json_request_parse(big, strlen(big), NULL, 1, &j), TD_ERR_INVALID);
  cr_expect(strstr(td_errmsg(), "\"seed\" must be an integer from 0 to 2^53"), "%s", td_errmsg());
  td_json_request_free(&j);
}

/* The probe: softmax of the raw logits after a prompt position, as the
 * reference's logits give it, whatever the position (the prompt's last is
 * the sample row), the chunking, the logit rows left, samples and beams. */
static double ref_prob(const fixture *fx, int i, int pos, int32_t tok) {
  const float *x = fx->logits + (fx->req[i].logits_off + (size_t)pos) * fx->vocab;
  double mx = -INFINITY, sum = 0;
  for (int j = 0; j < fx->vocab; j++) mx = x[j] > mx ? x[j] : mx;
  for (int j = 0; j < fx->vocab; j++) sum += exp((double)x[j] - mx);
  return exp((double)x[tok] - mx) / sum;
}

Test(engine_probe, matches_the_reference_logits) {
  fixture fx;
  fx_load("whisper-tiny", &fx);
  int all[MAXR];
  for (int i = 0; i < fx.n; i++) all[i] = i;
  const setup shapes[] = {
      {.block_size = 4, .self_blocks = 512, .cross_blocks = 256, .max_batch = 16, .max_tokens = 128},
      {.block_size = 2, .self_blocks = 512, .cross_blocks = 96, .max_batch = 8, .max_tokens = 2}, /* chunks of 2 */
      {.block_size = 2, .self_blocks = 512, .cross_blocks = 96, .max_batch = 4, .max_tokens = 4}, /* rows: 4 beams */
  };
  const mode modes[] = {GREEDY, SAMPLE, BEAM};
  int checked = 0;
  for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++)
    for (int pos = 1; pos <= 4; pos++)
      for (size_t mi = 0; mi < 3; mi++)
        for (int tk = 0; tk < 2; tk++) {
          setup su = shapes[si];
          if (modes[mi] == BEAM && su.max_tokens < 4) continue; /* 4 beams need 4 logit rows */
          su.probe_pos = pos;
          int32_t tok = tk ? 50 : fx.req[1].prompt[pos < fx.req[1].n_prompt ? pos : 0];
          su.probe_tok = tok;
          run_ctx c;
          run(&fx, &su, modes[mi], all, fx.n, &c);
          for (int i = 0; i < fx.n; i++) {
            int p = pos - 1 < fx.req[i].n_prompt ? pos - 1 : fx.req[i].n_prompt - 1;
            double want = ref_prob(&fx, i, p, tok);
            const got *g = &c.g[i];
            cr_assert(g->finished && g->status == TD_OK && g->n_out > 0);
            for (int o = 0; o < g->n_out; o++) {
              cr_assert(g->has_probe[o], "shape %zu mode %zu request %d output %d: no probe", si, mi, i, o);
              cr_expect(fabs(g->probe[o] - want) <= 1e-4 * want + 1e-7,
                        "shape %zu mode %zu request %d position %d token %d: probe %.8g, reference %.8g", si, mi, i, p,
                        tok, g->probe[o], want);
              checked++;
            }
          }
          free_run(&c);
        }
  cr_expect(checked > 100);
  fx_free(&fx);
}

Test(engine_probe, refused_outside_the_prompt_or_vocabulary) {
  lim L;
  td_model_opts mo = {0};
  td_engine_opts eo = {0};
  lim_open(&L, &mo, &eo);
  td_request r = lim_request(&L);
  r.params.probe = true;
  r.params.probe_token = 100000;
  refused(&L, &r, TD_ERR_INVALID, "probe token 100000 is outside the vocabulary");
  r.params.probe_token = 5;
  r.params.probe_position = 1; /* the prompt is the start token alone */
  refused(&L, &r, TD_ERR_INVALID, "probe position 1 is outside the decoder prompt of 1 tokens");
  r.params.probe_position = -1;
  refused(&L, &r, TD_ERR_INVALID, "probe position -1 is outside");
  r.params.probe_position = 0;
  r.params.all_logits = true;
  refused(&L, &r, TD_ERR_INVALID, "a probe and all logits: one or the other");
  r.params.all_logits = false;
  runs(&L, &r, 1);
  lim_close(&L);
}
