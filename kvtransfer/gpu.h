/* Internal: the CUDA runtime and NCCL calls of the transfer engine, so that
 * engine.c builds without CUDA (gpu_stub.c answers TD_ERR_UNSUPPORTED). */
#ifndef TD_KVTRANSFER_GPU_H
#define TD_KVTRANSFER_GPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "kvtransfer/kvtransfer.h"

#define KVX_NCCL_ID_BYTES 128

bool kvx_gpu_compiled(void);
bool kvx_nccl_compiled(void);

/* One per engine: the device and three streams (device-to-host,
 * host-to-device, NCCL), so staging directions overlap. */
typedef struct kvx_gpu kvx_gpu;
enum { KVX_S_D2H = 0, KVX_S_H2D = 1, KVX_S_NCCL = 2, KVX_S_COUNT };

td_status kvx_gpu_create(int device, kvx_gpu **out);
/* Identifies the device on its host (hash of the PCI bus id); 0 for NULL. */
uint64_t kvx_gpu_uid(kvx_gpu *g);
void kvx_gpu_destroy(kvx_gpu *g);
td_status kvx_gpu_host_alloc(kvx_gpu *g, size_t bytes, void **out);
void kvx_gpu_host_free(kvx_gpu *g, void *p);
/* Pins existing host memory for asynchronous copies (cudaHostRegister). */
td_status kvx_gpu_host_register(kvx_gpu *g, void *p, size_t bytes);
void kvx_gpu_host_unregister(kvx_gpu *g, void *p);
/* Whether [p, p + bytes) is device memory of the engine's device. */
td_status kvx_gpu_check_device_ptr(kvx_gpu *g, const void *p, size_t bytes);
/* Asynchronous copy on a stream (its direction decides the copy kind). */
td_status kvx_gpu_copy(kvx_gpu *g, int stream, void *dst, const void *src, size_t bytes);
/* n asynchronous copies on a stream, contiguous neighbours merged, issued
 * as one batch where the runtime has cudaMemcpyBatchAsync. */
td_status kvx_gpu_copy_many(kvx_gpu *g, int stream, void **dsts, const void **srcs, size_t *sizes, size_t n);
/* Synchronous host-to-device copy from pageable memory. */
td_status kvx_gpu_copy_sync(kvx_gpu *g, void *dst, const void *src, size_t bytes);
/* Makes a stream wait for an application event (cudaEvent_t). */
td_status kvx_gpu_wait(kvx_gpu *g, int stream, void *event);
/* Records a pooled event on a stream. */
td_status kvx_gpu_record(kvx_gpu *g, int stream, void **event);
/* 1: done, 0: pending, -1: failed (td_err set). */
int kvx_gpu_query(kvx_gpu *g, void *event);
void kvx_gpu_release(kvx_gpu *g, void *event);

/* A two-rank NCCL communicator, created without blocking. */
typedef struct kvx_nccl kvx_nccl;
typedef struct kvx_nccl_op kvx_nccl_op;
td_status kvx_nccl_unique_id(uint8_t id[KVX_NCCL_ID_BYTES]);
td_status kvx_nccl_create(kvx_gpu *g, const uint8_t id[KVX_NCCL_ID_BYTES], int rank, kvx_nccl **out);
/* 1: ready, 0: still initialising or enqueuing, -1: failed (td_err set). */
int kvx_nccl_poll(kvx_nccl *c);
/* Whether a new group may be posted (no enqueue in progress). */
bool kvx_nccl_idle(kvx_nccl *c);
/* Copies run on the NCCL stream once a receive is enqueued (scatter out of
 * a bounce buffer). */
typedef struct kvx_copies {
  void **dsts;
  const void **srcs;
  size_t *sizes;
  size_t n;
} kvx_copies;
/* One send (or receive) of bytes at buf to / from the other rank; after,
 * when non-NULL, is copied and run after the receive, before completion. */
td_status kvx_nccl_post(kvx_nccl *c, bool send, void *buf, size_t bytes, const kvx_copies *after, kvx_nccl_op **op);
/* A device buffer of at least bytes (0: send bounce, 1: receive bounce).
 * Growing needs an idle NCCL stream: TD_ERR_OVERLOADED means "later". */
td_status kvx_gpu_bounce(kvx_gpu *g, int which, size_t bytes, void **out);
/* 1: done, 0: pending, -1: failed. */
int kvx_nccl_op_poll(kvx_nccl_op *op);
void kvx_nccl_op_free(kvx_nccl_op *op);
/* Aborts whatever runs on it and frees it (never blocks on the peer).
 * Free its ops first. */
void kvx_nccl_abort(kvx_nccl *c);

#endif
