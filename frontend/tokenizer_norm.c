/* Normalizers of tokenizer.json: NFC / NFD / NFKC / NFKD (utf8proc),
 * Lowercase, Strip, StripAccents, Replace, Prepend, BertNormalizer,
 * ByteLevel, Precompiled (SentencePiece's charsmap, as T5 / mT5 ship it) and
 * Sequence. Each works on the whole string: offsets are not tracked, nothing
 * here needs them. */
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "frontend/tokenizer_impl.h"

typedef enum {
  N_NFC, N_NFD, N_NFKC, N_NFKD, N_LOWER, N_STRIP, N_STRIP_ACCENTS, N_REPLACE, N_PREPEND, N_BERT, N_BYTELEVEL,
  N_PRECOMPILED, N_SEQUENCE
} norm_kind;

struct tk_norm {
  norm_kind kind;
  bool left, right;                       /* Strip */
  bool clean_text, chinese, accents, lower; /* BertNormalizer */
  tk_regex *re;                           /* Replace */
  char *content;                          /* Replace, Prepend */
  uint32_t *trie;                         /* Precompiled: the double array */
  size_t trie_n;
  char *blob;                             /* ... and its NUL-separated normalized strings */
  size_t blob_n;
  tk_norm **seq;
  size_t nseq;
};

void tk_norm_free(tk_norm *n) {
  if (!n) return;
  for (size_t i = 0; i < n->nseq; i++) tk_norm_free(n->seq[i]);
  free(n->seq);
  tk_regex_free(n->re);
  free(n->content);
  free(n->trie);
  free(n->blob);
  free(n);
}

static int b64val(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

static td_status b64decode(const char *s, uint8_t **out, size_t *n) {
  size_t len = strlen(s);
  uint8_t *o = malloc(len / 4 * 3 + 3);
  if (!o) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  size_t k = 0;
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < len; i++) {
    if (s[i] == '=') break;
    int v = b64val(s[i]);
    if (v < 0) {
      free(o);
      return td_err(TD_ERR_FORMAT, "tokenizer.json: Precompiled: precompiled_charsmap is not base64");
    }
    acc = (acc << 6) | (uint32_t)v;
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      o[k++] = (uint8_t)(acc >> bits);
    }
  }
  *out = o;
  *n = k;
  return TD_OK;
}

static td_status parse_precompiled(const cJSON *j, tk_norm *n) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, "precompiled_charsmap");
  if (cJSON_IsNull(v) || (cJSON_IsString(v) && !v->valuestring[0])) return TD_OK; /* identity */
  if (!cJSON_IsString(v)) return td_err(TD_ERR_FORMAT, "tokenizer.json: Precompiled: no precompiled_charsmap");
  uint8_t *raw = NULL;
  size_t len = 0;
  TD_TRY(b64decode(v->valuestring, &raw, &len));
  td_status st = TD_OK;
  uint32_t trie_bytes = 0;
  if (len < 4) st = td_err(TD_ERR_FORMAT, "tokenizer.json: Precompiled: charsmap truncated");
  else {
    trie_bytes = (uint32_t)raw[0] | (uint32_t)raw[1] << 8 | (uint32_t)raw[2] << 16 | (uint32_t)raw[3] << 24;
    if (trie_bytes > len - 4 || trie_bytes % 4)
      st = td_err(TD_ERR_FORMAT, "tokenizer.json: Precompiled: charsmap's trie size %u does not fit its %zu bytes",
                  trie_bytes, len);
  }
  if (st == TD_OK) {
    n->trie_n = trie_bytes / 4;
    n->blob_n = len - 4 - trie_bytes;
    n->trie = malloc(n->trie_n * sizeof *n->trie + 1);
    n->blob = malloc(n->blob_n + 1);
    if (!n->trie || !n->blob) st = td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  }
  if (st == TD_OK) {
    for (size_t i = 0; i < n->trie_n; i++) {
      const uint8_t *p = raw + 4 + 4 * i;
      n->trie[i] = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    }
    memcpy(n->blob, raw + 4 + trie_bytes, n->blob_n);
    n->blob[n->blob_n] = 0;
    if (tk_utf8_valid_prefix(n->blob, n->blob_n) != n->blob_n)
      st = td_err(TD_ERR_FORMAT, "tokenizer.json: Precompiled: normalized strings are not UTF-8");
  }
  free(raw);
  return st;
}

/* darts-clone's common-prefix search as spm_precompiled does it: the
 * shortest key that prefixes chunk, its normalized string (NULL: none). */
static const char *pc_transform(const tk_norm *n, const char *s, size_t len, size_t *out_len) {
  if (!n->trie_n) return NULL;
  const uint32_t *a = n->trie;
  size_t pos = 0;
  uint32_t unit = a[0];
#define PC_OFFSET(u) ((size_t)(((u) >> 10) << (((u) & (1u << 9)) >> 6)))
  pos ^= PC_OFFSET(unit);
  for (size_t i = 0; i < len; i++) {
    uint8_t c = (uint8_t)s[i];
    if (!c) break;
    pos ^= c;
    if (pos >= n->trie_n) return NULL;
    unit = a[pos];
    if ((unit & ((1u << 31) | 0xFF)) != c) return NULL;
    pos ^= PC_OFFSET(unit);
    if (pos >= n->trie_n) return NULL;
    if ((unit >> 8) & 1) {
      size_t off = a[pos] & ((1u << 31) - 1);
      if (off >= n->blob_n) return NULL;
      size_t e = off;
      while (e < n->blob_n && n->blob[e]) e++;
      *out_len = e - off;
      return n->blob + off;
    }
  }
#undef PC_OFFSET
  return NULL;
}

static td_status apply_precompiled(const tk_norm *n, const char *s, size_t len, tk_buf *out) {
  utf8proc_int32_t state = 0, prev = -1;
  size_t g = 0, i = 0;
  while (g < len) { /* one extended grapheme cluster at a time */
    size_t e = g;
    i = g;
    prev = -1;
    state = 0;
    while (i < len) {
      uint32_t cp;
      size_t k = tk_utf8_next(s + i, len - i, &cp);
      if (prev >= 0 && utf8proc_grapheme_break_stateful(prev, (utf8proc_int32_t)cp, &state)) break;
      prev = (utf8proc_int32_t)cp;
      i += k;
      e = i;
    }
    size_t nl;
    const char *rep;
    if (e - g < 6 && (rep = pc_transform(n, s + g, e - g, &nl))) {
      TD_TRY(tk_buf_add(out, rep, nl));
    } else {
      for (size_t c = g; c < e;) {
        uint32_t cp;
        size_t k = tk_utf8_next(s + c, e - c, &cp);
        if ((rep = pc_transform(n, s + c, k, &nl))) TD_TRY(tk_buf_add(out, rep, nl));
        else TD_TRY(tk_buf_add(out, s + c, k));
        c += k;
      }
    }
    g = e;
  }
  return tk_buf_add(out, "", 0);
}

static td_status unicode_form(const char *s, size_t len, int opts, tk_buf *out) {
  if (!len) return tk_buf_add(out, "", 0);
  utf8proc_uint8_t *dst = NULL;
  utf8proc_ssize_t k = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)len, &dst,
                                    (utf8proc_option_t)(UTF8PROC_STABLE | opts));
  if (k < 0) return td_err(TD_ERR_INVALID, "tokenizer: normalization failed: %s", utf8proc_errmsg(k));
  td_status st = tk_buf_add(out, dst, (size_t)k);
  free(dst);
  return st;
}

static bool is_control(uint32_t c) { /* BertNormalizer's is_control */
  if (c == '\t' || c == '\n' || c == '\r') return false;
  utf8proc_category_t k = utf8proc_category((utf8proc_int32_t)c);
  return k == UTF8PROC_CATEGORY_CC || k == UTF8PROC_CATEGORY_CF || k == UTF8PROC_CATEGORY_CN ||
         k == UTF8PROC_CATEGORY_CO;
}

static bool is_chinese(uint32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
         (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

static bool is_mark(uint32_t c) {
  utf8proc_category_t k = utf8proc_category((utf8proc_int32_t)c);
  return k == UTF8PROC_CATEGORY_MN || k == UTF8PROC_CATEGORY_MC || k == UTF8PROC_CATEGORY_ME;
}

static td_status lowercase(const char *s, size_t len, tk_buf *out) {
  for (size_t i = 0; i < len;) {
    uint32_t cp;
    size_t k = tk_utf8_next(s + i, len - i, &cp);
    if (cp == 0x130) TD_TRY(tk_buf_add(out, "i\xCC\x87", 3)); /* the one multi-character lowercase mapping */
    else TD_TRY(tk_buf_addcp(out, (uint32_t)utf8proc_tolower((utf8proc_int32_t)cp)));
    i += k;
  }
  return tk_buf_add(out, "", 0);
}

static td_status apply_one(const tk_norm *n, const char *s, size_t len, tk_buf *out) {
  out->n = 0;
  switch (n->kind) {
  case N_NFC: return unicode_form(s, len, UTF8PROC_COMPOSE, out);
  case N_NFD: return unicode_form(s, len, UTF8PROC_DECOMPOSE, out);
  case N_NFKC: return unicode_form(s, len, UTF8PROC_COMPOSE | UTF8PROC_COMPAT, out);
  case N_NFKD: return unicode_form(s, len, UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT, out);
  case N_LOWER: return lowercase(s, len, out);
  case N_STRIP: {
    size_t a = n->left ? tk_skip_space(s, 0, len) : 0, b = n->right ? tk_trim_space(s, a, len) : len;
    return tk_buf_add(out, s + a, b - a);
  }
  case N_STRIP_ACCENTS:
    for (size_t i = 0; i < len;) {
      uint32_t cp;
      size_t k = tk_utf8_next(s + i, len - i, &cp);
      if (!is_mark(cp)) TD_TRY(tk_buf_add(out, s + i, k));
      i += k;
    }
    return tk_buf_add(out, "", 0);
  case N_REPLACE: return tk_regex_replace(n->re, s, len, n->content, strlen(n->content), out);
  case N_PREPEND:
    if (len) TD_TRY(tk_buf_add(out, n->content, strlen(n->content)));
    return tk_buf_add(out, s, len);
  case N_BYTELEVEL:
    for (size_t i = 0; i < len; i++) TD_TRY(tk_buf_addcp(out, tk_byte_to_char((uint8_t)s[i])));
    return tk_buf_add(out, "", 0);
  case N_PRECOMPILED: return apply_precompiled(n, s, len, out);
  case N_BERT: {
    tk_buf a = {0}, b = {0};
    td_status st = TD_OK;
    for (size_t i = 0; st == TD_OK && i < len;) {
      uint32_t cp;
      size_t k = tk_utf8_next(s + i, len - i, &cp);
      if (n->clean_text && (cp == 0 || cp == 0xFFFD || is_control(cp))) {
      } else if (n->clean_text && tk_is_whitespace(cp)) {
        st = tk_buf_addc(&a, ' ');
      } else if (n->chinese && is_chinese(cp)) {
        st = tk_buf_addc(&a, ' ');
        if (st == TD_OK) st = tk_buf_add(&a, s + i, k);
        if (st == TD_OK) st = tk_buf_addc(&a, ' ');
      } else {
        st = tk_buf_add(&a, s + i, k);
      }
      i += k;
    }
    if (st == TD_OK && n->accents) {
      if ((st = unicode_form(a.p ? a.p : "", a.n, UTF8PROC_DECOMPOSE, &b)) == TD_OK) {
        a.n = 0;
        for (size_t i = 0; st == TD_OK && i < b.n;) {
          uint32_t cp;
          size_t k = tk_utf8_next(b.p + i, b.n - i, &cp);
          if (utf8proc_category((utf8proc_int32_t)cp) != UTF8PROC_CATEGORY_MN) st = tk_buf_add(&a, b.p + i, k);
          i += k;
        }
      }
    }
    if (st == TD_OK) st = n->lower ? lowercase(a.p ? a.p : "", a.n, out) : tk_buf_add(out, a.p ? a.p : "", a.n);
    tk_buf_free(&a);
    tk_buf_free(&b);
    return st;
  }
  case N_SEQUENCE: {
    tk_buf cur = {0};
    td_status st = tk_buf_add(&cur, s, len);
    for (size_t i = 0; st == TD_OK && i < n->nseq; i++) {
      st = apply_one(n->seq[i], cur.p, cur.n, out);
      tk_buf t = cur;
      cur = *out;
      *out = t;
    }
    out->n = 0;
    if (st == TD_OK) st = tk_buf_add(out, cur.p, cur.n);
    tk_buf_free(&cur);
    return st;
  }
  }
  return td_err(TD_ERR_INTERNAL, "tokenizer: bad normalizer");
}

td_status tk_norm_apply(const tk_norm *n, const char *s, size_t len, tk_buf *out) { return apply_one(n, s, len, out); }

td_status tk_pattern_parse(const cJSON *j, const char *what, tk_regex **out) {
  const char *s = tk_jstr(j, "String"), *r = tk_jstr(j, "Regex");
  if (!s && !r) return td_err(TD_ERR_FORMAT, "tokenizer.json: %s: pattern is neither String nor Regex", what);
  return tk_regex_new(s ? s : r, strlen(s ? s : r), s != NULL, what, out);
}

td_status tk_norm_parse(const cJSON *j, tk_norm **out) {
  const char *type;
  TD_TRY(tk_jtype(j, "normalizer", &type));
  static const struct {
    const char *name;
    norm_kind kind;
  } kinds[] = {{"NFC", N_NFC},           {"NFD", N_NFD},           {"NFKC", N_NFKC},
               {"NFKD", N_NFKD},         {"Lowercase", N_LOWER},   {"Strip", N_STRIP},
               {"StripAccents", N_STRIP_ACCENTS}, {"Replace", N_REPLACE}, {"Prepend", N_PREPEND},
               {"BertNormalizer", N_BERT}, {"ByteLevel", N_BYTELEVEL}, {"Precompiled", N_PRECOMPILED},
               {"Sequence", N_SEQUENCE}};
  size_t k = 0;
  while (k < sizeof kinds / sizeof *kinds && strcmp(kinds[k].name, type)) k++;
  if (k == sizeof kinds / sizeof *kinds) return td_err(TD_ERR_UNSUPPORTED, "tokenizer.json: unknown normalizer \"%s\"", type);
  tk_norm *n = calloc(1, sizeof *n);
  if (!n) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  n->kind = kinds[k].kind;
  td_status st = TD_OK;
  switch (n->kind) {
  case N_STRIP:
    n->left = tk_jbool(j, "strip_left", false);
    n->right = tk_jbool(j, "strip_right", false);
    break;
  case N_BERT: {
    n->clean_text = tk_jbool(j, "clean_text", true);
    n->chinese = tk_jbool(j, "handle_chinese_chars", true);
    n->lower = tk_jbool(j, "lowercase", true);
    n->accents = tk_jbool(j, "strip_accents", n->lower); /* null follows lowercase */
    break;
  }
  case N_REPLACE: {
    const char *c = tk_jstr(j, "content");
    if (!c) st = td_err(TD_ERR_FORMAT, "tokenizer.json: Replace normalizer has no content");
    else if (!(n->content = strdup(c))) st = td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
    if (st == TD_OK) st = tk_pattern_parse(cJSON_GetObjectItemCaseSensitive(j, "pattern"), "Replace normalizer", &n->re);
    break;
  }
  case N_PREPEND: {
    const char *c = tk_jstr(j, "prepend");
    if (!c) st = td_err(TD_ERR_FORMAT, "tokenizer.json: Prepend normalizer has no prepend");
    else if (!(n->content = strdup(c))) st = td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
    break;
  }
  case N_PRECOMPILED: st = parse_precompiled(j, n); break;
  case N_SEQUENCE: {
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(j, "normalizers");
    if (!cJSON_IsArray(a)) {
      st = td_err(TD_ERR_FORMAT, "tokenizer.json: normalizer Sequence has no normalizers array");
      break;
    }
    int cnt = cJSON_GetArraySize(a);
    n->seq = calloc((size_t)cnt + 1, sizeof *n->seq);
    if (!n->seq) st = td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
    const cJSON *e;
    cJSON_ArrayForEach(e, a) {
      if (st != TD_OK) break;
      st = tk_norm_parse(e, &n->seq[n->nseq]);
      if (st == TD_OK) n->nseq++;
    }
    break;
  }
  default: break;
  }
  if (st != TD_OK) {
    tk_norm_free(n);
    return st;
  }
  *out = n;
  return TD_OK;
}
