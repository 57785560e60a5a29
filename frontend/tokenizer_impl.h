/* Inside the tokenizer: shared by frontend/tokenizer*.c only. */
#ifndef TD_FRONTEND_TOKENIZER_IMPL_H
#define TD_FRONTEND_TOKENIZER_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/status.h"
#include "frontend/tokenizer.h"

/* ---- bytes and UTF-8 (tokenizer_text.c) ---- */

typedef struct tk_buf {
  char *p;
  size_t n, cap;
} tk_buf;

td_status tk_buf_add(tk_buf *b, const void *s, size_t n);
td_status tk_buf_addc(tk_buf *b, char c);
td_status tk_buf_addcp(tk_buf *b, uint32_t cp); /* one code point as UTF-8 */
void tk_buf_free(tk_buf *b);
/* NUL-terminates and hands the bytes over (*len excludes the NUL). */
td_status tk_buf_take(tk_buf *b, char **out, size_t *len);

/* Token ids as they are produced. */
typedef struct tk_ids {
  int32_t *v;
  size_t n, cap;
} tk_ids;
td_status tk_ids_push(tk_ids *a, int32_t id);

/* A regular file of at most max bytes, whole and NUL-terminated (*len excludes the NUL). */
td_status tk_read_file(const char *path, size_t max, char **out, size_t *len);

/* Decodes the code point at s[0, n) (valid UTF-8 assumed); returns its length. */
size_t tk_utf8_next(const char *s, size_t n, uint32_t *cp);
size_t tk_utf8_len(uint8_t lead);
/* Where the code point ending at s[at) begins (lo < at; not before lo). */
size_t tk_utf8_prev(const char *s, size_t lo, size_t at);
/* s[a, e) without its leading / trailing white space: the new a / e. */
size_t tk_skip_space(const char *s, size_t a, size_t e);
size_t tk_trim_space(const char *s, size_t a, size_t e);
/* Length of the longest valid UTF-8 prefix. */
size_t tk_utf8_valid_prefix(const char *s, size_t n);
/* Invalid sequences replaced by U+FFFD, one per maximal subpart (as Rust's
 * from_utf8_lossy and Python's errors="replace"). */
td_status tk_utf8_lossy(const char *s, size_t n, tk_buf *out);
bool tk_is_whitespace(uint32_t cp); /* Unicode White_Space, as Rust's char::is_whitespace */
bool tk_is_numeric(uint32_t cp);    /* N*, as char::is_numeric */
bool tk_is_alnum(uint32_t cp);      /* L* or N* */
bool tk_is_punct(uint32_t cp);      /* ASCII punctuation or P* */
bool tk_is_word(uint32_t cp);       /* \w of Rust's regex */

/* A byte trie over token texts: leftmost-longest and common-prefix walks. */
typedef struct tk_trie tk_trie;
tk_trie *tk_trie_new(void);
void tk_trie_free(tk_trie *t);
td_status tk_trie_add(tk_trie *t, const char *s, size_t n, int32_t value);
/* Calls fn(len, value, ctx) for each key that is a prefix of s[0, n), shortest first. */
void tk_trie_prefixes(const tk_trie *t, const char *s, size_t n, void (*fn)(size_t, int32_t, void *), void *ctx);
/* The longest key that is a prefix of s[0, n): its length (0: none), value in *value. */
size_t tk_trie_longest(const tk_trie *t, const char *s, size_t n, int32_t *value);

/* Segments of a string as tokenizers' Pattern::find_matches gives them. */
typedef struct tk_seg {
  size_t s, e;
  bool match;
} tk_seg;
typedef struct tk_segs {
  tk_seg *v;
  size_t n, cap;
} tk_segs;
td_status tk_segs_push(tk_segs *a, size_t s, size_t e, bool match);

/* A compiled pattern (PCRE2; literal for tokenizers' String patterns). */
typedef struct tk_regex tk_regex;
td_status tk_regex_new(const char *pat, size_t len, bool literal, const char *what, tk_regex **out);
void tk_regex_free(tk_regex *r);
td_status tk_regex_segments(const tk_regex *r, const char *s, size_t n, tk_segs *out);
/* Where a match could still begin if more text were appended: the offset
 * of the earliest partial match reaching the end, or n when none. */
size_t tk_regex_partial_start(const tk_regex *r, const char *s, size_t n);
/* Every match of r in s replaced by rep. */
td_status tk_regex_replace(const tk_regex *r, const char *s, size_t n, const char *rep, size_t rep_len, tk_buf *out);
/* Replace's and Split's {"String": ...} or {"Regex": ...} (tokenizer_norm.c). */
td_status tk_pattern_parse(const cJSON *j, const char *what, tk_regex **out);

/* SplitDelimiterBehavior */
typedef enum tk_split { TK_REMOVED, TK_ISOLATED, TK_MERGED_PREV, TK_MERGED_NEXT, TK_CONTIGUOUS } tk_split;
/* Applies a behaviour to segments: the kept pieces, as [s, e) pairs in out (match flags false). */
td_status tk_split_apply(const tk_segs *in, tk_split b, tk_segs *out);
td_status tk_split_parse(const char *s, tk_split *out);
/* Segments from a per-character predicate (tokenizers' Fn(char) pattern). */
td_status tk_char_segments(const char *s, size_t n, bool (*pred)(uint32_t, const void *), const void *ctx,
                           tk_segs *out);

/* ---- JSON helpers (tokenizer_text.c) ---- */
const char *tk_jstr(const cJSON *o, const char *key); /* NULL when absent or not a string */
bool tk_jbool(const cJSON *o, const char *key, bool dflt);
td_status tk_jtype(const cJSON *o, const char *where, const char **type); /* the "type" field */

/* ---- normalizers (tokenizer_norm.c) ---- */
typedef struct tk_norm tk_norm;
td_status tk_norm_parse(const cJSON *j, tk_norm **out);
void tk_norm_free(tk_norm *n);
/* out gets the normalized text (out is reset first). */
td_status tk_norm_apply(const tk_norm *n, const char *s, size_t len, tk_buf *out);

/* ---- pre-tokenizers (tokenizer_pretok.c) ---- */
typedef struct tk_piece {
  char *s;
  size_t n;
  int32_t id;    /* an added token's id, or -1 */
  bool at_start; /* begins at offset 0 of the original text */
} tk_piece;
typedef struct tk_pieces {
  tk_piece *v;
  size_t n, cap;
} tk_pieces;
td_status tk_pieces_push(tk_pieces *a, const char *s, size_t n, int32_t id, bool at_start);
void tk_pieces_free(tk_pieces *a);

typedef struct tk_pretok tk_pretok;
td_status tk_pretok_parse(const cJSON *j, tk_pretok **out);
void tk_pretok_free(tk_pretok *p);
/* Splits every piece with id -1 in place. */
td_status tk_pretok_apply(const tk_pretok *p, tk_pieces *ps);
/* The GPT-2 byte <-> character map of ByteLevel. */
uint32_t tk_byte_to_char(uint8_t b);
int tk_char_to_byte(uint32_t cp); /* -1 when cp is not one of them */

/* ---- models (tokenizer_model.c) ---- */
typedef struct tk_vocab_entry tk_vocab_entry;
typedef struct tk_model tk_model;
td_status tk_model_parse(const cJSON *j, tk_model **out);
void tk_model_free(tk_model *m);
int32_t tk_model_size(const tk_model *m); /* one past the largest id */
int32_t tk_model_token_to_id(const tk_model *m, const char *s, size_t n);
const char *tk_model_id_to_token(const tk_model *m, int32_t id, size_t *len);
/* Appends the ids of one pre-tokenized piece. */
td_status tk_model_tokenize(const tk_model *m, const char *s, size_t n, tk_ids *ids);

/* ---- post-processors and decoders (tokenizer_decode.c) ---- */
typedef struct tk_post tk_post;
td_status tk_post_parse(const cJSON *j, tk_post **out);
void tk_post_free(tk_post *p);
/* Replaces ids with the single-sequence output. */
td_status tk_post_apply(const tk_post *p, tk_ids *ids);

typedef struct tk_dec tk_dec;
td_status tk_dec_parse(const cJSON *j, tk_dec **out);
void tk_dec_free(tk_dec *d);
/* Tokens (texts) to the decoded text; d NULL joins with spaces. */
td_status tk_dec_apply(const tk_dec *d, const char **tok, const size_t *len, size_t n, tk_buf *out);

/* transformers' clean_up_tokenization (" ." -> "." ...) in place. */
td_status tk_cleanup_spaces(tk_buf *b);
/* How many trailing bytes of s clean-up could still change once more text follows. */
size_t tk_cleanup_holdback(const char *s, size_t n);

/* ---- implementations behind td_tokenizer ---- */
typedef struct tk_ops {
  const char *name;
  td_status (*encode)(const td_tokenizer *t, const char *text, size_t len, bool add_special, int32_t **ids,
                      size_t *n);
  td_status (*decode)(const td_tokenizer *t, const int32_t *ids, size_t n, bool skip_special, tk_buf *out);
  int32_t (*vocab_size)(const td_tokenizer *t);
  int32_t (*token_to_id)(const td_tokenizer *t, const char *s);
  const char *(*id_to_token)(const td_tokenizer *t, int32_t id);
  bool (*is_special)(const td_tokenizer *t, int32_t id);
  void (*destroy)(td_tokenizer *t);
} tk_ops;

struct td_tokenizer {
  const tk_ops *ops;
  void *impl;
  td_tokenizer_opts opts;
  bool cleanup;         /* clean_up_tokenization_spaces */
  bool whisper;         /* WhisperTokenizer's decode: timestamps dropped, prompt stripped */
  int32_t whisper_prev; /* <|startofprev|>, or -1 */
  int32_t whisper_sot;  /* <|startoftranscript|>, or -1 */
  tk_regex *timestamp_re;
  bool strip_tail;      /* decode strips trailing white space (Marian) */
};

extern const tk_ops tk_hf_ops;
td_status tk_hf_load(const char *json, size_t len, td_tokenizer *t);
/* config: tokenizer_config.json's text (NULL: none). */
td_status tk_marian_load(const char *dir, const char *config, size_t config_len, td_tokenizer *t);

/* ---- SentencePiece (tokenizer_spm.cc: a C face on libsentencepiece) ---- */
typedef struct tk_spm tk_spm;
/* From a model file's bytes; path names it in errors. */
td_status tk_spm_load(const char *bytes, size_t len, const char *path, tk_spm **out);
void tk_spm_free(tk_spm *s);
/* Pieces of text, as SentencePieceProcessor::Encode(text, out_type=str). */
td_status tk_spm_encode(const tk_spm *s, const char *text, size_t len, char ***pieces, size_t *n);
void tk_spm_pieces_free(char **pieces, size_t n);
/* DecodePieces. */
td_status tk_spm_decode(const tk_spm *s, const char *const *pieces, size_t n, tk_buf *out);

#endif
