#include "random_model.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "common/half.h"

typedef struct tensor {
  char name[160];
  int64_t rows, cols, depth; /* cols 0: 1-D; depth > 0: 3-D (a convolution's kernel taps) */
  int kind;                  /* 0 matrix, 1 embedding, 2 norm, 3 bias */
  float gain;                /* times the matrix scale */
} tensor;

typedef struct list {
  tensor *t;
  int n, cap;
} list;

static void add(list *l, int kind, int64_t rows, int64_t cols, const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static void add(list *l, int kind, int64_t rows, int64_t cols, const char *fmt, ...) {
  if (l->n == l->cap) {
    l->cap = l->cap ? 2 * l->cap : 256;
    l->t = realloc(l->t, sizeof *l->t * (size_t)l->cap);
  }
  tensor *t = &l->t[l->n++];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(t->name, sizeof t->name, fmt, ap);
  va_end(ap);
  t->rows = rows;
  t->cols = cols;
  t->depth = 0;
  t->kind = kind;
  t->gain = 1.0f;
}

static uint64_t rng_state;
static double urand(void) {
  rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
  return ((rng_state >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}
/* Unit variance; uniform rather than normal: fast enough for billions. */
static float nrand(void) { return (float)((urand() * 2.0 - 1.0) * 1.7320508075688772); }

static void t5_tensors(list *l, const td_random_shape *s) {
  int d = s->d_model, hd = s->heads * s->head_dim;
  add(l, 1, s->vocab, d, "shared.weight");
  for (int e = 0; e < 2; e++) {
    const char *st = e ? "decoder" : "encoder";
    int L = e ? s->dec_layers : s->enc_layers;
    for (int i = 0; i < L; i++) {
      const char *qkv[4] = {"q", "k", "v", "o"};
      /* T5 has no 1/sqrt(head_dim) in its attention: its queries carry it
       * (as transformers initialises them and trained checkpoints keep it);
       * without it the scores' spread is ~8 and softmax near argmax, where a
       * rounding difference flips whole rows. */
      for (int k = 0; k < 4; k++) {
        add(l, 0, k == 3 ? d : hd, k == 3 ? hd : d, "%s.block.%d.layer.0.SelfAttention.%s.weight", st, i, qkv[k]);
        if (k == 0) l->t[l->n - 1].gain = 1.0f / sqrtf((float)s->head_dim);
      }
      add(l, 2, d, 0, "%s.block.%d.layer.0.layer_norm.weight", st, i);
      int ff = 1;
      if (e) {
        for (int k = 0; k < 4; k++) {
          add(l, 0, k == 3 ? d : hd, k == 3 ? hd : d, "%s.block.%d.layer.1.EncDecAttention.%s.weight", st, i, qkv[k]);
          if (k == 0) l->t[l->n - 1].gain = 1.0f / sqrtf((float)s->head_dim);
        }
        add(l, 2, d, 0, "%s.block.%d.layer.1.layer_norm.weight", st, i);
        ff = 2;
      }
      if (s->gated) {
        add(l, 0, s->ffn, d, "%s.block.%d.layer.%d.DenseReluDense.wi_0.weight", st, i, ff);
        add(l, 0, s->ffn, d, "%s.block.%d.layer.%d.DenseReluDense.wi_1.weight", st, i, ff);
      } else {
        add(l, 0, s->ffn, d, "%s.block.%d.layer.%d.DenseReluDense.wi.weight", st, i, ff);
      }
      add(l, 0, d, s->ffn, "%s.block.%d.layer.%d.DenseReluDense.wo.weight", st, i, ff);
      add(l, 2, d, 0, "%s.block.%d.layer.%d.layer_norm.weight", st, i, ff);
    }
    add(l, 2, d, 0, "%s.final_layer_norm.weight", st);
    add(l, 1, 32, s->heads, "%s.block.0.layer.0.SelfAttention.relative_attention_bias.weight", st);
  }
  if (s->gated) add(l, 0, s->vocab, d, "lm_head.weight");
}

/* One BART-layout layer (BART, Whisper): attention (and cross-attention
 * in the decoder) with their norms, then the FFN and its norm; Whisper's
 * k projections have no bias. */
static void bart_layer_tensors(list *l, const td_random_shape *s, const char *st, int i, bool cross, bool k_bias) {
  int d = s->d_model;
  for (int a = 0; a < (cross ? 2 : 1); a++) {
    const char *an = a ? "encoder_attn" : "self_attn";
    const char *p[4] = {"q_proj", "k_proj", "v_proj", "out_proj"};
    for (int k = 0; k < 4; k++) {
      add(l, 0, d, d, "model.%s.layers.%d.%s.%s.weight", st, i, an, p[k]);
      if (k != 1 || k_bias) add(l, 3, d, 0, "model.%s.layers.%d.%s.%s.bias", st, i, an, p[k]);
    }
    add(l, 2, d, 0, "model.%s.layers.%d.%s_layer_norm.weight", st, i, an);
    add(l, 3, d, 0, "model.%s.layers.%d.%s_layer_norm.bias", st, i, an);
  }
  add(l, 0, s->ffn, d, "model.%s.layers.%d.fc1.weight", st, i);
  add(l, 3, s->ffn, 0, "model.%s.layers.%d.fc1.bias", st, i);
  add(l, 0, d, s->ffn, "model.%s.layers.%d.fc2.weight", st, i);
  add(l, 3, d, 0, "model.%s.layers.%d.fc2.bias", st, i);
  add(l, 2, d, 0, "model.%s.layers.%d.final_layer_norm.weight", st, i);
  add(l, 3, d, 0, "model.%s.layers.%d.final_layer_norm.bias", st, i);
}

static void bart_tensors(list *l, const td_random_shape *s) {
  int d = s->d_model;
  add(l, 1, s->vocab, d, "model.shared.weight");
  add(l, 3, 1, s->vocab, "final_logits_bias");
  for (int e = 0; e < 2; e++) {
    const char *st = e ? "decoder" : "encoder";
    int L = e ? s->dec_layers : s->enc_layers;
    add(l, 1, s->max_positions + 2, d, "model.%s.embed_positions.weight", st);
    add(l, 2, d, 0, "model.%s.layernorm_embedding.weight", st);
    add(l, 3, d, 0, "model.%s.layernorm_embedding.bias", st);
    for (int i = 0; i < L; i++) bart_layer_tensors(l, s, st, i, e == 1, true);
  }
}

/* Whisper: convolutions over the mel frames, stored position tables, the
 * decoder's own token table (the head tied to it), pre-norm layers whose
 * k projections have no bias. */
static void whisper_tensors(list *l, const td_random_shape *s) {
  int d = s->d_model;
  add(l, 0, d, s->mels, "model.encoder.conv1.weight");
  l->t[l->n - 1].depth = 3;
  add(l, 3, d, 0, "model.encoder.conv1.bias");
  add(l, 0, d, d, "model.encoder.conv2.weight");
  l->t[l->n - 1].depth = 3;
  add(l, 3, d, 0, "model.encoder.conv2.bias");
  add(l, 1, s->max_positions, d, "model.encoder.embed_positions.weight");
  add(l, 1, s->max_target, d, "model.decoder.embed_positions.weight");
  add(l, 1, s->vocab, d, "model.decoder.embed_tokens.weight");
  for (int e = 0; e < 2; e++) {
    const char *st = e ? "decoder" : "encoder";
    for (int i = 0; i < (e ? s->dec_layers : s->enc_layers); i++) bart_layer_tensors(l, s, st, i, e == 1, false);
    add(l, 2, d, 0, "model.%s.layer_norm.weight", st);
    add(l, 3, d, 0, "model.%s.layer_norm.bias", st);
  }
}

static int write_json(const char *path, cJSON *o) {
  char *s = cJSON_Print(o);
  FILE *f = fopen(path, "w");
  if (!f || !s) {
    free(s);
    if (f) fclose(f);
    return -1;
  }
  fputs(s, f);
  fclose(f);
  free(s);
  return 0;
}

int td_random_model_write(const char *dir, const td_random_shape *s, unsigned seed) {
  mkdir(dir, 0755);
  bool t5 = !strcmp(s->model_type, "t5"), whisper = !strcmp(s->model_type, "whisper");
  char p[1024];
  cJSON *c = cJSON_CreateObject();
  cJSON_AddStringToObject(c, "model_type", s->model_type);
  cJSON_AddNumberToObject(c, "vocab_size", s->vocab);
  cJSON_AddNumberToObject(c, "d_model", s->d_model);
  if (t5) {
    cJSON_AddNumberToObject(c, "d_kv", s->head_dim);
    cJSON_AddNumberToObject(c, "d_ff", s->ffn);
    cJSON_AddNumberToObject(c, "num_layers", s->enc_layers);
    cJSON_AddNumberToObject(c, "num_decoder_layers", s->dec_layers);
    cJSON_AddNumberToObject(c, "num_heads", s->heads);
    cJSON_AddStringToObject(c, "feed_forward_proj", s->gated ? "gated-gelu" : "relu");
    cJSON_AddBoolToObject(c, "tie_word_embeddings", !s->gated);
    cJSON_AddNumberToObject(c, "n_positions", s->max_positions);
    cJSON_AddNumberToObject(c, "decoder_start_token_id", 0);
    cJSON_AddNumberToObject(c, "pad_token_id", 0);
    cJSON_AddNumberToObject(c, "eos_token_id", 1);
  } else {
    cJSON_AddNumberToObject(c, "encoder_layers", s->enc_layers);
    cJSON_AddNumberToObject(c, "decoder_layers", s->dec_layers);
    cJSON_AddNumberToObject(c, "encoder_attention_heads", s->heads);
    cJSON_AddNumberToObject(c, "decoder_attention_heads", s->heads);
    cJSON_AddNumberToObject(c, "encoder_ffn_dim", s->ffn);
    cJSON_AddNumberToObject(c, "decoder_ffn_dim", s->ffn);
    cJSON_AddStringToObject(c, "activation_function", "gelu");
    if (whisper) {
      cJSON_AddNumberToObject(c, "num_mel_bins", s->mels);
      cJSON_AddNumberToObject(c, "max_source_positions", s->max_positions);
      cJSON_AddNumberToObject(c, "max_target_positions", s->max_target);
    } else {
      cJSON_AddNumberToObject(c, "max_position_embeddings", s->max_positions);
    }
    /* Whisper: the multilingual tokenizer's <|startoftranscript|>, <|endoftext|> */
    cJSON_AddNumberToObject(c, "decoder_start_token_id", whisper ? 50258 : 2);
    cJSON_AddNumberToObject(c, "pad_token_id", whisper ? 50256 : 1);
    cJSON_AddNumberToObject(c, "eos_token_id", whisper ? 50257 : 2);
  }
  snprintf(p, sizeof p, "%s/config.json", dir);
  int rc = write_json(p, c);
  cJSON_Delete(c);
  if (rc) return rc;
  list l = {0};
  if (t5)
    t5_tensors(&l, s);
  else if (whisper)
    whisper_tensors(&l, s);
  else
    bart_tensors(&l, s);
  int es = s->bf16 ? 2 : 4;
  cJSON *h = cJSON_CreateObject();
  size_t off = 0;
  for (int i = 0; i < l.n; i++) {
    tensor *t = &l.t[i];
    size_t n = (size_t)t->rows * (size_t)(t->cols ? t->cols : 1) * (size_t)(t->depth ? t->depth : 1);
    cJSON *e = cJSON_AddObjectToObject(h, t->name);
    cJSON_AddStringToObject(e, "dtype", s->bf16 ? "BF16" : "F32");
    cJSON *sh = cJSON_AddArrayToObject(e, "shape");
    cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)t->rows));
    if (t->cols) cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)t->cols));
    if (t->depth) cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)t->depth));
    cJSON *o = cJSON_AddArrayToObject(e, "data_offsets");
    cJSON_AddItemToArray(o, cJSON_CreateNumber((double)off));
    cJSON_AddItemToArray(o, cJSON_CreateNumber((double)(off + n * es)));
    off += n * es;
  }
  char *hs = cJSON_PrintUnformatted(h);
  cJSON_Delete(h);
  size_t hl = strlen(hs);
  snprintf(p, sizeof p, "%s/model.safetensors", dir);
  FILE *f = fopen(p, "wb");
  if (!f) {
    free(hs);
    free(l.t);
    return -1;
  }
  unsigned char le[8];
  for (int i = 0; i < 8; i++) le[i] = (unsigned char)((uint64_t)hl >> (8 * i));
  fwrite(le, 1, 8, f);
  fwrite(hs, 1, hl, f);
  free(hs);
  rng_state = seed * 2654435761ULL + 1;
  size_t cap = 1 << 20;
  unsigned char *buf = malloc(cap * 4);
  for (int i = 0; i < l.n; i++) {
    tensor *t = &l.t[i];
    size_t n = (size_t)t->rows * (size_t)(t->cols ? t->cols : 1) * (size_t)(t->depth ? t->depth : 1);
    float scale = t->kind == 0 ? t->gain / sqrtf((float)t->cols * (float)(t->depth ? t->depth : 1)) : 1.0f;
    for (size_t done = 0; done < n;) {
      size_t k = n - done < cap ? n - done : cap;
      for (size_t j = 0; j < k; j++) {
        float v = t->kind == 2 ? 1.0f + 0.1f * nrand() : t->kind == 3 ? 0.1f * nrand() : nrand() * scale;
        if (s->bf16) {
          uint16_t b = td_f32_to_bf16(v);
          memcpy(buf + 2 * j, &b, 2);
        } else {
          memcpy(buf + 4 * j, &v, 4);
        }
      }
      fwrite(buf, (size_t)es, k, f);
      done += k;
    }
  }
  free(buf);
  free(l.t);
  fclose(f);
  snprintf(p, sizeof p, "%s/generation_config.json", dir);
  f = fopen(p, "w");
  if (!f) return -1;
  fprintf(f, "{\"decoder_start_token_id\": %d, \"eos_token_id\": %d}\n", t5 ? 0 : whisper ? 50258 : 2,
          t5 ? 1 : whisper ? 50257 : 2);
  fclose(f);
  return 0;
}
