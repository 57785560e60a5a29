/* The decode role (worker/role.h): reserves blocks for the KV other
 * workers push (or encodes here), admits the request into the continuous
 * batch once it all arrived, streams tokens and reports the result. */
#ifndef TD_DECODE_WORKER_DECODE_H
#define TD_DECODE_WORKER_DECODE_H

#include "worker/role.h"

extern const td_role td_role_decode;

#endif
