/* What a client asks of a generation and what each returned sequence is,
 * as plain data: the vocabulary shared by the engine, the client library
 * and the JSON-lines format, so that the client links no engine. */
#ifndef TD_COMMON_REQUEST_H
#define TD_COMMON_REQUEST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Decoding parameters of a request. td_request_params_default gives "use
 * the model's defaults" for everything. */
typedef struct td_request_params {
  int max_new_tokens;     /* <= 0: from generation_config max_length or the model limit */
  float temperature;      /* <= 0: greedy */
  int top_k;              /* <= 0: off */
  float top_p;            /* >= 1: off */
  uint64_t seed;
  bool has_seed;
  int n;                  /* independent samples */
  int num_beams;          /* > 1: beam search */
  int num_return_sequences;
  float length_penalty;
  int early_stopping;     /* 1 true, 0 false (heuristic), -1 never */
  const int32_t *stop_ids;/* finish when one of these is produced (besides EOS) */
  int n_stop_ids;
  const int32_t *allowed_ids; /* when n_allowed > 0: the only tokens that may be generated */
  int n_allowed;              /*   (Whisper's language detection: the language tokens) */
  int32_t timestamp_begin;    /* > 0: Whisper's timestamp rules, timestamps from this id (<|0.00|>) on */
  int max_initial_timestamp;  /* with them: the first timestamp's highest index; < 0: any */
  bool logprobs;          /* per-token log-probabilities in the output */
  int forced_bos;         /* -2: generation_config; -1: none; else the id */
  int forced_eos;         /* -2: generation_config; -1: none; else the id */
  bool ignore_eos;        /* do not stop on the model's EOS ids */
  bool all_logits;        /* keep the logits of every decoder position (greedy, n = 1) */
  /* The probability (softmax of the raw logits) of probe_token as the token
   * after decoder prompt position probe_position; the outputs carry it.
   * Whisper's no-speech probability: <|nospeech|> after <|startoftranscript|>. */
  bool probe;
  int32_t probe_token;
  int probe_position;
} td_request_params;

void td_request_params_default(td_request_params *p);

/* An optional number: absent (the default applies), "none" (off), or a value. */
typedef struct td_opt_num {
  bool given, off;
  double v;
} td_opt_num;

/* How audio longer than the model's window is transcribed (long-form, as
 * transformers' generate; frontend/longform.h): absent fields take
 * OpenAI whisper's defaults (common/defaults.h, TD_LONGFORM_*). */
typedef struct td_longform_settings {
  td_opt_num temperature_increment;       /* the fallback ladder's step above the temperature (0: none) */
  td_opt_num compression_ratio_threshold; /* decode a window again above it */
  td_opt_num logprob_threshold;           /* ... below it (average log-probability) */
  td_opt_num no_speech_threshold;         /* skip a window above it (with the logprob threshold) */
  bool condition_given;                   /* condition_on_previous_text given; else the default (yes) */
  bool condition_on_previous_text;        /* the earlier windows' tokens as the prompt */
} td_longform_settings;

typedef enum td_finish { TD_FINISH_NONE, TD_FINISH_STOP, TD_FINISH_LENGTH, TD_FINISH_CANCELLED, TD_FINISH_ERROR } td_finish;
const char *td_finish_name(td_finish f);

/* A stretch of a transcription between two timestamps (seconds). */
typedef struct td_text_segment {
  double start, end;
  const char *text;
} td_text_segment;

typedef struct td_seq_output {
  const int32_t *tokens;   /* generated tokens (prompt excluded); a stop token is the last */
  int n_tokens;
  const float *logprobs;   /* when asked: per token */
  double score;            /* beam search: length-normalised log-probability */
  double cum_logprob;
  td_finish finish;
  const char *text;        /* decoded text (special tokens skipped) where a tokenizer ran; else NULL */
  const td_text_segment *segments; /* audio with timestamps: its segments (n_segments); else NULL */
  int n_segments;
  bool has_probe;          /* the request's probe (td_request_params.probe), the same in every output */
  double probe_prob;
} td_seq_output;

/* The index of the first NaN or infinity among n floats, n when all are
 * finite: audio features are checked at every hop, 384,000 values a
 * Whisper request, so the scan works in blocks the compiler vectorises. */
size_t td_first_nonfinite(const float *v, size_t n);

#endif
