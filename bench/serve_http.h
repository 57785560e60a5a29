/* bench-serve's HTTP client: the workload's requests as streamed
 * /v1/completions calls to tandem-gateway (libcurl's multi-socket interface
 * over epoll, one thread, every request on its own connection as OpenAI
 * clients do). */
#ifndef TD_BENCH_SERVE_HTTP_H
#define TD_BENCH_SERVE_HTTP_H

#include <stdbool.h>

#include "common/jsonl.h"
#include "common/status.h"

typedef struct td_http_bench td_http_bench;

typedef struct td_http_events {
  void (*first)(void *ctx, int index);                       /* the first token's event */
  void (*done)(void *ctx, int index, bool ok, int n_tokens); /* n_tokens: the usage's completion_tokens */
  void *ctx;
} td_http_events;

/* url: the gateway (http://HOST:PORT); model: the name to send (NULL: the
 * first of GET /v1/models). */
td_status td_http_bench_create(const char *url, const char *model, td_http_bench **out);
void td_http_bench_destroy(td_http_bench *h);
/* Opens n connections before the clock starts (GET /health on each, kept
 * alive in the client's pool), as a client holding a connection pool would;
 * the requests then reuse them. */
td_status td_http_bench_warm(td_http_bench *h, int n);
/* The gateway's own account of its streams' first events (its /metrics,
 * endpoint /v1/completions): seconds summed and counted by stage (admit:
 * arrival to the router; cluster: the router's first answer; answer: to the
 * HTTP server). A gateway without them gives zeros. */
typedef struct td_http_stages {
  double sum[3], count[3];
} td_http_stages;
td_status td_http_bench_stages(td_http_bench *h, td_http_stages *out);
/* This client's side of the streams' first events, summed over n: from the
 * submit call to the first event; from curl's start of the transfer to the
 * request sent (CURLINFO_PRETRANSFER_TIME) and to the response's first
 * byte, its headers (CURLINFO_STARTTRANSFER_TIME). */
typedef struct td_http_hop {
  double sent_ms, headers_ms, first_ms;
  int n;
} td_http_hop;
td_http_hop td_http_bench_hop(const td_http_bench *h);
/* Builds the JSON bodies of n requests before the clock starts, as a load
 * generator holds its requests ready: encoding ~350 ids a body took ~0.3 ms
 * on a GPU host, and a burst of 256 waited up to ~90 ms on the client's own
 * printing. A later submit of index i sends body i. */
td_status td_http_bench_prepare(td_http_bench *h, const td_json_request *reqs, int n);
/* Sends request r (ids only: features or a decoder prompt are refused); its
 * body prepared at index, else built now. */
td_status td_http_bench_submit(td_http_bench *h, const td_json_request *r, int index);
/* Moves transfers for up to timeout_ms; reports through ev. */
td_status td_http_bench_poll(td_http_bench *h, int timeout_ms, const td_http_events *ev);

#endif
