/* What the router's files share: the router's state (workers, groups,
 * requests, the queue) and the calls between its parts:
 *   loop.c      sockets and timers on a td_loop, message dispatch, lifecycle
 *   workers.c   the registry: registration, heartbeats, death, health
 *   admin.c     an operator's requests: list, drain, undrain, remove
 *   groups.c    the TP/PP group rendezvous and its ranks' liveness
 *   requests.c  admission, the queue, placement, jobs, retries, deadlines
 *   stream.c    a placed request's progress: reservations, stages, tokens, results
 *   admit.c, placement.c: pure decisions (router/policy.h)
 * Private to router/. */
#ifndef TD_ROUTER_INTERNAL_H
#define TD_ROUTER_INTERNAL_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include <uthash.h>

#include "common/defaults.h"
#include "common/evloop.h"
#include "common/vec.h"
#include "metrics/metrics.h"
#include "proto/wire.h"
#include "proto/link.h"
#include "router/policy.h"
#include "router/router.h"

typedef struct worker {
  td_place_worker pl; /* first: the pool hands &w->pl to placement, which maps back */
  char id[TD_WIRE_MAX_ID + 1];            /* its id (registration's worker_id) */
  size_t id_len;
  uint8_t route[TD_WIRE_MAX_ID];          /* its connection's routing identity */
  size_t route_len;
  int self_blocks;
  char *device;
  char *version;                          /* its build (WorkerInfo.version) */
  char *group;                            /* its TP/PP group ("" alone) */
  uint32_t pid;
  char key[TD_AUTH_KEY_Z85];              /* its connection's CURVE public key ("" without keys) */
  bool drain_asked;                       /* an operator drains it (router/admin.c) */
  int64_t last_seen;
  Tandem__Cluster__Load load;
  UT_hash_handle hh; /* by id */
  UT_hash_handle hr; /* by route */
} worker;

typedef enum rtr_role { RTR_DECODE, RTR_ENCODE, RTR_PREFILL } rtr_role;

typedef enum stage { ST_QUEUED, ST_RESERVING, ST_ENCODING, ST_PREFILLING, ST_DECODING } stage;
extern const char *const rtr_stage_names[];

/* A request's audio features as a frame of their own: as the client sent
 * them (AudioFeatures.values_in_frame) or as the router computed them from
 * its audio; held once, forwarded to the encoding worker by reference on
 * every attempt. While held, the request's AudioFeatures.values points into
 * it, so that admission reads the values as if inline; the pointer is taken
 * back before the message is freed (rtr_client_msg_free). */
typedef struct rtr_feat_frame {
  zmq_msg_t m;
  bool has;
} rtr_feat_frame;

typedef struct rreq {
  uint64_t rid;          /* (serial << 8) | attempt: changes with every attempt */
  uint64_t serial;
  uint8_t client[TD_WIRE_MAX_ID];
  size_t client_len;
  char *cid;             /* the client's request id */
  char *ckey;            /* client identity + id, for cancel */
  Tandem__ClientMessage *msg; /* owns the GenerateRequest */
  Tandem__GenerateRequest *g;
  rtr_feat_frame feat;    /* the features' values as the client sent them, in a frame of their own (rtr_feat_adopt) */
  td_req_shape sh;
  bool multi;            /* n > 1 or beams: no resume from streamed tokens */
  stage st;
  int attempts;
  char dec_w[TD_WIRE_MAX_ID + 1], enc_w[TD_WIRE_MAX_ID + 1], pre_w[TD_WIRE_MAX_ID + 1];
  char avoid_dec[TD_WIRE_MAX_ID + 1]; /* the decode worker that failed its last attempt (td_place_req.avoid_dec) */
  bool local_encode, with_prefill;
  bool local_enc_held;   /* a local encode counts in its decode worker's enc_pending */
  bool decoding_counted; /* counted in its decode worker's `decoding` */
  Tandem__Cluster__Reserved *dres, *pres; /* decode / prefill reservations */
  /* this attempt's sender tokens (new each attempt): the encoder's into the
   * decode and prefill workers' cross blocks, the prefill worker's into the
   * decode worker's self blocks */
  uint8_t tok_cross[TD_KV_TOKEN_BYTES], tok_pcross[TD_KV_TOKEN_BYTES], tok_self[TD_KV_TOKEN_BYTES];
  bool encoded, prefilled;
  /* tokens already streamed to the client (first sequence) and their
   * log-probabilities, for resuming */
  td_i32vec streamed;
  td_f32vec streamed_lp;
  int64_t t_arrival, t_stage, deadline;
  int64_t t_queued;      /* when this attempt entered the queue */
  size_t held;           /* its client message's bytes, counted in r->held_bytes */
  int64_t t_reserved, t_encode_sent, t_encoded; /* stage times for Timings (0: not yet) */
  int64_t t_placed_ns, t_first_ns; /* the same in ns (a first token is often under a millisecond away) */
  double encode_ms, prefill_ms;
  /* streamed text: one detokenizer a sequence, made at its first chunk */
  td_detok **detok;
  int n_detok;
  /* Whisper's language detection: a first attempt of one greedy step over the
   * language tokens, then the request itself with the language it gave */
  bool detecting;
  Tandem__SamplingParams *user_sampling; /* the request's own, while detecting */
  Tandem__SamplingParams detect_sp;
  uint32_t user_max_new;
  bool user_stream;
  int free_attempts;   /* attempts max_attempts does not count (detection's) */
  UT_hash_handle hh;   /* by rid */
  UT_hash_handle hc;   /* by ckey */
} rreq;

typedef struct group_rv group_rv;

/* A connection that joined a group, by its routing identity: a peer is one
 * rank of one group, so a flood of joins from one peer holds one slot, and
 * a follower's heartbeat finds its group without a scan. */
typedef struct group_rank {
  uint8_t route[TD_WIRE_MAX_ID];
  size_t route_len;
  group_rv *g;
  int rank;
  UT_hash_handle hh;
} group_rank;

/* A worker group's rendezvous (GroupJoin / GroupInfo). */
struct group_rv {
  char name[TD_GROUP_MAX_NAME + 1];
  int world;
  char *endpoints[TD_GROUP_MAX_RANKS];
  uint8_t ids[TD_GROUP_MAX_RANKS][TD_WIRE_MAX_ID];
  size_t id_lens[TD_GROUP_MAX_RANKS];
  char keys[TD_GROUP_MAX_RANKS][TD_AUTH_KEY_Z85]; /* with keys: each rank's, as it joined (GroupInfo.keys) */
  uint8_t nccl_id[TD_GROUP_MAX_NCCL_ID];
  size_t nccl_len;
  int joined;
  bool complete;
  bool enc_rows; /* the first rank's encoder split (GroupJoin.encoder_split): every rank must agree */
  /* a rank was refused: the group cannot form; every rank hears why once */
  char *error;
  bool told[TD_GROUP_MAX_RANKS];
  int64_t created;
  int64_t completed;                /* when every rank had joined */
  int64_t seen[TD_GROUP_MAX_RANKS]; /* followers' last heartbeat; 0: none since the rendezvous */
  group_rank *members[TD_GROUP_MAX_RANKS]; /* the ranks that joined, in r->members */
  UT_hash_handle hh;
};

/* A token chunk held back while a worker's TokensBatch is handled, so that
 * each client gets one message for the batch (router/stream.c). */
typedef struct chunk_out {
  uint8_t client[TD_WIRE_MAX_ID];
  size_t client_len;
  char *cid;                 /* owned */
  char *text;                /* owned, or NULL */
  Tandem__TokenChunk chunk;  /* its tokens point into the worker's message */
} chunk_out;

typedef struct rtr_metrics rtr_metrics;
typedef struct probe probe;

struct td_router {
  td_router_opts o;
  rtr_metrics *metrics;           /* router/metrics.c */
  td_place_opts place_opts;
  bool batching;                  /* chunks go to the outbox (a TokensBatch is being handled) */
  chunk_out *outbox;
  int n_outbox, cap_outbox;
  void *ctx, *csock, *wsock;
  /* the local links (loop.c): their servers, and the peers connected */
  td_link_server *clink_srv, *wlink_srv;
  struct rtr_link **links;
  int n_links, cap_links;
  uint64_t next_link;
  td_loop *loop;                  /* td_router_run's */
  td_zap *zap; /* NULL without keys */
  bool own_ctx;
  volatile sig_atomic_t *stop;    /* td_router_run's */
  worker *workers;                /* by id */
  worker *by_route;               /* the same, by routing identity */
  struct id_key *id_keys;         /* with keys: each worker id's key, kept for the router's life */
  int n_id_keys;
  td_place_worker **pool;         /* the same workers in registration order */
  int n_pool, cap_pool;
  group_rv *groups;
  group_rank *members;          /* every rank of every group, by routing identity */
  rreq *by_rid, *by_ckey;
  td_ptrvec queue;                /* rreq waiting for placement, first come first served */
  td_ptrvec parked;               /* rtr_parked: requests that came before any worker told the model */
  int in_flight;
  uint64_t next_serial;
  uint64_t hb_seq;
  int64_t last_tick;              /* when the heartbeat timer last ran (ms) */
  char wait_why[256];             /* why the queue's head waits */
  bool wait_missing;              /* ... for a role no live worker has (td_placement.missing) */
  long long held_bytes;           /* client messages of the requests held (queued and in flight) */
  char client_adv[300], worker_adv[300]; /* the endpoints as clients and workers dial them (--advertise) */
  /* registrations waiting for the check of the KV endpoint they advertise (probe.c) */
  probe *probes;                  /* by routing identity */
  int n_probes;
  int probe_fd;                   /* an epoll set of their connects (-1: none yet) */
  /* the served model, from the first worker */
  bool have_model;
  int32_t model_start_token; /* the model's decoder start token (a resumed prompt's first) */
  int32_t model_eos[TD_ROUTER_MAX_EOS]; /* the tokens that end a sequence */
  int n_model_eos;
  Tandem__ModelInfo model;
  char *model_type, *model_name;
  int block_size;
};

/* ---- loop.c: sending */
td_status rtr_send_worker(td_router *r, const worker *w, Tandem__Cluster__RouterMessage *m);
/* The same with a second frame sent by reference (a job's features frame; NULL: none). */
td_status rtr_send_worker_extra(td_router *r, const worker *w, Tandem__Cluster__RouterMessage *m, zmq_msg_t *extra);
/* to a peer of the worker socket that may not be registered */
td_status rtr_send_peer(td_router *r, const uint8_t *id, size_t id_len, Tandem__Cluster__RouterMessage *m);
void rtr_send_client(td_router *r, const uint8_t *id, size_t id_len, Tandem__ServerMessage *m);
void rtr_client_error(td_router *r, const uint8_t *id, size_t id_len, const char *rid, Tandem__ErrorCode code,
                      const char *msg);

/* ---- workers.c */
worker *rtr_find_worker(td_router *r, const char *id);
worker *rtr_find_route(td_router *r, const uint8_t *route, size_t len);
int rtr_count_role(const td_router *r, rtr_role role);
bool rtr_cross_mode_matches(const td_router *r, const char *mode, char *why, size_t cap);
/* key: the connection's authenticated public key (NULL without CURVE). The
 * registration may wait for the check of the KV endpoint it advertises
 * (probe.c): then m's Register is taken from it. */
void rtr_on_register(td_router *r, const uint8_t *id, size_t id_len, const char *key, Tandem__Cluster__WorkerMessage *m);
/* The registration of a worker whose KV endpoint answered the check (or
 * needs none): the checks again, then the registry. */
void rtr_register_checked(td_router *r, const uint8_t *id, size_t id_len, const char *key,
                          Tandem__Cluster__Register *reg);
/* A refused registration: logged, and the worker told why. */
void rtr_register_refuse(td_router *r, const uint8_t *id, size_t id_len, const char *wid, const char *why);
void rtr_on_heartbeat(td_router *r, worker *w, const Tandem__Cluster__Heartbeat *hb);
/* A worker left (deregistered, silent, restarted, its group failed): its
 * requests are retried elsewhere. */
void rtr_worker_gone(td_router *r, worker *w, const char *why);
/* Timer: heartbeats to every worker; the silent ones are dead. */
int rtr_heartbeat_tick(td_loop *l, void *ctx);
/* Called by the timers that judge silence: when the router's own loop did
 * not run for longer than a worker may be silent (stopped, swapped out),
 * that silence was the router's, and declaring its workers dead would fail
 * the requests it holds: every worker and group rank gets a full period
 * from t. */
void rtr_stall_check(td_router *r, int64_t t);
void rtr_health(td_router *r, const uint8_t *id, size_t id_len);
/* Fills h with the cluster's state and every worker's; *ws and *wp hold the
 * workers' entries (free both after sending, even on failure). */
void rtr_health_fill(td_router *r, Tandem__HealthResponse *h, Tandem__WorkerStatus **ws, Tandem__WorkerStatus ***wp);
void rtr_workers_free(td_router *r);
void rtr_id_keys_free(td_router *r);
/* With keys, a name (a worker id, a group's rank) belongs to the key that
 * first used it, for the router's life; NULL key (no CURVE): true. */
bool rtr_id_key_ok(td_router *r, const char *name, const char *key, char *why, size_t cap);

/* ---- probe.c: the KV endpoint a registering worker advertises, dialled
 * before it is admitted (docs/deploy.md) */
/* Starts the check of reg's endpoint: true when it took the registration
 * (kept until the endpoint answers, or refused and freed already); false:
 * the caller goes on with it at once (no check: off, no endpoint, a host
 * name; or connected at once), unless *answered (too many checks under
 * way: the worker's retry comes back). */
bool rtr_probe_start(td_router *r, const uint8_t *id, size_t id_len, const char *key, Tandem__Cluster__Register *reg,
                     bool *answered);
/* Whether a check of this connection's registration is under way. */
bool rtr_probe_pending(td_router *r, const uint8_t *id, size_t id_len);
/* The loop: the connects that ended (the epoll set turned readable). */
void rtr_probes_ready(td_loop *l, void *ctx);
/* Timer: checks past their time fail. */
int rtr_probes_tick(td_loop *l, void *ctx);
void rtr_probes_free(td_router *r);

/* ---- admin.c: an operator's requests (tandem-admin) */
/* Whether this client connection may send admin requests. The one check
 * every admin request passes: without CURVE every client; with keys, the
 * clients whose key is on --admin-keys (none without that list). */
/* key: the client's authenticated public key (NULL without CURVE) */
bool rtr_admin_allowed(const td_router *r, const char *key);
void rtr_on_admin(td_router *r, const uint8_t *id, size_t id_len, const char *key, const Tandem__AdminRequest *a);

/* ---- groups.c */
/* key: the joining connection's authenticated public key (NULL without CURVE) */
void rtr_on_group_join(td_router *r, const uint8_t *id, size_t id_len, const char *key, Tandem__Cluster__GroupJoin *j);
/* The group whose follower rank has this identity (*rank set), or NULL. */
group_rv *rtr_group_of_follower(td_router *r, const uint8_t *id, size_t id_len, int *rank);
/* Timer: silent ranks fail their group; rendezvous that never complete expire. */
int rtr_groups_tick(td_loop *l, void *ctx);
/* Every rank of a running group that heartbeats counts as heard at t (rtr_stall_check). */
void rtr_groups_heard_all(td_router *r, int64_t t);
void rtr_groups_free(td_router *r);

/* ---- requests.c */
/* A client's request that came before the router knew the served model (it
 * just started: its workers register again after it), so that admission
 * cannot check it yet: it waits --capacity-wait-ms for a worker. */
typedef struct rtr_parked {
  uint8_t client[TD_WIRE_MAX_ID];
  size_t client_len;
  Tandem__ClientMessage *msg;
  rtr_feat_frame feat;
  size_t bytes;
  int64_t t;
} rtr_parked;
/* Admits the parked requests once a worker told the model (before placing). */
void rtr_unpark(td_router *r);
/* Fails them all (the router stops). */
void rtr_parked_fail(td_router *r, const char *why);
/* bytes: the client message's, held against max_held_bytes while the request lives */
/* feat: the message's features frame (moved from; NULL: none); bytes: the message's and the frame's */
void rtr_on_generate(td_router *r, const uint8_t *cid, size_t cid_len, Tandem__ClientMessage *msg, size_t bytes,
                     zmq_msg_t *feat);
/* Moves a features frame into dst and points the request's features at it. */
void rtr_feat_adopt(Tandem__ClientMessage *msg, rtr_feat_frame *dst, zmq_msg_t *src);
void rtr_feat_adopt_msg(Tandem__GenerateRequest *g, rtr_feat_frame *dst, zmq_msg_t *src);
/* Frees a held client message and its features frame. */
void rtr_client_msg_free(Tandem__ClientMessage *msg, rtr_feat_frame *feat);
void rtr_on_cancel(td_router *r, const uint8_t *cid, size_t cid_len, const Tandem__CancelRequest *c);
/* The request of this rid, or NULL (then the worker is told to let go of it). */
rreq *rtr_req_for(td_router *r, uint64_t rid, const worker *w);
/* Ends a request with an error to its client; workers are told to free it. */
void rtr_req_fail(td_router *r, rreq *q, Tandem__ErrorCode code, const char *msg);
/* Gives a request another attempt on other workers, or fails it. */
void rtr_req_retry(td_router *r, rreq *q, const char *why);
/* Whether a failure now hits the request's KV on its way to the decode
 * worker (encoding, prefilling: computed, pushed, awaited). */
bool rtr_req_kv_loading(const rreq *q);
/* A failure of that KV: another attempt (recompute) or the request's end
 * (--kv-load-failure fail). */
void rtr_req_kv_failed(td_router *r, rreq *q, const char *why);
/* Puts a request back at the queue's head for its next attempt (a new rid);
 * `release`: its holds on the workers of this attempt go first. */
void rtr_req_requeue(td_router *r, rreq *q, bool release);
/* Ends a request quietly (its result or error was sent). */
void rtr_req_free(td_router *r, rreq *q);
/* A worker's part in the request is over: its hold on the worker goes. */
void rtr_role_done(td_router *r, rreq *q, rtr_role role);
/* A local encode is over (the first token came, or the request left the
 * worker): its positions leave the worker's encoder queue. */
void rtr_local_encode_done(td_router *r, rreq *q);
/* The request's encoding is over: it counts as decoding on its decode worker. */
void rtr_mark_decoding(td_router *r, rreq *q);
void rtr_send_encode(td_router *r, rreq *q);
void rtr_send_prefill(td_router *r, rreq *q);
/* Before sleeping: places the queue's requests, first come first served. */
bool rtr_place_queue(td_loop *l, void *ctx);
/* Timer: deadlines and stage timeouts. */
int rtr_requests_tick(td_loop *l, void *ctx);

/* ---- text.c: the front end at the router (text, audio, detokenizing) */
/* Converts a request's text or audio in place into input_ids, or features
 * and a decoder prompt, after td_admit_inputs; ERROR_NONE when it needs
 * nothing or went well, else the code with the reason in err. *detect: the
 * audio names no language (the prompt holds a stand-in of the same length):
 * the request starts with language detection (rtr_detect_begin). Features
 * computed from audio go into *feat, which g's then point into. */
Tandem__ErrorCode rtr_convert_input(td_router *r, Tandem__GenerateRequest *g, rtr_feat_frame *feat, bool *detect,
                                    char *err, size_t cap);
/* Turns an admitted request into its detection step; false when it cannot. */
bool rtr_detect_begin(td_router *r, rreq *q);
/* The detection step's result: the request gets its language and goes back
 * to the queue, or fails. */
void rtr_detect_done(td_router *r, rreq *q, Tandem__SequenceOutput **outs, size_t n_out);
/* A request that was detecting gets its own sampling back (before it is freed). */
void rtr_detect_undo(rreq *q);
/* The text a streamed chunk of sequence `seq` adds (malloc'ed, "" for none),
 * or NULL without a tokenizer or when it cannot be decoded. */
char *rtr_stream_text(td_router *r, rreq *q, uint32_t seq, const int32_t *tokens, size_t n);
/* Sends each sequence's held-back text (a stream's end). */
void rtr_stream_text_finish(td_router *r, rreq *q);
/* Forgets the streamed text: sequences restart (a retry of samples / beams). */
void rtr_stream_text_reset(rreq *q);
/* What rtr_result_text made for a result's outputs. */
typedef struct rtr_result_extras {
  size_t n;
  char **texts;
  Tandem__Segment **segs;      /* per output: its segments (timestamps) */
  Tandem__Segment ***seg_ptrs;
} rtr_result_extras;
/* Sets each output's text (decode, special tokens skipped) where the router
 * has a tokenizer, and its segments when the request asked for timestamps;
 * rtr_result_extras_free after sending. */
void rtr_result_text(td_router *r, const rreq *q, Tandem__SequenceOutput **outs, size_t n, rtr_result_extras *x);
void rtr_result_extras_free(rtr_result_extras *x, Tandem__SequenceOutput **outs);

/* ---- stream.c: a worker's news of a request it holds */
void rtr_on_progress(td_router *r, worker *w, Tandem__Cluster__WorkerMessage *m);
/* Sends the request's result (a single sequence's earlier attempts' tokens
 * first) and ends it. */
/* decode_ms, worker_first_ms: the decode worker's reports (0: none) */
void rtr_req_result(td_router *r, rreq *q, Tandem__SequenceOutput **outs, size_t n_out, double decode_ms,
                    double worker_first_ms);

/* ---- metrics.c (docs/metrics.md) */
/* The registry, and the /metrics server when opts.metrics asks for it. */
td_status rtr_metrics_create(td_router *r);
void rtr_metrics_destroy(td_router *r);
/* The server's port (0: none). */
int rtr_metrics_port(const td_router *r);
/* Timer: renders the text and publishes it to the server. */
int rtr_metrics_tick(td_loop *l, void *ctx);
/* A result was sent (outs: as sent, earlier attempts' tokens included). */
void rtr_metrics_result(td_router *r, const rreq *q, Tandem__SequenceOutput *const *outs, size_t n_out,
                        const Tandem__Timings *tm);
/* A request ended with this error, or was refused at admission. */
void rtr_metrics_failure(td_router *r, Tandem__ErrorCode code);
void rtr_metrics_retry(td_router *r);
/* A worker registered (up) or left. */
void rtr_metrics_worker(td_router *r, const worker *w, bool up);

#endif
