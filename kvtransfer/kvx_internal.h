/* Private to kvtransfer/: the types every part of the transfer context
 * shares (pools, peers, transfers, grants, UCX operations, NCCL streams,
 * the context itself), its constants, and the functions one part calls in
 * another. Which file holds what: docs/kvtransfer.md, "Files". */
#ifndef TD_KVTRANSFER_KVX_INTERNAL_H
#define TD_KVTRANSFER_KVX_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include <ucp/api/ucp.h>
#include <uthash.h>
#include <utlist.h>

#include "common/clock.h"
#include "common/defaults.h"
#include "kvtransfer/gather.h"
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
#define KVX_MAX_STAGING_SLOTS 1024
/* Staging slot and chunk options below this take their default; an NCCL
 * chunk option below it is raised to it. */
#define KVX_MIN_CHUNK 4096
#define KVX_TEXT 256
#define KVX_NCCL_WINDOW 6 /* chunks of one NCCL transfer in flight */
#define KVX_NCCL_SLOTS KVX_NCCL_WINDOW /* device bounce slots per direction */
/* Chunks per NCCL group: a group's slots come back only when all of it is
 * done, so two groups alternate (one moves while the other is scattered
 * and posted again). */
#define KVX_NCCL_GROUP (KVX_NCCL_WINDOW / 2)
/* CUDA IPC: a chunk's copies (one batch or one gather launch, one event)
 * and the chunks in flight per transfer; a cancel waits for at most these.
 * A chunk's pieces fit one gather table (one launch); 16 MB chunks of
 * 64 KiB pieces, a launch each, moved 58 % of the link's rate (H200). */
#define KVX_IPC_CHUNK ((uint64_t)64 << 20)
#define KVX_IPC_PIECES KVX_GATHER_PIECES
#define KVX_IPC_WINDOW 4
/* A transfer's first two chunks are smaller (32 pieces and 1/16 of the
 * bytes, then 250 and 1/4): the copies start after 32 pieces were built and
 * launched by value, not 1,000 (~25 us on a GPU host), and the next chunk
 * is built while they run. */
#define KVX_IPC_RAMP 2

/* ---------------------------------------------------------------- types */

/* A registered pool (td_kvx_register_pool). */
typedef struct kvx_pool {
  uint32_t id;
  td_kvx_pool_desc d;
  uint64_t block_bytes, bytes;
  bool direct; /* remote puts land in it (host, or CUDA with UCX CUDA support) */
  bool ipc;    /* exported for CUDA IPC: handle of its allocation, its offset there */
  uint8_t ipc_handle[KVX_IPC_HANDLE_LEN];
  uint64_t ipc_off;
  ucp_mem_h memh;
  void *rkey;
  size_t rkey_len;
  int users;
  UT_hash_handle hh;
} kvx_pool;

/* Argument of a control endpoint's error handler; outlives the endpoint
 * until its close completes. */
typedef struct kvx_ep_owner {
  td_kvx *k;
  ucs_status_t failed;
  bool closing;
} kvx_ep_owner;

/* Sender side: a connection to a receiver (td_kvx_connect). */
struct td_kvx_peer {
  td_kvx *k;
  uint8_t *desc_bytes;
  kvx_desc desc;
  td_kvx_desc_info info;
  kvx_ep_owner *own;
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
  /* CUDA IPC (kvx_ipc.c): the peer's pools mapped here on first use. */
  int ipc_reach;                       /* 0: not checked, 1: its device is reachable, -1: IPC is off for it */
  int8_t ipc_state[TD_KVX_MAX_POOLS];  /* 0: not mapped yet, 1: mapped, -1: cannot be */
  uint8_t *ipc_base[TD_KVX_MAX_POOLS]; /* the mapped allocation */
  bool ipc_logged;                     /* why IPC is off for it, said once */
  struct td_kvx_peer *prev, *next;
};

/* Receiver side: a peer that connected to us (its HELLO). */
typedef struct kvx_rpeer {
  uint64_t uuid, host_id;
  td_kvx *k;
  kvx_ep_owner *own;
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

/* A chunk of a UCX transfer (kvx_put.c) and its state. */
enum { CH_D2H, CH_PUT, CH_FLUSH, CH_FLUSHED, CH_DONE, CH_IPC /* device copies into the mapped pool */ };

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
 * received and scattered in a pipeline (docs/kvtransfer.md, "NCCL
 * pipeline"). Chunks [done, post) are in flight, [post, prep) gathered and
 * not yet sent. */
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

/* Sender side: a posted transfer, from td_kvx_post to its callback. */
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
  bool nccl, am, ipc, src_staged, dst_staged, direct_stage;
  uint8_t *ipc_dst; /* ipc: the receiver's pool, mapped here */
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
  int ipc_chunks; /* CUDA IPC chunks issued (KVX_IPC_RAMP) */
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

/* Receiver side: a granted transfer, from REQ to its recv event. */
enum { G_PENDING, G_ACTIVE, G_CLOSING, G_ENDING };

typedef struct kvx_grant {
  gkey key;
  td_kvx *k;
  kvx_rpeer *rp;
  kvx_pool *pool;
  uint64_t request_id, res_id;
  int32_t *blocks; /* destination blocks, as asked */
  int32_t *sorted; /* the same, sorted, to check staged and UCX pieces (NULL for IPC and NCCL, which never ask) */
  int n_blocks;
  td_kvx_slice *items; /* the plan, for NCCL */
  int n_items;
  uint64_t total, received;
  bool nccl, staged, am, ipc, done_rx;
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

/* A received staging slot being copied into the pool. */
typedef struct kvx_h2d {
  kvx_grant *g;
  int slot;
  void *ev;
  uint64_t bytes;
  struct kvx_h2d *prev, *next;
} kvx_h2d;

/* A UCX operation in flight (kvx_ucx.c completes it). */
enum { OP_AM, OP_PUT, OP_FLUSH, OP_CLOSE };
enum { FL_CHUNK, FL_FINAL, FL_STOP };

typedef struct kvx_op {
  int kind, flush;
  bool orphan;
  td_kvx *k;
  kvx_xfer *x;
  kvx_chunk *ch;
  td_kvx_peer *peer; /* data operations hold the peer (its memory keys) */
  kvx_ep_owner *own;     /* close operations free it */
  ucp_ep_h ep;       /* messages: where they were sent */
  void *req;
  void *buf;
  struct kvx_op *prev, *next;
} kvx_op;

/* A control message, queued by the UCX handler for td_kvx_progress. */
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
  bool ipc;                    /* CUDA IPC on: a GPU and not no_ipc */
  char dev_id[KVX_DEV_ID_LEN + 1]; /* the GPU's identity on this host */
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
  uint64_t nccl_chunk; /* largest NCCL chunk this context sends or receives */
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
  uint64_t *seen; /* receiver scratch: a bit a destination block while a request is checked, all clear between */
  size_t seen_bits;
};

/* td_kvx_opts.trace: when each protocol step of a transfer happened, kept
 * in memory (no I/O on the data path) and printed at destroy. Both sides
 * read CLOCK_MONOTONIC, so two processes on one host line up. */
typedef struct kvx_tr {
  int64_t ns;
  uint64_t xid, a;
  const char *ev;
} kvx_tr;
enum { KVX_TRACE_CAP = 1 << 16 };
static inline void kvx_trace(td_kvx *k, uint64_t xid, const char *ev, uint64_t a) {
  if (k->trace && k->n_trace < KVX_TRACE_CAP) k->trace[k->n_trace++] = (kvx_tr){td_now_ns(), xid, a, ev};
}

static inline void kvx_set_text(char *dst, const char *src) { snprintf(dst, KVX_TEXT, "%s", src ? src : ""); }

/* ---- kvx.c: the context, pools, peers (connect / release) ---- */
kvx_pool *kvx_find_pool(td_kvx *k, uint32_t id);
/* Frees a disconnected peer once no transfer or operation uses it. */
void kvx_peer_maybe_release(td_kvx_peer *p);

/* ---- kvx_ucx.c: UCX worker, operations, endpoints, messages ---- */
/* UCX context, worker, active-message handlers, wakeup fd and epoll set;
 * decides whether same-host peers get a data endpoint (k->local_ok). */
td_status kvx_ucx_open(td_kvx *k);
td_status kvx_ucx_map(td_kvx *k, void *base, size_t bytes, bool cuda, ucp_mem_h *memh);
kvx_op *kvx_op_new(td_kvx *k, int kind);
void kvx_op_free(kvx_op *op);
void kvx_op_issued(kvx_op *op, ucs_status_ptr_t r);
ucp_request_param_t kvx_op_param(kvx_op *op);
void kvx_xfer_op_error(kvx_xfer *x, ucs_status_t s, const char *what);
void kvx_orphan_ops(td_kvx *k, kvx_xfer *x);
void kvx_orphan_msgs(td_kvx *k, ucp_ep_h a, ucp_ep_h b);
void kvx_close_ep(td_kvx *k, ucp_ep_h ep, bool force, kvx_ep_owner *own);
td_status kvx_make_ep(td_kvx *k, const void *addr, bool peer_mode, kvx_ep_owner *own, ucp_ep_h *ep);
bool kvx_ep_has_rma(ucp_ep_h ep);
bool kvx_ep_am_is_shm(ucp_ep_h ep);
void kvx_msg_begin(td_kvx *k, kvx_wbuf *w, int type, uint64_t xid);
void kvx_r_text(kvx_rbuf *r, char *out);
/* Sends and frees w's bytes (eager active message). */
void kvx_send_msg(td_kvx *k, ucp_ep_h ep, kvx_wbuf *w);
void kvx_send_status(td_kvx *k, ucp_ep_h ep, int type, uint64_t xid, td_status s, const char *text);

/* ---- kvx_staging.c: pinned staging slots and their GPU copies ---- */
td_status kvx_ensure_staging(td_kvx *k);
td_status kvx_stage_d2h(kvx_xfer *x, kvx_chunk *c);
void kvx_handle_chunk(td_kvx *k, kvx_grant *g, kvx_rbuf *r);
int kvx_pump_h2d(td_kvx *k);

/* ---- kvx_nccl.c: NCCL streams, bounce slots, both pipelines ---- */
td_status kvx_bounce_ring(td_kvx *k, int side);
/* Grows the scratch lists k->sc_d / sc_s / sc_n to n entries. */
td_status kvx_scratch(td_kvx *k, size_t n);
kvx_nstream *kvx_nstream_new(uint64_t first, uint64_t max);
void kvx_nstream_drop_ops(td_kvx *k, kvx_nstream *ns, bool recv);
bool kvx_nstream_quiet(td_kvx *k, kvx_nstream *ns);
void kvx_nstream_free(td_kvx *k, kvx_nstream *ns, int side);
int kvx_pump_nccl_send(kvx_xfer *x);
int kvx_pump_nccl_recv(kvx_grant *g);
void kvx_peer_nccl_abort(td_kvx_peer *p, td_status s, const char *why, bool tell);
void kvx_rpeer_nccl_abort(kvx_rpeer *rp, td_status s, const char *why, bool tell);

/* ---- kvx_ipc.c: CUDA IPC into a same-host peer's GPU pools ---- */
/* Whether a transfer from src into the peer's pool dpi can go over CUDA
 * IPC, mapping the pool on first use; *why (KVX_TEXT) says why not. Says
 * once per peer in the log why IPC is off for it. */
bool kvx_ipc_usable(td_kvx_peer *p, const kvx_pool *src, int dpi, char *why);
int kvx_pump_ipc(kvx_xfer *x);
/* Unmaps the peer's pools: none of its transfers has a copy in flight. */
void kvx_ipc_unmap(td_kvx_peer *p);

/* ---- kvx_send.c: a posted transfer's life on the sender ---- */
void kvx_xfer_stop(kvx_xfer *x, td_status s, const char *msg, bool notify);
void kvx_xfer_finish(kvx_xfer *x, td_status s, const char *msg);
/* DONE to the receiver once every byte of the transfer is in place. */
void kvx_xfer_send_done(kvx_xfer *x);
int kvx_pump_xfers(td_kvx *k);
/* GRANT, DENY, CREDIT, ACK, REVOKE for one of our transfers. */
void kvx_sender_msg(kvx_xfer *x, unsigned type, uint64_t xid, kvx_rbuf *r);

/* ---- kvx_put.c: the UCX data path of a transfer ---- */
/* The next run of pieces of the plan: at most max_bytes and max_pieces. */
kvx_chunk *kvx_chunk_build(kvx_xfer *x, uint64_t max_bytes, int max_pieces);
int kvx_pump_ucx(kvx_xfer *x);
void kvx_flush_data(kvx_xfer *x, int kind, kvx_chunk *ch);
void kvx_chunk_free(kvx_xfer *x, kvx_chunk *ch);

/* ---- kvx_recv.c: the receiver's peers and grants ---- */
kvx_grant *kvx_find_grant(td_kvx *k, uint64_t uuid, uint64_t xid);
bool kvx_grant_covers(const kvx_grant *g, uint64_t off, uint64_t len);
void kvx_grant_end(kvx_grant *g, td_status s, const char *msg);
void kvx_grant_revoke(kvx_grant *g, td_status s, const char *msg);
bool kvx_grant_drained(kvx_grant *g);
void kvx_grant_finalize(kvx_grant *g);
void kvx_rpeer_fail(kvx_rpeer *rp, td_status s, const char *msg, bool event);
int kvx_pump_grants(td_kvx *k);
void kvx_handle_hello(td_kvx *k, uint64_t uuid, kvx_rbuf *r);
/* REQ, CHUNK, DONE, ABORT, NCCL_ID, BYE, NCCL_ABORT from a peer that said
 * HELLO. */
void kvx_receiver_msg(td_kvx *k, unsigned type, uint64_t uuid, uint64_t xid, kvx_rbuf *r);

/* ---- kvx_dispatch.c: progress, wakeups, failures, callbacks ---- */
int kvx_run_callbacks(td_kvx *k);

#endif
