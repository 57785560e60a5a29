/* tandem-router: the cluster's front end. */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/defaults.h"
#include "common/log.h"
#include "common/net.h"
#include "common/settings.h"
#include "router/router.h"

static volatile sig_atomic_t stop_flag;
static void on_signal(int sig) { stop_flag = sig; }

/* The checkpoint's front end, read once: its tokenizer (strict UTF-8: bad
 * text is refused, not replaced) and, for Whisper (preprocessor_config.json
 * present), the feature extractor and the decoder prompt's ids. */
typedef struct frontend {
  td_tokenizer *tok;
  td_mel *mel;
  td_whisper_prompt *whisper;
} frontend;

static td_status load_frontend(const char *dir, frontend *fe) {
  td_tokenizer_opts to = {.strict_utf8 = true};
  TD_TRY(td_tokenizer_load(dir, &to, &fe->tok));
  char path[4096];
  snprintf(path, sizeof path, "%s/preprocessor_config.json", dir);
  if (access(path, F_OK) != 0) return TD_OK;
  td_mel_config mc = {0};
  TD_TRY(td_mel_config_from_preprocessor(dir, &mc));
  TD_TRY(td_mel_create(&mc, &fe->mel));
  return td_whisper_prompt_load(dir, fe->tok, &fe->whisper);
}

static void free_frontend(frontend *fe) {
  td_whisper_prompt_destroy(fe->whisper);
  td_mel_destroy(fe->mel);
  td_tokenizer_destroy(fe->tok);
}

int main(int argc, char **argv) {
  td_settings settings;
  if (td_settings_from_env(&settings) != TD_OK) {
    fprintf(stderr, "tandem-router: %s\n", td_errmsg());
    return 2;
  }
  td_settings_apply(&settings);
  td_log_set_name("router");
  static const struct option opts[] = {
      {"client-endpoint", required_argument, 0, 'c'}, {"worker-endpoint", required_argument, 0, 'w'},
      {"heartbeat-ms", required_argument, 0, 'H'},    {"dead-after", required_argument, 0, 'D'},
      {"max-queue", required_argument, 0, 'q'},       {"max-in-flight", required_argument, 0, 'f'},
      {"timeout-ms", required_argument, 0, 't'},      {"stage-timeout-ms", required_argument, 0, 's'},
      {"max-attempts", required_argument, 0, 'a'},    {"prefill-threshold", required_argument, 0, 'p'},
      {"encode-queue-runs", required_argument, 0, 'e'},
      {"local-encode-pct", required_argument, 0, 'L'},
      {"model-name", required_argument, 0, 'n'},      {"log-level", required_argument, 0, 'l'},
      {"cross-states", no_argument, 0, 'C'},          {"cross-mode", required_argument, 0, 'x'},
      {"tokenizer", required_argument, 0, 'T'},      {"help", no_argument, 0, 'h'},
      {"capacity-wait-ms", required_argument, 0, 'W'}, {"max-held-mb", required_argument, 0, 'M'},
      {"metrics-port", required_argument, 0, 'P'},    {"metrics-host", required_argument, 0, 'O'},
      {"kv-load-failure", required_argument, 0, 'K'},
      {"curve-secret", required_argument, 0, 1001},  {"worker-keys", required_argument, 0, 1002},
      {"client-keys", required_argument, 0, 1003},   {"admin-keys", required_argument, 0, 1004},
      {"advertise", required_argument, 0, 1005},     {"probe-timeout-ms", required_argument, 0, 1006},
      {"local-encode-margin", required_argument, 0, 1007}, {"io-threads", required_argument, 0, 1008},
      {"spin-us", required_argument, 0, 1009},
      {"client-socket", required_argument, 0, 1010}, {"worker-socket", required_argument, 0, 1011},
      {0, 0, 0, 0}};
  td_auth_opts ao = {0};
  td_router_opts o = {.client_endpoint = TD_DEFAULT_CLIENT_ENDPOINT, .worker_endpoint = TD_DEFAULT_WORKER_ENDPOINT};
  const char *tokenizer_dir = NULL;
  int c;
  while ((c = getopt_long(argc, argv, "c:w:H:D:q:f:t:s:a:p:e:L:n:l:Cx:T:W:M:P:O:K:h", opts, NULL)) != -1) {
    switch (c) {
      case 'c': o.client_endpoint = optarg; break;
      case 'w': o.worker_endpoint = optarg; break;
      case 1010: o.client_socket = optarg; break;
      case 1011: o.worker_socket = optarg; break;
      case 'H': o.heartbeat_ms = atoi(optarg); break;
      case 'D': o.dead_after = atoi(optarg); break;
      case 'q': o.max_queue = atoi(optarg); break;
      case 'f': o.max_in_flight = atoi(optarg); break;
      case 't': o.default_timeout_ms = atoi(optarg); break;
      case 's': o.stage_timeout_ms = atoi(optarg); break;
      case 'a': o.max_attempts = atoi(optarg); break;
      case 'p': o.prefill_threshold = atoi(optarg); break;
      case 'e': o.encode_runs = atoi(optarg); break;
      case 'L': o.local_encode_pct = atoi(optarg); break;
      case 1007: {
        char *end = NULL;
        o.local_encode_margin = strtod(optarg, &end);
        if (end == optarg || *end) {
          fprintf(stderr, "tandem-router: --local-encode-margin: a number of encoder runs, not '%s'\n", optarg);
          return 2;
        }
        break;
      }
      case 1008: {
        char *end = NULL;
        long v = strtol(optarg, &end, 10);
        if (end == optarg || *end || v < 1 || v > TD_ROUTER_MAX_IO_THREADS) {
          fprintf(stderr, "tandem-router: --io-threads: 1 to %d ZeroMQ I/O threads, not '%s'\n",
                  TD_ROUTER_MAX_IO_THREADS, optarg);
          return 2;
        }
        o.io_threads = (int)v;
        break;
      }
      case 1009: {
        char *end = NULL;
        long v = strtol(optarg, &end, 10);
        if (end == optarg || *end || v < 0 || v > TD_MAX_SPIN_US) {
          fprintf(stderr, "tandem-router: --spin-us: 0 to %d microseconds, not '%s'\n", TD_MAX_SPIN_US, optarg);
          return 2;
        }
        o.spin_us = (int)v;
        break;
      }
      case 'n': o.model_name = optarg; break;
      case 'T': tokenizer_dir = optarg; break;
      case 'W': o.capacity_wait_ms = atoi(optarg); break;
      case 'M': o.max_held_bytes = atoll(optarg) << 20; break;
      case 'C': o.cross_mode = TD_CROSS_STATES; break;
      case 'P':
        o.metrics = true;
        o.metrics_port = atoi(optarg);
        break;
      case 'O': o.metrics_host = optarg; break;
      case 'K':
        if (!strcmp(optarg, "recompute") || !strcmp(optarg, "fail")) {
          o.kv_load_failure = optarg[0] == 'f' ? TD_KV_LOAD_FAIL : TD_KV_LOAD_RECOMPUTE;
          break;
        }
        fprintf(stderr, "tandem-router: --kv-load-failure %s: recompute or fail\n", optarg);
        return 2;
      case 1001: ao.secret_file = optarg; break;
      case 1002: ao.worker_keys_file = optarg; break;
      case 1003: ao.client_keys_file = optarg; break;
      case 1004: ao.admin_keys_file = optarg; break;
      case 1005: o.advertise = optarg; break;
      case 1006:
        o.probe_timeout_ms = atoi(optarg);
        if (o.probe_timeout_ms < 0) {
          fprintf(stderr, "tandem-router: --probe-timeout-ms %s: 0 (no check) or more\n", optarg);
          return 2;
        }
        if (!o.probe_timeout_ms) o.probe_timeout_ms = -1;
        break;
      case 'x':
        if (td_cross_mode_parse(optarg, &o.cross_mode) == TD_OK) break;
        fprintf(stderr, "tandem-router: %s\n", td_errmsg());
        return 2;
      case 'l':
        if (td_log_parse_level(optarg) < 0) {
          fprintf(stderr, "tandem-router: unknown log level %s\n", optarg);
          return 2;
        }
        td_log_set_level((td_log_level)td_log_parse_level(optarg));
        break;
      default:
        fprintf(c == 'h' ? stdout : stderr,
                "usage: tandem-router [--client-endpoint tcp://HOST:PORT] [--worker-endpoint tcp://HOST:PORT]\n"
                "                     [--client-socket PATH] [--worker-socket PATH]  (local links: clients and\n"
                "                                         workers of this host reach the router at local:PATH over\n"
                "                                         a Unix socket, a ZeroMQ hop's wake-ups saved; not with\n"
                "                                         keys; docs/latency.md)\n"
                "                     [--advertise ADDR]  (the address clients and workers reach those at, when\n"
                "                                         they bind another, e.g. 0.0.0.0; docs/deploy.md)\n"
                "                     [--probe-timeout-ms N]  (a registering worker's KV endpoint must answer a\n"
                "                                         connect within N ms, else it is refused; default 3000,\n"
                "                                         0: no check)\n"
                "                     [--heartbeat-ms N] [--dead-after N] [--max-queue N] [--max-in-flight N]\n"
                "                     [--timeout-ms N] [--stage-timeout-ms N] [--max-attempts N]\n"
                "                     [--kv-load-failure recompute|fail]  (a request whose KV on its way to the\n"
                "                                         decode worker was lost: encoded again on another attempt,\n"
                "                                         the default, or ended with an error)\n"
                "                     [--prefill-threshold N] [--encode-queue-runs N] [--local-encode-pct P]\n"
                "                     [--local-encode-margin R]  (a decode worker that also encodes takes a request\n"
                "                                         only when the encoders are more than R of its encoder runs\n"
                "                                         further behind; default 0)\n"
                "                     [--capacity-wait-ms N]  (a request waits this long for a role no live\n"
                "                                         worker has, e.g. no encoder registered; default 10000)\n"
                "                     [--max-held-mb N]  (client messages of the requests held; default 256)\n"
                "                     [--io-threads N]  (ZeroMQ I/O threads: clients' and workers' connections\n"
                "                                         spread over them; default 2, at most 16)\n"
                "                     [--spin-us N]  (after a turn with messages the loop polls N us before it\n"
                "                                         sleeps: fewer wake-ups a request, a core while it spins;\n"
                "                                         for hosts with idle cores; default 0, at most 100000)\n"
                "                     [--metrics-port N [--metrics-host IP]]  (Prometheus' /metrics over HTTP;\n"
                "                                         0: any free port; host default 127.0.0.1; docs/metrics.md)\n"
                "                     [--model-name NAME] [--log-level LEVEL]\n"
                "                     [--tokenizer DIR]  (the checkpoint's folder: text and audio requests,\n"
                "                                         text in results; Whisper needs its preprocessor_config.json)\n"
                "                     [--cross-mode auto|kv|states|dual]  (what the cross pools hold; every\n"
                "                                         worker must run the same; --cross-states: states)\n"
                "                     [--curve-secret FILE --worker-keys FILE --client-keys FILE [--admin-keys FILE]]\n"
                "                                        (CURVE: this router's secret key, the public keys admitted\n"
                "                                         as workers and as clients; docs/security.md)\n");
        return c == 'h' ? 0 : 2;
    }
  }
  struct sigaction sa = {.sa_handler = on_signal};
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
  frontend fe = {0};
  if (tokenizer_dir) {
    if (load_frontend(tokenizer_dir, &fe) != TD_OK) {
      fprintf(stderr, "tandem-router: --tokenizer %s: %s\n", tokenizer_dir, td_errmsg());
      free_frontend(&fe);
      return 2;
    }
    o.tokenizer = fe.tok;
    o.mel = fe.mel;
    o.whisper = fe.whisper;
    TD_INFO("tokenizer from %s: text%s requests", tokenizer_dir, fe.mel ? " and audio" : "");
  }
  td_auth *auth = NULL;
  if (td_auth_create(&ao, &auth) != TD_OK) {
    fprintf(stderr, "tandem-router: %s\n", td_errmsg());
    free_frontend(&fe);
    return 2;
  }
  if (auth && (!ao.worker_keys_file || !ao.client_keys_file)) {
    fprintf(stderr, "tandem-router: --curve-secret needs --worker-keys and --client-keys (an empty file admits none)\n");
    td_auth_destroy(auth);
    free_frontend(&fe);
    return 2;
  }
  if (auth) TD_INFO("CURVE on the client and worker endpoints; this router's public key %s", td_auth_public_key(auth));
  o.auth = auth;
  td_router *r;
  if (td_router_create(&o, &r) != TD_OK) {
    fprintf(stderr, "tandem-router: %s\n", td_errmsg());
    td_auth_destroy(auth);
    free_frontend(&fe);
    return 1;
  }
  if (td_router_metrics_port(r)) {
    /* a wildcard is reached at the advertised address */
    const char *mh = o.metrics_host ? o.metrics_host : TD_METRICS_DEFAULT_HOST;
    if (o.advertise && td_net_is_wildcard(mh)) mh = o.advertise;
    bool v6 = strchr(mh, ':') && mh[0] != '[';
    TD_INFO("metrics http://%s%s%s:%d/metrics", v6 ? "[" : "", mh, v6 ? "]" : "", td_router_metrics_port(r));
  }
  td_status s = td_router_run(r, &stop_flag);
  if (s != TD_OK) fprintf(stderr, "tandem-router: %s\n", td_errmsg());
  td_router_destroy(r);
  td_auth_destroy(auth);
  free_frontend(&fe);
  return s == TD_OK ? 0 : 1;
}
