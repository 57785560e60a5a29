#include "common/net.h"

#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool td_net_is_wildcard(const char *host) {
  return host && (!strcmp(host, "0.0.0.0") || !strcmp(host, "*") || !strcmp(host, "::") || !strcmp(host, "[::]"));
}

/* host without its brackets, in out; false when it does not fit */
static bool unbracket(const char *host, char out[TD_NET_MAX_HOST]) {
  size_t n = strlen(host);
  if (n >= 2 && host[0] == '[' && host[n - 1] == ']') {
    host++;
    n -= 2;
  }
  if (n >= TD_NET_MAX_HOST) return false;
  memcpy(out, host, n);
  out[n] = 0;
  return true;
}

bool td_net_is_numeric(const char *host) {
  char h[TD_NET_MAX_HOST];
  unsigned char buf[sizeof(struct in6_addr)];
  if (!host || !unbracket(host, h)) return false;
  return inet_pton(AF_INET, h, buf) == 1 || inet_pton(AF_INET6, h, buf) == 1;
}

td_status td_net_check_advertise(const char *host) {
  if (!host || !*host) return td_err(TD_ERR_INVALID, "--advertise: an empty address");
  if (strlen(host) >= TD_NET_MAX_HOST)
    return td_err(TD_ERR_INVALID, "--advertise: an address of %zu characters, at most %d", strlen(host),
                  TD_NET_MAX_HOST - 1);
  if (td_net_is_wildcard(host))
    return td_err(TD_ERR_INVALID, "--advertise %s: a wildcard is no address peers can dial; give the one they reach "
                  "this process at", host);
  if (strstr(host, "://")) return td_err(TD_ERR_INVALID, "--advertise %s: an address, without a scheme", host);
  for (const char *p = host; *p; p++)
    if (*p <= ' ' || *p > '~' || *p == '/')
      return td_err(TD_ERR_INVALID, "--advertise %s: not a host name or a numeric address", host);
  /* a colon belongs to an IPv6 address only (the port is the bound one) */
  if (strchr(host, ':') && !td_net_is_numeric(host))
    return td_err(TD_ERR_INVALID, "--advertise %s: an address without a port (the port is the one bound)", host);
  return TD_OK;
}

bool td_net_split_tcp(const char *endpoint, char host[TD_NET_MAX_HOST], int *port) {
  const char *pre = "tcp://";
  if (!endpoint || strncmp(endpoint, pre, strlen(pre))) return false;
  const char *h = endpoint + strlen(pre), *colon = strrchr(h, ':');
  if (!colon || colon == h) return false;
  char *end;
  long p = strtol(colon + 1, &end, 10);
  if (*end || end == colon + 1 || p < 0 || p > 65535) return false;
  size_t n = (size_t)(colon - h);
  char raw[TD_NET_MAX_HOST];
  if (n >= sizeof raw) return false;
  memcpy(raw, h, n);
  raw[n] = 0;
  if (!unbracket(raw, host)) return false;
  *port = (int)p;
  return true;
}

td_status td_net_advertised(const char *bound, const char *advertise, char *out, size_t cap) {
  int n;
  char host[TD_NET_MAX_HOST];
  int port;
  if (!advertise || !td_net_split_tcp(bound, host, &port)) {
    n = snprintf(out, cap, "%s", bound);
  } else {
    char a[TD_NET_MAX_HOST];
    if (!unbracket(advertise, a)) return td_err(TD_ERR_INVALID, "--advertise %s: too long", advertise);
    bool v6 = strchr(a, ':') != NULL;
    n = snprintf(out, cap, "tcp://%s%s%s:%d", v6 ? "[" : "", a, v6 ? "]" : "", port);
  }
  if (n < 0 || (size_t)n >= cap) return td_err(TD_ERR_INVALID, "endpoint %s: longer than %zu bytes", bound, cap - 1);
  return TD_OK;
}
