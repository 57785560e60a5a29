/* The router's decisions as pure functions (no sockets, no globals, no
 * clock): what admission refuses and what it works out of a request
 * (router/admit.c), and which workers a request goes to (router/placement.c).
 * Private to the router; tests call them on hand-built inputs. */
#ifndef TD_ROUTER_POLICY_H
#define TD_ROUTER_POLICY_H

#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"
#include "tandem.pb-c.h"

/* ---- admission ---- */

/* What a valid request needs. */
typedef struct td_req_shape {
  int enc_len;    /* encoder positions */
  int n_prompt;   /* decoder prompt tokens (>= 1: the start token when none given) */
  int max_new;    /* tokens to generate */
  int width;      /* sequences run together: num_beams when > 1, else n */
  int need_cross; /* cross KV blocks (shared by the sequences) */
  int need_self;  /* self KV blocks, for every sequence, an upper bound */
  bool probe;     /* a probe (SamplingParams.probe): its decode worker computes the whole prompt */
} td_req_shape;

/* A client's request id: 1 to TD_ROUTER_MAX_REQUEST_ID bytes. */
td_status td_admit_request_id(const char *id, char *msg, size_t cap);

/* What the router can convert (router/main.c's --tokenizer). */
typedef struct td_admit_frontend {
  bool text;  /* a tokenizer: text in, text out */
  bool audio; /* a Whisper checkpoint's feature extractor and prompt */
} td_admit_frontend;

/* A request's input before conversion: exactly one of input_ids, features,
 * text and audio; text and audio within their limits and only where the
 * router can convert them; language / task / timestamps only with audio,
 * whose decoder prompt the router builds (so it takes none). */
td_status td_admit_inputs(const td_admit_frontend *fe, const Tandem__GenerateRequest *g, char *msg, size_t cap);

/* Checks a request against the served model (model->name: the served name,
 * model->model_type: its type) and the fixed limits; each refusal names the
 * limit in msg (TD_ERR_NOT_FOUND for another model, else TD_ERR_INVALID). */
td_status td_admit_request(const Tandem__ModelInfo *model, int block_size, const Tandem__GenerateRequest *g,
                           td_req_shape *out, char *msg, size_t cap);

/* ---- placement ---- */

/* A registered worker as placement sees it. */
typedef struct td_place_worker {
  const char *id;
  bool enc, pre, dec; /* roles */
  bool enc_self;      /* encodes its own requests only (a TP / PP group: its KV is sliced across ranks) */
  bool states_out;    /* an encoder that pushes encoder states: only to workers that project them */
  bool projects;      /* takes encoder states pushes and projects them into K/V */
  bool kv8;           /* its cross K/V in int8: K/V pushes only between two such workers (encoder states any) */
  bool draining;      /* finishing its work: nothing new goes there */
  int cross_blocks;   /* its cross KV pool */
  int max_running;    /* sequences its decode step runs at once */
  int jobs;           /* requests of any stage placed there */
  int committed_cross, committed_self; /* blocks placed requests hold or will */
  int enc_batch;      /* encoder positions one encoder run takes (0: unknown) */
  int enc_pending;    /* encoder positions placed there and not yet encoded */
  int decoding;       /* requests there whose encoding is over (decoding or prefilling) */
} td_place_worker;

/* What this attempt of a request needs. */
typedef struct td_place_req {
  int need_cross, need_self;
  int width;
  int n_prompt; /* decoder prompt tokens this attempt feeds (resumed tokens included) */
  int enc_len;  /* encoder positions */
  bool no_prefill; /* the decode worker computes the whole prompt (a probe reads a prompt row) */
  /* a decode worker that failed this request's last attempt (NULL: none):
   * it takes the next one only when no other fits, so that a worker that
   * fails whatever it gets (its group lost a rank) does not spend every attempt */
  const char *avoid_dec;
} td_place_req;

/* The router's placement settings. */
typedef struct td_place_opts {
  int prefill_threshold; /* decoder prompts this long go to a prefill worker */
  int encode_runs;       /* an encoder's queue: at most this many of its runs (enc_batch) */
  int local_encode_pct;  /* a decode worker that shares the encoding with encoder-only workers
                            encodes while fewer than this % of its max_running are decoding */
  double local_encode_margin; /* ... and only while the encoder-only workers have more than this many of
                                 its encoder runs (enc_batch positions) pending beyond its own (0: any more) */
} td_place_opts;

typedef enum td_place_status {
  TD_PLACE_OK,    /* placed */
  TD_PLACE_WAIT,  /* a registered worker can run it once it has room: stay queued */
  TD_PLACE_NEVER, /* no registered worker can run it: refuse */
} td_place_status;

typedef struct td_placement {
  int decode;   /* indices into the pool */
  int encode;   /* -1: the decode worker encodes (local_encode) */
  bool local_encode;
  int prefill;  /* -1: the decode worker runs the prompt */
  char why[256]; /* WAIT, NEVER: what is missing */
  bool missing;  /* WAIT because no live worker has a role it needs (none registered, every one draining), not
                    because the live ones are busy: the router waits only a bounded time for one */
} td_placement;

/* Chooses the workers of one request among pool[0..n) (registration order):
 * - the decode worker with room for its cross KV, a place in its queue
 *   (jobs < TD_ROUTER_JOBS_PER_SEQ x max_running) and max_running >= width,
 *   fewest jobs first, then fewest committed self blocks, then the earlier;
 * - the encoder: with no encoder-only worker in the pool, the decode worker
 *   when it encodes (as before any queue bound), else an encoder with room;
 *   with encoder-only workers, the encoder-only worker or (when it encodes
 *   and fewer than local_encode_pct % of its max_running are decoding: an
 *   encoder run stalls its whole decode batch, which pays only while that
 *   batch is small) the decode worker itself whose queue has room, fewest
 *   pending positions first (a decode worker's counted local_encode_margin x
 *   its enc_batch higher), an encoder-only worker on a tie. Room: nothing pending, or the
 *   pending positions and this request's within encode_runs x enc_batch (no
 *   bound when enc_batch is unknown). Encoders that are all full: WAIT, so
 *   that the queue drains to whichever encoder frees up first, and a decode
 *   GPU that also encodes takes the share its encoder runs can take;
 * - a prefill worker (with room for the cross KV) when the prompt has at
 *   least prefill_threshold tokens and neither the decode worker prefills nor
 *   encodes.
 * Draining workers are skipped. */
td_place_status td_place(const td_place_worker *const *pool, int n, const td_place_req *q, const td_place_opts *o,
                         td_placement *out);

/* Whether some registered decode worker (draining or not) could ever run
 * the request: a batch as wide and a cross pool as large. Else why. With
 * none registered: true (one may register; td_place waits for it as for any
 * role no live worker has). */
bool td_place_possible(const td_place_worker *const *pool, int n, const td_place_req *q, char *why, size_t cap);

#endif
