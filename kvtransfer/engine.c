/* The transfer engine: UCX context and worker, peers, the request / grant
 * protocol, staged and direct puts, NCCL groups. docs/kvtransfer.md
 * describes the protocol; comments here say why things are done the way
 * they are. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/random.h>
#include <sys/timerfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <ucp/api/ucp.h>
#include <uthash.h>
#include <utlist.h>

#include "common/clock.h"
#include "common/log.h"
#include "kvtransfer/gpu.h"
#include "kvtransfer/kvtransfer.h"
#include "kvtransfer/wire.h"

#define KVX_AM_ID 29      /* control messages */
#define KVX_AM_DATA_ID 30 /* data, on endpoints without hardware RMA */
#define KVX_AM_DATA_MAX ((uint64_t)256 << 10)
#define KVX_MAX_PUT ((uint64_t)8 << 20) /* bounds a put so cancellation is prompt */
#define KVX_DIRECT_WINDOW 4             /* direct chunks in flight per transfer */
#define KVX_CHUNK_PIECES 128
#define KVX_GRANT_SLOTS 8               /* staging slots one grant may hold */
#define KVX_STOP_GRACE_MS 3000          /* a stopping transfer's flush must end by then */
#define KVX_GRANT_GRACE_MS 2000
#define KVX_TEXT 256
#define KVX_NCCL_WINDOW 6 /* chunks of one NCCL transfer in flight */
#define KVX_NCCL_SLOTS KVX_NCCL_WINDOW /* device bounce slots per direction */
/* Chunks per NCCL group: a group's slots come back only when all of it is
 * done, so two groups alternate (one moves while the other is scattered
 * and posted again). */
#define KVX_NCCL_GROUP (KVX_NCCL_WINDOW / 2)
#define KVX_NCCL_CHUNK ((uint64_t)8 << 20) /* default largest chunk; to be tuned on the GPU machine */

/* ---------------------------------------------------------------- types */

typedef struct kvx_pool {
  uint32_t id;
  td_kvx_pool_desc d;
  uint64_t block_bytes, bytes;
  bool direct; /* remote puts land in it (host, or CUDA with UCX CUDA support) */
  ucp_mem_h memh;
  void *rkey;
  size_t rkey_len;
  int users;
  UT_hash_handle hh;
} kvx_pool;

/* Argument of a control endpoint's error handler; outlives the endpoint
 * until its close completes. */
typedef struct ep_owner {
  td_kvx *k;
  ucs_status_t failed;
  bool closing;
} ep_owner;

struct td_kvx_peer {
  td_kvx *k;
  uint8_t *desc_bytes;
  kvx_desc desc;
  td_kvx_desc_info info;
  ep_owner *own;
  ucp_ep_h ep;      /* control: UCP_ERR_HANDLING_MODE_PEER */
  ucp_ep_h data_ep; /* puts: == ep, or a same-host endpoint without error handling */
  bool local;
  bool rma;  /* data_ep has RMA lanes; else data goes as active messages */
  bool fast;  /* data_ep carries messages over shared memory: CHUNK / DONE go there */
  bool known; /* the receiver answered once: it has our HELLO, REQ may go fast too */
  ucp_rkey_h rkeys[TD_KVX_MAX_POOLS];
  ucp_rkey_h stg_rkey;
  uint8_t *stg_ptr; /* the peer's staging mapped here (same host): D2H lands in it */
  td_status status;
  char msg[KVX_TEXT];
  bool closed; /* the application disconnected */
  int n_xfers, n_ops;
  kvx_nccl *nccl;
  uint32_t nccl_gen;
  uint64_t nccl_next_seq; /* the next granted sequence number to post */
  struct td_kvx_peer *prev, *next;
};

typedef struct kvx_rpeer {
  uint64_t uuid;
  td_kvx *k;
  ep_owner *own;
  ucp_ep_h ep;      /* back channel for replies */
  ucp_ep_h fast_ep; /* same host: shared-memory messages (GRANT, CREDIT, ACK) */
  int conns;
  int n_grants;
  bool failed;
  kvx_nccl *nccl;
  uint32_t nccl_gen;
  uint64_t nccl_seq_assign, nccl_seq_post;
  UT_hash_handle hh;
  struct kvx_rpeer *prev, *next; /* zombie list once removed from the hash */
} kvx_rpeer;

enum { CH_D2H, CH_PUT, CH_FLUSH, CH_FLUSHED, CH_DONE };

typedef struct kvx_chunk {
  int state;
  int lslot, rslot;
  int n;
  td_kvx_slice *pc; /* pieces: pool offsets; packed in order in staging slots */
  uint64_t bytes;
  void *ev;
  int pending; /* UCX operations in flight */
  struct kvx_chunk *prev, *next;
} kvx_chunk;

/* One chunk of an NCCL transfer's byte stream. */
typedef struct kvx_nchunk {
  int slot; /* bounce slot, -1: straight from / into the pool */
  uint64_t len;
  uint8_t *buf;      /* what NCCL sends from / receives into */
  void *ev;          /* sender: gather done; receiver: scatter (or a stopped receive) done */
  kvx_nccl_op *op;   /* the group holding its send / receive, until seen complete */
  td_kvx_slice *pc;  /* receiver: the pieces to scatter out of the slot */
  int n_pc;
} kvx_nchunk;

/* One side of an NCCL transfer: the byte stream (the plan's pieces in
 * order) cut by kvx_chunk_len into chunks that are gathered, sent,
 * received and scattered in a pipeline (docs/kvtransfer.md). Chunks
 * [done, post) are in flight, [post, prep) gathered and not yet sent. */
typedef struct kvx_nstream {
  uint64_t first, max; /* chunking: proposed in REQ, settled by GRANT */
  uint64_t prep, post, done;
  uint64_t prep_bytes;
  int ci; /* plan cursor: item and offset in it */
  uint64_t coff;
  bool started, all_posted;
  int64_t drain_deadline; /* a stopped receiver waits this long for its copies */
  kvx_nchunk ring[KVX_NCCL_WINDOW];
} kvx_nstream;

typedef enum { XS_WAIT_GRANT, XS_RUN, XS_FINISH, XS_STOPPING } xstate;

typedef struct kvx_xfer {
  uint64_t id;
  td_kvx *k;
  td_kvx_peer *peer;
  kvx_pool *pool;
  int dpi; /* index of the destination pool in the peer's descriptor */
  uint64_t request_id, res_id;
  int32_t *blocks; /* n_blocks sources then n_blocks destinations */
  int n_blocks;
  td_kvx_slice *items;
  int n_items;
  uint64_t total;
  bool nccl, am, src_staged, dst_staged, direct_stage;
  void *ready_ev;
  bool ready_done;
  xstate st;
  int timeout_ms;
  int64_t deadline, stop_deadline;
  td_status fst;
  char fmsg[KVX_TEXT];
  bool notify, stop_flush_issued, stop_flushed, final_flush_issued, final_flushed, done_sent, acked;
  td_status op_err;
  char op_msg[KVX_TEXT];
  td_status ack_st;
  char ack_msg[KVX_TEXT];
  int ci; /* cursor: item and offset in it */
  uint64_t coff;
  uint64_t bytes_put, issued;
  int rslots[KVX_GRANT_SLOTS];
  int n_rslots;
  int rfree[KVX_GRANT_SLOTS];
  int n_rfree;
  kvx_chunk *chunks;
  int n_chunks;
  int ops;
  bool seq_set;
  uint64_t seq;
  kvx_nstream *ns;
  td_kvx_done_fn cb;
  void *arg;
  UT_hash_handle hh;
  struct kvx_xfer *dnext; /* completed, callback pending */
} kvx_xfer;

typedef struct gkey {
  uint64_t uuid, xid;
} gkey;

enum { G_PENDING, G_ACTIVE, G_CLOSING, G_ENDING };

typedef struct kvx_grant {
  gkey key;
  td_kvx *k;
  kvx_rpeer *rp;
  kvx_pool *pool;
  uint64_t request_id, res_id;
  int32_t *blocks; /* destination blocks, as asked */
  int32_t *sorted; /* the same, sorted, to check staged pieces */
  int n_blocks;
  td_kvx_slice *items; /* the plan, for NCCL */
  int n_items;
  uint64_t total, received;
  bool nccl, staged, am, done_rx;
  td_status data_err; /* set by the data handler, acted on by the pump */
  int gst;
  int slots[KVX_GRANT_SLOTS];
  int n_slots;
  int h2d;
  td_status est;
  char emsg[KVX_TEXT];
  int64_t deadline, hard_deadline;
  uint64_t seq;
  kvx_nstream *ns;
  UT_hash_handle hh;
  struct kvx_grant *dnext;
} kvx_grant;

typedef struct kvx_h2d {
  kvx_grant *g;
  int slot;
  void *ev;
  uint64_t bytes;
  struct kvx_h2d *prev, *next;
} kvx_h2d;

enum { OP_AM, OP_PUT, OP_FLUSH, OP_CLOSE };
enum { FL_CHUNK, FL_FINAL, FL_STOP };

typedef struct kvx_op {
  int kind, flush;
  bool orphan;
  td_kvx *k;
  kvx_xfer *x;
  kvx_chunk *ch;
  td_kvx_peer *peer; /* data operations hold the peer (its memory keys) */
  ep_owner *own;     /* close operations free it */
  ucp_ep_h ep;       /* messages: where they were sent */
  void *req;
  void *buf;
  struct kvx_op *prev, *next;
} kvx_op;

typedef struct kvx_msg {
  struct kvx_msg *next;
  size_t len;
  uint8_t data[];
} kvx_msg;

struct td_kvx {
  td_kvx_opts o;
  char name[64];
  uint64_t uuid, host_id;
  ucp_context_h ctx;
  ucp_worker_h w;
  ucp_address_t *addr;
  size_t addr_len;
  bool cuda_mem, local_ok;
  int efd, tfd, epfd;
  kvx_gpu *gpu;
  size_t slot_bytes, stage_chunk;
  int n_slots;
  uint8_t *send_stg, *recv_stg;
  ucp_mem_h send_memh, recv_memh;
  bool recv_ucx_alloc; /* receive staging allocated by UCX (shared memory) */
  void *recv_rkey;
  size_t recv_rkey_len;
  int *send_free, *recv_free;
  int n_send_free, n_recv_free;
  uint64_t nccl_chunk; /* largest NCCL chunk this engine sends or receives */
  uint8_t *nb[2];      /* NCCL bounce slots (0: send, 1: receive), made on first use */
  int nb_free[2][KVX_NCCL_SLOTS];
  int n_nb_free[2];
  void **sc_d; /* scratch lists for gather / scatter launches */
  const void **sc_s;
  size_t *sc_n, sc_cap;
  kvx_pool *pools;
  td_kvx_peer *peers;
  kvx_rpeer *rpeers, *rzombies;
  kvx_xfer *xfers;
  kvx_grant *grants;
  kvx_h2d *h2ds;
  kvx_op *ops;
  int n_ops, n_orphans;
  kvx_msg *inbox, *inbox_tail;
  kvx_xfer *xdone;
  kvx_grant *gdone;
  bool fail_pending, destroying;
  uint64_t next_xid;
  td_kvx_stats st;
  struct kvx_tr *trace; /* td_kvx_opts.trace */
  int n_trace;
};

/* TANDEM_KVX_TRACE=1: when each protocol step of a transfer happened, kept
 * in memory (no I/O on the data path) and printed at destroy. Both sides
 * read CLOCK_MONOTONIC, so two processes on one host line up. */
typedef struct kvx_tr {
  int64_t ns;
  uint64_t xid, a;
  const char *ev;
} kvx_tr;
enum { KVX_TRACE_CAP = 1 << 16 };
static void tr(td_kvx *k, uint64_t xid, const char *ev, uint64_t a) {
  if (k->trace && k->n_trace < KVX_TRACE_CAP) k->trace[k->n_trace++] = (kvx_tr){td_now_ns(), xid, a, ev};
}

/* ---------------------------------------------------------------- utilities */

static const char *ucs_str(ucs_status_t s) { return ucs_status_string(s); }

static void set_text(char *dst, const char *src) { snprintf(dst, KVX_TEXT, "%s", src ? src : ""); }

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

/* ---------------------------------------------------------------- operations */

static kvx_op *op_new(td_kvx *k, int kind) {
  kvx_op *op = calloc(1, sizeof *op);
  if (!op) return NULL;
  op->k = k;
  op->kind = kind;
  DL_APPEND(k->ops, op);
  k->n_ops++;
  return op;
}

static void op_free(kvx_op *op) {
  td_kvx *k = op->k;
  DL_DELETE(k->ops, op);
  k->n_ops--;
  if (op->orphan) k->n_orphans--;
  if (op->peer) op->peer->n_ops--;
  free(op->buf);
  free(op);
}

static void xfer_op_error(kvx_xfer *x, ucs_status_t s, const char *what) {
  if (x->op_err != TD_OK) return;
  x->op_err = (s == UCS_ERR_CANCELED) ? TD_ERR_CANCELLED : TD_ERR_NETWORK;
  snprintf(x->op_msg, KVX_TEXT, "%s failed: %s", what, ucs_str(s));
}

static void op_done(kvx_op *op, ucs_status_t s) {
  kvx_xfer *x = op->x;
  switch (op->kind) {
    case OP_PUT:
      if (x) {
        x->ops--;
        if (op->ch) op->ch->pending--;
        if (s != UCS_OK) xfer_op_error(x, s, "put");
      }
      break;
    case OP_FLUSH:
      if (x) {
        x->ops--;
        if (s != UCS_OK) xfer_op_error(x, s, "flush");
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
  op_free(op);
}

static void ucx_cb(void *req, ucs_status_t s, void *user) {
  kvx_op *op = user;
  op->req = NULL;
  ucp_request_free(req);
  op_done(op, s);
}

static void op_issued(kvx_op *op, ucs_status_ptr_t r) {
  if (r == NULL) {
    op_done(op, UCS_OK);
  } else if (UCS_PTR_IS_ERR(r)) {
    op_done(op, UCS_PTR_STATUS(r));
  } else {
    op->req = r;
  }
}

static ucp_request_param_t op_param(kvx_op *op) {
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
static void orphan_ops(td_kvx *k, kvx_xfer *x) {
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
static void orphan_msgs(td_kvx *k, ucp_ep_h a, ucp_ep_h b) {
  kvx_op *op;
  DL_FOREACH(k->ops, op) {
    if (op->kind == OP_AM && !op->orphan && op->ep && (op->ep == a || op->ep == b)) {
      op->orphan = true;
      k->n_orphans++;
    }
  }
}

static void close_ep(td_kvx *k, ucp_ep_h ep, bool force, ep_owner *own) {
  if (!ep) return;
  if (own) own->closing = true;
  kvx_op *op = op_new(k, OP_CLOSE);
  if (!op) return;
  op->own = own;
  ucp_request_param_t p = op_param(op);
  if (force) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  }
  op_issued(op, ucp_ep_close_nbx(ep, &p));
}

/* ---------------------------------------------------------------- messages */

static void msg_begin(td_kvx *k, kvx_wbuf *w, int type, uint64_t xid) {
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

static void r_text(kvx_rbuf *r, char *out) {
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

static void send_msg(td_kvx *k, ucp_ep_h ep, kvx_wbuf *w) {
  if (!ep || w->oom) {
    free(w->p);
    if (w->oom) TD_ERROR("kvx %s: out of memory building a message", k->name);
    return;
  }
  kvx_op *op = op_new(k, OP_AM);
  if (!op) {
    free(w->p);
    return;
  }
  op->buf = w->p;
  op->ep = ep;
  ucp_request_param_t p = op_param(op);
  p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_EAGER; /* the receiver handles whole messages only */
  op_issued(op, ucp_am_send_nbx(ep, KVX_AM_ID, NULL, 0, w->p, w->len, &p));
}

/* DENY, ACK, ABORT and REVOKE: a status and a reason. */
static void send_status(td_kvx *k, ucp_ep_h ep, int type, uint64_t xid, td_status s, const char *text) {
  kvx_wbuf w;
  msg_begin(k, &w, type, xid);
  kvx_w_u32(&w, (uint32_t)s);
  w_text(&w, text);
  send_msg(k, ep, &w);
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

static kvx_grant *find_grant(td_kvx *k, uint64_t uuid, uint64_t xid);
static bool grant_covers(const kvx_grant *g, uint64_t off, uint64_t len);

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
  kvx_grant *g = find_grant(k, uuid, xid);
  if (!g || g->gst != G_ACTIVE || !g->am || g->data_err != TD_OK) return UCS_OK;
  if (!grant_covers(g, off, length) || g->received + length > g->total) {
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
  ep_owner *o = arg;
  if (o->closing || o->failed != UCS_OK) return;
  o->failed = s;
  o->k->fail_pending = true;
}

static td_status make_ep(td_kvx *k, const void *addr, bool peer_mode, ep_owner *own, ucp_ep_h *ep) {
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
    return td_err(TD_ERR_NETWORK, "KV transfer: connecting: %s", ucs_str(s));
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
static bool ep_has_rma(ucp_ep_h ep) {
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
static bool ep_am_is_shm(ucp_ep_h ep) {
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

/* ---------------------------------------------------------------- staging */

static td_status ucx_map(td_kvx *k, void *base, size_t bytes, bool cuda, ucp_mem_h *memh) {
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
    return td_err(TD_ERR_NETWORK, "KV transfer: registering %zu bytes with UCX: %s", bytes, ucs_str(s));
  }
  return TD_OK;
}

static td_status ensure_staging(td_kvx *k) {
  if (k->recv_stg) return TD_OK;
  size_t bytes = k->slot_bytes * (size_t)k->n_slots;
  td_status s;
  k->send_free = malloc(sizeof(int) * (size_t)k->n_slots);
  k->recv_free = malloc(sizeof(int) * (size_t)k->n_slots);
  if (!k->send_free || !k->recv_free) return td_err(TD_ERR_NOMEM, "out of memory");
  void *sp = NULL, *rp = NULL;
  if ((s = kvx_gpu_host_alloc(k->gpu, bytes, &sp)) != TD_OK) return s;
  k->send_stg = sp;
  if ((s = ucx_map(k, k->send_stg, bytes, false, &k->send_memh)) != TD_OK) return s;
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
    if ((s = ucx_map(k, k->recv_stg, bytes, false, &k->recv_memh)) != TD_OK) return s;
  }
  ucs_status_t us = ucp_rkey_pack(k->ctx, k->recv_memh, &k->recv_rkey, &k->recv_rkey_len);
  if (us != UCS_OK) return td_err(TD_ERR_NETWORK, "KV transfer: packing the staging key: %s", ucs_str(us));
  for (int i = 0; i < k->n_slots; i++) {
    k->send_free[i] = k->n_slots - 1 - i;
    k->recv_free[i] = k->n_slots - 1 - i;
  }
  k->n_send_free = k->n_recv_free = k->n_slots;
  return TD_OK;
}

/* ---------------------------------------------------------------- engine */

td_status td_kvx_create(const td_kvx_opts *opts, td_kvx **out) {
  *out = NULL;
  td_kvx *k = calloc(1, sizeof *k);
  if (!k) return td_err(TD_ERR_NOMEM, "out of memory");
  k->o = *opts;
  snprintf(k->name, sizeof k->name, "%s", opts->name ? opts->name : "kvx");
  k->o.name = k->name;
  if (k->o.timeout_ms <= 0) k->o.timeout_ms = 30000;
  k->n_slots = k->o.staging_slots > 0 ? k->o.staging_slots : 8;
  if (k->n_slots > 1024) k->n_slots = 1024;
  k->slot_bytes = k->o.staging_slot_bytes >= 4096 ? k->o.staging_slot_bytes : (4u << 20);
  k->stage_chunk = k->o.staging_chunk_bytes >= 4096 ? k->o.staging_chunk_bytes : (2u << 20);
  k->nccl_chunk = k->o.nccl_chunk_bytes ? k->o.nccl_chunk_bytes : KVX_NCCL_CHUNK;
  if (k->nccl_chunk < 4096) k->nccl_chunk = 4096;
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
  }

  ucp_config_t *cfg = NULL;
  ucs_status_t us = ucp_config_read(NULL, NULL, &cfg);
  if (us != UCS_OK) {
    s = td_err(TD_ERR_NETWORK, "KV transfer: reading the UCX configuration: %s", ucs_str(us));
    goto fail;
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
    s = td_err(TD_ERR_NETWORK, "KV transfer: ucp_init: %s", ucs_str(us));
    goto fail;
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
    s = td_err(TD_ERR_NETWORK, "KV transfer: ucp_worker_create: %s", ucs_str(us));
    goto fail;
  }
  us = ucp_worker_get_address(k->w, &k->addr, &k->addr_len);
  if (us != UCS_OK || k->addr_len > KVX_MAX_ADDR) {
    k->addr = NULL;
    s = td_err(TD_ERR_NETWORK, "KV transfer: worker address: %s", ucs_str(us));
    goto fail;
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
    s = td_err(TD_ERR_NETWORK, "KV transfer: worker set-up: %s", ucs_str(us));
    goto fail;
  }
  k->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  k->epfd = epoll_create1(EPOLL_CLOEXEC);
  if (k->tfd < 0 || k->epfd < 0) {
    s = td_err(TD_ERR_IO, "KV transfer: timerfd / epoll: %s", strerror(errno));
    goto fail;
  }
  struct epoll_event ev = {.events = EPOLLIN};
  ev.data.fd = k->efd;
  if (epoll_ctl(k->epfd, EPOLL_CTL_ADD, k->efd, &ev) != 0) {
    s = td_err(TD_ERR_IO, "KV transfer: epoll_ctl: %s", strerror(errno));
    goto fail;
  }
  ev.data.fd = k->tfd;
  if (epoll_ctl(k->epfd, EPOLL_CTL_ADD, k->tfd, &ev) != 0) {
    s = td_err(TD_ERR_IO, "KV transfer: epoll_ctl: %s", strerror(errno));
    goto fail;
  }
  k->local_ok = local_path_wanted(&k->o);
  TD_INFO("kvx %s: uuid %016" PRIx64 ", UCX CUDA memory %s, same-host data path %s, GPU %s, NCCL %s", k->name,
          k->uuid, k->cuda_mem ? "yes" : "no", k->local_ok ? "on" : "off", k->gpu ? "yes" : "no",
          (k->gpu && kvx_nccl_compiled()) ? "yes" : "no");
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

/* ---------------------------------------------------------------- pools */

static kvx_pool *find_pool(td_kvx *k, uint32_t id) {
  kvx_pool *p = NULL;
  HASH_FIND(hh, k->pools, &id, sizeof id, p);
  return p;
}

td_status td_kvx_register_pool(td_kvx *k, const td_kvx_pool_desc *d) {
  if (!d || !d->base || d->n_blocks <= 0) return td_err(TD_ERR_INVALID, "KV transfer: pool without memory or blocks");
  TD_TRY(td_kvx_geom_check(&d->geom));
  if (find_pool(k, d->pool_id)) return td_err(TD_ERR_INVALID, "KV transfer: pool %u registered twice", d->pool_id);
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
    s = ucx_map(k, d->base, p->bytes, false, &p->memh);
  } else if (d->mem == TD_KVX_MEM_CUDA) {
    if (!k->gpu) {
      s = td_err(TD_ERR_UNSUPPORTED, "KV transfer: GPU pool %u on an engine without a CUDA device", d->pool_id);
    } else if ((s = kvx_gpu_check_device_ptr(k->gpu, d->base, p->bytes)) == TD_OK) {
      if (td_kvx_cuda_direct(k)) {
        p->direct = true;
        s = ucx_map(k, d->base, p->bytes, true, &p->memh);
      } else {
        s = ensure_staging(k);
      }
    }
  } else {
    s = td_err(TD_ERR_INVALID, "KV transfer: pool %u: memory kind %d", d->pool_id, (int)d->mem);
  }
  if (s == TD_OK && p->memh) {
    ucs_status_t us = ucp_rkey_pack(k->ctx, p->memh, &p->rkey, &p->rkey_len);
    if (us != UCS_OK) s = td_err(TD_ERR_NETWORK, "KV transfer: packing pool %u's key: %s", d->pool_id, ucs_str(us));
  }
  if (s != TD_OK) {
    if (p->rkey) ucp_rkey_buffer_release(p->rkey);
    if (p->memh) ucp_mem_unmap(k->ctx, p->memh);
    free(p);
    return s;
  }
  HASH_ADD(hh, k->pools, id, sizeof p->id, p);
  TD_DEBUG("kvx %s: pool %u: %d blocks of %" PRIu64 " bytes in %s memory (%s)", k->name, p->id, d->n_blocks,
           p->block_bytes, d->mem == TD_KVX_MEM_CUDA ? "GPU" : "host", p->direct ? "direct" : "staged");
  return TD_OK;
}

static void pool_free(td_kvx *k, kvx_pool *p) {
  if (p->rkey) ucp_rkey_buffer_release(p->rkey);
  if (p->memh) ucp_mem_unmap(k->ctx, p->memh);
  free(p);
}

td_status td_kvx_unregister_pool(td_kvx *k, uint32_t pool_id) {
  kvx_pool *p = find_pool(k, pool_id);
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
  }
  return kvx_desc_encode(&d, bytes, len);
}

/* ---------------------------------------------------------------- peers */

static void peer_maybe_release(td_kvx_peer *p);

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
  if ((s = make_ep(k, p->desc.addr, true, p->own, &p->ep)) != TD_OK) goto fail;
  p->data_ep = p->ep;
  if (k->local_ok && p->desc.host_id == k->host_id && p->desc.uuid != k->uuid) {
    /* Error handling would restrict UCX 1.13 to tcp; this endpoint lets it
     * pick shared memory / CMA. Failures surface on p->ep. */
    ucp_ep_h dep = NULL;
    if (make_ep(k, p->desc.addr, false, NULL, &dep) == TD_OK) {
      if (ep_has_rma(dep)) {
        p->data_ep = dep;
        p->local = true;
        p->rma = true;
        p->fast = ep_am_is_shm(dep);
        k->st.local_path = true;
      } else {
        close_ep(k, dep, false, NULL); /* no CMA / shared memory after all */
      }
    } else {
      td_err_clear();
    }
  }
  if (!p->local) p->rma = ep_has_rma(p->ep);
  for (int i = 0; i < p->desc.n_pools; i++) {
    if (!p->desc.pools[i].rkey_len) continue;
    ucs_status_t us = ucp_ep_rkey_unpack(p->data_ep, p->desc.pools[i].rkey, &p->rkeys[i]);
    if (us != UCS_OK) {
      p->rkeys[i] = NULL;
      s = td_err(TD_ERR_FORMAT, "KV transfer: peer pool %u's memory key: %s", p->desc.pools[i].info.pool_id,
                 ucs_str(us));
      goto fail;
    }
  }
  if (p->desc.staging) {
    ucs_status_t us = ucp_ep_rkey_unpack(p->data_ep, p->desc.stg_rkey, &p->stg_rkey);
    if (us != UCS_OK) {
      p->stg_rkey = NULL;
      s = td_err(TD_ERR_FORMAT, "KV transfer: peer staging key: %s", ucs_str(us));
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
  msg_begin(k, &w, KVX_MSG_HELLO, 0);
  kvx_w_u32(&w, (uint32_t)k->addr_len);
  kvx_w_bytes(&w, k->addr, k->addr_len);
  kvx_w_u64(&w, k->host_id);
  send_msg(k, p->ep, &w);
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
  if (p->data_ep && p->data_ep != p->ep) close_ep(k, p->data_ep, false, NULL);
  if (p->ep) {
    close_ep(k, p->ep, true, p->own);
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
static void peer_maybe_release(td_kvx_peer *p) {
  td_kvx *k = p->k;
  if (!p->closed || p->n_xfers > 0 || p->n_ops > 0) return;
  if (p->nccl) kvx_nccl_abort(p->nccl);
  p->nccl = NULL;
  if (p->status == TD_OK && p->ep) {
    kvx_wbuf w;
    msg_begin(k, &w, KVX_MSG_BYE, 0);
    send_msg(k, p->ep, &w);
  }
  if (p->stg_ptr) kvx_gpu_host_unregister(k->gpu, p->stg_ptr);
  p->stg_ptr = NULL;
  for (int i = 0; i < TD_KVX_MAX_POOLS; i++)
    if (p->rkeys[i]) ucp_rkey_destroy(p->rkeys[i]);
  if (p->stg_rkey) ucp_rkey_destroy(p->stg_rkey);
  /* An endpoint without error handling cannot be force-closed. */
  if (p->data_ep && p->data_ep != p->ep) close_ep(k, p->data_ep, false, NULL);
  if (p->ep) {
    close_ep(k, p->ep, p->status != TD_OK, p->own);
  } else {
    free(p->own);
  }
  DL_DELETE(k->peers, p);
  k->st.peers--;
  free(p->desc_bytes);
  free(p);
}

/* ---------------------------------------------------------------- NCCL chunks */

/* The bounce slots of one direction (0: send, 1: receive), allocated on
 * first use and kept until destroy: cudaFree synchronises the device, which
 * a send stuck behind a dead peer would hang. */
static td_status nccl_ring(td_kvx *k, int side) {
  if (k->nb[side]) return TD_OK;
  void *p = NULL;
  TD_TRY(kvx_gpu_dev_alloc(k->gpu, (size_t)k->nccl_chunk * KVX_NCCL_SLOTS, &p));
  k->nb[side] = p;
  for (int i = 0; i < KVX_NCCL_SLOTS; i++) k->nb_free[side][i] = KVX_NCCL_SLOTS - 1 - i;
  k->n_nb_free[side] = KVX_NCCL_SLOTS;
  return TD_OK;
}

static td_status scratch(td_kvx *k, size_t n) {
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

static kvx_nstream *nstream_new(uint64_t first, uint64_t max) {
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
static void nstream_drop_ops(td_kvx *k, kvx_nstream *ns, bool recv) {
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
static bool nstream_quiet(td_kvx *k, kvx_nstream *ns) {
  if (!ns) return true;
  for (uint64_t c = ns->done; c < ns->prep; c++) {
    kvx_nchunk *e = &ns->ring[c % KVX_NCCL_WINDOW];
    if (e->ev && kvx_gpu_query(k->gpu, e->ev) == 0) return false;
  }
  return true;
}

/* Releases what the unfinished chunks hold and frees the stream. */
static void nstream_free(td_kvx *k, kvx_nstream *ns, int side) {
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

/* ---------------------------------------------------------------- sender */

static void xfer_stop(kvx_xfer *x, td_status s, const char *msg, bool notify);

static void xfer_finish(kvx_xfer *x, td_status s, const char *msg) {
  td_kvx *k = x->k;
  HASH_DEL(k->xfers, x);
  x->fst = s;
  if (msg != x->fmsg) set_text(x->fmsg, msg);
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
  while (!nstream_quiet(k, x->ns)) {
  }
  nstream_free(k, x->ns, 0);
  x->ns = NULL;
  x->pool->users--; /* peer->n_xfers drops once the callback ran */
  if (s == TD_OK)
    k->st.xfers_ok++;
  else
    k->st.xfers_failed++;
  x->dnext = k->xdone;
  k->xdone = x;
  TD_DEBUG("kvx %s: transfer %" PRIu64 " (request %" PRIu64 ") ended: %s %s", k->name, x->id, x->request_id,
           td_status_str(s), x->fmsg);
}

/* Aborts the peer's NCCL communicator: every NCCL transfer on it fails,
 * and the receiver aborts its side (a queued receive cannot be cancelled). */
static void peer_nccl_abort(td_kvx_peer *p, td_status s, const char *why, bool tell) {
  td_kvx *k = p->k;
  if (!p->nccl) return;
  if (tell && p->status == TD_OK && p->ep) {
    kvx_wbuf w;
    msg_begin(k, &w, KVX_MSG_NCCL_ABORT, 0);
    kvx_w_u32(&w, p->nccl_gen);
    send_msg(k, p->ep, &w);
  }
  kvx_xfer *x, *tmp;
  HASH_ITER(hh, k->xfers, x, tmp) {
    if (x->peer == p && x->nccl) nstream_drop_ops(k, x->ns, false);
  }
  kvx_nccl_abort(p->nccl);
  p->nccl = NULL;
  HASH_ITER(hh, k->xfers, x, tmp) {
    if (x->peer == p && x->nccl && x->st != XS_STOPPING) xfer_stop(x, s, why, true);
  }
}

static void xfer_stop(kvx_xfer *x, td_status s, const char *msg, bool notify) {
  if (x->st == XS_STOPPING) return;
  x->fst = s;
  set_text(x->fmsg, msg);
  x->notify = notify;
  x->st = XS_STOPPING;
  x->stop_deadline = td_now_ms() + KVX_STOP_GRACE_MS;
  /* The receiver may have queued the matching receive: only an abort of
   * the communicator keeps the two sides in step. */
  if (x->nccl && x->peer->nccl) peer_nccl_abort(x->peer, TD_ERR_NETWORK, "NCCL communicator aborted", true);
}

td_status td_kvx_post(td_kvx_peer *p, const td_kvx_xfer *q, td_kvx_done_fn cb, void *arg, uint64_t *xfer_id) {
  td_kvx *k = p->k;
  if (xfer_id) *xfer_id = 0;
  if (k->destroying) return td_err(TD_ERR_INVALID, "KV transfer: engine shutting down");
  if (p->closed) return td_err(TD_ERR_INVALID, "KV transfer: peer disconnected");
  if (p->status != TD_OK) return td_err(p->status, "KV transfer: peer %016" PRIx64 ": %s", p->desc.uuid, p->msg);
  if (!q || q->n_blocks <= 0 || q->n_blocks > KVX_MAX_MSG_BLOCKS || !q->src_blocks || !q->dst_blocks)
    return td_err(TD_ERR_INVALID, "KV transfer: %d blocks", q ? q->n_blocks : 0);
  kvx_pool *pool = find_pool(k, q->src_pool);
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
  bool nccl;
  bool both_gpu = pool->d.mem == TD_KVX_MEM_CUDA && dp->info.mem == TD_KVX_MEM_CUDA;
  if (q->transport == TD_KVX_NCCL) {
    if (!both_gpu) return td_err(TD_ERR_INVALID, "KV transfer: NCCL moves GPU pools only");
    if (!td_kvx_nccl_available(k) || !p->info.nccl)
      return td_err(TD_ERR_UNSUPPORTED, "KV transfer: NCCL is not available on both sides");
    nccl = true;
  } else if (q->transport == TD_KVX_UCX) {
    nccl = false;
  } else {
    /* NCCL cannot pair two ranks on one GPU. */
    uint64_t mine = kvx_gpu_uid(k->gpu) ^ k->host_id;
    nccl = both_gpu && td_kvx_nccl_available(k) && p->info.nccl && p->desc.gpu_id != mine;
  }
  bool am = !nccl && !p->rma;
  bool src_staged = pool->d.mem == TD_KVX_MEM_CUDA && !pool->direct && !nccl;
  bool dst_staged = !dp->info.direct && !nccl && !am;
  if ((src_staged && !k->send_stg) || (dst_staged && !p->stg_rkey))
    return td_err(TD_ERR_INTERNAL, "KV transfer: staged path without staging buffers");
  if (nccl) TD_TRY(nccl_ring(k, 0));
  td_kvx_slice *items = NULL;
  int n_items = 0;
  TD_TRY(td_kvx_plan_copies(&pool->d.geom, &dp->info.geom, q->src_blocks, q->dst_blocks, q->n_blocks, &items,
                            &n_items));
  if (n_items == 0) {
    free(items);
    return td_err(TD_ERR_INVALID, "KV transfer: the peer's pool %u holds none of pool %u's layers and heads",
                  q->dst_pool, q->src_pool);
  }
  kvx_xfer *x = calloc(1, sizeof *x);
  int32_t *blocks = malloc(sizeof(int32_t) * 2 * (size_t)q->n_blocks);
  /* Proposed chunking (the receiver may lower it in GRANT): a smaller
   * first chunk, so the first gather is short. */
  kvx_nstream *ns = nccl ? nstream_new(k->nccl_chunk / 4, k->nccl_chunk) : NULL;
  if (!x || !blocks || (nccl && !ns)) {
    free(x);
    free(blocks);
    free(items);
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
  x->items = items;
  x->n_items = n_items;
  for (int i = 0; i < n_items; i++) x->total += items[i].len;
  x->nccl = nccl;
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
  tr(k, x->id, "post", x->total);
  /* Same endpoint for NCCL_ID and REQ: the id must arrive first. */
  ucp_ep_h req_ep = (p->fast && p->known) ? p->data_ep : p->ep;

  if (nccl && !p->nccl) {
    /* Communicators are made on demand per pair; the unique id travels on
     * the control endpoint, ahead of the request that needs it. */
    uint8_t id[KVX_NCCL_ID_BYTES];
    td_status s = kvx_nccl_unique_id(id);
    if (s == TD_OK) s = kvx_nccl_create(k->gpu, id, 0, &p->nccl);
    if (s != TD_OK) {
      free(x->items);
      free(x->blocks);
      free(x->ns);
      free(x);
      return s;
    }
    p->nccl_gen++;
    p->nccl_next_seq = 0;
    kvx_wbuf w;
    msg_begin(k, &w, KVX_MSG_NCCL_ID, 0);
    kvx_w_u32(&w, p->nccl_gen);
    kvx_w_bytes(&w, id, KVX_NCCL_ID_BYTES);
    send_msg(k, req_ep, &w);
  }
  kvx_wbuf w;
  msg_begin(k, &w, KVX_MSG_REQ, x->id);
  kvx_w_u64(&w, x->request_id);
  kvx_w_u64(&w, x->res_id);
  kvx_w_u32(&w, q->dst_pool);
  kvx_w_u8(&w, nccl ? KVX_MODE_NCCL : am ? KVX_MODE_AM : KVX_MODE_PUT);
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
  kvx_w_i32(&w, g->layer0);
  kvx_w_i32(&w, g->layer1);
  kvx_w_i32(&w, g->head0);
  kvx_w_i32(&w, g->head1);
  kvx_w_u32(&w, (uint32_t)x->n_blocks);
  for (int i = 0; i < 2 * x->n_blocks; i++) kvx_w_i32(&w, x->blocks[i]);
  send_msg(k, req_ep, &w);

  pool->users++;
  p->n_xfers++;
  if (nccl) k->st.nccl_xfers++;
  HASH_ADD(hh, k->xfers, id, sizeof x->id, x);
  if (xfer_id) *xfer_id = x->id;
  TD_DEBUG("kvx %s: transfer %" PRIu64 " (request %" PRIu64 "): %d blocks, %d copies, %" PRIu64 " bytes via %s%s%s",
           k->name, x->id, x->request_id, x->n_blocks, n_items, x->total,
           nccl ? "NCCL" : am ? "UCX active messages" : "UCX puts",
           src_staged ? ", staged source" : "", dst_staged ? ", staged destination" : "");
  return TD_OK;
}

td_status td_kvx_cancel(td_kvx *k, uint64_t xfer_id) {
  kvx_xfer *x = NULL;
  HASH_FIND(hh, k->xfers, &xfer_id, sizeof xfer_id, x);
  if (!x) return td_err(TD_ERR_NOT_FOUND, "KV transfer %" PRIu64 " is not running", xfer_id);
  xfer_stop(x, TD_ERR_CANCELLED, "cancelled", true);
  return TD_OK;
}

void td_kvx_disconnect(td_kvx_peer *p) {
  if (!p || p->closed) return;
  td_kvx *k = p->k;
  p->closed = true;
  kvx_xfer *x, *tmp;
  HASH_ITER(hh, k->xfers, x, tmp) {
    if (x->peer == p) xfer_stop(x, TD_ERR_CANCELLED, "peer disconnected", true);
  }
  peer_maybe_release(p);
}

/* Takes the next run of pieces from the transfer's plan. */
static kvx_chunk *chunk_build(kvx_xfer *x, uint64_t max_bytes) {
  kvx_chunk *ch = calloc(1, sizeof *ch);
  if (!ch) return NULL;
  ch->pc = malloc(sizeof *ch->pc * KVX_CHUNK_PIECES);
  if (!ch->pc) {
    free(ch);
    return NULL;
  }
  ch->lslot = ch->rslot = -1;
  while (x->ci < x->n_items && ch->n < KVX_CHUNK_PIECES && ch->bytes < max_bytes) {
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
  kvx_op *op = op_new(k, OP_PUT);
  if (!op) {
    xfer_op_error(x, UCS_ERR_NO_MEMORY, "put");
    return;
  }
  op->x = x;
  op->ch = ch;
  op->peer = x->peer;
  x->peer->n_ops++;
  x->ops++;
  ch->pending++;
  ucp_request_param_t prm = op_param(op);
  if (memh) {
    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    prm.memh = memh;
  }
  if (cuda) {
    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    prm.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  op_issued(op, ucp_put_nbx(x->peer->data_ep, local, len, raddr, rkey, &prm));
}

/* Data as active messages: header (who, which grant, where) + payload. */
static void am_data(kvx_xfer *x, kvx_chunk *ch, const uint8_t *local, uint64_t len, uint64_t dst_off) {
  td_kvx *k = x->k;
  for (uint64_t off = 0; off < len; off += KVX_AM_DATA_MAX) {
    uint64_t n = len - off < KVX_AM_DATA_MAX ? len - off : KVX_AM_DATA_MAX;
    kvx_op *op = op_new(k, OP_PUT);
    kvx_wbuf w;
    msg_begin(k, &w, 0, x->id);
    kvx_w_u64(&w, dst_off + off);
    if (!op || w.oom) {
      free(w.p);
      if (op) op_free(op);
      xfer_op_error(x, UCS_ERR_NO_MEMORY, "send");
      return;
    }
    op->buf = w.p; /* the header lives until completion */
    op->x = x;
    op->ch = ch;
    op->peer = x->peer;
    x->peer->n_ops++;
    x->ops++;
    ch->pending++;
    ucp_request_param_t prm = op_param(op);
    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    prm.flags = UCP_AM_SEND_FLAG_EAGER;
    op_issued(op, ucp_am_send_nbx(x->peer->ep, KVX_AM_DATA_ID, w.p, w.len, local + off, n, &prm));
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

static void flush_data(kvx_xfer *x, int kind, kvx_chunk *ch) {
  td_kvx *k = x->k;
  kvx_op *op = op_new(k, OP_FLUSH);
  if (!op) {
    xfer_op_error(x, UCS_ERR_NO_MEMORY, "flush");
    return;
  }
  op->x = x;
  op->ch = ch;
  op->flush = kind;
  op->peer = x->peer;
  x->peer->n_ops++;
  x->ops++;
  ucp_request_param_t prm = op_param(op);
  op_issued(op, ucp_ep_flush_nbx(x->peer->data_ep, &prm));
}

static void chunk_free(kvx_xfer *x, kvx_chunk *ch) {
  td_kvx *k = x->k;
  if (ch->ev) kvx_gpu_release(k->gpu, ch->ev);
  if (ch->lslot >= 0) k->send_free[k->n_send_free++] = ch->lslot;
  DL_DELETE(x->chunks, ch);
  x->n_chunks--;
  free(ch->pc);
  free(ch);
}

static int pump_ucx(kvx_xfer *x) {
  td_kvx *k = x->k;
  int work = 0;
  if (x->ready_ev && !x->ready_done) {
    if (x->src_staged) {
      if (kvx_gpu_wait(k->gpu, KVX_S_D2H, x->ready_ev) != TD_OK) {
        xfer_stop(x, TD_ERR_CUDA, td_errmsg(), true);
        return 1;
      }
    } else if (x->pool->d.mem == TD_KVX_MEM_CUDA) {
      int r = kvx_gpu_query(k->gpu, x->ready_ev);
      if (r < 0) {
        xfer_stop(x, TD_ERR_CUDA, td_errmsg(), true);
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
        xfer_stop(x, TD_ERR_CUDA, td_errmsg(), true);
        return 1;
      }
      if (r == 0) continue;
      kvx_gpu_release(k->gpu, ch->ev);
      ch->ev = NULL;
      tr(k, x->id, "d2h_done", ch->bytes);
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
        flush_data(x, FL_CHUNK, ch);
      } else {
        ch->state = CH_DONE;
      }
      work++;
    }
    if (ch->state == CH_FLUSHED) {
      kvx_wbuf w;
      msg_begin(k, &w, KVX_MSG_CHUNK, x->id);
      kvx_w_u32(&w, (uint32_t)ch->rslot);
      kvx_w_u32(&w, (uint32_t)ch->n);
      for (int i = 0; i < ch->n; i++) {
        kvx_w_u64(&w, ch->pc[i].dst_off);
        kvx_w_u64(&w, ch->pc[i].len);
      }
      send_msg(k, x->peer->fast ? x->peer->data_ep : x->peer->ep, &w);
      tr(k, x->id, "chunk", ch->bytes);
      ch->state = CH_DONE;
      work++;
    }
    if (ch->state == CH_DONE) chunk_free(x, ch);
  }
  if (x->op_err != TD_OK) {
    xfer_stop(x, x->op_err, x->op_msg, true);
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
    kvx_chunk *c = chunk_build(x, cap);
    if (!c) {
      xfer_stop(x, TD_ERR_NOMEM, "out of memory", true);
      return 1;
    }
    x->issued += c->bytes;
    DL_APPEND(x->chunks, c);
    x->n_chunks++;
    if (x->dst_staged) c->rslot = x->rfree[--x->n_rfree];
    if (x->src_staged) {
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
      tr(k, x->id, "d2h", c->bytes);
      if (s != TD_OK) {
        c->state = CH_DONE;
        xfer_stop(x, s, td_errmsg(), true);
        return 1;
      }
      c->state = CH_D2H;
    } else {
      chunk_puts(x, c);
    }
    work++;
  }
  if (x->op_err != TD_OK) {
    xfer_stop(x, x->op_err, x->op_msg, true);
    return 1;
  }
  if (x->ci == x->n_items && x->n_chunks == 0 && !x->final_flush_issued) {
    x->final_flush_issued = true;
    flush_data(x, FL_FINAL, NULL);
    work++;
  }
  if (x->final_flushed && !x->done_sent) {
    kvx_wbuf w;
    msg_begin(k, &w, KVX_MSG_DONE, x->id);
    kvx_w_u64(&w, x->total);
    send_msg(k, x->peer->fast ? x->peer->data_ep : x->peer->ep, &w);
    tr(k, x->id, "done", 0);
    x->done_sent = true;
    x->st = XS_FINISH;
    work++;
  }
  return work;
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
  } else if ((s = scratch(k, (size_t)n)) == TD_OK) {
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
static int pump_nccl_send(kvx_xfer *x) {
  td_kvx *k = x->k;
  td_kvx_peer *p = x->peer;
  kvx_nstream *ns = x->ns;
  if (!p->nccl) {
    xfer_stop(x, TD_ERR_NETWORK, "NCCL communicator gone", true);
    return 1;
  }
  /* While a group is being launched, the rest goes on (but no posting). */
  if (kvx_nccl_poll(p->nccl) < 0) {
    peer_nccl_abort(p, TD_ERR_NETWORK, td_errmsg(), true);
    return 1;
  }
  if (!kvx_nccl_ready(p->nccl)) return 0;
  int work = 0;
  /* Groups complete in order; their slots go back. */
  while (ns->done < ns->post) {
    int q = kvx_nccl_op_poll(ns->ring[ns->done % KVX_NCCL_WINDOW].op);
    if (q < 0) {
      peer_nccl_abort(p, TD_ERR_NETWORK, td_errmsg(), true);
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
        xfer_stop(x, s, td_errmsg(), true);
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
          xfer_stop(x, s, td_errmsg(), true);
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
          peer_nccl_abort(p, s, td_errmsg(), true);
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
    kvx_wbuf w;
    msg_begin(k, &w, KVX_MSG_DONE, x->id);
    kvx_w_u64(&w, x->total);
    send_msg(k, p->fast ? p->data_ep : p->ep, &w);
    x->done_sent = true;
    x->st = XS_FINISH;
    work++;
  }
  return work;
}

/* A stopping transfer ends once nothing of it is in flight and its puts
 * are flushed, so the receiver may reuse the blocks after the ABORT. */
static int pump_stop(kvx_xfer *x) {
  td_kvx *k = x->k;
  kvx_chunk *ch, *tmp;
  int work = 0;
  DL_FOREACH_SAFE(x->chunks, ch, tmp) {
    if (ch->state == CH_D2H) {
      if (kvx_gpu_query(k->gpu, ch->ev) == 0) continue;
      chunk_free(x, ch);
      work++;
    } else if ((ch->state == CH_PUT && ch->pending == 0) || ch->state == CH_FLUSHED || ch->state == CH_DONE) {
      chunk_free(x, ch);
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
  if (x->n_chunks > 0 || x->ops > 0 || !nstream_quiet(k, x->ns)) return work;
  if (x->bytes_put > 0 && !x->nccl && !x->stop_flush_issued) {
    x->stop_flush_issued = true;
    flush_data(x, FL_STOP, NULL);
    return work + 1;
  }
  if (x->stop_flush_issued && !x->stop_flushed) return work;
  if (x->notify && x->peer->status == TD_OK) send_status(k, x->peer->ep, KVX_MSG_ABORT, x->id, x->fst, x->fmsg);
  xfer_finish(x, x->fst, x->fmsg);
  return work + 1;
}

static int pump_xfers(td_kvx *k) {
  int work = 0;
  int64_t now = td_now_ms();
  kvx_xfer *x, *tmp;
  HASH_ITER(hh, k->xfers, x, tmp) {
    if (x->st != XS_STOPPING && now > x->deadline) {
      char m[KVX_TEXT];
      snprintf(m, sizeof m, "timed out after %d ms (%s)", x->timeout_ms,
               x->st == XS_WAIT_GRANT ? "no grant" : x->st == XS_RUN ? "copying" : "no acknowledgement");
      xfer_stop(x, TD_ERR_TIMEOUT, m, true);
    }
    switch (x->st) {
      case XS_RUN:
        work += x->nccl ? pump_nccl_send(x) : pump_ucx(x);
        break;
      case XS_FINISH:
        if (x->acked) {
          xfer_finish(x, x->ack_st, x->ack_msg);
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

/* ---------------------------------------------------------------- receiver */

static kvx_rpeer *find_rpeer(td_kvx *k, uint64_t uuid) {
  kvx_rpeer *rp = NULL;
  HASH_FIND(hh, k->rpeers, &uuid, sizeof uuid, rp);
  return rp;
}

static kvx_grant *find_grant(td_kvx *k, uint64_t uuid, uint64_t xid) {
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
static void grant_end(kvx_grant *g, td_status s, const char *msg) {
  if (g->gst == G_ENDING) return;
  g->est = s;
  set_text(g->emsg, msg);
  g->gst = G_ENDING;
  if (g->ns) {
    /* Only a communicator abort stops a queued receive (it was aborted
     * when any is left here). */
    nstream_drop_ops(g->k, g->ns, true);
    g->ns->drain_deadline = td_now_ms() + KVX_GRANT_GRACE_MS;
  }
}

/* Whether the grant's NCCL copies (and stopped receives) are over, so its
 * blocks and slots may go back. A receive that an aborted communicator
 * does not stop is given up on after a grace period. */
static bool grant_drained(kvx_grant *g) {
  if (!g->ns || nstream_quiet(g->k, g->ns)) return true;
  if (td_now_ms() <= g->ns->drain_deadline) return false;
  TD_WARN("kvx %s: grant %016" PRIx64 "/%" PRIu64 ": NCCL copies still pending after %d ms; releasing the blocks",
          g->k->name, g->key.uuid, g->key.xid, KVX_GRANT_GRACE_MS);
  return true;
}

static void grant_finalize(kvx_grant *g) {
  td_kvx *k = g->k;
  HASH_DEL(k->grants, g);
  for (int i = 0; i < g->n_slots; i++) k->recv_free[k->n_recv_free++] = g->slots[i];
  g->n_slots = 0;
  nstream_free(k, g->ns, 1);
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

static void rpeer_nccl_abort(kvx_rpeer *rp, td_status s, const char *why, bool tell);

/* Receiver-side failure: tell the sender to stop and wait for its ABORT
 * (or its death) before the blocks go back. */
static void grant_revoke(kvx_grant *g, td_status s, const char *msg) {
  td_kvx *k = g->k;
  if (g->gst == G_CLOSING || g->gst == G_ENDING) return;
  if (g->nccl && g->rp->nccl) {
    /* A queued receive stops only with the communicator (which revokes
     * this grant and every other NCCL grant of the peer). */
    rpeer_nccl_abort(g->rp, s, msg, true);
    return;
  }
  g->est = s;
  set_text(g->emsg, msg);
  if (g->gst == G_PENDING && !g->nccl) {
    /* Nothing granted yet: no write can come. */
    send_status(k, g->rp->ep, KVX_MSG_DENY, g->key.xid, s, msg);
    grant_end(g, s, msg);
    return;
  }
  send_status(k, g->rp->ep, KVX_MSG_REVOKE, g->key.xid, s, msg);
  g->gst = G_CLOSING;
  g->hard_deadline = td_now_ms() + 2 * KVX_GRANT_GRACE_MS;
}

static void rpeer_nccl_abort(kvx_rpeer *rp, td_status s, const char *why, bool tell) {
  td_kvx *k = rp->k;
  if (!rp->nccl) return;
  if (tell && !rp->failed && rp->ep) {
    kvx_wbuf w;
    msg_begin(k, &w, KVX_MSG_NCCL_ABORT, 1); /* 1: from the receiver */
    kvx_w_u32(&w, rp->nccl_gen);
    send_msg(k, rp->ep, &w);
  }
  kvx_grant *g, *tmp;
  HASH_ITER(hh, k->grants, g, tmp) {
    if (g->rp == rp && g->nccl) nstream_drop_ops(k, g->ns, true);
  }
  kvx_nccl_abort(rp->nccl);
  rp->nccl = NULL;
  HASH_ITER(hh, k->grants, g, tmp) {
    if (g->rp != rp || !g->nccl || g->gst == G_ENDING) continue;
    if (rp->failed)
      grant_end(g, s, why);
    else
      grant_revoke(g, s, why);
  }
}

static void rpeer_fail(kvx_rpeer *rp, td_status s, const char *msg, bool event) {
  td_kvx *k = rp->k;
  if (rp->failed) return;
  rp->failed = true;
  HASH_DEL(k->rpeers, rp);
  DL_APPEND(k->rzombies, rp);
  k->st.rpeers--;
  rpeer_nccl_abort(rp, s, msg, false);
  kvx_grant *g, *tmp;
  HASH_ITER(hh, k->grants, g, tmp) {
    if (g->rp == rp) grant_end(g, s != TD_OK ? s : TD_ERR_CANCELLED, msg);
  }
  if (s != TD_OK) orphan_msgs(k, rp->ep, rp->fast_ep);
  close_ep(k, rp->ep, s != TD_OK, rp->own);
  close_ep(k, rp->fast_ep, false, NULL); /* no error handling: cannot be forced */
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

static void handle_hello(td_kvx *k, uint64_t uuid, kvx_rbuf *r) {
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
  ep_owner *own = calloc(1, sizeof *own);
  if (!rp || !own) {
    free(rp);
    free(own);
    return;
  }
  own->k = k;
  rp->uuid = uuid;
  rp->k = k;
  rp->own = own;
  rp->conns = 1;
  if (make_ep(k, addr, true, own, &rp->ep) != TD_OK) {
    TD_WARN("kvx %s: cannot answer %016" PRIx64 ": %s", k->name, uuid, td_errmsg());
    free(own);
    free(rp);
    return;
  }
  if (k->local_ok && host == k->host_id && uuid != k->uuid) {
    ucp_ep_h fep = NULL;
    if (make_ep(k, addr, false, NULL, &fep) == TD_OK) {
      if (ep_am_is_shm(fep))
        rp->fast_ep = fep;
      else
        close_ep(k, fep, false, NULL);
    } else {
      td_err_clear();
    }
  }
  HASH_ADD(hh, k->rpeers, uuid, sizeof rp->uuid, rp);
  k->st.rpeers++;
  TD_DEBUG("kvx %s: peer %016" PRIx64 " connected%s", k->name, uuid, rp->fast_ep ? " (shared-memory replies)" : "");
}

static void handle_req(td_kvx *k, kvx_rpeer *rp, uint64_t xid, kvx_rbuf *r) {
  if (find_grant(k, rp->uuid, xid)) return; /* duplicate */
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
  sg.layer0 = kvx_r_i32(r);
  sg.layer1 = kvx_r_i32(r);
  sg.head0 = kvx_r_i32(r);
  sg.head1 = kvx_r_i32(r);
  uint32_t n = kvx_r_u32(r);
  const uint8_t *ids = (n > 0 && n <= KVX_MAX_MSG_BLOCKS) ? kvx_r_bytes(r, (size_t)n * 8) : NULL;
  char why[KVX_TEXT];
  td_status s = TD_OK;
  if (!ids || r->bad || r->pos != r->len) {
    send_status(k, rp->ep, KVX_MSG_DENY, xid, TD_ERR_FORMAT, "malformed transfer request");
    return;
  }
  kvx_pool *pool = find_pool(k, dst_pool);
  if (!pool) {
    snprintf(why, sizeof why, "receiver has no pool %u", dst_pool);
    send_status(k, rp->ep, KVX_MSG_DENY, xid, TD_ERR_NOT_FOUND, why);
    return;
  }
  kvx_grant *g = calloc(1, sizeof *g);
  int32_t *blocks = malloc(sizeof(int32_t) * 3 * (size_t)n);
  if (!g || !blocks) {
    free(g);
    free(blocks);
    send_status(k, rp->ep, KVX_MSG_DENY, xid, TD_ERR_NOMEM, "receiver out of memory");
    return;
  }
  kvx_rbuf ir = {.p = ids, .len = (size_t)n * 8};
  for (uint32_t i = 0; i < 2 * n; i++) blocks[i] = kvx_r_i32(&ir);
  int32_t *src = blocks, *dst = blocks + n, *sorted = blocks + 2 * n;
  memcpy(sorted, dst, sizeof(int32_t) * n);
  qsort(sorted, n, sizeof(int32_t), cmp_i32);
  why[0] = 0;
  for (uint32_t i = 0; i < n && !why[0]; i++) {
    if (sorted[i] < 0 || sorted[i] >= pool->d.n_blocks || src[i] < 0)
      snprintf(why, sizeof why, "block %d outside pool %u (%d blocks)", sorted[i], dst_pool, pool->d.n_blocks);
    else if (i > 0 && sorted[i] == sorted[i - 1])
      snprintf(why, sizeof why, "destination block %d appears twice", sorted[i]);
  }
  td_kvx_slice *items = NULL;
  int n_items = 0;
  uint64_t mine = 0;
  if (!why[0] && td_kvx_plan_copies(&sg, &pool->d.geom, src, dst, (int)n, &items, &n_items) != TD_OK)
    snprintf(why, sizeof why, "%s", td_errmsg());
  for (int i = 0; i < n_items; i++) mine += items[i].len;
  if (!why[0] && mine != total)
    snprintf(why, sizeof why, "sender plans %" PRIu64 " bytes, receiver %" PRIu64, total, mine);
  bool nccl = transport == KVX_MODE_NCCL, am = transport == KVX_MODE_AM;
  bool staged = !nccl && !am && !pool->direct;
  if (!why[0] && transport != KVX_MODE_PUT && !nccl && !am) snprintf(why, sizeof why, "unknown data mode %u", transport);
  if (!why[0] && nccl && (pool->d.mem != TD_KVX_MEM_CUDA || !rp->nccl || rp->nccl_gen != gen))
    snprintf(why, sizeof why, "no NCCL communicator for this transfer");
  if (!why[0] && nccl && !kvx_chunking_valid(ck_first, ck_max))
    snprintf(why, sizeof why, "NCCL chunks of %" PRIu64 " / %" PRIu64 " bytes", ck_first, ck_max);
  if (!why[0] && nccl && nccl_ring(k, 1) != TD_OK) snprintf(why, sizeof why, "%s", td_errmsg());
  /* The chunking both sides use: the sender's, within our slots. */
  kvx_nstream *ns = NULL;
  if (!why[0] && nccl) {
    uint64_t mx = ck_max < k->nccl_chunk ? ck_max : k->nccl_chunk;
    if (!(ns = nstream_new(ck_first < mx ? ck_first : mx, mx))) snprintf(why, sizeof why, "receiver out of memory");
  }
  if (!why[0] && staged && !k->recv_stg) snprintf(why, sizeof why, "no staging buffers");
  if (why[0]) {
    free(items);
    free(blocks);
    free(g);
    free(ns);
    send_status(k, rp->ep, KVX_MSG_DENY, xid, TD_ERR_INVALID, why);
    return;
  }
  td_kvx_grant_req req = {rp->uuid, request_id, res_id, dst_pool, dst, (int)n, total};
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
    send_status(k, rp->ep, KVX_MSG_DENY, xid, s, why);
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
  g->sorted = sorted;
  g->n_blocks = (int)n;
  g->items = items;
  g->n_items = n_items;
  g->total = total;
  g->nccl = nccl;
  g->ns = ns;
  g->am = am;
  g->staged = staged;
  g->deadline = td_now_ms() + (int64_t)timeout_ms + KVX_GRANT_GRACE_MS;
  HASH_ADD(hh, k->grants, key, sizeof g->key, g);
  pool->users++;
  rp->n_grants++;
  g->gst = G_PENDING;
  if (nccl) {
    g->seq = rp->nccl_seq_assign++;
    kvx_wbuf w;
    msg_begin(k, &w, KVX_MSG_GRANT, xid);
    kvx_w_u64(&w, g->seq);
    kvx_w_u32(&w, 0);
    kvx_w_u64(&w, ns->first);
    kvx_w_u64(&w, ns->max);
    send_msg(k, rp->fast_ep ? rp->fast_ep : rp->ep, &w);
  } else if (!staged) {
    g->gst = G_ACTIVE;
    kvx_wbuf w;
    msg_begin(k, &w, KVX_MSG_GRANT, xid);
    kvx_w_u64(&w, 0);
    kvx_w_u32(&w, 0);
    send_msg(k, rp->fast_ep ? rp->fast_ep : rp->ep, &w);
  }
  TD_DEBUG("kvx %s: granted request %" PRIu64 " from %016" PRIx64 ": %u blocks, %" PRIu64 " bytes", k->name,
           request_id, rp->uuid, n, total);
}

/* Whether [off, off + len) lies in blocks the grant holds. */
static bool grant_covers(const kvx_grant *g, uint64_t off, uint64_t len) {
  uint64_t bb = g->pool->block_bytes;
  if (len == 0 || off + len < off || off + len > g->pool->bytes) return false;
  for (uint64_t b = off / bb; b <= (off + len - 1) / bb; b++) {
    int32_t key = (int32_t)b;
    if (!bsearch(&key, g->sorted, (size_t)g->n_blocks, sizeof(int32_t), cmp_i32)) return false;
  }
  return true;
}

static void handle_chunk(td_kvx *k, kvx_grant *g, kvx_rbuf *r) {
  uint32_t slot = kvx_r_u32(r), n = kvx_r_u32(r);
  if (g->gst != G_ACTIVE || !g->staged) return;
  int si = -1;
  for (int i = 0; i < g->n_slots; i++)
    if ((uint32_t)g->slots[i] == slot) si = i;
  if (si < 0 || n == 0 || n > KVX_CHUNK_PIECES) {
    grant_revoke(g, TD_ERR_FORMAT, "chunk names a staging slot not granted");
    return;
  }
  uint8_t *src = k->recv_stg + (size_t)slot * k->slot_bytes;
  uint64_t packed = 0, bytes = 0;
  void *dsts[KVX_CHUNK_PIECES];
  const void *srcs[KVX_CHUNK_PIECES];
  size_t sizes[KVX_CHUNK_PIECES];
  for (uint32_t i = 0; i < n; i++) {
    uint64_t off = kvx_r_u64(r), len = kvx_r_u64(r);
    if (r->bad || !grant_covers(g, off, len) || packed + len > k->slot_bytes) {
      grant_revoke(g, TD_ERR_FORMAT, "chunk writes outside the granted blocks");
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
    grant_revoke(g, s, td_errmsg());
    return;
  }
  tr(k, g->key.xid, "r_chunk", bytes);
  h->g = g;
  h->slot = (int)slot;
  h->bytes = bytes;
  g->h2d++;
  DL_APPEND(k->h2ds, h);
}

static int pump_h2d(td_kvx *k) {
  int work = 0;
  kvx_h2d *h, *tmp;
  DL_FOREACH_SAFE(k->h2ds, h, tmp) {
    int r = kvx_gpu_query(k->gpu, h->ev);
    if (r == 0) continue;
    kvx_grant *g = h->g;
    g->h2d--;
    if (r < 0) {
      grant_revoke(g, TD_ERR_CUDA, td_errmsg());
    } else {
      g->received += h->bytes;
      tr(k, g->key.xid, "r_h2d_done", h->bytes);
      if (g->gst == G_ACTIVE) {
        kvx_wbuf w;
        msg_begin(k, &w, KVX_MSG_CREDIT, g->key.xid);
        kvx_w_u32(&w, (uint32_t)h->slot);
        send_msg(k, g->rp->fast_ep ? g->rp->fast_ep : g->rp->ep, &w);
      }
    }
    kvx_gpu_release(k->gpu, h->ev);
    DL_DELETE(k->h2ds, h);
    free(h);
    work++;
  }
  return work;
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
  TD_TRY(scratch(k, (size_t)e->n_pc));
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
static int pump_nccl_recv(kvx_grant *g) {
  td_kvx *k = g->k;
  kvx_rpeer *rp = g->rp;
  kvx_nstream *ns = g->ns;
  if (!rp->nccl) {
    grant_revoke(g, TD_ERR_NETWORK, "NCCL communicator gone");
    return 1;
  }
  /* While a group is being launched, the rest goes on (but no posting). */
  if (kvx_nccl_poll(rp->nccl) < 0) {
    rpeer_nccl_abort(rp, TD_ERR_NETWORK, td_errmsg(), true);
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
      rpeer_nccl_abort(rp, TD_ERR_NETWORK, td_errmsg(), true);
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
        grant_revoke(g, s, td_errmsg());
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
        grant_revoke(g, TD_ERR_CUDA, td_errmsg());
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
        rpeer_nccl_abort(rp, s, td_errmsg(), true);
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
        rpeer_nccl_abort(rp, s, td_errmsg(), true);
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
    send_status(k, rp->fast_ep ? rp->fast_ep : rp->ep, KVX_MSG_ACK, g->key.xid, TD_OK, "");
    grant_end(g, TD_OK, "");
    work++;
  }
  return work;
}

static int pump_grants(td_kvx *k) {
  int work = 0;
  int64_t now = td_now_ms();
  bool slots_taken = false; /* staged grants get slots in arrival order */
  kvx_grant *g, *tmp;
  HASH_ITER(hh, k->grants, g, tmp) {
    if ((g->gst == G_PENDING || g->gst == G_ACTIVE) && now > g->deadline) {
      grant_revoke(g, TD_ERR_TIMEOUT, "receiver timed the transfer out");
      work++;
    }
    switch (g->gst) {
      case G_PENDING:
        if (g->nccl) {
          kvx_rpeer *rp = g->rp;
          if (!rp->nccl) {
            grant_revoke(g, TD_ERR_NETWORK, "NCCL communicator gone");
            break;
          }
          int r = kvx_nccl_poll(rp->nccl);
          if (r < 0) {
            rpeer_nccl_abort(rp, TD_ERR_NETWORK, td_errmsg(), true);
            work++;
            break;
          }
          /* Receives are queued in grant order: this grant's turn comes
           * once the one before posted all of its. */
          if (!kvx_nccl_ready(rp->nccl) || rp->nccl_seq_post != g->seq) break;
          g->gst = G_ACTIVE;
          work += 1 + pump_nccl_recv(g);
        } else if (!slots_taken) {
          slots_taken = true;
          if (k->n_recv_free == 0) break;
          int want = KVX_GRANT_SLOTS;
          while (g->n_slots < want && k->n_recv_free > 0) g->slots[g->n_slots++] = k->recv_free[--k->n_recv_free];
          kvx_wbuf w;
          msg_begin(k, &w, KVX_MSG_GRANT, g->key.xid);
          kvx_w_u64(&w, 0);
          kvx_w_u32(&w, (uint32_t)g->n_slots);
          for (int i = 0; i < g->n_slots; i++) kvx_w_u32(&w, (uint32_t)g->slots[i]);
          send_msg(k, g->rp->fast_ep ? g->rp->fast_ep : g->rp->ep, &w);
          tr(k, g->key.xid, "r_grant", (uint64_t)g->n_slots);
          g->gst = G_ACTIVE;
          work++;
        }
        break;
      case G_ACTIVE:
        if (g->nccl) {
          work += pump_nccl_recv(g);
        } else if (g->data_err != TD_OK) {
          grant_revoke(g, g->data_err, "data outside the granted blocks, or a failed copy");
          work++;
        } else if ((g->staged || g->am) && g->received > g->total) {
          grant_revoke(g, TD_ERR_FORMAT, "more bytes than granted");
          work++;
        } else if (g->done_rx && g->h2d == 0 && (!(g->staged || g->am) || g->received == g->total)) {
          /* Data messages may trail DONE; a counted grant waits for them. */
          if (!g->staged && !g->am) g->received = g->total; /* direct puts are flushed before DONE */
          if (g->received == g->total) {
            send_status(k, g->rp->fast_ep ? g->rp->fast_ep : g->rp->ep, KVX_MSG_ACK, g->key.xid, TD_OK, "");
            tr(k, g->key.xid, "r_ack", 0);
            grant_end(g, TD_OK, "");
          } else {
            char m[KVX_TEXT];
            snprintf(m, sizeof m, "received %" PRIu64 " of %" PRIu64 " bytes", g->received, g->total);
            send_status(k, g->rp->fast_ep ? g->rp->fast_ep : g->rp->ep, KVX_MSG_ACK, g->key.xid, TD_ERR_NETWORK, m);
            grant_end(g, TD_ERR_NETWORK, m);
          }
          work++;
        }
        break;
      case G_CLOSING:
        if (now > g->hard_deadline) {
          /* The sender neither stopped nor died: cut it off. */
          rpeer_fail(g->rp, TD_ERR_TIMEOUT, "sender did not confirm a revoked transfer", true);
          work++;
        }
        break;
      default:
        break;
    }
    if (g->gst == G_ENDING && g->h2d == 0 && grant_drained(g)) {
      grant_finalize(g);
      work++;
    }
  }
  return work;
}

/* ---------------------------------------------------------------- dispatch */

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
  char text[KVX_TEXT];
  if (type == KVX_MSG_HELLO) {
    handle_hello(k, uuid, &r);
    return;
  }
  /* Receiver-bound messages come from a peer that said HELLO. */
  if (type == KVX_MSG_NCCL_ABORT && xid == 1) {
    /* From a receiver: the communicators of our peer handles to it. */
    uint32_t gen = kvx_r_u32(&r);
    td_kvx_peer *p;
    DL_FOREACH(k->peers, p) {
      if (p->desc.uuid == uuid && p->nccl && p->nccl_gen == gen && !r.bad)
        peer_nccl_abort(p, TD_ERR_NETWORK, "the receiver aborted the NCCL communicator", false);
    }
    return;
  }
  if (type == KVX_MSG_REQ || type == KVX_MSG_CHUNK || type == KVX_MSG_DONE || type == KVX_MSG_ABORT ||
      type == KVX_MSG_NCCL_ID || type == KVX_MSG_BYE || type == KVX_MSG_NCCL_ABORT) {
    kvx_rpeer *rp = find_rpeer(k, uuid);
    if (!rp) {
      TD_WARN("kvx %s: message %u from unknown peer %016" PRIx64, k->name, type, uuid);
      return;
    }
    kvx_grant *g = NULL;
    switch (type) {
      case KVX_MSG_REQ:
        tr(k, xid, "r_req", 0);
        handle_req(k, rp, xid, &r);
        break;
      case KVX_MSG_CHUNK:
        if ((g = find_grant(k, uuid, xid))) handle_chunk(k, g, &r);
        break;
      case KVX_MSG_DONE:
        if ((g = find_grant(k, uuid, xid)) && (g->gst == G_ACTIVE)) {
          uint64_t total = kvx_r_u64(&r);
          if (r.bad || total != g->total)
            grant_revoke(g, TD_ERR_FORMAT, "sender's total does not match the grant");
          else
            g->done_rx = true;
          tr(k, xid, "r_done", 0);
        }
        break;
      case KVX_MSG_ABORT:
        if ((g = find_grant(k, uuid, xid))) {
          td_status s = (td_status)kvx_r_u32(&r);
          r_text(&r, text);
          if (r.bad || s <= TD_OK || s >= TD_STATUS_COUNT) s = TD_ERR_CANCELLED;
          if (g->gst == G_CLOSING) {
            /* Our own revocation, now confirmed: keep its reason. */
            s = g->est;
            snprintf(text, sizeof text, "%s", g->emsg);
          }
          if (g->nccl && rp->nccl) rpeer_nccl_abort(rp, s, text, true);
          grant_end(g, s, text[0] ? text : "sender stopped");
        }
        break;
      case KVX_MSG_NCCL_ID: {
        uint32_t gen = kvx_r_u32(&r);
        const uint8_t *id = kvx_r_bytes(&r, KVX_NCCL_ID_BYTES);
        if (!id || !k->gpu) {
          TD_WARN("kvx %s: NCCL id from %016" PRIx64 " ignored (%s)", k->name, uuid, id ? "no GPU" : "malformed");
          break;
        }
        rpeer_nccl_abort(rp, TD_ERR_NETWORK, "NCCL communicator replaced", false);
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
        if (--rp->conns <= 0) rpeer_fail(rp, TD_OK, "peer disconnected", false);
        break;
      case KVX_MSG_NCCL_ABORT:
        if (kvx_r_u32(&r) == rp->nccl_gen && !r.bad)
          rpeer_nccl_abort(rp, TD_ERR_NETWORK, "the sender aborted the NCCL communicator", false);
        break;
      default:
        break;
    }
    return;
  }
  kvx_xfer *x = msg_xfer(k, uuid, xid);
  if (!x) return; /* a transfer that already ended */
  x->peer->known = true;
  switch (type) {
    case KVX_MSG_GRANT: {
      uint64_t seq = kvx_r_u64(&r);
      uint32_t n = kvx_r_u32(&r);
      if (x->st != XS_WAIT_GRANT) break;
      if (r.bad || n > KVX_GRANT_SLOTS || (x->dst_staged && n == 0)) {
        xfer_stop(x, TD_ERR_FORMAT, "malformed grant", true);
        break;
      }
      for (uint32_t i = 0; i < n; i++) {
        uint32_t s = kvx_r_u32(&r);
        if (s >= x->peer->desc.stg_slots) r.bad = true;
        x->rslots[i] = x->rfree[i] = (int)s;
      }
      if (x->nccl) {
        /* The receiver's chunking: ours or smaller, never larger than our slots. */
        uint64_t first = kvx_r_u64(&r), max = kvx_r_u64(&r);
        if (!kvx_chunking_valid(first, max) || max > x->ns->max) r.bad = true;
        x->ns->first = first;
        x->ns->max = max;
      }
      if (r.bad) {
        xfer_stop(x, TD_ERR_FORMAT, "malformed grant", true);
        break;
      }
      x->n_rslots = x->n_rfree = (int)n;
      tr(k, xid, "grant", n);
      x->seq = seq;
      x->seq_set = x->nccl;
      x->st = XS_RUN;
      break;
    }
    case KVX_MSG_DENY: {
      td_status s = (td_status)kvx_r_u32(&r);
      r_text(&r, text);
      if (s <= TD_OK || s >= TD_STATUS_COUNT) s = TD_ERR_INVALID;
      if (x->st != XS_WAIT_GRANT && x->st != XS_STOPPING) break;
      char m[KVX_TEXT + 32];
      snprintf(m, sizeof m, "receiver refused: %s", text);
      /* Nothing was written: no ABORT owed. */
      x->notify = false;
      if (x->st == XS_STOPPING) {
        if (x->ops == 0 && x->n_chunks == 0 && x->bytes_put == 0) xfer_finish(x, x->fst, x->fmsg);
      } else {
        xfer_finish(x, s, m);
      }
      break;
    }
    case KVX_MSG_CREDIT: {
      uint32_t s = kvx_r_u32(&r);
      bool ok = false;
      for (int i = 0; i < x->n_rslots; i++) ok |= (uint32_t)x->rslots[i] == s;
      for (int i = 0; i < x->n_rfree; i++) ok &= (uint32_t)x->rfree[i] != s;
      if (ok && !r.bad && x->n_rfree < KVX_GRANT_SLOTS) x->rfree[x->n_rfree++] = (int)s;
      tr(k, xid, "credit", s);
      break;
    }
    case KVX_MSG_ACK: {
      td_status s = (td_status)kvx_r_u32(&r);
      r_text(&r, text);
      if (s < TD_OK || s >= TD_STATUS_COUNT) s = TD_ERR_INTERNAL;
      /* NCCL: the receive may complete before the send is seen complete. */
      if (x->st == XS_STOPPING || x->st == XS_WAIT_GRANT) break;
      x->acked = true;
      tr(k, xid, "ack", (uint64_t)s);
      x->ack_st = s;
      snprintf(x->ack_msg, KVX_TEXT, "%s", s == TD_OK ? "" : text);
      break;
    }
    case KVX_MSG_REVOKE: {
      td_status s = (td_status)kvx_r_u32(&r);
      r_text(&r, text);
      if (s <= TD_OK || s >= TD_STATUS_COUNT) s = TD_ERR_INTERNAL;
      char m[KVX_TEXT + 32];
      snprintf(m, sizeof m, "receiver revoked: %s", text);
      xfer_stop(x, s, m, true);
      break;
    }
    default:
      break;
  }
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
    snprintf(p->msg, sizeof p->msg, "peer %016" PRIx64 " failed: %s", p->desc.uuid, ucs_str(p->own->failed));
    TD_WARN("kvx %s: %s", k->name, p->msg);
    peer_nccl_abort(p, TD_ERR_PEER, p->msg, false);
    orphan_msgs(k, p->ep, p->data_ep);
    kvx_xfer *x, *tmp;
    HASH_ITER(hh, k->xfers, x, tmp) {
      if (x->peer != p) continue;
      orphan_ops(k, x);
      /* A transfer already stopping keeps its reason (e.g. its timeout). */
      if (x->st == XS_STOPPING)
        xfer_finish(x, x->fst, x->fmsg);
      else
        xfer_finish(x, TD_ERR_PEER, p->msg);
    }
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
    close_ep(k, p->ep, true, p->own);
    p->ep = NULL;
    p->own = NULL;
    if (p->closed) {
      peer_maybe_release(p);
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
    snprintf(m, sizeof m, "peer %016" PRIx64 " failed: %s", rp->uuid, ucs_str(rp->own->failed));
    TD_WARN("kvx %s: %s", k->name, m);
    rpeer_fail(rp, TD_ERR_PEER, m, true);
    goto again;
  }
}

static int run_callbacks(td_kvx *k) {
  int n = 0;
  while (k->xdone || k->gdone) {
    while (k->xdone) {
      kvx_xfer *x = k->xdone;
      k->xdone = x->dnext;
      td_kvx_peer *p = x->peer;
      tr(k, x->id, "cb", 0);
      if (x->cb) x->cb(x->arg, x->id, x->fst, x->fmsg);
      free(x->items);
      free(x->blocks);
      free(x);
      p->n_xfers--;
      peer_maybe_release(p);
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
  work += pump_h2d(k);
  work += pump_grants(k);
  work += pump_xfers(k);
  work += run_callbacks(k);
  return work;
}

/* Work that no file descriptor signals: CUDA copies and NCCL groups. */
static bool gpu_busy(td_kvx *k) {
  if (k->h2ds) return true;
  kvx_xfer *x, *tmp;
  HASH_ITER(hh, k->xfers, x, tmp) {
    if (x->nccl && (x->st == XS_RUN || (x->st == XS_STOPPING && x->ns))) return true;
    kvx_chunk *ch;
    DL_FOREACH(x->chunks, ch) if (ch->state == CH_D2H) return true;
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
  return s;
}

/* ---------------------------------------------------------------- destroy */

void td_kvx_destroy(td_kvx *k) {
  if (!k) return;
  k->destroying = true;
  if (k->w) {
    td_kvx_peer *p, *ptmp;
    DL_FOREACH_SAFE(k->peers, p, ptmp) {
      kvx_xfer *x, *tmp;
      HASH_ITER(hh, k->xfers, x, tmp) {
        if (x->peer == p) xfer_stop(x, TD_ERR_CANCELLED, "engine shutting down", true);
      }
    }
    kvx_grant *g, *gtmp;
    HASH_ITER(hh, k->grants, g, gtmp) grant_revoke(g, TD_ERR_CANCELLED, "receiver shutting down");
    /* Let transfers stop cleanly for a moment, then cut. */
    int64_t until = td_now_ms() + 500;
    while ((HASH_COUNT(k->xfers) > 0 || k->h2ds) && td_now_ms() < until) td_kvx_progress(k);
    kvx_xfer *x, *tmp;
    HASH_ITER(hh, k->xfers, x, tmp) {
      orphan_ops(k, x);
      xfer_finish(x, x->st == XS_STOPPING ? x->fst : TD_ERR_CANCELLED, "engine shutting down");
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
      if (g->gst != G_ENDING) grant_end(g, g->gst == G_CLOSING ? g->est : TD_ERR_CANCELLED, "receiver shutting down");
      while (!grant_drained(g)) {
      }
      grant_finalize(g);
    }
    run_callbacks(k);
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
      peer_maybe_release(p);
    }
    kvx_rpeer *rp, *rtmp;
    HASH_ITER(hh, k->rpeers, rp, rtmp) rpeer_fail(rp, TD_OK, "shutting down", false);
    until = td_now_ms() + 200;
    while (k->ops && td_now_ms() < until) ucp_worker_progress(k->w);
    kvx_op *op, *otmp;
    DL_FOREACH(k->ops, op) {
      if (op->req) ucp_request_free(op->req); /* no callback after this */
      op->req = NULL;
    }
    if (k->addr) ucp_worker_release_address(k->w, k->addr);
    ucp_worker_destroy(k->w);
    DL_FOREACH_SAFE(k->ops, op, otmp) {
      free(op->own);
      op->peer = NULL;
      op_free(op);
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
  free(k);
}
