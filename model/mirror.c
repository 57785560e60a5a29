/* The follower mirror of a tensor- or pipeline-parallel group: the
 * leader's encode, step, block-copy and projection calls are serialised as bytes and
 * published; each follower's td_model_replay runs the same call, so that
 * the collectives inside meet. */
#include <stdlib.h>
#include <string.h>

#include "model/internal.h"

enum { MIRROR_ENCODE = 1, MIRROR_STEP = 2, MIRROR_COPY = 3, MIRROR_PROJECT = 4, MIRROR_MAGIC = 0x54444d52 };

typedef struct mbuf {
  uint8_t *p;
  size_t n, cap;
  bool oom;
} mbuf;

static void put(mbuf *b, const void *src, size_t n) {
  if (b->oom) return;
  if (b->n + n > b->cap) {
    size_t nc = b->cap ? b->cap : 4096;
    while (nc < b->n + n) nc *= 2;
    uint8_t *q = realloc(b->p, nc);
    if (!q) {
      b->oom = true;
      return;
    }
    b->p = q;
    b->cap = nc;
  }
  if (n) memcpy(b->p + b->n, src, n);
  b->n += n;
}

static void put_i32(mbuf *b, int32_t v) { put(b, &v, 4); }
static void put_arr(mbuf *b, const int32_t *v, int n) {
  put_i32(b, n);
  if (n > 0) put(b, v, sizeof(int32_t) * (size_t)n);
}

typedef struct rbuf {
  const uint8_t *p;
  size_t n, off;
  bool bad;
} rbuf;

static int32_t get_i32(rbuf *r) {
  int32_t v = 0;
  if (r->off + 4 > r->n) {
    r->bad = true;
    return 0;
  }
  memcpy(&v, r->p + r->off, 4);
  r->off += 4;
  return v;
}

/* A view into the buffer: no copy, valid while bytes are. */
static const void *get_arr(rbuf *r, int elem, int *count) {
  int32_t n = get_i32(r);
  *count = n;
  if (n < 0 || r->off + (size_t)n * (size_t)elem > r->n) {
    r->bad = true;
    return NULL;
  }
  const void *v = r->p + r->off;
  r->off += (size_t)n * (size_t)elem;
  return v;
}

void td_model_set_mirror(td_model *m, const td_model_mirror *mirror) {
  if (mirror)
    m->mirror = *mirror;
  else
    memset(&m->mirror, 0, sizeof m->mirror);
}

td_status mirror_publish_encode(td_model *m, const td_encode_input *in) {
  if (!m->mirror.publish) return TD_OK;
  mbuf b = {0};
  put_i32(&b, MIRROR_MAGIC);
  put_i32(&b, MIRROR_ENCODE);
  put_i32(&b, in->n_seqs);
  bool whisper = m->cfg.family == TD_FAMILY_WHISPER;
  int E = 0, tok = 0;
  for (int s = 0; s < in->n_seqs; s++) {
    E += whisper ? m->max_src : in->lens[s];
    tok += whisper ? 0 : in->lens[s];
  }
  put_arr(&b, in->lens, whisper ? 0 : in->n_seqs);
  put_arr(&b, in->tokens, whisper ? 0 : tok);
  int nf = whisper ? in->n_seqs * m->cfg.num_mel_bins * 2 * m->max_src : 0;
  put_i32(&b, nf);
  if (nf) put(&b, in->features, sizeof(float) * (size_t)nf);
  put_arr(&b, in->cross_slots, E);
  td_status s = b.oom ? td_err(TD_ERR_NOMEM, "mirror: out of memory") : m->mirror.publish(m->mirror.ctx, b.p, b.n);
  free(b.p);
  return s;
}

td_status mirror_publish_step(td_model *m, const td_step_input *in) {
  if (!m->mirror.publish) return TD_OK;
  mbuf b = {0};
  int S = in->n_seqs, T = in->n_tokens;
  put_i32(&b, MIRROR_MAGIC);
  put_i32(&b, MIRROR_STEP);
  put_i32(&b, S);
  put_i32(&b, T);
  put_i32(&b, in->block_stride);
  put_i32(&b, in->cross_stride);
  put_arr(&b, in->tokens, T);
  put_arr(&b, in->positions, T);
  put_arr(&b, in->q_start, S + 1);
  put_arr(&b, in->ctx_len, S);
  put_arr(&b, in->slots, T);
  put_arr(&b, in->block_table, S * in->block_stride);
  put_arr(&b, in->cross_len, S);
  put_arr(&b, in->cross_table, S * in->cross_stride);
  put_arr(&b, in->logit_rows, in->n_logits);
  td_status s = b.oom ? td_err(TD_ERR_NOMEM, "mirror: out of memory") : m->mirror.publish(m->mirror.ctx, b.p, b.n);
  free(b.p);
  return s;
}

/* Every rank projects its own heads (TP) or layers (PP) from the states
 * tails that reached it before this call on the same channel. */
td_status mirror_publish_project(td_model *m, const int32_t *cross_slots, int n) {
  if (!m->mirror.publish) return TD_OK;
  mbuf b = {0};
  put_i32(&b, MIRROR_MAGIC);
  put_i32(&b, MIRROR_PROJECT);
  put_arr(&b, cross_slots, n);
  td_status s = b.oom ? td_err(TD_ERR_NOMEM, "mirror: out of memory") : m->mirror.publish(m->mirror.ctx, b.p, b.n);
  free(b.p);
  return s;
}

static td_status replay_aligned(td_model *m, const void *bytes, size_t len);

td_status td_model_copy_self_blocks(td_model *m, const int32_t *pairs, int n_pairs) {
  if (!m->self_pool) return td_err(TD_ERR_INVALID, "copy: no self-attention pool set");
  if (m->mirror.publish) {
    mbuf b = {0};
    put_i32(&b, MIRROR_MAGIC);
    put_i32(&b, MIRROR_COPY);
    put_arr(&b, pairs, 2 * n_pairs);
    td_status s = b.oom ? td_err(TD_ERR_NOMEM, "mirror: out of memory") : m->mirror.publish(m->mirror.ctx, b.p, b.n);
    free(b.p);
    TD_TRY(s);
  }
  td_kv_layout sl = td_model_self_layout(m);
  return td_kv_copy_blocks(m->b, m->self_pool, &sl, pairs, n_pairs);
}

td_status td_model_replay(td_model *m, const void *bytes, size_t len) {
  if (!((uintptr_t)bytes & 3)) return replay_aligned(m, bytes, len);
  /* the arrays are read in place: give them their alignment */
  void *copy = malloc(len ? len : 1);
  if (!copy) return td_err(TD_ERR_NOMEM, "out of memory");
  memcpy(copy, bytes, len);
  td_status s = replay_aligned(m, copy, len);
  free(copy);
  return s;
}

/* Whether an encode call's arrays hold what td_model_encode reads: counts
 * as mirror_publish_encode writes them. */
static bool encode_counts_ok(const td_model *m, const td_encode_input *in, int n_lens, int n_tok, int nf,
                             int n_slots) {
  if (in->n_seqs < 0) return false;
  if (m->cfg.family == TD_FAMILY_WHISPER)
    return n_lens == 0 && n_tok == 0 &&
           (int64_t)nf == (int64_t)in->n_seqs * m->cfg.num_mel_bins * 2 * m->max_src &&
           (int64_t)n_slots == (int64_t)in->n_seqs * m->max_src;
  if (n_lens != in->n_seqs || nf != 0) return false;
  int64_t E = 0;
  for (int s = 0; s < in->n_seqs; s++) {
    if (in->lens[s] < 0) return false;
    E += in->lens[s];
  }
  return E == n_tok && E == n_slots;
}

static td_status replay_aligned(td_model *m, const void *bytes, size_t len) {
  rbuf r = {bytes, len, 0, false};
  if (get_i32(&r) != MIRROR_MAGIC) return td_err(TD_ERR_FORMAT, "mirror: not a model call");
  int kind = get_i32(&r);
  int n;
  if (kind == MIRROR_ENCODE) {
    td_encode_input in = {0};
    int n_lens, n_tok, n_slots;
    in.n_seqs = get_i32(&r);
    in.lens = get_arr(&r, 4, &n_lens);
    in.tokens = get_arr(&r, 4, &n_tok);
    int nf = get_i32(&r);
    if (nf < 0 || r.off + (size_t)nf * 4 > r.n) return td_err(TD_ERR_FORMAT, "mirror: truncated encode");
    in.features = nf ? (const float *)(r.p + r.off) : NULL;
    r.off += (size_t)nf * 4;
    in.cross_slots = get_arr(&r, 4, &n_slots);
    if (r.bad) return td_err(TD_ERR_FORMAT, "mirror: truncated encode");
    if (!encode_counts_ok(m, &in, n_lens, n_tok, nf, n_slots))
      return td_err(TD_ERR_FORMAT, "mirror: encode of %d sequences with arrays of %d, %d, %d and %d values",
                    in.n_seqs, n_lens, n_tok, nf, n_slots);
    return td_model_encode(m, &in, NULL);
  }
  if (kind == MIRROR_COPY) {
    const int32_t *pairs = get_arr(&r, 4, &n);
    if (r.bad || n % 2) return td_err(TD_ERR_FORMAT, "mirror: truncated copy");
    td_kv_layout sl = td_model_self_layout(m);
    TD_TRY(td_kv_copy_blocks(m->b, m->self_pool, &sl, pairs, n / 2));
    return td_sync(m->b);
  }
  if (kind == MIRROR_PROJECT) {
    const int32_t *slots = get_arr(&r, 4, &n);
    if (r.bad) return td_err(TD_ERR_FORMAT, "mirror: truncated projection");
    return td_model_project_cross(m, slots, n);
  }
  if (kind != MIRROR_STEP) return td_err(TD_ERR_FORMAT, "mirror: unknown call %d", kind);
  td_step_input in = {0};
  in.n_seqs = get_i32(&r);
  in.n_tokens = get_i32(&r);
  in.block_stride = get_i32(&r);
  in.cross_stride = get_i32(&r);
  /* each array's count against what td_model_step reads of it */
  int64_t S = in.n_seqs, T = in.n_tokens, want[8] = {T, T, S + 1, S, T, S * in.block_stride, S, S * in.cross_stride};
  const int32_t **arrs[8] = {&in.tokens, &in.positions, &in.q_start, &in.ctx_len,
                             &in.slots, &in.block_table, &in.cross_len, &in.cross_table};
  bool counts_ok = true;
  for (int i = 0; i < 8; i++) {
    *arrs[i] = get_arr(&r, 4, &n);
    counts_ok &= n == want[i];
  }
  in.logit_rows = get_arr(&r, 4, &in.n_logits);
  if (r.bad) return td_err(TD_ERR_FORMAT, "mirror: truncated step");
  if (!counts_ok)
    return td_err(TD_ERR_FORMAT, "mirror: step arrays do not match %d sequences, %d tokens, tables of %d and %d",
                  in.n_seqs, in.n_tokens, in.block_stride, in.cross_stride);
  const float *lg;
  TD_TRY(td_model_step(m, &in, &lg));
  return td_sync(m->b);
}
