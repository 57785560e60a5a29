/* bench-serve: the measure of record for serving. It sends a workload to a
 * running cluster (through the client library) or to an engine in this
 * process, with the same requests and arrivals, and reports throughput,
 * time to first token, time per output token, end-to-end latency and
 * goodput; a table on stdout, a section in bench/RESULTS.md (--record),
 * a PNG of latency against throughput over a sweep of rates (--plot).
 * Against a cluster it also shows how each worker spent the run (busy share,
 * decode steps and batch, encoder runs), from the counters of the router's
 * health before and after: which pool is short.
 *
 *   bench-serve (--router EP | --gateway URL [--gateway-model NAME] | --engine --model DIR [--device cpu|cuda])
 *               [--workload trt|whisper|long|FILE.jsonl] [--requests N] [--seed S]
 *               [--concurrency C | --rate R | --sweep R1,R2,...]
 *               [--ttft-bound MS] [--tpot-bound MS] [--model DIR] [--vocab N]
 *               [--max-batch N] [--max-tokens N] [--kv-blocks N] [--cross-blocks N]
 *               [--cross-mode M] [--cross-kv-dtype bf16|int8] [--label TEXT] [--record] [--plot FILE.png]
 *               [--timeout-ms N] [--results FILE.jsonl]
 *
 * Arrivals: all requests at once (the default), a closed loop of C in
 * flight, an open loop of Poisson arrivals at R requests a second, or one
 * run per rate of a sweep. --gateway sends the same requests as streamed
 * /v1/completions calls to tandem-gateway over HTTP (serve_http.c). The engine target is what tandem-generate runs,
 * driven step by step; its load time is not counted. --results (with --router,
 * one run) writes each answer as it comes, with its submit and answer times
 * on the system's monotonic clock, after a first line with the run's start,
 * so that another program (tandem-faults) can judge every request of a run
 * it disturbed. */
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <uthash.h>

#include "bench_util.h"
#include "client/client.h"
#include "common/clock.h"
#include "common/defaults.h"
#include "common/log.h"
#include "common/settings.h"
#include "engine/engine.h"
#include "model/config.h"
#include "model/model.h"
#include "serve_http.h"
#include "serve_stats.h"
#include "serve_workload.h"

#define MAX_SWEEP 16

typedef struct opts {
  const char *router, *gateway, *gateway_model, *model, *device, *workload, *label, *plot;
  const char *results; /* --results: each answer, a JSON line */
  int http_warm; /* --gateway: connections opened before the clock starts */
  bool engine, record;
  int n, concurrency, vocab, max_batch, max_tokens, kv_blocks, cross_blocks, timeout_ms, max_enc_tokens, max_enc_seqs;
  double mem_fraction;
  double cache_fraction; /* --engine: td_engine_opts.encoder_cache_fraction */
  int repeat;            /* each synthetic input this many times */
  int runs;              /* --runs: the measure this many times, each with its own inputs (seed + k x seed_step) */
  uint64_t seed, seed_step;
  int part, parts;       /* --part Q/N: the requests whose index is Q modulo N */
  double rates[MAX_SWEEP];
  int n_rates;
  double ttft_bound, tpot_bound;
  td_cross_mode cross_mode;
  bool cross_int8; /* --engine: the cross K/V in int8 (td_model_opts.cross_int8) */
  char barrier_dir[3072]; /* --barrier DIR:N: each run starts once N processes reached it */
  int barrier_n;
  int spin_us; /* --router: poll without sleeping this long while answers are due */
} opts;

/* Waits until n processes (this one included) have reached run k: each
 * leaves a file run-K.PID in dir. Engines on several GPUs at once then run
 * their k-th measure together, as a cluster's workers do. */
static td_status barrier(const char *dir, int n, int k) {
  char path[4200], prefix[32];
  snprintf(prefix, sizeof prefix, "run-%d.", k);
  snprintf(path, sizeof path, "%s/%s%d", dir, prefix, (int)getpid());
  FILE *f = fopen(path, "w");
  if (!f) return td_err(TD_ERR_IO, "--barrier: cannot write %s: %s", path, strerror(errno));
  fclose(f);
  int64_t deadline = td_now_ms() + 600000;
  for (;;) {
    DIR *d = opendir(dir);
    if (!d) return td_err(TD_ERR_IO, "--barrier: cannot read %s: %s", dir, strerror(errno));
    int seen = 0;
    for (struct dirent *e; (e = readdir(d));) seen += !strncmp(e->d_name, prefix, strlen(prefix));
    closedir(d);
    if (seen >= n) return TD_OK;
    if (td_now_ms() > deadline)
      return td_err(TD_ERR_TIMEOUT, "--barrier: %d of %d processes reached run %d in 600 s", seen, n, k + 1);
    usleep(200);
  }
}

/* ---------------------------------------------------------------- a run */

typedef struct id_slot {
  const char *id;
  int index;
  UT_hash_handle hh;
} id_slot;

typedef struct run {
  const td_workload *w;
  td_serve_sample *s;
  double *arrive; /* ms from t0 (open loop) */
  int concurrency; /* closed loop: in flight at most (0: open loop / all at once) */
  int next, in_flight, done;
  double t0, t0_wall; /* the run's start: now_ms(), and Unix ms (workers' times are on the wall clock) */
  id_slot *ids, *slots;
  td_client_timings stages; /* the cluster's per-stage times, summed over successful requests */
  int n_staged;
  double gw_sum[3], gw_count[3]; /* --gateway: the gateway's first-event stages over the run (seconds, streams) */
  td_http_hop hop;               /* --gateway: this client's side of the first events */
  FILE *results; /* --results */
  /* --router: every worker's engine counters before and after the run */
  td_serve_counters *before, *after;
  int n_before, n_after;
  int64_t spin_ns;           /* --spin-us */
  unsigned long long events; /* tokens and results taken so far */
} run;

static double now_ms(void) { return (double)td_now_ns() / 1e6; }

static td_status run_init(run *r, const td_workload *w, double rate, int concurrency, uint64_t seed) {
  memset(r, 0, sizeof *r);
  r->w = w;
  r->concurrency = rate > 0 ? 0 : concurrency;
  r->s = calloc((size_t)w->n, sizeof *r->s);
  r->arrive = calloc((size_t)w->n, sizeof *r->arrive);
  r->slots = calloc((size_t)w->n, sizeof *r->slots);
  if (!r->s || !r->arrive || !r->slots) return td_err(TD_ERR_NOMEM, "out of memory");
  td_workload_arrivals(rate, seed, w->n, r->arrive);
  for (int i = 0; i < w->n; i++) {
    id_slot *e = &r->slots[i], *dup = NULL;
    HASH_FIND_STR(r->ids, w->reqs[i].id, dup);
    if (dup) return td_err(TD_ERR_INVALID, "request id %s appears twice in the workload", w->reqs[i].id);
    e->id = w->reqs[i].id;
    e->index = i;
    HASH_ADD_KEYPTR(hh, r->ids, e->id, strlen(e->id), e);
    r->s[i].n_input = w->reqs[i].n_input; /* audio: 0 (in tok/s counts text only) */
  }
  return TD_OK;
}

static void run_free(run *r) {
  free(r->before);
  free(r->after);
  HASH_CLEAR(hh, r->ids);
  free(r->s);
  free(r->arrive);
  free(r->slots);
}

static int index_of(run *r, const char *id) {
  id_slot *e = NULL;
  HASH_FIND_STR(r->ids, id, e);
  return e ? e->index : -1;
}

/* Whether request r->next may go now; fills its submit time. */
static bool due(run *r, double t) {
  if (r->next >= r->w->n) return false;
  if (r->concurrency > 0) return r->in_flight < r->concurrency;
  return r->arrive[r->next] <= t - r->t0;
}

/* ms until the next arrival (open loop), capped. */
static int wait_ms(const run *r, double t, int cap) {
  if (r->next >= r->w->n || r->concurrency > 0) return cap;
  double d = r->t0 + r->arrive[r->next] - t;
  return d <= 0 ? 0 : d < cap ? (int)ceil(d) : cap;
}

static void token_seen(run *r, int i, int seq) {
  if (i < 0 || seq != 0 || r->s[i].first_ms > 0) return;
  r->s[i].first_ms = now_ms();
}

static void result_seen(run *r, int i, bool ok, int n_out) {
  if (i < 0 || r->s[i].done_ms > 0) return;
  td_serve_sample *x = &r->s[i];
  x->done_ms = now_ms();
  x->ok = ok;
  x->n_out = n_out;
  if (x->first_ms <= 0 && ok && n_out > 0) x->first_ms = x->done_ms; /* one chunk carried everything */
  r->in_flight--;
  r->done++;
}

/* ---------------------------------------------------------------- the cluster */

static void cl_tokens(void *ctx, const char *id, int seq, int offset, const int32_t *t, const float *lp, int n) {
  run *r = ctx;
  r->events++;
  if (n > 0) token_seen(r, index_of(r, id), seq);
}

/* One answer as a JSON line: its id, times (ms, the monotonic clock), the
 * first sequence's tokens and the count of sequences, or the error. */
static void write_result(run *r, int i, const td_client_result *res) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "id", res->id);
  cJSON_AddNumberToObject(o, "submit_ms", r->s[i].submit_ms);
  cJSON_AddNumberToObject(o, "done_ms", now_ms());
  if (res->status == TD_OK) {
    cJSON_AddNumberToObject(o, "n_outputs", res->n_outputs);
    cJSON *t = cJSON_AddArrayToObject(o, "tokens");
    for (int k = 0; res->n_outputs > 0 && k < res->outputs[0].n_tokens; k++)
      cJSON_AddItemToArray(t, cJSON_CreateNumber(res->outputs[0].tokens[k]));
  } else {
    cJSON_AddStringToObject(o, "error", res->error ? res->error : "");
    cJSON_AddStringToObject(o, "code", td_status_str(res->status));
  }
  char *line = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  if (line) fprintf(r->results, "%s\n", line);
  free(line);
}

static void cl_result(void *ctx, const td_client_result *res) {
  run *r = ctx;
  r->events++;
  int i = index_of(r, res->id);
  if (r->results && i >= 0 && r->s[i].done_ms <= 0) write_result(r, i, res);
  bool ok = res->status == TD_OK && res->n_outputs > 0;
  if (!ok && i >= 0 && r->s[i].done_ms <= 0)
    TD_WARN("request %s: %s", res->id, res->error ? res->error : td_status_str(res->status));
  if (ok && i >= 0 && r->s[i].done_ms <= 0) {
    const td_client_timings *t = &res->timings;
    td_client_timings *a = &r->stages;
    a->queue_ms += t->queue_ms, a->reserve_ms += t->reserve_ms, a->encode_ms += t->encode_ms;
    a->transfer_ms += t->transfer_ms, a->prefill_ms += t->prefill_ms, a->first_token_ms += t->first_token_ms;
    a->decode_ms += t->decode_ms, a->total_ms += t->total_ms, a->attempts += t->attempts;
    a->worker_first_token_ms += t->worker_first_token_ms;
    r->n_staged++;
  }
  result_seen(r, i, ok, ok ? res->outputs[0].n_tokens : 0);
}

/* How the arrival loop reaches a target: the ZeroMQ client or the HTTP one. */
typedef struct target_i {
  td_status (*submit)(void *t, const opts *o, const td_json_request *q, int index);
  td_status (*poll)(void *t, int timeout_ms, run *r);
} target_i;

/* Submits the workload's requests as they are due and polls for answers
 * until all came back or the run's deadline passed. */
static td_status drive(const target_i *vt, void *t, const opts *o, run *r) {
  td_status s = TD_OK;
  r->t0 = now_ms();
  r->t0_wall = (double)td_wall_ms();
  if (r->results) { /* the clock's start first, for a reader that times other things by it */
    fprintf(r->results, "{\"start_ms\": %.3f}\n", r->t0);
    fflush(r->results);
  }
  double deadline = r->t0 + o->timeout_ms + 60000.0;
  while (r->done < r->w->n && s == TD_OK) {
    double now = now_ms();
    while (due(r, now)) {
      int i = r->next++;
      r->s[i].submit_ms = r->concurrency > 0 ? now : r->t0 + r->arrive[i];
      if ((s = vt->submit(t, o, &r->w->reqs[i], i)) != TD_OK) break;
      r->in_flight++;
    }
    if (s != TD_OK) break;
    if (now > deadline) {
      s = td_err(TD_ERR_TIMEOUT, "%d of %d requests unanswered", r->w->n - r->done, r->w->n);
      break;
    }
    s = vt->poll(t, wait_ms(r, now, 20), r);
  }
  return s;
}

static td_status zmq_submit(void *t, const opts *o, const td_json_request *q, int index) {
  (void)index;
  return td_client_generate(t, q, true, (uint32_t)o->timeout_ms);
}

static td_status zmq_poll(void *t, int timeout_ms, run *r) {
  td_client_events ev = {.on_tokens = cl_tokens, .on_result = cl_result, .ctx = r};
  if (r->spin_ns > 0 && r->in_flight > 0) { /* as the gateway's --spin-us: an answer taken without a wake-up */
    unsigned long long seen = r->events;
    for (int64_t end = td_now_ns() + r->spin_ns; r->events == seen && td_now_ns() < end;)
      TD_TRY(td_client_poll(t, 0, &ev));
    if (r->events != seen) return TD_OK;
  }
  return td_client_poll(t, timeout_ms, &ev);
}

static const target_i zmq_target = {.submit = zmq_submit, .poll = zmq_poll};

/* The workers' counters as the router last heard them: *n rows in a new array. */
static td_status counters(td_client *c, td_serve_counters **out, int *n, bool *busy) {
  td_client_health *h = calloc(1, sizeof *h);
  if (!h) return td_err(TD_ERR_NOMEM, "out of memory");
  td_status s = td_client_health_check(c, TD_DEFAULT_CLIENT_CONNECT_TIMEOUT_MS, h);
  *out = s == TD_OK ? calloc((size_t)(h->n_workers ? h->n_workers : 1), sizeof **out) : NULL;
  if (s == TD_OK && !*out) s = td_err(TD_ERR_NOMEM, "out of memory");
  *n = 0;
  if (busy) *busy = false;
  for (int i = 0; s == TD_OK && i < h->n_workers; i++) {
    const td_client_worker *x = &h->workers[i];
    td_serve_counters *k = &(*out)[(*n)++];
    snprintf(k->id, sizeof k->id, "%s", x->id);
    k->steps = x->steps;
    k->tokens = x->tokens;
    k->encode_runs = x->encode_runs;
    k->encoded = x->encoded;
    k->busy_s = x->busy_seconds;
    k->project_s = x->project_seconds;
    k->began_ms = x->work_began_ms;
    k->ended_ms = x->work_ended_ms;
    if (busy) *busy |= x->running > 0 || x->queued > 0;
  }
  free(h);
  return s;
}

static td_status run_cluster(const opts *o, run *r) {
  td_client *c;
  TD_TRY(td_client_connect_wait(o->router, TD_DEFAULT_CLIENT_CONNECT_TIMEOUT_MS, &c)); /* a wrong --router says so */
  /* the workers' counters are extra: without a health answer the run goes on without them */
  bool looks = counters(c, &r->before, &r->n_before, NULL) == TD_OK;
  if (!looks) fprintf(stderr, "bench-serve: no workers' counters (%s): their table is left out\n", td_errmsg());
  td_status s = drive(&zmq_target, c, o, r);
  /* a worker's load reaches the router with its heartbeats (at once when it
   * goes idle): look until none runs anything and two looks 100 ms apart
   * agree, or 3 s */
  bool busy = true, same = false;
  for (int t = 0; looks && s == TD_OK && (busy || !same) && t < 30; t++) {
    td_serve_counters *prev = r->after;
    int n_prev = r->n_after;
    r->after = NULL;
    usleep(100 * 1000);
    looks = counters(c, &r->after, &r->n_after, &busy) == TD_OK;
    same = looks && prev && n_prev == r->n_after && !memcmp(prev, r->after, sizeof *prev * (size_t)n_prev);
    free(prev);
  }
  if (!looks) {
    free(r->after);
    r->after = NULL;
    r->n_after = 0;
  }
  td_client_close(c);
  return s;
}

/* ---------------------------------------------------------------- the gateway (HTTP) */

static void gw_first(void *ctx, int i) { token_seen(ctx, i, 0); }
static void gw_done(void *ctx, int i, bool ok, int n_tokens) { result_seen(ctx, i, ok, n_tokens); }

static td_status http_submit(void *t, const opts *o, const td_json_request *q, int index) {
  (void)o;
  return td_http_bench_submit(t, q, index);
}

static td_status http_poll(void *t, int timeout_ms, run *r) {
  td_http_events ev = {.first = gw_first, .done = gw_done, .ctx = r};
  return td_http_bench_poll(t, timeout_ms, &ev);
}

static const target_i http_target = {.submit = http_submit, .poll = http_poll};

static td_status run_gateway(const opts *o, run *r) {
  td_http_bench *h;
  TD_TRY(td_http_bench_create(o->gateway, o->gateway_model, &h));
  td_status s = td_http_bench_warm(h, o->http_warm);
  if (s == TD_OK) s = td_http_bench_prepare(h, r->w->reqs, r->w->n);
  td_http_stages before, after;
  bool staged = s == TD_OK && td_http_bench_stages(h, &before) == TD_OK;
  if (s == TD_OK) s = drive(&http_target, h, o, r);
  r->hop = td_http_bench_hop(h);
  if (s == TD_OK && staged && td_http_bench_stages(h, &after) == TD_OK)
    for (int i = 0; i < 3; i++) {
      r->gw_sum[i] = after.sum[i] - before.sum[i];
      r->gw_count[i] = after.count[i] - before.count[i];
    }
  td_http_bench_destroy(h);
  return s;
}

/* ---------------------------------------------------------------- the engine */

typedef struct eng {
  td_backend *b;
  td_model *m;
  td_engine *e;
  run *r;
  double busy_s; /* inside td_engine_step, as a worker counts its busy time */
} eng;

/* The engine's counters as a worker reports its own, for the same table. */
static td_serve_counters eng_counters(const eng *g) {
  td_engine_stats es = td_engine_get_stats(g->e);
  td_serve_counters k = {.steps = (unsigned long long)es.steps, .tokens = (unsigned long long)es.tokens_generated,
                         .encode_runs = (unsigned long long)es.encode_runs, .encoded = (unsigned long long)es.encodes,
                         .busy_s = g->busy_s};
  snprintf(k.id, sizeof k.id, "engine");
  return k;
}

static void en_token(void *ctx, uint64_t handle, void *user, int seq, int32_t token, float logprob) {
  eng *g = ctx;
  token_seen(g->r, (int)(intptr_t)user, seq);
}

static void en_finish(void *ctx, const td_result *res) {
  eng *g = ctx;
  bool ok = res->status == TD_OK && res->n_outputs > 0;
  if (!ok) TD_WARN("request %s: %s", res->id ? res->id : "?", res->error ? res->error : td_status_str(res->status));
  result_seen(g->r, (int)(intptr_t)res->user, ok, ok ? res->outputs[0].n_tokens : 0);
}

static td_status engine_open(const opts *o, const td_settings *st, int n_requests, eng *g, double *load_s) {
  double t = now_ms();
  td_backend_opts bo = {.kind = strcmp(o->device, "cuda") ? TD_BACKEND_CPU : TD_BACKEND_CUDA, .cuda = st->cuda};
  TD_TRY(td_backend_create(&bo, &g->b));
  bool gpu = bo.kind == TD_BACKEND_CUDA;
  td_model_opts mo = {.max_seqs = o->max_batch, .max_tokens = o->max_tokens, .cross_mode = o->cross_mode,
                      .cross_int8 = o->cross_int8, .tuning = st->model,
                      .max_enc_tokens = o->max_enc_tokens ? o->max_enc_tokens
                                        : gpu ? TD_DEFAULT_GPU_MAX_ENC_TOKENS : TD_DEFAULT_MAX_ENC_TOKENS,
                      .max_enc_seqs = o->max_enc_seqs ? o->max_enc_seqs
                                      : gpu ? TD_DEFAULT_GPU_MAX_ENC_SEQS : TD_DEFAULT_MAX_ENC_SEQS};
  TD_TRY(td_model_load(o->model, g->b, &mo, &g->m));
  td_engine_opts eo = {.self_blocks = o->kv_blocks, .cross_blocks = o->cross_blocks, .max_running = o->max_batch,
                       .max_step_tokens = o->max_tokens, .max_queue = n_requests + 1,
                       .gpu_memory_fraction = o->mem_fraction > 0 ? o->mem_fraction : TD_DEFAULT_GPU_MEMORY_FRACTION,
                       .encoder_cache_fraction = o->cache_fraction};
  td_engine_callbacks cb = {.on_token = en_token, .on_finish = en_finish, .ctx = g};
  TD_TRY(td_engine_create(g->m, &eo, &cb, &g->e));
  *load_s = (now_ms() - t) / 1000.0;
  return TD_OK;
}

static void engine_close(eng *g) {
  td_engine_destroy(g->e);
  td_model_destroy(g->m);
  td_backend_destroy(g->b);
  memset(g, 0, sizeof *g);
}

static td_status run_engine(eng *g, run *r) {
  g->r = r;
  r->t0 = now_ms();
  r->t0_wall = (double)td_wall_ms();
  while (r->done < r->w->n) {
    double t = now_ms();
    while (due(r, t)) {
      int i = r->next++;
      r->s[i].submit_ms = r->concurrency > 0 ? t : r->t0 + r->arrive[i];
      td_request q;
      td_request_from_json(&r->w->reqs[i], &q);
      q.user = (void *)(intptr_t)i;
      uint64_t h;
      r->in_flight++;
      if (td_engine_add(g->e, &q, &h) != TD_OK) {
        TD_WARN("request %s refused: %s", r->w->reqs[i].id, td_errmsg());
        result_seen(r, i, false, 0);
      }
    }
    if (!td_engine_idle(g->e)) {
      double t0 = now_ms();
      TD_TRY(td_engine_step(g->e));
      g->busy_s += (now_ms() - t0) / 1e3;
    } else if (r->done < r->w->n) {
      int ms = wait_ms(r, now_ms(), 20);
      if (ms > 0) usleep((useconds_t)ms * 1000);
    }
  }
  return TD_OK;
}

/* ---------------------------------------------------------------- report */

static const char *arrivals_name(const opts *o, double rate, int k, char *buf, size_t cap) {
  char nth[32] = "";
  if (o->runs > 1) snprintf(nth, sizeof nth, ", run %d", k + 1);
  if (rate > 0)
    snprintf(buf, cap, "Poisson %.3g/s", rate);
  else if (o->concurrency > 0)
    snprintf(buf, cap, "%d in flight%s", o->concurrency, nth);
  else
    snprintf(buf, cap, "all at once%s", nth);
  return buf;
}

static void row(td_sbuf *b, const char *arr, const td_serve_summary *m) {
  td_sbuf_printf(b,
                 "| %s | %d/%d | %.2f | %.0f | %.0f | %.2f / %.2f / %.2f | %.2f / %.2f / %.2f | "
                 "%.0f / %.0f / %.0f | %.2f |\n",
                 arr, m->n_ok, m->n, m->req_s, m->out_tok_s, m->in_tok_s, m->ttft.p50, m->ttft.p90, m->ttft.p99,
                 m->tpot.p50, m->tpot.p90, m->tpot.p99, m->e2e.p50, m->e2e.p90, m->e2e.p99, m->goodput_req_s);
}

static td_status plot(const char *png, const td_serve_summary *m, int n, const char *title) {
  char data[] = "/tmp/bench-serve-XXXXXX";
  int fd = mkstemp(data);
  if (fd < 0) return td_err(TD_ERR_IO, "plot: %s", strerror(errno));
  FILE *f = fdopen(fd, "w");
  if (!f) {
    close(fd);
    unlink(data);
    return td_err(TD_ERR_IO, "plot: %s", strerror(errno));
  }
  for (int i = 0; i < n; i++)
    fprintf(f, "%g %g %g %g %g\n", m[i].out_tok_s, m[i].ttft.p50, m[i].ttft.p99, m[i].e2e.p50, m[i].e2e.p99);
  fclose(f);
  FILE *g = popen("gnuplot 2>&1", "w");
  if (!g) {
    unlink(data);
    return td_err(TD_ERR_UNSUPPORTED, "plot: gnuplot cannot be started (Debian package gnuplot-nox)");
  }
  fprintf(g,
          "set terminal pngcairo size 900,600\nset output '%s'\nset title '%s'\n"
          "set xlabel 'output tokens/s'\nset ylabel 'ms'\nset logscale y\nset key left top\nset grid\n"
          "plot '%s' u 1:2 w lp t 'TTFT p50', '' u 1:3 w lp t 'TTFT p99', '' u 1:4 w lp t 'end-to-end p50', "
          "'' u 1:5 w lp t 'end-to-end p99'\n",
          png, title, data);
  int rc = pclose(g);
  unlink(data);
  if (rc != 0) return td_err(TD_ERR_UNSUPPORTED, "plot: gnuplot failed (%d): is it installed (gnuplot-nox)?", rc);
  return TD_OK;
}

/* ---------------------------------------------------------------- main */

static void usage(FILE *f) {
  fprintf(f,
          "usage: bench-serve (--router EP | --gateway URL [--gateway-model NAME] [--http-warm N]\n"
          "                   | --engine --model DIR\n"
          "                   [--device cpu|cuda])\n"
          "                   [--workload trt|whisper|long|FILE.jsonl] [--requests N] [--seed S]\n"
          "                   [--concurrency C | --rate R | --sweep R1,R2,...] [--ttft-bound MS] [--tpot-bound MS]\n"
          "                   [--model DIR] [--vocab N] [--max-batch N] [--max-tokens N] [--kv-blocks N]\n"
          "                   [--cross-blocks N] [--cross-mode auto|kv|states|dual] [--label TEXT] [--record]\n"
          "                   [--cross-kv-dtype bf16|int8 (--engine: the cross K/V in int8)]\n"
          "                   [--plot FILE.png] [--timeout-ms N] [--max-enc-tokens N] [--max-enc-seqs N]\n"
          "                   [--gpu-memory-fraction F] [--repeat K]  (each synthetic input K times in a row)\n"
          "                   [--runs K [--seed-step D]]  (the measure K times on one target, run k with inputs of\n"
          "                               seed S + k x D (D default 1):\n"
          "                               an engine's later runs are warm, as a cluster's after its first; a FILE\n"
          "                               workload repeats its inputs: --encoder-cache-fraction 0 for the engine)\n"
          "                   [--encoder-cache-fraction F]  (--engine: of the cross pool; 0.25, 0 disables)\n"
          "                   [--results FILE.jsonl]  (--router, one run: each answer with its times, a line)\n"
          "                   [--part Q/N]  (of the --requests N requests, those whose index is Q modulo N:\n"
          "                               an engine with its share of a cluster's load on the cluster's inputs)\n"
          "                   [--barrier DIR:N]  (each run starts once N bench-serve processes given the same DIR\n"
          "                               reached it: engines on several GPUs measured at once)\n"
          "                   [--spin-us N]  (--router: poll N us without sleeping while answers are due, as\n"
          "                               tandem-gateway --spin-us; 0 to 100000, default 0)\n");
}

static int parse_rates(const char *s, opts *o) {
  char buf[512];
  snprintf(buf, sizeof buf, "%s", s);
  o->n_rates = 0;
  for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
    char *end;
    double v = strtod(t, &end);
    if (*end || !(v > 0) || o->n_rates == MAX_SWEEP) return -1;
    o->rates[o->n_rates++] = v;
  }
  return o->n_rates ? 0 : -1;
}

static int positive(const char *what, const char *v, int *out) {
  char *end;
  long x = strtol(v, &end, 10);
  if (*end || x <= 0 || x > 100000000) {
    fprintf(stderr, "bench-serve: %s %s: a positive integer\n", what, v);
    return -1;
  }
  *out = (int)x;
  return 0;
}

int main(int argc, char **argv) {
  td_settings settings;
  if (td_settings_from_env(&settings) != TD_OK) {
    fprintf(stderr, "bench-serve: %s\n", td_errmsg());
    return 2;
  }
  td_settings_apply(&settings);
  td_log_set_name("bench-serve");
  const td_bench_out out = {.results = getenv("TD_RESULTS"), .commit = getenv("TD_COMMIT")};
  static const struct option lo[] = {
      {"router", required_argument, 0, 'r'},       {"engine", no_argument, 0, 'E'},
      {"gateway", required_argument, 0, 'g'},      {"gateway-model", required_argument, 0, 'G'},
      {"model", required_argument, 0, 'm'},        {"device", required_argument, 0, 'd'},
      {"workload", required_argument, 0, 'w'},     {"requests", required_argument, 0, 'n'},
      {"seed", required_argument, 0, 's'},         {"concurrency", required_argument, 0, 'c'},
      {"rate", required_argument, 0, 'R'},         {"sweep", required_argument, 0, 'S'},
      {"ttft-bound", required_argument, 0, 'T'},   {"tpot-bound", required_argument, 0, 'P'},
      {"vocab", required_argument, 0, 'v'},        {"max-batch", required_argument, 0, 'B'},
      {"max-tokens", required_argument, 0, 'K'},   {"kv-blocks", required_argument, 0, 'k'},
      {"cross-blocks", required_argument, 0, 'x'}, {"cross-mode", required_argument, 0, 'M'},
      {"label", required_argument, 0, 'l'},        {"record", no_argument, 0, 'o'},
      {"plot", required_argument, 0, 'p'},         {"timeout-ms", required_argument, 0, 't'},
      {"max-enc-tokens", required_argument, 0, 'e'}, {"max-enc-seqs", required_argument, 0, 'q'},
      {"gpu-memory-fraction", required_argument, 0, 'F'}, {"http-warm", required_argument, 0, 'W'},
      {"repeat", required_argument, 0, 'y'},       {"encoder-cache-fraction", required_argument, 0, 'Y'},
      {"results", required_argument, 0, 'O'},      {"runs", required_argument, 0, 'U'},
      {"barrier", required_argument, 0, 'Z'},      {"spin-us", required_argument, 0, 'Q'},
      {"seed-step", required_argument, 0, 1001},   {"part", required_argument, 0, 1002},
      {"cross-kv-dtype", required_argument, 0, 1003},
      {"help", no_argument, 0, 'h'},
      {0, 0, 0, 0}};
  opts o = {.device = "cpu", .workload = "trt", .n = 128, .seed = 1, .seed_step = 1, .runs = 1, .max_batch = 0, .max_tokens = 0,
            .timeout_ms = 600000, .cache_fraction = TD_DEFAULT_ENCODER_CACHE_FRACTION};
  int c;
  while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
    switch (c) {
      case 'r': o.router = optarg; break;
      case 'g': o.gateway = optarg; break;
      case 'G': o.gateway_model = optarg; break;
      case 'W':
        if (positive("--http-warm", optarg, &o.http_warm)) return 2;
        if (o.http_warm > 4096) {
          fprintf(stderr, "bench-serve: --http-warm %d: at most 4096 connections\n", o.http_warm);
          return 2;
        }
        break;
      case 'E': o.engine = true; break;
      case 'm': o.model = optarg; break;
      case 'd': o.device = optarg; break;
      case 'w': o.workload = optarg; break;
      case 'n':
        if (positive("--requests", optarg, &o.n)) return 2;
        break;
      case 's': o.seed = strtoull(optarg, NULL, 10); break;
      case 'c':
        if (positive("--concurrency", optarg, &o.concurrency)) return 2;
        break;
      case 'R':
      case 'S':
        if (parse_rates(optarg, &o) != 0) {
          fprintf(stderr, "bench-serve: %s %s: positive rates (requests/s), at most %d\n",
                  c == 'R' ? "--rate" : "--sweep", optarg, MAX_SWEEP);
          return 2;
        }
        if (c == 'R' && o.n_rates != 1) {
          fprintf(stderr, "bench-serve: --rate takes one rate (--sweep several)\n");
          return 2;
        }
        break;
      case 'T': o.ttft_bound = atof(optarg); break;
      case 'P': o.tpot_bound = atof(optarg); break;
      case 'v':
        if (positive("--vocab", optarg, &o.vocab)) return 2;
        break;
      case 'B':
        if (positive("--max-batch", optarg, &o.max_batch)) return 2;
        break;
      case 'K':
        if (positive("--max-tokens", optarg, &o.max_tokens)) return 2;
        break;
      case 'k':
        if (positive("--kv-blocks", optarg, &o.kv_blocks)) return 2;
        break;
      case 'x':
        if (positive("--cross-blocks", optarg, &o.cross_blocks)) return 2;
        break;
      case 'M':
        if (td_cross_mode_parse(optarg, &o.cross_mode) != TD_OK) {
          fprintf(stderr, "bench-serve: %s\n", td_errmsg());
          return 2;
        }
        break;
      case 1003:
        if (strcmp(optarg, "bf16") && strcmp(optarg, "int8")) {
          fprintf(stderr, "bench-serve: --cross-kv-dtype %s: bf16 or int8\n", optarg);
          return 2;
        }
        o.cross_int8 = !strcmp(optarg, "int8");
        break;
      case 'l': o.label = optarg; break;
      case 'o': o.record = true; break;
      case 'p': o.plot = optarg; break;
      case 't':
        if (positive("--timeout-ms", optarg, &o.timeout_ms)) return 2;
        break;
      case 'e':
        if (positive("--max-enc-tokens", optarg, &o.max_enc_tokens)) return 2;
        break;
      case 'q':
        if (positive("--max-enc-seqs", optarg, &o.max_enc_seqs)) return 2;
        break;
      case 'F':
        o.mem_fraction = atof(optarg);
        if (!(o.mem_fraction > 0 && o.mem_fraction <= 1)) {
          fprintf(stderr, "bench-serve: --gpu-memory-fraction %s: in (0, 1]\n", optarg);
          return 2;
        }
        break;
      case 'y':
        if (positive("--repeat", optarg, &o.repeat)) return 2;
        break;
      case 1001: {
        char *end = NULL;
        o.seed_step = strtoull(optarg, &end, 10);
        if (end == optarg || *end || !o.seed_step || o.seed_step > 1000000) {
          fprintf(stderr, "bench-serve: --seed-step %s: 1 to 1000000\n", optarg);
          return 2;
        }
        break;
      }
      case 1002: {
        int q, n, used = 0;
        if (sscanf(optarg, "%d/%d%n", &q, &n, &used) != 2 || optarg[used] || n < 1 || n > TD_WORKLOAD_MAX_PARTS ||
            q < 0 || q >= n) {
          fprintf(stderr, "bench-serve: --part %s: Q/N with 0 <= Q < N <= %d\n", optarg, TD_WORKLOAD_MAX_PARTS);
          return 2;
        }
        o.part = q, o.parts = n;
        break;
      }
      case 'U':
        if (positive("--runs", optarg, &o.runs)) return 2;
        if (o.runs > MAX_SWEEP) {
          fprintf(stderr, "bench-serve: --runs %d: at most %d\n", o.runs, MAX_SWEEP);
          return 2;
        }
        break;
      case 'Y': {
        char *end;
        o.cache_fraction = strtod(optarg, &end);
        if (*end || !(o.cache_fraction >= 0 && o.cache_fraction <= 1)) {
          fprintf(stderr, "bench-serve: --encoder-cache-fraction %s: in [0, 1] (0 disables)\n", optarg);
          return 2;
        }
        break;
      }
      case 'O': o.results = optarg; break;
      case 'Z': {
        const char *colon = strrchr(optarg, ':');
        char *end = NULL;
        long v = colon ? strtol(colon + 1, &end, 10) : 0;
        size_t dl = colon ? (size_t)(colon - optarg) : 0;
        if (!colon || !dl || dl >= sizeof o.barrier_dir || *end || v < 1 || v > 64) {
          fprintf(stderr, "bench-serve: --barrier %s: DIR:N, N processes from 1 to 64\n", optarg);
          return 2;
        }
        memcpy(o.barrier_dir, optarg, dl);
        o.barrier_dir[dl] = 0;
        o.barrier_n = (int)v;
        break;
      }
      case 'Q': {
        char *end;
        long v = strtol(optarg, &end, 10);
        if (*end || end == optarg || v < 0 || v > TD_MAX_SPIN_US) {
          fprintf(stderr, "bench-serve: --spin-us: 0 to %d microseconds, not '%s'\n", TD_MAX_SPIN_US, optarg);
          return 2;
        }
        o.spin_us = (int)v;
        break;
      }
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  if (o.runs > 1 && o.n_rates) {
    fprintf(stderr, "bench-serve: --runs repeats one measure: not with --rate or --sweep (a run a rate)\n");
    return 2;
  }
  if (o.results && (!o.router || o.n_rates > 1 || o.runs > 1)) {
    fprintf(stderr, "bench-serve: --results takes one run against a cluster (--router, not a sweep)\n");
    return 2;
  }
  if (!!o.router + !!o.gateway + o.engine != 1 || (o.engine && !o.model) || (o.concurrency && o.n_rates)) {
    usage(stderr);
    fprintf(stderr, "bench-serve: one target (--router, --gateway or --engine with --model); --concurrency or rates, "
                    "not both\n");
    return 2;
  }
  /* the workload's shape from the model when given */
  td_workload_opts wo = {.name = o.workload, .n = o.n, .seed = o.seed, .vocab = o.vocab, .repeat = o.repeat,
                         .part = o.part, .parts = o.parts};
  if (o.model) {
    td_model_config cfg;
    if (td_model_config_load(o.model, &cfg) != TD_OK) {
      fprintf(stderr, "bench-serve: %s\n", td_errmsg());
      return 2;
    }
    if (!wo.vocab) wo.vocab = cfg.vocab_size;
    wo.mel_bins = cfg.num_mel_bins;
    wo.frames = cfg.num_mel_bins ? 2 * cfg.max_source_len : 0; /* Whisper: the conv halves the frames */
  }
  if (!wo.vocab) wo.vocab = 32000;
  td_workload w;
  if (td_workload_make(&wo, &w) != TD_OK) {
    fprintf(stderr, "bench-serve: %s\n", td_errmsg());
    return 2;
  }
  if (!o.max_batch) o.max_batch = strcmp(o.device, "cuda") ? TD_DEFAULT_MAX_SEQS : TD_DEFAULT_GPU_MAX_BATCH;
  if (!o.max_tokens) o.max_tokens = o.max_batch > 512 ? o.max_batch : 512;
  eng g = {0};
  double load_s = 0;
  if (o.engine && engine_open(&o, &settings, w.n, &g, &load_s) != TD_OK) {
    fprintf(stderr, "bench-serve: %s\n", td_errmsg());
    engine_close(&g);
    td_workload_free(&w);
    return 1;
  }
  char target[512];
  if (o.engine)
    snprintf(target, sizeof target, "engine in process (%s, %s; load %.1f s, not counted)", o.model,
             td_backend_name(g.b), load_s);
  else if (o.gateway)
    snprintf(target, sizeof target, "gateway at %s (HTTP, streamed completions)", o.gateway);
  else
    snprintf(target, sizeof target, "cluster at %s", o.router);
  int n_runs = o.n_rates ? o.n_rates : o.runs;
  td_serve_summary sums[MAX_SWEEP];
  td_sbuf tab = {0};
  char repeat[48] = "";
  if (o.repeat > 1) snprintf(repeat, sizeof repeat, ", each input %d times", o.repeat);
  char part[64] = "";
  if (o.parts > 1) snprintf(part, sizeof part, " (part %d of %d of %d)", o.part, o.parts, o.n);
  td_sbuf_printf(&tab, "%s%s%s: workload %s%s, %d requests%s (%lld input, %lld output tokens asked), seed %llu\n\n",
                 o.label ? o.label : "", o.label ? ": " : "", target, o.workload, repeat, w.n, part, w.input_tokens,
                 w.output_tokens, (unsigned long long)o.seed);
  td_sbuf_printf(&tab, "| arrivals | ok | req/s | out tok/s | in tok/s | TTFT ms p50 / p90 / p99 | "
                       "TPOT ms p50 / p90 / p99 | end-to-end ms p50 / p90 / p99 | goodput req/s |\n"
                       "|---|---|---|---|---|---|---|---|---|\n");
  td_sbuf stages = {0}, hops = {0}, use = {0}, short_side = {0};
  if (o.router)
    td_sbuf_printf(&stages,
                   "\nWhere the time went, as the router saw it (mean ms a request; transfer: the encoder's wait and "
                   "KV push; first token on its worker: the decode worker's part, the rest hops and the router):\n\n"
                   "| arrivals | queue | reserve | encode | transfer | prefill | first token | ... on its worker | "
                   "decode | total | attempts |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
  if (o.gateway)
    td_sbuf_printf(&stages, "\nWhere a stream's first event went, as the gateway saw it (mean ms; admit: arrival to "
                            "the router, cluster: to the router's first answer, answer: to the HTTP server; the rest "
                            "of TTFT is HTTP and this client):\n\n| arrivals | admit | cluster | answer | streams |\n"
                            "|---|---|---|---|---|\n");
  if (o.gateway)
    td_sbuf_printf(&hops, "\nThe same first events as this client saw them (mean ms: the request sent and the "
                          "response's headers from curl's start of the transfer, the first event from the submit "
                          "call; TTFT counts from the request's arrival time, so TTFT minus first event is the wait "
                          "before the submit call):\n\n| arrivals | request sent | headers | first event | TTFT | "
                          "streams |\n|---|---|---|---|---|---|\n");
  int rc = 0;
  for (int k = 0; k < n_runs && rc == 0; k++) {
    double rate = o.n_rates ? o.rates[k] : 0;
    if (k > 0 && o.runs > 1) { /* new inputs: the encoder cache must not answer a later run */
      td_workload_free(&w);
      wo.seed = o.seed + (uint64_t)k * o.seed_step;
      if (td_workload_make(&wo, &w) != TD_OK) {
        fprintf(stderr, "bench-serve: %s\n", td_errmsg());
        rc = 1;
        break;
      }
    }
    run r;
    td_status s = run_init(&r, &w, rate, o.concurrency, o.seed + 7919 * (uint64_t)k);
    r.spin_ns = (int64_t)o.spin_us * 1000;
    if (s == TD_OK && o.results && !(r.results = fopen(o.results, "w")))
      s = td_err(TD_ERR_IO, "cannot write %s", o.results);
    if (s == TD_OK && o.barrier_n) s = barrier(o.barrier_dir, o.barrier_n, k);
    td_serve_counters eng_before = {0};
    if (o.engine) eng_before = eng_counters(&g);
    if (s == TD_OK) s = o.engine ? run_engine(&g, &r) : o.gateway ? run_gateway(&o, &r) : run_cluster(&o, &r);
    if (s == TD_OK) s = td_serve_summarize(r.s, w.n, o.ttft_bound, o.tpot_bound, &sums[k]);
    if (s == TD_OK && o.engine) { /* the engine's run as the cluster's workers' are shown: the same columns */
      td_serve_counters eng_after = eng_counters(&g);
      if (!r.after && (r.after = malloc(sizeof *r.after)) && (r.before = malloc(sizeof *r.before))) {
        r.after[0] = eng_after;
        r.before[0] = eng_before;
        r.n_after = r.n_before = 1;
      }
    }
    if (s != TD_OK) {
      fprintf(stderr, "bench-serve: %s\n", td_errmsg());
      rc = 1;
    } else {
      char arr[64];
      row(&tab, arrivals_name(&o, rate, k, arr, sizeof arr), &sums[k]);
      if (o.router && r.n_staged) {
        const td_client_timings *a = &r.stages;
        double d = r.n_staged;
        td_sbuf_printf(&stages, "| %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f | %.1f | %.1f | %.2f |\n", arr,
                       a->queue_ms / d, a->reserve_ms / d, a->encode_ms / d, a->transfer_ms / d, a->prefill_ms / d,
                       a->first_token_ms / d, a->worker_first_token_ms / d, a->decode_ms / d, a->total_ms / d,
                       a->attempts / d);
      }
      if ((o.router || o.engine) && r.after && r.n_after > 0) {
        td_serve_use *u = calloc((size_t)r.n_after, sizeof *u);
        double first = -1; /* the first submission: where the run's duration starts */
        for (int i = 0; i < w.n; i++)
          if (r.s[i].submit_ms > 0 && (first < 0 || r.s[i].submit_ms < first)) first = r.s[i].submit_ms;
        if (first < 0) first = r.t0;
        double start_wall = o.engine ? 0 : r.t0_wall + (first - r.t0);
        if (!u || td_serve_worker_use(r.before, r.n_before, r.after, r.n_after, sums[k].duration_s, start_wall, u) !=
                      TD_OK) {
          fprintf(stderr, "bench-serve: the workers' counters: %s\n", u ? td_errmsg() : "out of memory");
        } else {
          if (!use.s)
            td_sbuf_printf(&use, "\nHow the %s spent the run (their counters before and after it; busy: inside "
                                 "engine steps, as a share of the run's duration; ms a step counts encoder runs in; an "
                                 "encoder-only worker has runs, no steps; projecting: arrived encoder states into "
                                 "cross K/V, between steps; began / ended: its work began that long after the "
                                 "run's start and ended that long before its end, ms, \"-\" where it worked "
                                 "before or after):\n\n| arrivals | worker | busy %% | steps | mean batch | "
                                 "ms a step | encoded | encoder runs | inputs a run | projecting %% | began ms | "
                                 "ended ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
                           o.engine ? "engine" : "workers");
          for (int i = 0; i < r.n_after; i++) {
            char began[32] = "-", ended[32] = "-";
            if (u[i].began_ms >= 0) snprintf(began, sizeof began, "%.1f", u[i].began_ms);
            if (u[i].ended_ms >= 0) snprintf(ended, sizeof ended, "%.1f", u[i].ended_ms);
            td_sbuf_printf(&use, "| %s | %s | %.1f | %lld | %.1f | %.2f | %lld | %lld | %.1f | %.1f | %s | %s |\n",
                           arr, u[i].id, u[i].busy_pct, u[i].steps, u[i].mean_batch, u[i].step_ms, u[i].encoded,
                           u[i].encode_runs, u[i].inputs_a_run, u[i].project_pct, began, ended);
          }
          char why[768];
          if (td_serve_short_side(u, r.n_after, why, sizeof why)) td_sbuf_printf(&short_side, "- %s: %s\n", arr, why);
        }
        free(u);
      }
      if (o.gateway && r.gw_count[1] > 0)
        td_sbuf_printf(&stages, "| %s | %.3f | %.3f | %.3f | %.0f |\n", arr, 1e3 * r.gw_sum[0] / r.gw_count[0],
                       1e3 * r.gw_sum[1] / r.gw_count[1], 1e3 * r.gw_sum[2] / r.gw_count[2], r.gw_count[1]);
      if (o.gateway && r.hop.n > 0)
        td_sbuf_printf(&hops, "| %s | %.3f | %.3f | %.3f | %.3f | %d |\n", arr, r.hop.sent_ms / r.hop.n,
                       r.hop.headers_ms / r.hop.n, r.hop.first_ms / r.hop.n, sums[k].ttft.mean, r.hop.n);
      if (sums[k].n_failed) rc = 1;
    }
    if (r.results && fclose(r.results) != 0) {
      fprintf(stderr, "bench-serve: cannot write %s\n", o.results);
      rc = 1;
    }
    run_free(&r);
  }
  if (o.ttft_bound > 0 || o.tpot_bound > 0)
    td_sbuf_printf(&tab, "\nGoodput: requests a second with TTFT <= %g ms and TPOT <= %g ms (0: no bound).\n",
                   o.ttft_bound, o.tpot_bound);
  if (stages.s) td_sbuf_printf(&tab, "%s", stages.s);
  if (hops.s) td_sbuf_printf(&tab, "%s", hops.s);
  if (use.s) td_sbuf_printf(&tab, "%s", use.s);
  if (short_side.s) td_sbuf_printf(&tab, "\nWhich side was short:\n%s", short_side.s);
  if (o.engine) { /* every run of a sweep together */
    td_engine_stats es = td_engine_get_stats(g.e);
    td_sbuf_printf(&tab,
                   "\nEncoder: %lld runs (requests encoded); encoder cache (fraction %g of %d cross blocks): "
                   "%lld hits, %lld misses, %lld evictions.\n",
                   (long long)es.encodes, o.cache_fraction, es.cross.n_blocks, (long long)es.cache_hits,
                   (long long)es.cache_misses, (long long)es.cache_evictions);
  }
  td_sbuf_free(&stages);
  td_sbuf_free(&hops);
  td_sbuf_free(&use);
  td_sbuf_free(&short_side);
  fputs(tab.s, stdout);
  if (rc == 0 && o.plot && plot(o.plot, sums, n_runs, o.workload) != TD_OK) {
    fprintf(stderr, "bench-serve: %s\n", td_errmsg());
    rc = 1;
  }
  if (rc == 0 && o.record) {
    char title[256];
    snprintf(title, sizeof title, "bench-serve: %s, %s workload",
             o.engine ? "engine" : o.gateway ? "gateway (HTTP)" : "cluster", o.workload);
    if (td_bench_record(&out, title, o.engine ? td_backend_name(g.b) : td_bench_cpu_name(), tab.s) != 0) rc = 1;
  }
  td_sbuf_free(&tab);
  engine_close(&g);
  td_workload_free(&w);
  return rc;
}
