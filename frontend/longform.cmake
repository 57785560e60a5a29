# Long-form Whisper transcription (td_longform): the window loop as a state
# machine over token ids; zlib for transformers' compression ratio.
pkg_check_modules(ZLIB REQUIRED IMPORTED_TARGET GLOBAL zlib)
add_library(td_longform STATIC ${CMAKE_CURRENT_LIST_DIR}/longform.c)
target_link_libraries(td_longform PUBLIC td_common PRIVATE PkgConfig::ZLIB m)
