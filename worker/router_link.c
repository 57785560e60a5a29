/* The link to the router, on the main thread: registration (and its
 * retry), heartbeats at the period the router's ack names, the router's
 * silence, and its messages: jobs go to the role whose table takes them,
 * cancels, drains and shutdowns to the runtime. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "proto/check.h"
#include "worker/internal.h"

/* messages read from the router a turn, so that timers and transfers keep their turn */
#define ROUTER_BURST 1024

static void link_writable(td_loop *l, void *ctx) {
  td_worker *w = ctx;
  if (w->rlink) (void)td_link_flush(w->rlink); /* a broken link is its reader's to close */
  if (!w->rlink || !td_link_wants_write(w->rlink)) td_loop_set_writable(l, w->rlink_ev, NULL);
}

void td_worker_send(td_worker *w, Tandem__Cluster__WorkerMessage *m) {
  m->version = TD_PROTOCOL_VERSION;
  if (!w->rsock) { /* the local link: until it is up (re)connected, as a ZeroMQ peer's, nothing goes */
    if (!w->rlink) {
      TD_DEBUG("send to router: its local link is down");
      return;
    }
    if (td_link_send(w->rlink, &m->base, NULL) != TD_OK) TD_WARN("send to router: %s", td_errmsg());
    if (td_link_wants_write(w->rlink)) td_loop_set_writable(w->loop, w->rlink_ev, link_writable);
    return;
  }
  if (td_wire_send(w->rsock, NULL, 0, &m->base) != TD_OK) TD_WARN("send to router: %s", td_errmsg());
}

void td_worker_send_failed(td_worker *w, uint64_t rid, td_status code, const char *msg, bool retryable) {
  Tandem__Cluster__Failed f = TANDEM__CLUSTER__FAILED__INIT;
  f.rid = rid;
  f.code = td_wire_error_code(code);
  f.message = (char *)msg;
  f.retryable = retryable;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED;
  m.failed = &f;
  td_worker_send(w, &m);
}

void w_send_reserved(td_worker *w, td_job *j) {
  Tandem__Cluster__KvTarget cross = TANDEM__CLUSTER__KV_TARGET__INIT, self = TANDEM__CLUSTER__KV_TARGET__INIT;
  cross.worker_id = self.worker_id = w->id;
  cross.desc.data = self.desc.data = w->desc;
  cross.desc.len = self.desc.len = w->desc_len;
  cross.reservation = j->cross_res;
  cross.blocks = j->cross_ids;
  cross.n_blocks = (size_t)j->n_cross;
  cross.tokens = j->spec->enc_len;
  self.reservation = j->self_res;
  self.blocks = j->self_ids;
  self.n_blocks = (size_t)j->n_self;
  self.tokens = (uint32_t)j->self_expected;
  Tandem__Cluster__Reserved r = TANDEM__CLUSTER__RESERVED__INIT;
  r.rid = j->rid;
  r.cross = &cross;
  if (j->n_self) r.self = &self;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED;
  m.reserved = &r;
  td_worker_send(w, &m);
}

void w_send_register(td_worker *w) {
  Tandem__ModelInfo mi = TANDEM__MODEL_INFO__INIT;
  mi.name = "";
  mi.model_type = w->cfg.model_type;
  mi.vocab_size = (uint32_t)w->cfg.vocab_size;
  mi.max_source_len = (uint32_t)w->max_src;
  mi.max_target_len = (uint32_t)w->max_tgt;
  mi.mel_bins = w->frames ? (uint32_t)w->cfg.num_mel_bins : 0;
  mi.frames = (uint32_t)w->frames;
  Tandem__TokenId start = TANDEM__TOKEN_ID__INIT;
  start.id = w->start_token;
  mi.decoder_start = &start;
  const td_gen_config *gen = td_model_get_gen(w->m);
  mi.eos_token_ids = (int32_t *)gen->eos_ids;
  mi.n_eos_token_ids = (size_t)gen->n_eos;
  Tandem__Cluster__Role roles[TD_WORKER_MAX_ROLES];
  for (int i = 0; i < w->n_roles; i++) roles[i] = w->roles[i]->id;
  Tandem__Cluster__WorkerInfo in = TANDEM__CLUSTER__WORKER_INFO__INIT;
  in.worker_id = w->id;
  in.roles = roles;
  in.n_roles = (size_t)w->n_roles;
  in.model = &mi;
  in.tp = (uint32_t)(w->o.tp > 1 ? w->o.tp : 1);
  in.pp = (uint32_t)(w->o.pp > 1 ? w->o.pp : 1);
  in.group = (char *)(w->o.group ? w->o.group : "");
  in.block_size = (uint32_t)w->block_size;
  in.self_blocks = (uint32_t)w->self_blocks;
  in.cross_blocks = (uint32_t)w->cross_blocks;
  in.max_running = (uint32_t)w->max_running;
  in.encode_batch_tokens = (uint32_t)(w->o.max_enc_tokens > 0 ? w->o.max_enc_tokens : 0);
  in.transfer_desc.data = w->desc;
  in.transfer_desc.len = w->desc_len;
  in.device = (char *)td_backend_name(w->b);
  in.pid = (uint32_t)getpid();
  in.cross_mode = (char *)td_cross_mode_name(w->states_out ? TD_CROSS_STATES : w->o.cross_mode);
  in.cross_projects = w->states_bb > 0;
  in.cross_int8 = w->o.cross_int8;
  in.version = TD_BUILD_VERSION;
  Tandem__Cluster__Register reg = TANDEM__CLUSTER__REGISTER__INIT;
  reg.info = &in;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_REGISTER;
  m.register_ = &reg;
  td_worker_send(w, &m);
  w->last_register = td_now_ms();
}

void w_send_heartbeat(td_worker *w) {
  load_snap l = w_load(w);
  Tandem__Cluster__Load ld = TANDEM__CLUSTER__LOAD__INIT;
  ld.queued = (uint32_t)l.queued;
  ld.running = (uint32_t)l.running;
  ld.free_self_blocks = (uint32_t)l.free_self;
  ld.free_cross_blocks = (uint32_t)l.free_cross;
  ld.draining = w->draining;
  ld.stopping = w->draining && *w->stop;
  ld.kv_in_ucx = w->kv_in[TD_KVT_UCX];
  ld.kv_in_zmq = w->kv_in[TD_KVT_ZMQ];
  ld.kv_out_ucx = w->kv_out[TD_KVT_UCX];
  ld.kv_out_zmq = w->kv_out[TD_KVT_ZMQ];
  ld.kv_in_bytes_ucx = w->kv_in_bytes[TD_KVT_UCX];
  ld.kv_in_bytes_zmq = w->kv_in_bytes[TD_KVT_ZMQ];
  ld.kv_out_bytes_ucx = w->kv_out_bytes[TD_KVT_UCX];
  ld.kv_out_bytes_zmq = w->kv_out_bytes[TD_KVT_ZMQ];
  ld.kv_out_seconds_ucx = w->kv_out_seconds[TD_KVT_UCX];
  ld.kv_out_seconds_zmq = w->kv_out_seconds[TD_KVT_ZMQ];
  ld.kv_out_ipc = w->kvt[TD_KVT_UCX] ? td_kvt_ipc_blocks(w->kvt[TD_KVT_UCX]) : 0;
  ld.kv_pushing = (uint32_t)w_kv_pushing(w);
  ld.kv_refused = w->kv_refused;
  ld.encoded = (uint64_t)l.encoded;
  ld.encoder_cache_hits = (uint64_t)l.cache_hits;
  ld.encoder_cache_blocks = (uint32_t)l.cache_blocks;
  ld.steps = (uint64_t)l.steps;
  ld.tokens = (uint64_t)l.tokens;
  ld.encode_runs = (uint64_t)l.encode_runs;
  ld.busy_seconds = l.busy_s;
  ld.idle_seconds = l.idle_s;
  ld.project_seconds = l.project_s;
  ld.work_began_ms = (uint64_t)l.began_ms;
  ld.work_ended_ms = (uint64_t)l.ended_ms;
  Tandem__Cluster__Heartbeat hb = TANDEM__CLUSTER__HEARTBEAT__INIT;
  hb.load = &ld;
  hb.seq = ++w->hb_seq;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_HEARTBEAT;
  m.heartbeat = &hb;
  td_worker_send(w, &m);
}

void w_send_deregister(td_worker *w, const char *reason) {
  Tandem__Cluster__Deregister d = TANDEM__CLUSTER__DEREGISTER__INIT;
  d.reason = (char *)reason;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_DEREGISTER;
  m.deregister = &d;
  td_worker_send(w, &m);
}

/* ------------------------------------------------------------ timers */

static int heartbeat_timer(td_loop *l, void *ctx) {
  td_worker *w = ctx;
  if (w->registered) w_send_heartbeat(w);
  return w->hb_ms;
}

static int silence_timer(td_loop *l, void *ctx) {
  td_worker *w = ctx;
  int64_t quiet = td_now_ms() - w->last_router_msg;
  if (w->registered && quiet > (int64_t)w->hb_ms * w->dead_after) {
    TD_WARN("no word from the router for %lld ms", (long long)quiet);
    w->registered = false;
    w_cancel_all(w, "the router is silent");
  }
  return w->hb_ms;
}

int w_register_timer(td_loop *l, void *ctx) {
  td_worker *w = ctx;
  if (!w->registered && td_now_ms() - w->last_register >= TD_DEFAULT_REGISTER_RETRY_MS) {
    if (w_link_up(w) != TD_OK) TD_DEBUG("%s", td_errmsg()); /* the router may not serve it yet */
    w_send_register(w);
  }
  return TD_DEFAULT_REGISTER_RETRY_MS;
}

/* (Re)arms the heartbeat and silence timers at the period of hb_ms; first:
 * the first heartbeat goes now. */
td_status w_router_timers(td_worker *w, bool first) {
  if (w->hb_timer) td_loop_remove(w->loop, w->hb_timer);
  if (w->silence_timer) td_loop_remove(w->loop, w->silence_timer);
  w->hb_timer = w->silence_timer = 0;
  TD_TRY(td_loop_add_timer(w->loop, first ? 0 : w->hb_ms, heartbeat_timer, w, &w->hb_timer));
  return td_loop_add_timer(w->loop, w->hb_ms, silence_timer, w, &w->silence_timer);
}

/* ------------------------------------------------------------ messages */

static int register_again(td_loop *l, void *ctx) {
  (void)l;
  td_worker *w = ctx;
  if (!w->registered) w_send_register(w);
  return TD_LOOP_DONE;
}

static void on_ack(td_worker *w, const Tandem__Cluster__RegisterAck *a) {
  if (a->accepted) {
    bool was = w->registered;
    if (!was) TD_INFO("registered with the router");
    /* Taken back after a silence: the router dropped (and retried) whatever it
     * gave this worker before; jobs that came before this answer are of that
     * time, and none will ever be claimed or cancelled. */
    if (!was) w_cancel_all(w, "sent before the router took this worker back");
    w->id_wait_since = 0;
    w->registered = true;
    int hb = a->heartbeat_ms ? (int)a->heartbeat_ms : w->hb_ms;
    if (a->dead_after) w->dead_after = (int)a->dead_after;
    if (!was || hb != w->hb_ms) {
      w->hb_ms = hb;
      if (w_router_timers(w, !was) != TD_OK) TD_ERROR("heartbeat timer: %s", td_errmsg());
    }
  } else if (a->reason && strstr(a->reason, "unknown worker")) {
    w->registered = false;
    w_cancel_all(w, "the router does not know this worker");
    w_send_register(w);
  } else if (a->reason && strstr(a->reason, TD_ROUTER_ID_IN_USE) &&
             (!w->id_wait_since || td_now_ms() - w->id_wait_since < TD_WORKER_ID_WAIT_MS)) {
    /* an old instance of this worker may still hold the id: ask again
     * after a heartbeat period, until it has had time to fall silent */
    if (!w->id_wait_since) {
      w->id_wait_since = td_now_ms();
      TD_WARN("%s; retrying for up to %d s", a->reason, TD_WORKER_ID_WAIT_MS / 1000);
    }
    w->registered = false;
    if (td_loop_add_timer(w->loop, w->hb_ms, register_again, w, NULL) != TD_OK)
      TD_ERROR("register timer: %s", td_errmsg());
  } else {
    /* nothing to drain or deregister: td_worker_run returns the reason */
    snprintf(w->refused, sizeof w->refused, "%s", a->reason && a->reason[0] ? a->reason : "?");
    TD_ERROR("the router refused this worker: %s", w->refused);
    w->registered = false;
    w_cancel_all(w, "the router refused this worker");
    td_loop_stop(w->loop);
  }
}

/* The request a job message is about: to refuse a job that no role here takes. */
static const Tandem__Cluster__RequestSpec *job_spec(const Tandem__Cluster__RouterMessage *m) {
  switch (m->body_case) {
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE: return m->decode->req;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL: return m->prefill->req;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE: return m->encode->req;
    default: return NULL;
  }
}

/* Jobs and notices, to the role whose table takes them; returns whether
 * the role kept m. */
static bool to_role(td_worker *w, Tandem__Cluster__RouterMessage *m) {
  for (int i = 0; i < w->n_roles; i++) {
    const td_role *r = w->roles[i];
    if (r->job == m->body_case) {
      const Tandem__Cluster__RequestSpec *sp = job_spec(m);
      if (w->world > 1 && !r->in_group && !(r->group_self && w->states_out)) {
        /* group_self: the router should never have sent it (an encoder group, which pushes states, takes any) */
        if (sp)
          td_worker_send_failed(w, sp->rid, TD_ERR_INVALID,
                                "a worker group takes the encode role for its own requests only", false);
        return false;
      }
      td_log_set_request(sp ? sp->client_id : NULL);
      if (sp) TD_DEBUG("%s job for request %llu", r->name, (unsigned long long)sp->rid);
      r->on_job(w, m);
      td_log_set_request(NULL);
      return true;
    }
    if (r->notice && r->notice == m->body_case && r->on_notice) {
      r->on_notice(w, m);
      return false;
    }
  }
  const Tandem__Cluster__RequestSpec *sp = job_spec(m);
  if (sp) td_worker_send_failed(w, sp->rid, TD_ERR_OVERLOADED, "this worker serves no role that takes this job", true);
  return false;
}

/* One frame from the router (s: how receiving it went); freed here. */
static void router_frame(td_worker *w, td_wire_frame *f, td_status s) {
  if (s != TD_OK) {
    td_wire_frame_free(f);
    return;
  }
  Tandem__Cluster__RouterMessage *m;
  uint32_t ver;
  s = td_wire_unpack_router(f, &m, &ver);
  /* a job's features in a frame of their own: into the spec, as if inline (the wire checked the frame) */
  const Tandem__Cluster__RequestSpec *fsp = s == TD_OK ? job_spec(m) : NULL;
  if (fsp && fsp->features && td_wire_features_inline(f, fsp->features) != TD_OK) {
    TD_ERROR("request %llu: %s", (unsigned long long)fsp->rid, td_errmsg());
    td_worker_send_failed(w, fsp->rid, TD_ERR_NOMEM, td_errmsg(), true);
    tandem__cluster__router_message__free_unpacked(m, NULL);
    td_wire_frame_free(f);
    return;
  }
  td_wire_frame_free(f);
  if (s != TD_OK) {
    TD_ERROR("message from the router dropped: %s", td_errmsg());
    return;
  }
  w->last_router_msg = td_now_ms();
  char why[320];
  if (!td_check_router_message(m, w->cfg.vocab_size, why, sizeof why)) {
    /* a job's request fails naming the field; anything else is dropped */
    const Tandem__Cluster__RequestSpec *sp = job_spec(m);
    TD_ERROR("dropped an invalid message from the router: %s", why);
    if (sp) {
      char msg[400];
      snprintf(msg, sizeof msg, "invalid job: %s", why);
      td_worker_send_failed(w, sp->rid, TD_ERR_INVALID, msg, false);
    }
    tandem__cluster__router_message__free_unpacked(m, NULL);
    return;
  }
  bool kept = false;
  switch (m->body_case) {
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ACK: on_ack(w, m->ack); break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_HEARTBEAT: break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL: w_cancel_rid(w, m->cancel->rid); break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DRAIN:
      TD_INFO("the router asks this worker to drain");
      w->drain_asked = true;
      break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_UNDRAIN:
      if (*w->stop) {
        TD_WARN("the router asks this worker to stop draining, but it was told to stop (signal %d)", (int)*w->stop);
      } else if (w->drain_asked) {
        TD_INFO("the router takes its drain back: serving again");
        w->drain_asked = w->draining = false;
        w_send_heartbeat(w);
      }
      break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_REMOVE:
      TD_WARN("the router removed this worker: %s", m->remove->reason ? m->remove->reason : "");
      w->removed = true;
      w->registered = false;
      td_loop_stop(w->loop);
      break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO:
      if (!m->group_info->ok && w->world > 1) {
        TD_ERROR("the group failed: %s", m->group_info->error ? m->group_info->error : "?");
        w->group_failed = true;
        if (w->comm) td_comm_abort(w->comm);
        w_cancel_all(w, "the worker group failed");
        *w->stop = SIGTERM;
      }
      break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_SHUTDOWN:
      TD_INFO("the router is shutting down");
      w_cancel_all(w, "router shutdown");
      w->registered = false;
      break;
    default: kept = to_role(w, m); break;
  }
  if (!kept) tandem__cluster__router_message__free_unpacked(m, NULL);
}

/* One message; false when none was waiting. */
static bool router_message(td_worker *w) {
  td_wire_frame f;
  td_status s = td_wire_recv(w->rsock, false, false, &f);
  if (s == TD_ERR_NOT_FOUND) return false;
  router_frame(w, &f, s);
  return true;
}

void w_on_router(td_loop *l, void *ctx) {
  td_worker *w = ctx;
  for (int k = 0; k < ROUTER_BURST && !w->refused[0] && !w->removed && router_message(w); k++) {
  }
}

/* ------------------------------------------------------------ the local link */

void w_link_close(td_worker *w) {
  if (!w->rlink) return;
  td_loop_remove(w->loop, w->rlink_ev);
  td_link_destroy(w->rlink);
  w->rlink = NULL;
}

/* The router's end closed (it stopped or died): as after its silence, this
 * worker's jobs end and it registers again once a router serves the path. */
static void on_link(td_loop *l, void *ctx) {
  td_worker *w = ctx;
  for (int k = 0; k < ROUTER_BURST && w->rlink && !w->refused[0] && !w->removed; k++) {
    td_wire_frame f;
    td_status s = td_link_recv(w->rlink, &f);
    if (s == TD_ERR_NOT_FOUND) break;
    if (td_link_broken(w->rlink)) {
      td_wire_frame_free(&f);
      TD_WARN("the router's local link closed: %s", td_errmsg());
      w_link_close(w);
      if (w->registered) {
        w->registered = false;
        w_cancel_all(w, "the router's local link closed");
      }
      return;
    }
    router_frame(w, &f, s);
  }
  /* frames left in the link's buffer (the burst's end): the descriptor will not wake us for them */
  if (w->rlink) td_loop_set_pending(l, w->rlink_ev, td_link_pending(w->rlink));
}

td_status w_link_up(td_worker *w) {
  const char *path = td_link_path(w->o.router);
  if (!path || w->rlink) return TD_OK;
  td_link *k;
  TD_TRY(td_link_connect(path, &k));
  td_status s = td_loop_add_fd(w->loop, td_link_fd(k), on_link, w, &w->rlink_ev);
  if (s != TD_OK) {
    td_link_destroy(k);
    return s;
  }
  w->rlink = k;
  TD_INFO("connected to the router at %s", w->o.router);
  return TD_OK;
}
