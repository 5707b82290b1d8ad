"""Where the demo's stores live (a throwaway server, a container, or the URL given), and the
state of one run over them."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from coordinator import (
    Xid,
)
from coordinator.xid import FORMAT_ID

from .bank import ACCOUNTS, NEEDS, NODE_ID, OPENING, PG, REDIS, REDIS_NEEDS, REDIS_URL_ENV, URL_ENV

if TYPE_CHECKING:
    from sqlalchemy.engine import URL, Engine

    from messaging.connection import Listener
    from messaging.transfer import LogTransfer, TransferReceiver
    from resource_managers.cursor import Cursor
    from resource_managers.message_log import MessageLog
    from resource_managers.redis import RedisResource

# -- where the stores live ---------------------------------------------------------------------


class Unusable(Exception):
    """No server the demo can use; the message says what to install or change."""


@dataclass
class Cluster:
    """A PostgreSQL server for the demo and what to do with it afterwards."""

    admin: URL  # a database to connect to for CREATE / DROP DATABASE
    origin: str  # for the banner; never shows a password
    ours: bool  # started by the demo, so plain database names and removed at the end
    release: Callable[[], None] = lambda: None
    kept: str = ""  # how to remove what --keep leaves running ("": drop the database)

    def url(self, database: str) -> URL:
        return self.admin.set(drivername="postgresql+psycopg2", database=database)

    def dsn(self, database: str | None = None) -> str:
        url = self.admin.set(drivername="postgresql", database=database or self.admin.database)
        return url.render_as_string(hide_password=False)


@dataclass
class RedisStore:
    """A Redis server for the demo: where, how to name our keys, what to do afterwards."""

    url: str  # may carry a password: goes to the child through stdin only, never printed
    origin: str
    ours: bool  # a throwaway server: plain key names, removed at the end
    namespace: str  # RedisResource's namespace: twopc's own keys
    keys: str  # prefix of the demo's data keys
    release: Callable[[], None] = lambda: None
    kept: str = ""


def find_redis() -> RedisStore:
    from resource_managers.throwaway import (  # noqa: PLC0415
        RedisServer,
        ServerError,
        find_redis_server,
    )

    given = os.environ.get(REDIS_URL_ENV)
    if given:
        where = urlsplit(given)  # host and port only: the URL may carry a password
        place = where.path if where.scheme == "unix" else f"{where.hostname}:{where.port or 6379}"
        tag = uuid.uuid4().hex[:6]
        return RedisStore(
            given, f"{REDIS_URL_ENV} ({place})", False, f"twopc-{tag}", f"bank-{tag}:"
        )
    if find_redis_server() is None:
        raise Unusable(REDIS_NEEDS)
    server = RedisServer()
    try:
        server.start()
    except ServerError as exc:
        server.remove()
        raise Unusable(f"could not start a throwaway redis-server: {exc}") from exc
    return RedisStore(
        server.url(),
        f"a throwaway redis-server on 127.0.0.1:{server.port} (appendonly yes, appendfsync always)",
        ours=True,
        namespace="twopc",
        keys="bank:",
        release=server.remove,
        kept=f"kill {server.pid}; rm -rf {server.directory}",
    )


def find_cluster() -> Cluster:
    from sqlalchemy.engine import make_url  # noqa: PLC0415

    from resource_managers.throwaway import (  # noqa: PLC0415
        PostgresServer,
        ServerError,
        find_postgres_bin,
    )

    given = os.environ.get(URL_ENV)
    if given:
        admin = make_url(given).set(drivername="postgresql+psycopg2")
        admin = admin.set(database=admin.database or "postgres")
        return Cluster(admin, f"{URL_ENV} ({admin.render_as_string()})", ours=False)
    if find_postgres_bin() is not None:
        server = PostgresServer()
        try:
            server.start()
        except ServerError as exc:
            server.remove()
            raise Unusable(f"could not start a throwaway PostgreSQL cluster: {exc}") from exc
        return Cluster(
            make_url(server.url("postgres")),
            f"a throwaway cluster on 127.0.0.1:{server.port}",
            ours=True,
            release=server.remove,
            kept=f"kill -INT {server.pid}; rm -rf {server.directory}",
        )
    container = _container_cluster()
    if container is None:
        raise Unusable(NEEDS)
    return container


def _container_cluster() -> Cluster | None:
    """PostgreSQL in Docker, if testcontainers (the test extra) is installed and Docker answers."""
    from sqlalchemy.engine import make_url  # noqa: PLC0415

    try:
        from testcontainers.postgres import PostgresContainer  # noqa: PLC0415

        # the constructor asks the Docker engine for its version: no Docker, no container
        container = PostgresContainer("postgres:16", driver="psycopg2")
    except Exception:
        return None
    container.with_command("postgres -c max_prepared_transactions=64 -c fsync=on")
    container.start()
    return Cluster(
        make_url(container.get_connection_url()),
        "a postgres:16 container (testcontainers)",
        ours=True,
        release=container.stop,
        kept="nothing (testcontainers' reaper removes the container once the demo exits)",
    )


def _admin(cluster: Cluster, database: str | None, *statements: Any) -> list[tuple[Any, ...]]:
    import psycopg2  # noqa: PLC0415

    conn = psycopg2.connect(cluster.dsn(database), connect_timeout=10)
    try:
        conn.autocommit = True
        rows: list[tuple[Any, ...]] = []
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
                rows = cur.fetchall() if cur.description is not None else rows
        return rows
    finally:
        conn.close()


def create_bank(cluster: Cluster, database: str) -> None:
    from psycopg2 import sql  # noqa: PLC0415

    max_prepared = int(_admin(cluster, None, "SHOW max_prepared_transactions")[0][0])
    if max_prepared <= 0:
        raise Unusable(
            f"{cluster.origin} has max_prepared_transactions = 0, so it cannot prepare a "
            "transaction; set it (at least max_connections) and restart PostgreSQL"
        )
    create = sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(database))
    _admin(cluster, None, create)
    rows = sql.SQL(", ").join(
        sql.SQL("({}, {})").format(sql.Literal(name), sql.Literal(OPENING)) for name in ACCOUNTS[PG]
    )
    _admin(
        cluster,
        database,
        "CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL CHECK (balance >= 0))",
        "CREATE TABLE transfers (gtrid text PRIMARY KEY, account text NOT NULL REFERENCES "
        "accounts, delta bigint NOT NULL)",
        # what the consumer writes for each message; no unique key, so a duplicate would show
        "CREATE TABLE notifications (id bigserial PRIMARY KEY, gtrid text NOT NULL, "
        "message_id text NOT NULL)",
        sql.SQL("INSERT INTO accounts (id, balance) VALUES {}").format(rows),
    )


def check_redis(state: Run) -> None:
    """Let `RedisResource` judge the server as the service will: it checks at a branch's start."""
    from coordinator import ConfigurationError, TransientError  # noqa: PLC0415

    cache, probe = state.cache(), Xid(FORMAT_ID, f"{NODE_ID}:durability-check", REDIS)
    try:
        cache.start(probe)
    except (ConfigurationError, TransientError) as exc:
        raise Unusable(f"{state.store.origin}: {exc.message}") from exc
    cache.rollback(probe)  # nothing of it reached Redis


# -- the demo (parent process) -----------------------------------------------------------------


@dataclass
class Run:
    cluster: Cluster
    store: RedisStore
    workdir: Path
    database: str = ""
    engine: Engine | None = None
    client: Any = None  # redis.Redis, bytes in and out
    secret: bytes = b""  # the cursor's shared secret: to the child through stdin only
    cursor: Cursor | None = None
    receiver: TransferReceiver | None = None
    listener: Listener | None = None
    mlog: MessageLog | None = None  # the dead service's log, reopened by the parent
    transfer: LogTransfer | None = None  # the restarted transfer from that log

    @property
    def log(self) -> Path:
        return self.workdir / "txlog"

    @property
    def mlog_dir(self) -> Path:
        return self.workdir / "mlog"

    @property
    def cursor_dir(self) -> Path:
        return self.workdir / "cursor"

    @property
    def consumer_log(self) -> Path:
        return self.workdir / "consumer-txlog"

    def query(self, sql: str, *params: Any) -> list[Any]:
        assert self.engine is not None
        with self.engine.connect() as conn:
            return list(conn.exec_driver_sql(sql, params or None).fetchall())

    def cache(self) -> RedisResource:
        from resource_managers.redis import RedisResource  # noqa: PLC0415

        return RedisResource(self.client, name=REDIS, namespace=self.store.namespace)

    @property
    def twopc_keys(self) -> bytes:
        """Where RedisResource keeps its own keys (prepared set, locks, staged sets, markers)."""
        return self.cache().prefix

    def redis_count(self, pattern: bytes) -> int:
        return sum(1 for _ in self.client.scan_iter(match=pattern, count=1000))
