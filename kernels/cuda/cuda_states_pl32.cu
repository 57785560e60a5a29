/* attn_states for groups of 32 pairs, D split over a cluster of two (cuda_states.cuh). */
#include "kernels/cuda/cuda_states.cuh"

/* A decode row of Whisper-large is 20 (row, head) pairs. As two groups of
 * 16 (the other kernels' MMA row tile), each group's block streamed all of
 * the sequence's states: twice the bytes, as many as the per-layer K/V.
 * Here a group is 32 pairs (two row tiles), so a sequence's states are
 * read once. 32 rows of D accumulators fit in registers only with D split:
 * a cluster of two blocks a group, block p holding pool plane p (columns
 * [p D / 2, (p + 1) D / 2)) of every state, as states_pl_kernel does for
 * 16 pairs. A tile is 32 states of one plane; warps 0-7 take its partial
 * scores (warp w: row tile w & 1 over plane quarter w >> 1), sum the
 * quarters, and exchange the 32 x 32 sums with the other block by
 * st.async, so that both add the same two numbers and agree on the softmax
 * bit for bit; warps 8-15 mix the tile before over their eighth of the
 * plane, both row tiles, and each block writes its half of the columns. */
template <int NT>
struct StatesPl32Smem {
  static constexpr int R = 32, ST = 32, NSTG = 4, D = NT * 64, HALF = D / 2, PAIR = 2 * HALF + 8, RST = ST + 8;
  static constexpr size_t STAGE = (ST / 2) * (size_t)PAIR * 2; /* one plane: [ST / 2][PAIR] bf16 */
  static constexpr size_t RED = 4 * R * (size_t)RST * 4;       /* [quarter][R][RST] fp32 */
  static constexpr size_t P = 2 * R * (ST + 8) * 2;            /* two buffers */
  static constexpr size_t XB = 2 * R * (size_t)ST * 4;          /* the other plane's sums, two buffers */
  static constexpr size_t STATS = (R + R + 2 * R + R) * 4;      /* m, l, alpha [2][R], query scale */
  static constexpr size_t BARS = (NSTG + 6) * 8;                /* full[NSTG], pfull[2], pempty[2], xfull[2] */
  static constexpr size_t BYTES = NSTG * STAGE + RED + P + XB + STATS + BARS;
  static_assert((NSTG * STAGE + RED + P) % 16 == 0 && (NSTG * STAGE + RED + P + XB + STATS) % 8 == 0, "alignment");
};

template <int NT>
__global__ void __launch_bounds__(512, 1) states_pl32_kernel(const StatesArgs a) {
  using L = StatesPl32Smem<NT>;
  constexpr int R = L::R, ST = L::ST, NSTG = L::NSTG, HALF = L::HALF, PAIR = L::PAIR, RST = L::RST;
  constexpr int KW = HALF / 4, MT = HALF / 8 / 8, PB = R * (ST + 8);
  static_assert(KW % 16 == 0 && MT >= 2, "plane width");
  extern __shared__ __align__(128) unsigned char smem[];
  bf16 *stage = (bf16 *)smem;
  float *red = (float *)(smem + NSTG * L::STAGE);
  bf16 *ps = (bf16 *)((char *)red + L::RED);
  float *xb = (float *)((char *)ps + L::P);
  float *st_m = (float *)((char *)xb + L::XB), *st_l = st_m + R, *st_a = st_l + R, *st_q = st_a + 2 * R;
  uint64_t *full = (uint64_t *)(st_q + R), *pfull = full + NSTG, *pempty = pfull + 2, *xfull = pempty + 2;
  const int warp = threadIdx.x >> 5, tid = threadIdx.x;
  const bool sw = warp < 8;
  const int sg = (int)blockIdx.x >> 1, plane = (int)blockIdx.x & 1, s = sg / a.groups, g = sg % a.groups;
  const int ctx = a.ctx_len[s], t1 = (ctx + ST - 1) / ST;
  const int32_t *table = a.block_table + (size_t)s * a.max_blocks;
  states_plane_bars<NSTG>(full, pfull, pempty, xfull);
  states_start(st_m, st_l, true, R); /* the other block's barriers are ready once its arrival completes */
  const uint64_t pol = l2_evict_first();
  auto issue = [&](int t, int b, int lt) {
    states_issue<ST, HALF, PAIR, 1>(a, table, ctx, t, stage + (size_t)b * (L::STAGE / 2), &full[b], pol, lt, plane);
  };
  constexpr int first = 2; /* the rest once the first has landed (see states_ws_kernel) */
  if (tid < 128)
    for (int i = 0; i < first && i < t1; i++) issue(i, i, tid);
  td_pdl_start_if(a.late);
  const int q0 = a.q_start[s], npairs = (a.q_start[s + 1] - q0) * a.heads;
  if (sw) {
    /* warp w: row tile w & 1 (pairs 32 g + 16 (w & 1) + [0, 16)) over plane columns [KW (w >> 1), +KW) */
    const int mt = warp & 1, qt = warp >> 1;
    uint32_t qf[KW / 16][4];
    states_load_q<KW, L::D>(qf, a, 2 * g + mt, q0, npairs, plane * HALF + qt * KW);
    states_qscale(a, 2 * g, q0, npairs, st_q, R / 8);
    named_sync(1);
    const int sr = tid / 8, scol = (tid % 8) * 4; /* the softmax's row and four columns */
    const float rs = st_q[sr];
    const uint32_t rxb = dsmem_map(xb + sr * ST + scol, (unsigned)(plane ^ 1));
    const uint32_t rxf = dsmem_map(xfull, (unsigned)(plane ^ 1));
    cluster_wait();
    for (int t = 0, u = 0; t < t1; t++, u++) {
      const int b = u % NSTG, x = u & 1;
      bf16 *E = stage + (size_t)b * (L::STAGE / 2);
      const int nval = min(ST, ctx - t * ST);
      states_plane_tile<ST, HALF, PAIR, NSTG>(full, b, u, E, nval);
      states_scores<ST, KW, HALF, PAIR, RST>(E, qf, qt * KW, red + ((size_t)qt * R + mt * 16) * RST);
      named_sync(1);
      const float4 v = states_quarter_sum<R, RST>(red, sr, scol);
      st_async16(rxb + (uint32_t)(x * R * ST * 4), v, rxf + (uint32_t)(x * 8));
      if (tid == 0) mbar_arrive_tx(&xfull[x], R * ST * 4);
      if (u >= 2) mbar_wait(&pempty[x], (unsigned)((u >> 1) - 1) & 1u); /* the mix of tile u - 2 is done */
      mbar_wait_cluster(&xfull[x], (unsigned)(u >> 1) & 1u);
      states_plane_softmax<8>(v, *(const float4 *)&xb[x * R * ST + sr * ST + scol], rs, scol, nval, &st_m[sr],
                              &st_l[sr], &st_a[x * R + sr], &ps[x * PB + sr * (ST + 8) + scol]);
      named_sync(1); /* the partials and the other block's sums read, the probabilities written */
      if (tid == 0) mbar_arrive(&pfull[x]);
    }
    block_sync(); /* every tile consumed; l final */
  } else {
    /* mix: warp 8 + w owns plane columns [w HALF / 8, (w + 1) HALF / 8), both row tiles */
    const int c0 = (warp - 8) * (HALF / 8);
    float acc0[MT][4], acc1[MT][4];
#pragma unroll
    for (int j = 0; j < MT; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) acc0[j][e] = acc1[j][e] = 0.0f;
    if (first < t1 && tid - 256 < 128) {
      mbar_wait(&full[0], 0u);
      for (int i = first; i < NSTG && i < t1; i++) issue(i, i, tid - 256);
    }
    for (int t = 0, u = 0; t < t1; t++, u++) {
      const int b = u % NSTG, x = u & 1;
      const bf16 *E = stage + (size_t)b * (L::STAGE / 2);
      mbar_wait(&pfull[x], (unsigned)(u >> 1) & 1u);
      states_mix<ST, MT, HALF, PAIR>(acc0, E, ps + x * PB, st_a + x * R, c0);
      states_mix<ST, MT, HALF, PAIR>(acc1, E, ps + x * PB + 16 * (ST + 8), st_a + x * R + 16, c0);
      named_sync(2); /* the group is done with the stage and the probabilities */
      if (tid == 256) mbar_arrive(&pempty[x]);
      if (t + NSTG < t1 && tid - 256 < 128) {
        fence_proxy_async();
        issue(t + NSTG, b, tid - 256);
      }
    }
    cluster_wait(); /* (completed long ago: pairs this group's arrival) */
    block_sync();
    auto out_at = [&](int r) -> bf16 * {
      const int p = g * R + r;
      return p < npairs ? a.out + ((size_t)(q0 + p / a.heads) * a.heads + p % a.heads) * L::D + plane * HALF
                        : nullptr;
    };
    auto out_at1 = [&](int r) -> bf16 * { return out_at(16 + r); };
    states_store<MT, 0>(acc0, true, out_at, st_l, nullptr, c0);
    states_store<MT, 0>(acc1, true, out_at1, st_l + 16, nullptr, c0);
  }
}

template <int NT>
static void states_pl32_launch(const td_cuda *c, dim3 grid, int cluster, const StatesArgs &a) {
  (void)td_launch_ex(c, cluster, -1, states_pl32_kernel<NT>, grid, 512, StatesPl32Smem<NT>::BYTES, a);
}

#define TD_STATES_PL32(nt) \
  {nt, 16, false, true, StatesPl32Smem<nt>::BYTES, (const void *)states_pl32_kernel<nt>, states_pl32_launch<nt>, 32},
const states_cfg td_states_pl32_cfgs[STATES_N_PL32] = {TD_STATES_PL32(20)};
#undef TD_STATES_PL32
