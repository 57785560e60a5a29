add_executable(bench-router ${CMAKE_CURRENT_LIST_DIR}/router_bench.c)
target_link_libraries(bench-router PRIVATE td_router td_client td_bench_util Threads::Threads)
