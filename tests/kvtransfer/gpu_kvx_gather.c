/* gpu_kvx gather: the gather / scatter kernel of the NCCL path against a
 * CPU reference on random pieces, and its speed (GPU 0). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "gpu_kvx.h"
#include "kvtransfer/gather.h"
#include "kvtransfer/gpu.h"

static uint64_t rnd(uint64_t *x) {
  *x ^= *x << 13;
  *x ^= *x >> 7;
  *x ^= *x << 17;
  return *x;
}

/* Random pieces (disjoint destinations, shuffled order) copied by
 * kvx_gpu_copy_d2d on the device and by memcpy on host copies. */
static bool gather_case(kvx_gpu *g, uint64_t seed, int n, size_t small_max, int large_every, size_t large,
                        bool aligned) {
  size_t *len = malloc(sizeof(size_t) * (size_t)n), *so = malloc(sizeof(size_t) * (size_t)n),
         *dof = malloc(sizeof(size_t) * (size_t)n);
  size_t cap = 4096;
  for (int i = 0; i < n; i++) {
    len[i] = large_every && i % large_every == 1 ? large + rnd(&seed) % 99 : 1 + rnd(&seed) % small_max;
    if (aligned) len[i] = (len[i] + 15) & ~(size_t)15;
    cap += len[i] + 32;
  }
  size_t a = 0, b = 0;
  for (int i = 0; i < n; i++) {
    size_t ga = aligned ? 0 : rnd(&seed) % 31, gb = aligned ? 0 : rnd(&seed) % 29;
    so[i] = a + ga;
    dof[n - 1 - i] = b + gb;
    a += ga + len[i];
    b += gb + len[n - 1 - i];
  }
  uint8_t *hs = malloc(cap), *hd = malloc(cap), *got = malloc(cap);
  fill(hs, cap, seed);
  fill(hd, cap, seed + 1);
  void *ds = NULL, *dd = NULL;
  CHECK(cudaMalloc(&ds, cap) == cudaSuccess && cudaMalloc(&dd, cap) == cudaSuccess, "cudaMalloc %zu", cap);
  cudaMemcpy(ds, hs, cap, cudaMemcpyHostToDevice);
  cudaMemcpy(dd, hd, cap, cudaMemcpyHostToDevice);
  void **dsts = malloc(sizeof(void *) * (size_t)n);
  const void **srcs = malloc(sizeof(void *) * (size_t)n);
  size_t *sizes = malloc(sizeof(size_t) * (size_t)n);
  for (int i = 0; i < n; i++) {
    dsts[i] = (uint8_t *)dd + dof[i];
    srcs[i] = (uint8_t *)ds + so[i];
    sizes[i] = len[i];
    memcpy(hd + dof[i], hs + so[i], len[i]); /* the reference */
  }
  void *ev = NULL;
  td_status st = kvx_gpu_copy_d2d(g, KVX_S_GATHER, dsts, srcs, sizes, (size_t)n);
  if (st == TD_OK) st = kvx_gpu_record(g, KVX_S_GATHER, &ev);
  int q = 0;
  while (st == TD_OK && (q = kvx_gpu_query(g, ev)) == 0) {
  }
  kvx_gpu_release(g, ev);
  bool ok = st == TD_OK && q == 1;
  if (!ok) printf("  check failed: gather: %s\n", td_errmsg());
  cudaMemcpy(got, dd, cap, cudaMemcpyDeviceToHost);
  size_t bad = cap;
  for (size_t i = 0; ok && i < cap; i++)
    if (got[i] != hd[i]) bad = i;
  if (ok && bad != cap) {
    printf("  check failed: seed %llu: byte %zu differs (%u, expected %u)\n", (unsigned long long)seed, bad, got[bad],
           hd[bad]);
    ok = false;
  }
  cudaFree(ds);
  cudaFree(dd);
  free(hs);
  free(hd);
  free(got);
  free(dsts);
  free(srcs);
  free(sizes);
  free(len);
  free(so);
  free(dof);
  return ok;
}

/* Gather speed: n pieces of piece bytes, scattered over a buffer twice
 * the size, into one contiguous buffer (the NCCL sender's gather). */
static void gather_speed(kvx_gpu *g, size_t piece, int n) {
  size_t total = piece * (size_t)n;
  void *src = NULL, *dst = NULL;
  if (cudaMalloc(&src, 2 * total) != cudaSuccess || cudaMalloc(&dst, total) != cudaSuccess) return;
  void **dsts = malloc(sizeof(void *) * (size_t)n);
  const void **srcs = malloc(sizeof(void *) * (size_t)n);
  size_t *sizes = malloc(sizeof(size_t) * (size_t)n);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  float best = 1e30f;
  for (int r = 0; r < 6; r++) {
    for (int i = 0; i < n; i++) {
      dsts[i] = (uint8_t *)dst + (size_t)i * piece;
      srcs[i] = (uint8_t *)src + (size_t)((i * 7) % (2 * n)) * piece;
      sizes[i] = piece;
    }
    cudaDeviceSynchronize();
    cudaEventRecord(e0, NULL);
    kvx_gpu_wait(g, KVX_S_GATHER, e0);
    kvx_gpu_copy_d2d(g, KVX_S_GATHER, dsts, srcs, sizes, (size_t)n);
    void *ev = NULL;
    kvx_gpu_record(g, KVX_S_GATHER, &ev);
    cudaStreamWaitEvent(NULL, (cudaEvent_t)ev, 0);
    cudaEventRecord(e1, NULL);
    cudaEventSynchronize(e1);
    kvx_gpu_release(g, ev);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    if (r > 0 && ms < best) best = ms;
  }
  printf("  gather of %d x %zu KiB (%.1f MB): %.1f us, %.0f GB/s copied (read + write: %.0f GB/s of HBM)\n", n,
         piece >> 10, (double)total / 1e6, best * 1e3, (double)total / best / 1e6, 2.0 * (double)total / best / 1e6);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(src);
  cudaFree(dst);
  free(dsts);
  free(srcs);
  free(sizes);
}

void run_gather(void) {
  kvx_gpu *g = NULL;
  if (cudaSetDevice(0) != cudaSuccess || kvx_gpu_create(0, &g) != TD_OK) {
    report("gather: device", false);
    return;
  }
  report("gather: one piece, 5 bytes", gather_case(g, 1, 1, 5, 0, 0, false));
  report("gather: odd sizes, unaligned offsets", gather_case(g, 2, 300, 5000, 0, 0, false));
  report("gather: many small pieces (several launches)", gather_case(g, 3, 5000, 200, 0, 0, false));
  report("gather: a few large pieces among small ones", gather_case(g, 4, 200, 3000, 40, (size_t)3 << 20, false));
  report("gather: 16-byte aligned, 64 KiB .. 1.5 MiB", gather_case(g, 5, 120, (size_t)1536 << 10, 0, 0, true));
  report("gather: pieces over 1 GiB split", gather_case(g, 6, 3, 100, 2, ((size_t)1 << 30) + 4097, false));
  gather_speed(g, (size_t)64 << 10, 256);
  gather_speed(g, (size_t)64 << 10, 1000); /* one launch of a full table */
  gather_speed(g, (size_t)64 << 10, 4096); /* 256 MB */
  gather_speed(g, (size_t)1536 << 10, 11);
  gather_speed(g, (size_t)1536 << 10, 171);
  kvx_gpu_destroy(g);
}
