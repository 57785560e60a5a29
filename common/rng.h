/* Counter-based random numbers (Philox4x32-10): the value depends only on
 * (seed, counter), so a request's samples do not depend on the batch it runs
 * in, and the CPU and the GPU draw the same numbers. */
#ifndef TD_COMMON_RNG_H
#define TD_COMMON_RNG_H

#include <stdint.h>

#ifdef __CUDACC__
#define TD_HD __host__ __device__ __forceinline__
#else
#define TD_HD static inline
#endif

TD_HD void td_philox4x32(uint64_t key, uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                         uint32_t out[4]) {
  uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
  for (int r = 0; r < 10; r++) {
    uint64_t p0 = (uint64_t)0xD2511F53u * c0;
    uint64_t p1 = (uint64_t)0xCD9E8D57u * c2;
    uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
    uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
    c1 = (uint32_t)p1;
    c3 = (uint32_t)p0;
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

/* Uniform in [0, 1) with 24 random bits, from (seed, stream, step). */
TD_HD float td_rand_uniform(uint64_t seed, uint32_t stream, uint32_t step) {
  uint32_t o[4];
  td_philox4x32(seed, step, stream, 0x7A9Du, 0x51Cu, o);
  return (float)(o[0] >> 8) * (1.0f / 16777216.0f);
}

#endif
