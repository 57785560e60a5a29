/* Request lines with text and audio (common/jsonl.c): exactly one input,
 * the audio options only with audio, every limit, and result lines with
 * text. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/defaults.h"
#include "common/jsonl.h"

#define WAV TD_TEST_DATA "/audio/toy-numbers-whisper/number-7.wav"

static void expect_bad(const char *line, const char *says) {
  td_json_request r;
  cr_expect_neq(td_json_request_parse(line, strlen(line), TD_TEST_DATA, 1, &r), TD_OK, "accepted: %s", line);
  cr_expect(strstr(td_errmsg(), says), "%s: \"%s\" does not say \"%s\"", line, td_errmsg(), says);
}

Test(request_lines, text_and_audio) {
  td_json_request r;
  const char *t = "{\"id\": \"q\", \"text\": \"forty two\", \"max_new_tokens\": 8}";
  cr_assert_eq(td_json_request_parse(t, strlen(t), NULL, 1, &r), TD_OK, "%s", td_errmsg());
  cr_expect_str_eq(r.text, "forty two");
  cr_expect(!r.input_ids && !r.audio);
  td_json_request_free(&r);
  const char *a = "{\"audio\": \"audio/toy-numbers-whisper/number-7.wav\", \"language\": \"en\", \"task\": \"translate\","
                  " \"timestamps\": true}";
  cr_assert_eq(td_json_request_parse(a, strlen(a), TD_TEST_DATA, 1, &r), TD_OK, "%s", td_errmsg());
  cr_expect(r.audio && r.audio_len > 44 && !memcmp(r.audio, "RIFF", 4));
  cr_expect_str_eq(r.language, "en");
  cr_expect_str_eq(r.task, "translate");
  cr_expect(r.timestamps);
  td_json_request_free(&r);
}

Test(request_lines, refusals) {
  expect_bad("{\"text\": \"seven\", \"input_ids\": [1]}", "exactly one of");
  expect_bad("{\"text\": \"seven\", \"audio\": \"" WAV "\"}", "exactly one of");
  expect_bad("{\"id\": \"x\"}", "got none");
  expect_bad("{\"text\": \"\"}", "\"text\" is empty");
  expect_bad("{\"text\": 42}", "\"text\" must be a string");
  expect_bad("{\"text\": \"seven\", \"language\": \"en\"}", "go with \"audio\"");
  expect_bad("{\"input_ids\": [1], \"timestamps\": true}", "go with \"audio\"");
  expect_bad("{\"audio\": \"" WAV "\", \"task\": \"summarize\"}", "\"task\" must be");
  expect_bad("{\"audio\": \"no-such-file.wav\"}", "no-such-file.wav");
  expect_bad("{\"input_ids\": [1], \"probe_token_id\": 5}", "go together");
  expect_bad("{\"input_ids\": [1], \"probe_position\": 0}", "go together");
  expect_bad("{\"input_ids\": [1], \"probe_token_id\": -1, \"probe_position\": 0}", "must be at least 0");
  expect_bad("{\"audio\": \"" WAV "\", \"language\": \"a-language-code-longer-than-31-bytes\"}", "\"language\" is longer than 31 bytes");
  /* a text past the limit */
  size_t n = TD_MAX_TEXT_BYTES + 1;
  char *line = malloc(n + 32);
  strcpy(line, "{\"text\": \"");
  memset(line + 10, 'a', n);
  strcpy(line + 10 + n, "\"}");
  expect_bad(line, "exceeds the limit");
  free(line);
  /* an audio file past the limit (sparse) */
  char path[] = "/tmp/td-lines-XXXXXX";
  int fd = mkstemp(path);
  cr_assert(fd >= 0);
  cr_assert_eq(ftruncate(fd, (off_t)TD_MAX_AUDIO_BYTES + 1), 0);
  close(fd);
  char big[128];
  snprintf(big, sizeof big, "{\"audio\": \"%s\"}", path);
  expect_bad(big, "bytes (1 to");
  unlink(path);
}

Test(request_lines, results_with_text) {
  int32_t toks[3] = {6, 18, 1};
  td_seq_output o[2] = {{.tokens = toks, .n_tokens = 3, .finish = TD_FINISH_STOP, .text = "4\"2\n"},
                        {.tokens = toks, .n_tokens = 1, .finish = TD_FINISH_LENGTH}};
  char *s = td_json_result_format("q", o, 2);
  cr_assert(s);
  cr_expect(strstr(s, "\"tokens\":[6,18,1],\"text\":\"4\\\"2\\n\""), "%s", s);
  /* the second output has no text: no "text" key */
  const char *second = strstr(s, "},{");
  cr_assert(second, "%s", s);
  cr_expect(!strstr(second, "\"text\""), "%s", s);
  free(s);
}

Test(request_lines, probe) {
  td_json_request r;
  const char *t = "{\"input_ids\": [1], \"decoder_prompt\": [0, 7], \"probe_token_id\": 5, \"probe_position\": 1}";
  cr_assert_eq(td_json_request_parse(t, strlen(t), NULL, 1, &r), TD_OK, "%s", td_errmsg());
  cr_expect(r.params.probe);
  cr_expect_eq(r.params.probe_token, 5);
  cr_expect_eq(r.params.probe_position, 1);
  td_json_request_free(&r);
  int32_t toks[1] = {6};
  td_seq_output o = {.tokens = toks, .n_tokens = 1, .finish = TD_FINISH_STOP, .has_probe = true, .probe_prob = 0.25};
  char *s = td_json_result_format("q", &o, 1);
  cr_assert(s);
  cr_expect(strstr(s, "\"probe_prob\":0.25"), "%s", s);
  free(s);
}

/* Long-form settings go with audio: numbers, null turns a threshold off. */
Test(request_lines, longform_settings) {
  td_json_request r;
  const char *a = "{\"audio\": \"" WAV "\", \"temperature_increment_on_fallback\": 0, \"compression_ratio_threshold\": null,"
                  " \"logprob_threshold\": -0.5, \"condition_on_previous_text\": false}";
  cr_assert_eq(td_json_request_parse(a, strlen(a), NULL, 1, &r), TD_OK, "%s", td_errmsg());
  const td_longform_settings *s = &r.longform;
  cr_expect(s->temperature_increment.given && !s->temperature_increment.off && s->temperature_increment.v == 0);
  cr_expect(s->compression_ratio_threshold.given && s->compression_ratio_threshold.off);
  cr_expect(s->logprob_threshold.given && s->logprob_threshold.v == -0.5);
  cr_expect(!s->no_speech_threshold.given);
  cr_expect(s->condition_given && !s->condition_on_previous_text);
  td_json_request_free(&r);
  expect_bad("{\"input_ids\": [1], \"no_speech_threshold\": 0.5}", "go with \"audio\"");
  expect_bad("{\"audio\": \"" WAV "\", \"logprob_threshold\": \"low\"}", "\"logprob_threshold\" must be a number or null");
  expect_bad("{\"audio\": \"" WAV "\", \"temperature_increment_on_fallback\": null}", "must be a number");
  expect_bad("{\"audio\": \"" WAV "\", \"condition_on_previous_text\": 1}", "condition_on_previous_text");
}
