/* td_metrics: the text exposition format against exact text, histogram
 * buckets, label escaping, limits, and the /metrics server over a socket. */
#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <criterion/criterion.h>

#include "common/defaults.h"
#include "metrics/metrics.h"

static char *render(td_metrics *m) {
  char *t;
  size_t n;
  cr_assert_eq(td_metrics_render(m, &t, &n), TD_OK);
  cr_assert_eq(strlen(t), n);
  return t;
}

Test(metrics, counters_and_gauges_render_exactly) {
  td_metrics *m;
  cr_assert_eq(td_metrics_create(&m), TD_OK);
  td_metric *c, *g, *u;
  const char *lc[] = {"code"}, *lg[] = {"worker", "pool"};
  cr_assert_eq(td_metrics_add(m, TD_METRIC_COUNTER, "tandem:request_failure_total", "Failed requests.", lc, 1, NULL, 0,
                              &c),
               TD_OK);
  cr_assert_eq(td_metrics_add(m, TD_METRIC_GAUGE, "tandem:worker_kv_blocks_free", "Free blocks.", lg, 2, NULL, 0, &g),
               TD_OK);
  cr_assert_eq(td_metrics_add(m, TD_METRIC_GAUGE, "up_ratio", "A \\ help\nline.", NULL, 0, NULL, 0, &u), TD_OK);
  td_metric_inc(c, (const char *[]){"timeout"}, 1);
  td_metric_inc(c, (const char *[]){"unavailable"}, 2);
  td_metric_inc(c, (const char *[]){"timeout"}, 1);
  td_metric_set(g, (const char *[]){"w\"1\\\n", "self"}, 7);
  td_metric_set(g, (const char *[]){"w2", "cross"}, 3);
  td_metric_set(g, (const char *[]){"w2", "cross"}, 1.5);
  td_metric_set(u, NULL, 0.1);
  char *t = render(m);
  cr_assert_str_eq(t, "# HELP tandem:request_failure_total Failed requests.\n"
                      "# TYPE tandem:request_failure_total counter\n"
                      "tandem:request_failure_total{code=\"timeout\"} 2\n"
                      "tandem:request_failure_total{code=\"unavailable\"} 2\n"
                      "# HELP tandem:worker_kv_blocks_free Free blocks.\n"
                      "# TYPE tandem:worker_kv_blocks_free gauge\n"
                      "tandem:worker_kv_blocks_free{worker=\"w\\\"1\\\\\\n\",pool=\"self\"} 7\n"
                      "tandem:worker_kv_blocks_free{worker=\"w2\",pool=\"cross\"} 1.5\n"
                      "# HELP up_ratio A \\\\ help\\nline.\n"
                      "# TYPE up_ratio gauge\n"
                      "up_ratio 0.1\n");
  free(t);
  cr_assert_eq(td_metric_value(c, (const char *[]){"timeout"}), 2);
  cr_assert_eq(td_metric_value(c, (const char *[]){"none"}), 0);
  /* clearing forgets the series, not the family */
  td_metric_clear(g);
  t = render(m);
  cr_assert(strstr(t, "# TYPE tandem:worker_kv_blocks_free gauge\n# HELP up_ratio"));
  free(t);
  td_metrics_destroy(m);
}

Test(metrics, histogram_buckets_are_cumulative) {
  td_metrics *m;
  cr_assert_eq(td_metrics_create(&m), TD_OK);
  td_metric *h, *s;
  const double b[] = {0.005, 0.1, 1};
  const char *ls[] = {"stage"};
  cr_assert_eq(td_metrics_add(m, TD_METRIC_HISTOGRAM, "tandem:time_to_first_token_seconds", "TTFT.", NULL, 0, b, 3, &h),
               TD_OK);
  cr_assert_eq(td_metrics_add(m, TD_METRIC_HISTOGRAM, "stage_seconds", "Stages.", ls, 1, b, 3, &s), TD_OK);
  td_metric_touch(h, NULL);
  char *t = render(m);
  cr_assert_str_eq(t, "# HELP tandem:time_to_first_token_seconds TTFT.\n"
                      "# TYPE tandem:time_to_first_token_seconds histogram\n"
                      "tandem:time_to_first_token_seconds_bucket{le=\"0.005\"} 0\n"
                      "tandem:time_to_first_token_seconds_bucket{le=\"0.1\"} 0\n"
                      "tandem:time_to_first_token_seconds_bucket{le=\"1\"} 0\n"
                      "tandem:time_to_first_token_seconds_bucket{le=\"+Inf\"} 0\n"
                      "tandem:time_to_first_token_seconds_sum 0\n"
                      "tandem:time_to_first_token_seconds_count 0\n"
                      "# HELP stage_seconds Stages.\n"
                      "# TYPE stage_seconds histogram\n");
  free(t);
  /* a value on a bound falls in that bound's bucket (le: less or equal) */
  const double vals[] = {0.005, 0.05, 0.1, 0.5, 2, 0.001};
  for (int i = 0; i < 6; i++) td_metric_observe(h, NULL, vals[i]);
  td_metric_observe(s, (const char *[]){"queue"}, 0.25);
  t = render(m);
  cr_assert_str_eq(t, "# HELP tandem:time_to_first_token_seconds TTFT.\n"
                      "# TYPE tandem:time_to_first_token_seconds histogram\n"
                      "tandem:time_to_first_token_seconds_bucket{le=\"0.005\"} 2\n"
                      "tandem:time_to_first_token_seconds_bucket{le=\"0.1\"} 4\n"
                      "tandem:time_to_first_token_seconds_bucket{le=\"1\"} 5\n"
                      "tandem:time_to_first_token_seconds_bucket{le=\"+Inf\"} 6\n"
                      "tandem:time_to_first_token_seconds_sum 2.656\n"
                      "tandem:time_to_first_token_seconds_count 6\n"
                      "# HELP stage_seconds Stages.\n"
                      "# TYPE stage_seconds histogram\n"
                      "stage_seconds_bucket{stage=\"queue\",le=\"0.005\"} 0\n"
                      "stage_seconds_bucket{stage=\"queue\",le=\"0.1\"} 0\n"
                      "stage_seconds_bucket{stage=\"queue\",le=\"1\"} 1\n"
                      "stage_seconds_bucket{stage=\"queue\",le=\"+Inf\"} 1\n"
                      "stage_seconds_sum{stage=\"queue\"} 0.25\n"
                      "stage_seconds_count{stage=\"queue\"} 1\n");
  free(t);
  cr_assert_eq(td_metric_value(h, NULL), 6);
  td_metrics_destroy(m);
}

Test(metrics, special_values_and_bad_names) {
  td_metrics *m;
  cr_assert_eq(td_metrics_create(&m), TD_OK);
  td_metric *g;
  cr_assert_eq(td_metrics_add(m, TD_METRIC_GAUGE, "g", "", NULL, 0, NULL, 0, &g), TD_OK);
  td_metric_set(g, NULL, INFINITY);
  char *t = render(m);
  cr_assert_str_eq(t, "# HELP g \n# TYPE g gauge\ng +Inf\n");
  free(t);
  td_metric_set(g, NULL, NAN);
  t = render(m);
  cr_assert(strstr(t, "g NaN\n"));
  free(t);
  td_metric_set(g, NULL, 1e20);
  t = render(m);
  cr_assert(strstr(t, "g 1e+20\n"));
  free(t);
  td_metric *x;
  const char *bad_label[] = {"a:b"}, *le[] = {"le"};
  const double down[] = {1, 0.5}, one[] = {1};
  cr_assert_eq(td_metrics_add(m, TD_METRIC_GAUGE, "9lives", "", NULL, 0, NULL, 0, &x), TD_ERR_INVALID);
  cr_assert_eq(td_metrics_add(m, TD_METRIC_GAUGE, "a-b", "", NULL, 0, NULL, 0, &x), TD_ERR_INVALID);
  cr_assert_eq(td_metrics_add(m, TD_METRIC_GAUGE, "ok", "", bad_label, 1, NULL, 0, &x), TD_ERR_INVALID);
  cr_assert_eq(td_metrics_add(m, TD_METRIC_HISTOGRAM, "h", "", le, 1, one, 1, &x), TD_ERR_INVALID);
  cr_assert_eq(td_metrics_add(m, TD_METRIC_HISTOGRAM, "h", "", NULL, 0, down, 2, &x), TD_ERR_INVALID);
  cr_assert_eq(td_metrics_add(m, TD_METRIC_HISTOGRAM, "h", "", NULL, 0, NULL, 0, &x), TD_ERR_INVALID);
  cr_assert_eq(td_metrics_add(m, TD_METRIC_GAUGE, "ok", "", NULL, TD_METRICS_MAX_LABELS + 1, NULL, 0, &x),
               TD_ERR_INVALID);
  td_metrics_destroy(m);
}

Test(metrics, series_past_the_limit_are_dropped_and_counted) {
  td_metrics *m;
  cr_assert_eq(td_metrics_create(&m), TD_OK);
  td_metric *c;
  const char *l[] = {"k"};
  cr_assert_eq(td_metrics_add(m, TD_METRIC_COUNTER, "c_total", "", l, 1, NULL, 0, &c), TD_OK);
  char v[32];
  for (int i = 0; i < TD_METRICS_MAX_SERIES + 5; i++) {
    snprintf(v, sizeof v, "%d", i);
    td_metric_inc(c, (const char *[]){v}, 1);
  }
  cr_assert_eq(td_metrics_dropped(m), 5);
  cr_assert_eq(td_metric_value(c, (const char *[]){"0"}), 1);
  snprintf(v, sizeof v, "%d", TD_METRICS_MAX_SERIES);
  cr_assert_eq(td_metric_value(c, (const char *[]){v}), 0);
  td_metrics_destroy(m);
}

/* One HTTP request over a socket; the whole answer. */
static char *http(int port, const char *req) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  cr_assert_eq(write(fd, req, strlen(req)), (ssize_t)strlen(req));
  size_t cap = 1 << 16, n = 0;
  char *out = calloc(cap, 1);
  ssize_t k;
  while ((k = read(fd, out + n, cap - 1 - n)) > 0) n += (size_t)k;
  close(fd);
  return out;
}

Test(metrics, server_answers_with_the_published_text) {
  td_metrics_server *s;
  cr_assert_eq(td_metrics_server_start("no-ip", 0, &s), TD_ERR_INVALID);
  cr_assert_eq(td_metrics_server_start("127.0.0.1", 0, &s), TD_OK);
  int port = td_metrics_server_port(s);
  cr_assert_gt(port, 0);
  const char *get = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  char *a = http(port, get);
  cr_assert(strstr(a, "HTTP/1.1 200"), "%s", a);
  cr_assert(strstr(a, "Content-Type: text/plain; version=0.0.4; charset=utf-8"), "%s", a);
  free(a);
  const char *text = "# TYPE x gauge\nx 1\n";
  cr_assert_eq(td_metrics_server_publish(s, text, strlen(text)), TD_OK);
  a = http(port, get);
  cr_assert(strstr(a, "\r\n\r\n# TYPE x gauge\nx 1\n"), "%s", a);
  free(a);
  a = http(port, "GET /other HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  cr_assert(strstr(a, "HTTP/1.1 404"), "%s", a);
  free(a);
  td_metrics_server_stop(s);
}

/* /health: 200 while the owner's loop publishes, 503 before its first
 * publish and once publishing stopped for the window. */
Test(metrics, health_answers_while_the_owner_publishes) {
  td_metrics_server *s;
  cr_assert_eq(td_metrics_server_start("127.0.0.1", 0, &s), TD_OK);
  td_metrics_server_set_health_ms(s, 300);
  int port = td_metrics_server_port(s);
  const char *get = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  char *a = http(port, get);
  cr_assert(strstr(a, "HTTP/1.1 503") && strstr(a, "published nothing yet"), "%s", a);
  free(a);
  cr_assert_eq(td_metrics_server_publish(s, "x 1\n", 4), TD_OK);
  a = http(port, get);
  cr_assert(strstr(a, "HTTP/1.1 200") && strstr(a, "\r\n\r\nok\n"), "%s", a);
  free(a);
  usleep(400 * 1000);
  a = http(port, get);
  cr_assert(strstr(a, "HTTP/1.1 503") && strstr(a, "last published"), "%s", a);
  free(a);
  cr_assert_eq(td_metrics_server_publish(s, "x 2\n", 4), TD_OK);
  a = http(port, get);
  cr_assert(strstr(a, "HTTP/1.1 200"), "%s", a);
  free(a);
  a = http(port, "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nab");
  cr_assert(strstr(a, "HTTP/1.1 405"), "%s", a);
  free(a);
  td_metrics_server_stop(s);
}

typedef struct scraper {
  int port, n, ok;
} scraper;

static void *scrape_many(void *arg) {
  scraper *s = arg;
  for (int i = 0; i < s->n; i++) {
    char *a = http(s->port, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    /* always one whole published text: "v N\n" repeated, never a mix */
    char *body = strstr(a, "\r\n\r\n");
    int v = -1;
    bool whole = body && sscanf(body + 4, "v %d", &v) == 1;
    for (char *p = body ? body + 4 : NULL; whole && p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
      int w = -2;
      whole = *p == 0 || (sscanf(p, "v %d", &w) == 1 && w == v);
    }
    s->ok += whole;
    free(a);
  }
  return NULL;
}

/* Publishing while scrapes run: each scrape gets one whole text (run under
 * TSan, this is the server's race check). */
Test(metrics, scrapes_during_publishing_get_whole_texts) {
  td_metrics_server *s;
  cr_assert_eq(td_metrics_server_start("127.0.0.1", 0, &s), TD_OK);
  cr_assert_eq(td_metrics_server_publish(s, "v 0\n", 4), TD_OK);
  scraper sc = {.port = td_metrics_server_port(s), .n = 50};
  pthread_t th;
  cr_assert_eq(pthread_create(&th, NULL, scrape_many, &sc), 0);
  char text[64 * 8];
  for (int i = 1; i <= 2000; i++) {
    size_t n = 0;
    for (int k = 0; k < 64; k++) n += (size_t)snprintf(text + n, sizeof text - n, "v %d\n", i);
    cr_assert_eq(td_metrics_server_publish(s, text, n), TD_OK);
  }
  pthread_join(th, NULL);
  cr_expect_eq(sc.ok, sc.n);
  td_metrics_server_stop(s);
}
