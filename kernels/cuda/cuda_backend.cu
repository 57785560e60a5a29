/* The CUDA backend: device memory, copies, graphs and the small bandwidth
 * kernels (norms, activations, embedding, gathers). GEMMs live in
 * cuda_gemm.cu and cuda_gemm_ex.cu, attention in cuda_attn_*.cu and
 * cuda_states*.cu, the paged pools' ops in cuda_kv.cu, sampling in
 * cuda_sample.cu, the tuning and launch policy in cuda_policy.c.
 * Activations are bf16 with float32 math; every launcher checks its shapes
 * and the launch, and never allocates or synchronises. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <uthash.h>

#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/cuda_ptx.cuh"

extern "C" {
#include "kernels/act.h"
}

/* ------------------------------------------------------------ helpers */


/* ------------------------------------------------------------ conversions */

__global__ void f32_to_bf16_kernel(const float *__restrict__ s, bf16 *__restrict__ d, size_t n) {
  td_pdl_start();
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    d[i] = __float2bfloat16_rn(s[i]);
}

__global__ void bf16_to_f32_kernel(const bf16 *__restrict__ s, float *__restrict__ d, size_t n) {
  td_pdl_start();
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    d[i] = __bfloat162float(s[i]);
}

/* ------------------------------------------------------------ memory */

/* What this backend holds, so that KV pools can be sized from what is left
 * of its share of the device (td_backend_memory_info). */
struct cu_block {
  void *p;
  size_t bytes;
  UT_hash_handle hh;
};

static td_status cu_alloc(td_backend *b, size_t bytes, void **out) {
  td_cuda *c = td_cu(b);
  td_cu_bind(c);
  struct cu_block *k = (struct cu_block *)calloc(1, sizeof *k);
  if (!k) return td_err(TD_ERR_NOMEM, "out of memory");
  cudaError_t e = cudaMalloc(out, bytes);
  if (e != cudaSuccess) {
    *out = NULL;
    free(k);
    (void)cudaGetLastError();
    return td_err(TD_ERR_NOMEM, "cuda: cannot allocate %zu bytes of device memory: %s", bytes,
                  cudaGetErrorString(e));
  }
  k->p = *out;
  k->bytes = bytes;
  HASH_ADD_PTR(c->blocks, p, k);
  c->allocated += bytes;
  return TD_OK;
}

static void cu_free(td_backend *b, void *p) {
  td_cuda *c = td_cu(b);
  td_cu_bind(c);
  struct cu_block *k = NULL;
  HASH_FIND_PTR(c->blocks, &p, k);
  td_cu_bias16_drop(c, p, k ? k->bytes : 1);
  if (k) {
    c->allocated -= k->bytes;
    HASH_DEL(c->blocks, k);
    free(k);
  }
  (void)cudaFree(p);
}

static td_status cu_memory(td_backend *b, td_backend_memory *out) {
  td_cuda *c = td_cu(b);
  td_cu_bind(c);
  size_t fr = 0, tot = 0;
  TD_CU_CHECK(cudaMemGetInfo(&fr, &tot), "memory info");
  *out = (td_backend_memory){.total = tot, .free = fr, .allocated = c->allocated};
  return TD_OK;
}

static td_status cu_host_alloc(td_backend *b, size_t bytes, void **out) {
  td_cu_bind(td_cu(b));
  cudaError_t e = cudaMallocHost(out, bytes);
  if (e != cudaSuccess) {
    *out = NULL;
    (void)cudaGetLastError();
    return td_err(TD_ERR_NOMEM, "cuda: cannot allocate %zu bytes of pinned host memory: %s", bytes,
                  cudaGetErrorString(e));
  }
  return TD_OK;
}

static void cu_host_free(td_backend *b, void *p) {
  td_cu_bind(td_cu(b));
  (void)cudaFreeHost(p);
}

static td_status cu_upload(td_backend *b, td_buf_type t, void *dst, const float *src, size_t n) {
  td_cu_bind(td_cu(b));
  td_cuda *c = td_cu(b);
  if (td_cu_capturing(c)) return td_err(TD_ERR_INVALID, "upload: synchronous copy during graph capture");
  if (t != TD_BUF_ACT) {
    TD_CU_CHECK(cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyHostToDevice, c->stream), "upload");
    TD_CU_CHECK(cudaStreamSynchronize(c->stream), "upload");
    return TD_OK;
  }
  /* float32 through device staging, converted on the GPU (round to nearest even, as td_f32_to_bf16) */
  size_t chunk = TD_CU_STAGE_BYTES / sizeof(float);
  for (size_t off = 0; off < n; off += chunk) {
    size_t cnt = n - off < chunk ? n - off : chunk;
    TD_CU_CHECK(cudaMemcpyAsync(c->stage, src + off, cnt * 4, cudaMemcpyHostToDevice, c->stream), "upload");
    (void)td_launch(c, f32_to_bf16_kernel, td_blocks(cnt, 256), 256, 0, c->stage, (bf16 *)dst + off, cnt);
    TD_CU_LAUNCHED("upload");
  }
  TD_CU_CHECK(cudaStreamSynchronize(c->stream), "upload");
  return TD_OK;
}

static td_status cu_download(td_backend *b, td_buf_type t, const void *src, float *dst, size_t n) {
  td_cu_bind(td_cu(b));
  td_cuda *c = td_cu(b);
  if (td_cu_capturing(c)) return td_err(TD_ERR_INVALID, "download: synchronous copy during graph capture");
  if (t != TD_BUF_ACT) {
    TD_CU_CHECK(cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyDeviceToHost, c->stream), "download");
    TD_CU_CHECK(cudaStreamSynchronize(c->stream), "download");
    return TD_OK;
  }
  size_t chunk = TD_CU_STAGE_BYTES / sizeof(float);
  for (size_t off = 0; off < n; off += chunk) {
    size_t cnt = n - off < chunk ? n - off : chunk;
    (void)td_launch(c, bf16_to_f32_kernel, td_blocks(cnt, 256), 256, 0, (const bf16 *)src + off, c->stage, cnt);
    TD_CU_LAUNCHED("download");
    TD_CU_CHECK(cudaMemcpyAsync(dst + off, c->stage, cnt * 4, cudaMemcpyDeviceToHost, c->stream), "download");
  }
  TD_CU_CHECK(cudaStreamSynchronize(c->stream), "download");
  return TD_OK;
}

static td_status cu_copy(td_backend *b, void *dst, const void *src, size_t bytes, int dir) {
  td_cu_bind(td_cu(b));
  static const cudaMemcpyKind kinds[3] = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice};
  if (dir < 0 || dir > 2) return td_err(TD_ERR_INVALID, "copy: bad direction %d", dir);
  TD_CU_CHECK(cudaMemcpyAsync(dst, src, bytes, kinds[dir], td_cu(b)->stream), "copy");
  return TD_OK;
}

static td_status cu_sync(td_backend *b) {
  td_cu_bind(td_cu(b));
  TD_CU_CHECK(cudaStreamSynchronize(td_cu(b)->stream), "sync");
  return TD_OK;
}

/* ------------------------------------------------------------ norms */

/* One block per row; each thread re-reads only the elements it owns, so
 * x == y is safe without shared staging. */
template <bool RMS, bool VEC>
__global__ void norm_kernel(const bf16 *x, const float *__restrict__ w, const float *__restrict__ bias, bf16 *y,
                            int n, float eps) {
  td_pdl_start();
  __shared__ float red[32];
  const bf16 *xr = x + (size_t)blockIdx.x * n;
  bf16 *yr = y + (size_t)blockIdx.x * n;
  float s = 0.0f;
  if (VEC) {
    for (int i = threadIdx.x * 8; i < n; i += blockDim.x * 8) {
      td_bf16x8 v;
      v.u = *(const uint4 *)(xr + i);
#pragma unroll
      for (int j = 0; j < 4; j++) {
        float2 f = __bfloat1622float2(v.h[j]);
        s += f.x + f.y;
      }
    }
  } else {
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += __bfloat162float(xr[i]);
  }
  float mean = RMS ? 0.0f : td_block_sum(s, red) / (float)n;
  float s2 = 0.0f;
  if (VEC) {
    for (int i = threadIdx.x * 8; i < n; i += blockDim.x * 8) {
      td_bf16x8 v;
      v.u = *(const uint4 *)(xr + i);
#pragma unroll
      for (int j = 0; j < 4; j++) {
        float2 f = __bfloat1622float2(v.h[j]);
        s2 += (f.x - mean) * (f.x - mean) + (f.y - mean) * (f.y - mean);
      }
    }
  } else {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      float d = __bfloat162float(xr[i]) - mean;
      s2 += d * d;
    }
  }
  float inv = rsqrtf(td_block_sum(s2, red) / (float)n + eps);
  if (VEC) {
    for (int i = threadIdx.x * 8; i < n; i += blockDim.x * 8) {
      td_bf16x8 v, o;
      v.u = *(const uint4 *)(xr + i);
#pragma unroll
      for (int j = 0; j < 4; j++) {
        float2 f = __bfloat1622float2(v.h[j]);
        float a = (f.x - mean) * inv, c = (f.y - mean) * inv;
        if (w) {
          a *= w[i + 2 * j];
          c *= w[i + 2 * j + 1];
        }
        if (!RMS && bias) {
          a += bias[i + 2 * j];
          c += bias[i + 2 * j + 1];
        }
        o.h[j] = __floats2bfloat162_rn(a, c);
      }
      *(uint4 *)(yr + i) = o.u;
    }
  } else {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      float v = (__bfloat162float(xr[i]) - mean) * inv * (w ? w[i] : 1.0f);
      if (!RMS && bias) v += bias[i];
      yr[i] = __float2bfloat16_rn(v);
    }
  }
}

/* A warp per row for the common widths (n = 256 * NV): the row stays in
 * registers, the sums are warp shuffles (no block barrier), and each lane
 * keeps NV 16-byte loads in flight. The block kernel above took ~7 us for
 * 1500 rows of 1280, a few memory latencies in a row. */
template <bool RMS, int NV>
__global__ void __launch_bounds__(128) norm_warp_kernel(const bf16 *x, const float *__restrict__ w,
                                                        const float *__restrict__ bias, bf16 *y, int m, int n,
                                                        float eps) {
  td_pdl_start();
  const int row = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= m) return;
  const bf16 *xr = x + (size_t)row * n;
  bf16 *yr = y + (size_t)row * n;
  float f[NV][8];
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < NV; k++) {
    td_bf16x8 v;
    v.u = *(const uint4 *)(xr + (k * 32 + lane) * 8);
#pragma unroll
    for (int j = 0; j < 4; j++) {
      float2 t = __bfloat1622float2(v.h[j]);
      f[k][2 * j] = t.x;
      f[k][2 * j + 1] = t.y;
      s += t.x + t.y;
    }
  }
  const float mean = RMS ? 0.0f : td_warp_sum(s) / (float)n;
  float s2 = 0.0f;
#pragma unroll
  for (int k = 0; k < NV; k++)
#pragma unroll
    for (int j = 0; j < 8; j++) s2 += (f[k][j] - mean) * (f[k][j] - mean);
  const float inv = rsqrtf(td_warp_sum(s2) / (float)n + eps);
#pragma unroll
  for (int k = 0; k < NV; k++) {
    const int i = (k * 32 + lane) * 8;
    float g[8], a[8];
#pragma unroll
    for (int j = 0; j < 8; j++) g[j] = 1.0f, a[j] = 0.0f;
    if (w) {
      *(float4 *)g = *(const float4 *)(w + i);
      *(float4 *)(g + 4) = *(const float4 *)(w + i + 4);
    }
    if (!RMS && bias) {
      *(float4 *)a = *(const float4 *)(bias + i);
      *(float4 *)(a + 4) = *(const float4 *)(bias + i + 4);
    }
    td_bf16x8 o;
#pragma unroll
    for (int j = 0; j < 4; j++)
      o.h[j] = __floats2bfloat162_rn((f[k][2 * j] - mean) * inv * g[2 * j] + a[2 * j],
                                     (f[k][2 * j + 1] - mean) * inv * g[2 * j + 1] + a[2 * j + 1]);
    *(uint4 *)(yr + i) = o.u;
  }
}

template <bool RMS>
static bool norm_warp_launch(td_cuda *c, const bf16 *x, const float *w, const float *bias, bf16 *y, int m, int n,
                             float eps) {
  const unsigned blocks = (unsigned)((m + 3) / 4);
  switch (n / 256) {
#define TD_NORM_WARP(NV) \
  case NV:               \
    (void)td_launch(c, norm_warp_kernel<RMS, NV>, blocks, 128, 0, x, w, bias, y, m, n, eps); \
    return true;
    TD_NORM_WARP(2)
    TD_NORM_WARP(3)
    TD_NORM_WARP(4)
    TD_NORM_WARP(5)
    TD_NORM_WARP(6)
    TD_NORM_WARP(8)
    TD_NORM_WARP(10)
    TD_NORM_WARP(12)
    TD_NORM_WARP(16)
#undef TD_NORM_WARP
    default:
      return false;
  }
}

static td_status cu_norm(td_backend *b, const void *x, const float *w, const float *bias, void *y, int m, int n,
                         float eps, bool rms) {
  td_cu_bind(td_cu(b));
  td_cuda *c = td_cu(b);
  bool vec = n % 8 == 0 && td_aligned16(x) && td_aligned16(y);
  if (vec && n % 256 == 0 && (!w || td_aligned16(w)) && (!bias || td_aligned16(bias)) &&
      (rms ? norm_warp_launch<true>(c, (const bf16 *)x, w, bias, (bf16 *)y, m, n, eps)
           : norm_warp_launch<false>(c, (const bf16 *)x, w, bias, (bf16 *)y, m, n, eps))) {
    TD_CU_LAUNCHED("norm");
    return TD_OK;
  }
  int per = vec ? 8 : 1;
  int threads = (n / per + 31) / 32 * 32;
  threads = threads < 32 ? 32 : threads > 1024 ? 1024 : threads;
  const bf16 *X = (const bf16 *)x;
  bf16 *Y = (bf16 *)y;
  if (rms) {
    if (vec) (void)td_launch(c, norm_kernel<true, true>, m, threads, 0, X, w, bias, Y, n, eps);
    else (void)td_launch(c, norm_kernel<true, false>, m, threads, 0, X, w, bias, Y, n, eps);
  } else {
    if (vec) (void)td_launch(c, norm_kernel<false, true>, m, threads, 0, X, w, bias, Y, n, eps);
    else (void)td_launch(c, norm_kernel<false, false>, m, threads, 0, X, w, bias, Y, n, eps);
  }
  TD_CU_LAUNCHED("norm");
  return TD_OK;
}

/* ------------------------------------------------------------ gated activation */

template <bool VEC>
__global__ void gated_kernel(const bf16 *__restrict__ x, bf16 *__restrict__ y, int m, int f, int act) {
  td_pdl_start();
  size_t per = VEC ? 8 : 1, cols = (size_t)f / per, total = (size_t)m * cols;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
    size_t r = i / cols, cidx = (i % cols) * per;
    const bf16 *a = x + r * 2 * f + cidx, *g = a + f;
    bf16 *o = y + r * f + cidx;
    if (VEC) {
      td_bf16x8 va, vg, vo;
      va.u = *(const uint4 *)a;
      vg.u = *(const uint4 *)g;
#pragma unroll
      for (int j = 0; j < 4; j++) {
        float2 fa = __bfloat1622float2(va.h[j]), fg = __bfloat1622float2(vg.h[j]);
        vo.h[j] = __floats2bfloat162_rn(td_act_apply(act, fa.x) * fg.x, td_act_apply(act, fa.y) * fg.y);
      }
      *(uint4 *)o = vo.u;
    } else {
      *o = __float2bfloat16_rn(td_act_apply(act, __bfloat162float(*a)) * __bfloat162float(*g));
    }
  }
}

static td_status cu_gated_act(td_backend *b, const void *x, void *y, int m, int f, td_act act) {
  td_cu_bind(td_cu(b));
  td_cuda *c = td_cu(b);
  bool vec = f % 8 == 0 && td_aligned16(x) && td_aligned16(y);
  size_t work = (size_t)m * f / (vec ? 8 : 1);
  if (vec) (void)td_launch(c, gated_kernel<true>, td_blocks(work, 256), 256, 0, (const bf16 *)x, (bf16 *)y, m, f, act);
  else (void)td_launch(c, gated_kernel<false>, td_blocks(work, 256), 256, 0, (const bf16 *)x, (bf16 *)y, m, f, act);
  TD_CU_LAUNCHED("gated_act");
  return TD_OK;
}

/* ------------------------------------------------------------ embedding and rows */

/* One block per output row. */
__global__ void embed_kernel(const int32_t *__restrict__ ids, const int32_t *__restrict__ positions,
                             const bf16 *__restrict__ tok, const bf16 *__restrict__ pos, float scale,
                             bf16 *__restrict__ y, int d, bool vec) {
  td_pdl_start();
  int i = blockIdx.x;
  const bf16 *t = tok + (size_t)ids[i] * d;
  const bf16 *p = pos ? pos + (size_t)positions[i] * d : NULL;
  bf16 *o = y + (size_t)i * d;
  if (vec) {
    for (int j = threadIdx.x * 8; j < d; j += blockDim.x * 8) {
      td_bf16x8 vt, vp, vo;
      vp.u = make_uint4(0, 0, 0, 0);
      vt.u = *(const uint4 *)(t + j);
      if (p) vp.u = *(const uint4 *)(p + j);
#pragma unroll
      for (int q = 0; q < 4; q++) {
        float2 a = __bfloat1622float2(vt.h[q]);
        a.x *= scale;
        a.y *= scale;
        if (p) {
          float2 bb = __bfloat1622float2(vp.h[q]);
          a.x += bb.x;
          a.y += bb.y;
        }
        vo.h[q] = __floats2bfloat162_rn(a.x, a.y);
      }
      *(uint4 *)(o + j) = vo.u;
    }
  } else {
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
      float v = __bfloat162float(t[j]) * scale;
      if (p) v += __bfloat162float(p[j]);
      o[j] = __float2bfloat16_rn(v);
    }
  }
}

static int row_threads(int d, bool vec) {
  int t = ((vec ? d / 8 : d) + 31) / 32 * 32;
  return t < 32 ? 32 : t > 256 ? 256 : t;
}

static td_status cu_embed(td_backend *b, const int32_t *ids, const int32_t *positions, const void *tok,
                          const void *pos, float scale, void *y, int n, int d) {
  td_cu_bind(td_cu(b));
  td_cuda *c = td_cu(b);
  bool vec = d % 8 == 0 && td_aligned16(tok) && td_aligned16(y) && (!pos || td_aligned16(pos));
  (void)td_launch(c, embed_kernel, n, row_threads(d, vec), 0, ids, positions, (const bf16 *)tok, (const bf16 *)pos,
                                                          scale, (bf16 *)y, d, vec);
  TD_CU_LAUNCHED("embed");
  return TD_OK;
}

__global__ void add_pos_kernel(bf16 *__restrict__ y, const bf16 *__restrict__ pos, int len, int d, bool vec) {
  td_pdl_start();
  int r = blockIdx.x, t = r % len;
  bf16 *o = y + (size_t)r * d;
  const bf16 *p = pos + (size_t)t * d;
  if (vec) {
    for (int j = threadIdx.x * 8; j < d; j += blockDim.x * 8) {
      td_bf16x8 vo, vp;
      vo.u = *(const uint4 *)(o + j);
      vp.u = *(const uint4 *)(p + j);
#pragma unroll
      for (int q = 0; q < 4; q++) {
        float2 a = __bfloat1622float2(vo.h[q]), bb = __bfloat1622float2(vp.h[q]);
        vo.h[q] = __floats2bfloat162_rn(a.x + bb.x, a.y + bb.y);
      }
      *(uint4 *)(o + j) = vo.u;
    }
  } else {
    for (int j = threadIdx.x; j < d; j += blockDim.x)
      o[j] = __float2bfloat16_rn(__bfloat162float(o[j]) + __bfloat162float(p[j]));
  }
}

static td_status cu_add_pos(td_backend *b, void *y, const void *pos, int n_seqs, int len, int d) {
  td_cu_bind(td_cu(b));
  td_cuda *c = td_cu(b);
  long rows = (long)n_seqs * len;
  if (rows > 2147483647L) return td_err(TD_ERR_INVALID, "add_pos: %ld rows", rows);
  bool vec = d % 8 == 0 && td_aligned16(y) && td_aligned16(pos);
  (void)td_launch(c, add_pos_kernel, (unsigned)rows, row_threads(d, vec), 0, (bf16 *)y, (const bf16 *)pos, len, d, vec);
  TD_CU_LAUNCHED("add_pos");
  return TD_OK;
}

__global__ void gather_kernel(const bf16 *__restrict__ x, const int32_t *__restrict__ rows, bf16 *__restrict__ y,
                              int d, bool vec) {
  td_pdl_start();
  int i = blockIdx.x;
  const bf16 *s = x + (size_t)rows[i] * d;
  bf16 *o = y + (size_t)i * d;
  if (vec) {
    for (int j = threadIdx.x * 8; j < d; j += blockDim.x * 8) *(uint4 *)(o + j) = *(const uint4 *)(s + j);
  } else {
    for (int j = threadIdx.x; j < d; j += blockDim.x) o[j] = s[j];
  }
}

static td_status cu_gather_rows(td_backend *b, const void *x, const int32_t *rows, void *y, int n, int d) {
  td_cu_bind(td_cu(b));
  td_cuda *c = td_cu(b);
  bool vec = d % 8 == 0 && td_aligned16(x) && td_aligned16(y);
  (void)td_launch(c, gather_kernel, n, row_threads(d, vec), 0, (const bf16 *)x, rows, (bf16 *)y, d, vec);
  TD_CU_LAUNCHED("gather_rows");
  return TD_OK;
}

__global__ void im2col_kernel(const bf16 *__restrict__ x, bf16 *__restrict__ y, int batch, int c, int t_in,
                              int k, int stride, int pad, int t_out, bool cf) {
  td_pdl_start();
  size_t total = (size_t)batch * t_out * c * k;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
    int j = (int)(i % k);
    size_t r = i / k;
    int ch = (int)(r % c);
    r /= c;
    int t = (int)(r % t_out);
    int s = (int)(r / t_out);
    int ti = t * stride + j - pad;
    bf16 v = __float2bfloat16_rn(0.0f);
    if (ti >= 0 && ti < t_in)
      v = cf ? x[((size_t)s * c + ch) * t_in + ti] : x[((size_t)s * t_in + ti) * c + ch];
    y[i] = v;
  }
}

/* Channels last, 8 channels a thread (c % 8 == 0, 16-byte aligned): the
 * k input rows' 16-byte vectors in, their 8 x k values interleaved as the
 * columns (channel, tap) want them, out in 16-byte stores. The scalar form
 * above took 635 us for 16 Whisper windows' second convolution (4 64-bit
 * divisions and a 2-byte store a value). */
template <int K>
__global__ void im2col_cl8_kernel(const bf16 *__restrict__ x, bf16 *__restrict__ y, int c, int t_in, int stride,
                                  int pad, int t_out, unsigned total) {
  td_pdl_start();
  const unsigned cv = (unsigned)c / 8;
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    unsigned q = i % cv, row = i / cv, t = row % (unsigned)t_out, s = row / (unsigned)t_out;
    union {
      uint4 u[K];
      bf16 h[8 * K];
    } o;
#pragma unroll
    for (int j = 0; j < K; j++) {
      int ti = (int)t * stride + j - pad;
      union {
        uint4 u;
        bf16 h[8];
      } v;
      v.u = make_uint4(0, 0, 0, 0);
      if (ti >= 0 && ti < t_in) v.u = *reinterpret_cast<const uint4 *>(x + ((size_t)s * t_in + ti) * c + q * 8);
#pragma unroll
      for (int e = 0; e < 8; e++) o.h[e * K + j] = v.h[e];
    }
    uint4 *dst = reinterpret_cast<uint4 *>(y + (size_t)row * c * K + (size_t)q * 8 * K);
#pragma unroll
    for (int j = 0; j < K; j++) dst[j] = o.u[j];
  }
}

static td_status cu_im2col1d(td_backend *b, const void *x, void *y, int batch, int c, int t_in, int k, int stride,
                             int pad, bool channels_first) {
  td_cu_bind(td_cu(b));
  td_cuda *cc = td_cu(b);
  int t_out = (t_in + 2 * pad - k) / stride + 1;
  size_t total = (size_t)batch * t_out * c * k;
  size_t vecs = (size_t)batch * t_out * (c / 8);
  if (!channels_first && k == 3 && c % 8 == 0 && td_aligned16(x) && td_aligned16(y) && vecs <= 0x7fffffffu) {
    (void)td_launch(cc, im2col_cl8_kernel<3>, td_blocks(vecs, 256), 256, 0, (const bf16 *)x, (bf16 *)y, c, t_in,
                    stride, pad, t_out, (unsigned)vecs);
    TD_CU_LAUNCHED("im2col1d");
    return TD_OK;
  }
  (void)td_launch(cc, im2col_kernel, td_blocks(total, 256), 256, 0, (const bf16 *)x, (bf16 *)y, batch, c, t_in, k,
                                                               stride, pad, t_out, channels_first);
  TD_CU_LAUNCHED("im2col1d");
  return TD_OK;
}

/* ------------------------------------------------------------ graphs */

struct td_graph {
  cudaGraphExec_t exec;
  int kernels; /* kernel nodes captured */
};

static td_status cu_graph_begin(td_backend *b) {
  td_cu_bind(td_cu(b));
  td_cuda *c = td_cu(b);
  if (td_cu_capturing(c)) return td_err(TD_ERR_INVALID, "graph_begin: a capture is already open");
  TD_CU_CHECK(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal), "graph_begin");
  return TD_OK;
}

static td_status cu_graph_end(td_backend *b, td_graph **out) {
  td_cu_bind(td_cu(b));
  td_cuda *c = td_cu(b);
  *out = NULL;
  cudaGraph_t g = NULL;
  /* the hint branch joins here, so that the graph holds it whole */
  if (c->aux_pending && cudaEventRecord(c->aux_join, c->aux) == cudaSuccess)
    (void)cudaStreamWaitEvent(c->stream, c->aux_join, 0);
  c->aux_pending = false;
  /* Always end the capture, so that a failed op inside it leaves the stream usable. */
  cudaError_t e = cudaStreamEndCapture(c->stream, &g);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    if (g) cudaGraphDestroy(g);
    return td_err(TD_ERR_CUDA, "graph_end: capture failed: %s", cudaGetErrorString(e));
  }
  td_graph *tg = (td_graph *)calloc(1, sizeof *tg);
  if (!tg) {
    cudaGraphDestroy(g);
    return td_err(TD_ERR_NOMEM, "graph_end: out of memory");
  }
  size_t nodes = 0;
  tg->kernels = -1;
  if (cudaGraphGetNodes(g, NULL, &nodes) == cudaSuccess) {
    cudaGraphNode_t *all = (cudaGraphNode_t *)calloc(nodes ? nodes : 1, sizeof *all);
    if (all && cudaGraphGetNodes(g, all, &nodes) == cudaSuccess) {
      tg->kernels = 0;
      for (size_t i = 0; i < nodes; i++) {
        cudaGraphNodeType t;
        if (cudaGraphNodeGetType(all[i], &t) == cudaSuccess && t == cudaGraphNodeTypeKernel) tg->kernels++;
      }
    }
    free(all);
  }
  (void)cudaGetLastError();
  e = cudaGraphInstantiate(&tg->exec, g, 0);
  cudaGraphDestroy(g);
  if (e != cudaSuccess) {
    free(tg);
    (void)cudaGetLastError();
    return td_err(TD_ERR_CUDA, "graph_end: instantiation failed: %s", cudaGetErrorString(e));
  }
  *out = tg;
  return TD_OK;
}

static td_status cu_graph_launch(td_backend *b, td_graph *g) {
  td_cu_bind(td_cu(b));
  TD_CU_CHECK(cudaGraphLaunch(g->exec, td_cu(b)->stream), "graph_launch");
  return TD_OK;
}

static int cu_graph_kernels(td_backend *b, const td_graph *g) {
  (void)b;
  return g->kernels;
}

static void cu_graph_destroy(td_backend *b, td_graph *g) {
  td_cu_bind(td_cu(b));
  if (!g) return;
  (void)cudaGraphExecDestroy(g->exec);
  free(g);
}

/* ------------------------------------------------------------ backend */

static void cu_destroy(td_backend *b) {
  if (!b) return;
  td_cuda *c = td_cu(b);
  if (c) {
    (void)cudaSetDevice(c->device);
    if (c->stream) (void)cudaStreamSynchronize(c->stream);
    td_cu_gemm_destroy(c);
    td_cu_heads_destroy(c);
    if (c->lt) cublasLtDestroy(c->lt);
    if (c->lt_ws) (void)cudaFree(c->lt_ws);
    if (c->stage) (void)cudaFree(c->stage);
    if (c->split) (void)cudaFree(c->split);
    if (c->part) (void)cudaFree(c->part);
    if (c->counters) (void)cudaFree(c->counters);
    struct cu_block *k, *kt;
    HASH_ITER(hh, c->blocks, k, kt) {
      HASH_DEL(c->blocks, k);
      free(k);
    }
    if (c->aux_join) (void)cudaEventDestroy(c->aux_join);
    if (c->aux_fork) (void)cudaEventDestroy(c->aux_fork);
    if (c->aux) (void)cudaStreamDestroy(c->aux);
    if (c->stream) (void)cudaStreamDestroy(c->stream);
    free(c);
  }
  free(b);
}

/* Rows split by columns across tensor-parallel ranks, put back together:
 * one strided copy per rank. */
static td_status cu_unshard_cols(td_backend *b, const float *parts, float *out, int tp, int rows, int per, int cols) {
  td_cu_bind(td_cu(b));
  for (int k = 0; k < tp; k++) {
    int c0 = k * per, n = cols - c0 < per ? cols - c0 : per;
    if (n <= 0) break;
    TD_CU_CHECK(cudaMemcpy2DAsync(out + c0, (size_t)cols * sizeof(float), parts + (size_t)k * rows * per,
                                  (size_t)per * sizeof(float), (size_t)n * sizeof(float), (size_t)rows,
                                  cudaMemcpyDeviceToDevice, td_cu(b)->stream),
                "unshard_cols");
  }
  return TD_OK;
}

/* td_backend_set_cuda_tuning: every launch reads c->tune */
static td_status cu_set_cuda_tuning(td_backend *b, const td_cuda_tuning *t) {
  td_cu_tune_resolve(t, &td_cu(b)->tune);
  return TD_OK;
}

/* Filled field by field: entries this file does not know stay NULL. */
static td_backend_vt cuda_vt;

static void vt_init(void) {
  td_backend_vt *v = &cuda_vt;
  v->destroy = cu_destroy;
  v->alloc = cu_alloc;
  v->free = cu_free;
  v->host_alloc = cu_host_alloc;
  v->host_free = cu_host_free;
  v->upload = cu_upload;
  v->download = cu_download;
  v->copy = cu_copy;
  v->sync = cu_sync;
  v->gemm = td_cu_gemm;
  v->norm = cu_norm;
  v->gated_act = cu_gated_act;
  v->embed = cu_embed;
  v->add_pos = cu_add_pos;
  v->gather_rows = cu_gather_rows;
  v->im2col1d = cu_im2col1d;
  v->attn_dense = td_cu_attn_dense;
  v->kv_write = td_cu_kv_write;
  v->kv_read = td_cu_kv_read;
  v->attn_paged = td_cu_attn_paged;
  v->attn_states = td_cu_attn_states;
  v->states_rows = td_cu_states_rows;
  v->states_takes = td_cu_states_takes;
  v->states_fast = td_cu_states_fast;
  v->gemm_heads = td_cu_gemm_heads;
  v->kv_copy_blocks = td_cu_kv_copy_blocks;
  v->kv_prefetch = td_cu_kv_prefetch;
  v->kv_write_layers = td_cu_kv_write_layers;
  v->sample = td_cu_sample;
  v->topk_logprobs = td_cu_topk_logprobs;
  v->graph_begin = cu_graph_begin;
  v->graph_end = cu_graph_end;
  v->graph_launch = cu_graph_launch;
  v->graph_destroy = cu_graph_destroy;
  v->graph_kernels = cu_graph_kernels;
  v->unshard_cols = cu_unshard_cols;
  v->gemm_ex = td_cu_gemm_ex;
  v->fused_norm_rows = td_cu_fused_norm_rows;
  v->gemm_plan_rows = td_cu_gemm_plan_rows;
  v->gemm_plans_made = td_cu_gemm_plans_made;
  v->set_cuda_tuning = cu_set_cuda_tuning;
  v->memory = cu_memory;
}

static td_status create(const td_backend_opts *opts, td_backend *b, td_cuda *c) {
  int n = 0;
  TD_CU_CHECK(cudaGetDeviceCount(&n), "cuda backend");
  if (opts->device < 0 || opts->device >= n)
    return td_err(TD_ERR_INVALID, "cuda backend: device %d does not exist (%d visible)", opts->device, n);
  c->device = opts->device;
  TD_CU_CHECK(cudaSetDevice(c->device), "cuda backend");
  cudaDeviceProp p;
  TD_CU_CHECK(cudaGetDeviceProperties(&p, c->device), "cuda backend");
  c->sm_count = p.multiProcessorCount;
  c->l2_bytes = p.l2CacheSize > 0 ? (size_t)p.l2CacheSize : 0;
  c->cc_major = p.major;
  c->cc_minor = p.minor;
  c->smem_optin = p.sharedMemPerBlockOptin;
  td_cu_tune_resolve(&opts->cuda, &c->tune);
  snprintf(b->name, sizeof b->name, "cuda:%d (%.120s)", c->device, p.name);
  if (p.major != 9)
    return td_err(TD_ERR_UNSUPPORTED, "cuda backend: %s has compute capability %d.%d; this build holds sm_90a code only",
                  p.name, p.major, p.minor);
  TD_CU_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), "cuda backend");
  TD_CU_CHECK(cudaStreamCreateWithFlags(&c->aux, cudaStreamNonBlocking), "cuda backend");
  TD_CU_CHECK(cudaEventCreateWithFlags(&c->aux_fork, cudaEventDisableTiming), "cuda backend");
  TD_CU_CHECK(cudaEventCreateWithFlags(&c->aux_join, cudaEventDisableTiming), "cuda backend");
  if (cublasLtCreate(&c->lt) != CUBLAS_STATUS_SUCCESS) {
    c->lt = NULL;
    return td_err(TD_ERR_CUDA, "cuda backend: cublasLtCreate failed");
  }
  TD_TRY(cu_alloc(b, TD_CU_LT_WORKSPACE, &c->lt_ws));
  TD_TRY(cu_alloc(b, TD_CU_STAGE_BYTES, (void **)&c->stage));
  TD_TRY(cu_alloc(b, TD_CU_SPLIT_BYTES, (void **)&c->split));
  TD_TRY(cu_alloc(b, TD_CU_PART_BYTES, (void **)&c->part));
  size_t nc = (size_t)(TD_CU_GEMM_COUNTERS + TD_CU_ATTN_COUNTERS) * sizeof(int);
  TD_TRY(cu_alloc(b, nc, (void **)&c->counters));
  TD_CU_CHECK(cudaMemsetAsync(c->counters, 0, nc, c->stream), "cuda backend");
  TD_CU_CHECK(cudaStreamSynchronize(c->stream), "cuda backend");
  TD_TRY(td_cu_gemm_init(c));
  TD_TRY(td_cu_attn_dense_init(c));
  TD_TRY(td_cu_attn_paged_init(c));
  TD_TRY(td_cu_heads_init(c));
  TD_TRY(td_cu_states_init(c));
  TD_TRY(td_cu_sample_init(c));
  return TD_OK;
}

extern "C" bool td_backend_cuda_available(void) { return true; }

extern "C" td_status td_backend_cuda_create(const td_backend_opts *opts, td_backend **out) {
  *out = NULL;
  td_backend *b = (td_backend *)calloc(1, sizeof *b);
  td_cuda *c = (td_cuda *)calloc(1, sizeof *c);
  if (!b || !c) {
    free(b);
    free(c);
    return td_err(TD_ERR_NOMEM, "cuda backend: out of memory");
  }
  if (!cuda_vt.destroy) vt_init(); /* idempotent: same values on every call */
  b->vt = &cuda_vt;
  b->kind = TD_BACKEND_CUDA;
  b->act_size = sizeof(bf16);
  b->impl = c;
  td_status s = create(opts, b, c);
  if (s != TD_OK) {
    cu_destroy(b);
    return s;
  }
  *out = b;
  return TD_OK;
}
