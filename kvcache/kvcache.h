/* Paged KV block pools: host-side bookkeeping of block ownership (reference
 * counts, copy-on-write sharing, reservations filled by outside writers)
 * and the pool memory, held in backend memory in the layout
 * [block][layer][K|V][head][slot][head_dim]. Not thread-safe: one owner
 * thread per pool. */
#ifndef TD_KVCACHE_KVCACHE_H
#define TD_KVCACHE_KVCACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "kernels/ops.h"

typedef struct td_kv_pool td_kv_pool;

typedef struct td_kv_pool_stats {
  int n_blocks;
  int n_free;
  int n_shared;       /* blocks with more than one reference */
  int n_reserved;     /* blocks held by open reservations */
  int n_reservations;
} td_kv_pool_stats;

/* n_blocks blocks of the given layout. b may be NULL for bookkeeping only
 * (no memory). */
td_status td_kv_pool_create(td_backend *b, const td_kv_layout *layout, int n_blocks, td_kv_pool **out);
void td_kv_pool_destroy(td_kv_pool *p);
/* How many blocks of this layout fit in `bytes`. */
int td_kv_pool_blocks_for_bytes(const td_backend *b, const td_kv_layout *layout, size_t bytes);

void *td_kv_pool_memory(td_kv_pool *p);
const td_kv_layout *td_kv_pool_layout(const td_kv_pool *p);
size_t td_kv_pool_block_bytes(const td_kv_pool *p);
td_kv_pool_stats td_kv_pool_get_stats(const td_kv_pool *p);
int td_kv_pool_num_free(const td_kv_pool *p);

/* Allocates n blocks (reference count 1) or none: TD_ERR_NO_BLOCKS. */
td_status td_kv_alloc(td_kv_pool *p, int n, int32_t *ids);
/* Adds a reference (sharing, e.g. a forked beam). */
td_status td_kv_ref(td_kv_pool *p, int32_t id);
/* Drops a reference; the block is free at zero. */
td_status td_kv_unref(td_kv_pool *p, int32_t id);
void td_kv_unref_all(td_kv_pool *p, const int32_t *ids, int n);
int td_kv_refcount(const td_kv_pool *p, int32_t id);
/* Whether an open reservation holds the block. */
bool td_kv_is_reserved(const td_kv_pool *p, int32_t id);
/* Marks (or unmarks) an allocated block as kept by a keeper that holds one
 * reference to it (the engine's encoder cache); the pool counts the marked
 * blocks no one else references as they change, so that reading the count
 * every step costs nothing. A block is unmarked when freed. */
void td_kv_mark(td_kv_pool *p, int32_t id, bool on);
int td_kv_marked_idle(const td_kv_pool *p);

/* How make_private copies a block (default: td_kv_copy_blocks on the
 * pool's backend). A model with follower ranks sets one that also tells
 * them. */
typedef td_status (*td_kv_copier)(void *ctx, const int32_t *pairs, int n_pairs);
void td_kv_pool_set_copier(td_kv_pool *p, td_kv_copier fn, void *ctx);

/* Copy-on-write: if *id is shared, replaces it by a fresh private copy
 * (copying the block's contents in backend memory) and drops one reference
 * to the old one. *copied tells whether a copy was made. */
td_status td_kv_make_private(td_kv_pool *p, int32_t *id, bool *copied);

/* Reservations: blocks set aside for an outside writer (a KV transfer),
 * valid until `expires_ms` (td_now_ms clock). */
td_status td_kv_reserve(td_kv_pool *p, int n, int64_t expires_ms, uint64_t *res_id, int32_t *ids);
/* Whether res_id is open and unexpired at now_ms and owns every block in ids. */
bool td_kv_reservation_valid(const td_kv_pool *p, uint64_t res_id, const int32_t *ids, int n, int64_t now_ms);
/* Hands the reserved blocks to the caller (their references move to it). */
td_status td_kv_reservation_claim(td_kv_pool *p, uint64_t res_id, int32_t *ids, int cap, int *n);
/* Frees the reservation and its blocks. */
td_status td_kv_reservation_release(td_kv_pool *p, uint64_t res_id);
/* Releases every reservation expired at now_ms; returns how many. */
int td_kv_reservations_expire(td_kv_pool *p, int64_t now_ms);

/* Checks the pool's invariants (free list, counts, reservations);
 * returns TD_ERR_INTERNAL with a message on the first violation. */
td_status td_kv_pool_check(const td_kv_pool *p);

#endif
