/* bench-serve's statistics on known inputs: percentiles as numpy computes
 * them, throughput over the run's span, TTFT / TPOT / end-to-end, goodput
 * under bounds, failures counted apart; and its workloads and arrivals. */
#include <string.h>

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "serve_stats.h"
#include "serve_workload.h"

#define NEAR(a, b) cr_assert_float_eq((a), (b), 1e-9, "%.12g != %.12g", (double)(a), (double)(b))

Test(serve_stats, percentiles_interpolate_like_numpy) {
  double v[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  NEAR(td_serve_percentile(v, 10, 50), 5.5);
  NEAR(td_serve_percentile(v, 10, 90), 9.1);
  NEAR(td_serve_percentile(v, 10, 99), 9.91);
  NEAR(td_serve_percentile(v, 10, 0), 1);
  NEAR(td_serve_percentile(v, 10, 100), 10);
  double one[] = {42};
  NEAR(td_serve_percentile(one, 1, 99), 42);
  NEAR(td_serve_percentile(NULL, 0, 50), 0);
}

Test(serve_stats, a_run_of_known_requests) {
  /* four requests over one second: three good ones and a failure */
  td_serve_sample s[] = {
      {.submit_ms = 0, .first_ms = 100, .done_ms = 500, .n_input = 10, .n_out = 5, .ok = true},   /* TPOT 100 */
      {.submit_ms = 0, .first_ms = 200, .done_ms = 1000, .n_input = 20, .n_out = 9, .ok = true},  /* TPOT 100 */
      {.submit_ms = 100, .first_ms = 400, .done_ms = 400, .n_input = 30, .n_out = 1, .ok = true}, /* no TPOT */
      {.submit_ms = 100, .first_ms = 0, .done_ms = 300, .n_input = 40, .n_out = 0, .ok = false},
  };
  td_serve_summary m;
  cr_assert_eq(td_serve_summarize(s, 4, 0, 0, &m), TD_OK);
  cr_assert_eq(m.n, 4);
  cr_assert_eq(m.n_ok, 3);
  cr_assert_eq(m.n_failed, 1);
  NEAR(m.duration_s, 1.0);
  NEAR(m.req_s, 3.0);
  NEAR(m.out_tok_s, 15.0);
  NEAR(m.in_tok_s, 60.0);
  cr_assert_eq(m.ttft.n, 3);
  NEAR(m.ttft.p50, 200);  /* 100, 200, 300 */
  NEAR(m.ttft.mean, 200);
  NEAR(m.ttft.max, 300);
  cr_assert_eq(m.tpot.n, 2);
  NEAR(m.tpot.p50, 100);
  cr_assert_eq(m.e2e.n, 3);
  NEAR(m.e2e.p50, 500); /* 300, 500, 1000 */
  NEAR(m.e2e.p90, 900);
  cr_assert_eq(m.n_good, 3, "no bounds: every successful request is good");
  NEAR(m.goodput_req_s, 3.0);
}

Test(serve_stats, goodput_counts_requests_within_both_bounds) {
  td_serve_sample s[] = {
      {.submit_ms = 0, .first_ms = 50, .done_ms = 450, .n_out = 5, .ok = true},   /* TTFT 50, TPOT 100 */
      {.submit_ms = 0, .first_ms = 150, .done_ms = 550, .n_out = 5, .ok = true},  /* TTFT 150: too slow */
      {.submit_ms = 0, .first_ms = 50, .done_ms = 850, .n_out = 5, .ok = true},   /* TPOT 200: too slow */
      {.submit_ms = 0, .first_ms = 80, .done_ms = 1000, .n_out = 1, .ok = true},  /* one token: TTFT only */
  };
  td_serve_summary m;
  cr_assert_eq(td_serve_summarize(s, 4, 100, 150, &m), TD_OK);
  cr_assert_eq(m.n_good, 2);
  NEAR(m.goodput_req_s, 2.0);
  cr_assert_eq(td_serve_summarize(s, 4, 100, 0, &m), TD_OK);
  cr_assert_eq(m.n_good, 3, "TTFT bound only");
  cr_assert_eq(td_serve_summarize(s, 4, 0, 150, &m), TD_OK);
  cr_assert_eq(m.n_good, 3, "TPOT bound only");
}

Test(serve_stats, refuses_times_that_run_backwards) {
  td_serve_sample s[] = {{.submit_ms = 10, .first_ms = 5, .done_ms = 20, .n_out = 2, .ok = true}};
  td_serve_summary m;
  cr_assert_eq(td_serve_summarize(s, 1, 0, 0, &m), TD_ERR_INVALID);
  s[0] = (td_serve_sample){.submit_ms = 10, .first_ms = 0, .done_ms = 5, .ok = false};
  cr_assert_eq(td_serve_summarize(s, 1, 0, 0, &m), TD_ERR_INVALID);
  cr_assert_eq(td_serve_summarize(s, -1, 0, 0, &m), TD_ERR_INVALID);
  cr_assert_eq(td_serve_summarize(NULL, 0, 0, 0, &m), TD_OK);
  cr_assert_eq(m.n, 0);
}

Test(serve_workload, trt_lengths_and_ids_in_range_and_repeatable) {
  td_workload_opts o = {.name = "trt", .n = 200, .seed = 9, .vocab = 1000};
  td_workload a, b;
  cr_assert_eq(td_workload_make(&o, &a), TD_OK, "%s", td_errmsg());
  cr_assert_eq(td_workload_make(&o, &b), TD_OK);
  cr_assert_eq(a.n, 200);
  long long in = 0, outt = 0;
  int lo = 1 << 30, hi = 0;
  for (int i = 0; i < a.n; i++) {
    const td_json_request *r = &a.reqs[i];
    cr_assert(r->n_input >= 260 && r->n_input <= 440, "input %d", r->n_input);
    cr_assert(r->params.max_new_tokens >= 20 && r->params.max_new_tokens <= 128);
    cr_assert(r->params.ignore_eos);
    for (int k = 0; k < r->n_input; k++) cr_assert(r->input_ids[k] >= 4 && r->input_ids[k] < 1000);
    cr_assert_eq(r->n_input, b.reqs[i].n_input, "same seed, same lengths");
    cr_assert_arr_eq(r->input_ids, b.reqs[i].input_ids, sizeof(int32_t) * (size_t)r->n_input);
    in += r->n_input;
    outt += r->params.max_new_tokens;
    lo = r->n_input < lo ? r->n_input : lo;
    hi = r->n_input > hi ? r->n_input : hi;
  }
  cr_assert_eq(in, a.input_tokens);
  cr_assert_eq(outt, a.output_tokens);
  cr_assert(lo < 280 && hi > 420, "lengths spread over the range: %d..%d", lo, hi);
  td_workload_free(&a);
  td_workload_free(&b);
}

Test(serve_workload, whisper_features_and_refusals) {
  td_workload_opts o = {.name = "whisper", .n = 3, .seed = 1, .mel_bins = 8, .frames = 30};
  td_workload w;
  cr_assert_eq(td_workload_make(&o, &w), TD_OK, "%s", td_errmsg());
  cr_assert_eq(w.reqs[2].n_features, 240);
  cr_assert_null(w.reqs[2].input_ids);
  td_workload_free(&w);
  o.mel_bins = 0;
  cr_assert_eq(td_workload_make(&o, &w), TD_ERR_INVALID, "whisper needs the features' shape");
  td_workload_opts t = {.name = "trt", .n = 0, .vocab = 100};
  cr_assert_eq(td_workload_make(&t, &w), TD_ERR_INVALID);
  td_workload_opts f = {.name = "/nonexistent/requests.jsonl", .n = 4};
  cr_assert_eq(td_workload_make(&f, &w), TD_ERR_INVALID);
}

/* Runs with different seeds share no input (else a second run meets the
 * encoder cache): every request of seed 11 against every one of seed 12. */
Test(serve_workload, seeds_give_other_inputs) {
  td_workload_opts o = {.name = "whisper", .n = 256, .seed = 11, .mel_bins = 2, .frames = 4};
  td_workload a, b;
  cr_assert_eq(td_workload_make(&o, &a), TD_OK, "%s", td_errmsg());
  o.seed = 12;
  cr_assert_eq(td_workload_make(&o, &b), TD_OK, "%s", td_errmsg());
  int same = 0;
  for (int i = 0; i < a.n; i++)
    for (int j = 0; j < b.n; j++) same += !memcmp(a.reqs[i].features, b.reqs[j].features, sizeof(float) * 8);
  cr_expect_eq(same, 0, "%d requests of seed 12 repeat one of seed 11", same);
  td_workload_free(&a);
  td_workload_free(&b);
  td_workload_opts t = {.name = "trt", .n = 64, .seed = 11, .vocab = 32000};
  cr_assert_eq(td_workload_make(&t, &a), TD_OK, "%s", td_errmsg());
  t.seed = 12;
  cr_assert_eq(td_workload_make(&t, &b), TD_OK, "%s", td_errmsg());
  same = 0;
  for (int i = 0; i < a.n; i++)
    for (int j = 0; j < b.n; j++)
      same += a.reqs[i].n_input == b.reqs[j].n_input &&
              !memcmp(a.reqs[i].input_ids, b.reqs[j].input_ids, sizeof(int32_t) * (size_t)a.reqs[i].n_input);
  cr_expect_eq(same, 0, "%d trt requests of seed 12 repeat one of seed 11", same);
  td_workload_free(&a);
  td_workload_free(&b);
}

/* --part Q/N: the whole workload's requests Q, Q + N, ... (the same inputs
 * as the whole, so that an engine measures its share of a cluster's run);
 * the parts together are the whole; a file the same by line; refusals. */
Test(serve_workload, parts_are_the_wholes_requests_by_index) {
  td_workload_opts o = {.name = "trt", .n = 10, .seed = 4, .vocab = 500};
  td_workload all, part;
  cr_assert_eq(td_workload_make(&o, &all), TD_OK, "%s", td_errmsg());
  long long out = 0;
  for (int q = 0; q < 4; q++) {
    o.part = q, o.parts = 4;
    cr_assert_eq(td_workload_make(&o, &part), TD_OK, "%s", td_errmsg());
    cr_assert_eq(part.n, q < 2 ? 3 : 2, "part %d of 4 of 10: %d requests", q, part.n);
    for (int j = 0; j < part.n; j++) {
      const td_json_request *a = &all.reqs[q + 4 * j], *b = &part.reqs[j];
      cr_expect_str_eq(b->id, a->id);
      cr_assert_eq(b->n_input, a->n_input);
      cr_expect_arr_eq(b->input_ids, a->input_ids, sizeof(int32_t) * (size_t)a->n_input);
      cr_expect_eq(b->params.max_new_tokens, a->params.max_new_tokens);
    }
    out += part.output_tokens;
    td_workload_free(&part);
  }
  cr_expect_eq(out, all.output_tokens, "the parts ask for the whole's output tokens");
  td_workload_free(&all);
  td_workload_opts w = {.name = "whisper", .n = 6, .seed = 2, .mel_bins = 2, .frames = 4, .part = 1, .parts = 3};
  cr_assert_eq(td_workload_make(&w, &part), TD_OK, "%s", td_errmsg());
  w.parts = 0;
  cr_assert_eq(td_workload_make(&w, &all), TD_OK, "%s", td_errmsg());
  cr_assert_eq(part.n, 2);
  cr_expect_arr_eq(part.reqs[1].features, all.reqs[4].features, sizeof(float) * 8);
  td_workload_free(&part);
  td_workload_free(&all);
  char path[] = "/tmp/td-parts-XXXXXX";
  int fd = mkstemp(path);
  cr_assert_geq(fd, 0);
  FILE *f = fdopen(fd, "w");
  for (int i = 0; i < 5; i++) fprintf(f, "{\"input_ids\": [%d, 5, 6], \"max_new_tokens\": %d}\n", 10 + i, 2 + i);
  fclose(f);
  td_workload_opts fo = {.name = path, .part = 2, .parts = 2};
  cr_assert_eq(td_workload_make(&fo, &part), TD_ERR_INVALID, "part 2 of 2");
  fo.part = 1;
  cr_assert_eq(td_workload_make(&fo, &part), TD_OK, "%s", td_errmsg());
  cr_assert_eq(part.n, 2, "lines 1 and 3 of 0-4");
  cr_expect_eq(part.reqs[0].input_ids[0], 11);
  cr_expect_eq(part.reqs[1].params.max_new_tokens, 5);
  td_workload_free(&part);
  unlink(path);
  td_workload_opts bad = {.name = "trt", .n = 2, .seed = 1, .vocab = 100, .part = 3, .parts = 4};
  cr_expect_eq(td_workload_make(&bad, &part), TD_ERR_INVALID, "part 3 of 4 of 2 requests is empty");
  cr_expect(strstr(td_errmsg(), "part 3 of 4 holds none"), "%s", td_errmsg());
  bad.part = 4;
  cr_expect_eq(td_workload_make(&bad, &part), TD_ERR_INVALID, "part 4 of 4");
  bad.part = 0, bad.parts = TD_WORKLOAD_MAX_PARTS + 1;
  cr_expect_eq(td_workload_make(&bad, &part), TD_ERR_INVALID, "too many parts");
}

Test(serve_workload, poisson_arrivals_have_the_rate) {
  enum { N = 20000 };
  static double t[N];
  td_workload_arrivals(50.0, 3, N, t);
  for (int i = 1; i < N; i++) cr_assert_geq(t[i], t[i - 1]);
  double rate = (N - 1) / ((t[N - 1] - t[0]) / 1000.0);
  cr_assert(fabs(rate - 50.0) < 2.0, "measured rate %.2f", rate);
  td_workload_arrivals(0, 3, 5, t);
  for (int i = 0; i < 5; i++) cr_assert_eq(t[i], 0, "rate 0: all at once");
}

/* Worker utilisation over a run from two looks at the counters: an encoder
 * (runs, no steps), a decode worker (steps and tokens), one that joined
 * during the run (from zero); counters that went down are refused. */
Test(serve_stats, worker_use_from_two_looks) {
  td_serve_counters before[2] = {{.id = "encoder-0", .encode_runs = 10, .encoded = 30, .busy_s = 5.0},
                                 {.id = "decode-0", .steps = 100, .tokens = 1000, .busy_s = 2.0, .project_s = 1.0}};
  td_serve_counters after[3] = {{.id = "decode-0", .steps = 600, .tokens = 51000, .busy_s = 6.5, .project_s = 1.5},
                                {.id = "encoder-0", .encode_runs = 110, .encoded = 330, .busy_s = 8.0},
                                {.id = "decode-1", .steps = 50, .tokens = 2000, .encode_runs = 4, .encoded = 8,
                                 .busy_s = 0.5}};
  td_serve_use u[3];
  cr_assert_eq(td_serve_worker_use(before, 2, after, 3, 5.0, 0, u), TD_OK);
  cr_expect(u[0].began_ms < 0 && u[0].ended_ms < 0, "no start given: no began / ended times");
  cr_expect_str_eq(u[0].id, "decode-0");
  NEAR(u[0].busy_pct, 90.0);
  cr_expect_eq(u[0].steps, 500);
  NEAR(u[0].mean_batch, 100.0);
  NEAR(u[0].step_ms, 9.0);
  NEAR(u[0].inputs_a_run, 0.0);
  NEAR(u[0].project_pct, 10.0);
  cr_expect_str_eq(u[1].id, "encoder-0");
  NEAR(u[1].busy_pct, 60.0);
  cr_expect_eq(u[1].encode_runs, 100);
  NEAR(u[1].inputs_a_run, 3.0);
  NEAR(u[1].mean_batch, 0.0);
  NEAR(u[1].step_ms, 0.0);
  NEAR(u[1].project_pct, 0.0);
  cr_expect_str_eq(u[2].id, "decode-1"); /* joined during the run */
  NEAR(u[2].busy_pct, 10.0);
  NEAR(u[2].mean_batch, 40.0);
  NEAR(u[2].inputs_a_run, 2.0);
  cr_expect_eq(td_serve_worker_use(before, 2, after, 3, 0.0, 0, u), TD_ERR_INVALID);
  after[1].encoded = 20; /* restarted under the same id */
  cr_expect_eq(td_serve_worker_use(before, 2, after, 3, 5.0, 0, u), TD_ERR_INVALID);
}

/* When each worker's work began and ended within a run of 5 s from Unix ms
 * 1,000,000: one began 40 ms in and ended 300 ms before the end (it idled
 * 340 ms of the run), one worked before the run began, one is still working
 * at the look after it, one ended a little after the client's end (0). */
Test(serve_stats, work_began_and_ended_within_the_run) {
  td_serve_counters before[1] = {{.id = "w"}};
  td_serve_counters after[4] = {{.id = "early-end", .steps = 10, .began_ms = 1000040, .ended_ms = 1004700},
                                {.id = "before", .steps = 10, .began_ms = 999000, .ended_ms = 1004990},
                                {.id = "still", .steps = 10, .began_ms = 1000010, .ended_ms = 999500},
                                {.id = "after-end", .steps = 10, .began_ms = 1000002, .ended_ms = 1005003}};
  td_serve_use u[4];
  cr_assert_eq(td_serve_worker_use(before, 1, after, 4, 5.0, 1000000.0, u), TD_OK);
  NEAR(u[0].began_ms, 40.0);
  NEAR(u[0].ended_ms, 300.0);
  cr_expect(u[1].began_ms < 0 && u[1].ended_ms < 0, "worked before the run: %g / %g", u[1].began_ms, u[1].ended_ms);
  NEAR(u[2].began_ms, 10.0);
  cr_expect(u[2].ended_ms < 0, "still working: %g", u[2].ended_ms);
  NEAR(u[3].began_ms, 2.0);
  NEAR(u[3].ended_ms, 0.0);
}

/* Which side of a split was short, from the rows bench-serve prints: the
 * figures of the 2 x H200 Whisper runs (bench/RESULTS.md) and their
 * advice; none for an aggregated cluster. */
Test(serve_stats, which_side_was_short) {
  char buf[768];
  td_serve_use kv[2] = {{.id = "encoder-0", .busy_pct = 89.1, .encode_runs = 234, .encoded = 2048},
                        {.id = "decode-0", .busy_pct = 99.6, .steps = 1724, .tokens = 143000}};
  cr_assert(td_serve_short_side(kv, 2, buf, sizeof buf));
  cr_expect(strstr(buf, "decode workers are the short side"), "%s", buf);
  cr_expect(strstr(buf, "More decode GPUs"), "%s", buf);
  cr_expect(!strstr(buf, "--cross-transfer kv"), "nothing to project: %s", buf);
  td_serve_use states[2] = {{.id = "decode-0", .busy_pct = 90.0, .project_pct = 10.0, .steps = 1000},
                            {.id = "encoder-0", .busy_pct = 74.0, .encode_runs = 800, .encoded = 2048}};
  cr_assert(td_serve_short_side(states, 2, buf, sizeof buf));
  cr_expect(strstr(buf, "decode workers are the short side") && strstr(buf, "--cross-transfer kv"), "%s", buf);
  td_serve_use local[2] = {{.id = "encoder-0", .busy_pct = 30.0, .encode_runs = 800, .encoded = 1118},
                           {.id = "decode-0", .busy_pct = 98.0, .steps = 1200, .encode_runs = 661, .encoded = 930}};
  cr_assert(td_serve_short_side(local, 2, buf, sizeof buf));
  cr_expect(strstr(buf, "930 of 2048 inputs") && strstr(buf, "drop --decoders-encode"), "%s", buf);
  td_serve_use enc_short[3] = {{.id = "encoder-0", .busy_pct = 99.0, .encode_runs = 900, .encoded = 3000},
                               {.id = "decode-0", .busy_pct = 70.0, .steps = 900},
                               {.id = "decode-1", .busy_pct = 72.0, .steps = 900}};
  cr_assert(td_serve_short_side(enc_short, 3, buf, sizeof buf));
  cr_expect(strstr(buf, "encoders are the short side") && strstr(buf, "states") && strstr(buf, "More encoder GPUs"),
            "%s", buf);
  enc_short[1].project_pct = enc_short[2].project_pct = 8.0;
  cr_assert(td_serve_short_side(enc_short, 3, buf, sizeof buf));
  cr_expect(strstr(buf, "encoders are the short side") && !strstr(buf, "Pushing the encoder states"),
            "they already project: %s", buf);
  td_serve_use even[2] = {{.id = "encoder-0", .busy_pct = 90.0, .encode_runs = 10, .encoded = 30},
                          {.id = "decode-0", .busy_pct = 88.0, .steps = 100}};
  cr_assert(td_serve_short_side(even, 2, buf, sizeof buf));
  cr_expect(strstr(buf, "balanced"), "%s", buf);
  td_serve_use agg[2] = {{.id = "decode-0", .busy_pct = 98.0, .steps = 1300, .encode_runs = 650, .encoded = 1000},
                         {.id = "decode-1", .busy_pct = 97.5, .steps = 1250, .encode_runs = 640, .encoded = 1030}};
  cr_expect(!td_serve_short_side(agg, 2, buf, sizeof buf) && !buf[0], "an aggregated cluster has no sides");
  cr_expect(!td_serve_short_side(kv, 0, buf, sizeof buf));
}
