/* The encode role (worker/role.h): encodes requests in the engine's
 * batched encode phase and pushes each one's cross-attention KV into the
 * blocks its decode (and prefill) workers reserved. */
#ifndef TD_ENCODER_WORKER_ENCODER_H
#define TD_ENCODER_WORKER_ENCODER_H

#include "worker/role.h"

extern const td_role td_role_encode;

#endif
