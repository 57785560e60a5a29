/* One-shot all-reduce for the small messages of tensor-parallel decoding
 * (a few hundred KB): every rank writes its input straight into each
 * peer's buffer over NVLink (P2P, CUDA IPC between processes), raises a
 * flag there, waits for the peers' flags in its own buffer and sums the
 * ranks' values in rank order (so every rank gets the same bits). One
 * kernel plus a one-thread sequence bump: a few microseconds where NCCL's
 * ring takes tens, and the calls can be captured in graphs. Larger
 * messages, or machines without P2P, use NCCL. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/cuda_allreduce.h"

#define AR_MAX_WORLD 8
#define AR_SLOT_BYTES (4u << 20) /* largest message taken (bf16: 2M values) */
#define AR_BLOCKS 48
#define AR_THREADS 512
#define AR_SPIN_LIMIT (1u << 28) /* a vanished peer ends the wait (garbage, not a hang) */

typedef struct ar_peers {
  uint8_t *data[AR_MAX_WORLD];   /* each rank's data area, [2 parity][world][slot] */
  uint32_t *flags[AR_MAX_WORLD]; /* each rank's flags, [world][AR_BLOCKS] */
} ar_peers;

struct td_cu_allreduce {
  int rank, world, device;
  uint8_t *mine;     /* data, flags, then seq and error words */
  uint32_t *seq;     /* the sequence number of the next call (device) */
  uint32_t *err;
  uint32_t *done;    /* blocks finished with the current call */
  ar_peers peers;
  void *opened[AR_MAX_WORLD];
};

static size_t data_bytes(int world) { return (size_t)2 * world * AR_SLOT_BYTES; }
static size_t flag_bytes(int world) { return sizeof(uint32_t) * (size_t)world * AR_BLOCKS; }

__device__ __forceinline__ uint32_t ld_acquire(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release(uint32_t *p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__global__ void __launch_bounds__(AR_THREADS) ar_kernel(const bf16 *in, bf16 *out, size_t n, ar_peers P, int rank,
                                                        int world, uint32_t *seqp, uint32_t *err, uint32_t *done) {
  td_pdl_start();
  const uint32_t seq = *seqp;
  const int parity = seq & 1;
  /* this block's share, in whole 16-byte vectors (8 values) */
  size_t vecs = (n + 7) / 8, per = (vecs + gridDim.x - 1) / gridDim.x;
  size_t v0 = per * blockIdx.x, v1 = v0 + per < vecs ? v0 + per : vecs;
  size_t full = n / 8; /* vectors without a ragged tail */
  /* 1. our values into every peer's slot for us */
  for (int p = 0; p < world; p++) {
    if (p == rank) continue;
    bf16 *dst = (bf16 *)(P.data[p] + ((size_t)parity * world + rank) * AR_SLOT_BYTES);
    for (size_t v = v0 + threadIdx.x; v < v1; v += blockDim.x) {
      if (v < full) {
        ((uint4 *)dst)[v] = ((const uint4 *)in)[v];
      } else {
        for (size_t i = v * 8; i < n; i++) dst[i] = in[i];
      }
    }
  }
  __threadfence_system();
  __syncthreads();
  /* 2. tell each peer this block's part has landed */
  if (threadIdx.x < (unsigned)world && (int)threadIdx.x != rank)
    st_release(P.flags[threadIdx.x] + (size_t)rank * AR_BLOCKS + blockIdx.x, seq);
  /* 3. wait for theirs */
  if (threadIdx.x < (unsigned)world && (int)threadIdx.x != rank) {
    const uint32_t *f = P.flags[rank] + (size_t)threadIdx.x * AR_BLOCKS + blockIdx.x;
    uint32_t spins = 0;
    while (ld_acquire(f) < seq)
      if (++spins > AR_SPIN_LIMIT) {
        atomicExch(err, 1u);
        break;
      }
  }
  __syncthreads();
  /* 4. the sum, in rank order */
  const uint8_t *mine = P.data[rank] + (size_t)parity * world * AR_SLOT_BYTES;
  for (size_t v = v0 + threadIdx.x; v < v1; v += blockDim.x) {
    size_t i0 = v * 8, i1 = i0 + 8 < n ? i0 + 8 : n;
    float acc[8];
    for (int k = 0; k < 8; k++) acc[k] = 0.0f;
    for (int r = 0; r < world; r++) {
      const bf16 *src = r == rank ? in : (const bf16 *)(mine + (size_t)r * AR_SLOT_BYTES);
      if (i1 - i0 == 8) {
        uint4 u = ((const uint4 *)src)[v];
        const bf16 *h = (const bf16 *)&u;
        for (int k = 0; k < 8; k++) acc[k] += __bfloat162float(h[k]);
      } else {
        for (size_t i = i0; i < i1; i++) acc[i - i0] += __bfloat162float(src[i]);
      }
    }
    for (size_t i = i0; i < i1; i++) out[i] = __float2bfloat16(acc[i - i0]);
  }
  /* the last block out moves the sequence on, for the next call */
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(done, 1u) == gridDim.x - 1) {
      *done = 0;
      *seqp = seq + 1;
      __threadfence();
    }
  }
}

bool td_cu_allreduce_fits(const td_cu_allreduce *a, td_buf_type t, size_t n) {
  return a && t == TD_BUF_ACT && n * sizeof(bf16) <= AR_SLOT_BYTES;
}

td_status td_cu_allreduce_run(td_backend *b, td_cu_allreduce *a, void *buf, size_t n) {
  td_cuda *c = td_cu(b);
  size_t vecs = (n + 7) / 8;
  unsigned blocks = (unsigned)(vecs < (size_t)AR_BLOCKS * 64 ? (vecs + 63) / 64 : AR_BLOCKS);
  if (blocks < 1) blocks = 1;
  TD_CU_CHECK(td_launch(c, ar_kernel, dim3(blocks), dim3(AR_THREADS), 0, (const bf16 *)buf, (bf16 *)buf, n, a->peers,
                        a->rank, a->world, a->seq, a->err, a->done),
              "allreduce");
  TD_CU_LAUNCHED("allreduce");
  return TD_OK;
}

typedef struct ar_card {
  int32_t pid, device;
  uint64_t ptr;
  cudaIpcMemHandle_t handle;
  int32_t ok;
  int32_t pad;
} ar_card;

void td_cu_allreduce_destroy(td_cu_allreduce *a) {
  if (!a) return;
  (void)cudaSetDevice(a->device);
  for (int p = 0; p < AR_MAX_WORLD; p++)
    if (a->opened[p]) (void)cudaIpcCloseMemHandle(a->opened[p]);
  if (a->mine) (void)cudaFree(a->mine);
  free(a);
}

/* Every rank builds its part; the ranks then agree (all or none) through
 * gather, which the caller provides (NCCL all-gather of bytes). */
td_status td_cu_allreduce_create(td_backend *b, int rank, int world, td_cu_gather gather, void *gctx,
                                 td_cu_allreduce **out) {
  *out = NULL;
  if (world < 2 || world > AR_MAX_WORLD) return TD_OK;
  td_cuda *c = td_cu(b);
  if (!c->tune.custom_allreduce) return TD_OK;
  td_cu_bind(c);
  td_cu_allreduce *a = (td_cu_allreduce *)calloc(1, sizeof *a);
  if (!a) return td_err(TD_ERR_NOMEM, "allreduce: out of memory");
  a->rank = rank;
  a->world = world;
  a->device = c->device;
  size_t total = data_bytes(world) + flag_bytes(world) + 64;
  ar_card me = {};
  me.pid = (int32_t)getpid();
  me.device = c->device;
  me.ok = 1;
  if (cudaMalloc((void **)&a->mine, total) != cudaSuccess || cudaMemset(a->mine, 0, total) != cudaSuccess ||
      cudaIpcGetMemHandle(&me.handle, a->mine) != cudaSuccess)
    me.ok = 0;
  (void)cudaGetLastError();
  me.ptr = (uint64_t)(uintptr_t)a->mine;
  ar_card cards[AR_MAX_WORLD];
  td_status s = gather(gctx, &me, cards, sizeof me);
  if (s != TD_OK) {
    td_cu_allreduce_destroy(a);
    return s;
  }
  bool ok = true;
  for (int p = 0; p < world; p++) ok = ok && cards[p].ok;
  for (int p = 0; ok && p < world; p++) {
    if (p == rank) {
      a->peers.data[p] = a->mine;
      continue;
    }
    if (cards[p].pid == me.pid) {
      /* another thread of this process: the pointer itself, with peer access */
      int can = 0;
      ok = cudaDeviceCanAccessPeer(&can, c->device, cards[p].device) == cudaSuccess && can;
      if (ok) {
        cudaError_t e = cudaDeviceEnablePeerAccess(cards[p].device, 0);
        ok = e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled;
        (void)cudaGetLastError();
      }
      a->peers.data[p] = (uint8_t *)(uintptr_t)cards[p].ptr;
    } else {
      void *q = NULL;
      ok = cudaIpcOpenMemHandle(&q, cards[p].handle, cudaIpcMemLazyEnablePeerAccess) == cudaSuccess;
      (void)cudaGetLastError();
      a->opened[p] = q;
      a->peers.data[p] = (uint8_t *)q;
    }
  }
  for (int p = 0; p < world; p++) a->peers.flags[p] = (uint32_t *)(a->peers.data[p] + data_bytes(world));
  a->seq = (uint32_t *)(a->mine + data_bytes(world) + flag_bytes(world));
  a->err = a->seq + 1;
  a->done = a->seq + 2;
  /* sequence numbers start at 1: flags start at 0 */
  uint32_t one = 1;
  if (ok) ok = cudaMemcpy(a->seq, &one, sizeof one, cudaMemcpyHostToDevice) == cudaSuccess;
  /* all or none: a rank without P2P keeps every rank on NCCL */
  me.ok = ok;
  s = gather(gctx, &me, cards, sizeof me);
  for (int p = 0; s == TD_OK && p < world; p++) ok = ok && cards[p].ok;
  if (s != TD_OK || !ok) {
    td_cu_allreduce_destroy(a);
    return s;
  }
  *out = a;
  return TD_OK;
}
