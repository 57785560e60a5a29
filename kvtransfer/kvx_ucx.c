/* The UCX layer of the transfer context: the context and worker with their
 * active-message handlers and wakeup descriptors, endpoints and what their
 * lanes allow, operations in flight (puts, flushes, messages, closes) and
 * their completion, control messages, memory registration. Everything
 * that talks to ucp_* except the data path's puts (kvx_put.c). */
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include "common/log.h"
#include "kvtransfer/kvx_internal.h"

/* CMA (process_vm_writev) can be refused by seccomp or Yama; UCX would
 * then fail puts on an endpoint that cannot report it, so test first. */
static bool cma_allowed(void) {
  FILE *f = fopen("/proc/sys/kernel/yama/ptrace_scope", "r");
  if (f) {
    int scope = 0;
    if (fscanf(f, "%d", &scope) != 1) scope = 0;
    fclose(f);
    if (scope >= 2) return false;
  }
  char a[16] = "tandem-kvx-cma", b[16] = {0};
  struct iovec l = {a, sizeof a}, r = {b, sizeof b};
  return process_vm_writev(getpid(), &l, 1, &r, 1, 0) == (ssize_t)sizeof a && memcmp(a, b, sizeof a) == 0;
}

static bool local_path_wanted(const td_kvx_opts *o) {
  if (o->local_path == TD_KVX_LOCAL_OFF) return false;
  /* A UCX_TLS without shared-memory transports leaves nothing to gain. */
  const char *tls = o->ucx_tls && *o->ucx_tls ? o->ucx_tls : NULL;
  if (tls && !strstr(tls, "sm") && !strstr(tls, "posix") && !strstr(tls, "sysv") && !strstr(tls, "cma") &&
      !strstr(tls, "all"))
    return false;
  return cma_allowed();
}

kvx_op *kvx_op_new(td_kvx *k, int kind) {
  kvx_op *op = calloc(1, sizeof *op);
  if (!op) return NULL;
  op->k = k;
  op->kind = kind;
  DL_APPEND(k->ops, op);
  k->n_ops++;
  return op;
}

void kvx_op_free(kvx_op *op) {
  td_kvx *k = op->k;
  DL_DELETE(k->ops, op);
  k->n_ops--;
  if (op->orphan) k->n_orphans--;
  if (op->peer) op->peer->n_ops--;
  free(op->buf);
  free(op);
}

void kvx_xfer_op_error(kvx_xfer *x, ucs_status_t s, const char *what) {
  if (x->op_err != TD_OK) return;
  x->op_err = (s == UCS_ERR_CANCELED) ? TD_ERR_CANCELLED : TD_ERR_NETWORK;
  snprintf(x->op_msg, KVX_TEXT, "%s failed: %s", what, ucs_status_string(s));
}

static void op_done(kvx_op *op, ucs_status_t s) {
  kvx_xfer *x = op->x;
  switch (op->kind) {
    case OP_PUT:
      if (x) {
        x->ops--;
        if (op->ch) op->ch->pending--;
        if (s != UCS_OK) kvx_xfer_op_error(x, s, "put");
      }
      break;
    case OP_FLUSH:
      if (x) {
        x->ops--;
        if (s != UCS_OK) kvx_xfer_op_error(x, s, "flush");
        if (op->flush == FL_CHUNK && op->ch) op->ch->state = CH_FLUSHED;
        if (op->flush == FL_FINAL) x->final_flushed = true;
        if (op->flush == FL_STOP) x->stop_flushed = true;
      }
      break;
    case OP_CLOSE:
      free(op->own);
      op->own = NULL;
      break;
    default:
      break;
  }
  kvx_op_free(op);
}

static void ucx_cb(void *req, ucs_status_t s, void *user) {
  kvx_op *op = user;
  op->req = NULL;
  ucp_request_free(req);
  op_done(op, s);
}

void kvx_op_issued(kvx_op *op, ucs_status_ptr_t r) {
  if (r == NULL) {
    op_done(op, UCS_OK);
  } else if (UCS_PTR_IS_ERR(r)) {
    op_done(op, UCS_PTR_STATUS(r));
  } else {
    op->req = r;
  }
}

ucp_request_param_t kvx_op_param(kvx_op *op) {
  ucp_request_param_t p;
  memset(&p, 0, sizeof p);
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = ucx_cb;
  p.user_data = op;
  return p;
}

/* Detaches the operations of a transfer whose peer failed: they may never
 * complete (an endpoint without error handling cannot be force-closed);
 * they are freed when they do, or at destroy. */
void kvx_orphan_ops(td_kvx *k, kvx_xfer *x) {
  kvx_op *op;
  DL_FOREACH(k->ops, op) {
    if (op->x == x) {
      op->x = NULL;
      op->ch = NULL;
      op->orphan = true;
      k->n_orphans++;
    }
  }
  x->ops = 0;
}

/* Messages still queued to a failed peer may never complete (a
 * shared-memory lane has no error handling): count them as orphans. */
void kvx_orphan_msgs(td_kvx *k, ucp_ep_h a, ucp_ep_h b) {
  kvx_op *op;
  DL_FOREACH(k->ops, op) {
    if (op->kind == OP_AM && !op->orphan && op->ep && (op->ep == a || op->ep == b)) {
      op->orphan = true;
      k->n_orphans++;
    }
  }
}

void kvx_close_ep(td_kvx *k, ucp_ep_h ep, bool force, kvx_ep_owner *own) {
  if (!ep) return;
  if (own) own->closing = true;
  kvx_op *op = kvx_op_new(k, OP_CLOSE);
  if (!op) return;
  op->own = own;
  ucp_request_param_t p = kvx_op_param(op);
  if (force) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  }
  kvx_op_issued(op, ucp_ep_close_nbx(ep, &p));
}

void kvx_msg_begin(td_kvx *k, kvx_wbuf *w, int type, uint64_t xid) {
  memset(w, 0, sizeof *w);
  kvx_w_u32(w, KVX_MSG_MAGIC);
  kvx_w_u16(w, KVX_MSG_VERSION);
  kvx_w_u16(w, (uint16_t)type);
  kvx_w_u64(w, k->uuid);
  kvx_w_u64(w, xid);
}

static void w_text(kvx_wbuf *w, const char *s) {
  size_t n = s ? strlen(s) : 0;
  if (n > KVX_TEXT - 1) n = KVX_TEXT - 1;
  kvx_w_u16(w, (uint16_t)n);
  kvx_w_bytes(w, s, n);
}

void kvx_r_text(kvx_rbuf *r, char *out) {
  uint16_t n = kvx_r_u16(r);
  const uint8_t *p = n < KVX_TEXT ? kvx_r_bytes(r, n) : NULL;
  if (!p) {
    r->bad = true;
    out[0] = 0;
    return;
  }
  memcpy(out, p, n);
  out[n] = 0;
}

void kvx_send_msg(td_kvx *k, ucp_ep_h ep, kvx_wbuf *w) {
  if (!ep || w->oom) {
    free(w->p);
    if (w->oom) TD_ERROR("kvx %s: out of memory building a message", k->name);
    return;
  }
  kvx_op *op = kvx_op_new(k, OP_AM);
  if (!op) {
    free(w->p);
    return;
  }
  op->buf = w->p;
  op->ep = ep;
  ucp_request_param_t p = kvx_op_param(op);
  p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_EAGER; /* the receiver handles whole messages only */
  kvx_op_issued(op, ucp_am_send_nbx(ep, KVX_AM_ID, NULL, 0, w->p, w->len, &p));
}

/* DENY, ACK, ABORT and REVOKE: a status and a reason. */
void kvx_send_status(td_kvx *k, ucp_ep_h ep, int type, uint64_t xid, td_status s, const char *text) {
  kvx_wbuf w;
  kvx_msg_begin(k, &w, type, xid);
  kvx_w_u32(&w, (uint32_t)s);
  w_text(&w, text);
  kvx_send_msg(k, ep, &w);
}

static ucs_status_t am_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                          const ucp_am_recv_param_t *param) {
  td_kvx *k = arg;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    /* Senders use eager only; never expected. */
    TD_WARN("kvx %s: dropping a rendezvous message of %zu bytes", k->name, length);
    return UCS_OK;
  }
  kvx_msg *m = malloc(sizeof *m + length);
  if (!m) return UCS_OK;
  m->next = NULL;
  m->len = length;
  if (length) memcpy(m->data, data, length);
  if (k->inbox_tail)
    k->inbox_tail->next = m;
  else
    k->inbox = m;
  k->inbox_tail = m;
  return UCS_OK;
}

/* Data of an active grant lands here; the receiver checks it against the
 * grant, so nothing is written for a revoked or unknown transfer. */
static ucs_status_t am_data_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                               const ucp_am_recv_param_t *param) {
  td_kvx *k = arg;
  kvx_rbuf r = {.p = header, .len = header_length};
  uint32_t magic = kvx_r_u32(&r);
  kvx_r_u16(&r);
  kvx_r_u16(&r);
  uint64_t uuid = kvx_r_u64(&r), xid = kvx_r_u64(&r), off = kvx_r_u64(&r);
  if (r.bad || magic != KVX_MSG_MAGIC || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) return UCS_OK;
  kvx_grant *g = kvx_find_grant(k, uuid, xid);
  if (!g || g->gst != G_ACTIVE || !g->am || g->data_err != TD_OK) return UCS_OK;
  if (!kvx_grant_covers(g, off, length) || g->received + length > g->total) {
    g->data_err = TD_ERR_FORMAT;
    return UCS_OK;
  }
  if (g->pool->d.mem == TD_KVX_MEM_CUDA) {
    if (kvx_gpu_copy_sync(k->gpu, (uint8_t *)g->pool->d.base + off, data, length) != TD_OK) {
      g->data_err = TD_ERR_CUDA;
      return UCS_OK;
    }
  } else {
    memcpy((uint8_t *)g->pool->d.base + off, data, length);
  }
  g->received += length;
  return UCS_OK;
}

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t s) {
  kvx_ep_owner *o = arg;
  if (o->closing || o->failed != UCS_OK) return;
  o->failed = s;
  o->k->fail_pending = true;
}

td_status kvx_make_ep(td_kvx *k, const void *addr, bool peer_mode, kvx_ep_owner *own, ucp_ep_h *ep) {
  ucp_ep_params_t p;
  memset(&p, 0, sizeof p);
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.address = addr;
  p.err_mode = peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (own) {
    p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.err_handler.cb = ep_err_cb;
    p.err_handler.arg = own;
  }
  ucs_status_t s = ucp_ep_create(k->w, &p, ep);
  if (s != UCS_OK) {
    *ep = NULL;
    return td_err(TD_ERR_NETWORK, "KV transfer: connecting: %s", ucs_status_string(s));
  }
  return TD_OK;
}

/* UCX's description of an endpoint's lanes (malloc'd; NULL when it
 * cannot be captured). */
static char *ep_info(ucp_ep_h ep) {
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  if (!f) return NULL;
  ucp_ep_print_info(ep, f);
  fclose(f);
  return buf;
}

/* Whether UCX gave the endpoint RMA lanes. Without them (tcp) UCX 1.13
 * emulates puts with messages whose completion, acknowledged by the
 * target, aborts the target process when the origin dies; data then goes
 * as our own active messages instead. */
bool kvx_ep_has_rma(ucp_ep_h ep) {
  char *buf = ep_info(ep);
  bool rma = buf && strstr(buf, "rma_bw#") != NULL;
  free(buf);
  return rma;
}

/* Whether the endpoint's active-message lane is shared memory. In-transfer
 * messages then go there (a microsecond instead of a tcp round through
 * the kernel); UCX error handling does not cover such a lane, so failures
 * are still detected on the control endpoint, and a message lost to a
 * dead peer is harmless. */
bool kvx_ep_am_is_shm(ucp_ep_h ep) {
  char *buf = ep_info(ep);
  bool shm = false;
  for (char *line = buf; line && *line;) {
    char *nl = strchr(line, '\n');
    if (nl) *nl = 0;
    if (strstr(line, "lane[") && strstr(line, " am "))
      shm = strstr(line, "sysv/") || strstr(line, "posix/") || strstr(line, "xpmem/");
    line = nl ? nl + 1 : NULL;
  }
  free(buf);
  return shm;
}

td_status kvx_ucx_map(td_kvx *k, void *base, size_t bytes, bool cuda, ucp_mem_h *memh) {
  ucp_mem_map_params_t mp;
  memset(&mp, 0, sizeof mp);
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = base;
  mp.length = bytes;
  if (cuda) {
    mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    mp.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  ucs_status_t s = ucp_mem_map(k->ctx, &mp, memh);
  if (s != UCS_OK) {
    *memh = NULL;
    return td_err(TD_ERR_NETWORK, "KV transfer: registering %zu bytes with UCX: %s", bytes, ucs_status_string(s));
  }
  return TD_OK;
}

/* Where UCX's network transports go for a worker reached at addr. */
typedef enum bind_where {
  BIND_ANY,       /* UCX's choice: no address, a host name, a loopback or wildcard address */
  BIND_INTERFACE, /* the interface that carries addr (numeric IPv4 / IPv6) */
  BIND_NOWHERE,   /* a numeric address no interface here carries (NAT) */
} bind_where;

static bind_where bind_interface(const char *addr, char name[IF_NAMESIZE]) {
  struct addrinfo hints = {.ai_flags = AI_NUMERICHOST}, *ai = NULL;
  if (!addr || getaddrinfo(addr, NULL, &hints, &ai) != 0) return BIND_ANY;
  bool found = false, loop_or_any = false;
  if (ai->ai_family == AF_INET) {
    uint32_t a = ntohl(((struct sockaddr_in *)ai->ai_addr)->sin_addr.s_addr);
    loop_or_any = (a >> 24) == 127 || a == 0;
  } else if (ai->ai_family == AF_INET6) {
    const struct in6_addr *a = &((struct sockaddr_in6 *)ai->ai_addr)->sin6_addr;
    loop_or_any = IN6_IS_ADDR_LOOPBACK(a) || IN6_IS_ADDR_UNSPECIFIED(a);
  }
  struct ifaddrs *ifs = NULL;
  if (!loop_or_any && getifaddrs(&ifs) == 0) {
    for (struct ifaddrs *i = ifs; i && !found; i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != ai->ai_family || (i->ifa_flags & IFF_LOOPBACK)) continue;
      if (ai->ai_family == AF_INET)
        found = ((struct sockaddr_in *)i->ifa_addr)->sin_addr.s_addr == ((struct sockaddr_in *)ai->ai_addr)->sin_addr.s_addr;
      else if (ai->ai_family == AF_INET6)
        found = !memcmp(&((struct sockaddr_in6 *)i->ifa_addr)->sin6_addr, &((struct sockaddr_in6 *)ai->ai_addr)->sin6_addr,
                        sizeof(struct in6_addr));
      if (found) snprintf(name, IF_NAMESIZE, "%s", i->ifa_name);
    }
    freeifaddrs(ifs);
  }
  freeaddrinfo(ai);
  return loop_or_any ? BIND_ANY : found ? BIND_INTERFACE : BIND_NOWHERE;
}

td_status kvx_ucx_open(td_kvx *k) {
  ucp_config_t *cfg = NULL;
  ucs_status_t us = ucp_config_read(NULL, NULL, &cfg);
  if (us != UCS_OK) {
    return td_err(TD_ERR_NETWORK, "KV transfer: reading the UCX configuration: %s", ucs_status_string(us));
  }
  /* A worker told to bind one address listens on that interface only (UCX
   * would otherwise listen on every one, loopback included). */
  char ifname[IF_NAMESIZE];
  bool chosen = k->o.ucx_net_devices && *k->o.ucx_net_devices;
  bind_where where = chosen ? BIND_ANY : bind_interface(k->o.bind_addr, ifname);
  if (where == BIND_NOWHERE) {
    /* UCX tells peers its interfaces' own addresses, which do not reach this
     * host when it is known to them by another one (behind NAT) */
    ucp_config_release(cfg);
    return td_err(TD_ERR_UNSUPPORTED, "KV transfer: no interface here carries %s, the address peers reach this "
                  "worker at: UCX would give them this host's own addresses (set UCX_NET_DEVICES to choose)",
                  k->o.bind_addr);
  }
  if (where == BIND_INTERFACE) {
    us = ucp_config_modify(cfg, "NET_DEVICES", ifname);
    if (us != UCS_OK) {
      ucp_config_release(cfg);
      return td_err(TD_ERR_NETWORK, "KV transfer: UCX network device %s: %s", ifname, ucs_status_string(us));
    }
    TD_INFO("kvx %s: UCX network transports on %s (%s)", k->name, ifname, k->o.bind_addr);
  }
  ucp_params_t up;
  memset(&up, 0, sizeof up);
  up.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  up.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  up.name = k->name;
  us = ucp_init(&up, cfg, &k->ctx);
  ucp_config_release(cfg);
  if (us != UCS_OK) {
    k->ctx = NULL;
    return td_err(TD_ERR_NETWORK, "KV transfer: ucp_init: %s", ucs_status_string(us));
  }
  ucp_context_attr_t ca;
  memset(&ca, 0, sizeof ca);
  ca.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(k->ctx, &ca) == UCS_OK)
    k->cuda_mem = (ca.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;

  ucp_worker_params_t wp;
  memset(&wp, 0, sizeof wp);
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  us = ucp_worker_create(k->ctx, &wp, &k->w);
  if (us != UCS_OK) {
    k->w = NULL;
    return td_err(TD_ERR_NETWORK, "KV transfer: ucp_worker_create: %s", ucs_status_string(us));
  }
  us = ucp_worker_get_address(k->w, &k->addr, &k->addr_len);
  if (us != UCS_OK || k->addr_len > KVX_MAX_ADDR) {
    k->addr = NULL;
    return td_err(TD_ERR_NETWORK, "KV transfer: worker address: %s", ucs_status_string(us));
  }
  ucp_am_handler_param_t ah;
  memset(&ah, 0, sizeof ah);
  ah.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG;
  ah.id = KVX_AM_ID;
  ah.flags = UCP_AM_FLAG_WHOLE_MSG;
  ah.cb = am_cb;
  ah.arg = k;
  us = ucp_worker_set_am_recv_handler(k->w, &ah);
  if (us == UCS_OK) {
    ah.id = KVX_AM_DATA_ID;
    ah.cb = am_data_cb;
    us = ucp_worker_set_am_recv_handler(k->w, &ah);
  }
  if (us == UCS_OK) us = ucp_worker_get_efd(k->w, &k->efd);
  if (us != UCS_OK) {
    k->efd = -1;
    return td_err(TD_ERR_NETWORK, "KV transfer: worker set-up: %s", ucs_status_string(us));
  }
  k->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  k->epfd = epoll_create1(EPOLL_CLOEXEC);
  if (k->tfd < 0 || k->epfd < 0) {
    return td_err(TD_ERR_IO, "KV transfer: timerfd / epoll: %s", strerror(errno));
  }
  struct epoll_event ev = {.events = EPOLLIN};
  ev.data.fd = k->efd;
  if (epoll_ctl(k->epfd, EPOLL_CTL_ADD, k->efd, &ev) != 0) {
    return td_err(TD_ERR_IO, "KV transfer: epoll_ctl: %s", strerror(errno));
  }
  ev.data.fd = k->tfd;
  if (epoll_ctl(k->epfd, EPOLL_CTL_ADD, k->tfd, &ev) != 0) {
    return td_err(TD_ERR_IO, "KV transfer: epoll_ctl: %s", strerror(errno));
  }
  k->local_ok = local_path_wanted(&k->o);
  return TD_OK;
}
