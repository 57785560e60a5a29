/* Internal: the CUDA runtime and NCCL calls of kvtransfer, so that the
 * kvx_*.c files build without CUDA (gpu_stub.c answers TD_ERR_UNSUPPORTED;
 * the tests' gpu_fake.c stands in on the CPU). */
#ifndef TD_KVTRANSFER_GPU_H
#define TD_KVTRANSFER_GPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "kvtransfer/kvtransfer.h"
#include "kvtransfer/wire.h" /* KVX_IPC_HANDLE_LEN, KVX_DEV_ID_LEN: as the descriptor carries them */

#define KVX_NCCL_ID_BYTES 128

bool kvx_gpu_compiled(void);
bool kvx_nccl_compiled(void);

/* One per transfer context: the device and its streams, so that staging
 * directions, NCCL sends, NCCL receives and the NCCL path's gather and
 * scatter overlap. */
typedef struct kvx_gpu kvx_gpu;
enum {
  KVX_S_D2H = 0,
  KVX_S_H2D,
  KVX_S_NCCL,    /* sends (sender communicators) */
  KVX_S_NCCL_RX, /* receives: a stalled send never blocks them */
  KVX_S_GATHER,
  KVX_S_SCATTER,
  KVX_S_IPC, /* device-to-device copies into a peer's mapped pool */
  KVX_S_COUNT
};

td_status kvx_gpu_create(int device, kvx_gpu **out);
/* Identifies the device on its host (hash of the PCI bus id); 0 for NULL. */
uint64_t kvx_gpu_uid(kvx_gpu *g);
void kvx_gpu_destroy(kvx_gpu *g);
td_status kvx_gpu_host_alloc(kvx_gpu *g, size_t bytes, void **out);
void kvx_gpu_host_free(kvx_gpu *g, void *p);
/* Pins existing host memory for asynchronous copies (cudaHostRegister). */
td_status kvx_gpu_host_register(kvx_gpu *g, void *p, size_t bytes);
void kvx_gpu_host_unregister(kvx_gpu *g, void *p);
/* Whether [p, p + bytes) is device memory of the context's device. */
td_status kvx_gpu_check_device_ptr(kvx_gpu *g, const void *p, size_t bytes);
/* Asynchronous copy on a stream (its direction decides the copy kind;
 * KVX_S_IPC: device to device, also into a peer's mapped memory). */
td_status kvx_gpu_copy(kvx_gpu *g, int stream, void *dst, const void *src, size_t bytes);
/* n asynchronous copies on a stream, contiguous neighbours merged, issued
 * as one batch where the runtime has cudaMemcpyBatchAsync. */
td_status kvx_gpu_copy_many(kvx_gpu *g, int stream, void **dsts, const void **srcs, size_t *sizes, size_t n);
/* n device-to-device copies on a stream, contiguous neighbours merged, by
 * the gather kernel (gather.h): one launch per KVX_GATHER_PIECES pieces,
 * any sizes and alignments. The caller's arrays are scratch. */
td_status kvx_gpu_copy_d2d(kvx_gpu *g, int stream, void **dsts, const void **srcs, size_t *sizes, size_t n);
/* Device memory of the context's device (the NCCL bounce slots). */
td_status kvx_gpu_dev_alloc(kvx_gpu *g, size_t bytes, void **out);
void kvx_gpu_dev_free(kvx_gpu *g, void *p);
/* Synchronous host-to-device copy from pageable memory. */
td_status kvx_gpu_copy_sync(kvx_gpu *g, void *dst, const void *src, size_t bytes);
/* Makes a stream wait for an application event (cudaEvent_t). */
td_status kvx_gpu_wait(kvx_gpu *g, int stream, void *event);
/* Records a pooled event on a stream. */
td_status kvx_gpu_record(kvx_gpu *g, int stream, void **event);
/* 1: done, 0: pending, -1: failed (td_err set). */
int kvx_gpu_query(kvx_gpu *g, void *event);
/* Waits until the work queued on a stream so far has run: copies whose
 * event could not be recorded. */
void kvx_gpu_sync(kvx_gpu *g, int stream);
void kvx_gpu_release(kvx_gpu *g, void *event);

/* CUDA IPC between processes of one host (docs/kvtransfer.md, "CUDA IPC").
 * The device's identity on its host (its PCI bus id), as peers name it. */
td_status kvx_gpu_dev_id(kvx_gpu *g, char out[KVX_DEV_ID_LEN + 1]);
/* Exports the allocation holding [p, p + bytes): its handle and p's offset
 * in it. TD_ERR_UNSUPPORTED for memory that cannot be shared. */
td_status kvx_gpu_ipc_export(kvx_gpu *g, void *p, size_t bytes, uint8_t handle[KVX_IPC_HANDLE_LEN],
                             uint64_t *offset);
/* TD_OK when this context's device may copy into memory of the device a
 * peer named (kvx_gpu_dev_id), else why not. */
td_status kvx_gpu_ipc_reach(kvx_gpu *g, const char *dev_id);
/* Maps a peer's exported allocation for this context's device: *base is
 * its start, *size its length (0: unknown). A handle opened twice in one
 * process, or exported by this process, maps once. */
td_status kvx_gpu_ipc_open(kvx_gpu *g, const uint8_t handle[KVX_IPC_HANDLE_LEN], void **base, size_t *size);
/* Unmaps it. No copy into it may be in flight: the caller waited for
 * their events (CUDA also synchronises the IPC stream first, for copies
 * whose event could not be recorded). */
void kvx_gpu_ipc_close(kvx_gpu *g, void *base);

/* A two-rank NCCL communicator, created without blocking. */
typedef struct kvx_nccl kvx_nccl;
typedef struct kvx_nccl_op kvx_nccl_op;
td_status kvx_nccl_unique_id(uint8_t id[KVX_NCCL_ID_BYTES]);
td_status kvx_nccl_create(kvx_gpu *g, const uint8_t id[KVX_NCCL_ID_BYTES], int rank, kvx_nccl **out);
/* 1: ready, 0: still initialising or enqueuing, -1: failed (td_err set). */
int kvx_nccl_poll(kvx_nccl *c);
/* Whether it is initialised (groups may still be being launched). */
bool kvx_nccl_ready(kvx_nccl *c);
/* Whether a new group may be posted (no launch in progress). */
bool kvx_nccl_idle(kvx_nccl *c);
/* One buffer of a group: bytes at buf, moved after the stream waited for
 * wait (a kvx_gpu_record event, e.g. the gather into buf; may be NULL). */
typedef struct kvx_nccl_buf {
  void *buf;
  size_t bytes;
  void *wait;
} kvx_nccl_buf;
/* One group of n sends (or receives) to / from the other rank, in order,
 * on the NCCL send (receive) stream. A non-blocking communicator launches
 * every group from a new thread (tens of microseconds), and nothing else
 * may be posted meanwhile: buffers ready together go in one group. */
td_status kvx_nccl_post(kvx_nccl *c, bool send, const kvx_nccl_buf *b, int n, kvx_nccl_op **op);
/* 1: done, 0: pending, -1: failed. */
int kvx_nccl_op_poll(kvx_nccl_op *op);
void kvx_nccl_op_free(kvx_nccl_op *op);
/* Aborts whatever runs on it and frees it (never blocks on the peer).
 * Free its ops first. */
void kvx_nccl_abort(kvx_nccl *c);

#endif
