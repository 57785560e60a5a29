/* The local link (proto/link.c): frames over a Unix socket, whole or in
 * pieces, with a second frame by reference; malformed headers and closed
 * peers break it; the server's path checks. */
#include <criterion/criterion.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "proto/link.h"

typedef struct lpair {
  char dir[64], path[128];
  td_link_server *srv;
  td_link *a, *b; /* a: accepted, b: connected */
} lpair;

static void lpair_open(lpair *p) {
  memset(p, 0, sizeof *p);
  snprintf(p->dir, sizeof p->dir, "/tmp/td-link-XXXXXX");
  cr_assert_not_null(mkdtemp(p->dir));
  snprintf(p->path, sizeof p->path, "%s/s.sock", p->dir);
  cr_assert_eq(td_link_listen(p->path, &p->srv), TD_OK, "%s", td_errmsg());
  cr_assert_eq(td_link_connect(p->path, &p->b), TD_OK, "%s", td_errmsg());
  struct pollfd pf = {.fd = td_link_server_fd(p->srv), .events = POLLIN};
  cr_assert_eq(poll(&pf, 1, 2000), 1);
  cr_assert_eq(td_link_accept(p->srv, &p->a), TD_OK, "%s", td_errmsg());
  cr_expect_eq(td_link_accept(p->srv, &(td_link *){NULL}), TD_ERR_NOT_FOUND, "a second connection from nowhere");
}

static void lpair_close(lpair *p) {
  td_link_destroy(p->a);
  td_link_destroy(p->b);
  td_link_server_destroy(p->srv);
  struct stat st;
  cr_expect_neq(stat(p->path, &st), 0, "the socket file outlived its server");
  rmdir(p->dir);
}

/* One frame from k, waiting up to 2 s; writes of w meanwhile (the peer's
 * leftovers, when it sent more than its socket took). */
static td_status recv_wait(td_link *k, td_link *w, td_wire_frame *f) {
  for (int i = 0; i < 2000; i++) {
    if (w) (void)td_link_flush(w);
    td_status s = td_link_recv(k, f);
    if (s != TD_ERR_NOT_FOUND) return s;
    td_wire_frame_free(f);
    struct pollfd pf = {.fd = td_link_fd(k), .events = POLLIN};
    (void)poll(&pf, 1, 1);
  }
  return TD_ERR_TIMEOUT;
}

static void send_request(td_link *k, const char *id, zmq_msg_t *extra) {
  Tandem__AudioFeatures af = TANDEM__AUDIO_FEATURES__INIT;
  af.values_in_frame = true;
  Tandem__GenerateRequest g = TANDEM__GENERATE_REQUEST__INIT;
  g.request_id = (char *)id;
  if (extra) g.features = &af;
  Tandem__ClientMessage m = TANDEM__CLIENT_MESSAGE__INIT;
  m.version = TD_PROTOCOL_VERSION;
  m.body_case = TANDEM__CLIENT_MESSAGE__BODY_GENERATE;
  m.generate = &g;
  cr_assert_eq(td_link_send(k, &m.base, extra), TD_OK, "%s", td_errmsg());
}

static void expect_request(td_link *k, td_link *w, const char *id, size_t extra_floats) {
  td_wire_frame f;
  cr_assert_eq(recv_wait(k, w, &f), TD_OK, "%s", td_errmsg());
  Tandem__ClientMessage *m;
  uint32_t ver;
  cr_assert_eq(td_wire_unpack_client(&f, &m, &ver), TD_OK, "%s", td_errmsg());
  cr_expect_str_eq(m->generate->request_id, id);
  cr_assert_eq(f.has_extra, extra_floats > 0);
  if (extra_floats) {
    cr_assert_eq(zmq_msg_size(&f.extra), extra_floats * sizeof(float));
    const float *v = zmq_msg_data(&f.extra);
    for (size_t i = 0; i < extra_floats; i += 997) cr_assert_float_eq(v[i], (float)i * 0.25f, 0, "value %zu", i);
    cr_assert_float_eq(v[extra_floats - 1], (float)(extra_floats - 1) * 0.25f, 0);
  }
  tandem__client_message__free_unpacked(m, NULL);
  td_wire_frame_free(&f);
}

/* Frames both ways, small ones many to a read, a 24 MB second frame taken
 * in pieces (more than the socket holds: the sender keeps the rest and
 * writes it when the socket takes it) and sent by reference. */
Test(link, frames_whole_and_in_pieces) {
  lpair p;
  lpair_open(&p);
  for (int i = 0; i < 50; i++) {
    char id[16];
    snprintf(id, sizeof id, "r%d", i);
    send_request(p.b, id, NULL);
  }
  for (int i = 0; i < 50; i++) {
    char id[16];
    snprintf(id, sizeof id, "r%d", i);
    expect_request(p.a, NULL, id, 0);
  }
  size_t n = 6u << 20; /* 24 MB of floats */
  zmq_msg_t x;
  cr_assert_eq(zmq_msg_init_size(&x, n * sizeof(float)), 0);
  for (size_t i = 0; i < n; i++) ((float *)zmq_msg_data(&x))[i] = (float)i * 0.25f;
  send_request(p.a, "big", &x);
  zmq_msg_close(&x); /* the link holds its own reference until written */
  cr_expect(td_link_wants_write(p.a), "24 MB went into a socket at once");
  send_request(p.a, "after", NULL);
  expect_request(p.b, p.a, "big", n);
  expect_request(p.b, p.a, "after", 0);
  cr_expect(!td_link_wants_write(p.a));
  /* nothing more: not found, not broken */
  td_wire_frame f;
  cr_expect_eq(td_link_recv(p.b, &f), TD_ERR_NOT_FOUND);
  cr_expect(!td_link_broken(p.b));
  lpair_close(&p);
}

/* A header's bytes one at a time: a frame is whole only with its last. */
Test(link, a_frame_trickling_in) {
  lpair p;
  lpair_open(&p);
  Tandem__HealthRequest hr = TANDEM__HEALTH_REQUEST__INIT;
  Tandem__ClientMessage m = TANDEM__CLIENT_MESSAGE__INIT;
  m.version = TD_PROTOCOL_VERSION;
  m.body_case = TANDEM__CLIENT_MESSAGE__BODY_HEALTH;
  m.health = &hr;
  size_t n = protobuf_c_message_get_packed_size(&m.base);
  uint8_t buf[64] = {'T', 'D', 'L', '1', (uint8_t)n, 0, 0, 0, 0xff, 0xff, 0xff, 0xff};
  protobuf_c_message_pack(&m.base, buf + 12);
  td_wire_frame f;
  for (size_t i = 0; i < 12 + n; i++) {
    cr_expect_eq(td_link_recv(p.a, &f), TD_ERR_NOT_FOUND, "whole after %zu of %zu bytes", i, 12 + n);
    cr_assert_eq(write(td_link_fd(p.b), buf + i, 1), 1);
  }
  cr_assert_eq(recv_wait(p.a, NULL, &f), TD_OK, "%s", td_errmsg());
  Tandem__ClientMessage *got;
  uint32_t ver;
  cr_assert_eq(td_wire_unpack_client(&f, &got, &ver), TD_OK);
  cr_expect_eq(got->body_case, TANDEM__CLIENT_MESSAGE__BODY_HEALTH);
  cr_expect(!f.has_extra);
  tandem__client_message__free_unpacked(got, NULL);
  td_wire_frame_free(&f);
  lpair_close(&p);
}

/* A header that is not one, or claims more than a message may hold, breaks
 * the link (a stream cannot find the next frame); so does the peer's end. */
Test(link, bad_headers_and_closed_peers_break_it) {
  struct {
    uint8_t hdr[12];
    const char *says;
  } bad[] = {
      {{'H', 'T', 'T', 'P', 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff}, "malformed frame header"},
      {{'T', 'D', 'L', '1', 0, 0, 0, 0x7f, 0xff, 0xff, 0xff, 0xff}, "at most"},
      {{'T', 'D', 'L', '1', 1, 0, 0, 0, 0, 0, 0, 0x10}, "at most"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    lpair p;
    lpair_open(&p);
    cr_assert_eq(write(td_link_fd(p.b), bad[i].hdr, 12), 12);
    td_wire_frame f;
    cr_expect_eq(recv_wait(p.a, NULL, &f), TD_ERR_FORMAT, "case %zu", i);
    cr_expect(strstr(td_errmsg(), bad[i].says), "case %zu: %s", i, td_errmsg());
    cr_expect(td_link_broken(p.a));
    cr_expect_eq(td_link_recv(p.a, &f), TD_ERR_PEER);
    lpair_close(&p);
  }
  lpair p;
  lpair_open(&p);
  send_request(p.b, "last", NULL);
  td_link_destroy(p.b);
  p.b = NULL;
  expect_request(p.a, NULL, "last", 0); /* what came before the end is read */
  td_wire_frame f;
  cr_expect_eq(recv_wait(p.a, NULL, &f), TD_ERR_PEER);
  cr_expect(td_link_broken(p.a));
  /* writing to a peer that has gone reports it (no SIGPIPE) */
  Tandem__HealthRequest hr = TANDEM__HEALTH_REQUEST__INIT;
  Tandem__ClientMessage m = TANDEM__CLIENT_MESSAGE__INIT;
  m.version = TD_PROTOCOL_VERSION;
  m.body_case = TANDEM__CLIENT_MESSAGE__BODY_HEALTH;
  m.health = &hr;
  cr_expect_eq(td_link_send(p.a, &m.base, NULL), TD_ERR_PEER);
  lpair_close(&p);
}

/* A socket in a directory deeper than a Unix socket's address takes (a
 * run directory under a long build path) serves, carries frames, and is
 * removed with its server; the file name alone too long is refused. */
Test(link, deep_directory) {
  char base[] = "/tmp/td-link-XXXXXX";
  cr_assert_not_null(mkdtemp(base));
  char dir[400], path[480];
  snprintf(dir, sizeof dir, "%s", base);
  for (int i = 0; i < 6; i++) {
    size_t n = strlen(dir);
    snprintf(dir + n, sizeof dir - n, "/%s-%d", "a-directory-of-a-long-build-path", i);
    cr_assert_eq(mkdir(dir, 0700), 0);
  }
  snprintf(path, sizeof path, "%s/router-workers.sock", dir);
  cr_assert_gt(strlen(path), sizeof(((struct sockaddr_un *)0)->sun_path));
  td_link_server *srv;
  cr_assert_eq(td_link_listen(path, &srv), TD_OK, "%s", td_errmsg());
  struct stat st;
  cr_assert_eq(stat(path, &st), 0);
  cr_expect(S_ISSOCK(st.st_mode));
  cr_expect_eq(st.st_mode & 0777, 0600);
  td_link *b, *a;
  cr_assert_eq(td_link_connect(path, &b), TD_OK, "%s", td_errmsg());
  struct pollfd pf = {.fd = td_link_server_fd(srv), .events = POLLIN};
  cr_assert_eq(poll(&pf, 1, 2000), 1);
  cr_assert_eq(td_link_accept(srv, &a), TD_OK, "%s", td_errmsg());
  send_request(b, "deep", NULL);
  expect_request(a, b, "deep", 0);
  td_link_server *s2;
  cr_expect_eq(td_link_listen(path, &s2), TD_ERR_INVALID, "a live deep server's path taken over");
  td_link_destroy(a);
  td_link_destroy(b);
  td_link_server_destroy(srv);
  cr_expect_neq(stat(path, &st), 0, "the socket file outlived its server");
  char name[160];
  memset(name, 'n', sizeof name - 1);
  name[sizeof name - 1] = 0;
  snprintf(path, sizeof path, "%s/%s", dir, name);
  cr_expect_eq(td_link_listen(path, &s2), TD_ERR_INVALID);
  cr_expect(strstr(td_errmsg(), "longer than"), "%s", td_errmsg());
  cr_expect_eq(td_link_connect(path, &b), TD_ERR_INVALID);
  for (int i = 6; i > 0; i--) {
    cr_expect_eq(rmdir(dir), 0, "%s", dir);
    *strrchr(dir, '/') = 0;
  }
  rmdir(base);
}

/* A path another server answers on is refused, a stale one replaced, one
 * that is not a socket left alone; paths too long for a Unix socket and
 * endpoints that name none are told apart. */
Test(link, server_paths) {
  lpair p;
  lpair_open(&p);
  td_link_server *s2;
  cr_expect_eq(td_link_listen(p.path, &s2), TD_ERR_INVALID);
  cr_expect(strstr(td_errmsg(), "served by another process"), "%s", td_errmsg());
  lpair_close(&p);

  char dir[] = "/tmp/td-link-XXXXXX", path[128];
  cr_assert_not_null(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/stale.sock", dir);
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
  cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  close(fd); /* a dead server's file */
  cr_assert_eq(td_link_listen(path, &s2), TD_OK, "%s", td_errmsg());
  struct stat st;
  cr_assert_eq(stat(path, &st), 0);
  cr_expect_eq(st.st_mode & 0777, 0600);
  td_link_server_destroy(s2);
  snprintf(path, sizeof path, "%s/file", dir);
  FILE *f = fopen(path, "w");
  fclose(f);
  cr_expect_eq(td_link_listen(path, &s2), TD_ERR_INVALID);
  cr_expect(strstr(td_errmsg(), "is not a socket"), "%s", td_errmsg());
  cr_expect_eq(stat(path, &st), 0, "a file that is not a socket was removed");
  unlink(path);
  rmdir(dir);
  char lng[200];
  memset(lng, 'x', sizeof lng - 1);
  lng[0] = '/';
  lng[sizeof lng - 1] = 0;
  cr_expect_eq(td_link_listen(lng, &s2), TD_ERR_INVALID);
  cr_expect(strstr(td_errmsg(), "longer than"), "%s", td_errmsg());
  td_link *k;
  cr_expect_eq(td_link_connect("/nonexistent/td.sock", &k), TD_ERR_NETWORK);
  cr_expect_str_eq(td_link_path("local:/run/r.sock"), "/run/r.sock");
  cr_expect_null(td_link_path("tcp://127.0.0.1:7000"));
  cr_expect_null(td_link_path(NULL));
}
