/* Every default and timeout of the system in one place: what options fall
 * back to when unset (0), and the fixed limits that admission checks. A
 * default changed here changes it for the router, the workers, the group
 * ranks and tandem-generate alike. */
#ifndef TD_COMMON_DEFAULTS_H
#define TD_COMMON_DEFAULTS_H

/* ---- KV cache and batching ---- */
#define TD_DEFAULT_BLOCK_SIZE 16        /* token slots a KV block */
#define TD_DEFAULT_MAX_SEQS 64          /* sequences a decode step (engine, tandem-generate) */
#define TD_DEFAULT_WORKER_MAX_BATCH 32  /* sequences a decode step on a worker */
#define TD_DEFAULT_MAX_TOKENS 1024      /* decoder rows a step (engine) */
#define TD_DEFAULT_WORKER_MAX_TOKENS 512 /* decoder rows a step on a worker */
#define TD_DEFAULT_MAX_ENC_TOKENS 4096  /* encoder tokens a batch */
#define TD_DEFAULT_MAX_ENC_SEQS 16      /* encoder sequences a batch */
#define TD_DEFAULT_ENGINE_QUEUE 4096    /* requests waiting in one engine */
#define TD_DEFAULT_ENGINE_ENCODE_DEFER 8 /* two running sets: steps a waiting request may wait for others to share its encoder run */
#define TD_DEFAULT_GPU_MEMORY_FRACTION 0.9 /* of a GPU's memory a worker (weights, workspace, KV pools) takes */
#define TD_DEFAULT_GPU_MAX_BATCH 256     /* sequences a decode step on a GPU (pools sized from memory) */
#define TD_DEFAULT_GPU_MAX_ENC_TOKENS 32768 /* encoder tokens a batch on a GPU: few, large encoder runs (bench/RESULTS.md, bench-serve) */
#define TD_DEFAULT_GPU_MAX_ENC_SEQS 128  /* encoder sequences a batch on a GPU */
#define TD_GPU_RESERVE_BYTES (1ull << 30) /* what a GPU backend holds beyond its own count: context, cuBLAS, graphs, NCCL */
#define TD_GPU_HEADROOM_BYTES (256ull << 20) /* left free on the device when pools are sized */
#define TD_DEFAULT_ENCODER_CACHE_FRACTION 0.25 /* of the cross pool the encoder cache may hold (tandem-worker, tandem-generate, bench-serve --engine) */
#define TD_ENGINE_WARM_SEQ_MAX 1024     /* the encoder's warm-up (engine/warm.c): text runs in sequences this long at most */
#define TD_ENGINE_WARM_MAX_RUNS 512     /* ... and no warm-up where plans come in more row buckets than this (unbucketed) */
#define TD_ENGINE_MAX_BEAMS 32          /* num_beams a request (the engine sizes its top-k buffers so) */

/* ---- router ---- */
#define TD_DEFAULT_HEARTBEAT_MS 500      /* both ways */
#define TD_DEFAULT_DEAD_AFTER 6          /* missed heartbeats before a peer is dead */
#define TD_DEFAULT_MAX_QUEUE 1024        /* requests waiting for placement */
#define TD_DEFAULT_MAX_IN_FLIGHT 4096    /* requests placed, not finished */
#define TD_DEFAULT_REQUEST_TIMEOUT_MS 600000 /* a request's deadline when the client gives none */
#define TD_DEFAULT_STAGE_TIMEOUT_MS 60000    /* reserve / encode / prefill stages */
#define TD_DEFAULT_MAX_ATTEMPTS 3        /* worker sets a request is tried on */
#define TD_DEFAULT_PREFILL_THRESHOLD 16  /* decoder prompts this long go to a prefill worker */
#define TD_DEFAULT_LOCAL_ENCODE_PCT 50  /* a decode worker that also encodes takes encoder runs while fewer than
                                           this % of its batch decode (router/placement.c) */
#define TD_ROUTER_MAX_ENCODE_RUNS 1000  /* --encode-queue-runs at most */
#define TD_ROUTER_MAX_EOS 16             /* EOS ids a model registers at most */
#define TD_ROUTER_ID_IN_USE "worker id in use:" /* a refusal the worker retries (worker/router_link.c) */
#define TD_WORKER_ID_WAIT_MS 30000       /* a worker whose id is in use retries this long, then gives up */
#define TD_DEFAULT_ENCODE_RUNS 3         /* an encoder's queue, in its runs: one running, one waiting, one whose
                                            KV is on its way (router/placement.c; docs/router.md) */
#define TD_MALLOC_KEEP_MAX (32 << 20)   /* TANDEM_MALLOC_KEEP: allocations up to this from the heap (glibc's
                                           largest mmap threshold) */
#define TD_MALLOC_KEEP_TRIM (512 << 20) /* ... and this much freed heap kept before it goes back to the system */
#define TD_DEFAULT_ROUTER_IO_THREADS 2   /* the router's ZeroMQ I/O threads: clients' and workers' connections
                                            on separate threads (a Whisper request's 1.5 MB crosses both) */
#define TD_ROUTER_MAX_IO_THREADS 16
#define TD_DEFAULT_CLIENT_ENDPOINT "tcp://127.0.0.1:7000" /* where the router serves clients */
#define TD_DEFAULT_WORKER_ENDPOINT "tcp://127.0.0.1:7001" /* where workers reach the router */
#define TD_ROUTER_TICK_MS 20             /* deadlines, stage timeouts, group ranks and the stop flag checked */
#define TD_DEFAULT_PROBE_TIMEOUT_MS 3000 /* a registering worker's advertised KV endpoint must answer a connect */
#define TD_ROUTER_MAX_PROBES 256         /* registrations whose endpoint is being checked at once; more wait */
#define TD_ROUTER_JOBS_PER_SEQ 4         /* requests placed on a decode worker per sequence it runs at once */
#define TD_ROUTER_MAX_SAMPLES 64         /* n a request (the decode workers' width bounds it too) */
#define TD_ROUTER_MAX_REQUEST_ID 255     /* bytes of a client's request id */
#define TD_ROUTER_MAX_ATTEMPTS 255       /* max_attempts' ceiling: the attempt is a byte of the request's rid */
#define TD_ROUTER_WORKER_BURST 4096     /* worker messages handled a wake-up (then clients and timers) */
#define TD_ROUTER_CLIENT_BURST 1024     /* client messages handled a wake-up */
#define TD_ROUTER_CLIENT_BURST_US 1000  /* ... and for this long at most: placement runs between wake-ups */
/* Bounds on what peers make the router hold (docs/limits.md). */
#define TD_DEFAULT_CAPACITY_WAIT_MS 10000 /* a queued request waits this long for a role no live worker has
                                             ("no encoder is registered"), then fails ERROR_UNAVAILABLE */
#define TD_CLIENT_MAX_MSG_BYTES (TD_MAX_AUDIO_BYTES + (1u << 20)) /* a client message: the largest part of a request
                                             is its audio file; larger drops the connection (the client library
                                             refuses to send one) */
#define TD_DEFAULT_MAX_HELD_BYTES (256u << 20) /* client messages of requests queued and in flight, together;
                                             beyond: ERROR_OVERLOADED */
#define TD_ROUTER_MAX_GROUPS 256         /* worker group rendezvous held (forming, failed, running); beyond: refused */
#define TD_DEFAULT_CLIENT_CONNECT_TIMEOUT_MS 5000 /* tandem-client: a router that does not answer by then is
                                             reported unreachable */
#define TD_CLIENT_ROUTER_WAIT_MS 5000     /* the client library: a request sent while no router connection is up
                                             waits this long for one, then fails "router unreachable" */
#define TD_WIRE_HEARTBEAT_IVL_MS 1000    /* ZeroMQ heartbeats on every Tandem socket: a PING this often ... */
#define TD_WIRE_HEARTBEAT_TIMEOUT_MS 5000 /* ... and a peer silent this long after one is disconnected (a client's
                                             requests on that connection then fail "router unreachable") */
#define TD_ADMIN_DEFAULT_TIMEOUT_MS 60000 /* tandem-admin: the router's answer, or wait-up / wait-gone */
#define TD_ADMIN_POLL_MS 200             /* tandem-admin wait-up / wait-gone: how often it asks the router */
/* Text and audio are converted in the router's one loop at admission: these
 * bound what one request costs it (docs/frontend.md). */
#define TD_MAX_TEXT_BYTES (64u << 10)    /* a request's text (a few ms to tokenize; models take <= 1-4k tokens) */
#define TD_MAX_AUDIO_BYTES (16u << 20)   /* a request's audio file (30 s of 48 kHz stereo 32-bit WAV: 11.5 MB) */
#define TD_MAX_AUDIO_SECONDS 30.0        /* one Whisper window (long-form runs in the gateway and tandem-generate) */
#define TD_MAX_LANGUAGE_BYTES 31         /* a request's Whisper language code */

/* What a peer's message may hold, field by field (proto/check.h; the table
 * in docs/limits.md, "Fields"): refused on receipt, before any field is used. */
#define TD_MODEL_MAX_VOCAB (1 << 24)       /* a registered model's vocabulary (token ids are int32) */
#define TD_MODEL_MAX_POSITIONS (1 << 20)   /* a registered model's max_source_len / max_target_len */
#define TD_MODEL_MAX_FRAMES (1 << 20)      /* a Whisper model's feature frames */
#define TD_MAX_BLOCK_SIZE 4096             /* token slots a KV block (a worker's --block-size) */
#define TD_WORKER_MAX_BLOCKS (1 << 28)     /* blocks a worker's pool registers (sums of them stay in an int) */
#define TD_WORKER_MAX_RUNNING (1 << 16)    /* sequences a worker's decode step registers */
#define TD_WIRE_MAX_NAME 255               /* a model's name and type, a device, a build version, a group */
#define TD_WIRE_MAX_REASON 4096            /* a Failed message, a Deregister or Remove reason */
#define TD_TRANSFER_DESC_MAX_BYTES (64u << 10) /* a worker's KV descriptor (TransferDesc) */
#define TD_ROUTER_MAX_STOP_IDS 1024        /* stop_token_ids a request */
#define TD_MAX_SPIN_US 100000              /* --spin-us of the router and workers: a loop polls this long at most */
#define TD_MAX_HEARTBEAT_MS 60000          /* a RegisterAck's heartbeat period */
#define TD_MAX_DEAD_AFTER 1000             /* a RegisterAck's missed heartbeats before death */
#define TD_CLIENT_MAX_OUTPUTS 64           /* sequences a result carries (n and num_beams are bounded below it) */

/* ---- workers and groups ---- */
#define TD_DEFAULT_RESERVATION_TTL_MS 30000 /* reserved KV blocks that nothing fills expire */
#define TD_DEFAULT_TRANSFER_TIMEOUT_MS 10000 /* a KV push with no answer fails */
#define TD_DEFAULT_KVX_TIMEOUT_MS 30000      /* a kvtransfer transfer's own deadline */
#define TD_DEFAULT_DRAIN_MS 30000            /* a draining worker's last wait for its requests */
#define TD_DEFAULT_REGISTER_RETRY_MS 1000    /* an unregistered worker asks again */
#define TD_WORKER_BURST_GAP_US 500           /* a burst of requests has ended after this long without one */
#define TD_WORKER_BURST_MAX_US 4000          /* an idle engine waits for a burst this long at most */
#define TD_GROUP_JOIN_TIMEOUT_MS 120000      /* every rank of a group joined through the router */
#define TD_GROUP_READY_TIMEOUT_MS 600000     /* a follower's first heartbeat after the rendezvous: it loads
                                                the model first (tens of GB); then the heartbeat rule */
#define TD_GROUP_CONNECT_TIMEOUT_MS 30000    /* a group's communicator connected */
#define TD_GROUP_MIRROR_TIMEOUT_MS 60000     /* every follower reached the leader's mirror */
#define TD_DEFAULT_LISTEN_HOST "127.0.0.1"
#define TD_WORKER_MAX_ROLES 4              /* roles one worker serves (td_worker_opts.roles) */
#define TD_ENCODER_SELF_BLOCKS_PER_SEQ 2   /* an encoder-only worker's self pool: token-sized, per max_batch */
#define TD_WORKER_EXPIRY_CHECK_MS 50       /* how often open reservations are checked for expiry */
#define TD_WORKER_STOP_CHECK_MS 50         /* how soon a stop (SIGTERM) or a finished drain is noticed */
#define TD_WORKER_COMPUTE_IDLE_MS 50       /* an idle compute thread looks at its queue again */
#define TD_KV_PUSH_MAX_BLOCKS 65536        /* blocks one ZeroMQ KV push carries */
#define TD_KV_HEADER_MAX_BYTES (1u << 20)  /* a KvPush header: TD_KV_PUSH_MAX_BLOCKS block ids (5 bytes each at most) */
#define TD_KV_DEFAULT_MAX_FRAME_BYTES (64u << 20) /* a ZeroMQ KV frame when the owner names no block size */
#define TD_KV_ACK_MAX_BYTES (64u << 10)    /* a KvAck (the sender's socket takes nothing larger) */
#define TD_KV_TOKEN_BYTES 16               /* a reservation's sender token (KvSender.token): 128 random bits */
#define TD_GROUP_MAX_RANKS 16              /* ranks of a TP / PP worker group (the router's rendezvous too) */
#define TD_GROUP_MAX_NAME 127              /* bytes of a group's name (GroupJoin.group) */
#define TD_GROUP_MAX_NCCL_ID 256           /* bytes of a GroupJoin's NCCL id (NCCL's are 128) */
#define TD_GROUP_HEARTBEAT_MS 200          /* leader -> followers when idle; followers -> router */
#define TD_GROUP_LEADER_DEAD_MS 5000       /* a follower gives up on a silent leader */
#define TD_GROUP_JOIN_RESEND_MS 2000       /* a joining rank asks the router again */
#define TD_GROUP_MIRROR_IN_MAX_BYTES 1024  /* a follower's message to its leader (hello, heartbeat; a CURVE handshake's, about 300) */

/* ---- kvtransfer (td_kvx_opts left 0; the protocol's grace periods) ---- */
#define TD_DEFAULT_KVX_STAGING_SLOTS 8                /* pinned staging slots per side */
#define TD_DEFAULT_KVX_STAGING_SLOT_BYTES (4u << 20)  /* docs/kvtransfer.md, "Staged UCX" */
#define TD_DEFAULT_KVX_STAGING_CHUNK_BYTES (2u << 20) /* the staged pipeline's steady chunk */
#define TD_DEFAULT_KVX_NCCL_CHUNK_BYTES (8ull << 20)  /* the NCCL pipeline's largest chunk */
#define TD_DEFAULT_KVX_IPC_KERNEL_BELOW (256u << 10)  /* CUDA IPC pieces smaller on average: the gather kernel */
#define TD_KVX_STOP_GRACE_MS 3000   /* a stopping transfer's flush ends by then, or the peer is failed */
#define TD_KVX_GRANT_GRACE_MS 2000  /* a grant outlives the sender's deadline by this; a revoked one twice */
#define TD_KVX_DESTROY_STOP_MS 500  /* td_kvx_destroy lets transfers stop cleanly this long */
#define TD_KVX_DESTROY_CLOSE_MS 200 /* then waits this long for UCX operations to complete */

/* ---- front end: audio (td_audio_limits left 0; docs/audio.md) ---- */
#define TD_DEFAULT_AUDIO_MAX_SECONDS 3600.0 /* longest audio decoded (an hour of 16 kHz floats: 230 MB) */
#define TD_AUDIO_MAX_CHANNELS 64            /* more is no recording a person makes */
#define TD_AUDIO_MIN_RATE 1000              /* Hz; below it nothing of speech is left */
#define TD_AUDIO_MAX_RATE 768000            /* Hz; the highest rate audio interfaces record */
#define TD_AUDIO_MAX_SAMPLE_ABS 1e6         /* |sample| (full scale is 1): keeps every power finite in float32 */
#define TD_MEL_DEFAULT_WINDOW_SECONDS 30    /* WhisperFeatureExtractor's chunk_length */
#define TD_MEL_MAX_WINDOW_SECONDS 600       /* a preprocessor_config.json asking more is refused */
#define TD_MEL_MAX_MELS 256                 /* feature_size (Whisper: 80 or 128) */

/* ---- front end: tokenizer ---- */
#define TD_TOKENIZER_MAX_TEXT_BYTES (16u << 20) /* text one encode call takes */
#define TD_TOKENIZER_MAX_FILE_BYTES (256u << 20) /* tokenizer.json and friends (multilingual vocabularies run to tens of MB) */
#define TD_TOKENIZER_MAX_VOCAB (1 << 24)        /* token ids a tokenizer may name */

/* ---- metrics (docs/metrics.md) ---- */
#define TD_METRICS_MAX_LABELS 4           /* label names a metric family */
#define TD_METRICS_MAX_SERIES 4096        /* series a family holds; new ones past it are dropped and counted */
#define TD_METRICS_PUBLISH_MS 250         /* the router renders /metrics' text this often (a scrape's staleness) */
#define TD_METRICS_HEALTH_STALE_MS 5000   /* /health answers 503 once the loop has not published for this long */
#define TD_METRICS_DEFAULT_HOST "127.0.0.1" /* --metrics-host: loopback unless asked */
#define TD_METRICS_MAX_CONNECTIONS 64     /* open /metrics connections */
#define TD_METRICS_IDLE_TIMEOUT_S 10      /* a /metrics connection that sends nothing this long is closed */

/* ---- gateway (tandem-gateway, td_gateway_opts left 0; docs/gateway.md) ---- */
#define TD_GATEWAY_DEFAULT_PORT 8000
#define TD_GATEWAY_MAX_BODY_BYTES (25u << 20)  /* an upload (OpenAI's audio limit); larger: 413 */
#define TD_GATEWAY_MAX_JSON_BYTES (2u << 20)   /* a JSON request body; larger: 413 */
#define TD_GATEWAY_MAX_HELD_BYTES (1ull << 30) /* uploads held at once, all connections together; more: 503 */
#define TD_GATEWAY_MAX_CONNECTIONS 512         /* open HTTP connections (one thread each); more are closed */
#define TD_GATEWAY_MAX_REQUESTS 256            /* API requests in flight; more: 429 */
#define TD_GATEWAY_CONN_MEMORY_BYTES (64u << 10) /* a connection's buffer: request line and headers must fit (431) */
#define TD_GATEWAY_IDLE_TIMEOUT_S 30           /* a connection that sends nothing this long is closed */
#define TD_GATEWAY_MAX_PROMPTS 32              /* prompts one completion request batches */
#define TD_GATEWAY_MAX_STOP 4                  /* stop strings (OpenAI's limit) */
#define TD_GATEWAY_MAX_STOP_BYTES 256          /* bytes of one stop string */
#define TD_GATEWAY_MAX_USER_BYTES 256          /* a completion's "user" (OpenAI's end-user id) */
#define TD_GATEWAY_MAX_TOKENS 65536            /* max_tokens beyond this is refused before the router sees it */
#define TD_GATEWAY_DEFAULT_MAX_TOKENS 16       /* OpenAI's default max_tokens for completions */
#define TD_GATEWAY_MAX_AUDIO_SECONDS 600.0     /* audio decoded at most (longer: 400); beyond the model's window:
                                                  long-form, its whole features held (counted in max_held_bytes) */
/* Long-form transcription's defaults (docs/gateway.md): OpenAI whisper's
 * transcribe, the compression ratio as transformers computes it (zlib over
 * token ids, where whisper's 2.4 is over text). */
#define TD_LONGFORM_TEMPERATURE_STEP 0.2       /* temperature_increment_on_fallback: 0, 0.2, ... 1.0 */
#define TD_LONGFORM_COMPRESSION_RATIO 1.35     /* compression_ratio_threshold (transformers' documented value) */
#define TD_LONGFORM_LOGPROB -1.0               /* logprob_threshold */
#define TD_LONGFORM_NO_SPEECH 0.6              /* no_speech_threshold */
#define TD_LONGFORM_SAMPLE_TOP_K 50            /* a sampled window's top-k: transformers' GenerationConfig default */
#define TD_GATEWAY_STREAM_INTERVAL_MS 5         /* a stream's events after the first come at most this often (docs/gateway.md) */
#define TD_GATEWAY_IO_POLL_MS 20               /* the router link's poll while requests are in flight (new work
                                                  wakes it at once: gateway/io.c) */
#define TD_GATEWAY_MAX_API_KEYS 1024           /* keys in --api-keys FILE */
#define TD_GATEWAY_MAX_API_KEY_BYTES 256       /* one key's bytes */
#define TD_GATEWAY_HEALTH_TIMEOUT_MS 1000      /* GET /health waits this long for the router */
#define TD_GATEWAY_WAIT_GRACE_MS 10000         /* a request's HTTP side waits this long past its router deadline */

/* ---- CUDA backend tuning (td_cuda_tuning's zero values; measured best on
 * H100: docs/cuda.md, "Tuning knobs") ---- */
#define TD_CUDA_DEFAULT_AUTOTUNE_MIN 10000 /* TANDEM_CUDA_AUTOTUNE: GEMMs of m*n*k from this many million */
#define TD_CUDA_DEFAULT_SKINNY_ROWS 16     /* few-row GEMMs on the skinny kernel up to this many rows */
#define TD_CUDA_DEFAULT_GEMV_MAXV 8        /* one-row GEMMs on a warp a column: k up to 256 x this */
#define TD_CUDA_DEFAULT_GEMV_MAXN 8192     /* ... and up to this many columns */
#define TD_CUDA_DEFAULT_GEMV_ROWS 2        /* rows the warp kernel takes at k <= 1024 */
#define TD_CUDA_DEFAULT_GEMV_ROWS_N 8192   /* ... up to this many columns */
#define TD_CUDA_DEFAULT_FUSE_ROWS 8        /* td_gemm_ex on the fused decode kernel up to this many rows */
#define TD_CUDA_DEFAULT_FUSE_MASK 15       /* ... fusing the norm, GLU, the KV write; RMS after beyond */
#define TD_CUDA_DEFAULT_DENSE64_WAVE 5     /* dense attention, a grid of one wave: the keys in halves (2: one block) */
#define TD_CUDA_DEFAULT_DECODE_WARP 256    /* decode attention on 2 warps a pair from this many pairs */
#define TD_CUDA_DEFAULT_DECODE_SMALL 64    /* 16 warps a pair up to this many pairs */
#define TD_CUDA_DEFAULT_DECODE_SMALL_MIN 8 /* ... from this many (a TP=4 rank's 8 heads of Flan-T5-XL at batch 1) */
#define TD_CUDA_DEFAULT_DECODE_SMALL_CTX 1024 /* ... for contexts up to this long */
#define TD_CUDA_DEFAULT_DECODE_BULK 128    /* decode attention by bulk copies from this many pairs */
#define TD_CUDA_DEFAULT_DECODE_BULK_ALL 256 /* ... over self K/V up to this many */
#define TD_CUDA_DEFAULT_DECODE_BULK_EARLY 128 /* ... its self K/V copied before the wait up to this many */
#define TD_CUDA_DEFAULT_DECODE_BULK_CARVE 75 /* its shared-memory share of L1, percent */
#define TD_CUDA_DEFAULT_KVPF_SEQS 32       /* td_kv_prefetch from this many sequences */

/* CURVE (proto/auth.c, docs/security.md) */
#define TD_AUTH_MAX_KEYS 4096  /* public keys a list file may hold; more is refused at start */
#define TD_AUTH_ZAP_POLL_MS 100 /* how soon a ZAP handler's thread sees its stop flag */
#define TD_AUTH_REFUSAL_LOG_MS 10000 /* a refused peer retries every 100 ms: its refusal is logged once this often */
#define TD_AUTH_MAX_BOUND_IDS 65536 /* with keys: worker ids the router binds to the key that first registered them */
#define TD_AUTH_REFUSAL_LOG_KEYS 1024 /* refusals remembered for that; past it the memory starts over */
#define TD_AUTH_GROUP_WAIT_MS 20000 /* a group handshake waits this long for the rendezvous to name the ranks */

#endif
