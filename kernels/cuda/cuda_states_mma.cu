/* attn_states on tensor cores, 8 or 16 warps a block (cuda_states.cuh). */
#include "kernels/cuda/cuda_states.cuh"

/* The tensor-core kernel: D = 64 NT, ST states a tile, NSTG tiles in
 * flight, SW warps. */
template <int NT, int ST, int NSTG, int SW>
struct StatesSmem {
  /* a plane's rows in pairs (one bulk copy of 2 rows where they share a
   * paged block: half the copies of one a row), the pairs padded by 16
   * bytes */
  static constexpr int D = NT * 64, HALF = D / 2, PAIR = 2 * HALF + 8;
  static constexpr size_t STAGE = 2 * (ST / 2) * (size_t)PAIR * 2; /* [plane][ST / 2][PAIR] bf16 */
  /* per-warp partial scores, rows padded by 8 floats: a warp's stores of
   * 4 rows at a time meet no bank conflicts */
  static constexpr int RST = ST + 8;
  static constexpr size_t RED = SW * 16 * (size_t)RST * 4;
  static constexpr size_t P = 16 * (ST + 8) * 2;                 /* probabilities, bf16 */
  static constexpr size_t STATS = 3 * 16 * 4;                    /* m, l, alpha */
  static constexpr size_t ML = STATES_MAX_SPLITS * 16 * 8;       /* every split's (m, l), pushed before the merge */
  static constexpr size_t BYTES = NSTG * STAGE + RED + P + STATS + ML + NSTG * 8;
  /* after the last tile the stages hold the block's partial sums for the
   * cluster's merge: [16][D + 4] fp32, then 16 x STATES_MAX_SPLITS weights */
  static constexpr int PST = D + 4;
  static_assert(NSTG * STAGE >= (16 * (size_t)PST + 16 * STATES_MAX_SPLITS) * 4, "merge buffer");
};

template <int NT, int ST, int NSTG, int SW>
__global__ void __launch_bounds__(32 * SW, 1) states_mma_kernel(const StatesArgs a) {
  using L = StatesSmem<NT, ST, NSTG, SW>;
  static_assert(SW == 8 || SW == 16, "warps a block");
  constexpr int TPR = 2 * SW, RPW = 16 / SW; /* softmax threads a row; query-scale rows a warp */
  constexpr int D = L::D, HALF = L::HALF, PAIR = L::PAIR, KW = D / SW; /* each warp's score slice of D */
  constexpr int PLANE = (ST / 2) * PAIR, SSTAGE = 2 * PLANE;
  static_assert(ST % 16 == 0, "tile of whole 16-state spans");
  extern __shared__ __align__(128) unsigned char smem[];
  bf16 *stage = (bf16 *)smem;
  float *red = (float *)(smem + NSTG * L::STAGE);
  bf16 *ps = (bf16 *)((char *)red + L::RED);
  float *st_m = (float *)((char *)ps + L::P), *st_l = st_m + 16, *st_a = st_l + 16;
  float2 *ml = (float2 *)(st_m + 48); /* [split][16] */
  uint64_t *bar = (uint64_t *)((char *)ml + L::ML);
  const int warp = threadIdx.x >> 5, tid = threadIdx.x;
  const StatesBlock kb = states_block<ST>(a);
  const int split = kb.split, s = kb.s, g = kb.g, ctx = kb.ctx, t0 = kb.t0, t1 = kb.t1;
  const int32_t *table = kb.table;
  if (tid == 0)
    for (int i = 0; i < NSTG; i++) mbar_init(&bar[i], 1);
  states_start(st_m, st_l, a.n_splits > 1);
  /* tile t into stage buffer b by every thread that has copies to issue
   * (spread over the warps: a warp issues its bulk copies one after another) */
  const uint64_t pol = l2_evict_first();
  auto issue = [&](int t, int b) {
    states_issue<ST, HALF, PAIR>(a, table, ctx, t, stage + (size_t)b * SSTAGE, &bar[b], pol, tid);
  };
  for (int i = 0; i < NSTG && t0 + i < t1; i++) issue(t0 + i, i);
  td_pdl_start_if(a.late);
  const int q0 = a.q_start[s], npairs = (a.q_start[s + 1] - q0) * a.heads;
  uint32_t qf[KW / 16][4]; /* this warp's slice of D */
  states_load_q<KW, D>(qf, a, g, q0, npairs, warp * KW);
  /* score scale of each pair row (the query norm's 1 / rms), warp w rows RPW w + [0, RPW) */
  float *st_q = red; /* borrowed until the first tile's partials */
  states_qscale(a, g, q0, npairs, st_q, RPW);
  __syncthreads();
  float rs = st_q[tid / TPR]; /* the softmax phase's row */
  __syncthreads();

  constexpr int MT = D / SW / 8; /* each warp's mix columns in n8 tiles */
  float acc[MT][4];
#pragma unroll
  for (int j = 0; j < MT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  for (int t = t0, use = 0; t < t1; t++, use++) {
    const int b = use % NSTG;
    const bf16 *E = stage + (size_t)b * SSTAGE;
    mbar_wait(&bar[b], (unsigned)(use / NSTG) & 1u);
    const int nval = min(ST, ctx - t * ST);
    if (nval < ST) {
      states_zero_tail<ST, HALF, PAIR>((bf16 *)E, nval, tid, 32 * SW);
      __syncthreads();
    }
    /* scores: warp w sums over D columns [w KW, (w + 1) KW) */
    states_scores<ST, KW, HALF, PAIR, L::RST>(E, qf, warp * KW, red + (size_t)warp * 16 * L::RST);
    __syncthreads();
    { /* softmax over the tile: thread tid takes row tid / TPR, columns CPT (tid % TPR) + [0, CPT) */
      constexpr int CPT = ST / TPR;
      const int r = tid / TPR, c = (tid % TPR) * CPT;
      float v[CPT];
#pragma unroll
      for (int i = 0; i < CPT; i++) v[i] = 0.0f;
#pragma unroll
      for (int w = 0; w < SW; w++) {
        const float *rr = red + ((size_t)w * 16 + r) * L::RST + c;
        if constexpr (CPT % 2 == 0) { /* float2: a half-warp a row, no bank conflicts */
#pragma unroll
          for (int i = 0; i < CPT; i += 2) {
            const float2 f = *(const float2 *)&rr[i];
            v[i] += f.x;
            v[i + 1] += f.y;
          }
        } else {
#pragma unroll
          for (int i = 0; i < CPT; i++) v[i] += rr[i];
        }
      }
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < CPT; i++) {
        v[i] = states_perm(c + i) < nval ? v[i] * rs : -INFINITY;
        mx = fmaxf(mx, v[i]);
      }
#pragma unroll
      for (int o = TPR / 2; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float mo = st_m[r], mn = fmaxf(mo, mx);
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < CPT; i++) {
        v[i] = mn == -INFINITY ? 0.0f : exp2f(v[i] - mn);
        sum += v[i];
        ps[r * (ST + 8) + c + i] = __float2bfloat16(v[i]);
      }
#pragma unroll
      for (int o = TPR / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      __syncwarp();
      if (tid % TPR == 0) {
        const float al = mo == -INFINITY ? 0.0f : exp2f(mo - mn);
        st_a[r] = al;
        st_l[r] = st_l[r] * al + sum;
        st_m[r] = mn;
      }
    }
    __syncthreads();
    /* mix: warp w owns columns [w D / SW, (w + 1) D / SW), all in one plane */
    states_mix<ST, MT, HALF, PAIR>(acc, E, ps, st_a, warp * (D / SW));
    __syncthreads(); /* every warp is done with the stage and the probabilities */
    if (t + NSTG < t1) {
      fence_proxy_async(); /* this thread's reads of the stage before the copy engine's writes */
      issue(t + NSTG, b);
    }
  }

  /* out: this block's sums (one split) or the merge of the cluster's */
  const int c0 = warp * (D / SW);
  auto out_at = [&](int r) -> bf16 * {
    const int p = g * 16 + r;
    return p < npairs ? a.out + ((size_t)(q0 + p / a.heads) * a.heads + p % a.heads) * D : nullptr;
  };
  /* the output, or the partial sums into the stages (all copies have
   * landed) and the cluster's merge */
  float *mine = (float *)stage;
  states_store<MT, L::PST>(acc, a.n_splits == 1, out_at, st_l, mine, c0);
  if (a.n_splits == 1) return;
  states_merge<D, L::PST, 32 * SW>(mine, ml, st_m, st_l, a.n_splits, split, out_at);
}

template <int NT, int SW>
static void states_launch(const td_cuda *c, dim3 grid, int cluster, const StatesArgs &a) {
  (void)td_launch_ex(c, cluster, -1, states_mma_kernel<NT, ST, NSTG, SW>, grid, 32 * SW,
                     StatesSmem<NT, ST, NSTG, SW>::BYTES, a);
}

#define TD_STATES_CFG(nt, sw) \
  {nt, sw, false, false, StatesSmem<nt, ST, NSTG, sw>::BYTES, (const void *)states_mma_kernel<nt, ST, NSTG, sw>, \
   states_launch<nt, sw>, 16},
const states_cfg td_states_mma_cfgs[STATES_N_MMA] = {
    TD_STATES_CFG(8, 8) TD_STATES_CFG(12, 8) TD_STATES_CFG(16, 8) TD_STATES_CFG(20, 8)
    TD_STATES_CFG(8, 16) TD_STATES_CFG(12, 16) TD_STATES_CFG(16, 16) TD_STATES_CFG(20, 16)};
#undef TD_STATES_CFG
