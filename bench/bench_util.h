/* Shared by the benchmarks: where they run and how results are recorded. */
#ifndef TD_BENCH_UTIL_H
#define TD_BENCH_UTIL_H

#include <stddef.h>

/* "Intel Xeon ... x2 cores" or the GPU name when given. */
const char *td_bench_cpu_name(void);
/* Short commit of the source tree (git at run time, else the build's). */
const char *td_bench_commit(void);
/* Appends "## title" with date, device and commit, then body (a Markdown
 * table and notes), to bench/RESULTS.md (or $TD_RESULTS when set). */
int td_bench_record(const char *title, const char *device, const char *body);

/* A growing string for building tables. */
typedef struct td_sbuf {
  char *s;
  size_t n, cap;
} td_sbuf;
void td_sbuf_printf(td_sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void td_sbuf_free(td_sbuf *b);

#endif
