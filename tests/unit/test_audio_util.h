/* Helpers of the audio tests: test inputs written with libsndfile (and
 * resampled with libsoxr) at run time, temporary files, feature errors. */
#ifndef TD_TEST_AUDIO_UTIL_H
#define TD_TEST_AUDIO_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <criterion/criterion.h>
#include <sndfile.h>
#include <soxr.h>

#include "fixture.h"
#include "frontend/audio.h"

#define AU_DATA TD_TEST_DATA "/audio"
#define AU_SPEECH TD_TEST_DATA "/frontend/speech.wav"

/* A fresh temporary path ending in suffix (the file is created empty). */
static inline void au_tmp(char *out, size_t cap, const char *suffix) {
  const char *dir = getenv("TMPDIR");
  snprintf(out, cap, "%s/td_audio_XXXXXX%s", dir && *dir ? dir : "/tmp", suffix);
  int fd = mkstemps(out, (int)strlen(suffix));
  cr_assert(fd >= 0, "mkstemps %s", out);
  close(fd);
}

/* Writes frames x channels interleaved floats as format (SF_FORMAT_*). */
static inline void au_write(const char *path, int format, int rate, int channels, const float *x, size_t frames) {
  SF_INFO info = {.samplerate = rate, .channels = channels, .format = format};
  SNDFILE *sf = sf_open(path, SFM_WRITE, &info);
  cr_assert(sf, "writing %s: %s", path, sf_strerror(NULL));
  if (frames) cr_assert_eq(sf_writef_float(sf, x, (sf_count_t)frames), (sf_count_t)frames);
  cr_assert_eq(sf_close(sf), 0);
}

static inline unsigned char *au_read_bytes(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  cr_assert(f, "cannot open %s", path);
  fseek(f, 0, SEEK_END);
  long sz = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *b = malloc((size_t)sz + 1);
  cr_assert(fread(b, 1, (size_t)sz, f) == (size_t)sz);
  fclose(f);
  *len = (size_t)sz;
  return b;
}

static inline void au_write_bytes(const char *path, const void *b, size_t len) {
  FILE *f = fopen(path, "wb");
  cr_assert(f);
  cr_assert(fwrite(b, 1, len, f) == len);
  fclose(f);
}

/* speech.wav's samples read as transformers reads them: int16 / 32768
 * (its 44-byte canonical header parsed here, not by the decoder). */
static inline float *au_speech(size_t *n) {
  size_t len;
  unsigned char *b = au_read_bytes(AU_SPEECH, &len);
  cr_assert(len > 44 && !memcmp(b + 36, "data", 4));
  uint32_t bytes = (uint32_t)b[40] | (uint32_t)b[41] << 8 | (uint32_t)b[42] << 16 | (uint32_t)b[43] << 24;
  cr_assert(bytes <= len - 44);
  *n = bytes / 2;
  float *x = malloc(*n * sizeof *x);
  for (size_t i = 0; i < *n; i++) x[i] = (float)(int16_t)(b[44 + 2 * i] | b[45 + 2 * i] << 8) / 32768.0f;
  free(b);
  return x;
}

/* Test inputs at other rates: libsoxr at its very-high quality, its pass
 * band widened to 99 % so that up-sampling keeps the top mel bins. */
static inline float *au_resample_vhq(const float *x, size_t n, int from, int to, size_t *n_out) {
  *n_out = (size_t)ceil((double)n * to / from);
  float *y = calloc(*n_out + 1, sizeof *y);
  soxr_io_spec_t io = soxr_io_spec(SOXR_FLOAT32_I, SOXR_FLOAT32_I);
  soxr_quality_spec_t q = soxr_quality_spec(SOXR_VHQ, 0);
  q.passband_end = 0.99;
  size_t done = 0;
  cr_assert_null(soxr_oneshot(from, to, 1, x, n, NULL, y, *n_out, &done, &io, &q, NULL));
  return y;
}

/* Features of mono 16 kHz samples: window w, [mels][frames]. */
static inline float *au_features(const float *x, size_t n, int mels, size_t window, size_t w) {
  td_mel_config c = {.n_mels = mels, .window_samples = window};
  td_mel *m;
  cr_assert_eq(td_mel_create(&c, &m), TD_OK, "%s", td_errmsg());
  float *f = malloc((size_t)mels * td_mel_window_frames(m) * sizeof *f);
  cr_assert_eq(td_mel_window(m, x, n, w, f), TD_OK, "%s", td_errmsg());
  td_mel_destroy(m);
  return f;
}

/* max |a - b| / max |b| over mel bins [0, mel_hi) and frames [t0, t1). */
static inline double au_err(const float *a, const float *b, int mels, size_t frames, int mel_hi, size_t t0,
                            size_t t1) {
  double top = 0, err = 0;
  for (size_t i = 0; i < (size_t)mels * frames; i++) top = fmax(top, fabs(b[i]));
  for (int m = 0; m < mel_hi; m++)
    for (size_t t = t0; t < t1 && t < frames; t++) {
      double a_ = a[(size_t)m * frames + t], b_ = b[(size_t)m * frames + t];
      if (!isfinite(a_)) return INFINITY;
      err = fmax(err, fabs(a_ - b_));
    }
  return err / top;
}

/* The mel bins whose filters lie wholly below hz. */
static inline int au_bins_below(const td_mel *m, double hz) {
  const float *f = td_mel_filters(m);
  int n = 0;
  for (int b = 0; b < td_mel_n_mels(m); b++) {
    int last = 0;
    for (int k = 0; k < TD_MEL_N_FREQ; k++)
      if (f[(size_t)b * TD_MEL_N_FREQ + k] > 0) last = k;
    if (last * (double)(TD_AUDIO_RATE / 2) / (TD_MEL_N_FREQ - 1) <= hz) n = b + 1;
  }
  return n;
}

#endif
