/* POST /v1/completions: OpenAI's request body to router requests. Every
 * field is checked here with a message naming it; a field OpenAI has that
 * the cluster cannot honour is refused, not ignored (docs/gateway.md). */
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

static bool ids_of(const cJSON *a, const gw_model *m, td_i32vec *out, gw_error *e) {
  int n = cJSON_GetArraySize(a);
  if (n == 0) BAD("prompt", "prompt: an empty token array");
  const cJSON *x;
  cJSON_ArrayForEach(x, a) {
    if (!cJSON_IsNumber(x) || x->valuedouble != floor(x->valuedouble) || x->valuedouble < 0 ||
        x->valuedouble >= m->vocab)
      BAD("prompt", "prompt: token ids are integers in [0, %d)", m->vocab);
    if (td_i32vec_push(out, (int32_t)x->valuedouble) != TD_OK) BAD("prompt", "out of memory");
  }
  return true;
}

static bool text_of(const cJSON *s, const gw_model *m, td_i32vec *out, gw_error *e) {
  int32_t *ids = NULL;
  size_t n = 0;
  const char *txt = s->valuestring;
  if (td_tokenizer_encode(m->tok, txt, strlen(txt), true, &ids, &n) != TD_OK) BAD("prompt", "prompt: %s", td_errmsg());
  if (n == 0) {
    free(ids);
    BAD("prompt", "prompt: the text gives no tokens");
  }
  td_status s2 = td_i32vec_assign(out, ids, (int)n);
  free(ids);
  if (s2 != TD_OK) BAD("prompt", "out of memory");
  return true;
}

static bool is_id_array(const cJSON *a) {
  return cJSON_IsArray(a) && cJSON_GetArraySize(a) > 0 && cJSON_IsNumber(cJSON_GetArrayItem(a, 0));
}

/* A string, an array of strings, an array of ids, or an array of id arrays. */
static bool prompts_of(const cJSON *p, const gw_model *m, gw_completion *c, gw_error *e) {
  if (!p) BAD("prompt", "prompt is required");
  if (cJSON_IsString(p)) {
    c->n_prompts = 1;
    return text_of(p, m, &c->prompts[0], e);
  }
  if (!cJSON_IsArray(p) || cJSON_GetArraySize(p) == 0)
    BAD("prompt", "prompt: a string, an array of strings, an array of token ids or an array of those");
  if (is_id_array(p)) {
    c->n_prompts = 1;
    return ids_of(p, m, &c->prompts[0], e);
  }
  if (cJSON_GetArraySize(p) > TD_GATEWAY_MAX_PROMPTS)
    BAD("prompt", "prompt: %d prompts, at most %d a request", cJSON_GetArraySize(p), TD_GATEWAY_MAX_PROMPTS);
  const cJSON *x;
  cJSON_ArrayForEach(x, p) {
    td_i32vec *v = &c->prompts[c->n_prompts++];
    if (cJSON_IsString(x)) {
      if (!text_of(x, m, v, e)) return false;
    } else if (cJSON_IsArray(x)) {
      if (!ids_of(x, m, v, e)) return false;
    } else {
      BAD("prompt", "prompt: each element a string or an array of token ids");
    }
  }
  return true;
}

static bool num(const cJSON *x, const char *name, double lo, double hi, double *out, gw_error *e) {
  if (!cJSON_IsNumber(x) || !isfinite(x->valuedouble) || x->valuedouble < lo || x->valuedouble > hi)
    BAD(name, "%s: a number in [%g, %g]", name, lo, hi);
  *out = x->valuedouble;
  return true;
}

static bool integer(const cJSON *x, const char *name, double lo, double hi, long long *out, gw_error *e) {
  double v;
  if (!num(x, name, lo, hi, &v, e)) return false;
  if (v != floor(v)) BAD(name, "%s: an integer", name);
  *out = (long long)v;
  return true;
}

/* The field a key sets: aliases set the same one. */
static const char *field_of(const char *k) {
  if (!strcmp(k, "max_new_tokens")) return "max_tokens";
  if (!strcmp(k, "num_beams")) return "best_of";
  return k;
}

/* Whether a key before x in its object sets the same field: JSON leaves a
 * repeated key's meaning open, so a repeat is refused rather than one taken.
 * Bounded: the first unknown key ends the parse, so at most every known key
 * is scanned. */
static bool repeated(const cJSON *o, const cJSON *x) {
  for (const cJSON *y = o->child; y && y != x; y = y->next)
    if (!strcmp(field_of(y->string), field_of(x->string))) return true;
  return false;
}

static bool stops_of(const cJSON *x, gw_completion *c, gw_error *e) {
  if (cJSON_IsNull(x)) return true;
  const cJSON *one = x;
  int n = cJSON_IsArray(x) ? cJSON_GetArraySize(x) : 1;
  if (n > TD_GATEWAY_MAX_STOP) BAD("stop", "stop: at most %d strings", TD_GATEWAY_MAX_STOP);
  for (int i = 0; i < n; i++) {
    if (cJSON_IsArray(x)) one = cJSON_GetArrayItem(x, i);
    if (!cJSON_IsString(one) || !one->valuestring[0]) BAD("stop", "stop: a non-empty string or an array of them");
    if (strlen(one->valuestring) > TD_GATEWAY_MAX_STOP_BYTES)
      BAD("stop", "stop: a string of at most %d bytes", TD_GATEWAY_MAX_STOP_BYTES);
    if (!(c->stop[c->n_stop++] = strdup(one->valuestring))) BAD("stop", "out of memory");
  }
  return true;
}

bool gw_completion_parse(const char *body, size_t len, const gw_model *m, gw_completion *c, gw_error *e) {
  memset(c, 0, sizeof *c);
  td_request_params_default(&c->params);
  c->params.max_new_tokens = TD_GATEWAY_DEFAULT_MAX_TOKENS;
  c->n = 1;
  c->logprobs = -1;
  cJSON *o = cJSON_ParseWithLength(body, len);
  if (!o) {
    gw_error_set(e, 400, NULL, "the body is not valid JSON");
    e->code = "invalid_json";
    return false;
  }
  bool ok = false;
  int best_of = 0;
  td_request_params *q = &c->params;
  if (!cJSON_IsObject(o)) {
    gw_error_set(e, 400, NULL, "the body must be a JSON object");
    goto done;
  }
  const cJSON *model = cJSON_GetObjectItemCaseSensitive(o, "model");
  if (!cJSON_IsString(model)) {
    gw_error_set(e, 400, "model", "model is required (a string; GET /v1/models lists them)");
    goto done;
  }
  if (strcmp(model->valuestring, m->name) != 0) {
    gw_error_set(e, 404, "model", "the model '%s' does not exist (this gateway serves '%s')", model->valuestring,
                 m->name);
    e->code = "model_not_found";
    goto done;
  }
  if (m->whisper) {
    gw_error_set(e, 400, "model", "'%s' takes audio: use /v1/audio/transcriptions", m->name);
    goto done;
  }
  const cJSON *x;
  cJSON_ArrayForEach(x, o) {
    const char *k = x->string;
    double v;
    long long i;
    if (repeated(o, x)) {
      gw_error_set(e, 400, k, "%s: the field is given twice", k);
      goto done;
    }
    if (!strcmp(k, "model") || !strcmp(k, "prompt")) continue;
    if (!strcmp(k, "user")) { /* OpenAI's end-user id: kept nowhere, but bounded like any string */
      if (!cJSON_IsNull(x) && (!cJSON_IsString(x) || strlen(x->valuestring) > TD_GATEWAY_MAX_USER_BYTES)) {
        gw_error_set(e, 400, k, "user: a string of at most %d bytes", TD_GATEWAY_MAX_USER_BYTES);
        goto done;
      }
      continue;
    }
    if (cJSON_IsNull(x)) continue; /* clients send null for "unset" */
    if (!strcmp(k, "max_tokens") || !strcmp(k, "max_new_tokens")) {
      if (!integer(x, k, 1, TD_GATEWAY_MAX_TOKENS, &i, e)) goto done;
      q->max_new_tokens = (int)i;
    } else if (!strcmp(k, "temperature")) {
      if (!num(x, k, 0, 2, &v, e)) goto done;
      q->temperature = (float)v;
    } else if (!strcmp(k, "top_p")) {
      if (!num(x, k, 0, 1, &v, e)) goto done;
      if (v == 0) {
        gw_error_set(e, 400, k, "top_p: in (0, 1]");
        goto done;
      }
      q->top_p = (float)v;
    } else if (!strcmp(k, "top_k")) {
      if (!integer(x, k, 0, 1 << 20, &i, e)) goto done;
      q->top_k = (int)i;
    } else if (!strcmp(k, "n")) {
      if (!integer(x, k, 1, TD_ROUTER_MAX_SAMPLES, &i, e)) goto done;
      c->n = (int)i;
    } else if (!strcmp(k, "best_of") || !strcmp(k, "num_beams")) {
      if (!integer(x, k, 1, TD_ENGINE_MAX_BEAMS, &i, e)) goto done;
      best_of = (int)i;
    } else if (!strcmp(k, "seed")) {
      if (!integer(x, k, -9.2e18, 9.2e18, &i, e)) goto done;
      q->seed = (uint64_t)i;
      q->has_seed = true;
    } else if (!strcmp(k, "stop")) {
      if (!stops_of(x, c, e)) goto done;
    } else if (!strcmp(k, "stop_token_ids")) {
      if (!cJSON_IsArray(x) || !ids_of(x, m, &c->stop_ids, e)) {
        gw_error_set(e, 400, k, "stop_token_ids: an array of token ids in [0, %d)", m->vocab);
        goto done;
      }
    } else if (!strcmp(k, "logprobs")) {
      if (cJSON_IsBool(x)) {
        c->logprobs = cJSON_IsTrue(x) ? 0 : -1;
      } else {
        if (!integer(x, k, 0, 5, &i, e)) goto done;
        if (i > 1) {
          gw_error_set(e, 400, k, "logprobs: at most 1 (the chosen token's; alternatives are not computed)");
          goto done;
        }
        c->logprobs = (int)i;
      }
      q->logprobs = c->logprobs >= 0;
    } else if (!strcmp(k, "stream")) {
      if (!cJSON_IsBool(x)) {
        gw_error_set(e, 400, k, "stream: true or false");
        goto done;
      }
      c->stream = cJSON_IsTrue(x);
    } else if (!strcmp(k, "stream_options")) {
      const cJSON *u = cJSON_GetObjectItemCaseSensitive(x, "include_usage");
      if (!cJSON_IsObject(x) || (u && !cJSON_IsBool(u))) {
        gw_error_set(e, 400, k, "stream_options: {\"include_usage\": true|false}");
        goto done;
      }
      c->include_usage = cJSON_IsTrue(u);
    } else if (!strcmp(k, "length_penalty")) {
      if (!num(x, k, -100, 100, &v, e)) goto done;
      q->length_penalty = (float)v;
    } else if (!strcmp(k, "early_stopping")) {
      if (cJSON_IsBool(x))
        q->early_stopping = cJSON_IsTrue(x);
      else if (cJSON_IsString(x) && !strcmp(x->valuestring, "never"))
        q->early_stopping = -1;
      else {
        gw_error_set(e, 400, k, "early_stopping: true, false or \"never\"");
        goto done;
      }
    } else if (!strcmp(k, "ignore_eos")) {
      if (!cJSON_IsBool(x)) {
        gw_error_set(e, 400, k, "ignore_eos: true or false");
        goto done;
      }
      q->ignore_eos = cJSON_IsTrue(x);
    } else if (!strcmp(k, "echo") || !strcmp(k, "suffix") || !strcmp(k, "presence_penalty") ||
               !strcmp(k, "frequency_penalty") || !strcmp(k, "logit_bias")) {
      /* accepted only at their neutral value */
      bool neutral = (cJSON_IsBool(x) && !cJSON_IsTrue(x)) || (cJSON_IsNumber(x) && x->valuedouble == 0) ||
                     (cJSON_IsObject(x) && !x->child);
      if (!neutral) {
        gw_error_set(e, 400, k, "%s is not supported by this server", k);
        goto done;
      }
    } else {
      gw_error_set(e, 400, k, "unknown field '%s'", k);
      goto done;
    }
  }
  if (!prompts_of(cJSON_GetObjectItemCaseSensitive(o, "prompt"), m, c, e)) goto done;
  if (best_of > 1) {
    /* OpenAI's best_of keeps the best n of best_of; here that is beam search */
    if (q->temperature > 0) {
      gw_error_set(e, 400, "best_of", "best_of runs beam search: it needs temperature 0 (or absent)");
      goto done;
    }
    if (best_of < c->n) {
      gw_error_set(e, 400, "best_of", "best_of (%d) must be at least n (%d)", best_of, c->n);
      goto done;
    }
    if (c->stream) {
      gw_error_set(e, 400, "best_of", "best_of cannot be streamed");
      goto done;
    }
    q->num_beams = best_of;
    q->num_return_sequences = c->n;
  } else {
    q->n = c->n;
  }
  if (c->include_usage && !c->stream) {
    gw_error_set(e, 400, "stream_options", "stream_options needs stream: true");
    goto done;
  }
  ok = true;
done:
  cJSON_Delete(o);
  if (!ok) gw_completion_free(c);
  return ok;
}

void gw_completion_free(gw_completion *c) {
  for (int i = 0; i < TD_GATEWAY_MAX_PROMPTS; i++) td_i32vec_free(&c->prompts[i]);
  td_i32vec_free(&c->stop_ids);
  for (int i = 0; i < c->n_stop; i++) free(c->stop[i]);
  memset(c, 0, sizeof *c);
}
