/* Pre-tokenizers of tokenizer.json: ByteLevel (GPT-2's regex and byte map),
 * Metaspace, Whitespace, WhitespaceSplit, Split, Digits, Punctuation,
 * CharDelimiterSplit, BertPreTokenizer and Sequence. Pieces that are added
 * tokens (id >= 0) pass through untouched; empty pieces are dropped, as
 * PreTokenizedString::split drops them. */
#include <stdlib.h>
#include <string.h>

#include "frontend/tokenizer_impl.h"

typedef enum { P_BYTELEVEL, P_METASPACE, P_WHITESPACE, P_WSSPLIT, P_SPLIT, P_DIGITS, P_PUNCT, P_CHARDELIM, P_BERT, P_SEQUENCE } pretok_kind;
typedef enum { PREPEND_ALWAYS, PREPEND_FIRST, PREPEND_NEVER } prepend_scheme;

struct tk_pretok {
  pretok_kind kind;
  bool add_prefix_space, use_regex; /* ByteLevel */
  uint32_t replacement;             /* Metaspace; CharDelimiterSplit's delimiter */
  prepend_scheme prepend;
  bool split;
  tk_regex *re;                     /* ByteLevel, Split */
  tk_split behavior;                /* Split, Punctuation */
  bool invert;
  bool individual;                  /* Digits */
  tk_pretok **seq;
  size_t nseq;
};

#define BYTELEVEL_RE "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"

/* ---- the byte map ---- */

/* bytes_to_unicode(): printable bytes stand for themselves; the 68 others
 * (0x00-0x20, 0x7F-0xA0, 0xAD), in order, for U+0100 onwards. */
static bool printable(uint32_t b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); }

uint32_t tk_byte_to_char(uint8_t b) {
  if (printable(b)) return b;
  if (b <= 0x20) return 0x100 + b;
  if (b <= 0xA0) return 0x100 + 33 + (b - 0x7F);
  return 0x100 + 67;
}

int tk_char_to_byte(uint32_t cp) {
  if (cp < 0x100) return printable(cp) ? (int)cp : -1;
  if (cp < 0x100 + 33) return (int)(cp - 0x100);
  if (cp < 0x100 + 67) return (int)(cp - 0x100 - 33 + 0x7F);
  return cp == 0x100 + 67 ? 0xAD : -1;
}

/* ---- pieces ---- */

td_status tk_pieces_push(tk_pieces *a, const char *s, size_t n, int32_t id, bool at_start) {
  if (a->n == a->cap) {
    size_t cap = a->cap ? a->cap * 2 : 16;
    tk_piece *v = realloc(a->v, cap * sizeof *v);
    if (!v) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
    a->v = v;
    a->cap = cap;
  }
  char *c = malloc(n + 1);
  if (!c) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  if (n) memcpy(c, s, n);
  c[n] = 0;
  a->v[a->n++] = (tk_piece){c, n, id, at_start};
  return TD_OK;
}

void tk_pieces_free(tk_pieces *a) {
  for (size_t i = 0; i < a->n; i++) free(a->v[i].s);
  free(a->v);
  *a = (tk_pieces){0};
}

/* ---- one piece to its sub-pieces ---- */

static bool is_ws(uint32_t c, const void *ctx) { return tk_is_whitespace(c); }
static bool is_num(uint32_t c, const void *ctx) { return tk_is_numeric(c); }
static bool is_pun(uint32_t c, const void *ctx) { return tk_is_punct(c); }
static bool is_cp(uint32_t c, const void *ctx) { return c == *(const uint32_t *)ctx; }

/* Whitespace: the matches of \w+|[^\w\s]+. */
static td_status whitespace_segments(const char *s, size_t n, tk_segs *out) {
  out->n = 0;
  size_t i = 0;
  while (i < n) {
    uint32_t cp;
    size_t k = tk_utf8_next(s + i, n - i, &cp);
    if (tk_is_whitespace(cp)) {
      i += k;
      continue;
    }
    bool w = tk_is_word(cp);
    size_t j = i + k;
    while (j < n) {
      size_t k2 = tk_utf8_next(s + j, n - j, &cp);
      if (tk_is_whitespace(cp) || tk_is_word(cp) != w) break;
      j += k2;
    }
    TD_TRY(tk_segs_push(out, i, j, false));
    i = j;
  }
  return TD_OK;
}

static td_status emit_segs(const char *s, const tk_segs *kept, bool at_start, tk_pieces *out) {
  for (size_t i = 0; i < kept->n; i++) {
    const tk_seg *g = &kept->v[i];
    if (g->e > g->s) TD_TRY(tk_pieces_push(out, s + g->s, g->e - g->s, -1, at_start && g->s == 0));
  }
  return TD_OK;
}

static td_status split_with(const char *s, size_t n, bool at_start, const tk_segs *segs, tk_split b, tk_pieces *out) {
  tk_segs kept = {0};
  td_status st = tk_split_apply(segs, b, &kept);
  if (st == TD_OK) st = emit_segs(s, &kept, at_start, out);
  free(kept.v);
  return st;
}

static td_status split_piece(const tk_pretok *p, const char *s, size_t n, bool at_start, tk_pieces *out) {
  tk_segs segs = {0};
  tk_buf b = {0};
  td_status st = TD_OK;
  switch (p->kind) {
  case P_BYTELEVEL: {
    if (p->add_prefix_space && n && s[0] != ' ') {
      if ((st = tk_buf_addc(&b, ' ')) == TD_OK) st = tk_buf_add(&b, s, n);
      s = b.p;
      n = b.n;
    }
    if (st != TD_OK) break;
    if (p->use_regex) {
      if ((st = tk_regex_segments(p->re, s, n, &segs)) == TD_OK) st = split_with(s, n, at_start, &segs, TK_ISOLATED, out);
    } else if (n) {
      st = tk_pieces_push(out, s, n, -1, at_start);
    }
    break;
  }
  case P_METASPACE: {
    for (size_t i = 0; st == TD_OK && i < n; i++)
      st = s[i] == ' ' ? tk_buf_addcp(&b, p->replacement) : tk_buf_addc(&b, s[i]);
    if (st != TD_OK || !b.n) break;
    uint32_t first;
    tk_utf8_next(b.p, b.n, &first);
    bool pre = first != p->replacement &&
               (p->prepend == PREPEND_ALWAYS || (p->prepend == PREPEND_FIRST && at_start));
    if (pre) {
      tk_buf c = {0};
      if ((st = tk_buf_addcp(&c, p->replacement)) == TD_OK) st = tk_buf_add(&c, b.p, b.n);
      tk_buf_free(&b);
      b = c;
      if (st != TD_OK) break;
    }
    if (!p->split) {
      st = tk_pieces_push(out, b.p, b.n, -1, at_start);
      break;
    }
    if ((st = tk_char_segments(b.p, b.n, is_cp, &p->replacement, &segs)) == TD_OK)
      st = split_with(b.p, b.n, at_start, &segs, TK_MERGED_NEXT, out);
    break;
  }
  case P_WHITESPACE:
    if ((st = whitespace_segments(s, n, &segs)) == TD_OK) st = emit_segs(s, &segs, at_start, out);
    break;
  case P_WSSPLIT:
    if ((st = tk_char_segments(s, n, is_ws, NULL, &segs)) == TD_OK) st = split_with(s, n, at_start, &segs, TK_REMOVED, out);
    break;
  case P_CHARDELIM:
    if ((st = tk_char_segments(s, n, is_cp, &p->replacement, &segs)) == TD_OK)
      st = split_with(s, n, at_start, &segs, TK_REMOVED, out);
    break;
  case P_SPLIT:
    if ((st = tk_regex_segments(p->re, s, n, &segs)) != TD_OK) break;
    if (p->invert)
      for (size_t i = 0; i < segs.n; i++) segs.v[i].match = !segs.v[i].match;
    st = split_with(s, n, at_start, &segs, p->behavior, out);
    break;
  case P_DIGITS:
    if ((st = tk_char_segments(s, n, is_num, NULL, &segs)) == TD_OK)
      st = split_with(s, n, at_start, &segs, p->individual ? TK_ISOLATED : TK_CONTIGUOUS, out);
    break;
  case P_PUNCT:
    if ((st = tk_char_segments(s, n, is_pun, NULL, &segs)) == TD_OK) st = split_with(s, n, at_start, &segs, p->behavior, out);
    break;
  case P_BERT: {
    tk_pieces mid = {0};
    if ((st = tk_char_segments(s, n, is_ws, NULL, &segs)) == TD_OK) st = split_with(s, n, at_start, &segs, TK_REMOVED, &mid);
    for (size_t i = 0; st == TD_OK && i < mid.n; i++)
      if ((st = tk_char_segments(mid.v[i].s, mid.v[i].n, is_pun, NULL, &segs)) == TD_OK)
        st = split_with(mid.v[i].s, mid.v[i].n, mid.v[i].at_start, &segs, TK_ISOLATED, out);
    tk_pieces_free(&mid);
    break;
  }
  case P_SEQUENCE: break; /* handled by the caller */
  }
  free(segs.v);
  tk_buf_free(&b);
  return st;
}

static td_status byte_map(tk_pieces *ps) {
  for (size_t i = 0; i < ps->n; i++) {
    tk_piece *pc = &ps->v[i];
    if (pc->id >= 0) continue;
    tk_buf b = {0};
    td_status st = TD_OK;
    for (size_t k = 0; st == TD_OK && k < pc->n; k++) st = tk_buf_addcp(&b, tk_byte_to_char((uint8_t)pc->s[k]));
    if (st == TD_OK) st = tk_buf_add(&b, "", 0);
    if (st != TD_OK) {
      tk_buf_free(&b);
      return st;
    }
    free(pc->s);
    pc->s = b.p;
    pc->n = b.n;
  }
  return TD_OK;
}

td_status tk_pretok_apply(const tk_pretok *p, tk_pieces *ps) {
  if (p->kind == P_SEQUENCE) {
    for (size_t i = 0; i < p->nseq; i++) TD_TRY(tk_pretok_apply(p->seq[i], ps));
    return TD_OK;
  }
  tk_pieces out = {0};
  td_status st = TD_OK;
  for (size_t i = 0; st == TD_OK && i < ps->n; i++) {
    tk_piece *pc = &ps->v[i];
    if (pc->id >= 0) st = tk_pieces_push(&out, pc->s, pc->n, pc->id, pc->at_start);
    else st = split_piece(p, pc->s, pc->n, pc->at_start, &out);
  }
  if (st == TD_OK && p->kind == P_BYTELEVEL) st = byte_map(&out);
  if (st != TD_OK) {
    tk_pieces_free(&out);
    return st;
  }
  tk_pieces_free(ps);
  *ps = out;
  return TD_OK;
}

/* ---- parsing ---- */

void tk_pretok_free(tk_pretok *p) {
  if (!p) return;
  for (size_t i = 0; i < p->nseq; i++) tk_pretok_free(p->seq[i]);
  free(p->seq);
  tk_regex_free(p->re);
  free(p);
}

static td_status one_char(const cJSON *j, const char *key, const char *what, uint32_t *out) {
  const char *s = tk_jstr(j, key);
  uint32_t cp;
  if (!s || !s[0] || tk_utf8_valid_prefix(s, strlen(s)) != strlen(s) || tk_utf8_next(s, strlen(s), &cp) != strlen(s))
    return td_err(TD_ERR_FORMAT, "tokenizer.json: %s: \"%s\" must be one character", what, key);
  *out = cp;
  return TD_OK;
}

td_status tk_pretok_parse(const cJSON *j, tk_pretok **out) {
  const char *type;
  TD_TRY(tk_jtype(j, "pre_tokenizer", &type));
  static const struct {
    const char *name;
    pretok_kind kind;
  } kinds[] = {{"ByteLevel", P_BYTELEVEL}, {"Metaspace", P_METASPACE},    {"Whitespace", P_WHITESPACE},
               {"WhitespaceSplit", P_WSSPLIT}, {"Split", P_SPLIT},        {"Digits", P_DIGITS},
               {"Punctuation", P_PUNCT},   {"CharDelimiterSplit", P_CHARDELIM}, {"BertPreTokenizer", P_BERT},
               {"Sequence", P_SEQUENCE}};
  size_t k = 0;
  while (k < sizeof kinds / sizeof *kinds && strcmp(kinds[k].name, type)) k++;
  if (k == sizeof kinds / sizeof *kinds)
    return td_err(TD_ERR_UNSUPPORTED, "tokenizer.json: unknown pre_tokenizer \"%s\"", type);
  tk_pretok *p = calloc(1, sizeof *p);
  if (!p) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  p->kind = kinds[k].kind;
  td_status st = TD_OK;
  switch (p->kind) {
  case P_BYTELEVEL:
    p->add_prefix_space = tk_jbool(j, "add_prefix_space", true);
    p->use_regex = tk_jbool(j, "use_regex", true);
    if (p->use_regex) st = tk_regex_new(BYTELEVEL_RE, strlen(BYTELEVEL_RE), false, "ByteLevel", &p->re);
    break;
  case P_METASPACE: {
    if ((st = one_char(j, "replacement", "Metaspace", &p->replacement)) != TD_OK) break;
    const char *scheme = tk_jstr(j, "prepend_scheme");
    p->prepend = PREPEND_ALWAYS;
    if (scheme && !strcmp(scheme, "first")) p->prepend = PREPEND_FIRST;
    else if (scheme && !strcmp(scheme, "never")) p->prepend = PREPEND_NEVER;
    else if (scheme && strcmp(scheme, "always"))
      st = td_err(TD_ERR_FORMAT, "tokenizer.json: Metaspace: unknown prepend_scheme \"%s\"", scheme);
    if (!tk_jbool(j, "add_prefix_space", true)) p->prepend = PREPEND_NEVER; /* older files */
    p->split = tk_jbool(j, "split", true);
    break;
  }
  case P_SPLIT: {
    if ((st = tk_split_parse(tk_jstr(j, "behavior"), &p->behavior)) != TD_OK) break;
    p->invert = tk_jbool(j, "invert", false);
    st = tk_pattern_parse(cJSON_GetObjectItemCaseSensitive(j, "pattern"), "Split pre_tokenizer", &p->re);
    break;
  }
  case P_DIGITS: p->individual = tk_jbool(j, "individual_digits", false); break;
  case P_PUNCT: {
    const char *b = tk_jstr(j, "behavior");
    p->behavior = TK_ISOLATED;
    if (b) st = tk_split_parse(b, &p->behavior);
    break;
  }
  case P_CHARDELIM: st = one_char(j, "delimiter", "CharDelimiterSplit", &p->replacement); break;
  case P_SEQUENCE: {
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(j, "pretokenizers");
    if (!cJSON_IsArray(a)) {
      st = td_err(TD_ERR_FORMAT, "tokenizer.json: pre_tokenizer Sequence has no pretokenizers array");
      break;
    }
    p->seq = calloc((size_t)cJSON_GetArraySize(a) + 1, sizeof *p->seq);
    if (!p->seq) st = td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
    const cJSON *e;
    cJSON_ArrayForEach(e, a) {
      if (st != TD_OK) break;
      if ((st = tk_pretok_parse(e, &p->seq[p->nseq])) == TD_OK) p->nseq++;
    }
    break;
  }
  default: break;
  }
  if (st != TD_OK) {
    tk_pretok_free(p);
    return st;
  }
  *out = p;
  return TD_OK;
}
