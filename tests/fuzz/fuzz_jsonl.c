/* libFuzzer target: one request line of tandem-generate / tandem-client
 * (td_json_request_parse), relative file names read from a private
 * temporary folder holding f.f32 (four floats) and a.wav (a few bytes),
 * then the error line formatted with the request's id
 * (td_json_error_format), as the tools do for a refused line. Any bytes: a
 * request or a refusal naming the field, never a crash or a leak. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/jsonl.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char dir[64], f32[96], wav[96];

static void put(const char *path, const void *p, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(p, 1, n, f) != n || fclose(f) != 0) abort();
}

static void cleanup(void) {
  unlink(f32);
  unlink(wav);
  rmdir(dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  const char *tmp = getenv("TMPDIR");
  snprintf(dir, sizeof dir, "%s/fuzz_jsonl.XXXXXX", tmp && *tmp && strlen(tmp) < 40 ? tmp : "/tmp");
  if (!mkdtemp(dir)) abort();
  snprintf(f32, sizeof f32, "%s/f.f32", dir);
  snprintf(wav, sizeof wav, "%s/a.wav", dir);
  atexit(cleanup);
  const float v[4] = {0.5f, -1.0f, 2.0f, 0.0f};
  put(f32, v, sizeof v);
  put(wav, "RIFF\0\0\0\0WAVE", 12);
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  td_json_request r;
  td_status s = td_json_request_parse((const char *)data, size, dir, 7, &r);
  if (!memchr(r.id, 0, sizeof r.id)) abort(); /* the id is a C string either way */
  if (s == TD_OK) {
    int inputs = (r.input_ids != NULL) + (r.features != NULL) + (r.text != NULL) + (r.audio != NULL);
    if (inputs != 1 || (r.input_ids && r.n_input < 1) || (r.n_prompt && !r.prompt)) abort();
    td_json_request_free(&r);
  }
  char *line = td_json_error_format(r.id, s == TD_OK ? TD_ERR_INVALID : s, td_errmsg());
  free(line);
  return 0;
}
