/* The model the gateway fronts: its name, tokenizer, and for Whisper the
 * mel filters, feature window and task tokens. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/json.h"
#include "gateway/internal.h"

static int32_t special(const td_tokenizer *t, const char *name) { return td_tokenizer_token_to_id(t, name); }

td_status gw_model_load(const char *model_dir, const char *tokenizer_dir, const char *name, gw_model *m) {
  memset(m, 0, sizeof *m);
  char path[4096];
  snprintf(path, sizeof path, "%s/config.json", model_dir);
  cJSON *cfg;
  TD_TRY(td_json_load_file(path, 1u << 20, &cfg));
  int64_t mel = 0, eos = -1, tgt = 0, vocab = 0;
  td_status s = td_json_int(cfg, "num_mel_bins", false, path, &mel);
  if (s == TD_OK) s = td_json_int(cfg, "vocab_size", false, path, &vocab);
  if (s == TD_OK && !td_json_is_null(cfg, "eos_token_id") && cJSON_IsNumber(cJSON_GetObjectItem(cfg, "eos_token_id")))
    s = td_json_int(cfg, "eos_token_id", false, path, &eos);
  if (s == TD_OK) s = td_json_int(cfg, "max_target_positions", false, path, &tgt);
  cJSON_Delete(cfg);
  TD_TRY(s);
  m->whisper = mel > 0;
  m->eos = (int32_t)eos;
  m->max_target = (int)tgt;
  m->model_vocab = vocab > 0 && vocab <= INT32_MAX ? (int32_t)vocab : 0;
  if (name) {
    snprintf(m->name, sizeof m->name, "%s", name);
  } else {
    const char *slash = strrchr(model_dir, '/');
    const char *base = slash && slash[1] ? slash + 1 : model_dir;
    snprintf(m->name, sizeof m->name, "%s", base);
  }
  if ((s = td_tokenizer_load(tokenizer_dir ? tokenizer_dir : model_dir, NULL, &m->tok)) != TD_OK)
    return td_err_ctx(s, "the gateway needs the model's tokenizer (--tokenizer DIR): ");
  m->vocab = td_tokenizer_vocab_size(m->tok);
  if (!m->whisper) return TD_OK;
  td_mel_config mc = {0};
  if ((s = td_mel_config_from_preprocessor(model_dir, &mc)) != TD_OK ||
      (s = td_mel_create(&mc, &m->mel)) != TD_OK) {
    gw_model_free(m);
    return s;
  }
  if (td_mel_n_mels(m->mel) != (int)mel) {
    gw_model_free(m);
    return td_err(TD_ERR_FORMAT, "%s: preprocessor_config.json has %d mel bins, config.json %lld", model_dir,
                  td_mel_n_mels(m->mel), (long long)mel);
  }
  m->window_samples = td_mel_window_samples(m->mel);
  m->sot = special(m->tok, "<|startoftranscript|>");
  m->translate = special(m->tok, "<|translate|>");
  m->transcribe = special(m->tok, "<|transcribe|>");
  m->notimestamps = special(m->tok, "<|notimestamps|>");
  m->startofprev = special(m->tok, "<|startofprev|>");
  m->ts_begin = special(m->tok, "<|0.00|>");
  m->max_initial_timestamp = -1;
  /* generation_config.json's ids win where it has them, as transformers' generate takes them */
  snprintf(path, sizeof path, "%s/generation_config.json", model_dir);
  cJSON *gc = NULL;
  if (access(path, R_OK) == 0 && (s = td_json_load_file(path, 16u << 20, &gc)) != TD_OK) {
    gw_model_free(m);
    return s;
  }
  const cJSON *x = cJSON_GetObjectItemCaseSensitive(gc, "no_timestamps_token_id");
  if (cJSON_IsNumber(x)) m->notimestamps = (int32_t)x->valuedouble;
  const cJSON *tasks = cJSON_GetObjectItemCaseSensitive(gc, "task_to_id");
  if (cJSON_IsNumber(x = cJSON_GetObjectItemCaseSensitive(tasks, "transcribe"))) m->transcribe = (int32_t)x->valuedouble;
  if (cJSON_IsNumber(x = cJSON_GetObjectItemCaseSensitive(tasks, "translate"))) m->translate = (int32_t)x->valuedouble;
  if (cJSON_IsNumber(x = cJSON_GetObjectItemCaseSensitive(gc, "decoder_start_token_id"))) m->sot = (int32_t)x->valuedouble;
  if (cJSON_IsNumber(x = cJSON_GetObjectItemCaseSensitive(gc, "max_initial_timestamp_index")) && x->valuedouble >= 0)
    m->max_initial_timestamp = (int)x->valuedouble;
  /* transformers takes prev_sot_token_id, else the second-to-last suppressed token,
   * else none; checkpoints name <|startofprev|> there, which is what stands in */
  m->prev_sot = m->startofprev;
  if (cJSON_IsNumber(x = cJSON_GetObjectItemCaseSensitive(gc, "prev_sot_token_id"))) m->prev_sot = (int32_t)x->valuedouble;
  cJSON *langs = cJSON_DetachItemFromObjectCaseSensitive(gc, "lang_to_id");
  cJSON_Delete(gc);
  if (cJSON_IsObject(langs))
    m->lang_to_id = langs;
  else
    cJSON_Delete(langs);
  if (m->sot < 0 || m->transcribe < 0 || m->translate < 0 || m->notimestamps < 0) {
    gw_model_free(m);
    return td_err(TD_ERR_FORMAT, "the tokenizer lacks Whisper's task tokens (<|startoftranscript|>, "
                                 "<|transcribe|>, <|translate|>, <|notimestamps|>)");
  }
  /* the languages detection chooses from, and the default, exactly as
   * tandem-generate and the router have them */
  if ((s = td_whisper_prompt_load(model_dir, m->tok, &m->wp)) != TD_OK) {
    gw_model_free(m);
    return s;
  }
  m->langs = td_whisper_languages(m->wp, &m->n_langs);
  int32_t p[TD_WHISPER_PROMPT_MAX];
  int np = 0;
  if (m->langs && td_whisper_prompt_build(m->wp, NULL, "transcribe", true, p, &np) == TD_OK && np >= 2 &&
      !gw_language_code(m, p[1], m->default_language, sizeof m->default_language)) {
    gw_model_free(m);
    return td_err(TD_ERR_FORMAT, "%s: generation_config.json's language is not one of the model's", model_dir);
  }
  return TD_OK;
}

void gw_model_free(gw_model *m) {
  td_whisper_prompt_destroy(m->wp); /* before the tokenizer it refers to */
  cJSON_Delete(m->lang_to_id);
  td_tokenizer_destroy(m->tok);
  td_mel_destroy(m->mel);
  memset(m, 0, sizeof *m);
}
