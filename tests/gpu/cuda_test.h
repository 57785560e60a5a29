/* Shared by the CUDA op tests (test_cuda_ops.c, test_cuda_gemm.c,
 * test_cuda_attn.c, one program): the two backends, the random inputs, the
 * buffers held on both backends, and the comparison. */
#ifndef TD_TESTS_GPU_CUDA_TEST_H
#define TD_TESTS_GPU_CUDA_TEST_H

#include <criterion/criterion.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/half.h"
#include "common/settings.h"
#include "common/status.h"
#include "kernels/ops.h"

#define TOL 1e-2

/* G runs the CUDA ops, C the CPU reference; both made for each test. */
extern td_backend *G, *C;
/* The suite's RNG state (seeded in each test's setup). */
extern uint64_t rs;

/* What main read from the environment: the tuning G is created with
 * (TANDEM_CUDA_*), and the attn_states test's selection
 * (TD_TEST_STATES_VARIANT, TD_TEST_STATES_CASE; NULL: all). */
extern td_cuda_tuning cuda_base;
extern const char *states_variant, *states_case_only;

/* Switches G to cuda_base with the changes a test makes in t (a copy of
 * cuda_base): the kernel variants it wants to cover. */
void use_tuning(const td_cuda_tuning *t);

uint64_t next64(void);
float urand(void);
int irand(int n);
float bfr(float x);

/* random bf16-representable values in [-scale, scale) */
float *rnd(size_t n, float scale);

/* The same buffer on both backends. */
typedef struct pair {
  void *g, *c;
  size_t n;
  td_buf_type t;
} pair;

void put(pair *p, const void *h);
void poison(pair *p);
void poison_gpu(pair *p);
/* h NULL: poisoned */
pair mk(td_buf_type t, const void *h, size_t n);
void drop(pair *p);
float *get(td_backend *b, const pair *p, bool gpu);
/* ||out - ref|| / ||ref||; any NaN or infinity in out where ref is finite fails */
double relerr(const float *out, const float *ref, size_t n);
/* After a failed comparison of an [m, n] output: where it went wrong. */
void explain(const pair *p, int m, int n);
double compare(const pair *p, size_t n);

#define RUN2(call_g, call_c)                                                  \
  do {                                                                        \
    cr_assert((call_g) == TD_OK, "cuda: %s", td_errmsg());                    \
    cr_assert((call_c) == TD_OK, "cpu: %s", td_errmsg());                     \
  } while (0)

/* A paged pool on both backends, filled at random. */
typedef struct paged_rig {
  td_kv_layout l;
  int n_blocks;
  pair pool;
  float *pool_h;
} paged_rig;
void rig_pool(paged_rig *r, int layers, int H, int dh, int bs, int states, int n_blocks);
void rig_drop(paged_rig *r);

#endif
