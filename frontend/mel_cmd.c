/* `tandem-frontend mel`: an audio file's log-mel features, float32
 * [mels, frames] a window, the windows one after another, so that any audio
 * can be checked against transformers without a model. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/defaults.h"
#include "frontend/audio.h"

static const char usage[] =
    "usage: tandem-frontend mel --mels N [--chunk-seconds S | --preprocessor DIR] [--max-seconds S] AUDIO OUT.f32\n"
    "  AUDIO: WAV, FLAC or OGG, any rate and channels (mixed down, resampled to 16 kHz)\n"
    "  OUT.f32: float32 [mels, frames] for each window of the audio, one after another\n"
    "  --mels N            mel bins (80 or 128); optional with --preprocessor, which gives feature_size\n"
    "  --chunk-seconds S   the window (default 30 s, 3000 frames)\n"
    "  --preprocessor DIR  take the bins and the window from DIR/preprocessor_config.json\n"
    "  --max-seconds S     refuse longer audio (default: an hour)\n"
    "Prints one JSON line: windows, mels, frames, the source's rate, channels, seconds and format.\n";

static int bad(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int bad(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "mel: ");
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\n%s", usage);
  return 2;
}

static int parse_num(const char *s, double *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || end == s || *end || !isfinite(v) || v <= 0) return -1;
  *out = v;
  return 0;
}

static int fail(const char *what) {
  fprintf(stderr, "mel: %s%s\n", what, td_errmsg());
  return 1;
}

static int write_features(const td_mel *m, const td_audio *a, const char *path, size_t *windows) {
  size_t per = (size_t)td_mel_n_mels(m) * td_mel_window_frames(m);
  float *feat = malloc(per * sizeof *feat);
  FILE *f = feat ? fopen(path, "wb") : NULL;
  if (!f) {
    fprintf(stderr, "mel: %s: %s\n", path, feat ? strerror(errno) : "out of memory");
    free(feat);
    return 1;
  }
  int rc = 0;
  *windows = td_mel_windows(m, a->n);
  for (size_t w = 0; w < *windows && !rc; w++) {
    if (td_mel_window(m, a->samples, a->n, w, feat) != TD_OK)
      rc = fail("");
    else if (fwrite(feat, sizeof *feat, per, f) != per)
      rc = (fprintf(stderr, "mel: %s: %s\n", path, strerror(errno)), 1);
  }
  if (fclose(f) != 0 && !rc) rc = (fprintf(stderr, "mel: %s: %s\n", path, strerror(errno)), 1);
  if (rc) unlink(path);
  free(feat);
  return rc;
}

int td_frontend_mel_main(int argc, char **argv) {
  td_mel_config cfg = {0};
  td_audio_limits lim = {0};
  const char *pre = NULL, *chunk_arg = NULL, *pos[2] = {NULL, NULL};
  int n_pos = 0, mels = 0;
  double chunk = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    int has_val = i + 1 < argc;
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      fputs(usage, stdout);
      return 0;
    } else if (!strcmp(a, "--mels") && has_val) {
      char *end;
      long v = strtol(argv[++i], &end, 10);
      if (*end || end == argv[i] || v < 1 || v > TD_MEL_MAX_MELS) return bad("--mels %s: not a bin count", argv[i]);
      mels = (int)v;
    } else if (!strcmp(a, "--chunk-seconds") && has_val) {
      chunk_arg = argv[++i];
      if (parse_num(chunk_arg, &chunk)) return bad("--chunk-seconds %s: not a positive number", chunk_arg);
    } else if (!strcmp(a, "--preprocessor") && has_val) {
      pre = argv[++i];
    } else if (!strcmp(a, "--max-seconds") && has_val) {
      if (parse_num(argv[++i], &lim.max_seconds)) return bad("--max-seconds %s: not a positive number", argv[i]);
    } else if (a[0] == '-' && a[1]) {
      return bad("%s: unknown option or missing value", a);
    } else if (n_pos < 2) {
      pos[n_pos++] = a;
    } else {
      return bad("%s: one audio file and one output file only", a);
    }
  }
  if (n_pos != 2) return bad("needs AUDIO and OUT.f32");
  if (pre && chunk > 0) return bad("--chunk-seconds and --preprocessor both set the window: give one");
  if (pre) {
    if (td_mel_config_from_preprocessor(pre, &cfg) != TD_OK) return fail("");
    if (mels && mels != cfg.n_mels) {
      fprintf(stderr, "mel: --mels %d disagrees with feature_size %d of %s/preprocessor_config.json\n", mels,
              cfg.n_mels, pre);
      return 1;
    }
  } else {
    if (!mels) return bad("--mels is needed (or --preprocessor)");
    cfg.n_mels = mels;
    if (chunk > 0) {
      double w = chunk * TD_AUDIO_RATE;
      if (w != floor(w) || chunk > TD_MEL_MAX_WINDOW_SECONDS)
        return bad("--chunk-seconds %s: not a whole number of 16 kHz samples, at most %d s", chunk_arg,
                   TD_MEL_MAX_WINDOW_SECONDS);
      cfg.window_samples = (size_t)w; /* td_mel_create checks the rest */
    }
  }
  td_mel *m = NULL;
  if (td_mel_create(&cfg, &m) != TD_OK) return fail("");
  td_audio a = {0};
  int rc = 0;
  size_t windows = 0;
  if (td_audio_decode_file(pos[0], &lim, &a) != TD_OK)
    rc = fail("");
  else
    rc = write_features(m, &a, pos[1], &windows);
  if (!rc) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "windows", (double)windows);
    cJSON_AddNumberToObject(j, "mels", td_mel_n_mels(m));
    cJSON_AddNumberToObject(j, "frames", (double)td_mel_window_frames(m));
    cJSON_AddNumberToObject(j, "samples", (double)a.n);
    cJSON_AddNumberToObject(j, "source_rate", a.source_rate);
    cJSON_AddNumberToObject(j, "source_channels", a.source_channels);
    cJSON_AddNumberToObject(j, "source_seconds", a.source_seconds);
    cJSON_AddStringToObject(j, "format", a.format);
    char *s = cJSON_PrintUnformatted(j);
    if (s) printf("%s\n", s);
    cJSON_free(s);
    cJSON_Delete(j);
  }
  td_audio_free(&a);
  td_mel_destroy(m);
  return rc;
}
