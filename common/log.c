#include "common/log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

static int level = TD_LOG_INFO;
static int format = TD_LOG_TEXT;
static FILE *out; /* NULL: stderr */
static char name[32] = "tandem";
static _Thread_local char request[96];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

void td_log_set_format(td_log_format f) { format = (int)f; }

int td_log_parse_format(const char *s) {
  if (s && !strcasecmp(s, "text")) return TD_LOG_TEXT;
  if (s && !strcasecmp(s, "json")) return TD_LOG_JSON;
  return -1;
}

void td_log_set_file(FILE *f) { out = f; }

void td_log_set_request(const char *id) { snprintf(request, sizeof request, "%s", id ? id : ""); }
const char *td_log_get_request(void) { return request; }

/* {"time", "level", "proc", "pid", "src", "msg"[, "request"]}: cJSON escapes */
static char *json_line(const struct tm *tm, long ms, td_log_level l, const char *src, const char *msg) {
  static const char *const levels[] = {"debug", "info", "warn", "error"};
  char t[64], where[160];
  snprintf(t, sizeof t, "%04d-%02d-%02dT%02d:%02d:%02d.%03ld", tm->tm_year + 1900, tm->tm_mon + 1, tm->tm_mday,
           tm->tm_hour, tm->tm_min, tm->tm_sec, ms);
  snprintf(where, sizeof where, "%s", src);
  cJSON *o = cJSON_CreateObject();
  if (!o) return NULL;
  cJSON_AddStringToObject(o, "time", t);
  cJSON_AddStringToObject(o, "level", levels[l]);
  cJSON_AddStringToObject(o, "proc", name);
  cJSON_AddNumberToObject(o, "pid", (double)getpid());
  cJSON_AddStringToObject(o, "src", where);
  cJSON_AddStringToObject(o, "msg", msg);
  if (request[0]) cJSON_AddStringToObject(o, "request", request);
  char *s = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  return s;
}

int td_log_parse_level(const char *s) {
  static const char *const names[] = {"debug", "info", "warn", "error", "off"};
  for (int i = 0; i < 5; i++)
    if (s && strcasecmp(s, names[i]) == 0) return i;
  return -1;
}

td_log_level td_log_get_level(void) { return (td_log_level)level; }

void td_log_set_level(td_log_level l) { level = (int)l; }

void td_log_set_name(const char *n) { snprintf(name, sizeof name, "%s", n); }

void td_log_write(td_log_level l, const char *file, int line, const char *fmt, ...) {
  if ((int)l < (int)td_log_get_level()) return;
  static const char tags[] = "DIWE";
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  localtime_r(&ts.tv_sec, &tm);
  const char *base = strrchr(file, '/');
  base = base ? base + 1 : file;
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  FILE *f = out ? out : stderr;
  if (format == TD_LOG_JSON) {
    char src[160];
    snprintf(src, sizeof src, "%s:%d", base, line);
    char *js = json_line(&tm, ts.tv_nsec / 1000000, l, src, msg);
    if (js) {
      pthread_mutex_lock(&lock);
      fprintf(f, "%s\n", js);
      fflush(f);
      pthread_mutex_unlock(&lock);
      cJSON_free(js);
      return;
    }
    /* out of memory: the text line below still says it */
  }
  pthread_mutex_lock(&lock);
  fprintf(f, "%02d:%02d:%02d.%03ld %c %s[%d] %s:%d %s\n", tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000,
          tags[l], name, (int)getpid(), base, line, msg);
  pthread_mutex_unlock(&lock);
}
