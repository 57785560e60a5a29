/* Shared state and helpers of the CUDA backend (CUDA C++ translation units
 * only). One backend = one device, one stream, one cuBLASLt handle with its
 * workspace, and scratch buffers sized once at creation. Not thread-safe:
 * one owner thread per backend, like the rest of the ops interface. */
#ifndef TD_KERNELS_CUDA_INTERNAL_H
#define TD_KERNELS_CUDA_INTERNAL_H

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "kernels/backend_impl.h"
}
#include "kernels/cuda/cuda_policy.h"

typedef __nv_bfloat16 bf16;

struct td_gemm_plan;

typedef struct td_cuda {
  int device;
  int sm_count;
  size_t l2_bytes;
  int cc_major, cc_minor;
  size_t smem_optin; /* max dynamic shared memory per block */
  cudaStream_t stream;
  cudaStream_t aux;              /* hint branch of a capture (td_kv_prefetch) */
  cudaEvent_t aux_fork, aux_join;
  bool aux_pending;
  cublasLtHandle_t lt;
  void *lt_ws;
  float *stage;       /* TD_CU_STAGE_BYTES of device memory */
  float *split;       /* TD_CU_SPLIT_BYTES of device memory */
  float *part;        /* TD_CU_PART_BYTES of device memory */
  int *counters;      /* GEMM then attention arrival counters, zero between launches */
  td_cu_tune tune;    /* the tuning in force (td_backend_opts.cuda; td_backend_set_cuda_tuning) */
  struct td_gemm_plan *plans;
  void *heads_plans;  /* td_gemm_heads' cuBLASLt plans (cuda_gemm_heads.cu) */
  int states_clusters[16][4]; /* attn_states: co-resident clusters of 1, 2, 4, 8 blocks per kernel (D, warps) */
  uint64_t plan_clock;
  int64_t plans_made; /* cuBLASLt plans made (td_backend_gemm_plans_made) */
  struct cu_block *blocks; /* td_alloc'ed device memory: pointer -> bytes (td_backend_memory_info) */
  struct cu_bias16 *bias16; /* bf16 copies of GEMM biases for cuBLASLt's BIAS epilogue (cuda_gemm.cu) */
  size_t allocated;        /* bytes in blocks (the workspaces above included) */
} td_cuda;

static inline td_cuda *td_cu(td_backend *b) { return (td_cuda *)b->impl; }

#define TD_CU_CHECK(call, what)                                                                     \
  do {                                                                                              \
    cudaError_t td_e_ = (call);                                                                     \
    if (td_e_ != cudaSuccess)                                                                       \
      return td_err(TD_ERR_CUDA, "%s: %s failed: %s", (what), #call, cudaGetErrorString(td_e_));    \
  } while (0)

/* After every kernel launch: configuration errors surface here. */
#define TD_CU_LAUNCHED(what)                                                                        \
  do {                                                                                              \
    cudaError_t td_e_ = cudaGetLastError();                                                         \
    if (td_e_ != cudaSuccess) return td_err(TD_ERR_CUDA, "%s: launch failed: %s", (what), cudaGetErrorString(td_e_)); \
  } while (0)

/* Makes the backend's device current on the calling thread (ops may come
 * from a thread other than the one that created the backend). */
static inline void td_cu_bind(const td_cuda *c) {
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess || d != c->device) (void)cudaSetDevice(c->device);
}

/* Whether the backend's stream is capturing a graph. */
static inline bool td_cu_capturing(const td_cuda *c) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(c->stream, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone;
}

static inline bool td_aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }
static inline unsigned td_blocks(size_t n, unsigned per) {
  size_t g = (n + per - 1) / per;
  return (unsigned)(g > 65535u * 32u ? 65535u * 32u : g); /* kernels stride over the rest */
}

/* Programmatic dependent launch: a kernel launched with it may be scheduled
 * while the previous kernel in the stream runs. Every kernel of this
 * backend calls td_pdl_start() before it touches anything an earlier
 * kernel writes: it lets the next kernel be scheduled as soon as all our
 * blocks are resident, then waits until the previous grid has completed
 * and its memory is visible (a no-op without PDL). Triggering before the
 * wait lets launches run ahead down the stream as far as free SM
 * resources allow, each kernel prefetching its weights before its own
 * wait; the chain of waits still orders every dependent access, and no
 * kernel writes global memory before its wait. Before its wait a kernel
 * reads only model constants and what ops.h declares unwritten since the
 * last copy on the stream (kv_static). Building with -DTD_PDL_EARLY=0 in
 * CMAKE_CUDA_FLAGS triggers after the wait instead. */
#ifndef TD_PDL_EARLY
#define TD_PDL_EARLY 1
#endif
/* late: trigger after the wait, so that the launches behind this kernel
 * (and their weight prefetches) wait until it runs (td_cuda_tuning.pdl_late). */
__device__ __forceinline__ void td_pdl_start_if(bool late) {
  if (!late) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  if (late) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ void td_pdl_start() { td_pdl_start_if(!TD_PDL_EARLY); }
/* Thread-block clusters of `cluster` blocks along x. */
static inline cudaLaunchAttribute td_cluster_attr(int cluster) {
  cudaLaunchAttribute a = {};
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = (unsigned)cluster;
  a.val.clusterDim.y = a.val.clusterDim.z = 1;
  return a;
}
/* cluster > 0: thread-block clusters of that many blocks along x; carveout
 * >= 0: the preferred shared-memory share of L1 in percent. */
template <typename... KArgs, typename... Args>
static inline cudaError_t td_launch_ex(const td_cuda *c, int cluster, int carveout, void (*kernel)(KArgs...), dim3 grid,
                                       dim3 block, size_t smem, Args... args) {
  cudaLaunchAttribute attr[3];
  unsigned n = 0;
  if (carveout >= 0) {
    attr[n].id = cudaLaunchAttributePreferredSharedMemoryCarveout;
    attr[n++].val.sharedMemCarveout = (unsigned)carveout;
  }
  if (c->tune.pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 0) attr[n++] = td_cluster_attr(cluster);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = c->stream;
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

template <typename... KArgs, typename... Args>
static inline cudaError_t td_launch(const td_cuda *c, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                                    Args... args) {
  return td_launch_ex(c, 0, -1, kernel, grid, block, smem, args...);
}

__device__ __forceinline__ float td_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/* Sum over the block; every thread gets the result. red holds 32 floats. */
__device__ __forceinline__ float td_block_sum(float v, float *red) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = td_warp_sum(v);
  __syncthreads(); /* red may still be read by a previous call */
  if (lane == 0) red[w] = v;
  __syncthreads();
  v = lane < nw ? red[lane] : 0.0f;
  return td_warp_sum(v);
}

/* Eight bf16 values as one 16-byte load. */
union td_bf16x8 {
  uint4 u;
  __nv_bfloat162 h[4];
};

/* This thread's share of the sum of squares of x[0, n): the 8 values at
 * j, j + step, ... (n % 8 == 0, x 16-byte aligned). */
__device__ __forceinline__ float td_sumsq8(const bf16 *x, int n, int j, int step) {
  float ss = 0.0f;
  for (; j < n; j += step) {
    td_bf16x8 v;
    v.u = *(const uint4 *)(x + j);
#pragma unroll
    for (int t = 0; t < 4; t++) {
      float2 f = __bfloat1622float2(v.h[t]);
      ss = fmaf(f.x, f.x, fmaf(f.y, f.y, ss));
    }
  }
  return ss;
}

/* Per-file entry points. */
int td_cu_fused_norm_rows(const td_backend *b);
int td_cu_gemm_plan_rows(const td_backend *b, int m);
int64_t td_cu_gemm_plans_made(const td_backend *b);
td_status td_cu_gemm_init(td_cuda *c);
void td_cu_gemm_destroy(td_cuda *c);
/* Forgets the bf16 bias copies made from device memory in [p, p + bytes)
 * (that memory is being freed; a later allocation may reuse it). */
void td_cu_bias16_drop(td_cuda *c, const void *p, size_t bytes);
td_status td_cu_gemm(td_backend *b, const void *x, const void *w, const float *bias, void *y, int m, int n, int k,
                     td_act act, unsigned flags);

/* Where a QKV projection's K/V columns [col, col + 2 hd) also go: the
 * paged pool's slots (pool NULL: nowhere). Filled by kv_dest
 * (cuda_gemm_ex.cu). */
typedef struct td_kv_dest {
  bf16 *pool;
  const int32_t *slots;
  int col, hd, dh, bs, H;
  size_t block_elems, layer_off;
} td_kv_dest;

/* Where K/V column u (of 2 hd: K then V) of a row with this slot goes in the pool. */
__device__ __forceinline__ bf16 *td_kv_at(const td_kv_dest &d, int slot, int u) {
  int which = u / d.hd, e = u % d.hd, hh = e / d.dh, dd = e % d.dh;
  return d.pool + (size_t)(slot / d.bs) * d.block_elems + d.layer_off +
         ((size_t)(which * d.H + hh) * d.bs + slot % d.bs) * d.dh + dd;
}

/* Output (row, col) of a GEMM epilogue into the pool, as td_kv_write stores it. */
__device__ __forceinline__ void td_kv_store(const td_kv_dest &d, int row, int col, bf16 v) {
  if (!d.pool || col < d.col || col >= d.col + 2 * d.hd) return;
  int slot = __ldg(d.slots + row);
  if (slot < 0) return;
  *td_kv_at(d, slot, col - d.col) = v;
}

/* A GEMM's all-reduce epilogue (cuda_allreduce.cuh): the one-shot
 * all-reduce's receive areas of every rank and this rank's control words;
 * world 0: no all-reduce. */
enum { TD_CU_AR_MAX_WORLD = 8 };
struct td_cu_ar_ctl;
typedef struct td_cu_ar_dev {
  uint8_t *slots[TD_CU_AR_MAX_WORLD];
  struct td_cu_ar_ctl *ctl;
  int rank, world;
} td_cu_ar_dev;

/* The skinny decode GEMM (cuda_gemm_skinny.cu) with what it can fuse: a plain
 * RMSNorm (norm: scale by 1 / rms(x)), the KV write of a QKV projection
 * (kv.pool != NULL; bf16 output only), or the all-reduce of a
 * row-parallel layer (ar). kq is set by td_cu_skinny. */
typedef struct td_skinny_args {
  const bf16 *x, *w;
  const float *bias;
  void *y;
  int m, n, k, kq, act;
  bool accum, late, hint; /* hint: W with an L2 evict-first policy */
  const float *wsum;      /* with norm: a folded LayerNorm, W's row sums (NULL: RMS) */
  float eps;
  td_kv_dest kv;
  td_cu_ar_dev ar; /* world > 1: y summed over the ranks (bf16, no KV write, no GLU, no norm) */
} td_skinny_args;
td_status td_cu_skinny_init(td_cuda *c);
td_status td_cu_skinny(td_cuda *c, td_skinny_args *a, bool f32, bool norm, bool glu);
/* whether td_cu_skinny takes the bulk-copy kernel (the only one with GLU) for m rows of k */
bool td_cu_skinny_bulk(const td_cuda *c, int m, int k);
/* Whether td_cu_skinny ends this GEMM (bf16 out, no activation) in the
 * all-reduce of `world` ranks (args.ar): on the bulk-copy kernel, and on the
 * warp-per-column kernel from four ranks (at two its spinning blocks kept
 * the next GEMM's weight prefetch out: 1-3 % slower at one row, bench/RESULTS.md). */
bool td_cu_skinny_ar_fits(const td_cuda *c, int m, int n, int k, int world);
/* cuda_gemm.cu: y = the ranks' sum of x W^T (+ y with TD_GEMM_ACCUM) in one
 * kernel over the all-reduce d, where td_cu_gemm_ar_fits */
bool td_cu_gemm_ar_fits(td_backend *b, const void *x, const void *w, const void *y, int m, int n, int k,
                        unsigned flags, int world);
td_status td_cu_gemm_ar(td_backend *b, const td_cu_ar_dev *d, const void *x, const void *w, const float *bias, void *y,
                        int m, int n, int k, unsigned flags);

/* A cuBLASLt plan's descriptors (any of them NULL) */
static inline void td_cu_lt_release(cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
                                    cublasLtMatrixLayout_t lc) {
  if (op) cublasLtMatmulDescDestroy(op);
  if (la) cublasLtMatrixLayoutDestroy(la);
  if (lb) cublasLtMatrixLayoutDestroy(lb);
  if (lc) cublasLtMatrixLayoutDestroy(lc);
}

/* cuda_kv.cu: the paged pools' ops */
td_status td_cu_kv_write_layers(td_backend *b, const void *k, const void *v, int ld, size_t lcols, void *pool,
                                const td_kv_layout *l, int layer0, int n_layers, const int32_t *slots, int n);
td_status td_cu_kv_write(td_backend *b, const void *k, const void *v, int ld, void *pool, const td_kv_layout *l,
                         int layer, const int32_t *slots, int n);
td_status td_cu_kv_read(td_backend *b, const void *pool, const td_kv_layout *l, int layer, const int32_t *slots,
                        int n, void *k, void *v, int ld);
td_status td_cu_kv_copy_blocks(td_backend *b, void *pool, const td_kv_layout *l, const int32_t *pairs, int n_pairs);
td_status td_cu_kv_prefetch(td_backend *b, const void *pool, const td_kv_layout *l, int layer,
                            const td_paged_meta *m);

/* cuda_gemm_ex.cu: td_gemm_ex (fused on the decode kernel for m <= 16) */
td_status td_cu_skf_init(td_cuda *c);
td_status td_cu_gemm_ex(td_backend *b, const td_gemm_args *a);

/* attention: cuda_attn.cuh lists the files */
td_status td_cu_attn_dense_init(td_cuda *c);
td_status td_cu_attn_paged_init(td_cuda *c);
td_status td_cu_attn_dense(td_backend *b, const void *qkv, void *out, const int32_t *cu_seqlens, int n_seqs,
                           int n_tokens, int max_len, int heads, int head_dim, float scale, bool causal,
                           const td_relbias *bias, int q_lo, int q_hi);
td_status td_cu_attn_paged(td_backend *b, const void *q, int ldq, void *out, const void *pool,
                           const td_kv_layout *l, int layer, const td_paged_meta *m, float scale, bool causal,
                           const td_relbias *bias);

/* cuda_states.cu: attention over encoder states (cuda_states.cuh lists the files) */
td_status td_cu_states_init(td_cuda *c);
int td_cu_states_rows(const td_backend *b, int D, bool kv8);
bool td_cu_states_takes(const td_backend *b, int D, int heads, bool kv8, int rows);
bool td_cu_states_fast(const td_backend *b, int D);
td_status td_cu_attn_states(td_backend *b, const void *q, int ldq, void *out, const void *pool,
                            const td_kv_layout *l, int heads, const td_paged_meta *m, float scale);
/* cuda_gemm_heads.cu: the per-head products around it */
td_status td_cu_heads_init(td_cuda *c);
void td_cu_heads_destroy(td_cuda *c);
td_status td_cu_gemm_heads(td_backend *b, const void *x, const void *w, const float *bias, void *y, int m, int heads,
                           int n, int k, bool w_t);

td_status td_cu_sample_init(td_cuda *c);
td_status td_cu_sample(td_backend *b, float *logits, int n, int vocab, const td_sample_row *rows,
                       const int32_t *bans, int32_t *tokens, float *logprobs);
td_status td_cu_topk_logprobs(td_backend *b, float *logits, int n, int vocab, const td_sample_row *rows,
                              const int32_t *bans, int k, int32_t *ids, float *vals);

/* Largest k topk_logprobs accepts on the GPU. */
#define TD_CU_TOPK_MAX 1024

#endif
