/* Typed access to JSON documents (cJSON) with errors that name the source
 * and the field. */
#ifndef TD_COMMON_JSON_H
#define TD_COMMON_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/status.h"

/* Reads and parses a file; the error names the file and the offending spot. */
td_status td_json_load_file(const char *path, size_t max_bytes, cJSON **out);
/* Parses a buffer of len bytes (need not be NUL-terminated); src names it in errors. */
td_status td_json_parse(const char *buf, size_t len, const char *src, cJSON **out);

/* Each getter: when the key is absent, returns TD_OK and leaves *out
 * untouched if !required, or fails with TD_ERR_FORMAT if required. A present
 * key of the wrong type (or out of range) always fails. src names the document. */
td_status td_json_int(const cJSON *obj, const char *key, bool required, const char *src, int64_t *out);
td_status td_json_i32(const cJSON *obj, const char *key, bool required, const char *src, int32_t *out);
td_status td_json_num(const cJSON *obj, const char *key, bool required, const char *src, double *out);
td_status td_json_bool(const cJSON *obj, const char *key, bool required, const char *src, bool *out);
td_status td_json_str(const cJSON *obj, const char *key, bool required, const char *src,
                      char *out, size_t cap);
/* An array of integers within [lo, hi]; *out is malloc'ed (NULL when absent). */
td_status td_json_i32_array(const cJSON *obj, const char *key, bool required, const char *src,
                            int64_t lo, int64_t hi, int32_t **out, int *n);
/* Whether key exists and is JSON null. */
bool td_json_is_null(const cJSON *obj, const char *key);

#endif
