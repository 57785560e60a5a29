/* The gateway's pure parts: request parsing and its refusals, OpenAI error
 * objects, SSE framing, stop strings over streamed text, Whisper prompts,
 * segments from timestamp tokens, SRT / WebVTT. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "gateway/internal.h"

static gw_model t5, wh;

static void load_t5(void) {
  cr_assert_eq(gw_model_load(TD_TEST_DATA "/toy-numbers-t5", NULL, NULL, &t5), TD_OK, "%s", td_errmsg());
}
static void free_t5(void) { gw_model_free(&t5); }
static void load_wh(void) {
  cr_assert_eq(gw_model_load(TD_TEST_DATA "/toy-numbers-whisper", TD_TEST_DATA "/toy-numbers-whisper",
                             "whisper", &wh),
               TD_OK, "%s", td_errmsg());
}
static void free_wh(void) { gw_model_free(&wh); }

static bool parse(const char *body, gw_completion *c, gw_error *e) {
  memset(e, 0, sizeof *e);
  return gw_completion_parse(body, strlen(body), &t5, c, e);
}

/* ---------------------------------------------------------------- completions */

TestSuite(completions, .init = load_t5, .fini = free_t5);

Test(completions, text_prompt_and_defaults) {
  gw_completion c;
  gw_error e;
  cr_assert(parse("{\"model\": \"toy-numbers-t5\", \"prompt\": \"seven\"}", &c, &e), "%s", e.message);
  cr_assert_eq(c.n_prompts, 1);
  /* examples.json: "seven" -> [31, 1] */
  cr_assert_eq(c.prompts[0].n, 2);
  cr_assert_eq(c.prompts[0].v[0], 31);
  cr_assert_eq(c.prompts[0].v[1], 1);
  cr_assert_eq(c.params.max_new_tokens, TD_GATEWAY_DEFAULT_MAX_TOKENS);
  cr_assert_eq(c.n, 1);
  cr_assert_eq(c.logprobs, -1);
  cr_assert(!c.stream);
  gw_completion_free(&c);
}

Test(completions, ids_batches_and_fields) {
  gw_completion c;
  gw_error e;
  cr_assert(parse("{\"model\": \"toy-numbers-t5\", \"prompt\": [[31, 1], \"seven\"], \"max_tokens\": 5, "
                  "\"temperature\": 0.7, \"top_p\": 0.9, \"n\": 3, \"seed\": 42, \"stop\": [\"4\", \"2\"], "
                  "\"logprobs\": 1, \"stream\": true, \"stream_options\": {\"include_usage\": true}, "
                  "\"user\": \"u\", \"echo\": false, \"presence_penalty\": 0, \"suffix\": null}",
                  &c, &e),
            "%s", e.message);
  cr_assert_eq(c.n_prompts, 2);
  cr_assert_eq(c.prompts[0].n, 2);
  cr_assert_eq(c.params.max_new_tokens, 5);
  cr_assert_float_eq(c.params.temperature, 0.7f, 1e-6);
  cr_assert_float_eq(c.params.top_p, 0.9f, 1e-6);
  cr_assert_eq(c.params.n, 3);
  cr_assert(c.params.has_seed);
  cr_assert_eq(c.params.seed, 42);
  cr_assert_eq(c.n_stop, 2);
  cr_assert_str_eq(c.stop[1], "2");
  cr_assert_eq(c.logprobs, 1);
  cr_assert(c.params.logprobs);
  cr_assert(c.stream && c.include_usage);
  gw_completion_free(&c);
}

Test(completions, best_of_is_beam_search) {
  gw_completion c;
  gw_error e;
  cr_assert(parse("{\"model\": \"toy-numbers-t5\", \"prompt\": [31, 1], \"best_of\": 4, \"n\": 2}", &c, &e), "%s",
            e.message);
  cr_assert_eq(c.params.num_beams, 4);
  cr_assert_eq(c.params.num_return_sequences, 2);
  gw_completion_free(&c);
  cr_assert(!parse("{\"model\": \"toy-numbers-t5\", \"prompt\": [31, 1], \"best_of\": 4, \"temperature\": 1}", &c, &e));
  cr_assert_str_eq(e.param, "best_of");
  cr_assert(!parse("{\"model\": \"toy-numbers-t5\", \"prompt\": [31, 1], \"best_of\": 2, \"n\": 3}", &c, &e));
  cr_assert(!parse("{\"model\": \"toy-numbers-t5\", \"prompt\": [31, 1], \"best_of\": 2, \"stream\": true}", &c, &e));
}

static void refused(const char *body, int http, const char *param) {
  gw_completion c;
  gw_error e;
  cr_assert(!parse(body, &c, &e), "accepted: %s", body);
  cr_assert_eq(e.http, http, "%s: %d (%s)", body, e.http, e.message);
  if (param) cr_assert_str_eq(e.param, param, "%s: param %s", body, e.param);
  cr_assert(e.message[0]);
}

Test(completions, refusals) {
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\"", 400, NULL); /* malformed JSON */
  refused("[1, 2]", 400, NULL);
  refused("", 400, NULL);
  refused("{\"prompt\": \"seven\"}", 400, "model");
  refused("{\"model\": \"gpt-4\", \"prompt\": \"seven\"}", 404, "model");
  refused("{\"model\": \"toy-numbers-t5\"}", 400, "prompt");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": []}", 400, "prompt");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": [31, 4900]}", 400, "prompt");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": [31, -1]}", 400, "prompt");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": [31, 1.5]}", 400, "prompt");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": [{}]}", 400, "prompt");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": 7}", 400, "prompt");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"max_tokens\": 1000000000}", 400, "max_tokens");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"max_tokens\": 0}", 400, "max_tokens");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"max_tokens\": \"5\"}", 400, "max_tokens");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"temperature\": 3}", 400, "temperature");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"top_p\": 0}", 400, "top_p");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"n\": 1000}", 400, "n");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"logprobs\": 5}", 400, "logprobs");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"stop\": [\"a\",\"b\",\"c\",\"d\",\"e\"]}", 400, "stop");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"stop\": [\"\"]}", 400, "stop");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"stop\": 3}", 400, "stop");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"echo\": true}", 400, "echo");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"logit_bias\": {\"5\": 1}}", 400, "logit_bias");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"frobnicate\": 1}", 400, "frobnicate");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"stream\": \"yes\"}", 400, "stream");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"stream_options\": {\"include_usage\": true}}", 400,
          "stream_options");
  /* more prompts than a request may batch */
  char body[4096] = "{\"model\": \"toy-numbers-t5\", \"prompt\": [";
  for (int i = 0; i <= TD_GATEWAY_MAX_PROMPTS; i++) strcat(body, i ? ", \"a\"" : "\"a\"");
  strcat(body, "]}");
  refused(body, 400, "prompt");
}

/* ---------------------------------------------------------------- errors and SSE */

Test(errors, openai_error_object) {
  gw_error e;
  gw_error_set(&e, 404, "model", "no model %s", "x");
  char *s = gw_error_json(&e);
  cr_assert_str_eq(s, "{\"error\":{\"message\":\"no model x\",\"type\":\"invalid_request_error\",\"param\":\"model\","
                      "\"code\":\"not_found\"}}");
  free(s);
  gw_error_set(&e, 500, NULL, "boom");
  s = gw_error_json(&e);
  cr_assert_str_eq(s, "{\"error\":{\"message\":\"boom\",\"type\":\"server_error\",\"param\":null,\"code\":null}}");
  free(s);
}

Test(errors, status_mapping) {
  struct { td_status s; int http; } cases[] = {
      {TD_ERR_INVALID, 400},    {TD_ERR_FORMAT, 400},  {TD_ERR_UNSUPPORTED, 400}, {TD_ERR_NOT_FOUND, 404},
      {TD_ERR_OVERLOADED, 503}, {TD_ERR_NETWORK, 503}, {TD_ERR_PEER, 503},        {TD_ERR_TIMEOUT, 504},
      {TD_ERR_INTERNAL, 500},   {TD_ERR_CANCELLED, 500}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    gw_error e;
    gw_error_from_status(&e, cases[i].s, "why");
    cr_assert_eq(e.http, cases[i].http, "%s -> %d", td_status_str(cases[i].s), e.http);
    cr_assert_str_eq(e.message, "why");
  }
  gw_error e;
  gw_error_from_status(&e, TD_ERR_NETWORK, "router unreachable: the connection to the router was lost");
  cr_expect_str_eq(e.code, "router_unreachable");
  gw_error_from_status(&e, TD_ERR_OVERLOADED, "full");
  cr_expect_str_eq(e.code, "overloaded");
}

Test(errors, sse_framing) {
  gw_buf b = {0};
  gw_sse_data(&b, "{\"a\":1}");
  gw_sse_data(&b, "[DONE]");
  cr_assert_str_eq(b.s, "data: {\"a\":1}\n\ndata: [DONE]\n\n");
  gw_buf_free(&b);
}

/* ---------------------------------------------------------------- stop strings */

static td_i32vec enc(const gw_model *m, const char *text) {
  int32_t *ids = NULL;
  size_t n = 0;
  cr_assert_eq(td_tokenizer_encode(m->tok, text, strlen(text), false, &ids, &n), TD_OK);
  td_i32vec v = {0};
  td_i32vec_assign(&v, ids, (int)n);
  free(ids);
  return v;
}

TestSuite(text, .init = load_t5, .fini = free_t5);

Test(text, streamed_text_equals_decode_without_stops) {
  td_i32vec v = enc(&t5, "12345");
  gw_text t;
  cr_assert_eq(gw_text_init(&t, t5.tok, NULL, 0), TD_OK);
  gw_buf got = {0};
  for (int i = 0; i < v.n; i++) {
    cr_assert_eq(gw_text_push(&t, v.v[i]), TD_OK);
    const char *p;
    size_t n;
    gw_text_take(&t, false, &p, &n);
    gw_buf_add(&got, p, n);
  }
  cr_assert_eq(gw_text_finish(&t), TD_OK);
  const char *p;
  size_t n;
  gw_text_take(&t, true, &p, &n);
  gw_buf_add(&got, p, n);
  cr_assert_str_eq(got.s, "12345");
  cr_assert_eq(t.n_tokens, v.n);
  gw_buf_free(&got);
  gw_text_free(&t);
  td_i32vec_free(&v);
}

Test(text, stop_string_across_tokens_is_cut_and_held_back) {
  td_i32vec v = enc(&t5, "1234567");
  const char *stop[] = {"45", "99999"};
  gw_text t;
  cr_assert_eq(gw_text_init(&t, t5.tok, stop, 2), TD_OK);
  gw_buf got = {0};
  for (int i = 0; i < v.n; i++) {
    cr_assert_eq(gw_text_push(&t, v.v[i]), TD_OK);
    const char *p;
    size_t n;
    gw_text_take(&t, false, &p, &n);
    gw_buf_add(&got, p, n);
    /* text that a stop string may still begin is not given out */
    cr_assert(!got.s || !strchr(got.s, '4'), "gave out %s", got.s);
  }
  cr_assert(t.stopped);
  const char *p;
  size_t n;
  gw_text_take(&t, true, &p, &n);
  gw_buf_add(&got, p, n);
  cr_assert_str_eq(got.s, "123");
  cr_assert_lt(t.n_tokens, v.n, "tokens after the stop are not taken");
  gw_buf_free(&got);
  gw_text_free(&t);
  td_i32vec_free(&v);
}

/* ---------------------------------------------------------------- audio */

TestSuite(audio, .init = load_wh, .fini = free_wh);

static gw_audio_req areq(const char *model) {
  gw_audio_req a = {0};
  snprintf(a.model, sizeof a.model, "%s", model);
  return a;
}

Test(audio, prompt_as_transformers_builds_it) {
  gw_audio_req a = areq("whisper");
  gw_error e = {0};
  cr_assert(gw_audio_check(&a, &wh, &e), "%s", e.message);
  td_i32vec p = {0};
  cr_assert(gw_audio_prompt(&a, &wh, &p, &e), "%s", e.message);
  /* examples.json's decoder prompt */
  int32_t want[] = {50258, 50259, 50360, 50364};
  cr_assert_eq(p.n, 4);
  for (int i = 0; i < 4; i++) cr_assert_eq(p.v[i], want[i]);
  /* translate, a language, timestamps, a previous-text prompt */
  a.translate = true;
  snprintf(a.language, sizeof a.language, "de");
  a.seg_timestamps = true;
  a.prompt = strdup("  forty two ");
  cr_assert(gw_audio_check(&a, &wh, &e), "%s", e.message);
  cr_assert(gw_audio_prompt(&a, &wh, &p, &e), "%s", e.message);
  cr_assert_eq(p.v[0], wh.startofprev);
  /* timestamps asked: no <|notimestamps|> at the end */
  cr_assert_eq(p.v[p.n - 3], wh.sot);
  cr_assert_eq(p.v[p.n - 2], td_tokenizer_token_to_id(wh.tok, "<|de|>"));
  cr_assert_eq(p.v[p.n - 1], wh.translate);
  free(a.prompt);
  td_i32vec_free(&p);
}

Test(audio, languages_from_generation_config) {
  cr_assert_eq(gw_language_id(&wh, "en"), 50259);
  cr_assert_eq(gw_language_id(&wh, "zz"), -1);
  /* where generation_config.json has lang_to_id, it alone decides */
  wh.lang_to_id = cJSON_Parse("{\"<|en|>\": 50259, \"<|de|>\": 50261}");
  cr_assert_eq(gw_language_id(&wh, "de"), 50261);
  cr_assert_eq(gw_language_id(&wh, "fr"), -1);
  gw_audio_req a = areq("whisper");
  snprintf(a.language, sizeof a.language, "fr");
  gw_error e = {0};
  cr_assert(!gw_audio_check(&a, &wh, &e));
  cr_assert_str_eq(e.param, "language");
}

static bool lf_opts(gw_audio_req *a, td_longform_opts *o, gw_error *e);

/* A detected language token: the prompt (short audio) and the long-form
 * loop's first tokens as if the form had named that language. */
Test(audio, prompt_from_a_detected_language) {
  int32_t de = td_tokenizer_token_to_id(wh.tok, "<|de|>");
  cr_assert_gt(wh.n_langs, 90, "the toy's tokenizer is whisper-large-v3's: %d languages", wh.n_langs);
  cr_assert_eq(wh.langs[0], 50259, "<|en|> first");
  cr_assert_str_eq(wh.default_language, "", "no default: detected");
  char code[16];
  cr_assert(gw_language_code(&wh, de, code, sizeof code));
  cr_assert_str_eq(code, "de");
  cr_assert(!gw_language_code(&wh, wh.transcribe, code, sizeof code), "a task token is no language");
  cr_assert(!gw_language_code(&wh, 220, code, sizeof code), "nor is text");
  for (int tr = 0; tr < 2; tr++) {
    gw_audio_req a = areq("whisper");
    a.translate = tr;
    gw_error e = {0};
    cr_assert(gw_audio_check(&a, &wh, &e), "%s", e.message);
    cr_assert(gw_audio_detects(&a, &wh), "no language given: detected");
    cr_assert(gw_audio_set_language(&a, &wh, de, &e), "%s", e.message);
    cr_assert_str_eq(a.language, "de", "verbose_json names it");
    cr_assert(!gw_audio_detects(&a, &wh), "detected once");
    td_i32vec p = {0};
    cr_assert(gw_audio_prompt(&a, &wh, &p, &e), "%s", e.message);
    int32_t want[] = {wh.sot, de, tr ? wh.translate : wh.transcribe, wh.notimestamps};
    cr_assert_eq(p.n, 4);
    for (int i = 0; i < 4; i++) cr_assert_eq(p.v[i], want[i], "%d: %d, want %d", i, p.v[i], want[i]);
    td_i32vec_free(&p);
    td_longform_opts o;
    cr_assert(lf_opts(&a, &o, &e), "%s", e.message);
    cr_assert_eq(o.n_init, 3);
    for (int i = 0; i < 3; i++) cr_assert_eq(o.init[i], want[i]);
  }
  /* a token that is no language: the cluster's answer is refused, not used */
  gw_audio_req a = areq("whisper");
  gw_error e = {0};
  cr_assert(!gw_audio_set_language(&a, &wh, wh.eos, &e));
  cr_assert_eq(e.http, 502);
  cr_assert_str_eq(a.language, "");
  /* a language given: nothing to detect */
  snprintf(a.language, sizeof a.language, "en");
  cr_assert(!gw_audio_detects(&a, &wh));
  /* the checkpoint's default (generation_config.json's language) stands for a missing one */
  snprintf(wh.default_language, sizeof wh.default_language, "fr");
  gw_audio_req b = areq("whisper");
  cr_assert(gw_audio_check(&b, &wh, &e), "%s", e.message);
  cr_assert_str_eq(b.language, "fr");
  cr_assert(!gw_audio_detects(&b, &wh));
  /* an English-only checkpoint (no language tokens): nothing is detected, as before */
  wh.default_language[0] = 0;
  wh.n_langs = 0;
  gw_audio_req c = areq("whisper");
  cr_assert(gw_audio_check(&c, &wh, &e), "%s", e.message);
  cr_assert(!gw_audio_detects(&c, &wh));
}

static void arefused(gw_audio_req a, int http, const char *param) {
  gw_error e = {0};
  cr_assert(!gw_audio_check(&a, &wh, &e), "accepted");
  cr_assert_eq(e.http, http, "%d: %s", e.http, e.message);
  cr_assert_str_eq(e.param, param);
}

Test(audio, refusals) {
  arefused(areq(""), 400, "model");
  arefused(areq("whisper-1"), 404, "model");
  gw_audio_req a = areq("whisper");
  snprintf(a.response_format, sizeof a.response_format, "xml");
  arefused(a, 400, "response_format");
  a = areq("whisper");
  snprintf(a.response_format, sizeof a.response_format, "srt");
  a.stream = true;
  arefused(a, 400, "stream");
  a = areq("whisper");
  a.word_timestamps = true;
  arefused(a, 400, "timestamp_granularities[]");
  a = areq("whisper");
  snprintf(a.language, sizeof a.language, "xx");
  arefused(a, 400, "language");
  a = areq("whisper");
  snprintf(a.language, sizeof a.language, "EN");
  arefused(a, 400, "language");
  a = areq("whisper");
  a.has_temperature = true;
  a.temperature = 1.5f;
  arefused(a, 400, "temperature");
  a = areq("whisper");
  snprintf(a.bad_field, sizeof a.bad_field, "colour");
  arefused(a, 400, "colour");
}

Test(audio, formats_parse) {
  const char *f[] = {"json", "text", "srt", "vtt", "verbose_json"};
  for (int i = 0; i < 5; i++) {
    gw_audio_req a = areq("whisper");
    snprintf(a.response_format, sizeof a.response_format, "%s", f[i]);
    gw_error e = {0};
    cr_assert(gw_audio_check(&a, &wh, &e), "%s", e.message);
    cr_assert_eq((int)a.format, i);
  }
}

static int32_t ts(double s) { return wh.ts_begin + (int32_t)(s / 0.02 + 0.5); }

Test(audio, segments_from_timestamps) {
  td_i32vec a = enc(&wh, " 42"), b = enc(&wh, " 7");
  int32_t tok[64];
  int n = 0;
  tok[n++] = ts(0.0);
  for (int i = 0; i < a.n; i++) tok[n++] = a.v[i];
  tok[n++] = ts(1.2);
  tok[n++] = ts(1.2);
  for (int i = 0; i < b.n; i++) tok[n++] = b.v[i];
  tok[n++] = ts(2.5);
  tok[n++] = 50257; /* EOS */
  gw_segment *s;
  int ns;
  char *text;
  cr_assert_eq(gw_segments(&wh, tok, n, 3.0, true, &s, &ns, &text), TD_OK, "%s", td_errmsg());
  cr_assert_str_eq(text, "42 7");
  cr_assert_eq(ns, 2);
  cr_assert_float_eq(s[0].start, 0.0, 1e-9);
  cr_assert_float_eq(s[0].end, 1.2, 1e-9);
  cr_assert_str_eq(s[0].text, " 42");
  cr_assert_float_eq(s[1].start, 1.2, 1e-9);
  cr_assert_float_eq(s[1].end, 2.5, 1e-9);
  cr_assert_str_eq(s[1].text, " 7");
  gw_buf srt = {0}, vtt = {0};
  gw_format_srt(&srt, s, ns);
  gw_format_vtt(&vtt, s, ns);
  cr_assert_str_eq(srt.s, "1\n00:00:00,000 --> 00:00:01,200\n42\n\n2\n00:00:01,200 --> 00:00:02,500\n7\n\n");
  cr_assert_str_eq(vtt.s, "WEBVTT\n\n00:00:00.000 --> 00:00:01.200\n42\n\n00:00:01.200 --> 00:00:02.500\n7\n\n");
  gw_buf_free(&srt);
  gw_buf_free(&vtt);
  gw_segments_free(s, ns);
  free(text);
  /* without timestamps: one segment over the audio; a missing closing timestamp ends at the audio's end */
  cr_assert_eq(gw_segments(&wh, a.v, a.n, 2.25, false, &s, &ns, &text), TD_OK);
  cr_assert_eq(ns, 1);
  cr_assert_float_eq(s[0].end, 2.25, 1e-9);
  gw_segments_free(s, ns);
  free(text);
  tok[0] = ts(0.5);
  memcpy(tok + 1, a.v, (size_t)a.n * sizeof *tok);
  cr_assert_eq(gw_segments(&wh, tok, a.n + 1, 2.25, true, &s, &ns, &text), TD_OK);
  cr_assert_eq(ns, 1);
  cr_assert_float_eq(s[0].start, 0.5, 1e-9);
  cr_assert_float_eq(s[0].end, 2.25, 1e-9);
  gw_segments_free(s, ns);
  free(text);
  td_i32vec_free(&a);
  td_i32vec_free(&b);
}

Test(audio, time_format) {
  char b[32];
  gw_format_time(b, sizeof b, 3725.0456, ',');
  cr_assert_str_eq(b, "01:02:05,046");
  gw_format_time(b, sizeof b, -1, '.');
  cr_assert_str_eq(b, "00:00:00.000");
}

/* ---------------------------------------------------------------- long-form */

static bool lf_opts(gw_audio_req *a, td_longform_opts *o, gw_error *e) {
  td_i32vec ids = {0};
  memset(e, 0, sizeof *e);
  bool ok = gw_audio_prompt_ids(a, &wh, &ids, e) && gw_longform_opts(a, &wh, &ids, o, e);
  if (ok) cr_expect_eq(o->n_prompt_ids, ids.n);
  td_i32vec_free(&ids);
  return ok;
}

/* OpenAI whisper's defaults, the checkpoint's ids; the form's fields. */
Test(audio, longform_options) {
  gw_audio_req a = areq("whisper");
  td_longform_opts o;
  gw_error e;
  cr_assert(lf_opts(&a, &o, &e), "%s", e.message);
  cr_expect_eq(o.window_frames, 400);
  cr_expect_eq(o.max_target_positions, 64);
  cr_expect_eq(o.vocab_size, 51866);
  cr_expect_eq(o.timestamp_begin, 50365);
  cr_expect_eq(o.no_speech, 50363);
  cr_expect_eq(o.prev_sot, 50362, "<|startofprev|>: the toy's generation_config.json names none");
  cr_expect_eq(o.eos, 50257);
  int32_t init[] = {50258, 50259, 50360};
  cr_assert_eq(o.n_init, 3);
  cr_expect_arr_eq(o.init, init, sizeof init);
  float ladder[] = {0.0f, 0.2f, 0.4f, 0.6f, 0.8f, 1.0f};
  cr_assert_eq(o.n_temperatures, 6);
  cr_expect_arr_eq(o.temperatures, ladder, sizeof ladder);
  cr_expect(o.has_compression_ratio_threshold && o.compression_ratio_threshold == 1.35);
  cr_expect(o.has_logprob_threshold && o.logprob_threshold == -1.0);
  cr_expect(o.has_no_speech_threshold && o.no_speech_threshold == 0.6);
  cr_expect(o.condition_on_prev_tokens);
  /* the fields: a ladder from 0.5 by 0.25, no compression threshold, not conditioned, a prompt */
  a.has_temperature = true;
  a.temperature = 0.5f;
  cr_assert(gw_opt_num_parse("temperature_increment_on_fallback", "0.25", false, &a.lf.temperature_increment, &e));
  cr_assert(gw_opt_num_parse("compression_ratio_threshold", "none", true, &a.lf.compression_ratio_threshold, &e));
  cr_assert(gw_opt_num_parse("logprob_threshold", "-0.5", true, &a.lf.logprob_threshold, &e));
  a.lf.condition_given = true;
  a.prompt = strdup("forty two");
  snprintf(a.language, sizeof a.language, "de");
  cr_assert(lf_opts(&a, &o, &e), "%s", e.message);
  float ladder2[] = {0.5f, 0.75f, 1.0f};
  cr_assert_eq(o.n_temperatures, 3);
  cr_expect_arr_eq(o.temperatures, ladder2, sizeof ladder2);
  cr_expect(!o.has_compression_ratio_threshold);
  cr_expect_eq(o.logprob_threshold, -0.5);
  cr_expect(!o.condition_on_prev_tokens);
  cr_expect(o.n_prompt_ids > 0);
  cr_expect_eq(o.init[1], td_tokenizer_token_to_id(wh.tok, "<|de|>"));
  free(a.prompt);
  /* no fallback */
  a = areq("whisper");
  cr_assert(gw_opt_num_parse("temperature_increment_on_fallback", "0", false, &a.lf.temperature_increment, &e));
  cr_assert(lf_opts(&a, &o, &e), "%s", e.message);
  cr_expect_eq(o.n_temperatures, 1);
}

static void lf_refused(gw_audio_req a, const char *param, const char *says) {
  td_longform_opts o;
  gw_error e;
  cr_assert(!lf_opts(&a, &o, &e), "accepted: %s", says);
  cr_expect_eq(e.http, 400);
  cr_expect_str_eq(e.param, param);
  cr_expect(strstr(e.message, says), "\"%s\" does not say \"%s\"", e.message, says);
}

Test(audio, longform_refusals) {
  gw_error e = {0};
  td_opt_num x;
  cr_expect(!gw_opt_num_parse("logprob_threshold", "low", true, &x, &e));
  cr_expect_str_eq(e.param, "logprob_threshold");
  cr_expect(!gw_opt_num_parse("temperature_increment_on_fallback", "none", false, &x, &e), "no off for the step");
  cr_expect(!gw_opt_num_parse("no_speech_threshold", "nan", true, &x, &e));
  gw_audio_req a = areq("whisper");
  a.lf.logprob_threshold = (td_opt_num){.given = true, .v = 0.5};
  lf_refused(a, "logprob_threshold", "logprob_threshold: 0.5");
  a = areq("whisper");
  a.lf.logprob_threshold = (td_opt_num){.given = true, .off = true};
  lf_refused(a, "no_speech_threshold", "no_speech_threshold needs logprob_threshold");
  a = areq("whisper");
  a.lf.no_speech_threshold = (td_opt_num){.given = true, .v = 2};
  lf_refused(a, "no_speech_threshold", "not a probability");
  a = areq("whisper");
  a.lf.compression_ratio_threshold = (td_opt_num){.given = true, .v = -1};
  lf_refused(a, "compression_ratio_threshold", "compression_ratio_threshold: -1");
  a = areq("whisper");
  a.lf.temperature_increment = (td_opt_num){.given = true, .v = 0.01};
  lf_refused(a, "temperature_increment_on_fallback", "more than 16 temperatures");
  a.lf.temperature_increment = (td_opt_num){.given = true, .v = 1.5};
  lf_refused(a, "temperature_increment_on_fallback", "in [0, 1]");
}

/* The transcription's segments as the answers show them: tokens one after
 * another, texts without timestamps, each window's figures, empty text kept. */
Test(audio, longform_segments) {
  td_longform_opts o = {.window_frames = 400, .input_stride = 2, .max_target_positions = 64, .vocab_size = 51866,
                        .timestamp_begin = 50365, .eos = 50257, .no_speech = 50363, .prev_sot = 50362,
                        .init = {50258, 50259, 50360}, .n_init = 3, .temperatures = {0}, .n_temperatures = 1};
  td_longform *lf;
  cr_assert_eq(td_longform_create(&o, 900, &lf), TD_OK, "%s", td_errmsg());
  td_longform_window w;
  cr_assert(td_longform_next(lf, &w));
  int32_t a1[] = {50365, 14034, 50415, 50415, 1017, 2009, 22, 50465, 50257}; /* <|0.00|> 42 <|1.00|><|1.00|> 4207 <|2.00|> */
  float lp[9] = {0};
  cr_assert_eq(td_longform_feed(lf, a1, 9, lp, NAN), TD_OK, "%s", td_errmsg());
  cr_assert(td_longform_next(lf, &w));
  int32_t a2[] = {51461, 50257}; /* one timestamp: no text */
  cr_assert_eq(td_longform_feed(lf, a2, 2, lp, NAN), TD_OK, "%s", td_errmsg());
  int32_t *tok;
  int n_tok, n_seg;
  gw_segment *seg;
  char *text;
  cr_assert_eq(gw_longform_segments(&wh, lf, &tok, &n_tok, &seg, &n_seg, &text), TD_OK, "%s", td_errmsg());
  cr_assert_eq(n_seg, 3);
  cr_expect_eq(n_tok, 3 + 5 + 1);
  cr_expect_str_eq(text, "42 4207");
  cr_expect_str_eq(seg[0].text, " 42");
  cr_expect_str_eq(seg[1].text, " 4207");
  cr_expect_str_eq(seg[2].text, "");
  cr_expect(seg[0].stats && seg[2].seek == 400);
  cr_expect(seg[1].start == 1.0 && seg[1].end == 2.0);
  cr_expect(seg[2].start == 4.0 && fabs(seg[2].end - 25.92) < 1e-9);
  cr_expect_eq(seg[1].first, 3);
  cr_expect_eq(tok[seg[2].first], 51461);
  gw_segments_free(seg, n_seg);
  free(tok);
  free(text);
  td_longform_destroy(lf);
}

/* A field given twice is refused naming it: two "stop" lists of four each
 * once wrote past the four stop slots. */
Test(completions, a_field_given_twice_is_refused) {
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"stop\": [\"a\",\"b\",\"c\",\"d\"], "
          "\"stop\": [\"e\",\"f\",\"g\",\"h\"]}", 400, "stop");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"max_tokens\": 3, \"max_tokens\": 4}", 400, "max_tokens");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"prompt\": \"b\"}", 400, "prompt");
  refused("{\"model\": \"toy-numbers-t5\", \"model\": \"toy-numbers-t5\", \"prompt\": \"a\"}", 400, "model");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"max_tokens\": 3, \"max_new_tokens\": 4}", 400,
          "max_new_tokens");
  refused("{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"user\": 7}", 400, "user");
  char body[600];
  snprintf(body, sizeof body, "{\"model\": \"toy-numbers-t5\", \"prompt\": \"a\", \"user\": \"%0*d\"}", 300, 0);
  refused(body, 400, "user");
}

/* ---------------------------------------------------------------- API keys */

static char key_dir[] = "/tmp/td-gw-keys-XXXXXX";

static const char *key_file(const char *name, const char *text, int mode) {
  static char path[256];
  if (key_dir[sizeof key_dir - 2] == 'X') cr_assert(mkdtemp(key_dir));
  snprintf(path, sizeof path, "%s/%s", key_dir, name);
  FILE *f = fopen(path, "w");
  cr_assert(f);
  fputs(text, f);
  fclose(f);
  cr_assert_eq(chmod(path, (mode_t)mode), 0);
  return path;
}

/* the files of a test, then the folder where no other test's remain */
static void key_files_done(const char *const *names, size_t n) {
  char path[256];
  for (size_t i = 0; i < n; i++) {
    snprintf(path, sizeof path, "%s/%s", key_dir, names[i]);
    unlink(path);
  }
  rmdir(key_dir);
}

Test(api_keys, load_and_admit) {
  gw_keys k;
  const char *p = key_file("good", "# the gateway's keys\n\n  sk-first-key \nsk-second\t\n", 0600);
  cr_assert_eq(gw_keys_load(p, &k), TD_OK, "%s", td_errmsg());
  cr_assert_eq(k.n, 2);
  cr_expect(gw_keys_admit(&k, "Bearer sk-first-key"));
  cr_expect(gw_keys_admit(&k, "bearer  sk-second"), "the scheme's case and blanks around the key do not matter");
  cr_expect(gw_keys_admit(&k, "Bearer sk-second "));
  cr_expect(!gw_keys_admit(&k, NULL), "no header");
  cr_expect(!gw_keys_admit(&k, ""));
  cr_expect(!gw_keys_admit(&k, "Bearer "));
  cr_expect(!gw_keys_admit(&k, "sk-first-key"), "a key without the scheme");
  cr_expect(!gw_keys_admit(&k, "Basic sk-first-key"));
  cr_expect(!gw_keys_admit(&k, "Bearer sk-first-ke"), "a prefix of a key");
  cr_expect(!gw_keys_admit(&k, "Bearer sk-first-keyX"), "a key with more after it");
  cr_expect(!gw_keys_admit(&k, "Bearer sk-first-key sk-second"));
  cr_expect(!gw_keys_admit(&k, "Bearer # the gateway's keys"), "a comment is no key");
  char longer[600];
  memset(longer, 'a', sizeof longer - 1);
  longer[sizeof longer - 1] = 0;
  memcpy(longer, "Bearer ", 7);
  cr_expect(!gw_keys_admit(&k, longer), "a value past every key's length");
  gw_keys_free(&k);
  cr_expect_eq(k.n, 0);
  key_files_done((const char *[]){"good"}, 1);
}

Test(api_keys, bad_files_are_refused_naming_why) {
  gw_keys k;
  struct {
    const char *name, *text;
    int mode;
    const char *why;
  } bad[] = {
      {"open", "sk-a\n", 0644, "readable by others"},
      {"empty", "# nothing\n\n", 0600, "holds no key"},
      {"blank", "sk a\n", 0600, "printable ASCII without blanks"},
      {"control", "sk-\001\n", 0600, "printable ASCII without blanks"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    const char *p = key_file(bad[i].name, bad[i].text, bad[i].mode);
    cr_expect_neq(gw_keys_load(p, &k), TD_OK, "%s was taken", bad[i].name);
    cr_expect(strstr(td_errmsg(), bad[i].why), "%s: %s", bad[i].name, td_errmsg());
    cr_expect_eq(k.n, 0);
  }
  char big[TD_GATEWAY_MAX_API_KEY_BYTES + 100];
  memset(big, 'k', sizeof big - 2);
  big[sizeof big - 2] = '\n';
  big[sizeof big - 1] = 0;
  cr_expect_neq(gw_keys_load(key_file("long", big, 0600), &k), TD_OK);
  cr_expect(strstr(td_errmsg(), "bytes"), "%s", td_errmsg());
  cr_expect_neq(gw_keys_load("/nonexistent/keys", &k), TD_OK);
  cr_expect(strstr(td_errmsg(), "cannot be read"), "%s", td_errmsg());
  cr_expect_neq(gw_keys_load(key_dir, &k), TD_OK, "a folder is no key file");
  key_files_done((const char *[]){"open", "empty", "blank", "control", "long"}, 5);
}
