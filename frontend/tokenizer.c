/* td_tokenizer: loading a checkpoint folder, the tokenizer.json pipeline
 * (added tokens, normalizer, pre-tokenizer, model, post-processor;
 * decoder and transformers' decode rules) and the streaming detokenizer. */
#include <stdlib.h>
#include <string.h>

#include "common/defaults.h"
#include "frontend/tokenizer_impl.h"

typedef struct added {
  char *content, *norm; /* norm: the normalized content (matched on normalized text; decode gives it) */
  size_t n, norm_n;
  int32_t id;
  bool single_word, lstrip, rstrip, normalized, special;
} added;

typedef struct hf {
  tk_norm *norm;
  tk_pretok *pre;
  tk_model *model;
  tk_post *post;
  tk_dec *dec;
  added *added;
  size_t nadded;
  tk_trie *raw_trie, *norm_trie; /* values: index into added */
  int32_t size;
  const char **text; /* id -> the token decode gives */
  size_t *len;
  bool *special;
} hf;

/* ---- the tokenizer.json implementation ---- */

static void hf_destroy(td_tokenizer *t) {
  hf *h = t->impl;
  if (!h) return;
  tk_norm_free(h->norm);
  tk_pretok_free(h->pre);
  tk_model_free(h->model);
  tk_post_free(h->post);
  tk_dec_free(h->dec);
  for (size_t i = 0; i < h->nadded; i++) {
    free(h->added[i].content);
    free(h->added[i].norm);
  }
  free(h->added);
  tk_trie_free(h->raw_trie);
  tk_trie_free(h->norm_trie);
  free(h->text);
  free(h->len);
  free(h->special);
  free(h);
}

static td_status parse_added(hf *h, const cJSON *arr) {
  if (!arr || cJSON_IsNull(arr)) return TD_OK;
  if (!cJSON_IsArray(arr)) return td_err(TD_ERR_FORMAT, "tokenizer.json: added_tokens is not an array");
  int cnt = cJSON_GetArraySize(arr);
  if (!(h->added = calloc((size_t)cnt + 1, sizeof *h->added))) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  const cJSON *e;
  cJSON_ArrayForEach(e, arr) {
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(e, "id");
    const char *c = tk_jstr(e, "content");
    if (!c || !cJSON_IsNumber(id) || id->valuedouble < 0 || id->valuedouble >= TD_TOKENIZER_MAX_VOCAB ||
        id->valuedouble != (double)(int32_t)id->valuedouble)
      return td_err(TD_ERR_FORMAT, "tokenizer.json: added token %zu needs a content and an id in range", h->nadded);
    if (!c[0]) continue; /* tokenizers ignores empty ones */
    if (tk_utf8_valid_prefix(c, strlen(c)) != strlen(c))
      return td_err(TD_ERR_FORMAT, "tokenizer.json: added token %zu is not UTF-8", h->nadded);
    added *a = &h->added[h->nadded];
    bool special = tk_jbool(e, "special", false);
    *a = (added){.content = strdup(c), .n = strlen(c), .id = (int32_t)id->valuedouble,
                 .single_word = tk_jbool(e, "single_word", false), .lstrip = tk_jbool(e, "lstrip", false),
                 .rstrip = tk_jbool(e, "rstrip", false), .special = special,
                 .normalized = tk_jbool(e, "normalized", !special)};
    if (!a->content) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
    h->nadded++;
  }
  return TD_OK;
}

static td_status hf_index(hf *h) {
  h->raw_trie = tk_trie_new();
  h->norm_trie = tk_trie_new();
  if (!h->raw_trie || !h->norm_trie) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  h->size = tk_model_size(h->model);
  tk_buf b = {0};
  td_status st = TD_OK;
  for (size_t i = 0; st == TD_OK && i < h->nadded; i++) {
    added *a = &h->added[i];
    if (a->id + 1 > h->size) h->size = a->id + 1;
    if (a->normalized && h->norm) {
      st = tk_norm_apply(h->norm, a->content, a->n, &b);
      if (st == TD_OK && (b.n != a->n || memcmp(b.p, a->content, b.n)) && !(a->norm = strndup(b.p, b.n)))
        st = td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
      if (st != TD_OK) break;
      a->norm_n = b.n;
    }
    const char *key = a->norm ? a->norm : a->content; /* normalized text is matched by what it became */
    size_t len = a->norm ? a->norm_n : a->n;
    if (!a->normalized) st = tk_trie_add(h->raw_trie, a->content, a->n, (int32_t)i);
    else if (len) st = tk_trie_add(h->norm_trie, key, len, (int32_t)i);
  }
  tk_buf_free(&b);
  if (st != TD_OK) return st;
  h->text = calloc((size_t)h->size + 1, sizeof *h->text);
  h->len = calloc((size_t)h->size + 1, sizeof *h->len);
  h->special = calloc((size_t)h->size + 1, sizeof *h->special);
  if (!h->text || !h->len || !h->special) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  for (int32_t id = 0; id < tk_model_size(h->model); id++) h->text[id] = tk_model_id_to_token(h->model, id, &h->len[id]);
  for (size_t i = 0; i < h->nadded; i++) { /* added tokens first, as simple_id_to_token */
    added *a = &h->added[i];
    h->text[a->id] = a->norm ? a->norm : a->content;
    h->len[a->id] = a->norm ? a->norm_n : a->n;
  }
  tk_trie *sp = tk_trie_new(); /* special: the token's text is a special token's content */
  if (!sp) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  for (size_t i = 0; st == TD_OK && i < h->nadded; i++)
    if (h->added[i].special) st = tk_trie_add(sp, h->added[i].content, h->added[i].n, 1);
  for (int32_t id = 0; st == TD_OK && id < h->size; id++) {
    int32_t v = 0;
    if (h->text[id] && h->len[id]) h->special[id] = tk_trie_longest(sp, h->text[id], h->len[id], &v) == h->len[id];
  }
  tk_trie_free(sp);
  return st;
}

/* An optional component: absent or null is none. */
static const cJSON *present(const cJSON *root, const char *key) {
  const cJSON *j = cJSON_GetObjectItemCaseSensitive(root, key);
  return j && !cJSON_IsNull(j) ? j : NULL;
}

td_status tk_hf_load(const char *json, size_t len, td_tokenizer *t) {
  if (tk_utf8_valid_prefix(json, len) != len) return td_err(TD_ERR_FORMAT, "tokenizer.json is not UTF-8");
  cJSON *root = cJSON_ParseWithLength(json, len);
  if (!root) return td_err(TD_ERR_FORMAT, "tokenizer.json is not valid JSON (near byte %td)", cJSON_GetErrorPtr() ? cJSON_GetErrorPtr() - json : -1);
  hf *h = calloc(1, sizeof *h);
  td_status st = h ? TD_OK : td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  t->impl = h;
  t->ops = &tk_hf_ops;
  if (st == TD_OK && !cJSON_IsObject(root)) st = td_err(TD_ERR_FORMAT, "tokenizer.json is not a JSON object");
  /* truncation and padding are not read: transformers' encode of one text ignores them too */
  if (st == TD_OK) st = tk_model_parse(cJSON_GetObjectItemCaseSensitive(root, "model"), &h->model);
  const cJSON *j;
  if (st == TD_OK && (j = present(root, "normalizer"))) st = tk_norm_parse(j, &h->norm);
  if (st == TD_OK && (j = present(root, "pre_tokenizer"))) st = tk_pretok_parse(j, &h->pre);
  if (st == TD_OK && (j = present(root, "post_processor"))) st = tk_post_parse(j, &h->post);
  if (st == TD_OK && (j = present(root, "decoder"))) st = tk_dec_parse(j, &h->dec);
  if (st == TD_OK) st = parse_added(h, cJSON_GetObjectItemCaseSensitive(root, "added_tokens"));
  if (st == TD_OK) st = hf_index(h);
  cJSON_Delete(root);
  return st;
}

/* Splits pieces (id -1) around added tokens found by trie, as
 * AddedVocabulary::find_matches (leftmost-longest; single_word, lstrip,
 * rstrip). */
static td_status split_added(const hf *h, const tk_trie *trie, tk_pieces *ps) {
  tk_pieces out = {0};
  td_status st = TD_OK;
  for (size_t p = 0; st == TD_OK && p < ps->n; p++) {
    const tk_piece *pc = &ps->v[p];
    if (pc->id >= 0) {
      st = tk_pieces_push(&out, pc->s, pc->n, pc->id, pc->at_start);
      continue;
    }
    const char *s = pc->s;
    size_t n = pc->n, from = 0, pos = 0;
    while (st == TD_OK && pos < n) {
      int32_t idx = -1;
      size_t len = tk_trie_longest(trie, s + pos, n - pos, &idx);
      if (!len) {
        pos += tk_utf8_len((uint8_t)s[pos]);
        continue;
      }
      const added *a = &h->added[idx];
      size_t start = pos, stop = pos + len;
      pos = stop;
      if (a->single_word) {
        uint32_t cp;
        bool before = false, after = false;
        if (start > 0) {
          size_t q = tk_utf8_prev(s, 0, start);
          tk_utf8_next(s + q, start - q, &cp);
          before = tk_is_word(cp);
        }
        if (stop < n) {
          tk_utf8_next(s + stop, n - stop, &cp);
          after = tk_is_word(cp);
        }
        if (before || after) continue;
      }
      if (a->lstrip) start = tk_trim_space(s, from, start);
      if (a->rstrip) pos = stop = tk_skip_space(s, stop, n);
      if (from < start) st = tk_pieces_push(&out, s + from, start - from, -1, pc->at_start && from == 0);
      if (st == TD_OK) st = tk_pieces_push(&out, s + start, stop - start, a->id, false);
      from = stop;
    }
    if (st == TD_OK && from < n) st = tk_pieces_push(&out, s + from, n - from, -1, pc->at_start && from == 0);
  }
  if (st != TD_OK) {
    tk_pieces_free(&out);
    return st;
  }
  tk_pieces_free(ps);
  *ps = out;
  return TD_OK;
}

static td_status hf_encode(const td_tokenizer *t, const char *text, size_t len, bool add_special, int32_t **ids,
                           size_t *n) {
  const hf *h = t->impl;
  tk_pieces ps = {0};
  tk_buf b = {0};
  tk_ids v = {0};
  td_status st = TD_OK;
  if (len) st = tk_pieces_push(&ps, text, len, -1, true);
  if (st == TD_OK) st = split_added(h, h->raw_trie, &ps);
  for (size_t i = 0; st == TD_OK && h->norm && i < ps.n; i++) {
    tk_piece *pc = &ps.v[i];
    if (pc->id >= 0) continue;
    if ((st = tk_norm_apply(h->norm, pc->s, pc->n, &b)) != TD_OK) break;
    char *c = malloc(b.n + 1);
    if (!c) {
      st = td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
      break;
    }
    memcpy(c, b.p ? b.p : "", b.n);
    c[b.n] = 0;
    free(pc->s);
    pc->s = c;
    pc->n = b.n;
  }
  if (st == TD_OK) st = split_added(h, h->norm_trie, &ps);
  if (st == TD_OK && h->pre) st = tk_pretok_apply(h->pre, &ps);
  for (size_t i = 0; st == TD_OK && i < ps.n; i++)
    st = ps.v[i].id >= 0 ? tk_ids_push(&v, ps.v[i].id) : tk_model_tokenize(h->model, ps.v[i].s, ps.v[i].n, &v);
  if (st == TD_OK && add_special && h->post) st = tk_post_apply(h->post, &v);
  tk_pieces_free(&ps);
  tk_buf_free(&b);
  if (st != TD_OK) {
    free(v.v);
    return st;
  }
  *ids = v.v;
  *n = v.n;
  return TD_OK;
}

static td_status hf_decode(const td_tokenizer *t, const int32_t *ids, size_t n, bool skip_special, tk_buf *out) {
  const hf *h = t->impl;
  const char **tok = malloc((n + 1) * sizeof *tok);
  size_t *len = malloc((n + 1) * sizeof *len), k = 0;
  if (!tok || !len) {
    free(tok), free(len);
    return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  }
  for (size_t i = 0; i < n; i++) {
    if (skip_special && h->special[ids[i]]) continue;
    tok[k] = h->text[ids[i]];
    len[k++] = h->len[ids[i]];
  }
  td_status st = tk_dec_apply(h->dec, tok, len, k, out);
  free(tok);
  free(len);
  return st;
}

static int32_t hf_vocab_size(const td_tokenizer *t) { return ((const hf *)t->impl)->size; }

static int32_t hf_token_to_id(const td_tokenizer *t, const char *s) {
  const hf *h = t->impl;
  size_t n = strlen(s);
  for (size_t i = h->nadded; i-- > 0;)
    if (h->added[i].n == n && !memcmp(h->added[i].content, s, n)) return h->added[i].id;
  return tk_model_token_to_id(h->model, s, n);
}

static const char *hf_id_to_token(const td_tokenizer *t, int32_t id) {
  const hf *h = t->impl;
  return id >= 0 && id < h->size ? h->text[id] : NULL;
}

static bool hf_is_special(const td_tokenizer *t, int32_t id) {
  const hf *h = t->impl;
  return id >= 0 && id < h->size && h->special[id];
}

const tk_ops tk_hf_ops = {"tokenizer.json", hf_encode, hf_decode, hf_vocab_size, hf_token_to_id, hf_id_to_token,
                          hf_is_special, hf_destroy};
