/* KV in and out, on the main thread: the one hook set every transport
 * calls (a push is checked against its reservation before any byte is
 * written, the same check for every transport; bytes a transport brings
 * go to the compute thread; arrivals go to the job's role), and the push
 * of a job's handed-over blocks to the workers that reserved them, with
 * its role told once every push ended. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "worker/internal.h"

/* ------------------------------------------------------------ receiving */

/* Whether the push comes from the worker the router named for the
 * reservation: its token (new each attempt, so a stale or another
 * worker's push fails), and with CURVE its key. */
static bool from_named_sender(const td_job *j, const td_kvt_offer *o, char *why, size_t cap) {
  const Tandem__Cluster__KvSender *s = o->cross ? j->cross_from : j->self_from;
  const char *pool = o->cross ? "cross" : "prompt";
  if (!s) {
    snprintf(why, cap, "reservation %llu of request %llu names no sender for its %s blocks",
             (unsigned long long)o->reservation, (unsigned long long)o->rid, pool);
    return false;
  }
  const char *named = s->worker_id && s->worker_id[0] ? s->worker_id : "?";
  if (!o->token || !td_auth_token_equal(o->token, s->token.data)) {
    snprintf(why, cap, "reservation %llu of request %llu takes %s KV from %s only: the push carries %s (another "
             "worker, or an attempt that is over)", (unsigned long long)o->reservation, (unsigned long long)o->rid,
             pool, named, o->token ? "another token" : "no token");
    return false;
  }
  if (s->key && s->key[0] && (!o->sender_key || strcmp(o->sender_key, s->key))) {
    snprintf(why, cap, "reservation %llu of request %llu takes %s KV from %s's key %s only: the push came from %s%s",
             (unsigned long long)o->reservation, (unsigned long long)o->rid, pool, named, s->key,
             o->sender_key ? "key " : "no authenticated key", o->sender_key ? o->sender_key : "");
    return false;
  }
  return true;
}

static bool k_accept(void *ctx, const td_kvt_offer *o, char *why, size_t cap) {
  td_worker *w = ctx;
  bool ok = false;
  size_t want = o->cross ? w->full_cross_bb : w->full_self_bb;
  td_job *j = NULL;
  /* a cross push carries whole blocks (every layer's K/V), or only their
   * states tails (the encoder output, projected here on arrival) */
  int form = o->block_bytes == want                                   ? KV_FORM_KV
             : o->cross && w->states_bb && o->block_bytes == w->states_bb ? KV_FORM_STATES
                                                                       : 0;
  if (!form) {
    const char *kv = o->cross && w->o.cross_int8 ? "int8 K/V: --cross-kv-dtype int8 on the encoder too" : "K/V";
    if (o->cross && w->states_bb)
      snprintf(why, cap, "cross blocks of %zu bytes, this model's are %zu (%s) or %zu (encoder states: %d rows of "
               "%d) (another model, block size, device or --cross-mode?)", o->block_bytes, want, kv, w->states_bb,
               w->block_size, w->full_cross.states);
    else
      snprintf(why, cap, "%s blocks of %zu bytes, this model's are %zu (another model, block size, device or "
               "--cross-mode?%s)", o->cross ? "cross" : "self", o->block_bytes, want,
               o->cross ? "; encoder states are taken only by a worker in cross mode dual" : "");
  } else if (!(j = w_job_by_reservation(w, o->rid, o->reservation, o->cross)) || !j->reserved || j->added) {
    snprintf(why, cap, "reservation %llu of request %llu is not open here", (unsigned long long)o->reservation,
             (unsigned long long)o->rid);
  } else if (o->cross && j->cross_form && j->cross_form != form) {
    snprintf(why, cap, "request %llu: cross pushes of both forms (K/V and encoder states)", (unsigned long long)o->rid);
  } else if (from_named_sender(j, o, why, cap)) {
    if (td_now_ms() > j->expires) {
      snprintf(why, cap, "reservation %llu expired", (unsigned long long)o->reservation);
    } else {
      const int32_t *have = o->cross ? j->cross_ids : j->self_ids;
      const uint8_t *arrived = o->cross ? j->cross_in : j->self_in;
      int nh = o->cross ? j->n_cross : j->n_self;
      ok = true;
      /* each block once: a block written twice would count twice, and the
       * request would start with another block never written */
      for (int i = 0; i < o->n && ok; i++) {
        int k = 0;
        while (k < nh && have[k] != o->blocks[i]) k++;
        if (k == nh) {
          snprintf(why, cap, "block %d is not in reservation %llu", o->blocks[i], (unsigned long long)o->reservation);
          ok = false;
        } else if (arrived[k]) {
          snprintf(why, cap, "block %d of reservation %llu arrived already", o->blocks[i],
                   (unsigned long long)o->reservation);
          ok = false;
        }
        for (int p = 0; p < i && ok; p++)
          if (o->blocks[p] == o->blocks[i]) {
            snprintf(why, cap, "block %d appears twice in one push", o->blocks[i]);
            ok = false;
          }
      }
    }
  }
  if (ok && o->cross) j->cross_form = form;
  if (!ok) w->kv_refused++; /* the transport logs the refusal with its reason */
  return ok;
}

static void k_deliver(void *ctx, bool cross, const int32_t *blocks, int n, const void *const *data, size_t bb) {
  td_worker *w = ctx;
  cmd *c = w_cmd(CMD_WRITE_KV, 0, -1);
  if (c) {
    c->cross = cross;
    c->states_only = cross && bb != w->full_cross_bb; /* accepted: the states tails */
    c->blocks = malloc(sizeof(int32_t) * (size_t)n);
    c->data = malloc(bb * (size_t)n);
  }
  if (!c || !c->blocks || !c->data) {
    TD_ERROR("out of memory taking %d arrived KV blocks", n);
    cmd_free(c);
    return;
  }
  memcpy(c->blocks, blocks, sizeof(int32_t) * (size_t)n);
  for (int i = 0; i < n; i++) memcpy(c->data + (size_t)i * bb, data[i], bb);
  c->n_blocks = n;
  w_post(w, c);
}

static void k_arrived(void *ctx, const td_kvt *t, uint64_t rid, uint64_t res, bool cross, const int32_t *blocks,
                      int n) {
  td_worker *w = ctx;
  w->kv_in[td_kvt_get_kind(t)] += (uint64_t)n;
  td_job *j = w_job_by_reservation(w, rid, res, cross);
  size_t bb = !cross ? w->full_self_bb : j && j->cross_form == KV_FORM_STATES ? w->states_bb : w->full_cross_bb;
  w->kv_in_bytes[td_kvt_get_kind(t)] += (uint64_t)n * bb;
  if (!j) return; /* cancelled meanwhile */
  const int32_t *have = cross ? j->cross_ids : j->self_ids;
  uint8_t *in = cross ? j->cross_in : j->self_in;
  int nh = cross ? j->n_cross : j->n_self, fresh = 0;
  for (int i = 0; i < n; i++) /* two pushes accepted together count their blocks once */
    for (int k = 0; k < nh; k++)
      if (have[k] == blocks[i] && !in[k]) {
        in[k] = 1;
        fresh++;
        break;
      }
  if (cross)
    j->cross_got += fresh;
  else
    j->self_got += fresh;
  if (j->role->on_arrival) j->role->on_arrival(w, j);
}

/* ------------------------------------------------------------ sending */

/* The first failed push of the job says why. */
static void push_failed(td_job *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void push_failed(td_job *j, const char *fmt, ...) {
  if (j->push_failed) return;
  j->push_failed = true;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(j->push_error, sizeof j->push_error, fmt, ap);
  va_end(ap);
}

/* Every push of the job ended: its blocks go back, its role reports. */
static void pushes_over(td_worker *w, td_job *j) {
  w_release_out_blocks(w, j);
  j->role->on_pushed(w, j, j->push_failed ? j->push_error : NULL);
}

static void k_pushed(void *ctx, const td_kvt *t, uint64_t rid, int tag, int n, bool ok, const char *error) {
  td_worker *w = ctx;
  if (ok) w->kv_out[td_kvt_get_kind(t)] += (uint64_t)n;
  td_job *j = w_job_find(w, rid, tag);
  if (!j) return;
  if (ok) {
    w->kv_out_bytes[td_kvt_get_kind(t)] += (uint64_t)n * j->out_bb;
    w->kv_out_seconds[td_kvt_get_kind(t)] += (double)(td_now_ns() - j->push_start_ns) * 1e-9;
  }
  j->pushes_pending--;
  if (!ok) push_failed(j, "KV push failed: %s", error ? error : "?");
  if (j->pushes_pending <= 0) pushes_over(w, j);
}

static void k_release(void *ctx, bool cross, int32_t *blocks, int n) {
  td_worker *w = ctx;
  cmd *c = w_cmd(CMD_RELEASE_BLOCKS, 0, -1);
  if (!c) {
    free(blocks);
    return;
  }
  c->cross = cross;
  c->blocks = blocks;
  c->n_blocks = n;
  w_post(w, c);
}

td_kvt_hooks w_kv_hooks(td_worker *w) {
  return (td_kvt_hooks){.accept = k_accept, .deliver = k_deliver, .arrived = k_arrived, .pushed = k_pushed,
                        .release = k_release, .ctx = w};
}

void td_job_push(td_worker *w, td_job *j, Tandem__Cluster__KvTarget *const *targets, size_t n_targets) {
  j->push_start_ns = td_now_ns();
  for (size_t i = 0; i < n_targets; i++) {
    const Tandem__Cluster__KvTarget *t = targets[i];
    if ((int)t->n_blocks != j->n_out) {
      push_failed(j, "target %s reserved %zu blocks for %d", t->worker_id, t->n_blocks, j->n_out);
      continue;
    }
    if (!j->out_blocks || j->n_out <= 0) {
      push_failed(j, "no blocks to push to %s", t->worker_id);
      continue;
    }
    kv_route r;
    w_kv_route(w, t, j->out_cross, &r);
    td_status s;
    if (!r.t)
      s = td_err(TD_ERR_UNSUPPORTED, "%s", r.why);
    else if (td_kvt_host_copy(r.t) && !j->out_host) /* no copy was made when the job came: UCX looked possible then */
      s = td_err(TD_ERR_UNSUPPORTED, "the blocks are not in host memory");
    else
      s = td_kvt_push_blocks(r.t, &(td_kvt_push){.rid = j->rid, .tag = j->slot, .peer_id = t->worker_id,
                                                  .peer_desc = r.desc, .peer_desc_len = r.desc_len,
                                                  .reservation = t->reservation,
                                                  .token = t->token.len == TD_KV_TOKEN_BYTES ? t->token.data : NULL,
                                                  .cross = j->out_cross,
                                                  .dst = t->blocks, .n = j->n_out, .src_blocks = j->out_blocks,
                                                  .src_host = j->out_host, .block_bytes = j->out_bb});
    w_kv_route_free(&r);
    if (s == TD_OK)
      j->pushes_pending++;
    else
      push_failed(j, "KV push to %s: %s", t->worker_id, td_errmsg());
  }
  if (j->pushes_pending == 0) pushes_over(w, j);
}

/* A job ends: its pushes are forgotten (no hook fires for them); a
 * transport that still reads its blocks takes them. */
void w_kv_forget(td_worker *w, td_job *j) {
  for (int k = 0; k < TD_KVT_KINDS; k++)
    if (w->kvt[k] && td_kvt_forget(w->kvt[k], j->rid, j->slot, j->out_cross, j->out_blocks, j->n_out))
      j->out_blocks = NULL;
}

int w_kv_pushing(td_worker *w) {
  int n = 0;
  for (int k = 0; k < TD_KVT_KINDS; k++)
    if (w->kvt[k]) n += td_kvt_pending(w->kvt[k]);
  return n;
}

/* Before sleeping: the compute thread woken for the turn's commands, the transports armed
 * (false: one has work that signals no descriptor). */
bool w_kv_arm(td_loop *l, void *ctx) {
  td_worker *w = ctx;
  w_wake_compute(w);
  bool sleep = true;
  for (int k = 0; k < TD_KVT_KINDS; k++)
    if (w->kvt[k] && !td_kvt_arm(w->kvt[k])) sleep = false;
  return sleep;
}

/* After sleeping: the transports progress; reservations their transfers released go back. */
void w_kv_progress(td_loop *l, void *ctx) {
  td_worker *w = ctx;
  for (int k = 0; k < TD_KVT_KINDS; k++)
    if (w->kvt[k]) td_kvt_progress(w->kvt[k]);
  w_release_deferred(w);
}
