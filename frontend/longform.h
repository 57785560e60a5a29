/* Long-form Whisper transcription: audio longer than the model's window,
 * as transformers' WhisperForConditionalGeneration.generate transcribes it
 * (docs/audio.md, "Long-form transcription"). Windows of the model's
 * frames one after another, each seeking to the last timestamp the model
 * predicted (or by the whole window when its last segment has no closing
 * timestamp), the earlier windows' tokens as the next one's prompt after
 * <|startofprev|>, a window decoded again at the next temperature when its
 * compression ratio or average log-probability crosses its threshold, and
 * a window skipped when it holds no speech.
 *
 * A state machine over token ids: no audio, no tokenizer, no I/O. The
 * caller decodes each window wherever it likes (a cluster through the
 * router, an engine in process) and feeds the outcome back; many
 * transcriptions run side by side, each with its own td_longform, so their
 * windows batch together where they are decoded. Not thread-safe: one
 * thread drives one transcription. */
#ifndef TD_FRONTEND_LONGFORM_H
#define TD_FRONTEND_LONGFORM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/request.h"
#include "common/status.h"

#define TD_LONGFORM_MAX_TEMPERATURES 16 /* the fallback ladder's rungs */
#define TD_LONGFORM_MAX_INIT 8          /* <|startoftranscript|> <|lang|> <|task|>: ids before the output */

typedef struct td_longform_opts {
  /* the checkpoint */
  int window_frames;        /* mel frames of the model's window: input_stride x max_source_positions (3000) */
  int input_stride;         /* mel frames an encoder position spans (2: the convolutions' strides) */
  int max_target_positions; /* decoder positions (448) */
  int32_t vocab_size;       /* the compression ratio's bytes a token */
  int32_t timestamp_begin;  /* <|0.00|>: <|notimestamps|> + 1 */
  int32_t eos;
  int32_t no_speech;        /* <|nospeech|>: <|notimestamps|> - 1, as transformers takes it */
  int32_t prev_sot;         /* <|startofprev|> before the earlier text; -1: none */
  /* the request */
  int32_t init[TD_LONGFORM_MAX_INIT]; /* the decoder prompt of a window: <|startoftranscript|> [<|lang|> <|task|>] */
  int n_init;
  const int32_t *prompt_ids; /* the client's prompt (no <|startofprev|>): before the first window's init */
  int n_prompt_ids;
  float temperatures[TD_LONGFORM_MAX_TEMPERATURES]; /* the fallback ladder, each in [0, 1] */
  int n_temperatures;
  bool has_compression_ratio_threshold; /* > threshold: decode again at the next temperature */
  double compression_ratio_threshold;
  bool has_logprob_threshold;           /* average log-probability < threshold: again */
  double logprob_threshold;
  bool has_no_speech_threshold;         /* with the logprob threshold: P(<|nospeech|>) > it skips the window */
  double no_speech_threshold;
  bool condition_on_prev_tokens;        /* the earlier windows' tokens as the prompt */
  int max_new_tokens;                   /* a window's; 0: the positions its prompt leaves */
} td_longform_opts;

/* A client's settings into o: the temperatures from `temperature` up by the
 * increment to 1 (OpenAI whisper's np.arange(t, 1 + 1e-6, step)), the
 * thresholds and the conditioning, each absent one at its default
 * (TD_LONGFORM_*). TD_ERR_INVALID names a setting out of range. */
td_status td_longform_apply(const td_longform_settings *s, float temperature, td_longform_opts *o);

/* Every option against its limit; TD_ERR_INVALID names the first one out
 * of range (the caller refuses the request with it, before any work). */
td_status td_longform_check(const td_longform_opts *o);

typedef struct td_longform td_longform;

/* A transcription of total_frames mel frames (more than one window). opts'
 * arrays are copied. */
td_status td_longform_create(const td_longform_opts *o, int total_frames, td_longform **out);
void td_longform_destroy(td_longform *lf);

/* One decode to run: a window of the audio's features at one temperature. */
typedef struct td_longform_window {
  int index;             /* windows so far, from 0 */
  int attempt;           /* its temperature's rung, from 0 */
  int seek;              /* its first mel frame */
  int n_frames;          /* frames of audio in it (the rest of the window is zeros) */
  const int32_t *prompt; /* decoder prompt (valid until the next feed) */
  int n_prompt;
  float temperature;     /* 0: greedy */
  int max_new_tokens;
  int probe_position;    /* >= 0: ask the probability of probe_token after this prompt position */
  int32_t probe_token;   /*   (<|nospeech|> after <|startoftranscript|>: the no-speech probability) */
  bool want_logprobs;    /* the tokens' log-probabilities are needed */
} td_longform_window;

/* The next decode; false when the transcription is done. */
bool td_longform_next(td_longform *lf, td_longform_window *w);
/* The outcome of the decode td_longform_next gave: the generated tokens
 * (EOS included when it came), their log-probabilities (log_softmax of the
 * logits after the timestamp rules, at temperature 1; NULL when not asked
 * for) and the probed probability (NaN when not asked for). */
td_status td_longform_feed(td_longform *lf, const int32_t *tokens, int n, const float *logprobs, double probe_prob);

typedef struct td_longform_segment {
  double start, end;      /* seconds from the audio's start */
  const int32_t *tokens;  /* timestamps included, EOS not */
  int n_tokens;
  int seek;               /* its window's first frame */
  float temperature;      /* its window's */
  double avg_logprob;     /* its window's (EOS included) */
  double compression_ratio;
  double no_speech_prob;  /* NaN when not computed */
} td_longform_segment;

/* The segments so far, as transformers returns them (the first window's
 * client prompt is not one). Valid until the next feed. */
const td_longform_segment *td_longform_segments(const td_longform *lf, int *n);
/* Counts: windows started, decodes run, windows skipped as no speech. */
void td_longform_counts(const td_longform *lf, int *windows, int *decodes, int *skipped);

/* transformers' compression ratio: the tokens as little-endian integers of
 * int(log2(vocab_size) / 8) + 1 bytes, their length over zlib's
 * (compress2 at the default level: Python's zlib.compress). */
double td_longform_compression_ratio(const int32_t *tokens, int n, int32_t vocab_size);

/* The features of one window: frames [seek, seek + n_frames) of whole
 * ([n_mels, total_frames], row-major), zeros after them up to
 * window_frames; out holds n_mels x window_frames. */
void td_longform_window_features(const float *whole, int n_mels, int total_frames, int seek, int n_frames,
                                 int window_frames, float *out);

#endif
