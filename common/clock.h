/* Monotonic and wall clocks. */
#ifndef TD_COMMON_CLOCK_H
#define TD_COMMON_CLOCK_H
#include <stdint.h>
int64_t td_now_ns(void);   /* monotonic */
int64_t td_now_ms(void);   /* monotonic */
int64_t td_wall_ms(void);  /* since the epoch */
#endif
