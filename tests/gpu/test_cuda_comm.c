/* NCCL communicators of the CUDA backend: two ranks, one thread and one GPU
 * each, all-reduce (bf16, float32, int32), all-gather and send/recv, eager
 * and inside a captured graph. Needs two GPUs; skipped with fewer. */
#include <criterion/criterion.h>
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "common/settings.h"
#include "gpu_main.h"
#include "kernels/ops.h"

enum { N = 4099, WORLD = 2 };

static td_cuda_tuning cuda_tuning; /* main's, from the environment */

typedef struct rank_arg {
  int rank;
  const uint8_t *id;
  char fail[256]; /* empty: passed */
} rank_arg;

#define FAIL(...)                                           \
  do {                                                      \
    snprintf(a->fail, sizeof a->fail, __VA_ARGS__);         \
    goto out;                                               \
  } while (0)
#define OK(x, what)                                                      \
  do {                                                                   \
    if ((x) != TD_OK) FAIL("rank %d: %s: %s", a->rank, what, td_errmsg()); \
  } while (0)

static void *rank_main(void *p) {
  rank_arg *a = p;
  td_backend *b = NULL;
  td_comm *c = NULL;
  void *f = NULL, *h = NULL, *i32 = NULL, *g = NULL;
  float *x = malloc(sizeof(float) * N * WORLD), *y = malloc(sizeof(float) * N * WORLD);
  td_backend_opts o = {.kind = TD_BACKEND_CUDA, .device = a->rank, .cuda = cuda_tuning};
  OK(td_backend_create(&o, &b), "backend");
  OK(td_comm_create_nccl(b, a->id, a->rank, WORLD, &c), "communicator");
  td_backend_set_comm(b, c);
  OK(td_alloc(b, TD_BUF_F32, N, &f), "alloc");
  OK(td_alloc(b, TD_BUF_ACT, N, &h), "alloc");
  OK(td_alloc(b, TD_BUF_I32, N, &i32), "alloc");
  OK(td_alloc(b, TD_BUF_F32, (size_t)N * WORLD, &g), "alloc");
  for (int i = 0; i < N; i++) x[i] = (float)((i % 97) - 40 + a->rank * 3); /* exact in bf16 */
  OK(td_upload(b, TD_BUF_F32, f, x, N), "upload");
  OK(td_upload(b, TD_BUF_ACT, h, x, N), "upload");
  int32_t *xi = (int32_t *)y;
  for (int i = 0; i < N; i++) xi[i] = i * 7 + a->rank;
  OK(td_upload(b, TD_BUF_I32, i32, (const float *)xi, N), "upload");
  OK(td_allreduce_sum(b, f, TD_BUF_F32, N), "allreduce f32");
  OK(td_allreduce_sum(b, h, TD_BUF_ACT, N), "allreduce bf16");
  OK(td_allreduce_sum(b, i32, TD_BUF_I32, N), "allreduce i32");
  OK(td_allgather(b, f, g, TD_BUF_F32, N), "allgather");
  OK(td_sync(b), "sync");
  OK(td_download(b, TD_BUF_F32, f, y, N), "download");
  for (int i = 0; i < N; i++)
    if (y[i] != (float)(2 * ((i % 97) - 40) + 3)) FAIL("rank %d: f32 sum[%d] = %g", a->rank, i, y[i]);
  OK(td_download(b, TD_BUF_ACT, h, y, N), "download");
  for (int i = 0; i < N; i++)
    if (y[i] != (float)(2 * ((i % 97) - 40) + 3)) FAIL("rank %d: bf16 sum[%d] = %g", a->rank, i, y[i]);
  OK(td_download(b, TD_BUF_I32, i32, y, N), "download");
  for (int i = 0; i < N; i++)
    if (xi[i] != 14 * i + 1) FAIL("rank %d: i32 sum[%d] = %d", a->rank, i, xi[i]);
  OK(td_download(b, TD_BUF_F32, g, y, (size_t)N * WORLD), "download");
  for (int r = 0; r < WORLD; r++)
    for (int i = 0; i < N; i++)
      if (y[r * N + i] != (float)(2 * ((i % 97) - 40) + 3)) FAIL("rank %d: gather[%d][%d] = %g", a->rank, r, i, y[r * N + i]);
  /* point to point, captured in a graph and replayed twice */
  for (int i = 0; i < N; i++) x[i] = (float)(i + 1000 * a->rank);
  OK(td_upload(b, TD_BUF_F32, f, x, N), "upload");
  td_graph *gr = NULL;
  OK(td_graph_begin(b), "graph begin");
  td_status s1 = a->rank == 0 ? td_send(b, f, TD_BUF_F32, N, 1) : td_recv(b, f, TD_BUF_F32, N, 0);
  td_status s2 = td_graph_end(b, &gr);
  OK(s1, "send/recv capture");
  OK(s2, "graph end");
  for (int rep = 0; rep < 2; rep++) OK(td_graph_launch(b, gr), "graph launch");
  OK(td_sync(b), "sync");
  td_graph_destroy(b, gr);
  OK(td_download(b, TD_BUF_F32, f, y, N), "download");
  for (int i = 0; i < N; i++)
    if (y[i] != (float)i) FAIL("rank %d: received[%d] = %g", a->rank, i, y[i]);
out:
  if (b) {
    td_free(b, f);
    td_free(b, h);
    td_free(b, i32);
    td_free(b, g);
  }
  if (c) {
    if (a->fail[0]) td_comm_abort(c);
    else td_comm_destroy(c);
  }
  td_backend_destroy(b);
  free(x);
  free(y);
  return NULL;
}

Test(cuda_comm, two_ranks, .timeout = 120) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < WORLD) cr_skip_test("needs %d GPUs, %d visible", WORLD, n);
  uint8_t id[TD_NCCL_ID_BYTES];
  cr_assert(td_comm_nccl_id(id) == TD_OK, "%s", td_errmsg());
  rank_arg args[WORLD];
  pthread_t th[WORLD];
  for (int r = 0; r < WORLD; r++) {
    args[r] = (rank_arg){.rank = r, .id = id};
    cr_assert(pthread_create(&th[r], NULL, rank_main, &args[r]) == 0);
  }
  for (int r = 0; r < WORLD; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < WORLD; r++) cr_expect(args[r].fail[0] == 0, "%s", args[r].fail);
}

int main(int argc, char *argv[]) { return td_gpu_test_main(argc, argv, &cuda_tuning); }
