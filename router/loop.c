/* The router's loop and lifecycle: the worker and client sockets as
 * td_loop socket events (messages dispatched to the registry, the groups,
 * the requests), the periodic work as timers (heartbeats and worker death
 * at the heartbeat period; deadlines, stage timeouts, group ranks and the
 * stop flag every TD_ROUTER_TICK_MS), and placement before every sleep, so
 * that a request is placed as soon as a message makes room or brings it. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/net.h"
#include "router/internal.h"

/* ------------------------------------------------------------ local links */

/* A link peer's routing identity: a first byte no ZeroMQ identity here has
 * (libzmq's own begin with 0, workers' are printable), then its serial. */
#define LINK_ID0 0x01

typedef struct rtr_link {
  td_router *r;
  td_link *k;
  bool client;
  int ev;
  uint8_t id[9];
} rtr_link;

static rtr_link *find_link(td_router *r, const uint8_t *id, size_t n) {
  if (n != sizeof(((rtr_link *)0)->id) || id[0] != LINK_ID0) return NULL;
  for (int i = 0; i < r->n_links; i++)
    if (!memcmp(r->links[i]->id, id, n)) return r->links[i];
  return NULL;
}

static void link_writable(td_loop *l, void *ctx) {
  rtr_link *k = ctx;
  (void)td_link_flush(k->k); /* a broken link is its reader's to close */
  if (!td_link_wants_write(k->k)) td_loop_set_writable(l, k->ev, NULL);
}

/* NULL *sent when id is not a link's (the caller's ZeroMQ socket takes it) */
static td_status link_send(td_router *r, const uint8_t *id, size_t n, const ProtobufCMessage *m, zmq_msg_t *extra,
                           bool *sent) {
  *sent = false;
  if (!n || id[0] != LINK_ID0) return TD_OK;
  *sent = true;
  rtr_link *k = find_link(r, id, n);
  if (!k) return td_err(TD_ERR_PEER, "its local link is closed");
  td_status s = td_link_send(k->k, m, extra);
  if (td_link_wants_write(k->k) && r->loop) td_loop_set_writable(r->loop, k->ev, link_writable);
  return s;
}

/* ------------------------------------------------------------ sending */

td_status rtr_send_peer(td_router *r, const uint8_t *id, size_t id_len, Tandem__Cluster__RouterMessage *m) {
  m->version = TD_PROTOCOL_VERSION;
  bool sent;
  td_status s = link_send(r, id, id_len, &m->base, NULL, &sent);
  return sent ? s : td_wire_send(r->wsock, id, id_len, &m->base);
}

td_status rtr_send_worker_extra(td_router *r, const worker *w, Tandem__Cluster__RouterMessage *m, zmq_msg_t *extra) {
  m->version = TD_PROTOCOL_VERSION;
  bool sent;
  td_status s = link_send(r, w->route, w->route_len, &m->base, extra, &sent);
  if (!sent) s = td_wire_send_extra(r->wsock, w->route, w->route_len, &m->base, extra);
  if (s != TD_OK) TD_WARN("router: send to worker %s: %s", w->id, td_errmsg());
  return s;
}

td_status rtr_send_worker(td_router *r, const worker *w, Tandem__Cluster__RouterMessage *m) {
  return rtr_send_worker_extra(r, w, m, NULL);
}

void rtr_send_client(td_router *r, const uint8_t *id, size_t id_len, Tandem__ServerMessage *m) {
  m->version = TD_PROTOCOL_VERSION;
  bool sent;
  td_status s = link_send(r, id, id_len, &m->base, NULL, &sent);
  if (!sent) s = td_wire_send(r->csock, id, id_len, &m->base);
  if (s != TD_OK) TD_DEBUG("router: client send: %s", td_errmsg());
}

void rtr_client_error(td_router *r, const uint8_t *id, size_t id_len, const char *rid, Tandem__ErrorCode code,
                      const char *msg) {
  Tandem__Error e = TANDEM__ERROR__INIT;
  e.code = code;
  e.message = (char *)msg;
  Tandem__ServerMessage m = TANDEM__SERVER_MESSAGE__INIT;
  m.request_id = (char *)(rid ? rid : "");
  m.body_case = TANDEM__SERVER_MESSAGE__BODY_ERROR;
  m.error = &e;
  rtr_send_client(r, id, id_len, &m);
}

static void refuse_peer(td_router *r, const uint8_t *id, size_t id_len, const char *reason) {
  Tandem__Cluster__RegisterAck ack = TANDEM__CLUSTER__REGISTER_ACK__INIT;
  ack.accepted = false;
  ack.reason = (char *)reason;
  Tandem__Cluster__RouterMessage rm = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  rm.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ACK;
  rm.ack = &ack;
  (void)rtr_send_peer(r, id, id_len, &rm);
}

/* ------------------------------------------------------------ dispatch */

/* A worker's frame (s: how receiving it went), from the socket or a link; freed here. */
static void worker_frame(td_router *r, td_wire_frame *f, td_status s) {
  char wid[TD_WIRE_MAX_ID + 1];
  memcpy(wid, f->id, f->id_len);
  wid[f->id_len] = 0;
  if (s != TD_OK) {
    TD_WARN("router: bad frame from worker %s: %s", wid, td_errmsg());
    td_wire_frame_free(f);
    return;
  }
  Tandem__Cluster__WorkerMessage *m;
  uint32_t ver;
  s = td_wire_unpack_worker(f, &m, &ver);
  if (s != TD_OK) {
    TD_WARN("router: dropped a message from worker %s: %s", wid, td_errmsg());
    if (s == TD_ERR_VERSION) refuse_peer(r, f->id, f->id_len, td_errmsg());
    td_wire_frame_free(f);
    return;
  }
  worker *w = rtr_find_route(r, f->id, f->id_len);
  int frank = 0;
  group_rv *fg = w ? NULL : rtr_group_of_follower(r, f->id, f->id_len, &frank);
  if (m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_GROUP_JOIN) {
    char key[TD_AUTH_KEY_Z85];
    rtr_on_group_join(r, f->id, f->id_len, td_auth_msg_key(&f->msg, key) ? key : NULL, m->group_join);
  } else if (fg) {
    fg->seen[frank] = td_now_ms(); /* a follower's heartbeat */
  } else if (m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_REGISTER) {
    char key[TD_AUTH_KEY_Z85];
    rtr_on_register(r, f->id, f->id_len, td_auth_msg_key(&f->msg, key) ? key : NULL, m);
  } else if (!w) {
    refuse_peer(r, f->id, f->id_len, "unknown worker: register"); /* e.g. the router restarted */
  } else {
    w->last_seen = td_now_ms();
    if (m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_HEARTBEAT)
      rtr_on_heartbeat(r, w, m->heartbeat);
    else if (m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_DEREGISTER)
      rtr_worker_gone(r, w, m->deregister->reason && strlen(m->deregister->reason) <= TD_WIRE_MAX_REASON
                                ? m->deregister->reason
                                : "deregistered (its reason exceeds TD_WIRE_MAX_REASON)");
    else
      rtr_on_progress(r, w, m);
    td_log_set_request(NULL);
  }
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  td_wire_frame_free(f);
}

static void on_worker_message(td_router *r) {
  td_wire_frame f;
  td_status s = td_wire_recv(r->wsock, true, false, &f);
  if (s != TD_ERR_NOT_FOUND) worker_frame(r, &f, s);
}

static void list_models(td_router *r, const uint8_t *id, size_t id_len) {
  Tandem__ModelList ml = TANDEM__MODEL_LIST__INIT;
  Tandem__ModelInfo *one = &r->model;
  if (r->have_model) {
    ml.models = &one;
    ml.n_models = 1;
  }
  Tandem__ServerMessage sm = TANDEM__SERVER_MESSAGE__INIT;
  sm.request_id = "";
  sm.body_case = TANDEM__SERVER_MESSAGE__BODY_MODELS;
  sm.models = &ml;
  rtr_send_client(r, id, id_len, &sm);
}

/* A client's frame (s: how receiving it went), from the socket or a link; freed here. */
static void client_frame(td_router *r, td_wire_frame *f, td_status s) {
  if (s != TD_OK) {
    if (f->id_len) rtr_client_error(r, f->id, f->id_len, "", TANDEM__ERROR_CODE__ERROR_MALFORMED, td_errmsg());
    td_wire_frame_free(f);
    return;
  }
  Tandem__ClientMessage *m;
  uint32_t ver;
  s = td_wire_unpack_client(f, &m, &ver);
  if (s != TD_OK) {
    rtr_client_error(r, f->id, f->id_len, "",
                     s == TD_ERR_VERSION ? TANDEM__ERROR_CODE__ERROR_VERSION : TANDEM__ERROR_CODE__ERROR_MALFORMED,
                     td_errmsg());
    td_wire_frame_free(f);
    return;
  }
  switch (m->body_case) {
    case TANDEM__CLIENT_MESSAGE__BODY_GENERATE:
      td_log_set_request(m->generate ? m->generate->request_id : NULL);
      /* keeps or frees the message, and takes its features frame (the wire checked it is claimed) */
      rtr_on_generate(r, f->id, f->id_len, m, f->len + (f->has_extra ? zmq_msg_size(&f->extra) : 0),
                      f->has_extra ? &f->extra : NULL);
      td_log_set_request(NULL);
      m = NULL;
      break;
    case TANDEM__CLIENT_MESSAGE__BODY_CANCEL: rtr_on_cancel(r, f->id, f->id_len, m->cancel); break;
    case TANDEM__CLIENT_MESSAGE__BODY_HEALTH: rtr_health(r, f->id, f->id_len); break;
    case TANDEM__CLIENT_MESSAGE__BODY_LIST_MODELS: list_models(r, f->id, f->id_len); break;
    case TANDEM__CLIENT_MESSAGE__BODY_ADMIN: {
      char key[TD_AUTH_KEY_Z85];
      rtr_on_admin(r, f->id, f->id_len, td_auth_msg_key(&f->msg, key) ? key : NULL, m->admin);
      break;
    }
    default:
      rtr_client_error(r, f->id, f->id_len, "", TANDEM__ERROR_CODE__ERROR_MALFORMED, "message without a body");
      break;
  }
  if (m) tandem__client_message__free_unpacked(m, NULL);
  td_wire_frame_free(f);
}

static void on_client_message(td_router *r) {
  td_wire_frame f;
  td_status s = td_wire_recv(r->csock, true, false, &f);
  if (s != TD_ERR_NOT_FOUND) client_frame(r, &f, s);
}

static bool readable(void *sock) {
  int ev = 0;
  size_t l = sizeof ev;
  zmq_getsockopt(sock, ZMQ_EVENTS, &ev, &l);
  return ev & ZMQ_POLLIN;
}

/* A burst at most a wake-up, so that one busy socket cannot starve the
 * other or the timers. */
static void on_worker_socket(td_loop *l, void *ctx) {
  (void)l;
  td_router *r = ctx;
  for (int k = 0; k < TD_ROUTER_WORKER_BURST && readable(r->wsock); k++) on_worker_message(r);
}

/* Requests are placed before the loop sleeps: a burst of them handled in
 * one wake-up (256 Whisper requests take the router ~250 ms) would reach
 * no worker until the last had arrived, so a wake-up takes client messages
 * for TD_ROUTER_CLIENT_BURST_US at most. */
static void on_client_socket(td_loop *l, void *ctx) {
  (void)l;
  td_router *r = ctx;
  int64_t end = td_now_ns() + TD_ROUTER_CLIENT_BURST_US * 1000LL;
  for (int k = 0; k < TD_ROUTER_CLIENT_BURST && readable(r->csock); k++) {
    on_client_message(r);
    if (td_now_ns() >= end) break;
  }
}

/* A link closed (its peer left, or broke the framing): a worker on it is
 * gone at once, without waiting for its heartbeats to stop. */
static void link_close(td_router *r, rtr_link *k, const char *why) {
  td_loop_remove(r->loop, k->ev);
  if (!k->client) {
    worker *w = rtr_find_route(r, k->id, sizeof k->id);
    if (w) {
      char reason[300];
      snprintf(reason, sizeof reason, "its local link closed (%s)", why);
      rtr_worker_gone(r, w, reason);
    }
  }
  for (int i = 0; i < r->n_links; i++)
    if (r->links[i] == k) {
      r->links[i] = r->links[--r->n_links];
      break;
    }
  td_link_destroy(k->k);
  free(k);
}

/* A burst at most a wake-up, as on the sockets; frames left in the link's
 * buffer keep its event pending (the descriptor will not wake us for them). */
static void link_readable(td_loop *l, void *ctx) {
  rtr_link *k = ctx;
  td_router *r = k->r;
  int64_t end = td_now_ns() + TD_ROUTER_CLIENT_BURST_US * 1000LL;
  for (int n = 0; n < (k->client ? TD_ROUTER_CLIENT_BURST : TD_ROUTER_WORKER_BURST); n++) {
    td_wire_frame f;
    td_status s = td_link_recv(k->k, &f);
    if (s == TD_ERR_NOT_FOUND) break;
    if (td_link_broken(k->k)) {
      td_wire_frame_free(&f);
      if (s == TD_ERR_FORMAT) TD_WARN("router: %s %s", k->client ? "client" : "worker", td_errmsg());
      link_close(r, k, s == TD_ERR_FORMAT ? "a malformed frame" : "its peer left");
      return;
    }
    memcpy(f.id, k->id, sizeof k->id);
    f.id_len = sizeof k->id;
    if (k->client) {
      client_frame(r, &f, s);
      if (td_now_ns() >= end) break;
    } else {
      worker_frame(r, &f, s);
    }
  }
  td_loop_set_pending(l, k->ev, td_link_pending(k->k));
}

static void link_accept(td_loop *l, td_router *r, td_link_server *srv, bool client) {
  for (;;) {
    td_link *lk;
    td_status s = td_link_accept(srv, &lk);
    if (s == TD_ERR_NOT_FOUND) return;
    if (s != TD_OK) {
      TD_WARN("router: %s", td_errmsg());
      if (s == TD_ERR_PEER) continue; /* another user's connection, closed */
      return;
    }
    rtr_link *k = calloc(1, sizeof *k);
    if (k && r->n_links == r->cap_links) {
      int cap = r->cap_links ? 2 * r->cap_links : 16;
      rtr_link **v = realloc(r->links, sizeof *v * (size_t)cap);
      if (v) r->links = v, r->cap_links = cap;
    }
    if (!k || r->n_links == r->cap_links || td_loop_add_fd(l, td_link_fd(lk), link_readable, k, &k->ev) != TD_OK) {
      TD_WARN("router: a local link refused: out of memory");
      td_link_destroy(lk);
      free(k);
      return;
    }
    k->r = r;
    k->k = lk;
    k->client = client;
    k->id[0] = LINK_ID0;
    uint64_t serial = ++r->next_link;
    memcpy(k->id + 1, &serial, sizeof serial);
    r->links[r->n_links++] = k;
  }
}

static void on_client_link(td_loop *l, void *ctx) {
  td_router *r = ctx;
  link_accept(l, r, r->clink_srv, true);
}

static void on_worker_link(td_loop *l, void *ctx) {
  td_router *r = ctx;
  link_accept(l, r, r->wlink_srv, false);
}

static int stop_tick(td_loop *l, void *ctx) {
  td_router *r = ctx;
  if (*r->stop) td_loop_stop(l);
  return TD_ROUTER_TICK_MS;
}

/* ------------------------------------------------------------ lifecycle */

static void apply_defaults(td_router_opts *o) {
  if (!o->client_endpoint) o->client_endpoint = TD_DEFAULT_CLIENT_ENDPOINT;
  if (!o->worker_endpoint) o->worker_endpoint = TD_DEFAULT_WORKER_ENDPOINT;
  if (o->heartbeat_ms <= 0) o->heartbeat_ms = TD_DEFAULT_HEARTBEAT_MS;
  if (o->dead_after <= 0) o->dead_after = TD_DEFAULT_DEAD_AFTER;
  if (o->max_queue <= 0) o->max_queue = TD_DEFAULT_MAX_QUEUE;
  if (o->max_in_flight <= 0) o->max_in_flight = TD_DEFAULT_MAX_IN_FLIGHT;
  if (o->default_timeout_ms <= 0) o->default_timeout_ms = TD_DEFAULT_REQUEST_TIMEOUT_MS;
  if (o->stage_timeout_ms <= 0) o->stage_timeout_ms = TD_DEFAULT_STAGE_TIMEOUT_MS;
  if (o->max_attempts <= 0) o->max_attempts = TD_DEFAULT_MAX_ATTEMPTS;
  if (o->prefill_threshold <= 0) o->prefill_threshold = TD_DEFAULT_PREFILL_THRESHOLD;
  if (o->encode_runs <= 0) o->encode_runs = TD_DEFAULT_ENCODE_RUNS;
  if (o->io_threads <= 0) o->io_threads = TD_DEFAULT_ROUTER_IO_THREADS;
  if (o->local_encode_pct <= 0) o->local_encode_pct = TD_DEFAULT_LOCAL_ENCODE_PCT;
  if (o->capacity_wait_ms <= 0) o->capacity_wait_ms = TD_DEFAULT_CAPACITY_WAIT_MS;
  if (o->max_held_bytes <= 0) o->max_held_bytes = TD_DEFAULT_MAX_HELD_BYTES;
  if (!o->probe_timeout_ms) o->probe_timeout_ms = TD_DEFAULT_PROBE_TIMEOUT_MS;
}

static td_status bind_socket(td_router *r, void **sock, const char *endpoint, const char *what, bool handover,
                             int64_t max_msg, const char *domain) {
  *sock = zmq_socket(r->ctx, ZMQ_ROUTER);
  if (!*sock) return td_err(TD_ERR_NETWORK, "zmq: %s", zmq_strerror(zmq_errno()));
  td_wire_setup_socket(*sock);
  TD_TRY(td_auth_server(r->o.auth, *sock, domain));
  TD_TRY(td_zap_watch(r->zap, *sock, what));
  td_auth_warn_open(r->o.auth, endpoint, what);
  zmq_setsockopt(*sock, ZMQ_MAXMSGSIZE, &max_msg, sizeof max_msg);
  int on = handover;
  if (handover) zmq_setsockopt(*sock, ZMQ_ROUTER_HANDOVER, &on, sizeof on);
  if (zmq_bind(*sock, endpoint) != 0)
    return td_err(TD_ERR_NETWORK, "cannot bind the %s endpoint %s: %s", what, endpoint, zmq_strerror(zmq_errno()));
  return TD_OK;
}

/* The endpoint a bound socket is dialled at: --advertise's address at the port bound. */
static td_status advertised(td_router *r, void *sock, char *out, size_t cap) {
  char bound[256];
  size_t bl = sizeof bound;
  if (zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, bound, &bl) != 0)
    return td_err(TD_ERR_NETWORK, "zmq: %s", zmq_strerror(zmq_errno()));
  return td_net_advertised(bound, r->o.advertise, out, cap);
}

td_status td_router_create(const td_router_opts *opts, td_router **out) {
  *out = NULL;
  if (opts->advertise) TD_TRY(td_net_check_advertise(opts->advertise));
  if (opts->max_attempts > TD_ROUTER_MAX_ATTEMPTS)
    return td_err(TD_ERR_INVALID, "max_attempts %d exceeds %d (an attempt is numbered in a byte)", opts->max_attempts,
                  TD_ROUTER_MAX_ATTEMPTS);
  if (opts->spin_us < 0 || opts->spin_us > TD_MAX_SPIN_US)
    return td_err(TD_ERR_INVALID, "spin_us %d is outside 0 to %d", opts->spin_us, TD_MAX_SPIN_US);
  if (opts->io_threads < 0 || opts->io_threads > TD_ROUTER_MAX_IO_THREADS)
    return td_err(TD_ERR_INVALID, "io_threads %d is outside 1 to %d", opts->io_threads, TD_ROUTER_MAX_IO_THREADS);
  if (opts->encode_runs < 0 || opts->encode_runs > TD_ROUTER_MAX_ENCODE_RUNS)
    return td_err(TD_ERR_INVALID, "encode_runs %d is outside 1 to %d", opts->encode_runs, TD_ROUTER_MAX_ENCODE_RUNS);
  if (opts->kv_load_failure != TD_KV_LOAD_RECOMPUTE && opts->kv_load_failure != TD_KV_LOAD_FAIL)
    return td_err(TD_ERR_INVALID, "kv_load_failure %d: recompute or fail", (int)opts->kv_load_failure);
  if (opts->local_encode_pct < 0 || opts->local_encode_pct > 100)
    return td_err(TD_ERR_INVALID, "local_encode_pct %d is outside 1 to 100", opts->local_encode_pct);
  if (!(opts->local_encode_margin >= 0 && opts->local_encode_margin <= TD_ROUTER_MAX_ENCODE_RUNS))
    return td_err(TD_ERR_INVALID, "local_encode_margin %g is outside 0 to %d runs", opts->local_encode_margin,
                  TD_ROUTER_MAX_ENCODE_RUNS);
  td_router *r = calloc(1, sizeof *r);
  if (!r) return td_err(TD_ERR_NOMEM, "out of memory");
  r->o = *opts;
  r->probe_fd = -1;
  apply_defaults(&r->o);
  r->place_opts = (td_place_opts){.prefill_threshold = r->o.prefill_threshold, .encode_runs = r->o.encode_runs,
                                  .local_encode_pct = r->o.local_encode_pct,
                                  .local_encode_margin = r->o.local_encode_margin};
  r->model = (Tandem__ModelInfo)TANDEM__MODEL_INFO__INIT;
  r->next_serial = 1;
  r->own_ctx = !opts->zmq_ctx;
  r->ctx = r->own_ctx ? zmq_ctx_new() : opts->zmq_ctx;
  td_status s = r->ctx ? TD_OK : td_err(TD_ERR_NETWORK, "zmq: %s", zmq_strerror(zmq_errno()));
  /* before any socket: libzmq starts its I/O threads with the first */
  if (s == TD_OK && r->own_ctx && zmq_ctx_set(r->ctx, ZMQ_IO_THREADS, r->o.io_threads) != 0)
    s = td_err(TD_ERR_NETWORK, "zmq io threads %d: %s", r->o.io_threads, zmq_strerror(zmq_errno()));
  /* a request's largest part is its audio: a larger message drops the
   * client's connection before libzmq buffers it (tcp; inproc has no limit) */
  /* the ZAP handler answers the context's CURVE handshakes: it runs before a socket binds */
  if (s == TD_OK) s = td_zap_create(r->o.auth, r->ctx, &r->zap);
  if (s == TD_OK)
    s = bind_socket(r, &r->csock, r->o.client_endpoint, "client", false, TD_CLIENT_MAX_MSG_BYTES,
                    TD_AUTH_DOMAIN_CLIENTS);
  /* no ROUTER_HANDOVER: a second connection under a live identity made
   * libzmq abort under load (stream_engine_base.cpp !_io_error); workers
   * connect under identities never reused (td_wire_set_unique_route) and
   * a duplicate worker id is the registration's to refuse */
  if (s == TD_OK) s = bind_socket(r, &r->wsock, r->o.worker_endpoint, "worker", false, TD_WIRE_MAX_MSG, TD_AUTH_DOMAIN_WORKERS);
  if (s == TD_OK && (r->o.client_socket || r->o.worker_socket) && r->o.auth)
    s = td_err(TD_ERR_INVALID, "local links have no CURVE: not with keys (their socket file's owner is their only "
               "peer; use the endpoints)");
  if (s == TD_OK && r->o.client_socket) s = td_link_listen(r->o.client_socket, &r->clink_srv);
  if (s == TD_OK && r->o.worker_socket) s = td_link_listen(r->o.worker_socket, &r->wlink_srv);
  if (s == TD_OK) s = advertised(r, r->csock, r->client_adv, sizeof r->client_adv);
  if (s == TD_OK) s = advertised(r, r->wsock, r->worker_adv, sizeof r->worker_adv);
  r->probe_fd = epoll_create1(EPOLL_CLOEXEC);
  if (s == TD_OK && r->probe_fd < 0) s = td_err(TD_ERR_IO, "epoll_create1: %s", strerror(errno));
  if (s == TD_OK) s = rtr_metrics_create(r);
  if (s != TD_OK) {
    td_router_destroy(r);
    return s;
  }
  *out = r;
  return TD_OK;
}

void td_router_destroy(td_router *r) {
  if (!r) return;
  rtr_metrics_destroy(r); /* the server's thread stops first */
  rreq *q, *t;
  HASH_ITER(hh, r->by_rid, q, t) rtr_req_free(r, q);
  rtr_probes_free(r);
  for (int i = 0; i < r->parked.n; i++) {
    rtr_parked *p = r->parked.v[i];
    rtr_client_msg_free(p->msg, &p->feat);
    free(p);
  }
  td_ptrvec_free(&r->parked);
  rtr_workers_free(r);
  rtr_id_keys_free(r);
  rtr_groups_free(r);
  td_ptrvec_free(&r->queue);
  free(r->outbox); /* empty between messages */
  free(r->model_type);
  free(r->model_name);
  for (int i = 0; i < r->n_links; i++) {
    td_link_destroy(r->links[i]->k);
    free(r->links[i]);
  }
  free(r->links);
  td_link_server_destroy(r->clink_srv);
  td_link_server_destroy(r->wlink_srv);
  if (r->csock) zmq_close(r->csock);
  if (r->wsock) zmq_close(r->wsock);
  td_zap_destroy(r->zap);
  if (r->own_ctx && r->ctx) zmq_ctx_term(r->ctx);
  free(r);
}

/* Tells clients and workers that the router stops. */
static void shut_down(td_router *r) {
  rreq *q, *t;
  HASH_ITER(hh, r->by_rid, q, t) {
    rtr_req_fail(r, q, TANDEM__ERROR_CODE__ERROR_UNAVAILABLE, "the router is shutting down");
  }
  rtr_parked_fail(r, "the router is shutting down");
  Tandem__Cluster__Shutdown sd = TANDEM__CLUSTER__SHUTDOWN__INIT;
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_SHUTDOWN;
  m.shutdown = &sd;
  worker *w, *wt;
  HASH_ITER(hh, r->workers, w, wt) { (void)rtr_send_worker(r, w, &m); }
  for (int i = 0; i < r->n_links; i++) (void)td_link_flush(r->links[i]->k); /* what the sockets take now */
}

int td_router_metrics_port(const td_router *r) { return rtr_metrics_port(r); }
const char *td_router_client_endpoint(const td_router *r) { return r->client_adv; }
const char *td_router_worker_endpoint(const td_router *r) { return r->worker_adv; }

td_status td_router_run(td_router *r, volatile sig_atomic_t *stop) {
  TD_INFO("router serving clients on %s, workers on %s; cross pool mode %s", r->client_adv, r->worker_adv,
          td_cross_mode_name(r->o.cross_mode));
  if (r->clink_srv || r->wlink_srv)
    TD_INFO("router local links: clients at %s%s, workers at %s%s", r->clink_srv ? TD_LINK_PREFIX : "",
            r->o.client_socket ? r->o.client_socket : "(none)", r->wlink_srv ? TD_LINK_PREFIX : "",
            r->o.worker_socket ? r->o.worker_socket : "(none)");
  if (r->o.advertise)
    TD_INFO("router bound %s and %s, advertised at %s", r->o.client_endpoint, r->o.worker_endpoint, r->o.advertise);
  td_loop *l;
  TD_TRY(td_loop_create(TD_ROUTER_TICK_MS, &l));
  r->stop = stop;
  /* workers first: their news frees capacity for new requests */
  r->loop = l;
  td_status s = td_loop_add_socket(l, r->wsock, on_worker_socket, r, NULL);
  if (s == TD_OK && r->wlink_srv) s = td_loop_add_fd(l, td_link_server_fd(r->wlink_srv), on_worker_link, r, NULL);
  if (s == TD_OK && r->clink_srv) s = td_loop_add_fd(l, td_link_server_fd(r->clink_srv), on_client_link, r, NULL);
  if (s == TD_OK) s = td_loop_add_socket(l, r->csock, on_client_socket, r, NULL);
  if (s == TD_OK) s = td_loop_add_timer(l, 0, rtr_heartbeat_tick, r, NULL);
  if (s == TD_OK) s = td_loop_add_timer(l, TD_ROUTER_TICK_MS, rtr_requests_tick, r, NULL);
  if (s == TD_OK) s = td_loop_add_timer(l, TD_ROUTER_TICK_MS, rtr_groups_tick, r, NULL);
  if (s == TD_OK) s = td_loop_add_timer(l, 0, stop_tick, r, NULL);
  if (s == TD_OK) s = td_loop_add_fd(l, r->probe_fd, rtr_probes_ready, r, NULL);
  if (s == TD_OK) s = td_loop_add_timer(l, TD_ROUTER_TICK_MS, rtr_probes_tick, r, NULL);
  if (s == TD_OK && rtr_metrics_port(r)) s = td_loop_add_timer(l, 0, rtr_metrics_tick, r, NULL);
  td_loop_set_before_sleep(l, rtr_place_queue, r);
  td_loop_set_spin(l, r->o.spin_us);
  if (s == TD_OK) s = td_loop_run(l);
  shut_down(r);
  for (int i = 0; i < r->n_links; i++) td_loop_remove(l, r->links[i]->ev);
  r->loop = NULL;
  td_loop_destroy(l);
  TD_INFO("router stopped");
  return s;
}
