/* Tokenizers loaded unchanged from a checkpoint folder: Hugging Face
 * `tokenizer.json` (normalizers, pre-tokenizers, BPE / Unigram / WordLevel,
 * post-processors, decoders, added tokens), or Marian's SentencePiece pair
 * (`source.spm`, `target.spm`, `vocab.json`). Encoding and decoding give the
 * ids and text transformers' tokenizers give.
 *
 * Text in is UTF-8; invalid sequences are replaced by U+FFFD as Python's
 * bytes.decode("utf-8", "replace") does (what a caller of transformers has
 * to do first), unless the tokenizer was loaded with strict_utf8. Every call
 * is thread-safe on one loaded tokenizer (nothing in it changes after load).
 * Errors return a td_status with the reason in td_errmsg(). */
#ifndef TD_FRONTEND_TOKENIZER_H
#define TD_FRONTEND_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct td_tokenizer td_tokenizer;

typedef struct td_tokenizer_opts {
  bool strict_utf8;       /* invalid UTF-8 text is refused instead of replaced */
  size_t max_text_bytes;  /* 0: TD_TOKENIZER_MAX_TEXT_BYTES; longer text is refused */
  size_t max_file_bytes;  /* 0: TD_TOKENIZER_MAX_FILE_BYTES; larger tokenizer files are refused */
} td_tokenizer_opts;

/* Loads DIR/tokenizer.json (with DIR/tokenizer_config.json when present),
 * else DIR/source.spm + DIR/target.spm + DIR/vocab.json (Marian). opts may
 * be NULL. */
td_status td_tokenizer_load(const char *dir, const td_tokenizer_opts *opts, td_tokenizer **out);
/* From the text of a tokenizer.json and, optionally (NULL), of a
 * tokenizer_config.json; len bytes each, no NUL needed. */
td_status td_tokenizer_from_json(const char *json, size_t len, const char *config, size_t config_len,
                                 const td_tokenizer_opts *opts, td_tokenizer **out);
void td_tokenizer_destroy(td_tokenizer *t);

/* ids: one past the largest id (model vocabulary and added tokens). */
int32_t td_tokenizer_vocab_size(const td_tokenizer *t);
/* The id of a token's text (model vocabulary or added token), or -1. */
int32_t td_tokenizer_token_to_id(const td_tokenizer *t, const char *token);
/* The text of id, or NULL when no token has it. Valid while t lives. */
const char *td_tokenizer_id_to_token(const td_tokenizer *t, int32_t id);
bool td_tokenizer_is_special(const td_tokenizer *t, int32_t id);
/* The clean-up of spaces decoding applies (tokenizer_config.json's
 * clean_up_tokenization_spaces; false when absent). */
bool td_tokenizer_cleans_up_spaces(const td_tokenizer *t);

/* Text (len bytes) to ids; add_special applies the post-processor (the
 * special tokens transformers adds by default). *ids is malloc'ed (NULL when
 * *n is 0); free() it. */
td_status td_tokenizer_encode(const td_tokenizer *t, const char *text, size_t len, bool add_special,
                              int32_t **ids, size_t *n);
/* Ids to text as transformers' decode(ids, skip_special_tokens) does. An id
 * no token has is an error naming it. *text is malloc'ed and NUL-terminated
 * (*len excludes the NUL); free() it. */
td_status td_tokenizer_decode(const td_tokenizer *t, const int32_t *ids, size_t n, bool skip_special,
                              char **text, size_t *len);

/* Streaming detokenizer: ids in one at a time, text out only once it is
 * final (never half a UTF-8 character, never a change to text already
 * given). The pieces given by push and finish, concatenated, equal
 * td_tokenizer_decode of all the ids. */
typedef struct td_detok td_detok;

td_status td_detok_create(const td_tokenizer *t, bool skip_special, td_detok **out);
void td_detok_destroy(td_detok *d);
/* Adds one id; *piece (valid until the next call on d) gets the new final
 * text, possibly "" (then *len is 0). A bad id is refused and leaves d as it
 * was. */
td_status td_detok_push(td_detok *d, int32_t id, const char **piece, size_t *len);
/* No more ids: the text held back (an incomplete character, a space that
 * clean-up might remove) is given as it decodes now. */
td_status td_detok_finish(td_detok *d, const char **piece, size_t *len);

/* ---- Whisper's decoder prompt ---- */

/* What WhisperForConditionalGeneration.generate puts before the first
 * generated token: <|startoftranscript|>, a language token, the task token
 * and <|notimestamps|> unless timestamps are asked for. The ids come from
 * generation_config.json (decoder_start_token_id, lang_to_id, task_to_id,
 * no_timestamps_token_id, is_multilingual, language, task) where it has
 * them, else from the tokenizer's tokens. */
typedef struct td_whisper_prompt td_whisper_prompt;

#define TD_WHISPER_PROMPT_MAX 4 /* ids a prompt holds at most */

/* DIR/generation_config.json (optional) and t (kept: must outlive the
 * prompt). Refused when t has no <|startoftranscript|>: not a Whisper
 * tokenizer. */
td_status td_whisper_prompt_load(const char *dir, const td_tokenizer *t, td_whisper_prompt **out);
void td_whisper_prompt_destroy(td_whisper_prompt *w);
/* The prompt of one request into out[TD_WHISPER_PROMPT_MAX], *n set.
 * language: a code ("en"), a token ("<|en|>") or NULL / "" for the
 * checkpoint's default (generation_config.json's "language"); a
 * multilingual checkpoint with neither gives TD_ERR_NOT_FOUND: the caller
 * detects the language (td_whisper_languages) or refuses. task:
 * "transcribe" (NULL / "": the default) or "translate". Other errors
 * (TD_ERR_INVALID) name the bad value. */
td_status td_whisper_prompt_build(const td_whisper_prompt *w, const char *language, const char *task,
                                  bool timestamps, int32_t *out, int *n);
/* The language tokens (*n of them; NULL and 0 for an English-only
 * checkpoint): what transformers' detect_language takes the best of after
 * one decoder step from <|startoftranscript|>. */
const int32_t *td_whisper_languages(const td_whisper_prompt *w, int *n);
/* A request with timestamps: the first timestamp token (<|notimestamps|> + 1,
 * as transformers' WhisperTimeStampLogitsProcessor) and generation_config.json's
 * max_initial_timestamp_index (-1 when it names none). */
void td_whisper_timestamp_rules(const td_whisper_prompt *w, int32_t *begin, int *max_initial);

/* What long-form transcription puts before the earlier windows' tokens:
 * generation_config.json's prev_sot_token_id, else the tokenizer's
 * <|startofprev|> (-1: neither; transformers falls back to the second-to-last
 * suppressed token, which is <|startofprev|> in the checkpoints that have one). */
int32_t td_whisper_prev_sot(const td_whisper_prompt *w);

/* A stretch of transcription between two timestamps. */
typedef struct td_whisper_segment {
  double start, end; /* seconds */
  char *text;
} td_whisper_segment;

/* The segments of generated ids (prompt excluded) as transformers'
 * WhisperTokenizer._compute_offsets gives them (time precision 0.02 s,
 * segment size 1500): from the first timestamp, a segment ends at each pair
 * of timestamps and at the last timestamp; its text is its ids decoded
 * without the timestamps (special tokens kept). *out is malloc'ed (NULL
 * when *n_out is 0); td_whisper_segments_free. */
td_status td_whisper_segments(const td_tokenizer *t, const int32_t *ids, size_t n, int32_t timestamp_begin,
                              td_whisper_segment **out, size_t *n_out);
void td_whisper_segments_free(td_whisper_segment *s, size_t n);

#endif
