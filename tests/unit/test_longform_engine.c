/* Long-form transcription with the engine against transformers: the random
 * tiny Whisper (a window of 64 frames, 48 positions) on 300 frames of
 * synthetic features fills each window's positions with one token repeated
 * after a timestamp, so its windows end at the length limit, carry the
 * previous tokens after <|startofprev|> (cut to the prompt's room), end
 * their segments at a timestamp past the window and probe the no-speech
 * probability at <|startoftranscript|>'s own row: td_longform driving
 * td_engine must give transformers' segments, tokens and times
 * (tests/data/whisper-tiny/longform_reference.json, made by
 * tests/tools/make_longform_reference.py --tiny). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/json.h"
#include "engine/engine.h"
#include "frontend/longform.h"

#define DIR TD_TEST_DATA "/whisper-tiny"
#define FRAMES 300
#define MELS 80
#define WINDOW 64

typedef struct outcome {
  bool done;
  td_status status;
  int32_t tok[64];
  float lp[64];
  int n;
  double probe;
} outcome;

static void on_finish(void *ctx, const td_result *r) {
  outcome *o = ctx;
  o->done = true;
  o->status = r->status;
  o->n = 0;
  o->probe = NAN;
  if (r->status != TD_OK || !r->n_outputs) return;
  o->n = r->outputs[0].n_tokens < 64 ? r->outputs[0].n_tokens : 64;
  memcpy(o->tok, r->outputs[0].tokens, sizeof(int32_t) * (size_t)o->n);
  if (r->outputs[0].logprobs) memcpy(o->lp, r->outputs[0].logprobs, sizeof(float) * (size_t)o->n);
  if (r->outputs[0].has_probe) o->probe = r->outputs[0].probe_prob;
}

/* The script's features: (((m * 31 + t * 17) % 97) - 48) / 48 in float32. */
static void features(float *f) {
  for (int m = 0; m < MELS; m++)
    for (int t = 0; t < FRAMES; t++) f[m * FRAMES + t] = (float)(((m * 31 + t * 17) % 97) - 48) / 48.0f;
}

/* One transcription: every window through the engine, as the gateway does it through the cluster. */
static td_longform *transcribe(td_engine *e, outcome *out, const float *whole, bool cond) {
  td_longform_opts o = {.window_frames = WINDOW, .input_stride = 2, .max_target_positions = 48, .vocab_size = 400,
                        .timestamp_begin = 351, .eos = 2, .no_speech = 349, .prev_sot = 348, .init = {1},
                        .n_init = 1, .temperatures = {0}, .n_temperatures = 1,
                        .has_compression_ratio_threshold = true, .compression_ratio_threshold = 1.35,
                        .has_logprob_threshold = true, .logprob_threshold = -1.0, .has_no_speech_threshold = true,
                        .no_speech_threshold = 0.6, .condition_on_prev_tokens = cond};
  td_longform *lf;
  cr_assert_eq(td_longform_create(&o, FRAMES, &lf), TD_OK, "%s", td_errmsg());
  float win[MELS * WINDOW];
  td_longform_window w;
  while (td_longform_next(lf, &w)) {
    td_longform_window_features(whole, MELS, FRAMES, w.seek, w.n_frames, WINDOW, win);
    td_request r = {.id = "w", .features = win, .prompt = w.prompt, .n_prompt = w.n_prompt};
    td_request_params_default(&r.params);
    r.params.max_new_tokens = w.max_new_tokens;
    r.params.temperature = w.temperature;
    r.params.logprobs = true;
    r.params.timestamp_begin = o.timestamp_begin;
    if (w.probe_position >= 0) {
      r.params.probe = true;
      r.params.probe_token = w.probe_token;
      r.params.probe_position = w.probe_position;
    }
    uint64_t h;
    out->done = false;
    cr_assert_eq(td_engine_add(e, &r, &h), TD_OK, "%s", td_errmsg());
    for (int i = 0; i < 200 && !out->done; i++) cr_assert_eq(td_engine_step(e), TD_OK, "%s", td_errmsg());
    cr_assert(out->done && out->status == TD_OK, "window %d did not finish", w.index);
    cr_assert_eq(td_longform_feed(lf, out->tok, out->n, out->lp, out->probe), TD_OK, "%s", td_errmsg());
  }
  return lf;
}

Test(longform_engine, transformers_segments) {
  char path[512];
  snprintf(path, sizeof path, "%s/longform_reference.json", DIR);
  cJSON *ref = NULL;
  cr_assert_eq(td_json_load_file(path, 1 << 24, &ref), TD_OK,
               "no transformers reference: make it with python3 tests/tools/make_longform_reference.py --tiny "
               "where transformers is installed (%s)", td_errmsg());
  cr_assert_eq(cJSON_GetObjectItem(ref, "total_frames")->valueint, FRAMES);
  cr_assert_eq(cJSON_GetObjectItem(ref, "timestamp_begin")->valueint, 351);
  td_backend_opts bo = {.kind = TD_BACKEND_CPU};
  td_backend *b;
  cr_assert_eq(td_backend_create(&bo, &b), TD_OK);
  td_model_opts mo = {.block_size = 4, .max_seqs = 4, .max_tokens = 64, .max_enc_tokens = 256, .max_enc_seqs = 2};
  td_model *m;
  cr_assert_eq(td_model_load(DIR, b, &mo, &m), TD_OK, "%s", td_errmsg());
  outcome out;
  td_engine_opts eo = {.max_running = 4, .max_step_tokens = 64};
  td_engine_callbacks cb = {.on_finish = on_finish, .ctx = &out};
  td_engine *e;
  cr_assert_eq(td_engine_create(m, &eo, &cb, &e), TD_OK, "%s", td_errmsg());
  static float whole[MELS * FRAMES];
  features(whole);
  const cJSON *c;
  int cases = 0;
  cJSON_ArrayForEach(c, cJSON_GetObjectItem(ref, "cases")) {
    bool cond = cJSON_IsTrue(cJSON_GetObjectItem(c, "condition_on_prev_tokens"));
    td_longform *lf = transcribe(e, &out, whole, cond);
    int n;
    const td_longform_segment *s = td_longform_segments(lf, &n);
    const cJSON *segs = cJSON_GetObjectItem(c, "segments");
    cr_expect_eq(n, cJSON_GetArraySize(segs), "condition %d: %d segments, transformers %d", cond, n,
                 cJSON_GetArraySize(segs));
    for (int i = 0; i < n && i < cJSON_GetArraySize(segs); i++) {
      const cJSON *x = cJSON_GetArrayItem(segs, i), *toks = cJSON_GetObjectItem(x, "tokens");
      double start = cJSON_GetObjectItem(x, "start")->valuedouble, end = cJSON_GetObjectItem(x, "end")->valuedouble;
      cr_expect(fabs(s[i].start - start) < 1e-9 && fabs(s[i].end - end) < 1e-9,
                "condition %d segment %d: %.17g-%.17g, transformers %.17g-%.17g", cond, i, s[i].start, s[i].end,
                start, end);
      bool same = s[i].n_tokens == cJSON_GetArraySize(toks);
      for (int k = 0; same && k < s[i].n_tokens; k++) same = s[i].tokens[k] == cJSON_GetArrayItem(toks, k)->valueint;
      char *want = cJSON_PrintUnformatted(toks);
      cr_expect(same, "condition %d segment %d: tokens differ from transformers' %s", cond, i, want);
      free(want);
    }
    int windows, decodes, skipped;
    td_longform_counts(lf, &windows, &decodes, &skipped);
    cr_log_info("condition %d: %d windows, %d skipped, %d segments", cond, windows, skipped, n);
    td_longform_destroy(lf);
    cases++;
  }
  cr_expect_eq(cases, 2);
  td_engine_stats st = td_engine_get_stats(e);
  cr_expect_eq(st.self.n_free, st.self.n_blocks, "self blocks leaked");
  td_engine_destroy(e);
  td_model_destroy(m);
  td_backend_destroy(b);
  cJSON_Delete(ref);
}
