/* attn_states on 16 warps in two specialised groups (cuda_states.cuh). */
#include "kernels/cuda/cuda_states.cuh"

/* The same product with the phases on separate warps, where the policy
 * takes 16 warps and three stages fit (D <= 1024; td_cuda_tuning.states_ws
 * off: cuda_states_mma.cu's): warps 0-7 take the scores and the softmax of tile u
 * while warps 8-15 mix tile u - 1, the probabilities handed over through
 * two buffers and mbarriers, each group on its own named barrier, so that
 * neither waits for the other's phase and a third stage fits in the
 * shared memory the first kernel's 16 warps of partial scores took. The
 * mix group refills the stage it has finished. D = 64 NT, 512 threads
 * (docs/cuda.md, "Cross-attention over encoder states"). */
template <int NT>
struct StatesWsSmem {
  static constexpr int ST = 32, NSTG = 3, D = NT * 64, HALF = D / 2, PAIR = 2 * HALF + 8, RST = ST + 8;
  static constexpr size_t STAGE = 2 * (ST / 2) * (size_t)PAIR * 2;
  static constexpr size_t RED = 8 * 16 * (size_t)RST * 4;
  static constexpr size_t P = 2 * 16 * (ST + 8) * 2;              /* two buffers */
  static constexpr size_t STATS = (16 + 16 + 32 + 16) * 4;        /* m, l, alpha [2][16], query scale */
  static constexpr size_t ML = STATES_MAX_SPLITS * 16 * 8;
  static constexpr size_t BARS = (NSTG + 4) * 8;                  /* full[NSTG], pfull[2], pempty[2] */
  static constexpr size_t BYTES = NSTG * STAGE + RED + P + STATS + ML + BARS;
  static constexpr int PST = D + 4;
  static_assert(NSTG * STAGE >= (16 * (size_t)PST + 16 * STATES_MAX_SPLITS) * 4, "merge buffer");
};

/* 120 registers (512 threads): a block then fits beside one of the self
 * K/V prefetch's 4 blocks (td_kv_prefetch), which otherwise keep 4 SMs
 * from the states kernel's 128 blocks at batch 64
 * (docs/history/cuda-passes.md, pass 20). */
template <int NT>
__global__ void __maxnreg__(120) states_ws_kernel(const StatesArgs a) {
  using L = StatesWsSmem<NT>;
  constexpr int ST = L::ST, NSTG = L::NSTG, D = L::D, HALF = L::HALF, PAIR = L::PAIR, RST = L::RST;
  constexpr int KW = D / 8, MT = D / 8 / 8, PLANE = (ST / 2) * PAIR, SSTAGE = 2 * PLANE, PB = 16 * (ST + 8);
  extern __shared__ __align__(128) unsigned char smem[];
  bf16 *stage = (bf16 *)smem;
  float *red = (float *)(smem + NSTG * L::STAGE);
  bf16 *ps = (bf16 *)((char *)red + L::RED);
  float *st_m = (float *)((char *)ps + L::P), *st_l = st_m + 16, *st_a = st_l + 16, *st_q = st_a + 32;
  float2 *ml = (float2 *)(st_q + 16);
  uint64_t *full = (uint64_t *)((char *)ml + L::ML), *pfull = full + NSTG, *pempty = pfull + 2;
  const int warp = threadIdx.x >> 5, tid = threadIdx.x;
  const bool sw = warp < 8;
  const StatesBlock kb = states_block<ST>(a);
  const int split = kb.split, s = kb.s, g = kb.g, ctx = kb.ctx, t0 = kb.t0, t1 = kb.t1;
  const int32_t *table = kb.table;
  if (tid == 0) {
    for (int i = 0; i < NSTG; i++) mbar_init(&full[i], 1);
    for (int i = 0; i < 2; i++) {
      mbar_init(&pfull[i], 1);
      mbar_init(&pempty[i], 1);
    }
  }
  states_start(st_m, st_l, a.n_splits > 1);
  const uint64_t pol = l2_evict_first();
  /* tile t into stage b by threads lt < 128 of a group */
  auto issue = [&](int t, int b, int lt) {
    states_issue<ST, HALF, PAIR>(a, table, ctx, t, stage + (size_t)b * SSTAGE, &full[b], pol, lt);
  };
  /* two tiles at once, the third once the first has landed: requested
   * together, the first's bytes would share the start's DRAM queue with it
   * (docs/history/cuda-passes.md, pass 20) */
  constexpr int first = 2;
  if (tid < 128)
    for (int i = 0; i < first && t0 + i < t1; i++) issue(t0 + i, i, tid);
  td_pdl_start_if(a.late);
  const int q0 = a.q_start[s], npairs = (a.q_start[s + 1] - q0) * a.heads;
  auto out_at = [&](int r) -> bf16 * {
    const int p = g * 16 + r;
    return p < npairs ? a.out + ((size_t)(q0 + p / a.heads) * a.heads + p % a.heads) * D : nullptr;
  };
  float *mine = (float *)stage;
  if (sw) {
    /* scores and softmax: warp w sums over D columns [w KW, (w + 1) KW) */
    uint32_t qf[KW / 16][4];
    states_load_q<KW, D>(qf, a, g, q0, npairs, warp * KW);
    states_qscale(a, g, q0, npairs, st_q, 2);
    named_sync(1);
    const int sr = tid / 16, scol = (tid % 16) * 2; /* the softmax's row and two columns */
    const float rs = st_q[sr];
    for (int t = t0, u = 0; t < t1; t++, u++) {
      const int b = u % NSTG;
      const bf16 *E = stage + (size_t)b * SSTAGE;
      mbar_wait(&full[b], (unsigned)(u / NSTG) & 1u);
      const int nval = min(ST, ctx - t * ST);
      if (nval < ST) { /* (read by both groups) */
        states_zero_tail<ST, HALF, PAIR>((bf16 *)E, nval, tid, 256);
        named_sync(1);
      }
      states_scores<ST, KW, HALF, PAIR, RST>(E, qf, warp * KW, red + (size_t)warp * 16 * RST);
      named_sync(1);
      if (u >= 2) mbar_wait(&pempty[u & 1], (unsigned)((u >> 1) - 1) & 1u); /* the mix of tile u - 2 is done */
      {
        float v0 = 0.0f, v1 = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; w++) {
          const float2 f = *(const float2 *)&red[((size_t)w * 16 + sr) * RST + scol];
          v0 += f.x;
          v1 += f.y;
        }
        v0 = states_perm(scol) < nval ? v0 * rs : -INFINITY;
        v1 = states_perm(scol + 1) < nval ? v1 * rs : -INFINITY;
        float mx = fmaxf(v0, v1);
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float mo = st_m[sr], mn = fmaxf(mo, mx);
        v0 = mn == -INFINITY ? 0.0f : exp2f(v0 - mn);
        v1 = mn == -INFINITY ? 0.0f : exp2f(v1 - mn);
        *(uint32_t *)&ps[(u & 1) * PB + sr * (ST + 8) + scol] = pack_bf16(v0, v1);
        float sum = v0 + v1;
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (tid % 16 == 0) {
          const float al = mo == -INFINITY ? 0.0f : exp2f(mo - mn);
          st_a[(u & 1) * 16 + sr] = al;
          st_l[sr] = st_l[sr] * al + sum;
          st_m[sr] = mn;
        }
      }
      named_sync(1); /* the partials read, the probabilities written */
      if (tid == 0) mbar_arrive(&pfull[u & 1]);
    }
    block_sync(); /* every tile consumed; m, l final (the mix group meets it below) */
  } else {
    /* mix: warp 8 + w owns columns [w D / 8, (w + 1) D / 8), all in one plane */
    const int c0 = (warp - 8) * (D / 8);
    float acc[MT][4];
#pragma unroll
    for (int j = 0; j < MT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    states_mix_loop<ST, MT, HALF, PAIR, NSTG, first>(acc, stage, SSTAGE, t0, t1, ps, st_a, c0, full, pfull, pempty, issue);
    block_sync(); /* every tile consumed; m, l final */
    states_store<MT, L::PST>(acc, a.n_splits == 1, out_at, st_l, mine, c0);
  }
  if (a.n_splits == 1) return;
  states_merge<D, L::PST, 512>(mine, ml, st_m, st_l, a.n_splits, split, out_at);
}

template <int NT>
static void states_ws_launch(const td_cuda *c, dim3 grid, int cluster, const StatesArgs &a) {
  (void)td_launch_ex(c, cluster, -1, states_ws_kernel<NT>, grid, 512, StatesWsSmem<NT>::BYTES, a);
}

#define TD_STATES_WS(nt) \
  {nt, 16, true, false, StatesWsSmem<nt>::BYTES, (const void *)states_ws_kernel<nt>, states_ws_launch<nt>, 16},
const states_cfg td_states_ws_cfgs[STATES_N_WS] = {TD_STATES_WS(8) TD_STATES_WS(12) TD_STATES_WS(16)};
#undef TD_STATES_WS
