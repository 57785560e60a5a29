/* Shared by the benchmarks: where they run and how results are recorded. */
#ifndef TD_BENCH_UTIL_H
#define TD_BENCH_UTIL_H

#include <stddef.h>

/* "Intel Xeon ... x2 cores" or the GPU name when given. */
const char *td_bench_cpu_name(void);
/* Where a benchmark records its results and which commit they name, as
 * its main found them (TD_RESULTS, TD_COMMIT in the environment: a copy of
 * the tree on a GPU machine may carry a stale .git). */
typedef struct td_bench_out {
  const char *results; /* NULL or "": bench/RESULTS.md of the source tree */
  const char *commit;  /* NULL or "": git at run time, else the build's */
} td_bench_out;
/* Short commit of the source tree: o's, else git's at run time, else the build's. */
const char *td_bench_commit(const td_bench_out *o);
/* Appends "## title" with date, device and commit, then body (a Markdown
 * table and notes), to o's results file. */
int td_bench_record(const td_bench_out *o, const char *title, const char *device, const char *body);

/* A growing string for building tables. */
typedef struct td_sbuf {
  char *s;
  size_t n, cap;
} td_sbuf;
void td_sbuf_printf(td_sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void td_sbuf_free(td_sbuf *b);

#endif
