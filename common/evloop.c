#include "common/evloop.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>

#include <zmq.h>

#include "common/clock.h"

typedef enum { EV_FREE, EV_SOCKET, EV_FD, EV_TIMER } ev_type;

typedef struct loop_ev {
  ev_type type;
  int id;
  void *socket;
  int fd;
  td_loop_io_fn io;
  td_loop_io_fn on_write; /* descriptors: set while bytes wait to be written */
  bool pending;           /* descriptors: input waits in the reader's buffer */
  td_loop_timer_fn timer;
  int64_t due; /* timers: monotonic ms */
  void *ctx;
} loop_ev;

struct td_loop {
  int max_wait_ms;
  int64_t spin_ns;     /* poll without sleeping this long after a turn with file events */
  int64_t last_io_ns;  /* when the last turn with file events polled */
  loop_ev *evs;
  int n, cap;
  int next_id;
  bool stop;
  td_loop_sleep_fn before;
  void *before_ctx;
  td_loop_wake_fn after;
  void *after_ctx;
  zmq_pollitem_t *items; /* one per file event of the turn */
  int *item_ids;
  int items_cap;
};

td_status td_loop_create(int max_wait_ms, td_loop **out) {
  *out = NULL;
  td_loop *l = calloc(1, sizeof *l);
  if (!l) return td_err(TD_ERR_NOMEM, "event loop: out of memory");
  l->max_wait_ms = max_wait_ms > 0 ? max_wait_ms : 1000;
  l->next_id = 1;
  *out = l;
  return TD_OK;
}

void td_loop_destroy(td_loop *l) {
  if (!l) return;
  free(l->evs);
  free(l->items);
  free(l->item_ids);
  free(l);
}

static td_status add(td_loop *l, loop_ev e, int *id) {
  int slot = -1;
  for (int i = 0; i < l->n && slot < 0; i++)
    if (l->evs[i].type == EV_FREE) slot = i;
  if (slot < 0) {
    if (l->n == l->cap) {
      int cap = l->cap ? 2 * l->cap : 16;
      loop_ev *evs = realloc(l->evs, sizeof *evs * (size_t)cap);
      if (!evs) return td_err(TD_ERR_NOMEM, "event loop: out of memory");
      l->evs = evs;
      l->cap = cap;
    }
    slot = l->n++;
  }
  e.id = l->next_id++;
  if (l->next_id <= 0) l->next_id = 1;
  l->evs[slot] = e;
  if (id) *id = e.id;
  return TD_OK;
}

td_status td_loop_add_socket(td_loop *l, void *zmq_socket, td_loop_io_fn fn, void *ctx, int *id) {
  if (!zmq_socket || !fn) return td_err(TD_ERR_INVALID, "event loop: a socket event needs a socket and a handler");
  return add(l, (loop_ev){.type = EV_SOCKET, .socket = zmq_socket, .fd = -1, .io = fn, .ctx = ctx}, id);
}

td_status td_loop_add_fd(td_loop *l, int fd, td_loop_io_fn fn, void *ctx, int *id) {
  if (fd < 0 || !fn) return td_err(TD_ERR_INVALID, "event loop: a descriptor event needs a descriptor and a handler");
  return add(l, (loop_ev){.type = EV_FD, .fd = fd, .io = fn, .ctx = ctx}, id);
}

td_status td_loop_add_timer(td_loop *l, int first_ms, td_loop_timer_fn fn, void *ctx, int *id) {
  if (!fn) return td_err(TD_ERR_INVALID, "event loop: a timer needs a handler");
  int64_t due = td_now_ms() + (first_ms > 0 ? first_ms : 0);
  return add(l, (loop_ev){.type = EV_TIMER, .fd = -1, .timer = fn, .due = due, .ctx = ctx}, id);
}

void td_loop_remove(td_loop *l, int id) {
  for (int i = 0; i < l->n; i++)
    if (l->evs[i].type != EV_FREE && l->evs[i].id == id) l->evs[i].type = EV_FREE;
}

void td_loop_set_writable(td_loop *l, int id, td_loop_io_fn fn) {
  for (int i = 0; i < l->n; i++)
    if (l->evs[i].type == EV_FD && l->evs[i].id == id) l->evs[i].on_write = fn;
}

void td_loop_set_pending(td_loop *l, int id, bool pending) {
  for (int i = 0; i < l->n; i++)
    if (l->evs[i].type == EV_FD && l->evs[i].id == id) l->evs[i].pending = pending;
}

void td_loop_set_before_sleep(td_loop *l, td_loop_sleep_fn fn, void *ctx) {
  l->before = fn;
  l->before_ctx = ctx;
}

void td_loop_set_spin(td_loop *l, int spin_us) { l->spin_ns = spin_us > 0 ? (int64_t)spin_us * 1000 : 0; }

void td_loop_set_after_sleep(td_loop *l, td_loop_wake_fn fn, void *ctx) {
  l->after = fn;
  l->after_ctx = ctx;
}

void td_loop_stop(td_loop *l) { l->stop = true; }
bool td_loop_stopped(const td_loop *l) { return l->stop; }

static int find(const td_loop *l, int id) {
  for (int i = 0; i < l->n; i++)
    if (l->evs[i].type != EV_FREE && l->evs[i].id == id) return i;
  return -1;
}

static td_status collect_items(td_loop *l, int *n_items) {
  if (l->items_cap < l->n) {
    zmq_pollitem_t *it = realloc(l->items, sizeof *it * (size_t)l->n);
    if (it) l->items = it;
    int *ids = realloc(l->item_ids, sizeof *ids * (size_t)l->n);
    if (ids) l->item_ids = ids;
    if (!it || !ids) return td_err(TD_ERR_NOMEM, "event loop: out of memory");
    l->items_cap = l->n;
  }
  int k = 0;
  for (int i = 0; i < l->n; i++) {
    const loop_ev *e = &l->evs[i];
    if (e->type == EV_SOCKET)
      l->items[k] = (zmq_pollitem_t){.socket = e->socket, .events = ZMQ_POLLIN};
    else if (e->type == EV_FD)
      l->items[k] = (zmq_pollitem_t){.fd = e->fd, .events = (short)(ZMQ_POLLIN | (e->on_write ? ZMQ_POLLOUT : 0))};
    else
      continue;
    l->item_ids[k++] = e->id;
  }
  *n_items = k;
  return TD_OK;
}

td_status td_loop_run_once(td_loop *l) {
  int n_items = 0;
  TD_TRY(collect_items(l, &n_items));
  int64_t now = td_now_ms();
  int64_t wait = l->max_wait_ms;
  for (int i = 0; i < l->n; i++)
    if (l->evs[i].type == EV_TIMER && l->evs[i].due - now < wait) wait = l->evs[i].due - now;
  if (wait < 0) wait = 0;
  /* last before sleeping: a hook with work that signals nothing keeps us awake */
  if (l->before && !l->before(l, l->before_ctx)) wait = 0;
  for (int i = 0; i < l->n && wait; i++)
    if (l->evs[i].type == EV_FD && l->evs[i].pending) wait = 0;
  if (l->stop) return TD_OK;
  int64_t t_poll = l->spin_ns ? td_now_ns() : 0;
  if (l->spin_ns && t_poll - l->last_io_ns < l->spin_ns) wait = 0;
  int rc = zmq_poll(n_items ? l->items : NULL, n_items, (long)wait);
  if (rc < 0 && zmq_errno() != EINTR)
    return td_err(TD_ERR_NETWORK, "event loop: poll: %s", zmq_strerror(zmq_errno()));
  if (rc > 0 && l->spin_ns) l->last_io_ns = t_poll;
  if (l->after) l->after(l, l->after_ctx);
  for (int k = 0; k < n_items && !l->stop; k++) {
    short re = rc > 0 ? l->items[k].revents : 0;
    int i = find(l, l->item_ids[k]); /* an earlier handler may have removed it */
    if (i >= 0 && l->evs[i].pending) re |= ZMQ_POLLIN;
    if (i >= 0 && (re & ZMQ_POLLOUT) && l->evs[i].on_write) l->evs[i].on_write(l, l->evs[i].ctx);
    i = find(l, l->item_ids[k]); /* the writer may have removed it */
    /* a closed descriptor reports an error: its reader sees the end */
    if (i >= 0 && (re & (ZMQ_POLLIN | ZMQ_POLLERR))) l->evs[i].io(l, l->evs[i].ctx);
  }
  /* due timers, each at most once a turn; ids taken first, since handlers may add */
  now = td_now_ms();
  int n = l->n;
  for (int i = 0; i < n && !l->stop; i++) {
    if (l->evs[i].type != EV_TIMER || l->evs[i].due > now) continue;
    int id = l->evs[i].id;
    int next = l->evs[i].timer(l, l->evs[i].ctx);
    int j = find(l, id);
    if (j < 0) continue;
    if (next < 0)
      l->evs[j].type = EV_FREE;
    else
      l->evs[j].due = td_now_ms() + next;
  }
  return TD_OK;
}

td_status td_loop_run(td_loop *l) {
  l->stop = false;
  while (!l->stop) TD_TRY(td_loop_run_once(l));
  return TD_OK;
}
