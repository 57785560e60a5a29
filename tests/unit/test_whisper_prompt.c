/* Whisper's decoder prompt (td_whisper_prompt): the ids transformers'
 * WhisperForConditionalGeneration.generate puts first, from the tokenizer
 * or generation_config.json, and a clear refusal of every bad option. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "frontend/tokenizer.h"

#define WHISPER TD_TEST_DATA "/tokenizers/whisper-large-v3"
enum { SOT = 50258, EN = 50259, DE = 50261, TRANSLATE = 50359, TRANSCRIBE = 50360, NO_TS = 50364 };

static td_tokenizer *tok;
static char dir[64];

static void setup(void) {
  cr_assert_eq(td_tokenizer_load(WHISPER, NULL, &tok), TD_OK, "%s", td_errmsg());
  snprintf(dir, sizeof dir, "/tmp/td-whisper-XXXXXX");
  cr_assert(mkdtemp(dir));
}

static void teardown(void) {
  char p[128];
  snprintf(p, sizeof p, "%s/generation_config.json", dir);
  unlink(p);
  rmdir(dir);
  td_tokenizer_destroy(tok);
}

TestSuite(whisper_prompt, .init = setup, .fini = teardown);

static void gen_config(const char *text) {
  char p[128];
  snprintf(p, sizeof p, "%s/generation_config.json", dir);
  FILE *f = fopen(p, "w");
  cr_assert(f);
  fputs(text, f);
  fclose(f);
}

static void expect_prompt(const td_whisper_prompt *w, const char *lang, const char *task, bool ts, const int32_t *want,
                          int n_want) {
  int32_t out[TD_WHISPER_PROMPT_MAX];
  int n = -1;
  cr_assert_eq(td_whisper_prompt_build(w, lang, task, ts, out, &n), TD_OK, "%s", td_errmsg());
  cr_assert_eq(n, n_want, "%s/%s: %d ids", lang, task, n);
  for (int i = 0; i < n; i++) cr_expect_eq(out[i], want[i], "%s/%s: id %d is %d, want %d", lang, task, i, out[i], want[i]);
}

static void expect_refused(const td_whisper_prompt *w, const char *lang, const char *task, const char *says) {
  int32_t out[TD_WHISPER_PROMPT_MAX];
  int n;
  cr_expect_eq(td_whisper_prompt_build(w, lang, task, false, out, &n), TD_ERR_INVALID, "%s/%s accepted", lang, task);
  cr_expect(strstr(td_errmsg(), says), "\"%s\" does not say \"%s\"", td_errmsg(), says);
}

Test(whisper_prompt, from_the_tokenizer) {
  td_whisper_prompt *w;
  cr_assert_eq(td_whisper_prompt_load(dir, tok, &w), TD_OK, "%s", td_errmsg());
  expect_prompt(w, "en", NULL, false, (int32_t[]){SOT, EN, TRANSCRIBE, NO_TS}, 4);
  expect_prompt(w, "EN", "transcribe", false, (int32_t[]){SOT, EN, TRANSCRIBE, NO_TS}, 4);
  expect_prompt(w, "<|de|>", "translate", false, (int32_t[]){SOT, DE, TRANSLATE, NO_TS}, 4);
  expect_prompt(w, "de", "", true, (int32_t[]){SOT, DE, TRANSCRIBE}, 3);
  int32_t out[TD_WHISPER_PROMPT_MAX];
  int n;
  cr_expect_eq(td_whisper_prompt_build(w, NULL, NULL, false, out, &n), TD_ERR_NOT_FOUND, "no language: detect it");
  cr_expect_eq(td_whisper_prompt_build(w, "", "translate", false, out, &n), TD_ERR_NOT_FOUND);
  cr_expect(strstr(td_errmsg(), "give one (e.g. \"en\") or detect it"), "%s", td_errmsg());
  /* the languages: the tokens between <|startoftranscript|> and <|translate|> */
  const int32_t *langs = td_whisper_languages(w, &n);
  cr_assert(langs);
  cr_expect_eq(n, TRANSLATE - SOT - 1);
  cr_expect_eq(langs[0], EN);
  cr_expect_eq(langs[n - 1], TRANSLATE - 1);
  expect_refused(w, "xx", NULL, "not one this Whisper checkpoint knows");
  expect_refused(w, "transcribe", NULL, "not one this Whisper checkpoint knows"); /* a token, not a language */
  expect_refused(w, "en\"; DROP", NULL, "not a Whisper language code");
  expect_refused(w, "\xff\xfe", NULL, "not a Whisper language code");
  expect_refused(w, "en", "summarize", "neither \"transcribe\" nor \"translate\"");
  td_whisper_prompt_destroy(w);
}

Test(whisper_prompt, from_generation_config) {
  gen_config("{\"decoder_start_token_id\": 50258, \"no_timestamps_token_id\": 50364, \"is_multilingual\": true,"
             " \"lang_to_id\": {\"<|en|>\": 50259, \"<|de|>\": 50261}, \"language\": \"de\","
             " \"task_to_id\": {\"transcribe\": 50360, \"translate\": 50359}, \"task\": \"translate\"}");
  td_whisper_prompt *w;
  cr_assert_eq(td_whisper_prompt_load(dir, tok, &w), TD_OK, "%s", td_errmsg());
  expect_prompt(w, NULL, NULL, false, (int32_t[]){SOT, DE, TRANSLATE, NO_TS}, 4); /* the checkpoint's defaults */
  expect_prompt(w, "en", "transcribe", false, (int32_t[]){SOT, EN, TRANSCRIBE, NO_TS}, 4);
  expect_refused(w, "fr", NULL, "not one this Whisper checkpoint knows"); /* lang_to_id lists the languages */
  int n;
  const int32_t *langs = td_whisper_languages(w, &n);
  cr_assert_eq(n, 2);
  cr_expect(langs[0] + langs[1] == EN + DE && (langs[0] == EN || langs[0] == DE));
  td_whisper_prompt_destroy(w);
}

Test(whisper_prompt, english_only) {
  gen_config("{\"is_multilingual\": false}");
  td_whisper_prompt *w;
  cr_assert_eq(td_whisper_prompt_load(dir, tok, &w), TD_OK, "%s", td_errmsg());
  expect_prompt(w, NULL, NULL, false, (int32_t[]){SOT, NO_TS}, 2);
  expect_prompt(w, "en", NULL, false, (int32_t[]){SOT, NO_TS}, 2);
  expect_refused(w, "de", NULL, "English-only");
  expect_refused(w, NULL, "translate", "English-only");
  int n;
  cr_expect(td_whisper_languages(w, &n) == NULL && n == 0);
  td_whisper_prompt_destroy(w);
}

Test(whisper_prompt, bad_files) {
  td_whisper_prompt *w = NULL;
  gen_config("{\"lang_to_id\": {\"<|en|>\": \"fifty\"}}");
  cr_expect_eq(td_whisper_prompt_load(dir, tok, &w), TD_ERR_FORMAT);
  cr_expect(strstr(td_errmsg(), "lang_to_id"), "%s", td_errmsg());
  gen_config("{\"no_timestamps_token_id\": \"x\"}");
  cr_expect_neq(td_whisper_prompt_load(dir, tok, &w), TD_OK);
  cr_expect(strstr(td_errmsg(), "no_timestamps_token_id"), "%s", td_errmsg());
  gen_config("{not json");
  cr_expect_neq(td_whisper_prompt_load(dir, tok, &w), TD_OK);
  cr_expect(w == NULL);
  td_tokenizer *t5;
  cr_assert_eq(td_tokenizer_load(TD_TEST_DATA "/tokenizers/toy-numbers-t5", NULL, &t5), TD_OK, "%s", td_errmsg());
  gen_config("{}");
  cr_expect_eq(td_whisper_prompt_load(dir, t5, &w), TD_ERR_FORMAT);
  cr_expect(strstr(td_errmsg(), "not a Whisper tokenizer"), "%s", td_errmsg());
  td_tokenizer_destroy(t5);
}

/* transformers' _compute_offsets on hand-made outputs: one segment, two,
 * a new window (timestamps start again: 30 s on), none. */
Test(whisper_prompt, segments) {
  enum { T0 = 50365, EOT = 50257, SEVEN = 1614, FORTY_TWO = 14034 };
  td_whisper_prompt *w;
  cr_assert_eq(td_whisper_prompt_load(dir, tok, &w), TD_OK, "%s", td_errmsg());
  int32_t tb;
  int max_initial;
  td_whisper_timestamp_rules(w, &tb, &max_initial);
  cr_expect_eq(tb, T0, "the timestamps start after <|notimestamps|>");
  cr_expect_eq(max_initial, -1, "none in a checkpoint without generation_config.json");
  td_whisper_prompt_destroy(w);
  struct {
    int32_t ids[8];
    size_t n;
    size_t n_seg;
    double se[2][2];
    const char *text[2];
  } cases[] = {
      {{T0, SEVEN, T0 + 35, EOT}, 4, 1, {{0.0, 0.7}}, {" 7"}},
      {{T0, SEVEN, T0 + 35, T0 + 35, FORTY_TWO, T0 + 85, EOT}, 7, 2, {{0.0, 0.7}, {0.7, 1.7}}, {" 7", " 42"}},
      {{T0, SEVEN, T0 + 35, T0, FORTY_TWO, T0 + 35}, 6, 2, {{0.0, 0.7}, {30.0, 30.7}}, {" 7", " 42"}},
      {{SEVEN, EOT}, 2, 0, {{0}}, {NULL}},
      {{T0 + 10, SEVEN, EOT}, 3, 0, {{0}}, {NULL}},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    td_whisper_segment *s;
    size_t n;
    cr_assert_eq(td_whisper_segments(tok, cases[c].ids, cases[c].n, tb, &s, &n), TD_OK, "%s", td_errmsg());
    cr_expect_eq(n, cases[c].n_seg, "case %zu: %zu segments", c, n);
    for (size_t k = 0; k < n && k < cases[c].n_seg; k++) {
      cr_expect(fabs(s[k].start - cases[c].se[k][0]) < 1e-9 && fabs(s[k].end - cases[c].se[k][1]) < 1e-9,
                "case %zu segment %zu: %g-%g", c, k, s[k].start, s[k].end);
      cr_expect_str_eq(s[k].text, cases[c].text[k], "case %zu segment %zu", c, k);
    }
    td_whisper_segments_free(s, n);
  }
}
