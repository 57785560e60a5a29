#include "proto/link.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#define LINK_MAGIC 0x314c4454u /* "TDL1" */
#define LINK_NO_EXTRA 0xffffffffu
#define LINK_HDR 12
#define LINK_STAGE (64 * 1024) /* small frames are read many a call */
#define LINK_SOCKBUF (4 << 20)

_Static_assert(TD_WIRE_MAX_MSG < LINK_NO_EXTRA, "a frame's length fits its header");

/* what waits to be written: owned bytes, or a second frame held by reference */
typedef struct piece {
  uint8_t *buf;
  size_t len, off;
  zmq_msg_t ref;
  bool is_ref;
} piece;

enum { RX_HDR, RX_BODY, RX_EXTRA };

struct td_link {
  int fd;
  bool broken;
  piece *out;
  size_t n_out, head, cap_out, queued;
  uint8_t stage[LINK_STAGE];
  size_t st_off, st_len;
  int rx;
  zmq_msg_t body, extra;
  size_t body_len, extra_len, got;
  bool has_extra;
};

struct td_link_server {
  int fd;
  char *path;
};

const char *td_link_path(const char *endpoint) {
  size_t n = strlen(TD_LINK_PREFIX);
  return endpoint && !strncmp(endpoint, TD_LINK_PREFIX, n) ? endpoint + n : NULL;
}

/* A path longer than a Unix socket's address is reached through its
 * directory, opened (/proc/self/fd/N/name on Linux): a deep run directory
 * still serves. *dir is that directory's descriptor, or -1; closed by the
 * caller once bound or connected. */
static td_status address(const char *path, struct sockaddr_un *a, int *dir) {
  *dir = -1;
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  if (!path || !*path) return td_err(TD_ERR_INVALID, "local link: no socket path");
  size_t n = strlen(path);
  if (n < sizeof a->sun_path) {
    memcpy(a->sun_path, path, n);
    return TD_OK;
  }
  const char *slash = strrchr(path, '/');
  const char *name = slash ? slash + 1 : path;
  size_t dlen = slash ? (slash == path ? 1 : (size_t)(slash - path)) : 1;
  char dpath[4096];
  if (!*name || dlen >= sizeof dpath)
    return td_err(TD_ERR_INVALID, "local link: the socket path %s is longer than a Unix socket takes", path);
  memcpy(dpath, slash ? path : ".", dlen);
  dpath[dlen] = 0;
  int d = open(dpath, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (d < 0) return td_err(TD_ERR_NETWORK, "local link: the directory of %s: %s", path, strerror(errno));
  int w = snprintf(a->sun_path, sizeof a->sun_path, "/proc/self/fd/%d/%s", d, name);
  if (w < 0 || (size_t)w >= sizeof a->sun_path) {
    close(d);
    return td_err(TD_ERR_INVALID, "local link: the socket path %s is longer than a Unix socket takes (its file name is %zu bytes)",
                  path, strlen(name));
  }
  *dir = d;
  return TD_OK;
}

static void close_dir(int d) {
  if (d >= 0) close(d);
}

/* A blocking connection to a, or -1 (errno says why). */
static int dial(const struct sockaddr_un *a) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (connect(fd, (const struct sockaddr *)a, sizeof *a) == 0) return fd;
  int e = errno;
  close(fd);
  errno = e;
  return -1;
}

static void tune(int fd) {
  int b = LINK_SOCKBUF;
  (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &b, sizeof b);
  (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof b);
}

static td_status link_new(int fd, td_link **out) {
  td_link *k = calloc(1, sizeof *k);
  if (!k) {
    close(fd);
    return td_err(TD_ERR_NOMEM, "local link: out of memory");
  }
  k->fd = fd;
  k->rx = RX_HDR;
  zmq_msg_init(&k->body);
  zmq_msg_init(&k->extra);
  tune(fd);
  *out = k;
  return TD_OK;
}

td_status td_link_listen(const char *path, td_link_server **out) {
  *out = NULL;
  struct sockaddr_un a;
  int dir;
  TD_TRY(address(path, &a, &dir));
  /* a live server keeps its path; a file nobody answers on is a dead one's */
  int probe = dial(&a);
  bool live = probe >= 0;
  if (live) close(probe);
  if (live) {
    close_dir(dir);
    return td_err(TD_ERR_INVALID, "local link: %s is served by another process", path);
  }
  struct stat st;
  if (lstat(path, &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      close_dir(dir);
      return td_err(TD_ERR_INVALID, "local link: %s exists and is not a socket", path);
    }
    (void)unlink(path);
  }
  td_link_server *s = calloc(1, sizeof *s);
  char *keep = strdup(path);
  int fd = s && keep ? socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0) : -1;
  if (fd < 0) {
    int e = errno;
    free(s);
    free(keep);
    close_dir(dir);
    return s && keep ? td_err(TD_ERR_IO, "local link: socket: %s", strerror(e))
                     : td_err(TD_ERR_NOMEM, "local link: out of memory");
  }
  bool ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && chmod(path, 0600) == 0 && listen(fd, 128) == 0;
  int e = errno;
  close_dir(dir);
  if (!ok) {
    close(fd);
    free(s);
    free(keep);
    return td_err(TD_ERR_NETWORK, "local link: cannot serve %s: %s", path, strerror(e));
  }
  s->fd = fd;
  s->path = keep;
  *out = s;
  return TD_OK;
}

int td_link_server_fd(const td_link_server *s) { return s->fd; }

td_status td_link_accept(td_link_server *s, td_link **out) {
  *out = NULL;
  int fd = accept4(s->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) return TD_ERR_NOT_FOUND;
    return td_err(TD_ERR_NETWORK, "local link: accept on %s: %s", s->path, strerror(errno));
  }
  struct ucred cr;
  socklen_t cl = sizeof cr;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) != 0 || cr.uid != geteuid()) {
    close(fd);
    return td_err(TD_ERR_PEER, "local link: a process of another user connected to %s: closed", s->path);
  }
  return link_new(fd, out);
}

void td_link_server_destroy(td_link_server *s) {
  if (!s) return;
  close(s->fd);
  (void)unlink(s->path);
  free(s->path);
  free(s);
}

td_status td_link_connect(const char *path, td_link **out) {
  *out = NULL;
  struct sockaddr_un a;
  int dir;
  TD_TRY(address(path, &a, &dir));
  /* blocking connect (a local one does not wait on a peer's accept), then non-blocking */
  int fd = dial(&a), e = errno;
  close_dir(dir);
  if (fd < 0) return td_err(TD_ERR_NETWORK, "local link: cannot connect to %s: %s", path, strerror(e));
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0) {
    e = errno;
    close(fd);
    return td_err(TD_ERR_IO, "local link: %s", strerror(e));
  }
  return link_new(fd, out);
}

int td_link_fd(const td_link *k) { return k->fd; }
bool td_link_broken(const td_link *k) { return k->broken; }
bool td_link_pending(const td_link *k) { return !k->broken && k->rx == RX_HDR && k->st_len - k->st_off >= LINK_HDR; }
bool td_link_wants_write(const td_link *k) { return !k->broken && k->head < k->n_out; }

static void piece_free(piece *p) {
  if (p->is_ref)
    zmq_msg_close(&p->ref);
  else
    free(p->buf);
}

static td_status broke(td_link *k, td_status s, const char *what, int e) {
  k->broken = true;
  return td_err(s, "local link: %s: %s", what, e ? strerror(e) : "closed by the peer");
}

td_status td_link_flush(td_link *k) {
  if (k->broken) return td_err(TD_ERR_PEER, "local link: broken");
  while (k->head < k->n_out) {
    struct iovec v[16];
    int nv = 0;
    for (size_t i = k->head; i < k->n_out && nv < 16; i++, nv++) {
      piece *p = &k->out[i];
      uint8_t *base = p->is_ref ? zmq_msg_data(&p->ref) : p->buf;
      v[nv] = (struct iovec){base + p->off, p->len - p->off};
    }
    /* no SIGPIPE when the peer has gone: the write reports it */
    struct msghdr mh = {.msg_iov = v, .msg_iovlen = (size_t)nv};
    ssize_t w = sendmsg(k->fd, &mh, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      if (errno == EINTR) continue;
      return broke(k, TD_ERR_PEER, "write", errno);
    }
    size_t left = (size_t)w;
    while (left && k->head < k->n_out) {
      piece *p = &k->out[k->head];
      size_t take = p->len - p->off < left ? p->len - p->off : left;
      p->off += take;
      left -= take;
      k->queued -= take;
      if (p->off == p->len) {
        piece_free(p);
        k->head++;
      }
    }
  }
  if (k->head == k->n_out) k->head = k->n_out = 0;
  return TD_OK;
}

static td_status push(td_link *k, piece p) {
  if (k->n_out == k->cap_out) {
    if (k->head > 0) { /* reuse what was written */
      memmove(k->out, k->out + k->head, sizeof *k->out * (k->n_out - k->head));
      k->n_out -= k->head;
      k->head = 0;
    }
    if (k->n_out == k->cap_out) {
      size_t cap = k->cap_out ? 2 * k->cap_out : 16;
      piece *o = realloc(k->out, sizeof *o * cap);
      if (!o) return td_err(TD_ERR_NOMEM, "local link: out of memory");
      k->out = o;
      k->cap_out = cap;
    }
  }
  k->out[k->n_out++] = p;
  k->queued += p.len;
  return TD_OK;
}

static void put32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8), p[2] = (uint8_t)(v >> 16), p[3] = (uint8_t)(v >> 24);
}

static uint32_t get32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

td_status td_link_send(td_link *k, const ProtobufCMessage *msg, zmq_msg_t *extra) {
  if (k->broken) return td_err(TD_ERR_PEER, "local link: broken");
  size_t n = protobuf_c_message_get_packed_size(msg), x = extra ? zmq_msg_size(extra) : 0;
  if (n > TD_WIRE_MAX_MSG || x > TD_WIRE_MAX_MSG)
    return td_err(TD_ERR_INVALID, "local link: a message of %zu + %zu bytes (at most %d each)", n, x, TD_WIRE_MAX_MSG);
  if (k->queued + n + x > TD_LINK_MAX_QUEUED)
    return td_err(TD_ERR_OVERLOADED, "local link: %zu bytes wait to be written already", k->queued);
  piece p = {.buf = malloc(LINK_HDR + n), .len = LINK_HDR + n};
  if (!p.buf) return td_err(TD_ERR_NOMEM, "local link: a message of %zu bytes", n);
  put32(p.buf, LINK_MAGIC);
  put32(p.buf + 4, (uint32_t)n);
  put32(p.buf + 8, extra ? (uint32_t)x : LINK_NO_EXTRA);
  protobuf_c_message_pack(msg, p.buf + LINK_HDR);
  td_status s = push(k, p);
  if (s != TD_OK) {
    free(p.buf);
    return s;
  }
  if (extra && x) {
    piece r = {.len = x, .is_ref = true};
    zmq_msg_init(&r.ref);
    if (zmq_msg_copy(&r.ref, extra) != 0 || (s = push(k, r)) != TD_OK) {
      zmq_msg_close(&r.ref);
      /* the header promised these bytes: the stream cannot go on without them */
      return broke(k, TD_ERR_NOMEM, "a second frame could not be queued", 0);
    }
  }
  return td_link_flush(k);
}

/* Reads into dst (when given, straight there) or the stage; false on no
 * bytes now. */
static td_status fill(td_link *k, uint8_t *dst, size_t want, size_t *got) {
  *got = 0;
  if (!dst) {
    if (k->st_off > 0) { /* the stage's unread bytes to its front */
      memmove(k->stage, k->stage + k->st_off, k->st_len - k->st_off);
      k->st_len -= k->st_off;
      k->st_off = 0;
    }
    dst = k->stage + k->st_len;
    want = sizeof k->stage - k->st_len;
  }
  for (;;) {
    ssize_t r = read(k->fd, dst, want);
    if (r > 0) {
      *got = (size_t)r;
      return TD_OK;
    }
    if (r == 0) return broke(k, TD_ERR_PEER, "read", 0);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return TD_ERR_NOT_FOUND;
    return broke(k, TD_ERR_PEER, "read", errno);
  }
}

/* The rest of a frame part into m: from the stage first, then straight
 * from the socket. */
static td_status take(td_link *k, zmq_msg_t *m, size_t len) {
  uint8_t *p = zmq_msg_data(m);
  size_t have = k->st_len - k->st_off, need = len - k->got;
  size_t c = have < need ? have : need;
  memcpy(p + k->got, k->stage + k->st_off, c);
  k->st_off += c;
  k->got += c;
  while (k->got < len) {
    size_t g;
    td_status s = fill(k, p + k->got, len - k->got, &g);
    if (s != TD_OK) return s;
    k->got += g;
  }
  return TD_OK;
}

td_status td_link_recv(td_link *k, td_wire_frame *out) {
  memset(out, 0, sizeof *out);
  if (k->broken) return td_err(TD_ERR_PEER, "local link: broken");
  for (;;) {
    if (k->rx == RX_HDR) {
      while (k->st_len - k->st_off < LINK_HDR) {
        size_t g;
        td_status s = fill(k, NULL, 0, &g);
        if (s != TD_OK) return s;
        k->st_len += g;
      }
      const uint8_t *h = k->stage + k->st_off;
      uint32_t magic = get32(h), n = get32(h + 4), x = get32(h + 8);
      if (magic != LINK_MAGIC || n > TD_WIRE_MAX_MSG || (x != LINK_NO_EXTRA && x > TD_WIRE_MAX_MSG)) {
        k->broken = true;
        return td_err(TD_ERR_FORMAT, "local link: a malformed frame header (magic %08x, %u + %u bytes; at most %d)",
                      magic, n, x == LINK_NO_EXTRA ? 0 : x, TD_WIRE_MAX_MSG);
      }
      k->st_off += LINK_HDR;
      k->body_len = n;
      k->has_extra = x != LINK_NO_EXTRA;
      k->extra_len = k->has_extra ? x : 0;
      zmq_msg_close(&k->body);
      zmq_msg_close(&k->extra);
      zmq_msg_init(&k->extra);
      if (zmq_msg_init_size(&k->body, n) != 0 || (k->has_extra && zmq_msg_init_size(&k->extra, x) != 0)) {
        zmq_msg_init(&k->body);
        return broke(k, TD_ERR_NOMEM, "a frame's buffer", 0);
      }
      k->got = 0;
      k->rx = RX_BODY;
    }
    if (k->rx == RX_BODY) {
      TD_TRY(take(k, &k->body, k->body_len));
      k->got = 0;
      k->rx = k->has_extra ? RX_EXTRA : RX_HDR;
      if (k->has_extra) continue;
    } else if (k->rx == RX_EXTRA) {
      TD_TRY(take(k, &k->extra, k->extra_len));
      k->rx = RX_HDR;
    }
    /* whole: the frame's handles move out (a small message's bytes live inside its handle) */
    zmq_msg_init(&out->msg);
    zmq_msg_move(&out->msg, &k->body);
    out->has_msg = true;
    out->len = zmq_msg_size(&out->msg);
    out->data = zmq_msg_data(&out->msg);
    zmq_msg_init(&out->extra);
    if (k->has_extra) {
      zmq_msg_move(&out->extra, &k->extra);
      out->has_extra = true;
    }
    k->has_extra = false;
    return TD_OK;
  }
}

void td_link_destroy(td_link *k) {
  if (!k) return;
  for (size_t i = k->head; i < k->n_out; i++) piece_free(&k->out[i]);
  free(k->out);
  zmq_msg_close(&k->body);
  zmq_msg_close(&k->extra);
  close(k->fd);
  free(k);
}
