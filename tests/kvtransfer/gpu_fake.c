/* Test-only stand-in for kvtransfer/gpu_cuda.c: "device memory" is host
 * memory and copies are memcpy, so the staged pipeline (device-to-host,
 * puts into staging, CHUNK / CREDIT, host-to-device) and the NCCL pipeline
 * (gather, send / receive, scatter) run in CI without a GPU. Host copies
 * run when issued. Device-to-device copies (the gather kernel: its tables
 * and CPU reference) wait on their stream like real work: they run when an
 * event recorded behind them completes, when a send waits for such an
 * event, or when device memory is freed (cudaFree synchronises), so a slot
 * reused before its gather or scatter ran shows up as wrong bytes. Events
 * report completion only on their second query, so the engine's pending
 * paths are exercised. NCCL is faked between engines of one process
 * (below). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvtransfer/gather.h"
#include "kvtransfer/gpu.h"

typedef struct fake_batch {
  size_t n;
  void **d;
  const void **s;
  size_t *z;
  struct fake_batch *next;
} fake_batch;

struct kvx_gpu {
  int device;
  fake_batch *head[KVX_S_COUNT], *tail[KVX_S_COUNT];
  uint64_t issued[KVX_S_COUNT], ran[KVX_S_COUNT];
};

typedef struct fake_event {
  int queries;
  kvx_gpu *g;
  int stream;
  uint64_t seq; /* device copies of the stream issued before it */
} fake_event;

/* Runs a stream's deferred device copies up to the seq-th. */
static void fake_flush(kvx_gpu *g, int stream, uint64_t seq) {
  kvx_gtable *t = NULL;
  while (g->ran[stream] < seq && g->head[stream]) {
    fake_batch *b = g->head[stream];
    if (!t && !(t = malloc(sizeof *t))) abort(); /* test code: no way to report */
    size_t i = 0, off = 0;
    while (kvx_gtable_fill(t, b->d, b->s, b->z, b->n, &i, &off) > 0) kvx_gtable_run_cpu(t);
    g->head[stream] = b->next;
    if (!b->next) g->tail[stream] = NULL;
    g->ran[stream]++;
    free(b->d);
    free(b->s);
    free(b->z);
    free(b);
  }
  free(t);
}

static void fake_sync(kvx_gpu *g) {
  for (int i = 0; i < KVX_S_COUNT; i++) fake_flush(g, i, g->issued[i]);
}

bool kvx_gpu_compiled(void) { return true; }
bool kvx_nccl_compiled(void) { return true; }

td_status kvx_gpu_create(int device, kvx_gpu **out) {
  *out = calloc(1, sizeof **out);
  if (!*out) return td_err(TD_ERR_NOMEM, "out of memory");
  (*out)->device = device;
  return TD_OK;
}
void kvx_gpu_destroy(kvx_gpu *g) {
  if (!g) return;
  fake_sync(g);
  free(g);
}
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
td_status kvx_gpu_copy_d2d(kvx_gpu *g, int stream, void **dsts, const void **srcs, size_t *sizes, size_t n) {
  fake_batch *b = calloc(1, sizeof *b);
  if (b) {
    b->d = malloc(sizeof(void *) * (n + 1));
    b->s = malloc(sizeof(void *) * (n + 1));
    b->z = malloc(sizeof(size_t) * (n + 1));
  }
  if (!b || !b->d || !b->s || !b->z) {
    if (b) {
      free(b->d);
      free(b->s);
      free(b->z);
    }
    free(b);
    return td_err(TD_ERR_NOMEM, "out of memory");
  }
  memcpy(b->d, dsts, sizeof(void *) * n);
  memcpy(b->s, srcs, sizeof(void *) * n);
  memcpy(b->z, sizes, sizeof(size_t) * n);
  b->n = n;
  if (g->tail[stream])
    g->tail[stream]->next = b;
  else
    g->head[stream] = b;
  g->tail[stream] = b;
  g->issued[stream]++;
  return TD_OK;
}
td_status kvx_gpu_dev_alloc(kvx_gpu *g, size_t bytes, void **out) {
  *out = calloc(1, bytes);
  return *out ? TD_OK : td_err(TD_ERR_NOMEM, "out of memory");
}
void kvx_gpu_dev_free(kvx_gpu *g, void *p) {
  if (!p) return;
  fake_sync(g);
  free(p);
}
td_status kvx_gpu_copy_sync(kvx_gpu *g, void *dst, const void *src, size_t bytes) {
  memcpy(dst, src, bytes);
  return TD_OK;
}
td_status kvx_gpu_wait(kvx_gpu *g, int stream, void *event) { return TD_OK; }
td_status kvx_gpu_record(kvx_gpu *g, int stream, void **event) {
  fake_event *e = calloc(1, sizeof *e);
  *event = e;
  if (!e) return td_err(TD_ERR_NOMEM, "out of memory");
  e->g = g;
  e->stream = stream;
  e->seq = g->issued[stream];
  return TD_OK;
}
int kvx_gpu_query(kvx_gpu *g, void *event) {
  fake_event *e = event;
  if (!e) return 1; /* an application's ready event */
  if (++e->queries < 2) return 0;
  fake_flush(e->g, e->stream, e->seq);
  return 1;
}
void kvx_gpu_release(kvx_gpu *g, void *event) { free(event); }

/* ---- fake NCCL ----
 * The two ranks of a communicator meet in a registry by unique id. Each
 * rank's operations queue in posting order; the heads of both queues match
 * when one is a send and the other a receive (NCCL's order between a pair),
 * and the bytes are copied then: a send reads its buffer when matched, as
 * the real one reads it when it runs, so a slot reused too early shows up
 * as wrong bytes. Sizes that differ fail both operations. A group counts
 * as being launched until the communicator's next poll (nothing may be
 * posted meanwhile), and reports completion on its second poll; a rank
 * that aborts leaves the other's operations pending, like a real peer's
 * abort. */

typedef struct fake_link fake_link;

struct kvx_nccl {
  fake_link *l;
  int rank;
  int enqueuing; /* polls left before the last group counts as launched */
};

/* One send or receive of a group, queued on its rank's side of the link. */
typedef struct fake_sub {
  kvx_nccl_op *op;
  fake_link *l; /* NULL once matched or unlinked */
  int rank;
  bool send;
  uint8_t *buf;
  size_t bytes;
  struct fake_sub *next;
} fake_sub;

struct kvx_nccl_op {
  int n, matched, polls;
  bool failed;
  fake_sub *subs;
};

struct fake_link {
  uint8_t id[KVX_NCCL_ID_BYTES];
  bool joined[2], gone[2];
  fake_sub *q[2];
  fake_link *next;
};

static fake_link *g_links;
static unsigned g_ids;

static void q_remove(fake_link *l, fake_sub *sub) {
  for (fake_sub **pp = &l->q[sub->rank]; *pp; pp = &(*pp)->next)
    if (*pp == sub) {
      *pp = sub->next;
      break;
    }
  sub->l = NULL;
  sub->next = NULL;
}

static void match(fake_link *l) {
  while (l->q[0] && l->q[1] && l->q[0]->send != l->q[1]->send) {
    fake_sub *a = l->q[0], *b = l->q[1];
    fake_sub *snd = a->send ? a : b, *rcv = a->send ? b : a;
    if (snd->bytes != rcv->bytes) {
      a->op->failed = b->op->failed = true;
    } else {
      memcpy(rcv->buf, snd->buf, snd->bytes);
    }
    a->op->matched++;
    b->op->matched++;
    q_remove(l, a);
    q_remove(l, b);
  }
}

td_status kvx_nccl_unique_id(uint8_t id[KVX_NCCL_ID_BYTES]) {
  memset(id, 0, KVX_NCCL_ID_BYTES);
  snprintf((char *)id, KVX_NCCL_ID_BYTES, "fake-nccl-%d-%u", (int)getpid(), ++g_ids);
  return TD_OK;
}

td_status kvx_nccl_create(kvx_gpu *g, const uint8_t id[KVX_NCCL_ID_BYTES], int rank, kvx_nccl **out) {
  *out = NULL;
  fake_link *l = g_links;
  while (l && memcmp(l->id, id, KVX_NCCL_ID_BYTES) != 0) l = l->next;
  if (!l) {
    l = calloc(1, sizeof *l);
    if (!l) return td_err(TD_ERR_NOMEM, "out of memory");
    memcpy(l->id, id, KVX_NCCL_ID_BYTES);
    l->next = g_links;
    g_links = l;
  }
  if (rank < 0 || rank > 1 || l->joined[rank]) return td_err(TD_ERR_INVALID, "fake NCCL: rank %d joined twice", rank);
  kvx_nccl *c = calloc(1, sizeof *c);
  if (!c) return td_err(TD_ERR_NOMEM, "out of memory");
  c->l = l;
  c->rank = rank;
  l->joined[rank] = true;
  *out = c;
  return TD_OK;
}

int kvx_nccl_poll(kvx_nccl *c) {
  if (c->enqueuing > 0) {
    c->enqueuing--;
    return 0;
  }
  return c->l->joined[1 - c->rank] ? 1 : 0;
}
bool kvx_nccl_idle(kvx_nccl *c) { return c->enqueuing == 0 && c->l->joined[1 - c->rank]; }
bool kvx_nccl_ready(kvx_nccl *c) { return c->l->joined[1 - c->rank]; }

td_status kvx_nccl_post(kvx_nccl *c, bool send, const kvx_nccl_buf *b, int n, kvx_nccl_op **out) {
  *out = NULL;
  if (!kvx_nccl_idle(c)) return td_err(TD_ERR_INTERNAL, "fake NCCL: communicator busy");
  kvx_nccl_op *op = calloc(1, sizeof *op);
  fake_sub *subs = calloc((size_t)n, sizeof *subs);
  if (!op || !subs || n <= 0) {
    free(op);
    free(subs);
    return td_err(TD_ERR_NOMEM, "out of memory");
  }
  op->n = n;
  op->subs = subs;
  for (int i = 0; i < n; i++) { /* the stream waits for the gathers */
    fake_event *e = b[i].wait;
    if (e) fake_flush(e->g, e->stream, e->seq);
  }
  fake_sub **pp = &c->l->q[c->rank];
  while (*pp) pp = &(*pp)->next;
  for (int i = 0; i < n; i++) {
    subs[i] = (fake_sub){op, c->l, c->rank, send, b[i].buf, b[i].bytes, NULL};
    *pp = &subs[i];
    pp = &subs[i].next;
  }
  match(c->l);
  c->enqueuing = 1;
  *out = op;
  return TD_OK;
}

int kvx_nccl_op_poll(kvx_nccl_op *op) {
  if (op->failed) {
    td_err(TD_ERR_NETWORK, "fake NCCL: send and receive sizes differ");
    return -1;
  }
  if (op->matched < op->n) return 0;
  return ++op->polls >= 2 ? 1 : 0;
}

void kvx_nccl_op_free(kvx_nccl_op *op) {
  if (!op) return;
  for (int i = 0; i < op->n; i++)
    if (op->subs[i].l) q_remove(op->subs[i].l, &op->subs[i]);
  free(op->subs);
  free(op);
}

void kvx_nccl_abort(kvx_nccl *c) {
  if (!c) return;
  fake_link *l = c->l;
  while (l->q[c->rank]) q_remove(l, l->q[c->rank]); /* the engine freed its ops first; detach any left */
  l->gone[c->rank] = true;
  if ((!l->joined[0] || l->gone[0]) && (!l->joined[1] || l->gone[1])) {
    for (fake_link **pp = &g_links; *pp; pp = &(*pp)->next)
      if (*pp == l) {
        *pp = l->next;
        break;
      }
    free(l);
  }
  free(c);
}
