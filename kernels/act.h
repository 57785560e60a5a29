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

/* e^x and a / b: the hardware's approximations on the GPU (ex2.approx,
 * rcp.approx; a few ulp), libm on the CPU. */
TD_HD float td_act_exp(float x) {
#ifdef __CUDA_ARCH__
  return __expf(x);
#else
  return expf(x);
#endif
}
TD_HD float td_act_div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdividef(a, b);
#else
  return a / b;
#endif
}

/* Exact GELU, x Phi(x), with Phi from erfc in Abramowitz and Stegun's
 * 7.1.26 (|error| <= 1.5e-7 for erf; erfc taken directly for x < 0, so
 * the left tail keeps its relative precision): an exponential, a
 * reciprocal and five FMAs, where libm's erff takes two polynomials and a
 * select per value. The bf16 outputs this feeds hold 8 bits; the encoders'
 * bias + GELU pass was bound by erff's instructions, not by memory. */
TD_HD float td_gelu_erf(float x) {
  float z = fabsf(x) * 0.70710678118654752f;
  float t = td_act_div(1.0f, fmaf(0.3275911f, z, 1.0f));
  float p = t * fmaf(t, fmaf(t, fmaf(t, fmaf(t, 1.061405429f, -1.453152027f), 1.421413741f), -0.284496736f),
                     0.254829592f);
  float q = 0.5f * p * td_act_exp(-z * z); /* Phi(-|x|) */
  return x * (x >= 0.0f ? 1.0f - q : q);
}

TD_HD float td_act_apply(int act, float x) {
  switch (act) {
    case TD_ACT_RELU: return x > 0.0f ? x : 0.0f;
    case TD_ACT_GELU: return td_gelu_erf(x);
    /* 0.5 (1 + tanh u) = sigmoid(2u): one exponential and a division */
    case TD_ACT_GELU_TANH:
      return td_act_div(x, 1.0f + td_act_exp(-1.5957691216057308f * (x + 0.044715f * x * x * x)));
    case TD_ACT_SILU: return td_act_div(x, 1.0f + td_act_exp(-x));
    case TD_ACT_QUICK_GELU: return td_act_div(x, 1.0f + td_act_exp(-1.702f * x));
    default: return x;
  }
}

#endif
