/* Checkpoint and configuration loading: every malformed input gives a
 * clear error and no crash (run under ASan). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <criterion/criterion.h>

#include "fixture.h"
#include "kernels/ops.h"
#include "model/model.h"
#include "model/safetensors.h"

static char tmpdir[256];

static void setup_tmp(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/td-loader-XXXXXX");
  cr_assert(mkdtemp(tmpdir));
}

static void teardown_tmp(void) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "rm -rf %s", tmpdir);
  cr_assert(system(cmd) == 0);
}

static void write_raw(const char *name, const char *header, size_t hlen_field, const void *data, size_t n) {
  char p[512];
  snprintf(p, sizeof p, "%s/%s", tmpdir, name);
  FILE *f = fopen(p, "wb");
  cr_assert(f);
  uint64_t hl = hlen_field;
  unsigned char le[8];
  for (int i = 0; i < 8; i++) le[i] = (unsigned char)(hl >> (8 * i));
  fwrite(le, 1, 8, f);
  fwrite(header, 1, strlen(header), f);
  if (n) fwrite(data, 1, n, f);
  fclose(f);
}

static void write_st(const char *name, const char *header, size_t data_bytes) {
  void *d = calloc(1, data_bytes + 1);
  write_raw(name, header, strlen(header), d, data_bytes);
  free(d);
}

static void expect_fail(const char *file, td_status want, const char *needle) {
  char p[512];
  snprintf(p, sizeof p, "%s/%s", tmpdir, file);
  td_checkpoint *ck = NULL;
  td_status s = td_checkpoint_open(p, &ck);
  cr_expect_eq(s, want, "%s: status %s, expected %s (%s)", file, td_status_str(s), td_status_str(want), td_errmsg());
  cr_expect(ck == NULL);
  cr_expect(strstr(td_errmsg(), needle), "%s: message \"%s\" lacks \"%s\"", file, td_errmsg(), needle);
  td_checkpoint_close(ck);
}

TestSuite(loader, .init = setup_tmp, .fini = teardown_tmp);

Test(loader, valid_file_reads) {
  write_st("ok.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
                             "\"b\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[24,32]},"
                             "\"__metadata__\":{\"format\":\"pt\"}}", 32);
  char p[512];
  snprintf(p, sizeof p, "%s/ok.safetensors", tmpdir);
  td_checkpoint *ck;
  cr_assert(td_checkpoint_open(p, &ck) == TD_OK, "%s", td_errmsg());
  cr_expect_eq(td_checkpoint_count(ck), 2);
  const td_tensor_info *t = td_checkpoint_find(ck, "a");
  cr_assert(t);
  cr_expect_eq(t->numel, 6);
  float out[6];
  int64_t good[2] = {2, 3}, bad[2] = {3, 2};
  cr_expect(td_tensor_read_f32(t, 2, good, out) == TD_OK);
  cr_expect(td_tensor_read_f32(t, 2, bad, out) == TD_ERR_FORMAT);
  cr_expect(strstr(td_errmsg(), "\"a\" has shape [2, 3], expected [3, 2]"), "%s", td_errmsg());
  cr_expect(td_checkpoint_find(ck, "missing") == NULL);
  td_checkpoint_close(ck);
}

Test(loader, truncated_file) {
  write_st("t.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[100],\"data_offsets\":[0,400]}}", 100);
  expect_fail("t.safetensors", TD_ERR_FORMAT, "truncated");
  char p[512];
  snprintf(p, sizeof p, "%s/tiny.safetensors", tmpdir);
  FILE *f = fopen(p, "wb");
  fputs("abc", f);
  fclose(f);
  expect_fail("tiny.safetensors", TD_ERR_FORMAT, "too short");
  write_raw("empty.safetensors", "", 0, NULL, 0);
  expect_fail("empty.safetensors", TD_ERR_FORMAT, "malformed JSON");
}

Test(loader, header_longer_than_file) {
  write_raw("h.safetensors", "{}", 5000, NULL, 0);
  expect_fail("h.safetensors", TD_ERR_FORMAT, "longer than the file");
  write_raw("cap.safetensors", "{}", (size_t)1 << 40, NULL, 0);
  expect_fail("cap.safetensors", TD_ERR_FORMAT, "exceeds");
}

Test(loader, bad_json) {
  write_st("j.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]", 4);
  expect_fail("j.safetensors", TD_ERR_FORMAT, "malformed JSON");
  write_st("arr.safetensors", "[1,2,3]", 0);
  expect_fail("arr.safetensors", TD_ERR_FORMAT, "not a JSON object");
  write_st("e.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4);
  expect_fail("e.safetensors", TD_ERR_FORMAT, "data_offsets");
  write_st("neg.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4);
  expect_fail("neg.safetensors", TD_ERR_FORMAT, "shape[0]");
}

Test(loader, unknown_dtype) {
  write_st("d.safetensors", "{\"a\":{\"dtype\":\"F7\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4);
  expect_fail("d.safetensors", TD_ERR_FORMAT, "unknown dtype \"F7\"");
}

Test(loader, size_mismatch) {
  write_st("s.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8);
  expect_fail("s.safetensors", TD_ERR_FORMAT, "expected 12");
}

Test(loader, overlapping_and_out_of_range) {
  write_st("o.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                            "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12);
  expect_fail("o.safetensors", TD_ERR_FORMAT, "overlap");
  write_st("r.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 12);
  expect_fail("r.safetensors", TD_ERR_FORMAT, "past the end");
  write_st("rev.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,4]}}", 12);
  expect_fail("rev.safetensors", TD_ERR_FORMAT, "bad data_offsets");
  write_st("dup.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                              "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8);
  expect_fail("dup.safetensors", TD_ERR_FORMAT, "twice");
}

Test(loader, sharded_index_errors) {
  write_st("model-1.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4);
  char p[512];
  snprintf(p, sizeof p, "%s/model.safetensors.index.json", tmpdir);
  FILE *f = fopen(p, "w");
  fprintf(f, "{\"weight_map\": {\"a\": \"model-1.safetensors\", \"b\": \"model-1.safetensors\"}}");
  fclose(f);
  td_checkpoint *ck;
  cr_expect(td_checkpoint_open(tmpdir, &ck) == TD_ERR_FORMAT);
  cr_expect(strstr(td_errmsg(), "\"b\" is listed in weight_map but not in model-1.safetensors"), "%s", td_errmsg());
  f = fopen(p, "w");
  fprintf(f, "{\"weight_map\": {\"a\": \"model-2.safetensors\"}}");
  fclose(f);
  cr_expect(td_checkpoint_open(tmpdir, &ck) == TD_ERR_NOT_FOUND);
  cr_expect(strstr(td_errmsg(), "model-2.safetensors"), "%s", td_errmsg());
  f = fopen(p, "w");
  fprintf(f, "{\"weight_map\": {\"a\": \"../../etc/passwd\"}}");
  fclose(f);
  cr_expect(td_checkpoint_open(tmpdir, &ck) == TD_ERR_FORMAT);
}

/* ---- model-level: a fixture copied with one change ---- */

static void copy_file(const char *from, const char *to) {
  char cmd[1200];
  snprintf(cmd, sizeof cmd, "cp '%s' '%s'", from, to);
  cr_assert(system(cmd) == 0);
}

/* Rewrites fixture t5-tiny into tmpdir with tensor `drop` left out, or
 * `reshape` given shape [1, n]. */
static void rewrite_t5(const char *drop, const char *reshape) {
  char src[600], dst[600];
  snprintf(src, sizeof src, "%s/t5-tiny", TD_TEST_DATA);
  for (int i = 0; i < 2; i++) {
    const char *n = i ? "generation_config.json" : "config.json";
    snprintf(src, sizeof src, "%s/t5-tiny/%s", TD_TEST_DATA, n);
    snprintf(dst, sizeof dst, "%s/%s", tmpdir, n);
    copy_file(src, dst);
  }
  snprintf(src, sizeof src, "%s/t5-tiny/model.safetensors", TD_TEST_DATA);
  td_checkpoint *ck;
  cr_assert(td_checkpoint_open(src, &ck) == TD_OK);
  cJSON *h = cJSON_CreateObject();
  size_t off = 0, total = 0;
  for (size_t i = 0; i < td_checkpoint_count(ck); i++) total += td_checkpoint_at(ck, i)->nbytes;
  unsigned char *data = malloc(total + 1);
  for (size_t i = 0; i < td_checkpoint_count(ck); i++) {
    const td_tensor_info *t = td_checkpoint_at(ck, i);
    if (drop && !strcmp(t->name, drop)) continue;
    cJSON *e = cJSON_AddObjectToObject(h, t->name);
    cJSON_AddStringToObject(e, "dtype", td_dtype_name(t->dtype));
    cJSON *sh = cJSON_AddArrayToObject(e, "shape");
    if (reshape && !strcmp(t->name, reshape)) {
      cJSON_AddItemToArray(sh, cJSON_CreateNumber(1));
      cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)t->numel));
    } else {
      for (int d = 0; d < t->ndim; d++) cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)t->shape[d]));
    }
    cJSON *o = cJSON_AddArrayToObject(e, "data_offsets");
    cJSON_AddItemToArray(o, cJSON_CreateNumber((double)off));
    cJSON_AddItemToArray(o, cJSON_CreateNumber((double)(off + t->nbytes)));
    memcpy(data + off, t->data, t->nbytes);
    off += t->nbytes;
  }
  char *hs = cJSON_PrintUnformatted(h);
  write_raw("model.safetensors", hs, strlen(hs), data, off);
  free(hs);
  free(data);
  cJSON_Delete(h);
  td_checkpoint_close(ck);
}

static td_status load_tmp_model(void) {
  td_backend_opts bo = {.kind = TD_BACKEND_CPU};
  td_backend *b;
  cr_assert(td_backend_create(&bo, &b) == TD_OK);
  td_model_opts mo = {0};
  td_model *m = NULL;
  td_status s = td_model_load(tmpdir, b, &mo, &m);
  cr_expect((s == TD_OK) == (m != NULL));
  td_model_destroy(m);
  td_backend_destroy(b);
  return s;
}

Test(loader, missing_tensor) {
  rewrite_t5("decoder.block.1.layer.1.EncDecAttention.v.weight", NULL);
  cr_expect_eq(load_tmp_model(), TD_ERR_FORMAT);
  cr_expect(strstr(td_errmsg(), "tensor \"decoder.block.1.layer.1.EncDecAttention.v.weight\" is missing"), "%s",
            td_errmsg());
}

Test(loader, missing_tied_embedding) {
  rewrite_t5("shared.weight", NULL);
  cr_expect_eq(load_tmp_model(), TD_ERR_FORMAT);
  cr_expect(strstr(td_errmsg(), "shared.weight"), "%s", td_errmsg());
}

Test(loader, wrong_shape) {
  rewrite_t5(NULL, "encoder.block.0.layer.1.DenseReluDense.wo.weight");
  cr_expect_eq(load_tmp_model(), TD_ERR_FORMAT);
  cr_expect(strstr(td_errmsg(), "\"encoder.block.0.layer.1.DenseReluDense.wo.weight\" has shape [1, 8192], expected [64, 128]"),
            "%s", td_errmsg());
}

Test(loader, unknown_model_type) {
  rewrite_t5(NULL, NULL);
  char p[600];
  snprintf(p, sizeof p, "%s/config.json", tmpdir);
  FILE *f = fopen(p, "w");
  fprintf(f, "{\"model_type\": \"gpt2\", \"vocab_size\": 300}");
  fclose(f);
  cr_expect_eq(load_tmp_model(), TD_ERR_UNSUPPORTED);
  cr_expect(strstr(td_errmsg(), "model_type \"gpt2\" is not supported"), "%s", td_errmsg());
}

Test(loader, bad_config_fields) {
  rewrite_t5(NULL, NULL);
  char p[600];
  snprintf(p, sizeof p, "%s/config.json", tmpdir);
  const char *cases[][2] = {
      {"{\"model_type\": \"t5\", \"vocab_size\": 300}", "missing field \"d_model\""},
      {"{\"model_type\": \"t5\", \"vocab_size\": 300, \"d_model\": 64, \"d_kv\": 16, \"d_ff\": 128, \"num_layers\": 2, "
       "\"num_heads\": 4, \"feed_forward_proj\": \"gated-swoosh\"}",
       "feed_forward_proj \"gated-swoosh\""},
      {"{\"model_type\": \"t5\", \"vocab_size\": \"many\"}", "\"vocab_size\" must be an integer"},
      {"{\"model_type\": \"bart\", \"vocab_size\": 300, \"d_model\": 64, \"encoder_layers\": 2, \"decoder_layers\": 2, "
       "\"encoder_attention_heads\": 5, \"decoder_attention_heads\": 4, \"encoder_ffn_dim\": 8, \"decoder_ffn_dim\": 8}",
       "not divisible"},
      {"{\"model_type\": \"t5\"", "malformed JSON"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    FILE *f = fopen(p, "w");
    fputs(cases[i][0], f);
    fclose(f);
    td_status s = load_tmp_model();
    cr_expect(s != TD_OK, "case %zu loaded", i);
    cr_expect(strstr(td_errmsg(), cases[i][1]), "case %zu: \"%s\" lacks \"%s\"", i, td_errmsg(), cases[i][1]);
    cr_expect(strstr(td_errmsg(), "config.json"), "case %zu: \"%s\" does not name the file", i, td_errmsg());
  }
}

Test(loader, missing_directory) {
  td_backend_opts bo = {.kind = TD_BACKEND_CPU};
  td_backend *b;
  cr_assert(td_backend_create(&bo, &b) == TD_OK);
  td_model_opts mo = {0};
  td_model *m = NULL;
  cr_expect(td_model_load("/nonexistent/model", b, &mo, &m) == TD_ERR_NOT_FOUND);
  cr_expect(strstr(td_errmsg(), "/nonexistent/model/config.json"), "%s", td_errmsg());
  td_backend_destroy(b);
}

/* transformers reads generation_config.json alone when it exists: a forced
 * EOS that only config.json names is not applied (issue 35, item 7). */
static void write_file(const char *name, const char *text) {
  char p[600];
  snprintf(p, sizeof p, "%s/%s", tmpdir, name);
  FILE *f = fopen(p, "w");
  cr_assert(f);
  fputs(text, f);
  fclose(f);
}

static cJSON *read_json(const char *path) {
  FILE *f = fopen(path, "rb");
  cr_assert(f, "%s", path);
  char buf[16384];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  cJSON *j = cJSON_Parse(buf);
  cr_assert(j, "%s", path);
  return j;
}

Test(loader, generation_config_alone) {
  cJSON *cfg = read_json(TD_TEST_DATA "/bart-tiny/config.json");
  cJSON *gen = read_json(TD_TEST_DATA "/bart-tiny/generation_config.json");
  cJSON_DeleteItemFromObject(cfg, "forced_eos_token_id");
  cJSON_AddNumberToObject(cfg, "forced_eos_token_id", 2);
  cJSON_DeleteItemFromObject(cfg, "forced_bos_token_id");
  cJSON_AddNumberToObject(cfg, "forced_bos_token_id", 0);
  cJSON_DeleteItemFromObject(gen, "forced_eos_token_id");
  cJSON_DeleteItemFromObject(gen, "forced_bos_token_id");
  char *c = cJSON_Print(cfg), *g = cJSON_Print(gen);
  write_file("config.json", c);
  write_file("generation_config.json", g);
  free(c);
  free(g);
  cJSON_Delete(cfg);
  cJSON_Delete(gen);
  td_model_config mc;
  td_gen_config gc;
  cr_assert_eq(td_model_config_load(tmpdir, &mc), TD_OK, "%s", td_errmsg());
  cr_assert_eq(td_gen_config_load(tmpdir, &mc, &gc), TD_OK, "%s", td_errmsg());
  cr_expect_eq(gc.forced_eos_token_id, -1, "config.json's forced EOS was merged in");
  cr_expect_eq(gc.forced_bos_token_id, -1, "config.json's forced BOS was merged in");
  cr_expect_eq(gc.decoder_start_token_id, 2);
  cr_expect_eq(gc.n_eos, 1);
  td_gen_config_free(&gc);
  /* without generation_config.json, config.json supplies them */
  char p[600];
  snprintf(p, sizeof p, "%s/generation_config.json", tmpdir);
  cr_assert_eq(unlink(p), 0);
  cr_assert_eq(td_gen_config_load(tmpdir, &mc, &gc), TD_OK, "%s", td_errmsg());
  cr_expect_eq(gc.forced_eos_token_id, 2);
  cr_expect_eq(gc.forced_bos_token_id, 0);
  td_gen_config_free(&gc);
}
