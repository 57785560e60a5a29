/* The C client library: connect to a router, send generate requests, get
 * streamed tokens and results through callbacks, cancel, time out. One
 * thread drives a client. */
#ifndef TD_CLIENT_CLIENT_H
#define TD_CLIENT_CLIENT_H

#include <stdbool.h>
#include <stdint.h>

#include "common/jsonl.h"
#include "common/request.h"
#include "common/status.h"
#include "proto/auth.h"

typedef struct td_client td_client;

/* Where a request's time went, as the router saw it (ms; 0: the stage did
 * not run): queue (arrival to placement), reserve (to the decode worker's
 * reservation), encode (the encoder's compute), transfer (the encoder's
 * wait and KV push), prefill (compute), first token (placement to the
 * first token at the router), decode (the decode worker's, admission to
 * result), total (arrival to result); worker first token (the decode
 * worker's part of first token, its receipt of the job to the token: the
 * rest is hops and the router's own time). */
typedef struct td_client_timings {
  double queue_ms, reserve_ms, encode_ms, transfer_ms, prefill_ms, first_token_ms, decode_ms, total_ms;
  double worker_first_token_ms;
  int attempts;
} td_client_timings;

/* A request's end as the router reports it: the sequences (best first), or
 * why it failed. Valid during the on_result call. */
typedef struct td_client_result {
  const char *id;
  td_status status;     /* TD_OK, or the error's code */
  const char *error;    /* status != TD_OK: the router's message */
  int n_outputs;
  const td_seq_output *outputs;
  td_client_timings timings; /* where the time went (zeros for a failed request) */
} td_client_result;

typedef struct td_client_events {
  /* Streamed tokens of sequence `seq`, starting at output position `offset`. */
  void (*on_tokens)(void *ctx, const char *id, int seq, int offset, const int32_t *tokens, const float *logprobs,
                    int n);
  /* The text streamed tokens add (the router has a tokenizer), just before
   * their on_tokens; a chunk of no tokens carries the text held back at the end.
   * Concatenated, a sequence's pieces are its result's text. May be NULL. */
  void (*on_text)(void *ctx, const char *id, int seq, int offset, const char *text);
  /* The final result (r->status != TD_OK for errors); valid during the call. */
  void (*on_result)(void *ctx, const td_client_result *r);
  void *ctx;
} td_client_events;

typedef struct td_client_worker {
  char id[64];
  bool encode, prefill, decode, draining;
  int self_blocks, free_self_blocks, cross_blocks, free_cross_blocks, running, max_running, queued, jobs;
  /* KV blocks received / pushed over UCX (kvtransfer) and ZeroMQ; pushes in flight */
  uint64_t kv_in_ucx, kv_in_zmq, kv_out_ucx, kv_out_zmq;
  uint64_t kv_out_ipc; /* of kv_out_ucx: over CUDA IPC */
  uint64_t encoded;    /* requests its encoder ran */
  uint64_t encoder_cache_hits; /* requests whose cross KV came from its encoder cache */
  int encoder_cache_blocks;    /* cross blocks that cache holds (counted in free_cross_blocks) */
  int kv_pushing;
  uint64_t kv_refused;  /* KV pushes into it refused (wrong sender, no reservation, bad blocks) */
  /* engine steps, tokens they generated, encoder runs, and the wall time
   * spent in steps: utilisation and mean decode batch between two looks */
  uint64_t steps, tokens, encode_runs;
  double busy_seconds, idle_seconds;
  double project_seconds; /* projecting arrived encoder states (neither busy nor idle) */
  uint64_t work_began_ms, work_ended_ms; /* Unix ms: its engine last went from no work to work, ran out of it */
  char device[32];      /* its backend ("cpu", "cuda:0", ...) */
  char version[64];     /* its build */
  char group[64];       /* its TP/PP group ("" alone) */
  unsigned pid;
  bool drain_requested; /* an operator drains it (undrain takes it back) */
  bool stopping;        /* it drains on its own (a signal): it will leave */
} td_client_worker;

typedef struct td_client_health {
  bool serving;
  char cross_mode[16]; /* what the cluster's cross pools hold (td_cross_mode's name) */
  int encoders, prefills, decoders, in_flight, queued;
  int n_workers;
  td_client_worker workers[64];
  int workers_left_out; /* workers past the 64 shown here (the router has them) */
} td_client_health;

/* Connects without waiting (a router that is not there yet is reached
 * once it binds). */
td_status td_client_connect(const char *endpoint, td_client **out);
/* Connects and waits up to timeout_ms for the router to answer a probe:
 * TD_ERR_PEER "no router answers at EP within N ms" when none does. */
td_status td_client_connect_wait(const char *endpoint, int timeout_ms, td_client **out);
/* The same over CURVE: auth's key pair, the router's public key from auth
 * (NULL auth: plain TCP). A router that refuses the key answers nothing:
 * connect_wait then reports TD_ERR_PEER after timeout_ms, and the router
 * logs the refusal (docs/security.md). */
td_status td_client_connect_auth(const char *endpoint, const td_auth *auth, td_client **out);
td_status td_client_connect_wait_auth(const char *endpoint, const td_auth *auth, int timeout_ms, td_client **out);
/* td_client_connect_wait_auth with keys from files (none set: in the clear), as the command-line tools take them. */
td_status td_client_connect_wait_keys(const char *endpoint, const td_auth_opts *keys, int timeout_ms, td_client **out);
void td_client_close(td_client *c);

/* Sends a request (its id must be unique among this client's requests in
 * flight): its ids, features, text or audio (the router converts text and
 * audio when it has a tokenizer). timeout_ms: the router's deadline (0: its default); the client
 * also gives up on its own at that deadline plus a grace period. Over tcp and
 * ipc the client watches its router connection: a request whose connection
 * is lost (the router killed: at once; silent: within about 6 s, ZeroMQ
 * heartbeats), or that finds none within TD_CLIENT_ROUTER_WAIT_MS, ends with
 * TD_ERR_NETWORK "router unreachable: ..."; later requests go to the router
 * the socket reconnects to. */
td_status td_client_generate(td_client *c, const td_json_request *r, bool stream, uint32_t timeout_ms);
td_status td_client_cancel(td_client *c, const char *id);
/* Waits up to timeout_ms for messages and dispatches them; returns after
 * the first batch of messages or the timeout. Requests past their client
 * deadline end with TD_ERR_TIMEOUT, those whose router is unreachable with
 * TD_ERR_NETWORK, those the router answered with a message past a field's
 * limit with TD_ERR_FORMAT. */
td_status td_client_poll(td_client *c, int timeout_ms, const td_client_events *ev);
/* The same, also waking when descriptor fd (>= 0; e.g. an eventfd another
 * thread writes to hand this one work) turns readable: *fd_ready says so
 * (the caller drains it). */
td_status td_client_poll_fd(td_client *c, int fd, int timeout_ms, const td_client_events *ev, bool *fd_ready);
int td_client_pending(const td_client *c);
td_status td_client_health_check(td_client *c, int timeout_ms, td_client_health *out);

/* An operator's requests (the router may refuse them to this client). */
typedef enum td_admin_action { TD_ADMIN_LIST, TD_ADMIN_DRAIN, TD_ADMIN_UNDRAIN, TD_ADMIN_REMOVE } td_admin_action;
typedef struct td_admin_reply {
  td_status status;     /* TD_OK, or the router's refusal */
  char code[32];        /* the router's error code in words ("not_found", "failed_precondition", ...; "" when ok) */
  char message[512];    /* what the router did, or why not */
  td_client_health health; /* TD_ADMIN_LIST: the workers */
} td_admin_reply;
/* Sends one admin request about worker `worker` (ignored for TD_ADMIN_LIST)
 * and waits up to timeout_ms for the router's answer in *out. Returns
 * TD_OK when an answer came (out->status tells whether the router did it),
 * TD_ERR_TIMEOUT when none did. */
td_status td_client_admin(td_client *c, td_admin_action a, const char *worker, int timeout_ms, td_admin_reply *out);

#endif
