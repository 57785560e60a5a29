/* libFuzzer target: what a client sends the router and what the router
 * sends back. The first byte picks the direction; the rest is one message.
 * A ClientMessage goes through td_wire_unpack_client and, when it is a
 * GenerateRequest, the router's admission in its order (request id, inputs,
 * then td_admit_request) against a fixed T5-like and a Whisper-like model,
 * and an admitted one packed into the RequestSpec the router forwards to
 * workers, which must read it;
 * a ServerMessage through td_wire_unpack_server and td_check_server_message,
 * as the client library reads it (what it accepts fits the library's
 * arrays). Any bytes: a message or a refusal, never a crash or a leak. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/defaults.h"
#include "proto/check.h"
#include "proto/wire.h"
#include "router/policy.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void admit(const Tandem__GenerateRequest *g, uint8_t sel) {
  char msg[512];
  Tandem__ModelInfo mi = TANDEM__MODEL_INFO__INIT;
  mi.name = "t5-tiny";
  mi.model_type = "t5";
  mi.vocab_size = 100;
  mi.max_source_len = 64;
  mi.max_target_len = 32;
  if (sel & 2) { /* Whisper: features of mel_bins x frames */
    mi.name = "whisper-tiny";
    mi.model_type = "whisper";
    mi.mel_bins = 4;
    mi.frames = 6;
    mi.max_source_len = 3;
  }
  td_admit_frontend fe = {.text = sel & 4, .audio = sel & 8};
  (void)td_admit_request_id(g->request_id, msg, sizeof msg);
  if (td_admit_inputs(&fe, g, msg, sizeof msg) != TD_OK) return;
  td_req_shape sh;
  if (td_admit_request(&mi, 16, g, &sh, msg, sizeof msg) != TD_OK) return;
  /* what placement is then given: sane sizes */
  if (sh.enc_len < 0 || sh.n_prompt < 1 || sh.max_new < 0 || sh.width < 1 || sh.need_cross < 0 || sh.need_self < 0)
    abort();
  /* the parts router/requests.c forwards as they came */
  Tandem__Cluster__RequestSpec rs = TANDEM__CLUSTER__REQUEST_SPEC__INIT;
  rs.input_ids = g->input_ids;
  rs.n_input_ids = g->n_input_ids;
  rs.features = g->features;
  rs.sampling = g->sampling;
  rs.stop_token_ids = g->stop_token_ids;
  rs.n_stop_token_ids = g->n_stop_token_ids;
  size_t n = tandem__cluster__request_spec__get_packed_size(&rs);
  uint8_t *b = malloc(n ? n : 1);
  if (!b) return;
  tandem__cluster__request_spec__pack(&rs, b);
  Tandem__Cluster__RequestSpec *got = tandem__cluster__request_spec__unpack(NULL, n, b);
  if (!got) abort(); /* a worker would drop the job */
  tandem__cluster__request_spec__free_unpacked(got, NULL);
  free(b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  td_wire_frame f = {.data = (uint8_t *)data + 1, .len = size - 1};
  uint32_t ver;
  if (data[0] & 1) {
    Tandem__ServerMessage *m;
    if (td_wire_unpack_server(&f, &m, &ver) != TD_OK) return 0;
    char why[400];
    if (td_check_server_message(m, why, sizeof why) && m->body_case == TANDEM__SERVER_MESSAGE__BODY_RESULT &&
        m->result->n_outputs > TD_CLIENT_MAX_OUTPUTS)
      abort();
    tandem__server_message__free_unpacked(m, NULL);
    return 0;
  }
  Tandem__ClientMessage *m;
  if (td_wire_unpack_client(&f, &m, &ver) != TD_OK) return 0;
  if (m->body_case == TANDEM__CLIENT_MESSAGE__BODY_GENERATE && m->generate) admit(m->generate, data[0]);
  tandem__client_message__free_unpacked(m, NULL);
  return 0;
}
