/* What a backend implements; ops.c validates arguments and dispatches. */
#ifndef TD_KERNELS_BACKEND_IMPL_H
#define TD_KERNELS_BACKEND_IMPL_H

#include "kernels/ops.h"

typedef struct td_backend_vt {
  void (*destroy)(td_backend *b);
  td_status (*alloc)(td_backend *b, size_t bytes, void **out);
  void (*free)(td_backend *b, void *p);
  td_status (*host_alloc)(td_backend *b, size_t bytes, void **out);
  void (*host_free)(td_backend *b, void *p);
  td_status (*upload)(td_backend *b, td_buf_type t, void *dst, const float *src, size_t n);
  td_status (*download)(td_backend *b, td_buf_type t, const void *src, float *dst, size_t n);
  td_status (*copy)(td_backend *b, void *dst, const void *src, size_t bytes, int dir); /* 0 h2d 1 d2h 2 d2d */
  td_status (*sync)(td_backend *b);
  td_status (*gemm)(td_backend *b, const void *x, const void *w, const float *bias, void *y, int m, int n, int k,
                    td_act act, unsigned flags);
  td_status (*norm)(td_backend *b, const void *x, const float *w, const float *bias, void *y, int m, int n,
                    float eps, bool rms);
  td_status (*gated_act)(td_backend *b, const void *x, void *y, int m, int f, td_act act);
  td_status (*embed)(td_backend *b, const int32_t *ids, const int32_t *positions, const void *tok, const void *pos,
                     float scale, void *y, int n, int d);
  td_status (*add_pos)(td_backend *b, void *y, const void *pos, int n_seqs, int len, int d);
  td_status (*gather_rows)(td_backend *b, const void *x, const int32_t *rows, void *y, int n, int d);
  td_status (*im2col1d)(td_backend *b, const void *x, void *y, int batch, int c, int t_in, int k, int stride,
                        int pad, bool channels_first);
  td_status (*attn_dense)(td_backend *b, const void *qkv, void *out, const int32_t *cu_seqlens, int n_seqs,
                          int n_tokens, int max_len, int heads, int head_dim, float scale, bool causal,
                          const td_relbias *bias, int q_lo, int q_hi);
  td_status (*kv_write)(td_backend *b, const void *k, const void *v, int ld, void *pool, const td_kv_layout *l,
                        int layer, const int32_t *slots, int n);
  /* optional: several consecutive layers in one pass (else td_kv_write_layers loops over kv_write) */
  td_status (*kv_write_layers)(td_backend *b, const void *k, const void *v, int ld, size_t lcols, void *pool,
                               const td_kv_layout *l, int layer0, int n_layers, const int32_t *slots, int n);
  td_status (*kv_read)(td_backend *b, const void *pool, const td_kv_layout *l, int layer, const int32_t *slots,
                       int n, void *k, void *v, int ld);
  td_status (*attn_paged)(td_backend *b, const void *q, int ldq, void *out, const void *pool,
                          const td_kv_layout *l, int layer, const td_paged_meta *m, float scale, bool causal,
                          const td_relbias *bias);
  td_status (*attn_states)(td_backend *b, const void *q, int ldq, void *out, const void *pool,
                           const td_kv_layout *l, int heads, const td_paged_meta *m, float scale);
  td_status (*gemm_heads)(td_backend *b, const void *x, const void *w, const float *bias, void *y, int m,
                          int heads, int n, int k, bool w_t);
  td_status (*kv_prefetch)(td_backend *b, const void *pool, const td_kv_layout *l, int layer,
                           const struct td_paged_meta *m);
  td_status (*kv_copy_blocks)(td_backend *b, void *pool, const td_kv_layout *l, const int32_t *pairs,
                              int n_pairs);
  td_status (*sample)(td_backend *b, float *logits, int n, int vocab, const td_sample_row *rows,
                      const int32_t *bans, int32_t *tokens, float *logprobs);
  td_status (*topk_logprobs)(td_backend *b, float *logits, int n, int vocab, const td_sample_row *rows,
                             const int32_t *bans, int k, int32_t *ids, float *vals);
  /* graphs: NULL when unsupported */
  td_status (*graph_begin)(td_backend *b);
  td_status (*graph_end)(td_backend *b, td_graph **out);
  td_status (*graph_launch)(td_backend *b, td_graph *g);
  void (*graph_destroy)(td_backend *b, td_graph *g);
  int (*graph_kernels)(td_backend *b, const td_graph *g); /* NULL: -1 */
  /* NULL: norm, GEMM and gated activation as separate ops (ops.c) */
  td_status (*gemm_ex)(td_backend *b, const td_gemm_args *a);
  /* td_attn_states_rows; NULL: INT_MAX */
  int (*states_rows)(const td_backend *b, int D, bool kv8);
  /* td_attn_states_takes; NULL: from td_attn_states_rows on */
  bool (*states_takes)(const td_backend *b, int D, int heads, bool kv8, int rows);
  /* td_attn_states_fast; NULL: false */
  bool (*states_fast)(const td_backend *b, int D);
  /* td_backend_fused_norm_rows; NULL: 0 */
  int (*fused_norm_rows)(const td_backend *b);
  /* td_backend_gemm_plan_rows; NULL: 0 (no plans) */
  int (*gemm_plan_rows)(const td_backend *b, int m);
  /* td_backend_gemm_plans_made; NULL: 0 */
  int64_t (*gemm_plans_made)(const td_backend *b);
  /* td_backend_set_cuda_tuning; NULL: TD_ERR_UNSUPPORTED */
  td_status (*set_cuda_tuning)(td_backend *b, const td_cuda_tuning *t);
  /* td_backend_memory_info; NULL: TD_ERR_UNSUPPORTED */
  td_status (*memory)(td_backend *b, td_backend_memory *out);
  /* NULL: the CPU loop in ops.c */
  td_status (*unshard_cols)(td_backend *b, const float *parts, float *out, int tp, int rows, int per, int cols);
} td_backend_vt;

/* td_gemm_ex as separate ops (norm, GEMM, gated activation, KV write): what
 * ops.c runs when a backend has no gemm_ex, and what a backend's gemm_ex
 * falls back to for shapes it does not fuse. Arguments already checked. */
td_status td_gemm_ex_unfused(td_backend *b, const td_gemm_args *a);

/* A communicator's implementation. */
typedef struct td_comm_vt {
  td_status (*allreduce)(td_comm *c, td_backend *b, void *buf, td_buf_type t, size_t n);
  td_status (*allgather)(td_comm *c, td_backend *b, const void *send, void *recv, td_buf_type t, size_t n);
  td_status (*send)(td_comm *c, td_backend *b, const void *buf, td_buf_type t, size_t n, int peer);
  td_status (*recv)(td_comm *c, td_backend *b, void *buf, td_buf_type t, size_t n, int peer);
  /* NULL: the send, then the receive (transports whose sends are queued) */
  td_status (*sendrecv)(td_comm *c, td_backend *b, const void *send, td_buf_type send_t, size_t send_n, int to,
                        void *recv, td_buf_type recv_t, size_t recv_n, int from);
  void (*abort)(td_comm *c);
  void (*destroy)(td_comm *c);
  /* td_allgather_rows; NULL: packed through allgather in host memory (CPU backends) */
  td_status (*allgather_rows)(td_comm *c, td_backend *b, void *buf, td_buf_type t, int rows, int width, int col0,
                              int ncols);
  /* td_gemm_allreduce; NULL: td_gemm, then allreduce */
  td_status (*gemm_allreduce)(td_comm *c, td_backend *b, const void *x, const void *w, const float *bias, void *y,
                              int m, int n, int k, unsigned flags);
} td_comm_vt;

struct td_comm {
  const td_comm_vt *vt;
  int rank, world;
  void *impl;
};

struct td_backend {
  const td_backend_vt *vt;
  td_comm *comm;
  td_backend_kind kind;
  size_t act_size; /* bytes of a TD_BUF_ACT element */
  char name[160];
  void *impl;
};

/* CPU sampling, shared with the reference tests. */
td_status td_cpu_sample(td_backend *b, float *logits, int n, int vocab, const td_sample_row *rows,
                        const int32_t *bans, int32_t *tokens, float *logprobs);
td_status td_cpu_topk_logprobs(td_backend *b, float *logits, int n, int vocab, const td_sample_row *rows,
                               const int32_t *bans, int k, int32_t *ids, float *vals);

td_status td_backend_cpu_create(const td_backend_opts *opts, td_backend **out);
td_status td_backend_cuda_create(const td_backend_opts *opts, td_backend **out);

#endif
