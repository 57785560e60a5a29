#include "common/json.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

td_status td_json_parse(const char *buf, size_t len, const char *src, cJSON **out) {
  const char *end = NULL;
  cJSON *j = cJSON_ParseWithLengthOpts(buf, len, &end, 0);
  if (!j) {
    size_t off = end && end >= buf ? (size_t)(end - buf) : 0;
    return td_err(TD_ERR_FORMAT, "%s: malformed JSON near byte %zu", src, off);
  }
  *out = j;
  return TD_OK;
}

td_status td_json_load_file(const char *path, size_t max_bytes, cJSON **out) {
  FILE *f = fopen(path, "rb");
  if (!f) return td_err(errno == ENOENT ? TD_ERR_NOT_FOUND : TD_ERR_IO, "%s: %s", path, strerror(errno));
  td_status s = TD_OK;
  char *buf = NULL;
  struct stat st;
  if (fstat(fileno(f), &st) != 0) {
    s = td_err(TD_ERR_IO, "%s: %s", path, strerror(errno));
    goto out_close;
  }
  if ((size_t)st.st_size > max_bytes) {
    s = td_err(TD_ERR_FORMAT, "%s: %lld bytes, more than the %zu allowed", path, (long long)st.st_size,
               max_bytes);
    goto out_close;
  }
  buf = malloc((size_t)st.st_size + 1);
  if (!buf) {
    s = td_err(TD_ERR_NOMEM, "%s: cannot allocate %lld bytes", path, (long long)st.st_size);
    goto out_close;
  }
  if (fread(buf, 1, (size_t)st.st_size, f) != (size_t)st.st_size) {
    s = td_err(TD_ERR_IO, "%s: short read", path);
    goto out_free;
  }
  s = td_json_parse(buf, (size_t)st.st_size, path, out);
out_free:
  free(buf);
out_close:
  fclose(f);
  return s;
}

static td_status lookup(const cJSON *obj, const char *key, bool required, const char *src,
                        const cJSON **item) {
  *item = cJSON_GetObjectItemCaseSensitive(obj, key);
  if (!*item) return required ? td_err(TD_ERR_FORMAT, "%s: missing field \"%s\"", src, key) : TD_OK;
  return TD_OK;
}

td_status td_json_int(const cJSON *obj, const char *key, bool required, const char *src, int64_t *out) {
  const cJSON *it;
  TD_TRY(lookup(obj, key, required, src, &it));
  if (!it) return TD_OK;
  double v = it->valuedouble;
  if (!cJSON_IsNumber(it) || v != floor(v) || fabs(v) > 9007199254740992.0)
    return td_err(TD_ERR_FORMAT, "%s: field \"%s\" must be an integer", src, key);
  *out = (int64_t)v;
  return TD_OK;
}

td_status td_json_i32(const cJSON *obj, const char *key, bool required, const char *src, int32_t *out) {
  int64_t v = 0;
  const cJSON *it;
  TD_TRY(lookup(obj, key, required, src, &it));
  if (!it) return TD_OK;
  TD_TRY(td_json_int(obj, key, true, src, &v));
  if (v < INT32_MIN || v > INT32_MAX)
    return td_err(TD_ERR_FORMAT, "%s: field \"%s\" = %lld is out of range", src, key, (long long)v);
  *out = (int32_t)v;
  return TD_OK;
}

td_status td_json_num(const cJSON *obj, const char *key, bool required, const char *src, double *out) {
  const cJSON *it;
  TD_TRY(lookup(obj, key, required, src, &it));
  if (!it) return TD_OK;
  if (!cJSON_IsNumber(it)) return td_err(TD_ERR_FORMAT, "%s: field \"%s\" must be a number", src, key);
  *out = it->valuedouble;
  return TD_OK;
}

td_status td_json_bool(const cJSON *obj, const char *key, bool required, const char *src, bool *out) {
  const cJSON *it;
  TD_TRY(lookup(obj, key, required, src, &it));
  if (!it) return TD_OK;
  if (!cJSON_IsBool(it)) return td_err(TD_ERR_FORMAT, "%s: field \"%s\" must be true or false", src, key);
  *out = cJSON_IsTrue(it);
  return TD_OK;
}

td_status td_json_str(const cJSON *obj, const char *key, bool required, const char *src, char *out,
                      size_t cap) {
  const cJSON *it;
  TD_TRY(lookup(obj, key, required, src, &it));
  if (!it) return TD_OK;
  if (!cJSON_IsString(it)) return td_err(TD_ERR_FORMAT, "%s: field \"%s\" must be a string", src, key);
  if (strlen(it->valuestring) >= cap)
    return td_err(TD_ERR_FORMAT, "%s: field \"%s\" is longer than %zu bytes", src, key, cap - 1);
  strcpy(out, it->valuestring);
  return TD_OK;
}

td_status td_json_i32_array(const cJSON *obj, const char *key, bool required, const char *src,
                            int64_t lo, int64_t hi, int32_t **out, int *n) {
  const cJSON *it;
  *out = NULL;
  *n = 0;
  TD_TRY(lookup(obj, key, required, src, &it));
  if (!it) return TD_OK;
  if (!cJSON_IsArray(it)) return td_err(TD_ERR_FORMAT, "%s: field \"%s\" must be an array", src, key);
  int len = cJSON_GetArraySize(it);
  int32_t *v = malloc(sizeof *v * (size_t)(len ? len : 1));
  if (!v) return td_err(TD_ERR_NOMEM, "%s: field \"%s\": out of memory", src, key);
  int i = 0;
  const cJSON *e;
  cJSON_ArrayForEach(e, it) {
    double d = e->valuedouble;
    if (!cJSON_IsNumber(e) || d != floor(d)) {
      free(v);
      return td_err(TD_ERR_FORMAT, "%s: field \"%s\"[%d] must be an integer", src, key, i);
    }
    if (d < (double)lo || d > (double)hi) {
      free(v);
      return td_err(TD_ERR_INVALID, "%s: field \"%s\"[%d] = %.0f is outside [%lld, %lld]", src, key, i, d,
                    (long long)lo, (long long)hi);
    }
    v[i++] = (int32_t)d;
  }
  *out = v;
  *n = len;
  return TD_OK;
}

bool td_json_is_null(const cJSON *obj, const char *key) {
  return cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(obj, key));
}
