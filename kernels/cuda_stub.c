/* Linked when the build has no CUDA compiler. */
#include "kernels/backend_impl.h"

bool td_backend_cuda_available(void) { return false; }

td_status td_backend_cuda_create(const td_backend_opts *opts, td_backend **out) {
  *out = NULL;
  return td_err(TD_ERR_UNSUPPORTED, "this build has no CUDA backend");
}
