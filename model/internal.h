/* What the model's files share and nothing outside model/ sees: the model
 * struct, the weight types, and the loader that t5.c and bart.c use to read
 * a checkpoint into backend buffers (tensor-parallel slices, folded norms). */
#ifndef TD_MODEL_INTERNAL_H
#define TD_MODEL_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/model.h"
#include "model/safetensors.h"

/* the encoder's micro-batches through pipeline stages, at most (each has its own cu_seqlens in the metadata) */
#define TD_ENC_MICRO_BATCHES 8
/* Encoder graphs (one text input): rows a bucket, and buckets (up to 1024 rows) */
#define TD_ENC_GRAPH_ROWS 64
#define TD_ENC_GRAPHS 16

typedef struct lin {
  void *w;     /* TD_BUF_ACT [out, in] */
  float *b;    /* TD_BUF_F32 [out] or NULL */
  float *wsum; /* TD_BUF_F32 [out]: row sums of w as stored, when a LayerNorm is folded into it; else NULL */
  int out, in;
} lin;

typedef struct norm_w {
  float *w, *b; /* TD_BUF_F32; b NULL for RMSNorm */
  bool folded;  /* norm whose weight (and bias) is folded into the next layer: that GEMM normalises plainly */
} norm_w;

typedef struct enc_layer {
  norm_w ln_attn, ln_ffn;
  lin qkv, o, wi, wo;
} enc_layer;

typedef struct dec_layer {
  norm_w ln_self, ln_cross, ln_ffn;
  lin qkv, o, cq, ckv, co, wi, wo;
} dec_layer;

/* A per-rank view of the sizes: heads and FFN width are this rank's slice. */
typedef struct dims {
  int d, vocab;
  int eh, edh, eff; /* encoder heads, head dim, FFN width */
  int dh_, ddh, dff; /* decoder heads, head dim, FFN width */
  int v0, v1;        /* vocabulary rows of this rank's head */
  int e0, e1, l0, l1; /* encoder and decoder layers of this pipeline stage */
  int stage, stages;
} dims;

/* decode graphs a model keeps: batch buckets 1, 2, 4, ... up to max_seqs */
enum { MAX_GRAPHS = 16 };

struct td_model {
  td_model_config cfg;
  td_gen_config gen;
  td_model_opts opts;
  td_backend *b;
  dims d;
  int max_src, max_tgt;
  int self_stride, cross_stride; /* block-table row widths */

  /* weights */
  void *enc_tok, *dec_tok, *head; /* may alias */
  void *enc_pos, *dec_pos;        /* row 0 = position 0 (offset applied) */
  void *enc_pos_mem, *dec_pos_mem;
  norm_w enc_ln_emb, dec_ln_emb, enc_final, dec_final;
  float *logits_bias; /* [v1 - v0] */
  float *enc_lut, *dec_lut;
  lin conv1, conv2;
  enc_layer *enc;
  dec_layer *dec;

  void *self_pool, *cross_pool;

  /* scratch */
  void *e_h, *e_x, *e_qkv, *e_attn, *e_ff, *e_ff1, *w_col1, *w_c1, *w_col2, *w_feat;
  size_t e_ff_n; /* e_ff's elements: the cross K/V of several layers at once land there */
  /* every decoder layer's cross K/V weights as one [layers * ckv.out, ckv.in] matrix (and its biases, zeros
   * where a layer has none; NULL where none has one): dec[l].ckv points into it, so that a short encoder
   * run projects the K/V of several layers in one GEMM (NULL: per layer) */
  void *ckv_w;
  float *ckv_b;
  void *d_h, *d_x, *d_qkv, *d_attn, *d_q, *d_ff, *d_ff1, *d_lx;
  void *d_qs, *d_us; /* the states path: per-head queries and mixes over the states [T, heads, d] */
  float *logits;                    /* [max_logits, vocab] */
  float *logits_part, *logits_all; /* tensor parallel: this rank's columns, all ranks' */
  int32_t *meta_dev, *meta_host;
  size_t meta_cap;
  /* pp_sets 2 on the first stage: set 1's metadata and logits (set 0's are
   * the ones above); a set launched and its logits not yet collected, their
   * receive posted, their rows */
  int32_t *meta_dev1, *meta_host1;
  float *logits1;
  bool set_out[2], set_posted[2];
  int set_rows[2];
  /* decode graphs by batch bucket */
  int buckets[MAX_GRAPHS];
  int n_buckets;
  td_graph *graphs[MAX_GRAPHS];
  /* encoder graphs of one text input by bucket of TD_ENC_GRAPH_ROWS rows,
   * up to enc_graph_max rows (n_enc_graphs 0: none) */
  td_graph *enc_graphs[TD_ENC_GRAPHS];
  int n_enc_graphs, enc_graph_max;
  /* decode steps of more rows leave the cross query's folded RMSNorm to
   * the attention (td_paged_meta.q_norm): the backend's
   * td_backend_fused_norm_rows, or td_model_tuning.qnorm_rows */
  int q_norm_rows;
  /* steps of at least this many rows attend over the cross pool's states
   * (0 in STATES, INT_MAX in KV) */
  int states_rows;
  bool states_auto; /* dual pool, the backend's rows: td_attn_states_takes decides each row count */
  td_model_mirror mirror;
};

/* ---- the loader (weights.c) ---- */

typedef struct loader {
  td_checkpoint *ck;
  td_backend *b;
  const td_model_config *c;
  const char *dir;
  int rank, tp;
  float *tmp, *tmp2;
  size_t cap, cap2;
  const float *fold;   /* the next ld_lin scales W's input columns by this (then clears it) */
  const float *fold_b; /* ... and adds W times this to its bias, and keeps W's row sums (a LayerNorm's bias) */
} loader;

typedef enum split { SPLIT_NONE, SPLIT_ROWS, SPLIT_COLS } split;

/* Grows *buf to n floats. */
td_status ld_fit(float **buf, size_t *cap, size_t n);
/* The tensor called name; a missing required one sets the error. */
const td_tensor_info *ld_find(loader *ld, const char *name, bool required);
/* Reads a tensor into ld->tmp after checking its shape. */
td_status ld_read_f32(loader *ld, const char *name, int ndim, const int64_t *shape);
td_status ld_upload(loader *ld, td_buf_type type, const float *src, size_t n, void **out);
td_status ld_norm(loader *ld, const char *prefix, int n, norm_w *out);
/* A norm folded into the next ld_lin (fw, fb: scratch for its weight and bias). */
td_status ld_norm_fold(loader *ld, const char *prefix, int n, norm_w *out, float *fw, float *fb);
/* A linear layer from n_parts row blocks, sliced for tensor parallelism by sp. */
td_status ld_lin(loader *ld, int n_parts, const char *const *wnames, const char *const *bnames, const int *rows,
                 int in, split sp, lin *out);
td_status ld_lin1(loader *ld, const char *wname, const char *bname, int rows, int in, split sp, lin *out);
/* Around the encoder's layers: with the encoder split by rows, every rank
 * loads them whole (the loader's slice set to one rank of one), then back. */
void loader_encoder_begin(const td_model *m, loader *ld);
void loader_encoder_end(const td_model *m, loader *ld);
/* A [rows, d] table uploaded whole, less its first skip_rows. */
td_status ld_table(loader *ld, const char *name, int rows, int d, int skip_rows, void **out);

/* The weights of this rank's layers, the embeddings and the head (weights.c). */
td_status weights_load(td_model *m, const char *dir);
/* The families' checkpoint layouts: T5 (t5.c); BART, mBART, Marian and
 * Whisper under prefix P (bart.c). */
td_status t5_load(td_model *m, loader *ld);
td_status bart_load(td_model *m, loader *ld, const char *P);

/* ---- the follower mirror (mirror.c) ---- */

/* Publishes a call to the followers when a mirror is set. */
td_status mirror_publish_encode(td_model *m, const td_encode_input *in);
td_status mirror_publish_step(td_model *m, const td_step_input *in);
td_status mirror_publish_project(td_model *m, const int32_t *cross_slots, int n);

#endif
