/* The ops interface: every computation the model graph runs, with a CPU
 * implementation (float32, BLAS GEMMs; the reference) and a CUDA one (bf16
 * activations and weights, float32 accumulation). Model code never branches
 * on the backend.
 *
 * Buffers are backend memory (host memory for the CPU backend, device memory
 * for CUDA) given as plain pointers. Their element type is one of
 * td_buf_type: TD_BUF_ACT is float32 on the CPU and bf16 on CUDA and is used
 * for activations, weight matrices and the KV pools; biases and norm weights
 * are TD_BUF_F32; metadata is TD_BUF_I32.
 *
 * Ops are asynchronous on the backend's stream: they only enqueue work, never
 * allocate, and never synchronise, so a sequence of them can be captured in a
 * CUDA graph. Host-side sizes passed to an op are upper bounds fixed at
 * capture; per-sequence lengths are read from device metadata. */
#ifndef TD_KERNELS_OPS_H
#define TD_KERNELS_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/settings.h"
#include "common/status.h"
#include "kernels/act.h"

typedef struct td_backend td_backend;

typedef enum td_backend_kind { TD_BACKEND_CPU, TD_BACKEND_CUDA } td_backend_kind;

typedef struct td_backend_opts {
  td_backend_kind kind;
  int device;  /* CUDA device ordinal */
  int threads; /* CPU BLAS threads; 0 = library default */
  td_cuda_tuning cuda; /* kernel variants and switches (common/settings.h; zero: measured defaults) */
} td_backend_opts;

typedef enum td_buf_type { TD_BUF_ACT, TD_BUF_F32, TD_BUF_I32 } td_buf_type;

td_status td_backend_create(const td_backend_opts *opts, td_backend **out);
/* For tests and benchmarks only: replaces a CUDA backend's tuning, as
 * td_backend_opts.cuda set it at creation, so that one backend runs several
 * kernel variants in turn. Ops launched from then on read it; graphs
 * captured before keep what they captured. TD_ERR_UNSUPPORTED on other
 * backends. */
td_status td_backend_set_cuda_tuning(td_backend *b, const td_cuda_tuning *t);
/* Device memory as the backend sees it: the device's total and free bytes,
 * and what this backend holds (td_alloc'ed buffers and its workspace), so
 * that KV pools can take what is left of its share. CPU backends:
 * TD_ERR_UNSUPPORTED (their pools are sized from the model). */
typedef struct td_backend_memory {
  size_t total, free, allocated;
} td_backend_memory;
td_status td_backend_memory_info(td_backend *b, td_backend_memory *out);
void td_backend_destroy(td_backend *b);
td_backend_kind td_backend_get_kind(const td_backend *b);
/* "cpu" or "cuda:0 (NVIDIA H100 80GB HBM3)". */
const char *td_backend_name(const td_backend *b);
/* Whether the CUDA backend was compiled in. */
bool td_backend_cuda_available(void);
size_t td_buf_elem_size(const td_backend *b, td_buf_type t);

/* ---- memory ---- */
td_status td_alloc(td_backend *b, td_buf_type t, size_t n, void **out);
void td_free(td_backend *b, void *p);
/* Page-locked host memory where the backend benefits (CUDA), else malloc. */
td_status td_host_alloc(td_backend *b, size_t bytes, void **out);
void td_host_free(td_backend *b, void *p);
/* Converting copies between float32 host arrays and buffers of type t.
 * Synchronous. */
td_status td_upload(td_backend *b, td_buf_type t, void *dst, const float *src, size_t n);
td_status td_download(td_backend *b, td_buf_type t, const void *src, float *dst, size_t n);
/* Raw asynchronous copies on the stream (host side should be td_host_alloc'ed). */
td_status td_copy_h2d(td_backend *b, void *dst, const void *src, size_t bytes);
td_status td_copy_d2h(td_backend *b, void *dst, const void *src, size_t bytes);
td_status td_copy_d2d(td_backend *b, void *dst, const void *src, size_t bytes);
td_status td_sync(td_backend *b);

/* ---- dense ops ---- */
enum {
  TD_GEMM_ACCUM = 1u << 0, /* y += x W^T (residual add), else y = */
  TD_GEMM_OUT_F32 = 1u << 1, /* y is TD_BUF_F32 instead of TD_BUF_ACT */
};
/* y[m,n] = act(x[m,k] W[n,k]^T + bias[n]); bias may be NULL. act must be
 * TD_ACT_NONE with TD_GEMM_ACCUM. W is a model constant: a backend may start
 * reading it before the previous op on the stream has finished, so no op may
 * write it (upload weights with td_upload). The same holds for td_gemm_ex. */
td_status td_gemm(td_backend *b, const void *x, const void *w, const float *bias, void *y, int m, int n, int k,
                  td_act act, unsigned flags);
/* The GEMM with what surrounds it in a layer, for backends that fuse:
 * y = act(norm(x) W^T + bias), where norm (when norm_w != NULL) is the
 * row norm of td_norm; with TD_GEMM_GLU, W is [W_a; W_b] (n rows, n/2 each)
 * and y[m, n/2] = act(x W_a^T + b_a) * (x W_b^T + b_b). A backend without
 * the fusion runs td_norm into scratch_norm ([m, k]) and the GEMM into
 * scratch_glu ([m, n]) then td_gated_act; the scratch pointers must be
 * given either way. TD_GEMM_ACCUM excludes act and GLU. */
enum { TD_GEMM_GLU = 1u << 2 };
struct td_kv_layout;
typedef struct td_gemm_args {
  const void *x, *w;
  const float *bias;
  void *y;
  int m, n, k;
  td_act act;
  unsigned flags;
  const float *norm_w, *norm_b;
  float norm_eps;
  bool norm_rms;
  /* Normalise x with no weight (norm_w and norm_b NULL), RMS (norm_rms)
   * or LayerNorm: for a model that folded the norm's weight into W's
   * columns (and a LayerNorm's bias into the GEMM bias). A backend may then
   * scale x W^T by each row's 1 / rms instead of normalising x; for a
   * LayerNorm, (x - mean) W^T = x W^T - mean * norm_wsum, with norm_wsum
   * [n] the row sums of W as stored (required with a plain LayerNorm). */
  bool norm_plain;
  const float *norm_wsum;
  void *scratch_norm, *scratch_glu;
  /* Optional (kv_pool != NULL): also writes columns [kv_col, kv_col + 2 hd)
   * of y (hd = heads * head_dim of kv_layout) into the paged pool, as
   * td_kv_write(y + kv_col, y + kv_col + hd, ld n) would: K then V rows of
   * layer kv_layer at kv_slots[i] (negative: row skipped). Not with GLU or
   * TD_GEMM_OUT_F32. Saves the separate KV write of a QKV projection. */
  void *kv_pool;
  const struct td_kv_layout *kv_layout;
  int kv_layer, kv_col;
  const int32_t *kv_slots;
} td_gemm_args;
td_status td_gemm_ex(td_backend *b, const td_gemm_args *a);

/* Decode rows up to which td_gemm_ex applies a plain norm (norm_plain)
 * inside the projection at no cost; beyond them a caller may leave a query
 * projection's plain RMSNorm to the attention instead (td_paged_meta.q_norm).
 * 0: never inside. */
int td_backend_fused_norm_rows(const td_backend *b);

/* The row count whose GEMM plan an m-row GEMM runs on (a GPU backend keys
 * its cuBLASLt plans by buckets of rows): at least m; 0 where the backend
 * keeps no plans (the CPU), which a warm-up reads as nothing to warm. */
int td_backend_gemm_plan_rows(const td_backend *b, int m);
/* GEMM plans the backend has made since it was created (0 without plans). */
int64_t td_backend_gemm_plans_made(const td_backend *b);

/* y = LayerNorm(x) * w + bias, or RMSNorm(x) * w when rms (bias ignored).
 * Rows of n; x == y allowed; w NULL means a weight of 1. */
td_status td_norm(td_backend *b, const void *x, const float *w, const float *bias, void *y, int m, int n,
                  float eps, bool rms);
/* y[m,f] = act(x[:, :f]) * x[:, f:] for x[m, 2f]. */
td_status td_gated_act(td_backend *b, const void *x, void *y, int m, int f, td_act act);
/* y[i] = tok[ids[i]] * scale (+ pos[positions[i]] when pos != NULL). */
td_status td_embed(td_backend *b, const int32_t *ids, const int32_t *positions, const void *tok, const void *pos,
                   float scale, void *y, int n, int d);
/* y[s*len + t] += pos[t] for s < n_seqs, t < len. */
td_status td_add_pos(td_backend *b, void *y, const void *pos, int n_seqs, int len, int d);
/* y[i] = x[rows[i]] for i < n. */
td_status td_gather_rows(td_backend *b, const void *x, const int32_t *rows, void *y, int n, int d);
/* im2col for conv1d with kernel k, stride, padding pad over `batch`
 * sequences of length t_in with c channels: x is [batch, c, t_in] when
 * channels_first (log-mel features), else [batch, t_in, c]; y is
 * [batch * t_out, c * k] with t_out = (t_in + 2 pad - k) / stride + 1. */
td_status td_im2col1d(td_backend *b, const void *x, void *y, int batch, int c, int t_in, int k, int stride, int pad,
                      bool channels_first);

/* ---- attention ---- */
/* T5 relative position bias as a per-head lookup table over the relative
 * position key - query, clamped to [-max_distance, max_distance] (buckets
 * saturate there): lut[h * (2 max_distance + 1) + rel + max_distance]. */
typedef struct td_relbias {
  const float *lut; /* TD_BUF_F32 */
  int max_distance;
} td_relbias;

/* Self-attention over packed variable-length sequences: qkv is
 * [n_tokens, 3, heads, head_dim], out [n_tokens, heads, head_dim];
 * cu_seqlens[n_seqs + 1] (device) are token offsets; max_len bounds every
 * length. bias may be NULL. */
td_status td_attn_dense(td_backend *b, const void *qkv, void *out, const int32_t *cu_seqlens, int n_seqs,
                        int n_tokens, int max_len, int heads, int head_dim, float scale, bool causal,
                        const td_relbias *bias);
/* The same for the query rows [q_lo, q_hi) only (keys: every row of each
 * sequence), the rest of out left as it was, or written with what the
 * rows' q columns give (a backend may compute whole tiles): a rank of a
 * row-split encoder, whose qkv holds every row's K/V but only its own
 * rows' queries. cu_seqlens[0] is 0 (the CUDA backend's grid for one
 * sequence starts at the tile of q_lo). */
td_status td_attn_dense_rows(td_backend *b, const void *qkv, void *out, const int32_t *cu_seqlens, int n_seqs,
                             int n_tokens, int max_len, int heads, int head_dim, float scale, bool causal,
                             const td_relbias *bias, int q_lo, int q_hi);

/* Paged KV pools: [block][layer][K|V][head][slot][head_dim], then, where
 * states > 0, the block's encoder states [K|V][slot][states / 2] (each
 * state's first half in the K plane, its second in V): the cross pool's
 * "states tail", which every rank holds whole. n_layers may be 0 where
 * states > 0 (a pool of states only).
 * With int8 (the CUDA backend only; head_dim a multiple of 16, block_size
 * of 4), each layer is [K|V][head][slot][head_dim] of int8, then
 * [K|V][head][slot] float scales: a row's values are its int8 times its
 * scale (its largest magnitude / 127), written by td_kv_write, read by
 * td_attn_paged. Sizes and offsets (td_kv_block_elems, td_kv_span.off)
 * stay in 2-byte elements, the CUDA backend's activation size. */
typedef struct td_kv_layout {
  int n_layers, n_heads, head_dim, block_size;
  int states;
  int int8; /* the layers' K/V in int8 with per-row scales (the states tail stays as it is) */
} td_kv_layout;
size_t td_kv_block_elems(const td_kv_layout *l);
/* Where layer `layer` of a block sits: its offset in elements, its heads
 * and their width; layer == n_layers is the states tail (one head of width
 * states / 2). Each plane is [heads][slot][dim] (int8: bytes, then the
 * scales, as above). */
typedef struct td_kv_span {
  size_t off;
  int heads, dim;
} td_kv_span;
td_kv_span td_kv_layer_span(const td_kv_layout *l, int layer);
/* A layout whose fields are in range; layers >= 0 and (n_layers > 0 or
 * states > 0), states even; int8 with layers, head_dim % 16 == 0 and
 * block_size % 4 == 0. */
bool td_kv_layout_valid(const td_kv_layout *l);

/* Writes rows i < n of k and v (row stride ld elements, heads*head_dim
 * wide) into the pool at global slots slots[i] = block * block_size + slot;
 * a negative slot skips the row. layer == l->n_layers writes the states
 * tail: k and v are then each state's two halves (states / 2 wide). */
td_status td_kv_write(td_backend *b, const void *k, const void *v, int ld, void *pool, const td_kv_layout *l,
                      int layer, const int32_t *slots, int n);
/* td_kv_write for n_layers consecutive K/V layers from layer0 at once: layer
 * layer0 + j's K row i at k + i * ld + j * lcols (elements), its V at v
 * likewise (the cross K/V of several layers from one GEMM's columns). */
td_status td_kv_write_layers(td_backend *b, const void *k, const void *v, int ld, size_t lcols, void *pool,
                             const td_kv_layout *l, int layer0, int n_layers, const int32_t *slots, int n);
/* The inverse of td_kv_write: rows i < n of k and v (row stride ld) read
 * from the pool at slots[i]; a negative slot leaves the row alone. With
 * layer == l->n_layers it reads the states tail (each state's two halves),
 * the encoder output that a states push delivered, to be projected. */
td_status td_kv_read(td_backend *b, const void *pool, const td_kv_layout *l, int layer, const int32_t *slots,
                     int n, void *k, void *v, int ld);

/* Sequences whose queries attend to paged KV. */
typedef struct td_paged_meta {
  int n_seqs, n_tokens; /* host: sequences, and the rows of q and out (q_start's values lie in [0, n_tokens]) */
  int max_q, max_ctx;   /* host: bounds on query and context lengths */
  const int32_t *q_start;     /* device [n_seqs + 1]: query row offsets */
  const int32_t *ctx_len;     /* device [n_seqs]: KV length, queries included */
  const int32_t *block_table; /* device [n_seqs, max_blocks] */
  int max_blocks;
  /* true when the pool's K/V and this metadata were not written by any op
   * since the last copy, upload or sync on this backend (cross-attention
   * over the encoder's KV, the step's metadata uploaded at its start): the
   * backend may start reading them before earlier ops have finished. */
  bool kv_static;
  /* the same for the K/V at positions before each sequence's first query
   * only (self-attention: earlier steps wrote those; this step writes the
   * rest, possibly in the op just before) */
  bool kv_static_past;
  /* NULL, or device rows [n_tokens, q_norm_dim] (the input of the query's
   * projection) whose 1 / rms(row) (eps q_norm_eps) scales each query row:
   * a plain RMSNorm before that projection, its weight folded into the
   * projection's W, applied here instead of by a kernel before it */
  const void *q_norm;
  int q_norm_dim;
  float q_norm_eps;
} td_paged_meta;

/* out[n_tokens, heads, head_dim] = softmax(scale q K^T + bias) V. Query i
 * of a sequence with q_len queries and ctx_len keys sits at position
 * ctx_len - q_len + i; with causal it sees keys up to its position, else all
 * (cross-attention). q rows have stride ldq elements. */
td_status td_attn_paged(td_backend *b, const void *q, int ldq, void *out, const void *pool, const td_kv_layout *l,
                        int layer, const td_paged_meta *m, float scale, bool causal, const td_relbias *bias);

/* Attention over encoder states instead of per-layer cross K/V. The pool's
 * states tail (l->states = D > 0) holds one row E_j per slot, columns
 * [0, D / 2) in its K plane and [D / 2, D) in its V plane. For each query
 * row r of a sequence
 * and head h < heads:
 *   out[r, h, :] = sum_j softmax_j(scale * q[r, h, :] . E_j) E_j
 * over the sequence's ctx_len states (no mask). q [n_tokens, heads * D]
 * with row stride ldq, out [n_tokens, heads * D] dense. With
 * q[r, h] = W_k,h^T q_h (td_gemm_heads) the scores are q_h . k_j, and
 * W_v,h out[r, h] is the head's cross-attention output (the K bias cancels
 * in the softmax, the V bias adds after the projection). m->q_norm as for
 * td_attn_paged; kv_static_past is ignored. */
td_status td_attn_states(td_backend *b, const void *q, int ldq, void *out, const void *pool, const td_kv_layout *l,
                         int heads, const td_paged_meta *m, float scale);
/* The fewest query rows from which a decode step's cross-attention over
 * states of width D (td_attn_states between its two per-head products)
 * beats the per-layer K/V path on this backend; INT_MAX where it never
 * does (the CPU: its arithmetic is d_model / head_dim times the K/V path's).
 * kv8: the K/V path reads int8 K/V (td_kv_layout.int8; on CUDA then never). */
int td_attn_states_rows(const td_backend *b, int D, bool kv8);
/* Whether a decode step of `rows` rows (one a sequence) with `heads` heads
 * beats the K/V path over the states: never below td_attn_states_rows,
 * and above it where the backend's kernel fills its waves (on CUDA at D
 * 1280 only some row counts do). */
bool td_attn_states_takes(const td_backend *b, int D, int heads, bool kv8, int rows);
/* Whether td_attn_states has a fast (tensor-core) kernel for states of
 * width D on this backend, whether or not dual pools switch to it. */
bool td_attn_states_fast(const td_backend *b, int D);

/* Per-head products, for h < heads:
 *   y[:, h*n, (h+1)*n) = x[:, h*k, (h+1)*k) W_h (+ bias[h*n, (h+1)*n))
 * with W_h = w + h*k*n as [k, n] rows, or with w_t W_h^T and W_h = w + h*n*k
 * as [n, k] rows. x [m, heads * k], y [m, heads * n], dense rows of
 * TD_BUF_ACT; w TD_BUF_ACT, bias TD_BUF_F32 or NULL. */
td_status td_gemm_heads(td_backend *b, const void *x, const void *w, const float *bias, void *y, int m, int heads,
                        int n, int k, bool w_t);

/* Copies whole blocks within a pool (copy-on-write); pairs are host
 * (src, dst) block ids. */
td_status td_kv_copy_blocks(td_backend *b, void *pool, const td_kv_layout *l, const int32_t *pairs, int n_pairs);

/* A hint that the K/V of `layer` in pool at the positions below m's ctx_len
 * (block_table, max_blocks, n_seqs as for td_attn_paged) will be read soon:
 * a backend may start moving them closer once the work enqueued so far has
 * completed (CUDA, inside a graph capture: into L2 from a branch beside
 * the stream, joined at the capture's end). Results never depend on it; a
 * backend without it ignores it. */
td_status td_kv_prefetch(td_backend *b, const void *pool, const td_kv_layout *l, int layer, const td_paged_meta *m);

/* ---- sampling ---- */
/* What to do with one row of logits. Rows live in backend memory. */
typedef struct td_sample_row {
  float temperature;       /* <= 0: greedy (argmax, lowest id on ties) */
  int32_t top_k;           /* <= 0: off */
  float top_p;             /* >= 1: off */
  int32_t forced;          /* >= 0: the only allowed token (forced BOS/EOS) */
  int32_t ban_start;       /* bans[ban_start, ban_start + ban_count): token ids */
  int32_t ban_count;       /*   set to -inf (suppressed tokens) */
  uint32_t stream;         /* which sample of the request (n > 1) */
  uint32_t step;           /* output position: the random counter */
  uint64_t seed;
} td_sample_row;

/* For each row i < n of logits [n, vocab] (float32; modified in place by
 * the processing): applies forced / banned tokens, then picks a token:
 * argmax when temperature <= 0, else a draw from softmax(logits /
 * temperature) restricted to the top_k most likely tokens and to the
 * smallest set whose probability reaches top_p, using
 * td_rand_uniform(seed, stream, step). logprobs[i] (may be NULL) is
 * log_softmax(processed logits)[token] at temperature 1. */
td_status td_sample(td_backend *b, float *logits, int n, int vocab, const td_sample_row *rows, const int32_t *bans,
                    int32_t *tokens, float *logprobs);

/* Beam search support, as transformers scores beams: for each row takes
 * log_softmax(row), then applies forced / banned tokens to the log-probs
 * (forced: every other token -inf and the forced one 0; banned: -inf; no
 * renormalisation), and writes the k largest values in descending order
 * (lower id first on ties) with their token ids: ids[i * k + j],
 * vals[i * k + j]. logits are left modified. */
td_status td_topk_logprobs(td_backend *b, float *logits, int n, int vocab, const td_sample_row *rows,
                           const int32_t *bans, int k, int32_t *ids, float *vals);

/* ---- graphs ---- */
/* Captured op sequences replayed at fixed buffer addresses (CUDA graphs).
 * A backend without graphs answers TD_ERR_UNSUPPORTED. */
typedef struct td_graph td_graph;
bool td_backend_has_graphs(const td_backend *b);
td_status td_graph_begin(td_backend *b);
td_status td_graph_end(td_backend *b, td_graph **out);
td_status td_graph_launch(td_backend *b, td_graph *g);
void td_graph_destroy(td_backend *b, td_graph *g);
/* The kernels one replay of g launches (-1: the backend cannot tell). */
int td_graph_kernels(td_backend *b, const td_graph *g);

/* ---- collectives (tensor and pipeline parallelism) ---- */
/* A communicator joins the backends of one model's ranks. With one
 * attached, the model runs its slice and the ops below exchange data. */
typedef struct td_comm td_comm;
/* In-process communicators for `world` ranks driven by `world` threads (the
 * CPU backend; tests and CPU parallelism). comms[r] is rank r's. */
td_status td_comm_create_threads(int world, td_comm **comms);
/* Rank `rank` of `world` without peers, on any backend: all-reduces leave
 * the buffer as it is, all-gathers put the rank's part in every slot,
 * row all-gathers leave the other rows, sends and receives are refused.
 * One rank's share of a group run alone, to time what it computes. */
td_status td_comm_create_alone(int rank, int world, td_comm **out);
/* NCCL (CUDA backend): id is ncclUniqueId bytes from td_comm_nccl_id. */
#define TD_NCCL_ID_BYTES 128
td_status td_comm_nccl_id(uint8_t id[TD_NCCL_ID_BYTES]);
td_status td_comm_create_nccl(td_backend *b, const uint8_t id[TD_NCCL_ID_BYTES], int rank, int world,
                              td_comm **out);
/* Ends outstanding and later collectives with an error (a peer died); may
 * be called from another thread. td_comm_destroy still frees. */
void td_comm_abort(td_comm *c);
void td_comm_destroy(td_comm *c);
int td_comm_rank(const td_comm *c);
int td_comm_world(const td_comm *c);

/* Communicators between processes over ZeroMQ (CPU backend): each rank
 * binds (td_comm_zmq_bind), the endpoints are exchanged (through the
 * router), then each rank connects to all. Waits longer than timeout_ms,
 * or td_comm_abort from another thread, end an op with TD_ERR_PEER. */
typedef struct td_comm_zmq_boot td_comm_zmq_boot;
/* CURVE on a communicator's sockets, from its owner (kernels hold no keys):
 * the sockets are made in zmq_ctx (the owner's, whose ZAP handler admits
 * the group's ranks; it outlives the communicator), `server` readies the
 * bound socket before it binds, `client` a socket before it connects to
 * rank `peer`. NULL: plain sockets in a context of the communicator's own. */
typedef struct td_comm_zmq_sec {
  void *zmq_ctx;
  td_status (*server)(void *arg, void *sock);
  td_status (*client)(void *arg, void *sock, int peer);
  void *arg;
} td_comm_zmq_sec;
td_status td_comm_zmq_bind(const char *host, const td_comm_zmq_sec *sec, td_comm_zmq_boot **out);
const char *td_comm_zmq_endpoint(const td_comm_zmq_boot *boot);
void td_comm_zmq_boot_free(td_comm_zmq_boot *boot);
/* Takes boot over (freed on failure too). */
td_status td_comm_zmq_connect(td_comm_zmq_boot *boot, int rank, int world, const char *const *endpoints,
                              int timeout_ms, td_comm **out);

/* Attaches (or detaches with NULL) a communicator to a backend. */
void td_backend_set_comm(td_backend *b, td_comm *c);
td_comm *td_backend_comm(const td_backend *b);
/* Sum over ranks, in place. */
td_status td_allreduce_sum(td_backend *b, void *buf, td_buf_type t, size_t n);
/* A row-parallel layer's GEMM and its all-reduce: y[m,n] (TD_BUF_ACT) =
 * the sum over the communicator's ranks of x W^T + bias (+ y where that
 * rank passes TD_GEMM_ACCUM), as td_gemm then td_allreduce_sum, with the
 * same bits; one kernel where the backend can (CUDA: a few rows over the
 * one-shot all-reduce). Flags: TD_GEMM_ACCUM only. */
td_status td_gemm_allreduce(td_backend *b, const void *x, const void *w, const float *bias, void *y, int m, int n,
                            int k, unsigned flags);
/* recv[r * n + i] = rank r's send[i]. */
td_status td_allgather(td_backend *b, const void *send, void *recv, td_buf_type t, size_t n);
/* Rows split over the ranks: rank r holds rows [lo, hi) of n, in equal
 * shares of `per` rows (the last ones may be short or empty), per rounded
 * up to whole query tiles of the attention where n is large enough. */
typedef struct td_row_split {
  int per, lo, hi;
} td_row_split;
td_row_split td_rows_split(int n, int world, int rank);
/* In place over a [rows][width] matrix of type t: rank r's rows (of
 * td_rows_split(rows, world, r)), columns [col0, col0 + ncols), go to every
 * rank; the other columns are left as they are. */
td_status td_allgather_rows(td_backend *b, void *buf, td_buf_type t, int rows, int width, int col0, int ncols);
/* Point to point (pipeline stages). */
td_status td_send(td_backend *b, const void *buf, td_buf_type t, size_t n, int peer);
td_status td_recv(td_backend *b, void *buf, td_buf_type t, size_t n, int peer);
/* A send and a receive posted together, so that neither waits on the other
 * (a pipeline stage that sends one step's activations while it takes an
 * earlier step's logits back: a rendezvous send, or NCCL's on one stream,
 * would wait on a receive queued behind it). */
td_status td_sendrecv(td_backend *b, const void *send, td_buf_type send_t, size_t send_n, int to, void *recv,
                      td_buf_type recv_t, size_t recv_n, int from);
/* Reassembles rows split by columns across ranks: parts is [tp][rows][per]
 * (float32); out[rows][cols] takes the first cols of the concatenation. */
td_status td_unshard_cols(td_backend *b, const float *parts, float *out, int tp, int rows, int per, int cols);

#endif
