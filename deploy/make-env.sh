#!/bin/sh
# Print deploy/.env.example with a fresh HSSTREAM_API_TOKEN (the sidecar refuses the example's
# placeholder) and, given `cpu`, COMPOSE_PROFILES=cpu. Then edit what your host needs.
#
#   deploy/make-env.sh > deploy/.env          # GPU host
#   deploy/make-env.sh cpu > deploy/.env      # the cpu profile: runs as printed
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
token="$(python3 -c 'import secrets; print(secrets.token_hex(32))')"
profile="${1:-}"
case "$profile" in
  ""|gpu) sed "s/^HSSTREAM_API_TOKEN=.*/HSSTREAM_API_TOKEN=$token/" "$here/.env.example" ;;
  cpu) sed -e "s/^HSSTREAM_API_TOKEN=.*/HSSTREAM_API_TOKEN=$token/" -e "s/^COMPOSE_PROFILES=.*/COMPOSE_PROFILES=cpu/" \
           -e "s/^SPOOL_SIZE=.*/SPOOL_SIZE=1g/" -e "s/^HSSTREAM_SPOOL_BUDGET_BYTES=.*/HSSTREAM_SPOOL_BUDGET_BYTES=268435456/" \
           "$here/.env.example" ;;
  *) echo "usage: $0 [gpu|cpu]" >&2; exit 2 ;;
esac
