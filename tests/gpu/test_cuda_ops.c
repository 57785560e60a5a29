/* The CUDA backend against the CPU reference, op by op, on fresh random
 * inputs (seed printed; TD_TEST_SEED=N repeats a run) at several sizes,
 * odd ones included. Outputs are poisoned with NaN before each run, so an
 * element the kernel does not write fails; NaN never passes. Also: graph
 * capture + replay equals eager execution, and the GPU sampler follows the
 * CPU sampler (argmax exact, draws inside the allowed set, same seed same
 * token). Built in CI, run on the GPU machine. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/half.h"
#include "common/status.h"
#include "kernels/ops.h"

#define TOL 1e-2

static td_backend *G, *C;
static uint64_t rs;

static uint64_t next64(void) {
  uint64_t z = (rs += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static float urand(void) { return (float)((double)(next64() >> 40) / 16777216.0) * 2.0f - 1.0f; }
static int irand(int n) { return (int)(next64() % (uint64_t)n); }
static float bfr(float x) { return td_bf16_to_f32(td_f32_to_bf16(x)); }

static void setup(void) {
  const char *s = getenv("TD_TEST_SEED");
  rs = s ? strtoull(s, NULL, 10) : ((uint64_t)time(NULL) * 1000003u) ^ (uint64_t)getpid();
  fprintf(stderr, "seed %llu\n", (unsigned long long)rs);
  td_backend_opts go = {.kind = TD_BACKEND_CUDA, .device = 0}, co = {.kind = TD_BACKEND_CPU};
  cr_assert(td_backend_create(&go, &G) == TD_OK, "cuda backend: %s", td_errmsg());
  cr_assert(td_backend_create(&co, &C) == TD_OK, "cpu backend: %s", td_errmsg());
}

static void teardown(void) {
  td_backend_destroy(G);
  td_backend_destroy(C);
}

TestSuite(cuda, .init = setup, .fini = teardown, .timeout = 600);

/* random bf16-representable values in [-scale, scale) */
static float *rnd(size_t n, float scale) {
  float *a = malloc(sizeof(float) * (n ? n : 1));
  cr_assert(a);
  for (size_t i = 0; i < n; i++) a[i] = bfr(urand() * scale);
  return a;
}

/* The same buffer on both backends. */
typedef struct pair {
  void *g, *c;
  size_t n;
  td_buf_type t;
} pair;

static void put(pair *p, const void *h) {
  cr_assert(td_upload(G, p->t, p->g, h, p->n) == TD_OK, "%s", td_errmsg());
  cr_assert(td_upload(C, p->t, p->c, h, p->n) == TD_OK, "%s", td_errmsg());
}

static void poison(pair *p) {
  float *nan = malloc(sizeof(float) * (p->n ? p->n : 1));
  for (size_t i = 0; i < p->n; i++) nan[i] = NAN;
  if (p->t == TD_BUF_I32) memset(nan, 0x7f, sizeof(float) * p->n);
  put(p, nan);
  free(nan);
}

static void poison_gpu(pair *p) {
  float *nan = malloc(sizeof(float) * (p->n ? p->n : 1));
  for (size_t i = 0; i < p->n; i++) nan[i] = NAN;
  cr_assert(td_upload(G, p->t, p->g, nan, p->n) == TD_OK, "%s", td_errmsg());
  free(nan);
}

/* h NULL: poisoned */
static pair mk(td_buf_type t, const void *h, size_t n) {
  pair p = {NULL, NULL, n, t};
  cr_assert(td_alloc(G, t, n, &p.g) == TD_OK, "%s", td_errmsg());
  cr_assert(td_alloc(C, t, n, &p.c) == TD_OK, "%s", td_errmsg());
  if (h) put(&p, h);
  else poison(&p);
  return p;
}

static void drop(pair *p) {
  td_free(G, p->g);
  td_free(C, p->c);
}

static float *get(td_backend *b, const pair *p, bool gpu) {
  float *h = malloc(sizeof(float) * (p->n ? p->n : 1));
  cr_assert(td_sync(b) == TD_OK, "%s", td_errmsg());
  cr_assert(td_download(b, p->t, gpu ? p->g : p->c, h, p->n) == TD_OK, "%s", td_errmsg());
  return h;
}

/* ||out - ref|| / ||ref||; any NaN or infinity in out where ref is finite fails */
static double relerr(const float *out, const float *ref, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; i++) {
    if (!isfinite(out[i])) {
      if (isfinite(ref[i]) || isnan(out[i]) || out[i] != ref[i]) return INFINITY;
      continue;
    }
    double d = (double)out[i] - ref[i];
    num += d * d;
    den += (double)ref[i] * ref[i];
  }
  if (den == 0.0) return num == 0.0 ? 0.0 : INFINITY;
  return sqrt(num / den);
}

/* After a failed comparison of an [m, n] output: where it went wrong. */
static void explain(const pair *p, int m, int n) {
  float *o = get(G, p, true), *r = get(C, p, false);
  int shown = 0, bad = 0;
  for (int i = 0; i < m; i++)
    for (int j = 0; j < n; j++) {
      float d = fabsf(o[(size_t)i * n + j] - r[(size_t)i * n + j]);
      if (!(d <= 0.02f * (1.0f + fabsf(r[(size_t)i * n + j])))) {
        if (shown++ < 6) fprintf(stderr, "  [%d, %d]: gpu %g, cpu %g\n", i, j, o[(size_t)i * n + j], r[(size_t)i * n + j]);
        bad++;
      }
    }
  fprintf(stderr, "  %d of %d elements off\n", bad, m * n);
  free(o);
  free(r);
}

static double compare(const pair *p, size_t n) {
  float *o = get(G, p, true), *r = get(C, p, false);
  double e = relerr(o, r, n ? n : p->n);
  free(o);
  free(r);
  return e;
}

#define RUN2(call_g, call_c)                                                  \
  do {                                                                        \
    cr_assert((call_g) == TD_OK, "cuda: %s", td_errmsg());                    \
    cr_assert((call_c) == TD_OK, "cpu: %s", td_errmsg());                     \
  } while (0)

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

/* ---------------------------------------------------------------- GEMM */

static void gemm_case(int m, int n, int k, td_act act, unsigned flags, bool with_bias) {
  td_buf_type yt = (flags & TD_GEMM_OUT_F32) ? TD_BUF_F32 : TD_BUF_ACT;
  float *x = rnd((size_t)m * k, 1.0f), *w = rnd((size_t)n * k, 1.7f / sqrtf((float)k)),
        *b = with_bias ? rnd(n, 0.5f) : NULL, *y0 = rnd((size_t)m * n, 1.0f);
  pair X = mk(TD_BUF_ACT, x, (size_t)m * k), W = mk(TD_BUF_ACT, w, (size_t)n * k);
  pair B = {0};
  if (with_bias) B = mk(TD_BUF_F32, b, n);
  pair Y = mk(yt, (flags & TD_GEMM_ACCUM) ? y0 : NULL, (size_t)m * n);
  RUN2(td_gemm(G, X.g, W.g, with_bias ? B.g : NULL, Y.g, m, n, k, act, flags),
       td_gemm(C, X.c, W.c, with_bias ? B.c : NULL, Y.c, m, n, k, act, flags));
  double e = compare(&Y, 0);
  cr_expect(e <= TOL, "gemm m=%d n=%d k=%d act=%d flags=%u bias=%d: error %.3g", m, n, k, act, flags, with_bias, e);
  if (!(e <= TOL)) explain(&Y, m, n);
  drop(&X);
  drop(&W);
  drop(&Y);
  if (with_bias) drop(&B);
  free(x);
  free(w);
  free(b);
  free(y0);
}

Test(cuda, gemm) {
  static const struct {
    td_act act;
    unsigned flags;
    bool bias;
  } cfg[] = {
      {TD_ACT_NONE, 0, true},          {TD_ACT_NONE, 0, false},
      {TD_ACT_RELU, 0, true},          {TD_ACT_RELU, 0, false},
      {TD_ACT_GELU_TANH, 0, true},     {TD_ACT_GELU_TANH, 0, false},
      {TD_ACT_GELU, 0, true},          {TD_ACT_SILU, 0, false},
      {TD_ACT_QUICK_GELU, 0, true},    {TD_ACT_NONE, TD_GEMM_ACCUM, false},
      {TD_ACT_NONE, TD_GEMM_ACCUM, true}, {TD_ACT_NONE, TD_GEMM_OUT_F32, true},
      {TD_ACT_NONE, TD_GEMM_OUT_F32 | TD_GEMM_ACCUM, false}, {TD_ACT_GELU, TD_GEMM_OUT_F32, true},
  };
  static const int small[][3] = {{1, 64, 64}, {7, 301, 40}, {33, 3072, 1024}, {130, 513, 96}, {5, 1000, 333},
                                 {64, 56, 40}, {3, 17, 10}};
  for (size_t s = 0; s < sizeof small / sizeof small[0]; s++)
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++)
      gemm_case(small[s][0], small[s][1], small[s][2], cfg[c].act, cfg[c].flags, cfg[c].bias);
  /* every row-tile variant of the decode kernels (m <= 8; 8 < m <= 64 in 16, 32, 64 rows) */
  static const int dec[][3] = {{12, 1024, 2816}, {16, 5632, 1024}, {24, 1000, 512}, {40, 3072, 1024}, {9, 96, 64}};
  for (size_t s = 0; s < sizeof dec / sizeof dec[0]; s++) {
    gemm_case(dec[s][0], dec[s][1], dec[s][2], TD_ACT_NONE, TD_GEMM_ACCUM, true);
    gemm_case(dec[s][0], dec[s][1], dec[s][2], TD_ACT_GELU, TD_GEMM_OUT_F32, true);
    gemm_case(dec[s][0], dec[s][1], dec[s][2], TD_ACT_RELU, 0, false);
  }
  /* decode batch sizes: k not a multiple of 64, narrow and wide n; m 0: a
   * random batch size up to 64 */
  static const int mid[][3] = {{64, 5632, 1024}, {50, 1000, 2816}, {31, 3072, 1024}, {17, 96, 8},
                               {63, 33, 1000}, {48, 20000, 256}, {0, 1024, 1024}};
  for (size_t s = 0; s < sizeof mid / sizeof mid[0]; s++) {
    int m = mid[s][0] ? mid[s][0] : 1 + irand(64);
    gemm_case(m, mid[s][1], mid[s][2], TD_ACT_NONE, TD_GEMM_ACCUM, true);
    gemm_case(m, mid[s][1], mid[s][2], TD_ACT_SILU, 0, s & 1);
  }
  gemm_case(512, 1024, 2816, TD_ACT_NONE, TD_GEMM_ACCUM, false);
  gemm_case(300, 5632, 1024, TD_ACT_NONE, 0, false);
  gemm_case(1000, 4096, 1024, TD_ACT_GELU, 0, true);
  gemm_case(64, 32128, 1024, TD_ACT_NONE, TD_GEMM_OUT_F32, false);
  gemm_case(3, 32128, 1024, TD_ACT_NONE, TD_GEMM_OUT_F32, true);
}

/* The decode GEMM's three kernels (a warp per column, W by bulk copies, W
 * through a cp.async ring) at decode row counts, odd widths, k from 8 to
 * beyond what the bulk variant holds in shared memory and the warp kernel
 * in registers. */
Test(cuda, gemm_skinny_kernels) {
  static const int nk[][2] = {{1024, 1024}, {3072, 1024}, {1000, 2816}, {301, 40}, {17, 8},   {96, 64},
                              {5632, 1024}, {40, 8200},   {33, 1000},   {9, 5120},  {70, 1288}, {3, 3080}};
  static const int ms[] = {1, 2, 5, 8, 13, 16};
  /* default; the warp kernel at every k and width it takes; the bulk and the ring kernels at
   * every row count */
  static const char *env[][2][2] = {{{NULL, NULL}, {NULL, NULL}},
                                    {{"TANDEM_CUDA_GEMV", "8,100000,4,100000"}, {NULL, NULL}},
                                    {{"TANDEM_CUDA_GEMV", "0"}, {NULL, NULL}},
                                    {{"TANDEM_CUDA_GEMV", "0"}, {"TANDEM_CUDA_SKINNY_BULK", "0"}}};
  for (int pass = 0; pass < 4; pass++) {
    td_backend *saved = G, *alt = NULL;
    if (pass > 0) {
      td_backend_opts go = {.kind = TD_BACKEND_CUDA, .device = 0};
      for (int e = 0; e < 2; e++)
        if (env[pass][e][0]) setenv(env[pass][e][0], env[pass][e][1], 1);
      cr_assert(td_backend_create(&go, &alt) == TD_OK, "cuda backend: %s", td_errmsg());
      for (int e = 0; e < 2; e++)
        if (env[pass][e][0]) unsetenv(env[pass][e][0]);
      G = alt;
    }
    for (size_t i = 0; i < sizeof nk / sizeof nk[0]; i++)
      for (size_t j = 0; j < sizeof ms / sizeof ms[0]; j++) {
        int m = ms[j], n = nk[i][0], k = nk[i][1];
        if (m > 8 && n > 2048) continue; /* cuBLASLt's */
        gemm_case(m, n, k, TD_ACT_NONE, TD_GEMM_ACCUM, j & 1);
        gemm_case(m, n, k, TD_ACT_GELU_TANH, 0, true);
        gemm_case(m, n, k, TD_ACT_NONE, TD_GEMM_OUT_F32, j & 1);
      }
    if (alt) {
      G = saved;
      td_backend_destroy(alt);
    }
  }
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
  static const int sz[][2] = {{1, 64}, {17, 1024}, {300, 1280}, {5, 40}, {3, 1001}, {2048, 512}, {2, 8200}};
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
                              {2, 7, 11, 4, 3, 2, 0}};
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

/* ---------------------------------------------------------------- dense attention */

static void dense_case(int H, int dh, const int *lens, int ns, bool causal, int md, float scale) {
  int32_t *cu = malloc(sizeof(int32_t) * (ns + 1));
  cu[0] = 0;
  int max_len = 0;
  for (int s = 0; s < ns; s++) {
    cu[s + 1] = cu[s] + lens[s];
    max_len = lens[s] > max_len ? lens[s] : max_len;
  }
  int T = cu[ns];
  size_t nq = (size_t)T * 3 * H * dh;
  float *qkv = rnd(nq, 2.0f), *lut = md ? rnd((size_t)H * (2 * md + 1), 3.0f) : NULL;
  pair Q = mk(TD_BUF_ACT, qkv, nq), O = mk(TD_BUF_ACT, NULL, (size_t)T * H * dh), CU = mk(TD_BUF_I32, cu, ns + 1);
  pair L = {0};
  if (md) L = mk(TD_BUF_F32, lut, (size_t)H * (2 * md + 1));
  td_relbias bg = {md ? L.g : NULL, md}, bc = {md ? L.c : NULL, md};
  RUN2(td_attn_dense(G, Q.g, O.g, CU.g, ns, T, max_len, H, dh, scale, causal, md ? &bg : NULL),
       td_attn_dense(C, Q.c, O.c, CU.c, ns, T, max_len, H, dh, scale, causal, md ? &bc : NULL));
  double e = compare(&O, 0);
  cr_expect(e <= TOL, "attn_dense H=%d dh=%d seqs=%d tokens=%d causal=%d md=%d: error %.3g", H, dh, ns, T, causal,
            md, e);
  drop(&Q);
  drop(&O);
  drop(&CU);
  if (md) drop(&L);
  free(qkv);
  free(lut);
  free(cu);
}

Test(cuda, attn_dense) {
  int a[] = {512, 1, 200, 77}, b[] = {65, 130, 3}, c[] = {1000}, d[] = {5, 33}, e[] = {7, 1, 12}, f[] = {64, 64, 64},
      g[] = {129, 17, 300, 2, 63};
  dense_case(16, 64, a, 4, false, 128, 1.0f);
  dense_case(4, 128, b, 3, true, 0, 1.0f / sqrtf(128.0f));
  dense_case(3, 64, c, 1, true, 20, 1.0f);
  dense_case(4, 16, d, 2, false, 128, 1.0f);
  dense_case(3, 10, e, 3, true, 0, 0.3f);
  dense_case(2, 128, f, 3, false, 0, 0.125f);
  dense_case(5, 64, g, 5, false, 0, 0.125f);
  dense_case(5, 128, g, 5, true, 2000, 1.0f); /* LUT larger than the shared-memory copy */
  dense_case(2, 48, g, 5, false, 10, 0.2f);
}

/* head_dim 64 on each of its kernels: wgmma (default), mma.sync with 128
 * and with 64 query rows a block (TANDEM_CUDA_DENSE64=8 / 4, read when a
 * backend is created); bias in shared memory, in global memory, none. */
Test(cuda, attn_dense_head64_kernels) {
  int a[] = {512, 1, 200, 77}, c[] = {1000}, g[] = {129, 17, 300, 2, 63}, h[] = {64, 65, 191};
  const char *modes[] = {NULL, "8", "4"};
  td_backend *def = G;
  for (int m = 0; m < 3; m++) {
    if (modes[m]) {
      setenv("TANDEM_CUDA_DENSE64", modes[m], 1);
      td_backend_opts go = {.kind = TD_BACKEND_CUDA, .device = 0};
      cr_assert(td_backend_create(&go, &G) == TD_OK, "cuda backend: %s", td_errmsg());
      unsetenv("TANDEM_CUDA_DENSE64");
    }
    dense_case(16, 64, a, 4, false, 128, 0.125f);
    dense_case(3, 64, c, 1, true, 20, 1.0f);
    dense_case(5, 64, g, 5, true, 2000, 1.0f); /* LUT read from global memory */
    dense_case(2, 64, h, 3, true, 0, 0.125f);
    dense_case(4, 64, h, 3, false, 7, 1.0f);
    if (modes[m]) td_backend_destroy(G);
    G = def;
  }
}

/* ---------------------------------------------------------------- paged KV */

typedef struct paged_rig {
  td_kv_layout l;
  int n_blocks;
  pair pool;
  float *pool_h;
} paged_rig;

static void rig_pool(paged_rig *r, int layers, int H, int dh, int bs, int states, int n_blocks) {
  r->l = (td_kv_layout){layers, H, dh, bs, states};
  r->n_blocks = n_blocks;
  size_t n = td_kv_block_elems(&r->l) * n_blocks;
  r->pool_h = rnd(n, 2.0f);
  r->pool = mk(TD_BUF_ACT, r->pool_h, n);
}

static void rig_drop(paged_rig *r) {
  drop(&r->pool);
  free(r->pool_h);
}

Test(cuda, kv_write_copy) {
  static const int cfg[][4] = {{64, 16, 16, 37}, {128, 4, 32, 5}, {10, 3, 5, 23}, {64, 2, 7, 1}};
  for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
    int dh = cfg[c][0], H = cfg[c][1], bs = cfg[c][2], n = cfg[c][3], nb = 9;
    paged_rig r;
    int states = c % 2 ? 0 : 2 * dh; /* a states tail after the 3 layers */
    rig_pool(&r, 3, H, dh, bs, states, nb);
    int ld = 3 * H * dh;
    float *rows = rnd((size_t)n * ld, 1.0f);
    pair R = mk(TD_BUF_ACT, rows, (size_t)n * ld);
    /* distinct slots, some rows skipped */
    int total = nb * bs;
    int32_t *perm = malloc(sizeof(int32_t) * total), *slots = malloc(sizeof(int32_t) * n);
    for (int i = 0; i < total; i++) perm[i] = i;
    for (int i = total - 1; i > 0; i--) {
      int j = irand(i + 1), t = perm[i];
      perm[i] = perm[j];
      perm[j] = t;
    }
    for (int i = 0; i < n; i++) slots[i] = i % 5 == 3 ? -1 : perm[i % total];
    pair S = mk(TD_BUF_I32, slots, n);
    size_t eg = td_buf_elem_size(G, TD_BUF_ACT), ec = td_buf_elem_size(C, TD_BUF_ACT);
    const char *kg = (const char *)R.g + (size_t)H * dh * eg, *kc = (const char *)R.c + (size_t)H * dh * ec;
    RUN2(td_kv_write(G, kg, kg + (size_t)H * dh * eg, ld, r.pool.g, &r.l, 1, S.g, n),
         td_kv_write(C, kc, kc + (size_t)H * dh * ec, ld, r.pool.c, &r.l, 1, S.c, n));
    if (states) /* layer 3: the tail, each row's two halves */
      RUN2(td_kv_write(G, R.g, (const char *)R.g + (size_t)(states / 2) * eg, ld, r.pool.g, &r.l, 3, S.g, n),
           td_kv_write(C, R.c, (const char *)R.c + (size_t)(states / 2) * ec, ld, r.pool.c, &r.l, 3, S.c, n));
    double e = compare(&r.pool, 0);
    cr_expect(e == 0.0, "kv_write dh=%d H=%d bs=%d n=%d states=%d: error %.3g", dh, H, bs, n, states, e);
    int32_t pairs[6] = {0, 5, 3, 1, 7, 8};
    RUN2(td_kv_copy_blocks(G, r.pool.g, &r.l, pairs, 3), td_kv_copy_blocks(C, r.pool.c, &r.l, pairs, 3));
    e = compare(&r.pool, 0);
    cr_expect(e == 0.0, "kv_copy_blocks: error %.3g", e);
    drop(&R);
    drop(&S);
    rig_drop(&r);
    free(rows);
    free(perm);
    free(slots);
  }
}

/* ---------------------------------------------------------------- gemm_ex */

typedef struct gex_cfg {
  int m, n, k;
  int norm; /* 0 none, 1 RMSNorm, 2 LayerNorm, 3 RMSNorm without weight (norm_plain), 4 LayerNorm without
               weight and bias (norm_plain, with W's row sums) */
  bool glu, bias;
  td_act act;
  unsigned flags;
  int kv_dh, kv_bs; /* > 0: fused KV write of H = n / 3 / kv_dh heads at column n / 3 */
} gex_cfg;

/* The fused op against the CPU's separate ops. The fused KV write must put
 * exactly the GPU's own output columns into the slots and touch nothing
 * else of the pool. */
static const char *gex_mode = "default";

static void gemm_ex_case(const gex_cfg *p) {
  int m = p->m, n = p->n, k = p->k, ny = p->glu ? n / 2 : n;
  unsigned flags = p->flags | (p->glu ? TD_GEMM_GLU : 0);
  td_buf_type yt = (flags & TD_GEMM_OUT_F32) ? TD_BUF_F32 : TD_BUF_ACT;
  float *x = rnd((size_t)m * k, 1.0f), *w = rnd((size_t)n * k, 1.7f / sqrtf((float)k)), *b = rnd(n, 0.5f),
        *y0 = rnd((size_t)m * ny, 1.0f), *nw = rnd(k, 0.2f), *nb = rnd(k, 0.3f);
  for (size_t i = 0; i < (size_t)m * k; i++) x[i] = bfr(x[i] + 0.4f); /* a mean for LayerNorm to remove */
  for (int i = 0; i < k; i++) nw[i] += 1.0f;
  pair X = mk(TD_BUF_ACT, x, (size_t)m * k), W = mk(TD_BUF_ACT, w, (size_t)n * k), B = mk(TD_BUF_F32, b, n);
  pair NW = mk(TD_BUF_F32, nw, k), NB = mk(TD_BUF_F32, nb, k);
  float *ws = calloc((size_t)n, sizeof(float)); /* W's row sums (w is bf16-representable) */
  for (int j = 0; j < n; j++)
    for (int i = 0; i < k; i++) ws[j] += w[(size_t)j * k + i];
  pair WS = mk(TD_BUF_F32, ws, n);
  bool plain = p->norm == 3 || p->norm == 4;
  pair XN = mk(TD_BUF_ACT, NULL, (size_t)m * k), GL = mk(TD_BUF_ACT, NULL, (size_t)m * n);
  pair Y = mk(yt, (flags & TD_GEMM_ACCUM) ? y0 : NULL, (size_t)m * ny);
  td_gemm_args ag = {.x = X.g, .w = W.g, .bias = p->bias ? B.g : NULL, .y = Y.g, .m = m, .n = n, .k = k,
                     .act = p->act, .flags = flags, .norm_w = p->norm == 1 || p->norm == 2 ? NW.g : NULL,
                     .norm_b = plain ? NULL : NB.g, .norm_eps = 1e-5f,
                     .norm_rms = p->norm == 1 || p->norm == 3, .norm_plain = plain,
                     .norm_wsum = p->norm == 4 ? WS.g : NULL, .scratch_norm = XN.g, .scratch_glu = GL.g};
  td_gemm_args ac = ag;
  ac.x = X.c, ac.w = W.c, ac.bias = p->bias ? B.c : NULL, ac.y = Y.c;
  ac.norm_w = p->norm == 1 || p->norm == 2 ? NW.c : NULL, ac.norm_b = plain ? NULL : NB.c;
  ac.norm_wsum = p->norm == 4 ? WS.c : NULL;
  ac.scratch_norm = XN.c, ac.scratch_glu = GL.c;
  paged_rig r = {0};
  pair S = {0};
  int32_t *slots = NULL;
  int hd = n / 3, H = p->kv_dh ? hd / p->kv_dh : 0;
  if (p->kv_dh) {
    int nb_blocks = (m + p->kv_bs - 1) / p->kv_bs + 3, total = nb_blocks * p->kv_bs;
    rig_pool(&r, 2, H, p->kv_dh, p->kv_bs, m % 2 ? 64 : 0, nb_blocks);
    int32_t *perm = malloc(sizeof(int32_t) * total);
    slots = malloc(sizeof(int32_t) * m);
    for (int i = 0; i < total; i++) perm[i] = i;
    for (int i = total - 1; i > 0; i--) {
      int j = irand(i + 1), t = perm[i];
      perm[i] = perm[j];
      perm[j] = t;
    }
    for (int i = 0; i < m; i++) slots[i] = i % 7 == 5 ? -1 : perm[i];
    S = mk(TD_BUF_I32, slots, m);
    free(perm);
    ag.kv_pool = r.pool.g, ag.kv_layout = &r.l, ag.kv_layer = 1, ag.kv_col = hd, ag.kv_slots = S.g;
    ac.kv_pool = r.pool.c, ac.kv_layout = &r.l, ac.kv_layer = 1, ac.kv_col = hd, ac.kv_slots = S.c;
  }
  RUN2(td_gemm_ex(G, &ag), td_gemm_ex(C, &ac));
  double e = compare(&Y, 0);
  /* the relative error of a few outputs is a small sample of bf16 roundings:
   * 12 outputs (m 1, n 24, GLU) exceeded 1e-2 in 0.5 % of simulated draws */
  double tol = TOL * fmax(1.0, sqrt(64.0 / ((double)m * ny)));
  cr_expect(e <= tol, "gemm_ex (%s) m=%d n=%d k=%d norm=%d glu=%d bias=%d act=%d flags=%u kv=%d: error %.3g (tolerance %.3g)",
            gex_mode, m, n, k, p->norm, p->glu, p->bias, p->act, flags, p->kv_dh, e, tol);
  if (p->kv_dh) {
    float *yg = get(G, &Y, true), *pg = get(G, &r.pool, true);
    size_t be = td_kv_block_elems(&r.l), hs = (size_t)p->kv_bs * p->kv_dh;
    bool *hit = calloc(r.pool.n, sizeof(bool));
    int bad_rows = 0;
    for (int i = 0; i < m; i++) {
      if (slots[i] < 0) continue;
      size_t base = (size_t)(slots[i] / p->kv_bs) * be + (size_t)1 * 2 * H * hs /* layer 1 */ +
                    (size_t)(slots[i] % p->kv_bs) * p->kv_dh;
      for (int kv = 0; kv < 2; kv++)
        for (int c = 0; c < hd; c++) {
          size_t at = base + (size_t)kv * H * hs + (size_t)(c / p->kv_dh) * hs + c % p->kv_dh;
          hit[at] = true;
          if (pg[at] != yg[(size_t)i * n + hd + kv * hd + c]) bad_rows++;
        }
    }
    size_t stray = 0;
    for (size_t i = 0; i < r.pool.n; i++)
      if (!hit[i] && memcmp(&pg[i], &r.pool_h[i], sizeof(float)) != 0) stray++;
    cr_expect(bad_rows == 0 && stray == 0, "gemm_ex (%s) KV write m=%d dh=%d bs=%d: %d wrong values, %zu stray writes",
              gex_mode, m, p->kv_dh, p->kv_bs, bad_rows, stray);
    double ep = compare(&r.pool, 0);
    cr_expect(ep <= TOL, "gemm_ex KV pool vs CPU: error %.3g", ep);
    free(hit);
    free(yg);
    free(pg);
    drop(&S);
    rig_drop(&r);
    free(slots);
  }
  pair *ps[] = {&X, &W, &B, &NW, &NB, &XN, &GL, &Y, &WS};
  for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) drop(ps[i]);
  free(ws);
  free(x);
  free(w);
  free(b);
  free(y0);
  free(nw);
  free(nb);
}

Test(cuda, gemm_ex) {
  static const gex_cfg cfg[] = {
      /* m n k norm glu bias act flags kv_dh kv_bs */
      {1, 3072, 1024, 1, false, false, TD_ACT_NONE, 0, 64, 16},       /* decode QKV + KV write, batch 1 */
      {17, 3072, 1024, 1, false, false, TD_ACT_NONE, 0, 64, 16},
      {64, 3072, 1024, 1, false, true, TD_ACT_NONE, 0, 64, 16},
      {5, 5632, 1024, 1, true, false, TD_ACT_GELU_TANH, 0, 0, 0},     /* gated FFN input */
      {33, 5632, 1024, 1, true, true, TD_ACT_GELU_TANH, 0, 0, 0},
      {64, 5632, 1024, 1, true, false, TD_ACT_GELU_TANH, 0, 0, 0},
      {16, 1024, 1024, 1, false, false, TD_ACT_NONE, 0, 0, 0},        /* cross-attention query */
      {3, 1000, 200, 2, false, true, TD_ACT_SILU, 0, 0, 0},           /* LayerNorm, fused up to 16 rows */
      {16, 514, 1280, 2, true, true, TD_ACT_GELU, 0, 0, 0},           /* n / 2 odd */
      {40, 512, 256, 2, false, true, TD_ACT_NONE, 0, 0, 0},           /* LayerNorm over 16 rows: separate ops */
      {64, 1024, 2816, 0, false, false, TD_ACT_NONE, TD_GEMM_ACCUM, 0, 0}, /* residual add */
      {7, 1001, 96, 0, false, true, TD_ACT_GELU, TD_GEMM_OUT_F32, 0, 0},
      {50, 96, 64, 1, false, true, TD_ACT_RELU, 0, 0, 0},
      {1, 24, 40, 1, true, false, TD_ACT_GELU_TANH, 0, 0, 0},
      {9, 256, 576, 1, false, false, TD_ACT_NONE, 0, 0, 0},           /* 3 K splits: uneven column owners */
      {5, 512, 576, 1, true, true, TD_ACT_GELU_TANH, 0, 0, 0},
      {48, 300, 2816, 0, false, true, TD_ACT_NONE, TD_GEMM_ACCUM | TD_GEMM_OUT_F32, 0, 0},
      {65, 768, 512, 1, true, false, TD_ACT_GELU_TANH, 0, 0, 0},      /* over 64 rows: separate ops */
      {3, 100, 36, 1, false, false, TD_ACT_NONE, 0, 0, 0},            /* k % 8 != 0: separate ops */
      {12, 90, 64, 1, false, false, TD_ACT_NONE, 0, 10, 5},           /* odd head size and block size */
      {70, 384, 128, 0, false, true, TD_ACT_NONE, 0, 64, 16},         /* KV write after cuBLASLt */
      {37, 2050, 1000, 1, true, true, TD_ACT_GELU_TANH, 0, 0, 0},     /* n / 2 odd, k % 64 != 0 */
      {20, 1536, 512, 1, false, true, TD_ACT_NONE, TD_GEMM_ACCUM, 32, 7}, /* KV write with a residual */
      {64, 1024, 2816, 1, false, false, TD_ACT_RELU, 0, 0, 0},
      {3001, 1030, 512, 1, true, true, TD_ACT_GELU_TANH, 0, 0, 0},   /* encoder-sized */
      {1500, 768, 384, 2, false, true, TD_ACT_GELU, 0, 0, 0},
      {700, 384, 256, 1, false, false, TD_ACT_NONE, 0, 32, 16}, /* KV write of many rows */
      /* the decoder's folded RMSNorms: scaled by 1 / rms inside the GEMM */
      {1, 3072, 1024, 3, false, false, TD_ACT_NONE, 0, 64, 16},       /* decode QKV + KV write, batch 1 */
      {4, 3072, 1024, 3, false, true, TD_ACT_NONE, 0, 64, 16},
      {1, 1024, 1024, 3, false, false, TD_ACT_NONE, 0, 0, 0},         /* cross-attention query */
      {8, 5632, 1024, 3, true, false, TD_ACT_GELU_TANH, 0, 0, 0},     /* gated FFN input */
      {1, 5632, 1024, 3, true, true, TD_ACT_GELU_TANH, 0, 0, 0},
      {5, 1000, 200, 3, false, true, TD_ACT_SILU, 0, 0, 0},           /* odd n, k % 64 != 0 */
      {13, 90, 64, 3, false, false, TD_ACT_NONE, 0, 10, 5},           /* odd head and block size */
      {16, 514, 1280, 3, true, true, TD_ACT_GELU, 0, 0, 0},           /* n / 2 odd */
      {3, 100, 36, 3, false, false, TD_ACT_NONE, 0, 0, 0},            /* k % 8 != 0: separate ops */
      {40, 512, 256, 3, true, false, TD_ACT_GELU_TANH, 0, 0, 0},      /* over 16 rows: separate ops */
      {2, 1024, 2816, 3, false, false, TD_ACT_NONE, 0, 0, 0},         /* the deep ring (k = 2816) */
      /* beyond the fused rows: cuBLASLt, the 1 / rms scaling in the GLU or KV-write kernel after it */
      {64, 3072, 1024, 3, false, false, TD_ACT_NONE, 0, 64, 16},      /* decode QKV + KV write, batch 64 */
      {64, 5632, 1024, 3, true, false, TD_ACT_GELU_TANH, 0, 0, 0},    /* gated FFN input, batch 64 */
      {33, 1536, 512, 3, false, false, TD_ACT_NONE, 0, 32, 7},        /* odd rows and block size */
      {20, 2064, 520, 3, true, false, TD_ACT_SILU, 0, 0, 0},
      /* folded LayerNorms (Whisper, mBART): (x W^T - mean * row sums) / std inside the GEMM */
      {1, 3840, 1280, 4, false, true, TD_ACT_NONE, 0, 64, 16},        /* decode QKV + KV write, batch 1 */
      {4, 3072, 1024, 4, false, true, TD_ACT_NONE, 0, 64, 16},
      {1, 1280, 1280, 4, false, true, TD_ACT_NONE, 0, 0, 0},          /* cross-attention query */
      {2, 5120, 1280, 4, false, true, TD_ACT_GELU, 0, 0, 0},          /* FFN input */
      {8, 5632, 1024, 4, true, true, TD_ACT_GELU_TANH, 0, 0, 0},      /* gated */
      {5, 1000, 200, 4, false, true, TD_ACT_SILU, 0, 0, 0},           /* odd n, k % 64 != 0 */
      {3, 100, 36, 4, false, true, TD_ACT_NONE, 0, 0, 0},             /* k % 8 != 0: separate ops */
      {40, 512, 256, 4, true, true, TD_ACT_GELU_TANH, 0, 0, 0},       /* over 16 rows: separate ops */
      {16, 514, 1280, 4, true, true, TD_ACT_GELU, 0, 0, 0},           /* GLU beyond the bulk kernel: norm apart */
      {2, 1280, 5120, 4, false, true, TD_ACT_NONE, 0, 0, 0},          /* the deep ring (k = 5120) */
      /* one row on both sides of the warp-per-column kernel's limits (k, GLU) */
      {1, 4098, 2048, 3, true, true, TD_ACT_GELU_TANH, 0, 0, 0},      /* GLU, 8 pieces a lane, n / 2 odd */
      {1, 1000, 2816, 3, false, false, TD_ACT_NONE, 0, 0, 0},
      {1, 1288, 5120, 4, false, true, TD_ACT_GELU, 0, 0, 0},
      {1, 1536, 1288, 3, false, true, TD_ACT_NONE, 0, 64, 16},        /* KV write, k % 256 != 0 */
  };
  /* the backend's default fusions, then every fusion up to 16 rows */
  static const char *env[][2] = {{NULL, NULL},
                                 {"TANDEM_CUDA_FUSE", "16,7"},
                                 {"TANDEM_CUDA_SKINNY_BULK", "0"},
                                 {"TANDEM_CUDA_GEMV", "8,100000,4,100000"},
                                 {"TANDEM_CUDA_GEMV", "0"}};
  static const char *modes[] = {"default", "all fused", "cp.async ring", "warp kernel to k = 2048 and 4 rows", "no warp kernel"};
  for (int pass = 0; pass < 5; pass++) {
    td_backend *saved = G, *alt = NULL;
    if (pass > 0) {
      td_backend_opts go = {.kind = TD_BACKEND_CUDA, .device = 0};
      setenv(env[pass][0], env[pass][1], 1);
      cr_assert(td_backend_create(&go, &alt) == TD_OK, "cuda backend: %s", td_errmsg());
      unsetenv(env[pass][0]);
      G = alt;
    }
    gex_mode = modes[pass];
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) gemm_ex_case(&cfg[c]);
    if (alt) {
      G = saved;
      td_backend_destroy(alt);
    }
  }
}

/* Block tables [S, stride] of the pool's blocks in random order, enough
 * for ctx[s] slots of each sequence; -1 past them (never read). */
static int32_t *shuffled_tables(const int32_t *ctx, int S, int bs, int stride, int n_blocks) {
  int32_t *perm = malloc(sizeof(int32_t) * n_blocks), *tab = malloc(sizeof(int32_t) * S * stride);
  cr_assert(perm && tab);
  for (int i = 0; i < n_blocks; i++) perm[i] = i;
  for (int i = n_blocks - 1; i > 0; i--) {
    int j = irand(i + 1), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  for (int s = 0, next = 0; s < S; s++) {
    int nb = (ctx[s] + bs - 1) / bs;
    for (int i = 0; i < stride; i++) tab[s * stride + i] = i < nb ? perm[next++] : -1;
  }
  free(perm);
  return tab;
}

/* the paged and states tests' buffers: the query norm's rows (when
 * given), the queries, the output and the metadata */
static void io_drop(pair *qn_rows, float *qn, pair *q, pair *o, pair *qs, pair *ct, pair *tb) {
  if (qn_rows) drop(qn_rows);
  free(qn);
  drop(q);
  drop(o);
  drop(qs);
  drop(ct);
  drop(tb);
}

/* A batch's paged extents as its sequences are drawn: sequence s gets ql
 * query rows (q_start prefix sums in qs) and c keys in blocks of bs. */
typedef struct seq_extents {
  int max_q, max_ctx, max_nb, total_nb;
} seq_extents;
static void seq_add(seq_extents *x, int32_t *qs, int32_t *ctx, int s, int ql, int c, int bs) {
  qs[s + 1] = qs[s] + ql;
  ctx[s] = c;
  int nb = (c + bs - 1) / bs;
  x->max_nb = nb > x->max_nb ? nb : x->max_nb;
  x->total_nb += nb;
  x->max_q = ql > x->max_q ? ql : x->max_q;
  x->max_ctx = c > x->max_ctx ? c : x->max_ctx;
}

typedef struct paged_cfg {
  int H, dh, bs, n_seqs;
  bool causal;
  int md;
  int q_max;    /* query rows per sequence: 1 (decode) .. q_max */
  int ctx_max;  /* keys per sequence: up to ctx_max (+ queries when causal) */
  bool pad;     /* every 4th sequence is a padding row (ctx_len 0) */
  bool strided; /* q rows inside a [., 3, H, dh] buffer */
  int slack;    /* how far max_q / max_ctx exceed the real lengths */
} paged_cfg;

static const char *paged_mode = "default";
static int paged_qn_dim; /* > 0: every case with a query norm over rows this wide */

static void paged_case(const paged_cfg *p) {
  int S = p->n_seqs, H = p->H, dh = p->dh, bs = p->bs;
  int32_t *qs = malloc(sizeof(int32_t) * (S + 1)), *ctx = malloc(sizeof(int32_t) * S);
  qs[0] = 0;
  seq_extents x = {0, 0, 1, 0};
  for (int s = 0; s < S; s++) {
    int ql = 1 + irand(p->q_max);
    int c = 1 + irand(p->ctx_max);
    if (p->causal) c = c - 1 + ql;
    if (p->pad && s % 4 == 3) {
      ql = 1;
      c = 0;
    }
    seq_add(&x, qs, ctx, s, ql, c, bs);
  }
  int T = qs[S], stride = x.max_nb + 1, n_blocks = x.total_nb + 3, max_q = x.max_q, max_ctx = x.max_ctx;
  paged_rig r;
  rig_pool(&r, 3, H, dh, bs, 16, n_blocks);
  int32_t *tab = shuffled_tables(ctx, S, bs, stride, n_blocks);
  int ldq = p->strided ? 3 * H * dh : H * dh;
  float *q = rnd((size_t)T * ldq, 2.0f), *lut = p->md ? rnd((size_t)H * (2 * p->md + 1), 3.0f) : NULL;
  pair Q = mk(TD_BUF_ACT, q, (size_t)T * ldq), O = mk(TD_BUF_ACT, NULL, (size_t)T * H * dh);
  pair QS = mk(TD_BUF_I32, qs, S + 1), CT = mk(TD_BUF_I32, ctx, S), TB = mk(TD_BUF_I32, tab, (size_t)S * stride);
  pair L = {0};
  if (p->md) L = mk(TD_BUF_F32, lut, (size_t)H * (2 * p->md + 1));
  td_relbias bg = {p->md ? L.g : NULL, p->md}, bc = {p->md ? L.c : NULL, p->md};
  /* cross-attention (static K/V) may read the pool before the previous
   * kernel ends: that path on the GPU, the plain one on the re-run below */
  td_paged_meta mg = {S, T, max_q + p->slack, max_ctx + p->slack, QS.g, CT.g, TB.g, stride, !p->causal, p->causal,
                      NULL, 0, 0.0f};
  td_paged_meta mc = {S, T, max_q, max_ctx, QS.c, CT.c, TB.c, stride, false, false, NULL, 0, 0.0f};
  /* the query norm: 1 / rms of these rows scales each query */
  pair QN = {0};
  float *qn = NULL;
  if (paged_qn_dim) {
    qn = rnd((size_t)T * paged_qn_dim, 1.5f);
    QN = mk(TD_BUF_ACT, qn, (size_t)T * paged_qn_dim);
    mg.q_norm = QN.g, mc.q_norm = QN.c;
    mg.q_norm_dim = mc.q_norm_dim = paged_qn_dim;
    mg.q_norm_eps = mc.q_norm_eps = 1e-6f;
  }
  float scale = 1.0f / sqrtf((float)dh);
  RUN2(td_attn_paged(G, Q.g, ldq, O.g, r.pool.g, &r.l, 2, &mg, scale, p->causal, p->md ? &bg : NULL),
       td_attn_paged(C, Q.c, ldq, O.c, r.pool.c, &r.l, 2, &mc, scale, p->causal, p->md ? &bc : NULL));
  double e = compare(&O, 0);
  cr_expect(e <= TOL,
            "attn_paged (%s) H=%d dh=%d bs=%d seqs=%d tokens=%d causal=%d md=%d max_q=%d max_ctx=%d slack=%d: error %.3g",
            paged_mode, H, dh, bs, S, T, p->causal, p->md, max_q, max_ctx, p->slack, e);
  /* decode self-attention right after this step's KV write, as the model
   * runs it: the earlier keys may load before the write has finished, the
   * query's own key (stale in the pool until then) must not */
  if (p->causal && p->q_max == 1) {
    int hd = H * dh;
    int32_t *sl = malloc(sizeof(int32_t) * S);
    for (int s = 0; s < S; s++) {
      int qp = ctx[s] - 1;
      sl[s] = ctx[s] > 0 ? tab[s * stride + qp / bs] * bs + qp % bs : -1;
    }
    float *nk = rnd((size_t)S * 2 * hd, 2.0f);
    pair N = mk(TD_BUF_ACT, nk, (size_t)S * 2 * hd), SL = mk(TD_BUF_I32, sl, S);
    size_t eg = td_buf_elem_size(G, TD_BUF_ACT), ec = td_buf_elem_size(C, TD_BUF_ACT);
    td_paged_meta mp = mg;
    mp.kv_static = false;
    mp.kv_static_past = true;
    poison_gpu(&O);
    RUN2(td_kv_write(G, N.g, (char *)N.g + hd * eg, 2 * hd, r.pool.g, &r.l, 2, SL.g, S),
         td_kv_write(C, N.c, (char *)N.c + hd * ec, 2 * hd, r.pool.c, &r.l, 2, SL.c, S));
    RUN2(td_attn_paged(G, Q.g, ldq, O.g, r.pool.g, &r.l, 2, &mp, scale, true, p->md ? &bg : NULL),
         td_attn_paged(C, Q.c, ldq, O.c, r.pool.c, &r.l, 2, &mc, scale, true, p->md ? &bc : NULL));
    e = compare(&O, 0);
    cr_expect(e <= TOL, "attn_paged (%s) right after the step's KV write (kv_static_past) seqs=%d: error %.3g",
              paged_mode, S, e);
    drop(&N);
    drop(&SL);
    free(nk);
    free(sl);
  }
  /* exact bounds give the same answer */
  if (p->slack) {
    poison_gpu(&O);
    mg.max_q = max_q;
    mg.max_ctx = max_ctx;
    mg.kv_static = false;
    cr_assert(td_attn_paged(G, Q.g, ldq, O.g, r.pool.g, &r.l, 2, &mg, scale, p->causal, p->md ? &bg : NULL) == TD_OK,
              "%s", td_errmsg());
    e = compare(&O, 0);
    cr_expect(e <= TOL, "attn_paged (%s) with exact bounds: error %.3g", paged_mode, e);
  }
  io_drop(paged_qn_dim ? &QN : NULL, qn, &Q, &O, &QS, &CT, &TB);
  if (p->md) drop(&L);
  rig_drop(&r);
  free(q);
  free(lut);
  free(tab);
  free(qs);
  free(ctx);
}

Test(cuda, attn_paged) {
  static const paged_cfg cfg[] = {
      /* H dh bs seqs causal md q_max ctx_max pad strided slack */
      {16, 64, 16, 1, false, 0, 1, 512, false, false, 100},   /* decode cross, batch 1: split-KV */
      {16, 64, 16, 5, false, 0, 1, 512, true, false, 7},      /* odd batch, padding rows */
      {16, 64, 16, 64, false, 0, 1, 512, false, false, 0},    /* batch 64: one block per (seq, head) */
      {16, 64, 16, 64, true, 128, 1, 70, true, true, 33},     /* decode self with T5 bias */
      {16, 64, 32, 3, true, 128, 40, 90, false, true, 25},    /* prompt chunks */
      {4, 128, 16, 7, true, 0, 20, 300, true, true, 3},       /* head_dim 128 */
      {4, 128, 16, 1, false, 0, 1, 2000, false, false, 0},    /* long cross, many splits */
      {8, 128, 5, 9, false, 16, 3, 77, false, false, 1},      /* odd block size */
      {4, 16, 4, 5, true, 128, 6, 30, true, true, 5},         /* small head: generic kernel */
      {3, 10, 3, 4, false, 0, 2, 20, false, false, 2},        /* odd head size */
      {2, 64, 16, 2, true, 3000, 100, 200, false, false, 9},  /* LUT in global memory */
      {16, 64, 5, 17, true, 20, 1, 300, false, false, 11},    /* decode self, warp per (seq, head), odd blocks */
      {16, 64, 16, 33, false, 0, 1, 200, true, false, 5},     /* decode cross: warp kernel on the re-run */
      /* small batches on warps: 2, 4, 8, 16 warps a (seq, head) by the context bound */
      {16, 64, 16, 2, true, 128, 1, 60, false, true, 3},      /* self with T5 bias, short context */
      {8, 64, 7, 3, false, 0, 1, 120, false, false, 2},       /* odd block size */
      {8, 64, 16, 2, true, 0, 1, 250, false, false, 0},
      {16, 64, 5, 3, true, 20, 1, 300, true, false, 11},      /* odd blocks, padding row, bias */
      {16, 64, 16, 1, false, 0, 1, 1500, false, false, 0},    /* several chunks a warp (Whisper-length cross) */
      {16, 64, 32, 20, false, 0, 1, 700, true, false, 0},    /* block size over the bulk kernel's stage */
      {4, 64, 64, 9, true, 50, 1, 400, false, false, 0},      /* causal, bias, blocks of 64 */
  };
  for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) paged_case(&cfg[c]);
  /* every decode case again on the bulk-copy kernel in each block shape
   * (from one pair, static K/V or not; the self K/V before the query
   * copied before the wait, or not) */
  static const char *bulk[][2] = {{"1,2000000000,1,2000000000", "bulk copies, 4 warps x 2"},
                                  {"1,2000000000,2,2000000000", "bulk copies, 2 warps x 2"},
                                  {"1,2000000000,3,0", "bulk copies, 2 warps x 3, self K/V after the wait"}};
  for (int v = 0; v < 3; v++) {
    td_backend *saved = G, *alt = NULL;
    td_backend_opts go = {.kind = TD_BACKEND_CUDA, .device = 0};
    setenv("TANDEM_CUDA_DECATTN_BULK", bulk[v][0], 1);
    cr_assert(td_backend_create(&go, &alt) == TD_OK, "cuda backend: %s", td_errmsg());
    unsetenv("TANDEM_CUDA_DECATTN_BULK");
    G = alt;
    paged_mode = bulk[v][1];
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++)
      if (cfg[c].q_max == 1) paged_case(&cfg[c]);
    paged_mode = "default";
    G = saved;
    td_backend_destroy(alt);
  }
  /* the query norm, in the decode kernels (rows of 1024) and applied
   * before the others (and where rows of 100 are not 16-byte aligned) */
  static const struct {
    int dim;
    const char *mode;
  } qn[] = {{1024, "query norm over 1024"}, {100, "query norm over 100"}};
  for (int v = 0; v < 2; v++) {
    paged_qn_dim = qn[v].dim;
    paged_mode = qn[v].mode;
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) paged_case(&cfg[c]);
  }
  paged_qn_dim = 0;
  paged_mode = "default";
}

/* ---------------------------------------------------------- encoder states */

typedef struct states_cfg {
  int heads, D, bs, n_seqs;
  int q_max;   /* query rows per sequence: 1 .. q_max */
  int ctx_max; /* states per sequence: 1 .. ctx_max */
  bool pad;    /* every 4th sequence has no states (ctx_len 0) */
  int qn_dim;  /* > 0: a query norm over rows this wide */
  int ldq_pad; /* q rows wider than heads * D by this */
} states_cfg;

/* td_attn_states against the CPU on fresh inputs; on the GPU as the model
 * runs it (static states: the tensor-core kernel where D allows) and with
 * the states not declared static (the generic kernel) */
static void states_case(const states_cfg *p, const char *mode) {
  int S = p->n_seqs, Hq = p->heads, D = p->D, bs = p->bs;
  int32_t *qs = malloc(sizeof(int32_t) * (S + 1)), *ctx = malloc(sizeof(int32_t) * S);
  qs[0] = 0;
  seq_extents x = {0, 0, 1, 0};
  for (int s = 0; s < S; s++) {
    int ql = 1 + irand(p->q_max), c = 1 + irand(p->ctx_max);
    if (s == 0) c = p->ctx_max; /* the longest case always present */
    if (p->pad && s % 4 == 3) c = 0;
    seq_add(&x, qs, ctx, s, ql, c, bs);
  }
  int T = qs[S], stride = x.max_nb + 1, n_blocks = x.total_nb + 3, max_q = x.max_q, max_ctx = x.max_ctx;
  paged_rig r;
  /* a pool of states only, or the states tail after two layers' K/V (dual) */
  rig_pool(&r, S % 2 ? 0 : 2, 2, 8, bs, D, n_blocks);
  int32_t *tab = shuffled_tables(ctx, S, bs, stride, n_blocks);
  int ldq = Hq * D + p->ldq_pad;
  float *q = rnd((size_t)T * ldq, 2.0f);
  pair Q = mk(TD_BUF_ACT, q, (size_t)T * ldq), O = mk(TD_BUF_ACT, NULL, (size_t)T * Hq * D);
  pair QS = mk(TD_BUF_I32, qs, S + 1), CT = mk(TD_BUF_I32, ctx, S), TB = mk(TD_BUF_I32, tab, (size_t)S * stride);
  td_paged_meta mg = {S, T, max_q, max_ctx, QS.g, CT.g, TB.g, stride, true, false, NULL, 0, 0.0f};
  td_paged_meta mc = {S, T, max_q, max_ctx, QS.c, CT.c, TB.c, stride, false, false, NULL, 0, 0.0f};
  pair QN = {0};
  float *qn = NULL;
  if (p->qn_dim) {
    qn = rnd((size_t)T * p->qn_dim, 1.5f);
    QN = mk(TD_BUF_ACT, qn, (size_t)T * p->qn_dim);
    mg.q_norm = QN.g, mc.q_norm = QN.c;
    mg.q_norm_dim = mc.q_norm_dim = p->qn_dim;
    mg.q_norm_eps = mc.q_norm_eps = 1e-6f;
  }
  float scale = 1.0f / sqrtf((float)D);
  RUN2(td_attn_states(G, Q.g, ldq, O.g, r.pool.g, &r.l, Hq, &mg, scale),
       td_attn_states(C, Q.c, ldq, O.c, r.pool.c, &r.l, Hq, &mc, scale));
  double e = compare(&O, 0);
  cr_expect(e <= TOL, "attn_states (%s) heads=%d D=%d bs=%d seqs=%d tokens=%d max_ctx=%d qn=%d: error %.3g", mode,
            Hq, D, bs, S, T, max_ctx, p->qn_dim, e);
  if (!(e <= TOL)) explain(&O, T * Hq, D);
  poison_gpu(&O);
  mg.kv_static = false;
  cr_assert(td_attn_states(G, Q.g, ldq, O.g, r.pool.g, &r.l, Hq, &mg, scale) == TD_OK, "%s", td_errmsg());
  e = compare(&O, 0);
  cr_expect(e <= TOL, "attn_states (%s, not static) heads=%d D=%d seqs=%d: error %.3g", mode, Hq, D, S, e);
  io_drop(p->qn_dim ? &QN : NULL, qn, &Q, &O, &QS, &CT, &TB);
  rig_drop(&r);
  free(q);
  free(tab);
  free(qs);
  free(ctx);
}

Test(cuda, attn_states) {
  static const states_cfg cfg[] = {
      /* heads D bs seqs q_max ctx_max pad qn ldq_pad */
      {16, 1024, 16, 64, 1, 512, false, 0, 0},  /* Flan-T5-large, batch 64 */
      {16, 1024, 16, 3, 1, 512, true, 1024, 0}, /* few sequences: many splits; the query norm */
      {16, 1024, 16, 5, 3, 77, false, 0, 8},    /* prompt rows: 48 pairs a sequence */
      {20, 1280, 16, 7, 1, 1500, false, 0, 0},  /* Whisper-large: two groups of 16 pairs */
      {8, 512, 4, 9, 2, 33, true, 512, 0},      /* T5-small: 8 heads, padded pairs */
      {12, 768, 3, 4, 1, 250, false, 0, 0},     /* block size 3: rows cross blocks */
      {1, 1024, 16, 2, 1, 1, false, 0, 0},      /* one head, one state */
      {4, 96, 5, 6, 2, 41, true, 0, 0},         /* a width the generic kernel takes */
      {3, 40, 2, 3, 3, 9, false, 40, 0},
      {16, 1024, 16, 2, 1, 64, false, 1003, 0}, /* norm rows not of whole vectors */
  };
  /* splits (16: a non-portable cluster) by the policy's warps, then each
   * warp count forced; 16 warps are the warp-specialised kernel where it
   * fits, the other one under ws 0; two splits of the warp-specialised
   * kernel are its plane split, the key splits under planes 0 */
  static const struct {
    const char *splits, *warps, *ws, *planes;
  } var[] = {
      {NULL, NULL, NULL, NULL}, {"1", NULL, NULL, NULL}, {"2", NULL, NULL, NULL}, {"16", NULL, NULL, NULL},
      {NULL, "8", NULL, NULL},  {"1", "8", NULL, NULL},  {"4", "8", NULL, NULL},  {NULL, "16", NULL, NULL},
      {"2", "16", NULL, NULL},  {"8", "16", NULL, NULL}, {"1", "16", "0", NULL},  {"2", "16", "0", NULL},
      {"2", "16", NULL, "0"},
  };
  static const char *const env[] = {"TANDEM_CUDA_STATES_SPLITS", "TANDEM_CUDA_STATES_WARPS", "TANDEM_CUDA_STATES_WS",
                                    "TANDEM_CUDA_STATES_PLANES"};
  /* TD_TEST_STATES_VARIANT=v, TD_TEST_STATES_CASE=i: that variant or case
   * alone (racecheck takes minutes a case) */
  const char *only = getenv("TD_TEST_STATES_VARIANT"), *one = getenv("TD_TEST_STATES_CASE");
  for (size_t v = 0; v < sizeof var / sizeof var[0]; v++) {
    if (only && *only && (size_t)atoi(only) != v) continue;
    const char *val[] = {var[v].splits, var[v].warps, var[v].ws, var[v].planes};
    char mode[64];
    snprintf(mode, sizeof mode, "splits %s, warps %s, ws %s, planes %s", val[0] ? val[0] : "-",
             val[1] ? val[1] : "-", val[2] ? val[2] : "-", val[3] ? val[3] : "-");
    for (int k = 0; k < 4; k++)
      if (val[k]) setenv(env[k], val[k], 1);
    for (size_t i = 0; i < sizeof cfg / sizeof cfg[0]; i++)
      if (!(one && *one) || (size_t)atoi(one) == i) states_case(&cfg[i], mode);
    for (int k = 0; k < 4; k++) unsetenv(env[k]);
  }
  setenv("TANDEM_CUDA_STATES_GENERIC", "1", 1);
  for (size_t i = 0; i < 5; i++) states_case(&cfg[i], "generic");
  unsetenv("TANDEM_CUDA_STATES_GENERIC");
}

static void heads_case(int m, int heads, int n, int k, bool w_t, bool bias) {
  float *x = rnd((size_t)m * heads * k, 1.0f), *w = rnd((size_t)heads * n * k, 0.5f);
  float *bh = bias ? rnd((size_t)heads * n, 1.0f) : NULL;
  pair X = mk(TD_BUF_ACT, x, (size_t)m * heads * k), W = mk(TD_BUF_ACT, w, (size_t)heads * n * k);
  pair Y = mk(TD_BUF_ACT, NULL, (size_t)m * heads * n), B = {0};
  if (bias) B = mk(TD_BUF_F32, bh, (size_t)heads * n);
  RUN2(td_gemm_heads(G, X.g, W.g, bias ? B.g : NULL, Y.g, m, heads, n, k, w_t),
       td_gemm_heads(C, X.c, W.c, bias ? B.c : NULL, Y.c, m, heads, n, k, w_t));
  double e = compare(&Y, 0);
  cr_expect(e <= TOL, "gemm_heads m=%d heads=%d n=%d k=%d w_t=%d bias=%d: error %.3g", m, heads, n, k, w_t, bias, e);
  drop(&X);
  drop(&W);
  drop(&Y);
  if (bias) drop(&B);
  free(x);
  free(w);
  free(bh);
}

Test(cuda, gemm_heads) {
  /* the tensor-core kernel (n % 64 == 0, k % 16 == 0; split K over a
   * cluster where blocks are few), then every case on cuBLASLt */
  for (int lt = 0; lt < 2; lt++) {
    if (lt) setenv("TANDEM_CUDA_HEADS_LT", "1", 1);
    heads_case(64, 16, 1024, 64, false, false); /* the query into state space */
    heads_case(64, 16, 64, 1024, true, true);   /* the mix back to a head, V bias */
    heads_case(1, 16, 1024, 64, false, false);
    heads_case(1, 20, 64, 1280, true, true); /* K over a cluster of 8 blocks */
    heads_case(37, 7, 40, 24, false, true); /* widths only cuBLASLt takes */
    heads_case(5, 3, 24, 40, true, false);
    heads_case(130, 8, 512, 64, false, false); /* three row tiles */
    heads_case(77, 5, 128, 48, false, true);
    heads_case(3, 4, 192, 512, true, true);
    heads_case(200, 2, 64, 16, true, false);
    unsetenv("TANDEM_CUDA_HEADS_LT");
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
  /* a backend that takes td_kv_prefetch from one sequence */
  td_backend *saved = G;
  td_backend_opts go = {.kind = TD_BACKEND_CUDA, .device = 0};
  setenv("TANDEM_CUDA_KVPF", "1", 1);
  cr_assert(td_backend_create(&go, &G) == TD_OK, "cuda backend: %s", td_errmsg());
  unsetenv("TANDEM_CUDA_KVPF");
  td_kv_layout l = {1, GH, GDH, GBS, 0};
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
  td_backend_destroy(G);
  G = saved;
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
