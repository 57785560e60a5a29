/* Status codes and the thread's last error message. */
#ifndef TD_COMMON_STATUS_H
#define TD_COMMON_STATUS_H

typedef enum td_status {
  TD_OK = 0,
  TD_ERR_INVALID,     /* bad argument or input */
  TD_ERR_IO,          /* file or system call failed */
  TD_ERR_FORMAT,      /* malformed file or message */
  TD_ERR_UNSUPPORTED, /* valid but not supported here */
  TD_ERR_NOT_FOUND,
  TD_ERR_NOMEM,
  TD_ERR_NO_BLOCKS,   /* KV pool exhausted */
  TD_ERR_CUDA,
  TD_ERR_TIMEOUT,
  TD_ERR_CANCELLED,
  TD_ERR_NETWORK,
  TD_ERR_PEER,        /* peer process failed or vanished */
  TD_ERR_OVERLOADED,
  TD_ERR_VERSION,     /* protocol version mismatch */
  TD_ERR_INTERNAL,
  TD_STATUS_COUNT
} td_status;

const char *td_status_str(td_status s);

/* Records a formatted message as the thread's last error and returns s. */
td_status td_err(td_status s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prepends context ("loading X: ") to the last error message; returns s. */
td_status td_err_ctx(td_status s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
const char *td_errmsg(void);
void td_err_clear(void);

#define TD_TRY(expr)                  \
  do {                                \
    td_status td_try_s_ = (expr);     \
    if (td_try_s_ != TD_OK) return td_try_s_; \
  } while (0)

#endif
