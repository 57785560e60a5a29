/* The gateway's small pieces: strings, OpenAI error objects, SSE framing,
 * the text of a generated sequence (stop strings). */
#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "gateway/internal.h"

/* ---------------------------------------------------------------- gw_buf */

static bool grow(gw_buf *b, size_t extra) {
  if (b->oom) return false;
  if (b->n + extra + 1 <= b->cap) return true;
  size_t cap = b->cap ? b->cap : 256;
  while (cap < b->n + extra + 1) cap *= 2;
  char *s = realloc(b->s, cap);
  if (!s) {
    b->oom = true;
    return false;
  }
  b->s = s;
  b->cap = cap;
  return true;
}

void gw_buf_add(gw_buf *b, const char *s, size_t n) {
  if (!grow(b, n)) return;
  if (n) memcpy(b->s + b->n, s, n);
  b->n += n;
  b->s[b->n] = 0;
}

void gw_buf_str(gw_buf *b, const char *s) { gw_buf_add(b, s, strlen(s)); }

void gw_buf_printf(gw_buf *b, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (n < 0 || !grow(b, (size_t)n)) return;
  va_start(ap, fmt);
  vsnprintf(b->s + b->n, (size_t)n + 1, fmt, ap);
  va_end(ap);
  b->n += (size_t)n;
}

void gw_buf_free(gw_buf *b) {
  free(b->s);
  memset(b, 0, sizeof *b);
}

/* ---------------------------------------------------------------- API keys */

void gw_keys_free(gw_keys *k) {
  for (int i = 0; i < k->n; i++) free(k->key[i]);
  free(k->key);
  free(k->len);
  memset(k, 0, sizeof *k);
}

static td_status keys_fail(gw_keys *k, FILE *f, td_status s) {
  if (f) fclose(f);
  gw_keys_free(k);
  return s;
}

td_status gw_keys_load(const char *path, gw_keys *out) {
  memset(out, 0, sizeof *out);
  FILE *f = fopen(path, "r");
  if (!f) return td_err(TD_ERR_IO, "the API key file %s cannot be read", path);
  struct stat st;
  if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode))
    return keys_fail(out, f, td_err(TD_ERR_INVALID, "the API key file %s is no regular file", path));
  if (st.st_mode & 077)
    return keys_fail(out, f, td_err(TD_ERR_INVALID, "the API key file %s is readable by others (mode %03o): chmod 600 it",
                                    path, (unsigned)(st.st_mode & 0777)));
  char line[TD_GATEWAY_MAX_API_KEY_BYTES + 64];
  int no = 0;
  while (fgets(line, sizeof line, f)) {
    no++;
    size_t n = strlen(line);
    if (n == sizeof line - 1 && line[n - 1] != '\n' && !feof(f))
      return keys_fail(out, f, td_err(TD_ERR_INVALID, "%s line %d: a key past %d bytes", path, no,
                                      TD_GATEWAY_MAX_API_KEY_BYTES));
    while (n && isspace((unsigned char)line[n - 1])) line[--n] = 0;
    char *a = line;
    while (*a && isspace((unsigned char)*a)) a++;
    n = strlen(a);
    if (!n || *a == '#') continue;
    if (n > TD_GATEWAY_MAX_API_KEY_BYTES)
      return keys_fail(out, f, td_err(TD_ERR_INVALID, "%s line %d: a key of %zu bytes (at most %d)", path, no, n,
                                      TD_GATEWAY_MAX_API_KEY_BYTES));
    for (size_t i = 0; i < n; i++)
      if (a[i] <= ' ' || a[i] > '~')
        return keys_fail(out, f, td_err(TD_ERR_INVALID, "%s line %d: a key is printable ASCII without blanks", path,
                                        no));
    if (out->n == TD_GATEWAY_MAX_API_KEYS)
      return keys_fail(out, f, td_err(TD_ERR_INVALID, "%s: more than %d keys", path, TD_GATEWAY_MAX_API_KEYS));
    char **kk = realloc(out->key, sizeof *kk * (size_t)(out->n + 1));
    if (kk) out->key = kk;
    size_t *ll = kk ? realloc(out->len, sizeof *ll * (size_t)(out->n + 1)) : NULL;
    if (ll) out->len = ll;
    char *copy = ll ? strdup(a) : NULL;
    if (!copy) return keys_fail(out, f, td_err(TD_ERR_NOMEM, "out of memory"));
    out->key[out->n] = copy;
    out->len[out->n++] = n;
  }
  bool err = ferror(f);
  fclose(f);
  if (err) return keys_fail(out, NULL, td_err(TD_ERR_IO, "reading the API key file %s failed", path));
  if (!out->n) return td_err(TD_ERR_INVALID, "the API key file %s holds no key", path);
  return TD_OK;
}

bool gw_keys_admit(const gw_keys *k, const char *authorization) {
  if (!authorization || strncasecmp(authorization, "Bearer ", 7)) return false;
  const char *given = authorization + 7;
  while (*given == ' ') given++;
  size_t gn = strnlen(given, TD_GATEWAY_MAX_API_KEY_BYTES + 1);
  while (gn && given[gn - 1] == ' ') gn--;
  unsigned ok = 0;
  for (int i = 0; i < k->n; i++) {
    /* every byte of every key compared, so that the time does not say where a guess went wrong */
    unsigned diff = (unsigned)(k->len[i] ^ gn);
    for (size_t j = 0; j < k->len[i]; j++) diff |= (unsigned char)(k->key[i][j] ^ (j < gn ? given[j] : 0));
    ok |= diff == 0;
  }
  return ok != 0;
}

/* ---------------------------------------------------------------- errors */

static const char *type_of(int http) {
  switch (http) {
    case 400: case 401: case 404: case 405: case 413: case 431: return "invalid_request_error";
    case 429: return "rate_limit_error";
    default: return "server_error";
  }
}

void gw_error_set(gw_error *e, int http, const char *param, const char *fmt, ...) {
  e->http = http;
  e->type = type_of(http);
  e->code = http == 401 ? "invalid_api_key" : http == 404 ? "not_found" : http == 413 ? "request_too_large" : http == 429 ? "too_many_requests"
          : http == 503 ? "overloaded" : http == 504 ? "timeout" : NULL;
  snprintf(e->param, sizeof e->param, "%s", param ? param : "");
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e->message, sizeof e->message, fmt, ap);
  va_end(ap);
}

void gw_error_from_status(gw_error *e, td_status s, const char *msg) {
  int http;
  switch (s) {
    case TD_ERR_INVALID: case TD_ERR_FORMAT: case TD_ERR_UNSUPPORTED: http = 400; break;
    case TD_ERR_NOT_FOUND: http = 404; break;
    case TD_ERR_OVERLOADED: case TD_ERR_NO_BLOCKS: case TD_ERR_NETWORK: case TD_ERR_PEER: http = 503; break;
    case TD_ERR_TIMEOUT: http = 504; break;
    default: http = 500; break;
  }
  gw_error_set(e, http, NULL, "%s", msg && *msg ? msg : td_status_str(s));
  /* the client library's word for a router it lost or never reached */
  if (s == TD_ERR_NETWORK) e->code = "router_unreachable";
}

char *gw_error_json(const gw_error *e) {
  cJSON *o = cJSON_CreateObject(), *x = cJSON_AddObjectToObject(o, "error");
  cJSON_AddStringToObject(x, "message", e->message);
  cJSON_AddStringToObject(x, "type", e->type ? e->type : type_of(e->http));
  if (e->param[0])
    cJSON_AddStringToObject(x, "param", e->param);
  else
    cJSON_AddNullToObject(x, "param");
  if (e->code)
    cJSON_AddStringToObject(x, "code", e->code);
  else
    cJSON_AddNullToObject(x, "code");
  char *s = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  return s;
}

void gw_sse_data(gw_buf *b, const char *json) {
  /* JSON printed unformatted holds no newline, so one data line suffices */
  gw_buf_str(b, "data: ");
  gw_buf_str(b, json);
  gw_buf_str(b, "\n\n");
}

void gw_sse_transcript(gw_buf *b, const char *delta, size_t n, const char *done) {
  if (n) {
    cJSON *o = cJSON_CreateObject();
    char *t = strndup(delta, n);
    cJSON_AddStringToObject(o, "type", "transcript.text.delta");
    cJSON_AddStringToObject(o, "delta", t ? t : "");
    free(t);
    char *js = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (js) gw_sse_data(b, js);
    free(js);
  }
  if (done) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "transcript.text.done");
    cJSON_AddStringToObject(o, "text", done);
    char *js = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (js) gw_sse_data(b, js);
    free(js);
  }
}

/* ---------------------------------------------------------------- text and stop strings */

td_status gw_text_init(gw_text *t, const td_tokenizer *tok, const char *const *stop, int n_stop) {
  memset(t, 0, sizeof *t);
  t->stop = stop;
  t->n_stop = n_stop;
  for (int i = 0; i < n_stop; i++) {
    size_t l = strlen(stop[i]);
    if (l > 0 && l - 1 > t->hold) t->hold = l - 1;
  }
  return td_detok_create(tok, true, &t->d);
}

void gw_text_free(gw_text *t) {
  td_detok_destroy(t->d);
  gw_buf_free(&t->text);
  memset(t, 0, sizeof *t);
}

/* Cuts the text at the first stop string that ends in its new part. */
static void find_stop(gw_text *t, size_t from) {
  for (int i = 0; i < t->n_stop && !t->stopped; i++) {
    size_t l = strlen(t->stop[i]);
    if (!l || t->text.n < l) continue;
    size_t start = from > l ? from - l + 1 : 0;
    const char *p = t->text.s ? memmem(t->text.s + start, t->text.n - start, t->stop[i], l) : NULL;
    if (!p) continue;
    t->text.n = (size_t)(p - t->text.s);
    t->text.s[t->text.n] = 0;
    t->stopped = true;
  }
}

static void add_piece(gw_text *t, const char *piece, size_t len) {
  size_t from = t->text.n;
  gw_buf_add(&t->text, piece, len);
  if (t->n_stop && len) find_stop(t, from);
}

td_status gw_text_push(gw_text *t, int32_t id) {
  if (t->stopped) return TD_OK;
  const char *piece;
  size_t len;
  TD_TRY(td_detok_push(t->d, id, &piece, &len));
  t->n_tokens++;
  add_piece(t, piece, len);
  return t->text.oom ? td_err(TD_ERR_NOMEM, "out of memory") : TD_OK;
}

td_status gw_text_finish(gw_text *t) {
  if (t->stopped) return TD_OK;
  const char *piece;
  size_t len;
  TD_TRY(td_detok_finish(t->d, &piece, &len));
  add_piece(t, piece, len);
  return t->text.oom ? td_err(TD_ERR_NOMEM, "out of memory") : TD_OK;
}

void gw_text_take(gw_text *t, bool final, const char **p, size_t *n) {
  size_t end = t->text.n;
  if (!final && !t->stopped) end = end > t->hold ? end - t->hold : 0;
  /* never split a UTF-8 character when holding back */
  while (end > t->sent && end < t->text.n && ((unsigned char)t->text.s[end] & 0xC0) == 0x80) end--;
  if (end < t->sent) end = t->sent;
  *p = t->text.s ? t->text.s + t->sent : "";
  *n = end - t->sent;
  t->sent = end;
}
