/* Admission checks: a request against the served model and the fixed
 * limits, each refusal naming its limit, and what a valid request needs
 * (router/policy.h). Pure: what depends on the registered workers is
 * placement's (td_place_possible). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "common/defaults.h"
#include "common/request.h"
#include "router/policy.h"

#define REFUSE(st, ...)              \
  do {                               \
    snprintf(msg, cap, __VA_ARGS__); \
    return st;                       \
  } while (0)

td_status td_admit_request_id(const char *id, char *msg, size_t cap) {
  size_t n = id ? strlen(id) : 0;
  if (!n) REFUSE(TD_ERR_INVALID, "request_id is empty (1 to %d bytes)", TD_ROUTER_MAX_REQUEST_ID);
  if (n > TD_ROUTER_MAX_REQUEST_ID)
    REFUSE(TD_ERR_INVALID, "request_id of %zu bytes exceeds %d", n, TD_ROUTER_MAX_REQUEST_ID);
  return TD_OK;
}

td_status td_admit_inputs(const td_admit_frontend *fe, const Tandem__GenerateRequest *g, char *msg, size_t cap) {
  const char *names[4];
  int n = 0;
  bool text = g->text && g->text[0], audio = g->audio.len > 0;
  if (g->n_input_ids) names[n++] = "input_ids";
  if (g->features) names[n++] = "features";
  if (text) names[n++] = "text";
  if (audio) names[n++] = "audio";
  if (n == 0) REFUSE(TD_ERR_INVALID, "no input: give one of input_ids, features, text and audio");
  if (n > 1)
    REFUSE(TD_ERR_INVALID, "give exactly one of input_ids, features, text and audio, not %s and %s%s", names[0],
           names[1], n > 2 ? " and more" : "");
  if (!audio && ((g->language && g->language[0]) || (g->task && g->task[0]) || g->timestamps))
    REFUSE(TD_ERR_INVALID, "language, task and timestamps go with audio input only");
  if ((text || audio) && !fe->text)
    REFUSE(TD_ERR_INVALID, "%s input needs a tokenizer at the router (tandem-router --tokenizer DIR); "
           "this one takes input_ids and features only", text ? "text" : "audio");
  if (text && strlen(g->text) > TD_MAX_TEXT_BYTES)
    REFUSE(TD_ERR_INVALID, "text of %zu bytes exceeds the limit of %u", strlen(g->text), TD_MAX_TEXT_BYTES);
  if (audio && !fe->audio)
    REFUSE(TD_ERR_INVALID, "audio input needs a Whisper checkpoint's preprocessor_config.json at the router "
           "(tandem-router --tokenizer DIR); this router converts text only");
  if (audio && g->audio.len > TD_MAX_AUDIO_BYTES)
    REFUSE(TD_ERR_INVALID, "audio of %zu bytes exceeds the limit of %u", g->audio.len, TD_MAX_AUDIO_BYTES);
  if (audio && g->n_decoder_prompt)
    REFUSE(TD_ERR_INVALID, "audio input takes no decoder_prompt: the router builds Whisper's from language, task "
           "and timestamps");
  if (g->language && strlen(g->language) > TD_MAX_LANGUAGE_BYTES)
    REFUSE(TD_ERR_INVALID, "language of %zu bytes exceeds the limit of %d", strlen(g->language),
           TD_MAX_LANGUAGE_BYTES);
  return TD_OK;
}

static td_status check_input(const Tandem__ModelInfo *mi, const Tandem__GenerateRequest *g, int *enc_len, char *msg,
                             size_t cap) {
  int V = (int)mi->vocab_size;
  if (mi->mel_bins > 0) {
    size_t want = (size_t)mi->mel_bins * mi->frames;
    if (!g->features)
      REFUSE(TD_ERR_INVALID, "this model (%s) takes audio or audio features, not input_ids or text",
             mi->model_type ? mi->model_type : "Whisper");
    if (!g->features || g->features->n_values != want)
      REFUSE(TD_ERR_INVALID, "this model takes audio features of %u x %u floats, got %zu", mi->mel_bins, mi->frames,
             g->features ? g->features->n_values : 0);
    if ((g->features->mel_bins && g->features->mel_bins != mi->mel_bins) ||
        (g->features->frames && g->features->frames != mi->frames))
      REFUSE(TD_ERR_INVALID, "features are %u x %u, the model takes %u x %u", g->features->mel_bins,
             g->features->frames, mi->mel_bins, mi->frames);
    if (td_first_nonfinite(g->features->values, want) < want)
      REFUSE(TD_ERR_INVALID, "audio features contain NaN or infinity");
    *enc_len = (int)mi->max_source_len;
    return TD_OK;
  }
  if (g->features) REFUSE(TD_ERR_INVALID, "this model takes input_ids, not audio features");
  if (!g->n_input_ids) REFUSE(TD_ERR_INVALID, "empty encoder input");
  if (g->n_input_ids > mi->max_source_len)
    REFUSE(TD_ERR_INVALID, "encoder input of %zu tokens exceeds the model's %u", g->n_input_ids, mi->max_source_len);
  for (size_t i = 0; i < g->n_input_ids; i++)
    if (g->input_ids[i] < 0 || g->input_ids[i] >= V)
      REFUSE(TD_ERR_INVALID, "input token %d (at %zu) is outside the vocabulary of %d", g->input_ids[i], i, V);
  *enc_len = (int)g->n_input_ids;
  return TD_OK;
}

/* Sampling and beam parameters: one limit, one message. */
static td_status check_sampling(const Tandem__SamplingParams *sp, int V, char *msg, size_t cap) {
  int n = sp->n ? (int)sp->n : 1, beams = sp->num_beams ? (int)sp->num_beams : 1;
  if (!(sp->temperature >= 0) || !isfinite(sp->temperature))
    REFUSE(TD_ERR_INVALID, "temperature must be a finite number >= 0 (0: greedy), got %g", sp->temperature);
  if (!(sp->top_p >= 0) || !isfinite(sp->top_p))
    REFUSE(TD_ERR_INVALID, "top_p must be a finite number >= 0 (0 or >= 1: off), got %g", sp->top_p);
  if (sp->top_k < 0 || sp->top_k > V)
    REFUSE(TD_ERR_INVALID, "top_k must be 0 (off) to the vocabulary's %d, got %d", V, sp->top_k);
  if (sp->n > TD_ROUTER_MAX_SAMPLES)
    REFUSE(TD_ERR_INVALID, "n = %u exceeds the limit of %d samples a request", sp->n, TD_ROUTER_MAX_SAMPLES);
  if (sp->num_beams > TD_ENGINE_MAX_BEAMS)
    REFUSE(TD_ERR_INVALID, "num_beams = %u exceeds the limit of %d beams", sp->num_beams, TD_ENGINE_MAX_BEAMS);
  if (beams > 1 && n > 1)
    REFUSE(TD_ERR_INVALID, "num_beams = %d with n = %d: beam search takes no samples (n must be 1)", beams, n);
  if (beams > 1 && sp->temperature > 0)
    REFUSE(TD_ERR_INVALID, "num_beams = %d with temperature %g: beam search does not sample (temperature must be 0)",
           beams, sp->temperature);
  if (beams > 1 && sp->num_return_sequences > (uint32_t)beams)
    REFUSE(TD_ERR_INVALID, "num_return_sequences %u exceeds num_beams %d", sp->num_return_sequences, beams);
  if (beams == 1 && sp->num_return_sequences > (uint32_t)n)
    REFUSE(TD_ERR_INVALID, "num_return_sequences %u exceeds n %d", sp->num_return_sequences, n);
  if (sp->has_length_penalty && !isfinite(sp->length_penalty))
    REFUSE(TD_ERR_INVALID, "length_penalty must be a finite number, got %g", sp->length_penalty);
  if (sp->early_stopping < -1 || sp->early_stopping > 1)
    REFUSE(TD_ERR_INVALID, "early_stopping must be 1 (true), 0 (false) or -1 (never), got %d", sp->early_stopping);
  if (sp->set_forced_bos && (sp->forced_bos_token_id < -1 || sp->forced_bos_token_id >= V))
    REFUSE(TD_ERR_INVALID, "forced_bos_token_id %d is outside the vocabulary of %d (-1: none)", sp->forced_bos_token_id,
           V);
  if (sp->timestamp_begin < 0 || sp->timestamp_begin >= V)
    REFUSE(TD_ERR_INVALID, "timestamp_begin %d is outside the vocabulary of %d", sp->timestamp_begin, V);
  if (sp->has_max_initial_timestamp && (sp->max_initial_timestamp_index < 0 || sp->max_initial_timestamp_index >= V))
    REFUSE(TD_ERR_INVALID, "max_initial_timestamp_index must be 0 to the vocabulary's %d, got %d", V,
           sp->max_initial_timestamp_index);
  if (sp->n_allowed_token_ids > (size_t)V)
    REFUSE(TD_ERR_INVALID, "%zu allowed_token_ids exceed the vocabulary of %d", sp->n_allowed_token_ids, V);
  for (size_t i = 0; i < sp->n_allowed_token_ids; i++)
    if (sp->allowed_token_ids[i] < 0 || sp->allowed_token_ids[i] >= V)
      REFUSE(TD_ERR_INVALID, "allowed token %d is outside the vocabulary of %d", sp->allowed_token_ids[i], V);
  if (sp->probe && (sp->probe_token_id < 0 || sp->probe_token_id >= V))
    REFUSE(TD_ERR_INVALID, "probe_token_id %d is outside the vocabulary of %d", sp->probe_token_id, V);
  if (sp->set_forced_eos && (sp->forced_eos_token_id < -1 || sp->forced_eos_token_id >= V))
    REFUSE(TD_ERR_INVALID, "forced_eos_token_id %d is outside the vocabulary of %d (-1: none)", sp->forced_eos_token_id,
           V);
  return TD_OK;
}

td_status td_admit_request(const Tandem__ModelInfo *mi, int block_size, const Tandem__GenerateRequest *g,
                           td_req_shape *out, char *msg, size_t cap) {
  memset(out, 0, sizeof *out);
  int V = (int)mi->vocab_size;
  const char *name = mi->name ? mi->name : "", *type = mi->model_type ? mi->model_type : "";
  if (g->model && strlen(g->model) > TD_WIRE_MAX_NAME)
    REFUSE(TD_ERR_INVALID, "model of %zu bytes exceeds the limit of %d", strlen(g->model), TD_WIRE_MAX_NAME);
  if (g->model && g->model[0] && strcmp(g->model, name) && strcmp(g->model, type))
    REFUSE(TD_ERR_NOT_FOUND, "model \"%s\" is not served here (serving \"%s\")", g->model, name);
  td_status s = check_input(mi, g, &out->enc_len, msg, cap);
  if (s != TD_OK) return s;
  int n_prompt = g->n_decoder_prompt ? (int)g->n_decoder_prompt : 1;
  if (n_prompt >= (int)mi->max_target_len)
    REFUSE(TD_ERR_INVALID, "decoder prompt of %d tokens leaves no room in the model's %u positions", n_prompt,
           mi->max_target_len);
  for (size_t i = 0; i < g->n_decoder_prompt; i++)
    if (g->decoder_prompt[i] < 0 || g->decoder_prompt[i] >= V)
      REFUSE(TD_ERR_INVALID, "decoder prompt token %d is outside the vocabulary of %d", g->decoder_prompt[i], V);
  if (g->n_stop_token_ids > TD_ROUTER_MAX_STOP_IDS)
    REFUSE(TD_ERR_INVALID, "%zu stop_token_ids exceed the limit of %d", g->n_stop_token_ids, TD_ROUTER_MAX_STOP_IDS);
  for (size_t i = 0; i < g->n_stop_token_ids; i++)
    if (g->stop_token_ids[i] < 0 || g->stop_token_ids[i] >= V)
      REFUSE(TD_ERR_INVALID, "stop token %d is outside the vocabulary of %d", g->stop_token_ids[i], V);
  int room = (int)mi->max_target_len - n_prompt;
  if ((int64_t)g->max_new_tokens > room)
    REFUSE(TD_ERR_INVALID, "prompt %d + max_new_tokens %u exceeds the model's %u positions", n_prompt,
           g->max_new_tokens, mi->max_target_len);
  const Tandem__SamplingParams *sp = g->sampling;
  if (sp && (s = check_sampling(sp, V, msg, cap)) != TD_OK) return s;
  int n = sp && sp->n ? (int)sp->n : 1, beams = sp && sp->num_beams ? (int)sp->num_beams : 1;
  if (sp && sp->probe && sp->probe_position >= (uint32_t)n_prompt)
    REFUSE(TD_ERR_INVALID, "probe_position %u is outside the decoder prompt of %d tokens", sp->probe_position,
           n_prompt);
  out->probe = sp && sp->probe;
  out->n_prompt = n_prompt;
  out->max_new = g->max_new_tokens ? (int)g->max_new_tokens : room;
  out->width = beams > 1 ? beams : n;
  out->need_cross = (out->enc_len + block_size - 1) / block_size;
  out->need_self = out->width * ((n_prompt + out->max_new + block_size - 1) / block_size + 1);
  return TD_OK;
}
