/* The receiver's side: peers that said HELLO (with their reply
 * endpoints), REQ checked against our pool and the application's
 * authorize callback, grants and their states (pending, active, closing,
 * ending) until the recv event, DENY / REVOKE / ACK, and the messages a
 * sender sends us. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kvtransfer/kvx_internal.h"

static kvx_rpeer *find_rpeer(td_kvx *k, uint64_t uuid) {
  kvx_rpeer *rp = NULL;
  HASH_FIND(hh, k->rpeers, &uuid, sizeof uuid, rp);
  return rp;
}

kvx_grant *kvx_find_grant(td_kvx *k, uint64_t uuid, uint64_t xid) {
  gkey key;
  memset(&key, 0, sizeof key);
  key.uuid = uuid;
  key.xid = xid;
  kvx_grant *g = NULL;
  HASH_FIND(hh, k->grants, &key, sizeof key, g);
  return g;
}

static void rpeer_maybe_free(kvx_rpeer *rp) {
  td_kvx *k = rp->k;
  if (!rp->failed || rp->n_grants > 0) return;
  DL_DELETE(k->rzombies, rp);
  free(rp);
}

/* The grant is over: once no host-to-device copy is pending, its blocks
 * are released to the application with the event. */
void kvx_grant_end(kvx_grant *g, td_status s, const char *msg) {
  if (g->gst == G_ENDING) return;
  g->est = s;
  kvx_set_text(g->emsg, msg);
  g->gst = G_ENDING;
  if (g->ns) {
    /* Only a communicator abort stops a queued receive (it was aborted
     * when any is left here). */
    kvx_nstream_drop_ops(g->k, g->ns, true);
    g->ns->drain_deadline = td_now_ms() + TD_KVX_GRANT_GRACE_MS;
  }
}

/* Whether the grant's NCCL copies (and stopped receives) are over, so its
 * blocks and slots may go back. A receive that an aborted communicator
 * does not stop is given up on after a grace period. */
bool kvx_grant_drained(kvx_grant *g) {
  if (!g->ns || kvx_nstream_quiet(g->k, g->ns)) return true;
  if (td_now_ms() <= g->ns->drain_deadline) return false;
  TD_WARN("kvx %s: grant %016" PRIx64 "/%" PRIu64 ": NCCL copies still pending after %d ms; releasing the blocks",
          g->k->name, g->key.uuid, g->key.xid, TD_KVX_GRANT_GRACE_MS);
  return true;
}

void kvx_grant_finalize(kvx_grant *g) {
  td_kvx *k = g->k;
  HASH_DEL(k->grants, g);
  for (int i = 0; i < g->n_slots; i++) k->recv_free[k->n_recv_free++] = g->slots[i];
  g->n_slots = 0;
  kvx_nstream_free(k, g->ns, 1);
  g->ns = NULL;
  g->pool->users--;
  g->rp->n_grants--;
  if (g->est == TD_OK) {
    k->st.grants_ok++;
    k->st.bytes_received += g->received;
  } else {
    k->st.grants_failed++;
  }
  g->dnext = k->gdone;
  k->gdone = g;
  TD_DEBUG("kvx %s: grant %016" PRIx64 "/%" PRIu64 " (request %" PRIu64 ") ended: %s %s", k->name, g->key.uuid,
           g->key.xid, g->request_id, td_status_str(g->est), g->emsg);
  rpeer_maybe_free(g->rp);
}

/* Receiver-side failure: tell the sender to stop and wait for its ABORT
 * (or its death) before the blocks go back. */
void kvx_grant_revoke(kvx_grant *g, td_status s, const char *msg) {
  td_kvx *k = g->k;
  if (g->gst == G_CLOSING || g->gst == G_ENDING) return;
  if (g->nccl && g->rp->nccl) {
    /* A queued receive stops only with the communicator (which revokes
     * this grant and every other NCCL grant of the peer). */
    kvx_rpeer_nccl_abort(g->rp, s, msg, true);
    return;
  }
  g->est = s;
  kvx_set_text(g->emsg, msg);
  if (g->gst == G_PENDING && !g->nccl) {
    /* Nothing granted yet: no write can come. */
    kvx_send_status(k, g->rp->ep, KVX_MSG_DENY, g->key.xid, s, msg);
    kvx_grant_end(g, s, msg);
    return;
  }
  kvx_send_status(k, g->rp->ep, KVX_MSG_REVOKE, g->key.xid, s, msg);
  g->gst = G_CLOSING;
  g->hard_deadline = td_now_ms() + 2 * TD_KVX_GRANT_GRACE_MS;
}

void kvx_rpeer_fail(kvx_rpeer *rp, td_status s, const char *msg, bool event) {
  td_kvx *k = rp->k;
  if (rp->failed) return;
  rp->failed = true;
  HASH_DEL(k->rpeers, rp);
  DL_APPEND(k->rzombies, rp);
  k->st.rpeers--;
  kvx_rpeer_nccl_abort(rp, s, msg, false);
  kvx_grant *g, *tmp;
  HASH_ITER(hh, k->grants, g, tmp) {
    if (g->rp == rp) kvx_grant_end(g, s != TD_OK ? s : TD_ERR_CANCELLED, msg);
  }
  if (s != TD_OK) kvx_orphan_msgs(k, rp->ep, rp->fast_ep);
  kvx_close_ep(k, rp->ep, s != TD_OK, rp->own);
  kvx_close_ep(k, rp->fast_ep, false, NULL); /* no error handling: cannot be forced */
  rp->ep = NULL;
  rp->fast_ep = NULL;
  rp->own = NULL;
  if (event && k->o.on_peer) k->o.on_peer(k->o.ctx, NULL, rp->uuid, s, msg);
  rpeer_maybe_free(rp);
}

static int cmp_i32(const void *a, const void *b) {
  int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  return (x > y) - (x < y);
}

/* Whether every source is >= 0 and every destination a block of the pool,
 * each once (why says which not): a bit a block in k's scratch, cleared
 * again before returning. O(n): a sort of thousands of ids cost ~0.1-0.3 ms
 * of a 64 KiB-block transfer's critical path. */
static bool blocks_valid(td_kvx *k, const kvx_pool *pool, uint32_t dst_pool, const int32_t *src, const int32_t *dst,
                         uint32_t n, char *why) {
  size_t nb = (size_t)pool->d.n_blocks;
  if (k->seen_bits < nb) {
    uint64_t *b = calloc((nb + 63) / 64, sizeof *b);
    if (!b) {
      snprintf(why, KVX_TEXT, "receiver out of memory");
      return false;
    }
    free(k->seen);
    k->seen = b;
    k->seen_bits = (nb + 63) / 64 * 64;
  }
  uint32_t i = 0;
  for (; i < n; i++) {
    int32_t d = dst[i];
    if (d < 0 || (size_t)d >= nb || src[i] < 0) {
      snprintf(why, KVX_TEXT, "block %d outside pool %u (%d blocks)", d < 0 || (size_t)d >= nb ? d : src[i], dst_pool,
               pool->d.n_blocks);
      break;
    }
    uint64_t bit = 1ull << (d & 63);
    if (k->seen[d >> 6] & bit) {
      snprintf(why, KVX_TEXT, "destination block %d appears twice", d);
      break;
    }
    k->seen[d >> 6] |= bit;
  }
  for (uint32_t j = 0; j < i; j++) k->seen[dst[j] >> 6] = 0;
  return i == n;
}

void kvx_handle_hello(td_kvx *k, uint64_t uuid, kvx_rbuf *r) {
  uint32_t n = kvx_r_u32(r);
  const uint8_t *addr = (n > 0 && n <= KVX_MAX_ADDR) ? kvx_r_bytes(r, n) : NULL;
  uint64_t host = kvx_r_u64(r);
  if (!addr || r->bad) {
    TD_WARN("kvx %s: malformed HELLO from %016" PRIx64, k->name, uuid);
    return;
  }
  kvx_rpeer *rp = find_rpeer(k, uuid);
  if (rp) {
    rp->conns++;
    return;
  }
  rp = calloc(1, sizeof *rp);
  kvx_ep_owner *own = calloc(1, sizeof *own);
  if (!rp || !own) {
    free(rp);
    free(own);
    return;
  }
  own->k = k;
  rp->uuid = uuid;
  rp->host_id = host;
  rp->k = k;
  rp->own = own;
  rp->conns = 1;
  if (kvx_make_ep(k, addr, true, own, &rp->ep) != TD_OK) {
    TD_WARN("kvx %s: cannot answer %016" PRIx64 ": %s", k->name, uuid, td_errmsg());
    free(own);
    free(rp);
    return;
  }
  if (k->local_ok && host == k->host_id && uuid != k->uuid) {
    ucp_ep_h fep = NULL;
    if (kvx_make_ep(k, addr, false, NULL, &fep) == TD_OK) {
      if (kvx_ep_am_is_shm(fep))
        rp->fast_ep = fep;
      else
        kvx_close_ep(k, fep, false, NULL);
    } else {
      td_err_clear();
    }
  }
  HASH_ADD(hh, k->rpeers, uuid, sizeof rp->uuid, rp);
  k->st.rpeers++;
  TD_DEBUG("kvx %s: peer %016" PRIx64 " connected%s", k->name, uuid, rp->fast_ep ? " (shared-memory replies)" : "");
}

static void handle_req(td_kvx *k, kvx_rpeer *rp, uint64_t xid, kvx_rbuf *r) {
  if (kvx_find_grant(k, rp->uuid, xid)) return; /* duplicate */
  uint64_t request_id = kvx_r_u64(r), res_id = kvx_r_u64(r);
  uint32_t dst_pool = kvx_r_u32(r);
  uint8_t transport = kvx_r_u8(r);
  uint32_t gen = kvx_r_u32(r), timeout_ms = kvx_r_u32(r);
  uint64_t total = kvx_r_u64(r);
  uint64_t ck_first = kvx_r_u64(r), ck_max = kvx_r_u64(r);
  td_kvx_geom sg;
  memset(&sg, 0, sizeof sg);
  sg.elem_size = kvx_r_u16(r);
  sg.layout.n_layers = kvx_r_i32(r);
  sg.layout.n_heads = kvx_r_i32(r);
  sg.layout.head_dim = kvx_r_i32(r);
  sg.layout.block_size = kvx_r_i32(r);
  sg.layout.states = kvx_r_i32(r);
  sg.layout.int8 = kvx_r_u8(r);
  sg.layer0 = kvx_r_i32(r);
  sg.layer1 = kvx_r_i32(r);
  sg.head0 = kvx_r_i32(r);
  sg.head1 = kvx_r_i32(r);
  uint32_t n = kvx_r_u32(r);
  const uint8_t *ids = (n > 0 && n <= KVX_MAX_MSG_BLOCKS) ? kvx_r_bytes(r, (size_t)n * 8) : NULL;
  const uint8_t *token = kvx_r_bytes(r, TD_KV_TOKEN_BYTES);
  char why[KVX_TEXT];
  td_status s = TD_OK;
  if (!ids || !token || r->bad || r->pos != r->len) {
    kvx_send_status(k, rp->ep, KVX_MSG_DENY, xid, TD_ERR_FORMAT, "malformed transfer request");
    return;
  }
  kvx_pool *pool = kvx_find_pool(k, dst_pool);
  if (!pool) {
    snprintf(why, sizeof why, "receiver has no pool %u", dst_pool);
    kvx_send_status(k, rp->ep, KVX_MSG_DENY, xid, TD_ERR_NOT_FOUND, why);
    return;
  }
  kvx_grant *g = calloc(1, sizeof *g);
  int32_t *blocks = malloc(sizeof(int32_t) * 3 * (size_t)n);
  if (!g || !blocks) {
    free(g);
    free(blocks);
    kvx_send_status(k, rp->ep, KVX_MSG_DENY, xid, TD_ERR_NOMEM, "receiver out of memory");
    return;
  }
  kvx_rbuf ir = {.p = ids, .len = (size_t)n * 8};
  kvx_r_i32s(&ir, blocks, 2 * (size_t)n);
  int32_t *src = blocks, *dst = blocks + n, *sorted = blocks + 2 * n;
  bool nccl = transport == KVX_MODE_NCCL, am = transport == KVX_MODE_AM, ipc = transport == KVX_MODE_IPC;
  bool staged = !nccl && !am && !ipc && !pool->direct;
  why[0] = 0;
  if (blocks_valid(k, pool, dst_pool, src, dst, n, why) && !nccl && !ipc) { /* kvx_grant_covers checks these paths' pieces */
    memcpy(sorted, dst, sizeof(int32_t) * n);
    qsort(sorted, n, sizeof(int32_t), cmp_i32);
  }
  td_kvx_slice *items = NULL;
  int n_items = 0;
  uint64_t mine = 0;
  /* NCCL streams the plan's bytes in order on both sides: it needs the plan;
   * other paths only the byte count that must match the sender's */
  td_status ps = TD_OK;
  if (!why[0] && nccl && (ps = td_kvx_plan_copies(&sg, &pool->d.geom, src, dst, (int)n, &items, &n_items)) == TD_OK)
    for (int i = 0; i < n_items; i++) mine += items[i].len;
  else if (!why[0] && !nccl)
    ps = td_kvx_plan_bytes(&sg, &pool->d.geom, (int)n, &mine);
  if (!why[0] && ps != TD_OK) snprintf(why, sizeof why, "%s", td_errmsg());
  if (!why[0] && mine != total)
    snprintf(why, sizeof why, "sender plans %" PRIu64 " bytes, receiver %" PRIu64, total, mine);
  if (!why[0] && transport != KVX_MODE_PUT && !nccl && !am && !ipc)
    snprintf(why, sizeof why, "unknown data mode %u", transport);
  /* IPC writes need our handle, which we export only for GPU pools. */
  if (!why[0] && ipc && (!pool->ipc || rp->host_id != k->host_id))
    snprintf(why, sizeof why, "no CUDA IPC into pool %u from this peer", dst_pool);
  if (!why[0] && nccl && (pool->d.mem != TD_KVX_MEM_CUDA || !rp->nccl || rp->nccl_gen != gen))
    snprintf(why, sizeof why, "no NCCL communicator for this transfer");
  if (!why[0] && nccl && !kvx_chunking_valid(ck_first, ck_max))
    snprintf(why, sizeof why, "NCCL chunks of %" PRIu64 " / %" PRIu64 " bytes", ck_first, ck_max);
  if (!why[0] && nccl && kvx_bounce_ring(k, 1) != TD_OK) snprintf(why, sizeof why, "%s", td_errmsg());
  /* The chunking both sides use: the sender's, within our slots. */
  kvx_nstream *ns = NULL;
  if (!why[0] && nccl) {
    uint64_t mx = ck_max < k->nccl_chunk ? ck_max : k->nccl_chunk;
    if (!(ns = kvx_nstream_new(ck_first < mx ? ck_first : mx, mx))) snprintf(why, sizeof why, "receiver out of memory");
  }
  if (!why[0] && staged && !k->recv_stg) snprintf(why, sizeof why, "no staging buffers");
  if (why[0]) {
    free(items);
    free(blocks);
    free(g);
    free(ns);
    kvx_send_status(k, rp->ep, KVX_MSG_DENY, xid, TD_ERR_INVALID, why);
    return;
  }
  bool has_token = false; /* zeros: the sender has none */
  for (int i = 0; i < TD_KV_TOKEN_BYTES; i++) has_token |= token[i] != 0;
  td_kvx_grant_req req = {rp->uuid, request_id, res_id, dst_pool, dst, (int)n, total, has_token ? token : NULL};
  if (!k->o.authorize) {
    s = td_err(TD_ERR_UNSUPPORTED, "receiver accepts no transfers");
  } else {
    td_err_clear();
    s = k->o.authorize(k->o.ctx, &req);
    if (s != TD_OK && !td_errmsg()[0]) td_err(s, "reservation %" PRIu64 " refused", res_id);
  }
  if (s != TD_OK) {
    snprintf(why, sizeof why, "%s", td_errmsg());
    TD_DEBUG("kvx %s: refused request %" PRIu64 " from %016" PRIx64 ": %s", k->name, request_id, rp->uuid, why);
    free(items);
    free(blocks);
    free(g);
    free(ns);
    kvx_send_status(k, rp->ep, KVX_MSG_DENY, xid, s, why);
    return;
  }
  g->key.uuid = rp->uuid;
  g->key.xid = xid;
  g->k = k;
  g->rp = rp;
  g->pool = pool;
  g->request_id = request_id;
  g->res_id = res_id;
  g->blocks = dst; /* dst and sorted live in blocks[], freed from blocks - n_blocks */
  g->sorted = nccl || ipc ? NULL : sorted;
  g->n_blocks = (int)n;
  g->items = items;
  g->n_items = n_items;
  g->total = total;
  g->nccl = nccl;
  g->ns = ns;
  g->am = am;
  g->ipc = ipc;
  g->staged = staged;
  g->deadline = td_now_ms() + (int64_t)timeout_ms + TD_KVX_GRANT_GRACE_MS;
  HASH_ADD(hh, k->grants, key, sizeof g->key, g);
  pool->users++;
  rp->n_grants++;
  g->gst = G_PENDING;
  if (nccl) {
    g->seq = rp->nccl_seq_assign++;
    kvx_wbuf w;
    kvx_msg_begin(k, &w, KVX_MSG_GRANT, xid);
    kvx_w_u64(&w, g->seq);
    kvx_w_u32(&w, 0);
    kvx_w_u64(&w, ns->first);
    kvx_w_u64(&w, ns->max);
    kvx_send_msg(k, rp->fast_ep ? rp->fast_ep : rp->ep, &w);
  } else if (!staged) {
    g->gst = G_ACTIVE;
    kvx_wbuf w;
    kvx_msg_begin(k, &w, KVX_MSG_GRANT, xid);
    kvx_w_u64(&w, 0);
    kvx_w_u32(&w, 0);
    kvx_send_msg(k, rp->fast_ep ? rp->fast_ep : rp->ep, &w);
    kvx_trace(k, xid, "r_grant", n);
  }
  TD_DEBUG("kvx %s: granted request %" PRIu64 " from %016" PRIx64 ": %u blocks, %" PRIu64 " bytes", k->name,
           request_id, rp->uuid, n, total);
}

/* Whether [off, off + len) lies in blocks the grant holds. */
bool kvx_grant_covers(const kvx_grant *g, uint64_t off, uint64_t len) {
  uint64_t bb = g->pool->block_bytes;
  if (!g->sorted || len == 0 || off + len < off || off + len > g->pool->bytes) return false;
  for (uint64_t b = off / bb; b <= (off + len - 1) / bb; b++) {
    int32_t key = (int32_t)b;
    if (!bsearch(&key, g->sorted, (size_t)g->n_blocks, sizeof(int32_t), cmp_i32)) return false;
  }
  return true;
}

int kvx_pump_grants(td_kvx *k) {
  int work = 0;
  int64_t now = td_now_ms();
  bool slots_taken = false; /* staged grants get slots in arrival order */
  kvx_grant *g, *tmp;
  HASH_ITER(hh, k->grants, g, tmp) {
    if ((g->gst == G_PENDING || g->gst == G_ACTIVE) && now > g->deadline) {
      kvx_grant_revoke(g, TD_ERR_TIMEOUT, "receiver timed the transfer out");
      work++;
    }
    switch (g->gst) {
      case G_PENDING:
        if (g->nccl) {
          kvx_rpeer *rp = g->rp;
          if (!rp->nccl) {
            kvx_grant_revoke(g, TD_ERR_NETWORK, "NCCL communicator gone");
            break;
          }
          int r = kvx_nccl_poll(rp->nccl);
          if (r < 0) {
            kvx_rpeer_nccl_abort(rp, TD_ERR_NETWORK, td_errmsg(), true);
            work++;
            break;
          }
          /* Receives are queued in grant order: this grant's turn comes
           * once the one before posted all of its. */
          if (!kvx_nccl_ready(rp->nccl) || rp->nccl_seq_post != g->seq) break;
          g->gst = G_ACTIVE;
          work += 1 + kvx_pump_nccl_recv(g);
        } else if (!slots_taken) {
          slots_taken = true;
          if (k->n_recv_free == 0) break;
          int want = KVX_GRANT_SLOTS;
          while (g->n_slots < want && k->n_recv_free > 0) g->slots[g->n_slots++] = k->recv_free[--k->n_recv_free];
          kvx_wbuf w;
          kvx_msg_begin(k, &w, KVX_MSG_GRANT, g->key.xid);
          kvx_w_u64(&w, 0);
          kvx_w_u32(&w, (uint32_t)g->n_slots);
          for (int i = 0; i < g->n_slots; i++) kvx_w_u32(&w, (uint32_t)g->slots[i]);
          kvx_send_msg(k, g->rp->fast_ep ? g->rp->fast_ep : g->rp->ep, &w);
          kvx_trace(k, g->key.xid, "r_grant", (uint64_t)g->n_slots);
          g->gst = G_ACTIVE;
          work++;
        }
        break;
      case G_ACTIVE:
        if (g->nccl) {
          work += kvx_pump_nccl_recv(g);
        } else if (g->data_err != TD_OK) {
          kvx_grant_revoke(g, g->data_err, "data outside the granted blocks, or a failed copy");
          work++;
        } else if ((g->staged || g->am) && g->received > g->total) {
          kvx_grant_revoke(g, TD_ERR_FORMAT, "more bytes than granted");
          work++;
        } else if (g->done_rx && g->h2d == 0 && (!(g->staged || g->am) || g->received == g->total)) {
          /* Data messages may trail DONE; a counted grant waits for them. */
          /* Direct puts are flushed before DONE, IPC copies completed. */
          if (!g->staged && !g->am) g->received = g->total;
          if (g->received == g->total) {
            kvx_send_status(k, g->rp->fast_ep ? g->rp->fast_ep : g->rp->ep, KVX_MSG_ACK, g->key.xid, TD_OK, "");
            kvx_trace(k, g->key.xid, "r_ack", 0);
            kvx_grant_end(g, TD_OK, "");
          } else {
            char m[KVX_TEXT];
            snprintf(m, sizeof m, "received %" PRIu64 " of %" PRIu64 " bytes", g->received, g->total);
            kvx_send_status(k, g->rp->fast_ep ? g->rp->fast_ep : g->rp->ep, KVX_MSG_ACK, g->key.xid, TD_ERR_NETWORK, m);
            kvx_grant_end(g, TD_ERR_NETWORK, m);
          }
          work++;
        }
        break;
      case G_CLOSING:
        if (now > g->hard_deadline) {
          /* The sender neither stopped nor died: cut it off. */
          kvx_rpeer_fail(g->rp, TD_ERR_TIMEOUT, "sender did not confirm a revoked transfer", true);
          work++;
        }
        break;
      default:
        break;
    }
    if (g->gst == G_ENDING && g->h2d == 0 && kvx_grant_drained(g)) {
      kvx_grant_finalize(g);
      work++;
    }
  }
  return work;
}


void kvx_receiver_msg(td_kvx *k, unsigned type, uint64_t uuid, uint64_t xid, kvx_rbuf *r) {
  char text[KVX_TEXT];
  kvx_rpeer *rp = find_rpeer(k, uuid);
  if (!rp) {
    TD_WARN("kvx %s: message %u from unknown peer %016" PRIx64, k->name, type, uuid);
    return;
  }
  kvx_grant *g = NULL;
  switch (type) {
    case KVX_MSG_REQ:
      kvx_trace(k, xid, "r_req", 0);
      handle_req(k, rp, xid, r);
      break;
    case KVX_MSG_CHUNK:
      if ((g = kvx_find_grant(k, uuid, xid))) kvx_handle_chunk(k, g, r);
      break;
    case KVX_MSG_DONE:
      if ((g = kvx_find_grant(k, uuid, xid)) && (g->gst == G_ACTIVE)) {
        uint64_t total = kvx_r_u64(r);
        if (r->bad || total != g->total)
          kvx_grant_revoke(g, TD_ERR_FORMAT, "sender's total does not match the grant");
        else
          g->done_rx = true;
        kvx_trace(k, xid, "r_done", 0);
      }
      break;
    case KVX_MSG_ABORT:
      if ((g = kvx_find_grant(k, uuid, xid))) {
        td_status s = (td_status)kvx_r_u32(r);
        kvx_r_text(r, text);
        if (r->bad || s <= TD_OK || s >= TD_STATUS_COUNT) s = TD_ERR_CANCELLED;
        if (g->gst == G_CLOSING) {
          /* Our own revocation, now confirmed: keep its reason. */
          s = g->est;
          snprintf(text, sizeof text, "%s", g->emsg);
        }
        if (g->nccl && rp->nccl) kvx_rpeer_nccl_abort(rp, s, text, true);
        kvx_grant_end(g, s, text[0] ? text : "sender stopped");
      }
      break;
    case KVX_MSG_NCCL_ID: {
      uint32_t gen = kvx_r_u32(r);
      const uint8_t *id = kvx_r_bytes(r, KVX_NCCL_ID_BYTES);
      if (!id || !k->gpu) {
        TD_WARN("kvx %s: NCCL id from %016" PRIx64 " ignored (%s)", k->name, uuid, id ? "no GPU" : "malformed");
        break;
      }
      kvx_rpeer_nccl_abort(rp, TD_ERR_NETWORK, "NCCL communicator replaced", false);
      if (kvx_nccl_create(k->gpu, id, 1, &rp->nccl) != TD_OK) {
        TD_WARN("kvx %s: NCCL communicator with %016" PRIx64 ": %s", k->name, uuid, td_errmsg());
        rp->nccl = NULL;
        break;
      }
      rp->nccl_gen = gen;
      rp->nccl_seq_assign = rp->nccl_seq_post = 0;
      break;
    }
    case KVX_MSG_BYE:
      if (--rp->conns <= 0) kvx_rpeer_fail(rp, TD_OK, "peer disconnected", false);
      break;
    case KVX_MSG_NCCL_ABORT:
      if (kvx_r_u32(r) == rp->nccl_gen && !r->bad)
        kvx_rpeer_nccl_abort(rp, TD_ERR_NETWORK, "the sender aborted the NCCL communicator", false);
      break;
    default:
      break;
  }
}
