/* Linked when the build has no CUDA compiler. */
#include "kernels/backend_impl.h"

bool td_backend_cuda_available(void) { return false; }

td_status td_backend_cuda_create(const td_backend_opts *opts, td_backend **out) {
  *out = NULL;
  return td_err(TD_ERR_UNSUPPORTED, "this build has no CUDA backend");
}

td_status td_comm_nccl_id(uint8_t id[TD_NCCL_ID_BYTES]) {
  return td_err(TD_ERR_UNSUPPORTED, "this build has no NCCL");
}

td_status td_comm_create_nccl(td_backend *b, const uint8_t id[TD_NCCL_ID_BYTES], int rank, int world,
                              td_comm **out) {
  *out = NULL;
  return td_err(TD_ERR_UNSUPPORTED, "this build has no NCCL");
}
