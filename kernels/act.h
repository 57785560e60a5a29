/* Activation functions: the kinds the ops take (td_gemm, td_gated_act) and
 * their definition, shared by the CPU and CUDA code. */
#ifndef TD_KERNELS_ACT_H
#define TD_KERNELS_ACT_H

#include <math.h>

#include "common/rng.h" /* TD_HD */

typedef enum td_act {
  TD_ACT_NONE,
  TD_ACT_RELU,
  TD_ACT_GELU,      /* exact (erf) */
  TD_ACT_GELU_TANH, /* gelu_new / gelu_fast / gelu_pytorch_tanh */
  TD_ACT_SILU,
  TD_ACT_QUICK_GELU,
} td_act;

TD_HD float td_act_apply(int act, float x) {
  switch (act) {
    case TD_ACT_RELU: return x > 0.0f ? x : 0.0f;
    case TD_ACT_GELU: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    case TD_ACT_GELU_TANH:
      return 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
    case TD_ACT_SILU: return x / (1.0f + expf(-x));
    case TD_ACT_QUICK_GELU: return x / (1.0f + expf(-1.702f * x));
    default: return x;
  }
}

#endif
