/* Inline PTX used by the tensor-core kernels: cp.async, ldmatrix, mma.sync
 * m16n8k16 bf16 (sm_80+), and Hopper's wgmma (sm_90a). */
#ifndef TD_KERNELS_CUDA_PTX_CUH
#define TD_KERNELS_CUDA_PTX_CUH

#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_u32(p))
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_u32(p))
               : "memory");
}

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* ---- Hopper bulk copies (the TMA engine, 1-D) completing on an mbarrier */
__device__ __forceinline__ void mbar_init(uint64_t *bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
  /* make the initialised barrier visible to the copy engine */
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_tx(uint64_t *bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t *bar, unsigned phase) {
  asm volatile(
      "{\n.reg .pred p;\nTD_MBAR_WAIT%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra TD_MBAR_WAIT%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(phase)
      : "memory");
}
/* ---- distributed shared memory between the blocks of a cluster */
/* this block's shared address p as the same variable in block `rank` */
__device__ __forceinline__ uint32_t dsmem_map(const void *p, unsigned rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_u32(p)), "r"(rank));
  return r;
}
/* 16 bytes into another block's shared memory (addresses from dsmem_map),
 * completing on that block's barrier's transaction count */
__device__ __forceinline__ void st_async16(uint32_t dst, float4 v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                   dst),
               "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)),
               "r"(__float_as_uint(v.w)), "r"(bar)
               : "memory");
}
/* a local barrier's phase, with what the cluster wrote before completing it */
__device__ __forceinline__ bool mbar_test_cluster(uint64_t *bar, unsigned phase) {
  uint32_t done;
  asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
               "selp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done)
               : "r"(smem_u32(bar)), "r"(phase)
               : "memory");
  return done != 0;
}
__device__ __forceinline__ void mbar_wait_cluster(uint64_t *bar, unsigned phase) {
  while (!mbar_test_cluster(bar, phase)) {
  }
}
/* initialised barriers visible to the cluster's other blocks */
__device__ __forceinline__ void fence_mbar_init_cluster() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
/* the cluster barrier in halves, from divergent code (every thread of the
 * cluster arrives once; a thread waits before it arrives again or uses
 * what the arrival published) */
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory"); }

/* bytes (a multiple of 16, both addresses 16-byte aligned) from global to
 * this block's shared memory; completes on bar's transaction count */
__device__ __forceinline__ void bulk_g2s(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

/* bytes (a multiple of 16, 16-byte aligned) from global into L2 only: no
 * shared memory, no completion to wait for */
__device__ __forceinline__ void bulk_prefetch_l2(const void *src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}

/* the same with an L2 cache policy (l2_evict_first: data read once) */
__device__ __forceinline__ void bulk_g2s_hint(void *dst, const void *src, uint32_t bytes, uint64_t *bar,
                                              uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy)
      : "memory");
}
__device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}

/* 16 bytes of a model constant through the read-only path, with an L2
 * cache policy */
__device__ __forceinline__ uint4 ldg_hint(const void *p, uint64_t policy) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(policy));
  return v;
}

/* Sums of squares of x's rows from the mma.sync A fragments (a plain
 * RMSNorm folded into a GEMM): per k16 step a lane holds 4 values of row
 * g = lane / 4 and 4 of row g + 8, and the 4 lanes of a g cover the
 * step's 16 columns. */
__device__ __forceinline__ void sq_sums_add(const uint32_t (&af)[4], float &ss, float &ss8) {
#pragma unroll
  for (int i = 0; i < 4; i++) {
    float2 f = __bfloat1622float2(*(const __nv_bfloat162 *)&af[i]);
    float q = f.x * f.x + f.y * f.y;
    if (i & 1) ss8 += q;
    else ss += q;
  }
}
/* The same for the sums of x (a folded LayerNorm's mean); stored as above. */
__device__ __forceinline__ void x_sums_add(const uint32_t (&af)[4], float &s, float &s8) {
#pragma unroll
  for (int i = 0; i < 4; i++) {
    float2 f = __bfloat1622float2(*(const __nv_bfloat162 *)&af[i]);
    if (i & 1) s8 += f.x + f.y;
    else s += f.x + f.y;
  }
}
/* this warp's sums of rows 0..15 over its K range, into out[16] */
__device__ __forceinline__ void sq_sums_store(float *out, float ss, float ss8, int lane) {
  ss += __shfl_xor_sync(0xffffffffu, ss, 1);
  ss += __shfl_xor_sync(0xffffffffu, ss, 2);
  ss8 += __shfl_xor_sync(0xffffffffu, ss8, 1);
  ss8 += __shfl_xor_sync(0xffffffffu, ss8, 2);
  if (!(lane & 3)) {
    out[lane >> 2] = ss;
    out[(lane >> 2) + 8] = ss8;
  }
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *(uint32_t *)&v;
}

/* ---- Hopper warpgroup MMA (sm_90a): wgmma.mma_async m64n64k16, A from
 * registers (the mma.sync m16n8k16 A fragment of each warp's 16 rows), B
 * from shared memory through a descriptor. The f32 accumulators use the
 * mma.sync C fragment layout, n8 tile j in d[4j .. 4j + 3]. */

/* Descriptor of a 128-byte-swizzled shared-memory operand: rows of 128
 * bytes whose 16-byte chunk c sits at chunk c ^ (row & 7), 8-row groups
 * 1024 bytes apart, the tile 1024-byte aligned. */
__device__ __forceinline__ uint64_t wg_desc_sw128(const void *p, uint32_t lbo, uint32_t sbo) {
  uint64_t a = smem_u32(p);
  return ((a & 0x3FFFFu) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* Pins accumulator / fragment registers in program order: called before
 * wg_fence (writes to them land before the fence, as wgmma requires) and
 * after wg_wait (reads happen after the wait). */
__device__ __forceinline__ void wg_hold(float (&d)[32]) {
#pragma unroll
  for (int i = 0; i < 32; i++) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void wg_hold(uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; i++)
#pragma unroll
    for (int j = 0; j < 4; j++) asm volatile("" : "+r"(r[i][j])::"memory");
}
/* sync: shared-memory writes of the generic proxy (st, cp.async) become
 * visible to wgmma's reads (async proxy) */
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/* d (+)= a * B; TB: B stored N-major (transposed); acc: 0 overwrites d */
template <int TB>
__device__ __forceinline__ void wgmma64_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
      "{%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc), "n"(TB));
}

#endif
