#include "common/request.h"

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
