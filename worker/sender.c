/* What encoder and prefill workers share: pushing finished KV blocks to the
 * workers that reserved them, and reporting when every push is over. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/internal.h"

/* All pushes of a sender job are over: report and free its blocks. */
static void sender_finish(td_worker *w, job *j) {
  w_release_out_blocks(w, j);
  if (j->push_failed) {
    w_send_failed(w, j->rid, TD_ERR_PEER, j->push_error, true);
  } else if (j->role == ROLE_ENCODE) {
    Tandem__Cluster__EncodeDone d = TANDEM__CLUSTER__ENCODE_DONE__INIT;
    d.rid = j->rid;
    d.ms = j->compute_ms;
    Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
    m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_ENCODE_DONE;
    m.encode_done = &d;
    w_send(w, &m);
  } else {
    Tandem__Cluster__PrefillDone d = TANDEM__CLUSTER__PREFILL_DONE__INIT;
    d.rid = j->rid;
    d.first_token = -1;
    d.ms = j->compute_ms;
    Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
    m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_PREFILL_DONE;
    m.prefill_done = &d;
    w_send(w, &m);
  }
  w_job_drop(w, j);
}

void sender_on_pushed(td_worker *w, job *j, bool ok, const char *error) {
  j->pushes_pending--;
  if (!ok && !j->push_failed) {
    j->push_failed = true;
    snprintf(j->push_error, sizeof j->push_error, "KV push failed: %s", error ? error : "?");
  }
  if (j->pushes_pending <= 0) sender_finish(w, j);
}

/* Pushes the job's blocks to each target (over UCX straight from the pool
 * where both sides can, else the host copy over ZeroMQ); finishes when
 * none could start. */
void w_push_all(td_worker *w, job *j, Tandem__Cluster__KvTarget **targets, size_t n_targets) {
  for (size_t i = 0; i < n_targets; i++) {
    Tandem__Cluster__KvTarget *t = targets[i];
    if ((int)t->n_blocks != j->n_out) {
      j->push_failed = true;
      snprintf(j->push_error, sizeof j->push_error, "target %s reserved %zu blocks for %d", t->worker_id,
               t->n_blocks, j->n_out);
      continue;
    }
    if (j->n_out > 4096 || !j->out_blocks) {
      j->push_failed = true;
      snprintf(j->push_error, sizeof j->push_error, "%d blocks to push", j->n_out);
      continue;
    }
    kv_route r;
    w_kv_route(w, t, j->out_cross, &r);
    td_status s;
    if (r.path == KV_UCX) {
      s = uxfer_push(w_uxfer(w), j->rid, j->role, t->worker_id, r.kvx, r.kvx_len, t->reservation, j->out_cross,
                     j->out_blocks, t->blocks, j->n_out);
    } else if (r.path == KV_ZMQ && j->out_host) {
      const void *src[4096];
      for (int b = 0; b < j->n_out; b++) src[b] = j->out_host + (size_t)b * j->out_bb;
      s = xfer_push(w_xfer(w), j->rid, j->role, (const uint8_t *)r.zmq, strlen(r.zmq), t->reservation, j->out_cross,
                    src, j->out_bb, t->blocks, j->n_out);
    } else {
      /* no host copy was made when the job came: UCX looked possible then */
      s = td_err(TD_ERR_UNSUPPORTED, "%s", r.path == KV_ZMQ ? "the blocks are not in host memory" : r.why);
    }
    kv_route_free(&r);
    if (s == TD_OK) {
      j->pushes_pending++;
    } else if (!j->push_failed) {
      j->push_failed = true;
      snprintf(j->push_error, sizeof j->push_error, "KV push to %s: %s", t->worker_id, td_errmsg());
    }
  }
  if (j->pushes_pending == 0) sender_finish(w, j);
}
