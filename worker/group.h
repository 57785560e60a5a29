/* Worker groups: what the runtime and the follower share. Internal. */
#ifndef TD_WORKER_GROUP_H
#define TD_WORKER_GROUP_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/defaults.h"
#include "engine/engine.h"
#include "proto/wire.h"
#include "worker/worker.h"

typedef struct group_info {
  int world;
  char *endpoints[TD_GROUP_MAX_RANKS];
  uint8_t nccl_id[TD_NCCL_ID_BYTES];
  bool has_nccl_id;
  /* with keys: each rank's public key as the router authenticated it; the
   * group's sockets admit these and dial them */
  char keys[TD_GROUP_MAX_RANKS][TD_AUTH_KEY_Z85];
  bool has_keys;
} group_info;

/* CURVE on a group's own sockets (mirror, CPU communicator): server sockets
 * in the domain TD_AUTH_DOMAIN_GROUP of a context whose ZAP handler admits
 * the ranks' keys once the rendezvous named them (group_admit_ranks);
 * clients dial the key of the rank they connect to. NULL auth: plain. */
typedef struct group_keys {
  const td_auth *auth;
  td_zap *zap;          /* the context's ZAP handler */
  const group_info *gi; /* filled by the rendezvous, before any connect */
} group_keys;
td_status group_sec_server(void *arg, void *sock);
td_status group_sec_client(void *arg, void *sock, int peer);
/* After the rendezvous: the ranks it named may connect (with keys, their keys are required). */
td_status group_admit_ranks(const group_keys *k);

/* Joins `group` as `rank` through the router socket and waits for every
 * rank's endpoint (the router refuses a rank whose cross_mode differs
 * from its own, or whose encoder split, enc_rows, differs from the other
 * ranks'; encoder_states: an encoder group, whose states mode the
 * router takes as it takes a single-rank encoder's). */
td_status group_rendezvous(void *rsock, const char *group, int rank, int world, const char *endpoint,
                           const uint8_t *nccl_id, size_t nccl_len, td_cross_mode cross_mode, bool encoder_states,
                           bool enc_rows, int timeout_ms, volatile sig_atomic_t *stop, group_info *out);
/* Whether opts name the encode role alone (an encoder group pushes encoder states). */
bool group_encoder_only(const td_worker_opts *o);
void group_info_free(group_info *g);
/* The CPU communicator's endpoint bound at o->listen_host (in zmq_ctx with
 * CURVE when k->auth); *ep: what the other ranks dial (o->advertise's
 * address, at the port bound). */
td_status group_comm_bind(const td_worker_opts *o, group_keys *k, void *zmq_ctx, td_comm_zmq_boot **boot, char *ep,
                          size_t cap);
/* --host and --advertise: a wildcard bind needs an address to advertise,
 * which must be one (not a wildcard). Leader and followers alike. */
td_status group_check_addresses(const td_worker_opts *o);
/* rank 0's endpoint carries two: "COMM|MIRROR". */
void group_split_leader(const char *ep, char *comm, size_t ccap, char *mirror, size_t mcap);

/* What a 'K' mirror message ([kind][n][ids][blocks]) carries: this rank's
 * slices of self or cross blocks (their block size), or cross blocks'
 * states tails only (a states push: the same for every rank). */
enum { MIRROR_KV_SELF = 0, MIRROR_KV_CROSS = 1, MIRROR_KV_STATES = 2 };

/* Copies the part of a whole-model KV block (layout fl, elements of es
 * bytes) that holds layers [l0, l1) and heads [h0, h1) into dst (the same
 * layout, cut), and its states tail whole. */
void group_slice_block(const uint8_t *full, uint8_t *dst, const td_kv_layout *fl, size_t es, int l0, int l1, int h0,
                       int h1);
/* The layers and heads of a block of L layers x H heads that rank r of a
 * group holds (tp or pp ranks); the states tail is every rank's. */
void group_rank_range(int r, int tp, int pp, int L, int H, int *l0, int *l1, int *h0, int *h1);

#endif
