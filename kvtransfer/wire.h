/* Internal: little-endian encoding with bounds checks, the descriptor
 * format and the protocol's message types. Not part of the public API
 * (tests include it to forge malformed bytes). */
#ifndef TD_KVTRANSFER_WIRE_H
#define TD_KVTRANSFER_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvtransfer/kvtransfer.h"

#define KVX_DESC_MAGIC 0x584b4454u /* "TDKX" */
#define KVX_MSG_MAGIC 0x4d4b4454u  /* "TDKM" */
#define KVX_MSG_VERSION 5 /* 2: NCCL chunking in REQ; 3: the layout's states tail; 4: REQ's sender token;
                            5: REQ's int8 K/V flag */
#define KVX_MAX_ADDR (64u << 10)
#define KVX_MAX_RKEY (16u << 10)
#define KVX_MAX_MSG_BLOCKS (1 << 20)

/* Descriptor capability bits. */
enum { KVX_CAP_NCCL = 1u << 0, KVX_CAP_CUDA_DIRECT = 1u << 1 };

typedef struct kvx_wbuf {
  uint8_t *p;
  size_t len, cap;
  bool oom;
} kvx_wbuf;

void kvx_w_bytes(kvx_wbuf *w, const void *b, size_t n);
void kvx_w_u8(kvx_wbuf *w, uint8_t v);
void kvx_w_u16(kvx_wbuf *w, uint16_t v);
void kvx_w_u32(kvx_wbuf *w, uint32_t v);
void kvx_w_u64(kvx_wbuf *w, uint64_t v);
void kvx_w_i32(kvx_wbuf *w, int32_t v);
/* n values at once (a transfer's block lists: thousands a message) */
void kvx_w_i32s(kvx_wbuf *w, const int32_t *v, size_t n);

typedef struct kvx_rbuf {
  const uint8_t *p;
  size_t len, pos;
  bool bad;
} kvx_rbuf;

const uint8_t *kvx_r_bytes(kvx_rbuf *r, size_t n);
uint8_t kvx_r_u8(kvx_rbuf *r);
uint16_t kvx_r_u16(kvx_rbuf *r);
uint32_t kvx_r_u32(kvx_rbuf *r);
uint64_t kvx_r_u64(kvx_rbuf *r);
int32_t kvx_r_i32(kvx_rbuf *r);
/* n values into out; false (and r->bad) when fewer remain */
bool kvx_r_i32s(kvx_rbuf *r, int32_t *out, size_t n);

uint32_t kvx_crc32(const void *p, size_t n);

#define KVX_IPC_HANDLE_LEN 64 /* cudaIpcMemHandle_t */
#define KVX_DEV_ID_LEN 63     /* the longest device identity (a PCI bus id or GPU UUID) */

typedef struct kvx_desc_pool {
  td_kvx_pool_info info; /* info.ipc: a handle follows */
  uint64_t base;
  const uint8_t *rkey; /* points into the decoded bytes */
  uint32_t rkey_len;
  uint64_t ipc_off;          /* the pool's offset in the exported allocation */
  const uint8_t *ipc_handle; /* KVX_IPC_HANDLE_LEN bytes, into the decoded bytes */
} kvx_desc_pool;

typedef struct kvx_desc {
  uint16_t version; /* encode: 0 writes TD_KVX_DESC_VERSION; 2 the layout without IPC, 3 without int8 */
  uint32_t caps;
  uint64_t uuid, host_id;
  uint32_t pid;
  uint64_t gpu_id; /* the context's GPU (PCI bus id hash), 0: none */
  const uint8_t *addr;
  uint32_t addr_len;
  bool staging;
  uint64_t stg_base, stg_slot_bytes;
  uint32_t stg_slots;
  const uint8_t *stg_rkey;
  uint32_t stg_rkey_len;
  bool ipc;                         /* version 3: GPU pools exported for CUDA IPC */
  char dev_id[KVX_DEV_ID_LEN + 1];  /* their device (printable, NUL-terminated) */
  int n_pools;
  kvx_desc_pool pools[TD_KVX_MAX_POOLS];
} kvx_desc;

/* *out is malloc'ed. */
td_status kvx_desc_encode(const kvx_desc *d, uint8_t **out, size_t *len);
/* Pointers in *d refer to bytes. */
td_status kvx_desc_decode(const void *bytes, size_t len, kvx_desc *d);

/* ---- byte-stream chunking (pure functions, plan.c) ---- */

/* NCCL moves a transfer's byte stream (the plan's pieces in order) in
 * chunks; both sides must cut it identically, since every send must match a
 * receive of the same size. The sender picks (first, max) and sends them in
 * REQ; both then call kvx_chunk_len with the same arguments. Chunk i is
 * min(max, first << i) bytes, the last one what is left, and a remainder
 * smaller than first joins the chunk before it where that stays within max.
 * done: bytes of the chunks before this one. 0 once done == total. */
#define KVX_NCCL_MAX_CHUNK ((uint64_t)64 << 20)
uint64_t kvx_chunk_len(uint64_t total, uint64_t first, uint64_t max, uint64_t index, uint64_t done);
/* Whether (first, max) is acceptable from a peer: 0 < first <= max <=
 * KVX_NCCL_MAX_CHUNK. */
bool kvx_chunking_valid(uint64_t first, uint64_t max);
/* Pieces covering the next len bytes of a plan's byte stream from the
 * cursor (item *ci, offset *coff in it): kvx_plan_count counts them,
 * kvx_plan_take writes them to out (offsets as in items) and advances the
 * cursor. Stops early at the end of the plan. */
int kvx_plan_count(const td_kvx_slice *items, int n_items, int ci, uint64_t coff, uint64_t len);
int kvx_plan_take(const td_kvx_slice *items, int n_items, int *ci, uint64_t *coff, uint64_t len, td_kvx_slice *out);
/* Whether pieces are contiguous on the source (src true) or destination
 * side, so that side needs no bounce buffer. */
bool kvx_pieces_contiguous(const td_kvx_slice *pc, int n, bool src);
/* Staged UCX: the size limit of the next chunk, given the bytes issued so
 * far, the transfer's total, the slot size and the steady chunk size.
 * Chunks start at 256 KiB and double up to the steady size (the receiver
 * starts copying out sooner), stay there, and shrink again towards the end
 * (the last chunk's host-to-device copy is not overlapped with anything).
 * A steady size well below the slot keeps the receiver's copies in step
 * with the sender's: device-to-host copies complete in order, so one large
 * chunk holds back every copy-out behind it. */
uint64_t kvx_stage_chunk_cap(uint64_t issued, uint64_t total, uint64_t slot, uint64_t steady);

/* How a transfer's data moves (REQ's mode byte). */
enum { KVX_MODE_PUT = 1, KVX_MODE_AM = 2, KVX_MODE_NCCL = 3, KVX_MODE_IPC = 4 };

/* Message types (one UCX active message id, type in the header). */
enum {
  KVX_MSG_HELLO = 1, /* connector -> peer: its worker address */
  KVX_MSG_REQ,       /* sender -> receiver: may I write these blocks? */
  KVX_MSG_GRANT,     /* receiver -> sender: yes (+ staging slots / NCCL seq) */
  KVX_MSG_DENY,      /* receiver -> sender: no, with status and reason */
  KVX_MSG_CHUNK,     /* sender -> receiver: a staging slot holds these pieces */
  KVX_MSG_CREDIT,    /* receiver -> sender: staging slot free again */
  KVX_MSG_DONE,      /* sender -> receiver: all puts are remotely complete */
  KVX_MSG_ACK,       /* receiver -> sender: the transfer's verdict */
  KVX_MSG_ABORT,     /* sender -> receiver: stopped; nothing more will be written */
  KVX_MSG_REVOKE,    /* receiver -> sender: stop (timeout, bad data, failure) */
  KVX_MSG_NCCL_ID,   /* sender -> receiver: NCCL unique id of a pair communicator */
  KVX_MSG_BYE,       /* connector -> peer: disconnecting */
  KVX_MSG_NCCL_ABORT, /* either way: the pair's NCCL communicator was aborted */
  KVX_MSG_TYPES
};

#endif
