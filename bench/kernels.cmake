# bench_cuda_kernels: attention, GEMM, decode-step and encoder timings of the
# CUDA backend against the memory and matrix floors (docs/cuda.md). Runs on
# a GPU machine; appends to bench/RESULTS.md.
if(TANDEM_HAVE_CUDA)
  add_executable(bench_cuda_kernels ${CMAKE_CURRENT_LIST_DIR}/cuda_kernels.c)
  target_link_libraries(bench_cuda_kernels PRIVATE td_kernels td_common m)
endif()
