add_executable(bench-decode-step ${CMAKE_CURRENT_LIST_DIR}/decode_step.c)
target_link_libraries(bench-decode-step PRIVATE td_model td_kvcache td_bench_util Threads::Threads m)
