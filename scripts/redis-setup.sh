#!/usr/bin/env bash
# Installs what the Redis tier's tests need, once per machine: `redis-server` and `redis-cli`
# (Debian's redis-server package, which brings redis-tools). The tests start their own
# servers on free loopback ports, a single node and a cluster; nothing here starts one.
#
# A second run is a no-op. Without apt-get (or the rights to use it) it says what to install
# and fails: the tests never skip a missing server.
set -euo pipefail

if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then
    exit 0
fi
echo "redis-setup: installing redis-server (Debian's package)" >&2
sudo=""
if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null; then
        sudo="sudo"
    else
        echo "redis-setup: redis-server is missing and this user cannot install it; install Debian's redis-server package (or put redis-server and redis-cli on PATH)" >&2
        exit 1
    fi
fi
if ! command -v apt-get >/dev/null; then
    echo "redis-setup: no apt-get here; install redis-server and redis-cli (Redis 7) and put them on PATH" >&2
    exit 1
fi
$sudo apt-get update -qq >&2
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >&2
# The package starts a system server on port 6379; the tests do not use it.
command -v redis-server >/dev/null && command -v redis-cli >/dev/null
