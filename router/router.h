/* The router: the client front end (ZeroMQ ROUTER socket), the worker
 * registry (registration, heartbeats both ways, death after silence),
 * placement (decode by free blocks and queue, encoder by queue, prefill for
 * long prompts), the request lifecycle with timers for every stage,
 * streaming, cancellation, deadlines, bounded queueing and retries when a
 * worker dies. Single-threaded: td_router_run drives it. */
#ifndef TD_ROUTER_ROUTER_H
#define TD_ROUTER_ROUTER_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/cross_mode.h"
#include "common/status.h"

typedef struct td_router td_router;

typedef struct td_router_opts {
  const char *client_endpoint; /* e.g. tcp://127.0.0.1:7000 */
  const char *worker_endpoint; /* e.g. tcp://127.0.0.1:7001 */
  int heartbeat_ms;            /* both ways (default 500) */
  int dead_after;              /* missed heartbeats before a worker is dead (default 6) */
  int max_queue;               /* requests waiting for placement; beyond: "overloaded" (default 1024) */
  int max_in_flight;           /* requests placed and not finished (default 4096) */
  int default_timeout_ms;      /* per request when the client gives none (default 600000) */
  int stage_timeout_ms;        /* reserve / encode / prefill stages (default 60000) */
  int max_attempts;            /* a request is tried on this many worker sets (default 3) */
  int prefill_threshold;       /* decoder prompts this long go to a prefill worker (default 16) */
  const char *model_name;      /* served name (default: the workers' model type) */
  /* What the cluster's cross pools hold (td_model_opts.cross_mode): workers
   * exchange cross blocks, so one whose mode differs is refused. */
  td_cross_mode cross_mode;
} td_router_opts;

td_status td_router_create(const td_router_opts *opts, td_router **out);
void td_router_destroy(td_router *r);
/* Runs until *stop becomes non-zero; then tells workers and returns. */
td_status td_router_run(td_router *r, volatile sig_atomic_t *stop);

#endif
