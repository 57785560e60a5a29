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

static void paged_case(const paged_cfg *p) {
  int S = p->n_seqs, H = p->H, dh = p->dh, bs = p->bs;
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
  RUN2(td_attn_paged(G, Q.g, ldq, O.g, r.pool.g, &r.l, 2, &mg, scale, p->causal, p->md ? &bg : NULL),
       td_attn_paged(C, Q.c, ldq, O.c, r.pool.c, &r.l, 2, &mc, scale, p->causal, p->md ? &bc : NULL));
  double e = compare(&O, 0);
  cr_expect(e <= TOL,
            "attn_paged (%s) H=%d dh=%d bs=%d seqs=%d tokens=%d causal=%d md=%d max_q=%d max_ctx=%d slack=%d: error %.3g",
            paged_mode, H, dh, bs, S, T, p->causal, p->md, max_q, max_ctx, p->slack, e);
  /* decode self-attention right after this step's KV write, as the model
   * runs it: the earlier keys may load before the write has finished, the
   * query's own key (stale in the pool until then) must not */
  if (p->causal && p->q_max == 1) {
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
    cr_assert(td_attn_paged(G, Q.g, ldq, O.g, r.pool.g, &r.l, 2, &mg, scale, p->causal, p->md ? &bg : NULL) == TD_OK,
              "%s", td_errmsg());
    e = compare(&O, 0);
    cr_expect(e <= TOL, "attn_paged (%s) with exact bounds: error %.3g", paged_mode, e);
  }
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
      {8, 512, 4, 9, 2, 33, true, 512, 0},      /* T5-small: 8 heads, padded pairs */
      {12, 768, 3, 4, 1, 250, false, 0, 0},     /* block size 3: rows cross blocks */
      {1, 1024, 16, 2, 1, 1, false, 0, 0},      /* one head, one state */
      {4, 96, 5, 6, 2, 41, true, 0, 0},         /* a width the generic kernel takes */
      {3, 40, 2, 3, 3, 9, false, 40, 0},
      {16, 1024, 16, 2, 1, 64, false, 1003, 0}, /* norm rows not of whole vectors */
  };
  /* splits (16: a non-portable cluster) by the policy's warps, then each
   * warp count forced; 16 warps are the warp-specialised kernel where it
   * fits, the other one under ws 0; two splits of the warp-specialised
   * kernel are its plane split, the key splits under planes 0 */
  static const struct {
    int splits, warps, ws, planes; /* td_cuda_tuning.states_*; 0: the policy's */
  } var[] = {
      {0, 0, 0, 0},  {1, 0, 0, 0},  {2, 0, 0, 0},  {16, 0, 0, 0},      {0, 8, 0, 0},      {1, 8, 0, 0},     {4, 8, 0, 0},
      {0, 16, 0, 0}, {2, 16, 0, 0}, {8, 16, 0, 0}, {1, 16, TD_OFF, 0}, {2, 16, TD_OFF, 0}, {2, 16, 0, TD_OFF},
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
    use_tuning(&t);
    char mode[64];
    snprintf(mode, sizeof mode, "splits %d, warps %d, ws %s, planes %s", var[v].splits, var[v].warps,
             var[v].ws ? "off" : "-", var[v].planes ? "off" : "-");
    for (size_t i = 0; i < sizeof cfg / sizeof cfg[0]; i++)
      if (!(one && *one) || (size_t)atoi(one) == i) states_case(&cfg[i], mode);
  }
  td_cuda_tuning t = cuda_base;
  t.states_generic = TD_ON;
  use_tuning(&t);
  for (size_t i = 0; i < 5; i++) states_case(&cfg[i], "generic");
  use_tuning(&cuda_base);
  /* which widths a dual pool switches: Flan-T5-large's 1024 from 48 rows; Whisper-large's 1280 has a
     tensor-core kernel on Hopper but stays on the K/V (slower over the states at every batch) */
  cr_expect(td_attn_states_fast(G, 1024) && td_attn_states_rows(G, 1024) == 48);
  cr_expect(td_attn_states_fast(G, 1280), "no tensor-core states kernel for 1280");
  cr_expect_eq(td_attn_states_rows(G, 1280), INT_MAX);
  cr_expect(!td_attn_states_fast(G, 2048) && td_attn_states_rows(G, 2048) == INT_MAX, "Flan-T5-XL: the generic kernel");
  cr_expect(!td_attn_states_fast(C, 1024) && td_attn_states_rows(C, 1024) == INT_MAX, "the CPU: the K/V");
}

