#include "common/clock.h"

#include <time.h>

int64_t td_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int64_t td_now_ms(void) { return td_now_ns() / 1000000LL; }

int64_t td_wall_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000LL + ts.tv_nsec / 1000000LL;
}
