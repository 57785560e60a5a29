/* Settings from the environment: read once, parsed strictly. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "common/cross_mode.h"
#include "common/defaults.h"
#include "common/log.h"
#include "common/settings.h"

#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif
#if defined(__GLIBC__) && !defined(UNDER_ASAN)
#include <malloc.h>
#endif

static void clear(void) {
  const char *vars[] = {"TANDEM_LOG", "TANDEM_LOG_FORMAT", "TANDEM_NORM_FOLD", "TANDEM_QNORM_ROWS", "TANDEM_ENC_GRAPHS", "TANDEM_CKV_BATCH", "TANDEM_KVX_LOCAL", "TANDEM_KVX_TRACE",
                        "TANDEM_KVX_IPC", "UCX_TLS", "TANDEM_MALLOC_KEEP"};
  for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) unsetenv(vars[i]);
}

Test(settings, unset_means_defaults, .init = clear) {
  td_settings s;
  cr_assert_eq(td_settings_from_env(&s), TD_OK);
  cr_assert_eq(s.log_level, -1);
  cr_assert_eq(s.log_format, -1);
  cr_assert_eq(s.model.norm_fold, 0);
  cr_assert_eq(s.model.qnorm_rows, 0);
  cr_assert_eq(s.model.enc_graphs, 0, "unset: the encoder graphs on");
  cr_assert_eq(s.model.ckv_batch, 0, "unset: several layers' cross K/V in one GEMM");
  cr_assert_eq(s.kvx.local_path, 0);
  cr_assert_eq(s.kvx.ipc, 0);
  cr_assert_not(s.kvx.trace);
  cr_assert_str_empty(s.kvx.ucx_tls);
}

Test(settings, values_parse, .init = clear) {
  setenv("TANDEM_LOG", "warn", 1);
  setenv("TANDEM_LOG_FORMAT", "json", 1);
  setenv("TANDEM_NORM_FOLD", "0", 1);
  setenv("TANDEM_QNORM_ROWS", "0", 1);
  setenv("TANDEM_ENC_GRAPHS", "off", 1);
  setenv("TANDEM_CKV_BATCH", "off", 1);
  setenv("TANDEM_KVX_LOCAL", "off", 1);
  setenv("TANDEM_KVX_TRACE", "1", 1);
  setenv("TANDEM_KVX_IPC", "off", 1);
  setenv("UCX_TLS", "tcp", 1);
  td_settings s;
  cr_assert_eq(td_settings_from_env(&s), TD_OK);
  cr_assert_eq(s.log_level, TD_LOG_WARN);
  cr_assert_eq(s.log_format, TD_LOG_JSON);
  cr_assert_eq(s.model.norm_fold, TD_OFF);
  cr_assert_eq(s.model.qnorm_rows, -1, "0 rows: never fused");
  cr_assert_eq(s.model.enc_graphs, TD_OFF);
  cr_assert_eq(s.model.ckv_batch, TD_OFF);
  cr_assert_eq(s.kvx.local_path, TD_OFF);
  cr_assert_eq(s.kvx.ipc, TD_OFF);
  cr_assert(s.kvx.trace);
  cr_assert_str_eq(s.kvx.ucx_tls, "tcp");
  s.log_format = TD_LOG_TEXT; /* this test's own lines stay text */
  td_settings_apply(&s);
  cr_assert_eq(td_log_get_level(), TD_LOG_WARN);
  td_log_set_level(TD_LOG_INFO);
  setenv("TANDEM_QNORM_ROWS", "8", 1);
  cr_assert_eq(td_settings_from_env(&s), TD_OK);
  cr_assert_eq(s.model.qnorm_rows, 8);
}

Test(settings, bad_values_are_refused_by_name, .init = clear) {
  td_settings s;
  setenv("TANDEM_LOG", "loud", 1);
  cr_assert_eq(td_settings_from_env(&s), TD_ERR_INVALID);
  cr_assert(strstr(td_errmsg(), "TANDEM_LOG"));
  unsetenv("TANDEM_LOG");
  setenv("TANDEM_LOG_FORMAT", "xml", 1);
  cr_assert_eq(td_settings_from_env(&s), TD_ERR_INVALID);
  cr_assert(strstr(td_errmsg(), "TANDEM_LOG_FORMAT"));
  unsetenv("TANDEM_LOG_FORMAT");
  setenv("TANDEM_NORM_FOLD", "maybe", 1);
  cr_assert_eq(td_settings_from_env(&s), TD_ERR_INVALID);
  cr_assert(strstr(td_errmsg(), "TANDEM_NORM_FOLD"));
  unsetenv("TANDEM_NORM_FOLD");
  setenv("TANDEM_QNORM_ROWS", "12abc", 1);
  cr_assert_eq(td_settings_from_env(&s), TD_ERR_INVALID);
  cr_assert(strstr(td_errmsg(), "TANDEM_QNORM_ROWS"));
  unsetenv("TANDEM_QNORM_ROWS");
  setenv("TANDEM_ENC_GRAPHS", "later", 1);
  cr_assert_eq(td_settings_from_env(&s), TD_ERR_INVALID);
  cr_assert(strstr(td_errmsg(), "TANDEM_ENC_GRAPHS"));
  unsetenv("TANDEM_ENC_GRAPHS");
  setenv("TANDEM_CKV_BATCH", "2", 1);
  cr_assert_eq(td_settings_from_env(&s), TD_ERR_INVALID);
  cr_assert(strstr(td_errmsg(), "TANDEM_CKV_BATCH"));
  unsetenv("TANDEM_CKV_BATCH");
  setenv("TANDEM_KVX_IPC", "sometimes", 1);
  cr_assert_eq(td_settings_from_env(&s), TD_ERR_INVALID);
  cr_assert(strstr(td_errmsg(), "TANDEM_KVX_IPC"));
  unsetenv("TANDEM_KVX_IPC");
  /* longer than td_kvx_tuning holds: refused, not cut (a cut list names other transports) */
  char tls[sizeof s.kvx.ucx_tls + 8];
  memset(tls, 'x', sizeof tls - 1);
  tls[sizeof tls - 1] = 0;
  setenv("UCX_TLS", tls, 1);
  cr_assert_eq(td_settings_from_env(&s), TD_ERR_INVALID);
  cr_assert(strstr(td_errmsg(), "UCX_TLS"), "%s", td_errmsg());
}

/* TANDEM_MALLOC_KEEP: on unless switched off; with it a buffer of a Whisper
 * request's size is no mapping of its own (the sanitizers' allocator has
 * its own rules: only the parsing is checked there). */
Test(settings, malloc_keep, .init = clear) {
  td_settings s;
  cr_assert_eq(td_settings_from_env(&s), TD_OK);
  cr_assert_eq(s.malloc_keep, 0, "unset: the default (on)");
  setenv("TANDEM_MALLOC_KEEP", "off", 1);
  cr_assert_eq(td_settings_from_env(&s), TD_OK);
  cr_assert_eq(s.malloc_keep, TD_OFF);
  setenv("TANDEM_MALLOC_KEEP", "sometimes", 1);
  cr_assert_eq(td_settings_from_env(&s), TD_ERR_INVALID);
  cr_assert(strstr(td_errmsg(), "TANDEM_MALLOC_KEEP"), "%s", td_errmsg());
#if defined(__GLIBC__) && !defined(UNDER_ASAN)
  unsetenv("TANDEM_MALLOC_KEEP");
  cr_assert_eq(td_settings_from_env(&s), TD_OK);
  td_settings_apply(&s);
  size_t before = mallinfo2().hblks;
  char *a = malloc((size_t)3 << 19); /* 1.5 MiB */
  cr_assert_not_null(a);
  a[0] = 1;
  cr_assert_eq(mallinfo2().hblks, before, "a 1.5 MiB buffer was mapped on its own");
  free(a);
  char *b = malloc((size_t)TD_MALLOC_KEEP_MAX + 1); /* past the threshold: mapped, as before */
  cr_assert_not_null(b);
  cr_assert_eq(mallinfo2().hblks, before + 1);
  free(b);
#endif
}

/* --cross-mode names, and what an encoder-only worker pushes (tandem-worker's flag checks and its load) */
Test(cross_mode, names_and_what_an_encoder_pushes) {
  for (int i = TD_CROSS_AUTO; i <= TD_CROSS_DUAL; i++) {
    td_cross_mode m = TD_CROSS_KV;
    cr_assert_eq(td_cross_mode_parse(td_cross_mode_name((td_cross_mode)i), &m), TD_OK);
    cr_assert_eq(m, i);
  }
  td_cross_mode m;
  cr_assert_eq(td_cross_mode_parse("both", &m), TD_ERR_INVALID);
  cr_assert(strstr(td_errmsg(), "auto, kv, states or dual"), "%s", td_errmsg());
  cr_assert_eq(td_cross_mode_parse(NULL, &m), TD_ERR_INVALID);
  cr_assert(td_cross_pushes_states(TD_CROSS_AUTO, false), "auto: the states, projected on arrival");
  cr_assert(td_cross_pushes_states(TD_CROSS_STATES, false));
  cr_assert(!td_cross_pushes_states(TD_CROSS_AUTO, true), "--cross-transfer kv");
  cr_assert(!td_cross_pushes_states(TD_CROSS_STATES, true));
  cr_assert(!td_cross_pushes_states(TD_CROSS_KV, false), "a K/V pool pushes its K/V");
  cr_assert(!td_cross_pushes_states(TD_CROSS_DUAL, false));
}
