/* A rank without peers (td_comm_create_alone): one rank of a
 * tensor-parallel group runs its share of the model on one device, its
 * collectives leaving the other ranks' parts as they are. What one rank
 * computes, without the exchange: bench-decode-step --tp-alone measures a
 * TP rank's step on a single GPU. */
#include <stdlib.h>

#include "kernels/backend_impl.h"

static td_status a_allreduce(td_comm *c, td_backend *b, void *buf, td_buf_type t, size_t n) {
  (void)c, (void)b, (void)buf, (void)t, (void)n;
  return TD_OK;
}

/* its own part into every rank's slot, as the exchange would move it */
static td_status a_allgather(td_comm *c, td_backend *b, const void *send, void *recv, td_buf_type t, size_t n) {
  size_t bytes = n * td_buf_elem_size(b, t);
  for (int r = 0; r < c->world; r++) TD_TRY(td_copy_d2d(b, (char *)recv + (size_t)r * bytes, send, bytes));
  return TD_OK;
}

static td_status a_rows(td_comm *c, td_backend *b, void *buf, td_buf_type t, int rows, int width, int col0,
                        int ncols) {
  (void)c, (void)b, (void)buf, (void)t, (void)rows, (void)width, (void)col0, (void)ncols;
  return TD_OK;
}

static td_status no_peer(void) {
  return td_err(TD_ERR_UNSUPPORTED, "a rank alone has no peers to send to or receive from (pipeline stages)");
}
static td_status a_send(td_comm *c, td_backend *b, const void *buf, td_buf_type t, size_t n, int peer) {
  (void)c, (void)b, (void)buf, (void)t, (void)n, (void)peer;
  return no_peer();
}
static td_status a_recv(td_comm *c, td_backend *b, void *buf, td_buf_type t, size_t n, int peer) {
  (void)c, (void)b, (void)buf, (void)t, (void)n, (void)peer;
  return no_peer();
}
static td_status a_sendrecv(td_comm *c, td_backend *b, const void *send, td_buf_type st, size_t sn, int to,
                            void *recv, td_buf_type rt, size_t rn, int from) {
  (void)c, (void)b, (void)send, (void)st, (void)sn, (void)to, (void)recv, (void)rt, (void)rn, (void)from;
  return no_peer();
}
static void a_abort(td_comm *c) { (void)c; }
static void a_destroy(td_comm *c) { free(c); }

static const td_comm_vt alone_vt = {a_allreduce, a_allgather, a_send, a_recv, a_sendrecv, a_abort, a_destroy,
                                    a_rows, NULL};

td_status td_comm_create_alone(int rank, int world, td_comm **out) {
  *out = NULL;
  if (world < 1 || world > 1024 || rank < 0 || rank >= world)
    return td_err(TD_ERR_INVALID, "a rank alone: rank %d of %d", rank, world);
  td_comm *c = calloc(1, sizeof *c);
  if (!c) return td_err(TD_ERR_NOMEM, "a rank alone: out of memory");
  *c = (td_comm){.vt = &alone_vt, .rank = rank, .world = world};
  *out = c;
  return TD_OK;
}
