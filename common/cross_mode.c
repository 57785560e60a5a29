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

td_status td_cross_mode_parse(const char *s, td_cross_mode *out) {
  for (int i = TD_CROSS_AUTO; s && i <= TD_CROSS_DUAL; i++)
    if (strcmp(s, td_cross_mode_name((td_cross_mode)i)) == 0) {
      *out = (td_cross_mode)i;
      return TD_OK;
    }
  return td_err(TD_ERR_INVALID, "--cross-mode %s: want auto, kv, states or dual", s ? s : "(none)");
}

bool td_cross_pushes_states(td_cross_mode m, bool transfer_kv) {
  return !transfer_kv && (m == TD_CROSS_AUTO || m == TD_CROSS_STATES);
}
