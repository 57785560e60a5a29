/* libFuzzer target: the cluster's control messages. The first byte picks
 * the direction: a WorkerMessage as the router reads it
 * (td_wire_unpack_worker) or a RouterMessage as a worker reads it
 * (td_wire_unpack_router). A decoded message is then checked the way its
 * receiver starts to: field by field (proto/check.c, against a vocabulary
 * of 100), whose promises are held to (what it accepts fits the ints the
 * receiver casts it to), a Register's or GroupJoin's cross-pool mode parsed
 * (td_cross_mode_parse), and packed again: protobuf-c must re-read what it
 * packs, to the same size. Any bytes: a message or a refusal. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/cross_mode.h"
#include "common/defaults.h"
#include "proto/check.h"
#include "proto/wire.h"

#define V 100

/* What an accepted job promises its worker (worker/jobs.c casts these to int). */
static void spec_promises(const Tandem__Cluster__RequestSpec *sp) {
  if (sp->max_new_tokens > TD_MODEL_MAX_POSITIONS || sp->enc_len > TD_MODEL_MAX_POSITIONS) abort();
  if (sp->step_offset && sp->step_offset >= sp->n_decoder_prompt) abort();
  for (size_t i = 0; i < sp->n_input_ids; i++)
    if (sp->input_ids[i] < 0 || sp->input_ids[i] >= V) abort();
  const Tandem__SamplingParams *s = sp->sampling;
  if (s && (s->n > TD_ROUTER_MAX_SAMPLES || s->num_beams > TD_ENGINE_MAX_BEAMS || !(s->top_p >= 0) ||
            s->top_p == (float)INFINITY || (s->set_forced_bos && s->forced_bos_token_id < -1)))
    abort();
}

static void checked_worker(const Tandem__Cluster__WorkerMessage *m) {
  char why[400];
  if (!td_check_worker_message(m, V, why, sizeof why)) {
    if (!why[0]) abort(); /* a refusal says why */
    return;
  }
  if (m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_REGISTER) {
    const Tandem__Cluster__WorkerInfo *in = m->register_->info;
    if (in->model->vocab_size > TD_MODEL_MAX_VOCAB || in->self_blocks > TD_WORKER_MAX_BLOCKS ||
        in->block_size < 1 || in->encode_batch_tokens > INT32_MAX || !in->model->decoder_start)
      abort();
  }
  if (m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_HEARTBEAT)
    (void)td_check_load(m->heartbeat->load, 100, 100, why, sizeof why);
  if (m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FINISHED)
    for (size_t k = 0; k < m->finished->n_outputs; k++) {
      const Tandem__SequenceOutput *o = m->finished->outputs[k];
      if (isnan(o->score) || o->has_text) abort();
      for (size_t i = 0; i < o->n_tokens; i++)
        if (o->tokens[i] < 0 || o->tokens[i] >= V) abort();
    }
}

static void checked_router(const Tandem__Cluster__RouterMessage *m) {
  char why[400];
  if (!td_check_router_message(m, V, why, sizeof why)) {
    if (!why[0]) abort();
    return;
  }
  if (m->body_case == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE) spec_promises(m->decode->req);
  if (m->body_case == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE) {
    spec_promises(m->encode->req);
    if (m->encode->n_targets < 1 || m->encode->n_targets > 2) abort();
  }
  if (m->body_case == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ACK && m->ack->heartbeat_ms > TD_MAX_HEARTBEAT_MS) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void repack(const ProtobufCMessage *m) {
  size_t n = protobuf_c_message_get_packed_size(m);
  uint8_t *b = malloc(n ? n : 1);
  if (!b) return;
  if (protobuf_c_message_pack(m, b) != n) abort();
  ProtobufCMessage *again = protobuf_c_message_unpack(m->descriptor, NULL, n, b);
  if (!again) abort();
  if (protobuf_c_message_get_packed_size(again) != n) abort();
  protobuf_c_message_free_unpacked(again, NULL);
  free(b);
}

static void mode(const char *s) {
  td_cross_mode m;
  if (s && td_cross_mode_parse(s, &m) == TD_OK && !td_cross_mode_name(m)) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  td_wire_frame f = {.data = (uint8_t *)data + 1, .len = size - 1};
  uint32_t ver;
  if (data[0] & 1) {
    Tandem__Cluster__RouterMessage *m;
    if (td_wire_unpack_router(&f, &m, &ver) != TD_OK) return 0;
    checked_router(m);
    repack(&m->base);
    tandem__cluster__router_message__free_unpacked(m, NULL);
    return 0;
  }
  Tandem__Cluster__WorkerMessage *m;
  if (td_wire_unpack_worker(&f, &m, &ver) != TD_OK) return 0;
  checked_worker(m);
  if (m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_REGISTER && m->register_ && m->register_->info)
    mode(m->register_->info->cross_mode);
  if (m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_GROUP_JOIN && m->group_join)
    mode(m->group_join->cross_mode);
  repack(&m->base);
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  return 0;
}
