/* A worker process's runtime: one event loop (common/evloop.h) over the
 * router connection, the KV transports and compute completions; a compute
 * thread that owns the backend, model and engine, so the loop never waits
 * on compute and heartbeats flow during long steps. The roles it serves
 * (encode, prefill, decode) are tables (worker/role.h) given in the
 * options; the runtime knows them only through those. */
#ifndef TD_WORKER_WORKER_H
#define TD_WORKER_WORKER_H

#include <signal.h>
#include <stdbool.h>

#include "common/cross_mode.h"
#include "common/settings.h"
#include "common/status.h"
#include "proto/auth.h"
#include "kernels/ops.h"

typedef struct td_worker td_worker;
typedef struct td_role td_role;

typedef struct td_worker_opts {
  const char *router;      /* the router's worker endpoint */
  /* CURVE keys (NULL: plain): this worker's key pair, the router's public
   * key, the workers whose KV pushes its endpoint admits. With keys, KV
   * goes over ZeroMQ only (UCX has no CURVE; docs/security.md). */
  const td_auth *auth;
  const char *id;          /* unique worker id */
  /* the roles served (the role folders' tables), at most TD_WORKER_MAX_ROLES */
  const td_role *const *roles;
  int n_roles;
  const char *model_dir;
  td_backend_kind device;
  int device_id;
  int block_size;
  int self_blocks, cross_blocks; /* 0: sized from max_batch */
  int max_batch;           /* sequences in a decode step (0: TD_DEFAULT_GPU_MAX_BATCH on a GPU, else
                              TD_DEFAULT_WORKER_MAX_BATCH) */
  /* on a GPU, a single-rank worker's pools left at zero take what this share
   * of the device leaves after its weights (0: TD_DEFAULT_GPU_MEMORY_FRACTION;
   * several workers on one GPU each take their part) */
  double gpu_memory_fraction;
  int max_tokens;          /* decoder rows in a step */
  int max_enc_tokens;      /* encoder tokens a batch (0: TD_DEFAULT_GPU_MAX_ENC_TOKENS on a GPU, else
                              TD_DEFAULT_MAX_ENC_TOKENS) */
  int max_enc_seqs;        /* encoder sequences a batch (0: likewise) */
  double encoder_cache_fraction; /* td_engine_opts.encoder_cache_fraction (0: no encoder cache;
                                    tandem-worker: TD_DEFAULT_ENCODER_CACHE_FRACTION) */
  int threads;             /* CPU BLAS threads */
  int reservation_ttl_ms;  /* unclaimed reservations expire */
  int transfer_timeout_ms; /* a KV push with no answer fails */
  /* KV pushes to other workers: "auto" (UCX straight between the pools
   * where both sides can, else ZeroMQ), "ucx" (UCX or fail) or "zmq" */
  const char *transfer;
  /* the address the KV and group endpoints bind (a wildcard or an
   * interface of a container with advertise), and the one peers are told
   * (NULL: listen_host); UCX follows the advertised one (docs/deploy.md) */
  const char *listen_host;
  const char *advertise;
  /* A tensor- or pipeline-parallel group: one process per rank; rank 0
   * serves, the others replay its model calls (td_worker_follow). */
  const char *group;
  int tp, pp;              /* group size along one of them (the other 1) */
  /* TP: every rank the whole encoder over its share of the rows
   * (td_model_opts.enc_rows; --tp-encoder rows), else its heads */
  bool enc_rows;
  int pp_sets;             /* a pipeline group: 2 = two running sets (td_model_opts.pp_sets), every rank alike */
  int encode_defer;        /* two running sets: td_engine_opts.encode_defer_steps (0: the engine's default) */
  /* The main loop and the compute thread poll for spin_us after work before
   * they sleep (0: never; at most TD_MAX_SPIN_US): a request's first token
   * skips two thread wake-ups here, for up to two cores while they spin. */
  int spin_us;
  int rank;
  /* What the cross pool holds (td_model_opts.cross_mode); the router
   * refuses a worker whose mode differs from the cluster's. */
  td_cross_mode cross_mode;
  /* An encoder-only worker in cross mode auto pushes the encoder states
   * (its pool in cross mode states; the receiver projects them into K/V):
   * 48-64x fewer bytes than every layer's K/V. true: K/V pushes, as its
   * mode resolves (--cross-transfer kv). */
  bool cross_transfer_kv;
  /* The cross pool's K/V in int8 (td_model_opts.cross_int8): K/V blocks
   * are pushed only between int8 pools; encoder states pushed to it are
   * projected into int8 K/V. */
  bool cross_int8;
  int states_rows; /* td_model_opts.states_rows (every rank of a group the same) */
  /* from the environment, read once in main: backend, model and KV
   * transfer tuning (every rank of a group the same) */
  td_settings settings;
} td_worker_opts;

/* A follower rank of a worker group: joins the group through the router,
 * loads its slice of the model and replays the leader's calls until the
 * leader stops (or dies, or *stop). */
td_status td_worker_follow(const td_worker_opts *opts, volatile sig_atomic_t *stop);

/* Fills unset fields (what every rank of a group must agree on). */
void td_worker_opts_default(td_worker_opts *o);
td_status td_worker_create(const td_worker_opts *opts, td_worker **out);
/* Serves until *stop; SIGTERM-style stop drains: no new work, running work
 * finishes (or is handed back), then deregisters. */
td_status td_worker_run(td_worker *w, volatile sig_atomic_t *stop);
void td_worker_destroy(td_worker *w);

#endif
