/* Worker groups (tensor / pipeline parallel), what the leader and its
 * followers share: the rendezvous through the router, the leader's
 * endpoint pair, and which slice of a whole-model KV block a rank holds.
 * The follower's process is follower.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/defaults.h"
#include "common/log.h"
#include "common/net.h"
#include "kvcache/kvcache.h"
#include "worker/group.h"
#include "worker/role.h"

td_status group_check_addresses(const td_worker_opts *o) {
  if (o->advertise) return td_net_check_advertise(o->advertise);
  /* peers would be told the address bound */
  if (td_net_is_wildcard(o->listen_host))
    return td_err(TD_ERR_INVALID, "--host %s: a wildcard is no address peers can dial; give --advertise ADDR, the "
                  "address they reach this worker at", o->listen_host);
  return TD_OK;
}

td_status group_sec_server(void *arg, void *sock) {
  group_keys *k = arg;
  TD_TRY(td_auth_server(k->auth, sock, TD_AUTH_DOMAIN_GROUP));
  return td_zap_watch(k->zap, sock, "group");
}

td_status group_sec_client(void *arg, void *sock, int peer) {
  group_keys *k = arg;
  if (!k->auth) return TD_OK;
  if (!k->gi->has_keys || peer < 0 || peer >= k->gi->world)
    return td_err(TD_ERR_INVALID, "rank %d of the group has no CURVE key from the router", peer);
  return td_auth_client(k->auth, sock, k->gi->keys[peer]);
}

td_status group_admit_ranks(const group_keys *k) {
  if (!k->auth) return TD_OK;
  if (!k->gi->has_keys)
    return td_err(TD_ERR_INVALID, "the router named no key for the group's ranks (a router without keys?)");
  const char *keys[TD_GROUP_MAX_RANKS];
  for (int r = 0; r < k->gi->world; r++) keys[r] = k->gi->keys[r];
  return td_zap_set_group(k->zap, keys, k->gi->world);
}

td_status group_comm_bind(const td_worker_opts *o, group_keys *k, void *zmq_ctx, td_comm_zmq_boot **boot, char *ep,
                          size_t cap) {
  td_comm_zmq_sec sec = {.zmq_ctx = zmq_ctx, .server = group_sec_server, .client = group_sec_client, .arg = k};
  TD_TRY(td_comm_zmq_bind(o->listen_host, k->auth ? &sec : NULL, boot));
  return td_net_advertised(td_comm_zmq_endpoint(*boot), o->advertise, ep, cap);
}

bool group_encoder_only(const td_worker_opts *o) {
  bool enc = o->n_roles > 0;
  for (int i = 0; i < o->n_roles; i++) enc &= o->roles[i]->id == TANDEM__CLUSTER__ROLE__ROLE_ENCODE;
  return enc;
}

void group_info_free(group_info *g) {
  for (int i = 0; i < g->world; i++) free(g->endpoints[i]);
  memset(g, 0, sizeof *g);
}

td_status group_rendezvous(void *rsock, const char *group, int rank, int world, const char *endpoint,
                           const uint8_t *nccl_id, size_t nccl_len, td_cross_mode cross_mode, bool encoder_states,
                           bool enc_rows, int timeout_ms, volatile sig_atomic_t *stop, group_info *out) {
  memset(out, 0, sizeof *out);
  if (world > TD_GROUP_MAX_RANKS)
    return td_err(TD_ERR_INVALID, "group %s of %d ranks: at most %d", group, world, TD_GROUP_MAX_RANKS);
  Tandem__Cluster__GroupJoin j = TANDEM__CLUSTER__GROUP_JOIN__INIT;
  j.group = (char *)group;
  j.rank = (uint32_t)rank;
  j.world = (uint32_t)world;
  j.endpoint = (char *)endpoint;
  j.nccl_id.data = (uint8_t *)nccl_id;
  j.nccl_id.len = nccl_len;
  j.cross_mode = (char *)td_cross_mode_name(cross_mode);
  j.encoder_states = encoder_states;
  j.encoder_split = (char *)(enc_rows ? "rows" : "heads");
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.version = TD_PROTOCOL_VERSION;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_GROUP_JOIN;
  m.group_join = &j;
  TD_TRY(td_wire_send(rsock, NULL, 0, &m.base));
  int64_t end = td_now_ms() + timeout_ms, resend = td_now_ms() + TD_GROUP_JOIN_RESEND_MS;
  while (!(stop && *stop)) {
    if (td_now_ms() > end)
      return td_err(TD_ERR_TIMEOUT, "group %s: the other ranks did not join within %d ms", group, timeout_ms);
    zmq_pollitem_t it = {.socket = rsock, .events = ZMQ_POLLIN};
    if (zmq_poll(&it, 1, TD_WORKER_STOP_CHECK_MS) <= 0) {
      /* the router may have started after us: ask again */
      if (td_now_ms() > resend) {
        (void)td_wire_send(rsock, NULL, 0, &m.base);
        resend = td_now_ms() + TD_GROUP_JOIN_RESEND_MS;
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
    out->has_keys = gi->n_keys == (size_t)world;
    for (int r = 0; out->has_keys && r < world; r++) {
      out->has_keys = gi->keys[r] && strlen(gi->keys[r]) == TD_AUTH_KEY_Z85 - 1;
      if (out->has_keys) snprintf(out->keys[r], sizeof out->keys[r], "%s", gi->keys[r]);
    }
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

