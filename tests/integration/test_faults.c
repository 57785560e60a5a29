/* Faults in a cluster of real processes on loopback: cancels and deadlines,
 * workers killed or stopped mid-request and while KV is in flight, a drain
 * on SIGTERM, malformed and foreign messages, a group rank's death. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <criterion/criterion.h>

#include "../unit/fixture.h"
#include "cluster_util.h"
#include "common/clock.h"
#include "common/defaults.h"
#include "proto/wire.h"

static td_client_worker worker_status(cluster *c, const char *id) {
  td_client_health h;
  td_client_worker none = {0};
  if (cluster_health(c, &h))
    for (int i = 0; i < h.n_workers; i++)
      if (!strcmp(h.workers[i].id, id)) return h.workers[i];
  return none;
}

static int proc_index(cluster *c, const char *name) {
  for (int i = 0; i < c->n; i++)
    if (!strcmp(c->p[i].name, name)) return i;
  cr_assert_fail("no process %s", name);
  return -1;
}

/* ---- cancel, deadlines ---- */

typedef struct first_tok {
  bool got_token;
  bool done;
  td_status status;
} first_tok;

static void ft_tokens(void *ctx, const char *id, int seq, int off, const int32_t *t, const float *lp, int n) {
  ((first_tok *)ctx)->got_token = true;
}
static void ft_result(void *ctx, const td_client_result *r) {
  first_tok *f = ctx;
  f->done = true;
  f->status = r->status;
}

Test(faults, cancel_and_deadline_free_every_block, .timeout = 300) {
  fixture fx;
  fx_load("t5-tiny", &fx);
  cluster c;
  /* decode-0 is stopped for a moment below: the router must not give up on it */
  cluster_opts o = {.model = fx.dir, .encoders = 1, .prefills = 1, .decodes = 1, .prefill_threshold = 3,
                    .router_extra = "--dead-after 25"};
  cluster_start(&c, &o);
  td_client *cl;
  cr_assert(td_client_connect(c.client_ep, &cl) == TD_OK);
  const char *line = "{\"id\": \"long\", \"input_ids\": [4, 8, 15, 16, 23, 42, 1], \"decoder_prompt\": [0, 5, 6, 7], "
                     "\"max_new_tokens\": 500, \"ignore_eos\": true}";
  td_json_request r;
  cr_assert(td_json_request_parse(line, strlen(line), ".", 1, &r) == TD_OK);
  first_tok ft = {0};
  td_client_events ev = {.on_tokens = ft_tokens, .on_result = ft_result, .ctx = &ft};
  cr_assert(td_client_generate(cl, &r, true, 60000) == TD_OK);
  int64_t end = td_now_ms() + 20000;
  while (!ft.got_token && !ft.done && td_now_ms() < end) td_client_poll(cl, 50, &ev);
  cr_assert(ft.got_token, "no token streamed");
  /* with decode-0 stopped the request cannot finish before the cancel */
  pid_t d0 = c.p[proc_index(&c, "decode-0")].pid;
  kill(d0, SIGSTOP);
  cr_assert(td_client_cancel(cl, "long") == TD_OK);
  while (!ft.done && td_now_ms() < end) td_client_poll(cl, 50, &ev);
  kill(d0, SIGCONT);
  cr_expect(ft.done && ft.status == TD_ERR_CANCELLED, "cancel: status %s", td_status_str(ft.status));
  /* a deadline too short to finish in (decode-0 stopped: an optimised
   * build can finish the 500 tokens within 30 ms) */
  snprintf(r.id, sizeof r.id, "late");
  ft = (first_tok){0};
  kill(d0, SIGSTOP);
  cr_assert(td_client_generate(cl, &r, false, 30) == TD_OK);
  while (!ft.done && td_now_ms() < end) td_client_poll(cl, 50, &ev);
  kill(d0, SIGCONT);
  cr_expect(ft.done && ft.status == TD_ERR_TIMEOUT, "deadline: status %s", td_status_str(ft.status));
  td_client_close(cl);
  td_json_request_free(&r);
  char why[256] = "";
  cr_expect(cluster_wait_idle(&c, 5000, why, sizeof why), "blocks held after cancel/deadline: %s", why);
  cr_expect(cluster_stop(&c));
  fx_free(&fx);
}

/* ---- a decode worker dies ---- */

/* Three requests of four give no decoder prompt (the model's start token):
 * a resumed one must continue after that token. */
static void long_requests(const char *path, int n, int max_new) {
  FILE *f = fopen(path, "w");
  for (int i = 0; i < n; i++) {
    char prompt[64] = "";
    if (i % 4 == 0) snprintf(prompt, sizeof prompt, "\"decoder_prompt\": [0, %d], ", 60 + i);
    /* some beams and seeded samples: they restart from their prompt on
     * another worker and must give the undisturbed run's outputs */
    const char *kind = i % 6 == 1   ? "\"num_beams\": 3, \"num_return_sequences\": 2, "
                       : i % 6 == 3 ? "\"n\": 2, \"temperature\": 0.8, \"seed\": 11, "
                                    : "";
    fprintf(f, "{\"id\": \"k%d\", \"input_ids\": [%d, %d, 9, 1], %s%s\"max_new_tokens\": %d, \"ignore_eos\": true}\n",
            i, 3 + i, 40 + 2 * i, prompt, kind, max_new);
  }
  fclose(f);
}

typedef struct kill_ctx {
  cluster *c;
  int victim;
  bool killed;
} kill_ctx;

/* Whether the victim holds work: it says so (running, with its heartbeat
 * every 200 ms), or the router has given it requests (jobs, at once) and
 * the encoders are done with theirs, so their KV connections to it are
 * made (killing a worker while a peer's UCX endpoint to it is being
 * created leaks inside UCX; docs/kvtransfer.md). An optimised build can
 * finish every request within one heartbeat. */
static bool holds_work(const td_client_health *h, const char *victim) {
  int enc_jobs = 0, jobs = 0, running = 0;
  for (int i = 0; i < h->n_workers; i++) {
    if (!strncmp(h->workers[i].id, "encoder", 7)) enc_jobs += h->workers[i].jobs;
    if (!strcmp(h->workers[i].id, victim)) jobs = h->workers[i].jobs, running = h->workers[i].running;
  }
  return running > 0 || (jobs > 0 && enc_jobs == 0);
}

static void *killer(void *arg) {
  kill_ctx *k = arg;
  /* wait until the victim holds work, then kill it */
  int64_t end = td_now_ms() + 20000;
  while (td_now_ms() < end) {
    td_client_health h;
    if (cluster_health(k->c, &h) && holds_work(&h, k->c->p[k->victim].name)) {
      cluster_kill(k->c, k->victim);
      k->killed = true;
      return NULL;
    }
    usleep(2000);
  }
  return NULL;
}

/* Kills the rank after k->victim (a follower) once the leader k->victim runs work. */
static void *killer_rank(void *arg) {
  kill_ctx *k = arg;
  int64_t end = td_now_ms() + 20000;
  while (td_now_ms() < end) {
    td_client_health h;
    if (cluster_health(k->c, &h) && holds_work(&h, k->c->p[k->victim].name)) {
      cluster_kill(k->c, k->victim + 1);
      k->killed = true;
      return NULL;
    }
    usleep(2000);
  }
  return NULL;
}

/* Requests that ended with a result, by any finish reason, in a /metrics text. */
static double successes(const char *t) {
  double n = 0;
  for (const char *p = t; (p = strstr(p, "\ntandem:request_success_total{")); p++)
    n += strtod(strchr(p, ' ') + 1, NULL);
  return n;
}

/* Marian: absolute (sinusoidal) positions, so that a resumed prompt that
 * lost its start token would shift every position and change the tokens. */
static void decode_worker_killed(int prefills) {
  fixture fx;
  fx_load("marian-sinusoidal", &fx);
  cluster c;
  cluster_opts o = {.model = fx.dir, .encoders = 1, .prefills = prefills, .decodes = 2,
                    .router_extra = "--metrics-port 0"};
  cluster_start(&c, &o);
  char path[600];
  snprintf(path, sizeof path, "%s/long.jsonl", c.dir);
  long_requests(path, 12, 120);
  td_json_request reqs[12];
  cr_assert_eq(load_requests(path, reqs, 12), 12);
  outcome want[12], got[12];
  generate_reference(fx.dir, path, 4, want, 12);
  int victim = -1;
  for (int i = 0; i < c.n; i++)
    if (!strcmp(c.p[i].name, "decode-0")) victim = i;
  kill_ctx k = {&c, victim, false};
  pthread_t th;
  pthread_create(&th, NULL, killer, &k);
  int64_t t0 = td_now_ms();
  run_requests(c.client_ep, reqs, 12, true, 60000, got);
  pthread_join(th, NULL);
  cr_expect(k.killed, "decode-0 never held work");
  /* every request survives: the killed worker's single sequences resume on
   * decode-1 from their prompt (the start token) and the tokens already
   * streamed (with a prefill worker, a resumed prompt long enough goes
   * through it); its beams and seeded samples restart, with the same outputs */
  for (int i = 0; i < 12; i++) {
    cr_expect(got[i].done, "%s: no answer", got[i].id);
    cr_expect_eq(got[i].status, TD_OK, "%s failed: %s", got[i].id, got[i].error);
    if (got[i].status != TD_OK) continue;
    cr_expect_eq(got[i].n_out, want[i].n_out, "%s: %d outputs, want %d", got[i].id, got[i].n_out, want[i].n_out);
    for (int sq = 0; sq < want[i].n_out && sq < got[i].n_out; sq++) {
      cr_expect_eq(got[i].len[sq], want[i].len[sq], "%s output %d", got[i].id, sq);
      cr_expect_arr_eq(got[i].tok[sq], want[i].tok[sq], sizeof(int32_t) * (size_t)want[i].len[sq],
                       "%s output %d: resumed tokens differ", got[i].id, sq);
    }
  }
  cr_expect(td_now_ms() - t0 < 60000, "requests took too long after the failure");
  /* the encoder's blocks went over UCX (the default) */
  td_client_health h;
  uint64_t enc_ucx = 0;
  if (cluster_health(&c, &h))
    for (int i = 0; i < h.n_workers; i++)
      if (!strcmp(h.workers[i].id, "encoder-0")) enc_ucx = h.workers[i].kv_out_ucx;
  cr_expect(enc_ucx > 0, "the encoder pushed no KV over UCX");
  /* the router keeps serving */
  outcome again[1];
  run_requests(c.client_ep, reqs, 1, false, 30000, again);
  cr_expect(again[0].done && again[0].status == TD_OK, "after the failure: %s", again[0].error);
  char why[256] = "";
  cr_expect(cluster_wait_idle(&c, 5000, why, sizeof why), "survivors hold blocks: %s", why);
  /* the metrics tell it: retries, every request a success, decode-0 down */
  char *t = NULL;
  for (int64_t end = td_now_ms() + 5000; td_now_ms() < end; usleep(100 * 1000)) {
    free(t);
    t = cluster_scrape(&c);
    cr_assert(t, "no answer from /metrics");
    if (successes(t) == 13) break;
  }
  cr_expect_eq(successes(t), 13, "%s", t);
  cr_expect_geq(metric_sample(t, "tandem:request_retries_total"), 1, "%s", t);
  cr_expect_eq(metric_sample(t, "tandem:worker_up{worker=\"decode-0\",roles=\"decode\"}"), 0, "%s", t);
  cr_expect_eq(metric_sample(t, "tandem:worker_up{worker=\"decode-1\",roles=\"decode\"}"), 1);
  free(t);
  cr_expect(cluster_stop(&c));
  for (int i = 0; i < 12; i++) td_json_request_free(&reqs[i]);
  fx_free(&fx);
}

Test(faults, decode_worker_killed_mid_request, .timeout = 300) { decode_worker_killed(0); }
Test(faults, decode_worker_killed_mid_request_with_prefill, .timeout = 300) { decode_worker_killed(1); }

/* A second tandem-worker started with a live worker's id while requests
 * run: refused (it waits for the id), the router keeps serving, every
 * request gives the reference tokens. Before, ROUTER_HANDOVER let the
 * second connection take the identity and libzmq aborted the router. */
Test(faults, a_duplicate_worker_id_under_load_is_refused, .timeout = 300) {
  fixture fx;
  fx_load("marian-sinusoidal", &fx);
  cluster c;
  cluster_opts o = {.model = fx.dir, .encoders = 1, .decodes = 2};
  cluster_start(&c, &o);
  char path[600];
  snprintf(path, sizeof path, "%s/long.jsonl", c.dir);
  enum { N = 48 };
  long_requests(path, N, 120);
  static td_json_request reqs[N];
  cr_assert_eq(load_requests(path, reqs, N), N);
  static outcome want[N], got[N];
  generate_reference(fx.dir, path, 4, want, N);
  /* batches of requests run until the claimants have been refused and two
   * batches more; a few claimants start as a restart loop would */
  int dups[3], n_dups = 0, after = 0, batches = 0;
  for (; batches < 40 && after < 2; batches++) {
    memset(got, 0, sizeof got);
    client_job cj = {.ep = c.client_ep, .reqs = reqs, .n = N, .out = got, .stream = true};
    pthread_t th;
    pthread_create(&th, NULL, client_thread, &cj);
    if (n_dups < 3) {
      usleep(20 * 1000);
      dups[n_dups++] = cluster_add_worker(&c, "decode-0", "decode", 4);
    }
    pthread_join(th, NULL);
    for (int i = 0; i < N; i++) {
      cr_expect(got[i].done && got[i].status == TD_OK, "batch %d, %s: %s", batches, got[i].id, got[i].error);
      if (got[i].status == TD_OK)
        cr_expect_arr_eq(got[i].tok[0], want[i].tok[0], sizeof(int32_t) * (size_t)want[i].len[0], "%s", got[i].id);
    }
    if (after || cluster_log_has(&c, "router", TD_ROUTER_ID_IN_USE)) after++;
  }
  cr_expect_eq(after, 2, "no claimant was refused in %d batches", batches);
  cr_log_info("claimants refused by batch %d of requests", batches - 2);
  int router = proc_index(&c, "router");
  cr_expect(waitpid(c.p[router].pid, NULL, WNOHANG) == 0, "the router exited");
  td_client_health h;
  cr_assert(cluster_health(&c, &h), "no health answer");
  cr_expect_eq(h.decoders, 2, "a claimant took a place in the pool");
  for (int i = 0; i < n_dups; i++) cluster_kill(&c, dups[i]);
  cr_expect(cluster_stop(&c));
  for (int i = 0; i < N; i++) td_json_request_free(&reqs[i]);
  fx_free(&fx);
}

typedef struct start_arg {
  pthread_t *th;
  client_job *cj;
} start_arg;

static void start_client(void *arg) {
  start_arg *a = arg;
  pthread_create(a->th, NULL, client_thread, a->cj);
}

/* Holds the encoder while requests sent by start(arg) make decode-0
 * reserve blocks, then stops decode-0 and lets the encoder go on: its UCX
 * transfers to decode-0 wait for a grant that cannot come. */
static void stall_kv_to_decode0(cluster *c, void (*start)(void *), void *arg) {
  int enc = proc_index(c, "encoder-0"), d0i = proc_index(c, "decode-0");
  kill(c->p[enc].pid, SIGSTOP);
  start(arg);
  int64_t end = td_now_ms() + 10000;
  td_client_worker d0 = {0};
  while (td_now_ms() < end) {
    d0 = worker_status(c, "decode-0");
    if (d0.free_cross_blocks > 0 && d0.free_cross_blocks < d0.cross_blocks) break;
    usleep(20000);
  }
  cr_expect(d0.free_cross_blocks > 0 && d0.free_cross_blocks < d0.cross_blocks, "decode-0 reserved nothing");
  /* its main thread sends the reservations to the router (it has them already) */
  usleep(500000);
  kill(c->p[d0i].pid, SIGSTOP);
  kill(c->p[enc].pid, SIGCONT);
  td_client_worker e0 = {0};
  end = td_now_ms() + 10000;
  while (td_now_ms() < end && (e0 = worker_status(c, "encoder-0")).kv_pushing == 0) usleep(20000);
  cr_expect(e0.kv_pushing > 0, "the encoder has no KV push in flight");
}

/* A decode worker dies while the encoder's UCX transfers to it wait for
 * their grant: the encoder learns it from UCX (not from a timeout), the
 * router retries, every request completes on the other decode worker. */
Test(faults, decode_worker_killed_while_kv_in_flight_over_ucx, .timeout = 300) {
  fixture fx;
  fx_load("t5-tiny", &fx);
  cluster c;
  /* the router notices a silent worker only after 5 s: what ends the
   * transfers is UCX's failure report */
  cluster_opts o = {.model = fx.dir, .encoders = 1, .decodes = 2, .router_extra = "--dead-after 25"};
  cluster_start(&c, &o);
  char path[600];
  snprintf(path, sizeof path, "%s/inflight.jsonl", c.dir);
  long_requests(path, 8, 20);
  td_json_request reqs[8];
  cr_assert_eq(load_requests(path, reqs, 8), 8);
  outcome want[8], got[8];
  generate_reference(fx.dir, path, 4, want, 8);
  int victim = proc_index(&c, "decode-0");
  client_job cj = {c.client_ep, reqs, 8, got, false};
  pthread_t th;
  stall_kv_to_decode0(&c, start_client, &(start_arg){&th, &cj});
  int64_t t_kill = td_now_ms();
  cluster_kill(&c, victim);
  pthread_join(th, NULL);
  for (int i = 0; i < 8; i++) {
    cr_expect(got[i].done && got[i].status == TD_OK, "%s: %s", got[i].id, got[i].error);
    cr_expect_eq(got[i].len[0], want[i].len[0], "%s: %d tokens, want %d", got[i].id, got[i].len[0], want[i].len[0]);
    cr_expect_arr_eq(got[i].tok[0], want[i].tok[0], sizeof(int32_t) * (size_t)want[i].len[0], "%s: tokens differ",
                     got[i].id);
  }
  cr_expect(td_now_ms() - t_kill < 30000, "requests took %lld ms after the kill", (long long)(td_now_ms() - t_kill));
  /* UCX reported the dead receiver: the pushes failed and were retried */
  cr_expect(cluster_log_has(&c, "encoder-0", "KV receiver decode-0 failed"), "the encoder saw no UCX peer failure");
  cr_expect(cluster_log_has(&c, "router", "retrying: KV push failed"), "no request was retried after a failed push");
  td_client_worker e0 = worker_status(&c, "encoder-0");
  cr_expect(e0.kv_out_ucx > 0, "the encoder pushed no KV over UCX");
  char why[256] = "";
  cr_expect(cluster_wait_idle(&c, 8000, why, sizeof why), "survivors hold blocks: %s", why);
  cr_expect(cluster_stop(&c));
  for (int i = 0; i < 8; i++) td_json_request_free(&reqs[i]);
  fx_free(&fx);
}

typedef struct send_arg {
  td_client *cl;
  td_json_request *reqs;
  int n;
} send_arg;

static void send_all(void *arg) {
  send_arg *a = arg;
  for (int i = 0; i < a->n; i++) cr_assert(td_client_generate(a->cl, &a->reqs[i], false, 60000) == TD_OK);
}

static void count_result(void *ctx, const td_client_result *r) {
  int *n = ctx;
  if (r->status == TD_ERR_CANCELLED) (*n)++;
}

/* Requests cancelled while their KV waits in UCX transfers: the transfers
 * are cancelled, the encoder gets its blocks back once they stopped, the
 * stalled receiver refuses or drops what comes late, and every block of
 * every worker is free again. */
Test(faults, cancel_while_kv_in_flight_over_ucx_frees_every_block, .timeout = 300) {
  fixture fx;
  fx_load("t5-tiny", &fx);
  cluster c;
  cluster_opts o = {.model = fx.dir, .encoders = 1, .decodes = 1, .router_extra = "--dead-after 25"};
  cluster_start(&c, &o);
  char path[600];
  snprintf(path, sizeof path, "%s/cancel.jsonl", c.dir);
  long_requests(path, 4, 20);
  td_json_request reqs[4];
  cr_assert_eq(load_requests(path, reqs, 4), 4);
  td_client *cl;
  cr_assert(td_client_connect(c.client_ep, &cl) == TD_OK);
  stall_kv_to_decode0(&c, send_all, &(send_arg){cl, reqs, 4});
  for (int i = 0; i < 4; i++) cr_assert(td_client_cancel(cl, reqs[i].id) == TD_OK);
  int ended = 0;
  td_client_events ev = {.on_result = count_result, .ctx = &ended};
  int64_t end = td_now_ms() + 20000;
  while (td_client_pending(cl) > 0 && td_now_ms() < end) td_client_poll(cl, 50, &ev);
  cr_expect_eq(ended, 4, "%d of 4 requests ended as cancelled", ended);
  /* the cancelled transfers end without the receiver */
  end = td_now_ms() + 10000;
  td_client_worker e0 = {0};
  while (td_now_ms() < end && (e0 = worker_status(&c, "encoder-0")).kv_pushing > 0) usleep(50000);
  cr_expect_eq(e0.kv_pushing, 0, "the encoder still has %d pushes", e0.kv_pushing);
  kill(c.p[proc_index(&c, "decode-0")].pid, SIGCONT);
  char why[256] = "";
  cr_expect(cluster_wait_idle(&c, 10000, why, sizeof why), "blocks held after the cancel: %s", why);
  /* and the pair still works */
  outcome again[1];
  run_requests(c.client_ep, reqs, 1, false, 30000, again);
  cr_expect(again[0].done && again[0].status == TD_OK, "after the cancel: %s", again[0].error);
  kv_count k;
  cr_expect(cluster_kv_count(&c, "decode-0", 10000, &k) && k.in_ucx > 0, "decode-0 received nothing over UCX");
  td_client_close(cl);
  cr_expect(cluster_stop(&c));
  for (int i = 0; i < 4; i++) td_json_request_free(&reqs[i]);
  fx_free(&fx);
}

/* SIGTERM while decode-1 holds requests: it finishes them (the router
 * retries none elsewhere), exits with status 0 and leaves the pool. The
 * encoder is stopped until then, so that decode-1 holds every request of
 * its share (an optimised build could finish them between two looks). */
Test(faults, sigterm_drains_a_decode_worker, .timeout = 300) {
  fixture fx;
  fx_load("t5-tiny", &fx);
  cluster c;
  cluster_opts o = {.model = fx.dir, .encoders = 1, .prefills = 0, .decodes = 2, .router_extra = "--dead-after 25"};
  cluster_start(&c, &o);
  char path[600];
  snprintf(path, sizeof path, "%s/drain.jsonl", c.dir);
  long_requests(path, 8, 500);
  td_json_request reqs[8];
  cr_assert_eq(load_requests(path, reqs, 8), 8);
  int victim = proc_index(&c, "decode-1"), enc = proc_index(&c, "encoder-0");
  kill(c.p[enc].pid, SIGSTOP);
  outcome got[8];
  client_job cj = {c.client_ep, reqs, 8, got, false};
  pthread_t th;
  pthread_create(&th, NULL, client_thread, &cj);
  /* every request placed and decode-1 holding blocks for its share (its
   * heartbeat every 200 ms) */
  bool held = false;
  int64_t end = td_now_ms() + 10000;
  while (!held && td_now_ms() < end) {
    td_client_health h;
    if (cluster_health(&c, &h))
      for (int i = 0; i < h.n_workers; i++)
        if (!strcmp(h.workers[i].id, "decode-1")) {
          const td_client_worker *w = &h.workers[i];
          held = h.queued == 0 && w->jobs > 0 && w->free_cross_blocks < w->cross_blocks;
        }
    if (!held) usleep(20000);
  }
  cr_expect(held, "decode-1 reserved nothing");
  /* the rest of its share's jobs land (as in stall_kv_to_decode0) */
  usleep(500000);
  kill(c.p[victim].pid, SIGTERM);
  kill(c.p[enc].pid, SIGCONT);
  /* it finishes its work and exits by itself */
  int st = 0;
  end = td_now_ms() + 30000;
  pid_t r = 0;
  while (td_now_ms() < end && (r = waitpid(c.p[victim].pid, &st, WNOHANG)) == 0) usleep(50000);
  cr_expect_eq(r, c.p[victim].pid, "decode-1 did not exit after SIGTERM");
  c.p[victim].exited = true;
  cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "decode-1 exit status %d", st);
  pthread_join(th, NULL);
  for (int i = 0; i < 8; i++) {
    cr_expect(got[i].done && got[i].status == TD_OK, "%s: %s", got[i].id, got[i].error);
    cr_expect_eq(got[i].len[0], 500, "%s: %d tokens", got[i].id, got[i].len[0]);
  }
  cr_expect(cluster_log_has(&c, "decode-1", "draining: finishing") &&
                !cluster_log_has(&c, "decode-1", "draining: finishing 0 requests"),
            "decode-1 had nothing to drain");
  cr_expect(!cluster_log_has(&c, "router", "retrying"), "a request was retried: decode-1 dropped work");
  cr_expect(cluster_wait_ready(&c, 1, 0, 1, 5000), "the router still lists the drained worker");
  cr_expect(cluster_stop(&c));
  for (int i = 0; i < 8; i++) td_json_request_free(&reqs[i]);
  fx_free(&fx);
}

/* ---- bad clients ---- */

static Tandem__ServerMessage *raw_roundtrip(void *sock, const void *data, size_t len) {
  zmq_send(sock, data, len, 0);
  zmq_pollitem_t it = {.socket = sock, .events = ZMQ_POLLIN};
  if (zmq_poll(&it, 1, 5000) <= 0) return NULL;
  uint8_t buf[65536];
  int n = zmq_recv(sock, buf, sizeof buf, 0);
  if (n <= 0) return NULL;
  return tandem__server_message__unpack(NULL, (size_t)n, buf);
}

Test(faults, malformed_and_foreign_messages, .timeout = 300) {
  fixture fx;
  fx_load("bart-tiny", &fx);
  cluster c;
  cluster_opts o = {.model = fx.dir, .encoders = 1, .prefills = 0, .decodes = 1};
  cluster_start(&c, &o);
  void *ctx = zmq_ctx_new();
  void *s = zmq_socket(ctx, ZMQ_DEALER);
  int linger = 0;
  zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
  cr_assert(zmq_connect(s, c.client_ep) == 0);
  /* garbage */
  Tandem__ServerMessage *m = raw_roundtrip(s, "\xff\x01garbage", 9);
  cr_assert(m && m->body_case == TANDEM__SERVER_MESSAGE__BODY_ERROR, "no error for garbage");
  cr_expect_eq(m->error->code, TANDEM__ERROR_CODE__ERROR_MALFORMED);
  tandem__server_message__free_unpacked(m, NULL);
  /* another protocol version */
  Tandem__HealthRequest hr = TANDEM__HEALTH_REQUEST__INIT;
  Tandem__ClientMessage cm = TANDEM__CLIENT_MESSAGE__INIT;
  cm.version = 99;
  cm.body_case = TANDEM__CLIENT_MESSAGE__BODY_HEALTH;
  cm.health = &hr;
  uint8_t buf[256];
  size_t n = tandem__client_message__pack(&cm, buf);
  m = raw_roundtrip(s, buf, n);
  cr_assert(m && m->body_case == TANDEM__SERVER_MESSAGE__BODY_ERROR, "no error for version 99");
  cr_expect_eq(m->error->code, TANDEM__ERROR_CODE__ERROR_VERSION);
  cr_expect(strstr(m->error->message, "version 99"), "%s", m->error->message);
  tandem__server_message__free_unpacked(m, NULL);
  /* a request with bad fields */
  Tandem__GenerateRequest g = TANDEM__GENERATE_REQUEST__INIT;
  int32_t ids[2] = {5, 999999};
  g.request_id = "bad";
  g.input_ids = ids;
  g.n_input_ids = 2;
  cm.version = TD_PROTOCOL_VERSION;
  cm.body_case = TANDEM__CLIENT_MESSAGE__BODY_GENERATE;
  cm.generate = &g;
  n = tandem__client_message__pack(&cm, buf);
  m = raw_roundtrip(s, buf, n);
  cr_assert(m && m->body_case == TANDEM__SERVER_MESSAGE__BODY_ERROR);
  cr_expect_eq(m->error->code, TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT);
  cr_expect(strstr(m->error->message, "outside the vocabulary"), "%s", m->error->message);
  tandem__server_message__free_unpacked(m, NULL);
  /* an oversized message: the router drops the connection, nothing else */
  size_t big = (size_t)TD_WIRE_MAX_MSG + 1024;
  char *huge = calloc(1, big);
  zmq_send(s, huge, big, 0);
  free(huge);
  zmq_close(s);
  /* a worker that speaks another version is refused */
  void *w = zmq_socket(ctx, ZMQ_DEALER);
  zmq_setsockopt(w, ZMQ_LINGER, &linger, sizeof linger);
  zmq_setsockopt(w, ZMQ_ROUTING_ID, "future-worker", 13);
  cr_assert(zmq_connect(w, c.worker_ep) == 0);
  Tandem__Cluster__Register reg = TANDEM__CLUSTER__REGISTER__INIT;
  Tandem__Cluster__WorkerMessage wm = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  wm.version = TD_PROTOCOL_VERSION + 1;
  wm.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_REGISTER;
  wm.register_ = &reg;
  n = tandem__cluster__worker_message__pack(&wm, buf);
  zmq_send(w, buf, n, 0);
  zmq_pollitem_t it = {.socket = w, .events = ZMQ_POLLIN};
  cr_assert(zmq_poll(&it, 1, 5000) == 1, "no answer to a foreign worker");
  int got = zmq_recv(w, buf, sizeof buf, 0);
  Tandem__Cluster__RouterMessage *rm = tandem__cluster__router_message__unpack(NULL, (size_t)got, buf);
  cr_assert(rm && rm->body_case == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ACK);
  cr_expect(!rm->ack->accepted);
  cr_expect(strstr(rm->ack->reason, "version"), "%s", rm->ack->reason);
  tandem__cluster__router_message__free_unpacked(rm, NULL);
  zmq_send(w, "junk", 4, 0);
  zmq_close(w);
  zmq_ctx_term(ctx);
  /* well-behaved clients are served throughout */
  expect_fixture_greedy(&c, &fx);
  td_client_health h;
  cr_expect(cluster_health(&c, &h) && h.decoders == 1 && h.n_workers == 2, "the foreign worker was registered");
  cr_expect(cluster_stop(&c));
  fx_free(&fx);
}

Test(faults, group_rank_death_takes_the_group_out, .timeout = 300) {
  fixture fx;
  fx_load("t5-tiny", &fx);
  cluster c;
  /* a TP=2 group and a plain decode worker, both fed encoder states (the group's ranks project theirs) */
  cluster_start(&c, &(cluster_opts){.model = fx.dir, .encoders = 1, .decodes = 1});
  int g0 = cluster_add_group(&c, "grp", "--tp", 2, 4);
  cr_assert(cluster_wait_ready(&c, 1, 0, 2, 30000), "the group did not join");
  char path[600];
  snprintf(path, sizeof path, "%s/long.jsonl", c.dir);
  long_requests(path, 10, 200);
  td_json_request reqs[10];
  cr_assert_eq(load_requests(path, reqs, 10), 10);
  outcome want[10], got[10];
  generate_reference(fx.dir, path, 4, want, 10);
  /* kill the follower rank once the group's leader runs work */
  kill_ctx k = {&c, g0, false};
  pthread_t th;
  pthread_create(&th, NULL, killer_rank, &k);
  run_requests(c.client_ep, reqs, 10, true, 60000, got);
  pthread_join(th, NULL);
  cr_expect(k.killed, "the group never ran work");
  for (int i = 0; i < 10; i++) {
    cr_expect(got[i].done && got[i].status == TD_OK, "%s: %s", got[i].id, got[i].error);
    cr_expect_eq(got[i].len[0], want[i].len[0], "%s: %d tokens, want %d", got[i].id, got[i].len[0], want[i].len[0]);
    cr_expect_arr_eq(got[i].tok[0], want[i].tok[0], sizeof(int32_t) * (size_t)want[i].len[0], "%s: tokens differ",
                     got[i].id);
  }
  /* the leader left with its follower: only the plain decode worker is listed */
  cr_expect(cluster_wait_ready(&c, 1, 0, 1, 10000), "the group is still in the pool");
  int st = 0;
  int64_t end = td_now_ms() + 15000;
  pid_t r = 0;
  while (td_now_ms() < end && (r = waitpid(c.p[g0].pid, &st, WNOHANG)) == 0) usleep(50000);
  cr_expect_eq(r, c.p[g0].pid, "the group leader did not exit");
  if (r == c.p[g0].pid) c.p[g0].exited = true;
  char why[256] = "";
  cr_expect(cluster_wait_idle(&c, 5000, why, sizeof why), "blocks held: %s", why);
  cr_expect(cluster_stop(&c), "processes did not stop cleanly (logs in %s)", c.dir);
  for (int i = 0; i < 10; i++) td_json_request_free(&reqs[i]);
  fx_free(&fx);
}

/* ---- the router is lost ---- */

typedef struct ended {
  int n;
  char id[8][16];
  td_status status[8];
  char error[8][400];
  int64_t at[8];
} ended;

static void on_end(void *ctx, const td_client_result *r) {
  ended *e = ctx;
  if (e->n >= 8) return;
  snprintf(e->id[e->n], sizeof e->id[e->n], "%s", r->id);
  e->status[e->n] = r->status;
  snprintf(e->error[e->n], sizeof e->error[e->n], "%s", r->error ? r->error : "");
  e->at[e->n++] = td_now_ms();
}

static void send_one(td_client *cl, const char *id, int max_new, uint32_t timeout_ms) {
  char line[256];
  snprintf(line, sizeof line, "{\"id\": \"%s\", \"input_ids\": [4, 8, 15, 16, 23, 42, 1], \"max_new_tokens\": %d, "
           "\"ignore_eos\": true}", id, max_new);
  td_json_request r;
  cr_assert(td_json_request_parse(line, strlen(line), ".", 1, &r) == TD_OK);
  cr_assert(td_client_generate(cl, &r, true, timeout_ms) == TD_OK, "%s", td_errmsg());
  td_json_request_free(&r);
}

/* Polls until n requests ended or timeout_ms passed. */
static void wait_ended(td_client *cl, ended *e, int n, int timeout_ms) {
  td_client_events ev = {.on_result = on_end, .ctx = e};
  for (int64_t end = td_now_ms() + timeout_ms; e->n < n && td_now_ms() < end;) td_client_poll(cl, 50, &ev);
}

/* Requests held by a router that dies end within seconds with "router
 * unreachable" (the client library sees its connection go: at once for a
 * killed process, within the ZeroMQ heartbeat's timeout for a silent one),
 * not at their deadline (60 s here) plus the grace; a request sent while no
 * router runs waits TD_CLIENT_ROUTER_WAIT_MS for one; the same client's
 * next requests go to the router started again, or back again. */
Test(faults, a_lost_routers_requests_fail_fast_and_the_next_router_serves, .timeout = 300) {
  fixture fx;
  fx_load("t5-tiny", &fx);
  cluster c;
  cluster_opts o = {.model = fx.dir, .decodes = 1};
  cluster_start(&c, &o);
  td_client *cl;
  cr_assert(td_client_connect_wait(c.client_ep, 5000, &cl) == TD_OK);
  int rt = proc_index(&c, "router");
  pid_t d0 = c.p[proc_index(&c, "decode-0")].pid;
  /* held: decode-0 stopped, so that none can end before the kill */
  kill(d0, SIGSTOP);
  for (int i = 0; i < 4; i++) {
    char id[16];
    snprintf(id, sizeof id, "held%d", i);
    send_one(cl, id, 200, 60000);
  }
  ended e = {0};
  wait_ended(cl, &e, 1, 300);
  cr_assert_eq(e.n, 0, "%s ended before the kill: %s", e.id[0], e.error[0]);
  int64_t t0 = td_now_ms();
  cluster_kill(&c, rt);
  wait_ended(cl, &e, 4, 20000);
  cr_assert_eq(e.n, 4, "%d of 4 held requests ended after the router's SIGKILL", e.n);
  for (int i = 0; i < 4; i++) {
    cr_expect_eq(e.status[i], TD_ERR_NETWORK, "%s: %s", e.id[i], td_status_str(e.status[i]));
    cr_expect(strstr(e.error[i], "router unreachable: the connection to the router"), "%s: %s", e.id[i], e.error[i]);
    cr_expect_lt(e.at[i] - t0, 3000, "%s ended %lld ms after the kill", e.id[i], (long long)(e.at[i] - t0));
  }
  cr_log_info("held requests ended %lld ms after the router's SIGKILL", (long long)(e.at[3] - t0));
  kill(d0, SIGCONT);
  /* no router: a new request waits for one, then says so */
  e = (ended){0};
  t0 = td_now_ms();
  send_one(cl, "orphan", 4, 60000);
  wait_ended(cl, &e, 1, 20000);
  cr_assert_eq(e.n, 1);
  cr_expect_eq(e.status[0], TD_ERR_NETWORK);
  cr_expect(strstr(e.error[0], "router unreachable: no connection to the router"), "%s", e.error[0]);
  cr_expect(e.at[0] - t0 >= TD_CLIENT_ROUTER_WAIT_MS - 100 && e.at[0] - t0 < TD_CLIENT_ROUTER_WAIT_MS + 2000,
            "ended after %lld ms", (long long)(e.at[0] - t0));
  /* the router again, on its endpoints: the same client's next request is served */
  rt = cluster_restart(&c, rt);
  cr_assert(cluster_wait_ready(&c, 1, 0, 1, 30000), "the workers did not register with the new router");
  e = (ended){0};
  send_one(cl, "after-restart", 4, 60000);
  wait_ended(cl, &e, 1, 20000);
  cr_assert_eq(e.n, 1);
  cr_expect_eq(e.status[0], TD_OK, "after the restart: %s", e.error[0]);
  /* a router that stops answering (SIGSTOP, as a hung host): the heartbeat's timeout ends its requests */
  e = (ended){0};
  kill(c.p[rt].pid, SIGSTOP);
  t0 = td_now_ms();
  /* the router holds it to its deadline: the client's cancel goes out on its next connection, which the
   * router takes for another client */
  send_one(cl, "silent", 200, 10000);
  wait_ended(cl, &e, 1, 30000);
  int64_t took = td_now_ms() - t0;
  kill(c.p[rt].pid, SIGCONT);
  cr_assert_eq(e.n, 1, "nothing ended while the router was stopped");
  cr_expect_eq(e.status[0], TD_ERR_NETWORK, "%s", e.error[0]);
  cr_expect(strstr(e.error[0], "router unreachable: the connection to the router"), "%s", e.error[0]);
  cr_expect_lt(took, TD_WIRE_HEARTBEAT_IVL_MS + TD_WIRE_HEARTBEAT_TIMEOUT_MS + 2000, "took %lld ms", (long long)took);
  cr_log_info("a stopped router's request ended after %lld ms", (long long)took);
  /* ... and once it runs again, the client reconnects */
  e = (ended){0};
  send_one(cl, "after-stop", 4, 60000);
  wait_ended(cl, &e, 1, 20000);
  cr_assert_eq(e.n, 1);
  cr_expect_eq(e.status[0], TD_OK, "after the stop: %s", e.error[0]);
  td_client_close(cl);
  char why[256] = "";
  cr_expect(cluster_wait_idle(&c, 20000, why, sizeof why), "blocks held after the router's loss: %s", why);
  cr_expect(cluster_stop(&c));
  fx_free(&fx);
}
