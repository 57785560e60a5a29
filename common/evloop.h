/* The one event loop shape of every Tandem process (router, worker, group
 * follower), after Redis' ae: file events on ZeroMQ sockets and plain
 * descriptors, timers registered with a period, a before-sleep hook (the
 * last thing before polling: arm transports, flush) and an after-sleep
 * hook (what progresses every turn). The poll sleeps until the nearest
 * timer, never longer than max_wait_ms, and not at all when the
 * before-sleep hook says work is pending that signals no descriptor.
 *
 * Single-threaded: every call from the loop's own thread. Handlers may add
 * and remove events (their own included) and stop the loop. */
#ifndef TD_COMMON_EVLOOP_H
#define TD_COMMON_EVLOOP_H

#include <stdbool.h>

#include "common/status.h"

typedef struct td_loop td_loop;

/* A socket or descriptor turned readable. */
typedef void (*td_loop_io_fn)(td_loop *l, void *ctx);
/* A timer fired: returns the ms until it fires again, or TD_LOOP_DONE to
 * remove it. */
typedef int (*td_loop_timer_fn)(td_loop *l, void *ctx);
#define TD_LOOP_DONE (-1)
/* Before sleeping: false when work is pending that no descriptor signals
 * (the loop then polls without sleeping). */
typedef bool (*td_loop_sleep_fn)(td_loop *l, void *ctx);
/* After each poll, before the events are dispatched. */
typedef void (*td_loop_wake_fn)(td_loop *l, void *ctx);

/* max_wait_ms bounds each sleep (<= 0: 1000). */
td_status td_loop_create(int max_wait_ms, td_loop **out);
void td_loop_destroy(td_loop *l);

/* File events: fn runs when the ZeroMQ socket has a message or the
 * descriptor is readable. *id (optional) names the event for removal. */
td_status td_loop_add_socket(td_loop *l, void *zmq_socket, td_loop_io_fn fn, void *ctx, int *id);
td_status td_loop_add_fd(td_loop *l, int fd, td_loop_io_fn fn, void *ctx, int *id);
/* While fn is set (NULL: no more), it runs when the descriptor event id
 * can take bytes: a writer with bytes left over sets it, and clears it once
 * they are written. */
void td_loop_set_writable(td_loop *l, int id, td_loop_io_fn fn);
/* A descriptor event whose reader left input in its own buffer (pending):
 * its handler runs on the next turn as if the descriptor were readable,
 * and the loop does not sleep before it, until the reader clears it. */
void td_loop_set_pending(td_loop *l, int id, bool pending);
/* A timer that first fires after first_ms (0: on the next turn). */
td_status td_loop_add_timer(td_loop *l, int first_ms, td_loop_timer_fn fn, void *ctx, int *id);
/* Removes a file event or timer; unknown ids are ignored. */
void td_loop_remove(td_loop *l, int id);

void td_loop_set_before_sleep(td_loop *l, td_loop_sleep_fn fn, void *ctx);
/* For spin_us after a turn with file events the loop polls without
 * sleeping (0: never): the next message is taken without a wake-up of this
 * thread, at the cost of a core while it spins. */
void td_loop_set_spin(td_loop *l, int spin_us);
void td_loop_set_after_sleep(td_loop *l, td_loop_wake_fn fn, void *ctx);

/* One turn: before-sleep, poll, after-sleep, ready file events, due
 * timers. TD_ERR_NETWORK when the poll itself fails (EINTR is a turn). */
td_status td_loop_run_once(td_loop *l);
/* Turns until td_loop_stop (or a failed poll). */
td_status td_loop_run(td_loop *l);
void td_loop_stop(td_loop *l);
bool td_loop_stopped(const td_loop *l);

#endif
