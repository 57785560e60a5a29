/* The shared event loop: socket and descriptor events, timers with
 * periods, removal from inside handlers, the before-sleep hook. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/evloop.h"

typedef struct counts {
  int socket, fd, timer_a, timer_b, once, before, after;
  void *rx;
  int efd;
  int remove_id;
  td_loop *l;
} counts;

static void on_socket(td_loop *l, void *ctx) {
  counts *c = ctx;
  char buf[16];
  while (zmq_recv(c->rx, buf, sizeof buf, ZMQ_DONTWAIT) >= 0) c->socket++;
  if (c->socket >= 3) td_loop_stop(l);
}

static void on_fd(td_loop *l, void *ctx) {
  counts *c = ctx;
  uint64_t v;
  if (read(c->efd, &v, sizeof v) == sizeof v) c->fd += (int)v;
  td_loop_stop(l);
}

static int timer_a(td_loop *l, void *ctx) {
  counts *c = ctx;
  if (++c->timer_a == 5) td_loop_stop(l);
  return 10;
}

static int timer_b(td_loop *l, void *ctx) {
  ((counts *)ctx)->timer_b++;
  return 1000;
}

static int timer_once(td_loop *l, void *ctx) {
  ((counts *)ctx)->once++;
  return TD_LOOP_DONE;
}

static int timer_remover(td_loop *l, void *ctx) {
  counts *c = ctx;
  td_loop_remove(l, c->remove_id);
  return 5;
}

static bool before_busy(td_loop *l, void *ctx) {
  counts *c = ctx;
  if (++c->before == 50) td_loop_stop(l);
  return false; /* never sleep */
}

static void after(td_loop *l, void *ctx) { ((counts *)ctx)->after++; }

Test(evloop, socket_events) {
  void *z = zmq_ctx_new();
  void *rx = zmq_socket(z, ZMQ_PULL), *tx = zmq_socket(z, ZMQ_PUSH);
  cr_assert_eq(zmq_bind(rx, "inproc://evloop"), 0);
  cr_assert_eq(zmq_connect(tx, "inproc://evloop"), 0);
  td_loop *l;
  cr_assert_eq(td_loop_create(50, &l), TD_OK);
  counts c = {.rx = rx};
  cr_assert_eq(td_loop_add_socket(l, rx, on_socket, &c, NULL), TD_OK);
  for (int i = 0; i < 3; i++) zmq_send(tx, "x", 1, 0);
  int64_t t0 = td_now_ms();
  cr_assert_eq(td_loop_run(l), TD_OK);
  cr_assert_eq(c.socket, 3);
  cr_assert_lt(td_now_ms() - t0, 1000);
  td_loop_destroy(l);
  zmq_close(tx);
  zmq_close(rx);
  zmq_ctx_term(z);
}

Test(evloop, fd_events_wake_the_poll) {
  td_loop *l;
  cr_assert_eq(td_loop_create(5000, &l), TD_OK);
  counts c = {.efd = eventfd(0, EFD_NONBLOCK)};
  cr_assert_geq(c.efd, 0);
  cr_assert_eq(td_loop_add_fd(l, c.efd, on_fd, &c, NULL), TD_OK);
  uint64_t two = 2;
  cr_assert_eq(write(c.efd, &two, sizeof two), (ssize_t)sizeof two);
  int64_t t0 = td_now_ms();
  cr_assert_eq(td_loop_run(l), TD_OK);
  cr_assert_eq(c.fd, 2);
  cr_assert_lt(td_now_ms() - t0, 1000, "a ready descriptor must not wait for max_wait_ms");
  close(c.efd);
  td_loop_destroy(l);
}

Test(evloop, timers_fire_at_their_period) {
  td_loop *l;
  cr_assert_eq(td_loop_create(1000, &l), TD_OK);
  counts c = {0};
  cr_assert_eq(td_loop_add_timer(l, 10, timer_a, &c, NULL), TD_OK);
  cr_assert_eq(td_loop_add_timer(l, 0, timer_b, &c, NULL), TD_OK);
  cr_assert_eq(td_loop_add_timer(l, 0, timer_once, &c, NULL), TD_OK);
  int64_t t0 = td_now_ms();
  cr_assert_eq(td_loop_run(l), TD_OK);
  int64_t took = td_now_ms() - t0;
  cr_assert_eq(c.timer_a, 5);
  cr_assert_eq(c.timer_b, 1, "a 1000 ms timer fires once in ~50 ms");
  cr_assert_eq(c.once, 1, "TD_LOOP_DONE removes the timer");
  /* the sleep follows the nearest timer, not max_wait_ms */
  cr_assert_geq(took, 45);
  cr_assert_lt(took, 900);
  td_loop_destroy(l);
}

Test(evloop, remove_from_a_handler) {
  td_loop *l;
  cr_assert_eq(td_loop_create(1000, &l), TD_OK);
  counts c = {0};
  int id;
  cr_assert_eq(td_loop_add_timer(l, 20, timer_b, &c, &id), TD_OK);
  c.remove_id = id;
  cr_assert_eq(td_loop_add_timer(l, 0, timer_remover, &c, NULL), TD_OK);
  cr_assert_eq(td_loop_add_timer(l, 10, timer_a, &c, NULL), TD_OK);
  cr_assert_eq(td_loop_run(l), TD_OK);
  cr_assert_eq(c.timer_b, 0, "removed before it was due");
  td_loop_remove(l, 12345); /* unknown: ignored */
  td_loop_destroy(l);
}

Test(evloop, before_sleep_false_means_no_sleep) {
  td_loop *l;
  cr_assert_eq(td_loop_create(1000, &l), TD_OK);
  counts c = {0};
  td_loop_set_before_sleep(l, before_busy, &c);
  td_loop_set_after_sleep(l, after, &c);
  int64_t t0 = td_now_ms();
  cr_assert_eq(td_loop_run(l), TD_OK);
  cr_assert_eq(c.before, 50);
  cr_assert_eq(c.after, 49, "the 50th turn stopped before its poll");
  cr_assert_lt(td_now_ms() - t0, 500, "50 turns must not sleep 1000 ms each");
  td_loop_destroy(l);
}

static void on_fd_count(td_loop *l, void *ctx) {
  counts *c = ctx;
  uint64_t v;
  if (read(c->efd, &v, sizeof v) == sizeof v) c->fd += (int)v;
}

/* --spin-us: after a turn with a file event the loop polls without
 * sleeping until the window ends, then sleeps as before. */
Test(evloop, spins_after_io_then_sleeps) {
  td_loop *l;
  cr_assert_eq(td_loop_create(300, &l), TD_OK);
  counts c = {.efd = eventfd(0, EFD_NONBLOCK)};
  cr_assert_geq(c.efd, 0);
  cr_assert_eq(td_loop_add_fd(l, c.efd, on_fd_count, &c, NULL), TD_OK);
  td_loop_set_spin(l, 5 * 1000 * 1000);
  uint64_t one = 1;
  cr_assert_eq(write(c.efd, &one, sizeof one), (ssize_t)sizeof one);
  cr_assert_eq(td_loop_run_once(l), TD_OK);
  cr_assert_eq(c.fd, 1);
  int64_t t0 = td_now_ms();
  for (int i = 0; i < 20; i++) cr_assert_eq(td_loop_run_once(l), TD_OK);
  cr_assert_lt(td_now_ms() - t0, 250, "turns inside the spin window must not sleep 300 ms");
  /* a short window: past it, an idle turn sleeps its max_wait_ms */
  td_loop_set_spin(l, 20 * 1000);
  cr_assert_eq(write(c.efd, &one, sizeof one), (ssize_t)sizeof one);
  cr_assert_eq(td_loop_run_once(l), TD_OK);
  cr_assert_eq(c.fd, 2);
  usleep(40 * 1000);
  t0 = td_now_ms();
  cr_assert_eq(td_loop_run_once(l), TD_OK);
  cr_assert_geq(td_now_ms() - t0, 250, "after the window the loop sleeps again");
  /* 0 turns spinning off: an idle turn right after an event sleeps */
  td_loop_set_spin(l, 0);
  cr_assert_eq(write(c.efd, &one, sizeof one), (ssize_t)sizeof one);
  cr_assert_eq(td_loop_run_once(l), TD_OK);
  t0 = td_now_ms();
  cr_assert_eq(td_loop_run_once(l), TD_OK);
  cr_assert_geq(td_now_ms() - t0, 250);
  close(c.efd);
  td_loop_destroy(l);
}

Test(evloop, refuses_bad_events) {
  td_loop *l;
  cr_assert_eq(td_loop_create(0, &l), TD_OK);
  cr_assert_eq(td_loop_add_fd(l, -1, on_fd, NULL, NULL), TD_ERR_INVALID);
  cr_assert_eq(td_loop_add_socket(l, NULL, on_fd, NULL, NULL), TD_ERR_INVALID);
  cr_assert_eq(td_loop_add_timer(l, 0, NULL, NULL, NULL), TD_ERR_INVALID);
  td_loop_destroy(l);
}

typedef struct wr {
  int reads, writes, id;
} wr;

static void wr_read(td_loop *l, void *ctx) {
  (void)l;
  ((wr *)ctx)->reads++;
}

static void wr_write(td_loop *l, void *ctx) {
  wr *w = ctx;
  if (++w->writes == 3) td_loop_set_writable(l, w->id, NULL); /* nothing left to write */
}

/* A descriptor's writable event runs while its writer sets it, and only
 * then; the read event is unaffected. */
Test(evloop, writable_while_asked) {
  td_loop *l;
  cr_assert_eq(td_loop_create(20, &l), TD_OK);
  int efd = eventfd(0, EFD_NONBLOCK);
  wr w = {0};
  cr_assert_eq(td_loop_add_fd(l, efd, wr_read, &w, &w.id), TD_OK);
  cr_assert_eq(td_loop_run_once(l), TD_OK);
  cr_expect_eq(w.writes, 0, "writable ran though nobody asked");
  td_loop_set_writable(l, w.id, wr_write);
  for (int i = 0; i < 6; i++) cr_assert_eq(td_loop_run_once(l), TD_OK);
  cr_expect_eq(w.writes, 3, "writable ran %d times", w.writes);
  cr_expect_eq(w.reads, 0);
  td_loop_set_writable(l, 12345, wr_write); /* an unknown id: nothing */
  cr_assert_eq(td_loop_run_once(l), TD_OK);
  cr_expect_eq(w.writes, 3);
  td_loop_destroy(l);
  close(efd);
}

static int wr_timer(td_loop *l, void *ctx) {
  (void)l;
  (void)ctx;
  return TD_LOOP_DONE;
}

/* Input a reader left in its own buffer: while pending, its handler runs
 * every turn without the descriptor being readable, and the loop does not
 * sleep (max_wait 1 s: the turns below would take seconds otherwise). */
Test(evloop, pending_input_runs_its_reader_without_a_wakeup) {
  td_loop *l;
  cr_assert_eq(td_loop_create(1000, &l), TD_OK);
  int efd = eventfd(0, EFD_NONBLOCK);
  wr w = {0};
  cr_assert_eq(td_loop_add_fd(l, efd, wr_read, &w, &w.id), TD_OK);
  td_loop_set_pending(l, w.id, true);
  int64_t t0 = td_now_ms();
  for (int i = 0; i < 5; i++) cr_assert_eq(td_loop_run_once(l), TD_OK);
  cr_expect_eq(w.reads, 5, "the pending reader ran %d times in 5 turns", w.reads);
  cr_expect_lt(td_now_ms() - t0, 500, "the loop slept with input pending");
  td_loop_set_pending(l, w.id, false);
  cr_assert_eq(td_loop_add_timer(l, 50, wr_timer, NULL, NULL), TD_OK);
  cr_assert_eq(td_loop_run_once(l), TD_OK); /* sleeps until the timer */
  cr_expect_eq(w.reads, 5, "a reader with nothing pending and nothing to read ran");
  td_loop_destroy(l);
  close(efd);
}
