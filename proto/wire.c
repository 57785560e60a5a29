#include "proto/wire.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "common/defaults.h"

/* feature frames are little-endian float32, as protobuf's floats, copied as they are */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "a little-endian host");

void td_wire_set_unique_route(void *sock, const char *name) {
  uint64_t rnd = 0;
  if (getrandom(&rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    rnd = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30);
  }
  char route[128];
  int n = snprintf(route, sizeof route, "%.64s.%d.%016llx", name, (int)getpid(), (unsigned long long)rnd);
  zmq_setsockopt(sock, ZMQ_ROUTING_ID, route, (size_t)n);
}

void td_wire_setup_socket(void *sock) {
  int linger = 0, hwm = 100000;
  int64_t max = TD_WIRE_MAX_MSG;
  zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger);
  zmq_setsockopt(sock, ZMQ_MAXMSGSIZE, &max, sizeof max);
  zmq_setsockopt(sock, ZMQ_SNDHWM, &hwm, sizeof hwm);
  zmq_setsockopt(sock, ZMQ_RCVHWM, &hwm, sizeof hwm);
  int ivl = TD_WIRE_HEARTBEAT_IVL_MS, ttl = TD_WIRE_HEARTBEAT_TIMEOUT_MS, tmo = TD_WIRE_HEARTBEAT_TIMEOUT_MS;
  zmq_setsockopt(sock, ZMQ_HEARTBEAT_IVL, &ivl, sizeof ivl);
  zmq_setsockopt(sock, ZMQ_HEARTBEAT_TTL, &ttl, sizeof ttl);
  zmq_setsockopt(sock, ZMQ_HEARTBEAT_TIMEOUT, &tmo, sizeof tmo);
}

td_status td_wire_send_extra(void *sock, const uint8_t *id, size_t id_len, const ProtobufCMessage *msg,
                             zmq_msg_t *extra) {
  size_t n = protobuf_c_message_get_packed_size(msg);
  zmq_msg_t m, x;
  if (zmq_msg_init_size(&m, n ? n : 1) != 0) return td_err(TD_ERR_NOMEM, "zmq message of %zu bytes", n);
  protobuf_c_message_pack(msg, zmq_msg_data(&m));
  zmq_msg_init(&x);
  if (extra && zmq_msg_copy(&x, extra) != 0) { /* a reference: the bytes stay where they are */
    zmq_msg_close(&m);
    zmq_msg_close(&x);
    return td_err(TD_ERR_NETWORK, "zmq message copy: %s", zmq_strerror(errno));
  }
  /* the later frames of a message whose first was queued are queued too (ZeroMQ sends it whole or not at all) */
  if ((id && zmq_send(sock, id, id_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) ||
      zmq_msg_send(&m, sock, ZMQ_DONTWAIT | (extra ? ZMQ_SNDMORE : 0)) < 0 ||
      (extra && zmq_msg_send(&x, sock, ZMQ_DONTWAIT) < 0)) {
    int e = errno;
    zmq_msg_close(&m);
    zmq_msg_close(&x);
    return td_err(e == EAGAIN ? TD_ERR_OVERLOADED : TD_ERR_NETWORK, "zmq send: %s", zmq_strerror(e));
  }
  zmq_msg_close(&x);
  return TD_OK;
}

td_status td_wire_send(void *sock, const uint8_t *id, size_t id_len, const ProtobufCMessage *msg) {
  return td_wire_send_extra(sock, id, id_len, msg, NULL);
}

static bool more(void *sock) {
  int v = 0;
  size_t l = sizeof v;
  zmq_getsockopt(sock, ZMQ_RCVMORE, &v, &l);
  return v != 0;
}

static void drain(void *sock) {
  while (more(sock)) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    zmq_msg_recv(&m, sock, 0);
    zmq_msg_close(&m);
  }
}

td_status td_wire_recv(void *sock, bool router, bool wait, td_wire_frame *out) {
  memset(out, 0, sizeof *out);
  zmq_msg_t m;
  zmq_msg_init(&m);
  int flags = wait ? 0 : ZMQ_DONTWAIT;
  if (zmq_msg_recv(&m, sock, flags) < 0) {
    int e = errno;
    zmq_msg_close(&m);
    if (e == EAGAIN) return TD_ERR_NOT_FOUND;
    return td_err(e == ETERM ? TD_ERR_CANCELLED : TD_ERR_NETWORK, "zmq recv: %s", zmq_strerror(e));
  }
  if (router) {
    size_t il = zmq_msg_size(&m);
    if (il > TD_WIRE_MAX_ID) il = TD_WIRE_MAX_ID;
    memcpy(out->id, zmq_msg_data(&m), il);
    out->id_len = il;
    zmq_msg_close(&m);
    if (!more(sock)) return td_err(TD_ERR_FORMAT, "message without a body");
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, sock, 0) < 0) {
      zmq_msg_close(&m);
      return td_err(TD_ERR_NETWORK, "zmq recv: %s", zmq_strerror(errno));
    }
  }
  zmq_msg_init(&out->extra);
  if (more(sock)) {
    if (zmq_msg_recv(&out->extra, sock, 0) < 0 || more(sock)) {
      zmq_msg_close(&m);
      zmq_msg_close(&out->extra);
      drain(sock);
      return td_err(TD_ERR_FORMAT, "message with more than one frame after its body");
    }
    out->has_extra = true;
  }
  out->len = zmq_msg_size(&m);
  zmq_msg_init(&out->msg);
  zmq_msg_move(&out->msg, &m);
  zmq_msg_close(&m);
  out->has_msg = true;
  out->data = zmq_msg_data(&out->msg);
  return TD_OK;
}

void td_wire_frame_free(td_wire_frame *f) {
  if (f->has_msg) zmq_msg_close(&f->msg);
  if (f->has_extra) zmq_msg_close(&f->extra);
  f->has_msg = f->has_extra = false;
  f->data = NULL;
}

/* Reads field 1 (varint) without trusting the rest: a message from another
 * version still tells its version. */
static uint32_t peek_version(const uint8_t *p, size_t n) {
  if (n < 2 || p[0] != 0x08) return 0;
  uint64_t v = 0;
  for (size_t i = 1, sh = 0; i < n && sh < 35; i++, sh += 7) {
    v |= (uint64_t)(p[i] & 0x7f) << sh;
    if (!(p[i] & 0x80)) return (uint32_t)v;
  }
  return 0;
}

/* Drops the fields this version does not know, in m and every message it
 * holds. Peers of one protocol version send none; keeping them would let a
 * client's bytes travel on inside the parts the router forwards
 * (RequestSpec takes the request's SamplingParams and AudioFeatures), and
 * protobuf-c keeps some it cannot pack again: a field numbered 0 in a
 * tag of two bytes is read, then written as a one-byte tag that it
 * refuses, so the worker would drop the job (found by fuzz_wire_cluster). */
static void drop_unknown(ProtobufCMessage *m) {
  if (!m) return;
  for (unsigned i = 0; i < m->n_unknown_fields; i++) free(m->unknown_fields[i].data);
  free(m->unknown_fields); /* unpacked with the default allocator: malloc */
  m->unknown_fields = NULL;
  m->n_unknown_fields = 0;
  const ProtobufCMessageDescriptor *d = m->descriptor;
  for (unsigned i = 0; i < d->n_fields; i++) {
    const ProtobufCFieldDescriptor *f = &d->fields[i];
    if (f->type != PROTOBUF_C_TYPE_MESSAGE) continue;
    char *base = (char *)m;
    if (f->label == PROTOBUF_C_LABEL_REPEATED) {
      size_t n = *(size_t *)(base + f->quantifier_offset);
      ProtobufCMessage **v = *(ProtobufCMessage ***)(base + f->offset);
      for (size_t k = 0; k < n; k++) drop_unknown(v[k]);
    } else if (!(f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) || *(uint32_t *)(base + f->quantifier_offset) == f->id) {
      drop_unknown(*(ProtobufCMessage **)(base + f->offset));
    }
  }
}

/* The features whose values a message's second frame carries, if any. */
static Tandem__AudioFeatures *client_claim(Tandem__ClientMessage *m) {
  return m->body_case == TANDEM__CLIENT_MESSAGE__BODY_GENERATE && m->generate->features &&
                 m->generate->features->values_in_frame
             ? m->generate->features
             : NULL;
}

static Tandem__AudioFeatures *router_claim(Tandem__Cluster__RouterMessage *m) {
  const Tandem__Cluster__RequestSpec *sp = NULL;
  if (m->body_case == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE) sp = m->decode->req;
  if (m->body_case == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE) sp = m->encode->req;
  if (m->body_case == TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL) sp = m->prefill->req;
  return sp && sp->features && sp->features->values_in_frame ? sp->features : NULL;
}

static Tandem__AudioFeatures *no_claim(void *m) {
  (void)m;
  return NULL;
}

/* A second frame is there exactly when a field claims it, and holds what
 * that field says: mel_bins x frames float32. */
static td_status check_claim(const td_wire_frame *f, const Tandem__AudioFeatures *a) {
  if (!a && f->has_extra)
    return td_err(TD_ERR_FORMAT, "a frame of %zu bytes after the message, which no field of it claims",
                  zmq_msg_size((zmq_msg_t *)&f->extra));
  if (!a) return TD_OK;
  if (!f->has_extra) return td_err(TD_ERR_FORMAT, "AudioFeatures.values_in_frame, but no frame follows the message");
  if (a->n_values) return td_err(TD_ERR_FORMAT, "AudioFeatures: %zu values and values_in_frame", a->n_values);
  size_t want = (size_t)a->mel_bins * a->frames * sizeof(float), got = zmq_msg_size((zmq_msg_t *)&f->extra);
  if (!got || got % sizeof(float))
    return td_err(TD_ERR_FORMAT, "AudioFeatures in a frame of %zu bytes: not a whole number of float32", got);
  if ((a->mel_bins || a->frames) && got != want) /* without them the receiver checks the count against its model */
    return td_err(TD_ERR_FORMAT, "AudioFeatures of %u x %u values in a frame of %zu bytes (%zu expected)", a->mel_bins,
                  a->frames, got, want);
  return TD_OK;
}

#define UNPACK(fn, type, desc, claim)                                                                 \
  td_status fn(const td_wire_frame *f, type **out, uint32_t *version) {                              \
    *out = NULL;                                                                                      \
    *version = peek_version(f->data, f->len);                                                         \
    if (*version != TD_PROTOCOL_VERSION) {                                                            \
      if (*version == 0) return td_err(TD_ERR_FORMAT, "malformed message (%zu bytes, no version)", f->len); \
      return td_err(TD_ERR_VERSION, "protocol version %u, this peer speaks %u", *version,            \
                    TD_PROTOCOL_VERSION);                                                             \
    }                                                                                                 \
    type *m = (type *)protobuf_c_message_unpack(&desc, NULL, f->len, f->data);                        \
    if (!m) return td_err(TD_ERR_FORMAT, "malformed message (%zu bytes)", f->len);                    \
    drop_unknown(&m->base);                                                                           \
    td_status s = check_claim(f, claim(m));                                                           \
    if (s != TD_OK) {                                                                                 \
      protobuf_c_message_free_unpacked(&m->base, NULL);                                               \
      return s;                                                                                       \
    }                                                                                                 \
    *out = m;                                                                                         \
    return TD_OK;                                                                                     \
  }

UNPACK(td_wire_unpack_client, Tandem__ClientMessage, tandem__client_message__descriptor, client_claim)
UNPACK(td_wire_unpack_server, Tandem__ServerMessage, tandem__server_message__descriptor, no_claim)
UNPACK(td_wire_unpack_worker, Tandem__Cluster__WorkerMessage, tandem__cluster__worker_message__descriptor, no_claim)
UNPACK(td_wire_unpack_router, Tandem__Cluster__RouterMessage, tandem__cluster__router_message__descriptor, router_claim)

td_status td_wire_features_inline(td_wire_frame *f, Tandem__AudioFeatures *a) {
  if (!a || !a->values_in_frame) return TD_OK;
  size_t n = zmq_msg_size(&f->extra) / sizeof(float); /* a whole number of them: checked at unpacking */
  float *v = malloc(sizeof *v * (n ? n : 1));
  if (!v) return td_err(TD_ERR_NOMEM, "out of memory for %zu audio feature values", n);
  memcpy(v, zmq_msg_data(&f->extra), sizeof *v * n);
  a->values = v; /* freed with the message */
  a->n_values = n;
  a->values_in_frame = false;
  return TD_OK;
}

Tandem__ErrorCode td_wire_error_code(td_status s) {
  switch (s) {
    case TD_OK: return TANDEM__ERROR_CODE__ERROR_NONE;
    case TD_ERR_INVALID:
    case TD_ERR_UNSUPPORTED:
    case TD_ERR_NO_BLOCKS: return TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT;
    case TD_ERR_FORMAT: return TANDEM__ERROR_CODE__ERROR_MALFORMED;
    case TD_ERR_OVERLOADED: return TANDEM__ERROR_CODE__ERROR_OVERLOADED;
    case TD_ERR_TIMEOUT: return TANDEM__ERROR_CODE__ERROR_TIMEOUT;
    case TD_ERR_CANCELLED: return TANDEM__ERROR_CODE__ERROR_CANCELLED;
    case TD_ERR_PEER:
    case TD_ERR_NETWORK: return TANDEM__ERROR_CODE__ERROR_UNAVAILABLE;
    case TD_ERR_VERSION: return TANDEM__ERROR_CODE__ERROR_VERSION;
    case TD_ERR_NOT_FOUND: return TANDEM__ERROR_CODE__ERROR_NOT_FOUND;
    default: return TANDEM__ERROR_CODE__ERROR_INTERNAL;
  }
}

td_status td_wire_status(Tandem__ErrorCode c) {
  switch (c) {
    case TANDEM__ERROR_CODE__ERROR_NONE: return TD_OK;
    case TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT: return TD_ERR_INVALID;
    case TANDEM__ERROR_CODE__ERROR_OVERLOADED: return TD_ERR_OVERLOADED;
    case TANDEM__ERROR_CODE__ERROR_TIMEOUT: return TD_ERR_TIMEOUT;
    case TANDEM__ERROR_CODE__ERROR_CANCELLED: return TD_ERR_CANCELLED;
    case TANDEM__ERROR_CODE__ERROR_UNAVAILABLE: return TD_ERR_PEER;
    case TANDEM__ERROR_CODE__ERROR_VERSION: return TD_ERR_VERSION;
    case TANDEM__ERROR_CODE__ERROR_NOT_FOUND: return TD_ERR_NOT_FOUND;
    case TANDEM__ERROR_CODE__ERROR_MALFORMED: return TD_ERR_FORMAT;
    case TANDEM__ERROR_CODE__ERROR_FAILED_PRECONDITION:
    case TANDEM__ERROR_CODE__ERROR_PERMISSION_DENIED: return TD_ERR_INVALID;
    default: return TD_ERR_INTERNAL;
  }
}
