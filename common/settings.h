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

/* CUDA backend tuning (kernels/cuda): which kernel variant an op takes and
 * where the measured switches sit. TANDEM_CUDA_* variables. */
typedef struct td_cuda_tuning {
  int placeholder; /* filled in by the CUDA backend's settings */
} td_cuda_tuning;

/* Model graph choices (model/). */
typedef struct td_model_tuning {
  int norm_fold;  /* TANDEM_NORM_FOLD: fold decoder pre-norm weights into the next GEMM (TD_OFF: keep apart) */
  int qnorm_rows; /* TANDEM_QNORM_ROWS: rows up to which the query norm is fused (0: the backend's; -1: never) */
} td_model_tuning;

/* KV transfer (kvtransfer/). */
typedef struct td_kvx_tuning {
  int local_path;      /* TANDEM_KVX_LOCAL (on|off): same-host data endpoint (TD_OFF: never) */
  bool trace;          /* TANDEM_KVX_TRACE: keep a per-transfer event trace */
  char ucx_tls[256];   /* UCX_TLS as UCX will read it ("" unset): whether shared memory can be had */
} td_kvx_tuning;

typedef struct td_settings {
  int log_level; /* TANDEM_LOG (debug|info|warn|error|off); -1: unset (info) */
  td_cuda_tuning cuda;
  td_model_tuning model;
  td_kvx_tuning kvx;
} td_settings;

/* Reads every variable above; TD_ERR_INVALID (and the variable's name in
 * td_errmsg) for a value that does not parse. */
td_status td_settings_from_env(td_settings *s);
/* Applies the process-wide parts (the log level). */
void td_settings_apply(const td_settings *s);

#endif
