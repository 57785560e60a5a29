/* Engine throughput on the CPU backend: generated tokens per second against
 * batch size, for the fixture models and a T5-small-shaped random model.
 *   bench-cpu-throughput [--quick] [--no-record] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench_util.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/settings.h"
#include "engine/engine.h"
#include "random_model.h"

typedef struct res {
  double secs;
  long tokens;
} res;

static void on_finish(void *ctx, const td_result *r) { (void)ctx, (void)r; }

static int run(const char *dir, const td_model_tuning *tuning, int batch, int in_len, int new_tokens, res *out) {
  td_backend_opts bo = {.kind = TD_BACKEND_CPU};
  td_backend *b = NULL;
  td_model *m = NULL;
  td_engine *e = NULL;
  int rc = -1;
  if (td_backend_create(&bo, &b) != TD_OK) goto out;
  td_model_opts mo = {.block_size = 16, .max_seqs = batch, .max_tokens = batch * in_len > 512 ? batch * in_len : 512,
                      .max_enc_tokens = batch * 1500 > 4096 ? batch * 1500 : 4096, .max_enc_seqs = batch,
                      .tuning = *tuning};
  if (td_model_load(dir, b, &mo, &m) != TD_OK) goto out;
  const td_model_config *c = td_model_get_config(m);
  td_engine_opts eo = {.max_running = batch};
  td_engine_callbacks cb = {.on_finish = on_finish};
  if (td_engine_create(m, &eo, &cb, &e) != TD_OK) goto out;
  int frames = td_model_input_frames(m);
  float *feat = frames ? calloc((size_t)c->num_mel_bins * frames, sizeof(float)) : NULL;
  for (int i = 0; feat && i < c->num_mel_bins * frames; i++) feat[i] = (float)((i * 7919) % 1000) / 500.0f - 1.0f;
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)in_len);
  for (int r = 0; r < batch; r++) {
    for (int t = 0; t < in_len; t++) ids[t] = 3 + (r * 131 + t * 17) % (c->vocab_size - 3);
    td_request q = {.id = "bench", .input_ids = ids, .n_input = in_len, .features = feat};
    td_request_params_default(&q.params);
    q.params.max_new_tokens = new_tokens;
    q.params.ignore_eos = true;
    q.params.forced_eos = -1;
    uint64_t h;
    if (td_engine_add(e, &q, &h) != TD_OK) goto out_free;
  }
  int64_t t0 = td_now_ns();
  while (!td_engine_idle(e))
    if (td_engine_step(e) != TD_OK) goto out_free;
  out->secs = (double)(td_now_ns() - t0) * 1e-9;
  out->tokens = td_engine_get_stats(e).tokens_generated;
  rc = 0;
out_free:
  free(ids);
  free(feat);
out:
  if (rc) fprintf(stderr, "bench: %s\n", td_errmsg());
  td_engine_destroy(e);
  td_model_destroy(m);
  td_backend_destroy(b);
  return rc;
}

int main(int argc, char **argv) {
  td_settings settings;
  if (td_settings_from_env(&settings) != TD_OK) {
    fprintf(stderr, "bench: %s\n", td_errmsg());
    return 2;
  }
  td_settings_apply(&settings);
  const td_bench_out out = {.results = getenv("TD_RESULTS"), .commit = getenv("TD_COMMIT")};
  bool quick = false, record = true;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--quick")) quick = true;
    if (!strcmp(argv[i], "--no-record")) record = false;
  }
  td_log_set_level(TD_LOG_WARN);
  char small[] = "/tmp/td-bench-t5small-XXXXXX";
  if (!mkdtemp(small)) return 1;
  td_random_shape sh = {.model_type = "t5", .d_model = 512, .enc_layers = 6, .dec_layers = 6, .heads = 8,
                        .head_dim = 64, .ffn = 2048, .vocab = 32128, .max_positions = 512};
  if (td_random_model_write(small, &sh, 1)) return 1;
  struct {
    const char *name, *dir;
  } models[] = {{"t5-tiny", TD_TEST_DATA "/t5-tiny"},
                {"bart-tiny", TD_TEST_DATA "/bart-tiny"},
                {"whisper-tiny", TD_TEST_DATA "/whisper-tiny"},
                {"t5-small shape (random)", small}};
  int batches[] = {1, 4, 16, 64};
  int nb = quick ? 2 : 4;
  td_sbuf t = {0};
  td_sbuf_printf(&t, "Greedy generation through the engine on the CPU backend (OpenBLAS), encoder input 32 tokens, "
                     "32 new tokens per request, all requests submitted at once.\n\n");
  td_sbuf_printf(&t, "| model | batch | wall s | tokens | tokens/s |\n|---|---|---|---|---|\n");
  printf("%-26s %6s %9s %8s %10s\n", "model", "batch", "wall s", "tokens", "tokens/s");
  for (size_t mi = 0; mi < sizeof models / sizeof models[0]; mi++) {
    for (int bi = 0; bi < nb; bi++) {
      int batch = batches[bi];
      if (mi == 3 && batch > 16 && quick) continue;
      res r;
      if (run(models[mi].dir, &settings.model, batch, 32, 32, &r)) return 1;
      double tps = r.tokens / r.secs;
      printf("%-26s %6d %9.3f %8ld %10.1f\n", models[mi].name, batch, r.secs, r.tokens, tps);
      td_sbuf_printf(&t, "| %s | %d | %.3f | %ld | %.1f |\n", models[mi].name, batch, r.secs, r.tokens, tps);
    }
  }
  char cmd[256];
  snprintf(cmd, sizeof cmd, "rm -rf %s", small);
  if (system(cmd)) fprintf(stderr, "could not remove %s\n", small);
  if (record) td_bench_record(&out, "CPU engine throughput (bench-cpu-throughput)", td_bench_cpu_name(), t.s);
  td_sbuf_free(&t);
  return 0;
}
