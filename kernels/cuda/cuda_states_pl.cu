/* attn_states with D split over a cluster of two (cuda_states.cuh). */
#include "kernels/cuda/cuda_states.cuh"

/* The same two groups with D split instead of the keys: a cluster of two
 * blocks a group of 16 pairs, block p holding pool plane p (columns
 * [p D / 2, (p + 1) D / 2)) of every state, so that both blocks stream
 * the whole key range and no partial sums are merged. A tile is 64 states
 * of one plane (the bytes of cuda_states_ws.cu's 32 of both); warps 0-7
 * take its partial scores (two halves of the states by four quarters of
 * the plane), sum them, and exchange the 16 x 64 sums with the other
 * block by st.async, so that both add the same two numbers and agree on
 * the softmax bit for bit; warps 8-15 mix the tile before over their
 * eighth of the plane, and each block writes its half of the columns. */
template <int NT>
struct StatesPlSmem {
  static constexpr int ST = 64, NSTG = 3, D = NT * 64, HALF = D / 2, PAIR = 2 * HALF + 8, RST = ST + 8;
  static constexpr size_t STAGE = (ST / 2) * (size_t)PAIR * 2; /* one plane: [ST / 2][PAIR] bf16 */
  static constexpr size_t RED = 4 * 16 * (size_t)RST * 4;      /* [quarter][16][RST] fp32 */
  static constexpr size_t P = 2 * 16 * (ST + 8) * 2;            /* two buffers */
  static constexpr size_t XB = 2 * 16 * (size_t)ST * 4;         /* the other plane's sums, two buffers */
  static constexpr size_t STATS = (16 + 16 + 32 + 16) * 4;      /* m, l, alpha [2][16], query scale */
  static constexpr size_t BARS = (NSTG + 6) * 8;                /* full[NSTG], pfull[2], pempty[2], xfull[2] */
  static constexpr size_t BYTES = NSTG * STAGE + RED + P + XB + STATS + BARS;
};

template <int NT>
__global__ void __maxnreg__(120) states_pl_kernel(const StatesArgs a) {
  using L = StatesPlSmem<NT>;
  constexpr int ST = L::ST, NSTG = L::NSTG, HALF = L::HALF, PAIR = L::PAIR, RST = L::RST;
  constexpr int KW = HALF / 4, MT = HALF / 8 / 8, PB = 16 * (ST + 8);
  static_assert(KW % 16 == 0 && MT >= 1, "plane width");
  extern __shared__ __align__(128) unsigned char smem[];
  bf16 *stage = (bf16 *)smem;
  float *red = (float *)(smem + NSTG * L::STAGE);
  bf16 *ps = (bf16 *)((char *)red + L::RED);
  float *xb = (float *)((char *)ps + L::P);
  float *st_m = (float *)((char *)xb + L::XB), *st_l = st_m + 16, *st_a = st_l + 16, *st_q = st_a + 32;
  uint64_t *full = (uint64_t *)(st_q + 16), *pfull = full + NSTG, *pempty = pfull + 2, *xfull = pempty + 2;
  const int warp = threadIdx.x >> 5, tid = threadIdx.x;
  const bool sw = warp < 8;
  const int sg = (int)blockIdx.x >> 1, plane = (int)blockIdx.x & 1, s = sg / a.groups, g = sg % a.groups;
  const int ctx = a.ctx_len[s], t1 = (ctx + ST - 1) / ST;
  const int32_t *table = a.block_table + (size_t)s * a.max_blocks;
  states_plane_bars<NSTG>(full, pfull, pempty, xfull);
  states_start(st_m, st_l, true); /* the other block's barriers are ready once its arrival completes */
  const uint64_t pol = l2_evict_first();
  auto issue = [&](int t, int b, int lt) {
    states_issue<ST, HALF, PAIR, 1>(a, table, ctx, t, stage + (size_t)b * (L::STAGE / 2), &full[b], pol, lt, plane);
  };
  constexpr int first = 2; /* the third once the first has landed (see states_ws_kernel) */
  if (tid < 128)
    for (int i = 0; i < first && i < t1; i++) issue(i, i, tid);
  td_pdl_start_if(a.late);
  const int q0 = a.q_start[s], npairs = (a.q_start[s + 1] - q0) * a.heads;
  if (sw) {
    /* warp w: states [32 (w & 1), +32) of a tile over plane columns [KW (w >> 1), +KW) */
    const int sh = warp & 1, qt = warp >> 1;
    uint32_t qf[KW / 16][4];
    states_load_q<KW, L::D>(qf, a, g, q0, npairs, plane * HALF + qt * KW);
    states_qscale(a, g, q0, npairs, st_q, 2);
    named_sync(1);
    const int sr = tid / 16, scol = (tid % 16) * 4; /* the softmax's row and four columns */
    const float rs = st_q[sr];
    const uint32_t rxb = dsmem_map(xb + sr * ST + scol, (unsigned)(plane ^ 1));
    const uint32_t rxf = dsmem_map(xfull, (unsigned)(plane ^ 1));
    cluster_wait();
    for (int t = 0, u = 0; t < t1; t++, u++) {
      const int b = u % NSTG, x = u & 1;
      bf16 *E = stage + (size_t)b * (L::STAGE / 2);
      const int nval = min(ST, ctx - t * ST);
      states_plane_tile<ST, HALF, PAIR, NSTG>(full, b, u, E, nval);
      states_scores<32, KW, HALF, PAIR, RST>(E + (size_t)sh * 16 * PAIR, qf, qt * KW,
                                             red + (size_t)qt * 16 * RST + sh * 32);
      named_sync(1);
      const float4 v = states_quarter_sum<16, RST>(red, sr, scol);
      st_async16(rxb + (uint32_t)(x * 16 * ST * 4), v, rxf + (uint32_t)(x * 8));
      if (tid == 0) mbar_arrive_tx(&xfull[x], 16 * ST * 4);
      if (u >= 2) mbar_wait(&pempty[x], (unsigned)((u >> 1) - 1) & 1u); /* the mix of tile u - 2 is done */
      mbar_wait_cluster(&xfull[x], (unsigned)(u >> 1) & 1u);
      states_plane_softmax<16>(v, *(const float4 *)&xb[x * 16 * ST + sr * ST + scol], rs, scol, nval, &st_m[sr],
                               &st_l[sr], &st_a[x * 16 + sr], &ps[x * PB + sr * (ST + 8) + scol]);
      named_sync(1); /* the partials and the other block's sums read, the probabilities written */
      if (tid == 0) mbar_arrive(&pfull[x]);
    }
    block_sync(); /* every tile consumed; l final */
  } else {
    /* mix: warp 8 + w owns plane columns [w HALF / 8, (w + 1) HALF / 8) */
    const int c0 = (warp - 8) * (HALF / 8);
    float acc[MT][4];
#pragma unroll
    for (int j = 0; j < MT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    states_mix_loop<ST, MT, HALF, PAIR, NSTG, first>(acc, stage, L::STAGE / 2, 0, t1, ps, st_a, c0, full, pfull, pempty,
                                                   issue);
    cluster_wait(); /* (completed long ago: pairs this group's arrival) */
    block_sync();
    auto out_at = [&](int r) -> bf16 * {
      const int p = g * 16 + r;
      return p < npairs ? a.out + ((size_t)(q0 + p / a.heads) * a.heads + p % a.heads) * L::D + plane * HALF
                        : nullptr;
    };
    states_store<MT, 0>(acc, true, out_at, st_l, nullptr, c0);
  }
}


template <int NT>
static void states_pl_launch(const td_cuda *c, dim3 grid, int cluster, const StatesArgs &a) {
  (void)td_launch_ex(c, cluster, -1, states_pl_kernel<NT>, grid, 512, StatesPlSmem<NT>::BYTES, a);
}

#define TD_STATES_PL(nt) \
  {nt, 16, true, true, StatesPlSmem<nt>::BYTES, (const void *)states_pl_kernel<nt>, states_pl_launch<nt>, 16},
const states_cfg td_states_pl_cfgs[STATES_N_PL] = {TD_STATES_PL(8) TD_STATES_PL(12) TD_STATES_PL(16)};
#undef TD_STATES_PL
