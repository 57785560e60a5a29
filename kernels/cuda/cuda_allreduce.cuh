/* The one-shot all-reduce's protocol on the device (cuda_allreduce.cu
 * describes it): the slots' layout, the "not arrived" mark, the waits, and
 * the per-call bookkeeping (empty the previous phase, advance the phase),
 * shared by the all-reduce kernels and the GEMMs that end in an all-reduce
 * (cuda_gemm_skinny.cu). Internal to the CUDA backend. */
#ifndef TD_KERNELS_CUDA_ALLREDUCE_CUH
#define TD_KERNELS_CUDA_ALLREDUCE_CUH

#include "kernels/cuda/cuda_internal.h"

#define AR_MAX_WORLD TD_CU_AR_MAX_WORLD
#define AR_PHASES 3
#define AR_SLOT_BYTES (4u << 20) /* largest message taken (bf16: 2M values: a 1500-position Whisper
                                    encoder's rows, 3.84 MB); two ranks only above 1 MiB */
#define AR_WIDE_BYTES (1u << 20) /* more than two ranks: each rank sends world - 1 copies */
#define AR_EMPTY 0x8000u              /* bf16 -0.0: not arrived */
#define AR_EMPTY2 0x80008000u         /* two of them */
#define AR_SPIN_LIMIT (1u << 26)      /* a vanished peer ends the wait (garbage, not a hang) */

typedef struct ar_peers {
  uint8_t *slots[AR_MAX_WORLD]; /* each rank's receive area, [phase][world][slot] */
} ar_peers;

/* per rank, after its slots: the phase of the next call, the values of the
 * last call (the slots it filled), blocks done with the current call, and
 * whether a wait ever gave up */
struct td_cu_ar_ctl {
  uint32_t phase, nprev, done, err;
};
typedef struct td_cu_ar_ctl ar_ctl;

__device__ __forceinline__ uint4 ld_volatile16(const void *p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ uint16_t ld_volatile2(const void *p) {
  uint16_t v;
  asm volatile("ld.volatile.global.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t ld_volatile4(const void *p) {
  uint32_t v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ bool has_empty(uint32_t w) {
  return (w & 0xffffu) == AR_EMPTY || (w >> 16) == AR_EMPTY;
}

/* -0.0 is the "not arrived" mark: send it as +0.0 (the sum is the same) */
__device__ __forceinline__ uint32_t unmark(uint32_t w) {
  if ((w & 0xffffu) == AR_EMPTY) w &= 0xffff0000u;
  if ((w >> 16) == AR_EMPTY) w &= 0x0000ffffu;
  return w;
}

/* A peer's 16-byte vector once none of its values is "not arrived" (a
 * vanished peer: garbage after AR_SPIN_LIMIT spins, flagged in ctl->err);
 * WORDS: float32 words (ag_words_kernel), each marked whole by AR_EMPTY2 */
__device__ __forceinline__ bool vec_empty(uint4 w, bool words) {
  if (words) return w.x == AR_EMPTY2 || w.y == AR_EMPTY2 || w.z == AR_EMPTY2 || w.w == AR_EMPTY2;
  return has_empty(w.x) || has_empty(w.y) || has_empty(w.z) || has_empty(w.w);
}
template <bool WORDS = false>
__device__ __forceinline__ uint4 wait_vec(const uint4 *src, ar_ctl *ctl) {
  uint4 w = ld_volatile16(src);
  uint32_t spins = 0;
  while (vec_empty(w, WORDS)) {
    if (++spins > AR_SPIN_LIMIT) {
      atomicExch(&ctl->err, 1u);
      break;
    }
    w = ld_volatile16(src);
  }
  return w;
}

/* One float32 word, as wait_vec<true> */
__device__ __forceinline__ uint32_t wait_word(const uint32_t *src, ar_ctl *ctl) {
  uint32_t w, spins = 0;
  while ((w = ld_volatile4(src)) == AR_EMPTY2)
    if (++spins > AR_SPIN_LIMIT) {
      atomicExch(&ctl->err, 1u);
      break;
    }
  return w;
}

__device__ __forceinline__ void add8(float *acc, uint4 u) {
  const bf16 *h = (const bf16 *)&u;
#pragma unroll
  for (int k = 0; k < 8; k++) acc[k] += __bfloat162float(h[k]);
}

/* The previous call's values in our slots back to "not arrived" (nprev:
 * the most values a peer wrote into one slot of ours in that call). */
__device__ __forceinline__ void empty_previous(const ar_peers &P, int rank, int world, const ar_ctl *ctl,
                                               size_t me, size_t stride) {
  const uint32_t prev = (ctl->phase + AR_PHASES - 1) % AR_PHASES, nprev = ctl->nprev;
  const uint4 empty = make_uint4(AR_EMPTY2, AR_EMPTY2, AR_EMPTY2, AR_EMPTY2);
  for (int p = 0; p < world; p++) {
    if (p == rank) continue;
    uint4 *s = (uint4 *)(P.slots[rank] + ((size_t)prev * world + p) * AR_SLOT_BYTES);
    for (size_t v = me; v < (nprev + 7) / 8; v += stride) s[v] = empty;
  }
}

/* The last block out moves the phase on and records what this call wrote
 * into a peer's slot at most (values), for the next call to empty. Every
 * thread of every block of the grid calls it. */
__device__ __forceinline__ void advance_phase(ar_ctl *ctl, uint32_t phase, uint32_t wrote) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&ctl->done, 1u) == gridDim.x - 1) {
      ctl->done = 0;
      ctl->nprev = wrote;
      ctl->phase = (phase + 1) % AR_PHASES;
      __threadfence();
    }
  }
}

/* ---- an all-reduce at the end of a kernel ----
 * A kernel whose every thread of every block calls ar_open after its PDL
 * wait, then for each 8 of its outputs (vector v of the call's n / 8,
 * each taken by one thread) ar_push_vec, then ar_sum_vec, then ar_close:
 * the same protocol and the same bits as ar_kernel over the kernel's bf16
 * outputs. Whole 16-byte vectors, as ar_kernel sends: one NVLink write a
 * peer for 8 values, where a value at a time took 8. */
__device__ __forceinline__ uint32_t ar_open(const td_cu_ar_dev &d) {
  const size_t stride = (size_t)gridDim.x * blockDim.x, me = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  ar_peers P;
#pragma unroll
  for (int p = 0; p < AR_MAX_WORLD; p++) P.slots[p] = d.slots[p];
  empty_previous(P, d.rank, d.world, d.ctl, me, stride);
  return d.ctl->phase;
}

__device__ __forceinline__ uint16_t ar_bits(float v) {
  uint16_t h = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  return h == AR_EMPTY ? 0 : h;
}

/* this rank's 8 values u (each ar_bits) of vector v into every peer's slot for it */
__device__ __forceinline__ void ar_push_vec(const td_cu_ar_dev &d, uint32_t phase, size_t v, uint4 u) {
  for (int p = 0; p < d.world; p++)
    if (p != d.rank) ((uint4 *)(d.slots[p] + ((size_t)phase * d.world + d.rank) * AR_SLOT_BYTES))[v] = u;
}

/* vector v summed over the ranks in rank order into 8 bf16 (u: this rank's) */
__device__ __forceinline__ uint4 ar_sum_vec(const td_cu_ar_dev &d, uint32_t phase, size_t v, uint4 u) {
  float acc[8];
#pragma unroll
  for (int k = 0; k < 8; k++) acc[k] = 0.0f;
  for (int r = 0; r < d.world; r++) {
    if (r == d.rank) {
      add8(acc, u);
      continue;
    }
    add8(acc, wait_vec((const uint4 *)(d.slots[d.rank] + ((size_t)phase * d.world + r) * AR_SLOT_BYTES) + v, d.ctl));
  }
  bf16 o[8];
#pragma unroll
  for (int k = 0; k < 8; k++) o[k] = __float2bfloat16_rn(acc[k]);
  return *(const uint4 *)o;
}

/* The exchange of one vector: this rank's 8 values u out, the sum into y[v] */
__device__ __forceinline__ void ar_exchange_vec(const td_cu_ar_dev &d, uint32_t phase, size_t v, uint4 u, void *y) {
  ar_push_vec(d, phase, v, u);
  ((uint4 *)y)[v] = ar_sum_vec(d, phase, v, u);
}

__device__ __forceinline__ void ar_close(const td_cu_ar_dev &d, uint32_t phase, uint32_t n) {
  advance_phase(d.ctl, phase, n);
}

#endif
