/* Text plumbing for the tokenizer: byte buffers, UTF-8, character classes,
 * a byte trie, patterns and split behaviours.
 *
 * Regex: PCRE2 (8-bit, UTF + UCP). It matches UTF-8 in place, so segment
 * offsets are byte offsets with no UTF-16 round trip (ICU's regex works on
 * UTF-16), and it has \p{L} / \p{N}, look-ahead, JIT and partial matching
 * (which the streaming detokenizer uses to hold back text a rewrite could
 * still change). Character classes come from utf8proc (Unicode tables in C). */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <utf8proc.h>

#include "frontend/tokenizer_impl.h"

/* ---- buffers ---- */

static td_status buf_grow(tk_buf *b, size_t need) {
  if (b->n + need + 1 <= b->cap) return TD_OK;
  size_t cap = b->cap ? b->cap : 64;
  while (cap < b->n + need + 1) {
    if (cap > SIZE_MAX / 2) return td_err(TD_ERR_NOMEM, "tokenizer: text too large");
    cap *= 2;
  }
  char *p = realloc(b->p, cap);
  if (!p) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  b->p = p;
  b->cap = cap;
  return TD_OK;
}

td_status tk_buf_add(tk_buf *b, const void *s, size_t n) {
  TD_TRY(buf_grow(b, n));
  if (n) memcpy(b->p + b->n, s, n);
  b->n += n;
  b->p[b->n] = 0;
  return TD_OK;
}

td_status tk_buf_addc(tk_buf *b, char c) { return tk_buf_add(b, &c, 1); }

td_status tk_buf_addcp(tk_buf *b, uint32_t cp) {
  uint8_t u[4];
  utf8proc_ssize_t k = utf8proc_encode_char((utf8proc_int32_t)cp, u);
  if (k <= 0) return td_err(TD_ERR_INVALID, "tokenizer: bad code point U+%04X", cp);
  return tk_buf_add(b, u, (size_t)k);
}

void tk_buf_free(tk_buf *b) {
  free(b->p);
  *b = (tk_buf){0};
}

td_status tk_buf_take(tk_buf *b, char **out, size_t *len) {
  TD_TRY(buf_grow(b, 0));
  b->p[b->n] = 0;
  *out = b->p;
  if (len) *len = b->n;
  *b = (tk_buf){0};
  return TD_OK;
}

td_status tk_ids_push(tk_ids *a, int32_t id) {
  if (a->n == a->cap) {
    size_t cap = a->cap ? a->cap * 2 : 64;
    int32_t *v = realloc(a->v, cap * sizeof *v);
    if (!v) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
    a->v = v;
    a->cap = cap;
  }
  a->v[a->n++] = id;
  return TD_OK;
}

td_status tk_read_file(const char *path, size_t max, char **out, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return td_err(TD_ERR_IO, "cannot open %s", path);
  struct stat sb;
  if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
    fclose(f);
    return td_err(TD_ERR_IO, "%s is not a regular file", path);
  }
  if ((uint64_t)sb.st_size > max) {
    fclose(f);
    return td_err(TD_ERR_INVALID, "%s: %lld bytes, over the limit of %zu", path, (long long)sb.st_size, max);
  }
  char *b = malloc((size_t)sb.st_size + 1);
  size_t n = b ? fread(b, 1, (size_t)sb.st_size, f) : 0;
  fclose(f);
  if (!b || n != (size_t)sb.st_size) {
    free(b);
    return b ? td_err(TD_ERR_IO, "cannot read %s", path) : td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  }
  b[n] = 0;
  *out = b;
  *len = n;
  return TD_OK;
}

/* ---- UTF-8 ---- */

size_t tk_utf8_len(uint8_t c) {
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0) return 2;
  if ((c & 0xF0) == 0xE0) return 3;
  if ((c & 0xF8) == 0xF0) return 4;
  return 1;
}

size_t tk_utf8_next(const char *s, size_t n, uint32_t *cp) {
  utf8proc_int32_t c = 0;
  utf8proc_ssize_t k = utf8proc_iterate((const uint8_t *)s, (utf8proc_ssize_t)n, &c);
  if (k <= 0) { /* not valid here: one byte, as itself */
    *cp = (uint8_t)s[0];
    return 1;
  }
  *cp = (uint32_t)c;
  return (size_t)k;
}

size_t tk_utf8_prev(const char *s, size_t lo, size_t at) {
  size_t p = at - 1;
  while (p > lo && ((uint8_t)s[p] & 0xC0) == 0x80) p--;
  return p;
}

size_t tk_skip_space(const char *s, size_t a, size_t e) {
  while (a < e) {
    uint32_t cp;
    size_t k = tk_utf8_next(s + a, e - a, &cp);
    if (!tk_is_whitespace(cp)) break;
    a += k;
  }
  return a;
}

size_t tk_trim_space(const char *s, size_t a, size_t e) {
  while (e > a) {
    size_t p = tk_utf8_prev(s, a, e);
    uint32_t cp;
    tk_utf8_next(s + p, e - p, &cp);
    if (!tk_is_whitespace(cp)) break;
    e = p;
  }
  return e;
}

/* Length of the valid sequence at s (0: invalid), and of its maximal
 * invalid subpart in *bad (Unicode's "substitution of maximal subparts"). */
static size_t utf8_seq(const uint8_t *s, size_t n, size_t *bad) {
  uint8_t c = s[0];
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) need = 1;
  else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    *bad = 1;
    return 0;
  }
  size_t i = 1;
  for (; i <= need; i++) {
    if (i >= n) break;
    uint8_t lo_i = i == 1 ? lo : 0x80, hi_i = i == 1 ? hi : 0xBF;
    if (s[i] < lo_i || s[i] > hi_i) break;
  }
  if (i == need + 1) return need + 1;
  *bad = i;
  return 0;
}

size_t tk_utf8_valid_prefix(const char *s, size_t n) {
  size_t i = 0, bad = 0;
  while (i < n) {
    size_t k = utf8_seq((const uint8_t *)s + i, n - i, &bad);
    if (!k) break;
    i += k;
  }
  return i;
}

td_status tk_utf8_lossy(const char *s, size_t n, tk_buf *out) {
  size_t i = 0;
  while (i < n) {
    size_t bad = 0, k = utf8_seq((const uint8_t *)s + i, n - i, &bad);
    if (k) {
      TD_TRY(tk_buf_add(out, s + i, k));
      i += k;
    } else {
      TD_TRY(tk_buf_add(out, "\xEF\xBF\xBD", 3));
      i += bad;
    }
  }
  return tk_buf_add(out, "", 0);
}

/* ---- character classes ---- */

bool tk_is_whitespace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool tk_is_numeric(uint32_t c) {
  utf8proc_category_t k = utf8proc_category((utf8proc_int32_t)c);
  return k == UTF8PROC_CATEGORY_ND || k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_NO;
}

bool tk_is_alnum(uint32_t c) {
  utf8proc_category_t k = utf8proc_category((utf8proc_int32_t)c);
  return (k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_LO) || tk_is_numeric(c);
}

/* Rust regex's \w: alphabetic, marks, decimal digits, connector punctuation, joiners. */
bool tk_is_word(uint32_t c) {
  utf8proc_category_t k = utf8proc_category((utf8proc_int32_t)c);
  return (k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_ME) || k == UTF8PROC_CATEGORY_ND ||
         k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_PC || c == 0x200C || c == 0x200D;
}

bool tk_is_punct(uint32_t c) {
  if (c < 0x80) return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) ||
                       (c >= 0x7B && c <= 0x7E);
  utf8proc_category_t k = utf8proc_category((utf8proc_int32_t)c);
  return k >= UTF8PROC_CATEGORY_PC && k <= UTF8PROC_CATEGORY_PO;
}

/* ---- byte trie ---- */

typedef struct trie_node {
  int32_t value, child, sibling;
  uint8_t byte;
} trie_node;

struct tk_trie {
  trie_node *v;
  size_t n, cap;
  int32_t root[256]; /* the root's children, direct */
};

tk_trie *tk_trie_new(void) {
  tk_trie *t = calloc(1, sizeof *t);
  if (t) memset(t->root, 0xff, sizeof t->root);
  return t;
}

void tk_trie_free(tk_trie *t) {
  if (!t) return;
  free(t->v);
  free(t);
}

static int32_t trie_child(const tk_trie *t, int32_t node, uint8_t b) {
  if (node < 0) return t->root[b];
  for (int32_t c = t->v[node].child; c >= 0; c = t->v[c].sibling)
    if (t->v[c].byte == b) return c;
  return -1;
}

td_status tk_trie_add(tk_trie *t, const char *s, size_t n, int32_t value) {
  int32_t node = -1;
  for (size_t i = 0; i < n; i++) {
    uint8_t b = (uint8_t)s[i];
    int32_t c = trie_child(t, node, b);
    if (c < 0) {
      if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 1024;
        trie_node *v = realloc(t->v, cap * sizeof *v);
        if (!v) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
        t->v = v;
        t->cap = cap;
      }
      c = (int32_t)t->n++;
      t->v[c] = (trie_node){.value = -1, .child = -1, .sibling = -1, .byte = b};
      if (node < 0) {
        t->root[b] = c;
      } else {
        t->v[c].sibling = t->v[node].child;
        t->v[node].child = c;
      }
    }
    node = c;
  }
  if (node >= 0) t->v[node].value = value; /* the last one added wins, as a map built from a list */
  return TD_OK;
}

void tk_trie_prefixes(const tk_trie *t, const char *s, size_t n, void (*fn)(size_t, int32_t, void *), void *ctx) {
  int32_t node = -1;
  for (size_t i = 0; i < n; i++) {
    node = trie_child(t, node, (uint8_t)s[i]);
    if (node < 0) return;
    if (t->v[node].value >= 0) fn(i + 1, t->v[node].value, ctx);
  }
}

size_t tk_trie_longest(const tk_trie *t, const char *s, size_t n, int32_t *value) {
  int32_t node = -1;
  size_t best = 0;
  for (size_t i = 0; i < n; i++) {
    node = trie_child(t, node, (uint8_t)s[i]);
    if (node < 0) break;
    if (t->v[node].value >= 0) {
      best = i + 1;
      *value = t->v[node].value;
    }
  }
  return best;
}

/* ---- segments and split behaviours ---- */

td_status tk_segs_push(tk_segs *a, size_t s, size_t e, bool match) {
  if (a->n == a->cap) {
    size_t cap = a->cap ? a->cap * 2 : 16;
    tk_seg *v = realloc(a->v, cap * sizeof *v);
    if (!v) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
    a->v = v;
    a->cap = cap;
  }
  a->v[a->n++] = (tk_seg){s, e, match};
  return TD_OK;
}

td_status tk_char_segments(const char *s, size_t n, bool (*pred)(uint32_t, const void *), const void *ctx,
                           tk_segs *out) {
  out->n = 0;
  if (!n) return tk_segs_push(out, 0, 0, false);
  size_t last = 0, i = 0;
  while (i < n) {
    uint32_t cp;
    size_t k = tk_utf8_next(s + i, n - i, &cp);
    if (pred(cp, ctx)) {
      if (last < i) TD_TRY(tk_segs_push(out, last, i, false));
      TD_TRY(tk_segs_push(out, i, i + k, true));
      last = i + k;
    }
    i += k;
  }
  if (last < n) TD_TRY(tk_segs_push(out, last, n, false));
  return TD_OK;
}

td_status tk_split_parse(const char *s, tk_split *out) {
  static const struct {
    const char *name;
    tk_split b;
  } names[] = {{"Removed", TK_REMOVED},           {"Isolated", TK_ISOLATED},     {"MergedWithPrevious", TK_MERGED_PREV},
               {"MergedWithNext", TK_MERGED_NEXT}, {"Contiguous", TK_CONTIGUOUS}};
  for (size_t i = 0; s && i < sizeof names / sizeof *names; i++)
    if (!strcmp(s, names[i].name)) {
      *out = names[i].b;
      return TD_OK;
    }
  return td_err(TD_ERR_UNSUPPORTED, "tokenizer.json: unknown split behavior \"%s\"", s ? s : "(none)");
}

/* NormalizedString::split: kept pieces are the segments whose flag ends false. */
td_status tk_split_apply(const tk_segs *in, tk_split b, tk_segs *out) {
  out->n = 0;
  bool prev = false;
  if (b == TK_MERGED_NEXT) {
    for (size_t k = in->n; k-- > 0;) {
      const tk_seg *g = &in->v[k];
      if (g->match && !prev && out->n) out->v[out->n - 1].s = g->s;
      else TD_TRY(tk_segs_push(out, g->s, g->e, false));
      prev = g->match;
    }
    for (size_t i = 0; i < out->n / 2; i++) {
      tk_seg t = out->v[i];
      out->v[i] = out->v[out->n - 1 - i];
      out->v[out->n - 1 - i] = t;
    }
    return TD_OK;
  }
  for (size_t k = 0; k < in->n; k++) {
    const tk_seg *g = &in->v[k];
    switch (b) {
    case TK_ISOLATED: TD_TRY(tk_segs_push(out, g->s, g->e, false)); break;
    case TK_REMOVED:
      if (!g->match) TD_TRY(tk_segs_push(out, g->s, g->e, false));
      break;
    case TK_CONTIGUOUS:
      if (g->match == prev && out->n) out->v[out->n - 1].e = g->e;
      else TD_TRY(tk_segs_push(out, g->s, g->e, false));
      break;
    case TK_MERGED_PREV:
      if (g->match && !prev && out->n) out->v[out->n - 1].e = g->e;
      else TD_TRY(tk_segs_push(out, g->s, g->e, false));
      break;
    default: break;
    }
    prev = g->match;
  }
  return TD_OK;
}

/* ---- regex ---- */

#define TK_MATCH_LIMIT 10000000u /* backtracking steps one match may take: a pathological pattern fails, never hangs */

struct tk_regex {
  pcre2_code *code;
  pcre2_match_context *mctx;
};

td_status tk_regex_new(const char *pat, size_t len, bool literal, const char *what, tk_regex **out) {
  int err = 0;
  PCRE2_SIZE off = 0;
  uint32_t flags = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP); /* LITERAL takes no UCP */
  pcre2_code *code = pcre2_compile((PCRE2_SPTR)pat, len, flags, &err, &off, NULL);
  if (!code) {
    PCRE2_UCHAR msg[160];
    pcre2_get_error_message(err, msg, sizeof msg);
    return td_err(TD_ERR_FORMAT, "tokenizer.json: %s: pattern does not compile at offset %zu: %s", what, (size_t)off,
                  (const char *)msg);
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE); /* optional: the interpreter serves when JIT is absent */
  tk_regex *r = calloc(1, sizeof *r);
  pcre2_match_context *m = pcre2_match_context_create(NULL);
  if (!r || !m) {
    free(r);
    pcre2_match_context_free(m);
    pcre2_code_free(code);
    return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  }
  pcre2_set_match_limit(m, TK_MATCH_LIMIT);
  pcre2_set_depth_limit(m, TK_MATCH_LIMIT);
  r->code = code;
  r->mctx = m;
  *out = r;
  return TD_OK;
}

void tk_regex_free(tk_regex *r) {
  if (!r) return;
  pcre2_code_free(r->code);
  pcre2_match_context_free(r->mctx);
  free(r);
}

/* As the onig crate's find_iter: an empty match right after the previous
 * match is skipped by one character. */
td_status tk_regex_segments(const tk_regex *r, const char *s, size_t n, tk_segs *out) {
  out->n = 0;
  if (!n) return tk_segs_push(out, 0, 0, false);
  if (tk_utf8_valid_prefix(s, n) != n) return td_err(TD_ERR_INTERNAL, "tokenizer: pattern on invalid UTF-8");
  pcre2_match_data *md = pcre2_match_data_create_from_pattern(r->code, NULL);
  if (!md) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  td_status st = TD_OK;
  size_t last_end = 0, prev = 0, last_match_end = SIZE_MAX;
  while (last_end <= n) {
    int rc = pcre2_match(r->code, (PCRE2_SPTR)s, n, last_end, PCRE2_NO_UTF_CHECK, md, r->mctx);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      st = td_err(TD_ERR_INVALID, "tokenizer: pattern match failed (%d): text too costly for the pattern", rc);
      break;
    }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    size_t ms = ov[0], me = ov[1];
    if (me < ms) me = ms; /* \K tricks */
    if (ms == me && last_match_end == me) {
      last_end += last_end < n ? tk_utf8_len((uint8_t)s[last_end]) : 1;
      continue;
    }
    last_end = me;
    last_match_end = me;
    if (prev < ms && (st = tk_segs_push(out, prev, ms, false)) != TD_OK) break;
    if ((st = tk_segs_push(out, ms, me, true)) != TD_OK) break;
    if (me > prev) prev = me;
  }
  if (st == TD_OK && prev != n) st = tk_segs_push(out, prev, n, false);
  pcre2_match_data_free(md);
  return st;
}

size_t tk_regex_partial_start(const tk_regex *r, const char *s, size_t n) {
  pcre2_match_data *md = pcre2_match_data_create_from_pattern(r->code, NULL);
  if (!md) return 0; /* hold everything back rather than risk a change */
  size_t off = 0, at = n;
  while (off <= n) {
    int rc = pcre2_match(r->code, (PCRE2_SPTR)s, n, off, PCRE2_PARTIAL_HARD, md, r->mctx);
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    if (rc == PCRE2_ERROR_PARTIAL) {
      at = ov[0];
      break;
    }
    if (rc < 0) {
      if (rc != PCRE2_ERROR_NOMATCH) at = 0;
      break;
    }
    off = ov[1] > ov[0] ? ov[1] : ov[0] + (ov[0] < n ? tk_utf8_len((uint8_t)s[ov[0]]) : 1);
  }
  pcre2_match_data_free(md);
  return at;
}

td_status tk_regex_replace(const tk_regex *r, const char *s, size_t n, const char *rep, size_t rep_len, tk_buf *out) {
  tk_segs segs = {0};
  td_status st = tk_regex_segments(r, s, n, &segs);
  out->n = 0;
  for (size_t i = 0; st == TD_OK && i < segs.n; i++)
    st = segs.v[i].match ? tk_buf_add(out, rep, rep_len) : tk_buf_add(out, s + segs.v[i].s, segs.v[i].e - segs.v[i].s);
  if (st == TD_OK) st = tk_buf_add(out, "", 0);
  free(segs.v);
  return st;
}

/* ---- JSON ---- */

const char *tk_jstr(const cJSON *o, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsString(v) ? v->valuestring : NULL;
}

bool tk_jbool(const cJSON *o, const char *key, bool dflt) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsBool(v) ? cJSON_IsTrue(v) : dflt;
}

td_status tk_jtype(const cJSON *o, const char *where, const char **type) {
  if (!cJSON_IsObject(o)) return td_err(TD_ERR_FORMAT, "tokenizer.json: %s is not an object", where);
  const char *t = tk_jstr(o, "type");
  if (!t) return td_err(TD_ERR_FORMAT, "tokenizer.json: %s has no \"type\"", where);
  *type = t;
  return TD_OK;
}
