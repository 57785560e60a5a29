/* Shared by the worker runtime and the role handlers (encoder_worker/,
 * prefill_worker/, decode_worker/). Not a public interface. */
#ifndef TD_WORKER_INTERNAL_H
#define TD_WORKER_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include <uthash.h>

#include "engine/engine.h"
#include "proto/wire.h"
#include "worker/worker.h"

/* ---- main thread -> compute thread ---- */
typedef enum cmd_kind {
  CMD_RESERVE,        /* reserve cross (n_cross) and self (n_self) blocks */
  CMD_RELEASE_RES,    /* give back reservations */
  CMD_ADD,            /* a request for the engine */
  CMD_CANCEL,         /* end everything of rid */
  CMD_RELEASE_BLOCKS, /* blocks handed over earlier */
  CMD_WRITE_KV,       /* arrived KV bytes (whole-model blocks) into the pools */
} cmd_kind;

typedef enum wrole { ROLE_ENCODE, ROLE_PREFILL, ROLE_DECODE } wrole;

typedef struct cmd {
  cmd_kind kind;
  uint64_t rid;
  wrole role;
  int n_cross, n_self;
  uint64_t cross_res, self_res;
  bool cross;       /* CMD_RELEASE_BLOCKS: which pool */
  int32_t *blocks;  /* CMD_RELEASE_BLOCKS, CMD_WRITE_KV (owned) */
  int n_blocks;
  uint8_t *data;    /* CMD_WRITE_KV: n_blocks whole-model blocks (owned) */
  bool host_copy;   /* CMD_ADD: hand over the blocks' bytes in host memory (a ZeroMQ push) */
  /* CMD_ADD */
  td_request req;
  char id[256]; /* req.id points here */
  int32_t *owned_i32[4]; /* arrays the request points into */
  float *owned_f32;
  struct cmd *next;
} cmd;

/* ---- compute thread -> main thread ---- */
typedef enum ev_kind { EV_RESERVED, EV_TOKEN, EV_DONE } ev_kind;

typedef struct wev {
  ev_kind kind;
  uint64_t rid;
  wrole role;
  /* EV_RESERVED */
  uint64_t cross_res, self_res;
  int32_t *cross_ids, *self_ids;
  int n_cross, n_self;
  /* EV_TOKEN */
  int seq;
  int32_t token;
  float logprob;
  /* EV_DONE */
  td_status status;
  char *error;
  Tandem__SequenceOutput **outputs;
  int n_outputs;
  int32_t *blocks; /* handed-over blocks */
  int n_blocks;
  uint8_t *host;   /* their bytes, copied to host memory */
  size_t block_bytes;
  double ms;
  struct wev *next;
} wev;

/* A request's part on this worker, in the main thread. */
typedef struct job {
  uint64_t key;     /* rid * 4 + role */
  uint64_t rid;
  wrole role;
  Tandem__Cluster__RouterMessage *msg; /* owns the request spec */
  Tandem__Cluster__RequestSpec *spec;
  bool reserved;
  uint64_t cross_res, self_res;
  int32_t *cross_ids, *self_ids;
  int n_cross, n_self;
  int cross_got, self_got;   /* blocks arrived */
  int self_expected;         /* 0: no prompt KV comes */
  bool added;                /* handed to the engine */
  int64_t expires;           /* reservation deadline (ms) */
  /* senders: blocks to push and where */
  int32_t *out_blocks;
  int n_out;
  bool out_cross;
  uint8_t *out_host; /* their bytes */
  size_t out_bb;
  int pushes_pending;
  bool push_failed;
  char push_error[256];
  int64_t t_start;
  double compute_ms;
  UT_hash_handle hh;
} job;

/* ---- KV transport (peers identified by descriptor bytes) ---- */
typedef struct xfer xfer;
typedef struct xfer_hooks {
  /* whether n blocks of block_bytes each may be written into a reservation now */
  bool (*accept)(void *ctx, uint64_t rid, uint64_t reservation, bool cross, const int32_t *blocks, int n,
                 size_t block_bytes, char *why, size_t cap);
  /* their bytes: data[i] holds block blocks[i] */
  void (*deliver)(void *ctx, bool cross, const int32_t *blocks, int n, const void *const *data, size_t block_bytes);
  void (*arrived)(void *ctx, uint64_t rid, uint64_t reservation, bool cross, int n);
  /* a push finished: ok, or the error */
  void (*pushed)(void *ctx, uint64_t rid, int role, bool ok, const char *error);
  void *ctx;
} xfer_hooks;

td_status xfer_create(const char *host, const xfer_hooks *hooks, int timeout_ms, xfer **out);
void xfer_destroy(xfer *x);
/* This worker's descriptor: what peers need to push here. */
const char *xfer_desc(const xfer *x);
/* Sends n blocks (src[i]: block_bytes each, copied) into the
 * peer's reserved blocks dst; `pushed` reports the outcome. */
td_status xfer_push(xfer *x, uint64_t rid, int role, const uint8_t *peer, size_t peer_len, uint64_t reservation,
                    bool cross, const void *const *src, size_t block_bytes, const int32_t *dst, int n);
/* Poll items (ZeroMQ sockets) and progress. */
int xfer_poll_items(xfer *x, void *items, int cap);
void xfer_progress(xfer *x);
/* Drops pending pushes of rid (a cancel); their hooks never fire. */
void xfer_forget(xfer *x, uint64_t rid);
int xfer_pending(const xfer *x);

/* ---- KV over the kvtransfer module (UCX) between single-rank workers:
 * the engine's pools are registered, blocks go straight from the sender's
 * pool into the receiver's reserved blocks (worker/xfer_ucx.c) ---- */
typedef struct uxfer uxfer;
typedef struct uxfer_hooks {
  /* receiver: whether the blocks of the reservation may be written now */
  bool (*accept)(void *ctx, uint64_t rid, uint64_t reservation, bool cross, const int32_t *blocks, int n, char *why,
                 size_t cap);
  /* receiver: n blocks landed in the pool */
  void (*arrived)(void *ctx, uint64_t rid, uint64_t reservation, bool cross, int n);
  /* sender: a push of n blocks finished: ok, or the error */
  void (*pushed)(void *ctx, uint64_t rid, int role, bool ok, const char *error, int n);
  /* sender: blocks of forgotten pushes are no longer read (the array is the callee's) */
  void (*release)(void *ctx, bool cross, int32_t *blocks, int n);
  void *ctx;
} uxfer_hooks;

typedef struct uxfer_opts {
  const char *name;
  bool cuda;  /* pools in GPU memory of `device` (else host memory) */
  int device;
  int timeout_ms;
  int elem_size; /* bytes of a KV element (float32 on the CPU, bf16 on CUDA) */
  /* the whole decoder's (single-rank workers only); cross: with its states tail per --cross-mode */
  td_kv_layout cross_layout, self_layout;
  void *cross_base, *self_base; /* the engine's pools (compute thread's; only their memory is used here) */
  int cross_blocks, self_blocks;
  size_t cross_block_bytes, self_block_bytes; /* the pools' own: what the layouts must give */
  td_kvx_tuning kvx;
} uxfer_opts;

td_status uxfer_create(const uxfer_opts *o, const uxfer_hooks *hooks, uxfer **out);
/* Cancels every transfer (no hook fires); before the pools are freed. */
void uxfer_destroy(uxfer *u);
/* The kvtransfer descriptor (pools, UCX address) for peers. */
const uint8_t *uxfer_desc(const uxfer *u, size_t *len);
/* Whether blocks can go to the receiver with this kvtransfer descriptor
 * over UCX (same block geometry; connects); *why says why not. */
bool uxfer_route(uxfer *u, const char *peer_id, const uint8_t *desc, size_t len, bool cross, char *why, size_t cap);
/* Posts n blocks from this worker's pool (src, read until `pushed`) into
 * the receiver's reserved blocks dst. */
td_status uxfer_push(uxfer *u, uint64_t rid, int role, const char *peer_id, const uint8_t *desc, size_t len,
                     uint64_t reservation, bool cross, const int32_t *src, const int32_t *dst, int n);
/* Cancels the pushes of (rid, role); their hooks never fire. When some
 * still run and blocks is set, takes the blocks array and hands it to
 * `release` once none reads them; returns whether it took it. */
bool uxfer_forget(uxfer *u, uint64_t rid, int role, bool cross, int32_t *blocks, int n);
/* Whether a granted transfer still writes into the reservation's blocks. */
bool uxfer_busy(const uxfer *u, uint64_t reservation);
int uxfer_pushing(const uxfer *u);
/* Poll loop: a descriptor, arm before sleeping (false: do not sleep), progress. */
int uxfer_fd(const uxfer *u);
bool uxfer_arm(uxfer *u);
void uxfer_progress(uxfer *u);

/* How a sender's blocks reach one target. */
typedef enum kv_path { KV_NONE, KV_ZMQ, KV_UCX } kv_path;
typedef struct kv_route {
  kv_path path;
  char zmq[300];          /* KV_ZMQ: the receiver's ZeroMQ descriptor */
  const uint8_t *kvx;     /* KV_UCX: its kvtransfer descriptor (in d) */
  size_t kvx_len;
  char why[512];          /* KV_ZMQ: why not UCX; KV_NONE: why not at all */
  Tandem__Cluster__TransferDesc *d; /* the target's descriptor, unpacked */
} kv_route;
/* Decides (and logs once per receiver and path) how blocks reach t. */
void w_kv_route(td_worker *w, const Tandem__Cluster__KvTarget *t, bool cross, kv_route *r);
void kv_route_free(kv_route *r);

/* ---- the runtime, as role handlers see it ---- */
typedef struct td_worker td_worker;

void w_post(td_worker *w, cmd *c);
cmd *w_cmd(cmd_kind kind, uint64_t rid, wrole r);
job *w_job_new(td_worker *w, uint64_t rid, wrole r, Tandem__Cluster__RouterMessage *msg,
               Tandem__Cluster__RequestSpec *spec);
job *w_job_find(td_worker *w, uint64_t rid, wrole r);
void w_job_drop(td_worker *w, job *j);
void w_send(td_worker *w, Tandem__Cluster__WorkerMessage *m);
void w_send_failed(td_worker *w, uint64_t rid, td_status code, const char *msg, bool retryable);
void w_send_reserved(td_worker *w, job *j);
/* Gives the job's handed-over blocks back to the engine. */
void w_release_out_blocks(td_worker *w, job *j);
xfer *w_xfer(td_worker *w);
uxfer *w_uxfer(td_worker *w); /* NULL: ZeroMQ only */
/* Whether a sender needs its blocks in host memory: some target is pushed
 * over ZeroMQ (decided before the compute thread hands the blocks over). */
bool w_kv_host_copy(td_worker *w, Tandem__Cluster__KvTarget *const *targets, size_t n, bool cross);
int w_ttl_ms(td_worker *w);
bool w_draining(td_worker *w);
const td_worker_opts *w_opts(td_worker *w);
int w_block_size(td_worker *w);
/* A CMD_ADD built from a request spec (arrays copied). */
cmd *w_add_cmd(td_worker *w, job *j);

/* role handlers (main thread) */
void encoder_on_job(td_worker *w, Tandem__Cluster__RouterMessage *m);
void encoder_on_done(td_worker *w, job *j, wev *e);
void prefill_on_job(td_worker *w, Tandem__Cluster__RouterMessage *m);
void prefill_on_done(td_worker *w, job *j, wev *e);
void prefill_on_arrival(td_worker *w, job *j);
void decode_on_job(td_worker *w, Tandem__Cluster__RouterMessage *m);
void decode_on_prefill_result(td_worker *w, Tandem__Cluster__PrefillResult *pr);
void decode_on_arrival(td_worker *w, job *j);
void decode_on_done(td_worker *w, job *j, wev *e);
/* senders: push the job's out_blocks to targets; a push finished */
void w_push_all(td_worker *w, job *j, Tandem__Cluster__KvTarget **targets, size_t n_targets);
void sender_on_pushed(td_worker *w, job *j, bool ok, const char *error);

#endif
