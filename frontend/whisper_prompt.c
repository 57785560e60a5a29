/* Whisper's decoder prompt, as WhisperForConditionalGeneration.generate
 * builds it (tokenizer.h). */
#include <ctype.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/json.h"
#include "frontend/tokenizer.h"

#define GEN_CONFIG_MAX_BYTES (4u << 20)
#define MAX_LANGS 256

struct td_whisper_prompt {
  const td_tokenizer *t;
  int32_t sot, transcribe, translate, no_ts;
  bool multilingual;
  int n_langs; /* generation_config's lang_to_id, when given */
  char *lang_tok[MAX_LANGS];
  int32_t lang_id[MAX_LANGS];
  char language[32]; /* the default language token ("<|en|>"), or "" */
  int32_t *langs;    /* every language token's id (lang_to_id's, else the tokenizer's) */
  int n_all_langs;
  char task[16];     /* the default task */
  int max_initial;   /* generation_config's max_initial_timestamp_index, -1 when none */
  int32_t prev_sot;  /* generation_config's prev_sot_token_id, else <|startofprev|>, else -1 */
};

void td_whisper_prompt_destroy(td_whisper_prompt *w) {
  if (!w) return;
  for (int i = 0; i < w->n_langs; i++) free(w->lang_tok[i]);
  free(w->langs);
  free(w);
}

/* "en", "EN" or "<|en|>" -> "<|en|>"; false for anything else. */
static bool lang_token(const char *lang, char *out, size_t cap) {
  size_t n = strlen(lang);
  const char *code = lang;
  if (n > 4 && !strncmp(lang, "<|", 2) && !strcmp(lang + n - 2, "|>")) {
    code = lang + 2;
    n -= 4;
  }
  if (n == 0 || n > 16) return false;
  char low[17];
  for (size_t i = 0; i < n; i++) {
    if (!isalpha((unsigned char)code[i]) && code[i] != '-' && code[i] != '_') return false;
    low[i] = (char)tolower((unsigned char)code[i]);
  }
  low[n] = 0;
  snprintf(out, cap, "<|%s|>", low);
  return true;
}

/* An optional id field: absent or null leaves *dst as it was. */
static td_status opt_id(const cJSON *j, const char *key, const char *src, int32_t *dst) {
  if (td_json_is_null(j, key)) return TD_OK;
  int32_t v = -1;
  TD_TRY(td_json_i32(j, key, false, src, &v));
  if (v >= 0) *dst = v;
  return TD_OK;
}

static td_status read_config(td_whisper_prompt *w, const char *dir) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/generation_config.json", dir);
  if (access(path, F_OK) != 0) return TD_OK;
  cJSON *j = NULL;
  TD_TRY(td_json_load_file(path, GEN_CONFIG_MAX_BYTES, &j));
  td_status s = opt_id(j, "decoder_start_token_id", path, &w->sot);
  if (s == TD_OK) s = opt_id(j, "no_timestamps_token_id", path, &w->no_ts);
  if (s == TD_OK && !td_json_is_null(j, "is_multilingual"))
    s = td_json_bool(j, "is_multilingual", false, path, &w->multilingual);
  const cJSON *tasks = cJSON_GetObjectItemCaseSensitive(j, "task_to_id");
  if (s == TD_OK && cJSON_IsObject(tasks)) s = opt_id(tasks, "transcribe", path, &w->transcribe);
  if (s == TD_OK && cJSON_IsObject(tasks)) s = opt_id(tasks, "translate", path, &w->translate);
  const cJSON *langs = cJSON_GetObjectItemCaseSensitive(j, "lang_to_id"), *it;
  if (s == TD_OK && cJSON_IsObject(langs)) {
    cJSON_ArrayForEach(it, langs) {
      if (w->n_langs == MAX_LANGS || !cJSON_IsNumber(it) || it->valuedouble < 0 || it->valuedouble > INT32_MAX) {
        s = td_err(TD_ERR_FORMAT, "%s: lang_to_id: \"%s\" is not a token id (or more than %d languages)", path,
                   it->string, MAX_LANGS);
        break;
      }
      if (!(w->lang_tok[w->n_langs] = strdup(it->string))) {
        s = td_err(TD_ERR_NOMEM, "out of memory");
        break;
      }
      w->lang_id[w->n_langs++] = (int32_t)it->valuedouble;
    }
  }
  const cJSON *lang = cJSON_GetObjectItemCaseSensitive(j, "language");
  if (s == TD_OK && cJSON_IsString(lang) && !lang_token(lang->valuestring, w->language, sizeof w->language))
    s = td_err(TD_ERR_FORMAT, "%s: language \"%s\" is not a language code", path, lang->valuestring);
  if (s == TD_OK) s = opt_id(j, "max_initial_timestamp_index", path, &w->max_initial);
  if (s == TD_OK) s = opt_id(j, "prev_sot_token_id", path, &w->prev_sot);
  const cJSON *task = cJSON_GetObjectItemCaseSensitive(j, "task");
  if (s == TD_OK && cJSON_IsString(task)) snprintf(w->task, sizeof w->task, "%s", task->valuestring);
  cJSON_Delete(j);
  return s;
}

td_status td_whisper_prompt_load(const char *dir, const td_tokenizer *t, td_whisper_prompt **out) {
  *out = NULL;
  td_whisper_prompt *w = calloc(1, sizeof *w);
  if (!w) return td_err(TD_ERR_NOMEM, "out of memory");
  w->t = t;
  w->sot = td_tokenizer_token_to_id(t, "<|startoftranscript|>");
  w->transcribe = td_tokenizer_token_to_id(t, "<|transcribe|>");
  w->translate = td_tokenizer_token_to_id(t, "<|translate|>");
  w->no_ts = td_tokenizer_token_to_id(t, "<|notimestamps|>");
  w->multilingual = w->transcribe >= 0 && td_tokenizer_token_to_id(t, "<|en|>") >= 0;
  w->max_initial = -1;
  w->prev_sot = td_tokenizer_token_to_id(t, "<|startofprev|>");
  td_status s = read_config(w, dir);
  if (s == TD_OK && (td_tokenizer_token_to_id(t, "<|startoftranscript|>") < 0 || w->sot < 0))
    s = td_err(TD_ERR_FORMAT, "%s: not a Whisper tokenizer (no <|startoftranscript|> token)", dir);
  if (s == TD_OK && w->multilingual && (w->transcribe < 0 || w->translate < 0))
    s = td_err(TD_ERR_FORMAT, "%s: a multilingual Whisper tokenizer without <|transcribe|> / <|translate|>", dir);
  if (s == TD_OK && w->multilingual) {
    /* Whisper's vocabulary lists the languages between <|startoftranscript|> and <|translate|> */
    int32_t lo = td_tokenizer_token_to_id(t, "<|startoftranscript|>") + 1, hi = w->translate;
    int n = w->n_langs ? w->n_langs : hi > lo ? hi - lo : 0;
    if (!n) s = td_err(TD_ERR_FORMAT, "%s: a multilingual Whisper tokenizer without language tokens", dir);
    else if (!(w->langs = malloc(sizeof *w->langs * (size_t)n))) s = td_err(TD_ERR_NOMEM, "out of memory");
    for (int i = 0; s == TD_OK && i < n; i++) w->langs[i] = w->n_langs ? w->lang_id[i] : lo + i;
    w->n_all_langs = s == TD_OK ? n : 0;
  }
  if (s != TD_OK) {
    td_whisper_prompt_destroy(w);
    return s;
  }
  *out = w;
  return TD_OK;
}

const int32_t *td_whisper_languages(const td_whisper_prompt *w, int *n) {
  *n = w->n_all_langs;
  return w->n_all_langs ? w->langs : NULL;
}

/* A language token's id, or -1 when it names no language. */
static int32_t lang_id(const td_whisper_prompt *w, const char *tok) {
  if (w->n_langs) {
    for (int i = 0; i < w->n_langs; i++)
      if (!strcmp(w->lang_tok[i], tok)) return w->lang_id[i];
    return -1;
  }
  /* Whisper's vocabulary lists the languages between <|startoftranscript|> and <|translate|> */
  int32_t id = td_tokenizer_token_to_id(w->t, tok);
  int32_t sot = td_tokenizer_token_to_id(w->t, "<|startoftranscript|>");
  return id > sot && id < w->translate ? id : -1;
}

/* A client's value as messages quote it: printable ASCII only (the message
 * goes back to the client, maybe into JSON). */
static const char *shown(const char *v) {
  for (const char *c = v; *c; c++)
    if (*c < 0x20 || *c > 0x7e || *c == '"' || *c == '\\') return "(not a printable name)";
  return v;
}

td_status td_whisper_prompt_build(const td_whisper_prompt *w, const char *language, const char *task,
                                  bool timestamps, int32_t *out, int *n) {
  *n = 0;
  out[(*n)++] = w->sot;
  if (!task || !*task) task = w->task[0] ? w->task : "transcribe";
  bool translate = !strcmp(task, "translate");
  if (!translate && strcmp(task, "transcribe"))
    return td_err(TD_ERR_INVALID, "task \"%.32s\" is neither \"transcribe\" nor \"translate\"", shown(task));
  if (w->multilingual) {
    char tok[32];
    const char *src = language && *language ? language : NULL;
    if (!src && !w->language[0])
      return td_err(TD_ERR_NOT_FOUND,
                    "no language given and the checkpoint names none: give one (e.g. \"en\") or detect it");
    if (src && !lang_token(src, tok, sizeof tok))
      return td_err(TD_ERR_INVALID, "language \"%.32s\" is not a Whisper language code (e.g. \"en\")", shown(src));
    int32_t id = lang_id(w, src ? tok : w->language);
    if (id < 0)
      return td_err(TD_ERR_INVALID, "language \"%.32s\" is not one this Whisper checkpoint knows",
                    src ? src : w->language);
    out[(*n)++] = id;
    out[(*n)++] = translate ? w->translate : w->transcribe;
  } else if (language && *language && strcmp(language, "en") && strcmp(language, "<|en|>")) {
    return td_err(TD_ERR_INVALID, "language \"%.32s\": this Whisper checkpoint is English-only", shown(language));
  } else if (translate) {
    return td_err(TD_ERR_INVALID, "task \"translate\": this Whisper checkpoint is English-only");
  }
  if (!timestamps) {
    if (w->no_ts < 0) return td_err(TD_ERR_INVALID, "this Whisper tokenizer has no <|notimestamps|> token");
    out[(*n)++] = w->no_ts;
  }
  return TD_OK;
}

void td_whisper_timestamp_rules(const td_whisper_prompt *w, int32_t *begin, int *max_initial) {
  *begin = w->no_ts >= 0 ? w->no_ts + 1 : 0;
  *max_initial = w->max_initial;
}

int32_t td_whisper_prev_sot(const td_whisper_prompt *w) { return w->prev_sot; }

void td_whisper_segments_free(td_whisper_segment *s, size_t n) {
  for (size_t i = 0; s && i < n; i++) free(s[i].text);
  free(s);
}

#define TIME_PRECISION 0.02
#define SEGMENT_SIZE 1500

td_status td_whisper_segments(const td_tokenizer *t, const int32_t *ids, size_t n, int32_t tb,
                              td_whisper_segment **out, size_t *n_out) {
  *out = NULL;
  *n_out = 0;
  size_t n_ts = 0, first = n, last = n;
  for (size_t i = 0; i < n; i++)
    if (ids[i] >= tb) {
      n_ts++;
      if (first == n) first = i;
      last = i;
    }
  /* the slice ends: after each pair of timestamps, and after the last one */
  size_t *ends = malloc(sizeof *ends * (n + 1));
  if (!ends) return td_err(TD_ERR_NOMEM, "out of memory");
  size_t n_ends = 0;
  for (size_t i = 0; i + 1 < n; i++)
    if (ids[i] >= tb && ids[i + 1] >= tb) ends[n_ends++] = i + 1;
  if (n_ends == 0 && n_ts <= 1) {
    free(ends);
    return TD_OK;
  }
  bool has_last = false;
  for (size_t k = 0; k < n_ends; k++) has_last |= ends[k] == last + 1;
  if (!has_last) ends[n_ends++] = last + 1;
  td_whisper_segment *seg = calloc(n_ends, sizeof *seg);
  int32_t *text_ids = malloc(sizeof *text_ids * (n + 1));
  td_status s = seg && text_ids ? TD_OK : td_err(TD_ERR_NOMEM, "out of memory");
  size_t n_seg = 0, from = first;
  long cur_max = 0, prev_len = 0;
  for (size_t k = 0; s == TD_OK && k < n_ends; k++) {
    size_t to = ends[k];
    if (to > from + 1) {
      long start = ids[from] - tb, end = ids[to - 1] - tb;
      if (start < cur_max) { /* the next window started */
        bool single_ending = from >= 2 && !(ids[from - 2] >= tb && ids[from - 1] >= tb);
        prev_len += single_ending ? SEGMENT_SIZE : cur_max;
      }
      cur_max = end;
      size_t m = 0;
      for (size_t i = from; i < to; i++)
        if (ids[i] < tb) text_ids[m++] = ids[i];
      size_t len;
      s = td_tokenizer_decode(t, text_ids, m, false, &seg[n_seg].text, &len);
      if (s == TD_OK) {
        /* as transformers computes them, to the last bit */
        seg[n_seg].start = (double)start * TIME_PRECISION + (double)prev_len * TIME_PRECISION;
        seg[n_seg].end = (double)end * TIME_PRECISION + (double)prev_len * TIME_PRECISION;
        n_seg++;
      }
    }
    from = to;
  }
  free(ends);
  free(text_ids);
  if (s != TD_OK) {
    td_whisper_segments_free(seg, n_seg);
    return s;
  }
  *out = seg;
  *n_out = n_seg;
  return TD_OK;
}
