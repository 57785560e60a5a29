/* Admission (router/admit.c): every limit refused with its own message,
 * and what an admitted request needs. */
#include <criterion/criterion.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/defaults.h"
#include "common/request.h"
#include "router/policy.h"

static Tandem__ModelInfo model(void) {
  Tandem__ModelInfo m = TANDEM__MODEL_INFO__INIT;
  m.name = "served-t5";
  m.model_type = "t5";
  m.vocab_size = 100;
  m.max_source_len = 64;
  m.max_target_len = 32;
  return m;
}

static int32_t ids[4] = {1, 2, 3, 4};

typedef struct req {
  Tandem__GenerateRequest g;
  Tandem__SamplingParams sp;
} req;

/* A valid request: 4 input tokens, greedy, 5 new tokens. */
static void valid(req *r) {
  r->g = (Tandem__GenerateRequest)TANDEM__GENERATE_REQUEST__INIT;
  r->sp = (Tandem__SamplingParams)TANDEM__SAMPLING_PARAMS__INIT;
  r->g.request_id = "r1";
  r->g.input_ids = ids;
  r->g.n_input_ids = 4;
  r->g.max_new_tokens = 5;
  r->g.sampling = &r->sp;
}

/* Admits r; expects status `want` and, when refused, a message holding `says`. */
static void expect(req *r, td_status want, const char *says) {
  Tandem__ModelInfo m = model();
  td_req_shape sh;
  char msg[512] = "";
  td_status s = td_admit_request(&m, 16, &r->g, &sh, msg, sizeof msg);
  cr_assert_eq(s, want, "status %d, want %d: %s", s, want, msg);
  if (says) cr_expect(strstr(msg, says), "message \"%s\" does not say \"%s\"", msg, says);
}

Test(admit, a_valid_request_and_what_it_needs) {
  req r;
  valid(&r);
  Tandem__ModelInfo m = model();
  td_req_shape sh;
  char msg[256];
  cr_assert_eq(td_admit_request(&m, 16, &r.g, &sh, msg, sizeof msg), TD_OK, "%s", msg);
  cr_expect_eq(sh.enc_len, 4);
  cr_expect_eq(sh.n_prompt, 1, "no decoder prompt: the start token");
  cr_expect_eq(sh.max_new, 5);
  cr_expect_eq(sh.width, 1);
  cr_expect_eq(sh.need_cross, 1);
  cr_expect_eq(sh.need_self, 2, "(1 + 5) tokens in one block, and one more");
  r.sp.n = 3;
  r.g.max_new_tokens = 0; /* the model's room */
  cr_assert_eq(td_admit_request(&m, 16, &r.g, &sh, msg, sizeof msg), TD_OK, "%s", msg);
  cr_expect_eq(sh.width, 3);
  cr_expect_eq(sh.max_new, 31);
  cr_expect_eq(sh.need_self, 3 * (2 + 1));
  r.sp.n = 1;
  r.sp.num_beams = 4;
  cr_assert_eq(td_admit_request(&m, 16, &r.g, &sh, msg, sizeof msg), TD_OK, "%s", msg);
  cr_expect_eq(sh.width, 4);
}

Test(admit, request_id_empty) {
  char msg[128];
  cr_expect_eq(td_admit_request_id("", msg, sizeof msg), TD_ERR_INVALID);
  cr_expect(strstr(msg, "empty"), "%s", msg);
  cr_expect_eq(td_admit_request_id(NULL, msg, sizeof msg), TD_ERR_INVALID);
}

Test(admit, request_id_too_long) {
  char id[300], msg[128];
  memset(id, 'x', sizeof id);
  id[255] = 0;
  cr_expect_eq(td_admit_request_id(id, msg, sizeof msg), TD_OK);
  id[255] = 'x';
  id[256] = 0;
  cr_expect_eq(td_admit_request_id(id, msg, sizeof msg), TD_ERR_INVALID);
  cr_expect(strstr(msg, "256 bytes exceeds 255"), "%s", msg);
}

Test(admit, another_model) {
  req r;
  valid(&r);
  r.g.model = "t5";
  expect(&r, TD_OK, NULL);
  r.g.model = "served-t5";
  expect(&r, TD_OK, NULL);
  r.g.model = "bart";
  expect(&r, TD_ERR_NOT_FOUND, "\"bart\" is not served here");
}

Test(admit, empty_input) {
  req r;
  valid(&r);
  r.g.n_input_ids = 0;
  expect(&r, TD_ERR_INVALID, "empty encoder input");
}

Test(admit, input_longer_than_the_model_takes) {
  req r;
  valid(&r);
  int32_t many[65] = {0};
  r.g.input_ids = many;
  r.g.n_input_ids = 65;
  expect(&r, TD_ERR_INVALID, "65 tokens exceeds the model's 64");
}

Test(admit, input_token_outside_the_vocabulary) {
  req r;
  valid(&r);
  int32_t bad[2] = {5, 100};
  r.g.input_ids = bad;
  r.g.n_input_ids = 2;
  expect(&r, TD_ERR_INVALID, "input token 100 (at 1) is outside the vocabulary of 100");
  bad[1] = -1;
  expect(&r, TD_ERR_INVALID, "outside the vocabulary");
}

Test(admit, features_for_a_text_model) {
  req r;
  valid(&r);
  Tandem__AudioFeatures af = TANDEM__AUDIO_FEATURES__INIT;
  r.g.features = &af;
  expect(&r, TD_ERR_INVALID, "takes input_ids, not audio features");
}

Test(admit, audio_features_of_the_wrong_size_or_not_finite) {
  req r;
  valid(&r);
  Tandem__ModelInfo m = model();
  m.mel_bins = 2;
  m.frames = 3;
  float v[6] = {0, 1, 2, 3, 4, 5};
  Tandem__AudioFeatures af = TANDEM__AUDIO_FEATURES__INIT;
  af.values = v;
  af.n_values = 5;
  r.g.features = &af;
  td_req_shape sh;
  char msg[256];
  cr_expect_eq(td_admit_request(&m, 16, &r.g, &sh, msg, sizeof msg), TD_ERR_INVALID);
  cr_expect(strstr(msg, "2 x 3 floats, got 5"), "%s", msg);
  af.n_values = 6;
  af.mel_bins = 3;
  af.frames = 2;
  cr_expect_eq(td_admit_request(&m, 16, &r.g, &sh, msg, sizeof msg), TD_ERR_INVALID);
  cr_expect(strstr(msg, "features are 3 x 2, the model takes 2 x 3"), "%s", msg);
  af.mel_bins = af.frames = 0;
  v[4] = NAN;
  cr_expect_eq(td_admit_request(&m, 16, &r.g, &sh, msg, sizeof msg), TD_ERR_INVALID);
  cr_expect(strstr(msg, "NaN or infinity"), "%s", msg);
  v[4] = 4;
  cr_expect_eq(td_admit_request(&m, 16, &r.g, &sh, msg, sizeof msg), TD_OK, "%s", msg);
  cr_expect_eq(sh.enc_len, 64, "audio: the model's source length");
}

/* The blocked scan against a plain one: sizes around its block of 1,024
 * and a Whisper request's 384,000 values, a NaN, an infinity or a huge
 * value at random places, several at once (the first is reported). */
Test(admit, first_nonfinite_against_a_plain_scan) {
  srand(20261127);
  size_t sizes[] = {0, 1, 7, 1023, 1024, 1025, 3001, 4096, 384000, 384001};
  float specials[] = {NAN, INFINITY, -INFINITY, -NAN};
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    size_t n = sizes[k];
    float *v = malloc(sizeof(float) * (n ? n : 1));
    cr_assert(v);
    for (int trial = 0; trial < 6; trial++) {
      for (size_t i = 0; i < n; i++) v[i] = ((float)rand() / (float)RAND_MAX - 0.5f) * 1e30f;
      int bad = n ? trial % 3 : 0; /* none, one or two non-finite values */
      for (int b = 0; b < bad; b++) v[(size_t)rand() % n] = specials[rand() % 4];
      if (trial == 5 && n) v[n - 1] = FLT_MAX; /* the largest finite value stays finite */
      size_t want = n;
      for (size_t i = 0; i < n; i++)
        if (!isfinite(v[i])) {
          want = i;
          break;
        }
      cr_expect_eq(td_first_nonfinite(v, n), want, "n %zu, trial %d", n, trial);
    }
    free(v);
  }
}

Test(admit, decoder_prompt_filling_the_model) {
  req r;
  valid(&r);
  int32_t p[32] = {0};
  r.g.decoder_prompt = p;
  r.g.n_decoder_prompt = 32;
  r.g.max_new_tokens = 0;
  expect(&r, TD_ERR_INVALID, "decoder prompt of 32 tokens leaves no room in the model's 32 positions");
}

Test(admit, decoder_prompt_token_outside_the_vocabulary) {
  req r;
  valid(&r);
  int32_t p[2] = {0, 100};
  r.g.decoder_prompt = p;
  r.g.n_decoder_prompt = 2;
  expect(&r, TD_ERR_INVALID, "decoder prompt token 100 is outside the vocabulary");
}

Test(admit, stop_token_outside_the_vocabulary) {
  req r;
  valid(&r);
  int32_t s[1] = {100};
  r.g.stop_token_ids = s;
  r.g.n_stop_token_ids = 1;
  expect(&r, TD_ERR_INVALID, "stop token 100 is outside the vocabulary");
}

Test(admit, max_new_tokens_beyond_the_model) {
  req r;
  valid(&r);
  r.g.max_new_tokens = 31;
  expect(&r, TD_OK, NULL);
  r.g.max_new_tokens = 32;
  expect(&r, TD_ERR_INVALID, "prompt 1 + max_new_tokens 32 exceeds the model's 32 positions");
  r.g.max_new_tokens = 0x80000000u; /* negative as an int */
  expect(&r, TD_ERR_INVALID, "exceeds the model's 32 positions");
}

Test(admit, temperature_negative_or_not_finite) {
  req r;
  valid(&r);
  r.sp.temperature = -0.5f;
  expect(&r, TD_ERR_INVALID, "temperature must be a finite number >= 0");
  r.sp.temperature = NAN;
  expect(&r, TD_ERR_INVALID, "temperature must be a finite number >= 0");
  r.sp.temperature = INFINITY;
  expect(&r, TD_ERR_INVALID, "temperature must be a finite number >= 0");
}

Test(admit, top_p_negative_or_nan) {
  req r;
  valid(&r);
  r.sp.top_p = 5; /* >= 1: off */
  expect(&r, TD_OK, NULL);
  r.sp.top_p = -0.1f;
  expect(&r, TD_ERR_INVALID, "top_p must be a finite number >= 0");
  r.sp.top_p = NAN;
  expect(&r, TD_ERR_INVALID, "top_p must be a finite number >= 0");
}

Test(admit, top_k_negative) {
  req r;
  valid(&r);
  r.sp.top_k = -1;
  expect(&r, TD_ERR_INVALID, "top_k must be 0 (off) to the vocabulary's 100");
}

Test(admit, n_beyond_the_sample_limit) {
  req r;
  valid(&r);
  r.sp.temperature = 1;
  r.sp.n = TD_ROUTER_MAX_SAMPLES;
  expect(&r, TD_OK, NULL);
  r.sp.n = TD_ROUTER_MAX_SAMPLES + 1;
  expect(&r, TD_ERR_INVALID, "n = 65 exceeds the limit of 64 samples");
  r.sp.n = 0x80000000u;
  expect(&r, TD_ERR_INVALID, "exceeds the limit of 64 samples");
}

Test(admit, num_beams_beyond_the_beam_limit) {
  req r;
  valid(&r);
  r.sp.num_beams = TD_ENGINE_MAX_BEAMS;
  expect(&r, TD_OK, NULL);
  r.sp.num_beams = TD_ENGINE_MAX_BEAMS + 1;
  expect(&r, TD_ERR_INVALID, "num_beams = 33 exceeds the limit of 32 beams");
}

Test(admit, beams_with_samples) {
  req r;
  valid(&r);
  r.sp.num_beams = 4;
  r.sp.n = 2;
  expect(&r, TD_ERR_INVALID, "beam search takes no samples (n must be 1)");
}

Test(admit, beams_with_temperature) {
  req r;
  valid(&r);
  r.sp.num_beams = 4;
  r.sp.temperature = 0.7f;
  expect(&r, TD_ERR_INVALID, "beam search does not sample (temperature must be 0)");
}

Test(admit, more_return_sequences_than_beams) {
  req r;
  valid(&r);
  r.sp.num_beams = 4;
  r.sp.num_return_sequences = 4;
  expect(&r, TD_OK, NULL);
  r.sp.num_return_sequences = 5;
  expect(&r, TD_ERR_INVALID, "num_return_sequences 5 exceeds num_beams 4");
}

Test(admit, more_return_sequences_than_samples) {
  req r;
  valid(&r);
  r.sp.temperature = 1;
  r.sp.n = 2;
  r.sp.num_return_sequences = 3;
  expect(&r, TD_ERR_INVALID, "num_return_sequences 3 exceeds n 2");
}

Test(admit, length_penalty_not_finite) {
  req r;
  valid(&r);
  r.sp.has_length_penalty = true;
  r.sp.length_penalty = NAN;
  expect(&r, TD_ERR_INVALID, "length_penalty must be a finite number");
  r.sp.has_length_penalty = false;
  expect(&r, TD_OK, NULL);
}

Test(admit, early_stopping_out_of_range) {
  req r;
  valid(&r);
  r.sp.early_stopping = -1;
  expect(&r, TD_OK, NULL);
  r.sp.early_stopping = 2;
  expect(&r, TD_ERR_INVALID, "early_stopping must be 1 (true), 0 (false) or -1 (never), got 2");
}

Test(admit, forced_tokens_outside_the_vocabulary) {
  req r;
  valid(&r);
  r.sp.set_forced_bos = true;
  r.sp.forced_bos_token_id = 100;
  expect(&r, TD_ERR_INVALID, "forced_bos_token_id 100 is outside the vocabulary");
  r.sp.set_forced_bos = false;
  r.sp.set_forced_eos = true;
  r.sp.forced_eos_token_id = 100;
  expect(&r, TD_ERR_INVALID, "forced_eos_token_id 100 is outside the vocabulary");
  r.sp.forced_eos_token_id = -1; /* none */
  expect(&r, TD_OK, NULL);
}

/* ---- inputs before conversion (td_admit_inputs) */

static void expect_inputs(const td_admit_frontend *fe, const Tandem__GenerateRequest *g, td_status want,
                          const char *says) {
  char msg[512] = "";
  td_status s = td_admit_inputs(fe, g, msg, sizeof msg);
  cr_assert_eq(s, want, "status %d, want %d: %s", s, want, msg);
  if (says) cr_expect(strstr(msg, says), "message \"%s\" does not say \"%s\"", msg, says);
}

Test(admit, exactly_one_input) {
  td_admit_frontend fe = {.text = true, .audio = true};
  req r;
  valid(&r);
  expect_inputs(&fe, &r.g, TD_OK, NULL);
  r.g.text = "forty two";
  expect_inputs(&fe, &r.g, TD_ERR_INVALID, "not input_ids and text");
  r.g.n_input_ids = 0;
  expect_inputs(&fe, &r.g, TD_OK, NULL);
  uint8_t wav[4] = "RIFF";
  r.g.audio.data = wav;
  r.g.audio.len = sizeof wav;
  expect_inputs(&fe, &r.g, TD_ERR_INVALID, "not text and audio");
  r.g.text = "";
  expect_inputs(&fe, &r.g, TD_OK, NULL);
  Tandem__AudioFeatures af = TANDEM__AUDIO_FEATURES__INIT;
  r.g.features = &af;
  expect_inputs(&fe, &r.g, TD_ERR_INVALID, "not features and audio");
  r.g.features = NULL;
  r.g.audio.len = 0;
  expect_inputs(&fe, &r.g, TD_ERR_INVALID, "no input");
}

Test(admit, text_and_audio_need_the_front_end) {
  td_admit_frontend none = {0}, text_only = {.text = true};
  req r;
  valid(&r);
  r.g.n_input_ids = 0;
  r.g.text = "seven";
  expect_inputs(&none, &r.g, TD_ERR_INVALID, "needs a tokenizer at the router (tandem-router --tokenizer DIR)");
  r.g.text = "";
  uint8_t wav[4] = "RIFF";
  r.g.audio.data = wav;
  r.g.audio.len = sizeof wav;
  expect_inputs(&none, &r.g, TD_ERR_INVALID, "audio input needs a tokenizer");
  expect_inputs(&text_only, &r.g, TD_ERR_INVALID, "preprocessor_config.json");
}

Test(admit, text_and_audio_limits) {
  td_admit_frontend fe = {.text = true, .audio = true};
  req r;
  valid(&r);
  r.g.n_input_ids = 0;
  char *big = malloc(TD_MAX_TEXT_BYTES + 2);
  memset(big, 'a', TD_MAX_TEXT_BYTES + 1);
  big[TD_MAX_TEXT_BYTES + 1] = 0;
  r.g.text = big;
  expect_inputs(&fe, &r.g, TD_ERR_INVALID, "exceeds the limit");
  big[TD_MAX_TEXT_BYTES] = 0;
  expect_inputs(&fe, &r.g, TD_OK, NULL);
  free(big);
  r.g.text = "";
  static uint8_t one[1];
  r.g.audio.data = one;
  r.g.audio.len = (size_t)TD_MAX_AUDIO_BYTES + 1; /* only the length is read */
  expect_inputs(&fe, &r.g, TD_ERR_INVALID, "exceeds the limit");
  r.g.audio.len = 1;
  expect_inputs(&fe, &r.g, TD_OK, NULL);
  int32_t prompt[1] = {0};
  r.g.decoder_prompt = prompt;
  r.g.n_decoder_prompt = 1;
  expect_inputs(&fe, &r.g, TD_ERR_INVALID, "takes no decoder_prompt");
  r.g.n_decoder_prompt = 0;
  r.g.language = "a-language-code-far-longer-than-any-whisper-knows";
  expect_inputs(&fe, &r.g, TD_ERR_INVALID, "language of");
  /* the audio options without audio */
  r.g.language = "en";
  r.g.audio.len = 0;
  r.g.text = "seven";
  expect_inputs(&fe, &r.g, TD_ERR_INVALID, "go with audio input only");
}

Test(admit, text_for_an_audio_model) {
  req r;
  valid(&r);
  Tandem__ModelInfo m = model();
  m.model_type = "whisper";
  m.mel_bins = 80;
  m.frames = 400;
  td_req_shape sh;
  char msg[512] = "";
  cr_assert_eq(td_admit_request(&m, 16, &r.g, &sh, msg, sizeof msg), TD_ERR_INVALID);
  cr_expect(strstr(msg, "takes audio or audio features, not input_ids or text"), "%s", msg);
}

Test(admit, allowed_tokens_outside_the_vocabulary) {
  req r;
  valid(&r);
  int32_t allowed[2] = {5, 100};
  r.sp.allowed_token_ids = allowed;
  r.sp.n_allowed_token_ids = 2;
  expect(&r, TD_ERR_INVALID, "allowed token 100 is outside the vocabulary of 100");
  allowed[1] = 99;
  expect(&r, TD_OK, NULL);
}

Test(admit, probe_outside_the_vocabulary_or_prompt) {
  req r;
  valid(&r);
  int32_t p[3] = {0, 1, 2};
  r.g.decoder_prompt = p;
  r.g.n_decoder_prompt = 3;
  r.sp.probe = true;
  r.sp.probe_token_id = 100;
  expect(&r, TD_ERR_INVALID, "probe_token_id 100 is outside the vocabulary of 100");
  r.sp.probe_token_id = 99;
  r.sp.probe_position = 3;
  expect(&r, TD_ERR_INVALID, "probe_position 3 is outside the decoder prompt of 3 tokens");
  r.sp.probe_position = 2;
  Tandem__ModelInfo m = model();
  td_req_shape sh;
  char msg[256];
  cr_assert_eq(td_admit_request(&m, 16, &r.g, &sh, msg, sizeof msg), TD_OK, "%s", msg);
  cr_expect(sh.probe, "the shape says the decode worker computes the prompt");
  r.sp.probe = false;
  cr_assert_eq(td_admit_request(&m, 16, &r.g, &sh, msg, sizeof msg), TD_OK, "%s", msg);
  cr_expect(!sh.probe);
}
