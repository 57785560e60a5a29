/* The transfer context (td_kvx): create and destroy, the registered pools
 * and the descriptor that exports them, the peer handles of td_kvx_connect
 * and their release, statistics. The protocol's parts live in the other
 * kvx_*.c files (docs/kvtransfer.md, "Files"); destroy is here because it
 * winds all of them down in order. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "common/log.h"
#include "kvtransfer/kvx_internal.h"

static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
  const uint8_t *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

/* Same host: same hostname and kernel boot. */
static uint64_t host_identity(void) {
  char buf[256] = {0};
  uint64_t h = 0xcbf29ce484222325ull;
  if (gethostname(buf, sizeof buf - 1) == 0) h = fnv1a(h, buf, strlen(buf));
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f) {
    memset(buf, 0, sizeof buf);
    if (fgets(buf, sizeof buf, f)) h = fnv1a(h, buf, strlen(buf));
    fclose(f);
  }
  return h;
}

static uint64_t random_u64(void) {
  uint64_t v = 0;
  if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v) v = (uint64_t)td_now_ns() ^ ((uint64_t)getpid() << 32);
  return v ? v : 1;
}

td_status td_kvx_create(const td_kvx_opts *opts, td_kvx **out) {
  *out = NULL;
  td_kvx *k = calloc(1, sizeof *k);
  if (!k) return td_err(TD_ERR_NOMEM, "out of memory");
  k->o = *opts;
  snprintf(k->name, sizeof k->name, "%s", opts->name ? opts->name : "kvx");
  k->o.name = k->name;
  if (k->o.timeout_ms <= 0) k->o.timeout_ms = TD_DEFAULT_KVX_TIMEOUT_MS;
  k->n_slots = k->o.staging_slots > 0 ? k->o.staging_slots : TD_DEFAULT_KVX_STAGING_SLOTS;
  if (k->n_slots > KVX_MAX_STAGING_SLOTS) k->n_slots = KVX_MAX_STAGING_SLOTS;
  k->slot_bytes =
      k->o.staging_slot_bytes >= KVX_MIN_CHUNK ? k->o.staging_slot_bytes : TD_DEFAULT_KVX_STAGING_SLOT_BYTES;
  k->stage_chunk =
      k->o.staging_chunk_bytes >= KVX_MIN_CHUNK ? k->o.staging_chunk_bytes : TD_DEFAULT_KVX_STAGING_CHUNK_BYTES;
  k->nccl_chunk = k->o.nccl_chunk_bytes ? k->o.nccl_chunk_bytes : TD_DEFAULT_KVX_NCCL_CHUNK_BYTES;
  if (k->o.ipc_chunk_pieces <= 0 || k->o.ipc_chunk_pieces > KVX_IPC_PIECES) k->o.ipc_chunk_pieces = KVX_IPC_PIECES;
  if (k->o.ipc_chunk_pieces < 16) k->o.ipc_chunk_pieces = 16;
  if (k->nccl_chunk < KVX_MIN_CHUNK) k->nccl_chunk = KVX_MIN_CHUNK;
  if (k->nccl_chunk > KVX_NCCL_MAX_CHUNK) k->nccl_chunk = KVX_NCCL_MAX_CHUNK;
  k->uuid = random_u64();
  k->host_id = host_identity();
  k->next_xid = 1;
  k->efd = k->tfd = k->epfd = -1;
  if (k->o.trace) k->trace = malloc(sizeof *k->trace * KVX_TRACE_CAP); /* NULL: no trace */
  td_status s = TD_OK;

  if (k->o.cuda_device >= 0) {
    if (!kvx_gpu_compiled()) {
      s = td_err(TD_ERR_UNSUPPORTED, "KV transfer: CUDA device %d asked for, but this build has no CUDA",
                 k->o.cuda_device);
      goto fail;
    }
    if ((s = kvx_gpu_create(k->o.cuda_device, &k->gpu)) != TD_OK) goto fail;
    bool id = kvx_gpu_dev_id(k->gpu, k->dev_id) == TD_OK;
    if (!id && !k->o.no_ipc) TD_WARN("kvx %s: no CUDA IPC: %s", k->name, td_errmsg());
    td_err_clear();
    k->ipc = id && !k->o.no_ipc;
  }
  if ((s = kvx_ucx_open(k)) != TD_OK) goto fail;
  TD_INFO("kvx %s: uuid %016" PRIx64 ", UCX CUDA memory %s, same-host data path %s, GPU %s, NCCL %s, CUDA IPC %s",
          k->name, k->uuid, k->cuda_mem ? "yes" : "no", k->local_ok ? "on" : "off", k->gpu ? k->dev_id : "no",
          (k->gpu && kvx_nccl_compiled()) ? "yes" : "no", k->ipc ? "on" : "off");
  *out = k;
  return TD_OK;
fail:
  td_kvx_destroy(k);
  return s;
}

uint64_t td_kvx_uuid(const td_kvx *k) { return k->uuid; }
bool td_kvx_cuda_direct(const td_kvx *k) { return k->cuda_mem && !k->o.force_staged; }
bool td_kvx_nccl_available(const td_kvx *k) { return k->gpu && kvx_nccl_compiled(); }
int td_kvx_fd(const td_kvx *k) { return k->epfd; }

kvx_pool *kvx_find_pool(td_kvx *k, uint32_t id) {
  kvx_pool *p = NULL;
  HASH_FIND(hh, k->pools, &id, sizeof id, p);
  return p;
}

td_status td_kvx_register_pool(td_kvx *k, const td_kvx_pool_desc *d) {
  if (!d || !d->base || d->n_blocks <= 0) return td_err(TD_ERR_INVALID, "KV transfer: pool without memory or blocks");
  TD_TRY(td_kvx_geom_check(&d->geom));
  if (kvx_find_pool(k, d->pool_id)) return td_err(TD_ERR_INVALID, "KV transfer: pool %u registered twice", d->pool_id);
  if (HASH_COUNT(k->pools) >= TD_KVX_MAX_POOLS)
    return td_err(TD_ERR_INVALID, "KV transfer: more than %d pools", TD_KVX_MAX_POOLS);
  kvx_pool *p = calloc(1, sizeof *p);
  if (!p) return td_err(TD_ERR_NOMEM, "out of memory");
  p->id = d->pool_id;
  p->d = *d;
  p->block_bytes = td_kvx_block_bytes(&d->geom);
  p->bytes = p->block_bytes * (uint64_t)d->n_blocks;
  td_status s = TD_OK;
  if (d->mem == TD_KVX_MEM_HOST) {
    p->direct = true;
    s = kvx_ucx_map(k, d->base, p->bytes, false, &p->memh);
  } else if (d->mem == TD_KVX_MEM_CUDA) {
    if (!k->gpu) {
      s = td_err(TD_ERR_UNSUPPORTED, "KV transfer: GPU pool %u in a context without a CUDA device", d->pool_id);
    } else if ((s = kvx_gpu_check_device_ptr(k->gpu, d->base, p->bytes)) == TD_OK) {
      if (td_kvx_cuda_direct(k)) {
        p->direct = true;
        s = kvx_ucx_map(k, d->base, p->bytes, true, &p->memh);
      } else {
        s = kvx_ensure_staging(k);
      }
      /* Same-host peers may map it (CUDA IPC); memory that cannot be
       * shared still moves by the other paths. */
      if (s == TD_OK && k->ipc) {
        p->ipc = kvx_gpu_ipc_export(k->gpu, d->base, p->bytes, p->ipc_handle, &p->ipc_off) == TD_OK;
        if (!p->ipc) TD_INFO("kvx %s: pool %u not exported for CUDA IPC: %s", k->name, d->pool_id, td_errmsg());
        td_err_clear();
      }
    }
  } else {
    s = td_err(TD_ERR_INVALID, "KV transfer: pool %u: memory kind %d", d->pool_id, (int)d->mem);
  }
  if (s == TD_OK && p->memh) {
    ucs_status_t us = ucp_rkey_pack(k->ctx, p->memh, &p->rkey, &p->rkey_len);
    if (us != UCS_OK)
      s = td_err(TD_ERR_NETWORK, "KV transfer: packing pool %u's key: %s", d->pool_id, ucs_status_string(us));
  }
  if (s != TD_OK) {
    if (p->rkey) ucp_rkey_buffer_release(p->rkey);
    if (p->memh) ucp_mem_unmap(k->ctx, p->memh);
    free(p);
    return s;
  }
  HASH_ADD(hh, k->pools, id, sizeof p->id, p);
  TD_DEBUG("kvx %s: pool %u: %d blocks of %" PRIu64 " bytes in %s memory (%s%s)", k->name, p->id, d->n_blocks,
           p->block_bytes, d->mem == TD_KVX_MEM_CUDA ? "GPU" : "host", p->direct ? "direct" : "staged",
           p->ipc ? ", CUDA IPC" : "");
  return TD_OK;
}

static void pool_free(td_kvx *k, kvx_pool *p) {
  if (p->rkey) ucp_rkey_buffer_release(p->rkey);
  if (p->memh) ucp_mem_unmap(k->ctx, p->memh);
  free(p);
}

td_status td_kvx_unregister_pool(td_kvx *k, uint32_t pool_id) {
  kvx_pool *p = kvx_find_pool(k, pool_id);
  if (!p) return td_err(TD_ERR_NOT_FOUND, "KV transfer: no pool %u", pool_id);
  if (p->users > 0) return td_err(TD_ERR_INVALID, "KV transfer: pool %u is in use by %d transfers", pool_id, p->users);
  HASH_DEL(k->pools, p);
  pool_free(k, p);
  return TD_OK;
}

td_status td_kvx_export(td_kvx *k, uint8_t **bytes, size_t *len) {
  kvx_desc d;
  memset(&d, 0, sizeof d);
  d.caps = (td_kvx_nccl_available(k) ? KVX_CAP_NCCL : 0) | (td_kvx_cuda_direct(k) ? KVX_CAP_CUDA_DIRECT : 0);
  d.uuid = k->uuid;
  d.host_id = k->host_id;
  d.pid = (uint32_t)getpid();
  d.gpu_id = k->gpu ? kvx_gpu_uid(k->gpu) ^ k->host_id : 0;
  d.addr = (const uint8_t *)k->addr;
  d.addr_len = (uint32_t)k->addr_len;
  if (k->recv_stg) {
    d.staging = true;
    d.stg_base = (uint64_t)(uintptr_t)k->recv_stg;
    d.stg_slot_bytes = k->slot_bytes;
    d.stg_slots = (uint32_t)k->n_slots;
    d.stg_rkey = k->recv_rkey;
    d.stg_rkey_len = (uint32_t)k->recv_rkey_len;
  }
  d.ipc = k->ipc;
  snprintf(d.dev_id, sizeof d.dev_id, "%s", k->dev_id);
  kvx_pool *p, *tmp;
  HASH_ITER(hh, k->pools, p, tmp) {
    kvx_desc_pool *dp = &d.pools[d.n_pools++];
    dp->info.pool_id = p->id;
    dp->info.mem = p->d.mem;
    dp->info.direct = p->direct;
    dp->info.n_blocks = p->d.n_blocks;
    dp->info.geom = p->d.geom;
    dp->base = (uint64_t)(uintptr_t)p->d.base;
    dp->rkey = p->rkey;
    dp->rkey_len = (uint32_t)p->rkey_len;
    dp->info.ipc = p->ipc;
    dp->ipc_off = p->ipc_off;
    dp->ipc_handle = p->ipc_handle;
  }
  return kvx_desc_encode(&d, bytes, len);
}

td_status td_kvx_connect(td_kvx *k, const void *bytes, size_t len, td_kvx_peer **out) {
  *out = NULL;
  td_kvx_peer *p = calloc(1, sizeof *p);
  if (!p) return td_err(TD_ERR_NOMEM, "out of memory");
  p->k = k;
  td_status s = TD_OK;
  p->desc_bytes = malloc(len ? len : 1);
  p->own = calloc(1, sizeof *p->own);
  if (!p->desc_bytes || !p->own) {
    s = td_err(TD_ERR_NOMEM, "out of memory");
    goto fail;
  }
  if (len) memcpy(p->desc_bytes, bytes, len);
  if ((s = kvx_desc_decode(p->desc_bytes, len, &p->desc)) != TD_OK) goto fail;
  if ((s = td_kvx_desc_parse(p->desc_bytes, len, &p->info)) != TD_OK) goto fail;
  p->own->k = k;
  if ((s = kvx_make_ep(k, p->desc.addr, true, p->own, &p->ep)) != TD_OK) goto fail;
  p->data_ep = p->ep;
  if (k->local_ok && p->desc.host_id == k->host_id && p->desc.uuid != k->uuid) {
    /* Error handling would restrict UCX 1.13 to tcp; this endpoint lets it
     * pick shared memory / CMA. Failures surface on p->ep. */
    ucp_ep_h dep = NULL;
    if (kvx_make_ep(k, p->desc.addr, false, NULL, &dep) == TD_OK) {
      if (kvx_ep_has_rma(dep)) {
        p->data_ep = dep;
        p->local = true;
        p->rma = true;
        p->fast = kvx_ep_am_is_shm(dep);
        k->st.local_path = true;
      } else {
        kvx_close_ep(k, dep, false, NULL); /* no CMA / shared memory after all */
      }
    } else {
      td_err_clear();
    }
  }
  if (!p->local) p->rma = kvx_ep_has_rma(p->ep);
  for (int i = 0; i < p->desc.n_pools; i++) {
    if (!p->desc.pools[i].rkey_len) continue;
    ucs_status_t us = ucp_ep_rkey_unpack(p->data_ep, p->desc.pools[i].rkey, &p->rkeys[i]);
    if (us != UCS_OK) {
      p->rkeys[i] = NULL;
      s = td_err(TD_ERR_FORMAT, "KV transfer: peer pool %u's memory key: %s", p->desc.pools[i].info.pool_id,
                 ucs_status_string(us));
      goto fail;
    }
  }
  if (p->desc.staging) {
    ucs_status_t us = ucp_ep_rkey_unpack(p->data_ep, p->desc.stg_rkey, &p->stg_rkey);
    if (us != UCS_OK) {
      p->stg_rkey = NULL;
      s = td_err(TD_ERR_FORMAT, "KV transfer: peer staging key: %s", ucs_status_string(us));
      goto fail;
    }
  }
  if (p->local && p->stg_rkey && k->gpu) {
    void *ptr = NULL;
    size_t stg_bytes = (size_t)p->desc.stg_slots * p->desc.stg_slot_bytes;
    if (ucp_rkey_ptr(p->stg_rkey, p->desc.stg_base, &ptr) == UCS_OK) {
      if (kvx_gpu_host_register(k->gpu, ptr, stg_bytes) == TD_OK)
        p->stg_ptr = ptr;
      else
        TD_WARN("kvx %s: cannot pin the peer's mapped staging (%s); staging with puts", k->name, td_errmsg());
    }
  }
  kvx_wbuf w;
  kvx_msg_begin(k, &w, KVX_MSG_HELLO, 0);
  kvx_w_u32(&w, (uint32_t)k->addr_len);
  kvx_w_bytes(&w, k->addr, k->addr_len);
  kvx_w_u64(&w, k->host_id);
  kvx_send_msg(k, p->ep, &w);
  DL_APPEND(k->peers, p);
  k->st.peers++;
  TD_DEBUG("kvx %s: connected to %016" PRIx64 " (%s%s%s)", k->name, p->desc.uuid,
           p->local ? "same-host puts" : p->rma ? "puts on the control endpoint" : "data as active messages",
           p->stg_ptr ? ", staging mapped" : "", p->fast ? ", shared-memory messages" : "");
  *out = p;
  return TD_OK;
fail:
  for (int i = 0; i < TD_KVX_MAX_POOLS; i++)
    if (p->rkeys[i]) ucp_rkey_destroy(p->rkeys[i]);
  if (p->stg_rkey) ucp_rkey_destroy(p->stg_rkey);
  if (p->data_ep && p->data_ep != p->ep) kvx_close_ep(k, p->data_ep, false, NULL);
  if (p->ep) {
    kvx_close_ep(k, p->ep, true, p->own);
    p->own = NULL; /* freed when the close completes */
  }
  free(p->own);
  free(p->desc_bytes);
  free(p);
  return s;
}

td_status td_kvx_peer_status(const td_kvx_peer *p) { return p->status; }
uint64_t td_kvx_peer_uuid(const td_kvx_peer *p) { return p->desc.uuid; }
const td_kvx_desc_info *td_kvx_peer_info(const td_kvx_peer *p) { return &p->info; }

/* Frees a disconnected peer once no transfer or operation uses it. */
void kvx_peer_maybe_release(td_kvx_peer *p) {
  td_kvx *k = p->k;
  if (!p->closed || p->n_xfers > 0 || p->n_ops > 0) return;
  if (p->nccl) kvx_nccl_abort(p->nccl);
  p->nccl = NULL;
  if (p->status == TD_OK && p->ep) {
    kvx_wbuf w;
    kvx_msg_begin(k, &w, KVX_MSG_BYE, 0);
    kvx_send_msg(k, p->ep, &w);
  }
  if (p->stg_ptr) kvx_gpu_host_unregister(k->gpu, p->stg_ptr);
  p->stg_ptr = NULL;
  kvx_ipc_unmap(p);
  for (int i = 0; i < TD_KVX_MAX_POOLS; i++)
    if (p->rkeys[i]) ucp_rkey_destroy(p->rkeys[i]);
  if (p->stg_rkey) ucp_rkey_destroy(p->stg_rkey);
  /* An endpoint without error handling cannot be force-closed. */
  if (p->data_ep && p->data_ep != p->ep) kvx_close_ep(k, p->data_ep, false, NULL);
  if (p->ep) {
    kvx_close_ep(k, p->ep, p->status != TD_OK, p->own);
  } else {
    free(p->own);
  }
  DL_DELETE(k->peers, p);
  k->st.peers--;
  free(p->desc_bytes);
  free(p);
}

bool td_kvx_reservation_busy(const td_kvx *k, uint64_t res_id) {
  kvx_grant *g, *tmp;
  HASH_ITER(hh, k->grants, g, tmp) {
    if (g->res_id == res_id) return true;
  }
  return false;
}

td_kvx_stats td_kvx_get_stats(const td_kvx *k) {
  td_kvx_stats s = k->st;
  s.xfers = (int)HASH_COUNT(k->xfers);
  s.grants = (int)HASH_COUNT(k->grants);
  s.ops = k->n_ops;
  s.orphan_ops = k->n_orphans;
  kvx_h2d *h;
  DL_FOREACH(k->h2ds, h) s.ops++;
  kvx_xfer *x, *tmp;
  HASH_ITER(hh, k->xfers, x, tmp) {
    kvx_chunk *ch;
    DL_FOREACH(x->chunks, ch) if (ch->state == CH_IPC) s.ipc_chunks++;
  }
  s.ops += s.ipc_chunks;
  return s;
}

void td_kvx_destroy(td_kvx *k) {
  if (!k) return;
  k->destroying = true;
  if (k->w) {
    td_kvx_peer *p, *ptmp;
    DL_FOREACH_SAFE(k->peers, p, ptmp) {
      kvx_xfer *x, *tmp;
      HASH_ITER(hh, k->xfers, x, tmp) {
        if (x->peer == p) kvx_xfer_stop(x, TD_ERR_CANCELLED, "context shutting down", true);
      }
    }
    kvx_grant *g, *gtmp;
    HASH_ITER(hh, k->grants, g, gtmp) kvx_grant_revoke(g, TD_ERR_CANCELLED, "receiver shutting down");
    /* Let transfers stop cleanly for a moment, then cut. */
    int64_t until = td_now_ms() + TD_KVX_DESTROY_STOP_MS;
    while ((HASH_COUNT(k->xfers) > 0 || k->h2ds) && td_now_ms() < until) td_kvx_progress(k);
    kvx_xfer *x, *tmp;
    HASH_ITER(hh, k->xfers, x, tmp) {
      kvx_orphan_ops(k, x);
      kvx_xfer_finish(x, x->st == XS_STOPPING ? x->fst : TD_ERR_CANCELLED, "context shutting down");
    }
    kvx_h2d *h, *htmp;
    DL_FOREACH_SAFE(k->h2ds, h, htmp) {
      while (kvx_gpu_query(k->gpu, h->ev) == 0) {
      }
      h->g->h2d--;
      kvx_gpu_release(k->gpu, h->ev);
      DL_DELETE(k->h2ds, h);
      free(h);
    }
    HASH_ITER(hh, k->grants, g, gtmp) {
      if (g->gst != G_ENDING)
        kvx_grant_end(g, g->gst == G_CLOSING ? g->est : TD_ERR_CANCELLED, "receiver shutting down");
      while (!kvx_grant_drained(g)) {
      }
      kvx_grant_finalize(g);
    }
    kvx_run_callbacks(k);
    DL_FOREACH_SAFE(k->peers, p, ptmp) {
      p->closed = true;
      if (p->n_ops > 0) {
        /* Orphaned operations stay with the worker; release the rest. */
        kvx_op *op;
        DL_FOREACH(k->ops, op) if (op->peer == p) {
          op->peer = NULL;
        }
        p->n_ops = 0;
      }
      kvx_peer_maybe_release(p);
    }
    kvx_rpeer *rp, *rtmp;
    HASH_ITER(hh, k->rpeers, rp, rtmp) kvx_rpeer_fail(rp, TD_OK, "shutting down", false);
    until = td_now_ms() + TD_KVX_DESTROY_CLOSE_MS;
    while (k->ops && td_now_ms() < until) ucp_worker_progress(k->w);
    kvx_op *op, *otmp;
    DL_FOREACH(k->ops, op) {
      if (op->req) ucp_request_free(op->req); /* no callback after this */
      op->req = NULL;
    }
    /* Endpoints UCX made for peers that connected to us may still hold a
     * wireup reply on a pending queue (a peer that connected just now):
     * UCX asserts when it purges one at destroy, so flush them out first,
     * within the same bound. */
    ucp_request_param_t fp = {.op_attr_mask = 0};
    void *fr = ucp_worker_flush_nbx(k->w, &fp);
    if (UCS_PTR_IS_PTR(fr)) {
      until = td_now_ms() + TD_KVX_DESTROY_CLOSE_MS;
      while (ucp_request_check_status(fr) == UCS_INPROGRESS && td_now_ms() < until) ucp_worker_progress(k->w);
      ucp_request_free(fr);
    }
    if (k->addr) ucp_worker_release_address(k->w, k->addr);
    ucp_worker_destroy(k->w);
    DL_FOREACH_SAFE(k->ops, op, otmp) {
      free(op->own);
      op->peer = NULL;
      kvx_op_free(op);
    }
    DL_FOREACH_SAFE(k->rzombies, rp, rtmp) {
      DL_DELETE(k->rzombies, rp);
      free(rp->own);
      free(rp);
    }
  }
  while (k->inbox) {
    kvx_msg *m = k->inbox;
    k->inbox = m->next;
    free(m);
  }
  kvx_pool *pl, *pltmp;
  HASH_ITER(hh, k->pools, pl, pltmp) {
    HASH_DEL(k->pools, pl);
    pool_free(k, pl);
  }
  for (int i = 0; i < 2; i++) kvx_gpu_dev_free(k->gpu, k->nb[i]); /* communicators are gone */
  free(k->sc_d);
  free(k->sc_s);
  free(k->sc_n);
  if (k->gpu) kvx_gpu_destroy(k->gpu); /* waits for the streams before staging goes */
  if (k->recv_rkey) ucp_rkey_buffer_release(k->recv_rkey);
  if (k->send_memh) ucp_mem_unmap(k->ctx, k->send_memh);
  if (k->recv_ucx_alloc) kvx_gpu_host_unregister(NULL, k->recv_stg);
  if (k->recv_memh) ucp_mem_unmap(k->ctx, k->recv_memh); /* frees UCX-allocated staging */
  if (k->send_stg) kvx_gpu_host_free(NULL, k->send_stg);
  if (k->recv_stg && !k->recv_ucx_alloc) kvx_gpu_host_free(NULL, k->recv_stg);
  free(k->send_free);
  free(k->recv_free);
  if (k->ctx) ucp_cleanup(k->ctx);
  if (k->tfd >= 0) close(k->tfd);
  if (k->epfd >= 0) close(k->epfd);
  for (int i = 0; i < k->n_trace; i++)
    fprintf(stderr, "kvx-trace %s %lld %" PRIu64 " %s %" PRIu64 "\n", k->name, (long long)k->trace[i].ns,
            k->trace[i].xid, k->trace[i].ev, k->trace[i].a);
  free(k->trace);
  free(k->seen);
  free(k);
}
