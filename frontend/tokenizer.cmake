# Tokenizers (td_tokenizer) and the tandem-frontend command.
# PCRE2: patterns; utf8proc: Unicode normalization and classes; libsentencepiece
# (C++, behind tokenizer_spm.cc, the one C++ file): Marian's spm models.
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
pkg_check_modules(UTF8PROC REQUIRED IMPORTED_TARGET libutf8proc)
pkg_check_modules(SENTENCEPIECE REQUIRED IMPORTED_TARGET sentencepiece)
enable_language(CXX)
set(CMAKE_CXX_STANDARD 17)
set(CMAKE_CXX_STANDARD_REQUIRED ON)

add_library(td_tokenizer STATIC
  ${CMAKE_CURRENT_LIST_DIR}/tokenizer.c ${CMAKE_CURRENT_LIST_DIR}/tokenizer_api.c
  ${CMAKE_CURRENT_LIST_DIR}/tokenizer_text.c ${CMAKE_CURRENT_LIST_DIR}/tokenizer_norm.c
  ${CMAKE_CURRENT_LIST_DIR}/tokenizer_pretok.c ${CMAKE_CURRENT_LIST_DIR}/tokenizer_model.c
  ${CMAKE_CURRENT_LIST_DIR}/tokenizer_decode.c ${CMAKE_CURRENT_LIST_DIR}/tokenizer_marian.c
  ${CMAKE_CURRENT_LIST_DIR}/whisper_prompt.c
  ${CMAKE_CURRENT_LIST_DIR}/tokenizer_spm.cc)
# stdc++ by name: C programs in folders that never enabled C++ link this library
target_link_libraries(td_tokenizer PUBLIC td_common
  PRIVATE PkgConfig::PCRE2 PkgConfig::UTF8PROC PkgConfig::SENTENCEPIECE stdc++)

add_executable(tandem-frontend ${CMAKE_CURRENT_LIST_DIR}/main.c)
target_link_libraries(tandem-frontend PRIVATE td_tokenizer td_audio)
