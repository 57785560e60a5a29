/* proto/check.c: every field of every peer message past its limit, one
 * table row each: a valid message, one field changed, the refusal that must
 * name it. A valid message of each type passes. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/defaults.h"
#include "proto/check.h"
#include "proto/wire.h"

#define V 100 /* the vocabulary the checks compare ids with */

static void expect_refused(bool ok, const char *why, const char *row, const char *says) {
  cr_expect(!ok, "%s: accepted", row);
  if (!ok) cr_expect(strstr(why, says), "%s: \"%s\" does not say \"%s\"", row, why, says);
}

static char long_str[TD_WIRE_MAX_REASON + 2];
static const char *too_long(size_t n) {
  memset(long_str, 'x', n);
  long_str[n] = 0;
  return long_str;
}

/* ------------------------------------------------------------ registration */

typedef struct reg {
  Tandem__Cluster__WorkerInfo in;
  Tandem__ModelInfo mi;
  Tandem__TokenId start;
  Tandem__Cluster__Role roles[5];
  int32_t eos[TD_ROUTER_MAX_EOS + 1];
} reg;

static void valid_reg(reg *r) {
  memset(r, 0, sizeof *r);
  tandem__cluster__worker_info__init(&r->in);
  tandem__model_info__init(&r->mi);
  tandem__token_id__init(&r->start);
  r->mi.model_type = "t5";
  r->mi.vocab_size = V;
  r->mi.max_source_len = 64;
  r->mi.max_target_len = 32;
  r->start.id = 0;
  r->mi.decoder_start = &r->start;
  r->eos[0] = 1;
  r->mi.eos_token_ids = r->eos;
  r->mi.n_eos_token_ids = 1;
  r->roles[0] = TANDEM__CLUSTER__ROLE__ROLE_DECODE;
  r->in.worker_id = "decode-0";
  r->in.roles = r->roles;
  r->in.n_roles = 1;
  r->in.model = &r->mi;
  r->in.block_size = 16;
  r->in.self_blocks = 100;
  r->in.cross_blocks = 100;
  r->in.max_running = 32;
  r->in.device = "cpu";
  r->in.cross_mode = "auto";
}

typedef struct reg_row {
  const char *field, *says;
  void (*bad)(reg *);
} reg_row;

static void r_id_empty(reg *r) { r->in.worker_id = ""; }
static void r_id_space(reg *r) { r->in.worker_id = "decode 0"; }
static void r_id_long(reg *r) { r->in.worker_id = (char *)too_long(TD_WIRE_MAX_ID + 1); }
static void r_no_roles(reg *r) { r->in.n_roles = 0; }
static void r_role_7(reg *r) { r->roles[0] = (Tandem__Cluster__Role)7; }
static void r_five_roles(reg *r) {
  for (int i = 0; i < 5; i++) r->roles[i] = TANDEM__CLUSTER__ROLE__ROLE_DECODE;
  r->in.n_roles = 5;
}
static void r_no_model(reg *r) { r->in.model = NULL; }
static void r_vocab_0(reg *r) { r->mi.vocab_size = 0; }
static void r_vocab_2g(reg *r) { r->mi.vocab_size = 0x80000000u; }
static void r_src_0(reg *r) { r->mi.max_source_len = 0; }
static void r_src_4g(reg *r) { r->mi.max_source_len = 0xffffffffu; }
static void r_tgt_1(reg *r) { r->mi.max_target_len = 1; }
static void r_tgt_2g(reg *r) { r->mi.max_target_len = 0x80000000u; }
static void r_mels(reg *r) { r->mi.mel_bins = TD_MEL_MAX_MELS + 1, r->mi.frames = 10; }
static void r_frames_0(reg *r) { r->mi.mel_bins = 80, r->mi.frames = 0; }
static void r_frames_only(reg *r) { r->mi.frames = 3000; }
static void r_features_big(reg *r) { r->mi.mel_bins = 256, r->mi.frames = TD_MODEL_MAX_FRAMES; }
static void r_no_start(reg *r) { r->mi.decoder_start = NULL; }
static void r_start_oov(reg *r) { r->start.id = V; }
static void r_eos_many(reg *r) { r->mi.n_eos_token_ids = TD_ROUTER_MAX_EOS + 1; }
static void r_eos_neg(reg *r) { r->eos[0] = -1; }
static void r_name_long(reg *r) { r->mi.model_type = (char *)too_long(TD_WIRE_MAX_NAME + 1); }
static void r_tp(reg *r) { r->in.tp = TD_GROUP_MAX_RANKS + 1; }
static void r_tp_pp(reg *r) { r->in.tp = 4, r->in.pp = 8; }
static void r_bs_0(reg *r) { r->in.block_size = 0; }
static void r_bs_big(reg *r) { r->in.block_size = TD_MAX_BLOCK_SIZE + 1; }
static void r_self_2g(reg *r) { r->in.self_blocks = 0x80000000u; }
static void r_cross_2g(reg *r) { r->in.cross_blocks = 0x80000000u; }
static void r_running(reg *r) { r->in.max_running = TD_WORKER_MAX_RUNNING + 1; }
static void r_enc_batch(reg *r) { r->in.encode_batch_tokens = 0x80000000u; }
static void r_desc(reg *r) {
  static uint8_t junk[3] = {0xff, 0xff, 0xff};
  r->in.transfer_desc.data = junk;
  r->in.transfer_desc.len = 3;
}
static void r_device(reg *r) { r->in.device = (char *)too_long(TD_WIRE_MAX_NAME + 1); }
static void r_version(reg *r) { r->in.version = (char *)too_long(TD_WIRE_MAX_NAME + 1); }
static void r_group(reg *r) { r->in.group = (char *)too_long(TD_WIRE_MAX_NAME + 1); }

static const reg_row reg_rows[] = {
    {"worker_id empty", "the worker id", r_id_empty},
    {"worker_id with a space", "WorkerInfo.worker_id", r_id_space},
    {"worker_id too long", "1 to 255 printable", r_id_long},
    {"no roles", "WorkerInfo.roles is empty", r_no_roles},
    {"role 7", "WorkerInfo.roles[0] 7 is no role", r_role_7},
    {"5 roles", "WorkerInfo.roles holds 5 entries, at most 4", r_five_roles},
    {"no model", "WorkerInfo.model is missing", r_no_model},
    {"vocab 0", "ModelInfo.vocab_size 0 is outside 1 to", r_vocab_0},
    {"vocab 2^31", "ModelInfo.vocab_size 2147483648", r_vocab_2g},
    {"max_source_len 0", "ModelInfo.max_source_len 0", r_src_0},
    {"max_source_len 2^32-1", "ModelInfo.max_source_len 4294967295", r_src_4g},
    {"max_target_len 1", "ModelInfo.max_target_len 1 is outside 2 to", r_tgt_1},
    {"max_target_len 2^31", "ModelInfo.max_target_len 2147483648", r_tgt_2g},
    {"mel_bins", "ModelInfo.mel_bins 257 exceeds 256", r_mels},
    {"frames 0 with mel bins", "ModelInfo.frames 0 is outside", r_frames_0},
    {"frames without mel bins", "ModelInfo.frames 3000 without mel_bins", r_frames_only},
    {"features past a client message", "exceed a client message", r_features_big},
    {"no decoder start", "decoder start token", r_no_start},
    {"decoder start outside the vocabulary", "ModelInfo.decoder_start[0] 100 is outside the vocabulary of 100",
     r_start_oov},
    {"17 EOS ids", "ModelInfo.eos_token_ids holds 17 ids, at most 16", r_eos_many},
    {"EOS id -1", "ModelInfo.eos_token_ids[0] -1 is outside", r_eos_neg},
    {"model_type too long", "ModelInfo.model_type has 256 bytes", r_name_long},
    {"tp 17", "WorkerInfo.tp 17 x pp 0 exceeds 16 ranks", r_tp},
    {"tp 4 x pp 8", "WorkerInfo.tp 4 x pp 8 exceeds", r_tp_pp},
    {"block_size 0", "WorkerInfo.block_size 0 is outside 1 to", r_bs_0},
    {"block_size 4097", "WorkerInfo.block_size 4097", r_bs_big},
    {"self_blocks 2^31", "WorkerInfo.self_blocks 2147483648 exceeds", r_self_2g},
    {"cross_blocks 2^31", "WorkerInfo.cross_blocks 2147483648 exceeds", r_cross_2g},
    {"max_running", "WorkerInfo.max_running 65537 exceeds", r_running},
    {"encode_batch_tokens 2^31", "WorkerInfo.encode_batch_tokens 2147483648 exceeds", r_enc_batch},
    {"transfer_desc not a TransferDesc", "WorkerInfo.transfer_desc: the KV descriptor is not a TransferDesc", r_desc},
    {"device too long", "WorkerInfo.device has 256 bytes", r_device},
    {"version too long", "WorkerInfo.version has 256 bytes", r_version},
    {"group too long", "WorkerInfo.group has 256 bytes", r_group},
};

Test(check, a_registration_past_each_limit_is_refused_naming_the_field) {
  reg r;
  char why[400];
  valid_reg(&r);
  cr_assert(td_check_worker_info(&r.in, why, sizeof why), "a valid registration: %s", why);
  for (size_t i = 0; i < sizeof reg_rows / sizeof *reg_rows; i++) {
    valid_reg(&r);
    reg_rows[i].bad(&r);
    why[0] = 0;
    expect_refused(td_check_worker_info(&r.in, why, sizeof why), why, reg_rows[i].field, reg_rows[i].says);
  }
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  Tandem__Cluster__Register rg = TANDEM__CLUSTER__REGISTER__INIT;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_REGISTER;
  m.register_ = &rg;
  expect_refused(td_check_worker_message(&m, V, why, sizeof why), why, "Register without info",
                 "Register.info is missing");
}

Test(check, a_heartbeats_load_past_the_pools_is_refused) {
  char why[256];
  Tandem__Cluster__Load l = TANDEM__CLUSTER__LOAD__INIT;
  l.free_self_blocks = 10;
  l.free_cross_blocks = 20;
  cr_expect(td_check_load(&l, 10, 20, why, sizeof why), "%s", why);
  expect_refused(td_check_load(NULL, 10, 20, why, sizeof why), why, "no load", "Heartbeat.load is missing");
  l.free_self_blocks = 11;
  expect_refused(td_check_load(&l, 10, 20, why, sizeof why), why, "free self", "Load.free_self_blocks 11 exceeds");
  l.free_self_blocks = 10;
  l.free_cross_blocks = 21;
  expect_refused(td_check_load(&l, 10, 20, why, sizeof why), why, "free cross", "Load.free_cross_blocks 21");
  l.free_cross_blocks = 20;
  l.encoder_cache_blocks = 21;
  expect_refused(td_check_load(&l, 10, 20, why, sizeof why), why, "cache", "Load.encoder_cache_blocks 21");
  l.encoder_cache_blocks = 0;
  l.kv_out_seconds_zmq = NAN;
  expect_refused(td_check_load(&l, 10, 20, why, sizeof why), why, "seconds NaN", "Load.kv_out_seconds_zmq nan");
  l.kv_out_seconds_zmq = -1;
  expect_refused(td_check_load(&l, 10, 20, why, sizeof why), why, "seconds < 0", "Load.kv_out_seconds_zmq -1");
  l.kv_out_seconds_zmq = 0;
  l.busy_seconds = INFINITY;
  expect_refused(td_check_load(&l, 10, 20, why, sizeof why), why, "busy inf", "Load.busy_seconds inf");
  l.busy_seconds = -0.5;
  expect_refused(td_check_load(&l, 10, 20, why, sizeof why), why, "busy < 0", "Load.busy_seconds -0.5");
  l.busy_seconds = 12.5;
  l.idle_seconds = NAN;
  expect_refused(td_check_load(&l, 10, 20, why, sizeof why), why, "idle NaN", "Load.idle_seconds nan");
  l.idle_seconds = 3;
  l.project_seconds = -1;
  expect_refused(td_check_load(&l, 10, 20, why, sizeof why), why, "project < 0", "Load.project_seconds -1");
  l.project_seconds = 0.25;
  cr_expect(td_check_load(&l, 10, 20, why, sizeof why), "%s", why);
}

/* ------------------------------------------------------------ worker -> router */

typedef struct wmsg {
  Tandem__Cluster__WorkerMessage m;
  Tandem__Cluster__Tokens t;
  Tandem__Cluster__TokensBatch tb;
  Tandem__Cluster__Tokens *items[1];
  Tandem__Cluster__Finished fin;
  Tandem__SequenceOutput out;
  Tandem__SequenceOutput *outs[TD_CLIENT_MAX_OUTPUTS + 1];
  Tandem__Cluster__Failed fl;
  Tandem__Cluster__EncodeDone ed;
  Tandem__Cluster__PrefillDone pd;
  Tandem__Cluster__Reserved res;
  Tandem__Cluster__KvTarget kt;
  Tandem__Cluster__Deregister dr;
  Tandem__Cluster__Heartbeat hb;
  Tandem__Cluster__GroupJoin gj;
  int32_t tokens[3];
  float lp[3];
  int32_t blocks[2];
} wmsg;

static const char desc[] = "zmq:tcp://127.0.0.1:9";

/* A valid message of body b. */
static void valid_w(wmsg *x, Tandem__Cluster__WorkerMessage__BodyCase b) {
  memset(x, 0, sizeof *x);
  tandem__cluster__worker_message__init(&x->m);
  x->m.body_case = b;
  x->tokens[0] = 5, x->tokens[1] = 6, x->tokens[2] = 7;
  x->lp[0] = -0.5f, x->lp[1] = -1, x->lp[2] = -INFINITY;
  tandem__cluster__tokens__init(&x->t);
  x->t.rid = 256;
  x->t.tokens = x->tokens;
  x->t.n_tokens = 3;
  x->t.logprobs = x->lp;
  x->t.n_logprobs = 3;
  x->blocks[0] = 3, x->blocks[1] = 4;
  tandem__cluster__kv_target__init(&x->kt);
  x->kt.worker_id = "decode-0";
  x->kt.desc.data = (uint8_t *)desc;
  x->kt.desc.len = sizeof desc - 1;
  x->kt.blocks = x->blocks;
  x->kt.n_blocks = 2;
  x->kt.tokens = 20;
  switch (b) {
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS: x->m.tokens = &x->t; break;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS_BATCH:
      tandem__cluster__tokens_batch__init(&x->tb);
      x->items[0] = &x->t;
      x->tb.items = x->items;
      x->tb.n_items = 1;
      x->m.tokens_batch = &x->tb;
      break;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FINISHED:
      tandem__cluster__finished__init(&x->fin);
      tandem__sequence_output__init(&x->out);
      x->out.tokens = x->tokens;
      x->out.n_tokens = 3;
      x->out.finish_reason = TANDEM__FINISH_REASON__FINISH_STOP;
      x->out.score = -1.5;
      for (int i = 0; i <= TD_CLIENT_MAX_OUTPUTS; i++) x->outs[i] = &x->out;
      x->fin.outputs = x->outs;
      x->fin.n_outputs = 1;
      x->fin.decode_ms = 3;
      x->m.finished = &x->fin;
      break;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED:
      tandem__cluster__failed__init(&x->fl);
      x->fl.code = TANDEM__ERROR_CODE__ERROR_INVALID_ARGUMENT;
      x->fl.message = "bad";
      x->m.failed = &x->fl;
      break;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_ENCODE_DONE:
      tandem__cluster__encode_done__init(&x->ed);
      x->ed.ms = 1;
      x->m.encode_done = &x->ed;
      break;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_PREFILL_DONE:
      tandem__cluster__prefill_done__init(&x->pd);
      x->pd.first_token = -1;
      x->m.prefill_done = &x->pd;
      break;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED:
      tandem__cluster__reserved__init(&x->res);
      x->res.cross = &x->kt;
      x->m.reserved = &x->res;
      break;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_DEREGISTER:
      tandem__cluster__deregister__init(&x->dr);
      x->dr.reason = "drained";
      x->m.deregister = &x->dr;
      break;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_HEARTBEAT:
      tandem__cluster__heartbeat__init(&x->hb);
      x->m.heartbeat = &x->hb;
      break;
    case TANDEM__CLUSTER__WORKER_MESSAGE__BODY_GROUP_JOIN:
      tandem__cluster__group_join__init(&x->gj);
      x->gj.group = "g";
      x->gj.world = 2;
      x->gj.rank = 1;
      x->gj.endpoint = "tcp://127.0.0.1:5";
      x->m.group_join = &x->gj;
      break;
    default: break;
  }
}

typedef struct w_row {
  Tandem__Cluster__WorkerMessage__BodyCase body;
  const char *field, *says;
  void (*bad)(wmsg *);
} w_row;

static void t_oov(wmsg *x) { x->tokens[1] = V; }
static void t_neg(wmsg *x) { x->tokens[0] = -3; }
static void t_lp_count(wmsg *x) { x->t.n_logprobs = 2; }
static void t_lp_nan(wmsg *x) { x->lp[1] = NAN; }
static void t_lp_inf(wmsg *x) { x->lp[0] = INFINITY; }
static void t_seq(wmsg *x) { x->t.sequence = TD_CLIENT_MAX_OUTPUTS; }
static void t_offset(wmsg *x) { x->t.offset = 0x80000000u; }
static void f_none(wmsg *x) { x->fin.n_outputs = 0; }
static void f_many(wmsg *x) { x->fin.n_outputs = TD_CLIENT_MAX_OUTPUTS + 1; }
static void f_oov(wmsg *x) { x->tokens[2] = V + 5; }
static void f_reason(wmsg *x) { x->out.finish_reason = TANDEM__FINISH_REASON__FINISH_NONE; }
static void f_reason_9(wmsg *x) { x->out.finish_reason = (Tandem__FinishReason)9; }
static void f_score(wmsg *x) { x->out.score = NAN; }
static void f_lp(wmsg *x) {
  x->out.logprobs = x->lp;
  x->out.n_logprobs = 1;
}
static void f_text(wmsg *x) {
  x->out.text = "forged";
  x->out.has_text = true;
}
static void f_segments(wmsg *x) { x->out.has_segments = true; }
static void f_ms(wmsg *x) { x->fin.decode_ms = NAN; }
static void f_first_ms(wmsg *x) { x->fin.first_token_ms = -2; }
static void fl_code(wmsg *x) { x->fl.code = (Tandem__ErrorCode)99; }
static void fl_msg(wmsg *x) { x->fl.message = (char *)too_long(TD_WIRE_MAX_REASON + 1); }
static void ed_ms(wmsg *x) { x->ed.ms = -1; }
static void pd_token(wmsg *x) { x->pd.first_token = V; }
static void pd_lp(wmsg *x) { x->pd.first_logprob = NAN; }
static void rs_no_cross(wmsg *x) { x->res.cross = NULL; }
static void rs_id(wmsg *x) { x->kt.worker_id = ""; }
static void rs_desc(wmsg *x) { x->kt.desc.len = 0; }
static void rs_no_blocks(wmsg *x) { x->kt.n_blocks = 0; }
static void rs_neg_block(wmsg *x) { x->blocks[1] = -2; }
static void rs_tokens(wmsg *x) { x->kt.tokens = 0xffffffffu; }
static void rs_self(wmsg *x) {
  static Tandem__Cluster__KvTarget self = TANDEM__CLUSTER__KV_TARGET__INIT;
  self.worker_id = "decode-0";
  x->res.self = &self; /* no descriptor */
}
static void dr_reason(wmsg *x) { x->dr.reason = (char *)too_long(TD_WIRE_MAX_REASON + 1); }
static void hb_no_load(wmsg *x) { (void)x; }
static void gj_world(wmsg *x) { x->gj.world = 0; }
static void gj_rank(wmsg *x) { x->gj.rank = 2; }
static void gj_name(wmsg *x) { x->gj.group = (char *)too_long(TD_GROUP_MAX_NAME + 1); }
static void gj_endpoint(wmsg *x) { x->gj.endpoint = (char *)too_long(TD_WIRE_MAX_NAME + 1); }
static void gj_nccl(wmsg *x) { x->gj.nccl_id.len = TD_GROUP_MAX_NCCL_ID + 1; }

#define W(b) TANDEM__CLUSTER__WORKER_MESSAGE__BODY_##b
static const w_row w_rows[] = {
    {W(TOKENS), "token outside the vocabulary", "Tokens.tokens[1] 100 is outside the vocabulary of 100", t_oov},
    {W(TOKENS), "negative token", "Tokens.tokens[0] -3 is outside", t_neg},
    {W(TOKENS), "log-probs for fewer tokens", "Tokens.logprobs has 2 values for 3 tokens", t_lp_count},
    {W(TOKENS), "NaN log-prob", "Tokens.logprobs[1] is nan", t_lp_nan},
    {W(TOKENS), "+inf log-prob", "Tokens.logprobs[0] is inf", t_lp_inf},
    {W(TOKENS), "sequence 64", "Tokens.sequence 64 exceeds 63", t_seq},
    {W(TOKENS), "offset 2^31", "Tokens.offset 2147483648 exceeds", t_offset},
    {W(TOKENS_BATCH), "a batch item's token", "TokensBatch.items[0].tokens[1] 100", t_oov},
    {W(FINISHED), "no outputs", "Finished.outputs holds 0 sequences", f_none},
    {W(FINISHED), "65 outputs", "Finished.outputs holds 65 sequences, 1 to 64", f_many},
    {W(FINISHED), "token outside the vocabulary", "Finished.outputs[0].tokens[2] 105", f_oov},
    {W(FINISHED), "finish reason none", "Finished.outputs[0].finish_reason 0 is not", f_reason},
    {W(FINISHED), "finish reason 9", "Finished.outputs[0].finish_reason 9", f_reason_9},
    {W(FINISHED), "NaN score", "Finished.outputs[0].score is nan", f_score},
    {W(FINISHED), "log-probs for fewer tokens", "Finished.outputs[0].logprobs has 1 values for 3", f_lp},
    {W(FINISHED), "text from a worker", "carries text or segments", f_text},
    {W(FINISHED), "segments from a worker", "carries text or segments", f_segments},
    {W(FINISHED), "NaN decode time", "Finished.decode_ms nan", f_ms},
    {W(FINISHED), "a negative first-token time", "Finished.first_token_ms -2", f_first_ms},
    {W(FAILED), "code 99", "Failed.code 99 is no error code", fl_code},
    {W(FAILED), "a message too long", "Failed.message has 4097 bytes", fl_msg},
    {W(ENCODE_DONE), "negative time", "EncodeDone.ms -1", ed_ms},
    {W(PREFILL_DONE), "first token outside the vocabulary", "PrefillDone.first_token[0] 100", pd_token},
    {W(PREFILL_DONE), "NaN first log-prob", "PrefillDone.first_logprob is nan", pd_lp},
    {W(RESERVED), "no cross target", "Reserved.cross is missing", rs_no_cross},
    {W(RESERVED), "no worker id", "Reserved.cross.worker_id is not 1 to 255", rs_id},
    {W(RESERVED), "no descriptor", "Reserved.cross.desc: the KV descriptor is empty", rs_desc},
    {W(RESERVED), "no blocks", "Reserved.cross.blocks is empty", rs_no_blocks},
    {W(RESERVED), "a negative block", "Reserved.cross.blocks[1] -2 is negative", rs_neg_block},
    {W(RESERVED), "tokens 2^32-1", "Reserved.cross.tokens 4294967295 exceeds", rs_tokens},
    {W(RESERVED), "a self target without a descriptor", "Reserved.self.desc", rs_self},
    {W(DEREGISTER), "a reason too long", "Deregister.reason has 4097 bytes", dr_reason},
    {W(HEARTBEAT), "no load", "Heartbeat.load is missing", hb_no_load},
    {W(GROUP_JOIN), "world 0", "bad group join: world 0", gj_world},
    {W(GROUP_JOIN), "rank 2 of 2", "bad group join: rank 2 of a world of 2", gj_rank},
    {W(GROUP_JOIN), "a name too long", "bad group join: the group name has 128 bytes, at most 127", gj_name},
    {W(GROUP_JOIN), "an endpoint too long", "bad group join: an endpoint of 256 bytes", gj_endpoint},
    {W(GROUP_JOIN), "an NCCL id too long", "bad group join: an NCCL id of 257 bytes", gj_nccl},
};

Test(check, each_worker_message_past_a_limit_is_refused_naming_the_field) {
  static const Tandem__Cluster__WorkerMessage__BodyCase fine[] = {
      W(TOKENS), W(TOKENS_BATCH), W(FINISHED), W(FAILED), W(ENCODE_DONE), W(PREFILL_DONE), W(RESERVED),
      W(DEREGISTER), W(GROUP_JOIN)};
  wmsg x;
  char why[400];
  for (size_t i = 0; i < sizeof fine / sizeof *fine; i++) {
    valid_w(&x, fine[i]);
    cr_expect(td_check_worker_message(&x.m, V, why, sizeof why), "a valid message %d: %s", (int)fine[i], why);
  }
  for (size_t i = 0; i < sizeof w_rows / sizeof *w_rows; i++) {
    valid_w(&x, w_rows[i].body);
    w_rows[i].bad(&x);
    why[0] = 0;
    expect_refused(td_check_worker_message(&x.m, V, why, sizeof why), why, w_rows[i].field, w_rows[i].says);
  }
  /* the vocabulary not known yet: ids are refused only below 0 */
  valid_w(&x, W(TOKENS));
  x.tokens[0] = 5000;
  cr_expect(td_check_worker_message(&x.m, 0, why, sizeof why), "%s", why);
  x.tokens[0] = -1;
  expect_refused(td_check_worker_message(&x.m, 0, why, sizeof why), why, "-1 without a vocabulary",
                 "Tokens.tokens[0] -1 is negative");
  Tandem__Cluster__WorkerMessage none = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  expect_refused(td_check_worker_message(&none, V, why, sizeof why), why, "no body", "without a body");
}

Test(check, kv_descriptors) {
  char why[256];
  cr_expect(td_check_transfer_desc((const uint8_t *)desc, sizeof desc - 1, why, sizeof why), "%s", why);
  Tandem__Cluster__TransferDesc d = TANDEM__CLUSTER__TRANSFER_DESC__INIT;
  uint8_t buf[600];
  d.version = TD_PROTOCOL_VERSION;
  d.zmq = "zmq:tcp://127.0.0.1:9";
  size_t n = tandem__cluster__transfer_desc__pack(&d, buf);
  cr_expect(td_check_transfer_desc(buf, n, why, sizeof why), "%s", why);
  d.version = 1;
  n = tandem__cluster__transfer_desc__pack(&d, buf);
  expect_refused(td_check_transfer_desc(buf, n, why, sizeof why), why, "version 1", "TransferDesc.version 1");
  d.version = TD_PROTOCOL_VERSION;
  d.zmq = "tcp://127.0.0.1:9";
  n = tandem__cluster__transfer_desc__pack(&d, buf);
  expect_refused(td_check_transfer_desc(buf, n, why, sizeof why), why, "no zmq: prefix", "TransferDesc.zmq");
  d.zmq = "zmq:tcp://127.0.0.1:9";
  d.ranks = TD_GROUP_MAX_RANKS + 1;
  n = tandem__cluster__transfer_desc__pack(&d, buf);
  expect_refused(td_check_transfer_desc(buf, n, why, sizeof why), why, "ranks", "TransferDesc.ranks 17 exceeds 16");
  expect_refused(td_check_transfer_desc(buf, TD_TRANSFER_DESC_MAX_BYTES + 1, why, sizeof why), why, "too long",
                 "the KV descriptor has 65537 bytes");
}

/* ------------------------------------------------------------ router -> worker */

typedef struct rmsg {
  Tandem__Cluster__RouterMessage m;
  Tandem__Cluster__RequestSpec sp;
  Tandem__SamplingParams sa;
  Tandem__AudioFeatures af;
  Tandem__Cluster__DecodeJob dj;
  Tandem__Cluster__PrefillJob pj;
  Tandem__Cluster__EncodeJob ej;
  Tandem__Cluster__KvTarget kt;
  Tandem__Cluster__KvTarget *kts[3];
  Tandem__Cluster__RegisterAck ack;
  Tandem__Cluster__GroupInfo gi;
  Tandem__Cluster__Remove rm;
  int32_t ids[4], prompt[3], blocks[1];
  float feats[4];
  char *eps[2];
} rmsg;

static void valid_r(rmsg *x, Tandem__Cluster__RouterMessage__BodyCase b) {
  memset(x, 0, sizeof *x);
  tandem__cluster__router_message__init(&x->m);
  x->m.body_case = b;
  tandem__cluster__request_spec__init(&x->sp);
  tandem__sampling_params__init(&x->sa);
  x->ids[0] = 1, x->ids[1] = 2, x->ids[2] = 3, x->ids[3] = 4;
  x->prompt[0] = 0, x->prompt[1] = 7, x->prompt[2] = 8;
  x->sp.rid = 512;
  x->sp.input_ids = x->ids;
  x->sp.n_input_ids = 4;
  x->sp.decoder_prompt = x->prompt;
  x->sp.n_decoder_prompt = 3;
  x->sp.max_new_tokens = 10;
  x->sp.enc_len = 4;
  x->sp.sampling = &x->sa;
  x->sp.client_id = "a";
  x->blocks[0] = 1;
  tandem__cluster__kv_target__init(&x->kt);
  x->kt.worker_id = "decode-0";
  x->kt.desc.data = (uint8_t *)desc;
  x->kt.desc.len = sizeof desc - 1;
  x->kt.blocks = x->blocks;
  x->kt.n_blocks = 1;
  x->kt.tokens = 2;
  x->kts[0] = x->kts[1] = x->kts[2] = &x->kt;
  switch (b) {
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE:
      tandem__cluster__decode_job__init(&x->dj);
      x->dj.req = &x->sp;
      x->m.decode = &x->dj;
      break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL:
      tandem__cluster__prefill_job__init(&x->pj);
      x->pj.req = &x->sp;
      x->pj.self_target = &x->kt;
      x->pj.prefill_tokens = 2;
      x->m.prefill = &x->pj;
      break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE:
      tandem__cluster__encode_job__init(&x->ej);
      x->ej.req = &x->sp;
      x->ej.targets = x->kts;
      x->ej.n_targets = 1;
      x->m.encode = &x->ej;
      break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ACK:
      tandem__cluster__register_ack__init(&x->ack);
      x->ack.accepted = true;
      x->ack.heartbeat_ms = 500;
      x->ack.dead_after = 6;
      x->m.ack = &x->ack;
      break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO:
      tandem__cluster__group_info__init(&x->gi);
      x->eps[0] = "tcp://127.0.0.1:1", x->eps[1] = "tcp://127.0.0.1:2";
      x->gi.ok = true;
      x->gi.world = 2;
      x->gi.endpoints = x->eps;
      x->gi.n_endpoints = 2;
      x->m.group_info = &x->gi;
      break;
    case TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_REMOVE:
      tandem__cluster__remove__init(&x->rm);
      x->rm.reason = "removed";
      x->m.remove = &x->rm;
      break;
    default: break;
  }
}

typedef struct r_row {
  Tandem__Cluster__RouterMessage__BodyCase body;
  const char *field, *says;
  void (*bad)(rmsg *);
} r_row;

static void s_max_new_2g(rmsg *x) { x->sp.max_new_tokens = 0x80000000u; }
static void s_max_new_4g(rmsg *x) { x->sp.max_new_tokens = 0xffffffffu; }
static void s_enc_len(rmsg *x) { x->sp.enc_len = 0x80000000u; }
static void s_input_oov(rmsg *x) { x->ids[3] = V; }
static void s_prompt_neg(rmsg *x) { x->prompt[1] = -1; }
static void s_stop_many(rmsg *x) {
  static int32_t stop[TD_ROUTER_MAX_STOP_IDS + 1];
  x->sp.stop_token_ids = stop;
  x->sp.n_stop_token_ids = TD_ROUTER_MAX_STOP_IDS + 1;
}
static void s_step_offset(rmsg *x) { x->sp.step_offset = 3; }
static void s_features_nan(rmsg *x) {
  tandem__audio_features__init(&x->af);
  x->feats[2] = NAN;
  x->af.values = x->feats;
  x->af.n_values = 4;
  x->sp.features = &x->af;
}
static void s_client_id(rmsg *x) { x->sp.client_id = (char *)too_long(TD_ROUTER_MAX_REQUEST_ID + 1); }
static void s_temp(rmsg *x) { x->sa.temperature = -1; }
static void s_temp_inf(rmsg *x) { x->sa.temperature = INFINITY; }
static void s_top_p_nan(rmsg *x) { x->sa.top_p = NAN; }
static void s_top_p_inf(rmsg *x) { x->sa.top_p = INFINITY; }
static void s_top_k(rmsg *x) { x->sa.top_k = V + 1; }
static void s_n_2g(rmsg *x) { x->sa.n = 0x80000000u; }
static void s_beams(rmsg *x) { x->sa.num_beams = TD_ENGINE_MAX_BEAMS + 1; }
static void s_nret(rmsg *x) { x->sa.num_return_sequences = 0x80000000u; }
static void s_lp(rmsg *x) {
  x->sa.has_length_penalty = true;
  x->sa.length_penalty = NAN;
}
static void s_early(rmsg *x) { x->sa.early_stopping = 2; }
static void s_forced_bos(rmsg *x) {
  x->sa.set_forced_bos = true;
  x->sa.forced_bos_token_id = -5;
}
static void s_forced_eos(rmsg *x) {
  x->sa.set_forced_eos = true;
  x->sa.forced_eos_token_id = V;
}
static void s_ts_begin(rmsg *x) { x->sa.timestamp_begin = -1; }
static void s_max_init(rmsg *x) {
  x->sa.has_max_initial_timestamp = true;
  x->sa.max_initial_timestamp_index = 0x7fffffff;
}
static void s_allowed(rmsg *x) {
  static int32_t a[1] = {V};
  x->sa.allowed_token_ids = a;
  x->sa.n_allowed_token_ids = 1;
}
static void d_no_req(rmsg *x) { x->dj.req = NULL; }
static void d_both(rmsg *x) { x->dj.local_encode = x->dj.with_prefill = true, x->dj.prefill_tokens = 2; }
static void d_prefill_0(rmsg *x) { x->dj.with_prefill = true; }
static void d_prefill_all(rmsg *x) { x->dj.with_prefill = true, x->dj.prefill_tokens = 3; }
static void d_prefill_alone(rmsg *x) { x->dj.prefill_tokens = 2; }
static void p_tokens(rmsg *x) { x->pj.prefill_tokens = 1; }
static void p_no_target(rmsg *x) { x->pj.self_target = NULL; }
static void e_none(rmsg *x) { x->ej.n_targets = 0; }
static void e_three(rmsg *x) { x->ej.n_targets = 3; }
static void e_target(rmsg *x) { x->kt.desc.len = 0; }
static void a_hb(rmsg *x) { x->ack.heartbeat_ms = 0x80000000u; }
static void a_dead(rmsg *x) { x->ack.dead_after = TD_MAX_DEAD_AFTER + 1; }
static void g_world(rmsg *x) { x->gi.world = 3; }
static void g_ep(rmsg *x) { x->eps[1] = ""; }
static void g_nccl(rmsg *x) { x->gi.nccl_id.len = TD_GROUP_MAX_NCCL_ID + 1; }
static void rm_reason(rmsg *x) { x->rm.reason = (char *)too_long(TD_WIRE_MAX_REASON + 1); }

#define R(b) TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_##b
static const r_row r_rows[] = {
    {R(DECODE), "max_new_tokens 2^31", "RequestSpec.max_new_tokens 2147483648 exceeds 1048576", s_max_new_2g},
    {R(DECODE), "max_new_tokens 2^32-1", "RequestSpec.max_new_tokens 4294967295 exceeds", s_max_new_4g},
    {R(DECODE), "enc_len 2^31", "RequestSpec.enc_len 2147483648 exceeds", s_enc_len},
    {R(DECODE), "input id outside the vocabulary", "RequestSpec.input_ids[3] 100 is outside", s_input_oov},
    {R(DECODE), "negative prompt id", "RequestSpec.decoder_prompt[1] -1", s_prompt_neg},
    {R(DECODE), "too many stop ids", "RequestSpec.stop_token_ids holds 1025 entries, at most 1024", s_stop_many},
    {R(DECODE), "step offset past the prompt", "RequestSpec.step_offset 3: the resumed prompt has 3", s_step_offset},
    {R(DECODE), "NaN feature", "RequestSpec.features.values[2] is nan", s_features_nan},
    {R(DECODE), "client id too long", "RequestSpec.client_id has 256 bytes", s_client_id},
    {R(DECODE), "negative temperature", "SamplingParams.temperature -1", s_temp},
    {R(DECODE), "infinite temperature", "SamplingParams.temperature inf", s_temp_inf},
    {R(DECODE), "NaN top_p", "SamplingParams.top_p nan", s_top_p_nan},
    {R(DECODE), "infinite top_p", "SamplingParams.top_p inf", s_top_p_inf},
    {R(DECODE), "top_k past the vocabulary", "SamplingParams.top_k 101", s_top_k},
    {R(DECODE), "n 2^31", "SamplingParams.n 2147483648 exceeds 64", s_n_2g},
    {R(DECODE), "33 beams", "SamplingParams.num_beams 33 exceeds 32", s_beams},
    {R(DECODE), "num_return_sequences 2^31", "SamplingParams.num_return_sequences 2147483648", s_nret},
    {R(DECODE), "NaN length penalty", "SamplingParams.length_penalty nan", s_lp},
    {R(DECODE), "early_stopping 2", "SamplingParams.early_stopping 2", s_early},
    {R(DECODE), "forced BOS -5", "SamplingParams.forced_bos_token_id[0] -5", s_forced_bos},
    {R(DECODE), "forced EOS outside the vocabulary", "SamplingParams.forced_eos_token_id[0] 100", s_forced_eos},
    {R(DECODE), "timestamp_begin -1", "SamplingParams.timestamp_begin[0] -1", s_ts_begin},
    {R(DECODE), "max initial timestamp 2^31-1", "SamplingParams.max_initial_timestamp_index 2147483647", s_max_init},
    {R(DECODE), "allowed id outside the vocabulary", "SamplingParams.allowed_token_ids[0] 100", s_allowed},
    {R(DECODE), "no request", "the job has no RequestSpec", d_no_req},
    {R(DECODE), "local encode with a prefill worker", "local_encode and with_prefill together", d_both},
    {R(DECODE), "prefill of 0 tokens", "DecodeJob.prefill_tokens 0 for a prompt of 3", d_prefill_0},
    {R(DECODE), "prefill of the whole prompt", "DecodeJob.prefill_tokens 3 for a prompt of 3", d_prefill_all},
    {R(DECODE), "prefill tokens without a prefill worker", "without a prefill worker", d_prefill_alone},
    {R(PREFILL), "prefill tokens unlike the target's", "PrefillJob.prefill_tokens 1 for a prompt of 3 tokens and a "
                                                       "target of 2", p_tokens},
    {R(PREFILL), "no target", "PrefillJob.self_target is missing", p_no_target},
    {R(ENCODE), "no targets", "EncodeJob.targets holds 0 targets", e_none},
    {R(ENCODE), "three targets", "EncodeJob.targets holds 3 targets", e_three},
    {R(ENCODE), "a target without a descriptor", "EncodeJob.targets[0].desc", e_target},
    {R(ACK), "heartbeat 2^31 ms", "RegisterAck.heartbeat_ms 2147483648 exceeds 60000", a_hb},
    {R(ACK), "dead after 1001", "RegisterAck.dead_after 1001 exceeds 1000", a_dead},
    {R(GROUP_INFO), "world 3, 2 endpoints", "GroupInfo: world 3 with 2 endpoints", g_world},
    {R(GROUP_INFO), "an empty endpoint", "GroupInfo.endpoints[1] has 0 bytes", g_ep},
    {R(GROUP_INFO), "an NCCL id too long", "GroupInfo.nccl_id has 257 bytes", g_nccl},
    {R(REMOVE), "a reason too long", "Remove.reason has 4097 bytes", rm_reason},
};

Test(check, each_router_message_past_a_limit_is_refused_naming_the_field) {
  static const Tandem__Cluster__RouterMessage__BodyCase fine[] = {R(DECODE), R(PREFILL), R(ENCODE), R(ACK),
                                                                  R(GROUP_INFO), R(REMOVE)};
  rmsg x;
  char why[400];
  for (size_t i = 0; i < sizeof fine / sizeof *fine; i++) {
    valid_r(&x, fine[i]);
    cr_expect(td_check_router_message(&x.m, V, why, sizeof why), "a valid message %d: %s", (int)fine[i], why);
  }
  for (size_t i = 0; i < sizeof r_rows / sizeof *r_rows; i++) {
    valid_r(&x, r_rows[i].body);
    r_rows[i].bad(&x);
    why[0] = 0;
    expect_refused(td_check_router_message(&x.m, V, why, sizeof why), why, r_rows[i].field, r_rows[i].says);
  }
}

/* ------------------------------------------------------------ router -> client */

Test(check, a_clients_messages_past_a_limit_are_refused) {
  char why[256];
  int32_t t[2] = {1, 2};
  float lp[1] = {-1};
  Tandem__TokenChunk c = TANDEM__TOKEN_CHUNK__INIT;
  c.tokens = t;
  c.n_tokens = 2;
  Tandem__ServerMessage m = TANDEM__SERVER_MESSAGE__INIT;
  m.body_case = TANDEM__SERVER_MESSAGE__BODY_TOKENS;
  m.tokens = &c;
  cr_expect(td_check_server_message(&m, why, sizeof why), "%s", why);
  c.logprobs = lp;
  c.n_logprobs = 1;
  expect_refused(td_check_server_message(&m, why, sizeof why), why, "log-probs", "TokenChunk.logprobs has 1 values");
  c.n_logprobs = 0;
  c.offset = 0x80000000u;
  expect_refused(td_check_server_message(&m, why, sizeof why), why, "offset", "TokenChunk.offset 2147483648");
  c.offset = 0;
  Tandem__SequenceOutput o = TANDEM__SEQUENCE_OUTPUT__INIT, *os[TD_CLIENT_MAX_OUTPUTS + 1];
  for (int i = 0; i <= TD_CLIENT_MAX_OUTPUTS; i++) os[i] = &o;
  Tandem__GenerateResult g = TANDEM__GENERATE_RESULT__INIT;
  g.outputs = os;
  g.n_outputs = TD_CLIENT_MAX_OUTPUTS;
  m.body_case = TANDEM__SERVER_MESSAGE__BODY_RESULT;
  m.result = &g;
  cr_expect(td_check_server_message(&m, why, sizeof why), "%s", why);
  g.n_outputs = TD_CLIENT_MAX_OUTPUTS + 1;
  expect_refused(td_check_server_message(&m, why, sizeof why), why, "65 outputs",
                 "GenerateResult.outputs holds 65 sequences, at most 64");
  g.n_outputs = 1;
  o.tokens = t;
  o.n_tokens = 2;
  o.logprobs = lp;
  o.n_logprobs = 1;
  expect_refused(td_check_server_message(&m, why, sizeof why), why, "result log-probs",
                 "GenerateResult.outputs[0].logprobs has 1 values for 2 tokens");
}
