/* libFuzzer target: a model folder's config.json and generation_config.json
 * as td_model_config_load and td_gen_config_load read them (from files, so
 * each input is written into a private temporary folder). The first byte
 * picks:
 *   0: the rest is config.json, with no generation_config.json (the ids
 *      then come from config.json);
 *   1-3: the rest is generation_config.json next to the config.json of the
 *      t5-tiny, bart-tiny or whisper-tiny fixture.
 * Any bytes: a configuration or a refusal; an accepted one has the sizes
 * and ids the model code relies on. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/config.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *fixtures[] = {"t5-tiny", "bart-tiny", "whisper-tiny"};
static char dirs[4][64];

static void put(const char *dir, const char *name, const void *p, size_t n) {
  char path[128];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  if (!f || (n && fwrite(p, 1, n, f) != n) || fclose(f) != 0) abort();
}

static void cleanup(void) {
  for (int i = 0; i < 4; i++) {
    char p[128];
    snprintf(p, sizeof p, "%s/config.json", dirs[i]);
    unlink(p);
    snprintf(p, sizeof p, "%s/generation_config.json", dirs[i]);
    unlink(p);
    rmdir(dirs[i]);
  }
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  const char *tmp = getenv("TMPDIR");
  for (int i = 0; i < 4; i++) {
    snprintf(dirs[i], sizeof dirs[i], "%s/fuzz_cfg.XXXXXX", tmp && *tmp && strlen(tmp) < 40 ? tmp : "/tmp");
    if (!mkdtemp(dirs[i])) abort();
  }
  atexit(cleanup);
  for (int i = 1; i < 4; i++) { /* the fixture's config.json */
    char path[512];
    snprintf(path, sizeof path, "%s/%s/config.json", TD_TEST_DATA, fixtures[i - 1]);
    FILE *f = fopen(path, "rb");
    static char buf[1 << 16];
    size_t n = f ? fread(buf, 1, sizeof buf, f) : 0;
    if (!f || n == 0 || n == sizeof buf) abort();
    fclose(f);
    put(dirs[i], "config.json", buf, n);
  }
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  int k = data[0] % 4;
  put(dirs[k], k ? "generation_config.json" : "config.json", data + 1, size - 1);
  td_model_config c;
  if (td_model_config_load(dirs[k], &c) != TD_OK) {
    if (k) abort(); /* the fixture's config.json is valid */
    return 0;
  }
  if (c.d_model <= 0 || c.vocab_size <= 0 || c.enc_layers <= 0 || c.dec_layers <= 0 || c.enc_heads <= 0 ||
      c.dec_heads <= 0 || c.enc_head_dim <= 0 || c.dec_head_dim <= 0 || c.max_source_len <= 0 ||
      c.max_target_len <= 0 || !memchr(c.model_type, 0, sizeof c.model_type))
    abort();
  td_gen_config g;
  if (td_gen_config_load(dirs[k], &c, &g) == TD_OK) {
    if (g.n_eos < 1 || g.n_eos > TD_MAX_EOS || g.decoder_start_token_id < 0 || g.decoder_start_token_id >= c.vocab_size)
      abort();
    for (int i = 0; i < g.n_eos; i++)
      if (g.eos_ids[i] < 0 || g.eos_ids[i] >= c.vocab_size) abort();
    for (int i = 0; i < g.n_suppress; i++)
      if (g.suppress[i] < 0 || g.suppress[i] >= c.vocab_size) abort();
    for (int i = 0; i < g.n_begin_suppress; i++)
      if (g.begin_suppress[i] < 0 || g.begin_suppress[i] >= c.vocab_size) abort();
    (void)td_gen_is_eos(&g, g.eos_ids[0]);
    td_gen_config_free(&g);
  }
  return 0;
}
