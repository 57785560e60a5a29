/* Long-form Whisper transcription as a state machine (longform.h). Each
 * step follows transformers' generation_whisper.py: the window loop of
 * generate, generate_with_fallback, _need_fallback, _prepare_decoder_input_ids
 * and _retrieve_segment, down to the float arithmetic of the timestamps. */
#include "frontend/longform.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <zlib.h>

#include "common/defaults.h"

#define TIME_PRECISION 0.02        /* seconds a timestamp token steps */
#define FEATURE_PRECISION 0.01     /* seconds a mel frame spans (hop 160 at 16 kHz) */

typedef struct seg {
  double start, end;
  int32_t *tok;
  int n;
  int seek;
  float temperature;
  double avg_logprob, compression_ratio, no_speech_prob;
} seg;

struct td_longform {
  td_longform_opts o;
  int32_t *prompt_ids;
  int total;            /* mel frames of the audio */
  int seek;
  int windows, decodes, skipped;
  bool condition;       /* the next window takes the earlier tokens as its prompt */
  /* the window being decoded */
  bool in_window, pending;
  int attempt, n_frames;
  int32_t *prompt;
  int n_prompt, probe_pos;
  double no_speech_prob; /* probed on the window's first attempt */
  /* segments; segs[0] is the client's prompt when prompt_seg */
  seg *segs;
  int n_segs, cap_segs;
  bool prompt_seg;
  td_longform_segment *view;
};

static int cut_off(const td_longform_opts *o) { return o->max_target_positions / 2 - 1; }

/* The longest decoder prompt a window can have. */
static int longest_prompt(const td_longform_opts *o) {
  bool prev = o->condition_on_prev_tokens || o->n_prompt_ids > 0;
  return (prev ? (o->prev_sot >= 0) + cut_off(o) : 0) + o->n_init;
}

static bool in_vocab(const td_longform_opts *o, int32_t id) { return id >= 0 && id < o->vocab_size; }

td_status td_longform_check(const td_longform_opts *o) {
  if (o->window_frames <= 0 || o->input_stride <= 0 || o->window_frames % o->input_stride)
    return td_err(TD_ERR_INVALID, "long-form: a window of %d frames with an input stride of %d", o->window_frames,
                  o->input_stride);
  if (o->vocab_size <= 0 || o->vocab_size > (1 << 24))
    return td_err(TD_ERR_INVALID, "long-form: a vocabulary of %d", o->vocab_size);
  if (!in_vocab(o, o->timestamp_begin) || !in_vocab(o, o->eos) || (o->prev_sot != -1 && !in_vocab(o, o->prev_sot)))
    return td_err(TD_ERR_INVALID, "long-form: <|0.00|> %d, EOS %d or <|startofprev|> %d outside the vocabulary of %d",
                  o->timestamp_begin, o->eos, o->prev_sot, o->vocab_size);
  if (o->n_init < 1 || o->n_init > TD_LONGFORM_MAX_INIT)
    return td_err(TD_ERR_INVALID, "long-form: %d decoder prompt ids (1 to %d)", o->n_init, TD_LONGFORM_MAX_INIT);
  for (int i = 0; i < o->n_init; i++)
    if (!in_vocab(o, o->init[i])) return td_err(TD_ERR_INVALID, "long-form: prompt id %d outside the vocabulary", o->init[i]);
  if (o->n_prompt_ids < 0 || (o->n_prompt_ids && !o->prompt_ids) || o->n_prompt_ids > cut_off(o))
    return td_err(TD_ERR_INVALID, "prompt: %d tokens, at most %d for this model", o->n_prompt_ids, cut_off(o));
  for (int i = 0; i < o->n_prompt_ids; i++)
    if (!in_vocab(o, o->prompt_ids[i]))
      return td_err(TD_ERR_INVALID, "prompt: token %d outside the vocabulary", o->prompt_ids[i]);
  if (o->n_temperatures < 1 || o->n_temperatures > TD_LONGFORM_MAX_TEMPERATURES)
    return td_err(TD_ERR_INVALID, "temperature: %d temperatures to fall back through (1 to %d)", o->n_temperatures,
                  TD_LONGFORM_MAX_TEMPERATURES);
  for (int i = 0; i < o->n_temperatures; i++)
    if (!(o->temperatures[i] >= 0 && o->temperatures[i] <= 1))
      return td_err(TD_ERR_INVALID, "temperature: %g is outside [0, 1]", (double)o->temperatures[i]);
  if (o->has_compression_ratio_threshold &&
      !(o->compression_ratio_threshold > 0 && o->compression_ratio_threshold <= 1000))
    return td_err(TD_ERR_INVALID, "compression_ratio_threshold: %g; a ratio in (0, 1000] (at 0 every window would "
                  "be decoded again)", o->compression_ratio_threshold);
  if (o->has_logprob_threshold && !(o->logprob_threshold <= 0 && o->logprob_threshold >= -1e4))
    return td_err(TD_ERR_INVALID, "logprob_threshold: %g; an average log-probability in [-10000, 0] (above 0 every "
                  "window would be decoded again)", o->logprob_threshold);
  if (o->has_no_speech_threshold && !(o->no_speech_threshold >= 0 && o->no_speech_threshold <= 1))
    return td_err(TD_ERR_INVALID, "no_speech_threshold: %g is not a probability in [0, 1]", o->no_speech_threshold);
  if (o->has_no_speech_threshold && !o->has_logprob_threshold)
    return td_err(TD_ERR_INVALID, "no_speech_threshold needs logprob_threshold: a window is skipped when both say so");
  if (o->has_no_speech_threshold && !in_vocab(o, o->no_speech))
    return td_err(TD_ERR_INVALID, "no_speech_threshold: <|nospeech|> %d is outside the vocabulary", o->no_speech);
  if (o->max_new_tokens < 0) return td_err(TD_ERR_INVALID, "max_new_tokens %d: at least 0", o->max_new_tokens);
  int longest = longest_prompt(o), need = o->max_new_tokens > 0 ? o->max_new_tokens : 1;
  if (longest + need > o->max_target_positions)
    return td_err(TD_ERR_INVALID,
                  "max_new_tokens %d: with the longest window prompt (%d tokens) it exceeds the model's %d positions",
                  need, longest, o->max_target_positions);
  return TD_OK;
}

/* A threshold: its default, off, or the client's. */
static void threshold(const td_opt_num *x, double dflt, bool *has, double *v) {
  *has = !x->given || !x->off;
  *v = x->given && !x->off ? x->v : dflt;
}

td_status td_longform_apply(const td_longform_settings *s, float temperature, td_longform_opts *o) {
  double step = TD_LONGFORM_TEMPERATURE_STEP;
  if (s->temperature_increment.given) step = s->temperature_increment.off ? 0 : s->temperature_increment.v;
  if (!(step >= 0 && step <= 1))
    return td_err(TD_ERR_INVALID, "temperature_increment_on_fallback: %g; in [0, 1] (0: no fallback)", step);
  if (!(temperature >= 0 && temperature <= 1))
    return td_err(TD_ERR_INVALID, "temperature: %g is outside [0, 1]", (double)temperature);
  int n = 0;
  for (double t = temperature; n == 0 || (step > 0 && t < 1.0 + 1e-6); t = temperature + step * n) {
    if (n == TD_LONGFORM_MAX_TEMPERATURES)
      return td_err(TD_ERR_INVALID,
                    "temperature_increment_on_fallback: %g from temperature %g gives more than %d temperatures", step,
                    (double)temperature, TD_LONGFORM_MAX_TEMPERATURES);
    o->temperatures[n++] = (float)t;
  }
  o->n_temperatures = n;
  threshold(&s->compression_ratio_threshold, TD_LONGFORM_COMPRESSION_RATIO, &o->has_compression_ratio_threshold,
            &o->compression_ratio_threshold);
  threshold(&s->logprob_threshold, TD_LONGFORM_LOGPROB, &o->has_logprob_threshold, &o->logprob_threshold);
  threshold(&s->no_speech_threshold, TD_LONGFORM_NO_SPEECH, &o->has_no_speech_threshold, &o->no_speech_threshold);
  o->condition_on_prev_tokens = s->condition_given ? s->condition_on_previous_text : true;
  return TD_OK;
}

td_status td_longform_create(const td_longform_opts *o, int total_frames, td_longform **out) {
  *out = NULL;
  TD_TRY(td_longform_check(o));
  if (total_frames <= 0) return td_err(TD_ERR_INVALID, "long-form: %d frames of audio", total_frames);
  td_longform *lf = calloc(1, sizeof *lf);
  size_t longest = (size_t)longest_prompt(o) + (size_t)o->n_prompt_ids + 1;
  if (!lf || !(lf->prompt = malloc(sizeof *lf->prompt * longest)) ||
      (o->n_prompt_ids && !(lf->prompt_ids = malloc(sizeof *lf->prompt_ids * (size_t)o->n_prompt_ids)))) {
    td_longform_destroy(lf);
    return td_err(TD_ERR_NOMEM, "out of memory");
  }
  lf->o = *o;
  if (o->n_prompt_ids) memcpy(lf->prompt_ids, o->prompt_ids, sizeof *lf->prompt_ids * (size_t)o->n_prompt_ids);
  lf->o.prompt_ids = lf->prompt_ids;
  lf->total = total_frames;
  lf->condition = o->condition_on_prev_tokens;
  /* transformers' "first-segment" prompt: a segment before the first window's */
  if (o->n_prompt_ids) {
    lf->segs = calloc(4, sizeof *lf->segs);
    if (!lf->segs || !(lf->segs[0].tok = malloc(sizeof(int32_t) * (size_t)o->n_prompt_ids))) {
      td_longform_destroy(lf);
      return td_err(TD_ERR_NOMEM, "out of memory");
    }
    memcpy(lf->segs[0].tok, o->prompt_ids, sizeof(int32_t) * (size_t)o->n_prompt_ids);
    lf->segs[0].n = o->n_prompt_ids;
    lf->n_segs = 1;
    lf->cap_segs = 4;
    lf->prompt_seg = true;
  }
  *out = lf;
  return TD_OK;
}

void td_longform_destroy(td_longform *lf) {
  if (!lf) return;
  for (int i = 0; i < lf->n_segs; i++) free(lf->segs[i].tok);
  free(lf->segs);
  free(lf->view);
  free(lf->prompt);
  free(lf->prompt_ids);
  free(lf);
}

/* _prepare_decoder_input_ids for one audio. */
static void build_prompt(td_longform *lf) {
  const td_longform_opts *o = &lf->o;
  int n = 0;
  if (lf->condition && lf->n_segs > 0) {
    /* a segment ending in two timestamps gives its last one up for good
     * (transformers edits its segments here, the returned ones included) */
    for (int i = 0; i < lf->n_segs; i++)
      if (lf->segs[i].n > 2 && lf->segs[i].tok[lf->segs[i].n - 2] >= o->timestamp_begin) {
        lf->segs[i].n--;
        if (lf->view && i >= lf->prompt_seg) lf->view[i - lf->prompt_seg].n_tokens = lf->segs[i].n;
      }
    if (o->prev_sot >= 0) lf->prompt[n++] = o->prev_sot;
    /* the last cut_off tokens of every segment so far */
    int want = cut_off(o), have = 0, first = lf->n_segs;
    while (first > 0 && have < want) have += lf->segs[--first].n;
    int skip = have > want ? have - want : 0;
    for (int i = first; i < lf->n_segs; i++) {
      int from = i == first ? skip : 0;
      memcpy(lf->prompt + n, lf->segs[i].tok + from, sizeof(int32_t) * (size_t)(lf->segs[i].n - from));
      n += lf->segs[i].n - from;
    }
  } else if (o->n_prompt_ids) {
    if (o->prev_sot >= 0) lf->prompt[n++] = o->prev_sot;
    memcpy(lf->prompt + n, o->prompt_ids, sizeof(int32_t) * (size_t)o->n_prompt_ids);
    n += o->n_prompt_ids;
  }
  memcpy(lf->prompt + n, o->init, sizeof(int32_t) * (size_t)o->n_init);
  lf->n_prompt = n + o->n_init;
  /* WhisperNoSpeechDetection: the logits after <|startoftranscript|> */
  lf->probe_pos = lf->n_prompt - o->n_init;
}

bool td_longform_next(td_longform *lf, td_longform_window *w) {
  const td_longform_opts *o = &lf->o;
  if (!lf->in_window) {
    if (lf->seek >= lf->total) return false;
    lf->n_frames = lf->total - lf->seek < o->window_frames ? lf->total - lf->seek : o->window_frames;
    build_prompt(lf);
    lf->in_window = true;
    lf->attempt = 0;
    lf->no_speech_prob = NAN;
    lf->windows++;
  }
  lf->pending = true;
  *w = (td_longform_window){.index = lf->windows - 1, .attempt = lf->attempt, .seek = lf->seek,
                            .n_frames = lf->n_frames, .prompt = lf->prompt, .n_prompt = lf->n_prompt,
                            .temperature = o->temperatures[lf->attempt], .probe_position = -1, .probe_token = -1,
                            .want_logprobs = true};
  int max_new = o->max_target_positions - lf->n_prompt;
  w->max_new_tokens = o->max_new_tokens > 0 && o->max_new_tokens < max_new ? o->max_new_tokens : max_new;
  /* the probability is the same at every temperature: the first attempt asks it */
  if (o->has_no_speech_threshold && lf->attempt == 0) {
    w->probe_position = lf->probe_pos;
    w->probe_token = o->no_speech;
  }
  return true;
}

double td_longform_compression_ratio(const int32_t *tokens, int n, int32_t vocab_size) {
  int width = (int)(log2((double)vocab_size) / 8) + 1;
  size_t raw = (size_t)n * (size_t)width;
  uint8_t *b = malloc(raw ? raw : 1);
  uLongf cap = compressBound((uLong)raw);
  uint8_t *z = malloc(cap);
  double r = NAN;
  if (b && z) {
    for (int i = 0; i < n; i++)
      for (int k = 0; k < width; k++) b[(size_t)i * width + k] = (uint8_t)((uint32_t)tokens[i] >> (8 * k));
    if (compress2(z, &cap, b, (uLong)raw, Z_DEFAULT_COMPRESSION) == Z_OK) r = (double)raw / (double)cap;
  }
  free(b);
  free(z);
  return r;
}

static td_status add_seg(td_longform *lf, double start, double end, const int32_t *tok, int n, float temp,
                         double avg, double cr) {
  if (lf->n_segs == lf->cap_segs) {
    int c = lf->cap_segs ? 2 * lf->cap_segs : 8;
    seg *s = realloc(lf->segs, sizeof *s * (size_t)c);
    if (!s) return td_err(TD_ERR_NOMEM, "out of memory");
    lf->segs = s;
    lf->cap_segs = c;
  }
  seg *s = &lf->segs[lf->n_segs];
  *s = (seg){.start = start, .end = end, .n = n, .seek = lf->seek, .temperature = temp, .avg_logprob = avg,
             .compression_ratio = cr, .no_speech_prob = lf->no_speech_prob};
  if (!(s->tok = malloc(sizeof(int32_t) * (size_t)(n ? n : 1)))) return td_err(TD_ERR_NOMEM, "out of memory");
  if (n) memcpy(s->tok, tok, sizeof(int32_t) * (size_t)n);
  lf->n_segs++;
  return TD_OK;
}

/* _retrieve_segment: the window's segments, and the frames to seek by. */
static td_status retrieve(td_longform *lf, const int32_t *t, int n, float temp, double avg, double cr, int *offset) {
  const td_longform_opts *o = &lf->o;
  int32_t tb = o->timestamp_begin;
  double time_offset = (double)lf->seek * TIME_PRECISION / (double)o->input_stride;
  bool single_ending = n >= 2 && t[n - 2] < tb && t[n - 1] >= tb;
  int n_pairs = 0;
  for (int i = 0; i + 1 < n; i++) n_pairs += t[i] >= tb && t[i + 1] >= tb;
  if (n_pairs) {
    int last = 0, k = 0;
    for (int i = 0; i + 1 < n; i++) {
      if (!(t[i] >= tb && t[i + 1] >= tb)) continue;
      bool final = ++k == n_pairs;
      /* each pair closes a segment at its second timestamp; the last one,
       * unless the output ends in a single timestamp, keeps that timestamp
       * too and ends at the first (the text after it is dropped) */
      int to = final && !single_ending ? i + 2 : i + 1;
      int end_at = final && !single_ending ? to - 2 : to - 1;
      TD_TRY(add_seg(lf, time_offset + (double)(t[last] - tb) * TIME_PRECISION,
                     time_offset + (double)(t[end_at] - tb) * TIME_PRECISION, t + last, to - last, temp, avg, cr));
      last = to;
    }
    if (single_ending) {
      /* the rest, up to the final timestamp: no speech after it */
      TD_TRY(add_seg(lf, time_offset + (double)(t[last] - tb) * TIME_PRECISION,
                     time_offset + (double)(t[n - 1] - tb) * TIME_PRECISION, t + last, n - last, temp, avg, cr));
      *offset = lf->n_frames;
    } else {
      *offset = (t[last - 2] - tb) * o->input_stride;
    }
    return TD_OK;
  }
  /* no pair: the whole output is one segment to the window's end, or to its
   * last timestamp; transformers computes the window's end in float32 */
  volatile float frames = (float)lf->n_frames;
  volatile float secs = frames * (float)FEATURE_PRECISION;
  double end_pos = (double)(int)(secs / (float)TIME_PRECISION);
  int32_t last_ts = -1;
  for (int i = 0; i < n; i++)
    if (t[i] >= tb) last_ts = t[i];
  if (last_ts >= 0 && last_ts != tb) end_pos = (double)(last_ts - tb);
  TD_TRY(add_seg(lf, time_offset, time_offset + end_pos * TIME_PRECISION, t, n, temp, avg, cr));
  *offset = lf->n_frames;
  return TD_OK;
}

static td_status rebuild_view(td_longform *lf) {
  free(lf->view);
  int first = lf->prompt_seg, n = lf->n_segs - first;
  lf->view = n > 0 ? malloc(sizeof *lf->view * (size_t)n) : NULL;
  if (n > 0 && !lf->view) return td_err(TD_ERR_NOMEM, "out of memory");
  for (int i = 0; i < n; i++) {
    const seg *s = &lf->segs[first + i];
    lf->view[i] = (td_longform_segment){.start = s->start, .end = s->end, .tokens = s->tok, .n_tokens = s->n,
                                        .seek = s->seek, .temperature = s->temperature,
                                        .avg_logprob = s->avg_logprob, .compression_ratio = s->compression_ratio,
                                        .no_speech_prob = s->no_speech_prob};
  }
  return TD_OK;
}

td_status td_longform_feed(td_longform *lf, const int32_t *tokens, int n, const float *logprobs, double probe_prob) {
  const td_longform_opts *o = &lf->o;
  if (!lf->pending) return td_err(TD_ERR_INVALID, "long-form: an outcome fed with no decode asked for");
  if (n < 0 || (n && !tokens)) return td_err(TD_ERR_INVALID, "long-form: %d tokens", n);
  if (o->has_logprob_threshold && n && !logprobs)
    return td_err(TD_ERR_INVALID, "long-form: the window's log-probabilities are needed (logprob_threshold)");
  if (o->has_no_speech_threshold && lf->attempt == 0) {
    if (isnan(probe_prob)) return td_err(TD_ERR_INVALID, "long-form: the window's no-speech probability is missing");
    lf->no_speech_prob = probe_prob;
  }
  lf->pending = false;
  lf->decodes++;
  float temp = o->temperatures[lf->attempt];
  /* _need_fallback, over the tokens with their EOS */
  double cr = td_longform_compression_ratio(tokens, n, o->vocab_size);
  double sum = 0;
  for (int i = 0; logprobs && i < n; i++) sum += logprobs[i];
  double avg = logprobs && n ? sum / n : NAN;
  bool again = false, skip = false;
  if (o->has_compression_ratio_threshold && cr > o->compression_ratio_threshold) again = true;
  if (o->has_logprob_threshold && avg < o->logprob_threshold) again = true;
  if (o->has_no_speech_threshold && avg < o->logprob_threshold && lf->no_speech_prob > o->no_speech_threshold) {
    again = false;
    skip = true;
  }
  if (n && tokens[n - 1] == o->eos) n--;
  lf->condition = o->condition_on_prev_tokens && temp < 0.5f;
  if (again && lf->attempt + 1 < o->n_temperatures) {
    lf->attempt++;
    return TD_OK; /* the same window at the next temperature */
  }
  lf->in_window = false;
  int offset = lf->n_frames;
  if (skip) {
    lf->skipped++;
  } else {
    td_status s = retrieve(lf, tokens, n, temp, avg, cr, &offset);
    if (s == TD_OK) s = rebuild_view(lf);
    if (s != TD_OK) return s;
  }
  /* a window that would not move would be decoded forever: it moves by itself */
  lf->seek += offset > 0 ? offset : lf->n_frames;
  return TD_OK;
}

const td_longform_segment *td_longform_segments(const td_longform *lf, int *n) {
  *n = lf->view ? lf->n_segs - lf->prompt_seg : 0;
  return lf->view;
}

void td_longform_counts(const td_longform *lf, int *windows, int *decodes, int *skipped) {
  *windows = lf->windows;
  *decodes = lf->decodes;
  *skipped = lf->skipped;
}

void td_longform_window_features(const float *whole, int n_mels, int total_frames, int seek, int n_frames,
                                 int window_frames, float *out) {
  for (int m = 0; m < n_mels; m++) {
    float *row = out + (size_t)m * window_frames;
    memcpy(row, whole + (size_t)m * total_frames + seek, sizeof(float) * (size_t)n_frames);
    memset(row + n_frames, 0, sizeof(float) * (size_t)(window_frames - n_frames));
  }
}
