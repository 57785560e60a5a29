/* The leader of a tensor / pipeline parallel group (rank 0), on the
 * compute thread: its communicator, and the mirror channel that carries
 * every model call ('R'), arrived KV slices ('K'), heartbeats ('H') and the
 * stop ('S') to the followers, which replay them in order (follower.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "worker/internal.h"

static td_status mirror_publish(void *ctx, const void *bytes, size_t len) {
  td_worker *w = ctx;
  char *buf = malloc(len + 1);
  if (!buf) return td_err(TD_ERR_NOMEM, "out of memory");
  buf[0] = 'R';
  memcpy(buf + 1, bytes, len);
  td_status s = TD_OK;
  for (int r = 1; r < w->world && s == TD_OK; r++) {
    char id[32];
    snprintf(id, sizeof id, "f-%d", r);
    if (zmq_send(w->msock, id, strlen(id), ZMQ_SNDMORE) < 0 || zmq_send(w->msock, buf, len + 1, 0) < 0)
      s = td_err(TD_ERR_PEER, "mirror to rank %d: %s", r, zmq_strerror(zmq_errno()));
  }
  free(buf);
  w->last_mirror_hb = td_now_ms();
  return s;
}

void w_mirror_all(td_worker *w, const char *what) {
  for (int r = 1; r < w->world; r++) {
    char id[32];
    snprintf(id, sizeof id, "f-%d", r);
    zmq_send(w->msock, id, strlen(id), ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(w->msock, what, 1, ZMQ_DONTWAIT);
  }
}

/* Followers' messages (hello, heartbeats); a heartbeat to them when idle. */
int w_mirror_tick(td_worker *w) {
  int hellos = 0;
  for (;;) {
    zmq_msg_t id, body;
    zmq_msg_init(&id);
    zmq_msg_init(&body);
    if (zmq_msg_recv(&id, w->msock, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&id);
      zmq_msg_close(&body);
      break;
    }
    zmq_msg_recv(&body, w->msock, 0);
    if (zmq_msg_size(&body) && ((char *)zmq_msg_data(&body))[0] == 'Y') hellos++;
    zmq_msg_close(&id);
    zmq_msg_close(&body);
  }
  if (td_now_ms() - w->last_mirror_hb > TD_GROUP_HEARTBEAT_MS) {
    w_mirror_all(w, "H");
    w->last_mirror_hb = td_now_ms();
  }
  return hellos;
}

void w_mirror_send(td_worker *w, int rank, const void *msg, size_t len) {
  char id[32];
  snprintf(id, sizeof id, "f-%d", rank);
  zmq_send(w->msock, id, strlen(id), ZMQ_SNDMORE);
  zmq_send(w->msock, msg, len, 0);
}

/* A group leader's communicator and mirror, before the model loads. */
td_status w_leader_init(td_worker *w, td_model_opts *mo) {
  char comm_ep[256], mirror_ep[256];
  group_split_leader(w->gi.endpoints[0], comm_ep, sizeof comm_ep, mirror_ep, sizeof mirror_ep);
  if (w->o.device == TD_BACKEND_CPU) {
    const char *eps[TD_GROUP_MAX_RANKS];
    for (int r = 0; r < w->world; r++) eps[r] = r ? w->gi.endpoints[r] : comm_ep;
    td_status s = td_comm_zmq_connect(w->boot, 0, w->world, eps, TD_GROUP_CONNECT_TIMEOUT_MS, &w->comm);
    w->boot = NULL;
    TD_TRY(s);
  } else {
    TD_TRY(td_comm_create_nccl(w->b, w->nccl_id, 0, w->world, &w->comm));
  }
  td_backend_set_comm(w->b, w->comm);
  if (w->o.tp > 1) {
    mo->tp_size = w->o.tp;
    mo->enc_rows = w->o.enc_rows;
  } else {
    mo->pp_size = w->o.pp;
    mo->pp_sets = w->o.pp_sets;
  }
  return TD_OK;
}

/* Every follower says hello on the mirror before the first call. */
td_status w_leader_wait_followers(td_worker *w) {
  int hellos = 0;
  int64_t end = td_now_ms() + TD_GROUP_MIRROR_TIMEOUT_MS;
  while (hellos < w->world - 1 && td_now_ms() < end) {
    zmq_pollitem_t it = {.socket = w->msock, .events = ZMQ_POLLIN};
    zmq_poll(&it, 1, TD_GROUP_HEARTBEAT_MS);
    hellos += w_mirror_tick(w);
  }
  if (hellos < w->world - 1)
    return td_err(TD_ERR_TIMEOUT, "group %s: %d of %d followers reached the mirror", w->o.group, hellos, w->world - 1);
  td_model_mirror mir = {.publish = mirror_publish, .ctx = w};
  td_model_set_mirror(w->m, &mir);
  return TD_OK;
}
