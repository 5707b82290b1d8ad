#!/usr/bin/env bash
# The demo and the test suite start their own throwaway PostgreSQL and Redis servers from the
# local binaries; on a fresh Debian/Ubuntu machine install them (nothing is started or enabled
# here). Skipped when the binaries are present, or when TWOPC_TEST_POSTGRES_URL and
# TWOPC_TEST_REDIS_URL point at servers someone else runs.
set -euo pipefail
need=()
have_pg=false
command -v initdb >/dev/null && have_pg=true
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null && have_pg=true
$have_pg || [[ -n "${TWOPC_TEST_POSTGRES_URL:-}" ]] || need+=(postgresql)
command -v redis-server >/dev/null || [[ -n "${TWOPC_TEST_REDIS_URL:-}" ]] || need+=(redis-server)
((${#need[@]})) || exit 0
if ! command -v apt-get >/dev/null; then
    echo "twopc needs ${need[*]} (binaries on PATH); install them with your package manager" >&2
    exit 1
fi
sudo=""
[[ $(id -u) -eq 0 ]] || sudo="sudo"
echo "installing ${need[*]}" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}"
