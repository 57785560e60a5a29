#include "proto/check.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/defaults.h"
#include "common/request.h"
#include "proto/wire.h"

#define BAD(...)                      \
  do {                                \
    snprintf(why, cap, __VA_ARGS__);  \
    return false;                     \
  } while (0)

/* Each helper names the field it is given; false with why filled. */

static bool str_len(const char *field, const char *s, size_t lo, size_t hi, char *why, size_t cap) {
  size_t n = s ? strlen(s) : 0;
  if (n < lo || n > hi) BAD("%s has %zu bytes, %zu to %zu allowed", field, n, lo, hi);
  return true;
}

static bool u32_max(const char *field, uint32_t v, uint32_t hi, char *why, size_t cap) {
  if (v > hi) BAD("%s %u exceeds %u", field, v, hi);
  return true;
}

static bool count_max(const char *field, size_t n, size_t hi, char *why, size_t cap) {
  if (n > hi) BAD("%s holds %zu entries, at most %zu", field, n, hi);
  return true;
}

/* A token id: in [0, vocab), or >= 0 while the vocabulary is not known. */
static bool token_ok(const char *field, size_t i, int32_t t, int vocab, char *why, size_t cap) {
  if (t < 0 || (vocab > 0 && t >= vocab)) {
    if (vocab > 0) BAD("%s[%zu] %d is outside the vocabulary of %d", field, i, t, vocab);
    BAD("%s[%zu] %d is negative", field, i, t);
  }
  return true;
}

static bool tokens_ok(const char *field, const int32_t *v, size_t n, int vocab, char *why, size_t cap) {
  for (size_t i = 0; i < n; i++)
    if (!token_ok(field, i, v[i], vocab, why, cap)) return false;
  return true;
}

/* A time or a count in seconds / ms: finite and >= 0. */
static bool time_ok(const char *field, double x, char *why, size_t cap) {
  if (!isfinite(x) || x < 0) BAD("%s %g is not a finite time >= 0", field, x);
  return true;
}

/* A log-probability or a score: a number (-inf allowed: a token the model
 * gave no chance), never NaN or +inf. */
static bool logp_ok(const char *field, double x, char *why, size_t cap) {
  if (isnan(x) || x == INFINITY) BAD("%s is %g (the model produced NaN, or the value is forged)", field, x);
  return true;
}

/* Log-probabilities: none, or one a token. */
static bool logprobs_ok(const char *field, const float *lp, size_t n_lp, size_t n_tokens, char *why, size_t cap) {
  if (n_lp && n_lp != n_tokens) BAD("%s has %zu values for %zu tokens (none or one a token)", field, n_lp, n_tokens);
  char f[96];
  for (size_t i = 0; i < n_lp; i++) {
    snprintf(f, sizeof f, "%s[%zu]", field, i);
    if (!logp_ok(f, lp[i], why, cap)) return false;
  }
  return true;
}

/* ------------------------------------------------------------ registration */

bool td_check_model_info(const Tandem__ModelInfo *m, char *why, size_t cap) {
  if (!m) BAD("WorkerInfo.model is missing (the served model's description)");
  if (!str_len("ModelInfo.name", m->name, 0, TD_WIRE_MAX_NAME, why, cap) ||
      !str_len("ModelInfo.model_type", m->model_type, 0, TD_WIRE_MAX_NAME, why, cap))
    return false;
  if (m->vocab_size < 1 || m->vocab_size > TD_MODEL_MAX_VOCAB)
    BAD("ModelInfo.vocab_size %u is outside 1 to %d", m->vocab_size, TD_MODEL_MAX_VOCAB);
  if (m->max_source_len < 1 || m->max_source_len > TD_MODEL_MAX_POSITIONS)
    BAD("ModelInfo.max_source_len %u is outside 1 to %d", m->max_source_len, TD_MODEL_MAX_POSITIONS);
  /* a prompt of one token must leave room for one more */
  if (m->max_target_len < 2 || m->max_target_len > TD_MODEL_MAX_POSITIONS)
    BAD("ModelInfo.max_target_len %u is outside 2 to %d", m->max_target_len, TD_MODEL_MAX_POSITIONS);
  if (m->mel_bins > TD_MEL_MAX_MELS) BAD("ModelInfo.mel_bins %u exceeds %d", m->mel_bins, TD_MEL_MAX_MELS);
  if (m->mel_bins && (m->frames < 1 || m->frames > TD_MODEL_MAX_FRAMES))
    BAD("ModelInfo.frames %u is outside 1 to %d for a model of %u mel bins", m->frames, TD_MODEL_MAX_FRAMES,
        m->mel_bins);
  if (!m->mel_bins && m->frames) BAD("ModelInfo.frames %u without mel_bins", m->frames);
  /* a client must be able to send the features in one message */
  if ((uint64_t)m->mel_bins * m->frames * sizeof(float) > TD_CLIENT_MAX_MSG_BYTES)
    BAD("ModelInfo's features (%u x %u floats) exceed a client message (%u bytes)", m->mel_bins, m->frames,
        (unsigned)TD_CLIENT_MAX_MSG_BYTES);
  int V = (int)m->vocab_size;
  /* a resumed request's prompt starts with it */
  if (!m->decoder_start) BAD("ModelInfo.decoder_start is missing (the model's decoder start token)");
  if (!token_ok("ModelInfo.decoder_start", 0, m->decoder_start->id, V, why, cap)) return false;
  if (m->n_eos_token_ids > TD_ROUTER_MAX_EOS)
    BAD("ModelInfo.eos_token_ids holds %zu ids, at most %d", m->n_eos_token_ids, TD_ROUTER_MAX_EOS);
  return tokens_ok("ModelInfo.eos_token_ids", m->eos_token_ids, m->n_eos_token_ids, V, why, cap);
}

bool td_check_transfer_desc(const uint8_t *b, size_t len, char *why, size_t cap) {
  if (!len) BAD("the KV descriptor is empty");
  if (len > TD_TRANSFER_DESC_MAX_BYTES) BAD("the KV descriptor has %zu bytes, at most %u", len, TD_TRANSFER_DESC_MAX_BYTES);
  if (len > 4 && !memcmp(b, "zmq:", 4)) return true; /* a bare ZeroMQ endpoint (kvtransfer/transport_zmq.c parses it) */
  Tandem__Cluster__TransferDesc *d = tandem__cluster__transfer_desc__unpack(NULL, len, b);
  if (!d) BAD("the KV descriptor is not a TransferDesc");
  bool ok = false;
  if (d->version != TD_PROTOCOL_VERSION)
    snprintf(why, cap, "TransferDesc.version %u, this peer speaks %u", d->version, TD_PROTOCOL_VERSION);
  else if (!d->zmq || strncmp(d->zmq, "zmq:", 4) || strlen(d->zmq) > TD_WIRE_MAX_NAME)
    snprintf(why, cap, "TransferDesc.zmq is not a \"zmq:\" endpoint of at most %d bytes", TD_WIRE_MAX_NAME);
  else if (d->ranks > TD_GROUP_MAX_RANKS)
    snprintf(why, cap, "TransferDesc.ranks %u exceeds %d", d->ranks, TD_GROUP_MAX_RANKS);
  else
    ok = true;
  tandem__cluster__transfer_desc__free_unpacked(d, NULL);
  return ok;
}

static bool id_ok(const char *field, const char *id, char *why, size_t cap) {
  size_t n = id ? strlen(id) : 0;
  bool ok = n >= 1 && n <= TD_WIRE_MAX_ID;
  for (size_t i = 0; ok && i < n; i++) ok = id[i] > ' ' && id[i] <= '~';
  if (!ok) BAD("%s is not 1 to %d printable characters", field, TD_WIRE_MAX_ID);
  return true;
}

bool td_check_worker_info(const Tandem__Cluster__WorkerInfo *in, char *why, size_t cap) {
  if (!in) BAD("Register.info is missing");
  if (!id_ok("WorkerInfo.worker_id (the worker id)", in->worker_id, why, cap)) return false;
  if (!in->n_roles) BAD("WorkerInfo.roles is empty (no roles)");
  if (!count_max("WorkerInfo.roles", in->n_roles, TD_WORKER_MAX_ROLES, why, cap)) return false;
  for (size_t i = 0; i < in->n_roles; i++)
    if (in->roles[i] != TANDEM__CLUSTER__ROLE__ROLE_ENCODE && in->roles[i] != TANDEM__CLUSTER__ROLE__ROLE_PREFILL &&
        in->roles[i] != TANDEM__CLUSTER__ROLE__ROLE_DECODE)
      BAD("WorkerInfo.roles[%zu] %d is no role (encode 1, prefill 2, decode 3)", i, (int)in->roles[i]);
  if (!td_check_model_info(in->model, why, cap)) return false;
  uint32_t tp = in->tp ? in->tp : 1, pp = in->pp ? in->pp : 1;
  if (tp > TD_GROUP_MAX_RANKS || pp > TD_GROUP_MAX_RANKS || tp * pp > TD_GROUP_MAX_RANKS)
    BAD("WorkerInfo.tp %u x pp %u exceeds %d ranks", in->tp, in->pp, TD_GROUP_MAX_RANKS);
  if (in->block_size < 1 || in->block_size > TD_MAX_BLOCK_SIZE)
    BAD("WorkerInfo.block_size %u is outside 1 to %d", in->block_size, TD_MAX_BLOCK_SIZE);
  if (!u32_max("WorkerInfo.self_blocks", in->self_blocks, TD_WORKER_MAX_BLOCKS, why, cap) ||
      !u32_max("WorkerInfo.cross_blocks", in->cross_blocks, TD_WORKER_MAX_BLOCKS, why, cap) ||
      !u32_max("WorkerInfo.max_running", in->max_running, TD_WORKER_MAX_RUNNING, why, cap) ||
      !u32_max("WorkerInfo.encode_batch_tokens", in->encode_batch_tokens, INT32_MAX, why, cap))
    return false;
  if (in->transfer_desc.len && !td_check_transfer_desc(in->transfer_desc.data, in->transfer_desc.len, why, cap)) {
    char inner[256];
    snprintf(inner, sizeof inner, "%s", why);
    BAD("WorkerInfo.transfer_desc: %s", inner);
  }
  return str_len("WorkerInfo.device", in->device, 0, TD_WIRE_MAX_NAME, why, cap) &&
         str_len("WorkerInfo.version", in->version, 0, TD_WIRE_MAX_NAME, why, cap) &&
         str_len("WorkerInfo.group", in->group, 0, TD_WIRE_MAX_NAME, why, cap) &&
         str_len("WorkerInfo.cross_mode", in->cross_mode, 0, TD_WIRE_MAX_NAME, why, cap);
}

bool td_check_load(const Tandem__Cluster__Load *l, uint32_t self_blocks, uint32_t cross_blocks, char *why,
                   size_t cap) {
  if (!l) BAD("Heartbeat.load is missing");
  if (l->free_self_blocks > self_blocks)
    BAD("Load.free_self_blocks %u exceeds the %u self blocks registered", l->free_self_blocks, self_blocks);
  if (l->free_cross_blocks > cross_blocks)
    BAD("Load.free_cross_blocks %u exceeds the %u cross blocks registered", l->free_cross_blocks, cross_blocks);
  if (l->encoder_cache_blocks > cross_blocks)
    BAD("Load.encoder_cache_blocks %u exceeds the %u cross blocks registered", l->encoder_cache_blocks, cross_blocks);
  return time_ok("Load.kv_out_seconds_ucx", l->kv_out_seconds_ucx, why, cap) &&
         time_ok("Load.kv_out_seconds_zmq", l->kv_out_seconds_zmq, why, cap) &&
         time_ok("Load.busy_seconds", l->busy_seconds, why, cap) &&
         time_ok("Load.idle_seconds", l->idle_seconds, why, cap) &&
         time_ok("Load.project_seconds", l->project_seconds, why, cap);
}

/* ------------------------------------------------------------ shared */

bool td_check_kv_target(const char *name, const Tandem__Cluster__KvTarget *t, char *why, size_t cap) {
  char f[64];
  if (!t) BAD("%s is missing", name);
  snprintf(f, sizeof f, "%s.worker_id", name);
  if (!id_ok(f, t->worker_id, why, cap)) return false;
  if (!td_check_transfer_desc(t->desc.data, t->desc.len, why, cap)) {
    char inner[256];
    snprintf(inner, sizeof inner, "%s", why);
    BAD("%s.desc: %s", name, inner);
  }
  snprintf(f, sizeof f, "%s.blocks", name);
  if (!t->n_blocks) BAD("%s is empty", f);
  if (!count_max(f, t->n_blocks, TD_KV_PUSH_MAX_BLOCKS, why, cap)) return false;
  for (size_t i = 0; i < t->n_blocks; i++)
    if (t->blocks[i] < 0) BAD("%s[%zu] %d is negative", f, i, t->blocks[i]);
  snprintf(f, sizeof f, "%s.tokens", name);
  return u32_max(f, t->tokens, TD_MODEL_MAX_POSITIONS, why, cap);
}

/* ------------------------------------------------------------ worker -> router */

bool td_check_tokens(const char *name, const Tandem__Cluster__Tokens *t, int vocab, char *why, size_t cap) {
  char f[64];
  if (!t) BAD("%s is missing", name);
  snprintf(f, sizeof f, "%s.sequence", name);
  if (!u32_max(f, t->sequence, TD_CLIENT_MAX_OUTPUTS - 1, why, cap)) return false;
  snprintf(f, sizeof f, "%s.offset", name);
  if (!u32_max(f, t->offset, TD_MODEL_MAX_POSITIONS, why, cap)) return false;
  snprintf(f, sizeof f, "%s.tokens", name);
  if (!count_max(f, t->n_tokens, TD_MODEL_MAX_POSITIONS, why, cap) ||
      !tokens_ok(f, t->tokens, t->n_tokens, vocab, why, cap))
    return false;
  snprintf(f, sizeof f, "%s.logprobs", name);
  return logprobs_ok(f, t->logprobs, t->n_logprobs, t->n_tokens, why, cap);
}

static bool output_ok(size_t k, const Tandem__SequenceOutput *o, int vocab, char *why, size_t cap) {
  char f[64];
  if (!o) BAD("Finished.outputs[%zu] is missing", k);
  snprintf(f, sizeof f, "Finished.outputs[%zu].tokens", k);
  if (!count_max(f, o->n_tokens, TD_MODEL_MAX_POSITIONS, why, cap) ||
      !tokens_ok(f, o->tokens, o->n_tokens, vocab, why, cap))
    return false;
  if (o->finish_reason < TANDEM__FINISH_REASON__FINISH_STOP || o->finish_reason > TANDEM__FINISH_REASON__FINISH_ERROR)
    BAD("Finished.outputs[%zu].finish_reason %d is not stop, length, cancelled or error", k, (int)o->finish_reason);
  snprintf(f, sizeof f, "Finished.outputs[%zu].score", k);
  if (!logp_ok(f, o->score, why, cap)) return false;
  snprintf(f, sizeof f, "Finished.outputs[%zu].logprobs", k);
  if (!logprobs_ok(f, o->logprobs, o->n_logprobs, o->n_tokens, why, cap)) return false;
  /* text and segments are the router's to make from the tokens */
  if (o->has_text || (o->text && o->text[0]) || o->has_segments || o->n_segments)
    BAD("Finished.outputs[%zu] carries text or segments (the router makes them from the tokens)", k);
  return true;
}

bool td_check_group_join(const Tandem__Cluster__GroupJoin *j, char *why, size_t cap) {
  if (!j) BAD("bad group join: no GroupJoin");
  const char *name = j->group ? j->group : "";
  if (!name[0]) BAD("bad group join: no group name");
  if (strlen(name) > TD_GROUP_MAX_NAME)
    BAD("bad group join: the group name has %zu bytes, at most %d", strlen(name), TD_GROUP_MAX_NAME);
  if (j->world < 1 || j->world > TD_GROUP_MAX_RANKS)
    BAD("bad group join: world %u, a group has 1 to %d ranks", j->world, TD_GROUP_MAX_RANKS);
  if (j->rank >= j->world) BAD("bad group join: rank %u of a world of %u", j->rank, j->world);
  if (!j->endpoint || !j->endpoint[0]) BAD("bad group join: rank %u gave no endpoint", j->rank);
  if (strlen(j->endpoint) > TD_WIRE_MAX_NAME)
    BAD("bad group join: an endpoint of %zu bytes, at most %d", strlen(j->endpoint), TD_WIRE_MAX_NAME);
  if (j->nccl_id.len > TD_GROUP_MAX_NCCL_ID)
    BAD("bad group join: an NCCL id of %zu bytes, at most %d", j->nccl_id.len, TD_GROUP_MAX_NCCL_ID);
  if (!str_len("GroupJoin.cross_mode", j->cross_mode, 0, TD_WIRE_MAX_NAME, why, cap)) return false;
  const char *sp = j->encoder_split ? j->encoder_split : "";
  if (sp[0] && strcmp(sp, "rows") && strcmp(sp, "heads"))
    BAD("bad group join: encoder split \"%.32s\" (rows or heads)", sp);
  return true;
}

bool td_check_worker_message(const Tandem__Cluster__WorkerMessage *m, int vocab, char *why, size_t cap) {
  char f[64];
  switch (m->body_case) {
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_REGISTER:
      return td_check_worker_info(m->register_ ? m->register_->info : NULL, why, cap);
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_HEARTBEAT:
      if (!m->heartbeat->load) BAD("Heartbeat.load is missing");
      return true;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_DEREGISTER:
      return str_len("Deregister.reason", m->deregister->reason, 0, TD_WIRE_MAX_REASON, why, cap);
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED:
      return td_check_kv_target("Reserved.cross", m->reserved->cross, why, cap) &&
             (!m->reserved->self || td_check_kv_target("Reserved.self", m->reserved->self, why, cap));
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_ENCODE_DONE:
      return time_ok("EncodeDone.ms", m->encode_done->ms, why, cap);
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_PREFILL_DONE: {
      const Tandem__Cluster__PrefillDone *p = m->prefill_done;
      if (p->first_token != -1 && !token_ok("PrefillDone.first_token", 0, p->first_token, vocab, why, cap))
        return false;
      return logp_ok("PrefillDone.first_logprob", p->first_logprob, why, cap) &&
             time_ok("PrefillDone.ms", p->ms, why, cap);
    }
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS: return td_check_tokens("Tokens", m->tokens, vocab, why, cap);
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS_BATCH:
      for (size_t i = 0; i < m->tokens_batch->n_items; i++) {
        snprintf(f, sizeof f, "TokensBatch.items[%zu]", i);
        if (!td_check_tokens(f, m->tokens_batch->items[i], vocab, why, cap)) return false;
      }
      return true;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FINISHED: {
      const Tandem__Cluster__Finished *fin = m->finished;
      if (fin->n_outputs < 1 || fin->n_outputs > TD_CLIENT_MAX_OUTPUTS)
        BAD("Finished.outputs holds %zu sequences, 1 to %d", fin->n_outputs, TD_CLIENT_MAX_OUTPUTS);
      for (size_t k = 0; k < fin->n_outputs; k++)
        if (!output_ok(k, fin->outputs[k], vocab, why, cap)) return false;
      return time_ok("Finished.decode_ms", fin->decode_ms, why, cap) &&
             time_ok("Finished.first_token_ms", fin->first_token_ms, why, cap);
    }
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED: {
      const Tandem__Cluster__Failed *fl = m->failed;
      /* 0: unnamed (the router reports it as internal) */
      if (fl->code < TANDEM__ERROR_CODE__ERROR_NONE || fl->code > TANDEM__ERROR_CODE__ERROR_PERMISSION_DENIED)
        BAD("Failed.code %d is no error code", (int)fl->code);
      return str_len("Failed.message", fl->message, 0, TD_WIRE_MAX_REASON, why, cap);
    }
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_GROUP_JOIN: return td_check_group_join(m->group_join, why, cap);
    default: BAD("WorkerMessage without a body");
  }
}

/* ------------------------------------------------------------ router -> worker */

static bool sampling_ok(const Tandem__SamplingParams *s, int vocab, char *why, size_t cap) {
  if (!isfinite(s->temperature) || s->temperature < 0)
    BAD("SamplingParams.temperature %g is not a finite number >= 0", s->temperature);
  if (s->top_k < 0 || (vocab > 0 && s->top_k > vocab))
    BAD("SamplingParams.top_k %d is outside 0 to the vocabulary (%d)", s->top_k, vocab);
  if (!isfinite(s->top_p) || s->top_p < 0) BAD("SamplingParams.top_p %g is not a finite number >= 0", s->top_p);
  if (s->n > TD_ROUTER_MAX_SAMPLES) BAD("SamplingParams.n %u exceeds %d", s->n, TD_ROUTER_MAX_SAMPLES);
  if (s->num_beams > TD_ENGINE_MAX_BEAMS) BAD("SamplingParams.num_beams %u exceeds %d", s->num_beams, TD_ENGINE_MAX_BEAMS);
  if (s->num_return_sequences > TD_CLIENT_MAX_OUTPUTS)
    BAD("SamplingParams.num_return_sequences %u exceeds %d", s->num_return_sequences, TD_CLIENT_MAX_OUTPUTS);
  if (s->has_length_penalty && !isfinite(s->length_penalty))
    BAD("SamplingParams.length_penalty %g is not a finite number", s->length_penalty);
  if (s->early_stopping < -1 || s->early_stopping > 1)
    BAD("SamplingParams.early_stopping %d is not 1, 0 or -1", s->early_stopping);
  if (s->set_forced_bos && s->forced_bos_token_id != -1 &&
      !token_ok("SamplingParams.forced_bos_token_id", 0, s->forced_bos_token_id, vocab, why, cap))
    return false;
  if (s->set_forced_eos && s->forced_eos_token_id != -1 &&
      !token_ok("SamplingParams.forced_eos_token_id", 0, s->forced_eos_token_id, vocab, why, cap))
    return false;
  if (vocab > 0 && !count_max("SamplingParams.allowed_token_ids", s->n_allowed_token_ids, (size_t)vocab, why, cap))
    return false;
  if (!tokens_ok("SamplingParams.allowed_token_ids", s->allowed_token_ids, s->n_allowed_token_ids, vocab, why, cap) ||
      !token_ok("SamplingParams.timestamp_begin", 0, s->timestamp_begin, vocab, why, cap))
    return false;
  if (s->has_max_initial_timestamp &&
      (s->max_initial_timestamp_index < 0 || (vocab > 0 && s->max_initial_timestamp_index >= vocab)))
    BAD("SamplingParams.max_initial_timestamp_index %d is outside 0 to the vocabulary (%d)",
        s->max_initial_timestamp_index, vocab);
  return true;
}

bool td_check_request_spec(const Tandem__Cluster__RequestSpec *sp, int vocab, char *why, size_t cap) {
  if (!sp) BAD("the job has no RequestSpec");
  if (!count_max("RequestSpec.input_ids", sp->n_input_ids, TD_MODEL_MAX_POSITIONS, why, cap) ||
      !tokens_ok("RequestSpec.input_ids", sp->input_ids, sp->n_input_ids, vocab, why, cap) ||
      !count_max("RequestSpec.decoder_prompt", sp->n_decoder_prompt, TD_MODEL_MAX_POSITIONS, why, cap) ||
      !tokens_ok("RequestSpec.decoder_prompt", sp->decoder_prompt, sp->n_decoder_prompt, vocab, why, cap) ||
      !count_max("RequestSpec.stop_token_ids", sp->n_stop_token_ids, TD_ROUTER_MAX_STOP_IDS, why, cap) ||
      !tokens_ok("RequestSpec.stop_token_ids", sp->stop_token_ids, sp->n_stop_token_ids, vocab, why, cap) ||
      !u32_max("RequestSpec.max_new_tokens", sp->max_new_tokens, TD_MODEL_MAX_POSITIONS, why, cap) ||
      !u32_max("RequestSpec.enc_len", sp->enc_len, TD_MODEL_MAX_POSITIONS, why, cap) ||
      !str_len("RequestSpec.client_id", sp->client_id, 0, TD_ROUTER_MAX_REQUEST_ID, why, cap))
    return false;
  /* the earlier attempts' tokens are the resumed prompt's tail (the engine reads behind them) */
  if (sp->step_offset && sp->step_offset >= sp->n_decoder_prompt)
    BAD("RequestSpec.step_offset %u: the resumed prompt has %zu tokens, more than the offset", sp->step_offset,
        sp->n_decoder_prompt);
  if (sp->features) {
    const Tandem__AudioFeatures *a = sp->features;
    if (a->n_values > (size_t)TD_MEL_MAX_MELS * TD_MODEL_MAX_FRAMES)
      BAD("RequestSpec.features holds %zu values, at most %d", a->n_values, TD_MEL_MAX_MELS * TD_MODEL_MAX_FRAMES);
    size_t i = td_first_nonfinite(a->values, a->n_values);
    if (i < a->n_values) BAD("RequestSpec.features.values[%zu] is %g", i, a->values[i]);
  }
  return !sp->sampling || sampling_ok(sp->sampling, vocab, why, cap);
}

bool td_check_router_message(const Tandem__Cluster__RouterMessage *m, int vocab, char *why, size_t cap) {
  char f[64];
  switch (m->body_case) {
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ACK:
      return u32_max("RegisterAck.heartbeat_ms", m->ack->heartbeat_ms, TD_MAX_HEARTBEAT_MS, why, cap) &&
             u32_max("RegisterAck.dead_after", m->ack->dead_after, TD_MAX_DEAD_AFTER, why, cap) &&
             str_len("RegisterAck.reason", m->ack->reason, 0, TD_WIRE_MAX_REASON, why, cap);
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE: {
      const Tandem__Cluster__DecodeJob *d = m->decode;
      if (!td_check_request_spec(d->req, vocab, why, cap)) return false;
      if (d->local_encode && d->with_prefill) BAD("DecodeJob: local_encode and with_prefill together");
      /* the prefill worker sends every prompt token's KV but the last */
      if (d->with_prefill ? d->prefill_tokens < 1 || d->prefill_tokens >= d->req->n_decoder_prompt : d->prefill_tokens)
        BAD("DecodeJob.prefill_tokens %u for a prompt of %zu tokens%s", d->prefill_tokens, d->req->n_decoder_prompt,
            d->with_prefill ? "" : " without a prefill worker");
      return true;
    }
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL: {
      const Tandem__Cluster__PrefillJob *p = m->prefill;
      if (!td_check_request_spec(p->req, vocab, why, cap) ||
          !td_check_kv_target("PrefillJob.self_target", p->self_target, why, cap))
        return false;
      if (p->prefill_tokens < 1 || p->prefill_tokens >= p->req->n_decoder_prompt ||
          p->prefill_tokens != p->self_target->tokens)
        BAD("PrefillJob.prefill_tokens %u for a prompt of %zu tokens and a target of %u", p->prefill_tokens,
            p->req->n_decoder_prompt, p->self_target->tokens);
      return true;
    }
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE: {
      const Tandem__Cluster__EncodeJob *e = m->encode;
      if (!td_check_request_spec(e->req, vocab, why, cap)) return false;
      /* the decode worker's cross blocks, and the prefill worker's */
      if (e->n_targets < 1 || e->n_targets > 2) BAD("EncodeJob.targets holds %zu targets, 1 or 2", e->n_targets);
      for (size_t i = 0; i < e->n_targets; i++) {
        snprintf(f, sizeof f, "EncodeJob.targets[%zu]", i);
        if (!td_check_kv_target(f, e->targets[i], why, cap)) return false;
      }
      return true;
    }
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL_RESULT: {
      const Tandem__Cluster__PrefillResult *p = m->prefill_result;
      if (p->first_token != -1 && !token_ok("PrefillResult.first_token", 0, p->first_token, vocab, why, cap))
        return false;
      return logp_ok("PrefillResult.first_logprob", p->first_logprob, why, cap);
    }
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_REMOVE:
      return str_len("Remove.reason", m->remove->reason, 0, TD_WIRE_MAX_REASON, why, cap);
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO: {
      const Tandem__Cluster__GroupInfo *g = m->group_info;
      if (!str_len("GroupInfo.error", g->error, 0, TD_WIRE_MAX_REASON, why, cap)) return false;
      if (!g->ok) return true; /* only the error is read */
      if (g->world < 1 || g->world > TD_GROUP_MAX_RANKS || g->n_endpoints != g->world)
        BAD("GroupInfo: world %u with %zu endpoints (1 to %d ranks, one endpoint a rank)", g->world, g->n_endpoints,
            TD_GROUP_MAX_RANKS);
      for (size_t i = 0; i < g->n_endpoints; i++) {
        snprintf(f, sizeof f, "GroupInfo.endpoints[%zu]", i);
        if (!str_len(f, g->endpoints[i], 1, TD_WIRE_MAX_NAME, why, cap)) return false;
      }
      if (g->nccl_id.len > TD_GROUP_MAX_NCCL_ID)
        BAD("GroupInfo.nccl_id has %zu bytes, at most %d", g->nccl_id.len, TD_GROUP_MAX_NCCL_ID);
      return true;
    }
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_HEARTBEAT:
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_CANCEL:
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DRAIN:
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_UNDRAIN:
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_SHUTDOWN: return true;
    default: BAD("RouterMessage without a body");
  }
}

/* ------------------------------------------------------------ router -> client */

static bool client_chunk_ok(const char *name, const Tandem__TokenChunk *c, char *why, size_t cap) {
  char f[64];
  if (!c) BAD("%s is missing", name);
  snprintf(f, sizeof f, "%s.sequence", name);
  if (!u32_max(f, c->sequence, INT32_MAX, why, cap)) return false;
  snprintf(f, sizeof f, "%s.offset", name);
  if (!u32_max(f, c->offset, INT32_MAX, why, cap)) return false;
  snprintf(f, sizeof f, "%s.tokens", name);
  if (!count_max(f, c->n_tokens, INT32_MAX, why, cap)) return false;
  snprintf(f, sizeof f, "%s.logprobs", name);
  if (c->n_logprobs && c->n_logprobs != c->n_tokens)
    BAD("%s has %zu values for %zu tokens", f, c->n_logprobs, c->n_tokens);
  return true;
}

bool td_check_server_message(const Tandem__ServerMessage *m, char *why, size_t cap) {
  char f[64];
  switch (m->body_case) {
    case TANDEM__SERVER_MESSAGE__BODY_TOKENS: return client_chunk_ok("TokenChunk", m->tokens, why, cap);
    case TANDEM__SERVER_MESSAGE__BODY_CHUNKS:
      for (size_t i = 0; i < m->chunks->n_items; i++) {
        snprintf(f, sizeof f, "ChunkBatch.items[%zu].chunk", i);
        if (!client_chunk_ok(f, m->chunks->items[i]->chunk, why, cap)) return false;
      }
      return true;
    case TANDEM__SERVER_MESSAGE__BODY_RESULT: {
      const Tandem__GenerateResult *g = m->result;
      if (g->n_outputs > TD_CLIENT_MAX_OUTPUTS)
        BAD("GenerateResult.outputs holds %zu sequences, at most %d", g->n_outputs, TD_CLIENT_MAX_OUTPUTS);
      for (size_t i = 0; i < g->n_outputs; i++) {
        const Tandem__SequenceOutput *o = g->outputs[i];
        if (o->n_tokens > INT32_MAX || o->n_segments > INT32_MAX)
          BAD("GenerateResult.outputs[%zu] holds %zu tokens and %zu segments", i, o->n_tokens, o->n_segments);
        if (o->n_logprobs && o->n_logprobs != o->n_tokens)
          BAD("GenerateResult.outputs[%zu].logprobs has %zu values for %zu tokens", i, o->n_logprobs, o->n_tokens);
      }
      return true;
    }
    default: return true; /* errors, health, models, admin answers: read field by field with their bounds */
  }
}
