/* Tokenizers against transformers' own outputs: every case file under
 * tests/data/tokenizers/NAME/cases*.json (NAME/ is a checkpoint folder;
 * tests/tools/make_tokenizer_fixtures.py writes cases.transformers.json),
 * streaming decode equal to one-shot decode, and clear errors for bad ids,
 * bad text and bad tokenizer files.
 *
 * cases.json: {"cases": [{"text" | "text_hex", "ids", "decode_ids",
 * "decoded", "decoded_skip"}...]}: ids is encode(text) with special tokens;
 * decoded / decoded_skip are decode(decode_ids or ids) without / with
 * skip_special_tokens (decoded_skip_strip: compared with the white space
 * around it stripped). Any field may be absent. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <criterion/criterion.h>

#include "frontend/tokenizer.h"

#define TOK_DIR TD_TEST_DATA "/tokenizers"

static char *slurp(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *b = malloc((size_t)n + 1);
  cr_assert(b);
  cr_assert_eq(fread(b, 1, (size_t)n, f), (size_t)n);
  fclose(f);
  b[n] = 0;
  if (len) *len = (size_t)n;
  return b;
}

static td_tokenizer *load(const char *name) {
  char dir[512];
  snprintf(dir, sizeof dir, "%s/%s", TOK_DIR, name);
  td_tokenizer *t = NULL;
  cr_assert_eq(td_tokenizer_load(dir, NULL, &t), TD_OK, "%s: %s", name, td_errmsg());
  return t;
}

static int32_t *json_ids(const cJSON *a, size_t *n) {
  *n = (size_t)cJSON_GetArraySize(a);
  int32_t *v = malloc((*n + 1) * sizeof *v);
  const cJSON *e;
  size_t i = 0;
  cJSON_ArrayForEach(e, a) v[i++] = (int32_t)e->valuedouble;
  return v;
}

static char *ids_str(const int32_t *v, size_t n) {
  static char buf[8192];
  size_t k = 0;
  buf[0] = 0;
  for (size_t i = 0; i < n && k + 16 < sizeof buf; i++) k += (size_t)snprintf(buf + k, sizeof buf - k, "%s%d", i ? "," : "", v[i]);
  return buf;
}

/* The streamed pieces joined; checks each piece is whole UTF-8. */
static char *stream(const td_tokenizer *t, const int32_t *ids, size_t n, bool skip) {
  td_detok *d;
  cr_assert_eq(td_detok_create(t, skip, &d), TD_OK);
  size_t cap = 1024, len = 0;
  char *s = malloc(cap);
  for (size_t i = 0; i <= n; i++) {
    const char *p;
    size_t k;
    td_status st = i < n ? td_detok_push(d, ids[i], &p, &k) : td_detok_finish(d, &p, &k);
    cr_assert_eq(st, TD_OK, "stream step %zu of [%s]: %s", i, ids_str(ids, n), td_errmsg());
    if (k) { /* a piece never ends inside a character */
      size_t q = k - 1;
      while (q > 0 && ((uint8_t)p[q] & 0xC0) == 0x80) q--;
      uint8_t lead = (uint8_t)p[q];
      size_t want = lead < 0x80 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
      cr_assert_eq(k - q, want, "stream piece splits a character");
    }
    while (len + k + 1 > cap) s = realloc(s, cap *= 2);
    memcpy(s + len, p, k);
    len += k;
  }
  s[len] = 0;
  td_detok_destroy(d);
  return s;
}

static void check_decode(const td_tokenizer *t, const char *name, const int32_t *ids, size_t n, bool skip,
                         const char *want) {
  char *got = NULL;
  cr_assert_eq(td_tokenizer_decode(t, ids, n, skip, &got, NULL), TD_OK, "%s: decode: %s", name, td_errmsg());
  if (want) cr_expect_str_eq(got, want, "%s: decode [%s] skip=%d", name, ids_str(ids, n), skip);
  char *st = stream(t, ids, n, skip);
  cr_expect_str_eq(st, got, "%s: streamed decode of [%s] differs", name, ids_str(ids, n));
  free(st);
  free(got);
}

static int hexval(char c) { return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10; }

static int run_cases(const char *name, const char *file) {
  char path[768];
  snprintf(path, sizeof path, "%s/%s/%s", TOK_DIR, name, file);
  char *json = slurp(path, NULL);
  if (!json) return 0;
  cJSON *root = cJSON_Parse(json);
  cr_assert(root, "%s: cases.json does not parse", name);
  td_tokenizer *t = load(name);
  int n = 0;
  const cJSON *c;
  cJSON_ArrayForEach(c, cJSON_GetObjectItem(root, "cases")) {
    const cJSON *text = cJSON_GetObjectItem(c, "text"), *hex = cJSON_GetObjectItem(c, "text_hex");
    const cJSON *ids = cJSON_GetObjectItem(c, "ids"), *dids = cJSON_GetObjectItem(c, "decode_ids");
    char *bytes = NULL;
    size_t blen = 0;
    if (cJSON_IsString(text)) {
      blen = strlen(text->valuestring);
      bytes = strdup(text->valuestring);
    } else if (cJSON_IsString(hex)) {
      blen = strlen(hex->valuestring) / 2;
      bytes = malloc(blen + 1);
      for (size_t i = 0; i < blen; i++)
        bytes[i] = (char)(hexval(hex->valuestring[2 * i]) << 4 | hexval(hex->valuestring[2 * i + 1]));
    }
    if (bytes && cJSON_IsArray(ids)) {
      size_t nw, ng;
      int32_t *want = json_ids(ids, &nw), *got;
      cr_assert_eq(td_tokenizer_encode(t, bytes, blen, true, &got, &ng), TD_OK, "%s: encode: %s", name, td_errmsg());
      char ws[8192];
      snprintf(ws, sizeof ws, "%s", ids_str(want, nw));
      cr_expect(ng == nw && (!nw || !memcmp(got, want, nw * sizeof *got)), "%s: encode %s: got [%s], want [%s]", name,
                cJSON_IsString(text) ? text->valuestring : hex->valuestring, ids_str(got, ng), ws);
      free(got);
      free(want);
    }
    const cJSON *dec = cJSON_IsArray(dids) ? dids : ids;
    if (cJSON_IsArray(dec)) {
      size_t nd;
      int32_t *d = json_ids(dec, &nd);
      const cJSON *w0 = cJSON_GetObjectItem(c, "decoded"), *w1 = cJSON_GetObjectItem(c, "decoded_skip");
      check_decode(t, name, d, nd, false, cJSON_IsString(w0) ? w0->valuestring : NULL);
      check_decode(t, name, d, nd, true, cJSON_IsString(w1) ? w1->valuestring : NULL);
      const cJSON *w2 = cJSON_GetObjectItem(c, "decoded_skip_strip");
      if (cJSON_IsString(w2)) {
        char *got;
        size_t len;
        cr_assert_eq(td_tokenizer_decode(t, d, nd, true, &got, &len), TD_OK);
        size_t a = 0;
        while (a < len && strchr(" \t\n", got[a])) a++;
        while (len > a && strchr(" \t\n", got[len - 1])) len--;
        got[len] = 0;
        cr_expect_str_eq(got + a, w2->valuestring, "%s: decode [%s] skip=1, stripped", name, ids_str(d, nd));
        free(got);
      }
      free(d);
    }
    free(bytes);
    n++;
  }
  td_tokenizer_destroy(t);
  cJSON_Delete(root);
  free(json);
  return n;
}

Test(tokenizer, every_case_file) {
  DIR *d = opendir(TOK_DIR);
  cr_assert(d);
  struct dirent *e;
  int files = 0, cases = 0;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char sub[512];
    snprintf(sub, sizeof sub, "%s/%s", TOK_DIR, e->d_name);
    DIR *sd = opendir(sub);
    struct dirent *f;
    while (sd && (f = readdir(sd))) {
      size_t l = strlen(f->d_name);
      if (strncmp(f->d_name, "cases", 5) || l < 5 || strcmp(f->d_name + l - 5, ".json")) continue;
      cr_log_info("%s/%s", e->d_name, f->d_name);
      int k = run_cases(e->d_name, f->d_name);
      if (k) files++;
      cases += k;
    }
    if (sd) closedir(sd);
  }
  closedir(d);
  cr_assert_geq(files, 4, "case files found: %d", files);
  cr_log_info("%d cases in %d files", cases, files);
}

/* Random ids (byte-level pieces of characters, special tokens, anything):
 * the stream always equals the one-shot decode and never changes text. */
Test(tokenizer, streaming_equals_one_shot_on_random_ids) {
  static const char *names[] = {"bytelevel-bpe", "metaspace-unigram", "toy-numbers-t5", "whisper-large-v3", "marian-local"};
  uint64_t r = 42;
  for (size_t k = 0; k < sizeof names / sizeof *names; k++) {
    td_tokenizer *t = load(names[k]);
    int32_t v = td_tokenizer_vocab_size(t);
    for (int iter = 0; iter < 40; iter++) {
      int32_t ids[48];
      size_t n = 1 + iter % 48;
      for (size_t i = 0; i < n; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        int32_t id = (int32_t)((r >> 33) % (uint64_t)(iter % 3 ? 300 : v)); /* low ids: bytes and short pieces */
        if (!td_tokenizer_id_to_token(t, id)) id = 0;
        ids[i] = id;
      }
      check_decode(t, names[k], ids, n, false, NULL);
      check_decode(t, names[k], ids, n, true, NULL);
    }
    td_tokenizer_destroy(t);
  }
}

Test(tokenizer, clean_up_spaces_streams_without_changing_text) {
  td_tokenizer *t = load("bytelevel-bpe");
  const char *cfg = "{\"clean_up_tokenization_spaces\": true}";
  char path[512];
  snprintf(path, sizeof path, "%s/bytelevel-bpe/tokenizer.json", TOK_DIR);
  size_t len;
  char *json = slurp(path, &len);
  td_tokenizer *c;
  cr_assert_eq(td_tokenizer_from_json(json, len, cfg, strlen(cfg), NULL, &c), TD_OK, "%s", td_errmsg());
  cr_assert(td_tokenizer_cleans_up_spaces(c));
  const char *texts[] = {"It is n't so , right ? Yes ! I 'm here .", "a ' b 're 've 's", "end ,"};
  for (size_t i = 0; i < 3; i++) {
    int32_t *ids;
    size_t n;
    cr_assert_eq(td_tokenizer_encode(t, texts[i], strlen(texts[i]), true, &ids, &n), TD_OK);
    char *plain;
    cr_assert_eq(td_tokenizer_decode(t, ids, n, false, &plain, NULL), TD_OK);
    cr_expect_str_eq(plain, texts[i]);
    check_decode(c, "clean-up", ids, n, false, NULL);
    free(plain);
    free(ids);
  }
  char *out;
  int32_t *ids;
  size_t n;
  cr_assert_eq(td_tokenizer_encode(t, texts[0], strlen(texts[0]), true, &ids, &n), TD_OK);
  cr_assert_eq(td_tokenizer_decode(c, ids, n, false, &out, NULL), TD_OK);
  cr_expect_str_eq(out, "It isn't so, right? Yes! I'm here.");
  free(out);
  free(ids);
  free(json);
  td_tokenizer_destroy(c);
  td_tokenizer_destroy(t);
}

Test(tokenizer, whisper_special_and_timestamp_tokens) {
  td_tokenizer *t = load("whisper-large-v3");
  cr_assert_eq(td_tokenizer_vocab_size(t), 51866);
  int32_t sot = td_tokenizer_token_to_id(t, "<|startoftranscript|>"), ts = td_tokenizer_token_to_id(t, "<|0.00|>");
  cr_assert_eq(sot, 50258);
  cr_assert_eq(ts, 50365);
  cr_assert(td_tokenizer_is_special(t, sot));
  cr_assert(!td_tokenizer_is_special(t, ts), "timestamps are added tokens, not special ones");
  /* the post-processor's prefix and suffix */
  int32_t *ids;
  size_t n;
  cr_assert_eq(td_tokenizer_encode(t, "", 0, true, &ids, &n), TD_OK);
  int32_t want[] = {50258, 50259, 50360, 50364, 50257};
  cr_assert_eq(n, 5);
  cr_assert_arr_eq(ids, want, sizeof want);
  free(ids);
  /* special tokens in the text are matched whole */
  const char *txt = "<|en|>Hello<|0.00|> world";
  cr_assert_eq(td_tokenizer_encode(t, txt, strlen(txt), false, &ids, &n), TD_OK);
  cr_assert_geq(n, 4);
  cr_expect_eq(ids[0], 50259);
  char *s;
  cr_assert_eq(td_tokenizer_decode(t, ids, n, false, &s, NULL), TD_OK);
  cr_expect_str_eq(s, "<|en|>Hello world", "Whisper's decode drops timestamps");
  free(s);
  cr_assert_eq(td_tokenizer_decode(t, ids, n, true, &s, NULL), TD_OK);
  cr_expect_str_eq(s, "Hello world");
  free(s);
  check_decode(t, "whisper", ids, n, false, NULL);
  free(ids);
  /* a prompt before <|startoftranscript|> goes with skip_special_tokens */
  int32_t prev = td_tokenizer_token_to_id(t, "<|startofprev|>");
  int32_t p[] = {prev, 1614, sot, 50259, 14034, 50257};
  cr_assert_eq(td_tokenizer_decode(t, p, 6, true, &s, NULL), TD_OK);
  cr_expect_str_eq(s, " 42");
  free(s);
  check_decode(t, "whisper prompt", p, 6, true, " 42");
  td_tokenizer_destroy(t);
}

Test(tokenizer, invalid_utf8_is_replaced_or_refused) {
  td_tokenizer *t = load("bytelevel-bpe");
  const char bad[] = "ab\xC3(\xF0\x9F\x98"; /* a broken 2-byte and a truncated 4-byte sequence */
  const char fixed[] = "ab\xEF\xBF\xBD(\xEF\xBF\xBD";
  int32_t *a, *b;
  size_t na, nb;
  cr_assert_eq(td_tokenizer_encode(t, bad, sizeof bad - 1, true, &a, &na), TD_OK);
  cr_assert_eq(td_tokenizer_encode(t, fixed, sizeof fixed - 1, true, &b, &nb), TD_OK);
  cr_assert_eq(na, nb);
  cr_assert_arr_eq(a, b, na * sizeof *a, "invalid bytes encode as U+FFFD, one a maximal subpart");
  free(a);
  free(b);
  char dir[512];
  snprintf(dir, sizeof dir, "%s/bytelevel-bpe", TOK_DIR);
  td_tokenizer *s;
  td_tokenizer_opts o = {.strict_utf8 = true, .max_text_bytes = 64};
  cr_assert_eq(td_tokenizer_load(dir, &o, &s), TD_OK);
  cr_assert_eq(td_tokenizer_encode(s, bad, sizeof bad - 1, true, &a, &na), TD_ERR_INVALID);
  cr_assert(strstr(td_errmsg(), "UTF-8"), "%s", td_errmsg());
  char big[100];
  memset(big, 'a', sizeof big);
  cr_assert_eq(td_tokenizer_encode(s, big, sizeof big, true, &a, &na), TD_ERR_INVALID);
  cr_assert(strstr(td_errmsg(), "limit"), "%s", td_errmsg());
  /* NUL bytes are text like any other */
  cr_assert_eq(td_tokenizer_encode(t, "a\0b", 3, true, &a, &na), TD_OK);
  char *out;
  size_t len;
  cr_assert_eq(td_tokenizer_decode(t, a, na, false, &out, &len), TD_OK);
  cr_assert_eq(len, 3);
  cr_assert(!memcmp(out, "a\0b", 3));
  free(out);
  free(a);
  td_tokenizer_destroy(s);
  td_tokenizer_destroy(t);
}

Test(tokenizer, bad_ids_are_refused_by_value) {
  td_tokenizer *t = load("toy-numbers-t5");
  int32_t ids[] = {6, 999, 1};
  char *s;
  cr_assert_eq(td_tokenizer_decode(t, ids, 3, false, &s, NULL), TD_ERR_INVALID);
  cr_assert(strstr(td_errmsg(), "999"), "%s", td_errmsg());
  int32_t neg[] = {-1};
  cr_assert_eq(td_tokenizer_decode(t, neg, 1, true, &s, NULL), TD_ERR_INVALID);
  td_detok *d;
  cr_assert_eq(td_detok_create(t, true, &d), TD_OK);
  const char *p;
  size_t k;
  cr_assert_eq(td_detok_push(d, 19, &p, &k), TD_OK);
  cr_assert_eq(td_detok_push(d, 12345, &p, &k), TD_ERR_INVALID);
  cr_assert_eq(td_detok_push(d, 20, &p, &k), TD_OK, "a refused id leaves the stream as it was");
  cr_assert_eq(td_detok_finish(d, &p, &k), TD_OK);
  td_detok_destroy(d);
  td_tokenizer_destroy(t);
}

/* LeakSanitizer, in the sanitizer tree: its report at exit does not fail a
 * Criterion test, so a test that must not leak asks it directly. */
int __lsan_do_recoverable_leak_check(void) __attribute__((weak));

static td_status from_text(const char *json, td_tokenizer **t) {
  return td_tokenizer_from_json(json, strlen(json), NULL, 0, NULL, t);
}

Test(tokenizer, bad_files_get_errors_naming_the_part) {
  td_tokenizer *t = NULL;
  static const struct {
    const char *json, *says;
  } bad[] = {
      {"", "JSON"},
      {"[1, 2]", "object"},
      {"{\"model\": {\"type\": \"Mystery\"}}", "Mystery"},
      {"{\"model\": {\"type\": \"WordLevel\", \"vocab\": {\"a\": 0}, \"unk_token\": \"a\"}, \"normalizer\": {\"type\": \"Wat\"}}", "Wat"},
      {"{\"model\": {\"type\": \"WordLevel\", \"vocab\": {\"a\": 0}, \"unk_token\": \"a\"}, \"pre_tokenizer\": {\"type\": \"Nope\"}}", "Nope"},
      {"{\"model\": {\"type\": \"WordLevel\", \"vocab\": {\"a\": 0}, \"unk_token\": \"a\"}, \"decoder\": {\"type\": \"CTC\"}}", "CTC"},
      {"{\"model\": {\"type\": \"WordLevel\", \"vocab\": {\"a\": 0}, \"unk_token\": \"a\"}, \"post_processor\": {\"no\": 1}}", "type"},
      {"{\"model\": {\"type\": \"WordLevel\", \"vocab\": {\"a\": -3}}}", "range"},
      {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"a b\"]}}", "merge"},
      {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [7]}}", "merge"},
      {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [\"a b\", \"a c\"]}}", "merge 1"},
      {"{\"model\": {\"type\": \"Unigram\", \"vocab\": [[\"a\"]]}}", "Unigram"},
      {"{\"model\": {\"type\": \"WordLevel\", \"vocab\": {\"a\": 0}}, \"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"(\"}, \"behavior\": \"Isolated\"}}", "pattern"},
      {"{\"model\": {\"type\": \"WordLevel\", \"vocab\": {\"a\": 0}}, \"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"String\": \" \"}, \"behavior\": \"Sideways\"}}", "Sideways"},
      {"{\"model\": {\"type\": \"WordLevel\", \"vocab\": {\"a\": 0}}, \"normalizer\": {\"type\": \"Precompiled\", \"precompiled_charsmap\": \"AAAA\"}}", "Precompiled"},
      {"{\"model\": {\"type\": \"WordLevel\", \"vocab\": {\"a\": 0}}, \"added_tokens\": [{\"content\": \"x\"}]}", "added token"},
      {"{\"model\": {\"type\": \"WordLevel\", \"vocab\": {\"a\": 0}}, \"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": \"[X]\"}}], \"special_tokens\": {}}}", "[X]"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    cr_expect_neq(from_text(bad[i].json, &t), TD_OK, "case %zu accepted", i);
    cr_expect(strstr(td_errmsg(), bad[i].says), "case %zu: \"%s\" does not say %s", i, td_errmsg(), bad[i].says);
  }
  if (__lsan_do_recoverable_leak_check) cr_expect_eq(__lsan_do_recoverable_leak_check(), 0, "a refused file leaked");
  cr_assert_eq(td_tokenizer_load("/nonexistent-dir", NULL, &t), TD_ERR_NOT_FOUND);
}

/* A Marian folder whose tokenizer_config.json says separate_vocabs decodes
 * through target_vocab.json, which is not read: refused at load. */
Test(tokenizer, marian_separate_vocabs_is_refused) {
  char dir[] = "/tmp/td-marian-XXXXXX", src[512], dst[600];
  cr_assert(mkdtemp(dir));
  static const char *files[] = {"source.spm", "target.spm", "vocab.json"};
  for (size_t i = 0; i < 3; i++) {
    snprintf(src, sizeof src, "%s/marian-spm/%s", TOK_DIR, files[i]);
    snprintf(dst, sizeof dst, "%s/%s", dir, files[i]);
    cr_assert_eq(symlink(src, dst), 0);
  }
  snprintf(dst, sizeof dst, "%s/tokenizer_config.json", dir);
  for (int sep = 1; sep >= 0; sep--) {
    FILE *f = fopen(dst, "w");
    cr_assert(f);
    fprintf(f, "{\"separate_vocabs\": %s}", sep ? "true" : "false");
    fclose(f);
    td_tokenizer *t = NULL;
    td_status st = td_tokenizer_load(dir, NULL, &t);
    if (sep) {
      cr_expect_eq(st, TD_ERR_FORMAT);
      cr_expect(strstr(td_errmsg(), "separate_vocabs"), "\"%s\" does not name separate_vocabs", td_errmsg());
    } else {
      cr_expect_eq(st, TD_OK, "%s", td_errmsg());
      td_tokenizer_destroy(t);
    }
  }
  for (size_t i = 0; i < 3; i++) {
    snprintf(dst, sizeof dst, "%s/%s", dir, files[i]);
    unlink(dst);
  }
  snprintf(dst, sizeof dst, "%s/tokenizer_config.json", dir);
  unlink(dst);
  rmdir(dir);
}

/* The file limit holds for every file a Marian folder has, its SentencePiece models too. */
Test(tokenizer, marian_files_over_the_limit_are_refused) {
  char dir[512];
  snprintf(dir, sizeof dir, "%s/marian-local", TOK_DIR);
  td_tokenizer *t = NULL;
  td_tokenizer_opts o = {.max_file_bytes = 100000}; /* over vocab.json, under source.spm */
  cr_assert_eq(td_tokenizer_load(dir, &o, &t), TD_ERR_INVALID);
  cr_expect(strstr(td_errmsg(), "source.spm") && strstr(td_errmsg(), "limit"), "%s", td_errmsg());
  o.max_file_bytes = 0;
  cr_assert_eq(td_tokenizer_load(dir, &o, &t), TD_OK, "%s", td_errmsg());
  td_tokenizer_destroy(t);
}

/* Every prefix of real files, and single-byte corruptions of them: an error
 * or a tokenizer that works, never a crash (ASan watches). */
Test(tokenizer, truncated_and_corrupted_files_never_crash) {
  static const char *names[] = {"toy-numbers-t5", "bytelevel-bpe", "metaspace-unigram"};
  uint64_t r = 7;
  for (size_t k = 0; k < sizeof names / sizeof *names; k++) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s/tokenizer.json", TOK_DIR, names[k]);
    size_t len;
    char *json = slurp(path, &len);
    for (size_t cut = 0; cut < len; cut += 1 + cut / 16) {
      td_tokenizer *t = NULL;
      if (td_tokenizer_from_json(json, cut, NULL, 0, NULL, &t) == TD_OK) td_tokenizer_destroy(t);
    }
    for (int i = 0; i < 300; i++) {
      char *m = malloc(len);
      memcpy(m, json, len);
      for (int j = 0; j < 3; j++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        m[(r >> 33) % len] = "\"{}[],:0a\\ \x80"[(r >> 20) % 12];
      }
      td_tokenizer *t = NULL;
      if (td_tokenizer_from_json(m, len, NULL, 0, NULL, &t) == TD_OK) {
        int32_t *ids;
        size_t n;
        const char *txt = "Hello, world 42 \xC3\xA9t\xC3\xA9 \xF0\x9F\x8C\xB6";
        if (td_tokenizer_encode(t, txt, strlen(txt), true, &ids, &n) == TD_OK) {
          char *s;
          if (td_tokenizer_decode(t, ids, n, false, &s, NULL) == TD_OK) free(s);
          free(ids);
        }
        td_tokenizer_destroy(t);
      }
      free(m);
    }
    free(json);
  }
}

/* Any bytes as text: encode, then decode what came out. */
Test(tokenizer, random_bytes_encode_and_decode) {
  static const char *names[] = {"bytelevel-bpe", "metaspace-unigram", "toy-numbers-t5", "whisper-large-v3", "marian-local"};
  uint64_t r = 99;
  for (size_t k = 0; k < sizeof names / sizeof *names; k++) {
    td_tokenizer *t = load(names[k]);
    for (int i = 0; i < 60; i++) {
      char buf[200];
      size_t n = (size_t)i * 3 % sizeof buf;
      for (size_t j = 0; j < n; j++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        buf[j] = (char)(i % 2 ? (char)(r >> 40) : " ab<|>\xC3\xA9\xE2\x96\x81\n\t0"[(r >> 40) % 15]);
      }
      int32_t *ids;
      size_t m;
      cr_assert_eq(td_tokenizer_encode(t, buf, n, true, &ids, &m), TD_OK, "%s: %s", names[k], td_errmsg());
      check_decode(t, names[k], ids, m, false, NULL);
      free(ids);
    }
    td_tokenizer_destroy(t);
  }
}
