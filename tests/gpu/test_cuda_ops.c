/* The CUDA backend against the CPU reference, op by op, on fresh random
 * inputs (seed printed; TD_TEST_SEED=N repeats a run) at several sizes,
 * odd ones included. Outputs are poisoned with NaN before each run, so an
 * element the kernel does not write fails; NaN never passes. Also: graph
 * capture + replay equals eager execution, and the GPU sampler follows the
 * CPU sampler (argmax exact, draws inside the allowed set, same seed same
 * token). Built in CI, run on the GPU machine. */
#include <time.h>
#include <unistd.h>

#include "cuda_test.h"

/* ---------------------------------------------------------------- memory */

Test(cuda, memory_roundtrip) {
  size_t n = 1000003;
  float *h = rnd(n, 100.0f), *back = malloc(sizeof(float) * n);
  void *d;
  cr_assert(td_alloc(G, TD_BUF_ACT, n, &d) == TD_OK);
  cr_assert(td_upload(G, TD_BUF_ACT, d, h, n) == TD_OK);
  cr_assert(td_download(G, TD_BUF_ACT, d, back, n) == TD_OK);
  cr_expect(memcmp(h, back, sizeof(float) * n) == 0, "bf16 round trip of bf16 values is exact");
  /* copies through pinned memory */
  void *pin, *d2;
  cr_assert(td_host_alloc(G, n * 2, &pin) == TD_OK);
  cr_assert(td_alloc(G, TD_BUF_ACT, n, &d2) == TD_OK);
  cr_assert(td_copy_d2h(G, pin, d, n * 2) == TD_OK);
  cr_assert(td_copy_h2d(G, d2, pin, n * 2) == TD_OK);
  void *d3;
  cr_assert(td_alloc(G, TD_BUF_ACT, n, &d3) == TD_OK);
  cr_assert(td_copy_d2d(G, d3, d2, n * 2) == TD_OK);
  cr_assert(td_sync(G) == TD_OK);
  memset(back, 0, sizeof(float) * n);
  cr_assert(td_download(G, TD_BUF_ACT, d3, back, n) == TD_OK);
  cr_expect(memcmp(h, back, sizeof(float) * n) == 0, "copies keep the data");
  /* raw 4-byte types */
  int32_t iv[7] = {1, -2, 3, 2147483647, -2147483647, 0, 42}, ib[7];
  cr_assert(td_alloc(G, TD_BUF_I32, 7, &d2) == TD_OK);
  cr_assert(td_upload(G, TD_BUF_I32, d2, (const float *)iv, 7) == TD_OK);
  cr_assert(td_download(G, TD_BUF_I32, d2, (float *)ib, 7) == TD_OK);
  cr_expect(memcmp(iv, ib, sizeof iv) == 0);
  cr_expect(td_buf_elem_size(G, TD_BUF_ACT) == 2 && td_buf_elem_size(G, TD_BUF_F32) == 4);
  cr_expect(td_backend_has_graphs(G));
  td_free(G, d);
  td_free(G, d2);
  td_free(G, d3);
  td_host_free(G, pin);
  free(h);
  free(back);
}

/* ---------------------------------------------------------------- norms, activations */

static void norm_case(int m, int n, bool rms, bool with_bias, bool inplace, bool no_weight) {
  float *x = rnd((size_t)m * n, 2.0f), *w = rnd(n, 0.2f), *b = rnd(n, 0.3f);
  for (size_t i = 0; i < (size_t)m * n; i++) x[i] = bfr(x[i] + 0.7f); /* a mean to remove */
  for (int i = 0; i < n; i++) w[i] += 1.0f;
  pair X = mk(TD_BUF_ACT, x, (size_t)m * n), W = mk(TD_BUF_F32, w, n), B = mk(TD_BUF_F32, b, n);
  pair Y = inplace ? X : mk(TD_BUF_ACT, NULL, (size_t)m * n);
  RUN2(td_norm(G, X.g, no_weight ? NULL : W.g, with_bias ? B.g : NULL, Y.g, m, n, 1e-6f, rms),
       td_norm(C, X.c, no_weight ? NULL : W.c, with_bias ? B.c : NULL, Y.c, m, n, 1e-6f, rms));
  double e = compare(&Y, 0);
  cr_expect(e <= TOL, "norm m=%d n=%d rms=%d bias=%d inplace=%d no_weight=%d: error %.3g", m, n, rms, with_bias,
            inplace, no_weight, e);
  drop(&X);
  drop(&W);
  drop(&B);
  if (!inplace) drop(&Y);
  free(x);
  free(w);
  free(b);
}

Test(cuda, norm) {
  /* widths of 256 * {2..6, 8, 10, 12, 16} take the warp-per-row kernel (odd row counts leave a block's
   * last warps idle); 256, 8200 and the unaligned ones the block kernel */
  static const int sz[][2] = {{1, 64},     {17, 1024}, {300, 1280}, {5, 40},   {3, 1001},  {2048, 512},
                              {2, 8200},   {1501, 1280}, {33, 4096}, {7, 768}, {3, 2560}, {5, 256}};
  for (size_t s = 0; s < sizeof sz / sizeof sz[0]; s++)
    for (int v = 0; v < 8; v++) norm_case(sz[s][0], sz[s][1], v & 1, v & 2, v == 4 || v == 5, v >= 6);
}

Test(cuda, gated_act) {
  static const int sz[][2] = {{3, 2816}, {17, 36}, {1, 7}, {100, 1024}};
  static const td_act acts[] = {TD_ACT_RELU, TD_ACT_GELU, TD_ACT_GELU_TANH, TD_ACT_SILU, TD_ACT_QUICK_GELU,
                                TD_ACT_NONE};
  for (size_t s = 0; s < sizeof sz / sizeof sz[0]; s++)
    for (size_t a = 0; a < sizeof acts / sizeof acts[0]; a++) {
      int m = sz[s][0], f = sz[s][1];
      float *x = rnd((size_t)m * 2 * f, 3.0f);
      pair X = mk(TD_BUF_ACT, x, (size_t)m * 2 * f), Y = mk(TD_BUF_ACT, NULL, (size_t)m * f);
      RUN2(td_gated_act(G, X.g, Y.g, m, f, acts[a]), td_gated_act(C, X.c, Y.c, m, f, acts[a]));
      double e = compare(&Y, 0);
      cr_expect(e <= TOL, "gated_act m=%d f=%d act=%d: error %.3g", m, f, acts[a], e);
      drop(&X);
      drop(&Y);
      free(x);
    }
}

/* ---------------------------------------------------------------- embedding and rows */

Test(cuda, embed_rows_im2col) {
  static const int cfg[][3] = {{300, 64, 37}, {32128, 1024, 5}, {301, 40, 1}, {50, 1280, 129}};
  for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
    int V = cfg[c][0], d = cfg[c][1], n = cfg[c][2], P = 60;
    float *tok = rnd((size_t)V * d, 1.0f), *pos = rnd((size_t)P * d, 1.0f);
    int32_t *ids = malloc(sizeof(int32_t) * n * 2), *ps = ids + n;
    for (int i = 0; i < n; i++) {
      ids[i] = irand(V);
      ps[i] = irand(P);
    }
    pair T = mk(TD_BUF_ACT, tok, (size_t)V * d), Pp = mk(TD_BUF_ACT, pos, (size_t)P * d);
    pair I = mk(TD_BUF_I32, ids, n), Q = mk(TD_BUF_I32, ps, n);
    for (int with_pos = 0; with_pos < 2; with_pos++) {
      float scale = with_pos ? 1.0f : sqrtf((float)d);
      pair Y = mk(TD_BUF_ACT, NULL, (size_t)n * d);
      RUN2(td_embed(G, I.g, Q.g, T.g, with_pos ? Pp.g : NULL, scale, Y.g, n, d),
           td_embed(C, I.c, Q.c, T.c, with_pos ? Pp.c : NULL, scale, Y.c, n, d));
      double e = compare(&Y, 0);
      cr_expect(e <= TOL, "embed V=%d d=%d n=%d pos=%d: error %.3g", V, d, n, with_pos, e);
      /* add_pos over n_seqs x len rows of Y */
      int len = n >= 4 ? 4 : 1, ns = n / len;
      RUN2(td_add_pos(G, Y.g, Pp.g, ns, len, d), td_add_pos(C, Y.c, Pp.c, ns, len, d));
      e = compare(&Y, 0);
      cr_expect(e <= TOL, "add_pos n_seqs=%d len=%d d=%d: error %.3g", ns, len, d, e);
      /* gather rows of the table */
      pair Z = mk(TD_BUF_ACT, NULL, (size_t)n * d);
      RUN2(td_gather_rows(G, T.g, I.g, Z.g, n, d), td_gather_rows(C, T.c, I.c, Z.c, n, d));
      e = compare(&Z, 0);
      cr_expect(e == 0.0, "gather_rows d=%d n=%d: error %.3g", d, n, e);
      drop(&Y);
      drop(&Z);
    }
    drop(&T);
    drop(&Pp);
    drop(&I);
    drop(&Q);
    free(tok);
    free(pos);
    free(ids);
  }
  static const int ic[][7] = {/* batch, c, t_in, k, stride, pad, channels_first */
                              {2, 80, 64, 3, 1, 1, 1},
                              {1, 64, 64, 3, 2, 1, 0},
                              {3, 5, 9, 3, 2, 0, 1},
                              {2, 7, 11, 4, 3, 2, 0},
                              /* channels last, k 3, c % 8 == 0: the 8-channel vector kernel */
                              {3, 24, 37, 3, 2, 1, 0},
                              {2, 40, 33, 3, 1, 1, 0},
                              {2, 16, 10, 3, 2, 0, 0},
                              {1, 1280, 17, 3, 2, 1, 0},
                              {2, 12, 9, 3, 2, 1, 0}};
  for (size_t c = 0; c < sizeof ic / sizeof ic[0]; c++) {
    int B = ic[c][0], ch = ic[c][1], t = ic[c][2], k = ic[c][3], st = ic[c][4], pd = ic[c][5];
    int to = (t + 2 * pd - k) / st + 1;
    float *x = rnd((size_t)B * ch * t, 1.0f);
    pair X = mk(TD_BUF_ACT, x, (size_t)B * ch * t), Y = mk(TD_BUF_ACT, NULL, (size_t)B * to * ch * k);
    RUN2(td_im2col1d(G, X.g, Y.g, B, ch, t, k, st, pd, ic[c][6]), td_im2col1d(C, X.c, Y.c, B, ch, t, k, st, pd, ic[c][6]));
    double e = compare(&Y, 0);
    cr_expect(e == 0.0, "im2col1d case %zu: error %.3g", c, e);
    drop(&X);
    drop(&Y);
    free(x);
  }
}

/* ---------------------------------------------------------------- sampling */

typedef struct hc {
  double v;
  int id;
} hc;

static int hc_cmp(const void *a, const void *b) {
  const hc *x = a, *y = b;
  if (x->v != y->v) return x->v > y->v ? -1 : 1;
  return x->id - y->id;
}

/* How many of the sorted candidates the CPU sampler keeps (processed row). */
static int kept_set(const float *x, int V, const td_sample_row *r, hc *c) {
  float mx = -INFINITY;
  for (int j = 0; j < V; j++) mx = x[j] > mx ? x[j] : mx;
  float inv_t = 1.0f / r->temperature;
  for (int j = 0; j < V; j++) c[j] = (hc){(x[j] - mx) * inv_t, j};
  qsort(c, V, sizeof *c, hc_cmp);
  int keep = r->top_k > 0 && r->top_k < V ? r->top_k : V;
  if (r->top_p < 1.0f) {
    double tot = 0.0, acc = 0.0;
    for (int j = 0; j < keep; j++) tot += exp(c[j].v);
    int k = 0;
    while (k < keep) {
      acc += exp(c[k].v) / tot;
      k++;
      if (acc >= r->top_p) break;
    }
    keep = k;
  }
  /* tolerate rounding at the edge of the nucleus */
  return keep < V ? keep + 1 : keep;
}

static void sample_case(int V, int n) {
  size_t N = (size_t)n * V;
  float *x = malloc(sizeof(float) * N);
  for (size_t i = 0; i < N; i++) x[i] = urand() * 6.0f;
  td_sample_row *rows = calloc(n, sizeof *rows);
  int32_t bans[5] = {0, 7, V - 1, 3, 12345 % V};
  for (int i = 0; i < n; i++) {
    td_sample_row *r = &rows[i];
    r->forced = -1;
    r->top_p = 1.0f;
    r->seed = next64();
    r->stream = (uint32_t)irand(4);
    r->step = (uint32_t)irand(1000);
    switch (i % 10) {
      case 0: break;                                            /* greedy */
      case 1: r->ban_start = 1, r->ban_count = 4; break;         /* greedy, banned tokens */
      case 2: r->forced = i % V; break;                          /* forced */
      case 3: r->temperature = 0.8f, r->top_k = 50; break;
      case 4: r->temperature = 1.0f, r->top_p = 0.9f; break;
      case 5: r->temperature = 1.3f, r->top_k = 2000, r->top_p = 0.95f; break;
      case 6: r->temperature = 1.0f; break;                      /* full distribution */
      case 7: r->temperature = 0.5f, r->top_k = 1; break;
      case 8: r->temperature = 2.0f, r->top_p = 0.3f, r->ban_start = 0, r->ban_count = 5; break;
      case 9: r->temperature = 0.7f, r->top_k = 1500; break;
    }
    if (i % 10 == 0 && i % 20 == 0) /* ties: argmax takes the lowest id */
      for (int j = 0; j < V; j++) x[(size_t)i * V + j] = (float)(j % 7 == 3 ? 2 : j % 3);
  }
  pair X = mk(TD_BUF_F32, x, N), R = mk(TD_BUF_F32, rows, n * sizeof *rows / 4), B = mk(TD_BUF_I32, bans, 5);
  pair TK = mk(TD_BUF_I32, NULL, n), LP = mk(TD_BUF_F32, NULL, n);
  RUN2(td_sample(G, X.g, n, V, R.g, B.g, TK.g, LP.g), td_sample(C, X.c, n, V, R.c, B.c, TK.c, LP.c));
  /* processed logits match */
  double e = compare(&X, 0);
  cr_expect(e <= 1e-7, "sample V=%d: processed logits differ (%.3g)", V, e);
  int32_t *tg = (int32_t *)get(G, &TK, true), *tc = (int32_t *)get(C, &TK, false);
  float *lg = get(G, &LP, true), *lc = get(C, &LP, false), *xp = get(C, &X, false);
  hc *cand = malloc(sizeof *cand * V);
  int sampled = 0, agree = 0;
  for (int i = 0; i < n; i++) {
    const td_sample_row *r = &rows[i];
    cr_expect(tg[i] >= 0 && tg[i] < V, "row %d: token %d outside the vocabulary", i, tg[i]);
    if (tg[i] < 0 || tg[i] >= V) continue;
    if (r->temperature <= 0.0f || r->forced >= 0) {
      cr_expect_eq(tg[i], tc[i], "V=%d row %d: argmax %d, CPU %d", V, i, tg[i], tc[i]);
    } else {
      int keep = kept_set(xp + (size_t)i * V, V, r, cand), ok = 0;
      for (int j = 0; j < keep && !ok; j++) ok = cand[j].id == tg[i];
      cr_expect(ok, "V=%d row %d: sampled token %d is outside the %d allowed", V, i, tg[i], keep);
      sampled++;
      agree += tg[i] == tc[i];
    }
    float d = fabsf(lg[i] - lc[i]);
    cr_expect(d <= 1e-3f + 1e-4f * fabsf(lc[i]), "V=%d row %d: logprob %g, CPU %g", V, i, lg[i], lc[i]);
  }
  cr_expect(agree * 10 >= sampled * 9, "V=%d: only %d of %d draws match the CPU sampler", V, agree, sampled);
  fprintf(stderr, "sample V=%d: %d of %d draws equal the CPU's\n", V, agree, sampled);
  /* same seed, same token */
  put(&X, x);
  poison(&TK);
  cr_assert(td_sample(G, X.g, n, V, R.g, B.g, TK.g, NULL) == TD_OK, "%s", td_errmsg());
  int32_t *t2 = (int32_t *)get(G, &TK, true);
  cr_expect(memcmp(t2, tg, sizeof(int32_t) * n) == 0, "V=%d: a second draw with the same seeds differs", V);
  drop(&X);
  drop(&R);
  drop(&B);
  drop(&TK);
  drop(&LP);
  free(x);
  free(rows);
  free(tg);
  free(tc);
  free(t2);
  free(lg);
  free(lc);
  free(xp);
  free(cand);
}

Test(cuda, sample) {
  sample_case(32128, 80);
  sample_case(1001, 61);
  sample_case(7, 20);
}

static void topk_case(int V, int n, int k) {
  size_t N = (size_t)n * V;
  float *x = malloc(sizeof(float) * N);
  for (size_t i = 0; i < N; i++) x[i] = urand() * 8.0f;
  td_sample_row *rows = calloc(n, sizeof *rows);
  int32_t bans[3] = {1, 2, V / 2};
  for (int i = 0; i < n; i++) {
    rows[i].forced = i % 5 == 4 ? (i * 31) % V : -1;
    rows[i].top_p = 1.0f;
    if (i % 3 == 1) rows[i].ban_count = 3;
  }
  pair X = mk(TD_BUF_F32, x, N), R = mk(TD_BUF_F32, rows, n * sizeof *rows / 4), B = mk(TD_BUF_I32, bans, 3);
  pair I = mk(TD_BUF_I32, NULL, (size_t)n * k), Vv = mk(TD_BUF_F32, NULL, (size_t)n * k);
  RUN2(td_topk_logprobs(G, X.g, n, V, R.g, B.g, k, I.g, Vv.g), td_topk_logprobs(C, X.c, n, V, R.c, B.c, k, I.c, Vv.c));
  double ex = compare(&X, 0);
  cr_expect(ex <= 1e-5, "topk V=%d: rows left as processed log-probs differ (%.3g)", V, ex);
  int32_t *ig = (int32_t *)get(G, &I, true), *ic = (int32_t *)get(C, &I, false);
  float *vg = get(G, &Vv, true), *vc = get(C, &Vv, false);
  int bad = 0;
  for (size_t i = 0; i < (size_t)n * k; i++) {
    bool same = ig[i] == ic[i] && (vg[i] == vc[i] || fabsf(vg[i] - vc[i]) <= 1e-4f + 1e-5f * fabsf(vc[i]));
    if (!same && bad++ < 5)
      cr_expect(same, "topk V=%d k=%d entry %zu: (%d, %g), CPU (%d, %g)", V, k, i, ig[i], vg[i], ic[i], vc[i]);
  }
  cr_expect(bad == 0, "topk V=%d k=%d: %d entries differ", V, k, bad);
  drop(&X);
  drop(&R);
  drop(&B);
  drop(&I);
  drop(&Vv);
  free(x);
  free(rows);
  free(ig);
  free(ic);
  free(vg);
  free(vc);
}

Test(cuda, topk_logprobs) {
  topk_case(32128, 9, 8);
  topk_case(32128, 3, 1024);
  topk_case(1001, 11, 64);
  topk_case(5, 4, 5);
  topk_case(50000, 2, 1);
}

/* ---------------------------------------------------------------- graphs */

typedef struct step_bufs {
  void *tok, *h, *x, *qkv, *att, *logits, *pool;
  void *wemb, *wqkv, *wo, *whead, *nw, *lut;
  void *ids, *qs, *ctx, *tab, *slots, *rows, *bans, *out_tok, *out_lp;
} step_bufs;

enum { GS = 5, GD = 256, GH = 4, GDH = 64, GV = 1001, GBS = 16, GNB = 40, GSTRIDE = 8 };

static td_status run_step(step_bufs *s, const td_kv_layout *l) {
  td_paged_meta m = {GS, GS, 1, GSTRIDE * GBS, s->qs, s->ctx, s->tab, GSTRIDE, false, true, NULL, 0, 0.0f};
  td_relbias rb = {s->lut, 16};
  TD_TRY(td_embed(G, s->ids, s->ids, s->wemb, NULL, 2.0f, s->h, GS, GD));
  /* a hint: inside a capture, a branch beside the stream */
  TD_TRY(td_kv_prefetch(G, s->pool, l, 0, &m));
  /* norm, QKV projection and KV write in one op */
  td_gemm_args qa = {.x = s->h, .w = s->wqkv, .y = s->qkv, .m = GS, .n = 3 * GD, .k = GD, .norm_w = s->nw,
                     .norm_eps = 1e-6f, .norm_rms = true, .scratch_norm = s->x, .kv_pool = s->pool, .kv_layout = l,
                     .kv_layer = 0, .kv_col = GD, .kv_slots = s->slots};
  TD_TRY(td_gemm_ex(G, &qa));
  TD_TRY(td_attn_paged(G, s->qkv, 3 * GD, s->att, s->pool, l, 0, &m, 0.125f, true, &rb));
  TD_TRY(td_gemm(G, s->att, s->wo, NULL, s->h, GS, GD, GD, TD_ACT_NONE, TD_GEMM_ACCUM));
  TD_TRY(td_gemm(G, s->h, s->whead, NULL, s->logits, GS, GV, GD, TD_ACT_NONE, TD_GEMM_OUT_F32));
  return td_sample(G, s->logits, GS, GV, s->rows, s->bans, s->out_tok, s->out_lp);
}

static void set_meta(step_bufs *s, void *pin, int variant) {
  int32_t *h = pin;
  int32_t *ids = h, *qs = ids + GS, *ctx = qs + GS + 1, *tab = ctx + GS, *slots = tab + GS * GSTRIDE;
  td_sample_row *rows = (td_sample_row *)(slots + GS + 1);
  qs[0] = 0;
  for (int i = 0; i < GS; i++) {
    ids[i] = irand(GV);
    qs[i + 1] = i + 1;
    ctx[i] = 1 + irand(GSTRIDE * GBS);
    if (variant && i == 2) ctx[i] = 0; /* padding row */
    for (int b = 0; b < GSTRIDE; b++) tab[i * GSTRIDE + b] = i * GSTRIDE + b;
    slots[i] = ctx[i] ? i * GSTRIDE * GBS + ctx[i] - 1 : -1;
    rows[i] = (td_sample_row){.temperature = i % 2 ? 0.9f : 0.0f, .top_k = 40, .top_p = 0.95f, .forced = -1,
                              .seed = next64(), .step = (uint32_t)variant};
  }
  cr_assert(td_copy_h2d(G, s->ids, ids, sizeof(int32_t) * GS) == TD_OK);
  cr_assert(td_copy_h2d(G, s->qs, qs, sizeof(int32_t) * (GS + 1)) == TD_OK);
  cr_assert(td_copy_h2d(G, s->ctx, ctx, sizeof(int32_t) * GS) == TD_OK);
  cr_assert(td_copy_h2d(G, s->tab, tab, sizeof(int32_t) * GS * GSTRIDE) == TD_OK);
  cr_assert(td_copy_h2d(G, s->slots, slots, sizeof(int32_t) * GS) == TD_OK);
  cr_assert(td_copy_h2d(G, s->rows, rows, sizeof(td_sample_row) * GS) == TD_OK);
  cr_assert(td_sync(G) == TD_OK);
}

static void *galloc(td_buf_type t, size_t n, float scale) {
  void *p;
  cr_assert(td_alloc(G, t, n, &p) == TD_OK, "%s", td_errmsg());
  if (scale > 0.0f) {
    float *h = rnd(n, scale);
    cr_assert(td_upload(G, t, p, h, n) == TD_OK, "%s", td_errmsg());
    free(h);
  }
  return p;
}

static void snapshot(step_bufs *s, float *logits, int32_t *tok) {
  cr_assert(td_sync(G) == TD_OK, "%s", td_errmsg());
  cr_assert(td_download(G, TD_BUF_F32, s->logits, logits, (size_t)GS * GV) == TD_OK);
  cr_assert(td_download(G, TD_BUF_I32, s->out_tok, (float *)tok, GS) == TD_OK);
}

Test(cuda, graph_replay) {
  /* td_kv_prefetch taken from one sequence */
  td_cuda_tuning t = cuda_base;
  t.kvpf_seqs = 1;
  use_tuning(&t);
  td_kv_layout l = {1, GH, GDH, GBS, 0, 0};
  step_bufs s;
  s.wemb = galloc(TD_BUF_ACT, (size_t)GV * GD, 1.0f);
  s.wqkv = galloc(TD_BUF_ACT, (size_t)3 * GD * GD, 0.1f);
  s.wo = galloc(TD_BUF_ACT, (size_t)GD * GD, 0.1f);
  s.whead = galloc(TD_BUF_ACT, (size_t)GV * GD, 0.1f);
  s.nw = galloc(TD_BUF_F32, GD, 1.0f);
  s.lut = galloc(TD_BUF_F32, GH * 33, 1.0f);
  s.pool = galloc(TD_BUF_ACT, td_kv_block_elems(&l) * GNB, 1.0f);
  s.h = galloc(TD_BUF_ACT, (size_t)GS * GD, 0.0f);
  s.x = galloc(TD_BUF_ACT, (size_t)GS * GD, 0.0f);
  s.qkv = galloc(TD_BUF_ACT, (size_t)GS * 3 * GD, 0.0f);
  s.att = galloc(TD_BUF_ACT, (size_t)GS * GD, 0.0f);
  s.logits = galloc(TD_BUF_F32, (size_t)GS * GV, 0.0f);
  s.ids = galloc(TD_BUF_I32, GS, 0.0f);
  s.qs = galloc(TD_BUF_I32, GS + 1, 0.0f);
  s.ctx = galloc(TD_BUF_I32, GS, 0.0f);
  s.tab = galloc(TD_BUF_I32, GS * GSTRIDE, 0.0f);
  s.slots = galloc(TD_BUF_I32, GS, 0.0f);
  s.rows = galloc(TD_BUF_I32, sizeof(td_sample_row) * GS / 4, 0.0f);
  s.bans = galloc(TD_BUF_I32, 4, 0.0f);
  s.out_tok = galloc(TD_BUF_I32, GS, 0.0f);
  s.out_lp = galloc(TD_BUF_F32, GS, 0.0f);
  void *pin;
  cr_assert(td_host_alloc(G, 4096, &pin) == TD_OK);
  float *le = malloc(sizeof(float) * GS * GV), *lr = malloc(sizeof(float) * GS * GV);
  int32_t te[GS], tr[GS];

  for (int variant = 0; variant < 2; variant++) {
    set_meta(&s, pin, variant);
    cr_assert(run_step(&s, &l) == TD_OK, "eager: %s", td_errmsg());
    snapshot(&s, le, te);
    td_graph *g = NULL;
    if (variant == 0) {
      cr_assert(td_graph_begin(G) == TD_OK, "%s", td_errmsg());
      td_status st = run_step(&s, &l);
      td_status st2 = td_graph_end(G, &g);
      cr_assert(st == TD_OK && st2 == TD_OK, "capture: %s", td_errmsg());
      /* replay twice: the graph reads the metadata buffers as they are now */
      for (int rep = 0; rep < 2; rep++) {
        cr_assert(td_graph_launch(G, g) == TD_OK, "%s", td_errmsg());
        snapshot(&s, lr, tr);
        cr_expect(memcmp(le, lr, sizeof(float) * GS * GV) == 0, "replay %d: logits differ from eager", rep);
        cr_expect(memcmp(te, tr, sizeof te) == 0, "replay %d: tokens differ from eager", rep);
      }
      /* new metadata at the same addresses, then replay against eager */
      set_meta(&s, pin, 1);
      cr_assert(td_graph_launch(G, g) == TD_OK, "%s", td_errmsg());
      snapshot(&s, lr, tr);
      cr_assert(run_step(&s, &l) == TD_OK, "eager: %s", td_errmsg());
      snapshot(&s, le, te);
      cr_expect(memcmp(le, lr, sizeof(float) * GS * GV) == 0, "replay with new metadata: logits differ from eager");
      cr_expect(memcmp(te, tr, sizeof te) == 0, "replay with new metadata: tokens differ from eager");
      td_graph_destroy(G, g);
    }
  }
  /* an op that fails during capture leaves the stream usable */
  cr_assert(td_graph_begin(G) == TD_OK);
  cr_expect(td_upload(G, TD_BUF_F32, s.logits, le, 4) != TD_OK, "synchronous upload refused while capturing");
  td_graph *g = NULL;
  (void)td_graph_end(G, &g);
  td_graph_destroy(G, g);
  cr_assert(run_step(&s, &l) == TD_OK, "after a failed capture: %s", td_errmsg());
  cr_assert(td_sync(G) == TD_OK, "%s", td_errmsg());
  free(le);
  free(lr);
  td_host_free(G, pin);
  void *bufs[] = {s.wemb, s.wqkv, s.wo, s.whead, s.nw, s.lut, s.pool, s.h, s.x, s.qkv, s.att, s.logits,
                  s.ids, s.qs, s.ctx, s.tab, s.slots, s.rows, s.bans, s.out_tok, s.out_lp};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) td_free(G, bufs[i]);
}

/* A layer-like chain at 17-64 rows, where cuBLASLt's kernels run between
 * ours, which trigger their successors before their own wait. The
 * intermediates are poisoned before every replay: a kernel that read its
 * input before its predecessor finished would see NaN. Replay must equal
 * eager bit for bit, and eager the CPU reference. (It caught programmatic
 * edges into cuBLASLt's kernels: docs/cuda.md, decode pass 8.) */
typedef struct lt_bufs {
  pair x, nw, w1, w2, w3, w4; /* inputs */
  pair h, a, b, ga, o;        /* intermediates and output (a) */
} lt_bufs;

static void lt_chain(lt_bufs *t, int m, int d, int f, bool gpu) {
  td_backend *b = gpu ? G : C;
#define P(q) (gpu ? t->q.g : t->q.c)
  cr_assert(td_norm(b, P(x), P(nw), NULL, P(h), m, d, 1e-6f, true) == TD_OK, "%s", td_errmsg());
  cr_assert(td_gemm(b, P(h), P(w1), NULL, P(a), m, d, d, TD_ACT_NONE, 0) == TD_OK, "%s", td_errmsg());
  cr_assert(td_gemm(b, P(a), P(w2), NULL, P(b), m, 2 * f, d, TD_ACT_NONE, 0) == TD_OK, "%s", td_errmsg());
  cr_assert(td_gated_act(b, P(b), P(ga), m, f, TD_ACT_GELU_TANH) == TD_OK, "%s", td_errmsg());
  cr_assert(td_gemm(b, P(ga), P(w3), NULL, P(o), m, d, f, TD_ACT_NONE, 0) == TD_OK, "%s", td_errmsg());
  cr_assert(td_gemm(b, P(o), P(w4), NULL, P(a), m, d, d, TD_ACT_NONE, TD_GEMM_ACCUM) == TD_OK, "%s", td_errmsg());
#undef P
}

static pair mk_rnd(td_buf_type ty, size_t n, float scale) {
  float *h = rnd(n, scale);
  pair p = mk(ty, h, n);
  free(h);
  return p;
}

Test(cuda, graph_cublaslt_chain) {
  static const int rows[] = {64, 17, 32};
  const int d = 1024, f = 2816;
  for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
    int m = rows[r];
    lt_bufs t = {
        .x = mk_rnd(TD_BUF_ACT, (size_t)m * d, 2.0f),
        .nw = mk_rnd(TD_BUF_F32, d, 1.0f),
        .w1 = mk_rnd(TD_BUF_ACT, (size_t)d * d, 0.05f),
        .w2 = mk_rnd(TD_BUF_ACT, (size_t)2 * f * d, 0.05f),
        .w3 = mk_rnd(TD_BUF_ACT, (size_t)d * f, 0.03f),
        .w4 = mk_rnd(TD_BUF_ACT, (size_t)d * d, 0.05f),
        .h = mk(TD_BUF_ACT, NULL, (size_t)m * d),
        .a = mk(TD_BUF_ACT, NULL, (size_t)m * d),
        .b = mk(TD_BUF_ACT, NULL, (size_t)m * 2 * f),
        .ga = mk(TD_BUF_ACT, NULL, (size_t)m * f),
        .o = mk(TD_BUF_ACT, NULL, (size_t)m * d),
    };
    lt_chain(&t, m, d, f, false);
    lt_chain(&t, m, d, f, true);
    double e = compare(&t.a, 0);
    /* five bf16-rounded steps in a row */
    cr_expect(e <= 3 * TOL, "chain m=%d eager: error %.3g against the CPU", m, e);
    float *eager = get(G, &t.a, true);
    td_graph *g = NULL;
    cr_assert(td_graph_begin(G) == TD_OK, "%s", td_errmsg());
    lt_chain(&t, m, d, f, true);
    cr_assert(td_graph_end(G, &g) == TD_OK, "capture: %s", td_errmsg());
    pair *mid[] = {&t.h, &t.b, &t.ga, &t.o, &t.a};
    for (int rep = 0; rep < 4; rep++) {
      for (size_t i = 0; i < sizeof mid / sizeof mid[0]; i++) poison_gpu(mid[i]);
      cr_assert(td_graph_launch(G, g) == TD_OK, "%s", td_errmsg());
      float *out = get(G, &t.a, true);
      size_t diff = 0;
      for (size_t i = 0; i < (size_t)m * d; i++) diff += memcmp(&out[i], &eager[i], sizeof(float)) != 0;
      cr_expect(diff == 0, "chain m=%d replay %d: %zu of %d outputs differ from eager", m, rep, diff, m * d);
      free(out);
    }
    td_graph_destroy(G, g);
    free(eager);
    pair *all[] = {&t.x, &t.nw, &t.w1, &t.w2, &t.w3, &t.w4, &t.h, &t.a, &t.b, &t.ga, &t.o};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) drop(all[i]);
  }
}

Test(cuda, rejects_bad_shapes) {
  void *p;
  cr_assert(td_alloc(G, TD_BUF_F32, 64, &p) == TD_OK);
  cr_expect(td_topk_logprobs(G, p, 1, 4096, p, NULL, 2000, p, p) != TD_OK, "k above the GPU limit");
  cr_expect(td_attn_dense(G, p, p, p, 1, 1, 1, 1, 512, 1.0f, false, NULL) != TD_OK, "head_dim above 256");
  cr_expect(td_gemm(G, p, p, NULL, p, 1, 1, 1, (td_act)99, 0) != TD_OK, "unknown activation");
  td_backend *b2;
  td_backend_opts o = {.kind = TD_BACKEND_CUDA, .device = 99};
  cr_expect(td_backend_create(&o, &b2) != TD_OK, "missing device");
  td_free(G, p);
}

Test(cuda, unshard_cols) {
  static const int cfg[][4] = {{2, 5, 16032, 32064}, {4, 3, 80, 301}, {1, 7, 33, 33}};
  for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
    int tp = cfg[c][0], rows = cfg[c][1], per = cfg[c][2], cols = cfg[c][3];
    float *parts = rnd((size_t)tp * rows * per, 5.0f);
    pair P = mk(TD_BUF_F32, parts, (size_t)tp * rows * per), O = mk(TD_BUF_F32, NULL, (size_t)rows * cols);
    RUN2(td_unshard_cols(G, P.g, O.g, tp, rows, per, cols), td_unshard_cols(C, P.c, O.c, tp, rows, per, cols));
    double e = compare(&O, 0);
    cr_expect(e == 0.0, "unshard_cols tp=%d rows=%d per=%d cols=%d: error %.3g", tp, rows, per, cols, e);
    drop(&P);
    drop(&O);
    free(parts);
  }
}
