#!/usr/bin/env bash
# A Docker engine and two local images for the test fixtures' testcontainers path
# (tests/integration/test_testcontainers_path.py; the README says why it exists).
#
# 1. Installs docker.io (apt) when neither `dockerd` nor an answering engine is there.
# 2. Starts `dockerd` when the socket does not answer (log: $TWOPC_DOCKERD_LOG, default
#    /tmp/twopc-dockerd.log) and waits, bounded, until `docker info` answers.
# 3. Builds twopc-local/postgres:<major> and twopc-local/redis:<major> from the host's own
#    PostgreSQL and Redis binaries (tools/ensure-servers.sh installs those) when absent or built by
#    an older recipe. No registry is needed: CI machines of this kind cannot reach Docker Hub. They
#    are our images, never tagged as the official ones; their entrypoints accept what
#    testcontainers' PostgresContainer and RedisContainer pass (POSTGRES_USER/PASSWORD/DB, a
#    "postgres -c ..." or "redis-server ..." command).
#
# --check: install and start nothing (images are still built if an engine answers).
# --print-env: print TWOPC_TEST_POSTGRES_IMAGE=... and TWOPC_TEST_REDIS_IMAGE=... on stdout.
# Exit 0: ready. Exit 3: this machine cannot have an engine (no apt and no dockerd, not root and
# no password-less sudo, or --check and none answers); the reason is the last stderr line.
# Any other exit: something that should have worked failed; the reason is on stderr.
set -euo pipefail
RECIPE=4 # bump when the image layout below changes: older images are rebuilt
LOG=${TWOPC_DOCKERD_LOG:-/tmp/twopc-dockerd.log}
WAIT_SECONDS=${TWOPC_DOCKERD_WAIT:-60}
check=false
print_env=false
for arg in "$@"; do
    case $arg in
    --check) check=true ;;
    --print-env) print_env=true ;;
    *) echo "usage: $0 [--check] [--print-env]" >&2 && exit 2 ;;
    esac
done

cannot() { echo "ensure-docker: no Docker engine can be had here: $*" >&2 && exit 3; }
fail() { echo "ensure-docker: $*" >&2 && exit 1; }
engine_answers() { docker info >/dev/null 2>&1; }

sudo=""
if [[ $(id -u) -ne 0 ]]; then
    if sudo -n true 2>/dev/null; then sudo="sudo -n"; else sudo="none"; fi
fi
as_root() {
    [[ $sudo != none ]] || cannot "not root and sudo asks for a password (needed to: $*)"
    $sudo "$@"
}

install_engine() {
    $check && cannot "no engine answers (--check installs nothing; run tools/ensure-docker.sh)"
    command -v apt-get >/dev/null || cannot "no dockerd and no apt-get to install docker.io"
    echo "ensure-docker: installing docker.io" >&2
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq docker.io >/dev/null
}

start_engine() {
    $check && cannot "no engine answers (--check starts nothing; run tools/ensure-docker.sh)"
    local pid
    pid=$(cat /var/run/docker.pid 2>/dev/null || true)
    if [[ -n $pid && -d /proc/$pid ]]; then
        echo "ensure-docker: dockerd (pid $pid) is running; waiting for it to answer" >&2
    elif [[ -d /run/systemd/system ]] && command -v systemctl >/dev/null; then
        echo "ensure-docker: starting docker.service" >&2
        as_root systemctl start docker.service
    else
        echo "ensure-docker: starting dockerd (log: $LOG)" >&2
        # setsid and closed descriptors: the daemon outlives this script and holds no caller's pipe
        as_root setsid -f dockerd </dev/null >>"$LOG" 2>&1
    fi
    local waited=0
    until engine_answers; do
        ((waited < WAIT_SECONDS)) || fail "dockerd did not answer within ${WAIT_SECONDS}s;" \
            "docker info says: $(docker info 2>&1 | tail -n 2 | tr '\n' ' ')" \
            "last lines of $LOG: $(tail -n 5 "$LOG" 2>/dev/null | tr '\n' ' ')"
        sleep 1
        waited=$((waited + 1))
    done
}

# -- images ---------------------------------------------------------------------------------------

image_current() {
    docker image inspect -f '{{range .Config.Env}}{{println .}}{{end}}' "$1" 2>/dev/null |
        grep -qx "TWOPC_IMAGE_RECIPE=$RECIPE"
}

# Copies files (keeping their paths) and every library `ldd` lists for them into the rootfs $1.
copy_with_libs() {
    local root=$1 path
    shift
    for path in "$@"; do
        copy_to "$root" -a "$path"
        # a link's target too: redis-server is a link to redis-check-rdb (argv[0] picks the mode)
        [[ ! -L $path || -e $root$(readlink -f "$path") ]] || copy_to "$root" -a "$(readlink -f "$path")"
    done
    for path in $(ldd "$@" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3} /^[ \t]+\// && $2 ~ /^\(/ {print $1}' | sort -u); do
        [[ -e $root$path ]] || copy_to "$root" -L "$path"
    done
}

# cp --parents, without it (coreutils 9.1's fails on some parent directories): copy_to root opt path
copy_to() {
    mkdir -p "$1$(dirname "$3")"
    cp "$2" "$3" "$1$3"
}

# The parts every image shares: a shell for the entrypoint, rm, /tmp, and the passwd entries
# initdb needs (it refuses a uid without a name).
base_rootfs() {
    local root=$1
    chmod 755 "$root" # mktemp's 0700 would become the image's / and lock out uid 999
    mkdir -p "$root/bin" "$root/etc" "$root/tmp" "$root/usr/local/bin"
    copy_with_libs "$root" "$(readlink -f /bin/sh)" "$(command -v rm)"
    [[ -e $root/bin/sh ]] || ln -s "$(readlink -f /bin/sh)" "$root/bin/sh"
    chmod 1777 "$root/tmp"
    printf 'root:x:0:0:root:/root:/bin/sh\npostgres:x:999:999:postgres:/var/lib/postgresql:/bin/sh\n' >"$root/etc/passwd"
    printf 'root:x:0:\npostgres:x:999:\n' >"$root/etc/group"
    printf 'passwd: files\ngroup: files\nhosts: files dns\n' >"$root/etc/nsswitch.conf"
}

# Imports rootfs $1 as image $2; dirs owned by uid 999 are appended after the root-owned rest, so
# no chown (and no root) is needed to build. Further arguments are `docker import --change`s.
import_rootfs() {
    local root=$1 tag=$2 tarball old
    shift 2
    tarball=$(mktemp --suffix=.tar)
    tar -C "$root" --numeric-owner --owner=0 --group=0 --exclude=./var/lib/postgresql \
        --exclude=./var/run/postgresql -cf "$tarball" .
    if [[ -d $root/var/lib/postgresql ]]; then
        tar -C "$root" --numeric-owner --owner=999 --group=999 -rf "$tarball" \
            ./var/lib/postgresql ./var/run/postgresql
    fi
    old=$(docker image inspect -f '{{.Id}}' "$tag" 2>/dev/null || true)
    local changes=(--change "ENV TWOPC_IMAGE_RECIPE=$RECIPE")
    for change in "$@"; do changes+=(--change "$change"); done
    docker import "${changes[@]}" "$tarball" "$tag" >/dev/null
    rm -f "$tarball"
    [[ -z $old ]] || docker rmi "$old" >/dev/null 2>&1 || true
}

build_redis() {
    local tag=$1 server root
    server=$(command -v redis-server) || fail "no redis-server binary to build $tag from (run tools/ensure-servers.sh)"
    root=$(mktemp -d)
    base_rootfs "$root"
    copy_with_libs "$root" "$server"
    mkdir -m 1777 "$root/data"
    # The official image's entrypoint adds --protected-mode no (clients come through the bridge,
    # not loopback); ours does the same and nothing else.
    cat >"$root/usr/local/bin/twopc-redis-entrypoint" <<'EOF'
#!/bin/sh
# twopc-local/redis: runs the given redis-server command with protected mode off
if [ "${1:-}" = redis-server ]; then
    shift
    exec redis-server --protected-mode no "$@"
fi
exec "$@"
EOF
    chmod 755 "$root/usr/local/bin/twopc-redis-entrypoint"
    import_rootfs "$root" "$tag" "ENV PATH=/usr/local/bin:/usr/bin:/bin" "WORKDIR /data" \
        "EXPOSE 6379" 'ENTRYPOINT ["/usr/local/bin/twopc-redis-entrypoint"]' 'CMD ["redis-server"]'
    rm -rf "$root"
}

build_postgres() {
    local tag=$1 pgdir=$2 ver root
    ver=$(basename "$pgdir")
    root=$(mktemp -d)
    base_rootfs "$root"
    # every server module but LLVM's JIT (~100 MB of libraries; postgres runs without it)
    copy_with_libs "$root" "$pgdir"/bin/* $(ls "$pgdir"/lib/*.so | grep -v /llvmjit)
    copy_to "$root" -a "/usr/share/postgresql/$ver"
    copy_to "$root" -a /usr/share/zoneinfo
    mkdir -p -m 700 "$root/var/lib/postgresql/data"
    mkdir -p -m 2775 "$root/var/run/postgresql"
    cat >"$root/usr/local/bin/twopc-postgres-entrypoint" <<'EOF'
#!/bin/sh
# twopc-local/postgres: initialises a cluster from POSTGRES_USER/POSTGRES_PASSWORD/POSTGRES_DB on
# first start (password auth from the network, as the official image), then runs postgres with the
# command's arguments ("postgres -c max_prepared_transactions=64 ...").
set -eu
: "${POSTGRES_PASSWORD:?twopc-local/postgres needs POSTGRES_PASSWORD}"
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
[ "${1:-}" != postgres ] || shift
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    printf '%s\n' "$POSTGRES_PASSWORD" >/tmp/pwfile
    initdb -N -D "$PGDATA" -U "$user" --pwfile=/tmp/pwfile -E UTF8 --locale=C \
        --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f /tmp/pwfile
    printf 'host all all 0.0.0.0/0 scram-sha-256\nhost all all ::/0 scram-sha-256\n' >>"$PGDATA/pg_hba.conf"
    printf "listen_addresses = '*'\n" >>"$PGDATA/postgresql.conf"
    if [ "$db" != postgres ]; then
        echo "CREATE DATABASE \"$db\"" | postgres --single -D "$PGDATA" postgres >/dev/null
    fi
fi
exec postgres -D "$PGDATA" "$@"
EOF
    chmod 755 "$root/usr/local/bin/twopc-postgres-entrypoint"
    import_rootfs "$root" "$tag" "ENV PATH=$pgdir/bin:/usr/local/bin:/usr/bin:/bin" \
        "ENV PGDATA=/var/lib/postgresql/data" "ENV TZ=UTC" "USER 999:999" "EXPOSE 5432" \
        'ENTRYPOINT ["/usr/local/bin/twopc-postgres-entrypoint"]' 'CMD ["postgres"]'
    rm -rf "$root"
}

# -- main -----------------------------------------------------------------------------------------

if ! engine_answers; then
    said=$(docker info 2>&1 | tail -n 1 || true)
    [[ $said != *"permission denied"* ]] || fail "an engine runs, but not for $(id -un): $said"
    # an engine named elsewhere is someone else's to start
    [[ ${DOCKER_HOST:-unix:///var/run/docker.sock} == unix:///var/run/docker.sock ]] ||
        fail "DOCKER_HOST=$DOCKER_HOST does not answer: $(docker info 2>&1 | tail -n 1)"
    command -v dockerd >/dev/null || install_engine
    engine_answers || start_engine # the package's own scripts may have started it
fi

pgdir=$(compgen -G "/usr/lib/postgresql/*/bin/postgres" | sort -V | tail -n 1 | xargs -r dirname | xargs -r dirname)
[[ -n $pgdir ]] || fail "no /usr/lib/postgresql/<ver>/bin/postgres to build an image from (run tools/ensure-servers.sh)"
redis_major=$(redis-server --version 2>/dev/null | sed -n 's/.* v=\([0-9]*\)\..*/\1/p')
[[ -n $redis_major ]] || fail "no redis-server binary to build an image from (run tools/ensure-servers.sh)"
pg_image="twopc-local/postgres:$(basename "$pgdir")"
redis_image="twopc-local/redis:$redis_major"
image_current "$pg_image" || { echo "ensure-docker: building $pg_image" >&2 && build_postgres "$pg_image" "$pgdir"; }
image_current "$redis_image" || { echo "ensure-docker: building $redis_image" >&2 && build_redis "$redis_image"; }
if $print_env; then
    echo "TWOPC_TEST_POSTGRES_IMAGE=$pg_image"
    echo "TWOPC_TEST_REDIS_IMAGE=$redis_image"
fi
