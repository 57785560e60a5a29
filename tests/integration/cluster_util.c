#include "cluster_util.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <criterion/criterion.h>

#include "../unit/fixture.h"
#include "common/clock.h"

static int free_port_pair(void) {
  for (int tries = 0; tries < 100; tries++) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    if (bind(s, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(s, (struct sockaddr *)&a, &l) != 0) {
      close(s);
      continue;
    }
    int p = ntohs(a.sin_port);
    close(s);
    if (p >= 65535) continue;
    int s2 = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in b = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK), .sin_port = htons(p + 1)};
    int ok = bind(s2, (struct sockaddr *)&b, sizeof b) == 0;
    close(s2);
    if (ok) return p;
  }
  cr_assert_fail("no free ports");
  return 0;
}

static pid_t spawn_as(cluster *c, const char *name, char *const argv[], bool append) {
  char log[600];
  snprintf(log, sizeof log, "%s/%s.log", c->dir, name);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0) {
    int fd = open(log, O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC), 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    execv(argv[0], argv);
    _exit(127);
  }
  cr_assert(c->n < MAX_PROCS);
  proc *p = &c->p[c->n++];
  p->pid = pid;
  snprintf(p->name, sizeof p->name, "%s", name);
  size_t at = 0;
  for (int i = 0; argv[i]; i++) {
    size_t l = strlen(argv[i]) + 1;
    cr_assert(at + l <= sizeof p->args, "the command line of %s is too long to keep", name);
    memcpy(p->args + at, argv[i], l);
    at += l;
    p->n_args++;
  }
  return pid;
}

static pid_t spawn(cluster *c, const char *name, char *const argv[]) { return spawn_as(c, name, argv, false); }

int cluster_restart(cluster *c, int idx) {
  cr_assert(c->p[idx].exited, "%s still runs", c->p[idx].name);
  proc old = c->p[idx];
  char *argv[64];
  cr_assert(old.n_args < 64);
  const char *a = old.args;
  for (int i = 0; i < old.n_args; i++, a += strlen(a) + 1) argv[i] = (char *)a;
  argv[old.n_args] = NULL;
  spawn_as(c, old.name, argv, true);
  return c->n - 1;
}

/* Appends space-separated flags to argv[*a] (at most cap entries); they
 * point into buf. */
static void add_flags(char *buf, size_t cap_buf, const char *flags, char **argv, int *a, int cap) {
  if (!flags || !*flags) return;
  snprintf(buf, cap_buf, "%s", flags);
  char *save = NULL;
  for (char *t = strtok_r(buf, " ", &save); t && *a < cap; t = strtok_r(NULL, " ", &save)) argv[(*a)++] = t;
}

int cluster_add_worker(cluster *c, const char *name, const char *roles, int block_size) {
  char bin[600], bs[16], extra[256];
  snprintf(bin, sizeof bin, "%s/tandem-worker", TD_BIN_DIR);
  snprintf(bs, sizeof bs, "%d", block_size ? block_size : 4);
  char *argv[32] = {bin, "--router", c->worker_ep, "--model", c->model, "--role", (char *)roles, "--id", (char *)name,
                    "--block-size", bs, "--threads", "1", "--max-batch", "16", "--max-tokens", "256"};
  int a = 17;
  char sec[600], rk[600], wl[600];
  if (c->keys[0]) {
    snprintf(sec, sizeof sec, "%s/%s.key", c->keys, name);
    snprintf(rk, sizeof rk, "%s/router.pub", c->keys);
    snprintf(wl, sizeof wl, "%s/workers.list", c->keys);
    char *k[] = {"--curve-secret", sec, "--router-key", rk, "--worker-keys", wl};
    for (int i = 0; i < 6; i++) argv[a++] = k[i];
  }
  add_flags(extra, sizeof extra, strcmp(name, c->extra_worker) ? c->worker_extra : c->extra_flags, argv, &a, 31);
  argv[a] = NULL;
  spawn(c, name, argv);
  return c->n - 1;
}

int cluster_add_group(cluster *c, const char *name, const char *par, int world, int block_size) {
  char bin[600], bs[16], ws[8], rk[8], id[64], extra[256];
  snprintf(bin, sizeof bin, "%s/tandem-worker", TD_BIN_DIR);
  snprintf(bs, sizeof bs, "%d", block_size ? block_size : 4);
  snprintf(ws, sizeof ws, "%d", world);
  int first = c->n;
  for (int r = 0; r < world; r++) {
    snprintf(rk, sizeof rk, "%d", r);
    snprintf(id, sizeof id, r ? "%s-rank%d" : "%s", name, r);
    char *argv[40] = {bin, "--router", c->worker_ep, "--model", c->model, "--role",
                      (char *)(c->group_roles ? c->group_roles : "decode"), "--id", id,
                      "--block-size", bs, "--threads", "1", "--max-batch", "16", "--max-tokens", "256", "--group",
                      (char *)name, (char *)par, ws, "--rank", rk};
    int a = 23;
    char sec[600], rkey[600], wl[600];
    if (c->keys[0]) { /* each rank its own key, as a worker */
      snprintf(sec, sizeof sec, "%s/%s.key", c->keys, id);
      snprintf(rkey, sizeof rkey, "%s/router.pub", c->keys);
      snprintf(wl, sizeof wl, "%s/workers.list", c->keys);
      char *k[] = {"--curve-secret", sec, "--router-key", rkey, "--worker-keys", wl};
      for (int i = 0; i < 6; i++) argv[a++] = k[i];
    }
    bool other = !strcmp(name, c->extra_worker) || !strcmp(id, c->extra_worker); /* the group, or this rank */
    add_flags(extra, sizeof extra, other ? c->extra_flags : c->worker_extra, argv, &a, 39);
    argv[a] = NULL;
    spawn(c, id, argv);
  }
  return first;
}

void cluster_start(cluster *c, const cluster_opts *o) {
  memset(c, 0, sizeof *c);
  snprintf(c->dir, sizeof c->dir, "/tmp/td-cluster-XXXXXX");
  cr_assert(mkdtemp(c->dir));
  snprintf(c->model, sizeof c->model, "%s", o->model);
  snprintf(c->worker_extra, sizeof c->worker_extra, "%s", o->worker_extra ? o->worker_extra : "");
  snprintf(c->extra_worker, sizeof c->extra_worker, "%s", o->extra_worker ? o->extra_worker : "");
  snprintf(c->extra_flags, sizeof c->extra_flags, "%s", o->extra_flags ? o->extra_flags : "");
  snprintf(c->keys, sizeof c->keys, "%s", o->keys ? o->keys : "");
  c->auth = o->auth;
  int port = free_port_pair();
  snprintf(c->client_ep, sizeof c->client_ep, "tcp://127.0.0.1:%d", port);
  snprintf(c->worker_ep, sizeof c->worker_ep, "tcp://127.0.0.1:%d", port + 1);
  char bin[600], pt[16];
  snprintf(bin, sizeof bin, "%s/tandem-router", TD_BIN_DIR);
  snprintf(pt, sizeof pt, "%d", o->prefill_threshold ? o->prefill_threshold : 16);
  char cbind[300], wbind[300];
  snprintf(cbind, sizeof cbind, "tcp://%s:%d", o->router_bind ? o->router_bind : "127.0.0.1", port);
  snprintf(wbind, sizeof wbind, "tcp://%s:%d", o->router_bind ? o->router_bind : "127.0.0.1", port + 1);
  char *argv[32] = {bin, "--client-endpoint", cbind, "--worker-endpoint", wbind, "--prefill-threshold",
                    pt, "--heartbeat-ms", "200", "--dead-after", "5"};
  int a = 11;
  char extra[256], sec[600], wl[600], cl[600], al[600];
  if (c->keys[0]) {
    snprintf(sec, sizeof sec, "%s/router.key", c->keys);
    snprintf(wl, sizeof wl, "%s/workers.list", c->keys);
    snprintf(cl, sizeof cl, "%s/clients.list", c->keys);
    snprintf(al, sizeof al, "%s/admins.list", c->keys);
    char *k[] = {"--curve-secret", sec, "--worker-keys", wl, "--client-keys", cl, "--admin-keys", al};
    for (int i = 0; i < 8; i++) argv[a++] = k[i];
  }
  if (o->router_extra) {
    snprintf(extra, sizeof extra, "%s", o->router_extra);
    for (char *t = strtok(extra, " "); t && a < 30; t = strtok(NULL, " ")) argv[a++] = t;
  }
  argv[a] = NULL;
  spawn(c, "router", argv);
  char name[32];
  for (int i = 0; i < o->encoders; i++) {
    snprintf(name, sizeof name, "encoder-%d", i);
    cluster_add_worker(c, name, "encode", o->block_size);
  }
  for (int i = 0; i < o->prefills; i++) {
    snprintf(name, sizeof name, "prefill-%d", i);
    cluster_add_worker(c, name, "prefill", o->block_size);
  }
  /* without encoders, decode groups encode their own requests */
  c->group_roles = o->encoders ? "decode" : "encode,decode";
  for (int i = 0; i < o->decodes; i++) {
    snprintf(name, sizeof name, "decode-%d", i);
    if (o->group_tp > 1 || o->group_pp > 1)
      cluster_add_group(c, name, o->group_tp > 1 ? "--tp" : "--pp", o->group_tp > 1 ? o->group_tp : o->group_pp,
                        o->block_size);
    else
      cluster_add_worker(c, name, o->encoders && !o->decoders_encode ? "decode" : "encode,decode", o->block_size);
  }
  c->encoders = o->encoders && !o->decoders_encode ? o->encoders : o->encoders + o->decodes;
  c->prefills = o->prefills;
  c->decodes = o->decodes;
  cr_assert(cluster_wait_ready(c, c->encoders, c->prefills, c->decodes, 30000), "cluster did not come up (logs in %s)",
            c->dir);
}

bool cluster_health(cluster *c, td_client_health *h) {
  td_client *cl;
  if (td_client_connect_auth(c->client_ep, c->auth, &cl) != TD_OK) return false;
  bool ok = td_client_health_check(cl, 1000, h) == TD_OK;
  td_client_close(cl);
  return ok;
}

bool cluster_kv_count(cluster *c, const char *prefix, int timeout_ms, kv_count *out) {
  int64_t end = td_now_ms() + timeout_ms;
  kv_count last_all = {0};
  int stable = 0;
  memset(out, 0, sizeof *out);
  while (td_now_ms() < end) {
    td_client_health h;
    if (cluster_health(c, &h)) {
      kv_count all = {0}, mine = {0};
      for (int i = 0; i < h.n_workers; i++) {
        const td_client_worker *w = &h.workers[i];
        kv_count k = {w->kv_in_ucx, w->kv_in_zmq, w->kv_out_ucx, w->kv_out_zmq};
        all.in_ucx += k.in_ucx, all.in_zmq += k.in_zmq, all.out_ucx += k.out_ucx, all.out_zmq += k.out_zmq;
        if (!prefix || !strncmp(w->id, prefix, strlen(prefix)))
          mine.in_ucx += k.in_ucx, mine.in_zmq += k.in_zmq, mine.out_ucx += k.out_ucx, mine.out_zmq += k.out_zmq;
      }
      bool settled = all.in_ucx == all.out_ucx && all.in_zmq == all.out_zmq && all.in_ucx + all.in_zmq > 0;
      stable = settled && !memcmp(&all, &last_all, sizeof all) ? stable + 1 : 0;
      last_all = all;
      *out = mine;
      if (stable >= 2) return true; /* heartbeats come every 200 ms */
    }
    usleep(200000);
  }
  return false;
}

/* The body of GET /metrics, or NULL when the server does not answer. */
static char *scrape_port(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    close(fd);
    return NULL;
  }
  const char *req = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  cr_assert_eq(write(fd, req, strlen(req)), (ssize_t)strlen(req));
  size_t cap = 1 << 20, n = 0;
  char *out = calloc(cap, 1);
  ssize_t k;
  while ((k = read(fd, out + n, cap - 1 - n)) > 0) n += (size_t)k;
  close(fd);
  char *body = strstr(out, "\r\n\r\n");
  if (!strstr(out, "HTTP/1.1 200") || !body) {
    free(out);
    return NULL;
  }
  memmove(out, body + 4, strlen(body + 4) + 1);
  return out;
}

/* The value of the sample whose name and labels are exactly `series`; -1 when absent. */
double metric_sample(const char *text, const char *series) {
  size_t n = strlen(series);
  for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
    if (!strncmp(p, series, n) && p[n] == ' ') return strtod(p + n + 1, NULL);
  return -1;
}

static int metrics_port(cluster *c) {
  char path[600], line[512];
  snprintf(path, sizeof path, "%s/router.log", c->dir);
  FILE *f = fopen(path, "r");
  cr_assert(f, "%s", path);
  int port = 0;
  while (!port && fgets(line, sizeof line, f)) {
    char *m = strstr(line, "metrics http://127.0.0.1:");
    if (m) port = atoi(m + strlen("metrics http://127.0.0.1:"));
  }
  fclose(f);
  cr_assert_gt(port, 0, "no metrics line in %s", path);
  return port;
}

char *cluster_scrape(cluster *c) { return scrape_port(metrics_port(c)); }

bool cluster_log_has(cluster *c, const char *name, const char *text) {
  char path[600];
  snprintf(path, sizeof path, "%s/%s.log", c->dir, name);
  FILE *f = fopen(path, "r");
  if (!f) return false;
  char line[4096];
  bool found = false;
  while (!found && fgets(line, sizeof line, f)) found = strstr(line, text) != NULL;
  fclose(f);
  return found;
}

bool cluster_wait_ready(cluster *c, int encoders, int prefills, int decodes, int timeout_ms) {
  int64_t end = td_now_ms() + timeout_ms;
  while (td_now_ms() < end) {
    td_client_health h;
    if (cluster_health(c, &h) && h.encoders == encoders && h.prefills == prefills && h.decoders == decodes)
      return true;
    usleep(100000);
  }
  return false;
}

bool cluster_wait_idle(cluster *c, int timeout_ms, char *why, size_t cap) {
  int64_t end = td_now_ms() + timeout_ms;
  td_client_health h;
  while (td_now_ms() < end) {
    if (cluster_health(c, &h)) {
      bool idle = h.in_flight == 0 && h.queued == 0;
      for (int i = 0; i < h.n_workers; i++) {
        const td_client_worker *w = &h.workers[i];
        if (w->free_self_blocks != w->self_blocks || w->free_cross_blocks != w->cross_blocks || w->running ||
            w->queued || w->jobs) {
          idle = false;
          snprintf(why, cap, "worker %s: %d/%d self and %d/%d cross blocks free, %d running, %d jobs", w->id,
                   w->free_self_blocks, w->self_blocks, w->free_cross_blocks, w->cross_blocks, w->running, w->jobs);
        }
      }
      if (idle) return true;
      if (h.in_flight || h.queued) snprintf(why, cap, "router: %d in flight, %d queued", h.in_flight, h.queued);
    }
    usleep(100000);
  }
  return false;
}

void cluster_kill(cluster *c, int idx) {
  kill(c->p[idx].pid, SIGKILL);
  waitpid(c->p[idx].pid, &c->p[idx].status, 0);
  c->p[idx].exited = true;
}

bool cluster_stop(cluster *c) {
  bool clean = true;
  /* workers first, then the router */
  for (int pass = 0; pass < 2; pass++) {
    for (int i = c->n - 1; i >= 0; i--) {
      bool router = !strcmp(c->p[i].name, "router");
      if (c->p[i].exited || router != (pass == 1)) continue;
      kill(c->p[i].pid, SIGTERM);
    }
    int64_t end = td_now_ms() + 15000;
    for (int i = 0; i < c->n; i++) {
      bool router = !strcmp(c->p[i].name, "router");
      if (c->p[i].exited || router != (pass == 1)) continue;
      while (td_now_ms() < end) {
        pid_t r = waitpid(c->p[i].pid, &c->p[i].status, WNOHANG);
        if (r == c->p[i].pid) {
          c->p[i].exited = true;
          break;
        }
        usleep(20000);
      }
      if (!c->p[i].exited) {
        cr_log_error("%s did not exit on SIGTERM", c->p[i].name);
        kill(c->p[i].pid, SIGKILL);
        waitpid(c->p[i].pid, &c->p[i].status, 0);
        c->p[i].exited = true;
        clean = false;
      } else if (!WIFEXITED(c->p[i].status) || WEXITSTATUS(c->p[i].status) != 0) {
        cr_log_error("%s exited with status %d (logs in %s)", c->p[i].name, c->p[i].status, c->dir);
        clean = false;
      }
    }
  }
  if (clean && !getenv("TD_KEEP_LOGS")) { /* keep the logs of a failed run */
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", c->dir);
    if (system(cmd) != 0) cr_log_warn("could not remove %s", c->dir);
  }
  return clean;
}

/* ---------------------------------------------------------------- requests */

typedef struct run_state {
  outcome *out;
  td_json_request *reqs;
  int n;
} run_state;

static outcome *find(run_state *s, const char *id) {
  for (int i = 0; i < s->n; i++)
    if (!strcmp(s->out[i].id, id)) return &s->out[i];
  return NULL;
}

static void on_tokens(void *ctx, const char *id, int seq, int offset, const int32_t *t, const float *lp, int n) {
  outcome *o = find(ctx, id);
  if (!o || seq != 0) return;
  if (offset != o->n_streamed) o->order_ok = false;
  for (int i = 0; i < n && o->n_streamed < OUT_TOKENS; i++) o->streamed[o->n_streamed++] = t[i];
}

static void on_text(void *ctx, const char *id, int seq, int offset, const char *text) {
  outcome *o = find(ctx, id);
  if (!o || seq != 0) return;
  size_t l = strlen(o->streamed_text);
  snprintf(o->streamed_text + l, sizeof o->streamed_text - l, "%s", text);
}

static void on_result(void *ctx, const td_client_result *r) {
  outcome *o = find(ctx, r->id);
  if (!o) return;
  o->done = true;
  o->status = r->status;
  snprintf(o->error, sizeof o->error, "%s", r->error ? r->error : "");
  o->n_out = r->n_outputs;
  for (int i = 0; i < r->n_outputs && i < 8; i++) {
    o->len[i] = r->outputs[i].n_tokens < OUT_TOKENS ? r->outputs[i].n_tokens : OUT_TOKENS;
    memcpy(o->tok[i], r->outputs[i].tokens, sizeof(int32_t) * (size_t)o->len[i]);
    o->finish[i] = r->outputs[i].finish;
    o->has_text[i] = r->outputs[i].text != NULL;
    snprintf(o->text[i], sizeof o->text[i], "%s", r->outputs[i].text ? r->outputs[i].text : "");
  }
}

void run_requests(const char *endpoint, td_json_request *reqs, int n, bool stream, int timeout_ms, outcome *out) {
  run_requests_auth(endpoint, NULL, reqs, n, stream, timeout_ms, out);
}

void run_requests_auth(const char *endpoint, const td_auth *auth, td_json_request *reqs, int n, bool stream,
                       int timeout_ms, outcome *out) {
  run_state s = {out, reqs, n};
  for (int i = 0; i < n; i++) {
    memset(&out[i], 0, sizeof out[i]);
    snprintf(out[i].id, sizeof out[i].id, "%s", reqs[i].id);
    out[i].order_ok = true;
  }
  td_client *cl;
  cr_assert(td_client_connect_auth(endpoint, auth, &cl) == TD_OK);
  for (int i = 0; i < n; i++) cr_assert(td_client_generate(cl, &reqs[i], stream, (uint32_t)timeout_ms) == TD_OK);
  td_client_events ev = {.on_tokens = on_tokens, .on_text = on_text, .on_result = on_result, .ctx = &s};
  int64_t end = td_now_ms() + timeout_ms + 10000;
  while (td_client_pending(cl) > 0 && td_now_ms() < end) td_client_poll(cl, 100, &ev);
  td_client_close(cl);
}

void *client_thread(void *arg) {
  client_job *j = arg;
  run_requests(j->ep, j->reqs, j->n, j->stream, 60000, j->out);
  return NULL;
}

int load_requests(const char *path, td_json_request *reqs, int cap) {
  FILE *f = fopen(path, "r");
  cr_assert(f, "cannot open %s", path);
  char *line = NULL;
  size_t lcap = 0;
  ssize_t len;
  int n = 0, no = 0;
  char dir[512];
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (slash) *slash = 0;
  while ((len = getline(&line, &lcap, f)) > 0 && n < cap) {
    no++;
    if (len <= 1) continue;
    cr_assert(td_json_request_parse(line, (size_t)len, dir, no, &reqs[n]) == TD_OK, "%s", td_errmsg());
    n++;
  }
  free(line);
  fclose(f);
  return n;
}

static td_finish finish_of(const char *name) {
  for (td_finish f = TD_FINISH_NONE; f <= TD_FINISH_ERROR; f++)
    if (name && !strcmp(name, td_finish_name(f))) return f;
  return TD_FINISH_NONE;
}

int read_results(FILE *f, outcome *out, int cap) {
  char *line = NULL;
  size_t lcap = 0;
  int i = 0;
  while (i < cap && getline(&line, &lcap, f) > 0) {
    if (line[0] != '{') continue;
    outcome *o = &out[i++];
    memset(o, 0, sizeof *o);
    cJSON *j = cJSON_Parse(line);
    cr_assert(j, "bad result line %s", line);
    cJSON *id = cJSON_GetObjectItem(j, "id"), *outs = cJSON_GetObjectItem(j, "outputs"),
          *err = cJSON_GetObjectItem(j, "error");
    cr_assert(cJSON_IsString(id), "a result without an id: %s", line);
    snprintf(o->id, sizeof o->id, "%s", id->valuestring);
    o->done = true;
    o->status = outs ? TD_OK : TD_ERR_INVALID;
    if (cJSON_IsString(err)) snprintf(o->error, sizeof o->error, "%s", err->valuestring);
    o->n_out = outs ? cJSON_GetArraySize(outs) : 0;
    for (int k = 0; k < o->n_out && k < 8; k++) {
      cJSON *e = cJSON_GetArrayItem(outs, k), *t = cJSON_GetObjectItem(e, "tokens");
      o->len[k] = cJSON_GetArraySize(t) < OUT_TOKENS ? cJSON_GetArraySize(t) : OUT_TOKENS;
      for (int x = 0; x < o->len[k]; x++) o->tok[k][x] = cJSON_GetArrayItem(t, x)->valueint;
      o->finish[k] = finish_of(cJSON_GetStringValue(cJSON_GetObjectItem(e, "finish_reason")));
      const char *tx = cJSON_GetStringValue(cJSON_GetObjectItem(e, "text"));
      o->has_text[k] = tx != NULL;
      snprintf(o->text[k], sizeof o->text[k], "%s", tx ? tx : "");
    }
    cJSON_Delete(j);
  }
  free(line);
  return i;
}

void generate_reference(const char *model, const char *path, int block_size, outcome *out, int n) {
  char cmd[1600];
  snprintf(cmd, sizeof cmd, "%s/tandem-generate --model %s --requests %s --block-size %d 2>/dev/null", TD_BIN_DIR,
           model, path, block_size);
  FILE *p = popen(cmd, "r");
  cr_assert(p);
  int i = read_results(p, out, n);
  pclose(p);
  cr_assert_eq(i, n, "tandem-generate gave %d results for %d requests", i, n);
}

void expect_fixture_greedy(cluster *c, const fixture *fx) {
  char path[600];
  snprintf(path, sizeof path, "%s/ok.jsonl", c->dir);
  fx_write_requests(fx, path, "\"forced_eos_token_id\": null");
  td_json_request reqs[8];
  int nr = load_requests(path, reqs, 8);
  cr_assert_eq(nr, fx->n, "%d of the fixture's %d requests", nr, fx->n);
  outcome out[8];
  run_requests_auth(c->client_ep, c->auth, reqs, nr, false, 30000, out);
  for (int i = 0; i < nr; i++) {
    cr_expect(out[i].done && out[i].status == TD_OK, "%s: %s", out[i].id, out[i].error);
    cr_expect_eq(out[i].len[0], fx->req[i].n_greedy, "%s: %d tokens", out[i].id, out[i].len[0]);
    cr_expect_arr_eq(out[i].tok[0], fx->req[i].greedy, sizeof(int32_t) * (size_t)fx->req[i].n_greedy,
                     "%s: tokens differ from transformers", out[i].id);
    td_json_request_free(&reqs[i]);
  }
}
