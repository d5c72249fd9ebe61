#!/usr/bin/env bash
# Make sure `redis-server` is on PATH: the Redis cache tests start a real one on a free loopback
# port. Installs Debian's package when missing and root; otherwise says how, and fails.
set -euo pipefail

if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "redis-server is missing: installing Debian's redis-server package" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends redis-server >/dev/null
  # The package may start a system-wide instance; the tests start their own and never use it.
  command -v redis-server >/dev/null 2>&1 && exit 0
fi
echo "redis-server is missing and could not be installed here: install it (Debian/Ubuntu:" \
  "sudo apt-get install redis-server; macOS: brew install redis), then rerun" >&2
exit 1
