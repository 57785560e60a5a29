/* The gateway's Prometheus metrics, served at its own GET /metrics: API
 * requests by endpoint and status, in flight, duration, time to the first
 * streamed event, tokens and audio seconds. Connection threads update the
 * registry under one lock (td_metrics is single-threaded); a scrape renders
 * under it too. docs/metrics.md lists the names. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "gateway/internal.h"
#include "metrics/metrics.h"

struct gw_metrics {
  pthread_mutex_t mu;
  td_metrics *reg;
  td_metric *requests, *in_flight, *duration, *ttft, *stages, *prompt, *generated, *audio, *detections;
  td_metric *conns_opened, *conns_open;
};

static const double duration_buckets[] = {0.005, 0.01, 0.025, 0.05, 0.1,  0.25, 0.5,   1.0,   2.5,  5.0,
                                          10.0,  20.0, 40.0,  80.0, 160.0, 320.0, 640.0, 1280.0, 2560.0};
static const double ttft_buckets[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25, 0.5,  0.75,
                                      1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};

/* a stream's first event's stages: tens of microseconds (the gateway's own) to seconds (the cluster's) */
static const double stage_buckets[] = {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                       0.1,     0.25,   0.5,     1.0,    2.5,   5.0,    10.0,  30.0, 60.0};

const char *gw_route_name(gw_route r) {
  switch (r) {
    case GW_R_COMPLETIONS: return "/v1/completions";
    case GW_R_TRANSCRIBE: return "/v1/audio/transcriptions";
    case GW_R_TRANSLATE: return "/v1/audio/translations";
    case GW_R_NONE: break;
  }
  return "other";
}

void gw_metrics_destroy(gw_metrics *m) {
  if (!m) return;
  td_metrics_destroy(m->reg);
  pthread_mutex_destroy(&m->mu);
  free(m);
}

td_status gw_metrics_create(gw_metrics **out) {
  *out = NULL;
  gw_metrics *m = calloc(1, sizeof *m);
  if (!m) return td_err(TD_ERR_NOMEM, "out of memory");
  pthread_mutex_init(&m->mu, NULL);
  static const char *const ep_code[] = {"endpoint", "code"};
  static const char *const ep[] = {"endpoint"};
  static const char *const ep_stage[] = {"endpoint", "stage"};
  td_status s = td_metrics_create(&m->reg);
#define ADD(slot, type, name, help, labels, n, b, nb)                                 \
  if (s == TD_OK) s = td_metrics_add(m->reg, type, name, help, labels, n, b, nb, &m->slot)
  ADD(requests, TD_METRIC_COUNTER, "tandem:gateway_requests_total",
      "API requests answered, by endpoint and HTTP status (0: the client left before an answer)", ep_code, 2, NULL,
      0);
  ADD(in_flight, TD_METRIC_GAUGE, "tandem:gateway_requests_in_flight", "API requests being received or answered",
      NULL, 0, NULL, 0);
  ADD(duration, TD_METRIC_HISTOGRAM, "tandem:gateway_request_duration_seconds",
      "from the request's arrival to the end of its answer", ep, 1, duration_buckets,
      (int)(sizeof duration_buckets / sizeof *duration_buckets));
  ADD(ttft, TD_METRIC_HISTOGRAM, "tandem:gateway_time_to_first_token_seconds",
      "streams: from the request's arrival to its first event", ep, 1, ttft_buckets,
      (int)(sizeof ttft_buckets / sizeof *ttft_buckets));
  ADD(stages, TD_METRIC_HISTOGRAM, "tandem:gateway_first_event_stage_seconds",
      "streams: the first event's time by stage (admit: arrival to the router; cluster: the router's first answer; "
      "answer: to the HTTP server)",
      ep_stage, 2, stage_buckets, (int)(sizeof stage_buckets / sizeof *stage_buckets));
  ADD(prompt, TD_METRIC_COUNTER, "tandem:gateway_prompt_tokens_total", "prompt tokens of answered requests", ep, 1,
      NULL, 0);
  ADD(generated, TD_METRIC_COUNTER, "tandem:gateway_generation_tokens_total",
      "tokens generated for answered requests (up to a stop string)", ep, 1, NULL, 0);
  ADD(audio, TD_METRIC_COUNTER, "tandem:gateway_audio_seconds_total", "seconds of audio in answered requests", ep, 1,
      NULL, 0);
  ADD(detections, TD_METRIC_COUNTER, "tandem:gateway_language_detections_total",
      "language detection requests sent (audio without a language: one decode step each)", ep, 1, NULL, 0);
  ADD(conns_opened, TD_METRIC_COUNTER, "tandem:gateway_connections_opened_total",
      "HTTP connections accepted (each takes a thread; many per request: clients not reusing connections)", NULL, 0,
      NULL, 0);
  ADD(conns_open, TD_METRIC_GAUGE, "tandem:gateway_connections_open", "HTTP connections open now", NULL, 0, NULL, 0);
#undef ADD
  if (s != TD_OK) {
    gw_metrics_destroy(m);
    return s;
  }
  *out = m;
  return TD_OK;
}

void gw_metrics_request(gw_metrics *m, const char *endpoint, int code, double seconds, int prompt_tokens,
                        int generated_tokens, double audio_seconds) {
  char cs[16];
  snprintf(cs, sizeof cs, "%d", code);
  const char *ec[] = {endpoint, cs}, *e[] = {endpoint};
  pthread_mutex_lock(&m->mu);
  td_metric_inc(m->requests, ec, 1);
  if (seconds >= 0) td_metric_observe(m->duration, e, seconds);
  if (prompt_tokens > 0) td_metric_inc(m->prompt, e, prompt_tokens);
  if (generated_tokens > 0) td_metric_inc(m->generated, e, generated_tokens);
  if (audio_seconds > 0) td_metric_inc(m->audio, e, audio_seconds);
  pthread_mutex_unlock(&m->mu);
}

void gw_metrics_connection(gw_metrics *m, bool opened) {
  pthread_mutex_lock(&m->mu);
  if (opened) td_metric_inc(m->conns_opened, NULL, 1);
  td_metric_inc(m->conns_open, NULL, opened ? 1 : -1);
  pthread_mutex_unlock(&m->mu);
}

void gw_metrics_language_detection(gw_metrics *m, const char *endpoint) {
  const char *e[] = {endpoint};
  pthread_mutex_lock(&m->mu);
  td_metric_inc(m->detections, e, 1);
  pthread_mutex_unlock(&m->mu);
}

void gw_metrics_first_event(gw_metrics *m, const char *endpoint, double seconds) {
  const char *e[] = {endpoint};
  pthread_mutex_lock(&m->mu);
  td_metric_observe(m->ttft, e, seconds);
  pthread_mutex_unlock(&m->mu);
}

void gw_metrics_stages(gw_metrics *m, const char *endpoint, double admit, double cluster, double answer) {
  const char *a[] = {endpoint, "admit"}, *c[] = {endpoint, "cluster"}, *w[] = {endpoint, "answer"};
  pthread_mutex_lock(&m->mu);
  td_metric_observe(m->stages, a, admit);
  td_metric_observe(m->stages, c, cluster);
  td_metric_observe(m->stages, w, answer);
  pthread_mutex_unlock(&m->mu);
}

td_status gw_metrics_render(gw_metrics *m, int in_flight, char **text, size_t *len) {
  pthread_mutex_lock(&m->mu);
  td_metric_set(m->in_flight, NULL, in_flight);
  td_status s = td_metrics_render(m->reg, text, len);
  pthread_mutex_unlock(&m->mu);
  return s;
}
