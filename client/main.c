/* tandem-client: sends JSON-lines requests to a running cluster and prints
 * one result line per request in input order (DESIGN.md §4); with --stream
 * token chunks are printed as they arrive. */
#include <errno.h>
#include <getopt.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "client/client.h"
#include "common/clock.h"
#include "common/defaults.h"
#include "common/log.h"
#include "common/settings.h"

typedef struct slot {
  td_json_request req;
  char *out;
  bool sent;
} slot;

typedef struct app {
  slot *s;
  int n;
  int failed;
  bool stream;
  char *chunk_text; /* the text of the chunk on_tokens prints next */
} app;

static slot *find(app *a, const char *id) {
  for (int i = 0; i < a->n; i++)
    if (a->s[i].sent && !a->s[i].out && !strcmp(a->s[i].req.id, id)) return &a->s[i];
  return NULL;
}

static void on_tokens(void *ctx, const char *id, int seq, int offset, const int32_t *t, const float *lp, int n) {
  app *a = ctx;
  if (!a->stream) return;
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "id", id);
  cJSON_AddNumberToObject(o, "sequence", seq);
  cJSON_AddNumberToObject(o, "offset", offset);
  cJSON *arr = cJSON_AddArrayToObject(o, "tokens");
  for (int i = 0; i < n; i++) cJSON_AddItemToArray(arr, cJSON_CreateNumber(t[i]));
  if (a->chunk_text) cJSON_AddStringToObject(o, "text", a->chunk_text);
  free(a->chunk_text);
  a->chunk_text = NULL;
  char *s = cJSON_PrintUnformatted(o);
  if (s) puts(s);
  fflush(stdout);
  free(s);
  cJSON_Delete(o);
}

/* A chunk's text comes just before its tokens: kept for the tokens' line. */
static void on_text(void *ctx, const char *id, int seq, int offset, const char *text) {
  app *a = ctx;
  free(a->chunk_text);
  a->chunk_text = a->stream ? strdup(text) : NULL;
}

/* One request from the command line (--text or --audio), as a request line
 * would give it, so that both go through the same checks. */
static char *one_request_line(const char *text, const char *audio, const char *language, const char *task,
                              bool timestamps, int max_new) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "id", text ? "text" : "audio");
  if (text) cJSON_AddStringToObject(o, "text", text);
  if (audio) cJSON_AddStringToObject(o, "audio", audio);
  if (language) cJSON_AddStringToObject(o, "language", language);
  if (task) cJSON_AddStringToObject(o, "task", task);
  if (timestamps) cJSON_AddBoolToObject(o, "timestamps", true);
  if (max_new > 0) cJSON_AddNumberToObject(o, "max_new_tokens", max_new);
  char *s = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  return s;
}

static void on_result(void *ctx, const td_client_result *r) {
  app *a = ctx;
  slot *s = find(a, r->id);
  if (!s) return;
  s->out = r->status == TD_OK ? td_json_result_format(r->id, r->outputs, r->n_outputs)
                              : td_json_error_format(r->id, r->status, r->error);
  if (r->status != TD_OK) a->failed++;
  if (a->stream && s->out) {
    puts(s->out);
    fflush(stdout);
  }
}

int main(int argc, char **argv) {
  td_settings settings;
  if (td_settings_from_env(&settings) != TD_OK) {
    fprintf(stderr, "tandem-client: %s\n", td_errmsg());
    return 2;
  }
  td_settings_apply(&settings);
  td_log_set_name("client");
  static const struct option opts[] = {{"router", required_argument, 0, 'r'}, {"requests", required_argument, 0, 'q'},
                                       {"stream", no_argument, 0, 's'},       {"timeout-ms", required_argument, 0, 't'},
                                       {"max-inflight", required_argument, 0, 'm'}, {"health", no_argument, 0, 'H'},
                                       {"text", required_argument, 0, 'x'},   {"audio", required_argument, 0, 'a'},
                                       {"language", required_argument, 0, 'L'}, {"task", required_argument, 0, 'k'},
                                       {"timestamps", no_argument, 0, 'S'},   {"max-new-tokens", required_argument, 0, 'n'},
                                       {"connect-timeout-ms", required_argument, 0, 'C'},
                                       {"curve-secret", required_argument, 0, 1001}, {"router-key", required_argument, 0, 1002},
                                       {"help", no_argument, 0, 'h'},         {0, 0, 0, 0}};
  const char *router = NULL, *path = NULL, *text = NULL, *audio = NULL, *language = NULL, *task = NULL;
  int timeout = 0, max_inflight = 256, max_new = 0, connect_ms = TD_DEFAULT_CLIENT_CONNECT_TIMEOUT_MS;
  bool stream = false, health = false, timestamps = false;
  int c;
  td_auth_opts ao = {0};
  while ((c = getopt_long(argc, argv, "r:q:st:m:Hx:a:L:k:Sn:C:h", opts, NULL)) != -1) {
    switch (c) {
      case 'x': text = optarg; break;
      case 'a': audio = optarg; break;
      case 'L': language = optarg; break;
      case 'k': task = optarg; break;
      case 'S': timestamps = true; break;
      case 'n': max_new = atoi(optarg); break;
      case 'r': router = optarg; break;
      case 'q': path = optarg; break;
      case 's': stream = true; break;
      case 't': timeout = atoi(optarg); break;
      case 'm': max_inflight = atoi(optarg); break;
      case 'H': health = true; break;
      case 'C': connect_ms = atoi(optarg); break;
      case 1001: ao.secret_file = optarg; break;
      case 1002: ao.router_key_file = optarg; break;
      default:
        fprintf(c == 'h' ? stdout : stderr,
                "usage: tandem-client --router ENDPOINT --requests FILE.jsonl [--stream] [--timeout-ms N]\n"
                "                     [--max-inflight N]\n"
                "       tandem-client --router ENDPOINT (--text TEXT | --audio FILE [--language CODE]\n"
                "                     [--task transcribe|translate] [--timestamps]) [--max-new-tokens N] [--stream]\n"
                "                     (the router converts them: it needs --tokenizer)\n"
                "       tandem-client --router ENDPOINT --health\n"
                "       --connect-timeout-ms N: a router that does not answer by then is unreachable (default 5000)\n"
                "       --curve-secret FILE --router-key FILE: CURVE with this client's secret key and the router's\n"
                "                     public key (docs/security.md)\n");
        return c == 'h' ? 0 : 2;
    }
  }
  int inputs = (path != NULL) + (text != NULL) + (audio != NULL);
  if (!router || (inputs != 1 && !health) || max_inflight <= 0 || timeout < 0 || connect_ms <= 0) {
    fprintf(stderr, "tandem-client: --router and one of --requests, --text and --audio are required (see --help)\n");
    return 2;
  }
  if ((language || task || timestamps) && !audio) {
    fprintf(stderr, "tandem-client: --language, --task and --timestamps go with --audio\n");
    return 2;
  }
  td_client *cl;
  if (td_client_connect_wait_keys(router, &ao, connect_ms, &cl) != TD_OK) {
    fprintf(stderr, "tandem-client: %s\n", td_errmsg());
    return 2;
  }
  if (health) {
    td_client_health h;
    int rc = td_client_health_check(cl, timeout ? timeout : 5000, &h);
    if (rc == TD_OK) {
      cJSON *ws = cJSON_CreateArray();
      for (int i = 0; ws && i < h.n_workers; i++) {
        const td_client_worker *x = &h.workers[i];
        cJSON *wj = cJSON_CreateObject();
        cJSON_AddStringToObject(wj, "id", x->id);
        cJSON_AddNumberToObject(wj, "running", x->running);
        cJSON_AddNumberToObject(wj, "max_running", x->max_running);
        cJSON_AddNumberToObject(wj, "queued", x->queued);
        cJSON_AddNumberToObject(wj, "jobs", x->jobs);
        cJSON_AddNumberToObject(wj, "self_blocks", x->self_blocks);
        cJSON_AddNumberToObject(wj, "free_self_blocks", x->free_self_blocks);
        cJSON_AddNumberToObject(wj, "cross_blocks", x->cross_blocks);
        cJSON_AddNumberToObject(wj, "free_cross_blocks", x->free_cross_blocks);
        cJSON_AddNumberToObject(wj, "kv_in_ucx", (double)x->kv_in_ucx);
        cJSON_AddNumberToObject(wj, "kv_in_zmq", (double)x->kv_in_zmq);
        cJSON_AddNumberToObject(wj, "kv_out_ucx", (double)x->kv_out_ucx);
        cJSON_AddNumberToObject(wj, "kv_out_zmq", (double)x->kv_out_zmq);
        cJSON_AddNumberToObject(wj, "kv_out_ipc", (double)x->kv_out_ipc);
        cJSON_AddNumberToObject(wj, "kv_refused", (double)x->kv_refused);
        cJSON_AddNumberToObject(wj, "encoded", (double)x->encoded);
        cJSON_AddNumberToObject(wj, "encoder_cache_hits", (double)x->encoder_cache_hits);
        cJSON_AddNumberToObject(wj, "encoder_cache_blocks", x->encoder_cache_blocks);
        cJSON_AddNumberToObject(wj, "steps", (double)x->steps);
        cJSON_AddNumberToObject(wj, "tokens", (double)x->tokens);
        cJSON_AddNumberToObject(wj, "encode_runs", (double)x->encode_runs);
        cJSON_AddNumberToObject(wj, "busy_seconds", x->busy_seconds);
        cJSON_AddNumberToObject(wj, "idle_seconds", x->idle_seconds);
        cJSON_AddNumberToObject(wj, "project_seconds", x->project_seconds);
        cJSON_AddNumberToObject(wj, "work_began_ms", (double)x->work_began_ms);
        cJSON_AddNumberToObject(wj, "work_ended_ms", (double)x->work_ended_ms);
        cJSON_AddItemToArray(ws, wj);
      }
      char *wtxt = ws ? cJSON_PrintUnformatted(ws) : NULL;
      printf("{\"serving\": %s, \"cross\": \"%s\", \"encoders\": %d, \"prefills\": %d, \"decoders\": %d, "
             "\"in_flight\": %d, \"queued\": %d, \"workers\": %s}\n",
             h.serving ? "true" : "false", h.cross_mode, h.encoders, h.prefills, h.decoders,
             h.in_flight, h.queued, wtxt ? wtxt : "[]");
      free(wtxt);
      cJSON_Delete(ws);
    } else
      fprintf(stderr, "tandem-client: %s\n", td_errmsg());
    td_client_close(cl);
    return rc == TD_OK && h.serving ? 0 : 1;
  }
  char *one = NULL;
  if (!path) {
    one = one_request_line(text, audio, language, task, timestamps, max_new);
    if (!one) {
      fprintf(stderr, "tandem-client: out of memory\n");
      td_client_close(cl);
      return 2;
    }
  }
  FILE *f = one ? fmemopen(one, strlen(one), "r") : strcmp(path, "-") ? fopen(path, "r") : stdin;
  if (!f) {
    fprintf(stderr, "tandem-client: %s: %s\n", path ? path : "request", strerror(errno));
    td_client_close(cl);
    return 2;
  }
  char dirbuf[PATH_MAX];
  snprintf(dirbuf, sizeof dirbuf, "%s", path ? path : ".");
  const char *base = path && strcmp(path, "-") ? dirname(dirbuf) : ".";
  app a = {.stream = stream};
  char *line = NULL;
  size_t cap = 0;
  ssize_t len;
  int line_no = 0, cap_s = 0;
  while ((len = getline(&line, &cap, f)) >= 0) {
    line_no++;
    while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r' || line[len - 1] == ' ')) len--;
    if (!len) continue;
    if (a.n == cap_s) {
      cap_s = cap_s ? 2 * cap_s : 64;
      a.s = realloc(a.s, sizeof *a.s * (size_t)cap_s);
    }
    slot *s = &a.s[a.n++];
    memset(s, 0, sizeof *s);
    if (td_json_request_parse(line, (size_t)len, base, line_no, &s->req) != TD_OK) {
      s->out = td_json_error_format(s->req.id, TD_ERR_INVALID, td_errmsg());
      a.failed++;
    }
  }
  free(line);
  if (f != stdin) fclose(f);
  free(one);
  /* ids must be unique while in flight: later duplicates get an error */
  for (int i = 0; i < a.n; i++)
    for (int j = 0; j < i && !a.s[i].out; j++)
      if (!a.s[j].out && !strcmp(a.s[i].req.id, a.s[j].req.id)) {
        a.s[i].out = td_json_error_format(a.s[i].req.id, TD_ERR_INVALID, "duplicate request id in the file");
        a.failed++;
      }
  if (stream)
    for (int i = 0; i < a.n; i++)
      if (a.s[i].out) puts(a.s[i].out);
  td_client_events ev = {.on_tokens = on_tokens, .on_text = on_text, .on_result = on_result, .ctx = &a};
  int next = 0;
  for (;;) {
    while (next < a.n && td_client_pending(cl) < max_inflight) {
      slot *s = &a.s[next++];
      if (s->out) continue;
      s->sent = true;
      if (td_client_generate(cl, &s->req, stream, (uint32_t)timeout) != TD_OK) {
        s->out = td_json_error_format(s->req.id, TD_ERR_NETWORK, td_errmsg());
        a.failed++;
      }
    }
    if (next >= a.n && td_client_pending(cl) == 0) break;
    if (td_client_poll(cl, 200, &ev) != TD_OK) {
      fprintf(stderr, "tandem-client: %s\n", td_errmsg());
      break;
    }
  }
  if (!stream)
    for (int i = 0; i < a.n; i++)
      if (a.s[i].out) puts(a.s[i].out);
  fflush(stdout);
  for (int i = 0; i < a.n; i++) {
    td_json_request_free(&a.s[i].req);
    free(a.s[i].out);
  }
  free(a.s);
  free(a.chunk_text);
  td_client_close(cl);
  return a.failed ? 1 : 0;
}
