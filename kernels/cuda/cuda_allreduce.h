/* The one-shot P2P all-reduce of the CUDA backend (cuda_allreduce.cu),
 * used by the NCCL communicator for small messages. Internal. */
#ifndef TD_KERNELS_CUDA_ALLREDUCE_H
#define TD_KERNELS_CUDA_ALLREDUCE_H

#include "kernels/cuda/cuda_internal.h"

typedef struct td_cu_allreduce td_cu_allreduce;
/* recv[r * bytes ...] = rank r's send (every rank), on the host. */
typedef td_status (*td_cu_gather)(void *ctx, const void *send, void *recv, size_t bytes);

/* NULL in *out (and TD_OK) when it cannot be used: then NCCL does all. */
td_status td_cu_allreduce_create(td_backend *b, int rank, int world, td_cu_gather gather, void *gctx,
                                 td_cu_allreduce **out);
void td_cu_allreduce_destroy(td_cu_allreduce *a);
bool td_cu_allreduce_fits(const td_cu_allreduce *a, td_buf_type t, size_t n);
/* In place, on the backend's stream. */
td_status td_cu_allreduce_run(td_backend *b, td_cu_allreduce *a, void *buf, size_t n);
/* td_allgather of n float32 a rank over the same
 * slots, into recv[world][n], on the backend's stream. */
bool td_cu_allgather_words_fits(const td_cu_allreduce *a, td_buf_type t, size_t n);
td_status td_cu_allgather_words_run(td_backend *b, td_cu_allreduce *a, const void *send, void *recv, size_t n);
/* The device's view of it for a GEMM that ends in an all-reduce of n bf16
 * values (false: a does not take n values). */
bool td_cu_allreduce_dev(const td_cu_allreduce *a, size_t n, td_cu_ar_dev *out);
/* td_allgather_rows over the same slots (per: the rows a rank holds). */
bool td_cu_allgather_rows_fits(const td_cu_allreduce *a, td_buf_type t, const void *buf, int per, int width, int col0,
                               int ncols);
td_status td_cu_allgather_rows_run(td_backend *b, td_cu_allreduce *a, void *buf, int rows, int width, int col0,
                                   int ncols, int per);

#endif
