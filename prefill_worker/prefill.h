/* The prefill role (worker/role.h): reserves cross-attention blocks for
 * the encoder's push, runs the decoder prompt once they arrive and pushes
 * the prompt's KV into the blocks the decode worker reserved. */
#ifndef TD_PREFILL_WORKER_PREFILL_H
#define TD_PREFILL_WORKER_PREFILL_H

#include "worker/role.h"

extern const td_role td_role_prefill;

#endif
