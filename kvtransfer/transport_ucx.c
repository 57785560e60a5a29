/* The UCX KV transport (td_kvt_ucx) between single-rank workers, over
 * td_kvx (UCX puts, staged GPU pools, NCCL). The engine's own pools are
 * registered with td_kvx, so a sender posts straight from its blocks into
 * the blocks a receiver reserved: no host copy on either side and nothing
 * for the receiver's compute thread to write. The receiver grants a
 * transfer only while the reservation is open (the accept hook) and the
 * blocks stay the transfer's until its recv event (busy). Its descriptor
 * is td_kvx's (pools, UCX address). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <uthash.h>
#include <utlist.h>

#include "common/log.h"
#include "kvtransfer/kvtransfer.h"
#include "kvtransfer/transport.h"
#include "proto/wire.h"

/* td_kvx_progress calls a turn, so that a stream of completions cannot stall the loop */
#define PROGRESS_BURST 64
/* the pool ids both sides use */
#define POOL_CROSS 1u
#define POOL_SELF 2u

/* A receiver we push to, by worker id (a restarted worker comes back with
 * another td_kvx context uuid: reconnect then). */
typedef struct upeer {
  char id[TD_WIRE_MAX_ID + 1];
  uint64_t uuid;
  td_kvx_peer *p;
  UT_hash_handle hh;
} upeer;

/* Source blocks of cancelled pushes: given back once the last of them
 * stopped reading. */
typedef struct uhold {
  int refs;
  bool cross;
  int32_t *blocks;
  int n;
} uhold;

typedef struct ux ux;

typedef struct upush {
  ux *u;
  uint64_t xfer_id, rid;
  int tag, n;
  bool forgotten; /* the job is gone: report to nobody */
  uhold *hold;
  struct upush *prev, *next;
} upush;

struct ux {
  td_kvt *t;
  td_kvx *k;
  const td_kvt_hooks *h;
  td_loop *loop;
  int fd_ev;
  td_kvx_geom geom[2]; /* cross, self */
  uint8_t *desc;
  size_t desc_len;
  upeer *peers;
  upush *pushes;
  int n_pushes;
  bool closing; /* destroying: callbacks only free their records */
};

static uint32_t pool_id(bool cross) { return cross ? POOL_CROSS : POOL_SELF; }

/* ---- receiver side ---- */

static td_status on_authorize(void *ctx, const td_kvx_grant_req *r) {
  ux *u = ctx;
  if (u->closing) return td_err(TD_ERR_CANCELLED, "the receiving worker is shutting down");
  if (r->pool_id != POOL_CROSS && r->pool_id != POOL_SELF) return td_err(TD_ERR_INVALID, "no pool %u", r->pool_id);
  char why[256] = "";
  /* r->bytes is what the sender's plan writes: whole blocks only where its geometry is ours */
  size_t block_bytes = (size_t)(r->bytes / (uint64_t)r->n_blocks);
  /* UCX has no CURVE: the sender is known by the token it carries only */
  td_kvt_offer o = {.rid = r->request_id, .reservation = r->reservation_id, .cross = r->pool_id == POOL_CROSS,
                    .blocks = r->blocks, .n = r->n_blocks, .block_bytes = block_bytes, .token = r->token};
  if (!u->h->accept(u->h->ctx, &o, why, sizeof why)) {
    TD_WARN("refused a KV push over UCX for request %" PRIu64 ": %s", r->request_id, why);
    return td_err(TD_ERR_INVALID, "%s", why);
  }
  return TD_OK;
}

static void on_recv(void *ctx, const td_kvx_recv_event *ev) {
  ux *u = ctx;
  if (u->closing) return;
  if (ev->status == TD_OK) {
    /* the blocks are in the pool already: nothing to deliver */
    u->h->arrived(u->h->ctx, u->t, ev->request_id, ev->reservation_id, ev->pool_id == POOL_CROSS, ev->blocks,
                  ev->n_blocks);
  } else {
    /* the sender reports its failure to the router, which retries */
    TD_WARN("KV of request %" PRIu64 " over UCX did not arrive: %s", ev->request_id,
            ev->message ? ev->message : td_status_str(ev->status));
  }
}

static void on_peer(void *ctx, td_kvx_peer *p, uint64_t uuid, td_status s, const char *msg) {
  ux *u = ctx;
  if (!p) {
    TD_INFO("a KV sender (%016" PRIx64 ") went away: %s", uuid, msg ? msg : td_status_str(s));
    return;
  }
  /* its transfers already ended with TD_ERR_PEER; the next push reconnects */
  upeer *e, *t;
  HASH_ITER(hh, u->peers, e, t) if (e->p == p) {
    TD_WARN("KV receiver %s failed: %s", e->id, msg ? msg : td_status_str(s));
    HASH_DEL(u->peers, e);
    free(e);
  }
  td_kvx_disconnect(p);
}

/* ---- sender side ---- */

static void hold_drop(ux *u, uhold *h) {
  if (!h || --h->refs > 0) return;
  if (u->closing)
    free(h->blocks);
  else
    u->h->release(u->h->ctx, h->cross, h->blocks, h->n); /* takes the array */
  free(h);
}

static void on_done(void *arg, uint64_t xfer_id, td_status s, const char *msg) {
  upush *p = arg;
  ux *u = p->u;
  DL_DELETE(u->pushes, p);
  u->n_pushes--;
  if (p->forgotten || u->closing)
    hold_drop(u, p->hold);
  else
    u->h->pushed(u->h->ctx, u->t, p->rid, p->tag, p->n, s == TD_OK,
                 s == TD_OK ? NULL : (msg && *msg ? msg : td_status_str(s)));
  free(p);
}

static bool geom_equal(const td_kvx_geom *a, const td_kvx_geom *b) {
  return a->layout.n_layers == b->layout.n_layers && a->layout.n_heads == b->layout.n_heads &&
         a->layout.head_dim == b->layout.head_dim && a->layout.block_size == b->layout.block_size &&
         a->layout.states == b->layout.states &&
         a->elem_size == b->elem_size && a->layer0 == b->layer0 && a->layer1 == b->layer1 && a->head0 == b->head0 &&
         a->head1 == b->head1;
}

static void geom_text(const td_kvx_geom *g, char *out, size_t cap) {
  snprintf(out, cap, "%d layers x %d heads x %d dims and %d-wide states, %d-token blocks of %d-byte elements",
           g->layout.n_layers, g->layout.n_heads, g->layout.head_dim, g->layout.states, g->layout.block_size,
           g->elem_size);
}

/* The connected peer for a receiver's descriptor; NULL with td_err. */
static td_kvx_peer *get_peer(ux *u, const char *id, const uint8_t *desc, size_t len, uint64_t uuid) {
  upeer *e = NULL;
  HASH_FIND_STR(u->peers, id, e);
  if (e && e->uuid == uuid && td_kvx_peer_status(e->p) == TD_OK) return e->p;
  if (e) {
    HASH_DEL(u->peers, e);
    td_kvx_disconnect(e->p);
    free(e);
  }
  if (strlen(id) > TD_WIRE_MAX_ID) {
    td_err(TD_ERR_INVALID, "worker id too long");
    return NULL;
  }
  e = calloc(1, sizeof *e);
  if (!e) {
    td_err(TD_ERR_NOMEM, "out of memory");
    return NULL;
  }
  if (td_kvx_connect(u->k, desc, len, &e->p) != TD_OK) {
    free(e);
    return NULL;
  }
  snprintf(e->id, sizeof e->id, "%s", id);
  e->uuid = uuid;
  HASH_ADD_STR(u->peers, id, e);
  return e->p;
}

static bool ux_route(td_kvt *t, const char *peer_id, const uint8_t *desc, size_t len, bool cross, char *why,
                     size_t cap) {
  ux *u = t->ctx;
  td_kvx_desc_info info;
  if (td_kvx_desc_parse(desc, len, &info) != TD_OK) {
    snprintf(why, cap, "its UCX descriptor is unreadable (%s)", td_errmsg());
    return false;
  }
  const td_kvx_pool_info *pi = NULL;
  for (int i = 0; i < info.n_pools; i++)
    if (info.pools[i].pool_id == pool_id(cross)) pi = &info.pools[i];
  if (!pi) {
    snprintf(why, cap, "it registered no %s pool with UCX", cross ? "cross-attention" : "self-attention");
    return false;
  }
  const td_kvx_geom *mine = &u->geom[cross ? 0 : 1];
  /* a pool of encoder states only into blocks with the same states tail: the tails move (a states push) */
  bool states_push = cross && mine->layout.n_layers == 0 && mine->layout.states > 0 && pi->geom.layout.n_layers > 0 &&
                     pi->geom.layout.states == mine->layout.states && pi->geom.layout.block_size == mine->layout.block_size &&
                     pi->geom.layout.head_dim == mine->layout.head_dim && pi->geom.elem_size == mine->elem_size &&
                     pi->geom.layer0 == 0 && pi->geom.head0 == mine->head0 && pi->geom.head1 == mine->head1;
  if (!states_push && !geom_equal(mine, &pi->geom)) {
    /* e.g. a CPU worker (float32) and a CUDA worker (bf16): ZeroMQ's size check refuses it clearly */
    char a[160], b[160];
    geom_text(mine, a, sizeof a);
    geom_text(&pi->geom, b, sizeof b);
    snprintf(why, cap, "its KV blocks differ (here %s, there %s)", a, b);
    return false;
  }
  if (!get_peer(u, peer_id, desc, len, info.uuid)) {
    snprintf(why, cap, "cannot connect over UCX (%s)", td_errmsg());
    return false;
  }
  return true;
}

static td_status ux_push(td_kvt *t, const td_kvt_push *q) {
  ux *u = t->ctx;
  if (q->n > 0 && !q->src_blocks) return td_err(TD_ERR_INVALID, "UCX push without source blocks");
  td_kvx_desc_info info;
  TD_TRY(td_kvx_desc_parse(q->peer_desc, q->peer_desc_len, &info));
  td_kvx_peer *peer = get_peer(u, q->peer_id, q->peer_desc, q->peer_desc_len, info.uuid);
  if (!peer) return TD_ERR_NETWORK;
  upush *p = calloc(1, sizeof *p);
  if (!p) return td_err(TD_ERR_NOMEM, "out of memory");
  p->u = u;
  p->rid = q->rid;
  p->tag = q->tag;
  p->n = q->n;
  /* The blocks were finished before the compute thread reported them
   * (it synchronises its stream first): no ready event is needed. */
  td_kvx_xfer x = {.request_id = q->rid, .reservation_id = q->reservation, .src_pool = pool_id(q->cross),
                   .dst_pool = pool_id(q->cross), .src_blocks = q->src_blocks, .dst_blocks = q->dst, .n_blocks = q->n,
                   .transport = TD_KVX_AUTO};
  if (q->token) memcpy(x.token, q->token, TD_KV_TOKEN_BYTES);
  td_status s = td_kvx_post(peer, &x, on_done, p, &p->xfer_id);
  if (s != TD_OK) {
    free(p);
    return s;
  }
  DL_APPEND(u->pushes, p);
  u->n_pushes++;
  return TD_OK;
}

static bool ux_forget(td_kvt *t, uint64_t rid, int tag, bool cross, int32_t *blocks, int n) {
  ux *u = t->ctx;
  uhold *h = NULL;
  bool took = false;
  upush *p;
  DL_FOREACH(u->pushes, p) {
    if (p->rid != rid || p->tag != tag || p->forgotten) continue;
    if (blocks && !took) {
      took = true;
      h = calloc(1, sizeof *h);
      if (h)
        *h = (uhold){0, cross, blocks, n};
      else /* better lose the blocks than hand them out while they are read */
        TD_ERROR("out of memory holding the blocks of request %" PRIu64, rid);
    }
    p->forgotten = true;
    p->hold = h;
    if (h) h->refs++;
    /* its callback still comes (TD_ERR_CANCELLED) once nothing reads the blocks */
    if (td_kvx_cancel(u->k, p->xfer_id) != TD_OK) td_err_clear();
  }
  return took;
}

static bool ux_busy(const td_kvt *t, uint64_t reservation) {
  const ux *u = t->ctx;
  return td_kvx_reservation_busy(u->k, reservation);
}

static int ux_pending(const td_kvt *t) { return ((const ux *)t->ctx)->n_pushes; }
static bool ux_arm(td_kvt *t) { return td_kvx_arm(((ux *)t->ctx)->k); }

static void ux_progress(td_kvt *t) {
  ux *u = t->ctx;
  for (int i = 0; i < PROGRESS_BURST && td_kvx_progress(u->k) > 0; i++) {
  }
}

static void on_readable(td_loop *l, void *ctx) {
  (void)l;
  ux_progress(ctx);
}

static td_status ux_watch(td_kvt *t, td_loop *l) {
  ux *u = t->ctx;
  if (u->loop) td_loop_remove(u->loop, u->fd_ev);
  u->fd_ev = 0;
  u->loop = l;
  return l ? td_loop_add_fd(l, td_kvx_fd(u->k), on_readable, t, &u->fd_ev) : TD_OK;
}

static const uint8_t *ux_desc(const td_kvt *t, size_t *len) {
  const ux *u = t->ctx;
  *len = u->desc_len;
  return u->desc;
}

static void ux_destroy(td_kvt *t) {
  ux *u = t->ctx;
  if (!u) return;
  (void)ux_watch(t, NULL);
  u->closing = true;
  /* cancels what still runs; the callbacks free their records */
  td_kvx_destroy(u->k);
  upeer *e, *et;
  HASH_ITER(hh, u->peers, e, et) {
    HASH_DEL(u->peers, e);
    free(e);
  }
  upush *p, *pt;
  DL_FOREACH_SAFE(u->pushes, p, pt) { /* none left unless a callback never came */
    DL_DELETE(u->pushes, p);
    free(p);
  }
  free(u->desc);
  free(u);
  t->ctx = NULL;
}

static uint64_t ux_ipc_blocks(const td_kvt *t) {
  const ux *u = t->ctx;
  return td_kvx_get_stats(u->k).ipc_blocks;
}

static td_status ux_create(td_kvt *t, const td_kvt_opts *o) {
  ux *u = calloc(1, sizeof *u);
  if (!u) return td_err(TD_ERR_NOMEM, "out of memory");
  t->ctx = u;
  u->t = t;
  u->h = &t->hooks;
  td_kvx_opts ko = {.name = o->name, .cuda_device = o->cuda ? o->device : -1, .timeout_ms = o->timeout_ms,
                    .local_path = o->kvx.local_path == TD_OFF ? TD_KVX_LOCAL_OFF : TD_KVX_LOCAL_AUTO,
                    .no_ipc = o->kvx.ipc == TD_OFF,
                    .ucx_tls = o->kvx.ucx_tls, .trace = o->kvx.trace, .bind_addr = o->advertise ? o->advertise : o->listen_host,
                    .ucx_net_devices = o->kvx.ucx_net_devices,
                    .authorize = on_authorize, .on_recv = on_recv, .on_peer = on_peer, .ctx = u};
  td_status s = td_kvx_create(&ko, &u->k);
  for (int i = 0; s == TD_OK && i < 2; i++) {
    bool cross = i == 0;
    td_kvx_geom *g = &u->geom[i];
    /* the pool holds its layout's whole range (single-rank workers only) */
    const td_kvt_pool *pool = cross ? &o->cross : &o->self;
    const td_kv_layout *l = &pool->layout;
    *g = (td_kvx_geom){.layout = *l, .elem_size = o->elem_size, .layer0 = 0, .layer1 = l->n_layers, .head0 = 0,
                       .head1 = l->n_heads};
    if (td_kvx_block_bytes(g) != pool->block_bytes) {
      s = td_err(TD_ERR_INTERNAL, "%s pool: blocks of %zu bytes, its UCX geometry gives %zu",
                 cross ? "cross" : "self", pool->block_bytes, td_kvx_block_bytes(g));
      break;
    }
    td_kvx_pool_desc pd = {.pool_id = pool_id(cross), .mem = o->cuda ? TD_KVX_MEM_CUDA : TD_KVX_MEM_HOST,
                           .base = pool->base, .n_blocks = pool->n_blocks, .geom = *g};
    s = td_kvx_register_pool(u->k, &pd);
  }
  if (s == TD_OK) s = td_kvx_export(u->k, &u->desc, &u->desc_len);
  if (s != TD_OK) ux_destroy(t);
  return s;
}

const td_kvt_i td_kvt_ucx = {
    .name = "ucx",
    .kind = TD_KVT_UCX,
    .host_copy = false,
    .create = ux_create,
    .destroy = ux_destroy,
    .desc = ux_desc,
    .route = ux_route,
    .push = ux_push,
    .forget = ux_forget,
    .busy = ux_busy,
    .pending = ux_pending,
    .watch = ux_watch,
    .arm = ux_arm,
    .progress = ux_progress,
    .ipc_blocks = ux_ipc_blocks,
};
