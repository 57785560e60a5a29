/* What each message from a peer may hold, field by field: one function a
 * message type, called where the message is received, before any of its
 * fields is used. A refusal names the field as the .proto files spell it
 * ("Tokens.tokens[3] 5000 is outside the vocabulary of 100"). The table of
 * every field, its limit, where it is checked and what the sender gets is
 * docs/limits.md, "Fields"; the limits are in common/defaults.h.
 *
 * These checks see one message alone (and the served model's vocabulary
 * where ids are compared: 0 when not known yet, then only ids < 0 are
 * refused). What depends on the request a message is about (how many
 * blocks it needs, how many tokens it may still get) is checked by the
 * receiver against that request: router/stream.c, worker/jobs.c. A
 * client's GenerateRequest is admission's (router/admit.c). */
#ifndef TD_PROTO_CHECK_H
#define TD_PROTO_CHECK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cluster.pb-c.h"
#include "tandem.pb-c.h"

/* ---- from a worker, at the router ---- */

/* A registration's model: vocabulary, lengths, Whisper's features, the
 * decoder start token and the EOS ids within their limits. */
bool td_check_model_info(const Tandem__ModelInfo *m, char *why, size_t cap);
/* A registration: id, roles, model, group shape, block size, pools, batch,
 * KV descriptor, names. */
bool td_check_worker_info(const Tandem__Cluster__WorkerInfo *in, char *why, size_t cap);
/* A heartbeat's load (free blocks against the pools the worker registered:
 * self_blocks, cross_blocks), its times finite. */
bool td_check_load(const Tandem__Cluster__Load *l, uint32_t self_blocks, uint32_t cross_blocks, char *why, size_t cap);
/* Every worker message but Register's WorkerInfo (td_check_worker_info) and
 * Heartbeat's Load (td_check_load, which needs the registration): token ids
 * against the vocabulary, log-probabilities, scores and times not NaN,
 * counts that agree with their arrays, enum values known, strings bounded. */
bool td_check_worker_message(const Tandem__Cluster__WorkerMessage *m, int vocab, char *why, size_t cap);
/* Parts of those the router reads one by one: a TokensBatch's items (a bad
 * item costs its own request only), a GroupJoin (answered with GroupInfo's
 * error). name: the field's name in the refusal. */
bool td_check_tokens(const char *name, const Tandem__Cluster__Tokens *t, int vocab, char *why, size_t cap);
bool td_check_group_join(const Tandem__Cluster__GroupJoin *j, char *why, size_t cap);

/* ---- shared by both directions ---- */

/* Where blocks were reserved: the worker's id, its descriptor, block ids. */
bool td_check_kv_target(const char *name, const Tandem__Cluster__KvTarget *t, char *why, size_t cap);
/* A worker's KV descriptor (WorkerInfo.transfer_desc, KvTarget.desc): a
 * TransferDesc of this protocol version, or a bare "zmq:" endpoint. */
bool td_check_transfer_desc(const uint8_t *b, size_t len, char *why, size_t cap);

/* ---- from the router, at a worker ---- */

/* What a job says of its request: counts that fit an int, sampling values
 * finite and in range, a resumed prompt longer than its offset. */
bool td_check_request_spec(const Tandem__Cluster__RequestSpec *sp, int vocab, char *why, size_t cap);
/* Every router message: jobs (td_check_request_spec and their targets), the
 * registration's answer (heartbeat period, dead-after), group answers. */
bool td_check_router_message(const Tandem__Cluster__RouterMessage *m, int vocab, char *why, size_t cap);

/* ---- from the router, at a client ---- */

/* Chunks and results: counts that fit, log-probabilities that agree with
 * their tokens, at most TD_CLIENT_MAX_OUTPUTS sequences. */
bool td_check_server_message(const Tandem__ServerMessage *m, char *why, size_t cap);

#endif
