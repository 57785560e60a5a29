/* Descriptor bytes: round trip, and every kind of malformed input is
 * rejected cleanly (never a crash, never a connection). */
#include "kvx_testutil.h"
#include "kvtransfer/wire.h"

static uint8_t rkey_a[24], rkey_s[16], addr[40], ipc_h[KVX_IPC_HANDLE_LEN];
/* the context's IPC flag: after magic .. gpu_id (38), the address (4 + 40),
 * the staging flag (1) and area (8 + 8 + 4 + 4 + 16) */
enum { IPC_FLAG_AT = 123 };

static kvx_desc sample(void) {
  kvx_desc d;
  memset(&d, 0, sizeof d);
  for (size_t i = 0; i < sizeof addr; i++) addr[i] = (uint8_t)(i * 7 + 1);
  for (size_t i = 0; i < sizeof rkey_a; i++) rkey_a[i] = (uint8_t)(i + 100);
  for (size_t i = 0; i < sizeof rkey_s; i++) rkey_s[i] = (uint8_t)(200 - i);
  d.caps = KVX_CAP_NCCL;
  d.uuid = 0x1122334455667788ull;
  d.host_id = 42;
  d.pid = 1234;
  d.gpu_id = 99;
  d.addr = addr;
  d.addr_len = sizeof addr;
  d.staging = true;
  d.stg_base = 0x7f0000000000ull;
  d.stg_slot_bytes = 1 << 20;
  d.stg_slots = 8;
  d.stg_rkey = rkey_s;
  d.stg_rkey_len = sizeof rkey_s;
  d.n_pools = 2;
  d.pools[0].info = (td_kvx_pool_info){7, TD_KVX_MEM_HOST, true, 100, kt_geom(0, 4, 0, 8, 64, 16, 4), false};
  d.pools[0].base = 0x600000ull;
  d.pools[0].rkey = rkey_a;
  d.pools[0].rkey_len = sizeof rkey_a;
  d.pools[1].info = (td_kvx_pool_info){9, TD_KVX_MEM_CUDA, false, 50, kt_geom(2, 4, 4, 8, 64, 16, 2), true};
  d.pools[1].info.geom.layout.states = 128; /* a states tail */
  d.pools[1].base = 0x7000000ull;
  /* CUDA IPC: the device (an odd length) and the GPU pool's handle */
  d.ipc = true;
  snprintf(d.dev_id, sizeof d.dev_id, "0000:65:00.0x");
  for (size_t i = 0; i < sizeof ipc_h; i++) ipc_h[i] = (uint8_t)(i * 13 + 5);
  d.pools[1].ipc_handle = ipc_h;
  d.pools[1].ipc_off = 4096 + 3;
  return d;
}

static void fix_crc(uint8_t *b, size_t n) {
  uint32_t c = kvx_crc32(b, n - 4);
  for (int i = 0; i < 4; i++) b[n - 4 + (size_t)i] = (uint8_t)(c >> (8 * i));
}

Test(kvx_desc, round_trip) {
  kvx_desc d = sample(), e;
  uint8_t *b = NULL;
  size_t n = 0;
  cr_assert_eq(kvx_desc_encode(&d, &b, &n), TD_OK);
  cr_assert_eq(kvx_desc_decode(b, n, &e), TD_OK, "%s", td_errmsg());
  cr_assert_eq(e.uuid, d.uuid);
  cr_assert_eq(e.gpu_id, 99);
  cr_assert_eq(e.addr_len, d.addr_len);
  cr_assert_eq(memcmp(e.addr, addr, sizeof addr), 0);
  cr_assert(e.staging);
  cr_assert_eq(e.stg_slots, 8);
  cr_assert_eq(e.n_pools, 2);
  cr_assert_eq(e.pools[0].info.pool_id, 7);
  cr_assert_eq(e.pools[0].info.geom.layout.head_dim, 64);
  cr_assert_eq(memcmp(e.pools[0].rkey, rkey_a, sizeof rkey_a), 0);
  cr_assert_eq(e.pools[1].info.mem, TD_KVX_MEM_CUDA);
  cr_assert_not(e.pools[1].info.direct);
  cr_assert_eq(e.pools[1].info.geom.head0, 4);
  cr_assert_eq(e.pools[0].info.geom.layout.states, 0);
  cr_assert_eq(e.pools[1].info.geom.layout.states, 128);
  cr_assert(e.ipc);
  cr_assert_str_eq(e.dev_id, "0000:65:00.0x");
  cr_assert_not(e.pools[0].info.ipc);
  cr_assert_null(e.pools[0].ipc_handle);
  cr_assert(e.pools[1].info.ipc);
  cr_assert_eq(e.pools[1].ipc_off, 4099);
  cr_assert_eq(memcmp(e.pools[1].ipc_handle, ipc_h, sizeof ipc_h), 0);
  td_kvx_desc_info info;
  cr_assert_eq(td_kvx_desc_parse(b, n, &info), TD_OK);
  cr_assert(info.nccl);
  cr_assert(info.ipc);
  cr_assert_eq(info.version, TD_KVX_DESC_VERSION);
  cr_assert_eq(info.n_pools, 2);
  cr_assert_eq(info.pools[1].geom.layer0, 2);
  cr_assert(info.pools[1].ipc);
  cr_assert_not(info.pools[0].ipc);
  /* Without IPC: no device, no handles. */
  d.ipc = false;
  d.pools[1].info.ipc = false;
  uint8_t *b2 = NULL;
  size_t n2 = 0;
  cr_assert_eq(kvx_desc_encode(&d, &b2, &n2), TD_OK);
  cr_assert_eq(n2, n - 1 - 13 - 8 - KVX_IPC_HANDLE_LEN);
  cr_assert_eq(kvx_desc_decode(b2, n2, &e), TD_OK, "%s", td_errmsg());
  cr_assert_not(e.ipc);
  cr_assert_not(e.pools[1].info.ipc);
  free(b2);
  free(b);
}

/* Version 2 (before CUDA IPC) is still read: the same layout without the
 * IPC fields, so a peer of that build gets the other paths. */
Test(kvx_desc, version_2_without_ipc) {
  kvx_desc d = sample(), e;
  d.version = 2;
  uint8_t *b = NULL, *b3 = NULL;
  size_t n = 0, n3 = 0;
  cr_assert_eq(kvx_desc_encode(&d, &b, &n), TD_OK);
  d.version = 0;
  cr_assert_eq(kvx_desc_encode(&d, &b3, &n3), TD_OK);
  /* flag, length, 13 bytes; a flag per pool, offset and handle; an int8 flag per pool (version 4) */
  cr_assert_eq(n, n3 - 1 - 1 - 13 - 1 - 1 - 8 - KVX_IPC_HANDLE_LEN - 2, "IPC fields left in version 2");
  cr_assert_eq(kvx_desc_decode(b, n, &e), TD_OK, "%s", td_errmsg());
  cr_assert_eq(e.version, 2);
  cr_assert_not(e.ipc);
  cr_assert_not(e.pools[1].info.ipc);
  cr_assert_eq(e.pools[1].info.geom.layout.states, 128);
  td_kvx_desc_info info;
  cr_assert_eq(td_kvx_desc_parse(b, n, &info), TD_OK);
  cr_assert_eq(info.version, 2);
  cr_assert_not(info.ipc);
  for (size_t len = 0; len < n; len++) cr_assert_eq(kvx_desc_decode(b, len, &e), TD_ERR_FORMAT, "length %zu", len);
  free(b3);
  d.version = 1;
  cr_assert_eq(kvx_desc_encode(&d, &b3, &n3), TD_ERR_VERSION);
  free(b);
}

/* Version 4: a pool's int8 K/V flag (td_kv_layout.int8), whose block
 * bytes differ from bf16's; version 3 has none (read as 0) and cannot carry
 * an int8 pool; a flag other than 0 or 1 is refused. */
Test(kvx_desc, int8_layouts) {
  kvx_desc d = sample(), e;
  d.pools[1].info.geom.layout.int8 = 1;
  uint8_t *b = NULL, *b3 = NULL;
  size_t n = 0, n3 = 0;
  cr_assert_eq(kvx_desc_encode(&d, &b, &n), TD_OK, "%s", td_errmsg());
  cr_assert_eq(kvx_desc_decode(b, n, &e), TD_OK, "%s", td_errmsg());
  cr_assert_eq(e.version, TD_KVX_DESC_VERSION);
  cr_assert_eq(e.pools[1].info.geom.layout.int8, 1);
  cr_assert_eq(e.pools[0].info.geom.layout.int8, 0);
  td_kvx_geom plain = e.pools[1].info.geom;
  plain.layout.int8 = 0;
  cr_assert_lt(td_kvx_block_bytes(&e.pools[1].info.geom), td_kvx_block_bytes(&plain));
  /* the flag byte: the last pool ends with int8, base, key (none), IPC flag, offset, handle */
  size_t at = n - 4 - KVX_IPC_HANDLE_LEN - 8 - 1 - 4 - 8 - 1;
  cr_assert_eq(b[at], 1);
  b[at] = 2;
  fix_crc(b, n);
  cr_assert_eq(kvx_desc_decode(b, n, &e), TD_ERR_FORMAT, "int8 flag 2 accepted");
  free(b);
  d.version = 3;
  cr_assert_eq(kvx_desc_encode(&d, &b3, &n3), TD_ERR_VERSION);
  d.pools[1].info.geom.layout.int8 = 0;
  cr_assert_eq(kvx_desc_encode(&d, &b3, &n3), TD_OK);
  cr_assert_eq(kvx_desc_decode(b3, n3, &e), TD_OK, "%s", td_errmsg());
  cr_assert_eq(e.version, 3);
  cr_assert_eq(e.pools[1].info.geom.layout.int8, 0);
  free(b3);
  /* int8 in a pool of 4-byte elements (the CPU's) is no layout */
  d = sample();
  d.pools[0].info.geom.layout.int8 = 1;
  cr_assert_eq(kvx_desc_encode(&d, &b, &n), TD_OK);
  cr_assert_eq(kvx_desc_decode(b, n, &e), TD_ERR_FORMAT);
  cr_assert(strstr(td_errmsg(), "int8"), "%s", td_errmsg());
  free(b);
}

Test(kvx_desc, truncated_and_flipped_bytes) {
  kvx_desc d = sample(), e;
  uint8_t *b = NULL;
  size_t n = 0;
  cr_assert_eq(kvx_desc_encode(&d, &b, &n), TD_OK);
  for (size_t len = 0; len < n; len++) {
    uint8_t *t = malloc(len ? len : 1);
    memcpy(t, b, len);
    td_status s = kvx_desc_decode(len ? t : NULL, len, &e);
    cr_assert(s == TD_ERR_FORMAT, "length %zu of %zu: %s", len, n, td_status_str(s));
    free(t);
  }
  /* Any single flipped bit: the checksum (or magic / version) rejects it. */
  for (size_t i = 0; i < n; i++) {
    for (int bit = 0; bit < 8; bit += 3) {
      b[i] ^= (uint8_t)(1u << bit);
      td_status s = kvx_desc_decode(b, n, &e);
      cr_assert(s == TD_ERR_FORMAT || s == TD_ERR_VERSION, "byte %zu bit %d accepted", i, bit);
      b[i] ^= (uint8_t)(1u << bit);
    }
  }
  /* Trailing garbage. */
  uint8_t *t = malloc(n + 3);
  memcpy(t, b, n);
  memset(t + n, 0, 3);
  fix_crc(t, n + 3);
  cr_assert_eq(kvx_desc_decode(t, n + 3, &e), TD_ERR_FORMAT);
  free(t);
  free(b);
}

Test(kvx_desc, version_mismatch) {
  kvx_desc d = sample(), e;
  uint8_t *b = NULL;
  size_t n = 0;
  cr_assert_eq(kvx_desc_encode(&d, &b, &n), TD_OK);
  b[4] = TD_KVX_DESC_VERSION + 1;
  fix_crc(b, n);
  cr_assert_eq(kvx_desc_decode(b, n, &e), TD_ERR_VERSION);
  cr_assert(strstr(td_errmsg(), "version"));
  b[4] = 1;
  fix_crc(b, n);
  cr_assert_eq(kvx_desc_decode(b, n, &e), TD_ERR_VERSION);
  free(b);
}

/* Fields checked one by one (with a valid checksum, as a buggy or hostile
 * peer would send). */
Test(kvx_desc, bad_fields) {
  kvx_desc e;
  uint8_t *b;
  size_t n;
  kvx_desc d;
#define CHECK(stmt, label)                                                        \
  do {                                                                            \
    d = sample();                                                                 \
    stmt;                                                                         \
    cr_assert_eq(kvx_desc_encode(&d, &b, &n), TD_OK);                             \
    td_status s_ = kvx_desc_decode(b, n, &e);                                     \
    cr_assert_eq(s_, TD_ERR_FORMAT, "%s: %s (%s)", label, td_status_str(s_), td_errmsg()); \
    free(b);                                                                      \
  } while (0)
  CHECK(d.pools[0].info.geom.layout.n_layers = 0, "zero layers");
  CHECK(d.pools[0].info.geom.layer1 = 9, "layer range vs layout");
  CHECK(d.pools[0].info.geom.head0 = -1, "negative head");
  CHECK(d.pools[0].info.geom.elem_size = 3, "element size");
  CHECK(d.pools[0].info.n_blocks = 0, "no blocks");
  CHECK(d.pools[0].info.n_blocks = -5, "negative blocks");
  CHECK(d.pools[0].info.geom.layout.head_dim = 1 << 20, "huge head_dim");
  CHECK(d.pools[1].info.pool_id = 7, "duplicate pool id");
  CHECK(d.pools[0].rkey_len = 0, "direct pool without key");
  CHECK((d.pools[1].rkey = rkey_a, d.pools[1].rkey_len = 4), "staged pool with key");
  CHECK(d.staging = false, "staged pool without staging");
  CHECK(d.stg_slots = 0, "zero staging slots");
  CHECK(d.stg_slot_bytes = 16, "tiny staging slots");
  CHECK(d.addr_len = 0, "empty address");
  CHECK(d.pools[0].info.mem = (td_kvx_mem)5, "memory kind");
  CHECK(d.pools[0].info.geom.layout.block_size = -16, "negative slots");
  CHECK(d.pools[1].info.geom.layout.states = 127, "odd states width");
  CHECK(d.pools[1].info.geom.layout.states = -2, "negative states width");
  CHECK((d.pools[0].info.ipc = true, d.pools[0].ipc_handle = ipc_h), "IPC handle of a host pool");
  CHECK(d.ipc = false, "IPC handle without the context's device");
  CHECK(d.dev_id[0] = 0, "empty device identity");
  CHECK(d.dev_id[4] = ' ', "device identity with a space");
  CHECK(d.dev_id[2] = (char)0xc3, "device identity not ASCII");
  CHECK(d.pools[1].ipc_off = 1ull << 48, "pool past 2^48 in its allocation");
  CHECK(d.pools[1].ipc_off = UINT64_MAX - 100, "offset wrapping around");
#undef CHECK
  /* Flags and lengths forged in the bytes. */
  static const struct {
    size_t at;
    uint8_t v;
    const char *what;
  } forged[] = {{IPC_FLAG_AT, 2, "IPC flag 2"},
                {IPC_FLAG_AT + 1, 0, "device identity of 0 bytes"},
                {IPC_FLAG_AT + 1, KVX_DEV_ID_LEN + 1, "device identity too long"},
                {IPC_FLAG_AT + 1, 200, "device identity past the end"}};
  for (size_t i = 0; i < sizeof forged / sizeof forged[0]; i++) {
    d = sample();
    cr_assert_eq(kvx_desc_encode(&d, &b, &n), TD_OK);
    cr_assert_eq(b[IPC_FLAG_AT], 1);
    cr_assert_eq(b[IPC_FLAG_AT + 1], 13);
    b[forged[i].at] = forged[i].v;
    fix_crc(b, n);
    cr_assert_eq(kvx_desc_decode(b, n, &e), TD_ERR_FORMAT, "%s accepted", forged[i].what);
    free(b);
  }
  /* The GPU pool's IPC flag: the last pool ends with flag, offset, handle. */
  d = sample();
  cr_assert_eq(kvx_desc_encode(&d, &b, &n), TD_OK);
  size_t pf = n - 4 - KVX_IPC_HANDLE_LEN - 8 - 1;
  cr_assert_eq(b[pf], 1);
  b[pf] = 2;
  fix_crc(b, n);
  cr_assert_eq(kvx_desc_decode(b, n, &e), TD_ERR_FORMAT, "pool IPC flag 2 accepted");
  free(b);
  /* Lengths that point past the end. */
  d = sample();
  cr_assert_eq(kvx_desc_encode(&d, &b, &n), TD_OK);
  /* addr_len sits after magic(4) version(2) caps(4) uuid(8) host(8) pid(4) gpu(8). */
  b[38] = 0xff;
  b[39] = 0xff;
  fix_crc(b, n);
  cr_assert_eq(kvx_desc_decode(b, n, &e), TD_ERR_FORMAT);
  free(b);
}

/* Random mutations with a recomputed checksum: decode must fail or
 * succeed without reading out of bounds (AddressSanitizer watches). */
Test(kvx_desc, fuzz_with_valid_checksum) {
  kvx_desc d = sample(), e;
  uint8_t *b = NULL;
  size_t n = 0;
  cr_assert_eq(kvx_desc_encode(&d, &b, &n), TD_OK);
  uint8_t *t = malloc(n);
  uint64_t x = 88172645463325252ull;
  int accepted = 0;
  for (int it = 0; it < 20000; it++) {
    memcpy(t, b, n);
    int flips = 1 + it % 4;
    for (int f = 0; f < flips; f++) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      t[6 + x % (n - 10)] = (uint8_t)(x >> 32); /* keep magic and version */
    }
    size_t len = (it % 7 == 0) ? (size_t)(x % n) + 4 : n;
    if (len > n) len = n;
    fix_crc(t, len);
    if (kvx_desc_decode(t, len, &e) == TD_OK) accepted++;
  }
  free(t);
  free(b);
  cr_assert(accepted < 20000);
}

Test(kvx_desc, engine_export_and_bad_connect, .timeout = 60) {
  kt_rx rx = {0};
  td_kvx_opts o = kt_opts("desc", &rx);
  td_kvx *k = NULL;
  cr_assert_eq(td_kvx_create(&o, &k), TD_OK, "%s", td_errmsg());
  td_kvx_geom g = kt_geom(0, 2, 0, 4, 8, 4, 4);
  size_t bb = td_kvx_block_bytes(&g);
  void *mem = calloc(16, bb);
  td_kvx_pool_desc pd = {3, TD_KVX_MEM_HOST, mem, 16, g};
  cr_assert_eq(td_kvx_register_pool(k, &pd), TD_OK, "%s", td_errmsg());
  cr_assert_eq(td_kvx_register_pool(k, &pd), TD_ERR_INVALID);
  td_kvx_pool_desc gpu = {4, TD_KVX_MEM_CUDA, mem, 16, g};
  cr_assert_eq(td_kvx_register_pool(k, &gpu), TD_ERR_UNSUPPORTED);
  uint8_t *b = NULL;
  size_t n = 0;
  cr_assert_eq(td_kvx_export(k, &b, &n), TD_OK);
  td_kvx_desc_info info;
  cr_assert_eq(td_kvx_desc_parse(b, n, &info), TD_OK, "%s", td_errmsg());
  cr_assert_eq(info.uuid, td_kvx_uuid(k));
  cr_assert_eq(info.n_pools, 1);
  cr_assert_eq(info.pools[0].pool_id, 3);
  cr_assert(info.pools[0].direct);
  cr_assert_not(info.staging);
  /* Malformed bytes never connect. */
  td_kvx_peer *p = (td_kvx_peer *)0x1;
  cr_assert_eq(td_kvx_connect(k, b, n - 1, &p), TD_ERR_FORMAT);
  cr_assert_null(p);
  b[n / 2] ^= 0x40;
  cr_assert_eq(td_kvx_connect(k, b, n, &p), TD_ERR_FORMAT);
  cr_assert_null(p);
  uint8_t junk[300];
  kt_fill_random(junk, sizeof junk, 5);
  cr_assert_neq(td_kvx_connect(k, junk, sizeof junk, &p), TD_OK);
  cr_assert_eq(td_kvx_connect(k, NULL, 0, &p), TD_ERR_FORMAT);
  cr_assert_eq(td_kvx_get_stats(k).peers, 0);
  free(b);
  cr_assert_eq(td_kvx_unregister_pool(k, 3), TD_OK);
  cr_assert_eq(td_kvx_unregister_pool(k, 3), TD_ERR_NOT_FOUND);
  td_kvx_destroy(k);
  free(mem);
}
