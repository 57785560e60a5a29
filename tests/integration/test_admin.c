/* Pools that change while serving, driven through tandem-admin against a
 * cluster of real processes under load: a worker added joins and takes
 * work; a drained worker finishes its requests and exits 0; a rolling
 * restart of the decode pool (deploy/rolling-restart.sh) loses nothing;
 * a removed worker's requests end correct elsewhere. Every result is
 * compared with tandem-generate's (the undisturbed outputs). */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <criterion/criterion.h>

#include "../unit/fixture.h"
#include "cluster_util.h"
#include "common/clock.h"

#define N_REQ 12

/* Greedy single sequences, beams and seeded samples: a retried request
 * must give the same outputs as an undisturbed one. */
static void write_requests(const char *path, int n, int max_new, int first) {
  FILE *f = fopen(path, "w");
  cr_assert(f);
  for (int i = first; i < first + n; i++) {
    const char *kind = i % 6 == 1   ? "\"num_beams\": 3, \"num_return_sequences\": 2, "
                       : i % 6 == 3 ? "\"n\": 2, \"temperature\": 0.8, \"seed\": 11, "
                                    : "";
    fprintf(f, "{\"id\": \"r%d\", \"input_ids\": [%d, %d, 9, 1], %s\"max_new_tokens\": %d, \"ignore_eos\": true}\n", i,
            3 + i % 50, 40 + (2 * i) % 50, kind, max_new);
  }
  fclose(f);
}

typedef struct load {
  td_json_request reqs[N_REQ];
  outcome want[N_REQ];
  int n;
} load;

static void load_make(cluster *c, const char *model, load *l, int n, int max_new) {
  char path[600];
  snprintf(path, sizeof path, "%s/requests.jsonl", c->dir);
  write_requests(path, n, max_new, 0);
  l->n = load_requests(path, l->reqs, n);
  cr_assert_eq(l->n, n);
  generate_reference(model, path, 4, l->want, n);
}

static void load_free(load *l) {
  for (int i = 0; i < l->n; i++) td_json_request_free(&l->reqs[i]);
}

/* Waves of the load's first N_REQ requests, one after another until told
 * to stop, each result checked against the undisturbed outputs. */
typedef struct flow {
  cluster *c;
  load *l;
  _Atomic int stop, waves; /* read by the test while the flow runs */
  int requests, failed, wrong;
  char first_problem[512];
} flow;

static void *flow_thread(void *arg) {
  flow *f = arg;
  outcome *got = calloc(N_REQ, sizeof *got);
  while (!f->stop) {
    run_requests(f->c->client_ep, f->l->reqs, N_REQ, true, 60000, got);
    f->waves++;
    for (int i = 0; i < N_REQ; i++) {
      const outcome *g = &got[i], *w = &f->l->want[i];
      f->requests++;
      bool same = g->done && g->status == TD_OK && g->n_out == w->n_out;
      for (int s = 0; same && s < w->n_out; s++)
        same = g->len[s] == w->len[s] && !memcmp(g->tok[s], w->tok[s], sizeof(int32_t) * (size_t)w->len[s]);
      if (same) continue;
      if (!g->done || g->status != TD_OK) f->failed++;
      else f->wrong++;
      if (!f->first_problem[0])
        snprintf(f->first_problem, sizeof f->first_problem, "%s: %s", g->id,
                 g->status != TD_OK ? g->error : "outputs differ from the undisturbed run");
    }
  }
  free(got);
  return NULL;
}

static int proc_index(cluster *c, const char *name) {
  for (int i = 0; i < c->n; i++)
    if (!strcmp(c->p[i].name, name)) return i;
  cr_assert_fail("no process %s", name);
  return -1;
}

static td_client_worker worker_status(cluster *c, const char *id, bool *found) {
  td_client_health h;
  td_client_worker none = {0};
  *found = false;
  if (cluster_health(c, &h))
    for (int i = 0; i < h.n_workers; i++)
      if (!strcmp(h.workers[i].id, id)) {
        *found = true;
        return h.workers[i];
      }
  return none;
}

/* Waits until the worker holds requests (placed there and reserved). */
static bool wait_holds_work(cluster *c, const char *id, int timeout_ms) {
  for (int64_t end = td_now_ms() + timeout_ms; td_now_ms() < end; usleep(5000)) {
    bool found;
    td_client_worker w = worker_status(c, id, &found);
    if (found && (w.running > 0 || (w.jobs > 0 && w.free_cross_blocks < w.cross_blocks))) return true;
  }
  return false;
}

/* Makes `id` hold requests it cannot finish for a while: the encoder is
 * stopped (SIGSTOP; the router runs with --dead-after 25: 5 s) and the
 * flow's requests that reserved blocks there wait for their KV. True once
 * the router has given it work for 300 ms on end, the encoder still
 * stopped (the caller sends SIGCONT). When the work that waits is all on
 * the other worker, the encoder runs again a moment and it tries anew, so
 * that the encoder is never stopped long enough to count as dead. */
static bool hold_work_on(cluster *c, const char *id, int encoder_idx) {
  for (int64_t end = td_now_ms() + 30000; td_now_ms() < end;) {
    kill(c->p[encoder_idx].pid, SIGSTOP);
    int64_t since = 0;
    for (int64_t stop_end = td_now_ms() + 1500; td_now_ms() < stop_end; usleep(10000)) {
      bool found;
      td_client_worker w = worker_status(c, id, &found);
      if (!found || w.jobs == 0) {
        since = 0;
        continue;
      }
      if (!since) since = td_now_ms();
      if (td_now_ms() - since >= 300) return true;
    }
    kill(c->p[encoder_idx].pid, SIGCONT);
    usleep(300 * 1000);
  }
  return false;
}

/* tandem-admin's exit status and its stdout and stderr (in out). */
static int admin(cluster *c, const char *args, char *out, size_t cap) {
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "%s/tandem-admin --router %s %s 2>&1", TD_BIN_DIR, c->client_ep, args);
  FILE *p = popen(cmd, "r");
  cr_assert(p);
  size_t n = fread(out, 1, cap - 1, p);
  out[n] = 0;
  int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Waits for a child of the test to exit; its status, or -1. */
static int wait_exit(cluster *c, int idx, int timeout_ms) {
  int st = 0;
  for (int64_t end = td_now_ms() + timeout_ms; td_now_ms() < end; usleep(20000))
    if (waitpid(c->p[idx].pid, &st, WNOHANG) == c->p[idx].pid) {
      c->p[idx].exited = true;
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
  return -1;
}

/* ---- drain ---- */

/* decode-1 drained while it holds requests: it finishes them (none is
 * retried elsewhere), exits 0 and leaves the pool; the outputs are the
 * undisturbed ones. A second drain and an unknown id are refused. */
Test(admin, a_drained_worker_finishes_its_requests_and_exits_0, .timeout = 300) {
  fixture fx;
  fx_load("marian-sinusoidal", &fx);
  cluster c;
  cluster_opts o = {.model = fx.dir, .encoders = 1, .decodes = 2, .router_extra = "--dead-after 25"};
  cluster_start(&c, &o);
  load l;
  load_make(&c, fx.dir, &l, N_REQ, 120);
  flow f = {.c = &c, .l = &l};
  pthread_t th;
  pthread_create(&th, NULL, flow_thread, &f);
  int enc = proc_index(&c, "encoder-0");
  bool held = wait_holds_work(&c, "decode-1", 20000) && hold_work_on(&c, "decode-1", enc);
  char out[2048];
  int rc = admin(&c, "--json drain decode-1", out, sizeof out);
  cr_expect_eq(rc, 0, "%s", out);
  cr_expect(strstr(out, "\"ok\":true") && strstr(out, "decode-1 is draining"), "%s", out);
  char out2[2048], out3[2048];
  rc = admin(&c, "drain decode-1", out2, sizeof out2);
  bool again = rc == 1 && strstr(out2, "failed_precondition: worker decode-1 is already draining");
  rc = admin(&c, "--json remove nobody", out3, sizeof out3);
  bool unknown = rc == 1 && strstr(out3, "\"code\":\"not_found\"");
  kill(c.p[enc].pid, SIGCONT);
  int victim = proc_index(&c, "decode-1");
  int st = wait_exit(&c, victim, 60000);
  f.stop = 1;
  pthread_join(th, NULL);
  cr_expect(held, "decode-1 never held work");
  cr_expect(again, "a second drain: %s", out2);
  cr_expect(unknown, "an unknown worker: %s", out3);
  cr_expect_eq(st, 0, "decode-1 did not exit 0 after its drain");
  cr_expect_eq(f.failed + f.wrong, 0, "%d of %d requests failed, %d differ; first: %s", f.failed, f.requests, f.wrong,
               f.first_problem);
  cr_expect(cluster_log_has(&c, "decode-1", "draining: finishing") &&
                !cluster_log_has(&c, "decode-1", "draining: finishing 0 requests"),
            "decode-1 had nothing to drain");
  cr_expect(!cluster_log_has(&c, "router", "retrying"), "a request was retried: decode-1 dropped work");
  cr_expect(cluster_wait_ready(&c, 1, 0, 1, 5000), "the router still lists the drained worker");
  rc = admin(&c, "list", out, sizeof out);
  cr_expect(rc == 0 && strstr(out, "decode-0") && !strstr(out, "decode-1"), "%s", out);
  cr_expect(cluster_stop(&c));
  load_free(&l);
  fx_free(&fx);
}

/* ---- add ---- */

/* A decode worker started while requests flow registers, and the next
 * requests go to it too (it has the shorter queue). */
Test(admin, a_worker_added_under_load_takes_work, .timeout = 300) {
  fixture fx;
  fx_load("marian-sinusoidal", &fx);
  cluster c;
  cluster_opts o = {.model = fx.dir, .encoders = 1, .decodes = 1};
  cluster_start(&c, &o);
  load l;
  load_make(&c, fx.dir, &l, N_REQ, 120);
  flow f = {.c = &c, .l = &l};
  pthread_t th;
  pthread_create(&th, NULL, flow_thread, &f);
  bool held = wait_holds_work(&c, "decode-0", 20000);
  cluster_add_worker(&c, "decode-1", "decode", 4);
  bool ready = cluster_wait_ready(&c, 1, 0, 2, 60000);
  bool took = ready && wait_holds_work(&c, "decode-1", 30000);
  f.stop = 1;
  pthread_join(th, NULL);
  cr_expect(held, "decode-0 never held work");
  cr_expect(ready, "decode-1 did not register");
  cr_expect(took, "decode-1 took no work");
  cr_expect_eq(f.failed + f.wrong, 0, "%d of %d requests failed, %d differ; first: %s", f.failed, f.requests, f.wrong,
               f.first_problem);
  cr_expect(cluster_stop(&c));
  load_free(&l);
  fx_free(&fx);
}

/* ---- remove ---- */

/* decode-0 removed while it holds requests: it exits at once (status 0),
 * and each of its requests ends with the undisturbed outputs on decode-1
 * or with a clear error; none is silently wrong. */
Test(admin, a_removed_workers_requests_end_correct_elsewhere, .timeout = 300) {
  fixture fx;
  fx_load("marian-sinusoidal", &fx);
  cluster c;
  cluster_opts o = {.model = fx.dir, .encoders = 1, .decodes = 2, .router_extra = "--dead-after 25"};
  cluster_start(&c, &o);
  load l;
  load_make(&c, fx.dir, &l, N_REQ, 120);
  flow f = {.c = &c, .l = &l};
  pthread_t th;
  pthread_create(&th, NULL, flow_thread, &f);
  int enc = proc_index(&c, "encoder-0");
  bool held = wait_holds_work(&c, "decode-0", 20000) && hold_work_on(&c, "decode-0", enc);
  char out[2048];
  int rc = admin(&c, "remove decode-0", out, sizeof out);
  kill(c.p[enc].pid, SIGCONT);
  int victim = proc_index(&c, "decode-0");
  int st = wait_exit(&c, victim, 10000);
  /* a wave after the removal, on decode-1 alone */
  int waves = f.waves;
  for (int64_t end = td_now_ms() + 30000; f.waves < waves + 2 && td_now_ms() < end;) usleep(20000);
  f.stop = 1;
  pthread_join(th, NULL);
  cr_expect(held, "decode-0 never held work");
  cr_expect(rc == 0 && strstr(out, "worker decode-0 removed"), "%d %s", rc, out);
  if (st != 0) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "tail -n 40 %s/decode-0.log >&2", c.dir);
    cr_log_error("decode-0: exit status %d; its log's end:", st);
    if (system(cmd) != 0) cr_log_error("no log");
  }
  cr_expect_eq(st, 0, "decode-0 did not leave at once with status 0 (%d)", st);
  /* none silently wrong; a failure names its reason (none is expected: the
   * retry path resumes or restarts each request) */
  cr_expect_eq(f.wrong, 0, "%d of %d requests differ from the undisturbed run: %s", f.wrong, f.requests,
               f.first_problem);
  cr_expect_eq(f.failed, 0, "%d of %d requests failed; first: %s", f.failed, f.requests, f.first_problem);
  cr_expect(cluster_log_has(&c, "router", "removed by an operator"));
  cr_expect(cluster_log_has(&c, "router", "retrying: worker decode-0 failed (removed by an operator)"),
            "none of decode-0's requests moved");
  cr_expect(cluster_log_has(&c, "decode-0", "the router removed this worker"));
  cr_expect(cluster_wait_ready(&c, 1, 0, 1, 5000), "the router still lists the removed worker");
  char why[256] = "";
  cr_expect(cluster_wait_idle(&c, 5000, why, sizeof why), "survivors hold blocks: %s", why);
  cr_expect(cluster_stop(&c));
  load_free(&l);
  fx_free(&fx);
}

/* ---- rolling restart ---- */

/* deploy/rolling-restart.sh drains each decode worker in turn, starts its
 * replacement with the same command line and waits for it: while requests
 * flow, none is lost or changed; both decode workers end up replaced (new
 * pids) and serving. The replacements are the script's children; the test
 * adopts them (a subreaper) to stop them. */
Test(admin, a_rolling_restart_of_the_decode_pool_loses_no_request, .timeout = 300) {
  cr_assert_eq(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  fixture fx;
  fx_load("marian-sinusoidal", &fx);
  cluster c;
  cluster_opts o = {.model = fx.dir, .encoders = 1, .decodes = 2};
  cluster_start(&c, &o);
  load l;
  load_make(&c, fx.dir, &l, N_REQ, 120);
  pid_t old[2] = {c.p[proc_index(&c, "decode-0")].pid, c.p[proc_index(&c, "decode-1")].pid};
  flow f = {.c = &c, .l = &l};
  pthread_t th;
  pthread_create(&th, NULL, flow_thread, &f);
  bool held = wait_holds_work(&c, "decode-0", 20000) && wait_holds_work(&c, "decode-1", 20000);
  char cmd[1024];
  snprintf(cmd, sizeof cmd,
           "%s/deploy/rolling-restart.sh --router %s --bin %s --log-dir %s --timeout 120 decode >%s/rolling.log 2>&1",
           TD_SOURCE_DIR, c.client_ep, TD_BIN_DIR, c.dir, c.dir);
  int waves_before = f.waves;
  int st = system(cmd);
  /* the wave in flight as the restart ended, and one wholly after it, on
   * the replacements: a restart quicker than one wave still shows the
   * requests that spanned it ending correct */
  int waves_at_end = f.waves;
  for (int64_t end = td_now_ms() + 60000; f.waves < waves_at_end + 2 && td_now_ms() < end;) usleep(20000);
  int waves_after = f.waves - waves_at_end;
  f.stop = 1;
  pthread_join(th, NULL);
  cr_expect(held, "the decode workers never held work");
  cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "rolling-restart.sh failed (%s/rolling.log)", c.dir);
  char logp[600], text[8192] = "";
  snprintf(logp, sizeof logp, "%s/rolling.log", c.dir);
  FILE *lf = fopen(logp, "r");
  if (lf) {
    text[fread(text, 1, sizeof text - 1, lf)] = 0;
    fclose(lf);
  }
  cr_expect(strstr(text, "every decode worker was replaced"), "%s", text);
  /* requests flowed through the whole restart, and none was lost or changed */
  cr_expect_geq(waves_after, 2, "only %d waves of requests ended after the restart (%d before it, %d during)",
                waves_after, waves_before, waves_at_end - waves_before);
  cr_expect_eq(f.failed + f.wrong, 0, "%d of %d requests failed, %d differ; first: %s", f.failed, f.requests, f.wrong,
               f.first_problem);
  cr_log_info("rolling restart: %d requests in %d waves (%d ended during it), none lost", f.requests, f.waves,
              waves_at_end - waves_before);
  for (int i = 0; i < 2; i++) {
    int idx = proc_index(&c, i ? "decode-1" : "decode-0");
    cr_expect_eq(wait_exit(&c, idx, 5000), 0, "the old %s did not exit 0", c.p[idx].name);
  }
  /* the replacements serve */
  td_client_health h;
  cr_assert(cluster_health(&c, &h));
  pid_t fresh[2] = {0, 0};
  for (int i = 0; i < h.n_workers; i++)
    for (int k = 0; k < 2; k++)
      if (!strcmp(h.workers[i].id, k ? "decode-1" : "decode-0") && !h.workers[i].draining)
        fresh[k] = (pid_t)h.workers[i].pid;
  for (int k = 0; k < 2; k++) cr_expect(fresh[k] > 0 && fresh[k] != old[k], "decode-%d was not replaced", k);
  outcome again[2];
  run_requests(c.client_ep, l.reqs, 2, false, 60000, again);
  for (int i = 0; i < 2; i++) cr_expect(again[i].done && again[i].status == TD_OK, "after: %s", again[i].error);
  for (int k = 0; k < 2; k++) {
    if (fresh[k] <= 0) continue;
    kill(fresh[k], SIGTERM);
    int ws = 0;
    pid_t r = 0;
    for (int64_t end = td_now_ms() + 15000; td_now_ms() < end && (r = waitpid(fresh[k], &ws, WNOHANG)) == 0;)
      usleep(20000);
    cr_expect(r == fresh[k] && WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "the replacement decode-%d: status %d", k, ws);
  }
  cr_expect(cluster_stop(&c));
  load_free(&l);
  fx_free(&fx);
}
