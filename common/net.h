/* Addresses: what a process binds and what it tells its peers (--host /
 * the endpoints it binds, and --advertise). A process may bind a wildcard
 * or an interface of a container and advertise another address that its
 * peers reach (NAT, a Kubernetes pod IP, a host with several interfaces). */
#ifndef TD_COMMON_NET_H
#define TD_COMMON_NET_H

#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"

#define TD_NET_MAX_HOST 256 /* an address or host name, with its NUL */

/* Whether host is a wildcard: 0.0.0.0, *, :: or [::] (every interface). */
bool td_net_is_wildcard(const char *host);
/* Whether host is a numeric IPv4 or IPv6 address (brackets allowed). */
bool td_net_is_numeric(const char *host);
/* Checks an address to advertise: a host name or numeric address, not a
 * wildcard, no scheme, port or space. TD_ERR_INVALID names what is wrong. */
td_status td_net_check_advertise(const char *host);
/* The endpoint peers dial for `bound` ("tcp://HOST:PORT", as ZeroMQ's
 * ZMQ_LAST_ENDPOINT gives it): its host replaced by `advertise` (an IPv6
 * address in brackets), its port kept. NULL advertise: bound as it is.
 * Endpoints of other transports (ipc://, inproc://) are kept. */
td_status td_net_advertised(const char *bound, const char *advertise, char *out, size_t cap);
/* Splits "tcp://HOST:PORT" into its host (brackets removed) and port;
 * false for another form. */
bool td_net_split_tcp(const char *endpoint, char host[TD_NET_MAX_HOST], int *port);

#endif
