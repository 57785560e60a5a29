/* The CPU model against the Hugging Face fixtures: encoder output, logits
 * of every decoder position (teacher forced, as one prompt chunk and token
 * by token through the paged cache), and greedy tokens. */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "fixture.h"
#include "kernels/act.h"
#include "kvcache/kvcache.h"
#include "model/model.h"
#include "tests/unit/fx_batch.h"

#define TOL 1e-4

typedef struct rig rig;
struct rig {
  td_backend *b;
  td_model *m;
  td_kv_pool *self, *cross;
  int bs;
};

/* rig_open's models' cross pool mode and the rows from which their steps
 * attend over the states (td_model_opts.cross_mode, states_rows) */
static td_cross_mode rig_mode;
static int rig_states_rows;
static td_model_tuning rig_tuning;
static int rig_max_enc; /* td_model_opts.max_enc_tokens (0: 256) */
/* set: encode() runs the encoder on this rig (cross mode states) and
 * projects the states it pushed into the decoding rig's blocks */
static struct rig *rig_sender;

static void rig_open(rig *r, const char *dir, int bs) {
  td_backend_opts bo = {.kind = TD_BACKEND_CPU};
  cr_assert(td_backend_create(&bo, &r->b) == TD_OK, "%s", td_errmsg());
  td_model_opts mo = {.block_size = bs, .max_tokens = 128, .max_seqs = 8, .max_logits = 128,
                      .max_enc_tokens = rig_max_enc ? rig_max_enc : 256, .max_enc_seqs = 4, .cross_mode = rig_mode,
                      .states_rows = rig_states_rows, .tuning = rig_tuning};
  cr_assert(td_model_load(dir, r->b, &mo, &r->m) == TD_OK, "%s", td_errmsg());
  td_kv_layout sl = td_model_self_layout(r->m), cl = td_model_cross_layout(r->m);
  cr_assert(td_kv_pool_create(r->b, &sl, 64, &r->self) == TD_OK, "%s", td_errmsg());
  cr_assert(td_kv_pool_create(r->b, &cl, 64, &r->cross) == TD_OK, "%s", td_errmsg());
  td_model_set_pools(r->m, td_kv_pool_memory(r->self), td_kv_pool_memory(r->cross));
  r->bs = bs;
}

static void rig_close(rig *r) {
  td_kv_pool_destroy(r->self);
  td_kv_pool_destroy(r->cross);
  td_model_destroy(r->m);
  td_backend_destroy(r->b);
}

static int argmax(const float *v, int n) {
  int best = 0;
  for (int i = 1; i < n; i++)
    if (v[i] > v[best]) best = i;
  return best;
}

/* Encodes request i into fresh cross blocks; returns their count. */
static int encode(rig *r, const fixture *fx, int i, int32_t *cross_blocks, float *enc_out) {
  const fx_request *q = &fx->req[i];
  int L = q->enc_len, nb = (L + r->bs - 1) / r->bs;
  cr_assert(td_kv_alloc(r->cross, nb, cross_blocks) == TD_OK);
  int32_t *slots = malloc(sizeof *slots * (size_t)L);
  for (int t = 0; t < L; t++) slots[t] = cross_blocks[t / r->bs] * r->bs + t % r->bs;
  td_encode_input in = {.n_seqs = 1, .lens = &q->n_input, .tokens = q->input_ids,
                        .features = fx->features ? fx->features + (size_t)i * fx->mels * fx->frames : NULL,
                        .cross_slots = slots};
  if (rig_sender) {
    /* a states push: the sender (cross mode states) encodes, its blocks'
     * states land in these blocks' tails, and they are projected here */
    int32_t sb[64];
    cr_assert(td_kv_alloc(rig_sender->cross, nb, sb) == TD_OK);
    int32_t *ss = malloc(sizeof *ss * (size_t)L);
    for (int t = 0; t < L; t++) ss[t] = sb[t / r->bs] * r->bs + t % r->bs;
    td_encode_input si = in;
    si.cross_slots = ss;
    cr_assert(td_model_encode(rig_sender->m, &si, enc_out) == TD_OK, "%s", td_errmsg());
    const td_kv_layout *sl = td_kv_pool_layout(rig_sender->cross), *dl = td_kv_pool_layout(r->cross);
    size_t sbe = td_kv_block_elems(sl), dbe = td_kv_block_elems(dl);
    cr_assert_eq(sl->n_layers, 0);
    const float *sp = td_kv_pool_memory(rig_sender->cross);
    float *dp = td_kv_pool_memory(r->cross);
    for (int k = 0; k < nb; k++)
      memcpy(dp + (size_t)cross_blocks[k] * dbe + dbe - sbe, sp + (size_t)sb[k] * sbe, sizeof(float) * sbe);
    cr_assert(td_model_project_cross(r->m, slots, L) == TD_OK, "%s", td_errmsg());
    /* the same K/V as this model's own encoder writes */
    int32_t rb[64];
    cr_assert(td_kv_alloc(r->cross, nb, rb) == TD_OK);
    for (int t = 0; t < L; t++) ss[t] = rb[t / r->bs] * r->bs + t % r->bs;
    cr_assert(td_model_encode(r->m, &si, NULL) == TD_OK, "%s", td_errmsg());
    double worst = 0;
    for (int t = 0; t < L; t++)
      for (int l = 0; l < dl->n_layers; l++) {
        td_kv_span sp2 = td_kv_layer_span(dl, l);
        for (int kv = 0; kv < 2; kv++)
          for (int h = 0; h < sp2.heads; h++)
            for (int e = 0; e < sp2.dim; e++) {
              size_t o = sp2.off + (((size_t)kv * sp2.heads + h) * dl->block_size + t % r->bs) * sp2.dim + e;
              double a = dp[(size_t)cross_blocks[t / r->bs] * dbe + o], b = dp[(size_t)rb[t / r->bs] * dbe + o];
              worst = fabs(a - b) > worst ? fabs(a - b) : worst;
            }
      }
    cr_expect(worst <= 1e-5, "request %d: projected cross K/V differs from the encoder's by %.3g", i, worst);
    td_kv_unref_all(r->cross, rb, nb);
    td_kv_unref_all(rig_sender->cross, sb, nb);
    free(ss);
  } else {
    cr_assert(td_model_encode(r->m, &in, enc_out) == TD_OK, "%s", td_errmsg());
  }
  free(slots);
  return nb;
}

static void check_model(const char *name, int bs) {
  fixture fx;
  fx_load(name, &fx);
  rig r;
  rig_open(&r, fx.dir, bs);
  int V = fx.vocab, d = fx.d_model;
  for (int i = 0; i < fx.n; i++) {
    const fx_request *q = &fx.req[i];
    int32_t cross_blocks[64], self_blocks[64];
    float *enc = malloc(sizeof(float) * (size_t)q->enc_len * d);
    int ncb = encode(&r, &fx, i, cross_blocks, enc);
    double e = fx_rel_err(enc, fx.enc_out + q->enc_off * d, (size_t)q->enc_len * d);
    cr_expect(e <= TOL, "%s request %d: encoder output error %.3g", name, i, e);
    free(enc);

    /* teacher forcing: the whole sequence as one chunk */
    int n = q->n_prompt + q->n_greedy - 1;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)n * 4);
    int32_t *pos = tok + n, *slots = pos + n, *rows = slots + n;
    memcpy(tok, q->prompt, sizeof(int32_t) * (size_t)q->n_prompt);
    memcpy(tok + q->n_prompt, q->greedy, sizeof(int32_t) * (size_t)(q->n_greedy - 1));
    int nsb = (n + bs - 1) / bs;
    cr_assert(td_kv_alloc(r.self, nsb, self_blocks) == TD_OK);
    for (int t = 0; t < n; t++) {
      pos[t] = t;
      slots[t] = self_blocks[t / bs] * bs + t % bs;
      rows[t] = t;
    }
    int32_t qs[2] = {0, n}, ctx = n, clen = q->enc_len;
    td_step_input st = {.n_seqs = 1, .n_tokens = n, .tokens = tok, .positions = pos, .q_start = qs,
                        .ctx_len = &ctx, .slots = slots, .block_table = self_blocks, .block_stride = nsb,
                        .cross_len = &clen, .cross_table = cross_blocks, .cross_stride = ncb,
                        .n_logits = n, .logit_rows = rows};
    const float *lg;
    cr_assert(td_model_step(r.m, &st, &lg) == TD_OK, "%s", td_errmsg());
    const float *ref = fx.logits + q->logits_off * V;
    e = fx_rel_err(lg, ref, (size_t)n * V);
    cr_expect(e <= TOL, "%s request %d: teacher-forced logits error %.3g", name, i, e);
    td_kv_unref_all(r.self, self_blocks, nsb);

    /* incremental: the prompt, then one token a step, greedy */
    cr_assert(td_kv_alloc(r.self, nsb + 1, self_blocks) == TD_OK);
    int P = q->n_prompt;
    for (int t = 0; t < P; t++) slots[t] = self_blocks[t / bs] * bs + t % bs;
    int32_t last = P - 1;
    qs[1] = P;
    ctx = P;
    st.n_tokens = P;
    st.tokens = q->prompt;
    st.block_stride = nsb + 1;
    st.n_logits = 1;
    st.logit_rows = &last;
    double worst = 0.0;
    int32_t zero = 0;
    for (int k = 0; k < q->n_greedy; k++) {
      cr_assert(td_model_step(r.m, &st, &lg) == TD_OK, "%s", td_errmsg());
      int row = P - 1 + k;
      double ek = fx_rel_err(lg, ref + (size_t)row * V, (size_t)V);
      worst = ek > worst ? ek : worst;
      int next = argmax(lg, V);
      cr_expect_eq(next, q->greedy[k], "%s request %d: greedy token %d is %d, reference %d", name, i, k, next,
                   q->greedy[k]);
      if (k + 1 == q->n_greedy) break;
      /* feed the reference token so later steps stay comparable */
      int32_t p = P + k;
      tok[0] = q->greedy[k];
      pos[0] = p;
      slots[0] = self_blocks[p / bs] * bs + p % bs;
      qs[1] = 1;
      ctx = p + 1;
      st.n_tokens = 1;
      st.tokens = tok;
      st.positions = pos;
      st.slots = slots;
      st.logit_rows = &zero;
      last = 0;
    }
    cr_expect(worst <= TOL, "%s request %d: incremental logits error %.3g", name, i, worst);
    td_kv_unref_all(r.self, self_blocks, nsb + 1);
    td_kv_unref_all(r.cross, cross_blocks, ncb);
    free(tok);
  }
  cr_expect_eq(td_kv_pool_num_free(r.self), 64);
  cr_expect_eq(td_kv_pool_num_free(r.cross), 64);
  rig_close(&r);
  fx_free(&fx);
}

#define MODEL_TEST(id, name)                  \
  Test(model_cpu, id) {                       \
    check_model(name, 4);                     \
    check_model(name, 3);                     \
  }

MODEL_TEST(t5_tiny, "t5-tiny")
MODEL_TEST(bart_tiny, "bart-tiny")
MODEL_TEST(whisper_tiny, "whisper-tiny")
MODEL_TEST(t5v11_gated, "t5v11-gated-untied")
MODEL_TEST(mt5_silu, "mt5-silu-tied")
MODEL_TEST(mbart_prenorm, "mbart-prenorm-sharded")
MODEL_TEST(marian_sinusoidal, "marian-sinusoidal")
MODEL_TEST(bart_untied, "bart-untied-gelunew")
MODEL_TEST(whisper_128mel, "whisper-128mel")
MODEL_TEST(t5_untied_head, "t5-gated-untied-head")
MODEL_TEST(t5_four_layers, "t5-four-layers")
MODEL_TEST(whisper_four_layers, "whisper-four-layers")

/* Pre-norm decoders fold their norms into the next linear layer at load
 * (T5's RMSNorm weights; Whisper's and mBART's LayerNorm weights and
 * biases); with the fold off (the norm applied as its own op) the model
 * must match the same references. */
/* The activations' formulas (kernels/act.h, shared with the GPU) against
 * their definitions in double: exact GELU through erf, gelu_tanh through
 * tanh, SiLU; absolute error, and relative error where the value is not
 * tiny (the left tail of exact GELU keeps 5e-5 down to x = -3). */
Test(model_cpu, activations_match_their_definitions) {
  double worst[3] = {0}, worst_rel = 0;
  for (int i = -200000; i <= 200000; i++) {
    float x = (float)i * 6e-5f; /* [-12, 12] */
    double xd = x, ref[3] = {0.5 * xd * (1.0 + erf(xd / sqrt(2.0))),
                             0.5 * xd * (1.0 + tanh(0.7978845608028654 * (xd + 0.044715 * xd * xd * xd))),
                             xd / (1.0 + exp(-xd))};
    float got[3] = {td_act_apply(TD_ACT_GELU, x), td_act_apply(TD_ACT_GELU_TANH, x), td_act_apply(TD_ACT_SILU, x)};
    for (int k = 0; k < 3; k++) {
      double e = fabs(got[k] - ref[k]);
      if (e > worst[k]) worst[k] = e;
    }
    if (x > -3.0f && fabs(ref[0]) > 1e-30) {
      double r = fabs(got[0] - ref[0]) / fabs(ref[0]);
      if (r > worst_rel) worst_rel = r;
    }
  }
  cr_expect(worst[0] < 1e-6, "exact GELU: |error| %.3g", worst[0]);
  cr_expect(worst_rel < 1e-4, "exact GELU above -3: relative error %.3g", worst_rel);
  cr_expect(worst[1] < 1e-6, "gelu_tanh: |error| %.3g", worst[1]);
  cr_expect(worst[2] < 1e-5, "SiLU: |error| %.3g", worst[2]);
  /* the tails saturate without overflow: exp underflows to 0, the reciprocal of 1 + inf is 0 */
  cr_expect(td_act_apply(TD_ACT_GELU, -40.0f) == 0.0f && td_act_apply(TD_ACT_GELU, 40.0f) == 40.0f);
  cr_expect(td_act_apply(TD_ACT_GELU_TANH, -40.0f) == 0.0f && td_act_apply(TD_ACT_GELU_TANH, 40.0f) == 40.0f);
}

Test(model_cpu, norm_unfolded) {
  rig_tuning.norm_fold = TD_OFF;
  check_model("t5v11-gated-untied", 4);
  check_model("t5-tiny", 3);
  check_model("whisper-tiny", 4);
  check_model("mbart-prenorm-sharded", 3);
  rig_tuning.norm_fold = 0;
}

/* The cross K/V of several decoder layers in one GEMM (their weights one
 * matrix, td_model_tuning.ckv_batch): as many layers as the encoder's FFN
 * workspace holds at a run's rows, the rest in further GEMMs. The workspace
 * sized by max_enc_tokens makes t5-four-layers' inputs of 1-33 tokens take
 * all four layers at once (256), and at 40 and 34 one, two or three at once
 * with the rest after, or a GEMM a layer; off, a GEMM a layer throughout.
 * Every split must match the references. */
Test(model_cpu, cross_kv_layers_at_once) {
  static const int caps[] = {256, 40, 34};
  for (size_t i = 0; i < sizeof caps / sizeof caps[0]; i++) {
    rig_max_enc = caps[i];
    check_model("t5-four-layers", 4);
    check_model("whisper-four-layers", 3);
  }
  rig_max_enc = 0;
  rig_tuning.ckv_batch = TD_OFF;
  check_model("t5-four-layers", 4);
  check_model("whisper-four-layers", 4);
  check_model("bart-tiny", 3);
  rig_tuning.ckv_batch = 0;
}

/* The cross pool holding encoder states instead of per-layer K/V: every
 * fixture family (T5 without biases, BART / mBART / Marian / Whisper with
 * K and V biases, pre- and post-norm, folded norms or not) must match the
 * same references, prompt chunks and decode rows. */
Test(model_cpu, cross_states) {
  rig_mode = TD_CROSS_STATES;
  static const char *names[] = {"t5-tiny", "bart-tiny", "whisper-tiny", "t5v11-gated-untied", "mt5-silu-tied",
                                "mbart-prenorm-sharded", "marian-sinusoidal", "bart-untied-gelunew",
                                "whisper-128mel", "t5-gated-untied-head"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) check_model(names[i], i % 2 ? 3 : 4);
  rig_tuning.norm_fold = TD_OFF;
  check_model("t5v11-gated-untied", 4);
  rig_tuning.norm_fold = 0;
  rig_mode = TD_CROSS_AUTO;
}

/* Both in the cross pool (the default where d_model is even): steps of two
 * rows or more attend over the states, single rows over the K/V, so that
 * one request's prompt chunks and decode rows cross between the two
 * paths; every fixture family must still match its references. */
Test(model_cpu, cross_dual) {
  rig_mode = TD_CROSS_DUAL;
  rig_states_rows = 2;
  static const char *names[] = {"t5-tiny", "bart-tiny", "whisper-tiny", "mbart-prenorm-sharded", "marian-sinusoidal",
                                "t5-gated-untied-head"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) check_model(names[i], i % 2 ? 3 : 4);
  rig_mode = TD_CROSS_AUTO;
  rig_states_rows = 0;
}

/* States projected on arrival: a sender in cross mode states encodes, its
 * states tail is copied into a dual pool's blocks (what a states push
 * moves) and td_model_project_cross writes every layer's K/V there; the K/V
 * equal the receiver's own encoder's, and logits and greedy tokens match
 * the references (T5 without biases, BART / Whisper with K/V biases). */
Test(model_cpu, cross_states_projected) {
  static const char *names[] = {"t5-tiny", "bart-tiny", "whisper-tiny", "mbart-prenorm-sharded", "marian-sinusoidal",
                                "t5v11-gated-untied"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    fixture fx;
    fx_load(names[i], &fx);
    rig snd;
    rig_mode = TD_CROSS_STATES;
    int bs = i % 2 ? 3 : 4;
    rig_open(&snd, fx.dir, bs);
    rig_mode = TD_CROSS_DUAL;
    rig_states_rows = -1; /* the receiver's steps over the projected K/V only */
    rig_sender = &snd;
    check_model(names[i], bs);
    rig_sender = NULL;
    rig_mode = TD_CROSS_AUTO;
    rig_states_rows = 0;
    cr_expect_eq(td_kv_pool_num_free(snd.cross), 64);
    rig_close(&snd);
    fx_free(&fx);
  }
}

/* A pool without a states tail, or without K/V, has nothing to project. */
Test(model_cpu, project_cross_needs_dual) {
  fixture fx;
  fx_load("t5-tiny", &fx);
  const td_cross_mode modes[] = {TD_CROSS_KV, TD_CROSS_STATES};
  for (int k = 0; k < 2; k++) {
    rig r;
    rig_mode = modes[k];
    rig_open(&r, fx.dir, 4);
    int32_t slot = 0;
    cr_expect_eq(td_model_project_cross(r.m, &slot, 1), TD_ERR_INVALID);
    cr_expect(strstr(td_errmsg(), k ? "per-layer K/V" : "encoder states"), "%s", td_errmsg());
    rig_close(&r);
  }
  rig_mode = TD_CROSS_AUTO;
  fx_free(&fx);
}

/* The cross layout each mode gives, and AUTO as DUAL (where d_model is
 * even) on a backend where the states never pay: every step takes the K/V. */
Test(model_cpu, cross_layouts) {
  fixture fx;
  fx_load("t5-tiny", &fx);
  static const td_cross_mode modes[] = {TD_CROSS_AUTO, TD_CROSS_KV, TD_CROSS_STATES, TD_CROSS_DUAL};
  for (size_t i = 0; i < 4; i++) {
    rig_mode = modes[i];
    rig r;
    rig_open(&r, fx.dir, 4);
    const td_model_config *c = td_model_get_config(r.m);
    td_kv_layout cl = td_model_cross_layout(r.m);
    td_cross_mode got = td_model_get_opts(r.m)->cross_mode;
    cr_expect_eq(got, modes[i] == TD_CROSS_AUTO ? TD_CROSS_DUAL : modes[i], "mode %s resolved to %s",
                 td_cross_mode_name(modes[i]), td_cross_mode_name(got));
    cr_expect_eq(cl.n_layers, got == TD_CROSS_STATES ? 0 : c->dec_layers, "%s: %d layers", td_cross_mode_name(got),
                 cl.n_layers);
    cr_expect_eq(cl.states, got == TD_CROSS_KV ? 0 : c->d_model, "%s: states %d", td_cross_mode_name(got), cl.states);
    cr_expect_eq(td_model_states_rows(r.m), got == TD_CROSS_STATES ? 0 : INT_MAX, "%s: states from %d rows",
                 td_cross_mode_name(got), td_model_states_rows(r.m));
    for (int rows = 1; rows <= 256; rows *= 4)
      cr_expect_eq(td_model_takes_states(r.m, rows), got == TD_CROSS_STATES, "%s: %d rows", td_cross_mode_name(got),
                   rows);
    rig_close(&r);
  }
  /* rows set by hand (td_model_opts.states_rows): from them on, whatever the backend would choose */
  rig_mode = TD_CROSS_DUAL;
  rig_states_rows = 3;
  rig r;
  rig_open(&r, fx.dir, 4);
  cr_expect(!td_model_takes_states(r.m, 2) && td_model_takes_states(r.m, 3) && td_model_takes_states(r.m, 97));
  int ranges[2][2] = {{0, 0}, {0, 0}};
  cr_expect_eq(td_model_states_ranges(r.m, 40, ranges, 2), 1);
  cr_expect(ranges[0][0] == 3 && ranges[0][1] == 40, "%d-%d", ranges[0][0], ranges[0][1]);
  rig_close(&r);
  rig_states_rows = 0; /* the CPU's own choice: never */
  rig_open(&r, fx.dir, 4);
  cr_expect_eq(td_model_states_ranges(r.m, 40, ranges, 2), 0);
  rig_close(&r);
  rig_states_rows = 0;
  rig_mode = TD_CROSS_AUTO;
  fx_free(&fx);
}

/* A CPU backend and one buffer of n elements of type t on it. */
static td_backend *cpu_with_buffer(td_buf_type t, size_t n, void **p) {
  td_backend *b = NULL;
  td_backend_opts o = {.kind = TD_BACKEND_CPU};
  cr_assert(td_backend_create(&o, &b) == TD_OK, "%s", td_errmsg());
  *p = NULL;
  cr_assert(td_alloc(b, t, n, p) == TD_OK, "%s", td_errmsg());
  return b;
}

/* A plain LayerNorm (weights folded into W) cannot be fused without W's
 * row sums: td_gemm_ex says so on every backend. */
Test(model_cpu, gemm_ex_plain_layernorm_needs_row_sums) {
  void *p;
  td_backend *b = cpu_with_buffer(TD_BUF_F32, 256, &p);
  td_gemm_args a = {.x = p, .w = p, .y = p, .m = 1, .n = 8, .k = 8, .norm_plain = true, .norm_rms = false,
                    .norm_eps = 1e-5f, .scratch_norm = p, .scratch_glu = p};
  cr_expect(td_gemm_ex(b, &a) != TD_OK, "a plain LayerNorm without row sums");
  cr_expect(strstr(td_errmsg(), "row sums") != NULL, "%s", td_errmsg());
  a.norm_wsum = p;
  a.norm_w = p;
  cr_expect(td_gemm_ex(b, &a) != TD_OK, "a plain norm with a weight");
  td_free(b, p);
  td_backend_destroy(b);
}

/* td_kv_prefetch is a hint: bad arguments are refused, good ones change
 * nothing on a backend without it. */
Test(model_cpu, kv_prefetch_hint) {
  void *p;
  td_backend *b = cpu_with_buffer(TD_BUF_I32, 64, &p);
  td_kv_layout l = {2, 2, 8, 4, 0, 0};
  td_paged_meta m = {.n_seqs = 1, .n_tokens = 1, .max_q = 1, .max_ctx = 4, .q_start = p, .ctx_len = p,
                     .block_table = p, .max_blocks = 1};
  cr_expect(td_kv_prefetch(b, p, &l, 1, &m) == TD_OK, "%s", td_errmsg());
  cr_expect(td_kv_prefetch(b, p, &l, 2, &m) == TD_ERR_INVALID, "layer past the layout");
  cr_expect(strstr(td_errmsg(), "kv_prefetch") != NULL, "%s", td_errmsg());
  cr_expect(td_kv_prefetch(b, NULL, &l, 0, &m) == TD_ERR_INVALID, "no pool");
  cr_expect(td_kv_prefetch(b, p, &l, 0, NULL) == TD_ERR_INVALID, "no metadata");
  m.max_blocks = 0;
  cr_expect(td_kv_prefetch(b, p, &l, 0, &m) == TD_ERR_INVALID, "no blocks a sequence");
  m.max_blocks = 1;
  m.block_table = NULL;
  cr_expect(td_kv_prefetch(b, p, &l, 0, &m) == TD_ERR_INVALID, "no block table");
  td_free(b, p);
  td_backend_destroy(b);
}

/* The last call a model published to its followers (td_model_set_mirror). */
typedef struct captured {
  void *bytes;
  size_t len;
} captured;

static td_status capture_call(void *ctx, const void *bytes, size_t len) {
  captured *c = ctx;
  free(c->bytes);
  c->bytes = malloc(len);
  cr_assert(c->bytes);
  memcpy(c->bytes, bytes, len);
  c->len = len;
  return TD_OK;
}

/* Replays c with the int32 at index i of its bytes set to v. */
static td_status replay_with(rig *r, const captured *c, int i, int32_t v) {
  int32_t *p = malloc(c->len);
  cr_assert(p && (size_t)(i + 1) * 4 <= c->len);
  memcpy(p, c->bytes, c->len);
  p[i] = v;
  td_status s = td_model_replay(r->m, p, c->len);
  free(p);
  return s;
}

/* A group's projection is mirrored: the follower's replay projects the
 * same slots; a count beyond the bytes is refused. */
Test(model_cpu, mirror_replays_projection) {
  fixture fx;
  fx_load("t5-tiny", &fx);
  rig r;
  rig_mode = TD_CROSS_DUAL;
  rig_open(&r, fx.dir, 4);
  int32_t cross_blocks[64];
  encode(&r, &fx, 0, cross_blocks, NULL);
  int L = fx.req[0].enc_len;
  int32_t slots[256];
  for (int t = 0; t < L; t++) slots[t] = cross_blocks[t / 4] * 4 + t % 4;
  captured proj = {0};
  td_model_mirror mir = {capture_call, &proj};
  td_model_set_mirror(r.m, &mir);
  cr_assert(td_model_project_cross(r.m, slots, L) == TD_OK, "%s", td_errmsg());
  td_model_set_mirror(r.m, NULL);
  cr_assert(proj.bytes, "the projection was not published");
  cr_expect_eq(proj.len, (size_t)(3 + L) * 4, "magic, kind, count and %d slots: %zu bytes", L, proj.len);
  cr_expect(td_model_replay(r.m, proj.bytes, proj.len) == TD_OK, "%s", td_errmsg());
  cr_expect_eq(replay_with(&r, &proj, 2, L + 1), TD_ERR_FORMAT, "%d slots in the bytes of %d: %s", L + 1, L,
               td_errmsg());
  cr_expect(strstr(td_errmsg(), "truncated projection"), "%s", td_errmsg());
  free(proj.bytes);
  rig_close(&r);
  rig_mode = TD_CROSS_AUTO;
  fx_free(&fx);
}

/* A follower replays what the leader published; a call whose arrays do
 * not hold what its counts say is refused before anything reads them. */
Test(model_cpu, mirror_replay_checks_counts) {
  fixture fx;
  fx_load("t5-tiny", &fx);
  rig r;
  rig_open(&r, fx.dir, 4);
  captured enc = {0}, step = {0};
  td_model_mirror mir = {capture_call, &enc};
  td_model_set_mirror(r.m, &mir);
  int32_t cross_blocks[64], self_block;
  int ncb = encode(&r, &fx, 0, cross_blocks, NULL);
  mir.ctx = &step;
  td_model_set_mirror(r.m, &mir);
  cr_assert(td_kv_alloc(r.self, 1, &self_block) == TD_OK);
  int32_t tok = 0, pos = 0, qs[2] = {0, 1}, ctx = 1, slot = self_block * 4, clen = fx.req[0].enc_len, row = 0;
  td_step_input st = {.n_seqs = 1, .n_tokens = 1, .tokens = &tok, .positions = &pos, .q_start = qs,
                      .ctx_len = &ctx, .slots = &slot, .block_table = &self_block, .block_stride = 1,
                      .cross_len = &clen, .cross_table = cross_blocks, .cross_stride = ncb,
                      .n_logits = 1, .logit_rows = &row};
  const float *lg;
  cr_assert(td_model_step(r.m, &st, &lg) == TD_OK, "%s", td_errmsg());
  td_model_set_mirror(r.m, NULL);
  cr_expect(td_model_replay(r.m, enc.bytes, enc.len) == TD_OK, "%s", td_errmsg());
  cr_expect(td_model_replay(r.m, step.bytes, step.len) == TD_OK, "%s", td_errmsg());
  /* the header: magic, kind, then the encode's n_seqs / the step's S, T, block and cross table widths */
  cr_expect_eq(replay_with(&r, &enc, 2, 2), TD_ERR_FORMAT, "an encode of 2 sequences, 1 length: %s", td_errmsg());
  cr_expect_eq(replay_with(&r, &step, 3, 2), TD_ERR_FORMAT, "a step of 2 tokens, 1 token id: %s", td_errmsg());
  cr_expect_eq(replay_with(&r, &step, 5, ncb + 1), TD_ERR_FORMAT, "a cross table wider than its values: %s",
               td_errmsg());
  cr_expect(strstr(td_errmsg(), "mirror: step arrays"), "%s", td_errmsg());
  free(enc.bytes);
  free(step.bytes);
  rig_close(&r);
  fx_free(&fx);
}

static const float *cpu_step(void *ctx, const td_step_input *st) {
  const float *lg = NULL;
  cr_assert(td_model_step(ctx, st, &lg) == TD_OK, "%s", td_errmsg());
  return lg;
}

/* Decode steps over several sequences at once against the references. */

/* Decode steps over several sequences at once against the references: the
 * cross query's norm in the attention (the CPU's default) and before the
 * projection (td_model_tuning.qnorm_rows above the rows), over per-layer K/V or
 * encoder states. */
static void batched_decode(td_cross_mode mode, int states_rows) {
  static const char *qn_rows[] = {NULL, "1000"};
  rig_mode = mode;
  rig_states_rows = states_rows;
  for (size_t v = 0; v < 2; v++)
  for (size_t i = 0; i < FX_BATCH_MODELS; i++) {
    fixture fx;
    fx_load(fx_batch_models[i], &fx);
    rig r;
    rig_tuning.qnorm_rows = qn_rows[v] ? atoi(qn_rows[v]) : 0;
    rig_open(&r, fx.dir, 4);
    rig_tuning.qnorm_rows = 0;
    fx_batch_result res = fx_batched_decode(&fx, r.m, r.self, r.cross, 4, cpu_step, r.m, 0.0);
    fx_batch_expect(fx_batch_models[i], qn_rows[v], res, TOL);
    rig_close(&r);
    fx_free(&fx);
  }
  rig_mode = TD_CROSS_AUTO;
  rig_states_rows = 0;
}

Test(model_cpu, batched_decode) { batched_decode(TD_CROSS_KV, 0); }
Test(model_cpu, batched_decode_cross_states) { batched_decode(TD_CROSS_STATES, 0); }
/* dual: the larger steps over the states, the smaller over the K/V */
Test(model_cpu, batched_decode_cross_dual) { batched_decode(TD_CROSS_DUAL, 3); }
