/* tandem-generate on the command line: tokens and --logits-out against the
 * Hugging Face fixtures, and clear errors for bad input. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <criterion/criterion.h>

#include "fixture.h"

static char dir[256];

static void setup_tmp(void) {
  snprintf(dir, sizeof dir, "/tmp/td-gen-XXXXXX");
  cr_assert(mkdtemp(dir));
}

static void teardown_tmp(void) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  cr_assert(system(cmd) == 0);
}

TestSuite(generate_cli, .init = setup_tmp, .fini = teardown_tmp);

/* Runs tandem-generate; returns its exit status and output lines. */
static int run_gen(const char *args, char ***lines, int *n) {
  char cmd[2048];
  snprintf(cmd, sizeof cmd, "%s/tandem-generate %s 2>%s/stderr.txt", TD_BIN_DIR, args, dir);
  FILE *p = popen(cmd, "r");
  cr_assert(p);
  *lines = NULL;
  *n = 0;
  char *line = NULL;
  size_t cap = 0;
  while (getline(&line, &cap, p) > 0) {
    *lines = realloc(*lines, sizeof **lines * (size_t)(*n + 1));
    (*lines)[(*n)++] = strdup(line);
  }
  free(line);
  int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void free_lines(char **l, int n) {
  for (int i = 0; i < n; i++) free(l[i]);
  free(l);
}

/* The fixture's requests through tandem-generate with `flags`: tokens and
 * logits against the references. With out_toks set, each request's tokens
 * go there (16 requests of up to 64) and their counts to n_toks. */
static void check_model_flags(const char *name, const char *flags, int32_t (*out_toks)[64], int *n_toks) {
  fixture fx;
  fx_load(name, &fx);
  char req[512], lg[512], args[1600];
  snprintf(req, sizeof req, "%s/%s.jsonl", dir, name);
  snprintf(lg, sizeof lg, "%s/%s.logits", dir, name);
  fx_write_requests(&fx, req, "\"forced_bos_token_id\": null, \"forced_eos_token_id\": null");
  snprintf(args, sizeof args, "--model %s --requests %s --logits-out %s --block-size 4 --max-batch 8 %s", fx.dir, req,
           lg, flags);
  char **lines;
  int n;
  int rc = run_gen(args, &lines, &n);
  cr_assert_eq(rc, 0, "%s: tandem-generate exited %d", name, rc);
  cr_assert_eq(n, fx.n, "%s: %d output lines for %d requests", name, n, fx.n);
  for (int i = 0; i < n; i++) {
    cJSON *o = cJSON_Parse(lines[i]);
    cr_assert(o, "%s: bad output line %s", name, lines[i]);
    char want_id[16];
    snprintf(want_id, sizeof want_id, "r%d", i);
    cr_expect_str_eq(cJSON_GetObjectItem(o, "id")->valuestring, want_id);
    cJSON *out0 = cJSON_GetArrayItem(cJSON_GetObjectItem(o, "outputs"), 0);
    cJSON *toks = cJSON_GetObjectItem(out0, "tokens");
    cr_assert_eq(cJSON_GetArraySize(toks), fx.req[i].n_greedy, "%s request %d: token count", name, i);
    for (int t = 0; t < fx.req[i].n_greedy; t++)
      cr_expect_eq(cJSON_GetArrayItem(toks, t)->valueint, fx.req[i].greedy[t], "%s request %d token %d", name, i, t);
    if (out_toks) {
      cr_assert(i < 16 && cJSON_GetArraySize(toks) <= 64);
      n_toks[i] = cJSON_GetArraySize(toks);
      for (int t = 0; t < n_toks[i]; t++) out_toks[i][t] = cJSON_GetArrayItem(toks, t)->valueint;
    }
    const char *fr = cJSON_GetObjectItem(out0, "finish_reason")->valuestring;
    bool ends_eos = fx.req[i].greedy[fx.req[i].n_greedy - 1] == fx.eos;
    cr_expect_str_eq(fr, ends_eos ? "stop" : "length");
    cJSON_Delete(o);
  }
  size_t nl;
  float *got = fx_read_f32(lg, &nl);
  size_t rows = 0;
  for (int i = 0; i < fx.n; i++) rows += (size_t)(fx.req[i].n_prompt + fx.req[i].n_greedy - 1);
  cr_assert_eq(nl, rows * fx.vocab, "%s: logits file has %zu values, expected %zu", name, nl, rows * fx.vocab);
  for (int i = 0; i < fx.n; i++) {
    size_t r = (size_t)(fx.req[i].n_prompt + fx.req[i].n_greedy - 1);
    double e = fx_rel_err(got + fx.req[i].logits_off * fx.vocab, fx.logits + fx.req[i].logits_off * fx.vocab,
                          r * fx.vocab);
    cr_expect(e <= 1e-4, "%s %s request %d: logits error %.3g", name, flags, i, e);
  }
  free(got);
  free_lines(lines, n);
  fx_free(&fx);
}

static void check_model(const char *name) { check_model_flags(name, "", NULL, NULL); }

Test(generate_cli, all_fixture_models) {
  for (int i = 0; i < fx_n_models; i++) check_model(fx_models[i]);
}

/* Every cross pool mode (the default, auto, is dual with every step over
 * the K/V on the CPU): the same greedy tokens request by request, on every
 * fixture, also with the states path from two rows in dual. */
Test(generate_cli, cross_modes_give_the_same_tokens) {
  static const char *modes[] = {"--cross-states", "--cross-mode kv", "--cross-mode dual --states-rows 2"};
  for (int m = 0; m < fx_n_models; m++) {
    static int32_t plain[16][64], other[16][64];
    int n_plain[16] = {0};
    check_model_flags(fx_models[m], "", plain, n_plain);
    for (int k = 0; k < 3; k++) {
      int n_other[16] = {0};
      check_model_flags(fx_models[m], modes[k], other, n_other);
      for (int i = 0; i < 16; i++) {
        cr_expect_eq(n_other[i], n_plain[i], "%s request %d: %d tokens with %s, %d without", fx_models[m], i,
                     n_other[i], modes[k], n_plain[i]);
        cr_expect_arr_eq(other[i], plain[i], sizeof(int32_t) * (size_t)n_plain[i], "%s request %d: tokens differ with %s",
                         fx_models[m], i, modes[k]);
      }
    }
  }
}

/* An unknown --cross-mode is refused before anything loads */
Test(generate_cli, unknown_cross_mode_is_refused) {
  char **lines;
  int n;
  int rc = run_gen("--model /nonexistent --requests - --cross-mode fast", &lines, &n);
  cr_expect_eq(rc, 2, "exit status %d", rc);
  cr_expect_eq(n, 0);
  free_lines(lines, n);
  char path[600], msg[512] = "";
  snprintf(path, sizeof path, "%s/stderr.txt", dir);
  FILE *f = fopen(path, "r");
  cr_assert(f);
  size_t got = fread(msg, 1, sizeof msg - 1, f);
  msg[got] = 0;
  fclose(f);
  cr_expect(strstr(msg, "--cross-mode fast: want auto, kv, states or dual"), "%s", msg);
}

/* A request file that cannot be read to its end (here a directory) is an
 * error, not a run of the requests read before it stopped. */
Test(generate_cli, an_unreadable_request_file_is_refused) {
  char args[600];
  snprintf(args, sizeof args, "--model %s/t5-tiny --requests %s", TD_TEST_DATA, dir);
  char **lines;
  int n;
  int rc = run_gen(args, &lines, &n);
  cr_expect_eq(rc, 2, "exit status %d", rc);
  cr_expect_eq(n, 0);
  free_lines(lines, n);
}

Test(generate_cli, bad_requests_get_errors_and_others_run) {
  char req[512], args[1200];
  snprintf(req, sizeof req, "%s/bad.jsonl", dir);
  FILE *f = fopen(req, "w");
  fprintf(f, "{\"id\": \"ok\", \"input_ids\": [5, 6, 1], \"max_new_tokens\": 3}\n"
             "{\"id\": \"vocab\", \"input_ids\": [5, 300000, 1]}\n"
             "{\"id\": \"empty\", \"input_ids\": []}\n"
             "{\"id\": \"long\", \"input_ids\": [5, 1], \"decoder_prompt\": [0], \"max_new_tokens\": 100000}\n"
             "{\"id\": \"typo\", \"input_ids\": [5, 1], \"temprature\": 1}\n"
             "{\"id\": \"neg\", \"input_ids\": [5, 1], \"top_p\": -1}\n"
             "{\"id\": \"beams\", \"input_ids\": [5, 1], \"num_beams\": 2, \"num_return_sequences\": 3}\n"
             "{\"id\": \"feat\", \"input_features\": \"nope.f32\"}\n"
             "[1, 2]\n"
             "{\"id\": \"trunc\n");
  fclose(f);
  snprintf(args, sizeof args, "--model %s/t5-tiny --requests %s", TD_TEST_DATA, req);
  char **lines;
  int n;
  int rc = run_gen(args, &lines, &n);
  cr_expect_eq(rc, 1, "exit status %d", rc);
  cr_assert_eq(n, 10);
  const char *want[] = {NULL, "outside the vocabulary", "empty", "exceeds", "unknown field \"temprature\"",
                        "top_p", "num_return_sequences", "nope.f32", "not a JSON object", "malformed JSON"};
  for (int i = 0; i < n; i++) {
    cJSON *o = cJSON_Parse(lines[i]);
    cr_assert(o, "line %d is not JSON: %s", i, lines[i]);
    cJSON *err = cJSON_GetObjectItem(o, "error");
    if (!want[i])
      cr_expect(!err && cJSON_GetObjectItem(o, "outputs"), "line %d: %s", i, lines[i]);
    else
      cr_expect(err && strstr(err->valuestring, want[i]), "line %d: %s lacks %s", i, lines[i], want[i]);
    cJSON_Delete(o);
  }
  free_lines(lines, n);
  /* usage and model errors */
  cr_expect_eq(run_gen("--requests x", &lines, &n), 2);
  free_lines(lines, n);
  snprintf(args, sizeof args, "--model /nonexistent --requests %s", req);
  cr_expect_eq(run_gen(args, &lines, &n), 2);
  free_lines(lines, n);
}

/* Text and audio lines through the model folder's tokenizer: toy-numbers-t5's
 * answers and text to a folder without a tokenizer refused; Whisper audio,
 * its language given or detected (the shared fixture's model, where present). */
static const char *text_of(const char *line) {
  static char out[256];
  out[0] = 0;
  cJSON *j = cJSON_Parse(line);
  cJSON *o = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "outputs"), 0);
  const char *t = cJSON_GetStringValue(cJSON_GetObjectItem(o, "text"));
  const char *e = cJSON_GetStringValue(cJSON_GetObjectItem(j, "error"));
  snprintf(out, sizeof out, "%s", t ? t : e ? e : "(none)");
  cJSON_Delete(j);
  return out;
}

Test(generate_cli, text_and_audio_lines) {
  char req[512], args[1600];
  snprintf(req, sizeof req, "%s/text.jsonl", dir);
  FILE *f = fopen(req, "w");
  fprintf(f, "{\"id\": \"a\", \"text\": \"forty two\"}\n{\"id\": \"b\", \"text\": \"twelve thousand\", \"num_beams\": 2}\n"
             "{\"id\": \"c\", \"text\": \"bad \\u00e9 \xff\"}\n{\"id\": \"d\", \"input_ids\": [31, 1]}\n");
  fclose(f);
  snprintf(args, sizeof args, "--model %s/toy-numbers-t5 --requests %s", TD_TEST_DATA, req);
  char **lines;
  int n;
  cr_expect_eq(run_gen(args, &lines, &n), 1, "a refused line makes the exit status 1");
  cr_assert_eq(n, 4);
  cr_expect_str_eq(text_of(lines[0]), "42");
  cr_expect_str_eq(text_of(lines[1]), "12000");
  cr_expect(strstr(text_of(lines[2]), "not UTF-8"), "%s", lines[2]);
  cr_expect_str_eq(text_of(lines[3]), "7", "ids in, text out");
  free_lines(lines, n);
  /* a folder without a tokenizer */
  snprintf(args, sizeof args, "--model %s/t5-tiny --requests %s", TD_TEST_DATA, req);
  cr_expect_eq(run_gen(args, &lines, &n), 1);
  cr_assert_eq(n, 4);
  cr_expect(strstr(text_of(lines[0]), "text input needs a tokenizer"), "%s", lines[0]);
  cr_expect(strstr(lines[3], "\"tokens\"") && !strstr(lines[3], "\"text\""), "%s", lines[3]);
  free_lines(lines, n);
}

Test(generate_cli, whisper_audio_lines) {
  char model[512], probe[600];
  snprintf(model, sizeof model, "%s/toy-numbers-whisper", TD_FIXTURES_DIR);
  snprintf(probe, sizeof probe, "%s/model.safetensors", model);
  cr_assert(access(probe, R_OK) == 0, "%s is missing (tests/data/toy-numbers-whisper)", probe);
  char req[512], args[1600];
  snprintf(req, sizeof req, "%s/audio.jsonl", dir);
  FILE *f = fopen(req, "w");
  const char *wav = TD_TEST_DATA "/audio/toy-numbers-whisper";
  fprintf(f, "{\"id\": \"a\", \"audio\": \"%s/number-4207.wav\", \"language\": \"en\"}\n", wav);
  fprintf(f, "{\"id\": \"b\", \"audio\": \"%s/number-55.wav\"}\n", wav);
  fprintf(f, "{\"id\": \"c\", \"audio\": \"%s/number-38.wav\", \"language\": \"xx\"}\n", wav);
  fclose(f);
  snprintf(args, sizeof args, "--model %s --requests %s", model, req);
  char **lines;
  int n;
  cr_expect_eq(run_gen(args, &lines, &n), 1);
  cr_assert_eq(n, 3);
  cr_expect_str_eq(text_of(lines[0]), " 4207");
  cr_expect_str_eq(text_of(lines[1]), " 55", "the language detected");
  cr_expect(strstr(text_of(lines[2]), "language \"xx\" is not one this Whisper checkpoint knows"), "%s", lines[2]);
  free_lines(lines, n);
}

/* Appends the PCM of a 16 kHz mono 16-bit WAV to out. */
static void append_pcm(const char *path, FILE *out, size_t *bytes) {
  FILE *f = fopen(path, "rb");
  cr_assert(f, "%s", path);
  unsigned char h[12], c[8];
  cr_assert_eq(fread(h, 1, 12, f), 12u);
  while (fread(c, 1, 8, f) == 8) {
    size_t n = (size_t)c[4] | (size_t)c[5] << 8 | (size_t)c[6] << 16 | (size_t)c[7] << 24;
    if (memcmp(c, "data", 4)) {
      fseek(f, (long)(n + (n & 1)), SEEK_CUR);
      continue;
    }
    char *b = malloc(n);
    cr_assert_eq(fread(b, 1, n, f), n);
    fwrite(b, 1, n, out);
    free(b);
    *bytes += n;
    break;
  }
  fclose(f);
}

static void le32(unsigned char *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* Audio past the toy's 4 s window: long-form, a window at a time (the toy
 * predicts one timestamp past the window and EOS: a segment a window, no
 * text); the language detected from the first window; every window skipped
 * when every one is "no speech"; settings out of range refused. */
Test(generate_cli, whisper_long_audio_lines) {
  char model[512], wav[512], req[512], args[1600];
  snprintf(model, sizeof model, "%s/toy-numbers-whisper", TD_FIXTURES_DIR);
  snprintf(wav, sizeof wav, "%s/long.wav", dir);
  FILE *w = fopen(wav, "wb");
  unsigned char h[44] = "RIFF....WAVEfmt ";
  fwrite(h, 1, 44, w);
  size_t bytes = 0;
  const char *names[] = {"number-4207", "number-1999", "number-305", "number-42"};
  for (int i = 0; i < 4; i++) {
    char p[512];
    snprintf(p, sizeof p, "%s/audio/toy-numbers-whisper/%s.wav", TD_TEST_DATA, names[i]);
    append_pcm(p, w, &bytes);
  }
  le32(h + 4, (uint32_t)(36 + bytes));
  le32(h + 16, 16);
  h[20] = 1, h[21] = 0, h[22] = 1, h[23] = 0;
  le32(h + 24, 16000);
  le32(h + 28, 32000);
  h[32] = 2, h[33] = 0, h[34] = 16, h[35] = 0;
  memcpy(h + 36, "data", 4);
  le32(h + 40, (uint32_t)bytes);
  fseek(w, 0, SEEK_SET);
  fwrite(h, 1, 44, w);
  fclose(w);
  int windows = (int)((bytes / 2 / 160 + 399) / 400);
  snprintf(req, sizeof req, "%s/long.jsonl", dir);
  FILE *f = fopen(req, "w");
  fprintf(f, "{\"id\": \"a\", \"audio\": \"%s\", \"language\": \"en\", \"temperature_increment_on_fallback\": 0}\n", wav);
  fprintf(f, "{\"id\": \"b\", \"audio\": \"%s\", \"temperature_increment_on_fallback\": 0}\n", wav);
  fprintf(f, "{\"id\": \"c\", \"audio\": \"%s\", \"language\": \"en\", \"logprob_threshold\": 0, "
             "\"no_speech_threshold\": 0}\n", wav);
  fprintf(f, "{\"id\": \"d\", \"audio\": \"%s\", \"logprob_threshold\": 2}\n", wav);
  fclose(f);
  snprintf(args, sizeof args, "--model %s --requests %s", model, req);
  char **lines;
  int n;
  cr_expect_eq(run_gen(args, &lines, &n), 1, "one line is refused");
  cr_assert_eq(n, 4);
  for (int k = 0; k < 2; k++) {
    cJSON *j = cJSON_Parse(lines[k]);
    cr_assert(j, "%s", lines[k]);
    const cJSON *o = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "outputs"), 0);
    cr_assert(o, "%s", lines[k]);
    const cJSON *segs = cJSON_GetObjectItem(o, "segments");
    cr_expect_eq(cJSON_GetArraySize(segs), windows, "%s", lines[k]);
    cr_expect_eq(cJSON_GetArraySize(cJSON_GetObjectItem(o, "tokens")), windows, "%s", lines[k]);
    for (int i = 0; i < cJSON_GetArraySize(segs); i++)
      cr_expect_eq(cJSON_GetObjectItem(cJSON_GetArrayItem(segs, i), "start")->valuedouble, 4.0 * i, "%s", lines[k]);
    cJSON_Delete(j);
  }
  cr_expect_str_eq(strstr(lines[0], "\"outputs\""), strstr(lines[1], "\"outputs\""), "detected: English, the same");
  cr_expect(strstr(lines[2], "\"tokens\":[],\"text\":\"\",\"segments\":[]"), "every window skipped: %s", lines[2]);
  cr_expect(strstr(lines[3], "logprob_threshold: 2"), "%s", lines[3]);
  free_lines(lines, n);
}

/* Whether the stderr of the last run holds text. */
static bool stderr_has(const char *text) {
  char p[512];
  snprintf(p, sizeof p, "%s/stderr.txt", dir);
  FILE *f = fopen(p, "r");
  if (!f) return false;
  char buf[8192];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  return strstr(buf, text) != NULL;
}

/* The encoder cache (on by default): every fixture request twice in one
 * file, the second copy from the cache, with the same tokens; the
 * summary counts the hits; --encoder-cache-fraction is checked loudly. */
Test(generate_cli, repeated_inputs_hit_the_encoder_cache) {
  const char *models[] = {"t5-tiny", "whisper-tiny"};
  for (int m = 0; m < 2; m++) {
    fixture fx;
    fx_load(models[m], &fx);
    char once[512], twice[512], args[1600], want[64];
    snprintf(once, sizeof once, "%s/once.jsonl", dir);
    snprintf(twice, sizeof twice, "%s/twice.jsonl", dir);
    fx_write_requests(&fx, once, "\"forced_bos_token_id\": null, \"forced_eos_token_id\": null");
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "cat %s %s > %s", once, once, twice);
    cr_assert(system(cmd) == 0);
    for (int cached = 1; cached >= 0; cached--) {
      snprintf(args, sizeof args, "--model %s --requests %s --block-size 4 --max-batch 8%s", fx.dir, twice,
               cached ? "" : " --encoder-cache-fraction 0");
      char **lines;
      int n;
      cr_assert_eq(run_gen(args, &lines, &n), 0, "%s: tandem-generate failed", models[m]);
      cr_assert_eq(n, 2 * fx.n);
      /* the same tokens (scores may differ in the last bits: the batches differ) */
      for (int i = 0; i < fx.n; i++) {
        cJSON *a = cJSON_Parse(lines[i]), *b = cJSON_Parse(lines[fx.n + i]);
        cr_assert(a && b);
        cJSON *oa = cJSON_GetArrayItem(cJSON_GetObjectItem(a, "outputs"), 0);
        cJSON *ob = cJSON_GetArrayItem(cJSON_GetObjectItem(b, "outputs"), 0);
        char *ta = cJSON_PrintUnformatted(cJSON_GetObjectItem(oa, "tokens"));
        char *tb = cJSON_PrintUnformatted(cJSON_GetObjectItem(ob, "tokens"));
        cr_expect(ta && tb && !strcmp(ta, tb), "%s request %d: the repeat answers %s, the first %s", models[m], i,
                  tb, ta);
        free(ta);
        free(tb);
        cJSON_Delete(a);
        cJSON_Delete(b);
      }
      snprintf(want, sizeof want, "encoder cache: %d hits, %d misses", cached ? fx.n : 0, cached ? fx.n : 0);
      cr_expect(stderr_has(want), "%s: stderr lacks \"%s\"", models[m], want);
      snprintf(want, sizeof want, "for %d requests", cached ? fx.n : 2 * fx.n);
      cr_expect(stderr_has(want), "%s: stderr lacks \"%s\" (encoder runs)", models[m], want);
      free_lines(lines, n);
    }
    fx_free(&fx);
  }
  char **lines;
  int n;
  cr_expect_eq(run_gen("--model /nonexistent --requests - --encoder-cache-fraction 1.5", &lines, &n), 2);
  cr_expect(stderr_has("--encoder-cache-fraction 1.5: in [0, 1]"));
  free_lines(lines, n);
}
