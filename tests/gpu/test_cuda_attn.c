/* The CUDA attention against the CPU reference: dense, the paged pools'
 * writes and copies, paged (every decode kernel and the tiled one), over
 * encoder states (every kernel, split and warp count) (cuda_test.h). */
#include <limits.h>

#include "cuda_test.h"

/* ---------------------------------------------------------------- dense attention */

/* Query rows [lo, hi) (hi < 0: every row) against the CPU's: a row-split
 * encoder rank computes its rows only, over every key of their sequence;
 * the rows outside are not compared (a backend may compute whole tiles). */
static void dense_rows(int H, int dh, const int *lens, int ns, bool causal, int md, float scale, int lo, int hi) {
  int32_t *cu = malloc(sizeof(int32_t) * (ns + 1));
  cu[0] = 0;
  int max_len = 0;
  for (int s = 0; s < ns; s++) {
    cu[s + 1] = cu[s] + lens[s];
    max_len = lens[s] > max_len ? lens[s] : max_len;
  }
  int T = cu[ns];
  if (hi < 0) hi = T;
  size_t nq = (size_t)T * 3 * H * dh;
  float *qkv = rnd(nq, 2.0f), *lut = md ? rnd((size_t)H * (2 * md + 1), 3.0f) : NULL;
  pair Q = mk(TD_BUF_ACT, qkv, nq), O = mk(TD_BUF_ACT, NULL, (size_t)T * H * dh), CU = mk(TD_BUF_I32, cu, ns + 1);
  pair L = {0};
  if (md) L = mk(TD_BUF_F32, lut, (size_t)H * (2 * md + 1));
  td_relbias bg = {md ? L.g : NULL, md}, bc = {md ? L.c : NULL, md};
  RUN2(td_attn_dense_rows(G, Q.g, O.g, CU.g, ns, T, max_len, H, dh, scale, causal, md ? &bg : NULL, lo, hi),
       td_attn_dense_rows(C, Q.c, O.c, CU.c, ns, T, max_len, H, dh, scale, causal, md ? &bc : NULL, lo, hi));
  float *o = get(G, &O, true), *r = get(C, &O, false);
  size_t w = (size_t)H * dh;
  double e = relerr(o + (size_t)lo * w, r + (size_t)lo * w, (size_t)(hi - lo) * w);
  cr_expect(e <= TOL, "attn_dense rows [%d, %d) of %d, H=%d dh=%d seqs=%d causal=%d md=%d: error %.3g", lo, hi, T, H,
            dh, ns, causal, md, e);
  free(o);
  free(r);
  drop(&Q);
  drop(&O);
  drop(&CU);
  if (md) drop(&L);
  free(qkv);
  free(lut);
  free(cu);
}

static void dense_case(int H, int dh, const int *lens, int ns, bool causal, int md, float scale) {
  dense_rows(H, dh, lens, ns, causal, md, scale, 0, -1);
}

Test(cuda, attn_dense) {
  int a[] = {512, 1, 200, 77}, b[] = {65, 130, 3}, c[] = {1000}, d[] = {5, 33}, e[] = {7, 1, 12}, f[] = {64, 64, 64},
      g[] = {129, 17, 300, 2, 63};
  dense_case(16, 64, a, 4, false, 128, 1.0f);
  dense_case(4, 128, b, 3, true, 0, 1.0f / sqrtf(128.0f));
  dense_case(3, 64, c, 1, true, 20, 1.0f);
  dense_case(4, 16, d, 2, false, 128, 1.0f);
  dense_case(3, 10, e, 3, true, 0, 0.3f);
  dense_case(2, 128, f, 3, false, 0, 0.125f);
  dense_case(5, 64, g, 5, false, 0, 0.125f);
  dense_case(5, 128, g, 5, true, 2000, 1.0f); /* LUT larger than the shared-memory copy */
  dense_case(2, 48, g, 5, false, 10, 0.2f);
}

/* query-row ranges: inside one sequence, straddling a tile, across sequences */
Test(cuda, attn_dense_query_rows) {
  int one[] = {1500}, many[] = {129, 17, 300, 2, 63}, odd[] = {333};
  dense_rows(20, 64, one, 1, false, 0, 0.125f, 0, 768);
  dense_rows(20, 64, one, 1, false, 0, 0.125f, 768, 1500);
  dense_rows(10, 64, one, 1, false, 0, 0.125f, 750, 1500); /* a tile straddles the start */
  dense_rows(4, 64, many, 5, false, 40, 0.125f, 100, 400); /* across sequences, T5 bias */
  dense_rows(3, 128, odd, 1, false, 0, 0.125f, 111, 222);
  dense_rows(2, 48, many, 5, false, 0, 0.125f, 150, 511); /* the generic kernel */
}

/* head_dim 64 on each of its kernels: pipelined wgmma by the grid
 * (default, and with either one-wave form named), two and one block an SM, unpipelined wgmma, pipelined
 * with a block's keys in two halves, mma.sync with 128 and with 64 query rows a block
 * (td_cuda_tuning.dense64_warps 0, 0 with dense64_wave 2 and 5, 1, 2, 3, 5, 8, 4); bias in shared memory,
 * in global memory, none; one to many key tiles (odd and even counts), a row range. */
static const int dense64_forms[][2] = {{0, 0}, {0, 2}, {0, 5}, {1, 0}, {2, 0}, {3, 0}, {5, 0}, {8, 0}, {4, 0}};
#define N_DENSE64_FORMS (int)(sizeof dense64_forms / sizeof dense64_forms[0])
Test(cuda, attn_dense_head64_kernels) {
  int a[] = {512, 1, 200, 77}, c[] = {1000}, g[] = {129, 17, 300, 2, 63}, h[] = {64, 65, 191}, one[] = {1500},
      tiles[] = {128, 192, 257, 320, 1};
  for (int m = 0; m < N_DENSE64_FORMS; m++) {
    td_cuda_tuning t = cuda_base;
    t.dense64_warps = dense64_forms[m][0];
    t.dense64_wave = dense64_forms[m][1];
    use_tuning(&t);
    dense_case(16, 64, a, 4, false, 128, 0.125f);
    dense_case(3, 64, c, 1, true, 20, 1.0f);
    dense_case(5, 64, g, 5, true, 2000, 1.0f); /* LUT read from global memory */
    dense_case(2, 64, h, 3, true, 0, 0.125f);
    dense_case(4, 64, h, 3, false, 7, 1.0f);
    dense_case(3, 64, tiles, 5, false, 0, 0.125f);
    dense_case(3, 64, tiles, 5, true, 30, 0.5f);
    dense_rows(10, 64, one, 1, false, 0, 0.125f, 750, 1500);
  }
  use_tuning(&cuda_base);
}

/* Key splits merged by the last block (td_cuda_tuning.dense_splits 2-5 forced;
 * causal prefill never splits), on every head-64 kernel and head 128, the
 * T5 bias, a row range. */
Test(cuda, attn_dense_key_splits) {
  int a[] = {512, 1, 200, 77}, c[] = {1000}, g[] = {129, 17, 300, 2, 63}, one[] = {1500};
  const int splits[] = {2, 3, 5};
  for (int m = 0; m < N_DENSE64_FORMS; m++)
    for (int k = 0; k < 3; k++) {
      td_cuda_tuning t = cuda_base;
      t.dense64_warps = dense64_forms[m][0];
      t.dense64_wave = dense64_forms[m][1];
      t.dense_splits = splits[k];
      use_tuning(&t);
      dense_case(16, 64, a, 4, false, 128, 0.125f);
      dense_case(3, 64, c, 1, false, 20, 1.0f);
      dense_case(5, 128, g, 5, false, 2000, 1.0f);
      dense_case(3, 64, c, 1, true, 0, 1.0f);
      dense_rows(10, 64, one, 1, false, 0, 0.125f, 750, 1500);
    }
  use_tuning(&cuda_base);
}

/* ---------------------------------------------------------------- paged KV */
Test(cuda, kv_write_copy_read) {
  static const int cfg[][4] = {{64, 16, 16, 37}, {128, 4, 32, 5}, {10, 3, 5, 23}, {64, 2, 7, 1}};
  for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
    int dh = cfg[c][0], H = cfg[c][1], bs = cfg[c][2], n = cfg[c][3], nb = 9;
    paged_rig r;
    int states = c % 2 ? 0 : 2 * dh; /* a states tail after the 3 layers */
    rig_pool(&r, 3, H, dh, bs, states, nb);
    int ld = 3 * H * dh;
    float *rows = rnd((size_t)n * ld, 1.0f);
    pair R = mk(TD_BUF_ACT, rows, (size_t)n * ld);
    /* distinct slots, some rows skipped */
    int total = nb * bs;
    int32_t *perm = malloc(sizeof(int32_t) * total), *slots = malloc(sizeof(int32_t) * n);
    for (int i = 0; i < total; i++) perm[i] = i;
    for (int i = total - 1; i > 0; i--) {
      int j = irand(i + 1), t = perm[i];
      perm[i] = perm[j];
      perm[j] = t;
    }
    for (int i = 0; i < n; i++) slots[i] = i % 5 == 3 ? -1 : perm[i % total];
    pair S = mk(TD_BUF_I32, slots, n);
    size_t eg = td_buf_elem_size(G, TD_BUF_ACT), ec = td_buf_elem_size(C, TD_BUF_ACT);
    const char *kg = (const char *)R.g + (size_t)H * dh * eg, *kc = (const char *)R.c + (size_t)H * dh * ec;
    RUN2(td_kv_write(G, kg, kg + (size_t)H * dh * eg, ld, r.pool.g, &r.l, 1, S.g, n),
         td_kv_write(C, kc, kc + (size_t)H * dh * ec, ld, r.pool.c, &r.l, 1, S.c, n));
    if (states) /* layer 3: the tail, each row's two halves */
      RUN2(td_kv_write(G, R.g, (const char *)R.g + (size_t)(states / 2) * eg, ld, r.pool.g, &r.l, 3, S.g, n),
           td_kv_write(C, R.c, (const char *)R.c + (size_t)(states / 2) * ec, ld, r.pool.c, &r.l, 3, S.c, n));
    double e = compare(&r.pool, 0);
    cr_expect(e == 0.0, "kv_write dh=%d H=%d bs=%d n=%d states=%d: error %.3g", dh, H, bs, n, states, e);
    int32_t pairs[6] = {0, 5, 3, 1, 7, 8};
    RUN2(td_kv_copy_blocks(G, r.pool.g, &r.l, pairs, 3), td_kv_copy_blocks(C, r.pool.c, &r.l, pairs, 3));
    e = compare(&r.pool, 0);
    cr_expect(e == 0.0, "kv_copy_blocks: error %.3g", e);
    /* td_kv_read, the inverse (a states push projected on arrival reads the tail) */
    float *outh = rnd((size_t)n * ld, 1.0f);
    pair O = mk(TD_BUF_ACT, outh, (size_t)n * ld);
    const char *og = (const char *)O.g, *oc = (const char *)O.c;
    RUN2(td_kv_read(G, r.pool.g, &r.l, 1, S.g, n, (void *)og, (void *)(og + (size_t)H * dh * eg), ld),
         td_kv_read(C, r.pool.c, &r.l, 1, S.c, n, (void *)oc, (void *)(oc + (size_t)H * dh * ec), ld));
    if (states)
      RUN2(td_kv_read(G, r.pool.g, &r.l, 3, S.g, n, (void *)(og + (size_t)2 * H * dh * eg),
                      (void *)(og + ((size_t)2 * H * dh + (size_t)states / 2) * eg), ld),
           td_kv_read(C, r.pool.c, &r.l, 3, S.c, n, (void *)(oc + (size_t)2 * H * dh * ec),
                      (void *)(oc + ((size_t)2 * H * dh + (size_t)states / 2) * ec), ld));
    e = compare(&O, 0);
    cr_expect(e == 0.0, "kv_read dh=%d H=%d bs=%d n=%d states=%d: error %.3g", dh, H, bs, n, states, e);
    drop(&O);
    free(outh);
    drop(&R);
    drop(&S);
    rig_drop(&r);
    free(rows);
    free(perm);
    free(slots);
  }
}

/* td_kv_write_layers: layers 0-2 at once from one matrix's columns (layer j's
 * K at column j * lcols, its V hd further), on the GPU in one launch, on the
 * CPU a layer at a time; odd sizes take the scalar kernel, a states tail
 * stays as it was. */
Test(cuda, kv_write_layers) {
  static const int cfg[][4] = {{64, 16, 16, 37}, {128, 4, 32, 5}, {10, 3, 5, 23}, {64, 2, 7, 1}};
  for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
    int dh = cfg[c][0], H = cfg[c][1], bs = cfg[c][2], n = cfg[c][3], nb = 9, hd = H * dh;
    paged_rig r;
    rig_pool(&r, 3, H, dh, bs, c % 2 ? 0 : 2 * dh, nb);
    int lcols = 2 * hd + (c == 2 ? 3 : 0), ld = 3 * lcols + 1 - (int)(c % 2); /* odd strides: scalar */
    float *rows = rnd((size_t)n * ld, 1.0f);
    pair R = mk(TD_BUF_ACT, rows, (size_t)n * ld);
    int32_t *slots = malloc(sizeof(int32_t) * n);
    for (int i = 0; i < n; i++) slots[i] = i % 5 == 3 ? -1 : (i * 7 + 3) % (nb * bs);
    pair S = mk(TD_BUF_I32, slots, n);
    size_t eg = td_buf_elem_size(G, TD_BUF_ACT), ec = td_buf_elem_size(C, TD_BUF_ACT);
    RUN2(td_kv_write_layers(G, R.g, (const char *)R.g + (size_t)hd * eg, ld, (size_t)lcols, r.pool.g, &r.l, 0, 3, S.g,
                            n),
         td_kv_write_layers(C, R.c, (const char *)R.c + (size_t)hd * ec, ld, (size_t)lcols, r.pool.c, &r.l, 0, 3, S.c,
                            n));
    double e = compare(&r.pool, 0);
    cr_expect(e == 0.0, "kv_write_layers dh=%d H=%d bs=%d n=%d: error %.3g", dh, H, bs, n, e);
    RUN2(td_kv_write_layers(G, R.g, (const char *)R.g + (size_t)hd * eg, ld, (size_t)lcols, r.pool.g, &r.l, 1, 2, S.g,
                            n),
         td_kv_write_layers(C, R.c, (const char *)R.c + (size_t)hd * ec, ld, (size_t)lcols, r.pool.c, &r.l, 1, 2, S.c,
                            n));
    e = compare(&r.pool, 0);
    cr_expect(e == 0.0, "kv_write_layers from layer 1 dh=%d H=%d: error %.3g", dh, H, e);
    cr_expect(td_kv_write_layers(G, R.g, R.g, ld, (size_t)lcols, r.pool.g, &r.l, 1, 3, S.g, n) == TD_ERR_INVALID,
              "layers past the pool's");
    drop(&R);
    drop(&S);
    rig_drop(&r);
    free(rows);
    free(slots);
  }
}

static int32_t *shuffled_tables(const int32_t *ctx, int S, int bs, int stride, int n_blocks) {
  int32_t *perm = malloc(sizeof(int32_t) * n_blocks), *tab = malloc(sizeof(int32_t) * S * stride);
  cr_assert(perm && tab);
  for (int i = 0; i < n_blocks; i++) perm[i] = i;
  for (int i = n_blocks - 1; i > 0; i--) {
    int j = irand(i + 1), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  for (int s = 0, next = 0; s < S; s++) {
    int nb = (ctx[s] + bs - 1) / bs;
    for (int i = 0; i < stride; i++) tab[s * stride + i] = i < nb ? perm[next++] : -1;
  }
  free(perm);
  return tab;
}

/* the paged and states tests' buffers: the query norm's rows (when
 * given), the queries, the output and the metadata */
static void io_drop(pair *qn_rows, float *qn, pair *q, pair *o, pair *qs, pair *ct, pair *tb) {
  if (qn_rows) drop(qn_rows);
  free(qn);
  drop(q);
  drop(o);
  drop(qs);
  drop(ct);
  drop(tb);
}

/* A batch's paged extents as its sequences are drawn: sequence s gets ql
 * query rows (q_start prefix sums in qs) and c keys in blocks of bs. */
typedef struct seq_extents {
  int max_q, max_ctx, max_nb, total_nb;
} seq_extents;
static void seq_add(seq_extents *x, int32_t *qs, int32_t *ctx, int s, int ql, int c, int bs) {
  qs[s + 1] = qs[s] + ql;
  ctx[s] = c;
  int nb = (c + bs - 1) / bs;
  x->max_nb = nb > x->max_nb ? nb : x->max_nb;
  x->total_nb += nb;
  x->max_q = ql > x->max_q ? ql : x->max_q;
  x->max_ctx = c > x->max_ctx ? c : x->max_ctx;
}

typedef struct paged_cfg {
  int H, dh, bs, n_seqs;
  bool causal;
  int md;
  int q_max;    /* query rows per sequence: 1 (decode) .. q_max */
  int ctx_max;  /* keys per sequence: up to ctx_max (+ queries when causal) */
  bool pad;     /* every 4th sequence is a padding row (ctx_len 0) */
  bool strided; /* q rows inside a [., 3, H, dh] buffer */
  int slack;    /* how far max_q / max_ctx exceed the real lengths */
} paged_cfg;

static const char *paged_mode = "default";
static int paged_qn_dim; /* > 0: every case with a query norm over rows this wide */
static bool paged_q8;    /* the GPU's pool int8 (td_kv_layout.int8), the CPU's holding what its bytes say */

/* An int8 pool as the layout documents it (kernels/ops.h), read on the host:
 * row (plane, head, slot) of a layer's block, its values times its scale. */
static void q8_row(const td_kv_layout *l, const uint8_t *raw, int blk, int layer, int plane, int h, int slot,
                   float *vals, float *scale, int8_t *q) {
  size_t bb = td_kv_block_elems(l) * 2, lb = (size_t)l->n_heads * l->block_size * (l->head_dim + 4) * 2;
  const uint8_t *base = raw + (size_t)blk * bb + (size_t)layer * lb;
  size_t row = ((size_t)plane * l->n_heads + h) * l->block_size + slot;
  const int8_t *v = (const int8_t *)base + row * l->head_dim;
  float sc;
  memcpy(&sc, base + (size_t)2 * l->n_heads * l->block_size * l->head_dim + row * 4, sizeof sc);
  *scale = sc;
  for (int d = 0; d < l->head_dim; d++) {
    if (q) q[d] = v[d];
    if (vals) vals[d] = (float)v[d] * sc;
  }
}

/* r's pool (layers x H x dh, blocks of bs) again: on the GPU int8 (*l8, *g8),
 * every slot of every layer written by td_kv_write from fresh rows; the CPU's
 * r.pool.c rewritten with what those bytes hold */
static void q8_pools(paged_rig *r, td_kv_layout *l8, void **g8) {
  *l8 = r->l;
  l8->int8 = 1;
  int H = r->l.n_heads, dh = r->l.head_dim, n = r->n_blocks * r->l.block_size, hd = H * dh;
  size_t elems = td_kv_block_elems(l8) * (size_t)r->n_blocks;
  cr_assert(td_alloc(G, TD_BUF_ACT, elems, g8) == TD_OK, "%s", td_errmsg());
  int32_t *slots = malloc(sizeof(int32_t) * n);
  for (int i = 0; i < n; i++) slots[i] = i;
  pair S = mk(TD_BUF_I32, slots, n);
  float *kv = malloc(sizeof(float) * (size_t)n * 2 * hd);
  uint8_t *raw = malloc(elems * 2);
  cr_assert(kv && raw);
  for (int layer = 0; layer < r->l.n_layers; layer++) {
    float *rows = rnd((size_t)n * 2 * hd, 2.0f);
    pair R = mk(TD_BUF_ACT, rows, (size_t)n * 2 * hd);
    cr_assert(td_kv_write(G, R.g, (char *)R.g + (size_t)hd * 2, 2 * hd, *g8, l8, layer, S.g, n) == TD_OK, "%s",
              td_errmsg());
    cr_assert(td_sync(G) == TD_OK && td_copy_d2h(G, raw, *g8, elems * 2) == TD_OK, "%s", td_errmsg());
    for (int i = 0; i < n; i++)
      for (int plane = 0; plane < 2; plane++)
        for (int h = 0; h < H; h++) {
          float sc;
          q8_row(l8, raw, i / r->l.block_size, layer, plane, h, i % r->l.block_size,
                 kv + (size_t)i * 2 * hd + (size_t)plane * hd + (size_t)h * dh, &sc, NULL);
        }
    cr_assert(td_upload(C, TD_BUF_ACT, R.c, kv, (size_t)n * 2 * hd) == TD_OK);
    cr_assert(td_kv_write(C, R.c, (char *)R.c + (size_t)hd * td_buf_elem_size(C, TD_BUF_ACT), 2 * hd, r->pool.c, &r->l,
                          layer, S.c, n) == TD_OK, "%s", td_errmsg());
    drop(&R);
    free(rows);
  }
  drop(&S);
  free(kv);
  free(raw);
  free(slots);
}

static void paged_case(const paged_cfg *p) {
  int S = p->n_seqs, H = p->H, dh = p->dh, bs = p->bs;
  if (getenv("TD_TEST_VERBOSE"))
    fprintf(stderr, "paged case (%s%s) H=%d dh=%d bs=%d seqs=%d q_max=%d ctx_max=%d\n", paged_mode,
            paged_q8 ? ", int8" : "", H, dh, bs, S, p->q_max, p->ctx_max);
  int32_t *qs = malloc(sizeof(int32_t) * (S + 1)), *ctx = malloc(sizeof(int32_t) * S);
  qs[0] = 0;
  seq_extents x = {0, 0, 1, 0};
  for (int s = 0; s < S; s++) {
    int ql = 1 + irand(p->q_max);
    int c = 1 + irand(p->ctx_max);
    if (p->causal) c = c - 1 + ql;
    if (p->pad && s % 4 == 3) {
      ql = 1;
      c = 0;
    }
    seq_add(&x, qs, ctx, s, ql, c, bs);
  }
  int T = qs[S], stride = x.max_nb + 1, n_blocks = x.total_nb + 3, max_q = x.max_q, max_ctx = x.max_ctx;
  paged_rig r;
  rig_pool(&r, 3, H, dh, bs, 16, n_blocks);
  /* the pool each side reads: the same, or the GPU's in int8 and the CPU's with its values */
  td_kv_layout l8;
  void *g8 = NULL;
  if (paged_q8) q8_pools(&r, &l8, &g8);
  void *pg = paged_q8 ? g8 : r.pool.g;
  const td_kv_layout *lg = paged_q8 ? &l8 : &r.l;
  int32_t *tab = shuffled_tables(ctx, S, bs, stride, n_blocks);
  int ldq = p->strided ? 3 * H * dh : H * dh;
  float *q = rnd((size_t)T * ldq, 2.0f), *lut = p->md ? rnd((size_t)H * (2 * p->md + 1), 3.0f) : NULL;
  pair Q = mk(TD_BUF_ACT, q, (size_t)T * ldq), O = mk(TD_BUF_ACT, NULL, (size_t)T * H * dh);
  pair QS = mk(TD_BUF_I32, qs, S + 1), CT = mk(TD_BUF_I32, ctx, S), TB = mk(TD_BUF_I32, tab, (size_t)S * stride);
  pair L = {0};
  if (p->md) L = mk(TD_BUF_F32, lut, (size_t)H * (2 * p->md + 1));
  td_relbias bg = {p->md ? L.g : NULL, p->md}, bc = {p->md ? L.c : NULL, p->md};
  /* cross-attention (static K/V) may read the pool before the previous
   * kernel ends: that path on the GPU, the plain one on the re-run below */
  td_paged_meta mg = {S, T, max_q + p->slack, max_ctx + p->slack, QS.g, CT.g, TB.g, stride, !p->causal, p->causal,
                      NULL, 0, 0.0f};
  td_paged_meta mc = {S, T, max_q, max_ctx, QS.c, CT.c, TB.c, stride, false, false, NULL, 0, 0.0f};
  /* the query norm: 1 / rms of these rows scales each query */
  pair QN = {0};
  float *qn = NULL;
  if (paged_qn_dim) {
    qn = rnd((size_t)T * paged_qn_dim, 1.5f);
    QN = mk(TD_BUF_ACT, qn, (size_t)T * paged_qn_dim);
    mg.q_norm = QN.g, mc.q_norm = QN.c;
    mg.q_norm_dim = mc.q_norm_dim = paged_qn_dim;
    mg.q_norm_eps = mc.q_norm_eps = 1e-6f;
  }
  float scale = 1.0f / sqrtf((float)dh);
  RUN2(td_attn_paged(G, Q.g, ldq, O.g, pg, lg, 2, &mg, scale, p->causal, p->md ? &bg : NULL),
       td_attn_paged(C, Q.c, ldq, O.c, r.pool.c, &r.l, 2, &mc, scale, p->causal, p->md ? &bc : NULL));
  double e = compare(&O, 0);
  cr_expect(e <= TOL,
            "attn_paged (%s%s) H=%d dh=%d bs=%d seqs=%d tokens=%d causal=%d md=%d max_q=%d max_ctx=%d slack=%d: error %.3g",
            paged_mode, paged_q8 ? ", int8 K/V" : "", H, dh, bs, S, T, p->causal, p->md, max_q, max_ctx, p->slack, e);
  /* decode self-attention right after this step's KV write, as the model
   * runs it: the earlier keys may load before the write has finished, the
   * query's own key (stale in the pool until then) must not */
  if (p->causal && p->q_max == 1 && !paged_q8) {
    int hd = H * dh;
    int32_t *sl = malloc(sizeof(int32_t) * S);
    for (int s = 0; s < S; s++) {
      int qp = ctx[s] - 1;
      sl[s] = ctx[s] > 0 ? tab[s * stride + qp / bs] * bs + qp % bs : -1;
    }
    float *nk = rnd((size_t)S * 2 * hd, 2.0f);
    pair N = mk(TD_BUF_ACT, nk, (size_t)S * 2 * hd), SL = mk(TD_BUF_I32, sl, S);
    size_t eg = td_buf_elem_size(G, TD_BUF_ACT), ec = td_buf_elem_size(C, TD_BUF_ACT);
    td_paged_meta mp = mg;
    mp.kv_static = false;
    mp.kv_static_past = true;
    poison_gpu(&O);
    RUN2(td_kv_write(G, N.g, (char *)N.g + hd * eg, 2 * hd, r.pool.g, &r.l, 2, SL.g, S),
         td_kv_write(C, N.c, (char *)N.c + hd * ec, 2 * hd, r.pool.c, &r.l, 2, SL.c, S));
    RUN2(td_attn_paged(G, Q.g, ldq, O.g, r.pool.g, &r.l, 2, &mp, scale, true, p->md ? &bg : NULL),
         td_attn_paged(C, Q.c, ldq, O.c, r.pool.c, &r.l, 2, &mc, scale, true, p->md ? &bc : NULL));
    e = compare(&O, 0);
    cr_expect(e <= TOL, "attn_paged (%s) right after the step's KV write (kv_static_past) seqs=%d: error %.3g",
              paged_mode, S, e);
    drop(&N);
    drop(&SL);
    free(nk);
    free(sl);
  }
  /* exact bounds give the same answer */
  if (p->slack) {
    poison_gpu(&O);
    mg.max_q = max_q;
    mg.max_ctx = max_ctx;
    mg.kv_static = false;
    cr_assert(td_attn_paged(G, Q.g, ldq, O.g, pg, lg, 2, &mg, scale, p->causal, p->md ? &bg : NULL) == TD_OK,
              "%s", td_errmsg());
    e = compare(&O, 0);
    cr_expect(e <= TOL, "attn_paged (%s%s) with exact bounds: error %.3g", paged_mode, paged_q8 ? ", int8 K/V" : "", e);
  }
  if (g8) td_free(G, g8);
  io_drop(paged_qn_dim ? &QN : NULL, qn, &Q, &O, &QS, &CT, &TB);
  if (p->md) drop(&L);
  rig_drop(&r);
  free(q);
  free(lut);
  free(tab);
  free(qs);
  free(ctx);
}

Test(cuda, attn_paged) {
  static const paged_cfg cfg[] = {
      /* H dh bs seqs causal md q_max ctx_max pad strided slack */
      {16, 64, 16, 1, false, 0, 1, 512, false, false, 100},   /* decode cross, batch 1: split-KV */
      {16, 64, 16, 5, false, 0, 1, 512, true, false, 7},      /* odd batch, padding rows */
      {16, 64, 16, 64, false, 0, 1, 512, false, false, 0},    /* batch 64: one block per (seq, head) */
      {16, 64, 16, 64, true, 128, 1, 70, true, true, 33},     /* decode self with T5 bias */
      {16, 64, 32, 3, true, 128, 40, 90, false, true, 25},    /* prompt chunks */
      {4, 128, 16, 7, true, 0, 20, 300, true, true, 3},       /* head_dim 128 */
      {4, 128, 16, 1, false, 0, 1, 2000, false, false, 0},    /* long cross, many splits */
      {8, 128, 5, 9, false, 16, 3, 77, false, false, 1},      /* odd block size */
      {4, 16, 4, 5, true, 128, 6, 30, true, true, 5},         /* small head: generic kernel */
      {3, 10, 3, 4, false, 0, 2, 20, false, false, 2},        /* odd head size */
      {2, 64, 16, 2, true, 3000, 100, 200, false, false, 9},  /* LUT in global memory */
      {16, 64, 5, 17, true, 20, 1, 300, false, false, 11},    /* decode self, warp per (seq, head), odd blocks */
      {16, 64, 16, 33, false, 0, 1, 200, true, false, 5},     /* decode cross: warp kernel on the re-run */
      /* small batches on warps: 2, 4, 8, 16 warps a (seq, head) by the context bound */
      {16, 64, 16, 2, true, 128, 1, 60, false, true, 3},      /* self with T5 bias, short context */
      {8, 64, 7, 3, false, 0, 1, 120, false, false, 2},       /* odd block size */
      {8, 64, 16, 2, true, 0, 1, 250, false, false, 0},
      {16, 64, 5, 3, true, 20, 1, 300, true, false, 11},      /* odd blocks, padding row, bias */
      {16, 64, 16, 1, false, 0, 1, 1500, false, false, 0},    /* several chunks a warp (Whisper-length cross) */
      {8, 64, 16, 1, false, 0, 1, 512, false, false, 0},      /* a TP=4 rank's 8 heads at batch 1: 16 warps a pair */
      {16, 64, 32, 20, false, 0, 1, 700, true, false, 0},    /* block size over the bulk kernel's stage */
      {4, 64, 64, 9, true, 50, 1, 400, false, false, 0},      /* causal, bias, blocks of 64 */
  };
  for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) paged_case(&cfg[c]);
  /* every decode case again on the bulk-copy kernel in each block shape
   * (from one pair, static K/V or not; the self K/V before the query
   * copied before the wait, or not) */
  static const struct {
    int shape, early; /* decode_bulk_shape, decode_bulk_early */
    const char *mode;
  } bulk[] = {{1, 2000000000, "bulk copies, 4 warps x 2"},
              {2, 2000000000, "bulk copies, 2 warps x 2"},
              {3, TD_OFF, "bulk copies, 2 warps x 3, self K/V after the wait"}};
  for (int v = 0; v < 3; v++) {
    td_cuda_tuning t = cuda_base;
    t.decode_bulk = 1, t.decode_bulk_all = 2000000000;
    t.decode_bulk_shape = bulk[v].shape, t.decode_bulk_early = bulk[v].early;
    use_tuning(&t);
    paged_mode = bulk[v].mode;
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++)
      if (cfg[c].q_max == 1) paged_case(&cfg[c]);
    paged_mode = "default";
  }
  use_tuning(&cuda_base);
  /* the query norm, in the decode kernels (rows of 1024) and applied
   * before the others (and where rows of 100 are not 16-byte aligned) */
  static const struct {
    int dim;
    const char *mode;
  } qn[] = {{1024, "query norm over 1024"}, {100, "query norm over 100"}};
  for (int v = 0; v < 2; v++) {
    paged_qn_dim = qn[v].dim;
    paged_mode = qn[v].mode;
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) paged_case(&cfg[c]);
  }
  paged_qn_dim = 0;
  paged_mode = "default";
}

/* int8 cross K/V (td_kv_layout.int8): td_kv_write quantizes each (row,
 * head) by its largest magnitude into the documented layout, td_kv_read
 * gives the values back, slots of -1 are left alone, and the states tail
 * stays bf16 */
Test(cuda, kv_write_int8) {
  /* dh, heads, block size, rows, row stride over 2 x heads x dh (1: one more, the unvectorised kernel) */
  static const int cfg[][5] = {{64, 16, 16, 37, 0}, {128, 4, 32, 5, 0}, {16, 3, 4, 23, 0}, {64, 2, 8, 1, 0},
                               {256, 1, 4, 9, 0},   {48, 5, 4, 11, 0},  {80, 3, 8, 7, 0},  {64, 20, 16, 13, 1},
                               {32, 7, 4, 6, 1}};
  for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
    int dh = cfg[c][0], H = cfg[c][1], bs = cfg[c][2], n = cfg[c][3], nb = 9, hd = H * dh, ld = 2 * hd + cfg[c][4];
    int states = c % 2 ? 0 : 2 * dh;
    td_kv_layout l = {3, H, dh, bs, states, 1};
    cr_assert(td_kv_layout_valid(&l));
    size_t elems = td_kv_block_elems(&l) * nb;
    cr_expect_eq(elems, ((size_t)3 * H * bs * (dh + 4) + (size_t)bs * states) * nb, "int8 blocks' size");
    void *pool = NULL;
    cr_assert(td_alloc(G, TD_BUF_ACT, elems, &pool) == TD_OK);
    uint8_t *raw = malloc(elems * 2), *before = malloc(elems * 2);
    cr_assert(raw && before);
    for (size_t i = 0; i < elems * 2; i++) before[i] = (uint8_t)(i * 131u + 7u);
    cr_assert(td_copy_h2d(G, pool, before, elems * 2) == TD_OK);
    float *rows = rnd((size_t)n * ld, 3.0f);
    /* a row of zeros and a row with one large value */
    for (int d = 0; d < dh; d++) rows[d] = 0.0f;
    if (n > 1) rows[(size_t)ld + 5] = 900.0f;
    pair R = mk(TD_BUF_ACT, rows, (size_t)n * ld);
    int32_t *slots = malloc(sizeof(int32_t) * n);
    for (int i = 0; i < n; i++) slots[i] = i % 5 == 3 ? -1 : (i * 7) % (nb * bs);
    pair S = mk(TD_BUF_I32, slots, n);
    cr_assert(td_kv_write(G, R.g, (char *)R.g + (size_t)hd * 2, ld, pool, &l, 1, S.g, n) == TD_OK, "%s",
              td_errmsg());
    if (states)
      cr_assert(td_kv_write(G, R.g, (char *)R.g + (size_t)(states / 2) * 2, ld, pool, &l, 3, S.g, n) == TD_OK);
    cr_assert(td_sync(G) == TD_OK && td_copy_d2h(G, raw, pool, elems * 2) == TD_OK);
    int wrong_q = 0, wrong_scale = 0, far = 0;
    int8_t q[256];
    float vals[256];
    for (int i = 0; i < n; i++) {
      if (slots[i] < 0) continue;
      int blk = slots[i] / bs, sl = slots[i] % bs;
      for (int plane = 0; plane < 2; plane++)
        for (int h = 0; h < H; h++) {
          const float *x = rows + (size_t)i * ld + (size_t)plane * hd + (size_t)h * dh;
          float amax = 0.0f, sc;
          for (int d = 0; d < dh; d++) amax = fmaxf(amax, fabsf(x[d]));
          q8_row(&l, raw, blk, 1, plane, h, sl, vals, &sc, q);
          wrong_scale += sc != amax / 127.0f;
          float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
          for (int d = 0; d < dh; d++) {
            wrong_q += q[d] != (int8_t)fmaxf(-127.0f, fminf(127.0f, rintf(x[d] * inv)));
            far += !(fabsf(vals[d] - x[d]) <= 0.5f * sc * 1.0001f);
          }
        }
    }
    cr_expect(wrong_scale == 0 && wrong_q == 0 && far == 0,
              "kv_write int8 dh=%d H=%d bs=%d n=%d: %d scales, %d values off the rule, %d beyond half a step", dh, H,
              bs, n, wrong_scale, wrong_q, far);
    /* untouched: the other layers, and the slots of skipped rows */
    size_t bb = td_kv_block_elems(&l) * 2, lb = (size_t)H * bs * (dh + 4) * 2;
    int moved = 0;
    for (int b = 0; b < nb; b++)
      for (size_t o = 0; o < lb; o++) moved += raw[b * bb + o] != before[b * bb + o]; /* layer 0 */
    cr_expect(moved == 0, "kv_write int8 into layer 1 changed %d bytes of layer 0", moved);
    if (states) { /* the tail: bf16 as it was given (a row's first half in K, its second in V) */
      int bad = 0;
      for (int i = 0; i < n; i++) {
        if (slots[i] < 0) continue;
        for (int d = 0; d < states; d++) {
          int plane = d < states / 2 ? 0 : 1, j = d % (states / 2);
          uint16_t u;
          memcpy(&u, raw + (size_t)(slots[i] / bs) * bb + 3 * lb +
                         (((size_t)plane * bs + slots[i] % bs) * (states / 2) + j) * 2, 2);
          bad += td_bf16_to_f32(u) != rows[(size_t)i * ld + d];
        }
      }
      cr_expect(bad == 0, "the states tail of an int8 pool: %d values off", bad);
    }
    /* td_kv_read: the values times their scales, as bf16 */
    pair O = mk(TD_BUF_ACT, NULL, (size_t)n * 2 * hd);
    cr_assert(td_kv_read(G, pool, &l, 1, S.g, n, O.g, (char *)O.g + (size_t)hd * 2, 2 * hd) == TD_OK, "%s",
              td_errmsg());
    float *o = get(G, &O, true);
    int off = 0;
    for (int i = 0; i < n; i++) {
      if (slots[i] < 0) continue;
      for (int plane = 0; plane < 2; plane++)
        for (int h = 0; h < H; h++) {
          float sc;
          q8_row(&l, raw, slots[i] / bs, 1, plane, h, slots[i] % bs, vals, &sc, NULL);
          for (int d = 0; d < dh; d++) off += o[(size_t)i * 2 * hd + (size_t)plane * hd + (size_t)h * dh + d] != bfr(vals[d]);
        }
    }
    cr_expect(off == 0, "kv_read int8 dh=%d H=%d: %d values not the bytes' value times scale", dh, H, off);
    free(o);
    drop(&O);
    drop(&R);
    drop(&S);
    td_free(G, pool);
    free(rows);
    free(slots);
    free(raw);
    free(before);
  }
  /* what the CPU backend and the layout refuse */
  td_kv_layout odd = {2, 2, 24, 16, 0, 1}, blocks = {2, 2, 64, 6, 0, 1}, none = {0, 2, 64, 16, 64, 1};
  cr_expect(!td_kv_layout_valid(&odd) && !td_kv_layout_valid(&blocks) && !td_kv_layout_valid(&none),
            "int8 layouts need head_dim %% 16, block_size %% 4 and layers");
  td_kv_layout l = {1, 2, 64, 16, 0, 1};
  float x[256] = {0};
  int32_t s0 = 0;
  void *cp = NULL;
  cr_assert(td_alloc(C, TD_BUF_ACT, td_kv_block_elems(&l), &cp) == TD_OK);
  cr_expect(td_kv_write(C, x, x + 128, 256, cp, &l, 0, &s0, 1) == TD_ERR_UNSUPPORTED);
  cr_expect(strstr(td_errmsg(), "int8 K/V pools need the CUDA backend"), "%s", td_errmsg());
  td_free(C, cp);
}

/* td_attn_paged over int8 K/V against the CPU over the values the int8
 * bytes hold: every decode kernel (warps by the context bound, 16 warps
 * where bf16 would take the tiled kernel's key splits, the bulk copies in
 * each shape), the generic kernel (several queries a sequence, other head
 * sizes), with the query norm and with the decode kernels off */
Test(cuda, attn_paged_int8) {
  static const paged_cfg cfg[] = {
      /* H dh bs seqs causal md q_max ctx_max pad strided slack */
      {16, 64, 16, 1, false, 0, 1, 512, false, false, 100},  /* batch 1: 16 warps (bf16: split keys) */
      {16, 64, 16, 5, false, 0, 1, 512, true, false, 7},     /* odd batch, padding rows */
      {16, 64, 16, 64, false, 0, 1, 512, false, false, 0},   /* batch 64: bulk copies */
      {16, 64, 16, 33, false, 0, 1, 200, true, false, 5},
      {20, 64, 16, 3, false, 0, 1, 1500, false, false, 0},   /* Whisper's 1,500 positions, 20 heads */
      {20, 64, 16, 24, false, 0, 1, 400, false, false, 0},
      {8, 64, 16, 1, false, 0, 1, 512, false, false, 0},     /* a TP=4 rank's 8 heads */
      {16, 64, 32, 20, false, 0, 1, 700, true, false, 0},    /* blocks past the bulk kernel's stage */
      {8, 64, 4, 3, false, 0, 1, 61, false, false, 2},       /* blocks of 4, short contexts on warps */
      {8, 64, 12, 3, false, 0, 1, 120, false, false, 2},
      {8, 64, 16, 2, false, 0, 1, 250, false, false, 0},
      {16, 64, 16, 3, false, 0, 4, 90, false, true, 25},     /* a decoder prompt: the generic kernel */
      {4, 128, 16, 7, false, 0, 3, 300, true, true, 3},      /* head_dim 128 */
      {4, 16, 4, 5, false, 0, 6, 30, true, true, 5},         /* small heads */
      {2, 64, 16, 2, false, 7, 2, 200, false, false, 9},     /* a relative bias (generic) */
  };
  paged_q8 = true;
  for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) paged_case(&cfg[c]);
  static const int shapes[] = {1, 2, 3};
  for (int v = 0; v < 3; v++) {
    td_cuda_tuning t = cuda_base;
    t.decode_bulk = 1, t.decode_bulk_all = 2000000000, t.decode_bulk_shape = shapes[v];
    use_tuning(&t);
    paged_mode = v == 0 ? "bulk copies, 4 warps x 2" : v == 1 ? "bulk copies, 2 warps x 2" : "bulk copies, 2 warps x 3";
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++)
      if (cfg[c].q_max == 1) paged_case(&cfg[c]);
  }
  td_cuda_tuning t = cuda_base;
  t.decode_warp = 0; /* no decode kernels: the generic one */
  use_tuning(&t);
  paged_mode = "decode kernels off";
  for (size_t c = 0; c < 4; c++) paged_case(&cfg[c]);
  use_tuning(&cuda_base);
  paged_qn_dim = 1024;
  paged_mode = "query norm over 1024";
  for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) paged_case(&cfg[c]);
  paged_qn_dim = 0;
  paged_mode = "default";
  paged_q8 = false;
}

/* ---------------------------------------------------------- encoder states */

typedef struct states_cfg {
  int heads, D, bs, n_seqs;
  int q_max;   /* query rows per sequence: 1 .. q_max */
  int ctx_max; /* states per sequence: 1 .. ctx_max */
  bool pad;    /* every 4th sequence has no states (ctx_len 0) */
  int qn_dim;  /* > 0: a query norm over rows this wide */
  int ldq_pad; /* q rows wider than heads * D by this */
} states_cfg;

/* td_attn_states against the CPU on fresh inputs; on the GPU as the model
 * runs it (static states: the tensor-core kernel where D allows) and with
 * the states not declared static (the generic kernel) */
static void states_case(const states_cfg *p, const char *mode) {
  int S = p->n_seqs, Hq = p->heads, D = p->D, bs = p->bs;
  int32_t *qs = malloc(sizeof(int32_t) * (S + 1)), *ctx = malloc(sizeof(int32_t) * S);
  qs[0] = 0;
  seq_extents x = {0, 0, 1, 0};
  for (int s = 0; s < S; s++) {
    int ql = 1 + irand(p->q_max), c = 1 + irand(p->ctx_max);
    if (s == 0) c = p->ctx_max; /* the longest case always present */
    if (p->pad && s % 4 == 3) c = 0;
    seq_add(&x, qs, ctx, s, ql, c, bs);
  }
  int T = qs[S], stride = x.max_nb + 1, n_blocks = x.total_nb + 3, max_q = x.max_q, max_ctx = x.max_ctx;
  paged_rig r;
  /* a pool of states only, or the states tail after two layers' K/V (dual) */
  rig_pool(&r, S % 2 ? 0 : 2, 2, 8, bs, D, n_blocks);
  int32_t *tab = shuffled_tables(ctx, S, bs, stride, n_blocks);
  int ldq = Hq * D + p->ldq_pad;
  float *q = rnd((size_t)T * ldq, 2.0f);
  pair Q = mk(TD_BUF_ACT, q, (size_t)T * ldq), O = mk(TD_BUF_ACT, NULL, (size_t)T * Hq * D);
  pair QS = mk(TD_BUF_I32, qs, S + 1), CT = mk(TD_BUF_I32, ctx, S), TB = mk(TD_BUF_I32, tab, (size_t)S * stride);
  td_paged_meta mg = {S, T, max_q, max_ctx, QS.g, CT.g, TB.g, stride, true, false, NULL, 0, 0.0f};
  td_paged_meta mc = {S, T, max_q, max_ctx, QS.c, CT.c, TB.c, stride, false, false, NULL, 0, 0.0f};
  pair QN = {0};
  float *qn = NULL;
  if (p->qn_dim) {
    qn = rnd((size_t)T * p->qn_dim, 1.5f);
    QN = mk(TD_BUF_ACT, qn, (size_t)T * p->qn_dim);
    mg.q_norm = QN.g, mc.q_norm = QN.c;
    mg.q_norm_dim = mc.q_norm_dim = p->qn_dim;
    mg.q_norm_eps = mc.q_norm_eps = 1e-6f;
  }
  float scale = 1.0f / sqrtf((float)D);
  RUN2(td_attn_states(G, Q.g, ldq, O.g, r.pool.g, &r.l, Hq, &mg, scale),
       td_attn_states(C, Q.c, ldq, O.c, r.pool.c, &r.l, Hq, &mc, scale));
  double e = compare(&O, 0);
  cr_expect(e <= TOL, "attn_states (%s) heads=%d D=%d bs=%d seqs=%d tokens=%d max_ctx=%d qn=%d: error %.3g", mode,
            Hq, D, bs, S, T, max_ctx, p->qn_dim, e);
  if (!(e <= TOL)) explain(&O, T * Hq, D);
  poison_gpu(&O);
  mg.kv_static = false;
  cr_assert(td_attn_states(G, Q.g, ldq, O.g, r.pool.g, &r.l, Hq, &mg, scale) == TD_OK, "%s", td_errmsg());
  e = compare(&O, 0);
  cr_expect(e <= TOL, "attn_states (%s, not static) heads=%d D=%d seqs=%d: error %.3g", mode, Hq, D, S, e);
  io_drop(p->qn_dim ? &QN : NULL, qn, &Q, &O, &QS, &CT, &TB);
  rig_drop(&r);
  free(q);
  free(tab);
  free(qs);
  free(ctx);
}

Test(cuda, attn_states) {
  static const states_cfg cfg[] = {
      /* heads D bs seqs q_max ctx_max pad qn ldq_pad */
      {16, 1024, 16, 64, 1, 512, false, 0, 0},  /* Flan-T5-large, batch 64 */
      {16, 1024, 16, 3, 1, 512, true, 1024, 0}, /* few sequences: many splits; the query norm */
      {16, 1024, 16, 5, 3, 77, false, 0, 8},    /* prompt rows: 48 pairs a sequence */
      {20, 1280, 16, 7, 1, 1500, false, 0, 0},  /* Whisper-large: two groups of 16 pairs */
      {20, 1280, 16, 66, 1, 333, false, 0, 0},  /* ... at batch 66: one group of 32 pairs (states_pl32_kernel) */
      {20, 1280, 7, 40, 2, 200, true, 1280, 0}, /* 40 pairs a sequence: two groups of 32, blocks of 7 */
      {8, 512, 4, 9, 2, 33, true, 512, 0},      /* T5-small: 8 heads, padded pairs */
      {12, 768, 3, 4, 1, 250, false, 0, 0},     /* block size 3: rows cross blocks */
      {1, 1024, 16, 2, 1, 1, false, 0, 0},      /* one head, one state */
      {4, 96, 5, 6, 2, 41, true, 0, 0},         /* a width the generic kernel takes */
      {3, 40, 2, 3, 3, 9, false, 40, 0},
      {16, 1024, 16, 2, 1, 64, false, 1003, 0}, /* norm rows not of whole vectors */
      {16, 1024, 16, 150, 1, 200, true, 0, 0},  /* past one wave of an H100's or H200's 132 SMs */
  };
  /* splits (16: a non-portable cluster) by the policy's warps, then each
   * warp count forced; 16 warps are the warp-specialised kernel where it
   * fits, the other one under ws 0; two splits of the warp-specialised
   * kernel are its plane split, the key splits under planes 0 */
  static const struct {
    int splits, warps, ws, planes, pl32; /* td_cuda_tuning.states_*; 0: the policy's */
  } var[] = {
      {0, 0, 0, 0, 0},  {1, 0, 0, 0, 0},  {2, 0, 0, 0, 0},  {16, 0, 0, 0, 0},      {0, 8, 0, 0, 0},
      {1, 8, 0, 0, 0},  {4, 8, 0, 0, 0},  {0, 16, 0, 0, 0}, {2, 16, 0, 0, 0},      {8, 16, 0, 0, 0},
      {1, 16, TD_OFF, 0, 0}, {2, 16, TD_OFF, 0, 0}, {2, 16, 0, TD_OFF, 0}, {0, 0, 0, 0, TD_OFF},
  };
  /* TD_TEST_STATES_VARIANT=v, TD_TEST_STATES_CASE=i: that variant or case
   * alone (racecheck takes minutes a case; main reads them) */
  const char *only = states_variant, *one = states_case_only;
  for (size_t v = 0; v < sizeof var / sizeof var[0]; v++) {
    if (only && *only && (size_t)atoi(only) != v) continue;
    td_cuda_tuning t = cuda_base;
    t.states_splits = var[v].splits;
    t.states_warps = var[v].warps;
    t.states_ws = var[v].ws;
    t.states_planes = var[v].planes;
    t.states_pl32 = var[v].pl32;
    use_tuning(&t);
    char mode[80];
    snprintf(mode, sizeof mode, "splits %d, warps %d, ws %s, planes %s, pl32 %s", var[v].splits, var[v].warps,
             var[v].ws ? "off" : "-", var[v].planes ? "off" : "-", var[v].pl32 ? "off" : "-");
    for (size_t i = 0; i < sizeof cfg / sizeof cfg[0]; i++)
      if (!(one && *one) || (size_t)atoi(one) == i) states_case(&cfg[i], mode);
  }
  td_cuda_tuning t = cuda_base;
  t.states_generic = TD_ON;
  use_tuning(&t);
  for (size_t i = 0; i < 5; i++) states_case(&cfg[i], "generic");
  use_tuning(&cuda_base);
  /* which widths a dual pool switches: Flan-T5-large's 1024 from 48 rows; Whisper-large's 1280 (20 heads) on
     the 32-pair plane kernel at the row counts that fill its waves (132 SMs: 53-66, 106-132, ...) */
  cr_expect(td_attn_states_fast(G, 1024) && td_attn_states_rows(G, 1024, false) == 48);
  cr_expect(td_attn_states_takes(G, 1024, 16, false, 80));
  cr_expect_eq(td_attn_states_rows(G, 1024, true), INT_MAX, "int8 K/V: never the states");
  cr_expect(td_attn_states_fast(G, 1280), "no tensor-core states kernel for 1280");
  cr_expect_eq(td_attn_states_rows(G, 1280, false), 48);
  cr_expect(td_attn_states_takes(G, 1280, 20, false, 64) && !td_attn_states_takes(G, 1280, 20, false, 96) &&
                td_attn_states_takes(G, 1280, 20, false, 128) && !td_attn_states_takes(G, 1280, 20, false, 32),
            "Whisper-large: 64 and 128 rows over the states, 32 and 96 over the K/V");
  cr_expect(!td_attn_states_takes(G, 1280, 20, true, 64), "int8 K/V");
  cr_expect(!td_attn_states_takes(C, 1024, 16, false, 64), "the CPU: the K/V");
  cr_expect(!td_attn_states_fast(G, 2048) && td_attn_states_rows(G, 2048, false) == INT_MAX,
            "Flan-T5-XL: the generic kernel");
  cr_expect(!td_attn_states_fast(C, 1024) && td_attn_states_rows(C, 1024, false) == INT_MAX, "the CPU: the K/V");
}

