/* KV pools sized from a memory budget (td_engine_plan_pools): the budget
 * split in the proportion of one sequence at the model's longest, refused
 * loudly when it holds none; the CPU keeps the model's sizes. */
#include <criterion/criterion.h>
#include <string.h>

#include "engine/engine.h"
#include "fixture.h"

Test(pool_plan, the_budget_holds_whole_sequences) {
  /* one sequence: 33 self blocks of 3 MiB and 32 cross blocks of 3 MiB + 64 KiB */
  td_pool_plan p = {.self_block_bytes = 3u << 20, .cross_block_bytes = (3u << 20) + (64u << 10), .self_per_seq = 33,
                    .cross_per_seq = 32};
  double seq = 33.0 * (3u << 20) + 32.0 * ((3u << 20) + (64u << 10));
  int sb, cb;
  p.budget = 310 * seq + seq / 2; /* 310.5 sequences */
  cr_assert_eq(td_engine_plan_pools(&p, &sb, &cb), TD_OK, "%s", td_errmsg());
  cr_assert_eq(sb, 310 * 33);
  cr_assert_eq(cb, 310 * 32);
  cr_assert_leq((double)sb * p.self_block_bytes + (double)cb * p.cross_block_bytes, p.budget, "within the budget");
  p.budget = seq;
  cr_assert_eq(td_engine_plan_pools(&p, &sb, &cb), TD_OK);
  cr_assert_eq(sb, 33);
  cr_assert_eq(cb, 32);
}

Test(pool_plan, a_budget_below_one_sequence_is_refused_naming_the_sizes) {
  td_pool_plan p = {.budget = 100.0 * (1 << 20), .self_block_bytes = 3u << 20, .cross_block_bytes = 3u << 20,
                    .self_per_seq = 33, .cross_per_seq = 32};
  int sb = 7, cb = 7;
  cr_assert_eq(td_engine_plan_pools(&p, &sb, &cb), TD_ERR_NO_BLOCKS);
  cr_assert(strstr(td_errmsg(), "100 MiB"), "%s", td_errmsg());
  cr_assert(strstr(td_errmsg(), "--gpu-memory-fraction"), "%s", td_errmsg());
  cr_assert_eq(sb, 0);
  cr_assert_eq(cb, 0);
  p.budget = -5;
  cr_assert_eq(td_engine_plan_pools(&p, &sb, &cb), TD_ERR_NO_BLOCKS);
}

Test(pool_plan, nonsense_sizes_are_refused) {
  int sb, cb;
  td_pool_plan p = {.budget = 1e9, .self_block_bytes = 0, .cross_block_bytes = 1024, .self_per_seq = 4,
                    .cross_per_seq = 4};
  cr_assert_eq(td_engine_plan_pools(&p, &sb, &cb), TD_ERR_INVALID);
  p.self_block_bytes = 1024;
  p.self_per_seq = 0;
  cr_assert_eq(td_engine_plan_pools(&p, &sb, &cb), TD_ERR_INVALID);
}

Test(pool_plan, block_counts_stay_within_int32) {
  td_pool_plan p = {.budget = 1e30, .self_block_bytes = 1, .cross_block_bytes = 1, .self_per_seq = 3,
                    .cross_per_seq = 2};
  int sb, cb;
  cr_assert_eq(td_engine_plan_pools(&p, &sb, &cb), TD_OK);
  cr_assert_gt(sb, 0);
  cr_assert_gt(cb, 0);
}

Test(pool_plan, the_cpu_keeps_the_models_sizes) {
  fixture fx;
  fx_load("t5-tiny", &fx);
  td_backend *b;
  td_backend_opts bo = {.kind = TD_BACKEND_CPU};
  cr_assert_eq(td_backend_create(&bo, &b), TD_OK);
  double budget;
  cr_assert_eq(td_engine_memory_budget(b, 0.9, &budget), TD_ERR_UNSUPPORTED);
  cr_assert_eq(td_engine_memory_budget(b, 1.5, &budget), TD_ERR_INVALID);
  cr_assert_eq(td_engine_memory_budget(b, 0, &budget), TD_ERR_INVALID);
  td_model *m;
  td_model_opts mo = {.max_seqs = 8};
  cr_assert_eq(td_model_load(fx.dir, b, &mo, &m), TD_OK, "%s", td_errmsg());
  td_engine *with, *without;
  td_engine_opts eo = {.max_running = 8, .gpu_memory_fraction = 0.9};
  cr_assert_eq(td_engine_create(m, &eo, NULL, &with), TD_OK, "%s", td_errmsg());
  td_engine_stats a = td_engine_get_stats(with);
  td_engine_destroy(with);
  eo.gpu_memory_fraction = 0;
  cr_assert_eq(td_engine_create(m, &eo, NULL, &without), TD_OK);
  td_engine_stats c = td_engine_get_stats(without);
  td_engine_destroy(without);
  cr_assert_eq(a.self.n_blocks, c.self.n_blocks);
  cr_assert_eq(a.cross.n_blocks, c.cross.n_blocks);
  int sb, cbk;
  td_engine_default_blocks(m, &(td_engine_opts){.max_running = 8}, &sb, &cbk);
  cr_assert_eq(a.self.n_blocks, sb);
  cr_assert_eq(a.cross.n_blocks, cbk);
  td_model_destroy(m);
  td_backend_destroy(b);
  fx_free(&fx);
}
