/* NCCL communicators for the CUDA backend (tensor and pipeline
 * parallelism): collectives and point-to-point on the backend's stream, so
 * they order with the ops around them and can be captured in a CUDA graph.
 * One rank per GPU. Built without NCCL (nccl.h / libnccl not found), the
 * calls answer TD_ERR_UNSUPPORTED. */
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_allreduce.h"
#include "kernels/cuda/cuda_internal.h"

#ifdef TD_HAVE_NCCL
#include <nccl.h>

typedef struct nccl_comm {
  ncclComm_t comm;
  int device;
  td_cu_allreduce *ar; /* small all-reduces over P2P, when every rank has it */
  void *rows_buf;      /* allgather_rows through NCCL: the packed blocks */
  size_t rows_cap;
  bool aborted;
} nccl_comm;

static td_status nccl_fail(const char *what, ncclResult_t r) {
  return td_err(r == ncclRemoteError || r == ncclSystemError ? TD_ERR_PEER : TD_ERR_CUDA, "nccl %s: %s", what,
                ncclGetErrorString(r));
}

#define TD_NCCL(call, what)                          \
  do {                                               \
    ncclResult_t td_r_ = (call);                     \
    if (td_r_ != ncclSuccess) return nccl_fail(what, td_r_); \
  } while (0)

static ncclDataType_t nccl_type(const td_backend *b, td_buf_type t) {
  return t == TD_BUF_ACT ? ncclBfloat16 : t == TD_BUF_F32 ? ncclFloat32 : ncclInt32;
}

static td_status need_cuda(const td_backend *b, const char *op) {
  return b->kind == TD_BACKEND_CUDA ? TD_OK : td_err(TD_ERR_INVALID, "nccl %s: the backend is not CUDA", op);
}

static td_status n_allreduce(td_comm *c, td_backend *b, void *buf, td_buf_type t, size_t n) {
  if (b->kind == TD_BACKEND_CUDA) td_cu_bind(td_cu(b));
  TD_TRY(need_cuda(b, "allreduce"));
  nccl_comm *nc = (nccl_comm *)c->impl;
  if (nc->aborted) return td_err(TD_ERR_PEER, "allreduce: the communicator was aborted");
  if (td_cu_allreduce_fits(nc->ar, t, n)) return td_cu_allreduce_run(b, nc->ar, buf, n);
  TD_NCCL(ncclAllReduce(buf, buf, n, nccl_type(b, t), ncclSum, nc->comm, td_cu(b)->stream), "allreduce");
  return TD_OK;
}

/* A row-parallel GEMM of a few rows ends in the one-shot all-reduce (one
 * kernel, the same bits); else the GEMM, then the all-reduce. */
static td_status n_gemm_allreduce(td_comm *c, td_backend *b, const void *x, const void *w, const float *bias, void *y,
                                  int m, int n, int k, unsigned flags) {
  if (b->kind == TD_BACKEND_CUDA) td_cu_bind(td_cu(b));
  TD_TRY(need_cuda(b, "gemm_allreduce"));
  nccl_comm *nc = (nccl_comm *)c->impl;
  if (nc->aborted) return td_err(TD_ERR_PEER, "gemm_allreduce: the communicator was aborted");
  td_cu_ar_dev d;
  if (td_cu_gemm_ar_fits(b, x, w, y, m, n, k, flags, c->world) && td_cu_allreduce_dev(nc->ar, (size_t)m * n, &d))
    return td_cu_gemm_ar(b, &d, x, w, bias, y, m, n, k, flags);
  TD_TRY(td_gemm(b, x, w, bias, y, m, n, k, TD_ACT_NONE, flags));
  return n_allreduce(c, b, y, TD_BUF_ACT, (size_t)m * n);
}

static td_status n_allgather(td_comm *c, td_backend *b, const void *send, void *recv, td_buf_type t, size_t n) {
  if (b->kind == TD_BACKEND_CUDA) td_cu_bind(td_cu(b));
  TD_TRY(need_cuda(b, "allgather"));
  nccl_comm *nc = (nccl_comm *)c->impl;
  if (nc->aborted) return td_err(TD_ERR_PEER, "allgather: the communicator was aborted");
  if (td_cu(b)->tune.custom_allgather && td_cu_allgather_words_fits(nc->ar, t, n))
    return td_cu_allgather_words_run(b, nc->ar, send, recv, n);
  TD_NCCL(ncclAllGather(send, recv, n, nccl_type(b, t), nc->comm, td_cu(b)->stream), "allgather");
  return TD_OK;
}

/* Over P2P slots when they take a rank's block, else packed into a
 * buffer of the communicator's (grown here: not while a graph is being
 * captured), all-gathered in place by NCCL and unpacked. */
static td_status n_allgather_rows(td_comm *c, td_backend *b, void *buf, td_buf_type t, int rows, int width, int col0,
                                  int ncols) {
  if (b->kind == TD_BACKEND_CUDA) td_cu_bind(td_cu(b));
  TD_TRY(need_cuda(b, "allgather_rows"));
  nccl_comm *nc = (nccl_comm *)c->impl;
  if (nc->aborted) return td_err(TD_ERR_PEER, "allgather_rows: the communicator was aborted");
  td_row_split me = td_rows_split(rows, c->world, c->rank);
  if (td_cu_allgather_rows_fits(nc->ar, t, buf, me.per, width, col0, ncols))
    return td_cu_allgather_rows_run(b, nc->ar, buf, rows, width, col0, ncols, me.per);
  size_t es = td_buf_elem_size(b, t), blk = (size_t)me.per * (size_t)ncols * es, pitch = (size_t)width * es;
  cudaStream_t st = td_cu(b)->stream;
  if (nc->rows_cap < blk * (size_t)c->world) {
    (void)cudaStreamSynchronize(st);
    (void)cudaFree(nc->rows_buf);
    nc->rows_buf = NULL;
    nc->rows_cap = 0;
    TD_CU_CHECK(cudaMalloc(&nc->rows_buf, blk * (size_t)c->world), "allgather_rows buffer");
    nc->rows_cap = blk * (size_t)c->world;
  }
  char *packed = (char *)nc->rows_buf, *B = (char *)buf + (size_t)col0 * es;
  if (me.hi > me.lo)
    TD_CU_CHECK(cudaMemcpy2DAsync(packed + (size_t)c->rank * blk, (size_t)ncols * es, B + (size_t)me.lo * pitch, pitch,
                                  (size_t)ncols * es, (size_t)(me.hi - me.lo), cudaMemcpyDeviceToDevice, st),
                "allgather_rows pack");
  TD_NCCL(ncclAllGather(packed + (size_t)c->rank * blk, packed, (size_t)me.per * (size_t)ncols, nccl_type(b, t),
                        nc->comm, st),
          "allgather_rows");
  for (int r = 0; r < c->world; r++) {
    td_row_split o = td_rows_split(rows, c->world, r);
    if (r == c->rank || o.hi == o.lo) continue;
    TD_CU_CHECK(cudaMemcpy2DAsync(B + (size_t)o.lo * pitch, pitch, packed + (size_t)r * blk, (size_t)ncols * es,
                                  (size_t)ncols * es, (size_t)(o.hi - o.lo), cudaMemcpyDeviceToDevice, st),
                "allgather_rows unpack");
  }
  return TD_OK;
}

static td_status n_send(td_comm *c, td_backend *b, const void *buf, td_buf_type t, size_t n, int peer) {
  if (b->kind == TD_BACKEND_CUDA) td_cu_bind(td_cu(b));
  TD_TRY(need_cuda(b, "send"));
  nccl_comm *nc = (nccl_comm *)c->impl;
  TD_NCCL(ncclSend(buf, n, nccl_type(b, t), peer, nc->comm, td_cu(b)->stream), "send");
  return TD_OK;
}

static td_status n_recv(td_comm *c, td_backend *b, void *buf, td_buf_type t, size_t n, int peer) {
  if (b->kind == TD_BACKEND_CUDA) td_cu_bind(td_cu(b));
  TD_TRY(need_cuda(b, "recv"));
  nccl_comm *nc = (nccl_comm *)c->impl;
  TD_NCCL(ncclRecv(buf, n, nccl_type(b, t), peer, nc->comm, td_cu(b)->stream), "recv");
  return TD_OK;
}

/* One NCCL group: both are posted before either waits for its peer. */
static td_status n_sendrecv(td_comm *c, td_backend *b, const void *send, td_buf_type send_t, size_t send_n, int to,
                            void *recv, td_buf_type recv_t, size_t recv_n, int from) {
  if (b->kind == TD_BACKEND_CUDA) td_cu_bind(td_cu(b));
  TD_TRY(need_cuda(b, "sendrecv"));
  nccl_comm *nc = (nccl_comm *)c->impl;
  cudaStream_t st = td_cu(b)->stream;
  TD_NCCL(ncclGroupStart(), "sendrecv group");
  ncclResult_t r = ncclSend(send, send_n, nccl_type(b, send_t), to, nc->comm, st);
  if (r == ncclSuccess) r = ncclRecv(recv, recv_n, nccl_type(b, recv_t), from, nc->comm, st);
  ncclResult_t e = ncclGroupEnd();
  if (r != ncclSuccess) return nccl_fail("sendrecv", r);
  if (e != ncclSuccess) return nccl_fail("sendrecv group", e);
  return TD_OK;
}

/* Unblocks pending collectives (a peer died); td_comm_destroy frees. */
static void n_abort(td_comm *c) {
  nccl_comm *nc = (nccl_comm *)c->impl;
  if (nc->aborted) return;
  nc->aborted = true;
  if (nc->comm) (void)ncclCommAbort(nc->comm);
}

static void n_destroy(td_comm *c) {
  nccl_comm *nc = (nccl_comm *)c->impl;
  (void)cudaSetDevice(nc->device);
  if (nc->comm && !nc->aborted) (void)ncclCommDestroy(nc->comm);
  td_cu_allreduce_destroy(nc->ar);
  if (nc->rows_buf) (void)cudaFree(nc->rows_buf);
  free(nc);
  free(c);
}

typedef struct gather_ctx {
  td_backend *b;
  nccl_comm *nc;
  int world;
} gather_ctx;

/* Host bytes from every rank, through an NCCL all-gather. */
static td_status gather_bytes(void *ctx, const void *send, void *recv, size_t bytes) {
  gather_ctx *g = (gather_ctx *)ctx;
  td_cuda *cu = td_cu(g->b);
  uint8_t *d = NULL;
  TD_CU_CHECK(cudaMalloc((void **)&d, bytes * (size_t)(g->world + 1)), "allreduce set-up");
  cudaError_t e = cudaMemcpy(d, send, bytes, cudaMemcpyHostToDevice);
  ncclResult_t r = e == cudaSuccess ? ncclAllGather(d, d + bytes, bytes, ncclUint8, g->nc->comm, cu->stream)
                                    : ncclUnhandledCudaError;
  if (r == ncclSuccess) e = cudaStreamSynchronize(cu->stream);
  if (r == ncclSuccess && e == cudaSuccess) e = cudaMemcpy(recv, d + bytes, bytes * (size_t)g->world, cudaMemcpyDeviceToHost);
  (void)cudaFree(d);
  if (r != ncclSuccess) return nccl_fail("allreduce set-up", r);
  if (e != cudaSuccess) return td_err(TD_ERR_CUDA, "allreduce set-up: %s", cudaGetErrorString(e));
  return TD_OK;
}

static td_comm_vt nccl_vt;

/* NCCL connects peers lazily, on the first operation that needs them, and
 * connecting is not allowed while a stream is being captured: so every
 * connection a step may use (collectives, and point to point with each
 * peer) is made here, and graphs captured later only replay. */
static td_status warm_up(td_backend *b, nccl_comm *nc, int rank, int world) {
  if (world == 1) return TD_OK;
  td_cuda *cu = td_cu(b);
  int32_t *buf = NULL;
  TD_CU_CHECK(cudaMalloc((void **)&buf, sizeof(int32_t) * (size_t)(2 * world + 2)), "nccl warm-up");
  TD_CU_CHECK(cudaMemsetAsync(buf, 0, sizeof(int32_t) * (size_t)(2 * world + 2), cu->stream), "nccl warm-up");
  ncclResult_t r = ncclAllReduce(buf, buf, 1, ncclInt32, ncclSum, nc->comm, cu->stream);
  if (r == ncclSuccess) r = ncclAllGather(buf, buf + 2, 1, ncclInt32, nc->comm, cu->stream);
  if (r == ncclSuccess) r = ncclGroupStart();
  for (int p = 0; p < world && r == ncclSuccess; p++) {
    if (p == rank) continue;
    r = ncclSend(buf + 1, 1, ncclInt32, p, nc->comm, cu->stream);
    if (r == ncclSuccess) r = ncclRecv(buf + 2 + world + p, 1, ncclInt32, p, nc->comm, cu->stream);
  }
  if (r == ncclSuccess) r = ncclGroupEnd();
  cudaError_t e = cudaStreamSynchronize(cu->stream);
  (void)cudaFree(buf);
  if (r != ncclSuccess) return nccl_fail("warm-up", r);
  if (e != cudaSuccess) return td_err(TD_ERR_CUDA, "nccl warm-up: %s", cudaGetErrorString(e));
  return TD_OK;
}

extern "C" td_status td_comm_nccl_id(uint8_t id[TD_NCCL_ID_BYTES]) {
  static_assert(sizeof(ncclUniqueId) == TD_NCCL_ID_BYTES, "NCCL id size");
  ncclUniqueId u;
  TD_NCCL(ncclGetUniqueId(&u), "unique id");
  memcpy(id, &u, sizeof u);
  return TD_OK;
}

/* Blocks until all `world` ranks have joined with the same id. */
extern "C" td_status td_comm_create_nccl(td_backend *b, const uint8_t id[TD_NCCL_ID_BYTES], int rank, int world,
                                         td_comm **out) {
  *out = NULL;
  TD_TRY(need_cuda(b, "communicator"));
  if (world < 1 || rank < 0 || rank >= world)
    return td_err(TD_ERR_INVALID, "nccl communicator: rank %d of %d", rank, world);
  nccl_vt.allreduce = n_allreduce;
  nccl_vt.allgather = n_allgather;
  nccl_vt.send = n_send;
  nccl_vt.recv = n_recv;
  nccl_vt.sendrecv = n_sendrecv;
  nccl_vt.abort = n_abort;
  nccl_vt.destroy = n_destroy;
  nccl_vt.allgather_rows = n_allgather_rows;
  nccl_vt.gemm_allreduce = n_gemm_allreduce;
  td_comm *c = (td_comm *)calloc(1, sizeof *c);
  nccl_comm *nc = (nccl_comm *)calloc(1, sizeof *nc);
  if (!c || !nc) {
    free(c);
    free(nc);
    return td_err(TD_ERR_NOMEM, "nccl communicator: out of memory");
  }
  nc->device = td_cu(b)->device;
  ncclUniqueId u;
  memcpy(&u, id, sizeof u);
  cudaError_t e = cudaSetDevice(nc->device);
  ncclResult_t r = e == cudaSuccess ? ncclCommInitRank(&nc->comm, world, u, rank) : ncclUnhandledCudaError;
  if (r != ncclSuccess) {
    free(c);
    free(nc);
    return nccl_fail("communicator", r);
  }
  c->vt = &nccl_vt;
  c->rank = rank;
  c->world = world;
  c->impl = nc;
  td_status s = warm_up(b, nc, rank, world);
  gather_ctx g = {b, nc, world};
  if (s == TD_OK) s = td_cu_allreduce_create(b, rank, world, gather_bytes, &g, &nc->ar);
  if (s != TD_OK) {
    n_abort(c);
    n_destroy(c);
    return s;
  }
  *out = c;
  return TD_OK;
}

#else

extern "C" td_status td_comm_nccl_id(uint8_t id[TD_NCCL_ID_BYTES]) {
  return td_err(TD_ERR_UNSUPPORTED, "this build has no NCCL (nccl.h or libnccl was not found)");
}

extern "C" td_status td_comm_create_nccl(td_backend *b, const uint8_t id[TD_NCCL_ID_BYTES], int rank, int world,
                                         td_comm **out) {
  *out = NULL;
  return td_err(TD_ERR_UNSUPPORTED, "this build has no NCCL (nccl.h or libnccl was not found)");
}

#endif
