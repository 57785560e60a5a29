/* The HTTP gateway: an OpenAI-compatible front of a Tandem cluster
 * (POST /v1/completions, /v1/audio/transcriptions, /v1/audio/translations,
 * GET /v1/models, /health). It tokenizes text and computes Whisper features
 * itself (frontend/) and sends ids and features to the router through the
 * client library; one thread owns the router connection and every HTTP
 * request shares it (docs/gateway.md). */
#ifndef TD_GATEWAY_GATEWAY_H
#define TD_GATEWAY_GATEWAY_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "proto/auth.h"

typedef struct td_gateway td_gateway;

/* A zero field takes its default (common/defaults.h, TD_GATEWAY_*). */
typedef struct td_gateway_opts {
  const char *router;        /* the router's client endpoint (required) */
  const td_auth *auth;       /* CURVE keys and the router's public key; NULL: plain (docs/security.md) */
  const char *model_dir;     /* config.json (and preprocessor_config.json for Whisper) (required) */
  const char *tokenizer_dir; /* tokenizer.json or Marian's spm pair; NULL: model_dir */
  const char *model_name;    /* the name clients give as "model"; NULL: model_dir's last component */
  const char *host;          /* listen address; NULL: TD_DEFAULT_LISTEN_HOST */
  int port;                  /* 0: TD_GATEWAY_DEFAULT_PORT; -1: any free port (td_gateway_port) */
  size_t max_body_bytes, max_json_bytes;
  size_t max_held_bytes;     /* uploads in memory at once, all requests together */
  int max_connections, max_requests, idle_timeout_s;
  uint32_t request_timeout_ms; /* a request's deadline at the router; 0: TD_DEFAULT_REQUEST_TIMEOUT_MS */
  double max_audio_seconds;
  int stream_interval_ms;    /* 0: TD_GATEWAY_STREAM_INTERVAL_MS; -1: an event for every arrival of tokens */
  int spin_us;               /* the router link and waiting HTTP threads poll this long before they sleep; 0: never */
  const char *api_keys_file; /* keys clients must give as "Authorization: Bearer KEY" for /v1/ (one a line,
                                mode 0600); NULL: none asked (docs/gateway.md, "API keys") */
} td_gateway_opts;

/* Loads the tokenizer (and the mel filters for Whisper), connects to the
 * router and starts serving. */
td_status td_gateway_create(const td_gateway_opts *o, td_gateway **out);
/* Stops serving: requests in flight end with an error, connections close. */
void td_gateway_destroy(td_gateway *g);
int td_gateway_port(const td_gateway *g);

#endif
