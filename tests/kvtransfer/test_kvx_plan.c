/* Re-slicing plans: a rank's slices recombine into the full block. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "kvtransfer/kvtransfer.h"

static td_kvx_geom geom(int l0, int l1, int h0, int h1, int head_dim, int slots, int elem) {
  td_kvx_geom g = {{l1 - l0, h1 - h0, head_dim, slots}, elem, l0, l1, h0, h1};
  return g;
}

/* Byte offset of (layer, kv, head, slot, dim) in a block of g; layer and
 * head are model indices. */
static size_t ref_off(const td_kvx_geom *g, int layer, int kv, int head, int slot, int d) {
  size_t i = (((size_t)(layer - g->layer0) * 2 + (size_t)kv) * (size_t)g->layout.n_heads + (size_t)(head - g->head0));
  i = (i * (size_t)g->layout.block_size + (size_t)slot) * (size_t)g->layout.head_dim + (size_t)d;
  return i * (size_t)g->elem_size;
}

static void apply(const td_kvx_geom *s, const td_kvx_geom *d, const uint8_t *src, uint8_t *dst, uint8_t *cover) {
  td_kvx_slice sl[256];
  int n = -1;
  cr_assert_eq(td_kvx_slice_plan(s, d, sl, 256, &n), TD_OK, "%s", td_errmsg());
  for (int i = 0; i < n; i++) {
    cr_assert(sl[i].src_off + sl[i].len <= td_kvx_block_bytes(s));
    cr_assert(sl[i].dst_off + sl[i].len <= td_kvx_block_bytes(d));
    memcpy(dst + sl[i].dst_off, src + sl[i].src_off, sl[i].len);
    if (cover)
      for (uint64_t b = 0; b < sl[i].len; b++) cover[sl[i].dst_off + b]++;
  }
}

/* Extracts rank geometry r's view of a full block by element copies. */
static void expect_slice(const td_kvx_geom *full, const uint8_t *fb, const td_kvx_geom *r, uint8_t *out) {
  int e = r->elem_size;
  for (int l = r->layer0; l < r->layer1; l++)
    for (int kv = 0; kv < 2; kv++)
      for (int h = r->head0; h < r->head1; h++)
        for (int s = 0; s < r->layout.block_size; s++)
          for (int d = 0; d < r->layout.head_dim; d++)
            memcpy(out + ref_off(r, l, kv, h, s, d), fb + ref_off(full, l, kv, h, s, d), (size_t)e);
}

static uint8_t *random_block(size_t n, unsigned seed) {
  uint8_t *b = malloc(n);
  srand(seed);
  for (size_t i = 0; i < n; i++) b[i] = (uint8_t)rand();
  return b;
}

Test(kvx_plan, same_geometry_is_one_slice) {
  td_kvx_geom g = geom(0, 6, 0, 8, 64, 16, 2);
  td_kvx_slice sl[4];
  int n = 0;
  cr_assert_eq(td_kvx_slice_plan(&g, &g, sl, 4, &n), TD_OK);
  cr_assert_eq(n, 1);
  cr_assert_eq(sl[0].src_off, 0);
  cr_assert_eq(sl[0].dst_off, 0);
  cr_assert_eq(sl[0].len, td_kvx_block_bytes(&g));
  cr_assert_eq(td_kvx_block_bytes(&g), (size_t)6 * 2 * 8 * 16 * 64 * 2);
}

Test(kvx_plan, mismatch_and_disjoint) {
  td_kvx_geom a = geom(0, 4, 0, 4, 64, 16, 2), b = geom(0, 4, 0, 4, 64, 8, 2);
  td_kvx_slice sl[16];
  int n = 0;
  cr_assert_eq(td_kvx_slice_plan(&a, &b, sl, 16, &n), TD_ERR_INVALID);
  b = geom(0, 4, 0, 4, 32, 16, 2);
  cr_assert_eq(td_kvx_slice_plan(&a, &b, sl, 16, &n), TD_ERR_INVALID);
  b = geom(0, 4, 0, 4, 64, 16, 4);
  cr_assert_eq(td_kvx_slice_plan(&a, &b, sl, 16, &n), TD_ERR_INVALID);
  b = geom(4, 8, 0, 4, 64, 16, 2); /* other layers */
  cr_assert_eq(td_kvx_slice_plan(&a, &b, sl, 16, &n), TD_OK);
  cr_assert_eq(n, 0);
  b = geom(0, 4, 4, 8, 64, 16, 2); /* other heads */
  cr_assert_eq(td_kvx_slice_plan(&a, &b, sl, 16, &n), TD_OK);
  cr_assert_eq(n, 0);
  /* Inconsistent geometry: ranges do not match the layout. */
  td_kvx_geom bad = a;
  bad.layer1 = 5;
  cr_assert_eq(td_kvx_slice_plan(&a, &bad, sl, 16, &n), TD_ERR_INVALID);
  cr_assert_eq(td_kvx_block_bytes(&bad), 0);
  /* Too small an output. */
  b = geom(0, 4, 0, 2, 64, 16, 2);
  cr_assert_eq(td_kvx_slice_plan(&a, &b, sl, 3, &n), TD_ERR_INVALID);
}

Test(kvx_plan, tp_slices_are_per_layer_and_kv) {
  td_kvx_geom full = geom(0, 3, 0, 8, 16, 4, 2), half = geom(0, 3, 4, 8, 16, 4, 2);
  td_kvx_slice sl[16];
  int n = 0;
  cr_assert_eq(td_kvx_slice_plan(&full, &half, sl, 16, &n), TD_OK);
  cr_assert_eq(n, 6); /* 3 layers x K|V, 4 heads each */
  size_t unit = 4 * 16 * 2;
  for (int i = 0; i < n; i++) {
    cr_assert_eq(sl[i].len, 4 * unit);
    cr_assert_eq(sl[i].src_off, (size_t)i * 8 * unit + 4 * unit);
    cr_assert_eq(sl[i].dst_off, (size_t)i * 4 * unit);
  }
  /* PP only: the layer range is one contiguous slice. */
  td_kvx_geom pp = geom(1, 3, 0, 8, 16, 4, 2);
  cr_assert_eq(td_kvx_slice_plan(&full, &pp, sl, 16, &n), TD_OK);
  cr_assert_eq(n, 1);
  cr_assert_eq(sl[0].src_off, 2 * 8 * unit);
  cr_assert_eq(sl[0].dst_off, 0);
  cr_assert_eq(sl[0].len, 2 * 2 * 8 * unit);
}

/* A full sender feeds every rank of a TP x PP receiver; the ranks' blocks
 * recombine into the sender's block. */
Test(kvx_plan, full_sender_to_sharded_receivers) {
  const int L = 6, H = 8, D = 8, S = 4, E = 2;
  td_kvx_geom full = geom(0, L, 0, H, D, S, E);
  size_t fbytes = td_kvx_block_bytes(&full);
  uint8_t *src = random_block(fbytes, 7);
  int degrees[][2] = {{1, 1}, {1, 2}, {2, 1}, {2, 2}, {3, 4}, {2, 8}, {6, 1}};
  for (size_t t = 0; t < sizeof degrees / sizeof degrees[0]; t++) {
    int pp = degrees[t][0], tp = degrees[t][1];
    uint8_t *again = calloc(1, fbytes);
    uint8_t *cover = calloc(1, fbytes);
    for (int i = 0; i < pp; i++) {
      for (int j = 0; j < tp; j++) {
        td_kvx_geom r = geom(i * L / pp, (i + 1) * L / pp, j * H / tp, (j + 1) * H / tp, D, S, E);
        size_t rb = td_kvx_block_bytes(&r);
        uint8_t *got = calloc(1, rb), *want = calloc(1, rb);
        apply(&full, &r, src, got, NULL);
        expect_slice(&full, src, &r, want);
        cr_assert_eq(memcmp(got, want, rb), 0, "pp %d tp %d rank (%d, %d)", pp, tp, i, j);
        /* And back: the rank's block lands where it came from. */
        apply(&r, &full, got, again, cover);
        free(got);
        free(want);
      }
    }
    cr_assert_eq(memcmp(again, src, fbytes), 0, "pp %d tp %d: recombined block differs", pp, tp);
    for (size_t b = 0; b < fbytes; b++) cr_assert_eq(cover[b], 1, "byte %zu written %d times", b, cover[b]);
    free(again);
    free(cover);
  }
  free(src);
}

/* Sender and receiver sharded differently (TP 2 -> TP 4 x PP 2, PP 3 ->
 * PP 2): every receiver rank gets exactly its slice from the senders. */
Test(kvx_plan, sharded_to_differently_sharded) {
  const int L = 6, H = 8, D = 4, S = 2, E = 4;
  td_kvx_geom full = geom(0, L, 0, H, D, S, E);
  size_t fbytes = td_kvx_block_bytes(&full);
  uint8_t *model = random_block(fbytes, 11);
  int cases[][4] = {{1, 2, 2, 4}, {3, 1, 2, 1}, {2, 4, 3, 2}, {1, 8, 6, 1}};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    int spp = cases[c][0], stp = cases[c][1], rpp = cases[c][2], rtp = cases[c][3];
    for (int ri = 0; ri < rpp; ri++) {
      for (int rj = 0; rj < rtp; rj++) {
        td_kvx_geom r = geom(ri * L / rpp, (ri + 1) * L / rpp, rj * H / rtp, (rj + 1) * H / rtp, D, S, E);
        size_t rb = td_kvx_block_bytes(&r);
        uint8_t *got = calloc(1, rb), *want = calloc(1, rb), *cover = calloc(1, rb);
        for (int si = 0; si < spp; si++) {
          for (int sj = 0; sj < stp; sj++) {
            td_kvx_geom s = geom(si * L / spp, (si + 1) * L / spp, sj * H / stp, (sj + 1) * H / stp, D, S, E);
            uint8_t *sb = calloc(1, td_kvx_block_bytes(&s));
            expect_slice(&full, model, &s, sb);
            apply(&s, &r, sb, got, cover);
            free(sb);
          }
        }
        expect_slice(&full, model, &r, want);
        cr_assert_eq(memcmp(got, want, rb), 0, "case %zu rank (%d, %d)", c, ri, rj);
        for (size_t b = 0; b < rb; b++) cr_assert_eq(cover[b], 1, "case %zu byte %zu", c, b);
        free(got);
        free(want);
        free(cover);
      }
    }
  }
  free(model);
}

Test(kvx_plan, copies_coalesce_contiguous_runs) {
  td_kvx_geom g = geom(0, 2, 0, 2, 8, 4, 2);
  uint64_t bb = td_kvx_block_bytes(&g);
  int32_t src[] = {3, 4, 5, 9, 1}, dst[] = {10, 11, 12, 2, 3};
  td_kvx_slice *c = NULL;
  int n = 0;
  cr_assert_eq(td_kvx_plan_copies(&g, &g, src, dst, 5, &c, &n), TD_OK);
  cr_assert_eq(n, 3);
  cr_assert_eq(c[0].src_off, 3 * bb);
  cr_assert_eq(c[0].dst_off, 10 * bb);
  cr_assert_eq(c[0].len, 3 * bb);
  cr_assert_eq(c[1].src_off, 9 * bb);
  cr_assert_eq(c[1].dst_off, 2 * bb);
  cr_assert_eq(c[1].len, bb);
  cr_assert_eq(c[2].src_off, bb);
  cr_assert_eq(c[2].len, bb);
  free(c);
  /* Partial heads: one copy per layer and K|V per block, no merging across blocks. */
  td_kvx_geom h = geom(0, 2, 1, 2, 8, 4, 2);
  cr_assert_eq(td_kvx_plan_copies(&g, &h, src, dst, 5, &c, &n), TD_OK);
  cr_assert_eq(n, 5 * 4);
  free(c);
  /* PP receiver of the last layer: one copy per block. */
  td_kvx_geom p = geom(1, 2, 0, 2, 8, 4, 2);
  cr_assert_eq(td_kvx_plan_copies(&g, &p, src, dst, 5, &c, &n), TD_OK);
  cr_assert_eq(n, 5);
  free(c);
  /* Negative ids are refused. */
  int32_t badsrc[] = {-1};
  cr_assert_eq(td_kvx_plan_copies(&g, &g, badsrc, dst, 1, &c, &n), TD_ERR_INVALID);
  cr_assert_null(c);
}
