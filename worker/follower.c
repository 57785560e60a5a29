/* A follower rank of a worker group (tandem-worker --rank R > 0): joins the
 * group through the router, loads its slice of the model and replays the
 * leader's calls in order from the mirror ('R': a model call, 'K': arrived
 * KV for its pools, 'S': stop, 'H': the leader is alive). Its loop is the
 * worker's shape (td_loop): the router and mirror sockets as file events,
 * heartbeats to the router, the leader's silence and the stop check as
 * timers. A watchdog thread aborts the communicator when the leader goes
 * silent, so that a collective it will never join cannot hang this rank. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/defaults.h"
#include "common/evloop.h"
#include "common/log.h"
#include "kvcache/kvcache.h"
#include "proto/link.h"
#include "worker/group.h"

typedef struct watchdog {
  td_comm *comm;
  atomic_llong last_ms;
  atomic_bool done;
  int dead_ms;
} watchdog;

static void *watch(void *arg) {
  watchdog *w = arg;
  while (!atomic_load(&w->done)) {
    usleep(TD_WORKER_STOP_CHECK_MS * 1000);
    if (td_now_ms() - atomic_load(&w->last_ms) > w->dead_ms) {
      TD_ERROR("the group leader is silent: aborting");
      if (w->comm) td_comm_abort(w->comm);
      return NULL;
    }
  }
  return NULL;
}

typedef struct follower {
  const td_worker_opts *o;
  volatile sig_atomic_t *stop;
  void *zctx, *rsock, *msock;
  td_zap *zap;   /* with keys: zctx's ZAP handler (the communicator's socket) */
  group_keys gk;
  td_comm_zmq_boot *boot;
  td_backend *b;
  td_comm *comm;
  td_model *m;
  td_kv_pool *self, *cross;
  group_info gi;
  watchdog wd;
  td_status s; /* why the loop stopped early */
  uint64_t hb_seq;
} follower;

/* A 'K' mirror message: [kind][n][ids][bytes of n blocks] (MIRROR_KV_*),
 * each block this rank's slice (with the states tail whole): its pool's
 * block size; or each block's states tail only, written at the block's end
 * (the projection that reads it follows as an 'R' call). */
static td_status write_mirrored_kv(follower *f, const uint8_t *p, size_t len) {
  if (len < 5) return td_err(TD_ERR_FORMAT, "mirror: short KV message");
  int kind = p[0];
  if (kind != MIRROR_KV_SELF && kind != MIRROR_KV_CROSS && kind != MIRROR_KV_STATES)
    return td_err(TD_ERR_FORMAT, "mirror: KV message of kind %d", kind);
  int32_t n;
  memcpy(&n, p + 1, 4);
  td_kv_pool *pool = kind == MIRROR_KV_SELF ? f->self : f->cross;
  size_t bb = td_kv_pool_block_bytes(pool), put = bb, at = 0;
  if (kind == MIRROR_KV_STATES) {
    td_kv_layout cl = td_model_cross_layout(f->m);
    put = (size_t)cl.block_size * (size_t)cl.states * td_buf_elem_size(f->b, TD_BUF_ACT);
    if (!put || cl.n_layers == 0) return td_err(TD_ERR_FORMAT, "mirror: encoder states for a pool without states and K/V");
    at = bb - put;
  }
  if (n < 0 || len != 5 + (size_t)n * 4 + (size_t)n * put)
    return td_err(TD_ERR_FORMAT, "mirror: KV message of %zu bytes", len);
  const uint8_t *data = p + 5 + (size_t)n * 4;
  for (int i = 0; i < n; i++) {
    int32_t id;
    memcpy(&id, p + 5 + (size_t)i * 4, 4);
    if (id < 0 || id >= td_kv_pool_get_stats(pool).n_blocks) return td_err(TD_ERR_FORMAT, "mirror: KV block %d", id);
    TD_TRY(td_copy_h2d(f->b, (uint8_t *)td_kv_pool_memory(pool) + (size_t)id * bb + at, data + (size_t)i * put, put));
  }
  return td_sync(f->b);
}

/* ------------------------------------------------------------ the loop */

static void stop_with(td_loop *l, follower *f, td_status s) {
  f->s = s;
  td_loop_stop(l);
}

/* One mirror message a turn: timers keep their turn between long replays. */
static void on_mirror(td_loop *l, void *ctx) {
  follower *f = ctx;
  zmq_msg_t msg;
  zmq_msg_init(&msg);
  if (zmq_msg_recv(&msg, f->msock, ZMQ_DONTWAIT) < 0) {
    zmq_msg_close(&msg);
    return;
  }
  atomic_store(&f->wd.last_ms, td_now_ms());
  const char *p = zmq_msg_data(&msg);
  size_t n = zmq_msg_size(&msg);
  char kind = n ? p[0] : 0;
  td_status s = TD_OK;
  if (kind == 'K') s = write_mirrored_kv(f, (const uint8_t *)p + 1, n - 1);
  if (kind == 'R') {
    s = td_model_replay(f->m, p + 1, n - 1);
    atomic_store(&f->wd.last_ms, td_now_ms());
  }
  zmq_msg_close(&msg);
  if (s != TD_OK) {
    stop_with(l, f, s);
  } else if (kind == 'S') {
    TD_INFO("the leader stopped the group");
    td_loop_stop(l);
  }
}

/* The router: only a group failure matters. */
static void on_router(td_loop *l, void *ctx) {
  follower *f = ctx;
  for (int k = 0; k < 16; k++) {
    td_wire_frame rf;
    if (td_wire_recv(f->rsock, false, false, &rf) != TD_OK) break;
    Tandem__Cluster__RouterMessage *rm;
    uint32_t ver;
    if (td_wire_unpack_router(&rf, &rm, &ver) == TD_OK) {
      if (rm->body_case == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO && !rm->group_info->ok) {
        TD_ERROR("the group failed: %s", rm->group_info->error ? rm->group_info->error : "?");
        *f->stop = SIGTERM;
      }
      tandem__cluster__router_message__free_unpacked(rm, NULL);
    }
    td_wire_frame_free(&rf);
  }
}

/* The router watches every rank; a silent one takes its group out. */
static int heartbeat_timer(td_loop *l, void *ctx) {
  follower *f = ctx;
  Tandem__Cluster__Heartbeat hb = TANDEM__CLUSTER__HEARTBEAT__INIT;
  hb.seq = ++f->hb_seq;
  Tandem__Cluster__WorkerMessage hm = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  hm.version = TD_PROTOCOL_VERSION;
  hm.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_HEARTBEAT;
  hm.heartbeat = &hb;
  (void)td_wire_send(f->rsock, NULL, 0, &hm.base);
  return TD_GROUP_HEARTBEAT_MS;
}

static int leader_timer(td_loop *l, void *ctx) {
  follower *f = ctx;
  if (td_now_ms() - atomic_load(&f->wd.last_ms) > f->wd.dead_ms)
    stop_with(l, f, td_err(TD_ERR_PEER, "group %s: the leader is gone", f->o->group));
  return TD_WORKER_STOP_CHECK_MS;
}

static int stop_timer(td_loop *l, void *ctx) {
  follower *f = ctx;
  if (*f->stop) td_loop_stop(l);
  return TD_WORKER_STOP_CHECK_MS;
}

static td_status run_loop(follower *f) {
  td_loop *l;
  TD_TRY(td_loop_create(TD_WORKER_STOP_CHECK_MS, &l));
  td_status s = td_loop_add_socket(l, f->rsock, on_router, f, NULL);
  if (s == TD_OK) s = td_loop_add_socket(l, f->msock, on_mirror, f, NULL);
  if (s == TD_OK) s = td_loop_add_timer(l, 0, heartbeat_timer, f, NULL);
  if (s == TD_OK) s = td_loop_add_timer(l, TD_WORKER_STOP_CHECK_MS, leader_timer, f, NULL);
  if (s == TD_OK) s = td_loop_add_timer(l, 0, stop_timer, f, NULL);
  if (s == TD_OK) s = td_loop_run(l);
  td_loop_destroy(l);
  return s != TD_OK ? s : f->s;
}

/* ------------------------------------------------------------ setup */

static td_status join(follower *f) {
  const td_worker_opts *o = f->o;
  int world = o->tp > 1 ? o->tp : o->pp;
  char id[256];
  snprintf(id, sizeof id, "%s-rank-%d", o->group, o->rank);
  if (td_link_path(o->router))
    return td_err(TD_ERR_UNSUPPORTED, "--router %s: a group's ranks reach the router over its endpoint, not a "
                  "local link", o->router);
  f->zctx = zmq_ctx_new();
  f->rsock = f->zctx ? zmq_socket(f->zctx, ZMQ_DEALER) : NULL;
  if (!f->rsock) return td_err(TD_ERR_NETWORK, "zmq: %s", zmq_strerror(zmq_errno()));
  td_wire_setup_socket(f->rsock);
  td_wire_set_unique_route(f->rsock, id);
  TD_TRY(td_auth_client(o->auth, f->rsock, NULL));
  if (zmq_connect(f->rsock, o->router) != 0)
    return td_err(TD_ERR_INVALID, "cannot connect to the router at %s", o->router);
  f->gk = (group_keys){.auth = o->auth, .gi = &f->gi};
  TD_TRY(td_zap_create(o->auth, f->zctx, &f->zap));
  f->gk.zap = f->zap;
  char ep[300] = "-";
  if (o->device == TD_BACKEND_CPU) TD_TRY(group_comm_bind(o, &f->gk, f->zctx, &f->boot, ep, sizeof ep));
  TD_TRY(group_rendezvous(f->rsock, o->group, o->rank, world, ep, NULL, 0, o->cross_mode, group_encoder_only(o),
                          o->tp > 1 && o->enc_rows, TD_GROUP_JOIN_TIMEOUT_MS, f->stop, &f->gi));
  TD_TRY(group_admit_ranks(&f->gk));
  td_backend_opts bo = {.kind = o->device, .device = o->device_id, .threads = o->threads, .cuda = o->settings.cuda};
  TD_TRY(td_backend_create(&bo, &f->b));
  char comm_ep[256], mirror_ep[256];
  group_split_leader(f->gi.endpoints[0], comm_ep, sizeof comm_ep, mirror_ep, sizeof mirror_ep);
  td_status s;
  if (o->device == TD_BACKEND_CPU) {
    const char *eps[TD_GROUP_MAX_RANKS];
    for (int r = 0; r < world; r++) eps[r] = r ? f->gi.endpoints[r] : comm_ep;
    s = td_comm_zmq_connect(f->boot, o->rank, world, eps, TD_GROUP_CONNECT_TIMEOUT_MS, &f->comm);
    f->boot = NULL;
  } else {
    s = f->gi.has_nccl_id ? td_comm_create_nccl(f->b, f->gi.nccl_id, o->rank, world, &f->comm)
                          : td_err(TD_ERR_INVALID, "group %s: no NCCL id from the leader", o->group);
  }
  TD_TRY(s);
  td_backend_set_comm(f->b, f->comm);
  td_model_opts mo = {.block_size = o->block_size, .max_seqs = o->max_batch, .max_tokens = o->max_tokens,
                      .max_enc_tokens = o->max_enc_tokens, .max_enc_seqs = o->max_enc_seqs,
                      .cross_mode = o->cross_mode, .states_rows = o->states_rows, .tuning = o->settings.model};
  if (o->tp > 1) {
    mo.tp_rank = o->rank;
    mo.tp_size = o->tp;
    mo.enc_rows = o->enc_rows;
  } else {
    mo.pp_rank = o->rank;
    mo.pp_size = o->pp;
    mo.pp_sets = o->pp_sets;
  }
  TD_TRY(td_model_load(o->model_dir, f->b, &mo, &f->m));
  td_engine_opts eo = {.self_blocks = o->self_blocks, .cross_blocks = o->cross_blocks, .max_running = o->max_batch};
  int nself, ncross;
  td_engine_default_blocks(f->m, &eo, &nself, &ncross);
  td_kv_layout sl = td_model_self_layout(f->m), cl = td_model_cross_layout(f->m);
  TD_TRY(td_kv_pool_create(f->b, &sl, nself, &f->self));
  TD_TRY(td_kv_pool_create(f->b, &cl, ncross, &f->cross));
  td_model_set_pools(f->m, td_kv_pool_memory(f->self), td_kv_pool_memory(f->cross));
  f->msock = zmq_socket(f->zctx, ZMQ_DEALER);
  if (!f->msock) return td_err(TD_ERR_NETWORK, "zmq: %s", zmq_strerror(zmq_errno()));
  char mid[32];
  snprintf(mid, sizeof mid, "f-%d", o->rank);
  int linger = 0, hwm = 0;
  zmq_setsockopt(f->msock, ZMQ_LINGER, &linger, sizeof linger);
  zmq_setsockopt(f->msock, ZMQ_RCVHWM, &hwm, sizeof hwm);
  /* no size limit: it connects out to its own leader only, whose mirrored
   * KV forwards are as large as a push's blocks */
  zmq_setsockopt(f->msock, ZMQ_ROUTING_ID, mid, strlen(mid));
  TD_TRY(group_sec_client(&f->gk, f->msock, 0)); /* the leader's key */
  if (zmq_connect(f->msock, mirror_ep) != 0)
    return td_err(TD_ERR_NETWORK, "cannot reach the leader's mirror at %s", mirror_ep);
  zmq_send(f->msock, "Y", 1, 0);
  TD_INFO("rank %d of group %s ready (%s)", o->rank, o->group, td_backend_name(f->b));
  return TD_OK;
}

td_status td_worker_follow(const td_worker_opts *o, volatile sig_atomic_t *stop) {
  static volatile sig_atomic_t never;
  int world = o->tp > 1 ? o->tp : o->pp;
  TD_TRY(group_check_addresses(o));
  if (!o->group || world < 2 || o->rank < 1 || o->rank >= world)
    return td_err(TD_ERR_INVALID, "a follower needs --group, --tp or --pp above 1 and a rank in [1, %d)", world);
  if (world > TD_GROUP_MAX_RANKS)
    return td_err(TD_ERR_INVALID, "a group of %d ranks: at most %d", world, TD_GROUP_MAX_RANKS);
  follower f = {.o = o, .stop = stop ? stop : &never, .wd = {.dead_ms = TD_GROUP_LEADER_DEAD_MS}};
  pthread_t wd_thread;
  bool wd_started = false;
  td_status s = join(&f);
  if (s == TD_OK) {
    f.wd.comm = f.comm;
    atomic_store(&f.wd.last_ms, td_now_ms());
    if (pthread_create(&wd_thread, NULL, watch, &f.wd) == 0) wd_started = true;
    s = run_loop(&f);
  }
  if (wd_started) {
    atomic_store(&f.wd.done, true);
    pthread_join(wd_thread, NULL);
  }
  if (s != TD_OK) TD_ERROR("follower rank %d: %s", o->rank, td_errmsg());
  if (f.msock) zmq_close(f.msock);
  if (f.rsock) zmq_close(f.rsock);
  td_kv_pool_destroy(f.self);
  td_kv_pool_destroy(f.cross);
  td_model_destroy(f.m);
  if (f.b) td_backend_set_comm(f.b, NULL);
  td_comm_destroy(f.comm);
  td_backend_destroy(f.b);
  td_comm_zmq_boot_free(f.boot);
  group_info_free(&f.gi);
  td_zap_destroy(f.zap); /* after the communicator's sockets, before the context ends */
  if (f.zctx) zmq_ctx_term(f.zctx);
  return s;
}
