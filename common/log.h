/* Levelled logging to stderr. The level is info until set (main sets it
 * from TANDEM_LOG through td_settings_apply, or from --log-level); the
 * format is text until set (TANDEM_LOG_FORMAT=json: one JSON object a
 * line, with the request the thread works on, so that one request can be
 * followed across the router and the workers). */
#ifndef TD_COMMON_LOG_H
#define TD_COMMON_LOG_H

#include <stdio.h>

typedef enum td_log_level { TD_LOG_DEBUG, TD_LOG_INFO, TD_LOG_WARN, TD_LOG_ERROR, TD_LOG_OFF } td_log_level;

void td_log_set_level(td_log_level level);
td_log_level td_log_get_level(void);
/* Parses "debug", "info", ...; returns -1 when unknown. */
int td_log_parse_level(const char *s);
/* A short name printed on every line (the process role). */
void td_log_set_name(const char *name);
typedef enum td_log_format { TD_LOG_TEXT, TD_LOG_JSON } td_log_format;
void td_log_set_format(td_log_format f);
/* "text" or "json"; -1 when unknown. */
int td_log_parse_format(const char *s);
/* Where lines go (NULL: stderr). */
void td_log_set_file(FILE *f);
/* The client's id of the request this thread works on (copied; NULL or ""
 * clears): JSON lines carry it as "request". */
void td_log_set_request(const char *id);
const char *td_log_get_request(void); /* "" when none */
/* One line about request id (JSON: its "request"), whatever the thread's. */
#define TD_LOG_ABOUT(id, lvl, ...)                                    \
  do {                                                                \
    char td_saved_[96];                                               \
    snprintf(td_saved_, sizeof td_saved_, "%s", td_log_get_request()); \
    td_log_set_request(id);                                           \
    lvl(__VA_ARGS__);                                                 \
    td_log_set_request(td_saved_);                                    \
  } while (0)
void td_log_write(td_log_level level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define TD_DEBUG(...) td_log_write(TD_LOG_DEBUG, __FILE__, __LINE__, __VA_ARGS__)
#define TD_INFO(...) td_log_write(TD_LOG_INFO, __FILE__, __LINE__, __VA_ARGS__)
#define TD_WARN(...) td_log_write(TD_LOG_WARN, __FILE__, __LINE__, __VA_ARGS__)
#define TD_ERROR(...) td_log_write(TD_LOG_ERROR, __FILE__, __LINE__, __VA_ARGS__)

#endif
