/* Re-slicing plans: which bytes of a source block go where in a destination
 * block when the two ranks hold different layer / head ranges. */
#include <stdlib.h>

#include "kvtransfer/kvtransfer.h"

#define KVX_MAX_DIM (1 << 16)

td_status td_kvx_geom_check(const td_kvx_geom *g) {
  const td_kv_layout *l = &g->layout;
  if (l->n_layers <= 0 || l->n_heads <= 0 || l->head_dim <= 0 || l->block_size <= 0 || l->n_layers > KVX_MAX_DIM ||
      l->n_heads > KVX_MAX_DIM || l->head_dim > KVX_MAX_DIM || l->block_size > KVX_MAX_DIM)
    return td_err(TD_ERR_INVALID, "KV geometry: %d layers x %d heads x %d dims x %d slots is not a block layout",
                  l->n_layers, l->n_heads, l->head_dim, l->block_size);
  if (g->elem_size != 1 && g->elem_size != 2 && g->elem_size != 4 && g->elem_size != 8)
    return td_err(TD_ERR_INVALID, "KV geometry: element size %d", g->elem_size);
  /* 64-bit: ranges come from the wire. */
  if (g->layer0 < 0 || g->layer0 > KVX_MAX_DIM || (int64_t)g->layer1 - g->layer0 != l->n_layers || g->head0 < 0 ||
      g->head0 > KVX_MAX_DIM || (int64_t)g->head1 - g->head0 != l->n_heads)
    return td_err(TD_ERR_INVALID, "KV geometry: layers [%d, %d) and heads [%d, %d) do not match %d layers x %d heads",
                  g->layer0, g->layer1, g->head0, g->head1, l->n_layers, l->n_heads);
  return TD_OK;
}

size_t td_kvx_block_bytes(const td_kvx_geom *g) {
  if (td_kvx_geom_check(g) != TD_OK) return 0;
  return td_kv_block_elems(&g->layout) * (size_t)g->elem_size;
}

static int imax(int a, int b) { return a > b ? a : b; }
static int imin(int a, int b) { return a < b ? a : b; }

td_status td_kvx_slice_plan(const td_kvx_geom *s, const td_kvx_geom *d, td_kvx_slice *out, int cap, int *n) {
  *n = 0;
  TD_TRY(td_kvx_geom_check(s));
  TD_TRY(td_kvx_geom_check(d));
  if (s->layout.block_size != d->layout.block_size || s->layout.head_dim != d->layout.head_dim ||
      s->elem_size != d->elem_size)
    return td_err(TD_ERR_INVALID,
                  "KV re-slicing: blocks differ in slots (%d vs %d), head_dim (%d vs %d) or element size (%d vs %d)",
                  s->layout.block_size, d->layout.block_size, s->layout.head_dim, d->layout.head_dim, s->elem_size,
                  d->elem_size);
  int l0 = imax(s->layer0, d->layer0), l1 = imin(s->layer1, d->layer1);
  int h0 = imax(s->head0, d->head0), h1 = imin(s->head1, d->head1);
  if (l0 >= l1 || h0 >= h1) return TD_OK;
  /* One head's [slot][head_dim] sub-slab. */
  uint64_t unit = (uint64_t)s->layout.block_size * (uint64_t)s->layout.head_dim * (uint64_t)s->elem_size;
  uint64_t len = (uint64_t)(h1 - h0) * unit;
  int k = 0;
  for (int l = l0; l < l1; l++) {
    for (int kv = 0; kv < 2; kv++) {
      uint64_t so = ((uint64_t)((l - s->layer0) * 2 + kv) * (uint64_t)s->layout.n_heads + (uint64_t)(h0 - s->head0)) * unit;
      uint64_t dof = ((uint64_t)((l - d->layer0) * 2 + kv) * (uint64_t)d->layout.n_heads + (uint64_t)(h0 - d->head0)) * unit;
      if (k > 0 && out[k - 1].src_off + out[k - 1].len == so && out[k - 1].dst_off + out[k - 1].len == dof) {
        out[k - 1].len += len;
        continue;
      }
      if (k == cap) return td_err(TD_ERR_INVALID, "KV re-slicing: more than %d slices", cap);
      out[k++] = (td_kvx_slice){so, dof, len};
    }
  }
  *n = k;
  return TD_OK;
}

td_status td_kvx_plan_copies(const td_kvx_geom *s, const td_kvx_geom *d, const int32_t *src_blocks,
                             const int32_t *dst_blocks, int n_blocks, td_kvx_slice **out, int *n) {
  *out = NULL;
  *n = 0;
  if (n_blocks < 0 || (n_blocks > 0 && (!src_blocks || !dst_blocks)))
    return td_err(TD_ERR_INVALID, "KV transfer plan: %d blocks", n_blocks);
  TD_TRY(td_kvx_geom_check(s));
  TD_TRY(td_kvx_geom_check(d));
  /* At most 2 slices per layer. */
  int cap = 2 * imin(s->layout.n_layers, d->layout.n_layers);
  td_kvx_slice *sl = malloc(sizeof *sl * (size_t)cap);
  if (!sl) return td_err(TD_ERR_NOMEM, "out of memory");
  int ns = 0;
  td_status st = td_kvx_slice_plan(s, d, sl, cap, &ns);
  if (st != TD_OK || ns == 0 || n_blocks == 0) {
    free(sl);
    return st;
  }
  uint64_t sbb = td_kvx_block_bytes(s), dbb = td_kvx_block_bytes(d);
  td_kvx_slice *c = malloc(sizeof *c * (size_t)n_blocks * (size_t)ns);
  if (!c) {
    free(sl);
    return td_err(TD_ERR_NOMEM, "out of memory");
  }
  int k = 0;
  for (int b = 0; b < n_blocks; b++) {
    if (src_blocks[b] < 0 || dst_blocks[b] < 0) {
      free(sl);
      free(c);
      return td_err(TD_ERR_INVALID, "KV transfer plan: block pair %d is (%d, %d)", b, src_blocks[b], dst_blocks[b]);
    }
    for (int i = 0; i < ns; i++) {
      uint64_t so = (uint64_t)src_blocks[b] * sbb + sl[i].src_off;
      uint64_t dof = (uint64_t)dst_blocks[b] * dbb + sl[i].dst_off;
      if (k > 0 && c[k - 1].src_off + c[k - 1].len == so && c[k - 1].dst_off + c[k - 1].len == dof) {
        c[k - 1].len += sl[i].len;
      } else {
        c[k++] = (td_kvx_slice){so, dof, sl[i].len};
      }
    }
  }
  free(sl);
  *out = c;
  *n = k;
  return TD_OK;
}
