/* Jobs, on the main thread: a job is a request's part on this worker for
 * one role (the same request may have an encode and a decode job here).
 * This file keeps the job table and the role API over it (worker/role.h):
 * taking a job, reserving blocks, running the request on the compute
 * thread, ending and failing jobs; and what the runtime does for every
 * role alike: reservations that expire, cancels (whatever the job is
 * doing: a reservation a transfer still writes goes back after it), and
 * the compute thread's events (reserved, done) dispatched to the roles. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "worker/internal.h"

/* ------------------------------------------------------------ the table */

int w_role_slot(const td_worker *w, const td_role *r) {
  for (int i = 0; i < w->n_roles; i++)
    if (w->roles[i] == r) return i;
  return -1;
}

td_job *w_job_find(td_worker *w, uint64_t rid, int slot) {
  job_key k = {rid, (uint64_t)slot};
  td_job *j = NULL;
  HASH_FIND(hh, w->jobs, &k, sizeof k, j);
  return j;
}

td_job *w_job_by_reservation(td_worker *w, uint64_t rid, uint64_t res, bool cross) {
  for (int s = 0; s < w->n_roles; s++) {
    td_job *j = w_job_find(w, rid, s);
    if (j && (cross ? j->cross_res : j->self_res) == res) return j;
  }
  return NULL;
}

void w_job_drop(td_worker *w, td_job *j) {
  HASH_DEL(w->jobs, j);
  if (j->msg) tandem__cluster__router_message__free_unpacked(j->msg, NULL);
  free(j->cross_ids);
  free(j->self_ids);
  free(j->cross_in);
  free(j->self_in);
  free(j->out_blocks);
  free(j->out_host);
  free(j);
}

void w_jobs_free(td_worker *w) {
  td_job *j, *t;
  HASH_ITER(hh, w->jobs, j, t) w_job_drop(w, j);
}

td_job *td_job_find(td_worker *w, uint64_t rid, const td_role *r) {
  int slot = w_role_slot(w, r);
  return slot < 0 ? NULL : w_job_find(w, rid, slot);
}

uint64_t td_job_rid(const td_job *j) { return j->rid; }
const Tandem__Cluster__RouterMessage *td_job_msg(const td_job *j) { return j->msg; }
const Tandem__Cluster__RequestSpec *td_job_spec(const td_job *j) { return j->spec; }
double td_job_compute_ms(const td_job *j) { return j->compute_ms; }
bool td_worker_draining(const td_worker *w) { return w->draining; }

td_job *td_job_take(td_worker *w, const td_role *r, Tandem__Cluster__RouterMessage *m,
                    const Tandem__Cluster__RequestSpec *spec, bool well_formed) {
  int slot = w_role_slot(w, r);
  if (!spec || !well_formed || slot < 0 || w->draining || w_job_find(w, spec->rid, slot)) {
    if (spec) {
      char why[128];
      snprintf(why, sizeof why, "this worker takes no %s work now", r->name);
      td_worker_send_failed(w, spec->rid, TD_ERR_OVERLOADED, why, true);
    }
    tandem__cluster__router_message__free_unpacked(m, NULL);
    return NULL;
  }
  td_job *j = calloc(1, sizeof *j);
  if (!j) {
    td_worker_send_failed(w, spec->rid, TD_ERR_NOMEM, "out of memory", true);
    tandem__cluster__router_message__free_unpacked(m, NULL);
    return NULL;
  }
  j->key = (job_key){spec->rid, (uint64_t)slot};
  j->rid = spec->rid;
  j->slot = slot;
  j->role = r;
  j->msg = m;
  j->spec = spec;
  j->t_recv_ns = td_now_ns();
  HASH_ADD(hh, w->jobs, key, sizeof j->key, j);
  return j;
}

/* ------------------------------------------------------------ reservations */

bool w_res_busy(td_worker *w, uint64_t cross_res, uint64_t self_res) {
  for (int k = 0; k < TD_KVT_KINDS; k++)
    if (w->kvt[k] && (td_kvt_busy(w->kvt[k], cross_res) || td_kvt_busy(w->kvt[k], self_res))) return true;
  return false;
}

static void post_release_res(td_worker *w, uint64_t rid, int slot, uint64_t cross_res, uint64_t self_res) {
  cmd *c = w_cmd(CMD_RELEASE_RES, rid, slot);
  if (c) {
    c->cross_res = cross_res;
    c->self_res = self_res;
    w_post(w, c);
  }
}

/* Gives reservations back, once no granted transfer writes them. */
static void release_res(td_worker *w, uint64_t rid, int slot, uint64_t cross_res, uint64_t self_res) {
  if (w_res_busy(w, cross_res, self_res)) {
    dres *d = calloc(1, sizeof *d);
    if (!d) return; /* lost rather than handed out while written */
    *d = (dres){rid, slot, cross_res, self_res, w->deferred};
    w->deferred = d;
    return;
  }
  post_release_res(w, rid, slot, cross_res, self_res);
}

void w_release_deferred(td_worker *w) {
  for (dres **pp = &w->deferred; *pp;) {
    dres *d = *pp;
    if (w_res_busy(w, d->cross_res, d->self_res)) {
      pp = &d->next;
      continue;
    }
    *pp = d->next;
    post_release_res(w, d->rid, d->slot, d->cross_res, d->self_res);
    free(d);
  }
}

/* in 64 bits: token counts come from the router's message */
static int64_t blocks_for(int tokens, int bs) { return ((int64_t)tokens + bs - 1) / bs; }

/* A sender the receiver can check: a token of TD_KV_TOKEN_BYTES, a key of
 * Z85's 40 characters or none. */
static bool sender_ok(const Tandem__Cluster__KvSender *s) {
  size_t kl = s && s->key ? strlen(s->key) : 0;
  return s && s->token.len == TD_KV_TOKEN_BYTES && (kl == 0 || kl == TD_AUTH_KEY_Z85 - 1);
}

td_status td_job_reserve(td_worker *w, td_job *j, int cross_tokens, int self_tokens,
                         const Tandem__Cluster__KvSender *cross_from, const Tandem__Cluster__KvSender *self_from) {
  if (cross_tokens < 0 || self_tokens < 0)
    return td_err(TD_ERR_INVALID, "request %llu: %d encoder and %d prompt tokens to reserve blocks for",
                  (unsigned long long)j->rid, cross_tokens, self_tokens);
  /* blocks nobody may fill would wait for their expiry */
  if ((cross_tokens > 0 && !sender_ok(cross_from)) || (self_tokens > 0 && !sender_ok(self_from)))
    return td_err(TD_ERR_INVALID, "request %llu: the job names no well-formed KV sender for its %s blocks (a token of "
                  "%d bytes; a router older than this worker?)", (unsigned long long)j->rid,
                  cross_tokens > 0 && !sender_ok(cross_from) ? "cross" : "prompt", TD_KV_TOKEN_BYTES);
  j->cross_from = cross_tokens > 0 ? cross_from : NULL;
  j->self_from = self_tokens > 0 ? self_from : NULL;
  int64_t nc = blocks_for(cross_tokens, w->block_size), ns = blocks_for(self_tokens, w->block_size);
  /* what no wait makes fit is refused now, naming the pool */
  if (nc > w->cross_blocks)
    return td_err(TD_ERR_NO_BLOCKS, "request %llu needs %lld cross-attention blocks (%d encoder tokens), this "
                  "worker's cross pool holds %d (--cross-blocks)", (unsigned long long)j->rid, (long long)nc,
                  cross_tokens, w->cross_blocks);
  if (ns > w->self_blocks)
    return td_err(TD_ERR_NO_BLOCKS, "request %llu needs %lld self-attention blocks (%d prompt tokens), this "
                  "worker's self pool holds %d (--kv-blocks)", (unsigned long long)j->rid, (long long)ns, self_tokens,
                  w->self_blocks);
  cmd *c = w_cmd(CMD_RESERVE, j->rid, j->slot);
  if (!c) return td_err(TD_ERR_NOMEM, "out of memory");
  c->n_cross = (int)nc;
  c->n_self = (int)ns;
  j->self_expected = self_tokens;
  w_post(w, c);
  return TD_OK;
}

bool td_job_kv_ready(const td_job *j) {
  if (j->added || !j->reserved || j->cross_got < j->n_cross) return false;
  return !j->self_expected || j->self_got >= j->n_self;
}

/* ------------------------------------------------------------ running */

static int32_t *dup_i32(const int32_t *v, size_t n) {
  int32_t *p = malloc(sizeof *p * (n + 1));
  if (p && n) memcpy(p, v, sizeof *p * n);
  return p;
}

static void copy_sampling(td_request_params *p, const Tandem__SamplingParams *s) {
  p->temperature = s->temperature;
  p->top_k = s->top_k;
  p->top_p = s->top_p > 0 && s->top_p < 1 ? s->top_p : 1.0f;
  p->seed = s->seed;
  p->has_seed = s->has_seed;
  p->n = s->n ? (int)s->n : 1;
  p->num_beams = s->num_beams ? (int)s->num_beams : 1;
  p->num_return_sequences = (int)s->num_return_sequences;
  if (s->has_length_penalty) p->length_penalty = s->length_penalty;
  p->early_stopping = s->early_stopping;
  p->ignore_eos = s->ignore_eos;
  p->logprobs = s->logprobs;
  if (s->set_forced_bos) p->forced_bos = s->forced_bos_token_id < 0 ? -1 : s->forced_bos_token_id;
  if (s->set_forced_eos) p->forced_eos = s->forced_eos_token_id < 0 ? -1 : s->forced_eos_token_id;
  p->timestamp_begin = s->timestamp_begin;
  p->max_initial_timestamp = s->has_max_initial_timestamp ? s->max_initial_timestamp_index : -1;
  p->probe = s->probe;
  p->probe_token = s->probe_token_id;
  p->probe_position = s->probe_position > INT_MAX ? INT_MAX : (int)s->probe_position;
}

/* A CMD_ADD built from the job's spec (arrays copied). */
static td_status add_cmd(td_worker *w, td_job *j, cmd **out) {
  const Tandem__Cluster__RequestSpec *sp = j->spec;
  size_t nf = sp->features ? sp->features->n_values : 0;
  if (nf && nf != (size_t)w->cfg.num_mel_bins * (size_t)w->frames)
    return td_err(TD_ERR_INVALID, "bad request data: %zu audio feature values, the model takes %d mel bins x %d frames",
                  nf, w->cfg.num_mel_bins, w->frames);
  cmd *c = *out = w_cmd(CMD_ADD, j->rid, j->slot);
  if (!c) return td_err(TD_ERR_NOMEM, "out of memory");
  c->role = j->role;
  c->t_recv_ns = j->t_recv_ns;
  td_request *r = &c->req;
  c->id = strdup(sp->client_id ? sp->client_id : "");
  c->owned_i32[0] = dup_i32(sp->input_ids, sp->n_input_ids);
  c->owned_i32[1] = dup_i32(sp->decoder_prompt, sp->n_decoder_prompt);
  c->owned_i32[2] = dup_i32(sp->stop_token_ids, sp->n_stop_token_ids);
  const Tandem__SamplingParams *sa = sp->sampling;
  c->owned_i32[3] = dup_i32(sa ? sa->allowed_token_ids : NULL, sa ? sa->n_allowed_token_ids : 0);
  if (nf) c->owned_f32 = malloc(sizeof(float) * nf);
  if (!c->id || !c->owned_i32[0] || !c->owned_i32[1] || !c->owned_i32[2] || !c->owned_i32[3] ||
      (nf && !c->owned_f32)) {
    cmd_free(c);
    *out = NULL;
    return td_err(TD_ERR_NOMEM, "out of memory");
  }
  r->id = c->id;
  r->input_ids = sp->n_input_ids ? c->owned_i32[0] : NULL;
  r->n_input = (int)sp->n_input_ids;
  if (nf) {
    memcpy(c->owned_f32, sp->features->values, sizeof(float) * nf);
    r->features = c->owned_f32;
  }
  r->prompt = sp->n_decoder_prompt ? c->owned_i32[1] : NULL;
  r->n_prompt = (int)sp->n_decoder_prompt;
  td_request_params *p = &r->params;
  td_request_params_default(p);
  p->max_new_tokens = (int)sp->max_new_tokens;
  p->stop_ids = c->owned_i32[2];
  p->n_stop_ids = (int)sp->n_stop_token_ids;
  if (sp->sampling) copy_sampling(p, sp->sampling);
  p->allowed_ids = c->owned_i32[3];
  p->n_allowed = sa ? (int)sa->n_allowed_token_ids : 0;
  r->step_offset = sp->step_offset;
  r->enc_len = (int)sp->enc_len;
  return TD_OK;
}

td_status td_job_run_request(td_worker *w, td_job *j, const td_job_run *run) {
  cmd *c;
  TD_TRY(add_cmd(w, j, &c));
  if (run->reserved_kv) {
    c->cross_res = j->cross_res;
    c->n_cross = j->n_cross;
    if (j->cross_form == KV_FORM_STATES && j->n_cross > 0) {
      c->project_cross = true;
      c->proj_blocks = malloc(sizeof(int32_t) * (size_t)j->n_cross);
      if (!c->proj_blocks) {
        cmd_free(c);
        return td_err(TD_ERR_NOMEM, "out of memory");
      }
      memcpy(c->proj_blocks, j->cross_ids, sizeof(int32_t) * (size_t)j->n_cross);
    }
    if (j->self_expected) {
      c->self_res = j->self_res;
      c->n_self = j->n_self;
      c->req.n_computed = j->self_expected;
    }
  } else {
    c->req.enc_len = 0; /* encoded here */
  }
  c->req.encode_only = run->encode_only;
  if (run->prefill_tokens > 0) c->req.prefill_only = run->prefill_tokens;
  if (run->adjust) run->adjust(&c->req);
  if (j->role->hands_over != TD_POOL_NONE)
    c->host_copy = w_kv_host_copy(w, run->push_to, run->n_push_to, j->role->hands_over == TD_POOL_CROSS);
  j->added = true;
  w_post(w, c);
  return TD_OK;
}

/* ------------------------------------------------------------ ending */

void w_release_out_blocks(td_worker *w, td_job *j) {
  if (!j->out_blocks) return;
  cmd *c = w_cmd(CMD_RELEASE_BLOCKS, j->rid, j->slot);
  if (!c) return;
  c->cross = j->out_cross;
  c->blocks = j->out_blocks;
  c->n_blocks = j->n_out;
  j->out_blocks = NULL;
  w_post(w, c);
}

/* Gives back what the job holds; cancel: also stops its request on the engine. */
static void job_end(td_worker *w, td_job *j, bool cancel) {
  if (!j->added && (j->cross_res || j->self_res)) release_res(w, j->rid, j->slot, j->cross_res, j->self_res);
  if (cancel && j->added && !j->finished) w_post(w, w_cmd(CMD_CANCEL, j->rid, j->slot));
  /* blocks that a transport still reads go back when its cancelled pushes stopped */
  w_kv_forget(w, j);
  w_release_out_blocks(w, j);
  w_job_drop(w, j);
}

void td_job_end(td_worker *w, td_job *j) { job_end(w, j, true); }

void td_job_fail(td_worker *w, td_job *j, td_status code, const char *msg) {
  /* bad input fails for good; a lost reservation or full pool may fit elsewhere */
  td_worker_send_failed(w, j->rid, code, msg, code != TD_ERR_INVALID && code != TD_ERR_UNSUPPORTED);
  td_job_end(w, j);
}

/* Ends every part of rid on this worker. */
void w_cancel_rid(td_worker *w, uint64_t rid) {
  for (int s = 0; s < w->n_roles; s++) {
    td_job *j = w_job_find(w, rid, s);
    if (j) job_end(w, j, false);
  }
  w_post(w, w_cmd(CMD_CANCEL, rid, -1));
  w_stream_forget(w, rid); /* a new attempt here counts its offsets afresh */
}

void w_cancel_all(td_worker *w, const char *why) {
  int n = 0;
  while (w->jobs) {
    w_cancel_rid(w, w->jobs->rid);
    n++;
  }
  if (n) TD_WARN("dropped %d requests: %s", n, why);
}

int w_expiry_timer(td_loop *l, void *ctx) {
  td_worker *w = ctx;
  int64_t now = td_now_ms();
  /* a cancel drops every job of its request: walk again after each */
  for (bool again = true; again;) {
    again = false;
    td_job *j, *t;
    HASH_ITER(hh, w->jobs, j, t) {
      /* a granted transfer keeps writing until its recv event: wait for it */
      if (!j->reserved || j->added || now <= j->expires || w_res_busy(w, j->cross_res, j->self_res)) continue;
      uint64_t rid = j->rid;
      TD_WARN("request %llu: KV did not arrive in time", (unsigned long long)rid);
      w_cancel_rid(w, rid);
      td_worker_send_failed(w, rid, TD_ERR_TIMEOUT, "KV blocks did not arrive before the reservation expired", true);
      again = true;
      break;
    }
  }
  return TD_WORKER_EXPIRY_CHECK_MS;
}

/* ------------------------------------------------------------ compute events */

/* An event for a job that is gone (cancelled meanwhile): give back what it carries. */
static void orphan_event(td_worker *w, wev *e) {
  if (e->kind == EV_RESERVED && (e->cross_res || e->self_res)) {
    post_release_res(w, e->rid, e->slot, e->cross_res, e->self_res);
  } else if (e->kind == EV_DONE && e->n_blocks) {
    cmd *c = w_cmd(CMD_RELEASE_BLOCKS, e->rid, e->slot);
    if (c) {
      c->cross = e->blocks_cross;
      c->blocks = e->blocks;
      c->n_blocks = e->n_blocks;
      e->blocks = NULL;
      w_post(w, c);
    }
  }
}

static void on_reserved(td_worker *w, td_job *j, wev *e) {
  j->reserved = true;
  j->cross_res = e->cross_res;
  j->self_res = e->self_res;
  j->cross_ids = e->cross_ids;
  j->self_ids = e->self_ids;
  j->n_cross = e->n_cross;
  j->n_self = e->n_self;
  e->cross_ids = e->self_ids = NULL;
  j->cross_in = calloc((size_t)j->n_cross + 1, 1);
  j->self_in = calloc((size_t)j->n_self + 1, 1);
  if (!j->cross_in || !j->self_in) {
    td_job_fail(w, j, TD_ERR_NOMEM, "out of memory");
    return;
  }
  j->expires = td_now_ms() + w->o.reservation_ttl_ms;
  w_send_reserved(w, j);
}

static void on_done(td_worker *w, td_job *j, wev *e) {
  const td_role *r = j->role;
  uint64_t rid = j->rid;
  j->finished = true;
  if (r->streams) w_stream_flush(w); /* every token before the result */
  /* handed-over blocks are the job's now, also when it failed (td_job_end gives them back) */
  j->out_blocks = e->blocks;
  j->n_out = e->n_blocks;
  j->out_cross = e->blocks_cross;
  j->out_host = e->host;
  j->out_bb = e->block_bytes;
  e->blocks = NULL;
  e->host = NULL;
  if (e->status != TD_OK) {
    if (e->status == TD_ERR_CANCELLED) {
      td_job_end(w, j);
    } else {
      char why[256];
      snprintf(why, sizeof why, "%s failed", r->name);
      td_job_fail(w, j, e->status, e->error ? e->error : why);
    }
  } else {
    j->compute_ms = e->ms;
    td_done d = {.outputs = e->outputs, .n_outputs = e->n_outputs, .ms = e->ms, .first_ms = e->first_ms};
    r->on_done(w, j, &d);
  }
  if (r->streams) w_stream_forget(w, rid);
}

void w_on_events(td_loop *l, void *ctx) {
  td_worker *w = ctx;
  wev *list = w_events_take(w);
  while (list) {
    wev *e = list;
    list = e->next;
    td_job *j = w_job_find(w, e->rid, e->slot);
    if (e->kind == EV_TOKEN) {
      if (j) w_stream_token(w, e->rid, e->seq, e->token, e->logprob);
    } else if (!j) {
      orphan_event(w, e);
    } else if (e->kind == EV_RESERVED) {
      on_reserved(w, j, e);
    } else {
      on_done(w, j, e);
    }
    ev_free(e);
  }
  w_stream_flush(w);
  pthread_mutex_lock(&w->mu);
  bool idle_news = w->idle_news;
  w->idle_news = false;
  pthread_mutex_unlock(&w->mu);
  if (idle_news && w->registered) w_send_heartbeat(w);
}
