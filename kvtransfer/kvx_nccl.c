/* The NCCL data path: per-pair communicators made on demand and aborted on
 * any abnormal end, the device bounce slots, and both pipelines over a
 * transfer's byte stream (sender: gather then send; receiver: receive then
 * scatter), chunked identically on both sides (kvx_chunk_len).
 * docs/kvtransfer.md, "NCCL pipeline". */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kvtransfer/kvx_internal.h"

/* The bounce slots of one direction (0: send, 1: receive), allocated on
 * first use and kept until destroy: cudaFree synchronises the device, which
 * a send stuck behind a dead peer would hang. */
td_status kvx_bounce_ring(td_kvx *k, int side) {
  if (k->nb[side]) return TD_OK;
  void *p = NULL;
  TD_TRY(kvx_gpu_dev_alloc(k->gpu, (size_t)k->nccl_chunk * KVX_NCCL_SLOTS, &p));
  k->nb[side] = p;
  for (int i = 0; i < KVX_NCCL_SLOTS; i++) k->nb_free[side][i] = KVX_NCCL_SLOTS - 1 - i;
  k->n_nb_free[side] = KVX_NCCL_SLOTS;
  return TD_OK;
}

td_status kvx_scratch(td_kvx *k, size_t n) {
  if (n <= k->sc_cap) return TD_OK;
  size_t cap = n < 256 ? 256 : n;
  free(k->sc_d);
  free(k->sc_s);
  free(k->sc_n);
  k->sc_d = malloc(sizeof(void *) * cap);
  k->sc_s = malloc(sizeof(void *) * cap);
  k->sc_n = malloc(sizeof(size_t) * cap);
  k->sc_cap = (k->sc_d && k->sc_s && k->sc_n) ? cap : 0;
  return k->sc_cap ? TD_OK : td_err(TD_ERR_NOMEM, "out of memory");
}

kvx_nstream *kvx_nstream_new(uint64_t first, uint64_t max) {
  kvx_nstream *ns = calloc(1, sizeof *ns);
  if (!ns) return NULL;
  ns->first = first;
  ns->max = max;
  for (int i = 0; i < KVX_NCCL_WINDOW; i++) ns->ring[i].slot = -1;
  return ns;
}

/* Clears the group op of chunks [c, end) that share chunk c's (a group
 * covers consecutive chunks) and returns it, to be freed once. */
static kvx_nccl_op *nstream_take_op(kvx_nstream *ns, uint64_t c, uint64_t end) {
  kvx_nccl_op *op = ns->ring[c % KVX_NCCL_WINDOW].op;
  for (; c < end && ns->ring[c % KVX_NCCL_WINDOW].op == op; c++) ns->ring[c % KVX_NCCL_WINDOW].op = NULL;
  return op;
}

/* Frees the sends / receives in flight (their communicator is about to be
 * aborted). A receive stopped so may write for a moment longer: the
 * receiver waits for an event queued behind it before the slot or the
 * blocks are used again. */
void kvx_nstream_drop_ops(td_kvx *k, kvx_nstream *ns, bool recv) {
  if (!ns) return;
  for (uint64_t c = ns->done; c < ns->post; c++) {
    kvx_nchunk *e = &ns->ring[c % KVX_NCCL_WINDOW];
    if (!e->op) continue;
    if (recv)
      for (uint64_t d = c; d < ns->post && ns->ring[d % KVX_NCCL_WINDOW].op == e->op; d++) {
        kvx_nchunk *f = &ns->ring[d % KVX_NCCL_WINDOW];
        if (!f->ev && kvx_gpu_record(k->gpu, KVX_S_NCCL_RX, &f->ev) != TD_OK) {
          f->ev = NULL;
          td_err_clear();
        }
      }
    kvx_nccl_op_free(nstream_take_op(ns, c, ns->post));
  }
}

/* Whether no copy (or stopped receive) of the stream's chunks is pending. */
bool kvx_nstream_quiet(td_kvx *k, kvx_nstream *ns) {
  if (!ns) return true;
  for (uint64_t c = ns->done; c < ns->prep; c++) {
    kvx_nchunk *e = &ns->ring[c % KVX_NCCL_WINDOW];
    if (e->ev && kvx_gpu_query(k->gpu, e->ev) == 0) return false;
  }
  return true;
}

/* Releases what the unfinished chunks hold and frees the stream. */
void kvx_nstream_free(td_kvx *k, kvx_nstream *ns, int side) {
  if (!ns) return;
  for (uint64_t c = ns->done; c < ns->prep; c++) {
    kvx_nchunk *e = &ns->ring[c % KVX_NCCL_WINDOW];
    if (e->op) kvx_nccl_op_free(nstream_take_op(ns, c, ns->prep));
    if (e->ev) kvx_gpu_release(k->gpu, e->ev);
    if (e->slot >= 0) k->nb_free[side][k->n_nb_free[side]++] = e->slot;
    free(e->pc);
  }
  free(ns);
}

/* The pieces of a stream's next chunk (*pc, malloc'ed), from the plan's
 * cursor, which is not advanced: *ci / *coff get the cursor after it. */
static td_status nstream_pieces(const kvx_nstream *ns, const td_kvx_slice *items, int n_items, uint64_t total,
                                td_kvx_slice **pc, uint64_t *len, int *n, int *ci, uint64_t *coff) {
  *len = kvx_chunk_len(total, ns->first, ns->max, ns->prep, ns->prep_bytes);
  *n = kvx_plan_count(items, n_items, ns->ci, ns->coff, *len);
  if (*len == 0 || *n == 0)
    return td_err(TD_ERR_INTERNAL, "KV transfer: NCCL chunk %" PRIu64 " beyond the plan", ns->prep);
  *pc = malloc(sizeof **pc * (size_t)*n);
  if (!*pc) return td_err(TD_ERR_NOMEM, "out of memory");
  *ci = ns->ci;
  *coff = ns->coff;
  kvx_plan_take(items, n_items, ci, coff, *len, *pc);
  return TD_OK;
}

/* Aborts the peer's NCCL communicator: every NCCL transfer on it fails,
 * and the receiver aborts its side (a queued receive cannot be cancelled). */
void kvx_peer_nccl_abort(td_kvx_peer *p, td_status s, const char *why, bool tell) {
  td_kvx *k = p->k;
  if (!p->nccl) return;
  if (tell && p->status == TD_OK && p->ep) {
    kvx_wbuf w;
    kvx_msg_begin(k, &w, KVX_MSG_NCCL_ABORT, 0);
    kvx_w_u32(&w, p->nccl_gen);
    kvx_send_msg(k, p->ep, &w);
  }
  kvx_xfer *x, *tmp;
  HASH_ITER(hh, k->xfers, x, tmp) {
    if (x->peer == p && x->nccl) kvx_nstream_drop_ops(k, x->ns, false);
  }
  kvx_nccl_abort(p->nccl);
  p->nccl = NULL;
  HASH_ITER(hh, k->xfers, x, tmp) {
    if (x->peer == p && x->nccl && x->st != XS_STOPPING) kvx_xfer_stop(x, s, why, true);
  }
}

/* The next chunk of a stream: its pieces and its ring entry (reset). */
static td_status nchunk_next(kvx_nstream *ns, const td_kvx_slice *items, int n_items, uint64_t total,
                             kvx_nchunk **out, td_kvx_slice **pc, int *n, int *ci, uint64_t *coff) {
  uint64_t len;
  TD_TRY(nstream_pieces(ns, items, n_items, total, pc, &len, n, ci, coff));
  kvx_nchunk *e = &ns->ring[ns->prep % KVX_NCCL_WINDOW];
  memset(e, 0, sizeof *e);
  e->slot = -1;
  e->len = len;
  *out = e;
  return TD_OK;
}

/* The chunk is ready to post: the stream moves past it. */
static void nchunk_made(kvx_nstream *ns, const kvx_nchunk *e, int ci, uint64_t coff) {
  ns->ci = ci;
  ns->coff = coff;
  ns->prep++;
  ns->prep_bytes += e->len;
}

/* Prepares the sender's next chunk: straight from the pool when its pieces
 * are contiguous there, else gathered into a bounce slot by one kernel
 * launch. *made stays false while no slot is free. */
static td_status nccl_prepare(kvx_xfer *x, bool *made) {
  td_kvx *k = x->k;
  kvx_nstream *ns = x->ns;
  *made = false;
  td_kvx_slice *pc = NULL;
  uint64_t coff;
  int n, ci;
  kvx_nchunk *e;
  TD_TRY(nchunk_next(ns, x->items, x->n_items, x->total, &e, &pc, &n, &ci, &coff));
  uint8_t *base = x->pool->d.base;
  td_status s = TD_OK;
  if (kvx_pieces_contiguous(pc, n, true)) {
    e->buf = base + pc[0].src_off;
  } else if (k->n_nb_free[0] == 0) {
    free(pc);
    return TD_OK;
  } else if ((s = kvx_scratch(k, (size_t)n)) == TD_OK) {
    e->slot = k->nb_free[0][--k->n_nb_free[0]];
    e->buf = k->nb[0] + (size_t)e->slot * k->nccl_chunk;
    uint64_t packed = 0;
    for (int i = 0; i < n; i++) {
      k->sc_d[i] = e->buf + packed;
      k->sc_s[i] = base + pc[i].src_off;
      k->sc_n[i] = pc[i].len;
      packed += pc[i].len;
    }
    s = kvx_gpu_copy_d2d(k->gpu, KVX_S_GATHER, k->sc_d, k->sc_s, k->sc_n, (size_t)n);
    if (s == TD_OK) s = kvx_gpu_record(k->gpu, KVX_S_GATHER, &e->ev);
    if (s != TD_OK) {
      k->nb_free[0][k->n_nb_free[0]++] = e->slot;
      e->slot = -1;
    }
  }
  free(pc);
  if (s != TD_OK) return s;
  nchunk_made(ns, e, ci, coff);
  *made = true;
  return TD_OK;
}

/* The sender's NCCL pipeline: chunk i + 1 is gathered (gather stream) while
 * chunk i is sent (NCCL stream, after waiting for its gather), with up to
 * KVX_NCCL_WINDOW chunks in flight. */
int kvx_pump_nccl_send(kvx_xfer *x) {
  td_kvx *k = x->k;
  td_kvx_peer *p = x->peer;
  kvx_nstream *ns = x->ns;
  if (!p->nccl) {
    kvx_xfer_stop(x, TD_ERR_NETWORK, "NCCL communicator gone", true);
    return 1;
  }
  /* While a group is being launched, the rest goes on (but no posting). */
  if (kvx_nccl_poll(p->nccl) < 0) {
    kvx_peer_nccl_abort(p, TD_ERR_NETWORK, td_errmsg(), true);
    return 1;
  }
  if (!kvx_nccl_ready(p->nccl)) return 0;
  int work = 0;
  /* Groups complete in order; their slots go back. */
  while (ns->done < ns->post) {
    int q = kvx_nccl_op_poll(ns->ring[ns->done % KVX_NCCL_WINDOW].op);
    if (q < 0) {
      kvx_peer_nccl_abort(p, TD_ERR_NETWORK, td_errmsg(), true);
      return 1;
    }
    if (q == 0) break;
    kvx_nccl_op_free(nstream_take_op(ns, ns->done, ns->post));
    for (; ns->done < ns->post && !ns->ring[ns->done % KVX_NCCL_WINDOW].op; ns->done++) {
      kvx_nchunk *e = &ns->ring[ns->done % KVX_NCCL_WINDOW];
      if (e->ev) kvx_gpu_release(k->gpu, e->ev);
      e->ev = NULL;
      if (e->slot >= 0) k->nb_free[0][k->n_nb_free[0]++] = e->slot;
      e->slot = -1;
      work++;
    }
  }
  /* Only the transfer whose turn it is takes slots and posts (the receiver
   * queues its receives in grant order); the next one starts once all of
   * this one's sends are posted. */
  if (!ns->all_posted && p->nccl_next_seq == x->seq) {
    if (!ns->started) {
      ns->started = true;
      td_status s = TD_OK;
      if (x->ready_ev) s = kvx_gpu_wait(k->gpu, KVX_S_GATHER, x->ready_ev);
      if (x->ready_ev && s == TD_OK) s = kvx_gpu_wait(k->gpu, KVX_S_NCCL, x->ready_ev);
      if (s != TD_OK) {
        kvx_xfer_stop(x, s, td_errmsg(), true);
        return 1;
      }
    }
    /* Gather and post alternately: the first chunk goes alone, and the
     * chunks gathered while a group is being launched go together. */
    for (bool more = true; more;) {
      more = false;
      if (ns->prep_bytes < x->total && ns->prep - ns->done < KVX_NCCL_WINDOW) {
        td_status s = nccl_prepare(x, &more);
        if (s != TD_OK) {
          kvx_xfer_stop(x, s, td_errmsg(), true);
          return 1;
        }
      }
      if (ns->post < ns->prep && kvx_nccl_idle(p->nccl)) {
        kvx_nccl_buf b[KVX_NCCL_GROUP];
        int n = 0;
        for (uint64_t c = ns->post; c < ns->prep && n < KVX_NCCL_GROUP; c++) {
          kvx_nchunk *e = &ns->ring[c % KVX_NCCL_WINDOW];
          b[n++] = (kvx_nccl_buf){e->buf, e->len, e->ev};
        }
        kvx_nccl_op *op = NULL;
        td_status s = kvx_nccl_post(p->nccl, true, b, n, &op);
        if (s != TD_OK) {
          kvx_peer_nccl_abort(p, s, td_errmsg(), true);
          return 1;
        }
        for (int i = 0; i < n; i++, ns->post++) ns->ring[ns->post % KVX_NCCL_WINDOW].op = op;
        more = true;
      }
      work += more;
    }
    if (ns->prep_bytes == x->total && ns->post == ns->prep) {
      ns->all_posted = true;
      p->nccl_next_seq++;
      x->bytes_put = x->total;
    }
  }
  if (ns->all_posted && ns->done == ns->post) {
    k->st.bytes_sent += x->total;
    kvx_xfer_send_done(x);
    work++;
  }
  return work;
}

void kvx_rpeer_nccl_abort(kvx_rpeer *rp, td_status s, const char *why, bool tell) {
  td_kvx *k = rp->k;
  if (!rp->nccl) return;
  if (tell && !rp->failed && rp->ep) {
    kvx_wbuf w;
    kvx_msg_begin(k, &w, KVX_MSG_NCCL_ABORT, 1); /* 1: from the receiver */
    kvx_w_u32(&w, rp->nccl_gen);
    kvx_send_msg(k, rp->ep, &w);
  }
  kvx_grant *g, *tmp;
  HASH_ITER(hh, k->grants, g, tmp) {
    if (g->rp == rp && g->nccl) kvx_nstream_drop_ops(k, g->ns, true);
  }
  kvx_nccl_abort(rp->nccl);
  rp->nccl = NULL;
  HASH_ITER(hh, k->grants, g, tmp) {
    if (g->rp != rp || !g->nccl || g->gst == G_ENDING) continue;
    if (rp->failed)
      kvx_grant_end(g, s, why);
    else
      kvx_grant_revoke(g, s, why);
  }
}

/* Prepares the receiver's next chunk: straight into the pool when its
 * pieces are contiguous there, else into a bounce slot (scattered once
 * received). *made stays false while no slot is free. */
static td_status nccl_prepare_recv(kvx_grant *g, bool *made) {
  td_kvx *k = g->k;
  kvx_nstream *ns = g->ns;
  *made = false;
  td_kvx_slice *pc = NULL;
  uint64_t coff;
  int n, ci;
  kvx_nchunk *e;
  TD_TRY(nchunk_next(ns, g->items, g->n_items, g->total, &e, &pc, &n, &ci, &coff));
  if (kvx_pieces_contiguous(pc, n, false)) {
    e->buf = (uint8_t *)g->pool->d.base + pc[0].dst_off;
    free(pc);
  } else if (k->n_nb_free[1] == 0) {
    free(pc);
    return TD_OK;
  } else {
    e->slot = k->nb_free[1][--k->n_nb_free[1]];
    e->buf = k->nb[1] + (size_t)e->slot * k->nccl_chunk;
    e->pc = pc;
    e->n_pc = n;
  }
  nchunk_made(ns, e, ci, coff);
  *made = true;
  return TD_OK;
}

/* Copies a received slot out into the pool (scatter stream). */
static td_status nccl_scatter(kvx_grant *g, kvx_nchunk *e) {
  td_kvx *k = g->k;
  TD_TRY(kvx_scratch(k, (size_t)e->n_pc));
  uint8_t *base = g->pool->d.base;
  uint64_t packed = 0;
  for (int i = 0; i < e->n_pc; i++) {
    k->sc_d[i] = base + e->pc[i].dst_off;
    k->sc_s[i] = e->buf + packed;
    k->sc_n[i] = e->pc[i].len;
    packed += e->pc[i].len;
  }
  TD_TRY(kvx_gpu_copy_d2d(k->gpu, KVX_S_SCATTER, k->sc_d, k->sc_s, k->sc_n, (size_t)e->n_pc));
  return kvx_gpu_record(k->gpu, KVX_S_SCATTER, &e->ev);
}

/* The receiver's NCCL pipeline: chunk i - 1 is scattered (scatter stream)
 * while chunk i is received (NCCL receive stream), with up to
 * KVX_NCCL_WINDOW receives queued. */
int kvx_pump_nccl_recv(kvx_grant *g) {
  td_kvx *k = g->k;
  kvx_rpeer *rp = g->rp;
  kvx_nstream *ns = g->ns;
  if (!rp->nccl) {
    kvx_grant_revoke(g, TD_ERR_NETWORK, "NCCL communicator gone");
    return 1;
  }
  /* While a group is being launched, the rest goes on (but no posting). */
  if (kvx_nccl_poll(rp->nccl) < 0) {
    kvx_rpeer_nccl_abort(rp, TD_ERR_NETWORK, td_errmsg(), true);
    return 1;
  }
  if (!kvx_nccl_ready(rp->nccl)) return 0;
  int work = 0;
  /* Groups complete in order; a slot is scattered as soon as it is in. */
  for (uint64_t c = ns->done; c < ns->post;) {
    kvx_nchunk *e = &ns->ring[c % KVX_NCCL_WINDOW];
    if (!e->op) {
      c++;
      continue;
    }
    int q = kvx_nccl_op_poll(e->op);
    if (q < 0) {
      kvx_rpeer_nccl_abort(rp, TD_ERR_NETWORK, td_errmsg(), true);
      return 1;
    }
    if (q == 0) break;
    uint64_t first = c;
    kvx_nccl_op *op = e->op;
    for (; c < ns->post && ns->ring[c % KVX_NCCL_WINDOW].op == op; c++) {}
    kvx_nccl_op_free(nstream_take_op(ns, first, c));
    for (uint64_t d = first; d < c; d++) {
      kvx_nchunk *f = &ns->ring[d % KVX_NCCL_WINDOW];
      td_status s = f->slot >= 0 ? nccl_scatter(g, f) : TD_OK;
      if (s != TD_OK) {
        kvx_grant_revoke(g, s, td_errmsg());
        return 1;
      }
    }
    work++;
  }
  while (ns->done < ns->post) {
    kvx_nchunk *e = &ns->ring[ns->done % KVX_NCCL_WINDOW];
    if (e->op) break;
    if (e->ev) {
      int q = kvx_gpu_query(k->gpu, e->ev);
      if (q == 0) break;
      if (q < 0) {
        kvx_grant_revoke(g, TD_ERR_CUDA, td_errmsg());
        return 1;
      }
      kvx_gpu_release(k->gpu, e->ev);
      e->ev = NULL;
    }
    if (e->slot >= 0) k->nb_free[1][k->n_nb_free[1]++] = e->slot;
    e->slot = -1;
    free(e->pc);
    e->pc = NULL;
    g->received += e->len;
    ns->done++;
    work++;
  }
  /* The chunks there are slots for go in one group. */
  if (!ns->all_posted && kvx_nccl_idle(rp->nccl)) {
    bool made = true;
    while (made && ns->prep_bytes < g->total && ns->prep - ns->done < KVX_NCCL_WINDOW &&
           ns->prep - ns->post < KVX_NCCL_GROUP) {
      td_status s = nccl_prepare_recv(g, &made);
      if (s != TD_OK) {
        kvx_rpeer_nccl_abort(rp, s, td_errmsg(), true);
        return 1;
      }
    }
    if (ns->post < ns->prep) {
      kvx_nccl_buf b[KVX_NCCL_GROUP];
      int n = 0;
      for (uint64_t c = ns->post; c < ns->prep; c++) {
        kvx_nchunk *e = &ns->ring[c % KVX_NCCL_WINDOW];
        b[n++] = (kvx_nccl_buf){e->buf, e->len, NULL};
      }
      kvx_nccl_op *op = NULL;
      td_status s = kvx_nccl_post(rp->nccl, false, b, n, &op);
      if (s != TD_OK) {
        kvx_rpeer_nccl_abort(rp, s, td_errmsg(), true);
        return 1;
      }
      for (; ns->post < ns->prep; ns->post++) ns->ring[ns->post % KVX_NCCL_WINDOW].op = op;
      work++;
    }
    if (ns->prep_bytes == g->total) {
      ns->all_posted = true;
      rp->nccl_seq_post++;
    }
  }
  if (ns->all_posted && ns->done == ns->post) {
    kvx_send_status(k, rp->fast_ep ? rp->fast_ep : rp->ep, KVX_MSG_ACK, g->key.xid, TD_OK, "");
    kvx_grant_end(g, TD_OK, "");
    work++;
  }
  return work;
}
