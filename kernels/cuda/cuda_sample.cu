/* Sampling on the GPU, one 1024-thread block per row, with the semantics of
 * cpu_sample.c: candidates ordered by (value desc, id asc); top-k keeps the
 * first k; top-p the shortest prefix whose probability reaches top_p; the
 * draw takes the first candidate whose running sum exceeds u * total, u from
 * td_rand_uniform(seed, stream, step).
 *
 * Nothing is sorted in full. The k-th candidate, or the one where a running
 * sum crosses a threshold, is found by a 4-pass radix descent over the
 * 32-bit order key (8 bits a pass) with per-digit histograms of counts or of
 * weights exp(v) in 2^-36 fixed point: integer sums do not depend on the
 * order of the atomics, so every run picks the same token. Ties on the key
 * are resolved in id order by a block scan. The usual case (top-k <= 1024,
 * or a nucleus / draw inside the first 1024 candidates) sorts those 1024 in
 * shared memory and scans them instead. */
#include <math.h>
#include <stdint.h>

#include "kernels/cuda/cuda_internal.h"

extern "C" {
#include "common/rng.h"
}

enum { SB = 1024, NWARP = SB / 32 };
#define FIX_ONE 68719476736.0f /* 2^36: weights exp(v) <= 1 in fixed point */

struct Bound {
  uint32_t key;
  int id;
};

struct Shared {
  unsigned long long hist[256];
  unsigned long long arr[SB];  /* composite keys (key << 32 | ~id) */
  unsigned long long cumw[SB]; /* running weights of the sorted candidates */
  unsigned long long ured[NWARP];
  float fred[NWARP];
  int ired[NWARP];
  unsigned long long before, tmp64;
  int digit, found, n, id, flag;
};

/* Monotone map of floats to unsigned keys; NaN sorts last. */
__device__ __forceinline__ uint32_t fkey(float v) {
  if (v != v) return 0u;
  uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ bool kept(uint32_t k, int j, Bound b) { return k > b.key || (k == b.key && j <= b.id); }

struct Row {
  float *x; /* processed logits (global; written by this block, so no read-only cache) */
  int vocab;
  float mx, inv_t;
  bool temp; /* order by (x - mx) * inv_t, else by x */
};

__device__ __forceinline__ float rval(const Row &r, int j) {
  float x = r.x[j];
  return r.temp ? (x - r.mx) * r.inv_t : x;
}
__device__ __forceinline__ unsigned long long weight_of(float v) {
  float e = expf(v);
  return e == e ? __float2ull_rn(e * FIX_ONE) : 0ull;
}

/* ---------------------------------------------------------------- block reductions */

__device__ float block_max(float v, Shared &sh) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (lane == 0) sh.fred[w] = v;
  __syncthreads();
  v = sh.fred[lane];
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ float block_fsum(float v, Shared &sh) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) sh.fred[w] = v;
  __syncthreads();
  v = sh.fred[lane];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ unsigned long long block_umax(unsigned long long v, Shared &sh) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    unsigned long long t = __shfl_xor_sync(0xffffffffu, v, o);
    v = t > v ? t : v;
  }
  __syncthreads();
  if (lane == 0) sh.ured[w] = v;
  __syncthreads();
  v = sh.ured[lane];
  for (int o = 16; o > 0; o >>= 1) {
    unsigned long long t = __shfl_xor_sync(0xffffffffu, v, o);
    v = t > v ? t : v;
  }
  return v;
}

__device__ unsigned long long block_usum(unsigned long long v, Shared &sh) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) sh.ured[w] = v;
  __syncthreads();
  v = sh.ured[lane];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/* Inclusive scan over the block (thread order). */
__device__ unsigned long long block_uscan(unsigned long long v, Shared &sh) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  for (int o = 1; o < 32; o <<= 1) {
    unsigned long long t = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += t;
  }
  __syncthreads();
  if (lane == 31) sh.ured[w] = v;
  __syncthreads();
  if (w == 0) {
    unsigned long long t = sh.ured[lane], s = t;
    for (int o = 1; o < 32; o <<= 1) {
      unsigned long long u = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += u;
    }
    sh.ured[lane] = s - t; /* exclusive warp offsets */
  }
  __syncthreads();
  return v + sh.ured[w];
}

/* ---------------------------------------------------------------- radix descent */

/* The first kept candidate, in (key desc, id asc) order, at which the
 * running weight reaches T (>= T, or > T when strict); weights are 1 with
 * COUNT. T must be >= 1 when !strict. Returns false when the total never
 * reaches T. *cum gets the running weight including the candidate. */
template <bool COUNT>
__device__ bool select_first(const Row &r, Bound kb, unsigned long long T, bool strict, Shared &sh, Bound *out,
                             unsigned long long *cum) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  uint32_t prefix = 0, pmask = 0;
  unsigned long long before = 0;
  for (int pass = 0; pass < 4; pass++) {
    const int shift = 24 - 8 * pass;
    for (int i = tid; i < 256; i += SB) sh.hist[i] = 0;
    __syncthreads();
    for (int base = 0; base < r.vocab; base += SB) {
      int j = base + tid, digit = 256;
      unsigned long long w = 0;
      if (j < r.vocab) {
        float v = rval(r, j);
        uint32_t k = fkey(v);
        if (kept(k, j, kb) && (k & pmask) == prefix) {
          digit = (int)((k >> shift) & 255u);
          w = COUNT ? 1ull : weight_of(v);
        }
      }
      unsigned peers = __match_any_sync(0xffffffffu, digit);
      bool leader = lane == __ffs(peers) - 1;
      if (COUNT) {
        if (digit < 256 && leader) atomicAdd(&sh.hist[digit], (unsigned long long)__popc(peers));
      } else {
        unsigned lo = __reduce_add_sync(peers, (unsigned)(w & 0xffffull));
        unsigned hi = __reduce_add_sync(peers, (unsigned)(w >> 16));
        if (digit < 256 && leader) atomicAdd(&sh.hist[digit], ((unsigned long long)hi << 16) + lo);
      }
    }
    __syncthreads();
    if (warp == 0) {
      /* lane covers digits 255 - 8 lane - q, q = 0..7: descending order */
      unsigned long long loc[8], lsum = 0;
#pragma unroll
      for (int q = 0; q < 8; q++) {
        loc[q] = sh.hist[255 - 8 * lane - q];
        lsum += loc[q];
      }
      unsigned long long incl = lsum;
      for (int o = 1; o < 32; o <<= 1) {
        unsigned long long t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
      }
      unsigned long long end = before + incl;
      unsigned bal = __ballot_sync(0xffffffffu, strict ? end > T : end >= T);
      if (lane == 0) sh.found = bal != 0;
      if (bal && lane == __ffs(bal) - 1) {
        unsigned long long c = end - lsum;
        int d = 255 - 8 * lane - 7;
#pragma unroll
        for (int q = 0; q < 8; q++) {
          unsigned long long nc = c + loc[q];
          if (strict ? nc > T : nc >= T) {
            d = 255 - 8 * lane - q;
            break;
          }
          c = nc;
        }
        sh.digit = d;
        sh.before = c;
      }
    }
    __syncthreads();
    if (!sh.found) return false;
    prefix |= (uint32_t)sh.digit << shift;
    pmask |= 255u << shift;
    before = sh.before;
    __syncthreads(); /* sh.digit / sh.before are rewritten by the next pass */
  }
  /* ties on the key: all have the same weight; which one crosses, in id order */
  unsigned long long wt = COUNT ? 1ull : weight_of(key_float(prefix));
  if (wt == 0) wt = 1;
  unsigned long long need = T > before ? T - before : 0;
  unsigned long long i = strict ? need / wt : (need + wt - 1) / wt - (need ? 1 : 0);
  /* count kept ties per contiguous id range, scan, and let the owner find it */
  int chunk = (r.vocab + SB - 1) / SB, j0 = tid * chunk, j1 = min(j0 + chunk, r.vocab);
  int cnt = 0;
  for (int j = j0; j < j1; j++) {
    uint32_t k = fkey(rval(r, j));
    cnt += k == prefix && kept(k, j, kb);
  }
  unsigned long long incl = block_uscan((unsigned long long)cnt, sh), ex = incl - cnt;
  unsigned long long total_ties = incl;
  if (tid == SB - 1) sh.tmp64 = total_ties;
  __syncthreads();
  total_ties = sh.tmp64;
  if (i >= total_ties) i = total_ties ? total_ties - 1 : 0;
  if (i >= ex && i < incl) {
    unsigned long long left = i - ex;
    for (int j = j0; j < j1; j++) {
      uint32_t k = fkey(rval(r, j));
      if (k == prefix && kept(k, j, kb)) {
        if (left == 0) {
          sh.id = j;
          break;
        }
        left--;
      }
    }
  }
  __syncthreads();
  out->key = prefix;
  out->id = sh.id;
  *cum = before + (i + 1) * wt;
  __syncthreads();
  return true;
}

/* The first C (<= SB) kept candidates, sorted, into sh.arr; returns C. */
__device__ int top_sorted(const Row &r, Bound kb, int C, Shared &sh) {
  const int tid = threadIdx.x;
  Bound bc;
  unsigned long long cum;
  if (!select_first<true>(r, kb, (unsigned long long)C, false, sh, &bc, &cum)) bc = kb; /* fewer than C: all */
  if (tid == 0) sh.n = 0;
  sh.arr[tid] = 0ull;
  __syncthreads();
  for (int j = tid; j < r.vocab; j += SB) {
    uint32_t k = fkey(rval(r, j));
    if (kept(k, j, kb) && kept(k, j, bc)) {
      int p = atomicAdd(&sh.n, 1);
      if (p < SB) sh.arr[p] = (unsigned long long)k << 32 | (0xffffffffu - (uint32_t)j);
    }
  }
  __syncthreads();
  int n = sh.n < C ? sh.n : C;
  /* bitonic sort, descending */
  for (int k = 2; k <= SB; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      int ixj = tid ^ j;
      if (ixj > tid) {
        unsigned long long a = sh.arr[tid], b = sh.arr[ixj];
        bool up = (tid & k) == 0;
        if ((a < b) == up) {
          sh.arr[tid] = b;
          sh.arr[ixj] = a;
        }
      }
      __syncthreads();
    }
  return n;
}

__device__ __forceinline__ int arr_id(unsigned long long c) { return (int)(0xffffffffu - (uint32_t)c); }

/* Forced / banned tokens, written back to the row as the CPU does. */
__device__ void process_row(float *x, int vocab, const td_sample_row &rw, const int32_t *bans) {
  if (rw.forced >= 0 && rw.forced < vocab) {
    for (int j = threadIdx.x; j < vocab; j += SB) x[j] = j == rw.forced ? 0.0f : -INFINITY;
  } else if (bans) {
    for (int i = threadIdx.x; i < rw.ban_count; i += SB) {
      int32_t t = bans[rw.ban_start + i];
      if (t >= 0 && t < vocab) x[t] = -INFINITY;
    }
  }
  __syncthreads();
}

/* max and log-sum-exp of the processed row (temperature 1) */
__device__ void row_stats(const float *x, int vocab, Shared &sh, float *mx_out, float *lse_out) {
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < vocab; j += SB) mx = fmaxf(mx, x[j]);
  mx = block_max(mx, sh);
  float s = 0.0f;
  if (mx != -INFINITY)
    for (int j = threadIdx.x; j < vocab; j += SB) s += expf(x[j] - mx);
  s = block_fsum(s, sh);
  *mx_out = mx;
  *lse_out = mx == -INFINITY ? -INFINITY : mx + logf(s);
}

__global__ void __launch_bounds__(SB) sample_kernel(float *logits, int vocab, const td_sample_row *rows,
                                                    const int32_t *bans, int32_t *tokens, float *logprobs) {
  td_pdl_start();
  __shared__ Shared sh;
  const int tid = threadIdx.x;
  float *x = logits + (size_t)blockIdx.x * vocab;
  const td_sample_row rw = rows[blockIdx.x];
  process_row(x, vocab, rw, bans);
  float mx, lse;
  row_stats(x, vocab, sh, &mx, &lse);
  int tok;
  if (rw.temperature <= 0.0f || rw.forced >= 0) {
    unsigned long long best = 0;
    for (int j = tid; j < vocab; j += SB) {
      unsigned long long c = (unsigned long long)fkey(x[j]) << 32 | (0xffffffffu - (uint32_t)j);
      best = c > best ? c : best;
    }
    tok = arr_id(block_umax(best, sh));
  } else {
    Row r = {x, vocab, mx, 1.0f / rw.temperature, true};
    const Bound all = {0u, 0x7fffffff};
    int kcap = rw.top_k > 0 && rw.top_k < vocab ? rw.top_k : vocab;
    int C = kcap < SB ? kcap : SB;
    int n = top_sorted(r, all, C, sh);
    /* running weights of the sorted candidates */
    unsigned long long w = tid < n ? weight_of(rval(r, arr_id(sh.arr[tid]))) : 0ull;
    unsigned long long cw = block_uscan(w, sh);
    sh.cumw[tid] = cw;
    __syncthreads();
    /* the kept set: top-k */
    Bound kb = all;
    unsigned long long total;
    bool in_array = kcap <= SB; /* the whole kept set is in sh.arr */
    if (in_array) {
      total = sh.cumw[n - 1];
    } else {
      unsigned long long cum = 0;
      if (kcap < vocab && !select_first<true>(r, all, (unsigned long long)kcap, false, sh, &kb, &cum)) kb = all;
      unsigned long long s = 0;
      for (int j = tid; j < vocab; j += SB) {
        float v = rval(r, j);
        if (kept(fkey(v), j, kb)) s += weight_of(v);
      }
      total = block_usum(s, sh);
    }
    int limit = n; /* sorted candidates that belong to the kept set */
    if (rw.top_p < 1.0f) {
      double tp = rw.top_p > 0.0f ? (double)rw.top_p : 0.0;
      unsigned long long T = (unsigned long long)ceil(tp * (double)total);
      if (T < 1) T = 1;
      if (sh.cumw[n - 1] >= T) {
        if (tid == 0) sh.flag = n;
        __syncthreads();
        if (tid < n && sh.cumw[tid] >= T && (tid == 0 || sh.cumw[tid - 1] < T)) sh.flag = tid + 1;
        __syncthreads();
        limit = sh.flag;
        total = sh.cumw[limit - 1];
        in_array = true;
      } else {
        Bound bp;
        unsigned long long cum;
        if (select_first<false>(r, kb, T, false, sh, &bp, &cum)) {
          kb = bp;
          total = cum;
        }
        in_array = false;
      }
    }
    float u = td_rand_uniform(rw.seed, rw.stream, rw.step);
    unsigned long long U = (unsigned long long)((double)u * (double)total);
    if (in_array || U < sh.cumw[limit - 1]) {
      __syncthreads(); /* every thread has read the nucleus size from sh.flag */
      if (tid == 0) sh.flag = limit - 1;
      __syncthreads();
      if (tid < limit && sh.cumw[tid] > U && (tid == 0 || sh.cumw[tid - 1] <= U)) sh.flag = tid;
      __syncthreads();
      tok = arr_id(sh.arr[sh.flag]);
    } else {
      Bound bt;
      unsigned long long cum;
      if (select_first<false>(r, kb, U, true, sh, &bt, &cum)) tok = bt.id;
      else tok = kb.id < vocab ? kb.id : arr_id(sh.arr[limit - 1]);
    }
  }
  if (tid == 0) {
    tokens[blockIdx.x] = tok;
    if (logprobs) logprobs[blockIdx.x] = x[tok] - lse;
  }
}

/* As transformers scores beams: log_softmax of the raw row, then forced /
 * banned tokens applied to the log-probs (no renormalisation); the row is
 * left holding them. */
__global__ void __launch_bounds__(SB) topk_kernel(float *logits, int vocab, const td_sample_row *rows,
                                                  const int32_t *bans, int k, int32_t *ids, float *vals) {
  td_pdl_start();
  __shared__ Shared sh;
  const int tid = threadIdx.x;
  float *x = logits + (size_t)blockIdx.x * vocab;
  const td_sample_row rw = rows[blockIdx.x];
  float mx, lse;
  row_stats(x, vocab, sh, &mx, &lse);
  for (int j = tid; j < vocab; j += SB) x[j] -= lse;
  __syncthreads();
  process_row(x, vocab, rw, bans);
  Row r = {x, vocab, 0.0f, 1.0f, false};
  const Bound all = {0u, 0x7fffffff};
  top_sorted(r, all, k, sh);
  if (tid < k) {
    int id = arr_id(sh.arr[tid]);
    ids[(size_t)blockIdx.x * k + tid] = id;
    vals[(size_t)blockIdx.x * k + tid] = x[id];
  }
}

td_status td_cu_sample_init(td_cuda *c) { return TD_OK; }

td_status td_cu_sample(td_backend *b, float *logits, int n, int vocab, const td_sample_row *rows,
                       const int32_t *bans, int32_t *tokens, float *logprobs) {
  td_cu_bind(td_cu(b));
  td_cuda *c = td_cu(b);
  (void)td_launch(c, sample_kernel, n, SB, 0, logits, vocab, rows, bans, tokens, logprobs);
  TD_CU_LAUNCHED("sample");
  return TD_OK;
}

td_status td_cu_topk_logprobs(td_backend *b, float *logits, int n, int vocab, const td_sample_row *rows,
                              const int32_t *bans, int k, int32_t *ids, float *vals) {
  td_cu_bind(td_cu(b));
  td_cuda *c = td_cu(b);
  if (k > TD_CU_TOPK_MAX)
    return td_err(TD_ERR_UNSUPPORTED, "topk_logprobs: k = %d, the GPU path allows at most %d", k, TD_CU_TOPK_MAX);
  (void)td_launch(c, topk_kernel, n, SB, 0, logits, vocab, rows, bans, k, ids, vals);
  TD_CU_LAUNCHED("topk_logprobs");
  return TD_OK;
}
