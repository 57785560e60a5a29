/* libFuzzer target for what the gateway parses from a client: the
 * /v1/completions body (JSON, prompts tokenized), stop strings cut from
 * streamed text, and Whisper's output split at timestamp tokens. Built
 * with clang where libFuzzer links (tests/unit/CMakeLists.txt). Any bytes
 * in: a result or a refusal, never a crash or a leak. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/internal.h"

static gw_model m;

static void once(void) {
  if (m.tok) return;
  if (td_tokenizer_load(TD_TEST_DATA "/toy-numbers-t5", NULL, &m.tok) != TD_OK) abort();
  snprintf(m.name, sizeof m.name, "toy-numbers-t5");
  m.vocab = td_tokenizer_vocab_size(m.tok);
  m.ts_begin = m.vocab - 8; /* pretend the last ids are timestamps */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  once();
  if (size < 1) return 0;
  const char *p = (const char *)data + 1;
  size_t n = size - 1;
  switch (data[0] % 3) {
    case 0: { /* a request body */
      gw_completion c;
      gw_error e;
      if (gw_completion_parse(p, n, &m, &c, &e)) gw_completion_free(&c);
      break;
    }
    case 1: { /* a stop string (up to the first NUL) over the rest as token ids */
      size_t l = strnlen(p, n < 16 ? n : 16);
      char stop[17];
      memcpy(stop, p, l);
      stop[l] = 0;
      const char *stops[] = {stop};
      gw_text t;
      if (gw_text_init(&t, m.tok, stops, l ? 1 : 0) != TD_OK) abort();
      for (size_t i = l; i < n; i++) {
        (void)gw_text_push(&t, (int32_t)((uint8_t)p[i] % (m.vocab + 2)) - 1);
        const char *s;
        size_t k;
        gw_text_take(&t, false, &s, &k);
      }
      (void)gw_text_finish(&t);
      const char *s;
      size_t k;
      gw_text_take(&t, true, &s, &k);
      gw_text_free(&t);
      break;
    }
    default: { /* generated ids with timestamps, to segments and subtitles */
      int32_t ids[256];
      int k = 0;
      for (size_t i = 0; i < n && k < 256; i++) ids[k++] = (int32_t)((uint8_t)p[i] % m.vocab);
      gw_segment *seg;
      int ns;
      char *text;
      if (gw_segments(&m, ids, k, 3.0, data[0] & 4, &seg, &ns, &text) == TD_OK) {
        gw_buf b = {0};
        gw_format_srt(&b, seg, ns);
        gw_format_vtt(&b, seg, ns);
        gw_buf_free(&b);
        gw_segments_free(seg, ns);
        free(text);
      }
      break;
    }
  }
  return 0;
}
