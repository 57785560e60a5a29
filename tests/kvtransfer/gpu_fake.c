/* Test-only stand-in for kvtransfer/gpu_cuda.c: "device memory" is host
 * memory and copies are memcpy, so the staged pipeline (device-to-host,
 * puts into staging, CHUNK / CREDIT, host-to-device) runs in CI without a
 * GPU. Copies run when issued; events report completion only on their
 * second query, so the engine's pending paths are exercised. No NCCL. */
#include <stdlib.h>
#include <string.h>

#include "kvtransfer/gpu.h"

struct kvx_gpu {
  int device;
};

typedef struct fake_event {
  int queries;
} fake_event;

bool kvx_gpu_compiled(void) { return true; }
bool kvx_nccl_compiled(void) { return false; }

td_status kvx_gpu_create(int device, kvx_gpu **out) {
  *out = calloc(1, sizeof **out);
  if (!*out) return td_err(TD_ERR_NOMEM, "out of memory");
  (*out)->device = device;
  return TD_OK;
}
void kvx_gpu_destroy(kvx_gpu *g) { free(g); }
uint64_t kvx_gpu_uid(kvx_gpu *g) { return g ? (uint64_t)g->device + 1 : 0; }
td_status kvx_gpu_host_alloc(kvx_gpu *g, size_t bytes, void **out) {
  *out = NULL;
  if (posix_memalign(out, 4096, bytes) != 0) return td_err(TD_ERR_NOMEM, "out of memory");
  memset(*out, 0, bytes);
  return TD_OK;
}
void kvx_gpu_host_free(kvx_gpu *g, void *p) { free(p); }
td_status kvx_gpu_host_register(kvx_gpu *g, void *p, size_t bytes) { return TD_OK; }
void kvx_gpu_host_unregister(kvx_gpu *g, void *p) {}
td_status kvx_gpu_check_device_ptr(kvx_gpu *g, const void *p, size_t bytes) { return TD_OK; }
td_status kvx_gpu_copy(kvx_gpu *g, int stream, void *dst, const void *src, size_t bytes) {
  memcpy(dst, src, bytes);
  return TD_OK;
}
td_status kvx_gpu_copy_many(kvx_gpu *g, int stream, void **dsts, const void **srcs, size_t *sizes, size_t n) {
  for (size_t i = 0; i < n; i++) memcpy(dsts[i], srcs[i], sizes[i]);
  return TD_OK;
}
td_status kvx_gpu_copy_sync(kvx_gpu *g, void *dst, const void *src, size_t bytes) {
  memcpy(dst, src, bytes);
  return TD_OK;
}
td_status kvx_gpu_wait(kvx_gpu *g, int stream, void *event) { return TD_OK; }
td_status kvx_gpu_record(kvx_gpu *g, int stream, void **event) {
  *event = calloc(1, sizeof(fake_event));
  return *event ? TD_OK : td_err(TD_ERR_NOMEM, "out of memory");
}
int kvx_gpu_query(kvx_gpu *g, void *event) {
  fake_event *e = event;
  if (!e) return 1; /* an application's ready event */
  return ++e->queries >= 2 ? 1 : 0;
}
void kvx_gpu_release(kvx_gpu *g, void *event) { free(event); }

static td_status no_nccl(void) { return td_err(TD_ERR_UNSUPPORTED, "fake GPU: no NCCL"); }
td_status kvx_nccl_unique_id(uint8_t id[KVX_NCCL_ID_BYTES]) { return no_nccl(); }
td_status kvx_nccl_create(kvx_gpu *g, const uint8_t id[KVX_NCCL_ID_BYTES], int rank, kvx_nccl **out) {
  *out = NULL;
  return no_nccl();
}
int kvx_nccl_poll(kvx_nccl *c) {
  no_nccl();
  return -1;
}
bool kvx_nccl_idle(kvx_nccl *c) { return false; }
td_status kvx_nccl_post(kvx_nccl *c, bool send, void *buf, size_t bytes, const kvx_copies *after, kvx_nccl_op **op) {
  *op = NULL;
  return no_nccl();
}
td_status kvx_gpu_bounce(kvx_gpu *g, int which, size_t bytes, void **out) {
  *out = NULL;
  return no_nccl();
}
int kvx_nccl_op_poll(kvx_nccl_op *op) { return -1; }
void kvx_nccl_op_free(kvx_nccl_op *op) {}
void kvx_nccl_abort(kvx_nccl *c) {}
