add_executable(bench-cpu-throughput ${CMAKE_CURRENT_LIST_DIR}/cpu_throughput.c)
target_link_libraries(bench-cpu-throughput PRIVATE td_engine td_bench_util)
target_compile_definitions(bench-cpu-throughput PRIVATE TD_TEST_DATA="${CMAKE_SOURCE_DIR}/tests/data")
