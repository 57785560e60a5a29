/* Staging for GPU pools that UCX cannot reach directly: the pinned host
 * slots of both sides (the receive side allocated by UCX so that a
 * same-host sender can map it), the sender's device-to-host copies into
 * them, and the receiver's host-to-device copies out of them with the
 * CREDIT that frees a slot. The staged pipeline's puts and messages are in
 * kvx_put.c; docs/kvtransfer.md, "Staged UCX", says how it fits. */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kvtransfer/kvx_internal.h"

td_status kvx_ensure_staging(td_kvx *k) {
  if (k->recv_stg) return TD_OK;
  size_t bytes = k->slot_bytes * (size_t)k->n_slots;
  td_status s;
  k->send_free = malloc(sizeof(int) * (size_t)k->n_slots);
  k->recv_free = malloc(sizeof(int) * (size_t)k->n_slots);
  if (!k->send_free || !k->recv_free) return td_err(TD_ERR_NOMEM, "out of memory");
  void *sp = NULL, *rp = NULL;
  if ((s = kvx_gpu_host_alloc(k->gpu, bytes, &sp)) != TD_OK) return s;
  k->send_stg = sp;
  if ((s = kvx_ucx_map(k, k->send_stg, bytes, false, &k->send_memh)) != TD_OK) return s;
  /* Receive staging from UCX: shared memory where it can, so a same-host
   * sender maps it (ucp_rkey_ptr) and copies device-to-host straight in. */
  ucp_mem_map_params_t mp;
  memset(&mp, 0, sizeof mp);
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  mp.length = bytes;
  mp.flags = UCP_MEM_MAP_ALLOCATE;
  if (ucp_mem_map(k->ctx, &mp, &k->recv_memh) == UCS_OK) {
    ucp_mem_attr_t ma;
    memset(&ma, 0, sizeof ma);
    ma.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    if (ucp_mem_query(k->recv_memh, &ma) == UCS_OK && ma.length >= bytes &&
        kvx_gpu_host_register(k->gpu, ma.address, bytes) == TD_OK) {
      k->recv_stg = ma.address;
      k->recv_ucx_alloc = true;
    } else {
      TD_WARN("kvx %s: UCX-allocated staging unusable (%s); using pinned memory", k->name, td_errmsg());
      ucp_mem_unmap(k->ctx, k->recv_memh);
      k->recv_memh = NULL;
    }
  }
  if (!k->recv_stg) {
    if ((s = kvx_gpu_host_alloc(k->gpu, bytes, &rp)) != TD_OK) return s;
    k->recv_stg = rp;
    if ((s = kvx_ucx_map(k, k->recv_stg, bytes, false, &k->recv_memh)) != TD_OK) return s;
  }
  ucs_status_t us = ucp_rkey_pack(k->ctx, k->recv_memh, &k->recv_rkey, &k->recv_rkey_len);
  if (us != UCS_OK) return td_err(TD_ERR_NETWORK, "KV transfer: packing the staging key: %s", ucs_status_string(us));
  for (int i = 0; i < k->n_slots; i++) {
    k->send_free[i] = k->n_slots - 1 - i;
    k->recv_free[i] = k->n_slots - 1 - i;
  }
  k->n_send_free = k->n_recv_free = k->n_slots;
  return TD_OK;
}

/* Issues the device-to-host copies of a chunk's pieces, packed in order
 * into a local send slot, or straight into the receiver's slot where its
 * staging is mapped here (direct_stage), and records their event. */
td_status kvx_stage_d2h(kvx_xfer *x, kvx_chunk *c) {
  td_kvx *k = x->k;
  uint8_t *dst;
  if (x->direct_stage) {
    dst = x->peer->stg_ptr + (size_t)c->rslot * x->peer->desc.stg_slot_bytes;
  } else {
    c->lslot = k->send_free[--k->n_send_free];
    dst = k->send_stg + (size_t)c->lslot * k->slot_bytes;
  }
  void *dsts[KVX_CHUNK_PIECES];
  const void *srcs[KVX_CHUNK_PIECES];
  size_t sizes[KVX_CHUNK_PIECES];
  for (int i = 0; i < c->n; i++) {
    dsts[i] = dst;
    srcs[i] = (uint8_t *)x->pool->d.base + c->pc[i].src_off;
    sizes[i] = c->pc[i].len;
    dst += c->pc[i].len;
  }
  td_status s = kvx_gpu_copy_many(k->gpu, KVX_S_D2H, dsts, srcs, sizes, (size_t)c->n);
  if (s == TD_OK) s = kvx_gpu_record(k->gpu, KVX_S_D2H, &c->ev);
  kvx_trace(k, x->id, "d2h", c->bytes);
  return s;
}

void kvx_handle_chunk(td_kvx *k, kvx_grant *g, kvx_rbuf *r) {
  uint32_t slot = kvx_r_u32(r), n = kvx_r_u32(r);
  if (g->gst != G_ACTIVE || !g->staged) return;
  int si = -1;
  for (int i = 0; i < g->n_slots; i++)
    if ((uint32_t)g->slots[i] == slot) si = i;
  if (si < 0 || n == 0 || n > KVX_CHUNK_PIECES) {
    kvx_grant_revoke(g, TD_ERR_FORMAT, "chunk names a staging slot not granted");
    return;
  }
  uint8_t *src = k->recv_stg + (size_t)slot * k->slot_bytes;
  uint64_t packed = 0, bytes = 0;
  void *dsts[KVX_CHUNK_PIECES];
  const void *srcs[KVX_CHUNK_PIECES];
  size_t sizes[KVX_CHUNK_PIECES];
  for (uint32_t i = 0; i < n; i++) {
    uint64_t off = kvx_r_u64(r), len = kvx_r_u64(r);
    if (r->bad || !kvx_grant_covers(g, off, len) || packed + len > k->slot_bytes) {
      kvx_grant_revoke(g, TD_ERR_FORMAT, "chunk writes outside the granted blocks");
      return;
    }
    dsts[i] = (uint8_t *)g->pool->d.base + off;
    srcs[i] = src + packed;
    sizes[i] = len;
    packed += len;
    bytes += len;
  }
  td_status s = kvx_gpu_copy_many(k->gpu, KVX_S_H2D, dsts, srcs, sizes, n);
  kvx_h2d *h = calloc(1, sizeof *h);
  if (s == TD_OK && !h) s = td_err(TD_ERR_NOMEM, "out of memory");
  if (s == TD_OK) s = kvx_gpu_record(k->gpu, KVX_S_H2D, &h->ev);
  if (s != TD_OK) {
    free(h);
    kvx_grant_revoke(g, s, td_errmsg());
    return;
  }
  kvx_trace(k, g->key.xid, "r_chunk", bytes);
  h->g = g;
  h->slot = (int)slot;
  h->bytes = bytes;
  g->h2d++;
  DL_APPEND(k->h2ds, h);
}

int kvx_pump_h2d(td_kvx *k) {
  int work = 0;
  kvx_h2d *h, *tmp;
  DL_FOREACH_SAFE(k->h2ds, h, tmp) {
    int r = kvx_gpu_query(k->gpu, h->ev);
    if (r == 0) continue;
    kvx_grant *g = h->g;
    g->h2d--;
    if (r < 0) {
      kvx_grant_revoke(g, TD_ERR_CUDA, td_errmsg());
    } else {
      g->received += h->bytes;
      kvx_trace(k, g->key.xid, "r_h2d_done", h->bytes);
      if (g->gst == G_ACTIVE) {
        kvx_wbuf w;
        kvx_msg_begin(k, &w, KVX_MSG_CREDIT, g->key.xid);
        kvx_w_u32(&w, (uint32_t)h->slot);
        kvx_send_msg(k, g->rp->fast_ep ? g->rp->fast_ep : g->rp->ep, &w);
      }
    }
    kvx_gpu_release(k->gpu, h->ev);
    DL_DELETE(k->h2ds, h);
    free(h);
    work++;
  }
  return work;
}
