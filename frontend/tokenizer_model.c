/* Models of tokenizer.json: BPE (merges by rank through a heap, byte
 * fallback, continuing-subword prefix, end-of-word suffix, unk fused or
 * not, ignore_merges), Unigram (SentencePiece's Viterbi over a trie, unk
 * fused, byte fallback) and WordLevel, as the tokenizers crate runs them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uthash.h>

#include "common/defaults.h"
#include "frontend/tokenizer_impl.h"

typedef enum { M_BPE, M_UNIGRAM, M_WORDLEVEL } model_kind;

typedef struct vent {
  char *s;
  size_t n;
  int32_t id;
  UT_hash_handle hh;
} vent;

typedef struct merge_ent {
  uint64_t pair;
  int32_t rank, id;
  UT_hash_handle hh;
} merge_ent;

struct tk_model {
  model_kind kind;
  vent *ents;       /* the vocabulary as listed */
  size_t nents;
  vent *map;        /* text -> entry (uthash) */
  vent **by_id;     /* id -> entry */
  int32_t size;
  merge_ent *merges_v, *merges;
  char *prefix, *suffix; /* BPE continuing_subword_prefix, end_of_word_suffix */
  int32_t unk;           /* unk token's id, or -1 */
  bool fuse_unk, byte_fallback, ignore_merges;
  double *scores, min_score; /* Unigram */
  tk_trie *trie;
};

#define UNK_PENALTY 10.0 /* sentencepiece's kUnkPenalty */

void tk_model_free(tk_model *m) {
  if (!m) return;
  HASH_CLEAR(hh, m->map);
  HASH_CLEAR(hh, m->merges);
  for (size_t i = 0; i < m->nents; i++) free(m->ents[i].s);
  free(m->ents);
  free(m->by_id);
  free(m->merges_v);
  free(m->prefix);
  free(m->suffix);
  free(m->scores);
  tk_trie_free(m->trie);
  free(m);
}

int32_t tk_model_size(const tk_model *m) { return m->size; }

static vent *find(const tk_model *m, const char *s, size_t n) {
  vent *e = NULL;
  HASH_FIND(hh, m->map, s, n, e);
  return e;
}

int32_t tk_model_token_to_id(const tk_model *m, const char *s, size_t n) {
  vent *e = find(m, s, n);
  return e ? e->id : -1;
}

const char *tk_model_id_to_token(const tk_model *m, int32_t id, size_t *len) {
  if (id < 0 || id >= m->size || !m->by_id[id]) return NULL;
  if (len) *len = m->by_id[id]->n;
  return m->by_id[id]->s;
}

/* ---- loading ---- */

static td_status add_entry(tk_model *m, const char *s, int64_t id) {
  if (id < 0 || id >= TD_TOKENIZER_MAX_VOCAB)
    return td_err(TD_ERR_FORMAT, "tokenizer.json: model: token id %lld out of range [0, %d)", (long long)id,
                  TD_TOKENIZER_MAX_VOCAB);
  size_t n = strlen(s);
  if (tk_utf8_valid_prefix(s, n) != n) return td_err(TD_ERR_FORMAT, "tokenizer.json: model: a token is not UTF-8");
  vent *e = &m->ents[m->nents];
  if (!(e->s = strdup(s))) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  e->n = n;
  e->id = (int32_t)id;
  m->nents++;
  vent *old = find(m, s, n);
  if (old) HASH_DEL(m->map, old); /* a later duplicate wins, as in a map built from the list */
  HASH_ADD_KEYPTR(hh, m->map, e->s, e->n, e);
  if (e->id + 1 > m->size) m->size = e->id + 1;
  return TD_OK;
}

static td_status index_ids(tk_model *m) {
  m->by_id = calloc((size_t)m->size + 1, sizeof *m->by_id);
  if (!m->by_id) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  for (size_t i = 0; i < m->nents; i++) m->by_id[m->ents[i].id] = &m->ents[i];
  return TD_OK;
}

static td_status parse_vocab_object(tk_model *m, const cJSON *v, const char *what) {
  if (!cJSON_IsObject(v)) return td_err(TD_ERR_FORMAT, "tokenizer.json: %s model has no vocab object", what);
  int cnt = cJSON_GetArraySize(v);
  if (!(m->ents = calloc((size_t)cnt + 1, sizeof *m->ents))) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  const cJSON *e;
  cJSON_ArrayForEach(e, v) {
    if (!cJSON_IsNumber(e) || e->valuedouble != (double)(int64_t)e->valuedouble)
      return td_err(TD_ERR_FORMAT, "tokenizer.json: %s vocab: \"%s\" has no integer id", what, e->string);
    TD_TRY(add_entry(m, e->string, (int64_t)e->valuedouble));
  }
  return index_ids(m);
}

static td_status dup_opt(const cJSON *j, const char *key, char **out) {
  const char *s = tk_jstr(j, key);
  if (s && !(*out = strdup(s))) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  return TD_OK;
}

static td_status parse_bpe(tk_model *m, const cJSON *j) {
  TD_TRY(parse_vocab_object(m, cJSON_GetObjectItemCaseSensitive(j, "vocab"), "BPE"));
  TD_TRY(dup_opt(j, "continuing_subword_prefix", &m->prefix));
  TD_TRY(dup_opt(j, "end_of_word_suffix", &m->suffix));
  m->fuse_unk = tk_jbool(j, "fuse_unk", false);
  m->byte_fallback = tk_jbool(j, "byte_fallback", false);
  m->ignore_merges = tk_jbool(j, "ignore_merges", false);
  const cJSON *d = cJSON_GetObjectItemCaseSensitive(j, "dropout");
  if (cJSON_IsNumber(d) && d->valuedouble > 0.0 && d->valuedouble < 1.0)
    return td_err(TD_ERR_UNSUPPORTED, "tokenizer.json: BPE dropout is random: not supported for serving");
  const char *unk = tk_jstr(j, "unk_token");
  m->unk = -1;
  if (unk) { /* a missing unk is an error only once it is needed, as in tokenizers */
    vent *e = find(m, unk, strlen(unk));
    m->unk = e ? e->id : -2;
  }
  const cJSON *mg = cJSON_GetObjectItemCaseSensitive(j, "merges");
  if (!mg || cJSON_IsNull(mg)) return TD_OK;
  if (!cJSON_IsArray(mg)) return td_err(TD_ERR_FORMAT, "tokenizer.json: BPE merges is not an array");
  int cnt = cJSON_GetArraySize(mg);
  if (!(m->merges_v = calloc((size_t)cnt + 1, sizeof *m->merges_v))) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  size_t plen = m->prefix ? strlen(m->prefix) : 0;
  int rank = 0;
  const cJSON *e;
  tk_buf cat = {0};
  td_status st = TD_OK;
  cJSON_ArrayForEach(e, mg) {
    const char *a, *b;
    size_t alen, blen;
    if (cJSON_IsString(e)) { /* "a b" */
      const char *sp = strchr(e->valuestring, ' ');
      if (!sp || strchr(sp + 1, ' ')) {
        st = td_err(TD_ERR_FORMAT, "tokenizer.json: BPE merge %d \"%s\" is not two tokens", rank, e->valuestring);
        break;
      }
      a = e->valuestring;
      alen = (size_t)(sp - a);
      b = sp + 1;
      blen = strlen(b);
    } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 && cJSON_IsString(cJSON_GetArrayItem(e, 0)) &&
               cJSON_IsString(cJSON_GetArrayItem(e, 1))) { /* ["a", "b"] */
      a = cJSON_GetArrayItem(e, 0)->valuestring;
      b = cJSON_GetArrayItem(e, 1)->valuestring;
      alen = strlen(a);
      blen = strlen(b);
    } else {
      st = td_err(TD_ERR_FORMAT, "tokenizer.json: BPE merge %d is neither \"a b\" nor [\"a\", \"b\"]", rank);
      break;
    }
    vent *ea = find(m, a, alen), *eb = find(m, b, blen);
    if (!ea || !eb || blen < plen) {
      st = td_err(TD_ERR_FORMAT, "tokenizer.json: BPE merge %d: a token is not in the vocabulary", rank);
      break;
    }
    cat.n = 0;
    if ((st = tk_buf_add(&cat, a, alen)) != TD_OK || (st = tk_buf_add(&cat, b + plen, blen - plen)) != TD_OK) break;
    vent *en = find(m, cat.p, cat.n);
    if (!en) {
      st = td_err(TD_ERR_FORMAT, "tokenizer.json: BPE merge %d: the merged token is not in the vocabulary", rank);
      break;
    }
    uint64_t pair = (uint64_t)(uint32_t)ea->id << 32 | (uint32_t)eb->id;
    merge_ent *old = NULL;
    HASH_FIND(hh, m->merges, &pair, sizeof pair, old);
    if (old) HASH_DEL(m->merges, old); /* a later duplicate wins */
    merge_ent *me = &m->merges_v[rank];
    *me = (merge_ent){.pair = pair, .rank = rank, .id = en->id};
    HASH_ADD(hh, m->merges, pair, sizeof me->pair, me);
    rank++;
  }
  tk_buf_free(&cat);
  return st;
}

static td_status parse_unigram(tk_model *m, const cJSON *j) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, "vocab");
  if (!cJSON_IsArray(v)) return td_err(TD_ERR_FORMAT, "tokenizer.json: Unigram model has no vocab array");
  int cnt = cJSON_GetArraySize(v);
  if (cnt >= TD_TOKENIZER_MAX_VOCAB) return td_err(TD_ERR_FORMAT, "tokenizer.json: Unigram vocab too large (%d)", cnt);
  m->ents = calloc((size_t)cnt + 1, sizeof *m->ents);
  m->scores = calloc((size_t)cnt + 1, sizeof *m->scores);
  m->trie = tk_trie_new();
  if (!m->ents || !m->scores || !m->trie) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  m->min_score = 1e300;
  int id = 0;
  const cJSON *e;
  cJSON_ArrayForEach(e, v) {
    const cJSON *t = cJSON_GetArrayItem(e, 0), *s = cJSON_GetArrayItem(e, 1);
    if (!cJSON_IsArray(e) || cJSON_GetArraySize(e) != 2 || !cJSON_IsString(t) || !cJSON_IsNumber(s))
      return td_err(TD_ERR_FORMAT, "tokenizer.json: Unigram vocab entry %d is not [piece, score]", id);
    TD_TRY(add_entry(m, t->valuestring, id));
    TD_TRY(tk_trie_add(m->trie, t->valuestring, strlen(t->valuestring), id));
    m->scores[id] = s->valuedouble;
    if (s->valuedouble < m->min_score) m->min_score = s->valuedouble;
    id++;
  }
  m->size = id;
  TD_TRY(index_ids(m));
  m->unk = -1;
  const cJSON *u = cJSON_GetObjectItemCaseSensitive(j, "unk_id");
  if (cJSON_IsNumber(u)) {
    if (u->valuedouble < 0 || u->valuedouble >= id)
      return td_err(TD_ERR_FORMAT, "tokenizer.json: Unigram unk_id %g is not in the vocabulary", u->valuedouble);
    m->unk = (int32_t)u->valuedouble;
  }
  m->byte_fallback = tk_jbool(j, "byte_fallback", false);
  m->fuse_unk = true;
  return TD_OK;
}

static td_status parse_wordlevel(tk_model *m, const cJSON *j) {
  TD_TRY(parse_vocab_object(m, cJSON_GetObjectItemCaseSensitive(j, "vocab"), "WordLevel"));
  const char *unk = tk_jstr(j, "unk_token");
  vent *e = unk ? find(m, unk, strlen(unk)) : NULL;
  m->unk = e ? e->id : -2;
  return TD_OK;
}

td_status tk_model_parse(const cJSON *j, tk_model **out) {
  const char *type = tk_jstr(j, "type");
  if (!cJSON_IsObject(j)) return td_err(TD_ERR_FORMAT, "tokenizer.json: no model object");
  tk_model *m = calloc(1, sizeof *m);
  if (!m) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  td_status st;
  if (!type && cJSON_GetObjectItemCaseSensitive(j, "merges")) type = "BPE"; /* older files name no type */
  if (type && !strcmp(type, "BPE")) {
    m->kind = M_BPE;
    st = parse_bpe(m, j);
  } else if (type && !strcmp(type, "Unigram")) {
    m->kind = M_UNIGRAM;
    st = parse_unigram(m, j);
  } else if (type && !strcmp(type, "WordLevel")) {
    m->kind = M_WORDLEVEL;
    st = parse_wordlevel(m, j);
  } else {
    st = td_err(TD_ERR_UNSUPPORTED, "tokenizer.json: unknown model \"%s\"", type ? type : "(no type)");
  }
  if (st != TD_OK) {
    tk_model_free(m);
    return st;
  }
  *out = m;
  return TD_OK;
}

/* ---- tokenizing ---- */

/* <0xAB> tokens for each byte of s; false when one is missing. */
static bool byte_tokens(const tk_model *m, const char *s, size_t n, int32_t *out) {
  for (size_t i = 0; i < n; i++) {
    char name[8];
    snprintf(name, sizeof name, "<0x%02X>", (uint8_t)s[i]);
    vent *e = find(m, name, 6);
    if (!e) return false;
    out[i] = e->id;
  }
  return true;
}

typedef struct sym {
  int32_t id, prev, next;
  size_t len;
} sym;

typedef struct hitem {
  int32_t rank, pos, id;
} hitem;

static bool h_less(const hitem *a, const hitem *b) { return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos; }

static void h_push(hitem *h, size_t *n, hitem x) {
  size_t i = (*n)++;
  h[i] = x;
  while (i && h_less(&h[i], &h[(i - 1) / 2])) {
    hitem t = h[i];
    h[i] = h[(i - 1) / 2];
    h[(i - 1) / 2] = t;
    i = (i - 1) / 2;
  }
}

static hitem h_pop(hitem *h, size_t *n) {
  hitem top = h[0];
  h[0] = h[--(*n)];
  size_t i = 0;
  for (;;) {
    size_t l = 2 * i + 1, r = l + 1, s = i;
    if (l < *n && h_less(&h[l], &h[s])) s = l;
    if (r < *n && h_less(&h[r], &h[s])) s = r;
    if (s == i) break;
    hitem t = h[i];
    h[i] = h[s];
    h[s] = t;
    i = s;
  }
  return top;
}

static const merge_ent *merge_of(const tk_model *m, int32_t a, int32_t b) {
  uint64_t pair = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
  merge_ent *e = NULL;
  HASH_FIND(hh, m->merges, &pair, sizeof pair, e);
  return e;
}

static td_status bpe_tokenize(const tk_model *m, const char *w, size_t n, tk_ids *ids) {
  if (m->ignore_merges) {
    vent *e = find(m, w, n);
    if (e) return tk_ids_push(ids, e->id);
  }
  size_t plen = m->prefix ? strlen(m->prefix) : 0, slen = m->suffix ? strlen(m->suffix) : 0;
  /* at most one symbol a byte, plus room for byte fallback of prefix / suffix */
  size_t maxs = n * (1 + plen + slen) + 1;
  sym *sy = malloc(maxs * sizeof *sy);
  hitem *heap = malloc((maxs * 3 + 1) * sizeof *heap); /* each merge pushes at most two */
  char *tmp = malloc(n + plen + slen + 1);
  int32_t *bt = malloc((n + plen + slen + 1) * sizeof *bt);
  td_status st = TD_OK;
  if (!sy || !heap || !tmp || !bt) st = td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  size_t ns = 0;
  int32_t unk_id = -1;
  size_t unk_len = 0;
  for (size_t i = 0; st == TD_OK && i < n;) {
    size_t k = tk_utf8_len((uint8_t)w[i]);
    if (i + k > n) k = n - i;
    size_t tl = 0;
    if (i > 0 && plen) memcpy(tmp, m->prefix, plen), tl = plen;
    memcpy(tmp + tl, w + i, k);
    tl += k;
    if (i + k == n && slen) memcpy(tmp + tl, m->suffix, slen), tl += slen;
    vent *e = find(m, tmp, tl);
    if (e) {
      if (unk_id >= 0) sy[ns++] = (sym){unk_id, 0, 0, unk_len}, unk_id = -1;
      sy[ns++] = (sym){e->id, 0, 0, k};
    } else if (m->byte_fallback && byte_tokens(m, tmp, tl, bt)) {
      for (size_t b = 0; b < tl; b++) sy[ns++] = (sym){bt[b], 0, 0, 1};
    } else if (m->unk != -1) {
      if (m->unk < 0) st = td_err(TD_ERR_FORMAT, "tokenizer.json: BPE unk_token is not in the vocabulary");
      else if (unk_id >= 0 && m->fuse_unk) unk_len += k;
      else {
        if (unk_id >= 0) sy[ns++] = (sym){unk_id, 0, 0, unk_len};
        unk_id = m->unk;
        unk_len = k;
      }
    } /* no unk token: the character is dropped, as in tokenizers */
    i += k;
  }
  if (st == TD_OK && unk_id >= 0) sy[ns++] = (sym){unk_id, 0, 0, unk_len};
  size_t nh = 0;
  for (size_t i = 0; st == TD_OK && i < ns; i++) {
    sy[i].prev = (int32_t)i - 1;
    sy[i].next = i + 1 < ns ? (int32_t)i + 1 : -1;
    const merge_ent *me = i + 1 < ns ? merge_of(m, sy[i].id, sy[i + 1].id) : NULL;
    if (me) h_push(heap, &nh, (hitem){me->rank, (int32_t)i, me->id});
  }
  while (st == TD_OK && nh) {
    hitem top = h_pop(heap, &nh);
    sym *s = &sy[top.pos];
    if (!s->len || s->next < 0) continue;
    sym *r = &sy[s->next];
    const merge_ent *me = merge_of(m, s->id, r->id);
    if (!me || me->id != top.id) continue; /* stale */
    s->id = top.id;
    s->len += r->len;
    r->len = 0;
    s->next = r->next;
    if (r->next >= 0) sy[r->next].prev = top.pos;
    if (s->prev >= 0 && (me = merge_of(m, sy[s->prev].id, s->id)))
      h_push(heap, &nh, (hitem){me->rank, s->prev, me->id});
    if (s->next >= 0 && (me = merge_of(m, s->id, sy[s->next].id)))
      h_push(heap, &nh, (hitem){me->rank, top.pos, me->id});
  }
  for (size_t i = 0; st == TD_OK && i < ns; i++)
    if (sy[i].len) st = tk_ids_push(ids, sy[i].id);
  free(sy);
  free(heap);
  free(tmp);
  free(bt);
  return st;
}

typedef struct node {
  double score;
  int32_t id;
  int64_t start; /* -1: not reached */
} node;

typedef struct uni_ctx {
  const tk_model *m;
  node *best;
  size_t at;
  double base;
  size_t mblen;
  bool single;
} uni_ctx;

static void uni_visit(size_t len, int32_t id, void *p) {
  uni_ctx *c = p;
  node *t = &c->best[c->at + len];
  double sc = c->m->scores[id] + c->base;
  if (t->start < 0 || sc > t->score) *t = (node){sc, id, (int64_t)c->at};
  if (len == c->mblen) c->single = true;
}

static td_status unigram_tokenize(const tk_model *m, const char *s, size_t n, tk_ids *ids) {
  node *best = malloc((n + 1) * sizeof *best);
  size_t *ends = malloc((n + 1) * sizeof *ends);
  int32_t *bt = malloc((n + 1) * sizeof *bt);
  if (!best || !ends || !bt) {
    free(best), free(ends), free(bt);
    return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  }
  td_status st = TD_OK;
  for (size_t i = 0; i <= n; i++) best[i] = (node){0, -1, -1};
  best[0].start = 0;
  double unk_score = m->min_score - UNK_PENALTY;
  for (size_t at = 0; at < n && st == TD_OK;) {
    uni_ctx c = {m, best, at, best[at].score, tk_utf8_len((uint8_t)s[at]), false};
    if (at + c.mblen > n) c.mblen = n - at;
    tk_trie_prefixes(m->trie, s + at, n - at, uni_visit, &c);
    if (!c.single) {
      if (m->unk < 0) {
        st = td_err(TD_ERR_FORMAT, "tokenizer.json: Unigram needs an unk_id for text outside its vocabulary");
        break;
      }
      node *t = &best[at + c.mblen];
      double sc = unk_score + c.base;
      if (t->start < 0 || sc > t->score) *t = (node){sc, m->unk, (int64_t)at};
    }
    at += c.mblen;
  }
  /* back from the end; fused unk runs become one piece */
  size_t np = 0;
  for (size_t e = n; st == TD_OK && e > 0;) {
    size_t b = (size_t)best[e].start;
    bool unk = best[e].id == m->unk && m->fuse_unk;
    if (unk) {
      while (b > 0 && best[b].id == m->unk) b = (size_t)best[b].start;
    }
    ends[np++] = e;
    e = b;
  }
  for (size_t k = np; st == TD_OK && k-- > 0;) {
    size_t e = ends[k], b = k + 1 < np ? ends[k + 1] : 0;
    vent *v = find(m, s + b, e - b);
    if (v) st = tk_ids_push(ids, v->id);
    else if (m->byte_fallback && byte_tokens(m, s + b, e - b, bt)) {
      for (size_t i = 0; st == TD_OK && i < e - b; i++) st = tk_ids_push(ids, bt[i]);
    } else if (m->unk < 0) {
      st = td_err(TD_ERR_FORMAT, "tokenizer.json: Unigram needs an unk_id for text outside its vocabulary");
    } else {
      st = tk_ids_push(ids, m->unk);
    }
  }
  free(best);
  free(ends);
  free(bt);
  return st;
}

td_status tk_model_tokenize(const tk_model *m, const char *s, size_t n, tk_ids *ids) {
  if (!n) return TD_OK;
  switch (m->kind) {
  case M_BPE: return bpe_tokenize(m, s, n, ids);
  case M_UNIGRAM: return unigram_tokenize(m, s, n, ids);
  case M_WORDLEVEL: {
    vent *e = find(m, s, n);
    if (e) return tk_ids_push(ids, e->id);
    if (m->unk < 0) return td_err(TD_ERR_FORMAT, "tokenizer.json: WordLevel unk_token is missing from the vocabulary");
    return tk_ids_push(ids, m->unk);
  }
  }
  return td_err(TD_ERR_INTERNAL, "tokenizer: bad model");
}
