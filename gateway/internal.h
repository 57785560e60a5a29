/* The gateway's parts: request parsing and response formatting (pure,
 * unit-tested), the router link (io.c: one thread owns the td_client), the
 * HTTP server (http.c, libmicrohttpd). docs/gateway.md. */
#ifndef TD_GATEWAY_INTERNAL_H
#define TD_GATEWAY_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uthash.h>

#include "client/client.h"
#include "common/defaults.h"
#include "common/jsonl.h"
#include "common/vec.h"
#include "frontend/audio.h"
#include "frontend/longform.h"
#include "frontend/tokenizer.h"

/* ---- a growable string ---- */
typedef struct gw_buf {
  char *s;
  size_t n, cap;
  bool oom; /* an append failed: the content is incomplete */
} gw_buf;

void gw_buf_add(gw_buf *b, const char *s, size_t n);
void gw_buf_str(gw_buf *b, const char *s);
void gw_buf_printf(gw_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void gw_buf_free(gw_buf *b);

/* ---- the model the gateway fronts ---- */
typedef struct gw_model {
  char name[128];
  td_tokenizer *tok;
  int32_t vocab, eos;
  int32_t model_vocab; /* config.json's vocab_size (0: not given) */
  /* Whisper */
  bool whisper;
  td_mel *mel;
  size_t window_samples;
  int max_target; /* decoder positions (0: unknown) */
  int32_t sot, translate, transcribe, notimestamps, startofprev, ts_begin;
  int max_initial_timestamp; /* generation_config.json's max_initial_timestamp_index; -1: none */
  int32_t prev_sot; /* before earlier text: generation_config.json's prev_sot_token_id, else <|startofprev|> */
  void *lang_to_id; /* generation_config.json's lang_to_id (a cJSON object), NULL when absent */
  td_whisper_prompt *wp; /* the language tokens and default, as tandem-generate and the router take them */
  const int32_t *langs;  /* every language token (NULL: English-only, nothing to detect) */
  int n_langs;
  char default_language[16]; /* generation_config.json's language ("" : none; then it is detected) */
} gw_model;

td_status gw_model_load(const char *model_dir, const char *tokenizer_dir, const char *name, gw_model *m);
void gw_model_free(gw_model *m);
/* The id of language code `code` ("en"): generation_config.json's lang_to_id
 * when it has one, else the tokenizer's <|code|>; -1 when unknown. */
int32_t gw_language_id(const gw_model *m, const char *code);
/* The code ("en") of language token id into code[cap]; false when id is
 * none of the model's language tokens. */
bool gw_language_code(const gw_model *m, int32_t id, char *code, size_t cap);

/* ---- API keys (--api-keys FILE) ---- */
typedef struct gw_keys {
  char **key;
  size_t *len;
  int n;
} gw_keys;

/* One key a line (surrounding blanks dropped; empty lines and lines
 * starting with '#' skipped), printable ASCII without spaces, at most
 * TD_GATEWAY_MAX_API_KEY_BYTES each, at least one and at most
 * TD_GATEWAY_MAX_API_KEYS; the file readable by its owner only. */
td_status gw_keys_load(const char *path, gw_keys *out);
void gw_keys_free(gw_keys *k);
/* Whether an Authorization header's value ("Bearer KEY", the scheme in any
 * case) carries one of the keys; the comparison takes the same time
 * wherever a candidate differs. */
bool gw_keys_admit(const gw_keys *k, const char *authorization);

/* ---- errors (OpenAI's error object) ---- */
typedef struct gw_error {
  int http;          /* 400, 401, 404, 413, 429, 500, 503, 504 */
  const char *type;  /* invalid_request_error, server_error, ... */
  const char *code;  /* NULL or a short code: model_not_found, ... */
  char param[64];    /* the offending field, "" when none */
  char message[512];
} gw_error;

void gw_error_set(gw_error *e, int http, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* From a td_status and td_errmsg() (a refusal of the router or a failure). */
void gw_error_from_status(gw_error *e, td_status s, const char *msg);
/* {"error": {"message", "type", "param", "code"}}, malloc'ed. */
char *gw_error_json(const gw_error *e);

/* ---- server-sent events ---- */
/* "data: JSON\n\n" */
void gw_sse_data(gw_buf *b, const char *json);
/* A transcription's stream events: the delta's n bytes (none when n is 0),
 * then, when done is given, the whole text. */
void gw_sse_transcript(gw_buf *b, const char *delta, size_t n, const char *done);

/* ---- text of one generated sequence: detokenizing, stop strings ---- */
typedef struct gw_text {
  td_detok *d;
  gw_buf text;      /* all text so far (cut at a stop string) */
  size_t sent;      /* bytes of text already given out */
  bool stopped;     /* a stop string was found; nothing more is taken */
  int n_tokens;     /* tokens taken (up to the stop) */
  const char *const *stop;
  int n_stop;
  size_t hold;      /* bytes kept back while a stop string may still begin there */
} gw_text;

td_status gw_text_init(gw_text *t, const td_tokenizer *tok, const char *const *stop, int n_stop);
void gw_text_free(gw_text *t);
/* Takes one token; ignored once stopped. */
td_status gw_text_push(gw_text *t, int32_t id);
/* The end: held-back text becomes final. */
td_status gw_text_finish(gw_text *t);
/* Text that is final and not yet given out ([*p, *p + *n)); marks it given. */
void gw_text_take(gw_text *t, bool final, const char **p, size_t *n);

/* ---- /v1/completions ---- */
typedef struct gw_completion {
  int n_prompts;
  td_i32vec prompts[TD_GATEWAY_MAX_PROMPTS];
  td_request_params params;
  td_i32vec stop_ids;
  char *stop[TD_GATEWAY_MAX_STOP];
  int n_stop;
  int n;           /* choices a prompt */
  int logprobs;    /* -1: none */
  bool stream, include_usage;
} gw_completion;

/* Parses a request body (len bytes); false with *e filled when it is refused. */
bool gw_completion_parse(const char *body, size_t len, const gw_model *m, gw_completion *c, gw_error *e);
void gw_completion_free(gw_completion *c);

/* ---- /v1/audio/transcriptions and /translations ---- */
typedef enum gw_format { GW_FMT_JSON, GW_FMT_TEXT, GW_FMT_SRT, GW_FMT_VTT, GW_FMT_VERBOSE } gw_format;

typedef struct gw_audio_req {
  bool translate;
  char model[128], language[16], response_format[16];
  char *prompt;           /* malloc'ed, NULL when absent */
  float temperature;
  bool has_temperature, stream, seg_timestamps, word_timestamps;
  gw_format format;
  char bad_field[64];     /* a field this endpoint does not know */
  td_longform_settings lf; /* audio past the window */
  unsigned seen;          /* the fields given, by bit (a second of one is refused) */
} gw_audio_req;

/* Checks the form fields (after upload); false with *e filled. No
 * language: the checkpoint's default where it names one. */
bool gw_audio_check(gw_audio_req *a, const gw_model *m, gw_error *e);
/* Whether the language is to be detected first: none given, none by
 * default, and the model has language tokens (transformers' detect_language). */
bool gw_audio_detects(const gw_audio_req *a, const gw_model *m);
/* Takes the detected token as the request's language; false with *e
 * filled when it is no language token of the model. */
bool gw_audio_set_language(gw_audio_req *a, const gw_model *m, int32_t id, gw_error *e);
/* A number form field: a number, or "none" when off_ok; false with *e filled. */
bool gw_opt_num_parse(const char *field, const char *v, bool off_ok, td_opt_num *out, gw_error *e);
/* The decoder prompt as transformers builds it: [<|startofprev|> prompt]
 * <|startoftranscript|> <|lang|> <|task|> [<|notimestamps|>]. */
bool gw_audio_prompt(const gw_audio_req *a, const gw_model *m, td_i32vec *out, gw_error *e);
/* The client's prompt as transformers' get_prompt_ids gives it, without its <|startofprev|>. */
bool gw_audio_prompt_ids(const gw_audio_req *a, const gw_model *m, td_i32vec *out, gw_error *e);

typedef struct gw_segment {
  double start, end;
  char *text; /* malloc'ed */
  int first, n_tokens; /* the tokens it came from in the output */
  /* long-form: its window's (stats false: short audio, computed from the output) */
  bool stats;
  int seek;
  float temperature;
  double avg_logprob, compression_ratio, no_speech_prob;
} gw_segment;

/* Splits generated tokens at timestamp tokens (<|0.00|> and on, 0.02 s
 * each) as transformers does; without timestamps one segment covers the
 * audio. *text gets the whole text (timestamps and special tokens removed). */
td_status gw_segments(const gw_model *m, const int32_t *tok, int n, double duration, bool timestamps,
                      gw_segment **segs, int *n_segs, char **text);
void gw_segments_free(gw_segment *s, int n);
/* ---- long-form: audio longer than the model's window (longform.c) ---- */
/* The transcription's options from the form: transformers' generate with
 * OpenAI whisper's defaults (docs/gateway.md); false with *e filled. */
bool gw_longform_opts(const gw_audio_req *a, const gw_model *m, const td_i32vec *prompt_ids, td_longform_opts *o,
                      gw_error *e);
/* The transcription's segments as gw_segments over all its tokens (*tok,
 * malloc'ed), and its text; segments keep transformers' list (empty text
 * included). */
td_status gw_longform_segments(const gw_model *m, const td_longform *lf, int32_t **tok, int *n_tok,
                               gw_segment **segs, int *n_segs, char **text);

/* SRT (1-based cues, HH:MM:SS,mmm) and WebVTT (WEBVTT header, HH:MM:SS.mmm). */
void gw_format_srt(gw_buf *b, const gw_segment *s, int n);
void gw_format_vtt(gw_buf *b, const gw_segment *s, int n);
/* hh:mm:ss + sep + mmm */
void gw_format_time(char *out, size_t cap, double seconds, char sep);

/* ---- the router link: one thread, one td_client (io.c) ---- */
typedef struct gw_out {
  td_i32vec tok;
  td_f32vec lp;
  td_finish finish;
  double score;
  bool has_probe; /* the request's probe, from its result */
  double probe;
} gw_out;

typedef struct gw_batch gw_batch;

/* One router request. */
typedef struct gw_sub {
  char id[48];
  td_json_request req;
  bool stream;
  gw_out out[TD_ROUTER_MAX_SAMPLES];
  int n_out;
  bool done;
  td_status status;
  char error[512];
  gw_batch *b;
  int64_t sent_ns, first_ns; /* handed to the router; its first token (or result) back: under b->mu */
  UT_hash_handle hh;
} gw_sub;

/* The router requests of one HTTP request; mu guards every sub's output
 * fields, cv signals new tokens and ends. */
struct gw_batch {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int refs; /* the owner's + one a sub in the link's table */
  int n, n_done;
  bool quiet; /* the waiter holds its stream back: wake it for ends only */
  gw_sub *subs;
  struct gw_io *io;
  _Atomic unsigned events; /* bumped with every wake-up: what a spinning waiter watches */
};

typedef struct gw_io gw_io;

/* spin_us > 0: the link thread, and up to a quarter of the CPUs' waiting
 * HTTP threads, poll this long before they sleep (a sleeping thread's
 * wake-up costs tens of microseconds on an idle host); 0: never. */
td_status gw_io_create(const char *router, const td_auth *auth, uint32_t timeout_ms, int spin_us, gw_io **out);
/* Ends every request in flight with an error and stops the thread; later
 * submissions end at once with an error. */
void gw_io_stop(gw_io *io);
/* Stops (if not yet) and frees. */
void gw_io_destroy(gw_io *io);
/* n subs, ids from the link's counter; the caller fills req / stream. */
gw_batch *gw_batch_create(gw_io *io, int n);
void gw_batch_release(gw_batch *b);
void gw_io_submit(gw_io *io, gw_batch *b);
/* Cancels the subs still in flight (they end with TD_ERR_CANCELLED). */
void gw_io_cancel(gw_io *io, gw_batch *b);
/* Under b->mu: waits for a change until deadline_ms (td_now_ms clock);
 * false when the deadline passed. */
bool gw_batch_wait(gw_batch *b, int64_t deadline_ms);
/* One router request of a window of features (n_feat floats) and a
 * decoder prompt of n_prompt ids, both allocated for the caller to fill
 * (*s: the sub); NULL with e set (500) when out of memory. */
gw_batch *gw_window_batch(gw_io *io, size_t n_feat, int n_prompt, gw_sub **s, gw_error *e);
/* Under b->mu: waits until s ended or deadline_ms passed; true when it passed first. */
bool gw_sub_wait(gw_batch *b, const gw_sub *s, int64_t deadline_ms);

/* ---- the HTTP side (http.c: server and uploads; serve.c: the answers) ---- */
struct MHD_Connection;

typedef enum gw_route { GW_R_NONE, GW_R_COMPLETIONS, GW_R_TRANSCRIBE, GW_R_TRANSLATE } gw_route;

typedef struct gw_choice {
  gw_text t;
  const gw_out *o;  /* in the batch: read under its mutex only */
  td_i32vec tok;    /* o's tokens copied out (briefly, under the mutex), the connection's own */
  td_f32vec lp;
  int used;         /* of tok, given to t (up to a stop string) */
  int lp_sent;      /* of them, with log-probs given out */
  int shown;        /* of them, announced by an event (a token may add no text yet) */
  td_finish finish; /* copied when its sub ended */
  bool done;        /* its sub ended (copied) */
  bool finished;    /* its finish_reason was given */
} gw_choice;

typedef struct td_gateway td_gateway;

/* One API request: its body, its router requests, its stream. */
typedef struct gw_conn {
  td_gateway *g;
  gw_route route;
  gw_error err;      /* set: refused (answered at the end of the upload) */
  gw_buf body;       /* JSON body, or the uploaded file */
  struct MHD_PostProcessor *pp;
  gw_audio_req audio;
  char field[64];    /* the form field being received */
  gw_buf value;      /* ... and its value so far */
  bool have_file;
  size_t held;          /* upload bytes counted against the gateway's total */
  char close_delim[96]; /* "--BOUNDARY--": what follows it (an epilogue) is not fed to the form parser */
  char tail[96];        /* the last bytes fed, where the delimiter may begin */
  size_t n_tail;
  bool closed;
  /* answering */
  gw_batch *b;
  gw_completion comp;
  gw_choice *ch;
  int n_ch, per_sub; /* choices; of them, each sub's */
  int prompt_tokens;
  int64_t deadline_ms;
  int64_t hold_until_ms; /* a stream's next event not before (coalescing tokens) */
  char cid[64];      /* the response's id */
  long long created;
  double duration;   /* audio seconds */
  gw_buf out;        /* stream: bytes not yet handed to the server */
  size_t out_pos;
  bool answered;     /* the upload ended and was answered */
  int64_t arrived_ms; /* monotonic */
  int64_t arrived_ns; /* the same, finer: the stages of a stream's first event */
  bool staged;       /* those stages observed */
  int status;        /* the HTTP status answered (0: none) */
  bool cancelled, ended;
  /* long-form: the transcription, the audio's whole features (counted in the gateway's held bytes) */
  td_longform *lf;
  float *whole;
  int whole_frames;
  size_t whole_held;
  int lf_fed;        /* segments whose text the stream gave out */
  gw_text lf_text;   /* the stream's text */
  bool lf_text_init;
  int generated;     /* tokens decoded over every window (metrics) */
} gw_conn;

/* The gateway's state the answers need. */
const gw_model *gw_gateway_model(const td_gateway *g);
gw_io *gw_gateway_io(const td_gateway *g);
uint32_t gw_gateway_timeout_ms(const td_gateway *g);
double gw_gateway_max_audio_seconds(const td_gateway *g);
/* Bytes held for requests (uploads, long-form features) against --max-held-bytes: false when over. */
bool gw_gateway_hold(td_gateway *g, size_t bytes);
void gw_gateway_release(td_gateway *g, size_t bytes);
size_t gw_gateway_max_held_bytes(const td_gateway *g);
int gw_gateway_stream_interval_ms(const td_gateway *g); /* 0: none */

/* ---- metrics (metrics.c): thread-safe ---- */
typedef struct gw_metrics gw_metrics;
td_status gw_metrics_create(gw_metrics **out);
void gw_metrics_destroy(gw_metrics *m);
const char *gw_route_name(gw_route r);
/* An API request's end: its endpoint, HTTP status (0: no answer), seconds
 * since arrival (< 0: not observed), tokens and audio seconds. */
void gw_metrics_request(gw_metrics *m, const char *endpoint, int code, double seconds, int prompt_tokens,
                        int generated_tokens, double audio_seconds);
/* An HTTP connection accepted (opened) or closed. */
void gw_metrics_connection(gw_metrics *m, bool opened);
/* A language detection request sent for an endpoint. */
void gw_metrics_language_detection(gw_metrics *m, const char *endpoint);
/* A stream's first event, seconds after the request arrived. */
void gw_metrics_first_event(gw_metrics *m, const char *endpoint, double seconds);
/* Its stages (seconds): arrival to the router, the router to its first answer, that to the event. */
void gw_metrics_stages(gw_metrics *m, const char *endpoint, double admit, double cluster, double answer);
/* The exposition text (malloc'ed). */
td_status gw_metrics_render(gw_metrics *m, int in_flight, char **text, size_t *len);
gw_metrics *gw_gateway_metrics(const td_gateway *g);
/* The status of the reply this thread queued last (gw_reply, streams); 0: none since the last call. */
void gw_note_status(int status);
int gw_take_status(void);

/* Answers a finished upload (queues the response on mc). */
int gw_serve_completions(gw_conn *c, struct MHD_Connection *mc);
int gw_serve_audio(gw_conn *c, struct MHD_Connection *mc);
/* Audio longer than the model's window (longform.c): a's samples decoded. */
int gw_serve_longform(gw_conn *c, struct MHD_Connection *mc, const td_audio *a);
/* Language detection (language.c): one router request, the first window's
 * features (window: n_mels x window frames) after <|startoftranscript|>,
 * one greedy token over the language tokens; sets c->audio.language.
 * Waits on the shared link as a long-form window does; false with *e filled. */
bool gw_detect_language(gw_conn *c, const float *window, gw_error *e);
/* Releases a connection's long-form state (its features' held bytes too). */
void gw_longform_free(gw_conn *c);
/* The answer to a transcription in its response format: text, segments
 * over tok (lp: their log-probabilities, n_lp of them; short audio only). */
int gw_audio_reply(gw_conn *c, struct MHD_Connection *mc, const char *text, const gw_segment *seg, int n_seg,
                   const int32_t *tok, const float *lp, int n_lp);
int gw_reply(struct MHD_Connection *mc, int status, const char *ctype, char *body, size_t len);
int gw_reply_error(struct MHD_Connection *mc, const gw_error *e);
/* Gives the upload's bytes back to the gateway's total (the upload is freed). */
void gw_conn_drop_upload(gw_conn *c);
/* Releases what answering held (cancels router requests still running). */
void gw_conn_free(gw_conn *c);

#endif
