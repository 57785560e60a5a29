/* tandem-worker on the command line: bad arguments get a clear error and
 * exit status 2 before anything starts. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <criterion/criterion.h>

/* Runs tandem-worker with args; its exit status, and stderr in err. */
static int run_worker(const char *args, char *err, size_t cap) {
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "%s/tandem-worker %s 2>&1 >/dev/null", TD_BIN_DIR, args);
  FILE *p = popen(cmd, "r");
  cr_assert_not_null(p);
  size_t n = fread(err, 1, cap - 1, p);
  err[n] = 0;
  int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* A role name that merely contains a role's name is none of them. */
Test(worker_cli, unknown_role_is_refused) {
  const char *bad[] = {"encoder", "decode,foo", "prefill,", "", "decode,,encode"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char args[256], err[4096];
    snprintf(args, sizeof args, "--router tcp://127.0.0.1:1 --model /nonexistent --role '%s'", bad[i]);
    cr_expect_eq(run_worker(args, err, sizeof err), 2, "--role '%s': %s", bad[i], err);
    char want[64];
    snprintf(want, sizeof want, "--role %s: a list of encode, prefill and decode", bad[i]);
    cr_expect(strstr(err, want), "--role '%s': %s", bad[i], err);
  }
}
