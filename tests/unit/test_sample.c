/* The sampler: greedy is argmax, draws stay inside top-k / top-p, a seed
 * reproduces, forced and banned tokens hold, beam top-k is exact. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "kernels/ops.h"

static td_backend *cpu(void) {
  td_backend_opts bo = {.kind = TD_BACKEND_CPU};
  td_backend *b;
  cr_assert(td_backend_create(&bo, &b) == TD_OK);
  return b;
}

static float frand(void) { return (float)rand() / (float)RAND_MAX; }

Test(sample, draws_stay_in_top_k_and_top_p) {
  td_backend *b = cpu();
  srand(7);
  const int V = 1001, N = 200;
  float *logits = malloc(sizeof(float) * V * N), *orig = malloc(sizeof(float) * V * N);
  td_sample_row *rows = calloc(N, sizeof *rows);
  int32_t tok[200];
  for (int i = 0; i < V * N; i++) orig[i] = 4 * frand() - 2;
  for (int i = 0; i < N; i++)
    rows[i] = (td_sample_row){.temperature = 0.5f + frand(), .top_k = 1 + rand() % 50,
                              .top_p = i % 2 ? 0.3f + 0.6f * frand() : 1.0f, .forced = -1, .seed = (uint64_t)i,
                              .step = (uint32_t)i};
  memcpy(logits, orig, sizeof(float) * V * N);
  cr_assert(td_sample(b, logits, N, V, rows, NULL, tok, NULL) == TD_OK);
  for (int i = 0; i < N; i++) {
    const float *x = orig + (size_t)i * V;
    int above = 0;
    for (int j = 0; j < V; j++) above += x[j] > x[tok[i]];
    cr_expect(above < rows[i].top_k, "row %d: token ranked %d, top_k %d", i, above, rows[i].top_k);
    if (rows[i].top_p < 1.0f) {
      /* the probability mass strictly above the token is below top_p */
      double t = rows[i].temperature, mx = -INFINITY, z = 0, mass = 0;
      for (int j = 0; j < V; j++) mx = x[j] > mx ? x[j] : mx;
      for (int j = 0; j < V; j++) z += exp((x[j] - mx) / t);
      for (int j = 0; j < V; j++)
        if (x[j] > x[tok[i]]) mass += exp((x[j] - mx) / t) / z;
      cr_expect(mass < rows[i].top_p + 1e-6, "row %d: mass above %.4f, top_p %.4f", i, mass, rows[i].top_p);
    }
  }
  /* same seed, same draw; another step draws independently */
  int32_t again[200];
  memcpy(logits, orig, sizeof(float) * V * N);
  cr_assert(td_sample(b, logits, N, V, rows, NULL, again, NULL) == TD_OK);
  cr_expect_arr_eq(tok, again, sizeof tok);
  free(logits);
  free(orig);
  free(rows);
  td_backend_destroy(b);
}

Test(sample, greedy_forced_and_banned) {
  td_backend *b = cpu();
  const int V = 50;
  float x[3 * 50];
  for (int i = 0; i < 3 * V; i++) x[i] = (float)(i % V) * 0.01f;
  x[7] = 5.0f;                      /* row 0: argmax 7 */
  x[V + 9] = 5.0f, x[V + 3] = 4.0f; /* row 1: 9 banned -> 3 */
  x[2 * V + 11] = 5.0f;             /* row 2: forced 20 */
  int32_t bans[1] = {9};
  td_sample_row rows[3] = {{.temperature = 0, .forced = -1},
                           {.temperature = 0, .forced = -1, .ban_start = 0, .ban_count = 1},
                           {.temperature = 1, .forced = 20}};
  int32_t tok[3];
  float lp[3];
  cr_assert(td_sample(b, x, 3, V, rows, bans, tok, lp) == TD_OK);
  cr_expect_eq(tok[0], 7);
  cr_expect_eq(tok[1], 3);
  cr_expect_eq(tok[2], 20);
  cr_expect(fabsf(lp[2]) < 1e-6, "forced token log-prob %g", lp[2]);
  cr_expect(lp[0] < 0 && lp[0] > -1.0f);
  td_backend_destroy(b);
}

Test(sample, topk_logprobs_exact) {
  td_backend *b = cpu();
  srand(3);
  const int V = 333, N = 5, K = 8;
  float x[5 * 333], y[5 * 333];
  for (int i = 0; i < V * N; i++) x[i] = y[i] = 3 * frand();
  x[10] = x[11] = y[10] = y[11] = 9.0f; /* tie: lower id first */
  td_sample_row rows[5];
  memset(rows, 0, sizeof rows);
  for (int i = 0; i < N; i++) rows[i].forced = -1;
  int32_t ids[5 * 8];
  float vals[5 * 8];
  cr_assert(td_topk_logprobs(b, x, N, V, rows, NULL, K, ids, vals) == TD_OK);
  cr_expect_eq(ids[0], 10);
  cr_expect_eq(ids[1], 11);
  for (int i = 0; i < N; i++) {
    const float *r = y + (size_t)i * V;
    double mx = -INFINITY, z = 0;
    for (int j = 0; j < V; j++) mx = r[j] > mx ? r[j] : mx;
    for (int j = 0; j < V; j++) z += exp(r[j] - mx);
    for (int k = 0; k < K; k++) {
      double want = r[ids[i * K + k]] - mx - log(z);
      cr_expect(fabs(vals[i * K + k] - want) < 1e-5);
      if (k) cr_expect(vals[i * K + k] <= vals[i * K + k - 1]);
      int above = 0;
      for (int j = 0; j < V; j++) above += r[j] > r[ids[i * K + k]];
      cr_expect(above <= k);
    }
  }
  td_backend_destroy(b);
}
