/* The decode step and the encoder on a GPU, on a model of Flan-T5-large
 * (or Flan-T5-XL, BART-large, Whisper-large-v3) shape with random bf16 weights, against the memory floor (bytes read /
 * measured copy bandwidth) and the matrix floor (FLOPs / measured cuBLAS
 * bf16 rate).
 *   bench-decode-step [--tp N | --pp N [--pp-sets 2] | --tp-alone N] [--batches 1,16,64] [--enc-len 512] [--ctx 64]
 *                     [--steps N] [--shape flan-t5-large|flan-t5-xl|bart-large|whisper-large-v3] [--no-record]
 *                     [--model-dir DIR] [--trace BATCH [--trace-gpus]] [--trace-encoder] [--block-size N]
 *                     [--cross-mode auto|kv|states|dual] [--states-rows N] [--enc-split rows|heads]
 *                     [--cross-kv-dtype bf16|int8]
 * With --tp / --pp the ranks are threads, one GPU each, joined by NCCL.
 * --tp-alone N: rank 0 of a TP=N group alone on one GPU, its exchanges
 * left out (td_comm_create_alone): what a rank computes, against which a
 * group's step shows what its exchanges cost; floors are a rank's share.
 * --model-dir keeps the random checkpoint in DIR (written there once, then
 * reused), so that runs under different settings load the same weights.
 * --trace prints the kernel timeline of one decode step at that batch
 * (CUPTI; builds without it say so); --trace-encoder that of one encoder run
 * (of the largest batch's inputs); --trace-gpus: two steps, every rank's
 * GPU on one clock (when each rank reaches each exchange). --block-size: tokens a paged KV block
 * (default 16). --cross-mode: what the cross pool caches
 * (td_model_opts.cross_mode; default auto, i.e. dual: steps of at least
 * --states-rows rows, the backend's choice by default, attend over the
 * states); the table names each step's path and gives both floors, the
 * per-layer K/V one and the one of the bytes that path reads (--cross-states:
 * --cross-mode states). Whisper's encoder input is 30 s of
 * synthetic mel features (3000 frames, 1500 encoder positions: --enc-len
 * is fixed at 1500). --enc-split rows: a TP group's encoder runs each rank's
 * share of the rows over the whole weights (td_model_opts.enc_rows), heads
 * (the default) each rank's heads and FFN slice. --cross-kv-dtype int8: the
 * cross K/V in int8 with a float scale a row (td_model_opts.cross_int8):
 * the path "kv8", its own floor over those bytes. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bench_util.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/settings.h"
#include "kernel_trace.h"
#include "kvcache/kvcache.h"
#include "model/model.h"
#include "random_model.h"

typedef struct cfg {
  int tp, pp, world;
  bool alone; /* --tp-alone: rank 0 of tp, no peers */
  int pp_sets; /* 2: two running sets alternate through the stages (step ms: a set's step) */
  int batches[8], n_batches;
  int enc_len, ctx, steps;
  int trace; /* batch whose step is traced, 0: none */
  bool trace_enc; /* the encoder run traced too */
  bool trace_gpus; /* the traced steps: two, every GPU printed */
  int block_size; /* tokens a paged KV block */
  td_cross_mode cross_mode;
  int states_rows; /* td_model_opts.states_rows */
  bool enc_rows;   /* TP: the encoder split by rows (td_model_opts.enc_rows) */
  bool cross_int8; /* td_model_opts.cross_int8 */
  const char *dir;
  td_random_shape shape;
  uint8_t nccl_id[TD_NCCL_ID_BYTES];
  td_cuda_tuning cuda;   /* main's settings (TANDEM_CUDA_*) */
  td_model_tuning model; /* ... and the model's */
  pthread_barrier_t *barrier; /* the ranks, around a traced step */
} cfg;

typedef struct rank {
  const cfg *c;
  int r;
  td_status st;
  char err[512];
  /* rank 0's measurements */
  double copy_gbs, gemm_tflops, enc_ms, step_ms[8];
  double enqueue_ms[8]; /* the host's part: until td_model_step returns */
  double ar_us[8]; /* TP: one all-reduce of a step's B x d_model bf16 (graph replay) */
  double enc_ar_us; /* TP: one all-reduce of the encoder's rows (every input's positions x d_model) */
  double weight_bytes;
  int states_rows; /* the model's: steps of this many rows attend over the states */
  bool takes_states[8]; /* each batch's step did (td_model_takes_states) */
  td_cross_mode mode; /* as the model resolved it (STATES: the encoder projects no cross K/V) */
} rank;

static double ms_since(int64_t t0) { return (double)(td_now_ns() - t0) * 1e-6; }

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Ceilings measured on this device: device copy and a large bf16 GEMM. */
static td_status ceilings(td_backend *b, double *gbs, double *tflops) {
  size_t n = (size_t)1 << 29; /* 1 GiB of bf16 */
  void *x = NULL, *y = NULL;
  TD_TRY(td_alloc(b, TD_BUF_ACT, n, &x));
  TD_TRY(td_alloc(b, TD_BUF_ACT, n, &y));
  /* random data throughout: repeating patterns toggle fewer bits, draw less
   * power and let the GEMM run at clocks real weights never see */
  size_t chunk = (size_t)1 << 20;
  float *h = malloc(sizeof(float) * chunk);
  if (!h) return td_err(TD_ERR_NOMEM, "out of memory");
  uint64_t st = 0x9e3779b97f4a7c15ull;
  for (size_t off = 0; off < n; off += chunk) {
    for (size_t i = 0; i < chunk; i++) {
      st ^= st << 13, st ^= st >> 7, st ^= st << 17;
      h[i] = (float)(st >> 40) / (float)(1 << 24) - 0.5f;
    }
    TD_TRY(td_upload(b, TD_BUF_ACT, (char *)x + off * 2, h, chunk));
  }
  TD_TRY(td_copy_d2d(b, y, x, n * 2));
  TD_TRY(td_sync(b));
  int64_t t0 = td_now_ns();
  for (int i = 0; i < 10; i++) TD_TRY(td_copy_d2d(b, i % 2 ? x : y, i % 2 ? y : x, n * 2));
  TD_TRY(td_sync(b));
  *gbs = 10.0 * 2 * (double)n * 2 / (ms_since(t0) * 1e-3) / 1e9; /* read + write */
  int M = 8192;
  t0 = 0;
  double best = 1e30;
  /* sustained, as the encoder is measured: 4 back-to-back GEMMs per sample */
  for (int i = 0; i < 4; i++) {
    TD_TRY(td_sync(b));
    int64_t s = td_now_ns();
    for (int k = 0; k < 4; k++) TD_TRY(td_gemm(b, x, (char *)x + (size_t)M * M * 2, NULL, y, M, M, M, TD_ACT_NONE, 0));
    TD_TRY(td_sync(b));
    double ms = ms_since(s) / 4;
    if (i > 0 && ms < best) best = ms;
  }
  *tflops = 2.0 * M * M * (double)M / (best * 1e-3) / 1e12;
  free(h);
  td_free(b, x);
  td_free(b, y);
  return TD_OK;
}

/* One all-reduce of a decode step's B x d_model bf16 values, as the step
 * runs it (captured in a graph: 64 back to back, median of five replays). */
static td_status time_allreduce(td_backend *b, td_model *m, int B, double *us) {
  enum { CALLS = 64, REPS = 5 };
  size_t n = (size_t)B * td_model_get_config(m)->d_model;
  void *x = NULL;
  td_graph *g = NULL;
  double t[REPS];
  TD_TRY(td_alloc(b, TD_BUF_ACT, n, &x));
  td_status s = td_graph_begin(b), e;
  for (int i = 0; i < CALLS && s == TD_OK; i++) s = td_allreduce_sum(b, x, TD_BUF_ACT, n);
  e = td_graph_end(b, &g);
  if (s == TD_OK) s = e;
  for (int r = 0; r < REPS + 1 && s == TD_OK; r++) {
    int64_t t0 = td_now_ns();
    if ((s = td_graph_launch(b, g)) == TD_OK) s = td_sync(b);
    if (r) t[r - 1] = ms_since(t0) * 1e3 / CALLS;
  }
  if (s == TD_OK) {
    qsort(t, REPS, sizeof *t, cmp_d);
    *us = t[REPS / 2];
  }
  if (g) td_graph_destroy(b, g);
  td_free(b, x);
  return s;
}

/* Every rank of the group here before any goes on: an all-reduce, then its end. */
static td_status meet(td_backend *b) {
  void *x = NULL;
  TD_TRY(td_alloc(b, TD_BUF_ACT, 8, &x));
  td_status s = td_allreduce_sum(b, x, TD_BUF_ACT, 8);
  if (s == TD_OK) s = td_sync(b);
  td_free(b, x);
  return s;
}

static void *rank_main(void *arg) {
  rank *rk = arg;
  const cfg *c = rk->c;
  td_backend *b = NULL;
  td_comm *comm = NULL;
  td_model *m = NULL;
  td_kv_pool *self = NULL, *cross = NULL;
  int32_t *buf = NULL;
  float *feat = NULL;
  td_status s;
  int maxb = 0;
  for (int i = 0; i < c->n_batches; i++) maxb = c->batches[i] > maxb ? c->batches[i] : maxb;
  td_backend_opts bo = {.kind = TD_BACKEND_CUDA, .device = rk->r, .cuda = c->cuda};
  if ((s = td_backend_create(&bo, &b)) != TD_OK) goto out;
  if (c->alone) {
    if ((s = td_comm_create_alone(0, c->tp, &comm)) != TD_OK) goto out;
    td_backend_set_comm(b, comm);
  } else if (c->world > 1) {
    if ((s = td_comm_create_nccl(b, c->nccl_id, rk->r, c->world, &comm)) != TD_OK) goto out;
    td_backend_set_comm(b, comm);
  }
  if (rk->r == 0 && (s = ceilings(b, &rk->copy_gbs, &rk->gemm_tflops)) != TD_OK) goto out;
  int bs = c->block_size;
  td_model_opts mo = {.block_size = bs, .max_seqs = maxb, .max_tokens = maxb * c->ctx, .max_logits = maxb,
                      .max_enc_tokens = maxb * c->enc_len, .max_enc_seqs = maxb, .max_source_len = c->enc_len,
                      .max_target_len = c->ctx + c->steps + 16, .cross_mode = c->cross_mode,
                      .states_rows = c->states_rows, .cross_int8 = c->cross_int8, .tuning = c->model};
  if (c->tp > 1) {
    mo.tp_rank = rk->r;
    mo.tp_size = c->tp;
    mo.enc_rows = c->enc_rows;
  }
  if (c->pp > 1) {
    mo.pp_rank = rk->r;
    mo.pp_size = c->pp;
    mo.pp_sets = c->pp_sets;
  }
  if ((s = td_model_load(c->dir, b, &mo, &m)) != TD_OK) goto out;
  int ncb = (c->enc_len + bs - 1) / bs, nsb = (c->ctx + c->steps + bs) / bs + 1;
  td_kv_layout sl = td_model_self_layout(m), cl = td_model_cross_layout(m);
  rk->states_rows = td_model_states_rows(m);
  rk->mode = td_model_get_opts(m)->cross_mode;
  if ((s = td_kv_pool_create(b, &sl, maxb * nsb, &self)) != TD_OK) goto out;
  if ((s = td_kv_pool_create(b, &cl, maxb * ncb, &cross)) != TD_OK) goto out;
  td_model_set_pools(m, td_kv_pool_memory(self), td_kv_pool_memory(cross));
  const td_model_config *mc = td_model_get_config(m);
  int E = maxb * c->enc_len, T = maxb * c->ctx;
  buf = malloc(sizeof(int32_t) * (size_t)(6 * E + 8 * T + 16 * maxb * (ncb + nsb) + 64));
  int32_t *lens = buf, *toks = lens + maxb, *slots = toks + E;
  for (int i = 0; i < maxb; i++) lens[i] = c->enc_len;
  for (int i = 0; i < E; i++) toks[i] = 3 + (int32_t)((i * 2654435761u) % (uint32_t)(mc->vocab_size - 3));
  for (int sq = 0; sq < maxb; sq++)
    for (int t = 0; t < c->enc_len; t++) slots[sq * c->enc_len + t] = (sq * ncb + t / bs) * bs + t % bs;
  td_encode_input ei = {.n_seqs = maxb, .lens = lens, .tokens = toks, .cross_slots = slots};
  size_t n_feat = c->shape.mels ? (size_t)maxb * c->shape.mels * 2 * c->enc_len : 0;
  if (n_feat) { /* Whisper: mel-like features in [-1, 1], page-locked as the engine stages an encoder batch's */
    if ((s = td_host_alloc(b, sizeof(float) * n_feat, (void **)&feat)) != TD_OK) goto out;
    for (size_t i = 0; i < n_feat; i++) feat[i] = (float)((i * 2654435761u) % 2001u) / 1000.0f - 1.0f;
    ei.features = feat;
  }
  /* the ranks meet first: rank 0 alone measured the ceilings, and a rank
   * seconds ahead would wait in its first exchange inside the warm-up */
  if (c->world > 1 && !c->alone && (s = meet(b)) != TD_OK) goto out;
  /* encoder: one warm-up, then the median of three */
  double enc[3];
  for (int it = 0; it < 4; it++) {
    int64_t t0 = td_now_ns();
    if ((s = td_model_encode(m, &ei, NULL)) != TD_OK) goto out;
    if (it) enc[it - 1] = ms_since(t0);
  }
  qsort(enc, 3, sizeof *enc, cmp_d);
  rk->enc_ms = enc[1];
  if (c->trace_enc) { /* every rank encodes (they meet in the all-reduces); rank 0's GPU is printed */
    if (rk->r == 0 && td_ktrace_begin() != 0) {
      s = td_err(TD_ERR_UNSUPPORTED, "--trace-encoder: CUPTI would not start");
      goto out;
    }
    if (c->world > 1) pthread_barrier_wait(c->barrier);
    if ((s = td_model_encode(m, &ei, NULL)) != TD_OK || (s = td_sync(b)) != TD_OK) goto out;
    if (c->world > 1) pthread_barrier_wait(c->barrier);
    if (rk->r == 0) {
      char title[96];
      snprintf(title, sizeof title, "encoder, %d inputs of %d (GPU 0 of %d)", maxb, c->enc_len, c->world);
      td_ktrace_end_device(stdout, title, 0);
    }
  }
  /* decoder prompts of ctx tokens fill the self KV */
  int32_t *qs = slots + E, *ctx = qs + maxb + 1, *clen = ctx + maxb, *tab = clen + maxb, *ctab = tab + maxb * nsb,
          *pos = ctab + maxb * ncb, *dtok = pos + T, *dslots = dtok + T, *rows = dslots + T;
  for (int sq = 0; sq < maxb; sq++) {
    for (int k = 0; k < nsb; k++) tab[sq * nsb + k] = sq * nsb + k;
    for (int k = 0; k < ncb; k++) ctab[sq * ncb + k] = sq * ncb + k;
    clen[sq] = c->enc_len;
  }
  int P = c->ctx;
  qs[0] = 0;
  for (int sq = 0; sq < maxb; sq++) {
    qs[sq + 1] = qs[sq] + P;
    ctx[sq] = P;
    rows[sq] = qs[sq + 1] - 1;
    for (int t = 0; t < P; t++) {
      int row = sq * P + t;
      dtok[row] = 3 + (row * 7919) % 1000;
      pos[row] = t;
      dslots[row] = tab[sq * nsb + t / bs] * bs + t % bs;
    }
  }
  td_step_input pi = {.n_seqs = maxb, .n_tokens = maxb * P, .tokens = dtok, .positions = pos, .q_start = qs,
                      .ctx_len = ctx, .slots = dslots, .block_table = tab, .block_stride = nsb, .cross_len = clen,
                      .cross_table = ctab, .cross_stride = ncb, .n_logits = maxb, .logit_rows = rows};
  const float *lg;
  if ((s = td_model_step(m, &pi, &lg)) != TD_OK || (s = td_sync(b)) != TD_OK) goto out;
  /* decode steps: every sequence one token at position ctx (graph replay) */
  for (int bi = 0; bi < c->n_batches; bi++) {
    int B = c->batches[bi];
    for (int sq = 0; sq < B; sq++) {
      qs[sq] = sq;
      ctx[sq] = P + 1;
      dtok[sq] = 5 + sq;
      pos[sq] = P;
      dslots[sq] = tab[sq * nsb + P / bs] * bs + P % bs;
      rows[sq] = sq;
    }
    qs[B] = B;
    td_step_input di = {.n_seqs = B, .n_tokens = B, .tokens = dtok, .positions = pos, .q_start = qs, .ctx_len = ctx,
                        .slots = dslots, .block_table = tab, .block_stride = nsb, .cross_len = clen,
                        .cross_table = ctab, .cross_stride = ncb, .n_logits = B, .logit_rows = rows};
    double *t = malloc(sizeof(double) * 2 * (size_t)c->steps), *tq = t + c->steps;
    bool sets = c->pp_sets == 2 && rk->r == 0; /* the first stage launches one set and collects the other */
    for (int it = 0; it < c->steps + 3; it++) {
      int64_t t0 = td_now_ns();
      s = sets ? td_model_step_launch(m, &di, it & 1) : td_model_step(m, &di, &lg);
      double q = ms_since(t0);
      if (s == TD_OK && sets && it > 0) s = td_model_step_collect(m, (it - 1) & 1, &lg);
      if (s != TD_OK || (s = td_sync(b)) != TD_OK) {
        free(t);
        goto out;
      }
      if (it >= 3) t[it - 3] = ms_since(t0), tq[it - 3] = q;
    }
    if (sets && ((s = td_model_step_collect(m, (c->steps + 2) & 1, &lg)) != TD_OK || (s = td_sync(b)) != TD_OK)) {
      free(t);
      goto out;
    }
    qsort(t, (size_t)c->steps, sizeof *t, cmp_d);
    qsort(tq, (size_t)c->steps, sizeof *tq, cmp_d);
    rk->step_ms[bi] = t[c->steps / 2];
    rk->takes_states[bi] = td_model_takes_states(m, B);
    rk->enqueue_ms[bi] = tq[c->steps / 2];
    free(t);
    if (c->trace == B) { /* every rank steps (they meet in the all-reduces); rank 0's GPU is printed */
      if (rk->r == 0 && td_ktrace_begin() != 0) {
        s = td_err(TD_ERR_UNSUPPORTED, "--trace: CUPTI would not start");
        goto out;
      }
      if (c->world > 1) pthread_barrier_wait(c->barrier);
      for (int it = 0; it < (c->trace_gpus ? 2 : 1); it++)
        if ((s = td_model_step(m, &di, &lg)) != TD_OK || (s = td_sync(b)) != TD_OK) goto out;
      if (c->world > 1) pthread_barrier_wait(c->barrier);
      if (rk->r == 0) {
        char title[80];
        if (c->trace_gpus) snprintf(title, sizeof title, "two decode steps, batch %d (%d GPUs)", B, c->world);
        else snprintf(title, sizeof title, "decode step, batch %d (GPU 0 of %d)", B, c->world);
        td_ktrace_end_device(stdout, title, c->trace_gpus ? -1 : 0);
      }
    }
  }
  /* after every step measured: a graph made and dropped here must not sit between them */
  for (int bi = 0; bi < c->n_batches && c->tp > 1 && !c->alone; bi++)
    if ((s = time_allreduce(b, m, c->batches[bi], &rk->ar_us[bi])) != TD_OK) goto out;
  if (c->tp > 1 && !c->alone && (s = time_allreduce(b, m, maxb * c->enc_len, &rk->enc_ar_us)) != TD_OK) goto out;
out:
  if (s != TD_OK) {
    rk->st = s;
    snprintf(rk->err, sizeof rk->err, "rank %d: %s", rk->r, td_errmsg());
    if (comm) td_comm_abort(comm);
  }
  if (feat) td_host_free(b, feat);
  free(buf);
  td_kv_pool_destroy(self);
  td_kv_pool_destroy(cross);
  td_model_destroy(m);
  if (b) td_backend_set_comm(b, NULL);
  td_comm_destroy(comm);
  td_backend_destroy(b);
  return NULL;
}

int main(int argc, char **argv) {
  td_settings settings;
  if (td_settings_from_env(&settings) != TD_OK) {
    fprintf(stderr, "bench: %s\n", td_errmsg());
    return 2;
  }
  td_settings_apply(&settings);
  cfg c = {.tp = 1, .pp = 1, .enc_len = 512, .ctx = 64, .steps = 50, .block_size = 16};
  c.cuda = settings.cuda;
  c.model = settings.model;
  const td_bench_out out = {.results = getenv("TD_RESULTS"), .commit = getenv("TD_COMMIT")};
  int defb[3] = {1, 16, 64};
  memcpy(c.batches, defb, sizeof defb);
  c.n_batches = 3;
  bool record = true;
  const char *shape = "flan-t5-large", *keep = NULL;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--tp") && i + 1 < argc) c.tp = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--tp-alone") && i + 1 < argc) {
      c.tp = atoi(argv[++i]);
      c.alone = true;
    }
    else if (!strcmp(argv[i], "--pp") && i + 1 < argc) c.pp = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--pp-sets") && i + 1 < argc) c.pp_sets = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--enc-len") && i + 1 < argc) c.enc_len = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--ctx") && i + 1 < argc) c.ctx = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--steps") && i + 1 < argc) c.steps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--shape") && i + 1 < argc) shape = argv[++i];
    else if (!strcmp(argv[i], "--no-record")) record = false;
    else if (!strcmp(argv[i], "--model-dir") && i + 1 < argc) keep = argv[++i];
    else if (!strcmp(argv[i], "--trace") && i + 1 < argc) c.trace = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--trace-encoder")) c.trace_enc = true;
    else if (!strcmp(argv[i], "--trace-gpus")) c.trace_gpus = true;
    else if (!strcmp(argv[i], "--enc-split") && i + 1 < argc) {
      const char *v = argv[++i];
      if (strcmp(v, "rows") && strcmp(v, "heads")) {
        fprintf(stderr, "--enc-split: rows or heads, not %s\n", v);
        return 2;
      }
      c.enc_rows = !strcmp(v, "rows");
    }
    else if (!strcmp(argv[i], "--block-size") && i + 1 < argc) c.block_size = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--cross-states")) c.cross_mode = TD_CROSS_STATES;
    else if (!strcmp(argv[i], "--cross-kv-dtype") && i + 1 < argc) {
      const char *v = argv[++i];
      if (strcmp(v, "bf16") && strcmp(v, "int8")) {
        fprintf(stderr, "--cross-kv-dtype: bf16 or int8, not %s\n", v);
        return 2;
      }
      c.cross_int8 = !strcmp(v, "int8");
    }
    else if (!strcmp(argv[i], "--states-rows") && i + 1 < argc) c.states_rows = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--cross-mode") && i + 1 < argc) {
      if (td_cross_mode_parse(argv[++i], &c.cross_mode) != TD_OK) {
        fprintf(stderr, "%s\n", td_errmsg());
        return 2;
      }
    }
    else if (!strcmp(argv[i], "--batches") && i + 1 < argc) {
      c.n_batches = 0;
      for (char *t = strtok(argv[++i], ","); t && c.n_batches < 8; t = strtok(NULL, ",")) c.batches[c.n_batches++] = atoi(t);
    }
  }
  td_log_set_level(TD_LOG_WARN);
  if (c.alone && (c.tp < 2 || c.tp > 64 || c.pp > 1 || c.trace_gpus)) {
    fprintf(stderr, "--tp-alone: 2 to 64 ranks, without --pp and --trace-gpus\n");
    return 2;
  }
  if (!c.alone && (c.tp < 1 || c.tp > 8 || c.pp < 1 || c.pp > 8 || c.tp * c.pp > 8)) {
    fprintf(stderr, "--tp, --pp: at most 8 GPUs in all\n");
    return 2;
  }
  c.world = c.alone ? 1 : c.tp * c.pp;
  const int share = c.alone ? c.tp : c.world; /* the floors: one GPU's share of the model */
  if (c.trace_gpus && !c.trace) {
    fprintf(stderr, "--trace-gpus goes with --trace BATCH\n");
    return 2;
  }
  if (c.pp_sets && (c.pp_sets != 2 || c.pp < 2 || c.trace)) {
    fprintf(stderr, "--pp-sets: 2, with --pp 2 or more and without --trace\n");
    return 2;
  }
  if (c.block_size < 1 || c.block_size > 1024) {
    fprintf(stderr, "--block-size: 1 to 1024 tokens, not %d\n", c.block_size);
    return 2;
  }
  if (!strcmp(shape, "bart-large")) {
    c.shape = (td_random_shape){.model_type = "bart", .d_model = 1024, .enc_layers = 12, .dec_layers = 12, .heads = 16,
                                .head_dim = 64, .ffn = 4096, .vocab = 50265, .bf16 = true, .max_positions = 1024};
  } else if (!strcmp(shape, "whisper-large-v3")) {
    c.shape = (td_random_shape){.model_type = "whisper", .d_model = 1280, .enc_layers = 32, .dec_layers = 32,
                                .heads = 20, .head_dim = 64, .ffn = 5120, .vocab = 51866, .bf16 = true,
                                .max_positions = 1500, .mels = 128, .max_target = 448};
    c.enc_len = 1500; /* 30 s of audio: every Whisper input */
  } else if (!strcmp(shape, "flan-t5-large")) {
    c.shape = (td_random_shape){.model_type = "t5", .d_model = 1024, .enc_layers = 24, .dec_layers = 24, .heads = 16,
                                .head_dim = 64, .ffn = 2816, .vocab = 32128, .gated = true, .bf16 = true,
                                .max_positions = 1024};
  } else if (!strcmp(shape, "flan-t5-xl")) {
    c.shape = (td_random_shape){.model_type = "t5", .d_model = 2048, .enc_layers = 24, .dec_layers = 24, .heads = 32,
                                .head_dim = 64, .ffn = 5120, .vocab = 32128, .gated = true, .bf16 = true,
                                .max_positions = 1024};
  } else {
    fprintf(stderr, "--shape: flan-t5-large, flan-t5-xl, bart-large or whisper-large-v3, not %s\n", shape);
    return 2;
  }
  char dir[512] = "/tmp/td-bench-model-XXXXXX", probe[600];
  if (keep) snprintf(dir, sizeof dir, "%s", keep);
  else if (!mkdtemp(dir)) return 1;
  c.dir = dir;
  snprintf(probe, sizeof probe, "%s/model.safetensors", dir);
  if (!keep || access(probe, R_OK) != 0) {
    int64_t t0 = td_now_ns();
    if (keep && mkdir(dir, 0755) != 0 && errno != EEXIST) {
      fprintf(stderr, "cannot create %s: %s\n", dir, strerror(errno));
      return 1;
    }
    if (td_random_model_write(dir, &c.shape, 7)) {
      fprintf(stderr, "cannot write the model\n");
      return 1;
    }
    fprintf(stderr, "wrote a random %s checkpoint in %.1f s\n", shape, ms_since(t0) / 1000);
  }
  if (c.world > 1 && td_comm_nccl_id(c.nccl_id) != TD_OK) {
    fprintf(stderr, "%s\n", td_errmsg());
    return 1;
  }
  if ((c.trace || c.trace_enc) && !td_ktrace_available()) {
    fprintf(stderr, "--trace: no kernel tracing here (CUPTI)\n");
    c.trace = 0;
    c.trace_enc = false;
  }
  pthread_barrier_t barrier;
  pthread_barrier_init(&barrier, NULL, (unsigned)(c.world > 0 ? c.world : 1));
  c.barrier = &barrier;
  rank rk[8] = {0};
  pthread_t th[8];
  for (int r = 0; r < c.world; r++) {
    rk[r] = (rank){.c = &c, .r = r};
    pthread_create(&th[r], NULL, rank_main, &rk[r]);
  }
  for (int r = 0; r < c.world; r++) pthread_join(th[r], NULL);
  pthread_barrier_destroy(&barrier);
  if (!keep) {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) fprintf(stderr, "could not remove %s\n", dir);
  }
  for (int r = 0; r < c.world; r++)
    if (rk[r].st != TD_OK) {
      fprintf(stderr, "%s\n", rk[r].err);
      return 1;
    }
  /* floors */
  const td_random_shape *sh = &c.shape;
  double d = sh->d_model, hd = (double)sh->heads * sh->head_dim, ff = sh->ffn, Ld = sh->dec_layers, Le = sh->enc_layers;
  double ffw = sh->gated ? 3 * d * ff : 2 * d * ff;
  double dec_w = Ld * (4 * d * hd + 2 * d * hd + ffw) * 2 + (double)sh->vocab * d * 2; /* excludes cross K/V weights */
  double kv_tok = Ld * 2 * hd * 2;                                                     /* bytes per token per sequence */
  double gbs = rk[0].copy_gbs, tf = rk[0].gemm_tflops;
  double enc_tokens = (double)c.batches[c.n_batches - 1] * c.enc_len;
  for (int i = 0; i < c.n_batches; i++)
    if (c.batches[i] > 0) enc_tokens = enc_tokens > c.batches[i] * (double)c.enc_len ? enc_tokens : c.batches[i] * (double)c.enc_len;
  double enc_flops = enc_tokens * (Le * (2 * (4 * d * hd + ffw) + 4 * c.enc_len * hd) +
                                   (rk[0].mode != TD_CROSS_STATES ? Ld * 2 * 2 * d * hd : 0.0));
  if (sh->mels) /* the convolutions: 2 * enc_len frames of 3 x mels taps, then enc_len of 3 x d */
    enc_flops += enc_tokens * (2.0 * 2 * d * 3 * sh->mels + 2.0 * d * 3 * d);
  const char *dev = td_backend_cuda_available() ? "GPU" : "?";
  FILE *p = popen("nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1", "r");
  char devname[128] = "";
  if (p) {
    if (fgets(devname, sizeof devname, p)) devname[strcspn(devname, "\n")] = 0;
    pclose(p);
  }
  if (devname[0]) dev = devname;
  td_sbuf t = {0};
  td_sbuf_printf(&t, "%s shape (d_model %d, %d+%d layers, %d heads of %d, %sFFN %d, vocab %d), random bf16 weights; "
                     "encoder input %d tokens, decoder context %d tokens, KV blocks of %d tokens; %s%s%d. Ceilings measured in the same run: "
                     "device copy %.0f GB/s (read + write), cuBLAS bf16 GEMM 8192^3 on random data %.0f TFLOP/s.\n\n",
                 shape, sh->d_model, sh->enc_layers, sh->dec_layers, sh->heads, sh->head_dim, sh->gated ? "gated " : "",
                 sh->ffn, sh->vocab, c.enc_len, c.ctx, c.block_size,
                 c.alone ? "rank 0 of tensor parallel " : c.tp > 1 ? "tensor parallel " : c.pp > 1 ? "pipeline stages " : "GPUs ",
                 c.alone ? "alone (no exchanges), of " : "", c.alone ? c.tp : c.world, gbs, tf);
  if (c.pp_sets == 2)
    td_sbuf_printf(&t, "Two running sets of the batch each alternate through the stages: step ms is the time a set's step "
                       "takes in the steady state (the first stage launches one set and collects the other's logits), so "
                       "tokens/s counts the batch once a step.\n\n");
  /* the K/V floor (the one the targets are set against): every layer's
   * cross K/V read; the path's own: over the states, also W_k and W_v of
   * every layer and the states once a layer instead of the K/V */
  const char *mode = td_cross_mode_name(rk[0].mode);
  td_sbuf_printf(&t, "Cross pool mode %s.\n\n| batch | path | step ms | tokens/s | K/V floor ms | x K/V floor | "
                     "bytes read GB | floor ms | x floor |\n|---|---|---|---|---|---|---|---|---|\n", mode);
  printf("cross pool mode %s\n%6s %6s %9s %10s %9s %8s %9s %9s %8s\n", mode, "batch", "path", "step ms", "tokens/s",
         "KV fl ms", "x KV fl", "bytes GB", "floor ms", "x floor");
  for (int i = 0; i < c.n_batches; i++) {
    int B = c.batches[i];
    bool states = rk[0].takes_states[i];
    double bytes = dec_w + (double)B * (c.enc_len + c.ctx + 1) * kv_tok;
    double floor_ms = bytes / (gbs * 1e9) * 1e3 / share;
    double ms = rk[0].step_ms[i];
    /* int8 cross K/V: a byte a value and a float scale a row of head_dim */
    double kv8 = dec_w + (double)B * (c.ctx + 1) * kv_tok + (double)B * c.enc_len * Ld * 2 * hd * (1 + 4.0 / sh->head_dim);
    double sb = states ? dec_w + Ld * 2 * d * hd * 2 + (double)B * (c.ctx + 1) * kv_tok + (double)B * c.enc_len * Ld * d * 2
                : c.cross_int8 ? kv8 : bytes;
    double sf = sb / (gbs * 1e9) * 1e3 / share;
    const char *path = states ? "states" : c.cross_int8 ? "kv8" : "kv";
    printf("%6d %6s %9.3f %10.0f %9.3f %8.2f %9.3f %9.3f %8.2f\n", B, path, ms, B / (ms * 1e-3), floor_ms,
           ms / floor_ms, sb / 1e9, sf, ms / sf);
    td_sbuf_printf(&t, "| %d | %s | %.3f | %.0f | %.3f | %.2f | %.3f | %.3f | %.2f |\n", B, path, ms, B / (ms * 1e-3),
                   floor_ms, ms / floor_ms, sb / 1e9, sf, ms / sf);
  }
  for (int i = 0; i < c.n_batches; i++)
    printf("batch %d: the host enqueues a step in %.3f ms\n", c.batches[i], rk[0].enqueue_ms[i]);
  if (c.tp > 1 && !c.alone) {
    td_sbuf_printf(&t, "\nOne all-reduce of the step's rows (B x d_model bf16, in a graph):");
    for (int i = 0; i < c.n_batches; i++) {
      printf("all-reduce at batch %d: %.2f us\n", c.batches[i], rk[0].ar_us[i]);
      td_sbuf_printf(&t, "%s batch %d %.2f us", i ? "," : "", c.batches[i], rk[0].ar_us[i]);
    }
    int inputs = 0; /* the encoder runs the largest batch's inputs */
    for (int i = 0; i < c.n_batches; i++) inputs = c.batches[i] > inputs ? c.batches[i] : inputs;
    printf("all-reduce of the encoder's rows (%d x %d): %.2f us\n", inputs * c.enc_len, sh->d_model, rk[0].enc_ar_us);
    td_sbuf_printf(&t, "; the encoder's rows (%d x %d) %.2f us.\n", inputs * c.enc_len, sh->d_model, rk[0].enc_ar_us);
  }
  double enc_floor = enc_flops / (tf * 1e12) * 1e3 / share;
  printf("encoder %g tokens (%s%s): %.2f ms, %.0f TFLOP/s = %.0f%% of the GEMM rate\n", enc_tokens,
         rk[0].mode != TD_CROSS_STATES ? "with cross-KV projection" : "states into the cross pool",
         c.tp > 1 ? (c.enc_rows ? ", split by rows" : ", split by heads") : "",
         rk[0].enc_ms, enc_flops / (rk[0].enc_ms * 1e-3) / 1e12, 100 * enc_floor / rk[0].enc_ms);
  td_sbuf_printf(&t, "\nEncoder forward of %.0f tokens%s: "
                     "%.2f ms, %.0f TFLOP/s per GPU, %.0f%% of the measured GEMM rate.\n",
                 enc_tokens, rk[0].mode != TD_CROSS_STATES ? " plus the cross-attention K/V projection of every decoder layer" : "",
                 rk[0].enc_ms, enc_flops / (rk[0].enc_ms * 1e-3) / 1e12 / share,
                 100 * enc_floor / rk[0].enc_ms);
  if (record) {
    char title[128];
    snprintf(title, sizeof title, "Decode step and encoder, %s, %s=%d%s%s (bench-decode-step)", shape,
             c.pp > 1 ? "PP" : "TP", c.pp > 1 ? c.pp : c.tp, c.alone ? " rank alone" : "", rk[0].mode == TD_CROSS_KV ? ""
                                                            : rk[0].mode == TD_CROSS_STATES ? ", cross states"
                                                                                            : ", cross dual");
    td_bench_record(&out, title, dev, t.s);
  }
  td_sbuf_free(&t);
  return 0;
}
