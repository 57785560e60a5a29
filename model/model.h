/* An encoder-decoder model on a backend: weights loaded from a Hugging Face
 * checkpoint, the encoder forward (writing cross-attention KV into a paged
 * pool) and the decoder step (prompt chunks and decode rows together, KV read
 * through block tables). All scratch memory is sized at load from the
 * limits in td_model_opts; a step allocates nothing. */
#ifndef TD_MODEL_MODEL_H
#define TD_MODEL_MODEL_H

#include <stdint.h>

#include "common/status.h"
#include "common/cross_mode.h"
#include "common/settings.h"
#include "kernels/ops.h"
#include "model/config.h"

typedef struct td_model td_model;


typedef struct td_model_opts {
  int block_size;          /* KV slots per block */
  int max_tokens;          /* decoder query rows per step */
  int max_seqs;            /* sequences per step */
  int max_logits;          /* logit rows per step (default max_seqs) */
  int max_enc_tokens;      /* encoder tokens per encode call (Whisper: frames out) */
  int max_enc_seqs;        /* sequences per encode call */
  int max_source_len;      /* 0: the model's own limit */
  int max_target_len;      /* 0: the model's own limit */
  int tp_rank, tp_size;    /* tensor-parallel slice (1 = whole model) */
  int pp_rank, pp_size;    /* pipeline stage: this rank's share of the layers */
  /* PP: 2 = two running sets stepped alternately, every rank alike (a step
   * goes through the stages whole, one micro-batch; the first stage uses
   * td_model_step_launch / _collect); 0 or 1: one set, a step in micro-batches */
  int pp_sets;
  /* TP: every rank holds the whole encoder and runs its share of the rows
   * (td_rows_split), the K/V of each layer all-gathered (one collective a
   * layer, half the bytes of the two all-reduces of a head split, and no
   * norm or activation repeated); false: each rank its heads and FFN slice */
  bool enc_rows;
  bool no_graphs;          /* run decode steps eagerly even where graphs exist */
  /* What the cross pool caches of each sequence (every process that
   * shares a model's cross blocks must agree): see td_cross_mode. */
  td_cross_mode cross_mode;
  /* TD_CROSS_DUAL: steps of at least this many rows attend over the states,
   * smaller ones over the per-layer K/V (0: the backend's choice,
   * td_attn_states_rows; -1: never) */
  int states_rows;
  /* The cross pool's per-layer K/V in int8, a float scale a (position,
   * head) row (td_kv_layout.int8): 0.53x the bytes a decode step reads of
   * them, and 1.5-1.9x the sequences a pool holds, for values within 1/254 of
   * each row's largest (not the reference's bits: off by default). CUDA,
   * one rank, a cross mode with K/V; no cross K/V may move between
   * processes (the router keeps such a worker's encodes local). */
  bool cross_int8;
  td_model_tuning tuning; /* graph choices (common/settings.h) */
} td_model_opts;

/* Fills unset (zero) fields with defaults. */
void td_model_opts_default(td_model_opts *o);

td_status td_model_load(const char *dir, td_backend *b, const td_model_opts *opts, td_model **out);
void td_model_destroy(td_model *m);

const td_model_config *td_model_get_config(const td_model *m);
const td_gen_config *td_model_get_gen(const td_model *m);
const td_model_opts *td_model_get_opts(const td_model *m);
td_backend *td_model_backend(const td_model *m);
int td_model_max_source_len(const td_model *m);
int td_model_max_target_len(const td_model *m);
/* The fewest rows of a step that attend over the cross pool's states
 * (0 in TD_CROSS_STATES; INT_MAX where no step does). */
int td_model_states_rows(const td_model *m);
/* Whether a decode step of `rows` rows attends over the states (from
 * td_model_states_rows on; with the backend's choice, by its row count). */
bool td_model_takes_states(const td_model *m, int rows);
/* The row counts in [1, max_rows] that take the states, as ranges
 * [r[i][0], r[i][1]]: how many ranges there are (the first n stored). */
int td_model_states_ranges(const td_model *m, int max_rows, int (*r)[2], int n);
/* Decoder self-attention and cross-attention pool layouts. */
td_kv_layout td_model_self_layout(const td_model *m);
td_kv_layout td_model_cross_layout(const td_model *m);
/* Encoder output length for an input of `input_len` tokens (Whisper: the
 * number of frames after the stride-2 convolution). */
int td_model_encoder_out_len(const td_model *m, int input_len);
/* Whisper input frames per request (2 x max_source_positions); 0 for text models. */
int td_model_input_frames(const td_model *m);

/* The pools the model reads and writes (backend memory). */
void td_model_set_pools(td_model *m, void *self_pool, void *cross_pool);
/* Captures the decode step of every batch bucket now (after the pools are
 * set: the graphs hold their addresses), so that no request pays for a
 * capture; a no-op without graphs and for TP / PP ranks, which capture as
 * their steps come. */
td_status td_model_capture_graphs(td_model *m);
/* Captures the encoder of one text input at every bucket of up to 1024
 * rows (64 a bucket), after the encoder's warm-up (its GEMM plans and the
 * bias copies they take exist then); td_model_encode then runs one input
 * as its bucket's graph, padded. A no-op without graphs, for Whisper and
 * for TP / PP ranks. */
td_status td_model_capture_encoder_graphs(td_model *m);
/* The longest single input td_model_encode runs as a captured graph (0:
 * none captured, every input runs eagerly). */
int td_model_encoder_graph_rows(const td_model *m);

typedef struct td_encode_input {
  int n_seqs;
  const int32_t *lens;     /* host [n_seqs]: input tokens per sequence (text models) */
  const int32_t *tokens;   /* host, packed (text models) */
  const float *features;   /* host [n_seqs, mels, frames] (Whisper) */
  const int32_t *cross_slots; /* host [sum of output lengths]: cross pool slot per encoder position */
} td_encode_input;

/* Runs the encoder and writes every decoder layer's cross-attention K/V
 * into the cross pool. enc_out (host, may be NULL) receives the final
 * encoder hidden states [sum of output lengths, d_model]. Synchronous. */
td_status td_model_encode(td_model *m, const td_encode_input *in, float *enc_out);

/* Projects the encoder states that a cross block's states tail holds (a
 * states push; cross mode dual) into every decoder layer's cross K/V of the
 * same slots, as td_model_encode would have written them: per layer one
 * GEMM over all n rows (host cross_slots, negative: skipped), in chunks of
 * the encoder's workspace. On a TP / PP leader the call is mirrored: every
 * rank projects its own heads or layers from its own (whole) states tails.
 * Synchronous. */
td_status td_model_project_cross(td_model *m, const int32_t *cross_slots, int n);

typedef struct td_step_input {
  int n_seqs, n_tokens;
  const int32_t *tokens;      /* [n_tokens] */
  const int32_t *positions;   /* [n_tokens] */
  const int32_t *q_start;     /* [n_seqs + 1] */
  const int32_t *ctx_len;     /* [n_seqs]: self KV length after this step */
  const int32_t *slots;       /* [n_tokens]: self pool slot written by each row */
  const int32_t *block_table; /* [n_seqs * block_stride] */
  int block_stride;
  const int32_t *cross_len;   /* [n_seqs] */
  const int32_t *cross_table; /* [n_seqs * cross_stride] */
  int cross_stride;
  int n_logits;
  const int32_t *logit_rows;  /* [n_logits]: rows whose next-token logits are wanted */
} td_step_input;

/* One decoder step. All arrays are host memory. On success *logits points
 * to backend memory holding float32 [n_logits, vocab], valid until the next
 * step; the work may still be in flight (td_sync or a download waits). */
td_status td_model_step(td_model *m, const td_step_input *in, const float **logits);
/* Two running sets (pp_sets 2), the first stage only: launch runs this
 * stage's layers of set `set`'s step (0 or 1) and sends them on; where the
 * other set's logits are due it posts their receive with that send
 * (td_sendrecv: the last stage sends them before it takes this step).
 * Collect hands back a launched set's logits (posting their receive when no
 * launch did). td_model_step refuses while a set is out; td_model_encode
 * first posts the receive of a launched set's logits that no launch posted
 * (the last stage sends those before it takes the encoder run). */
td_status td_model_step_launch(td_model *m, const td_step_input *in, int set);
td_status td_model_step_collect(td_model *m, int set, const float **logits);

/* Tensor parallelism: the leader rank's engine drives its model; every
 * encode and step call is also published, as bytes, to the other ranks,
 * whose models replay it (the collectives inside meet). */
typedef struct td_model_mirror {
  td_status (*publish)(void *ctx, const void *bytes, size_t len);
  void *ctx;
} td_model_mirror;
void td_model_set_mirror(td_model *m, const td_model_mirror *mirror);
/* Copies self-attention blocks (copy-on-write), on every rank. */
td_status td_model_copy_self_blocks(td_model *m, const int32_t *pairs, int n_pairs);
/* Runs the call described by bytes from the leader's mirror. */
td_status td_model_replay(td_model *m, const void *bytes, size_t len);

#endif
