/* The CPU spectrogram: kissfft's real FFT a frame, the power and mel sums in
 * float64 (as the numpy path of WhisperFeatureExtractor), the log floor
 * over the whole result. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <kiss_fftr.h>

#include "frontend/audio.h"

typedef struct cpu_state {
  int n_mels;
  float *filters;    /* [n_mels][TD_MEL_N_FREQ] */
  int *lo, *hi;      /* each filter's non-zero bins: [lo, hi) */
  float window[TD_MEL_N_FFT];
} cpu_state;

static void cpu_destroy(void *p) {
  cpu_state *s = p;
  if (!s) return;
  free(s->filters);
  free(s->lo);
  free(s->hi);
  free(s);
}

static td_status cpu_create(int n_mels, const float *filters, const float *window, void **out) {
  cpu_state *s = calloc(1, sizeof *s);
  if (!s) return td_err(TD_ERR_NOMEM, "out of memory");
  s->n_mels = n_mels;
  s->filters = malloc((size_t)n_mels * TD_MEL_N_FREQ * sizeof *s->filters);
  s->lo = malloc((size_t)n_mels * sizeof *s->lo);
  s->hi = malloc((size_t)n_mels * sizeof *s->hi);
  if (!s->filters || !s->lo || !s->hi) {
    cpu_destroy(s);
    return td_err(TD_ERR_NOMEM, "out of memory");
  }
  memcpy(s->filters, filters, (size_t)n_mels * TD_MEL_N_FREQ * sizeof *filters);
  memcpy(s->window, window, sizeof s->window);
  for (int m = 0; m < n_mels; m++) {
    const float *f = filters + (size_t)m * TD_MEL_N_FREQ;
    int lo = 0, hi = TD_MEL_N_FREQ;
    while (lo < hi && f[lo] == 0.0f) lo++;
    while (hi > lo && f[hi - 1] == 0.0f) hi--;
    s->lo[m] = lo;
    s->hi[m] = hi;
  }
  *out = s;
  return TD_OK;
}

/* np.pad(mode="reflect") index: the edge sample is not repeated (n > 200). */
static inline size_t reflect(long long i, size_t n) {
  if (i < 0) i = -i;
  if (i >= (long long)n) i = 2 * ((long long)n - 1) - i;
  return (size_t)i;
}

static td_status cpu_log_mel(void *p, const float *x, size_t n, float *out) {
  const cpu_state *s = p;
  if (n <= TD_MEL_N_FFT / 2)
    return td_err(TD_ERR_INVALID, "mel: %zu samples; reflect padding needs more than %d", n, TD_MEL_N_FFT / 2);
  const size_t frames = n / TD_MEL_HOP; /* 1 + n / hop frames, the last dropped as transformers does */
  /* kiss_fftr keeps scratch in its plan: one plan a call keeps calls independent */
  kiss_fftr_cfg fft = kiss_fftr_alloc(TD_MEL_N_FFT, 0, NULL, NULL);
  if (!fft) return td_err(TD_ERR_NOMEM, "out of memory");
  kiss_fft_scalar frame[TD_MEL_N_FFT];
  kiss_fft_cpx spec[TD_MEL_N_FREQ];
  double power[TD_MEL_N_FREQ];
  double top = -INFINITY;
  for (size_t t = 0; t < frames; t++) {
    long long start = (long long)(t * TD_MEL_HOP) - TD_MEL_N_FFT / 2;
    if (start >= 0 && (size_t)start + TD_MEL_N_FFT <= n) {
      for (int i = 0; i < TD_MEL_N_FFT; i++) frame[i] = x[start + i] * s->window[i];
    } else {
      for (int i = 0; i < TD_MEL_N_FFT; i++) frame[i] = x[reflect(start + i, n)] * s->window[i];
    }
    kiss_fftr(fft, frame, spec);
    for (int k = 0; k < TD_MEL_N_FREQ; k++) power[k] = (double)spec[k].r * spec[k].r + (double)spec[k].i * spec[k].i;
    for (int m = 0; m < s->n_mels; m++) {
      const float *f = s->filters + (size_t)m * TD_MEL_N_FREQ;
      double acc = 0;
      for (int k = s->lo[m]; k < s->hi[m]; k++) acc += f[k] * power[k];
      double v = log10(acc > 1e-10 ? acc : 1e-10);
      if (v > top) top = v;
      out[(size_t)m * frames + t] = (float)v;
    }
  }
  kiss_fftr_free(fft);
  const float floor_ = (float)(top - 8.0);
  const size_t total = (size_t)s->n_mels * frames;
  for (size_t i = 0; i < total; i++) {
    float v = out[i] > floor_ ? out[i] : floor_;
    out[i] = (v + 4.0f) / 4.0f;
  }
  return TD_OK;
}

const td_mel_backend_i td_mel_backend_cpu = {
    .name = "cpu (kissfft)",
    .create = cpu_create,
    .destroy = cpu_destroy,
    .log_mel = cpu_log_mel,
};
