/* A fixture's requests decoded together: each request's prompt alone, then
 * decode steps over all of them at once (one row a sequence), fed the
 * reference tokens, for as many steps as the shortest reference allows.
 * Each batch row is compared with its request's reference logits. The
 * test programs of both backends include this (it needs the model and KV
 * cache libraries, which the fixture library does not link). */
#ifndef TD_TESTS_FX_BATCH_H
#define TD_TESTS_FX_BATCH_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "kvcache/kvcache.h"
#include "model/model.h"
#include "tests/unit/fixture.h"

/* one step; returns its logits on the host, [n_logits, vocab] */
typedef const float *(*fx_step_fn)(void *ctx, const td_step_input *st);

typedef struct fx_batch_result {
  double worst;  /* max over batch rows of the relative logit error */
  int steps;     /* batched steps run */
  int flips;     /* greedy tokens that differ where the reference margin exceeds tie x the row's logit error */
} fx_batch_result;

static fx_batch_result fx_batched_decode(const fixture *fx, td_model *m, td_kv_pool *self, td_kv_pool *cross, int bs,
                                         fx_step_fn step, void *ctx, double tie) {
  enum { MAXN = 8, MAXB = 64 };
  int N = fx->n < MAXN ? fx->n : MAXN, V = fx->vocab, K = 1 << 30, cstride = 1, sstride = 1;
  int32_t cb[MAXN][MAXB], sb[MAXN][MAXB], ncb[MAXN], nsb[MAXN];
  fx_batch_result res = {0.0, 0, 0};
  for (int i = 0; i < N; i++) {
    const fx_request *q = &fx->req[i];
    K = q->n_greedy < K ? q->n_greedy : K;
    ncb[i] = (q->enc_len + bs - 1) / bs;
    nsb[i] = (q->n_prompt + q->n_greedy + bs - 1) / bs;
    cr_assert(ncb[i] <= MAXB && nsb[i] <= MAXB, "fixture request %d too long for the batch test", i);
    cstride = ncb[i] > cstride ? ncb[i] : cstride;
    sstride = nsb[i] > sstride ? nsb[i] : sstride;
    cr_assert(td_kv_alloc(cross, ncb[i], cb[i]) == TD_OK && td_kv_alloc(self, nsb[i], sb[i]) == TD_OK);
    int32_t *cs = malloc(sizeof(int32_t) * (size_t)q->enc_len);
    for (int t = 0; t < q->enc_len; t++) cs[t] = cb[i][t / bs] * bs + t % bs;
    td_encode_input in = {.n_seqs = 1, .lens = &q->n_input, .tokens = q->input_ids,
                          .features = fx->features ? fx->features + (size_t)i * fx->mels * fx->frames : NULL,
                          .cross_slots = cs};
    cr_assert(td_model_encode(m, &in, NULL) == TD_OK, "%s", td_errmsg());
    free(cs);
    /* the prompt alone */
    int P = q->n_prompt;
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)P * 2), *slots = pos + P, qs[2] = {0, P}, ctx_len = P,
            clen = q->enc_len, last = P - 1;
    for (int t = 0; t < P; t++) {
      pos[t] = t;
      slots[t] = sb[i][t / bs] * bs + t % bs;
    }
    td_step_input st = {.n_seqs = 1, .n_tokens = P, .tokens = q->prompt, .positions = pos, .q_start = qs,
                        .ctx_len = &ctx_len, .slots = slots, .block_table = sb[i], .block_stride = nsb[i],
                        .cross_len = &clen, .cross_table = cb[i], .cross_stride = ncb[i], .n_logits = 1,
                        .logit_rows = &last};
    (void)step(ctx, &st);
    free(pos);
  }
  /* step k feeds every request's reference token k - 1 */
  int32_t tok[MAXN], pos[MAXN], slots[MAXN], qs[MAXN + 1], ctx_len[MAXN], clen[MAXN], rows[MAXN];
  int32_t tab[MAXN * MAXB] = {0}, ctab[MAXN * MAXB] = {0};
  for (int i = 0; i < N; i++) {
    memcpy(tab + (size_t)i * sstride, sb[i], sizeof(int32_t) * (size_t)nsb[i]);
    memcpy(ctab + (size_t)i * cstride, cb[i], sizeof(int32_t) * (size_t)ncb[i]);
  }
  for (int k = 1; k < K; k++) {
    for (int i = 0; i < N; i++) {
      const fx_request *q = &fx->req[i];
      int p = q->n_prompt + k - 1;
      tok[i] = q->greedy[k - 1];
      pos[i] = p;
      slots[i] = sb[i][p / bs] * bs + p % bs;
      qs[i] = i;
      ctx_len[i] = p + 1;
      clen[i] = q->enc_len;
      rows[i] = i;
    }
    qs[N] = N;
    td_step_input st = {.n_seqs = N, .n_tokens = N, .tokens = tok, .positions = pos, .q_start = qs,
                        .ctx_len = ctx_len, .slots = slots, .block_table = tab, .block_stride = sstride,
                        .cross_len = clen, .cross_table = ctab, .cross_stride = cstride, .n_logits = N,
                        .logit_rows = rows};
    const float *lg = step(ctx, &st);
    for (int i = 0; i < N; i++) {
      const fx_request *q = &fx->req[i];
      const float *got = lg + (size_t)i * V, *ref = fx->logits + (q->logits_off + (size_t)(q->n_prompt - 1 + k)) * V;
      double e = fx_rel_err(got, ref, (size_t)V), mabs = 0.0;
      res.worst = e > res.worst ? e : res.worst;
      int best = 0;
      for (int j = 0; j < V; j++) {
        best = got[j] > got[best] ? j : best;
        mabs = fabs(got[j] - ref[j]) > mabs ? fabs(got[j] - ref[j]) : mabs;
      }
      int want = q->greedy[k];
      if (best != want && (double)ref[want] - ref[best] > tie * mabs) res.flips++;
    }
    res.steps++;
  }
  for (int i = 0; i < N; i++) {
    td_kv_unref_all(self, sb[i], nsb[i]);
    td_kv_unref_all(cross, cb[i], ncb[i]);
  }
  return res;
}

/* The fixtures both backends decode in batches. */
static const char *const fx_batch_models[] = {"t5-tiny", "bart-tiny", "whisper-tiny", "mbart-prenorm-sharded"};
enum { FX_BATCH_MODELS = sizeof fx_batch_models / sizeof fx_batch_models[0] };

/* A batched run's verdict: steps ran, every row within tol, no greedy flip
 * (qn_rows: the td_model_tuning.qnorm_rows it ran under, NULL for the default). */
static void fx_batch_expect(const char *model, const char *qn_rows, fx_batch_result res, double tol) {
  cr_expect(res.steps > 0, "%s: no batched steps", model);
  cr_expect(res.worst <= tol && res.flips == 0,
            "%s (query norm from %s rows): %d batched steps, logits error %.3g, %d greedy flips", model,
            qn_rows ? qn_rows : "default", res.steps, res.worst, res.flips);
}

#endif
