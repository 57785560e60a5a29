# KV transfer bandwidth / latency benchmark (kvtransfer): host paths always,
# the staged GPU path and NCCL when the build has CUDA.
add_executable(bench_kv_transfer ${CMAKE_CURRENT_LIST_DIR}/kv_transfer.c)
target_link_libraries(bench_kv_transfer PRIVATE td_kvtransfer td_common)
if(TANDEM_HAVE_CUDA)
  target_compile_definitions(bench_kv_transfer PRIVATE TD_KVX_BENCH_CUDA=1)
  target_link_libraries(bench_kv_transfer PRIVATE CUDA::cudart)
  if(TD_NCCL_INCLUDE_DIR AND TD_NCCL_LIBRARY)
    target_compile_definitions(bench_kv_transfer PRIVATE TD_KVX_BENCH_NCCL=1)
    target_include_directories(bench_kv_transfer PRIVATE ${TD_NCCL_INCLUDE_DIR})
    target_link_libraries(bench_kv_transfer PRIVATE ${TD_NCCL_LIBRARY})
  endif()
endif()
