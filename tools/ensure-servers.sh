#!/usr/bin/env bash
# The demo and the test suite start their own throwaway PostgreSQL and Redis servers from the
# local binaries; on a fresh Debian/Ubuntu machine install them (nothing is started or enabled
# here). Skipped when the binaries are present, or when TWOPC_TEST_POSTGRES_URL and
# TWOPC_TEST_REDIS_URL point at servers someone else runs. The Spark tests also need a Java
# runtime (PySpark 4 needs Java 17 or newer): a headless one is installed when `java` is missing.
set -euo pipefail
need=()
have_pg=false
command -v initdb >/dev/null && have_pg=true
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null && have_pg=true
$have_pg || [[ -n "${TWOPC_TEST_POSTGRES_URL:-}" ]] || need+=(postgresql)
command -v redis-server >/dev/null || [[ -n "${TWOPC_TEST_REDIS_URL:-}" ]] || need+=(redis-server)
need_java=false
command -v java >/dev/null || [[ -x "${JAVA_HOME:-/nonexistent}/bin/java" ]] || need_java=true
((${#need[@]})) || $need_java || exit 0
if ! command -v apt-get >/dev/null; then
    $need_java && need+=("a Java 17+ runtime")
    echo "twopc needs ${need[*]} (binaries on PATH); install them with your package manager" >&2
    exit 1
fi
sudo=""
[[ $(id -u) -eq 0 ]] || sudo="sudo"
((${#need[@]})) && echo "installing ${need[*]}" >&2
$need_java && echo "installing a headless Java runtime (for the Spark tests)" >&2
$sudo apt-get update -qq
if $need_java; then
    # Java 17 where the distribution still ships it, else its default (newer) runtime
    if apt-cache show openjdk-17-jre-headless >/dev/null 2>&1; then
        need+=(openjdk-17-jre-headless)
    else
        need+=(default-jre-headless)
    fi
fi
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}"
