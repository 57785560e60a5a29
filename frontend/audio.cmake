# Whisper audio: decoding (libsndfile), resampling (libsoxr), log-mel (kissfft);
# `tandem-frontend mel` is td_frontend_mel_main (mel_cmd.c).
pkg_check_modules(SNDFILE REQUIRED IMPORTED_TARGET GLOBAL sndfile)
pkg_check_modules(SOXR REQUIRED IMPORTED_TARGET GLOBAL soxr)
pkg_check_modules(KISSFFT REQUIRED IMPORTED_TARGET GLOBAL kissfft-float)
add_library(td_audio STATIC audio.c mel.c mel_cpu.c mel_cmd.c)
target_link_libraries(td_audio PUBLIC td_common PRIVATE PkgConfig::SNDFILE PkgConfig::SOXR PkgConfig::KISSFFT m)
