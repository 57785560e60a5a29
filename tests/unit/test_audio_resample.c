/* Resampled input: a 44.1 kHz stereo speech.wav against transformers'
 * features of the 16 kHz mono one, and the libsoxr path against the
 * resampler of transformers' ASR pipeline (torchaudio.functional.resample
 * at its defaults), restated below as the measuring reference: the
 * tolerances and why they are what they are, docs/audio.md, "Accuracy". */
#include "test_audio_util.h"

/* torchaudio.functional.resample(x, orig, new) with its defaults
 * (sinc_interp_hann, lowpass_filter_width 6, rolloff 0.99): the kernel of
 * _get_sinc_resample_kernel, the strided convolution of
 * _apply_sinc_resample_kernel, ceil(new * n / orig) samples. Float64. */
static long gcd_(long a, long b) {
  while (b) {
    long t = a % b;
    a = b;
    b = t;
  }
  return a;
}

static float *torchaudio_resample(const float *x, size_t n, int orig_rate, int new_rate, size_t *n_out) {
  const double width_zc = 6, rolloff = 0.99;
  long g = gcd_(orig_rate, new_rate), orig = orig_rate / g, nw = new_rate / g;
  double base = (orig < nw ? orig : nw) * rolloff;
  long width = (long)ceil(width_zc * (double)orig / base), klen = 2 * width + orig;
  double *ker = malloc((size_t)(nw * klen) * sizeof *ker);
  for (long p = 0; p < nw; p++)
    for (long k = 0; k < klen; k++) {
      double t = (-(double)p / nw + (double)(k - width) / orig) * base;
      t = fmax(-width_zc, fmin(width_zc, t));
      double w = cos(t * M_PI / width_zc / 2);
      t *= M_PI;
      ker[p * klen + k] = (t == 0 ? 1.0 : sin(t) / t) * w * w * base / orig;
    }
  *n_out = (size_t)ceil((double)nw * (double)n / orig);
  float *y = malloc(*n_out * sizeof *y);
  for (size_t j = 0; j < *n_out; j++) {
    long i = (long)(j / (size_t)nw), p = (long)(j % (size_t)nw);
    double acc = 0;
    for (long k = 0; k < klen; k++) {
      long at = i * orig + k - width;
      if (at >= 0 && (size_t)at < n) acc += ker[p * klen + k] * x[at];
    }
    y[j] = (float)acc;
  }
  free(ker);
  return y;
}

/* speech.wav at 44.1 kHz in stereo (L = s + d, R = s - d: the mean is s),
 * through the decoder, against transformers' features of speech.wav itself.
 * What separates them is two resamplings: up here at very high quality,
 * then down through the roll-off chosen to follow torchaudio's (flat to
 * 0.74 x 8 kHz, soft above), so the band below 5.9 kHz agrees closely and
 * the top bins lose what that roll-off takes, as they do in transformers'
 * pipeline (whose distance is logged beside). */
Test(resample, speech_44k_stereo_close_to_16k_mono) {
  size_t n, n44, nf;
  float *x = au_speech(&n);
  float *up = au_resample_vhq(x, n, 16000, 44100, &n44);
  float *st = malloc(2 * n44 * sizeof *st);
  for (size_t i = 0; i < n44; i++) {
    float d = 0.1f * (float)sin(2 * M_PI * 440.0 * (double)i / 44100);
    st[2 * i] = up[i] + d;
    st[2 * i + 1] = up[i] - d;
  }
  char path[256];
  au_tmp(path, sizeof path, ".wav");
  au_write(path, SF_FORMAT_WAV | SF_FORMAT_FLOAT, 44100, 2, st, n44);
  td_audio a;
  cr_assert_eq(td_audio_decode_file(path, NULL, &a), TD_OK, "%s", td_errmsg());
  cr_assert_eq(a.n, n);
  float *ref = fx_read_f32(TD_TEST_DATA "/frontend/speech.mel80.f32", &nf);
  float *f = au_features(a.samples, a.n, 80, 0, 0);
  td_mel_config c = {.n_mels = 80};
  td_mel *m;
  cr_assert_eq(td_mel_create(&c, &m), TD_OK);
  int band = au_bins_below(m, 0.74 * 8000);
  double all = au_err(f, ref, 80, 3000, 80, 0, 3000), in_band = au_err(f, ref, 80, 3000, band, 3, 297);
  size_t nt;
  float *t = torchaudio_resample(up, n44, 44100, 16000, &nt);
  float *ft = au_features(t, nt, 80, 0, 0);
  double theirs = au_err(ft, ref, 80, 3000, 80, 0, 3000);
  cr_log_info("speech.wav at 44.1 kHz stereo: all bins %.2e (torchaudio's path: %.2e), the %d bins below 5.9 kHz %.2e",
              all, theirs, band, in_band);
  cr_assert_lt(in_band, 1e-3, "%.3g", in_band);
  cr_assert_lt(all, 0.2, "%.3g", all);
  free(ft);
  free(t);
  td_mel_destroy(m);
  free(f);
  free(ref);
  td_audio_free(&a);
  free(st);
  free(up);
  free(x);
  unlink(path);
}

/* Band-limited speech and full-band noise at common rates, through the
 * decoder here and through torchaudio's resample there, into the same
 * features: the bounds the generated cases are held to. */
static void versus_torchaudio(int rate, bool noise) {
  size_t n, ns;
  float *x;
  if (noise) {
    n = (size_t)rate * 3;
    x = malloc(n * sizeof *x);
    uint64_t s = 42;
    for (size_t i = 0; i < n; i++) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      x[i] = 0.1f * (float)((double)(s >> 11) / (double)(1ull << 53) * 2 - 1);
    }
  } else {
    float *sp = au_speech(&ns);
    x = au_resample_vhq(sp, ns, 16000, rate, &n);
    free(sp);
  }
  char path[256];
  au_tmp(path, sizeof path, ".wav");
  au_write(path, SF_FORMAT_WAV | SF_FORMAT_FLOAT, rate, 1, x, n);
  td_audio a;
  cr_assert_eq(td_audio_decode_file(path, NULL, &a), TD_OK, "%s", td_errmsg());
  size_t nt;
  float *t = torchaudio_resample(x, n, rate, 16000, &nt);
  cr_assert_eq(a.n, nt, "%d Hz: %zu samples, torchaudio gives %zu", rate, a.n, nt);
  float *f = au_features(a.samples, a.n, 80, 0, 0), *ref = au_features(t, nt, 80, 0, 0);
  td_mel_config c = {.n_mels = 80};
  td_mel *m;
  cr_assert_eq(td_mel_create(&c, &m), TD_OK);
  double nyq = fmin(rate / 2.0, 8000);
  int band = au_bins_below(m, 0.74 * nyq);
  size_t frames = (nt + TD_MEL_HOP - 1) / TD_MEL_HOP;
  double all = au_err(f, ref, 80, 3000, 80, 0, 3000), in_band = au_err(f, ref, 80, 3000, band, 3, frames - 3);
  cr_log_info("%d Hz %s: all bins %.2e, the %d bins below %.0f Hz inside the audio %.2e", rate,
              noise ? "noise" : "speech", all, band, 0.74 * nyq, in_band);
  cr_assert_lt(in_band, 2e-2, "%d Hz: %.3g in band", rate, in_band);
  if (rate > 16000) cr_assert_lt(all, 0.5, "%d Hz: %.3g", rate, all);
  td_mel_destroy(m);
  free(f);
  free(ref);
  free(t);
  td_audio_free(&a);
  free(x);
  unlink(path);
}

Test(resample, speech_versus_torchaudio_8k) { versus_torchaudio(8000, false); }
Test(resample, speech_versus_torchaudio_22k) { versus_torchaudio(22050, false); }
Test(resample, speech_versus_torchaudio_44k) { versus_torchaudio(44100, false); }
Test(resample, speech_versus_torchaudio_48k) { versus_torchaudio(48000, false); }
Test(resample, noise_versus_torchaudio_8k) { versus_torchaudio(8000, true); }
Test(resample, noise_versus_torchaudio_22k) { versus_torchaudio(22050, true); }
Test(resample, noise_versus_torchaudio_44k) { versus_torchaudio(44100, true); }
Test(resample, noise_versus_torchaudio_48k) { versus_torchaudio(48000, true); }
