/* Settings read from the environment: the one place below main() that
 * calls getenv. Each program's main() fills a td_settings once
 * (td_settings_from_env), lets its flags override it, and passes the
 * parts down inside the options of what it creates (td_backend_opts,
 * td_model_opts, td_kvx_opts, ...). Libraries never read the environment;
 * tests select variants by filling these structs.
 *
 * Every field's zero value means "the measured default". */
#ifndef TD_COMMON_SETTINGS_H
#define TD_COMMON_SETTINGS_H

#include <stdbool.h>

#include "common/status.h"

/* A switch that defaults one way: 0 the default, TD_ON / TD_OFF forced. */
#define TD_ON 1
#define TD_OFF (-1)

/* CUDA backend tuning (kernels/cuda, docs/cuda.md): which kernel variant an
 * op takes and where the measured switches sit, TANDEM_CUDA_* variables.
 * Switches are TD_ON / TD_OFF; counts, sizes and masks are 0 for the
 * default (common/defaults.h), TD_OFF for none (the variable set to 0),
 * else the value. The backend takes them when it is created. */
typedef struct td_cuda_tuning {
  int verbose;  /* TANDEM_CUDA_VERBOSE: print GEMM plan choices (default off) */
  int autotune; /* TANDEM_CUDA_AUTOTUNE: time cuBLASLt's candidates for large GEMMs (default off) */
  int autotune_min; /* TANDEM_CUDA_AUTOTUNE_MIN=N: ... for GEMMs of m*n*k >= N million (default 10000) */
  int pdl;      /* TANDEM_CUDA_PDL: programmatic dependent launch (default on) */
  int pdl_late; /* TANDEM_CUDA_PDL_LATE=MASK: kernels that trigger the next launch after their wait: 1 decode
                   attention, 2 every skinny GEMM, 4 the normed ones, 8 the others (0: the default policy) */
  /* GEMMs */
  int skinny;      /* TANDEM_CUDA_SKINNY: few-row GEMMs on the skinny kernel (TD_OFF: cuBLASLt) */
  int skinny_rows; /* TANDEM_CUDA_SKINNY_ROWS: ... beyond 8 rows up to this many (8-16) where W has <= 2048 rows */
  int skinny_bulk; /* TANDEM_CUDA_SKINNY_BULK: its W by bulk copies where it fits (TD_OFF: the cp.async ring) */
  int weight_hint; /* TANDEM_CUDA_WEIGHT_HINT: skinny GEMM weights read with an L2 evict-first policy */
  /* TANDEM_CUDA_GEMV=MAXV[,MAXN[,ROWS[,ROWSN]]]: one-row GEMMs on a warp an output column for k up to 256
   * MAXV (4 or 8; TD_OFF: the warp kernel off) and up to MAXN columns; 2 to ROWS (<= 4) rows for k <= 1024
   * and up to ROWSN columns, no GLU */
  int gemv_maxv, gemv_maxn, gemv_rows, gemv_rows_n;
  /* TANDEM_CUDA_FUSE=ROWS[,MASK]: td_gemm_ex on the fused decode kernel up to ROWS (<= 16; TD_OFF: never)
   * rows, fusing what MASK names: 1 the norm, 2 GLU, 4 the KV write; 8: beyond ROWS, a plain RMSNorm
   * applied after the GEMM */
  int fuse_rows, fuse_mask;
  /* attention */
  int dense64_warps; /* TANDEM_CUDA_DENSE64: dense attention at head_dim 64 on wgmma with a tile's softmax
                        beside the previous tile's P.V (0: one block an SM where the grid fits in one wave,
                        else two; 1: two; 2: one; 5: a block's keys in two halves on 16 warps), on wgmma
                        unpipelined (3), or on mma.sync with 8 warps (128 query rows a block) or 4 (64 rows) */
  int dense64_wave;  /* TANDEM_CUDA_DENSE64=0,W: the grid rule's kernel where the grid fits in one wave of one
                        block an SM: 2 (one block of 8 warps) or 5 (the keys in two halves); 0: the default */
  int dense_splits;  /* TANDEM_CUDA_DENSE_SPLITS=N: dense attention's keys in N splits a query tile, merged
                        (0 or 1: none) */
  int decode_warp;   /* TANDEM_CUDA_DECATTN=N: paged decode over self K/V on warps from N (sequence, head)
                        pairs (TD_OFF: the decode kernels off) */
  /* TANDEM_CUDA_DECATTN_SMALL=N[,MIN[,CTX]]: fewer pairs than that: 2-8 warps a pair by context (<= 256
   * keys), 16 for longer contexts up to N pairs (TD_OFF: the tiled kernel), from MIN pairs, contexts up to
   * CTX */
  int decode_small, decode_small_min, decode_small_ctx;
  /* TANDEM_CUDA_DECATTN_BULK=MIN[,ALL[,SHAPE[,EARLY]]]: decode attention fed by bulk copies over static K/V
   * from MIN pairs (TD_OFF: off), over self K/V up to ALL pairs, in block shape SHAPE (0: by the pair
   * count; 1 four warps x 2 slots, 2 two x 2, 3 two x 3), the self K/V's past keys copied before the wait
   * up to EARLY pairs */
  int decode_bulk, decode_bulk_all, decode_bulk_shape, decode_bulk_early;
  int decode_bulk_carve; /* TANDEM_CUDA_DECATTN_CARVE=PCT: its preferred shared-memory share of L1, in percent
                            (TD_OFF: no preference) */
  int kvpf_seqs;         /* TANDEM_CUDA_KVPF=N[,MB]: td_kv_prefetch from N sequences (TD_OFF: never) */
  int kvpf_mb;           /* ... while a layer's self K/V is at most MB megabytes (unset: a quarter of L2; TD_OFF: any) */
  /* attention over encoder states, per-head products */
  int states_generic; /* TANDEM_CUDA_STATES_GENERIC: the generic kernel always (default off) */
  int states_splits;  /* TANDEM_CUDA_STATES_SPLITS=N: key splits, the largest power of two up to N (0: the
                         policy's) */
  int states_warps;   /* TANDEM_CUDA_STATES_WARPS: 8 or 16 warps a block (0: the policy's) */
  int states_ws;      /* TANDEM_CUDA_STATES_WS: the warp-specialised kernel for 16 warps (default on) */
  int states_planes;  /* TANDEM_CUDA_STATES_PLANES: two key splits as a split of D (default on) */
  int states_waves;   /* TANDEM_CUDA_STATES_WAVES: past one wave, 16-warp blocks or plane pairs by whole waves
                         (default on; off: 8-warp blocks) */
  int states_pl32;    /* TANDEM_CUDA_STATES_PL32: more than 16 pairs a sequence in groups of 32 (default on) */
  int heads_lt;       /* TANDEM_CUDA_HEADS_LT: td_gemm_heads on cuBLASLt always (default off) */
  /* collectives */
  int custom_allreduce; /* TANDEM_CUDA_CUSTOM_ALLREDUCE: the one-shot all-reduce over peer memory (default on) */
  int fuse_allreduce;   /* TANDEM_CUDA_FUSE_ALLREDUCE: a row-parallel GEMM of a few rows ends in that all-reduce
                           (td_gemm_allreduce; default on) */
  int custom_allgather; /* TANDEM_CUDA_CUSTOM_ALLGATHER: td_allgather of 4-byte words (the logits of a
                           vocabulary split) over the same peer memory (default on) */
  int plan_bucket; /* TANDEM_CUDA_PLAN_BUCKET: cuBLASLt plans of GEMMs over 64 rows keyed by the row count rounded
                      up to an eighth of its power of two, not the exact count (default on) */
} td_cuda_tuning;

/* Model graph choices (model/). */
typedef struct td_model_tuning {
  int norm_fold;  /* TANDEM_NORM_FOLD: fold decoder pre-norm weights into the next GEMM (TD_OFF: keep apart) */
  int qnorm_rows; /* TANDEM_QNORM_ROWS: rows up to which the query norm is fused (0: the backend's; -1: never) */
  int enc_graphs; /* TANDEM_ENC_GRAPHS: one text input encoded as its bucket's CUDA graph (TD_OFF: eagerly) */
  int ckv_batch;  /* TANDEM_CKV_BATCH: the cross K/V of several layers in one GEMM where the rows are few (TD_OFF: a
                     GEMM a layer) */
} td_model_tuning;

/* KV transfer (kvtransfer/). */
typedef struct td_kvx_tuning {
  int local_path;      /* TANDEM_KVX_LOCAL (on|off): same-host data endpoint (TD_OFF: never) */
  int ipc;             /* TANDEM_KVX_IPC (on|off): CUDA IPC between GPU pools of one host (TD_OFF: never) */
  bool trace;          /* TANDEM_KVX_TRACE: keep a per-transfer event trace */
  char ucx_tls[256];   /* UCX_TLS as UCX will read it ("" unset): whether shared memory can be had */
  char ucx_net_devices[256]; /* UCX_NET_DEVICES ("" unset): when set, the operator's choice of interfaces */
} td_kvx_tuning;

typedef struct td_settings {
  int log_level; /* TANDEM_LOG (debug|info|warn|error|off); -1: unset (info) */
  int log_format; /* TANDEM_LOG_FORMAT (text|json); -1: unset (text) */
  /* TANDEM_MALLOC_KEEP (on|off): buffers up to TD_MALLOC_KEEP_MAX (a Whisper
   * request's 1.5 MB of features, at every hop) come from the heap and freed
   * heap stays with the process up to TD_MALLOC_KEEP_TRIM, instead of fresh
   * mappings the kernel faults in and zeroes for each (default on; glibc) */
  int malloc_keep;
  td_cuda_tuning cuda;
  td_model_tuning model;
  td_kvx_tuning kvx;
} td_settings;

/* Reads every variable above; TD_ERR_INVALID (and the variable's name in
 * td_errmsg) for a value that does not parse. */
td_status td_settings_from_env(td_settings *s);
/* Applies the process-wide parts (the log level and format, the heap's
 * thresholds). */
void td_settings_apply(const td_settings *s);

#endif
