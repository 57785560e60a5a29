/* The encoder's warm-up at engine creation: one encoder run at each GEMM
 * plan bucket (td_backend_gemm_plan_rows) its runs can meet, up to the
 * engine's max_enc_tokens, so that no request pays for a cuBLASLt plan or a
 * kernel's first load. Cold, an engine's first closed loop of BART-large ran
 * its steps 10-18 % slower than the next (bench/RESULTS.md); the decode
 * step's buckets are warm already (td_model_capture_graphs). Nothing to do
 * where the backend keeps no plans (the CPU) and on TP / PP ranks, whose
 * encoder runs are mirrored run by run. */
#include <stdlib.h>

#include "common/clock.h"
#include "common/defaults.h"
#include "common/log.h"
#include "engine/internal.h"

/* One encoder run of n_seqs sequences of lens[i] inputs each (Whisper: whole
 * feature windows), its output in freshly taken cross blocks, given back. */
static td_status warm_run(td_engine *e, int n_seqs, const int32_t *lens, bool whisper, bool *no_room) {
  int bs = e->bs, rows = 0, blocks = 0;
  for (int i = 0; i < n_seqs; i++) {
    int el = whisper ? e->max_src : lens[i];
    rows += el;
    blocks += eng_blocks_for(el, bs);
  }
  *no_room = blocks > td_kv_pool_num_free(e->cross);
  if (*no_room) return TD_OK;
  size_t nf = whisper ? (size_t)e->cfg->num_mel_bins * td_model_input_frames(e->m) : 0;
  int32_t *ids = malloc(sizeof *ids * (size_t)blocks), *slots = malloc(sizeof *slots * (size_t)rows);
  int32_t *toks = whisper ? NULL : calloc((size_t)rows, sizeof *toks); /* token 0: any id does */
  float *feats = whisper ? calloc(nf * (size_t)n_seqs, sizeof *feats) : NULL;
  td_status s = TD_OK;
  if (!ids || !slots || (!whisper && !toks) || (whisper && !feats)) s = td_err(TD_ERR_NOMEM, "out of memory");
  if (s == TD_OK) s = td_kv_alloc(e->cross, blocks, ids);
  if (s == TD_OK) {
    int k = 0, b0 = 0;
    for (int i = 0; i < n_seqs; i++) {
      int el = whisper ? e->max_src : lens[i];
      eng_cross_slots(ids + b0, el, bs, slots + k);
      k += el;
      b0 += eng_blocks_for(el, bs);
    }
    td_encode_input in = {.n_seqs = n_seqs, .lens = lens, .tokens = toks, .features = feats, .cross_slots = slots};
    s = td_model_encode(e->m, &in, NULL);
    td_kv_unref_all(e->cross, ids, blocks);
  }
  free(ids);
  free(slots);
  free(toks);
  free(feats);
  return s;
}

td_status eng_warm_encoder(td_engine *e) {
  const td_model_opts *mo = td_model_get_opts(e->m);
  if (mo->tp_size > 1 || mo->pp_size > 1 || td_backend_gemm_plan_rows(e->b, 1) <= 0) return TD_OK;
  bool whisper = e->cfg->family == TD_FAMILY_WHISPER;
  int max_rows = e->o.max_enc_tokens, max_seqs = mo->max_enc_seqs;
  /* text: sequences of at most 1,024 (the rows decide a plan; T5's source length is not bounded so) */
  int each = whisper ? e->max_src : e->max_src < TD_ENGINE_WARM_SEQ_MAX ? e->max_src : TD_ENGINE_WARM_SEQ_MAX;
  if (each <= 0 || max_seqs <= 0) return TD_OK;
  int buckets = 0; /* the plan_rows guarantee (at least m) makes each step advance */
  for (int m = 1; m <= max_rows && buckets <= TD_ENGINE_WARM_MAX_RUNS; m = td_backend_gemm_plan_rows(e->b, m) + 1)
    buckets++;
  if (buckets > TD_ENGINE_WARM_MAX_RUNS) {
    TD_INFO("no encoder warm-up: the backend's GEMM plans are not bucketed (%d+ row counts to warm)", buckets);
    return TD_OK;
  }
  int32_t *lens = malloc(sizeof *lens * (size_t)max_seqs);
  if (!lens) return td_err(TD_ERR_NOMEM, "out of memory");
  int64_t t0 = td_now_ns();
  int runs = 0, last = 0, top = 0;
  td_status s = TD_OK;
  bool no_room = false;
  if (whisper) {
    /* a run's rows are whole windows: n x the encoder's positions (and 2n x for the convolution's) */
    int frames = td_model_input_frames(e->m), prev_a = 0, prev_b = 0;
    for (int n = 1; n <= max_seqs && (int64_t)n * each <= max_rows && s == TD_OK && !no_room; n++) {
      int a = td_backend_gemm_plan_rows(e->b, n * each), b = td_backend_gemm_plan_rows(e->b, n * frames);
      if (a == prev_a && b == prev_b) continue;
      prev_a = a, prev_b = b;
      for (int i = 0; i < n; i++) lens[i] = 0;
      s = warm_run(e, n, lens, true, &no_room);
      runs += s == TD_OK && !no_room;
      if (s == TD_OK && !no_room) top = n * each;
    }
  } else {
    /* every bucket from one row up: a bucket's largest row count, in sequences of at most the source length */
    for (int m = 1; m <= max_rows && s == TD_OK && !no_room; m = last + 1) {
      int r = td_backend_gemm_plan_rows(e->b, m); /* at least m */
      if (r > max_rows) r = max_rows;
      last = r;
      int n = (r + each - 1) / each;
      if (n > max_seqs) break;
      for (int i = 0; i < n; i++) lens[i] = i < n - 1 ? each : r - each * (n - 1);
      s = warm_run(e, n, lens, false, &no_room);
      runs += s == TD_OK && !no_room;
      if (s == TD_OK && !no_room) top = r;
    }
  }
  free(lens);
  if (s != TD_OK) return td_err_ctx(s, "the encoder's warm-up: ");
  TD_INFO("warmed the encoder's GEMM plans: %d runs of up to %d positions in %.2f s%s", runs, top,
          (double)(td_now_ns() - t0) / 1e9, no_room ? " (the cross pool held no more)" : "");
  return TD_OK;
}
