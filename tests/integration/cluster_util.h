/* Real processes on loopback for the cluster tests: start a router and
 * workers, talk to them with the client library, stop them. */
#ifndef TD_TESTS_CLUSTER_UTIL_H
#define TD_TESTS_CLUSTER_UTIL_H

#include <stdbool.h>
#include <stdio.h>
#include <sys/types.h>

#include "client/client.h"

#define MAX_PROCS 16

typedef struct proc {
  pid_t pid;
  char name[32];
  bool exited;
  int status;
  char args[2048]; /* its command line, NUL-separated (cluster_restart) */
  int n_args;
} proc;

typedef struct cluster {
  char dir[256];
  char model[512];
  char client_ep[64], worker_ep[64];
  proc p[MAX_PROCS];
  int n;
  int encoders, prefills, decodes;
  char worker_extra[256];           /* flags for every worker */
  char extra_worker[64], extra_flags[256]; /* ... but this one (a worker, group or group rank) gets these */
  const char *group_roles;          /* cluster_add_group's --role (NULL: decode) */
  char keys[256];                   /* CURVE: the folder of key files ("" without) */
  const td_auth *auth;              /* CURVE: this test's client keys (NULL without) */
} cluster;

typedef struct cluster_opts {
  const char *model;
  int encoders, prefills, decodes;
  int group_tp, group_pp; /* decode workers as groups of this many ranks */
  bool decoders_encode;   /* decode workers encode too, beside the encoders */
  int idle_within_ms;     /* run_topology: the health must show every worker idle this soon (0: 5000) */
  int prefill_threshold; /* 0: router default */
  int block_size;
  const char *router_extra; /* extra router flags, space separated */
  const char *router_bind;  /* the address the router's endpoints bind (NULL: 127.0.0.1, which clients dial) */
  const char *worker_extra; /* extra flags of every worker, space separated */
  const char *extra_worker; /* a worker (e.g. "prefill-0") that gets extra_flags instead */
  const char *extra_flags;
  /* CURVE everywhere: the folder holding router.key / router.pub, NAME.key
   * of each worker, workers.list, clients.list and admins.list,
   * and the client keys the test's own connections use */
  const char *keys;
  const td_auth *auth;
} cluster_opts;

void cluster_start(cluster *c, const cluster_opts *o);
/* Starts one more worker; returns its index. */
int cluster_add_worker(cluster *c, const char *name, const char *roles, int block_size);
/* Starts a decode group of `world` ranks ("--tp" or "--pp"); returns the
 * index of rank 0. */
int cluster_add_group(cluster *c, const char *name, const char *par, int world, int block_size);
/* SIGTERM everything; true when every process exited cleanly in time. */
bool cluster_stop(cluster *c);
void cluster_kill(cluster *c, int idx);
/* Starts process idx again with its command line (it must have exited),
 * its log appended to; returns the new process's index. */
int cluster_restart(cluster *c, int idx);
/* Waits until the router reports the given worker counts. */
bool cluster_wait_ready(cluster *c, int encoders, int prefills, int decodes, int timeout_ms);
bool cluster_health(cluster *c, td_client_health *h);
/* KV blocks moved over UCX and ZeroMQ by the workers whose id starts with
 * prefix (NULL: all), once the heartbeats show every pushed block arrived
 * (and nothing changes for a few heartbeats). */
typedef struct kv_count {
  uint64_t in_ucx, in_zmq, out_ucx, out_zmq;
} kv_count;
bool cluster_kv_count(cluster *c, const char *prefix, int timeout_ms, kv_count *out);
/* The router's /metrics text (the router runs with --metrics-port; its log
 * names the port), malloc'ed, or NULL when it does not answer. */
char *cluster_scrape(cluster *c);
/* The value of the sample whose name and labels are exactly `series` in a
 * /metrics text; -1 when absent. */
double metric_sample(const char *text, const char *series);
/* Whether the log of process `name` holds `text`. */
bool cluster_log_has(cluster *c, const char *name, const char *text);
/* Waits until every live worker holds no blocks and nothing is in flight. */
bool cluster_wait_idle(cluster *c, int timeout_ms, char *why, size_t cap);

/* Results of many requests sent over one client; tokens past OUT_TOKENS
 * are dropped. */
#define OUT_TOKENS 512
typedef struct outcome {
  char id[64];
  bool done;
  td_status status;
  char error[256];
  int n_out;
  int32_t tok[8][OUT_TOKENS];
  int len[8];
  td_finish finish[8];
  /* streamed chunks of sequence 0 */
  int32_t streamed[OUT_TOKENS];
  int n_streamed;
  bool order_ok;
  /* each output's text (a router with a tokenizer), and the text streamed for sequence 0 */
  bool has_text[8];
  char text[8][256];
  char streamed_text[512];
} outcome;

/* Sends reqs (parsed request lines) and waits for all results. */
void run_requests(const char *endpoint, td_json_request *reqs, int n, bool stream, int timeout_ms, outcome *out);
/* The same over CURVE with auth's client keys (NULL: plain). */
void run_requests_auth(const char *endpoint, const td_auth *auth, td_json_request *reqs, int n, bool stream,
                       int timeout_ms, outcome *out);
/* run_requests on a thread (pthread_create(..., client_thread, &job)), 60 s a request. */
typedef struct client_job {
  const char *ep;
  td_json_request *reqs;
  int n;
  outcome *out;
  bool stream;
} client_job;
void *client_thread(void *arg);
/* Parses a JSONL file (or string lines) into requests; returns the count. */
int load_requests(const char *path, td_json_request *reqs, int cap);
/* Reads result lines (JSON lines beginning with '{'; others skipped) into
 * outcomes: id, status (TD_OK or the line's error), tokens, finish reasons.
 * Returns the count. */
int read_results(FILE *f, outcome *out, int cap);
/* Runs tandem-generate over path into outcomes (n of them, all read). */
void generate_reference(const char *model, const char *path, int block_size, outcome *out, int n);
/* The fixture's requests (greedy, up to 8) through the cluster: each
 * gives transformers' tokens. */
struct fixture;
void expect_fixture_greedy(cluster *c, const struct fixture *fx);

#endif
