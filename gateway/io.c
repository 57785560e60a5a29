/* The router link: one thread owns the td_client (the library is driven by
 * one thread) and every HTTP request shares it. HTTP threads hand it
 * batches through a queue; it sends them, polls the router, and writes
 * tokens and results into the batch under the batch's mutex, waking the
 * HTTP thread that waits on it. While requests are in flight it waits on
 * the router socket and an eventfd that new work writes to (so a request
 * goes out at once, not at the next poll); idle, it sleeps on the queue
 * (docs/gateway.md, "Threads"). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "gateway/internal.h"

typedef struct op {
  bool cancel;
  gw_batch *b;
  struct op *next;
} op;

struct gw_io {
  td_client *c;
  uint32_t timeout_ms;
  pthread_t thread;
  pthread_mutex_t mu; /* the queue and stop */
  pthread_cond_t cv;
  op *head, *tail;
  bool stop;
  int efd; /* written when work is queued: wakes the thread out of its router poll */
  unsigned long long next_id;
  gw_sub *table; /* in flight at the router: the thread's alone */
  int spin_us;
  int max_spinners;           /* HTTP threads spinning at once, at most */
  _Atomic int spinners;
  unsigned long long n_events; /* router events handled: the thread's alone */
};

static void wake_batch(gw_batch *b) {
  atomic_fetch_add_explicit(&b->events, 1u, memory_order_release);
  pthread_cond_broadcast(&b->cv);
}

static void batch_unref_locked(gw_batch *b, bool *freed) {
  *freed = --b->refs == 0;
}

static void batch_free(gw_batch *b) {
  for (int i = 0; i < b->n; i++) {
    gw_sub *s = &b->subs[i];
    td_json_request_free(&s->req);
    for (int k = 0; k < TD_ROUTER_MAX_SAMPLES; k++) {
      td_i32vec_free(&s->out[k].tok);
      td_f32vec_free(&s->out[k].lp);
    }
  }
  pthread_mutex_destroy(&b->mu);
  pthread_cond_destroy(&b->cv);
  free(b->subs);
  free(b);
}

gw_batch *gw_batch_create(gw_io *io, int n) {
  gw_batch *b = calloc(1, sizeof *b);
  if (!b || !(b->subs = calloc((size_t)n, sizeof *b->subs))) {
    free(b);
    return NULL;
  }
  pthread_mutex_init(&b->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&b->cv, &ca);
  pthread_condattr_destroy(&ca);
  b->refs = 1;
  b->n = n;
  b->io = io;
  pthread_mutex_lock(&io->mu);
  unsigned long long first = io->next_id;
  io->next_id += (unsigned long long)n;
  pthread_mutex_unlock(&io->mu);
  for (int i = 0; i < n; i++) {
    snprintf(b->subs[i].id, sizeof b->subs[i].id, "gw-%llu", first + (unsigned long long)i);
    b->subs[i].b = b;
    td_request_params_default(&b->subs[i].req.params);
  }
  return b;
}

void gw_batch_release(gw_batch *b) {
  if (!b) return;
  pthread_mutex_lock(&b->mu);
  bool freed;
  batch_unref_locked(b, &freed);
  pthread_mutex_unlock(&b->mu);
  if (freed) batch_free(b);
}

bool gw_batch_wait(gw_batch *b, int64_t deadline_ms) {
  int64_t now = td_now_ms();
  if (now >= deadline_ms) return false;
  gw_io *io = b->io;
  if (io && io->spin_us > 0 && atomic_fetch_add(&io->spinners, 1) < io->max_spinners) {
    unsigned seen = atomic_load_explicit(&b->events, memory_order_acquire);
    pthread_mutex_unlock(&b->mu);
    int64_t end = td_now_ns() + (int64_t)io->spin_us * 1000;
    bool moved = false;
    while (!moved && td_now_ns() < end) moved = atomic_load_explicit(&b->events, memory_order_acquire) != seen;
    atomic_fetch_sub(&io->spinners, 1);
    pthread_mutex_lock(&b->mu);
    if (moved) return td_now_ms() < deadline_ms;
    now = td_now_ms();
    if (now >= deadline_ms) return false;
  } else if (io && io->spin_us > 0) {
    atomic_fetch_sub(&io->spinners, 1);
  }
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  int64_t left = deadline_ms - now;
  ts.tv_sec += left / 1000;
  ts.tv_nsec += (left % 1000) * 1000000;
  if (ts.tv_nsec >= 1000000000) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000;
  }
  pthread_cond_timedwait(&b->cv, &b->mu, &ts);
  return td_now_ms() < deadline_ms;
}

gw_batch *gw_window_batch(gw_io *io, size_t n_feat, int n_prompt, gw_sub **s, gw_error *e) {
  gw_batch *b = gw_batch_create(io, 1);
  td_json_request *r = b ? &b->subs[0].req : NULL;
  if (r) {
    snprintf(r->id, sizeof r->id, "%s", b->subs[0].id);
    r->n_features = n_feat;
    r->features = malloc(sizeof *r->features * n_feat);
    r->prompt = malloc(sizeof *r->prompt * (size_t)(n_prompt > 0 ? n_prompt : 1));
  }
  if (!r || !r->features || !r->prompt) {
    gw_batch_release(b);
    gw_error_set(e, 500, NULL, "out of memory");
    return NULL;
  }
  *s = &b->subs[0];
  return b;
}

bool gw_sub_wait(gw_batch *b, const gw_sub *s, int64_t deadline_ms) {
  bool timed_out = false;
  while (!s->done && !timed_out) timed_out = !gw_batch_wait(b, deadline_ms) && !s->done;
  return timed_out;
}

/* Ends a sub (under b->mu) and drops the link's reference; the caller
 * has taken it out of the table. Returns whether the batch is to be freed. */
static bool end_sub(gw_sub *s, td_status st, const char *msg) {
  gw_batch *b = s->b;
  if (!s->done) {
    s->done = true;
    s->status = st;
    if (st != TD_OK) snprintf(s->error, sizeof s->error, "%s", msg ? msg : td_status_str(st));
    b->n_done++;
  }
  wake_batch(b);
  bool freed;
  batch_unref_locked(b, &freed);
  return freed;
}

static void finish(gw_io *io, gw_sub *s, td_status st, const char *msg, const td_client_result *r) {
  HASH_DEL(io->table, s);
  gw_batch *b = s->b;
  pthread_mutex_lock(&b->mu);
  if (!s->first_ns) s->first_ns = td_now_ns();
  if (r && st == TD_OK) {
    int n = r->n_outputs < TD_ROUTER_MAX_SAMPLES ? r->n_outputs : TD_ROUTER_MAX_SAMPLES;
    for (int i = 0; i < n; i++) {
      gw_out *o = &s->out[i];
      const td_seq_output *x = &r->outputs[i];
      /* the result is authoritative: it replaces what was streamed */
      if (td_i32vec_assign(&o->tok, x->tokens, x->n_tokens) != TD_OK) {
        st = td_err(TD_ERR_NOMEM, "out of memory");
        msg = td_errmsg();
        break;
      }
      o->lp.n = 0;
      if (x->logprobs) td_f32vec_append(&o->lp, x->logprobs, x->n_tokens);
      o->finish = x->finish;
      o->score = x->score;
      o->has_probe = x->has_probe;
      o->probe = x->probe_prob;
    }
    if (n > s->n_out) s->n_out = n;
  }
  bool freed = end_sub(s, st, msg);
  pthread_mutex_unlock(&b->mu);
  if (freed) batch_free(b);
}

static void on_tokens(void *ctx, const char *id, int seq, int offset, const int32_t *t, const float *lp, int n) {
  gw_io *io = ctx;
  io->n_events++;
  gw_sub *s = NULL;
  HASH_FIND_STR(io->table, id, s);
  if (!s || seq < 0 || seq >= TD_ROUTER_MAX_SAMPLES || offset < 0) return;
  pthread_mutex_lock(&s->b->mu);
  if (!s->first_ns && n > 0) s->first_ns = td_now_ns();
  gw_out *o = &s->out[seq];
  /* a resumed request repeats no token; a restarted sample starts over at 0: keep what was given out */
  if (offset <= o->tok.n) {
    int skip = o->tok.n - offset;
    for (int i = skip; i < n; i++) {
      td_i32vec_push(&o->tok, t[i]);
      if (lp) td_f32vec_push(&o->lp, lp[i]);
    }
  }
  if (seq + 1 > s->n_out) s->n_out = seq + 1;
  if (!s->b->quiet) wake_batch(s->b); /* a wake-up a token costs more than the token */
  pthread_mutex_unlock(&s->b->mu);
}

static void on_result(void *ctx, const td_client_result *r) {
  gw_io *io = ctx;
  io->n_events++;
  gw_sub *s = NULL;
  HASH_FIND_STR(io->table, r->id, s);
  if (!s) return;
  finish(io, s, r->status, r->error, r);
}

/* Each unsent sub holds a reference, so b lives while one is left; once the
 * last has ended (a send that failed at once, as over a local link whose
 * router is down), the HTTP thread may free b: not read again. */
static void send_batch(gw_io *io, gw_batch *b) {
  const int n = b->n;
  for (int i = 0; i < n; i++) {
    gw_sub *s = &b->subs[i];
    td_status st = td_client_generate(io->c, &s->req, s->stream, io->timeout_ms);
    if (st == TD_OK) {
      pthread_mutex_lock(&b->mu);
      s->sent_ns = td_now_ns();
      pthread_mutex_unlock(&b->mu);
      HASH_ADD_STR(io->table, id, s);
      continue;
    }
    TD_WARN("gateway: %s not sent: %s", s->id, td_errmsg());
    pthread_mutex_lock(&b->mu);
    bool freed = end_sub(s, TD_ERR_NETWORK, td_errmsg());
    pthread_mutex_unlock(&b->mu);
    if (freed) {
      batch_free(b);
      return;
    }
  }
}

static void cancel_batch(gw_io *io, gw_batch *b) {
  for (int i = 0; i < b->n; i++) {
    gw_sub *s = NULL;
    HASH_FIND_STR(io->table, b->subs[i].id, s);
    if (!s) continue;
    (void)td_client_cancel(io->c, s->id);
    finish(io, s, TD_ERR_CANCELLED, "cancelled", NULL);
  }
  gw_batch_release(b); /* the cancel op's reference */
}

static void *run(void *arg) {
  gw_io *io = arg;
  td_client_events ev = {.on_tokens = on_tokens, .on_result = on_result, .ctx = io};
  for (;;) {
    pthread_mutex_lock(&io->mu);
    while (!io->stop && !io->head && !io->table) pthread_cond_wait(&io->cv, &io->mu);
    op *q = io->head;
    io->head = io->tail = NULL;
    bool stop = io->stop;
    pthread_mutex_unlock(&io->mu);
    while (q) {
      op *next = q->next;
      if (q->cancel)
        cancel_batch(io, q->b);
      else
        send_batch(io, q->b);
      free(q);
      q = next;
    }
    if (stop) break;
    bool woken = false;
    if (io->table && io->spin_us > 0) {
      /* requests in flight: poll without sleeping for a while, so that an answer (or new work)
         is seen without a wake-up's latency */
      int64_t end = td_now_ns() + (int64_t)io->spin_us * 1000;
      unsigned long long seen = io->n_events;
      td_status ps = TD_OK;
      while (ps == TD_OK && !woken && io->n_events == seen && td_now_ns() < end)
        ps = td_client_poll_fd(io->c, io->efd, 0, &ev, &woken);
      if (ps == TD_OK && !woken && io->n_events == seen)
        ps = td_client_poll_fd(io->c, io->efd, TD_GATEWAY_IO_POLL_MS, &ev, &woken);
      if (ps != TD_OK) TD_WARN("gateway: polling the router: %s", td_errmsg());
    } else if (io->table && td_client_poll_fd(io->c, io->efd, TD_GATEWAY_IO_POLL_MS, &ev, &woken) != TD_OK) {
      TD_WARN("gateway: polling the router: %s", td_errmsg());
    }
    uint64_t cnt;
    if (woken && read(io->efd, &cnt, sizeof cnt) < 0) TD_DEBUG("gateway: eventfd read failed");
  }
  gw_sub *s, *t;
  HASH_ITER(hh, io->table, s, t) finish(io, s, TD_ERR_CANCELLED, "the gateway is shutting down", NULL);
  return NULL;
}

static void wake(gw_io *io) {
  uint64_t one = 1;
  if (write(io->efd, &one, sizeof one) < 0) TD_DEBUG("gateway: eventfd write failed");
}

static void enqueue(gw_io *io, gw_batch *b, bool cancel) {
  op *q = calloc(1, sizeof *q);
  pthread_mutex_lock(&b->mu);
  b->refs += cancel ? 1 : b->n; /* the link holds each sub until it ends */
  pthread_mutex_unlock(&b->mu);
  if (!q) {
    pthread_mutex_lock(&b->mu);
    for (int i = 0; i < b->n && !cancel; i++) {
      bool freed = end_sub(&b->subs[i], TD_ERR_NOMEM, "out of memory");
      (void)freed; /* the caller's reference keeps it */
    }
    if (cancel) b->refs--;
    pthread_mutex_unlock(&b->mu);
    return;
  }
  q->cancel = cancel;
  q->b = b;
  pthread_mutex_lock(&io->mu);
  if (io->stop) {
    pthread_mutex_unlock(&io->mu);
    free(q);
    pthread_mutex_lock(&b->mu);
    if (cancel)
      b->refs--;
    else
      for (int i = 0; i < b->n; i++) (void)end_sub(&b->subs[i], TD_ERR_CANCELLED, "the gateway is shutting down");
    pthread_mutex_unlock(&b->mu);
    return;
  }
  if (io->tail)
    io->tail->next = q;
  else
    io->head = q;
  io->tail = q;
  pthread_cond_signal(&io->cv);
  pthread_mutex_unlock(&io->mu);
  wake(io);
}

void gw_io_submit(gw_io *io, gw_batch *b) { enqueue(io, b, false); }
void gw_io_cancel(gw_io *io, gw_batch *b) { enqueue(io, b, true); }

td_status gw_io_create(const char *router, const td_auth *auth, uint32_t timeout_ms, int spin_us, gw_io **out) {
  *out = NULL;
  gw_io *io = calloc(1, sizeof *io);
  if (!io) return td_err(TD_ERR_NOMEM, "out of memory");
  io->spin_us = spin_us > 0 ? spin_us : 0;
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  io->max_spinners = cpus >= 8 ? (int)(cpus / 4) : 1;
  td_status s = td_client_connect_auth(router, auth, &io->c);
  if (s != TD_OK) {
    free(io);
    return s;
  }
  io->timeout_ms = timeout_ms;
  io->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (io->efd < 0) {
    td_client_close(io->c);
    free(io);
    return td_err(TD_ERR_IO, "eventfd failed");
  }
  pthread_mutex_init(&io->mu, NULL);
  pthread_cond_init(&io->cv, NULL);
  if (pthread_create(&io->thread, NULL, run, io) != 0) {
    close(io->efd);
    td_client_close(io->c);
    pthread_mutex_destroy(&io->mu);
    pthread_cond_destroy(&io->cv);
    free(io);
    return td_err(TD_ERR_IO, "cannot start the router link's thread");
  }
  *out = io;
  return TD_OK;
}

void gw_io_stop(gw_io *io) {
  pthread_mutex_lock(&io->mu);
  bool was = io->stop;
  io->stop = true;
  pthread_cond_signal(&io->cv);
  pthread_mutex_unlock(&io->mu);
  wake(io);
  if (!was) pthread_join(io->thread, NULL);
}

void gw_io_destroy(gw_io *io) {
  if (!io) return;
  gw_io_stop(io);
  close(io->efd);
  td_client_close(io->c);
  pthread_mutex_destroy(&io->mu);
  pthread_cond_destroy(&io->cv);
  free(io);
}
