/* Log-mel features against transformers' WhisperFeatureExtractor: the
 * fixture wav (80 and 128 bins), the filter banks of openai/whisper, the
 * window from preprocessor_config.json, the backend table, the `mel`
 * command; and every case tests/tools/make_audio_fixtures.py wrote under
 * tests/data/audio/generated (docs/audio.md says how each is compared). */
#include "test_audio_util.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <sys/stat.h>

#include "common/json.h"

#define TOY AU_DATA "/toy-numbers-whisper"
#define GENERATED AU_DATA "/generated"

static void speech_vs_fixture(int mels) {
  size_t n, nf;
  float *x = au_speech(&n);
  char path[512];
  snprintf(path, sizeof path, TD_TEST_DATA "/frontend/speech.mel%d.f32", mels);
  float *ref = fx_read_f32(path, &nf);
  cr_assert_eq(nf, (size_t)mels * 3000);
  td_audio a;
  cr_assert_eq(td_audio_decode_file(AU_SPEECH, NULL, &a), TD_OK, "%s", td_errmsg());
  float *f = au_features(a.samples, a.n, mels, 0, 0);
  double e = fx_rel_err(f, ref, nf);
  cr_log_info("speech.wav, %d bins: %.2e of the max", mels, e);
  cr_assert_lt(e, 1e-4, "%d bins: %.3g", mels, e);
  td_audio_free(&a);
  free(f);
  free(ref);
  free(x);
}

Test(mel, speech_80_bins_match_transformers) { speech_vs_fixture(80); }
Test(mel, speech_128_bins_match_transformers) { speech_vs_fixture(128); }

/* openai/whisper's mel_filters.npz (librosa's Slaney filters, float32). */
Test(mel, filters_match_openai_whisper) {
  for (int mels = 80; mels <= 128; mels += 48) {
    char path[512];
    size_t n;
    snprintf(path, sizeof path, AU_DATA "/mel_filters_%d.f32", mels);
    float *ref = fx_read_f32(path, &n);
    cr_assert_eq(n, (size_t)mels * TD_MEL_N_FREQ);
    td_mel_config c = {.n_mels = mels};
    td_mel *m;
    cr_assert_eq(td_mel_create(&c, &m), TD_OK);
    double e = fx_rel_err(td_mel_filters(m), ref, n);
    cr_log_info("mel filters, %d bins: %.2e of the max", mels, e);
    cr_assert_lt(e, 1e-6, "%d bins: %.3g", mels, e);
    td_mel_destroy(m);
    free(ref);
  }
}

Test(mel, window_from_preprocessor_config) {
  td_mel_config c = {0};
  cr_assert_eq(td_mel_config_from_preprocessor(TOY, &c), TD_OK, "%s", td_errmsg());
  cr_assert_eq(c.n_mels, 80);
  cr_assert_eq(c.window_samples, 64000);
  td_mel *m;
  cr_assert_eq(td_mel_create(&c, &m), TD_OK);
  cr_assert_eq(td_mel_window_frames(m), 400);
  cr_assert_eq(td_mel_windows(m, 64000), 1);
  cr_assert_eq(td_mel_windows(m, 64001), 2);
  cr_assert_eq(td_mel_windows(m, 0), 1);
  td_mel_destroy(m);
}

static void bad_config(const char *json, td_status code, const char *words) {
  char dir[] = "/tmp/td_mel_cfg_XXXXXX", path[256];
  cr_assert(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/preprocessor_config.json", dir);
  au_write_bytes(path, json, strlen(json));
  td_mel_config c = {.n_mels = 7};
  td_status s = td_mel_config_from_preprocessor(dir, &c);
  cr_assert_eq(s, code, "%s: %s", json, td_errmsg());
  cr_assert(strstr(td_errmsg(), words), "\"%s\" lacks \"%s\"", td_errmsg(), words);
  cr_assert(strstr(td_errmsg(), "preprocessor_config.json"), "%s", td_errmsg());
  cr_assert_eq(c.n_mels, 7, "a refused file changes nothing");
  unlink(path);
  rmdir(dir);
}

Test(mel, bad_preprocessor_configs_are_refused) {
  bad_config("{\"chunk_length\": 4, \"n_samples\": 480000}", TD_ERR_INVALID, "n_samples 480000");
  bad_config("{\"chunk_length\": 4, \"nb_max_frames\": 3000}", TD_ERR_INVALID, "disagree with chunk_length 4");
  bad_config("{\"sampling_rate\": 8000}", TD_ERR_UNSUPPORTED, "sampling_rate 8000");
  bad_config("{\"hop_length\": 320}", TD_ERR_UNSUPPORTED, "hop_length");
  bad_config("{\"n_fft\": 512}", TD_ERR_UNSUPPORTED, "n_fft");
  bad_config("{\"dither\": 0.5}", TD_ERR_UNSUPPORTED, "dither");
  bad_config("{\"feature_extractor_type\": \"Wav2Vec2FeatureExtractor\"}", TD_ERR_UNSUPPORTED, "Whisper");
  bad_config("{\"chunk_length\": 0}", TD_ERR_INVALID, "chunk_length 0");
  bad_config("{\"chunk_length\": 100000}", TD_ERR_INVALID, "chunk_length");
  bad_config("{\"chunk_length\": 0.00001}", TD_ERR_INVALID, "whole number of samples");
  bad_config("{\"feature_size\": 0}", TD_ERR_INVALID, "0 mel bins");
  bad_config("{\"feature_size\": \"80\"}", TD_ERR_FORMAT, "feature_size");
  bad_config("[1, 2]", TD_ERR_FORMAT, "not a JSON object");
  bad_config("{\"chunk_length\": ", TD_ERR_FORMAT, "malformed");
  td_mel_config c = {0};
  cr_assert_eq(td_mel_config_from_preprocessor("/nonexistent", &c), TD_ERR_NOT_FOUND);
}

/* Short audio: the 4 s window is the first 400 frames of the 30 s one (the
 * same samples, the same maximum); the references of transformers for the
 * 4 s window are among the generated cases. */
Test(mel, numbers_in_the_4_second_window) {
  const char *names[] = {"1", "7", "18", "24", "38", "42", "55", "305", "1999", "4207"};
  for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
    char path[512];
    snprintf(path, sizeof path, TOY "/number-%s.wav", names[i]);
    td_audio a;
    cr_assert_eq(td_audio_decode_file(path, NULL, &a), TD_OK, "%s", td_errmsg());
    cr_assert(a.n < 64000 - TD_MEL_N_FFT);
    float *f4 = au_features(a.samples, a.n, 80, 64000, 0);
    float *f30 = au_features(a.samples, a.n, 80, 0, 0);
    for (int m = 0; m < 80; m++)
      cr_assert_eq(memcmp(f4 + m * 400, f30 + m * 3000, 400 * sizeof *f4), 0, "%s, bin %d", path, m);
    free(f4);
    free(f30);
    td_audio_free(&a);
  }
}

/* Audio longer than the window: window w is the features of its slice. */
Test(mel, long_audio_windows_one_after_another) {
  size_t n;
  float *x = au_speech(&n);
  size_t len = 16000 * 65;
  float *lng = malloc(len * sizeof *lng);
  for (size_t i = 0; i < len; i++) lng[i] = x[i % n] * (float)(1.0 + (double)i / len);
  td_mel_config c = {.n_mels = 80};
  td_mel *m;
  cr_assert_eq(td_mel_create(&c, &m), TD_OK);
  cr_assert_eq(td_mel_windows(m, len), 3);
  float *f = malloc(80 * 3000 * sizeof *f);
  for (size_t w = 0; w < 3; w++) {
    size_t k = w < 2 ? 480000 : len - 960000;
    float *slice = au_features(lng + w * 480000, k, 80, 0, 0);
    cr_assert_eq(td_mel_window(m, lng, len, w, f), TD_OK);
    cr_assert_eq(memcmp(f, slice, 80 * 3000 * sizeof *f), 0, "window %zu", w);
    free(slice);
  }
  cr_assert_eq(td_mel_window(m, lng, len, 3, f), TD_ERR_INVALID);
  /* the whole audio at once, as transformers' long-form input: a window's worth equals the window */
  float *whole = malloc(80 * 3000 * sizeof *whole);
  cr_assert_eq(td_mel_whole(m, lng, 480000, whole), TD_OK);
  cr_assert_eq(td_mel_window(m, lng, len, 0, f), TD_OK);
  cr_assert_eq(memcmp(f, whole, 80 * 3000 * sizeof *f), 0);
  cr_assert_eq(td_mel_whole(m, lng, TD_MEL_N_FFT / 2, whole), TD_ERR_INVALID);
  free(whole);
  free(f);
  free(lng);
  free(x);
  td_mel_destroy(m);
}

Test(mel, silence_and_bad_samples) {
  float *z = calloc(1000, sizeof *z);
  float *f = au_features(z, 1000, 80, 0, 0);
  for (size_t i = 0; i < 80 * 3000; i++) cr_assert_float_eq(f[i], -1.5f, 1e-6, "log10(1e-10) floor");
  td_mel_config c = {.n_mels = 80};
  td_mel *m;
  cr_assert_eq(td_mel_create(&c, &m), TD_OK);
  z[10] = NAN;
  cr_assert_eq(td_mel_window(m, z, 1000, 0, f), TD_ERR_INVALID);
  cr_assert(strstr(td_errmsg(), "sample 10"), "%s", td_errmsg());
  z[10] = 1e9f;
  cr_assert_eq(td_mel_whole(m, z, 1000, f), TD_ERR_INVALID);
  cr_assert_eq(td_mel_window(m, NULL, 0, 0, f), TD_OK, "no samples: one window of silence");
  cr_assert_float_eq(f[0], -1.5f, 1e-6);
  float *two = calloc(480000 + 20, sizeof *two);
  two[480000 + 17] = INFINITY;
  cr_assert_eq(td_mel_window(m, two, 480000 + 20, 1, f), TD_ERR_INVALID);
  cr_assert(strstr(td_errmsg(), "sample 480017"), "%s", td_errmsg());
  free(two);
  td_mel_destroy(m);
  c.n_mels = 0;
  cr_assert_eq(td_mel_create(&c, &m), TD_ERR_INVALID);
  c.n_mels = 80;
  c.window_samples = 100;
  cr_assert_eq(td_mel_create(&c, &m), TD_ERR_INVALID);
  free(f);
  free(z);
}

/* Another device plugs in through the table: it gets the padded window. */
static int fake_calls;
static size_t fake_n;
static td_status fake_create(int n_mels, const float *filters, const float *window, void **state) {
  cr_assert_eq(n_mels, 128);
  cr_assert_float_eq(window[100], 0.5f, 1e-6);
  cr_assert(filters[5] >= 0.0f);
  *state = &fake_calls;
  return TD_OK;
}
static void fake_destroy(void *state) { cr_assert_eq(state, &fake_calls); }
static td_status fake_log_mel(void *state, const float *x, size_t n, float *out) {
  fake_calls++;
  fake_n = n;
  for (size_t i = 0; i < 128 * (n / TD_MEL_HOP); i++) out[i] = x[0];
  return TD_OK;
}
static const td_mel_backend_i fake = {"fake", fake_create, fake_destroy, fake_log_mel};

Test(mel, backend_table) {
  td_mel_config c = {.n_mels = 128, .window_samples = 32000, .backend = &fake};
  td_mel *m;
  cr_assert_eq(td_mel_create(&c, &m), TD_OK);
  float x[3] = {0.25f, 0, 0}, out[128 * 200];
  cr_assert_eq(td_mel_window(m, x, 3, 0, out), TD_OK);
  cr_assert_eq(fake_calls, 1);
  cr_assert_eq(fake_n, 32000);
  cr_assert_float_eq(out[128 * 200 - 1], 0.25f, 0);
  td_mel_destroy(m);
}

/* ---- the `mel` command ---- */

static int run_mel(int argc, const char **argv) { return td_frontend_mel_main(argc, (char **)argv); }

Test(mel_cmd, writes_the_features) {
  char out[256];
  au_tmp(out, sizeof out, ".f32");
  const char *argv[] = {"mel", "--mels", "128", AU_SPEECH, out};
  cr_assert_eq(run_mel(5, argv), 0);
  size_t n, nr;
  float *f = fx_read_f32(out, &n), *ref = fx_read_f32(TD_TEST_DATA "/frontend/speech.mel128.f32", &nr);
  cr_assert_eq(n, nr);
  cr_assert_lt(fx_rel_err(f, ref, n), 1e-4);
  free(f);
  free(ref);
  /* the window from the checkpoint */
  const char *argv2[] = {"mel", "--preprocessor", TOY, TOY "/number-42.wav", out};
  cr_assert_eq(run_mel(5, argv2), 0);
  f = fx_read_f32(out, &n);
  cr_assert_eq(n, 80 * 400);
  free(f);
  /* 3 s in 2 s windows: two windows one after the other */
  const char *argv3[] = {"mel", "--mels", "80", "--chunk-seconds", "2", AU_SPEECH, out};
  cr_assert_eq(run_mel(7, argv3), 0);
  f = fx_read_f32(out, &n);
  cr_assert_eq(n, 2 * 80 * 200);
  size_t ns;
  float *x = au_speech(&ns);
  float *w1 = au_features(x, ns, 80, 32000, 1);
  cr_assert_eq(memcmp(f + 80 * 200, w1, 80 * 200 * sizeof *f), 0);
  free(w1);
  free(x);
  free(f);
  unlink(out);
}

Test(mel_cmd, refuses_bad_arguments) {
  char out[256];
  au_tmp(out, sizeof out, ".f32");
  unlink(out);
  struct {
    int argc, rc;
    const char *argv[8];
  } cases[] = {
      {1, 2, {"mel"}},
      {4, 2, {"mel", "--mels", "80", AU_SPEECH}},
      {5, 2, {"mel", "--mels", "eighty", AU_SPEECH, out}},
      {5, 2, {"mel", "--mels", "0", AU_SPEECH, out}},
      {3, 2, {"mel", AU_SPEECH, out}},
      {7, 2, {"mel", "--mels", "80", "--chunk-seconds", "-1", AU_SPEECH, out}},
      {7, 2, {"mel", "--mels", "80", "--chunk-seconds", "0.00001", AU_SPEECH, out}},
      {7, 2, {"mel", "--chunk-seconds", "4", "--preprocessor", TOY, AU_SPEECH, out}},
      {6, 2, {"mel", "--mels", "80", "--bogus", AU_SPEECH, out}},
      {5, 1, {"mel", "--mels", "80", "/nonexistent.wav", out}},
      {7, 1, {"mel", "--mels", "128", "--preprocessor", TOY, AU_SPEECH, out}},
      {7, 1, {"mel", "--mels", "80", "--max-seconds", "1", AU_SPEECH, out}},
      {5, 1, {"mel", "--mels", "80", AU_SPEECH, "/nonexistent/dir/out.f32"}},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    cr_assert_eq(run_mel(cases[i].argc, cases[i].argv), cases[i].rc, "case %zu", i);
    struct stat st;
    cr_assert_neq(stat(out, &st), 0, "case %zu left an output behind", i);
  }
}

/* ---- cases made with transformers (tests/tools/make_audio_fixtures.py) ---- */

/* Tolerances (docs/audio.md, "Accuracy"): 16 kHz input is decoded as there
 * and must agree to 1e-4. Resampled input goes through libsoxr here and
 * torchaudio there: the bins below 0.74 of the lower Nyquist agree to 2e-2
 * away from the audio's edges, to 0.1 for "full_band" cases (a loud chirp
 * far above 8 kHz, which torchaudio's short filter aliases into the band
 * some 50 dB down and libsoxr removes); all bins agree to 0.5 when the input
 * was higher than 16 kHz (the filters differ just below 8 kHz); above an
 * input's own band (8 kHz audio) nothing is bounded. */
static bool check_case(const cJSON *c) {
  char name[128], audio[256], feat[256], mode[16] = "windows", path[512];
  int32_t mels = 0, rate = 0;
  int64_t samples = -1;
  bool full_band = false;
  double chunk = 30;
  cr_assert_eq(td_json_str(c, "name", true, "case", name, sizeof name), TD_OK, "%s", td_errmsg());
  cr_assert_eq(td_json_str(c, "audio", true, name, audio, sizeof audio), TD_OK, "%s", td_errmsg());
  cr_assert_eq(td_json_str(c, "features", true, name, feat, sizeof feat), TD_OK, "%s", td_errmsg());
  cr_assert_eq(td_json_str(c, "mode", false, name, mode, sizeof mode), TD_OK);
  cr_assert_eq(td_json_i32(c, "mels", true, name, &mels), TD_OK);
  cr_assert_eq(td_json_i32(c, "source_rate", true, name, &rate), TD_OK);
  cr_assert_eq(td_json_num(c, "chunk_seconds", false, name, &chunk), TD_OK);
  cr_assert_eq(td_json_int(c, "samples", false, name, &samples), TD_OK);
  cr_assert_eq(td_json_bool(c, "full_band", false, name, &full_band), TD_OK);
  snprintf(path, sizeof path, GENERATED "/%s", audio);
  td_audio a;
  cr_assert_eq(td_audio_decode_file(path, NULL, &a), TD_OK, "%s: %s", name, td_errmsg());
  cr_assert_eq(a.source_rate, rate, "%s", name);
  if (samples >= 0) cr_assert_eq((int64_t)a.n, samples, "%s: %zu samples at 16 kHz, the reference %lld", name, a.n,
                                 (long long)samples);
  snprintf(path, sizeof path, GENERATED "/%s", feat);
  size_t nref;
  float *ref = fx_read_f32(path, &nref);
  td_mel_config cfg = {.n_mels = mels, .window_samples = (size_t)(chunk * TD_AUDIO_RATE)};
  td_mel *m;
  cr_assert_eq(td_mel_create(&cfg, &m), TD_OK, "%s: %s", name, td_errmsg());
  bool whole = !strcmp(mode, "whole");
  size_t frames = whole ? a.n / TD_MEL_HOP : td_mel_window_frames(m);
  size_t windows = whole ? 1 : td_mel_windows(m, a.n), per = (size_t)mels * frames;
  cr_assert_eq(nref, windows * per, "%s: %zu reference values, %zu windows of %zu here", name, nref, windows, per);
  float *f = malloc(per * sizeof *f);
  double nyq = fmin(rate / 2.0, TD_AUDIO_RATE / 2.0);
  int band = au_bins_below(m, 0.74 * nyq);
  double worst_all = 0, worst_band = 0;
  for (size_t w = 0; w < windows; w++) {
    if (whole)
      cr_assert_eq(td_mel_whole(m, a.samples, a.n, f), TD_OK, "%s", td_errmsg());
    else
      cr_assert_eq(td_mel_window(m, a.samples, a.n, w, f), TD_OK, "%s", td_errmsg());
    const float *r = ref + w * per;
    /* away from the audio's edges: its first 3 frames and its last 3 */
    size_t in_audio = (a.n + TD_MEL_HOP - 1) / TD_MEL_HOP - w * frames;
    in_audio = in_audio < frames ? in_audio : frames;
    size_t t0 = w == 0 ? 3 : 0, t1 = in_audio > 3 ? in_audio - 3 : 0;
    double all = au_err(f, r, mels, frames, mels, 0, frames);
    double in_band = au_err(f, r, mels, frames, band, t0, t1);
    worst_all = fmax(worst_all, all);
    worst_band = fmax(worst_band, in_band);
  }
  cr_log_info("%s: all bins %.2e, the %d bins below %.0f Hz inside the audio %.2e", name, worst_all, band,
              0.74 * nyq, worst_band);
  bool ok = rate == TD_AUDIO_RATE ? worst_all < 1e-4
                                  : worst_band < (full_band ? 0.1 : 2e-2) && (rate < TD_AUDIO_RATE || worst_all < 0.5);
  if (!ok) cr_log_error("%s: beyond its tolerance", name);
  free(f);
  free(ref);
  td_mel_destroy(m);
  td_audio_free(&a);
  return ok;
}

Test(mel, generated_cases_match_transformers) {
  struct stat st;
  if (stat(GENERATED "/manifest.json", &st) != 0) cr_skip_test("no %s/manifest.json", GENERATED);
  cJSON *j;
  cr_assert_eq(td_json_load_file(GENERATED "/manifest.json", 1 << 20, &j), TD_OK, "%s", td_errmsg());
  const cJSON *cases = cJSON_GetObjectItemCaseSensitive(j, "cases");
  cr_assert(cJSON_IsArray(cases) && cJSON_GetArraySize(cases) > 0);
  const cJSON *c;
  int bad = 0, all = cJSON_GetArraySize(cases);
  cJSON_ArrayForEach(c, cases) bad += !check_case(c);
  cJSON_Delete(j);
  cr_assert_eq(bad, 0, "%d of %d cases beyond their tolerance", bad, all);
}
