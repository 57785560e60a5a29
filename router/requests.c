/* A request's lifecycle on the router's side: admission (every limit
 * checked, router/admit.c), the queue (bounded, first come first served),
 * placement (router/placement.c) and the jobs sent to the chosen workers,
 * the hold a request keeps on each of them, retries on other workers,
 * cancels, deadlines and stage timeouts. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "router/internal.h"

const char *const rtr_stage_names[] = {"queued", "reserving", "encoding", "prefilling", "decoding"};

/* ------------------------------------------------------------ holds */

/* A placed request holds a job on each of its workers, and the decode
 * worker's (cross and self) and the prefill worker's (cross) blocks. */
static void hold(worker *w, const rreq *q, rtr_role role, int sign) {
  w->pl.jobs += sign;
  if (role == RTR_ENCODE) w->pl.enc_pending += sign * q->sh.enc_len;
  if (role == RTR_DECODE) {
    w->pl.committed_cross += sign * q->sh.need_cross;
    w->pl.committed_self += sign * q->sh.need_self;
  } else if (role == RTR_PREFILL) {
    w->pl.committed_cross += sign * q->sh.need_cross;
  }
}

static char *role_worker(rreq *q, rtr_role role) {
  return role == RTR_DECODE ? q->dec_w : role == RTR_ENCODE ? q->enc_w : q->pre_w;
}

void rtr_local_encode_done(td_router *r, rreq *q) {
  if (!q->local_enc_held) return;
  q->local_enc_held = false;
  worker *w = q->dec_w[0] ? rtr_find_worker(r, q->dec_w) : NULL;
  if (w) w->pl.enc_pending -= q->sh.enc_len;
}

void rtr_mark_decoding(td_router *r, rreq *q) {
  worker *w = q->dec_w[0] ? rtr_find_worker(r, q->dec_w) : NULL;
  if (q->decoding_counted || !w) return;
  q->decoding_counted = true;
  w->pl.decoding++;
}

void rtr_role_done(td_router *r, rreq *q, rtr_role role) {
  if (role == RTR_DECODE) {
    rtr_local_encode_done(r, q);
    worker *d = q->decoding_counted && q->dec_w[0] ? rtr_find_worker(r, q->dec_w) : NULL;
    if (d) d->pl.decoding--;
    q->decoding_counted = false;
  }
  char *wid = role_worker(q, role);
  worker *w = wid[0] ? rtr_find_worker(r, wid) : NULL;
  if (w) hold(w, q, role, -1);
  wid[0] = 0;
}

static void send_cancel(td_router *r, const char *wid, uint64_t rid) {
  worker *w = wid[0] ? rtr_find_worker(r, wid) : NULL;
  if (!w) return;
  Tandem__Cluster__Cancel c = TANDEM__CLUSTER__CANCEL__INIT;
  c.rid = rid;
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL;
  m.cancel = &c;
  (void)rtr_send_worker(r, w, &m);
}

/* Drops the request's holds on its workers and, with `tell`, tells each of
 * them (once) to free whatever it keeps for the request. */
static void release_workers(td_router *r, rreq *q, bool tell) {
  const rtr_role roles[3] = {RTR_DECODE, RTR_ENCODE, RTR_PREFILL};
  for (int i = 0; i < 3; i++) {
    const char *wid = role_worker(q, roles[i]);
    bool told = false;
    for (int k = 0; k < i; k++) told |= !strcmp(wid, role_worker(q, roles[k]));
    if (tell && wid[0] && !told) send_cancel(r, wid, q->rid);
  }
  for (int i = 0; i < 3; i++) rtr_role_done(r, q, roles[i]);
  if (q->dres) tandem__cluster__reserved__free_unpacked(q->dres, NULL);
  if (q->pres) tandem__cluster__reserved__free_unpacked(q->pres, NULL);
  q->dres = q->pres = NULL;
  q->encoded = q->prefilled = false;
}

/* ------------------------------------------------------------ endings */

void rtr_req_free(td_router *r, rreq *q) {
  if (q->st != ST_QUEUED) r->in_flight--;
  r->held_bytes -= (long long)q->held;
  release_workers(r, q, false);
  td_ptrvec_remove(&r->queue, q);
  HASH_DELETE(hh, r->by_rid, q);
  HASH_DELETE(hc, r->by_ckey, q);
  rtr_detect_undo(q);
  rtr_client_msg_free(q->msg, &q->feat);
  free(q->cid);
  free(q->ckey);
  td_i32vec_free(&q->streamed);
  td_f32vec_free(&q->streamed_lp);
  rtr_stream_text_reset(q);
  free(q);
}

void rtr_req_fail(td_router *r, rreq *q, Tandem__ErrorCode code, const char *msg) {
  TD_LOG_ABOUT(q->cid, TD_INFO, "request %s (rid %llu) failed in stage %s: %s", q->cid, (unsigned long long)q->rid,
               rtr_stage_names[q->st], msg);
  release_workers(r, q, true);
  rtr_metrics_failure(r, code);
  rtr_client_error(r, q->client, q->client_len, q->cid, code, msg);
  rtr_req_free(r, q);
}

/* The finish of a single sequence whose every token reached the router:
 * its length reached, or a stop token it asked for or the model's EOS
 * (unless it ignores EOS) last; else NONE. */
static Tandem__FinishReason streamed_to_the_end(const td_router *r, const rreq *q) {
  if (q->multi || !q->streamed.n) return TANDEM__FINISH_REASON__FINISH_NONE;
  int32_t last = q->streamed.v[q->streamed.n - 1];
  for (size_t i = 0; i < q->g->n_stop_token_ids; i++)
    if (q->g->stop_token_ids[i] == last) return TANDEM__FINISH_REASON__FINISH_STOP;
  bool ignore_eos = q->g->sampling && q->g->sampling->ignore_eos;
  for (int i = 0; i < r->n_model_eos && !ignore_eos; i++)
    if (r->model_eos[i] == last) return TANDEM__FINISH_REASON__FINISH_STOP;
  return q->streamed.n >= q->sh.max_new ? TANDEM__FINISH_REASON__FINISH_LENGTH : TANDEM__FINISH_REASON__FINISH_NONE;
}

void rtr_req_retry(td_router *r, rreq *q, const char *why) {
  release_workers(r, q, true);
  /* nothing is left to generate: another attempt would ask for 0 tokens,
   * which a worker reads as "the model's limit" */
  Tandem__SequenceOutput done = TANDEM__SEQUENCE_OUTPUT__INIT;
  done.finish_reason = streamed_to_the_end(r, q);
  if (done.finish_reason != TANDEM__FINISH_REASON__FINISH_NONE) {
    TD_LOG_ABOUT(q->cid, TD_INFO, "request %s (rid %llu): every token was streamed before %s; it ends with them",
                 q->cid, (unsigned long long)q->rid, why);
    Tandem__SequenceOutput *outs = &done;
    rtr_req_result(r, q, &outs, 1, 0, 0);
    return;
  }
  if (q->attempts - q->free_attempts >= r->o.max_attempts) {
    char msg[512];
    snprintf(msg, sizeof msg, "gave up after %d attempts: %s", q->attempts, why);
    rtr_req_fail(r, q, TANDEM__ERROR_CODE__ERROR_UNAVAILABLE, msg);
    return;
  }
  TD_LOG_ABOUT(q->cid, TD_WARN, "request %s (rid %llu): retrying: %s (%s)", q->cid, (unsigned long long)q->rid, why,
               q->multi ? "from the start" : q->streamed.n ? "after the tokens streamed" : "nothing streamed yet");
  if (q->multi) { /* samples and beams restart from the prompt */
    q->streamed.n = q->streamed_lp.n = 0;
    rtr_stream_text_reset(q);
  }
  rtr_metrics_retry(r);
  rtr_req_requeue(r, q, false);
}

bool rtr_req_kv_loading(const rreq *q) { return q->st == ST_ENCODING || q->st == ST_PREFILLING; }

void rtr_req_kv_failed(td_router *r, rreq *q, const char *why) {
  if (r->o.kv_load_failure != TD_KV_LOAD_FAIL) {
    rtr_req_retry(r, q, why);
    return;
  }
  char msg[512];
  snprintf(msg, sizeof msg, "KV load failed: %s (--kv-load-failure fail)", why);
  rtr_req_fail(r, q, TANDEM__ERROR_CODE__ERROR_UNAVAILABLE, msg);
}

void rtr_req_requeue(td_router *r, rreq *q, bool release) {
  if (release) release_workers(r, q, false);
  HASH_DELETE(hh, r->by_rid, q);
  q->rid = (q->serial << 8) | (uint64_t)(q->attempts & 0xff); /* attempts <= TD_ROUTER_MAX_ATTEMPTS */
  HASH_ADD(hh, r->by_rid, rid, sizeof q->rid, q);
  if (q->st != ST_QUEUED) r->in_flight--;
  q->st = ST_QUEUED;
  q->t_queued = td_now_ms();
  if (td_ptrvec_insert(&r->queue, 0, q) != TD_OK)
    rtr_req_fail(r, q, TANDEM__ERROR_CODE__ERROR_INTERNAL, "out of memory");
}

rreq *rtr_req_for(td_router *r, uint64_t rid, const worker *w) {
  rreq *q = NULL;
  HASH_FIND(hh, r->by_rid, &rid, sizeof rid, q);
  if (!q) send_cancel(r, w->id, rid); /* a stale attempt: make sure the worker lets go of it */
  td_log_set_request(q ? q->cid : NULL); /* the lines this message makes name it (the loop clears it) */
  return q;
}

/* ------------------------------------------------------------ jobs */

/* The spec of a job for this attempt: a resumed single sequence continues
 * from its prompt (the model's decoder start token when it gave none) plus
 * the tokens already streamed. Audio features go only to the worker that
 * encodes them (`encodes`): a Whisper request's 1.5 MB would otherwise
 * travel to its decode and prefill workers too, which get the cross KV.
 * Features the client sent in a frame of their own go on in it: *frame is
 * that frame for the job's send (NULL: none), sp's AudioFeatures then hdr.
 * Returns the prompt buffer the spec points into (the caller frees it after
 * sending), NULL when out of memory. */
static int32_t *spec_of(const td_router *r, rreq *q, bool encodes, Tandem__Cluster__RequestSpec *sp,
                        Tandem__AudioFeatures *hdr, zmq_msg_t **frame) {
  const Tandem__GenerateRequest *g = q->g;
  int32_t *prompt = malloc(sizeof(int32_t) * (g->n_decoder_prompt + (size_t)q->streamed.n + 1));
  tandem__cluster__request_spec__init(sp);
  *frame = NULL;
  if (!prompt) return NULL;
  int np = 0;
  for (size_t i = 0; i < g->n_decoder_prompt; i++) prompt[np++] = g->decoder_prompt[i];
  if (!g->n_decoder_prompt && q->streamed.n) prompt[np++] = r->model_start_token;
  for (int i = 0; i < q->streamed.n; i++) prompt[np++] = q->streamed.v[i];
  sp->rid = q->rid;
  sp->input_ids = g->input_ids;
  sp->n_input_ids = g->n_input_ids;
  sp->features = encodes ? g->features : NULL;
  if (encodes && q->feat.has) { /* by reference: the 1.5 MB of a Whisper request are neither copied nor parsed */
    *hdr = *g->features;
    hdr->values = NULL;
    hdr->n_values = 0;
    hdr->values_in_frame = true;
    sp->features = hdr;
    *frame = &q->feat.m;
  }
  sp->decoder_prompt = prompt;
  sp->n_decoder_prompt = (size_t)np;
  sp->sampling = g->sampling;
  sp->max_new_tokens = (uint32_t)(q->sh.max_new - q->streamed.n);
  sp->stop_token_ids = g->stop_token_ids;
  sp->n_stop_token_ids = g->n_stop_token_ids;
  sp->enc_len = (uint32_t)q->sh.enc_len;
  sp->step_offset = (uint32_t)q->streamed.n;
  sp->client_id = q->cid;
  return prompt;
}

/* What placement needs of a request whose resumed attempt feeds `resumed`
 * streamed tokens after its prompt. */
static td_place_req place_req(const td_req_shape *sh, int resumed) {
  return (td_place_req){.need_cross = sh->need_cross, .need_self = sh->need_self, .width = sh->width,
                        .n_prompt = sh->n_prompt + resumed, .enc_len = sh->enc_len, .no_prefill = sh->probe};
}

static td_place_req attempt_req(const rreq *q) {
  td_place_req pr = place_req(&q->sh, q->multi ? 0 : q->streamed.n);
  pr.avoid_dec = q->avoid_dec[0] ? q->avoid_dec : NULL;
  return pr;
}

/* The sender a receiver admits into a reservation: worker w with token tok. */
static Tandem__Cluster__KvSender kv_sender(const worker *w, uint8_t *tok) {
  Tandem__Cluster__KvSender s = TANDEM__CLUSTER__KV_SENDER__INIT;
  s.worker_id = (char *)w->id;
  s.token = (ProtobufCBinaryData){TD_KV_TOKEN_BYTES, tok};
  s.key = (char *)w->key;
  return s;
}

/* A reservation's target as its pusher gets it: with the token the receiver expects. */
static Tandem__Cluster__KvTarget target_for_pusher(const Tandem__Cluster__KvTarget *t, uint8_t *tok) {
  Tandem__Cluster__KvTarget c = *t; /* shallow: only packed, never freed */
  c.token = (ProtobufCBinaryData){TD_KV_TOKEN_BYTES, tok};
  return c;
}

/* Starts a placed request: holds on its workers, the decode job. */
static void start(td_router *r, rreq *q, const td_placement *pl) {
  worker *d = (worker *)r->pool[pl->decode];
  worker *e = pl->encode >= 0 ? (worker *)r->pool[pl->encode] : NULL;
  worker *p = pl->prefill >= 0 ? (worker *)r->pool[pl->prefill] : NULL;
  /* a push of an earlier attempt, or of a worker not named, finds other tokens */
  if (td_auth_token_new(q->tok_cross) != TD_OK || td_auth_token_new(q->tok_pcross) != TD_OK ||
      td_auth_token_new(q->tok_self) != TD_OK) {
    rtr_req_fail(r, q, TANDEM__ERROR_CODE__ERROR_INTERNAL, td_errmsg());
    return;
  }
  Tandem__Cluster__RequestSpec sp;
  Tandem__AudioFeatures hdr;
  zmq_msg_t *frame;
  int32_t *prompt = spec_of(r, q, pl->local_encode, &sp, &hdr, &frame);
  if (!prompt) {
    rtr_req_fail(r, q, TANDEM__ERROR_CODE__ERROR_INTERNAL, "out of memory");
    return;
  }
  q->attempts++;
  q->local_encode = pl->local_encode;
  q->with_prefill = p != NULL;
  snprintf(q->dec_w, sizeof q->dec_w, "%s", d->id);
  snprintf(q->enc_w, sizeof q->enc_w, "%s", e ? e->id : "");
  snprintf(q->pre_w, sizeof q->pre_w, "%s", p ? p->id : "");
  hold(d, q, RTR_DECODE, 1);
  if (e) hold(e, q, RTR_ENCODE, 1);
  if (p) hold(p, q, RTR_PREFILL, 1);
  if (q->local_encode) { /* until its first token: the encoder run is behind it then */
    d->pl.enc_pending += q->sh.enc_len;
    q->local_enc_held = true;
  }
  q->st = q->local_encode ? ST_DECODING : ST_RESERVING;
  if (!q->t_placed_ns) q->t_placed_ns = td_now_ns();
  q->t_stage = td_now_ms();
  /* this attempt's stages (the first token stays the request's first) */
  q->t_reserved = q->t_encode_sent = q->t_encoded = 0;
  q->encode_ms = q->prefill_ms = 0;
  r->in_flight++;
  Tandem__Cluster__DecodeJob dj = TANDEM__CLUSTER__DECODE_JOB__INIT;
  dj.req = &sp;
  dj.local_encode = q->local_encode;
  dj.with_prefill = q->with_prefill;
  /* the prefill worker sends all prompt KV but the last token's, which the
   * decode worker runs itself to get the first logits */
  dj.prefill_tokens = q->with_prefill ? (uint32_t)(attempt_req(q).n_prompt - 1) : 0;
  Tandem__Cluster__KvSender cross_from, self_from;
  if (e) {
    cross_from = kv_sender(e, q->tok_cross);
    dj.cross_from = &cross_from;
  }
  if (p) {
    self_from = kv_sender(p, q->tok_self);
    dj.self_from = &self_from;
  }
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE;
  m.decode = &dj;
  td_status s = rtr_send_worker_extra(r, d, &m, frame);
  free(prompt);
  TD_LOG_ABOUT(q->cid, TD_DEBUG, "request %s (rid %llu) placed: decode %s, encode %s, prefill %s", q->cid,
               (unsigned long long)q->rid, d->id, e ? e->id : "local", p ? p->id : "-");
  if (s != TD_OK) rtr_req_retry(r, q, "could not reach the decode worker");
}

bool rtr_place_queue(td_loop *l, void *ctx) {
  (void)l;
  td_router *r = ctx;
  rtr_unpark(r);
  r->wait_why[0] = 0;
  r->wait_missing = false;
  while (r->queue.n > 0) {
    rreq *q = r->queue.v[0];
    td_place_req pr = attempt_req(q);
    td_placement pl;
    td_place_status st =
        td_place((const td_place_worker *const *)r->pool, r->n_pool, &pr, &r->place_opts, &pl);
    if (st == TD_PLACE_WAIT) {
      snprintf(r->wait_why, sizeof r->wait_why, "%s", pl.why);
      r->wait_missing = pl.missing;
      break;
    }
    td_ptrvec_remove(&r->queue, q);
    if (st == TD_PLACE_NEVER)
      rtr_req_fail(r, q, TANDEM__ERROR_CODE__ERROR_UNAVAILABLE, pl.why); /* rather than wait forever */
    else
      start(r, q, &pl); /* a retry puts it back at the head */
  }
  return true;
}

void rtr_send_encode(td_router *r, rreq *q) {
  worker *e = rtr_find_worker(r, q->enc_w);
  if (!e || !q->dres || !q->dres->cross || (q->with_prefill && (!q->pres || !q->pres->cross))) {
    rtr_req_kv_failed(r, q, "encoder or reservation lost");
    return;
  }
  Tandem__Cluster__RequestSpec sp;
  Tandem__AudioFeatures hdr;
  zmq_msg_t *frame;
  int32_t *prompt = spec_of(r, q, true, &sp, &hdr, &frame);
  if (!prompt) {
    rtr_req_fail(r, q, TANDEM__ERROR_CODE__ERROR_INTERNAL, "out of memory");
    return;
  }
  Tandem__Cluster__KvTarget to_dec = target_for_pusher(q->dres->cross, q->tok_cross), to_pre;
  if (q->with_prefill) to_pre = target_for_pusher(q->pres->cross, q->tok_pcross);
  Tandem__Cluster__KvTarget *targets[2] = {&to_dec, q->with_prefill ? &to_pre : NULL};
  Tandem__Cluster__EncodeJob ej = TANDEM__CLUSTER__ENCODE_JOB__INIT;
  ej.req = &sp;
  ej.targets = targets;
  ej.n_targets = q->with_prefill ? 2 : 1;
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE;
  m.encode = &ej;
  q->st = ST_ENCODING;
  q->t_stage = q->t_encode_sent = td_now_ms();
  td_status s = rtr_send_worker_extra(r, e, &m, frame);
  free(prompt);
  if (s != TD_OK) rtr_req_kv_failed(r, q, "could not reach the encoder");
}

void rtr_send_prefill(td_router *r, rreq *q) {
  worker *p = rtr_find_worker(r, q->pre_w), *e = rtr_find_worker(r, q->enc_w);
  if (!p || !e || !q->dres || !q->dres->self) {
    rtr_req_kv_failed(r, q, "prefill worker, encoder or reservation lost");
    return;
  }
  Tandem__Cluster__RequestSpec sp;
  Tandem__AudioFeatures hdr;
  zmq_msg_t *frame;
  int32_t *prompt = spec_of(r, q, false, &sp, &hdr, &frame);
  if (!prompt) {
    rtr_req_fail(r, q, TANDEM__ERROR_CODE__ERROR_INTERNAL, "out of memory");
    return;
  }
  Tandem__Cluster__KvTarget to_dec = target_for_pusher(q->dres->self, q->tok_self);
  Tandem__Cluster__KvSender cross_from = kv_sender(e, q->tok_pcross);
  Tandem__Cluster__PrefillJob pj = TANDEM__CLUSTER__PREFILL_JOB__INIT;
  pj.req = &sp;
  pj.cross_from = &cross_from;
  pj.self_target = &to_dec;
  pj.prefill_tokens = q->dres->self->tokens;
  pj.sample_first = false;
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL;
  m.prefill = &pj;
  td_status s = rtr_send_worker_extra(r, p, &m, frame);
  free(prompt);
  if (s != TD_OK) rtr_req_kv_failed(r, q, "could not reach the prefill worker");
}

/* ------------------------------------------------------------ clients */

void rtr_feat_adopt_msg(Tandem__GenerateRequest *g, rtr_feat_frame *dst, zmq_msg_t *src) {
  zmq_msg_init(&dst->m);
  zmq_msg_move(&dst->m, src); /* a frame's bytes may live inside the handle: the pointer is taken after the move */
  dst->has = true;
  Tandem__AudioFeatures *a = g->features;
  a->values = zmq_msg_data(&dst->m);
  a->n_values = zmq_msg_size(&dst->m) / sizeof(float);
}

void rtr_feat_adopt(Tandem__ClientMessage *msg, rtr_feat_frame *dst, zmq_msg_t *src) {
  rtr_feat_adopt_msg(msg->generate, dst, src);
}

void rtr_client_msg_free(Tandem__ClientMessage *msg, rtr_feat_frame *feat) {
  if (feat && feat->has) {
    if (msg && msg->generate && msg->generate->features) { /* the frame's, not protobuf-c's to free */
      msg->generate->features->values = NULL;
      msg->generate->features->n_values = 0;
    }
    zmq_msg_close(&feat->m);
    feat->has = false;
  }
  if (msg) tandem__client_message__free_unpacked(msg, NULL);
}

/* The key a client's request is found by: its identity (hex) and its id. */
static char *client_key(const uint8_t *cid, size_t cid_len, const char *id) {
  size_t klen = cid_len * 2 + strlen(id) + 2;
  char *key = malloc(klen);
  if (!key) return NULL;
  for (size_t i = 0; i < cid_len; i++) snprintf(key + 2 * i, 3, "%02x", cid[i]);
  snprintf(key + 2 * cid_len, klen - 2 * cid_len, "/%s", id);
  return key;
}

/* Every refusal of a new request, in order; the request is admitted when
 * code stays ERROR_NONE. */
static Tandem__ErrorCode admit(td_router *r, const char *key, Tandem__GenerateRequest *g, rtr_feat_frame *feat,
                               size_t bytes, td_req_shape *sh, bool *detect, char *err, size_t cap) {
  rreq *dup = NULL;
  HASH_FIND(hc, r->by_ckey, key, strlen(key), dup);
  if (dup) {
    snprintf(err, cap, "request_id \"%s\" is already in flight", g->request_id);
    return TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT;
  }
  if (!r->have_model) { /* park() refused it */
    snprintf(err, cap, "no worker has registered yet, and %d requests wait for one (--max-queue, --max-held-mb)",
             r->parked.n);
    return TANDEM__ERROR_CODE__ERROR_OVERLOADED;
  }
  if (r->queue.n + r->parked.n >= r->o.max_queue || r->in_flight >= r->o.max_in_flight) {
    snprintf(err, cap, "overloaded: %d requests queued, %d in flight", r->queue.n, r->in_flight);
    return TANDEM__ERROR_CODE__ERROR_OVERLOADED;
  }
  /* the messages held are the router's memory: bounded together, not only one by one */
  if (r->held_bytes + (long long)bytes > r->o.max_held_bytes) {
    snprintf(err, cap, "overloaded: the requests held take %lld bytes of client messages, this one %zu more, at "
             "most %lld (--max-held-mb)", r->held_bytes, bytes, r->o.max_held_bytes);
    return TANDEM__ERROR_CODE__ERROR_OVERLOADED;
  }
  td_admit_frontend fe = {.text = r->o.tokenizer != NULL, .audio = r->o.mel && r->o.whisper};
  td_status s = td_admit_inputs(&fe, g, err, cap);
  if (s != TD_OK) return td_wire_error_code(s);
  /* text and audio become ids / features here, once every cheaper refusal passed */
  Tandem__ErrorCode code = rtr_convert_input(r, g, feat, detect, err, cap);
  if (code != TANDEM__ERROR_CODE__ERROR_NONE) return code;
  s = td_admit_request(&r->model, r->block_size, g, sh, err, cap);
  if (s != TD_OK) return td_wire_error_code(s);
  td_place_req pr = place_req(sh, 0);
  if (!td_place_possible((const td_place_worker *const *)r->pool, r->n_pool, &pr, err, cap))
    return TANDEM__ERROR_CODE__ERROR_UNAVAILABLE;
  return TANDEM__ERROR_CODE__ERROR_NONE;
}

/* Holds a request until a worker tells the model; false when it cannot. */
static bool park(td_router *r, const uint8_t *cid, size_t cid_len, Tandem__ClientMessage *msg, size_t bytes,
                 zmq_msg_t *feat) {
  if (r->queue.n + r->parked.n >= r->o.max_queue || r->held_bytes + (long long)bytes > r->o.max_held_bytes)
    return false;
  rtr_parked *p = calloc(1, sizeof *p);
  if (!p || td_ptrvec_insert(&r->parked, r->parked.n, p) != TD_OK) {
    free(p);
    return false;
  }
  memcpy(p->client, cid, cid_len);
  p->client_len = cid_len;
  p->msg = msg;
  if (feat) rtr_feat_adopt(msg, &p->feat, feat);
  p->bytes = bytes;
  p->t = td_now_ms();
  r->held_bytes += (long long)bytes;
  return true;
}

void rtr_unpark(td_router *r) {
  if (!r->have_model || !r->parked.n) return;
  td_ptrvec parked = r->parked; /* admission may park nothing now: the model is known */
  r->parked = (td_ptrvec){0};
  for (int i = 0; i < parked.n; i++) {
    rtr_parked *p = parked.v[i];
    r->held_bytes -= (long long)p->bytes;
    td_log_set_request(p->msg->generate->request_id);
    rtr_on_generate(r, p->client, p->client_len, p->msg, p->bytes, p->feat.has ? &p->feat.m : NULL);
    td_log_set_request(NULL);
    free(p);
  }
  td_ptrvec_free(&parked);
}

static void parked_end(td_router *r, int i, const char *why) {
  rtr_parked *p = r->parked.v[i];
  const char *id = p->msg->generate->request_id ? p->msg->generate->request_id : "";
  rtr_metrics_failure(r, TANDEM__ERROR_CODE__ERROR_UNAVAILABLE);
  rtr_client_error(r, p->client, p->client_len, id, TANDEM__ERROR_CODE__ERROR_UNAVAILABLE, why);
  r->held_bytes -= (long long)p->bytes;
  td_ptrvec_remove(&r->parked, p);
  rtr_client_msg_free(p->msg, &p->feat);
  free(p);
}

void rtr_parked_fail(td_router *r, const char *why) {
  while (r->parked.n) parked_end(r, 0, why);
  td_ptrvec_free(&r->parked);
}

/* A parked request that waited --capacity-wait-ms (or its own deadline) for a worker ends. */
static void parked_tick(td_router *r, int64_t t) {
  for (int i = 0; i < r->parked.n;) {
    rtr_parked *p = r->parked.v[i];
    int64_t waited = t - p->t, limit = r->o.capacity_wait_ms;
    uint32_t own = p->msg->generate->timeout_ms;
    if (own && own < limit) limit = own;
    if (waited <= limit) {
      i++;
      continue;
    }
    char why[200];
    snprintf(why, sizeof why, "no decode worker is registered (waited %lld ms, --capacity-wait-ms %d)",
             (long long)waited, r->o.capacity_wait_ms);
    parked_end(r, i, why);
  }
}

/* A cancel of a parked request. */
static bool parked_cancel(td_router *r, const uint8_t *cid, size_t cid_len, const char *id) {
  for (int i = 0; i < r->parked.n; i++) {
    rtr_parked *p = r->parked.v[i];
    const char *pid = p->msg->generate->request_id ? p->msg->generate->request_id : "";
    if (p->client_len != cid_len || memcmp(p->client, cid, cid_len) || strcmp(pid, id)) continue;
    rtr_client_error(r, cid, cid_len, id, TANDEM__ERROR_CODE__ERROR_CANCELLED, "cancelled by the client");
    r->held_bytes -= (long long)p->bytes;
    td_ptrvec_remove(&r->parked, p);
    rtr_client_msg_free(p->msg, &p->feat);
    free(p);
    return true;
  }
  return false;
}

void rtr_on_generate(td_router *r, const uint8_t *cid, size_t cid_len, Tandem__ClientMessage *msg, size_t bytes,
                     zmq_msg_t *feat) {
  Tandem__GenerateRequest *g = msg->generate;
  /* a router that just started knows no model until a worker registers: the
   * request waits for one (its id is checked then) */
  if (!r->have_model && park(r, cid, cid_len, msg, bytes, feat)) return;
  rtr_feat_frame held = {.has = false};
  if (feat) rtr_feat_adopt(msg, &held, feat); /* admission reads the values where they are */
  const char *id = g->request_id ? g->request_id : "";
  char err[512];
  char *key = NULL;
  rreq *q = NULL;
  Tandem__ErrorCode code = TANDEM__ERROR_CODE__ERROR_NONE;
  td_req_shape sh = {0};
  bool detect = false;
  if (td_admit_request_id(id, err, sizeof err) != TD_OK) {
    code = TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT;
  } else if (!(key = client_key(cid, cid_len, id))) {
    code = TANDEM__ERROR_CODE__ERROR_INTERNAL;
    snprintf(err, sizeof err, "out of memory");
  } else {
    code = admit(r, key, g, &held, bytes, &sh, &detect, err, sizeof err);
  }
  if (code == TANDEM__ERROR_CODE__ERROR_NONE &&
      (!(q = calloc(1, sizeof *q)) || !(q->cid = strdup(id)) || td_ptrvec_insert(&r->queue, r->queue.n, q) != TD_OK)) {
    code = TANDEM__ERROR_CODE__ERROR_INTERNAL;
    snprintf(err, sizeof err, "out of memory");
  }
  if (code != TANDEM__ERROR_CODE__ERROR_NONE) {
    rtr_metrics_failure(r, code);
    rtr_client_error(r, cid, cid_len, strlen(id) <= TD_ROUTER_MAX_REQUEST_ID ? id : "", code, err);
    if (q) free(q->cid);
    free(q);
    free(key);
    rtr_client_msg_free(msg, &held);
    return;
  }
  q->sh = sh;
  q->multi = sh.width > 1;
  q->serial = r->next_serial++;
  q->rid = q->serial << 8;
  memcpy(q->client, cid, cid_len);
  q->client_len = cid_len;
  q->ckey = key;
  q->msg = msg;
  q->g = g;
  if (held.has) rtr_feat_adopt(msg, &q->feat, &held.m);
  q->t_arrival = q->t_queued = td_now_ms();
  q->held = bytes;
  r->held_bytes += (long long)bytes;
  q->deadline = q->t_arrival + (g->timeout_ms ? (int64_t)g->timeout_ms : r->o.default_timeout_ms);
  q->st = ST_QUEUED;
  HASH_ADD(hh, r->by_rid, rid, sizeof q->rid, q);
  HASH_ADD_KEYPTR(hc, r->by_ckey, q->ckey, strlen(q->ckey), q);
  if (detect && !rtr_detect_begin(r, q))
    rtr_req_fail(r, q, TANDEM__ERROR_CODE__ERROR_INTERNAL, "language detection could not start");
}

void rtr_on_cancel(td_router *r, const uint8_t *cid, size_t cid_len, const Tandem__CancelRequest *c) {
  const char *id = c->request_id ? c->request_id : "";
  char err[128];
  if (td_admit_request_id(id, err, sizeof err) != TD_OK) {
    rtr_client_error(r, cid, cid_len, strlen(id) <= TD_ROUTER_MAX_REQUEST_ID ? id : "",
                     TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, err);
    return;
  }
  char *key = client_key(cid, cid_len, id);
  if (!key) return;
  rreq *q = NULL;
  HASH_FIND(hc, r->by_ckey, key, strlen(key), q);
  free(key);
  if (q)
    rtr_req_fail(r, q, TANDEM__ERROR_CODE__ERROR_CANCELLED, "cancelled by the client");
  else if (!parked_cancel(r, cid, cid_len, id))
    rtr_client_error(r, cid, cid_len, id, TANDEM__ERROR_CODE__ERROR_NOT_FOUND, "no such request in flight");
}

/* ------------------------------------------------------------ timers */

int rtr_requests_tick(td_loop *l, void *ctx) {
  (void)l;
  td_router *r = ctx;
  int64_t t = td_now_ms();
  parked_tick(r, t);
  /* placed afresh first: a worker that registered this turn is not missing */
  if (r->wait_missing) (void)rtr_place_queue(l, r);
  rreq *q, *tmp;
  HASH_ITER(hh, r->by_rid, q, tmp) {
    if (t > q->deadline) {
      char why[320];
      if (q->st == ST_QUEUED && r->wait_why[0])
        snprintf(why, sizeof why, "deadline exceeded (queued: %s)", r->wait_why);
      else
        snprintf(why, sizeof why, "deadline exceeded");
      rtr_req_fail(r, q, TANDEM__ERROR_CODE__ERROR_TIMEOUT, why);
      continue;
    }
    /* busy workers are load, worth the wait; a role no live worker has is not */
    if (q->st == ST_QUEUED && r->wait_missing && t - q->t_queued > r->o.capacity_wait_ms) {
      char why[400];
      snprintf(why, sizeof why, "%s (waited %lld ms, --capacity-wait-ms %d)", r->wait_why,
               (long long)(t - q->t_queued), r->o.capacity_wait_ms);
      rtr_req_fail(r, q, TANDEM__ERROR_CODE__ERROR_UNAVAILABLE, why);
      continue;
    }
    if ((q->st == ST_RESERVING || q->st == ST_ENCODING || q->st == ST_PREFILLING) &&
        t - q->t_stage > r->o.stage_timeout_ms) {
      char why[128];
      snprintf(why, sizeof why, "stage %s took more than %d ms", rtr_stage_names[q->st], r->o.stage_timeout_ms);
      if (rtr_req_kv_loading(q))
        rtr_req_kv_failed(r, q, why);
      else
        rtr_req_retry(r, q, why);
    }
  }
  return TD_ROUTER_TICK_MS;
}
