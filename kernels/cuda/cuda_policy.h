/* The CUDA backend's tuning as plain C: td_cuda_tuning with its defaults
 * applied, which the host compiler builds and the unit tests run without a
 * GPU. Why each switch sits where it does: docs/cuda.md. */
#ifndef TD_KERNELS_CUDA_POLICY_H
#define TD_KERNELS_CUDA_POLICY_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "common/settings.h"

/* Sizes fixed at creation (docs/cuda.md lists them). */
enum {
  TD_CU_LT_WORKSPACE = 32 << 20,     /* cuBLASLt workspace (Hopper recommends 32 MiB) */
  TD_CU_STAGE_BYTES = 32 << 20,      /* upload/download conversion staging */
  TD_CU_SPLIT_BYTES = 32 << 20,      /* split-KV partial outputs of attn_paged */
  TD_CU_GEMM_CACHE = 1024,           /* cached cuBLASLt plans */
  TD_CU_GEMM_WAYS = 8,               /* ways per set (least recently used evicted) */
  TD_CU_PART_BYTES = 16 << 20,       /* split-K partial sums of the skinny GEMM */
  TD_CU_GEMM_COUNTERS = 8192,        /* arrival counters: skinny GEMM column tiles */
  TD_CU_ATTN_COUNTERS = 65536,       /* arrival counters: split-KV attention groups */
};

/* Rows of the fused decode GEMM (td_gemm_ex), the most the tuning takes. */
enum { TD_CU_FUSE_MAX_ROWS = 16 };

/* The tuning in force: every field a value (td_cuda_tuning documents them). */
typedef struct td_cu_tune {
  bool verbose, autotune;
  bool pdl;
  int pdl_late; /* -1: the default policy, else the mask */
  bool skinny, skinny_bulk, weight_hint;
  int skinny_rows; /* 8-16 */
  int gemv_maxv, gemv_maxn, gemv_rows, gemv_rows_n; /* maxv 0: the warp kernel off (and rows 0) */
  int fuse, fuse_mask; /* rows 0-16 (0: never fused), mask 0-15 */
  int dense64_warps;   /* 0 (wgmma), 4 or 8 */
  int decode_warp, decode_small, decode_small_min, decode_small_ctx; /* 0: off */
  int decode_bulk, decode_bulk_all, decode_bulk_shape, decode_bulk_early;
  int decode_bulk_carve; /* percent, -1: none */
  int kvpf_seqs;         /* 0: off */
  bool states_generic, states_ws, states_planes;
  int states_splits; /* 0: the policy's */
  int states_warps;  /* 0: the policy's, else 8 or 16 */
  bool heads_lt, custom_allreduce;
} td_cu_tune;

void td_cu_tune_resolve(const td_cuda_tuning *t, td_cu_tune *out);

#ifdef __cplusplus
}
#endif

#endif
