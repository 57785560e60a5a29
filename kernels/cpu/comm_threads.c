/* Communicators between ranks that are threads of one process (CPU
 * backend): collectives meet at a barrier and read each other's buffers;
 * point-to-point is a rendezvous. Sums run in rank order, so every rank
 * gets the same bits. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend_impl.h"

#define MAX_WORLD 16

typedef struct box {
  const void *data;
  size_t bytes;
  bool full;
} box;

typedef struct shared {
  int world, refs;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int arrived;
  unsigned long gen;
  bool aborted;
  const void *bufs[MAX_WORLD];
  float *acc;
  size_t acc_cap;
  box boxes[MAX_WORLD][MAX_WORLD];
} shared;

/* Returns false when the communicator was aborted. */
static bool barrier(shared *s) {
  pthread_mutex_lock(&s->mu);
  unsigned long g = s->gen;
  if (++s->arrived == s->world) {
    s->arrived = 0;
    s->gen++;
    pthread_cond_broadcast(&s->cv);
  } else {
    while (g == s->gen && !s->aborted) pthread_cond_wait(&s->cv, &s->mu);
  }
  bool ok = !s->aborted;
  pthread_mutex_unlock(&s->mu);
  return ok;
}

static td_status aborted(void) { return td_err(TD_ERR_PEER, "communicator aborted (a rank failed)"); }

static td_status t_allreduce(td_comm *c, td_backend *b, void *buf, td_buf_type t, size_t n) {
  shared *s = c->impl;
  s->bufs[c->rank] = buf;
  if (!barrier(s)) return aborted();
  if (c->rank == 0) {
    if (n > s->acc_cap) {
      free(s->acc);
      s->acc = malloc(sizeof(float) * n);
      s->acc_cap = s->acc ? n : 0;
    }
    if (s->acc) {
      if (t == TD_BUF_I32) {
        int32_t *a = (int32_t *)s->acc;
        memcpy(a, s->bufs[0], 4 * n);
        for (int r = 1; r < c->world; r++)
          for (size_t i = 0; i < n; i++) a[i] += ((const int32_t *)s->bufs[r])[i];
      } else {
        memcpy(s->acc, s->bufs[0], 4 * n);
        for (int r = 1; r < c->world; r++)
          for (size_t i = 0; i < n; i++) s->acc[i] += ((const float *)s->bufs[r])[i];
      }
    }
  }
  if (!barrier(s)) return aborted();
  if (!s->acc) return td_err(TD_ERR_NOMEM, "allreduce scratch");
  memcpy(buf, s->acc, 4 * n);
  if (!barrier(s)) return aborted();
  return TD_OK;
}

static td_status t_allgather(td_comm *c, td_backend *b, const void *send, void *recv, td_buf_type t, size_t n) {
  shared *s = c->impl;
  s->bufs[c->rank] = send;
  if (!barrier(s)) return aborted();
  for (int r = 0; r < c->world; r++) memcpy((char *)recv + (size_t)r * n * 4, s->bufs[r], 4 * n);
  if (!barrier(s)) return aborted();
  return TD_OK;
}

/* Under s->mu: puts buf in the box to peer (once the last deposit was taken). */
static void deposit(shared *s, box *x, const void *buf, size_t n) {
  while (x->full && !s->aborted) pthread_cond_wait(&s->cv, &s->mu);
  x->data = buf;
  x->bytes = 4 * n;
  x->full = true;
  pthread_cond_broadcast(&s->cv);
}

/* Under s->mu: waits until the receiver took the deposit; false when aborted. */
static bool taken(shared *s, box *x) {
  while (x->full && !s->aborted) pthread_cond_wait(&s->cv, &s->mu);
  return !s->aborted;
}

static td_status t_send(td_comm *c, td_backend *b, const void *buf, td_buf_type t, size_t n, int peer) {
  shared *s = c->impl;
  box *x = &s->boxes[c->rank][peer];
  pthread_mutex_lock(&s->mu);
  deposit(s, x, buf, n);
  bool ok = taken(s, x); /* rendezvous: the buffer is read before send returns */
  pthread_mutex_unlock(&s->mu);
  return ok ? TD_OK : aborted();
}

static td_status t_recv(td_comm *c, td_backend *b, void *buf, td_buf_type t, size_t n, int peer) {
  shared *s = c->impl;
  box *x = &s->boxes[peer][c->rank];
  pthread_mutex_lock(&s->mu);
  while (!x->full && !s->aborted) pthread_cond_wait(&s->cv, &s->mu);
  td_status st = TD_OK;
  if (s->aborted)
    st = aborted();
  else if (x->bytes != 4 * n)
    st = td_err(TD_ERR_INTERNAL, "recv of %zu bytes met a send of %zu", 4 * n, x->bytes);
  else
    memcpy(buf, x->data, x->bytes);
  x->full = false;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  return st;
}

/* The send deposited, the receive taken, then the deposit waited for: a
 * peer that sends to us before it receives from us meets us half way. */
static td_status t_sendrecv(td_comm *c, td_backend *b, const void *send, td_buf_type send_t, size_t send_n, int to,
                            void *recv, td_buf_type recv_t, size_t recv_n, int from) {
  shared *s = c->impl;
  box *x = &s->boxes[c->rank][to];
  pthread_mutex_lock(&s->mu);
  deposit(s, x, send, send_n);
  pthread_mutex_unlock(&s->mu);
  td_status st = t_recv(c, b, recv, recv_t, recv_n, from);
  pthread_mutex_lock(&s->mu);
  bool ok = taken(s, x);
  pthread_mutex_unlock(&s->mu);
  if (st != TD_OK) return st;
  return ok ? TD_OK : aborted();
}

static void t_abort(td_comm *c) {
  shared *s = c->impl;
  pthread_mutex_lock(&s->mu);
  s->aborted = true;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

static void t_destroy(td_comm *c) {
  shared *s = c->impl;
  pthread_mutex_lock(&s->mu);
  bool last = --s->refs == 0;
  pthread_mutex_unlock(&s->mu);
  if (last) {
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s->acc);
    free(s);
  }
  free(c);
}

static const td_comm_vt threads_vt = {t_allreduce, t_allgather, t_send, t_recv, t_sendrecv, t_abort, t_destroy, NULL, NULL};

td_status td_comm_create_threads(int world, td_comm **comms) {
  if (world < 1 || world > MAX_WORLD) return td_err(TD_ERR_INVALID, "world of %d ranks (1 to %d)", world, MAX_WORLD);
  shared *s = calloc(1, sizeof *s);
  if (!s) return td_err(TD_ERR_NOMEM, "out of memory");
  s->world = world;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  for (int r = 0; r < world; r++) {
    comms[r] = calloc(1, sizeof **comms);
    if (!comms[r]) {
      for (int k = 0; k < r; k++) t_destroy(comms[k]);
      if (!r) free(s);
      return td_err(TD_ERR_NOMEM, "out of memory");
    }
    comms[r]->vt = &threads_vt;
    comms[r]->rank = r;
    comms[r]->world = world;
    comms[r]->impl = s;
    s->refs++;
  }
  return TD_OK;
}
