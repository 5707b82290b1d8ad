"""Real PostgreSQL and Redis servers for the test suite (a pytest plugin, see tests/conftest.py).

Where they come from, first match wins:
1. ``TWOPC_TEST_POSTGRES_URL`` / ``TWOPC_TEST_REDIS_URL``: servers someone runs for us. The
   PostgreSQL role must be able to create databases. Tests that kill a server skip on these.
2. Local binaries (PATH or /usr/lib/postgresql/*/bin): throwaway servers from
   `resource_managers.throwaway`, killable with ``kill -9`` and restartable on the same data.
3. Docker through testcontainers, when the binaries are missing (or ``TWOPC_TEST_SERVERS=docker``
   asks for it) and a Docker engine answers. Images: ``TWOPC_TEST_POSTGRES_IMAGE`` /
   ``TWOPC_TEST_REDIS_IMAGE``, the official ``postgres:15`` / ``redis:7`` by default;
   tools/ensure-docker.sh builds local stand-ins (``twopc-local/...``) where no registry answers.
4. Nothing: the test skips and says what to install; under ``CI=true`` it fails instead, so a CI
   machine without servers cannot pass by skipping.

Speed: one shared cluster and one shared Redis per session; each test gets a fresh database (a
``CREATE DATABASE`` from template0, ~30 ms) or a flushed Redis. Tests that kill a server ask for
a private one (`private_pg`, `private_redis`); clusters are copied from an initialised template.
Every server started here is stopped by PID when the session ends, even after a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit, urlunsplit

import pytest

from resource_managers.throwaway import (
    INSTALL_HINT,
    PostgresServer,
    RedisServer,
    ServerError,
    drop_database,
    find_postgres_bin,
    find_redis_server,
)

PG_URL_ENV = "TWOPC_TEST_POSTGRES_URL"
REDIS_URL_ENV = "TWOPC_TEST_REDIS_URL"
PG_IMAGE_ENV = "TWOPC_TEST_POSTGRES_IMAGE"
REDIS_IMAGE_ENV = "TWOPC_TEST_REDIS_IMAGE"
SERVERS_ENV = "TWOPC_TEST_SERVERS"  # "docker": containers even where local binaries exist
LOCAL_IMAGE_PREFIX = "twopc-local/"  # tools/ensure-docker.sh's images, built without a registry


def missing(what: str) -> None:
    """Skip, or fail under CI=true: a CI run must never go green by skipping its servers."""
    message = f"no {what} available for this test: {INSTALL_HINT}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def docker_works() -> bool:
    try:
        import docker  # testcontainers' client

        docker.from_env().ping()
        return True
    except Exception:
        return False


def _docker_forced() -> bool:
    return os.environ.get(SERVERS_ENV, "").lower() == "docker"


def _image(env: str, default: str) -> str:
    """The image to start; a local one means no registry, so no reaper (pulled from Docker Hub).

    Without the reaper a ``kill -9`` of pytest leaves the container behind; every normal end,
    failures included, removes it (`_Servers.stop_all`, or the test that started it).
    """
    image = os.environ.get(env) or default
    if image.startswith(LOCAL_IMAGE_PREFIX) and "TESTCONTAINERS_RYUK_DISABLED" not in os.environ:
        from testcontainers.core.config import testcontainers_config

        testcontainers_config.ryuk_disabled = True
    return image


# -- PostgreSQL ---------------------------------------------------------------------------------


class PgCluster(Protocol):
    """What a test may ask of a PostgreSQL server, whoever started it."""

    killable: bool

    def url(self, database: str = "postgres") -> str: ...

    def dsn(self, database: str = "postgres") -> str: ...

    def create_database(self, name: str | None = None) -> str: ...

    def drop_database(self, name: str) -> None: ...


@dataclass
class ExternalPostgres:
    """A server given by URL: databases are created on it and dropped again; never killed."""

    admin_url: str
    killable: bool = False

    def url(self, database: str = "postgres") -> str:
        parts = urlsplit(self.admin_url)
        scheme = "postgresql+psycopg2"
        return urlunsplit((scheme, parts.netloc, f"/{database}", parts.query, ""))

    def dsn(self, database: str = "postgres") -> str:
        parts = urlsplit(self.admin_url)
        return urlunsplit(("postgresql", parts.netloc, f"/{database}", parts.query, ""))

    def create_database(self, name: str | None = None) -> str:
        import psycopg2

        name = name or f"t_{uuid.uuid4().hex[:12]}"
        conn = psycopg2.connect(self.dsn("postgres"))
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
        finally:
            conn.close()
        return name

    def drop_database(self, name: str) -> None:
        drop_database(self.dsn("postgres"), self.dsn(name), name)


class LocalPostgres(PostgresServer):
    killable = True


def start_postgres_container() -> Any:
    """A PostgreSQL container with prepared transactions on; wrapped like an external server."""
    from testcontainers.postgres import PostgresContainer

    container = PostgresContainer(_image(PG_IMAGE_ENV, "postgres:15"), driver="psycopg2")
    container.with_command("postgres -c max_prepared_transactions=64 -c fsync=on")
    return _started(container)


def _started(container: Any) -> Any:
    """Starts ``container``; one that never became ready is removed, not left behind."""
    try:
        return container.start()
    except BaseException:
        with contextlib.suppress(Exception):
            container.stop()
        raise


class _Servers:
    """Everything this session started, so it can all be stopped by PID at the end."""

    def __init__(self) -> None:
        self.started: list[PostgresServer | RedisServer] = []
        self.containers: list[Any] = []
        self.pg_template: Path | None = None

    def track(self, server: PostgresServer | RedisServer) -> None:
        self.started.append(server)

    def stop_all(self) -> None:
        for server in reversed(self.started):
            with contextlib.suppress(Exception):
                server.remove()
        for container in self.containers:
            with contextlib.suppress(Exception):
                container.stop()
        if self.pg_template is not None:
            shutil.rmtree(self.pg_template.parent, ignore_errors=True)


Server = TypeVar("Server", PostgresServer, RedisServer)


def _start_shared(servers: _Servers, server: Server) -> Server:
    servers.track(server)
    try:
        return server.start()
    except ServerError as exc:
        pytest.fail(f"could not start {server.what}: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def _servers() -> Iterator[_Servers]:
    servers = _Servers()
    try:
        yield servers
    finally:
        servers.stop_all()


@pytest.fixture(scope="session")
def pg_server(_servers: _Servers) -> PgCluster:
    """The session's shared PostgreSQL server; tests never kill it (see `private_pg`)."""
    url = os.environ.get(PG_URL_ENV)
    if url:
        return ExternalPostgres(url)
    if find_postgres_bin() is not None and not _docker_forced():
        return _start_shared(_servers, LocalPostgres())
    if docker_works():
        container = start_postgres_container()
        _servers.containers.append(container)
        return ExternalPostgres(container.get_connection_url())
    missing(f"PostgreSQL{' in Docker' if _docker_forced() else ''}")
    raise AssertionError("unreachable")


@pytest.fixture
def make_pg_database(pg_server: PgCluster) -> Iterator[Callable[[], str]]:
    """A factory of fresh, empty databases on the shared server; returns SQLAlchemy URLs."""
    made: list[str] = []

    def make() -> str:
        name = pg_server.create_database()
        made.append(name)
        return pg_server.url(name)

    yield make
    for name in made:
        pg_server.drop_database(name)


@pytest.fixture
def pg_url(make_pg_database: Callable[[], str]) -> str:
    """One fresh database on the shared server (dropped after the test)."""
    return make_pg_database()


@pytest.fixture
def private_pg(_servers: _Servers) -> Iterator[Callable[..., PostgresServer]]:
    """A factory of private clusters a test may ``kill9``, ``pause`` and ``restart``.

    Keyword arguments go to `PostgresServer` (``max_prepared_transactions=0``, ``settings``).
    """
    if os.environ.get(PG_URL_ENV) and find_postgres_bin() is None:
        pytest.skip(f"{PG_URL_ENV} is set and there are no local binaries to start a killable one")
    if find_postgres_bin() is None:
        missing("PostgreSQL binaries (a killable server)")
    if _servers.pg_template is None:
        _servers.pg_template = PostgresServer().initialise().datadir
    mine: list[PostgresServer] = []

    def make(**kwargs: Any) -> PostgresServer:
        server = LocalPostgres(template=_servers.pg_template, **kwargs)
        mine.append(server)
        _servers.track(server)
        return server.start()

    yield make
    for server in mine:
        server.remove()


# -- Redis --------------------------------------------------------------------------------------


@dataclass
class ExternalRedis:
    base_url: str
    killable: bool = False

    def url(self, db: int = 0) -> str:
        parts = urlsplit(self.base_url)
        return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, ""))


class LocalRedis(RedisServer):
    killable = True


@pytest.fixture(scope="session")
def redis_server(_servers: _Servers) -> LocalRedis | ExternalRedis:
    """The session's shared Redis (AOF, fsync always); tests never kill it (see `private_redis`)."""
    url = os.environ.get(REDIS_URL_ENV)
    if url:
        return ExternalRedis(url)
    if find_redis_server() is not None and not _docker_forced():
        return _start_shared(_servers, LocalRedis())
    if docker_works():
        container = start_redis_container()
        _servers.containers.append(container)
        return ExternalRedis(redis_container_url(container))
    missing(f"Redis{' in Docker' if _docker_forced() else ''}")
    raise AssertionError("unreachable")


def start_redis_container() -> Any:
    """A Redis container with the shared server's durability (AOF, fsync always)."""
    from testcontainers.redis import RedisContainer

    container = RedisContainer(_image(REDIS_IMAGE_ENV, "redis:7")).with_command(
        "redis-server --appendonly yes --appendfsync always --maxmemory-policy noeviction"
    )
    return _started(container)


def redis_container_url(container: Any) -> str:
    host, port = container.get_container_host_ip(), container.get_exposed_port(6379)
    return f"redis://{host}:{port}/0"


@pytest.fixture
def redis_url(redis_server: LocalRedis | ExternalRedis) -> str:
    """The shared Redis, flushed before the test (tests run one at a time)."""
    import redis

    url = redis_server.url(0)
    client = redis.Redis.from_url(url)
    try:
        client.flushall()
    finally:
        client.close()
    return url


@pytest.fixture
def private_redis(_servers: _Servers) -> Iterator[Callable[..., RedisServer]]:
    """A factory of private Redis servers a test may ``kill9`` and ``restart`` (AOF survives)."""
    if find_redis_server() is None:
        missing("redis-server binary (a killable server)")
    mine: list[RedisServer] = []

    def make(**kwargs: Any) -> RedisServer:
        server = LocalRedis(**kwargs)
        mine.append(server)
        _servers.track(server)
        return server.start()

    yield make
    for server in mine:
        server.remove()
