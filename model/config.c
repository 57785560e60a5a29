#include "model/config.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/json.h"

#define CONFIG_MAX_BYTES (16u << 20)

const char *td_act_name(td_act a) {
  switch (a) {
    case TD_ACT_NONE: return "none";
    case TD_ACT_RELU: return "relu";
    case TD_ACT_GELU: return "gelu";
    case TD_ACT_GELU_TANH: return "gelu_new";
    case TD_ACT_SILU: return "silu";
    case TD_ACT_QUICK_GELU: return "quick_gelu";
  }
  return "?";
}

static int parse_act(const char *s) {
  if (!strcmp(s, "relu")) return TD_ACT_RELU;
  if (!strcmp(s, "gelu")) return TD_ACT_GELU;
  if (!strcmp(s, "gelu_new") || !strcmp(s, "gelu_fast") || !strcmp(s, "gelu_pytorch_tanh"))
    return TD_ACT_GELU_TANH;
  if (!strcmp(s, "silu") || !strcmp(s, "swish")) return TD_ACT_SILU;
  if (!strcmp(s, "quick_gelu")) return TD_ACT_QUICK_GELU;
  return -1;
}

static td_status get_pos_int(const cJSON *j, const char *key, bool required, const char *src, int *out) {
  int64_t v = *out;
  TD_TRY(td_json_int(j, key, required, src, &v));
  if (v <= 0 || v > (1 << 24))
    return td_err(TD_ERR_FORMAT, "%s: field \"%s\" = %lld must be a positive size", src, key, (long long)v);
  *out = (int)v;
  return TD_OK;
}

static td_status load_t5(const cJSON *j, const char *src, td_model_config *c) {
  c->family = TD_FAMILY_T5;
  int d_kv = 0, d_ff = 0, heads = 0;
  TD_TRY(get_pos_int(j, "d_model", true, src, &c->d_model));
  TD_TRY(get_pos_int(j, "d_kv", true, src, &d_kv));
  TD_TRY(get_pos_int(j, "d_ff", true, src, &d_ff));
  TD_TRY(get_pos_int(j, "num_layers", true, src, &c->enc_layers));
  c->dec_layers = c->enc_layers;
  if (!td_json_is_null(j, "num_decoder_layers"))
    TD_TRY(get_pos_int(j, "num_decoder_layers", false, src, &c->dec_layers));
  TD_TRY(get_pos_int(j, "num_heads", true, src, &heads));
  c->enc_heads = c->dec_heads = heads;
  c->enc_head_dim = c->dec_head_dim = d_kv;
  c->enc_ffn = c->dec_ffn = d_ff;
  c->rel_buckets = 32;
  c->rel_max_distance = 128;
  TD_TRY(get_pos_int(j, "relative_attention_num_buckets", false, src, &c->rel_buckets));
  TD_TRY(get_pos_int(j, "relative_attention_max_distance", false, src, &c->rel_max_distance));
  double eps = 1e-6;
  TD_TRY(td_json_num(j, "layer_norm_epsilon", false, src, &eps));
  c->norm_eps = (float)eps;
  char ffp[64] = "relu";
  TD_TRY(td_json_str(j, "feed_forward_proj", false, src, ffp, sizeof ffp));
  const char *act = ffp;
  c->gated_ffn = strncmp(ffp, "gated-", 6) == 0;
  if (c->gated_ffn) act = ffp + 6;
  int a = parse_act(act);
  /* transformers maps "gated-gelu" to the tanh approximation. */
  if (c->gated_ffn && a == TD_ACT_GELU) a = TD_ACT_GELU_TANH;
  if (a < 0 || strchr(act, '-'))
    return td_err(TD_ERR_UNSUPPORTED,
                  "%s: feed_forward_proj \"%s\" is not supported (expected relu, gelu, gated-gelu, gated-silu, ...)",
                  src, ffp);
  c->act = (td_act)a;
  c->rmsnorm = true;
  c->pre_norm = true;
  c->final_norm = true;
  c->layernorm_embedding = false;
  c->embed_scale = 1.0f;
  c->pos_kind = TD_POS_RELATIVE;
  c->pos_offset = 0;
  int n_pos = 512;
  TD_TRY(get_pos_int(j, "n_positions", false, src, &n_pos));
  c->max_source_len = c->max_target_len = n_pos;
  c->enc_attn_scale = c->dec_attn_scale = 1.0f;
  c->attn_bias = c->k_bias = false;
  c->tie_word_embeddings = true;
  TD_TRY(td_json_bool(j, "tie_word_embeddings", false, src, &c->tie_word_embeddings));
  /* transformers 5 saves scale_decoder_outputs for t5; older t5 configs imply
   * it by tying. Its mt5 never scales unless told to (checked against 5.17). */
  c->scale_decoder_outputs = c->tie_word_embeddings && strcmp(c->model_type, "mt5") != 0;
  TD_TRY(td_json_bool(j, "scale_decoder_outputs", false, src, &c->scale_decoder_outputs));
  c->shared_embeddings = true;
  return TD_OK;
}

static td_status load_bart_like(const cJSON *j, const char *src, td_model_config *c) {
  c->family = !strcmp(c->model_type, "whisper") ? TD_FAMILY_WHISPER : TD_FAMILY_BART;
  TD_TRY(get_pos_int(j, "d_model", true, src, &c->d_model));
  TD_TRY(get_pos_int(j, "encoder_layers", true, src, &c->enc_layers));
  TD_TRY(get_pos_int(j, "decoder_layers", true, src, &c->dec_layers));
  TD_TRY(get_pos_int(j, "encoder_attention_heads", true, src, &c->enc_heads));
  TD_TRY(get_pos_int(j, "decoder_attention_heads", true, src, &c->dec_heads));
  TD_TRY(get_pos_int(j, "encoder_ffn_dim", true, src, &c->enc_ffn));
  TD_TRY(get_pos_int(j, "decoder_ffn_dim", true, src, &c->dec_ffn));
  if (c->d_model % c->enc_heads || c->d_model % c->dec_heads)
    return td_err(TD_ERR_FORMAT, "%s: d_model %d is not divisible by the attention heads (%d, %d)", src,
                  c->d_model, c->enc_heads, c->dec_heads);
  c->enc_head_dim = c->d_model / c->enc_heads;
  c->dec_head_dim = c->d_model / c->dec_heads;
  char act[64] = "gelu";
  TD_TRY(td_json_str(j, "activation_function", false, src, act, sizeof act));
  int a = parse_act(act);
  if (a < 0)
    return td_err(TD_ERR_UNSUPPORTED,
                  "%s: activation_function \"%s\" is not supported (expected relu, gelu, gelu_new, silu, swish)", src,
                  act);
  c->act = (td_act)a;
  c->gated_ffn = false;
  c->rmsnorm = false;
  c->norm_eps = 1e-5f;
  bool scale = false;
  TD_TRY(td_json_bool(j, "scale_embedding", false, src, &scale));
  c->embed_scale = scale ? sqrtf((float)c->d_model) : 1.0f;
  c->attn_bias = true;
  c->k_bias = true;
  c->tie_word_embeddings = true;
  TD_TRY(td_json_bool(j, "tie_word_embeddings", false, src, &c->tie_word_embeddings));
  c->scale_decoder_outputs = false;
  c->shared_embeddings = true;
  c->rel_buckets = c->rel_max_distance = 0;
  if (c->family == TD_FAMILY_WHISPER) {
    c->pre_norm = true;
    c->final_norm = true;
    c->layernorm_embedding = false;
    c->pos_kind = TD_POS_LEARNED; /* encoder: a stored sinusoidal table */
    c->pos_offset = 0;
    c->k_bias = false;
    c->shared_embeddings = false;
    c->num_mel_bins = 80;
    c->max_source_len = 1500;
    c->max_target_len = 448;
    TD_TRY(get_pos_int(j, "num_mel_bins", false, src, &c->num_mel_bins));
    TD_TRY(get_pos_int(j, "max_source_positions", false, src, &c->max_source_len));
    TD_TRY(get_pos_int(j, "max_target_positions", false, src, &c->max_target_len));
  } else {
    int maxpos = 1024;
    TD_TRY(get_pos_int(j, "max_position_embeddings", false, src, &maxpos));
    c->max_source_len = c->max_target_len = maxpos;
    if (!strcmp(c->model_type, "bart")) {
      c->pre_norm = false;
      c->final_norm = false;
      c->layernorm_embedding = true;
      c->pos_kind = TD_POS_LEARNED;
      c->pos_offset = 2;
    } else if (!strcmp(c->model_type, "mbart")) {
      c->pre_norm = true;
      c->final_norm = true;
      c->layernorm_embedding = true;
      c->pos_kind = TD_POS_LEARNED;
      c->pos_offset = 2;
    } else { /* marian */
      c->pre_norm = false;
      c->final_norm = false;
      c->layernorm_embedding = false;
      c->pos_kind = TD_POS_SINUSOIDAL;
      c->pos_offset = 0;
      TD_TRY(td_json_bool(j, "share_encoder_decoder_embeddings", false, src, &c->shared_embeddings));
      int dec_vocab = c->vocab_size;
      if (!td_json_is_null(j, "decoder_vocab_size"))
        TD_TRY(get_pos_int(j, "decoder_vocab_size", false, src, &dec_vocab));
      if (dec_vocab != c->vocab_size)
        return td_err(TD_ERR_UNSUPPORTED, "%s: decoder_vocab_size %d differs from vocab_size %d", src, dec_vocab,
                      c->vocab_size);
    }
  }
  c->enc_attn_scale = 1.0f / sqrtf((float)c->enc_head_dim);
  c->dec_attn_scale = 1.0f / sqrtf((float)c->dec_head_dim);
  return TD_OK;
}

td_status td_model_config_load(const char *dir, td_model_config *c) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/config.json", dir);
  memset(c, 0, sizeof *c);
  cJSON *j = NULL;
  TD_TRY(td_json_load_file(path, CONFIG_MAX_BYTES, &j));
  td_status s = TD_OK;
  if (!cJSON_IsObject(j)) {
    s = td_err(TD_ERR_FORMAT, "%s: not a JSON object", path);
    goto out;
  }
  s = td_json_str(j, "model_type", true, path, c->model_type, sizeof c->model_type);
  if (s != TD_OK) goto out;
  s = get_pos_int(j, "vocab_size", true, path, &c->vocab_size);
  if (s != TD_OK) goto out;
  if (!strcmp(c->model_type, "t5") || !strcmp(c->model_type, "mt5")) {
    s = load_t5(j, path, c);
  } else if (!strcmp(c->model_type, "bart") || !strcmp(c->model_type, "mbart") ||
             !strcmp(c->model_type, "marian") || !strcmp(c->model_type, "whisper")) {
    s = load_bart_like(j, path, c);
  } else {
    s = td_err(TD_ERR_UNSUPPORTED,
               "%s: model_type \"%s\" is not supported (expected t5, mt5, bart, mbart, marian or whisper)", path,
               c->model_type);
  }
out:
  cJSON_Delete(j);
  return s;
}

/* Reads the token-id fields present in j into g. */
static td_status read_ids(const cJSON *j, const char *src, int vocab, td_gen_config *g) {
  const struct {
    const char *key;
    int32_t *dst;
  } ids[] = {
      {"decoder_start_token_id", &g->decoder_start_token_id},
      {"pad_token_id", &g->pad_token_id},
      {"bos_token_id", &g->bos_token_id},
      {"forced_bos_token_id", &g->forced_bos_token_id},
      {"forced_eos_token_id", &g->forced_eos_token_id},
      {"max_length", &g->max_length},
  };
  for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++) {
    if (td_json_is_null(j, ids[i].key)) {
      *ids[i].dst = -1;
      continue;
    }
    TD_TRY(td_json_i32(j, ids[i].key, false, src, ids[i].dst));
  }
  const cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "eos_token_id");
  if (cJSON_IsNumber(e)) {
    TD_TRY(td_json_i32(j, "eos_token_id", true, src, &g->eos_ids[0]));
    g->n_eos = 1;
  } else if (cJSON_IsArray(e)) {
    int32_t *v = NULL;
    int n = 0;
    TD_TRY(td_json_i32_array(j, "eos_token_id", true, src, 0, INT32_MAX, &v, &n));
    if (n > TD_MAX_EOS) {
      free(v);
      return td_err(TD_ERR_UNSUPPORTED, "%s: more than %d eos_token_id values", src, TD_MAX_EOS);
    }
    memcpy(g->eos_ids, v, sizeof *v * (size_t)n);
    g->n_eos = n;
    free(v);
  } else if (e && !cJSON_IsNull(e)) {
    return td_err(TD_ERR_FORMAT, "%s: eos_token_id must be an integer or a list", src);
  }
  const struct {
    const char *key;
    int32_t **dst;
    int *n;
  } lists[] = {{"begin_suppress_tokens", &g->begin_suppress, &g->n_begin_suppress},
               {"suppress_tokens", &g->suppress, &g->n_suppress}};
  for (size_t i = 0; i < 2; i++) {
    if (!cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(j, lists[i].key))) continue;
    free(*lists[i].dst);
    /* Ids past the vocabulary (configs shared across sizes) can never be produced. */
    TD_TRY(td_json_i32_array(j, lists[i].key, false, src, 0, INT32_MAX, lists[i].dst, lists[i].n));
    int k = 0;
    for (int t = 0; t < *lists[i].n; t++)
      if ((*lists[i].dst)[t] < vocab) (*lists[i].dst)[k++] = (*lists[i].dst)[t];
    *lists[i].n = k;
  }
  return TD_OK;
}

td_status td_gen_config_load(const char *dir, const td_model_config *cfg, td_gen_config *g) {
  memset(g, 0, sizeof *g);
  g->decoder_start_token_id = -1;
  g->pad_token_id = -1;
  g->bos_token_id = g->forced_bos_token_id = g->forced_eos_token_id = g->max_length = -1;
  char path[PATH_MAX];
  cJSON *j = NULL;
  td_status s = TD_OK;
  /* As transformers: generation_config.json, when present, alone gives the
   * generation defaults (GenerationConfig.from_model_config only stands in
   * when it is missing), so config.json's forced BOS / EOS are not merged. */
  snprintf(path, sizeof path, "%s/generation_config.json", dir);
  bool have_gen = access(path, F_OK) == 0;
  if (!have_gen) snprintf(path, sizeof path, "%s/config.json", dir);
  TD_TRY(td_json_load_file(path, CONFIG_MAX_BYTES, &j));
  s = read_ids(j, path, cfg->vocab_size, g);
  cJSON_Delete(j);
  if (s != TD_OK) goto fail;
  /* config.json's max_length is a legacy default, not a model property. */
  if (!have_gen) g->max_length = -1;
  if (cfg->family == TD_FAMILY_T5 && g->decoder_start_token_id < 0) g->decoder_start_token_id = g->pad_token_id;
  /* transformers' _get_decoder_start_token_id: else the BOS token */
  if (g->decoder_start_token_id < 0) g->decoder_start_token_id = g->bos_token_id;
  const struct {
    const char *name;
    int32_t v;
    bool required;
  } chk[] = {{"decoder_start_token_id", g->decoder_start_token_id, true},
             {"forced_bos_token_id", g->forced_bos_token_id, false},
             {"forced_eos_token_id", g->forced_eos_token_id, false}};
  for (size_t i = 0; i < 3; i++) {
    if ((chk[i].required && chk[i].v < 0) || chk[i].v >= cfg->vocab_size) {
      s = td_err(TD_ERR_FORMAT, "%s: %s = %d is missing or outside the vocabulary of %d", dir, chk[i].name,
                 chk[i].v, cfg->vocab_size);
      goto fail;
    }
  }
  if (g->n_eos == 0) {
    s = td_err(TD_ERR_FORMAT, "%s: no eos_token_id in config.json or generation_config.json", dir);
    goto fail;
  }
  for (int i = 0; i < g->n_eos; i++)
    if (g->eos_ids[i] < 0 || g->eos_ids[i] >= cfg->vocab_size) {
      s = td_err(TD_ERR_FORMAT, "%s: eos_token_id %d is outside the vocabulary of %d", dir, g->eos_ids[i],
                 cfg->vocab_size);
      goto fail;
    }
  return TD_OK;
fail:
  td_gen_config_free(g);
  return s;
}

void td_gen_config_free(td_gen_config *g) {
  free(g->begin_suppress);
  free(g->suppress);
  g->begin_suppress = g->suppress = NULL;
  g->n_begin_suppress = g->n_suppress = 0;
}

bool td_gen_is_eos(const td_gen_config *g, int32_t tok) {
  for (int i = 0; i < g->n_eos; i++)
    if (g->eos_ids[i] == tok) return true;
  return false;
}
