/* KV transports: how a worker's finished KV blocks reach blocks that
 * another worker reserved, behind one interface (a const table of
 * function pointers per implementation, as kernels/backend_impl.h):
 *   td_kvt_ucx: over td_kvx (UCX puts straight between the registered
 *               pools; staged GPU pools; NCCL between GPUs);
 *   td_kvt_zmq: over ZeroMQ, from host copies of the blocks (the fallback:
 *               groups, mixed element types, no UCX).
 * The owner gives every transport the same hook set, asks each whether it
 * reaches a peer (route) and pushes over the one it picked. What travels
 * on the wire is each transport's own (KvPush / KvAck frames for ZeroMQ,
 * td_kvx's protocol for UCX; docs/architecture.md).
 *
 * Not thread-safe: the owner's thread only (the worker's main thread).
 * Hooks run inside td_kvt_progress, the loop's handlers and td_kvt_forget. */
#ifndef TD_KVTRANSFER_TRANSPORT_H
#define TD_KVTRANSFER_TRANSPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/evloop.h"
#include "common/settings.h"
#include "common/status.h"
#include "proto/auth.h"
#include "kernels/ops.h"

typedef struct td_kvt td_kvt;

/* Which slot of a worker's transfer descriptor (TransferDesc) a
 * transport's own descriptor goes in. */
typedef enum td_kvt_kind { TD_KVT_UCX = 0, TD_KVT_ZMQ = 1, TD_KVT_KINDS } td_kvt_kind;

/* A push as its sender offers it, before a byte is written. */
typedef struct td_kvt_offer {
  uint64_t rid, reservation;
  bool cross;
  const int32_t *blocks;
  int n;
  size_t block_bytes;     /* the bytes the sender writes into each block, as its push announced them */
  const uint8_t *token;   /* the reservation's sender token the push carries (TD_KV_TOKEN_BYTES); NULL: none */
  const char *sender_key; /* the sender's CURVE public key as the handshake proved it (Z85); NULL: unknown */
} td_kvt_offer;

/* What the owner answers and hears: one set for every transport. */
typedef struct td_kvt_hooks {
  /* receiver: whether the offered blocks may be written now (the
   * reservation open, unexpired, every block in it, and the push from the
   * sender the reservation names). *why: not. */
  bool (*accept)(void *ctx, const td_kvt_offer *o, char *why, size_t cap);
  /* receiver, transports that bring bytes (host_copy): data[i] holds block
   * blocks[i]; the owner writes them into its pools */
  void (*deliver)(void *ctx, bool cross, const int32_t *blocks, int n, const void *const *data, size_t block_bytes);
  /* receiver: blocks[0..n) of the reservation are in place */
  void (*arrived)(void *ctx, const td_kvt *t, uint64_t rid, uint64_t reservation, bool cross, const int32_t *blocks,
                  int n);
  /* sender: a push of n blocks ended: ok, or the error */
  void (*pushed)(void *ctx, const td_kvt *t, uint64_t rid, int tag, int n, bool ok, const char *error);
  /* sender: blocks taken by td_kvt_forget are no longer read (the array is the callee's) */
  void (*release)(void *ctx, bool cross, int32_t *blocks, int n);
  void *ctx;
} td_kvt_hooks;

/* A pool a transport may read and write (the engine's, owned elsewhere). */
typedef struct td_kvt_pool {
  td_kv_layout layout; /* the whole decoder's (single-rank workers): with the states tail per --cross-mode */
  void *base;
  int n_blocks;
  size_t block_bytes; /* the pool's own: what the layout must give */
} td_kvt_pool;

/* Everything any transport is created from; each reads its part. */
typedef struct td_kvt_opts {
  const char *name;        /* for logs (the worker id) */
  const char *listen_host; /* zmq: the address this endpoint binds (a wildcard with advertise) */
  const char *advertise;   /* the address peers reach this worker at (NULL: listen_host); ucx: its interface */
  int timeout_ms;          /* a push with no answer fails */
  /* zmq: the largest block a peer may send here and this side sends (the
   * model's whole-decoder block bytes); a larger frame drops the peer's
   * connection before it is buffered. 0: TD_KV_DEFAULT_MAX_FRAME_BYTES */
  size_t max_block_bytes;
  /* ucx: the pools it registers */
  bool cuda;     /* pools in GPU memory of `device` (else host memory) */
  int device;
  int elem_size; /* bytes of a KV element (float32 on the CPU, bf16 on CUDA) */
  td_kvt_pool cross, self;
  td_kvx_tuning kvx; /* from the settings main read */
  /* zmq: CURVE keys (NULL: plain). The endpoint is a CURVE server admitting
   * the worker list (its ZAP domain TD_AUTH_DOMAIN_KV); its descriptor
   * carries its public key, pushes connect as CURVE clients. */
  const td_auth *auth;
} td_kvt_opts;

/* One push of n blocks into the peer's reserved blocks. */
typedef struct td_kvt_push {
  uint64_t rid;
  int tag;                   /* the owner's: `pushed` reports it back */
  const char *peer_id;
  const uint8_t *peer_desc;  /* the peer's descriptor for this transport */
  size_t peer_desc_len;
  uint64_t reservation;
  const uint8_t *token;      /* the reservation's sender token (TD_KV_TOKEN_BYTES) the receiver checks; NULL: none */
  bool cross;
  const int32_t *dst;        /* the reserved blocks */
  int n;
  const int32_t *src_blocks; /* transports that read the pools: this worker's blocks, read until `pushed` */
  const uint8_t *src_host;   /* host_copy transports: n blocks of block_bytes, copied at once */
  size_t block_bytes;
} td_kvt_push;

/* An implementation: ggml_backend_i's shape. t->ctx is the implementation's. */
typedef struct td_kvt_i {
  const char *name; /* "ucx", "zmq" */
  td_kvt_kind kind;
  bool host_copy;   /* pushes take the blocks' bytes in host memory (else they read the pools) */
  td_status (*create)(td_kvt *t, const td_kvt_opts *o);
  void (*destroy)(td_kvt *t);
  const uint8_t *(*desc)(const td_kvt *t, size_t *len);
  bool (*route)(td_kvt *t, const char *peer_id, const uint8_t *desc, size_t len, bool cross, char *why, size_t cap);
  td_status (*push)(td_kvt *t, const td_kvt_push *p);
  bool (*forget)(td_kvt *t, uint64_t rid, int tag, bool cross, int32_t *blocks, int n);
  bool (*busy)(const td_kvt *t, uint64_t reservation);
  int (*pending)(const td_kvt *t);
  td_status (*watch)(td_kvt *t, td_loop *l);
  bool (*arm)(td_kvt *t);
  void (*progress)(td_kvt *t);
  uint64_t (*ipc_blocks)(const td_kvt *t); /* of its pushed blocks, those over CUDA IPC; NULL: none */
} td_kvt_i;

struct td_kvt {
  const td_kvt_i *iface;
  td_kvt_hooks hooks;
  void *ctx;
};

extern const td_kvt_i td_kvt_ucx;
extern const td_kvt_i td_kvt_zmq;

/* Creates a transport of implementation `impl`; the hooks are copied. */
td_status td_kvt_create(const td_kvt_i *impl, const td_kvt_opts *o, const td_kvt_hooks *hooks, td_kvt **out);
/* Cancels what still moves (no hook fires); before the pools are freed. */
void td_kvt_destroy(td_kvt *t);
const char *td_kvt_name(const td_kvt *t);
td_kvt_kind td_kvt_get_kind(const td_kvt *t);
bool td_kvt_host_copy(const td_kvt *t);
/* This transport's descriptor: what peers need to push here. */
const uint8_t *td_kvt_desc(const td_kvt *t, size_t *len);
/* Whether blocks reach the peer with this descriptor (connects when it
 * must); *why says why not. */
bool td_kvt_route(td_kvt *t, const char *peer_id, const uint8_t *desc, size_t len, bool cross, char *why, size_t cap);
/* Starts a push; `pushed` reports how it ended. */
td_status td_kvt_push_blocks(td_kvt *t, const td_kvt_push *p);
/* Cancels the pushes of (rid, tag): their hooks never fire. When some
 * still read the source blocks and blocks is set, takes the array and
 * hands it to `release` once nothing reads them; returns whether it took it. */
bool td_kvt_forget(td_kvt *t, uint64_t rid, int tag, bool cross, int32_t *blocks, int n);
/* Whether a granted transfer still writes into the reservation's blocks. */
bool td_kvt_busy(const td_kvt *t, uint64_t reservation);
/* Pushes waiting for their answer. */
int td_kvt_pending(const td_kvt *t);
/* Registers the transport's descriptors and sockets with the loop (it
 * adds and removes its own as peers come and go); NULL detaches. */
td_status td_kvt_watch(td_kvt *t, td_loop *l);
/* Last before sleeping: false when work is pending that signals no
 * descriptor (GPU copies): do not sleep. */
bool td_kvt_arm(td_kvt *t);
/* Receives, completes and times out what it can, without blocking. */
void td_kvt_progress(td_kvt *t);
/* Blocks it pushed over CUDA IPC (td_kvt_ucx between GPU pools of one
 * host), counted among its pushed blocks too. */
uint64_t td_kvt_ipc_blocks(const td_kvt *t);

#endif
