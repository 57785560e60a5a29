/* Logging (common/log.c): JSON lines that parse, escape what they must and
 * carry the thread's request; the text format unchanged; levels filter; error
 * messages (common/status.c) that quote the last one. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/log.h"
#include "common/status.h"

/* The lines written to f since it was opened, one string each (n of them). */
static int read_lines(FILE *f, char lines[][1024], int cap) {
  rewind(f);
  int n = 0;
  while (n < cap && fgets(lines[n], 1024, f)) n++;
  return n;
}

static void *other_thread(void *arg) {
  (void)arg;
  TD_INFO("from another thread"); /* the main thread's request is not this thread's */
  return NULL;
}

Test(log, json_lines_carry_the_request_and_escape_the_message) {
  FILE *f = tmpfile();
  cr_assert(f);
  td_log_set_file(f);
  td_log_set_format(TD_LOG_JSON);
  td_log_set_name("router");
  td_log_set_level(TD_LOG_INFO);
  TD_INFO("no request yet");
  td_log_set_request("trt-26");
  TD_WARN("quote \" backslash \\ newline \n tab \t done");
  TD_DEBUG("below the level: not written");
  pthread_t t;
  pthread_create(&t, NULL, other_thread, NULL);
  pthread_join(t, NULL);
  TD_LOG_ABOUT("other-7", TD_ERROR, "about %s", "another request");
  TD_INFO("back to its own");
  td_log_set_request(NULL);
  TD_INFO("cleared");
  char lines[8][1024];
  int n = read_lines(f, lines, 8);
  cr_assert_eq(n, 6, "%d lines", n);
  const char *want_req[] = {NULL, "trt-26", NULL, "other-7", "trt-26", NULL};
  const char *want_lvl[] = {"info", "warn", "info", "error", "info", "info"};
  for (int i = 0; i < n; i++) {
    cJSON *o = cJSON_Parse(lines[i]);
    cr_assert(o, "line %d is not JSON: %s", i, lines[i]);
    cr_expect_str_eq(cJSON_GetStringValue(cJSON_GetObjectItem(o, "level")), want_lvl[i]);
    cr_expect_str_eq(cJSON_GetStringValue(cJSON_GetObjectItem(o, "proc")), "router");
    cr_expect(cJSON_IsNumber(cJSON_GetObjectItem(o, "pid")));
    cr_expect(strstr(cJSON_GetStringValue(cJSON_GetObjectItem(o, "src")), "test_log.c:"));
    cr_expect(strlen(cJSON_GetStringValue(cJSON_GetObjectItem(o, "time"))) == 23);
    const char *req = cJSON_GetStringValue(cJSON_GetObjectItem(o, "request"));
    if (want_req[i]) cr_expect(req && !strcmp(req, want_req[i]), "line %d: request %s", i, req ? req : "(none)");
    else cr_expect(!req, "line %d names request %s", i, req);
    if (i == 1)
      cr_expect_str_eq(cJSON_GetStringValue(cJSON_GetObjectItem(o, "msg")),
                       "quote \" backslash \\ newline \n tab \t done");
    cJSON_Delete(o);
  }
  td_log_set_format(TD_LOG_TEXT);
  td_log_set_file(NULL);
  fclose(f);
}

Test(log, text_lines_as_before) {
  FILE *f = tmpfile();
  td_log_set_file(f);
  td_log_set_format(TD_LOG_TEXT);
  td_log_set_name("worker");
  td_log_set_request("r1");
  TD_INFO("hello %d", 42);
  td_log_set_request(NULL);
  char lines[2][1024];
  cr_assert_eq(read_lines(f, lines, 2), 1);
  cr_expect(strstr(lines[0], " I worker[") && strstr(lines[0], "test_log.c:") && strstr(lines[0], " hello 42\n"),
            "%s", lines[0]);
  td_log_set_file(NULL);
  fclose(f);
}

Test(log, formats_parse) {
  cr_expect_eq(td_log_parse_format("json"), TD_LOG_JSON);
  cr_expect_eq(td_log_parse_format("TEXT"), TD_LOG_TEXT);
  cr_expect_eq(td_log_parse_format("yaml"), -1);
  cr_expect_eq(td_log_parse_format(NULL), -1);
}

/* An error message built from the previous one (td_err(..., "%s",
 * td_errmsg())) wraps it whole: the message buffer is not read while it is
 * written. */
Test(status, a_message_may_quote_the_last_one) {
  td_err(TD_ERR_INVALID, "inner %d", 7);
  cr_assert_eq(td_err(TD_ERR_FORMAT, "outer: %s", td_errmsg()), TD_ERR_FORMAT);
  cr_expect_str_eq(td_errmsg(), "outer: inner 7");
  td_err(TD_ERR_INVALID, "a");
  td_err(TD_ERR_INVALID, "%s%s%s", td_errmsg(), td_errmsg(), td_errmsg());
  cr_expect_str_eq(td_errmsg(), "aaa");
}
