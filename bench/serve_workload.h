/* bench-serve's workloads: the requests of a run and when they arrive.
 *   trt      input 260-440 tokens, output 20-128 (EOS ignored): the
 *            encoder-decoder table of TensorRT-LLM's docs;
 *   whisper  30 s of log-mel features (random), output 20-120;
 *   long     input 2000-4000 tokens, output 20-128 (T5's long inputs);
 *   a file   request lines of the JSON-lines format (README).
 * Lengths are uniform in their ranges and the token ids random, both from
 * the seed, so a run is repeatable and cluster and engine get the same
 * requests. With repeat K > 1 each synthetic input is asked K times in a
 * row (requests i*K .. i*K+K-1 share request i*K's input ids or features;
 * output lengths stay their own): the encoder cache's workload. */
#ifndef TD_BENCH_SERVE_WORKLOAD_H
#define TD_BENCH_SERVE_WORKLOAD_H

#include <stdint.h>

#include "common/jsonl.h"
#include "common/status.h"

typedef struct td_workload_opts {
  const char *name;    /* trt | whisper | long | a .jsonl file */
  int n;               /* requests (a file: its first n; 0: all of it) */
  uint64_t seed;
  int vocab;           /* token ids in [4, vocab) */
  int mel_bins, frames; /* whisper: the features' shape */
  int repeat;          /* synthetic: each input this many times in a row (0, 1: all different) */
  /* of the n requests, only those whose index is part modulo parts (parts 0 or 1: all): an engine with its
     share of a cluster's load on the cluster's own inputs */
  int part, parts;
} td_workload_opts;

typedef struct td_workload {
  td_json_request *reqs;
  int n;
  long long input_tokens, output_tokens; /* what the requests ask for (output: max_new_tokens) */
} td_workload;

#define TD_WORKLOAD_MAX_PARTS 1024

td_status td_workload_make(const td_workload_opts *o, td_workload *out);
void td_workload_free(td_workload *w);
/* Arrival times (ms from the start) of n requests: all at 0 when rate <= 0,
 * else a Poisson process of `rate` requests a second. */
void td_workload_arrivals(double rate, uint64_t seed, int n, double *t_ms);

#endif
