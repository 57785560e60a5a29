/* The JSON-lines request and result format shared by tandem-generate and
 * tandem-client (DESIGN.md §4). */
#ifndef TD_COMMON_JSONL_H
#define TD_COMMON_JSONL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/defaults.h"
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
  char *text;            /* "text": UTF-8, to be tokenized (NULL when absent) */
  uint8_t *audio;        /* "audio": the bytes of the file it names (WAV / FLAC / OGG) */
  size_t audio_len;
  char language[TD_MAX_LANGUAGE_BYTES + 1]; /* "language" (audio): Whisper's code, "" for the default */
  char task[16];         /* "task" (audio): "transcribe" or "translate", "" for the default */
  bool timestamps;       /* "timestamps" (audio) */
  td_longform_settings longform; /* audio past the model's window: "temperature_increment_on_fallback",
                                    "compression_ratio_threshold", "logprob_threshold", "no_speech_threshold"
                                    (a number, or null: off), "condition_on_previous_text" */
  td_request_params params;
} td_json_request;

/* Parses one request line. Relative "input_features" and "audio" paths are
 * read from base_dir. Exactly one input: "input_ids", "input_features",
 * "text" or "audio" (at most TD_MAX_TEXT_BYTES / TD_MAX_AUDIO_BYTES).
 * Unknown fields, wrong types and out-of-range values fail with a message
 * naming the field. The id defaults to "line-N". */
td_status td_json_request_parse(const char *line, size_t len, const char *base_dir, int line_no,
                                td_json_request *out);
void td_json_request_free(td_json_request *r);
/* One output line (no newline), malloc'ed: {"id", "outputs": [...]}, best
 * first, each with "text" where the output has it; td_json_error_format: {"id", "error", "code"} of a failed request. */
char *td_json_result_format(const char *id, const td_seq_output *outputs, int n_outputs);
char *td_json_error_format(const char *id, td_status code, const char *msg);

#endif
