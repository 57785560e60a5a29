#include "common/settings.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "common/defaults.h"
#include "common/log.h"

static const char *env(const char *name) {
  const char *v = getenv(name);
  return v && *v ? v : NULL;
}

/* on|off|1|0|yes|no|true|false */
static td_status env_switch(const char *name, int *out) {
  const char *v = env(name);
  if (!v) return TD_OK;
  static const char *const on[] = {"1", "on", "yes", "true"}, *const off[] = {"0", "off", "no", "false"};
  for (int i = 0; i < 4; i++) {
    if (!strcasecmp(v, on[i])) return *out = TD_ON, TD_OK;
    if (!strcasecmp(v, off[i])) return *out = TD_OFF, TD_OK;
  }
  return td_err(TD_ERR_INVALID, "%s=%s: on or off", name, v);
}

/* Up to n comma-separated integers of one variable (*got: how many). */
static td_status env_ints(const char *name, int n, int *vals, int *got) {
  *got = 0;
  const char *v = env(name);
  if (!v) return TD_OK;
  for (const char *p = v; *got < n; p++) {
    char *end;
    long x = strtol(p, &end, 10);
    if (end == p || (*end && *end != ',') || x < INT_MIN || x > INT_MAX) break;
    vals[(*got)++] = (int)x;
    if (!*end) return TD_OK;
    p = end;
  }
  return td_err(TD_ERR_INVALID, "%s=%s: %s", name, v, n > 1 ? "integers separated by commas" : "an integer");
}

/* A count or size as td_cuda_tuning holds it: 0 or less is none (TD_OFF). */
static int cuda_count(int v) { return v > 0 ? v : TD_OFF; }

/* A variable of up to four counts, into f0.. (NULL past its last field). */
static td_status cuda_counts(const char *name, int *f0, int *f1, int *f2, int *f3) {
  int *f[4] = {f0, f1, f2, f3}, n = 0, vals[4], got;
  while (n < 4 && f[n]) n++;
  TD_TRY(env_ints(name, n, vals, &got));
  for (int i = 0; i < got; i++) *f[i] = cuda_count(vals[i]);
  return TD_OK;
}

/* A mask of flags 1, 2, 4, 8 (0: none, TD_OFF). */
static td_status cuda_mask(const char *name, int v, int *out) {
  if (v < 0 || v > 15) return td_err(TD_ERR_INVALID, "%s: mask %d (0-15)", name, v);
  *out = v ? v : TD_OFF;
  return TD_OK;
}

static td_status cuda_from_env(td_cuda_tuning *c) {
  TD_TRY(env_switch("TANDEM_CUDA_VERBOSE", &c->verbose));
  TD_TRY(env_switch("TANDEM_CUDA_AUTOTUNE", &c->autotune));
  TD_TRY(cuda_counts("TANDEM_CUDA_AUTOTUNE_MIN", &c->autotune_min, NULL, NULL, NULL));
  TD_TRY(env_switch("TANDEM_CUDA_PDL", &c->pdl));
  int v[4], got;
  TD_TRY(env_ints("TANDEM_CUDA_PDL_LATE", 1, v, &got));
  if (got) TD_TRY(cuda_mask("TANDEM_CUDA_PDL_LATE", v[0], &c->pdl_late));
  TD_TRY(env_switch("TANDEM_CUDA_SKINNY", &c->skinny));
  TD_TRY(cuda_counts("TANDEM_CUDA_SKINNY_ROWS", &c->skinny_rows, NULL, NULL, NULL));
  TD_TRY(env_switch("TANDEM_CUDA_SKINNY_BULK", &c->skinny_bulk));
  TD_TRY(env_switch("TANDEM_CUDA_WEIGHT_HINT", &c->weight_hint));
  TD_TRY(cuda_counts("TANDEM_CUDA_GEMV", &c->gemv_maxv, &c->gemv_maxn, &c->gemv_rows, &c->gemv_rows_n));
  TD_TRY(env_ints("TANDEM_CUDA_FUSE", 2, v, &got));
  if (got) c->fuse_rows = cuda_count(v[0]);
  if (got > 1) TD_TRY(cuda_mask("TANDEM_CUDA_FUSE", v[1], &c->fuse_mask));
  TD_TRY(env_ints("TANDEM_CUDA_DENSE64", 2, v, &got));
  if (got && (v[0] < 0 || v[0] > 5) && v[0] != 8)
    return td_err(TD_ERR_INVALID,
                  "TANDEM_CUDA_DENSE64=%d: 0 (by the grid), 1 or 2 (pipelined wgmma, two or one block an SM), 5 "
                  "(the same, the keys in two halves), 3 (wgmma), 4 or 8 warps (mma.sync)",
                  v[0]);
  if (got > 1 && (v[0] != 0 || (v[1] != 2 && v[1] != 5)))
    return td_err(TD_ERR_INVALID,
                  "TANDEM_CUDA_DENSE64=%d,%d: a second value is the grid rule's kernel for one wave, 2 (one block an "
                  "SM) or 5 (the keys in two halves), after 0",
                  v[0], v[1]);
  if (got) c->dense64_warps = v[0];
  if (got > 1) c->dense64_wave = v[1];
  TD_TRY(env_ints("TANDEM_CUDA_DENSE_SPLITS", 1, v, &got));
  if (got && (v[0] < 0 || v[0] > 8)) return td_err(TD_ERR_INVALID, "TANDEM_CUDA_DENSE_SPLITS=%d: 0 to 8", v[0]);
  if (got) c->dense_splits = v[0];
  TD_TRY(cuda_counts("TANDEM_CUDA_DECATTN", &c->decode_warp, NULL, NULL, NULL));
  TD_TRY(cuda_counts("TANDEM_CUDA_DECATTN_SMALL", &c->decode_small, &c->decode_small_min, &c->decode_small_ctx, NULL));
  TD_TRY(env_ints("TANDEM_CUDA_DECATTN_BULK", 4, v, &got));
  if (got > 2 && (v[2] < 0 || v[2] > 3))
    return td_err(TD_ERR_INVALID, "TANDEM_CUDA_DECATTN_BULK: shape %d (0 by the pairs, 1, 2 or 3)", v[2]);
  int *bulk[4] = {&c->decode_bulk, &c->decode_bulk_all, &c->decode_bulk_shape, &c->decode_bulk_early};
  for (int i = 0; i < got; i++) *bulk[i] = i == 2 ? v[i] : cuda_count(v[i]);
  /* a share of 0 % is the smallest carveout, as 1 % is; below 0: no preference */
  TD_TRY(env_ints("TANDEM_CUDA_DECATTN_CARVE", 1, v, &got));
  if (got) c->decode_bulk_carve = v[0] < 0 ? TD_OFF : v[0] == 0 ? 1 : v[0];
  TD_TRY(cuda_counts("TANDEM_CUDA_KVPF", &c->kvpf_seqs, &c->kvpf_mb, NULL, NULL));
  TD_TRY(env_switch("TANDEM_CUDA_STATES_GENERIC", &c->states_generic));
  TD_TRY(env_ints("TANDEM_CUDA_STATES_SPLITS", 1, v, &got));
  if (got) c->states_splits = v[0] < 1 ? 1 : v[0]; /* 0: one split, as 1 */
  TD_TRY(env_ints("TANDEM_CUDA_STATES_WARPS", 1, v, &got));
  if (got && v[0] != 8 && v[0] != 16) return td_err(TD_ERR_INVALID, "TANDEM_CUDA_STATES_WARPS=%d: 8 or 16", v[0]);
  if (got) c->states_warps = v[0];
  TD_TRY(env_switch("TANDEM_CUDA_STATES_WS", &c->states_ws));
  TD_TRY(env_switch("TANDEM_CUDA_STATES_PLANES", &c->states_planes));
  TD_TRY(env_switch("TANDEM_CUDA_STATES_WAVES", &c->states_waves));
  TD_TRY(env_switch("TANDEM_CUDA_STATES_PL32", &c->states_pl32));
  TD_TRY(env_switch("TANDEM_CUDA_HEADS_LT", &c->heads_lt));
  TD_TRY(env_switch("TANDEM_CUDA_PLAN_BUCKET", &c->plan_bucket));
  TD_TRY(env_switch("TANDEM_CUDA_FUSE_ALLREDUCE", &c->fuse_allreduce));
  TD_TRY(env_switch("TANDEM_CUDA_CUSTOM_ALLGATHER", &c->custom_allgather));
  return env_switch("TANDEM_CUDA_CUSTOM_ALLREDUCE", &c->custom_allreduce);
}

td_status td_settings_from_env(td_settings *s) {
  memset(s, 0, sizeof *s);
  s->log_level = -1;
  const char *lv = env("TANDEM_LOG");
  if (lv && (s->log_level = td_log_parse_level(lv)) < 0)
    return td_err(TD_ERR_INVALID, "TANDEM_LOG=%s: debug, info, warn, error or off", lv);
  s->log_format = -1;
  const char *lf = env("TANDEM_LOG_FORMAT");
  if (lf && (s->log_format = td_log_parse_format(lf)) < 0)
    return td_err(TD_ERR_INVALID, "TANDEM_LOG_FORMAT=%s: text or json", lf);
  TD_TRY(env_switch("TANDEM_MALLOC_KEEP", &s->malloc_keep));
  TD_TRY(cuda_from_env(&s->cuda));
  /* model */
  TD_TRY(env_switch("TANDEM_NORM_FOLD", &s->model.norm_fold));
  TD_TRY(env_switch("TANDEM_ENC_GRAPHS", &s->model.enc_graphs));
  TD_TRY(env_switch("TANDEM_CKV_BATCH", &s->model.ckv_batch));
  int rows, got;
  TD_TRY(env_ints("TANDEM_QNORM_ROWS", 1, &rows, &got));
  if (got) s->model.qnorm_rows = rows > 0 ? rows : -1; /* 0 rows: never fused */
  /* kvtransfer */
  TD_TRY(env_switch("TANDEM_KVX_LOCAL", &s->kvx.local_path));
  TD_TRY(env_switch("TANDEM_KVX_IPC", &s->kvx.ipc));
  int trace = 0;
  TD_TRY(env_switch("TANDEM_KVX_TRACE", &trace));
  s->kvx.trace = trace == TD_ON;
  const char *tls = env("UCX_TLS");
  if (tls && strlen(tls) >= sizeof s->kvx.ucx_tls)
    return td_err(TD_ERR_INVALID, "UCX_TLS of %zu bytes: at most %zu", strlen(tls), sizeof s->kvx.ucx_tls - 1);
  if (tls) snprintf(s->kvx.ucx_tls, sizeof s->kvx.ucx_tls, "%s", tls);
  const char *nd = env("UCX_NET_DEVICES");
  if (nd && strlen(nd) >= sizeof s->kvx.ucx_net_devices)
    return td_err(TD_ERR_INVALID, "UCX_NET_DEVICES of %zu bytes: at most %zu", strlen(nd),
                  sizeof s->kvx.ucx_net_devices - 1);
  if (nd) snprintf(s->kvx.ucx_net_devices, sizeof s->kvx.ucx_net_devices, "%s", nd);
  return TD_OK;
}

void td_settings_apply(const td_settings *s) {
  if (s->log_level >= 0) td_log_set_level((td_log_level)s->log_level);
  if (s->log_format >= 0) td_log_set_format((td_log_format)s->log_format);
#ifdef __GLIBC__
  /* Each large free would otherwise unmap (or trim) and the next malloc map
   * again: on the router, 1.8 ms of faults and zeroing a Whisper request
   * against 0.5 ms with the heap kept (bench-router --audio). */
  if (s->malloc_keep != TD_OFF) {
    mallopt(M_MMAP_THRESHOLD, TD_MALLOC_KEEP_MAX);
    mallopt(M_TRIM_THRESHOLD, TD_MALLOC_KEEP_TRIM);
  }
#endif
}
