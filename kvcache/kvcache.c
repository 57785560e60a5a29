#include "kvcache/kvcache.h"

#include <stdlib.h>
#include <string.h>

#include <uthash.h>

typedef struct reservation {
  uint64_t id;
  int64_t expires_ms;
  int n;
  int32_t *ids;
  UT_hash_handle hh;
} reservation;

struct td_kv_pool {
  td_backend *b;
  td_kv_layout layout;
  void *mem;
  int n_blocks;
  int32_t *refs;     /* reference count per block */
  uint8_t *reserved; /* block held by a reservation */
  int32_t *free_ids; /* stack of free blocks */
  int n_free;
  int n_shared;      /* blocks with refs > 1, kept as they change: stats are read every step */
  int n_reserved;    /* blocks with reserved set */
  uint8_t *marked;   /* held by a keeper (td_kv_mark) */
  int n_marked_idle; /* marked blocks with refs == 1 (the keeper's only): read every step */
  reservation *res;  /* uthash by id */
  uint64_t next_res;
  td_kv_copier copier;
  void *copier_ctx;
};

void td_kv_pool_set_copier(td_kv_pool *p, td_kv_copier fn, void *ctx) {
  p->copier = fn;
  p->copier_ctx = ctx;
}

int td_kv_pool_blocks_for_bytes(const td_backend *b, const td_kv_layout *l, size_t bytes) {
  size_t per = td_kv_block_elems(l) * td_buf_elem_size(b, TD_BUF_ACT);
  size_t n = per ? bytes / per : 0;
  return n > (size_t)(1 << 30) ? (1 << 30) : (int)n;
}

td_status td_kv_pool_create(td_backend *b, const td_kv_layout *l, int n_blocks, td_kv_pool **out) {
  *out = NULL;
  if (n_blocks <= 0 || !td_kv_layout_valid(l))
    return td_err(TD_ERR_INVALID,
                  "KV pool: %d blocks of %d layers x %d heads x %d dims x %d slots with %d-wide states is not a pool",
                  n_blocks, l->n_layers, l->n_heads, l->head_dim, l->block_size, l->states);
  td_kv_pool *p = calloc(1, sizeof *p);
  if (!p) return td_err(TD_ERR_NOMEM, "out of memory");
  p->b = b;
  p->layout = *l;
  p->n_blocks = n_blocks;
  p->next_res = 1;
  p->refs = calloc((size_t)n_blocks, sizeof *p->refs);
  p->reserved = calloc((size_t)n_blocks, 1);
  p->marked = calloc((size_t)n_blocks, 1);
  p->free_ids = malloc(sizeof *p->free_ids * (size_t)n_blocks);
  td_status s = TD_OK;
  if (!p->refs || !p->reserved || !p->marked || !p->free_ids) {
    s = td_err(TD_ERR_NOMEM, "KV pool of %d blocks: out of memory", n_blocks);
    goto fail;
  }
  /* Pop order ascending: low ids first. */
  for (int i = 0; i < n_blocks; i++) p->free_ids[i] = n_blocks - 1 - i;
  p->n_free = n_blocks;
  if (b) {
    s = td_alloc(b, TD_BUF_ACT, td_kv_block_elems(l) * (size_t)n_blocks, &p->mem);
    if (s != TD_OK) {
      td_err_ctx(s, "KV pool of %d blocks (%zu bytes each): ", n_blocks,
                 td_kv_block_elems(l) * td_buf_elem_size(b, TD_BUF_ACT));
      goto fail;
    }
  }
  *out = p;
  return TD_OK;
fail:
  td_kv_pool_destroy(p);
  return s;
}

void td_kv_pool_destroy(td_kv_pool *p) {
  if (!p) return;
  reservation *r, *tmp;
  HASH_ITER(hh, p->res, r, tmp) {
    HASH_DEL(p->res, r);
    free(r->ids);
    free(r);
  }
  if (p->b) td_free(p->b, p->mem);
  free(p->free_ids);
  free(p->reserved);
  free(p->marked);
  free(p->refs);
  free(p);
}

void *td_kv_pool_memory(td_kv_pool *p) { return p->mem; }
const td_kv_layout *td_kv_pool_layout(const td_kv_pool *p) { return &p->layout; }
size_t td_kv_pool_block_bytes(const td_kv_pool *p) {
  return td_kv_block_elems(&p->layout) * (p->b ? td_buf_elem_size(p->b, TD_BUF_ACT) : 4);
}
int td_kv_pool_num_free(const td_kv_pool *p) { return p->n_free; }

td_kv_pool_stats td_kv_pool_get_stats(const td_kv_pool *p) {
  return (td_kv_pool_stats){.n_blocks = p->n_blocks, .n_free = p->n_free, .n_reservations = (int)HASH_COUNT(p->res),
                            .n_shared = p->n_shared, .n_reserved = p->n_reserved};
}

static bool valid_id(const td_kv_pool *p, int32_t id) { return id >= 0 && id < p->n_blocks; }

td_status td_kv_alloc(td_kv_pool *p, int n, int32_t *ids) {
  if (n < 0) return td_err(TD_ERR_INVALID, "KV alloc of %d blocks", n);
  if (n > p->n_free)
    return td_err(TD_ERR_NO_BLOCKS, "KV pool: %d blocks wanted, %d of %d free", n, p->n_free, p->n_blocks);
  for (int i = 0; i < n; i++) {
    int32_t id = p->free_ids[--p->n_free];
    p->refs[id] = 1;
    ids[i] = id;
  }
  return TD_OK;
}

td_status td_kv_ref(td_kv_pool *p, int32_t id) {
  if (!valid_id(p, id) || p->refs[id] <= 0) return td_err(TD_ERR_INVALID, "KV ref of unallocated block %d", id);
  if (++p->refs[id] == 2) {
    p->n_shared++;
    p->n_marked_idle -= p->marked[id];
  }
  return TD_OK;
}

/* One reference fewer on a block that keeps at least one. */
static void drop_shared(td_kv_pool *p, int32_t id) {
  if (--p->refs[id] == 1) {
    p->n_shared--;
    p->n_marked_idle += p->marked[id];
  }
}

td_status td_kv_unref(td_kv_pool *p, int32_t id) {
  if (!valid_id(p, id) || p->refs[id] <= 0) return td_err(TD_ERR_INVALID, "KV unref of unallocated block %d", id);
  if (p->refs[id] > 1) {
    drop_shared(p, id);
  } else {
    p->refs[id] = 0;
    p->n_marked_idle -= p->marked[id]; /* a keeper that lets go of its last reference keeps nothing */
    p->marked[id] = 0;
    if (p->reserved[id]) p->n_reserved--;
    p->reserved[id] = 0;
    p->free_ids[p->n_free++] = id;
  }
  return TD_OK;
}

void td_kv_unref_all(td_kv_pool *p, const int32_t *ids, int n) {
  for (int i = 0; i < n; i++) (void)td_kv_unref(p, ids[i]);
}

int td_kv_refcount(const td_kv_pool *p, int32_t id) { return valid_id(p, id) ? p->refs[id] : -1; }

bool td_kv_is_reserved(const td_kv_pool *p, int32_t id) { return valid_id(p, id) && p->reserved[id]; }

void td_kv_mark(td_kv_pool *p, int32_t id, bool on) {
  if (!valid_id(p, id) || p->refs[id] <= 0 || p->marked[id] == on) return;
  p->marked[id] = on;
  if (p->refs[id] == 1) p->n_marked_idle += on ? 1 : -1;
}

int td_kv_marked_idle(const td_kv_pool *p) { return p->n_marked_idle; }

td_status td_kv_make_private(td_kv_pool *p, int32_t *id, bool *copied) {
  *copied = false;
  int32_t old = *id;
  if (!valid_id(p, old) || p->refs[old] <= 0) return td_err(TD_ERR_INVALID, "KV copy-on-write of block %d", old);
  if (p->refs[old] == 1) return TD_OK;
  int32_t fresh;
  TD_TRY(td_kv_alloc(p, 1, &fresh));
  if (p->b || p->copier) {
    int32_t pair[2] = {old, fresh};
    td_status s = p->copier ? p->copier(p->copier_ctx, pair, 1) : td_kv_copy_blocks(p->b, p->mem, &p->layout, pair, 1);
    if (s != TD_OK) {
      (void)td_kv_unref(p, fresh);
      return s;
    }
  }
  drop_shared(p, old);
  *id = fresh;
  *copied = true;
  return TD_OK;
}

td_status td_kv_reserve(td_kv_pool *p, int n, int64_t expires_ms, uint64_t *res_id, int32_t *ids) {
  reservation *r = calloc(1, sizeof *r);
  if (!r) return td_err(TD_ERR_NOMEM, "out of memory");
  r->ids = malloc(sizeof *r->ids * (size_t)(n ? n : 1));
  if (!r->ids) {
    free(r);
    return td_err(TD_ERR_NOMEM, "out of memory");
  }
  td_status s = td_kv_alloc(p, n, r->ids);
  if (s != TD_OK) {
    free(r->ids);
    free(r);
    return s;
  }
  for (int i = 0; i < n; i++) p->reserved[r->ids[i]] = 1;
  p->n_reserved += n; /* fresh blocks: none was reserved */
  r->id = p->next_res++;
  r->n = n;
  r->expires_ms = expires_ms;
  HASH_ADD(hh, p->res, id, sizeof r->id, r);
  memcpy(ids, r->ids, sizeof *ids * (size_t)n);
  *res_id = r->id;
  return TD_OK;
}

static reservation *find_res(const td_kv_pool *p, uint64_t id) {
  reservation *r = NULL;
  HASH_FIND(hh, p->res, &id, sizeof id, r);
  return r;
}

bool td_kv_reservation_valid(const td_kv_pool *p, uint64_t res_id, const int32_t *ids, int n, int64_t now_ms) {
  const reservation *r = find_res(p, res_id);
  if (!r || now_ms > r->expires_ms) return false;
  for (int i = 0; i < n; i++) {
    bool found = false;
    for (int j = 0; j < r->n && !found; j++) found = r->ids[j] == ids[i];
    if (!found) return false;
  }
  return true;
}

static void drop_res(td_kv_pool *p, reservation *r, bool free_blocks) {
  HASH_DEL(p->res, r);
  for (int i = 0; i < r->n; i++) {
    if (p->reserved[r->ids[i]]) p->n_reserved--;
    p->reserved[r->ids[i]] = 0;
    if (free_blocks) (void)td_kv_unref(p, r->ids[i]);
  }
  free(r->ids);
  free(r);
}

td_status td_kv_reservation_claim(td_kv_pool *p, uint64_t res_id, int32_t *ids, int cap, int *n) {
  reservation *r = find_res(p, res_id);
  if (!r) return td_err(TD_ERR_NOT_FOUND, "KV reservation %llu is not open (expired or released)",
                        (unsigned long long)res_id);
  if (r->n > cap) return td_err(TD_ERR_INVALID, "KV reservation %llu has %d blocks, room for %d",
                                (unsigned long long)res_id, r->n, cap);
  memcpy(ids, r->ids, sizeof *ids * (size_t)r->n);
  *n = r->n;
  drop_res(p, r, false);
  return TD_OK;
}

td_status td_kv_reservation_release(td_kv_pool *p, uint64_t res_id) {
  reservation *r = find_res(p, res_id);
  if (!r) return td_err(TD_ERR_NOT_FOUND, "KV reservation %llu is not open", (unsigned long long)res_id);
  drop_res(p, r, true);
  return TD_OK;
}

int td_kv_reservations_expire(td_kv_pool *p, int64_t now_ms) {
  int n = 0;
  reservation *r, *tmp;
  HASH_ITER(hh, p->res, r, tmp) {
    if (now_ms > r->expires_ms) {
      drop_res(p, r, true);
      n++;
    }
  }
  return n;
}

td_status td_kv_pool_check(const td_kv_pool *p) {
  uint8_t *on_free = calloc((size_t)p->n_blocks, 1);
  if (!on_free) return td_err(TD_ERR_NOMEM, "out of memory");
  td_status s = TD_OK;
  for (int i = 0; i < p->n_free && s == TD_OK; i++) {
    int32_t id = p->free_ids[i];
    if (!valid_id(p, id) || on_free[id] || p->refs[id] != 0 || p->reserved[id])
      s = td_err(TD_ERR_INTERNAL, "KV pool: free list entry %d (block %d) is invalid", i, id);
    else
      on_free[id] = 1;
  }
  int in_use = 0, shared = 0, marked_idle = 0;
  for (int i = 0; i < p->n_blocks && s == TD_OK; i++) {
    if (p->refs[i] < 0) s = td_err(TD_ERR_INTERNAL, "KV pool: block %d has refcount %d", i, p->refs[i]);
    if (p->refs[i] == 0 && !on_free[i]) s = td_err(TD_ERR_INTERNAL, "KV pool: block %d leaked", i);
    if (p->refs[i] == 0 && p->marked[i]) s = td_err(TD_ERR_INTERNAL, "KV pool: free block %d is marked", i);
    in_use += p->refs[i] > 0;
    shared += p->refs[i] > 1;
    marked_idle += p->marked[i] && p->refs[i] == 1;
  }
  if (s == TD_OK && shared != p->n_shared)
    s = td_err(TD_ERR_INTERNAL, "KV pool: %d shared blocks, the count says %d", shared, p->n_shared);
  if (s == TD_OK && marked_idle != p->n_marked_idle)
    s = td_err(TD_ERR_INTERNAL, "KV pool: %d marked blocks held once, the count says %d", marked_idle,
               p->n_marked_idle);
  if (s == TD_OK && in_use + p->n_free != p->n_blocks)
    s = td_err(TD_ERR_INTERNAL, "KV pool: %d in use + %d free != %d", in_use, p->n_free, p->n_blocks);
  int reserved = 0;
  for (int i = 0; i < p->n_blocks; i++) reserved += p->reserved[i];
  if (s == TD_OK && reserved != p->n_reserved)
    s = td_err(TD_ERR_INTERNAL, "KV pool: %d reserved flags, the count says %d", reserved, p->n_reserved);
  int in_res = 0;
  const reservation *r;
  for (r = p->res; r && s == TD_OK; r = r->hh.next) {
    for (int i = 0; i < r->n && s == TD_OK; i++) {
      if (!p->reserved[r->ids[i]] || p->refs[r->ids[i]] != 1)
        s = td_err(TD_ERR_INTERNAL, "KV pool: reservation %llu block %d not held", (unsigned long long)r->id,
                   r->ids[i]);
    }
    in_res += r->n;
  }
  if (s == TD_OK && in_res != reserved)
    s = td_err(TD_ERR_INTERNAL, "KV pool: %d reserved flags, %d blocks in reservations", reserved, in_res);
  free(on_free);
  return s;
}
