/* The CUDA GEMMs against the CPU reference: td_gemm on each of its decode
 * kernels and cuBLASLt, td_gemm_ex with each fusion, td_gemm_heads on its
 * tensor-core kernel and on cuBLASLt (cuda_test.h). */
#include "cuda_test.h"

/* ---------------------------------------------------------------- GEMM */

static void gemm_case(int m, int n, int k, td_act act, unsigned flags, bool with_bias) {
  td_buf_type yt = (flags & TD_GEMM_OUT_F32) ? TD_BUF_F32 : TD_BUF_ACT;
  float *x = rnd((size_t)m * k, 1.0f), *w = rnd((size_t)n * k, 1.7f / sqrtf((float)k)),
        *b = with_bias ? rnd(n, 0.5f) : NULL, *y0 = rnd((size_t)m * n, 1.0f);
  pair X = mk(TD_BUF_ACT, x, (size_t)m * k), W = mk(TD_BUF_ACT, w, (size_t)n * k);
  pair B = {0};
  if (with_bias) B = mk(TD_BUF_F32, b, n);
  pair Y = mk(yt, (flags & TD_GEMM_ACCUM) ? y0 : NULL, (size_t)m * n);
  RUN2(td_gemm(G, X.g, W.g, with_bias ? B.g : NULL, Y.g, m, n, k, act, flags),
       td_gemm(C, X.c, W.c, with_bias ? B.c : NULL, Y.c, m, n, k, act, flags));
  double e = compare(&Y, 0);
  cr_expect(e <= TOL, "gemm m=%d n=%d k=%d act=%d flags=%u bias=%d: error %.3g", m, n, k, act, flags, with_bias, e);
  if (!(e <= TOL)) explain(&Y, m, n);
  drop(&X);
  drop(&W);
  drop(&Y);
  if (with_bias) drop(&B);
  free(x);
  free(w);
  free(b);
  free(y0);
}

Test(cuda, gemm) {
  static const struct {
    td_act act;
    unsigned flags;
    bool bias;
  } cfg[] = {
      {TD_ACT_NONE, 0, true},          {TD_ACT_NONE, 0, false},
      {TD_ACT_RELU, 0, true},          {TD_ACT_RELU, 0, false},
      {TD_ACT_GELU_TANH, 0, true},     {TD_ACT_GELU_TANH, 0, false},
      {TD_ACT_GELU, 0, true},          {TD_ACT_SILU, 0, false},
      {TD_ACT_QUICK_GELU, 0, true},    {TD_ACT_NONE, TD_GEMM_ACCUM, false},
      {TD_ACT_NONE, TD_GEMM_ACCUM, true}, {TD_ACT_NONE, TD_GEMM_OUT_F32, true},
      {TD_ACT_NONE, TD_GEMM_OUT_F32 | TD_GEMM_ACCUM, false}, {TD_ACT_GELU, TD_GEMM_OUT_F32, true},
  };
  static const int small[][3] = {{1, 64, 64}, {7, 301, 40}, {33, 3072, 1024}, {130, 513, 96}, {5, 1000, 333},
                                 {64, 56, 40}, {3, 17, 10}};
  for (size_t s = 0; s < sizeof small / sizeof small[0]; s++)
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++)
      gemm_case(small[s][0], small[s][1], small[s][2], cfg[c].act, cfg[c].flags, cfg[c].bias);
  /* encoder-sized outputs: the bias / activation pass after cuBLASLt, vectorised where a row is whole
     16-byte vectors (n % 8, f32 out n % 4) and scalar where not */
  gemm_case(1500, 1280, 64, TD_ACT_GELU, 0, true);
  gemm_case(601, 520, 40, TD_ACT_NONE, TD_GEMM_ACCUM, true);
  gemm_case(257, 1028, 32, TD_ACT_GELU, TD_GEMM_OUT_F32, true);
  gemm_case(300, 1030, 24, TD_ACT_SILU, 0, true);
  /* a bf16-output bias reaches cuBLASLt as a bf16 copy kept per bias pointer: the same shape again
     gets a new bias in memory the allocator likely hands back at the same address, which the copy
     of the freed one must not answer for */
  for (int r = 0; r < 3; r++) gemm_case(130, 768, 64, TD_ACT_NONE, 0, true);
  for (int r = 0; r < 2; r++) {
    gemm_case(130, 768, 64, TD_ACT_GELU_TANH, 0, true);
    gemm_case(130, 768, 64, TD_ACT_NONE, TD_GEMM_ACCUM, true);
  }
  /* every row-tile variant of the decode kernels (m <= 8; 8 < m <= 64 in 16, 32, 64 rows) */
  static const int dec[][3] = {{12, 1024, 2816}, {16, 5632, 1024}, {24, 1000, 512}, {40, 3072, 1024}, {9, 96, 64}};
  for (size_t s = 0; s < sizeof dec / sizeof dec[0]; s++) {
    gemm_case(dec[s][0], dec[s][1], dec[s][2], TD_ACT_NONE, TD_GEMM_ACCUM, true);
    gemm_case(dec[s][0], dec[s][1], dec[s][2], TD_ACT_GELU, TD_GEMM_OUT_F32, true);
    gemm_case(dec[s][0], dec[s][1], dec[s][2], TD_ACT_RELU, 0, false);
  }
  /* decode batch sizes: k not a multiple of 64, narrow and wide n; m 0: a
   * random batch size up to 64 */
  static const int mid[][3] = {{64, 5632, 1024}, {50, 1000, 2816}, {31, 3072, 1024}, {17, 96, 8},
                               {63, 33, 1000}, {48, 20000, 256}, {0, 1024, 1024}};
  for (size_t s = 0; s < sizeof mid / sizeof mid[0]; s++) {
    int m = mid[s][0] ? mid[s][0] : 1 + irand(64);
    gemm_case(m, mid[s][1], mid[s][2], TD_ACT_NONE, TD_GEMM_ACCUM, true);
    gemm_case(m, mid[s][1], mid[s][2], TD_ACT_SILU, 0, s & 1);
  }
  gemm_case(512, 1024, 2816, TD_ACT_NONE, TD_GEMM_ACCUM, false);
  gemm_case(300, 5632, 1024, TD_ACT_NONE, 0, false);
  gemm_case(1000, 4096, 1024, TD_ACT_GELU, 0, true);
  gemm_case(64, 32128, 1024, TD_ACT_NONE, TD_GEMM_OUT_F32, false);
  gemm_case(3, 32128, 1024, TD_ACT_NONE, TD_GEMM_OUT_F32, true);
}

/* cuBLASLt plans keyed by row buckets (td_cu_plan_rows): a plan chosen for a
 * bucket's top row count runs at fewer rows, after more and before more
 * (its layouts are re-pointed each time), encoder-run row counts in a random
 * order, and the same with exact keys (TANDEM_CUDA_PLAN_BUCKET=0). */
Test(cuda, gemm_plan_buckets) {
  td_cuda_tuning t[2] = {cuda_base, cuda_base};
  t[1].plan_bucket = TD_OFF;
  static const int same[] = {72, 65, 70, 72, 66, 320, 289, 301, 320, 1024, 897, 1000, 1017};
  for (int pass = 0; pass < 2; pass++) {
    use_tuning(&t[pass]);
    for (size_t i = 0; i < sizeof same / sizeof *same; i++) {
      gemm_case(same[i], 1024, 1024, TD_ACT_GELU, 0, true);
      gemm_case(same[i], 3072, 1024, TD_ACT_NONE, TD_GEMM_ACCUM, false);
    }
    for (int r = 0; r < 12; r++) { /* a run of one to three inputs of 260-440 tokens */
      int m = 0, inputs = 1 + irand(3);
      for (int j = 0; j < inputs; j++) m += 260 + irand(181);
      gemm_case(m, 1024, 4096, TD_ACT_NONE, 0, true);
      gemm_case(m, 4096, 1024, TD_ACT_GELU, TD_GEMM_OUT_F32, r & 1);
    }
  }
  use_tuning(&cuda_base);
}

/* The decode GEMM's three kernels (a warp per column, W by bulk copies, W
 * through a cp.async ring) at decode row counts, odd widths, k from 8 to
 * beyond what the bulk variant holds in shared memory and the warp kernel
 * in registers. */
/* the warp-per-column kernel at every k and width it takes (as
 * TANDEM_CUDA_GEMV=8,100000,4,100000), or off (=0) */
static void gemv_wide(td_cuda_tuning *t) {
  t->gemv_maxv = 8, t->gemv_maxn = 100000, t->gemv_rows = 4, t->gemv_rows_n = 100000;
}
static void gemv_off(td_cuda_tuning *t) { t->gemv_maxv = TD_OFF, t->gemv_maxn = t->gemv_rows = t->gemv_rows_n = 0; }

Test(cuda, gemm_skinny_kernels) {
  static const int nk[][2] = {{1024, 1024}, {3072, 1024}, {1000, 2816}, {301, 40}, {17, 8},   {96, 64},
                              {5632, 1024}, {40, 8200},   {33, 1000},   {9, 5120},  {70, 1288}, {3, 3080}};
  static const int ms[] = {1, 2, 5, 8, 13, 16};
  /* default; the warp kernel at every k and width it takes; the bulk and the ring kernels at
   * every row count */
  td_cuda_tuning t[4] = {cuda_base, cuda_base, cuda_base, cuda_base};
  gemv_wide(&t[1]);
  gemv_off(&t[2]);
  gemv_off(&t[3]);
  t[3].skinny_bulk = TD_OFF;
  for (int pass = 0; pass < 4; pass++) {
    use_tuning(&t[pass]);
    for (size_t i = 0; i < sizeof nk / sizeof nk[0]; i++)
      for (size_t j = 0; j < sizeof ms / sizeof ms[0]; j++) {
        int m = ms[j], n = nk[i][0], k = nk[i][1];
        if (m > 8 && n > 2048) continue; /* cuBLASLt's */
        gemm_case(m, n, k, TD_ACT_NONE, TD_GEMM_ACCUM, j & 1);
        gemm_case(m, n, k, TD_ACT_GELU_TANH, 0, true);
        gemm_case(m, n, k, TD_ACT_NONE, TD_GEMM_OUT_F32, j & 1);
      }
  }
}

/* ---------------------------------------------------------------- gemm_ex */

typedef struct gex_cfg {
  int m, n, k;
  int norm; /* 0 none, 1 RMSNorm, 2 LayerNorm, 3 RMSNorm without weight (norm_plain), 4 LayerNorm without
               weight and bias (norm_plain, with W's row sums) */
  bool glu, bias;
  td_act act;
  unsigned flags;
  int kv_dh, kv_bs; /* > 0: fused KV write of H = n / 3 / kv_dh heads at column n / 3 */
} gex_cfg;

/* The fused op against the CPU's separate ops. The fused KV write must put
 * exactly the GPU's own output columns into the slots and touch nothing
 * else of the pool. */
static const char *gex_mode = "default";

static void gemm_ex_case(const gex_cfg *p) {
  int m = p->m, n = p->n, k = p->k, ny = p->glu ? n / 2 : n;
  unsigned flags = p->flags | (p->glu ? TD_GEMM_GLU : 0);
  td_buf_type yt = (flags & TD_GEMM_OUT_F32) ? TD_BUF_F32 : TD_BUF_ACT;
  float *x = rnd((size_t)m * k, 1.0f), *w = rnd((size_t)n * k, 1.7f / sqrtf((float)k)), *b = rnd(n, 0.5f),
        *y0 = rnd((size_t)m * ny, 1.0f), *nw = rnd(k, 0.2f), *nb = rnd(k, 0.3f);
  for (size_t i = 0; i < (size_t)m * k; i++) x[i] = bfr(x[i] + 0.4f); /* a mean for LayerNorm to remove */
  for (int i = 0; i < k; i++) nw[i] += 1.0f;
  pair X = mk(TD_BUF_ACT, x, (size_t)m * k), W = mk(TD_BUF_ACT, w, (size_t)n * k), B = mk(TD_BUF_F32, b, n);
  pair NW = mk(TD_BUF_F32, nw, k), NB = mk(TD_BUF_F32, nb, k);
  float *ws = calloc((size_t)n, sizeof(float)); /* W's row sums (w is bf16-representable) */
  for (int j = 0; j < n; j++)
    for (int i = 0; i < k; i++) ws[j] += w[(size_t)j * k + i];
  pair WS = mk(TD_BUF_F32, ws, n);
  bool plain = p->norm == 3 || p->norm == 4;
  pair XN = mk(TD_BUF_ACT, NULL, (size_t)m * k), GL = mk(TD_BUF_ACT, NULL, (size_t)m * n);
  pair Y = mk(yt, (flags & TD_GEMM_ACCUM) ? y0 : NULL, (size_t)m * ny);
  td_gemm_args ag = {.x = X.g, .w = W.g, .bias = p->bias ? B.g : NULL, .y = Y.g, .m = m, .n = n, .k = k,
                     .act = p->act, .flags = flags, .norm_w = p->norm == 1 || p->norm == 2 ? NW.g : NULL,
                     .norm_b = plain ? NULL : NB.g, .norm_eps = 1e-5f,
                     .norm_rms = p->norm == 1 || p->norm == 3, .norm_plain = plain,
                     .norm_wsum = p->norm == 4 ? WS.g : NULL, .scratch_norm = XN.g, .scratch_glu = GL.g};
  td_gemm_args ac = ag;
  ac.x = X.c, ac.w = W.c, ac.bias = p->bias ? B.c : NULL, ac.y = Y.c;
  ac.norm_w = p->norm == 1 || p->norm == 2 ? NW.c : NULL, ac.norm_b = plain ? NULL : NB.c;
  ac.norm_wsum = p->norm == 4 ? WS.c : NULL;
  ac.scratch_norm = XN.c, ac.scratch_glu = GL.c;
  paged_rig r = {0};
  pair S = {0};
  int32_t *slots = NULL;
  int hd = n / 3, H = p->kv_dh ? hd / p->kv_dh : 0;
  if (p->kv_dh) {
    int nb_blocks = (m + p->kv_bs - 1) / p->kv_bs + 3, total = nb_blocks * p->kv_bs;
    rig_pool(&r, 2, H, p->kv_dh, p->kv_bs, m % 2 ? 64 : 0, nb_blocks);
    int32_t *perm = malloc(sizeof(int32_t) * total);
    slots = malloc(sizeof(int32_t) * m);
    for (int i = 0; i < total; i++) perm[i] = i;
    for (int i = total - 1; i > 0; i--) {
      int j = irand(i + 1), t = perm[i];
      perm[i] = perm[j];
      perm[j] = t;
    }
    for (int i = 0; i < m; i++) slots[i] = i % 7 == 5 ? -1 : perm[i];
    S = mk(TD_BUF_I32, slots, m);
    free(perm);
    ag.kv_pool = r.pool.g, ag.kv_layout = &r.l, ag.kv_layer = 1, ag.kv_col = hd, ag.kv_slots = S.g;
    ac.kv_pool = r.pool.c, ac.kv_layout = &r.l, ac.kv_layer = 1, ac.kv_col = hd, ac.kv_slots = S.c;
  }
  RUN2(td_gemm_ex(G, &ag), td_gemm_ex(C, &ac));
  double e = compare(&Y, 0);
  /* the relative error of a few outputs is a small sample of bf16 roundings:
   * 12 outputs (m 1, n 24, GLU) exceeded 1e-2 in 0.5 % of simulated draws */
  double tol = TOL * fmax(1.0, sqrt(64.0 / ((double)m * ny)));
  cr_expect(e <= tol, "gemm_ex (%s) m=%d n=%d k=%d norm=%d glu=%d bias=%d act=%d flags=%u kv=%d: error %.3g (tolerance %.3g)",
            gex_mode, m, n, k, p->norm, p->glu, p->bias, p->act, flags, p->kv_dh, e, tol);
  if (p->kv_dh) {
    float *yg = get(G, &Y, true), *pg = get(G, &r.pool, true);
    size_t be = td_kv_block_elems(&r.l), hs = (size_t)p->kv_bs * p->kv_dh;
    bool *hit = calloc(r.pool.n, sizeof(bool));
    int bad_rows = 0;
    for (int i = 0; i < m; i++) {
      if (slots[i] < 0) continue;
      size_t base = (size_t)(slots[i] / p->kv_bs) * be + (size_t)1 * 2 * H * hs /* layer 1 */ +
                    (size_t)(slots[i] % p->kv_bs) * p->kv_dh;
      for (int kv = 0; kv < 2; kv++)
        for (int c = 0; c < hd; c++) {
          size_t at = base + (size_t)kv * H * hs + (size_t)(c / p->kv_dh) * hs + c % p->kv_dh;
          hit[at] = true;
          if (pg[at] != yg[(size_t)i * n + hd + kv * hd + c]) bad_rows++;
        }
    }
    size_t stray = 0;
    for (size_t i = 0; i < r.pool.n; i++)
      if (!hit[i] && memcmp(&pg[i], &r.pool_h[i], sizeof(float)) != 0) stray++;
    cr_expect(bad_rows == 0 && stray == 0, "gemm_ex (%s) KV write m=%d dh=%d bs=%d: %d wrong values, %zu stray writes",
              gex_mode, m, p->kv_dh, p->kv_bs, bad_rows, stray);
    double ep = compare(&r.pool, 0);
    cr_expect(ep <= TOL, "gemm_ex KV pool vs CPU: error %.3g", ep);
    free(hit);
    free(yg);
    free(pg);
    drop(&S);
    rig_drop(&r);
    free(slots);
  }
  pair *ps[] = {&X, &W, &B, &NW, &NB, &XN, &GL, &Y, &WS};
  for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) drop(ps[i]);
  free(ws);
  free(x);
  free(w);
  free(b);
  free(y0);
  free(nw);
  free(nb);
}

Test(cuda, gemm_ex) {
  static const gex_cfg cfg[] = {
      /* m n k norm glu bias act flags kv_dh kv_bs */
      {1, 3072, 1024, 1, false, false, TD_ACT_NONE, 0, 64, 16},       /* decode QKV + KV write, batch 1 */
      {17, 3072, 1024, 1, false, false, TD_ACT_NONE, 0, 64, 16},
      {64, 3072, 1024, 1, false, true, TD_ACT_NONE, 0, 64, 16},
      {5, 5632, 1024, 1, true, false, TD_ACT_GELU_TANH, 0, 0, 0},     /* gated FFN input */
      {33, 5632, 1024, 1, true, true, TD_ACT_GELU_TANH, 0, 0, 0},
      {64, 5632, 1024, 1, true, false, TD_ACT_GELU_TANH, 0, 0, 0},
      {16, 1024, 1024, 1, false, false, TD_ACT_NONE, 0, 0, 0},        /* cross-attention query */
      {3, 1000, 200, 2, false, true, TD_ACT_SILU, 0, 0, 0},           /* LayerNorm, fused up to 16 rows */
      {16, 514, 1280, 2, true, true, TD_ACT_GELU, 0, 0, 0},           /* n / 2 odd */
      {40, 512, 256, 2, false, true, TD_ACT_NONE, 0, 0, 0},           /* LayerNorm over 16 rows: separate ops */
      {64, 1024, 2816, 0, false, false, TD_ACT_NONE, TD_GEMM_ACCUM, 0, 0}, /* residual add */
      {7, 1001, 96, 0, false, true, TD_ACT_GELU, TD_GEMM_OUT_F32, 0, 0},
      {50, 96, 64, 1, false, true, TD_ACT_RELU, 0, 0, 0},
      {1, 24, 40, 1, true, false, TD_ACT_GELU_TANH, 0, 0, 0},
      {9, 256, 576, 1, false, false, TD_ACT_NONE, 0, 0, 0},           /* 3 K splits: uneven column owners */
      {5, 512, 576, 1, true, true, TD_ACT_GELU_TANH, 0, 0, 0},
      {48, 300, 2816, 0, false, true, TD_ACT_NONE, TD_GEMM_ACCUM | TD_GEMM_OUT_F32, 0, 0},
      {65, 768, 512, 1, true, false, TD_ACT_GELU_TANH, 0, 0, 0},      /* over 64 rows: separate ops */
      {3, 100, 36, 1, false, false, TD_ACT_NONE, 0, 0, 0},            /* k % 8 != 0: separate ops */
      {12, 90, 64, 1, false, false, TD_ACT_NONE, 0, 10, 5},           /* odd head size and block size */
      {70, 384, 128, 0, false, true, TD_ACT_NONE, 0, 64, 16},         /* KV write after cuBLASLt */
      {37, 2050, 1000, 1, true, true, TD_ACT_GELU_TANH, 0, 0, 0},     /* n / 2 odd, k % 64 != 0 */
      {20, 1536, 512, 1, false, true, TD_ACT_NONE, TD_GEMM_ACCUM, 32, 7}, /* KV write with a residual */
      {64, 1024, 2816, 1, false, false, TD_ACT_RELU, 0, 0, 0},
      {3001, 1030, 512, 1, true, true, TD_ACT_GELU_TANH, 0, 0, 0},   /* encoder-sized */
      {1500, 768, 384, 2, false, true, TD_ACT_GELU, 0, 0, 0},
      {700, 384, 256, 1, false, false, TD_ACT_NONE, 0, 32, 16}, /* KV write of many rows */
      /* the decoder's folded RMSNorms: scaled by 1 / rms inside the GEMM */
      {1, 3072, 1024, 3, false, false, TD_ACT_NONE, 0, 64, 16},       /* decode QKV + KV write, batch 1 */
      {4, 3072, 1024, 3, false, true, TD_ACT_NONE, 0, 64, 16},
      {1, 1024, 1024, 3, false, false, TD_ACT_NONE, 0, 0, 0},         /* cross-attention query */
      {8, 5632, 1024, 3, true, false, TD_ACT_GELU_TANH, 0, 0, 0},     /* gated FFN input */
      {1, 5632, 1024, 3, true, true, TD_ACT_GELU_TANH, 0, 0, 0},
      {5, 1000, 200, 3, false, true, TD_ACT_SILU, 0, 0, 0},           /* odd n, k % 64 != 0 */
      {13, 90, 64, 3, false, false, TD_ACT_NONE, 0, 10, 5},           /* odd head and block size */
      {16, 514, 1280, 3, true, true, TD_ACT_GELU, 0, 0, 0},           /* n / 2 odd */
      {3, 100, 36, 3, false, false, TD_ACT_NONE, 0, 0, 0},            /* k % 8 != 0: separate ops */
      {40, 512, 256, 3, true, false, TD_ACT_GELU_TANH, 0, 0, 0},      /* over 16 rows: separate ops */
      {2, 1024, 2816, 3, false, false, TD_ACT_NONE, 0, 0, 0},         /* the deep ring (k = 2816) */
      /* beyond the fused rows: cuBLASLt, the 1 / rms scaling in the GLU or KV-write kernel after it */
      {64, 3072, 1024, 3, false, false, TD_ACT_NONE, 0, 64, 16},      /* decode QKV + KV write, batch 64 */
      {64, 5632, 1024, 3, true, false, TD_ACT_GELU_TANH, 0, 0, 0},    /* gated FFN input, batch 64 */
      {33, 1536, 512, 3, false, false, TD_ACT_NONE, 0, 32, 7},        /* odd rows and block size */
      {20, 2064, 520, 3, true, false, TD_ACT_SILU, 0, 0, 0},
      /* folded LayerNorms (Whisper, mBART): (x W^T - mean * row sums) / std inside the GEMM */
      {1, 3840, 1280, 4, false, true, TD_ACT_NONE, 0, 64, 16},        /* decode QKV + KV write, batch 1 */
      {4, 3072, 1024, 4, false, true, TD_ACT_NONE, 0, 64, 16},
      {1, 1280, 1280, 4, false, true, TD_ACT_NONE, 0, 0, 0},          /* cross-attention query */
      {2, 5120, 1280, 4, false, true, TD_ACT_GELU, 0, 0, 0},          /* FFN input */
      {8, 5632, 1024, 4, true, true, TD_ACT_GELU_TANH, 0, 0, 0},      /* gated */
      {5, 1000, 200, 4, false, true, TD_ACT_SILU, 0, 0, 0},           /* odd n, k % 64 != 0 */
      {3, 100, 36, 4, false, true, TD_ACT_NONE, 0, 0, 0},             /* k % 8 != 0: separate ops */
      {40, 512, 256, 4, true, true, TD_ACT_GELU_TANH, 0, 0, 0},       /* over 16 rows: separate ops */
      {16, 514, 1280, 4, true, true, TD_ACT_GELU, 0, 0, 0},           /* GLU beyond the bulk kernel: norm apart */
      {2, 1280, 5120, 4, false, true, TD_ACT_NONE, 0, 0, 0},          /* the deep ring (k = 5120) */
      /* one row on both sides of the warp-per-column kernel's limits (k, GLU) */
      {1, 4098, 2048, 3, true, true, TD_ACT_GELU_TANH, 0, 0, 0},      /* GLU, 8 pieces a lane, n / 2 odd */
      {1, 1000, 2816, 3, false, false, TD_ACT_NONE, 0, 0, 0},
      {1, 1288, 5120, 4, false, true, TD_ACT_GELU, 0, 0, 0},
      {1, 1536, 1288, 3, false, true, TD_ACT_NONE, 0, 64, 16},        /* KV write, k % 256 != 0 */
  };
  /* the backend's default fusions, then every fusion up to 16 rows */
  td_cuda_tuning t[5] = {cuda_base, cuda_base, cuda_base, cuda_base, cuda_base};
  t[1].fuse_rows = 16, t[1].fuse_mask = 7;
  t[2].skinny_bulk = TD_OFF;
  gemv_wide(&t[3]);
  gemv_off(&t[4]);
  static const char *modes[] = {"default", "all fused", "cp.async ring", "warp kernel to k = 2048 and 4 rows", "no warp kernel"};
  for (int pass = 0; pass < 5; pass++) {
    use_tuning(&t[pass]);
    gex_mode = modes[pass];
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) gemm_ex_case(&cfg[c]);
  }
}

/* Block tables [S, stride] of the pool's blocks in random order, enough
 * for ctx[s] slots of each sequence; -1 past them (never read). */
static void heads_case(int m, int heads, int n, int k, bool w_t, bool bias) {
  float *x = rnd((size_t)m * heads * k, 1.0f), *w = rnd((size_t)heads * n * k, 0.5f);
  float *bh = bias ? rnd((size_t)heads * n, 1.0f) : NULL;
  pair X = mk(TD_BUF_ACT, x, (size_t)m * heads * k), W = mk(TD_BUF_ACT, w, (size_t)heads * n * k);
  pair Y = mk(TD_BUF_ACT, NULL, (size_t)m * heads * n), B = {0};
  if (bias) B = mk(TD_BUF_F32, bh, (size_t)heads * n);
  RUN2(td_gemm_heads(G, X.g, W.g, bias ? B.g : NULL, Y.g, m, heads, n, k, w_t),
       td_gemm_heads(C, X.c, W.c, bias ? B.c : NULL, Y.c, m, heads, n, k, w_t));
  double e = compare(&Y, 0);
  cr_expect(e <= TOL, "gemm_heads m=%d heads=%d n=%d k=%d w_t=%d bias=%d: error %.3g", m, heads, n, k, w_t, bias, e);
  drop(&X);
  drop(&W);
  drop(&Y);
  if (bias) drop(&B);
  free(x);
  free(w);
  free(bh);
}

Test(cuda, gemm_heads) {
  /* the tensor-core kernel (n % 64 == 0, k % 16 == 0; split K over a
   * cluster where blocks are few), then every case on cuBLASLt */
  for (int lt = 0; lt < 2; lt++) {
    td_cuda_tuning t = cuda_base;
    t.heads_lt = lt ? TD_ON : TD_OFF;
    use_tuning(&t);
    heads_case(64, 16, 1024, 64, false, false); /* the query into state space */
    heads_case(64, 16, 64, 1024, true, true);   /* the mix back to a head, V bias */
    heads_case(1, 16, 1024, 64, false, false);
    heads_case(1, 20, 64, 1280, true, true); /* K over a cluster of 8 blocks */
    heads_case(37, 7, 40, 24, false, true); /* widths only cuBLASLt takes */
    heads_case(5, 3, 24, 40, true, false);
    heads_case(130, 8, 512, 64, false, false); /* three row tiles */
    heads_case(77, 5, 128, 48, false, true);
    heads_case(3, 4, 192, 512, true, true);
    heads_case(200, 2, 64, 16, true, false);
  }
}

