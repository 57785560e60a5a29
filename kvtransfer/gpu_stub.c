/* Built when CMake found no CUDA: GPU pools, CUDA IPC and NCCL are unsupported. */
#include "kvtransfer/gpu.h"

#define NO_CUDA td_err(TD_ERR_UNSUPPORTED, "KV transfer: this build has no CUDA")

bool kvx_gpu_compiled(void) { return false; }
bool kvx_nccl_compiled(void) { return false; }
td_status kvx_gpu_create(int device, kvx_gpu **out) {
  *out = NULL;
  return NO_CUDA;
}
void kvx_gpu_destroy(kvx_gpu *g) {}
uint64_t kvx_gpu_uid(kvx_gpu *g) { return 0; }
td_status kvx_gpu_host_alloc(kvx_gpu *g, size_t bytes, void **out) {
  *out = NULL;
  return NO_CUDA;
}
void kvx_gpu_host_free(kvx_gpu *g, void *p) {}
td_status kvx_gpu_host_register(kvx_gpu *g, void *p, size_t bytes) { return NO_CUDA; }
void kvx_gpu_host_unregister(kvx_gpu *g, void *p) {}
td_status kvx_gpu_check_device_ptr(kvx_gpu *g, const void *p, size_t bytes) { return NO_CUDA; }
td_status kvx_gpu_copy(kvx_gpu *g, int stream, void *dst, const void *src, size_t bytes) { return NO_CUDA; }
td_status kvx_gpu_copy_many(kvx_gpu *g, int stream, void **dsts, const void **srcs, size_t *sizes, size_t n) {
  return NO_CUDA;
}
td_status kvx_gpu_copy_d2d(kvx_gpu *g, int stream, void **dsts, const void **srcs, size_t *sizes, size_t n) {
  return NO_CUDA;
}
td_status kvx_gpu_dev_alloc(kvx_gpu *g, size_t bytes, void **out) {
  *out = NULL;
  return NO_CUDA;
}
void kvx_gpu_dev_free(kvx_gpu *g, void *p) {}
td_status kvx_gpu_copy_sync(kvx_gpu *g, void *dst, const void *src, size_t bytes) { return NO_CUDA; }
td_status kvx_gpu_wait(kvx_gpu *g, int stream, void *event) { return NO_CUDA; }
td_status kvx_gpu_record(kvx_gpu *g, int stream, void **event) {
  *event = NULL;
  return NO_CUDA;
}
int kvx_gpu_query(kvx_gpu *g, void *event) {
  NO_CUDA;
  return -1;
}
void kvx_gpu_release(kvx_gpu *g, void *event) {}
void kvx_gpu_sync(kvx_gpu *g, int stream) {}
td_status kvx_gpu_dev_id(kvx_gpu *g, char out[KVX_DEV_ID_LEN + 1]) {
  out[0] = 0;
  return NO_CUDA;
}
td_status kvx_gpu_ipc_export(kvx_gpu *g, void *p, size_t bytes, uint8_t handle[KVX_IPC_HANDLE_LEN],
                             uint64_t *offset) {
  return NO_CUDA;
}
td_status kvx_gpu_ipc_reach(kvx_gpu *g, const char *dev_id) { return NO_CUDA; }
td_status kvx_gpu_ipc_open(kvx_gpu *g, const uint8_t handle[KVX_IPC_HANDLE_LEN], void **base, size_t *size) {
  *base = NULL;
  *size = 0;
  return NO_CUDA;
}
void kvx_gpu_ipc_close(kvx_gpu *g, void *base) {}
td_status kvx_nccl_unique_id(uint8_t id[KVX_NCCL_ID_BYTES]) { return NO_CUDA; }
td_status kvx_nccl_create(kvx_gpu *g, const uint8_t id[KVX_NCCL_ID_BYTES], int rank, kvx_nccl **out) {
  *out = NULL;
  return NO_CUDA;
}
int kvx_nccl_poll(kvx_nccl *c) {
  NO_CUDA;
  return -1;
}
bool kvx_nccl_idle(kvx_nccl *c) { return false; }
bool kvx_nccl_ready(kvx_nccl *c) { return false; }
td_status kvx_nccl_post(kvx_nccl *c, bool send, const kvx_nccl_buf *b, int n, kvx_nccl_op **op) {
  *op = NULL;
  return NO_CUDA;
}
int kvx_nccl_op_poll(kvx_nccl_op *op) {
  NO_CUDA;
  return -1;
}
void kvx_nccl_op_free(kvx_nccl_op *op) {}
void kvx_nccl_abort(kvx_nccl *c) {}
