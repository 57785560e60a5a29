/* The engine's private state, shared by its files:
 *   engine.c    create / destroy, add (building a request's group), cancel, stats, checks
 *   validate.c  what a request may ask: every limit, refused at admission
 *   group.c     sequences and groups: forks, block release, the final report
 *   encode.c    admission of waiting requests into an encoder batch
 *   schedule.c  building a decoder step: chunks, blocks, preemption
 *   sample.c    sampling parameters a row, the sampler and beam top-k
 *   beam.c      beam search: hypotheses and transformers' stopping rules
 *   step.c      td_engine_step: the model run and applying its results
 *   enccache.c  the encoder cache: cross KV kept by a hash of the encoder input */
#ifndef TD_ENGINE_INTERNAL_H
#define TD_ENGINE_INTERNAL_H

#include <uthash.h>

#include "common/vec.h"
#include "engine/engine.h"

typedef struct seq {
  td_i32vec tok;  /* prompt + generated */
  td_i32vec blk;  /* self-attention blocks */
  td_f32vec lp;   /* per generated token */
  int n_computed; /* tokens whose KV is in the cache */
  double sum_lp;
  int stream;
  td_finish finish;
} seq;

/* A finished beam hypothesis. */
typedef struct hyp {
  int32_t *tok; /* generated tokens */
  float *lp;
  int n;
  double score, sum_lp;
} hyp;

typedef enum gstate { G_WAITING, G_RUNNING } gstate;

/* One request: its sequences (one, or its samples / beams once forked). */
typedef struct group {
  uint64_t handle;
  char *id;
  void *user;
  td_request_params p;
  int32_t *stop_ids;
  int32_t *allowed; /* p.n_allowed ids, sorted: the only tokens it may generate */
  int32_t *input;
  int n_input;
  float *features;
  int enc_len;
  int32_t *prompt;
  int n_prompt;
  int max_new;
  int forced_bos, forced_eos;
  bool beam; /* beam search */
  int width; /* samples or beams */
  td_i32vec cross;
  seq **s; /* live sequences */
  int n_s;
  seq **done; /* finished samples */
  int n_done;
  hyp *hyps; /* finished beam hypotheses, at most width */
  int n_hyps;
  td_f32vec logits; /* all_logits */
  int n_logit_rows;
  gstate state;
  bool forked; /* prompt done and split into samples / beams */
  bool encode_only;
  int prefill_only;
  /* encoder cache: the input's hash (computed once), and whether its cross
   * KV came from the cache this admission */
  bool hashed, hit;
  uint64_t key_hash;
  struct centry *lent; /* the entry whose key is this group's features (Whisper): theirs when the group lets go */
  uint32_t step_offset;
  /* the probe (td_request_params.probe): its value once its row ran */
  bool probe_done;
  double probe_prob;
  /* two running sets (a pipeline's first stage, td_model_opts.pp_sets 2):
   * the set it steps in; a cancel that waits for its set's logits */
  int set;
  bool cancel_pending;
  /* per step */
  bool scheduled, completes;
  int row0; /* completes: its first row of the ordered sample rows (order_rows) */
  int probe_x; /* the probe's row this step: -1 none, -2 its sample row, else its extra row */
  UT_hash_handle hh;
} group;

/* What a validated request asks for, as the engine will run it. */
typedef struct eng_admit {
  bool whisper, ext_cross, beam;
  int n_prompt, max_new, width, enc_len;
  int forced_bos, forced_eos;
} eng_admit;

/* What one logit row is for. */
typedef struct row_use {
  group *g;
  int seq; /* index into g->s */
} row_use;

/* The decoder step being built and run; every array is sized at create. */
typedef struct eng_batch {
  int n_tok, n_seq;  /* query rows and sequences */
  int n_rows;        /* sample rows: the last query row of completing sequences */
  int n_extra;       /* all_logits and probe rows besides the sample rows */
  int n_sched;       /* groups in the step */
  int n_samp, k;     /* ordered: n_samp sampled rows, then beam rows of top-k width k */
  /* model input: [max_step_tokens] */
  int32_t *tok, *pos, *slots;
  /* [max_running (+ 1)] */
  int32_t *qs, *ctx, *clen, *tab, *ctab;
  int *chunks;       /* one group's tokens a sequence */
  group **sched;
  /* [max_rows] */
  int32_t *rows, *extra_rows, *ordered;
  row_use *use, *ouse;
  group **extra_group;
} eng_batch;

/* Sampling buffers, on the backend (d_) and the host (h_). */
typedef struct eng_sampler {
  td_sample_row *d_rows, *h_rows;
  int32_t *d_bans, *h_bans;
  int cap_bans;
  int32_t *d_tok, *h_tok;
  float *d_lp, *h_lp;
  int32_t *d_ids, *h_ids;
  float *d_vals, *h_vals;
  int max_k;       /* top-k width of the beam rows: 2 x the most beams */
  float *h_logits; /* one downloaded row for all_logits */
} eng_sampler;

/* An encoder-cache entry: one reference to each block of an encoded input. */
typedef struct centry {
  uint64_t hash;
  void *key; /* the encoder input, compared in full on a hit */
  size_t key_bytes;
  /* the group whose features key is (not a copy: 1.5 MB a Whisper window, a
   * malloc and a memcpy that cost 5-7 % of a burst), until it releases them
   * (eng_release_features); NULL: the entry owns key */
  struct group *lender;
  int32_t *blocks;
  int n_blocks;
  struct centry *older, *newer; /* LRU list */
  UT_hash_handle hh;
} centry;

typedef struct eng_cache {
  centry *by_hash;
  centry *oldest, *newest;
  int budget;    /* blocks the entries may hold */
  int n_blocks;  /* blocks they hold */
  int n_entries;
  uint64_t mask; /* hash bits used: all but in tests (collisions on demand) */
} eng_cache;

struct td_engine {
  td_model *m;
  td_backend *b;
  td_engine_opts o;
  td_engine_callbacks cb;
  td_kv_pool *self, *cross;
  int bs, V, max_src, max_tgt;
  int self_stride, cross_stride;
  int max_rows;       /* logit rows a step */
  int max_width;      /* sequences one request may run: what a step always fits */
  const char *width_limit; /* the option that sets max_width */
  const td_model_config *cfg;
  const td_gen_config *gen;
  uint64_t next_handle;
  group *by_handle;
  td_ptrvec wait, run; /* of group */
  group **enc_batch;   /* [max_enc_seqs] */
  /* a Whisper encoder batch's features, page-locked so that the upload is
   * one DMA (from pageable memory the driver copies through its own staging
   * first: 2-4 ms of 16 windows on an H200 host, the GPU idle); made at the
   * first encoder run, of feat_stage_n floats */
  float *feat_stage;
  size_t feat_stage_n;
  bool feat_stage_tried; /* a failed allocation is not retried every run */
  eng_batch batch, batch1; /* set 0's step (the only one with one set) and set 1's */
  eng_batch *bt;           /* the step being built, run or applied */
  /* two running sets: stepped alternately, one set's step in the later
   * stages while the other's logits are sampled (docs/architecture.md) */
  bool two_sets;
  int cur;     /* the set the next step launches */
  bool out[2]; /* a set's step launched, its logits not yet collected */
  int enc_deferred; /* steps the waiting requests' encoder run was put off (opts.encode_defer_steps) */
  eng_sampler smp;
  int *ext_self, *ext_cross; /* references held by callers (handed-over blocks) */
  eng_cache cache;
  td_engine_stats st;
};

static inline int eng_blocks_for(int tokens, int bs) { return (tokens + bs - 1) / bs; }
/* The pool slots of positions 0..n-1 of a sequence whose cross KV is in blocks. */
static inline void eng_cross_slots(const int32_t *blocks, int n, int bs, int32_t *out) {
  for (int t = 0; t < n; t++) out[t] = blocks[t / bs] * bs + t % bs;
}

/* validate.c */
td_status eng_validate(const td_engine *e, const td_request *r, eng_admit *a);

/* group.c */
void eng_seq_free(td_engine *e, seq *s);
void eng_seq_release_blocks(td_engine *e, seq *s);
/* A copy of parent sharing its blocks (copy-on-write), plus token tok. */
td_status eng_seq_fork(td_engine *e, const seq *parent, int32_t tok, float lp, int stream, seq **out);
void eng_group_free(td_engine *e, group *g);
/* Reports and frees a group that left the engine. */
void eng_group_finish(td_engine *e, group *g, td_status status, const char *error, td_finish why);
void eng_group_fail(td_engine *e, group *g, td_status s, const char *msg);
bool eng_is_stop(const td_engine *e, const group *g, int32_t t);

/* encode.c */
td_status eng_encode_phase(td_engine *e);
/* Two running sets: the one with fewer running sequences (ties: the set
 * the coming step launches), for a request that starts running. */
int eng_pick_set(const td_engine *e);

/* enccache.c */
void eng_cache_init(td_engine *e);
/* One encoder run at each GEMM plan bucket up to max_enc_tokens (warm.c). */
td_status eng_warm_encoder(td_engine *e);
/* The entry holding g's encoder input, or NULL (disabled, absent, or a
 * different input under the same hash). */
centry *eng_cache_find(td_engine *e, group *g);
/* g shares the entry's blocks (g->cross reserved to n_blocks). */
void eng_cache_use(td_engine *e, centry *c, group *g);
/* Caches g's freshly allocated cross blocks (to be encoded this step). */
void eng_cache_insert(td_engine *e, group *g);
/* g's encoding failed: drops the entry made for its blocks. */
void eng_cache_forget(td_engine *e, const group *g);
/* g no longer needs its features: they become its cache entry's key, or are freed. */
void eng_release_features(td_engine *e, group *g);
/* Blocks only the cache holds (free on demand). */
int eng_cache_idle_blocks(const td_engine *e);
/* Counts the cache's references per cross block into refs. */
void eng_cache_holders(const td_engine *e, int *refs);
/* Tests: keeps only these hash bits, so that different inputs collide. */
void eng_cache_set_hash_mask(td_engine *e, uint64_t mask);

/* schedule.c */
td_status eng_batch_init(td_engine *e, eng_batch *bt);
void eng_batch_free(eng_batch *bt);
/* Fills e->batch with the running groups that fit this step, preempting
 * the newest when blocks run short. An empty batch (n_tok 0) runs nothing. */
td_status eng_schedule(td_engine *e);

/* sample.c */
td_status eng_sampler_init(td_engine *e);
void eng_sampler_free(td_engine *e);
/* Samples the batch's ordered rows of logits: tokens into h_tok / h_lp for
 * the sampled rows, top-k log-probs into h_ids / h_vals for beam rows. */
td_status eng_sample(td_engine *e, float *logits);

/* beam.c */
/* One beam-search step of g from its rows' top-k log-probs; *done when the
 * request has finished. */
td_status eng_beam_step(td_engine *e, group *g, const int32_t *ids, const float *vals, int k, bool *done);
/* The best hypotheses, best first, as outputs (outs holds n_hyps). */
int eng_beam_outputs(const td_engine *e, group *g, td_seq_output *outs);

#endif
