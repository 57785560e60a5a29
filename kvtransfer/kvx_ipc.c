/* CUDA IPC between GPU pools of one host (docs/kvtransfer.md, "CUDA IPC"):
 * the sender maps the receiver's pool from the handle in its descriptor, on
 * its own device, the first time a transfer goes there, and once granted
 * copies the plan's byte ranges device to device into it on a stream of its
 * own, a few chunks in flight (small pieces by the gather kernel, whose
 * stores reach the peer's memory over the link; large ones by the copy
 * engines); DONE goes when the last chunk's event has
 * completed. The receiver grants and ends such a transfer as a direct put
 * (kvx_recv.c). Mappings are closed when their peer fails or is released,
 * after every copy into them completed. */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kvtransfer/kvx_internal.h"

/* IPC is off for this transfer: why, and once per peer in the log when it
 * is the peer (its descriptor, its device, its mapping) that rules it out. */
static bool ipc_no(td_kvx_peer *p, char *why, bool log, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static bool ipc_no(td_kvx_peer *p, char *why, bool log, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, KVX_TEXT, fmt, ap);
  va_end(ap);
  if (log && !p->ipc_logged) {
    p->ipc_logged = true;
    TD_INFO("kvx %s: peer %016" PRIx64 ": no CUDA IPC (%s); its GPU pools get staged UCX or NCCL", p->k->name,
            p->desc.uuid, why);
  }
  return false;
}

bool kvx_ipc_usable(td_kvx_peer *p, const kvx_pool *src, int dpi, char *why) {
  td_kvx *k = p->k;
  const kvx_desc_pool *dp = &p->desc.pools[dpi];
  if (!k->ipc) return ipc_no(p, why, false, "CUDA IPC is off here");
  if (src->d.mem != TD_KVX_MEM_CUDA || dp->info.mem != TD_KVX_MEM_CUDA)
    return ipc_no(p, why, false, "not GPU pool to GPU pool");
  if (p->desc.host_id != k->host_id) return ipc_no(p, why, false, "the peer is on another host");
  if (!p->desc.ipc) return ipc_no(p, why, true, "the peer exports no IPC handles (IPC off there, or an older build)");
  if (!dp->info.ipc) return ipc_no(p, why, true, "the peer exports no IPC handle for pool %u", dp->info.pool_id);
  if (p->status != TD_OK) return ipc_no(p, why, false, "the peer failed");
  if (p->ipc_reach == 0) {
    td_status s = kvx_gpu_ipc_reach(k->gpu, p->desc.dev_id);
    p->ipc_reach = s == TD_OK ? 1 : -1;
    if (s != TD_OK) {
      char m[KVX_TEXT];
      snprintf(m, sizeof m, "%s", td_errmsg());
      td_err_clear();
      return ipc_no(p, why, true, "%s", m);
    }
  }
  if (p->ipc_reach < 0) return ipc_no(p, why, false, "the peer's GPU %s cannot be reached from ours", p->desc.dev_id);
  if (p->ipc_state[dpi] == 0) {
    void *base = NULL;
    size_t size = 0;
    td_status s = kvx_gpu_ipc_open(k->gpu, dp->ipc_handle, &base, &size);
    uint64_t need = dp->ipc_off + td_kvx_block_bytes(&dp->info.geom) * (uint64_t)dp->info.n_blocks;
    if (s == TD_OK && size && need > size) {
      kvx_gpu_ipc_close(k->gpu, base);
      s = td_err(TD_ERR_FORMAT, "it ends at byte %" PRIu64 ", outside the allocation it exported (%zu bytes)", need,
                 size);
    }
    if (s != TD_OK) {
      char m[KVX_TEXT];
      snprintf(m, sizeof m, "mapping pool %u: %s", dp->info.pool_id, td_errmsg());
      td_err_clear();
      p->ipc_state[dpi] = -1;
      return ipc_no(p, why, true, "%s", m);
    }
    p->ipc_base[dpi] = base;
    p->ipc_state[dpi] = 1;
    TD_DEBUG("kvx %s: peer %016" PRIx64 ": pool %u mapped for CUDA IPC (GPU %s)", k->name, p->desc.uuid,
             dp->info.pool_id, p->desc.dev_id);
  }
  if (p->ipc_state[dpi] < 0) return ipc_no(p, why, false, "the peer's pool %u could not be mapped", dp->info.pool_id);
  return true;
}

void kvx_ipc_unmap(td_kvx_peer *p) {
  td_kvx *k = p->k;
  /* Copies into a mapping end before it goes: their transfers ended or
   * stopped after their events. Wait here in case one did not. */
  kvx_xfer *x, *tmp;
  HASH_ITER(hh, k->xfers, x, tmp) {
    if (x->peer != p || !x->ipc) continue;
    kvx_chunk *ch;
    DL_FOREACH(x->chunks, ch) {
      if (ch->state != CH_IPC || !ch->ev) continue;
      while (kvx_gpu_query(k->gpu, ch->ev) == 0) {
      }
    }
  }
  for (int i = 0; i < TD_KVX_MAX_POOLS; i++) {
    if (p->ipc_state[i] == 1) kvx_gpu_ipc_close(k->gpu, p->ipc_base[i]);
    p->ipc_base[i] = NULL;
    if (p->ipc_state[i] != 0) p->ipc_state[i] = -1;
  }
}

int kvx_pump_ipc(kvx_xfer *x) {
  td_kvx *k = x->k;
  int work = 0;
  if (x->ready_ev && !x->ready_done) {
    if (kvx_gpu_wait(k->gpu, KVX_S_IPC, x->ready_ev) != TD_OK) {
      kvx_xfer_stop(x, TD_ERR_CUDA, td_errmsg(), true);
      return 1;
    }
    x->ready_done = true;
  }
  kvx_chunk *ch, *tmp;
  DL_FOREACH_SAFE(x->chunks, ch, tmp) {
    int r = kvx_gpu_query(k->gpu, ch->ev);
    if (r < 0) {
      kvx_xfer_stop(x, TD_ERR_CUDA, td_errmsg(), true);
      return 1;
    }
    if (r == 0) break; /* one stream: the chunks after it finish later */
    x->bytes_put += ch->bytes;
    k->st.bytes_sent += ch->bytes;
    kvx_trace(k, x->id, "ipc_done", ch->bytes);
    kvx_chunk_free(x, ch);
    work++;
  }
  const uint8_t *src = x->pool->d.base;
  while (x->ci < x->n_items && x->n_chunks < KVX_IPC_WINDOW) {
    /* the first chunks smaller (KVX_IPC_RAMP): the first a table passed by value */
    static const int ramp_pieces[KVX_IPC_RAMP] = {KVX_GATHER_SMALL, KVX_GATHER_PIECES / 4};
    static const int ramp_shift[KVX_IPC_RAMP] = {4, 2};
    bool ramp = x->ipc_chunks < KVX_IPC_RAMP;
    int pieces = ramp && ramp_pieces[x->ipc_chunks] < k->o.ipc_chunk_pieces ? ramp_pieces[x->ipc_chunks]
                                                                             : k->o.ipc_chunk_pieces;
    kvx_chunk *c = kvx_chunk_build(x, KVX_IPC_CHUNK >> (ramp ? ramp_shift[x->ipc_chunks] : 0), pieces);
    if (!c || kvx_scratch(k, k->o.ipc_chunk_pieces) != TD_OK) {
      if (c) {
        free(c->pc);
        free(c);
      }
      kvx_xfer_stop(x, TD_ERR_NOMEM, "out of memory", true);
      return 1;
    }
    for (int i = 0; i < c->n; i++) {
      k->sc_d[i] = x->ipc_dst + c->pc[i].dst_off;
      k->sc_s[i] = src + c->pc[i].src_off;
      k->sc_n[i] = c->pc[i].len;
    }
    x->issued += c->bytes;
    x->ipc_chunks++;
    DL_APPEND(x->chunks, c);
    x->n_chunks++;
    /* On one GPU the kernel copies at 3x the engines' rate for any piece
     * (H200: 1,250 against 398 GB/s with 1.5 MiB pieces, 485 against 19
     * with 64 KiB); between GPUs the engines keep large pieces. */
    bool kern = k->o.ipc_copy == TD_KVX_IPC_COPY_KERNEL ||
                (k->o.ipc_copy == TD_KVX_IPC_COPY_AUTO &&
                 (!strcmp(x->peer->desc.dev_id, k->dev_id) ||
                  (c->n > 1 && c->bytes / (uint64_t)c->n < TD_DEFAULT_KVX_IPC_KERNEL_BELOW)));
    td_status s = kern ? kvx_gpu_copy_d2d(k->gpu, KVX_S_IPC, k->sc_d, k->sc_s, k->sc_n, (size_t)c->n)
                       : kvx_gpu_copy_many(k->gpu, KVX_S_IPC, k->sc_d, k->sc_s, k->sc_n, (size_t)c->n);
    if (s == TD_OK) s = kvx_gpu_record(k->gpu, KVX_S_IPC, &c->ev);
    if (s != TD_OK) {
      /* Without an event nothing tells when its copies end: wait for them
       * here, so that the ABORT that follows never precedes a write. */
      kvx_gpu_sync(k->gpu, KVX_S_IPC);
      c->state = CH_DONE;
      kvx_xfer_stop(x, s, td_errmsg(), true);
      return 1;
    }
    c->state = CH_IPC;
    kvx_trace(k, x->id, "ipc", c->bytes);
    work++;
  }
  if (x->ci == x->n_items && x->n_chunks == 0 && !x->done_sent) {
    /* Every copy completed: the bytes are in the receiver's pool. */
    kvx_xfer_send_done(x);
    work++;
  }
  return work;
}
