/* The encoder cache (docs/encoder-cache.md): cross-attention KV kept by a
 * hash of the encoder input (XXH3 of the input ids or the Whisper
 * features; the model is the engine's own, so nothing else changes the
 * encoder's output). An entry holds one reference to each block; requests
 * with the same input take references too (cross KV is never written after
 * encoding, so sharing needs no copy-on-write). Entries are LRU within a
 * budget of blocks, and entries no request uses are evicted first whenever
 * the pool is short: the cache never makes work wait. */
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "common/log.h"
#include "engine/internal.h"

void eng_cache_init(td_engine *e) {
  eng_cache *c = &e->cache;
  c->budget = (int)(e->o.encoder_cache_fraction * td_kv_pool_get_stats(e->cross).n_blocks);
  c->mask = ~(uint64_t)0;
}

void eng_cache_set_hash_mask(td_engine *e, uint64_t mask) { e->cache.mask = mask; }

/* g's encoder input as bytes. */
static void key_of(const td_engine *e, const group *g, const void **p, size_t *n) {
  if (g->features) {
    *p = g->features;
    *n = sizeof(float) * (size_t)e->cfg->num_mel_bins * td_model_input_frames(e->m);
  } else {
    *p = g->input;
    *n = sizeof(int32_t) * (size_t)g->n_input;
  }
}

static void unlink_lru(eng_cache *c, centry *x) {
  if (x->older) x->older->newer = x->newer; else c->oldest = x->newer;
  if (x->newer) x->newer->older = x->older; else c->newest = x->older;
  x->older = x->newer = NULL;
}

static void push_newest(eng_cache *c, centry *x) {
  x->older = c->newest;
  x->newer = NULL;
  if (c->newest) c->newest->newer = x; else c->oldest = x;
  c->newest = x;
}

static void evict(td_engine *e, centry *x) {
  eng_cache *c = &e->cache;
  unlink_lru(c, x);
  HASH_DEL(c->by_hash, x);
  for (int i = 0; i < x->n_blocks; i++) td_kv_mark(e->cross, x->blocks[i], false);
  td_kv_unref_all(e->cross, x->blocks, x->n_blocks);
  c->n_blocks -= x->n_blocks;
  c->n_entries--;
  e->st.cache_evictions++;
  free(x->blocks);
  if (x->lender) x->lender->lent = NULL; /* the group keeps its features */
  else free(x->key);
  free(x);
}

static bool idle(const td_engine *e, const centry *x) {
  for (int i = 0; i < x->n_blocks; i++)
    if (td_kv_refcount(e->cross, x->blocks[i]) > 1) return false;
  return true;
}

centry *eng_cache_find(td_engine *e, group *g) {
  eng_cache *c = &e->cache;
  if (c->budget <= 0 || (!g->input && !g->features)) return NULL;
  const void *k;
  size_t n;
  key_of(e, g, &k, &n);
  if (!g->hashed) {
    g->key_hash = XXH3_64bits(k, n) & c->mask;
    g->hashed = true;
  }
  centry *x = NULL;
  HASH_FIND(hh, c->by_hash, &g->key_hash, sizeof g->key_hash, x);
  /* the full input decides: a collision is a miss */
  if (x && (x->key_bytes != n || memcmp(x->key, k, n) != 0)) x = NULL;
  return x;
}

void eng_cache_use(td_engine *e, centry *x, group *g) {
  for (int i = 0; i < x->n_blocks; i++) (void)td_kv_ref(e->cross, x->blocks[i]);
  memcpy(g->cross.v, x->blocks, sizeof(int32_t) * (size_t)x->n_blocks);
  g->cross.n = x->n_blocks;
  unlink_lru(&e->cache, x);
  push_newest(&e->cache, x);
  e->st.cache_hits++;
}

void eng_cache_insert(td_engine *e, group *g) {
  eng_cache *c = &e->cache;
  if (c->budget <= 0 || !g->hashed) return;
  e->st.cache_misses++;
  if (g->cross.n > c->budget) return; /* an input larger than the whole budget is not kept */
  centry *old = NULL;
  HASH_FIND(hh, c->by_hash, &g->key_hash, sizeof g->key_hash, old);
  if (old) evict(e, old); /* a different input under this hash: the newer one stays */
  while (c->n_blocks + g->cross.n > c->budget && c->oldest) evict(e, c->oldest);
  const void *k;
  size_t n;
  key_of(e, g, &k, &n);
  centry *x = calloc(1, sizeof *x);
  bool borrow = g->features != NULL && !g->lent; /* features: borrowed from the group, not copied */
  if (x) {
    x->key = borrow ? (void *)g->features : malloc(n ? n : 1);
    x->blocks = malloc(sizeof(int32_t) * (size_t)g->cross.n);
  }
  if (!x || !x->key || !x->blocks) { /* not cached: nothing else changes */
    if (x) {
      if (!borrow) free(x->key);
      free(x->blocks);
    }
    free(x);
    TD_WARN("encoder cache: out of memory, request %s not cached", g->id);
    return;
  }
  if (borrow) {
    x->lender = g;
    g->lent = x;
  } else {
    memcpy(x->key, k, n);
  }
  x->key_bytes = n;
  x->hash = g->key_hash;
  x->n_blocks = g->cross.n;
  memcpy(x->blocks, g->cross.v, sizeof(int32_t) * (size_t)g->cross.n);
  for (int i = 0; i < x->n_blocks; i++) {
    (void)td_kv_ref(e->cross, x->blocks[i]);
    td_kv_mark(e->cross, x->blocks[i], true);
  }
  HASH_ADD(hh, c->by_hash, hash, sizeof x->hash, x);
  push_newest(c, x);
  c->n_blocks += x->n_blocks;
  c->n_entries++;
}

void eng_release_features(td_engine *e, group *g) {
  (void)e;
  if (g->lent) { /* the entry keeps them as its key */
    g->lent->lender = NULL;
    g->lent = NULL;
  } else {
    free(g->features);
  }
  g->features = NULL;
}

void eng_cache_forget(td_engine *e, const group *g) {
  if (!g->hashed || g->hit || !g->cross.n) return;
  centry *x = NULL;
  HASH_FIND(hh, e->cache.by_hash, &g->key_hash, sizeof g->key_hash, x);
  if (x && x->n_blocks && x->blocks[0] == g->cross.v[0]) evict(e, x);
}

/* Counted by the pool as references change (a walk of the entries took ~60 us, every step). */
int eng_cache_idle_blocks(const td_engine *e) { return td_kv_marked_idle(e->cross); }

void eng_cache_holders(const td_engine *e, int *refs) {
  for (const centry *x = e->cache.oldest; x; x = x->newer)
    for (int i = 0; i < x->n_blocks; i++) refs[x->blocks[i]]++;
}

void td_engine_cache_reclaim(td_engine *e, int n) {
  centry *x = e->cache.oldest;
  while (x && td_kv_pool_num_free(e->cross) < n) {
    centry *next = x->newer;
    /* evicting an entry a request still uses frees nothing now */
    if (idle(e, x)) evict(e, x);
    x = next;
  }
}

void td_engine_cache_clear(td_engine *e) {
  while (e->cache.oldest) evict(e, e->cache.oldest);
}
