/* The rendezvous of tensor / pipeline parallel worker groups: every rank
 * joins with its endpoint (GroupJoin), and once all have, each gets the list
 * (GroupInfo). Followers then heartbeat here; a silent one fails the group,
 * whose leader (a registered worker) leaves the pool. Bounded against a
 * flood of joins: a peer holds one rank of one group (a join elsewhere
 * leaves the last), the router at most TD_ROUTER_MAX_GROUPS rendezvous, and
 * a peer's group is found by its identity in a hash, never by a scan. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "proto/check.h"
#include "router/internal.h"

/* A group's ranks leave the member index with it. */
static void group_drop(td_router *r, group_rv *g) {
  for (int i = 0; i < TD_GROUP_MAX_RANKS; i++) {
    if (g->members[i]) {
      HASH_DEL(r->members, g->members[i]);
      free(g->members[i]);
    }
    free(g->endpoints[i]);
  }
  HASH_DEL(r->groups, g);
  free(g->error);
  free(g);
}

/* NULL when the router holds TD_ROUTER_MAX_GROUPS already (*why says so) or
 * is out of memory. */
static group_rv *group_new(td_router *r, const char *name, int world, char *why, size_t cap) {
  if (HASH_COUNT(r->groups) >= TD_ROUTER_MAX_GROUPS) {
    snprintf(why, cap, "the router holds %d worker group rendezvous, at most %d (TD_ROUTER_MAX_GROUPS); try again",
             (int)HASH_COUNT(r->groups), TD_ROUTER_MAX_GROUPS);
    return NULL;
  }
  group_rv *g = calloc(1, sizeof *g);
  if (!g) {
    snprintf(why, cap, "out of memory");
    return NULL;
  }
  snprintf(g->name, sizeof g->name, "%s", name);
  g->world = world;
  g->created = td_now_ms();
  HASH_ADD_STR(r->groups, name, g);
  return g;
}

static void group_reply(td_router *r, const uint8_t *id, size_t id_len, const group_rv *g, const char *error) {
  Tandem__Cluster__GroupInfo gi = TANDEM__CLUSTER__GROUP_INFO__INIT;
  gi.group = (char *)(g ? g->name : "");
  gi.ok = !error;
  gi.error = (char *)(error ? error : "");
  if (g && !error) {
    gi.world = (uint32_t)g->world;
    gi.endpoints = (char **)g->endpoints;
    gi.n_endpoints = (size_t)g->world;
    gi.nccl_id.data = (uint8_t *)g->nccl_id;
    gi.nccl_id.len = g->nccl_len;
  }
  char *keys[TD_GROUP_MAX_RANKS];
  if (g && !error && r->o.auth) { /* the group's sockets admit these, and its ranks dial them */
    for (int k = 0; k < g->world; k++) keys[k] = (char *)g->keys[k];
    gi.keys = keys;
    gi.n_keys = (size_t)g->world;
  }
  Tandem__Cluster__RouterMessage m = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  m.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO;
  m.group_info = &gi;
  (void)rtr_send_peer(r, id, id_len, &m);
}

/* A rank was refused (or its group already failed): the other ranks cannot
 * form the group either; those waiting hear why now, the others when they
 * join (rather than waiting for a rank that never comes). */
static void join_refused(td_router *r, const uint8_t *id, size_t id_len, const Tandem__Cluster__GroupJoin *j,
                         group_rv *g, bool refused, const char *why) {
  const char *name = j->group;
  if (refused) TD_WARN("refused rank %u of worker group %s: %s", j->rank, name, why);
  group_reply(r, id, id_len, NULL, refused ? why : g->error);
  char full[200];
  if (!g && !(g = group_new(r, name, (int)j->world, full, sizeof full))) return;
  g->told[j->rank] = true;
  if (!g->error) {
    char other[700];
    snprintf(other, sizeof other, "rank %u of group %s was refused: %s", j->rank, name, why);
    g->error = strdup(other);
    for (int k = 0; k < g->world; k++)
      if (g->endpoints[k] && !g->told[k]) {
        group_reply(r, g->ids[k], g->id_lens[k], NULL, other);
        g->told[k] = true;
      }
  }
  bool all = true;
  for (int k = 0; k < g->world; k++) all &= g->told[k];
  if (all) group_drop(r, g);
}

static void group_failed(td_router *r, group_rv *g, const char *why);

/* A peer that joins one group leaves the one it was in: a rank is one
 * process of one group (a restarted rank connects under a new identity). */
static void member_leave(td_router *r, group_rank *mb) {
  group_rv *g = mb->g;
  int k = mb->rank;
  if (g->complete) {
    char why[300];
    snprintf(why, sizeof why, "rank %d of group %s joined another group", k, g->name);
    group_failed(r, g, why);
    return;
  }
  HASH_DEL(r->members, mb);
  free(mb);
  g->members[k] = NULL;
  free(g->endpoints[k]);
  g->endpoints[k] = NULL;
  g->id_lens[k] = 0;
  g->joined--;
  if (g->joined <= 0 && !g->error) group_drop(r, g);
}

void rtr_on_group_join(td_router *r, const uint8_t *id, size_t id_len, const char *key,
                       Tandem__Cluster__GroupJoin *j) {
  char why[512];
  if (!td_check_group_join(j, why, sizeof why)) { /* proto/check.c: each limit its own message */
    group_reply(r, id, id_len, NULL, why);
    return;
  }
  /* with keys, a group's rank belongs to the key that first joined it (its
   * sockets admit the ranks' keys: another listed key cannot take its place) */
  char slot[TD_WIRE_MAX_ID + 1];
  snprintf(slot, sizeof slot, "group %s rank %u", j->group, j->rank);
  if (!rtr_id_key_ok(r, slot, key, why, sizeof why)) {
    TD_WARN("refused rank %u of worker group %s: %s", j->rank, j->group, why);
    group_reply(r, id, id_len, NULL, why);
    return;
  }
  const char *name = j->group;
  group_rank *mb = NULL;
  HASH_FIND(hh, r->members, id, id_len, mb);
  if (mb && (strcmp(mb->g->name, name) || mb->rank != (int)j->rank)) member_leave(r, mb);
  group_rv *g = NULL;
  HASH_FIND_STR(r->groups, name, g);
  bool rows = j->encoder_split && !strcmp(j->encoder_split, "rows");
  /* an encoder group runs states (it pushes encoder states), which the router takes as from a single-rank encoder */
  bool states_ok = j->encoder_states && j->cross_mode && !strcmp(j->cross_mode, "states") &&
                   (r->o.cross_mode == TD_CROSS_AUTO || r->o.cross_mode == TD_CROSS_DUAL);
  bool refused = !states_ok && !rtr_cross_mode_matches(r, j->cross_mode, why, sizeof why);
  /* ranks of one rendezvous that split the encoder differently would hold different weights and meet in
     different collectives */
  if (!refused && g && !g->complete && !g->error && g->joined > 0 && g->world == (int)j->world &&
      !g->endpoints[j->rank] && g->enc_rows != rows) {
    snprintf(why, sizeof why, "rank %u splits the encoder by %s, the ranks before it by %s (--tp-encoder): every "
             "rank of a group must agree", j->rank, rows ? "rows" : "heads", g->enc_rows ? "rows" : "heads");
    refused = true;
  }
  /* a failed rendezvous that this rank heard of already, or a running group, starts over (a restart) */
  if (g && ((g->error && (g->told[j->rank] || g->world != (int)j->world)) || (refused && g->complete))) {
    group_drop(r, g);
    g = NULL;
  }
  if (refused || (g && g->error)) {
    join_refused(r, id, id_len, j, g, refused, why);
    return;
  }
  /* the same process asking again (its join crossed our answer): answer again */
  if (g && g->complete && g->world == (int)j->world && g->id_lens[j->rank] == id_len &&
      !memcmp(g->ids[j->rank], id, id_len)) {
    group_reply(r, id, id_len, g, NULL);
    return;
  }
  /* A running group that a restarted rank joins again has lost that rank:
   * it fails (its leader hears why, leaves the pool and exits, for its
   * supervisor to restart it into the new rendezvous) before the silence
   * check would notice. Dropping it quietly left the leader serving with a
   * rank that was gone and the new rank waiting for a leader that never came. */
  if (g && g->complete) {
    char lost[300];
    snprintf(lost, sizeof lost, "rank %u of group %s joined again (restarted): the group forms anew", j->rank, name);
    group_failed(r, g, lost);
    g = NULL;
  }
  /* a rendezvous that a rank joins twice starts over */
  if (g && (g->endpoints[j->rank] || g->world != (int)j->world)) {
    group_drop(r, g);
    g = NULL;
  }
  if (!g && !(g = group_new(r, name, (int)j->world, why, sizeof why))) {
    TD_WARN("refused rank %u of worker group %s: %s", j->rank, name, why);
    group_reply(r, id, id_len, NULL, why);
    return;
  }
  group_rank *nm = calloc(1, sizeof *nm);
  if (!nm || !(g->endpoints[j->rank] = strdup(j->endpoint))) {
    free(nm);
    group_reply(r, id, id_len, NULL, "out of memory");
    if (!g->joined) group_drop(r, g);
    return;
  }
  memcpy(g->ids[j->rank], id, id_len);
  g->id_lens[j->rank] = id_len;
  snprintf(g->keys[j->rank], sizeof g->keys[j->rank], "%s", key ? key : "");
  memcpy(nm->route, id, id_len);
  nm->route_len = id_len;
  nm->g = g;
  nm->rank = (int)j->rank;
  HASH_ADD_KEYPTR(hh, r->members, nm->route, nm->route_len, nm);
  g->members[j->rank] = nm;
  if (j->rank == 0 && j->nccl_id.len) {
    memcpy(g->nccl_id, j->nccl_id.data, j->nccl_id.len);
    g->nccl_len = j->nccl_id.len;
  }
  if (g->joined == 0) g->enc_rows = rows;
  if (++g->joined < g->world) return;
  g->complete = true;
  g->completed = td_now_ms();
  for (int k = 0; k < g->world; k++) g->seen[k] = 0; /* loading: heard from after the model is up */
  TD_INFO("worker group %s: %d ranks joined", g->name, g->world);
  for (int k = 0; k < g->world; k++) group_reply(r, g->ids[k], g->id_lens[k], g, NULL);
}

group_rv *rtr_group_of_follower(td_router *r, const uint8_t *id, size_t id_len, int *rank) {
  group_rank *mb = NULL;
  HASH_FIND(hh, r->members, id, id_len, mb);
  if (!mb || mb->rank < 1) return NULL;
  *rank = mb->rank;
  return mb->g;
}

/* A rank of a complete group died: the group leaves the pool. */
static void group_failed(td_router *r, group_rv *g, const char *why) {
  TD_WARN("worker group %s failed: %s", g->name, why);
  group_reply(r, g->ids[0], g->id_lens[0], g, why);
  worker *w = rtr_find_route(r, g->ids[0], g->id_lens[0]); /* the leader registered on the socket it joined on */
  if (w) rtr_worker_gone(r, w, why);
  group_drop(r, g);
}

void rtr_groups_heard_all(td_router *r, int64_t t) {
  group_rv *g, *gt;
  HASH_ITER(hh, r->groups, g, gt)
    for (int k = 1; g->complete && k < g->world; k++)
      if (g->seen[k] > 0) g->seen[k] = t;
}

int rtr_groups_tick(td_loop *l, void *ctx) {
  (void)l;
  td_router *r = ctx;
  int64_t t = td_now_ms();
  rtr_stall_check(r, t);
  group_rv *g, *gt;
  HASH_ITER(hh, r->groups, g, gt) {
    if (g->complete) {
      for (int k = 1; k < g->world; k++) {
        bool heard = g->seen[k] > 0;
        if (heard ? t - g->seen[k] > (int64_t)r->o.heartbeat_ms * r->o.dead_after
                  : t - g->completed > TD_GROUP_READY_TIMEOUT_MS) {
          char why[160];
          if (heard) snprintf(why, sizeof why, "rank %d of group %s is silent", k, g->name);
          else
            snprintf(why, sizeof why, "rank %d of group %s was not ready within %d s of the rendezvous", k, g->name,
                     TD_GROUP_READY_TIMEOUT_MS / 1000);
          group_failed(r, g, why);
          break;
        }
      }
    } else if (t - g->created > TD_GROUP_JOIN_TIMEOUT_MS) {
      TD_WARN("worker group %s: %d of %d ranks joined in %d s; dropped", g->name, g->joined, g->world,
              TD_GROUP_JOIN_TIMEOUT_MS / 1000);
      group_drop(r, g);
    }
  }
  return TD_ROUTER_TICK_MS;
}

void rtr_groups_free(td_router *r) {
  group_rv *g, *gt;
  HASH_ITER(hh, r->groups, g, gt) group_drop(r, g);
}
