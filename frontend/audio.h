/* Whisper audio front end: WAV / FLAC / OGG decoded (libsndfile), mixed down
 * to mono and resampled to 16 kHz (libsoxr); log-mel features exactly as
 * transformers' WhisperFeatureExtractor computes them (FFT: kissfft), behind
 * a backend table so that another device may compute them. The choices
 * (resampling quality, limits, accuracy): docs/audio.md. */
#ifndef TD_FRONTEND_AUDIO_H
#define TD_FRONTEND_AUDIO_H

#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"

#define TD_AUDIO_RATE 16000 /* Whisper's sampling rate: decoded audio always comes out at it */
#define TD_MEL_N_FFT 400    /* WhisperFeatureExtractor's n_fft (25 ms) */
#define TD_MEL_HOP 160      /* ... and hop_length (10 ms) */
#define TD_MEL_N_FREQ (TD_MEL_N_FFT / 2 + 1)

/* ---- decoding ---- */

/* What an input may be; a zero field takes its default (common/defaults.h). */
typedef struct td_audio_limits {
  double max_seconds; /* TD_DEFAULT_AUDIO_MAX_SECONDS */
  int max_channels;   /* TD_AUDIO_MAX_CHANNELS */
  int min_rate;       /* TD_AUDIO_MIN_RATE (Hz) */
  int max_rate;       /* TD_AUDIO_MAX_RATE (Hz) */
} td_audio_limits;

/* Decoded audio: mono float32 at TD_AUDIO_RATE. */
typedef struct td_audio {
  float *samples; /* n of them; td_audio_free */
  size_t n;
  int source_rate;     /* the input's rate and channels */
  int source_channels;
  double source_seconds;
  char format[48]; /* e.g. "WAV PCM 16", "FLAC", "OGG Vorbis" */
} td_audio;

/* WAV (RIFF, WAVE_FORMAT_EXTENSIBLE, RF64), FLAC and OGG (Vorbis, Opus, FLAC)
 * from a file or from memory (an upload). Channels are averaged; any rate is
 * resampled to 16 kHz. Refused with a message (td_errmsg) naming the input:
 * an unreadable, corrupt or truncated file, another format, no samples, a
 * rate, channel count or duration beyond the limits, non-finite samples.
 * name labels the memory input in messages (NULL: "audio"). */
td_status td_audio_decode_file(const char *path, const td_audio_limits *lim, td_audio *out);
td_status td_audio_decode_memory(const void *data, size_t len, const char *name, const td_audio_limits *lim,
                                 td_audio *out);
void td_audio_free(td_audio *a);

/* Mono float32 at rate -> TD_AUDIO_RATE (libsoxr, the quality of docs/audio.md);
 * ceil(n * 16000 / rate) samples, as torchaudio's resample gives. *out is malloc'ed
 * (a copy when rate is already 16 kHz). */
td_status td_audio_resample(const float *in, size_t n, int rate, float **out, size_t *n_out);

/* ---- log-mel features ---- */

/* Where the spectrogram is computed: one const table a backend. create gets
 * the mel filters ([n_mels][TD_MEL_N_FREQ], float32, copied if kept) and the
 * periodic Hann window ([TD_MEL_N_FFT]). log_mel turns n >= TD_MEL_N_FFT / 2 + 1
 * samples at 16 kHz (already padded as the caller wants) into the features
 * [n_mels][n / TD_MEL_HOP]: STFT (centre, reflect padding), power, mel, log10,
 * the max - 8 floor over all of them, (x + 4) / 4. It may be called from
 * several threads at once on one state. */
typedef struct td_mel_backend_i {
  const char *name;
  td_status (*create)(int n_mels, const float *filters, const float *window, void **state);
  void (*destroy)(void *state);
  td_status (*log_mel)(void *state, const float *samples, size_t n, float *out);
} td_mel_backend_i;

extern const td_mel_backend_i td_mel_backend_cpu; /* kissfft */

typedef struct td_mel_config {
  int n_mels;            /* feature_size: 80 or 128 for Whisper (1..TD_MEL_MAX_MELS) */
  size_t window_samples; /* the feature window (n_samples); 0: 30 s */
  const td_mel_backend_i *backend; /* NULL: td_mel_backend_cpu */
} td_mel_config;

/* Fills n_mels and window_samples from DIR/preprocessor_config.json as
 * WhisperFeatureExtractor reads it (feature_size; chunk_length x sampling_rate,
 * else n_samples, else nb_max_frames x hop_length). Refuses a file whose
 * values disagree with one another or with what is computed here (sampling
 * rate, n_fft, hop, dither, padding value). Leaves backend as it was. */
td_status td_mel_config_from_preprocessor(const char *dir, td_mel_config *cfg);

typedef struct td_mel td_mel;

/* Computes the Slaney mel filters as transformers' mel_filter_bank does; the
 * handle is read-only afterwards and may be shared by threads. */
td_status td_mel_create(const td_mel_config *cfg, td_mel **out);
void td_mel_destroy(td_mel *m);
int td_mel_n_mels(const td_mel *m);
size_t td_mel_window_samples(const td_mel *m);
size_t td_mel_window_frames(const td_mel *m); /* window_samples / hop: 3000 for 30 s */
/* The filters, [n_mels][TD_MEL_N_FREQ]. */
const float *td_mel_filters(const td_mel *m);
/* How many windows audio of n samples fills, one after another (at least one). */
size_t td_mel_windows(const td_mel *m, size_t n);
/* Window w of the audio (samples [w * W, (w + 1) * W), zeros past the end), as
 * WhisperFeatureExtractor()(that slice): out [n_mels][td_mel_window_frames]. */
td_status td_mel_window(const td_mel *m, const float *samples, size_t n, size_t w, float *out);
/* The whole audio at once, unpadded, as WhisperFeatureExtractor(truncation=False,
 * padding="longest") gives for long-form generation: out [n_mels][n / hop], one
 * floor over all frames. n must exceed TD_MEL_N_FFT / 2. */
td_status td_mel_whole(const td_mel *m, const float *samples, size_t n, float *out);

/* A request's audio file (data, len bytes; name labels it in messages) as
 * the model's input: decoded, resampled, and the features of its one window
 * into *out ([n_mels][window frames], malloc'ed, *n floats). Audio longer
 * than the window (or TD_MAX_AUDIO_SECONDS) is refused, naming where
 * long-form transcription runs (frontend/longform.h's callers). */
td_status td_mel_features_from_audio(const td_mel *m, const void *data, size_t len, const char *name, float **out,
                                     size_t *n);

/* `tandem-frontend mel`: argv[0] is the subcommand's name. Prints its usage on
 * bad arguments (returns 2), the error on failure (returns 1). */
int td_frontend_mel_main(int argc, char **argv);

#endif
