/* tokenizer.json components one at a time, on small hand-made files whose
 * outputs follow from the tokenizers library's rules (split behaviours,
 * added-token stripping, byte fallback, decoders, post-processors). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "frontend/tokenizer.h"

static td_tokenizer *mk(const char *json) {
  td_tokenizer *t = NULL;
  cr_assert_eq(td_tokenizer_from_json(json, strlen(json), NULL, 0, NULL, &t), TD_OK, "%s\n%s", td_errmsg(), json);
  return t;
}

static void expect_ids(td_tokenizer *t, const char *text, const int32_t *want, size_t n) {
  int32_t *ids;
  size_t k;
  cr_assert_eq(td_tokenizer_encode(t, text, strlen(text), true, &ids, &k), TD_OK, "%s", td_errmsg());
  char got[256] = "";
  for (size_t i = 0, o = 0; i < k && o < 240; i++) o += (size_t)snprintf(got + o, sizeof got - o, "%d ", ids[i]);
  cr_expect(k == n && (!n || !memcmp(ids, want, n * sizeof *ids)), "\"%s\": got %s", text, got);
  free(ids);
}

static void expect_text(td_tokenizer *t, const int32_t *ids, size_t n, bool skip, const char *want) {
  char *s;
  cr_assert_eq(td_tokenizer_decode(t, ids, n, skip, &s, NULL), TD_OK, "%s", td_errmsg());
  cr_expect_str_eq(s, want);
  /* and the stream gives the same */
  td_detok *d;
  cr_assert_eq(td_detok_create(t, skip, &d), TD_OK);
  char acc[512] = "";
  for (size_t i = 0; i <= n; i++) {
    const char *p;
    size_t k;
    cr_assert_eq(i < n ? td_detok_push(d, ids[i], &p, &k) : td_detok_finish(d, &p, &k), TD_OK, "%s", td_errmsg());
    strncat(acc, p, sizeof acc - strlen(acc) - 1);
  }
  cr_expect_str_eq(acc, want, "streamed");
  td_detok_destroy(d);
  free(s);
}

#define IDS(...) (const int32_t[]){__VA_ARGS__}, sizeof((const int32_t[]){__VA_ARGS__}) / sizeof(int32_t)

static const char *SPLIT_VOCAB =
    "\"model\": {\"type\": \"WordLevel\", \"unk_token\": \"[UNK]\", \"vocab\": {\"a\": 0, \"b\": 1, \"-\": 2, \"a-\": 3, "
    "\"b-\": 4, \"-a\": 5, \"-b\": 6, \"--\": 7, \"[UNK]\": 8, \"ab\": 9, \"12\": 10, \"cd\": 11}}";

static td_tokenizer *split_tok(const char *behavior, const char *pattern, bool invert) {
  char json[1024];
  snprintf(json, sizeof json, "{%s, \"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": %s, \"behavior\": \"%s\", \"invert\": %s}}",
           SPLIT_VOCAB, pattern, behavior, invert ? "true" : "false");
  return mk(json);
}

Test(tokenizer_components, split_behaviours) {
  static const struct {
    const char *b;
    int32_t ids[8];
    size_t n;
  } cases[] = {{"Removed", {0, 1, 0}, 3},
               {"Isolated", {0, 2, 1, 2, 2, 0}, 6},
               {"MergedWithPrevious", {3, 4, 2, 0}, 4},
               {"MergedWithNext", {0, 6, 2, 5}, 4},
               {"Contiguous", {0, 2, 1, 7, 0}, 5}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    td_tokenizer *t = split_tok(cases[i].b, "{\"String\": \"-\"}", false);
    expect_ids(t, "a-b--a", cases[i].ids, cases[i].n);
    td_tokenizer_destroy(t);
  }
  td_tokenizer *t = split_tok("Removed", "{\"String\": \"-\"}", true);
  expect_ids(t, "a-b--a", IDS(2, 2, 2));
  td_tokenizer_destroy(t);
  t = split_tok("Isolated", "{\"Regex\": \"\\\\d+\"}", false);
  expect_ids(t, "ab12cd", IDS(9, 10, 11));
  td_tokenizer_destroy(t);
}

Test(tokenizer_components, digits_punctuation_whitespace) {
  char json[1024];
  snprintf(json, sizeof json, "{%s, \"pre_tokenizer\": {\"type\": \"Digits\", \"individual_digits\": false}}", SPLIT_VOCAB);
  td_tokenizer *t = mk(json);
  expect_ids(t, "ab12cd", IDS(9, 10, 11));
  td_tokenizer_destroy(t);
  const char *wl = "\"model\": {\"type\": \"WordLevel\", \"unk_token\": \"?\", \"vocab\": {\"?\": 0, \"hi\": 1, \",\": 2, "
                   "\"there\": 3, \"!\": 4, \"!!\": 5, \"1\": 6, \"2\": 7}}";
  snprintf(json, sizeof json, "{%s, \"pre_tokenizer\": {\"type\": \"Punctuation\", \"behavior\": \"Isolated\"}}", wl);
  t = mk(json);
  expect_ids(t, "hi,there!!", IDS(1, 2, 3, 4, 4));
  td_tokenizer_destroy(t);
  snprintf(json, sizeof json, "{%s, \"pre_tokenizer\": {\"type\": \"Whitespace\"}}", wl);
  t = mk(json);
  expect_ids(t, "hi, there !!", IDS(1, 2, 3, 5));
  td_tokenizer_destroy(t);
  snprintf(json, sizeof json,
           "{%s, \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"WhitespaceSplit\"}, "
           "{\"type\": \"Digits\", \"individual_digits\": true}]}}", wl);
  t = mk(json);
  expect_ids(t, " hi\u3000\t12 ", IDS(1, 6, 7));
  td_tokenizer_destroy(t);
}

/* Prepend + Replace normalizers, BPE with byte fallback, and the decoder
 * chain that undoes them (Replace, ByteFallback, Fuse, Strip). */
static const char *BYTE_BPE =
    "{\"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"Prepend\", \"prepend\": \"\u2581\"}, "
    "{\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, \"content\": \"\u2581\"}]},"
    "\"model\": {\"type\": \"BPE\", \"unk_token\": \"<unk>\", \"byte_fallback\": true, \"fuse_unk\": true,"
    " \"vocab\": {\"<unk>\": 0, \"\u2581\": 1, \"a\": 2, \"b\": 3, \"\u2581a\": 4, \"ab\": 5, \"\u2581ab\": 6,"
    " \"<0xC3>\": 7, \"<0xA9>\": 8}, \"merges\": [[\"\u2581\", \"a\"], \"a b\", \"\u2581a b\"]},"
    "\"decoder\": {\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Replace\", \"pattern\": {\"String\": \"\u2581\"},"
    " \"content\": \" \"}, {\"type\": \"ByteFallback\"}, {\"type\": \"Fuse\"},"
    " {\"type\": \"Strip\", \"content\": \" \", \"start\": 1, \"stop\": 0}]}}";

Test(tokenizer_components, bpe_byte_fallback_and_its_decoders) {
  td_tokenizer *t = mk(BYTE_BPE);
  expect_ids(t, "ab \xC3\xA9", IDS(6, 1, 7, 8));
  expect_ids(t, "ab zz", IDS(6, 1, 0)); /* no <0x7A>: unk, fused */
  expect_text(t, IDS(6, 1, 7, 8), false, "ab \xC3\xA9");
  expect_text(t, IDS(7), false, "\xEF\xBF\xBD");
  expect_text(t, IDS(7, 7, 2), false, "\xEF\xBF\xBD\xEF\xBF\xBD" "a"); /* one U+FFFD a byte */
  /* a run of bytes that is not UTF-8 as a whole: U+FFFD for each byte of it */
  expect_text(t, IDS(4, 7, 8, 7), false, "a\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  expect_text(t, IDS(4, 7, 8, 1), false, "a\xC3\xA9 ");
  td_tokenizer_destroy(t);
}

Test(tokenizer_components, unigram_byte_fallback) {
  td_tokenizer *t = mk("{\"model\": {\"type\": \"Unigram\", \"unk_id\": 0, \"byte_fallback\": true, \"vocab\": "
                       "[[\"<unk>\", 0], [\"a\", -1], [\"<0xC3>\", -2], [\"<0xA9>\", -2], [\"ab\", -1.5], [\"b\", -1]]}}");
  expect_ids(t, "a\xC3\xA9", IDS(1, 2, 3));
  expect_ids(t, "ab", IDS(4)); /* one piece beats two (-1.5 > -2) */
  td_tokenizer_destroy(t);
}

static const char *ADDED =
    "{\"model\": {\"type\": \"WordLevel\", \"unk_token\": \"[UNK]\", \"vocab\": {\"x\": 0, \"y\": 1, \"[UNK]\": 2,"
    " \"x \": 6, \" y\": 7}},"
    "\"added_tokens\": [{\"id\": 3, \"content\": \"<m>\", \"lstrip\": true, \"special\": true},"
    " {\"id\": 4, \"content\": \"tok\", \"single_word\": true, \"special\": false},"
    " {\"id\": 5, \"content\": \"<r>\", \"rstrip\": true, \"special\": true},"
    " {\"id\": 8, \"content\": \"<mm>\", \"special\": true}]}";

Test(tokenizer_components, added_tokens_strip_and_single_word) {
  td_tokenizer *t = mk(ADDED);
  expect_ids(t, "x <m> y", IDS(0, 3, 7));
  expect_ids(t, "x<r>  y", IDS(0, 5, 1));
  expect_ids(t, "tokx", IDS(2));
  expect_ids(t, "x tok y", IDS(6, 4, 7));
  expect_ids(t, "<mm><m>", IDS(8, 3)); /* longest match first */
  cr_expect_eq(td_tokenizer_vocab_size(t), 9);
  cr_expect(td_tokenizer_is_special(t, 3));
  cr_expect(!td_tokenizer_is_special(t, 4));
  expect_text(t, IDS(0, 3, 4, 1), false, "x <m> tok y"); /* no decoder: tokens joined by spaces */
  expect_text(t, IDS(0, 3, 4, 1), true, "x tok y");
  td_tokenizer_destroy(t);
}

Test(tokenizer_components, normalizers) {
  const char *base = "\"model\": {\"type\": \"WordLevel\", \"unk_token\": \"?\", \"vocab\": {\"?\": 0, \"cafe\": 1,"
                     " \"unicode\": 2, \"fi\": 3, \"i\u0307\": 4}}, \"pre_tokenizer\": {\"type\": \"WhitespaceSplit\"}";
  char json[1024];
  snprintf(json, sizeof json,
           "{%s, \"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"NFD\"}, {\"type\": \"StripAccents\"},"
           " {\"type\": \"Lowercase\"}, {\"type\": \"Strip\", \"strip_left\": true, \"strip_right\": true}]}}", base);
  td_tokenizer *t = mk(json);
  expect_ids(t, "  CAF\xC3\x89  \xC3\x9Cn\xC3\xAF" "code ", IDS(1, 2));
  td_tokenizer_destroy(t);
  snprintf(json, sizeof json,
           "{%s, \"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"NFKC\"}, {\"type\": \"Lowercase\"}]}}", base);
  t = mk(json);
  expect_ids(t, "\xEF\xAC\x81 \xC4\xB0", IDS(3, 4)); /* U+FB01 -> fi; U+0130 lowercases to two characters */
  td_tokenizer_destroy(t);
  snprintf(json, sizeof json,
           "{%s, \"normalizer\": {\"type\": \"BertNormalizer\", \"clean_text\": true, \"handle_chinese_chars\": true,"
           " \"strip_accents\": null, \"lowercase\": true}}", base);
  t = mk(json);
  expect_ids(t, "Caf\xC3\xA9\x01 UNICODE", IDS(1, 2));
  td_tokenizer_destroy(t);
}

Test(tokenizer_components, metaspace_schemes) {
  const char *v = "\"model\": {\"type\": \"WordLevel\", \"unk_token\": \"?\", \"vocab\": {\"?\": 0, \"\u2581a\": 1, \"a\": 2,"
                  " \"\u2581b\": 3, \"b\": 4, \"\u2581\": 5}}, \"added_tokens\": [{\"id\": 6, \"content\": \"<s>\", \"special\": true}]";
  static const struct {
    const char *scheme;
    int32_t ids[6];
    size_t n;
  } cases[] = {{"always", {1, 6, 3}, 3}, {"first", {1, 6, 4}, 3}, {"never", {2, 6, 4}, 3}};
  for (size_t i = 0; i < 3; i++) {
    char json[1024];
    snprintf(json, sizeof json,
             "{%s, \"pre_tokenizer\": {\"type\": \"Metaspace\", \"replacement\": \"\u2581\", \"prepend_scheme\": \"%s\","
             " \"split\": true}, \"decoder\": {\"type\": \"Metaspace\", \"replacement\": \"\u2581\", \"prepend_scheme\":"
             " \"%s\", \"split\": true}}", v, cases[i].scheme, cases[i].scheme);
    td_tokenizer *t = mk(json);
    expect_ids(t, "a<s>b", cases[i].ids, cases[i].n);
    td_tokenizer_destroy(t);
  }
  char json[1024];
  snprintf(json, sizeof json, "{%s, \"decoder\": {\"type\": \"Metaspace\", \"replacement\": \"\u2581\", \"prepend_scheme\": \"always\"}}", v);
  td_tokenizer *t = mk(json);
  expect_text(t, IDS(1, 3, 5, 2), false, "a b a"); /* the first token's leading mark goes */
  expect_text(t, IDS(6, 1, 3), true, "a b");
  expect_text(t, IDS(6, 1, 3), false, "<s> a b");
  td_tokenizer_destroy(t);
}

Test(tokenizer_components, post_processors) {
  const char *v = "\"model\": {\"type\": \"WordLevel\", \"unk_token\": \"?\", \"vocab\": {\"<s>\": 0, \"</s>\": 2, \"?\": 3, \"hi\": 4}},"
                  " \"pre_tokenizer\": {\"type\": \"WhitespaceSplit\"}";
  char json[1024];
  snprintf(json, sizeof json, "{%s, \"post_processor\": {\"type\": \"RobertaProcessing\", \"sep\": [\"</s>\", 2], \"cls\": [\"<s>\", 0],"
                              " \"trim_offsets\": true, \"add_prefix_space\": false}}", v);
  td_tokenizer *t = mk(json);
  expect_ids(t, "hi hi", IDS(0, 4, 4, 2));
  expect_ids(t, "", IDS(0, 2));
  td_tokenizer_destroy(t);
  snprintf(json, sizeof json,
           "{%s, \"post_processor\": {\"type\": \"Sequence\", \"processors\": [{\"type\": \"ByteLevel\", \"trim_offsets\": true},"
           " {\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": \"P\", \"type_id\": 0}},"
           " {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}], \"pair\": [], \"special_tokens\": {\"P\": {\"id\": \"P\","
           " \"ids\": [2, 0], \"tokens\": [\"</s>\", \"<s>\"]}}}]}}", v);
  t = mk(json);
  expect_ids(t, "hi", IDS(2, 0, 4));
  int32_t *ids;
  size_t n;
  cr_assert_eq(td_tokenizer_encode(t, "hi", 2, false, &ids, &n), TD_OK);
  cr_expect_eq(n, 1, "add_special false: no post-processing");
  free(ids);
  td_tokenizer_destroy(t);
}

Test(tokenizer_components, wordpiece_and_bpe_decoders) {
  const char *v = "\"model\": {\"type\": \"WordLevel\", \"unk_token\": \"?\", \"vocab\": {\"?\": 0, \"hel\": 1, \"##lo\": 2,"
                  " \"world\": 3, \".\": 4, \"lo</w>\": 5, \"world</w>\": 6}}";
  char json[1024];
  snprintf(json, sizeof json, "{%s, \"decoder\": {\"type\": \"WordPiece\", \"prefix\": \"##\", \"cleanup\": true}}", v);
  td_tokenizer *t = mk(json);
  expect_text(t, IDS(1, 2, 3, 4), false, "hello world.");
  td_tokenizer_destroy(t);
  snprintf(json, sizeof json, "{%s, \"decoder\": {\"type\": \"BPEDecoder\", \"suffix\": \"</w>\"}}", v);
  t = mk(json);
  expect_text(t, IDS(1, 5, 6), false, "hello world");
  td_tokenizer_destroy(t);
}
