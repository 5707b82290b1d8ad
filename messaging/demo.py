"""``twopc demo``: move money between two PostgreSQL databases atomically, crash, recover, audit.

A child process (``python -m messaging.demo child``) moves money from ``bank_a`` to ``bank_b``,
one transaction per transfer, with a `TransactionManager`, a file decision log and two
`PostgresResource` branches. It is killed with SIGKILL at a named crash point after the commit
decision; by default ``tm.after_commit.1:7``, so transfer 7 is committed in bank_a and only
prepared in bank_b. The parent shows that state as PostgreSQL and the log hold it, runs recovery
in a new manager as a restarted service would, and audits both databases.

The server, first match wins: ``TWOPC_DEMO_POSTGRES_URL`` (a role that may create databases; two
fresh ones are created and dropped again), a throwaway cluster from local binaries, a Docker
container through testcontainers. SQLAlchemy, psycopg2 and the server helpers are imported only
when the demo runs (hence the ``noqa: PLC0415``), so ``twopc`` loads without the postgres extra.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator import (
    FORMAT_ID,
    FileDecisionLog,
    RecoveryReport,
    TransactionManager,
    TransactionRolledBack,
)
from coordinator.cli import summarize, table
from coordinator.decision_log import inspect_log

if TYPE_CHECKING:
    from sqlalchemy.engine import URL, Engine
    from sqlalchemy.orm import Session

URL_ENV = "TWOPC_DEMO_POSTGRES_URL"
NODE_ID = "demo-1"
ACCOUNTS = {"bank_a": ("alice", "bob", "carol"), "bank_b": ("dave", "erin", "frank")}
OPENING = 1_000
NEEDS = (
    "no PostgreSQL server found. Install PostgreSQL (Debian/Ubuntu: "
    "apt-get install postgresql; macOS: brew install postgresql) so that initdb and postgres are "
    "on PATH or in /usr/lib/postgresql/<version>/bin, or start Docker (the demo then runs "
    f"postgres:16 through testcontainers), or set {URL_ENV} to a server whose role may create "
    "databases and whose max_prepared_transactions is above 0."
)


def register(sub: Any) -> None:
    """Entry point of the ``twopc.commands`` group."""
    p = sub.add_parser(
        "demo", help="transfers between two PostgreSQL databases, a crash, recovery, an audit"
    )
    p.add_argument(
        "--transfers", type=int, default=10, metavar="N", help="transfers to attempt (default 10)"
    )
    p.add_argument(
        "--crash-at",
        default="tm.after_commit.1:7",
        metavar="NAME[:NTH]",
        help="crash point that kills the service (default tm.after_commit.1:7)",
    )
    p.add_argument("--keep", action="store_true", help="keep the databases and the log; print them")
    p.set_defaults(func=run)


# -- the service that crashes (child process) --------------------------------------------------


def _say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def _move(db: Session, gtrid: str, account: str, delta: int) -> None:
    from sqlalchemy import text  # noqa: PLC0415

    db.execute(
        text("UPDATE accounts SET balance = balance + :delta WHERE id = :account"),
        {"delta": delta, "account": account},
    )
    db.execute(
        text("INSERT INTO transfers (gtrid, account, delta) VALUES (:gtrid, :account, :delta)"),
        {"gtrid": gtrid, "account": account, "delta": delta},
    )


def run_child(spec: dict[str, Any]) -> int:
    """One transfer per transaction; an event line before each commit and after its answer."""
    from sqlalchemy import create_engine  # noqa: PLC0415

    from resource_managers.postgres import PostgresResource  # noqa: PLC0415

    a, b = (PostgresResource(create_engine(spec["urls"][n]), name=n) for n in ACCOUNTS)
    rng = random.Random(7)
    with TransactionManager(NODE_ID, FileDecisionLog(spec["log"]), [a, b]) as tm:
        for n in range(1, spec["transfers"] + 1):
            amount = rng.randint(1, 50)
            src, dst = rng.choice(ACCOUNTS["bank_a"]), rng.choice(ACCOUNTS["bank_b"])
            try:
                with tm.transaction() as tx:
                    _say(n=n, amount=amount, src=src, dst=dst, gtrid=tx.gtrid)
                    _move(tx.join(a), tx.gtrid, src, -amount)
                    _move(tx.join(b), tx.gtrid, dst, amount)
            except TransactionRolledBack as exc:
                _say(n=n, answer=f"rolled back ({exc.reason})")
                continue
            _say(n=n, answer="committed")
    return 0


# -- where the databases live ------------------------------------------------------------------


@dataclass
class _Cluster:
    """A PostgreSQL server for the demo and what to do with it afterwards."""

    admin: URL  # a database to connect to for CREATE / DROP DATABASE
    origin: str  # for the banner; never shows a password
    ours: bool  # started by the demo, so plain database names and removed at the end
    release: Callable[[], None] = lambda: None
    kept: str = ""  # how to remove what --keep leaves running ("": drop the databases)

    def url(self, database: str) -> URL:
        return self.admin.set(drivername="postgresql+psycopg2", database=database)

    def dsn(self, database: str | None = None) -> str:
        url = self.admin.set(drivername="postgresql", database=database or self.admin.database)
        return url.render_as_string(hide_password=False)


class _Unusable(Exception):
    """No server the demo can use; the message says what to install or change."""


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
            f"a throwaway cluster on 127.0.0.1:{server.port} ({server.bindir})",
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


def _create_bank(cluster: _Cluster, bank: str, database: str) -> None:
    from psycopg2 import sql  # noqa: PLC0415

    create = sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(database))
    _admin(cluster, None, create)
    rows = sql.SQL(", ").join(
        sql.SQL("({}, {})").format(sql.Literal(name), sql.Literal(OPENING))
        for name in ACCOUNTS[bank]
    )
    _admin(
        cluster,
        database,
        "CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL CHECK (balance >= 0))",
        "CREATE TABLE transfers (gtrid text PRIMARY KEY, account text NOT NULL REFERENCES "
        "accounts, delta bigint NOT NULL)",
        sql.SQL("INSERT INTO accounts (id, balance) VALUES {}").format(rows),
    )


# -- the demo (parent process) -----------------------------------------------------------------


@dataclass
class _Run:
    cluster: _Cluster
    workdir: Path
    databases: dict[str, str]  # bank -> database name
    engines: dict[str, Engine] = field(default_factory=dict)

    @property
    def log(self) -> Path:
        return self.workdir / "txlog"

    def query(self, bank: str, sql: str, *params: Any) -> list[Any]:
        with self.engines[bank].connect() as conn:
            return list(conn.exec_driver_sql(sql, params or None).fetchall())


def run(args: argparse.Namespace) -> int:
    try:
        import psycopg2  # noqa: PLC0415, F401
        import sqlalchemy  # noqa: PLC0415, F401
    except ImportError:
        print("twopc demo needs the postgres extra: pip install 'twopc[postgres]'", file=sys.stderr)
        return 2
    try:
        cluster = _find_cluster()
        with _setup(cluster, args.keep) as state:
            return _demo(state, args)
    except _Unusable as exc:
        print(f"twopc demo: {exc}", file=sys.stderr)
        return 2


@contextlib.contextmanager
def _setup(cluster: _Cluster, keep: bool) -> Iterator[_Run]:
    from sqlalchemy import create_engine  # noqa: PLC0415

    from resource_managers.throwaway import drop_database  # noqa: PLC0415

    suffix = "" if cluster.ours else f"_{uuid.uuid4().hex[:6]}"
    state = _Run(cluster, Path(tempfile.mkdtemp(prefix="twopc-demo-")), {})
    try:
        max_prepared = int(_admin(cluster, None, "SHOW max_prepared_transactions")[0][0])
        if max_prepared <= 0:
            raise _Unusable(
                f"{cluster.origin} has max_prepared_transactions = 0, so it cannot prepare a "
                "transaction; set it (at least max_connections) and restart PostgreSQL"
            )
        for bank in ACCOUNTS:
            state.databases[bank] = f"{bank}{suffix}"
            _create_bank(cluster, bank, state.databases[bank])
            state.engines[bank] = create_engine(cluster.url(state.databases[bank]))
        yield state
    finally:
        for engine in state.engines.values():
            engine.dispose()
        if keep:
            _print_kept(state)
        else:
            for name in state.databases.values():
                with contextlib.suppress(Exception):
                    drop_database(cluster.dsn(), cluster.dsn(name), name)
            cluster.release()
            shutil.rmtree(state.workdir, ignore_errors=True)


def _print_kept(state: _Run) -> None:
    print("\nkept (--keep):")
    for bank, name in state.databases.items():
        print(f"  {bank}: {state.cluster.url(name).render_as_string()}")
    print(f"  decision log: {state.log}")
    drop = "; ".join(f'DROP DATABASE "{name}"' for name in state.databases.values())
    print(f"  remove with: {state.cluster.kept or drop}; rm -rf {state.workdir}")


def _demo(state: _Run, args: argparse.Namespace) -> int:
    version = state.query("bank_a", "SHOW server_version")[0][0].split()[0]
    print(f"twopc demo: PostgreSQL {version}, {state.cluster.origin}")
    if not state.cluster.ours:
        print(f"   databases {state.databases['bank_a']} and {state.databases['bank_b']}")
    print(f"\n1. a service moves money from bank_a to bank_b until SIGKILL at {args.crash_at}:")
    before = _total(state)
    acked = _run_crashing_child(state, args)
    print("\n2. left in doubt, as pg_prepared_xacts and `twopc status` show it:")
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
    return _audit(state, before, acked)


def _run_crashing_child(state: _Run, args: argparse.Namespace) -> list[str]:
    """Run the service; print what it did; return the gtrids it acknowledged."""
    spec = {
        "urls": {
            b: state.cluster.url(d).render_as_string(False) for b, d in state.databases.items()
        },
        "log": str(state.log),
        "transfers": args.transfers,
    }
    # the URLs (which may hold a password) go through stdin, never argv or the environment
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
        print(f"   transfer {n}: {t['amount']:>2} from {t['src']:<5} to {t['dst']:<5}  {answer}")
    if not killed:
        print(f"   the service exited with {proc.returncode} before reaching the crash point")
    if proc.returncode not in (0, -signal.SIGKILL):
        print(proc.stderr, file=sys.stderr)
    return [t["gtrid"] for t in transfers.values() if t.get("answer") == "committed"]


def _in_doubt(state: _Run) -> list[tuple[str, str, str]]:
    """What a crash left: pending decisions, and each bank's side of them, from the sources."""
    rows: list[tuple[str, str, str]] = []
    pending, _, _ = summarize(inspect_log(state.log))
    finished = set(pending)
    for bank in state.databases:
        for gtrid in pending:
            if state.query(bank, "SELECT 1 FROM transfers WHERE gtrid = %s", gtrid):
                rows.append((bank, "committed", f"transfer {gtrid}"))
            else:
                finished.discard(gtrid)
        prepared = state.query(
            bank,
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
            "ORDER BY prepared",
        )
        rows.extend((bank, "prepared, locks held", f"gid {gid}") for (gid,) in prepared)
    for gtrid, record in pending.items():
        # END is written lazily, with the next forced write: a crash can lose it harmlessly
        state_ = "COMMIT, END lost (lazy)" if gtrid in finished else "COMMIT, no END"
        rows.append(("decision log", state_, f"{gtrid} [{', '.join(record['branches'])}]"))
    return rows


def _recover(state: _Run) -> RecoveryReport:
    from resource_managers.postgres import PostgresResource  # noqa: PLC0415

    banks = [PostgresResource(e, name=b) for b, e in state.engines.items()]
    with TransactionManager(
        NODE_ID, FileDecisionLog(state.log), banks, recover_on_start=False, recovery_interval=None
    ) as tm:
        return tm.recover(force=True)


def _total(state: _Run) -> int:
    return sum(int(state.query(b, "SELECT sum(balance) FROM accounts")[0][0]) for b in ACCOUNTS)


def _audit(state: _Run, before: int, acked: list[str]) -> int:
    applied = {b: {r[0] for r in state.query(b, "SELECT gtrid FROM transfers")} for b in ACCOUNTS}
    drift = [  # accounts whose balance is not the opening balance plus their transfer rows
        account
        for b in ACCOUNTS
        for account, balance, delta in state.query(
            b,
            "SELECT a.id, a.balance, COALESCE(sum(t.delta), 0) FROM accounts a "
            "LEFT JOIN transfers t ON t.account = a.id GROUP BY a.id, a.balance",
        )
        if balance != OPENING + delta
    ]
    prepared = sum(
        state.query(
            b, "SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()"
        )[0][0]
        for b in ACCOUNTS
    )
    pending, _, _ = summarize(inspect_log(state.log))
    after = _total(state)
    a, b = applied["bank_a"], applied["bank_b"]
    checks = [
        (
            "conservation: same total, balances match transfers",
            after == before and not drift,
            f"{before} -> {after}" + (f"; wrong: {', '.join(drift)}" if drift else ""),
        ),
        ("atomicity: no transfer on one side only", a == b, f"{len(a & b)} in both"),
        (
            "durable_ack: every acknowledged transfer in both",
            all(g in a and g in b for g in acked),
            f"{len(acked)} acknowledged",
        ),
        (
            "no_in_doubt_residue: nothing prepared or pending",
            not prepared and not pending,
            f"{prepared} prepared, {len(pending)} pending",
        ),
    ]
    print("\n4. audit:")
    rows = [(name, "yes" if ok else "NO", detail) for name, ok, detail in checks]
    print(_indent(table(["invariant", "holds", "detail"], rows)))
    ok = all(ok for _, ok, _ in checks)
    print("PASS: both databases agree and nothing is left in doubt" if ok else "FAIL")
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
