#include "client/client.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <uthash.h>

#include "common/clock.h"
#include "common/defaults.h"
#include "common/log.h"
#include "proto/check.h"
#include "proto/link.h"
#include "proto/wire.h"

#define GRACE_MS 5000
#define DEFAULT_TIMEOUT_MS 600000 /* when the caller gives none: never wait forever */

typedef struct pending {
  char *id;
  int64_t deadline_ms; /* monotonic; 0 = none */
  int64_t sent_ms;
  uint64_t conn;       /* the connection it went out on (0: none was up; it waits in the socket for one) */
  bool lost;           /* that connection was lost: its answer cannot come */
  UT_hash_handle hh;
} pending;

/* The router connection's events (tcp and ipc; inproc has none): a request
 * is answered on the connection it went out on, since the router routes
 * by connection and a restarted router knows nothing of it. */
struct td_client {
  void *ctx, *sock; /* sock: NULL over a local link */
  td_link *link;    /* the router's local link (local:PATH), while connected */
  void *mon;        /* PAIR: the socket's handshakes and disconnections (NULL: inproc, not watched) */
  char endpoint[256];
  bool up;          /* a connection is up (its handshake done) */
  uint64_t conn;    /* connections made so far */
  pending *pend;
  td_client_health health;
  bool have_health;
  /* the admin request waiting for its answer */
  char admin_id[32];
  uint64_t admin_serial;
  td_admin_reply *admin_out;
  bool have_admin;
};

td_status td_client_connect(const char *endpoint, td_client **out) { return td_client_connect_auth(endpoint, NULL, out); }

td_status td_client_connect_auth(const char *endpoint, const td_auth *auth, td_client **out) {
  *out = NULL;
  td_client *c = calloc(1, sizeof *c);
  if (!c) return td_err(TD_ERR_NOMEM, "out of memory");
  if (td_link_path(endpoint)) { /* connected when a request goes out */
    snprintf(c->endpoint, sizeof c->endpoint, "%s", endpoint);
    if (auth) {
      td_client_close(c);
      return td_err(TD_ERR_INVALID, "%s: a local link has no CURVE (not with keys)", endpoint);
    }
    *out = c;
    return TD_OK;
  }
  c->ctx = zmq_ctx_new();
  c->sock = c->ctx ? zmq_socket(c->ctx, ZMQ_DEALER) : NULL;
  if (!c->sock) {
    td_client_close(c);
    return td_err(TD_ERR_NETWORK, "zmq: %s", zmq_strerror(zmq_errno()));
  }
  td_wire_setup_socket(c->sock);
  td_status as = td_auth_client(auth, c->sock, NULL);
  if (as != TD_OK) {
    td_client_close(c);
    return as;
  }
  snprintf(c->endpoint, sizeof c->endpoint, "%s", endpoint);
  if (strncmp(endpoint, "inproc://", 9)) {
    char mep[64];
    snprintf(mep, sizeof mep, "inproc://td-client-monitor-%p", (void *)c);
    if (zmq_socket_monitor(c->sock, mep, ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_DISCONNECTED) != 0 ||
        !(c->mon = zmq_socket(c->ctx, ZMQ_PAIR)) || zmq_connect(c->mon, mep) != 0) {
      td_status s = td_err(TD_ERR_NETWORK, "zmq monitor: %s", zmq_strerror(zmq_errno()));
      td_client_close(c);
      return s;
    }
  }
  if (zmq_connect(c->sock, endpoint) != 0) {
    td_status s = td_err(TD_ERR_INVALID, "cannot connect to %s: %s", endpoint, zmq_strerror(zmq_errno()));
    td_client_close(c);
    return s;
  }
  *out = c;
  return TD_OK;
}

/* The local link's end: what went out on it cannot be answered. */
static void link_lost(td_client *c) {
  td_link_destroy(c->link);
  c->link = NULL;
  c->up = false;
  for (pending *p = c->pend; p; p = p->hh.next)
    if (p->conn == c->conn) p->lost = true;
  TD_WARN("client: the connection to the router at %s was lost", c->endpoint);
}

static td_status link_up(td_client *c) {
  if (c->link) return TD_OK;
  TD_TRY(td_link_connect(td_link_path(c->endpoint), &c->link));
  c->up = true;
  c->conn++;
  return TD_OK;
}

/* Writes what the socket did not take at once: a client has no loop to come back in. */
static td_status link_send(td_client *c, Tandem__ClientMessage *m, zmq_msg_t *extra) {
  td_status s = link_up(c);
  if (s != TD_OK) return td_err(TD_ERR_NETWORK, "router unreachable: %s", td_errmsg());
  s = td_link_send(c->link, &m->base, extra);
  while (s == TD_OK && td_link_wants_write(c->link)) {
    zmq_pollitem_t it = {.fd = td_link_fd(c->link), .events = ZMQ_POLLOUT};
    if (zmq_poll(&it, 1, TD_CLIENT_ROUTER_WAIT_MS) <= 0) {
      s = td_err(TD_ERR_NETWORK, "router unreachable: it took nothing for %d ms", TD_CLIENT_ROUTER_WAIT_MS);
      break;
    }
    s = td_link_flush(c->link);
  }
  if (s != TD_OK && td_link_broken(c->link)) link_lost(c);
  return s;
}

/* Takes the connection events that came: a lost connection marks the
 * requests that went out on it lost (reported by the next poll); a new one
 * takes the requests that waited in the socket for it. */
static void take_events(td_client *c) {
  if (!c->mon) return;
  for (;;) {
    zmq_msg_t head, addr;
    zmq_msg_init(&head);
    if (zmq_msg_recv(&head, c->mon, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&head);
      return;
    }
    uint16_t event = 0;
    if (zmq_msg_size(&head) >= sizeof event) memcpy(&event, zmq_msg_data(&head), sizeof event);
    bool more = zmq_msg_more(&head);
    zmq_msg_close(&head);
    if (more) { /* the endpoint's address */
      zmq_msg_init(&addr);
      (void)zmq_msg_recv(&addr, c->mon, 0);
      zmq_msg_close(&addr);
    }
    pending *p, *t;
    if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
      c->up = true;
      c->conn++;
      HASH_ITER(hh, c->pend, p, t) if (!p->conn) p->conn = c->conn;
    } else if (event == ZMQ_EVENT_DISCONNECTED && c->up) {
      c->up = false;
      HASH_ITER(hh, c->pend, p, t) if (p->conn == c->conn) p->lost = true;
      TD_WARN("client: the connection to the router at %s was lost", c->endpoint);
    }
  }
}

static td_status send_client(td_client *c, Tandem__ClientMessage *m);

/* A ListModels probe until any answer comes: a DEALER queues nothing
 * while it has no connection, so the probe is sent again until one is made. */
td_status td_client_connect_wait(const char *endpoint, int timeout_ms, td_client **out) {
  return td_client_connect_wait_auth(endpoint, NULL, timeout_ms, out);
}

td_status td_client_connect_wait_keys(const char *endpoint, const td_auth_opts *keys, int timeout_ms, td_client **out) {
  td_auth *auth = NULL;
  *out = NULL;
  TD_TRY(td_auth_create_client(keys, &auth));
  td_status s = td_client_connect_wait_auth(endpoint, auth, timeout_ms, out);
  td_auth_destroy(auth); /* the socket holds its keys */
  return s;
}

td_status td_client_connect_wait_auth(const char *endpoint, const td_auth *auth, int timeout_ms, td_client **out) {
  TD_TRY(td_client_connect_auth(endpoint, auth, out));
  td_client *c = *out;
  Tandem__ListModelsRequest lr = TANDEM__LIST_MODELS_REQUEST__INIT;
  Tandem__ClientMessage m = TANDEM__CLIENT_MESSAGE__INIT;
  m.body_case = TANDEM__CLIENT_MESSAGE__BODY_LIST_MODELS;
  m.list_models = &lr;
  bool sent = false;
  for (int64_t end = td_now_ms() + timeout_ms, left; (left = end - td_now_ms()) > 0;) {
    if (!sent) sent = send_client(c, &m) == TD_OK;
    if (!c->sock) { /* a local link: connected and asked, or not yet served */
      if (!sent) {
        (void)zmq_poll(NULL, 0, left < 20 ? (long)left : 20); /* a sleep */
        continue;
      }
      zmq_pollitem_t it = {.fd = td_link_fd(c->link), .events = ZMQ_POLLIN};
      if (zmq_poll(&it, 1, left) <= 0) continue;
      td_wire_frame f;
      td_status s = td_link_recv(c->link, &f);
      td_wire_frame_free(&f);
      if (s == TD_OK) return TD_OK; /* any answer: a router is there */
      if (td_link_broken(c->link)) {
        link_lost(c);
        sent = false;
      }
      continue;
    }
    zmq_pollitem_t it = {.socket = c->sock, .events = ZMQ_POLLIN};
    if (zmq_poll(&it, 1, sent ? left : (left < 20 ? left : 20)) > 0) {
      td_wire_frame f;
      if (td_wire_recv(c->sock, false, false, &f) == TD_OK) {
        td_wire_frame_free(&f); /* any answer: a router is there */
        return TD_OK;
      }
    }
  }
  td_client_close(c);
  *out = NULL;
  return td_err(TD_ERR_PEER, "no router answers at %s within %d ms", endpoint, timeout_ms);
}

void td_client_close(td_client *c) {
  if (!c) return;
  pending *p, *t;
  HASH_ITER(hh, c->pend, p, t) {
    HASH_DEL(c->pend, p);
    free(p->id);
    free(p);
  }
  td_link_destroy(c->link);
  if (c->sock) zmq_socket_monitor(c->sock, NULL, 0);
  if (c->mon) zmq_close(c->mon);
  if (c->sock) zmq_close(c->sock);
  if (c->ctx) zmq_ctx_term(c->ctx);
  free(c);
}

int td_client_pending(const td_client *c) { return (int)HASH_COUNT(c->pend); }

/* extra: a second frame (the features' values; NULL: none), which the router forwards by reference */
static td_status send_client_extra(td_client *c, Tandem__ClientMessage *m, zmq_msg_t *extra) {
  m->version = TD_PROTOCOL_VERSION;
  /* the router's socket would drop the connection without a word */
  size_t n = protobuf_c_message_get_packed_size(&m->base), x = extra ? zmq_msg_size(extra) : 0;
  if (n > TD_CLIENT_MAX_MSG_BYTES || x > TD_CLIENT_MAX_MSG_BYTES)
    return td_err(TD_ERR_INVALID, "the request's message has %zu bytes; a router takes at most %u "
                  "(TD_CLIENT_MAX_MSG_BYTES)", n > x ? n : x, (unsigned)TD_CLIENT_MAX_MSG_BYTES);
  return c->sock ? td_wire_send_extra(c->sock, NULL, 0, &m->base, extra) : link_send(c, m, extra);
}

static td_status send_client(td_client *c, Tandem__ClientMessage *m) { return send_client_extra(c, m, NULL); }

td_status td_client_generate(td_client *c, const td_json_request *r, bool stream, uint32_t timeout_ms) {
  pending *p = NULL;
  HASH_FIND_STR(c->pend, r->id, p);
  if (p) return td_err(TD_ERR_INVALID, "request %s is already in flight", r->id);
  const td_request_params *q = &r->params;
  Tandem__SamplingParams sp = TANDEM__SAMPLING_PARAMS__INIT;
  sp.temperature = q->temperature;
  sp.top_k = q->top_k;
  sp.top_p = q->top_p;
  sp.seed = q->seed;
  sp.has_seed = q->has_seed;
  sp.n = (uint32_t)q->n;
  sp.num_beams = (uint32_t)q->num_beams;
  sp.num_return_sequences = (uint32_t)q->num_return_sequences;
  sp.length_penalty = q->length_penalty;
  sp.has_length_penalty = true;
  sp.early_stopping = q->early_stopping;
  sp.ignore_eos = q->ignore_eos;
  sp.logprobs = q->logprobs;
  sp.set_forced_bos = q->forced_bos != -2;
  sp.forced_bos_token_id = q->forced_bos;
  sp.set_forced_eos = q->forced_eos != -2;
  sp.forced_eos_token_id = q->forced_eos;
  sp.timestamp_begin = q->timestamp_begin;
  sp.has_max_initial_timestamp = q->timestamp_begin > 0 && q->max_initial_timestamp >= 0;
  sp.max_initial_timestamp_index = sp.has_max_initial_timestamp ? q->max_initial_timestamp : 0;
  sp.allowed_token_ids = q->n_allowed > 0 ? (int32_t *)q->allowed_ids : NULL;
  sp.n_allowed_token_ids = q->n_allowed > 0 ? (size_t)q->n_allowed : 0;
  sp.probe = q->probe;
  sp.probe_token_id = q->probe_token;
  sp.probe_position = q->probe && q->probe_position > 0 ? (uint32_t)q->probe_position : 0;
  Tandem__AudioFeatures af = TANDEM__AUDIO_FEATURES__INIT;
  Tandem__GenerateRequest g = TANDEM__GENERATE_REQUEST__INIT;
  g.request_id = (char *)r->id;
  g.input_ids = r->input_ids;
  g.n_input_ids = (size_t)r->n_input;
  zmq_msg_t feat;
  zmq_msg_init(&feat);
  if (r->features) { /* in a frame of their own: the router passes it on without parsing or copying it */
    zmq_msg_close(&feat);
    if (zmq_msg_init_size(&feat, sizeof(float) * r->n_features) != 0)
      return td_err(TD_ERR_NOMEM, "out of memory for %zu audio feature values", r->n_features);
    memcpy(zmq_msg_data(&feat), r->features, sizeof(float) * r->n_features);
    af.values_in_frame = true;
    g.features = &af;
  }
  g.decoder_prompt = r->prompt;
  g.n_decoder_prompt = (size_t)r->n_prompt;
  g.sampling = &sp;
  g.max_new_tokens = q->max_new_tokens > 0 ? (uint32_t)q->max_new_tokens : 0;
  g.stop_token_ids = r->stop_ids;
  g.n_stop_token_ids = (size_t)r->n_stop_ids;
  g.timeout_ms = timeout_ms;
  g.stream = stream;
  if (r->text) g.text = r->text;
  if (r->audio) {
    g.audio.data = r->audio;
    g.audio.len = r->audio_len;
  }
  g.language = (char *)r->language;
  g.task = (char *)r->task;
  g.timestamps = r->timestamps;
  Tandem__ClientMessage m = TANDEM__CLIENT_MESSAGE__INIT;
  m.body_case = TANDEM__CLIENT_MESSAGE__BODY_GENERATE;
  m.generate = &g;
  take_events(c); /* which connection it goes out on, as of now */
  td_status s = send_client_extra(c, &m, r->features ? &feat : NULL);
  zmq_msg_close(&feat);
  TD_TRY(s);
  p = calloc(1, sizeof *p);
  if (!p || !(p->id = strdup(r->id))) {
    free(p);
    return td_err(TD_ERR_NOMEM, "out of memory");
  }
  p->sent_ms = td_now_ms();
  p->conn = c->up ? c->conn : 0;
  p->deadline_ms = p->sent_ms + (timeout_ms ? timeout_ms : DEFAULT_TIMEOUT_MS) + GRACE_MS;
  HASH_ADD_KEYPTR(hh, c->pend, p->id, strlen(p->id), p);
  return TD_OK;
}

td_status td_client_cancel(td_client *c, const char *id) {
  Tandem__CancelRequest cr = TANDEM__CANCEL_REQUEST__INIT;
  cr.request_id = (char *)id;
  Tandem__ClientMessage m = TANDEM__CLIENT_MESSAGE__INIT;
  m.body_case = TANDEM__CLIENT_MESSAGE__BODY_CANCEL;
  m.cancel = &cr;
  return send_client(c, &m);
}

static void finish(td_client *c, const char *id, const td_client_events *ev, const td_client_result *r) {
  pending *p = NULL;
  HASH_FIND_STR(c->pend, id, p);
  if (!p) return; /* late or unknown: already reported */
  HASH_DEL(c->pend, p);
  if (ev && ev->on_result) ev->on_result(ev->ctx, r);
  free(p->id);
  free(p);
}

static void fail(td_client *c, const char *id, const td_client_events *ev, td_status s, const char *msg) {
  td_client_result r = {.id = id, .status = s, .error = msg};
  finish(c, id, ev, &r);
}

static td_finish finish_of(Tandem__FinishReason f) {
  switch (f) {
    case TANDEM__FINISH_REASON__FINISH_STOP: return TD_FINISH_STOP;
    case TANDEM__FINISH_REASON__FINISH_LENGTH: return TD_FINISH_LENGTH;
    case TANDEM__FINISH_REASON__FINISH_CANCELLED: return TD_FINISH_CANCELLED;
    case TANDEM__FINISH_REASON__FINISH_ERROR: return TD_FINISH_ERROR;
    default: return TD_FINISH_NONE;
  }
}

static void chunk(const char *id, const Tandem__TokenChunk *t, const td_client_events *ev) {
  if (ev && ev->on_text && t->has_text && t->text) ev->on_text(ev->ctx, id, (int)t->sequence, (int)t->offset, t->text);
  if (ev && ev->on_tokens)
    ev->on_tokens(ev->ctx, id, (int)t->sequence, (int)t->offset, t->tokens, t->n_logprobs ? t->logprobs : NULL,
                  (int)t->n_tokens);
}

static const char *error_code_name(Tandem__ErrorCode c) {
  switch (c) {
    case TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT: return "invalid_argument";
    case TANDEM__ERROR_CODE__ERROR_OVERLOADED: return "overloaded";
    case TANDEM__ERROR_CODE__ERROR_TIMEOUT: return "timeout";
    case TANDEM__ERROR_CODE__ERROR_CANCELLED: return "cancelled";
    case TANDEM__ERROR_CODE__ERROR_UNAVAILABLE: return "unavailable";
    case TANDEM__ERROR_CODE__ERROR_VERSION: return "version";
    case TANDEM__ERROR_CODE__ERROR_NOT_FOUND: return "not_found";
    case TANDEM__ERROR_CODE__ERROR_MALFORMED: return "malformed";
    case TANDEM__ERROR_CODE__ERROR_FAILED_PRECONDITION: return "failed_precondition";
    case TANDEM__ERROR_CODE__ERROR_PERMISSION_DENIED: return "permission_denied";
    default: return "internal";
  }
}

static void health_of(const Tandem__HealthResponse *x0, td_client_health *hh) {
  *hh = (td_client_health){.serving = x0->serving, .encoders = (int)x0->encoders, .prefills = (int)x0->prefills,
                           .decoders = (int)x0->decoders, .in_flight = (int)x0->in_flight, .queued = (int)x0->queued};
  snprintf(hh->cross_mode, sizeof hh->cross_mode, "%s", x0->cross_mode && *x0->cross_mode ? x0->cross_mode : "auto");
  const size_t cap = sizeof hh->workers / sizeof hh->workers[0];
  hh->workers_left_out = x0->n_workers > cap ? (int)(x0->n_workers - cap) : 0;
  for (size_t i = 0; i < x0->n_workers && i < cap; i++) {
    const Tandem__WorkerStatus *x = x0->workers[i];
    td_client_worker *cw = &hh->workers[hh->n_workers++];
    snprintf(cw->id, sizeof cw->id, "%s", x->id ? x->id : "");
    cw->encode = x->encode;
    cw->prefill = x->prefill;
    cw->decode = x->decode;
    cw->draining = x->draining;
    cw->self_blocks = (int)x->self_blocks;
    cw->free_self_blocks = (int)x->free_self_blocks;
    cw->cross_blocks = (int)x->cross_blocks;
    cw->free_cross_blocks = (int)x->free_cross_blocks;
    cw->running = (int)x->running;
    cw->max_running = (int)x->max_running;
    cw->queued = (int)x->queued;
    cw->jobs = (int)x->jobs;
    cw->kv_in_ucx = x->kv_in_ucx;
    cw->kv_in_zmq = x->kv_in_zmq;
    cw->kv_out_ucx = x->kv_out_ucx;
    cw->kv_out_zmq = x->kv_out_zmq;
    cw->kv_out_ipc = x->kv_out_ipc;
    cw->encoded = x->encoded;
    cw->encoder_cache_hits = x->encoder_cache_hits;
    cw->encoder_cache_blocks = (int)x->encoder_cache_blocks;
    cw->kv_pushing = (int)x->kv_pushing;
    cw->kv_refused = x->kv_refused;
    cw->steps = x->steps;
    cw->tokens = x->tokens;
    cw->encode_runs = x->encode_runs;
    cw->busy_seconds = x->busy_seconds;
    cw->idle_seconds = x->idle_seconds;
    cw->project_seconds = x->project_seconds;
    cw->work_began_ms = x->work_began_ms;
    cw->work_ended_ms = x->work_ended_ms;
    snprintf(cw->device, sizeof cw->device, "%s", x->device ? x->device : "");
    snprintf(cw->version, sizeof cw->version, "%s", x->version ? x->version : "");
    snprintf(cw->group, sizeof cw->group, "%s", x->group ? x->group : "");
    cw->pid = x->pid;
    cw->drain_requested = x->drain_requested;
    cw->stopping = x->stopping;
  }
}

static void dispatch(td_client *c, Tandem__ServerMessage *m, const td_client_events *ev) {
  const char *id = m->request_id ? m->request_id : "";
  switch (m->body_case) {
    case TANDEM__SERVER_MESSAGE__BODY_TOKENS: chunk(id, m->tokens, ev); break;
    case TANDEM__SERVER_MESSAGE__BODY_CHUNKS:
      for (size_t i = 0; i < m->chunks->n_items; i++) {
        const Tandem__RequestChunk *it = m->chunks->items[i];
        if (it->chunk) chunk(it->request_id ? it->request_id : "", it->chunk, ev);
      }
      break;
    case TANDEM__SERVER_MESSAGE__BODY_RESULT: {
      Tandem__GenerateResult *g = m->result;
      td_seq_output outs[TD_CLIENT_MAX_OUTPUTS]; /* td_check_server_message bounds n_outputs */
      td_text_segment *segs[TD_CLIENT_MAX_OUTPUTS] = {0};
      static const td_text_segment none[1];
      int n = 0;
      for (size_t i = 0; i < g->n_outputs && n < TD_CLIENT_MAX_OUTPUTS; i++, n++) {
        Tandem__SequenceOutput *o = g->outputs[i];
        outs[n] = (td_seq_output){.tokens = o->tokens, .n_tokens = (int)o->n_tokens,
                                  .logprobs = o->n_logprobs ? o->logprobs : NULL, .score = o->score,
                                  .finish = finish_of(o->finish_reason), .text = o->has_text ? o->text : NULL,
                                  .has_probe = o->has_probe_prob, .probe_prob = o->probe_prob};
        if (o->has_segments && (segs[n] = calloc(o->n_segments + 1, sizeof **segs))) {
          for (size_t k = 0; k < o->n_segments; k++)
            segs[n][k] = (td_text_segment){.start = o->segments[k]->start, .end = o->segments[k]->end,
                                           .text = o->segments[k]->text};
          outs[n].segments = segs[n];
          outs[n].n_segments = (int)o->n_segments;
        } else if (o->has_segments) {
          outs[n].segments = none; /* out of memory: shown as none rather than absent */
        }
      }
      td_client_result r = {.id = id, .status = TD_OK, .n_outputs = n, .outputs = outs};
      const Tandem__Timings *tm = g->timings;
      if (tm)
        r.timings = (td_client_timings){.queue_ms = tm->queue_ms, .reserve_ms = tm->reserve_ms,
                                        .encode_ms = tm->encode_ms, .transfer_ms = tm->transfer_ms,
                                        .prefill_ms = tm->prefill_ms, .first_token_ms = tm->first_token_ms,
                                        .decode_ms = tm->decode_ms, .total_ms = tm->total_ms,
                                        .worker_first_token_ms = tm->worker_first_token_ms,
                                        .attempts = (int)tm->attempts};
      finish(c, id, ev, &r);
      for (int i = 0; i < n; i++) free(segs[i]);
      break;
    }
    case TANDEM__SERVER_MESSAGE__BODY_ERROR:
      if (c->admin_out && !c->have_admin && !strcmp(id, c->admin_id)) {
        td_admin_reply *o = c->admin_out;
        o->status = td_wire_status(m->error->code);
        snprintf(o->code, sizeof o->code, "%s", error_code_name(m->error->code));
        snprintf(o->message, sizeof o->message, "%s", m->error->message ? m->error->message : "error");
        c->have_admin = true;
        break;
      }
      fail(c, id, ev, td_wire_status(m->error->code), m->error->message ? m->error->message : "error");
      break;
    case TANDEM__SERVER_MESSAGE__BODY_HEALTH:
      health_of(m->health, &c->health);
      c->have_health = true;
      break;
    case TANDEM__SERVER_MESSAGE__BODY_ADMIN:
      if (c->admin_out && !c->have_admin && !strcmp(id, c->admin_id)) {
        td_admin_reply *o = c->admin_out;
        o->status = TD_OK;
        snprintf(o->message, sizeof o->message, "%s", m->admin->message ? m->admin->message : "");
        if (m->admin->health) health_of(m->admin->health, &o->health);
        c->have_admin = true;
      }
      break;
    default:
      break;
  }
}

/* A router message that breaks a field's limit: the requests it is about
 * end with the reason, rather than with part of it. */
static void invalid(td_client *c, const Tandem__ServerMessage *m, const td_client_events *ev, const char *why) {
  char msg[400];
  snprintf(msg, sizeof msg, "the router sent an invalid message: %s", why);
  TD_WARN("client: %s", msg);
  if (m->body_case == TANDEM__SERVER_MESSAGE__BODY_CHUNKS) {
    for (size_t i = 0; i < m->chunks->n_items; i++)
      if (m->chunks->items[i]->request_id) fail(c, m->chunks->items[i]->request_id, ev, TD_ERR_FORMAT, msg);
  } else if (m->request_id && m->request_id[0]) {
    fail(c, m->request_id, ev, TD_ERR_FORMAT, msg);
  }
}

/* Ends the requests whose answer cannot come: their connection was lost,
 * no router connection came within TD_CLIENT_ROUTER_WAIT_MS of their
 * sending, or their deadline (plus the grace) passed. Each is cancelled too,
 * in case it still waits in the socket for the next router. */
static void expire(td_client *c, const td_client_events *ev) {
  int64_t now = td_now_ms();
  pending *p, *t;
  HASH_ITER(hh, c->pend, p, t) {
    char msg[400];
    td_status s = TD_ERR_NETWORK;
    if (p->lost)
      snprintf(msg, sizeof msg, "router unreachable: the connection to the router at %s was lost (it stopped, was "
               "killed or restarted) while the request was in flight", c->endpoint);
    else if (c->mon && !p->conn && now - p->sent_ms > TD_CLIENT_ROUTER_WAIT_MS)
      snprintf(msg, sizeof msg, "router unreachable: no connection to the router at %s within %d ms (not running, "
               "or it refused this client's key)", c->endpoint, TD_CLIENT_ROUTER_WAIT_MS);
    else if (p->deadline_ms && now > p->deadline_ms)
      snprintf(msg, sizeof msg, "no answer from the router before the deadline"), s = TD_ERR_TIMEOUT;
    else
      continue;
    char *id = strdup(p->id);
    if (!id) continue;
    (void)td_client_cancel(c, id);
    fail(c, id, ev, s, msg);
    free(id);
  }
}

td_status td_client_poll(td_client *c, int timeout_ms, const td_client_events *ev) {
  return td_client_poll_fd(c, -1, timeout_ms, ev, NULL);
}

td_status td_client_poll_fd(td_client *c, int fd, int timeout_ms, const td_client_events *ev, bool *fd_ready) {
  /* a request already lost ends now, not after the wait */
  take_events(c);
  for (pending *p = c->pend; p; p = p->hh.next)
    if (p->lost) timeout_ms = 0;
  zmq_pollitem_t it[3] = {{.socket = c->sock, .events = ZMQ_POLLIN}, {.socket = c->mon, .events = ZMQ_POLLIN},
                          {.fd = fd, .events = ZMQ_POLLIN}};
  if (!c->sock) it[0] = (zmq_pollitem_t){.fd = c->link ? td_link_fd(c->link) : -1, .events = ZMQ_POLLIN};
  bool buffered = !c->sock && c->link && td_link_pending(c->link); /* frames the last poll left in the link */
  if (buffered) timeout_ms = 0;
  int n_it = 1;
  if (c->mon) n_it++;
  if (fd >= 0) it[n_it++] = (zmq_pollitem_t){.fd = fd, .events = ZMQ_POLLIN};
  /* a request waiting for a connection wakes the poll when its wait ends */
  if (c->mon && !c->up)
    for (pending *p = c->pend; p; p = p->hh.next)
      if (!p->conn) {
        int64_t left = p->sent_ms + TD_CLIENT_ROUTER_WAIT_MS + 1 - td_now_ms();
        if (timeout_ms < 0 || left < timeout_ms) timeout_ms = left > 0 ? (int)left : 0;
      }
  int rc = zmq_poll(it, n_it, timeout_ms);
  if (rc < 0) return td_err(TD_ERR_NETWORK, "zmq poll: %s", zmq_strerror(zmq_errno()));
  if (fd_ready) *fd_ready = fd >= 0 && (it[n_it - 1].revents & ZMQ_POLLIN);
  if (buffered) it[0].revents |= ZMQ_POLLIN, rc = rc > 0 ? rc : 1;
  if (!(it[0].revents & (ZMQ_POLLIN | ZMQ_POLLERR))) rc = 0; /* the caller's descriptor, or connection events only */
  for (int k = 0; rc > 0 && k < 1024; k++) {
    td_wire_frame f;
    td_status s = c->sock ? td_wire_recv(c->sock, false, false, &f) : td_link_recv(c->link, &f);
    if (s == TD_ERR_NOT_FOUND) break;
    if (!c->sock && td_link_broken(c->link)) {
      td_wire_frame_free(&f);
      link_lost(c);
      break;
    }
    if (s != TD_OK) {
      TD_WARN("client: %s", td_errmsg());
      td_wire_frame_free(&f);
      continue;
    }
    Tandem__ServerMessage *m;
    uint32_t ver;
    s = td_wire_unpack_server(&f, &m, &ver);
    td_wire_frame_free(&f);
    if (s != TD_OK) {
      TD_WARN("client: dropped a message from the router: %s", td_errmsg());
      continue;
    }
    char why[320];
    if (td_check_server_message(m, why, sizeof why))
      dispatch(c, m, ev);
    else
      invalid(c, m, ev, why);
    tandem__server_message__free_unpacked(m, NULL);
  }
  take_events(c);
  expire(c, ev);
  return TD_OK;
}

td_status td_client_health_check(td_client *c, int timeout_ms, td_client_health *out) {
  Tandem__HealthRequest hr = TANDEM__HEALTH_REQUEST__INIT;
  Tandem__ClientMessage m = TANDEM__CLIENT_MESSAGE__INIT;
  m.body_case = TANDEM__CLIENT_MESSAGE__BODY_HEALTH;
  m.health = &hr;
  c->have_health = false;
  TD_TRY(send_client(c, &m));
  int64_t end = td_now_ms() + timeout_ms;
  while (!c->have_health) {
    int64_t left = end - td_now_ms();
    if (left <= 0) return td_err(TD_ERR_TIMEOUT, "no health answer within %d ms", timeout_ms);
    TD_TRY(td_client_poll(c, (int)left, NULL));
  }
  *out = c->health;
  return TD_OK;
}

td_status td_client_admin(td_client *c, td_admin_action a, const char *worker, int timeout_ms, td_admin_reply *out) {
  static const Tandem__AdminAction actions[] = {
      [TD_ADMIN_LIST] = TANDEM__ADMIN_ACTION__ADMIN_LIST, [TD_ADMIN_DRAIN] = TANDEM__ADMIN_ACTION__ADMIN_DRAIN,
      [TD_ADMIN_UNDRAIN] = TANDEM__ADMIN_ACTION__ADMIN_UNDRAIN, [TD_ADMIN_REMOVE] = TANDEM__ADMIN_ACTION__ADMIN_REMOVE};
  if ((unsigned)a > TD_ADMIN_REMOVE) return td_err(TD_ERR_INVALID, "unknown admin action %d", (int)a);
  if (a != TD_ADMIN_LIST && (!worker || !*worker)) return td_err(TD_ERR_INVALID, "this admin action needs a worker id");
  memset(out, 0, sizeof *out);
  snprintf(c->admin_id, sizeof c->admin_id, "admin-%llu", (unsigned long long)++c->admin_serial);
  Tandem__AdminRequest ar = TANDEM__ADMIN_REQUEST__INIT;
  ar.action = actions[a];
  ar.worker_id = (char *)(a == TD_ADMIN_LIST || !worker ? "" : worker);
  ar.request_id = c->admin_id;
  Tandem__ClientMessage m = TANDEM__CLIENT_MESSAGE__INIT;
  m.body_case = TANDEM__CLIENT_MESSAGE__BODY_ADMIN;
  m.admin = &ar;
  TD_TRY(send_client(c, &m));
  c->admin_out = out;
  c->have_admin = false;
  td_status s = TD_OK;
  for (int64_t end = td_now_ms() + timeout_ms; !c->have_admin && s == TD_OK;) {
    int64_t left = end - td_now_ms();
    if (left <= 0) s = td_err(TD_ERR_TIMEOUT, "no answer from the router within %d ms", timeout_ms);
    else s = td_client_poll(c, (int)left, NULL);
  }
  c->admin_out = NULL;
  return s;
}
