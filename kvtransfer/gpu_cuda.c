/* CUDA runtime (C API) and NCCL calls of kvtransfer (gpu.h). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <cuda.h> /* driver types of cuMemGetAddressRange, reached through the runtime */
#include <cuda_runtime_api.h>
#ifdef TD_KVX_HAVE_NCCL
#include <nccl.h>
#endif

#include "kvtransfer/gather.h"
#include "kvtransfer/gpu.h"

struct kvx_gpu {
  int device;
  bool no_batch; /* cudaMemcpyBatchAsync refused once: copy one by one */
  int nccl_enqueuing; /* groups of any communicator not yet on the stream */
  unsigned gather_blocks; /* thread blocks of a gather launch: a few per SM */
  kvx_gtable *table;      /* scratch for gather launches (24 KiB) */
  cudaStream_t s[KVX_S_COUNT];
  cudaEvent_t *free_ev; /* pool of events: creating them costs microseconds */
  int n_free, cap_free;
};

static td_status cuda_fail(cudaError_t e, const char *what) {
  return td_err(TD_ERR_CUDA, "KV transfer: %s: %s", what, cudaGetErrorString(e));
}
#define CK(expr, what)                         \
  do {                                         \
    cudaError_t e_ = (expr);                   \
    if (e_ != cudaSuccess) return cuda_fail(e_, what); \
  } while (0)

bool kvx_gpu_compiled(void) { return true; }
bool kvx_nccl_compiled(void) {
#ifdef TD_KVX_HAVE_NCCL
  return true;
#else
  return false;
#endif
}

td_status kvx_gpu_create(int device, kvx_gpu **out) {
  *out = NULL;
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return cuda_fail(e, "no CUDA device");
  if (device < 0 || device >= n) return td_err(TD_ERR_INVALID, "KV transfer: CUDA device %d of %d", device, n);
  kvx_gpu *g = calloc(1, sizeof *g);
  if (!g) return td_err(TD_ERR_NOMEM, "out of memory");
  g->device = device;
  g->table = malloc(sizeof *g->table);
  if (!g->table) {
    free(g);
    return td_err(TD_ERR_NOMEM, "out of memory");
  }
  e = cudaSetDevice(device);
  int sms = 0;
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  /* Four blocks per SM saturate HBM and leave room for NCCL's kernels. */
  g->gather_blocks = sms > 0 ? 4u * (unsigned)sms : 256u;
  for (int i = 0; i < KVX_S_COUNT && e == cudaSuccess; i++) e = cudaStreamCreateWithFlags(&g->s[i], cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    kvx_gpu_destroy(g);
    return cuda_fail(e, "creating streams");
  }
  *out = g;
  return TD_OK;
}

uint64_t kvx_gpu_uid(kvx_gpu *g) {
  if (!g) return 0;
  char bus[64] = {0};
  if (cudaDeviceGetPCIBusId(bus, (int)sizeof bus - 1, g->device) != cudaSuccess) return (uint64_t)g->device + 1;
  uint64_t h = 0xcbf29ce484222325ull;
  for (const char *p = bus; *p; p++) h = (h ^ (uint8_t)*p) * 0x100000001b3ull;
  return h;
}

void kvx_gpu_destroy(kvx_gpu *g) {
  if (!g) return;
  cudaSetDevice(g->device);
  for (int i = 0; i < KVX_S_COUNT; i++)
    if (g->s[i]) {
      cudaStreamSynchronize(g->s[i]);
      cudaStreamDestroy(g->s[i]);
    }
  for (int i = 0; i < g->n_free; i++) cudaEventDestroy(g->free_ev[i]);
  free(g->free_ev);
  free(g->table);
  free(g);
}

td_status kvx_gpu_host_alloc(kvx_gpu *g, size_t bytes, void **out) {
  *out = NULL;
  cudaSetDevice(g->device);
  CK(cudaHostAlloc(out, bytes, cudaHostAllocPortable), "pinned host allocation");
  return TD_OK;
}

void kvx_gpu_host_free(kvx_gpu *g, void *p) {
  if (p) cudaFreeHost(p);
}

td_status kvx_gpu_host_register(kvx_gpu *g, void *p, size_t bytes) {
  cudaSetDevice(g->device);
  CK(cudaHostRegister(p, bytes, cudaHostRegisterPortable), "cudaHostRegister");
  return TD_OK;
}

void kvx_gpu_host_unregister(kvx_gpu *g, void *p) {
  if (p) cudaHostUnregister(p);
}

td_status kvx_gpu_check_device_ptr(kvx_gpu *g, const void *p, size_t bytes) {
  struct cudaPointerAttributes a;
  cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return cuda_fail(e, "pool pointer");
  }
  if (a.type != cudaMemoryTypeDevice || a.device != g->device)
    return td_err(TD_ERR_INVALID, "KV transfer: %p is not device memory of CUDA device %d", p, g->device);
  return TD_OK;
}

td_status kvx_gpu_copy(kvx_gpu *g, int stream, void *dst, const void *src, size_t bytes) {
  cudaSetDevice(g->device); /* streams and events belong to the context's device */
  enum cudaMemcpyKind kind = stream == KVX_S_D2H ? cudaMemcpyDeviceToHost
                             : stream == KVX_S_H2D ? cudaMemcpyHostToDevice
                                                   : cudaMemcpyDefault;
  CK(cudaMemcpyAsync(dst, src, bytes, kind, g->s[stream]), "cudaMemcpyAsync");
  return TD_OK;
}

td_status kvx_gpu_copy_sync(kvx_gpu *g, void *dst, const void *src, size_t bytes) {
  cudaSetDevice(g->device);
  CK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  return TD_OK;
}

td_status kvx_gpu_copy_many(kvx_gpu *g, int stream, void **dsts, const void **srcs, size_t *sizes, size_t n) {
  /* Merge neighbours (the caller's arrays are scratch). */
  size_t m = 0;
  for (size_t i = 0; i < n; i++) {
    if (m > 0 && (char *)dsts[m - 1] + sizes[m - 1] == (char *)dsts[i] &&
        (const char *)srcs[m - 1] + sizes[m - 1] == (const char *)srcs[i]) {
      sizes[m - 1] += sizes[i];
      continue;
    }
    dsts[m] = dsts[i];
    srcs[m] = srcs[i];
    sizes[m] = sizes[i];
    m++;
  }
  if (m == 1) return kvx_gpu_copy(g, stream, dsts[0], srcs[0], sizes[0]);
  cudaSetDevice(g->device);
#if CUDART_VERSION >= 12080
  if (!g->no_batch && m > 1) {
    /* Many small scattered copies cost microseconds each to issue. */
    struct cudaMemcpyAttributes attr;
    memset(&attr, 0, sizeof attr);
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t idx = 0;
    cudaError_t e = cudaMemcpyBatchAsync(dsts, srcs, sizes, m, &attr, &idx, 1, g->s[stream]);
    if (e == cudaSuccess) return TD_OK;
    cudaGetLastError();
    g->no_batch = true;
  }
#endif
  for (size_t i = 0; i < m; i++) TD_TRY(kvx_gpu_copy(g, stream, dsts[i], srcs[i], sizes[i]));
  return TD_OK;
}

td_status kvx_gpu_copy_d2d(kvx_gpu *g, int stream, void **dsts, const void **srcs, size_t *sizes, size_t n) {
  size_t m = 0;
  for (size_t i = 0; i < n; i++) {
    if (sizes[i] == 0) continue;
    if (m > 0 && (char *)dsts[m - 1] + sizes[m - 1] == (char *)dsts[i] &&
        (const char *)srcs[m - 1] + sizes[m - 1] == (const char *)srcs[i]) {
      sizes[m - 1] += sizes[i];
      continue;
    }
    dsts[m] = dsts[i];
    srcs[m] = srcs[i];
    sizes[m] = sizes[i];
    m++;
  }
  cudaSetDevice(g->device);
  size_t i = 0, off = 0;
  while (kvx_gtable_fill(g->table, dsts, (const void *const *)srcs, sizes, m, &i, &off) > 0) {
    cudaError_t e = (cudaError_t)kvx_gather_launch(g->table, g->gather_blocks, g->s[stream]);
    if (e != cudaSuccess) return cuda_fail(e, "gather kernel");
  }
  return TD_OK;
}

td_status kvx_gpu_dev_alloc(kvx_gpu *g, size_t bytes, void **out) {
  *out = NULL;
  cudaSetDevice(g->device);
  CK(cudaMalloc(out, bytes), "NCCL bounce buffer");
  return TD_OK;
}

void kvx_gpu_dev_free(kvx_gpu *g, void *p) {
  if (!p) return;
  cudaSetDevice(g->device);
  cudaFree(p);
}

td_status kvx_gpu_wait(kvx_gpu *g, int stream, void *event) {
  cudaSetDevice(g->device);
  CK(cudaStreamWaitEvent(g->s[stream], (cudaEvent_t)event, 0), "waiting for the KV's ready event");
  return TD_OK;
}

td_status kvx_gpu_record(kvx_gpu *g, int stream, void **event) {
  *event = NULL;
  cudaSetDevice(g->device);
  cudaEvent_t ev;
  if (g->n_free > 0) {
    ev = g->free_ev[--g->n_free];
  } else {
    CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
  }
  cudaError_t e = cudaEventRecord(ev, g->s[stream]);
  if (e != cudaSuccess) {
    cudaEventDestroy(ev);
    return cuda_fail(e, "cudaEventRecord");
  }
  *event = ev;
  return TD_OK;
}

int kvx_gpu_query(kvx_gpu *g, void *event) {
  cudaError_t e = cudaEventQuery((cudaEvent_t)event);
  if (e == cudaSuccess) return 1;
  if (e == cudaErrorNotReady) return 0;
  cuda_fail(e, "copy failed");
  return -1;
}

void kvx_gpu_release(kvx_gpu *g, void *event) {
  if (!event) return;
  if (g->n_free == g->cap_free) {
    int cap = g->cap_free ? 2 * g->cap_free : 32;
    cudaEvent_t *p = realloc(g->free_ev, sizeof *p * (size_t)cap);
    if (!p) {
      cudaEventDestroy((cudaEvent_t)event);
      return;
    }
    g->free_ev = p;
    g->cap_free = cap;
  }
  g->free_ev[g->n_free++] = (cudaEvent_t)event;
}

void kvx_gpu_sync(kvx_gpu *g, int stream) {
  cudaSetDevice(g->device);
  if (cudaStreamSynchronize(g->s[stream]) != cudaSuccess) cudaGetLastError();
}

/* ---- CUDA IPC ---- */

_Static_assert(sizeof(cudaIpcMemHandle_t) == KVX_IPC_HANDLE_LEN, "IPC handle size");

td_status kvx_gpu_dev_id(kvx_gpu *g, char out[KVX_DEV_ID_LEN + 1]) {
  out[0] = 0;
  CK(cudaDeviceGetPCIBusId(out, KVX_DEV_ID_LEN, g->device), "cudaDeviceGetPCIBusId");
  return TD_OK;
}

/* cuMemGetAddressRange through the runtime (no link to libcuda): the
 * allocation that holds a pointer, since a handle names a whole
 * allocation and opens at its start. NULL where the runtime is too old. */
typedef CUresult (*range_fn)(CUdeviceptr *base, size_t *size, CUdeviceptr p);
static range_fn g_range;
static pthread_once_t g_range_once = PTHREAD_ONCE_INIT;
static void range_init(void) {
#if CUDART_VERSION >= 12050
  void *f = NULL;
  enum cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
      q == cudaDriverEntryPointSuccess)
    g_range = (range_fn)f;
  cudaGetLastError();
#endif
}
static bool alloc_range(const void *p, uint8_t **base, size_t *size) {
  pthread_once(&g_range_once, range_init);
  CUdeviceptr b = 0;
  size_t n = 0;
  if (!g_range || g_range(&b, &n, (CUdeviceptr)(uintptr_t)p) != CUDA_SUCCESS) return false;
  *base = (uint8_t *)(uintptr_t)b;
  *size = n;
  return true;
}

/* Mappings of this process, shared by its contexts: a handle opened twice
 * in one process fails, and one this process exported cannot be opened
 * here at all (its memory is used as it is). */
typedef struct ipc_map {
  uint8_t h[KVX_IPC_HANDLE_LEN];
  int device;   /* -1: exported by this process */
  uint8_t *base;
  size_t size;
  int refs;
  bool local;
  struct ipc_map *next;
} ipc_map;
static ipc_map *g_maps;
static pthread_mutex_t g_ipc_mu = PTHREAD_MUTEX_INITIALIZER;

static ipc_map *map_find(const uint8_t *h, int device) {
  for (ipc_map *m = g_maps; m; m = m->next)
    if (m->device == device && !memcmp(m->h, h, KVX_IPC_HANDLE_LEN)) return m;
  return NULL;
}

td_status kvx_gpu_ipc_export(kvx_gpu *g, void *p, size_t bytes, uint8_t handle[KVX_IPC_HANDLE_LEN],
                             uint64_t *offset) {
  cudaSetDevice(g->device);
  uint8_t *base = p;
  size_t size = 0;
  if (alloc_range(p, &base, &size) && (uint8_t *)p + bytes > base + size)
    return td_err(TD_ERR_INVALID, "KV transfer: pool %p (%zu bytes) overruns its allocation", p, bytes);
  cudaIpcMemHandle_t h;
  cudaError_t e = cudaIpcGetMemHandle(&h, base);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return td_err(TD_ERR_UNSUPPORTED, "KV transfer: cudaIpcGetMemHandle: %s", cudaGetErrorString(e));
  }
  memcpy(handle, &h, KVX_IPC_HANDLE_LEN);
  *offset = (uint64_t)((uint8_t *)p - base);
  pthread_mutex_lock(&g_ipc_mu);
  ipc_map *m = map_find(handle, -1);
  if (!m && (m = calloc(1, sizeof *m))) {
    memcpy(m->h, handle, KVX_IPC_HANDLE_LEN);
    m->device = -1;
    m->base = base;
    m->size = size;
    m->next = g_maps;
    g_maps = m;
  }
  pthread_mutex_unlock(&g_ipc_mu);
  return TD_OK;
}

td_status kvx_gpu_ipc_reach(kvx_gpu *g, const char *dev_id) {
  int peer = -1;
  cudaError_t e = cudaDeviceGetByPCIBusId(&peer, dev_id);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return td_err(TD_ERR_UNSUPPORTED, "the peer's GPU %s is not visible here: %s", dev_id, cudaGetErrorString(e));
  }
  if (peer == g->device) return TD_OK;
  int can = 0;
  e = cudaDeviceCanAccessPeer(&can, g->device, peer);
  if (e != cudaSuccess || !can) {
    cudaGetLastError();
    return td_err(TD_ERR_UNSUPPORTED, "no peer access from GPU %d to GPU %d (%s)", g->device, peer, dev_id);
  }
  return TD_OK;
}

td_status kvx_gpu_ipc_open(kvx_gpu *g, const uint8_t handle[KVX_IPC_HANDLE_LEN], void **base, size_t *size) {
  *base = NULL;
  *size = 0;
  td_status s = TD_OK;
  pthread_mutex_lock(&g_ipc_mu);
  ipc_map *m = map_find(handle, g->device);
  if (!m) {
    ipc_map *own = map_find(handle, -1);
    m = calloc(1, sizeof *m);
    if (!m) {
      s = td_err(TD_ERR_NOMEM, "out of memory");
    } else if (own) {
      m->base = own->base;
      m->size = own->size;
      m->local = true;
    } else {
      cudaSetDevice(g->device);
      cudaIpcMemHandle_t h;
      memcpy(&h, handle, KVX_IPC_HANDLE_LEN);
      void *p = NULL;
      cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
      if (e != cudaSuccess) {
        cudaGetLastError();
        s = cuda_fail(e, "cudaIpcOpenMemHandle");
      } else {
        uint8_t *rb = NULL;
        size_t rs = 0;
        m->base = p;
        m->size = alloc_range(p, &rb, &rs) && rb == (uint8_t *)p ? rs : 0;
      }
    }
    if (s == TD_OK) {
      memcpy(m->h, handle, KVX_IPC_HANDLE_LEN);
      m->device = g->device;
      m->next = g_maps;
      g_maps = m;
    } else {
      free(m);
      m = NULL;
    }
  }
  if (m) {
    m->refs++;
    *base = m->base;
    *size = m->size;
  }
  pthread_mutex_unlock(&g_ipc_mu);
  return s;
}

void kvx_gpu_ipc_close(kvx_gpu *g, void *base) {
  cudaSetDevice(g->device);
  cudaStreamSynchronize(g->s[KVX_S_IPC]); /* any copy whose event could not be recorded */
  pthread_mutex_lock(&g_ipc_mu);
  for (ipc_map **pp = &g_maps; *pp; pp = &(*pp)->next) {
    ipc_map *m = *pp;
    if (m->device != g->device || m->base != base) continue;
    if (--m->refs == 0) {
      if (!m->local) cudaIpcCloseMemHandle(m->base);
      cudaGetLastError();
      *pp = m->next;
      free(m);
    }
    break;
  }
  pthread_mutex_unlock(&g_ipc_mu);
}

/* ---- NCCL ---- */

#ifdef TD_KVX_HAVE_NCCL

struct kvx_nccl {
  kvx_gpu *g;
  ncclComm_t comm;
  int rank;
  bool ready, failed;
  kvx_nccl_op *enqueuing; /* a group whose ncclGroupEnd answered in-progress */
};

struct kvx_nccl_op {
  kvx_nccl *c;
  kvx_gpu *g;
  int stream;
  void *ev; /* pooled event, recorded once the group is enqueued */
  bool failed;
};

static void set_enqueuing(kvx_nccl *c, kvx_nccl_op *op) {
  if (c->enqueuing && !op) c->g->nccl_enqueuing--;
  if (!c->enqueuing && op) c->g->nccl_enqueuing++;
  c->enqueuing = op;
}

static td_status nccl_fail(ncclResult_t r, const char *what) {
  return td_err(TD_ERR_NETWORK, "KV transfer: NCCL %s: %s", what, ncclGetErrorString(r));
}

td_status kvx_nccl_unique_id(uint8_t id[KVX_NCCL_ID_BYTES]) {
  ncclUniqueId u;
  ncclResult_t r = ncclGetUniqueId(&u);
  if (r != ncclSuccess) return nccl_fail(r, "ncclGetUniqueId");
  memcpy(id, u.internal, KVX_NCCL_ID_BYTES);
  return TD_OK;
}

td_status kvx_nccl_create(kvx_gpu *g, const uint8_t id[KVX_NCCL_ID_BYTES], int rank, kvx_nccl **out) {
  *out = NULL;
  kvx_nccl *c = calloc(1, sizeof *c);
  if (!c) return td_err(TD_ERR_NOMEM, "out of memory");
  c->g = g;
  c->rank = rank;
  ncclUniqueId u;
  memcpy(u.internal, id, KVX_NCCL_ID_BYTES);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0; /* initialisation proceeds while the worker's loop runs */
  cudaSetDevice(g->device);
  ncclResult_t r = ncclCommInitRankConfig(&c->comm, 2, u, rank, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    free(c);
    return nccl_fail(r, "ncclCommInitRankConfig");
  }
  *out = c;
  return TD_OK;
}

int kvx_nccl_poll(kvx_nccl *c) {
  if (c->failed) return -1;
  ncclResult_t st = ncclSuccess;
  ncclResult_t r = ncclCommGetAsyncError(c->comm, &st);
  if (r != ncclSuccess) st = r;
  if (st == ncclInProgress) return 0;
  if (st != ncclSuccess) {
    c->failed = true;
    if (c->enqueuing) c->enqueuing->failed = true;
    nccl_fail(st, "communicator");
    return -1;
  }
  c->ready = true;
  if (c->enqueuing) {
    kvx_nccl_op *op = c->enqueuing;
    set_enqueuing(c, NULL);
    /* The group is on the stream now: its completion event goes behind. */
    if (kvx_gpu_record(c->g, op->stream, &op->ev) != TD_OK) op->failed = true;
  }
  return 1;
}

/* Idle also across communicators: a group still being enqueued has no
 * place on its stream yet, so nothing may be queued behind it. */
bool kvx_nccl_idle(kvx_nccl *c) { return c->ready && !c->failed && !c->enqueuing && c->g->nccl_enqueuing == 0; }
bool kvx_nccl_ready(kvx_nccl *c) { return c->ready && !c->failed; }

td_status kvx_nccl_post(kvx_nccl *c, bool send, const kvx_nccl_buf *b, int n, kvx_nccl_op **out) {
  *out = NULL;
  if (!kvx_nccl_idle(c)) return td_err(TD_ERR_INTERNAL, "KV transfer: NCCL communicator busy");
  kvx_nccl_op *op = calloc(1, sizeof *op);
  if (!op) return td_err(TD_ERR_NOMEM, "out of memory");
  op->c = c;
  op->g = c->g;
  op->stream = send ? KVX_S_NCCL : KVX_S_NCCL_RX;
  cudaStream_t st = c->g->s[op->stream];
  cudaSetDevice(c->g->device);
  for (int i = 0; i < n; i++) {
    cudaError_t e = b[i].wait ? cudaStreamWaitEvent(st, (cudaEvent_t)b[i].wait, 0) : cudaSuccess;
    if (e != cudaSuccess) {
      free(op);
      return cuda_fail(e, "NCCL stream waiting for a gather");
    }
  }
  int peer = 1 - c->rank;
  /* A few large operations per group: thousands of small ones in one group
   * ran far below the link's speed (docs/history/kvtransfer.md, "Measured,
   * pass by pass"). */
  ncclResult_t r = ncclGroupStart();
  for (int i = 0; i < n && (r == ncclSuccess || r == ncclInProgress); i++)
    r = send ? ncclSend(b[i].buf, b[i].bytes, ncclUint8, peer, c->comm, st)
             : ncclRecv(b[i].buf, b[i].bytes, ncclUint8, peer, c->comm, st);
  ncclResult_t re = ncclGroupEnd();
  if ((r != ncclSuccess && r != ncclInProgress) || (re != ncclSuccess && re != ncclInProgress)) {
    free(op);
    c->failed = true;
    return nccl_fail(r != ncclSuccess && r != ncclInProgress ? r : re, send ? "ncclSend" : "ncclRecv");
  }
  /* Non-blocking communicators: the group is enqueued once the async state
   * leaves ncclInProgress (kvx_nccl_poll records the event then). */
  set_enqueuing(c, op);
  kvx_nccl_poll(c);
  *out = op;
  return TD_OK;
}

int kvx_nccl_op_poll(kvx_nccl_op *op) {
  if (op->failed) return -1;
  if (!op->ev) {
    int r = op->c ? kvx_nccl_poll(op->c) : -1;
    if (r < 0 || op->failed) return -1;
    if (!op->ev) return 0;
  }
  cudaError_t e = cudaEventQuery((cudaEvent_t)op->ev);
  if (e == cudaSuccess) return 1;
  if (e != cudaErrorNotReady) {
    cuda_fail(e, "NCCL transfer");
    return -1;
  }
  /* A transfer stuck behind a dead peer shows up as an async error. */
  if (op->c && kvx_nccl_poll(op->c) < 0) return -1;
  return 0;
}

void kvx_nccl_op_free(kvx_nccl_op *op) {
  if (!op) return;
  if (op->c && op->c->enqueuing == op) set_enqueuing(op->c, NULL);
  if (op->ev) kvx_gpu_release(op->g, op->ev);
  free(op);
}

void kvx_nccl_abort(kvx_nccl *c) {
  if (!c) return;
  if (c->enqueuing) set_enqueuing(c, NULL);
  cudaSetDevice(c->g->device);
  ncclCommAbort(c->comm);
  free(c);
}

#else /* CUDA without NCCL */

static td_status no_nccl(void) { return td_err(TD_ERR_UNSUPPORTED, "KV transfer: this build has no NCCL"); }
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
bool kvx_nccl_ready(kvx_nccl *c) { return false; }
td_status kvx_nccl_post(kvx_nccl *c, bool send, const kvx_nccl_buf *b, int n, kvx_nccl_op **op) {
  *op = NULL;
  return no_nccl();
}
int kvx_nccl_op_poll(kvx_nccl_op *op) { return -1; }
void kvx_nccl_op_free(kvx_nccl_op *op) {}
void kvx_nccl_abort(kvx_nccl *c) {}

#endif
