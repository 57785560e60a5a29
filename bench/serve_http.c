/* bench-serve over HTTP: streamed completions to tandem-gateway. */
#include "serve_http.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <errno.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <curl/curl.h>

#include "common/clock.h"

#include "common/log.h"

typedef struct xfer {
  td_http_bench *h;
  CURL *e;
  struct curl_slist *hdr;
  char *body;
  int index;
  char *line; /* the SSE bytes not yet split into lines */
  size_t n, cap;
  bool first, done, failed;
  int n_tokens;
  int64_t t0_ns; /* the submit call (td_now_ns) */
  struct xfer *prev, *next; /* the live transfers */
} xfer;

struct td_http_bench {
  CURLM *m;
  /* libcurl's multi-socket interface over epoll: a wake-up touches only the
   * connections with bytes (curl_multi_perform visits every transfer, and
   * with 256 streams that loop, not the gateway, set the pace) */
  int ep;
  int64_t due_ns; /* curl's timeout (td_now_ns), -1: none */
  char url[512], model[256];
  const td_http_events *ev; /* during a poll */
  xfer *live;
  td_http_hop hop; /* first events so far */
  char **bodies; /* td_http_bench_prepare's, by index; a submit takes its own */
  int n_bodies;
};

static void event(xfer *x, const char *data) {
  if (!strcmp(data, "[DONE]")) {
    x->done = true;
    return;
  }
  /* only the first event, the usage and errors are read: parsing every chunk would load the CPU the cluster shares */
  if (x->first && !strstr(data, "\"usage\"") && !strstr(data, "\"error\"")) return;
  cJSON *o = cJSON_Parse(data);
  if (!o) return;
  if (cJSON_GetObjectItem(o, "error")) {
    const cJSON *m = cJSON_GetObjectItem(cJSON_GetObjectItem(o, "error"), "message");
    TD_WARN("bench-serve: request %d: %s", x->index, cJSON_IsString(m) ? m->valuestring : "error");
    x->failed = true;
  }
  const cJSON *ch = cJSON_GetObjectItem(o, "choices"), *u = cJSON_GetObjectItem(o, "usage");
  if (cJSON_GetArraySize(ch) > 0 && !x->first) {
    x->first = true;
    curl_off_t sent = 0, head = 0; /* microseconds from curl's start of the transfer */
    curl_easy_getinfo(x->e, CURLINFO_PRETRANSFER_TIME_T, &sent);
    curl_easy_getinfo(x->e, CURLINFO_STARTTRANSFER_TIME_T, &head);
    x->h->hop.sent_ms += (double)sent / 1e3;
    x->h->hop.headers_ms += (double)head / 1e3;
    x->h->hop.first_ms += (double)(td_now_ns() - x->t0_ns) / 1e6;
    x->h->hop.n++;
    if (x->h->ev && x->h->ev->first) x->h->ev->first(x->h->ev->ctx, x->index);
  }
  const cJSON *ct = u ? cJSON_GetObjectItem(u, "completion_tokens") : NULL;
  if (cJSON_IsNumber(ct)) x->n_tokens = (int)ct->valuedouble;
  cJSON_Delete(o);
}

static size_t on_data(char *p, size_t size, size_t nmemb, void *ctx) {
  xfer *x = ctx;
  size_t n = size * nmemb;
  if (x->n + n + 1 > x->cap) {
    size_t cap = (x->n + n + 1) * 2;
    char *l = realloc(x->line, cap);
    if (!l) return 0;
    x->line = l;
    x->cap = cap;
  }
  memcpy(x->line + x->n, p, n);
  x->n += n;
  x->line[x->n] = 0;
  char *s = x->line, *nl;
  while ((nl = strchr(s, '\n'))) {
    *nl = 0;
    if (!strncmp(s, "data: ", 6)) event(x, s + 6);
    s = nl + 1;
  }
  x->n -= (size_t)(s - x->line);
  memmove(x->line, s, x->n);
  return n;
}

static size_t sink(char *p, size_t size, size_t nmemb, void *ctx) {
  char **out = ctx;
  size_t n = size * nmemb, have = *out ? strlen(*out) : 0;
  if (have + n > (1u << 20)) return 0;
  char *s = realloc(*out, have + n + 1);
  if (!s) return 0;
  memcpy(s + have, p, n);
  s[have + n] = 0;
  *out = s;
  return n;
}

/* GET url into *got (malloc'ed); false on a transport failure. */
static bool get(const char *url, char **got) {
  CURL *e = curl_easy_init();
  if (!e) return false;
  curl_easy_setopt(e, CURLOPT_URL, url);
  curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, sink);
  curl_easy_setopt(e, CURLOPT_WRITEDATA, got);
  curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, 10000L);
  CURLcode rc = curl_easy_perform(e);
  curl_easy_cleanup(e);
  return rc == CURLE_OK;
}

td_status td_http_bench_stages(td_http_bench *h, td_http_stages *out) {
  memset(out, 0, sizeof *out);
  char url[600], *got = NULL;
  snprintf(url, sizeof url, "%s/metrics", h->url);
  if (!get(url, &got) || !got) {
    free(got);
    return td_err(TD_ERR_NETWORK, "%s: no metrics", url);
  }
  static const char *const names[3] = {"admit", "cluster", "answer"};
  for (int i = 0; i < 3; i++) {
    char key[160];
    for (int k = 0; k < 2; k++) {
      snprintf(key, sizeof key, "tandem:gateway_first_event_stage_seconds_%s{endpoint=\"/v1/completions\",stage=\"%s\"} ",
               k ? "count" : "sum", names[i]);
      const char *p = strstr(got, key);
      if (p) (k ? out->count : out->sum)[i] = strtod(p + strlen(key), NULL);
    }
  }
  free(got);
  return TD_OK;
}

/* The first model GET /v1/models lists. */
static td_status first_model(td_http_bench *h) {
  CURL *e = curl_easy_init();
  if (!e) return td_err(TD_ERR_NOMEM, "curl: cannot make a handle");
  char url[600], *got = NULL;
  snprintf(url, sizeof url, "%s/v1/models", h->url);
  curl_easy_setopt(e, CURLOPT_URL, url);
  curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, sink);
  curl_easy_setopt(e, CURLOPT_WRITEDATA, &got);
  curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, 10000L);
  CURLcode rc = curl_easy_perform(e);
  curl_easy_cleanup(e);
  cJSON *o = rc == CURLE_OK && got ? cJSON_Parse(got) : NULL;
  const cJSON *id = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(o, "data"), 0), "id");
  td_status s = TD_OK;
  if (cJSON_IsString(id))
    snprintf(h->model, sizeof h->model, "%s", id->valuestring);
  else
    s = td_err(TD_ERR_NETWORK, "%s: no model list (%s)", url, rc == CURLE_OK ? "bad answer" : curl_easy_strerror(rc));
  cJSON_Delete(o);
  free(got);
  return s;
}

static int on_socket(CURL *e, curl_socket_t fd, int what, void *hp, void *sp) {
  (void)e;
  (void)sp;
  td_http_bench *h = hp;
  if (what == CURL_POLL_REMOVE) {
    epoll_ctl(h->ep, EPOLL_CTL_DEL, fd, NULL); /* EBADF once curl closed it: epoll dropped it then */
    return 0;
  }
  struct epoll_event ev = {.events = (what & CURL_POLL_IN ? EPOLLIN : 0u) | (what & CURL_POLL_OUT ? EPOLLOUT : 0u),
                           .data.fd = fd};
  if (epoll_ctl(h->ep, EPOLL_CTL_MOD, fd, &ev) != 0 && errno == ENOENT) epoll_ctl(h->ep, EPOLL_CTL_ADD, fd, &ev);
  return 0;
}

static int on_timer(CURLM *m, long ms, void *hp) {
  (void)m;
  td_http_bench *h = hp;
  h->due_ns = ms < 0 ? -1 : td_now_ns() + (int64_t)ms * 1000000;
  return 0;
}

/* Waits up to timeout_ms for sockets or curl's timeout and lets curl act on them. */
static td_status step(td_http_bench *h, int timeout_ms) {
  int wait = timeout_ms;
  if (h->due_ns >= 0) {
    int64_t left = (h->due_ns - td_now_ns() + 999999) / 1000000;
    if (left < wait) wait = left > 0 ? (int)left : 0;
  }
  struct epoll_event evs[64];
  int n = epoll_wait(h->ep, evs, 64, wait), running;
  if (n < 0 && errno != EINTR) return td_err(TD_ERR_IO, "epoll_wait: %s", strerror(errno));
  for (int i = 0; i < n; i++) {
    int f = (evs[i].events & EPOLLIN ? CURL_CSELECT_IN : 0) | (evs[i].events & EPOLLOUT ? CURL_CSELECT_OUT : 0) |
            (evs[i].events & (EPOLLERR | EPOLLHUP) ? CURL_CSELECT_ERR : 0);
    CURLMcode mc = curl_multi_socket_action(h->m, evs[i].data.fd, f, &running);
    if (mc != CURLM_OK) return td_err(TD_ERR_IO, "curl: %s", curl_multi_strerror(mc));
  }
  if (h->due_ns >= 0 && td_now_ns() >= h->due_ns) {
    h->due_ns = -1;
    CURLMcode mc = curl_multi_socket_action(h->m, CURL_SOCKET_TIMEOUT, 0, &running);
    if (mc != CURLM_OK) return td_err(TD_ERR_IO, "curl: %s", curl_multi_strerror(mc));
  }
  return TD_OK;
}

td_status td_http_bench_create(const char *url, const char *model, td_http_bench **out) {
  *out = NULL;
  if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) return td_err(TD_ERR_IO, "curl: global init failed");
  td_http_bench *h = calloc(1, sizeof *h);
  if (!h || !(h->m = curl_multi_init())) {
    free(h);
    return td_err(TD_ERR_NOMEM, "curl: cannot make a multi handle");
  }
  h->due_ns = -1;
  h->ep = epoll_create1(EPOLL_CLOEXEC);
  if (h->ep < 0) {
    curl_multi_cleanup(h->m);
    free(h);
    return td_err(TD_ERR_IO, "epoll_create1: %s", strerror(errno));
  }
  curl_multi_setopt(h->m, CURLMOPT_SOCKETFUNCTION, on_socket);
  curl_multi_setopt(h->m, CURLMOPT_SOCKETDATA, h);
  curl_multi_setopt(h->m, CURLMOPT_TIMERFUNCTION, on_timer);
  curl_multi_setopt(h->m, CURLMOPT_TIMERDATA, h);
  snprintf(h->url, sizeof h->url, "%s", url);
  size_t n = strlen(h->url);
  while (n && h->url[n - 1] == '/') h->url[--n] = 0;
  if (model) {
    snprintf(h->model, sizeof h->model, "%s", model);
  } else {
    td_status s = first_model(h);
    if (s != TD_OK) {
      td_http_bench_destroy(h);
      return s;
    }
  }
  *out = h;
  return TD_OK;
}

static void xfer_free(xfer *x) {
  if (x->prev) x->prev->next = x->next;
  else if (x->h->live == x) x->h->live = x->next;
  if (x->next) x->next->prev = x->prev;
  if (x->e) {
    curl_multi_remove_handle(x->h->m, x->e);
    curl_easy_cleanup(x->e);
  }
  curl_slist_free_all(x->hdr);
  free(x->body);
  free(x->line);
  free(x);
}

void td_http_bench_destroy(td_http_bench *h) {
  if (!h) return;
  while (h->live) xfer_free(h->live);
  for (int i = 0; i < h->n_bodies; i++) free(h->bodies[i]);
  free(h->bodies);
  if (h->m) curl_multi_cleanup(h->m);
  if (h->ep >= 0) close(h->ep);
  free(h);
  curl_global_cleanup();
}

static char *body_of(const td_http_bench *h, const td_json_request *r) {
  const td_request_params *q = &r->params;
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "model", h->model);
  cJSON *p = cJSON_AddArrayToObject(o, "prompt");
  for (int i = 0; i < r->n_input; i++) cJSON_AddItemToArray(p, cJSON_CreateNumber(r->input_ids[i]));
  if (q->max_new_tokens > 0) cJSON_AddNumberToObject(o, "max_tokens", q->max_new_tokens);
  if (q->temperature > 0) cJSON_AddNumberToObject(o, "temperature", q->temperature);
  if (q->top_p < 1) cJSON_AddNumberToObject(o, "top_p", q->top_p);
  if (q->top_k > 0) cJSON_AddNumberToObject(o, "top_k", q->top_k);
  if (q->has_seed) cJSON_AddNumberToObject(o, "seed", (double)q->seed);
  if (q->n > 1) cJSON_AddNumberToObject(o, "n", q->n);
  if (q->ignore_eos) cJSON_AddTrueToObject(o, "ignore_eos");
  cJSON_AddTrueToObject(o, "stream");
  cJSON_AddTrueToObject(cJSON_AddObjectToObject(o, "stream_options"), "include_usage");
  char *s = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  return s;
}

static size_t discard(char *p, size_t size, size_t nmemb, void *ctx) {
  (void)p;
  (void)ctx;
  return size * nmemb;
}

td_status td_http_bench_warm(td_http_bench *h, int n) {
  if (n <= 0) return TD_OK;
  curl_multi_setopt(h->m, CURLMOPT_MAXCONNECTS, (long)n + 16);
  CURL **e = calloc((size_t)n, sizeof *e);
  if (!e) return td_err(TD_ERR_NOMEM, "out of memory");
  char url[600];
  snprintf(url, sizeof url, "%s/health", h->url);
  td_status s = TD_OK;
  for (int i = 0; i < n && s == TD_OK; i++) {
    e[i] = curl_easy_init();
    if (!e[i]) {
      s = td_err(TD_ERR_NOMEM, "out of memory");
      break;
    }
    curl_easy_setopt(e[i], CURLOPT_URL, url);
    curl_easy_setopt(e[i], CURLOPT_WRITEFUNCTION, discard);
    curl_easy_setopt(e[i], CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(e[i], CURLOPT_TIMEOUT_MS, 10000L);
    if (curl_multi_add_handle(h->m, e[i]) != CURLM_OK) s = td_err(TD_ERR_IO, "curl: cannot add a transfer");
  }
  int ended = 0;
  while (s == TD_OK && ended < n) {
    s = step(h, 100);
    CURLMsg *msg;
    int left;
    while ((msg = curl_multi_info_read(h->m, &left)))
      if (msg->msg == CURLMSG_DONE) {
        ended++;
        if (msg->data.result != CURLE_OK && s == TD_OK)
          s = td_err(TD_ERR_NETWORK, "warming %s: %s", url, curl_easy_strerror(msg->data.result));
      }
  }
  for (int i = 0; i < n; i++)
    if (e[i]) {
      curl_multi_remove_handle(h->m, e[i]);
      curl_easy_cleanup(e[i]);
    }
  free(e);
  return s;
}

static td_status sendable(const td_json_request *r) {
  if (r->features || r->n_prompt || r->params.num_beams > 1)
    return td_err(TD_ERR_UNSUPPORTED, "request %s: --gateway sends token-id prompts only (no audio features, decoder "
                                      "prompt or beams)", r->id);
  return TD_OK;
}

td_status td_http_bench_prepare(td_http_bench *h, const td_json_request *reqs, int n) {
  for (int i = 0; i < h->n_bodies; i++) free(h->bodies[i]);
  free(h->bodies);
  h->n_bodies = 0;
  if (n <= 0) return TD_OK;
  if (!(h->bodies = calloc((size_t)n, sizeof *h->bodies))) return td_err(TD_ERR_NOMEM, "out of memory");
  h->n_bodies = n;
  for (int i = 0; i < n; i++) {
    TD_TRY(sendable(&reqs[i]));
    if (!(h->bodies[i] = body_of(h, &reqs[i]))) return td_err(TD_ERR_NOMEM, "out of memory");
  }
  return TD_OK;
}

td_status td_http_bench_submit(td_http_bench *h, const td_json_request *r, int index) {
  TD_TRY(sendable(r));
  xfer *x = calloc(1, sizeof *x);
  if (!x) return td_err(TD_ERR_NOMEM, "out of memory");
  x->t0_ns = td_now_ns();
  x->h = h;
  x->index = index;
  if (index >= 0 && index < h->n_bodies && h->bodies[index]) {
    x->body = h->bodies[index];
    h->bodies[index] = NULL;
  } else {
    x->body = body_of(h, r);
  }
  x->e = curl_easy_init();
  x->hdr = curl_slist_append(NULL, "Content-Type: application/json");
  /* no "Expect: 100-continue" (curl's default above 1 KiB of body): a round
   * trip before the body that a client of the API would not wait for */
  struct curl_slist *more = x->hdr ? curl_slist_append(x->hdr, "Expect:") : NULL;
  if (more) x->hdr = more;
  if (!x->body || !x->e || !x->hdr) {
    xfer_free(x);
    return td_err(TD_ERR_NOMEM, "out of memory");
  }
  char url[600];
  snprintf(url, sizeof url, "%s/v1/completions", h->url);
  curl_easy_setopt(x->e, CURLOPT_URL, url);
  curl_easy_setopt(x->e, CURLOPT_POSTFIELDS, x->body);
  curl_easy_setopt(x->e, CURLOPT_HTTPHEADER, x->hdr);
  curl_easy_setopt(x->e, CURLOPT_WRITEFUNCTION, on_data);
  curl_easy_setopt(x->e, CURLOPT_WRITEDATA, x);
  curl_easy_setopt(x->e, CURLOPT_PRIVATE, x);
  curl_easy_setopt(x->e, CURLOPT_TCP_NODELAY, 1L);
  if (curl_multi_add_handle(h->m, x->e) != CURLM_OK) {
    curl_easy_cleanup(x->e);
    x->e = NULL;
    xfer_free(x);
    return td_err(TD_ERR_IO, "curl: cannot add a transfer");
  }
  x->next = h->live;
  if (h->live) h->live->prev = x;
  h->live = x;
  return TD_OK;
}

td_http_hop td_http_bench_hop(const td_http_bench *h) { return h->hop; }

td_status td_http_bench_poll(td_http_bench *h, int timeout_ms, const td_http_events *ev) {
  h->ev = ev;
  td_status s = step(h, timeout_ms);
  if (s != TD_OK) {
    h->ev = NULL;
    return s;
  }
  CURLMsg *msg;
  int left;
  while ((msg = curl_multi_info_read(h->m, &left))) {
    if (msg->msg != CURLMSG_DONE) continue;
    xfer *x = NULL;
    curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&x);
    long code = 0;
    curl_easy_getinfo(msg->easy_handle, CURLINFO_RESPONSE_CODE, &code);
    bool ok = msg->data.result == CURLE_OK && code == 200 && x->done && !x->failed;
    if (!ok && !x->failed)
      TD_WARN("bench-serve: request %d: HTTP %ld, %s%s", x->index, code, curl_easy_strerror(msg->data.result),
              x->line && x->n ? x->line : "");
    if (ev && ev->done) ev->done(ev->ctx, x->index, ok, x->n_tokens);
    xfer_free(x);
  }
  h->ev = NULL;
  return TD_OK;
}
