/* Post-processors (TemplateProcessing, RobertaProcessing, BertProcessing,
 * ByteLevel, Sequence) and decoders (ByteLevel, Metaspace, Replace,
 * ByteFallback, Fuse, Strip, WordPiece, BPEDecoder, Sequence) of
 * tokenizer.json, and transformers' clean-up of spaces. */
#include <stdlib.h>
#include <string.h>

#include "common/defaults.h"
#include "frontend/tokenizer_impl.h"

/* ---- post-processors ---- */

typedef enum { PP_TEMPLATE, PP_PAIR, PP_NOOP, PP_SEQUENCE } post_kind;

struct tk_post {
  post_kind kind;
  tk_ids tmpl; /* TEMPLATE: ids, -1 where the sequence goes */
  tk_post **seq;
  size_t nseq;
};

void tk_post_free(tk_post *p) {
  if (!p) return;
  for (size_t i = 0; i < p->nseq; i++) tk_post_free(p->seq[i]);
  free(p->seq);
  free(p->tmpl.v);
  free(p);
}

static bool valid_id(const cJSON *v) {
  return cJSON_IsNumber(v) && v->valuedouble >= 0 && v->valuedouble < TD_TOKENIZER_MAX_VOCAB &&
         v->valuedouble == (double)(int32_t)v->valuedouble;
}

static td_status parse_template(tk_post *p, const cJSON *j) {
  const cJSON *single = cJSON_GetObjectItemCaseSensitive(j, "single");
  const cJSON *specials = cJSON_GetObjectItemCaseSensitive(j, "special_tokens");
  if (!cJSON_IsArray(single)) return td_err(TD_ERR_FORMAT, "tokenizer.json: TemplateProcessing has no single template");
  const cJSON *it;
  cJSON_ArrayForEach(it, single) {
    const cJSON *seq = cJSON_GetObjectItemCaseSensitive(it, "Sequence");
    const cJSON *sp = cJSON_GetObjectItemCaseSensitive(it, "SpecialToken");
    if (cJSON_IsObject(seq)) {
      const char *id = tk_jstr(seq, "id");
      if (id && !strcmp(id, "A")) TD_TRY(tk_ids_push(&p->tmpl, -1));
      continue; /* "B" has no place in a single sequence */
    }
    const char *name = cJSON_IsObject(sp) ? tk_jstr(sp, "id") : NULL;
    if (!name) return td_err(TD_ERR_FORMAT, "tokenizer.json: TemplateProcessing: an item is neither Sequence nor SpecialToken");
    const cJSON *def = cJSON_GetObjectItemCaseSensitive(specials, name);
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(def, "ids");
    if (!cJSON_IsArray(ids))
      return td_err(TD_ERR_FORMAT, "tokenizer.json: TemplateProcessing: special token \"%s\" is not defined", name);
    const cJSON *v;
    cJSON_ArrayForEach(v, ids) {
      if (!valid_id(v)) return td_err(TD_ERR_FORMAT, "tokenizer.json: TemplateProcessing: \"%s\" has a bad id", name);
      TD_TRY(tk_ids_push(&p->tmpl, (int32_t)v->valuedouble));
    }
  }
  return TD_OK;
}

/* RobertaProcessing / BertProcessing: cls A sep. */
static td_status parse_pair(tk_post *p, const cJSON *j, const char *type) {
  const cJSON *cls = cJSON_GetObjectItemCaseSensitive(j, "cls"), *sep = cJSON_GetObjectItemCaseSensitive(j, "sep");
  if (!cJSON_IsArray(cls) || !cJSON_IsArray(sep) || !valid_id(cJSON_GetArrayItem(cls, 1)) ||
      !valid_id(cJSON_GetArrayItem(sep, 1)))
    return td_err(TD_ERR_FORMAT, "tokenizer.json: %s needs cls and sep as [token, id]", type);
  p->kind = PP_TEMPLATE;
  TD_TRY(tk_ids_push(&p->tmpl, (int32_t)cJSON_GetArrayItem(cls, 1)->valuedouble));
  TD_TRY(tk_ids_push(&p->tmpl, -1));
  return tk_ids_push(&p->tmpl, (int32_t)cJSON_GetArrayItem(sep, 1)->valuedouble);
}

td_status tk_post_parse(const cJSON *j, tk_post **out) {
  const char *type;
  TD_TRY(tk_jtype(j, "post_processor", &type));
  tk_post *p = calloc(1, sizeof *p);
  if (!p) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  td_status st = TD_OK;
  if (!strcmp(type, "TemplateProcessing")) {
    p->kind = PP_TEMPLATE;
    st = parse_template(p, j);
  } else if (!strcmp(type, "RobertaProcessing") || !strcmp(type, "BertProcessing")) {
    st = parse_pair(p, j, type);
  } else if (!strcmp(type, "ByteLevel")) {
    p->kind = PP_NOOP; /* offsets only */
  } else if (!strcmp(type, "Sequence")) {
    p->kind = PP_SEQUENCE;
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(j, "processors");
    if (!cJSON_IsArray(a)) st = td_err(TD_ERR_FORMAT, "tokenizer.json: post_processor Sequence has no processors array");
    else if (!(p->seq = calloc((size_t)cJSON_GetArraySize(a) + 1, sizeof *p->seq)))
      st = td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
    const cJSON *e;
    cJSON_ArrayForEach(e, a) {
      if (st != TD_OK) break;
      if ((st = tk_post_parse(e, &p->seq[p->nseq])) == TD_OK) p->nseq++;
    }
  } else {
    st = td_err(TD_ERR_UNSUPPORTED, "tokenizer.json: unknown post_processor \"%s\"", type);
  }
  if (st != TD_OK) {
    tk_post_free(p);
    return st;
  }
  *out = p;
  return TD_OK;
}

td_status tk_post_apply(const tk_post *p, tk_ids *ids) {
  if (p->kind == PP_SEQUENCE) {
    for (size_t i = 0; i < p->nseq; i++) TD_TRY(tk_post_apply(p->seq[i], ids));
    return TD_OK;
  }
  if (p->kind != PP_TEMPLATE) return TD_OK;
  size_t total = 0;
  for (size_t i = 0; i < p->tmpl.n; i++) total += p->tmpl.v[i] < 0 ? ids->n : 1;
  int32_t *v = malloc((total + 1) * sizeof *v);
  if (!v) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  size_t k = 0;
  for (size_t i = 0; i < p->tmpl.n; i++) {
    if (p->tmpl.v[i] >= 0) v[k++] = p->tmpl.v[i];
    else if (ids->n) memcpy(v + k, ids->v, ids->n * sizeof *v), k += ids->n;
  }
  free(ids->v);
  *ids = (tk_ids){v, k, total + 1};
  return TD_OK;
}

/* ---- decoders ---- */

typedef enum { D_BYTELEVEL, D_METASPACE, D_REPLACE, D_BYTEFALLBACK, D_FUSE, D_STRIP, D_WORDPIECE, D_BPE, D_SEQUENCE } dec_kind;

struct tk_dec {
  dec_kind kind;
  uint32_t ch;      /* Metaspace replacement, Strip content */
  bool drop_first;  /* Metaspace: prepend_scheme is not never */
  size_t start, stop;
  tk_regex *re;
  char *str;        /* Replace content, WordPiece prefix, BPE suffix */
  bool cleanup;     /* WordPiece */
  tk_dec **seq;
  size_t nseq;
};

void tk_dec_free(tk_dec *d) {
  if (!d) return;
  for (size_t i = 0; i < d->nseq; i++) tk_dec_free(d->seq[i]);
  free(d->seq);
  tk_regex_free(d->re);
  free(d->str);
  free(d);
}

static td_status one_cp(const char *s, const char *what, uint32_t *out) {
  size_t n = s ? strlen(s) : 0;
  if (!n || tk_utf8_valid_prefix(s, n) != n || tk_utf8_next(s, n, out) != n)
    return td_err(TD_ERR_FORMAT, "tokenizer.json: %s decoder: needs one character", what);
  return TD_OK;
}

static td_status dup_str(const char *s, const char *dflt, char **out) {
  if (!(*out = strdup(s ? s : dflt))) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  return TD_OK;
}

static bool get_count(const cJSON *j, const char *key, size_t *out) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
  if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > 1e6) return false;
  *out = (size_t)v->valuedouble;
  return true;
}

td_status tk_dec_parse(const cJSON *j, tk_dec **out) {
  const char *type;
  TD_TRY(tk_jtype(j, "decoder", &type));
  static const struct {
    const char *name;
    dec_kind kind;
  } kinds[] = {{"ByteLevel", D_BYTELEVEL}, {"Metaspace", D_METASPACE}, {"Replace", D_REPLACE},
               {"ByteFallback", D_BYTEFALLBACK}, {"Fuse", D_FUSE}, {"Strip", D_STRIP},
               {"WordPiece", D_WORDPIECE}, {"BPEDecoder", D_BPE}, {"Sequence", D_SEQUENCE}};
  size_t k = 0;
  while (k < sizeof kinds / sizeof *kinds && strcmp(kinds[k].name, type)) k++;
  if (k == sizeof kinds / sizeof *kinds) return td_err(TD_ERR_UNSUPPORTED, "tokenizer.json: unknown decoder \"%s\"", type);
  tk_dec *d = calloc(1, sizeof *d);
  if (!d) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  d->kind = kinds[k].kind;
  td_status st = TD_OK;
  switch (d->kind) {
  case D_METASPACE: {
    st = one_cp(tk_jstr(j, "replacement"), "Metaspace", &d->ch);
    const char *scheme = tk_jstr(j, "prepend_scheme");
    d->drop_first = !(scheme && !strcmp(scheme, "never")) && tk_jbool(j, "add_prefix_space", true);
    break;
  }
  case D_REPLACE: {
    const char *c = tk_jstr(j, "content");
    if (!c) st = td_err(TD_ERR_FORMAT, "tokenizer.json: Replace decoder has no content");
    else st = dup_str(c, "", &d->str);
    if (st == TD_OK) st = tk_pattern_parse(cJSON_GetObjectItemCaseSensitive(j, "pattern"), "Replace decoder", &d->re);
    break;
  }
  case D_STRIP:
    st = one_cp(tk_jstr(j, "content"), "Strip", &d->ch);
    if (st == TD_OK && (!get_count(j, "start", &d->start) || !get_count(j, "stop", &d->stop)))
      st = td_err(TD_ERR_FORMAT, "tokenizer.json: Strip decoder needs start and stop counts");
    break;
  case D_WORDPIECE:
    st = dup_str(tk_jstr(j, "prefix"), "##", &d->str);
    d->cleanup = tk_jbool(j, "cleanup", true);
    break;
  case D_BPE: st = dup_str(tk_jstr(j, "suffix"), "</w>", &d->str); break;
  case D_SEQUENCE: {
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(j, "decoders");
    if (!cJSON_IsArray(a)) {
      st = td_err(TD_ERR_FORMAT, "tokenizer.json: decoder Sequence has no decoders array");
      break;
    }
    if (!(d->seq = calloc((size_t)cJSON_GetArraySize(a) + 1, sizeof *d->seq))) st = td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
    const cJSON *e;
    cJSON_ArrayForEach(e, a) {
      if (st != TD_OK) break;
      if ((st = tk_dec_parse(e, &d->seq[d->nseq])) == TD_OK) d->nseq++;
    }
    break;
  }
  default: break;
  }
  if (st != TD_OK) {
    tk_dec_free(d);
    return st;
  }
  *out = d;
  return TD_OK;
}

/* A list of token texts that each decoder rewrites. */
typedef struct toks {
  tk_buf *v;
  size_t n;
} toks;

static void toks_free(toks *t) {
  for (size_t i = 0; i < t->n; i++) tk_buf_free(&t->v[i]);
  free(t->v);
  *t = (toks){0};
}

/* Replaces t by one token holding b (b is taken). */
static td_status toks_single(toks *t, tk_buf *b) {
  toks_free(t);
  if (!(t->v = calloc(1, sizeof *t->v))) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  t->v[0] = *b;
  t->n = 1;
  *b = (tk_buf){0};
  return TD_OK;
}

static td_status replace_all(const char *s, size_t n, const char *pat, const char *rep, tk_buf *out) {
  size_t pl = strlen(pat), rl = strlen(rep);
  out->n = 0;
  for (size_t i = 0; i < n;) {
    if (pl && i + pl <= n && !memcmp(s + i, pat, pl)) {
      TD_TRY(tk_buf_add(out, rep, rl));
      i += pl;
    } else {
      TD_TRY(tk_buf_add(out, s + i, 1));
      i++;
    }
  }
  return tk_buf_add(out, "", 0);
}

/* Each pair's first string replaced by its second, pair after pair. */
static td_status replace_each(tk_buf *b, const char *const (*pats)[2], size_t n) {
  tk_buf o = {0};
  td_status st = TD_OK;
  for (size_t i = 0; i < n; i++) {
    if ((st = replace_all(b->p ? b->p : "", b->n, pats[i][0], pats[i][1], &o)) != TD_OK) break;
    tk_buf t = *b;
    *b = o;
    o = t;
  }
  tk_buf_free(&o);
  return st;
}

static const char *const wordpiece_pats[][2] = {{" .", "."},    {" ?", "?"},     {" !", "!"},    {" ,", ","},
                                                {" ' ", "'"},   {" n't", "n't"}, {" 'm", "'m"}, {" do not", " don't"},
                                                {" 's", "'s"},  {" 've", "'ve"}, {" 're", "'re"}};

/* u8::from_str_radix(s, 16) on two bytes: an optional '+', then hex digits. */
static int hex_byte(const char *s) {
  int v = 0, nd = 0;
  for (int i = 0; i < 2; i++) {
    char c = s[i];
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (d < 0) {
      if (i == 0 && c == '+') continue;
      return -1;
    }
    v = v * 16 + d;
    nd++;
  }
  return nd ? v : -1;
}

static td_status dec_bytefallback(toks *t) {
  toks o = {0};
  td_status st = TD_OK;
  /* at most one output a token: a valid run of bytes becomes one, an invalid one a U+FFFD a byte */
  if (!(o.v = calloc(t->n + 1, sizeof *o.v))) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  tk_buf bytes = {0};
  for (size_t i = 0; st == TD_OK && i <= t->n; i++) {
    const tk_buf *b = i < t->n ? &t->v[i] : NULL;
    int val = -1;
    if (b && b->n == 6 && !memcmp(b->p, "<0x", 3) && b->p[5] == '>') val = hex_byte(b->p + 3);
    if (val >= 0) {
      st = tk_buf_addc(&bytes, (char)val);
      continue;
    }
    if (bytes.n) {
      if (tk_utf8_valid_prefix(bytes.p, bytes.n) == bytes.n) {
        o.v[o.n++] = bytes;
        bytes = (tk_buf){0};
      } else {
        for (size_t k = 0; st == TD_OK && k < bytes.n; k++) {
          o.v[o.n] = (tk_buf){0};
          st = tk_buf_add(&o.v[o.n++], "\xEF\xBF\xBD", 3);
        }
        bytes.n = 0;
      }
    }
    if (b && st == TD_OK) {
      o.v[o.n] = (tk_buf){0};
      st = tk_buf_add(&o.v[o.n++], b->p ? b->p : "", b->n);
    }
  }
  tk_buf_free(&bytes);
  toks_free(t);
  *t = o;
  return st;
}

static td_status dec_one(const tk_dec *d, toks *t) {
  tk_buf b = {0};
  td_status st = TD_OK;
  switch (d->kind) {
  case D_SEQUENCE:
    for (size_t i = 0; i < d->nseq; i++) TD_TRY(dec_one(d->seq[i], t));
    return TD_OK;
  case D_BYTELEVEL: {
    tk_buf raw = {0};
    for (size_t i = 0; st == TD_OK && i < t->n; i++) {
      const tk_buf *x = &t->v[i];
      size_t start = raw.n;
      bool all = true;
      for (size_t k = 0; all && st == TD_OK && k < x->n;) {
        uint32_t cp;
        size_t l = tk_utf8_next(x->p + k, x->n - k, &cp);
        int by = tk_char_to_byte(cp);
        if (by < 0) all = false;
        else st = tk_buf_addc(&raw, (char)by);
        k += l;
      }
      if (!all && st == TD_OK) {
        raw.n = start;
        st = tk_buf_add(&raw, x->p, x->n);
      }
    }
    if (st == TD_OK) st = tk_utf8_lossy(raw.p ? raw.p : "", raw.n, &b);
    tk_buf_free(&raw);
    if (st == TD_OK) st = toks_single(t, &b);
    break;
  }
  case D_FUSE:
    for (size_t i = 0; st == TD_OK && i < t->n; i++) st = tk_buf_add(&b, t->v[i].p, t->v[i].n);
    if (st == TD_OK) st = tk_buf_add(&b, "", 0);
    if (st == TD_OK) st = toks_single(t, &b);
    break;
  case D_BYTEFALLBACK: return dec_bytefallback(t);
  default:
    for (size_t i = 0; st == TD_OK && i < t->n; i++) {
      tk_buf *x = &t->v[i];
      const char *s = x->p ? x->p : "";
      b.n = 0;
      if (d->kind == D_METASPACE) {
        for (size_t k = 0; st == TD_OK && k < x->n;) {
          uint32_t cp;
          size_t l = tk_utf8_next(s + k, x->n - k, &cp);
          if (cp != d->ch) st = tk_buf_add(&b, s + k, l);
          else if (!(i == 0 && d->drop_first)) st = tk_buf_addc(&b, ' ');
          k += l;
        }
        if (st == TD_OK) st = tk_buf_add(&b, "", 0);
      } else if (d->kind == D_REPLACE) {
        st = tk_regex_replace(d->re, s, x->n, d->str, strlen(d->str), &b);
      } else if (d->kind == D_STRIP) {
        size_t a = 0, e = x->n, cnt = 0;
        while (cnt < d->start && a < e) {
          uint32_t cp;
          size_t l = tk_utf8_next(s + a, e - a, &cp);
          if (cp != d->ch) break;
          a += l, cnt++;
        }
        for (cnt = 0; cnt < d->stop && e > a; cnt++) {
          size_t p = tk_utf8_prev(s, a, e);
          uint32_t cp;
          tk_utf8_next(s + p, e - p, &cp);
          if (cp != d->ch) break;
          e = p;
        }
        st = tk_buf_add(&b, s + a, e - a);
      } else if (d->kind == D_WORDPIECE) {
        size_t pl = strlen(d->str);
        if (i != 0 && x->n >= pl && !memcmp(s, d->str, pl)) st = tk_buf_add(&b, s + pl, x->n - pl);
        else if (i != 0) {
          if ((st = tk_buf_addc(&b, ' ')) == TD_OK) st = tk_buf_add(&b, s, x->n);
        } else st = tk_buf_add(&b, s, x->n);
        if (st == TD_OK && d->cleanup) st = replace_each(&b, wordpiece_pats, sizeof wordpiece_pats / sizeof *wordpiece_pats);
      } else if (d->kind == D_BPE) {
        st = replace_all(s, x->n, d->str, i + 1 == t->n ? "" : " ", &b);
      }
      if (st == TD_OK) {
        tk_buf tmp = *x;
        *x = b;
        b = tmp;
      }
    }
    break;
  }
  tk_buf_free(&b);
  return st;
}

td_status tk_dec_apply(const tk_dec *d, const char **tok, const size_t *len, size_t n, tk_buf *out) {
  out->n = 0;
  if (!d) {
    for (size_t i = 0; i < n; i++) {
      if (i) TD_TRY(tk_buf_addc(out, ' '));
      TD_TRY(tk_buf_add(out, tok[i], len[i]));
    }
    return tk_buf_add(out, "", 0);
  }
  toks t = {0};
  if (!(t.v = calloc(n + 1, sizeof *t.v))) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  td_status st = TD_OK;
  for (size_t i = 0; st == TD_OK && i < n; i++, t.n++) st = tk_buf_add(&t.v[i], tok[i], len[i]);
  if (st == TD_OK) st = dec_one(d, &t);
  for (size_t i = 0; st == TD_OK && i < t.n; i++) st = tk_buf_add(out, t.v[i].p, t.v[i].n);
  if (st == TD_OK) st = tk_buf_add(out, "", 0);
  toks_free(&t);
  return st;
}

/* ---- transformers' clean_up_tokenization ---- */

static const char *const cleanup_pats[][2] = {{" .", "."},    {" ?", "?"},    {" !", "!"},    {" ,", ","},
                                              {" ' ", "'"},   {" n't", "n't"}, {" 'm", "'m"}, {" 's", "'s"},
                                              {" 've", "'ve"}, {" 're", "'re"}};

td_status tk_cleanup_spaces(tk_buf *b) { return replace_each(b, cleanup_pats, sizeof cleanup_pats / sizeof *cleanup_pats); }

size_t tk_cleanup_holdback(const char *s, size_t n) {
  size_t best = 0;
  for (size_t i = 0; i < sizeof cleanup_pats / sizeof *cleanup_pats; i++) {
    size_t pl = strlen(cleanup_pats[i][0]);
    for (size_t k = pl - 1; k > best; k--) /* proper prefixes of the pattern ending the text */
      if (k <= n && !memcmp(s + n - k, cleanup_pats[i][0], k)) {
        best = k;
        break;
      }
  }
  return best;
}
