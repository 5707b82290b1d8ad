"""The fixtures' testcontainers path, run for real against a Docker engine (issue 18, point 5).

Everywhere else the suite starts servers from local binaries, so the Docker path in
tests/support/servers.py would only ever run on a machine without them, and could rot unseen.
Here it runs on every CI machine: tools/ensure-docker.sh installs and starts an engine if needed
and builds local images from the host's own PostgreSQL and Redis (no registry is reachable in CI),
and the test starts containers through the very functions the fixtures call, then runs a
two-phase transaction over both.

Where the engine comes from: under ``CI=true`` (or ``TWOPC_TEST_SERVERS=docker``) the script may
install and start one; anywhere else it only checks (``--check``), so a developer's ``pytest``
never installs a daemon. A missing engine fails under CI with the script's reason, unless the
machine cannot have one at all (the script's exit 3: no apt and no dockerd, or no root): then it
skips with that reason. Images are built once and reused; with them present this file takes
about 20 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import redis

from coordinator import TransactionManager
from resource_managers.postgres import PostgresResource
from resource_managers.redis import RedisResource
from tests.support.managers import make_manager
from tests.support.pg import ledger_engine, move, prepared_gids, total, transfer_ids
from tests.support.servers import (
    PG_IMAGE_ENV,
    REDIS_IMAGE_ENV,
    SERVERS_ENV,
    ExternalPostgres,
    docker_works,
    redis_container_url,
    start_postgres_container,
    start_redis_container,
)

ROOT = Path(__file__).resolve().parents[2]
ENSURE = ROOT / "tools" / "ensure-docker.sh"
CANNOT_HAVE_AN_ENGINE = 3  # tools/ensure-docker.sh's exit status for "not on this machine"


def _ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def _no_engine(reason: str) -> None:
    """Fail under CI (a CI run must not pass by skipping the Docker path), else skip."""
    if _ci():
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


def _ensure_images() -> dict[str, str]:
    """Runs tools/ensure-docker.sh; returns the image variables it prints."""
    may_install = _ci() or os.environ.get(SERVERS_ENV, "").lower() == "docker"
    args = [str(ENSURE), "--print-env"] + ([] if may_install else ["--check"])
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, check=False)
    said = done.stderr.strip().splitlines()
    reason = said[-1] if said else f"tools/ensure-docker.sh exited {done.returncode}"
    if done.returncode == CANNOT_HAVE_AN_ENGINE:
        pytest.skip(reason)
    if done.returncode != 0:
        _no_engine(f"tools/ensure-docker.sh failed (exit {done.returncode}): {done.stderr.strip()}")
    return dict(line.split("=", 1) for line in done.stdout.split() if "=" in line)


@pytest.fixture(scope="module")
def images() -> Iterator[dict[str, str]]:
    """The images the fixtures' functions will start: set by the user, or built locally."""
    given = {env: os.environ[env] for env in (PG_IMAGE_ENV, REDIS_IMAGE_ENV) if env in os.environ}
    chosen = given if len(given) == 2 else {**_ensure_images(), **given}
    if not docker_works():
        _no_engine("no Docker engine answers the docker client (DOCKER_HOST or the socket)")
    with pytest.MonkeyPatch.context() as patch:
        for env, image in chosen.items():
            patch.setenv(env, image)
        yield chosen


def _removed(container: Any) -> Callable[[], None]:
    def stop() -> None:
        container.stop()

    return stop


def _leftovers(client: redis.Redis) -> list[bytes]:
    """Locks, staged write sets and prepared entries: none may outlive a finished branch."""
    keys = list(client.scan_iter(match=b"*:lock:*")) + list(client.scan_iter(match=b"*:ws:*"))
    return keys + [k for k in client.scan_iter(match=b"*:prepared") if client.zcard(k)]


def _still_there(container_ids: list[str]) -> list[str]:
    import docker

    client = docker.from_env()
    try:
        return [c.id for c in client.containers.list(all=True) if c.id in container_ids]
    finally:
        client.close()


def _transfer(tm: TransactionManager, bank: PostgresResource, cache: RedisResource) -> None:
    with tm.transaction() as tx:
        move(tx.join(bank), "t1", 1, -10)
        tx.join(cache).incrby("credited:1", 10)
    with pytest.raises(RuntimeError), tm.transaction() as tx:
        move(tx.join(bank), "t2", 1, -99)
        tx.join(cache).incrby("credited:1", 99)
        raise RuntimeError("atomicity: neither side may keep t2")


def test_a_two_phase_transaction_over_postgres_and_redis_containers(
    images: dict[str, str], managers: list[TransactionManager]
) -> None:
    with ExitStack() as stack:
        pg_container = start_postgres_container()
        stack.callback(_removed(pg_container))
        redis_container = start_redis_container()
        stack.callback(_removed(redis_container))
        ids = [pg_container.get_wrapped_container().id, redis_container.get_wrapped_container().id]
        assert pg_container.image == images[PG_IMAGE_ENV]
        assert redis_container.image == images[REDIS_IMAGE_ENV]

        server = ExternalPostgres(pg_container.get_connection_url())
        engine = ledger_engine(server.url(server.create_database()))
        stack.callback(engine.dispose)
        client = redis.Redis.from_url(redis_container_url(redis_container))
        stack.callback(client.close)
        # the settings the fixtures pass reached the servers: prepared transactions, AOF fsync
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW max_prepared_transactions").scalar_one() == "64"
        assert client.config_get("appendfsync") == {"appendfsync": "always"}

        bank, cache = PostgresResource(engine, "bank"), RedisResource(client, "cache")
        tm = make_manager(managers, [bank, cache])
        _transfer(tm, bank, cache)

        assert total(engine) == 3990 and transfer_ids(engine) == {"t1"}
        assert client.get("credited:1") == b"10"
        assert prepared_gids(engine) == [] and _leftovers(client) == []
        counts = tm.metrics.as_dict()
        assert counts["outcome_committed"] == 1 and counts.get("one_phase", 0) == 0
    assert _still_there(ids) == []


def test_the_session_fixtures_take_the_docker_path_when_asked(
    images: dict[str, str], tmp_path: Path
) -> None:
    """TWOPC_TEST_SERVERS=docker: pg_server and redis_server start containers, and the session's
    end removes them (run in a child pytest, since this session's servers are already chosen)."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "def test_probe(pg_server, redis_url):\n"
        "    import redis\n"
        "    assert not pg_server.killable\n"
        "    aof = redis.Redis.from_url(redis_url).config_get('appendonly')\n"
        "    assert aof == {'appendonly': 'yes'}\n"
        "    print('containers:', pg_server.dsn().rsplit('@', 1)[-1], redis_url)\n"
    )
    env = {**os.environ, SERVERS_ENV: "docker", **images, "PYTHONPATH": str(ROOT)}
    env.pop("TWOPC_TEST_POSTGRES_URL", None)
    env.pop("TWOPC_TEST_REDIS_URL", None)
    before = _container_ids(images)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "tests.support.servers", str(probe)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "containers:" in done.stdout
    assert _container_ids(images) == before, "the session left a container behind"


def _container_ids(images: dict[str, str]) -> set[str]:
    import docker

    client = docker.from_env()
    try:
        wanted = set(images.values())
        return {c.id for c in client.containers.list(all=True) if set(c.image.tags) & wanted}
    finally:
        client.close()
