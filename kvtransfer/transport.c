/* The transport interface's calls: each goes through the implementation's
 * table (transport.h); the implementations are transport_ucx.c and
 * transport_zmq.c. */
#include "kvtransfer/transport.h"

#include <stdlib.h>

td_status td_kvt_create(const td_kvt_i *impl, const td_kvt_opts *o, const td_kvt_hooks *hooks, td_kvt **out) {
  *out = NULL;
  td_kvt *t = calloc(1, sizeof *t);
  if (!t) return td_err(TD_ERR_NOMEM, "out of memory");
  t->iface = impl;
  t->hooks = *hooks;
  td_status s = impl->create(t, o);
  if (s != TD_OK) {
    free(t);
    return s;
  }
  *out = t;
  return TD_OK;
}

void td_kvt_destroy(td_kvt *t) {
  if (!t) return;
  t->iface->destroy(t);
  free(t);
}

const char *td_kvt_name(const td_kvt *t) { return t->iface->name; }
td_kvt_kind td_kvt_get_kind(const td_kvt *t) { return t->iface->kind; }
bool td_kvt_host_copy(const td_kvt *t) { return t->iface->host_copy; }
const uint8_t *td_kvt_desc(const td_kvt *t, size_t *len) { return t->iface->desc(t, len); }

bool td_kvt_route(td_kvt *t, const char *peer_id, const uint8_t *desc, size_t len, bool cross, char *why, size_t cap) {
  return t->iface->route(t, peer_id, desc, len, cross, why, cap);
}

td_status td_kvt_push_blocks(td_kvt *t, const td_kvt_push *p) { return t->iface->push(t, p); }

bool td_kvt_forget(td_kvt *t, uint64_t rid, int tag, bool cross, int32_t *blocks, int n) {
  return t->iface->forget(t, rid, tag, cross, blocks, n);
}

bool td_kvt_busy(const td_kvt *t, uint64_t reservation) { return reservation && t->iface->busy(t, reservation); }
int td_kvt_pending(const td_kvt *t) { return t->iface->pending(t); }
td_status td_kvt_watch(td_kvt *t, td_loop *l) { return t->iface->watch(t, l); }
bool td_kvt_arm(td_kvt *t) { return t->iface->arm(t); }
void td_kvt_progress(td_kvt *t) { t->iface->progress(t); }
uint64_t td_kvt_ipc_blocks(const td_kvt *t) { return t->iface->ipc_blocks ? t->iface->ipc_blocks(t) : 0; }
