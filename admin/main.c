/* tandem-admin: an operator's requests to a running router: list the
 * workers and pools, drain a worker (it finishes its requests and exits),
 * take a drain back, remove a worker at once (its requests move to other
 * workers), and wait for a worker to be up or gone (for scripts such as
 * deploy/rolling-restart.sh). Links the client library only. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "client/client.h"
#include "common/clock.h"
#include "common/defaults.h"
#include "common/log.h"
#include "common/settings.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: tandem-admin --router ENDPOINT [--json] [--timeout-ms N] [--connect-timeout-ms N] COMMAND\n"
          "commands:\n"
          "  list               workers and pools: id, roles, device, state, running sequences, KV blocks,\n"
          "                     requests encoded, build version, group, pid\n"
          "  drain WORKER       place nothing new there; it finishes its requests, deregisters and exits 0\n"
          "  undrain WORKER     take a drain back (before the worker has left)\n"
          "  remove WORKER      it leaves now; its requests are retried on other workers\n"
          "  wait-up WORKER     wait until WORKER is registered and not draining\n"
          "  wait-gone WORKER   wait until WORKER is no longer registered\n"
          "  ids ROLE           'ID PID' a line for each worker with ROLE (encode, prefill, decode): for scripts\n"
          "--timeout-ms N: how long to wait for the router's answer, or for wait-up / wait-gone (default %d)\n"
          "--json: one JSON object on stdout\n"
          "--curve-secret FILE --router-key FILE: CURVE with this operator's secret key (on the router's\n"
          "  --client-keys and --admin-keys lists) and the router's public key (docs/security.md)\n"
          "exit status: 0 done, 1 the router refused (or a wait timed out), 2 usage or no router\n",
          TD_ADMIN_DEFAULT_TIMEOUT_MS);
}

static const char *state_of(const td_client_worker *x) {
  return x->stopping ? "stopping" : x->draining || x->drain_requested ? "draining" : "up";
}

static void roles_of(const td_client_worker *x, char *buf, size_t cap) {
  snprintf(buf, cap, "%s%s%s", x->encode ? "encode," : "", x->prefill ? "prefill," : "", x->decode ? "decode," : "");
  size_t n = strlen(buf);
  if (n) buf[n - 1] = 0;
}

static cJSON *worker_json(const td_client_worker *x) {
  char roles[32];
  roles_of(x, roles, sizeof roles);
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "id", x->id);
  cJSON *ra = cJSON_AddArrayToObject(o, "roles");
  if (x->encode) cJSON_AddItemToArray(ra, cJSON_CreateString("encode"));
  if (x->prefill) cJSON_AddItemToArray(ra, cJSON_CreateString("prefill"));
  if (x->decode) cJSON_AddItemToArray(ra, cJSON_CreateString("decode"));
  cJSON_AddStringToObject(o, "device", x->device);
  cJSON_AddStringToObject(o, "state", state_of(x));
  cJSON_AddNumberToObject(o, "running", x->running);
  cJSON_AddNumberToObject(o, "max_running", x->max_running);
  cJSON_AddNumberToObject(o, "queued", x->queued);
  cJSON_AddNumberToObject(o, "jobs", x->jobs);
  cJSON_AddNumberToObject(o, "self_blocks_used", x->self_blocks - x->free_self_blocks);
  cJSON_AddNumberToObject(o, "self_blocks_free", x->free_self_blocks);
  cJSON_AddNumberToObject(o, "cross_blocks_used", x->cross_blocks - x->free_cross_blocks);
  cJSON_AddNumberToObject(o, "cross_blocks_free", x->free_cross_blocks);
  cJSON_AddNumberToObject(o, "encoded", (double)x->encoded);
  cJSON_AddNumberToObject(o, "steps", (double)x->steps);
  cJSON_AddNumberToObject(o, "tokens", (double)x->tokens);
  cJSON_AddNumberToObject(o, "encode_runs", (double)x->encode_runs);
  cJSON_AddNumberToObject(o, "busy_seconds", x->busy_seconds);
  cJSON_AddNumberToObject(o, "idle_seconds", x->idle_seconds);
  cJSON_AddNumberToObject(o, "project_seconds", x->project_seconds);
  cJSON_AddStringToObject(o, "version", x->version);
  cJSON_AddStringToObject(o, "group", x->group);
  cJSON_AddNumberToObject(o, "pid", x->pid);
  return o;
}

/* A pool: the workers of one role set. */
static void print_list(const td_client_health *h, bool json) {
  if (json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddBoolToObject(o, "serving", h->serving);
    cJSON_AddNumberToObject(o, "in_flight", h->in_flight);
    cJSON_AddNumberToObject(o, "queued", h->queued);
    cJSON *pools = cJSON_AddObjectToObject(o, "pools");
    cJSON *ws = cJSON_AddArrayToObject(o, "workers");
    for (int i = 0; i < h->n_workers; i++) {
      const td_client_worker *x = &h->workers[i];
      char roles[32];
      roles_of(x, roles, sizeof roles);
      cJSON *p = cJSON_GetObjectItemCaseSensitive(pools, roles);
      if (!p) {
        p = cJSON_AddObjectToObject(pools, roles);
        cJSON_AddNumberToObject(p, "up", 0);
        cJSON_AddNumberToObject(p, "draining", 0);
      }
      cJSON *n = cJSON_GetObjectItemCaseSensitive(p, strcmp(state_of(x), "up") ? "draining" : "up");
      cJSON_SetNumberValue(n, n->valuedouble + 1);
      cJSON_AddItemToArray(ws, worker_json(x));
    }
    cJSON_AddNumberToObject(o, "workers_left_out", h->workers_left_out);
    char *s = cJSON_PrintUnformatted(o);
    if (s) puts(s);
    free(s);
    cJSON_Delete(o);
    return;
  }
  printf("%-24s %-21s %-6s %-9s %9s %15s %15s %8s %-20s %-12s %s\n", "WORKER", "ROLES", "DEVICE", "STATE",
         "RUNNING", "SELF used/free", "CROSS used/free", "ENCODED", "VERSION", "GROUP", "PID");
  for (int i = 0; i < h->n_workers; i++) {
    const td_client_worker *x = &h->workers[i];
    char roles[32], run[24], self[24], cross[24];
    roles_of(x, roles, sizeof roles);
    snprintf(run, sizeof run, "%d/%d", x->running, x->max_running);
    snprintf(self, sizeof self, "%d/%d", x->self_blocks - x->free_self_blocks, x->free_self_blocks);
    snprintf(cross, sizeof cross, "%d/%d", x->cross_blocks - x->free_cross_blocks, x->free_cross_blocks);
    printf("%-24s %-21s %-6s %-9s %9s %15s %15s %8llu %-20s %-12s %u\n", x->id, roles, x->device, state_of(x), run,
           self, cross, (unsigned long long)x->encoded, x->version[0] ? x->version : "-", x->group[0] ? x->group : "-",
           x->pid);
  }
  printf("pools: %d encode, %d prefill, %d decode workers; %d requests in flight, %d queued%s\n", h->encoders,
         h->prefills, h->decoders, h->in_flight, h->queued, h->serving ? "" : "; NOT SERVING (no decode worker)");
  if (h->workers_left_out) printf("(%d more workers not shown)\n", h->workers_left_out);
}

static const td_client_worker *find_worker(const td_client_health *h, const char *id) {
  for (int i = 0; i < h->n_workers; i++)
    if (!strcmp(h->workers[i].id, id)) return &h->workers[i];
  return NULL;
}

static void print_result(bool json, const char *cmd, const char *worker, bool ok, const char *code, const char *msg) {
  if (json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "command", cmd);
    if (worker) cJSON_AddStringToObject(o, "worker", worker);
    cJSON_AddBoolToObject(o, "ok", ok);
    if (!ok) cJSON_AddStringToObject(o, "code", code);
    cJSON_AddStringToObject(o, ok ? "message" : "error", msg);
    char *s = cJSON_PrintUnformatted(o);
    if (s) puts(s);
    free(s);
    cJSON_Delete(o);
  } else if (ok) {
    printf("%s\n", msg);
  } else {
    fprintf(stderr, "tandem-admin: %s: %s\n", code, msg);
  }
}

/* Polls the worker list until `up` (registered, not draining) or gone. */
static int wait_for(td_client *cl, const char *worker, bool up, int timeout_ms, bool json) {
  int64_t end = td_now_ms() + timeout_ms;
  td_admin_reply *rep = malloc(sizeof *rep);
  if (!rep) return 2;
  char last[512] = "no answer from the router";
  for (;;) {
    int64_t left = end - td_now_ms();
    if (left <= 0) break;
    td_status s = td_client_admin(cl, TD_ADMIN_LIST, NULL, (int)(left < 5000 ? left : 5000), rep);
    if (s == TD_OK && rep->status != TD_OK) {
      print_result(json, up ? "wait-up" : "wait-gone", worker, false, rep->code, rep->message);
      free(rep);
      return 1;
    }
    if (s == TD_OK) {
      const td_client_worker *x = find_worker(&rep->health, worker);
      if (up ? x && !strcmp(state_of(x), "up") : !x) {
        char msg[256];
        snprintf(msg, sizeof msg, "worker %s is %s", worker, up ? "up" : "gone");
        print_result(json, up ? "wait-up" : "wait-gone", worker, true, "", msg);
        free(rep);
        return 0;
      }
      snprintf(last, sizeof last, "worker %s is %s", worker, x ? state_of(x) : "not registered");
    }
    usleep(TD_ADMIN_POLL_MS * 1000);
  }
  char msg[768];
  snprintf(msg, sizeof msg, "worker %s not %s within %d ms (%s)", worker, up ? "up" : "gone", timeout_ms, last);
  print_result(json, up ? "wait-up" : "wait-gone", worker, false, "timeout", msg);
  free(rep);
  return 1;
}

int main(int argc, char **argv) {
  td_settings settings;
  if (td_settings_from_env(&settings) != TD_OK) {
    fprintf(stderr, "tandem-admin: %s\n", td_errmsg());
    return 2;
  }
  td_settings_apply(&settings);
  td_log_set_name("admin");
  static const struct option opts[] = {{"router", required_argument, 0, 'r'},
                                       {"json", no_argument, 0, 'j'},
                                       {"timeout-ms", required_argument, 0, 't'},
                                       {"connect-timeout-ms", required_argument, 0, 'C'},
                                       {"curve-secret", required_argument, 0, 1001},
                                       {"router-key", required_argument, 0, 1002},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  const char *router = NULL;
  bool json = false;
  int timeout = TD_ADMIN_DEFAULT_TIMEOUT_MS, connect_ms = TD_DEFAULT_CLIENT_CONNECT_TIMEOUT_MS;
  int c;
  td_auth_opts ao = {0};
  while ((c = getopt_long(argc, argv, "r:jt:C:h", opts, NULL)) != -1) {
    switch (c) {
      case 'r': router = optarg; break;
      case 'j': json = true; break;
      case 't': timeout = atoi(optarg); break;
      case 'C': connect_ms = atoi(optarg); break;
      case 1001: ao.secret_file = optarg; break;
      case 1002: ao.router_key_file = optarg; break;
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  if (!router || optind >= argc || timeout <= 0 || connect_ms <= 0) {
    fprintf(stderr, "tandem-admin: --router and a command are required (see --help)\n");
    return 2;
  }
  const char *cmd = argv[optind];
  const char *worker = optind + 1 < argc ? argv[optind + 1] : NULL;
  static const struct {
    const char *name;
    td_admin_action a;
  } acts[] = {{"list", TD_ADMIN_LIST}, {"drain", TD_ADMIN_DRAIN}, {"undrain", TD_ADMIN_UNDRAIN},
              {"remove", TD_ADMIN_REMOVE}, {"wait-up", TD_ADMIN_LIST}, {"wait-gone", TD_ADMIN_LIST}, {"ids", TD_ADMIN_LIST}};
  int k = -1;
  for (int i = 0; i < (int)(sizeof acts / sizeof acts[0]); i++)
    if (!strcmp(cmd, acts[i].name)) k = i;
  if (k < 0) {
    fprintf(stderr, "tandem-admin: unknown command '%s' (see --help)\n", cmd);
    return 2;
  }
  bool needs_worker = strcmp(cmd, "list") != 0;
  if (argc - optind - 1 != (needs_worker ? 1 : 0)) {
    fprintf(stderr, "tandem-admin: %s %s\n", cmd,
            !needs_worker ? "takes no argument" : strcmp(cmd, "ids") ? "takes one worker id" : "takes one role");
    return 2;
  }
  if (!strcmp(cmd, "ids") && strcmp(worker, "encode") && strcmp(worker, "prefill") && strcmp(worker, "decode")) {
    fprintf(stderr, "tandem-admin: ids takes a role: encode, prefill or decode (not '%s')\n", worker);
    return 2;
  }
  td_client *cl;
  if (td_client_connect_wait_keys(router, &ao, connect_ms, &cl) != TD_OK) {
    fprintf(stderr, "tandem-admin: %s\n", td_errmsg());
    return 2;
  }
  int rc;
  if (!strcmp(cmd, "wait-up") || !strcmp(cmd, "wait-gone")) {
    rc = wait_for(cl, worker, !strcmp(cmd, "wait-up"), timeout, json);
  } else {
    td_admin_reply *rep = malloc(sizeof *rep);
    td_status s = rep ? td_client_admin(cl, acts[k].a, worker, timeout, rep) : td_err(TD_ERR_NOMEM, "out of memory");
    if (s != TD_OK) {
      print_result(json, cmd, worker, false, s == TD_ERR_TIMEOUT ? "timeout" : "client", td_errmsg());
      rc = 2;
    } else if (rep->status != TD_OK) {
      print_result(json, cmd, worker, false, rep->code, rep->message);
      rc = 1;
    } else if (!strcmp(cmd, "ids")) {
      for (int i = 0; i < rep->health.n_workers; i++) {
        const td_client_worker *x = &rep->health.workers[i];
        bool has = !strcmp(worker, "encode") ? x->encode : !strcmp(worker, "prefill") ? x->prefill : x->decode;
        if (has) printf("%s %u\n", x->id, x->pid);
      }
      rc = rep->health.workers_left_out ? 1 : 0;
      if (rc) fprintf(stderr, "tandem-admin: %d workers not shown\n", rep->health.workers_left_out);
    } else if (acts[k].a == TD_ADMIN_LIST) {
      print_list(&rep->health, json);
      rc = 0;
    } else {
      print_result(json, cmd, worker, true, "", rep->message);
      rc = 0;
    }
    free(rep);
  }
  td_client_close(cl);
  return rc;
}
