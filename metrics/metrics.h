/* Metrics in Prometheus' text exposition format 0.0.4: counters, gauges and
 * histograms with labels (td_metrics), and an HTTP server of /metrics that
 * serves the last text its owner published (td_metrics_server).
 *
 * A registry and its families are single-threaded (the owner's loop
 * thread). The server runs libmicrohttpd in its own thread and reads only
 * the published text, under its lock, so the owner's loop never waits on a
 * scrape and a scrape never sees the registry mid-update (docs/metrics.md). */
#ifndef TD_METRICS_METRICS_H
#define TD_METRICS_METRICS_H

#include <stddef.h>

#include "common/status.h"

typedef struct td_metrics td_metrics;
typedef struct td_metric td_metric; /* a family: one name, its label names, its series */

typedef enum td_metric_type { TD_METRIC_COUNTER, TD_METRIC_GAUGE, TD_METRIC_HISTOGRAM } td_metric_type;

td_status td_metrics_create(td_metrics **out);
void td_metrics_destroy(td_metrics *m);

/* Adds a family, rendered in the order added. labels: n_labels names (at
 * most TD_METRICS_MAX_LABELS), copied; bounds (histograms only): n_bounds
 * finite upper bounds, increasing, copied (+Inf is implied). The name and
 * label names must be valid Prometheus names (checked: TD_ERR_INVALID). */
td_status td_metrics_add(td_metrics *m, td_metric_type type, const char *name, const char *help,
                         const char *const *labels, int n_labels, const double *bounds, int n_bounds,
                         td_metric **out);

/* The series of these label values (n_labels of them, any bytes; NULL with
 * no labels). A series is made at its first use; past
 * TD_METRICS_MAX_SERIES series in a family (or out of memory) new ones are
 * dropped and counted in td_metrics_dropped, so metrics never fail the
 * caller's work. */
void td_metric_inc(td_metric *f, const char *const *values, double v);     /* counter, gauge: += v */
/* gauge; or a counter that mirrors a count kept elsewhere (a peer's) */
void td_metric_set(td_metric *f, const char *const *values, double v);
void td_metric_observe(td_metric *f, const char *const *values, double v); /* histogram */
/* Makes the series (at 0) so that it shows before its first event. */
void td_metric_touch(td_metric *f, const char *const *values);
/* Forgets every series of the family (gauges rebuilt from current state). */
void td_metric_clear(td_metric *f);
/* A series' value (counter, gauge) or count (histogram); 0 when absent. */
double td_metric_value(td_metric *f, const char *const *values);
long long td_metrics_dropped(const td_metrics *m);

/* The exposition text of every family (malloc'ed, NUL-terminated; *len
 * without the NUL). Label values are escaped (\\, \", \n), HELP text too
 * (\\, \n); histograms as _bucket{le="..."} (cumulative, "+Inf" last),
 * _sum and _count. */
td_status td_metrics_render(const td_metrics *m, char **text, size_t *len);

/* ---- the /metrics HTTP server */
typedef struct td_metrics_server td_metrics_server;

/* Listens on host (IPv4) and port (0: any free port) and answers GET
 * /metrics with the last published text, and GET /health with 200 while
 * the owner published within TD_METRICS_HEALTH_STALE_MS (its loop is
 * alive; 503 else: probes restart a stuck process), 404 elsewhere, 405 for
 * other methods. */
td_status td_metrics_server_start(const char *host, int port, td_metrics_server **out);
/* The port it listens on. */
int td_metrics_server_port(const td_metrics_server *s);
/* How recent a publish keeps /health at 200 (before any scrape; <= 0: the default). */
void td_metrics_server_set_health_ms(td_metrics_server *s, int ms);
/* Replaces the text scrapes get (copied). */
td_status td_metrics_server_publish(td_metrics_server *s, const char *text, size_t len);
void td_metrics_server_stop(td_metrics_server *s);

#endif
