/* Kernel timeline of a stretch of GPU work, through CUPTI's activity API
 * (benchmarks only): start / end of every kernel, graph replays included,
 * and how much each kernel added to the critical path. */
#ifndef TD_BENCH_KERNEL_TRACE_H
#define TD_BENCH_KERNEL_TRACE_H

#include <stdbool.h>
#include <stdio.h>

/* false where the build has no CUPTI */
bool td_ktrace_available(void);
/* Starts recording kernels (call before the CUDA work of interest; recording
 * slows every launch down, so only around it). */
int td_ktrace_begin(void);
/* Drops what was recorded so far. */
int td_ktrace_discard(void);
/* Stops, prints each kernel in start order (duration, and the time its end
 * added to the latest end so far) and a summary by kernel name to f. */
int td_ktrace_end(FILE *f, const char *title);
/* The same for the kernels of one device only (-1: every device). */
int td_ktrace_end_device(FILE *f, const char *title, int device);

#endif
