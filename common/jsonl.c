#include "common/jsonl.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/json.h"

#define MAX_FEATURE_BYTES (256u << 20)

static const char *const known[] = {"id", "input_ids", "input_features", "decoder_prompt", "max_new_tokens",
                                    "temperature", "top_k", "top_p", "seed", "n", "num_beams",
                                    "num_return_sequences", "length_penalty", "early_stopping", "stop_token_ids",
                                    "logprobs", "forced_bos_token_id", "forced_eos_token_id", "ignore_eos",
                                    "text", "audio", "language", "task", "timestamps", "probe_token_id",
                                    "probe_position", "temperature_increment_on_fallback",
                                    "compression_ratio_threshold", "logprob_threshold", "no_speech_threshold",
                                    "condition_on_previous_text"};

/* A long-form setting: absent, null (off, where allowed) or a number. */
static td_status opt_num(const cJSON *j, const char *key, bool off_ok, const char *src, td_opt_num *out) {
  const cJSON *x = cJSON_GetObjectItemCaseSensitive(j, key);
  if (!x) return TD_OK;
  out->given = true;
  if (off_ok && cJSON_IsNull(x)) {
    out->off = true;
    return TD_OK;
  }
  if (!cJSON_IsNumber(x) || !isfinite(x->valuedouble))
    return td_err(TD_ERR_INVALID, "%s: \"%s\" must be a number%s", src, key, off_ok ? " or null (off)" : "");
  out->v = x->valuedouble;
  return TD_OK;
}

/* The bytes of a file a request line names (relative to base), at most max. */
static td_status read_file(const char *field, const char *path, const char *base, const char *src, size_t max,
                           void **out, size_t *n) {
  char full[PATH_MAX];
  if (path[0] == '/' || !base || !*base)
    snprintf(full, sizeof full, "%s", path);
  else
    snprintf(full, sizeof full, "%s/%s", base, path);
  FILE *f = fopen(full, "rb");
  if (!f) return td_err(TD_ERR_INVALID, "%s: %s \"%s\": %s", src, field, full, strerror(errno));
  td_status s = TD_OK;
  long sz = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
  if (sz <= 0 || (unsigned long)sz > max) {
    s = td_err(TD_ERR_INVALID, "%s: %s \"%s\" has %ld bytes (1 to %zu accepted)", src, field, full, sz, max);
  } else if (fseek(f, 0, SEEK_SET) != 0 || !(*out = malloc((size_t)sz))) {
    s = td_err(TD_ERR_NOMEM, "out of memory");
  } else if (fread(*out, 1, (size_t)sz, f) != (size_t)sz) {
    s = td_err(TD_ERR_IO, "%s: short read of %s", src, full);
  } else {
    *n = (size_t)sz;
  }
  fclose(f);
  return s;
}

static td_status read_features(const char *path, const char *base, const char *src, float **out, size_t *n) {
  void *p = NULL;
  size_t bytes = 0;
  TD_TRY(read_file("input_features", path, base, src, MAX_FEATURE_BYTES, &p, &bytes));
  *out = p;
  if (bytes % 4) return td_err(TD_ERR_INVALID, "%s: input_features \"%s\" has %zu bytes, not a float32 array", src, path, bytes);
  *n = bytes / 4;
  return TD_OK;
}

/* "text", "audio" and the audio options. */
static td_status parse_text_audio(const cJSON *j, const char *base, const char *src, td_json_request *r) {
  const cJSON *t = cJSON_GetObjectItemCaseSensitive(j, "text");
  if (t) {
    if (!cJSON_IsString(t)) return td_err(TD_ERR_INVALID, "%s: \"text\" must be a string", src);
    size_t n = strlen(t->valuestring);
    if (!n) return td_err(TD_ERR_INVALID, "%s: \"text\" is empty", src);
    if (n > TD_MAX_TEXT_BYTES)
      return td_err(TD_ERR_INVALID, "%s: \"text\" of %zu bytes exceeds the limit of %u", src, n, TD_MAX_TEXT_BYTES);
    if (!(r->text = strdup(t->valuestring))) return td_err(TD_ERR_NOMEM, "out of memory");
  }
  char path[PATH_MAX] = "";
  TD_TRY(td_json_str(j, "audio", false, src, path, sizeof path));
  if (path[0]) {
    void *p = NULL;
    TD_TRY(read_file("audio", path, base, src, TD_MAX_AUDIO_BYTES, &p, &r->audio_len));
    r->audio = p;
  }
  TD_TRY(td_json_str(j, "language", false, src, r->language, sizeof r->language));
  TD_TRY(td_json_str(j, "task", false, src, r->task, sizeof r->task));
  TD_TRY(td_json_bool(j, "timestamps", false, src, &r->timestamps));
  if (!r->audio && (r->language[0] || r->task[0] || r->timestamps))
    return td_err(TD_ERR_INVALID, "%s: \"language\", \"task\" and \"timestamps\" go with \"audio\"", src);
  td_longform_settings *lf = &r->longform;
  TD_TRY(opt_num(j, "temperature_increment_on_fallback", false, src, &lf->temperature_increment));
  TD_TRY(opt_num(j, "compression_ratio_threshold", true, src, &lf->compression_ratio_threshold));
  TD_TRY(opt_num(j, "logprob_threshold", true, src, &lf->logprob_threshold));
  TD_TRY(opt_num(j, "no_speech_threshold", true, src, &lf->no_speech_threshold));
  if (cJSON_GetObjectItemCaseSensitive(j, "condition_on_previous_text")) {
    TD_TRY(td_json_bool(j, "condition_on_previous_text", true, src, &lf->condition_on_previous_text));
    lf->condition_given = true;
  }
  bool any_lf = lf->temperature_increment.given || lf->compression_ratio_threshold.given ||
                lf->logprob_threshold.given || lf->no_speech_threshold.given || lf->condition_given;
  if (!r->audio && any_lf)
    return td_err(TD_ERR_INVALID, "%s: the long-form settings (\"compression_ratio_threshold\", ...) go with \"audio\"",
                  src);
  if (r->task[0] && strcmp(r->task, "transcribe") && strcmp(r->task, "translate"))
    return td_err(TD_ERR_INVALID, "%s: \"task\" must be \"transcribe\" or \"translate\"", src);
  return TD_OK;
}

static td_status parse_obj(const cJSON *j, const char *base, const char *src, td_json_request *r) {
  td_request_params *p = &r->params;
  const cJSON *it;
  cJSON_ArrayForEach(it, j) {
    bool ok = false;
    for (size_t i = 0; i < sizeof known / sizeof known[0] && !ok; i++) ok = strcmp(it->string, known[i]) == 0;
    if (!ok) return td_err(TD_ERR_INVALID, "%s: unknown field \"%s\"", src, it->string);
  }
  const cJSON *id = cJSON_GetObjectItemCaseSensitive(j, "id");
  if (id) {
    if (cJSON_IsString(id))
      TD_TRY(td_json_str(j, "id", true, src, r->id, sizeof r->id));
    else if (cJSON_IsNumber(id))
      snprintf(r->id, sizeof r->id, "%.0f", id->valuedouble);
    else
      return td_err(TD_ERR_INVALID, "%s: \"id\" must be a string", src);
  }
  TD_TRY(td_json_i32_array(j, "input_ids", false, src, INT32_MIN, INT32_MAX, &r->input_ids, &r->n_input));
  char fpath[PATH_MAX] = "";
  TD_TRY(td_json_str(j, "input_features", false, src, fpath, sizeof fpath));
  if (fpath[0]) TD_TRY(read_features(fpath, base, src, &r->features, &r->n_features));
  TD_TRY(parse_text_audio(j, base, src, r));
  int inputs = (r->input_ids != NULL) + (r->features != NULL) + (r->text != NULL) + (r->audio != NULL);
  if (inputs != 1)
    return td_err(TD_ERR_INVALID, "%s: give exactly one of \"input_ids\", \"input_features\", \"text\" and \"audio\" (%s)",
                  src, inputs ? "got several" : "got none");
  if (r->input_ids && r->n_input == 0) return td_err(TD_ERR_INVALID, "%s: \"input_ids\" is empty", src);
  TD_TRY(td_json_i32_array(j, "decoder_prompt", false, src, INT32_MIN, INT32_MAX, &r->prompt, &r->n_prompt));
  TD_TRY(td_json_i32_array(j, "stop_token_ids", false, src, INT32_MIN, INT32_MAX, &r->stop_ids, &r->n_stop_ids));
  int32_t v32;
  v32 = p->max_new_tokens;
  TD_TRY(td_json_i32(j, "max_new_tokens", false, src, &v32));
  if (cJSON_GetObjectItemCaseSensitive(j, "max_new_tokens") && v32 < 1)
    return td_err(TD_ERR_INVALID, "%s: \"max_new_tokens\" must be at least 1", src);
  p->max_new_tokens = v32;
  double d = p->temperature;
  TD_TRY(td_json_num(j, "temperature", false, src, &d));
  p->temperature = (float)d;
  d = p->top_p;
  TD_TRY(td_json_num(j, "top_p", false, src, &d));
  p->top_p = (float)d;
  d = p->length_penalty;
  TD_TRY(td_json_num(j, "length_penalty", false, src, &d));
  p->length_penalty = (float)d;
  v32 = p->top_k;
  TD_TRY(td_json_i32(j, "top_k", false, src, &v32));
  p->top_k = v32;
  v32 = p->n;
  TD_TRY(td_json_i32(j, "n", false, src, &v32));
  p->n = v32;
  v32 = p->num_beams;
  TD_TRY(td_json_i32(j, "num_beams", false, src, &v32));
  p->num_beams = v32;
  v32 = p->num_return_sequences;
  TD_TRY(td_json_i32(j, "num_return_sequences", false, src, &v32));
  p->num_return_sequences = v32;
  const cJSON *seed = cJSON_GetObjectItemCaseSensitive(j, "seed");
  if (seed) {
    /* a JSON number is a double: integers above 2^53 would arrive rounded */
    if (!cJSON_IsNumber(seed) || seed->valuedouble < 0 || seed->valuedouble != floor(seed->valuedouble) ||
        seed->valuedouble > 9007199254740992.0)
      return td_err(TD_ERR_INVALID, "%s: \"seed\" must be an integer from 0 to 2^53", src);
    p->seed = (uint64_t)seed->valuedouble;
    p->has_seed = true;
  }
  const cJSON *es = cJSON_GetObjectItemCaseSensitive(j, "early_stopping");
  if (es) {
    if (cJSON_IsBool(es))
      p->early_stopping = cJSON_IsTrue(es) ? 1 : 0;
    else if (cJSON_IsString(es) && !strcmp(es->valuestring, "never"))
      p->early_stopping = -1;
    else
      return td_err(TD_ERR_INVALID, "%s: \"early_stopping\" must be true, false or \"never\"", src);
  }
  TD_TRY(td_json_bool(j, "logprobs", false, src, &p->logprobs));
  /* a probe: the probability of a token after a decoder prompt position */
  bool has_tok = cJSON_GetObjectItemCaseSensitive(j, "probe_token_id") != NULL,
       has_pos = cJSON_GetObjectItemCaseSensitive(j, "probe_position") != NULL;
  if (has_tok != has_pos)
    return td_err(TD_ERR_INVALID, "%s: \"probe_token_id\" and \"probe_position\" go together", src);
  if (has_tok) {
    TD_TRY(td_json_i32(j, "probe_token_id", true, src, &p->probe_token));
    v32 = 0;
    TD_TRY(td_json_i32(j, "probe_position", true, src, &v32));
    if (p->probe_token < 0 || v32 < 0)
      return td_err(TD_ERR_INVALID, "%s: \"probe_token_id\" and \"probe_position\" must be at least 0", src);
    p->probe_position = v32;
    p->probe = true;
  }
  TD_TRY(td_json_bool(j, "ignore_eos", false, src, &p->ignore_eos));
  const char *forced[2] = {"forced_bos_token_id", "forced_eos_token_id"};
  int *dst[2] = {&p->forced_bos, &p->forced_eos};
  for (int i = 0; i < 2; i++) {
    if (!cJSON_GetObjectItemCaseSensitive(j, forced[i])) continue;
    if (td_json_is_null(j, forced[i])) {
      *dst[i] = -1;
      continue;
    }
    v32 = 0;
    TD_TRY(td_json_i32(j, forced[i], true, src, &v32));
    if (v32 < 0) return td_err(TD_ERR_INVALID, "%s: \"%s\" must be a token id or null", src, forced[i]);
    *dst[i] = v32;
  }
  return TD_OK;
}

td_status td_json_request_parse(const char *line, size_t len, const char *base_dir, int line_no,
                                td_json_request *r) {
  memset(r, 0, sizeof *r);
  td_request_params_default(&r->params);
  snprintf(r->id, sizeof r->id, "line-%d", line_no);
  char src[64];
  snprintf(src, sizeof src, "request line %d", line_no);
  cJSON *j = NULL;
  TD_TRY(td_json_parse(line, len, src, &j));
  td_status s = TD_OK;
  if (!cJSON_IsObject(j))
    s = td_err(TD_ERR_INVALID, "%s: not a JSON object", src);
  else
    s = parse_obj(j, base_dir, src, r);
  cJSON_Delete(j);
  if (s != TD_OK) {
    char keep[256];
    memcpy(keep, r->id, sizeof keep);
    td_json_request_free(r);
    memcpy(r->id, keep, sizeof keep);
  }
  return s;
}

void td_json_request_free(td_json_request *r) {
  free(r->input_ids);
  free(r->features);
  free(r->prompt);
  free(r->stop_ids);
  free(r->text);
  free(r->audio);
  memset(r, 0, sizeof *r);
}

static char *print_free(cJSON *o) {
  char *s = o ? cJSON_PrintUnformatted(o) : NULL;
  cJSON_Delete(o);
  return s;
}

char *td_json_result_format(const char *id, const td_seq_output *outputs, int n_outputs) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "id", id ? id : "");
  cJSON *outs = cJSON_AddArrayToObject(o, "outputs");
  for (int i = 0; i < n_outputs; i++) {
    const td_seq_output *so = &outputs[i];
    cJSON *e = cJSON_CreateObject();
    cJSON *toks = cJSON_AddArrayToObject(e, "tokens");
    for (int t = 0; t < so->n_tokens; t++) cJSON_AddItemToArray(toks, cJSON_CreateNumber(so->tokens[t]));
    if (so->text) cJSON_AddStringToObject(e, "text", so->text);
    if (so->segments) {
      cJSON *segs = cJSON_AddArrayToObject(e, "segments");
      for (int k = 0; k < so->n_segments; k++) {
        cJSON *g = cJSON_CreateObject();
        cJSON_AddNumberToObject(g, "start", so->segments[k].start);
        cJSON_AddNumberToObject(g, "end", so->segments[k].end);
        cJSON_AddStringToObject(g, "text", so->segments[k].text ? so->segments[k].text : "");
        cJSON_AddItemToArray(segs, g);
      }
    }
    cJSON_AddStringToObject(e, "finish_reason", td_finish_name(so->finish));
    cJSON_AddNumberToObject(e, "score", so->score);
    if (so->has_probe) cJSON_AddNumberToObject(e, "probe_prob", so->probe_prob);
    if (so->logprobs) {
      cJSON *lp = cJSON_AddArrayToObject(e, "logprobs");
      for (int t = 0; t < so->n_tokens; t++) cJSON_AddItemToArray(lp, cJSON_CreateNumber(so->logprobs[t]));
    }
    cJSON_AddItemToArray(outs, e);
  }
  return print_free(o);
}

char *td_json_error_format(const char *id, td_status code, const char *msg) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "id", id ? id : "");
  cJSON_AddStringToObject(o, "error", msg ? msg : td_status_str(code));
  cJSON_AddStringToObject(o, "code", td_status_str(code));
  return print_free(o);
}
