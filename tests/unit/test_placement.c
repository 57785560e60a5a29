/* Placement (router/placement.c) on hand-built worker pools: room for the
 * cross KV, queue order, the batch width, encoder choice (pending positions,
 * the encoder queue bound, local encode shared with encoder-only workers),
 * the prefill threshold, draining workers, and the reason when nothing fits. */
#include <criterion/criterion.h>
#include <string.h>

#include "common/defaults.h"
#include "router/policy.h"

#define MAXW 8

typedef struct pool {
  td_place_worker w[MAXW];
  const td_place_worker *p[MAXW];
  int n;
} pool;

/* A worker with roles "e", "p", "d" (any mix), a large cross pool and batch. */
static td_place_worker *add(pool *pl, const char *id, const char *roles) {
  td_place_worker *w = &pl->w[pl->n];
  *w = (td_place_worker){.id = id, .cross_blocks = 1000, .max_running = 32};
  w->enc = strchr(roles, 'e') != NULL;
  w->pre = strchr(roles, 'p') != NULL;
  w->dec = strchr(roles, 'd') != NULL;
  pl->p[pl->n] = w;
  pl->n++;
  return w;
}

static const td_place_req small = {.need_cross = 2, .need_self = 4, .width = 1, .n_prompt = 1};

static td_place_status place_margin(const pool *pl, const td_place_req *q, double margin, td_placement *out) {
  td_place_opts o = {.prefill_threshold = TD_DEFAULT_PREFILL_THRESHOLD,
                     .encode_runs = TD_DEFAULT_ENCODE_RUNS,
                     .local_encode_pct = TD_DEFAULT_LOCAL_ENCODE_PCT,
                     .local_encode_margin = margin};
  return td_place(pl->p, pl->n, q, &o, out);
}

static td_place_status place(const pool *pl, const td_place_req *q, td_placement *out) {
  return place_margin(pl, q, 0, out);
}

static const char *who(const pool *pl, int i) { return i < 0 ? "-" : pl->w[i].id; }

Test(placement, decode_worker_without_room_for_the_cross_kv_is_skipped) {
  pool pl = {0};
  td_place_worker *full = add(&pl, "full", "ed");
  add(&pl, "roomy", "ed");
  full->committed_cross = full->cross_blocks - 1; /* one block left, two needed */
  td_placement out;
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "roomy");
  full->committed_cross = full->cross_blocks - 2; /* exactly enough */
  full->jobs = 0;
  pl.w[1].jobs = 1;
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "full");
}

Test(placement, fewest_jobs_then_fewest_self_blocks_then_the_earlier) {
  pool pl = {0};
  td_place_worker *a = add(&pl, "a", "ed"), *b = add(&pl, "b", "ed"), *c = add(&pl, "c", "ed");
  a->jobs = 3, b->jobs = 1, c->jobs = 2;
  td_placement out;
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "b", "fewest jobs");
  a->jobs = b->jobs = c->jobs = 2;
  a->committed_self = 50, b->committed_self = 40, c->committed_self = 10;
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "c", "a tie in jobs: fewest self blocks");
  c->committed_self = 40;
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "b", "a full tie: the earlier registered");
}

Test(placement, a_full_queue_waits) {
  pool pl = {0};
  td_place_worker *d = add(&pl, "d", "ed");
  d->max_running = 2;
  d->jobs = TD_ROUTER_JOBS_PER_SEQ * 2 - 1;
  td_placement out;
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_OK);
  d->jobs++;
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_WAIT);
  cr_expect(strstr(out.why, "full"), "%s", out.why);
  cr_expect_eq(out.decode, -1);
}

Test(placement, a_group_wider_than_a_worker_batch_goes_to_a_wider_one) {
  pool pl = {0};
  td_place_worker *narrow = add(&pl, "narrow", "ed"), *wide = add(&pl, "wide", "ed");
  narrow->max_running = 4;
  wide->max_running = 16;
  wide->jobs = 5; /* busier, but the only one that can run 8 sequences */
  td_place_req q = small;
  q.width = 8;
  td_placement out;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "wide");
  q.width = 4;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "narrow");
}

Test(placement, wider_than_every_decode_worker_is_never_placed) {
  pool pl = {0};
  add(&pl, "a", "ed")->max_running = 4;
  add(&pl, "b", "ed")->max_running = 16;
  td_place_req q = small;
  q.width = 17;
  td_placement out;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_NEVER);
  cr_expect(strstr(out.why, "17 sequences") && strstr(out.why, "widest runs 16") && strstr(out.why, "max_running"),
            "%s", out.why);
  char why[256];
  cr_expect(!td_place_possible(pl.p, pl.n, &q, why, sizeof why));
  cr_expect_str_eq(why, out.why);
  q.width = 16;
  cr_expect(td_place_possible(pl.p, pl.n, &q, why, sizeof why));
}

Test(placement, cross_kv_larger_than_every_pool_is_never_placed) {
  pool pl = {0};
  add(&pl, "a", "ed")->cross_blocks = 10;
  td_place_req q = small;
  q.need_cross = 11;
  td_placement out;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_NEVER);
  cr_expect(strstr(out.why, "11 cross KV blocks") && strstr(out.why, "has 10"), "%s", out.why);
  /* a pool large enough but full now: wait */
  q.need_cross = 10;
  pl.w[0].committed_cross = 1;
  cr_expect_eq(place(&pl, &q, &out), TD_PLACE_WAIT);
}

Test(placement, width_and_cross_kv_on_different_workers_is_never_placed) {
  pool pl = {0};
  td_place_worker *a = add(&pl, "a", "ed"), *b = add(&pl, "b", "ed");
  a->max_running = 8, a->cross_blocks = 4;
  b->max_running = 2, b->cross_blocks = 100;
  td_place_req q = {.need_cross = 10, .need_self = 8, .width = 8, .n_prompt = 1};
  td_placement out;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_NEVER);
  cr_expect(strstr(out.why, "both"), "%s", out.why);
}

Test(placement, encoder_by_fewest_pending_positions) {
  pool pl = {0};
  add(&pl, "dec", "d");
  td_place_worker *busy = add(&pl, "enc-busy", "e");
  busy->jobs = 1, busy->enc_pending = 5000;
  td_place_worker *idle = add(&pl, "enc-idle", "e");
  idle->jobs = 5, idle->enc_pending = 400; /* more requests, fewer positions */
  td_placement out;
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "dec");
  cr_expect_str_eq(who(&pl, out.encode), "enc-idle");
  cr_expect_eq(out.prefill, -1);
}

Test(placement, a_decode_worker_that_encodes_with_no_encoder_only_worker_encodes_itself) {
  pool pl = {0};
  td_place_worker *a = add(&pl, "a", "ed"), *b = add(&pl, "b", "ed");
  add(&pl, "pre", "p");
  a->enc_batch = b->enc_batch = 100;
  a->enc_pending = 100000; /* far beyond its runs: aggregated workers keep no encoder queue bound */
  b->jobs = 1;
  td_place_req q = small;
  q.n_prompt = 100; /* long enough for a prefill worker */
  td_placement out;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "a");
  cr_expect(out.local_encode);
  cr_expect_eq(out.encode, -1, "local encode");
  cr_expect_eq(out.prefill, -1, "a local encode runs the prompt there too");
}

Test(placement, a_decode_worker_that_encodes_shares_with_encoder_only_workers) {
  pool pl = {0};
  td_place_worker *both = add(&pl, "both", "ed"), *enc = add(&pl, "enc", "e");
  td_place_req q = small;
  q.enc_len = 300;
  td_placement out;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.encode), "enc", "a tie: the encoder-only worker");
  cr_expect(!out.local_encode);
  enc->enc_pending = 300;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect(out.local_encode, "fewer positions pending on the decode worker");
  cr_expect_eq(out.encode, -1);
  both->enc_pending = 600;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.encode), "enc");
}

Test(placement, a_local_encode_margin_keeps_the_encoder_only_worker_busy_first) {
  pool pl = {0};
  td_place_worker *both = add(&pl, "both", "ed"), *enc = add(&pl, "enc", "e");
  both->enc_batch = enc->enc_batch = 1000;
  enc->enc_pending = 1500; /* one and a half runs behind the decode worker's empty queue */
  td_place_req q = small;
  q.enc_len = 100;
  td_placement out;
  cr_assert_eq(place_margin(&pl, &q, 0, &out), TD_PLACE_OK);
  cr_expect(out.local_encode, "no margin: the decode worker takes it (fewer pending)");
  cr_assert_eq(place_margin(&pl, &q, 2, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.encode), "enc", "margin 2 runs: 1500 behind is not enough");
  cr_assert_eq(place_margin(&pl, &q, 1, &out), TD_PLACE_OK);
  cr_expect(out.local_encode, "margin 1 run: 1500 behind is");
  both->enc_pending = 600; /* then the decode worker's own queue counts with it */
  cr_assert_eq(place_margin(&pl, &q, 1, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.encode), "enc", "600 + 1000 > 1500");
  cr_assert_eq(place_margin(&pl, &q, 0.5, &out), TD_PLACE_OK);
  cr_expect(out.local_encode, "600 + 500 < 1500");
}

Test(placement, a_decode_worker_with_a_large_decode_batch_leaves_the_encoding_to_encoders) {
  pool pl = {0};
  td_place_worker *both = add(&pl, "both", "ed"), *enc = add(&pl, "enc", "e");
  enc->enc_batch = 1000;
  enc->enc_pending = 2000; /* room for this one, more pending than the decode worker */
  td_place_req q = small;
  q.enc_len = 100;
  td_placement out;
  both->decoding = both->max_running * TD_DEFAULT_LOCAL_ENCODE_PCT / 100 - 1;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect(out.local_encode, "a small decode batch: the decode worker encodes");
  both->decoding++;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.encode), "enc", "a large decode batch: the encoder, though busier");
  enc->enc_pending = TD_DEFAULT_ENCODE_RUNS * 1000;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_WAIT, "and when it is full, the request waits");
}

Test(placement, another_decode_worker_never_encodes_for_one_that_encodes) {
  pool pl = {0};
  td_place_worker *a = add(&pl, "a", "ed"), *b = add(&pl, "b", "ed"), *e = add(&pl, "e", "e");
  b->jobs = 1; /* the decode worker is a */
  a->enc_pending = 900, b->enc_pending = 0, e->enc_pending = 600;
  td_placement out;
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "a");
  cr_expect_str_eq(who(&pl, out.encode), "e");
}

Test(placement, an_encoder_queue_holds_at_most_its_runs) {
  pool pl = {0};
  add(&pl, "dec", "d");
  td_place_worker *e = add(&pl, "enc", "e");
  e->enc_batch = 1000;
  td_place_req q = small;
  q.enc_len = 200;
  td_placement out;
  e->enc_pending = TD_DEFAULT_ENCODE_RUNS * 1000 - 200; /* exactly room */
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.encode), "enc");
  e->enc_pending++;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_WAIT);
  cr_expect(strstr(out.why, "encoder"), "%s", out.why);
  cr_expect(!out.missing, "a full encoder queue is load");
  cr_expect_eq(out.decode, -1);
  q.enc_len = 100000; /* larger than the bound: an idle encoder still takes it */
  e->enc_pending = 0;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  e->enc_batch = 0; /* a run size not registered: no bound */
  e->enc_pending = 1 << 30;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
}

Test(placement, full_encoders_and_a_full_local_queue_wait_and_the_first_to_free_takes_it) {
  pool pl = {0};
  td_place_worker *both = add(&pl, "both", "ed"), *enc = add(&pl, "enc", "e");
  both->enc_batch = enc->enc_batch = 1000;
  both->enc_pending = enc->enc_pending = TD_DEFAULT_ENCODE_RUNS * 1000;
  td_place_req q = small;
  q.enc_len = 1;
  td_placement out;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_WAIT);
  cr_expect(!out.missing, "busy encoders are load, not missing capacity");
  both->enc_pending -= 500; /* the decode worker's first token came */
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect(out.local_encode);
  both->enc_pending += 500;
  enc->enc_pending -= 1000; /* the encoder finished a run */
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.encode), "enc");
}

Test(placement, prefill_worker_from_the_threshold_on) {
  pool pl = {0};
  add(&pl, "dec", "d");
  add(&pl, "enc", "e");
  add(&pl, "pre", "p");
  td_place_req q = small;
  td_placement out;
  q.n_prompt = TD_DEFAULT_PREFILL_THRESHOLD - 1;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect_eq(out.prefill, -1, "a short prompt runs on the decode worker");
  q.n_prompt = TD_DEFAULT_PREFILL_THRESHOLD;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.prefill), "pre");
  td_place_opts o = {.prefill_threshold = TD_DEFAULT_PREFILL_THRESHOLD + 1};
  cr_expect_eq(td_place(pl.p, pl.n, &q, &o, &out), TD_PLACE_OK);
  cr_expect_eq(out.prefill, -1, "the threshold is the caller's");
}

Test(placement, no_prefill_worker_when_the_decode_worker_prefills_or_none_has_room) {
  pool pl = {0};
  add(&pl, "dec", "pd");
  add(&pl, "enc", "e");
  td_place_worker *pre = add(&pl, "pre", "p");
  td_place_req q = small;
  q.n_prompt = 100;
  td_placement out;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect_eq(out.prefill, -1, "the decode worker prefills itself");
  pl.w[0].pre = false;
  pre->committed_cross = pre->cross_blocks; /* no room for the cross KV it needs */
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect_eq(out.prefill, -1, "a full prefill worker is passed over, not waited for");
  pre->committed_cross = 0;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.prefill), "pre");
}

Test(placement, draining_workers_take_nothing) {
  pool pl = {0};
  add(&pl, "dec-draining", "ed")->draining = true;
  add(&pl, "dec", "d");
  add(&pl, "enc-draining", "e")->draining = true;
  add(&pl, "enc", "e")->jobs = 9;
  td_placement out;
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "dec");
  cr_expect_str_eq(who(&pl, out.encode), "enc");
  pl.w[3].draining = true;
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_WAIT);
  cr_expect_str_eq(out.why, "every encoder is draining");
  cr_expect(out.missing, "no live encoder: the router waits a bounded time");
  pl.w[1].draining = true;
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_WAIT, "a draining worker could still run it: wait");
  cr_expect_str_eq(out.why, "every decode worker is draining");
  cr_expect(out.missing);
}

Test(placement, group_leader_is_placed_as_one_worker) {
  /* a TP/PP group registers through its leader, with the group's batch and pools */
  pool pl = {0};
  td_place_worker *group = add(&pl, "group-leader", "ed");
  group->max_running = 64;
  add(&pl, "single", "ed")->max_running = 8;
  td_place_req q = small;
  q.width = 32;
  td_placement out;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "group-leader");
}

Test(placement, no_worker_of_a_role_says_which) {
  pool pl = {0};
  td_placement out;
  /* a decode worker may register (a router restarted before its workers): waited for, bounded */
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_WAIT);
  cr_expect_str_eq(out.why, "no decode worker is registered");
  cr_expect(out.missing);
  add(&pl, "enc", "e");
  add(&pl, "pre", "p");
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_WAIT);
  cr_expect_str_eq(out.why, "no decode worker is registered");
  cr_expect(out.missing);
  pool only_dec = {0};
  add(&only_dec, "dec", "d");
  cr_assert_eq(place(&only_dec, &small, &out), TD_PLACE_WAIT, "an encoder may still register");
  cr_expect_str_eq(out.why, "no encoder is registered");
  cr_expect(out.missing);
}

/* A TP / PP group that encodes (enc_self) encodes its own requests only:
 * its blocks are sliced across its ranks, so a plain decode worker beside it
 * waits for an encoder rather than being given the group's. */
Test(placement, a_group_encodes_its_own_requests_only) {
  pool pl = {0};
  td_place_worker *g = add(&pl, "group", "d");
  g->enc_self = true;
  td_placement out;
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "group");
  cr_expect(out.local_encode, "the group encodes its own request");
  td_place_worker *plain = add(&pl, "plain", "d");
  g->jobs = 5; /* the plain worker is the one with room now */
  cr_expect_eq(place(&pl, &small, &out), TD_PLACE_WAIT, "the plain worker was given the group's encoder");
  cr_expect(strstr(out.why, "no encoder"), "%s", out.why);
  /* with an encoder-only worker the plain one is served by it, and the group shares
   * the encoding of its own requests as a decode worker that encodes does */
  add(&pl, "enc", "e");
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "plain");
  cr_expect_str_eq(who(&pl, out.encode), "enc");
  plain->jobs = 9;
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "group");
  cr_expect(out.local_encode || out.encode == 2, "the group's request went to %s", who(&pl, out.encode));
}

/* Workers whose cross K/V are int8 (kv8) take K/V pushes only from int8
 * encoders, and push K/V only to int8 pools: beside a bf16 K/V encoder an
 * int8 worker encodes every request of its own and gets no prefill worker,
 * and it encodes for no bf16 worker; an int8 encoder serves int8 decode
 * workers only. */
Test(placement, k_v_pushes_stay_within_one_dtype) {
  pool pl = {0};
  td_place_worker *q8 = add(&pl, "q8", "ed");
  q8->kv8 = true;
  q8->projects = true;
  add(&pl, "enc", "e"); /* pushes bf16 K/V */
  add(&pl, "pre", "p");
  td_placement out;
  const td_place_req longp = {.need_cross = 2, .need_self = 4, .width = 1, .n_prompt = 1000};
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(place(&pl, &longp, &out), TD_PLACE_OK);
    cr_expect_str_eq(who(&pl, out.decode), "q8");
    cr_expect(out.local_encode && out.encode == -1, "the int8 worker's request was encoded by %s", who(&pl, out.encode));
    cr_expect_eq(out.prefill, -1, "a prefill worker was given the int8 worker's request");
    q8->decoding = 1000; /* a full decode batch sends others' encodes to encoders, never its own */
  }
  /* a plain decode worker beside it is served by the bf16 encoder, never by the int8 worker */
  td_place_worker *plain = add(&pl, "plain", "d");
  q8->jobs = 9;
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "plain");
  cr_expect_str_eq(who(&pl, out.encode), "enc");
  /* without the bf16 encoder it waits rather than being given the int8 worker's encoder, and says why */
  pl.w[1].draining = true;
  cr_expect_eq(place(&pl, &small, &out), TD_PLACE_WAIT);
  cr_expect(out.missing);
  cr_expect(strstr(out.why, "decode worker plain (its cross K/V in bf16)"), "%s", out.why);
  /* an int8 encoder that pushes K/V serves the int8 decode worker, and not the plain one */
  pl.w[1].draining = false;
  plain->draining = true;
  q8->jobs = 0;
  q8->decoding = 0;
  td_place_worker *enc8 = add(&pl, "enc8", "e");
  enc8->kv8 = true;
  q8->enc_pending = 3000; /* its own encoder is busy */
  pl.w[1].enc_pending = 0, enc8->enc_pending = 10; /* the bf16 one is idler: still not the one */
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "q8");
  cr_expect_str_eq(who(&pl, out.encode), "enc8");
  plain->draining = false;
  q8->jobs = 9;
  cr_assert_eq(place(&pl, &small, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "plain");
  cr_expect_str_eq(who(&pl, out.encode), "enc");
}

/* An int8 decode worker takes encoder states, which it projects into its
 * int8 K/V: encoders that push states serve it (and a prefill worker that
 * projects too); with bf16 K/V encoders only, it waits and says why. */
Test(placement, an_int8_decode_worker_takes_encoder_states) {
  pool pl = {0};
  td_place_worker *q8 = add(&pl, "q8", "d");
  q8->kv8 = true;
  q8->projects = true;
  td_place_worker *kv = add(&pl, "kv-enc", "e");
  td_placement out;
  cr_expect_eq(place(&pl, &small, &out), TD_PLACE_WAIT);
  cr_expect(out.missing, "no encoder it can take was reported as a wait for a queue");
  cr_expect(strstr(out.why, "its cross K/V in int8") && strstr(out.why, "--cross-kv-dtype int8"), "%s", out.why);
  td_place_worker *st = add(&pl, "states-enc", "e");
  st->states_out = true;
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(place(&pl, &small, &out), TD_PLACE_OK);
    cr_expect_str_eq(who(&pl, out.decode), "q8");
    cr_expect_str_eq(who(&pl, out.encode), "states-enc", "the K/V encoder was chosen");
    kv->enc_pending = 0, st->enc_pending = 5000; /* the other is idler: still never the K/V one */
  }
  /* long prompts: a prefill worker that projects the states too */
  td_place_worker *pre = add(&pl, "pre", "p");
  pre->projects = true;
  const td_place_req longp = {.need_cross = 2, .need_self = 4, .width = 1, .n_prompt = 1000};
  cr_assert_eq(place(&pl, &longp, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.encode), "states-enc");
  cr_expect_str_eq(who(&pl, out.prefill), "pre");
  /* with the states encoder draining, the bf16 K/V encoder still does not serve it */
  st->draining = true;
  cr_expect_eq(place(&pl, &longp, &out), TD_PLACE_WAIT);
  cr_expect(strstr(out.why, "int8"), "%s", out.why);
  /* with no encoder at all, the usual reason */
  kv->draining = true;
  cr_expect_eq(place(&pl, &longp, &out), TD_PLACE_WAIT);
  cr_expect(strstr(out.why, "every encoder is draining"), "%s", out.why);
}

/* A decode worker that failed the request's last attempt (a group that lost
 * a rank fails whatever it gets) takes the next only when no other fits. */
Test(placement, the_decode_worker_that_failed_the_last_attempt_is_avoided) {
  pool pl = {0};
  td_place_worker *broken = add(&pl, "broken", "ed"), *other = add(&pl, "other", "ed");
  other->jobs = 5; /* the broken one looks idler: it just dropped its work */
  td_place_req q = small;
  q.avoid_dec = "broken";
  td_placement out;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "other");
  other->committed_cross = other->cross_blocks; /* the other has no room: the avoided one it is */
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "broken");
  q.avoid_dec = NULL;
  other->committed_cross = 0;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect_str_eq(who(&pl, out.decode), "broken");
  (void)broken;
}

/* A probe reads a prompt row: the decode worker computes the whole prompt. */
Test(placement, no_prefill_worker_for_a_probe) {
  pool pl = {0};
  add(&pl, "dec", "d");
  add(&pl, "enc", "e");
  add(&pl, "pre", "p");
  td_place_req q = small;
  q.n_prompt = 100;
  q.no_prefill = true;
  td_placement out;
  cr_assert_eq(place(&pl, &q, &out), TD_PLACE_OK);
  cr_expect_eq(out.prefill, -1, "a probing request went to a prefill worker");
  cr_expect_str_eq(who(&pl, out.decode), "dec");
}
