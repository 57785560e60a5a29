#include "common/cross_mode.h"

#include <string.h>

const char *td_cross_mode_name(td_cross_mode m) {
  switch (m) {
    case TD_CROSS_KV: return "kv";
    case TD_CROSS_STATES: return "states";
    case TD_CROSS_DUAL: return "dual";
    default: return "auto";
  }
}

int td_cross_mode_parse(const char *s) {
  for (int i = TD_CROSS_AUTO; s && i <= TD_CROSS_DUAL; i++)
    if (strcmp(s, td_cross_mode_name((td_cross_mode)i)) == 0) return i;
  return -1;
}
