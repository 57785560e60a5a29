/* The registry and the text exposition format 0.0.4
 * (https://prometheus.io/docs/instrumenting/exposition_formats/). A series
 * is found by its label values joined with a byte no label name holds, in a
 * hash; families and series render in the order they were made. */
#include <ctype.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <uthash.h>

#include "common/defaults.h"
#include "metrics/metrics.h"

typedef struct series {
  char *key;      /* the label values, each followed by '\xff' */
  char **values;  /* n_labels of them */
  double v;       /* counter, gauge */
  double *counts; /* histogram: per bucket, not cumulative; the last is +Inf's */
  double sum, count;
  UT_hash_handle hh;
} series;

struct td_metric {
  td_metrics *owner;
  td_metric_type type;
  char *name, *help;
  char *labels[TD_METRICS_MAX_LABELS];
  int n_labels;
  double *bounds;
  int n_bounds;
  int n_series;
  series *by_key;
  td_metric *next;
};

struct td_metrics {
  td_metric *first, *last;
  long long dropped;
};

td_status td_metrics_create(td_metrics **out) {
  *out = calloc(1, sizeof **out);
  return *out ? TD_OK : td_err(TD_ERR_NOMEM, "out of memory");
}

static void series_free(series *s, int n_labels) {
  for (int i = 0; s->values && i < n_labels; i++) free(s->values[i]);
  free(s->values);
  free(s->counts);
  free(s->key);
  free(s);
}

void td_metric_clear(td_metric *f) {
  series *s, *t;
  HASH_ITER(hh, f->by_key, s, t) {
    HASH_DEL(f->by_key, s);
    series_free(s, f->n_labels);
  }
  f->n_series = 0;
}

void td_metrics_destroy(td_metrics *m) {
  if (!m) return;
  for (td_metric *f = m->first, *n; f; f = n) {
    n = f->next;
    td_metric_clear(f);
    for (int i = 0; i < f->n_labels; i++) free(f->labels[i]);
    free(f->bounds);
    free(f->name);
    free(f->help);
    free(f);
  }
  free(m);
}

/* [a-zA-Z_:][a-zA-Z0-9_:]* (label names: no ':'; "le" is the histogram's) */
static bool valid_name(const char *s, bool label) {
  if (!s || !*s || isdigit((unsigned char)*s)) return false;
  for (; *s; s++)
    if (!isalnum((unsigned char)*s) && *s != '_' && (label || *s != ':')) return false;
  return true;
}

td_status td_metrics_add(td_metrics *m, td_metric_type type, const char *name, const char *help,
                         const char *const *labels, int n_labels, const double *bounds, int n_bounds,
                         td_metric **out) {
  *out = NULL;
  if (!valid_name(name, false)) return td_err(TD_ERR_INVALID, "metrics: bad name %s", name ? name : "(null)");
  if (n_labels < 0 || n_labels > TD_METRICS_MAX_LABELS)
    return td_err(TD_ERR_INVALID, "metrics: %s: %d labels (at most %d)", name, n_labels, TD_METRICS_MAX_LABELS);
  for (int i = 0; i < n_labels; i++)
    if (!valid_name(labels[i], true) || (type == TD_METRIC_HISTOGRAM && !strcmp(labels[i], "le")))
      return td_err(TD_ERR_INVALID, "metrics: %s: bad label name %s", name, labels[i] ? labels[i] : "(null)");
  if (type == TD_METRIC_HISTOGRAM) {
    if (n_bounds < 1) return td_err(TD_ERR_INVALID, "metrics: histogram %s without buckets", name);
    for (int i = 0; i < n_bounds; i++)
      if (!isfinite(bounds[i]) || (i && bounds[i] <= bounds[i - 1]))
        return td_err(TD_ERR_INVALID, "metrics: histogram %s: buckets not finite and increasing", name);
  } else {
    n_bounds = 0;
  }
  td_metric *f = calloc(1, sizeof *f);
  if (!f) return td_err(TD_ERR_NOMEM, "out of memory");
  f->owner = m;
  f->type = type;
  bool ok = (f->name = strdup(name)) && (f->help = strdup(help ? help : ""));
  for (int i = 0; ok && i < n_labels; i++) ok = (f->labels[f->n_labels++] = strdup(labels[i])) != NULL;
  if (ok && n_bounds) {
    ok = (f->bounds = malloc((size_t)n_bounds * sizeof *f->bounds)) != NULL;
    if (ok) memcpy(f->bounds, bounds, (size_t)n_bounds * sizeof *f->bounds);
    f->n_bounds = n_bounds;
  }
  if (!ok) {
    for (int i = 0; i < f->n_labels; i++) free(f->labels[i]);
    free(f->bounds);
    free(f->name);
    free(f->help);
    free(f);
    return td_err(TD_ERR_NOMEM, "out of memory");
  }
  if (m->last)
    m->last->next = f;
  else
    m->first = f;
  m->last = f;
  *out = f;
  return TD_OK;
}

static char *join_key(const td_metric *f, const char *const *values) {
  size_t n = 1;
  for (int i = 0; i < f->n_labels; i++) n += strlen(values[i]) + 1;
  char *k = malloc(n), *p = k;
  if (!k) return NULL;
  for (int i = 0; i < f->n_labels; i++) {
    size_t l = strlen(values[i]);
    memcpy(p, values[i], l);
    p[l] = '\xff'; /* never in UTF-8 text */
    p += l + 1;
  }
  *p = 0;
  return k;
}

static series *find(td_metric *f, const char *const *values, bool make) {
  char *k = join_key(f, values);
  if (!k) {
    f->owner->dropped++;
    return NULL;
  }
  series *s = NULL;
  HASH_FIND_STR(f->by_key, k, s);
  if (s || !make) {
    free(k);
    return s;
  }
  if (f->n_series >= TD_METRICS_MAX_SERIES || !(s = calloc(1, sizeof *s))) {
    free(k);
    f->owner->dropped++;
    return NULL;
  }
  s->key = k;
  bool ok = (s->values = calloc((size_t)(f->n_labels ? f->n_labels : 1), sizeof *s->values)) != NULL;
  for (int i = 0; ok && i < f->n_labels; i++) ok = (s->values[i] = strdup(values[i])) != NULL;
  if (ok && f->type == TD_METRIC_HISTOGRAM) ok = (s->counts = calloc((size_t)f->n_bounds + 1, sizeof *s->counts));
  if (!ok) {
    series_free(s, f->n_labels);
    f->owner->dropped++;
    return NULL;
  }
  HASH_ADD_KEYPTR(hh, f->by_key, s->key, strlen(s->key), s);
  f->n_series++;
  return s;
}

void td_metric_inc(td_metric *f, const char *const *values, double v) {
  series *s = f->type != TD_METRIC_HISTOGRAM ? find(f, values, true) : NULL;
  if (s) s->v += v;
}

void td_metric_set(td_metric *f, const char *const *values, double v) {
  series *s = f->type != TD_METRIC_HISTOGRAM ? find(f, values, true) : NULL;
  if (s) s->v = v;
}

void td_metric_observe(td_metric *f, const char *const *values, double v) {
  series *s = f->type == TD_METRIC_HISTOGRAM ? find(f, values, true) : NULL;
  if (!s) return;
  int b = 0;
  while (b < f->n_bounds && !(v <= f->bounds[b])) b++; /* NaN lands in +Inf */
  s->counts[b]++;
  s->sum += v;
  s->count++;
}

void td_metric_touch(td_metric *f, const char *const *values) { (void)find(f, values, true); }

double td_metric_value(td_metric *f, const char *const *values) {
  series *s = find(f, values, false);
  return !s ? 0 : f->type == TD_METRIC_HISTOGRAM ? s->count : s->v;
}

long long td_metrics_dropped(const td_metrics *m) { return m->dropped; }

/* ------------------------------------------------------------ rendering */

typedef struct buf {
  char *p;
  size_t n, cap;
  bool failed;
} buf;

static void put(buf *b, const char *s, size_t n) {
  if (b->failed) return;
  if (b->n + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 4096;
    while (b->n + n + 1 > cap) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
      b->failed = true;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
  memcpy(b->p + b->n, s, n);
  b->n += n;
  b->p[b->n] = 0;
}

static void puts_(buf *b, const char *s) { put(b, s, strlen(s)); }

/* label values: \\, \" and \n escaped; HELP text: \\ and \n */
static void put_escaped(buf *b, const char *s, bool quote) {
  for (; *s; s++) {
    if (*s == '\\')
      puts_(b, "\\\\");
    else if (*s == '\n')
      puts_(b, "\\n");
    else if (*s == '"' && quote)
      puts_(b, "\\\"");
    else
      put(b, s, 1);
  }
}

/* The shortest text that reads back as the same double (Go's ParseFloat,
 * as Prometheus reads it); integers without an exponent where exact. */
static void put_double(buf *b, double v) {
  char t[40];
  if (isnan(v))
    snprintf(t, sizeof t, "NaN");
  else if (isinf(v))
    snprintf(t, sizeof t, v > 0 ? "+Inf" : "-Inf");
  else if (v == floor(v) && fabs(v) < 1e15)
    snprintf(t, sizeof t, "%.0f", v);
  else
    for (int p = 1; p <= 17; p++) {
      snprintf(t, sizeof t, "%.*g", p, v);
      if (strtod(t, NULL) == v) break;
    }
  puts_(b, t);
}

/* {a="x",b="y"} with an optional extra le="..." (NULL: none); nothing for no labels */
static void put_labels(buf *b, const td_metric *f, const series *s, const char *le) {
  if (!f->n_labels && !le) return;
  puts_(b, "{");
  for (int i = 0; i < f->n_labels; i++) {
    if (i) puts_(b, ",");
    puts_(b, f->labels[i]);
    puts_(b, "=\"");
    put_escaped(b, s->values[i], true);
    puts_(b, "\"");
  }
  if (le) {
    if (f->n_labels) puts_(b, ",");
    puts_(b, "le=\"");
    puts_(b, le);
    puts_(b, "\"");
  }
  puts_(b, "}");
}

static void put_sample(buf *b, const td_metric *f, const series *s, const char *suffix, const char *le, double v) {
  puts_(b, f->name);
  puts_(b, suffix);
  put_labels(b, f, s, le);
  puts_(b, " ");
  put_double(b, v);
  puts_(b, "\n");
}

td_status td_metrics_render(const td_metrics *m, char **text, size_t *len) {
  static const char *const types[] = {"counter", "gauge", "histogram"};
  buf b = {0};
  puts_(&b, ""); /* an empty registry renders "" */
  for (const td_metric *f = m->first; f; f = f->next) {
    puts_(&b, "# HELP ");
    puts_(&b, f->name);
    puts_(&b, " ");
    put_escaped(&b, f->help, false);
    puts_(&b, "\n# TYPE ");
    puts_(&b, f->name);
    puts_(&b, " ");
    puts_(&b, types[f->type]);
    puts_(&b, "\n");
    for (const series *s = f->by_key; s; s = s->hh.next) {
      if (f->type != TD_METRIC_HISTOGRAM) {
        put_sample(&b, f, s, "", NULL, s->v);
        continue;
      }
      double cum = 0;
      for (int i = 0; i <= f->n_bounds; i++) {
        cum += s->counts[i];
        buf le = {0};
        if (i < f->n_bounds)
          put_double(&le, f->bounds[i]);
        else
          puts_(&le, "+Inf");
        if (le.failed) b.failed = true;
        put_sample(&b, f, s, "_bucket", le.p ? le.p : "", cum);
        free(le.p);
      }
      put_sample(&b, f, s, "_sum", NULL, s->sum);
      put_sample(&b, f, s, "_count", NULL, s->count);
    }
  }
  if (b.failed) {
    free(b.p);
    return td_err(TD_ERR_NOMEM, "out of memory");
  }
  *text = b.p;
  *len = b.n;
  return TD_OK;
}
