/* Addresses bound and advertised (common/net.h): wildcards, the checks of
 * an --advertise address, an endpoint rewritten to the advertised host at
 * the port bound, tcp endpoints split. */
#include <criterion/criterion.h>
#include <string.h>

#include "common/net.h"

Test(net, wildcards_and_numeric_addresses) {
  const char *wild[] = {"0.0.0.0", "*", "::", "[::]"};
  for (int i = 0; i < 4; i++) cr_expect(td_net_is_wildcard(wild[i]), "%s", wild[i]);
  cr_expect(!td_net_is_wildcard("127.0.0.1") && !td_net_is_wildcard("node-1") && !td_net_is_wildcard(NULL));
  cr_expect(td_net_is_numeric("10.0.0.7") && td_net_is_numeric("::1") && td_net_is_numeric("[fe80::1]"));
  cr_expect(!td_net_is_numeric("node-1") && !td_net_is_numeric("10.0.0") && !td_net_is_numeric(""));
}

Test(net, an_address_to_advertise_is_checked) {
  const char *good[] = {"10.0.0.7", "node-1.cluster.local", "::1", "[2001:db8::5]"};
  for (int i = 0; i < 4; i++) cr_expect_eq(td_net_check_advertise(good[i]), TD_OK, "%s: %s", good[i], td_errmsg());
  struct {
    const char *addr, *why;
  } bad[] = {{"", "empty"},
             {"0.0.0.0", "wildcard"},
             {"::", "wildcard"},
             {"tcp://10.0.0.7", "scheme"},
             {"10.0.0.7:7001", "without a port"},
             {"node 1", "not a host name"},
             {"a/b", "not a host name"}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    cr_expect_eq(td_net_check_advertise(bad[i].addr), TD_ERR_INVALID, "'%s' was taken", bad[i].addr);
    cr_expect(strstr(td_errmsg(), bad[i].why), "'%s': %s", bad[i].addr, td_errmsg());
  }
  char longer[400];
  memset(longer, 'a', sizeof longer - 1);
  longer[sizeof longer - 1] = 0;
  cr_expect_eq(td_net_check_advertise(longer), TD_ERR_INVALID);
}

Test(net, endpoints_are_advertised_at_the_port_bound) {
  char out[300];
  cr_assert_eq(td_net_advertised("tcp://0.0.0.0:41234", "10.1.2.3", out, sizeof out), TD_OK);
  cr_expect_str_eq(out, "tcp://10.1.2.3:41234");
  cr_assert_eq(td_net_advertised("tcp://[::]:7001", "2001:db8::5", out, sizeof out), TD_OK);
  cr_expect_str_eq(out, "tcp://[2001:db8::5]:7001");
  cr_assert_eq(td_net_advertised("tcp://127.0.0.1:9", "[::1]", out, sizeof out), TD_OK);
  cr_expect_str_eq(out, "tcp://[::1]:9");
  cr_assert_eq(td_net_advertised("tcp://0.0.0.0:7000", NULL, out, sizeof out), TD_OK);
  cr_expect_str_eq(out, "tcp://0.0.0.0:7000");
  cr_assert_eq(td_net_advertised("ipc:///tmp/x", "10.1.2.3", out, sizeof out), TD_OK);
  cr_expect_str_eq(out, "ipc:///tmp/x");
  cr_expect_eq(td_net_advertised("tcp://0.0.0.0:7000", "node-1", out, 12), TD_ERR_INVALID, "an endpoint was cut");
}

Test(net, tcp_endpoints_split) {
  char host[TD_NET_MAX_HOST];
  int port = 0;
  cr_assert(td_net_split_tcp("tcp://10.0.0.7:7001", host, &port));
  cr_expect_str_eq(host, "10.0.0.7");
  cr_expect_eq(port, 7001);
  cr_assert(td_net_split_tcp("tcp://[::1]:80", host, &port));
  cr_expect_str_eq(host, "::1");
  cr_expect_eq(port, 80);
  cr_expect(!td_net_split_tcp("tcp://10.0.0.7", host, &port));
  cr_expect(!td_net_split_tcp("tcp://10.0.0.7:x", host, &port));
  cr_expect(!td_net_split_tcp("tcp://10.0.0.7:70000", host, &port));
  cr_expect(!td_net_split_tcp("ipc:///tmp/x", host, &port));
  cr_expect(!td_net_split_tcp("tcp://:7001", host, &port));
}
