#include "bench_util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

void td_sbuf_printf(td_sbuf *b, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int need = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (need < 0) return;
  if (b->n + (size_t)need + 1 > b->cap) {
    size_t nc = b->cap ? b->cap : 256;
    while (nc < b->n + (size_t)need + 1) nc *= 2;
    char *p = realloc(b->s, nc);
    if (!p) return;
    b->s = p;
    b->cap = nc;
  }
  va_start(ap, fmt);
  vsnprintf(b->s + b->n, b->cap - b->n, fmt, ap);
  va_end(ap);
  b->n += (size_t)need;
}

void td_sbuf_free(td_sbuf *b) {
  free(b->s);
  memset(b, 0, sizeof *b);
}

const char *td_bench_cpu_name(void) {
  static char name[256];
  if (name[0]) return name;
  FILE *f = fopen("/proc/cpuinfo", "r");
  char line[512];
  snprintf(name, sizeof name, "cpu");
  while (f && fgets(line, sizeof line, f)) {
    if (!strncmp(line, "model name", 10)) {
      char *c = strchr(line, ':');
      if (c) {
        c += 2;
        c[strcspn(c, "\n")] = 0;
        snprintf(name, sizeof name, "%s x%ld", c, sysconf(_SC_NPROCESSORS_ONLN));
      }
      break;
    }
  }
  if (f) fclose(f);
  return name;
}

const char *td_bench_commit(const td_bench_out *o) {
  if (o->commit && *o->commit) return o->commit;
  static char c[64];
  if (c[0]) return c;
  FILE *p = popen("git -C " TD_SOURCE_DIR " rev-parse --short HEAD 2>/dev/null", "r");
  if (p) {
    if (fgets(c, sizeof c, p)) c[strcspn(c, "\n")] = 0;
    pclose(p);
  }
  if (!c[0]) snprintf(c, sizeof c, "%s", TD_BUILD_COMMIT);
  return c;
}

int td_bench_record(const td_bench_out *o, const char *title, const char *device, const char *body) {
  const char *path = o->results;
  char def[1024];
  if (!path || !*path) {
    snprintf(def, sizeof def, "%s/bench/RESULTS.md", TD_SOURCE_DIR);
    path = def;
  }
  FILE *f = fopen(path, "a");
  if (!f) {
    fprintf(stderr, "cannot append to %s\n", path);
    return -1;
  }
  time_t t = time(NULL);
  struct tm tm;
  gmtime_r(&t, &tm);
  char date[32];
  strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", &tm);
  fprintf(f, "\n## %s\n\n%s · %s · commit %s\n\n%s\n", title, date, device, td_bench_commit(o), body);
  fclose(f);
  printf("appended to %s\n", path);
  return 0;
}
