/* Test-only stand-in for kvtransfer/gpu_cuda.c: "device memory" is host
 * memory and copies are memcpy, so the staged pipeline (device-to-host,
 * puts into staging, CHUNK / CREDIT, host-to-device), the NCCL pipeline
 * (gather, send / receive, scatter) and CUDA IPC run in CI without a GPU.
 * Host copies run when issued. Device-to-device copies (the gather kernel:
 * its tables and CPU reference; IPC copies) wait on their stream like real
 * work: they run when an event recorded behind them completes, when a
 * stream waits for such an event, or when device memory is freed (cudaFree
 * synchronises), so a slot reused before its gather or scatter ran, or a
 * DONE sent before its copies ran, shows up as wrong bytes. Events report
 * completion only on their second query, so the engine's pending paths are
 * exercised. NCCL is faked between engines of one process (below); CUDA
 * IPC between processes through memfd (further below). */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gpu_fake.h"
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
/* Queues device copies on a stream: they run with fake_flush. */
static td_status fake_defer(kvx_gpu *g, int stream, void **dsts, const void **srcs, size_t *sizes, size_t n) {
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
td_status kvx_gpu_copy_d2d(kvx_gpu *g, int stream, void **dsts, const void **srcs, size_t *sizes, size_t n) {
  return fake_defer(g, stream, dsts, srcs, sizes, n);
}
td_status kvx_gpu_copy_many(kvx_gpu *g, int stream, void **dsts, const void **srcs, size_t *sizes, size_t n) {
  if (stream == KVX_S_IPC) return fake_defer(g, stream, dsts, srcs, sizes, n); /* device to device */
  for (size_t i = 0; i < n; i++) memcpy(dsts[i], srcs[i], sizes[i]);
  return TD_OK;
}
td_status kvx_gpu_copy(kvx_gpu *g, int stream, void *dst, const void *src, size_t bytes) {
  return kvx_gpu_copy_many(g, stream, &dst, &src, &bytes, 1);
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
/* The stream's later work runs after the event's: run what precedes it now. */
td_status kvx_gpu_wait(kvx_gpu *g, int stream, void *event) {
  fake_event *e = event;
  if (e) fake_flush(e->g, e->stream, e->seq);
  return TD_OK;
}
static int g_fail_record = -1;
void kvx_fake_fail_record(int stream) { g_fail_record = stream; }
void kvx_gpu_sync(kvx_gpu *g, int stream) { fake_flush(g, stream, g->issued[stream]); }
td_status kvx_gpu_record(kvx_gpu *g, int stream, void **event) {
  if (stream == g_fail_record) {
    *event = NULL;
    return td_err(TD_ERR_CUDA, "fake GPU: cudaEventRecord failed");
  }
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

/* ---- fake CUDA IPC ----
 * Shareable "device memory" is a memfd mapped shared; its handle names the
 * exporting process, the descriptor there and the file's inode, and an
 * opener maps it from /proc/PID/fd, so a mapping works across processes as
 * within one and, as with CUDA, stays valid after the exporter died. The
 * handle cannot be opened once the exporter is gone (another container
 * neither: kvx_fake_ipc_refuse). Copies into a mapping run deferred on the
 * IPC stream; closing a mapping with one still queued is counted
 * (kvx_fake_ipc_violations): the engine must wait for its copies first. */

typedef struct fake_mem {
  uint8_t *base;
  size_t size;
  int fd; /* exported allocations only */
  uint64_t ino;
  struct fake_mem *next;
} fake_mem;

typedef struct fake_handle {
  char magic[8];
  uint32_t pid;
  int32_t fd;
  uint64_t ino, size;
} fake_handle;

static fake_mem *g_exported, *g_mapped; /* the tests drive every context from one thread */
static bool g_refuse;
static int g_violations;

void *kvx_fake_dev_alloc(size_t bytes) {
  fake_mem *m = calloc(1, sizeof *m);
  int fd = memfd_create("td-fake-gpu", MFD_CLOEXEC);
  struct stat st;
  void *p = MAP_FAILED;
  if (m && fd >= 0 && ftruncate(fd, (off_t)bytes) == 0 && fstat(fd, &st) == 0)
    p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    if (fd >= 0) close(fd);
    free(m);
    return NULL;
  }
  *m = (fake_mem){p, bytes, fd, (uint64_t)st.st_ino, g_exported};
  g_exported = m;
  return p;
}

void kvx_fake_dev_free(void *p) {
  for (fake_mem **pp = &g_exported; *pp; pp = &(*pp)->next)
    if ((*pp)->base == p) {
      fake_mem *m = *pp;
      *pp = m->next;
      munmap(m->base, m->size);
      close(m->fd);
      free(m);
      return;
    }
}

void kvx_fake_ipc_refuse(bool refuse) { g_refuse = refuse; }
int kvx_fake_ipc_violations(void) { return g_violations; }
int kvx_fake_ipc_mapped(void) {
  int n = 0;
  for (fake_mem *m = g_mapped; m; m = m->next) n++;
  return n;
}

td_status kvx_gpu_dev_id(kvx_gpu *g, char out[KVX_DEV_ID_LEN + 1]) {
  snprintf(out, KVX_DEV_ID_LEN + 1, "fake-gpu-%d", g->device);
  return TD_OK;
}

td_status kvx_gpu_ipc_export(kvx_gpu *g, void *p, size_t bytes, uint8_t handle[KVX_IPC_HANDLE_LEN],
                             uint64_t *offset) {
  for (fake_mem *m = g_exported; m; m = m->next) {
    if ((uint8_t *)p < m->base || (uint8_t *)p + bytes > m->base + m->size) continue;
    fake_handle h = {"TDFAKEIP", (uint32_t)getpid(), m->fd, m->ino, m->size};
    memset(handle, 0, KVX_IPC_HANDLE_LEN);
    memcpy(handle, &h, sizeof h);
    *offset = (uint64_t)((uint8_t *)p - m->base);
    return TD_OK;
  }
  return td_err(TD_ERR_UNSUPPORTED, "fake GPU: %p is not shareable device memory", p);
}

td_status kvx_gpu_ipc_reach(kvx_gpu *g, const char *dev_id) {
  if (strncmp(dev_id, "fake-gpu-", 9) != 0)
    return td_err(TD_ERR_UNSUPPORTED, "fake GPU: device %s is not on this host", dev_id);
  return TD_OK;
}

td_status kvx_gpu_ipc_open(kvx_gpu *g, const uint8_t handle[KVX_IPC_HANDLE_LEN], void **base, size_t *size) {
  *base = NULL;
  *size = 0;
  fake_handle h;
  memcpy(&h, handle, sizeof h);
  if (memcmp(h.magic, "TDFAKEIP", 8) != 0) return td_err(TD_ERR_INVALID, "fake GPU: not an IPC handle");
  if (g_refuse) return td_err(TD_ERR_CUDA, "fake GPU: cudaIpcOpenMemHandle: invalid device context");
  char path[64];
  snprintf(path, sizeof path, "/proc/%u/fd/%d", h.pid, h.fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0 || (uint64_t)st.st_ino != h.ino || (uint64_t)st.st_size != h.size) {
    if (fd >= 0) close(fd);
    return td_err(TD_ERR_CUDA, "fake GPU: cudaIpcOpenMemHandle: the exporting process is gone");
  }
  void *p = mmap(NULL, h.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  fake_mem *m = calloc(1, sizeof *m);
  if (p == MAP_FAILED || !m) {
    if (p != MAP_FAILED) munmap(p, h.size);
    free(m);
    return td_err(TD_ERR_NOMEM, "fake GPU: mapping %llu bytes", (unsigned long long)h.size);
  }
  *m = (fake_mem){p, h.size, -1, h.ino, g_mapped};
  g_mapped = m;
  *base = p;
  *size = h.size;
  return TD_OK;
}

void kvx_gpu_ipc_close(kvx_gpu *g, void *base) {
  for (fake_mem **pp = &g_mapped; *pp; pp = &(*pp)->next) {
    fake_mem *m = *pp;
    if (m->base != base) continue;
    bool pending = false;
    for (fake_batch *b = g->head[KVX_S_IPC]; b; b = b->next)
      for (size_t i = 0; i < b->n; i++)
        pending |= (uint8_t *)b->d[i] + b->z[i] > m->base && (uint8_t *)b->d[i] < m->base + m->size;
    if (pending) {
      g_violations++;
      fake_flush(g, KVX_S_IPC, g->issued[KVX_S_IPC]); /* rather than write into an unmapped range later */
    }
    *pp = m->next;
    munmap(m->base, m->size);
    free(m);
    return;
  }
}
