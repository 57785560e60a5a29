/* A worker's life: defaults, creation (the router socket, a group
 * leader's rendezvous, the compute thread, the KV transports), the main
 * loop (td_loop: the router socket, the compute thread's eventfd and the
 * transports' descriptors as file events; heartbeats, registration retry,
 * the router's silence, reservation expiry and the stop / drain check as
 * timers; transports armed before sleeping and progressed after), and the
 * teardown in the order the pools' users require. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/net.h"
#include "worker/internal.h"

static bool has_self_kv(const td_worker_opts *o) {
  for (int i = 0; i < o->n_roles; i++)
    if (o->roles[i]->self_kv) return true;
  return false;
}

void td_worker_opts_default(td_worker_opts *o) {
  if (!o->block_size) o->block_size = TD_DEFAULT_BLOCK_SIZE;
  if (!o->max_batch) o->max_batch = o->device == TD_BACKEND_CUDA ? TD_DEFAULT_GPU_MAX_BATCH : TD_DEFAULT_WORKER_MAX_BATCH;
  if (o->max_tokens && o->max_tokens < o->max_batch) o->max_tokens = o->max_batch;
  if (!o->max_tokens && o->max_batch > TD_DEFAULT_WORKER_MAX_TOKENS) o->max_tokens = o->max_batch;
  if (o->gpu_memory_fraction <= 0) o->gpu_memory_fraction = TD_DEFAULT_GPU_MEMORY_FRACTION;
  if (!o->max_tokens) o->max_tokens = TD_DEFAULT_WORKER_MAX_TOKENS;
  bool gpu = o->device == TD_BACKEND_CUDA;
  if (!o->max_enc_tokens) o->max_enc_tokens = gpu ? TD_DEFAULT_GPU_MAX_ENC_TOKENS : TD_DEFAULT_MAX_ENC_TOKENS;
  if (!o->max_enc_seqs) o->max_enc_seqs = gpu ? TD_DEFAULT_GPU_MAX_ENC_SEQS : TD_DEFAULT_MAX_ENC_SEQS;
  if (!o->reservation_ttl_ms) o->reservation_ttl_ms = TD_DEFAULT_RESERVATION_TTL_MS;
  /* a worker whose roles keep no self KV (an encoder) only stages cross KV: its self pool can be token-sized */
  if (o->n_roles && !has_self_kv(o) && !o->self_blocks) o->self_blocks = TD_ENCODER_SELF_BLOCKS_PER_SEQ * o->max_batch;
  if (!o->transfer_timeout_ms) o->transfer_timeout_ms = TD_DEFAULT_TRANSFER_TIMEOUT_MS;
  if (!o->listen_host) o->listen_host = TD_DEFAULT_LISTEN_HOST;
  if (!o->transfer) o->transfer = "auto";
}

/* The roles: at most TD_WORKER_MAX_ROLES, each once, each with what the runtime calls. */
static td_status check_roles(td_worker *w) {
  const td_worker_opts *o = &w->o;
  if (o->n_roles < 1) return td_err(TD_ERR_INVALID, "a worker needs at least one role");
  if (o->n_roles > TD_WORKER_MAX_ROLES)
    return td_err(TD_ERR_INVALID, "%d roles: a worker serves at most %d", o->n_roles, TD_WORKER_MAX_ROLES);
  for (int i = 0; i < o->n_roles; i++) {
    const td_role *r = o->roles[i];
    if (!r || !r->name || !r->job || !r->on_job || !r->on_done || (r->hands_over && !r->on_pushed))
      return td_err(TD_ERR_INVALID, "role %d (%s) lacks a job message or a callback", i, r && r->name ? r->name : "?");
    for (int k = 0; k < i; k++)
      if (o->roles[k] == r || o->roles[k]->job == r->job)
        return td_err(TD_ERR_INVALID, "role %s given twice", r->name);
    w->roles[w->n_roles++] = r;
  }
  return TD_OK;
}

/* rank 0 of a TP / PP group: the mirror socket and the rendezvous. */
static td_status group_start(td_worker *w) {
  const td_worker_opts *o = &w->o;
  if (!strcmp(o->transfer, "ucx"))
    return td_err(TD_ERR_UNSUPPORTED, "--kv-transport ucx: a TP/PP group takes KV over ZeroMQ (its leader re-slices "
                  "whole-model blocks for the ranks)");
  for (int i = 0; i < w->n_roles; i++)
    if (!w->roles[i]->in_group && !w->roles[i]->group_self)
      return td_err(TD_ERR_UNSUPPORTED, "a worker group cannot serve the %s role (prefill workers are single-rank; "
                    "their KV is re-sliced for the group on arrival; a group encodes its own requests only)",
                    w->roles[i]->name);
  if (!o->group || o->rank != 0 || (o->tp > 1 && o->pp > 1))
    return td_err(TD_ERR_INVALID, "a group leader needs --group, rank 0 and either --tp or --pp");
  if (w->world > TD_GROUP_MAX_RANKS)
    return td_err(TD_ERR_INVALID, "a group of %d ranks: at most %d", w->world, TD_GROUP_MAX_RANKS);
  char comm_ep[300] = "-", ep[700];
  /* with keys the group's sockets are CURVE servers of the ranks' keys, known after the rendezvous */
  w->gk = (group_keys){.auth = o->auth, .gi = &w->gi};
  TD_TRY(td_zap_create(o->auth, w->zctx, &w->zap));
  w->gk.zap = w->zap;
  if (o->device == TD_BACKEND_CPU) {
    TD_TRY(group_comm_bind(o, &w->gk, w->zctx, &w->boot, comm_ep, sizeof comm_ep));
  } else {
    TD_TRY(td_comm_nccl_id(w->nccl_id));
  }
  w->msock = zmq_socket(w->zctx, ZMQ_ROUTER);
  char mep[300], bound[256], adv[300];
  snprintf(mep, sizeof mep, "tcp://%s:*", o->listen_host);
  int linger = 0, hwm = 0;
  if (w->msock) {
    zmq_setsockopt(w->msock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(w->msock, ZMQ_SNDHWM, &hwm, sizeof hwm);
    int64_t max = TD_GROUP_MIRROR_IN_MAX_BYTES; /* one-byte hellos and heartbeats, and CURVE's handshake */
    zmq_setsockopt(w->msock, ZMQ_MAXMSGSIZE, &max, sizeof max);
  }
  size_t bl = sizeof bound;
  if (w->msock) TD_TRY(group_sec_server(&w->gk, w->msock));
  if (!w->msock || zmq_bind(w->msock, mep) != 0 || zmq_getsockopt(w->msock, ZMQ_LAST_ENDPOINT, bound, &bl) != 0)
    return td_err(TD_ERR_NETWORK, "cannot bind the group mirror on %s", mep);
  TD_TRY(td_net_advertised(bound, o->advertise, adv, sizeof adv));
  snprintf(ep, sizeof ep, "%s|%s", comm_ep, adv);
  TD_INFO("group %s: communicator %s, mirror %s%s; waiting for %d ranks", o->group, comm_ep, adv,
          o->auth ? " (CURVE: the group's ranks only)" : "", w->world);
  bool cpu = o->device == TD_BACKEND_CPU;
  TD_TRY(group_rendezvous(w->rsock, o->group, 0, w->world, ep, cpu ? NULL : w->nccl_id, cpu ? 0 : TD_NCCL_ID_BYTES,
                          o->cross_mode, group_encoder_only(o), o->tp > 1 && o->enc_rows, TD_GROUP_JOIN_TIMEOUT_MS,
                          NULL, &w->gi));
  return group_admit_ranks(&w->gk);
}

static td_status create(td_worker *w) {
  td_worker_opts *o = &w->o;
  td_worker_opts_default(o);
  TD_TRY(check_roles(w));
  snprintf(w->id, sizeof w->id, "%s", o->id);
  /* peers reach the KV and group endpoints at the address advertised: one they can dial */
  TD_TRY(group_check_addresses(o));
  if (strcmp(o->transfer, "ucx") && strcmp(o->transfer, "zmq") && strcmp(o->transfer, "auto"))
    return td_err(TD_ERR_INVALID, "KV transport %s: auto, ucx or zmq", o->transfer);
  if (o->auth) {
    if (!strcmp(o->transfer, "ucx"))
      return td_err(TD_ERR_UNSUPPORTED, "--kv-transport ucx with CURVE keys: UCX has no CURVE, so KV goes over ZeroMQ "
                    "(--kv-transport zmq or auto)");
    o->transfer = "zmq"; /* auto: every push over CURVE */
    if ((o->tp > 1 || o->pp > 1) && o->device == TD_BACKEND_CUDA)
      TD_WARN("group %s: CURVE covers its mirror, not NCCL: the traffic between its GPUs is neither authenticated "
              "nor encrypted (keep its ranks on one host or a trusted network; docs/security.md)",
              o->group ? o->group : "?");
  }
  w->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (w->efd < 0) return td_err(TD_ERR_IO, "eventfd: %s", strerror(errno));
  if (o->spin_us < 0 || o->spin_us > TD_MAX_SPIN_US)
    return td_err(TD_ERR_INVALID, "spin_us %d is outside 0 to %d", o->spin_us, TD_MAX_SPIN_US);
  TD_TRY(td_loop_create(TD_WORKER_STOP_CHECK_MS, &w->loop));
  td_loop_set_spin(w->loop, o->spin_us);
  w->zctx = zmq_ctx_new();
  if (!w->zctx) return td_err(TD_ERR_NETWORK, "zmq: %s", zmq_strerror(zmq_errno()));
  w->world = o->tp > 1 ? o->tp : o->pp > 1 ? o->pp : 1;
  if (td_link_path(o->router)) {
    /* the local link: connected when the loop starts, and again after the router's end closes */
    if (o->auth) return td_err(TD_ERR_INVALID, "--router %s: a local link has no CURVE (not with keys)", o->router);
    if (w->world > 1)
      return td_err(TD_ERR_UNSUPPORTED, "--router %s: a group's ranks reach the router over its endpoint, not a "
                    "local link", o->router);
  } else {
    w->rsock = zmq_socket(w->zctx, ZMQ_DEALER);
    if (!w->rsock) return td_err(TD_ERR_NETWORK, "zmq: %s", zmq_strerror(zmq_errno()));
    td_wire_setup_socket(w->rsock);
    td_wire_set_unique_route(w->rsock, w->id);
    TD_TRY(td_auth_client(o->auth, w->rsock, NULL));
    if (zmq_connect(w->rsock, o->router) != 0)
      return td_err(TD_ERR_INVALID, "cannot connect to the router at %s: %s", o->router, zmq_strerror(zmq_errno()));
  }
  if (w->world > 1) TD_TRY(group_start(w));
  TD_TRY(w_compute_start(w));
  return w_kv_start(w);
}

td_status td_worker_create(const td_worker_opts *opts, td_worker **out) {
  *out = NULL;
  td_worker *w = calloc(1, sizeof *w);
  if (!w) return td_err(TD_ERR_NOMEM, "out of memory");
  w->o = *opts;
  w->hb_ms = TD_DEFAULT_HEARTBEAT_MS;
  w->dead_after = TD_DEFAULT_DEAD_AFTER;
  w->efd = -1;
  pthread_mutex_init(&w->mu, NULL);
  pthread_cond_init(&w->cv, NULL);
  td_status s = create(w);
  if (s != TD_OK) {
    td_worker_destroy(w);
    return s;
  }
  *out = w;
  return TD_OK;
}

/* ------------------------------------------------------------ the loop */

/* A stop (SIGTERM, the router's Drain, a failed group) starts the drain:
 * no new work, what runs finishes (or the deadline passes). */
static int stop_timer(td_loop *l, void *ctx) {
  td_worker *w = ctx;
  int64_t now = td_now_ms();
  if ((*w->stop || w->drain_asked) && !w->draining) {
    w->draining = true;
    w->drain_deadline = now + TD_DEFAULT_DRAIN_MS;
    TD_INFO("draining: finishing %u requests", HASH_COUNT(w->jobs));
    w_send_heartbeat(w);
  }
  if (w->draining && (HASH_COUNT(w->jobs) == 0 || now > w->drain_deadline)) td_loop_stop(l);
  return TD_WORKER_STOP_CHECK_MS;
}

static td_status loop_events(td_worker *w) {
  td_loop *l = w->loop;
  if (w->rsock) TD_TRY(td_loop_add_socket(l, w->rsock, w_on_router, w, NULL));
  if (w_link_up(w) != TD_OK) TD_WARN("%s: registering when it answers", td_errmsg());
  TD_TRY(td_loop_add_fd(l, w->efd, w_on_events, w, NULL));
  TD_TRY(td_loop_add_timer(l, TD_DEFAULT_REGISTER_RETRY_MS, w_register_timer, w, NULL));
  TD_TRY(w_router_timers(w, false));
  TD_TRY(td_loop_add_timer(l, TD_WORKER_EXPIRY_CHECK_MS, w_expiry_timer, w, NULL));
  TD_TRY(td_loop_add_timer(l, 0, stop_timer, w, NULL));
  td_loop_set_before_sleep(l, w_kv_arm, w);
  td_loop_set_after_sleep(l, w_kv_progress, w);
  return TD_OK;
}

td_status td_worker_run(td_worker *w, volatile sig_atomic_t *stop) {
  static volatile sig_atomic_t never;
  w->stop = stop ? stop : &never;
  char roles[128] = "";
  for (int i = 0; i < w->n_roles; i++)
    snprintf(roles + strlen(roles), sizeof roles - strlen(roles), "%s%s", i ? " " : "", w->roles[i]->name);
  size_t zl;
  const uint8_t *zd = td_kvt_desc(w->kvt[TD_KVT_ZMQ], &zl);
  TD_INFO("worker %s (%s) on %s, KV endpoint %.*s%s", w->id, roles, td_backend_name(w->b), (int)zl, (const char *)zd,
          w->kvt[TD_KVT_UCX] ? " and UCX" : "");
  TD_INFO("pools: %d self blocks (%.0f MiB), %d cross blocks (%.0f MiB); %d sequences a step", w->self_blocks,
          w->full_self_bb * (double)w->self_blocks / 1048576.0 / w->world, w->cross_blocks,
          w->full_cross_bb * (double)w->cross_blocks / 1048576.0 / w->world, w->max_running);
  TD_TRY(loop_events(w));
  w_send_register(w);
  w->last_router_msg = td_now_ms();
  td_status s = td_loop_run(w->loop);
  if (s != TD_OK) return s;
  if (w->refused[0]) return td_err(TD_ERR_INVALID, "the router refused this worker: %s", w->refused);
  if (w->removed) {
    /* the router already gave its requests to other workers and forgot it */
    w_cancel_all(w, "removed by the router");
    TD_INFO("worker %s removed by the router; stopped", w->id);
    return TD_OK;
  }
  if (HASH_COUNT(w->jobs)) w_cancel_all(w, "drain deadline passed");
  w_send_deregister(w, "drained");
  TD_INFO("worker %s stopped", w->id);
  return w->group_failed ? td_err(TD_ERR_PEER, "the worker group failed") : TD_OK;
}

void td_worker_destroy(td_worker *w) {
  if (!w) return;
  /* the transports first: they stop what still moves while the pools they
   * registered exist (the engine frees them below); their hooks touch no job now */
  w_kv_stop(w);
  while (w->deferred) {
    dres *d = w->deferred;
    w->deferred = d->next;
    free(d);
  }
  w_compute_stop(w);
  w_jobs_free(w);
  w_stream_free(w);
  if (w->rsock) zmq_close(w->rsock);
  w_link_close(w);
  td_zap_destroy(w->zap); /* after the group's sockets, before the context ends */
  if (w->zctx) zmq_ctx_term(w->zctx);
  td_loop_destroy(w->loop);
  group_info_free(&w->gi);
  if (w->efd >= 0) close(w->efd);
  pthread_mutex_destroy(&w->mu);
  pthread_cond_destroy(&w->cv);
  free(w);
}
