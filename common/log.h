/* Levelled logging to stderr. The level is info until set (main sets it
 * from TANDEM_LOG through td_settings_apply, or from --log-level). */
#ifndef TD_COMMON_LOG_H
#define TD_COMMON_LOG_H

typedef enum td_log_level { TD_LOG_DEBUG, TD_LOG_INFO, TD_LOG_WARN, TD_LOG_ERROR, TD_LOG_OFF } td_log_level;

void td_log_set_level(td_log_level level);
td_log_level td_log_get_level(void);
/* Parses "debug", "info", ...; returns -1 when unknown. */
int td_log_parse_level(const char *s);
/* A short name printed on every line (the process role). */
void td_log_set_name(const char *name);
void td_log_write(td_log_level level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define TD_DEBUG(...) td_log_write(TD_LOG_DEBUG, __FILE__, __LINE__, __VA_ARGS__)
#define TD_INFO(...) td_log_write(TD_LOG_INFO, __FILE__, __LINE__, __VA_ARGS__)
#define TD_WARN(...) td_log_write(TD_LOG_WARN, __FILE__, __LINE__, __VA_ARGS__)
#define TD_ERROR(...) td_log_write(TD_LOG_ERROR, __FILE__, __LINE__, __VA_ARGS__)

#endif
