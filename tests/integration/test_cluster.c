/* The cluster as users meet it: real router and worker processes on
 * loopback, the real client; topologies, KV transports, cross pool modes,
 * streaming, deploy/local.sh --demo. The faults are in test_faults.c. */
#include <pthread.h>
#include <signal.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <criterion/criterion.h>

#include "../unit/fixture.h"
#include "cluster_util.h"
#include "common/clock.h"

#define MAXQ 64

/* Greedy, beam and sampled variants of every fixture request. */
static int write_mixed(const fixture *fx, const char *path, int max_new) {
  FILE *f = fopen(path, "w");
  cr_assert(f);
  int n = 0;
  for (int i = 0; i < fx->n; i++) {
    const fx_request *q = &fx->req[i];
    char input[4096] = "", prompt[1024] = "";
    size_t l = 0;
    if (fx->mels) {
      char fp[700];
      snprintf(fp, sizeof fp, "%s.feat%d.f32", path, i);
      FILE *ff = fopen(fp, "wb");
      fwrite(fx->features + (size_t)i * fx->mels * fx->frames, 4, (size_t)fx->mels * fx->frames, ff);
      fclose(ff);
      snprintf(input, sizeof input, "\"input_features\": \"%s\"", fp);
    } else {
      l = (size_t)snprintf(input, sizeof input, "\"input_ids\": [");
      for (int t = 0; t < q->n_input; t++) l += (size_t)snprintf(input + l, sizeof input - l, "%s%d", t ? "," : "", q->input_ids[t]);
      snprintf(input + l, sizeof input - l, "]");
    }
    l = (size_t)snprintf(prompt, sizeof prompt, "\"decoder_prompt\": [");
    for (int t = 0; t < q->n_prompt; t++) l += (size_t)snprintf(prompt + l, sizeof prompt - l, "%s%d", t ? "," : "", q->prompt[t]);
    snprintf(prompt + l, sizeof prompt - l, "]");
    fprintf(f, "{\"id\": \"g%d\", %s, %s, \"max_new_tokens\": %d, \"forced_eos_token_id\": null}\n", i, input, prompt,
            max_new);
    fprintf(f, "{\"id\": \"b%d\", %s, %s, \"max_new_tokens\": 10, \"num_beams\": 4, \"num_return_sequences\": 2, "
               "\"early_stopping\": true}\n",
            i, input, prompt);
    fprintf(f, "{\"id\": \"s%d\", %s, %s, \"max_new_tokens\": 8, \"temperature\": 0.8, \"top_k\": 20, \"seed\": %d, "
               "\"n\": 2}\n",
            i, input, prompt, 100 + i);
    n += 3;
  }
  fclose(f);
  return n;
}

/* Sends the requests from `clients` concurrent clients (interleaved). */
static void run_concurrent(const char *ep, td_json_request *reqs, int n, int clients, bool stream, outcome *out) {
  td_json_request *part[8];
  outcome *pout[8];
  int cnt[8] = {0};
  pthread_t th[8];
  client_job jobs[8];
  for (int c = 0; c < clients; c++) {
    part[c] = calloc((size_t)n, sizeof **part);
    pout[c] = calloc((size_t)n, sizeof **pout);
  }
  for (int i = 0; i < n; i++) part[i % clients][cnt[i % clients]++] = reqs[i];
  for (int c = 0; c < clients; c++) {
    jobs[c] = (client_job){ep, part[c], cnt[c], pout[c], stream};
    pthread_create(&th[c], NULL, client_thread, &jobs[c]);
  }
  for (int c = 0; c < clients; c++) pthread_join(th[c], NULL);
  for (int i = 0; i < n; i++) out[i] = pout[i % clients][i / clients];
  for (int c = 0; c < clients; c++) {
    free(part[c]);
    free(pout[c]);
  }
}

static void expect_same(const outcome *got, const outcome *want, int n, const char *what) {
  for (int i = 0; i < n; i++) {
    cr_expect(got[i].done && got[i].status == TD_OK, "%s %s: not done (%s)", what, got[i].id, got[i].error);
    if (!got[i].done || got[i].status != TD_OK) continue;
    cr_expect_eq(got[i].n_out, want[i].n_out, "%s %s: %d outputs, expected %d", what, got[i].id, got[i].n_out,
                 want[i].n_out);
    for (int k = 0; k < got[i].n_out && k < want[i].n_out; k++) {
      cr_expect_eq(got[i].len[k], want[i].len[k], "%s %s output %d: %d tokens, expected %d", what, got[i].id, k,
                   got[i].len[k], want[i].len[k]);
      cr_expect_arr_eq(got[i].tok[k], want[i].tok[k], sizeof(int32_t) * (size_t)want[i].len[k],
                       "%s %s output %d: tokens differ from tandem-generate", what, got[i].id, k);
      cr_expect_eq(got[i].finish[k], want[i].finish[k], "%s %s output %d: finish reason %s, tandem-generate's %s",
                   what, got[i].id, k, td_finish_name(got[i].finish[k]), td_finish_name(want[i].finish[k]));
    }
  }
}

/* Which transport the workers whose id starts with `prefix` received KV
 * blocks over: 1 some, 0 none, -1 either. */
typedef struct kv_want {
  const char *prefix;
  int in_ucx, in_zmq;
} kv_want;

static void expect_kv(cluster *c, const kv_want *want, int n_want, const char *what) {
  for (int i = 0; i < n_want; i++) {
    kv_count k;
    cr_expect(cluster_kv_count(c, want[i].prefix, 10000, &k), "%s: the KV counters did not settle", what);
    const char *who = want[i].prefix ? want[i].prefix : "the workers";
    if (want[i].in_ucx >= 0)
      cr_expect(want[i].in_ucx ? k.in_ucx > 0 : k.in_ucx == 0, "%s: %s received %llu KV blocks over UCX (want %s)",
                what, who, (unsigned long long)k.in_ucx, want[i].in_ucx ? "some" : "none");
    if (want[i].in_zmq >= 0)
      cr_expect(want[i].in_zmq ? k.in_zmq > 0 : k.in_zmq == 0, "%s: %s received %llu KV blocks over ZeroMQ (want %s)",
                what, who, (unsigned long long)k.in_zmq, want[i].in_zmq ? "some" : "none");
  }
}

/* Runs greedy, beam and sampled requests of a fixture through the cluster
 * and checks the tokens against tandem-generate and the KV transports
 * against `want`; the results go to got_out (MAXQ entries) when set. */
static int run_topology(const char *model, cluster_opts o, int clients, const kv_want *want, int n_want,
                        outcome *got_out) {
  fixture fx;
  fx_load(model, &fx);
  cluster c;
  o.model = fx.dir;
  o.prefill_threshold = 2;
  o.block_size = 4;
  cluster_start(&c, &o);
  /* the health answer names the cross pools' mode */
  td_client_health h;
  cr_expect(cluster_health(&c, &h), "%s: no health answer", model);
  const char *mode = "auto", *cm = o.router_extra ? strstr(o.router_extra, "--cross-mode ") : NULL;
  char want_mode[16] = "";
  if (o.router_extra && strstr(o.router_extra, "--cross-states")) mode = "states";
  if (cm && sscanf(cm + strlen("--cross-mode "), "%15s", want_mode) == 1) mode = want_mode;
  cr_expect_str_eq(h.cross_mode, mode, "%s: health says cross mode %s, the router runs %s", model, h.cross_mode, mode);
  char path[600];
  snprintf(path, sizeof path, "%s/requests.jsonl", c.dir);
  int n = write_mixed(&fx, path, fx.max_new);
  td_json_request reqs[MAXQ];
  cr_assert_eq(load_requests(path, reqs, MAXQ), n);
  outcome *ref = calloc(MAXQ, sizeof *ref), *got = calloc(MAXQ, sizeof *got);
  generate_reference(fx.dir, path, 4, ref, n);
  run_concurrent(c.client_ep, reqs, n, clients, false, got);
  expect_same(got, ref, n, model);
  expect_kv(&c, want, n_want, model);
  char why[256] = "";
  cr_expect(cluster_wait_idle(&c, o.idle_within_ms ? o.idle_within_ms : 5000, why, sizeof why),
            "%s: blocks held after all requests: %s", model, why);
  cr_expect(cluster_stop(&c), "%s: processes did not stop cleanly (logs in %s)", model, c.dir);
  if (got_out) memcpy(got_out, got, sizeof *got * MAXQ);
  for (int i = 0; i < n; i++) td_json_request_free(&reqs[i]);
  free(ref);
  free(got);
  fx_free(&fx);
  return n;
}

/* Single-rank workers on the default transport: every block goes over UCX. */
static const kv_want all_ucx[] = {{NULL, 1, 0}};

static void check_topology_groups(const char *model, int enc, int pre, int dec, int clients, int gtp, int gpp) {
  cluster_opts o = {.encoders = enc, .prefills = pre, .decodes = dec, .group_tp = gtp, .group_pp = gpp};
  /* a group takes its KV over ZeroMQ (encoder states, or prompt K/V the leader re-slices); a prefill worker over UCX */
  const kv_want groups[] = {{"decode-", 0, 1}, {"prefill-", pre ? 1 : -1, 0}};
  run_topology(model, o, clients, gtp > 1 || gpp > 1 ? groups : all_ucx, gtp > 1 || gpp > 1 ? 2 : 1, NULL);
}

static void check_topology(const char *model, int enc, int pre, int dec, int clients) {
  check_topology_groups(model, enc, pre, dec, clients, 1, 1);
}

Test(cluster, tensor_parallel_decode_group_matches_generate, .timeout = 600) {
  check_topology_groups("t5-tiny", 1, 1, 1, 3, 2, 1);
  check_topology_groups("bart-tiny", 1, 0, 1, 3, 4, 1);
}

/* A group without encoders encodes its own requests (no block moves: there
 * is no other worker), and gives generate's tokens. */
Test(cluster, decode_groups_that_encode_for_themselves_match_generate, .timeout = 600) {
  run_topology("t5-tiny", (cluster_opts){.decodes = 1, .group_tp = 2}, 3, NULL, 0, NULL);
  run_topology("mbart-prenorm-sharded", (cluster_opts){.decodes = 1, .group_pp = 2}, 3, NULL, 0, NULL);
}

/* A group with nothing to do for longer than a follower waits on a silent
 * leader (TD_GROUP_LEADER_DEAD_MS) stays up: the idle leader heartbeats. */
Test(cluster, an_idle_group_stays_up, .timeout = 120) {
  fixture fx;
  fx_load("t5-tiny", &fx);
  cluster c;
  cluster_start(&c, &(cluster_opts){.model = fx.dir, .encoders = 1, .decodes = 1, .group_tp = 2});
  usleep((TD_GROUP_LEADER_DEAD_MS + 2000) * 1000);
  td_client_health h;
  cr_expect(cluster_health(&c, &h) && h.decoders == 1, "the idle group left the pool (logs in %s)", c.dir);
  cr_expect(cluster_stop(&c), "processes did not stop cleanly (logs in %s)", c.dir);
  fx_free(&fx);
}

Test(cluster, pipeline_parallel_decode_group_matches_generate, .timeout = 600) {
  check_topology_groups("mbart-prenorm-sharded", 1, 1, 1, 3, 1, 2);
}

Test(cluster, encoder_prefill_decode_match_generate, .timeout = 600) {
  const char *models[] = {"t5-tiny", "bart-tiny", "whisper-tiny", "mbart-prenorm-sharded"};
  for (int i = 0; i < 4; i++) check_topology(models[i], 1, 1, 1, 4);
}

Test(cluster, two_encoders_two_decoders_match_generate, .timeout = 600) {
  check_topology("t5-tiny", 2, 0, 2, 6);
  check_topology("marian-sinusoidal", 2, 0, 2, 6);
}

/* The encoder cache on the workers (docs/encoder-cache.md): the fixture's
 * requests twice, on a worker that encodes for itself and on an encoder
 * worker (encode_only jobs, whose cached blocks are pushed again): the
 * second round runs no encoder, gives transformers' tokens again, and the
 * health reports the hits; the cached blocks count as free. */
static void check_encoder_cache(int encoders) {
  fixture fx;
  fx_load("t5-tiny", &fx);
  cluster c;
  cluster_opts o = {.model = fx.dir, .encoders = encoders, .decodes = 1, .block_size = 4};
  double t_start = td_now_ms() / 1e3;
  cluster_start(&c, &o);
  expect_fixture_greedy(&c, &fx);
  expect_fixture_greedy(&c, &fx);
  uint64_t hits = 0, encoded = 0, tokens = 0, want_tokens = 0, runs = 0, steps = 0;
  double busy = 0, idle = 0;
  int cached = 0;
  for (int i = 0; i < fx.n; i++) want_tokens += 2 * (uint64_t)fx.req[i].n_greedy;
  for (int t = 0; t < 50 && (hits < (uint64_t)fx.n || tokens < want_tokens); t++) { /* the load comes with the heartbeats */
    td_client_health h;
    hits = encoded = tokens = runs = steps = 0;
    busy = idle = 0;
    cached = 0;
    if (cluster_health(&c, &h))
      for (int i = 0; i < h.n_workers; i++) {
        hits += h.workers[i].encoder_cache_hits;
        encoded += h.workers[i].encoded;
        cached += h.workers[i].encoder_cache_blocks;
        tokens += h.workers[i].tokens;
        runs += h.workers[i].encode_runs;
        steps += h.workers[i].steps;
        busy += h.workers[i].busy_seconds;
        idle += h.workers[i].idle_seconds;
        cr_expect(h.workers[i].busy_seconds >= 0 && h.workers[i].idle_seconds >= 0 &&
                      h.workers[i].busy_seconds + h.workers[i].idle_seconds <= td_now_ms() / 1e3 - t_start,
                  "%s busy %.3f s, idle %.3f s", h.workers[i].id, h.workers[i].busy_seconds,
                  h.workers[i].idle_seconds);
      }
    if (hits < (uint64_t)fx.n || tokens < want_tokens) usleep(100000);
  }
  /* the engine counters the health reports: every greedy token, one encoder
   * run at most an input (the repeats came from the cache), steps for all */
  cr_expect_eq(tokens, want_tokens, "%d encoders: %llu tokens generated, %llu asked", encoders,
               (unsigned long long)tokens, (unsigned long long)want_tokens);
  cr_expect(runs >= 1 && runs <= (uint64_t)fx.n, "%d encoders: %llu encoder runs for %d inputs", encoders,
            (unsigned long long)runs, fx.n);
  cr_expect(steps * 8 >= want_tokens / 2, "%llu steps for %llu tokens", (unsigned long long)steps,
            (unsigned long long)want_tokens);
  cr_expect_gt(busy, 0.0);
  cr_expect_gt(idle, 0.0, "the workers waited between the two rounds and after");
  cr_expect_eq(hits, (uint64_t)fx.n, "%d encoders: %llu encoder-cache hits for %d repeated inputs", encoders,
               (unsigned long long)hits, fx.n);
  cr_expect_eq(encoded, (uint64_t)fx.n, "%d encoders: %llu encoder runs for %d inputs", encoders,
               (unsigned long long)encoded, fx.n);
  cr_expect_gt(cached, 0);
  char why[256] = "";
  cr_expect(cluster_wait_idle(&c, 5000, why, sizeof why), "blocks held after all requests: %s", why);
  cr_expect(cluster_stop(&c), "processes did not stop cleanly (logs in %s)", c.dir);
  fx_free(&fx);
}

Test(cluster, encoder_cache_hits_on_workers, .timeout = 300) {
  check_encoder_cache(0);
  check_encoder_cache(1);
}

/* Decode workers that encode beside an encoder (the router shares the
 * encoding: router/placement.c) give the same tokens; with heartbeats 3 s
 * apart, the health shows every worker idle within 1 s of the last result
 * (a worker that goes idle says so at once: no stale running counts). */
Test(cluster, decoders_that_encode_beside_an_encoder_match_generate, .timeout = 600) {
  const char *models[] = {"t5-tiny", "whisper-tiny"};
  for (int i = 0; i < 2; i++) {
    cluster_opts o = {.encoders = 1, .decodes = 2, .decoders_encode = true, .idle_within_ms = 1000,
                      .router_extra = "--heartbeat-ms 3000"};
    run_topology(models[i], o, 4, NULL, 0, NULL);
  }
}

/* --kv-transport zmq: the same cluster moves every block over ZeroMQ and
 * gives the same tokens as the default (UCX). */
Test(cluster, kv_transport_zmq_gives_identical_tokens, .timeout = 600) {
  outcome *ucx = calloc(MAXQ, sizeof *ucx), *zmq = calloc(MAXQ, sizeof *zmq);
  cluster_opts o = {.encoders = 1, .prefills = 1, .decodes = 1};
  int n = run_topology("t5-tiny", o, 4, all_ucx, 1, ucx);
  o.worker_extra = "--kv-transport zmq";
  const kv_want none_ucx[] = {{NULL, 0, 1}};
  cr_assert_eq(run_topology("t5-tiny", o, 4, none_ucx, 1, zmq), n);
  expect_same(zmq, ucx, n, "zmq against ucx");
  free(ucx);
  free(zmq);
}

/* One worker on ZeroMQ, the others on auto: each pair takes the path both
 * sides can (a decode worker gets cross KV over UCX and prompt KV over
 * ZeroMQ, or the other way round). */
Test(cluster, mixed_kv_transports, .timeout = 600) {
  cluster_opts o = {.encoders = 1, .prefills = 1, .decodes = 1, .extra_worker = "prefill-0",
                    .extra_flags = "--kv-transport zmq"};
  /* encoder -> prefill: ZeroMQ (no UCX there); encoder -> decode: UCX; prefill -> decode: ZeroMQ */
  const kv_want prefill_zmq[] = {{"decode-", 1, 1}, {"prefill-", 0, 1}};
  run_topology("bart-tiny", o, 3, prefill_zmq, 2, NULL);
  o.extra_worker = "encoder-0";
  /* encoder -> prefill and decode: ZeroMQ; prefill -> decode: UCX */
  const kv_want encoder_zmq[] = {{"decode-", 1, 1}, {"prefill-", 0, 1}};
  run_topology("bart-tiny", o, 3, encoder_zmq, 2, NULL);
}

/* --cross-states on the router and every worker (the cross pools hold
 * encoder states): the tokens of tandem-generate without it, over UCX
 * (the pools' own geometry) and over ZeroMQ (the receivers check and write
 * the states' block size). */
Test(cluster, cross_states_match_generate, .timeout = 600) {
  cluster_opts o = {.encoders = 1, .prefills = 1, .decodes = 1, .router_extra = "--cross-states",
                    .worker_extra = "--cross-states"};
  run_topology("t5-tiny", o, 4, all_ucx, 1, NULL);
  run_topology("whisper-tiny", o, 4, all_ucx, 1, NULL);
  o.worker_extra = "--cross-states --kv-transport zmq";
  const kv_want none_ucx[] = {{NULL, 0, 1}};
  run_topology("bart-tiny", o, 4, none_ucx, 1, NULL);
}

/* --cross-mode dual with the steps of two rows or more over the states and
 * single rows over the K/V: the cross blocks carry both, over UCX, over
 * ZeroMQ and into a TP group's ranks (each its K/V heads and the whole
 * states); the tokens are tandem-generate's. */
Test(cluster, cross_dual_match_generate, .timeout = 600) {
  cluster_opts o = {.encoders = 1, .prefills = 1, .decodes = 1, .router_extra = "--cross-mode dual",
                    .worker_extra = "--cross-mode dual --states-rows 2"};
  run_topology("t5-tiny", o, 4, all_ucx, 1, NULL);
  o.worker_extra = "--cross-mode dual --states-rows 2 --kv-transport zmq";
  const kv_want none_ucx[] = {{NULL, 0, 1}};
  run_topology("whisper-tiny", o, 4, none_ucx, 1, NULL);
  const kv_want groups[] = {{"decode-", 0, 1}, {"prefill-", 1, 0}};
  o.worker_extra = "--cross-mode dual --states-rows 2";
  o.group_tp = 2;
  run_topology("bart-tiny", o, 3, groups, 2, NULL);
}

/* The default between an encoder-only worker and decode / prefill workers
 * (cross mode auto): the encoder's pool holds the encoder states only and
 * it pushes those (the blocks' states tails); the receivers project them
 * into every layer's K/V on arrival. Tokens equal tandem-generate's and
 * those of K/V pushes (--cross-transfer kv), over UCX and over ZeroMQ, for
 * T5, BART and Whisper; the bytes a decode worker took are the states'. */
Test(cluster, states_pushed_and_projected_match_generate, .timeout = 600) {
  static const char *const models[] = {"t5-tiny", "bart-tiny", "whisper-tiny"};
  for (int m = 0; m < 3; m++) {
    outcome *st = calloc(MAXQ, sizeof *st), *kv = calloc(MAXQ, sizeof *kv);
    cluster_opts o = {.encoders = 1, .prefills = m == 0, .decodes = 1};
    o.worker_extra = m == 2 ? "--kv-transport zmq" : NULL;
    const kv_want none_ucx[] = {{NULL, 0, 1}};
    int n = run_topology(models[m], o, 3, m == 2 ? none_ucx : all_ucx, 1, st);
    o.worker_extra = m == 2 ? "--kv-transport zmq --cross-transfer kv" : "--cross-transfer kv";
    cr_assert_eq(run_topology(models[m], o, 3, m == 2 ? none_ucx : all_ucx, 1, kv), n);
    expect_same(st, kv, n, models[m]);
    free(st);
    free(kv);
  }
  /* what moved: the encoder says it pushes states; a decode worker's bytes in are states tails */
  fixture fx;
  fx_load("whisper-tiny", &fx);
  cluster c;
  cluster_start(&c, &(cluster_opts){.model = fx.dir, .encoders = 1, .decodes = 1, .block_size = 4,
                                    .router_extra = "--metrics-port 0"});
  expect_fixture_greedy(&c, &fx);
  cr_expect(cluster_log_has(&c, "encoder-0", "cross transfer: encoder states"), "no states transfer in the log");
  kv_count k;
  cr_expect(cluster_kv_count(&c, "decode-", 10000, &k) && k.in_ucx > 0, "the KV counters did not settle");
  usleep(1500 * 1000); /* the router renders /metrics every 250 ms from heartbeats */
  char *text = cluster_scrape(&c);
  cr_expect(text, "no /metrics answer");
  if (text) {
    double in = metric_sample(text, "tandem:kv_bytes_transferred_total{worker=\"decode-0\",direction=\"in\",transport=\"ucx\"}");
    /* a states tail: 4 slots x d_model x 4 bytes a block */
    double tail = 4.0 * fx.d_model * 4.0;
    cr_expect(in > 0 && fmod(in, tail) == 0, "decode-0 took %.0f bytes, not whole states tails of %.0f", in, tail);
    free(text);
  }
  cr_expect(cluster_stop(&c), "processes did not stop cleanly (logs in %s)", c.dir);
  fx_free(&fx);
}

/* An encoder pushing states to a TP group (the default): the leader takes
 * the states tails only (not K/V to re-slice), hands them to its follower
 * over the mirror, and every rank projects its heads' K/V. Tokens equal
 * tandem-generate's and those of K/V pushes (--cross-transfer kv). */
Test(cluster, states_pushed_to_a_tp_group_match_generate, .timeout = 600) {
  static const char *const models[] = {"t5-tiny", "whisper-tiny"};
  const kv_want groups[] = {{"decode-", 0, 1}};
  for (int m = 0; m < 2; m++) {
    outcome *st = calloc(MAXQ, sizeof *st), *kv = calloc(MAXQ, sizeof *kv);
    cluster_opts o = {.encoders = 1, .decodes = 1, .group_tp = 2};
    int n = run_topology(models[m], o, 3, groups, 1, st);
    o.worker_extra = "--cross-transfer kv";
    cr_assert_eq(run_topology(models[m], o, 3, groups, 1, kv), n);
    expect_same(st, kv, n, models[m]);
    free(st);
    free(kv);
  }
  fixture fx;
  fx_load("whisper-tiny", &fx);
  cluster c;
  cluster_start(&c, &(cluster_opts){.model = fx.dir, .encoders = 1, .decodes = 1, .group_tp = 2, .block_size = 4,
                                    .router_extra = "--metrics-port 0"});
  expect_fixture_greedy(&c, &fx);
  cr_expect(cluster_log_has(&c, "encoder-0", "cross transfer: encoder states"), "no states transfer in the log");
  kv_count k;
  cr_expect(cluster_kv_count(&c, "decode-", 10000, &k) && k.in_zmq > 0, "the KV counters did not settle");
  usleep(1500 * 1000); /* the router renders /metrics every 250 ms from heartbeats */
  char *text = cluster_scrape(&c);
  cr_expect(text, "no /metrics answer");
  if (text) {
    double in = metric_sample(text, "tandem:kv_bytes_transferred_total{worker=\"decode-0\",direction=\"in\",transport=\"zmq\"}");
    /* each block a states tail: 4 slots x d_model x 4 bytes, not the whole decoder's K/V */
    double tail = 4.0 * fx.d_model * 4.0;
    cr_expect(in > 0 && in == (double)k.in_zmq * tail, "the group's leader took %.0f bytes in %llu blocks, not states "
              "tails of %.0f", in, (unsigned long long)k.in_zmq, tail);
    free(text);
  }
  cr_expect(cluster_stop(&c), "processes did not stop cleanly (logs in %s)", c.dir);
  fx_free(&fx);
}

/* Decode groups in --cross-states: the leader hands every rank the whole
 * states (not a slice of heads or layers) and slices the prompt KV. */
Test(cluster, cross_states_decode_groups_match_generate, .timeout = 600) {
  const kv_want groups[] = {{"decode-", 0, 1}, {"prefill-", 1, 0}};
  cluster_opts o = {.encoders = 1, .prefills = 1, .decodes = 1, .group_tp = 2, .router_extra = "--cross-states",
                    .worker_extra = "--cross-states"};
  run_topology("t5-tiny", o, 3, groups, 2, NULL);
  o.group_tp = 0;
  o.group_pp = 2;
  run_topology("mbart-prenorm-sharded", o, 3, groups, 2, NULL);
}

Test(cluster, streaming_in_order, .timeout = 300) {
  fixture fx;
  fx_load("t5-tiny", &fx);
  cluster c;
  cluster_opts o = {.model = fx.dir, .encoders = 1, .prefills = 1, .decodes = 1, .prefill_threshold = 3};
  cluster_start(&c, &o);
  char path[600];
  snprintf(path, sizeof path, "%s/stream.jsonl", c.dir);
  FILE *f = fopen(path, "w");
  for (int i = 0; i < 8; i++)
    fprintf(f, "{\"id\": \"st%d\", \"input_ids\": [%d, 5, 9, 1], \"decoder_prompt\": [0, %d, 7], \"max_new_tokens\": 40, "
               "\"ignore_eos\": true}\n",
            i, 10 + i, 20 + i);
  fclose(f);
  td_json_request reqs[8];
  cr_assert_eq(load_requests(path, reqs, 8), 8);
  outcome got[8];
  run_requests(c.client_ep, reqs, 8, true, 30000, got);
  for (int i = 0; i < 8; i++) {
    cr_expect(got[i].done && got[i].status == TD_OK, "%s: %s", got[i].id, got[i].error);
    cr_expect(got[i].order_ok, "%s: chunks out of order", got[i].id);
    cr_expect_eq(got[i].len[0], 40, "%s: %d tokens, asked for 40", got[i].id, got[i].len[0]);
    cr_expect_eq(got[i].n_streamed, got[i].len[0], "%s: streamed %d tokens, result has %d", got[i].id,
                 got[i].n_streamed, got[i].len[0]);
    cr_expect_arr_eq(got[i].streamed, got[i].tok[0], sizeof(int32_t) * (size_t)got[i].len[0], "%s: streamed tokens differ",
                     got[i].id);
    td_json_request_free(&reqs[i]);
  }
  cr_expect(cluster_stop(&c));
  fx_free(&fx);
}

/* deploy/local.sh --demo with `flags` on t5-tiny (ids: no tokenizer): every
 * request of its demo file comes back in order, with as many outputs as it
 * asks for, each max_new_tokens long ("length") or ending on EOS ("stop"),
 * with tandem-generate's tokens and finish reasons for the same file (the
 * sampled request has a seed); with `router_says`, the router's log must
 * hold it. */
static void local_sh_demo(const char *flags, const char *router_says) {
  char dir[] = "/tmp/td-local-XXXXXX";
  cr_assert(mkdtemp(dir));
  char cmd[2048];
  snprintf(cmd, sizeof cmd,
           "TANDEM_BIN=%s %s/deploy/local.sh --demo --model %s/tests/data/t5-tiny --run-dir %s/run --block-size 4 %s "
           "> %s/out.txt 2> %s/err.txt",
           TD_BIN_DIR, TD_SOURCE_DIR, TD_SOURCE_DIR, dir, flags, dir, dir);
  int rc = system(cmd);
  cr_expect(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "local.sh --demo exited %d", rc);
  char p[600];
  snprintf(p, sizeof p, "%s/out.txt", dir);
  FILE *f = fopen(p, "r");
  cr_assert(f);
  char line[8192];
  /* the router's TCP endpoint first, as the README says, then its local link where clients have one */
  bool router_line = fgets(line, sizeof line, f) && !strncmp(line, "router tcp://127.0.0.1:", 23);
  cr_expect(router_line, "no \"router tcp://...\" line first: %s", line);
  if (strstr(flags, "--auth") == NULL && strstr(flags, "--local-link off") == NULL) {
    bool local_line = fgets(line, sizeof line, f) && !strncmp(line, "router-local local:/", 20);
    cr_expect(local_line, "no \"router-local local:...\" line after the router's: %s", line);
  }
  outcome got[8], want[8];
  int n_got = read_results(f, got, 8);
  fclose(f);
  /* the demo's requests, and what tandem-generate makes of them */
  fixture fx;
  fx_load("t5-tiny", &fx);
  snprintf(p, sizeof p, "%s/run/demo.jsonl", dir);
  td_json_request reqs[8];
  int n = load_requests(p, reqs, 8);
  cr_assert_eq(n, 4, "the demo sends %d requests, not greedy, beam, sampled and long-prompt ones", n);
  cr_assert_eq(n_got, n, "%d demo results for %d requests", n_got, n);
  generate_reference(fx.dir, p, 4, want, n);
  for (int i = 0; i < n; i++) {
    const td_request_params *q = &reqs[i].params;
    int outputs = q->num_beams > 1 ? (q->num_return_sequences > 0 ? q->num_return_sequences : 1) : q->n;
    cr_expect_str_eq(got[i].id, reqs[i].id, "result %d", i);
    cr_expect_eq(got[i].status, TD_OK, "%s: %s", got[i].id, got[i].error);
    cr_expect_eq(got[i].n_out, outputs, "%s: %d outputs, asked for %d", got[i].id, got[i].n_out, outputs);
    for (int k = 0; k < got[i].n_out && k < 8; k++) {
      int len = got[i].len[k];
      bool eos = len > 0 && got[i].tok[k][len - 1] == fx.eos;
      if (got[i].finish[k] == TD_FINISH_STOP)
        cr_expect(eos && len <= q->max_new_tokens, "%s output %d: \"stop\" after %d tokens, not on EOS", got[i].id, k,
                  len);
      else
        cr_expect(got[i].finish[k] == TD_FINISH_LENGTH && len == q->max_new_tokens,
                  "%s output %d: \"%s\" after %d tokens, max_new_tokens %d", got[i].id, k,
                  td_finish_name(got[i].finish[k]), len, q->max_new_tokens);
    }
    td_json_request_free(&reqs[i]);
  }
  expect_same(got, want, n, flags[0] ? flags : "local.sh --demo");
  fx_free(&fx);
  /* every process it started is gone: its supervisor logged its end and
   * removed both pid files (deploy/supervise.sh) */
  const char *names[] = {"router", "encoder-0", "prefill-0", "decode-0"};
  for (int i = 0; i < 4; i++) {
    snprintf(p, sizeof p, "%s/run/%s.pid", dir, names[i]);
    cr_expect(access(p, F_OK) != 0, "%s.pid is left: the process may still run", names[i]);
    snprintf(p, sizeof p, "%s/run/%s.supervisor.pid", dir, names[i]);
    cr_expect(access(p, F_OK) != 0, "%s.supervisor.pid is left", names[i]);
    snprintf(cmd, sizeof cmd, "grep -q '^supervise: .* %s: stopped: ' %s/run/%s.log", names[i], dir, names[i]);
    cr_expect_eq(system(cmd), 0, "%s: its supervisor did not log its end", names[i]);
  }
  if (router_says) {
    snprintf(p, sizeof p, "%s/run/router.log", dir);
    f = fopen(p, "r");
    cr_assert(f, "no router.log");
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) found = strstr(line, router_says) != NULL;
    fclose(f);
    cr_expect(found, "the router's log lacks \"%s\"", router_says);
  }
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  cr_expect(system(cmd) == 0);
}

Test(cluster, local_sh_demo, .timeout = 300) { local_sh_demo("", NULL); }

/* --cross-states reaches the router and every worker (a worker without it would be refused) */
Test(cluster, local_sh_demo_cross_states, .timeout = 300) {
  local_sh_demo("--cross-states", "cross pool mode states");
}


/* ---- workers that disagree with the router's cross pool mode ---- */

/* Waits for process idx to exit: its exit status, or -1 (still running,
 * or killed by a signal). */
static int wait_exit(cluster *c, int idx, int timeout_ms) {
  int st = 0;
  int64_t end = td_now_ms() + timeout_ms;
  pid_t r = 0;
  while (td_now_ms() < end && (r = waitpid(c->p[idx].pid, &st, WNOHANG)) == 0) usleep(50000);
  if (r != c->p[idx].pid) return -1;
  c->p[idx].exited = true;
  c->p[idx].status = st;
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* A decode worker, a TP=2 decode group and a group with one rank in the
 * other mode than the router's are refused with a clear error and exit
 * with status 1 (no crash, no hang: the rank in the right mode hears why,
 * whichever joined first); the workers in the router's mode keep serving. */
static void check_mode_refused(bool router_states) {
  fixture fx;
  fx_load("t5-tiny", &fx);
  cluster c;
  const char *mode = router_states ? "--cross-states" : "";
  cluster_start(&c, &(cluster_opts){.model = fx.dir, .encoders = 1, .decodes = 1, .router_extra = mode,
                                    .worker_extra = mode});
  snprintf(c.extra_flags, sizeof c.extra_flags, "%s", router_states ? "" : "--cross-states");
  snprintf(c.extra_worker, sizeof c.extra_worker, "decode-other");
  int w = cluster_add_worker(&c, "decode-other", "decode", 4);
  snprintf(c.extra_worker, sizeof c.extra_worker, "grp-other");
  int g = cluster_add_group(&c, "grp-other", "--tp", 2, 4);
  snprintf(c.extra_worker, sizeof c.extra_worker, "grp-mixed-rank1");
  int m = cluster_add_group(&c, "grp-mixed", "--tp", 2, 4);
  const int idx[5] = {w, g, g + 1, m, m + 1};
  for (int k = 0; k < 5; k++) {
    const char *name = c.p[idx[k]].name;
    int st = wait_exit(&c, idx[k], 30000);
    cr_expect_eq(st, 1, "%s (router %s --cross-states): exit status %d, want 1 (logs in %s)", name,
                 router_states ? "with" : "without", st, c.dir);
    cr_expect(cluster_log_has(&c, name, "cross pool mode differs: the worker runs"), "%s: no clear refusal in its log",
              name);
    cr_expect(cluster_log_has(&c, name, "the router and every worker must agree"), "%s: the log lacks the remedy",
              name);
    cr_expect(!cluster_log_has(&c, name, "Sanitizer"), "%s: a sanitizer report", name);
  }
  cr_expect(cluster_log_has(&c, "decode-other", "the router refused this worker"));
  cr_expect(cluster_log_has(&c, "grp-other", "the router refused the join"));
  cr_expect(cluster_log_has(&c, "grp-mixed", "the router refused the join"));
  cr_expect(cluster_log_has(&c, "router", "refused worker decode-other"));
  /* the workers in the router's mode serve the reference tokens */
  expect_fixture_greedy(&c, &fx);
  td_client_health h;
  cr_expect(cluster_health(&c, &h) && h.decoders == 1 && h.n_workers == 2, "refused workers are listed");
  for (int i = 0; i < h.n_workers; i++)
    cr_expect(strcmp(h.workers[i].id, "decode-other") && strncmp(h.workers[i].id, "grp-other", 9),
              "%s is listed", h.workers[i].id);
  char why[256] = "";
  cr_expect(cluster_wait_idle(&c, 5000, why, sizeof why), "blocks held: %s", why);
  cr_expect(cluster_stop(&c), "processes did not stop cleanly (logs in %s)", c.dir);
  fx_free(&fx);
}

Test(cluster, worker_in_another_cross_mode_is_refused, .timeout = 300) {
  check_mode_refused(true);
  check_mode_refused(false);
}

/* TANDEM_LOG_FORMAT=json: every process writes JSON lines, and a request's
 * lines in the router and in the decode worker carry its id. */
Test(cluster, json_logs_follow_a_request_across_processes, .timeout = 120) {
  fixture fx;
  fx_load("t5-tiny", &fx);
  setenv("TANDEM_LOG_FORMAT", "json", 1);
  setenv("TANDEM_LOG", "debug", 1);
  cluster c;
  cluster_start(&c, &(cluster_opts){.model = fx.dir, .encoders = 1, .decodes = 1});
  unsetenv("TANDEM_LOG_FORMAT");
  unsetenv("TANDEM_LOG");
  td_json_request req;
  char line[256];
  snprintf(line, sizeof line, "{\"id\": \"follow-me\", \"input_ids\": [5, 6, 7, 1], \"max_new_tokens\": 4}");
  cr_assert_eq(td_json_request_parse(line, strlen(line), NULL, 1, &req), TD_OK, "%s", td_errmsg());
  outcome got;
  run_concurrent(c.client_ep, &req, 1, 1, false, &got);
  cr_expect(got.done, "the request did not finish");
  const char *procs[] = {"router", "encoder-0", "decode-0"};
  for (int p = 0; p < 3; p++) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s.log", c.dir, procs[p]);
    FILE *f = fopen(path, "r");
    cr_assert(f, "no log %s", path);
    char buf[4096];
    int lines = 0, json = 0, about = 0;
    while (fgets(buf, sizeof buf, f)) {
      if (buf[0] != '{') continue; /* a sanitizer's or a library's own line */
      lines++;
      cJSON *o = cJSON_Parse(buf);
      json += o != NULL;
      const char *rq = o ? cJSON_GetStringValue(cJSON_GetObjectItem(o, "request")) : NULL;
      about += rq && !strcmp(rq, "follow-me");
      cJSON_Delete(o);
    }
    fclose(f);
    cr_expect(lines > 0 && json == lines, "%s: %d of %d lines parse as JSON", procs[p], json, lines);
    cr_expect(about > 0, "%s: no line names the request", procs[p]);
  }
  cr_expect(cluster_stop(&c), "processes did not stop cleanly (logs in %s)", c.dir);
  td_json_request_free(&req);
  fx_free(&fx);
}
