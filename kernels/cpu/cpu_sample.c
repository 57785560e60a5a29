/* Sampling on the CPU: the reference for the CUDA sampler and what the CPU
 * engine runs. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "kernels/backend_impl.h"

static void process_row(float *x, int vocab, const td_sample_row *r, const int32_t *bans) {
  if (r->forced >= 0 && r->forced < vocab) {
    for (int j = 0; j < vocab; j++) x[j] = -INFINITY;
    x[r->forced] = 0.0f;
    return;
  }
  for (int i = 0; i < r->ban_count; i++) {
    int32_t t = bans[r->ban_start + i];
    if (t >= 0 && t < vocab) x[t] = -INFINITY;
  }
}

/* log of sum(exp(x)) over the row, max-shifted. */
static float log_sum_exp(const float *x, int vocab, float *max_out) {
  float mx = -INFINITY;
  for (int j = 0; j < vocab; j++) mx = x[j] > mx ? x[j] : mx;
  *max_out = mx;
  if (mx == -INFINITY) return -INFINITY;
  double s = 0.0;
  for (int j = 0; j < vocab; j++) s += exp((double)(x[j] - mx));
  return mx + (float)log(s);
}

static int argmax(const float *x, int vocab) {
  int best = 0;
  for (int j = 1; j < vocab; j++)
    if (x[j] > x[best]) best = j;
  return best;
}

typedef struct cand {
  float v;
  int32_t id;
} cand;

static int cand_cmp(const void *a, const void *b) {
  const cand *x = a, *y = b;
  if (x->v != y->v) return x->v > y->v ? -1 : 1;
  return x->id < y->id ? -1 : x->id > y->id;
}

td_status td_cpu_sample(td_backend *b, float *logits, int n, int vocab, const td_sample_row *rows,
                        const int32_t *bans, int32_t *tokens, float *logprobs) {
  cand *c = NULL;
  for (int i = 0; i < n; i++) {
    float *x = logits + (size_t)i * vocab;
    const td_sample_row *r = &rows[i];
    process_row(x, vocab, r, bans);
    float mx;
    float lse = log_sum_exp(x, vocab, &mx);
    int tok;
    if (r->temperature <= 0.0f || r->forced >= 0) {
      tok = argmax(x, vocab);
    } else {
      if (!c) {
        c = malloc(sizeof *c * (size_t)vocab);
        if (!c) return td_err(TD_ERR_NOMEM, "sampling scratch");
      }
      float inv_t = 1.0f / r->temperature;
      for (int j = 0; j < vocab; j++) c[j] = (cand){(x[j] - mx) * inv_t, j};
      qsort(c, (size_t)vocab, sizeof *c, cand_cmp);
      int keep = vocab;
      if (r->top_k > 0 && r->top_k < keep) keep = r->top_k;
      double total = 0.0;
      for (int j = 0; j < keep; j++) total += exp((double)c[j].v);
      if (r->top_p < 1.0f) {
        double acc = 0.0;
        int k = 0;
        while (k < keep) {
          acc += exp((double)c[k].v) / total;
          k++;
          if (acc >= r->top_p) break;
        }
        keep = k;
        total = 0.0;
        for (int j = 0; j < keep; j++) total += exp((double)c[j].v);
      }
      double u = (double)td_rand_uniform(r->seed, r->stream, r->step) * total, acc = 0.0;
      tok = c[keep - 1].id;
      for (int j = 0; j < keep; j++) {
        acc += exp((double)c[j].v);
        if (u < acc) {
          tok = c[j].id;
          break;
        }
      }
    }
    tokens[i] = tok;
    if (logprobs) logprobs[i] = x[tok] - lse;
  }
  free(c);
  return TD_OK;
}

td_status td_cpu_topk_logprobs(td_backend *b, float *logits, int n, int vocab, const td_sample_row *rows,
                               const int32_t *bans, int k, int32_t *ids, float *vals) {
  for (int i = 0; i < n; i++) {
    float *x = logits + (size_t)i * vocab;
    float mx;
    float lse = log_sum_exp(x, vocab, &mx);
    for (int j = 0; j < vocab; j++) x[j] -= lse;
    process_row(x, vocab, &rows[i], bans);
    int32_t *oid = ids + (size_t)i * k;
    float *ov = vals + (size_t)i * k;
    int have = 0;
    for (int j = 0; j < vocab; j++) {
      float v = x[j];
      if (have == k && !(v > ov[k - 1])) continue; /* ties keep the lower id already in */
      int p = have < k ? have++ : k - 1;
      while (p > 0 && v > ov[p - 1]) {
        ov[p] = ov[p - 1];
        oid[p] = oid[p - 1];
        p--;
      }
      ov[p] = v;
      oid[p] = j;
    }
  }
  return TD_OK;
}
