#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "worker/group.h"
#include "worker/internal.h"

/* compute-side record of a request the engine runs */
typedef struct creq {
  uint64_t rid;
  wrole role;
  uint64_t handle;
  int64_t t_start;
  bool host_copy; /* its handed-over blocks also go to host memory (a ZeroMQ push) */
  UT_hash_handle hh;
} creq;

/* Reservations of cancelled requests that a granted UCX transfer still
 * writes: given back after its recv event. */
typedef struct dres {
  uint64_t rid;
  wrole role;
  uint64_t cross_res, self_res;
  struct dres *next;
} dres;

/* The KV path last logged for a receiver (once per peer and path). */
typedef struct kvlog {
  char id[TD_WIRE_MAX_ID + 1];
  kv_path path;
  UT_hash_handle hh;
} kvlog;

typedef struct load_snap {
  int queued, running, free_self, free_cross;
} load_snap;

struct td_worker {
  td_worker_opts o;
  char id[TD_WIRE_MAX_ID + 1];
  void *zctx, *rsock;
  /* compute thread */
  pthread_t thread;
  bool thread_started;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  cmd *cmd_head, *cmd_tail;
  wev *ev_head, *ev_tail;
  int efd;
  bool stop_compute;
  bool ready;
  td_status init_status;
  char init_error[512];
  load_snap load;
  /* owned by the compute thread after start */
  td_backend *b;
  td_model *m;
  td_engine *e;
  creq *creqs;
  /* model facts for registration */
  td_model_config cfg;
  int max_src, max_tgt, frames, block_size, self_blocks, cross_blocks, max_running;
  int32_t start_token; /* the decoder's first token without a prompt */
  /* whole-model KV blocks, what peers push (cross: with the states tail per --cross-mode) */
  td_kv_layout full_self, full_cross;
  size_t full_self_bb, full_cross_bb;
  uxfer_opts pools; /* the engine's pools for UCX: set by compute_init, read after `ready` */
  /* main thread */
  xfer *x;
  uxfer *ux;          /* NULL: ZeroMQ only (--kv-transport zmq, a group, or UCX did not start) */
  uint8_t *desc;      /* TransferDesc: every way to push here */
  size_t desc_len;
  dres *deferred;
  kvlog *kvlogs;
  uint64_t kv_in_ucx, kv_in_zmq, kv_out_ucx, kv_out_zmq; /* blocks */
  job *jobs;
  bool registered;
  int hb_ms, dead_after;
  int64_t last_hb_sent, last_router_msg, last_register;
  uint64_t hb_seq;
  bool draining;
  int64_t drain_deadline;
  /* rank 0 of a tensor / pipeline parallel group */
  int world;
  group_info gi;
  td_comm_zmq_boot *boot;
  uint8_t nccl_id[TD_NCCL_ID_BYTES];
  void *msock; /* mirror to the followers: the compute thread's once it runs */
  td_comm *comm;
  int64_t last_mirror_hb;
  bool group_failed;
  char refused[512]; /* the router refused this worker: why */
};

/* ------------------------------------------------------------ group mirror */

static td_status mirror_publish(void *ctx, const void *bytes, size_t len) {
  td_worker *w = ctx;
  char *buf = malloc(len + 1);
  if (!buf) return td_err(TD_ERR_NOMEM, "out of memory");
  buf[0] = 'R';
  memcpy(buf + 1, bytes, len);
  td_status s = TD_OK;
  for (int r = 1; r < w->world && s == TD_OK; r++) {
    char id[32];
    snprintf(id, sizeof id, "f-%d", r);
    if (zmq_send(w->msock, id, strlen(id), ZMQ_SNDMORE) < 0 || zmq_send(w->msock, buf, len + 1, 0) < 0)
      s = td_err(TD_ERR_PEER, "mirror to rank %d: %s", r, zmq_strerror(zmq_errno()));
  }
  free(buf);
  w->last_mirror_hb = td_now_ms();
  return s;
}

static void mirror_all(td_worker *w, const char *what) {
  for (int r = 1; r < w->world; r++) {
    char id[32];
    snprintf(id, sizeof id, "f-%d", r);
    zmq_send(w->msock, id, strlen(id), ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(w->msock, what, 1, ZMQ_DONTWAIT);
  }
}

/* Followers' messages (hello, heartbeats); a heartbeat to them when idle. */
static int mirror_tick(td_worker *w) {
  int hellos = 0;
  for (;;) {
    zmq_msg_t id, body;
    zmq_msg_init(&id);
    zmq_msg_init(&body);
    if (zmq_msg_recv(&id, w->msock, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&id);
      zmq_msg_close(&body);
      break;
    }
    zmq_msg_recv(&body, w->msock, 0);
    if (zmq_msg_size(&body) && ((char *)zmq_msg_data(&body))[0] == 'Y') hellos++;
    zmq_msg_close(&id);
    zmq_msg_close(&body);
  }
  if (td_now_ms() - w->last_mirror_hb > 200) {
    mirror_all(w, "H");
    w->last_mirror_hb = td_now_ms();
  }
  return hellos;
}

/* ------------------------------------------------------------ queues */

cmd *w_cmd(cmd_kind kind, uint64_t rid, wrole r) {
  cmd *c = calloc(1, sizeof *c);
  if (c) {
    c->kind = kind;
    c->rid = rid;
    c->role = r;
  }
  return c;
}

static void cmd_free(cmd *c) {
  if (!c) return;
  free(c->blocks);
  free(c->data);
  for (int i = 0; i < 4; i++) free(c->owned_i32[i]);
  free(c->owned_f32);
  free(c);
}

void w_post(td_worker *w, cmd *c) {
  if (!c) return;
  pthread_mutex_lock(&w->mu);
  if (w->cmd_tail)
    w->cmd_tail->next = c;
  else
    w->cmd_head = c;
  w->cmd_tail = c;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

static void ev_push(td_worker *w, wev *e) {
  pthread_mutex_lock(&w->mu);
  if (w->ev_tail)
    w->ev_tail->next = e;
  else
    w->ev_head = e;
  w->ev_tail = e;
  pthread_mutex_unlock(&w->mu);
  uint64_t one = 1;
  if (write(w->efd, &one, sizeof one) < 0) TD_DEBUG("eventfd write: %s", strerror(errno));
}

static void ev_free(wev *e) {
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

/* ------------------------------------------------------------ compute thread */

static void on_token(void *ctx, uint64_t handle, void *user, int seq, int32_t token, float logprob) {
  td_worker *w = ctx;
  creq *c = user;
  if (c->role != ROLE_DECODE) return;
  wev *e = calloc(1, sizeof *e);
  if (!e) return;
  e->kind = EV_TOKEN;
  e->rid = c->rid;
  e->role = c->role;
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

static void on_finish(void *ctx, const td_result *r) {
  td_worker *w = ctx;
  creq *c = r->user;
  wev *e = calloc(1, sizeof *e);
  if (e) {
    e->kind = EV_DONE;
    e->rid = c->rid;
    e->role = c->role;
    e->status = r->status;
    e->error = r->error ? strdup(r->error) : NULL;
    e->ms = (double)(td_now_ms() - c->t_start);
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
      e->outputs[e->n_outputs++] = so;
    }
    if (r->n_blocks) {
      /* the blocks, and their bytes in host memory when ZeroMQ pushes them */
      td_kv_pool *pool = c->role == ROLE_ENCODE ? td_engine_cross_pool(w->e) : td_engine_self_pool(w->e);
      size_t bb = td_kv_pool_block_bytes(pool);
      e->blocks = malloc(sizeof(int32_t) * (size_t)r->n_blocks);
      e->host = c->host_copy ? malloc(bb * (size_t)r->n_blocks) : NULL;
      if (e->blocks && (e->host || !c->host_copy)) {
        memcpy(e->blocks, r->blocks, sizeof(int32_t) * (size_t)r->n_blocks);
        e->n_blocks = r->n_blocks;
        e->block_bytes = bb;
        for (int i = 0; e->host && i < r->n_blocks; i++)
          (void)td_copy_d2h(w->b, e->host + (size_t)i * bb, (uint8_t *)td_kv_pool_memory(pool) + (size_t)r->blocks[i] * bb,
                            bb);
        /* UCX reads the pool itself: the blocks must be complete before the main thread sees them */
        if (td_sync(w->b) != TD_OK) e->status = TD_ERR_CUDA;
      } else {
        e->status = td_err(TD_ERR_NOMEM, "out of memory");
      }
    }
    ev_push(w, e);
  }
  HASH_DEL(w->creqs, c);
  free(c);
}

static void done_error(td_worker *w, uint64_t rid, wrole r, td_status s, const char *msg) {
  wev *e = calloc(1, sizeof *e);
  if (!e) return;
  e->kind = EV_DONE;
  e->rid = rid;
  e->role = r;
  e->status = s;
  e->error = strdup(msg);
  ev_push(w, e);
}

static void compute_reserve(td_worker *w, cmd *c) {
  wev *e = calloc(1, sizeof *e);
  if (!e) return;
  e->kind = EV_RESERVED;
  e->rid = c->rid;
  e->role = c->role;
  e->cross_ids = calloc((size_t)c->n_cross + 1, sizeof(int32_t));
  e->self_ids = calloc((size_t)c->n_self + 1, sizeof(int32_t));
  td_status s = e->cross_ids && e->self_ids ? TD_OK : td_err(TD_ERR_NOMEM, "out of memory");
  /* the main thread expires reservations itself (it knows about transfers in flight) */
  if (s == TD_OK && c->n_cross)
    s = td_kv_reserve(td_engine_cross_pool(w->e), c->n_cross, INT64_MAX, &e->cross_res, e->cross_ids);
  if (s == TD_OK && c->n_self) {
    s = td_kv_reserve(td_engine_self_pool(w->e), c->n_self, INT64_MAX, &e->self_res, e->self_ids);
    if (s != TD_OK && c->n_cross) (void)td_kv_reservation_release(td_engine_cross_pool(w->e), e->cross_res);
  }
  if (s != TD_OK) {
    ev_free(e);
    done_error(w, c->rid, c->role, s, td_errmsg());
    return;
  }
  e->n_cross = c->n_cross;
  e->n_self = c->n_self;
  ev_push(w, e);
}

static void compute_add(td_worker *w, cmd *c) {
  int32_t cross[4096], self[4096];
  int nc = 0, ns = 0;
  td_status s = TD_OK;
  td_request r = c->req;
  if (c->cross_res) {
    s = td_kv_reservation_claim(td_engine_cross_pool(w->e), c->cross_res, cross, 4096, &nc);
    r.cross_blocks = cross;
    r.n_cross_blocks = nc;
  }
  if (s == TD_OK && c->self_res) {
    s = td_kv_reservation_claim(td_engine_self_pool(w->e), c->self_res, self, 4096, &ns);
    r.self_blocks = self;
    r.n_self_blocks = ns;
  }
  creq *cr = calloc(1, sizeof *cr);
  if (s == TD_OK && !cr) s = td_err(TD_ERR_NOMEM, "out of memory");
  if (s == TD_OK) {
    cr->rid = c->rid;
    cr->role = c->role;
    cr->t_start = td_now_ms();
    cr->host_copy = c->host_copy;
    r.user = cr;
    s = td_engine_add(w->e, &r, &cr->handle);
  }
  if (s != TD_OK) {
    /* the claimed blocks are ours to free */
    td_kv_unref_all(td_engine_cross_pool(w->e), cross, nc);
    td_kv_unref_all(td_engine_self_pool(w->e), self, ns);
    free(cr);
    done_error(w, c->rid, c->role, s, td_errmsg());
    return;
  }
  HASH_ADD(hh, w->creqs, rid, sizeof cr->rid, cr);
}

static void compute_cancel(td_worker *w, uint64_t rid) {
  creq *c = NULL;
  HASH_FIND(hh, w->creqs, &rid, sizeof rid, c);
  while (c) {
    uint64_t h = c->handle;
    (void)td_engine_cancel(w->e, h); /* on_finish frees c */
    c = NULL;
    HASH_FIND(hh, w->creqs, &rid, sizeof rid, c);
  }
}

/* Arrived whole-model blocks: this rank's part into its pool, the other
 * ranks' parts to them through the mirror (before any step that reads
 * them, since the mirror keeps order). A cross block's states tail is not
 * split by heads or layers: every rank takes all of it. */
static void compute_write_kv(td_worker *w, cmd *c) {
  td_kv_pool *pool = c->cross ? td_engine_cross_pool(w->e) : td_engine_self_pool(w->e);
  size_t bb = td_kv_pool_block_bytes(pool), es = td_buf_elem_size(w->b, TD_BUF_ACT);
  const td_kv_layout *fl = c->cross ? &w->full_cross : &w->full_self;
  size_t full_bb = c->cross ? w->full_cross_bb : w->full_self_bb;
  int L = fl->n_layers, H = fl->n_heads;
  int tp = w->o.tp > 1 ? w->o.tp : 1, pp = w->o.pp > 1 ? w->o.pp : 1;
  uint8_t *part = malloc(full_bb);
  uint8_t *msg = NULL;
  if (!part) return;
  for (int r = 0; r < w->world; r++) {
    int l0, l1, h0, h1;
    group_rank_range(r, tp, pp, L, H, &l0, &l1, &h0, &h1);
    td_kv_layout rl = {l1 - l0, h1 - h0, fl->head_dim, fl->block_size, fl->states};
    size_t rb = td_kv_block_elems(&rl) * es;
    if (r > 0) {
      free(msg);
      msg = malloc(1 + 1 + 4 + (size_t)c->n_blocks * (4 + rb));
      if (!msg) break;
      msg[0] = 'K';
      msg[1] = c->cross;
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
    if (r > 0) {
      char id[32];
      snprintf(id, sizeof id, "f-%d", r);
      zmq_send(w->msock, id, strlen(id), ZMQ_SNDMORE);
      zmq_send(w->msock, msg, 6 + (size_t)c->n_blocks * (4 + rb), 0);
    }
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
    case CMD_CANCEL: compute_cancel(w, c->rid); break;
    case CMD_RELEASE_BLOCKS: td_engine_release(w->e, c->cross, c->blocks, c->n_blocks); break;
    case CMD_WRITE_KV: compute_write_kv(w, c); break;
  }
}

static td_status compute_init(td_worker *w) {
  td_backend_opts bo = {.kind = w->o.device, .device = w->o.device_id, .threads = w->o.threads,
                        .cuda = w->o.settings.cuda};
  TD_TRY(td_backend_create(&bo, &w->b));
  td_model_opts mo = {.block_size = w->o.block_size, .max_seqs = w->o.max_batch, .max_tokens = w->o.max_tokens,
                      .max_enc_tokens = w->o.max_enc_tokens, .max_enc_seqs = 16,
                      .cross_mode = w->o.cross_mode, .states_rows = w->o.states_rows,
                      .tuning = w->o.settings.model};
  if (w->world > 1) {
    char comm_ep[256], mirror_ep[256];
    group_split_leader(w->gi.endpoints[0], comm_ep, sizeof comm_ep, mirror_ep, sizeof mirror_ep);
    if (w->o.device == TD_BACKEND_CPU) {
      const char *eps[16];
      for (int r = 0; r < w->world; r++) eps[r] = r ? w->gi.endpoints[r] : comm_ep;
      td_status s = td_comm_zmq_connect(w->boot, 0, w->world, eps, 30000, &w->comm);
      w->boot = NULL;
      TD_TRY(s);
    } else {
      TD_TRY(td_comm_create_nccl(w->b, w->nccl_id, 0, w->world, &w->comm));
    }
    td_backend_set_comm(w->b, w->comm);
    if (w->o.tp > 1) {
      mo.tp_size = w->o.tp;
    } else {
      mo.pp_size = w->o.pp;
    }
  }
  TD_TRY(td_model_load(w->o.model_dir, w->b, &mo, &w->m));
  if (w->world > 1) {
    /* every follower says hello on the mirror before the first call */
    int hellos = 0;
    int64_t end = td_now_ms() + 60000;
    while (hellos < w->world - 1 && td_now_ms() < end) {
      zmq_pollitem_t it = {.socket = w->msock, .events = ZMQ_POLLIN};
      zmq_poll(&it, 1, 100);
      hellos += mirror_tick(w);
    }
    if (hellos < w->world - 1)
      return td_err(TD_ERR_TIMEOUT, "group %s: %d of %d followers reached the mirror", w->o.group, hellos,
                    w->world - 1);
    td_model_mirror mir = {.publish = mirror_publish, .ctx = w};
    td_model_set_mirror(w->m, &mir);
  }
  td_engine_opts eo = {.self_blocks = w->o.self_blocks, .cross_blocks = w->o.cross_blocks,
                       .max_running = w->o.max_batch, .max_step_tokens = w->o.max_tokens};
  td_engine_callbacks cb = {.on_token = on_token, .on_finish = on_finish, .ctx = w};
  TD_TRY(td_engine_create(w->m, &eo, &cb, &w->e));
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
  w->load = (load_snap){0, 0, st.self.n_free, st.cross.n_free};
  w->max_running = w->o.max_batch;
  size_t es = td_buf_elem_size(w->b, TD_BUF_ACT);
  w->full_self = (td_kv_layout){w->cfg.dec_layers, w->cfg.dec_heads, w->cfg.dec_head_dim, w->block_size, 0};
  /* the whole decoder's K/V (none in STATES), the states tail as the model's */
  td_kv_layout mcl = td_model_cross_layout(w->m);
  w->full_cross = w->full_self;
  if (mcl.n_layers == 0) w->full_cross.n_layers = 0;
  w->full_cross.states = mcl.states;
  w->full_self_bb = td_kv_block_elems(&w->full_self) * es;
  w->full_cross_bb = td_kv_block_elems(&w->full_cross) * es;
  /* the pools stay this thread's; the main thread registers their memory with UCX */
  td_kv_pool *cp = td_engine_cross_pool(w->e), *sp = td_engine_self_pool(w->e);
  w->pools = (uxfer_opts){.cuda = w->o.device == TD_BACKEND_CUDA, .device = w->o.device_id,
                          .elem_size = (int)es, .cross_layout = td_model_cross_layout(w->m),
                          .self_layout = td_model_self_layout(w->m), .cross_base = td_kv_pool_memory(cp),
                          .self_base = td_kv_pool_memory(sp), .cross_blocks = st.cross.n_blocks,
                          .self_blocks = st.self.n_blocks, .cross_block_bytes = td_kv_pool_block_bytes(cp),
                          .self_block_bytes = td_kv_pool_block_bytes(sp)};
  return TD_OK;
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
  for (;;) {
    pthread_mutex_lock(&w->mu);
    while (!w->cmd_head && !w->stop_compute && td_engine_idle(w->e)) {
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_nsec += 50 * 1000000L;
      if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
      pthread_cond_timedwait(&w->cv, &w->mu, &ts);
    }
    cmd *list = w->cmd_head;
    w->cmd_head = w->cmd_tail = NULL;
    bool stop = w->stop_compute;
    pthread_mutex_unlock(&w->mu);
    while (list) {
      cmd *next = list->next;
      compute_handle(w, list);
      cmd_free(list);
      list = next;
    }
    if (stop) {
      if (w->world > 1) mirror_all(w, "S");
      break;
    }
    if (w->world > 1) mirror_tick(w);
    if (!td_engine_idle(w->e) && td_engine_step(w->e) != TD_OK) TD_ERROR("engine step failed: %s", td_errmsg());
    td_engine_stats st = td_engine_get_stats(w->e);
    pthread_mutex_lock(&w->mu);
    w->load = (load_snap){st.waiting, st.running, st.self.n_free, st.cross.n_free};
    pthread_mutex_unlock(&w->mu);
  }
  return NULL;
}

/* ------------------------------------------------------------ helpers for roles */

static uint64_t job_key(uint64_t rid, wrole r) { return rid * 4 + (uint64_t)r; }

job *w_job_find(td_worker *w, uint64_t rid, wrole r) {
  uint64_t k = job_key(rid, r);
  job *j = NULL;
  HASH_FIND(hh, w->jobs, &k, sizeof k, j);
  return j;
}

job *w_job_new(td_worker *w, uint64_t rid, wrole r, Tandem__Cluster__RouterMessage *msg,
               Tandem__Cluster__RequestSpec *spec) {
  job *j = calloc(1, sizeof *j);
  if (!j) return NULL;
  j->key = job_key(rid, r);
  j->rid = rid;
  j->role = r;
  j->msg = msg;
  j->spec = spec;
  j->t_start = td_now_ms();
  HASH_ADD(hh, w->jobs, key, sizeof j->key, j);
  return j;
}

void w_job_drop(td_worker *w, job *j) {
  HASH_DEL(w->jobs, j);
  if (j->msg) tandem__cluster__router_message__free_unpacked(j->msg, NULL);
  free(j->cross_ids);
  free(j->self_ids);
  free(j->out_blocks);
  free(j->out_host);
  free(j);
}

void w_send(td_worker *w, Tandem__Cluster__WorkerMessage *m) {
  m->version = TD_PROTOCOL_VERSION;
  if (td_wire_send(w->rsock, NULL, 0, &m->base) != TD_OK) TD_WARN("send to router: %s", td_errmsg());
}

void w_send_failed(td_worker *w, uint64_t rid, td_status code, const char *msg, bool retryable) {
  Tandem__Cluster__Failed f = TANDEM__CLUSTER__FAILED__INIT;
  f.rid = rid;
  f.code = td_wire_error_code(code);
  f.message = (char *)msg;
  f.retryable = retryable;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED;
  m.failed = &f;
  w_send(w, &m);
}

void w_send_reserved(td_worker *w, job *j) {
  Tandem__Cluster__KvTarget cross = TANDEM__CLUSTER__KV_TARGET__INIT, self = TANDEM__CLUSTER__KV_TARGET__INIT;
  cross.worker_id = self.worker_id = w->id;
  cross.desc.data = self.desc.data = w->desc;
  cross.desc.len = self.desc.len = w->desc_len;
  cross.reservation = j->cross_res;
  cross.blocks = j->cross_ids;
  cross.n_blocks = (size_t)j->n_cross;
  cross.tokens = j->spec->enc_len;
  self.reservation = j->self_res;
  self.blocks = j->self_ids;
  self.n_blocks = (size_t)j->n_self;
  self.tokens = (uint32_t)j->self_expected;
  Tandem__Cluster__Reserved r = TANDEM__CLUSTER__RESERVED__INIT;
  r.rid = j->rid;
  r.cross = &cross;
  if (j->n_self) r.self = &self;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED;
  m.reserved = &r;
  w_send(w, &m);
}

void w_release_out_blocks(td_worker *w, job *j) {
  if (!j->out_blocks) return;
  cmd *c = w_cmd(CMD_RELEASE_BLOCKS, j->rid, j->role);
  if (!c) return;
  c->cross = j->out_cross;
  c->blocks = j->out_blocks;
  c->n_blocks = j->n_out;
  j->out_blocks = NULL;
  w_post(w, c);
}

xfer *w_xfer(td_worker *w) { return w->x; }
uxfer *w_uxfer(td_worker *w) { return w->ux; }
int w_ttl_ms(td_worker *w) { return w->o.reservation_ttl_ms; }
bool w_draining(td_worker *w) { return w->draining; }
const td_worker_opts *w_opts(td_worker *w) { return &w->o; }
int w_block_size(td_worker *w) { return w->block_size; }

static int32_t *dup_i32(const int32_t *v, size_t n) {
  int32_t *p = malloc(sizeof *p * (n + 1));
  if (p && n) memcpy(p, v, sizeof *p * n);
  return p;
}

cmd *w_add_cmd(td_worker *w, job *j) {
  const Tandem__Cluster__RequestSpec *sp = j->spec;
  cmd *c = w_cmd(CMD_ADD, j->rid, j->role);
  if (!c) return NULL;
  td_request *r = &c->req;
  snprintf(c->id, sizeof c->id, "%s", sp->client_id ? sp->client_id : "");
  r->id = c->id;
  c->owned_i32[0] = dup_i32(sp->input_ids, sp->n_input_ids);
  c->owned_i32[1] = dup_i32(sp->decoder_prompt, sp->n_decoder_prompt);
  c->owned_i32[2] = dup_i32(sp->stop_token_ids, sp->n_stop_token_ids);
  if (!c->owned_i32[0] || !c->owned_i32[1] || !c->owned_i32[2]) {
    cmd_free(c);
    return NULL;
  }
  r->input_ids = sp->n_input_ids ? c->owned_i32[0] : NULL;
  r->n_input = (int)sp->n_input_ids;
  if (sp->features && sp->features->n_values) {
    c->owned_f32 = malloc(sizeof(float) * sp->features->n_values);
    if (!c->owned_f32) {
      cmd_free(c);
      return NULL;
    }
    memcpy(c->owned_f32, sp->features->values, sizeof(float) * sp->features->n_values);
    r->features = c->owned_f32;
    if (sp->features->n_values != (size_t)w->cfg.num_mel_bins * (size_t)w->frames) {
      cmd_free(c);
      return NULL;
    }
  }
  r->prompt = sp->n_decoder_prompt ? c->owned_i32[1] : NULL;
  r->n_prompt = (int)sp->n_decoder_prompt;
  td_request_params *p = &r->params;
  td_request_params_default(p);
  p->max_new_tokens = (int)sp->max_new_tokens;
  p->stop_ids = c->owned_i32[2];
  p->n_stop_ids = (int)sp->n_stop_token_ids;
  const Tandem__SamplingParams *s = sp->sampling;
  if (s) {
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
  }
  r->step_offset = sp->step_offset;
  r->enc_len = (int)sp->enc_len;
  return c;
}

/* ------------------------------------------------------------ router messages */

static void send_register(td_worker *w) {
  Tandem__ModelInfo mi = TANDEM__MODEL_INFO__INIT;
  mi.name = "";
  mi.model_type = w->cfg.model_type;
  mi.vocab_size = (uint32_t)w->cfg.vocab_size;
  mi.max_source_len = (uint32_t)w->max_src;
  mi.max_target_len = (uint32_t)w->max_tgt;
  mi.mel_bins = w->frames ? (uint32_t)w->cfg.num_mel_bins : 0;
  mi.frames = (uint32_t)w->frames;
  Tandem__TokenId start = TANDEM__TOKEN_ID__INIT;
  start.id = w->start_token;
  mi.decoder_start = &start;
  Tandem__Cluster__Role roles[3];
  size_t nr = 0;
  if (w->o.encode) roles[nr++] = TANDEM__CLUSTER__ROLE__ROLE_ENCODE;
  if (w->o.prefill) roles[nr++] = TANDEM__CLUSTER__ROLE__ROLE_PREFILL;
  if (w->o.decode) roles[nr++] = TANDEM__CLUSTER__ROLE__ROLE_DECODE;
  Tandem__Cluster__WorkerInfo in = TANDEM__CLUSTER__WORKER_INFO__INIT;
  in.worker_id = w->id;
  in.roles = roles;
  in.n_roles = nr;
  in.model = &mi;
  in.tp = (uint32_t)(w->o.tp > 1 ? w->o.tp : 1);
  in.pp = (uint32_t)(w->o.pp > 1 ? w->o.pp : 1);
  in.group = (char *)(w->o.group ? w->o.group : "");
  in.block_size = (uint32_t)w->block_size;
  in.self_blocks = (uint32_t)w->self_blocks;
  in.cross_blocks = (uint32_t)w->cross_blocks;
  in.max_running = (uint32_t)w->max_running;
  in.transfer_desc.data = w->desc;
  in.transfer_desc.len = w->desc_len;
  in.device = (char *)td_backend_name(w->b);
  in.pid = (uint32_t)getpid();
  in.cross_mode = (char *)td_cross_mode_name(w->o.cross_mode);
  Tandem__Cluster__Register reg = TANDEM__CLUSTER__REGISTER__INIT;
  reg.info = &in;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_REGISTER;
  m.register_ = &reg;
  w_send(w, &m);
  w->last_register = td_now_ms();
}

static void send_heartbeat(td_worker *w) {
  pthread_mutex_lock(&w->mu);
  load_snap l = w->load;
  pthread_mutex_unlock(&w->mu);
  Tandem__Cluster__Load ld = TANDEM__CLUSTER__LOAD__INIT;
  ld.queued = (uint32_t)l.queued;
  ld.running = (uint32_t)l.running;
  ld.free_self_blocks = (uint32_t)l.free_self;
  ld.free_cross_blocks = (uint32_t)l.free_cross;
  ld.draining = w->draining;
  ld.kv_in_ucx = w->kv_in_ucx;
  ld.kv_in_zmq = w->kv_in_zmq;
  ld.kv_out_ucx = w->kv_out_ucx;
  ld.kv_out_zmq = w->kv_out_zmq;
  ld.kv_pushing = (uint32_t)(xfer_pending(w->x) + (w->ux ? uxfer_pushing(w->ux) : 0));
  Tandem__Cluster__Heartbeat hb = TANDEM__CLUSTER__HEARTBEAT__INIT;
  hb.load = &ld;
  hb.seq = ++w->hb_seq;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_HEARTBEAT;
  m.heartbeat = &hb;
  w_send(w, &m);
  w->last_hb_sent = td_now_ms();
}

static bool res_busy(td_worker *w, uint64_t cross_res, uint64_t self_res) {
  return w->ux && (uxfer_busy(w->ux, cross_res) || uxfer_busy(w->ux, self_res));
}

static void post_release_res(td_worker *w, uint64_t rid, wrole r, uint64_t cross_res, uint64_t self_res) {
  cmd *c = w_cmd(CMD_RELEASE_RES, rid, r);
  if (c) {
    c->cross_res = cross_res;
    c->self_res = self_res;
    w_post(w, c);
  }
}

/* Gives reservations back, once no granted UCX transfer writes them. */
static void release_res(td_worker *w, uint64_t rid, wrole r, uint64_t cross_res, uint64_t self_res) {
  if (res_busy(w, cross_res, self_res)) {
    dres *d = calloc(1, sizeof *d);
    if (!d) return; /* lost rather than handed out while written */
    *d = (dres){rid, r, cross_res, self_res, w->deferred};
    w->deferred = d;
    return;
  }
  post_release_res(w, rid, r, cross_res, self_res);
}

static void release_deferred(td_worker *w) {
  for (dres **pp = &w->deferred; *pp;) {
    dres *d = *pp;
    if (res_busy(w, d->cross_res, d->self_res)) {
      pp = &d->next;
      continue;
    }
    *pp = d->next;
    post_release_res(w, d->rid, d->role, d->cross_res, d->self_res);
    free(d);
  }
}

/* Ends every part of rid on this worker. */
static void cancel_rid(td_worker *w, uint64_t rid) {
  xfer_forget(w->x, rid);
  for (int r = 0; r < 3; r++) {
    job *j = w_job_find(w, rid, (wrole)r);
    if (!j) continue;
    if (!j->added && (j->cross_res || j->self_res)) release_res(w, rid, (wrole)r, j->cross_res, j->self_res);
    /* blocks that UCX still reads go back when the cancelled transfers stopped */
    if (w->ux && uxfer_forget(w->ux, rid, r, j->out_cross, j->out_blocks, j->n_out)) j->out_blocks = NULL;
    w_release_out_blocks(w, j);
    w_job_drop(w, j);
  }
  w_post(w, w_cmd(CMD_CANCEL, rid, ROLE_DECODE));
}

static void cancel_all(td_worker *w, const char *why) {
  job *j, *t;
  uint64_t rids[1024];
  int n = 0;
  HASH_ITER(hh, w->jobs, j, t) if (n < 1024) rids[n++] = j->rid;
  for (int i = 0; i < n; i++) cancel_rid(w, rids[i]);
  if (n) TD_WARN("dropped %d requests: %s", n, why);
}

static bool on_router(td_worker *w, volatile sig_atomic_t *stop) {
  td_wire_frame f;
  td_status s = td_wire_recv(w->rsock, false, false, &f);
  if (s == TD_ERR_NOT_FOUND) return false;
  if (s != TD_OK) {
    td_wire_frame_free(&f);
    return true;
  }
  Tandem__Cluster__RouterMessage *m;
  uint32_t ver;
  s = td_wire_unpack_router(&f, &m, &ver);
  td_wire_frame_free(&f);
  if (s != TD_OK) {
    TD_ERROR("message from the router dropped: %s", td_errmsg());
    return true;
  }
  w->last_router_msg = td_now_ms();
  bool keep = false;
  switch (m->body_case) {
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ACK:
      if (m->ack->accepted) {
        if (!w->registered) TD_INFO("registered with the router");
        w->registered = true;
        if (m->ack->heartbeat_ms) w->hb_ms = (int)m->ack->heartbeat_ms;
        if (m->ack->dead_after) w->dead_after = (int)m->ack->dead_after;
      } else if (m->ack->reason && strstr(m->ack->reason, "unknown worker")) {
        w->registered = false;
        cancel_all(w, "the router does not know this worker");
        send_register(w);
      } else {
        /* nothing to drain or deregister: td_worker_run returns the reason */
        snprintf(w->refused, sizeof w->refused, "%s", m->ack->reason && m->ack->reason[0] ? m->ack->reason : "?");
        TD_ERROR("the router refused this worker: %s", w->refused);
        w->registered = false;
        cancel_all(w, "the router refused this worker");
      }
      break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_HEARTBEAT:
      break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE:
      decode_on_job(w, m);
      keep = true;
      break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL:
      prefill_on_job(w, m);
      keep = true;
      break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE:
      encoder_on_job(w, m);
      keep = true;
      break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL_RESULT:
      decode_on_prefill_result(w, m->prefill_result);
      break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL:
      cancel_rid(w, m->cancel->rid);
      break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DRAIN:
      *stop = SIGTERM;
      break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO:
      if (!m->group_info->ok && w->world > 1) {
        TD_ERROR("the group failed: %s", m->group_info->error ? m->group_info->error : "?");
        w->group_failed = true;
        if (w->comm) td_comm_abort(w->comm);
        cancel_all(w, "the worker group failed");
        *stop = SIGTERM;
      }
      break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_SHUTDOWN:
      TD_INFO("the router is shutting down");
      cancel_all(w, "router shutdown");
      w->registered = false;
      break;
    default:
      break;
  }
  if (!keep) tandem__cluster__router_message__free_unpacked(m, NULL);
  return true;
}

/* ------------------------------------------------------------ events */

static void flush_tokens(td_worker *w, uint64_t rid, int seq, int32_t *tok, float *lp, int n, int offset) {
  if (!n) return;
  Tandem__Cluster__Tokens t = TANDEM__CLUSTER__TOKENS__INIT;
  t.rid = rid;
  t.sequence = (uint32_t)seq;
  t.offset = (uint32_t)offset;
  t.tokens = tok;
  t.n_tokens = (size_t)n;
  t.logprobs = lp;
  t.n_logprobs = (size_t)n;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS;
  m.tokens = &t;
  w_send(w, &m);
}

/* Per (rid, seq): how many tokens were sent, for offsets. */
typedef struct tokcount {
  uint64_t key;
  int n;
  UT_hash_handle hh;
} tokcount;
static tokcount *tokcounts;

static int tok_offset(uint64_t rid, int seq, int add) {
  uint64_t k = rid * 64 + (uint64_t)(seq & 63);
  tokcount *t = NULL;
  HASH_FIND(hh, tokcounts, &k, sizeof k, t);
  if (!t) {
    t = calloc(1, sizeof *t);
    if (!t) return 0;
    t->key = k;
    HASH_ADD(hh, tokcounts, key, sizeof t->key, t);
  }
  int off = t->n;
  t->n += add;
  return off;
}

static void tok_forget(uint64_t rid) {
  tokcount *t, *tmp;
  HASH_ITER(hh, tokcounts, t, tmp) if (t->key / 64 == rid) {
    HASH_DEL(tokcounts, t);
    free(t);
  }
}

static void drain_events(td_worker *w) {
  uint64_t cnt;
  if (read(w->efd, &cnt, sizeof cnt) < 0 && errno != EAGAIN) TD_DEBUG("eventfd read: %s", strerror(errno));
  pthread_mutex_lock(&w->mu);
  wev *list = w->ev_head;
  w->ev_head = w->ev_tail = NULL;
  pthread_mutex_unlock(&w->mu);
  /* consecutive tokens of one sequence go out as one message */
  int32_t tok[256];
  float lp[256];
  int n = 0, seq = -1;
  uint64_t rid = 0;
  while (list) {
    wev *e = list;
    list = e->next;
    bool same = e->kind == EV_TOKEN && n && e->rid == rid && e->seq == seq && n < 256;
    if (n && !same) {
      flush_tokens(w, rid, seq, tok, lp, n, tok_offset(rid, seq, n));
      n = 0;
    }
    if (e->kind == EV_TOKEN) {
      if (w_job_find(w, e->rid, ROLE_DECODE)) {
        rid = e->rid;
        seq = e->seq;
        tok[n] = e->token;
        lp[n] = e->logprob;
        n++;
      }
      ev_free(e);
      continue;
    }
    job *j = w_job_find(w, e->rid, e->role);
    if (!j) {
      /* cancelled meanwhile: give back what the event carries */
      if (e->kind == EV_RESERVED && (e->cross_res || e->self_res)) {
        cmd *c = w_cmd(CMD_RELEASE_RES, e->rid, e->role);
        if (c) {
          c->cross_res = e->cross_res;
          c->self_res = e->self_res;
          w_post(w, c);
        }
      } else if (e->kind == EV_DONE && e->n_blocks) {
        cmd *c = w_cmd(CMD_RELEASE_BLOCKS, e->rid, e->role);
        if (c) {
          c->cross = e->role == ROLE_ENCODE;
          c->blocks = e->blocks;
          c->n_blocks = e->n_blocks;
          e->blocks = NULL;
          w_post(w, c);
        }
      }
      ev_free(e);
      continue;
    }
    if (e->kind == EV_RESERVED) {
      j->reserved = true;
      j->cross_res = e->cross_res;
      j->self_res = e->self_res;
      j->cross_ids = e->cross_ids;
      j->self_ids = e->self_ids;
      j->n_cross = e->n_cross;
      j->n_self = e->n_self;
      e->cross_ids = e->self_ids = NULL;
      j->expires = td_now_ms() + w->o.reservation_ttl_ms;
      w_send_reserved(w, j);
    } else if (e->role == ROLE_DECODE) {
      if (n) {
        flush_tokens(w, rid, seq, tok, lp, n, tok_offset(rid, seq, n));
        n = 0;
      }
      decode_on_done(w, j, e);
      tok_forget(e->rid);
    } else if (e->role == ROLE_ENCODE) {
      encoder_on_done(w, j, e);
    } else {
      prefill_on_done(w, j, e);
    }
    ev_free(e);
  }
  if (n) flush_tokens(w, rid, seq, tok, lp, n, tok_offset(rid, seq, n));
}

/* ------------------------------------------------------------ transfers */

/* Whether a sender may write these blocks of request rid's reservation
 * now: the same check for both transports, before any byte moves. */
static bool reservation_ok(td_worker *w, uint64_t rid, uint64_t res, bool cross, const int32_t *blocks, int n,
                           char *why, size_t cap) {
  job *j = w_job_find(w, rid, ROLE_DECODE);
  if (!j || (cross ? j->cross_res : j->self_res) != res) j = w_job_find(w, rid, ROLE_PREFILL);
  if (!j || !j->reserved || j->added || (cross ? j->cross_res : j->self_res) != res) {
    snprintf(why, cap, "reservation %llu of request %llu is not open here", (unsigned long long)res,
             (unsigned long long)rid);
    return false;
  }
  if (td_now_ms() > j->expires) {
    snprintf(why, cap, "reservation %llu expired", (unsigned long long)res);
    return false;
  }
  const int32_t *have = cross ? j->cross_ids : j->self_ids;
  int nh = cross ? j->n_cross : j->n_self;
  for (int i = 0; i < n; i++) {
    bool ok = false;
    for (int k = 0; k < nh && !ok; k++) ok = have[k] == blocks[i];
    if (!ok) {
      snprintf(why, cap, "block %d is not in reservation %llu", blocks[i], (unsigned long long)res);
      return false;
    }
  }
  return true;
}

static bool x_accept(void *ctx, uint64_t rid, uint64_t res, bool cross, const int32_t *blocks, int n,
                     size_t block_bytes, char *why, size_t cap) {
  td_worker *w = ctx;
  size_t want = cross ? w->full_cross_bb : w->full_self_bb;
  if (block_bytes != want) {
    snprintf(why, cap, "%s blocks of %zu bytes, this model's are %zu (another model, block size, device or "
             "--cross-mode?)", cross ? "cross" : "self", block_bytes, want);
    return false;
  }
  return reservation_ok(w, rid, res, cross, blocks, n, why, cap);
}

static void x_deliver(void *ctx, bool cross, const int32_t *blocks, int n, const void *const *data, size_t bb) {
  td_worker *w = ctx;
  cmd *c = w_cmd(CMD_WRITE_KV, 0, ROLE_DECODE);
  if (!c) return;
  c->cross = cross;
  c->blocks = malloc(sizeof(int32_t) * (size_t)n);
  c->data = malloc(bb * (size_t)n);
  if (!c->blocks || !c->data) {
    free(c->blocks);
    free(c->data);
    free(c);
    return;
  }
  memcpy(c->blocks, blocks, sizeof(int32_t) * (size_t)n);
  for (int i = 0; i < n; i++) memcpy(c->data + (size_t)i * bb, data[i], bb);
  c->n_blocks = n;
  w_post(w, c);
}

static void arrival(td_worker *w, uint64_t rid, uint64_t res, bool cross, int n) {
  job *j = w_job_find(w, rid, ROLE_DECODE);
  if (!j || (cross ? j->cross_res : j->self_res) != res) j = w_job_find(w, rid, ROLE_PREFILL);
  if (!j || (cross ? j->cross_res : j->self_res) != res) return; /* cancelled meanwhile */
  if (cross)
    j->cross_got += n;
  else
    j->self_got += n;
  if (j->role == ROLE_DECODE)
    decode_on_arrival(w, j);
  else
    prefill_on_arrival(w, j);
}

static void x_arrived(void *ctx, uint64_t rid, uint64_t res, bool cross, int n) {
  td_worker *w = ctx;
  w->kv_in_zmq += (uint64_t)n;
  arrival(w, rid, res, cross, n);
}

static void x_pushed(void *ctx, uint64_t rid, int r, bool ok, const char *error) {
  td_worker *w = ctx;
  job *j = w_job_find(w, rid, (wrole)r);
  if (!j) return;
  if (ok) w->kv_out_zmq += (uint64_t)j->n_out;
  sender_on_pushed(w, j, ok, error);
}

static bool u_accept(void *ctx, uint64_t rid, uint64_t res, bool cross, const int32_t *blocks, int n, char *why,
                     size_t cap) {
  return reservation_ok(ctx, rid, res, cross, blocks, n, why, cap);
}

/* The blocks are in the pool already: no CMD_WRITE_KV. */
static void u_arrived(void *ctx, uint64_t rid, uint64_t res, bool cross, int n) {
  td_worker *w = ctx;
  w->kv_in_ucx += (uint64_t)n;
  arrival(w, rid, res, cross, n);
}

static void u_pushed(void *ctx, uint64_t rid, int r, bool ok, const char *error, int n) {
  td_worker *w = ctx;
  if (ok) w->kv_out_ucx += (uint64_t)n;
  job *j = w_job_find(w, rid, (wrole)r);
  if (j) sender_on_pushed(w, j, ok, error);
}

static void u_release(void *ctx, bool cross, int32_t *blocks, int n) {
  td_worker *w = ctx;
  cmd *c = w_cmd(CMD_RELEASE_BLOCKS, 0, cross ? ROLE_ENCODE : ROLE_PREFILL);
  if (!c) {
    free(blocks);
    return;
  }
  c->cross = cross;
  c->blocks = blocks;
  c->n_blocks = n;
  w_post(w, c);
}

static void kv_log_path(td_worker *w, const char *peer, const kv_route *r) {
  kvlog *l = NULL;
  HASH_FIND_STR(w->kvlogs, peer, l);
  if (l && l->path == r->path) return;
  if (!l && strlen(peer) <= TD_WIRE_MAX_ID && (l = calloc(1, sizeof *l)) != NULL) {
    snprintf(l->id, sizeof l->id, "%s", peer);
    HASH_ADD_STR(w->kvlogs, id, l);
  }
  if (l) l->path = r->path;
  if (r->path == KV_UCX)
    TD_INFO("KV to %s: over UCX, straight into its pool", peer);
  else if (r->path == KV_ZMQ)
    TD_INFO("KV to %s: over ZeroMQ (%s)", peer, r->why);
  else
    TD_WARN("KV to %s: no way: %s", peer, r->why);
}

void kv_route_free(kv_route *r) {
  if (r->d) tandem__cluster__transfer_desc__free_unpacked(r->d, NULL);
  r->d = NULL;
}

void w_kv_route(td_worker *w, const Tandem__Cluster__KvTarget *t, bool cross, kv_route *r) {
  memset(r, 0, sizeof *r);
  r->path = KV_NONE;
  const char *peer = t->worker_id ? t->worker_id : "?";
  const uint8_t *b = t->desc.data;
  size_t len = t->desc.len;
  char why[400] = "";
  if (len > 4 && !memcmp(b, "zmq:", 4)) {
    /* a bare ZeroMQ endpoint (a worker from before TransferDesc) */
    if (len < sizeof r->zmq) memcpy(r->zmq, b, len);
    snprintf(why, sizeof why, "it offers ZeroMQ only");
  } else {
    r->d = tandem__cluster__transfer_desc__unpack(NULL, len, b);
    if (!r->d || r->d->version != TD_PROTOCOL_VERSION) {
      if (r->d)
        snprintf(r->why, sizeof r->why, "its KV descriptor has protocol version %u, this worker's %u", r->d->version,
                 TD_PROTOCOL_VERSION);
      else
        snprintf(r->why, sizeof r->why, "its KV descriptor is malformed");
      kv_route_free(r);
      kv_log_path(w, peer, r);
      return;
    }
    snprintf(r->zmq, sizeof r->zmq, "%s", r->d->zmq ? r->d->zmq : "");
    if (!strcmp(w->o.transfer, "zmq"))
      snprintf(why, sizeof why, "--kv-transport zmq here");
    else if (!w->ux)
      snprintf(why, sizeof why, "this worker has no UCX engine");
    else if (r->d->ranks > 1)
      snprintf(why, sizeof why, "it is a TP/PP group, whose leader re-slices the blocks");
    else if (!r->d->kvx.len)
      snprintf(why, sizeof why, "it offers no UCX (--kv-transport zmq there)");
    else if (uxfer_route(w->ux, peer, r->d->kvx.data, r->d->kvx.len, cross, why, sizeof why))
      r->path = KV_UCX;
  }
  if (r->path == KV_UCX) {
    r->kvx = r->d->kvx.data;
    r->kvx_len = r->d->kvx.len;
  } else if (!strcmp(w->o.transfer, "ucx")) {
    snprintf(r->why, sizeof r->why, "--kv-transport ucx, but %s", why);
  } else if (!r->zmq[0]) {
    snprintf(r->why, sizeof r->why, "no ZeroMQ endpoint, and %s", why);
  } else {
    r->path = KV_ZMQ;
    snprintf(r->why, sizeof r->why, "%s", why);
  }
  kv_log_path(w, peer, r);
}

bool w_kv_host_copy(td_worker *w, Tandem__Cluster__KvTarget *const *targets, size_t n, bool cross) {
  bool host = false;
  for (size_t i = 0; i < n && !host; i++) {
    kv_route r;
    w_kv_route(w, targets[i], cross, &r);
    host = r.path != KV_UCX;
    kv_route_free(&r);
  }
  return host;
}

static td_status build_desc(td_worker *w) {
  Tandem__Cluster__TransferDesc d = TANDEM__CLUSTER__TRANSFER_DESC__INIT;
  d.version = TD_PROTOCOL_VERSION;
  d.zmq = (char *)xfer_desc(w->x);
  if (w->ux) {
    size_t len;
    d.kvx.data = (uint8_t *)uxfer_desc(w->ux, &len);
    d.kvx.len = len;
  }
  d.ranks = (uint32_t)w->world;
  w->desc_len = tandem__cluster__transfer_desc__get_packed_size(&d);
  w->desc = malloc(w->desc_len + 1);
  if (!w->desc) return td_err(TD_ERR_NOMEM, "out of memory");
  tandem__cluster__transfer_desc__pack(&d, w->desc);
  return TD_OK;
}

/* ------------------------------------------------------------ timers */

static void timers(td_worker *w, volatile sig_atomic_t *stop) {
  int64_t t = td_now_ms();
  if (!w->registered && t - w->last_register > 1000) send_register(w);
  if (w->registered && t - w->last_hb_sent >= w->hb_ms) send_heartbeat(w);
  if (w->registered && t - w->last_router_msg > (int64_t)w->hb_ms * w->dead_after) {
    TD_WARN("no word from the router for %lld ms", (long long)(t - w->last_router_msg));
    w->registered = false;
    cancel_all(w, "the router is silent");
  }
  job *j, *tmp;
  HASH_ITER(hh, w->jobs, j, tmp) {
    /* a granted UCX transfer keeps writing until its recv event: wait for it */
    if (j->reserved && !j->added && t > j->expires && !res_busy(w, j->cross_res, j->self_res)) {
      TD_WARN("request %llu: KV did not arrive in time", (unsigned long long)j->rid);
      uint64_t rid = j->rid;
      cancel_rid(w, rid);
      w_send_failed(w, rid, TD_ERR_TIMEOUT, "KV blocks did not arrive before the reservation expired", true);
    }
  }
  if (*stop && !w->draining) {
    w->draining = true;
    w->drain_deadline = t + 30000;
    TD_INFO("draining: finishing %u requests", HASH_COUNT(w->jobs));
    send_heartbeat(w);
  }
}

/* ------------------------------------------------------------ lifecycle */

void td_worker_opts_default(td_worker_opts *o) {
  if (!o->block_size) o->block_size = 16;
  if (!o->max_batch) o->max_batch = 32;
  if (!o->max_tokens) o->max_tokens = 512;
  if (!o->max_enc_tokens) o->max_enc_tokens = 4096;
  if (!o->reservation_ttl_ms) o->reservation_ttl_ms = 30000;
  /* an encoder only stages cross KV: its self pool can be token-sized */
  if (!o->decode && !o->prefill && !o->self_blocks) o->self_blocks = 2 * o->max_batch;
  if (!o->transfer_timeout_ms) o->transfer_timeout_ms = 10000;
  if (!o->listen_host) o->listen_host = "127.0.0.1";
  if (!o->transfer) o->transfer = "auto";
}

td_status td_worker_create(const td_worker_opts *opts, td_worker **out) {
  *out = NULL;
  td_worker *w = calloc(1, sizeof *w);
  if (!w) return td_err(TD_ERR_NOMEM, "out of memory");
  w->o = *opts;
  td_worker_opts *o = &w->o;
  td_worker_opts_default(o);
  snprintf(w->id, sizeof w->id, "%s", o->id);
  bool ucx_only = !strcmp(o->transfer, "ucx"), zmq_only = !strcmp(o->transfer, "zmq");
  w->hb_ms = 500;
  w->dead_after = 6;
  w->efd = -1;
  w->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  pthread_mutex_init(&w->mu, NULL);
  pthread_cond_init(&w->cv, NULL);
  td_status s = TD_OK;
  if (!ucx_only && !zmq_only && strcmp(o->transfer, "auto")) {
    s = td_err(TD_ERR_INVALID, "KV transport %s: auto, ucx or zmq", o->transfer);
    goto fail;
  }
  if (w->efd < 0) {
    s = td_err(TD_ERR_IO, "eventfd: %s", strerror(errno));
    goto fail;
  }
  w->zctx = zmq_ctx_new();
  w->rsock = w->zctx ? zmq_socket(w->zctx, ZMQ_DEALER) : NULL;
  if (!w->rsock) {
    s = td_err(TD_ERR_NETWORK, "zmq: %s", zmq_strerror(zmq_errno()));
    goto fail;
  }
  td_wire_setup_socket(w->rsock);
  zmq_setsockopt(w->rsock, ZMQ_ROUTING_ID, w->id, strlen(w->id));
  if (zmq_connect(w->rsock, o->router) != 0) {
    s = td_err(TD_ERR_INVALID, "cannot connect to the router at %s: %s", o->router, zmq_strerror(zmq_errno()));
    goto fail;
  }
  w->world = o->tp > 1 ? o->tp : o->pp > 1 ? o->pp : 1;
  if (w->world > 1) {
    if (ucx_only) {
      s = td_err(TD_ERR_UNSUPPORTED, "--kv-transport ucx: a TP/PP group takes KV over ZeroMQ (its leader re-slices "
                 "whole-model blocks for the ranks)");
      goto fail;
    }
    if (o->encode || o->prefill) {
      s = td_err(TD_ERR_UNSUPPORTED, "worker groups run the decode role only (encoders and prefill workers are "
                 "single-rank; their KV is re-sliced for the group on arrival)");
      goto fail;
    }
    if (!o->group || o->rank != 0 || (o->tp > 1 && o->pp > 1)) {
      s = td_err(TD_ERR_INVALID, "a group leader needs --group, rank 0 and either --tp or --pp");
      goto fail;
    }
    char comm_ep[256] = "-", ep[600];
    if (o->device == TD_BACKEND_CPU) {
      if ((s = td_comm_zmq_bind(o->listen_host, &w->boot)) != TD_OK) goto fail;
      snprintf(comm_ep, sizeof comm_ep, "%s", td_comm_zmq_endpoint(w->boot));
    } else if ((s = td_comm_nccl_id(w->nccl_id)) != TD_OK) {
      goto fail;
    }
    w->msock = zmq_socket(w->zctx, ZMQ_ROUTER);
    char mep[300], bound[256];
    snprintf(mep, sizeof mep, "tcp://%s:*", o->listen_host);
    int linger = 0, hwm = 0;
    if (w->msock) {
      zmq_setsockopt(w->msock, ZMQ_LINGER, &linger, sizeof linger);
      zmq_setsockopt(w->msock, ZMQ_SNDHWM, &hwm, sizeof hwm);
    }
    size_t bl = sizeof bound;
    if (!w->msock || zmq_bind(w->msock, mep) != 0 || zmq_getsockopt(w->msock, ZMQ_LAST_ENDPOINT, bound, &bl) != 0) {
      s = td_err(TD_ERR_NETWORK, "cannot bind the group mirror on %s", mep);
      goto fail;
    }
    snprintf(ep, sizeof ep, "%s|%s", comm_ep, bound);
    TD_INFO("group %s: waiting for %d ranks", o->group, w->world);
    s = group_rendezvous(w->rsock, o->group, 0, w->world, ep, o->device == TD_BACKEND_CPU ? NULL : w->nccl_id,
                         o->device == TD_BACKEND_CPU ? 0 : TD_NCCL_ID_BYTES, o->cross_mode, 120000, NULL, &w->gi);
    if (s != TD_OK) goto fail;
  }
  if (pthread_create(&w->thread, NULL, compute_main, w) != 0) {
    s = td_err(TD_ERR_INTERNAL, "cannot start the compute thread");
    goto fail;
  }
  w->thread_started = true;
  pthread_mutex_lock(&w->mu);
  while (!w->ready) pthread_cond_wait(&w->cv, &w->mu);
  pthread_mutex_unlock(&w->mu);
  if (w->init_status != TD_OK) {
    s = td_err(w->init_status, "%s", w->init_error);
    goto fail;
  }
  xfer_hooks hooks = {.accept = x_accept, .deliver = x_deliver, .arrived = x_arrived, .pushed = x_pushed, .ctx = w};
  s = xfer_create(o->listen_host, &hooks, o->transfer_timeout_ms, &w->x);
  if (s != TD_OK) goto fail;
  /* A group's ranks hold slices: blocks for it go through the leader's
   * re-slicing (ZeroMQ), so only single-rank workers register pools. */
  if (!zmq_only && w->world == 1) {
    uxfer_opts uo = w->pools;
    uo.name = w->id;
    uo.timeout_ms = o->transfer_timeout_ms;
    uo.kvx = o->settings.kvx;
    uxfer_hooks uh = {.accept = u_accept, .arrived = u_arrived, .pushed = u_pushed, .release = u_release, .ctx = w};
    s = uxfer_create(&uo, &uh, &w->ux);
    if (s != TD_OK && ucx_only) goto fail;
    if (s != TD_OK) TD_WARN("KV over ZeroMQ only: UCX did not start: %s", td_errmsg());
  }
  if ((s = build_desc(w)) != TD_OK) goto fail;
  *out = w;
  return TD_OK;
fail:
  td_worker_destroy(w);
  return s;
}

td_status td_worker_run(td_worker *w, volatile sig_atomic_t *stop) {
  TD_INFO("worker %s (%s%s%s) on %s, KV endpoint %s%s", w->id, w->o.encode ? "encode " : "",
          w->o.prefill ? "prefill " : "", w->o.decode ? "decode" : "", td_backend_name(w->b), xfer_desc(w->x),
          w->ux ? " and UCX" : "");
  send_register(w);
  w->last_router_msg = td_now_ms();
  for (;;) {
    zmq_pollitem_t items[16];
    items[0] = (zmq_pollitem_t){.socket = w->rsock, .events = ZMQ_POLLIN};
    items[1] = (zmq_pollitem_t){.fd = w->efd, .events = ZMQ_POLLIN};
    int n = 2 + xfer_poll_items(w->x, items + 2, 13);
    int timeout = 20;
    if (w->ux) {
      items[n++] = (zmq_pollitem_t){.fd = uxfer_fd(w->ux), .events = ZMQ_POLLIN};
      /* last before sleeping; work that signals no descriptor (GPU copies) means no sleep */
      if (!uxfer_arm(w->ux)) timeout = 0;
    }
    int rc = zmq_poll(items, n, timeout);
    if (rc < 0 && zmq_errno() != EINTR) return td_err(TD_ERR_NETWORK, "zmq poll: %s", zmq_strerror(zmq_errno()));
    for (int k = 0; k < 1024 && on_router(w, stop); k++) {
    }
    drain_events(w);
    xfer_progress(w->x);
    if (w->ux) {
      uxfer_progress(w->ux);
      release_deferred(w);
    }
    if (w->refused[0]) break;
    timers(w, stop);
    if (w->draining && (HASH_COUNT(w->jobs) == 0 || td_now_ms() > w->drain_deadline)) break;
  }
  if (w->refused[0]) return td_err(TD_ERR_INVALID, "the router refused this worker: %s", w->refused);
  if (HASH_COUNT(w->jobs)) cancel_all(w, "drain deadline passed");
  Tandem__Cluster__Deregister d = TANDEM__CLUSTER__DEREGISTER__INIT;
  d.reason = "drained";
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_DEREGISTER;
  m.deregister = &d;
  w_send(w, &m);
  TD_INFO("worker %s stopped", w->id);
  return w->group_failed ? td_err(TD_ERR_PEER, "the worker group failed") : TD_OK;
}

void td_worker_destroy(td_worker *w) {
  if (!w) return;
  /* UCX first: it stops what still moves while the pools it registered
   * exist (the engine frees them below); its callbacks touch no job now */
  uxfer_destroy(w->ux);
  w->ux = NULL;
  while (w->deferred) {
    dres *d = w->deferred;
    w->deferred = d->next;
    free(d);
  }
  kvlog *kl, *klt;
  HASH_ITER(hh, w->kvlogs, kl, klt) {
    HASH_DEL(w->kvlogs, kl);
    free(kl);
  }
  free(w->desc);
  if (w->thread_started) {
    pthread_mutex_lock(&w->mu);
    w->stop_compute = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
  }
  /* the engine reports what it still runs as events; free those after */
  td_engine_destroy(w->e);
  w->e = NULL;
  job *j, *t;
  HASH_ITER(hh, w->jobs, j, t) w_job_drop(w, j);
  while (w->cmd_head) {
    cmd *c = w->cmd_head;
    w->cmd_head = c->next;
    cmd_free(c);
  }
  while (w->ev_head) {
    wev *e = w->ev_head;
    w->ev_head = e->next;
    ev_free(e);
  }
  tokcount *tc, *tt;
  HASH_ITER(hh, tokcounts, tc, tt) {
    HASH_DEL(tokcounts, tc);
    free(tc);
  }
  creq *c, *ct;
  HASH_ITER(hh, w->creqs, c, ct) {
    HASH_DEL(w->creqs, c);
    free(c);
  }
  xfer_destroy(w->x);
  if (w->msock) zmq_close(w->msock);
  w->msock = NULL;
  if (w->rsock) zmq_close(w->rsock);
  if (w->zctx) zmq_ctx_term(w->zctx);
  td_model_destroy(w->m);
  if (w->b) td_backend_set_comm(w->b, NULL);
  td_comm_destroy(w->comm);
  td_backend_destroy(w->b);
  td_comm_zmq_boot_free(w->boot);
  group_info_free(&w->gi);
  if (w->efd >= 0) close(w->efd);
  pthread_mutex_destroy(&w->mu);
  pthread_cond_destroy(&w->cv);
  free(w);
}
