/* libFuzzer target: what a worker reads of another worker's KV transfer
 * set-up. The first byte picks:
 *   0: a TransferDesc (protobuf, WorkerInfo.transfer_desc / KvTarget.desc),
 *      version-checked as worker/kv_route.c does, its kvx bytes parsed;
 *   1: a kvtransfer descriptor alone (kvx_desc_decode, td_kvx_desc_parse);
 *   2: the same with its checksum made right first: a CRC is no puzzle a
 *      fuzzer solves, and the fields behind it are what peers control;
 *   3: a ZeroMQ KV push header (KvPush) with the receiver's checks, or a
 *      KvAck as the pusher reads it;
 *   4: a transfer request's source geometry and block lists (as REQ carries
 *      them, the int8 flag included) planned into a fixed destination pool
 *      (an int8 one for int8 sources; td_kvx_plan_copies), as the receiver
 *      does before it grants.
 * Any bytes: a result or a refusal, never a crash or a leak. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/defaults.h"
#include "kvtransfer/wire.h"
#include "kernels/backend_impl.h"
#include "proto/wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* kernels/ops.c (the KV layout's checks) also creates backends, which this
 * target never does: their constructors are not linked in. */
td_status td_backend_cpu_create(const td_backend_opts *opts, td_backend **out) {
  (void)opts;
  (void)out;
  abort();
}
td_status td_backend_cuda_create(const td_backend_opts *opts, td_backend **out) {
  (void)opts;
  (void)out;
  abort();
}
bool td_backend_cuda_available(void) { return false; }

static void desc(const uint8_t *p, size_t n) {
  kvx_desc d;
  if (kvx_desc_decode(p, n, &d) == TD_OK) {
    /* what the decoder promises: pools within the limit, pointers inside the bytes */
    if (d.n_pools < 0 || d.n_pools > TD_KVX_MAX_POOLS) abort();
    if (d.addr < p || d.addr + d.addr_len > p + n) abort();
    for (int i = 0; i < d.n_pools; i++)
      if (td_kvx_block_bytes(&d.pools[i].info.geom) == 0) abort();
  }
  td_kvx_desc_info info;
  (void)td_kvx_desc_parse(p, n, &info);
}

static void plan(const uint8_t *p, size_t n) {
  kvx_rbuf r = {.p = p, .len = n};
  td_kvx_geom sg = {0};
  sg.elem_size = kvx_r_u16(&r);
  sg.layout.n_layers = kvx_r_i32(&r);
  sg.layout.n_heads = kvx_r_i32(&r);
  sg.layout.head_dim = kvx_r_i32(&r);
  sg.layout.block_size = kvx_r_i32(&r);
  sg.layout.states = kvx_r_i32(&r);
  sg.layout.int8 = kvx_r_u8(&r);
  sg.layer0 = kvx_r_i32(&r);
  sg.layer1 = kvx_r_i32(&r);
  sg.head0 = kvx_r_i32(&r);
  sg.head1 = kvx_r_i32(&r);
  uint32_t nb = kvx_r_u32(&r);
  if (r.bad || nb == 0 || nb > 64 || r.len - r.pos < (size_t)nb * 8) return;
  int32_t src[64], dst[64];
  for (uint32_t i = 0; i < nb; i++) src[i] = kvx_r_i32(&r);
  for (uint32_t i = 0; i < nb; i++) dst[i] = kvx_r_i32(&r);
  /* the receiver's pool, 64 blocks: 4 layers x 4 heads x 8 dims x 16 slots in float32, or (int8 sources)
   * 4 x 4 x 16 x 16 int8 K/V with a 64-wide states tail; the receiver has checked that dst blocks are in
   * the pool and src blocks >= 0 */
  td_kvx_geom dg = {.layout = {4, 4, 8, 16, 0, 0}, .elem_size = 4, .layer0 = 0, .layer1 = 4, .head0 = 0, .head1 = 4};
  if (sg.layout.int8) dg = (td_kvx_geom){{4, 4, 16, 16, 64, 1}, 2, 0, 4, 0, 4};
  for (uint32_t i = 0; i < nb; i++)
    if (dst[i] < 0 || dst[i] >= 64 || src[i] < 0) return;
  if (td_kvx_geom_check(&sg) != TD_OK) return;
  td_kvx_slice *items = NULL;
  int k = 0;
  if (td_kvx_plan_copies(&sg, &dg, src, dst, (int)nb, &items, &k) == TD_OK) {
    uint64_t pool = 64 * (uint64_t)td_kvx_block_bytes(&dg);
    for (int i = 0; i < k; i++)
      if (items[i].dst_off > pool || items[i].len > pool - items[i].dst_off) abort(); /* a write past the pool */
  }
  free(items);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  const uint8_t *p = data + 1;
  size_t n = size - 1;
  switch (data[0] % 5) {
    case 0: {
      Tandem__Cluster__TransferDesc *d = tandem__cluster__transfer_desc__unpack(NULL, n, p);
      if (!d) return 0;
      if (d->version == TD_PROTOCOL_VERSION && d->kvx.len) desc(d->kvx.data, d->kvx.len);
      tandem__cluster__transfer_desc__free_unpacked(d, NULL);
      break;
    }
    case 1: desc(p, n); break;
    case 2: {
      if (n < 4 || n > (1u << 20)) return 0;
      uint8_t *b = malloc(n);
      if (!b) return 0;
      memcpy(b, p, n);
      kvx_wbuf w = {0};
      kvx_w_u32(&w, kvx_crc32(b, n - 4)); /* the encoder's byte order */
      if (!w.oom) {
        memcpy(b + n - 4, w.p, 4);
        desc(b, n);
      }
      free(w.p);
      free(b);
      break;
    }
    case 3: {
      Tandem__Cluster__KvPush *h = tandem__cluster__kv_push__unpack(NULL, n, p);
      if (h) {
        bool ok = h->version == TD_PROTOCOL_VERSION && h->n_blocks <= TD_KV_PUSH_MAX_BLOCKS;
        if (ok && h->n_blocks && !h->blocks) abort();
        tandem__cluster__kv_push__free_unpacked(h, NULL);
      }
      Tandem__Cluster__KvAck *a = n <= TD_KV_ACK_MAX_BYTES ? tandem__cluster__kv_ack__unpack(NULL, n, p) : NULL;
      if (a) tandem__cluster__kv_ack__free_unpacked(a, NULL);
      break;
    }
    default: plan(p, n); break;
  }
  return 0;
}
