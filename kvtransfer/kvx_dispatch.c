/* The transfer context's loop: incoming messages routed by type to the
 * sender (kvx_send.c) or the receiver (kvx_recv.c), peer failures that UCX
 * reported, the callbacks of ended transfers and grants, and
 * td_kvx_progress / arm / wait: the one place where every part is pumped,
 * in a fixed order. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include "common/log.h"
#include "kvtransfer/kvx_internal.h"

static kvx_xfer *msg_xfer(td_kvx *k, uint64_t uuid, uint64_t xid) {
  kvx_xfer *x = NULL;
  HASH_FIND(hh, k->xfers, &xid, sizeof xid, x);
  if (x && x->peer->desc.uuid != uuid) return NULL;
  return x;
}

static void handle_msg(td_kvx *k, const uint8_t *data, size_t len) {
  kvx_rbuf r = {.p = data, .len = len};
  uint32_t magic = kvx_r_u32(&r);
  uint16_t ver = kvx_r_u16(&r), type = kvx_r_u16(&r);
  uint64_t uuid = kvx_r_u64(&r), xid = kvx_r_u64(&r);
  if (r.bad || magic != KVX_MSG_MAGIC || ver != KVX_MSG_VERSION || type == 0 || type >= KVX_MSG_TYPES) {
    TD_WARN("kvx %s: dropping a malformed message (%zu bytes)", k->name, len);
    return;
  }
  if (type == KVX_MSG_HELLO) {
    kvx_handle_hello(k, uuid, &r);
    return;
  }
  /* Receiver-bound messages come from a peer that said HELLO. */
  if (type == KVX_MSG_NCCL_ABORT && xid == 1) {
    /* From a receiver: the communicators of our peer handles to it. */
    uint32_t gen = kvx_r_u32(&r);
    td_kvx_peer *p;
    DL_FOREACH(k->peers, p) {
      if (p->desc.uuid == uuid && p->nccl && p->nccl_gen == gen && !r.bad)
        kvx_peer_nccl_abort(p, TD_ERR_NETWORK, "the receiver aborted the NCCL communicator", false);
    }
    return;
  }
  if (type == KVX_MSG_REQ || type == KVX_MSG_CHUNK || type == KVX_MSG_DONE || type == KVX_MSG_ABORT ||
      type == KVX_MSG_NCCL_ID || type == KVX_MSG_BYE || type == KVX_MSG_NCCL_ABORT) {
    kvx_receiver_msg(k, type, uuid, xid, &r);
    return;
  }
  kvx_xfer *x = msg_xfer(k, uuid, xid);
  if (!x) return; /* a transfer that already ended */
  x->peer->known = true;
  kvx_sender_msg(x, type, xid, &r);
}

static int process_inbox(td_kvx *k) {
  int n = 0;
  while (k->inbox) {
    kvx_msg *m = k->inbox;
    k->inbox = m->next;
    if (!k->inbox) k->inbox_tail = NULL;
    handle_msg(k, m->data, m->len);
    free(m);
    n++;
  }
  return n;
}

static void process_failures(td_kvx *k) {
  k->fail_pending = false;
again:;
  td_kvx_peer *p;
  DL_FOREACH(k->peers, p) {
    if (!p->own || p->own->failed == UCS_OK || p->status != TD_OK) continue;
    p->status = TD_ERR_PEER;
    snprintf(p->msg, sizeof p->msg, "peer %016" PRIx64 " failed: %s", p->desc.uuid, ucs_status_string(p->own->failed));
    TD_WARN("kvx %s: %s", k->name, p->msg);
    kvx_peer_nccl_abort(p, TD_ERR_PEER, p->msg, false);
    kvx_orphan_msgs(k, p->ep, p->data_ep);
    kvx_xfer *x, *tmp;
    HASH_ITER(hh, k->xfers, x, tmp) {
      if (x->peer != p) continue;
      kvx_orphan_ops(k, x);
      /* A transfer already stopping keeps its reason (e.g. its timeout). */
      if (x->st == XS_STOPPING)
        kvx_xfer_finish(x, x->fst, x->fmsg);
      else
        kvx_xfer_finish(x, TD_ERR_PEER, p->msg);
    }
    /* Its copies were waited for: the dead peer's memory goes back now. */
    kvx_ipc_unmap(p);
    if (p->data_ep == p->ep) {
      /* The failed endpoint completed its operations; keys go before it. */
      for (int i = 0; i < TD_KVX_MAX_POOLS; i++) {
        if (p->rkeys[i]) ucp_rkey_destroy(p->rkeys[i]);
        p->rkeys[i] = NULL;
      }
      if (p->stg_rkey) ucp_rkey_destroy(p->stg_rkey);
      p->stg_rkey = NULL;
      p->data_ep = NULL;
    }
    kvx_close_ep(k, p->ep, true, p->own);
    p->ep = NULL;
    p->own = NULL;
    if (p->closed) {
      kvx_peer_maybe_release(p);
    } else if (k->o.on_peer) {
      /* The callback may disconnect peers: rescan afterwards. */
      k->o.on_peer(k->o.ctx, p, p->desc.uuid, TD_ERR_PEER, p->msg);
    }
    goto again;
  }
  kvx_rpeer *rp, *rtmp;
  HASH_ITER(hh, k->rpeers, rp, rtmp) {
    if (!rp->own || rp->own->failed == UCS_OK) continue;
    char m[KVX_TEXT];
    snprintf(m, sizeof m, "peer %016" PRIx64 " failed: %s", rp->uuid, ucs_status_string(rp->own->failed));
    TD_WARN("kvx %s: %s", k->name, m);
    kvx_rpeer_fail(rp, TD_ERR_PEER, m, true);
    goto again;
  }
}

int kvx_run_callbacks(td_kvx *k) {
  int n = 0;
  while (k->xdone || k->gdone) {
    while (k->xdone) {
      kvx_xfer *x = k->xdone;
      k->xdone = x->dnext;
      td_kvx_peer *p = x->peer;
      kvx_trace(k, x->id, "cb", 0);
      if (x->cb) x->cb(x->arg, x->id, x->fst, x->fmsg);
      free(x->items);
      free(x->blocks);
      free(x);
      p->n_xfers--;
      kvx_peer_maybe_release(p);
      n++;
    }
    while (k->gdone) {
      kvx_grant *g = k->gdone;
      k->gdone = g->dnext;
      if (k->o.on_recv) {
        td_kvx_recv_event ev = {g->est,    g->emsg,      g->key.uuid, g->request_id, g->res_id,
                                g->pool->id, g->blocks, g->n_blocks, g->received};
        k->o.on_recv(k->o.ctx, &ev);
      }
      free(g->items);
      free(g->blocks - g->n_blocks);
      free(g);
      n++;
    }
  }
  return n;
}

int td_kvx_progress(td_kvx *k) {
  int work = 0;
  uint64_t ticks;
  while (read(k->tfd, &ticks, sizeof ticks) > 0) {
  }
  for (int i = 0; i < 256 && ucp_worker_progress(k->w); i++) work++;
  work += process_inbox(k);
  if (k->fail_pending) {
    process_failures(k);
    work++;
  }
  work += kvx_pump_h2d(k);
  work += kvx_pump_grants(k);
  work += kvx_pump_xfers(k);
  work += kvx_run_callbacks(k);
  return work;
}

/* Work that no file descriptor signals: CUDA copies (staged, IPC) and NCCL groups. */
static bool gpu_busy(td_kvx *k) {
  if (k->h2ds) return true;
  kvx_xfer *x, *tmp;
  HASH_ITER(hh, k->xfers, x, tmp) {
    if (x->nccl && (x->st == XS_RUN || (x->st == XS_STOPPING && x->ns))) return true;
    kvx_chunk *ch;
    DL_FOREACH(x->chunks, ch) if (ch->state == CH_D2H || ch->state == CH_IPC) return true;
    if (x->ready_ev && !x->ready_done && x->st == XS_RUN) return true;
  }
  kvx_grant *g, *gtmp;
  HASH_ITER(hh, k->grants, g, gtmp) {
    if (g->nccl && (g->gst == G_PENDING || g->gst == G_ACTIVE || g->gst == G_ENDING)) return true;
  }
  return false;
}

bool td_kvx_arm(td_kvx *k) {
  if (k->inbox || k->xdone || k->gdone || k->fail_pending || gpu_busy(k)) return false;
  ucs_status_t s = ucp_worker_arm(k->w);
  if (s == UCS_ERR_BUSY) return false;
  if (s != UCS_OK) return false;
  int64_t next = INT64_MAX;
  kvx_xfer *x, *tmp;
  HASH_ITER(hh, k->xfers, x, tmp) {
    int64_t d = x->st == XS_STOPPING ? x->stop_deadline : x->deadline;
    if (d < next) next = d;
  }
  kvx_grant *g, *gtmp;
  HASH_ITER(hh, k->grants, g, gtmp) {
    int64_t d = g->gst == G_CLOSING ? g->hard_deadline : g->deadline;
    if (g->gst != G_ENDING && d < next) next = d;
  }
  struct itimerspec its;
  memset(&its, 0, sizeof its);
  if (next != INT64_MAX) {
    int64_t ms = next - td_now_ms() + 1;
    if (ms < 1) ms = 1;
    its.it_value.tv_sec = ms / 1000;
    its.it_value.tv_nsec = (ms % 1000) * 1000000;
  }
  timerfd_settime(k->tfd, 0, &its, NULL);
  return true;
}

void td_kvx_wait(td_kvx *k, int timeout_ms) {
  if (td_kvx_progress(k) > 0) return;
  if (!td_kvx_arm(k)) return;
  struct epoll_event ev[4];
  epoll_wait(k->epfd, ev, 4, timeout_ms);
  td_kvx_progress(k);
}
