/* Piece tables of the gather / scatter kernel (gather.h): built here on the
 * host for every build, so the CPU tests cover them. */
#include <string.h>

#include "kvtransfer/gather.h"

uint32_t kvx_gtable_fill(kvx_gtable *t, void *const *dsts, const void *const *srcs, const size_t *sizes, size_t n,
                         size_t *i, size_t *off) {
  t->n = 0;
  t->tiles = 0;
  while (*i < n && t->n < KVX_GATHER_PIECES) {
    if (sizes[*i] <= *off) {
      (*i)++;
      *off = 0;
      continue;
    }
    uint64_t len = sizes[*i] - *off;
    if (len > KVX_GATHER_MAX_PIECE) len = KVX_GATHER_MAX_PIECE;
    uint32_t tiles = (uint32_t)((len + KVX_GATHER_TILE - 1) / KVX_GATHER_TILE);
    kvx_gpiece *p = &t->p[t->n++];
    p->src = (uint64_t)(uintptr_t)srcs[*i] + *off;
    p->dst = (uint64_t)(uintptr_t)dsts[*i] + *off;
    p->len = (uint32_t)len;
    p->tile0 = t->tiles;
    t->tiles += tiles;
    *off += len;
    if (*off == sizes[*i]) {
      (*i)++;
      *off = 0;
    }
  }
  return t->n;
}

void kvx_gtable_run_cpu(const kvx_gtable *t) {
  /* the kernel's walk with an odd number of blocks, so that ranges start inside pieces */
  const uint32_t blocks = 7;
  for (uint32_t b = 0; b < blocks; b++) {
    uint32_t lo, hi;
    kvx_gtable_range(t->tiles, blocks, b, &lo, &hi);
    if (lo >= hi) continue;
    uint32_t k = kvx_gtable_find(t->p, t->n, lo);
    for (uint32_t tile = lo; tile < hi; tile++) {
      k = kvx_gtable_advance(t->p, t->n, k, tile);
      const kvx_gpiece *p = &t->p[k];
      uint32_t off = (tile - p->tile0) * KVX_GATHER_TILE;
      uint32_t len = p->len - off < KVX_GATHER_TILE ? p->len - off : KVX_GATHER_TILE;
      memcpy((void *)(uintptr_t)(p->dst + off), (const void *)(uintptr_t)(p->src + off), len);
    }
  }
}
