// Gather / scatter kernel of the NCCL path (gather.h): one launch copies a
// table of device-to-device pieces. The copy engine costs microseconds per
// piece (cudaMemcpyBatchAsync included); here each thread block copies a
// contiguous range of 32 KiB tiles with 16-byte accesses, four in flight per
// thread.
#include <cuda_runtime.h>
#include <string.h>

#include "kvtransfer/gather.h"

namespace {

constexpr unsigned kThreads = 256;

// Copies n bytes with accesses of V where d and s share V's alignment:
// single bytes up to d's V boundary, V words, then the last bytes.
template <typename V>
__device__ __forceinline__ void copy_words(uint8_t *d, const uint8_t *s, uint32_t n) {
  constexpr uint32_t W = sizeof(V);
  uint32_t head = (uint32_t)((W - ((uintptr_t)d & (W - 1))) & (W - 1));
  if (head > n) head = n;
  if (threadIdx.x < head) d[threadIdx.x] = s[threadIdx.x];
  d += head;
  s += head;
  n -= head;
  const uint32_t nv = n / W;
  V *dv = reinterpret_cast<V *>(d);
  const V *sv = reinterpret_cast<const V *>(s);
  uint32_t i = threadIdx.x;
  // Loads first, then stores: four independent loads in flight per thread.
  for (; i + 3 * kThreads < nv; i += 4 * kThreads) {
    V a = sv[i], b = sv[i + kThreads], c = sv[i + 2 * kThreads], e = sv[i + 3 * kThreads];
    dv[i] = a;
    dv[i + kThreads] = b;
    dv[i + 2 * kThreads] = c;
    dv[i + 3 * kThreads] = e;
  }
  for (; i < nv; i += kThreads) dv[i] = sv[i];
  const uint32_t done = nv * W, tail = n - done;
  if (threadIdx.x < tail) d[done + threadIdx.x] = s[done + threadIdx.x];
}

__device__ __forceinline__ void copy_range(uint8_t *d, const uint8_t *s, uint32_t n) {
  const uintptr_t mis = (uintptr_t)d ^ (uintptr_t)s;
  if ((mis & 15) == 0)
    copy_words<uint4>(d, s, n);
  else if ((mis & 7) == 0)
    copy_words<uint2>(d, s, n);
  else if ((mis & 3) == 0)
    copy_words<uint32_t>(d, s, n);
  else if ((mis & 1) == 0)
    copy_words<uint16_t>(d, s, n);
  else
    copy_words<uint8_t>(d, s, n);
}

// The same layout as kvx_gtable, fewer pieces: a launch passes the whole
// struct, so short lists use this one.
struct small_table {
  uint32_t n, tiles;
  kvx_gpiece p[KVX_GATHER_SMALL];
};

// __grid_constant__: the table stays in parameter space (indexed by the
// binary search) instead of being copied per thread.
template <typename T>
__global__ void __launch_bounds__(kThreads) gather_kernel(const __grid_constant__ T t) {
  uint32_t lo, hi;
  kvx_gtable_range(t.tiles, gridDim.x, blockIdx.x, &lo, &hi);
  if (lo >= hi) return;
  uint32_t k = kvx_gtable_find(t.p, t.n, lo);
  for (uint32_t tile = lo; tile < hi; tile++) {
    k = kvx_gtable_advance(t.p, t.n, k, tile);
    const kvx_gpiece *p = &t.p[k];
    const uint32_t off = (tile - p->tile0) * KVX_GATHER_TILE;
    const uint32_t len = p->len - off < KVX_GATHER_TILE ? p->len - off : KVX_GATHER_TILE;
    copy_range(reinterpret_cast<uint8_t *>(p->dst) + off, reinterpret_cast<const uint8_t *>(p->src) + off, len);
  }
}

}  // namespace

extern "C" int kvx_gather_launch(const kvx_gtable *t, unsigned max_blocks, void *stream) {
  if (t->n == 0 || t->tiles == 0) return (int)cudaSuccess;
  unsigned blocks = t->tiles < max_blocks ? t->tiles : max_blocks;
  if (blocks == 0) blocks = 1;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (t->n <= KVX_GATHER_SMALL) {
    small_table st;
    memset(&st, 0, sizeof st);
    st.n = t->n;
    st.tiles = t->tiles;
    memcpy(st.p, t->p, sizeof(kvx_gpiece) * t->n);
    gather_kernel<small_table><<<blocks, kThreads, 0, s>>>(st);
  } else {
    gather_kernel<kvx_gtable><<<blocks, kThreads, 0, s>>>(*t);
  }
  return (int)cudaGetLastError();
}
