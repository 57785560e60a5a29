/* The main of a GPU test program (test_cuda_ops, test_cuda_model,
 * test_cuda_comm): the environment read once, as a process's main reads it
 * (the CUDA tuning the tests' backends are made with, the log level), then
 * the Criterion tests. Criterion runs each test in a process of its own
 * that starts the executable over and never reaches main, so what main
 * reads is read there again, by a constructor (TD_GPU_ENV): without it
 * the tests ran on the default tuning whatever the environment said. */
#ifndef TD_TESTS_GPU_MAIN_H
#define TD_TESTS_GPU_MAIN_H

#include <criterion/criterion.h>
#include <stdio.h>

#include "common/settings.h"

/* The environment's CUDA tuning into *cuda and the log level applied; a
 * malformed environment leaves them (main refuses it). */
static inline void td_gpu_read_env(td_cuda_tuning *cuda) {
  td_settings settings;
  if (td_settings_from_env(&settings) != TD_OK) return;
  td_settings_apply(&settings);
  *cuda = settings.cuda;
}
/* fn runs in every process of the program, Criterion's test processes too */
#define TD_GPU_ENV(fn) __attribute__((constructor)) static void td_gpu_env_##fn(void) { fn(); }

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
