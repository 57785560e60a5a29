/* The HTTP server (libmicrohttpd, a thread a connection): routes, limits
 * (body, header, connections, requests in flight, idle time), uploads
 * (JSON bodies, multipart forms), GET /v1/models, /health and /metrics. The answers
 * to API requests are in serve.c. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>
#include <microhttpd.h>

#include "common/clock.h"
#include "common/log.h"
#include "gateway/gateway.h"
#include "gateway/internal.h"

struct td_gateway {
  td_gateway_opts o;
  gw_model m;
  gw_io *io;
  td_client *health; /* its own connection: a health check drops other requests' messages */
  pthread_mutex_t health_mu;
  struct MHD_Daemon *d;
  atomic_int in_flight;
  _Atomic size_t held; /* upload bytes in memory */
  int port;
  long long created;
  gw_metrics *metrics;
  gw_keys keys;             /* --api-keys: none loaded, none asked */
  _Atomic int64_t key_log_ms; /* when a refused key was last logged */
  atomic_int key_quiet;     /* refusals since, not logged */
};

const gw_model *gw_gateway_model(const td_gateway *g) { return &g->m; }
gw_io *gw_gateway_io(const td_gateway *g) { return g->io; }
uint32_t gw_gateway_timeout_ms(const td_gateway *g) { return g->o.request_timeout_ms; }
double gw_gateway_max_audio_seconds(const td_gateway *g) { return g->o.max_audio_seconds; }

bool gw_gateway_hold(td_gateway *g, size_t bytes) {
  if (atomic_fetch_add(&g->held, bytes) + bytes > g->o.max_held_bytes) {
    atomic_fetch_sub(&g->held, bytes);
    return false;
  }
  return true;
}

void gw_gateway_release(td_gateway *g, size_t bytes) { atomic_fetch_sub(&g->held, bytes); }
size_t gw_gateway_max_held_bytes(const td_gateway *g) { return g->o.max_held_bytes; }
int gw_gateway_stream_interval_ms(const td_gateway *g) { return g->o.stream_interval_ms > 0 ? g->o.stream_interval_ms : 0; }
int td_gateway_port(const td_gateway *g) { return g->port; }
gw_metrics *gw_gateway_metrics(const td_gateway *g) { return g->metrics; }

/* A connection's requests run on its own thread: the status of what the
 * handler queued reaches the connection through it. */
static _Thread_local int last_status;
void gw_note_status(int status) { last_status = status; }
int gw_take_status(void) {
  int s = last_status;
  last_status = 0;
  return s;
}

/* ---------------------------------------------------------------- replies */

int gw_reply(struct MHD_Connection *mc, int status, const char *ctype, char *body, size_t len) {
  struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
  if (!r) {
    free(body);
    return MHD_NO;
  }
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
  enum MHD_Result q = MHD_queue_response(mc, (unsigned)status, r);
  MHD_destroy_response(r);
  if (q == MHD_YES) gw_note_status(status);
  return q;
}

int gw_reply_error(struct MHD_Connection *mc, const gw_error *e) {
  char *s = gw_error_json(e);
  if (!s) return MHD_NO;
  if (e->http >= 500) TD_WARN("gateway: %d %s", e->http, e->message);
  return gw_reply(mc, e->http, "application/json", s, strlen(s));
}

static int reply_json(struct MHD_Connection *mc, int status, cJSON *o) {
  char *s = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  if (!s) return MHD_NO;
  return gw_reply(mc, status, "application/json", s, strlen(s));
}

/* ---------------------------------------------------------------- GET */

static cJSON *model_obj(const td_gateway *g) {
  cJSON *m = cJSON_CreateObject();
  cJSON_AddStringToObject(m, "id", g->m.name);
  cJSON_AddStringToObject(m, "object", "model");
  cJSON_AddNumberToObject(m, "created", (double)g->created);
  cJSON_AddStringToObject(m, "owned_by", "tandem");
  return m;
}

static int get_models(td_gateway *g, struct MHD_Connection *mc, const char *url) {
  if (!strcmp(url, "/v1/models")) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "object", "list");
    cJSON_AddItemToArray(cJSON_AddArrayToObject(o, "data"), model_obj(g));
    return reply_json(mc, 200, o);
  }
  const char *id = url + strlen("/v1/models/");
  if (strcmp(id, g->m.name) != 0) {
    gw_error e;
    gw_error_set(&e, 404, "model", "the model '%s' does not exist (this gateway serves '%s')", id, g->m.name);
    e.code = "model_not_found";
    return gw_reply_error(mc, &e);
  }
  return reply_json(mc, 200, model_obj(g));
}

static int get_health(td_gateway *g, struct MHD_Connection *mc) {
  td_client_health h;
  pthread_mutex_lock(&g->health_mu);
  td_status s = td_client_health_check(g->health, TD_GATEWAY_HEALTH_TIMEOUT_MS, &h);
  pthread_mutex_unlock(&g->health_mu);
  cJSON *o = cJSON_CreateObject();
  bool ok = s == TD_OK && h.serving && h.decoders > 0;
  cJSON_AddStringToObject(o, "status", ok ? "ok" : "unavailable");
  cJSON_AddStringToObject(o, "model", g->m.name);
  cJSON_AddNumberToObject(o, "requests_in_flight", atomic_load(&g->in_flight));
  if (s == TD_OK) {
    cJSON *r = cJSON_AddObjectToObject(o, "router");
    cJSON_AddBoolToObject(r, "serving", h.serving);
    cJSON_AddNumberToObject(r, "encoders", h.encoders);
    cJSON_AddNumberToObject(r, "prefills", h.prefills);
    cJSON_AddNumberToObject(r, "decoders", h.decoders);
    cJSON_AddNumberToObject(r, "in_flight", h.in_flight);
    cJSON_AddNumberToObject(r, "queued", h.queued);
  } else {
    cJSON_AddStringToObject(o, "error", td_errmsg());
  }
  return reply_json(mc, ok ? 200 : 503, o);
}

/* ---------------------------------------------------------------- uploads */

/* Applies a form field once its value is whole. */
static void field_done(gw_conn *c) {
  if (!c->field[0]) return;
  gw_audio_req *a = &c->audio;
  const char *k = c->field, *v = c->value.s ? c->value.s : "";
  /* each field once (the granularities are a list) */
  static const char *const once[] = {"model", "language", "prompt", "response_format", "temperature", "stream"};
  for (unsigned i = 0; i < sizeof once / sizeof *once && !c->err.http; i++)
    if (!strcmp(k, once[i])) {
      if (a->seen & (1u << i)) gw_error_set(&c->err, 400, k, "%s: the field is given twice", k);
      a->seen |= 1u << i;
    }
  if (c->err.http) {
    /* refused already */
  } else if (c->value.oom) {
    gw_error_set(&c->err, 500, k, "out of memory");
  } else if (!strcmp(k, "model")) {
    if (strlen(v) >= sizeof a->model)
      gw_error_set(&c->err, 400, k, "model: at most %zu bytes (GET /v1/models lists them)", sizeof a->model - 1);
    snprintf(a->model, sizeof a->model, "%s", v);
  } else if (!strcmp(k, "language")) {
    if (strlen(v) >= sizeof a->language) gw_error_set(&c->err, 400, k, "language: an ISO-639-1 code such as \"en\"");
    snprintf(a->language, sizeof a->language, "%s", v);
  } else if (!strcmp(k, "prompt")) {
    free(a->prompt);
    a->prompt = strdup(v);
  } else if (!strcmp(k, "response_format")) {
    snprintf(a->response_format, sizeof a->response_format, "%s", strlen(v) < sizeof a->response_format ? v : "?");
  } else if (!strcmp(k, "temperature")) {
    char *end;
    a->temperature = strtof(v, &end);
    a->has_temperature = true;
    if (end == v || *end) gw_error_set(&c->err, 400, k, "temperature: a number in [0, 1]");
  } else if (!strcmp(k, "stream")) {
    if (strcmp(v, "true") && strcmp(v, "false")) gw_error_set(&c->err, 400, k, "stream: true or false");
    a->stream = !strcmp(v, "true");
  } else if (!strcmp(k, "temperature_increment_on_fallback")) {
    gw_opt_num_parse(k, v, false, &a->lf.temperature_increment, &c->err);
  } else if (!strcmp(k, "compression_ratio_threshold")) {
    gw_opt_num_parse(k, v, true, &a->lf.compression_ratio_threshold, &c->err);
  } else if (!strcmp(k, "logprob_threshold")) {
    gw_opt_num_parse(k, v, true, &a->lf.logprob_threshold, &c->err);
  } else if (!strcmp(k, "no_speech_threshold")) {
    gw_opt_num_parse(k, v, true, &a->lf.no_speech_threshold, &c->err);
  } else if (!strcmp(k, "condition_on_previous_text")) {
    if (strcmp(v, "true") && strcmp(v, "false")) gw_error_set(&c->err, 400, k, "condition_on_previous_text: true or false");
    a->lf.condition_on_previous_text = !strcmp(v, "true");
    a->lf.condition_given = true;
  } else if (!strcmp(k, "timestamp_granularities[]") || !strcmp(k, "timestamp_granularities")) {
    if (!strcmp(v, "segment"))
      a->seg_timestamps = true;
    else if (!strcmp(v, "word"))
      a->word_timestamps = true;
    else
      gw_error_set(&c->err, 400, k, "timestamp_granularities: \"segment\" or \"word\"");
  } else if (!a->bad_field[0]) {
    snprintf(a->bad_field, sizeof a->bad_field, "%s", k);
  }
  c->field[0] = 0;
  gw_buf_free(&c->value);
}

static enum MHD_Result form_field(void *cls, enum MHD_ValueKind kind, const char *key, const char *filename,
                                  const char *content_type, const char *transfer_encoding, const char *data,
                                  uint64_t off, size_t size) {
  gw_conn *c = cls;
  if (c->err.http) return MHD_YES; /* refused already: drain */
  if (!key) key = "";
  if (!strcmp(key, "file")) {
    if (off == 0) {
      field_done(c);
      if (c->have_file) {
        gw_error_set(&c->err, 400, "file", "one file a request");
        return MHD_YES;
      }
      c->have_file = true;
    }
    if (c->body.n + size > c->g->o.max_body_bytes) {
      gw_error_set(&c->err, 413, "file", "the upload exceeds %zu bytes", c->g->o.max_body_bytes);
      return MHD_YES;
    }
    if (atomic_fetch_add(&c->g->held, size) + size > c->g->o.max_held_bytes) {
      atomic_fetch_sub(&c->g->held, size);
      gw_error_set(&c->err, 503, "file", "the gateway holds %zu bytes of uploads, its limit: try again shortly",
                   c->g->o.max_held_bytes);
      return MHD_YES;
    }
    c->held += size;
    gw_buf_add(&c->body, data, size);
    return MHD_YES;
  }
  if (off == 0 || strcmp(key, c->field) != 0) {
    field_done(c);
    snprintf(c->field, sizeof c->field, "%s", key);
  }
  if (c->value.n + size > TD_GATEWAY_MAX_STOP_BYTES * 64) {
    gw_error_set(&c->err, 413, key, "the form field '%s' is too long", key);
    return MHD_YES;
  }
  gw_buf_add(&c->value, data, size);
  return MHD_YES;
}

void gw_conn_drop_upload(gw_conn *c) {
  atomic_fetch_sub(&c->g->held, c->held);
  c->held = 0;
  gw_buf_free(&c->body);
}

/* ---------------------------------------------------------------- the handler */

static gw_route route_of(const char *url) {
  if (!strcmp(url, "/v1/completions")) return GW_R_COMPLETIONS;
  if (!strcmp(url, "/v1/audio/transcriptions")) return GW_R_TRANSCRIBE;
  if (!strcmp(url, "/v1/audio/translations")) return GW_R_TRANSLATE;
  return GW_R_NONE;
}

static int refuse(struct MHD_Connection *mc, int http, const char *fmt, const char *arg) {
  gw_error e;
  gw_error_set(&e, http, NULL, fmt, arg);
  return gw_reply_error(mc, &e);
}

/* The multipart body's closing delimiter from Content-Type's boundary. */
static void find_boundary(gw_conn *c, struct MHD_Connection *mc) {
  const char *ct = MHD_lookup_connection_value(mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE);
  const char *b = ct ? strstr(ct, "boundary=") : NULL;
  if (!b) return;
  b += strlen("boundary=");
  bool quoted = *b == '"';
  if (quoted) b++;
  size_t n = strcspn(b, quoted ? "\"" : "; \t");
  if (n == 0 || n + 5 > sizeof c->close_delim) return;
  snprintf(c->close_delim, sizeof c->close_delim, "--%.*s--", (int)n, b);
}

/* Feeds form data up to the closing delimiter and drops the epilogue after
 * it (RFC 2046 says to ignore it; libmicrohttpd's parser refuses it, and
 * clients such as openai's Node library send one). */
static bool feed_form(gw_conn *c, const char *data, size_t n) {
  if (c->closed) return true;
  size_t feed = n;
  size_t dl = strlen(c->close_delim);
  if (dl) {
    /* look in what was fed last plus this chunk, so a delimiter split between chunks is found */
    char *w = malloc(c->n_tail + n);
    if (!w) return false;
    memcpy(w, c->tail, c->n_tail);
    memcpy(w + c->n_tail, data, n);
    const char *p = memmem(w, c->n_tail + n, c->close_delim, dl);
    if (p) {
      size_t end = (size_t)(p - w) + dl;
      if (end + 2 <= c->n_tail + n && w[end] == '\r' && w[end + 1] == '\n') end += 2;
      feed = end > c->n_tail ? end - c->n_tail : 0;
      c->closed = true;
    } else {
      size_t keep = dl - 1 < c->n_tail + n ? dl - 1 : c->n_tail + n;
      memcpy(c->tail, w + c->n_tail + n - keep, keep);
      c->n_tail = keep;
    }
    free(w);
  }
  return feed == 0 || MHD_post_process(c->pp, data, feed) == MHD_YES;
}

static int get_metrics(td_gateway *g, struct MHD_Connection *mc) {
  char *text = NULL;
  size_t len = 0;
  if (gw_metrics_render(g->metrics, atomic_load(&g->in_flight), &text, &len) != TD_OK) {
    gw_error e;
    gw_error_set(&e, 500, NULL, "metrics: %s", td_errmsg());
    return gw_reply_error(mc, &e);
  }
  return gw_reply(mc, 200, "text/plain; version=0.0.4; charset=utf-8", text, len);
}

/* A refusal before the request has a connection state, counted. */
static enum MHD_Result refused(td_gateway *g, gw_route r, struct MHD_Connection *mc, int http, const char *fmt,
                               const char *arg) {
  gw_metrics_request(g->metrics, gw_route_name(r), http, -1, 0, 0, 0);
  return (enum MHD_Result)refuse(mc, http, fmt, arg);
}

/* The con_cls of a GET answered on its next call: a response queued on the
 * first call, before the request is read to its end, makes the HTTP library
 * close the connection after it ("Connection: close"), so that a client's
 * pool (bench-serve's warm connections, OpenAI clients) opened a connection,
 * and the gateway a thread, for every request after a GET. */
static char get_later;

static bool is_get_route(const char *url) {
  return !strcmp(url, "/metrics") || !strcmp(url, "/health") || !strcmp(url, "/v1/models") ||
         !strncmp(url, "/v1/models/", 11);
}

static enum MHD_Result answer_get(td_gateway *g, struct MHD_Connection *mc, const char *url) {
  if (!strcmp(url, "/metrics")) return (enum MHD_Result)get_metrics(g, mc);
  return (enum MHD_Result)(strcmp(url, "/health") ? get_models(g, mc, url) : get_health(g, mc));
}

/* 401 with OpenAI's error object and the scheme to use; logged at most once a second. */
static enum MHD_Result unauthorized(td_gateway *g, gw_route r, struct MHD_Connection *mc, const char *url,
                                    bool given) {
  gw_metrics_request(g->metrics, gw_route_name(r), 401, -1, 0, 0, 0);
  int64_t now = td_now_ms(), last = atomic_load(&g->key_log_ms);
  if (now - last >= 1000 && atomic_compare_exchange_strong(&g->key_log_ms, &last, now)) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(mc, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    char addr[INET_ADDRSTRLEN] = "?";
    if (ci && ci->client_addr && ci->client_addr->sa_family == AF_INET)
      inet_ntop(AF_INET, &((const struct sockaddr_in *)ci->client_addr)->sin_addr, addr, sizeof addr);
    TD_WARN("gateway: %s from %s refused: %s API key (%d more refused since the last such line)", url, addr,
            given ? "an unknown" : "no", atomic_exchange(&g->key_quiet, 0));
  } else {
    atomic_fetch_add(&g->key_quiet, 1);
  }
  gw_error e;
  gw_error_set(&e, 401, NULL,
               given ? "the API key given is not one this gateway accepts"
                     : "this gateway asks for an API key: send \"Authorization: Bearer KEY\"");
  char *s = gw_error_json(&e);
  if (!s) return MHD_NO;
  struct MHD_Response *resp = MHD_create_response_from_buffer(strlen(s), s, MHD_RESPMEM_MUST_FREE);
  if (!resp) {
    free(s);
    return MHD_NO;
  }
  MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
  MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
  enum MHD_Result q = MHD_queue_response(mc, 401, resp);
  MHD_destroy_response(resp);
  return q;
}

static enum MHD_Result first_call(td_gateway *g, struct MHD_Connection *mc, const char *url, const char *method,
                                  void **con_cls) {
  bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
  gw_route r = route_of(url);
  /* the API asks for a key where keys were given; /health and /metrics stay open to probes and scrapers */
  if (g->keys.n && !strncmp(url, "/v1/", 4)) {
    const char *au = MHD_lookup_connection_value(mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!gw_keys_admit(&g->keys, au)) return unauthorized(g, r, mc, url, au != NULL);
  }
  if (is_get_route(url)) {
    if (!get) return (enum MHD_Result)refuse(mc, 405, "%s: use GET", url);
    *con_cls = &get_later;
    return MHD_YES;
  }
  if (r == GW_R_NONE) return refused(g, r, mc, 404, "no such endpoint: %s", url);
  if (strcmp(method, "POST")) return refused(g, r, mc, 405, "%s: use POST", url);
  size_t limit = r == GW_R_COMPLETIONS ? g->o.max_json_bytes : g->o.max_body_bytes;
  const char *cl = MHD_lookup_connection_value(mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
  if (cl && strtoull(cl, NULL, 10) > limit) {
    gw_error e;
    gw_error_set(&e, 413, NULL, "the body of %s bytes exceeds this endpoint's %zu", cl, limit);
    gw_metrics_request(g->metrics, gw_route_name(r), 413, -1, 0, 0, 0);
    return (enum MHD_Result)gw_reply_error(mc, &e);
  }
  if (atomic_fetch_add(&g->in_flight, 1) >= g->o.max_requests) {
    atomic_fetch_sub(&g->in_flight, 1);
    gw_error e;
    gw_error_set(&e, 429, NULL, "%d requests in flight: the gateway's limit; try again shortly", g->o.max_requests);
    gw_metrics_request(g->metrics, gw_route_name(r), 429, -1, 0, 0, 0);
    return (enum MHD_Result)gw_reply_error(mc, &e);
  }
  gw_conn *c = calloc(1, sizeof *c);
  if (!c) {
    atomic_fetch_sub(&g->in_flight, 1);
    return MHD_NO;
  }
  c->g = g;
  c->route = r;
  c->arrived_ms = td_now_ms();
  c->arrived_ns = td_now_ns();
  c->audio.translate = r == GW_R_TRANSLATE;
  if (r != GW_R_COMPLETIONS) {
    c->pp = MHD_create_post_processor(mc, 64 * 1024, form_field, c);
    if (!c->pp) gw_error_set(&c->err, 400, NULL, "the body must be multipart/form-data");
    find_boundary(c, mc);
  }
  *con_cls = c;
  return MHD_YES;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *mc, const char *url, const char *method,
                              const char *version, const char *upload_data, size_t *upload_data_size,
                              void **con_cls) {
  td_gateway *g = cls;
  gw_conn *c = *con_cls;
  if (!c) return first_call(g, mc, url, method, con_cls);
  if (*con_cls == &get_later) {
    if (*upload_data_size) { /* a body on a GET: read and dropped */
      *upload_data_size = 0;
      return MHD_YES;
    }
    *con_cls = NULL;
    return answer_get(g, mc, url);
  }
  if (*upload_data_size) {
    size_t n = *upload_data_size;
    *upload_data_size = 0;
    if (c->err.http) return MHD_YES; /* refused: the rest is read and dropped */
    if (c->route == GW_R_COMPLETIONS) {
      if (c->body.n + n > g->o.max_json_bytes)
        gw_error_set(&c->err, 413, NULL, "the body exceeds this endpoint's %zu bytes", g->o.max_json_bytes);
      else
        gw_buf_add(&c->body, upload_data, n);
    } else if (!feed_form(c, upload_data, n) && !c->err.http) {
      gw_error_set(&c->err, 400, NULL, "a malformed multipart/form-data body");
    }
    if (c->body.oom && !c->err.http) gw_error_set(&c->err, 500, NULL, "out of memory");
    return MHD_YES;
  }
  if (c->answered) return MHD_YES;
  c->answered = true;
  if (c->pp) {
    if (MHD_destroy_post_processor(c->pp) != MHD_YES && !c->err.http)
      gw_error_set(&c->err, 400, NULL, "a malformed or truncated multipart/form-data body");
    c->pp = NULL;
    if (!c->err.http) field_done(c);
  }
  (void)gw_take_status();
  enum MHD_Result q = (enum MHD_Result)(c->err.http ? gw_reply_error(mc, &c->err)
                                        : c->route == GW_R_COMPLETIONS ? gw_serve_completions(c, mc)
                                                                        : gw_serve_audio(c, mc));
  c->status = gw_take_status();
  return q;
}

static void completed(void *cls, struct MHD_Connection *mc, void **con_cls, enum MHD_RequestTerminationCode toe) {
  td_gateway *g = cls;
  gw_conn *c = *con_cls;
  *con_cls = NULL;
  if (!c || (void *)c == (void *)&get_later) return;
  if (c->pp) MHD_destroy_post_processor(c->pp);
  int generated = c->generated; /* long-form: every window's tokens */
  for (int i = 0; i < c->n_ch; i++) generated += c->ch[i].t.n_tokens;
  /* a stream cut by the client counts as the status it started with */
  gw_metrics_request(g->metrics, gw_route_name(c->route), c->status, (double)(td_now_ms() - c->arrived_ms) / 1e3,
                     c->status == 200 ? c->prompt_tokens : 0, c->status == 200 ? generated : 0,
                     c->status == 200 ? c->duration : 0);
  gw_conn_drop_upload(c);
  gw_conn_free(c);
  atomic_fetch_sub(&g->in_flight, 1);
}

static void connection_note(void *cls, struct MHD_Connection *mc, void **socket_context,
                            enum MHD_ConnectionNotificationCode toe) {
  (void)mc;
  (void)socket_context;
  gw_metrics_connection(((td_gateway *)cls)->metrics, toe == MHD_CONNECTION_NOTIFY_STARTED);
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
  char msg[512];
  vsnprintf(msg, sizeof msg, fmt, ap);
  size_t n = strlen(msg);
  while (n && msg[n - 1] == '\n') msg[--n] = 0;
  TD_DEBUG("gateway: http: %s", msg);
}

/* ---------------------------------------------------------------- create / destroy */

td_status td_gateway_create(const td_gateway_opts *opts, td_gateway **out) {
  *out = NULL;
  if (!opts->router || !opts->model_dir) return td_err(TD_ERR_INVALID, "the gateway needs --router and --model");
  td_gateway *g = calloc(1, sizeof *g);
  if (!g) return td_err(TD_ERR_NOMEM, "out of memory");
  g->o = *opts;
  td_gateway_opts *o = &g->o;
  if (!o->host) o->host = TD_DEFAULT_LISTEN_HOST;
  if (!o->port) o->port = TD_GATEWAY_DEFAULT_PORT;
  if (!o->max_body_bytes) o->max_body_bytes = TD_GATEWAY_MAX_BODY_BYTES;
  if (!o->max_json_bytes) o->max_json_bytes = TD_GATEWAY_MAX_JSON_BYTES;
  if (!o->max_held_bytes) o->max_held_bytes = TD_GATEWAY_MAX_HELD_BYTES;
  if (!o->max_connections) o->max_connections = TD_GATEWAY_MAX_CONNECTIONS;
  if (!o->max_requests) o->max_requests = TD_GATEWAY_MAX_REQUESTS;
  if (!o->idle_timeout_s) o->idle_timeout_s = TD_GATEWAY_IDLE_TIMEOUT_S;
  if (!o->request_timeout_ms) o->request_timeout_ms = TD_DEFAULT_REQUEST_TIMEOUT_MS;
  if (!(o->max_audio_seconds > 0)) o->max_audio_seconds = TD_GATEWAY_MAX_AUDIO_SECONDS;
  if (!o->stream_interval_ms) o->stream_interval_ms = TD_GATEWAY_STREAM_INTERVAL_MS;
  pthread_mutex_init(&g->health_mu, NULL);
  g->created = (long long)time(NULL);
  td_status s = gw_metrics_create(&g->metrics);
  if (s == TD_OK && o->api_keys_file) s = gw_keys_load(o->api_keys_file, &g->keys);
  if (s == TD_OK) s = gw_model_load(o->model_dir, o->tokenizer_dir, o->model_name, &g->m);
  if (s == TD_OK) s = td_client_connect_auth(o->router, o->auth, &g->health);
  if (s == TD_OK) s = gw_io_create(o->router, o->auth, o->request_timeout_ms, o->spin_us, &g->io);
  if (s != TD_OK) {
    td_gateway_destroy(g);
    return s;
  }
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)(o->port < 0 ? 0 : o->port))};
  if (inet_pton(AF_INET, o->host, &sa.sin_addr) != 1) {
    td_gateway_destroy(g);
    return td_err(TD_ERR_INVALID, "gateway: %s is no IPv4 address", o->host);
  }
  g->d = MHD_start_daemon(
      MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ITC | MHD_USE_ERROR_LOG, 0, NULL, NULL, handle, g,
      MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa, MHD_OPTION_CONNECTION_LIMIT, (unsigned)o->max_connections,
      MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)o->idle_timeout_s, MHD_OPTION_CONNECTION_MEMORY_LIMIT,
      (size_t)TD_GATEWAY_CONN_MEMORY_BYTES, MHD_OPTION_NOTIFY_COMPLETED, completed, g, MHD_OPTION_NOTIFY_CONNECTION,
      connection_note, g, MHD_OPTION_EXTERNAL_LOGGER,
      mhd_log, NULL, MHD_OPTION_END);
  if (!g->d) {
    td_gateway_destroy(g);
    return td_err(TD_ERR_IO, "gateway: cannot listen on %s:%d (taken?)", o->host, o->port);
  }
  const union MHD_DaemonInfo *di = MHD_get_daemon_info(g->d, MHD_DAEMON_INFO_BIND_PORT);
  g->port = di ? di->port : o->port;
  *out = g;
  return TD_OK;
}

void td_gateway_destroy(td_gateway *g) {
  if (!g) return;
  if (g->d) MHD_quiesce_daemon(g->d);
  if (g->io) gw_io_stop(g->io); /* requests waiting on the router end now */
  if (g->d) MHD_stop_daemon(g->d);
  gw_io_destroy(g->io);
  td_client_close(g->health);
  gw_model_free(&g->m);
  gw_metrics_destroy(g->metrics);
  gw_keys_free(&g->keys);
  pthread_mutex_destroy(&g->health_mu);
  free(g);
}
