#include "serve_stats.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

double td_serve_percentile(const double *sorted, int n, double p) {
  if (n <= 0) return 0;
  if (p <= 0) return sorted[0];
  if (p >= 100) return sorted[n - 1];
  double rank = p / 100.0 * (n - 1);
  int lo = (int)floor(rank);
  double frac = rank - lo;
  return lo + 1 < n ? sorted[lo] + frac * (sorted[lo + 1] - sorted[lo]) : sorted[lo];
}

/* Sorts v (n values) and fills its figures. */
static void pct_of(double *v, int n, td_serve_pct *out) {
  memset(out, 0, sizeof *out);
  out->n = n;
  if (!n) return;
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  double sum = 0;
  for (int i = 0; i < n; i++) sum += v[i];
  out->mean = sum / n;
  out->p50 = td_serve_percentile(v, n, 50);
  out->p90 = td_serve_percentile(v, n, 90);
  out->p99 = td_serve_percentile(v, n, 99);
  out->max = v[n - 1];
}

/* The request's time per output token after the first; < 0 when it has
 * fewer than two tokens or no first-token time. */
static double tpot_of(const td_serve_sample *s) {
  if (s->n_out < 2 || s->first_ms <= 0) return -1;
  return (s->done_ms - s->first_ms) / (s->n_out - 1);
}

td_status td_serve_summarize(const td_serve_sample *s, int n, double ttft_bound_ms, double tpot_bound_ms,
                             td_serve_summary *out) {
  memset(out, 0, sizeof *out);
  if (n < 0) return td_err(TD_ERR_INVALID, "summary of %d samples", n);
  for (int i = 0; i < n; i++) {
    const td_serve_sample *x = &s[i];
    if (x->done_ms < x->submit_ms || (x->first_ms > 0 && (x->first_ms < x->submit_ms || x->first_ms > x->done_ms)))
      return td_err(TD_ERR_INVALID, "sample %d: times run backwards (submit %.3f, first %.3f, done %.3f)", i,
                    x->submit_ms, x->first_ms, x->done_ms);
  }
  out->n = n;
  if (!n) return TD_OK;
  double *ttft = malloc(sizeof(double) * (size_t)n), *tpot = malloc(sizeof(double) * (size_t)n),
         *e2e = malloc(sizeof(double) * (size_t)n);
  if (!ttft || !tpot || !e2e) {
    free(ttft), free(tpot), free(e2e);
    return td_err(TD_ERR_NOMEM, "out of memory");
  }
  int nt = 0, np = 0, ne = 0;
  double t0 = s[0].submit_ms, t1 = s[0].done_ms;
  long long out_tok = 0, in_tok = 0;
  for (int i = 0; i < n; i++) {
    const td_serve_sample *x = &s[i];
    if (x->submit_ms < t0) t0 = x->submit_ms;
    if (x->done_ms > t1) t1 = x->done_ms;
    if (!x->ok) {
      out->n_failed++;
      continue;
    }
    out->n_ok++;
    out_tok += x->n_out;
    in_tok += x->n_input;
    e2e[ne++] = x->done_ms - x->submit_ms;
    double ft = x->first_ms > 0 ? x->first_ms - x->submit_ms : -1;
    double tp = tpot_of(x);
    if (ft >= 0) ttft[nt++] = ft;
    if (tp >= 0) tpot[np++] = tp;
    bool good = (ttft_bound_ms <= 0 || (ft >= 0 && ft <= ttft_bound_ms)) &&
                (tpot_bound_ms <= 0 || tp < 0 || tp <= tpot_bound_ms);
    if (good) out->n_good++;
  }
  out->duration_s = (t1 - t0) / 1000.0;
  if (out->duration_s > 0) {
    out->req_s = out->n_ok / out->duration_s;
    out->out_tok_s = (double)out_tok / out->duration_s;
    out->in_tok_s = (double)in_tok / out->duration_s;
    out->goodput_req_s = out->n_good / out->duration_s;
  }
  pct_of(ttft, nt, &out->ttft);
  pct_of(tpot, np, &out->tpot);
  pct_of(e2e, ne, &out->e2e);
  free(ttft), free(tpot), free(e2e);
  return TD_OK;
}

td_status td_serve_worker_use(const td_serve_counters *before, int n_before, const td_serve_counters *after,
                              int n_after, double duration_s, double start_ms, td_serve_use *out) {
  if (!(duration_s > 0)) return td_err(TD_ERR_INVALID, "a run of %g s", duration_s);
  for (int i = 0; i < n_after; i++) {
    const td_serve_counters *a = &after[i], *b = NULL;
    static const td_serve_counters zero;
    for (int k = 0; k < n_before && !b; k++)
      if (!strcmp(before[k].id, a->id)) b = &before[k];
    if (!b) b = &zero;
    if (a->steps < b->steps || a->tokens < b->tokens || a->encode_runs < b->encode_runs || a->encoded < b->encoded ||
        a->busy_s < b->busy_s || a->project_s < b->project_s)
      return td_err(TD_ERR_INVALID, "worker %s: its counters went down over the run (restarted?)", a->id);
    td_serve_use *u = &out[i];
    memset(u, 0, sizeof *u);
    snprintf(u->id, sizeof u->id, "%s", a->id);
    u->steps = (long long)(a->steps - b->steps);
    u->tokens = (long long)(a->tokens - b->tokens);
    u->encode_runs = (long long)(a->encode_runs - b->encode_runs);
    u->encoded = (long long)(a->encoded - b->encoded);
    double busy = a->busy_s - b->busy_s;
    u->busy_pct = 100.0 * busy / duration_s;
    u->project_pct = 100.0 * (a->project_s - b->project_s) / duration_s;
    if (u->steps) {
      u->mean_batch = (double)u->tokens / (double)u->steps;
      u->step_ms = 1e3 * busy / (double)u->steps;
    }
    if (u->encode_runs) u->inputs_a_run = (double)u->encoded / (double)u->encode_runs;
    double end_ms = start_ms + 1e3 * duration_s;
    bool began = start_ms > 0 && a->began_ms && (double)a->began_ms >= start_ms;
    u->began_ms = began ? (double)a->began_ms - start_ms : -1;
    bool ended = began && a->ended_ms >= a->began_ms;
    u->ended_ms = !ended ? -1 : (double)a->ended_ms >= end_ms ? 0 : end_ms - (double)a->ended_ms;
  }
  return TD_OK;
}

bool td_serve_short_side(const td_serve_use *u, int n, char *buf, size_t cap) {
  if (cap) buf[0] = 0;
  int ne = 0, nd = 0;
  double enc = 0, dec = 0, proj = 0;
  long long enc_inputs = 0, dec_inputs = 0;
  for (int i = 0; i < n; i++) {
    if (u[i].steps > 0) {
      nd++, dec += u[i].busy_pct, proj += u[i].project_pct, dec_inputs += u[i].encoded;
    } else if (u[i].encode_runs > 0) {
      ne++, enc += u[i].busy_pct, enc_inputs += u[i].encoded;
    }
  }
  if (!ne || !nd || !cap) return false;
  enc /= ne, dec /= nd, proj /= nd;
  size_t at = 0;
#define SAY(...) (void)(at < cap && (at += (size_t)snprintf(buf + at, cap - at, __VA_ARGS__)))
  if (dec + proj > enc + TD_SERVE_SHORT_PTS) {
    SAY("The decode workers are the short side (busy %.1f %% in steps + %.1f %% projecting, encoders %.1f %%).", dec,
        proj, enc);
    if (proj >= 1.0)
      SAY(" Pushing K/V (--cross-transfer kv) gives the encoders the projection (where the KV stays on NVLink).");
    if (dec_inputs > 0)
      SAY(" Their own encoder runs (%lld of %lld inputs) take time from decoding: drop --decoders-encode or raise "
          "--local-encode-margin.",
          dec_inputs, dec_inputs + enc_inputs);
    if (proj < 1.0 && dec_inputs == 0) SAY(" More decode GPUs against encoder GPUs.");
  } else if (enc > dec + proj + TD_SERVE_SHORT_PTS) {
    SAY("The encoders are the short side (busy %.1f %%, decode workers %.1f %% in steps + %.1f %% projecting).", enc,
        dec, proj);
    if (proj < 1.0)
      SAY(" Pushing the encoder states (the default, without --cross-transfer kv) gives the decode workers the "
          "projection.");
    SAY(" More encoder GPUs, or decode workers that also encode (--decoders-encode).");
  } else {
    SAY("Encoders and decode workers are balanced (busy %.1f %% against %.1f %% in steps + %.1f %% projecting).", enc,
        dec, proj);
  }
#undef SAY
  return true;
}
