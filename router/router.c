#include "router/router.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <uthash.h>

#include "common/clock.h"
#include "common/log.h"
#include "proto/wire.h"

/* ------------------------------------------------------------ state */

typedef struct worker {
  char id[TD_WIRE_MAX_ID + 1];
  size_t id_len;
  bool enc, pre, dec;
  int block_size, self_blocks, cross_blocks, max_running;
  uint8_t *desc;
  size_t desc_len;
  char device[64];
  int64_t last_seen;
  Tandem__Cluster__Load load;
  int jobs;         /* requests of any stage assigned here */
  int committed_cross, committed_self;
  bool draining;
  UT_hash_handle hh;
} worker;

typedef enum stage { ST_QUEUED, ST_RESERVING, ST_ENCODING, ST_PREFILLING, ST_DECODING } stage;
static const char *const stage_names[] = {"queued", "reserving", "encoding", "prefilling", "decoding"};

typedef struct rreq {
  uint64_t rid;          /* changes with every attempt */
  uint64_t serial;
  uint8_t client[TD_WIRE_MAX_ID];
  size_t client_len;
  char *cid;             /* the client's request id */
  char *ckey;            /* client identity + id, for cancel */
  Tandem__ClientMessage *msg; /* owns the GenerateRequest */
  Tandem__GenerateRequest *g;
  int enc_len, n_prompt, max_new, width;
  bool multi;            /* n > 1 or beams: no resume from streamed tokens */
  stage st;
  int attempts;
  char dec_w[TD_WIRE_MAX_ID + 1], enc_w[TD_WIRE_MAX_ID + 1], pre_w[TD_WIRE_MAX_ID + 1];
  bool local_encode, with_prefill;
  int need_cross, need_self;
  Tandem__Cluster__Reserved *dres, *pres; /* decode / prefill reservations */
  bool encoded, prefilled;
  /* tokens already streamed to the client (first sequence), for resuming */
  int32_t *streamed;
  float *streamed_lp;
  int n_streamed, cap_streamed;
  int64_t t_arrival, t_placed, t_stage, deadline;
  double encode_ms, prefill_ms;
  UT_hash_handle hh;   /* by rid */
  UT_hash_handle hc;   /* by ckey */
} rreq;

/* A worker group's rendezvous (GroupJoin / GroupInfo). */
#define MAX_GROUP 16
typedef struct group_rv {
  char name[128];
  int world;
  char *endpoints[MAX_GROUP];
  uint8_t ids[MAX_GROUP][TD_WIRE_MAX_ID];
  size_t id_lens[MAX_GROUP];
  uint8_t nccl_id[256];
  size_t nccl_len;
  int joined;
  bool complete;
  /* a rank was refused: the group cannot form; every rank hears why once */
  char *error;
  bool told[MAX_GROUP];
  int64_t created;
  int64_t seen[MAX_GROUP]; /* followers' last heartbeat */
  UT_hash_handle hh;
} group_rv;

struct td_router {
  td_router_opts o;
  group_rv *groups;
  void *ctx, *csock, *wsock;
  worker *workers;
  rreq *by_rid, *by_ckey;
  rreq **queue;
  int n_queue, cap_queue;
  int in_flight;
  uint64_t next_serial;
  int64_t last_hb;
  uint64_t hb_seq;
  /* the served model, from the first worker */
  bool have_model;
  Tandem__ModelInfo model;
  char model_type[32], model_name[128];
  int block_size;
};

/* ------------------------------------------------------------ helpers */

static int64_t now(void) { return td_now_ms(); }

static td_status send_worker(td_router *r, const worker *w, Tandem__Cluster__RouterMessage *m) {
  m->version = TD_PROTOCOL_VERSION;
  td_status s = td_wire_send(r->wsock, (const uint8_t *)w->id, w->id_len, &m->base);
  if (s != TD_OK) TD_WARN("router: send to worker %s: %s", w->id, td_errmsg());
  return s;
}

static void send_client_msg(td_router *r, const uint8_t *id, size_t id_len, Tandem__ServerMessage *m) {
  m->version = TD_PROTOCOL_VERSION;
  if (td_wire_send(r->csock, id, id_len, &m->base) != TD_OK) TD_DEBUG("router: client send: %s", td_errmsg());
}

static void client_error(td_router *r, const uint8_t *id, size_t id_len, const char *rid, Tandem__ErrorCode code,
                         const char *msg) {
  Tandem__Error e = TANDEM__ERROR__INIT;
  e.code = code;
  e.message = (char *)msg;
  Tandem__ServerMessage m = TANDEM__SERVER_MESSAGE__INIT;
  m.request_id = (char *)(rid ? rid : "");
  m.body_case = TANDEM__SERVER_MESSAGE__BODY_ERROR;
  m.error = &e;
  send_client_msg(r, id, id_len, &m);
}

static worker *find_worker(td_router *r, const char *id) {
  worker *w = NULL;
  HASH_FIND_STR(r->workers, id, w);
  return w;
}

static void send_cancel(td_router *r, const char *wid, uint64_t rid) {
  worker *w = wid[0] ? find_worker(r, wid) : NULL;
  if (!w) return;
  Tandem__Cluster__Cancel c = TANDEM__CLUSTER__CANCEL__INIT;
  c.rid = rid;
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL;
  m.cancel = &c;
  (void)send_worker(r, w, &m);
}

/* Drops the request's hold on its workers (accounting) and tells them to
 * free whatever they hold for it. */
static void release_workers(td_router *r, rreq *q, bool tell) {
  const char *ws[3] = {q->dec_w, q->enc_w, q->pre_w};
  for (int i = 0; i < 3; i++) {
    if (!ws[i][0]) continue;
    bool dup = false;
    for (int j = 0; j < i; j++) dup |= !strcmp(ws[i], ws[j]);
    worker *w = find_worker(r, ws[i]);
    if (w && !dup) {
      w->jobs--;
      if (i == 0) {
        w->committed_cross -= q->need_cross;
        w->committed_self -= q->need_self;
      }
      if (i == 2) w->committed_cross -= q->need_cross;
      if (tell) send_cancel(r, ws[i], q->rid);
    }
  }
  q->dec_w[0] = q->enc_w[0] = q->pre_w[0] = 0;
  if (q->dres) tandem__cluster__reserved__free_unpacked(q->dres, NULL);
  if (q->pres) tandem__cluster__reserved__free_unpacked(q->pres, NULL);
  q->dres = q->pres = NULL;
  q->encoded = q->prefilled = false;
}

static void queue_remove(td_router *r, rreq *q) {
  for (int i = 0; i < r->n_queue; i++)
    if (r->queue[i] == q) {
      memmove(r->queue + i, r->queue + i + 1, sizeof *r->queue * (size_t)(r->n_queue - i - 1));
      r->n_queue--;
      return;
    }
}

static td_status queue_push(td_router *r, rreq *q, bool front) {
  if (r->n_queue == r->cap_queue) {
    int nc = r->cap_queue ? 2 * r->cap_queue : 64;
    rreq **p = realloc(r->queue, sizeof *p * (size_t)nc);
    if (!p) return td_err(TD_ERR_NOMEM, "out of memory");
    r->queue = p;
    r->cap_queue = nc;
  }
  if (front) {
    memmove(r->queue + 1, r->queue, sizeof *r->queue * (size_t)r->n_queue);
    r->queue[0] = q;
  } else {
    r->queue[r->n_queue] = q;
  }
  r->n_queue++;
  return TD_OK;
}

static void req_free(td_router *r, rreq *q) {
  if (q->st != ST_QUEUED) r->in_flight--;
  release_workers(r, q, false);
  queue_remove(r, q);
  HASH_DELETE(hh, r->by_rid, q);
  HASH_DELETE(hc, r->by_ckey, q);
  tandem__client_message__free_unpacked(q->msg, NULL);
  free(q->cid);
  free(q->ckey);
  free(q->streamed);
  free(q->streamed_lp);
  free(q);
}

/* Ends a request with an error to its client; workers are told to free it. */
static void req_fail(td_router *r, rreq *q, Tandem__ErrorCode code, const char *msg) {
  TD_INFO("request %s (rid %llu) failed in stage %s: %s", q->cid, (unsigned long long)q->rid, stage_names[q->st], msg);
  release_workers(r, q, true);
  client_error(r, q->client, q->client_len, q->cid, code, msg);
  req_free(r, q);
}

/* Gives a request another attempt on other workers, or fails it. */
static void req_retry(td_router *r, rreq *q, const char *why) {
  release_workers(r, q, true);
  if (q->attempts >= r->o.max_attempts) {
    char msg[512];
    snprintf(msg, sizeof msg, "gave up after %d attempts: %s", q->attempts, why);
    req_fail(r, q, TANDEM__ERROR_CODE__ERROR_UNAVAILABLE, msg);
    return;
  }
  TD_WARN("request %s (rid %llu): retrying: %s", q->cid, (unsigned long long)q->rid, why);
  if (q->multi) q->n_streamed = 0; /* samples and beams restart from the prompt */
  HASH_DELETE(hh, r->by_rid, q);
  q->rid = (q->serial << 8) | (uint64_t)(q->attempts & 0xff);
  HASH_ADD(hh, r->by_rid, rid, sizeof q->rid, q);
  if (q->st != ST_QUEUED) r->in_flight--;
  q->st = ST_QUEUED;
  if (queue_push(r, q, true) != TD_OK) req_fail(r, q, TANDEM__ERROR_CODE__ERROR_INTERNAL, "out of memory");
}

/* ------------------------------------------------------------ workers */

static void worker_gone(td_router *r, worker *w, const char *why) {
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
      req_retry(r, q, msg);
    }
  }
  HASH_DEL(r->workers, w);
  free(w->desc);
  free(w);
}

static bool model_matches(td_router *r, const Tandem__ModelInfo *m, char *why, size_t cap) {
  if (!m) {
    snprintf(why, cap, "registration without a model description");
    return false;
  }
  if (!r->have_model) return true;
  if (strcmp(m->model_type ? m->model_type : "", r->model_type) || m->vocab_size != r->model.vocab_size ||
      m->max_source_len != r->model.max_source_len || m->max_target_len != r->model.max_target_len) {
    snprintf(why, cap, "serves %s (vocab %u), the cluster serves %s (vocab %u)", m->model_type, m->vocab_size,
             r->model_type, r->model.vocab_size);
    return false;
  }
  return true;
}

/* Workers exchange cross blocks, whose layout the mode sets: every one
 * must run the router's. */
static bool cross_mode_matches(const td_router *r, const char *mode, char *why, size_t cap) {
  const char *wm = mode && *mode ? mode : "auto";
  td_cross_mode m;
  if (td_cross_mode_parse(wm, &m) == TD_OK && m == r->o.cross_mode) return true;
  snprintf(why, cap, "cross pool mode differs: the worker runs --cross-mode %s, the router --cross-mode %s; the router "
           "and every worker must agree", wm, td_cross_mode_name(r->o.cross_mode));
  return false;
}

static void on_register(td_router *r, const uint8_t *id, size_t id_len, Tandem__Cluster__Register *reg) {
  Tandem__Cluster__RegisterAck ack = TANDEM__CLUSTER__REGISTER_ACK__INIT;
  ack.heartbeat_ms = (uint32_t)r->o.heartbeat_ms;
  ack.dead_after = (uint32_t)r->o.dead_after;
  char why[512] = "";
  Tandem__Cluster__WorkerInfo *in = reg ? reg->info : NULL;
  char wid[TD_WIRE_MAX_ID + 1];
  memcpy(wid, id, id_len);
  wid[id_len] = 0;
  bool ok = in && model_matches(r, in->model, why, sizeof why);
  if (ok && (!in->block_size || (r->have_model && (int)in->block_size != r->block_size))) {
    snprintf(why, sizeof why, "block size %u, the cluster uses %d", in->block_size, r->block_size);
    ok = false;
  }
  if (ok && !in->n_roles) {
    snprintf(why, sizeof why, "no roles");
    ok = false;
  }
  if (ok) ok = cross_mode_matches(r, in->cross_mode, why, sizeof why);
  if (!ok) {
    TD_WARN("refused worker %s: %s", wid, why);
    ack.accepted = false;
    ack.reason = why;
    Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
    m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ACK;
    m.ack = &ack;
    m.version = TD_PROTOCOL_VERSION;
    (void)td_wire_send(r->wsock, id, id_len, &m.base);
    return;
  }
  worker *old = find_worker(r, wid);
  if (old) worker_gone(r, old, "registered again (restarted)");
  worker *w = calloc(1, sizeof *w);
  if (!w) return;
  memcpy(w->id, id, id_len);
  w->id_len = id_len;
  for (size_t i = 0; i < in->n_roles; i++) {
    w->enc |= in->roles[i] == TANDEM__CLUSTER__ROLE__ROLE_ENCODE;
    w->pre |= in->roles[i] == TANDEM__CLUSTER__ROLE__ROLE_PREFILL;
    w->dec |= in->roles[i] == TANDEM__CLUSTER__ROLE__ROLE_DECODE;
  }
  w->block_size = (int)in->block_size;
  w->self_blocks = (int)in->self_blocks;
  w->cross_blocks = (int)in->cross_blocks;
  w->max_running = in->max_running ? (int)in->max_running : 1;
  if (in->transfer_desc.len) {
    w->desc = malloc(in->transfer_desc.len);
    if (w->desc) {
      memcpy(w->desc, in->transfer_desc.data, in->transfer_desc.len);
      w->desc_len = in->transfer_desc.len;
    }
  }
  snprintf(w->device, sizeof w->device, "%s", in->device ? in->device : "");
  w->last_seen = now();
  w->load.free_self_blocks = (uint32_t)w->self_blocks;
  w->load.free_cross_blocks = (uint32_t)w->cross_blocks;
  HASH_ADD_STR(r->workers, id, w);
  if (!r->have_model) {
    r->have_model = true;
    snprintf(r->model_type, sizeof r->model_type, "%s", in->model->model_type ? in->model->model_type : "");
    r->model = *in->model;
    r->model.name = r->model_name;
    r->model.model_type = r->model_type;
    snprintf(r->model_name, sizeof r->model_name, "%s",
             r->o.model_name ? r->o.model_name : (in->model->name && in->model->name[0] ? in->model->name : r->model_type));
    r->block_size = w->block_size;
  }
  TD_INFO("worker %s registered: %s%s%s on %s, %d self / %d cross blocks", wid, w->enc ? "encode " : "",
          w->pre ? "prefill " : "", w->dec ? "decode" : "", w->device, w->self_blocks, w->cross_blocks);
  ack.accepted = true;
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ACK;
  m.ack = &ack;
  (void)send_worker(r, w, &m);
}

/* ------------------------------------------------------------ groups */

static void group_free(group_rv *g) {
  for (int i = 0; i < MAX_GROUP; i++) free(g->endpoints[i]);
  free(g->error);
  free(g);
}

static void group_reply(td_router *r, const uint8_t *id, size_t id_len, const group_rv *g, const char *error) {
  Tandem__Cluster__GroupInfo gi = TANDEM__CLUSTER__GROUP_INFO__INIT;
  gi.group = (char *)(g ? g->name : "");
  gi.ok = !error;
  gi.error = (char *)(error ? error : "");
  if (g && !error) {
    gi.world = (uint32_t)g->world;
    gi.endpoints = (char **)g->endpoints;
    gi.n_endpoints = (size_t)g->world;
    gi.nccl_id.data = (uint8_t *)g->nccl_id;
    gi.nccl_id.len = g->nccl_len;
  }
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  m.version = TD_PROTOCOL_VERSION;
  m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO;
  m.group_info = &gi;
  (void)td_wire_send(r->wsock, id, id_len, &m.base);
}

static void on_group_join(td_router *r, const uint8_t *id, size_t id_len, Tandem__Cluster__GroupJoin *j) {
  const char *name = j->group ? j->group : "";
  if (!name[0] || strlen(name) >= 128 || j->world < 1 || j->world > MAX_GROUP || j->rank >= j->world ||
      !j->endpoint || !j->endpoint[0]) {
    group_reply(r, id, id_len, NULL, "bad group join (name, world 1..16, rank < world, endpoint)");
    return;
  }
  group_rv *g = NULL;
  HASH_FIND_STR(r->groups, name, g);
  char why[512];
  bool refused = !cross_mode_matches(r, j->cross_mode, why, sizeof why);
  /* a failed rendezvous that this rank heard of already, or a running group, starts over (a restart) */
  if (g && ((g->error && (g->told[j->rank] || g->world != (int)j->world)) || (refused && g->complete))) {
    HASH_DEL(r->groups, g);
    group_free(g);
    g = NULL;
  }
  if (refused || (g && g->error)) {
    /* the other ranks cannot form the group either: those waiting hear why now, the others
     * when they join (rather than waiting for a rank that never comes) */
    if (refused) TD_WARN("refused rank %u of worker group %s: %s", j->rank, name, why);
    group_reply(r, id, id_len, NULL, refused ? why : g->error);
    if (!g && (g = calloc(1, sizeof *g)) != NULL) {
      snprintf(g->name, sizeof g->name, "%s", name);
      g->world = (int)j->world;
      g->created = now();
      HASH_ADD_STR(r->groups, name, g);
    }
    if (!g) return;
    g->told[j->rank] = true;
    if (!g->error) {
      char other[700];
      snprintf(other, sizeof other, "rank %u of group %s was refused: %s", j->rank, name, why);
      g->error = strdup(other);
      for (int k = 0; k < g->world; k++)
        if (g->endpoints[k] && !g->told[k]) {
          group_reply(r, g->ids[k], g->id_lens[k], NULL, other);
          g->told[k] = true;
        }
    }
    bool all = true;
    for (int k = 0; k < g->world; k++) all &= g->told[k];
    if (all) {
      HASH_DEL(r->groups, g);
      group_free(g);
    }
    return;
  }
  /* a finished rendezvous, or a rank that joins twice, starts over (a restart) */
  if (g && (g->complete || g->endpoints[j->rank] || g->world != (int)j->world)) {
    HASH_DEL(r->groups, g);
    group_free(g);
    g = NULL;
  }
  if (!g) {
    g = calloc(1, sizeof *g);
    if (!g) return;
    snprintf(g->name, sizeof g->name, "%s", name);
    g->world = (int)j->world;
    g->created = now();
    HASH_ADD_STR(r->groups, name, g);
  }
  g->endpoints[j->rank] = strdup(j->endpoint);
  memcpy(g->ids[j->rank], id, id_len);
  g->id_lens[j->rank] = id_len;
  if (j->rank == 0 && j->nccl_id.len && j->nccl_id.len <= sizeof g->nccl_id) {
    memcpy(g->nccl_id, j->nccl_id.data, j->nccl_id.len);
    g->nccl_len = j->nccl_id.len;
  }
  if (++g->joined < g->world) return;
  g->complete = true;
  for (int k = 0; k < g->world; k++) g->seen[k] = now();
  TD_INFO("worker group %s: %d ranks joined", g->name, g->world);
  for (int k = 0; k < g->world; k++) group_reply(r, g->ids[k], g->id_lens[k], g, NULL);
}

/* The group whose follower rank has this identity, or NULL. */
static group_rv *group_of_follower(td_router *r, const uint8_t *id, size_t id_len, int *rank) {
  group_rv *g, *gt;
  HASH_ITER(hh, r->groups, g, gt) {
    for (int k = 1; k < g->world; k++)
      if (g->id_lens[k] == id_len && !memcmp(g->ids[k], id, id_len)) {
        *rank = k;
        return g;
      }
  }
  return NULL;
}

/* A rank of a complete group died: the group leaves the pool. */
static void group_failed(td_router *r, group_rv *g, const char *why) {
  TD_WARN("worker group %s failed: %s", g->name, why);
  group_reply(r, g->ids[0], g->id_lens[0], g, why);
  char wid[TD_WIRE_MAX_ID + 1];
  memcpy(wid, g->ids[0], g->id_lens[0]);
  wid[g->id_lens[0]] = 0;
  worker *w = find_worker(r, wid);
  if (w) worker_gone(r, w, why);
  HASH_DEL(r->groups, g);
  group_free(g);
}

/* ------------------------------------------------------------ placement */

static worker *pick(td_router *r, bool want_dec, bool want_enc, bool want_pre, const rreq *q) {
  worker *best = NULL, *w, *t;
  HASH_ITER(hh, r->workers, w, t) {
    if (w->draining) continue;
    if ((want_dec && !w->dec) || (want_enc && !w->enc) || (want_pre && !w->pre)) continue;
    if (want_dec) {
      if (w->committed_cross + q->need_cross > w->cross_blocks) continue;
      if (w->jobs >= 4 * w->max_running) continue;
    }
    if (want_pre && w->committed_cross + q->need_cross > w->cross_blocks) continue;
    if (!best || w->jobs < best->jobs ||
        (w->jobs == best->jobs && w->committed_self < best->committed_self))
      best = w;
  }
  return best;
}

static void fill_spec(const td_router *r, const rreq *q, Tandem__Cluster__RequestSpec *sp, int32_t *prompt_buf) {
  const Tandem__GenerateRequest *g = q->g;
  sp->rid = q->rid;
  sp->input_ids = g->input_ids;
  sp->n_input_ids = g->n_input_ids;
  sp->features = g->features;
  int np = 0;
  if (g->n_decoder_prompt)
    for (size_t i = 0; i < g->n_decoder_prompt; i++) prompt_buf[np++] = g->decoder_prompt[i];
  for (int i = 0; i < q->n_streamed; i++) prompt_buf[np++] = q->streamed[i];
  sp->decoder_prompt = prompt_buf;
  sp->n_decoder_prompt = (size_t)np;
  sp->sampling = g->sampling;
  sp->max_new_tokens = (uint32_t)(q->max_new - q->n_streamed);
  sp->stop_token_ids = g->stop_token_ids;
  sp->n_stop_token_ids = g->n_stop_token_ids;
  sp->enc_len = (uint32_t)q->enc_len;
  sp->step_offset = (uint32_t)q->n_streamed;
  sp->client_id = q->cid;
}

static bool place(td_router *r, rreq *q) {
  worker *d = pick(r, true, false, false, q);
  if (!d) return false;
  worker *e = NULL, *p = NULL;
  bool local = d->enc;
  if (!local) {
    e = pick(r, false, true, false, q);
    if (!e) return false;
  }
  int n_prompt = q->n_prompt + (q->multi ? 0 : q->n_streamed);
  if (!d->pre && n_prompt >= r->o.prefill_threshold && !local) p = pick(r, false, false, true, q);
  if (p == d) p = NULL;
  q->attempts++;
  q->local_encode = local;
  q->with_prefill = p != NULL;
  snprintf(q->dec_w, sizeof q->dec_w, "%s", d->id);
  snprintf(q->enc_w, sizeof q->enc_w, "%s", e ? e->id : "");
  snprintf(q->pre_w, sizeof q->pre_w, "%s", p ? p->id : "");
  d->jobs++;
  d->committed_cross += q->need_cross;
  d->committed_self += q->need_self;
  if (e && e != d) e->jobs++;
  if (p) {
    p->jobs++;
    p->committed_cross += q->need_cross;
  }
  q->st = local ? ST_DECODING : ST_RESERVING;
  q->t_placed = q->t_placed ? q->t_placed : now();
  q->t_stage = now();
  r->in_flight++;
  int32_t *prompt = malloc(sizeof(int32_t) * (size_t)(n_prompt + 1));
  if (!prompt) return false;
  Tandem__Cluster__RequestSpec sp = TANDEM__CLUSTER__REQUEST_SPEC__INIT;
  fill_spec(r, q, &sp, prompt);
  Tandem__Cluster__DecodeJob dj = TANDEM__CLUSTER__DECODE_JOB__INIT;
  dj.req = &sp;
  dj.local_encode = local;
  dj.with_prefill = q->with_prefill;
  /* the prefill worker sends all prompt KV but the last token's, which the
   * decode worker runs itself to get the first logits */
  dj.prefill_tokens = q->with_prefill ? (uint32_t)(n_prompt - 1) : 0;
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE;
  m.decode = &dj;
  td_status s = send_worker(r, d, &m);
  free(prompt);
  TD_DEBUG("request %s (rid %llu) placed: decode %s, encode %s, prefill %s", q->cid, (unsigned long long)q->rid,
           d->id, local ? "local" : e->id, p ? p->id : "-");
  if (s != TD_OK) req_retry(r, q, "could not reach the decode worker");
  return true;
}

static void send_encode(td_router *r, rreq *q) {
  worker *e = find_worker(r, q->enc_w);
  if (!e || !q->dres || !q->dres->cross || (q->with_prefill && (!q->pres || !q->pres->cross))) {
    req_retry(r, q, "encoder or reservation lost");
    return;
  }
  int32_t *prompt = malloc(sizeof(int32_t) * (size_t)(q->n_prompt + q->n_streamed + 1));
  if (!prompt) return;
  Tandem__Cluster__RequestSpec sp = TANDEM__CLUSTER__REQUEST_SPEC__INIT;
  fill_spec(r, q, &sp, prompt);
  Tandem__Cluster__KvTarget *targets[2] = {q->dres->cross, q->with_prefill ? q->pres->cross : NULL};
  Tandem__Cluster__EncodeJob ej = TANDEM__CLUSTER__ENCODE_JOB__INIT;
  ej.req = &sp;
  ej.targets = targets;
  ej.n_targets = q->with_prefill ? 2 : 1;
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE;
  m.encode = &ej;
  q->st = ST_ENCODING;
  q->t_stage = now();
  td_status s = send_worker(r, e, &m);
  free(prompt);
  if (s != TD_OK) req_retry(r, q, "could not reach the encoder");
}

static void send_prefill(td_router *r, rreq *q) {
  worker *p = find_worker(r, q->pre_w);
  if (!p || !q->dres || !q->dres->self) {
    req_retry(r, q, "prefill worker or reservation lost");
    return;
  }
  int32_t *prompt = malloc(sizeof(int32_t) * (size_t)(q->n_prompt + q->n_streamed + 1));
  if (!prompt) return;
  Tandem__Cluster__RequestSpec sp = TANDEM__CLUSTER__REQUEST_SPEC__INIT;
  fill_spec(r, q, &sp, prompt);
  Tandem__Cluster__PrefillJob pj = TANDEM__CLUSTER__PREFILL_JOB__INIT;
  pj.req = &sp;
  pj.self_target = q->dres->self;
  pj.prefill_tokens = q->dres->self->tokens;
  pj.sample_first = false;
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL;
  m.prefill = &pj;
  td_status s = send_worker(r, p, &m);
  free(prompt);
  if (s != TD_OK) req_retry(r, q, "could not reach the prefill worker");
}

/* ------------------------------------------------------------ clients */

static td_status validate(td_router *r, const Tandem__GenerateRequest *g, rreq *q, char *msg, size_t cap) {
  const Tandem__ModelInfo *mi = &r->model;
  int V = (int)mi->vocab_size;
  if (g->model && g->model[0] && strcmp(g->model, r->model_name) && strcmp(g->model, r->model_type)) {
    snprintf(msg, cap, "model \"%s\" is not served here (serving \"%s\")", g->model, r->model_name);
    return TD_ERR_NOT_FOUND;
  }
  bool audio = mi->mel_bins > 0;
  if (audio) {
    size_t want = (size_t)mi->mel_bins * mi->frames;
    if (!g->features || g->features->n_values != want) {
      snprintf(msg, cap, "this model takes audio features of %u x %u floats, got %zu", mi->mel_bins, mi->frames,
               g->features ? g->features->n_values : 0);
      return TD_ERR_INVALID;
    }
    if ((g->features->mel_bins && g->features->mel_bins != mi->mel_bins) ||
        (g->features->frames && g->features->frames != mi->frames)) {
      snprintf(msg, cap, "features are %u x %u, the model takes %u x %u", g->features->mel_bins, g->features->frames,
               mi->mel_bins, mi->frames);
      return TD_ERR_INVALID;
    }
    for (size_t i = 0; i < want; i++)
      if (!isfinite(g->features->values[i])) {
        snprintf(msg, cap, "audio features contain NaN or infinity");
        return TD_ERR_INVALID;
      }
    q->enc_len = (int)mi->max_source_len;
  } else {
    if (g->features) {
      snprintf(msg, cap, "this model takes input_ids, not audio features");
      return TD_ERR_INVALID;
    }
    if (!g->n_input_ids) {
      snprintf(msg, cap, "empty encoder input");
      return TD_ERR_INVALID;
    }
    if (g->n_input_ids > mi->max_source_len) {
      snprintf(msg, cap, "encoder input of %zu tokens exceeds the model's %u", g->n_input_ids, mi->max_source_len);
      return TD_ERR_INVALID;
    }
    for (size_t i = 0; i < g->n_input_ids; i++)
      if (g->input_ids[i] < 0 || g->input_ids[i] >= V) {
        snprintf(msg, cap, "input token %d (at %zu) is outside the vocabulary of %d", g->input_ids[i], i, V);
        return TD_ERR_INVALID;
      }
    q->enc_len = (int)g->n_input_ids;
  }
  q->n_prompt = g->n_decoder_prompt ? (int)g->n_decoder_prompt : 1;
  if (q->n_prompt >= (int)mi->max_target_len) {
    snprintf(msg, cap, "decoder prompt of %d tokens leaves no room in the model's %u positions", q->n_prompt,
             mi->max_target_len);
    return TD_ERR_INVALID;
  }
  for (size_t i = 0; i < g->n_decoder_prompt; i++)
    if (g->decoder_prompt[i] < 0 || g->decoder_prompt[i] >= V) {
      snprintf(msg, cap, "decoder prompt token %d is outside the vocabulary of %d", g->decoder_prompt[i], V);
      return TD_ERR_INVALID;
    }
  for (size_t i = 0; i < g->n_stop_token_ids; i++)
    if (g->stop_token_ids[i] < 0 || g->stop_token_ids[i] >= V) {
      snprintf(msg, cap, "stop token %d is outside the vocabulary of %d", g->stop_token_ids[i], V);
      return TD_ERR_INVALID;
    }
  int room = (int)mi->max_target_len - q->n_prompt;
  if ((int)g->max_new_tokens > room) {
    snprintf(msg, cap, "prompt %d + max_new_tokens %u exceeds the model's %u positions", q->n_prompt,
             g->max_new_tokens, mi->max_target_len);
    return TD_ERR_INVALID;
  }
  q->max_new = g->max_new_tokens ? (int)g->max_new_tokens : room;
  const Tandem__SamplingParams *sp = g->sampling;
  int n = sp && sp->n ? (int)sp->n : 1, beams = sp && sp->num_beams ? (int)sp->num_beams : 1;
  if (sp) {
    if (sp->temperature < 0 || !isfinite(sp->temperature) || sp->top_p < 0 || sp->top_k < 0 || n > 64 ||
        beams > 32 || sp->num_return_sequences > (uint32_t)(beams > 1 ? beams : n) ||
        (beams > 1 && (n > 1 || sp->temperature > 0)) || sp->early_stopping < -1 || sp->early_stopping > 1 ||
        (sp->set_forced_bos && sp->forced_bos_token_id >= V) || (sp->set_forced_eos && sp->forced_eos_token_id >= V)) {
      snprintf(msg, cap, "invalid sampling parameters (temperature >= 0, top_p in [0, 1], top_k >= 0, n <= 64, "
                         "num_beams <= 32, num_return_sequences <= n or num_beams, no sampling with beams)");
      return TD_ERR_INVALID;
    }
  }
  q->width = beams > 1 ? beams : n;
  q->multi = q->width > 1;
  q->need_cross = (q->enc_len + r->block_size - 1) / r->block_size;
  q->need_self = q->width * ((q->n_prompt + q->max_new + r->block_size - 1) / r->block_size + 1);
  return TD_OK;
}

static int count_role(td_router *r, int role) {
  int n = 0;
  worker *w, *t;
  HASH_ITER(hh, r->workers, w, t) n += role == 0 ? w->enc : role == 1 ? w->pre : w->dec;
  return n;
}

static void on_generate(td_router *r, const uint8_t *cid, size_t cid_len, Tandem__ClientMessage *msg) {
  Tandem__GenerateRequest *g = msg->generate;
  const char *id = g->request_id ? g->request_id : "";
  char err[512];
  if (!id[0] || strlen(id) > 255) {
    client_error(r, cid, cid_len, id, TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, "request_id must be 1 to 255 bytes");
    tandem__client_message__free_unpacked(msg, NULL);
    return;
  }
  size_t klen = cid_len * 2 + strlen(id) + 2;
  char *key = malloc(klen);
  if (!key) {
    tandem__client_message__free_unpacked(msg, NULL);
    return;
  }
  for (size_t i = 0; i < cid_len; i++) snprintf(key + 2 * i, 3, "%02x", cid[i]);
  snprintf(key + 2 * cid_len, klen - 2 * cid_len, "/%s", id);
  rreq *dup = NULL;
  HASH_FIND(hc, r->by_ckey, key, strlen(key), dup);
  Tandem__ErrorCode code = TANDEM__ERROR_CODE__ERROR_NONE;
  rreq *q = NULL;
  if (dup) {
    code = TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT;
    snprintf(err, sizeof err, "request_id \"%s\" is already in flight", id);
  } else if (!r->have_model || count_role(r, 2) == 0) {
    code = TANDEM__ERROR_CODE__ERROR_UNAVAILABLE;
    snprintf(err, sizeof err, "no decode worker is registered");
  } else if (r->n_queue >= r->o.max_queue || r->in_flight >= r->o.max_in_flight) {
    code = TANDEM__ERROR_CODE__ERROR_OVERLOADED;
    snprintf(err, sizeof err, "overloaded: %d requests queued, %d in flight", r->n_queue, r->in_flight);
  } else if (!(q = calloc(1, sizeof *q))) {
    code = TANDEM__ERROR_CODE__ERROR_INTERNAL;
    snprintf(err, sizeof err, "out of memory");
  } else {
    td_status s = validate(r, g, q, err, sizeof err);
    if (s != TD_OK) code = td_wire_error_code(s);
  }
  if (code != TANDEM__ERROR_CODE__ERROR_NONE) {
    client_error(r, cid, cid_len, id, code, err);
    free(q);
    free(key);
    tandem__client_message__free_unpacked(msg, NULL);
    return;
  }
  q->serial = r->next_serial++;
  q->rid = q->serial << 8;
  memcpy(q->client, cid, cid_len);
  q->client_len = cid_len;
  q->cid = strdup(id);
  q->ckey = key;
  q->msg = msg;
  q->g = g;
  q->t_arrival = now();
  q->deadline = q->t_arrival + (g->timeout_ms ? (int64_t)g->timeout_ms : r->o.default_timeout_ms);
  q->st = ST_QUEUED;
  if (!q->cid || queue_push(r, q, false) != TD_OK) {
    client_error(r, cid, cid_len, id, TANDEM__ERROR_CODE__ERROR_INTERNAL, "out of memory");
    free(q->cid);
    free(key);
    free(q);
    tandem__client_message__free_unpacked(msg, NULL);
    return;
  }
  HASH_ADD(hh, r->by_rid, rid, sizeof q->rid, q);
  HASH_ADD_KEYPTR(hc, r->by_ckey, q->ckey, strlen(q->ckey), q);
}

static void on_client(td_router *r) {
  td_wire_frame f;
  td_status s = td_wire_recv(r->csock, true, false, &f);
  if (s == TD_ERR_NOT_FOUND) return;
  if (s != TD_OK) {
    if (f.id_len) client_error(r, f.id, f.id_len, "", TANDEM__ERROR_CODE__ERROR_MALFORMED, td_errmsg());
    td_wire_frame_free(&f);
    return;
  }
  Tandem__ClientMessage *m;
  uint32_t ver;
  s = td_wire_unpack_client(&f, &m, &ver);
  if (s != TD_OK) {
    client_error(r, f.id, f.id_len, "", s == TD_ERR_VERSION ? TANDEM__ERROR_CODE__ERROR_VERSION
                                                             : TANDEM__ERROR_CODE__ERROR_MALFORMED,
                 td_errmsg());
    td_wire_frame_free(&f);
    return;
  }
  switch (m->body_case) {
    case TANDEM__CLIENT_MESSAGE__BODY_GENERATE:
      on_generate(r, f.id, f.id_len, m);
      m = NULL;
      break;
    case TANDEM__CLIENT_MESSAGE__BODY_CANCEL: {
      const char *id = m->cancel->request_id ? m->cancel->request_id : "";
      size_t klen = f.id_len * 2 + strlen(id) + 2;
      char *key = malloc(klen);
      if (!key) break;
      for (size_t i = 0; i < f.id_len; i++) snprintf(key + 2 * i, 3, "%02x", f.id[i]);
      snprintf(key + 2 * f.id_len, klen - 2 * f.id_len, "/%s", id);
      rreq *q = NULL;
      HASH_FIND(hc, r->by_ckey, key, strlen(key), q);
      free(key);
      if (q)
        req_fail(r, q, TANDEM__ERROR_CODE__ERROR_CANCELLED, "cancelled by the client");
      else
        client_error(r, f.id, f.id_len, id, TANDEM__ERROR_CODE__ERROR_NOT_FOUND, "no such request in flight");
      break;
    }
    case TANDEM__CLIENT_MESSAGE__BODY_HEALTH: {
      Tandem__HealthResponse h = TANDEM__HEALTH_RESPONSE__INIT;
      h.encoders = (uint32_t)count_role(r, 0);
      h.prefills = (uint32_t)count_role(r, 1);
      h.decoders = (uint32_t)count_role(r, 2);
      h.serving = h.decoders > 0;
      h.in_flight = (uint32_t)r->in_flight;
      h.queued = (uint32_t)r->n_queue;
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
          x->encode = w->enc;
          x->prefill = w->pre;
          x->decode = w->dec;
          x->self_blocks = (uint32_t)w->self_blocks;
          x->free_self_blocks = w->load.free_self_blocks;
          x->cross_blocks = (uint32_t)w->cross_blocks;
          x->free_cross_blocks = w->load.free_cross_blocks;
          x->running = w->load.running;
          x->queued = w->load.queued;
          x->jobs = (uint32_t)w->jobs;
          x->draining = w->draining;
          x->device = w->device;
          x->kv_in_ucx = w->load.kv_in_ucx;
          x->kv_in_zmq = w->load.kv_in_zmq;
          x->kv_out_ucx = w->load.kv_out_ucx;
          x->kv_out_zmq = w->load.kv_out_zmq;
          x->kv_pushing = w->load.kv_pushing;
          wp[k] = x;
          k++;
        }
        h.workers = wp;
        h.n_workers = k;
      }
      Tandem__ServerMessage sm = TANDEM__SERVER_MESSAGE__INIT;
      sm.request_id = "";
      sm.body_case = TANDEM__SERVER_MESSAGE__BODY_HEALTH;
      sm.health = &h;
      send_client_msg(r, f.id, f.id_len, &sm);
      free(ws);
      free(wp);
      break;
    }
    case TANDEM__CLIENT_MESSAGE__BODY_LIST_MODELS: {
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
      send_client_msg(r, f.id, f.id_len, &sm);
      break;
    }
    default:
      client_error(r, f.id, f.id_len, "", TANDEM__ERROR_CODE__ERROR_MALFORMED, "message without a body");
      break;
  }
  if (m) tandem__client_message__free_unpacked(m, NULL);
  td_wire_frame_free(&f);
}

/* ------------------------------------------------------------ worker messages */

static rreq *req_for(td_router *r, uint64_t rid, const worker *w) {
  rreq *q = NULL;
  HASH_FIND(hh, r->by_rid, &rid, sizeof rid, q);
  if (!q) {
    /* a stale attempt: make sure the worker lets go of it */
    send_cancel(r, w->id, rid);
    return NULL;
  }
  return q;
}

static void on_reserved(td_router *r, worker *w, Tandem__Cluster__WorkerMessage *m) {
  Tandem__Cluster__Reserved *res = m->reserved;
  rreq *q = req_for(r, res->rid, w);
  if (!q || q->st != ST_RESERVING) return;
  bool from_dec = !strcmp(w->id, q->dec_w), from_pre = q->with_prefill && !strcmp(w->id, q->pre_w);
  if (!from_dec && !from_pre) return;
  /* keep the reservation: detach it from the message */
  Tandem__Cluster__Reserved **slot = from_dec ? &q->dres : &q->pres;
  if (*slot) tandem__cluster__reserved__free_unpacked(*slot, NULL);
  *slot = res;
  m->reserved = NULL;
  m->body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY__NOT_SET;
  if (from_dec) {
    if (q->with_prefill)
      send_prefill(r, q);
    else
      send_encode(r, q);
  } else {
    send_encode(r, q);
  }
}

static bool push_streamed(rreq *q, int32_t tok, float lp) {
  if (q->n_streamed == q->cap_streamed) {
    int nc = q->cap_streamed ? 2 * q->cap_streamed : 32;
    int32_t *a = realloc(q->streamed, sizeof *a * (size_t)nc);
    if (!a) return false;
    q->streamed = a;
    float *b = realloc(q->streamed_lp, sizeof *b * (size_t)nc);
    if (!b) return false;
    q->streamed_lp = b;
    q->cap_streamed = nc;
  }
  q->streamed[q->n_streamed] = tok;
  q->streamed_lp[q->n_streamed] = lp;
  q->n_streamed++;
  return true;
}

static void on_tokens(td_router *r, worker *w, Tandem__Cluster__Tokens *t) {
  rreq *q = req_for(r, t->rid, w);
  if (!q || strcmp(w->id, q->dec_w)) return;
  if (q->st < ST_DECODING) q->st = ST_DECODING;
  /* A single sequence's tokens are kept so that another worker can resume
   * it; its offsets continue across attempts. */
  uint32_t off = t->offset;
  if (!q->multi) {
    off = (uint32_t)q->n_streamed;
    for (size_t i = 0; i < t->n_tokens; i++)
      if (!push_streamed(q, t->tokens[i], i < t->n_logprobs ? t->logprobs[i] : 0.0f)) {
        req_fail(r, q, TANDEM__ERROR_CODE__ERROR_INTERNAL, "out of memory");
        return;
      }
  }
  if (!q->g->stream) return;
  Tandem__TokenChunk c = TANDEM__TOKEN_CHUNK__INIT;
  c.sequence = t->sequence;
  c.offset = off;
  c.tokens = t->tokens;
  c.n_tokens = t->n_tokens;
  c.logprobs = t->logprobs;
  c.n_logprobs = q->g->sampling && q->g->sampling->logprobs ? t->n_logprobs : 0;
  Tandem__ServerMessage sm = TANDEM__SERVER_MESSAGE__INIT;
  sm.request_id = q->cid;
  sm.body_case = TANDEM__SERVER_MESSAGE__BODY_TOKENS;
  sm.tokens = &c;
  send_client_msg(r, q->client, q->client_len, &sm);
}

static void on_finished(td_router *r, worker *w, Tandem__Cluster__Finished *fin) {
  rreq *q = req_for(r, fin->rid, w);
  if (!q || strcmp(w->id, q->dec_w)) return;
  Tandem__SequenceOutput **outs = fin->outputs, *tmp[64], merged = TANDEM__SEQUENCE_OUTPUT__INIT;
  size_t n_out = fin->n_outputs < 64 ? fin->n_outputs : 64;
  /* a resumed sequence: earlier attempts' tokens come first */
  int prior = !q->multi && n_out ? q->n_streamed - (int)outs[0]->n_tokens : 0;
  bool want_lp = q->g->sampling && q->g->sampling->logprobs;
  if (prior > 0) {
    for (size_t i = 0; i < n_out; i++) tmp[i] = outs[i];
    merged = *outs[0];
    merged.tokens = q->streamed;
    merged.n_tokens = (size_t)q->n_streamed;
    merged.logprobs = want_lp ? q->streamed_lp : NULL;
    merged.n_logprobs = want_lp ? (size_t)q->n_streamed : 0;
    tmp[0] = &merged;
    outs = tmp;
  }
  Tandem__Timings tm = TANDEM__TIMINGS__INIT;
  tm.queue_ms = (double)(q->t_placed - q->t_arrival);
  tm.encode_ms = q->encode_ms;
  tm.prefill_ms = q->prefill_ms;
  tm.decode_ms = fin->decode_ms;
  tm.total_ms = (double)(now() - q->t_arrival);
  tm.attempts = (uint32_t)q->attempts;
  Tandem__GenerateResult gr = TANDEM__GENERATE_RESULT__INIT;
  gr.outputs = outs;
  gr.n_outputs = n_out;
  gr.timings = &tm;
  Tandem__ServerMessage sm = TANDEM__SERVER_MESSAGE__INIT;
  sm.request_id = q->cid;
  sm.body_case = TANDEM__SERVER_MESSAGE__BODY_RESULT;
  sm.result = &gr;
  send_client_msg(r, q->client, q->client_len, &sm);
  TD_DEBUG("request %s done in %.0f ms (attempts %d)", q->cid, tm.total_ms, q->attempts);
  req_free(r, q);
}

static void on_worker(td_router *r) {
  td_wire_frame f;
  td_status s = td_wire_recv(r->wsock, true, false, &f);
  if (s == TD_ERR_NOT_FOUND) return;
  char wid[TD_WIRE_MAX_ID + 1];
  memcpy(wid, f.id, f.id_len);
  wid[f.id_len] = 0;
  if (s != TD_OK) {
    TD_WARN("router: bad frame from worker %s: %s", wid, td_errmsg());
    td_wire_frame_free(&f);
    return;
  }
  Tandem__Cluster__WorkerMessage *m;
  uint32_t ver;
  s = td_wire_unpack_worker(&f, &m, &ver);
  if (s != TD_OK) {
    TD_WARN("router: dropped a message from worker %s: %s", wid, td_errmsg());
    if (s == TD_ERR_VERSION) {
      Tandem__Cluster__RegisterAck ack = TANDEM__CLUSTER__REGISTER_ACK__INIT;
      ack.accepted = false;
      ack.reason = (char *)td_errmsg();
      Tandem__Cluster__RouterMessage rm = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
      rm.version = TD_PROTOCOL_VERSION;
      rm.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ACK;
      rm.ack = &ack;
      (void)td_wire_send(r->wsock, f.id, f.id_len, &rm.base);
    }
    td_wire_frame_free(&f);
    return;
  }
  worker *w = find_worker(r, wid);
  int frank = 0;
  group_rv *fg = w ? NULL : group_of_follower(r, f.id, f.id_len, &frank);
  if (m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_GROUP_JOIN) {
    on_group_join(r, f.id, f.id_len, m->group_join);
  } else if (fg) {
    fg->seen[frank] = now(); /* a follower's heartbeat */
  } else if (m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_REGISTER) {
    on_register(r, f.id, f.id_len, m->register_);
  } else if (!w) {
    /* unknown (e.g. the router restarted): ask it to register */
    Tandem__Cluster__RegisterAck ack = TANDEM__CLUSTER__REGISTER_ACK__INIT;
    ack.accepted = false;
    ack.reason = "unknown worker: register";
    Tandem__Cluster__RouterMessage rm = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
    rm.version = TD_PROTOCOL_VERSION;
    rm.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ACK;
    rm.ack = &ack;
    (void)td_wire_send(r->wsock, f.id, f.id_len, &rm.base);
  } else {
    w->last_seen = now();
    switch (m->body_case) {
      case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_HEARTBEAT:
        if (m->heartbeat->load) {
          w->load = *m->heartbeat->load;
          if (w->load.draining && !w->draining) TD_INFO("worker %s is draining", w->id);
          w->draining = w->load.draining;
        }
        w->load.base = (ProtobufCMessage)PROTOBUF_C_MESSAGE_INIT(&tandem__cluster__load__descriptor);
        break;
      case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_DEREGISTER:
        worker_gone(r, w, m->deregister->reason ? m->deregister->reason : "deregistered");
        w = NULL;
        break;
      case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED:
        on_reserved(r, w, m);
        break;
      case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_ENCODE_DONE: {
        rreq *q = req_for(r, m->encode_done->rid, w);
        if (q && !strcmp(w->id, q->enc_w)) {
          q->encoded = true;
          q->encode_ms = m->encode_done->ms;
          /* the encoder's part is over */
          if (strcmp(q->enc_w, q->dec_w) && strcmp(q->enc_w, q->pre_w)) w->jobs--;
          q->enc_w[0] = 0;
          q->st = q->with_prefill && !q->prefilled ? ST_PREFILLING : ST_DECODING;
          q->t_stage = now();
        }
        break;
      }
      case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_PREFILL_DONE: {
        rreq *q = req_for(r, m->prefill_done->rid, w);
        if (q && q->with_prefill && !strcmp(w->id, q->pre_w)) {
          q->prefilled = true;
          q->prefill_ms = m->prefill_done->ms;
          w->jobs--;
          w->committed_cross -= q->need_cross;
          q->pre_w[0] = 0;
          worker *d = find_worker(r, q->dec_w);
          Tandem__Cluster__PrefillResult pr = TANDEM__CLUSTER__PREFILL_RESULT__INIT;
          pr.rid = q->rid;
          pr.first_token = m->prefill_done->first_token;
          pr.first_logprob = m->prefill_done->first_logprob;
          Tandem__Cluster__RouterMessage rm = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
          rm.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL_RESULT;
          rm.prefill_result = &pr;
          if (d) (void)send_worker(r, d, &rm);
          q->st = ST_DECODING;
          q->t_stage = now();
        }
        break;
      }
      case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS:
        on_tokens(r, w, m->tokens);
        break;
      case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FINISHED:
        on_finished(r, w, m->finished);
        break;
      case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED: {
        rreq *q = req_for(r, m->failed->rid, w);
        if (!q) break;
        const char *msg = m->failed->message ? m->failed->message : "worker error";
        if (m->failed->retryable)
          req_retry(r, q, msg);
        else
          req_fail(r, q, m->failed->code ? m->failed->code : TANDEM__ERROR_CODE__ERROR_INTERNAL, msg);
        break;
      }
      default:
        break;
    }
  }
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  td_wire_frame_free(&f);
}

/* ------------------------------------------------------------ timers */

static void timers(td_router *r) {
  int64_t t = now();
  if (t - r->last_hb >= r->o.heartbeat_ms) {
    r->last_hb = t;
    Tandem__Cluster__Heartbeat hb = TANDEM__CLUSTER__HEARTBEAT__INIT;
    hb.seq = ++r->hb_seq;
    Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
    m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_HEARTBEAT;
    m.heartbeat = &hb;
    worker *w, *tmp;
    HASH_ITER(hh, r->workers, w, tmp) {
      if (t - w->last_seen > (int64_t)r->o.heartbeat_ms * r->o.dead_after) {
        char why[128];
        snprintf(why, sizeof why, "silent for %lld ms", (long long)(t - w->last_seen));
        worker_gone(r, w, why);
        continue;
      }
      (void)send_worker(r, w, &m);
    }
  }
  rreq *q, *tmp;
  HASH_ITER(hh, r->by_rid, q, tmp) {
    if (t > q->deadline) {
      req_fail(r, q, TANDEM__ERROR_CODE__ERROR_TIMEOUT, "deadline exceeded");
      continue;
    }
    if ((q->st == ST_RESERVING || q->st == ST_ENCODING || q->st == ST_PREFILLING) &&
        t - q->t_stage > r->o.stage_timeout_ms) {
      char why[128];
      snprintf(why, sizeof why, "stage %s took more than %d ms", stage_names[q->st], r->o.stage_timeout_ms);
      req_retry(r, q, why);
    }
  }
  group_rv *g, *gt;
  HASH_ITER(hh, r->groups, g, gt) {
    if (g->complete) {
      for (int k = 1; k < g->world; k++)
        if (t - g->seen[k] > (int64_t)r->o.heartbeat_ms * r->o.dead_after) {
          char why[160];
          snprintf(why, sizeof why, "rank %d of group %s is silent", k, g->name);
          group_failed(r, g, why);
          break;
        }
      continue;
    }
    if (!g->complete && t - g->created > 120000) {
      TD_WARN("worker group %s: %d of %d ranks joined in 120 s; dropped", g->name, g->joined, g->world);
      HASH_DEL(r->groups, g);
      group_free(g);
    }
  }
  /* placement, first come first served */
  while (r->n_queue > 0) {
    rreq *head = r->queue[0];
    if (!place(r, head)) {
      /* no worker with the role at all: fail now rather than wait */
      if (count_role(r, 2) == 0) {
        req_fail(r, head, TANDEM__ERROR_CODE__ERROR_UNAVAILABLE, "no decode worker is registered");
        continue;
      }
      break;
    }
    queue_remove(r, head);
  }
}

/* ------------------------------------------------------------ lifecycle */

td_status td_router_create(const td_router_opts *opts, td_router **out) {
  *out = NULL;
  td_router *r = calloc(1, sizeof *r);
  if (!r) return td_err(TD_ERR_NOMEM, "out of memory");
  r->o = *opts;
  td_router_opts *o = &r->o;
  if (o->heartbeat_ms <= 0) o->heartbeat_ms = 500;
  if (o->dead_after <= 0) o->dead_after = 6;
  if (o->max_queue <= 0) o->max_queue = 1024;
  if (o->max_in_flight <= 0) o->max_in_flight = 4096;
  if (o->default_timeout_ms <= 0) o->default_timeout_ms = 600000;
  if (o->stage_timeout_ms <= 0) o->stage_timeout_ms = 60000;
  if (o->max_attempts <= 0) o->max_attempts = 3;
  if (o->prefill_threshold <= 0) o->prefill_threshold = 16;
  r->ctx = zmq_ctx_new();
  r->csock = r->ctx ? zmq_socket(r->ctx, ZMQ_ROUTER) : NULL;
  r->wsock = r->ctx ? zmq_socket(r->ctx, ZMQ_ROUTER) : NULL;
  td_status s = TD_OK;
  if (!r->csock || !r->wsock) {
    s = td_err(TD_ERR_NETWORK, "zmq: %s", zmq_strerror(zmq_errno()));
    goto fail;
  }
  td_wire_setup_socket(r->csock);
  td_wire_setup_socket(r->wsock);
  /* a worker that reconnects with the same id takes over its identity */
  int handover = 1;
  zmq_setsockopt(r->wsock, ZMQ_ROUTER_HANDOVER, &handover, sizeof handover);
  if (zmq_bind(r->csock, o->client_endpoint) != 0) {
    s = td_err(TD_ERR_NETWORK, "cannot bind the client endpoint %s: %s", o->client_endpoint,
               zmq_strerror(zmq_errno()));
    goto fail;
  }
  if (zmq_bind(r->wsock, o->worker_endpoint) != 0) {
    s = td_err(TD_ERR_NETWORK, "cannot bind the worker endpoint %s: %s", o->worker_endpoint,
               zmq_strerror(zmq_errno()));
    goto fail;
  }
  r->model = (Tandem__ModelInfo)TANDEM__MODEL_INFO__INIT;
  r->next_serial = 1;
  *out = r;
  return TD_OK;
fail:
  td_router_destroy(r);
  return s;
}

void td_router_destroy(td_router *r) {
  if (!r) return;
  rreq *q, *t;
  HASH_ITER(hh, r->by_rid, q, t) req_free(r, q);
  worker *w, *wt;
  HASH_ITER(hh, r->workers, w, wt) {
    HASH_DEL(r->workers, w);
    free(w->desc);
    free(w);
  }
  group_rv *g, *gt;
  HASH_ITER(hh, r->groups, g, gt) {
    HASH_DEL(r->groups, g);
    group_free(g);
  }
  free(r->queue);
  if (r->csock) zmq_close(r->csock);
  if (r->wsock) zmq_close(r->wsock);
  if (r->ctx) zmq_ctx_term(r->ctx);
  free(r);
}

td_status td_router_run(td_router *r, volatile sig_atomic_t *stop) {
  TD_INFO("router serving clients on %s, workers on %s; cross pool mode %s", r->o.client_endpoint,
          r->o.worker_endpoint, td_cross_mode_name(r->o.cross_mode));
  while (!*stop) {
    zmq_pollitem_t items[2] = {{.socket = r->csock, .events = ZMQ_POLLIN},
                               {.socket = r->wsock, .events = ZMQ_POLLIN}};
    int rc = zmq_poll(items, 2, 20);
    if (rc < 0) {
      if (zmq_errno() == EINTR) continue;
      return td_err(TD_ERR_NETWORK, "zmq poll: %s", zmq_strerror(zmq_errno()));
    }
    /* workers first: their news frees capacity for new requests */
    for (int k = 0; (items[1].revents & ZMQ_POLLIN) && k < 4096; k++) {
      int ev = 0;
      size_t l = sizeof ev;
      zmq_getsockopt(r->wsock, ZMQ_EVENTS, &ev, &l);
      if (!(ev & ZMQ_POLLIN)) break;
      on_worker(r);
    }
    for (int k = 0; (items[0].revents & ZMQ_POLLIN) && k < 1024; k++) {
      int ev = 0;
      size_t l = sizeof ev;
      zmq_getsockopt(r->csock, ZMQ_EVENTS, &ev, &l);
      if (!(ev & ZMQ_POLLIN)) break;
      on_client(r);
    }
    timers(r);
  }
  /* tell clients and workers */
  rreq *q, *t;
  HASH_ITER(hh, r->by_rid, q, t) req_fail(r, q, TANDEM__ERROR_CODE__ERROR_UNAVAILABLE, "the router is shutting down");
  Tandem__Cluster__Shutdown sd = TANDEM__CLUSTER__SHUTDOWN__INIT;
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_SHUTDOWN;
  m.shutdown = &sd;
  worker *w, *wt;
  HASH_ITER(hh, r->workers, w, wt)(void) send_worker(r, w, &m);
  TD_INFO("router stopped");
  return TD_OK;
}
