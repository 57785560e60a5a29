/* libFuzzer target: checkpoint files as td_checkpoint_open reads them (it
 * maps files, so each input is written to a file in a private temporary
 * folder). The first byte picks:
 *   even: the rest is a .safetensors file (header length, JSON header,
 *         data); every tensor it lists is then converted to float32
 *         (td_tensor_read_f32) as the loader does;
 *   odd:  the rest is model.safetensors.index.json in a folder that holds
 *         two small valid shards, a.safetensors (x: F32 [2]) and
 *         b.safetensors (y: BF16 [2, 2], z: F16 [0]).
 * Any bytes: a checkpoint or a refusal, never a crash or a leak. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/safetensors.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char dir[64], file[96], sharded[96], index_path[160], shard_a[160], shard_b[160];

static void put(const char *path, const void *p, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f || (n && fwrite(p, 1, n, f) != n) || fclose(f) != 0) abort();
}

/* A safetensors file of one header and its data. */
static void shard(const char *path, const char *hdr, const void *body, size_t n) {
  uint8_t b[512];
  size_t h = strlen(hdr);
  for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)h >> (8 * i));
  memcpy(b + 8, hdr, h);
  memcpy(b + 8 + h, body, n);
  put(path, b, 8 + h + n);
}

static void cleanup(void) {
  unlink(file);
  unlink(index_path);
  unlink(shard_a);
  unlink(shard_b);
  rmdir(sharded);
  rmdir(dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  const char *tmp = getenv("TMPDIR");
  snprintf(dir, sizeof dir, "%s/fuzz_st.XXXXXX", tmp && *tmp && strlen(tmp) < 40 ? tmp : "/tmp");
  if (!mkdtemp(dir)) abort();
  snprintf(file, sizeof file, "%s/x.safetensors", dir);
  snprintf(sharded, sizeof sharded, "%s/sharded", dir);
  snprintf(index_path, sizeof index_path, "%s/model.safetensors.index.json", sharded);
  snprintf(shard_a, sizeof shard_a, "%s/a.safetensors", sharded);
  snprintf(shard_b, sizeof shard_b, "%s/b.safetensors", sharded);
  if (mkdir(sharded, 0700) != 0) abort();
  atexit(cleanup);
  const float x[2] = {1.5f, -2.0f};
  const uint16_t y[4] = {0x3f80, 0xbf80, 0x4000, 0x7f80}; /* bf16 1, -1, 2, inf */
  shard(shard_a, "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", x, sizeof x);
  shard(shard_b,
        "{\"__metadata__\":{\"format\":\"pt\"},\"y\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,8]},"
        "\"z\":{\"dtype\":\"F16\",\"shape\":[0],\"data_offsets\":[8,8]}}",
        y, sizeof y);
  return 0;
}

static void read_all(const td_checkpoint *ck) {
  size_t n = td_checkpoint_count(ck);
  for (size_t i = 0; i < n; i++) {
    const td_tensor_info *t = td_checkpoint_at(ck, i);
    if (!t || td_checkpoint_find(ck, t->name) != t) abort();
    if (t->numel > (1 << 16)) continue; /* large tensors only cost time */
    float *dst = malloc(sizeof(float) * (size_t)(t->numel ? t->numel : 1));
    if (!dst) abort();
    (void)td_tensor_read_f32(t, t->ndim, t->shape, dst);
    free(dst);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  bool idx = data[0] & 1;
  put(idx ? index_path : file, data + 1, size - 1);
  td_checkpoint *ck;
  if (td_checkpoint_open(idx ? sharded : file, &ck) == TD_OK) {
    read_all(ck);
    td_checkpoint_close(ck);
  }
  return 0;
}
