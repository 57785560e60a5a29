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
