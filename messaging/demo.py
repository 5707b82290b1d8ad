"""``twopc demo``: move money between PostgreSQL and Redis atomically, with a message for every
transfer; crash, recover, deliver the messages exactly once, audit.

Accounts alice, bob and carol live in a PostgreSQL table; dave, erin and frank are Redis strings.
A child process (``python -m messaging.demo child``) makes one transaction per transfer with a
`TransactionManager`, a file decision log, a `MessageLogResource` named ``mlog`` on an embedded
`MessageLog`, a `PostgresResource` named ``postgres`` and a `RedisResource` named ``redis``: odd
transfers move money from PostgreSQL to Redis, even ones back. Each side also records the transfer
(a ``transfers`` row; an entry in the Redis stream ``bank:ledger``), and the transaction sends a
message about it to the destination ``transfers``. While the child runs, a `LogTransfer` moves
committed messages to an embedded `Cursor` that the parent serves on 127.0.0.1 (a `Listener` with
a fresh shared secret, handed to the child on stdin).

Branches prepare and commit in name order, ``mlog``, ``postgres``, ``redis``, and crash points
count them from 1, so the default crash point ``tm.after_commit.2:7`` kills the child with
transfer 7 committed in the message log and PostgreSQL and only prepared in Redis (the message
log's commit record is written lazily, so the kill usually leaves that branch prepared on disk
too; the decision, kept until it is written, makes recovery commit it again): its credit
staged under the gid, its keys locked. The parent shows that state as Redis, PostgreSQL, the
message log and the decision log hold it, runs recovery in a new manager as a restarted service
would, restarts the transfer from the reopened log, consumes every message in a transaction with
a PostgreSQL insert (a ``notifications`` row, without a unique key, so a duplicate would show),
and audits the stores and the messages.

PostgreSQL, first match wins: ``TWOPC_DEMO_POSTGRES_URL`` (a role that may create databases; a
fresh one is created and dropped again), a throwaway cluster from local binaries, a Docker
container through testcontainers. Redis: ``TWOPC_DEMO_REDIS_URL`` (keys under a random prefix,
deleted again; the server must keep a prepare across a crash), else a throwaway ``redis-server``
from local binaries with ``appendonly yes`` and ``appendfsync always``. SQLAlchemy, psycopg2,
redis-py and the server helpers are imported only when the demo runs (hence the ``noqa:
PLC0415``), so ``twopc`` loads without the extras; the message log, the cursor and the messaging
modules are imported there too, so other ``twopc`` commands do not pay for them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from coordinator import (
    FORMAT_ID,
    ConfigurationError,
    FileDecisionLog,
    RecoveryReport,
    Transaction,
    TransactionManager,
    TransactionRolledBack,
    Xid,
)
from coordinator.cli import summarize, table
from coordinator.decision_log import inspect_log

if TYPE_CHECKING:
    from sqlalchemy.engine import URL, Engine
    from sqlalchemy.orm import Session

    from messaging.connection import Connection, Listener
    from messaging.transfer import LogTransfer, TransferReceiver
    from resource_managers.cursor import Cursor, Delivery
    from resource_managers.message_log import MessageLog, ProducerBranch
    from resource_managers.redis import RedisBranch, RedisResource

URL_ENV = "TWOPC_DEMO_POSTGRES_URL"
REDIS_URL_ENV = "TWOPC_DEMO_REDIS_URL"
NODE_ID = "demo-1"
CONSUMER_ID = "demo-consumer"
# Do not rename: phases run in ascending name order, "mlog" < "postgres" < "redis", and crash
# points count branches from 1, so tm.after_commit.2 (the second branch to commit) leaves the
# message log and PostgreSQL committed (the log's record lazily: maybe prepared on disk) and Redis
# prepared.
MLOG, PG, REDIS = "mlog", "postgres", "redis"
CURSOR = "cursor"
DESTINATION = "transfers"  # where every transfer's message goes
CRASH_AT = "tm.after_commit.2:7"
LOG_ID, CURSOR_ID = "demo-log", "demo-cursor"  # the transfer connection's two ends
ACCOUNTS = {PG: ("alice", "bob", "carol"), REDIS: ("dave", "erin", "frank")}
OPENING = 1_000
NEEDS = (
    "no PostgreSQL server found. Install PostgreSQL (Debian/Ubuntu: "
    "apt-get install postgresql; macOS: brew install postgresql) so that initdb and postgres are "
    "on PATH or in /usr/lib/postgresql/<version>/bin, or start Docker (the demo then runs "
    f"postgres:16 through testcontainers), or set {URL_ENV} to a server whose role may create "
    "databases and whose max_prepared_transactions is above 0."
)
REDIS_NEEDS = (
    "no redis-server found. Install Redis (Debian/Ubuntu: apt-get install redis-server; macOS: "
    f"brew install redis) so that redis-server is on PATH, or set {REDIS_URL_ENV} to a server "
    "with appendonly yes, appendfsync always and maxmemory-policy noeviction."
)


def register(sub: Any) -> None:
    """Entry point of the ``twopc.commands`` group."""
    p = sub.add_parser(
        "demo",
        help="transfers between PostgreSQL and Redis with a message each, a crash, recovery, "
        "exactly-once delivery, an audit",
    )
    p.add_argument(
        "--transfers", type=int, default=10, metavar="N", help="transfers to attempt (default 10)"
    )
    p.add_argument(
        "--crash-at",
        default=CRASH_AT,
        metavar="NAME[:NTH]",
        help=f"crash point that kills the service (default {CRASH_AT})",
    )
    p.add_argument("--keep", action="store_true", help="keep the servers and the log; print them")
    p.add_argument(
        "--spark",
        action="store_true",
        help="instead: a Spark streaming job into PostgreSQL and Redis, its driver killed after a "
        "decision, restarted on its checkpoint, audited (needs the spark extra and Java)",
    )
    p.set_defaults(func=run)


# -- the service that crashes (child process) --------------------------------------------------


def _say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def _pg_move(db: Session, gtrid: str, account: str, delta: int) -> None:
    from sqlalchemy import text  # noqa: PLC0415

    db.execute(
        text("UPDATE accounts SET balance = balance + :delta WHERE id = :account"),
        {"delta": delta, "account": account},
    )
    db.execute(
        text("INSERT INTO transfers (gtrid, account, delta) VALUES (:gtrid, :account, :delta)"),
        {"gtrid": gtrid, "account": account, "delta": delta},
    )


def _redis_move(r: RedisBranch, keys: str, gtrid: str, account: str, delta: int) -> None:
    # buffered until commit; the ledger entry's id is assigned when the commit script runs
    r.incrby(f"{keys}balance:{account}", delta)
    r.xadd(f"{keys}ledger", {"gtrid": gtrid, "account": account, "delta": delta})


def _send_notice(outbox: ProducerBranch, event: dict[str, Any]) -> None:
    # staged until prepare; numbered at commit, and only then visible to the log's transfer
    body = json.dumps({k: event[k] for k in ("gtrid", "n", "amount", "src", "dst")}).encode()
    outbox.send(DESTINATION, body, headers={"content-type": "application/json"})


def _dialer(address: tuple[str, int], secret: bytes) -> Callable[[], Connection]:
    """How a log's transfer reaches the demo's cursor (called again after every failure)."""
    from messaging.auth import SharedSecret  # noqa: PLC0415
    from messaging.connection import connect  # noqa: PLC0415
    from messaging.transfer import TRANSFER_ROLE  # noqa: PLC0415

    key = SharedSecret(secret)
    return lambda: connect(address, key, LOG_ID, TRANSFER_ROLE, server_id=CURSOR_ID, timeout=5.0)


def _transfer(mlog: MessageLog, dial: Callable[[], Connection]) -> LogTransfer:
    from messaging.transfer import LogTransfer  # noqa: PLC0415
    from resource_managers.sequencing import DoublingBackoff  # noqa: PLC0415

    # resend soon: a frame lost with a connection matters only until the next one, but a demo
    # should not sit out the default back-off
    return LogTransfer(mlog, dial, resend=DoublingBackoff(base=0.2, cap=2.0), name="demo-transfer")


def run_child(spec: dict[str, Any]) -> int:
    """One transfer per transaction; an event line before each commit and after its answer."""
    import redis  # noqa: PLC0415
    from sqlalchemy import create_engine  # noqa: PLC0415

    from resource_managers.message_log import MessageLog, MessageLogResource  # noqa: PLC0415
    from resource_managers.postgres import PostgresResource  # noqa: PLC0415
    from resource_managers.redis import RedisResource  # noqa: PLC0415

    pg = PostgresResource(create_engine(spec["pg_url"]), name=PG)
    client = redis.Redis.from_url(spec["redis_url"])
    cache = RedisResource(client, name=REDIS, namespace=spec["namespace"])
    host, port = spec["cursor"]
    dial = _dialer((host, int(port)), bytes.fromhex(spec["secret"]))
    rng = random.Random(7)
    with MessageLog(spec["mlog"]) as mlog, _transfer(mlog, dial) as transfer:
        # the transfer runs while we work: committed messages reach the cursor at once
        outbox = MessageLogResource(mlog, MLOG)
        resources: list[Any] = [outbox, pg, cache]
        with TransactionManager(NODE_ID, FileDecisionLog(spec["log"]), resources) as tm:
            for n in range(1, spec["transfers"] + 1):
                amount = rng.randint(1, 50)
                pg_account, redis_account = rng.choice(ACCOUNTS[PG]), rng.choice(ACCOUNTS[REDIS])
                sign = -1 if n % 2 else 1  # odd: PostgreSQL -> Redis; even: Redis -> PostgreSQL
                src, dst = (pg_account, redis_account) if n % 2 else (redis_account, pg_account)
                try:
                    with tm.transaction() as tx:
                        event = {"n": n, "amount": amount, "src": src, "dst": dst}
                        _say(**event, gtrid=tx.gtrid)
                        _pg_move(tx.join(pg), tx.gtrid, pg_account, sign * amount)
                        _redis_move(
                            tx.join(cache), spec["keys"], tx.gtrid, redis_account, -sign * amount
                        )
                        _send_notice(tx.join(outbox), {**event, "gtrid": tx.gtrid})
                except TransactionRolledBack as exc:
                    _say(n=n, answer=f"rolled back ({exc.reason})")
                    continue
                _say(n=n, answer="committed")
        transfer.wait_idle(10)  # not killed: hand everything over before closing the log
    return 0


# -- where the stores live ---------------------------------------------------------------------


class _Unusable(Exception):
    """No server the demo can use; the message says what to install or change."""


@dataclass
class _Cluster:
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
class _Redis:
    """A Redis server for the demo: where, how to name our keys, what to do afterwards."""

    url: str  # may carry a password: goes to the child through stdin only, never printed
    origin: str
    ours: bool  # a throwaway server: plain key names, removed at the end
    namespace: str  # RedisResource's namespace: twopc's own keys
    keys: str  # prefix of the demo's data keys
    release: Callable[[], None] = lambda: None
    kept: str = ""


def _find_redis() -> _Redis:
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
        return _Redis(given, f"{REDIS_URL_ENV} ({place})", False, f"twopc-{tag}", f"bank-{tag}:")
    if find_redis_server() is None:
        raise _Unusable(REDIS_NEEDS)
    server = RedisServer()
    try:
        server.start()
    except ServerError as exc:
        server.remove()
        raise _Unusable(f"could not start a throwaway redis-server: {exc}") from exc
    return _Redis(
        server.url(),
        f"a throwaway redis-server on 127.0.0.1:{server.port} (appendonly yes, appendfsync always)",
        ours=True,
        namespace="twopc",
        keys="bank:",
        release=server.remove,
        kept=f"kill {server.pid}; rm -rf {server.directory}",
    )


def _find_cluster() -> _Cluster:
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
        return _Cluster(admin, f"{URL_ENV} ({admin.render_as_string()})", ours=False)
    if find_postgres_bin() is not None:
        server = PostgresServer()
        try:
            server.start()
        except ServerError as exc:
            server.remove()
            raise _Unusable(f"could not start a throwaway PostgreSQL cluster: {exc}") from exc
        return _Cluster(
            make_url(server.url("postgres")),
            f"a throwaway cluster on 127.0.0.1:{server.port}",
            ours=True,
            release=server.remove,
            kept=f"kill -INT {server.pid}; rm -rf {server.directory}",
        )
    container = _container_cluster()
    if container is None:
        raise _Unusable(NEEDS)
    return container


def _container_cluster() -> _Cluster | None:
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
    return _Cluster(
        make_url(container.get_connection_url()),
        "a postgres:16 container (testcontainers)",
        ours=True,
        release=container.stop,
        kept="nothing (testcontainers' reaper removes the container once the demo exits)",
    )


def _admin(cluster: _Cluster, database: str | None, *statements: Any) -> list[tuple[Any, ...]]:
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


def _create_bank(cluster: _Cluster, database: str) -> None:
    from psycopg2 import sql  # noqa: PLC0415

    max_prepared = int(_admin(cluster, None, "SHOW max_prepared_transactions")[0][0])
    if max_prepared <= 0:
        raise _Unusable(
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


def _check_redis(state: _Run) -> None:
    """Let `RedisResource` judge the server as the service will: it checks at a branch's start."""
    from coordinator import ConfigurationError, TransientError, Xid  # noqa: PLC0415

    cache, probe = state.cache(), Xid(FORMAT_ID, f"{NODE_ID}:durability-check", REDIS)
    try:
        cache.start(probe)
    except (ConfigurationError, TransientError) as exc:
        raise _Unusable(f"{state.store.origin}: {exc.message}") from exc
    cache.rollback(probe)  # nothing of it reached Redis


# -- the demo (parent process) -----------------------------------------------------------------


@dataclass
class _Run:
    cluster: _Cluster
    store: _Redis
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


def run(args: argparse.Namespace) -> int:
    if args.spark:
        # the layer above, found by name at run time: messaging never imports spark_integration
        return int(importlib.import_module("spark_integration.demo").run(args))
    try:
        import psycopg2  # noqa: PLC0415, F401
        import redis  # noqa: PLC0415, F401
        import sqlalchemy  # noqa: PLC0415, F401
    except ImportError:
        raise ConfigurationError(
            "twopc demo needs the extras: pip install 'twopc[postgres,redis]'"
        ) from None
    try:
        store = _find_redis()
        try:
            cluster = _find_cluster()
        except BaseException:
            store.release()
            raise
        with _setup(cluster, store, args.keep) as state:
            return _demo(state, args)
    except _Unusable as exc:  # one line with its code, as every command's failure
        raise ConfigurationError(f"twopc demo: {exc}") from exc


@contextlib.contextmanager
def _setup(cluster: _Cluster, store: _Redis, keep: bool) -> Iterator[_Run]:
    import redis  # noqa: PLC0415
    from sqlalchemy import create_engine  # noqa: PLC0415

    state = _Run(cluster, store, Path(tempfile.mkdtemp(prefix="twopc-demo-")))
    try:
        state.client = redis.Redis.from_url(store.url)
        _check_redis(state)
        state.client.mset({f"{store.keys}balance:{a}": OPENING for a in ACCOUNTS[REDIS]})
        database = "bank" if cluster.ours else f"bank_{uuid.uuid4().hex[:6]}"
        _create_bank(cluster, database)
        state.database = database
        state.engine = create_engine(cluster.url(database))
        _start_cursor(state)
        yield state
    finally:
        try:
            _close_messaging(state)
        finally:
            if state.engine is not None:
                state.engine.dispose()
            if keep:
                _print_kept(state)
            else:
                _remove(state)


def _start_cursor(state: _Run) -> None:
    """The embedded cursor, served on a free local port to transfers that know a fresh secret."""
    import secrets  # noqa: PLC0415

    from messaging.auth import SharedSecret  # noqa: PLC0415
    from messaging.connection import Listener  # noqa: PLC0415
    from messaging.transfer import TRANSFER_ROLE, TransferReceiver  # noqa: PLC0415
    from resource_managers.cursor import Cursor  # noqa: PLC0415

    state.secret = secrets.token_bytes(32)
    state.cursor = Cursor(state.cursor_dir)
    state.receiver = TransferReceiver(state.cursor)
    handlers = {TRANSFER_ROLE: state.receiver}
    key = SharedSecret(state.secret)
    state.listener = Listener(("127.0.0.1", 0), key, CURSOR_ID, handlers).start()


def _close_messaging(state: _Run) -> None:
    """Transfer, listener, cursor, log: each closed even if an earlier one fails."""
    with contextlib.ExitStack() as stack:
        # an ExitStack runs its callbacks last pushed first
        for part in (state.mlog, state.cursor, state.listener, state.transfer):
            if part is not None:
                stack.callback(part.close)


def _remove(state: _Run) -> None:
    from resource_managers.throwaway import drop_database  # noqa: PLC0415

    cluster, store = state.cluster, state.store
    if state.database:
        with contextlib.suppress(Exception):
            drop_database(cluster.dsn(), cluster.dsn(state.database), state.database)
    if not store.ours and state.client is not None:
        with contextlib.suppress(Exception):
            for pattern in (f"{store.keys}*", f"{store.namespace}:*"):
                for key in list(state.client.scan_iter(match=pattern, count=1000)):
                    state.client.delete(key)
    if state.client is not None:
        state.client.close()
    cluster.release()
    store.release()
    shutil.rmtree(state.workdir, ignore_errors=True)


def _print_kept(state: _Run) -> None:
    cluster, store = state.cluster, state.store
    print("\nkept (--keep):")
    print(f"  PostgreSQL: {cluster.url(state.database).render_as_string()}")
    where = store.url if store.ours else store.origin  # only a throwaway URL is password-free
    print(f"  Redis: {where}, keys {store.keys}* and {store.namespace}:*")
    print(f"  decision log: {state.log}")
    print(f"  message log: {state.mlog_dir}")
    print(f"  cursor: {state.cursor_dir}")
    print(f"  consumer's decision log: {state.consumer_log}")
    drop = cluster.kept or f'DROP DATABASE "{state.database}"'
    unkey = store.kept or f"delete the keys {store.keys}* and {store.namespace}:*"
    print(f"  remove with: {drop}; {unkey}; rm -rf {state.workdir}")


def _demo(state: _Run, args: argparse.Namespace) -> int:
    pg_version = state.query("SHOW server_version")[0][0].split()[0]
    redis_version = state.client.info("server")["redis_version"]
    print(f"twopc demo: PostgreSQL {pg_version}, {state.cluster.origin}")
    print(f"   and Redis {redis_version}, {state.store.origin}")
    if not state.cluster.ours or not state.store.ours:
        print(f"   database {state.database}; Redis keys {state.store.keys}*")
    print(
        f"\n1. a service moves money between PostgreSQL ({', '.join(ACCOUNTS[PG])}) and Redis "
        f"({', '.join(ACCOUNTS[REDIS])}),\n   sending a message about each transfer to "
        f'"{DESTINATION}" (its log\'s transfer feeds a cursor\n   on {_where(state)}), branches '
        f"in name order (mlog, postgres, redis),\n   until SIGKILL at {args.crash_at}:"
    )
    before = _total(state)
    acked, attempted = _run_crashing_child(state, args)
    assert state.cursor is not None
    early = len(state.cursor.available(DESTINATION))  # what the service's transfer delivered
    state.mlog = _reopen_log(state)
    print(
        "\n2. left in doubt, as pg_prepared_xacts, Redis, the message log and `twopc status` "
        "show it:"
    )
    rows = _in_doubt(state)
    print(_indent(table(["where", "state", "what"], rows)))
    if rows:
        print(
            f'   (a gid is <format id>_<base64 gtrid>_<base64 branch>; ours is {FORMAT_ID}, "tpc0")'
        )
    report = _recover(state)
    print("\n3. a new TransactionManager on the same log runs recovery, as a restart would:")
    print(
        f"   committed again: {len(report.committed)} decision(s); "
        f"presumed abort: {len(report.rolled_back)} branch(es); failures: {len(report.failures)}"
    )
    print(
        "\n4. the log transfers the messages to the cursor; a consumer takes each one in a "
        "transaction\n   with a PostgreSQL insert:"
    )
    _deliver(state, early)
    return _audit(state, before, acked, attempted)


def _where(state: _Run) -> str:
    assert state.listener is not None
    host, port = state.listener.address
    return f"{host}:{port}"


def _reopen_log(state: _Run) -> MessageLog:
    """The dead service's message log, as its restart would open it (the lock died with it)."""
    from resource_managers.message_log import MessageLog  # noqa: PLC0415

    return MessageLog(state.mlog_dir)


def _run_crashing_child(state: _Run, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Run the service; print what it did; return the gtrids it acknowledged and attempted."""
    assert state.listener is not None
    spec = {
        "pg_url": state.cluster.url(state.database).render_as_string(False),
        "redis_url": state.store.url,
        "namespace": state.store.namespace,
        "keys": state.store.keys,
        "log": str(state.log),
        "transfers": args.transfers,
        "mlog": str(state.mlog_dir),
        "cursor": list(state.listener.address),
        "secret": state.secret.hex(),
    }
    # the URLs (which may hold a password) and the cursor's secret go through stdin, never argv
    # or the environment
    proc = subprocess.run(
        [sys.executable, "-m", "messaging.demo", "child"],
        input=json.dumps(spec),
        env=dict(os.environ, TWOPC_CRASH_AT=args.crash_at),
        capture_output=True,
        text=True,
        timeout=120,
    )
    killed = proc.returncode == -signal.SIGKILL
    transfers: dict[int, dict[str, Any]] = {}
    for line in proc.stdout.splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            transfers.setdefault(event["n"], {}).update(event)
    for n, t in transfers.items():
        answer = t.get("answer", "no answer: killed by SIGKILL" if killed else "no answer")
        print(f"   transfer {n:>2}: {t['amount']:>2} from {t['src']:<5} to {t['dst']:<5}  {answer}")
    if not killed:
        print(f"   the service exited with {proc.returncode} before reaching the crash point")
    if proc.returncode not in (0, -signal.SIGKILL):
        print(proc.stderr, file=sys.stderr)
    acked = [t["gtrid"] for t in transfers.values() if t.get("answer") == "committed"]
    return acked, [t["gtrid"] for t in transfers.values()]


def _in_doubt(state: _Run) -> list[tuple[str, str, str]]:
    """What a crash left: pending decisions, and each store's side of them, from the sources."""
    assert state.mlog is not None
    pending, _, _ = summarize(inspect_log(state.log))
    mlog_done = {g for g in pending if state.mlog.is_committed(Xid(FORMAT_ID, g, MLOG).to_gid())}
    pg_done = {g for g in pending if state.query("SELECT 1 FROM transfers WHERE gtrid = %s", g)}
    redis_done = {g for g in pending if g in _ledger(state)}
    done = {MLOG: mlog_done, PG: pg_done, REDIS: redis_done}
    rows = [(MLOG, "committed", f"transfer {g}, its message numbered") for g in sorted(mlog_done)]
    rows += [(MLOG, "prepared, message held", f"gid {gid}") for gid in state.mlog.prepared_gids()]
    rows += [(PG, "committed", f"transfer {g}") for g in sorted(pg_done)]
    prepared = state.query(
        "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() ORDER BY prepared"
    )
    rows += [(PG, "prepared, locks held", f"gid {gid}") for (gid,) in prepared]
    rows += [(REDIS, "committed", f"transfer {g}") for g in sorted(redis_done)]
    rows += _redis_prepared(state)
    for gtrid, record in pending.items():
        # END is written lazily, with the next forced write: a crash can lose it harmlessly
        finished = all(gtrid in done.get(branch, ()) for branch in record["branches"])
        state_ = "COMMIT, END lost (lazy)" if finished else "COMMIT, no END"
        rows.append(("decision log", state_, f"{gtrid} [{', '.join(record['branches'])}]"))
    return rows


def _redis_prepared(state: _Run) -> list[tuple[str, str, str]]:
    """Each prepared Redis branch: its entry in the prepared set, its locks, its staged set."""
    prefix, client = state.twopc_keys, state.client
    rows: list[tuple[str, str, str]] = []
    for gid in client.zrange(prefix + b"prepared", 0, -1):
        locked = [
            key[len(prefix) + 5 :].decode(errors="replace")
            for key in client.scan_iter(match=prefix + b"lock:*", count=1000)
            if client.get(key) == gid
        ]
        staged = _staged_commands(client.lrange(prefix + b"ws:" + gid, 0, -1))
        rows += [
            (REDIS, "prepared", f"gid {gid.decode()}"),
            (REDIS, "locked by it", ", ".join(sorted(locked))),
            (REDIS, "staged, not applied", "; ".join(staged)),
        ]
    return rows


def _staged_commands(ws: list[bytes]) -> list[str]:
    """A staged write set, read: [magic, n, n keys, then (command, key, nargs, args) ...]."""
    if len(ws) < 2:
        return ["(none)"]
    i, out = 2 + int(ws[1]), []
    while i + 2 < len(ws):
        command, key, nargs = ws[i].decode(), ws[i + 1].decode(errors="replace"), int(ws[i + 2])
        shown = f" {ws[i + 3].decode()}" if command == "INCRBY" else ""
        out.append(f"{command} {key}{shown}")
        i += 3 + nargs
    return out


def _recover(state: _Run) -> RecoveryReport:
    from resource_managers.message_log import MessageLogResource  # noqa: PLC0415
    from resource_managers.postgres import PostgresResource  # noqa: PLC0415

    assert state.engine is not None and state.mlog is not None
    resources: list[Any] = [
        MessageLogResource(state.mlog, MLOG),
        PostgresResource(state.engine, name=PG),
        state.cache(),
    ]
    with TransactionManager(
        NODE_ID,
        FileDecisionLog(state.log),
        resources,
        recover_on_start=False,
        recovery_interval=None,
    ) as tm:
        return tm.recover(force=True)


def _deliver(state: _Run, early: int) -> None:
    """Restart the log's transfer, wait until the cursor holds everything, consume it all:
    one transaction per message, its deletion from the cursor and a notifications row together."""
    from sqlalchemy import text  # noqa: PLC0415

    from messaging.consumer import consume_once  # noqa: PLC0415
    from resource_managers.cursor import CursorResource  # noqa: PLC0415
    from resource_managers.postgres import PostgresResource  # noqa: PLC0415

    assert state.mlog is not None and state.cursor is not None and state.listener is not None
    assert state.receiver is not None and state.engine is not None
    state.transfer = _transfer(state.mlog, _dialer(state.listener.address, state.secret)).start()
    idle = state.transfer.wait_idle(30)
    held = len(state.cursor.available(DESTINATION))
    dropped = state.receiver.stats["messages"] - held  # copies the cursor's filter refused
    print(
        f"   transferred: {held} message(s) in the cursor, {early} while the service ran and "
        f"{held - early} after the restart;\n   resent copies the cursor's stream filter dropped "
        f"as duplicates: {dropped}"
    )
    if not idle:
        print("   the transfer did not finish within 30 s: the audit shows what is missing")

    pg = PostgresResource(state.engine, name=PG)
    inbox = CursorResource(state.cursor, CURSOR)

    def notify(tx: Transaction, delivery: Delivery) -> None:
        event = json.loads(delivery.body)
        tx.join(pg).execute(
            text("INSERT INTO notifications (gtrid, message_id) VALUES (:gtrid, :message_id)"),
            {"gtrid": event["gtrid"], "message_id": delivery.message_id},
        )

    consumed = 0
    log = FileDecisionLog(state.consumer_log)
    with TransactionManager(CONSUMER_ID, log, [inbox, pg], recovery_interval=None) as tm:
        while got := consume_once(tm, inbox, DESTINATION, notify, batch=1, timeout=0.2):
            consumed += got
    c = state.cursor.stats()
    print(
        f"   consumed: {consumed} message(s), one transaction (cursor, postgres) and one "
        "notifications row each"
    )
    print(
        f"   the cursor now: available {c.available}, in flight {c.in_flight}, prepared "
        f"{c.prepared}; {c.forced_records} forced records, {c.fsyncs} fsyncs"
    )


def _redis_balances(state: _Run) -> dict[str, int]:
    keys = [f"{state.store.keys}balance:{a}" for a in ACCOUNTS[REDIS]]
    return {a: int(v) for a, v in zip(ACCOUNTS[REDIS], state.client.mget(keys), strict=True)}


def _ledger(state: _Run) -> list[str]:
    """The gtrid of every entry in the Redis ledger stream, duplicates kept."""
    entries = state.client.xrange(f"{state.store.keys}ledger")
    return [fields[b"gtrid"].decode() for _, fields in entries]


def _total(state: _Run) -> int:
    pg = int(state.query("SELECT sum(balance) FROM accounts")[0][0])
    return pg + sum(_redis_balances(state).values())


def _drift(state: _Run) -> list[str]:
    """Accounts whose balance is not the opening balance plus their transfer records."""
    drift = [
        account
        for account, balance, delta in state.query(
            "SELECT a.id, a.balance, COALESCE(sum(t.delta), 0) FROM accounts a "
            "LEFT JOIN transfers t ON t.account = a.id GROUP BY a.id, a.balance"
        )
        if balance != OPENING + delta
    ]
    moved = dict.fromkeys(ACCOUNTS[REDIS], 0)
    for _, fields in state.client.xrange(f"{state.store.keys}ledger"):
        moved[fields[b"account"].decode()] += int(fields[b"delta"])
    balances = _redis_balances(state)
    return drift + [a for a in ACCOUNTS[REDIS] if balances[a] != OPENING + moved[a]]


def _residue(state: _Run) -> tuple[bool, str]:
    """Anything a transaction can leave behind: prepared branches, locks, staged sets, decisions."""
    pg = state.query("SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()")
    prefix = state.twopc_keys
    redis = [
        state.client.zcard(prefix + b"prepared"),
        state.redis_count(prefix + b"lock:*"),
        state.redis_count(prefix + b"ws:*"),
    ]
    pending, _, _ = summarize(inspect_log(state.log))
    left = [pg[0][0], *redis, len(pending)]
    detail = "prepared {} pg, {} redis; locks {}; staged {}; pending {}".format(*left)
    return not any(left), detail


def _in_flight(state: _Run) -> tuple[bool, str]:
    """Messages anywhere but consumed: in the log (unacknowledged or prepared), in the cursor."""
    assert state.mlog is not None and state.cursor is not None
    log, cursor = state.mlog.stats(), state.cursor.stats()
    left = [log.pending, log.prepared, cursor.available, cursor.in_flight, cursor.prepared]
    detail = "log: pending {}, prepared {}; cursor: available {}, in flight {}, prepared {}"
    return not any(left), detail.format(*left)


def _audit(state: _Run, before: int, acked: list[str], attempted: list[str]) -> int:
    in_pg = {r[0] for r in state.query("SELECT gtrid FROM transfers")}
    ledger = _ledger(state)
    in_redis = set(ledger)
    drift, after = _drift(state), _total(state)
    wrong = f"; wrong: {', '.join(drift)}" if drift else ""
    notified = Counter(r[0] for r in state.query("SELECT gtrid FROM notifications"))
    twice = sorted(g for g, count in notified.items() if count > 1)
    missed = sorted(in_pg - notified.keys())
    rolled_back = set(attempted) - in_pg
    strays = sorted(notified.keys() - in_pg)
    checks = [
        (
            "conservation: same total, balances match records",
            after == before and not drift,
            f"{before} -> {after}{wrong}",
        ),
        (
            "atomicity: no transfer in one store only",
            in_pg == in_redis,
            f"{len(in_pg & in_redis)} in both",
        ),
        (
            "exactly_once: no transfer applied twice",
            len(ledger) == len(in_redis),
            f"{len(ledger)} ledger entries",
        ),
        (
            "durable_ack: every acknowledged transfer in both",
            all(g in in_pg and g in in_redis for g in acked),
            f"{len(acked)} acknowledged",
        ),
        ("no_in_doubt_residue: nothing prepared, locked, staged", *_residue(state)),
        (
            "messages exactly once: every committed transfer notified once",
            notified == Counter(in_pg),
            f"{notified.total()} notifications for {len(in_pg)} transfers"
            + "".join(
                f"; {w}: {', '.join(g)}" for w, g in (("twice", twice), ("none", missed)) if g
            ),
        ),
        (
            "no message of a rolled-back transfer",
            not strays,
            f"{len(rolled_back)} rolled back"
            + (f"; notified anyway: {', '.join(strays)}" if strays else ", none notified"),
        ),
        ("nothing in flight: log and cursor empty", *_in_flight(state)),
    ]
    print("\n5. audit:")
    rows = [(name, "yes" if ok else "NO", detail) for name, ok, detail in checks]
    print(_indent(table(["invariant", "holds", "detail"], rows)))
    ok = all(ok for _, ok, _ in checks)
    print(
        "PASS: PostgreSQL and Redis agree, every message was consumed exactly once, and nothing "
        "is left in doubt"
        if ok
        else "FAIL"
    )
    return 0 if ok else 1


def _indent(text: str) -> str:
    return "\n".join(f"   {line}" for line in text.splitlines())


def _main(argv: list[str]) -> int:
    if argv != ["child"]:
        print("usage: python -m messaging.demo child  (the demo's service; reads stdin)")
        return 2
    return run_child(json.load(sys.stdin))


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
