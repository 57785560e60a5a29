/* The main of a GPU test program (test_cuda_ops, test_cuda_model,
 * test_cuda_comm): the environment read once, as a process's main reads it
 * (the CUDA tuning the tests' backends are made with, the log level), then
 * the Criterion tests. */
#ifndef TD_TESTS_GPU_MAIN_H
#define TD_TESTS_GPU_MAIN_H

#include <criterion/criterion.h>
#include <stdio.h>

#include "common/settings.h"

static inline int td_gpu_test_main(int argc, char *argv[], td_cuda_tuning *cuda) {
  td_settings settings;
  if (td_settings_from_env(&settings) != TD_OK) {
    fprintf(stderr, "%s: %s\n", argv[0], td_errmsg());
    return 2;
  }
  td_settings_apply(&settings);
  *cuda = settings.cuda;
  struct criterion_test_set *tests = criterion_initialize();
  int rc = 0;
  if (criterion_handle_args(argc, argv, true)) rc = !criterion_run_all_tests(tests);
  criterion_finalize(tests);
  return rc;
}

#endif
