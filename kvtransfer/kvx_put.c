/* The UCX data path of one transfer: the plan cut into chunks, each put
 * into the peer's pool or staging slot (or sent as data messages where the
 * endpoint has no RMA lanes), flushed, and announced with CHUNK; DONE once
 * the last flush completed. Staged sources are first copied device to host
 * (kvx_staging.c). */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kvtransfer/kvx_internal.h"

kvx_chunk *kvx_chunk_build(kvx_xfer *x, uint64_t max_bytes, int max_pieces) {
  kvx_chunk *ch = calloc(1, sizeof *ch);
  if (!ch) return NULL;
  ch->pc = malloc(sizeof *ch->pc * (size_t)max_pieces);
  if (!ch->pc) {
    free(ch);
    return NULL;
  }
  ch->lslot = ch->rslot = -1;
  while (x->ci < x->n_items && ch->n < max_pieces && ch->bytes < max_bytes) {
    const td_kvx_slice *it = &x->items[x->ci];
    uint64_t len = it->len - x->coff;
    if (len > max_bytes - ch->bytes) len = max_bytes - ch->bytes;
    ch->pc[ch->n++] = (td_kvx_slice){it->src_off + x->coff, it->dst_off + x->coff, len};
    ch->bytes += len;
    x->coff += len;
    if (x->coff == it->len) {
      x->ci++;
      x->coff = 0;
    }
  }
  return ch;
}

static void put_one(kvx_xfer *x, kvx_chunk *ch, void *local, ucp_mem_h memh, bool cuda, uint64_t len,
                    uint64_t raddr, ucp_rkey_h rkey) {
  td_kvx *k = x->k;
  kvx_op *op = kvx_op_new(k, OP_PUT);
  if (!op) {
    kvx_xfer_op_error(x, UCS_ERR_NO_MEMORY, "put");
    return;
  }
  op->x = x;
  op->ch = ch;
  op->peer = x->peer;
  x->peer->n_ops++;
  x->ops++;
  ch->pending++;
  ucp_request_param_t prm = kvx_op_param(op);
  if (memh) {
    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    prm.memh = memh;
  }
  if (cuda) {
    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    prm.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  kvx_op_issued(op, ucp_put_nbx(x->peer->data_ep, local, len, raddr, rkey, &prm));
}

/* Data as active messages: header (who, which grant, where) + payload. */
static void am_data(kvx_xfer *x, kvx_chunk *ch, const uint8_t *local, uint64_t len, uint64_t dst_off) {
  td_kvx *k = x->k;
  for (uint64_t off = 0; off < len; off += KVX_AM_DATA_MAX) {
    uint64_t n = len - off < KVX_AM_DATA_MAX ? len - off : KVX_AM_DATA_MAX;
    kvx_op *op = kvx_op_new(k, OP_PUT);
    kvx_wbuf w;
    kvx_msg_begin(k, &w, 0, x->id);
    kvx_w_u64(&w, dst_off + off);
    if (!op || w.oom) {
      free(w.p);
      if (op) kvx_op_free(op);
      kvx_xfer_op_error(x, UCS_ERR_NO_MEMORY, "send");
      return;
    }
    op->buf = w.p; /* the header lives until completion */
    op->x = x;
    op->ch = ch;
    op->peer = x->peer;
    x->peer->n_ops++;
    x->ops++;
    ch->pending++;
    ucp_request_param_t prm = kvx_op_param(op);
    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    prm.flags = UCP_AM_SEND_FLAG_EAGER;
    kvx_op_issued(op, ucp_am_send_nbx(x->peer->ep, KVX_AM_DATA_ID, w.p, w.len, local + off, n, &prm));
  }
}

static void chunk_puts(kvx_xfer *x, kvx_chunk *ch) {
  td_kvx *k = x->k;
  td_kvx_peer *p = x->peer;
  const kvx_desc_pool *dp = &p->desc.pools[x->dpi];
  uint8_t *lbase = x->src_staged ? k->send_stg + (size_t)ch->lslot * k->slot_bytes : NULL;
  uint64_t rbase = x->dst_staged ? p->desc.stg_base + (uint64_t)ch->rslot * p->desc.stg_slot_bytes : 0;
  ucp_rkey_h rkey = x->dst_staged ? p->stg_rkey : p->rkeys[x->dpi];
  ch->state = CH_PUT;
  if (x->am) {
    uint64_t packed = 0;
    for (int i = 0; i < ch->n; i++) {
      const td_kvx_slice *pc = &ch->pc[i];
      const uint8_t *local = x->src_staged ? lbase + packed : (const uint8_t *)x->pool->d.base + pc->src_off;
      am_data(x, ch, local, pc->len, pc->dst_off);
      packed += pc->len;
    }
  } else if (x->src_staged && x->dst_staged) {
    put_one(x, ch, lbase, k->send_memh, false, ch->bytes, rbase, rkey);
  } else {
    uint64_t packed = 0;
    for (int i = 0; i < ch->n; i++) {
      const td_kvx_slice *pc = &ch->pc[i];
      void *local = x->src_staged ? (void *)(lbase + packed) : (void *)((uint8_t *)x->pool->d.base + pc->src_off);
      ucp_mem_h memh = x->src_staged ? k->send_memh : x->pool->memh;
      bool cuda = !x->src_staged && x->pool->d.mem == TD_KVX_MEM_CUDA;
      uint64_t raddr = x->dst_staged ? rbase + packed : dp->base + pc->dst_off;
      put_one(x, ch, local, memh, cuda, pc->len, raddr, rkey);
      packed += pc->len;
    }
  }
  x->bytes_put += ch->bytes;
  k->st.bytes_sent += ch->bytes;
}

void kvx_flush_data(kvx_xfer *x, int kind, kvx_chunk *ch) {
  td_kvx *k = x->k;
  kvx_op *op = kvx_op_new(k, OP_FLUSH);
  if (!op) {
    kvx_xfer_op_error(x, UCS_ERR_NO_MEMORY, "flush");
    return;
  }
  op->x = x;
  op->ch = ch;
  op->flush = kind;
  op->peer = x->peer;
  x->peer->n_ops++;
  x->ops++;
  ucp_request_param_t prm = kvx_op_param(op);
  kvx_op_issued(op, ucp_ep_flush_nbx(x->peer->data_ep, &prm));
}

void kvx_chunk_free(kvx_xfer *x, kvx_chunk *ch) {
  td_kvx *k = x->k;
  if (ch->ev) kvx_gpu_release(k->gpu, ch->ev);
  if (ch->lslot >= 0) k->send_free[k->n_send_free++] = ch->lslot;
  DL_DELETE(x->chunks, ch);
  x->n_chunks--;
  free(ch->pc);
  free(ch);
}

int kvx_pump_ucx(kvx_xfer *x) {
  td_kvx *k = x->k;
  int work = 0;
  if (x->ready_ev && !x->ready_done) {
    if (x->src_staged) {
      if (kvx_gpu_wait(k->gpu, KVX_S_D2H, x->ready_ev) != TD_OK) {
        kvx_xfer_stop(x, TD_ERR_CUDA, td_errmsg(), true);
        return 1;
      }
    } else if (x->pool->d.mem == TD_KVX_MEM_CUDA) {
      int r = kvx_gpu_query(k->gpu, x->ready_ev);
      if (r < 0) {
        kvx_xfer_stop(x, TD_ERR_CUDA, td_errmsg(), true);
        return 1;
      }
      if (r == 0) return 0;
    }
    x->ready_done = true;
  }
  kvx_chunk *ch, *tmp;
  DL_FOREACH_SAFE(x->chunks, ch, tmp) {
    if (ch->state == CH_D2H) {
      int r = kvx_gpu_query(k->gpu, ch->ev);
      if (r < 0) {
        kvx_xfer_stop(x, TD_ERR_CUDA, td_errmsg(), true);
        return 1;
      }
      if (r == 0) continue;
      kvx_gpu_release(k->gpu, ch->ev);
      ch->ev = NULL;
      kvx_trace(k, x->id, "d2h_done", ch->bytes);
      if (x->direct_stage) {
        /* Already in the receiver's slot: only the message is left. */
        ch->state = CH_FLUSHED;
        x->bytes_put += ch->bytes;
        k->st.bytes_sent += ch->bytes;
      } else {
        chunk_puts(x, ch);
      }
      work++;
    }
    if (ch->state == CH_PUT && ch->pending == 0) {
      if (ch->lslot >= 0) k->send_free[k->n_send_free++] = ch->lslot;
      ch->lslot = -1;
      if (x->dst_staged) {
        /* The receiver copies the slot out once told; the flush makes the
         * puts remotely complete before the message goes. */
        ch->state = CH_FLUSH;
        kvx_flush_data(x, FL_CHUNK, ch);
      } else {
        ch->state = CH_DONE;
      }
      work++;
    }
    if (ch->state == CH_FLUSHED) {
      kvx_wbuf w;
      kvx_msg_begin(k, &w, KVX_MSG_CHUNK, x->id);
      kvx_w_u32(&w, (uint32_t)ch->rslot);
      kvx_w_u32(&w, (uint32_t)ch->n);
      for (int i = 0; i < ch->n; i++) {
        kvx_w_u64(&w, ch->pc[i].dst_off);
        kvx_w_u64(&w, ch->pc[i].len);
      }
      kvx_send_msg(k, x->peer->fast ? x->peer->data_ep : x->peer->ep, &w);
      kvx_trace(k, x->id, "chunk", ch->bytes);
      ch->state = CH_DONE;
      work++;
    }
    if (ch->state == CH_DONE) kvx_chunk_free(x, ch);
  }
  if (x->op_err != TD_OK) {
    kvx_xfer_stop(x, x->op_err, x->op_msg, true);
    return 1;
  }
  while (x->ci < x->n_items) {
    if (x->dst_staged && x->n_rfree == 0) break;
    if (x->src_staged && !x->direct_stage && k->n_send_free == 0) break;
    if (!x->src_staged && !x->dst_staged && x->n_chunks >= KVX_DIRECT_WINDOW) break;
    uint64_t cap = (x->src_staged || x->dst_staged) ? UINT64_MAX : KVX_MAX_PUT;
    if (x->src_staged && !x->direct_stage && k->slot_bytes < cap) cap = k->slot_bytes;
    if (x->dst_staged && x->peer->desc.stg_slot_bytes < cap) cap = x->peer->desc.stg_slot_bytes;
    /* Small first and last chunks: the pipeline fills and drains sooner. */
    if (x->src_staged || x->dst_staged) cap = kvx_stage_chunk_cap(x->issued, x->total, cap, k->stage_chunk);
    kvx_chunk *c = kvx_chunk_build(x, cap, KVX_CHUNK_PIECES);
    if (!c) {
      kvx_xfer_stop(x, TD_ERR_NOMEM, "out of memory", true);
      return 1;
    }
    x->issued += c->bytes;
    DL_APPEND(x->chunks, c);
    x->n_chunks++;
    if (x->dst_staged) c->rslot = x->rfree[--x->n_rfree];
    if (x->src_staged) {
      td_status s = kvx_stage_d2h(x, c);
      if (s != TD_OK) {
        c->state = CH_DONE;
        kvx_xfer_stop(x, s, td_errmsg(), true);
        return 1;
      }
      c->state = CH_D2H;
    } else {
      chunk_puts(x, c);
    }
    work++;
  }
  if (x->op_err != TD_OK) {
    kvx_xfer_stop(x, x->op_err, x->op_msg, true);
    return 1;
  }
  if (x->ci == x->n_items && x->n_chunks == 0 && !x->final_flush_issued) {
    x->final_flush_issued = true;
    kvx_flush_data(x, FL_FINAL, NULL);
    work++;
  }
  if (x->final_flushed && !x->done_sent) {
    kvx_xfer_send_done(x);
    work++;
  }
  return work;
}
