/* KV transfer: moves paged KV blocks from an encoder / prefill worker (the
 * sender) into blocks that a decode worker reserved (the receiver), over UCX
 * (one-sided puts into registered pools; GPU pools staged through pinned
 * host buffers when the UCX build has no CUDA support), CUDA IPC (GPU pools
 * of one host: device-to-device copies into the receiver's mapped pool) or
 * NCCL (GPU to GPU send/recv on a per-pair communicator).
 *
 * Protocol (docs/kvtransfer.md): the sender asks (REQ), the receiver checks
 * the reservation through the application's authorize callback and grants
 * (GRANT) or refuses (DENY); only then does data move. Granted blocks stay
 * pinned (td_kvx_reservation_busy) until the transfer completes, fails, is
 * cancelled or the sender dies; every grant ends with exactly one recv event.
 *
 * A td_kvx is one transfer context (a UCX worker, its pools and peers).
 * Not thread-safe: one owner thread per context. Callbacks run only inside
 * td_kvx_progress, td_kvx_disconnect and td_kvx_destroy; they may post and
 * cancel but must not destroy the context. */
#ifndef TD_KVTRANSFER_KVTRANSFER_H
#define TD_KVTRANSFER_KVTRANSFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/defaults.h"
#include "common/status.h"
#include "kernels/ops.h"

typedef struct td_kvx td_kvx;
typedef struct td_kvx_peer td_kvx_peer;

#define TD_KVX_MAX_POOLS 16
#define TD_KVX_DESC_VERSION 4 /* 2: the layout's states tail; 3: CUDA IPC handles; 4: int8 K/V layouts (2 and 3 are
                                 still read) */

typedef enum td_kvx_mem { TD_KVX_MEM_HOST = 0, TD_KVX_MEM_CUDA = 1 } td_kvx_mem;
/* AUTO: CUDA IPC for GPU to GPU on one host where both sides can, else
 * NCCL between two GPUs, else UCX (docs/kvtransfer.md, "Data paths"). */
typedef enum td_kvx_transport { TD_KVX_AUTO = 0, TD_KVX_UCX = 1, TD_KVX_NCCL = 2, TD_KVX_IPC = 3 } td_kvx_transport;

/* ---- geometry and re-slicing (pure functions) ---- */

/* Where a rank's blocks sit in the model: the layout of its blocks
 * ([layer][K|V][head][slot][head_dim], layout.n_layers == layer1 - layer0,
 * layout.n_heads == head1 - head0, then the states tail, which every rank
 * holds whole) and the element size in bytes. */
typedef struct td_kvx_geom {
  td_kv_layout layout;
  int elem_size;      /* 4: CPU float32, 2: CUDA bf16 */
  int layer0, layer1; /* [layer0, layer1) of the model's decoder layers */
  int head0, head1;   /* [head0, head1) of the model's KV heads */
} td_kvx_geom;

/* A byte range copied from a source block to a destination block. */
typedef struct td_kvx_slice {
  uint64_t src_off, dst_off, len;
} td_kvx_slice;

/* Bytes of one block; 0 when g is not a valid geometry. */
size_t td_kvx_block_bytes(const td_kvx_geom *g);
td_status td_kvx_geom_check(const td_kvx_geom *g);
/* The byte ranges of a src block that belong in a dst block: for every
 * layer and head both hold, the [slot][head_dim] sub-slabs, and the states
 * tail, merged where contiguous on both sides (one slice when both hold the
 * same ranges). *n = 0 when they share nothing. block_size, head_dim,
 * states and elem_size must match. At most cap slices; TD_ERR_INVALID when
 * more are needed. */
td_status td_kvx_slice_plan(const td_kvx_geom *src, const td_kvx_geom *dst, td_kvx_slice *out, int cap, int *n);
/* Expands a slice plan over block pairs into pool byte offsets
 * (block * block_bytes + slice offset), merging runs contiguous on both
 * sides (contiguous block runs become one copy). *out is malloc'ed. */
td_status td_kvx_plan_copies(const td_kvx_geom *src, const td_kvx_geom *dst, const int32_t *src_blocks,
                             const int32_t *dst_blocks, int n_blocks, td_kvx_slice **out, int *n);
/* The bytes td_kvx_plan_copies moves for n_blocks block pairs (the same
 * slices every block), without the per-block plan. */
td_status td_kvx_plan_bytes(const td_kvx_geom *src, const td_kvx_geom *dst, int n_blocks, uint64_t *bytes);

/* ---- the transfer context ---- */

/* Receiver side: may the peer write request_id's data into these reserved
 * blocks? Return TD_OK to grant (the blocks must stay untouched until the
 * matching recv event; e.g. td_kv_reservation_valid and td_kv_ref), or an
 * error with td_err's message: it is sent back to the sender. */
typedef struct td_kvx_grant_req {
  uint64_t peer_uuid, request_id, reservation_id;
  uint32_t pool_id;
  const int32_t *blocks;
  int n_blocks;
  uint64_t bytes;
  const uint8_t *token; /* the sender's td_kvx_xfer.token (TD_KV_TOKEN_BYTES); NULL: it sent zeros (none) */
} td_kvx_grant_req;
typedef td_status (*td_kvx_authorize_fn)(void *ctx, const td_kvx_grant_req *r);

/* Receiver side: the end of a granted transfer (exactly once per grant);
 * from now on nothing writes into the blocks. */
typedef struct td_kvx_recv_event {
  td_status status; /* TD_OK: all bytes arrived; else why it ended */
  const char *message;
  uint64_t peer_uuid, request_id, reservation_id;
  uint32_t pool_id;
  const int32_t *blocks;
  int n_blocks;
  uint64_t bytes; /* bytes written into the blocks */
} td_kvx_recv_event;
typedef void (*td_kvx_recv_fn)(void *ctx, const td_kvx_recv_event *ev);

/* A peer failed or vanished: peer is the handle from td_kvx_connect (still
 * to be disconnected), or NULL for a peer that connected to us. */
typedef void (*td_kvx_peer_fn)(void *ctx, td_kvx_peer *peer, uint64_t peer_uuid, td_status status, const char *msg);

/* Sender side: the end of a posted transfer. After it the source blocks
 * are no longer read. */
typedef void (*td_kvx_done_fn)(void *arg, uint64_t xfer_id, td_status status, const char *msg);

typedef enum td_kvx_local_path {
  TD_KVX_LOCAL_AUTO = 0, /* on where shared memory can be had (ucx_tls, ptrace scope) */
  TD_KVX_LOCAL_ON,
  TD_KVX_LOCAL_OFF,
} td_kvx_local_path;

/* How CUDA IPC copies into a peer's pool: the copy engines (one batched
 * memcpy of a chunk's pieces) move large pieces at the link's rate without
 * taking SMs; small scattered pieces cost the engines microseconds each, and
 * the gather kernel moves them at the link's rate instead. */
typedef enum td_kvx_ipc_copy {
  TD_KVX_IPC_COPY_AUTO = 0, /* the kernel on one GPU, and between GPUs for pieces under TD_DEFAULT_KVX_IPC_KERNEL_BELOW */
  TD_KVX_IPC_COPY_KERNEL,
  TD_KVX_IPC_COPY_ENGINES,
} td_kvx_ipc_copy;

typedef struct td_kvx_opts {
  const char *name;          /* for logs */
  int cuda_device;           /* device of the GPU pools; -1: no GPU */
  /* Zero fields take the TD_DEFAULT_KVX_* values of common/defaults.h;
   * how they were chosen: docs/kvtransfer.md. */
  int timeout_ms;            /* default per-transfer timeout */
  int staging_slots;         /* pinned staging buffers per side */
  size_t staging_slot_bytes;
  /* Staged chunks grow from 256 KiB to this size and shrink again at the
   * end of a transfer. */
  size_t staging_chunk_bytes;
  bool force_staged;         /* stage GPU pools even if UCX supports CUDA */
  /* No CUDA IPC: GPU pools export no handle and transfers never map a
   * peer's pool (TANDEM_KVX_IPC=off). */
  bool no_ipc;
  td_kvx_ipc_copy ipc_copy;
  /* CUDA IPC: pieces a chunk copies, each chunk one gather launch whose
   * piece table is its kernel parameter (0: KVX_IPC_PIECES, 1,000 = 24 KiB
   * of parameters; at least 16). For measuring what a launch's table costs
   * against how many launches a transfer takes (bench_kv_transfer
   * --ipc-pieces). */
  int ipc_chunk_pieces;
  /* NCCL: the largest chunk of a transfer's byte stream (the pipeline's
   * step; 6 device bounce slots of this size per direction). */
  size_t nccl_chunk_bytes;
  /* Same-host peers: puts on a second endpoint without UCX error handling,
   * so UCX may pick shared memory / CMA (UCX 1.13 offers only tcp and
   * RDMA with peer-failure handling); failures still surface through the
   * control endpoint. */
  td_kvx_local_path local_path;
  /* UCX_TLS as UCX reads it (NULL or "": unset): a list without a
   * shared-memory transport leaves the local path nothing to gain. */
  const char *ucx_tls;
  /* The address peers reach this worker at (it advertises it): UCX's
   * network transports use only the interface that carries it (NULL, a host
   * name, a loopback or wildcard address: UCX's choice), unless
   * UCX_NET_DEVICES names devices. A numeric address no interface here
   * carries (NAT) is refused: UCX would advertise this host's own ones. */
  const char *bind_addr;
  const char *ucx_net_devices; /* UCX_NET_DEVICES as UCX will read it (NULL or "": unset) */
  bool trace; /* keep a per-transfer event trace, printed at destroy */
  td_kvx_authorize_fn authorize; /* NULL: refuse every transfer */
  td_kvx_recv_fn on_recv;
  td_kvx_peer_fn on_peer;
  void *ctx;
} td_kvx_opts;

td_status td_kvx_create(const td_kvx_opts *opts, td_kvx **out);
/* Cancels everything (callbacks fire with TD_ERR_CANCELLED), closes the
 * peers and frees the context. */
void td_kvx_destroy(td_kvx *k);
uint64_t td_kvx_uuid(const td_kvx *k);
/* Whether this context moves GPU pools directly through UCX (the UCX build
 * reports CUDA memory and force_staged is off) rather than staged. */
bool td_kvx_cuda_direct(const td_kvx *k);
bool td_kvx_nccl_available(const td_kvx *k);

/* A local pool: base pointer, block count and geometry. Register before
 * td_kvx_export; the memory must outlive the registration. */
typedef struct td_kvx_pool_desc {
  uint32_t pool_id; /* chosen by the application, unique per context */
  td_kvx_mem mem;
  void *base;
  int n_blocks;
  td_kvx_geom geom;
} td_kvx_pool_desc;
td_status td_kvx_register_pool(td_kvx *k, const td_kvx_pool_desc *d);
/* TD_ERR_INVALID while transfers use the pool. */
td_status td_kvx_unregister_pool(td_kvx *k, uint32_t pool_id);

/* The context's descriptor: transport address, memory keys and pool
 * geometry, as bytes for the control plane. *bytes is malloc'ed. */
td_status td_kvx_export(td_kvx *k, uint8_t **bytes, size_t *len);

typedef struct td_kvx_pool_info {
  uint32_t pool_id;
  td_kvx_mem mem;
  bool direct; /* remote puts land in the pool itself (else staged) */
  int n_blocks;
  td_kvx_geom geom;
  bool ipc; /* a GPU pool that same-host peers may map (CUDA IPC) */
} td_kvx_pool_info;
typedef struct td_kvx_desc_info {
  uint16_t version;
  uint64_t uuid;
  bool staging; /* has staging buffers for GPU pools */
  bool nccl;    /* can receive over NCCL */
  bool ipc;     /* exports CUDA IPC handles of its GPU pools */
  int n_pools;
  td_kvx_pool_info pools[TD_KVX_MAX_POOLS];
} td_kvx_desc_info;
/* Validates descriptor bytes (TD_ERR_FORMAT, TD_ERR_VERSION) and reports
 * what the peer holds, e.g. to pick the receiver ranks of a block. */
td_status td_kvx_desc_parse(const void *bytes, size_t len, td_kvx_desc_info *out);

/* Connects to the context that exported the descriptor. Failures of the
 * link surface later as a peer event. */
td_status td_kvx_connect(td_kvx *k, const void *bytes, size_t len, td_kvx_peer **out);
/* Cancels the peer's transfers (their callbacks fire with
 * TD_ERR_CANCELLED once their copies stopped) and releases the handle. */
void td_kvx_disconnect(td_kvx_peer *p);
/* TD_OK while usable, else why not (TD_ERR_PEER ...). */
td_status td_kvx_peer_status(const td_kvx_peer *p);
uint64_t td_kvx_peer_uuid(const td_kvx_peer *p);
const td_kvx_desc_info *td_kvx_peer_info(const td_kvx_peer *p);

/* A batch of block copies for one request. The receiver pool's geometry
 * may differ from the source's (other layer / head ranges): only what the
 * receiver holds is sent. */
typedef struct td_kvx_xfer {
  uint64_t request_id;
  uint64_t reservation_id;   /* the receiver's reservation */
  uint32_t src_pool;         /* local pool id */
  uint32_t dst_pool;         /* the peer's pool id */
  const int32_t *src_blocks; /* n_blocks source blocks, copied; */
  const int32_t *dst_blocks; /* the reserved destination of each */
  int n_blocks;
  int timeout_ms;             /* 0: the context's default */
  td_kvx_transport transport; /* AUTO: IPC, then NCCL for GPU to GPU where both have it */
  void *cuda_ready_event;     /* optional cudaEvent_t the copies wait for */
  /* the receiver's proof that this sender may write the reservation (the
   * application's; it travels in REQ to authorize; zeros: none) */
  uint8_t token[TD_KV_TOKEN_BYTES];
} td_kvx_xfer;
/* Posts a transfer; cb fires once from td_kvx_progress. */
td_status td_kvx_post(td_kvx_peer *p, const td_kvx_xfer *x, td_kvx_done_fn cb, void *arg, uint64_t *xfer_id);
/* Stops a transfer: its callback fires with TD_ERR_CANCELLED once no copy
 * is in flight. TD_ERR_NOT_FOUND when it already ended. */
td_status td_kvx_cancel(td_kvx *k, uint64_t xfer_id);

/* Makes progress without blocking; returns how much work was done (0 when
 * idle). */
int td_kvx_progress(td_kvx *k);
/* A file descriptor that turns readable when td_kvx_progress has work. */
int td_kvx_fd(const td_kvx *k);
/* Prepares to sleep on td_kvx_fd: false when there is work to do now
 * (call td_kvx_progress again instead of sleeping). */
bool td_kvx_arm(td_kvx *k);
/* Progress, arm and poll for at most timeout_ms. */
void td_kvx_wait(td_kvx *k, int timeout_ms);

/* Whether a granted transfer still writes into the reservation's blocks. */
bool td_kvx_reservation_busy(const td_kvx *k, uint64_t reservation_id);

typedef struct td_kvx_stats {
  int peers;       /* connected by us, including failed ones */
  int rpeers;      /* connected to us */
  int xfers;       /* posted, not ended */
  int grants;      /* granted, not ended */
  int ops;         /* UCX / CUDA operations in flight (IPC chunks included) */
  int ipc_chunks;  /* chunks of CUDA IPC copies in flight */
  int orphan_ops;  /* of failed peers, never completed */
  uint64_t bytes_sent, bytes_received;
  uint64_t xfers_ok, xfers_failed, grants_ok, grants_failed;
  uint64_t nccl_xfers; /* posted over NCCL */
  uint64_t ipc_xfers;  /* posted over CUDA IPC */
  uint64_t ipc_blocks; /* blocks of CUDA IPC transfers that ended well */
  bool local_path; /* some peer uses the same-host data endpoint */
} td_kvx_stats;
td_kvx_stats td_kvx_get_stats(const td_kvx *k);

#endif
