/* /v1/audio/transcriptions and /translations: the form's fields, Whisper's
 * decoder prompt as transformers builds it, segments from timestamp
 * tokens, and the response formats (docs/gateway.md). */
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "gateway/internal.h"

#define BAD(param, ...)                      \
  do {                                       \
    gw_error_set(e, 400, param, __VA_ARGS__); \
    return false;                            \
  } while (0)

int32_t gw_language_id(const gw_model *m, const char *code) {
  char tok[32];
  snprintf(tok, sizeof tok, "<|%s|>", code);
  if (m->lang_to_id) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive((const cJSON *)m->lang_to_id, tok);
    return cJSON_IsNumber(x) && x->valuedouble >= 0 && x->valuedouble < m->vocab ? (int32_t)x->valuedouble : -1;
  }
  return td_tokenizer_token_to_id(m->tok, tok);
}

bool gw_language_code(const gw_model *m, int32_t id, char *code, size_t cap) {
  bool known = false;
  for (int i = 0; i < m->n_langs && !known; i++) known = m->langs[i] == id;
  const char *tok = known ? td_tokenizer_id_to_token(m->tok, id) : NULL;
  size_t n = tok ? strlen(tok) : 0;
  if (n < 5 || n - 4 >= cap || strncmp(tok, "<|", 2) || strcmp(tok + n - 2, "|>")) return false;
  memcpy(code, tok + 2, n - 4);
  code[n - 4] = 0;
  /* the prompt is built from the code: it must give this token back */
  return gw_language_id(m, code) == id;
}

bool gw_audio_detects(const gw_audio_req *a, const gw_model *m) { return !a->language[0] && m->n_langs > 0; }

bool gw_audio_set_language(gw_audio_req *a, const gw_model *m, int32_t id, gw_error *e) {
  if (!gw_language_code(m, id, a->language, sizeof a->language)) {
    a->language[0] = 0;
    gw_error_set(e, 502, NULL, "language detection answered token %d, which is no language of this model", id);
    return false;
  }
  return true;
}

static const char *const formats[] = {"json", "text", "srt", "vtt", "verbose_json"};

bool gw_audio_check(gw_audio_req *a, const gw_model *m, gw_error *e) {
  if (a->bad_field[0]) BAD(a->bad_field, "unknown field '%s'", a->bad_field);
  if (!a->model[0]) BAD("model", "model is required (GET /v1/models lists them)");
  if (strcmp(a->model, m->name) != 0) {
    gw_error_set(e, 404, "model", "the model '%s' does not exist (this gateway serves '%s')", a->model, m->name);
    e->code = "model_not_found";
    return false;
  }
  if (!m->whisper) BAD("model", "'%s' takes text: use /v1/completions", m->name);
  a->format = GW_FMT_JSON;
  if (a->response_format[0]) {
    int k = -1;
    for (int i = 0; i < 5; i++)
      if (!strcmp(a->response_format, formats[i])) k = i;
    if (k < 0) BAD("response_format", "response_format: json, text, srt, vtt or verbose_json");
    a->format = (gw_format)k;
  }
  if (a->word_timestamps) BAD("timestamp_granularities[]", "timestamp_granularities: only \"segment\" is supported");
  if (a->has_temperature && !(a->temperature >= 0 && a->temperature <= 1))
    BAD("temperature", "temperature: a number in [0, 1]");
  if (a->stream && a->format != GW_FMT_JSON && a->format != GW_FMT_TEXT)
    BAD("stream", "stream: only with response_format json or text");
  if (a->language[0]) {
    for (const char *p = a->language; *p; p++)
      if (!islower((unsigned char)*p)) BAD("language", "language: an ISO-639-1 code such as \"en\"");
    if (gw_language_id(m, a->language) < 0) BAD("language", "language '%s' is not one this model knows", a->language);
  } else if (m->default_language[0]) { /* as transformers: generation_config.json's language before detection */
    snprintf(a->language, sizeof a->language, "%s", m->default_language);
  }
  return true;
}

bool gw_audio_prompt_ids(const gw_audio_req *a, const gw_model *m, td_i32vec *out, gw_error *e) {
  out->n = 0;
  if (a->prompt && a->prompt[0]) {
    if (m->startofprev < 0) BAD("prompt", "this tokenizer has no <|startofprev|>: prompt is not supported");
    /* WhisperTokenizer.get_prompt_ids: " " + text.strip(), no special tokens */
    const char *p = a->prompt;
    while (isspace((unsigned char)*p)) p++;
    size_t len = strlen(p);
    while (len && isspace((unsigned char)p[len - 1])) len--;
    char *text = malloc(len + 2);
    if (!text) BAD("prompt", "out of memory");
    text[0] = ' ';
    memcpy(text + 1, p, len);
    text[len + 1] = 0;
    int32_t *ids = NULL;
    size_t n = 0;
    td_status s = td_tokenizer_encode(m->tok, text, len + 1, false, &ids, &n);
    free(text);
    if (s != TD_OK) BAD("prompt", "prompt: %s", td_errmsg());
    /* transformers keeps at most max_target_positions / 2 - 1 prompt tokens; a longer one is refused here */
    int room = m->max_target > 0 ? m->max_target / 2 - 1 : 223;
    if ((int)n > room) {
      free(ids);
      BAD("prompt", "prompt: %zu tokens, at most %d for this model", n, room);
    }
    if (td_i32vec_reserve(out, out->n + (int)n + 5) != TD_OK) {
      free(ids);
      BAD("prompt", "out of memory");
    }
    memcpy(out->v + out->n, ids, n * sizeof *ids);
    out->n += (int)n;
    free(ids);
  }
  return true;
}

bool gw_audio_prompt(const gw_audio_req *a, const gw_model *m, td_i32vec *out, gw_error *e) {
  td_i32vec ids = {0};
  if (!gw_audio_prompt_ids(a, m, &ids, e)) {
    td_i32vec_free(&ids);
    return false;
  }
  out->n = 0;
  bool oom = ids.n && (td_i32vec_push(out, m->startofprev) != TD_OK || td_i32vec_reserve(out, ids.n + 5) != TD_OK);
  if (!oom && ids.n) {
    memcpy(out->v + out->n, ids.v, sizeof *ids.v * (size_t)ids.n);
    out->n += ids.n;
  }
  td_i32vec_free(&ids);
  if (oom) BAD("prompt", "out of memory");
  int32_t lid = gw_language_id(m, a->language[0] ? a->language : "en");
  if (lid < 0) BAD("language", "language '%s' is not one this model knows", a->language[0] ? a->language : "en");
  if (td_i32vec_push(out, m->sot) || td_i32vec_push(out, lid) ||
      td_i32vec_push(out, a->translate ? m->translate : m->transcribe) ||
      (!a->seg_timestamps && td_i32vec_push(out, m->notimestamps)))
    BAD(NULL, "out of memory");
  if (a->seg_timestamps && m->ts_begin < 0) BAD("timestamp_granularities[]", "this tokenizer has no timestamp tokens");
  return true;
}

/* ---------------------------------------------------------------- segments */

static char *decode(const gw_model *m, const int32_t *tok, int n) {
  char *text = NULL;
  size_t len = 0;
  if (td_tokenizer_decode(m->tok, tok, (size_t)n, true, &text, &len) != TD_OK) return NULL;
  return text;
}

static bool is_ts(const gw_model *m, int32_t id) { return m->ts_begin >= 0 && id >= m->ts_begin; }

static td_status add_seg(gw_segment **s, int *n, int *cap, double start, double end, const gw_model *m,
                         const int32_t *tok, int first, int count) {
  if (*n == *cap) {
    int c = *cap ? 2 * *cap : 8;
    gw_segment *x = realloc(*s, (size_t)c * sizeof *x);
    if (!x) return td_err(TD_ERR_NOMEM, "out of memory");
    *s = x;
    *cap = c;
  }
  char *text = decode(m, tok + first, count);
  if (!text) return td_err_ctx(TD_ERR_INVALID, "decoding a segment: ");
  (*s)[(*n)++] = (gw_segment){.start = start, .end = end, .text = text, .first = first, .n_tokens = count};
  return TD_OK;
}

td_status gw_segments(const gw_model *m, const int32_t *tok, int n, double duration, bool timestamps,
                      gw_segment **segs, int *n_segs, char **text) {
  *segs = NULL;
  *n_segs = 0;
  *text = NULL;
  /* the text: every non-timestamp token, decoded as transformers does */
  int32_t *plain = malloc(((size_t)n + 1) * sizeof *plain);
  if (!plain) return td_err(TD_ERR_NOMEM, "out of memory");
  int k = 0;
  for (int i = 0; i < n; i++)
    if (!is_ts(m, tok[i])) plain[k++] = tok[i];
  *text = decode(m, plain, k);
  free(plain);
  if (!*text) return td_err_ctx(TD_ERR_INVALID, "decoding the output: ");
  /* the whole text without the leading space Whisper's first token carries, as OpenAI answers it */
  size_t a = 0, z = strlen(*text);
  while ((*text)[a] == ' ') a++;
  while (z > a && ((*text)[z - 1] == ' ' || (*text)[z - 1] == '\n')) z--;
  memmove(*text, *text + a, z - a);
  (*text)[z - a] = 0;
  int cap = 0;
  td_status s = TD_OK;
  if (!timestamps) {
    s = add_seg(segs, n_segs, &cap, 0, duration, m, tok, 0, n);
  } else {
    /* <|t0|> text <|t1|>: a segment; <|t1|><|t1|> closes one and opens the next */
    double start = 0;
    int first = 0;
    bool open = false;
    for (int i = 0; i < n && s == TD_OK; i++) {
      if (!is_ts(m, tok[i])) {
        if (!open) {
          open = true;
          first = i;
        }
        continue;
      }
      double t = (tok[i] - m->ts_begin) * 0.02;
      if (open && i > first) s = add_seg(segs, n_segs, &cap, start, t, m, tok, first, i - first);
      open = false;
      start = t;
    }
    if (s == TD_OK && open) s = add_seg(segs, n_segs, &cap, start, duration > start ? duration : start, m, tok,
                                        first, n - first);
    /* drop segments that decode to nothing (an EOS alone) */
    int w = 0;
    for (int i = 0; i < *n_segs; i++) {
      const char *p = (*segs)[i].text;
      while (*p == ' ') p++;
      if (*p)
        (*segs)[w++] = (*segs)[i];
      else
        free((*segs)[i].text);
    }
    *n_segs = w;
  }
  if (s != TD_OK) {
    gw_segments_free(*segs, *n_segs);
    *segs = NULL;
    *n_segs = 0;
    free(*text);
    *text = NULL;
  }
  return s;
}

void gw_segments_free(gw_segment *s, int n) {
  for (int i = 0; i < n; i++) free(s[i].text);
  free(s);
}

void gw_format_time(char *out, size_t cap, double seconds, char sep) {
  if (!(seconds >= 0)) seconds = 0;
  long long ms = llround(seconds * 1000.0);
  snprintf(out, cap, "%02lld:%02lld:%02lld%c%03lld", ms / 3600000, ms / 60000 % 60, ms / 1000 % 60, sep, ms % 1000);
}

static const char *trimmed(const char *s) {
  while (*s == ' ') s++;
  return s;
}

void gw_format_srt(gw_buf *b, const gw_segment *s, int n) {
  for (int i = 0; i < n; i++) {
    char t0[32], t1[32];
    gw_format_time(t0, sizeof t0, s[i].start, ',');
    gw_format_time(t1, sizeof t1, s[i].end, ',');
    gw_buf_printf(b, "%d\n%s --> %s\n%s\n\n", i + 1, t0, t1, trimmed(s[i].text));
  }
}

void gw_format_vtt(gw_buf *b, const gw_segment *s, int n) {
  gw_buf_str(b, "WEBVTT\n\n");
  for (int i = 0; i < n; i++) {
    char t0[32], t1[32];
    gw_format_time(t0, sizeof t0, s[i].start, '.');
    gw_format_time(t1, sizeof t1, s[i].end, '.');
    gw_buf_printf(b, "%s --> %s\n%s\n\n", t0, t1, trimmed(s[i].text));
  }
}

/* ---------------------------------------------------------------- long-form */

bool gw_opt_num_parse(const char *field, const char *v, bool off_ok, td_opt_num *out, gw_error *e) {
  out->given = true;
  out->off = false;
  if (off_ok && (!strcmp(v, "none") || !strcmp(v, "null"))) {
    out->off = true;
    return true;
  }
  char *end;
  out->v = strtod(v, &end);
  if (end == v || *end || !isfinite(out->v))
    BAD(field, "%s: a number%s", field, off_ok ? ", or \"none\" to turn it off" : "");
  return true;
}
