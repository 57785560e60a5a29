/* tandem-keygen NAME: a CURVE key pair for a router, worker, client or
 * gateway, as NAME.pub and NAME.key (docs/security.md). */
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "proto/auth.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: tandem-keygen NAME\n"
          "  writes a CURVE key pair: NAME.pub (the public key, to hand to peers) and NAME.key\n"
          "  (the secret key, mode 0600); Z85 text, one line each. Existing files are never\n"
          "  overwritten. docs/security.md says which process takes which file.\n");
}

int main(int argc, char **argv) {
  if (argc == 2 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
    usage(stdout);
    return 0;
  }
  if (argc != 2 || !argv[1][0] || argv[1][0] == '-') {
    usage(stderr);
    return 2;
  }
  char pub[4096], sec[4096];
  if ((size_t)snprintf(pub, sizeof pub, "%s.pub", argv[1]) >= sizeof pub ||
      (size_t)snprintf(sec, sizeof sec, "%s.key", argv[1]) >= sizeof sec) {
    fprintf(stderr, "tandem-keygen: the name is too long\n");
    return 2;
  }
  if (td_auth_keygen(pub, sec) != TD_OK) {
    fprintf(stderr, "tandem-keygen: %s\n", td_errmsg());
    return 1;
  }
  printf("%s\n%s\n", pub, sec);
  return 0;
}
