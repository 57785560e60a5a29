/* The paged KV pools' own ops: rows written to their slots (td_kv_write),
 * blocks copied (td_kv_copy_blocks), and the L2 prefetch hint
 * (td_kv_prefetch). The attention reads them (cuda_attn.cuh); a QKV
 * projection may write them itself (td_gemm_ex, td_kv_dest). */
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/cuda_ptx.cuh"

/* ------------------------------------------------------------ paged KV */

/* One block per row (and per layer: blockIdx.y, layer y's rows lcols
 * further along and its K/V lspan further into a block); K and V rows of
 * heads*head_dim go to their slots. */
template <bool VEC>
__global__ void kv_write_kernel(const bf16 *__restrict__ k, const bf16 *__restrict__ v, int ld, bf16 *pool,
                                size_t block_elems, size_t layer_off, int H, int dh, int bs,
                                const int32_t *__restrict__ slots, size_t lcols, size_t lspan) {
  td_pdl_start();
  int i = blockIdx.x;
  k += blockIdx.y * lcols;
  v += blockIdx.y * lcols;
  layer_off += blockIdx.y * lspan;
  int slot = slots[i];
  if (slot < 0) return;
  int blk = slot / bs, sl = slot % bs;
  size_t head_stride = (size_t)bs * dh;
  bf16 *kb = pool + (size_t)blk * block_elems + layer_off + (size_t)sl * dh;
  bf16 *vb = kb + (size_t)H * head_stride;
  const bf16 *kr = k + (size_t)i * ld, *vr = v + (size_t)i * ld;
  int per = VEC ? 8 : 1, cols = dh / per, total = H * cols;
  for (int e = threadIdx.x; e < total; e += blockDim.x) {
    int h = e / cols, cc = (e % cols) * per;
    size_t src = (size_t)h * dh + cc, dst = (size_t)h * head_stride + cc;
    if (VEC) {
      *(uint4 *)(kb + dst) = *(const uint4 *)(kr + src);
      *(uint4 *)(vb + dst) = *(const uint4 *)(vr + src);
    } else {
      kb[dst] = kr[src];
      vb[dst] = vr[src];
    }
  }
}

/* int8 K/V (td_kv_layout.int8): a warp a (row, head, K or V): the row's
 * largest magnitude sets its scale (/ 127), each value rounds to the
 * nearest int8 of it; dh a multiple of 16, up to 256 (8 values a lane). */
__global__ void __launch_bounds__(256) kv_write_int8_kernel(const bf16 *__restrict__ k, const bf16 *__restrict__ v,
                                                            int ld, char *pool, size_t block_bytes, size_t layer_off,
                                                            int H, int dh, int bs, const int32_t *__restrict__ slots) {
  td_pdl_start();
  const int i = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int slot = slots[i];
  if (slot < 0) return;
  const int blk = slot / bs, sl = slot % bs;
  char *base = pool + (size_t)blk * block_bytes + layer_off;
  float *scales = (float *)(base + (size_t)2 * H * bs * dh);
  for (int u = warp; u < 2 * H; u += blockDim.x >> 5) {
    const int plane = u / H, h = u % H;
    const bf16 *src = (plane ? v : k) + (size_t)i * ld + (size_t)h * dh;
    float x[8];
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; e++) {
      const int d = lane + 32 * e;
      x[e] = d < dh ? __bfloat162float(src[d]) : 0.0f;
      amax = fmaxf(amax, fabsf(x[e]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const size_t row = ((size_t)plane * H + h) * bs + sl;
    signed char *dst = (signed char *)base + row * dh;
#pragma unroll
    for (int e = 0; e < 8; e++) {
      const int d = lane + 32 * e;
      if (d < dh) dst[d] = (signed char)max(-127, min(127, __float2int_rn(x[e] * inv)));
    }
    if (lane == 0) scales[row] = amax / 127.0f;
  }
}

/* The same, 8 values a lane (16-byte loads, 8-byte stores): G lanes (dh / 8
 * rounded up to a power of two) a (head, K or V), 32 / G of them a warp at
 * once; the same scales and values. */
template <int G>
__global__ void __launch_bounds__(256) kv_write_int8_vec_kernel(const bf16 *__restrict__ k, const bf16 *__restrict__ v,
                                                                int ld, char *pool, size_t block_bytes,
                                                                size_t layer_off, int H, int dh, int bs,
                                                                const int32_t *__restrict__ slots) {
  td_pdl_start();
  const int i = blockIdx.x, sub = threadIdx.x % G, group = threadIdx.x / G, groups = blockDim.x / G;
  const int slot = slots[i];
  if (slot < 0) return;
  const int blk = slot / bs, sl = slot % bs;
  char *base = pool + (size_t)blk * block_bytes + layer_off;
  float *scales = (float *)(base + (size_t)2 * H * bs * dh);
  for (int u0 = 0; u0 < 2 * H; u0 += groups) { /* the same trips for every lane: the shuffles take them all */
    const int u = u0 + group, plane = u / H, h = u % H;
    const bool on = u < 2 * H && sub * 8 < dh;
    float x[8];
    float amax = 0.0f;
    if (on) {
      const uint4 raw = *(const uint4 *)((plane ? v : k) + (size_t)i * ld + (size_t)h * dh + sub * 8);
      const bf16 *p = (const bf16 *)&raw;
#pragma unroll
      for (int e = 0; e < 8; e++) {
        x[e] = __bfloat162float(p[e]);
        amax = fmaxf(amax, fabsf(x[e]));
      }
    }
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (on) {
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const size_t row = ((size_t)plane * H + h) * bs + sl;
      uint2 packed;
      signed char *q = (signed char *)&packed;
#pragma unroll
      for (int e = 0; e < 8; e++) q[e] = (signed char)max(-127, min(127, __float2int_rn(x[e] * inv)));
      *(uint2 *)(base + row * dh + sub * 8) = packed;
      if (sub == 0) scales[row] = amax / 127.0f;
    }
  }
}

/* ... and back to bf16 rows (td_kv_read) */
__global__ void __launch_bounds__(256) kv_read_int8_kernel(const char *pool, size_t block_bytes, size_t layer_off,
                                                           int H, int dh, int bs, const int32_t *__restrict__ slots,
                                                           bf16 *k, bf16 *v, int ld) {
  td_pdl_start();
  const int i = blockIdx.x;
  const int slot = slots[i];
  if (slot < 0) return;
  const int blk = slot / bs, sl = slot % bs;
  const char *base = pool + (size_t)blk * block_bytes + layer_off;
  const float *scales = (const float *)(base + (size_t)2 * H * bs * dh);
  for (int e = threadIdx.x; e < 2 * H * dh; e += blockDim.x) {
    const int plane = e / (H * dh), h = e / dh % H, d = e % dh;
    const size_t row = ((size_t)plane * H + h) * bs + sl;
    const float x = (float)((const signed char *)base)[row * dh + d] * scales[row];
    (plane ? v : k)[(size_t)i * ld + (size_t)h * dh + d] = __float2bfloat16_rn(x);
  }
}

/* kv_write_kernel over n rows of n_layers layers from the span sp (a layer's, lspan apart) */
static td_status bf16_write(td_cuda *c, const void *k, const void *v, int ld, size_t lcols, size_t lspan, void *pool,
                            const td_kv_layout *l, td_kv_span sp, int n_layers, const int32_t *slots, int n) {
  int H = sp.heads, dh = sp.dim;
  size_t be = td_kv_block_elems(l);
  bool vec = dh % 8 == 0 && ld % 8 == 0 && lcols % 8 == 0 && lspan % 8 == 0 && be % 8 == 0 && td_aligned16(k) &&
             td_aligned16(v) && td_aligned16(pool);
  int work = H * dh / (vec ? 8 : 1);
  int threads = work >= 256 ? 256 : (work + 31) / 32 * 32;
  dim3 grid((unsigned)n, (unsigned)n_layers);
  if (vec)
    (void)td_launch(c, kv_write_kernel<true>, grid, threads, 0, (const bf16 *)k, (const bf16 *)v, ld, (bf16 *)pool,
                    be, sp.off, H, dh, l->block_size, slots, lcols, lspan);
  else
    (void)td_launch(c, kv_write_kernel<false>, grid, threads, 0, (const bf16 *)k, (const bf16 *)v, ld, (bf16 *)pool,
                    be, sp.off, H, dh, l->block_size, slots, lcols, lspan);
  TD_CU_LAUNCHED("kv_write");
  return TD_OK;
}

td_status td_cu_kv_write(td_backend *b, const void *k, const void *v, int ld, void *pool, const td_kv_layout *l,
                         int layer, const int32_t *slots, int n) {
  td_cu_bind(td_cu(b));
  td_cuda *c = td_cu(b);
  td_kv_span sp = td_kv_layer_span(l, layer); /* a K/V layer or the states tail */
  if (l->int8 && layer < l->n_layers) {
    if (sp.dim > 256) return td_err(TD_ERR_UNSUPPORTED, "kv_write: int8 rows of %d values (at most 256)", sp.dim);
    size_t bb = td_kv_block_elems(l) * sizeof(bf16), lo = sp.off * sizeof(bf16);
    int g = 2;
    while (g * 8 < sp.dim) g *= 2;
    const bf16 *kb = (const bf16 *)k, *vb = (const bf16 *)v;
    char *pb = (char *)pool;
    int H = sp.heads, dh = sp.dim, bs = l->block_size;
    if (ld % 8 || !td_aligned16(k) || !td_aligned16(v) || !td_aligned16(pool))
      (void)td_launch(c, kv_write_int8_kernel, n, 256, 0, kb, vb, ld, pb, bb, lo, H, dh, bs, slots);
    else if (g == 2)
      (void)td_launch(c, kv_write_int8_vec_kernel<2>, n, 256, 0, kb, vb, ld, pb, bb, lo, H, dh, bs, slots);
    else if (g == 4)
      (void)td_launch(c, kv_write_int8_vec_kernel<4>, n, 256, 0, kb, vb, ld, pb, bb, lo, H, dh, bs, slots);
    else if (g == 8)
      (void)td_launch(c, kv_write_int8_vec_kernel<8>, n, 256, 0, kb, vb, ld, pb, bb, lo, H, dh, bs, slots);
    else if (g == 16)
      (void)td_launch(c, kv_write_int8_vec_kernel<16>, n, 256, 0, kb, vb, ld, pb, bb, lo, H, dh, bs, slots);
    else
      (void)td_launch(c, kv_write_int8_vec_kernel<32>, n, 256, 0, kb, vb, ld, pb, bb, lo, H, dh, bs, slots);
    TD_CU_LAUNCHED("kv_write");
    return TD_OK;
  }
  return bf16_write(c, k, v, ld, 0, 0, pool, l, sp, 1, slots, n);
}

/* td_kv_write_layers: bf16 layers in one launch, a grid row a layer (a
 * block's layers lie td_kv_layer_span(l, 1).off apart); int8 layers one at
 * a time */
td_status td_cu_kv_write_layers(td_backend *b, const void *k, const void *v, int ld, size_t lcols, void *pool,
                                const td_kv_layout *l, int layer0, int n_layers, const int32_t *slots, int n) {
  td_cu_bind(td_cu(b));
  td_cuda *c = td_cu(b);
  td_kv_span sp = td_kv_layer_span(l, layer0);
  size_t lspan = td_kv_layer_span(l, 1).off;
  if (l->int8 || n_layers > 65535) { /* 65535: a grid's rows */
    for (int j = 0; j < n_layers; j++)
      TD_TRY(td_cu_kv_write(b, (const bf16 *)k + j * lcols, (const bf16 *)v + j * lcols, ld, pool, l, layer0 + j,
                            slots, n));
    return TD_OK;
  }
  return bf16_write(c, k, v, ld, lcols, lspan, pool, l, sp, n_layers, slots, n);
}

/* kv_write_kernel's inverse: one block per row, the pool's slot into the row. */
template <bool VEC>
__global__ void kv_read_kernel(const bf16 *__restrict__ pool, size_t block_elems, size_t layer_off, int H, int dh,
                               int bs, const int32_t *__restrict__ slots, bf16 *k, bf16 *v, int ld) {
  td_pdl_start();
  int i = blockIdx.x;
  int slot = slots[i];
  if (slot < 0) return;
  int blk = slot / bs, sl = slot % bs;
  size_t head_stride = (size_t)bs * dh;
  const bf16 *kb = pool + (size_t)blk * block_elems + layer_off + (size_t)sl * dh;
  const bf16 *vb = kb + (size_t)H * head_stride;
  bf16 *kr = k + (size_t)i * ld, *vr = v + (size_t)i * ld;
  int per = VEC ? 8 : 1, cols = dh / per, total = H * cols;
  for (int e = threadIdx.x; e < total; e += blockDim.x) {
    int h = e / cols, cc = (e % cols) * per;
    size_t dst = (size_t)h * dh + cc, src = (size_t)h * head_stride + cc;
    if (VEC) {
      *(uint4 *)(kr + dst) = *(const uint4 *)(kb + src);
      *(uint4 *)(vr + dst) = *(const uint4 *)(vb + src);
    } else {
      kr[dst] = kb[src];
      vr[dst] = vb[src];
    }
  }
}

td_status td_cu_kv_read(td_backend *b, const void *pool, const td_kv_layout *l, int layer, const int32_t *slots,
                        int n, void *k, void *v, int ld) {
  td_cu_bind(td_cu(b));
  td_cuda *c = td_cu(b);
  td_kv_span sp = td_kv_layer_span(l, layer);
  if (l->int8 && layer < l->n_layers) {
    (void)td_launch(c, kv_read_int8_kernel, n, 256, 0, (const char *)pool, td_kv_block_elems(l) * sizeof(bf16),
                    sp.off * sizeof(bf16), sp.heads, sp.dim, l->block_size, slots, (bf16 *)k, (bf16 *)v, ld);
    TD_CU_LAUNCHED("kv_read");
    return TD_OK;
  }
  int H = sp.heads, dh = sp.dim;
  bool vec = dh % 8 == 0 && ld % 8 == 0 && td_kv_block_elems(l) % 8 == 0 && td_aligned16(k) && td_aligned16(v) &&
             td_aligned16(pool);
  int work = H * dh / (vec ? 8 : 1);
  int threads = work >= 256 ? 256 : (work + 31) / 32 * 32;
  size_t be = td_kv_block_elems(l);
  if (vec)
    (void)td_launch(c, kv_read_kernel<true>, n, threads, 0, (const bf16 *)pool, be, sp.off, H, dh, l->block_size,
                    slots, (bf16 *)k, (bf16 *)v, ld);
  else
    (void)td_launch(c, kv_read_kernel<false>, n, threads, 0, (const bf16 *)pool, be, sp.off, H, dh, l->block_size,
                    slots, (bf16 *)k, (bf16 *)v, ld);
  TD_CU_LAUNCHED("kv_read");
  return TD_OK;
}

td_status td_cu_kv_copy_blocks(td_backend *b, void *pool, const td_kv_layout *l, const int32_t *pairs,
                               int n_pairs) {
  td_cu_bind(td_cu(b));
  td_cuda *c = td_cu(b);
  size_t bytes = td_kv_block_elems(l) * sizeof(bf16);
  for (int i = 0; i < n_pairs; i++) {
    if (pairs[2 * i] < 0 || pairs[2 * i + 1] < 0)
      return td_err(TD_ERR_INVALID, "kv_copy_blocks: negative block id in pair %d", i);
    if (pairs[2 * i] == pairs[2 * i + 1]) continue;
    TD_CU_CHECK(cudaMemcpyAsync((char *)pool + (size_t)pairs[2 * i + 1] * bytes,
                                (const char *)pool + (size_t)pairs[2 * i] * bytes, bytes, cudaMemcpyDeviceToDevice,
                                c->stream),
                "kv_copy_blocks");
  }
  return TD_OK;
}

/* ------------------------------------------------------------ hints */

/* td_kv_prefetch: one bulk L2 prefetch per (sequence, paged block): the
 * layer's K and V rows of every head lie together in a block. A block's
 * prefetches drain through its SM's copy engine, so the few blocks (4)
 * bound the rate to what the latency-bound GEMMs beside it can spare;
 * spread over more blocks it slowed the QKV GEMM beside it. It pays from
 * 32 sequences (the tuning's kvpf_seqs) while the layer's K/V take at most
 * a quarter of L2 (td_cu_kvpf_bytes; docs/cuda.md, "The query norm and the
 * next layer's K/V"). */
__global__ void __launch_bounds__(128) kv_prefetch_kernel(const bf16 *pool, size_t block_elems, size_t layer_off,
                                                          uint32_t bytes, int bs, const int32_t *ctx_len,
                                                          const int32_t *table, int max_blocks, int n_seqs,
                                                          unsigned long long most) {
  /* the step's real lengths decide (a graph's bounds hold for any step):
   * nothing past the bound */
  if (most) {
    __shared__ unsigned long long used;
    if (threadIdx.x == 0) used = 0;
    __syncthreads();
    unsigned long long mine = 0;
    for (int s = threadIdx.x; s < n_seqs; s += blockDim.x) mine += (unsigned long long)((ctx_len[s] + bs - 1) / bs);
    atomicAdd(&used, mine);
    __syncthreads();
    if (used * bytes > most) return;
  }
  const long items = (long)n_seqs * max_blocks;
  for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < items; i += (long)gridDim.x * blockDim.x) {
    const int s = (int)(i / max_blocks), j = (int)(i % max_blocks);
    if ((long)j * bs >= ctx_len[s]) continue;
    const int32_t blk = table[i];
    if (blk >= 0) bulk_prefetch_l2(pool + (size_t)blk * block_elems + layer_off, bytes);
  }
}

td_status td_cu_kv_prefetch(td_backend *b, const void *pool, const td_kv_layout *l, int layer,
                            const td_paged_meta *m) {
  td_cuda *c = td_cu(b);
  td_cu_bind(c);
  /* only on a capture's branch (joined at its end): eagerly it would be a
   * node in the chain */
  if (c->tune.kvpf_seqs <= 0 || m->n_seqs < c->tune.kvpf_seqs || !td_cu_capturing(c)) return TD_OK;
  /* the layer's K and V (int8: with their scales) lie together in a block */
  size_t layer_off = td_kv_layer_span(l, layer).off;
  size_t bytes = (td_kv_layer_span(l, layer + 1).off - layer_off) * sizeof(bf16);
  /* bulk prefetches take 16-byte aligned addresses and sizes */
  if (!td_aligned16(pool) || bytes % 16 || bytes > 0xffffffffu || td_kv_block_elems(l) * sizeof(bf16) % 16 ||
      layer_off * sizeof(bf16) % 16)
    return TD_OK;
  /* past the bound at a block a sequence: no branch at all (even a kernel
   * that returns at once cost such steps 1-2 %) */
  const size_t most = td_cu_kvpf_bytes(&c->tune, c->l2_bytes);
  if (most && (size_t)m->n_seqs * bytes > most) return TD_OK;
  TD_CU_CHECK(cudaEventRecord(c->aux_fork, c->stream), "kv_prefetch");
  TD_CU_CHECK(cudaStreamWaitEvent(c->aux, c->aux_fork, 0), "kv_prefetch");
  long items = (long)m->n_seqs * m->max_blocks;
  unsigned grid = (unsigned)((items + 127) / 128 > 4 ? 4 : (items + 127) / 128);
  kv_prefetch_kernel<<<grid, 128, 0, c->aux>>>((const bf16 *)pool, td_kv_block_elems(l), layer_off, (uint32_t)bytes,
                                               l->block_size, m->ctx_len, m->block_table, m->max_blocks, m->n_seqs,
                                               (unsigned long long)most);
  TD_CU_LAUNCHED("kv_prefetch");
  c->aux_pending = true;
  return TD_OK;
}
