#include "common/settings.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

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

static td_status env_int(const char *name, int *out) {
  const char *v = env(name);
  if (!v) return TD_OK;
  char *end;
  long x = strtol(v, &end, 10);
  if (*end || x < -1000000000L || x > 1000000000L) return td_err(TD_ERR_INVALID, "%s=%s: an integer", name, v);
  *out = (int)x;
  return TD_OK;
}

td_status td_settings_from_env(td_settings *s) {
  memset(s, 0, sizeof *s);
  s->log_level = -1;
  const char *lv = env("TANDEM_LOG");
  if (lv && (s->log_level = td_log_parse_level(lv)) < 0)
    return td_err(TD_ERR_INVALID, "TANDEM_LOG=%s: debug, info, warn, error or off", lv);
  /* model */
  TD_TRY(env_switch("TANDEM_NORM_FOLD", &s->model.norm_fold));
  const char *qr = env("TANDEM_QNORM_ROWS");
  TD_TRY(env_int("TANDEM_QNORM_ROWS", &s->model.qnorm_rows));
  if (qr && s->model.qnorm_rows <= 0) s->model.qnorm_rows = -1; /* 0 rows: never fused */
  /* kvtransfer */
  TD_TRY(env_switch("TANDEM_KVX_LOCAL", &s->kvx.local_path));
  int trace = 0;
  TD_TRY(env_switch("TANDEM_KVX_TRACE", &trace));
  s->kvx.trace = trace == TD_ON;
  const char *tls = env("UCX_TLS");
  if (tls) snprintf(s->kvx.ucx_tls, sizeof s->kvx.ucx_tls, "%s", tls);
  return TD_OK;
}

void td_settings_apply(const td_settings *s) {
  if (s->log_level >= 0) td_log_set_level((td_log_level)s->log_level);
}
