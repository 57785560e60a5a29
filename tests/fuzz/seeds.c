/* Writes the protobuf and binary seeds of tests/fuzz/corpus (the JSON and
 * safetensors seeds are copies of tests/data fixtures and hand-made files):
 * valid messages of each kind, each prefixed with the selector byte its
 * target reads first. Run by hand when the messages change:
 *   tests/fuzz/make_seeds.sh    (builds this and rewrites the seeds)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/defaults.h"
#include "kvtransfer/wire.h"
#include "proto/wire.h"

static const char *root;

static void put(const char *target, const char *name, uint8_t sel, const void *p, size_t n) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s/%s", root, target, name);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(&sel, 1, 1, f) != 1 || (n && fwrite(p, 1, n, f) != n) || fclose(f) != 0) {
    fprintf(stderr, "seeds: cannot write %s\n", path);
    exit(1);
  }
}

static void msg(const char *target, const char *name, uint8_t sel, const ProtobufCMessage *m) {
  size_t n = protobuf_c_message_get_packed_size(m);
  uint8_t *b = malloc(n + 1);
  protobuf_c_message_pack(m, b);
  put(target, name, sel, b, n);
  free(b);
}

static void client(void) {
  int32_t ids[] = {5, 6, 7, 1}, prompt[] = {0}, stops[] = {1}, allowed[] = {3, 4};
  Tandem__SamplingParams sp = TANDEM__SAMPLING_PARAMS__INIT;
  sp.num_beams = 4;
  sp.num_return_sequences = 2;
  sp.has_length_penalty = true;
  sp.length_penalty = 1.5f;
  sp.early_stopping = -1;
  sp.set_forced_bos = true;
  sp.forced_bos_token_id = 2;
  sp.n_allowed_token_ids = 2;
  sp.allowed_token_ids = allowed;
  Tandem__GenerateRequest g = TANDEM__GENERATE_REQUEST__INIT;
  g.request_id = "r1";
  g.model = "t5-tiny";
  g.n_input_ids = 4;
  g.input_ids = ids;
  g.n_decoder_prompt = 1;
  g.decoder_prompt = prompt;
  g.n_stop_token_ids = 1;
  g.stop_token_ids = stops;
  g.max_new_tokens = 8;
  g.stream = true;
  Tandem__ClientMessage m = TANDEM__CLIENT_MESSAGE__INIT;
  m.version = TD_PROTOCOL_VERSION;
  m.body_case = TANDEM__CLIENT_MESSAGE__BODY_GENERATE;
  m.generate = &g;
  msg("fuzz_wire_client", "generate_ids", 0, &m.base);
  g.sampling = &sp;
  msg("fuzz_wire_client", "generate_beams", 0, &m.base);
  /* sampling, n = 3 */
  Tandem__SamplingParams sp2 = TANDEM__SAMPLING_PARAMS__INIT;
  sp2.temperature = 0.7f;
  sp2.top_k = 5;
  sp2.top_p = 0.9f;
  sp2.has_seed = true;
  sp2.seed = 42;
  sp2.n = 3;
  sp2.logprobs = true;
  g.sampling = &sp2;
  msg("fuzz_wire_client", "generate_sample", 0, &m.base);
  /* Whisper features 4 x 6 */
  float v[24];
  for (int i = 0; i < 24; i++) v[i] = (float)i / 8.0f;
  Tandem__AudioFeatures af = TANDEM__AUDIO_FEATURES__INIT;
  af.mel_bins = 4;
  af.frames = 6;
  af.n_values = 24;
  af.values = v;
  Tandem__GenerateRequest w = TANDEM__GENERATE_REQUEST__INIT;
  w.request_id = "w1";
  w.features = &af;
  w.max_new_tokens = 4;
  m.generate = &w;
  msg("fuzz_wire_client", "generate_features", 2, &m.base);
  Tandem__GenerateRequest t = TANDEM__GENERATE_REQUEST__INIT;
  t.request_id = "t1";
  t.text = "translate English to German: one two three";
  m.generate = &t;
  msg("fuzz_wire_client", "generate_text", 4, &m.base);
  Tandem__GenerateRequest a = TANDEM__GENERATE_REQUEST__INIT;
  a.request_id = "a1";
  a.audio.len = 12;
  a.audio.data = (uint8_t *)"RIFF\0\0\0\0WAVE";
  a.language = "en";
  a.task = "transcribe";
  a.timestamps = true;
  m.generate = &a;
  msg("fuzz_wire_client", "generate_audio", 8 | 4 | 2, &m.base);
  Tandem__CancelRequest c = TANDEM__CANCEL_REQUEST__INIT;
  c.request_id = "r1";
  Tandem__ClientMessage mc = TANDEM__CLIENT_MESSAGE__INIT;
  mc.version = TD_PROTOCOL_VERSION;
  mc.body_case = TANDEM__CLIENT_MESSAGE__BODY_CANCEL;
  mc.cancel = &c;
  msg("fuzz_wire_client", "cancel", 0, &mc.base);
  Tandem__HealthRequest h = TANDEM__HEALTH_REQUEST__INIT;
  mc.body_case = TANDEM__CLIENT_MESSAGE__BODY_HEALTH;
  mc.health = &h;
  msg("fuzz_wire_client", "health", 0, &mc.base);
  mc.version = 1; /* another protocol version */
  msg("fuzz_wire_client", "old_version", 0, &mc.base);

  /* the router's answers */
  int32_t toks[] = {10, 11, 12};
  float lps[] = {-0.1f, -0.2f, -0.3f};
  Tandem__TokenChunk tc = TANDEM__TOKEN_CHUNK__INIT;
  tc.n_tokens = 3;
  tc.tokens = toks;
  tc.n_logprobs = 3;
  tc.logprobs = lps;
  tc.text = "eins zwei";
  tc.has_text = true;
  Tandem__ServerMessage s = TANDEM__SERVER_MESSAGE__INIT;
  s.version = TD_PROTOCOL_VERSION;
  s.request_id = "r1";
  s.body_case = TANDEM__SERVER_MESSAGE__BODY_TOKENS;
  s.tokens = &tc;
  msg("fuzz_wire_client", "server_tokens", 1, &s.base);
  Tandem__RequestChunk rc = TANDEM__REQUEST_CHUNK__INIT, *rcs[] = {&rc, &rc};
  rc.request_id = "r2";
  rc.chunk = &tc;
  Tandem__ChunkBatch cb = TANDEM__CHUNK_BATCH__INIT;
  cb.n_items = 2;
  cb.items = rcs;
  s.body_case = TANDEM__SERVER_MESSAGE__BODY_CHUNKS;
  s.chunks = &cb;
  msg("fuzz_wire_client", "server_chunks", 1, &s.base);
  Tandem__Error e = TANDEM__ERROR__INIT;
  e.code = TANDEM__ERROR_CODE__ERROR_OVERLOADED;
  e.message = "the requests held take 300 MB of client messages";
  s.body_case = TANDEM__SERVER_MESSAGE__BODY_ERROR;
  s.error = &e;
  msg("fuzz_wire_client", "server_error", 1, &s.base);
  /* a result with log-probs, text and segments, as the client library reads it */
  int32_t rt[] = {6, 18, 15, 1};
  float rl[] = {-0.1f, -0.2f, -0.3f, -0.4f};
  Tandem__Segment seg = TANDEM__SEGMENT__INIT, *segs[] = {&seg};
  seg.start = 0;
  seg.end = 1.5;
  seg.text = "42";
  Tandem__SequenceOutput so = TANDEM__SEQUENCE_OUTPUT__INIT, *sos[] = {&so, &so};
  so.n_tokens = 4;
  so.tokens = rt;
  so.n_logprobs = 4;
  so.logprobs = rl;
  so.finish_reason = TANDEM__FINISH_REASON__FINISH_STOP;
  so.text = "42";
  so.has_text = true;
  so.n_segments = 1;
  so.segments = segs;
  so.has_segments = true;
  Tandem__Timings tm = TANDEM__TIMINGS__INIT;
  tm.total_ms = 12;
  tm.attempts = 2;
  Tandem__GenerateResult gr = TANDEM__GENERATE_RESULT__INIT;
  gr.n_outputs = 2;
  gr.outputs = sos;
  gr.timings = &tm;
  s.request_id = "r1";
  s.body_case = TANDEM__SERVER_MESSAGE__BODY_RESULT;
  s.result = &gr;
  msg("fuzz_wire_client", "server_result", 1, &s.base);
  /* an operator's request */
  Tandem__AdminRequest ar = TANDEM__ADMIN_REQUEST__INIT;
  ar.action = TANDEM__ADMIN_ACTION__ADMIN_DRAIN;
  ar.worker_id = "decode-0";
  ar.request_id = "admin-1";
  Tandem__ClientMessage am = TANDEM__CLIENT_MESSAGE__INIT;
  am.version = TD_PROTOCOL_VERSION;
  am.body_case = TANDEM__CLIENT_MESSAGE__BODY_ADMIN;
  am.admin = &ar;
  msg("fuzz_wire_client", "admin_drain", 0, &am.base);
}

static void cluster(void) {
  Tandem__ModelInfo mi = TANDEM__MODEL_INFO__INIT;
  mi.name = "t5-tiny";
  mi.model_type = "t5";
  mi.vocab_size = 100;
  mi.max_source_len = 64;
  mi.max_target_len = 32;
  Tandem__Cluster__Role roles[] = {TANDEM__CLUSTER__ROLE__ROLE_ENCODE, TANDEM__CLUSTER__ROLE__ROLE_DECODE};
  Tandem__Cluster__WorkerInfo wi = TANDEM__CLUSTER__WORKER_INFO__INIT;
  wi.worker_id = "w0";
  wi.n_roles = 2;
  wi.roles = roles;
  wi.model = &mi;
  wi.tp = wi.pp = 1;
  wi.block_size = 16;
  wi.self_blocks = 64;
  wi.cross_blocks = 32;
  wi.max_running = 8;
  wi.transfer_desc.data = (uint8_t *)"zmq:tcp://127.0.0.1:5601";
  wi.transfer_desc.len = strlen((char *)wi.transfer_desc.data);
  wi.device = "cpu";
  wi.cross_mode = "dual";
  Tandem__Cluster__Register reg = TANDEM__CLUSTER__REGISTER__INIT;
  reg.info = &wi;
  Tandem__Cluster__WorkerMessage m = TANDEM__CLUSTER__WORKER_MESSAGE__INIT;
  m.version = TD_PROTOCOL_VERSION;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_REGISTER;
  m.register_ = &reg;
  msg("fuzz_wire_cluster", "register", 0, &m.base);
  Tandem__Cluster__Load ld = TANDEM__CLUSTER__LOAD__INIT;
  ld.queued = 2;
  ld.free_self_blocks = 60;
  ld.kv_in_zmq = 7;
  Tandem__Cluster__Heartbeat hb = TANDEM__CLUSTER__HEARTBEAT__INIT;
  hb.load = &ld;
  hb.seq = 9;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_HEARTBEAT;
  m.heartbeat = &hb;
  msg("fuzz_wire_cluster", "heartbeat", 0, &m.base);
  int32_t toks[] = {4, 5};
  Tandem__Cluster__Tokens tk = TANDEM__CLUSTER__TOKENS__INIT, *tks[] = {&tk, &tk};
  tk.rid = 3;
  tk.n_tokens = 2;
  tk.tokens = toks;
  Tandem__Cluster__TokensBatch tb = TANDEM__CLUSTER__TOKENS_BATCH__INIT;
  tb.n_items = 2;
  tb.items = tks;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS_BATCH;
  m.tokens_batch = &tb;
  msg("fuzz_wire_cluster", "tokens_batch", 0, &m.base);
  Tandem__Cluster__GroupJoin gj = TANDEM__CLUSTER__GROUP_JOIN__INIT;
  gj.group = "g0";
  gj.rank = 1;
  gj.world = 2;
  gj.endpoint = "tcp://127.0.0.1:7001";
  gj.cross_mode = "kv";
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_GROUP_JOIN;
  m.group_join = &gj;
  msg("fuzz_wire_cluster", "group_join", 0, &m.base);
  gj.cross_mode = "states"; /* an encoder group's join */
  gj.encoder_states = true;
  msg("fuzz_wire_cluster", "group_join_encoder", 0, &m.base);
  Tandem__Cluster__Failed fl = TANDEM__CLUSTER__FAILED__INIT;
  fl.rid = 3;
  fl.code = TANDEM__ERROR_CODE__ERROR_INTERNAL;
  fl.message = "out of blocks";
  fl.retryable = true;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FAILED;
  m.failed = &fl;
  msg("fuzz_wire_cluster", "failed", 0, &m.base);

  /* the router's messages to workers */
  int32_t ids[] = {5, 6, 7}, blocks[] = {0, 1};
  Tandem__Cluster__RequestSpec rs = TANDEM__CLUSTER__REQUEST_SPEC__INIT;
  rs.rid = 3;
  rs.n_input_ids = 3;
  rs.input_ids = ids;
  rs.max_new_tokens = 8;
  rs.enc_len = 3;
  rs.client_id = "c1";
  Tandem__Cluster__DecodeJob dj = TANDEM__CLUSTER__DECODE_JOB__INIT;
  dj.req = &rs;
  dj.local_encode = true;
  Tandem__Cluster__RouterMessage r = TANDEM__CLUSTER__ROUTER_MESSAGE__INIT;
  r.version = TD_PROTOCOL_VERSION;
  r.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE;
  r.decode = &dj;
  msg("fuzz_wire_cluster", "decode_job", 1, &r.base);
  Tandem__Cluster__KvTarget kt = TANDEM__CLUSTER__KV_TARGET__INIT, *kts[] = {&kt};
  kt.worker_id = "w1";
  kt.desc = wi.transfer_desc;
  kt.reservation = 11;
  kt.n_blocks = 2;
  kt.blocks = blocks;
  kt.tokens = 3;
  Tandem__Cluster__EncodeJob ej = TANDEM__CLUSTER__ENCODE_JOB__INIT;
  ej.req = &rs;
  ej.n_targets = 1;
  ej.targets = kts;
  r.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ENCODE;
  r.encode = &ej;
  msg("fuzz_wire_cluster", "encode_job", 1, &r.base);
  Tandem__Cluster__RegisterAck ack = TANDEM__CLUSTER__REGISTER_ACK__INIT;
  ack.accepted = true;
  ack.heartbeat_ms = 500;
  ack.dead_after = 4;
  r.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_ACK;
  r.ack = &ack;
  msg("fuzz_wire_cluster", "register_ack", 1, &r.base);
  char *eps[] = {"tcp://127.0.0.1:7000", "tcp://127.0.0.1:7001"};
  Tandem__Cluster__GroupInfo gi = TANDEM__CLUSTER__GROUP_INFO__INIT;
  gi.group = "g0";
  gi.world = 2;
  gi.n_endpoints = 2;
  gi.endpoints = eps;
  gi.ok = true;
  r.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_GROUP_INFO;
  r.group_info = &gi;
  msg("fuzz_wire_cluster", "group_info", 1, &r.base);

  /* every other message with fields (proto/check.c), and the bounds next to their limits */
  Tandem__Cluster__Reserved rv = TANDEM__CLUSTER__RESERVED__INIT;
  rv.rid = 3;
  rv.cross = &kt;
  rv.self = &kt;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_RESERVED;
  m.reserved = &rv;
  msg("fuzz_wire_cluster", "reserved", 0, &m.base);
  Tandem__Cluster__EncodeDone ed = TANDEM__CLUSTER__ENCODE_DONE__INIT;
  ed.rid = 3;
  ed.ms = 1.25;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_ENCODE_DONE;
  m.encode_done = &ed;
  msg("fuzz_wire_cluster", "encode_done", 0, &m.base);
  Tandem__Cluster__PrefillDone pd = TANDEM__CLUSTER__PREFILL_DONE__INIT;
  pd.rid = 3;
  pd.first_token = 99;
  pd.first_logprob = -0.5f;
  pd.ms = 2;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_PREFILL_DONE;
  m.prefill_done = &pd;
  msg("fuzz_wire_cluster", "prefill_done", 0, &m.base);
  float lps[] = {-0.25f, -3.0f};
  tk.logprobs = lps;
  tk.n_logprobs = 2;
  tk.sequence = 63;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_TOKENS;
  m.tokens = &tk;
  msg("fuzz_wire_cluster", "tokens_logprobs", 0, &m.base);
  Tandem__SequenceOutput so = TANDEM__SEQUENCE_OUTPUT__INIT, *sos[] = {&so};
  so.n_tokens = 2;
  so.tokens = toks;
  so.finish_reason = TANDEM__FINISH_REASON__FINISH_STOP;
  so.score = -1.5;
  so.n_logprobs = 2;
  so.logprobs = lps;
  Tandem__Cluster__Finished fin = TANDEM__CLUSTER__FINISHED__INIT;
  fin.rid = 3;
  fin.n_outputs = 1;
  fin.outputs = sos;
  fin.decode_ms = 12;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_FINISHED;
  m.finished = &fin;
  msg("fuzz_wire_cluster", "finished", 0, &m.base);
  Tandem__Cluster__Deregister dr = TANDEM__CLUSTER__DEREGISTER__INIT;
  dr.reason = "drained";
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_DEREGISTER;
  m.deregister = &dr;
  msg("fuzz_wire_cluster", "deregister", 0, &m.base);
  /* a registration at its limits: 2^24 tokens, 2^20 positions, 2^28 blocks */
  mi.vocab_size = TD_MODEL_MAX_VOCAB;
  mi.max_source_len = mi.max_target_len = TD_MODEL_MAX_POSITIONS;
  wi.self_blocks = wi.cross_blocks = TD_WORKER_MAX_BLOCKS;
  wi.max_running = TD_WORKER_MAX_RUNNING;
  wi.encode_batch_tokens = INT32_MAX;
  wi.block_size = TD_MAX_BLOCK_SIZE;
  m.body_case = TANDEM__CLUSTER__WORKER_MESSAGE__BODY_REGISTER;
  m.register_ = &reg;
  msg("fuzz_wire_cluster", "register_limits", 0, &m.base);

  int32_t prompt[] = {0, 7, 8}, stop[] = {1};
  Tandem__SamplingParams sa = TANDEM__SAMPLING_PARAMS__INIT;
  sa.temperature = 0.8f;
  sa.top_k = 100;
  sa.top_p = 0.95f;
  sa.n = 64;
  sa.set_forced_bos = true;
  sa.forced_bos_token_id = -1;
  sa.has_max_initial_timestamp = true;
  sa.max_initial_timestamp_index = 50;
  rs.n_decoder_prompt = 3;
  rs.decoder_prompt = prompt;
  rs.step_offset = 2;
  rs.n_stop_token_ids = 1;
  rs.stop_token_ids = stop;
  rs.sampling = &sa;
  rs.max_new_tokens = TD_MODEL_MAX_POSITIONS;
  Tandem__Cluster__PrefillJob pj = TANDEM__CLUSTER__PREFILL_JOB__INIT;
  pj.req = &rs;
  pj.self_target = &kt;
  pj.prefill_tokens = 2;
  kt.tokens = 2;
  r.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL;
  r.prefill = &pj;
  msg("fuzz_wire_cluster", "prefill_job", 1, &r.base);
  dj.local_encode = false;
  dj.with_prefill = true;
  dj.prefill_tokens = 2;
  r.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_DECODE;
  r.decode = &dj;
  msg("fuzz_wire_cluster", "decode_job_resumed", 1, &r.base);
  Tandem__Cluster__PrefillResult pr = TANDEM__CLUSTER__PREFILL_RESULT__INIT;
  pr.rid = 3;
  pr.first_token = 5;
  pr.first_logprob = -1;
  r.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_PREFILL_RESULT;
  r.prefill_result = &pr;
  msg("fuzz_wire_cluster", "prefill_result", 1, &r.base);
  Tandem__Cluster__Remove rm = TANDEM__CLUSTER__REMOVE__INIT;
  rm.reason = "removed by an operator";
  r.body_case = TANDEM__CLUSTER__ROUTER_MESSAGE__BODY_REMOVE;
  r.remove = &rm;
  msg("fuzz_wire_cluster", "remove", 1, &r.base);
}

static void kv(void) {
  static const uint8_t rkey[8] = {1, 2, 3, 4, 5, 6, 7, 8}, handle[KVX_IPC_HANDLE_LEN] = {9};
  kvx_desc d = {0};
  d.caps = KVX_CAP_NCCL;
  d.uuid = 0x1122334455667788ull;
  d.host_id = 42;
  d.pid = 1234;
  d.addr = (const uint8_t *)"ucx-worker-address";
  d.addr_len = 18;
  d.staging = true;
  d.stg_base = 0x10000;
  d.stg_slot_bytes = 1 << 20;
  d.stg_slots = 4;
  d.stg_rkey = rkey;
  d.stg_rkey_len = 8;
  d.ipc = true;
  snprintf(d.dev_id, sizeof d.dev_id, "0000:3b:00.0");
  d.n_pools = 2;
  for (int i = 0; i < 2; i++) {
    kvx_desc_pool *p = &d.pools[i];
    p->info.pool_id = (uint32_t)i;
    p->info.mem = i ? TD_KVX_MEM_CUDA : TD_KVX_MEM_HOST;
    p->info.direct = i == 1;
    p->info.n_blocks = 64;
    /* the GPU pool's K/V in int8 (version 4) */
    p->info.geom = (td_kvx_geom){.layout = {4, 4, 16, 16, i ? 64 : 0, i}, .elem_size = i ? 2 : 4, .layer0 = 0,
                                 .layer1 = 4, .head0 = 0, .head1 = 4};
    p->base = 0x200000;
    p->rkey = i ? rkey : NULL;
    p->rkey_len = i ? 8 : 0;
    p->info.ipc = i == 1;
    p->ipc_off = 4096;
    p->ipc_handle = handle;
  }
  uint8_t *b;
  size_t n;
  if (kvx_desc_encode(&d, &b, &n) != TD_OK) exit(1);
  put("fuzz_kv_desc", "desc_v4", 1, b, n);
  put("fuzz_kv_desc", "desc_v4_crcfix", 2, b, n);
  Tandem__Cluster__TransferDesc td = TANDEM__CLUSTER__TRANSFER_DESC__INIT;
  td.version = TD_PROTOCOL_VERSION;
  td.zmq = "zmq:tcp://127.0.0.1:5601";
  td.kvx.data = b;
  td.kvx.len = n;
  msg("fuzz_kv_desc", "transfer_desc", 0, &td.base);
  free(b);
  d.version = 3; /* before int8 layouts */
  d.pools[1].info.geom.layout.int8 = 0;
  if (kvx_desc_encode(&d, &b, &n) != TD_OK) exit(1);
  put("fuzz_kv_desc", "desc_v3", 1, b, n);
  put("fuzz_kv_desc", "desc_v3_crcfix", 2, b, n);
  free(b);
  d.version = 2; /* the older layout, no IPC */
  d.ipc = false;
  d.pools[1].info.ipc = false;
  if (kvx_desc_encode(&d, &b, &n) != TD_OK) exit(1);
  put("fuzz_kv_desc", "desc_v2", 1, b, n);
  free(b);
  int32_t blocks[] = {3, 4, 5};
  Tandem__Cluster__KvPush kp = TANDEM__CLUSTER__KV_PUSH__INIT;
  kp.version = TD_PROTOCOL_VERSION;
  kp.rid = 3;
  kp.reservation = 11;
  kp.cross = true;
  kp.n_blocks = 3;
  kp.blocks = blocks;
  kp.block_bytes = 4096;
  kp.push_id = 1;
  msg("fuzz_kv_desc", "kv_push", 3, &kp.base);
  Tandem__Cluster__KvAck ka = TANDEM__CLUSTER__KV_ACK__INIT;
  ka.version = TD_PROTOCOL_VERSION;
  ka.push_id = 1;
  ka.error = "KV push frame 2 has 100 bytes";
  msg("fuzz_kv_desc", "kv_ack", 3, &ka.base);
  /* a transfer request's geometry: a rank holding layers [2, 4) and heads [0, 2) of the pool's */
  for (int q8 = 0; q8 < 2; q8++) { /* float32 K/V, and int8 K/V with a states tail into the int8 pool */
    kvx_wbuf w = {0};
    kvx_w_u16(&w, q8 ? 2 : 4);
    const int32_t geom[2][5] = {{2, 2, 8, 16, 0}, {2, 2, 16, 16, 64}}, range[] = {2, 4, 0, 2};
    for (int i = 0; i < 5; i++) kvx_w_i32(&w, geom[q8][i]);
    kvx_w_u8(&w, (uint8_t)q8);
    for (int i = 0; i < 4; i++) kvx_w_i32(&w, range[i]);
    kvx_w_u32(&w, 2);
    const int32_t src[] = {0, 1}, dst[] = {7, 8};
    for (int i = 0; i < 2; i++) kvx_w_i32(&w, src[i]);
    for (int i = 0; i < 2; i++) kvx_w_i32(&w, dst[i]);
    put("fuzz_kv_desc", q8 ? "plan_slices_int8" : "plan_slices", 4, w.p, w.len);
    free(w.p);
  }
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: seeds CORPUS_DIR\n");
    return 2;
  }
  root = argv[1];
  client();
  cluster();
  kv();
  return 0;
}
