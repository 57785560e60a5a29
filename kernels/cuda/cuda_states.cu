/* td_attn_states (cuda_states.cuh describes it): the generic kernel, the
 * table of tensor-core kernels and their occupancy, and the op, which
 * launches the kernel td_cu_states_policy (cuda_policy.c) picks. */
#include <limits.h>

#include "kernels/cuda/cuda_states.cuh"

/* Any D: a block per (row, head); warps over keys, lanes over D. */
__global__ void __launch_bounds__(128) states_generic_kernel(const StatesArgs a) {
  extern __shared__ float sc[]; /* [max ctx] */
  __shared__ float red[32];
  td_pdl_start();
  const int s = (int)blockIdx.x / a.max_q, i = (int)blockIdx.x % a.max_q, h = (int)blockIdx.y;
  const int q0 = a.q_start[s], qn = a.q_start[s + 1] - q0, ctx = min(a.ctx_len[s], a.max_ctx);
  if (i >= qn) return;
  const int row = q0 + i, half = a.D / 2, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int32_t *table = a.block_table + (size_t)s * a.max_blocks;
  const bf16 *q = a.q + (size_t)row * a.ldq + (size_t)h * a.D;
  const float qs = a.scale_log2 * states_qn(a, row);
  for (int j = warp; j < ctx; j += 4) {
    const bf16 *ek = states_row(a, table, j, 0), *ev = states_row(a, table, j, 1);
    float d = 0.0f;
    for (int c = lane; c < half; c += 32) {
      d = fmaf(__bfloat162float(q[c]), __bfloat162float(ek[c]), d);
      d = fmaf(__bfloat162float(q[half + c]), __bfloat162float(ev[c]), d);
    }
    d = td_warp_sum(d);
    if (lane == 0) sc[j] = d * qs;
  }
  __syncthreads();
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < ctx; j += blockDim.x) mx = fmaxf(mx, sc[j]);
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  mx = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
  float sum = 0.0f;
  for (int j = threadIdx.x; j < ctx; j += blockDim.x) {
    float p = exp2f(sc[j] - mx);
    sc[j] = p;
    sum += p;
  }
  sum = td_block_sum(sum, red); /* its barriers also publish sc */
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  bf16 *o = a.out + ((size_t)row * a.heads + h) * a.D;
  for (int c = threadIdx.x; c < a.D; c += blockDim.x) {
    const int plane = c >= half, cc = c - plane * half;
    float acc = 0.0f;
    for (int j = 0; j < ctx; j++) acc = fmaf(sc[j], __bfloat162float(states_row(a, table, j, plane)[cc]), acc);
    o[c] = __float2bfloat16(acc * inv);
  }
}

/* The tensor-core kernels in one table: 8 and 16 warps, then the
 * warp-specialised and the plane kernels. */
static const states_cfg *states_cfg_at(int i) {
  return i < STATES_N_MMA                    ? &td_states_mma_cfgs[i]
         : i < STATES_N_MMA + STATES_N_WS       ? &td_states_ws_cfgs[i - STATES_N_MMA]
         : i < STATES_N_MMA + STATES_N_WS + STATES_N_PL ? &td_states_pl_cfgs[i - STATES_N_MMA - STATES_N_WS]
                                                        : &td_states_pl32_cfgs[i - STATES_N_MMA - STATES_N_WS - STATES_N_PL];
}
enum { STATES_NCFG = STATES_N_MMA + STATES_N_WS + STATES_N_PL + STATES_N_PL32 };
static_assert(STATES_NCFG <= (int)(sizeof(((td_cuda *)0)->states_clusters) / sizeof(((td_cuda *)0)->states_clusters[0])),
              "a states_clusters row per kernel");
static_assert(TD_CU_STATES_CLUSTERS <= (int)(sizeof(((td_cuda *)0)->states_clusters[0]) / sizeof(int)),
              "a column per cluster size");

static td_states_kernel states_kind(const states_cfg *s) {
  return s->rows == 32 ? TD_STATES_PL32 : s->pl ? TD_STATES_PL : s->ws ? TD_STATES_WS : s->sw == 8 ? TD_STATES_MMA8 : TD_STATES_MMA16;
}

/* Which kernels take D on this device, with their table index */
static void states_avail(const td_cuda *c, int D, td_states_avail *k, int (&index)[TD_STATES_KERNELS]) {
  *k = td_states_avail{};
  for (int i = 0; i < STATES_NCFG; i++) {
    const states_cfg *s = states_cfg_at(i);
    if (D != s->nt * 64 || s->bytes > c->smem_optin) continue;
    const td_states_kernel kind = states_kind(s);
    k->has[kind] = true;
    index[kind] = i;
    for (int j = 0; j < TD_CU_STATES_CLUSTERS; j++) k->clusters[kind][j] = c->states_clusters[i][j];
  }
}

td_status td_cu_states_init(td_cuda *c) {
  for (int i = 0; i < STATES_NCFG; i++) {
    const states_cfg *s = states_cfg_at(i);
    if (s->bytes > c->smem_optin) continue;
    TD_CU_CHECK(cudaFuncSetAttribute(s->fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)s->bytes),
                "attn_states");
    TD_CU_CHECK(cudaFuncSetAttribute(s->fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1), "attn_states");
    for (int k = 0; k < TD_CU_STATES_CLUSTERS; k++) {
      cudaLaunchConfig_t lc = {};
      cudaLaunchAttribute at = td_cluster_attr(1 << k);
      lc.gridDim = dim3(1u << k);
      lc.blockDim = dim3(32 * (unsigned)s->sw);
      lc.dynamicSmemBytes = s->bytes;
      lc.attrs = &at;
      lc.numAttrs = 1;
      int n = 0;
      TD_CU_CHECK(cudaOccupancyMaxActiveClusters(&n, s->fn, &lc), "attn_states");
      c->states_clusters[i][k] = n;
    }
  }
  return TD_OK;
}

/* Whether a tensor-core kernel takes D on this device. */
bool td_cu_states_fast(const td_backend *b, int D) {
  const td_cuda *c = td_cu((td_backend *)b);
  for (int i = 0; i < STATES_NCFG; i++)
    if (D == states_cfg_at(i)->nt * 64 && states_cfg_at(i)->bytes <= c->smem_optin) return true;
  return false;
}

/* Whether the 32-pair plane kernel takes D (and is not tuned off); cap, if
 * given: how many of its blocks are resident at once (clusters of two). */
static bool states_pl32_fits(const td_cuda *c, int D, int *cap) {
  td_states_avail k;
  int index[TD_STATES_KERNELS] = {0};
  states_avail(c, D, &k, index);
  const int n = 2 * k.clusters[TD_STATES_PL32][1];
  if (cap) *cap = n;
  return c->tune.states_pl32 && k.has[TD_STATES_PL32] && n > 0;
}

bool td_cu_states_takes(const td_backend *b, int D, int heads, bool kv8, int rows) {
  const td_cuda *c = td_cu((td_backend *)b);
  int cap = 0;
  const bool f32 = states_pl32_fits(c, D, &cap);
  return td_cu_states_switch_takes(D, heads, td_cu_states_fast(b, D), f32, kv8, rows, cap);
}

/* From which rows a dual pool's steps take the states path: the policy's rule. */
int td_cu_states_rows(const td_backend *b, int D, bool kv8) {
  const bool f32 = states_pl32_fits(td_cu((td_backend *)b), D, NULL);
  return td_cu_states_switch_rows(D, td_cu_states_fast(b, D), f32, kv8);
}

td_status td_cu_attn_states(td_backend *b, const void *q, int ldq, void *out, const void *pool,
                            const td_kv_layout *l, int heads, const td_paged_meta *m, float scale) {
  td_cuda *c = td_cu(b);
  td_cu_bind(c);
  int D = l->states, bs = l->block_size;
  if ((long)m->max_blocks * bs > 2147483647L) return td_err(TD_ERR_INVALID, "attn_states: block table too wide");
  int max_q = m->max_q < 1 ? 1 : m->max_q > m->n_tokens ? m->n_tokens : m->max_q;
  int max_ctx = m->max_ctx < 1 || m->max_ctx > m->max_blocks * bs ? m->max_blocks * bs : m->max_ctx;
  StatesArgs a = {};
  a.q = (const bf16 *)q;
  a.pool = (const bf16 *)pool + td_kv_layer_span(l, l->n_layers).off; /* the states tail */
  a.out = (bf16 *)out;
  a.q_start = m->q_start;
  a.ctx_len = m->ctx_len;
  a.block_table = m->block_table;
  a.ldq = ldq;
  a.heads = heads;
  a.D = D;
  a.bs = bs;
  a.max_blocks = m->max_blocks;
  a.max_q = max_q;
  a.max_ctx = max_ctx;
  a.block_elems = td_kv_block_elems(l);
  a.scale_log2 = scale * LOG2E_F;
  a.late = c->tune.pdl_late > 0 && (c->tune.pdl_late & 1) != 0;
  if (m->q_norm) {
    a.qn = (const bf16 *)m->q_norm;
    a.qn_dim = m->q_norm_dim;
    a.qn_eps = m->q_norm_eps;
    a.qn_vec = m->q_norm_dim % 8 == 0 && td_aligned16(m->q_norm);
  }
  td_states_avail k;
  int index[TD_STATES_KERNELS] = {0};
  states_avail(c, D, &k, index);
  td_states_shape sh = {};
  sh.n_seqs = m->n_seqs;
  sh.heads = heads;
  sh.max_q = max_q;
  sh.max_ctx = max_ctx;
  sh.aligned = ldq % 8 == 0 && td_aligned16(q) && td_aligned16(a.pool) && a.block_elems % 8 == 0 && td_aligned16(out);
  sh.kv_static = m->kv_static;
  const td_states_plan p = td_cu_states_policy(&c->tune, c->sm_count, &k, &sh);
  if (p.kernel == TD_STATES_GENERIC) {
    size_t sm = ((size_t)max_ctx + 8) * sizeof(float);
    if (sm > c->smem_optin) return td_err(TD_ERR_UNSUPPORTED, "attn_states: %d states", max_ctx);
    if (sm > 48 * 1024)
      TD_CU_CHECK(cudaFuncSetAttribute(states_generic_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm),
                  "attn_states");
    dim3 grid((unsigned)(m->n_seqs * max_q), (unsigned)heads);
    (void)td_launch(c, states_generic_kernel, grid, 128, sm, a);
    TD_CU_LAUNCHED("attn_states");
    return TD_OK;
  }
  a.groups = p.groups;
  if (p.blocks > 2147483647L) return td_err(TD_ERR_UNSUPPORTED, "attn_states: %ld blocks", p.blocks);
  a.n_splits = p.n_splits;
  states_cfg_at(index[p.kernel])->launch(c, dim3((unsigned)p.blocks), p.cluster, a);
  TD_CU_LAUNCHED("attn_states");
  return TD_OK;
}
