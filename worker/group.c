/* Worker groups (tensor / pipeline parallel): the rendezvous through the
 * router, the mirror channel between the leader and its followers, and the
 * follower process loop. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "kvcache/kvcache.h"
#include "worker/group.h"

void group_info_free(group_info *g) {
  for (int i = 0; i < g->world; i++) free(g->endpoints[i]);
  memset(g, 0, sizeof *g);
}

td_status group_rendezvous(void *rsock, const char *group, int rank, int world, const char *endpoint,
                           const uint8_t *nccl_id, size_t nccl_len, td_cross_mode cross_mode, int timeout_ms,
                           volatile sig_atomic_t *stop, group_info *out) {
  memset(out, 0, sizeof *out);
  Tandem__Cluster__GroupJoin j = TANDEM__CLUSTER__GROUP_JOIN__INIT;
  j.group = (char *)group;
  j.rank = (uint32_t)rank;
  j.world = (uint32_t)world;
  j.endpoint = (char *)endpoint;
  j.nccl_id.data = (uint8_t *)nccl_id;
  j.nccl_id.len = nccl_len;
  j.cross_mode = (char *)td_cross_mode_name(cross_mode);
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.version = TD_PROTOCOL_VERSION;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_GROUP_JOIN;
  m.group_join = &j;
  TD_TRY(td_wire_send(rsock, NULL, 0, &m.base));
  int64_t end = td_now_ms() + timeout_ms, resend = td_now_ms() + 2000;
  while (!(stop && *stop)) {
    if (td_now_ms() > end)
      return td_err(TD_ERR_TIMEOUT, "group %s: the other ranks did not join within %d ms", group, timeout_ms);
    zmq_pollitem_t it = {.socket = rsock, .events = ZMQ_POLLIN};
    if (zmq_poll(&it, 1, 100) <= 0) {
      /* the router may have started after us: ask again */
      if (td_now_ms() > resend) {
        (void)td_wire_send(rsock, NULL, 0, &m.base);
        resend = td_now_ms() + 2000;
      }
      continue;
    }
    td_wire_frame f;
    if (td_wire_recv(rsock, false, false, &f) != TD_OK) continue;
    Tandem__Cluster__RouterMessage *rm;
    uint32_t ver;
    td_status s = td_wire_unpack_router(&f, &rm, &ver);
    td_wire_frame_free(&f);
    if (s != TD_OK) continue;
    if (rm->body_case != TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO) {
      tandem__cluster__router_message__free_unpacked(rm, NULL);
      continue;
    }
    Tandem__Cluster__GroupInfo *gi = rm->group_info;
    if (!gi->ok || (int)gi->world != world || gi->n_endpoints != (size_t)world) {
      s = td_err(TD_ERR_INVALID, "group %s: the router refused the join: %s", group, gi->error ? gi->error : "?");
      tandem__cluster__router_message__free_unpacked(rm, NULL);
      return s;
    }
    out->world = world;
    for (int r = 0; r < world; r++) out->endpoints[r] = strdup(gi->endpoints[r]);
    if (gi->nccl_id.len == TD_NCCL_ID_BYTES) {
      memcpy(out->nccl_id, gi->nccl_id.data, TD_NCCL_ID_BYTES);
      out->has_nccl_id = true;
    }
    tandem__cluster__router_message__free_unpacked(rm, NULL);
    return TD_OK;
  }
  return td_err(TD_ERR_CANCELLED, "group %s: stopped while joining", group);
}

/* rank 0's endpoint is "COMM|MIRROR" */
void group_split_leader(const char *ep, char *comm, size_t ccap, char *mirror, size_t mcap) {
  const char *bar = strchr(ep, '|');
  size_t n = bar ? (size_t)(bar - ep) : strlen(ep);
  snprintf(comm, ccap, "%.*s", (int)n, ep);
  snprintf(mirror, mcap, "%s", bar ? bar + 1 : "");
}

void group_slice_block(const uint8_t *full, uint8_t *dst, const td_kv_layout *fl, size_t es, int l0, int l1, int h0,
                       int h1) {
  size_t slot_bytes = (size_t)fl->block_size * fl->head_dim * es, run = (size_t)(h1 - h0) * slot_bytes;
  for (int l = l0; l < l1; l++)
    for (int kv = 0; kv < 2; kv++) {
      memcpy(dst, full + (((size_t)l * 2 + kv) * fl->n_heads + h0) * slot_bytes, run);
      dst += run;
    }
  size_t tail = (size_t)fl->block_size * fl->states * es; /* the states, whole */
  memcpy(dst, full + td_kv_block_elems(fl) * es - tail, tail);
}

void group_rank_range(int r, int tp, int pp, int L, int H, int *l0, int *l1, int *h0, int *h1) {
  *l0 = 0, *l1 = L, *h0 = 0, *h1 = H;
  if (tp > 1) {
    *h0 = H * r / tp;
    *h1 = H * (r + 1) / tp;
  } else if (pp > 1) {
    *l0 = L * r / pp;
    *l1 = L * (r + 1) / pp;
  }
}

/* A 'K' mirror message: [cross][n][ids][bytes of n blocks], each block this
 * rank's slice (with the states tail whole): its pool's block size. */
static td_status write_mirrored_kv(td_backend *b, td_kv_pool *self, td_kv_pool *cross, const uint8_t *p, size_t len) {
  if (len < 5) return td_err(TD_ERR_FORMAT, "mirror: short KV message");
  bool is_cross = p[0] != 0;
  int32_t n;
  memcpy(&n, p + 1, 4);
  td_kv_pool *pool = is_cross ? cross : self;
  size_t bb = td_kv_pool_block_bytes(pool);
  if (n < 0 || len != 5 + (size_t)n * 4 + (size_t)n * bb) return td_err(TD_ERR_FORMAT, "mirror: KV message of %zu bytes", len);
  const uint8_t *data = p + 5 + (size_t)n * 4;
  for (int i = 0; i < n; i++) {
    int32_t id;
    memcpy(&id, p + 5 + (size_t)i * 4, 4);
    if (id < 0 || id >= td_kv_pool_get_stats(pool).n_blocks) return td_err(TD_ERR_FORMAT, "mirror: KV block %d", id);
    TD_TRY(td_copy_h2d(b, (uint8_t *)td_kv_pool_memory(pool) + (size_t)id * bb, data + (size_t)i * bb, bb));
  }
  return td_sync(b);
}

/* ------------------------------------------------------------ follower */

typedef struct watchdog {
  td_comm *comm;
  atomic_llong last_ms;
  atomic_bool done;
  int dead_ms;
} watchdog;

/* Aborts the communicator when the leader goes silent, so that a
 * collective it will never join cannot hang this rank. */
static void *watch(void *arg) {
  watchdog *w = arg;
  while (!atomic_load(&w->done)) {
    usleep(100000);
    if (td_now_ms() - atomic_load(&w->last_ms) > w->dead_ms) {
      TD_ERROR("the group leader is silent: aborting");
      if (w->comm) td_comm_abort(w->comm);
      return NULL;
    }
  }
  return NULL;
}

td_status td_worker_follow(const td_worker_opts *o, volatile sig_atomic_t *stop) {
  int world = o->tp > 1 ? o->tp : o->pp;
  if (!o->group || world < 2 || o->rank < 1 || o->rank >= world)
    return td_err(TD_ERR_INVALID, "a follower needs --group, --tp or --pp above 1 and a rank in [1, %d)", world);
  char id[256];
  snprintf(id, sizeof id, "%s-rank-%d", o->group, o->rank);
  td_status s = TD_OK;
  void *zctx = zmq_ctx_new(), *rsock = NULL, *msock = NULL;
  td_comm_zmq_boot *boot = NULL;
  td_backend *b = NULL;
  td_comm *comm = NULL;
  td_model *m = NULL;
  td_kv_pool *self = NULL, *cross = NULL;
  group_info gi = {0};
  pthread_t wd_thread;
  bool wd_started = false;
  watchdog wd = {.dead_ms = 5000};
  rsock = zctx ? zmq_socket(zctx, ZMQ_DEALER) : NULL;
  if (!rsock) {
    s = td_err(TD_ERR_NETWORK, "zmq: %s", zmq_strerror(zmq_errno()));
    goto out;
  }
  td_wire_setup_socket(rsock);
  zmq_setsockopt(rsock, ZMQ_ROUTING_ID, id, strlen(id));
  if (zmq_connect(rsock, o->router) != 0) {
    s = td_err(TD_ERR_INVALID, "cannot connect to the router at %s", o->router);
    goto out;
  }
  const char *ep = "-";
  if (o->device == TD_BACKEND_CPU) {
    if ((s = td_comm_zmq_bind(o->listen_host, &boot)) != TD_OK) goto out;
    ep = td_comm_zmq_endpoint(boot);
  }
  if ((s = group_rendezvous(rsock, o->group, o->rank, world, ep, NULL, 0, o->cross_mode, 120000, stop, &gi)) != TD_OK)
    goto out;
  td_backend_opts bo = {.kind = o->device, .device = o->device_id, .threads = o->threads,
                        .cuda = o->settings.cuda};
  if ((s = td_backend_create(&bo, &b)) != TD_OK) goto out;
  char comm_ep[256], mirror_ep[256];
  group_split_leader(gi.endpoints[0], comm_ep, sizeof comm_ep, mirror_ep, sizeof mirror_ep);
  if (o->device == TD_BACKEND_CPU) {
    const char *eps[16];
    for (int r = 0; r < world; r++) eps[r] = r ? gi.endpoints[r] : comm_ep;
    s = td_comm_zmq_connect(boot, o->rank, world, eps, 30000, &comm);
    boot = NULL;
  } else {
    s = gi.has_nccl_id ? td_comm_create_nccl(b, gi.nccl_id, o->rank, world, &comm)
                       : td_err(TD_ERR_INVALID, "group %s: no NCCL id from the leader", o->group);
  }
  if (s != TD_OK) goto out;
  td_backend_set_comm(b, comm);
  td_model_opts mo = {.block_size = o->block_size, .max_seqs = o->max_batch, .max_tokens = o->max_tokens,
                      .max_enc_tokens = o->max_enc_tokens, .max_enc_seqs = 16, .cross_mode = o->cross_mode,
                      .states_rows = o->states_rows, .tuning = o->settings.model};
  if (o->tp > 1) {
    mo.tp_rank = o->rank;
    mo.tp_size = o->tp;
  } else {
    mo.pp_rank = o->rank;
    mo.pp_size = o->pp;
  }
  if ((s = td_model_load(o->model_dir, b, &mo, &m)) != TD_OK) goto out;
  td_engine_opts eo = {.self_blocks = o->self_blocks, .cross_blocks = o->cross_blocks, .max_running = o->max_batch};
  int nself, ncross;
  td_engine_default_blocks(m, &eo, &nself, &ncross);
  td_kv_layout sl = td_model_self_layout(m), cl = td_model_cross_layout(m);
  if ((s = td_kv_pool_create(b, &sl, nself, &self)) != TD_OK || (s = td_kv_pool_create(b, &cl, ncross, &cross)) != TD_OK)
    goto out;
  td_model_set_pools(m, td_kv_pool_memory(self), td_kv_pool_memory(cross));
  msock = zmq_socket(zctx, ZMQ_DEALER);
  char mid[32];
  snprintf(mid, sizeof mid, "f-%d", o->rank);
  int linger = 0, hwm = 0;
  zmq_setsockopt(msock, ZMQ_LINGER, &linger, sizeof linger);
  zmq_setsockopt(msock, ZMQ_RCVHWM, &hwm, sizeof hwm);
  zmq_setsockopt(msock, ZMQ_ROUTING_ID, mid, strlen(mid));
  if (zmq_connect(msock, mirror_ep) != 0) {
    s = td_err(TD_ERR_NETWORK, "cannot reach the leader's mirror at %s", mirror_ep);
    goto out;
  }
  zmq_send(msock, "Y", 1, 0);
  TD_INFO("rank %d of group %s ready (%s)", o->rank, o->group, td_backend_name(b));
  wd.comm = comm;
  atomic_store(&wd.last_ms, td_now_ms());
  if (pthread_create(&wd_thread, NULL, watch, &wd) == 0) wd_started = true;
  int64_t last_hb = 0;
  Tandem__Cluster__Heartbeat hb = TANDEM__CLUSTER__HEARTBEAT__INIT;
  Tandem__Cluster__WorkerMessage hm = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  hm.version = TD_PROTOCOL_VERSION;
  hm.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_HEARTBEAT;
  hm.heartbeat = &hb;
  for (;;) {
    if (stop && *stop) break;
    if (td_now_ms() - last_hb > 200) {
      /* the router watches every rank; a silent one takes its group out */
      hb.seq++;
      (void)td_wire_send(rsock, NULL, 0, &hm.base);
      last_hb = td_now_ms();
    }
    for (int k = 0; k < 16; k++) { /* the router: only a group failure matters */
      td_wire_frame rf;
      if (td_wire_recv(rsock, false, false, &rf) != TD_OK) break;
      Tandem__Cluster__RouterMessage *rm;
      uint32_t ver;
      if (td_wire_unpack_router(&rf, &rm, &ver) == TD_OK) {
        if (rm->body_case == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO && !rm->group_info->ok) {
          TD_ERROR("the group failed: %s", rm->group_info->error ? rm->group_info->error : "?");
          if (stop) *stop = SIGTERM;
        }
        tandem__cluster__router_message__free_unpacked(rm, NULL);
      }
      td_wire_frame_free(&rf);
    }
    zmq_pollitem_t it = {.socket = msock, .events = ZMQ_POLLIN};
    if (zmq_poll(&it, 1, 100) <= 0) {
      if (td_now_ms() - atomic_load(&wd.last_ms) > wd.dead_ms) {
        s = td_err(TD_ERR_PEER, "group %s: the leader is gone", o->group);
        break;
      }
      continue;
    }
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    if (zmq_msg_recv(&msg, msock, 0) < 0) {
      zmq_msg_close(&msg);
      continue;
    }
    atomic_store(&wd.last_ms, td_now_ms());
    const char *p = zmq_msg_data(&msg);
    size_t n = zmq_msg_size(&msg);
    char kind = n ? p[0] : 0;
    if (kind == 'K') {
      s = write_mirrored_kv(b, self, cross, (const uint8_t *)p + 1, n - 1);
      if (s != TD_OK) {
        zmq_msg_close(&msg);
        break;
      }
    }
    if (kind == 'R') {
      s = td_model_replay(m, p + 1, n - 1);
      atomic_store(&wd.last_ms, td_now_ms());
      if (s != TD_OK) {
        zmq_msg_close(&msg);
        break;
      }
    }
    zmq_msg_close(&msg);
    if (kind == 'S') {
      TD_INFO("the leader stopped the group");
      break;
    }
  }
out:
  if (wd_started) {
    atomic_store(&wd.done, true);
    pthread_join(wd_thread, NULL);
  }
  if (s != TD_OK) TD_ERROR("follower rank %d: %s", o->rank, td_errmsg());
  if (msock) zmq_close(msock);
  if (rsock) zmq_close(rsock);
  td_kv_pool_destroy(self);
  td_kv_pool_destroy(cross);
  td_model_destroy(m);
  if (b) td_backend_set_comm(b, NULL);
  td_comm_destroy(comm);
  td_backend_destroy(b);
  td_comm_zmq_boot_free(boot);
  group_info_free(&gi);
  if (zctx) zmq_ctx_term(zctx);
  return s;
}
