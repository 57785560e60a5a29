/* The CUDA backend's tuning and launch policy, on the CPU: TANDEM_CUDA_*
 * parsed into td_cuda_tuning, its defaults applied, and which kernel,
 * splits, warps and planes the attention ops take for a shape
 * (kernels/cuda/cuda_policy.h). */
#include <criterion/criterion.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "common/defaults.h"
#include "common/settings.h"
#include "kernels/cuda/cuda_policy.h"
#include "kernels/ops.h"

static const char *const cuda_vars[] = {
    "TANDEM_CUDA_VERBOSE",       "TANDEM_CUDA_AUTOTUNE",      "TANDEM_CUDA_AUTOTUNE_MIN", "TANDEM_CUDA_PDL",
    "TANDEM_CUDA_PDL_LATE",      "TANDEM_CUDA_SKINNY",        "TANDEM_CUDA_SKINNY_ROWS",
    "TANDEM_CUDA_SKINNY_BULK",   "TANDEM_CUDA_WEIGHT_HINT",   "TANDEM_CUDA_GEMV",
    "TANDEM_CUDA_FUSE",          "TANDEM_CUDA_DENSE64",       "TANDEM_CUDA_DECATTN",
    "TANDEM_CUDA_DECATTN_SMALL", "TANDEM_CUDA_DECATTN_BULK",  "TANDEM_CUDA_DECATTN_CARVE",
    "TANDEM_CUDA_KVPF",          "TANDEM_CUDA_STATES_GENERIC", "TANDEM_CUDA_STATES_SPLITS",
    "TANDEM_CUDA_STATES_WARPS",  "TANDEM_CUDA_STATES_WS",     "TANDEM_CUDA_STATES_PLANES", "TANDEM_CUDA_STATES_WAVES",
    "TANDEM_CUDA_STATES_PL32",
    "TANDEM_CUDA_HEADS_LT",      "TANDEM_CUDA_CUSTOM_ALLREDUCE", "TANDEM_CUDA_FUSE_ALLREDUCE", "TANDEM_CUDA_CUSTOM_ALLGATHER",
    "TANDEM_CUDA_PLAN_BUCKET",   "TANDEM_CUDA_DENSE_SPLITS"};

static void clear(void) {
  for (size_t i = 0; i < sizeof cuda_vars / sizeof *cuda_vars; i++) unsetenv(cuda_vars[i]);
}

static td_cu_tune defaults(void) {
  td_cuda_tuning t = {0};
  td_cu_tune r;
  td_cu_tune_resolve(&t, &r);
  return r;
}

/* ---------------------------------------------------------------- settings */

Test(cuda_settings, unset_is_zero, .init = clear) {
  td_settings s;
  cr_assert_eq(td_settings_from_env(&s), TD_OK);
  td_cuda_tuning zero = {0};
  cr_assert(!memcmp(&s.cuda, &zero, sizeof zero), "every field 0 when nothing is set");
}

Test(cuda_settings, values_parse, .init = clear) {
  setenv("TANDEM_CUDA_VERBOSE", "1", 1);
  setenv("TANDEM_CUDA_PDL", "0", 1);
  setenv("TANDEM_CUDA_PDL_LATE", "5", 1);
  setenv("TANDEM_CUDA_GEMV", "8,100000,4,100000", 1);
  setenv("TANDEM_CUDA_FUSE", "16,7", 1);
  setenv("TANDEM_CUDA_DENSE64", "0,5", 1);
  setenv("TANDEM_CUDA_DECATTN_BULK", "1,2000000000,3,0", 1);
  setenv("TANDEM_CUDA_DECATTN_SMALL", "256", 1);
  setenv("TANDEM_CUDA_DECATTN_CARVE", "0", 1);
  setenv("TANDEM_CUDA_KVPF", "0", 1);
  setenv("TANDEM_CUDA_STATES_SPLITS", "0", 1);
  setenv("TANDEM_CUDA_STATES_WARPS", "16", 1);
  setenv("TANDEM_CUDA_STATES_WS", "off", 1);
  setenv("TANDEM_CUDA_HEADS_LT", "yes", 1);
  setenv("TANDEM_CUDA_CUSTOM_ALLREDUCE", "0", 1);
  setenv("TANDEM_CUDA_FUSE_ALLREDUCE", "off", 1);
  setenv("TANDEM_CUDA_CUSTOM_ALLGATHER", "no", 1);
  setenv("TANDEM_CUDA_AUTOTUNE_MIN", "500", 1);
  setenv("TANDEM_CUDA_PLAN_BUCKET", "off", 1);
  setenv("TANDEM_CUDA_STATES_PL32", "off", 1);
  td_settings s;
  cr_assert_eq(td_settings_from_env(&s), TD_OK, "%s", td_errmsg());
  td_cuda_tuning *c = &s.cuda;
  cr_assert_eq(c->verbose, TD_ON);
  cr_assert_eq(c->pdl, TD_OFF);
  cr_assert_eq(c->pdl_late, 5);
  cr_assert(c->gemv_maxv == 8 && c->gemv_maxn == 100000 && c->gemv_rows == 4 && c->gemv_rows_n == 100000);
  cr_assert(c->fuse_rows == 16 && c->fuse_mask == 7);
  cr_assert(c->dense64_warps == 0 && c->dense64_wave == 5);
  cr_assert(c->decode_bulk == 1 && c->decode_bulk_all == 2000000000 && c->decode_bulk_shape == 3 &&
            c->decode_bulk_early == TD_OFF);
  cr_assert(c->decode_small == 256 && c->decode_small_min == 0 && c->decode_small_ctx == 0, "unset fields: 0");
  cr_assert_eq(c->decode_bulk_carve, 1, "0 %% is the smallest carveout, as 1 %%");
  cr_assert_eq(c->kvpf_seqs, TD_OFF);
  cr_assert_eq(c->states_splits, 1, "0 splits: one");
  cr_assert_eq(c->states_warps, 16);
  cr_assert_eq(c->states_ws, TD_OFF);
  cr_assert_eq(c->heads_lt, TD_ON);
  cr_assert_eq(c->custom_allreduce, TD_OFF);
  cr_assert_eq(c->fuse_allreduce, TD_OFF);
  cr_assert_eq(c->custom_allgather, TD_OFF);
  cr_assert_eq(c->autotune_min, 500);
  cr_assert_eq(c->plan_bucket, TD_OFF);
  cr_assert_eq(c->states_pl32, TD_OFF);
  td_cu_tune r;
  td_cu_tune_resolve(c, &r);
  cr_assert_eq(r.autotune_min, 500);
  cr_assert(!r.plan_bucket && !r.fuse_allreduce && !r.custom_allgather && !r.states_pl32);
  /* "0" where 0 means none */
  setenv("TANDEM_CUDA_GEMV", "0", 1);
  setenv("TANDEM_CUDA_PDL_LATE", "0", 1);
  setenv("TANDEM_CUDA_DECATTN_CARVE", "-1", 1);
  cr_assert_eq(td_settings_from_env(&s), TD_OK, "%s", td_errmsg());
  cr_assert(c->gemv_maxv == TD_OFF && c->gemv_maxn == 0);
  cr_assert_eq(c->pdl_late, TD_OFF);
  cr_assert_eq(c->decode_bulk_carve, TD_OFF);
}

Test(cuda_settings, bad_values_are_refused_by_name, .init = clear) {
  static const char *const bad[][2] = {
      {"TANDEM_CUDA_PDL", "maybe"},          {"TANDEM_CUDA_GEMV", "8,x"},
      {"TANDEM_CUDA_GEMV", "8,"},            {"TANDEM_CUDA_GEMV", "1,2,3,4,5"},
      {"TANDEM_CUDA_FUSE", "16,99"},         {"TANDEM_CUDA_PDL_LATE", "-1"},
      {"TANDEM_CUDA_DENSE64", "6"},          {"TANDEM_CUDA_STATES_WARPS", "12"},
      {"TANDEM_CUDA_DENSE64", "1,5"},        {"TANDEM_CUDA_DENSE64", "0,3"},
      {"TANDEM_CUDA_DECATTN_BULK", "1,2,7"}, {"TANDEM_CUDA_KVPF", "32k"},
      {"TANDEM_CUDA_DECATTN", "99999999999"}, {"TANDEM_CUDA_HEADS_LT", "2"},
      {"TANDEM_CUDA_AUTOTUNE_MIN", "1e9"}, {"TANDEM_CUDA_PLAN_BUCKET", "2"},
      {"TANDEM_CUDA_FUSE_ALLREDUCE", "sometimes"}, {"TANDEM_CUDA_CUSTOM_ALLGATHER", "2"},
      {"TANDEM_CUDA_STATES_WAVES", "2"},    {"TANDEM_CUDA_STATES_PL32", "sometimes"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    clear();
    setenv(bad[i][0], bad[i][1], 1);
    td_settings s;
    cr_assert_eq(td_settings_from_env(&s), TD_ERR_INVALID, "%s=%s accepted", bad[i][0], bad[i][1]);
    cr_assert(strstr(td_errmsg(), bad[i][0]), "%s=%s: %s", bad[i][0], bad[i][1], td_errmsg());
  }
}

/* ---------------------------------------------------------------- defaults */

Test(cuda_tune, zero_takes_the_measured_defaults) {
  td_cu_tune r = defaults();
  cr_assert(!r.verbose && !r.autotune && r.autotune_min == TD_CUDA_DEFAULT_AUTOTUNE_MIN && r.pdl && r.pdl_late == -1);
  cr_assert(r.skinny && r.skinny_bulk && r.weight_hint && r.skinny_rows == TD_CUDA_DEFAULT_SKINNY_ROWS);
  cr_assert(r.gemv_maxv == TD_CUDA_DEFAULT_GEMV_MAXV && r.gemv_maxn == TD_CUDA_DEFAULT_GEMV_MAXN &&
            r.gemv_rows == TD_CUDA_DEFAULT_GEMV_ROWS && r.gemv_rows_n == TD_CUDA_DEFAULT_GEMV_ROWS_N);
  cr_assert(r.fuse == TD_CUDA_DEFAULT_FUSE_ROWS && r.fuse_mask == TD_CUDA_DEFAULT_FUSE_MASK);
  cr_assert(r.dense64_warps == 0 && r.dense64_wave == TD_CUDA_DEFAULT_DENSE64_WAVE);
  cr_assert(r.decode_warp == TD_CUDA_DEFAULT_DECODE_WARP && r.decode_small == TD_CUDA_DEFAULT_DECODE_SMALL &&
            r.decode_small_min == TD_CUDA_DEFAULT_DECODE_SMALL_MIN &&
            r.decode_small_ctx == TD_CUDA_DEFAULT_DECODE_SMALL_CTX);
  cr_assert(r.decode_bulk == TD_CUDA_DEFAULT_DECODE_BULK && r.decode_bulk_all == TD_CUDA_DEFAULT_DECODE_BULK_ALL &&
            r.decode_bulk_shape == 0 && r.decode_bulk_early == TD_CUDA_DEFAULT_DECODE_BULK_EARLY &&
            r.decode_bulk_carve == TD_CUDA_DEFAULT_DECODE_BULK_CARVE);
  cr_assert_eq(r.kvpf_seqs, TD_CUDA_DEFAULT_KVPF_SEQS);
  cr_assert(!r.states_generic && r.states_ws && r.states_planes && r.states_waves && r.states_pl32 &&
            r.states_splits == 0 && r.states_warps == 0);
  cr_assert(!r.heads_lt && r.custom_allreduce && r.fuse_allreduce && r.custom_allgather);
  cr_assert(r.plan_bucket);
}

/* ---------------------------------------------------------------- td_gemm's plans */

Test(cuda_policy, plan_rows) {
  td_cu_tune r = defaults();
  /* exact up to 64 rows, then eighths of the power of two */
  static const int want[][2] = {{1, 1},       {17, 17},     {64, 64},       {65, 72},      {72, 72},
                                {73, 80},     {128, 128},   {129, 144},     {260, 288},    {289, 320},
                                {1000, 1024}, {1025, 1152}, {32768, 32768}, {32769, 36864}};
  for (size_t i = 0; i < sizeof want / sizeof *want; i++)
    cr_expect_eq(td_cu_plan_rows(&r, want[i][0]), want[i][1], "%d rows: %d", want[i][0], td_cu_plan_rows(&r, want[i][0]));
  int last = 0, buckets = 0;
  for (int m = 1; m <= 100000; m++) {
    int b = td_cu_plan_rows(&r, m);
    cr_assert(b >= m && (m <= TD_CU_PLAN_EXACT_ROWS ? b == m : b <= m + m / 8), "%d rows: %d", m, b);
    cr_assert(b >= last, "monotone");
    if (m >= 260 && m <= 1320 && b != last) buckets++;
    last = b;
  }
  cr_expect_leq(buckets, 24, "an encoder run of one to three 260-440 token inputs: %d plans a shape", buckets);
  cr_expect_eq(td_cu_plan_rows(&r, INT_MAX), INT_MAX, "no overflow");
  r.plan_bucket = false;
  cr_expect_eq(td_cu_plan_rows(&r, 1000), 1000, "off: exact");
}

Test(cuda_tune, none_and_clamps) {
  td_cuda_tuning t = {.gemv_maxv = TD_OFF, .skinny_rows = 40, .fuse_rows = 40, .decode_bulk_carve = 150,
                      .decode_warp = TD_OFF, .pdl_late = TD_OFF, .kvpf_seqs = TD_OFF, .fuse_mask = TD_OFF};
  td_cu_tune r;
  td_cu_tune_resolve(&t, &r);
  cr_assert(r.gemv_maxv == 0 && r.gemv_rows == 0, "the warp kernel off, its rows too");
  cr_assert_eq(r.skinny_rows, 16);
  cr_assert_eq(r.fuse, TD_CU_FUSE_MAX_ROWS);
  cr_assert_eq(r.fuse_mask, 0);
  cr_assert_eq(r.decode_bulk_carve, 100);
  cr_assert_eq(r.decode_warp, 0);
  cr_assert_eq(r.pdl_late, 0, "no kernel late");
  cr_assert_eq(r.kvpf_seqs, 0);
  t = (td_cuda_tuning){.skinny_rows = 3, .decode_bulk_carve = TD_OFF};
  td_cu_tune_resolve(&t, &r);
  cr_assert_eq(r.skinny_rows, 8);
  cr_assert_eq(r.decode_bulk_carve, -1);
}

/* td_kv_prefetch's bound on a layer's self K/V: a quarter of L2 unless told */
Test(cuda_tune, kv_prefetch_bound, .init = clear) {
  td_cu_tune r = defaults();
  cr_assert_eq(r.kvpf_mb, -1);
  cr_assert_eq(td_cu_kvpf_bytes(&r, 50u << 20), (size_t)(50u << 20) / 4, "an H100's 50 MB: 12.5 MB");
  cr_assert_eq(td_cu_kvpf_bytes(&r, 0), 1, "no L2 reported: every step above the bound");
  td_settings s;
  setenv("TANDEM_CUDA_KVPF", "16,24", 1);
  cr_assert_eq(td_settings_from_env(&s), TD_OK, "%s", td_errmsg());
  td_cu_tune_resolve(&s.cuda, &r);
  cr_assert(r.kvpf_seqs == 16 && r.kvpf_mb == 24);
  cr_assert_eq(td_cu_kvpf_bytes(&r, 50u << 20), (size_t)24 << 20);
  setenv("TANDEM_CUDA_KVPF", "16,0", 1);
  cr_assert_eq(td_settings_from_env(&s), TD_OK, "%s", td_errmsg());
  td_cu_tune_resolve(&s.cuda, &r);
  cr_assert_eq(td_cu_kvpf_bytes(&r, 50u << 20), 0, "0 MB: any size");
  setenv("TANDEM_CUDA_KVPF", "16,x", 1);
  cr_assert_eq(td_settings_from_env(&s), TD_ERR_INVALID);
  unsetenv("TANDEM_CUDA_KVPF");
}

/* ---------------------------------------------------------------- td_attn_dense */

Test(cuda_policy, dense) {
  td_cu_tune r = defaults();
  td_dense_plan p = td_cu_dense_policy(&r, 64, true, 1000, 300);
  cr_assert(p.kernel == TD_DENSE_64_PIPE && p.qtiles == 3, "128 rows a tile, max_len 300");
  td_dense_kernel wave = TD_CUDA_DEFAULT_DENSE64_WAVE == 5 ? TD_DENSE_64_HALVES : TD_DENSE_64_PIPE1;
  cr_assert_eq(td_cu_dense_fit(&r, p.kernel, 132, 1, 132), wave, "one wave at one block an SM");
  cr_assert_eq(td_cu_dense_fit(&r, p.kernel, 120, 1, 132), wave);
  cr_assert_eq(td_cu_dense_fit(&r, p.kernel, 133, 1, 132), TD_DENSE_64_PIPE, "more: two an SM");
  cr_assert_eq(td_cu_dense_fit(&r, p.kernel, 67, 2, 132), TD_DENSE_64_PIPE, "blocks of every split counted");
  cr_assert_eq(td_cu_dense_fit(&r, TD_DENSE_128, 8, 1, 132), TD_DENSE_128, "other kernels as chosen");
  r.dense64_wave = 2;
  cr_assert_eq(td_cu_dense_fit(&r, p.kernel, 48, 1, 132), TD_DENSE_64_PIPE1, "one wave: one block of 8 warps");
  r.dense64_wave = 5;
  cr_assert_eq(td_cu_dense_fit(&r, p.kernel, 48, 1, 132), TD_DENSE_64_HALVES, "one wave: the keys in halves");
  cr_assert_eq(td_cu_dense_fit(&r, p.kernel, 48, 2, 132), TD_DENSE_64_PIPE1, "halves never beside key splits");
  cr_assert_eq(td_cu_dense_fit(&r, p.kernel, 133, 1, 132), TD_DENSE_64_PIPE, "more than a wave: two an SM");
  p = td_cu_dense_policy(&r, 64, true, 1000, 0);
  cr_assert_eq(p.qtiles, 8, "no bound: every token");
  r.dense64_warps = 1;
  p = td_cu_dense_policy(&r, 64, true, 1000, 300);
  cr_assert(p.kernel == TD_DENSE_64_PIPE && p.qtiles == 3 && p.rows == 128, "pipelined: 128 rows a tile");
  cr_assert_eq(td_cu_dense_fit(&r, p.kernel, 8, 1, 132), TD_DENSE_64_PIPE, "named: kept");
  r.dense64_warps = 2;
  cr_assert_eq(td_cu_dense_policy(&r, 64, true, 1000, 300).kernel, TD_DENSE_64_PIPE1);
  cr_assert_eq(td_cu_dense_fit(&r, TD_DENSE_64_PIPE1, 1000, 1, 132), TD_DENSE_64_PIPE1, "named: kept");
  r.dense64_warps = 3;
  cr_assert_eq(td_cu_dense_policy(&r, 64, true, 1000, 300).kernel, TD_DENSE_64_WGMMA);
  r.dense64_warps = 5;
  p = td_cu_dense_policy(&r, 64, true, 1000, 300);
  cr_assert(p.kernel == TD_DENSE_64_HALVES && p.rows == 128, "the keys in two halves: 128 rows a tile");
  cr_assert_eq(td_cu_dense_fit(&r, p.kernel, 8, 1, 132), TD_DENSE_64_HALVES, "named: kept");
  r.dense64_warps = 8;
  cr_assert_eq(td_cu_dense_policy(&r, 64, true, 1000, 300).kernel, TD_DENSE_64);
  r.dense64_warps = 4;
  p = td_cu_dense_policy(&r, 64, true, 1000, 300);
  cr_assert(p.kernel == TD_DENSE_64_SMALL && p.qtiles == 5, "64 rows a tile");
  p = td_cu_dense_policy(&r, 128, true, 1000, 300);
  cr_assert(p.kernel == TD_DENSE_128 && p.qtiles == 5);
  cr_assert_eq(td_cu_dense_policy(&r, 80, true, 1000, 300).kernel, TD_DENSE_GENERIC);
  cr_assert_eq(td_cu_dense_policy(&r, 64, false, 1000, 300).kernel, TD_DENSE_GENERIC);
  cr_assert_eq(td_cu_dense_policy(&r, 64, true, 1000, 300).rows, 64);
}

Test(cuda_policy, dense_key_splits) {
  td_cu_tune r = defaults();
  /* by default never: not where the blocks fill the SMs, nor where half of them idle */
  cr_assert_eq(td_cu_dense_splits(&r, 120, 1500, false), 1, "no splits to share SMs");
  cr_assert_eq(td_cu_dense_splits(&r, 64, 512, false), 1, "half the SMs idle: none either");
  cr_assert_eq(td_cu_dense_splits(&r, 24, 4000, false), 1, "few blocks, long keys");
  r.dense_splits = 1;
  cr_assert_eq(td_cu_dense_splits(&r, 120, 1500, false), 1, "off");
  r.dense_splits = 5;
  cr_assert_eq(td_cu_dense_splits(&r, 500, 1500, false), 5, "forced");
  cr_assert_eq(td_cu_dense_splits(&r, 24, 1500, true), 1, "forced, but causal");
  cr_assert_eq(td_cu_dense_splits(&r, 500, 600, false), 2, "forced, but four key tiles a split");
  cr_assert_eq(td_cu_dense_splits(&r, 12, 300, false), 1, "forced, but short keys");
}

/* ---------------------------------------------------------------- td_attn_paged */

enum { SMS = 132 };

/* A decode step's self-attention (causal, earlier keys static) of n
 * sequences, Flan-T5-large heads, context ctx */
static td_paged_shape self_decode(int n, int ctx) {
  td_paged_shape s = {.n_seqs = n, .n_tokens = n, .heads = 16, .head_dim = 64, .max_q = 1, .max_ctx = ctx,
                      .causal = true, .kv_static_past = true, .q_ok = true, .out_ok = true, .pool_ok = true,
                      .blocks_ok = true};
  return s;
}

static td_paged_shape cross_decode(int n, int ctx) {
  td_paged_shape s = self_decode(n, ctx);
  s.causal = false;
  s.kv_static = true;
  s.kv_static_past = false;
  return s;
}

Test(cuda_policy, paged_decode_kernels) {
  td_cu_tune r = defaults();
  td_paged_shape s = self_decode(1, 64);
  td_paged_plan p = td_cu_paged_policy(&r, SMS, &s);
  cr_assert(p.kernel == TD_PAGED_W2P4 && p.early, "few pairs, short context: 2 warps a pair, past keys early");
  s.max_ctx = 100;
  cr_assert_eq(td_cu_paged_policy(&r, SMS, &s).kernel, TD_PAGED_W4P2);
  s.max_ctx = 200;
  cr_assert_eq(td_cu_paged_policy(&r, SMS, &s).kernel, TD_PAGED_W8);
  s.max_ctx = 512;
  cr_assert_eq(td_cu_paged_policy(&r, SMS, &s).kernel, TD_PAGED_W16);
  s.max_ctx = 2000;
  cr_assert_eq(td_cu_paged_policy(&r, SMS, &s).kernel, TD_PAGED_TILED, "long contexts: the tiled kernel's splits");
  /* a TP=4 rank of Flan-T5-XL at batch 1: 8 heads over 512 encoder keys on 16 warps a pair (0.903-0.914 ms
   * a step against 0.957-0.979 on the tiled kernel's splits, 4 x H200); fewer pairs stay tiled */
  s = cross_decode(1, 512);
  s.heads = 8;
  cr_assert_eq(td_cu_paged_policy(&r, SMS, &s).kernel, TD_PAGED_W16);
  s.heads = 4;
  cr_assert_eq(td_cu_paged_policy(&r, SMS, &s).kernel, TD_PAGED_TILED);
  s = self_decode(64, 512);
  p = td_cu_paged_policy(&r, SMS, &s);
  cr_assert(p.kernel == TD_PAGED_W2P4 && p.early, "1024 pairs over self K/V: 2 warps a pair");
  s = cross_decode(16, 512);
  p = td_cu_paged_policy(&r, SMS, &s);
  cr_assert(p.kernel == TD_PAGED_BULK && p.early && p.bulk_warps == 4 && p.bulk_slots == 2 &&
                p.carve == TD_CUDA_DEFAULT_DECODE_BULK_CARVE,
            "256 pairs over static K/V: bulk copies, 4 warps, the carveout");
  s = cross_decode(64, 512);
  p = td_cu_paged_policy(&r, SMS, &s);
  cr_assert(p.kernel == TD_PAGED_BULK && p.bulk_warps == 2 && p.bulk_slots == 2 && p.carve == -1,
            "pairs beyond six an SM: 2 warps, no carveout");
  s = self_decode(12, 512);
  p = td_cu_paged_policy(&r, SMS, &s);
  cr_assert(p.kernel == TD_PAGED_BULK && !p.early, "192 pairs of self K/V: bulk, past keys after the wait");
  s = self_decode(8, 512);
  p = td_cu_paged_policy(&r, SMS, &s);
  cr_assert(p.kernel == TD_PAGED_BULK && p.early, "128 pairs: early");
}

Test(cuda_policy, paged_tuned) {
  td_cu_tune r = defaults();
  td_paged_shape s = cross_decode(16, 512);
  r.decode_bulk_shape = 3;
  td_paged_plan p = td_cu_paged_policy(&r, SMS, &s);
  cr_assert(p.kernel == TD_PAGED_BULK && p.bulk_warps == 2 && p.bulk_slots == 3 && p.carve == -1);
  r.decode_bulk = 0;
  cr_assert_eq(td_cu_paged_policy(&r, SMS, &s).kernel, TD_PAGED_TILED, "bulk off: 256 pairs, static K/V");
  r.decode_warp = 0;
  s = self_decode(1, 64);
  cr_assert_eq(td_cu_paged_policy(&r, SMS, &s).kernel, TD_PAGED_TILED, "the decode kernels off");
}

Test(cuda_policy, paged_tiled_and_generic) {
  td_cu_tune r = defaults();
  td_paged_shape s = self_decode(1, 512);
  s.head_dim = 128;
  td_paged_plan p = td_cu_paged_policy(&r, SMS, &s);
  cr_assert(p.kernel == TD_PAGED_TILED && p.qtiles == 1 && p.splits == 8, "16 blocks: keys split by the context");
  s = self_decode(4, 512);
  s.max_q = 40;
  s.n_tokens = 160;
  p = td_cu_paged_policy(&r, SMS, &s);
  cr_assert(p.kernel == TD_PAGED_TILED && p.qtiles == 3 && p.splits == 2, "prefill chunks: 192 blocks");
  s.q_ok = false;
  p = td_cu_paged_policy(&r, SMS, &s);
  cr_assert(p.kernel == TD_PAGED_GENERIC && p.qtiles == 40, "unaligned q: a warp a query row");
  s = self_decode(1, 64);
  s.head_dim = 80;
  cr_assert_eq(td_cu_paged_policy(&r, SMS, &s).kernel, TD_PAGED_GENERIC);
}

Test(cuda_policy, paged_query_norm) {
  td_cu_tune r = defaults();
  td_paged_shape s = cross_decode(1, 512);
  s.q_norm = s.q_norm_vec = true;
  td_paged_plan p = td_cu_paged_policy(&r, SMS, &s);
  cr_assert(p.kernel == TD_PAGED_W16 && p.qn_inside && !p.qn_before);
  s.q_norm_vec = false;
  p = td_cu_paged_policy(&r, SMS, &s);
  cr_assert(p.kernel == TD_PAGED_W16 && !p.qn_inside && p.qn_before, "rows not whole vectors: norm first");
  s = self_decode(1, 512);
  s.head_dim = 128;
  s.q_norm = s.q_norm_vec = true;
  s.q_ok = false;
  p = td_cu_paged_policy(&r, SMS, &s);
  cr_assert(p.kernel == TD_PAGED_TILED && p.qn_before, "the staged rows are aligned: the tiled kernel");
  s.blocks_ok = false;
  p = td_cu_paged_policy(&r, SMS, &s);
  cr_assert(p.kernel == TD_PAGED_GENERIC && p.qn_before, "staged rows, blocks not 16-byte aligned: generic");
}

/* ---------------------------------------------------------------- td_attn_states */

/* Every tensor-core kernel for the D at hand, `clusters` of each size resident */
static td_states_avail all_kernels(int clusters) {
  td_states_avail k = {0};
  for (int i = TD_STATES_MMA8; i < TD_STATES_KERNELS; i++) {
    k.has[i] = true;
    for (int c = 0; c < TD_CU_STATES_CLUSTERS; c++) k.clusters[i][c] = clusters;
  }
  return k;
}

static td_states_shape states_decode(int n, int ctx) {
  td_states_shape s = {.n_seqs = n, .heads = 16, .max_q = 1, .max_ctx = ctx, .aligned = true, .kv_static = true};
  return s;
}

Test(cuda_policy, states_splits_warps_planes) {
  td_cu_tune r = defaults();
  td_states_avail k = all_kernels(1000);
  td_states_shape s = states_decode(1, 512);
  td_states_plan p = td_cu_states_policy(&r, SMS, &k, &s);
  cr_assert(p.kernel == TD_STATES_MMA8 && p.groups == 1 && p.cluster == 8 && p.n_splits == 8 && p.blocks == 8,
            "one group: eight key splits on 8 warps");
  s = states_decode(64, 512);
  p = td_cu_states_policy(&r, SMS, &k, &s);
  cr_assert(p.kernel == TD_STATES_PL && p.cluster == 2 && p.n_splits == 1 && p.blocks == 128,
            "two splits on the warp-specialised kernel: D split instead");
  r.states_planes = false;
  p = td_cu_states_policy(&r, SMS, &k, &s);
  cr_assert(p.kernel == TD_STATES_WS && p.n_splits == 2);
  r.states_ws = false;
  cr_assert_eq(td_cu_states_policy(&r, SMS, &k, &s).kernel, TD_STATES_MMA16);
  s = states_decode(128, 512);
  r = defaults();
  p = td_cu_states_policy(&r, SMS, &k, &s);
  cr_assert(p.kernel == TD_STATES_WS && p.cluster == 1 && p.blocks == 128, "a wave of single blocks: 16 warps");
  /* past one wave: 16-warp blocks or plane pairs, by whole waves */
  k.clusters[TD_STATES_WS][0] = k.clusters[TD_STATES_MMA16][0] = 132;
  k.clusters[TD_STATES_PL][1] = 66;
  s = states_decode(160, 512);
  p = td_cu_states_policy(&r, SMS, &k, &s);
  cr_assert(p.kernel == TD_STATES_PL && p.cluster == 2 && p.n_splits == 1 && p.blocks == 320,
            "160 groups: three waves of pairs against two of 16-warp blocks (four pair waves)");
  s = states_decode(256, 512);
  p = td_cu_states_policy(&r, SMS, &k, &s);
  cr_assert(p.kernel == TD_STATES_WS && p.cluster == 1 && p.blocks == 256, "256 groups: a tie, 16-warp blocks");
  s = states_decode(300, 512);
  cr_assert_eq(td_cu_states_policy(&r, SMS, &k, &s).kernel, TD_STATES_PL, "300: 5 pair waves against 3 (6)");
  r.states_planes = false;
  p = td_cu_states_policy(&r, SMS, &k, &s);
  cr_assert(p.kernel == TD_STATES_WS && p.blocks == 300, "no pairs: 16-warp blocks in waves");
  r.states_ws = false;
  cr_assert_eq(td_cu_states_policy(&r, SMS, &k, &s).kernel, TD_STATES_MMA8, "neither: 8 warps");
  r = defaults();
  r.states_waves = false;
  cr_assert_eq(td_cu_states_policy(&r, SMS, &k, &s).kernel, TD_STATES_MMA8, "waves off: 8 warps");
  r = defaults();
  r.states_warps = 8;
  cr_assert_eq(td_cu_states_policy(&r, SMS, &k, &s).kernel, TD_STATES_MMA8, "told 8 warps");
  r.states_warps = 16;
  cr_assert_eq(td_cu_states_policy(&r, SMS, &k, &s).kernel, TD_STATES_WS, "told 16 warps: in waves");
}

/* Whisper-large's 20 heads: groups of 32 pairs on plane pairs where their
 * blocks fill half the SMs, else groups of 16 with key splits */
Test(cuda_policy, states_groups_of_32) {
  td_cu_tune r = defaults();
  td_states_avail k = {0}; /* D 1280: the 8- and 16-warp kernels and the 32-pair plane kernel */
  for (int i = TD_STATES_MMA8; i < TD_STATES_KERNELS; i++) {
    if (i == TD_STATES_WS || i == TD_STATES_PL) continue;
    k.has[i] = true;
    k.clusters[i][0] = 132, k.clusters[i][1] = 66, k.clusters[i][2] = 33, k.clusters[i][3] = 16;
  }
  td_states_shape s = states_decode(64, 1500);
  s.heads = 20;
  td_states_plan p = td_cu_states_policy(&r, SMS, &k, &s);
  cr_assert(p.kernel == TD_STATES_PL32 && p.groups == 1 && p.blocks == 128 && p.cluster == 2 && p.n_splits == 1,
            "batch 64: one group of 32 pairs a sequence (kernel %d, groups %d)", p.kernel, p.groups);
  s.max_q = 2; /* 40 pairs: two groups of 32 */
  p = td_cu_states_policy(&r, SMS, &k, &s);
  cr_assert(p.kernel == TD_STATES_PL32 && p.groups == 2 && p.blocks == 256);
  s.max_q = 1;
  s.n_seqs = 16; /* 32 blocks: the 16-pair groups' key splits */
  p = td_cu_states_policy(&r, SMS, &k, &s);
  cr_assert(p.kernel != TD_STATES_PL32 && p.groups == 2 && p.n_splits > 1);
  s.n_seqs = 64;
  r.states_pl32 = false;
  p = td_cu_states_policy(&r, SMS, &k, &s);
  cr_assert(p.kernel == TD_STATES_MMA16 && p.groups == 2 && p.blocks == 128, "off: two groups of 16");
  r = defaults();
  r.states_warps = 16;
  cr_assert_eq(td_cu_states_policy(&r, SMS, &k, &s).kernel, TD_STATES_MMA16, "told the warps: not the 32-pair kernel");
  r = defaults();
  s.heads = 16; /* one group of 16: nothing to gain */
  cr_assert_neq(td_cu_states_policy(&r, SMS, &k, &s).kernel, TD_STATES_PL32);
}

Test(cuda_policy, states_tuned_and_generic) {
  td_cu_tune r = defaults();
  td_states_avail k = all_kernels(1000);
  td_states_shape s = states_decode(1, 512);
  r.states_splits = 16;
  td_states_plan p = td_cu_states_policy(&r, SMS, &k, &s);
  cr_assert(p.kernel == TD_STATES_MMA8 && p.cluster == 16 && p.n_splits == 16, "16 splits: a non-portable cluster");
  r.states_splits = 3;
  cr_assert_eq(td_cu_states_policy(&r, SMS, &k, &s).cluster, 2, "the largest power of two up to 3");
  r.states_splits = 0;
  r.states_warps = 16;
  p = td_cu_states_policy(&r, SMS, &k, &s);
  cr_assert(p.kernel == TD_STATES_WS && p.n_splits == 8);
  r = defaults();
  r.states_generic = true;
  cr_assert_eq(td_cu_states_policy(&r, SMS, &k, &s).kernel, TD_STATES_GENERIC);
  r = defaults();
  s.kv_static = false;
  cr_assert_eq(td_cu_states_policy(&r, SMS, &k, &s).kernel, TD_STATES_GENERIC);
  s = states_decode(1, 512);
  s.aligned = false;
  cr_assert_eq(td_cu_states_policy(&r, SMS, &k, &s).kernel, TD_STATES_GENERIC);
  td_states_avail none = {0};
  s = states_decode(1, 512);
  cr_assert_eq(td_cu_states_policy(&r, SMS, &none, &s).kernel, TD_STATES_GENERIC, "no kernel for this D");
  k.has[TD_STATES_MMA8] = false;
  p = td_cu_states_policy(&r, SMS, &k, &s);
  cr_assert(p.kernel == TD_STATES_MMA16 && p.n_splits == 8, "without an 8-warp kernel, its splits on 16 warps");
}

Test(cuda_policy, states_switch_rows) {
  cr_assert_eq(td_cu_states_switch_rows(1024, true, false, false), 48, "Flan-T5-large, BART-large");
  cr_assert_eq(td_cu_states_switch_rows(1024, true, false, true), INT_MAX, "int8 K/V: level or ahead at every batch");
  cr_assert_eq(td_cu_states_switch_rows(512, true, false, false), 48);
  cr_assert_eq(td_cu_states_switch_rows(1280, true, false, false), INT_MAX,
               "Whisper-large without the 32-pair kernel: the K/V path is faster");
  cr_assert_eq(td_cu_states_switch_rows(1280, true, true, false), 48, "with it: by row count from 48");
  cr_assert_eq(td_cu_states_switch_rows(1280, true, true, true), INT_MAX);
  cr_assert_eq(td_cu_states_switch_rows(1024, false, false, false), INT_MAX, "no tensor-core kernel: never");
  cr_assert_eq(td_cu_states_switch_rows(0, true, true, false), INT_MAX);
}

/* Whisper-large on 132 SMs (66 clusters of two resident): the states where
 * the 32-pair kernel's last wave is at least 80 % full */
Test(cuda_policy, states_switch_takes) {
  const int cap = 132;
  cr_assert(td_cu_states_switch_takes(1024, 16, true, false, false, 48, 0), "D 1024: from 48 rows at any count");
  cr_assert(td_cu_states_switch_takes(1024, 16, true, false, false, 97, 0));
  cr_assert(!td_cu_states_switch_takes(1024, 16, true, false, false, 47, 0));
  cr_assert(!td_cu_states_switch_takes(1024, 16, true, false, true, 64, 0), "int8 K/V");
  static const struct {
    int rows;
    bool takes;
  } w[] = {{32, false}, {48, false}, {53, true}, {64, true}, {66, true}, {80, false}, {96, false},
           {106, true}, {128, true}, {132, true}, {150, false}, {160, true}, {256, true}};
  for (size_t i = 0; i < sizeof w / sizeof w[0]; i++)
    cr_assert_eq(td_cu_states_switch_takes(1280, 20, true, true, false, w[i].rows, cap), w[i].takes, "%d rows",
                 w[i].rows);
  cr_assert(!td_cu_states_switch_takes(1280, 20, true, false, false, 64, cap), "without the 32-pair kernel");
  cr_assert(!td_cu_states_switch_takes(1280, 20, true, true, false, 64, 0), "no cluster resident");
  cr_assert(!td_cu_states_switch_takes(1280, 16, true, true, false, 64, cap), "16 heads at 1280: one group of 16");
  cr_assert(!td_cu_states_switch_takes(1280, 20, true, true, true, 64, cap), "int8 K/V");
}

/* ---------------------------------------------------------------- the backend hook */

Test(cuda_tune, set_cuda_tuning_refused_off_cuda) {
  td_backend_opts o = {.kind = TD_BACKEND_CPU};
  td_backend *b;
  cr_assert_eq(td_backend_create(&o, &b), TD_OK);
  td_cuda_tuning t = {0};
  cr_assert_eq(td_backend_set_cuda_tuning(b, &t), TD_ERR_UNSUPPORTED);
  td_backend_destroy(b);
}
