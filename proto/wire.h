/* Versioned protobuf messages over ZeroMQ. A DEALER peer sends one frame
 * (the packed message); a ROUTER sees [identity][message]. Every message's
 * field 1 is the protocol version, checked on receipt. */
#ifndef TD_PROTO_WIRE_H
#define TD_PROTO_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <zmq.h>

#include "cluster.pb-c.h"
#include "common/status.h"
#include "tandem.pb-c.h"

#define TD_PROTOCOL_VERSION 2u /* 2: cross_mode replaces cross_states */
#define TD_WIRE_MAX_MSG (64 << 20) /* larger messages drop the peer's connection */
#define TD_WIRE_MAX_ID 255

typedef struct td_wire_frame {
  uint8_t id[TD_WIRE_MAX_ID];
  size_t id_len;  /* 0 on DEALER sockets */
  uint8_t *data;  /* payload: the received message's own bytes, not a copy (a large request is held once) */
  size_t len;
  zmq_msg_t msg;  /* holds data until td_wire_frame_free (a frame is never copied by value: small messages keep
                     their bytes inside msg) */
  bool has_msg;
  /* A second frame after the message: bulk data a field of it claims
   * (AudioFeatures.values_in_frame); whoever takes it moves it out. */
  zmq_msg_t extra;
  bool has_extra;
} td_wire_frame;

/* Packs msg and sends it, after the identity frame when id != NULL.
 * Non-blocking: a full queue reports TD_ERR_OVERLOADED. */
td_status td_wire_send(void *sock, const uint8_t *id, size_t id_len, const ProtobufCMessage *msg);
/* The same with a second frame (NULL: none): extra is sent by reference
 * (a copy of the handle, not of the bytes) and stays the caller's. */
td_status td_wire_send_extra(void *sock, const uint8_t *id, size_t id_len, const ProtobufCMessage *msg,
                             zmq_msg_t *extra);
/* Receives one message (non-blocking unless `wait`), and its second frame
 * when one follows. TD_ERR_NOT_FOUND when nothing is ready. Frames that do
 * not fit the expected shape (more than two after the identity) are
 * consumed and reported as TD_ERR_FORMAT (id filled when known). */
td_status td_wire_recv(void *sock, bool router, bool wait, td_wire_frame *out);
void td_wire_frame_free(td_wire_frame *f);

/* Unpack with version check; TD_ERR_FORMAT for malformed bytes,
 * TD_ERR_VERSION for another protocol version (*out is then NULL). */
td_status td_wire_unpack_client(const td_wire_frame *f, Tandem__ClientMessage **out, uint32_t *version);
td_status td_wire_unpack_server(const td_wire_frame *f, Tandem__ServerMessage **out, uint32_t *version);
td_status td_wire_unpack_worker(const td_wire_frame *f, Tandem__Cluster__WorkerMessage **out, uint32_t *version);
td_status td_wire_unpack_router(const td_wire_frame *f, Tandem__Cluster__RouterMessage **out, uint32_t *version);

/* Socket options common to every Tandem socket (linger, size limit, heartbeats). */
void td_wire_setup_socket(void *sock);

/* A connection's routing identity, unique to this process and call:
 * "NAME.PID.RANDOM" (NAME cut to 64 bytes). A worker's id travels in its
 * registration; its socket's identity is never reused, so that a second
 * process claiming the same id is a registration the router can refuse,
 * not a libzmq identity clash. */
void td_wire_set_unique_route(void *sock, const char *name);

/* The unpackers also check the second frame: there exactly when a field
 * claims it (AudioFeatures.values_in_frame), of the size it says. Frames
 * are little-endian float32, as protobuf's own floats. */

/* Copies a claimed frame's features into a->values (the message then
 * holds them as if sent inline); a no-op for other features. */
td_status td_wire_features_inline(td_wire_frame *f, Tandem__AudioFeatures *a);

/* Maps between status codes and the protocol's error codes. */
Tandem__ErrorCode td_wire_error_code(td_status s);
td_status td_wire_status(Tandem__ErrorCode c);

#endif
