/* tandem-worker: one worker process with any of the encode, prefill and
 * decode roles: the role folders' tables, handed to the runtime in
 * td_worker_opts.roles (the runtime links no role). */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/defaults.h"
#include "common/log.h"
#include "common/settings.h"
#include "decode_worker/decode.h"
#include "encoder_worker/encoder.h"
#include "prefill_worker/prefill.h"
#include "worker/worker.h"

/* a worker id's length: room for a group's rank suffix within TD_WIRE_MAX_ID */
#define MAX_ID 200

static volatile sig_atomic_t stop_flag;
static void on_signal(int sig) { stop_flag = sig; }

static void usage(FILE *f) {
  fprintf(f,
          "usage: tandem-worker --router tcp://HOST:PORT|local:PATH --model DIR [--role encode,prefill,decode]\n"
          "                                        (local:PATH: the router's --worker-socket on this host)\n"
          "                     [--id NAME] [--device cpu|cuda] [--gpu N] [--block-size N]\n"
          "                     [--kv-blocks N] [--cross-blocks N] [--max-batch N] [--max-tokens N]\n"
          "                     [--max-enc-tokens N] [--max-enc-seqs N]  (an encoder batch)\n"
          "                     [--threads N] [--reservation-ttl-ms N] [--log-level LEVEL]\n"
          "                     [--host ADDR]  (the address the KV and group endpoints bind; default 127.0.0.1)\n"
          "                     [--advertise ADDR]  (the address peers reach them at, when not the one bound:\n"
          "                                         NAT, a pod IP; a wildcard --host needs it; docs/deploy.md)\n"
          "                     [--kv-transport auto|ucx|zmq]   (how KV blocks go to other workers; auto: UCX\n"
          "                                                      where both sides can, else ZeroMQ)\n"
          "                     [--group NAME (--tp N | --pp N [--pp-sets 2]) --rank R]   (rank 0 serves, others follow;\n"
          "                      --pp-sets 2: two running sets alternate through the stages, every rank alike)\n"
          "                     [--tp-encoder heads|rows]  (a TP group's encoder: each rank its heads and FFN\n"
          "                                         slice (default), or the whole encoder over its share of\n"
          "                                         the rows: more memory, faster; every rank alike)\n"
          "                     [--encode-defer N]  (two running sets: steps waiting requests may wait to share an\n"
          "                                         encoder run while both sets run; default 8, -1: never)\n"
          "                     [--spin-us N]  (the main loop and the compute thread poll N us after work before\n"
          "                                         they sleep: fewer wake-ups a request, up to two cores while\n"
          "                                         they spin; for hosts with idle cores; default 0)\n"
          "                     [--cross-mode auto|kv|states|dual]  (what the cross pool holds: as the\n"
          "                                         router; --cross-states: states)\n"
          "                     [--cross-transfer states|kv]  (an encoder-only worker in cross mode auto:\n"
          "                                         push the encoder states, projected on arrival (default),\n"
          "                                         or every layer's K/V)\n"
          "                     [--cross-kv-dtype bf16|int8]  (int8: the cross K/V in int8 with a scale a\n"
          "                                         row, half the bytes a decode step reads, not the reference's\n"
          "                                         bits; a GPU worker of one rank with the decode role, or an\n"
          "                                         encoder that pushes K/V; K/V move only between int8 pools,\n"
          "                                         encoder states pushed to it are projected; default bf16)\n"
          "                     [--states-rows N]  (dual: steps of N rows or more attend over the states;\n"
          "                                         default: the backend's choice, -1: never)\n"
          "                     [--gpu-memory-fraction F]  (a GPU worker's share of its device: weights and\n"
          "                                         pools; default 0.9; split it between workers on one GPU)\n"
          "                     [--encoder-cache-fraction F]  (of the cross pool: encoder outputs kept for\n"
          "                                         repeated inputs; default 0.25, 0 disables)\n"
          "                     [--curve-secret FILE --router-key FILE --worker-keys FILE]  (CURVE: this worker's\n"
          "                                         secret key, the router's public key, the workers admitted\n"
          "                                         to push KV here; KV then goes over ZeroMQ; docs/security.md)\n");
}

/* The roles this process serves, "encode,prefill,decode": the role folders'
 * tables, each named exactly; -1 for a name that is none of them. */
static int parse_roles(const char *list, const td_role *served[TD_WORKER_MAX_ROLES]) {
  static const td_role *const known[] = {&td_role_encode, &td_role_prefill, &td_role_decode};
  int n = 0;
  for (const char *p = list;; p++) {
    size_t len = strcspn(p, ",");
    const td_role *r = NULL;
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
      if (strlen(known[i]->name) == len && !strncmp(p, known[i]->name, len)) r = known[i];
    if (!r || n == TD_WORKER_MAX_ROLES) return -1;
    served[n++] = r;
    p += len;
    if (!*p) return n;
  }
}

/* An option of two words: 1 for `yes`, 0 for `no`, -1 (said on stderr) for anything else. */
static int two_words(const char *option, const char *arg, const char *no, const char *yes) {
  if (!strcmp(arg, yes)) return 1;
  if (!strcmp(arg, no)) return 0;
  fprintf(stderr, "tandem-worker: %s must be %s or %s, not '%s'\n", option, no, yes, arg);
  return -1;
}

int main(int argc, char **argv) {
  td_settings settings;
  if (td_settings_from_env(&settings) != TD_OK) {
    fprintf(stderr, "tandem-worker: %s\n", td_errmsg());
    return 2;
  }
  td_settings_apply(&settings);
  static const struct option opts[] = {
      {"router", required_argument, 0, 'r'},     {"model", required_argument, 0, 'm'},
      {"role", required_argument, 0, 'R'},       {"id", required_argument, 0, 'i'},
      {"device", required_argument, 0, 'd'},     {"gpu", required_argument, 0, 'g'},
      {"block-size", required_argument, 0, 'b'}, {"kv-blocks", required_argument, 0, 'k'},
      {"cross-blocks", required_argument, 0, 'c'}, {"max-batch", required_argument, 0, 'B'},
      {"max-tokens", required_argument, 0, 'T'}, {"threads", required_argument, 0, 't'},
      {"host", required_argument, 0, 'H'},       {"reservation-ttl-ms", required_argument, 0, 'x'},
      {"log-level", required_argument, 0, 'l'},  {"help", no_argument, 0, 'h'},
      {"group", required_argument, 0, 'G'},      {"tp", required_argument, 0, 'P'},
      {"pp", required_argument, 0, 'S'},         {"rank", required_argument, 0, 'K'},
      {"pp-sets", required_argument, 0, 1201},   {"encode-defer", required_argument, 0, 1202},
      {"spin-us", required_argument, 0, 1203},
      {"kv-transport", required_argument, 0, 'X'}, {"cross-states", no_argument, 0, 'C'},
      {"cross-mode", required_argument, 0, 'M'}, {"states-rows", required_argument, 0, 'W'},
      {"gpu-memory-fraction", required_argument, 0, 'F'}, {"max-enc-tokens", required_argument, 0, 'E'},
      {"max-enc-seqs", required_argument, 0, 'Q'}, {"encoder-cache-fraction", required_argument, 0, 'Y'},
      {"curve-secret", required_argument, 0, 1001}, {"router-key", required_argument, 0, 1002},
      {"worker-keys", required_argument, 0, 1003}, {"advertise", required_argument, 0, 1004},
      {"cross-transfer", required_argument, 0, 1005}, {"tp-encoder", required_argument, 0, 1006},
      {"cross-kv-dtype", required_argument, 0, 1007},
      {0, 0, 0, 0}};
  td_auth_opts ao = {0};
  td_worker_opts o = {.device = TD_BACKEND_CPU, .settings = settings,
                      .encoder_cache_fraction = TD_DEFAULT_ENCODER_CACHE_FRACTION};
  const char *roles = "encode,prefill,decode";
  char idbuf[64];
  snprintf(idbuf, sizeof idbuf, "worker-%d", (int)getpid());
  o.id = idbuf;
  int c;
  while ((c = getopt_long(argc, argv, "r:m:R:i:d:g:b:k:c:B:T:t:H:x:l:hG:P:S:K:X:CM:W:F:E:Q:Y:", opts, NULL)) != -1) {
    switch (c) {
      case 'r': o.router = optarg; break;
      case 'm': o.model_dir = optarg; break;
      case 'R': roles = optarg; break;
      case 'i': o.id = optarg; break;
      case 'd':
        if (!strcmp(optarg, "cuda"))
          o.device = TD_BACKEND_CUDA;
        else if (strcmp(optarg, "cpu")) {
          fprintf(stderr, "tandem-worker: --device must be cpu or cuda\n");
          return 2;
        }
        break;
      case 'g': o.device_id = atoi(optarg); break;
      case 'b': o.block_size = atoi(optarg); break;
      case 'k': o.self_blocks = atoi(optarg); break;
      case 'c': o.cross_blocks = atoi(optarg); break;
      case 'B': o.max_batch = atoi(optarg); break;
      case 'E': o.max_enc_tokens = atoi(optarg); break;
      case 'Q': o.max_enc_seqs = atoi(optarg); break;
      case 'F': {
        char *end;
        o.gpu_memory_fraction = strtod(optarg, &end);
        if (*end || !(o.gpu_memory_fraction > 0 && o.gpu_memory_fraction <= 1)) {
          fprintf(stderr, "tandem-worker: --gpu-memory-fraction %s: in (0, 1]\n", optarg);
          return 2;
        }
        break;
      }
      case 'Y': {
        char *end;
        o.encoder_cache_fraction = strtod(optarg, &end);
        if (*end || !(o.encoder_cache_fraction >= 0 && o.encoder_cache_fraction <= 1)) {
          fprintf(stderr, "tandem-worker: --encoder-cache-fraction %s: in [0, 1] (0 disables)\n", optarg);
          return 2;
        }
        break;
      }
      case 'T': o.max_tokens = atoi(optarg); break;
      case 't': o.threads = atoi(optarg); break;
      case 'H': o.listen_host = optarg; break;
      case 1004: o.advertise = optarg; break;
      case 'x': o.reservation_ttl_ms = atoi(optarg); break;
      case 'l':
        if (td_log_parse_level(optarg) < 0) {
          fprintf(stderr, "tandem-worker: unknown log level %s\n", optarg);
          return 2;
        }
        td_log_set_level((td_log_level)td_log_parse_level(optarg));
        break;
      case 'G': o.group = optarg; break;
      case 'P': o.tp = atoi(optarg); break;
      case 'S': o.pp = atoi(optarg); break;
      case 1201:
        o.pp_sets = atoi(optarg);
        if (o.pp_sets != 1 && o.pp_sets != 2) {
          fprintf(stderr, "tandem-worker: --pp-sets %s: 1 or 2\n", optarg);
          return 2;
        }
        break;
      case 1202: {
        char *end = NULL;
        long v = strtol(optarg, &end, 10);
        if (!*optarg || *end || v < -1 || v > 1000) {
          fprintf(stderr, "tandem-worker: --encode-defer %s: steps, -1 (never) to 1000\n", optarg);
          return 2;
        }
        o.encode_defer = v == 0 ? -1 : (int)v; /* 0 steps: encode at once, as -1 */
        break;
      }
      case 1203: {
        char *end = NULL;
        long v = strtol(optarg, &end, 10);
        if (!*optarg || *end || v < 0 || v > TD_MAX_SPIN_US) {
          fprintf(stderr, "tandem-worker: --spin-us %s: 0 to %d microseconds\n", optarg, TD_MAX_SPIN_US);
          return 2;
        }
        o.spin_us = (int)v;
        break;
      }
      case 'K': o.rank = atoi(optarg); break;
      case 'X':
        if (strcmp(optarg, "auto") && strcmp(optarg, "ucx") && strcmp(optarg, "zmq")) {
          fprintf(stderr, "tandem-worker: --kv-transport must be auto, ucx or zmq\n");
          return 2;
        }
        o.transfer = optarg;
        break;
      case 'C': o.cross_mode = TD_CROSS_STATES; break;
      case 'M':
        if (td_cross_mode_parse(optarg, &o.cross_mode) == TD_OK) break;
        fprintf(stderr, "tandem-worker: %s\n", td_errmsg());
        return 2;
      case 'W': o.states_rows = atoi(optarg); break;
      case 1001: ao.secret_file = optarg; break;
      case 1002: ao.router_key_file = optarg; break;
      case 1003: ao.worker_keys_file = optarg; break;
      case 1005: {
        int kv = two_words("--cross-transfer", optarg, "states", "kv");
        if (kv < 0) return 2;
        o.cross_transfer_kv = kv;
        break;
      }
      case 1007: {
        int q8 = two_words("--cross-kv-dtype", optarg, "bf16", "int8");
        if (q8 < 0) return 2;
        o.cross_int8 = q8;
        break;
      }
      case 1006: {
        int rows = two_words("--tp-encoder", optarg, "heads", "rows");
        if (rows < 0) return 2;
        o.enc_rows = rows;
        break;
      }
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  const td_role *served[TD_WORKER_MAX_ROLES];
  o.n_roles = parse_roles(roles, served);
  if (o.n_roles < 0) {
    fprintf(stderr, "tandem-worker: --role %s: a list of encode, prefill and decode\n", roles);
    return 2;
  }
  o.roles = served;
  bool enc_only = true;
  for (int i = 0; i < o.n_roles; i++) enc_only &= served[i]->id == TANDEM__CLUSTER__ROLE__ROLE_ENCODE;
  if (o.group && enc_only) {
    /* an encoder group pushes encoder states, whole on rank 0 (its K/V would be sliced across the ranks) */
    if (!td_cross_pushes_states(o.cross_mode, o.cross_transfer_kv)) {
      fprintf(stderr, "tandem-worker: an encoder group pushes encoder states only (--cross-transfer kv and other "
                      "cross modes need a single-rank encoder)\n");
      return 2;
    }
    o.cross_mode = TD_CROSS_STATES;
  }
  if (o.cross_int8) {
    /* int8 cross K/V are pushed only between int8 pools (router/placement.c): a decode worker's, made by its
       own encoder, projected from pushed encoder states or pushed by an int8 encoder; an encoder-only worker's,
       pushed as they are */
    bool dec = false, kv_out = enc_only && !td_cross_pushes_states(o.cross_mode, o.cross_transfer_kv);
    for (int i = 0; i < o.n_roles; i++) dec |= served[i]->id == TANDEM__CLUSTER__ROLE__ROLE_DECODE;
    const char *why = o.device != TD_BACKEND_CUDA ? "needs --device cuda"
                      : o.group                   ? "is for a worker of one rank, not a group"
                      : !dec && !kv_out
                          ? "is for decode workers, and encoders that push K/V (--cross-transfer kv): encoder states "
                            "are pushed as they are"
                          : NULL;
    if (why) {
      fprintf(stderr, "tandem-worker: --cross-kv-dtype int8 %s\n", why);
      return 2;
    }
  }
  if (strlen(o.id) > MAX_ID) {
    fprintf(stderr, "tandem-worker: --id: at most %d characters (the router's ids and a group's rank names)\n", MAX_ID);
    return 2;
  }
  if (o.encode_defer && o.pp_sets != 2) {
    fprintf(stderr, "tandem-worker: --encode-defer is for two running sets (--pp N --pp-sets 2)\n");
    return 2;
  }
  if (o.enc_rows && (!o.group || o.tp < 2)) {
    fprintf(stderr, "tandem-worker: --tp-encoder rows is for a tensor-parallel group (--group NAME --tp N)\n");
    return 2;
  }
  if (o.pp_sets == 2 && (!o.group || o.pp < 2)) {
    fprintf(stderr, "tandem-worker: --pp-sets 2 is for a pipeline group (--group NAME --pp N)\n");
    return 2;
  }
  if (!o.router || !o.model_dir || !o.n_roles) {
    usage(stderr);
    return 2;
  }
  td_log_set_name(o.id);
  td_auth *auth = NULL;
  if (td_auth_create(&ao, &auth) != TD_OK) {
    fprintf(stderr, "tandem-worker: %s\n", td_errmsg());
    return 2;
  }
  if (auth && (!ao.router_key_file || !ao.worker_keys_file)) {
    fprintf(stderr, "tandem-worker: --curve-secret needs --router-key and --worker-keys\n");
    td_auth_destroy(auth);
    return 2;
  }
  o.auth = auth;
  struct sigaction sa = {.sa_handler = on_signal};
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
  if (o.rank > 0) {
    td_worker_opts_default(&o);
    td_status fs = td_worker_follow(&o, &stop_flag);
    td_auth_destroy(auth);
    if (fs != TD_OK && !stop_flag) fprintf(stderr, "tandem-worker: %s\n", td_errmsg());
    return fs == TD_OK || stop_flag ? 0 : 1;
  }
  td_worker *w;
  if (td_worker_create(&o, &w) != TD_OK) {
    fprintf(stderr, "tandem-worker: %s\n", td_errmsg());
    td_auth_destroy(auth);
    return 1;
  }
  td_status s = td_worker_run(w, &stop_flag);
  if (s != TD_OK) fprintf(stderr, "tandem-worker: %s\n", td_errmsg());
  td_worker_destroy(w);
  td_auth_destroy(auth);
  return s == TD_OK ? 0 : 1;
}
