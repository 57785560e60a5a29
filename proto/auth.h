/* ZeroMQ CURVE for Tandem's sockets: a process's key pair from its secret
 * key file, the router's public key, the lists of public keys a server
 * admits, and the ZAP handler that checks them (docs/security.md).
 *
 * Key files are Z85 text, one key of 40 characters on the first line (a
 * trailing newline allowed); tandem-keygen writes them. A list file holds
 * public keys, one a line; blank lines and lines starting with '#' are
 * skipped. A NULL td_auth means "no keys configured": every function here
 * then leaves sockets as they are (plain TCP, as before). */
#ifndef TD_PROTO_AUTH_H
#define TD_PROTO_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/defaults.h"
#include "common/status.h"

#define TD_AUTH_KEY_Z85 41  /* 40 characters and the NUL */

/* ZAP domains: which list a server socket admits from. */
#define TD_AUTH_DOMAIN_CLIENTS "tandem-clients" /* the router's client socket: client keys */
#define TD_AUTH_DOMAIN_WORKERS "tandem-workers" /* the router's worker socket: worker keys */
#define TD_AUTH_DOMAIN_KV "tandem-kv"           /* a worker's KV socket: worker keys */
#define TD_AUTH_DOMAIN_GROUP "tandem-group"     /* a TP/PP group's own sockets: its ranks' keys (td_zap_set_group) */

typedef struct td_auth td_auth;

typedef struct td_auth_opts {
  const char *secret_file;      /* this process's secret key (required when any other is set) */
  const char *router_key_file;  /* the router's public key (clients, gateway, workers) */
  const char *worker_keys_file; /* public keys admitted as workers (router, and workers' KV sockets) */
  const char *client_keys_file; /* public keys admitted as clients (router) */
  const char *admin_keys_file;  /* of the client keys, those admitted for admin commands (router) */
} td_auth_opts;

/* True when libzmq was built with CURVE. */
bool td_auth_available(void);

/* Loads the files named in o. *out stays NULL when no file is named (no
 * authentication). TD_ERR_UNSUPPORTED when files are named but libzmq has
 * no CURVE; TD_ERR_INVALID / TD_ERR_FORMAT for missing or malformed files
 * (the message names the file and line, never a key's secret). */
td_status td_auth_create(const td_auth_opts *o, td_auth **out);
/* The same for a client of the router (client, gateway, admin): keys need the router's public key. */
td_status td_auth_create_client(const td_auth_opts *o, td_auth **out);
void td_auth_destroy(td_auth *a);

/* This process's public key (Z85); "" when a is NULL. */
const char *td_auth_public_key(const td_auth *a);

/* Makes sock a CURVE server whose connections the ZAP handler checks
 * against the domain's list. Call before bind. TD_OK and nothing done when a is NULL. */
td_status td_auth_server(const td_auth *a, void *sock, const char *domain);
/* Makes sock a CURVE client of the server whose public key is server_key
 * (Z85; NULL: the configured router key). Call before connect. */
td_status td_auth_client(const td_auth *a, void *sock, const char *server_key);

/* True when the Z85 public key is on the domain's list (admin: the admin list). */
bool td_auth_admits(const td_auth *a, const char *domain, const char *z85);
bool td_auth_is_admin(const td_auth *a, const char *z85);

/* The ZAP handler of one ZeroMQ context: a thread answering the context's
 * inproc://zeromq.zap.01 requests from a's lists. Start it before any
 * CURVE server socket of ctx binds; destroy it before zmq_ctx_term. A
 * refusal is logged at warning level with the domain, the peer's address
 * and its public key (never a secret). NULL a: *out = NULL, nothing started. */
typedef struct td_zap td_zap;
td_status td_zap_create(const td_auth *a, void *zmq_ctx, td_zap **out);
void td_zap_destroy(td_zap *z);
/* Logs failed handshakes on sock that never reach ZAP (a peer without
 * CURVE, a bad handshake) with the endpoint's name `what`, through a
 * socket monitor the handler's thread reads. Call from the socket's owner
 * before it binds; NULL z: nothing. */
td_status td_zap_watch(td_zap *z, void *sock, const char *what);
/* The keys admitted on TD_AUTH_DOMAIN_GROUP: a group's ranks, once its
 * rendezvous named them (at most TD_GROUP_MAX_RANKS; none before: every
 * connection is refused). Replaces the earlier set. */
td_status td_zap_set_group(td_zap *z, const char *const *keys, int n);
/* Counts (for tests and logs): handshakes refused. */
unsigned long td_zap_refused(const td_zap *z);

/* The authenticated public key (Z85) of a received message's sender, from
 * the ZAP handler's User-Id; false on a socket without CURVE. */
bool td_auth_msg_key(void *zmq_msg, char out[TD_AUTH_KEY_Z85]);

/* A KV reservation's sender token (TD_KV_TOKEN_BYTES bytes from the
 * kernel's random source): the router hands it to the receiver and to the
 * pusher it names, and the receiver admits pushes carrying it. */
td_status td_auth_token_new(uint8_t out[TD_KV_TOKEN_BYTES]);
/* Whether two tokens are equal, in time that does not depend on where they differ. */
bool td_auth_token_equal(const uint8_t a[TD_KV_TOKEN_BYTES], const uint8_t b[TD_KV_TOKEN_BYTES]);

/* Warns (once per call) when endpoint binds beyond this host (not
 * loopback, ipc or inproc) and a is NULL: anyone who reaches it is trusted. */
void td_auth_warn_open(const td_auth *a, const char *endpoint, const char *what);

/* A new key pair written as two files: public_path (mode 0644) and
 * secret_path (mode 0600), one Z85 key and a newline each. Refuses
 * (TD_ERR_INVALID) when either file exists: a key is never overwritten. */
td_status td_auth_keygen(const char *public_path, const char *secret_path);

/* Reads one Z85 key from the first line of a file into out (40 characters).
 * secret: the file is a secret key, refused when others can read it. */
td_status td_auth_read_key(const char *path, bool secret, char out[TD_AUTH_KEY_Z85]);

#endif
