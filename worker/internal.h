/* The worker runtime's own structures, shared by its files and by no role
 * (roles see worker/role.h). Two threads meet here: the compute thread
 * (compute.c) owns the backend, model, engine and their pools; the main
 * thread (everything else) owns jobs, the router link and the transports.
 * They talk through two queues only: commands in (w_post), events out
 * (an eventfd the main loop watches). */
#ifndef TD_WORKER_INTERNAL_H
#define TD_WORKER_INTERNAL_H

#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include <uthash.h>

#include "common/defaults.h"
#include "common/evloop.h"
#include "common/vec.h"
#include "kvtransfer/transport.h"
#include "proto/link.h"
#include "worker/group.h"
#include "worker/role.h"

/* ---- main thread -> compute thread ---- */
typedef enum cmd_kind {
  CMD_RESERVE,        /* reserve cross (n_cross) and self (n_self) blocks */
  CMD_RELEASE_RES,    /* give back reservations */
  CMD_ADD,            /* a request for the engine */
  CMD_CANCEL,         /* end the requests of rid (slot, or every slot when -1) */
  CMD_RELEASE_BLOCKS, /* blocks handed over earlier */
  CMD_WRITE_KV,       /* arrived KV bytes (whole-model blocks) into the pools */
} cmd_kind;

/* A cross push's form: every layer's K/V (whole blocks), or the encoder
 * states only (blocks' states tails), projected here on arrival. */
enum { KV_FORM_KV = 1, KV_FORM_STATES = 2 };

typedef struct cmd {
  cmd_kind kind;
  uint64_t rid;
  int slot;            /* the job's role: its index in the worker's roles */
  const td_role *role; /* CMD_ADD */
  int n_cross, n_self; /* CMD_RESERVE; CMD_ADD: the reservations' sizes */
  uint64_t cross_res, self_res;
  bool cross;       /* CMD_RELEASE_BLOCKS, CMD_WRITE_KV: which pool */
  int32_t *blocks;  /* CMD_RELEASE_BLOCKS, CMD_WRITE_KV (owned) */
  int n_blocks;
  uint8_t *data;    /* CMD_WRITE_KV: n_blocks whole-model blocks (owned) */
  bool host_copy;   /* CMD_ADD: hand over the blocks' bytes in host memory too */
  int64_t t_recv_ns; /* CMD_ADD: td_now_ns at the job message's receipt */
  bool states_only; /* CMD_WRITE_KV: cross blocks' states tails only (a states push) */
  /* CMD_ADD: the cross KV arrived as encoder states, to be projected into
   * every layer's K/V (td_model_project_cross) before the engine takes it */
  bool project_cross;
  int32_t *proj_blocks; /* owned: the reservation's cross blocks, in order */
  bool proj_failed;
  char proj_error[160];
  /* CMD_ADD */
  td_request req;
  char *id;              /* req.id points here */
  int32_t *owned_i32[4]; /* arrays the request points into */
  float *owned_f32;
  struct cmd *next;
} cmd;

/* ---- compute thread -> main thread ---- */
typedef enum ev_kind { EV_RESERVED, EV_TOKEN, EV_DONE } ev_kind;

typedef struct wev {
  ev_kind kind;
  uint64_t rid;
  int slot;
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
  bool blocks_cross;
  uint8_t *host;   /* their bytes, copied to host memory */
  size_t block_bytes;
  double ms;
  double first_ms; /* EV_DONE: the job message's receipt to the first token (0: none) */
  struct wev *next;
} wev;

/* ---- a request's part on this worker for one role (main thread) ---- */
typedef struct job_key {
  uint64_t rid;
  uint64_t slot;
} job_key;

struct td_job {
  job_key key;
  uint64_t rid;
  int slot;
  const td_role *role;
  Tandem__Cluster__RouterMessage *msg; /* owns the request spec */
  const Tandem__Cluster__RequestSpec *spec;
  bool reserved;
  uint64_t cross_res, self_res;
  int32_t *cross_ids, *self_ids;
  int n_cross, n_self;
  int cross_got, self_got;   /* blocks arrived, each counted once */
  int cross_form;            /* what the cross pushes carried: 0 none yet, KV_FORM_KV or KV_FORM_STATES */
  uint8_t *cross_in, *self_in; /* which reserved blocks arrived, by index in cross_ids / self_ids */
  int self_expected;         /* prompt tokens whose KV comes; 0: none */
  /* who may push into the reservations: the router's KvSenders (in msg); NULL: nobody */
  const Tandem__Cluster__KvSender *cross_from, *self_from;
  bool added;                /* handed to the engine */
  bool finished;             /* ... and its result came back */
  int64_t expires;           /* reservation deadline (ms) */
  /* handed-over blocks to push, and their bytes when a transport copies */
  int32_t *out_blocks;
  int n_out;
  bool out_cross;
  uint8_t *out_host;
  size_t out_bb;
  int pushes_pending;
  int64_t push_start_ns; /* td_job_push: a push's time is from here to its answer */
  bool push_failed;
  char push_error[256];
  double compute_ms;
  int64_t t_recv_ns;         /* td_now_ns when its job message came */
  UT_hash_handle hh;
};

/* compute-side record of a request the engine runs */
typedef struct creq {
  uint64_t rid;
  int slot;
  const td_role *role;
  uint64_t handle;
  int64_t t_start_ns; /* td_now_ns at the job's start */
  int64_t t_recv_ns;  /* ... at its job message's receipt (main thread) */
  double first_ms;    /* receipt to the first token; 0: none yet */
  bool host_copy;
  UT_hash_handle hh;
} creq;

/* Reservations of ended jobs that a granted transfer still writes: given
 * back once it is over. */
typedef struct dres {
  uint64_t rid;
  int slot;
  uint64_t cross_res, self_res;
  struct dres *next;
} dres;

typedef struct kvlog kvlog;
typedef struct tokcount tokcount;

typedef struct load_snap {
  int queued, running, free_self, free_cross;
  int64_t encoded; /* requests encoded */
  int64_t cache_hits; /* encoder cache */
  int cache_blocks;
  int64_t steps, tokens, encode_runs; /* engine counters */
  double busy_s, idle_s; /* wall time inside td_engine_step; waiting with no work */
  double project_s;      /* projecting arrived encoder states (between steps) */
  int64_t began_ms, ended_ms; /* wall clock: its engine last went from no work to work, and ran out of it */
} load_snap;

struct td_worker {
  td_worker_opts o;
  char id[TD_WIRE_MAX_ID + 1];
  const td_role *roles[TD_WORKER_MAX_ROLES];
  int n_roles;
  void *zctx, *rsock; /* rsock: the router's endpoint (NULL over a local link) */
  td_link *rlink;      /* the router over its local link (--router local:PATH), once connected */
  int rlink_ev;
  /* ---- compute thread (compute.c) ---- */
  pthread_t thread;
  bool thread_started;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  cmd *cmd_head, *cmd_tail;
  wev *ev_head, *ev_tail;
  wev *pend_head, *pend_tail; /* the compute thread's, not yet handed over (ev_flush) */
  bool cmd_unsignalled;       /* main thread: commands posted since the compute thread was woken */
  int efd;
  bool stop_compute;
  bool ready;
  td_status init_status;
  char init_error[512];
  load_snap load; /* under mu */
  int64_t project_ns; /* the compute thread's: projecting arrived encoder states */
  bool idle_news; /* under mu: the engine went idle; the loop sends its load now */
  td_backend *b;
  td_model *m;
  td_engine *e;
  creq *creqs;
  void *msock; /* group mirror to the followers: the compute thread's once it runs */
  td_comm *comm;
  td_comm_zmq_boot *boot;
  uint8_t nccl_id[TD_NCCL_ID_BYTES];
  int64_t last_mirror_hb;
  /* model facts, set by the compute thread before `ready` */
  td_model_config cfg;
  int max_src, max_tgt, frames, block_size, self_blocks, cross_blocks, max_running;
  int32_t start_token; /* the decoder's first token without a prompt */
  /* whole-model KV blocks, what peers push (cross: with the states tail per --cross-mode) */
  td_kv_layout full_self, full_cross;
  /* a cross block's states tail in bytes where states pushes can be taken
   * (cross mode dual: td_model_project_cross, mirrored on a group's ranks), else 0 */
  size_t states_bb;
  bool states_out; /* an encoder-only worker whose cross mode auto became states: it pushes states */
  size_t full_self_bb, full_cross_bb;
  td_kvt_opts pools; /* the engine's pools for the transports that read them */
  /* ---- main thread ---- */
  td_loop *loop;
  int hb_timer, silence_timer;
  volatile sig_atomic_t *stop;
  td_kvt *kvt[TD_KVT_KINDS]; /* by kind; NULL: not here */
  uint8_t *desc; /* TransferDesc: every way to push here */
  size_t desc_len;
  dres *deferred;
  kvlog *kvlogs;
  uint64_t kv_in[TD_KVT_KINDS], kv_out[TD_KVT_KINDS];             /* blocks */
  uint64_t kv_in_bytes[TD_KVT_KINDS], kv_out_bytes[TD_KVT_KINDS]; /* ... and their bytes */
  double kv_out_seconds[TD_KVT_KINDS]; /* pushes' time, from the push to the receiver's answer */
  uint64_t kv_refused;                 /* pushes into this worker refused (kv_io.c) */
  td_job *jobs;
  tokcount *tokcounts; /* stream.c */
  struct {             /* a turn's tokens, sent as one message (stream.c) */
    struct tok_run {   /* consecutive tokens of one sequence: tok / lp [at, at + n) */
      uint64_t rid;
      int seq, at, n;
    } *runs;
    int n_runs, cap_runs;
    td_i32vec tok;
    td_f32vec lp;
  } out;
  bool registered;
  int64_t id_wait_since; /* when the router first said this id is in use (0: never) */
  int hb_ms, dead_after;
  int64_t last_router_msg, last_register;
  uint64_t hb_seq;
  bool draining;
  bool drain_asked;   /* the router's Drain (an operator's): an Undrain takes it back unless *stop is set too */
  bool removed;       /* the router's Remove: it forgot this worker; leave now, saying nothing more */
  int64_t drain_deadline;
  /* rank 0 of a tensor / pipeline parallel group */
  int world;
  group_info gi;
  td_zap *zap;    /* with keys: zctx's ZAP handler, for the group's mirror and communicator */
  group_keys gk;  /* their CURVE (worker/group.h) */
  bool group_failed;
  char refused[512]; /* the router refused this worker: why */
};

/* compute.c: the compute thread and the two queues */
td_status w_compute_start(td_worker *w);
void w_compute_stop(td_worker *w);
cmd *w_cmd(cmd_kind kind, uint64_t rid, int slot);
void w_post(td_worker *w, cmd *c);
void cmd_free(cmd *c);
/* Wakes the compute thread for the commands posted since it was last woken
 * (the main loop calls it before sleeping). */
void w_wake_compute(td_worker *w);
wev *w_events_take(td_worker *w);
void ev_free(wev *e);
load_snap w_load(td_worker *w);

/* leader.c: a group leader's side, on the compute thread */
td_status w_leader_init(td_worker *w, td_model_opts *mo);
td_status w_leader_wait_followers(td_worker *w);
void w_mirror_all(td_worker *w, const char *what);
int w_mirror_tick(td_worker *w);
void w_mirror_send(td_worker *w, int rank, const void *msg, size_t len);

/* jobs.c: jobs, reservations, cancels, expiry, compute events */
td_job *w_job_find(td_worker *w, uint64_t rid, int slot);
/* the job whose reservation res of pool `cross` is, for request rid */
td_job *w_job_by_reservation(td_worker *w, uint64_t rid, uint64_t res, bool cross);
void w_job_drop(td_worker *w, td_job *j);
void w_release_out_blocks(td_worker *w, td_job *j);
void w_release_deferred(td_worker *w);
bool w_res_busy(td_worker *w, uint64_t cross_res, uint64_t self_res);
void w_cancel_rid(td_worker *w, uint64_t rid);
void w_cancel_all(td_worker *w, const char *why);
int w_expiry_timer(td_loop *l, void *ctx);
void w_on_events(td_loop *l, void *ctx);
void w_jobs_free(td_worker *w);
int w_role_slot(const td_worker *w, const td_role *r);

/* router_link.c */
void w_send_register(td_worker *w);
void w_send_heartbeat(td_worker *w);
void w_send_reserved(td_worker *w, td_job *j);
void w_send_deregister(td_worker *w, const char *reason);
void w_on_router(td_loop *l, void *ctx);
/* Connects the router's local link when --router names one and it is down. */
td_status w_link_up(td_worker *w);
void w_link_close(td_worker *w);
int w_register_timer(td_loop *l, void *ctx);
td_status w_router_timers(td_worker *w, bool first);

/* stream.c: tokens to the router, with their offset per sequence */
void w_stream_token(td_worker *w, uint64_t rid, int seq, int32_t token, float logprob);
void w_stream_flush(td_worker *w);
void w_stream_forget(td_worker *w, uint64_t rid);
void w_stream_free(td_worker *w);

/* kv_route.c: which transport reaches a target */
typedef struct kv_route {
  td_kvt *t;               /* NULL: no way (why says) */
  const uint8_t *desc;     /* the target's descriptor for t */
  size_t desc_len;
  char why[512];           /* ZeroMQ: why not UCX; none: why not at all */
  Tandem__Cluster__TransferDesc *d; /* the target's descriptor, unpacked */
} kv_route;
void w_kv_route(td_worker *w, const Tandem__Cluster__KvTarget *t, bool cross, kv_route *r);
void w_kv_route_free(kv_route *r);
bool w_kv_host_copy(td_worker *w, Tandem__Cluster__KvTarget *const *targets, size_t n, bool cross);
td_status w_kv_start(td_worker *w);
void w_kv_stop(td_worker *w);

/* kv_io.c: the transports' hooks, pushes of handed-over blocks */
td_kvt_hooks w_kv_hooks(td_worker *w);
void w_kv_forget(td_worker *w, td_job *j);
bool w_kv_arm(td_loop *l, void *ctx);
void w_kv_progress(td_loop *l, void *ctx);
int w_kv_pushing(td_worker *w);

#endif
