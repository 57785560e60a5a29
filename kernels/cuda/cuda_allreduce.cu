/* One-shot all-reduce for the small messages of tensor-parallel decoding
 * (a few KB to 1 MB): every rank stores its values straight into each
 * peer's receive slot over NVLink (P2P, CUDA IPC between processes) and
 * sums the peers' values from its own slots in rank order, so every rank
 * gets the same bits. The values are their own flags (as in Lamport's
 * scheme): a slot holds bf16 -0.0 (0x8000) where nothing has arrived, the
 * senders write -0.0 as +0.0, and a reader spins on each value until it is
 * no longer -0.0. No fence and no flag round trip: one kernel whose cost
 * is one NVLink store latency. Slots rotate over three phases: the call
 * after next is the first that can write a phase again, so each call
 * empties the previous call's phase (the peers finished writing it before
 * this rank could finish that call). Larger messages, or machines without
 * P2P, use NCCL. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/cuda_allreduce.h"
#include "kernels/cuda/cuda_allreduce.cuh"

#define AR_THREADS 256
#define AR_MAX_BLOCKS 128

struct td_cu_allreduce {
  int rank, world, device;
  uint8_t *mine; /* slots, then the ar_ctl */
  ar_ctl *ctl;
  ar_peers peers;
  void *opened[AR_MAX_WORLD];
};

static size_t slot_bytes(int world) { return (size_t)AR_PHASES * world * AR_SLOT_BYTES; }

__global__ void __launch_bounds__(AR_THREADS) ar_kernel(bf16 *buf, uint32_t n, ar_peers P, int rank, int world,
                                                        ar_ctl *ctl) {
  td_pdl_start();
  const uint32_t phase = ctl->phase;
  const size_t stride = (size_t)gridDim.x * blockDim.x, me = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  uint8_t *mine = P.slots[rank];
  /* 1. the previous call's values in our slots back to "not arrived" */
  empty_previous(P, rank, world, ctl, me, stride);
  /* 2. ours into every peer's slot for us, all of this thread's vectors
   * first (so that a thread with several waits one NVLink latency, not one
   * a vector); 3. the sum in rank order */
  const size_t full = n / 8;
  for (size_t v = me; v < full; v += stride) {
    uint4 u = ((const uint4 *)buf)[v];
    u = make_uint4(unmark(u.x), unmark(u.y), unmark(u.z), unmark(u.w));
    for (int p = 0; p < world; p++)
      if (p != rank) ((uint4 *)(P.slots[p] + ((size_t)phase * world + rank) * AR_SLOT_BYTES))[v] = u;
  }
  for (size_t v = me; v < full; v += stride) {
    uint4 u = ((const uint4 *)buf)[v]; /* this thread's own vector, not yet summed */
    u = make_uint4(unmark(u.x), unmark(u.y), unmark(u.z), unmark(u.w));
    float acc[8];
#pragma unroll
    for (int k = 0; k < 8; k++) acc[k] = 0.0f;
    for (int r = 0; r < world; r++) {
      if (r == rank) {
        add8(acc, u);
        continue;
      }
      add8(acc, wait_vec((const uint4 *)(mine + ((size_t)phase * world + r) * AR_SLOT_BYTES) + v, ctl));
    }
    bf16 o[8];
#pragma unroll
    for (int k = 0; k < 8; k++) o[k] = __float2bfloat16(acc[k]);
    ((uint4 *)buf)[v] = *(const uint4 *)o;
  }
  /* the ragged tail, a value at a time, by the first threads after the vectors */
  for (size_t i = full * 8 + me; i < n; i += stride) {
    uint16_t x = ((const uint16_t *)buf)[i];
    if (x == AR_EMPTY) x = 0;
    for (int p = 0; p < world; p++)
      if (p != rank) ((uint16_t *)(P.slots[p] + ((size_t)phase * world + rank) * AR_SLOT_BYTES))[i] = x;
    float acc = 0.0f;
    for (int r = 0; r < world; r++) {
      uint16_t y = x;
      if (r != rank) {
        const uint16_t *src = (const uint16_t *)(mine + ((size_t)phase * world + r) * AR_SLOT_BYTES) + i;
        uint32_t spins = 0;
        while ((y = ld_volatile2(src)) == AR_EMPTY)
          if (++spins > AR_SPIN_LIMIT) {
            atomicExch(&ctl->err, 1u);
            break;
          }
      }
      acc += __bfloat162float(__ushort_as_bfloat16(y));
    }
    buf[i] = __float2bfloat16(acc);
  }
  advance_phase(ctl, phase, n);
}

/* The all-gather of a row-split matrix's columns [col0, col0 + 8 cpr)
 * (td_allgather_rows) over the same slots and phases: this rank's rows into
 * every peer's slot for it, then each peer's rows out of our slots into
 * buf. The previous call's slots are emptied first, as above. */
__global__ void __launch_bounds__(AR_THREADS) ag_rows_kernel(bf16 *buf, int rows, int width, int col0, int cpr,
                                                             int per, ar_peers P, int rank, int world, ar_ctl *ctl) {
  /* the wait only: the next kernel (the attention) launches when this one
   * ends, so that its blocks spread over the SMs evenly rather than where
   * these spinning blocks left room (two a SM there: 42 against 30 us) */
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  const uint32_t phase = ctl->phase;
  const size_t stride = (size_t)gridDim.x * blockDim.x, me = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  uint8_t *mine = P.slots[rank];
  empty_previous(P, rank, world, ctl, me, stride);
  const size_t w8 = (size_t)width / 8, c8 = (size_t)col0 / 8;
  const int lo = min(rows, rank * per), hi = min(rows, (rank + 1) * per);
  /* a rank without rows still sends one vector (zeros) and waits for one
   * from each such peer: every call then meets every peer, so that no rank
   * runs two calls ahead into a phase its peer has yet to empty */
  const size_t mine_v = (size_t)(hi - lo) * cpr, send_v = mine_v ? mine_v : 1;
  for (size_t v = me; v < send_v; v += stride) {
    uint4 u = make_uint4(0u, 0u, 0u, 0u);
    if (v < mine_v) u = ((const uint4 *)buf)[(lo + v / cpr) * w8 + c8 + v % cpr];
    u = make_uint4(unmark(u.x), unmark(u.y), unmark(u.z), unmark(u.w));
    for (int p = 0; p < world; p++)
      if (p != rank) ((uint4 *)(P.slots[p] + ((size_t)phase * world + rank) * AR_SLOT_BYTES))[v] = u;
  }
  for (int r = 0; r < world; r++) {
    if (r == rank) continue;
    const int rlo = min(rows, r * per), rhi = min(rows, (r + 1) * per);
    const uint4 *src = (const uint4 *)(mine + ((size_t)phase * world + r) * AR_SLOT_BYTES);
    const size_t their_v = (size_t)(rhi - rlo) * cpr;
    for (size_t v = me; v < (their_v ? their_v : 1); v += stride) {
      uint4 w = wait_vec(src + v, ctl);
      if (v < their_v) ((uint4 *)buf)[(rlo + v / cpr) * w8 + c8 + v % cpr] = w;
    }
  }
  advance_phase(ctl, phase, (uint32_t)per * (uint32_t)cpr * 8u); /* the most any peer wrote into a slot of ours */
}

/* The all-gather of n 4-byte words a rank (float32 logits of a vocabulary
 * split: recv[r * n ...] = rank r's send) over the same slots and phases:
 * this rank's words into every peer's slot for it and its own part of recv,
 * then each peer's out of ours. A word's "not arrived" mark is 0x80008000
 * (two bf16 marks, what emptying writes); a word with that pattern (a
 * negative denormal, -4.6e-41 as a float) is sent as -0.0. VEC: 16-byte
 * vectors (n % 4 == 0, aligned buffers), else a word at a time. */
template <bool VEC>
__global__ void __launch_bounds__(AR_THREADS) ag_words_kernel(const uint32_t *send, uint32_t *recv, uint32_t n,
                                                              ar_peers P, int rank, int world, ar_ctl *ctl) {
  td_pdl_start();
  const uint32_t phase = ctl->phase;
  const size_t stride = (size_t)gridDim.x * blockDim.x, me = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  empty_previous(P, rank, world, ctl, me, stride);
  auto fix = [](uint32_t w) { return w == AR_EMPTY2 ? 0x80000000u : w; };
  const size_t units = VEC ? n / 4 : n;
  for (size_t v = me; v < units; v += stride) {
    if (VEC) {
      uint4 u = ((const uint4 *)send)[v];
      u = make_uint4(fix(u.x), fix(u.y), fix(u.z), fix(u.w));
      for (int p = 0; p < world; p++)
        if (p != rank) ((uint4 *)(P.slots[p] + ((size_t)phase * world + rank) * AR_SLOT_BYTES))[v] = u;
      ((uint4 *)(recv + (size_t)rank * n))[v] = u;
    } else {
      uint32_t u = fix(send[v]);
      for (int p = 0; p < world; p++)
        if (p != rank) ((uint32_t *)(P.slots[p] + ((size_t)phase * world + rank) * AR_SLOT_BYTES))[v] = u;
      recv[(size_t)rank * n + v] = u;
    }
  }
  for (int r = 0; r < world; r++) {
    if (r == rank) continue;
    const uint8_t *src = P.slots[rank] + ((size_t)phase * world + r) * AR_SLOT_BYTES;
    for (size_t v = me; v < units; v += stride) {
      if (VEC) ((uint4 *)(recv + (size_t)r * n))[v] = wait_vec<true>((const uint4 *)src + v, ctl);
      else recv[(size_t)r * n + v] = wait_word((const uint32_t *)src + v, ctl);
    }
  }
  advance_phase(ctl, phase, 2u * n); /* in bf16 values, as the slots are emptied */
}

bool td_cu_allgather_words_fits(const td_cu_allreduce *a, td_buf_type t, size_t n) {
  return a && t == TD_BUF_F32 && n <= UINT32_MAX / 2 &&
         n * 4u <= (a->world <= 2 ? AR_SLOT_BYTES : AR_WIDE_BYTES);
}

td_status td_cu_allgather_words_run(td_backend *b, td_cu_allreduce *a, const void *send, void *recv, size_t n) {
  td_cuda *c = td_cu(b);
  if (!n) return TD_OK;
  const bool vec = n % 4 == 0 && td_aligned16(send) && td_aligned16(recv);
  size_t units = vec ? n / 4 : n, blocks = (units + AR_THREADS - 1) / AR_THREADS;
  if (blocks > AR_MAX_BLOCKS) blocks = AR_MAX_BLOCKS;
  if (vec)
    TD_CU_CHECK(td_launch(c, ag_words_kernel<true>, dim3((unsigned)blocks), dim3(AR_THREADS), 0,
                          (const uint32_t *)send, (uint32_t *)recv, (uint32_t)n, a->peers, a->rank, a->world, a->ctl),
                "allgather");
  else
    TD_CU_CHECK(td_launch(c, ag_words_kernel<false>, dim3((unsigned)blocks), dim3(AR_THREADS), 0,
                          (const uint32_t *)send, (uint32_t *)recv, (uint32_t)n, a->peers, a->rank, a->world, a->ctl),
                "allgather");
  TD_CU_LAUNCHED("allgather");
  return TD_OK;
}

bool td_cu_allgather_rows_fits(const td_cu_allreduce *a, td_buf_type t, const void *buf, int per, int width, int col0,
                               int ncols) {
  return a && t == TD_BUF_ACT && td_aligned16(buf) && width % 8 == 0 && col0 % 8 == 0 && ncols % 8 == 0 &&
         (size_t)per * (size_t)ncols * sizeof(bf16) <= (a->world <= 2 ? AR_SLOT_BYTES : AR_WIDE_BYTES);
}

td_status td_cu_allgather_rows_run(td_backend *b, td_cu_allreduce *a, void *buf, int rows, int width, int col0,
                                   int ncols, int per) {
  td_cuda *c = td_cu(b);
  size_t vecs = (size_t)per * (size_t)(ncols / 8);
  size_t blocks = (vecs + AR_THREADS - 1) / AR_THREADS;
  if (blocks > AR_MAX_BLOCKS) blocks = AR_MAX_BLOCKS;
  if (blocks < 1) blocks = 1;
  TD_CU_CHECK(td_launch(c, ag_rows_kernel, dim3((unsigned)blocks), dim3(AR_THREADS), 0, (bf16 *)buf, rows, width,
                        col0, ncols / 8, per, a->peers, a->rank, a->world, a->ctl),
              "allgather_rows");
  TD_CU_LAUNCHED("allgather_rows");
  return TD_OK;
}

__global__ void ar_fill_kernel(uint32_t *p, size_t words) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x)
    p[i] = AR_EMPTY2;
}

bool td_cu_allreduce_fits(const td_cu_allreduce *a, td_buf_type t, size_t n) {
  return a && t == TD_BUF_ACT && n * sizeof(bf16) <= (a->world <= 2 ? AR_SLOT_BYTES : AR_WIDE_BYTES);
}

bool td_cu_allreduce_dev(const td_cu_allreduce *a, size_t n, td_cu_ar_dev *out) {
  if (!td_cu_allreduce_fits(a, TD_BUF_ACT, n)) return false;
  memset(out, 0, sizeof *out);
  for (int p = 0; p < a->world; p++) out->slots[p] = a->peers.slots[p];
  out->ctl = a->ctl;
  out->rank = a->rank;
  out->world = a->world;
  return true;
}

td_status td_cu_allreduce_run(td_backend *b, td_cu_allreduce *a, void *buf, size_t n) {
  td_cuda *c = td_cu(b);
  if (!n) return TD_OK;
  size_t vecs = (n + 7) / 8;
  size_t blocks = (vecs + AR_THREADS - 1) / AR_THREADS;
  if (blocks > AR_MAX_BLOCKS) blocks = AR_MAX_BLOCKS;
  TD_CU_CHECK(td_launch(c, ar_kernel, dim3((unsigned)blocks), dim3(AR_THREADS), 0, (bf16 *)buf, (uint32_t)n,
                        a->peers, a->rank, a->world, a->ctl),
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
  size_t total = slot_bytes(world) + sizeof(ar_ctl);
  ar_card me = {};
  me.pid = (int32_t)getpid();
  me.device = c->device;
  me.ok = 1;
  /* every slot "not arrived", the control words zero; done before any peer can write */
  if (cudaMalloc((void **)&a->mine, total) != cudaSuccess || cudaMemset(a->mine, 0, total) != cudaSuccess)
    me.ok = 0;
  if (me.ok) {
    ar_fill_kernel<<<256, 256>>>((uint32_t *)a->mine, slot_bytes(world) / 4);
    me.ok = cudaGetLastError() == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess &&
            cudaIpcGetMemHandle(&me.handle, a->mine) == cudaSuccess;
  }
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
      a->peers.slots[p] = a->mine;
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
      a->peers.slots[p] = (uint8_t *)(uintptr_t)cards[p].ptr;
    } else {
      void *q = NULL;
      ok = cudaIpcOpenMemHandle(&q, cards[p].handle, cudaIpcMemLazyEnablePeerAccess) == cudaSuccess;
      (void)cudaGetLastError();
      a->opened[p] = q;
      a->peers.slots[p] = (uint8_t *)q;
    }
  }
  a->ctl = (ar_ctl *)(a->mine + slot_bytes(world));
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
