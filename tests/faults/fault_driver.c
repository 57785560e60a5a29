/* tandem-faults: one fault injected into a cluster of real processes under
 * load, and every request classified.
 *
 *   tandem-faults --model DIR --fault NAME [--requests N] [--rate R] [--at F]
 *                 [--pause-ms MS] [--timeout-ms MS] [--bin DIR] [--keep] [--load driver|bench-serve]
 *
 * It starts a router, an encoder, a prefill worker and two decode workers
 * (which also encode, so an encoder's death leaves the cluster able to
 * serve; for the TP faults decode-0 is a TP=2 group), writes N greedy
 * requests (a third with decoder prompts long enough for the prefill
 * worker, two thirds past EOS so that they live long enough to be hit),
 * computes their tokens with tandem-generate (the undisturbed run), sends
 * them at R a second (evenly from here, or with --load bench-serve as
 * bench-serve's open loop of Poisson arrivals, whose answers it writes for
 * this program to judge), injects the fault when a fraction F of them is sent,
 * and classifies each request: correct (the undisturbed tokens), a clear
 * error (an error code with a message), silently wrong (a result with other
 * tokens), lost (no answer by its deadline and the client's grace). After
 * the run every surviving worker must give back every KV block. Prints one
 * row of the fault table on stdout (the details on stderr); exits 1 when a
 * request was silently wrong or lost, a block leaked, a survivor died, or
 * fewer than --min-correct percent were correct. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <math.h>
#include <stdarg.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <uthash.h>

#include "client/client.h"
#include "common/clock.h"
#include "common/jsonl.h"
#include "common/log.h"

#define MAX_PROCS 16
#define MAX_TOK 1024
#define NETNS_HOST "10.231.0.1"
#define NETNS_PEER "10.231.0.2"

/* ---------------------------------------------------------------- processes */

typedef struct proc {
  pid_t pid;
  char name[32];
  bool gone;    /* killed or exited on purpose: not a survivor */
  bool stopped; /* SIGSTOPped and left so */
} proc;

typedef struct cluster {
  char dir[256], bin[512], model[512], netns[32];
  const char *kv_load_failure; /* the router's --kv-load-failure */
  char client_ep[64], worker_ep[64], worker_ep_bind[64];
  int port;
  proc p[MAX_PROCS];
  int n;
  bool tp;
} cluster;

static pid_t spawn(cluster *c, const char *name, char *const argv[]) {
  char log[600];
  snprintf(log, sizeof log, "%s/%s.log", c->dir, name);
  pid_t pid = fork();
  if (pid < 0) {
    perror("fork");
    exit(2);
  }
  if (pid == 0) {
    int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* the cluster goes with the driver, however it ends */
    execvp(argv[0], argv);
    _exit(127);
  }
  proc *p = NULL;
  for (int i = 0; i < c->n && !p; i++)
    if (!strcmp(c->p[i].name, name)) p = &c->p[i]; /* a restart takes the old slot */
  if (!p) {
    if (c->n == MAX_PROCS) {
      fprintf(stderr, "tandem-faults: too many processes\n");
      exit(2);
    }
    p = &c->p[c->n++];
  }
  *p = (proc){.pid = pid};
  snprintf(p->name, sizeof p->name, "%s", name);
  return pid;
}

static proc *proc_named(cluster *c, const char *name) {
  for (int i = 0; i < c->n; i++)
    if (!strcmp(c->p[i].name, name)) return &c->p[i];
  fprintf(stderr, "tandem-faults: no process %s\n", name);
  exit(2);
}

static pid_t start_router(cluster *c) {
  char bin[600];
  snprintf(bin, sizeof bin, "%s/tandem-router", c->bin);
  char *argv[] = {bin, "--client-endpoint", c->client_ep, "--worker-endpoint", c->worker_ep_bind,
                  "--prefill-threshold", "4", "--heartbeat-ms", "200", "--dead-after", "5",
                  "--kv-load-failure", (char *)c->kv_load_failure, NULL};
  return spawn(c, "router", argv);
}

/* A worker; in_netns: inside the namespace, its KV over ZeroMQ through the
 * veth link (UCX would take shared memory past the link). */
static void start_worker(cluster *c, const char *name, const char *roles, const char *group, const char *rank,
                         bool in_netns) {
  char bin[600];
  snprintf(bin, sizeof bin, "%s/tandem-worker", c->bin);
  char ep[80];
  if (in_netns)
    snprintf(ep, sizeof ep, "tcp://" NETNS_HOST ":%d", c->port + 1);
  else
    snprintf(ep, sizeof ep, "%s", c->worker_ep);
  char *argv[40];
  int a = 0;
  if (in_netns) argv[a++] = "ip", argv[a++] = "netns", argv[a++] = "exec", argv[a++] = c->netns;
  char *base[] = {bin, "--router", ep, "--model", c->model, "--role", (char *)roles, "--id", (char *)name,
                  "--block-size", "4", "--threads", "1", "--max-batch", "16", "--max-tokens", "256"};
  for (size_t i = 0; i < sizeof base / sizeof *base; i++) argv[a++] = base[i];
  if (group) argv[a++] = "--group", argv[a++] = (char *)group, argv[a++] = "--tp", argv[a++] = "2",
             argv[a++] = "--rank", argv[a++] = (char *)rank;
  if (in_netns) argv[a++] = "--host", argv[a++] = NETNS_PEER, argv[a++] = "--kv-transport", argv[a++] = "zmq";
  argv[a] = NULL;
  spawn(c, name, argv);
}

static bool health(cluster *c, td_client_health *h) {
  td_client *cl;
  if (td_client_connect(c->client_ep, &cl) != TD_OK) return false;
  bool ok = td_client_health_check(cl, 1000, h) == TD_OK;
  td_client_close(cl);
  return ok;
}

static bool registered(cluster *c, const char *id) {
  td_client_health h;
  if (!health(c, &h)) return false;
  for (int i = 0; i < h.n_workers; i++)
    if (!strcmp(h.workers[i].id, id)) return true;
  return false;
}

static int free_port_pair(void) {
  for (int tries = 0; tries < 100; tries++) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY)};
    socklen_t l = sizeof a;
    int ok = bind(s, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(s, (struct sockaddr *)&a, &l) == 0;
    close(s);
    if (!ok) continue;
    int p = ntohs(a.sin_port);
    if (p >= 65535) continue;
    int s2 = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in b = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY), .sin_port = htons(p + 1)};
    ok = bind(s2, (struct sockaddr *)&b, sizeof b) == 0;
    close(s2);
    if (ok) return p;
  }
  fprintf(stderr, "tandem-faults: no free ports\n");
  exit(2);
}

static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...) {
  char cmd[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof cmd, fmt, ap);
  va_end(ap);
  int rc = system(cmd);
  if (rc != 0) fprintf(stderr, "tandem-faults: `%s` failed (%d)\n", cmd, rc);
  return rc;
}

/* A network namespace joined to the host by a veth pair, the qdisc given
 * on both ends: netem (delay, loss), or tbf (a slow link that drops what
 * queues past its latency) where the kernel has no sch_netem. */
static bool netns_up(cluster *c, const char *netem) {
  snprintf(c->netns, sizeof c->netns, "tdf%d", (int)getpid());
  const char *ns = c->netns;
  if (sh("ip netns add %s", ns) ||
      sh("ip link add %sa type veth peer name %sb", ns, ns) || sh("ip link set %sb netns %s", ns, ns) ||
      sh("ip addr add " NETNS_HOST "/30 dev %sa && ip link set %sa up", ns, ns) ||
      sh("ip netns exec %s sh -c 'ip addr add " NETNS_PEER "/30 dev %sb && ip link set %sb up && ip link set lo up'",
         ns, ns, ns) ||
      sh("tc qdisc add dev %sa root %s", ns, netem) ||
      sh("ip netns exec %s tc qdisc add dev %sb root %s", ns, ns, netem))
    return false;
  return true;
}

/* Deleting the namespace deletes its end of the pair, and so the pair. */
static void netns_down(cluster *c) {
  if (!c->netns[0]) return;
  char cmd[128];
  snprintf(cmd, sizeof cmd, "ip netns del %s", c->netns);
  if (system(cmd) != 0) fprintf(stderr, "tandem-faults: could not remove namespace %s\n", c->netns);
  c->netns[0] = 0;
}

static bool wait_ready(cluster *c, int enc, int pre, int dec, int ms) {
  for (int64_t end = td_now_ms() + ms; td_now_ms() < end; usleep(100000)) {
    td_client_health h;
    if (health(c, &h) && h.encoders == enc && h.prefills == pre && h.decoders == dec) return true;
  }
  return false;
}

/* ---------------------------------------------------------------- requests */

typedef struct req {
  char line[512];
  td_json_request q;
  int want_n, got_n;
  int32_t want[MAX_TOK], got[MAX_TOK];
  bool done, ok;
  char error[160];
  double submit_ms, done_ms; /* from t0 */
  UT_hash_handle hh;
} req;

typedef struct run {
  cluster c;
  req *r;
  int n;
  req *by_id;
  double t0;
  const char *fault;
  int pause_ms, timeout_ms;
  double rate, at;
  /* filled by the fault thread */
  _Atomic double t_fault; /* ms from t0; 0 until injected */
  double restart_serves_ms; /* a restarted process registered, ms after the fault; -1: none */
  char note[160];
  bool fault_ok;
  atomic_bool acted;    /* the fault thread did all it does (a restart: until the process serves) */
  atomic_bool finished; /* the cluster is stopped: the fault thread may end */
  pthread_t fault_th;
  /* duplicate request ids: a second client sends the same ids */
  int n_dup, dup_ok, dup_err, dup_wrong;
  bool bench; /* --load bench-serve */
} run;

static double now_rel(const run *R) { return (double)td_now_ms() - R->t0; }

/* Greedy requests over the toy vocabulary: random input words; a third
 * with a decoder prompt of 4 tokens (>= the router's prefill threshold),
 * two thirds past EOS so that they run long enough to be caught. */
static void make_requests(run *R, int vocab, int max_new_cap, uint64_t seed) {
  srand48((long)seed);
  for (int i = 0; i < R->n; i++) {
    char in[256] = "", prompt[96] = "";
    int len = 3 + (int)(drand48() * 10);
    for (int k = 0; k < len; k++) {
      size_t l = strlen(in);
      snprintf(in + l, sizeof in - l, "%d, ", 2 + (int)(drand48() * (vocab - 2)));
    }
    if (i % 3 == 2)
      snprintf(prompt, sizeof prompt, "\"decoder_prompt\": [0, %d, %d, %d], ", 2 + i % 20, 3 + i % 17, 5 + i % 13);
    int max_new = i % 3 == 0 ? 32 : max_new_cap / 4 + (int)(drand48() * (max_new_cap - max_new_cap / 4));
    snprintf(R->r[i].line, sizeof R->r[i].line,
             "{\"id\": \"f%d\", \"input_ids\": [%s1], %s\"max_new_tokens\": %d%s}", i, in, prompt, max_new,
             i % 3 ? ", \"ignore_eos\": true" : "");
  }
}

static int reference(run *R) {
  char path[600], cmd[1800];
  snprintf(path, sizeof path, "%s/requests.jsonl", R->c.dir);
  FILE *f = fopen(path, "w");
  if (!f) return -1;
  for (int i = 0; i < R->n; i++) fprintf(f, "%s\n", R->r[i].line);
  fclose(f);
  snprintf(cmd, sizeof cmd, "%s/tandem-generate --model %s --requests %s --block-size 4 2>%s/generate.log",
           R->c.bin, R->c.model, path, R->c.dir);
  FILE *p = popen(cmd, "r");
  if (!p) return -1;
  char *line = NULL;
  size_t cap = 0;
  int got = 0;
  while (getline(&line, &cap, p) > 0) {
    if (line[0] != '{') continue;
    cJSON *j = cJSON_Parse(line);
    const char *id = j ? cJSON_GetStringValue(cJSON_GetObjectItem(j, "id")) : NULL;
    cJSON *outs = j ? cJSON_GetObjectItem(j, "outputs") : NULL;
    req *q = NULL;
    if (id) HASH_FIND_STR(R->by_id, id, q);
    if (q && cJSON_GetArraySize(outs) == 1) {
      cJSON *t = cJSON_GetObjectItem(cJSON_GetArrayItem(outs, 0), "tokens");
      q->want_n = cJSON_GetArraySize(t) < MAX_TOK ? cJSON_GetArraySize(t) : MAX_TOK;
      for (int k = 0; k < q->want_n; k++) q->want[k] = cJSON_GetArrayItem(t, k)->valueint;
      got++;
    }
    cJSON_Delete(j);
  }
  free(line);
  int rc = pclose(p);
  if (rc != 0 || got != R->n) fprintf(stderr, "tandem-faults: tandem-generate: status %d, %d of %d results\n", rc, got, R->n);
  return rc == 0 && got == R->n ? 0 : -1;
}

static void on_result(void *ctx, const td_client_result *res) {
  run *R = ctx;
  req *q = NULL;
  HASH_FIND_STR(R->by_id, res->id, q);
  if (!q || q->done) return;
  q->done = true;
  q->done_ms = now_rel(R);
  q->ok = res->status == TD_OK;
  if (q->ok && res->n_outputs == 1) {
    q->got_n = res->outputs[0].n_tokens < MAX_TOK ? res->outputs[0].n_tokens : MAX_TOK;
    memcpy(q->got, res->outputs[0].tokens, sizeof(int32_t) * (size_t)q->got_n);
  } else if (q->ok) {
    q->got_n = -1; /* not one output: wrong */
  } else {
    snprintf(q->error, sizeof q->error, "%s: %s", td_status_str(res->status), res->error ? res->error : "");
  }
}

static bool correct(const req *q) {
  return q->ok && q->got_n == q->want_n && !memcmp(q->got, q->want, sizeof(int32_t) * (size_t)q->want_n);
}
/* a clear error: a code and a message that says something */
static bool clear_error(const req *q) { return q->done && !q->ok && strlen(q->error) > 12; }

/* ---------------------------------------------------------------- faults */

static void sleep_ms(int ms) {
  if (ms > 0) usleep((useconds_t)ms * 1000);
}

static void sig(run *R, const char *name, int s) {
  proc *p = proc_named(&R->c, name);
  kill(p->pid, s);
  if (s == SIGKILL) {
    waitpid(p->pid, NULL, 0);
    p->gone = true;
  }
  p->stopped = s == SIGSTOP ? true : s == SIGCONT ? false : p->stopped;
}

static void mark(run *R) { R->t_fault = now_rel(R); }

/* Waits up to ms for a process to register again; the time after the fault. */
static void wait_serves(run *R, const char *id, int ms) {
  for (int64_t end = td_now_ms() + ms; td_now_ms() < end; usleep(50000))
    if (registered(&R->c, id)) {
      R->restart_serves_ms = now_rel(R) - R->t_fault;
      return;
    }
  snprintf(R->note, sizeof R->note, "%s did not register again within %d s", id, ms / 1000);
}

static const char *victim_of(const char *f) {
  const char *dash = strrchr(f, '-');
  const char *role = dash ? dash + 1 : "";
  if (!strcmp(role, "encoder")) return "encoder-0";
  if (!strcmp(role, "prefill")) return "prefill-0";
  if (!strcmp(role, "decode")) return "decode-0";
  if (!strcmp(role, "rank")) return "decode-0-rank1";
  if (!strcmp(role, "router")) return "router";
  return NULL;
}

/* The sender's KV push cut: decode-0 stopped while it holds reservations,
 * so the encoder's pushes to it stall, then the encoder killed with pushes
 * in flight and decode-0 let go on. */
static void cut_transfer(run *R) {
  proc *d0 = proc_named(&R->c, "decode-0");
  td_client_health h;
  for (int64_t end = td_now_ms() + 10000; td_now_ms() < end; usleep(5000)) {
    if (!health(&R->c, &h)) continue;
    bool held = false;
    for (int i = 0; i < h.n_workers; i++)
      if (!strcmp(h.workers[i].id, "decode-0")) held = h.workers[i].jobs > 0;
    if (held) break;
  }
  kill(d0->pid, SIGSTOP);
  int pushing = 0;
  for (int64_t end = td_now_ms() + 10000; td_now_ms() < end && !pushing; usleep(5000))
    if (health(&R->c, &h))
      for (int i = 0; i < h.n_workers; i++)
        if (!strcmp(h.workers[i].id, "encoder-0")) pushing = h.workers[i].kv_pushing;
  mark(R);
  sig(R, "encoder-0", SIGKILL);
  snprintf(R->note, sizeof R->note, "%d pushes in flight when the encoder died", pushing);
  R->fault_ok = pushing > 0;
  sleep_ms(300);
  kill(d0->pid, SIGCONT);
}

static void restart(run *R, const char *name) {
  if (!strcmp(name, "router")) {
    start_router(&R->c);
    wait_serves(R, "decode-1", 20000); /* the workers find the new router */
    return;
  }
  start_worker(&R->c, name, !strcmp(name, "encoder-0") ? "encode" : !strcmp(name, "prefill-0") ? "prefill"
                                                                                                 : "encode,decode",
               NULL, NULL, false);
  wait_serves(R, name, 20000);
}

/* Waits (up to 5 s) until a worker holds work: requests running or jobs
 * given (a fault that hits an idle worker tests little). */
static void wait_busy(run *R, const char *id) {
  for (int64_t end = td_now_ms() + 5000; td_now_ms() < end; usleep(2000)) {
    td_client_health h;
    if (health(&R->c, &h))
      for (int i = 0; i < h.n_workers; i++)
        if (!strcmp(h.workers[i].id, id) && (h.workers[i].running > 0 || h.workers[i].jobs > 0)) return;
  }
}

static bool netns_fault(const char *f) { return !strncmp(f, "netem-", 6) || !strncmp(f, "slow-", 5); }

static void *fault_thread(void *arg) {
  run *R = arg;
  const char *f = R->fault, *victim = victim_of(f);
  sleep_ms((int)(R->at * R->n / R->rate * 1000.0));
  if (victim && strcmp(victim, "router") != 0) wait_busy(R, R->c.tp ? "decode-0" : victim);
  R->fault_ok = true;
  if (!strcmp(f, "none") || netns_fault(f)) {
    mark(R);
  } else if (!strncmp(f, "kill-", 5)) {
    mark(R);
    sig(R, victim, SIGKILL);
    if (!strcmp(victim, "router")) { /* clients see errors; a router started again takes new requests */
      sleep_ms(R->pause_ms);
      restart(R, victim);
    }
  } else if (!strncmp(f, "stop-", 5)) { /* SIGSTOP, SIGCONT after a while */
    mark(R);
    sig(R, victim, SIGSTOP);
    sleep_ms(R->pause_ms);
    sig(R, victim, SIGCONT);
  } else if (!strncmp(f, "hang-", 5)) { /* SIGSTOP, left stopped */
    mark(R);
    sig(R, victim, SIGSTOP);
  } else if (!strncmp(f, "restart-", 8)) {
    mark(R);
    sig(R, victim, SIGKILL);
    sleep_ms(R->pause_ms);
    restart(R, victim);
  } else if (!strcmp(f, "cut-transfer")) {
    cut_transfer(R);
  } else if (!strcmp(f, "dup-worker")) { /* a second process claims decode-0's id */
    mark(R);
    char bin[600];
    snprintf(bin, sizeof bin, "%s/tandem-worker", R->c.bin);
    char *argv[] = {bin, "--router", R->c.worker_ep, "--model", R->c.model, "--role", "encode,decode", "--id",
                    "decode-0", "--block-size", "4", "--threads", "1", NULL};
    spawn(&R->c, "decode-0-claimant", argv);
  } else if (!strcmp(f, "dup-request")) {
    mark(R); /* the second client runs in the main loop */
  } else {
    fprintf(stderr, "tandem-faults: unknown fault %s\n", f);
    exit(2);
  }
  R->acted = true;
  /* PR_SET_PDEATHSIG follows the thread that forked: a process started here
   * would be killed when this thread ended */
  while (!R->finished) usleep(20000);
  return NULL;
}

/* ---------------------------------------------------------------- the run */

static void dup_result(void *ctx, const td_client_result *res) {
  run *R = ctx;
  req *q = NULL;
  HASH_FIND_STR(R->by_id, res->id, q);
  if (!q) return;
  bool same = res->status == TD_OK && res->n_outputs == 1 && res->outputs[0].n_tokens == q->want_n &&
              !memcmp(res->outputs[0].tokens, q->want, sizeof(int32_t) * (size_t)q->want_n);
  if (same)
    R->dup_ok++;
  else if (res->status != TD_OK && res->error && strlen(res->error) > 0)
    R->dup_err++;
  else
    R->dup_wrong++;
}

static int drive(run *R) {
  td_client *cl, *dup = NULL;
  if (td_client_connect_wait(R->c.client_ep, 5000, &cl) != TD_OK) {
    fprintf(stderr, "tandem-faults: %s\n", td_errmsg());
    return -1;
  }
  bool dups = !strcmp(R->fault, "dup-request");
  if (dups && td_client_connect(R->c.client_ep, &dup) != TD_OK) return -1;
  td_client_events ev = {.on_result = on_result, .ctx = R};
  td_client_events dev = {.on_result = dup_result, .ctx = R};
  R->t0 = (double)td_now_ms();
  pthread_create(&R->fault_th, NULL, fault_thread, R);
  double gap = 1000.0 / R->rate, end_ms = 0;
  int next = 0, done = 0;
  while (true) {
    double t = now_rel(R);
    while (next < R->n && next * gap <= t) {
      req *q = &R->r[next++];
      q->submit_ms = t;
      if (td_client_generate(cl, &q->q, true, (uint32_t)R->timeout_ms) != TD_OK) {
        q->done = true;
        snprintf(q->error, sizeof q->error, "not sent: %s", td_errmsg());
      }
      /* the second client repeats the ids of requests in flight */
      if (dup && R->t_fault > 0 && R->n_dup < R->n / 10 && td_client_generate(dup, &q->q, false, (uint32_t)R->timeout_ms) == TD_OK)
        R->n_dup++;
    }
    if (next == R->n && !end_ms) end_ms = t + R->timeout_ms + 20000; /* the deadline and the client's grace */
    done = 0;
    for (int i = 0; i < next; i++) done += R->r[i].done;
    bool dup_done = !dup || td_client_pending(dup) == 0;
    if ((next == R->n && done == R->n && dup_done) || (end_ms && t > end_ms)) break;
    td_client_poll(cl, 10, &ev);
    if (dup) td_client_poll(dup, 0, &dev);
  }
  td_client_close(cl);
  if (dup) td_client_close(dup);
  /* a restart may come after the last answer: it is part of the run */
  for (int64_t end = td_now_ms() + 60000; !R->acted && td_now_ms() < end;) usleep(20000);
  return 0;
}

/* One answer of bench-serve's --results: the request it names is done. */
static void bench_answer(run *R, const cJSON *j) {
  const char *id = cJSON_GetStringValue(cJSON_GetObjectItem(j, "id"));
  req *q = NULL;
  if (id) HASH_FIND_STR(R->by_id, id, q);
  if (!q || q->done) return;
  q->done = true;
  q->submit_ms = cJSON_GetNumberValue(cJSON_GetObjectItem(j, "submit_ms")) - R->t0;
  q->done_ms = cJSON_GetNumberValue(cJSON_GetObjectItem(j, "done_ms")) - R->t0;
  const cJSON *t = cJSON_GetObjectItem(j, "tokens");
  q->ok = cJSON_IsArray(t);
  if (q->ok && cJSON_GetNumberValue(cJSON_GetObjectItem(j, "n_outputs")) == 1) {
    q->got_n = cJSON_GetArraySize(t) < MAX_TOK ? cJSON_GetArraySize(t) : MAX_TOK;
    for (int k = 0; k < q->got_n; k++) q->got[k] = cJSON_GetArrayItem(t, k)->valueint;
  } else if (q->ok) {
    q->got_n = -1; /* not one output: wrong */
  } else {
    snprintf(q->error, sizeof q->error, "%s: %s", cJSON_GetStringValue(cJSON_GetObjectItem(j, "code")),
             cJSON_GetStringValue(cJSON_GetObjectItem(j, "error")));
  }
}

/* The load from bench-serve: the same requests, its open loop of Poisson
 * arrivals at the same mean rate; every answer it wrote is judged here, a
 * request it has none for is lost. Both read the system's monotonic clock. */
static int drive_bench(run *R) {
  char bin[600], reqs[600], out[600], n[16], rate[32], tmo[16];
  snprintf(bin, sizeof bin, "%s/bench-serve", R->c.bin);
  snprintf(reqs, sizeof reqs, "%s/requests.jsonl", R->c.dir);
  snprintf(out, sizeof out, "%s/bench-results.jsonl", R->c.dir);
  snprintf(n, sizeof n, "%d", R->n);
  snprintf(rate, sizeof rate, "%g", R->rate);
  snprintf(tmo, sizeof tmo, "%d", R->timeout_ms);
  char *argv[] = {bin, "--router", R->c.client_ep, "--workload", reqs, "--requests", n, "--rate", rate,
                  "--timeout-ms", tmo, "--seed", "7", "--results", out, NULL};
  unlink(out);
  pid_t pid = spawn(&R->c, "bench-serve", argv);
  /* the fault is timed from bench-serve's first arrival, not its start-up */
  int st = 0;
  R->t0 = 0;
  for (int64_t end = td_now_ms() + 30000; R->t0 <= 0 && td_now_ms() < end; usleep(10000)) {
    FILE *f = fopen(out, "r");
    char first[128] = "";
    if (f && fgets(first, sizeof first, f) && strchr(first, '\n')) {
      cJSON *j = cJSON_Parse(first);
      R->t0 = cJSON_GetNumberValue(cJSON_GetObjectItem(j, "start_ms"));
      cJSON_Delete(j);
    }
    if (f) fclose(f);
    if (waitpid(pid, &st, WNOHANG) == pid) break;
  }
  if (!(R->t0 > 0)) {
    fprintf(stderr, "tandem-faults: bench-serve did not start (log in %s/bench-serve.log)\n", R->c.dir);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return -1;
  }
  pthread_create(&R->fault_th, NULL, fault_thread, R);
  waitpid(pid, &st, 0);
  proc_named(&R->c, "bench-serve")->gone = true; /* not a survivor to judge */
  FILE *f = fopen(out, "r");
  if (!f) {
    fprintf(stderr, "tandem-faults: bench-serve wrote no results (status %d; log in %s/bench-serve.log)\n", st,
            R->c.dir);
    return -1;
  }
  char *line = NULL;
  size_t cap = 0;
  while (getline(&line, &cap, f) > 0) {
    cJSON *j = cJSON_Parse(line);
    if (j) bench_answer(R, j);
    cJSON_Delete(j);
  }
  free(line);
  fclose(f);
  for (int64_t end = td_now_ms() + 60000; !R->acted && td_now_ms() < end;) usleep(20000);
  return 0;
}

/* Correct completions stay at 75 % of their rate before the fault (over up
 * to 5 s, from 1 s after the start) or more over every 2 s window from the
 * fault to the last arrival: the time to the end of the last window below it. */
static double recovery_s(run *R) {
  double tf = R->t_fault, last = R->r[R->n - 1].submit_ms, pre_from = tf - 5000 > 1000 ? tf - 5000 : 1000;
  if (tf <= 0 || tf - pre_from < 500) return NAN;
  int pre = 0;
  for (int i = 0; i < R->n; i++)
    if (correct(&R->r[i]) && R->r[i].done_ms >= pre_from && R->r[i].done_ms < tf) pre++;
  double rate = pre / (tf - pre_from), W = 2000, dip_end = tf;
  for (double t = tf; t + W <= last; t += 100) {
    int k = 0;
    for (int i = 0; i < R->n; i++)
      if (correct(&R->r[i]) && R->r[i].done_ms >= t && R->r[i].done_ms < t + W) k++;
    if (k < 0.75 * rate * W) dip_end = t + W;
  }
  return (dip_end - tf) / 1000.0;
}

/* Waits until every live worker holds no block and the router nothing in
 * flight; the blocks still held (0: none leaked) and by whom. */
static int leaked_blocks(run *R, char *why, size_t cap) {
  int held = -1;
  snprintf(why, cap, "no health answer");
  for (int64_t end = td_now_ms() + 20000; td_now_ms() < end; usleep(200000)) {
    td_client_health h;
    if (!health(&R->c, &h)) continue;
    held = 0;
    why[0] = 0;
    for (int i = 0; i < h.n_workers; i++) {
      const td_client_worker *w = &h.workers[i];
      int n = w->self_blocks - w->free_self_blocks + w->cross_blocks - w->free_cross_blocks;
      if (n || w->running || w->jobs) {
        held += n;
        size_t l = strlen(why);
        snprintf(why + l, cap - l, "%s holds %d blocks, %d running, %d jobs; ", w->id, n, w->running, w->jobs);
      }
    }
    if (h.in_flight || h.queued) {
      size_t l = strlen(why);
      snprintf(why + l, cap - l, "router: %d in flight, %d queued", h.in_flight, h.queued);
    }
    if (!held && !why[0]) return 0;
  }
  return held < 0 ? 1 : held ? held : 1;
}

static void stop_all(cluster *c, bool keep) {
  for (int pass = 0; pass < 2; pass++) {
    for (int i = 0; i < c->n; i++) {
      proc *p = &c->p[i];
      if (p->gone || (pass == 0) == !strcmp(p->name, "router")) continue;
      if (p->stopped) kill(p->pid, SIGKILL); /* left stopped: it has nothing to drain */
      else kill(p->pid, SIGTERM);
    }
    for (int i = 0; i < c->n; i++) {
      proc *p = &c->p[i];
      if (p->gone || (pass == 0) == !strcmp(p->name, "router")) continue;
      int64_t end = td_now_ms() + 15000;
      while (td_now_ms() < end && waitpid(p->pid, NULL, WNOHANG) == 0) usleep(20000);
      if (waitpid(p->pid, NULL, WNOHANG) == 0) {
        kill(p->pid, SIGKILL);
        waitpid(p->pid, NULL, 0);
      }
      p->gone = true;
    }
  }
  netns_down(c);
  if (!keep) {
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", c->dir);
    if (system(cmd) != 0) fprintf(stderr, "tandem-faults: could not remove %s\n", c->dir);
  }
}

/* Lines of a process's log (a restarted one appends) that hold text. */
static int count_lines(cluster *c, const char *name, const char *text) {
  char path[600], line[4096];
  snprintf(path, sizeof path, "%s/%s.log", c->dir, name);
  FILE *f = fopen(path, "r");
  int n = 0;
  while (f && fgets(line, sizeof line, f)) n += strstr(line, text) != NULL;
  if (f) fclose(f);
  return n;
}

static int model_vocab(const char *dir) {
  char path[600];
  snprintf(path, sizeof path, "%s/config.json", dir);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  char buf[65536];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  cJSON *j = cJSON_Parse(buf);
  int v = j ? (int)cJSON_GetNumberValue(cJSON_GetObjectItem(j, "vocab_size")) : 0;
  cJSON_Delete(j);
  return v;
}

static void usage(FILE *f) {
  fprintf(f, "usage: tandem-faults --model DIR --fault NAME [--requests N] [--rate R] [--at F] [--pause-ms MS]\n"
             "                     [--timeout-ms MS] [--max-new N (<= 480)] [--min-correct PCT] [--bin DIR] [--keep]\n"
             "                     [--kv-load-failure recompute|fail]  (the router's policy)\n"
             "                     [--load driver|bench-serve]  (even arrivals from here, or bench-serve's Poisson)\n"
             "faults: none, kill-|stop-|hang-|restart- encoder|prefill|decode|router (hang: left stopped),\n"
             "        kill-rank|stop-rank (a TP=2 decode group's rank 1), cut-transfer, dup-worker, dup-request,\n"
             "        netem-decode, slow-decode (decode-1 in a network namespace behind a link with netem's delay\n"
             "        and loss, or tbf's rate limit; as root); exit status 3: the kernel lacks the qdisc\n"
             "        [--netem 'delay 20ms 10ms loss 2%%'] [--slow 'rate 8mbit burst 32kb latency 20ms']\n");
}

int main(int argc, char **argv) {
  static run R;
  const char *model = NULL, *bin = TD_BIN_DIR, *netem = "delay 20ms 10ms loss 2%",
             *slow = "rate 8mbit burst 32kb latency 20ms";
  R.n = 200, R.rate = 20, R.at = 0.4, R.pause_ms = 3000, R.timeout_ms = 30000, R.fault = NULL;
  R.restart_serves_ms = -1;
  R.c.kv_load_failure = "recompute";
  bool keep = false;
  int max_new = 256;
  double min_correct = 0;
  static const struct option lo[] = {
      {"model", required_argument, 0, 'm'},    {"fault", required_argument, 0, 'f'},
      {"requests", required_argument, 0, 'n'}, {"rate", required_argument, 0, 'r'},
      {"at", required_argument, 0, 'a'},       {"pause-ms", required_argument, 0, 'p'},
      {"timeout-ms", required_argument, 0, 't'}, {"bin", required_argument, 0, 'b'},
      {"netem", required_argument, 0, 'N'},    {"slow", required_argument, 0, 'S'},    {"keep", no_argument, 0, 'k'},
      {"max-new", required_argument, 0, 'x'},  {"min-correct", required_argument, 0, 'c'},
      {"kv-load-failure", required_argument, 0, 'K'}, {"load", required_argument, 0, 'L'},
      {"help", no_argument, 0, 'h'},           {0, 0, 0, 0}};
  int o;
  while ((o = getopt_long(argc, argv, "", lo, NULL)) != -1) switch (o) {
      case 'm': model = optarg; break;
      case 'f': R.fault = optarg; break;
      case 'n': R.n = atoi(optarg); break;
      case 'r': R.rate = atof(optarg); break;
      case 'a': R.at = atof(optarg); break;
      case 'p': R.pause_ms = atoi(optarg); break;
      case 't': R.timeout_ms = atoi(optarg); break;
      case 'b': bin = optarg; break;
      case 'N': netem = optarg; break;
      case 'S': slow = optarg; break;
      case 'k': keep = true; break;
      case 'x': max_new = atoi(optarg); break;
      case 'c': min_correct = atof(optarg); break;
      case 'K': R.c.kv_load_failure = optarg; break;
      case 'L':
        if (strcmp(optarg, "driver") && strcmp(optarg, "bench-serve")) {
          usage(stderr);
          return 2;
        }
        R.bench = !strcmp(optarg, "bench-serve");
        break;
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  if (!model || !R.fault || R.n < 10 || R.n > 100000 || !(R.rate > 0) || !(R.at > 0 && R.at < 1) ||
      R.pause_ms < 0 || R.timeout_ms < 1000 || max_new < 8 || max_new > 480) {
    usage(stderr);
    return 2;
  }
  int vocab = model_vocab(model);
  if (vocab < 3) {
    fprintf(stderr, "tandem-faults: no vocab_size in %s/config.json\n", model);
    return 2;
  }
  td_log_set_name("tandem-faults");
  signal(SIGPIPE, SIG_IGN);
  cluster *c = &R.c;
  snprintf(c->dir, sizeof c->dir, "/tmp/td-faults-XXXXXX");
  if (!mkdtemp(c->dir)) return 2;
  snprintf(c->bin, sizeof c->bin, "%s", bin);
  snprintf(c->model, sizeof c->model, "%s", model);
  bool netns = !strncmp(R.fault, "netem-", 6) || !strncmp(R.fault, "slow-", 5);
  c->tp = strstr(R.fault, "-rank") != NULL;
  R.r = calloc((size_t)R.n, sizeof *R.r);
  make_requests(&R, vocab, max_new, 7);
  for (int i = 0; i < R.n; i++) {
    if (td_json_request_parse(R.r[i].line, strlen(R.r[i].line), ".", i + 1, &R.r[i].q) != TD_OK) {
      fprintf(stderr, "tandem-faults: %s\n", td_errmsg());
      return 2;
    }
    HASH_ADD_STR(R.by_id, q.id, &R.r[i]);
  }
  if (reference(&R) != 0) {
    fprintf(stderr, "tandem-faults: tandem-generate gave no reference (log in %s/generate.log)\n", c->dir);
    return 2;
  }
  char qdisc[300];
  snprintf(qdisc, sizeof qdisc, "%s %s", R.fault[0] == 'n' ? "netem" : "tbf", R.fault[0] == 'n' ? netem : slow);
  if (netns && !netns_up(c, qdisc)) {
    netns_down(c);
    fprintf(stderr, "tandem-faults: the network namespace or its qdisc (%s) could not be set up (root, iproute2, "
            "the kernel's sch_netem / sch_tbf)\n", qdisc);
    return 3;
  }
  if (netns) snprintf(R.note, sizeof R.note, "decode-1 behind %s", qdisc);
  /* ports found free may be taken before the router binds them (another
   * cluster, an outgoing connection): then other ports */
  for (int tries = 0;; tries++) {
    c->port = free_port_pair();
    snprintf(c->client_ep, sizeof c->client_ep, "tcp://127.0.0.1:%d", c->port);
    snprintf(c->worker_ep, sizeof c->worker_ep, "tcp://127.0.0.1:%d", c->port + 1);
    snprintf(c->worker_ep_bind, sizeof c->worker_ep_bind, netns ? "tcp://0.0.0.0:%d" : "tcp://127.0.0.1:%d",
             c->port + 1);
    pid_t rp = start_router(c);
    td_client *probe;
    bool up = false;
    for (int64_t end = td_now_ms() + 10000; !up && td_now_ms() < end && waitpid(rp, NULL, WNOHANG) == 0;
         usleep(50000))
      if (td_client_connect(c->client_ep, &probe) == TD_OK) {
        td_client_health h;
        up = td_client_health_check(probe, 500, &h) == TD_OK;
        td_client_close(probe);
      }
    if (up) break;
    kill(rp, SIGKILL);
    waitpid(rp, NULL, 0);
    if (tries == 4) {
      fprintf(stderr, "tandem-faults: the router did not start (log in %s)\n", c->dir);
      return 2;
    }
  }
  start_worker(c, "encoder-0", "encode", NULL, NULL, false);
  start_worker(c, "prefill-0", "prefill", NULL, NULL, false);
  if (c->tp) {
    start_worker(c, "decode-0", "decode", "decode-0", "0", false);
    start_worker(c, "decode-0-rank1", "decode", "decode-0", "1", false);
  } else {
    start_worker(c, "decode-0", "encode,decode", NULL, NULL, false);
  }
  start_worker(c, "decode-1", "encode,decode", NULL, NULL, netns);
  int encoders = c->tp ? 2 : 3;
  if (!wait_ready(c, encoders, 1, 2, 60000)) {
    fprintf(stderr, "tandem-faults: the cluster did not come up (logs in %s)\n", c->dir);
    stop_all(c, true);
    return 2;
  }
  int64_t t_start = td_now_ms();
  if (R.bench && !strcmp(R.fault, "dup-request")) {
    fprintf(stderr, "tandem-faults: dup-request needs the driver's own load (its second client)\n");
    stop_all(c, false);
    return 2;
  }
  if ((R.bench ? drive_bench(&R) : drive(&R)) != 0) {
    stop_all(c, true);
    return 2; /* the fault thread may still run: exit takes it */
  }
  double run_s = (double)(td_now_ms() - t_start) / 1000.0;
  /* the survivors: every process not killed on purpose still runs */
  char dead[256] = "";
  for (int i = 0; i < c->n; i++) {
    proc *p = &c->p[i];
    if (p->gone || !strcmp(p->name, "decode-0-claimant")) continue;
    if (c->tp && !strncmp(p->name, "decode-0", 8)) continue; /* a group whose rank fell silent leaves whole */
    if (waitpid(p->pid, NULL, WNOHANG) != 0) {
      size_t l = strlen(dead);
      snprintf(dead + l, sizeof dead - l, "%s ", p->name);
      p->gone = true;
    }
  }
  char why[1024];
  int leaked = leaked_blocks(&R, why, sizeof why);
  td_client_health hh;
  if (netns && health(c, &hh)) /* what crossed the link */
    for (int i = 0; i < hh.n_workers; i++)
      if (!strcmp(hh.workers[i].id, "decode-1")) {
        size_t l = strlen(R.note);
        snprintf(R.note + l, sizeof R.note - l, "; it received %llu KV blocks over it",
                 (unsigned long long)hh.workers[i].kv_in_zmq);
      }
  int n_ok = 0, n_err = 0, n_wrong = 0, n_lost = 0;
  double max_err_ms = 0;
  int shown = 0;
  for (int i = 0; i < R.n; i++) {
    req *q = &R.r[i];
    if (correct(q)) n_ok++;
    else if (clear_error(q)) {
      n_err++;
      if (q->done_ms - q->submit_ms > max_err_ms) max_err_ms = q->done_ms - q->submit_ms;
      if (shown++ < 5) fprintf(stderr, "  %s: %s\n", q->q.id, q->error);
    } else if (q->done && q->ok) {
      n_wrong++;
      fprintf(stderr, "  %s: SILENTLY WRONG: %d tokens, want %d\n", q->q.id, q->got_n, q->want_n);
    } else {
      n_lost++;
      fprintf(stderr, "  %s: LOST%s%s\n", q->q.id, q->done ? ": " : "", q->error);
    }
  }
  int sent = R.n + R.n_dup;
  n_ok += R.dup_ok, n_err += R.dup_err, n_wrong += R.dup_wrong;
  n_lost += R.n_dup - R.dup_ok - R.dup_err - R.dup_wrong;
  double rec = recovery_s(&R);
  /* requests sent and not answered when the fault came, when the last of them ended, and when the last of
   * those that ended in an error did (the time to error: a killed router's clients learn it at once) */
  int at_fault = 0;
  double settled = 0, err_after = 0;
  for (int i = 0; i < R.n; i++)
    if (R.t_fault > 0 && R.r[i].submit_ms <= R.t_fault && (!R.r[i].done || R.r[i].done_ms > R.t_fault)) {
      at_fault++;
      if (R.r[i].done && R.r[i].done_ms - R.t_fault > settled) settled = R.r[i].done_ms - R.t_fault;
      if (clear_error(&R.r[i]) && R.r[i].done_ms - R.t_fault > err_after) err_after = R.r[i].done_ms - R.t_fault;
    }
  int retries = count_lines(c, "router", "retrying:");
  char recs[64];
  if (R.restart_serves_ms >= 0)
    snprintf(recs, sizeof recs, "%.1f (serves after %.1f)", isnan(rec) ? 0 : rec, R.restart_serves_ms / 1000.0);
  else if (isnan(rec))
    snprintf(recs, sizeof recs, "-");
  else
    snprintf(recs, sizeof recs, "%.1f", rec);
  if (!R.fault_ok) snprintf(R.note, sizeof R.note, "%s", R.note[0] ? R.note : "the fault was not injected");
  printf("| %s%s | %d | %d | %d (%.1f %%) | %d | %d | %d | %d | %s | %.1f | %.1f | %.1f | %d | %s%s%s |\n", R.fault,
         strcmp(c->kv_load_failure, "recompute") ? " (--kv-load-failure fail)" : "", sent,
         at_fault, n_ok, 100.0 * n_ok / sent, n_err, n_wrong, n_lost, leaked, recs, settled / 1000.0,
         err_after / 1000.0, max_err_ms / 1000.0, retries, R.note,
         dead[0] ? " died: " : "", dead);
  fflush(stdout);
  double lat = 0;
  int n_lat = 0;
  for (int i = 0; i < R.n; i++)
    if (correct(&R.r[i])) lat += R.r[i].done_ms - R.r[i].submit_ms, n_lat++;
  fprintf(stderr, "tandem-faults: %s: %d requests at %.0f/s over %.1f s (correct ones %.0f ms on average), fault at %.1f s%s%s\n",
          R.fault, sent, R.rate, run_s, n_lat ? lat / n_lat : 0, R.t_fault / 1000.0, leaked ? "; held: " : "", leaked ? why : "");
  bool bad = n_wrong || n_lost || leaked || dead[0] || !R.fault_ok || 100.0 * n_ok / sent < min_correct;
  stop_all(c, keep || bad);
  R.finished = true;
  pthread_join(R.fault_th, NULL);
  if (bad) fprintf(stderr, "tandem-faults: logs in %s\n", c->dir);
  for (int i = 0; i < R.n; i++) td_json_request_free(&R.r[i].q);
  HASH_CLEAR(hh, R.by_id);
  free(R.r);
  return bad ? 1 : 0;
}
