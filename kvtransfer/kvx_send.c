/* The sender's side of a transfer: td_kvx_post (checks, the plan, the
 * data path's choice, REQ), cancel and disconnect, stopping and finishing,
 * the per-transfer pump that drives the UCX (kvx_put.c), CUDA IPC
 * (kvx_ipc.c) or NCCL (kvx_nccl.c) data path, and the receiver's answers
 * (GRANT, DENY, CREDIT, ACK, REVOKE). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kvtransfer/kvx_internal.h"

void kvx_xfer_finish(kvx_xfer *x, td_status s, const char *msg) {
  td_kvx *k = x->k;
  HASH_DEL(k->xfers, x);
  x->fst = s;
  if (msg != x->fmsg) kvx_set_text(x->fmsg, msg);
  /* Chunks left here belong to a failed peer: their copies were waited for. */
  kvx_chunk *ch, *tmp;
  DL_FOREACH_SAFE(x->chunks, ch, tmp) {
    if (ch->ev) {
      while (kvx_gpu_query(k->gpu, ch->ev) == 0) {
      }
      kvx_gpu_release(k->gpu, ch->ev);
    }
    if (ch->lslot >= 0) k->send_free[k->n_send_free++] = ch->lslot;
    DL_DELETE(x->chunks, ch);
    free(ch->pc);
    free(ch);
  }
  /* Gathers always finish: wait for them before their slots go back. */
  while (!kvx_nstream_quiet(k, x->ns)) {
  }
  kvx_nstream_free(k, x->ns, 0);
  x->ns = NULL;
  x->pool->users--; /* peer->n_xfers drops once the callback ran */
  if (s == TD_OK)
    k->st.xfers_ok++;
  else
    k->st.xfers_failed++;
  if (s == TD_OK && x->ipc) k->st.ipc_blocks += (uint64_t)x->n_blocks;
  x->dnext = k->xdone;
  k->xdone = x;
  TD_DEBUG("kvx %s: transfer %" PRIu64 " (request %" PRIu64 ") ended: %s %s", k->name, x->id, x->request_id,
           td_status_str(s), x->fmsg);
}

/* Every byte is in place (flushed, copied, or sent over NCCL): DONE, then
 * the receiver's ACK ends the transfer. */
void kvx_xfer_send_done(kvx_xfer *x) {
  td_kvx_peer *p = x->peer;
  kvx_wbuf w;
  kvx_msg_begin(x->k, &w, KVX_MSG_DONE, x->id);
  kvx_w_u64(&w, x->total);
  kvx_send_msg(x->k, p->fast ? p->data_ep : p->ep, &w);
  kvx_trace(x->k, x->id, "done", 0);
  x->done_sent = true;
  x->st = XS_FINISH;
}

void kvx_xfer_stop(kvx_xfer *x, td_status s, const char *msg, bool notify) {
  if (x->st == XS_STOPPING) return;
  x->fst = s;
  kvx_set_text(x->fmsg, msg);
  x->notify = notify;
  x->st = XS_STOPPING;
  x->stop_deadline = td_now_ms() + TD_KVX_STOP_GRACE_MS;
  /* The receiver may have queued the matching receive: only an abort of
   * the communicator keeps the two sides in step. */
  if (x->nccl && x->peer->nccl) kvx_peer_nccl_abort(x->peer, TD_ERR_NETWORK, "NCCL communicator aborted", true);
}

td_status td_kvx_post(td_kvx_peer *p, const td_kvx_xfer *q, td_kvx_done_fn cb, void *arg, uint64_t *xfer_id) {
  td_kvx *k = p->k;
  if (xfer_id) *xfer_id = 0;
  if (k->destroying) return td_err(TD_ERR_INVALID, "KV transfer: context shutting down");
  if (p->closed) return td_err(TD_ERR_INVALID, "KV transfer: peer disconnected");
  if (p->status != TD_OK) return td_err(p->status, "KV transfer: peer %016" PRIx64 ": %s", p->desc.uuid, p->msg);
  if (!q || q->n_blocks <= 0 || q->n_blocks > KVX_MAX_MSG_BLOCKS || !q->src_blocks || !q->dst_blocks)
    return td_err(TD_ERR_INVALID, "KV transfer: %d blocks", q ? q->n_blocks : 0);
  kvx_trace(k, k->next_xid, "post_in", (uint64_t)q->n_blocks); /* the id it gets if it goes */
  kvx_pool *pool = kvx_find_pool(k, q->src_pool);
  if (!pool) return td_err(TD_ERR_NOT_FOUND, "KV transfer: no local pool %u", q->src_pool);
  int dpi = -1;
  for (int i = 0; i < p->desc.n_pools; i++)
    if (p->desc.pools[i].info.pool_id == q->dst_pool) dpi = i;
  if (dpi < 0) return td_err(TD_ERR_NOT_FOUND, "KV transfer: peer has no pool %u", q->dst_pool);
  const kvx_desc_pool *dp = &p->desc.pools[dpi];
  for (int i = 0; i < q->n_blocks; i++) {
    if (q->src_blocks[i] < 0 || q->src_blocks[i] >= pool->d.n_blocks || q->dst_blocks[i] < 0 ||
        q->dst_blocks[i] >= dp->info.n_blocks)
      return td_err(TD_ERR_INVALID, "KV transfer: block pair %d (%d -> %d) outside the pools (%d, %d blocks)", i,
                    q->src_blocks[i], q->dst_blocks[i], pool->d.n_blocks, dp->info.n_blocks);
  }
  bool nccl = false, ipc = false;
  bool both_gpu = pool->d.mem == TD_KVX_MEM_CUDA && dp->info.mem == TD_KVX_MEM_CUDA;
  char why[KVX_TEXT];
  if (q->transport == TD_KVX_NCCL) {
    if (!both_gpu) return td_err(TD_ERR_INVALID, "KV transfer: NCCL moves GPU pools only");
    if (!td_kvx_nccl_available(k) || !p->info.nccl)
      return td_err(TD_ERR_UNSUPPORTED, "KV transfer: NCCL is not available on both sides");
    nccl = true;
  } else if (q->transport == TD_KVX_IPC) {
    if (!both_gpu) return td_err(TD_ERR_INVALID, "KV transfer: CUDA IPC moves GPU pools only");
    if (!kvx_ipc_usable(p, pool, dpi, why))
      return td_err(TD_ERR_UNSUPPORTED, "KV transfer: no CUDA IPC into the peer's pool %u: %s", q->dst_pool, why);
    ipc = true;
  } else if (q->transport == TD_KVX_AUTO) {
    /* IPC copies straight into the peer's pool on one host; NCCL cannot
     * pair two ranks on one GPU. */
    ipc = both_gpu && kvx_ipc_usable(p, pool, dpi, why);
    uint64_t mine = kvx_gpu_uid(k->gpu) ^ k->host_id;
    nccl = !ipc && both_gpu && td_kvx_nccl_available(k) && p->info.nccl && p->desc.gpu_id != mine;
  } else if (q->transport != TD_KVX_UCX) {
    return td_err(TD_ERR_INVALID, "KV transfer: transport %d", (int)q->transport);
  }
  bool am = !nccl && !ipc && !p->rma;
  bool src_staged = pool->d.mem == TD_KVX_MEM_CUDA && !pool->direct && !nccl && !ipc;
  bool dst_staged = !dp->info.direct && !nccl && !am && !ipc;
  if ((src_staged && !k->send_stg) || (dst_staged && !p->stg_rkey))
    return td_err(TD_ERR_INTERNAL, "KV transfer: staged path without staging buffers");
  if (nccl) TD_TRY(kvx_bounce_ring(k, 0));
  /* The byte count goes in REQ; the copies are planned after it went, while
   * the receiver checks it (thousands of blocks: tens of microseconds each side). */
  uint64_t total = 0;
  TD_TRY(td_kvx_plan_bytes(&pool->d.geom, &dp->info.geom, q->n_blocks, &total));
  if (total == 0)
    return td_err(TD_ERR_INVALID, "KV transfer: the peer's pool %u holds none of pool %u's layers and heads",
                  q->dst_pool, q->src_pool);
  kvx_xfer *x = calloc(1, sizeof *x);
  int32_t *blocks = malloc(sizeof(int32_t) * 2 * (size_t)q->n_blocks);
  /* Proposed chunking (the receiver may lower it in GRANT): a smaller
   * first chunk, so the first gather is short. */
  kvx_nstream *ns = nccl ? kvx_nstream_new(k->nccl_chunk / 4, k->nccl_chunk) : NULL;
  if (!x || !blocks || (nccl && !ns)) {
    free(x);
    free(blocks);
    free(ns);
    return td_err(TD_ERR_NOMEM, "out of memory");
  }
  x->ns = ns;
  memcpy(blocks, q->src_blocks, sizeof(int32_t) * (size_t)q->n_blocks);
  memcpy(blocks + q->n_blocks, q->dst_blocks, sizeof(int32_t) * (size_t)q->n_blocks);
  x->id = k->next_xid++;
  x->k = k;
  x->peer = p;
  x->pool = pool;
  x->dpi = dpi;
  x->request_id = q->request_id;
  x->res_id = q->reservation_id;
  x->blocks = blocks;
  x->n_blocks = q->n_blocks;
  x->total = total;
  x->nccl = nccl;
  x->ipc = ipc;
  if (ipc) x->ipc_dst = p->ipc_base[dpi] + dp->ipc_off;
  x->am = am;
  x->src_staged = src_staged;
  x->dst_staged = dst_staged;
  x->direct_stage = src_staged && dst_staged && p->stg_ptr;
  x->ready_ev = q->cuda_ready_event;
  x->timeout_ms = q->timeout_ms > 0 ? q->timeout_ms : k->o.timeout_ms;
  x->deadline = td_now_ms() + x->timeout_ms;
  x->cb = cb;
  x->arg = arg;
  x->st = XS_WAIT_GRANT;
  kvx_trace(k, x->id, "post", x->total);
  /* Same endpoint for NCCL_ID and REQ: the id must arrive first. */
  ucp_ep_h req_ep = (p->fast && p->known) ? p->data_ep : p->ep;

  if (nccl && !p->nccl) {
    /* Communicators are made on demand per pair; the unique id travels on
     * the control endpoint, ahead of the request that needs it. */
    uint8_t id[KVX_NCCL_ID_BYTES];
    td_status s = kvx_nccl_unique_id(id);
    if (s == TD_OK) s = kvx_nccl_create(k->gpu, id, 0, &p->nccl);
    if (s != TD_OK) {
      free(x->blocks);
      free(x->ns);
      free(x);
      return s;
    }
    p->nccl_gen++;
    p->nccl_next_seq = 0;
    kvx_wbuf w;
    kvx_msg_begin(k, &w, KVX_MSG_NCCL_ID, 0);
    kvx_w_u32(&w, p->nccl_gen);
    kvx_w_bytes(&w, id, KVX_NCCL_ID_BYTES);
    kvx_send_msg(k, req_ep, &w);
  }
  kvx_wbuf w;
  kvx_msg_begin(k, &w, KVX_MSG_REQ, x->id);
  kvx_w_u64(&w, x->request_id);
  kvx_w_u64(&w, x->res_id);
  kvx_w_u32(&w, q->dst_pool);
  kvx_w_u8(&w, nccl ? KVX_MODE_NCCL : ipc ? KVX_MODE_IPC : am ? KVX_MODE_AM : KVX_MODE_PUT);
  kvx_w_u32(&w, nccl ? p->nccl_gen : 0);
  kvx_w_u32(&w, (uint32_t)x->timeout_ms);
  kvx_w_u64(&w, x->total);
  kvx_w_u64(&w, ns ? ns->first : 0);
  kvx_w_u64(&w, ns ? ns->max : 0);
  const td_kvx_geom *g = &pool->d.geom;
  kvx_w_u16(&w, (uint16_t)g->elem_size);
  kvx_w_i32(&w, g->layout.n_layers);
  kvx_w_i32(&w, g->layout.n_heads);
  kvx_w_i32(&w, g->layout.head_dim);
  kvx_w_i32(&w, g->layout.block_size);
  kvx_w_i32(&w, g->layout.states);
  kvx_w_u8(&w, (uint8_t)g->layout.int8);
  kvx_w_i32(&w, g->layer0);
  kvx_w_i32(&w, g->layer1);
  kvx_w_i32(&w, g->head0);
  kvx_w_i32(&w, g->head1);
  kvx_w_u32(&w, (uint32_t)x->n_blocks);
  kvx_w_i32s(&w, x->blocks, 2 * (size_t)x->n_blocks);
  kvx_w_bytes(&w, q->token, TD_KV_TOKEN_BYTES);
  kvx_send_msg(k, req_ep, &w);

  pool->users++;
  p->n_xfers++;
  if (nccl) k->st.nccl_xfers++;
  if (ipc) k->st.ipc_xfers++;
  HASH_ADD(hh, k->xfers, id, sizeof x->id, x);
  if (xfer_id) *xfer_id = x->id;
  td_status ps = td_kvx_plan_copies(&pool->d.geom, &dp->info.geom, q->src_blocks, q->dst_blocks, q->n_blocks,
                                    &x->items, &x->n_items);
  if (ps != TD_OK) { /* out of memory: REQ went, so the transfer ends as any running one does */
    kvx_xfer_stop(x, ps, td_errmsg(), true);
    return TD_OK;
  }
  TD_DEBUG("kvx %s: transfer %" PRIu64 " (request %" PRIu64 "): %d blocks, %d copies, %" PRIu64 " bytes via %s%s%s",
           k->name, x->id, x->request_id, x->n_blocks, x->n_items, x->total,
           nccl ? "NCCL" : ipc ? "CUDA IPC" : am ? "UCX active messages" : "UCX puts",
           src_staged ? ", staged source" : "", dst_staged ? ", staged destination" : "");
  return TD_OK;
}

td_status td_kvx_cancel(td_kvx *k, uint64_t xfer_id) {
  kvx_xfer *x = NULL;
  HASH_FIND(hh, k->xfers, &xfer_id, sizeof xfer_id, x);
  if (!x) return td_err(TD_ERR_NOT_FOUND, "KV transfer %" PRIu64 " is not running", xfer_id);
  kvx_xfer_stop(x, TD_ERR_CANCELLED, "cancelled", true);
  return TD_OK;
}

void td_kvx_disconnect(td_kvx_peer *p) {
  if (!p || p->closed) return;
  td_kvx *k = p->k;
  p->closed = true;
  kvx_xfer *x, *tmp;
  HASH_ITER(hh, k->xfers, x, tmp) {
    if (x->peer == p) kvx_xfer_stop(x, TD_ERR_CANCELLED, "peer disconnected", true);
  }
  kvx_peer_maybe_release(p);
}

/* A stopping transfer ends once nothing of it is in flight and its puts
 * are flushed, so the receiver may reuse the blocks after the ABORT. */
static int pump_stop(kvx_xfer *x) {
  td_kvx *k = x->k;
  kvx_chunk *ch, *tmp;
  int work = 0;
  DL_FOREACH_SAFE(x->chunks, ch, tmp) {
    if (ch->state == CH_D2H || ch->state == CH_IPC) {
      if (kvx_gpu_query(k->gpu, ch->ev) == 0) continue;
      kvx_chunk_free(x, ch);
      work++;
    } else if ((ch->state == CH_PUT && ch->pending == 0) || ch->state == CH_FLUSHED || ch->state == CH_DONE) {
      kvx_chunk_free(x, ch);
      work++;
    }
  }
  if (td_now_ms() > x->stop_deadline) {
    /* The link does not drain: give up on the peer. */
    td_kvx_peer *p = x->peer;
    if (p->own && p->own->failed == UCS_OK && p->status == TD_OK) {
      p->own->failed = UCS_ERR_TIMED_OUT;
      k->fail_pending = true;
    }
    return work;
  }
  if (x->n_chunks > 0 || x->ops > 0 || !kvx_nstream_quiet(k, x->ns)) return work;
  if (x->bytes_put > 0 && !x->nccl && !x->ipc && !x->stop_flush_issued) {
    x->stop_flush_issued = true;
    kvx_flush_data(x, FL_STOP, NULL);
    return work + 1;
  }
  if (x->stop_flush_issued && !x->stop_flushed) return work;
  if (x->notify && x->peer->status == TD_OK) kvx_send_status(k, x->peer->ep, KVX_MSG_ABORT, x->id, x->fst, x->fmsg);
  kvx_xfer_finish(x, x->fst, x->fmsg);
  return work + 1;
}

int kvx_pump_xfers(td_kvx *k) {
  int work = 0;
  int64_t now = td_now_ms();
  kvx_xfer *x, *tmp;
  HASH_ITER(hh, k->xfers, x, tmp) {
    if (x->st != XS_STOPPING && now > x->deadline) {
      char m[KVX_TEXT];
      snprintf(m, sizeof m, "timed out after %d ms (%s)", x->timeout_ms,
               x->st == XS_WAIT_GRANT ? "no grant" : x->st == XS_RUN ? "copying" : "no acknowledgement");
      kvx_xfer_stop(x, TD_ERR_TIMEOUT, m, true);
    }
    switch (x->st) {
      case XS_RUN:
        work += x->nccl ? kvx_pump_nccl_send(x) : x->ipc ? kvx_pump_ipc(x) : kvx_pump_ucx(x);
        break;
      case XS_FINISH:
        if (x->acked) {
          kvx_xfer_finish(x, x->ack_st, x->ack_msg);
          work++;
        }
        break;
      case XS_STOPPING:
        work += pump_stop(x);
        break;
      default:
        break;
    }
  }
  return work;
}


void kvx_sender_msg(kvx_xfer *x, unsigned type, uint64_t xid, kvx_rbuf *r) {
  td_kvx *k = x->k;
  char text[KVX_TEXT];
  switch (type) {
    case KVX_MSG_GRANT: {
      uint64_t seq = kvx_r_u64(r);
      uint32_t n = kvx_r_u32(r);
      if (x->st != XS_WAIT_GRANT) break;
      if (r->bad || n > KVX_GRANT_SLOTS || (x->dst_staged && n == 0)) {
        kvx_xfer_stop(x, TD_ERR_FORMAT, "malformed grant", true);
        break;
      }
      for (uint32_t i = 0; i < n; i++) {
        uint32_t s = kvx_r_u32(r);
        if (s >= x->peer->desc.stg_slots) r->bad = true;
        x->rslots[i] = x->rfree[i] = (int)s;
      }
      if (x->nccl) {
        /* The receiver's chunking: ours or smaller, never larger than our slots. */
        uint64_t first = kvx_r_u64(r), max = kvx_r_u64(r);
        if (!kvx_chunking_valid(first, max) || max > x->ns->max) r->bad = true;
        x->ns->first = first;
        x->ns->max = max;
      }
      if (r->bad) {
        kvx_xfer_stop(x, TD_ERR_FORMAT, "malformed grant", true);
        break;
      }
      x->n_rslots = x->n_rfree = (int)n;
      kvx_trace(k, xid, "grant", n);
      x->seq = seq;
      x->seq_set = x->nccl;
      x->st = XS_RUN;
      break;
    }
    case KVX_MSG_DENY: {
      td_status s = (td_status)kvx_r_u32(r);
      kvx_r_text(r, text);
      if (s <= TD_OK || s >= TD_STATUS_COUNT) s = TD_ERR_INVALID;
      if (x->st != XS_WAIT_GRANT && x->st != XS_STOPPING) break;
      char m[KVX_TEXT + 32];
      snprintf(m, sizeof m, "receiver refused: %s", text);
      /* Nothing was written: no ABORT owed. */
      x->notify = false;
      if (x->st == XS_STOPPING) {
        if (x->ops == 0 && x->n_chunks == 0 && x->bytes_put == 0) kvx_xfer_finish(x, x->fst, x->fmsg);
      } else {
        kvx_xfer_finish(x, s, m);
      }
      break;
    }
    case KVX_MSG_CREDIT: {
      uint32_t s = kvx_r_u32(r);
      bool ok = false;
      for (int i = 0; i < x->n_rslots; i++) ok |= (uint32_t)x->rslots[i] == s;
      for (int i = 0; i < x->n_rfree; i++) ok &= (uint32_t)x->rfree[i] != s;
      if (ok && !r->bad && x->n_rfree < KVX_GRANT_SLOTS) x->rfree[x->n_rfree++] = (int)s;
      kvx_trace(k, xid, "credit", s);
      break;
    }
    case KVX_MSG_ACK: {
      td_status s = (td_status)kvx_r_u32(r);
      kvx_r_text(r, text);
      if (s < TD_OK || s >= TD_STATUS_COUNT) s = TD_ERR_INTERNAL;
      /* NCCL: the receive may complete before the send is seen complete. */
      if (x->st == XS_STOPPING || x->st == XS_WAIT_GRANT) break;
      x->acked = true;
      kvx_trace(k, xid, "ack", (uint64_t)s);
      x->ack_st = s;
      snprintf(x->ack_msg, KVX_TEXT, "%s", s == TD_OK ? "" : text);
      break;
    }
    case KVX_MSG_REVOKE: {
      td_status s = (td_status)kvx_r_u32(r);
      kvx_r_text(r, text);
      if (s <= TD_OK || s >= TD_STATUS_COUNT) s = TD_ERR_INTERNAL;
      char m[KVX_TEXT + 32];
      snprintf(m, sizeof m, "receiver revoked: %s", text);
      kvx_xfer_stop(x, s, m, true);
      break;
    }
    default:
      break;
  }
}
