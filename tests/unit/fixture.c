#include "fixture.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <criterion/criterion.h>

#include "common/json.h"

const char *const fx_models[] = {"t5-tiny",           "bart-tiny",          "whisper-tiny",
                                 "t5v11-gated-untied", "mt5-silu-tied",      "mbart-prenorm-sharded",
                                 "marian-sinusoidal", "bart-untied-gelunew", "whisper-128mel"};
const int fx_n_models = sizeof fx_models / sizeof fx_models[0];

float *fx_read_f32(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  cr_assert(f, "cannot open %s", path);
  fseek(f, 0, SEEK_END);
  long sz = ftell(f);
  fseek(f, 0, SEEK_SET);
  float *v = malloc((size_t)sz + 4);
  cr_assert(fread(v, 1, (size_t)sz, f) == (size_t)sz);
  fclose(f);
  *n = (size_t)sz / 4;
  return v;
}

static int32_t *ints(const cJSON *o, const char *key, int *n) {
  int32_t *v = NULL;
  *n = 0;
  if (!cJSON_GetObjectItem(o, key)) return NULL;
  cr_assert(td_json_i32_array(o, key, true, "reference", -1, 1 << 30, &v, n) == TD_OK, "%s", td_errmsg());
  return v;
}

void fx_load(const char *name, fixture *f) {
  memset(f, 0, sizeof *f);
  snprintf(f->dir, sizeof f->dir, "%s/%s", TD_TEST_DATA, name);
  snprintf(f->name, sizeof f->name, "%s", name);
  char p[700];
  cJSON *cfg, *ref;
  snprintf(p, sizeof p, "%s/config.json", f->dir);
  cr_assert(td_json_load_file(p, 1 << 24, &cfg) == TD_OK, "%s", td_errmsg());
  snprintf(p, sizeof p, "%s/reference.json", f->dir);
  cr_assert(td_json_load_file(p, 1 << 24, &ref) == TD_OK, "%s", td_errmsg());
  f->d_model = cJSON_GetObjectItem(cfg, "d_model")->valueint;
  f->vocab = cJSON_GetObjectItem(cfg, "vocab_size")->valueint;
  cJSON *mels = cJSON_GetObjectItem(cfg, "num_mel_bins");
  if (mels) {
    f->mels = mels->valueint;
    f->frames = 2 * cJSON_GetObjectItem(cfg, "max_source_positions")->valueint;
  }
  f->max_new = cJSON_GetObjectItem(ref, "max_new_tokens")->valueint;
  f->eos = cJSON_GetObjectItem(ref, "eos_token_id")->valueint;
  cJSON *reqs = cJSON_GetObjectItem(ref, "requests");
  f->n = cJSON_GetArraySize(reqs);
  f->req = calloc((size_t)f->n, sizeof *f->req);
  size_t eo = 0, lo = 0;
  for (int i = 0; i < f->n; i++) {
    cJSON *r = cJSON_GetArrayItem(reqs, i);
    fx_request *q = &f->req[i];
    q->input_ids = ints(r, "input_ids", &q->n_input);
    q->prompt = ints(r, "decoder_prompt", &q->n_prompt);
    q->greedy = ints(r, "greedy_tokens", &q->n_greedy);
    q->enc_len = cJSON_GetObjectItem(r, "encoder_len")->valueint;
    q->enc_off = eo;
    q->logits_off = lo;
    eo += (size_t)q->enc_len;
    lo += (size_t)(q->n_prompt + q->n_greedy - 1);
  }
  size_t n;
  snprintf(p, sizeof p, "%s/ref_encoder_out.f32", f->dir);
  f->enc_out = fx_read_f32(p, &n);
  cr_assert_eq(n, eo * (size_t)f->d_model);
  snprintf(p, sizeof p, "%s/ref_logits.f32", f->dir);
  f->logits = fx_read_f32(p, &n);
  cr_assert_eq(n, lo * (size_t)f->vocab);
  if (f->mels) {
    snprintf(p, sizeof p, "%s/input_features.f32", f->dir);
    f->features = fx_read_f32(p, &n);
    cr_assert_eq(n, (size_t)f->n * f->mels * f->frames);
  }
  snprintf(p, sizeof p, "%s/beam_reference.json", f->dir);
  cJSON *bj = NULL;
  FILE *bf = fopen(p, "r");
  if (bf) {
    fclose(bf);
    cr_assert(td_json_load_file(p, 1 << 24, &bj) == TD_OK);
    cJSON *br = cJSON_GetObjectItem(bj, "requests");
    f->beam = calloc((size_t)f->n, sizeof *f->beam);
    for (int i = 0; i < f->n && i < cJSON_GetArraySize(br); i++) {
      cJSON *r = cJSON_GetArrayItem(br, i);
      cJSON *seqs = cJSON_GetObjectItem(r, "sequences"), *sc = cJSON_GetObjectItem(r, "scores");
      f->beam[i].n_seq = cJSON_GetArraySize(seqs);
      for (int k = 0; k < f->beam[i].n_seq && k < 8; k++) {
        cJSON *s = cJSON_GetArrayItem(seqs, k);
        int len = cJSON_GetArraySize(s);
        f->beam[i].seq[k] = calloc((size_t)len + 1, sizeof(int32_t));
        for (int t = 0; t < len; t++) f->beam[i].seq[k][t] = cJSON_GetArrayItem(s, t)->valueint;
        f->beam[i].seq_len[k] = len;
        f->beam[i].score[k] = cJSON_GetArrayItem(sc, k)->valuedouble;
      }
    }
    cJSON_Delete(bj);
  }
  cJSON_Delete(cfg);
  cJSON_Delete(ref);
}

void fx_free(fixture *f) {
  for (int i = 0; i < f->n; i++) {
    free(f->req[i].input_ids);
    free(f->req[i].prompt);
    free(f->req[i].greedy);
    if (f->beam)
      for (int k = 0; k < f->beam[i].n_seq && k < 8; k++) free(f->beam[i].seq[k]);
  }
  free(f->beam);
  free(f->req);
  free(f->enc_out);
  free(f->logits);
  free(f->features);
}

double fx_rel_err(const float *a, const float *b, size_t n) {
  double md = 0.0, mr = 0.0;
  for (size_t i = 0; i < n; i++) {
    if (isnan(a[i]) || isinf(a[i])) return INFINITY;
    double d = fabs((double)a[i] - b[i]);
    md = d > md ? d : md;
    mr = fabs(b[i]) > mr ? fabs(b[i]) : mr;
  }
  return mr > 0 ? md / mr : md;
}

static void put_ints(FILE *f, const char *key, const int32_t *v, int n) {
  fprintf(f, "\"%s\": [", key);
  for (int i = 0; i < n; i++) fprintf(f, "%s%d", i ? ", " : "", v[i]);
  fprintf(f, "]");
}

const char *fx_write_requests(const fixture *fx, const char *path, const char *extra) {
  FILE *f = fopen(path, "w");
  cr_assert(f, "cannot write %s", path);
  for (int i = 0; i < fx->n; i++) {
    const fx_request *q = &fx->req[i];
    fprintf(f, "{\"id\": \"r%d\", ", i);
    if (fx->mels) {
      char fp[700];
      snprintf(fp, sizeof fp, "%s.feat%d.f32", path, i);
      FILE *ff = fopen(fp, "wb");
      cr_assert(ff);
      fwrite(fx->features + (size_t)i * fx->mels * fx->frames, 4, (size_t)fx->mels * fx->frames, ff);
      fclose(ff);
      fprintf(f, "\"input_features\": \"%s\", ", fp);
    } else {
      put_ints(f, "input_ids", q->input_ids, q->n_input);
      fprintf(f, ", ");
    }
    put_ints(f, "decoder_prompt", q->prompt, q->n_prompt);
    fprintf(f, ", \"max_new_tokens\": %d%s%s}\n", fx->max_new, extra && *extra ? ", " : "", extra ? extra : "");
  }
  fclose(f);
  return path;
}
