/* The router: the client front end (ZeroMQ ROUTER socket), the worker
 * registry (registration, heartbeats both ways, death after silence),
 * placement (decode by free blocks and queue, encoder by queue, prefill for
 * long prompts), the request lifecycle with timers for every stage,
 * streaming, cancellation, deadlines, bounded queueing and retries when a
 * worker dies. Single-threaded: td_router_run drives it on a td_loop.
 * Inside: router/internal.h (shared state), router/policy.h (the pure
 * admission and placement decisions). */
#ifndef TD_ROUTER_ROUTER_H
#define TD_ROUTER_ROUTER_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/cross_mode.h"
#include "common/status.h"
#include "proto/auth.h"
#include "frontend/audio.h"
#include "frontend/tokenizer.h"

typedef struct td_router td_router;

/* --kv-load-failure, named as vLLM's kv_load_failure_policy. */
typedef enum td_kv_load_failure { TD_KV_LOAD_RECOMPUTE, TD_KV_LOAD_FAIL } td_kv_load_failure;

/* 0 / NULL fields take the defaults of common/defaults.h. */
typedef struct td_router_opts {
  const char *client_endpoint; /* e.g. tcp://127.0.0.1:7000 */
  const char *worker_endpoint; /* e.g. tcp://127.0.0.1:7001 */
  /* Unix socket paths of the local links (proto/link.h) that clients and
   * workers of this host may use instead of the endpoints (NULL: none);
   * not with keys (a link has no CURVE: its file's owner is its only peer) */
  const char *client_socket, *worker_socket;
  int heartbeat_ms;            /* both ways */
  int dead_after;              /* missed heartbeats before a worker is dead */
  int max_queue;               /* requests waiting for placement; beyond: "overloaded" */
  int max_in_flight;           /* requests placed and not finished */
  int default_timeout_ms;      /* per request when the client gives none */
  int stage_timeout_ms;        /* reserve / encode / prefill stages */
  int max_attempts;            /* a request is tried on this many worker sets (at most 255) */
  /* A request whose KV was on its way to its decode worker when that failed
   * (the encoder or prefill worker lost or its push failed, the reservation
   * lost, the stage timed out): TD_KV_LOAD_RECOMPUTE gives it another attempt
   * (encoded again), TD_KV_LOAD_FAIL ends it with ERROR_UNAVAILABLE. */
  td_kv_load_failure kv_load_failure;
  int prefill_threshold;       /* decoder prompts this long go to a prefill worker */
  int encode_runs;             /* an encoder's queue holds at most this many of its runs */
  int local_encode_pct;        /* a decode worker that also encodes does while fewer than this % of its
                                  batch decode (with encoder-only workers beside it) */
  double local_encode_margin;  /* ... and while the encoder-only workers are more than this many of its encoder
                                  runs further behind than it (0: any; TD_ROUTER_MAX_ENCODE_RUNS at most) */
  int capacity_wait_ms;        /* a queued request waits this long for a role no live worker has (no encoder
                                  registered, every decode worker draining), then fails ERROR_UNAVAILABLE */
  long long max_held_bytes;    /* client messages of the requests queued and in flight, together; a new one
                                  past it is refused ERROR_OVERLOADED */
  const char *model_name;      /* served name (default: the workers' model type) */
  /* What the cluster's cross pools hold (td_model_opts.cross_mode): workers
   * exchange cross blocks, so one whose mode differs is refused. */
  td_cross_mode cross_mode;
  /* The front end, loaded once by router/main.c from --tokenizer DIR and
   * borrowed (it must outlive the router); NULL: text and audio requests are
   * refused and results carry no text. With a tokenizer, text becomes
   * input_ids at admission and every result (and streamed chunk) carries its
   * text; with mel and whisper too, audio becomes log-mel features and
   * Whisper's decoder prompt (docs/frontend.md). */
  const td_tokenizer *tokenizer;
  const td_mel *mel;
  const td_whisper_prompt *whisper;
  /* Prometheus' /metrics over HTTP (docs/metrics.md): served when `metrics`
   * is set, on metrics_host (NULL: TD_METRICS_DEFAULT_HOST, loopback) and
   * metrics_port (0: any free port; td_router_metrics_port says which). */
  bool metrics;
  const char *metrics_host;
  int metrics_port;
  /* A ZeroMQ context to bind in (so that inproc:// endpoints reach peers of
   * the same process); NULL: the router's own, with io_threads I/O threads
   * (0: TD_DEFAULT_ROUTER_IO_THREADS; TD_ROUTER_MAX_IO_THREADS at most). */
  void *zmq_ctx;
  int io_threads;
  /* The loop polls without sleeping for spin_us after a turn with messages
   * (0: never; at most TD_MAX_SPIN_US): a request's hops skip this thread's
   * wake-ups, for a core while it spins (GPU hosts with idle cores). */
  int spin_us;
  const td_auth *auth; /* CURVE keys and lists; NULL: plain sockets (docs/security.md) */
  /* The address clients and workers reach the endpoints at, when not the
   * one bound (a wildcard, a container's interface; NULL: as bound): what
   * the router says it serves on. */
  const char *advertise;
  /* A registering worker's KV endpoint, as it advertises it, is dialled
   * first: no answer within this many ms (or a refusal) refuses the worker
   * (0: TD_DEFAULT_PROBE_TIMEOUT_MS; negative: no check). */
  int probe_timeout_ms;
} td_router_opts;

td_status td_router_create(const td_router_opts *opts, td_router **out);
void td_router_destroy(td_router *r);
/* The client and worker endpoints as peers dial them (the advertised
 * address, the ports bound). */
const char *td_router_client_endpoint(const td_router *r);
const char *td_router_worker_endpoint(const td_router *r);
/* The /metrics server's port (0: not serving). */
int td_router_metrics_port(const td_router *r);
/* Runs until *stop becomes non-zero; then tells clients and workers and
 * returns. */
td_status td_router_run(td_router *r, volatile sig_atomic_t *stop);

#endif
