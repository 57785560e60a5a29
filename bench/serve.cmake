# bench-serve: statistics and workloads as a library (unit-tested), the load generator over it;
# libcurl drives tandem-gateway over HTTP (--gateway).
pkg_check_modules(CURL REQUIRED IMPORTED_TARGET libcurl)
add_library(td_serve STATIC ${CMAKE_CURRENT_LIST_DIR}/serve_stats.c ${CMAKE_CURRENT_LIST_DIR}/serve_workload.c)
target_include_directories(td_serve PUBLIC ${CMAKE_CURRENT_LIST_DIR})
target_link_libraries(td_serve PUBLIC td_common m)
add_executable(bench-serve ${CMAKE_CURRENT_LIST_DIR}/serve.c ${CMAKE_CURRENT_LIST_DIR}/serve_http.c)
target_link_libraries(bench-serve PRIVATE td_serve td_client td_engine td_bench_util PkgConfig::CURL)
