/* The compute thread: it owns the backend, the model, the engine and the
 * engine's KV pools, takes commands from the main thread (w_post: reserve,
 * add, cancel, release, write arrived KV) and answers with events (blocks
 * reserved, a token, a request done) that the main loop reads when the
 * eventfd turns readable. Nothing else in the runtime touches the engine,
 * so the main loop never waits on compute. A group leader also feeds its
 * followers from this thread (leader.c; arrived KV sliced per rank here). */
#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "worker/internal.h"

/* ------------------------------------------------------------ queues */

cmd *w_cmd(cmd_kind kind, uint64_t rid, int slot) {
  cmd *c = calloc(1, sizeof *c);
  if (c) {
    c->kind = kind;
    c->rid = rid;
    c->slot = slot;
  }
  return c;
}

void cmd_free(cmd *c) {
  if (!c) return;
  free(c->blocks);
  free(c->proj_blocks);
  free(c->data);
  free(c->id);
  for (int i = 0; i < 4; i++) free(c->owned_i32[i]);
  free(c->owned_f32);
  free(c);
}

/* Commands queue up during a turn of the main loop and wake the compute
 * thread once, before the loop sleeps (w_wake_compute): the requests of a
 * burst reach the engine together and are encoded in one batch. */
void w_post(td_worker *w, cmd *c) {
  if (!c) return;
  pthread_mutex_lock(&w->mu);
  if (w->cmd_tail)
    w->cmd_tail->next = c;
  else
    w->cmd_head = c;
  w->cmd_tail = c;
  pthread_mutex_unlock(&w->mu);
  w->cmd_unsignalled = true;
}

void w_wake_compute(td_worker *w) {
  if (!w->cmd_unsignalled) return;
  w->cmd_unsignalled = false;
  pthread_mutex_lock(&w->mu);
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

/* Events wait on the compute thread's own list and go to the main thread
 * together (ev_flush): a step's tokens cost one lock and one eventfd write,
 * not one each. */
static void ev_push(td_worker *w, wev *e) {
  if (w->pend_tail)
    w->pend_tail->next = e;
  else
    w->pend_head = e;
  w->pend_tail = e;
}

static void ev_flush(td_worker *w) {
  if (!w->pend_head) return;
  pthread_mutex_lock(&w->mu);
  if (w->ev_tail)
    w->ev_tail->next = w->pend_head;
  else
    w->ev_head = w->pend_head;
  w->ev_tail = w->pend_tail;
  pthread_mutex_unlock(&w->mu);
  w->pend_head = w->pend_tail = NULL;
  uint64_t one = 1;
  if (write(w->efd, &one, sizeof one) < 0) TD_DEBUG("eventfd write: %s", strerror(errno));
}

wev *w_events_take(td_worker *w) {
  uint64_t cnt;
  if (read(w->efd, &cnt, sizeof cnt) < 0 && errno != EAGAIN) TD_DEBUG("eventfd read: %s", strerror(errno));
  pthread_mutex_lock(&w->mu);
  wev *list = w->ev_head;
  w->ev_head = w->ev_tail = NULL;
  pthread_mutex_unlock(&w->mu);
  return list;
}

void ev_free(wev *e) {
  if (!e) return;
  free(e->cross_ids);
  free(e->self_ids);
  free(e->error);
  for (int i = 0; i < e->n_outputs; i++) {
    free(e->outputs[i]->tokens);
    free(e->outputs[i]->logprobs);
    free(e->outputs[i]);
  }
  free(e->outputs);
  free(e->blocks);
  free(e->host);
  free(e);
}

load_snap w_load(td_worker *w) {
  pthread_mutex_lock(&w->mu);
  load_snap l = w->load;
  pthread_mutex_unlock(&w->mu);
  return l;
}

/* ------------------------------------------------------------ engine callbacks */

static void on_token(void *ctx, uint64_t handle, void *user, int seq, int32_t token, float logprob) {
  td_worker *w = ctx;
  creq *c = user;
  if (!c->role->streams) return;
  if (c->first_ms <= 0) c->first_ms = fmax((double)(td_now_ns() - c->t_recv_ns) / 1e6, 1e-6);
  wev *e = calloc(1, sizeof *e);
  if (!e) return;
  e->kind = EV_TOKEN;
  e->rid = c->rid;
  e->slot = c->slot;
  e->seq = seq;
  e->token = token;
  e->logprob = logprob;
  ev_push(w, e);
}

static Tandem__FinishReason finish_code(td_finish f) {
  switch (f) {
    case TD_FINISH_STOP: return TANDEM__FINISH_REASON__FINISH_STOP;
    case TD_FINISH_LENGTH: return TANDEM__FINISH_REASON__FINISH_LENGTH;
    case TD_FINISH_CANCELLED: return TANDEM__FINISH_REASON__FINISH_CANCELLED;
    case TD_FINISH_ERROR: return TANDEM__FINISH_REASON__FINISH_ERROR;
    default: return TANDEM__FINISH_REASON__FINISH_NONE;
  }
}

static void copy_outputs(wev *e, const td_result *r) {
  if (r->n_outputs) e->outputs = calloc((size_t)r->n_outputs, sizeof *e->outputs);
  for (int i = 0; e->outputs && i < r->n_outputs; i++) {
    const td_seq_output *o = &r->outputs[i];
    Tandem__SequenceOutput *so = malloc(sizeof *so);
    if (!so) break;
    tandem__sequence_output__init(so);
    so->tokens = malloc(sizeof(int32_t) * (size_t)(o->n_tokens + 1));
    if (so->tokens) memcpy(so->tokens, o->tokens, sizeof(int32_t) * (size_t)o->n_tokens);
    so->n_tokens = so->tokens ? (size_t)o->n_tokens : 0;
    if (o->logprobs) {
      so->logprobs = malloc(sizeof(float) * (size_t)(o->n_tokens + 1));
      if (so->logprobs) {
        memcpy(so->logprobs, o->logprobs, sizeof(float) * (size_t)o->n_tokens);
        so->n_logprobs = (size_t)o->n_tokens;
      }
    }
    so->score = o->score;
    so->finish_reason = finish_code(o->finish);
    so->has_probe_prob = o->has_probe;
    so->probe_prob = o->probe_prob;
    e->outputs[e->n_outputs++] = so;
  }
}

/* The blocks a finished request hands over, and their bytes in host memory
 * when a transport that copies pushes them. */
static void hand_over(td_worker *w, creq *c, wev *e, const td_result *r) {
  bool cross = c->role->hands_over == TD_POOL_CROSS;
  td_kv_pool *pool = cross ? td_engine_cross_pool(w->e) : td_engine_self_pool(w->e);
  size_t bb = td_kv_pool_block_bytes(pool);
  e->blocks = malloc(sizeof(int32_t) * (size_t)r->n_blocks);
  e->host = c->host_copy ? malloc(bb * (size_t)r->n_blocks) : NULL;
  if (!e->blocks || (!e->host && c->host_copy)) {
    e->status = td_err(TD_ERR_NOMEM, "out of memory");
    return;
  }
  memcpy(e->blocks, r->blocks, sizeof(int32_t) * (size_t)r->n_blocks);
  e->n_blocks = r->n_blocks;
  e->blocks_cross = cross;
  e->block_bytes = bb;
  for (int i = 0; e->host && i < r->n_blocks; i++)
    (void)td_copy_d2h(w->b, e->host + (size_t)i * bb, (uint8_t *)td_kv_pool_memory(pool) + (size_t)r->blocks[i] * bb,
                      bb);
  /* UCX reads the pool itself: the blocks must be complete before the main thread sees them */
  if (td_sync(w->b) != TD_OK) e->status = TD_ERR_CUDA;
}

static void on_finish(void *ctx, const td_result *r) {
  td_worker *w = ctx;
  creq *c = r->user;
  wev *e = calloc(1, sizeof *e);
  if (e) {
    e->kind = EV_DONE;
    e->rid = c->rid;
    e->slot = c->slot;
    e->status = r->status;
    e->error = r->error ? strdup(r->error) : NULL;
    e->ms = (double)(td_now_ns() - c->t_start_ns) / 1e6; /* sub-ms: a toy encode of < 1 ms read 0 and went uncounted */
    e->first_ms = c->first_ms;
    copy_outputs(e, r);
    if (r->n_blocks && c->role->hands_over != TD_POOL_NONE) hand_over(w, c, e, r);
    ev_push(w, e);
  }
  HASH_DEL(w->creqs, c);
  free(c);
}

/* ------------------------------------------------------------ commands */

static void done_error(td_worker *w, uint64_t rid, int slot, td_status s, const char *msg) {
  wev *e = calloc(1, sizeof *e);
  if (!e) return;
  e->kind = EV_DONE;
  e->rid = rid;
  e->slot = slot;
  e->status = s;
  e->error = strdup(msg);
  ev_push(w, e);
}

static void compute_reserve(td_worker *w, cmd *c) {
  wev *e = calloc(1, sizeof *e);
  if (!e) {
    done_error(w, c->rid, c->slot, TD_ERR_NOMEM, "out of memory");
    return;
  }
  e->kind = EV_RESERVED;
  e->rid = c->rid;
  e->slot = c->slot;
  e->cross_ids = calloc((size_t)c->n_cross + 1, sizeof(int32_t));
  e->self_ids = calloc((size_t)c->n_self + 1, sizeof(int32_t));
  td_status s = e->cross_ids && e->self_ids ? TD_OK : td_err(TD_ERR_NOMEM, "out of memory");
  /* the main thread expires reservations itself (it knows about transfers in flight);
   * the encoder cache gives up blocks first */
  if (s == TD_OK && c->n_cross) td_engine_cache_reclaim(w->e, c->n_cross);
  if (s == TD_OK && c->n_cross)
    s = td_kv_reserve(td_engine_cross_pool(w->e), c->n_cross, INT64_MAX, &e->cross_res, e->cross_ids);
  if (s == TD_OK && c->n_self) {
    s = td_kv_reserve(td_engine_self_pool(w->e), c->n_self, INT64_MAX, &e->self_res, e->self_ids);
    if (s != TD_OK && c->n_cross) (void)td_kv_reservation_release(td_engine_cross_pool(w->e), e->cross_res);
  }
  if (s != TD_OK) {
    ev_free(e);
    done_error(w, c->rid, c->slot, s, td_errmsg());
    return;
  }
  e->n_cross = c->n_cross;
  e->n_self = c->n_self;
  ev_push(w, e);
}

/* Claims a reservation's blocks into a buffer of its own size. */
static td_status claim(td_kv_pool *p, uint64_t res, int expected, int32_t **ids, int *n) {
  *ids = malloc(sizeof **ids * (size_t)(expected > 0 ? expected : 1));
  if (!*ids) return td_err(TD_ERR_NOMEM, "out of memory");
  return td_kv_reservation_claim(p, res, *ids, expected, n);
}

static void compute_add(td_worker *w, cmd *c) {
  int32_t *cross = NULL, *self = NULL;
  int nc = 0, ns = 0;
  td_status s = TD_OK;
  td_request r = c->req;
  if (c->proj_failed) s = td_err(TD_ERR_INTERNAL, "%s", c->proj_error);
  if (s == TD_OK && c->cross_res) {
    s = claim(td_engine_cross_pool(w->e), c->cross_res, c->n_cross, &cross, &nc);
    r.cross_blocks = cross;
    r.n_cross_blocks = nc;
  }
  if (s == TD_OK && c->self_res) {
    s = claim(td_engine_self_pool(w->e), c->self_res, c->n_self, &self, &ns);
    r.self_blocks = self;
    r.n_self_blocks = ns;
  }
  creq *cr = calloc(1, sizeof *cr);
  if (s == TD_OK && !cr) s = td_err(TD_ERR_NOMEM, "out of memory");
  if (s == TD_OK) {
    cr->rid = c->rid;
    cr->slot = c->slot;
    cr->role = c->role;
    cr->t_start_ns = td_now_ns();
    cr->t_recv_ns = c->t_recv_ns ? c->t_recv_ns : cr->t_start_ns;
    cr->host_copy = c->host_copy;
    r.user = cr;
    s = td_engine_add(w->e, &r, &cr->handle);
  }
  if (s != TD_OK) {
    /* the claimed blocks are ours to free */
    td_kv_unref_all(td_engine_cross_pool(w->e), cross, nc);
    td_kv_unref_all(td_engine_self_pool(w->e), self, ns);
    free(cr);
    done_error(w, c->rid, c->slot, s, td_errmsg());
  } else {
    HASH_ADD(hh, w->creqs, rid, sizeof cr->rid, cr);
  }
  free(cross);
  free(self);
}

static void compute_cancel(td_worker *w, uint64_t rid, int slot) {
  creq *c, *t;
  HASH_ITER(hh, w->creqs, c, t) {
    if (c->rid == rid && (slot < 0 || c->slot == slot)) (void)td_engine_cancel(w->e, c->handle); /* on_finish frees c */
  }
}

/* Arrived whole-model blocks: this rank's part into its pool, the other
 * ranks' parts to them through the mirror (before any step that reads
 * them, since the mirror keeps order). A cross block's states tail is not
 * split by heads or layers: every rank takes all of it. */
static void compute_write_kv(td_worker *w, cmd *c) {
  td_kv_pool *pool = c->cross ? td_engine_cross_pool(w->e) : td_engine_self_pool(w->e);
  size_t bb = td_kv_pool_block_bytes(pool), es = td_buf_elem_size(w->b, TD_BUF_ACT);
  if (c->states_only) { /* each tail at its block's end, on every rank the same (a tail is whole on each) */
    for (int i = 0; i < c->n_blocks; i++)
      if (c->blocks[i] >= 0 && c->blocks[i] < td_kv_pool_get_stats(pool).n_blocks)
        (void)td_copy_h2d(w->b, (uint8_t *)td_kv_pool_memory(pool) + (size_t)c->blocks[i] * bb + bb - w->states_bb,
                          c->data + (size_t)i * w->states_bb, w->states_bb);
    (void)td_sync(w->b);
    if (w->world > 1) {
      size_t len = 6 + (size_t)c->n_blocks * (4 + w->states_bb);
      uint8_t *msg = malloc(len);
      if (!msg) {
        TD_ERROR("out of memory forwarding %d encoder states blocks", c->n_blocks);
        return;
      }
      msg[0] = 'K';
      msg[1] = MIRROR_KV_STATES;
      memcpy(msg + 2, &c->n_blocks, 4);
      memcpy(msg + 6, c->blocks, sizeof(int32_t) * (size_t)c->n_blocks);
      memcpy(msg + 6 + (size_t)c->n_blocks * 4, c->data, (size_t)c->n_blocks * w->states_bb);
      for (int r = 1; r < w->world; r++) w_mirror_send(w, r, msg, len);
      free(msg);
    }
    return;
  }
  const td_kv_layout *fl = c->cross ? &w->full_cross : &w->full_self;
  size_t full_bb = c->cross ? w->full_cross_bb : w->full_self_bb;
  int L = fl->n_layers, H = fl->n_heads;
  int tp = w->o.tp > 1 ? w->o.tp : 1, pp = w->o.pp > 1 ? w->o.pp : 1;
  uint8_t *part = malloc(full_bb);
  uint8_t *msg = NULL;
  if (!part) {
    TD_ERROR("out of memory writing %d arrived KV blocks", c->n_blocks);
    return;
  }
  for (int r = 0; r < w->world; r++) {
    int l0, l1, h0, h1;
    group_rank_range(r, tp, pp, L, H, &l0, &l1, &h0, &h1);
    td_kv_layout rl = {l1 - l0, h1 - h0, fl->head_dim, fl->block_size, fl->states, fl->int8};
    size_t rb = td_kv_block_elems(&rl) * es;
    if (r > 0) {
      free(msg);
      msg = malloc(1 + 1 + 4 + (size_t)c->n_blocks * (4 + rb));
      if (!msg) {
        TD_ERROR("out of memory forwarding %d KV blocks to rank %d", c->n_blocks, r);
        break;
      }
      msg[0] = 'K';
      msg[1] = c->cross ? MIRROR_KV_CROSS : MIRROR_KV_SELF;
      memcpy(msg + 2, &c->n_blocks, 4);
      memcpy(msg + 6, c->blocks, sizeof(int32_t) * (size_t)c->n_blocks);
    }
    for (int i = 0; i < c->n_blocks; i++) {
      const uint8_t *full = c->data + (size_t)i * full_bb;
      uint8_t *dst = r == 0 ? part : msg + 6 + (size_t)c->n_blocks * 4 + (size_t)i * rb;
      group_slice_block(full, dst, fl, es, l0, l1, h0, h1);
      if (r == 0 && c->blocks[i] >= 0 && c->blocks[i] < td_kv_pool_get_stats(pool).n_blocks)
        (void)td_copy_h2d(w->b, (uint8_t *)td_kv_pool_memory(pool) + (size_t)c->blocks[i] * bb, part, bb);
      if (r == 0) (void)td_sync(w->b); /* part is reused */
    }
    if (r > 0) w_mirror_send(w, r, msg, 6 + (size_t)c->n_blocks * (4 + rb));
  }
  free(msg);
  free(part);
}

static void compute_handle(td_worker *w, cmd *c) {
  switch (c->kind) {
    case CMD_RESERVE: compute_reserve(w, c); break;
    case CMD_RELEASE_RES:
      if (c->cross_res) (void)td_kv_reservation_release(td_engine_cross_pool(w->e), c->cross_res);
      if (c->self_res) (void)td_kv_reservation_release(td_engine_self_pool(w->e), c->self_res);
      break;
    case CMD_ADD: compute_add(w, c); break;
    case CMD_CANCEL: compute_cancel(w, c->rid, c->slot); break;
    case CMD_RELEASE_BLOCKS: td_engine_release(w->e, c->cross, c->blocks, c->n_blocks); break;
    case CMD_WRITE_KV: compute_write_kv(w, c); break;
  }
}

/* ------------------------------------------------------------ the thread */

/* Which decode steps attend over the encoder states (a dual pool picks by
 * the step's rows): logged once, for the operator. */
static void log_cross_paths(const td_worker *w) {
  td_cross_mode mode = td_model_get_opts(w->m)->cross_mode;
  int r[8][2], n = td_model_states_ranges(w->m, w->o.max_batch, r, 8);
  char buf[256] = "";
  size_t at = 0;
  for (int i = 0; i < n && i < 8 && at < sizeof buf; i++)
    at += (size_t)snprintf(buf + at, sizeof buf - at, "%s%d-%d", i ? ", " : "", r[i][0], r[i][1]);
  if (n == 0)
    TD_INFO("cross pool %s: every decode step over the per-layer K/V", td_cross_mode_name(mode));
  else
    TD_INFO("cross pool %s: decode steps of %s%s rows over the encoder states%s", td_cross_mode_name(mode), buf,
            n > 8 ? ", ..." : "", mode == TD_CROSS_DUAL ? ", the others over the per-layer K/V" : "");
}

static void model_facts(td_worker *w) {
  w->cfg = *td_model_get_config(w->m);
  w->max_src = td_model_max_source_len(w->m);
  w->max_tgt = td_model_max_target_len(w->m);
  w->frames = td_model_input_frames(w->m);
  w->start_token = td_model_get_gen(w->m)->decoder_start_token_id;
  w->block_size = td_model_get_opts(w->m)->block_size;
  td_engine_stats st = td_engine_get_stats(w->e);
  w->self_blocks = st.self.n_blocks;
  w->cross_blocks = st.cross.n_blocks;
  /* heartbeats before the first command report the pools as they are (read after `ready`) */
  w->load = (load_snap){.free_self = st.self.n_free, .free_cross = st.cross.n_free};
  w->max_running = w->o.max_batch;
  size_t es = td_buf_elem_size(w->b, TD_BUF_ACT);
  w->full_self = (td_kv_layout){w->cfg.dec_layers, w->cfg.dec_heads, w->cfg.dec_head_dim, w->block_size, 0, 0};
  /* the whole decoder's K/V (none in STATES), the states tail as the model's */
  td_kv_layout mcl = td_model_cross_layout(w->m);
  w->full_cross = w->full_self;
  if (mcl.n_layers == 0) w->full_cross.n_layers = 0;
  w->full_cross.states = mcl.states;
  w->full_cross.int8 = mcl.int8; /* one rank only: the pool's own blocks */
  w->full_self_bb = td_kv_block_elems(&w->full_self) * es;
  w->full_cross_bb = td_kv_block_elems(&w->full_cross) * es;
  /* a group's leader takes states too: its followers get the same tails and replay the projection */
  w->states_bb = mcl.n_layers > 0 && mcl.states > 0 ? (size_t)w->block_size * (size_t)mcl.states * es : 0;
  /* the pools stay this thread's; the main thread registers their memory with UCX */
  td_kv_pool *cp = td_engine_cross_pool(w->e), *sp = td_engine_self_pool(w->e);
  w->pools.cuda = w->o.device == TD_BACKEND_CUDA;
  w->pools.device = w->o.device_id;
  w->pools.elem_size = (int)es;
  w->pools.cross = (td_kvt_pool){td_model_cross_layout(w->m), td_kv_pool_memory(cp), st.cross.n_blocks,
                                 td_kv_pool_block_bytes(cp)};
  w->pools.self = (td_kvt_pool){td_model_self_layout(w->m), td_kv_pool_memory(sp), st.self.n_blocks,
                                td_kv_pool_block_bytes(sp)};
}

static td_status compute_init(td_worker *w) {
  td_backend_opts bo = {.kind = w->o.device, .device = w->o.device_id, .threads = w->o.threads,
                        .cuda = w->o.settings.cuda};
  TD_TRY(td_backend_create(&bo, &w->b));
  td_model_opts mo = {.block_size = w->o.block_size, .max_seqs = w->o.max_batch, .max_tokens = w->o.max_tokens,
                      .max_enc_tokens = w->o.max_enc_tokens, .max_enc_seqs = w->o.max_enc_seqs,
                      .cross_mode = w->o.cross_mode, .states_rows = w->o.states_rows,
                      .cross_int8 = w->o.cross_int8, .tuning = w->o.settings.model};
  if (w->world > 1) TD_TRY(w_leader_init(w, &mo));
  bool enc_only = w->n_roles > 0;
  for (int i = 0; i < w->n_roles; i++) enc_only &= w->roles[i]->id == TANDEM__CLUSTER__ROLE__ROLE_ENCODE;
  if (enc_only && w->world > 1) {
    /* an encoder group (tandem-worker resolved its cross mode to states for every rank): the tails are whole on
       each rank, so rank 0 pushes them like a single-rank encoder */
    if (mo.cross_mode != TD_CROSS_STATES)
      return td_err(TD_ERR_INVALID, "an encoder group pushes encoder states: --cross-mode states on every rank");
    w->states_out = true;
    TD_INFO("cross transfer: encoder states from a group of %d ranks", w->world);
  } else if (enc_only && mo.cross_mode == TD_CROSS_AUTO && td_cross_pushes_states(mo.cross_mode, w->o.cross_transfer_kv)) {
    /* pushes of the encoder states (the decode side projects them): 1 / (2 x layers) of the K/V bytes */
    mo.cross_mode = TD_CROSS_STATES;
    if (td_model_load(w->o.model_dir, w->b, &mo, &w->m) == TD_OK) {
      w->states_out = true;
      TD_INFO("cross transfer: encoder states (the receivers project them into K/V; --cross-transfer kv: K/V)");
    } else {
      TD_INFO("cross transfer: K/V (%s)", td_errmsg()); /* an odd d_model has no states tail */
      mo.cross_mode = TD_CROSS_AUTO;
    }
  }
  if (!w->m) TD_TRY(td_model_load(w->o.model_dir, w->b, &mo, &w->m));
  if (w->world > 1) TD_TRY(w_leader_wait_followers(w));
  /* a group's followers size their pools from the model alone: its leader too, so that block ids agree */
  td_engine_opts eo = {.self_blocks = w->o.self_blocks, .cross_blocks = w->o.cross_blocks,
                       .max_running = w->o.max_batch, .max_step_tokens = w->o.max_tokens,
                       .gpu_memory_fraction = w->world == 1 ? w->o.gpu_memory_fraction : 0,
                       .encoder_cache_fraction = w->o.encoder_cache_fraction,
                       .encode_defer_steps = w->o.encode_defer};
  td_engine_callbacks cb = {.on_token = on_token, .on_finish = on_finish, .ctx = w};
  TD_TRY(td_engine_create(w->m, &eo, &cb, &w->e));
  model_facts(w);
  log_cross_paths(w);
  return TD_OK;
}

/* Waits on the command queue's condition for at most us microseconds
 * (w->mu held). */
static void timed_wait(td_worker *w, long us) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_nsec += us * 1000L;
  while (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
  pthread_cond_timedwait(&w->cv, &w->mu, &ts);
}

/* Takes and runs the queued commands; returns how many were requests for
 * the engine. */
/* Requests whose cross KV arrived as encoder states: their K/V projected
 * together (one GEMM a decoder layer over all their rows), then each added. */
static void flush_projections(td_worker *w, cmd **pend, int *n_pend) {
  if (*n_pend == 0) return;
  int rows = 0;
  for (int i = 0; i < *n_pend; i++) rows += pend[i]->req.enc_len;
  int32_t *slots = malloc(sizeof *slots * (size_t)(rows > 0 ? rows : 1));
  td_status s = slots ? TD_OK : td_err(TD_ERR_NOMEM, "out of memory");
  int bs = w->block_size, k = 0;
  for (int i = 0; s == TD_OK && i < *n_pend; i++) {
    const cmd *c = pend[i];
    if (c->req.enc_len > c->n_cross * bs) {
      s = td_err(TD_ERR_INVALID, "request %llu: %d encoder positions in %d cross blocks of %d",
                 (unsigned long long)c->rid, c->req.enc_len, c->n_cross, bs);
      break;
    }
    for (int t = 0; t < c->req.enc_len; t++) slots[k++] = c->proj_blocks[t / bs] * bs + t % bs;
  }
  int64_t t0 = td_now_ns();
  if (s == TD_OK) s = td_model_project_cross(w->m, slots, k);
  w->project_ns += td_now_ns() - t0;
  free(slots);
  for (int i = 0; i < *n_pend; i++) {
    if (s != TD_OK) {
      pend[i]->proj_failed = true;
      snprintf(pend[i]->proj_error, sizeof pend[i]->proj_error, "projecting the arrived encoder states: %s",
               td_errmsg());
    }
    compute_handle(w, pend[i]);
    cmd_free(pend[i]);
  }
  *n_pend = 0;
}

static int run_commands(td_worker *w) {
  pthread_mutex_lock(&w->mu);
  cmd *list = w->cmd_head;
  w->cmd_head = w->cmd_tail = NULL;
  pthread_mutex_unlock(&w->mu);
  int added = 0, n_pend = 0;
  cmd *pend[64];
  while (list) {
    cmd *next = list->next;
    added += list->kind == CMD_ADD;
    if (list->kind == CMD_ADD && list->project_cross) {
      if (n_pend == (int)(sizeof pend / sizeof pend[0])) flush_projections(w, pend, &n_pend);
      pend[n_pend++] = list;
    } else {
      /* in order: a ZeroMQ push's bytes are written before the projection that reads them */
      flush_projections(w, pend, &n_pend);
      compute_handle(w, list);
      cmd_free(list);
    }
    list = next;
  }
  flush_projections(w, pend, &n_pend);
  return added;
}

static void *compute_main(void *arg) {
  td_worker *w = arg;
  td_status s = compute_init(w);
  pthread_mutex_lock(&w->mu);
  w->init_status = s;
  if (s != TD_OK) snprintf(w->init_error, sizeof w->init_error, "%s", td_errmsg());
  w->ready = true;
  pthread_cond_broadcast(&w->cv);
  pthread_mutex_unlock(&w->mu);
  if (s != TD_OK) return NULL;
  int64_t busy_ns = 0, idle_ns = 0; /* inside engine steps (the worker's utilisation); waiting for work */
  int64_t began_ms = 0, ended_ms = 0; /* wall clock of the last start and end of work */
  bool had_work = false;
  int64_t cmd_ns = 0, gather_ns = 0, ev_ns = 0, turns = 0; /* the rest of a turn, logged at the end */
  int64_t t_first = td_now_ns();
  int64_t spin_ns = (int64_t)w->o.spin_us * 1000, last_work_ns = 0;
  for (;;) {
    turns++;
    pthread_mutex_lock(&w->mu);
    int64_t t_wait = td_now_ns();
    /* --spin-us: the next command is taken without a wake-up of this thread */
    while (spin_ns && !w->cmd_head && !w->stop_compute && td_engine_idle(w->e) && td_now_ns() - last_work_ns < spin_ns) {
      pthread_mutex_unlock(&w->mu);
      sched_yield();
      pthread_mutex_lock(&w->mu);
    }
    while (!w->cmd_head && !w->stop_compute && td_engine_idle(w->e)) {
      timed_wait(w, TD_WORKER_COMPUTE_IDLE_MS * 1000L);
      if (w->world > 1) { /* an idle leader still heartbeats to its followers */
        pthread_mutex_unlock(&w->mu);
        w_mirror_tick(w);
        pthread_mutex_lock(&w->mu);
      }
    }
    idle_ns += td_now_ns() - t_wait;
    bool was_idle = td_engine_idle(w->e);
    pthread_mutex_unlock(&w->mu);
    int64_t t_cmd = td_now_ns();
    int added = run_commands(w);
    cmd_ns += td_now_ns() - t_cmd;
    /* A burst of requests on an idle engine: wait while more keep coming (a
     * short gap ends it), so that they are encoded as one batch; a lone
     * request starts at once. */
    if (was_idle && added >= 2) {
      int64_t t_gather = td_now_ns();
      int64_t end = t_gather + TD_WORKER_BURST_MAX_US * 1000LL;
      while (td_now_ns() < end) {
        pthread_mutex_lock(&w->mu);
        if (!w->cmd_head && !w->stop_compute) timed_wait(w, TD_WORKER_BURST_GAP_US);
        bool more = w->cmd_head != NULL;
        pthread_mutex_unlock(&w->mu);
        if (!more || !run_commands(w)) break;
      }
      gather_ns += td_now_ns() - t_gather;
    }
    pthread_mutex_lock(&w->mu);
    bool stop = w->stop_compute;
    pthread_mutex_unlock(&w->mu);
    int64_t t_ev = td_now_ns();
    ev_flush(w);
    ev_ns += td_now_ns() - t_ev;
    if (stop) {
      int64_t rest = td_now_ns() - t_first - busy_ns - cmd_ns - gather_ns - ev_ns - idle_ns;
      TD_INFO("compute thread: %lld turns; %.3f s in engine steps, %.3f s taking commands, %.3f s gathering bursts, "
              "%.3f s handing events, %.3f s idle, %.3f s the rest (counters, locks)",
              (long long)turns, (double)busy_ns / 1e9, (double)cmd_ns / 1e9, (double)gather_ns / 1e9,
              (double)ev_ns / 1e9, (double)idle_ns / 1e9, (double)rest / 1e9);
      if (w->world > 1) w_mirror_all(w, "S");
      break;
    }
    if (w->world > 1) w_mirror_tick(w);
    bool stepped = !td_engine_idle(w->e);
    if (stepped && !had_work) began_ms = td_wall_ms(), had_work = true;
    if (stepped) {
      int64_t t0 = td_now_ns();
      if (td_engine_step(w->e) != TD_OK) TD_ERROR("engine step failed: %s", td_errmsg());
      busy_ns += td_now_ns() - t0;
    }
    if (stepped || added) last_work_ns = td_now_ns();
    t_ev = td_now_ns();
    ev_flush(w);
    ev_ns += td_now_ns() - t_ev;
    td_engine_stats st = td_engine_get_stats(w->e);
    bool idle = !st.waiting && !st.running;
    if (idle && had_work) ended_ms = td_wall_ms(), had_work = false;
    pthread_mutex_lock(&w->mu);
    /* the router hears of an idle worker now, not at the next heartbeat:
     * its health never shows the last requests as still running, nor its
     * counters short of the last step (an encoder's request comes and goes
     * within one step), nor blocks that a finished push gave back */
    bool news = idle && (stepped || w->load.running || w->load.queued || w->load.free_self != st.self.n_free ||
                         w->load.free_cross != st.cross.n_free);
    if (news) w->idle_news = true;
    w->load = (load_snap){st.waiting,   st.running,     st.self.n_free,
                          st.cross.n_free, st.encodes,   st.cache_hits,
                          st.cache_blocks, st.steps,     st.tokens_generated,
                          st.encode_runs,  (double)busy_ns / 1e9, (double)idle_ns / 1e9,
                          (double)w->project_ns / 1e9, began_ms,      ended_ms};
    pthread_mutex_unlock(&w->mu);
    if (news) {
      uint64_t one = 1;
      if (write(w->efd, &one, sizeof one) < 0) TD_DEBUG("eventfd write: %s", strerror(errno));
    }
  }
  return NULL;
}

td_status w_compute_start(td_worker *w) {
  if (pthread_create(&w->thread, NULL, compute_main, w) != 0)
    return td_err(TD_ERR_INTERNAL, "cannot start the compute thread");
  w->thread_started = true;
  pthread_mutex_lock(&w->mu);
  while (!w->ready) pthread_cond_wait(&w->cv, &w->mu);
  pthread_mutex_unlock(&w->mu);
  if (w->init_status != TD_OK) return td_err(w->init_status, "%s", w->init_error);
  return TD_OK;
}

/* Stops the thread, then frees what it owned (the engine reports what it
 * still runs as events: freed by the caller after). */
void w_compute_stop(td_worker *w) {
  if (w->thread_started) {
    pthread_mutex_lock(&w->mu);
    w->stop_compute = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    w->thread_started = false;
  }
  td_engine_destroy(w->e);
  w->e = NULL;
  creq *c, *ct;
  HASH_ITER(hh, w->creqs, c, ct) {
    HASH_DEL(w->creqs, c);
    free(c);
  }
  while (w->cmd_head) {
    cmd *c2 = w->cmd_head;
    w->cmd_head = c2->next;
    cmd_free(c2);
  }
  w->cmd_tail = NULL;
  ev_flush(w); /* what the engine reported as it went */
  while (w->ev_head) {
    wev *e = w->ev_head;
    w->ev_head = e->next;
    ev_free(e);
  }
  w->ev_tail = NULL;
  if (w->msock) zmq_close(w->msock);
  w->msock = NULL;
  td_model_destroy(w->m);
  w->m = NULL;
  if (w->b) td_backend_set_comm(w->b, NULL);
  td_comm_destroy(w->comm);
  w->comm = NULL;
  td_backend_destroy(w->b);
  w->b = NULL;
  td_comm_zmq_boot_free(w->boot);
  w->boot = NULL;
}
