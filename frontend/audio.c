/* Decoding (libsndfile, from a file or from memory), mono mixdown and
 * resampling to 16 kHz (libsoxr), streamed block by block so that only the
 * 16 kHz result is held. Every refusal names the input and the limit. */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <sndfile.h>
#include <soxr.h>

#include "common/defaults.h"
#include "frontend/audio.h"

#define READ_FRAMES 4096       /* frames decoded a block */
#define RESERVE_MAX (1u << 20) /* samples reserved up front whatever a header claims */

/* ---- resampling ---- */

/* soxr's quality: linear phase, 20-bit, with the gentle roll-off (flat to
 * 0.74 of the lower Nyquist, stop band from 1.2) that best follows
 * torchaudio's default resample, the one transformers' ASR pipeline uses:
 * docs/audio.md, "Resampling". */
#define RESAMPLE_RECIPE SOXR_HQ
#define RESAMPLE_PASSBAND_END 0.74
#define RESAMPLE_STOPBAND_BEGIN 1.20

typedef struct resampler {
  soxr_t sx; /* NULL when the input is already at 16 kHz */
  int rate;
  size_t n_in;
  float *out;
  size_t n, cap;
} resampler;

static td_status grow(resampler *r, size_t more) {
  if (r->n + more <= r->cap) return TD_OK;
  if (more > SIZE_MAX / 4 / sizeof(float) - r->n) return td_err(TD_ERR_NOMEM, "audio: %zu samples", more);
  size_t cap = r->cap ? r->cap : 1u << 16;
  while (cap < r->n + more) cap *= 2;
  float *p = realloc(r->out, cap * sizeof *p);
  if (!p) return td_err(TD_ERR_NOMEM, "audio: out of memory for %zu samples", cap);
  r->out = p;
  r->cap = cap;
  return TD_OK;
}

static td_status rs_init(resampler *r, int rate, size_t expect_in) {
  memset(r, 0, sizeof *r);
  r->rate = rate;
  if (expect_in) TD_TRY(grow(r, (size_t)fmin(ceil((double)expect_in * TD_AUDIO_RATE / rate) + 1, RESERVE_MAX)));
  if (rate == TD_AUDIO_RATE) return TD_OK;
  soxr_io_spec_t io = soxr_io_spec(SOXR_FLOAT32_I, SOXR_FLOAT32_I);
  soxr_quality_spec_t q = soxr_quality_spec(RESAMPLE_RECIPE, 0);
  q.passband_end = RESAMPLE_PASSBAND_END;
  q.stopband_begin = RESAMPLE_STOPBAND_BEGIN;
  soxr_runtime_spec_t rt = soxr_runtime_spec(1);
  soxr_error_t e = NULL;
  r->sx = soxr_create(rate, TD_AUDIO_RATE, 1, &e, &io, &q, &rt);
  if (!r->sx || e) {
    free(r->out);
    r->out = NULL;
    return td_err(TD_ERR_INTERNAL, "audio: cannot resample %d Hz to %d Hz: %s", rate, TD_AUDIO_RATE,
                  e ? e : "soxr_create failed");
  }
  return TD_OK;
}

static void rs_free(resampler *r) {
  if (r->sx) soxr_delete(r->sx);
  free(r->out);
  memset(r, 0, sizeof *r);
}

/* Feeds n samples (NULL, 0: the end, which flushes the filter). */
static td_status rs_push(resampler *r, const float *in, size_t n) {
  r->n_in += n;
  if (!r->sx) {
    if (!n) return TD_OK;
    TD_TRY(grow(r, n));
    memcpy(r->out + r->n, in, n * sizeof *in);
    r->n += n;
    return TD_OK;
  }
  size_t room = (size_t)ceil((double)n * TD_AUDIO_RATE / r->rate) + 1024;
  for (;;) {
    TD_TRY(grow(r, room));
    size_t used = 0, made = 0;
    soxr_error_t e = soxr_process(r->sx, in, n, in ? &used : NULL, r->out + r->n, r->cap - r->n, &made);
    if (e) return td_err(TD_ERR_INTERNAL, "audio: resampling failed: %s", e);
    r->n += made;
    if (in) {
      in += used;
      n -= used;
      if (!n) return TD_OK;
    } else if (!made) {
      return TD_OK;
    }
  }
}

/* The end: flushes, then sets the length torchaudio's resample gives. */
static td_status rs_finish(resampler *r) {
  if (!r->sx) return TD_OK;
  TD_TRY(rs_push(r, NULL, 0));
  size_t want = (size_t)(((uint64_t)r->n_in * TD_AUDIO_RATE + (uint64_t)r->rate - 1) / (uint64_t)r->rate);
  if (want > r->n) {
    TD_TRY(grow(r, want - r->n));
    memset(r->out + r->n, 0, (want - r->n) * sizeof *r->out);
  }
  r->n = want;
  return TD_OK;
}

td_status td_audio_resample(const float *in, size_t n, int rate, float **out, size_t *n_out) {
  if (rate < TD_AUDIO_MIN_RATE || rate > TD_AUDIO_MAX_RATE)
    return td_err(TD_ERR_INVALID, "audio: sample rate %d Hz is outside %d..%d Hz", rate, TD_AUDIO_MIN_RATE,
                  TD_AUDIO_MAX_RATE);
  resampler r;
  TD_TRY(rs_init(&r, rate, n));
  td_status s = rs_push(&r, in, n);
  if (s == TD_OK) s = rs_finish(&r);
  if (s != TD_OK) {
    rs_free(&r);
    return s;
  }
  if (!r.out) { /* n == 0 at 16 kHz */
    r.out = malloc(sizeof *r.out);
    if (!r.out) return td_err(TD_ERR_NOMEM, "audio: out of memory");
  }
  *out = r.out;
  *n_out = r.n;
  r.out = NULL;
  rs_free(&r);
  return TD_OK;
}

/* ---- libsndfile over memory ---- */

typedef struct membuf {
  const unsigned char *data;
  sf_count_t len, pos;
} membuf;

static sf_count_t mem_len(void *u) { return ((membuf *)u)->len; }

static sf_count_t mem_seek(sf_count_t off, int whence, void *u) {
  membuf *m = u;
  sf_count_t base = whence == SEEK_SET ? 0 : whence == SEEK_CUR ? m->pos : m->len;
  if ((off > 0 && base > INT64_MAX - off) || base + off < 0) return -1;
  m->pos = base + off;
  return m->pos;
}

static sf_count_t mem_read(void *ptr, sf_count_t count, void *u) {
  membuf *m = u;
  if (count <= 0 || m->pos >= m->len) return 0;
  sf_count_t k = m->len - m->pos < count ? m->len - m->pos : count;
  memcpy(ptr, m->data + m->pos, (size_t)k);
  m->pos += k;
  return k;
}

static sf_count_t mem_tell(void *u) { return ((membuf *)u)->pos; }

/* ---- decoding ---- */

static const char *major_name(int major) {
  switch (major) {
    case SF_FORMAT_WAV: return "WAV";
    case SF_FORMAT_WAVEX: return "WAV (extensible)";
    case SF_FORMAT_RF64: return "RF64";
    case SF_FORMAT_FLAC: return "FLAC";
    case SF_FORMAT_OGG: return "OGG";
    default: return NULL; /* not accepted */
  }
}

static void describe(int format, char *out, size_t cap) {
  const char *major = major_name(format & SF_FORMAT_TYPEMASK);
  SF_FORMAT_INFO sub = {.format = format & SF_FORMAT_SUBMASK};
  if (sf_command(NULL, SFC_GET_FORMAT_INFO, &sub, sizeof sub) != 0 || !sub.name) sub.name = "?";
  snprintf(out, cap, "%s %s", major ? major : "?", sub.name);
}

/* libsndfile reads a WAV whose data chunk runs past the end of the file as
 * far as it goes and notes "data : declared (should be present)" in its log;
 * a declared size of 0xFFFFFFFF is the placeholder streamed WAVs carry. */
static bool wav_truncated(SNDFILE *sf, long long *declared, long long *present) {
  char *log = malloc(16384);
  if (!log) return false;
  bool cut = false;
  sf_command(sf, SFC_GET_LOG_INFO, log, 16384);
  for (const char *p = log; (p = strstr(p, "data : ")); p++) {
    if (p != log && p[-1] != '\n') continue;
    if (sscanf(p, "data : %lld (should be %lld)", declared, present) == 2 && *present < *declared &&
        *declared < 0xFFFFFFFFll) {
      cut = true;
      break;
    }
  }
  free(log);
  return cut;
}

static void limits_or_defaults(const td_audio_limits *in, td_audio_limits *out) {
  *out = in ? *in : (td_audio_limits){0};
  if (out->max_seconds <= 0) out->max_seconds = TD_DEFAULT_AUDIO_MAX_SECONDS;
  if (out->max_channels <= 0) out->max_channels = TD_AUDIO_MAX_CHANNELS;
  if (out->min_rate <= 0) out->min_rate = TD_AUDIO_MIN_RATE;
  if (out->max_rate <= 0) out->max_rate = TD_AUDIO_MAX_RATE;
}

static td_status check_header(SNDFILE *sf, const SF_INFO *info, const char *name, const td_audio_limits *lim) {
  int major = info->format & SF_FORMAT_TYPEMASK;
  if (!major_name(major)) {
    SF_FORMAT_INFO fi = {.format = major};
    const char *what = sf_command(NULL, SFC_GET_FORMAT_INFO, &fi, sizeof fi) == 0 && fi.name ? fi.name : "this";
    return td_err(TD_ERR_UNSUPPORTED, "%s: %s audio is not accepted (WAV, FLAC or OGG)", name, what);
  }
  if (info->channels < 1 || info->channels > lim->max_channels)
    return td_err(TD_ERR_INVALID, "%s: %d channels, more than the %d accepted", name, info->channels,
                  lim->max_channels);
  if (info->samplerate < lim->min_rate || info->samplerate > lim->max_rate)
    return td_err(TD_ERR_INVALID, "%s: sample rate %d Hz is outside the accepted %d..%d Hz", name,
                  info->samplerate, lim->min_rate, lim->max_rate);
  if (info->frames <= 0) return td_err(TD_ERR_INVALID, "%s: the audio is empty (no samples)", name);
  bool known = info->frames != SF_COUNT_MAX;
  if (known && (double)info->frames / info->samplerate > lim->max_seconds)
    return td_err(TD_ERR_INVALID, "%s: %.1f s of audio, over the limit of %.1f s", name,
                  (double)info->frames / info->samplerate, lim->max_seconds);
  if (!known && major == SF_FORMAT_OGG)
    return td_err(TD_ERR_FORMAT, "%s: truncated: the OGG stream has no final page", name);
  long long declared, present;
  if ((major == SF_FORMAT_WAV || major == SF_FORMAT_WAVEX || major == SF_FORMAT_RF64) &&
      wav_truncated(sf, &declared, &present))
    return td_err(TD_ERR_FORMAT, "%s: truncated: the data chunk declares %lld bytes, the file holds %lld", name,
                  declared, present);
  return TD_OK;
}

static td_status decode(SNDFILE *sf, const SF_INFO *info, const char *name, const td_audio_limits *given,
                        td_audio *out) {
  td_audio_limits lim;
  limits_or_defaults(given, &lim);
  TD_TRY(check_header(sf, info, name, &lim));
  const int ch = info->channels;
  const double max_frames = floor(lim.max_seconds * info->samplerate);
  bool known = info->frames != SF_COUNT_MAX;
  resampler r;
  TD_TRY(rs_init(&r, info->samplerate, known ? (size_t)info->frames : 0));
  td_status s = TD_OK;
  float *buf = malloc((size_t)READ_FRAMES * (size_t)ch * sizeof *buf);
  float *mono = malloc(READ_FRAMES * sizeof *mono);
  if (!buf || !mono) {
    s = td_err(TD_ERR_NOMEM, "%s: out of memory", name);
    goto out;
  }
  long long total = 0;
  sf_count_t got;
  while ((got = sf_readf_float(sf, buf, READ_FRAMES)) > 0) {
    if ((double)(total + got) > max_frames) {
      s = td_err(TD_ERR_INVALID, "%s: more than %.1f s of audio, the limit", name, lim.max_seconds);
      goto out;
    }
    for (sf_count_t i = 0; i < got; i++) {
      double sum = 0;
      for (int c = 0; c < ch; c++) sum += buf[i * ch + c];
      float v = (float)(sum / ch);
      if (!isfinite(v) || fabsf(v) > TD_AUDIO_MAX_SAMPLE_ABS) {
        s = td_err(TD_ERR_INVALID, "%s: sample %lld is %g, not a finite value within +-%g", name,
                   total + (long long)i, v, TD_AUDIO_MAX_SAMPLE_ABS);
        goto out;
      }
      mono[i] = v;
    }
    total += got;
    if ((s = rs_push(&r, mono, (size_t)got)) != TD_OK) goto out;
  }
  if (sf_error(sf) != SF_ERR_NO_ERROR) {
    s = td_err(TD_ERR_FORMAT, "%s: corrupt: decoding stopped after %lld samples: %s", name, total, sf_strerror(sf));
    goto out;
  }
  if (total == 0) {
    s = td_err(TD_ERR_INVALID, "%s: the audio is empty (no samples)", name);
    goto out;
  }
  if (known && total != info->frames) {
    s = td_err(TD_ERR_FORMAT, "%s: truncated or corrupt: %lld of the %lld samples its header declares", name, total,
               (long long)info->frames);
    goto out;
  }
  if ((s = rs_finish(&r)) != TD_OK) goto out;
  memset(out, 0, sizeof *out);
  out->samples = r.out;
  out->n = r.n;
  r.out = NULL;
  out->source_rate = info->samplerate;
  out->source_channels = ch;
  out->source_seconds = (double)total / info->samplerate;
  describe(info->format, out->format, sizeof out->format);
out:
  free(buf);
  free(mono);
  rs_free(&r);
  return s;
}

static td_status open_failed(const char *name) {
  int e = sf_error(NULL);
  const char *why = sf_strerror(NULL);
  if (e == SF_ERR_UNRECOGNISED_FORMAT)
    return td_err(TD_ERR_UNSUPPORTED, "%s: not audio in a known format (WAV, FLAC or OGG): %s", name, why);
  return td_err(TD_ERR_FORMAT, "%s: unreadable audio: %s", name, why);
}

td_status td_audio_decode_file(const char *path, const td_audio_limits *lim, td_audio *out) {
  struct stat st;
  if (stat(path, &st) != 0)
    return td_err(errno == ENOENT ? TD_ERR_NOT_FOUND : TD_ERR_IO, "%s: %s", path, strerror(errno));
  if (!S_ISREG(st.st_mode)) return td_err(TD_ERR_INVALID, "%s: not a regular file", path);
  SF_INFO info = {0};
  SNDFILE *sf = sf_open(path, SFM_READ, &info);
  if (!sf) return open_failed(path);
  td_status s = decode(sf, &info, path, lim, out);
  sf_close(sf);
  return s;
}

td_status td_audio_decode_memory(const void *data, size_t len, const char *name, const td_audio_limits *lim,
                                 td_audio *out) {
  if (!name) name = "audio";
  if (!data || !len) return td_err(TD_ERR_INVALID, "%s: the upload is empty", name);
  if (len > (size_t)INT64_MAX) return td_err(TD_ERR_INVALID, "%s: too large", name);
  membuf m = {.data = data, .len = (sf_count_t)len};
  SF_VIRTUAL_IO io = {.get_filelen = mem_len, .seek = mem_seek, .read = mem_read, .tell = mem_tell};
  SF_INFO info = {0};
  SNDFILE *sf = sf_open_virtual(&io, SFM_READ, &info, &m);
  if (!sf) return open_failed(name);
  td_status s = decode(sf, &info, name, lim, out);
  sf_close(sf);
  return s;
}

void td_audio_free(td_audio *a) {
  if (!a) return;
  free(a->samples);
  a->samples = NULL;
  a->n = 0;
}
