/* The router's /metrics on a running cluster: after requests of known
 * sizes (and a refused one), the counts, histograms, token totals and
 * per-worker gauges read back over HTTP equal what was sent. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <math.h>

#include <criterion/criterion.h>

#include "cluster_util.h"
#include "common/clock.h"
#include "common/defaults.h"

#define T5 TD_SOURCE_DIR "/tests/data/toy-numbers-t5"
#define NREQ 6
#define MAX_NEW 7

/* KV blocks the decode worker received, every transport. */
static double kv_in(const char *t) {
#define KV_IN "tandem:kv_blocks_transferred_total{worker=\"decode-0\",direction=\"in\",transport="
  return metric_sample(t, KV_IN "\"ucx\"}") + metric_sample(t, KV_IN "\"zmq\"}");
}

Test(metrics, counts_equal_the_requests_sent, .timeout = 300) {
  cluster c;
  cluster_opts o = {.model = T5, .encoders = 1, .decodes = 1, .router_extra = "--metrics-port 0"};
  cluster_start(&c, &o);
  char path[600];
  snprintf(path, sizeof path, "%s/m.jsonl", c.dir);
  FILE *f = fopen(path, "w");
  int prompt = 0;
  for (int i = 0; i < NREQ; i++) {
    /* i + 3 input ids, a decoder prompt of 1 (the start token) */
    fprintf(f, "{\"id\": \"m%d\", \"input_ids\": [", i);
    for (int k = 0; k < i + 3; k++) fprintf(f, "%s%d", k ? ", " : "", 5 + k);
    fprintf(f, "], \"decoder_prompt\": [0], \"max_new_tokens\": %d, \"ignore_eos\": true}\n", MAX_NEW);
    prompt += i + 3 + 1;
  }
  fclose(f);
  td_json_request reqs[NREQ + 1];
  cr_assert_eq(load_requests(path, reqs, NREQ), NREQ);
  outcome got[NREQ];
  run_requests(c.client_ep, reqs, NREQ, true, 60000, got);
  for (int i = 0; i < NREQ; i++) {
    cr_assert(got[i].done && got[i].status == TD_OK, "%s: %s", got[i].id, got[i].error);
    cr_assert_eq(got[i].len[0], MAX_NEW);
    td_json_request_free(&reqs[i]);
  }
  /* one refused at admission: no input (made by hand: the line parser refuses it first) */
  memset(&reqs[0], 0, sizeof reqs[0]);
  td_request_params_default(&reqs[0].params);
  snprintf(reqs[0].id, sizeof reqs[0].id, "bad");
  outcome bad;
  run_requests(c.client_ep, reqs, 1, false, 30000, &bad);
  cr_assert(bad.done && bad.status != TD_OK, "the empty request was not refused");

  /* the workers' heartbeats settle (every pushed block arrived), and the text,
   * rendered every TD_METRICS_PUBLISH_MS from the last heartbeats, shows it all */
  kv_count kv;
  cr_assert(cluster_kv_count(&c, "decode", 10000, &kv));
  char *t = NULL;
  int64_t until = td_now_ms() + 10000;
  while (td_now_ms() < until) {
    free(t);
    t = cluster_scrape(&c);
    cr_assert(t, "no answer from /metrics");
    if (metric_sample(t, "tandem:request_success_total{finished_reason=\"length\"}") == NREQ &&
        metric_sample(t, "tandem:request_failure_total{code=\"invalid_argument\"}") == 1 &&
        metric_sample(t, "tandem:worker_kv_blocks_used{worker=\"decode-0\",pool=\"cross\"}") == 0 &&
        metric_sample(t, "tandem:worker_encoded_requests_total{worker=\"encoder-0\"}") == NREQ &&
        kv_in(t) == (double)(kv.in_ucx + kv.in_zmq))
      break;
    usleep(100 * 1000);
  }
  cr_expect_eq(metric_sample(t, "tandem:request_success_total{finished_reason=\"length\"}"), NREQ, "%s", t);
  cr_expect_eq(metric_sample(t, "tandem:request_failure_total{code=\"invalid_argument\"}"), 1, "%s", t);
  cr_expect(strstr(t, "# TYPE tandem:time_to_first_token_seconds histogram\n"));
  cr_expect_eq(metric_sample(t, "tandem:time_to_first_token_seconds_count"), NREQ);
  cr_expect_eq(metric_sample(t, "tandem:time_to_first_token_seconds_bucket{le=\"+Inf\"}"), NREQ);
  cr_expect_eq(metric_sample(t, "tandem:e2e_request_latency_seconds_count"), NREQ);
  cr_expect_eq(metric_sample(t, "tandem:time_per_output_token_seconds_count"), NREQ);
  cr_expect_gt(metric_sample(t, "tandem:e2e_request_latency_seconds_sum"), 0);
  cr_expect_eq(metric_sample(t, "tandem:request_stage_seconds_count{stage=\"queue\"}"), NREQ);
  cr_expect_eq(metric_sample(t, "tandem:request_stage_seconds_count{stage=\"encode\"}"), NREQ);
  cr_expect_eq(metric_sample(t, "tandem:request_stage_seconds_count{stage=\"decode\"}"), NREQ);
  cr_expect_eq(metric_sample(t, "tandem:prompt_tokens_total"), prompt, "%s", t);
  cr_expect_eq(metric_sample(t, "tandem:generation_tokens_total"), NREQ * MAX_NEW);
  cr_expect_eq(metric_sample(t, "tandem:request_retries_total"), 0);
  cr_expect_eq(metric_sample(t, "tandem:num_requests_running"), 0);
  cr_expect_eq(metric_sample(t, "tandem:num_requests_waiting"), 0);
  cr_expect_eq(metric_sample(t, "tandem:worker_up{worker=\"decode-0\",roles=\"decode\"}"), 1, "%s", t);
  cr_expect_eq(metric_sample(t, "tandem:worker_up{worker=\"encoder-0\",roles=\"encode\"}"), 1);
  cr_expect_eq(metric_sample(t, "tandem:worker_running_sequences{worker=\"decode-0\"}"), 0);
  cr_expect_gt(metric_sample(t, "tandem:worker_kv_blocks_free{worker=\"decode-0\",pool=\"self\"}"), 0);
  cr_expect_gt(metric_sample(t, "tandem:worker_kv_blocks_free{worker=\"decode-0\",pool=\"cross\"}"), 0);
  cr_expect_eq(metric_sample(t, "tandem:worker_kv_blocks_used{worker=\"decode-0\",pool=\"self\"}"), 0);
  cr_expect_eq(metric_sample(t, "tandem:worker_encoded_requests_total{worker=\"encoder-0\"}"), NREQ);
  /* every request's cross KV went from the encoder to the decode worker */
  cr_expect_eq(kv_in(t), (double)(kv.in_ucx + kv.in_zmq), "%s", t);
  /* ... and its bytes: the same on both sides, a whole number of blocks of one size */
#define KV_BYTES "tandem:kv_bytes_transferred_total{worker="
#define KV_BLOCKS "tandem:kv_blocks_transferred_total{worker="
  double in_b = metric_sample(t, KV_BYTES "\"decode-0\",direction=\"in\",transport=\"ucx\"}") +
                metric_sample(t, KV_BYTES "\"decode-0\",direction=\"in\",transport=\"zmq\"}");
  double out_b = metric_sample(t, KV_BYTES "\"encoder-0\",direction=\"out\",transport=\"ucx\"}") +
                 metric_sample(t, KV_BYTES "\"encoder-0\",direction=\"out\",transport=\"zmq\"}");
  double out_n = metric_sample(t, KV_BLOCKS "\"encoder-0\",direction=\"out\",transport=\"ucx\"}") +
                 metric_sample(t, KV_BLOCKS "\"encoder-0\",direction=\"out\",transport=\"zmq\"}");
  cr_expect_gt(in_b, 0, "no KV bytes counted: %s", t);
  cr_expect_eq(in_b, out_b, "the decode worker counted %.0f bytes in, the encoder %.0f out", in_b, out_b);
  cr_expect(kv_in(t) > 0 && out_n == kv_in(t) && fmod(in_b, kv_in(t)) == 0,
            "%.0f bytes in %.0f blocks (out: %.0f blocks)", in_b, kv_in(t), out_n);
  double secs = metric_sample(t, "tandem:kv_push_seconds_total{worker=\"encoder-0\",transport=\"ucx\"}") +
                metric_sample(t, "tandem:kv_push_seconds_total{worker=\"encoder-0\",transport=\"zmq\"}");
  cr_expect(secs > 0 && secs < 60.0 * NREQ, "the encoder's pushes took %g s", secs);
  cr_expect_gt(kv_in(t), 0);
  /* utilisation: the encoder ran NREQ inputs in at least one run and at most NREQ,
   * the decode worker stepped and generated; both were busy and idle for some time */
  double runs = metric_sample(t, "tandem:worker_encoder_runs_total{worker=\"encoder-0\"}");
  cr_expect(runs >= 1 && runs <= NREQ, "%g encoder runs for %d inputs", runs, NREQ);
  cr_expect_gt(metric_sample(t, "tandem:worker_steps_total{worker=\"decode-0\"}"), 0);
  cr_expect_geq(metric_sample(t, "tandem:worker_generated_tokens_total{worker=\"decode-0\"}"), NREQ);
  const char *ids[] = {"encoder-0", "decode-0"};
  for (int i = 0; i < 2; i++) {
    char name[128];
    snprintf(name, sizeof name, "tandem:worker_busy_seconds_total{worker=\"%s\"}", ids[i]);
    double busy = metric_sample(t, name);
    snprintf(name, sizeof name, "tandem:worker_idle_seconds_total{worker=\"%s\"}", ids[i]);
    double idle = metric_sample(t, name);
    cr_expect(busy > 0 && idle > 0 && busy + idle < 600, "%s: busy %g s, idle %g s", ids[i], busy, idle);
  }
  /* the encoder pushed states (cross mode auto): the decode worker projected them, the encoder none */
  double proj = metric_sample(t, "tandem:worker_project_seconds_total{worker=\"decode-0\"}");
  cr_expect(proj > 0 && proj < 600, "decode-0 projected for %g s", proj);
  cr_expect_eq(metric_sample(t, "tandem:worker_project_seconds_total{worker=\"encoder-0\"}"), 0);
  free(t);
  cr_expect(cluster_stop(&c));
}

Test(metrics, a_worker_that_left_is_down, .timeout = 300) {
  cluster c;
  cluster_opts o = {.model = T5, .encoders = 1, .decodes = 1, .router_extra = "--metrics-port 0"};
  cluster_start(&c, &o);
  int extra = cluster_add_worker(&c, "decode-1", "decode", 0);
  cr_assert(cluster_wait_ready(&c, 1, 0, 2, 30000));
  cluster_kill(&c, extra);
  char *t = NULL;
  int64_t until = td_now_ms() + 15000;
  while (td_now_ms() < until) {
    free(t);
    t = cluster_scrape(&c);
    cr_assert(t);
    if (metric_sample(t, "tandem:worker_up{worker=\"decode-1\",roles=\"decode\"}") == 0) break;
    usleep(100 * 1000);
  }
  cr_expect_eq(metric_sample(t, "tandem:worker_up{worker=\"decode-1\",roles=\"decode\"}"), 0, "%s", t);
  cr_expect_eq(metric_sample(t, "tandem:worker_running_sequences{worker=\"decode-1\"}"), -1,
               "a gone worker's gauges go");
  cr_expect_eq(metric_sample(t, "tandem:worker_up{worker=\"decode-0\",roles=\"decode\"}"), 1);
  free(t);
  cr_expect(cluster_stop(&c));
}
