/* The local link: the frames of a ZeroMQ peer (proto/wire.h) over a Unix
 * stream socket between two processes of one host, read and written by the
 * application thread itself. A ZeroMQ hop wakes three threads (the
 * sender's I/O thread, the receiver's I/O thread, the receiver) and took
 * 55-140 us on our hosts; a Unix socket wakes the receiver alone
 * (docs/latency.md). Only the router's own processes use it: workers on the
 * router's host (`--router local:PATH`) and local clients, never the
 * network (no CURVE: the socket file's owner is the only peer taken).
 *
 * A frame is a 12-byte header (magic, the message's length, the second
 * frame's length or TD_LINK_NO_EXTRA), little-endian, then the bytes of
 * each. A malformed header breaks the link: a stream cannot resync. */
#ifndef TD_PROTO_LINK_H
#define TD_PROTO_LINK_H

#include <stdbool.h>
#include <stddef.h>

#include "proto/wire.h"

#define TD_LINK_PREFIX "local:" /* an endpoint naming a link's socket path */
#define TD_LINK_MAX_QUEUED ((size_t)1 << 30) /* bytes waiting to be written: more is an overload */

typedef struct td_link td_link;
typedef struct td_link_server td_link_server;

/* The socket path an endpoint names (after TD_LINK_PREFIX), or NULL when it
 * is not a link's. */
const char *td_link_path(const char *endpoint);

/* Binds path (refused when another process serves it; a stale file is
 * replaced), readable and writable by this user only. */
td_status td_link_listen(const char *path, td_link_server **out);
int td_link_server_fd(const td_link_server *s);
/* A waiting connection (TD_ERR_NOT_FOUND: none). A peer running as another
 * user is closed and reported as TD_ERR_PEER. */
td_status td_link_accept(td_link_server *s, td_link **out);
/* Closes and removes the socket file. */
void td_link_server_destroy(td_link_server *s);

td_status td_link_connect(const char *path, td_link **out);
int td_link_fd(const td_link *k);

/* Queues msg (packed) and extra (by reference: a copy of the handle, the
 * caller's stays its own; NULL: none) and writes what the socket takes
 * now. TD_ERR_PEER once the link is broken, TD_ERR_OVERLOADED past
 * TD_LINK_MAX_QUEUED. */
td_status td_link_send(td_link *k, const ProtobufCMessage *msg, zmq_msg_t *extra);
/* Writes what waits (when the descriptor is writable). */
td_status td_link_flush(td_link *k);
bool td_link_wants_write(const td_link *k);
/* One whole frame (its message in out->data, a second frame in out->extra),
 * reading the socket as needed: TD_ERR_NOT_FOUND until one is whole,
 * TD_ERR_PEER when the peer closed or the link broke, TD_ERR_FORMAT for a
 * malformed header (the link is broken then). out is always freeable. */
td_status td_link_recv(td_link *k, td_wire_frame *out);
bool td_link_broken(const td_link *k);
/* Bytes of a next frame wait in the link's own buffer (a reader that
 * stopped early, e.g. at its burst's end): the descriptor will not say so,
 * so read again without waiting for it. */
bool td_link_pending(const td_link *k);
void td_link_destroy(td_link *k);

#endif
