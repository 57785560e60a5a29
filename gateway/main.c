/* tandem-gateway: the OpenAI-compatible HTTP front of a cluster
 * (docs/gateway.md). */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/defaults.h"
#include "common/log.h"
#include "common/settings.h"
#include "gateway/gateway.h"

static volatile sig_atomic_t stop_flag;
static void on_signal(int sig) { stop_flag = sig; }

static int number(const char *flag, const char *v, long lo, long hi, long *out) {
  char *end;
  long x = strtol(v, &end, 10);
  if (!*v || *end || x < lo || x > hi) {
    fprintf(stderr, "tandem-gateway: %s %s: an integer in [%ld, %ld]\n", flag, v, lo, hi);
    return -1;
  }
  *out = x;
  return 0;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: tandem-gateway --router tcp://HOST:PORT --model DIR [--tokenizer DIR] [--model-name NAME]\n"
          "                      [--host ADDR] [--port N (0: any free)] [--max-body-bytes N] [--max-json-bytes N]\n"
          "                      [--max-held-bytes N (uploads in memory at once)]\n"
          "                      [--max-connections N] [--max-requests N] [--idle-timeout-s N] [--timeout-ms N]\n"
          "                      [--max-audio-seconds S] [--stream-interval-ms N (0: every arrival)]\n"
          "                      [--spin-us N (the router link and waiting HTTP threads poll this long before\n"
          "                       they sleep: less latency for CPU; default 0, never)]\n"
          "                      [--api-keys FILE (clients give one of its keys, one a line, as\n"
          "                       \"Authorization: Bearer KEY\" for /v1/; mode 0600; docs/gateway.md)]\n"
          "                      [--log-level LEVEL]\n"
          "                      [--curve-secret FILE --router-key FILE]  (CURVE to the router: this gateway's\n"
          "                       secret key and the router's public key; docs/security.md)\n");
}

int main(int argc, char **argv) {
  td_settings settings;
  if (td_settings_from_env(&settings) != TD_OK) {
    fprintf(stderr, "tandem-gateway: %s\n", td_errmsg());
    return 2;
  }
  td_settings_apply(&settings);
  td_log_set_name("gateway");
  static const struct option lo[] = {
      {"router", required_argument, 0, 'r'},         {"model", required_argument, 0, 'm'},
      {"tokenizer", required_argument, 0, 't'},      {"model-name", required_argument, 0, 'n'},
      {"host", required_argument, 0, 'H'},           {"port", required_argument, 0, 'p'},
      {"max-body-bytes", required_argument, 0, 'b'}, {"max-json-bytes", required_argument, 0, 'j'},
      {"max-connections", required_argument, 0, 'c'}, {"max-requests", required_argument, 0, 'q'},
      {"idle-timeout-s", required_argument, 0, 'i'}, {"timeout-ms", required_argument, 0, 'T'},
      {"max-audio-seconds", required_argument, 0, 'a'}, {"log-level", required_argument, 0, 'l'},
      {"stream-interval-ms", required_argument, 0, 's'}, {"max-held-bytes", required_argument, 0, 'B'},
      {"curve-secret", required_argument, 0, 1001},  {"router-key", required_argument, 0, 1002},
      {"spin-us", required_argument, 0, 1003},       {"api-keys", required_argument, 0, 1004},
      {"help", no_argument, 0, 'h'},                 {0, 0, 0, 0}};
  td_auth_opts ao = {0};
  td_gateway_opts o = {0};
  int c;
  long v;
  while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
    switch (c) {
      case 'r': o.router = optarg; break;
      case 'm': o.model_dir = optarg; break;
      case 't': o.tokenizer_dir = optarg; break;
      case 'n': o.model_name = optarg; break;
      case 'H': o.host = optarg; break;
      case 'p':
        if (number("--port", optarg, 0, 65535, &v)) return 2;
        o.port = v ? (int)v : -1;
        break;
      case 'b':
        if (number("--max-body-bytes", optarg, 1024, 1L << 32, &v)) return 2;
        o.max_body_bytes = (size_t)v;
        break;
      case 'B':
        if (number("--max-held-bytes", optarg, 1024, 1L << 40, &v)) return 2;
        o.max_held_bytes = (size_t)v;
        break;
      case 'j':
        if (number("--max-json-bytes", optarg, 1024, 1L << 30, &v)) return 2;
        o.max_json_bytes = (size_t)v;
        break;
      case 'c':
        if (number("--max-connections", optarg, 1, 65536, &v)) return 2;
        o.max_connections = (int)v;
        break;
      case 'q':
        if (number("--max-requests", optarg, 1, 1 << 20, &v)) return 2;
        o.max_requests = (int)v;
        break;
      case 'i':
        if (number("--idle-timeout-s", optarg, 1, 86400, &v)) return 2;
        o.idle_timeout_s = (int)v;
        break;
      case 'T':
        if (number("--timeout-ms", optarg, 1, 86400000, &v)) return 2;
        o.request_timeout_ms = (uint32_t)v;
        break;
      case 'a':
        o.max_audio_seconds = atof(optarg);
        if (!(o.max_audio_seconds > 0)) {
          fprintf(stderr, "tandem-gateway: --max-audio-seconds %s: a positive number\n", optarg);
          return 2;
        }
        break;
      case 1003:
        if (number("--spin-us", optarg, 0, 100000, &v)) return 2;
        o.spin_us = (int)v;
        break;
      case 's':
        if (number("--stream-interval-ms", optarg, 0, 10000, &v)) return 2;
        o.stream_interval_ms = v ? (int)v : -1;
        break;
      case 'l':
        if (td_log_parse_level(optarg) < 0) {
          fprintf(stderr, "tandem-gateway: unknown log level %s\n", optarg);
          return 2;
        }
        td_log_set_level((td_log_level)td_log_parse_level(optarg));
        break;
      case 1001: ao.secret_file = optarg; break;
      case 1002: ao.router_key_file = optarg; break;
      case 1004: o.api_keys_file = optarg; break;
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  if (!o.router || !o.model_dir || optind < argc) {
    usage(stderr);
    return 2;
  }
  struct sigaction sa = {.sa_handler = on_signal};
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
  td_auth *auth = NULL;
  if (td_auth_create_client(&ao, &auth) != TD_OK) {
    fprintf(stderr, "tandem-gateway: %s\n", td_errmsg());
    return 2;
  }
  o.auth = auth;
  td_gateway *g;
  if (td_gateway_create(&o, &g) != TD_OK) {
    fprintf(stderr, "tandem-gateway: %s\n", td_errmsg());
    td_auth_destroy(auth);
    return 1;
  }
  TD_INFO("gateway serving http://%s:%d (router %s)", o.host ? o.host : TD_DEFAULT_LISTEN_HOST, td_gateway_port(g),
          o.router);
  while (!stop_flag) pause();
  TD_INFO("gateway stopping");
  td_gateway_destroy(g);
  td_auth_destroy(auth);
  return 0;
}
