/* Placement: which decode, encoder and prefill workers a request goes to.
 * Pure over the pool the router hands in (router/policy.h). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "common/defaults.h"
#include "router/policy.h"

typedef enum want { WANT_DEC, WANT_ENC, WANT_PRE } want;

static bool fits(const td_place_worker *w, want role, const td_place_req *q) {
  if (w->draining) return false;
  switch (role) {
    case WANT_DEC:
      return w->dec && w->committed_cross + q->need_cross <= w->cross_blocks &&
             w->jobs < TD_ROUTER_JOBS_PER_SEQ * w->max_running && q->width <= w->max_running;
    case WANT_ENC:
      return w->enc;
    case WANT_PRE:
      return w->pre && w->committed_cross + q->need_cross <= w->cross_blocks;
  }
  return false;
}

/* The fitting worker with the fewest jobs, then the fewest committed self
 * blocks, then the earliest registered; -1 when none fits. A decode worker
 * to avoid is taken only when no other fits. */
static int pick(const td_place_worker *const *pool, int n, want role, const td_place_req *q) {
  int best = -1;
  for (int pass = 0; pass < 2 && best < 0; pass++)
    for (int i = 0; i < n; i++) {
      const td_place_worker *w = pool[i];
      if (!fits(w, role, q)) continue;
      if (!pass && role == WANT_DEC && q->avoid_dec && w->id && !strcmp(w->id, q->avoid_dec)) continue;
      if (best < 0 || w->jobs < pool[best]->jobs ||
          (w->jobs == pool[best]->jobs && w->committed_self < pool[best]->committed_self))
        best = i;
    }
  return best;
}

bool td_place_possible(const td_place_worker *const *pool, int n, const td_place_req *q, char *why, size_t cap) {
  int n_dec = 0, widest = 0, largest = 0;
  for (int i = 0; i < n; i++) {
    const td_place_worker *w = pool[i];
    if (!w->dec) continue;
    n_dec++;
    if (w->max_running >= q->width && w->cross_blocks >= q->need_cross) return true;
    if (w->max_running > widest) widest = w->max_running;
    if (w->cross_blocks > largest) largest = w->cross_blocks;
  }
  if (!n_dec) /* one may register: the wait for a missing role bounds it */
    return true;
  if (widest < q->width)
    snprintf(why, cap, "%d sequences at once (n or num_beams) exceed every decode worker's batch: the widest runs %d "
             "(max_running)", q->width, widest);
  else if (largest < q->need_cross)
    snprintf(why, cap, "the encoder output needs %d cross KV blocks; the largest decode worker's pool has %d",
             q->need_cross, largest);
  else
    snprintf(why, cap, "no decode worker has both a batch of %d sequences and %d cross KV blocks", q->width,
             q->need_cross);
  return false;
}

/* Why no fitting worker of a role is free now; *missing: no live worker has the role. */
static void wait_reason(const td_place_worker *const *pool, int n, want role, char *why, size_t cap, bool *missing) {
  static const char *const names[] = {"decode worker", "encoder", "prefill worker"};
  int with_role = 0, live = 0;
  for (int i = 0; i < n; i++) {
    const td_place_worker *w = pool[i];
    bool has = role == WANT_DEC ? w->dec : role == WANT_ENC ? w->enc : w->pre;
    with_role += has;
    live += has && !w->draining;
  }
  *missing = !live;
  if (!with_role)
    snprintf(why, cap, "no %s is registered", names[role]);
  else if (!live)
    snprintf(why, cap, "every %s is draining", names[role]);
  else if (role == WANT_ENC)
    snprintf(why, cap, "every encoder's queue is full (its encoder runs ahead)");
  else
    snprintf(why, cap, "every %s that can run it is full (cross KV blocks or queue)", names[role]);
}

/* Whether an encoder's queue takes q's positions: nothing pending, no known
 * run size, or within encode_runs runs. */
static bool enc_room(const td_place_worker *w, const td_place_req *q, const td_place_opts *o) {
  if (w->enc_pending <= 0 || w->enc_batch <= 0 || o->encode_runs <= 0) return true;
  return (int64_t)w->enc_pending + q->enc_len <= (int64_t)o->encode_runs * w->enc_batch;
}

/* The encoder for decode worker d: d itself (-2 below means "local") or an
 * index; -1 when every candidate is full. */
#define LOCAL (-2)
/* Whether receiver r takes the cross pushes of encoder w: encoder states
 * only where they are projected, K/V only into a pool of the same dtype. */
static bool takes(const td_place_worker *r, const td_place_worker *w) {
  return w->states_out ? r->projects : r->kv8 == w->kv8;
}

/* Whether encoder w's pushes can go to d (and to a prefill worker, when
 * one will be used); d encoding its own pushes nothing. */
static bool form_ok(const td_place_worker *const *pool, int n, int d, const td_place_worker *w, const td_place_req *q,
                    const td_place_opts *o) {
  if (w == pool[d]) return true;
  if (!takes(pool[d], w)) return false;
  if (pool[d]->pre || q->n_prompt < o->prefill_threshold) return true;
  for (int i = 0; i < n; i++)
    if (pool[i]->pre && !pool[i]->draining && !takes(pool[i], w)) return false;
  return true;
}

/* An encoder candidate's pending positions, a decode worker's raised by the
 * margin: its encoder runs stall its decode batch, so it takes one only when
 * the encoder-only workers are that far behind it. */
static double load(const td_place_worker *w, const td_place_opts *o) {
  return (double)w->enc_pending + (w->dec ? o->local_encode_margin * (double)(w->enc_batch > 0 ? w->enc_batch : 0) : 0.0);
}

static int pick_encoder(const td_place_worker *const *pool, int n, int d, const td_place_req *q,
                        const td_place_opts *o) {
  const td_place_worker *dw = pool[d];
  bool self = dw->enc || dw->enc_self; /* d may encode its own */
  bool pure = false; /* an encoder-only worker is there to share the encoding with */
  for (int i = 0; i < n; i++)
    pure |= pool[i]->enc && !pool[i]->dec && !pool[i]->draining && form_ok(pool, n, d, pool[i], q, o);
  if (self && !pure) return LOCAL;
  int best = -1;
  const td_place_worker *bw = NULL;
  for (int i = 0; i < n; i++) {
    const td_place_worker *w = pool[i];
    if (!(w->enc || (i == d && w->enc_self)) || w->draining || !enc_room(w, q, o) || !form_ok(pool, n, d, w, q, o))
      continue;
    /* a worker that decodes encodes only for itself when it encodes */
    if (self && w->dec && i != d) continue;
    if (i == d && (int64_t)w->decoding * 100 >= (int64_t)o->local_encode_pct * w->max_running) continue;
    if (!bw || load(w, o) < load(bw, o) || (load(w, o) == load(bw, o) && bw->dec && !w->dec)) best = i, bw = w;
  }
  return best == d ? LOCAL : best;
}

td_place_status td_place(const td_place_worker *const *pool, int n, const td_place_req *q, const td_place_opts *o,
                         td_placement *out) {
  out->decode = out->encode = out->prefill = -1;
  out->why[0] = 0;
  out->missing = false;
  int d = pick(pool, n, WANT_DEC, q);
  if (d < 0) {
    if (!td_place_possible(pool, n, q, out->why, sizeof out->why)) return TD_PLACE_NEVER;
    wait_reason(pool, n, WANT_DEC, out->why, sizeof out->why, &out->missing);
    return TD_PLACE_WAIT;
  }
  int e = pick_encoder(pool, n, d, q, o), p = -1;
  if (e == -1) {
    wait_reason(pool, n, WANT_ENC, out->why, sizeof out->why, &out->missing);
    bool usable = false, states = false, live = false;
    for (int i = 0; i < n; i++) {
      if (!pool[i]->enc || pool[i]->draining) continue;
      live = true;
      states |= pool[i]->states_out;
      usable |= form_ok(pool, n, d, pool[i], q, o);
    }
    if (!usable && states) {
      /* no encoder whose pushes it can take: as if there were none */
      snprintf(out->why, sizeof out->why, "the encoders push encoder states, which decode worker %s%s cannot project "
               "(cross mode kv): start an encoder with --cross-transfer kv",
               pool[d]->id ? pool[d]->id : "?", pool[d]->projects ? "'s prefill workers" : "");
      out->missing = true;
    } else if (!usable && live) {
      /* K/V encoders whose pool's dtype is not the receivers' */
      snprintf(out->why, sizeof out->why, "no encoder's K/V pushes fit decode worker %s (its cross K/V in %s) and its "
               "prefill workers: K/V move only between pools of one dtype; start an encoder with --cross-kv-dtype %s, "
               "or one that pushes encoder states (without --cross-transfer kv)", pool[d]->id ? pool[d]->id : "?",
               pool[d]->kv8 ? "int8" : "bf16", pool[d]->kv8 ? "int8" : "bf16");
      out->missing = true;
    }
    return TD_PLACE_WAIT;
  }
  bool local = e == LOCAL;
  if (local) e = -1;
  if (!local && !pool[d]->pre && !q->no_prefill && q->n_prompt >= o->prefill_threshold)
    p = pick(pool, n, WANT_PRE, q);
  out->decode = d;
  out->encode = e;
  out->local_encode = local;
  out->prefill = p;
  return TD_PLACE_OK;
}
