/* Long-form transcription's window loop (frontend/longform.h) on fixed
 * token sequences, as transformers' generate would treat them: segments
 * from timestamp pairs, a trailing single timestamp, no timestamps, the
 * seek, temperature fallback, the no-speech skip, the previous windows'
 * tokens as the prompt, and every limit refused. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "frontend/longform.h"

#define TB 50365  /* <|0.00|> */
#define EOS 50257
#define PREV 50362
#define NOSPEECH 50363
#define SOT 50258
#define EN 50259
#define TRANSCRIBE 50360
#define T(x) (TB + (x)) /* a timestamp, in 0.02 s steps */

/* The toy checkpoint's shape: a 4 s window (400 frames), 64 positions. */
static td_longform_opts opts(void) {
  td_longform_opts o = {.window_frames = 400, .input_stride = 2, .max_target_positions = 64, .vocab_size = 51866,
                        .timestamp_begin = TB, .eos = EOS, .no_speech = NOSPEECH, .prev_sot = PREV,
                        .init = {SOT, EN, TRANSCRIBE}, .n_init = 3, .temperatures = {0.0f}, .n_temperatures = 1};
  return o;
}

static td_longform *make(const td_longform_opts *o, int frames) {
  td_longform *lf = NULL;
  cr_assert_eq(td_longform_create(o, frames, &lf), TD_OK, "%s", td_errmsg());
  return lf;
}

static td_longform_window next(td_longform *lf) {
  td_longform_window w;
  cr_assert(td_longform_next(lf, &w), "the transcription ended early");
  return w;
}

/* Feeds tokens with every log-probability lp and no-speech probability ns. */
static void feed(td_longform *lf, const int32_t *t, int n, float lp, double ns) {
  float l[64];
  for (int i = 0; i < n; i++) l[i] = lp;
  cr_assert_eq(td_longform_feed(lf, t, n, l, ns), TD_OK, "%s", td_errmsg());
}

static void seg_is(const td_longform_segment *s, double start, double end, const int32_t *tok, int n) {
  cr_expect(fabs(s->start - start) < 1e-9, "start %.17g, expected %.17g", s->start, start);
  cr_expect(fabs(s->end - end) < 1e-9, "end %.17g, expected %.17g", s->end, end);
  cr_assert_eq(s->n_tokens, n, "%d tokens, expected %d", s->n_tokens, n);
  cr_expect_arr_eq(s->tokens, tok, sizeof(int32_t) * (size_t)n);
}

Test(longform, timestamp_pairs_seek_to_the_last_one) {
  td_longform_opts o = opts();
  td_longform *lf = make(&o, 1000);
  td_longform_window w = next(lf);
  cr_expect_eq(w.seek, 0);
  cr_expect_eq(w.n_frames, 400);
  int32_t init[3] = {SOT, EN, TRANSCRIBE};
  cr_assert_eq(w.n_prompt, 3);
  cr_expect_arr_eq(w.prompt, init, sizeof init);
  cr_expect_eq(w.max_new_tokens, 61, "the positions the prompt leaves");
  cr_expect_eq(w.probe_position, -1, "no no-speech threshold: nothing probed");
  /* <|0.00|> a b <|1.00|><|1.00|> c <|1.50|><|1.50|> d: the text after the last pair is cut off */
  int32_t out[] = {T(0), 7, 8, T(50), T(50), 9, T(75), T(75), 10};
  feed(lf, out, 9, -0.1f, NAN);
  int n;
  const td_longform_segment *s = td_longform_segments(lf, &n);
  cr_assert_eq(n, 2);
  seg_is(&s[0], 0.0, 1.0, out, 4);
  seg_is(&s[1], 1.0, 1.5, out + 4, 4); /* ends at the pair's first; keeps its second */
  w = next(lf);
  cr_expect_eq(w.seek, 150, "seek to <|1.50|>: 75 steps of 2 frames");
  cr_expect_eq(w.index, 1);
  td_longform_destroy(lf);
}

Test(longform, a_single_timestamp_at_the_end_seeks_by_the_window) {
  td_longform_opts o = opts();
  td_longform *lf = make(&o, 1000);
  next(lf);
  int32_t out[] = {T(0), 7, T(40), T(40), 8, T(90), EOS};
  feed(lf, out, 7, -0.1f, NAN);
  int n;
  const td_longform_segment *s = td_longform_segments(lf, &n);
  cr_assert_eq(n, 2);
  seg_is(&s[0], 0.0, 0.8, out, 3);
  seg_is(&s[1], 0.8, 1.8, out + 3, 3); /* EOS not kept */
  td_longform_window w = next(lf);
  cr_expect_eq(w.seek, 400);
  /* a segment in the second window starts at its offset */
  int32_t out2[] = {T(10), 9, T(20), EOS};
  feed(lf, out2, 4, -0.1f, NAN);
  s = td_longform_segments(lf, &n);
  cr_assert_eq(n, 3);
  seg_is(&s[2], 4.0, 4.0 + 0.4, out2, 3); /* no pair: from the window's start */
  td_longform_destroy(lf);
}

Test(longform, no_timestamps_make_one_segment_to_the_window_end) {
  td_longform_opts o = opts();
  td_longform *lf = make(&o, 637); /* a window, then 237 frames */
  next(lf);
  int32_t plain[] = {7, 8, EOS};
  feed(lf, plain, 3, -0.1f, NAN);
  td_longform_window w = next(lf);
  cr_expect_eq(w.seek, 400);
  cr_expect_eq(w.n_frames, 237);
  /* only <|0.00|>: the window's end, which transformers computes in float32 (237 x 0.01 / 0.02 -> 118) */
  int32_t zero[] = {T(0), 9, EOS};
  feed(lf, zero, 3, -0.1f, NAN);
  cr_expect(!td_longform_next(lf, &w), "the audio is done");
  int n;
  const td_longform_segment *s = td_longform_segments(lf, &n);
  cr_assert_eq(n, 2);
  seg_is(&s[0], 0.0, 200 * 0.02, plain, 2);
  seg_is(&s[1], 4.0, 4.0 + 118 * 0.02, zero, 2);
  td_longform_destroy(lf);
  /* one timestamp past <|0.00|> and no pair: the segment ends there */
  lf = make(&o, 1000);
  next(lf);
  int32_t one[] = {T(1096), EOS};
  feed(lf, one, 2, -3.0f, NAN);
  s = td_longform_segments(lf, &n);
  cr_assert_eq(n, 1);
  seg_is(&s[0], 0.0, 1096 * 0.02, one, 1);
  w = next(lf);
  cr_expect_eq(w.seek, 400);
  td_longform_destroy(lf);
}

/* transformers computes a short window's end as int(float32(frames) * 0.01f / 0.02f):
 * 14 steps for 30 frames where float64 gives 15. */
Test(longform, the_window_end_in_float32) {
  td_longform_opts o = opts();
  const int frames[] = {30, 54, 58, 60, 116, 118, 120, 1, 399};
  const int steps[] = {14, 26, 29, 29, 58, 59, 59, 0, 199};
  for (size_t k = 0; k < sizeof frames / sizeof *frames; k++) {
    td_longform *lf = make(&o, 400 + frames[k]);
    next(lf);
    int32_t plain[] = {7, EOS};
    feed(lf, plain, 2, 0, NAN);
    next(lf);
    feed(lf, plain, 2, 0, NAN);
    int n;
    const td_longform_segment *s = td_longform_segments(lf, &n);
    cr_assert_eq(n, 2);
    double want = 4.0 + steps[k] * 0.02;
    cr_expect(fabs(s[1].end - want) < 1e-12, "%d frames: end %.17g, expected %.17g", frames[k], s[1].end, want);
    td_longform_destroy(lf);
  }
}

Test(longform, fallback_on_compression_ratio_or_logprob) {
  td_longform_opts o = opts();
  float ladder[] = {0.0f, 0.2f, 0.4f, 0.6f, 0.8f, 1.0f};
  memcpy(o.temperatures, ladder, sizeof ladder);
  o.n_temperatures = 6;
  o.has_compression_ratio_threshold = true;
  o.compression_ratio_threshold = 1.35;
  o.has_logprob_threshold = true;
  o.logprob_threshold = -1.0;
  td_longform *lf = make(&o, 800);
  td_longform_window w = next(lf);
  cr_expect_eq(w.temperature, 0.0f);
  /* a loop: zlib squeezes it (4.67, as Python's zlib.compress gives it) */
  int32_t loop[42];
  loop[0] = T(0);
  for (int i = 0; i < 20; i++) loop[1 + 2 * i] = 1017, loop[2 + 2 * i] = 2009;
  loop[41] = EOS;
  cr_expect(fabs(td_longform_compression_ratio(loop, 42, 51866) - 4.666666666666667) < 1e-12);
  feed(lf, loop, 42, -0.1f, NAN);
  w = next(lf);
  cr_expect_eq(w.index, 0, "the same window again");
  cr_expect_eq(w.attempt, 1);
  cr_expect_eq(w.temperature, 0.2f);
  cr_expect_eq(w.seek, 0);
  /* not repetitive (0.846), but unlikely */
  int32_t unlikely[] = {T(0), 1017, 2009, 22, T(100), T(100), 1017, 2009, 22, T(200), EOS};
  cr_expect(fabs(td_longform_compression_ratio(unlikely, 11, 51866) - 0.8461538461538461) < 1e-12);
  feed(lf, unlikely, 11, -1.5f, NAN);
  w = next(lf);
  cr_expect_eq(w.attempt, 2);
  cr_expect(fabs(w.temperature - 0.4f) < 1e-7);
  feed(lf, unlikely, 11, -0.5f, NAN); /* good enough */
  int n;
  const td_longform_segment *s = td_longform_segments(lf, &n);
  cr_assert_eq(n, 2);
  cr_expect(fabs(s[0].temperature - 0.4f) < 1e-7);
  cr_expect(fabs(s[0].avg_logprob + 0.5) < 1e-6);
  w = next(lf);
  cr_expect_eq(w.index, 1);
  cr_expect_eq(w.attempt, 0, "a new window starts at the first temperature");
  cr_expect_eq(w.seek, 400, "a single timestamp at the end: the whole window");
  /* the last rung is taken whatever it gives */
  for (int k = 0; k < 6; k++) {
    w = next(lf);
    cr_expect_eq(w.attempt, k);
    feed(lf, loop, 42, -5.0f, NAN);
  }
  int windows, decodes, skipped;
  td_longform_counts(lf, &windows, &decodes, &skipped);
  cr_expect_eq(windows, 2);
  cr_expect_eq(decodes, 3 + 6);
  cr_expect(!td_longform_next(lf, &w));
  s = td_longform_segments(lf, &n);
  cr_assert_eq(n, 3);
  cr_expect_eq(s[2].temperature, 1.0f);
  td_longform_destroy(lf);
}

Test(longform, no_speech_skips_the_window) {
  td_longform_opts o = opts();
  o.has_logprob_threshold = true;
  o.logprob_threshold = -1.0;
  o.has_no_speech_threshold = true;
  o.no_speech_threshold = 0.6;
  float ladder[] = {0.0f, 0.5f};
  memcpy(o.temperatures, ladder, sizeof ladder);
  o.n_temperatures = 2;
  td_longform *lf = make(&o, 1200);
  td_longform_window w = next(lf);
  cr_expect_eq(w.probe_position, 0, "<|startoftranscript|>'s logits");
  cr_expect_eq(w.probe_token, NOSPEECH);
  int32_t out[] = {T(0), 7, T(10), EOS};
  /* unlikely and no speech: skipped, no fallback */
  feed(lf, out, 4, -2.0f, 0.9);
  w = next(lf);
  cr_expect_eq(w.seek, 400);
  cr_expect_eq(w.attempt, 0);
  /* likely: kept whatever the no-speech probability */
  feed(lf, out, 4, -0.2f, 0.9);
  w = next(lf);
  cr_expect_eq(w.seek, 800);
  /* unlikely, speech: falls back; the second attempt asks no probability */
  feed(lf, out, 4, -2.0f, 0.1);
  w = next(lf);
  cr_expect_eq(w.attempt, 1);
  cr_expect_eq(w.probe_position, -1);
  feed(lf, out, 4, -2.0f, NAN);
  cr_expect(!td_longform_next(lf, &w));
  int n, windows, decodes, skipped;
  const td_longform_segment *s = td_longform_segments(lf, &n);
  cr_assert_eq(n, 2);
  cr_expect(fabs(s[0].no_speech_prob - 0.9) < 1e-12);
  cr_expect(fabs(s[1].no_speech_prob - 0.1) < 1e-12, "the window's first attempt's");
  cr_expect(fabs(s[1].start - 8.0) < 1e-12);
  td_longform_counts(lf, &windows, &decodes, &skipped);
  cr_expect_eq(windows, 3);
  cr_expect_eq(decodes, 4);
  cr_expect_eq(skipped, 1);
  /* a probe is needed on a first attempt */
  td_longform_destroy(lf);
  lf = make(&o, 1200);
  next(lf);
  cr_expect_eq(td_longform_feed(lf, out, 4, NULL, 0.5), TD_ERR_INVALID, "no log-probabilities");
  cr_expect_eq(td_longform_feed(lf, out, 4, (float[4]){0}, NAN), TD_ERR_INVALID);
  cr_expect(strstr(td_errmsg(), "no-speech probability"), "%s", td_errmsg());
  td_longform_destroy(lf);
}

Test(longform, previous_tokens_as_the_prompt) {
  td_longform_opts o = opts();
  o.condition_on_prev_tokens = true;
  o.has_no_speech_threshold = true;
  o.no_speech_threshold = 0.6;
  o.has_logprob_threshold = true;
  o.logprob_threshold = -1.0;
  float ladder[] = {0.0f, 0.6f};
  memcpy(o.temperatures, ladder, sizeof ladder);
  o.n_temperatures = 2;
  td_longform *lf = make(&o, 2000);
  next(lf);
  /* ends in a pair: its last timestamp is dropped from the prompt and the segment */
  int32_t a[] = {T(0), 7, 8, T(50), T(50), 9, T(75), T(75), 10};
  feed(lf, a, 9, -0.1f, 0.0);
  td_longform_window w = next(lf);
  int32_t want[] = {PREV, T(0), 7, 8, T(50), T(50), 9, T(75), SOT, EN, TRANSCRIBE};
  cr_assert_eq(w.n_prompt, 11);
  cr_expect_arr_eq(w.prompt, want, sizeof want);
  cr_expect_eq(w.probe_position, 8, "<|startoftranscript|> after the previous tokens");
  cr_expect_eq(w.max_new_tokens, 64 - 11);
  int n;
  const td_longform_segment *s = td_longform_segments(lf, &n);
  cr_assert_eq(n, 2);
  cr_expect_eq(s[1].n_tokens, 3, "transformers edits the segment itself");
  /* long outputs: the prompt keeps the last 31 (64 / 2 - 1) tokens */
  int32_t longer[40];
  longer[0] = T(0);
  for (int i = 1; i < 39; i++) longer[i] = 100 + i;
  longer[39] = T(190);
  feed(lf, longer, 40, -0.1f, 0.0);
  w = next(lf);
  cr_assert_eq(w.n_prompt, 1 + 31 + 3);
  cr_expect_eq(w.prompt[0], PREV);
  cr_expect_arr_eq(w.prompt + 1, longer + 9, sizeof(int32_t) * 31);
  /* a window settled at temperature 0.6: the next one is not conditioned */
  int32_t c[] = {T(0), 7, T(10), EOS};
  feed(lf, c, 4, -3.0f, 0.0);
  w = next(lf);
  cr_expect_eq(w.attempt, 1);
  feed(lf, c, 4, -3.0f, 0.0);
  w = next(lf);
  cr_assert_eq(w.n_prompt, 3, "after a hot window: no previous tokens");
  cr_expect_eq(w.probe_position, 0);
  td_longform_destroy(lf);
}

Test(longform, the_client_prompt) {
  td_longform_opts o = opts();
  int32_t p[] = {220, 1017};
  o.prompt_ids = p;
  o.n_prompt_ids = 2;
  /* conditioned: the first window after it, later ones after it and what came */
  o.condition_on_prev_tokens = true;
  td_longform *lf = make(&o, 900);
  td_longform_window w = next(lf);
  int32_t first[] = {PREV, 220, 1017, SOT, EN, TRANSCRIBE};
  cr_assert_eq(w.n_prompt, 6);
  cr_expect_arr_eq(w.prompt, first, sizeof first);
  int32_t a[] = {T(0), 7, T(30), EOS};
  feed(lf, a, 4, -0.1f, NAN);
  w = next(lf);
  int32_t second[] = {PREV, 220, 1017, T(0), 7, T(30), SOT, EN, TRANSCRIBE};
  cr_assert_eq(w.n_prompt, 9);
  cr_expect_arr_eq(w.prompt, second, sizeof second);
  int n;
  td_longform_segments(lf, &n);
  cr_expect_eq(n, 1, "the prompt is not a segment of the answer");
  td_longform_destroy(lf);
  /* not conditioned: every window after the prompt */
  o.condition_on_prev_tokens = false;
  lf = make(&o, 900);
  next(lf);
  feed(lf, a, 4, -0.1f, NAN);
  w = next(lf);
  cr_assert_eq(w.n_prompt, 6);
  cr_expect_arr_eq(w.prompt, first, sizeof first);
  td_longform_destroy(lf);
}

Test(longform, a_window_that_would_not_move_moves_by_itself) {
  td_longform_opts o = opts();
  td_longform *lf = make(&o, 900);
  next(lf);
  int32_t stuck[] = {T(0), T(0), 7}; /* a pair at <|0.00|>: transformers would seek by 0 */
  feed(lf, stuck, 3, -0.1f, NAN);
  td_longform_window w = next(lf);
  cr_expect_eq(w.seek, 400);
  td_longform_destroy(lf);
}

Test(longform, window_features_are_sliced_and_padded) {
  float whole[2 * 5] = {1, 2, 3, 4, 5, 10, 20, 30, 40, 50}, out[2 * 4];
  td_longform_window_features(whole, 2, 5, 3, 2, 4, out);
  float want[] = {4, 5, 0, 0, 40, 50, 0, 0};
  cr_expect_arr_eq(out, want, sizeof want);
}

static void refused(td_longform_opts o, const char *says) {
  cr_expect_eq(td_longform_check(&o), TD_ERR_INVALID, "accepted, expected: %s", says);
  cr_expect(strstr(td_errmsg(), says), "\"%s\" does not say \"%s\"", td_errmsg(), says);
  td_longform *lf = NULL;
  cr_expect_neq(td_longform_create(&o, 1000, &lf), TD_OK);
  cr_expect(!lf);
}

Test(longform, limits_refused) {
  td_longform_opts o = opts();
  cr_expect_eq(td_longform_check(&o), TD_OK, "%s", td_errmsg());
  td_longform_opts x = o;
  x.n_temperatures = 0;
  refused(x, "temperatures to fall back through");
  x = o;
  x.n_temperatures = TD_LONGFORM_MAX_TEMPERATURES + 1;
  refused(x, "temperatures to fall back through (1 to 16)");
  x = o;
  x.temperatures[0] = 1.5f;
  refused(x, "temperature: 1.5 is outside [0, 1]");
  x.temperatures[0] = NAN;
  refused(x, "is outside [0, 1]");
  x = o;
  x.has_compression_ratio_threshold = true;
  x.compression_ratio_threshold = 0;
  refused(x, "compression_ratio_threshold: 0");
  x.compression_ratio_threshold = INFINITY;
  refused(x, "compression_ratio_threshold: inf");
  x = o;
  x.has_logprob_threshold = true;
  x.logprob_threshold = 0.5;
  refused(x, "logprob_threshold: 0.5");
  x.logprob_threshold = NAN;
  refused(x, "logprob_threshold: nan");
  x = o;
  x.has_no_speech_threshold = true;
  x.no_speech_threshold = 0.6;
  refused(x, "no_speech_threshold needs logprob_threshold");
  x.has_logprob_threshold = true;
  x.logprob_threshold = -1;
  x.no_speech_threshold = 1.5;
  refused(x, "no_speech_threshold: 1.5 is not a probability");
  x = o;
  x.condition_on_prev_tokens = true;
  x.max_new_tokens = 30; /* 1 + 31 + 3 + 30 > 64 */
  refused(x, "max_new_tokens 30: with the longest window prompt (35 tokens) it exceeds the model's 64 positions");
  x.max_new_tokens = 29;
  cr_expect_eq(td_longform_check(&x), TD_OK, "%s", td_errmsg());
  x = o;
  int32_t p[40] = {0};
  x.prompt_ids = p;
  x.n_prompt_ids = 32;
  refused(x, "prompt: 32 tokens, at most 31");
  x = o;
  x.n_init = 0;
  refused(x, "decoder prompt ids");
  td_longform *lf = NULL;
  cr_expect_eq(td_longform_create(&o, 0, &lf), TD_ERR_INVALID);
  /* an outcome with no decode asked */
  cr_assert_eq(td_longform_create(&o, 1000, &lf), TD_OK);
  int32_t t[] = {T(0), EOS};
  cr_expect_eq(td_longform_feed(lf, t, 2, NULL, NAN), TD_ERR_INVALID);
  td_longform_destroy(lf);
}
