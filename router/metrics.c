/* The router's metrics (docs/metrics.md): events counted where they
 * happen (a result, a failure, a retry, a worker's arrival and departure),
 * state read when the text is rendered (the queue, requests in flight,
 * each live worker's last heartbeat). A timer renders the text every
 * TD_METRICS_PUBLISH_MS and hands it to the HTTP server's thread, so a
 * scrape never reads the router's state and never waits on its loop. */
#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "router/internal.h"

/* vLLM's buckets, so that dashboards read the same; TPOT starts at 1 ms
 * (a decode step on an H100 is below vLLM's first bucket, 10 ms) */
static const double ttft_buckets[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                      1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
static const double tpot_buckets[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                                      0.4,   0.5,    0.75,  1.0,  2.5,   5.0,  7.5,   10.0, 20.0, 40.0, 80.0};
static const double e2e_buckets[] = {0.3,  0.5,  0.8,  1.0,  1.5,  2.0,  2.5,   5.0,   10.0,   15.0,  20.0,
                                     30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
static const double stage_buckets[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,  0.25, 0.5,
                                       1.0,   2.5,    5.0,   10.0, 30.0,  60.0, 120.0, 300.0};
#define N(a) ((int)(sizeof a / sizeof a[0]))

struct rtr_metrics {
  td_metrics *reg;
  td_metrics_server *server;
  td_metric *running, *waiting, *success, *failure, *ttft, *tpot, *e2e, *prompt, *generation, *retries, *stage;
  td_metric *w_up, *w_running, *w_waiting, *w_used, *w_free, *w_kv, *w_kv_bytes, *w_kv_secs, *w_ipc, *w_encoded,
      *w_hits, *w_cache_blocks, *w_refused, *w_steps, *w_tokens, *w_runs, *w_busy, *w_idle, *w_project;
  td_metric *dropped;
};

#define LABELS(...) ((const char *const[]){__VA_ARGS__}), N(((const char *const[]){__VA_ARGS__}))
/* ADD(slot, type, name, help, labels, n_labels, bounds, n_bounds) */
#define ADD(slot, type, name, help, ...) TD_TRY(td_metrics_add(m->reg, type, name, help, __VA_ARGS__, &m->slot))

td_status rtr_metrics_create(td_router *r) {
  rtr_metrics *m = calloc(1, sizeof *m);
  if (!m) return td_err(TD_ERR_NOMEM, "out of memory");
  r->metrics = m;
  TD_TRY(td_metrics_create(&m->reg));
  ADD(running, TD_METRIC_GAUGE, "tandem:num_requests_running",
      "Requests placed on workers and not finished.", NULL, 0, NULL, 0);
  ADD(waiting, TD_METRIC_GAUGE, "tandem:num_requests_waiting",
      "Requests queued for placement.", NULL, 0, NULL, 0);
  ADD(success, TD_METRIC_COUNTER, "tandem:request_success_total",
      "Requests that finished with a result, by the first output's finish reason.", LABELS("finished_reason"), NULL, 0);
  ADD(failure, TD_METRIC_COUNTER, "tandem:request_failure_total",
      "Requests that ended with an error (refusals at admission included), by error code.", LABELS("code"), NULL, 0);
  ADD(ttft, TD_METRIC_HISTOGRAM, "tandem:time_to_first_token_seconds",
      "Arrival at the router to the first token at the router.", NULL, 0, ttft_buckets, N(ttft_buckets));
  ADD(tpot, TD_METRIC_HISTOGRAM, "tandem:time_per_output_token_seconds",
      "A request's mean time per output token after the first.", NULL, 0, tpot_buckets, N(tpot_buckets));
  ADD(e2e, TD_METRIC_HISTOGRAM, "tandem:e2e_request_latency_seconds",
      "Arrival at the router to the result.", NULL, 0, e2e_buckets, N(e2e_buckets));
  ADD(prompt, TD_METRIC_COUNTER, "tandem:prompt_tokens_total",
      "Prompt tokens of finished requests: encoder input ids and decoder prompt.", NULL, 0, NULL, 0);
  ADD(generation, TD_METRIC_COUNTER, "tandem:generation_tokens_total",
      "Tokens generated for finished requests, every output.", NULL, 0, NULL, 0);
  ADD(retries, TD_METRIC_COUNTER, "tandem:request_retries_total",
      "Attempts that were retried on other workers (a worker died, failed or timed out).", NULL, 0, NULL, 0);
  ADD(stage, TD_METRIC_HISTOGRAM, "tandem:request_stage_seconds",
      "Where finished requests' time went (their last attempt; the stages of the result's Timings).",
      LABELS("stage"), stage_buckets, N(stage_buckets));
  ADD(w_up, TD_METRIC_GAUGE, "tandem:worker_up",
      "1 while a worker is registered, 0 after it left.", LABELS("worker", "roles"), NULL, 0);
  ADD(w_running, TD_METRIC_GAUGE, "tandem:worker_running_sequences",
      "Sequences a worker's engine runs (its last heartbeat).", LABELS("worker"), NULL, 0);
  ADD(w_waiting, TD_METRIC_GAUGE, "tandem:worker_waiting_sequences",
      "Requests queued in a worker's engine (its last heartbeat).", LABELS("worker"), NULL, 0);
  ADD(w_used, TD_METRIC_GAUGE, "tandem:worker_kv_blocks_used",
      "KV blocks in use in a worker's pool (self: decoder self-attention; cross: encoder output).", LABELS("worker",
      "pool"), NULL, 0);
  ADD(w_free, TD_METRIC_GAUGE, "tandem:worker_kv_blocks_free",
      "Free KV blocks in a worker's pool (encoder-cache blocks count free).", LABELS("worker", "pool"), NULL, 0);
  ADD(w_kv, TD_METRIC_COUNTER, "tandem:kv_blocks_transferred_total",
      "KV blocks a worker received (in) or pushed (out), by transport.", LABELS("worker", "direction",
      "transport"), NULL, 0);
  ADD(w_kv_bytes, TD_METRIC_COUNTER, "tandem:kv_bytes_transferred_total",
      "Bytes of the KV blocks a worker received (in) or pushed (out), by transport (whole-model blocks, as sent).",
      LABELS("worker", "direction", "transport"), NULL, 0);
  ADD(w_kv_secs, TD_METRIC_COUNTER, "tandem:kv_push_seconds_total",
      "Time a worker's KV pushes took, each from the push to the receiver's answer, by transport "
      "(with tandem:kv_bytes_transferred_total: the transport's rate).", LABELS("worker", "transport"), NULL, 0);
  ADD(w_ipc, TD_METRIC_COUNTER, "tandem:kv_blocks_ipc_total",
      "Of the KV blocks a worker pushed over UCX, those over CUDA IPC (GPU pools of one host).",
      LABELS("worker"), NULL, 0);
  ADD(w_refused, TD_METRIC_COUNTER, "tandem:kv_pushes_refused_total",
      "KV pushes a worker refused before writing a byte: not from the sender its reservation names, no open "
      "reservation, blocks outside it or of another size.", LABELS("worker"), NULL, 0);
  ADD(w_encoded, TD_METRIC_COUNTER, "tandem:worker_encoded_requests_total",
      "Requests a worker's encoder ran.", LABELS("worker"), NULL, 0);
  ADD(w_steps, TD_METRIC_COUNTER, "tandem:worker_steps_total",
      "Engine steps a worker ran (decode steps, encoder and prefill passes).", LABELS("worker"), NULL, 0);
  ADD(w_tokens, TD_METRIC_COUNTER, "tandem:worker_generated_tokens_total",
      "Tokens a worker's steps generated; over steps, its mean decode batch.", LABELS("worker"), NULL, 0);
  ADD(w_runs, TD_METRIC_COUNTER, "tandem:worker_encoder_runs_total",
      "Encoder runs a worker made (each encodes one or more requests).", LABELS("worker"), NULL, 0);
  ADD(w_busy, TD_METRIC_COUNTER, "tandem:worker_busy_seconds_total",
      "Wall time a worker spent inside engine steps; its rate is the worker's utilisation.", LABELS("worker"), NULL, 0);
  ADD(w_idle, TD_METRIC_COUNTER, "tandem:worker_idle_seconds_total",
      "Wall time a worker waited with no work at all (nothing running, waiting or queued).", LABELS("worker"), NULL,
      0);
  ADD(w_project, TD_METRIC_COUNTER, "tandem:worker_project_seconds_total",
      "Wall time a worker spent projecting arrived encoder states into cross K/V, between its steps.",
      LABELS("worker"), NULL, 0);
  ADD(w_hits, TD_METRIC_COUNTER, "tandem:encoder_cache_hits_total",
      "Requests whose cross KV came from a worker's encoder cache (no encoder run).", LABELS("worker"), NULL, 0);
  ADD(w_cache_blocks, TD_METRIC_GAUGE, "tandem:encoder_cache_blocks",
      "Cross blocks a worker's encoder cache holds.", LABELS("worker"), NULL, 0);
  ADD(dropped, TD_METRIC_GAUGE, "tandem:metrics_series_dropped",
      "Series not kept: a family past its limit of series, or out of memory.", NULL, 0, NULL, 0);
  /* the unlabelled series show (0) before their first event */
  td_metric *zero[] = {m->ttft, m->tpot, m->e2e, m->prompt, m->generation, m->retries};
  for (int i = 0; i < N(zero); i++) td_metric_touch(zero[i], NULL);
  if (!r->o.metrics) return TD_OK;
  TD_TRY(td_metrics_server_start(r->o.metrics_host ? r->o.metrics_host : TD_METRICS_DEFAULT_HOST, r->o.metrics_port,
                                 &m->server));
  return TD_OK;
}

void rtr_metrics_destroy(td_router *r) {
  rtr_metrics *m = r->metrics;
  if (!m) return;
  td_metrics_server_stop(m->server); /* first: its thread reads nothing of ours, but it is gone before we are */
  td_metrics_destroy(m->reg);
  free(m);
  r->metrics = NULL;
}

int rtr_metrics_port(const td_router *r) {
  return r->metrics && r->metrics->server ? td_metrics_server_port(r->metrics->server) : 0;
}

static void roles_of(const worker *w, char *out, size_t cap) {
  snprintf(out, cap, "%s%s%s", w->pl.enc ? "encode," : "", w->pl.pre ? "prefill," : "", w->pl.dec ? "decode," : "");
  size_t n = strlen(out);
  if (n) out[n - 1] = 0;
}

void rtr_metrics_worker(td_router *r, const worker *w, bool up) {
  if (!r->metrics) return;
  char roles[32];
  roles_of(w, roles, sizeof roles);
  const char *l[] = {w->id, roles};
  td_metric_set(r->metrics->w_up, l, up);
}

/* The state gauges, from the registry as it is now. */
static void collect(td_router *r) {
  rtr_metrics *m = r->metrics;
  td_metric_set(m->running, NULL, r->in_flight);
  td_metric_set(m->waiting, NULL, r->queue.n + r->parked.n);
  td_metric *per_worker[] = {m->w_running, m->w_waiting, m->w_used,    m->w_free,          m->w_kv, m->w_kv_bytes, m->w_kv_secs,
                             m->w_ipc,     m->w_encoded, m->w_hits,    m->w_cache_blocks, m->w_refused,
                             m->w_steps,   m->w_tokens,  m->w_runs,    m->w_busy,          m->w_idle,
                             m->w_project};
  for (int i = 0; i < N(per_worker); i++) td_metric_clear(per_worker[i]); /* workers that left go */
  for (worker *w = r->workers; w; w = w->hh.next) {
    const Tandem__Cluster__Load *ld = &w->load;
    const char *id[] = {w->id};
    td_metric_set(m->w_running, id, ld->running);
    td_metric_set(m->w_waiting, id, ld->queued);
    const char *self[] = {w->id, "self"}, *cross[] = {w->id, "cross"};
    td_metric_set(m->w_used, self, (double)w->self_blocks - ld->free_self_blocks);
    td_metric_set(m->w_free, self, ld->free_self_blocks);
    td_metric_set(m->w_used, cross, (double)w->pl.cross_blocks - ld->free_cross_blocks);
    td_metric_set(m->w_free, cross, ld->free_cross_blocks);
    const char *in_ucx[] = {w->id, "in", "ucx"}, *in_zmq[] = {w->id, "in", "zmq"};
    const char *out_ucx[] = {w->id, "out", "ucx"}, *out_zmq[] = {w->id, "out", "zmq"};
    td_metric_set(m->w_kv, in_ucx, (double)ld->kv_in_ucx);
    td_metric_set(m->w_kv, in_zmq, (double)ld->kv_in_zmq);
    td_metric_set(m->w_kv, out_ucx, (double)ld->kv_out_ucx);
    td_metric_set(m->w_kv, out_zmq, (double)ld->kv_out_zmq);
    td_metric_set(m->w_kv_bytes, in_ucx, (double)ld->kv_in_bytes_ucx);
    td_metric_set(m->w_kv_bytes, in_zmq, (double)ld->kv_in_bytes_zmq);
    td_metric_set(m->w_kv_bytes, out_ucx, (double)ld->kv_out_bytes_ucx);
    td_metric_set(m->w_kv_bytes, out_zmq, (double)ld->kv_out_bytes_zmq);
    const char *s_ucx[] = {w->id, "ucx"}, *s_zmq[] = {w->id, "zmq"};
    td_metric_set(m->w_kv_secs, s_ucx, ld->kv_out_seconds_ucx);
    td_metric_set(m->w_kv_secs, s_zmq, ld->kv_out_seconds_zmq);
    td_metric_set(m->w_ipc, id, (double)ld->kv_out_ipc);
    td_metric_set(m->w_refused, id, (double)ld->kv_refused);
    td_metric_set(m->w_encoded, id, (double)ld->encoded);
    td_metric_set(m->w_hits, id, (double)ld->encoder_cache_hits);
    td_metric_set(m->w_cache_blocks, id, ld->encoder_cache_blocks);
    td_metric_set(m->w_steps, id, (double)ld->steps);
    td_metric_set(m->w_tokens, id, (double)ld->tokens);
    td_metric_set(m->w_runs, id, (double)ld->encode_runs);
    td_metric_set(m->w_busy, id, ld->busy_seconds);
    td_metric_set(m->w_idle, id, ld->idle_seconds);
    td_metric_set(m->w_project, id, ld->project_seconds);
  }
  td_metric_set(m->dropped, NULL, (double)td_metrics_dropped(m->reg));
}

int rtr_metrics_tick(td_loop *l, void *ctx) {
  (void)l;
  td_router *r = ctx;
  char *text;
  size_t len;
  collect(r);
  if (td_metrics_render(r->metrics->reg, &text, &len) == TD_OK) {
    if (td_metrics_server_publish(r->metrics->server, text, len) != TD_OK) TD_WARN("metrics: %s", td_errmsg());
    free(text);
  } else {
    TD_WARN("metrics: %s", td_errmsg());
  }
  return TD_METRICS_PUBLISH_MS;
}

static const char *finish_name(Tandem__FinishReason f) {
  switch (f) {
    case TANDEM__FINISH_REASON__FINISH_STOP: return "stop";
    case TANDEM__FINISH_REASON__FINISH_LENGTH: return "length";
    case TANDEM__FINISH_REASON__FINISH_CANCELLED: return "abort";
    case TANDEM__FINISH_REASON__FINISH_ERROR: return "error";
    default: return "none";
  }
}

void rtr_metrics_result(td_router *r, const rreq *q, Tandem__SequenceOutput *const *outs, size_t n_out,
                        const Tandem__Timings *tm) {
  rtr_metrics *m = r->metrics;
  if (!m) return;
  int64_t now = td_now_ms();
  const char *reason[] = {finish_name(n_out ? outs[0]->finish_reason : TANDEM__FINISH_REASON__FINISH_NONE)};
  td_metric_inc(m->success, reason, 1);
  /* no token came before the result (samples, beams): the result is the first */
  int64_t first = q->t_first_ns ? q->t_first_ns / 1000000 : now;
  td_metric_observe(m->ttft, NULL, (double)(first - q->t_arrival) / 1e3);
  td_metric_observe(m->e2e, NULL, tm->total_ms / 1e3);
  size_t n_first = n_out ? outs[0]->n_tokens : 0;
  if (n_first > 1 && q->t_first_ns)
    td_metric_observe(m->tpot, NULL, (double)(now - q->t_first_ns / 1000000) / 1e3 / (double)(n_first - 1));
  double gen = 0;
  for (size_t i = 0; i < n_out; i++) gen += (double)outs[i]->n_tokens;
  td_metric_inc(m->generation, NULL, gen);
  td_metric_inc(m->prompt, NULL, (double)(q->g->n_input_ids + q->g->n_decoder_prompt));
  const char *st[1];
  st[0] = "queue";
  td_metric_observe(m->stage, st, tm->queue_ms / 1e3);
  if (q->t_reserved) {
    st[0] = "reserve";
    td_metric_observe(m->stage, st, tm->reserve_ms / 1e3);
  }
  if (q->encode_ms > 0) {
    st[0] = "encode";
    td_metric_observe(m->stage, st, tm->encode_ms / 1e3);
  }
  if (q->t_encode_sent && q->t_encoded) {
    st[0] = "transfer";
    td_metric_observe(m->stage, st, tm->transfer_ms / 1e3);
  }
  if (q->prefill_ms > 0) {
    st[0] = "prefill";
    td_metric_observe(m->stage, st, tm->prefill_ms / 1e3);
  }
  if (tm->decode_ms > 0) {
    st[0] = "decode";
    td_metric_observe(m->stage, st, tm->decode_ms / 1e3);
  }
  if (tm->worker_first_token_ms > 0) { /* the first token's time at the router less the worker's: hops */
    st[0] = "first_token_worker";
    td_metric_observe(m->stage, st, tm->worker_first_token_ms / 1e3);
    st[0] = "first_token_hops";
    td_metric_observe(m->stage, st, (tm->first_token_ms - tm->worker_first_token_ms) / 1e3);
  }
}

void rtr_metrics_failure(td_router *r, Tandem__ErrorCode code) {
  if (!r->metrics) return;
  /* ERROR_UNAVAILABLE -> unavailable */
  const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(&tandem__error_code__descriptor, (int)code);
  char name[64] = "unknown";
  if (v) snprintf(name, sizeof name, "%s", strncmp(v->name, "ERROR_", 6) ? v->name : v->name + 6);
  for (char *p = name; *p; p++) *p = (char)tolower((unsigned char)*p);
  const char *l[] = {name};
  td_metric_inc(r->metrics->failure, l, 1);
}

void rtr_metrics_retry(td_router *r) {
  if (r->metrics) td_metric_inc(r->metrics->retries, NULL, 1);
}
