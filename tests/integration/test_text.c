/* Text and audio through the cluster: the router (--tokenizer) turns text
 * into ids and audio into Whisper's features and prompt at admission, and
 * results carry text. The trained toy models give answers a person can
 * check: toy-numbers-t5 (number words to digits, in tests/data) and
 * toy-numbers-whisper (spoken numbers; its model is in the shared fixtures,
 * its wavs in tests/data/audio; skipped where the model is absent). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <criterion/criterion.h>

#include "cluster_util.h"
#include "common/defaults.h"

#define T5 TD_SOURCE_DIR "/tests/data/toy-numbers-t5"
#define WAVS TD_SOURCE_DIR "/tests/data/audio/toy-numbers-whisper"
#define MAXC 16

static cJSON *load_json(const char *path) {
  FILE *f = fopen(path, "rb");
  cr_assert(f, "%s", path);
  static char buf[1 << 16];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  cJSON *j = cJSON_Parse(buf);
  cr_assert(j, "%s", path);
  return j;
}

/* Runs cmd; its result lines (tandem-client's) into out. */
static int run_client(const char *cmd, outcome *out, int cap) {
  FILE *p = popen(cmd, "r");
  cr_assert(p, "%s", cmd);
  int n = read_results(p, out, cap);
  pclose(p);
  return n;
}

/* A request as a request line would give it, filled by hand (so that the
 * router, not the client's parser, meets what is wrong with it). */
static void blank(td_json_request *r, const char *id) {
  memset(r, 0, sizeof *r);
  td_request_params_default(&r->params);
  snprintf(r->id, sizeof r->id, "%s", id);
}

static void expect_refused(const outcome *o, const char *says) {
  cr_expect(o->done && o->status != TD_OK, "%s: not refused", o->id);
  cr_expect(strstr(o->error, says), "%s: \"%s\" does not say \"%s\"", o->id, o->error, says);
}

static char *strip(char *s) {
  while (*s == ' ') s++;
  size_t n = strlen(s);
  while (n && s[n - 1] == ' ') s[--n] = 0;
  return s;
}

Test(text, t5_text_in_text_out, .timeout = 300) {
  cluster c;
  cluster_opts o = {.model = T5, .encoders = 1, .decodes = 1, .router_extra = "--tokenizer " T5};
  cluster_start(&c, &o);
  cJSON *ex = load_json(T5 "/examples.json"), *cases = cJSON_GetObjectItem(ex, "cases");
  int n = cJSON_GetArraySize(cases);
  cr_assert(n > 0 && n <= MAXC);
  /* every example as a request line through tandem-client */
  char path[600], cmd[2048];
  snprintf(path, sizeof path, "%s/text.jsonl", c.dir);
  FILE *f = fopen(path, "w");
  for (int i = 0; i < n; i++)
    fprintf(f, "{\"id\": \"e%d\", \"text\": \"%s\"}\n", i, cJSON_GetObjectItem(cJSON_GetArrayItem(cases, i), "text")->valuestring);
  fclose(f);
  snprintf(cmd, sizeof cmd, "%s/tandem-client --router %s --requests %s --timeout-ms 60000", TD_BIN_DIR, c.client_ep,
           path);
  static outcome got[MAXC];
  cr_assert_eq(run_client(cmd, got, MAXC), n);
  for (int i = 0; i < n; i++) {
    const cJSON *e = cJSON_GetArrayItem(cases, i), *want = cJSON_GetObjectItem(e, "greedy_tokens");
    const char *text = cJSON_GetObjectItem(e, "text")->valuestring;
    const char *answer = cJSON_GetObjectItem(e, "output_text")->valuestring;
    cr_assert_eq(got[i].status, TD_OK, "\"%s\": %s", text, got[i].error);
    cr_expect(got[i].has_text[0], "\"%s\": no text in the result", text);
    cr_expect_str_eq(got[i].text[0], answer, "\"%s\" gave \"%s\", transformers \"%s\"", text, got[i].text[0], answer);
    cr_expect_eq(got[i].len[0], cJSON_GetArraySize(want), "\"%s\": %d tokens", text, got[i].len[0]);
    for (int k = 0; k < got[i].len[0] && k < cJSON_GetArraySize(want); k++)
      cr_expect_eq(got[i].tok[0][k], cJSON_GetArrayItem(want, k)->valueint, "\"%s\": token %d", text, k);
  }
  /* --text, streamed: the text deltas add up to the result's text */
  snprintf(cmd, sizeof cmd,
           "%s/tandem-client --router %s --text 'four thousand two hundred seven' --stream --timeout-ms 60000",
           TD_BIN_DIR, c.client_ep);
  FILE *p = popen(cmd, "r");
  cr_assert(p);
  char line[4096], deltas[256] = "", result[256] = "";
  while (fgets(line, sizeof line, p)) {
    cJSON *j = cJSON_Parse(line);
    cr_assert(j, "%s", line);
    const cJSON *outs = cJSON_GetObjectItem(j, "outputs");
    if (outs) {
      snprintf(result, sizeof result, "%s", cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetArrayItem(outs, 0), "text")));
    } else if (cJSON_GetStringValue(cJSON_GetObjectItem(j, "text"))) {
      size_t l = strlen(deltas);
      snprintf(deltas + l, sizeof deltas - l, "%s", cJSON_GetStringValue(cJSON_GetObjectItem(j, "text")));
    }
    cJSON_Delete(j);
  }
  pclose(p);
  cr_expect_str_eq(result, "4207");
  cr_expect_str_eq(deltas, "4207", "streamed text \"%s\"", deltas);
  /* the library, streamed, several at once */
  td_json_request reqs[3];
  const char *texts[3] = {"ninety thousand one", "twelve thousand", "one hundred"};
  const char *answers[3] = {"90001", "12000", "100"};
  for (int i = 0; i < 3; i++) {
    blank(&reqs[i], texts[i]);
    reqs[i].text = strdup(texts[i]);
  }
  outcome lib[3];
  run_requests(c.client_ep, reqs, 3, true, 30000, lib);
  for (int i = 0; i < 3; i++) {
    cr_expect(lib[i].status == TD_OK, "%s: %s", texts[i], lib[i].error);
    cr_expect_str_eq(lib[i].text[0], answers[i], "%s", texts[i]);
    cr_expect_str_eq(lib[i].streamed_text, answers[i], "%s: streamed \"%s\"", texts[i], lib[i].streamed_text);
    td_json_request_free(&reqs[i]);
  }
  /* what the router refuses, each with its reason */
  td_json_request bad[5];
  blank(&bad[0], "bad-utf8");
  bad[0].text = strdup("forty \xff\xfe two");
  blank(&bad[1], "text-and-ids");
  bad[1].text = strdup("seven");
  bad[1].input_ids = malloc(sizeof(int32_t) * 2);
  bad[1].input_ids[0] = 31;
  bad[1].input_ids[1] = 1;
  bad[1].n_input = 2;
  blank(&bad[2], "audio-to-t5");
  bad[2].audio = (uint8_t *)strdup("RIFF....WAVE");
  bad[2].audio_len = 12;
  blank(&bad[3], "text-too-long");
  bad[3].text = malloc(TD_MAX_TEXT_BYTES + 2);
  memset(bad[3].text, 'a', TD_MAX_TEXT_BYTES + 1);
  bad[3].text[TD_MAX_TEXT_BYTES + 1] = 0;
  blank(&bad[4], "language-with-text");
  bad[4].text = strdup("seven");
  snprintf(bad[4].language, sizeof bad[4].language, "en");
  outcome r[5];
  run_requests(c.client_ep, bad, 5, false, 30000, r);
  expect_refused(&r[0], "not UTF-8");
  expect_refused(&r[1], "give exactly one of input_ids, features, text and audio, not input_ids and text");
  expect_refused(&r[2], "preprocessor_config.json");
  expect_refused(&r[3], "exceeds the limit");
  expect_refused(&r[4], "go with audio input only");
  for (int i = 0; i < 5; i++) td_json_request_free(&bad[i]);
  cJSON_Delete(ex);
  cr_expect(cluster_stop(&c));
}

Test(text, a_router_without_tokenizer_refuses_text, .timeout = 300) {
  cluster c;
  cluster_opts o = {.model = T5, .decodes = 1};
  cluster_start(&c, &o);
  td_json_request q[2];
  blank(&q[0], "text");
  q[0].text = strdup("seven");
  blank(&q[1], "ids");
  q[1].input_ids = malloc(sizeof(int32_t) * 2);
  q[1].input_ids[0] = 31;
  q[1].input_ids[1] = 1;
  q[1].n_input = 2;
  outcome r[2];
  run_requests(c.client_ep, q, 2, false, 30000, r);
  expect_refused(&r[0], "needs a tokenizer at the router (tandem-router --tokenizer DIR)");
  cr_expect(r[1].status == TD_OK, "%s", r[1].error);
  cr_expect(!r[1].has_text[0], "a result with text from a router without a tokenizer");
  for (int i = 0; i < 2; i++) td_json_request_free(&q[i]);
  cr_expect(cluster_stop(&c));
}

/* A WAV of `seconds` of silence at 16 kHz. */
static void write_silence(const char *path, double seconds) {
  uint32_t n = (uint32_t)(seconds * 16000), bytes = n * 2;
  FILE *f = fopen(path, "wb");
  cr_assert(f);
  uint32_t u32;
  uint16_t u16;
  fwrite("RIFF", 1, 4, f);
  u32 = 36 + bytes;
  fwrite(&u32, 4, 1, f);
  fwrite("WAVEfmt ", 1, 8, f);
  u32 = 16;
  fwrite(&u32, 4, 1, f);
  u16 = 1;
  fwrite(&u16, 2, 1, f); /* PCM */
  fwrite(&u16, 2, 1, f); /* mono */
  u32 = 16000;
  fwrite(&u32, 4, 1, f);
  u32 = 32000;
  fwrite(&u32, 4, 1, f);
  u16 = 2;
  fwrite(&u16, 2, 1, f);
  u16 = 16;
  fwrite(&u16, 2, 1, f);
  fwrite("data", 1, 4, f);
  fwrite(&bytes, 4, 1, f);
  for (uint32_t i = 0; i < n; i++) fwrite("\0\0", 1, 2, f);
  fclose(f);
}

Test(text, whisper_audio_in_text_out, .timeout = 600) {
  char model[600];
  snprintf(model, sizeof model, "%s/toy-numbers-whisper", TD_FIXTURES_DIR);
  char probe[700];
  snprintf(probe, sizeof probe, "%s/model.safetensors", model);
  cr_assert(access(probe, R_OK) == 0, "%s is missing (tests/data/toy-numbers-whisper)", probe);
  char extra[700];
  snprintf(extra, sizeof extra, "--tokenizer %s", model);
  cluster c;
  cluster_opts o = {.model = model, .decodes = 1, .router_extra = extra};
  cluster_start(&c, &o);
  snprintf(probe, sizeof probe, "%s/examples.json", model);
  cJSON *ex = load_json(probe);
  cJSON *cases = cJSON_GetObjectItem(ex, "cases");
  int n = cJSON_GetArraySize(cases);
  cr_assert(n > 0 && n <= MAXC);
  /* each wav through tandem-client --audio; then all of them as request lines, the
   * language left to detection (transformers' detect_language: one step over the
   * language tokens; this model was trained on <|en|>) */
  char path[600], cmd[2048];
  snprintf(path, sizeof path, "%s/audio.jsonl", c.dir);
  FILE *f = fopen(path, "w");
  static outcome got[MAXC];
  for (int i = 0; i < n; i++) {
    const char *wav = cJSON_GetObjectItem(cJSON_GetArrayItem(cases, i), "audio")->valuestring;
    fprintf(f, "{\"id\": \"%s\", \"audio\": \"%s/%s\"}\n", wav, WAVS, wav);
    snprintf(cmd, sizeof cmd, "%s/tandem-client --router %s --audio %s/%s --language en --timeout-ms 60000",
             TD_BIN_DIR, c.client_ep, WAVS, wav);
    cr_assert_eq(run_client(cmd, &got[i], 1), 1, "%s", wav);
  }
  fclose(f);
  static outcome lines[MAXC];
  snprintf(cmd, sizeof cmd, "%s/tandem-client --router %s --requests %s --timeout-ms 60000", TD_BIN_DIR, c.client_ep,
           path);
  cr_assert_eq(run_client(cmd, lines, MAXC), n);
  for (int i = 0; i < n; i++) {
    const cJSON *e = cJSON_GetArrayItem(cases, i), *want = cJSON_GetObjectItem(e, "greedy_tokens");
    const char *wav = cJSON_GetObjectItem(e, "audio")->valuestring;
    /* transformers' text, stripped (the fixture's note); one case is the model's own mistake */
    const char *answer = cJSON_GetObjectItem(e, "text")->valuestring;
    for (int k = 0; k < 2; k++) {
      outcome *g = k ? &lines[i] : &got[i];
      cr_assert_eq(g->status, TD_OK, "%s: %s", wav, g->error);
      cr_expect_str_eq(strip(g->text[0]), answer, "%s gave \"%s\", transformers \"%s\"", wav, g->text[0], answer);
      /* the greedy tokens up to the first <|endoftext|> */
      for (int t = 0; t < g->len[0] && t < cJSON_GetArraySize(want); t++)
        cr_expect_eq(g->tok[0][t], cJSON_GetArrayItem(want, t)->valueint, "%s: token %d", wav, t);
    }
  }
  /* timestamps: the prompt without <|notimestamps|>, transformers' timestamp rules (the
   * first token a timestamp; this model never learnt them), segments in the result */
  snprintf(cmd, sizeof cmd, "%s/tandem-client --router %s --audio %s/number-42.wav --timestamps --timeout-ms 60000",
           TD_BIN_DIR, c.client_ep, WAVS);
  FILE *p = popen(cmd, "r");
  cr_assert(p);
  char line[4096] = "";
  cr_assert(fgets(line, sizeof line, p), "no result line");
  pclose(p);
  cJSON *j = cJSON_Parse(line), *o0 = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "outputs"), 0);
  cr_assert(o0, "%s", line);
  cr_expect(cJSON_GetArrayItem(cJSON_GetObjectItem(o0, "tokens"), 0)->valueint >= 50365, "%s", line);
  cr_expect(cJSON_IsArray(cJSON_GetObjectItem(o0, "segments")), "no segments: %s", line);
  cJSON_Delete(j);
  /* refusals: a truncated file, audio past the 4 s window, an unknown language or task, text */
  char trunc[600], longw[600];
  snprintf(trunc, sizeof trunc, "%s/trunc.wav", c.dir);
  snprintf(cmd, sizeof cmd, "head -c 3000 %s/number-42.wav > %s", WAVS, trunc);
  cr_assert_eq(system(cmd), 0);
  snprintf(longw, sizeof longw, "%s/long.wav", c.dir);
  write_silence(longw, 5.0);
  td_json_request bad[6];
  const char *files[2] = {trunc, longw};
  for (int i = 0; i < 2; i++) {
    blank(&bad[i], i ? "long" : "truncated");
    FILE *af = fopen(files[i], "rb");
    cr_assert(af);
    bad[i].audio = malloc(1 << 20);
    bad[i].audio_len = fread(bad[i].audio, 1, 1 << 20, af);
    fclose(af);
    snprintf(bad[i].language, sizeof bad[i].language, "en");
  }
  blank(&bad[2], "unknown-language");
  FILE *af = fopen(WAVS "/number-7.wav", "rb");
  cr_assert(af);
  bad[2].audio = malloc(1 << 20);
  bad[2].audio_len = fread(bad[2].audio, 1, 1 << 20, af);
  fclose(af);
  snprintf(bad[2].language, sizeof bad[2].language, "xx");
  blank(&bad[3], "bad-task");
  bad[3].audio = malloc(bad[2].audio_len);
  memcpy(bad[3].audio, bad[2].audio, bad[2].audio_len);
  bad[3].audio_len = bad[2].audio_len;
  snprintf(bad[3].language, sizeof bad[3].language, "en");
  snprintf(bad[3].task, sizeof bad[3].task, "summarize");
  blank(&bad[4], "text-to-whisper");
  bad[4].text = strdup("seven");
  blank(&bad[5], "not-audio");
  bad[5].audio = (uint8_t *)strdup("this is not a sound file at all");
  bad[5].audio_len = strlen((char *)bad[5].audio);
  snprintf(bad[5].language, sizeof bad[5].language, "en");
  outcome r[6];
  run_requests(c.client_ep, bad, 6, false, 30000, r);
  expect_refused(&r[0], "truncated");
  expect_refused(&r[1], "longer audio is transcribed long-form by tandem-gateway");
  expect_refused(&r[2], "language \"xx\" is not one this Whisper checkpoint knows");
  expect_refused(&r[3], "neither \"transcribe\" nor \"translate\"");
  expect_refused(&r[4], "takes audio or audio features, not input_ids or text");
  expect_refused(&r[5], "not audio in a known format");
  for (int i = 0; i < 6; i++) td_json_request_free(&bad[i]);
  /* any bytes in, an answer out: random audio behind each format's magic, cut and
   * flipped real files, random text; the router keeps serving */
  enum { NF = 48 };
  static td_json_request fz[NF];
  static outcome fo[NF];
  FILE *wf = fopen(WAVS "/number-42.wav", "rb");
  cr_assert(wf);
  static uint8_t real[1 << 16];
  size_t n_real = fread(real, 1, sizeof real, wf);
  fclose(wf);
  const char *magic[4] = {"RIFF", "fLaC", "OggS", "RIFF\x24\x00\x00\x00WAVEfmt "};
  srand(35);
  for (int i = 0; i < NF; i++) {
    char id[32];
    snprintf(id, sizeof id, "fuzz-%d", i);
    blank(&fz[i], id);
    size_t len = 1 + (size_t)rand() % 4096;
    uint8_t *b = malloc(n_real + 64);
    if (i % 3 == 2) { /* a real file, cut and with bytes flipped */
      len = 1 + (size_t)rand() % n_real;
      memcpy(b, real, len);
      for (int k = 0; k < 4; k++) b[(size_t)rand() % len] ^= (uint8_t)(1 + rand() % 255);
    } else {
      for (size_t k = 0; k < len; k++) b[k] = (uint8_t)rand();
      const char *m = magic[i % 4];
      size_t ml = i % 4 == 3 ? 16 : 4;
      if (len > ml) memcpy(b, m, ml);
    }
    if (i % 4 == 1) { /* as text: random bytes, NUL-terminated */
      b[len - 1] = 0;
      for (size_t k = 0; k + 1 < len; k++) b[k] = b[k] ? b[k] : 'x';
      fz[i].text = (char *)b;
    } else {
      fz[i].audio = b;
      fz[i].audio_len = len;
      snprintf(fz[i].language, sizeof fz[i].language, "en");
    }
  }
  run_requests(c.client_ep, fz, NF, false, 30000, fo);
  for (int i = 0; i < NF; i++) {
    cr_expect(fo[i].done, "%s: no answer", fo[i].id);
    cr_expect(fo[i].status == TD_OK || fo[i].error[0], "%s: an error without a message", fo[i].id);
    td_json_request_free(&fz[i]);
  }
  td_client_health h;
  cr_expect(cluster_health(&c, &h) && h.serving, "the router stopped serving after the fuzzed requests");
  cJSON_Delete(ex);
  cr_expect(cluster_stop(&c));
}

/* deploy/local.sh --demo as a new user runs it: the bundled toy-numbers-t5,
 * text in, answers a person can check out (each result's id is its
 * question), and a readable "question  ->  answer" line each. */
Test(text, local_sh_demo_answers, .timeout = 300) {
  char dir[] = "/tmp/td-local-text-XXXXXX";
  cr_assert(mkdtemp(dir));
  char cmd[2048], p[600];
  snprintf(cmd, sizeof cmd, "TANDEM_BIN=%s %s/deploy/local.sh --demo --run-dir %s/run > %s/out.txt 2> %s/err.txt",
           TD_BIN_DIR, TD_SOURCE_DIR, dir, dir, dir);
  int rc = system(cmd);
  cr_expect(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "local.sh --demo exited %d (logs in %s)", rc, dir);
  snprintf(p, sizeof p, "%s/out.txt", dir);
  FILE *f = fopen(p, "r");
  cr_assert(f);
  static outcome got[MAXC];
  int n = read_results(f, got, MAXC);
  fclose(f);
  cr_assert(n >= 5, "%d demo results", n);
  cJSON *ex = load_json(T5 "/examples.json"), *cases = cJSON_GetObjectItem(ex, "cases");
  int checked = 0;
  for (int i = 0; i < n; i++) {
    cr_expect_eq(got[i].status, TD_OK, "%s: %s", got[i].id, got[i].error);
    cr_expect(got[i].has_text[0], "%s: no text", got[i].id);
    /* the id is the question, or the question and what else it asks for in brackets */
    char q[64];
    snprintf(q, sizeof q, "%s", got[i].id);
    char *br = strstr(q, " (");
    if (br) *br = 0;
    for (int k = 0; k < cJSON_GetArraySize(cases); k++) {
      const cJSON *e = cJSON_GetArrayItem(cases, k);
      if (strcmp(cJSON_GetObjectItem(e, "text")->valuestring, q)) continue;
      cr_expect_str_eq(got[i].text[0], cJSON_GetObjectItem(e, "expected")->valuestring, "\"%s\"", q);
      checked++;
    }
  }
  cr_expect_eq(checked, n, "%d of the %d demo questions are examples.json's", checked, n);
  snprintf(cmd, sizeof cmd, "grep -qx '  forty two  ->  42' %s/out.txt", dir);
  cr_expect_eq(system(cmd), 0, "no readable \"forty two  ->  42\" line");
  /* every process it started is gone: its supervisor logged its end and
   * removed both pid files (deploy/supervise.sh) */
  const char *names[] = {"router", "encoder-0", "prefill-0", "decode-0"};
  for (int i = 0; i < 4; i++) {
    snprintf(p, sizeof p, "%s/run/%s.pid", dir, names[i]);
    cr_expect(access(p, F_OK) != 0, "%s.pid is left: the process may still run", names[i]);
    snprintf(p, sizeof p, "%s/run/%s.supervisor.pid", dir, names[i]);
    cr_expect(access(p, F_OK) != 0, "%s.supervisor.pid is left", names[i]);
    snprintf(cmd, sizeof cmd, "grep -q '^supervise: .* %s: stopped: ' %s/run/%s.log", names[i], dir, names[i]);
    cr_expect_eq(system(cmd), 0, "%s: its supervisor did not log its end", names[i]);
  }
  cJSON_Delete(ex);
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  cr_expect(system(cmd) == 0);
}

/* tandem-client's own refusals: one input, the audio options with --audio. */
Test(text, client_flags) {
  const char *bad[] = {"--text seven --requests x.jsonl", "--text seven --audio x.wav", "--text seven --language en",
                       "--requests x.jsonl --timestamps", ""};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "%s/tandem-client --router tcp://127.0.0.1:1 %s > /dev/null 2>&1", TD_BIN_DIR, bad[i]);
    int rc = system(cmd);
    cr_expect(WIFEXITED(rc) && WEXITSTATUS(rc) == 2, "tandem-client %s: exit %d, want 2", bad[i], rc);
  }
}
