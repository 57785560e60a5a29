/* tandem-worker on the command line: bad arguments get a clear error and
 * exit status 2 before anything starts; addresses it cannot advertise are
 * refused when it starts, naming why. */
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

/* A wildcard --host needs --advertise; an --advertise that is no address is
 * refused; a numeric --advertise no interface here carries cannot be UCX's
 * (it would give peers this host's own addresses). */
Test(worker_cli, addresses_it_cannot_advertise_are_refused) {
  char args[1024], err[4096];
  const char *base = "--router tcp://127.0.0.1:1 --model " TD_TEST_DATA "/t5-tiny --role decode --id w";
  snprintf(args, sizeof args, "%s --host 0.0.0.0", base);
  cr_expect_eq(run_worker(args, err, sizeof err), 1, "%s", err);
  cr_expect(strstr(err, "--host 0.0.0.0: a wildcard is no address peers can dial; give --advertise"), "%s", err);
  snprintf(args, sizeof args, "%s --host 0.0.0.0 --advertise '*'", base);
  cr_expect_eq(run_worker(args, err, sizeof err), 1, "%s", err);
  cr_expect(strstr(err, "--advertise *: a wildcard"), "%s", err);
  snprintf(args, sizeof args, "%s --advertise tcp://10.0.0.7:7001", base);
  cr_expect_eq(run_worker(args, err, sizeof err), 1, "%s", err);
  cr_expect(strstr(err, "without a scheme"), "%s", err);
  snprintf(args, sizeof args, "%s --host 127.0.0.1 --advertise 192.0.2.1 --kv-transport ucx", base);
  cr_expect_eq(run_worker(args, err, sizeof err), 1, "%s", err);
  cr_expect(strstr(err, "no interface here carries 192.0.2.1"), "%s", err);
}

/* Two running sets are for a pipeline group: a count other than 1 or 2,
 * or 2 on a worker that is no pipeline, is refused at once. */
Test(worker_cli, running_sets_outside_a_pipeline_are_refused) {
  char err[4096];
  cr_expect_eq(run_worker("--router tcp://127.0.0.1:1 --model /nonexistent --pp-sets 3", err, sizeof err), 2, "%s", err);
  cr_expect(strstr(err, "--pp-sets 3: 1 or 2"), "%s", err);
  const char *args = "--router tcp://127.0.0.1:1 --model " TD_TEST_DATA "/t5-tiny --device cpu --pp-sets 2 --id w";
  cr_expect_eq(run_worker(args, err, sizeof err), 2, "%s", err);
  cr_expect(strstr(err, "--pp-sets 2 is for a pipeline group"), "%s", err);
}

/* --encode-defer: a number of steps from -1 to 1000, and only with two running sets. */
Test(worker_cli, encode_defer_is_checked) {
  char err[4096];
  const char *bad[] = {"x", "-2", "1001", "", "3steps"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char args[256];
    snprintf(args, sizeof args, "--router tcp://127.0.0.1:1 --model /nonexistent --encode-defer '%s'", bad[i]);
    cr_expect_eq(run_worker(args, err, sizeof err), 2, "%s: %s", bad[i], err);
    cr_expect(strstr(err, "steps, -1 (never) to 1000"), "%s: %s", bad[i], err);
  }
  const char *args = "--router tcp://127.0.0.1:1 --model " TD_TEST_DATA "/t5-tiny --device cpu --encode-defer 4 --id w";
  cr_expect_eq(run_worker(args, err, sizeof err), 2, "%s", err);
  cr_expect(strstr(err, "--encode-defer is for two running sets"), "%s", err);
}

/* --spin-us: 0 to TD_MAX_SPIN_US microseconds, nothing else. */
Test(worker_cli, spin_is_checked) {
  char err[4096];
  const char *bad[] = {"x", "-1", "100001", "", "5ms"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char args[256];
    snprintf(args, sizeof args, "--router tcp://127.0.0.1:1 --model /nonexistent --spin-us '%s'", bad[i]);
    cr_expect_eq(run_worker(args, err, sizeof err), 2, "%s: %s", bad[i], err);
    cr_expect(strstr(err, "0 to 100000 microseconds"), "%s: %s", bad[i], err);
  }
}
