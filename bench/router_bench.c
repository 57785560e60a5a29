/* The router alone: requests per second and the latency it adds, with
 * workers that answer every job at once (no model).
 *   bench-router [--requests N] [--audio] [--io-threads N] [--link] [--no-record]
 *   bench-router --serve PORT [--audio]  (the router on PORT (clients) and PORT + 1
 *                                (workers) with the instant workers, until
 *                                SIGINT / SIGTERM: a cluster without compute
 *                                for measuring what is in front of it, e.g.
 *                                tandem-gateway against bench-serve)
 * --audio: the workers serve a Whisper-large-v3 shape (128 mel bins x 3,000
 * frames) and the table's requests carry 30 s of features (1.5 MB each):
 * what the router's thread and I/O threads cost a Whisper request. --io-threads: the
 * router's ZeroMQ I/O threads (td_router_opts.io_threads). --link: the
 * client and the workers on the router's local links (Unix sockets,
 * proto/link.h) instead of loopback TCP. */
#include <dirent.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "bench_util.h"
#include "client/client.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/settings.h"
#include "proto/link.h"
#include "proto/wire.h"
#include "router/router.h"

static volatile sig_atomic_t stop_router, stop_workers, stop_serving;
static bool audio; /* --audio: Whisper-sized feature requests */
static bool use_link; /* --link: local links instead of TCP */
enum { MELS = 128, FRAMES = 3000 };
static void on_signal(int sig) {
  (void)sig;
  stop_serving = 1;
}

typedef struct rctx {
  td_router *r;
  volatile pid_t tid;
} rctx;

static void *router_thread(void *arg) {
  ((rctx *)arg)->tid = gettid();
  td_router_run(((rctx *)arg)->r, &stop_router);
  return NULL;
}

/* Where the CPU time goes: each thread's time on a CPU (schedstat, ns), so
 * that the table says whether the router's thread, its ZeroMQ I/O threads
 * or the client is the busy one. The router's I/O threads are the tasks
 * td_router_create started. */
enum { MAX_TASKS = 256 };
static int tasks_now(pid_t *out) {
  int n = 0;
  DIR *d = opendir("/proc/self/task");
  struct dirent *e;
  while (d && (e = readdir(d)) && n < MAX_TASKS)
    if (e->d_name[0] != '.') out[n++] = (pid_t)atoi(e->d_name);
  if (d) closedir(d);
  return n;
}

static int64_t task_ns(pid_t tid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/self/task/%d/schedstat", (int)tid);
  FILE *f = fopen(path, "r");
  long long ns = 0;
  if (f) {
    if (fscanf(f, "%lld", &ns) != 1) ns = 0;
    fclose(f);
  }
  return ns;
}

typedef struct cpu_groups {
  pid_t router, client, io[MAX_TASKS];
  int n_io;
} cpu_groups;

/* CPU ns so far: the router's thread, its I/O threads, the client's thread. */
static void cpu_now(const cpu_groups *g, int64_t ns[3]) {
  ns[0] = task_ns(g->router);
  ns[1] = 0;
  for (int i = 0; i < g->n_io; i++) ns[1] += task_ns(g->io[i]);
  ns[2] = task_ns(g->client);
}

typedef struct wctx {
  const char *ep;
  char id[32];
  long answered;
} wctx;

/* the worker's end: a ZeroMQ socket or a local link */
typedef struct wconn {
  void *s;
  td_link *k;
} wconn;

static void wsend(wconn *c, Tandem__Cluster__WorkerMessage *m) {
  m->version = TD_PROTOCOL_VERSION;
  if (c->k)
    (void)td_link_send(c->k, &m->base, NULL);
  else
    (void)td_wire_send(c->s, NULL, 0, &m->base);
}

static td_status wrecv(wconn *c, td_wire_frame *f) {
  return c->k ? td_link_recv(c->k, f) : td_wire_recv(c->s, false, false, f);
}

/* A decode worker that encodes "locally" and finishes every request with one token at once. */
static void *worker_thread(void *arg) {
  wctx *w = arg;
  void *ctx = NULL;
  wconn s = {0};
  if (use_link) {
    if (td_link_connect(td_link_path(w->ep), &s.k) != TD_OK) {
      fprintf(stderr, "worker: %s\n", td_errmsg());
      return NULL;
    }
  } else {
    ctx = zmq_ctx_new();
    s.s = zmq_socket(ctx, ZMQ_DEALER);
    td_wire_setup_socket(s.s);
    zmq_setsockopt(s.s, ZMQ_ROUTING_ID, w->id, strlen(w->id));
    zmq_connect(s.s, w->ep);
  }
  Tandem__ModelInfo mi = TANDEM__MODEL_INFO__INIT;
  mi.model_type = audio ? "whisper" : "t5";
  mi.vocab_size = audio ? 51866 : 32128;
  mi.max_source_len = audio ? FRAMES / 2 : 512;
  mi.max_target_len = audio ? 448 : 512;
  mi.mel_bins = audio ? MELS : 0;
  mi.frames = audio ? FRAMES : 0;
  Tandem__TokenId start = TANDEM__TOKEN_ID__INIT;
  start.id = audio ? 50258 : 0;
  mi.decoder_start = &start;
  Tandem__Cluster__Role roles[2] = {TANDEM__CLUSTER__ROLE__ROLE_ENCODE, TANDEM__CLUSTER__ROLE__ROLE_DECODE};
  Tandem__Cluster__WorkerInfo in = TANDEM__CLUSTER__WORKER_INFO__INIT;
  in.worker_id = w->id;
  in.roles = roles;
  in.n_roles = 2;
  in.model = &mi;
  in.block_size = 16;
  in.self_blocks = 1 << 20;
  in.cross_blocks = 1 << 20;
  in.max_running = 1 << 16;
  Tandem__Cluster__Register reg = TANDEM__CLUSTER__REGISTER__INIT;
  reg.info = &in;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_REGISTER;
  m.register_ = &reg;
  wsend(&s, &m);
  int64_t last_hb = 0;
  int32_t tok = 5;
  while (!stop_workers) {
    if (td_now_ms() - last_hb > 200) {
      Tandem__Cluster__Load load = TANDEM__CLUSTER__LOAD__INIT; /* the router drops a heartbeat without it */
      load.free_self_blocks = load.free_cross_blocks = 1u << 20;
      Tandem__Cluster__Heartbeat hb = TANDEM__CLUSTER__HEARTBEAT__INIT;
      hb.load = &load;
      Tandem__Cluster__WorkerMessage hm = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
      hm.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_HEARTBEAT;
      hm.heartbeat = &hb;
      wsend(&s, &hm);
      last_hb = td_now_ms();
    }
    if (s.k) {
      (void)td_link_flush(s.k);
      if (td_link_broken(s.k)) break;
      if (!td_link_pending(s.k)) {
        struct pollfd pf = {.fd = td_link_fd(s.k), .events = POLLIN | (td_link_wants_write(s.k) ? POLLOUT : 0)};
        if (poll(&pf, 1, 50) <= 0) continue;
      }
    } else {
      zmq_pollitem_t it = {.socket = s.s, .events = ZMQ_POLLIN};
      if (zmq_poll(&it, 1, 50) <= 0) continue;
    }
    for (;;) {
      td_wire_frame f;
      if (wrecv(&s, &f) != TD_OK) break;
      Tandem__Cluster__RouterMessage *rm;
      uint32_t ver;
      if (td_wire_unpack_router(&f, &rm, &ver) == TD_OK) {
        if (rm->body_case == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE) {
          Tandem__SequenceOutput o = TANDEM__SEQUENCE_OUTPUT__INIT;
          o.tokens = &tok;
          o.n_tokens = 1;
          o.finish_reason = TANDEM__FINISH_REASON__FINISH_LENGTH;
          Tandem__SequenceOutput *op = &o;
          Tandem__Cluster__Finished fin = TANDEM__CLUSTER__FINISHED__INIT;
          fin.rid = rm->decode->req->rid;
          fin.outputs = &op;
          fin.n_outputs = 1;
          Tandem__Cluster__WorkerMessage fm = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
          fm.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FINISHED;
          fm.finished = &fin;
          wsend(&s, &fm);
          w->answered++;
        }
        tandem__cluster__router_message__free_unpacked(rm, NULL);
      }
      td_wire_frame_free(&f);
    }
  }
  if (s.k) {
    td_link_destroy(s.k);
  } else {
    zmq_close(s.s);
    zmq_ctx_term(ctx);
  }
  return NULL;
}

typedef struct lat {
  int64_t *sent;
  double *ms;
  int done;
} lat;

static void on_result(void *ctx, const td_client_result *r) {
  lat *l = ctx;
  int i = atoi(r->id);
  l->ms[i] = (double)(td_now_ns() - l->sent[i]) * 1e-6;
  l->done++;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Sends n requests keeping `inflight` outstanding; returns requests/s. */
static double run(const char *ep, int n, int inflight, double *p50, double *p99) {
  td_client *c;
  *p50 = *p99 = 0;
  float *feat = audio ? malloc(sizeof(float) * MELS * FRAMES) : NULL;
  if ((audio && !feat) || td_client_connect(ep, &c) != TD_OK) {
    free(feat);
    return -1;
  }
  lat l = {calloc((size_t)n, sizeof(int64_t)), calloc((size_t)n, sizeof(double)), 0};
  td_client_events ev = {.on_result = on_result, .ctx = &l};
  int32_t ids[32];
  for (int i = 0; i < 32; i++) ids[i] = 100 + i;
  td_json_request q;
  memset(&q, 0, sizeof q);
  td_request_params_default(&q.params);
  q.params.max_new_tokens = 1;
  int32_t start = 50258;
  if (audio) { /* 30 s of features, values the encoder could see */
    for (int i = 0; i < MELS * FRAMES; i++) feat[i] = (float)(((int64_t)i * 7919) % 2001) / 1000.0f - 1.0f;
    q.features = feat;
    q.n_features = (size_t)MELS * FRAMES;
    q.prompt = &start;
    q.n_prompt = 1;
  } else {
    q.input_ids = ids;
    q.n_input = 32;
  }
  int64_t t0 = td_now_ns();
  int sent = 0;
  while (l.done < n) {
    while (sent < n && sent - l.done < inflight) {
      snprintf(q.id, sizeof q.id, "%d", sent);
      l.sent[sent] = td_now_ns();
      if (td_client_generate(c, &q, false, 60000) != TD_OK) break;
      sent++;
    }
    td_client_poll(c, 10, &ev);
  }
  double secs = (double)(td_now_ns() - t0) * 1e-9;
  qsort(l.ms, (size_t)n, sizeof(double), cmp_d);
  *p50 = l.ms[n / 2];
  *p99 = l.ms[(int)(n * 0.99)];
  free(l.sent);
  free(l.ms);
  free(feat);
  td_client_close(c);
  return n / secs;
}

/* The workers, then the router. */
static void stop_all(pthread_t *wt, pthread_t rt, rctx *rc) {
  stop_workers = 1;
  for (int i = 0; i < 2; i++) pthread_join(wt[i], NULL);
  stop_router = 1;
  pthread_join(rt, NULL);
  td_router_destroy(rc->r);
}

int main(int argc, char **argv) {
  td_settings settings;
  if (td_settings_from_env(&settings) != TD_OK) {
    fprintf(stderr, "bench: %s\n", td_errmsg());
    return 2;
  }
  td_settings_apply(&settings);
  int n = 0, serve_port = 0, io_threads = 0;
  bool record = true;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--requests") && i + 1 < argc) n = atoi(argv[++i]);
    if (!strcmp(argv[i], "--no-record")) record = false;
    if (!strcmp(argv[i], "--audio")) audio = true;
    if (!strcmp(argv[i], "--link")) use_link = true;
    if (!strcmp(argv[i], "--io-threads") && i + 1 < argc) io_threads = atoi(argv[++i]);
    if (!strcmp(argv[i], "--serve") && i + 1 < argc) {
      serve_port = atoi(argv[++i]);
      if (serve_port < 1 || serve_port > 65534) {
        fprintf(stderr, "bench-router: --serve PORT: 1 to 65534 (PORT + 1 takes the workers)\n");
        return 2;
      }
    }
  }
  if (n <= 0) n = audio ? 1000 : 20000; /* a Whisper request is 1.5 MB */
  td_log_set_level(TD_LOG_WARN);
  char cep[64] = "tcp://127.0.0.1:7390", wep[64] = "tcp://127.0.0.1:7391";
  if (serve_port) {
    snprintf(cep, sizeof cep, "tcp://127.0.0.1:%d", serve_port);
    snprintf(wep, sizeof wep, "tcp://127.0.0.1:%d", serve_port + 1);
  }
  cpu_groups cg = {.client = gettid()};
  pid_t before[MAX_TASKS], after[MAX_TASKS];
  int n_before = tasks_now(before);
  td_router_opts o = {.client_endpoint = cep, .worker_endpoint = wep, .max_queue = 1 << 20, .max_in_flight = 1 << 20,
                      .io_threads = io_threads, .max_held_bytes = 4LL << 30};
  char dir[] = "/tmp/bench-router-XXXXXX", csock[96] = "", wsock[96] = "", clink[104] = "", wlink[104] = "";
  if (use_link) {
    if (!mkdtemp(dir)) {
      perror("bench-router: mkdtemp");
      return 1;
    }
    snprintf(csock, sizeof csock, "%s/clients.sock", dir);
    snprintf(wsock, sizeof wsock, "%s/workers.sock", dir);
    snprintf(clink, sizeof clink, "local:%s", csock);
    snprintf(wlink, sizeof wlink, "local:%s", wsock);
    o.client_socket = csock;
    o.worker_socket = wsock;
  }
  const char *client_ep = use_link ? clink : cep, *worker_ep = use_link ? wlink : wep;
  rctx rc = {0};
  if (td_router_create(&o, &rc.r) != TD_OK) {
    fprintf(stderr, "router: %s\n", td_errmsg());
    return 1;
  }
  int n_after = tasks_now(after);
  for (int i = 0; i < n_after; i++) {
    bool old = false;
    for (int j = 0; j < n_before && !old; j++) old = after[i] == before[j];
    if (!old) cg.io[cg.n_io++] = after[i];
  }
  pthread_t rt, wt[2];
  pthread_create(&rt, NULL, router_thread, &rc);
  pthread_setname_np(rt, "router"); /* perf and top tell the router's thread from the client's */
  wctx w[2] = {{.ep = worker_ep}, {.ep = worker_ep}};
  for (int i = 0; i < 2; i++) {
    snprintf(w[i].id, sizeof w[i].id, "fake-%d", i);
    pthread_create(&wt[i], NULL, worker_thread, &w[i]);
    pthread_setname_np(wt[i], w[i].id);
  }
  usleep(500000);
  cg.router = rc.tid;
  if (serve_port) {
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    printf("router %s (2 workers that answer every job at once)\n", cep);
    fflush(stdout);
    while (!stop_serving) usleep(100000);
    stop_all(wt, rt, &rc);
    if (use_link) rmdir(dir);
    return 0;
  }
  td_sbuf t = {0};
  td_sbuf_printf(&t, "Router alone (tandem-router in-process, 2 decode workers that answer each job at once, one client "
                     "over %s, requests of %s; %d I/O threads): throughput at several concurrencies and the "
                     "round-trip latency (client -> router -> worker -> router -> client); CPU time a request "
                     "of the router's thread, of its I/O threads together and of the client's thread.\n\n",
                 use_link ? "the router's local links (Unix sockets)" : "loopback TCP",
                 audio ? "30 s of Whisper features (1.5 MB)" : "32 input tokens",
                 io_threads > 0 ? io_threads : TD_DEFAULT_ROUTER_IO_THREADS);
  td_sbuf_printf(&t, "| requests in flight | requests/s | p50 ms | p99 ms | router thread us | router I/O us | "
                     "client us |\n|---|---|---|---|---|---|---|\n");
  printf("%10s %12s %8s %8s %10s %10s %10s\n", "in flight", "requests/s", "p50 ms", "p99 ms", "router us", "r-I/O us",
         "client us");
  int levels[] = {1, 8, 64, 512};
  for (int k = 0; k < 4; k++) {
    double p50 = 0, p99 = 0;
    int cnt = levels[k] == 1 ? (n / 10 > 500 ? n / 10 : audio ? n / 4 : 500) : n;
    int64_t c0[3], c1[3];
    cpu_now(&cg, c0);
    double rps = run(client_ep, cnt, levels[k], &p50, &p99);
    cpu_now(&cg, c1);
    double us[3];
    for (int j = 0; j < 3; j++) us[j] = (double)(c1[j] - c0[j]) / 1e3 / cnt;
    printf("%10d %12.0f %8.3f %8.3f %10.1f %10.1f %10.1f\n", levels[k], rps, p50, p99, us[0], us[1], us[2]);
    td_sbuf_printf(&t, "| %d | %.0f | %.3f | %.3f | %.1f | %.1f | %.1f |\n", levels[k], rps, p50, p99, us[0], us[1],
                   us[2]);
  }
  stop_all(wt, rt, &rc);
  if (use_link) rmdir(dir);
  const td_bench_out out = {.results = getenv("TD_RESULTS"), .commit = getenv("TD_COMMIT")};
  if (record)
    td_bench_record(&out, audio ? "Router throughput with Whisper requests (bench-router --audio)"
                                : "Router throughput and added latency (bench-router)",
                    td_bench_cpu_name(), t.s);
  td_sbuf_free(&t);
  return 0;
}
