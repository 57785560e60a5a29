/* Which KV transport reaches a target, on the main thread. A worker holds
 * a ZeroMQ transport always and a UCX one when it is single-rank and may
 * (--kv-transport auto|ucx); it registers one descriptor (TransferDesc)
 * naming every way to push to it. A sender takes UCX where both sides can
 * (same block geometry, a single-rank receiver that offers it), else
 * ZeroMQ, and logs the path once per receiver (docs/architecture.md, "How
 * KV blocks travel between workers"). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "worker/internal.h"

/* The KV path last logged for a receiver. */
struct kvlog {
  char id[TD_WIRE_MAX_ID + 1];
  const td_kvt *t; /* NULL: no way */
  UT_hash_handle hh;
};

static void log_path(td_worker *w, const char *peer, const kv_route *r) {
  kvlog *l = NULL;
  HASH_FIND_STR(w->kvlogs, peer, l);
  if (l && l->t == r->t) return;
  if (!l && strlen(peer) <= TD_WIRE_MAX_ID && (l = calloc(1, sizeof *l)) != NULL) {
    snprintf(l->id, sizeof l->id, "%s", peer);
    HASH_ADD_STR(w->kvlogs, id, l);
  }
  if (l) l->t = r->t;
  if (!r->t)
    TD_WARN("KV to %s: no way: %s", peer, r->why);
  else if (td_kvt_get_kind(r->t) == TD_KVT_UCX)
    TD_INFO("KV to %s: over UCX, straight into its pool", peer);
  else
    TD_INFO("KV to %s: over ZeroMQ (%s)", peer, r->why);
}

void w_kv_route_free(kv_route *r) {
  if (r->d) tandem__cluster__transfer_desc__free_unpacked(r->d, NULL);
  r->d = NULL;
}

/* Why UCX does not reach the target of descriptor d (NULL: a bare ZeroMQ
 * descriptor); false when it does. */
static bool no_ucx(td_worker *w, const char *peer, const Tandem__Cluster__TransferDesc *d, bool cross, char *why,
                   size_t cap) {
  td_kvt *ucx = w->kvt[TD_KVT_UCX];
  if (!d)
    snprintf(why, cap, "it offers ZeroMQ only");
  else if (!strcmp(w->o.transfer, "zmq"))
    snprintf(why, cap, "--kv-transport zmq here");
  else if (!ucx)
    snprintf(why, cap, "this worker has no UCX engine");
  else if (d->ranks > 1)
    snprintf(why, cap, "it is a TP/PP group, whose leader re-slices the blocks");
  else if (!d->kvx.len)
    snprintf(why, cap, "it offers no UCX (--kv-transport zmq there)");
  else
    return !td_kvt_route(ucx, peer, d->kvx.data, d->kvx.len, cross, why, cap);
  return true;
}

void w_kv_route(td_worker *w, const Tandem__Cluster__KvTarget *t, bool cross, kv_route *r) {
  memset(r, 0, sizeof *r);
  const char *peer = t->worker_id ? t->worker_id : "?";
  const uint8_t *b = t->desc.data;
  size_t len = t->desc.len;
  const uint8_t *zd = b; /* the target's ZeroMQ descriptor */
  size_t zlen = len;
  /* a bare ZeroMQ endpoint: a worker from before TransferDesc */
  if (!(len > 4 && !memcmp(b, "zmq:", 4))) {
    r->d = tandem__cluster__transfer_desc__unpack(NULL, len, b);
    if (!r->d || r->d->version != TD_PROTOCOL_VERSION) {
      if (r->d)
        snprintf(r->why, sizeof r->why, "its KV descriptor has protocol version %u, this worker's %u", r->d->version,
                 TD_PROTOCOL_VERSION);
      else
        snprintf(r->why, sizeof r->why, "its KV descriptor is malformed");
      w_kv_route_free(r);
      log_path(w, peer, r);
      return;
    }
    zd = (const uint8_t *)(r->d->zmq ? r->d->zmq : "");
    zlen = strlen((const char *)zd);
  }
  char why[400] = "", zwhy[100] = "";
  if (!no_ucx(w, peer, r->d, cross, why, sizeof why)) {
    r->t = w->kvt[TD_KVT_UCX];
    r->desc = r->d->kvx.data;
    r->desc_len = r->d->kvx.len;
  } else if (!strcmp(w->o.transfer, "ucx")) {
    snprintf(r->why, sizeof r->why, "--kv-transport ucx, but %s", why);
  } else if (!td_kvt_route(w->kvt[TD_KVT_ZMQ], peer, zd, zlen, cross, zwhy, sizeof zwhy)) {
    snprintf(r->why, sizeof r->why, "%s, and %s", zwhy, why);
  } else {
    r->t = w->kvt[TD_KVT_ZMQ];
    r->desc = zd;
    r->desc_len = zlen;
    snprintf(r->why, sizeof r->why, "%s", why);
  }
  log_path(w, peer, r);
}

bool w_kv_host_copy(td_worker *w, Tandem__Cluster__KvTarget *const *targets, size_t n, bool cross) {
  bool host = false;
  for (size_t i = 0; i < n && !host; i++) {
    kv_route r;
    w_kv_route(w, targets[i], cross, &r);
    host = !r.t || td_kvt_host_copy(r.t);
    w_kv_route_free(&r);
  }
  return host;
}

static td_status build_desc(td_worker *w) {
  Tandem__Cluster__TransferDesc d = TANDEM__CLUSTER__TRANSFER_DESC__INIT;
  d.version = TD_PROTOCOL_VERSION;
  size_t zlen;
  const uint8_t *z = td_kvt_desc(w->kvt[TD_KVT_ZMQ], &zlen);
  char *zs = strndup((const char *)z, zlen);
  if (!zs) return td_err(TD_ERR_NOMEM, "out of memory");
  d.zmq = zs;
  if (w->kvt[TD_KVT_UCX]) {
    size_t len;
    d.kvx.data = (uint8_t *)td_kvt_desc(w->kvt[TD_KVT_UCX], &len);
    d.kvx.len = len;
  }
  d.ranks = (uint32_t)w->world;
  w->desc_len = tandem__cluster__transfer_desc__get_packed_size(&d);
  w->desc = malloc(w->desc_len + 1);
  if (w->desc) tandem__cluster__transfer_desc__pack(&d, w->desc);
  free(zs);
  return w->desc ? TD_OK : td_err(TD_ERR_NOMEM, "out of memory");
}

td_status w_kv_start(td_worker *w) {
  const td_worker_opts *o = &w->o;
  bool ucx_only = !strcmp(o->transfer, "ucx"), zmq_only = !strcmp(o->transfer, "zmq");
  td_kvt_hooks hooks = w_kv_hooks(w);
  td_kvt_opts ko = w->pools;
  ko.name = w->id;
  ko.listen_host = o->listen_host;
  ko.advertise = o->advertise;
  ko.timeout_ms = o->transfer_timeout_ms;
  ko.auth = o->auth;
  /* peers push blocks of this model: whole-decoder cross or self blocks, in
   * float32 at most (a CPU sender's to a bf16 receiver must still arrive, to
   * be refused with the size error rather than a dropped connection) */
  size_t ce = td_kv_block_elems(&w->full_cross), se = td_kv_block_elems(&w->full_self);
  ko.max_block_bytes = (ce > se ? ce : se) * sizeof(float);
  ko.kvx = o->settings.kvx;
  TD_TRY(td_kvt_create(&td_kvt_zmq, &ko, &hooks, &w->kvt[TD_KVT_ZMQ]));
  /* A group's ranks hold slices: blocks for it go through the leader's
   * re-slicing (ZeroMQ), so only single-rank workers register pools. */
  if (!zmq_only && w->world == 1) {
    td_status s = td_kvt_create(&td_kvt_ucx, &ko, &hooks, &w->kvt[TD_KVT_UCX]);
    if (s != TD_OK && ucx_only) return s;
    if (s != TD_OK) TD_WARN("KV over ZeroMQ only: UCX did not start: %s", td_errmsg());
  }
  TD_TRY(build_desc(w));
  for (int k = 0; k < TD_KVT_KINDS; k++)
    if (w->kvt[k]) TD_TRY(td_kvt_watch(w->kvt[k], w->loop));
  return TD_OK;
}

/* UCX first: it stops what still moves while the pools it registered exist
 * (the engine frees them later); no hook fires any more. */
void w_kv_stop(td_worker *w) {
  for (int k = 0; k < TD_KVT_KINDS; k++) {
    td_kvt_destroy(w->kvt[k]);
    w->kvt[k] = NULL;
  }
  kvlog *l, *t;
  HASH_ITER(hh, w->kvlogs, l, t) {
    HASH_DEL(w->kvlogs, l);
    free(l);
  }
  free(w->desc);
  w->desc = NULL;
}
