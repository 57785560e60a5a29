/* Shared by the parts of gpu_kvx (the GPU checks of kvtransfer). */
#ifndef TD_TESTS_GPU_KVX_H
#define TD_TESTS_GPU_KVX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* A failed check: says what, and returns false from the check's function. */
#define CHECK(cond, ...)                      \
  do {                                        \
    if (!(cond)) {                            \
      printf("  check failed: " __VA_ARGS__); \
      printf("\n");                           \
      return false;                           \
    }                                         \
  } while (0)

/* PASS / FAIL line; failures are counted for the exit status. */
void report(const char *name, bool ok);
void fill(uint8_t *p, size_t n, uint64_t seed);
/* gpu_kvx_gather.c */
void run_gather(void);

#endif
