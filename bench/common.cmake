execute_process(COMMAND git -C ${CMAKE_SOURCE_DIR} rev-parse --short HEAD OUTPUT_VARIABLE td_build_commit
                OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT td_build_commit)
  set(td_build_commit "unknown")
endif()
add_library(td_bench_util STATIC ${CMAKE_CURRENT_LIST_DIR}/bench_util.c)
target_compile_definitions(td_bench_util PRIVATE TD_SOURCE_DIR="${CMAKE_SOURCE_DIR}"
                           TD_BUILD_COMMIT="${td_build_commit}")
target_include_directories(td_bench_util PUBLIC ${CMAKE_CURRENT_LIST_DIR})
target_sources(td_bench_util PRIVATE ${CMAKE_CURRENT_LIST_DIR}/random_model.c)
target_link_libraries(td_bench_util PUBLIC td_common PkgConfig::CJSON m)
