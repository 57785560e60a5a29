#include "common/request.h"

#include <math.h>
#include <string.h>

const char *td_finish_name(td_finish f) {
  switch (f) {
    case TD_FINISH_STOP: return "stop";
    case TD_FINISH_LENGTH: return "length";
    case TD_FINISH_CANCELLED: return "cancelled";
    case TD_FINISH_ERROR: return "error";
    default: return "none";
  }
}

void td_request_params_default(td_request_params *p) {
  memset(p, 0, sizeof *p);
  p->top_p = 1.0f;
  p->n = 1;
  p->num_beams = 1;
  p->num_return_sequences = 0;
  p->length_penalty = 1.0f;
  p->early_stopping = 0;
  p->forced_bos = -2;
  p->forced_eos = -2;
  p->max_initial_timestamp = -1;
}

size_t td_first_nonfinite(const float *v, size_t n) {
  enum { BLOCK = 1024 };
  size_t i = 0;
  for (; i + BLOCK <= n; i += BLOCK) {
    uint32_t bad = 0; /* an all-ones exponent: NaN or infinity */
    for (size_t j = 0; j < BLOCK; j++) {
      uint32_t b;
      memcpy(&b, v + i + j, sizeof b);
      bad |= (b & 0x7f800000u) == 0x7f800000u;
    }
    if (bad) break;
  }
  for (; i < n; i++)
    if (!isfinite(v[i])) return i;
  return n;
}
