/* The public face of td_tokenizer: loading from a folder, limits and UTF-8
 * checks on the way in, transformers' decode rules on the way out
 * (clean-up of spaces, Whisper's timestamps and prompt), and the streaming
 * detokenizer. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/defaults.h"
#include "frontend/tokenizer_impl.h"

#define WHISPER_TIMESTAMP_RE "<\\|(\\d+\\.\\d+)\\|>" /* WhisperTokenizer.timestamp_pat */

static bool is_file(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

static td_tokenizer_opts with_defaults(const td_tokenizer_opts *o) {
  td_tokenizer_opts r = o ? *o : (td_tokenizer_opts){0};
  if (!r.max_text_bytes) r.max_text_bytes = TD_TOKENIZER_MAX_TEXT_BYTES;
  if (!r.max_file_bytes) r.max_file_bytes = TD_TOKENIZER_MAX_FILE_BYTES;
  return r;
}

/* tokenizer_config.json: the clean-up flag and the class (Whisper decodes its own way). */
static td_status apply_config(td_tokenizer *t, const char *cfg, size_t len) {
  const char *cls = NULL;
  cJSON *root = NULL;
  if (cfg) {
    root = cJSON_ParseWithLength(cfg, len);
    if (!root || !cJSON_IsObject(root)) {
      cJSON_Delete(root);
      return td_err(TD_ERR_FORMAT, "tokenizer_config.json is not a JSON object");
    }
    t->cleanup = tk_jbool(root, "clean_up_tokenization_spaces", false);
    cls = tk_jstr(root, "tokenizer_class");
  }
  int32_t sot = t->ops->token_to_id(t, "<|startoftranscript|>");
  t->whisper = cls ? strstr(cls, "Whisper") != NULL : sot >= 0; /* no config: Whisper's own special tokens say it */
  cJSON_Delete(root);
  if (!t->whisper) return TD_OK;
  t->whisper_sot = sot;
  t->whisper_prev = t->ops->token_to_id(t, "<|startofprev|>");
  return tk_regex_new(WHISPER_TIMESTAMP_RE, strlen(WHISPER_TIMESTAMP_RE), false, "Whisper timestamps", &t->timestamp_re);
}

void td_tokenizer_destroy(td_tokenizer *t) {
  if (!t) return;
  if (t->ops) t->ops->destroy(t);
  tk_regex_free(t->timestamp_re);
  free(t);
}

td_status td_tokenizer_from_json(const char *json, size_t len, const char *config, size_t config_len,
                                 const td_tokenizer_opts *opts, td_tokenizer **out) {
  if (!json || !out) return td_err(TD_ERR_INVALID, "tokenizer: no tokenizer.json text");
  td_tokenizer *t = calloc(1, sizeof *t);
  if (!t) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  t->opts = with_defaults(opts);
  td_status st = len > t->opts.max_file_bytes
                     ? td_err(TD_ERR_INVALID, "tokenizer.json: %zu bytes, over the limit of %zu", len, t->opts.max_file_bytes)
                     : tk_hf_load(json, len, t);
  if (st == TD_OK) st = apply_config(t, config, config_len);
  if (st != TD_OK) {
    td_tokenizer_destroy(t);
    return st;
  }
  *out = t;
  return TD_OK;
}

td_status td_tokenizer_load(const char *dir, const td_tokenizer_opts *opts, td_tokenizer **out) {
  if (!dir || !out) return td_err(TD_ERR_INVALID, "tokenizer: no folder");
  td_tokenizer_opts o = with_defaults(opts);
  char path[4096], cpath[4096];
  snprintf(path, sizeof path, "%s/tokenizer.json", dir);
  snprintf(cpath, sizeof cpath, "%s/tokenizer_config.json", dir);
  char *cfg = NULL;
  size_t clen = 0;
  if (is_file(cpath)) TD_TRY(tk_read_file(cpath, o.max_file_bytes, &cfg, &clen));
  td_status st;
  if (is_file(path)) {
    char *json = NULL;
    size_t len = 0;
    st = tk_read_file(path, o.max_file_bytes, &json, &len);
    if (st == TD_OK) st = td_tokenizer_from_json(json, len, cfg, clen, &o, out);
    free(json);
    if (st != TD_OK) td_err_ctx(st, "%s: ", path);
  } else {
    snprintf(path, sizeof path, "%s/source.spm", dir);
    td_tokenizer *t = NULL;
    if (!is_file(path)) {
      st = td_err(TD_ERR_NOT_FOUND, "%s has neither tokenizer.json nor source.spm", dir);
    } else if (!(t = calloc(1, sizeof *t))) {
      st = td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
    } else {
      t->opts = o;
      st = tk_marian_load(dir, cfg, clen, t);
      if (st == TD_OK) st = apply_config(t, cfg, clen);
      if (st == TD_OK) *out = t;
      else td_tokenizer_destroy(t);
    }
  }
  free(cfg);
  return st;
}

int32_t td_tokenizer_vocab_size(const td_tokenizer *t) { return t->ops->vocab_size(t); }
int32_t td_tokenizer_token_to_id(const td_tokenizer *t, const char *s) { return s ? t->ops->token_to_id(t, s) : -1; }
const char *td_tokenizer_id_to_token(const td_tokenizer *t, int32_t id) { return t->ops->id_to_token(t, id); }
bool td_tokenizer_is_special(const td_tokenizer *t, int32_t id) { return t->ops->is_special(t, id); }
bool td_tokenizer_cleans_up_spaces(const td_tokenizer *t) { return t->cleanup; }

td_status td_tokenizer_encode(const td_tokenizer *t, const char *text, size_t len, bool add_special, int32_t **ids,
                              size_t *n) {
  if (!t || !ids || !n || (len && !text)) return td_err(TD_ERR_INVALID, "tokenizer: encode: bad arguments");
  *ids = NULL;
  *n = 0;
  if (len > t->opts.max_text_bytes)
    return td_err(TD_ERR_INVALID, "tokenizer: text of %zu bytes is over the limit of %zu", len, t->opts.max_text_bytes);
  size_t valid = tk_utf8_valid_prefix(text ? text : "", len);
  if (valid == len) return t->ops->encode(t, text ? text : "", len, add_special, ids, n);
  if (t->opts.strict_utf8) return td_err(TD_ERR_INVALID, "tokenizer: text is not UTF-8 (byte %zu)", valid);
  tk_buf b = {0};
  td_status st = tk_utf8_lossy(text, len, &b);
  if (st == TD_OK) st = t->ops->encode(t, b.p, b.n, add_special, ids, n);
  tk_buf_free(&b);
  return st;
}

static td_status check_id(const td_tokenizer *t, int32_t id) {
  if (id < 0 || id >= t->ops->vocab_size(t))
    return td_err(TD_ERR_INVALID, "tokenizer: token id %d is out of range [0, %d)", id, t->ops->vocab_size(t));
  if (!t->ops->id_to_token(t, id)) return td_err(TD_ERR_INVALID, "tokenizer: no token has id %d", id);
  return TD_OK;
}

/* decode as transformers does it, into out (reset first). */
static td_status decode_text(const td_tokenizer *t, const int32_t *ids, size_t n, bool skip, tk_buf *out) {
  out->n = 0;
  for (size_t i = 0; i < n; i++) TD_TRY(check_id(t, ids[i]));
  if (t->whisper && skip && n && ids[0] == t->whisper_prev && t->whisper_prev >= 0) { /* _strip_prompt */
    size_t k = 0;
    while (k < n && ids[k] != t->whisper_sot) k++;
    ids += k;
    n -= k;
  }
  TD_TRY(t->ops->decode(t, ids, n, skip, out));
  if (t->cleanup) TD_TRY(tk_cleanup_spaces(out));
  if (t->timestamp_re) {
    tk_buf o = {0};
    td_status st = tk_regex_replace(t->timestamp_re, out->p ? out->p : "", out->n, "", 0, &o);
    if (st != TD_OK) {
      tk_buf_free(&o);
      return st;
    }
    tk_buf_free(out);
    *out = o;
  }
  return tk_buf_add(out, "", 0);
}

td_status td_tokenizer_decode(const td_tokenizer *t, const int32_t *ids, size_t n, bool skip_special, char **text,
                              size_t *len) {
  if (!t || !text || (n && !ids)) return td_err(TD_ERR_INVALID, "tokenizer: decode: bad arguments");
  tk_buf b = {0};
  td_status st = decode_text(t, ids, n, skip_special, &b);
  if (st == TD_OK) return tk_buf_take(&b, text, len);
  tk_buf_free(&b);
  return st;
}

/* ---- streaming ---- */

struct td_detok {
  const td_tokenizer *t;
  bool skip;
  tk_ids ids;
  tk_buf given, piece, full, cand;
};

td_status td_detok_create(const td_tokenizer *t, bool skip_special, td_detok **out) {
  if (!t || !out) return td_err(TD_ERR_INVALID, "tokenizer: detok: bad arguments");
  td_detok *d = calloc(1, sizeof *d);
  if (!d) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  d->t = t;
  d->skip = skip_special;
  *out = d;
  return TD_OK;
}

void td_detok_destroy(td_detok *d) {
  if (!d) return;
  free(d->ids.v);
  tk_buf_free(&d->given);
  tk_buf_free(&d->piece);
  tk_buf_free(&d->full);
  tk_buf_free(&d->cand);
  free(d);
}

/* A <0xAB> token: ByteFallback joins a run of them, so a run at the end is not final. */
static bool byte_token(const td_tokenizer *t, int32_t id) {
  const char *s = t->ops->id_to_token(t, id);
  return s && strlen(s) == 6 && !memcmp(s, "<0x", 3) && s[5] == '>';
}

static bool ends_with(const tk_buf *b, size_t h, const char *s, size_t n) {
  return h >= n && !memcmp(b->p + h - n, s, n);
}

/* Gives text[given, upto) and records it; text must extend what was given. */
static td_status give(td_detok *d, const tk_buf *text, size_t upto, const char **piece, size_t *len) {
  d->piece.n = 0;
  TD_TRY(tk_buf_add(&d->piece, "", 0));
  if (upto > d->given.n) {
    if (memcmp(text->p, d->given.p ? d->given.p : "", d->given.n))
      return td_err(TD_ERR_INTERNAL, "tokenizer: streaming decode would change text already given");
    TD_TRY(tk_buf_add(&d->piece, text->p + d->given.n, upto - d->given.n));
    TD_TRY(tk_buf_add(&d->given, text->p + d->given.n, upto - d->given.n));
  }
  *piece = d->piece.p;
  if (len) *len = d->piece.n;
  return TD_OK;
}

td_status td_detok_push(td_detok *d, int32_t id, const char **piece, size_t *len) {
  if (!d || !piece) return td_err(TD_ERR_INVALID, "tokenizer: detok: bad arguments");
  const td_tokenizer *t = d->t;
  TD_TRY(check_id(t, id));
  TD_TRY(tk_ids_push(&d->ids, id));
  const int32_t *ids = d->ids.v;
  size_t k = d->ids.n; /* ids[0, k) decode to text that is final but for its tail */
  while (k > 0 && (byte_token(t, ids[k - 1]) || (d->skip && t->ops->is_special(t, ids[k - 1])))) k--;
  td_status st = decode_text(t, ids, k, d->skip, &d->cand);
  if (st != TD_OK) {
    d->ids.n--;
    return st;
  }
  size_t h = d->cand.n;
  while (ends_with(&d->cand, h, "\xEF\xBF\xBD", 3)) h -= 3; /* an incomplete character decodes as U+FFFD */
  if (t->cleanup) h -= tk_cleanup_holdback(d->cand.p, h);
  if (t->timestamp_re) {
    size_t p = tk_regex_partial_start(t->timestamp_re, d->cand.p, h);
    if (p < h) h = p;
  }
  if (t->strip_tail) h = tk_trim_space(d->cand.p, 0, h); /* the decode strips trailing white space */
  return give(d, &d->cand, h, piece, len);
}

td_status td_detok_finish(td_detok *d, const char **piece, size_t *len) {
  if (!d || !piece) return td_err(TD_ERR_INVALID, "tokenizer: detok: bad arguments");
  TD_TRY(decode_text(d->t, d->ids.v, d->ids.n, d->skip, &d->full));
  if (d->full.n < d->given.n || memcmp(d->full.p, d->given.p ? d->given.p : "", d->given.n))
    return td_err(TD_ERR_INTERNAL, "tokenizer: streaming decode would change text already given");
  return give(d, &d->full, d->full.n, piece, len);
}
