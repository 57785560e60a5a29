#include "serve_workload.h"

#include <errno.h>
#include <libgen.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"

/* Whether request i is in the part asked for. */
static bool in_part(const td_workload_opts *o, int i) { return o->parts <= 1 || i % o->parts == o->part; }

/* Uniform integer in [lo, hi] from (seed, stream, step). */
static int uniform(uint64_t seed, uint32_t stream, uint32_t step, int lo, int hi) {
  int v = lo + (int)(td_rand_uniform(seed, stream, step) * (float)(hi - lo + 1));
  return v > hi ? hi : v;
}

enum { S_IN_LEN, S_OUT_LEN, S_IDS, S_FEATS, S_ARRIVAL };

static td_status synth(const td_workload_opts *o, int in_lo, int in_hi, int out_lo, int out_hi, bool audio,
                       td_workload *w) {
  if (o->n <= 0) return td_err(TD_ERR_INVALID, "workload %s: %d requests", o->name, o->n);
  if (!audio && o->vocab <= 4) return td_err(TD_ERR_INVALID, "workload %s: vocabulary of %d", o->name, o->vocab);
  if (audio && (o->mel_bins <= 0 || o->frames <= 0))
    return td_err(TD_ERR_INVALID, "workload %s: features of %d x %d", o->name, o->mel_bins, o->frames);
  w->reqs = calloc((size_t)o->n, sizeof *w->reqs);
  if (!w->reqs) return td_err(TD_ERR_NOMEM, "out of memory");
  int rep = o->repeat > 1 ? o->repeat : 1;
  for (int i = 0; i < o->n; i++) {
    if (!in_part(o, i)) continue;
    td_json_request *r = &w->reqs[w->n++];
    int src = i / rep * rep; /* the request whose input this one repeats */
    snprintf(r->id, sizeof r->id, "%s-%d", o->name, i);
    td_request_params_default(&r->params);
    r->params.max_new_tokens = uniform(o->seed, S_OUT_LEN, (uint32_t)i, out_lo, out_hi);
    r->params.ignore_eos = true;
    w->output_tokens += r->params.max_new_tokens;
    if (audio) {
      size_t nf = (size_t)o->mel_bins * (size_t)o->frames;
      r->features = malloc(sizeof(float) * nf);
      if (!r->features) return td_err(TD_ERR_NOMEM, "out of memory");
      r->n_features = nf;
      /* seed and request mixed, not XORed: seed ^ i over i < 256 is the same
       * set of inputs for every seed below 256, so a second run with another
       * seed hit the encoder cache for all of them */
      uint64_t fs = o->seed * 0x9E3779B97F4A7C15ULL + (uint64_t)src * 0xBF58476D1CE4E5B9ULL;
      for (size_t k = 0; k < nf; k++) r->features[k] = 2.0f * td_rand_uniform(fs, S_FEATS, (uint32_t)k) - 1.0f;
      w->input_tokens += o->frames / 2; /* encoder positions */
    } else {
      int len = uniform(o->seed, S_IN_LEN, (uint32_t)src, in_lo, in_hi);
      r->input_ids = malloc(sizeof(int32_t) * (size_t)len);
      if (!r->input_ids) return td_err(TD_ERR_NOMEM, "out of memory");
      r->n_input = len;
      for (int k = 0; k < len; k++)
        r->input_ids[k] = uniform(o->seed ^ ((uint64_t)src << 20), S_IDS, (uint32_t)k, 4, o->vocab - 1);
      w->input_tokens += len;
    }
  }
  return TD_OK;
}

static td_status from_file(const td_workload_opts *o, td_workload *w) {
  FILE *f = fopen(o->name, "r");
  if (!f) return td_err(TD_ERR_INVALID, "workload %s: %s", o->name, strerror(errno));
  char dir[4096];
  snprintf(dir, sizeof dir, "%s", o->name);
  const char *base = dirname(dir);
  char *line = NULL;
  size_t cap = 0;
  ssize_t len;
  int line_no = 0, n_cap = 0, index = 0;
  td_status s = TD_OK;
  while ((o->n <= 0 || index < o->n) && (len = getline(&line, &cap, f)) > 0) {
    line_no++;
    if (len <= 1) continue;
    if (!in_part(o, index++)) continue;
    if (w->n == n_cap) {
      n_cap = n_cap ? 2 * n_cap : 64;
      td_json_request *r = realloc(w->reqs, sizeof *r * (size_t)n_cap);
      if (!r) {
        s = td_err(TD_ERR_NOMEM, "out of memory");
        break;
      }
      w->reqs = r;
    }
    td_json_request *r = &w->reqs[w->n];
    if ((s = td_json_request_parse(line, (size_t)len, base, line_no, r)) != TD_OK) break;
    w->n++;
    w->input_tokens += r->n_input ? r->n_input : (long long)r->n_features;
    w->output_tokens += r->params.max_new_tokens;
  }
  free(line);
  fclose(f);
  if (s == TD_OK && !w->n) s = td_err(TD_ERR_INVALID, "workload %s: no requests%s", o->name,
                                      o->parts > 1 ? " in the part asked for" : "");
  return s;
}

td_status td_workload_make(const td_workload_opts *o, td_workload *out) {
  memset(out, 0, sizeof *out);
  if (o->parts < 0 || o->parts > TD_WORKLOAD_MAX_PARTS || (o->parts > 1 && (o->part < 0 || o->part >= o->parts)))
    return td_err(TD_ERR_INVALID, "workload part %d of %d: parts 1 to %d, the part below them", o->part, o->parts,
                  TD_WORKLOAD_MAX_PARTS);
  td_status s;
  if (!strcmp(o->name, "trt"))
    s = synth(o, 260, 440, 20, 128, false, out);
  else if (!strcmp(o->name, "whisper"))
    s = synth(o, 0, 0, 20, 120, true, out);
  else if (!strcmp(o->name, "long"))
    s = synth(o, 2000, 4000, 20, 128, false, out);
  else if (o->repeat > 1)
    s = td_err(TD_ERR_INVALID, "workload %s: --repeat applies to the synthetic workloads (a file repeats "
                               "its own lines)", o->name);
  else
    s = from_file(o, out);
  if (s == TD_OK && !out->n) s = td_err(TD_ERR_INVALID, "workload %s: part %d of %d holds none of its %d requests",
                                        o->name, o->part, o->parts, o->n);
  if (s != TD_OK) td_workload_free(out);
  return s;
}

void td_workload_free(td_workload *w) {
  for (int i = 0; w->reqs && i < w->n; i++) td_json_request_free(&w->reqs[i]);
  free(w->reqs);
  memset(w, 0, sizeof *w);
}

void td_workload_arrivals(double rate, uint64_t seed, int n, double *t_ms) {
  double t = 0;
  for (int i = 0; i < n; i++) {
    if (rate > 0) {
      /* exponential gaps: -ln(1 - u) / rate, u in [0, 1) */
      double u = td_rand_uniform(seed, S_ARRIVAL, (uint32_t)i);
      t += -log(1.0 - u) / rate * 1000.0;
    }
    t_ms[i] = rate > 0 ? t : 0;
  }
}
