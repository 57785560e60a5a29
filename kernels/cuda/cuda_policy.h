/* The CUDA backend's launch policy as plain C: the tuning a backend runs
 * with (td_cuda_tuning with its defaults applied) and, for the attention
 * ops, which kernel a launch takes, in how many splits, warps and planes.
 * Pure functions of the tuning, the device's figures and the shapes, so
 * that the host compiler builds them and the unit tests run them without a
 * GPU (tests/unit/test_cuda_policy.c). Why each switch sits where it does:
 * docs/cuda.md. */
#ifndef TD_KERNELS_CUDA_POLICY_H
#define TD_KERNELS_CUDA_POLICY_H

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "common/settings.h"

/* Sizes fixed at creation (docs/cuda.md, "Limits", lists them). */
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

/* Kernel shapes the policy reasons about. */
enum {
  TD_CU_ATTN_BN = 64,          /* keys a tile of the tiled attention kernel */
  TD_CU_ATTN_MAX_DH = 256,     /* head sizes the generic attention kernel takes */
  TD_CU_FUSE_MAX_ROWS = 16,    /* rows of the fused decode GEMM (td_gemm_ex) */
  TD_CU_STATES_TILE = 32,      /* states a tile of the attn_states tensor-core kernels */
  TD_CU_STATES_MAX_SPLITS = 16, /* key splits a group of attn_states (a cluster) */
  TD_CU_STATES_CLUSTERS = 4,   /* cluster sizes whose occupancy is known: 1, 2, 4, 8 blocks */
};

/* The tuning in force: every field a value (td_cuda_tuning documents them). */
typedef struct td_cu_tune {
  bool verbose, autotune;
  int autotune_min; /* m*n*k in millions */
  bool pdl;
  int pdl_late; /* -1: the default policy, else the mask */
  bool skinny, skinny_bulk, weight_hint;
  int skinny_rows; /* 8-16 */
  int gemv_maxv, gemv_maxn, gemv_rows, gemv_rows_n; /* maxv 0: the warp kernel off (and rows 0) */
  int fuse, fuse_mask; /* rows 0-16 (0: never fused), mask 0-15 */
  int dense64_warps;   /* 0 (by the grid), 1 / 2 (pipelined wgmma, two / one block an SM), 5 (the same, the
                          keys in two halves), 3 (wgmma), 4 or 8 */
  int dense64_wave;    /* with dense64_warps 0: the kernel for one wave, 2 or 5 */
  int dense_splits;    /* 0 or 1: none */
  int decode_warp, decode_small, decode_small_min, decode_small_ctx; /* 0: off */
  int decode_bulk, decode_bulk_all, decode_bulk_shape, decode_bulk_early;
  int decode_bulk_carve; /* percent, -1: none */
  int kvpf_seqs;         /* 0: off */
  int kvpf_mb;           /* the self K/V bound in MB: -1 a quarter of L2, 0 none */
  bool states_generic, states_ws, states_planes, states_waves, states_pl32;
  int states_splits; /* 0: the policy's */
  int states_warps;  /* 0: the policy's, else 8 or 16 */
  bool heads_lt, custom_allreduce, fuse_allreduce, custom_allgather;
  bool plan_bucket;
} td_cu_tune;

void td_cu_tune_resolve(const td_cuda_tuning *t, td_cu_tune *out);

/* ---- td_gemm's cuBLASLt plans ----
 * The row count a plan is keyed and chosen by: m itself up to
 * TD_CU_PLAN_EXACT_ROWS, beyond it m rounded up to an eighth of its power of
 * two (at most 12.5 % more), so that encoder runs, whose row count is their
 * token count, share a few plans a shape instead of one each (an engine
 * serving BART's `trt` workload made ~2,000 plans a run of 1,280 requests,
 * twice the cache). The plan runs at the actual m (its layouts are set to
 * it); an algorithm chosen for more rows serves fewer. */
enum { TD_CU_PLAN_EXACT_ROWS = 64 };
int td_cu_plan_rows(const td_cu_tune *t, int m);
/* td_kv_prefetch: the most bytes of a layer's self K/V it prefetches (0:
 * any), from the tuning and the device's L2 */
size_t td_cu_kvpf_bytes(const td_cu_tune *t, size_t l2_bytes);

/* ---- td_attn_dense ---- */
typedef enum td_dense_kernel {
  TD_DENSE_GENERIC,  /* a warp a query row, any head size up to TD_CU_ATTN_MAX_DH, any alignment */
  TD_DENSE_64_WGMMA, /* head_dim 64, 128 query rows a block on wgmma */
  TD_DENSE_64_PIPE,  /* ... tile k + 1's softmax beside tile k's P.V (two blocks an SM) */
  TD_DENSE_64_PIPE1, /* ... the same in more registers (one block an SM) */
  TD_DENSE_64_HALVES, /* ... a block's keys in two halves on 16 warps, merged in the block */
  TD_DENSE_64,       /* ... on mma.sync, 8 warps */
  TD_DENSE_64_SMALL, /* ... 64 rows, 4 warps */
  TD_DENSE_128,      /* head_dim 128, 64 rows */
} td_dense_kernel;
typedef struct td_dense_plan {
  td_dense_kernel kernel;
  int qtiles; /* query tiles a sequence (tiled kernels) */
  int rows;   /* query rows a tile */
} td_dense_plan;
/* aligned: qkv and out 16-byte aligned */
td_dense_plan td_cu_dense_policy(const td_cu_tune *t, int head_dim, bool aligned, int n_tokens, int max_len);
/* The kernel for a grid of `blocks` (query tile, head) blocks of `splits`
 * key splits each on `sms` SMs (where they fit in one wave, the pipelined
 * wgmma kernel's one-block-an-SM form or its halves form, by dense64_wave;
 * unless the tuning named a kernel). */
td_dense_kernel td_cu_dense_fit(const td_cu_tune *t, td_dense_kernel k, long blocks, int splits, int sms);
/* Key splits a query tile for `blocks` (tile, head) blocks over up to
 * `keys` keys each (tiled kernels; the caller checks its scratch). */
int td_cu_dense_splits(const td_cu_tune *t, long blocks, int keys, bool causal);

/* ---- td_attn_paged ---- */
typedef struct td_paged_shape {
  int n_seqs, n_tokens, heads, head_dim;
  int max_q, max_ctx; /* clamped to what the buffers hold */
  bool causal, kv_static, kv_static_past;
  bool q_ok;      /* q 16-byte aligned, ldq a multiple of 8 */
  bool out_ok, pool_ok; /* 16-byte aligned */
  bool blocks_ok; /* the pool's blocks a multiple of 8 elements */
  bool q_norm;    /* a query norm to apply */
  bool q_norm_vec; /* ... its rows whole 16-byte vectors, aligned */
  bool kv8;       /* int8 K/V (td_kv_layout.int8): the decode kernels or the generic one, never the tiled */
} td_paged_shape;
typedef enum td_paged_kernel {
  TD_PAGED_GENERIC, /* a warp a query row */
  TD_PAGED_TILED,   /* 16 query rows a block, the keys split over gridDim.z when blocks are few */
  TD_PAGED_BULK,    /* decode: a (sequence, head) pair a block, K/V by bulk copies */
  TD_PAGED_W2P4,    /* decode on warps: 2 a pair, 4 pairs a block */
  TD_PAGED_W4P2,    /* 4 warps a pair, 2 pairs a block */
  TD_PAGED_W8,      /* 8 warps a pair */
  TD_PAGED_W16,     /* 16 warps a pair */
} td_paged_kernel;
typedef struct td_paged_plan {
  td_paged_kernel kernel;
  bool qn_inside; /* the query norm inside the decode kernel */
  bool qn_before; /* ... else as a kernel of its own first, into the staging buffer */
  bool early;     /* decode kernels: the first K/V loads before the wait */
  int bulk_warps, bulk_slots, carve; /* TD_PAGED_BULK: block shape, L1 carveout (-1: none) */
  int qtiles;     /* TD_PAGED_TILED: query tiles a sequence; TD_PAGED_GENERIC: query rows */
  int splits;     /* TD_PAGED_TILED: key splits */
} td_paged_plan;
td_paged_plan td_cu_paged_policy(const td_cu_tune *t, int sm_count, const td_paged_shape *s);

/* ---- td_attn_states ---- */
typedef enum td_states_kernel {
  TD_STATES_GENERIC, /* a block a (row, head), any D */
  TD_STATES_MMA8,    /* tensor cores, 8 warps */
  TD_STATES_MMA16,   /* tensor cores, 16 warps */
  TD_STATES_WS,      /* 16 warps in two groups (scores, mix) */
  TD_STATES_PL,      /* the same, D split over a cluster of two */
  TD_STATES_PL32,    /* the same over groups of 32 pairs (a sequence's states read once for up to 32 heads) */
  TD_STATES_KERNELS,
} td_states_kernel;
/* The tensor-core kernels that exist for a D and fit the device, and how
 * many clusters of 1, 2, 4 and 8 blocks of each the GPU holds at once. */
typedef struct td_states_avail {
  bool has[TD_STATES_KERNELS];
  int clusters[TD_STATES_KERNELS][TD_CU_STATES_CLUSTERS];
} td_states_avail;
typedef struct td_states_shape {
  int n_seqs, heads, max_q, max_ctx; /* clamped */
  bool aligned;   /* q, out and the states 16-byte aligned, ldq and the pool's blocks multiples of 8 */
  bool kv_static;
} td_states_shape;
typedef struct td_states_plan {
  td_states_kernel kernel;
  int groups;   /* groups of 16 (row, head) pairs a sequence */
  long blocks;  /* the grid: sequences x groups x cluster */
  int cluster;  /* blocks a group, one thread-block cluster */
  int n_splits; /* key splits among them (the plane kernel's two blocks hold every key) */
} td_states_plan;
td_states_plan td_cu_states_policy(const td_cu_tune *t, int sm_count, const td_states_avail *k,
                                   const td_states_shape *s);
/* The rows from which a dual pool's steps attend over the states
 * (td_attn_states_rows): 48 where a tensor-core kernel takes D (`fits`) and
 * D is at most 1024 or the 32-pair plane kernel takes it (`fits32`; then
 * td_cu_states_switch_takes decides by row count); never over int8 K/V (kv8: half the bytes, level with
 * the states or ahead at every batch to 256 on an H200) nor elsewhere
 * (INT_MAX). */
int td_cu_states_switch_rows(int D, bool fits, bool fits32, bool kv8);
/* Whether a decode step of `rows` rows (one a sequence) with `heads` heads
 * takes the states (td_attn_states_takes): from the rows above, and above
 * D 1024 where the 32-pair plane kernel's last wave of cap32 resident
 * blocks is at least 80 % full. fits32: that kernel takes D. */
bool td_cu_states_switch_takes(int D, int heads, bool fits, bool fits32, bool kv8, int rows, int cap32);

#ifdef __cplusplus
}
#endif

#endif
