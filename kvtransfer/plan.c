/* Re-slicing plans: which bytes of a source block go where in a destination
 * block when the two ranks hold different layer / head ranges; and how a
 * transfer's byte stream is cut into chunks. */
#include <stdlib.h>

#include "kvtransfer/kvtransfer.h"
#include "kvtransfer/wire.h"

#define KVX_MAX_DIM (1 << 16)

td_status td_kvx_geom_check(const td_kvx_geom *g) {
  const td_kv_layout *l = &g->layout;
  if (!td_kv_layout_valid(l) || l->n_layers > KVX_MAX_DIM || l->n_heads > KVX_MAX_DIM || l->head_dim > KVX_MAX_DIM ||
      l->block_size > KVX_MAX_DIM || l->states > KVX_MAX_DIM)
    return td_err(TD_ERR_INVALID,
                  "KV geometry: %d layers x %d heads x %d dims x %d slots with %d-wide states is not a block layout",
                  l->n_layers, l->n_heads, l->head_dim, l->block_size, l->states);
  if (g->elem_size != 1 && g->elem_size != 2 && g->elem_size != 4 && g->elem_size != 8)
    return td_err(TD_ERR_INVALID, "KV geometry: element size %d", g->elem_size);
  if (l->int8 && g->elem_size != 2) /* the int8 layout's sizes are in 2-byte elements (GPU pools) */
    return td_err(TD_ERR_INVALID, "KV geometry: int8 K/V in a pool of %d-byte elements", g->elem_size);
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

/* Appends a byte range, merged into the last one where both sides follow
 * on; false when that needs a slice past cap. */
static bool slice_push(td_kvx_slice *out, int *k, int cap, uint64_t so, uint64_t dof, uint64_t len) {
  td_kvx_slice *last = *k > 0 ? &out[*k - 1] : NULL;
  if (last && last->src_off + last->len == so && last->dst_off + last->len == dof) {
    last->len += len;
    return true;
  }
  if (*k == cap) return false;
  out[(*k)++] = (td_kvx_slice){so, dof, len};
  return true;
}
static int imin(int a, int b) { return a < b ? a : b; }

td_status td_kvx_slice_plan(const td_kvx_geom *s, const td_kvx_geom *d, td_kvx_slice *out, int cap, int *n) {
  *n = 0;
  TD_TRY(td_kvx_geom_check(s));
  TD_TRY(td_kvx_geom_check(d));
  if (s->layout.block_size != d->layout.block_size || s->layout.head_dim != d->layout.head_dim ||
      s->layout.states != d->layout.states || s->elem_size != d->elem_size)
    return td_err(TD_ERR_INVALID,
                  "KV re-slicing: blocks differ in slots (%d vs %d), head_dim (%d vs %d), states (%d vs %d) or "
                  "element size (%d vs %d)",
                  s->layout.block_size, d->layout.block_size, s->layout.head_dim, d->layout.head_dim,
                  s->layout.states, d->layout.states, s->elem_size, d->elem_size);
  int l0 = imax(s->layer0, d->layer0), l1 = imin(s->layer1, d->layer1);
  int h0 = imax(s->head0, d->head0), h1 = imin(s->head1, d->head1);
  if (h0 >= h1) l1 = l0; /* no K/V in common; the states tail still is */
  if (l0 < l1 && s->layout.int8 != d->layout.int8)
    return td_err(TD_ERR_INVALID, "KV re-slicing: %s K/V into a pool of %s K/V (only encoder states cross between "
                  "them)", s->layout.int8 ? "int8" : "bf16", d->layout.int8 ? "int8" : "bf16");
  /* A layer: [K|V][head] sub-slabs of [slot][head_dim], and for int8 (a
   * byte a value) then [K|V][head] runs of [slot] float scales. */
  const int bs = s->layout.block_size, dh = s->layout.head_dim, q8 = s->layout.int8;
  const uint64_t es = (uint64_t)s->elem_size;
  uint64_t unit[2] = {(uint64_t)bs * (uint64_t)dh * (q8 ? 1 : es), (uint64_t)bs * 4};
  uint64_t s_layer = (uint64_t)td_kv_layer_span(&s->layout, 1).off * es;
  uint64_t d_layer = (uint64_t)td_kv_layer_span(&d->layout, 1).off * es;
  int k = 0;
  for (int l = l0; l < l1; l++)
    for (int part = 0; part < (q8 ? 2 : 1); part++)
      for (int kv = 0; kv < 2; kv++) {
        uint64_t so = (uint64_t)(l - s->layer0) * s_layer + (part ? 2 * (uint64_t)s->layout.n_heads * unit[0] : 0) +
                      ((uint64_t)kv * (uint64_t)s->layout.n_heads + (uint64_t)(h0 - s->head0)) * unit[part];
        uint64_t dof = (uint64_t)(l - d->layer0) * d_layer + (part ? 2 * (uint64_t)d->layout.n_heads * unit[0] : 0) +
                       ((uint64_t)kv * (uint64_t)d->layout.n_heads + (uint64_t)(h0 - d->head0)) * unit[part];
        if (!slice_push(out, &k, cap, so, dof, (uint64_t)(h1 - h0) * unit[part]))
          return td_err(TD_ERR_INVALID, "KV re-slicing: more than %d slices", cap);
      }
  if (s->layout.states > 0) {
    uint64_t tail = (uint64_t)s->layout.block_size * (uint64_t)s->layout.states * (uint64_t)s->elem_size;
    if (!slice_push(out, &k, cap, td_kvx_block_bytes(s) - tail, td_kvx_block_bytes(d) - tail, tail))
      return td_err(TD_ERR_INVALID, "KV re-slicing: more than %d slices", cap);
  }
  *n = k;
  return TD_OK;
}

/* One block's slice plan, malloc'ed (NULL when it fails), after both
 * geometries are checked. */
static td_status block_slices(const td_kvx_geom *s, const td_kvx_geom *d, td_kvx_slice **sl, int *ns) {
  *sl = NULL;
  *ns = 0;
  TD_TRY(td_kvx_geom_check(s));
  TD_TRY(td_kvx_geom_check(d));
  /* At most 2 slices per layer (4 for int8: the scales), and the states tail. */
  int cap = (s->layout.int8 ? 4 : 2) * imin(s->layout.n_layers, d->layout.n_layers) + 1;
  if (!(*sl = malloc(sizeof **sl * (size_t)cap))) return td_err(TD_ERR_NOMEM, "out of memory");
  td_status st = td_kvx_slice_plan(s, d, *sl, cap, ns);
  if (st != TD_OK) {
    free(*sl);
    *sl = NULL;
    *ns = 0;
  }
  return st;
}

td_status td_kvx_plan_copies(const td_kvx_geom *s, const td_kvx_geom *d, const int32_t *src_blocks,
                             const int32_t *dst_blocks, int n_blocks, td_kvx_slice **out, int *n) {
  *out = NULL;
  *n = 0;
  if (n_blocks < 0 || (n_blocks > 0 && (!src_blocks || !dst_blocks)))
    return td_err(TD_ERR_INVALID, "KV transfer plan: %d blocks", n_blocks);
  td_kvx_slice *sl = NULL;
  int ns = 0;
  td_status st = block_slices(s, d, &sl, &ns);
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
      (void)slice_push(c, &k, n_blocks * ns, so, dof, sl[i].len); /* c holds a slice per block and piece */
    }
  }
  free(sl);
  *out = c;
  *n = k;
  return TD_OK;
}

td_status td_kvx_plan_bytes(const td_kvx_geom *s, const td_kvx_geom *d, int n_blocks, uint64_t *bytes) {
  *bytes = 0;
  if (n_blocks < 0) return td_err(TD_ERR_INVALID, "KV transfer plan: %d blocks", n_blocks);
  td_kvx_slice *sl = NULL;
  int ns = 0;
  td_status st = block_slices(s, d, &sl, &ns);
  uint64_t per = 0;
  for (int i = 0; i < ns && st == TD_OK; i++) per += sl[i].len;
  free(sl);
  if (st == TD_OK) *bytes = per * (uint64_t)n_blocks;
  return st;
}

/* ---- byte-stream chunking (declared in wire.h: internal) ---- */

bool kvx_chunking_valid(uint64_t first, uint64_t max) { return first > 0 && first <= max && max <= KVX_NCCL_MAX_CHUNK; }

uint64_t kvx_chunk_len(uint64_t total, uint64_t first, uint64_t max, uint64_t index, uint64_t done) {
  if (done >= total || first == 0 || max == 0) return 0;
  uint64_t left = total - done;
  uint64_t len = first;
  for (uint64_t i = 0; i < index && len < max; i++) len <<= 1; /* no overflow: len < max before */
  if (len > max) len = max;
  if (len >= left) return left;
  /* A small tail costs a whole NCCL operation: merge it when it fits. */
  if (left - len < first && left <= max) return left;
  return len;
}

int kvx_plan_count(const td_kvx_slice *items, int n_items, int ci, uint64_t coff, uint64_t len) {
  int n = 0;
  while (len > 0 && ci < n_items) {
    uint64_t l = items[ci].len - coff;
    if (l > len) l = len;
    len -= l;
    n++;
    ci++;
    coff = 0;
  }
  return n;
}

int kvx_plan_take(const td_kvx_slice *items, int n_items, int *ci, uint64_t *coff, uint64_t len, td_kvx_slice *out) {
  int n = 0;
  while (len > 0 && *ci < n_items) {
    const td_kvx_slice *it = &items[*ci];
    uint64_t l = it->len - *coff;
    if (l > len) l = len;
    out[n++] = (td_kvx_slice){it->src_off + *coff, it->dst_off + *coff, l};
    len -= l;
    *coff += l;
    if (*coff == it->len) {
      (*ci)++;
      *coff = 0;
    }
  }
  return n;
}

bool kvx_pieces_contiguous(const td_kvx_slice *pc, int n, bool src) {
  for (int i = 1; i < n; i++) {
    uint64_t prev = src ? pc[i - 1].src_off : pc[i - 1].dst_off, cur = src ? pc[i].src_off : pc[i].dst_off;
    if (prev + pc[i - 1].len != cur) return false;
  }
  return true;
}

uint64_t kvx_stage_chunk_cap(uint64_t issued, uint64_t total, uint64_t slot, uint64_t steady) {
  const uint64_t small = (uint64_t)256 << 10;
  uint64_t cap = steady > 0 && steady < slot ? steady : slot;
  uint64_t up = issued < small ? small : issued;
  if (up < cap) cap = up;
  /* Half of what is left: the chunks after it shrink too, so the copy
   * out of the last one is short. */
  uint64_t left = total > issued ? total - issued : 0;
  uint64_t down = left / 2 < small ? left : left / 2;
  if (down < cap) cap = down;
  return cap > 0 ? cap : small;
}
