/* Model descriptions read from config.json and generation_config.json. */
#ifndef TD_MODEL_CONFIG_H
#define TD_MODEL_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "kernels/act.h" /* td_act */

typedef enum td_family { TD_FAMILY_T5, TD_FAMILY_BART, TD_FAMILY_WHISPER } td_family;

typedef enum td_pos_kind { TD_POS_RELATIVE, TD_POS_LEARNED, TD_POS_SINUSOIDAL } td_pos_kind;

#define TD_MAX_EOS 8

typedef struct td_model_config {
  char model_type[32];
  td_family family;
  int d_model;
  int vocab_size;
  int enc_layers, dec_layers;
  int enc_heads, dec_heads;
  int enc_head_dim, dec_head_dim;
  int enc_ffn, dec_ffn;
  bool gated_ffn;
  td_act act;
  bool rmsnorm;    /* T5: RMSNorm without bias; others LayerNorm */
  float norm_eps;
  bool pre_norm;
  bool layernorm_embedding;
  bool final_norm;
  float embed_scale;     /* sqrt(d_model) with scale_embedding, else 1 */
  td_pos_kind pos_kind;
  int pos_offset;        /* 2 for BART / mBART learned positions */
  int max_source_len;    /* encoder positions (Whisper: frames after the stride-2 conv) */
  int max_target_len;    /* decoder positions */
  int rel_buckets, rel_max_distance;
  float enc_attn_scale, dec_attn_scale; /* T5 1, else head_dim^-0.5 */
  bool attn_bias;        /* q/v/o biases (k too, except Whisper) */
  bool k_bias;
  bool scale_decoder_outputs; /* T5: d_model^-0.5 before the head */
  bool tie_word_embeddings;
  bool shared_embeddings;     /* encoder and decoder use one table */
  int num_mel_bins;           /* Whisper */
} td_model_config;

typedef struct td_gen_config {
  int32_t decoder_start_token_id;
  int32_t eos_ids[TD_MAX_EOS];
  int n_eos;
  int32_t pad_token_id;
  int32_t bos_token_id;        /* -1 when none */
  int32_t forced_bos_token_id; /* -1 when none */
  int32_t forced_eos_token_id; /* -1 when none */
  int32_t max_length;          /* -1 when none: prompt + generated */
  int32_t *begin_suppress;     /* token ids suppressed at the first generated step */
  int n_begin_suppress;
  int32_t *suppress;           /* token ids never generated */
  int n_suppress;
} td_gen_config;

/* Reads DIR/config.json. Unknown model types and missing or invalid fields
 * fail with a message naming the file and the field. */
td_status td_model_config_load(const char *dir, td_model_config *cfg);
/* Reads DIR/generation_config.json when present, alone (as transformers:
 * config.json's ids, forced BOS / EOS included, are not merged in); else
 * config.json's ids. Free with td_gen_config_free. */
td_status td_gen_config_load(const char *dir, const td_model_config *cfg, td_gen_config *gen);
void td_gen_config_free(td_gen_config *gen);

bool td_gen_is_eos(const td_gen_config *gen, int32_t tok);
const char *td_act_name(td_act a);

#endif
