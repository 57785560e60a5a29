/* The worker registry: registration (model, block size and cross mode must
 * match the cluster's), heartbeats both ways, death after silence, the pool
 * placement reads, the health answer. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "proto/check.h"
#include "router/internal.h"

worker *rtr_find_worker(td_router *r, const char *id) {
  worker *w = NULL;
  HASH_FIND_STR(r->workers, id, w);
  return w;
}

worker *rtr_find_route(td_router *r, const uint8_t *route, size_t len) {
  worker *w = NULL;
  HASH_FIND(hr, r->by_route, route, len, w);
  return w;
}

int rtr_count_role(const td_router *r, rtr_role role) {
  int n = 0;
  for (int i = 0; i < r->n_pool; i++) {
    const td_place_worker *w = r->pool[i];
    n += role == RTR_ENCODE ? w->enc || w->enc_self : role == RTR_PREFILL ? w->pre : w->dec;
  }
  return n;
}

static td_status pool_add(td_router *r, worker *w) {
  if (r->n_pool == r->cap_pool) {
    int nc = r->cap_pool ? 2 * r->cap_pool : 16;
    td_place_worker **p = realloc(r->pool, sizeof *p * (size_t)nc);
    if (!p) return td_err(TD_ERR_NOMEM, "out of memory");
    r->pool = p;
    r->cap_pool = nc;
  }
  r->pool[r->n_pool++] = &w->pl;
  return TD_OK;
}

static void pool_remove(td_router *r, worker *w) {
  for (int i = 0; i < r->n_pool; i++)
    if (r->pool[i] == &w->pl) {
      memmove(r->pool + i, r->pool + i + 1, sizeof *r->pool * (size_t)(r->n_pool - i - 1));
      r->n_pool--;
      return;
    }
}

static void worker_free(worker *w) {
  free(w->device);
  free(w->version);
  free(w->group);
  free(w);
}

void rtr_worker_gone(td_router *r, worker *w, const char *why) {
  TD_WARN("worker %s is gone: %s", w->id, why);
  rreq *q, *t;
  HASH_ITER(hh, r->by_rid, q, t) {
    if (!strcmp(q->dec_w, w->id) || !strcmp(q->enc_w, w->id) || !strcmp(q->pre_w, w->id)) {
      char msg[512];
      snprintf(msg, sizeof msg, "worker %s failed (%s)", w->id, why);
      /* its own accounting goes with it */
      if (!strcmp(q->dec_w, w->id)) q->dec_w[0] = 0;
      if (!strcmp(q->enc_w, w->id)) q->enc_w[0] = 0;
      if (!strcmp(q->pre_w, w->id)) q->pre_w[0] = 0;
      if (rtr_req_kv_loading(q))
        rtr_req_kv_failed(r, q, msg);
      else
        rtr_req_retry(r, q, msg);
    }
  }
  rtr_metrics_worker(r, w, false);
  HASH_DEL(r->workers, w);
  HASH_DELETE(hr, r->by_route, w);
  pool_remove(r, w);
  worker_free(w);
}

/* The model a registration describes (checked field by field already)
 * against the one the cluster serves. */
static bool model_matches(td_router *r, const Tandem__ModelInfo *m, char *why, size_t cap) {
  if (!r->have_model) return true;
  if (strcmp(m->model_type ? m->model_type : "", r->model_type) || m->vocab_size != r->model.vocab_size ||
      m->max_source_len != r->model.max_source_len || m->max_target_len != r->model.max_target_len ||
      m->mel_bins != r->model.mel_bins || m->frames != r->model.frames ||
      m->decoder_start->id != r->model_start_token) {
    snprintf(why, cap, "serves %s (vocab %u), the cluster serves %s (vocab %u)", m->model_type, m->vocab_size,
             r->model_type, r->model.vocab_size);
    return false;
  }
  return true;
}

/* Workers exchange cross blocks, whose layout the mode sets: every one
 * must run the router's. */
bool rtr_cross_mode_matches(const td_router *r, const char *mode, char *why, size_t cap) {
  const char *wm = mode && *mode ? mode : "auto";
  td_cross_mode m;
  if (td_cross_mode_parse(wm, &m) == TD_OK && m == r->o.cross_mode) return true;
  snprintf(why, cap, "cross pool mode differs: the worker runs --cross-mode %s, the router --cross-mode %s; the router "
           "and every worker must agree", wm, td_cross_mode_name(r->o.cross_mode));
  return false;
}

static void send_ack(td_router *r, const uint8_t *id, size_t id_len, bool accepted, const char *reason) {
  Tandem__Cluster__RegisterAck ack = TANDEM__CLUSTER__REGISTER_ACK__INIT;
  ack.accepted = accepted;
  ack.reason = (char *)(reason ? reason : "");
  ack.heartbeat_ms = (uint32_t)r->o.heartbeat_ms;
  ack.dead_after = (uint32_t)r->o.dead_after;
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ACK;
  m.ack = &ack;
  (void)rtr_send_peer(r, id, id_len, &m);
}

/* The first worker sets the cluster's model. */
static td_status adopt_model(td_router *r, const Tandem__Cluster__WorkerInfo *in) {
  const Tandem__ModelInfo *m = in->model;
  const char *name = r->o.model_name ? r->o.model_name
                     : m->name && m->name[0] ? m->name
                     : m->model_type ? m->model_type : "";
  char *type = strdup(m->model_type ? m->model_type : ""), *served = strdup(name);
  if (!type || !served) {
    free(type);
    free(served);
    return td_err(TD_ERR_NOMEM, "out of memory");
  }
  r->model_type = type;
  r->model_name = served;
  r->model = *m;
  r->model.base = (ProtobufCMessage)PROTOBUF_C_MESSAGE_INIT(&tandem__model_info__descriptor);
  r->model.name = served;
  r->model.model_type = type;
  r->model.decoder_start = NULL; /* the message is freed after registration */
  r->model.eos_token_ids = NULL;
  r->model.n_eos_token_ids = 0;
  r->n_model_eos = (int)m->n_eos_token_ids;
  memcpy(r->model_eos, m->eos_token_ids, sizeof(int32_t) * m->n_eos_token_ids);
  r->model_start_token = m->decoder_start->id;
  r->block_size = (int)in->block_size;
  r->have_model = true;
  return TD_OK;
}

/* With keys, a worker id (or a group's rank) belongs to the key that
 * first registered it, for the router's life: another listed key cannot
 * take it over, not even while its worker is away. NULL key (no CURVE): true. */
typedef struct id_key {
  char id[TD_WIRE_MAX_ID + 1];
  char key[TD_AUTH_KEY_Z85];
  UT_hash_handle hh;
} id_key;

bool rtr_id_key_ok(td_router *r, const char *wid, const char *key, char *why, size_t cap) {
  if (!key) return true;
  id_key *e = NULL;
  HASH_FIND_STR(r->id_keys, wid, e);
  if (e) {
    if (!strcmp(e->key, key)) return true;
    /* group ranks are "group NAME rank R" (no worker id holds a space) */
    snprintf(why, cap, "%s%s belongs to another key (this connection's key is %s)",
             strncmp(wid, "group ", 6) ? "worker id " : "", wid, key);
    return false;
  }
  if (r->n_id_keys >= TD_AUTH_MAX_BOUND_IDS) {
    snprintf(why, cap, "the router has bound %d worker ids to keys (TD_AUTH_MAX_BOUND_IDS): no new id", r->n_id_keys);
    return false;
  }
  e = calloc(1, sizeof *e);
  if (!e) {
    snprintf(why, cap, "out of memory");
    return false;
  }
  snprintf(e->id, sizeof e->id, "%s", wid);
  snprintf(e->key, sizeof e->key, "%s", key);
  HASH_ADD_STR(r->id_keys, id, e);
  r->n_id_keys++;
  return true;
}

void rtr_id_keys_free(td_router *r) {
  id_key *e, *t;
  HASH_ITER(hh, r->id_keys, e, t) {
    HASH_DEL(r->id_keys, e);
    free(e);
  }
  r->n_id_keys = 0;
}

void rtr_register_refuse(td_router *r, const uint8_t *id, size_t id_len, const char *wid, const char *why) {
  TD_WARN("refused worker %s: %s", wid, why);
  send_ack(r, id, id_len, false, why);
}

/* An encoder-only worker whose pool holds encoder states (cross mode states
 * under a router in auto or dual): it pushes states, projected on arrival. */
static bool states_encoder(const td_router *r, const Tandem__Cluster__WorkerInfo *in) {
  bool enc_only = in && in->n_roles > 0;
  for (size_t i = 0; in && i < in->n_roles; i++) enc_only &= in->roles[i] == TANDEM__CLUSTER__ROLE__ROLE_ENCODE;
  return enc_only && in->cross_mode && strcmp(in->cross_mode, "states") == 0 &&
         (r->o.cross_mode == TD_CROSS_AUTO || r->o.cross_mode == TD_CROSS_DUAL);
}

/* Every check of a registration but its endpoint's; false: why says. */
static bool registration_ok(td_router *r, const uint8_t *id, size_t id_len, const char *key,
                            const Tandem__Cluster__WorkerInfo *in, const char *wid, char *why, size_t cap) {
  /* every field within its limits first (proto/check.c), then against the cluster */
  bool ok = td_check_worker_info(in, why, cap);
  if (ok && !id_len) {
    snprintf(why, cap, "the worker's connection has no routing identity");
    ok = false;
  }
  if (ok) ok = model_matches(r, in->model, why, cap);
  if (ok && r->have_model && (int)in->block_size != r->block_size) {
    snprintf(why, cap, "block size %u, the cluster uses %d", in->block_size, r->block_size);
    ok = false;
  }
  /* an encoder-only worker in cross mode states pushes encoder states, which
   * decode workers with K/V and a states tail (dual) project on arrival */
  if (ok && !states_encoder(r, in)) ok = rtr_cross_mode_matches(r, in->cross_mode, why, cap);
  if (ok) ok = rtr_id_key_ok(r, wid, key, why, cap);
  worker *old = ok ? rtr_find_worker(r, wid) : NULL;
  if (old && (old->route_len != id_len || memcmp(old->route, id, id_len))) {
    /* another connection claims a live worker's id: refused until the
     * first falls silent (a restart waits out the old one's liveness);
     * the worker retries on this answer */
    int64_t silent = td_now_ms() - old->last_seen;
    if (silent < (int64_t)r->o.heartbeat_ms * r->o.dead_after) {
      snprintf(why, cap, "%s %s: another connection registered it and was heard from %lld ms ago",
               TD_ROUTER_ID_IN_USE, wid, (long long)silent);
      ok = false;
    }
  }
  return ok;
}

void rtr_on_register(td_router *r, const uint8_t *id, size_t id_len, const char *key, Tandem__Cluster__WorkerMessage *m) {
  if (rtr_probe_pending(r, id, id_len)) return; /* its retry while its endpoint is being checked */
  Tandem__Cluster__Register *reg = m->register_;
  Tandem__Cluster__WorkerInfo *in = reg ? reg->info : NULL;
  char why[512] = "", wid[TD_WIRE_MAX_ID + 1] = "";
  if (in && in->worker_id) snprintf(wid, sizeof wid, "%s", in->worker_id);
  if (!registration_ok(r, id, id_len, key, in, wid, why, sizeof why)) {
    rtr_register_refuse(r, id, id_len, wid, why);
    return;
  }
  bool answered = false;
  if (rtr_probe_start(r, id, id_len, key, reg, &answered)) {
    m->register_ = NULL; /* the check keeps it */
    m->body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY__NOT_SET;
    return;
  }
  if (!answered) rtr_register_checked(r, id, id_len, key, reg);
}

void rtr_register_checked(td_router *r, const uint8_t *id, size_t id_len, const char *key,
                          Tandem__Cluster__Register *reg) {
  char why[512] = "";
  Tandem__Cluster__WorkerInfo *in = reg ? reg->info : NULL;
  /* the worker's id is the registration's; its connection's identity only routes */
  char wid[TD_WIRE_MAX_ID + 1] = "";
  if (in && in->worker_id) snprintf(wid, sizeof wid, "%s", in->worker_id);
  /* again: a check may have taken a while */
  if (!registration_ok(r, id, id_len, key, in, wid, why, sizeof why)) {
    rtr_register_refuse(r, id, id_len, wid, why);
    return;
  }
  worker *old = rtr_find_worker(r, wid);
  if (old) rtr_worker_gone(r, old, "registered again (restarted)");
  worker *w = calloc(1, sizeof *w);
  if (!w) return;
  w->id_len = strlen(wid);
  memcpy(w->id, wid, w->id_len);
  memcpy(w->route, id, id_len);
  w->route_len = id_len;
  w->pl.id = w->id;
  for (size_t i = 0; i < in->n_roles; i++) {
    w->pl.enc |= in->roles[i] == TANDEM__CLUSTER__ROLE__ROLE_ENCODE;
    w->pl.pre |= in->roles[i] == TANDEM__CLUSTER__ROLE__ROLE_PREFILL;
    w->pl.dec |= in->roles[i] == TANDEM__CLUSTER__ROLE__ROLE_DECODE;
  }
  /* a group's KV is sliced across its ranks: it encodes for itself, never for another; an encoder group
     pushes encoder states, which every rank holds whole, so it encodes for any */
  if (w->pl.enc && in->group && in->group[0] && (in->tp > 1 || in->pp > 1) && !states_encoder(r, in)) {
    w->pl.enc = false;
    w->pl.enc_self = w->pl.dec;
  }
  w->pl.states_out = states_encoder(r, in);
  w->pl.projects = in->cross_projects;
  /* int8 cross K/V: its K/V pushes go to int8 pools only, and it takes K/V from int8 encoders only */
  w->pl.kv8 = in->cross_int8;
  w->self_blocks = (int)in->self_blocks;
  w->pl.cross_blocks = (int)in->cross_blocks;
  w->pl.max_running = in->max_running ? (int)in->max_running : 1;
  w->pl.enc_batch = (int)in->encode_batch_tokens; /* <= INT32_MAX: td_check_worker_info */
  w->device = strdup(in->device ? in->device : "");
  w->version = strdup(in->version ? in->version : "");
  w->group = strdup(in->group ? in->group : "");
  w->pid = in->pid;
  snprintf(w->key, sizeof w->key, "%s", key ? key : "");
  w->last_seen = td_now_ms();
  w->load = (Tandem__Cluster__Load)TANDEM__CLUSTER__LOAD__INIT;
  w->load.free_self_blocks = (uint32_t)w->self_blocks;
  w->load.free_cross_blocks = (uint32_t)w->pl.cross_blocks;
  if (!w->device || !w->version || !w->group) {
    TD_ERROR("worker %s: out of memory", wid);
    worker_free(w);
    return;
  }
  if ((!r->have_model && adopt_model(r, in) != TD_OK) || pool_add(r, w) != TD_OK) {
    TD_ERROR("worker %s: %s", wid, td_errmsg());
    worker_free(w);
    return;
  }
  HASH_ADD_STR(r->workers, id, w);
  HASH_ADD(hr, r->by_route, route, w->route_len, w);
  TD_INFO("worker %s registered: %s%s%s on %s, %d self / %d cross blocks", wid, w->pl.enc ? "encode " : w->pl.enc_self ? "encode (its own) " : "",
          w->pl.pre ? "prefill " : "", w->pl.dec ? "decode" : "", w->device, w->self_blocks, w->pl.cross_blocks);
  rtr_metrics_worker(r, w, true);
  send_ack(r, id, id_len, true, NULL);
}

void rtr_on_heartbeat(td_router *r, worker *w, const Tandem__Cluster__Heartbeat *hb) {
  (void)r;
  char why[256];
  if (!td_check_load(hb->load, (uint32_t)w->self_blocks, (uint32_t)w->pl.cross_blocks, why, sizeof why)) {
    /* the last good load stays: placement does not read it, /metrics and health do */
    TD_WARN("worker %s: dropped a heartbeat: %s", w->id, why);
    return;
  }
  w->load = *hb->load;
  w->load.base = (ProtobufCMessage)PROTOBUF_C_MESSAGE_INIT(&tandem__cluster__load__descriptor);
  if (w->load.draining && !w->pl.draining) TD_INFO("worker %s is draining", w->id);
  /* an operator's drain holds from the moment it was asked, whatever
   * heartbeats sent before the worker heard it say */
  w->pl.draining = w->load.draining || w->drain_asked;
}

void rtr_stall_check(td_router *r, int64_t t) {
  if (r->last_tick && t - r->last_tick > (int64_t)r->o.heartbeat_ms * r->o.dead_after) {
    TD_WARN("the router's loop stalled for %lld ms: workers' silence during it is not counted",
            (long long)(t - r->last_tick));
    worker *w, *tmp;
    HASH_ITER(hh, r->workers, w, tmp) w->last_seen = t;
    rtr_groups_heard_all(r, t);
  }
  r->last_tick = t;
}

int rtr_heartbeat_tick(td_loop *l, void *ctx) {
  (void)l;
  td_router *r = ctx;
  int64_t t = td_now_ms();
  Tandem__Cluster__Heartbeat hb = TANDEM__CLUSTER__HEARTBEAT__INIT;
  hb.seq = ++r->hb_seq;
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_HEARTBEAT;
  m.heartbeat = &hb;
  worker *w, *tmp;
  int64_t dead_ms = (int64_t)r->o.heartbeat_ms * r->o.dead_after;
  rtr_stall_check(r, t);
  HASH_ITER(hh, r->workers, w, tmp) {
    if (t - w->last_seen > dead_ms) {
      char why[128];
      snprintf(why, sizeof why, "silent for %lld ms", (long long)(t - w->last_seen));
      rtr_worker_gone(r, w, why);
      continue;
    }
    (void)rtr_send_worker(r, w, &m);
  }
  return r->o.heartbeat_ms;
}

void rtr_health_fill(td_router *r, Tandem__HealthResponse *hp, Tandem__WorkerStatus **wsp,
                     Tandem__WorkerStatus ***wpp) {
  Tandem__HealthResponse h = TANDEM__HEALTH_RESPONSE__INIT;
  h.encoders = (uint32_t)rtr_count_role(r, RTR_ENCODE);
  h.prefills = (uint32_t)rtr_count_role(r, RTR_PREFILL);
  h.decoders = (uint32_t)rtr_count_role(r, RTR_DECODE);
  h.serving = h.decoders > 0;
  h.in_flight = (uint32_t)r->in_flight;
  h.queued = (uint32_t)(r->queue.n + r->parked.n);
  h.cross_mode = (char *)td_cross_mode_name(r->o.cross_mode);
  size_t nw = HASH_COUNT(r->workers), k = 0;
  Tandem__WorkerStatus *ws = calloc(nw + 1, sizeof *ws);
  Tandem__WorkerStatus **wp = calloc(nw + 1, sizeof *wp);
  worker *w, *wt;
  if (ws && wp) {
    HASH_ITER(hh, r->workers, w, wt) {
      Tandem__WorkerStatus *x = &ws[k];
      tandem__worker_status__init(x);
      x->id = w->id;
      x->encode = w->pl.enc || w->pl.enc_self;
      x->prefill = w->pl.pre;
      x->decode = w->pl.dec;
      x->self_blocks = (uint32_t)w->self_blocks;
      x->free_self_blocks = w->load.free_self_blocks;
      x->cross_blocks = (uint32_t)w->pl.cross_blocks;
      x->free_cross_blocks = w->load.free_cross_blocks;
      x->running = w->load.running;
      x->max_running = (uint32_t)w->pl.max_running;
      x->queued = w->load.queued;
      x->jobs = (uint32_t)w->pl.jobs;
      x->draining = w->pl.draining;
      x->device = w->device;
      x->kv_in_ucx = w->load.kv_in_ucx;
      x->kv_in_zmq = w->load.kv_in_zmq;
      x->kv_out_ucx = w->load.kv_out_ucx;
      x->kv_out_zmq = w->load.kv_out_zmq;
      x->kv_out_ipc = w->load.kv_out_ipc;
      x->encoded = w->load.encoded;
      x->encoder_cache_hits = w->load.encoder_cache_hits;
      x->encoder_cache_blocks = w->load.encoder_cache_blocks;
      x->kv_pushing = w->load.kv_pushing;
      x->version = w->version;
      x->group = w->group;
      x->pid = w->pid;
      x->drain_requested = w->drain_asked;
      x->stopping = w->load.stopping;
      x->kv_refused = w->load.kv_refused;
      x->steps = w->load.steps;
      x->tokens = w->load.tokens;
      x->encode_runs = w->load.encode_runs;
      x->busy_seconds = w->load.busy_seconds;
      x->idle_seconds = w->load.idle_seconds;
      x->project_seconds = w->load.project_seconds;
      x->work_began_ms = w->load.work_began_ms;
      x->work_ended_ms = w->load.work_ended_ms;
      wp[k++] = x;
    }
    h.workers = wp;
    h.n_workers = k;
  }
  *hp = h;
  *wsp = ws;
  *wpp = wp;
}

void rtr_health(td_router *r, const uint8_t *id, size_t id_len) {
  Tandem__HealthResponse h;
  Tandem__WorkerStatus *ws, **wp;
  rtr_health_fill(r, &h, &ws, &wp);
  Tandem__ServerMessage sm = TANDEM__SERVER_MESSAGE__INIT;
  sm.request_id = "";
  sm.body_case = TANDEM__SERVER_MESSAGE__BODY_HEALTH;
  sm.health = &h;
  rtr_send_client(r, id, id_len, &sm);
  free(ws);
  free(wp);
}

void rtr_workers_free(td_router *r) {
  worker *w, *wt;
  HASH_ITER(hh, r->workers, w, wt) {
    HASH_DEL(r->workers, w);
    HASH_DELETE(hr, r->by_route, w);
    worker_free(w);
  }
  free(r->pool);
  r->pool = NULL;
  r->n_pool = r->cap_pool = 0;
}
