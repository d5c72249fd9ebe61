#!/usr/bin/env bash
# The Ray tests (tests/ray) in a fresh network namespace with only loopback and its own PIDs:
# Ray picks and advertises addresses on its own, so it must never start on the host network.
# Every Ray process ends with the namespace. Needs root (or unprivileged user namespaces).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
if ! "$PYTHON" -c "import ray.serve" 2>/dev/null; then
  echo "ray-tests: ray is not installed: pip install 'fulcrum-serve[ray]' (make install)" >&2
  exit 1
fi
USERNS=()
if [ "$(id -u)" != 0 ]; then USERNS=(--user --map-root-user); fi
exec unshare "${USERNS[@]}" --net --pid --fork --mount-proc bash -c '
  set -e
  ip link set lo up
  if [ "$(ip -o link show | awk -F": " "{print \$2}")" != "lo" ]; then
    echo "ray-tests: the namespace has an interface besides lo" >&2; exit 1
  fi
  # Ray 2.59 imports pydantic v1-style fields: its own deprecations, not ours.
  exec "$0" -m pytest -q -rs -p no:cacheprovider -W "ignore::DeprecationWarning:ray" \
    -W "ignore::pydantic.warnings.PydanticDeprecatedSince20" tests/ray "$@"
' "$PYTHON" "$@"
