/* Attention on a warp a query row (cuda_attn.cuh): any head size up to
 * GEN_MAX_DH, any alignment, dense or paged. */
#include "kernels/cuda/cuda_attn.cuh"

/* One warp per (query row, head): any head size up to 256, any alignment. */
__global__ void __launch_bounds__(128) attn_generic_kernel(const AttnArgs a, int DH, bool paged) {
  td_pdl_start();
  __shared__ float qsh[4][GEN_MAX_DH];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, h = blockIdx.y, H = a.H;
  int rid = blockIdx.x * 4 + warp;
  int qi, qlen, kend, qpos;
  size_t row0;
  const int32_t *table = nullptr;
  if (!paged) {
    if (rid >= a.n_tokens || rid < a.q_lo || rid >= a.q_hi) return;
    int lo = 0, hi = a.n_seqs - 1;
    while (lo < hi) { /* last s with cu[s] <= rid */
      int mid = (lo + hi + 1) >> 1;
      if (a.cu[mid] <= rid) lo = mid;
      else hi = mid - 1;
    }
    row0 = (size_t)a.cu[lo];
    qlen = a.cu[lo + 1] - a.cu[lo];
    qi = rid - a.cu[lo];
    if (qi >= qlen) return;
    qpos = qi;
    kend = a.causal ? qi + 1 : qlen;
  } else {
    int s = rid / a.qtiles;
    qi = rid % a.qtiles;
    if (s >= a.n_seqs) return;
    int qs = a.q_start[s];
    qlen = min(a.q_start[s + 1], a.n_tokens) - qs;
    if (qs < 0 || qi >= qlen) return;
    row0 = (size_t)qs;
    int ctx = a.ctx_len[s];
    int nk = min(max(ctx, 0), a.max_blocks * a.bs);
    qpos = ctx - qlen + qi;
    kend = a.causal ? min(nk, qpos + 1) : nk;
    table = a.block_table + (size_t)s * a.max_blocks;
  }
  size_t qkv_row = (size_t)3 * H * DH;
  const bf16 *qp = paged ? a.q + (row0 + qi) * a.ldq + (size_t)h * DH : a.qkv + (row0 + qi) * qkv_row + (size_t)h * DH;
  for (int d = lane; d < DH; d += 32) qsh[warp][d] = __bfloat162float(qp[d]);
  __syncwarp();
  const float *L = a.lut ? a.lut + (size_t)h * (2 * a.md + 1) : nullptr;
  /* int8 K/V (paged): [K|V][head][slot] rows of DH bytes, then their float scales */
  const char *lay8 = (const char *)(a.pool + a.layer_off);
  const size_t bbytes = a.block_elems * sizeof(bf16), plane8 = (size_t)H * a.bs * DH;
  auto row8 = [&](int j, int kv, float &scale) {
    const char *bp = lay8 + (size_t)table[j / a.bs] * bbytes;
    const size_t row = ((size_t)kv * H + h) * a.bs + j % a.bs;
    scale = ((const float *)(bp + 2 * plane8))[row];
    return (const signed char *)bp + row * DH;
  };
  float m = -INFINITY, l = 0.0f, acc[GEN_MAX_DH / 32];
#pragma unroll
  for (int i = 0; i < GEN_MAX_DH / 32; i++) acc[i] = 0.0f;
  for (int c0 = 0; c0 < kend; c0 += 32) {
    int j = c0 + lane;
    float sc = -INFINITY;
    if (j < kend && paged && a.kv8) {
      float ks;
      const signed char *kp = row8(j, 0, ks);
      float dot = 0.0f;
      for (int d = 0; d < DH; d++) dot += qsh[warp][d] * (float)kp[d];
      sc = dot * ks * a.scale_log2;
      if (L) sc += lut_at(L, a.md, j - qpos) * LOG2E;
    } else if (j < kend) {
      const bf16 *kp = paged ? a.pool + (size_t)table[j / a.bs] * a.block_elems + a.layer_off +
                                   ((size_t)h * a.bs + j % a.bs) * DH
                             : a.qkv + (row0 + j) * qkv_row + (size_t)(H + h) * DH;
      float dot = 0.0f;
      for (int d = 0; d < DH; d++) dot += qsh[warp][d] * __bfloat162float(kp[d]);
      sc = dot * a.scale_log2;
      if (L) sc += lut_at(L, a.md, j - qpos) * LOG2E;
    }
    float cmax = sc;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, o));
    float nm = fmaxf(m, cmax), mu = nm == -INFINITY ? 0.0f : nm;
    float alpha = exp2f(m - mu), p = j < kend ? exp2f(sc - mu) : 0.0f, ps = p;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
    l = l * alpha + ps;
    m = nm;
#pragma unroll
    for (int i = 0; i < GEN_MAX_DH / 32; i++) acc[i] *= alpha;
    int cnt = min(32, kend - c0);
    for (int kk = 0; kk < cnt; kk++) {
      float pk = __shfl_sync(0xffffffffu, p, kk);
      int jj = c0 + kk;
      if (paged && a.kv8) {
        float vsc;
        const signed char *vp = row8(jj, 1, vsc);
        pk *= vsc;
#pragma unroll
        for (int i = 0; i < GEN_MAX_DH / 32; i++) {
          int d = lane + 32 * i;
          if (d < DH) acc[i] += pk * (float)vp[d];
        }
        continue;
      }
      const bf16 *vp = paged ? a.pool + (size_t)table[jj / a.bs] * a.block_elems + a.layer_off +
                                   ((size_t)(H + h) * a.bs + jj % a.bs) * DH
                             : a.qkv + (row0 + jj) * qkv_row + (size_t)(2 * H + h) * DH;
#pragma unroll
      for (int i = 0; i < GEN_MAX_DH / 32; i++) {
        int d = lane + 32 * i;
        if (d < DH) acc[i] += pk * __bfloat162float(vp[d]);
      }
    }
  }
  float inv = l > 0.0f ? 1.0f / l : 0.0f;
  bf16 *op = a.out + ((row0 + qi) * H + h) * DH;
#pragma unroll
  for (int i = 0; i < GEN_MAX_DH / 32; i++) {
    int d = lane + 32 * i;
    if (d < DH) op[d] = __float2bfloat16_rn(acc[i] * inv);
  }
}

void td_cu_attn_generic(const td_cuda *c, dim3 grid, const AttnArgs &a, int DH, bool paged) {
  (void)td_launch(c, attn_generic_kernel, grid, 128, 0, a, DH, paged);
}
