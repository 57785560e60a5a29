#include "proto/auth.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <uthash.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/log.h"

#define ZAP_ENDPOINT "inproc://zeromq.zap.01"

typedef struct keyent {
  char z85[TD_AUTH_KEY_Z85];
  UT_hash_handle hh;
} keyent;

struct td_auth {
  char secret[TD_AUTH_KEY_Z85], public[TD_AUTH_KEY_Z85], router[TD_AUTH_KEY_Z85];
  bool has_router;
  keyent *workers, *clients, *admins;
};

bool td_auth_available(void) { return zmq_has("curve") != 0; }

static bool z85_ok(const char *s) {
  uint8_t bin[32];
  return strlen(s) == 40 && zmq_z85_decode(bin, s) != NULL;
}

/* The first line without its newline and surrounding blanks; false when it is not one key. */
static bool clean_line(char *line, char out[TD_AUTH_KEY_Z85]) {
  char *s = line;
  while (*s == ' ' || *s == '\t') s++;
  size_t n = strlen(s);
  while (n && (s[n - 1] == '\n' || s[n - 1] == '\r' || s[n - 1] == ' ' || s[n - 1] == '\t')) s[--n] = 0;
  if (n != 40) return false;
  memcpy(out, s, 41);
  return z85_ok(out);
}

td_status td_auth_read_key(const char *path, bool secret, char out[TD_AUTH_KEY_Z85]) {
  FILE *f = fopen(path, "r");
  if (!f) return td_err(TD_ERR_IO, "cannot read the key file %s: %s", path, strerror(errno));
  struct stat st;
  if (secret && fstat(fileno(f), &st) == 0 && (st.st_mode & 077)) {
    fclose(f);
    return td_err(TD_ERR_INVALID, "the secret key file %s is readable by others (mode %03o): chmod 600 it", path,
                  (unsigned)(st.st_mode & 0777));
  }
  char line[256];
  bool ok = fgets(line, sizeof line, f) && clean_line(line, out);
  memset(line, 0, sizeof line);
  fclose(f);
  if (!ok) {
    memset(out, 0, TD_AUTH_KEY_Z85);
    return td_err(TD_ERR_FORMAT, "the key file %s does not hold one Z85 key of 40 characters on its first line", path);
  }
  return TD_OK;
}

static void free_list(keyent **h) {
  keyent *e, *t;
  HASH_ITER(hh, *h, e, t) {
    HASH_DEL(*h, e);
    free(e);
  }
}

static td_status read_list(const char *path, keyent **out) {
  FILE *f = fopen(path, "r");
  if (!f) return td_err(TD_ERR_IO, "cannot read the key list %s: %s", path, strerror(errno));
  char line[256];
  int ln = 0, n = 0;
  td_status s = TD_OK;
  while (s == TD_OK && fgets(line, sizeof line, f)) {
    ln++;
    char *p = line;
    while (*p == ' ' || *p == '\t') p++;
    if (*p == '#' || *p == '\n' || *p == '\r' || *p == 0) continue;
    char k[TD_AUTH_KEY_Z85];
    if (!clean_line(p, k)) {
      s = td_err(TD_ERR_FORMAT, "%s line %d: not a Z85 public key of 40 characters", path, ln);
      break;
    }
    keyent *e = NULL;
    HASH_FIND_STR(*out, k, e);
    if (e) continue;
    if (++n > TD_AUTH_MAX_KEYS) {
      s = td_err(TD_ERR_INVALID, "%s holds more than %d keys", path, TD_AUTH_MAX_KEYS);
      break;
    }
    e = calloc(1, sizeof *e);
    if (!e) {
      s = td_err(TD_ERR_NOMEM, "out of memory");
      break;
    }
    memcpy(e->z85, k, sizeof k);
    HASH_ADD_STR(*out, z85, e);
  }
  fclose(f);
  if (s != TD_OK) free_list(out);
  return s;
}

td_status td_auth_create_client(const td_auth_opts *o, td_auth **out) {
  *out = NULL;
  if (o->secret_file && !o->router_key_file) return td_err(TD_ERR_INVALID, "--curve-secret needs --router-key");
  return td_auth_create(o, out);
}

td_status td_auth_create(const td_auth_opts *o, td_auth **out) {
  *out = NULL;
  bool any = o->secret_file || o->router_key_file || o->worker_keys_file || o->client_keys_file || o->admin_keys_file;
  if (!any) return TD_OK;
  if (!td_auth_available())
    return td_err(TD_ERR_UNSUPPORTED, "keys are configured but this libzmq has no CURVE (zmq_has(\"curve\") is false)");
  if (!o->secret_file) return td_err(TD_ERR_INVALID, "key lists or a router key are configured without a secret key file");
  td_auth *a = calloc(1, sizeof *a);
  if (!a) return td_err(TD_ERR_NOMEM, "out of memory");
  td_status s = td_auth_read_key(o->secret_file, true, a->secret);
  if (s == TD_OK && zmq_curve_public(a->public, a->secret) != 0)
    s = td_err(TD_ERR_FORMAT, "%s: not a CURVE secret key", o->secret_file);
  if (s == TD_OK && o->router_key_file) {
    s = td_auth_read_key(o->router_key_file, false, a->router);
    a->has_router = s == TD_OK;
  }
  if (s == TD_OK && o->worker_keys_file) s = read_list(o->worker_keys_file, &a->workers);
  if (s == TD_OK && o->client_keys_file) s = read_list(o->client_keys_file, &a->clients);
  if (s == TD_OK && o->admin_keys_file) s = read_list(o->admin_keys_file, &a->admins);
  if (s != TD_OK) {
    td_auth_destroy(a);
    return s;
  }
  *out = a;
  return TD_OK;
}

void td_auth_destroy(td_auth *a) {
  if (!a) return;
  free_list(&a->workers);
  free_list(&a->clients);
  free_list(&a->admins);
  memset(a->secret, 0, sizeof a->secret);
  free(a);
}

const char *td_auth_public_key(const td_auth *a) { return a ? a->public : ""; }

td_status td_auth_server(const td_auth *a, void *sock, const char *domain) {
  if (!a) return TD_OK;
  int on = 1;
  if (zmq_setsockopt(sock, ZMQ_CURVE_SERVER, &on, sizeof on) != 0 ||
      zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, a->secret, 40) != 0 ||
      zmq_setsockopt(sock, ZMQ_ZAP_DOMAIN, domain, strlen(domain)) != 0)
    return td_err(TD_ERR_NETWORK, "cannot make a CURVE server socket: %s", zmq_strerror(zmq_errno()));
  return TD_OK;
}

td_status td_auth_client(const td_auth *a, void *sock, const char *server_key) {
  if (!a) return TD_OK;
  if (!server_key) {
    if (!a->has_router) return td_err(TD_ERR_INVALID, "a secret key is configured without the router's public key");
    server_key = a->router;
  }
  if (!z85_ok(server_key)) return td_err(TD_ERR_FORMAT, "the server's public key is not a Z85 key of 40 characters");
  if (zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, server_key, 40) != 0 ||
      zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, a->public, 40) != 0 ||
      zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, a->secret, 40) != 0)
    return td_err(TD_ERR_NETWORK, "cannot make a CURVE client socket: %s", zmq_strerror(zmq_errno()));
  return TD_OK;
}

static keyent *list_of(const td_auth *a, const char *domain) {
  if (!strcmp(domain, TD_AUTH_DOMAIN_CLIENTS)) return a->clients;
  if (!strcmp(domain, TD_AUTH_DOMAIN_WORKERS) || !strcmp(domain, TD_AUTH_DOMAIN_KV)) return a->workers;
  return NULL;
}

bool td_auth_admits(const td_auth *a, const char *domain, const char *z85) {
  if (!a || !domain || !z85) return false;
  keyent *h = list_of(a, domain), *e = NULL;
  HASH_FIND_STR(h, z85, e);
  return e != NULL;
}

bool td_auth_is_admin(const td_auth *a, const char *z85) {
  if (!a || !z85) return false;
  keyent *e = NULL;
  HASH_FIND_STR(a->admins, z85, e);
  return e != NULL;
}

bool td_auth_msg_key(void *zmq_msg, char out[TD_AUTH_KEY_Z85]) {
  const char *u = zmq_msg_gets(zmq_msg, "User-Id");
  if (!u || strlen(u) != 40) return false;
  memcpy(out, u, 41);
  return true;
}

td_status td_auth_token_new(uint8_t out[TD_KV_TOKEN_BYTES]) {
  size_t got = 0;
  while (got < TD_KV_TOKEN_BYTES) {
    ssize_t n = getrandom(out + got, TD_KV_TOKEN_BYTES - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return td_err(TD_ERR_INTERNAL, "getrandom: %s", strerror(errno));
    got += (size_t)n;
  }
  return TD_OK;
}

bool td_auth_token_equal(const uint8_t a[TD_KV_TOKEN_BYTES], const uint8_t b[TD_KV_TOKEN_BYTES]) {
  /* every byte is read whatever the first difference: the time tells nothing */
  volatile uint8_t d = 0;
  for (int i = 0; i < TD_KV_TOKEN_BYTES; i++) d |= a[i] ^ b[i];
  return d == 0;
}

/* ---- ZAP handler (RFC 27) ---- */

#define ZAP_MAX_WATCH 4
#define ZAP_MAX_WAITING 64 /* group handshakes held until the rendezvous names the ranks; more are refused */

typedef struct watch {
  void *mon; /* PAIR: the watched socket's monitor events */
  char what[32];
} watch;

/* when a refusal (domain or endpoint, and key) was last logged */
typedef struct seen {
  char what[96];
  int64_t logged_ms;
  unsigned long quiet; /* refusals not logged since */
  UT_hash_handle hh;
} seen;

struct td_zap {
  const td_auth *a;
  seen *seen; /* the handler thread's alone */
  int n_seen;
  void *sock, *ctx;
  pthread_mutex_t mu; /* guards n_watch: watches are added from the owner's thread */
  watch w[ZAP_MAX_WATCH];
  int n_watch;
  pthread_t th;
  atomic_bool stop;
  atomic_ulong refused, admitted;
  char group[TD_GROUP_MAX_RANKS][TD_AUTH_KEY_Z85]; /* under mu: TD_AUTH_DOMAIN_GROUP's keys */
  int n_group;
  bool group_known; /* under mu: td_zap_set_group was called */
  /* the handler thread's: group handshakes that came before the ranks were named */
  struct waiting {
    zmq_msg_t route, req_id;
    char key[TD_AUTH_KEY_Z85], address[64];
    int64_t deadline;
  } wait[ZAP_MAX_WAITING];
  int n_wait;
};

td_status td_zap_set_group(td_zap *z, const char *const *keys, int n) {
  if (!z) return TD_OK;
  if (n < 0 || n > TD_GROUP_MAX_RANKS) return td_err(TD_ERR_INVALID, "a group of %d ranks: at most %d", n, TD_GROUP_MAX_RANKS);
  for (int i = 0; i < n; i++)
    if (!keys[i] || strlen(keys[i]) != TD_AUTH_KEY_Z85 - 1)
      return td_err(TD_ERR_INVALID, "rank %d of the group has no CURVE key (a rank without keys?)", i);
  pthread_mutex_lock(&z->mu);
  for (int i = 0; i < n; i++) snprintf(z->group[i], sizeof z->group[i], "%s", keys[i]);
  z->n_group = n;
  z->group_known = true;
  pthread_mutex_unlock(&z->mu);
  return TD_OK;
}

/* 1: a rank of the group; 0: not; -1: the ranks are not named yet */
static int group_admits(td_zap *z, const char *key) {
  int ok = 0;
  pthread_mutex_lock(&z->mu);
  if (!z->group_known) ok = -1;
  for (int i = 0; i < z->n_group && ok == 0; i++) ok = !strcmp(z->group[i], key);
  pthread_mutex_unlock(&z->mu);
  return ok;
}

#define ZAP_FRAMES 7

/* A ROUTER socket answers out of order: a group handshake waits for its
 * ranks to be named while others are answered. [route][""][reply...] */
static void zap_reply(void *sock, const zmq_msg_t *route, const zmq_msg_t *req_id, const char *code, const char *text,
                      const char *user) {
  zmq_send(sock, zmq_msg_data((zmq_msg_t *)route), zmq_msg_size((zmq_msg_t *)route), ZMQ_SNDMORE);
  zmq_send(sock, "", 0, ZMQ_SNDMORE);
  zmq_send(sock, "1.0", 3, ZMQ_SNDMORE);
  zmq_send(sock, zmq_msg_data((zmq_msg_t *)req_id), zmq_msg_size((zmq_msg_t *)req_id), ZMQ_SNDMORE);
  zmq_send(sock, code, strlen(code), ZMQ_SNDMORE);
  zmq_send(sock, text, strlen(text), ZMQ_SNDMORE);
  zmq_send(sock, user, strlen(user), ZMQ_SNDMORE);
  zmq_send(sock, "", 0, 0);
}

static void copy_frame(zmq_msg_t *m, char *out, size_t cap) {
  size_t n = zmq_msg_size(m);
  if (n >= cap) n = cap - 1;
  memcpy(out, zmq_msg_data(m), n);
  out[n] = 0;
}

/* Whether to log this refusal now (a refused peer reconnects every 100 ms);
 * *quiet: the refusals of it not logged since the last line. */
static bool log_now(td_zap *z, const char *a, const char *b, unsigned long *quiet) {
  char what[96];
  snprintf(what, sizeof what, "%s|%s", a, b);
  int64_t now = td_now_ms();
  seen *e = NULL;
  HASH_FIND_STR(z->seen, what, e);
  *quiet = 0;
  if (e && now - e->logged_ms < TD_AUTH_REFUSAL_LOG_MS) {
    e->quiet++;
    return false;
  }
  if (!e) {
    if (z->n_seen >= TD_AUTH_REFUSAL_LOG_KEYS) {
      seen *x, *t;
      HASH_ITER(hh, z->seen, x, t) {
        HASH_DEL(z->seen, x);
        free(x);
      }
      z->n_seen = 0;
    }
    e = calloc(1, sizeof *e);
    if (!e) return true;
    snprintf(e->what, sizeof e->what, "%s", what);
    HASH_ADD_STR(z->seen, what, e);
    z->n_seen++;
  }
  *quiet = e->quiet;
  e->quiet = 0;
  e->logged_ms = now;
  return true;
}

static void refusal(td_zap *z, const char *domain, const char *key, const char *address, const char *mech,
                    bool group) {
  atomic_fetch_add(&z->refused, 1);
  unsigned long quiet;
  bool say = log_now(z, domain, key[0] ? key : mech, &quiet);
  if (say && key[0] && group) {
    TD_WARN("auth: refused key %s on %s from %s: not a rank of this group (%lu more refusals of it since the last "
            "line)", key, domain, address, quiet);
  } else if (say && key[0]) {
    TD_WARN("auth: refused key %s on %s from %s: not on the %s list (%lu more refusals of it since the last line)",
            key, domain, address, !strcmp(domain, TD_AUTH_DOMAIN_CLIENTS) ? "client" : "worker", quiet);
  } else if (say) {
    TD_WARN("auth: refused a %s connection on %s from %s: CURVE keys are required", mech,
            domain[0] ? domain : "(no domain)", address);
  }
}

static void answer(td_zap *z, const zmq_msg_t *route, const zmq_msg_t *req_id, const char *domain, const char *key,
                   const char *address, bool ok) {
  if (ok) {
    atomic_fetch_add(&z->admitted, 1);
    TD_DEBUG("auth: admitted key %s on %s from %s", key, domain, address);
    zap_reply(z->sock, route, req_id, "200", "OK", key);
  } else {
    refusal(z, domain, key, address, "CURVE", !strcmp(domain, TD_AUTH_DOMAIN_GROUP));
    zap_reply(z->sock, route, req_id, "400", "key not admitted", "");
  }
}

/* [route][""][version][request id][domain][address][identity][mechanism][credentials] */
static void zap_handle(td_zap *z) {
  enum { HEAD = 2 };
  zmq_msg_t f[HEAD + ZAP_FRAMES + 1];
  int n = 0;
  bool more = true;
  while (more) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, z->sock, 0) < 0) {
      zmq_msg_close(&m);
      break;
    }
    more = zmq_msg_more(&m);
    if (n < HEAD + ZAP_FRAMES + 1) f[n++] = m;
    else zmq_msg_close(&m);
  }
  bool envelope = n >= HEAD && zmq_msg_size(&f[1]) == 0;
  if (!envelope || n < HEAD + 6) { /* not a ZAP request */
    if (envelope && n >= HEAD + 2) zap_reply(z->sock, &f[0], &f[HEAD + 1], "500", "malformed ZAP request", "");
    for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
    return;
  }
  zmq_msg_t *r = f + HEAD;
  char domain[64], address[64], mech[16];
  copy_frame(&r[2], domain, sizeof domain);
  copy_frame(&r[3], address, sizeof address);
  copy_frame(&r[5], mech, sizeof mech);
  char key[TD_AUTH_KEY_Z85] = "";
  bool curve = !strcmp(mech, "CURVE") && n == HEAD + 7 && zmq_msg_size(&r[6]) == 32;
  if (curve) zmq_z85_encode(key, zmq_msg_data(&r[6]), 32);
  bool group = !strcmp(domain, TD_AUTH_DOMAIN_GROUP);
  int ok = curve ? (group ? group_admits(z, key) : td_auth_admits(z->a, domain, key)) : 0;
  if (ok < 0 && z->n_wait < ZAP_MAX_WAITING) {
    /* before the rendezvous named the ranks: a rank that was quicker than
     * this one waits (a refusal would end its connection for good) */
    struct waiting *w = &z->wait[z->n_wait++];
    zmq_msg_init(&w->route);
    zmq_msg_init(&w->req_id);
    zmq_msg_copy(&w->route, &f[0]);
    zmq_msg_copy(&w->req_id, &r[1]);
    snprintf(w->key, sizeof w->key, "%s", key);
    snprintf(w->address, sizeof w->address, "%s", address);
    w->deadline = td_now_ms() + TD_AUTH_GROUP_WAIT_MS;
  } else if (curve) {
    answer(z, &f[0], &r[1], domain, key, address, ok > 0);
  } else {
    refusal(z, domain, "", address, mech, group);
    zap_reply(z->sock, &f[0], &r[1], "400", "key not admitted", "");
  }
  for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
}

/* The waiting group handshakes, once their ranks are named (or too late). */
static void zap_waiting(td_zap *z) {
  int64_t now = td_now_ms();
  for (int i = z->n_wait - 1; i >= 0; i--) {
    struct waiting *w = &z->wait[i];
    int ok = group_admits(z, w->key);
    if (ok < 0 && now < w->deadline) continue;
    answer(z, &w->route, &w->req_id, TD_AUTH_DOMAIN_GROUP, w->key, w->address, ok > 0);
    zmq_msg_close(&w->route);
    zmq_msg_close(&w->req_id);
    z->wait[i] = z->wait[--z->n_wait];
  }
}

/* One monitor event: [u16 event][u32 value], then the endpoint. */
static void watch_event(td_zap *z, watch *w) {
  zmq_msg_t m;
  zmq_msg_init(&m);
  if (zmq_msg_recv(&m, w->mon, 0) < 0) {
    zmq_msg_close(&m);
    return;
  }
  uint16_t ev = 0;
  uint32_t val = 0;
  if (zmq_msg_size(&m) >= 6) {
    memcpy(&ev, zmq_msg_data(&m), 2);
    memcpy(&val, (uint8_t *)zmq_msg_data(&m) + 2, 4);
  }
  bool more = zmq_msg_more(&m);
  zmq_msg_close(&m);
  char ep[128] = "";
  while (more) {
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, w->mon, 0) < 0) {
      zmq_msg_close(&m);
      break;
    }
    if (!ep[0]) copy_frame(&m, ep, sizeof ep);
    more = zmq_msg_more(&m);
    zmq_msg_close(&m);
  }
  /* a peer that hung up during the handshake: one without keys that gave
   * up first, or a port check (the router dials a registering worker's KV
   * endpoint): counted, but no warning */
  if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL && (val == EPIPE || val == ECONNRESET)) {
    atomic_fetch_add(&z->refused, 1);
    unsigned long quiet;
    if (log_now(z, w->what, "hangup", &quiet))
      TD_INFO("auth: a connection on the %s endpoint %s closed during its handshake (a peer without CURVE keys, or "
              "a port check such as the router's; %lu more since the last line)", w->what, ep, quiet);
    return;
  }
  if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL || ev == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) {
    atomic_fetch_add(&z->refused, 1);
    unsigned long quiet;
    char code[16];
    snprintf(code, sizeof code, "%x", (unsigned)val);
    bool say = log_now(z, w->what, code, &quiet);
    if (say && ev == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL && val == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
      TD_WARN("auth: refused a connection without CURVE keys on the %s endpoint %s (%lu more since the last line)",
              w->what, ep, quiet);
    else if (say)
      TD_WARN("auth: refused a connection on the %s endpoint %s: the CURVE handshake failed (0x%x)", w->what, ep,
              (unsigned)val);
  }
}

static void *zap_main(void *arg) {
  td_zap *z = arg;
  while (!atomic_load(&z->stop)) {
    zmq_pollitem_t it[1 + ZAP_MAX_WATCH] = {{.socket = z->sock, .events = ZMQ_POLLIN}};
    pthread_mutex_lock(&z->mu);
    int n = z->n_watch;
    pthread_mutex_unlock(&z->mu);
    for (int i = 0; i < n; i++) it[1 + i] = (zmq_pollitem_t){.socket = z->w[i].mon, .events = ZMQ_POLLIN};
    int r = zmq_poll(it, 1 + n, TD_AUTH_ZAP_POLL_MS);
    if (r < 0 && zmq_errno() == ETERM) break;
    if (r > 0 && (it[0].revents & ZMQ_POLLIN)) zap_handle(z);
    for (int i = 0; r > 0 && i < n; i++)
      if (it[1 + i].revents & ZMQ_POLLIN) watch_event(z, &z->w[i]);
    if (z->n_wait) zap_waiting(z);
  }
  return NULL;
}

td_status td_zap_watch(td_zap *z, void *sock, const char *what) {
  if (!z) return TD_OK;
  pthread_mutex_lock(&z->mu);
  int i = z->n_watch;
  pthread_mutex_unlock(&z->mu);
  if (i == ZAP_MAX_WATCH) return td_err(TD_ERR_INTERNAL, "more than %d sockets watched by one ZAP handler", ZAP_MAX_WATCH);
  char ep[64];
  snprintf(ep, sizeof ep, "inproc://td-auth-monitor-%p", sock);
  if (zmq_socket_monitor(sock, ep, ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) != 0)
    return td_err(TD_ERR_NETWORK, "cannot monitor the %s socket: %s", what, zmq_strerror(zmq_errno()));
  void *mon = zmq_socket(z->ctx, ZMQ_PAIR);
  int linger = 0;
  if (mon) zmq_setsockopt(mon, ZMQ_LINGER, &linger, sizeof linger);
  if (!mon || zmq_connect(mon, ep) != 0) {
    if (mon) zmq_close(mon);
    return td_err(TD_ERR_NETWORK, "cannot read the %s socket's monitor: %s", what, zmq_strerror(zmq_errno()));
  }
  z->w[i].mon = mon;
  snprintf(z->w[i].what, sizeof z->w[i].what, "%s", what);
  pthread_mutex_lock(&z->mu); /* the thread reads the new entry after this */
  z->n_watch = i + 1;
  pthread_mutex_unlock(&z->mu);
  return TD_OK;
}

td_status td_zap_create(const td_auth *a, void *ctx, td_zap **out) {
  *out = NULL;
  if (!a) return TD_OK;
  td_zap *z = calloc(1, sizeof *z);
  if (!z) return td_err(TD_ERR_NOMEM, "out of memory");
  z->a = a;
  z->ctx = ctx;
  pthread_mutex_init(&z->mu, NULL);
  z->sock = zmq_socket(ctx, ZMQ_ROUTER);
  int linger = 0;
  if (z->sock) zmq_setsockopt(z->sock, ZMQ_LINGER, &linger, sizeof linger);
  if (!z->sock || zmq_bind(z->sock, ZAP_ENDPOINT) != 0) {
    td_status s = td_err(TD_ERR_NETWORK, "cannot start the ZAP handler: %s", zmq_strerror(zmq_errno()));
    if (z->sock) zmq_close(z->sock);
    free(z);
    return s;
  }
  if (pthread_create(&z->th, NULL, zap_main, z) != 0) {
    zmq_close(z->sock);
    free(z);
    return td_err(TD_ERR_INTERNAL, "cannot start the ZAP handler's thread");
  }
  *out = z;
  return TD_OK;
}

void td_zap_destroy(td_zap *z) {
  if (!z) return;
  atomic_store(&z->stop, true);
  pthread_join(z->th, NULL);
  for (int i = 0; i < z->n_wait; i++) {
    zmq_msg_close(&z->wait[i].route);
    zmq_msg_close(&z->wait[i].req_id);
  }
  zmq_close(z->sock);
  for (int i = 0; i < z->n_watch; i++) zmq_close(z->w[i].mon);
  seen *x, *t;
  HASH_ITER(hh, z->seen, x, t) {
    HASH_DEL(z->seen, x);
    free(x);
  }
  pthread_mutex_destroy(&z->mu);
  free(z);
}

unsigned long td_zap_refused(const td_zap *z) { return z ? atomic_load(&((td_zap *)z)->refused) : 0; }

static bool loopback(const char *ep) {
  if (strncmp(ep, "tcp://", 6)) return true; /* ipc, inproc: this host only */
  const char *h = ep + 6;
  return !strncmp(h, "127.", 4) || !strncmp(h, "localhost:", 10) || !strncmp(h, "[::1]:", 6);
}

void td_auth_warn_open(const td_auth *a, const char *endpoint, const char *what) {
  if (a || !endpoint || loopback(endpoint)) return;
  TD_WARN("the %s endpoint %s is reachable beyond this host without CURVE keys: anyone who reaches it is trusted "
          "(docs/security.md)",
          what, endpoint);
}

static td_status write_new(const char *path, const char *key, mode_t mode) {
  int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) {
    if (errno == EEXIST) return td_err(TD_ERR_INVALID, "%s exists: a key file is never overwritten", path);
    return td_err(TD_ERR_IO, "cannot create %s: %s", path, strerror(errno));
  }
  char line[TD_AUTH_KEY_Z85 + 1];
  int n = snprintf(line, sizeof line, "%s\n", key);
  bool ok = fchmod(fd, mode) == 0 && write(fd, line, (size_t)n) == n && fsync(fd) == 0;
  memset(line, 0, sizeof line);
  ok = close(fd) == 0 && ok;
  if (!ok) {
    td_status s = td_err(TD_ERR_IO, "cannot write %s: %s", path, strerror(errno));
    unlink(path);
    return s;
  }
  return TD_OK;
}

td_status td_auth_keygen(const char *public_path, const char *secret_path) {
  if (!td_auth_available()) return td_err(TD_ERR_UNSUPPORTED, "this libzmq has no CURVE (zmq_has(\"curve\") is false)");
  if (access(public_path, F_OK) == 0)
    return td_err(TD_ERR_INVALID, "%s exists: a key file is never overwritten", public_path);
  char pub[TD_AUTH_KEY_Z85], sec[TD_AUTH_KEY_Z85];
  if (zmq_curve_keypair(pub, sec) != 0) return td_err(TD_ERR_INTERNAL, "zmq_curve_keypair: %s", zmq_strerror(zmq_errno()));
  td_status s = write_new(secret_path, sec, 0600);
  memset(sec, 0, sizeof sec);
  if (s != TD_OK) return s;
  s = write_new(public_path, pub, 0644);
  if (s != TD_OK) unlink(secret_path); /* half a pair is of no use */
  return s;
}
