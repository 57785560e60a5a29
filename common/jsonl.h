/* The JSON-lines request and result format shared by tandem-generate and
 * tandem-client (DESIGN.md §4). */
#ifndef TD_COMMON_JSONL_H
#define TD_COMMON_JSONL_H

#include <stddef.h>
#include <stdint.h>

#include "common/request.h"
#include "common/status.h"

typedef struct td_json_request {
  char id[256];
  int32_t *input_ids;
  int n_input;
  float *features;       /* loaded from "input_features" */
  size_t n_features;
  int32_t *prompt;
  int n_prompt;
  int32_t *stop_ids;
  int n_stop_ids;
  td_request_params params;
} td_json_request;

/* Parses one request line. Relative "input_features" paths are read from
 * base_dir. Unknown fields, wrong types and out-of-range values fail with
 * a message naming the field. The id defaults to "line-N". */
td_status td_json_request_parse(const char *line, size_t len, const char *base_dir, int line_no,
                                td_json_request *out);
void td_json_request_free(td_json_request *r);
/* One output line (no newline), malloc'ed: {"id", "outputs": [...]}, best
 * first; td_json_error_format: {"id", "error", "code"} of a failed request. */
char *td_json_result_format(const char *id, const td_seq_output *outputs, int n_outputs);
char *td_json_error_format(const char *id, td_status code, const char *msg);

#endif
