#include "kvtransfer/wire.h"

#include <stdlib.h>
#include <string.h>

void kvx_w_bytes(kvx_wbuf *w, const void *b, size_t n) {
  if (w->oom || n == 0) return;
  if (w->len + n > w->cap) {
    size_t cap = w->cap ? w->cap : 256;
    while (cap < w->len + n) cap *= 2;
    uint8_t *p = realloc(w->p, cap);
    if (!p) {
      w->oom = true;
      return;
    }
    w->p = p;
    w->cap = cap;
  }
  memcpy(w->p + w->len, b, n);
  w->len += n;
}

void kvx_w_u8(kvx_wbuf *w, uint8_t v) { kvx_w_bytes(w, &v, 1); }
void kvx_w_u16(kvx_wbuf *w, uint16_t v) {
  uint8_t b[2] = {(uint8_t)v, (uint8_t)(v >> 8)};
  kvx_w_bytes(w, b, 2);
}
void kvx_w_u32(kvx_wbuf *w, uint32_t v) {
  uint8_t b[4];
  for (int i = 0; i < 4; i++) b[i] = (uint8_t)(v >> (8 * i));
  kvx_w_bytes(w, b, 4);
}
void kvx_w_u64(kvx_wbuf *w, uint64_t v) {
  uint8_t b[8];
  for (int i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (8 * i));
  kvx_w_bytes(w, b, 8);
}
void kvx_w_i32(kvx_wbuf *w, int32_t v) { kvx_w_u32(w, (uint32_t)v); }

void kvx_w_i32s(kvx_wbuf *w, const int32_t *v, size_t n) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  if (n <= SIZE_MAX / 4) {
    kvx_w_bytes(w, v, n * 4); /* the wire's order already */
    return;
  }
#endif
  for (size_t i = 0; i < n; i++) kvx_w_i32(w, v[i]);
}

const uint8_t *kvx_r_bytes(kvx_rbuf *r, size_t n) {
  if (r->bad || n > r->len - r->pos) {
    r->bad = true;
    return NULL;
  }
  const uint8_t *p = r->p + r->pos;
  r->pos += n;
  return p;
}
uint8_t kvx_r_u8(kvx_rbuf *r) {
  const uint8_t *p = kvx_r_bytes(r, 1);
  return p ? p[0] : 0;
}
uint16_t kvx_r_u16(kvx_rbuf *r) {
  const uint8_t *p = kvx_r_bytes(r, 2);
  return p ? (uint16_t)(p[0] | (p[1] << 8)) : 0;
}
uint32_t kvx_r_u32(kvx_rbuf *r) {
  const uint8_t *p = kvx_r_bytes(r, 4);
  if (!p) return 0;
  uint32_t v = 0;
  for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}
uint64_t kvx_r_u64(kvx_rbuf *r) {
  const uint8_t *p = kvx_r_bytes(r, 8);
  if (!p) return 0;
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}
int32_t kvx_r_i32(kvx_rbuf *r) { return (int32_t)kvx_r_u32(r); }

bool kvx_r_i32s(kvx_rbuf *r, int32_t *out, size_t n) {
  const uint8_t *p = n <= SIZE_MAX / 4 ? kvx_r_bytes(r, n * 4) : NULL;
  if (!p) {
    r->bad = true;
    return false;
  }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  memcpy(out, p, n * 4);
#else
  for (size_t i = 0; i < n; i++, p += 4)
    out[i] = (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
#endif
  return true;
}

uint32_t kvx_crc32(const void *data, size_t n) {
  static uint32_t table[256];
  static int init;
  if (!init) {
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      table[i] = c;
    }
    init = 1;
  }
  const uint8_t *p = data;
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; i++) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

/* Layout: magic u32, version u16, caps u32, uuid u64, host_id u64, pid u32,
 * gpu_id u64, addr (u32 len + bytes), staging u8 [base u64, slot_bytes u64, slots u32,
 * rkey], [version 3: ipc u8 [device id: u8 len + bytes]], n_pools u32, pools
 * (each: geometry [version 4: int8 u8], base, rkey [version 3: ipc u8 [offset
 * u64, handle]]), crc32 u32 of everything before it. */
td_status kvx_desc_encode(const kvx_desc *d, uint8_t **out, size_t *len) {
  *out = NULL;
  *len = 0;
  uint16_t version = d->version ? d->version : TD_KVX_DESC_VERSION;
  if (version < 2 || version > TD_KVX_DESC_VERSION)
    return td_err(TD_ERR_VERSION, "KV transfer descriptor: cannot write version %u", (unsigned)version);
  for (int i = 0; version < 4 && i < d->n_pools; i++)
    if (d->pools[i].info.geom.layout.int8)
      return td_err(TD_ERR_VERSION, "KV transfer descriptor: version %u has no int8 layouts", (unsigned)version);
  bool v3 = version >= 3, v4 = version >= 4;
  kvx_wbuf w = {0};
  kvx_w_u32(&w, KVX_DESC_MAGIC);
  kvx_w_u16(&w, version);
  kvx_w_u32(&w, d->caps);
  kvx_w_u64(&w, d->uuid);
  kvx_w_u64(&w, d->host_id);
  kvx_w_u32(&w, d->pid);
  kvx_w_u64(&w, d->gpu_id);
  kvx_w_u32(&w, d->addr_len);
  kvx_w_bytes(&w, d->addr, d->addr_len);
  kvx_w_u8(&w, d->staging ? 1 : 0);
  if (d->staging) {
    kvx_w_u64(&w, d->stg_base);
    kvx_w_u64(&w, d->stg_slot_bytes);
    kvx_w_u32(&w, d->stg_slots);
    kvx_w_u32(&w, d->stg_rkey_len);
    kvx_w_bytes(&w, d->stg_rkey, d->stg_rkey_len);
  }
  if (v3) {
    kvx_w_u8(&w, d->ipc ? 1 : 0);
    if (d->ipc) {
      size_t n = strnlen(d->dev_id, KVX_DEV_ID_LEN);
      kvx_w_u8(&w, (uint8_t)n);
      kvx_w_bytes(&w, d->dev_id, n);
    }
  }
  kvx_w_u32(&w, (uint32_t)d->n_pools);
  for (int i = 0; i < d->n_pools; i++) {
    const kvx_desc_pool *p = &d->pools[i];
    const td_kvx_geom *g = &p->info.geom;
    kvx_w_u32(&w, p->info.pool_id);
    kvx_w_u8(&w, (uint8_t)p->info.mem);
    kvx_w_u8(&w, p->info.direct ? 1 : 0);
    kvx_w_u16(&w, (uint16_t)g->elem_size);
    kvx_w_i32(&w, p->info.n_blocks);
    kvx_w_i32(&w, g->layout.n_layers);
    kvx_w_i32(&w, g->layout.n_heads);
    kvx_w_i32(&w, g->layout.head_dim);
    kvx_w_i32(&w, g->layout.block_size);
    kvx_w_i32(&w, g->layout.states);
    kvx_w_i32(&w, g->layer0);
    kvx_w_i32(&w, g->layer1);
    kvx_w_i32(&w, g->head0);
    kvx_w_i32(&w, g->head1);
    if (v4) kvx_w_u8(&w, (uint8_t)g->layout.int8);
    kvx_w_u64(&w, p->base);
    kvx_w_u32(&w, p->rkey_len);
    kvx_w_bytes(&w, p->rkey, p->rkey_len);
    if (v3) {
      kvx_w_u8(&w, p->info.ipc ? 1 : 0);
      if (p->info.ipc) {
        kvx_w_u64(&w, p->ipc_off);
        kvx_w_bytes(&w, p->ipc_handle, KVX_IPC_HANDLE_LEN);
      }
    }
  }
  if (!w.oom) kvx_w_u32(&w, kvx_crc32(w.p, w.len));
  if (w.oom) {
    free(w.p);
    return td_err(TD_ERR_NOMEM, "out of memory");
  }
  *out = w.p;
  *len = w.len;
  return TD_OK;
}

#define BAD(...) td_err(TD_ERR_FORMAT, "KV transfer descriptor: " __VA_ARGS__)

td_status kvx_desc_decode(const void *bytes, size_t len, kvx_desc *d) {
  memset(d, 0, sizeof *d);
  if (!bytes || len < 4 + 2 + 4) return BAD("%zu bytes is too short", len);
  kvx_rbuf r = {.p = bytes, .len = len};
  if (kvx_r_u32(&r) != KVX_DESC_MAGIC) return BAD("bad magic (not a descriptor)");
  d->version = kvx_r_u16(&r);
  if (d->version < 2 || d->version > TD_KVX_DESC_VERSION)
    return td_err(TD_ERR_VERSION, "KV transfer descriptor: version %u, this build reads versions 2 to %u",
                  (unsigned)d->version, (unsigned)TD_KVX_DESC_VERSION);
  bool v3 = d->version >= 3, v4 = d->version >= 4;
  /* The checksum catches truncation and corruption before any field is trusted. */
  uint32_t crc = kvx_crc32(bytes, len - 4);
  kvx_rbuf tail = {.p = (const uint8_t *)bytes + len - 4, .len = 4};
  if (kvx_r_u32(&tail) != crc) return BAD("checksum mismatch (truncated or corrupted)");
  r.len = len - 4;
  d->caps = kvx_r_u32(&r);
  d->uuid = kvx_r_u64(&r);
  d->host_id = kvx_r_u64(&r);
  d->pid = kvx_r_u32(&r);
  d->gpu_id = kvx_r_u64(&r);
  d->addr_len = kvx_r_u32(&r);
  if (r.bad || d->addr_len == 0 || d->addr_len > KVX_MAX_ADDR) return BAD("transport address of %u bytes", d->addr_len);
  d->addr = kvx_r_bytes(&r, d->addr_len);
  uint8_t stg = kvx_r_u8(&r);
  if (stg > 1) return BAD("staging flag %u", stg);
  d->staging = stg;
  if (d->staging) {
    d->stg_base = kvx_r_u64(&r);
    d->stg_slot_bytes = kvx_r_u64(&r);
    d->stg_slots = kvx_r_u32(&r);
    d->stg_rkey_len = kvx_r_u32(&r);
    if (r.bad || d->stg_slots == 0 || d->stg_slots > 1024 || d->stg_slot_bytes < 4096 ||
        d->stg_slot_bytes > (1ull << 32) || d->stg_rkey_len == 0 || d->stg_rkey_len > KVX_MAX_RKEY)
      return BAD("staging area of %u slots of %llu bytes, key of %u bytes", d->stg_slots,
                 (unsigned long long)d->stg_slot_bytes, d->stg_rkey_len);
    d->stg_rkey = kvx_r_bytes(&r, d->stg_rkey_len);
  }
  uint8_t ipc = v3 ? kvx_r_u8(&r) : 0;
  if (ipc > 1) return BAD("IPC flag %u", ipc);
  d->ipc = ipc;
  if (d->ipc) {
    uint8_t n = kvx_r_u8(&r);
    const uint8_t *id = n > 0 && n <= KVX_DEV_ID_LEN ? kvx_r_bytes(&r, n) : NULL;
    if (!id) return BAD("device identity of %u bytes", n);
    for (uint8_t i = 0; i < n; i++)
      if (id[i] < 0x21 || id[i] > 0x7e) return BAD("device identity with byte 0x%02x", id[i]);
    memcpy(d->dev_id, id, n);
    d->dev_id[n] = 0;
  }
  uint32_t np = kvx_r_u32(&r);
  if (r.bad || np > TD_KVX_MAX_POOLS) return BAD("%u pools (at most %d)", np, TD_KVX_MAX_POOLS);
  d->n_pools = (int)np;
  for (int i = 0; i < d->n_pools; i++) {
    kvx_desc_pool *p = &d->pools[i];
    td_kvx_geom *g = &p->info.geom;
    p->info.pool_id = kvx_r_u32(&r);
    uint8_t mem = kvx_r_u8(&r), direct = kvx_r_u8(&r);
    g->elem_size = kvx_r_u16(&r);
    p->info.n_blocks = kvx_r_i32(&r);
    g->layout.n_layers = kvx_r_i32(&r);
    g->layout.n_heads = kvx_r_i32(&r);
    g->layout.head_dim = kvx_r_i32(&r);
    g->layout.block_size = kvx_r_i32(&r);
    g->layout.states = kvx_r_i32(&r);
    g->layer0 = kvx_r_i32(&r);
    g->layer1 = kvx_r_i32(&r);
    g->head0 = kvx_r_i32(&r);
    g->head1 = kvx_r_i32(&r);
    g->layout.int8 = v4 ? kvx_r_u8(&r) : 0; /* td_kvx_geom_check takes 0 or 1 */
    p->base = kvx_r_u64(&r);
    p->rkey_len = kvx_r_u32(&r);
    if (r.bad) return BAD("pool %d truncated", i);
    if (mem > TD_KVX_MEM_CUDA || direct > 1) return BAD("pool %u: memory kind %u, direct flag %u", p->info.pool_id, mem, direct);
    p->info.mem = (td_kvx_mem)mem;
    p->info.direct = direct;
    if (td_kvx_geom_check(g) != TD_OK) return BAD("pool %u: %s", p->info.pool_id, td_errmsg());
    uint64_t bb = td_kvx_block_bytes(g);
    if (p->info.n_blocks <= 0 || bb * (uint64_t)p->info.n_blocks > (1ull << 48))
      return BAD("pool %u: %d blocks of %llu bytes", p->info.pool_id, p->info.n_blocks, (unsigned long long)bb);
    if (p->rkey_len > KVX_MAX_RKEY || (direct && p->rkey_len == 0) || (!direct && p->rkey_len != 0))
      return BAD("pool %u: memory key of %u bytes", p->info.pool_id, p->rkey_len);
    if (!direct && !d->staging) return BAD("pool %u is staged but the peer has no staging area", p->info.pool_id);
    p->rkey = p->rkey_len ? kvx_r_bytes(&r, p->rkey_len) : NULL;
    uint8_t pipc = v3 ? kvx_r_u8(&r) : 0;
    if (pipc > 1 || (pipc && (!d->ipc || mem != TD_KVX_MEM_CUDA)))
      return BAD("pool %u: IPC flag %u (%s memory, context IPC %d)", p->info.pool_id, pipc,
                 mem == TD_KVX_MEM_CUDA ? "GPU" : "host", d->ipc);
    p->info.ipc = pipc;
    if (pipc) {
      p->ipc_off = kvx_r_u64(&r);
      p->ipc_handle = kvx_r_bytes(&r, KVX_IPC_HANDLE_LEN);
      if (r.bad) return BAD("pool %u truncated", i);
      if (p->ipc_off > (1ull << 48) - bb * (uint64_t)p->info.n_blocks)
        return BAD("pool %u at offset %llu of its allocation", p->info.pool_id, (unsigned long long)p->ipc_off);
    }
    for (int j = 0; j < i; j++)
      if (d->pools[j].info.pool_id == p->info.pool_id) return BAD("pool id %u appears twice", p->info.pool_id);
  }
  if (r.bad) return BAD("truncated");
  if (r.pos != r.len) return BAD("%zu trailing bytes", r.len - r.pos);
  return TD_OK;
}

td_status td_kvx_desc_parse(const void *bytes, size_t len, td_kvx_desc_info *out) {
  memset(out, 0, sizeof *out);
  kvx_desc d;
  TD_TRY(kvx_desc_decode(bytes, len, &d));
  out->version = d.version;
  out->uuid = d.uuid;
  out->staging = d.staging;
  out->nccl = (d.caps & KVX_CAP_NCCL) != 0;
  out->ipc = d.ipc;
  out->n_pools = d.n_pools;
  for (int i = 0; i < d.n_pools; i++) out->pools[i] = d.pools[i].info;
  return TD_OK;
}
