/* Unpacking peers' messages (proto/wire.c): fields this version does not
 * know are dropped on receipt, so what the router forwards of a client's
 * request packs into bytes a worker reads (a fuzz_wire_cluster finding). */
#include <criterion/criterion.h>
#include <string.h>

#include "proto/wire.h"

/* ClientMessage{version 2, generate{request_id "r", input_ids [5], sampling{top_k 3,
 * field 0 (its tag in two bytes: 0x82 0x00) of 2 bytes}}} */
static const uint8_t client_msg[] = {0x08, 0x02, 0x12, 0x0f, 0x0a, 0x01, 'r', 0x1a, 0x01, 0x05, 0x32,
                                     0x07, 0x10, 0x03, 0x82, 0x00, 0x02, 0xaa, 0xbb};

Test(wire, unknown_fields_are_dropped_and_forwarded_parts_pack_again) {
  /* protobuf-c itself keeps the odd field, and packs it into bytes it refuses */
  Tandem__SamplingParams *raw = tandem__sampling_params__unpack(NULL, 7, client_msg + 12);
  cr_assert_not_null(raw);
  cr_assert_eq(raw->base.n_unknown_fields, 1);
  uint8_t b[64];
  size_t n = tandem__sampling_params__pack(raw, b);
  Tandem__SamplingParams *again = tandem__sampling_params__unpack(NULL, n, b);
  cr_assert_null(again, "protobuf-c now reads back its packing: this test's premise is gone");
  tandem__sampling_params__free_unpacked(raw, NULL);

  td_wire_frame f = {.data = (uint8_t *)client_msg, .len = sizeof client_msg};
  Tandem__ClientMessage *m;
  uint32_t ver;
  cr_assert_eq(td_wire_unpack_client(&f, &m, &ver), TD_OK, "%s", td_errmsg());
  cr_assert_eq(m->body_case, TANDEM__CLIENT_MESSAGE__BODY_GENERATE);
  Tandem__SamplingParams *sp = m->generate->sampling;
  cr_assert_not_null(sp);
  cr_assert_eq(sp->top_k, 3);
  cr_assert_eq(sp->base.n_unknown_fields, 0);
  /* as the router forwards it to a worker, inside a RequestSpec */
  Tandem__Cluster__RequestSpec rs = TANDEM__CLUSTER__REQUEST_SPEC__INIT;
  rs.rid = 1;
  rs.input_ids = m->generate->input_ids;
  rs.n_input_ids = m->generate->n_input_ids;
  rs.sampling = sp;
  n = tandem__cluster__request_spec__pack(&rs, b);
  Tandem__Cluster__RequestSpec *got = tandem__cluster__request_spec__unpack(NULL, n, b);
  cr_assert_not_null(got, "the worker cannot read the forwarded request");
  cr_assert_eq(got->sampling->top_k, 3);
  tandem__cluster__request_spec__free_unpacked(got, NULL);
  tandem__client_message__free_unpacked(m, NULL);
}

/* A DEALER / DEALER pair over inproc, for messages with a second frame. */
typedef struct pair {
  void *ctx, *a, *b;
} pair;

static pair pair_open(void) {
  pair p = {.ctx = zmq_ctx_new()};
  p.a = zmq_socket(p.ctx, ZMQ_DEALER);
  p.b = zmq_socket(p.ctx, ZMQ_DEALER);
  cr_assert_eq(zmq_bind(p.a, "inproc://wire-extra"), 0);
  cr_assert_eq(zmq_connect(p.b, "inproc://wire-extra"), 0);
  return p;
}

static void pair_close(pair *p) {
  zmq_close(p->a);
  zmq_close(p->b);
  zmq_ctx_term(p->ctx);
}

/* A generate request whose features' values follow in a frame of `bytes` bytes (0: no frame). */
static void send_framed(void *s, bool claim, uint32_t mel, uint32_t frames, size_t bytes, size_t n_inline) {
  static float inl[2] = {1, 2};
  Tandem__AudioFeatures af = TANDEM__AUDIO_FEATURES__INIT;
  af.values_in_frame = claim;
  af.mel_bins = mel;
  af.frames = frames;
  af.values = n_inline ? inl : NULL;
  af.n_values = n_inline;
  Tandem__GenerateRequest g = TANDEM__GENERATE_REQUEST__INIT;
  g.request_id = "r";
  g.features = &af;
  Tandem__ClientMessage m = TANDEM__CLIENT_MESSAGE__INIT;
  m.version = TD_PROTOCOL_VERSION;
  m.body_case = TANDEM__CLIENT_MESSAGE__BODY_GENERATE;
  m.generate = &g;
  zmq_msg_t x;
  cr_assert_eq(zmq_msg_init_size(&x, bytes), 0);
  for (size_t i = 0; i < bytes / sizeof(float); i++) ((float *)zmq_msg_data(&x))[i] = (float)i + 0.5f;
  cr_assert_eq(td_wire_send_extra(s, NULL, 0, &m.base, bytes ? &x : NULL), TD_OK);
  zmq_msg_close(&x);
}

/* What unpacking one message of the pair says: TD_OK and m, or the error. */
static td_status recv_client(void *s, Tandem__ClientMessage **m, td_wire_frame *f) {
  cr_assert_eq(td_wire_recv(s, false, true, f), TD_OK);
  uint32_t ver;
  return td_wire_unpack_client(f, m, &ver);
}

/* AudioFeatures.values_in_frame: the values come as the message's second
 * frame, which the sender's handle keeps (sent by reference); the frame is
 * there exactly when claimed and holds whole floats, as many as
 * mel_bins x frames where those are given; td_wire_features_inline puts
 * them in the message as if sent inline. */
Test(wire, features_in_a_second_frame) {
  pair p = pair_open();
  Tandem__ClientMessage *m;
  td_wire_frame f;
  send_framed(p.b, true, 2, 3, 24, 0);
  cr_assert_eq(recv_client(p.a, &m, &f), TD_OK, "%s", td_errmsg());
  cr_assert(f.has_extra);
  Tandem__AudioFeatures *af = m->generate->features;
  cr_expect(af->values_in_frame);
  cr_expect_eq(af->n_values, 0);
  cr_assert_eq(td_wire_features_inline(&f, af), TD_OK);
  cr_assert_eq(af->n_values, 6);
  cr_expect(!af->values_in_frame);
  for (int i = 0; i < 6; i++) cr_expect_float_eq(af->values[i], i + 0.5f, 0);
  td_wire_frame_free(&f);
  tandem__client_message__free_unpacked(m, NULL); /* the values are the message's now */
  /* without mel_bins and frames, any whole number of floats (the receiver checks its model's) */
  send_framed(p.b, true, 0, 0, 40, 0);
  cr_assert_eq(recv_client(p.a, &m, &f), TD_OK, "%s", td_errmsg());
  tandem__client_message__free_unpacked(m, NULL);
  td_wire_frame_free(&f);
  /* refusals */
  struct {
    bool claim;
    uint32_t mel, frames;
    size_t bytes, n_inline;
    const char *says;
  } bad[] = {
      {true, 2, 3, 0, 0, "no frame follows the message"},
      {false, 2, 3, 24, 0, "which no field of it claims"},
      {true, 2, 3, 20, 0, "2 x 3 values in a frame of 20 bytes (24 expected)"},
      {true, 0, 0, 6, 0, "not a whole number of float32"},
      {true, 1, 2, 8, 2, "2 values and values_in_frame"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    send_framed(p.b, bad[i].claim, bad[i].mel, bad[i].frames, bad[i].bytes, bad[i].n_inline);
    m = NULL;
    cr_expect_eq(recv_client(p.a, &m, &f), TD_ERR_FORMAT, "case %zu", i);
    cr_expect_null(m);
    cr_expect(strstr(td_errmsg(), bad[i].says), "case %zu: %s", i, td_errmsg());
    td_wire_frame_free(&f);
  }
  /* a third frame is refused by the receipt itself, and the next message still reads */
  zmq_send(p.b, "x", 1, ZMQ_SNDMORE);
  zmq_send(p.b, "y", 1, ZMQ_SNDMORE);
  zmq_send(p.b, "z", 1, 0);
  cr_expect_eq(td_wire_recv(p.a, false, true, &f), TD_ERR_FORMAT);
  cr_expect(strstr(td_errmsg(), "more than one frame after its body"), "%s", td_errmsg());
  td_wire_frame_free(&f);
  send_framed(p.b, true, 2, 3, 24, 0);
  cr_assert_eq(recv_client(p.a, &m, &f), TD_OK, "%s", td_errmsg());
  tandem__client_message__free_unpacked(m, NULL);
  td_wire_frame_free(&f);
  /* the other messages take no frame */
  Tandem__ServerMessage sm = TANDEM__SERVER_MESSAGE__INIT;
  sm.version = TD_PROTOCOL_VERSION;
  sm.request_id = "r";
  zmq_msg_t x;
  zmq_msg_init_size(&x, 8);
  cr_assert_eq(td_wire_send_extra(p.b, NULL, 0, &sm.base, &x), TD_OK);
  zmq_msg_close(&x);
  cr_assert_eq(td_wire_recv(p.a, false, true, &f), TD_OK);
  Tandem__ServerMessage *got = NULL;
  uint32_t ver;
  cr_expect_eq(td_wire_unpack_server(&f, &got, &ver), TD_ERR_FORMAT);
  cr_expect_null(got);
  td_wire_frame_free(&f);
  pair_close(&p);
}
