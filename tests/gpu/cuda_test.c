/* The CUDA op tests' shared pieces (cuda_test.h) and their main, which
 * reads the environment once: the tuning G is created with, the seed
 * (TD_TEST_SEED=N repeats a run) and the attn_states selection. */
#include "cuda_test.h"

#include <time.h>
#include <unistd.h>

#include "gpu_main.h"

td_backend *G, *C;
uint64_t rs;
td_cuda_tuning cuda_base;
const char *states_variant, *states_case_only;
static const char *seed_env;

static void setup(void) {
  rs = seed_env ? strtoull(seed_env, NULL, 10) : ((uint64_t)time(NULL) * 1000003u) ^ (uint64_t)getpid();
  fprintf(stderr, "seed %llu\n", (unsigned long long)rs);
  td_backend_opts go = {.kind = TD_BACKEND_CUDA, .device = 0, .cuda = cuda_base}, co = {.kind = TD_BACKEND_CPU};
  cr_assert(td_backend_create(&go, &G) == TD_OK, "cuda backend: %s", td_errmsg());
  cr_assert(td_backend_create(&co, &C) == TD_OK, "cpu backend: %s", td_errmsg());
}

static void teardown(void) {
  td_backend_destroy(G);
  td_backend_destroy(C);
}

TestSuite(cuda, .init = setup, .fini = teardown, .timeout = 600);

void use_tuning(const td_cuda_tuning *t) {
  cr_assert(td_backend_set_cuda_tuning(G, t) == TD_OK, "%s", td_errmsg());
}

uint64_t next64(void) {
  uint64_t z = (rs += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
float urand(void) { return (float)((double)(next64() >> 40) / 16777216.0) * 2.0f - 1.0f; }
int irand(int n) { return (int)(next64() % (uint64_t)n); }
float bfr(float x) { return td_bf16_to_f32(td_f32_to_bf16(x)); }

float *rnd(size_t n, float scale) {
  float *a = malloc(sizeof(float) * (n ? n : 1));
  cr_assert(a);
  for (size_t i = 0; i < n; i++) a[i] = bfr(urand() * scale);
  return a;
}

void put(pair *p, const void *h) {
  cr_assert(td_upload(G, p->t, p->g, h, p->n) == TD_OK, "%s", td_errmsg());
  cr_assert(td_upload(C, p->t, p->c, h, p->n) == TD_OK, "%s", td_errmsg());
}

void poison(pair *p) {
  float *nan = malloc(sizeof(float) * (p->n ? p->n : 1));
  for (size_t i = 0; i < p->n; i++) nan[i] = NAN;
  if (p->t == TD_BUF_I32) memset(nan, 0x7f, sizeof(float) * p->n);
  put(p, nan);
  free(nan);
}

void poison_gpu(pair *p) {
  float *nan = malloc(sizeof(float) * (p->n ? p->n : 1));
  for (size_t i = 0; i < p->n; i++) nan[i] = NAN;
  cr_assert(td_upload(G, p->t, p->g, nan, p->n) == TD_OK, "%s", td_errmsg());
  free(nan);
}

pair mk(td_buf_type t, const void *h, size_t n) {
  pair p = {NULL, NULL, n, t};
  cr_assert(td_alloc(G, t, n, &p.g) == TD_OK, "%s", td_errmsg());
  cr_assert(td_alloc(C, t, n, &p.c) == TD_OK, "%s", td_errmsg());
  if (h) put(&p, h);
  else poison(&p);
  return p;
}

void drop(pair *p) {
  td_free(G, p->g);
  td_free(C, p->c);
}

float *get(td_backend *b, const pair *p, bool gpu) {
  float *h = malloc(sizeof(float) * (p->n ? p->n : 1));
  cr_assert(td_sync(b) == TD_OK, "%s", td_errmsg());
  cr_assert(td_download(b, p->t, gpu ? p->g : p->c, h, p->n) == TD_OK, "%s", td_errmsg());
  return h;
}

double relerr(const float *out, const float *ref, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; i++) {
    if (!isfinite(out[i])) {
      if (isfinite(ref[i]) || isnan(out[i]) || out[i] != ref[i]) return INFINITY;
      continue;
    }
    double d = (double)out[i] - ref[i];
    num += d * d;
    den += (double)ref[i] * ref[i];
  }
  if (den == 0.0) return num == 0.0 ? 0.0 : INFINITY;
  return sqrt(num / den);
}

void explain(const pair *p, int m, int n) {
  float *o = get(G, p, true), *r = get(C, p, false);
  int shown = 0, bad = 0;
  for (int i = 0; i < m; i++)
    for (int j = 0; j < n; j++) {
      float d = fabsf(o[(size_t)i * n + j] - r[(size_t)i * n + j]);
      if (!(d <= 0.02f * (1.0f + fabsf(r[(size_t)i * n + j])))) {
        if (shown++ < 6) fprintf(stderr, "  [%d, %d]: gpu %g, cpu %g\n", i, j, o[(size_t)i * n + j], r[(size_t)i * n + j]);
        bad++;
      }
    }
  fprintf(stderr, "  %d of %d elements off\n", bad, m * n);
  free(o);
  free(r);
}

double compare(const pair *p, size_t n) {
  float *o = get(G, p, true), *r = get(C, p, false);
  double e = relerr(o, r, n ? n : p->n);
  free(o);
  free(r);
  return e;
}

void rig_pool(paged_rig *r, int layers, int H, int dh, int bs, int states, int n_blocks) {
  r->l = (td_kv_layout){layers, H, dh, bs, states, 0};
  r->n_blocks = n_blocks;
  size_t n = td_kv_block_elems(&r->l) * n_blocks;
  r->pool_h = rnd(n, 2.0f);
  r->pool = mk(TD_BUF_ACT, r->pool_h, n);
}

void rig_drop(paged_rig *r) {
  drop(&r->pool);
  free(r->pool_h);
}

static void read_env(void) {
  seed_env = getenv("TD_TEST_SEED");
  states_variant = getenv("TD_TEST_STATES_VARIANT");
  states_case_only = getenv("TD_TEST_STATES_CASE");
  td_gpu_read_env(&cuda_base);
}
TD_GPU_ENV(read_env)

int main(int argc, char *argv[]) {
  read_env();
  return td_gpu_test_main(argc, argv, &cuda_base);
}
