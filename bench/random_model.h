/* Random-weight checkpoints of a given T5 / BART / Whisper shape, written
 * in the Hugging Face layout, for benchmarks of realistic sizes. */
#ifndef TD_BENCH_RANDOM_MODEL_H
#define TD_BENCH_RANDOM_MODEL_H

#include <stdbool.h>

typedef struct td_random_shape {
  const char *model_type; /* "t5", "bart" or "whisper" */
  int d_model, enc_layers, dec_layers, heads, head_dim, ffn, vocab;
  bool gated;             /* T5 gated-gelu (Flan-T5) */
  bool bf16;              /* weights stored as bf16 */
  int max_positions;      /* Whisper: encoder positions (half the mel frames) */
  int mels, max_target;   /* Whisper: mel bins, decoder positions */
} td_random_shape;

/* Writes dir/config.json, generation_config.json and model.safetensors.
 * Weights ~ N(0,1)/sqrt(fan_in), embeddings N(0,1), norms ~1. */
int td_random_model_write(const char *dir, const td_random_shape *s, unsigned seed);

#endif
