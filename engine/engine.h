/* The engine every worker runs: requests in a continuous batch, KV in paged
 * blocks, greedy / sampled / beam-search decoding.
 *
 * One iteration (td_engine_step) encodes newly admitted requests, then runs
 * one decoder step over the running sequences: decode rows (one token each)
 * and chunks of prompts that still need their KV, under a per-step token
 * budget (in-flight batching). Admission is by free blocks; when blocks run
 * short, new work waits and running requests are preempted by recompute,
 * newest first. Not thread-safe: one thread drives an engine. */
#ifndef TD_ENGINE_ENGINE_H
#define TD_ENGINE_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "kvcache/kvcache.h"
#include "model/model.h"

typedef struct td_engine td_engine;

typedef struct td_engine_opts {
  int self_blocks;        /* decoder self-attention pool (blocks) */
  int cross_blocks;       /* cross-attention pool (blocks) */
  int max_running;        /* sequences in the decoder batch (beams count each) */
  int max_step_tokens;    /* decoder rows per step */
  int max_enc_tokens;     /* encoder tokens per step */
  int max_queue;          /* requests waiting or running; more are refused */
  bool recompute_cross;   /* on preemption free cross KV too (re-encode later) */
} td_engine_opts;

/* Decoding parameters of a request. td_request_params_default gives "use
 * the model's defaults" for everything. */
typedef struct td_request_params {
  int max_new_tokens;     /* <= 0: from generation_config max_length or the model limit */
  float temperature;      /* <= 0: greedy */
  int top_k;              /* <= 0: off */
  float top_p;            /* >= 1: off */
  uint64_t seed;
  bool has_seed;
  int n;                  /* independent samples */
  int num_beams;          /* > 1: beam search */
  int num_return_sequences;
  float length_penalty;
  int early_stopping;     /* 1 true, 0 false (heuristic), -1 never */
  const int32_t *stop_ids;/* finish when one of these is produced (besides EOS) */
  int n_stop_ids;
  bool logprobs;          /* per-token log-probabilities in the output */
  int forced_bos;         /* -2: generation_config; -1: none; else the id */
  int forced_eos;         /* -2: generation_config; -1: none; else the id */
  bool ignore_eos;        /* do not stop on the model's EOS ids */
  bool all_logits;        /* keep the logits of every decoder position (greedy, n = 1) */
} td_request_params;

void td_request_params_default(td_request_params *p);

typedef struct td_request {
  const char *id;
  const int32_t *input_ids;   /* text models */
  int n_input;
  const float *features;      /* Whisper: [mels, frames] */
  const int32_t *prompt;      /* decoder prompt; NULL/0: the decoder start token */
  int n_prompt;
  td_request_params params;
  void *user;
} td_request;

typedef enum td_finish { TD_FINISH_NONE, TD_FINISH_STOP, TD_FINISH_LENGTH, TD_FINISH_CANCELLED, TD_FINISH_ERROR } td_finish;
const char *td_finish_name(td_finish f);

typedef struct td_seq_output {
  const int32_t *tokens;   /* generated tokens (prompt excluded); a stop token is the last */
  int n_tokens;
  const float *logprobs;   /* when asked: per token */
  double score;            /* beam search: length-normalised log-probability */
  double cum_logprob;
  td_finish finish;
} td_seq_output;

typedef struct td_result {
  uint64_t handle;
  const char *id;
  void *user;
  td_status status;        /* TD_OK, or why the request failed */
  const char *error;
  int n_outputs;
  const td_seq_output *outputs; /* best first */
  const float *logits;     /* all_logits: [n_logit_rows, vocab] */
  int n_logit_rows;
} td_result;

typedef struct td_engine_callbacks {
  /* A token appended to sequence `seq` of a sampled (non-beam) request. */
  void (*on_token)(void *ctx, uint64_t handle, void *user, int seq, int32_t token, float logprob);
  /* The request ended; r and everything it points to is valid during the call only. */
  void (*on_finish)(void *ctx, const td_result *r);
  void *ctx;
} td_engine_callbacks;

typedef struct td_engine_stats {
  int waiting, running, preempted;
  int64_t steps, encodes, preemptions, tokens_generated, prompt_tokens;
  td_kv_pool_stats self, cross;
} td_engine_stats;

/* The engine allocates its pools on the model's backend and binds them. */
td_status td_engine_create(td_model *m, const td_engine_opts *opts, const td_engine_callbacks *cb, td_engine **out);
void td_engine_destroy(td_engine *e);

/* Validates and queues a request (copied). Bad input answers at once with
 * a clear error and nothing is queued. */
td_status td_engine_add(td_engine *e, const td_request *r, uint64_t *handle);
/* Ends a request now (on_finish with TD_FINISH_CANCELLED); blocks are freed. */
td_status td_engine_cancel(td_engine *e, uint64_t handle);
/* One iteration; returns TD_OK when idle too. Per-request failures go to
 * on_finish; a returned error means the engine itself failed. */
td_status td_engine_step(td_engine *e);
bool td_engine_idle(const td_engine *e);
td_engine_stats td_engine_get_stats(const td_engine *e);
/* Checks block accounting: every block of both pools is free or held by a
 * live sequence; TD_ERR_INTERNAL with a message otherwise. */
td_status td_engine_check(const td_engine *e);

#endif
