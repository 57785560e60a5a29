/* Log-mel features as transformers' WhisperFeatureExtractor: the filters
 * (mel_filter_bank, Slaney scale and norm), the window, the feature window's
 * length from preprocessor_config.json, padding to the window; the
 * spectrogram itself is the backend's (mel_cpu.c). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/defaults.h"
#include "common/json.h"
#include "frontend/audio.h"

#define MEL_FMAX 8000.0 /* WhisperFeatureExtractor's max_frequency */
#define PREPROCESSOR_MAX_BYTES (1u << 20)

struct td_mel {
  int n_mels;
  size_t window; /* samples */
  float *filters; /* [n_mels][TD_MEL_N_FREQ] */
  float hann[TD_MEL_N_FFT];
  const td_mel_backend_i *be;
  void *state;
};

/* transformers' audio_utils.hertz_to_mel / mel_to_hertz, mel_scale="slaney" */
static double hz_to_mel(double f) {
  if (f >= 1000.0) return 15.0 + log(f / 1000.0) * (27.0 / log(6.4));
  return 3.0 * f / 200.0;
}

static double mel_to_hz(double m) {
  if (m >= 15.0) return 1000.0 * exp(log(6.4) / 27.0 * (m - 15.0));
  return 200.0 * m / 3.0;
}

/* mel_filter_bank(num_frequency_bins=201, num_mel_filters=n, min_frequency=0,
 * max_frequency=8000, sampling_rate=16000, norm="slaney", mel_scale="slaney"),
 * in float64 as there, stored transposed as float32. */
static td_status filter_bank(int n, float *out) {
  double *f = malloc((size_t)(n + 2) * sizeof *f);
  if (!f) return td_err(TD_ERR_NOMEM, "mel: out of memory");
  double mmax = hz_to_mel(MEL_FMAX), step = mmax / (n + 1); /* np.linspace(0, mmax, n + 2) */
  for (int i = 0; i < n + 2; i++) f[i] = mel_to_hz(i == n + 1 ? mmax : i * step);
  double fstep = (TD_AUDIO_RATE / 2) / (double)(TD_MEL_N_FREQ - 1); /* np.linspace(0, 8000, 201) */
  for (int m = 0; m < n; m++) {
    double enorm = 2.0 / (f[m + 2] - f[m]);
    for (int k = 0; k < TD_MEL_N_FREQ; k++) {
      double fk = k == TD_MEL_N_FREQ - 1 ? TD_AUDIO_RATE / 2 : k * fstep;
      double down = -(f[m] - fk) / (f[m + 1] - f[m]);
      double up = (f[m + 2] - fk) / (f[m + 2] - f[m + 1]);
      double w = fmax(0.0, fmin(down, up));
      out[(size_t)m * TD_MEL_N_FREQ + k] = (float)(w * enorm);
    }
  }
  free(f);
  return TD_OK;
}

static td_status check_config(const td_mel_config *c, size_t *window) {
  *window = c->window_samples ? c->window_samples : (size_t)TD_MEL_DEFAULT_WINDOW_SECONDS * TD_AUDIO_RATE;
  if (c->n_mels < 1 || c->n_mels > TD_MEL_MAX_MELS)
    return td_err(TD_ERR_INVALID, "mel: %d mel bins, not within 1..%d", c->n_mels, TD_MEL_MAX_MELS);
  if (*window < TD_MEL_N_FFT || *window > (size_t)TD_MEL_MAX_WINDOW_SECONDS * TD_AUDIO_RATE)
    return td_err(TD_ERR_INVALID, "mel: a window of %zu samples, not within %d..%d", *window, TD_MEL_N_FFT,
                  TD_MEL_MAX_WINDOW_SECONDS * TD_AUDIO_RATE);
  return TD_OK;
}

td_status td_mel_create(const td_mel_config *cfg, td_mel **out) {
  size_t window;
  TD_TRY(check_config(cfg, &window));
  td_mel *m = calloc(1, sizeof *m);
  if (!m) return td_err(TD_ERR_NOMEM, "mel: out of memory");
  m->n_mels = cfg->n_mels;
  m->window = window;
  m->be = cfg->backend ? cfg->backend : &td_mel_backend_cpu;
  for (int i = 0; i < TD_MEL_N_FFT; i++) /* torch.hann_window(400), periodic */
    m->hann[i] = (float)(0.5 - 0.5 * cos(2.0 * M_PI * i / TD_MEL_N_FFT));
  td_status s = TD_OK;
  m->filters = malloc((size_t)m->n_mels * TD_MEL_N_FREQ * sizeof *m->filters);
  if (!m->filters)
    s = td_err(TD_ERR_NOMEM, "mel: out of memory");
  else if ((s = filter_bank(m->n_mels, m->filters)) == TD_OK)
    s = m->be->create(m->n_mels, m->filters, m->hann, &m->state);
  if (s != TD_OK) {
    td_err_ctx(s, "mel backend %s: ", m->be->name);
    free(m->filters);
    free(m);
    return s;
  }
  *out = m;
  return TD_OK;
}

void td_mel_destroy(td_mel *m) {
  if (!m) return;
  if (m->state) m->be->destroy(m->state);
  free(m->filters);
  free(m);
}

int td_mel_n_mels(const td_mel *m) { return m->n_mels; }
size_t td_mel_window_samples(const td_mel *m) { return m->window; }
size_t td_mel_window_frames(const td_mel *m) { return m->window / TD_MEL_HOP; }
const float *td_mel_filters(const td_mel *m) { return m->filters; }

size_t td_mel_windows(const td_mel *m, size_t n) { return n <= m->window ? 1 : (n + m->window - 1) / m->window; }

/* x holds samples [first, first + n) of the audio */
static td_status check_samples(const float *x, size_t n, size_t first) {
  for (size_t i = 0; i < n; i++)
    if (!isfinite(x[i]) || fabsf(x[i]) > TD_AUDIO_MAX_SAMPLE_ABS)
      return td_err(TD_ERR_INVALID, "mel: sample %zu is %g, not a finite value within +-%g", first + i, x[i],
                    TD_AUDIO_MAX_SAMPLE_ABS);
  return TD_OK;
}

td_status td_mel_window(const td_mel *m, const float *samples, size_t n, size_t w, float *out) {
  if (w >= td_mel_windows(m, n))
    return td_err(TD_ERR_INVALID, "mel: window %zu of audio that fills %zu", w, td_mel_windows(m, n));
  size_t start = w * m->window, k = n - start < m->window ? n - start : m->window;
  if (k) TD_TRY(check_samples(samples + start, k, start));
  float *buf = calloc(m->window, sizeof *buf);
  if (!buf) return td_err(TD_ERR_NOMEM, "mel: out of memory");
  if (k) memcpy(buf, samples + start, k * sizeof *buf);
  td_status s = m->be->log_mel(m->state, buf, m->window, out);
  free(buf);
  return s;
}

td_status td_mel_whole(const td_mel *m, const float *samples, size_t n, float *out) {
  if (n <= TD_MEL_N_FFT / 2)
    return td_err(TD_ERR_INVALID, "mel: %zu samples; reflect padding needs more than %d", n, TD_MEL_N_FFT / 2);
  TD_TRY(check_samples(samples, n, 0));
  return m->be->log_mel(m->state, samples, n, out);
}

/* ---- preprocessor_config.json ---- */

static td_status expect_num(const cJSON *j, const char *key, double want, const char *src) {
  double v = want;
  TD_TRY(td_json_num(j, key, false, src, &v));
  if (v != want)
    return td_err(TD_ERR_UNSUPPORTED, "%s: %s %g is not supported (WhisperFeatureExtractor's %g is)", src, key, v,
                  want);
  return TD_OK;
}

static td_status read_preprocessor(const cJSON *j, const char *src, td_mel_config *cfg) {
  const cJSON *type = cJSON_GetObjectItemCaseSensitive(j, "feature_extractor_type");
  if (type && (!cJSON_IsString(type) || strcmp(type->valuestring, "WhisperFeatureExtractor") != 0))
    return td_err(TD_ERR_UNSUPPORTED, "%s: feature_extractor_type is not WhisperFeatureExtractor", src);
  TD_TRY(expect_num(j, "sampling_rate", TD_AUDIO_RATE, src));
  TD_TRY(expect_num(j, "n_fft", TD_MEL_N_FFT, src));
  TD_TRY(expect_num(j, "hop_length", TD_MEL_HOP, src));
  TD_TRY(expect_num(j, "dither", 0.0, src));
  TD_TRY(expect_num(j, "padding_value", 0.0, src));
  int32_t mels = 80; /* the defaults of WhisperFeatureExtractor.__init__ */
  double chunk = TD_MEL_DEFAULT_WINDOW_SECONDS;
  TD_TRY(td_json_i32(j, "feature_size", false, src, &mels));
  TD_TRY(td_json_num(j, "chunk_length", false, src, &chunk));
  /* transformers sets n_samples = chunk_length x sampling_rate whatever the
   * file says: n_samples and nb_max_frames that disagree are refused. */
  double window = chunk * TD_AUDIO_RATE;
  if (!(chunk > 0) || chunk > TD_MEL_MAX_WINDOW_SECONDS || window != floor(window) || window < TD_MEL_N_FFT)
    return td_err(TD_ERR_INVALID, "%s: chunk_length %g s is not a whole number of samples within %g..%d s", src,
                  chunk, (double)TD_MEL_N_FFT / TD_AUDIO_RATE, TD_MEL_MAX_WINDOW_SECONDS);
  int64_t n_samples = (int64_t)window, frames = (int64_t)window / TD_MEL_HOP;
  TD_TRY(td_json_int(j, "n_samples", false, src, &n_samples));
  TD_TRY(td_json_int(j, "nb_max_frames", false, src, &frames));
  if (n_samples != (int64_t)window || frames != (int64_t)window / TD_MEL_HOP)
    return td_err(TD_ERR_INVALID,
                  "%s: n_samples %lld / nb_max_frames %lld disagree with chunk_length %g s (%lld samples, %lld "
                  "frames)",
                  src, (long long)n_samples, (long long)frames, chunk, (long long)window,
                  (long long)window / TD_MEL_HOP);
  td_mel_config c = *cfg;
  c.n_mels = mels;
  c.window_samples = (size_t)window;
  size_t w;
  td_status s = check_config(&c, &w);
  if (s != TD_OK) return td_err_ctx(s, "%s: ", src);
  *cfg = c;
  return TD_OK;
}

td_status td_mel_config_from_preprocessor(const char *dir, td_mel_config *cfg) {
  char path[4096];
  if (snprintf(path, sizeof path, "%s/preprocessor_config.json", dir) >= (int)sizeof path)
    return td_err(TD_ERR_INVALID, "%s: path too long", dir);
  cJSON *j = NULL;
  TD_TRY(td_json_load_file(path, PREPROCESSOR_MAX_BYTES, &j));
  td_status s = cJSON_IsObject(j) ? read_preprocessor(j, path, cfg)
                                  : td_err(TD_ERR_FORMAT, "%s: not a JSON object", path);
  cJSON_Delete(j);
  return s;
}

td_status td_mel_features_from_audio(const td_mel *m, const void *data, size_t len, const char *name, float **out,
                                     size_t *n) {
  *out = NULL;
  *n = 0;
  double window_s = (double)td_mel_window_samples(m) / TD_AUDIO_RATE;
  if (window_s > TD_MAX_AUDIO_SECONDS) window_s = TD_MAX_AUDIO_SECONDS;
  td_audio_limits lim = {.max_seconds = window_s};
  td_audio a;
  td_status s = td_audio_decode_memory(data, len, name, &lim, &a);
  if (s != TD_OK) {
    /* the duration refusals say "N s of audio": name what is missing */
    if (!strstr(td_errmsg(), "s of audio")) return s;
    char why[512];
    snprintf(why, sizeof why, "%s", td_errmsg());
    return td_err(s, "%s: the model's window is %.1f s; longer audio is transcribed long-form by tandem-gateway "
                  "(/v1/audio/transcriptions) and tandem-generate, window after window", why, window_s);
  }
  size_t count = (size_t)td_mel_n_mels(m) * td_mel_window_frames(m);
  float *v = malloc(sizeof *v * count);
  s = v ? td_mel_window(m, a.samples, a.n, 0, v) : td_err(TD_ERR_NOMEM, "%s: out of memory", name);
  td_audio_free(&a);
  if (s != TD_OK) {
    free(v);
    return s;
  }
  *out = v;
  *n = count;
  return TD_OK;
}
