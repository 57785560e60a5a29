/* libFuzzer target for the tokenizer (clang -fsanitize=fuzzer): the first
 * byte picks what the rest is: a tokenizer.json, text for one of the test
 * tokenizers, or ids for one of them. Any of it must end in a result or a
 * clear error; the streamed decode must equal the one-shot decode.
 *
 *   build-asan/bin/fuzz_tokenizer -max_total_time=600 CORPUS_DIR   (longer runs by hand)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "frontend/tokenizer.h"

static const char *names[] = {"bytelevel-bpe", "metaspace-unigram", "toy-numbers-t5", "whisper-large-v3", "marian-local"};
static td_tokenizer *toks[sizeof names / sizeof *names];

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/tokenizers/%s", TD_TEST_DATA, names[i]);
    if (td_tokenizer_load(dir, NULL, &toks[i]) != TD_OK) {
      fprintf(stderr, "fuzz_tokenizer: %s\n", td_errmsg());
      abort();
    }
  }
  return 0;
}

static void decode_both_ways(const td_tokenizer *t, const int32_t *ids, size_t n, bool skip) {
  char *one = NULL;
  size_t len = 0;
  if (td_tokenizer_decode(t, ids, n, skip, &one, &len) != TD_OK) return; /* a bad id: refused, fine */
  td_detok *d;
  if (td_detok_create(t, skip, &d) != TD_OK) abort();
  char *acc = malloc(len + 1);
  size_t k = 0;
  for (size_t i = 0; i <= n; i++) {
    const char *p;
    size_t pl;
    if ((i < n ? td_detok_push(d, ids[i], &p, &pl) : td_detok_finish(d, &p, &pl)) != TD_OK) {
      fprintf(stderr, "stream failed: %s\n", td_errmsg());
      abort();
    }
    if (k + pl > len) abort(); /* more text than the one-shot decode */
    memcpy(acc + k, p, pl);
    k += pl;
  }
  if (k != len || memcmp(acc, one, len)) abort();
  td_detok_destroy(d);
  free(acc);
  free(one);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!size) return 0;
  unsigned mode = data[0] % 3;
  const td_tokenizer *t = toks[(data[0] / 3) % (sizeof toks / sizeof *toks)];
  data++, size--;
  if (mode == 0) { /* a tokenizer.json */
    td_tokenizer *x;
    if (td_tokenizer_from_json((const char *)data, size, NULL, 0, NULL, &x) != TD_OK) return 0;
    int32_t *ids;
    size_t n;
    if (td_tokenizer_encode(x, "Hello, w\xC3\xB6rld 42 <s> \xF0\x9F\x99\x82", 22, true, &ids, &n) == TD_OK) {
      decode_both_ways(x, ids, n, false);
      free(ids);
    }
    td_tokenizer_destroy(x);
  } else if (mode == 1) { /* text */
    int32_t *ids;
    size_t n;
    if (td_tokenizer_encode(t, (const char *)data, size, true, &ids, &n) != TD_OK) abort(); /* any text encodes */
    decode_both_ways(t, ids, n, false);
    decode_both_ways(t, ids, n, true);
    free(ids);
  } else { /* ids, some out of range */
    size_t n = size / 2;
    int32_t *ids = malloc((n + 1) * sizeof *ids);
    int32_t v = td_tokenizer_vocab_size(t);
    for (size_t i = 0; i < n; i++) {
      uint32_t x = (uint32_t)data[2 * i] | (uint32_t)data[2 * i + 1] << 8;
      ids[i] = x & 0x8000 ? (int32_t)(x % (uint32_t)(v + 4)) - 2 : (int32_t)(x % 400); /* low ids: bytes, pieces */
    }
    decode_both_ways(t, ids, n, size && (data[0] & 1));
    free(ids);
  }
  return 0;
}
