#!/usr/bin/env bash
# System tools the multi-host tests use, where they can be installed (root, apt-get):
# iptables impairs a namespace host's link (tests/link_impair.py; these kernels have no
# netem). Without them those tests skip, saying why; nothing here fails the run.
set -uo pipefail
if [ "$(id -u)" -ne 0 ] || command -v iptables > /dev/null; then
    exit 0
fi
if ! command -v apt-get > /dev/null; then
    echo "setup_host_tools.sh: no iptables and no apt-get: the slow-link tests will skip"
    exit 0
fi
# bounded: an unreachable mirror must not hold the test run
apt() { DEBIAN_FRONTEND=noninteractive timeout 300 apt-get -q -o Acquire::http::Timeout=30 "$@"; }
apt install -y iptables > /tmp/setup_host_tools.log 2>&1 \
    || { apt update > /dev/null 2>&1 && apt install -y iptables > /tmp/setup_host_tools.log 2>&1; } \
    || echo "setup_host_tools.sh: installing iptables failed (the slow-link tests will" \
            "skip): $(tail -1 /tmp/setup_host_tools.log)"
exit 0
