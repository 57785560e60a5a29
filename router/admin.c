/* An operator's requests (tandem-admin, ClientMessage.admin): list the
 * workers, drain one (nothing new is placed there; it finishes its
 * requests, deregisters and exits 0), take a drain back, or remove one at
 * once (its requests are retried on other workers, as when a worker dies).
 * Every request passes rtr_admin_allowed first. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "router/internal.h"

bool rtr_admin_allowed(const td_router *r, const char *key) {
  if (!r->o.auth) return true; /* no keys: every client, as every client may reach the socket */
  return key && td_auth_is_admin(r->o.auth, key);
}

static const char *action_name(Tandem__AdminAction a) {
  switch (a) {
    case TANDEM__ADMIN_ACTION__ADMIN_LIST: return "list";
    case TANDEM__ADMIN_ACTION__ADMIN_DRAIN: return "drain";
    case TANDEM__ADMIN_ACTION__ADMIN_UNDRAIN: return "undrain";
    case TANDEM__ADMIN_ACTION__ADMIN_REMOVE: return "remove";
    default: return "?";
  }
}

static void reply(td_router *r, const uint8_t *id, size_t id_len, const Tandem__AdminRequest *a, const char *msg,
                  Tandem__HealthResponse *h) {
  Tandem__AdminReply ar = TANDEM__ADMIN_REPLY__INIT;
  ar.action = a->action;
  ar.worker_id = a->worker_id ? a->worker_id : "";
  ar.message = (char *)msg;
  ar.health = h;
  Tandem__ServerMessage sm = TANDEM__SERVER_MESSAGE__INIT;
  sm.request_id = a->request_id ? a->request_id : "";
  sm.body_case = TANDEM__SERVER_MESSAGE__BODY_ADMIN;
  sm.admin = &ar;
  rtr_send_client(r, id, id_len, &sm);
}

static void refuse(td_router *r, const uint8_t *id, size_t id_len, const Tandem__AdminRequest *a,
                   Tandem__ErrorCode code, const char *msg) {
  TD_WARN("admin %s %s refused: %s", action_name(a->action), a->worker_id ? a->worker_id : "", msg);
  rtr_client_error(r, id, id_len, a->request_id, code, msg);
}

/* Live decode workers other than w that are not draining. */
static int other_decoders(const td_router *r, const worker *w) {
  int n = 0;
  for (int i = 0; i < r->n_pool; i++) n += r->pool[i] != &w->pl && r->pool[i]->dec && !r->pool[i]->draining;
  return n;
}

void rtr_on_admin(td_router *r, const uint8_t *id, size_t id_len, const char *key, const Tandem__AdminRequest *a) {
  if (a->request_id && strlen(a->request_id) > TD_ROUTER_MAX_REQUEST_ID) {
    char msg[128];
    snprintf(msg, sizeof msg, "request_id of %zu bytes exceeds %d", strlen(a->request_id), TD_ROUTER_MAX_REQUEST_ID);
    rtr_client_error(r, id, id_len, "", TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, msg);
    return;
  }
  if (!rtr_admin_allowed(r, key)) {
    refuse(r, id, id_len, a, TANDEM__ERROR_CODE__ERROR_PERMISSION_DENIED,
           "this client may not send admin requests (its key is not on the router's --admin-keys list)");
    return;
  }
  char msg[512];
  if (a->action == TANDEM__ADMIN_ACTION__ADMIN_LIST) {
    Tandem__HealthResponse h;
    Tandem__WorkerStatus *ws, **wp;
    rtr_health_fill(r, &h, &ws, &wp);
    snprintf(msg, sizeof msg, "%zu workers", h.n_workers);
    reply(r, id, id_len, a, msg, &h);
    free(ws);
    free(wp);
    return;
  }
  const char *wid = a->worker_id ? a->worker_id : "";
  if (a->action != TANDEM__ADMIN_ACTION__ADMIN_DRAIN && a->action != TANDEM__ADMIN_ACTION__ADMIN_UNDRAIN &&
      a->action != TANDEM__ADMIN_ACTION__ADMIN_REMOVE) {
    snprintf(msg, sizeof msg, "unknown admin action %d", (int)a->action);
    refuse(r, id, id_len, a, TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT, msg);
    return;
  }
  worker *w = *wid && strlen(wid) <= TD_WIRE_MAX_ID ? rtr_find_worker(r, wid) : NULL;
  if (!w) {
    snprintf(msg, sizeof msg, "no worker '%.*s' is registered (tandem-admin list shows the workers)", TD_WIRE_MAX_ID,
             wid);
    refuse(r, id, id_len, a, TANDEM__ERROR_CODE__ERROR_NOT_FOUND, msg);
    return;
  }
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  switch (a->action) {
    case TANDEM__ADMIN_ACTION__ADMIN_DRAIN: {
      if (w->drain_asked || w->pl.draining) {
        snprintf(msg, sizeof msg, "worker %s is already draining (%s)", w->id,
                 w->drain_asked ? "an operator drains it" : "it was told to stop");
        refuse(r, id, id_len, a, TANDEM__ERROR_CODE__ERROR_FAILED_PRECONDITION, msg);
        return;
      }
      w->drain_asked = w->pl.draining = true;
      Tandem__Cluster__Drain d = TANDEM__CLUSTER__DRAIN__INIT;
      m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DRAIN;
      m.drain = &d;
      (void)rtr_send_worker(r, w, &m);
      snprintf(msg, sizeof msg, "worker %s is draining: nothing new goes there; it finishes its %d requests, "
               "deregisters and exits%s", w->id, w->pl.jobs,
               w->pl.dec && !other_decoders(r, w) ? " (no other decode worker serves: new requests wait for one)" : "");
      TD_INFO("admin: %s", msg);
      reply(r, id, id_len, a, msg, NULL);
      return;
    }
    case TANDEM__ADMIN_ACTION__ADMIN_UNDRAIN: {
      if (w->load.stopping) {
        snprintf(msg, sizeof msg, "worker %s drains on its own (it was told to stop); it will leave", w->id);
        refuse(r, id, id_len, a, TANDEM__ERROR_CODE__ERROR_FAILED_PRECONDITION, msg);
        return;
      }
      if (!w->drain_asked) {
        snprintf(msg, sizeof msg, "worker %s is not draining", w->id);
        refuse(r, id, id_len, a, TANDEM__ERROR_CODE__ERROR_FAILED_PRECONDITION, msg);
        return;
      }
      w->drain_asked = w->pl.draining = false;
      Tandem__Cluster__Undrain u = TANDEM__CLUSTER__UNDRAIN__INIT;
      m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_UNDRAIN;
      m.undrain = &u;
      (void)rtr_send_worker(r, w, &m);
      snprintf(msg, sizeof msg, "worker %s serves again", w->id);
      TD_INFO("admin: %s", msg);
      reply(r, id, id_len, a, msg, NULL);
      return;
    }
    default: { /* remove */
      int jobs = w->pl.jobs;
      char wname[TD_WIRE_MAX_ID + 1];
      snprintf(wname, sizeof wname, "%s", w->id);
      Tandem__Cluster__Remove rm = TANDEM__CLUSTER__REMOVE__INIT;
      rm.reason = "removed by an operator";
      m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_REMOVE;
      m.remove = &rm;
      (void)rtr_send_worker(r, w, &m);
      rtr_worker_gone(r, w, "removed by an operator"); /* its requests go to other workers */
      snprintf(msg, sizeof msg, "worker %s removed; its %d requests are retried on other workers", wname, jobs);
      TD_INFO("admin: %s", msg);
      reply(r, id, id_len, a, msg, NULL);
      return;
    }
  }
}
