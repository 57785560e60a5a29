/* Internal: piece tables of the gather / scatter kernel (gather.cu). A
 * table lists device-to-device copies (src, dst, len); the kernel cuts each
 * piece into tiles of KVX_GATHER_TILE bytes, each thread block a contiguous
 * range of tiles, and finds its first tile's piece by binary search on the
 * pieces' first tiles, then walks the table. Tables
 * are built on the host (gather_plan.c, pure C, tested on the CPU) and go to
 * the kernel by value, so a launch needs no upload and no buffer whose
 * lifetime must be tracked. kvx_gtable_run_cpu is the CPU reference. */
#ifndef TD_KVTRANSFER_GATHER_H
#define TD_KVTRANSFER_GATHER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVX_GATHER_TILE 32768u /* bytes per thread block and step */
#define KVX_GATHER_PIECES 1000 /* per launch: 24 KiB of kernel parameters (limit 32 KiB) */
#define KVX_GATHER_SMALL 32    /* tables up to this go as a small parameter block (no constant-cache misses) */
#define KVX_GATHER_MAX_PIECE ((uint64_t)1 << 30) /* longer pieces are split */

typedef struct kvx_gpiece {
  uint64_t src, dst; /* device addresses */
  uint32_t len;
  uint32_t tile0; /* the piece's first tile in its table */
} kvx_gpiece;

typedef struct kvx_gtable {
  uint32_t n, tiles;
  kvx_gpiece p[KVX_GATHER_PIECES];
} kvx_gtable;

/* Fills t from the copy lists (n entries) starting at entry *i, byte *off
 * of it, and advances the cursor; empty entries are skipped. Returns the
 * pieces in t (0 once the lists are used up). */
uint32_t kvx_gtable_fill(kvx_gtable *t, void *const *dsts, const void *const *srcs, const size_t *sizes, size_t n,
                         size_t *i, size_t *off);
/* CPU reference of one launch: the kernel's tile walk with memcpy. */
void kvx_gtable_run_cpu(const kvx_gtable *t);
/* Launches the kernel on a CUDA stream (cudaStream_t) with at most
 * max_blocks thread blocks; returns a cudaError_t (0: launched). CUDA
 * builds only. */
int kvx_gather_launch(const kvx_gtable *t, unsigned max_blocks, void *stream);

#ifdef __CUDACC__
#define KVX_GATHER_FN static __host__ __device__ __forceinline__
#else
#define KVX_GATHER_FN static inline
#endif

/* The piece that holds a tile: the last one whose first tile is <= tile. */
KVX_GATHER_FN uint32_t kvx_gtable_find(const kvx_gpiece *p, uint32_t n, uint32_t tile) {
  uint32_t lo = 0, hi = n;
  while (hi - lo > 1) {
    uint32_t mid = (lo + hi) / 2;
    if (p[mid].tile0 <= tile)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

/* Block b of `blocks` copies the tiles [*lo, *hi): contiguous ranges, so a
 * block searches the table once and then walks it (a search a tile missed
 * the constant cache on tables of hundreds of pieces). */
KVX_GATHER_FN void kvx_gtable_range(uint32_t tiles, uint32_t blocks, uint32_t b, uint32_t *lo, uint32_t *hi) {
  uint32_t per = (tiles + blocks - 1) / blocks;
  uint64_t l = (uint64_t)b * per, h = l + per;
  *lo = l < tiles ? (uint32_t)l : tiles;
  *hi = h < tiles ? (uint32_t)h : tiles;
}

/* The piece of `tile` given k, the piece of an earlier tile of the range
 * (pieces of no tiles share the next one's tile0 and are passed over). */
KVX_GATHER_FN uint32_t kvx_gtable_advance(const kvx_gpiece *p, uint32_t n, uint32_t k, uint32_t tile) {
  while (k + 1 < n && p[k + 1].tile0 <= tile) k++;
  return k;
}

#ifdef __cplusplus
}
#endif

#endif
