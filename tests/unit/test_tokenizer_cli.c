/* tandem-frontend encode / decode on the command line: the case files'
 * texts and ids through the binary, and its answers to bad input. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <criterion/criterion.h>

#define TOK_DIR TD_TEST_DATA "/tokenizers"

static char tmp[64];

static void setup(void) {
  snprintf(tmp, sizeof tmp, "/tmp/td-tokcli-XXXXXX");
  cr_assert(mkdtemp(tmp));
}

static void teardown(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
  cr_assert(system(cmd) == 0);
}

TestSuite(tokenizer_cli, .init = setup, .fini = teardown);

/* Runs tandem-frontend ARGS < input; returns the exit status, output in *out. */
static int run(const char *args, const char *input, char **out) {
  char in[128], cmd[1024];
  snprintf(in, sizeof in, "%s/in.txt", tmp);
  FILE *f = fopen(in, "w");
  cr_assert(f);
  fputs(input, f);
  fclose(f);
  snprintf(cmd, sizeof cmd, "%s/tandem-frontend %s < %s 2>%s/err.txt", TD_BIN_DIR, args, in, tmp);
  FILE *p = popen(cmd, "r");
  cr_assert(p);
  size_t cap = 4096, n = 0, k;
  char *b = malloc(cap);
  while ((k = fread(b + n, 1, cap - n - 1, p)) > 0)
    if ((n += k) + 1 == cap) b = realloc(b, cap *= 2);
  b[n] = 0;
  *out = b;
  int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static char *errtext(void) {
  static char buf[4096];
  char path[128];
  snprintf(path, sizeof path, "%s/err.txt", tmp);
  FILE *f = fopen(path, "r");
  size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
  if (f) fclose(f);
  buf[n] = 0;
  return buf;
}

static char *ids_line(const cJSON *a) {
  static char buf[8192];
  size_t k = 0;
  const cJSON *e;
  k += (size_t)snprintf(buf, sizeof buf, "[");
  cJSON_ArrayForEach(e, a) k += (size_t)snprintf(buf + k, sizeof buf - k, "%s%d", k > 1 ? ", " : "", e->valueint);
  snprintf(buf + k, sizeof buf - k, "]");
  return buf;
}

/* Every text case of a case file through encode --json, every id list
 * through decode --json (plain and --stream). */
static void check_file(const char *name) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s/cases.json", TOK_DIR, name);
  FILE *f = fopen(path, "r");
  cr_assert(f);
  static char json[1 << 20];
  json[fread(json, 1, sizeof json - 1, f)] = 0;
  fclose(f);
  cJSON *root = cJSON_Parse(json);
  size_t cap = 1 << 16, a = 0, b = 0, c = 0;
  char *texts = calloc(1, cap), *want_ids = calloc(1, cap), *dec_in = calloc(1, cap), *want_dec = calloc(1, cap);
  const cJSON *cs;
  cJSON_ArrayForEach(cs, cJSON_GetObjectItem(root, "cases")) {
    const cJSON *text = cJSON_GetObjectItem(cs, "text"), *ids = cJSON_GetObjectItem(cs, "ids");
    const cJSON *dids = cJSON_GetObjectItem(cs, "decode_ids"), *ds = cJSON_GetObjectItem(cs, "decoded_skip");
    if (cJSON_IsString(text) && cJSON_IsArray(ids)) {
      char *t = cJSON_PrintUnformatted(text);
      a += (size_t)snprintf(texts + a, cap - a, "%s\n", t);
      b += (size_t)snprintf(want_ids + b, cap - b, "%s\n", ids_line(ids));
      free(t);
    }
    const cJSON *d = cJSON_IsArray(dids) ? dids : ids;
    if (cJSON_IsArray(d) && cJSON_IsString(ds)) {
      c += (size_t)snprintf(dec_in + c, cap - c, "%s\n", ids_line(d));
      char *t = cJSON_PrintUnformatted(ds);
      strncat(want_dec, t, cap - strlen(want_dec) - 2);
      strcat(want_dec, "\n");
      free(t);
    }
  }
  char args[512], *out;
  snprintf(args, sizeof args, "encode --tokenizer %s/%s --json", TOK_DIR, name);
  cr_assert_eq(run(args, texts, &out), 0, "%s: %s", name, errtext());
  cr_expect_str_eq(out, want_ids, "%s: encode", name);
  free(out);
  for (int stream = 0; stream < 2; stream++) {
    snprintf(args, sizeof args, "decode --tokenizer %s/%s --json --skip-special%s", TOK_DIR, name, stream ? " --stream" : "");
    cr_assert_eq(run(args, dec_in, &out), 0, "%s: %s", name, errtext());
    cr_expect_str_eq(out, want_dec, "%s: decode%s", name, stream ? " --stream" : "");
    free(out);
  }
  free(texts);
  free(want_ids);
  free(dec_in);
  free(want_dec);
  cJSON_Delete(root);
}

Test(tokenizer_cli, case_files_through_the_binary) {
  check_file("bytelevel-bpe");
  check_file("metaspace-unigram");
  check_file("toy-numbers-t5");
  check_file("marian-local");
}

Test(tokenizer_cli, plain_lines_and_special_tokens) {
  char args[512], *out;
  snprintf(args, sizeof args, "encode --tokenizer %s/toy-numbers-t5", TOK_DIR);
  cr_assert_eq(run(args, "seven\nthirteen\n", &out), 0, "%s", errtext());
  cr_expect_str_eq(out, "[31, 1]\n[34, 4, 4, 5, 1]\n");
  free(out);
  snprintf(args, sizeof args, "encode --tokenizer %s/toy-numbers-t5 --no-special", TOK_DIR);
  cr_assert_eq(run(args, "seven", &out), 0, "a last line without newline is a line");
  cr_expect_str_eq(out, "[31]\n");
  free(out);
  snprintf(args, sizeof args, "decode --tokenizer %s/toy-numbers-t5", TOK_DIR);
  cr_assert_eq(run(args, "[6, 19, 1]\n[]\n", &out), 0, "%s", errtext());
  cr_expect_str_eq(out, "7</s>\n\n");
  free(out);
}

Test(tokenizer_cli, bad_input_is_reported_by_line) {
  char args[512], *out;
  snprintf(args, sizeof args, "decode --tokenizer %s/toy-numbers-t5 --json", TOK_DIR);
  cr_assert_eq(run(args, "[6, 19]\n[6, 99999]\nnot json\n[1.5]\n[19]\n", &out), 1);
  cr_expect_str_eq(out, "\"7\"\nnull\nnull\nnull\n\"7\"\n", "bad lines answer null, the others go on");
  char *e = errtext();
  cr_expect(strstr(e, "line 2") && strstr(e, "99999"), "%s", e);
  cr_expect(strstr(e, "line 3") && strstr(e, "line 4"), "%s", e);
  free(out);
  snprintf(args, sizeof args, "encode --tokenizer %s/toy-numbers-t5 --json", TOK_DIR);
  cr_assert_eq(run(args, "\"ok\"\n42\n", &out), 1);
  cr_expect_str_eq(out, "[6, 10, 2, 1]\nnull\n");
  free(out);
  cr_expect_eq(run("encode --tokenizer /nonexistent", "", &out), 2);
  cr_expect(strstr(errtext(), "/nonexistent"), "%s", errtext());
  free(out);
  cr_expect_eq(run("encode", "", &out), 2);
  free(out);
  cr_expect_eq(run("decode --tokenizer x --bogus", "", &out), 2);
  cr_expect(strstr(errtext(), "--bogus"), "%s", errtext());
  free(out);
  cr_expect_eq(run("mystery", "", &out), 2);
  free(out);
}
