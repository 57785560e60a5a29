/* The cross pool's mode: what it holds of each encoder position. Every
 * process that shares a model's cross blocks (router, encoder, prefill and
 * decode workers) must run the same one. */
#ifndef TD_COMMON_CROSS_MODE_H
#define TD_COMMON_CROSS_MODE_H

#include <stdbool.h>

#include "common/status.h"

/* What a cross pool holds of each encoder position:
 * - KV: every decoder layer's cross K and V (2 x heads x head_dim a layer);
 * - STATES: the encoder states once (d_model values), the pool's states
 *   tail: num_layers x less memory and half the bytes a large decode step
 *   reads; each layer then projects the query by W_k and the attention's mix
 *   by W_v per head (td_attn_states), which costs more at few rows;
 * - DUAL: both (1 / num_layers more memory than KV): each step takes the
 *   path that is faster at its row count (td_model_opts.states_rows).
 * AUTO (zero) is DUAL where d_model is even, else KV. */
typedef enum td_cross_mode {
  TD_CROSS_AUTO = 0,
  TD_CROSS_KV = 1,
  TD_CROSS_STATES = 2,
  TD_CROSS_DUAL = 3,
} td_cross_mode;
/* "auto", "kv", "states" or "dual" into *out; else TD_ERR_INVALID naming
 * the choices (for a --cross-mode argument) */
td_status td_cross_mode_parse(const char *s, td_cross_mode *out);
const char *td_cross_mode_name(td_cross_mode m);
/* What an encoder-only worker in cross mode m pushes to decode workers:
 * the encoder states (projected on arrival) in auto and states modes
 * unless K/V were asked for (--cross-transfer kv), else its K/V. A group
 * pushes states whatever it was told (tandem-worker refuses the rest),
 * and a model of odd d_model falls back to K/V at load. */
bool td_cross_pushes_states(td_cross_mode m, bool transfer_kv);

#endif
