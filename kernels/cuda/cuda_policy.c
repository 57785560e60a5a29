#include "kernels/cuda/cuda_policy.h"

#include <stddef.h>

#include "common/defaults.h"

/* td_cuda_tuning's conventions: a switch 0 takes its default; a count 0
 * its default, below 0 (TD_OFF) none */
static bool on(int v, bool def) { return v == 0 ? def : v > 0; }
static int count(int v, int def) { return v == 0 ? def : v < 0 ? 0 : v; }

void td_cu_tune_resolve(const td_cuda_tuning *t, td_cu_tune *r) {
  r->verbose = on(t->verbose, false);
  r->autotune = on(t->autotune, false);
  r->pdl = on(t->pdl, true);
  r->pdl_late = t->pdl_late == 0 ? -1 : t->pdl_late < 0 ? 0 : t->pdl_late;
  r->skinny = on(t->skinny, true);
  r->skinny_bulk = on(t->skinny_bulk, true);
  r->weight_hint = on(t->weight_hint, true);
  int rows = count(t->skinny_rows, TD_CUDA_DEFAULT_SKINNY_ROWS);
  r->skinny_rows = rows < 8 ? 8 : rows > 16 ? 16 : rows;
  r->gemv_maxv = count(t->gemv_maxv, TD_CUDA_DEFAULT_GEMV_MAXV);
  r->gemv_maxn = count(t->gemv_maxn, TD_CUDA_DEFAULT_GEMV_MAXN);
  r->gemv_rows = r->gemv_maxv > 0 ? count(t->gemv_rows, TD_CUDA_DEFAULT_GEMV_ROWS) : 0;
  r->gemv_rows_n = count(t->gemv_rows_n, TD_CUDA_DEFAULT_GEMV_ROWS_N);
  int fuse = count(t->fuse_rows, TD_CUDA_DEFAULT_FUSE_ROWS);
  r->fuse = fuse > TD_CU_FUSE_MAX_ROWS ? TD_CU_FUSE_MAX_ROWS : fuse;
  r->fuse_mask = count(t->fuse_mask, TD_CUDA_DEFAULT_FUSE_MASK) & 15;
  r->dense64_warps = t->dense64_warps == 4 || t->dense64_warps == 8 ? t->dense64_warps : 0;
  r->decode_warp = count(t->decode_warp, TD_CUDA_DEFAULT_DECODE_WARP);
  r->decode_small = count(t->decode_small, TD_CUDA_DEFAULT_DECODE_SMALL);
  r->decode_small_min = count(t->decode_small_min, TD_CUDA_DEFAULT_DECODE_SMALL_MIN);
  r->decode_small_ctx = count(t->decode_small_ctx, TD_CUDA_DEFAULT_DECODE_SMALL_CTX);
  r->decode_bulk = count(t->decode_bulk, TD_CUDA_DEFAULT_DECODE_BULK);
  r->decode_bulk_all = count(t->decode_bulk_all, TD_CUDA_DEFAULT_DECODE_BULK_ALL);
  r->decode_bulk_shape = t->decode_bulk_shape > 0 ? t->decode_bulk_shape : 0;
  r->decode_bulk_early = count(t->decode_bulk_early, TD_CUDA_DEFAULT_DECODE_BULK_EARLY);
  int carve = t->decode_bulk_carve == 0 ? TD_CUDA_DEFAULT_DECODE_BULK_CARVE : t->decode_bulk_carve;
  r->decode_bulk_carve = carve > 100 ? 100 : carve < 0 ? -1 : carve;
  r->kvpf_seqs = count(t->kvpf_seqs, TD_CUDA_DEFAULT_KVPF_SEQS);
  r->states_generic = on(t->states_generic, false);
  r->states_ws = on(t->states_ws, true);
  r->states_planes = on(t->states_planes, true);
  r->states_splits = t->states_splits > 0 ? t->states_splits : 0;
  r->states_warps = t->states_warps == 8 || t->states_warps == 16 ? t->states_warps : 0;
  r->heads_lt = on(t->heads_lt, false);
  r->custom_allreduce = on(t->custom_allreduce, true);
}
