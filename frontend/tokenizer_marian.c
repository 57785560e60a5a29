/* Marian checkpoints: source.spm cuts the text into pieces, vocab.json gives
 * their ids (unknown pieces: <unk>), </s> ends the sequence; decoding maps
 * ids back through vocab.json and joins the pieces with source.spm (the
 * vocabulary is joint), special tokens kept apart, as transformers 5's
 * MarianTokenizer does (models/marian/tokenization_marian.py). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uthash.h>

#include "common/defaults.h"
#include "frontend/tokenizer_impl.h"

typedef struct ment {
  char *s;
  int32_t id;
  UT_hash_handle hh;
} ment;

typedef struct marian {
  tk_spm *src, *tgt;
  ment *ents, *map;
  size_t nents;
  char **by_id;
  int32_t size, unk, eos;
  char *special[3]; /* eos, unk, pad */
  tk_trie *special_trie;
} marian;

static void marian_destroy(td_tokenizer *t) {
  marian *m = t->impl;
  if (!m) return;
  tk_spm_free(m->src);
  tk_spm_free(m->tgt);
  HASH_CLEAR(hh, m->map);
  for (size_t i = 0; i < m->nents; i++) free(m->ents[i].s);
  free(m->ents);
  free(m->by_id);
  for (int i = 0; i < 3; i++) free(m->special[i]);
  tk_trie_free(m->special_trie);
  free(m);
}

static int32_t lookup(const marian *m, const char *s, size_t n) {
  ment *e = NULL;
  HASH_FIND(hh, m->map, s, n, e);
  return e ? e->id : -1;
}

static td_status load_vocab(marian *m, const char *path, size_t max) {
  char *json;
  size_t len;
  TD_TRY(tk_read_file(path, max, &json, &len));
  cJSON *root = tk_utf8_valid_prefix(json, len) == len ? cJSON_ParseWithLength(json, len) : NULL;
  free(json);
  if (!cJSON_IsObject(root)) {
    cJSON_Delete(root);
    return td_err(TD_ERR_FORMAT, "%s is not a JSON object of piece -> id", path);
  }
  td_status st = TD_OK;
  int cnt = cJSON_GetArraySize(root);
  if (!(m->ents = calloc((size_t)cnt + 1, sizeof *m->ents))) st = td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  const cJSON *e;
  cJSON_ArrayForEach(e, root) {
    if (st != TD_OK) break;
    double v = cJSON_IsNumber(e) ? e->valuedouble : -1;
    if (v < 0 || v >= TD_TOKENIZER_MAX_VOCAB || v != (double)(int32_t)v) {
      st = td_err(TD_ERR_FORMAT, "%s: \"%s\" has no id in range", path, e->string);
      break;
    }
    ment *x = &m->ents[m->nents];
    if (!(x->s = strdup(e->string))) {
      st = td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
      break;
    }
    x->id = (int32_t)v;
    m->nents++;
    ment *old = NULL;
    HASH_FIND(hh, m->map, x->s, strlen(x->s), old);
    if (old) HASH_DEL(m->map, old);
    HASH_ADD_KEYPTR(hh, m->map, x->s, strlen(x->s), x);
    if (x->id + 1 > m->size) m->size = x->id + 1;
  }
  cJSON_Delete(root);
  if (st != TD_OK) return st;
  if (!(m->by_id = calloc((size_t)m->size + 1, sizeof *m->by_id))) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  for (size_t i = 0; i < m->nents; i++) m->by_id[m->ents[i].id] = m->ents[i].s; /* the last listed wins, as a dict */
  return TD_OK;
}

static bool is_special_text(const marian *m, const char *s, size_t n) {
  for (int i = 0; i < 3; i++)
    if (m->special[i] && strlen(m->special[i]) == n && !memcmp(m->special[i], s, n)) return true;
  return false;
}

/* MarianTokenizer.remove_language_code + _tokenize: a chunk that starts with
 * ">>" has its text up to the first "<<" as one token (a >>lang<< code);
 * source.spm cuts the rest as it is, spaces and later ">>..<<" included. */
static td_status tokenize_chunk(const marian *m, const char *s, size_t n, tk_ids *v) {
  td_status st = TD_OK;
  const char *end = n >= 2 && !memcmp(s, ">>", 2) ? memmem(s, n, "<<", 2) : NULL;
  if (end) {
    size_t k = (size_t)(end - s) + 2;
    int32_t id = lookup(m, s, k);
    st = tk_ids_push(v, id >= 0 ? id : m->unk);
    s += k;
    n -= k;
  }
  char **pieces = NULL;
  size_t np = 0;
  if (st == TD_OK) st = tk_spm_encode(m->src, s, n, &pieces, &np);
  for (size_t i = 0; st == TD_OK && i < np; i++) {
    int32_t id = lookup(m, pieces[i], strlen(pieces[i]));
    st = tk_ids_push(v, id >= 0 ? id : m->unk);
  }
  tk_spm_pieces_free(pieces, np);
  return st;
}

static td_status marian_encode(const td_tokenizer *t, const char *text, size_t len, bool add_special, int32_t **ids,
                               size_t *n) {
  const marian *m = t->impl;
  tk_ids v = {0};
  size_t from = 0, pos = 0;
  td_status st = TD_OK;
  while (st == TD_OK && pos < len) { /* special tokens in the text stay whole */
    int32_t idx = -1;
    size_t k = tk_trie_longest(m->special_trie, text + pos, len - pos, &idx);
    if (!k) {
      pos += tk_utf8_len((uint8_t)text[pos]);
      continue;
    }
    if (from < pos) st = tokenize_chunk(m, text + from, pos - from, &v);
    if (st == TD_OK) st = tk_ids_push(&v, idx);
    pos += k;
    from = pos;
  }
  if (st == TD_OK && from < len) st = tokenize_chunk(m, text + from, len - from, &v);
  if (st == TD_OK && add_special) st = tk_ids_push(&v, m->eos);
  if (st != TD_OK) {
    free(v.v);
    return st;
  }
  *ids = v.v;
  *n = v.n;
  return TD_OK;
}

/* convert_tokens_to_string: source.spm joins runs of pieces (_decode's
 * use_source_tokenizer is `not separate_vocabs`); a special token goes in as
 * itself followed by a space; ▁ becomes a space; stripped. */
static td_status marian_decode(const td_tokenizer *t, const int32_t *ids, size_t n, bool skip_special, tk_buf *out) {
  const marian *m = t->impl;
  const char **run = malloc((n + 1) * sizeof *run);
  if (!run) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  tk_buf all = {0}, part = {0};
  size_t nr = 0;
  td_status st = TD_OK;
  for (size_t i = 0; st == TD_OK && i <= n; i++) {
    const char *tok = i < n ? m->by_id[ids[i]] : NULL;
    bool special = tok && is_special_text(m, tok, strlen(tok));
    if (special && skip_special) continue;
    if (tok && !special) {
      run[nr++] = tok;
      continue;
    }
    part.n = 0;
    st = tk_spm_decode(m->src, run, nr, &part);
    nr = 0;
    if (st == TD_OK) st = tk_buf_add(&all, part.p ? part.p : "", part.n);
    if (st == TD_OK && tok) st = tk_buf_add(&all, tok, strlen(tok));
    if (st == TD_OK && tok) st = tk_buf_addc(&all, ' ');
  }
  free(run);
  out->n = 0;
  /* ▁ -> space, then strip() */
  const char *s = all.p ? all.p : "";
  tk_buf sp = {0};
  for (size_t i = 0; st == TD_OK && i < all.n;) {
    if (i + 3 <= all.n && !memcmp(s + i, "\xE2\x96\x81", 3)) st = tk_buf_addc(&sp, ' '), i += 3;
    else st = tk_buf_add(&sp, s + i, 1), i++;
  }
  s = sp.p ? sp.p : "";
  size_t a = tk_skip_space(s, 0, sp.n), e = tk_trim_space(s, a, sp.n);
  if (st == TD_OK) st = tk_buf_add(out, s + a, e - a);
  tk_buf_free(&all);
  tk_buf_free(&part);
  tk_buf_free(&sp);
  return st;
}

static int32_t marian_vocab_size(const td_tokenizer *t) { return ((const marian *)t->impl)->size; }
static int32_t marian_token_to_id(const td_tokenizer *t, const char *s) { return lookup(t->impl, s, strlen(s)); }
static const char *marian_id_to_token(const td_tokenizer *t, int32_t id) {
  const marian *m = t->impl;
  return id >= 0 && id < m->size ? m->by_id[id] : NULL;
}
static bool marian_is_special(const td_tokenizer *t, int32_t id) {
  const char *s = marian_id_to_token(t, id);
  return s && is_special_text(t->impl, s, strlen(s));
}

static const tk_ops marian_ops = {"marian", marian_encode, marian_decode, marian_vocab_size, marian_token_to_id,
                                  marian_id_to_token, marian_is_special, marian_destroy};

/* The special tokens' texts: tokenizer_config.json's when it names them.
 * separate_vocabs (decoding through target_vocab.json and target.spm) is
 * not read here, so it is refused rather than decoded wrongly. */
static td_status read_config(marian *m, const char *dir, const char *config, size_t config_len) {
  static const char *keys[3] = {"eos_token", "unk_token", "pad_token"}, *dflt[3] = {"</s>", "<unk>", "<pad>"};
  cJSON *root = config ? cJSON_ParseWithLength(config, config_len) : NULL; /* a bad one is refused by the caller */
  if (tk_jbool(root, "separate_vocabs", false)) {
    cJSON_Delete(root);
    return td_err(TD_ERR_FORMAT, "%s/tokenizer_config.json: separate_vocabs (a target_vocab.json) is not supported", dir);
  }
  for (int i = 0; i < 3; i++) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, keys[i]);
    const char *s = cJSON_IsString(v) ? v->valuestring : tk_jstr(v, "content");
    if (!(m->special[i] = strdup(s ? s : dflt[i]))) {
      cJSON_Delete(root);
      return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
    }
  }
  cJSON_Delete(root);
  return TD_OK;
}

/* DIR/NAME through libsentencepiece, refused over the file limit as every tokenizer file is. */
static td_status load_spm(const char *dir, const char *name, size_t max, tk_spm **out) {
  char path[4096], *bytes;
  size_t len;
  snprintf(path, sizeof path, "%s/%s", dir, name);
  TD_TRY(tk_read_file(path, max, &bytes, &len));
  td_status st = tk_spm_load(bytes, len, path, out);
  free(bytes);
  return st;
}

td_status tk_marian_load(const char *dir, const char *config, size_t config_len, td_tokenizer *t) {
  marian *m = calloc(1, sizeof *m);
  if (!m) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  t->impl = m;
  t->ops = &marian_ops;
  t->strip_tail = true;
  size_t max = t->opts.max_file_bytes;
  TD_TRY(load_spm(dir, "source.spm", max, &m->src));
  TD_TRY(load_spm(dir, "target.spm", max, &m->tgt)); /* decodes nothing with a joint vocabulary; loaded as transformers does */
  char path[4096];
  snprintf(path, sizeof path, "%s/vocab.json", dir);
  TD_TRY(load_vocab(m, path, max));
  TD_TRY(read_config(m, dir, config, config_len));
  m->eos = lookup(m, m->special[0], strlen(m->special[0]));
  m->unk = lookup(m, m->special[1], strlen(m->special[1]));
  if (m->eos < 0 || m->unk < 0)
    return td_err(TD_ERR_FORMAT, "%s: vocab.json lacks %s or %s", dir, m->special[0], m->special[1]);
  if (!(m->special_trie = tk_trie_new())) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  for (int i = 0; i < 3; i++) {
    int32_t id = lookup(m, m->special[i], strlen(m->special[i]));
    if (id >= 0) TD_TRY(tk_trie_add(m->special_trie, m->special[i], strlen(m->special[i]), id));
  }
  return TD_OK;
}
