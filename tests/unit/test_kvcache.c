/* Block pool invariants under random allocate / share / copy-on-write /
 * reserve / mark / free sequences, and copy-on-write contents. */
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "kvcache/kvcache.h"

#define NB 37

Test(kvcache, random_operations_keep_invariants) {
  td_kv_layout l = {2, 2, 4, 3, 0, 0};
  td_kv_pool *p;
  cr_assert(td_kv_pool_create(NULL, &l, NB, &p) == TD_OK);
  /* holders: each owns a list of block ids (one reference per entry) */
  enum { H = 12 };
  int32_t held[H][NB * 4];
  int n_held[H] = {0};
  uint64_t res[8];
  int n_res = 0;
  bool mk[NB] = {false}; /* marked (a keeper's), as the test keeps it */
  srand(1234);
  for (int it = 0; it < 20000; it++) {
    int op = rand() % 8, h = rand() % H;
    if (op == 0) { /* allocate */
      int n = rand() % 5;
      int32_t ids[8];
      td_status s = td_kv_alloc(p, n, ids);
      if (n > td_kv_pool_num_free(p) + (s == TD_OK ? n : 0)) cr_assert_eq(s, TD_ERR_NO_BLOCKS);
      if (s == TD_OK && n_held[h] + n <= NB * 4)
        for (int i = 0; i < n; i++) held[h][n_held[h]++] = ids[i];
      else if (s == TD_OK)
        td_kv_unref_all(p, ids, n);
    } else if (op == 1 && n_held[h]) { /* share one with another holder */
      int g = rand() % H;
      int32_t id = held[h][rand() % n_held[h]];
      if (n_held[g] < NB * 4) {
        cr_assert(td_kv_ref(p, id) == TD_OK);
        held[g][n_held[g]++] = id;
      }
    } else if (op == 2 && n_held[h]) { /* release one */
      int k = rand() % n_held[h];
      cr_assert(td_kv_unref(p, held[h][k]) == TD_OK);
      held[h][k] = held[h][--n_held[h]];
    } else if (op == 3 && n_held[h]) { /* copy on write */
      int k = rand() % n_held[h];
      int before = td_kv_refcount(p, held[h][k]);
      bool copied;
      td_status s = td_kv_make_private(p, &held[h][k], &copied);
      if (s == TD_OK) {
        cr_assert_eq(copied, before > 1);
        cr_assert_eq(td_kv_refcount(p, held[h][k]), 1);
      } else {
        cr_assert_eq(s, TD_ERR_NO_BLOCKS);
      }
    } else if (op == 4 && n_res < 8) { /* reserve */
      int32_t ids[4];
      if (td_kv_reserve(p, 1 + rand() % 3, 1000 + rand() % 100, &res[n_res], ids) == TD_OK) n_res++;
    } else if (op == 5 && n_res) { /* claim or release a reservation */
      int k = rand() % n_res;
      if (rand() % 2) {
        int32_t ids[4];
        int n;
        cr_assert(td_kv_reservation_claim(p, res[k], ids, 4, &n) == TD_OK);
        for (int i = 0; i < n; i++) held[h][n_held[h]++] = ids[i];
      } else {
        cr_assert(td_kv_reservation_release(p, res[k]) == TD_OK);
      }
      res[k] = res[--n_res];
    } else if (op == 6 && n_res && rand() % 10 == 0) { /* time passes */
      int gone = td_kv_reservations_expire(p, 1050);
      int left = 0;
      for (int k = 0; k < n_res; k++)
        if (td_kv_reservation_valid(p, res[k], NULL, 0, 0)) res[left++] = res[k];
      cr_assert_eq(n_res - left, gone);
      n_res = left;
    } else if (op == 7 && n_held[h]) { /* a keeper marks or unmarks one */
      int32_t id = held[h][rand() % n_held[h]];
      mk[id] = rand() % 3 != 0;
      td_kv_mark(p, id, mk[id]);
    }
    cr_assert(td_kv_pool_check(p) == TD_OK, "iteration %d: %s", it, td_errmsg());
    /* reference counts equal the number of holders (+1 for reserved) */
    int expect[NB] = {0};
    for (int g = 0; g < H; g++)
      for (int i = 0; i < n_held[g]; i++) expect[held[g][i]]++;
    td_kv_pool_stats st = td_kv_pool_get_stats(p);
    int in_use = 0, shared = 0, reserved = 0, marked_idle = 0;
    for (int b = 0; b < NB; b++) {
      if (expect[b]) cr_assert_eq(td_kv_refcount(p, b), expect[b], "block %d", b);
      if (td_kv_refcount(p, b) == 0) mk[b] = false; /* freed: no longer kept */
      marked_idle += mk[b] && td_kv_refcount(p, b) == 1;
      in_use += td_kv_refcount(p, b) > 0;
      shared += td_kv_refcount(p, b) > 1;
      reserved += td_kv_is_reserved(p, b);
    }
    cr_assert_eq(st.n_free, NB - in_use);
    /* the stats' counts are kept as blocks change, not recounted: they must agree */
    cr_assert_eq(st.n_shared, shared, "iteration %d", it);
    cr_assert_eq(st.n_reserved, reserved, "iteration %d", it);
    cr_assert_eq(td_kv_marked_idle(p), marked_idle, "iteration %d", it);
  }
  for (int g = 0; g < H; g++) td_kv_unref_all(p, held[g], n_held[g]);
  for (int k = 0; k < n_res; k++) cr_assert(td_kv_reservation_release(p, res[k]) == TD_OK);
  cr_expect_eq(td_kv_pool_num_free(p), NB);
  cr_expect(td_kv_pool_check(p) == TD_OK);
  td_kv_pool_destroy(p);
}

Test(kvcache, copy_on_write_copies_contents) {
  td_backend_opts bo = {.kind = TD_BACKEND_CPU};
  td_backend *b;
  cr_assert(td_backend_create(&bo, &b) == TD_OK);
  td_kv_layout l = {3, 2, 5, 4, 0, 0};
  td_kv_pool *p;
  cr_assert(td_kv_pool_create(b, &l, 6, &p) == TD_OK);
  size_t be = td_kv_block_elems(&l);
  float *mem = td_kv_pool_memory(p);
  int32_t id;
  cr_assert(td_kv_alloc(p, 1, &id) == TD_OK);
  for (size_t i = 0; i < be; i++) mem[(size_t)id * be + i] = (float)i + 0.5f;
  cr_assert(td_kv_ref(p, id) == TD_OK);
  int32_t mine = id;
  bool copied;
  cr_assert(td_kv_make_private(p, &mine, &copied) == TD_OK);
  cr_assert(copied && mine != id);
  cr_assert_arr_eq(mem + (size_t)mine * be, mem + (size_t)id * be, be * sizeof(float));
  cr_expect_eq(td_kv_refcount(p, id), 1);
  cr_expect_eq(td_kv_refcount(p, mine), 1);
  td_kv_unref(p, id);
  td_kv_unref(p, mine);
  cr_expect(td_kv_unref(p, mine) == TD_ERR_INVALID);
  cr_expect_eq(td_kv_pool_num_free(p), 6);
  td_kv_pool_destroy(p);
  td_backend_destroy(b);
}

Test(kvcache, reservations_expire_and_refuse) {
  td_kv_layout l = {1, 1, 1, 1, 0, 0};
  td_kv_pool *p;
  cr_assert(td_kv_pool_create(NULL, &l, 4, &p) == TD_OK);
  uint64_t r;
  int32_t ids[4];
  cr_assert(td_kv_reserve(p, 3, 100, &r, ids) == TD_OK);
  cr_expect(td_kv_reservation_valid(p, r, ids, 3, 50));
  cr_expect(!td_kv_reservation_valid(p, r, ids, 3, 101), "expired reservation still valid");
  int32_t other = 3;
  cr_expect(!td_kv_reservation_valid(p, r, &other, 1, 50), "block outside the reservation accepted");
  cr_expect(td_kv_reserve(p, 2, 100, &r, ids) == TD_ERR_NO_BLOCKS);
  cr_expect_eq(td_kv_reservations_expire(p, 200), 1);
  cr_expect(!td_kv_reservation_valid(p, r, ids, 0, 0));
  int n;
  cr_expect(td_kv_reservation_claim(p, r, ids, 4, &n) == TD_ERR_NOT_FOUND);
  cr_expect_eq(td_kv_pool_num_free(p), 4);
  td_kv_pool_destroy(p);
}

/* A block with a states tail: [layer][K|V][head][slot][dim] then
 * [K|V][slot][states / 2]. td_kv_write puts layer n_layers's rows there,
 * each row's halves in the two planes, and nothing else moves; layouts
 * without a tail, odd widths and pools of nothing are refused. */
Test(kvcache, states_tail_layout_and_writes) {
  td_backend_opts bo = {.kind = TD_BACKEND_CPU};
  td_backend *b;
  cr_assert(td_backend_create(&bo, &b) == TD_OK);
  const int L = 2, H = 3, dh = 4, bs = 5, W = 6, NBK = 3;
  td_kv_layout l = {L, H, dh, bs, W, 0};
  cr_assert_eq(td_kv_block_elems(&l), (size_t)L * 2 * H * bs * dh + (size_t)bs * W);
  td_kv_span sp = td_kv_layer_span(&l, L), s1 = td_kv_layer_span(&l, 1);
  cr_expect(sp.off == (size_t)L * 2 * H * bs * dh && sp.heads == 1 && sp.dim == W / 2, "tail span %zu %d %d", sp.off,
            sp.heads, sp.dim);
  cr_expect(s1.off == (size_t)2 * H * bs * dh && s1.heads == H && s1.dim == dh, "layer 1 span %zu %d %d", s1.off,
            s1.heads, s1.dim);
  td_kv_pool *p;
  cr_assert(td_kv_pool_create(b, &l, NBK, &p) == TD_OK, "%s", td_errmsg());
  float *mem = td_kv_pool_memory(p);
  size_t be = td_kv_block_elems(&l), total = be * NBK;
  for (size_t i = 0; i < total; i++) mem[i] = -1.0f;
  /* rows of W values into slots 7 (block 1, slot 2) and 11 (block 2, slot 1); one row skipped */
  enum { N = 3 };
  float rows[N][8];
  for (int i = 0; i < N; i++)
    for (int c = 0; c < 8; c++) rows[i][c] = (float)(100 * i + c);
  int32_t slots[N] = {7, -1, 11};
  float *dev = NULL;
  int32_t *dslots = NULL;
  cr_assert(td_alloc(b, TD_BUF_ACT, sizeof rows / sizeof(float), (void **)&dev) == TD_OK);
  cr_assert(td_alloc(b, TD_BUF_I32, N, (void **)&dslots) == TD_OK);
  memcpy(dev, rows, sizeof rows);
  memcpy(dslots, slots, sizeof slots);
  cr_assert(td_kv_write(b, dev, dev + W / 2, 8, mem, &l, L, dslots, N) == TD_OK, "%s", td_errmsg());
  size_t changed = 0;
  for (size_t i = 0; i < total; i++) changed += mem[i] != -1.0f;
  cr_expect_eq(changed, (size_t)2 * W, "%zu elements changed, want %d", changed, 2 * W);
  for (int i = 0; i < N; i += 2) {
    int blk = slots[i] / bs, sl = slots[i] % bs;
    for (int kv = 0; kv < 2; kv++)
      for (int c = 0; c < W / 2; c++)
        cr_expect_eq(mem[(size_t)blk * be + sp.off + ((size_t)kv * bs + sl) * (W / 2) + c], rows[i][kv * (W / 2) + c],
                     "row %d plane %d column %d", i, kv, c);
  }
  cr_expect(td_kv_write(b, dev, dev, 2, mem, &l, L, dslots, N) == TD_ERR_INVALID, "a row stride under states / 2");
  td_kv_layout plain = {L, H, dh, bs, 0, 0};
  cr_expect(td_kv_write(b, dev, dev, 8, mem, &plain, L, dslots, N) == TD_ERR_INVALID, "a tail the layout lacks");
  int32_t pairs[2] = {1, 0};
  cr_assert(td_kv_copy_blocks(b, mem, &l, pairs, 1) == TD_OK);
  cr_expect_arr_eq(mem, mem + be, be * sizeof(float), "a block copy moves its tail too");
  td_kv_pool *bad = NULL;
  td_kv_layout odd = {L, H, dh, bs, 5, 0}, none = {0, H, dh, bs, 0, 0}, only = {0, H, dh, bs, W, 0};
  cr_expect(td_kv_pool_create(b, &odd, 2, &bad) == TD_ERR_INVALID, "an odd states width");
  cr_expect(td_kv_pool_create(b, &none, 2, &bad) == TD_ERR_INVALID, "no layers and no states");
  cr_expect(td_kv_pool_create(b, &only, 2, &bad) == TD_OK, "a pool of states only: %s", td_errmsg());
  cr_expect_eq(td_kv_pool_block_bytes(bad), (size_t)bs * W * sizeof(float));
  td_kv_pool_destroy(bad);
  td_free(b, dev);
  td_free(b, dslots);
  td_kv_pool_destroy(p);
  td_backend_destroy(b);
}

/* td_kv_write_layers: layers [layer0, layer0 + n) from one matrix's
 * columns land where td_kv_write a layer at a time puts them; the states
 * tail is not a layer of it, and neither are layers past the pool's */
Test(kvcache, write_layers_from_one_matrix) {
  td_backend_opts bo = {.kind = TD_BACKEND_CPU};
  td_backend *b;
  cr_assert(td_backend_create(&bo, &b) == TD_OK);
  const int L = 3, H = 2, dh = 4, bs = 3, NBK = 4, hd = H * dh, lcols = 2 * hd + 1, ld = L * lcols + 2;
  td_kv_layout l = {L, H, dh, bs, 4, 0};
  td_kv_pool *p, *q;
  cr_assert(td_kv_pool_create(b, &l, NBK, &p) == TD_OK && td_kv_pool_create(b, &l, NBK, &q) == TD_OK);
  size_t total = td_kv_block_elems(&l) * NBK;
  float *a = td_kv_pool_memory(p), *e = td_kv_pool_memory(q);
  for (size_t i = 0; i < total; i++) a[i] = e[i] = -1.0f;
  enum { N = 4 };
  float *rows = NULL;
  int32_t *slots = NULL;
  cr_assert(td_alloc(b, TD_BUF_ACT, (size_t)N * ld, (void **)&rows) == TD_OK);
  cr_assert(td_alloc(b, TD_BUF_I32, N, (void **)&slots) == TD_OK);
  for (int i = 0; i < N * ld; i++) rows[i] = (float)i;
  const int32_t sl[N] = {5, -1, 0, 11};
  memcpy(slots, sl, sizeof sl);
  cr_assert(td_kv_write_layers(b, rows + lcols, rows + lcols + hd, ld, (size_t)lcols, a, &l, 1, 2, slots, N) == TD_OK,
            "%s", td_errmsg());
  for (int j = 0; j < 2; j++)
    cr_assert(td_kv_write(b, rows + (j + 1) * lcols, rows + (j + 1) * lcols + hd, ld, e, &l, 1 + j, slots, N) == TD_OK);
  cr_expect_arr_eq(a, e, total * sizeof(float), "layers 1-2 at once against a layer at a time");
  size_t changed = 0;
  for (size_t i = 0; i < total; i++) changed += a[i] != -1.0f;
  cr_expect_eq(changed, (size_t)3 * 2 * 2 * hd, "3 rows x 2 layers x K and V: %zu changed", changed);
  cr_expect(td_kv_write_layers(b, rows, rows + hd, ld, (size_t)lcols, a, &l, 1, 3, slots, N) == TD_ERR_INVALID,
            "layers past the pool's");
  cr_expect(td_kv_write_layers(b, rows, rows + hd, ld, (size_t)lcols, a, &l, L, 1, slots, N) == TD_ERR_INVALID,
            "the states tail is not a layer");
  cr_expect(td_kv_write_layers(b, rows, rows + hd, ld, (size_t)lcols, a, &l, 0, 0, slots, N) == TD_ERR_INVALID,
            "no layers");
  cr_expect(td_kv_write_layers(b, rows, rows + hd, hd, (size_t)lcols, a, &l, 0, 2, slots, N) == TD_ERR_INVALID,
            "a row stride under a layer's columns");
  td_free(b, rows);
  td_free(b, slots);
  td_kv_pool_destroy(p);
  td_kv_pool_destroy(q);
  td_backend_destroy(b);
}

/* int8 K/V (td_kv_layout.int8): a layer is H x bs rows of dh bytes a plane
 * and H x bs float scales a plane, sizes in 2-byte elements; the states
 * tail after the layers as before; layouts it cannot hold are invalid, and
 * the CPU backend refuses every op on one */
Test(kvcache, int8_layout) {
  td_kv_layout l = {3, 4, 64, 16, 128, 1};
  cr_assert(td_kv_layout_valid(&l));
  size_t layer = (size_t)4 * 16 * (64 + 4); /* 2 x 4 x 16 x 64 bytes + 2 x 4 x 16 x 4 bytes, in 2-byte units */
  cr_expect_eq(td_kv_block_elems(&l), 3 * layer + 16 * 128);
  for (int i = 0; i <= 3; i++) cr_expect_eq(td_kv_layer_span(&l, i).off, (size_t)i * layer, "layer %d", i);
  td_kv_span tail = td_kv_layer_span(&l, 3);
  cr_expect(tail.heads == 1 && tail.dim == 64);
  td_kv_layout plain = l;
  plain.int8 = 0;
  cr_expect_eq(td_kv_block_elems(&plain), (size_t)3 * 2 * 4 * 16 * 64 + 16 * 128, "bf16: twice the bytes, no scales");
  const td_kv_layout bad[] = {{3, 4, 24, 16, 0, 1}, {3, 4, 64, 6, 0, 1}, {0, 4, 64, 16, 128, 1}, {3, 4, 64, 16, 0, 2}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) cr_expect(!td_kv_layout_valid(&bad[i]), "layout %zu", i);
  td_backend *b;
  td_backend_opts o = {.kind = TD_BACKEND_CPU};
  cr_assert(td_backend_create(&o, &b) == TD_OK);
  void *pool = NULL;
  cr_assert(td_alloc(b, TD_BUF_ACT, td_kv_block_elems(&l), &pool) == TD_OK);
  float rows[2 * 256] = {0};
  int32_t slot = 0;
  cr_expect_eq(td_kv_write(b, rows, rows + 256, 512, pool, &l, 0, &slot, 1), TD_ERR_UNSUPPORTED);
  cr_expect(strstr(td_errmsg(), "int8 K/V pools need the CUDA backend"), "%s", td_errmsg());
  cr_expect_eq(td_kv_read(b, pool, &l, 0, &slot, 1, rows, rows + 256, 512), TD_ERR_UNSUPPORTED);
  int32_t pairs[2] = {0, 0};
  cr_expect_eq(td_kv_copy_blocks(b, pool, &l, pairs, 1), TD_ERR_UNSUPPORTED);
  td_free(b, pool);
  td_backend_destroy(b);
}
