#include "common/log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

static int level = TD_LOG_INFO;
static char name[32] = "tandem";
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

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
  pthread_mutex_lock(&lock);
  fprintf(stderr, "%02d:%02d:%02d.%03ld %c %s[%d] %s:%d %s\n", tm.tm_hour, tm.tm_min, tm.tm_sec,
          ts.tv_nsec / 1000000, tags[l], name, (int)getpid(), base, line, msg);
  pthread_mutex_unlock(&lock);
}
