/* tandem-frontend: the front end alone, so that a tokenizer or an audio file
 * can be checked against transformers without a model. One subcommand a
 * table entry.
 *
 *   tandem-frontend encode --tokenizer DIR [--no-special] [--json]
 *     text lines on stdin (JSON strings with --json), one JSON array of ids a line out
 *   tandem-frontend decode --tokenizer DIR [--skip-special] [--json] [--stream]
 *     JSON arrays of ids on stdin, one text line out (a JSON string with --json)
 *   tandem-frontend mel --mels N [--chunk-seconds S | --preprocessor DIR] AUDIO OUT.f32
 *     Whisper's log-mel features, float32 [mels, frames] a window (frontend/audio.h)
 *
 * A line that fails prints its error on stderr and "null" (or an empty
 * line) in its place; the exit status is then 1. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/log.h"
#include "common/settings.h"
#include "frontend/audio.h"
#include "frontend/tokenizer.h"

typedef struct cli {
  const char *dir;
  bool special, skip, json, stream;
} cli;

/* Each subcommand parses its own arguments (argv[0] is its name). */
typedef struct subcommand {
  const char *name;
  const char *usage;
  int (*run)(int argc, char **argv);
} subcommand;

/* encode's and decode's flags; false when one is unknown or missing. */
static bool parse_args(int argc, char **argv, bool decode, cli *c) {
  *c = (cli){.special = true};
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--tokenizer") && i + 1 < argc) c->dir = argv[++i];
    else if (!strcmp(argv[i], "--json")) c->json = true;
    else if (!decode && !strcmp(argv[i], "--no-special")) c->special = false;
    else if (decode && !strcmp(argv[i], "--skip-special")) c->skip = true;
    else if (decode && !strcmp(argv[i], "--stream")) c->stream = true;
    else {
      fprintf(stderr, "tandem-frontend %s: unknown argument %s\n", argv[0], argv[i]);
      return false;
    }
  }
  if (!c->dir) fprintf(stderr, "tandem-frontend %s: needs --tokenizer DIR\n", argv[0]);
  return c->dir != NULL;
}

static size_t read_line(char **line, size_t *cap) {
  ssize_t n = getline(line, cap, stdin);
  if (n < 0) return (size_t)-1;
  if (n > 0 && (*line)[n - 1] == '\n') (*line)[--n] = 0;
  return (size_t)n;
}

/* One line of stdin: false when it failed (its error printed). */
typedef bool (*line_fn)(const cli *c, const td_tokenizer *t, const char *line, size_t n, size_t lineno);

/* encode's and decode's frame: arguments, the tokenizer, every line of stdin. */
static int each_line(int argc, char **argv, bool decode, line_fn one) {
  cli c;
  if (!parse_args(argc, argv, decode, &c)) return 2;
  td_tokenizer *t = NULL;
  if (td_tokenizer_load(c.dir, NULL, &t) != TD_OK) {
    fprintf(stderr, "tandem-frontend: %s\n", td_errmsg());
    return 2;
  }
  char *line = NULL;
  size_t cap = 0, n, lineno = 0;
  int rc = 0;
  while ((n = read_line(&line, &cap)) != (size_t)-1)
    if (!one(&c, t, line, n, ++lineno)) rc = 1;
  free(line);
  td_tokenizer_destroy(t);
  return rc;
}

static bool encode_line(const cli *c, const td_tokenizer *t, const char *line, size_t n, size_t lineno) {
  const char *text = line;
  size_t len = n;
  cJSON *j = NULL;
  if (c->json) {
    j = cJSON_ParseWithLength(line, n);
    if (!cJSON_IsString(j)) {
      fprintf(stderr, "tandem-frontend: line %zu: not a JSON string\n", lineno);
      puts("null");
      cJSON_Delete(j);
      return false;
    }
    text = j->valuestring;
    len = strlen(text);
  }
  int32_t *ids = NULL;
  size_t k = 0;
  bool ok = td_tokenizer_encode(t, text, len, c->special, &ids, &k) == TD_OK;
  if (!ok) {
    fprintf(stderr, "tandem-frontend: line %zu: %s\n", lineno, td_errmsg());
    puts("null");
  } else {
    putchar('[');
    for (size_t i = 0; i < k; i++) printf(i ? ", %d" : "%d", ids[i]);
    puts("]");
  }
  free(ids);
  cJSON_Delete(j);
  return ok;
}

static void print_text(const cli *c, const char *s) {
  if (!c->json) {
    puts(s);
    return;
  }
  cJSON *j = cJSON_CreateString(s);
  char *out = j ? cJSON_PrintUnformatted(j) : NULL;
  puts(out ? out : "null");
  free(out);
  cJSON_Delete(j);
}

/* One line of ids through the streaming detokenizer: the pieces joined. */
static td_status stream_decode(const td_tokenizer *t, bool skip, const int32_t *ids, int n, char **out) {
  td_detok *d;
  TD_TRY(td_detok_create(t, skip, &d));
  size_t cap = 64, len = 0;
  char *s = malloc(cap);
  td_status st = s ? TD_OK : td_err(TD_ERR_NOMEM, "out of memory");
  for (int i = 0; st == TD_OK && i <= n; i++) {
    const char *piece;
    size_t k;
    st = i < n ? td_detok_push(d, ids[i], &piece, &k) : td_detok_finish(d, &piece, &k);
    if (st != TD_OK) break;
    if (len + k + 1 > cap) {
      while (len + k + 1 > cap) cap *= 2;
      char *x = realloc(s, cap);
      if (!x) {
        st = td_err(TD_ERR_NOMEM, "out of memory");
        break;
      }
      s = x;
    }
    memcpy(s + len, piece, k);
    len += k;
  }
  td_detok_destroy(d);
  if (st != TD_OK) {
    free(s);
    return st;
  }
  s[len] = 0;
  *out = s;
  return TD_OK;
}

static bool decode_line(const cli *c, const td_tokenizer *t, const char *line, size_t n, size_t lineno) {
  cJSON *j = cJSON_ParseWithLength(line, n);
  int cnt = cJSON_IsArray(j) ? cJSON_GetArraySize(j) : -1;
  int32_t *ids = cnt >= 0 ? malloc(((size_t)cnt + 1) * sizeof *ids) : NULL;
  const char *err = cnt < 0 ? "not a JSON array" : ids ? NULL : "out of memory";
  const cJSON *e;
  int k = 0;
  cJSON *arr = cnt >= 0 ? j : (cJSON *)NULL;
  cJSON_ArrayForEach(e, arr) {
    if (err) break;
    if (!cJSON_IsNumber(e) || e->valuedouble != (double)(int32_t)e->valuedouble) err = "an id is not a 32-bit integer";
    else ids[k++] = (int32_t)e->valuedouble;
  }
  char *text = NULL;
  if (!err) {
    td_status st = c->stream ? stream_decode(t, c->skip, ids, k, &text)
                             : td_tokenizer_decode(t, ids, (size_t)k, c->skip, &text, NULL);
    if (st != TD_OK) err = td_errmsg();
  }
  if (err) {
    fprintf(stderr, "tandem-frontend: line %zu: %s\n", lineno, err);
    puts(c->json ? "null" : "");
  } else {
    print_text(c, text);
  }
  free(text);
  free(ids);
  cJSON_Delete(j);
  return !err;
}

static int run_encode(int argc, char **argv) { return each_line(argc, argv, false, encode_line); }
static int run_decode(int argc, char **argv) { return each_line(argc, argv, true, decode_line); }

static const subcommand subcommands[] = {
    {"encode", "encode --tokenizer DIR [--no-special] [--json]", run_encode},
    {"decode", "decode --tokenizer DIR [--skip-special] [--json] [--stream]", run_decode},
    {"mel", "mel --mels N [--chunk-seconds S | --preprocessor DIR] [--max-seconds S] AUDIO OUT.f32",
     td_frontend_mel_main},
};

static int usage(void) {
  fprintf(stderr, "usage:\n");
  for (size_t i = 0; i < sizeof subcommands / sizeof *subcommands; i++)
    fprintf(stderr, "  tandem-frontend %s\n", subcommands[i].usage);
  return 2;
}

int main(int argc, char **argv) {
  td_settings s;
  if (td_settings_from_env(&s) != TD_OK) {
    fprintf(stderr, "tandem-frontend: %s\n", td_errmsg());
    return 2;
  }
  td_settings_apply(&s);
  td_log_set_name("frontend");
  if (argc < 2) return usage();
  const subcommand *sc = NULL;
  for (size_t i = 0; i < sizeof subcommands / sizeof *subcommands; i++)
    if (!strcmp(argv[1], subcommands[i].name)) sc = &subcommands[i];
  if (!sc) return usage();
  return sc->run(argc - 1, argv + 1);
}
