/* libFuzzer target: the cluster's control messages. The first byte picks
 * the direction: a WorkerMessage as the router reads it
 * (td_wire_unpack_worker) or a RouterMessage as a worker reads it
 * (td_wire_unpack_router). A decoded message is then checked the way its
 * receiver starts to: a Register's or GroupJoin's cross-pool mode parsed
 * (td_cross_mode_parse), and packed again: protobuf-c must re-read what it
 * packs, to the same size. Any bytes: a message or a refusal. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/cross_mode.h"
#include "proto/wire.h"

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
    repack(&m->base);
    tandem__cluster__router_message__free_unpacked(m, NULL);
    return 0;
  }
  Tandem__Cluster__WorkerMessage *m;
  if (td_wire_unpack_worker(&f, &m, &ver) != TD_OK) return 0;
  if (m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_REGISTER && m->register_ && m->register_->info)
    mode(m->register_->info->cross_mode);
  if (m->body_case == TANDEM__CLUSTER__WORKER_MESSAGE__BODY_GROUP_JOIN && m->group_join)
    mode(m->group_join->cross_mode);
  repack(&m->base);
  tandem__cluster__worker_message__free_unpacked(m, NULL);
  return 0;
}
