/* Re-slicing plans: a rank's slices recombine into the full block. Byte
 * stream chunking (NCCL, staged) and the gather kernel's piece tables. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "kvtransfer/gather.h"
#include "kvtransfer/kvtransfer.h"
#include "kvtransfer/wire.h"

static td_kvx_geom geom(int l0, int l1, int h0, int h1, int head_dim, int slots, int elem) {
  td_kvx_geom g = {{l1 - l0, h1 - h0, head_dim, slots, 0, 0}, elem, l0, l1, h0, h1};
  return g;
}

static td_kvx_geom with_states(td_kvx_geom g, int states) {
  g.layout.states = states;
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

/* The states tail: every rank's whole, after its K/V slices; a pool of
 * states only (no layers) is the tail alone; the widths must agree. */
Test(kvx_plan, states_tail_is_every_ranks) {
  const int L = 3, H = 4, D = 8, S = 4, E = 2, W = 6;
  td_kvx_geom full = with_states(geom(0, L, 0, H, D, S, E), W);
  size_t fbytes = td_kvx_block_bytes(&full), tail = (size_t)S * W * E;
  cr_assert_eq(fbytes, (size_t)L * 2 * H * S * D * E + tail);
  uint8_t *src = random_block(fbytes, 11);
  for (int tp = 1; tp <= 4; tp *= 2)
    for (int pp = 1; pp <= 3; pp += 2)
      for (int i = 0; i < pp; i++)
        for (int j = 0; j < tp; j++) {
          td_kvx_geom r = with_states(geom(i * L / pp, (i + 1) * L / pp, j * H / tp, (j + 1) * H / tp, D, S, E), W);
          size_t rb = td_kvx_block_bytes(&r);
          uint8_t *got = calloc(1, rb), *want = calloc(1, rb);
          apply(&full, &r, src, got, NULL);
          expect_slice(&full, src, &r, want);
          memcpy(want + rb - tail, src + fbytes - tail, tail);
          cr_assert_eq(memcmp(got, want, rb), 0, "tp %d pp %d rank (%d, %d)", tp, pp, i, j);
          free(got);
          free(want);
        }
  /* states only: the tail, one slice, from the full block's end */
  td_kvx_geom so = with_states(geom(0, 0, 0, H, D, S, E), W);
  td_kvx_slice sl[8];
  int n = 0;
  cr_assert_eq(td_kvx_block_bytes(&so), tail);
  cr_assert_eq(td_kvx_slice_plan(&full, &so, sl, 8, &n), TD_OK, "%s", td_errmsg());
  cr_assert_eq(n, 1);
  cr_assert_eq(sl[0].src_off, fbytes - tail);
  cr_assert_eq(sl[0].dst_off, 0);
  cr_assert_eq(sl[0].len, tail);
  /* other layers and heads still share the tail */
  td_kvx_geom other = with_states(geom(L, L + 2, H, 2 * H, D, S, E), W);
  cr_assert_eq(td_kvx_slice_plan(&full, &other, sl, 8, &n), TD_OK);
  cr_assert_eq(n, 1);
  /* a different width, an odd one, or a layout with neither */
  td_kvx_geom w2 = with_states(full, W + 2);
  cr_assert_eq(td_kvx_slice_plan(&full, &w2, sl, 8, &n), TD_ERR_INVALID);
  cr_assert_eq(td_kvx_block_bytes(&(td_kvx_geom){with_states(full, W + 1).layout, E, 0, L, 0, H}), 0);
  cr_assert_eq(td_kvx_block_bytes(&(td_kvx_geom){geom(0, 0, 0, H, D, S, E).layout, E, 0, 0, 0, H}), 0);
  free(src);
}

/* Byte offset of value (layer, kv, head, slot, d) of an int8 block of g, or
 * with d < 0 of that row's float scale (td_kv_layout.int8). */
static size_t ref_off8(const td_kvx_geom *g, int layer, int kv, int head, int slot, int d) {
  size_t H = (size_t)g->layout.n_heads, S = (size_t)g->layout.block_size, D = (size_t)g->layout.head_dim;
  size_t layer_bytes = 2 * H * S * (D + 4), row = ((size_t)kv * H + (size_t)(head - g->head0)) * S + (size_t)slot;
  return (size_t)(layer - g->layer0) * layer_bytes + (d >= 0 ? row * D + (size_t)d : 2 * H * S * D + row * 4);
}

/* int8 K/V (values a byte, then a float scale a row): the tail of encoder
 * states lands at an int8 block's end from a states-only sender or a bf16
 * block; int8 ranks re-slice into int8 ranks value for value and scale for
 * scale; bf16 K/V into int8 K/V (or back) is refused, naming both. */
Test(kvx_plan, int8_layouts) {
  const int L = 3, H = 4, D = 16, S = 4, W = 8;
  td_kvx_geom full8 = with_states(geom(0, L, 0, H, D, S, 2), W), bf = full8;
  full8.layout.int8 = 1;
  size_t fb = td_kvx_block_bytes(&full8), tail = (size_t)S * W * 2;
  cr_assert_eq(fb, (size_t)L * 2 * H * S * (D + 4) + tail);
  td_kvx_slice sl[64];
  int n = 0;
  /* states only, or a bf16 block's tail, into an int8 block: the tail alone */
  td_kvx_geom so = with_states(geom(0, 0, 0, H, D, S, 2), W);
  cr_assert_eq(td_kvx_slice_plan(&so, &full8, sl, 64, &n), TD_OK, "%s", td_errmsg());
  cr_assert_eq(n, 1);
  cr_assert_eq(sl[0].src_off, 0);
  cr_assert_eq(sl[0].dst_off, fb - tail);
  cr_assert_eq(sl[0].len, tail);
  td_kvx_geom other = with_states(geom(L, L + 1, 0, H, D, S, 2), W); /* bf16, no layer in common */
  cr_assert_eq(td_kvx_slice_plan(&other, &full8, sl, 64, &n), TD_OK, "%s", td_errmsg());
  cr_assert_eq(n, 1);
  cr_assert_eq(sl[0].dst_off, fb - tail);
  /* K/V in common with another dtype */
  cr_assert_eq(td_kvx_slice_plan(&bf, &full8, sl, 64, &n), TD_ERR_INVALID);
  cr_assert(strstr(td_errmsg(), "bf16 K/V into a pool of int8"), "%s", td_errmsg());
  cr_assert_eq(td_kvx_slice_plan(&full8, &bf, sl, 64, &n), TD_ERR_INVALID);
  /* the same geometry: one slice; int8 ranks: every value and scale where it belongs */
  cr_assert_eq(td_kvx_slice_plan(&full8, &full8, sl, 64, &n), TD_OK);
  cr_assert_eq(n, 1);
  cr_assert_eq(sl[0].len, fb);
  uint8_t *src = random_block(fb, 5);
  for (int tp = 1; tp <= 4; tp *= 2)
    for (int pp = 1; pp <= 3; pp += 2)
      for (int i = 0; i < pp; i++)
        for (int j = 0; j < tp; j++) {
          td_kvx_geom r = with_states(geom(i * L / pp, (i + 1) * L / pp, j * H / tp, (j + 1) * H / tp, D, S, 2), W);
          r.layout.int8 = 1;
          size_t rb = td_kvx_block_bytes(&r);
          uint8_t *got = calloc(1, rb), *want = calloc(1, rb);
          apply(&full8, &r, src, got, NULL);
          for (int l = r.layer0; l < r.layer1; l++)
            for (int kv = 0; kv < 2; kv++)
              for (int h = r.head0; h < r.head1; h++)
                for (int t = 0; t < S; t++) {
                  for (int d = 0; d < D; d++) want[ref_off8(&r, l, kv, h, t, d)] = src[ref_off8(&full8, l, kv, h, t, d)];
                  memcpy(want + ref_off8(&r, l, kv, h, t, -1), src + ref_off8(&full8, l, kv, h, t, -1), 4);
                }
          memcpy(want + rb - tail, src + fb - tail, tail);
          cr_assert_eq(memcmp(got, want, rb), 0, "tp %d pp %d rank (%d, %d)", tp, pp, i, j);
          free(got);
          free(want);
        }
  free(src);
  /* int8 needs the GPU's 2-byte elements */
  td_kvx_geom cpu = full8;
  cpu.elem_size = 4;
  cr_assert_eq(td_kvx_block_bytes(&cpu), 0);
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

/* td_kvx_plan_bytes: the bytes of td_kvx_plan_copies without the plan, for
 * every geometry pair of the sharding cases (states tail included), and 0
 * for pools that share nothing. */
Test(kvx_plan, plan_bytes_match_the_copies) {
  const int L = 6, H = 8, D = 4, S = 2, E = 4;
  int32_t src[37], dst[37];
  for (int i = 0; i < 37; i++) src[i] = (i * 5) % 41, dst[i] = 40 - i;
  int cases[][4] = {{1, 1, 1, 1}, {1, 2, 2, 4}, {3, 1, 2, 1}, {2, 4, 3, 2}, {1, 8, 6, 1}};
  for (int states = 0; states <= 8; states += 8)
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
      for (int ri = 0; ri < cases[c][2]; ri++)
        for (int rj = 0; rj < cases[c][3]; rj++) {
          int spp = cases[c][0], stp = cases[c][1], rpp = cases[c][2], rtp = cases[c][3];
          td_kvx_geom s = geom(0, L / spp, 0, H / stp, D, S, E), r = geom(ri * L / rpp, (ri + 1) * L / rpp,
                                                                          rj * H / rtp, (rj + 1) * H / rtp, D, S, E);
          s.layout.states = r.layout.states = states;
          td_kvx_slice *cp = NULL;
          int n = 0;
          cr_assert_eq(td_kvx_plan_copies(&s, &r, src, dst, 37, &cp, &n), TD_OK, "%s", td_errmsg());
          uint64_t want = 0, got = 1;
          for (int i = 0; i < n; i++) want += cp[i].len;
          free(cp);
          cr_assert_eq(td_kvx_plan_bytes(&s, &r, 37, &got), TD_OK, "%s", td_errmsg());
          cr_assert_eq(got, want, "case %zu rank (%d, %d) states %d: %llu against %llu", c, ri, rj, states,
                       (unsigned long long)got, (unsigned long long)want);
        }
  uint64_t b = 1;
  td_kvx_geom a = geom(0, 2, 0, 8, D, S, E), z = geom(2, 4, 0, 8, D, S, E);
  cr_assert_eq(td_kvx_plan_bytes(&a, &z, 5, &b), TD_OK);
  cr_assert_eq(b, 0);
  cr_assert_eq(td_kvx_plan_bytes(&a, &a, -1, &b), TD_ERR_INVALID);
}

/* ---- byte-stream chunking ---- */

static uint64_t nominal_len(uint64_t first, uint64_t max, uint64_t i) {
  uint64_t l = first;
  while (i-- > 0 && l < max) l *= 2;
  return l < max ? l : max;
}

static uint64_t rnd64(uint64_t *x) {
  *x ^= *x << 13;
  *x ^= *x >> 7;
  *x ^= *x << 17;
  return *x;
}

/* Chunks cover the stream exactly, stay within max, start at first and
 * double, and depend on nothing but (total, first, max). */
Test(kvx_plan, nccl_chunks_cover_the_stream) {
  uint64_t seed = 7;
  for (int t = 0; t < 20000; t++) {
    uint64_t max = 1 + rnd64(&seed) % KVX_NCCL_MAX_CHUNK, first = 1 + rnd64(&seed) % max;
    if (t % 5 == 1) first = max = KVX_NCCL_MAX_CHUNK; /* the largest: no shift overflows */
    uint64_t big = (uint64_t)300 << 20 < 5000 * max ? (uint64_t)300 << 20 : 5000 * max;
    uint64_t total = t % 3 == 0 ? rnd64(&seed) % (64 * max + 1) : rnd64(&seed) % big;
    if (t < 64) { /* edges */
      total = (uint64_t)t;
      first = 1 + (uint64_t)t % 3;
      max = 4;
    }
    cr_assert(kvx_chunking_valid(first, max));
    uint64_t done = 0, i = 0;
    for (;; i++) {
      uint64_t len = kvx_chunk_len(total, first, max, i, done);
      if (len == 0) break;
      cr_assert_eq(len, kvx_chunk_len(total, first, max, i, done)); /* both sides get the same */
      cr_assert_leq(len, max, "chunk %" PRIu64 ": %" PRIu64 " > max %" PRIu64, i, len, max);
      uint64_t nominal = nominal_len(first, max, i);
      bool last = done + len == total;
      if (!last) cr_assert_eq(len, nominal, "chunk %" PRIu64 " of %" PRIu64 " (%" PRIu64 "/%" PRIu64 ")", i, total, first, max);
      else cr_assert(len <= nominal || total - done < nominal + first, "tail chunk %" PRIu64, len);
      /* A tail smaller than first never stands alone when it could merge. */
      if (last && i > 0) {
        uint64_t prev = nominal_len(first, max, i - 1);
        cr_assert(len >= first || len + prev > max, "tail of %" PRIu64 " after %" PRIu64, len, prev);
      }
      done += len;
      cr_assert(i < 100000);
    }
    cr_assert_eq(done, total);
    cr_assert_eq(kvx_chunk_len(total, first, max, i + 1, done), 0);
  }
  cr_assert(!kvx_chunking_valid(0, 4));
  cr_assert(!kvx_chunking_valid(8, 4));
  cr_assert(!kvx_chunking_valid(4, KVX_NCCL_MAX_CHUNK + 1));
  cr_assert(kvx_chunking_valid(KVX_NCCL_MAX_CHUNK, KVX_NCCL_MAX_CHUNK));
  /* The defaults: 2 MiB, 4 MiB, 8 MiB, 8 MiB ... */
  uint64_t m = (uint64_t)8 << 20;
  cr_assert_eq(kvx_chunk_len((uint64_t)64 << 20, m / 4, m, 0, 0), m / 4);
  cr_assert_eq(kvx_chunk_len((uint64_t)64 << 20, m / 4, m, 1, m / 4), m / 2);
  cr_assert_eq(kvx_chunk_len((uint64_t)64 << 20, m / 4, m, 5, (uint64_t)30 << 20), m);
}

/* Chunks cut over a transfer plan: the pieces of consecutive chunks,
 * concatenated, are the plan's byte stream; a side's pieces of a chunk are
 * contiguous exactly when its offsets follow each other. */
Test(kvx_plan, chunks_over_a_plan) {
  td_kvx_geom s = geom(0, 4, 0, 8, 16, 4, 2), d = geom(1, 3, 2, 6, 16, 4, 2);
  int32_t src[40], dst[40];
  for (int i = 0; i < 40; i++) {
    src[i] = i;
    dst[i] = (i * 7 + 3) % 41;
  }
  td_kvx_slice *items = NULL;
  int n = 0;
  cr_assert_eq(td_kvx_plan_copies(&s, &d, src, dst, 40, &items, &n), TD_OK);
  uint64_t total = 0;
  for (int i = 0; i < n; i++) total += items[i].len;
  uint64_t firsts[] = {1, 100, 512, 4096}, maxes[] = {1, 3000, 4096, 1 << 20};
  for (int a = 0; a < 4; a++)
    for (int b = 0; b < 4; b++) {
      if (firsts[a] > maxes[b]) continue;
      int ci = 0, item = 0;
      uint64_t coff = 0, done = 0, in_item = 0;
      for (uint64_t c = 0;; c++) {
        uint64_t len = kvx_chunk_len(total, firsts[a], maxes[b], c, done);
        if (!len) break;
        int cnt = kvx_plan_count(items, n, ci, coff, len);
        td_kvx_slice *pc = malloc(sizeof *pc * (size_t)cnt);
        int got = kvx_plan_take(items, n, &ci, &coff, len, pc);
        cr_assert_eq(got, cnt);
        uint64_t sum = 0;
        for (int i = 0; i < got; i++) {
          /* Piece i continues the plan where the previous one stopped. */
          cr_assert_lt(item, n);
          cr_assert_eq(pc[i].src_off, items[item].src_off + in_item);
          cr_assert_eq(pc[i].dst_off, items[item].dst_off + in_item);
          in_item += pc[i].len;
          if (in_item == items[item].len) {
            item++;
            in_item = 0;
          }
          sum += pc[i].len;
        }
        cr_assert_eq(sum, len);
        bool cs = true, cd = true;
        for (int i = 1; i < got; i++) {
          cs &= pc[i - 1].src_off + pc[i - 1].len == pc[i].src_off;
          cd &= pc[i - 1].dst_off + pc[i - 1].len == pc[i].dst_off;
        }
        cr_assert_eq(kvx_pieces_contiguous(pc, got, true), cs);
        cr_assert_eq(kvx_pieces_contiguous(pc, got, false), cd);
        free(pc);
        done += len;
      }
      cr_assert_eq(done, total);
      cr_assert_eq(ci, n);
      cr_assert_eq(item, n);
    }
  free(items);
}

/* Staged chunks: 256 KiB first, doubling up to the steady size (never
 * above the slot), shrinking again at the end so the last host-to-device
 * copy is short. */
Test(kvx_plan, staged_chunks_ramp_up_and_down) {
  uint64_t slot = (uint64_t)4 << 20, k256 = (uint64_t)256 << 10;
  uint64_t totals[] = {1, 100000, (uint64_t)1 << 20, (uint64_t)16 << 20, ((uint64_t)16 << 20) + 12345,
                       (uint64_t)256 << 20};
  uint64_t steadies[] = {0, (uint64_t)1 << 20, (uint64_t)3 << 20, (uint64_t)8 << 20};
  for (int sv = 0; sv < 4; sv++)
    for (int t = 0; t < 6; t++) {
      uint64_t total = totals[t], issued = 0, last = 0, steady = steadies[sv], top = 0;
      uint64_t bound = steady > 0 && steady < slot ? steady : slot;
      int n = 0;
      while (issued < total) {
        uint64_t cap = kvx_stage_chunk_cap(issued, total, slot, steady);
        cr_assert_gt(cap, 0);
        cr_assert_leq(cap, bound);
        if (issued == 0) cr_assert_leq(cap, k256);
        last = total - issued < cap ? total - issued : cap;
        top = last > top ? last : top;
        issued += last;
        n++;
        cr_assert_lt(n, 10000);
      }
      cr_assert_leq(last, 2 * k256, "total %" PRIu64 ": last chunk %" PRIu64, total, last);
      if (total >= (uint64_t)64 << 20) cr_assert_eq(top, bound, "a long transfer reaches the steady size");
    }
  /* Small slots bound everything. */
  cr_assert_eq(kvx_stage_chunk_cap((uint64_t)1 << 20, (uint64_t)64 << 20, 40 << 10, 0), 40 << 10);
  cr_assert_eq(kvx_stage_chunk_cap((uint64_t)8 << 20, (uint64_t)64 << 20, slot, (uint64_t)1 << 20),
               (uint64_t)1 << 20);
}

/* ---- the gather kernel's piece tables, run by the CPU reference ---- */

static void gather_case(uint64_t seed, int n, size_t max_len, bool aligned) {
  size_t cap = 0, nonzero = 0;
  size_t *len = malloc(sizeof *len * (size_t)n), *so = malloc(sizeof *so * (size_t)n), *dof = malloc(sizeof *dof * (size_t)n);
  for (int i = 0; i < n; i++) {
    len[i] = i % 17 == 5 ? 0 : 1 + rnd64(&seed) % max_len;
    if (i % 50 == 7) len[i] = 3 * KVX_GATHER_TILE + 5; /* a few long ones */
    cap += len[i] + 64;
    nonzero += len[i] > 0;
  }
  uint8_t *src = malloc(cap), *dst = malloc(cap), *want = malloc(cap);
  for (size_t i = 0; i < cap; i++) src[i] = (uint8_t)rnd64(&seed);
  memset(dst, 0xA5, cap);
  memcpy(want, dst, cap);
  /* Pieces in a shuffled order, disjoint on both sides, odd offsets. */
  size_t a = 0, b = 0;
  for (int i = 0; i < n; i++) {
    size_t ga = aligned ? 0 : rnd64(&seed) % 17, gb = aligned ? 0 : rnd64(&seed) % 23;
    so[i] = a + ga;
    dof[n - 1 - i] = b + gb;
    a += ga + len[i] + (aligned ? (16 - len[i] % 16) % 16 : 0);
    b += gb + len[n - 1 - i] + (aligned ? (16 - len[n - 1 - i] % 16) % 16 : 0);
  }
  void **d = malloc(sizeof(void *) * (size_t)n);
  const void **s = malloc(sizeof(void *) * (size_t)n);
  for (int i = 0; i < n; i++) {
    d[i] = dst + dof[i];
    s[i] = src + so[i];
    memcpy(want + dof[i], src + so[i], len[i]);
  }
  kvx_gtable *t = malloc(sizeof *t);
  size_t i = 0, off = 0;
  int tables = 0;
  uint32_t got;
  while ((got = kvx_gtable_fill(t, d, s, len, (size_t)n, &i, &off)) > 0) {
    cr_assert_leq(got, KVX_GATHER_PIECES);
    uint64_t tiles = 0;
    for (uint32_t k = 0; k < got; k++) {
      cr_assert_gt(t->p[k].len, 0);
      cr_assert_eq(t->p[k].tile0, tiles);
      tiles += (t->p[k].len + KVX_GATHER_TILE - 1) / KVX_GATHER_TILE;
    }
    cr_assert_eq(t->tiles, tiles);
    /* Every tile finds the piece that holds it. */
    for (uint32_t tile = 0; tile < t->tiles; tile += 1 + tile / 7) {
      uint32_t k = kvx_gtable_find(t->p, t->n, tile);
      cr_assert_leq(t->p[k].tile0, tile);
      cr_assert(k + 1 == t->n || t->p[k + 1].tile0 > tile);
    }
    kvx_gtable_run_cpu(t);
    tables++;
  }
  cr_assert_eq((size_t)tables, (nonzero + KVX_GATHER_PIECES - 1) / KVX_GATHER_PIECES);
  cr_assert_eq(memcmp(dst, want, cap), 0, "seed %" PRIu64 ": gathered bytes differ", seed);
  free(t);
  free(d);
  free(s);
  free(src);
  free(dst);
  free(want);
  free(len);
  free(so);
  free(dof);
}

Test(kvx_plan, gather_tables_match_memcpy) {
  gather_case(1, 1, 100, false);
  gather_case(2, 37, 5000, false);           /* odd sizes, unaligned offsets */
  gather_case(3, 2500, 300, false);          /* many small pieces: three tables */
  gather_case(4, 200, 3 * KVX_GATHER_TILE, true); /* aligned, several tiles each */
  gather_case(5, KVX_GATHER_PIECES, 64, false);   /* exactly one full table */
}
