/* /metrics over HTTP: libmicrohttpd's own polling thread answers scrapes
 * with a copy of the text the owner published last. The lock guards only
 * that text (a pointer swap on publish, a memcpy on a scrape), so neither
 * side waits on the other's work and the owner's state never crosses
 * threads. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <microhttpd.h>

#include "common/clock.h"
#include "common/defaults.h"
#include "common/log.h"
#include "metrics/metrics.h"

#define CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

struct td_metrics_server {
  struct MHD_Daemon *d;
  int port;
  pthread_mutex_t mu;
  char *text; /* under mu */
  size_t len;
  int64_t published; /* under mu: when the owner last published (0: never) */
  int health_ms;     /* /health answers 200 while the last publish is younger */
};

static enum MHD_Result reply(struct MHD_Connection *c, unsigned status, char *body, size_t len, const char *type) {
  struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
  if (!r) {
    free(body);
    return MHD_NO;
  }
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
  enum MHD_Result q = MHD_queue_response(c, status, r);
  MHD_destroy_response(r);
  return q;
}

static enum MHD_Result plain(struct MHD_Connection *c, unsigned status, const char *msg) {
  char *body = strdup(msg);
  return body ? reply(c, status, body, strlen(body), "text/plain; charset=utf-8") : MHD_NO;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                              const char *version, const char *upload, size_t *upload_len, void **con_cls) {
  (void)version;
  (void)upload;
  td_metrics_server *s = cls;
  if (!*con_cls) { /* the headers: answer once the (empty) body is in */
    *con_cls = s;
    return MHD_YES;
  }
  if (*upload_len) { /* a body is read and ignored */
    *upload_len = 0;
    return MHD_YES;
  }
  bool health = !strcmp(url, "/health");
  if (strcmp(url, "/metrics") && !health) return plain(c, MHD_HTTP_NOT_FOUND, "not found: GET /metrics or /health\n");
  if (strcmp(method, MHD_HTTP_METHOD_GET) && strcmp(method, MHD_HTTP_METHOD_HEAD))
    return plain(c, MHD_HTTP_METHOD_NOT_ALLOWED, "method not allowed: GET /metrics or /health\n");
  if (health) {
    /* the owner's loop publishes every TD_METRICS_PUBLISH_MS: a text this
     * old means the loop is stuck (or never ran) */
    pthread_mutex_lock(&s->mu);
    int64_t age = s->published ? td_now_ms() - s->published : -1;
    pthread_mutex_unlock(&s->mu);
    char msg[128];
    if (age >= 0 && age < s->health_ms) return plain(c, MHD_HTTP_OK, "ok\n");
    if (age < 0) snprintf(msg, sizeof msg, "unavailable: the loop has published nothing yet\n");
    else snprintf(msg, sizeof msg, "unavailable: the loop last published %lld ms ago\n", (long long)age);
    return plain(c, MHD_HTTP_SERVICE_UNAVAILABLE, msg);
  }
  pthread_mutex_lock(&s->mu);
  size_t len = s->len;
  char *body = malloc(len + 1);
  if (body) memcpy(body, s->text ? s->text : "", len + 1);
  pthread_mutex_unlock(&s->mu);
  if (!body) return plain(c, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory\n");
  return reply(c, MHD_HTTP_OK, body, len, CONTENT_TYPE);
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
  (void)cls;
  char msg[512];
  vsnprintf(msg, sizeof msg, fmt, ap);
  size_t n = strlen(msg);
  while (n && msg[n - 1] == '\n') msg[--n] = 0;
  TD_DEBUG("metrics: http: %s", msg);
}

td_status td_metrics_server_start(const char *host, int port, td_metrics_server **out) {
  *out = NULL;
  if (port < 0 || port > 65535) return td_err(TD_ERR_INVALID, "metrics: port %d is outside 0 to 65535", port);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  if (!host || inet_pton(AF_INET, host, &sa.sin_addr) != 1)
    return td_err(TD_ERR_INVALID, "metrics: %s is no IPv4 address", host ? host : "(null)");
  td_metrics_server *s = calloc(1, sizeof *s);
  if (!s) return td_err(TD_ERR_NOMEM, "out of memory");
  pthread_mutex_init(&s->mu, NULL);
  s->health_ms = TD_METRICS_HEALTH_STALE_MS;
  /* AUTO: epoll or poll, not select (the router's descriptors may pass FD_SETSIZE);
   * ITC: a stop wakes the thread at once */
  s->d = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO | MHD_USE_ITC | MHD_USE_ERROR_LOG, 0,
                          NULL, NULL, handle, s,
                          MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa, MHD_OPTION_CONNECTION_LIMIT,
                          (unsigned)TD_METRICS_MAX_CONNECTIONS, MHD_OPTION_CONNECTION_TIMEOUT,
                          (unsigned)TD_METRICS_IDLE_TIMEOUT_S, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
                          MHD_OPTION_END);
  if (!s->d) {
    td_metrics_server_stop(s);
    return td_err(TD_ERR_IO, "metrics: cannot listen on %s:%d (taken?)", host, port);
  }
  const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
  s->port = di ? di->port : port;
  *out = s;
  return TD_OK;
}

int td_metrics_server_port(const td_metrics_server *s) { return s->port; }

void td_metrics_server_set_health_ms(td_metrics_server *s, int ms) { s->health_ms = ms > 0 ? ms : TD_METRICS_HEALTH_STALE_MS; }

td_status td_metrics_server_publish(td_metrics_server *s, const char *text, size_t len) {
  char *copy = malloc(len + 1);
  if (!copy) return td_err(TD_ERR_NOMEM, "out of memory");
  memcpy(copy, text, len);
  copy[len] = 0;
  pthread_mutex_lock(&s->mu);
  char *old = s->text;
  s->text = copy;
  s->len = len;
  s->published = td_now_ms();
  pthread_mutex_unlock(&s->mu);
  free(old);
  return TD_OK;
}

void td_metrics_server_stop(td_metrics_server *s) {
  if (!s) return;
  if (s->d) MHD_stop_daemon(s->d); /* joins its thread: no scrape runs after this */
  pthread_mutex_destroy(&s->mu);
  free(s->text);
  free(s);
}
