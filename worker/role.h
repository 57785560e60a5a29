/* The worker runtime as a role sees it: the role table (td_role) that each
 * role folder (encoder_worker/, prefill_worker/, decode_worker/) defines,
 * and the calls a role makes: take a job from a router message, reserve
 * blocks for KV that peers push, run the request on the compute thread's
 * engine, push the handed-over blocks to their targets, report to the
 * router. The runtime reaches a role only through its table; tandem-worker's
 * main hands the tables over in td_worker_opts.roles. */
#ifndef TD_WORKER_ROLE_H
#define TD_WORKER_ROLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"
#include "proto/wire.h"
#include "worker/worker.h"

typedef struct td_job td_job;

/* Which pool the blocks of a finished request are handed over from. */
typedef enum td_role_pool { TD_POOL_NONE = 0, TD_POOL_CROSS, TD_POOL_SELF } td_role_pool;

/* A request that finished on the engine (only successes reach a role: the
 * runtime reports failures itself). */
typedef struct td_done {
  Tandem__SequenceOutput **outputs; /* best first */
  int n_outputs;
  double ms;       /* on the compute thread */
  double first_ms; /* the job message's receipt to the first token (0: none) */
} td_done;

struct td_role {
  const char *name;                               /* "encode": logs and refusals */
  Tandem__Cluster__Role id;                       /* what the worker registers */
  Tandem__Cluster__RouterMessage__BodyCase job;   /* the router message it takes */
  bool streams;          /* tokens go to the router as they come */
  td_role_pool hands_over; /* its finished blocks leave for other workers (td_job_push) */
  bool self_kv;          /* its requests hold decoder self-attention KV (else the self pool stays token-sized) */
  bool in_group;         /* a TP / PP group may serve it (its blocks never leave whole-model) */
  bool group_self;       /* a group may take it for its own requests only (encode: its blocks are sliced
                            across the ranks, so none can leave for another worker); the router is told
                            so by the group's registration, and jobs for others are refused */
  /* a job message (m is the role's: td_job_take keeps it with the job) */
  void (*on_job)(td_worker *w, Tandem__Cluster__RouterMessage *m);
  /* blocks arrived in the job's reservation (NULL: never reserves) */
  void (*on_arrival)(td_worker *w, td_job *j);
  /* the engine finished the job's request */
  void (*on_done)(td_worker *w, td_job *j, const td_done *d);
  /* every push of td_job_push ended: error NULL, or why one failed (NULL: pushes nothing) */
  void (*on_pushed)(td_worker *w, td_job *j, const char *error);
  /* another router message about its jobs (decode: PrefillResult); 0: none */
  Tandem__Cluster__RouterMessage__BodyCase notice;
  void (*on_notice)(td_worker *w, const Tandem__Cluster__RouterMessage *m);
};

/* ---- jobs: a request's part on this worker for one role ---- */

/* The job of router message m for request spec: NULL when refused (no
 * spec, !well_formed, draining, the request already here, out of memory),
 * after telling the router why and freeing m. Else the job owns m. */
td_job *td_job_take(td_worker *w, const td_role *r, Tandem__Cluster__RouterMessage *m,
                    const Tandem__Cluster__RequestSpec *spec, bool well_formed);
td_job *td_job_find(td_worker *w, uint64_t rid, const td_role *r);
uint64_t td_job_rid(const td_job *j);
const Tandem__Cluster__RouterMessage *td_job_msg(const td_job *j);
const Tandem__Cluster__RequestSpec *td_job_spec(const td_job *j);
/* ms its request spent on the compute thread */
double td_job_compute_ms(const td_job *j);
/* Ends the job: its reservations, handed-over blocks and pushes go back. */
void td_job_end(td_worker *w, td_job *j);
/* Tells the router the job failed (Failed: retryable unless the request
 * itself is bad, TD_ERR_INVALID / TD_ERR_UNSUPPORTED) and ends it. */
void td_job_fail(td_worker *w, td_job *j, td_status code, const char *msg);

/* ---- KV that peers push here ---- */

/* Reserves blocks for cross_tokens of encoder KV and self_tokens of prompt
 * KV; the router hears Reserved once they are, or Failed. Refuses (status
 * and td_err naming the limit) what this worker's pools cannot hold.
 * cross_from / self_from: the workers the router named to push into them
 * (in the job's message); a push from any other is refused, and a
 * reservation with tokens but no well-formed sender is refused here. */
td_status td_job_reserve(td_worker *w, td_job *j, int cross_tokens, int self_tokens,
                         const Tandem__Cluster__KvSender *cross_from, const Tandem__Cluster__KvSender *self_from);
/* Whether every reserved block arrived and the request is not running yet. */
bool td_job_kv_ready(const td_job *j);

/* ---- the request on the engine ---- */

typedef struct td_job_run {
  /* the reserved blocks hold the encoder's KV (and the prompt's when
   * self tokens were reserved); else the request is encoded here */
  bool reserved_kv;
  bool encode_only;   /* the cross KV only, handed over */
  int prefill_tokens; /* > 0: the KV of this many prompt tokens only, handed over */
  /* where the handed-over blocks go: they are copied to host memory when
   * a transport that needs it reaches one of them */
  Tandem__Cluster__KvTarget *const *push_to;
  size_t n_push_to;
  void (*adjust)(td_request *r); /* the role's changes to the request built from the spec */
} td_job_run;
/* Hands the request to the engine; on_done (or a Failed) follows.
 * TD_ERR_INVALID for request data that does not fit the model. */
td_status td_job_run_request(td_worker *w, td_job *j, const td_job_run *run);

/* ---- blocks handed over ---- */

/* Pushes the job's handed-over blocks into each target's reserved blocks,
 * over the transport that reaches it; on_pushed follows once all ended. */
void td_job_push(td_worker *w, td_job *j, Tandem__Cluster__KvTarget *const *targets, size_t n_targets);

/* ---- the router ---- */

void td_worker_send(td_worker *w, Tandem__Cluster__WorkerMessage *m);
void td_worker_send_failed(td_worker *w, uint64_t rid, td_status code, const char *msg, bool retryable);
bool td_worker_draining(const td_worker *w);

#endif
