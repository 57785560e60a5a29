/* Hugging Face reference fixtures under tests/data (see tests/data/README.md). */
#ifndef TD_TESTS_FIXTURE_H
#define TD_TESTS_FIXTURE_H

#include <stddef.h>
#include <stdint.h>

typedef struct fx_request {
  int32_t *input_ids;
  int n_input;
  int32_t *prompt;
  int n_prompt;
  int32_t *greedy;
  int n_greedy;
  int enc_len;
  size_t enc_off;    /* into enc_out, rows */
  size_t logits_off; /* into logits, rows */
} fx_request;

typedef struct fx_beam {
  int n_seq;
  int32_t *seq[8];
  int seq_len[8];
  double score[8];
} fx_beam;

typedef struct fixture {
  char dir[512];
  char name[64];
  int n;
  fx_request *req;
  int d_model, vocab, mels, frames;
  float *enc_out;
  float *logits;
  float *features; /* Whisper: [n, mels, frames] */
  int max_new;
  int eos;
  fx_beam *beam;   /* NULL when the fixture has none */
} fixture;

extern const char *const fx_models[];
extern const int fx_n_models;

/* Loads tests/data/<name>; aborts the test on failure. */
void fx_load(const char *name, fixture *f);
void fx_free(fixture *f);
float *fx_read_f32(const char *path, size_t *n);
/* max |a - b| / max |b| over n values; NaN in a counts as infinite. */
double fx_rel_err(const float *a, const float *b, size_t n);
/* Writes a JSONL request file for tandem-generate; returns its path (static). */
const char *fx_write_requests(const fixture *f, const char *path, const char *extra);

#endif
