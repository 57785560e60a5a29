#include "common/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define TD_ERRMSG_CAP 1024
static _Thread_local char errmsg[TD_ERRMSG_CAP];

static const char *const names[TD_STATUS_COUNT] = {
    [TD_OK] = "ok",
    [TD_ERR_INVALID] = "invalid argument",
    [TD_ERR_IO] = "i/o error",
    [TD_ERR_FORMAT] = "malformed data",
    [TD_ERR_UNSUPPORTED] = "unsupported",
    [TD_ERR_NOT_FOUND] = "not found",
    [TD_ERR_NOMEM] = "out of memory",
    [TD_ERR_NO_BLOCKS] = "out of KV blocks",
    [TD_ERR_CUDA] = "CUDA error",
    [TD_ERR_TIMEOUT] = "timed out",
    [TD_ERR_CANCELLED] = "cancelled",
    [TD_ERR_NETWORK] = "network error",
    [TD_ERR_PEER] = "peer failed",
    [TD_ERR_OVERLOADED] = "overloaded",
    [TD_ERR_VERSION] = "protocol version mismatch",
    [TD_ERR_INTERNAL] = "internal error",
};

const char *td_status_str(td_status s) {
  if ((unsigned)s >= TD_STATUS_COUNT) return "unknown status";
  return names[s];
}

td_status td_err(td_status s, const char *fmt, ...) {
  char msg[TD_ERRMSG_CAP]; /* an argument may be td_errmsg() itself */
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  memcpy(errmsg, msg, sizeof errmsg);
  return s;
}

td_status td_err_ctx(td_status s, const char *fmt, ...) {
  char prefix[512];
  char old[TD_ERRMSG_CAP];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof prefix, fmt, ap);
  va_end(ap);
  memcpy(old, errmsg, sizeof old);
  snprintf(errmsg, sizeof errmsg, "%s%s", prefix, old[0] ? old : td_status_str(s));
  return s;
}

const char *td_errmsg(void) { return errmsg[0] ? errmsg : "no error message"; }

void td_err_clear(void) { errmsg[0] = 0; }
