/* bench-serve's statistics: what a serving run measured per request, and
 * the summary it reports (throughput, time to first token, time per output
 * token, end-to-end latency at p50 / p90 / p99, goodput under latency
 * bounds). Pure functions of the samples, so that tests can check them on
 * known inputs. */
#ifndef TD_BENCH_SERVE_STATS_H
#define TD_BENCH_SERVE_STATS_H

#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"

/* One request as the load generator saw it (ms on one monotonic clock). */
typedef struct td_serve_sample {
  double submit_ms;  /* sent (open loop: its arrival time) */
  double first_ms;   /* its first output token arrived (0: none) */
  double done_ms;    /* its result arrived */
  int n_input;       /* prompt tokens (encoder input) */
  int n_out;         /* output tokens of its first sequence */
  bool ok;           /* ended with a result, not an error */
} td_serve_sample;

typedef struct td_serve_pct {
  double mean, p50, p90, p99, max;
  int n; /* how many requests the figure is over */
} td_serve_pct;

typedef struct td_serve_summary {
  int n, n_ok, n_failed;
  double duration_s;   /* first submit to last result */
  double req_s;        /* finished requests a second */
  double out_tok_s;    /* output tokens a second */
  double in_tok_s;     /* prompt tokens a second */
  td_serve_pct ttft;   /* ms, successful requests */
  td_serve_pct tpot;   /* ms per output token after the first (requests of 2+ tokens) */
  td_serve_pct e2e;    /* ms, submit to result */
  int n_good;          /* requests within both bounds */
  double goodput_req_s;
} td_serve_summary;

/* The p-th percentile (0..100) of n sorted values, interpolated linearly
 * between the closest ranks (numpy's default); 0 for n == 0. */
double td_serve_percentile(const double *sorted, int n, double p);
/* Summarises n samples. ttft_bound_ms / tpot_bound_ms (<= 0: no bound)
 * define goodput: successful requests whose TTFT and TPOT are both within
 * their bounds, a second. TD_ERR_INVALID for n < 0 or a sample whose
 * times run backwards. */
td_status td_serve_summarize(const td_serve_sample *s, int n, double ttft_bound_ms, double tpot_bound_ms,
                             td_serve_summary *out);

/* A worker's engine counters, as its health reports them (cumulative). */
typedef struct td_serve_counters {
  char id[64];
  unsigned long long steps, tokens, encode_runs, encoded;
  double busy_s, project_s; /* inside steps; projecting arrived encoder states (between steps) */
  unsigned long long began_ms, ended_ms; /* Unix ms: its engine last went from no work to work, ran out of it (0: never) */
} td_serve_counters;

/* What a worker did over a run: the counters' change between a look before
 * and one after, over the run's duration, which began at start_ms (Unix ms;
 * 0: unknown, no began / ended times). */
typedef struct td_serve_use {
  char id[64];
  double busy_pct;      /* time inside engine steps, of the run's duration */
  long long steps, tokens, encode_runs, encoded;
  double mean_batch;    /* tokens a step (0: no steps) */
  double step_ms;       /* busy time a step, encoder runs included (0: no steps) */
  double inputs_a_run;  /* inputs an encoder run (0: no runs) */
  double project_pct;   /* time projecting arrived encoder states, of the run's duration */
  /* when its work began after the run's start and ended before the run's end, ms (-1: not in the
   * run: it was working already, or still is): a worker that starts late or ends early idles */
  double began_ms, ended_ms;
} td_serve_use;

/* Each worker of `after` against its counters in `before` (a worker that
 * joined meanwhile from zero), over duration_s: n_after rows in out.
 * TD_ERR_INVALID for a duration <= 0 or counters that went down (a worker
 * restarted under the same id: its row would lie). */
td_status td_serve_worker_use(const td_serve_counters *before, int n_before, const td_serve_counters *after,
                              int n_after, double duration_s, double start_ms, td_serve_use *out);

/* Which side of a disaggregated cluster was short over a run, from its
 * workers' use (encoder-only workers: runs and no steps; decode workers:
 * steps, their projection counted with their steps), with what to change
 * (README, "Several GPUs", step 4), into buf. False, buf empty, where
 * there is no encoder-only worker or no decode worker. Sides within
 * TD_SERVE_SHORT_PTS points of each other are balanced. */
#define TD_SERVE_SHORT_PTS 5.0
bool td_serve_short_side(const td_serve_use *u, int n, char *buf, size_t cap);

#endif
