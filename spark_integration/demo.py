"""``twopc demo --spark``: a Structured Streaming job writes CSV rows into PostgreSQL and Redis
through the ``twopc`` data source; its driver is killed right after a decision; the restarted
query replays the batch as a no-op; an audit.

The demo starts a throwaway PostgreSQL cluster (a data database ``shop`` and the decision-log
database ``txlog``; ``max_prepared_transactions`` 64) and a throwaway ``redis-server`` (``appendonly
yes``, ``appendfsync always``) from local binaries (`resource_managers.throwaway`), and writes
three CSV files of 100 known ids each. A child process (``python -m spark_integration.demo
child``: its own SparkSession on ``local[2,2]``, 127.0.0.1 only, workers on this interpreter)
runs the query, one file per micro-batch (``maxFilesPerTrigger=1``, ``availableNow``), with
``TWOPC_CRASH_AT=spark.driver_after_commit:2``: the crash point fires in the Python worker that
runs batch 1's ``commit``, right after its COMMIT is durable. The parent watches the child's
stderr for the crash point's line and SIGKILLs the child's whole process group (driver JVM and
Python workers) at once, as a driver crash would: batch 1 is decided, its branches are prepared,
and Spark has not recorded it in the checkpoint's ``commits/``. The parent shows that, starts the
job again on the same checkpoint (Spark re-runs batch 1 with the same id: its tasks find the
decision and write nothing, its ``commit`` finishes the recorded one), and audits the stores.

pyspark, SQLAlchemy, psycopg2 and redis-py are imported only when the demo runs (hence the
``noqa: PLC0415``). `messaging.demo` dispatches ``--spark`` here by name at run time, since
messaging sits below this package and never imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator import ConfigurationError, Xid
from coordinator.cli import table

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from resource_managers.throwaway import PostgresServer, RedisServer

APP_ID = "demo"
NODE = "spark"  # log.node's default: the gtrids are spark:demo:<batch id>
TABLE = "items"
BATCHES, PER_BATCH = 3, 100
CRASH_POINT = "spark.driver_after_commit"
# the point counts hits per process and Spark reuses the idle commit worker for the next
# micro-batch, so the second hit is batch 1's commit
CRASH_AT = f"{CRASH_POINT}:2"
REPLAYED = 1
LEASE_SECONDS = 3  # a killed commit worker holds the node's lease this long
CHILD_TIMEOUT = 90.0
MASTER = "local[2,2]"


# -- the driver that crashes (child process) ---------------------------------------------------


def _say(line: str) -> None:
    print(line, flush=True)


def run_child(spec: dict[str, Any]) -> int:
    """One streaming query over the CSV directory, until it has drained it (``availableNow``)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession  # noqa: PLC0415

    from spark_integration.demo_source import ReportingDataSource  # noqa: PLC0415

    spark = (
        SparkSession.builder.master(MASTER)
        .appName("twopc-demo")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.streaming.stopTimeout", "5s")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    # format("twopc"), each commit telling on stderr what it did (spark_integration.demo_source)
    spark.dataSource.register(ReportingDataSource)
    _say("STARTED")
    query = (
        spark.readStream.schema("id INT, name STRING")
        .option("maxFilesPerTrigger", 1)
        .csv(spec["source"])
        .writeStream.trigger(availableNow=True)
        .format("twopc")
        .options(**spec["options"])
        .option("checkpointLocation", spec["checkpoint"])
        .start()
    )
    try:
        query.awaitTermination()
    except Exception as exc:
        _say(f"FAILED {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return 3
    finally:
        spark.stop()
    _say("DONE")
    return 0


# -- the demo (parent process) -----------------------------------------------------------------


class _Unusable(Exception):
    """Something the demo needs is missing; the message says what."""


@dataclass
class _Child:
    """A driver process and the files holding its stdout and stderr."""

    proc: subprocess.Popen[bytes]
    out: Path
    err: Path

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def events(self) -> list[dict[str, Any]]:
        """What each micro-batch's commit told (`spark_integration.demo_source`), in order."""
        from spark_integration.demo_source import TAG  # noqa: PLC0415

        return [
            json.loads(line.partition(TAG)[2])
            for line in self.stderr().splitlines()
            if line.startswith(TAG)
        ]


@dataclass
class _Run:
    workdir: Path
    pg: PostgresServer | None = None
    redis_server: RedisServer | None = None
    data: Engine | None = None
    log: Engine | None = None
    client: Any = None  # redis.Redis, bytes in and out
    children: list[_Child] = field(default_factory=list)

    @property
    def source(self) -> Path:
        return self.workdir / "in"

    @property
    def checkpoint(self) -> Path:
        return self.workdir / "checkpoint"

    def options(self) -> dict[str, str]:
        assert self.pg is not None and self.redis_server is not None
        return {
            "appId": APP_ID,
            "log.url": self.pg.url("txlog"),
            "log.acquire_timeout": "60",
            "log.lease_seconds": str(LEASE_SECONDS),
            "pg.url": self.pg.url("shop"),
            "pg.table": TABLE,
            "pg.columns": "id,name",
            "redis.url": self.redis_server.url(),
            "redis.op": "set",
            "redis.key": "item:{id}",
            "redis.value": "{name}",
        }


def run(args: argparse.Namespace) -> int:
    """``twopc demo --spark``; 0 only if the audit holds."""
    try:
        _check_requirements()
        with _setup(bool(getattr(args, "keep", False))) as state:
            return _demo(state)
    except _Unusable as exc:  # one line with its code, as every command's failure
        raise ConfigurationError(f"twopc demo --spark: {exc}") from exc


def _check_requirements() -> None:
    import importlib.util  # noqa: PLC0415

    from resource_managers.throwaway import find_postgres_bin, find_redis_server  # noqa: PLC0415

    extras = ("pyspark", "pyarrow", "sqlalchemy", "psycopg2", "redis")
    if any(importlib.util.find_spec(name) is None for name in extras):
        raise _Unusable("needs the extras: pip install 'twopc[postgres,redis,spark]'")
    if not (os.environ.get("JAVA_HOME") or shutil.which("java")):
        raise _Unusable("Spark needs a Java runtime (17 or 21): java on PATH or JAVA_HOME")
    if find_postgres_bin() is None:
        raise _Unusable(
            "no PostgreSQL binaries (initdb, postgres) on PATH or in "
            "/usr/lib/postgresql/<version>/bin (Debian/Ubuntu: apt-get install postgresql)"
        )
    if find_redis_server() is None:
        raise _Unusable("no redis-server on PATH (Debian/Ubuntu: apt-get install redis-server)")


@contextlib.contextmanager
def _setup(keep: bool) -> Iterator[_Run]:
    import redis  # noqa: PLC0415
    import sqlalchemy as sa  # noqa: PLC0415

    from resource_managers.throwaway import PostgresServer, RedisServer  # noqa: PLC0415

    state = _Run(Path(tempfile.mkdtemp(prefix="twopc-spark-demo-")))
    try:
        # each in its own temporary directory (PostgreSQL's owned by the postgres user as root)
        state.redis_server = RedisServer().start()
        state.pg = PostgresServer(max_prepared_transactions=64).start()
        for name in ("shop", "txlog"):
            state.pg.create_database(name)
        state.data = sa.create_engine(state.pg.url("shop"))
        state.log = sa.create_engine(state.pg.url("txlog"))
        with state.data.begin() as conn:
            # no unique key: a row written twice would show as two rows
            conn.exec_driver_sql(f"CREATE TABLE {TABLE} (id int NOT NULL, name text NOT NULL)")
        state.client = redis.Redis.from_url(state.redis_server.url())
        yield state
    finally:
        for child in state.children:
            _kill_group(child)
        for engine in (state.data, state.log):
            if engine is not None:
                engine.dispose()
        if state.client is not None:
            state.client.close()
        if keep:
            _print_kept(state)
        else:
            for server in (state.pg, state.redis_server):
                if server is not None:
                    server.remove()
            shutil.rmtree(state.workdir, ignore_errors=True)


def _print_kept(state: _Run) -> None:
    print("\nkept (--keep):")
    kill = []
    if state.pg is not None:
        print(f"  PostgreSQL: {state.pg.url('shop')} (data), {state.pg.url('txlog')} (log)")
        kill.append(f"kill -INT {state.pg.pid}; rm -rf {state.pg.directory}")
    if state.redis_server is not None:
        print(f"  Redis: {state.redis_server.url()}")
        kill.append(f"kill {state.redis_server.pid}; rm -rf {state.redis_server.directory}")
    print(f"  CSV input: {state.source}; checkpoint: {state.checkpoint}")
    print(f"  remove with: {'; '.join(kill)}; rm -rf {state.workdir}")


def _demo(state: _Run) -> int:
    started = time.monotonic()
    assert state.pg is not None and state.redis_server is not None
    pg_version = _scalar(state, "shop", "SHOW server_version").split()[0]
    redis_version = state.client.info("server")["redis_version"]
    print(
        f"twopc demo --spark: PostgreSQL {pg_version} on 127.0.0.1:{state.pg.port} "
        f"(databases shop, txlog), Redis {redis_version} on 127.0.0.1:{state.redis_server.port}"
    )
    _write_csv(state.source)
    print(
        f"\n1. {BATCHES} CSV files of {PER_BATCH} ids each (0..{BATCHES * PER_BATCH - 1}); a "
        f"streaming query on {MASTER} reads one per micro-batch\n   and writes each row to "
        f'PostgreSQL (table {TABLE}) and Redis (item:<id>) through format("twopc"),\n   '
        f"with TWOPC_CRASH_AT={CRASH_AT}:"
    )
    crashed = _start_child(state, "crashed", CRASH_AT)
    line = _wait_for_crash(crashed)
    _kill_group(crashed)
    _print_events(crashed)
    print(f"   {line}")
    print(
        f"   -> SIGKILL to the driver's process group (JVM and Python workers) "
        f"{time.monotonic() - started:.1f} s in"
    )
    print("\n2. what the dead driver left:")
    decision = _show_leftovers(state)
    print(
        f"\n3. the same query restarted on the same checkpoint (lease wait <= {LEASE_SECONDS} s):"
    )
    restarted = _start_child(state, "restarted", None)
    if not _finish(restarted):
        return 1
    _print_events(restarted)
    print(f"   the query drained the source; Spark's commits/ now: {_commits(state)}")
    ok = _audit(state, decision, restarted.events())
    print(f"   ({time.monotonic() - started:.1f} s in all)")
    return 0 if ok else 1


def _write_csv(directory: Path) -> None:
    directory.mkdir()
    for b in range(BATCHES):
        ids = range(b * PER_BATCH, (b + 1) * PER_BATCH)
        (directory / f"part-{b}.csv").write_text("".join(f"{i},n{i}\n" for i in ids))


def _start_child(state: _Run, label: str, crash_at: str | None) -> _Child:
    """A driver in its own process group (killed as one), output in files the parent polls."""
    env = {k: v for k, v in os.environ.items() if k != "TWOPC_CRASH_AT"}
    env.update(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    env.update(SPARK_LOCAL_IP="127.0.0.1", PYTHONUNBUFFERED="1")
    if crash_at:
        env["TWOPC_CRASH_AT"] = crash_at
    spec = {
        "options": state.options(),
        "source": str(state.source),
        "checkpoint": str(state.checkpoint),
    }
    out, err = state.workdir / f"{label}.out", state.workdir / f"{label}.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spark_integration.demo", "child"],
            stdin=subprocess.PIPE,
            stdout=stdout,
            stderr=stderr,
            env=env,
            start_new_session=True,
        )
    child = _Child(proc, out, err)
    state.children.append(child)
    assert proc.stdin is not None
    # the options (URLs) go through stdin, never argv
    proc.stdin.write(json.dumps(spec).encode())
    proc.stdin.close()
    return child


def _kill_group(child: _Child) -> None:
    proc = child.proc
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def _wait_for_crash(child: _Child) -> str:
    """Poll every 20 ms: the group must go before the JVM does much after the crash point."""
    marker = f"twopc: crash point {CRASH_POINT} reached"
    deadline = time.monotonic() + CHILD_TIMEOUT
    while True:
        for line in child.stderr().splitlines():
            if marker in line:
                return line
        if child.proc.poll() is not None or time.monotonic() > deadline:
            ended = child.proc.poll() is not None
            why = f"ended ({child.proc.returncode})" if ended else "timed out"
            tail = child.stderr()[-3000:]
            raise _Unusable(f"the driver {why} before the crash point:\n{tail}")
        time.sleep(0.02)


def _print_events(child: _Child) -> None:
    for event in child.events():
        if "tasks" in event:
            did = []
            if event["tasks"]:
                did.append(f"{event['tasks']} task(s) wrote {event['rows']} rows, prepared")
            if event["skipped"]:
                did.append(f"{event['skipped']} task(s) found it committed and wrote nothing")
            print(f"   batch {event['batch']}: {'; '.join(did) or 'no tasks'}; commit...")
        else:
            how = "a replay, finished the recorded decision" if event["replay"] else "decided"
            print(
                f"   batch {event['batch']}: {how}: {event['committed']} branch(es) committed, "
                f"{event['rolled_back']} rolled back"
            )


def _finish(child: _Child) -> bool:
    try:
        code = child.proc.wait(CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        print(f"   FAIL: the restarted driver still runs after {CHILD_TIMEOUT:.0f} s")
        return False
    out = child.stdout()
    if code != 0 or "DONE" not in out:
        print(f"   FAIL: the restarted driver exited with {code}: {out.strip()}")
        print(child.stderr()[-3000:], file=sys.stderr)
        return False
    return True


# -- reading the stores ------------------------------------------------------------------------


def _engine(state: _Run, database: str) -> Engine:
    engine = state.data if database == "shop" else state.log
    assert engine is not None
    return engine


def _query(state: _Run, database: str, sql: str) -> list[Any]:
    with _engine(state, database).connect() as conn:
        return list(conn.exec_driver_sql(sql).fetchall())


def _scalar(state: _Run, database: str, sql: str) -> Any:
    return _query(state, database, sql)[0][0]


def _pending(state: _Run) -> list[tuple[str, tuple[str, ...]]]:
    """The node's pending decisions, read as ``twopc status`` does: no lease, no writes."""
    from resource_managers.postgres import SqlDecisionLog  # noqa: PLC0415

    log = SqlDecisionLog(_engine(state, "txlog"), NODE, read_only=True)
    try:
        return [(d.gtrid, d.branches) for d in log.pending()]
    finally:
        log.close()


def _prepared(state: _Run) -> list[tuple[str, Xid]]:
    """Every prepared branch: both databases, then Redis's prepared set."""
    from resource_managers.redis import RedisResource  # noqa: PLC0415

    found: list[tuple[str, Xid]] = []
    for database in ("shop", "txlog"):
        sql = "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() ORDER BY gid"
        found += [
            (f"postgres {database}", Xid.from_gid(g)) for (g,) in _query(state, database, sql)
        ]
    prepared_set = RedisResource(state.client, name="redis").prefix + b"prepared"
    for gid in state.client.zrange(prepared_set, 0, -1):
        found.append(("redis", Xid.from_gid(gid.decode())))
    return found


def _ledger(state: _Run) -> dict[str, list[tuple[str, ...]]]:
    """The committed ledger rows (one per committed micro-batch), by gtrid."""
    rows: dict[str, list[tuple[str, ...]]] = {}
    exists = _scalar(state, "txlog", "SELECT to_regclass('twopc_spark_ledger') IS NOT NULL")
    if exists:
        for gtrid, branches in _query(
            state, "txlog", "SELECT gtrid, branches FROM twopc_spark_ledger"
        ):
            rows.setdefault(gtrid, []).append(tuple(json.loads(branches)))
    return rows


def _rows(state: _Run) -> list[tuple[int, str]]:
    sql = f"SELECT id, name FROM {TABLE} ORDER BY id, name"
    return [(int(i), str(n)) for i, n in _query(state, "shop", sql)]


def _redis_items(state: _Run) -> dict[str, str]:
    keys = list(state.client.scan_iter(match=b"item:*", count=1000))
    values = state.client.mget(keys) if keys else []
    return {k.decode(): v.decode() for k, v in zip(keys, values, strict=True)}


def _dir(state: _Run, name: str) -> list[int]:
    folder = state.checkpoint / name
    return sorted(int(p) for p in os.listdir(folder) if p.isdigit()) if folder.exists() else []


def _commits(state: _Run) -> list[int]:
    return _dir(state, "commits")


def _short(bqual: str) -> str:
    """A sub-branch's owner, partition and attempt, without its task id, nonce and birth time."""
    return ".".join(bqual.split(".")[:2]) if "~p" in bqual else bqual.split(".", 1)[0]


def _show_leftovers(state: _Run) -> tuple[str, tuple[str, ...]] | None:
    pending = _pending(state)
    rows = [
        ("decision log", "COMMIT, phase two not run", f"{g} [{', '.join(map(_short, b))}]")
        for g, b in pending
    ]
    rows += [(where, "prepared", f"{x.gtrid} {_short(x.bqual)}") for where, x in _prepared(state)]
    rows += [
        (f"postgres shop.{TABLE}", "committed", f"{len(_rows(state))} rows"),
        ("redis item:*", "committed", f"{len(_redis_items(state))} keys"),
        ("spark offsets/", "planned", f"batches {_dir(state, 'offsets')}"),
        ("spark commits/", "recorded done", f"batches {_commits(state)}"),
    ]
    print(_indent(table(["where", "state", "what"], rows)))
    print(
        f"   batch {REPLAYED} is decided but Spark never recorded it: the restarted query runs "
        "it again with the same id"
    )
    return pending[0] if len(pending) == 1 else None


def _audit(
    state: _Run, decision: tuple[str, tuple[str, ...]] | None, events: list[dict[str, Any]]
) -> bool:
    n = BATCHES * PER_BATCH
    rows, items = _rows(state), _redis_items(state)
    ledger = _ledger(state)
    gtrid = f"{NODE}:{APP_ID}:{REPLAYED}"
    decided = set(decision[1]) if decision is not None and decision[0] == gtrid else None
    recorded = ledger.get(gtrid, [])
    # the restarted run's first commit is batch REPLAYED's: its tasks must all have skipped,
    # and the batch's one ledger row must name what the dead driver decided, nothing new
    told = [e for e in events if e["batch"] == REPLAYED]
    wrote = sum(e["tasks"] for e in told if "tasks" in e)
    rows_written = sum(e["rows"] for e in told if "tasks" in e)
    replay_noop = (
        decided is not None
        and len(recorded) == 1
        and set(recorded[0]) == decided
        and bool(told)
        and wrote == 0
        and rows_written == 0
        and any(e.get("replay") for e in told)
    )
    replayed_ids = sum(1 for i, _ in rows if REPLAYED * PER_BATCH <= i < (REPLAYED + 1) * PER_BATCH)
    prepared, pending = _prepared(state), _pending(state)
    checks = [
        (
            "every id once in PostgreSQL",
            rows == [(i, f"n{i}") for i in range(n)],
            f"{len(rows)} rows, {len({i for i, _ in rows})} distinct ids of {n}",
        ),
        (
            "every id once in Redis",
            items == {f"item:{i}": f"n{i}" for i in range(n)},
            f"{len(items)} keys of {n}",
        ),
        (
            f"the replayed batch {REPLAYED} wrote nothing",
            replay_noop and replayed_ids == PER_BATCH,
            f"{wrote} task(s) wrote, {rows_written} rows; {replayed_ids} ids of it; ledger: "
            f"the {len(recorded[0]) if recorded else 0} branches decided before the crash",
        ),
        (
            "one committed ledger row per batch",
            sorted(ledger) == [f"{NODE}:{APP_ID}:{b}" for b in range(BATCHES)]
            and all(len(v) == 1 for v in ledger.values()),
            f"{sum(map(len, ledger.values()))} rows for {len(ledger)} batches",
        ),
        ("nothing prepared", not prepared, f"{len(prepared)} prepared (shop, txlog, Redis)"),
        ("no pending decision", not pending, f"{len(pending)} pending"),
        (
            "Spark recorded every batch",
            _commits(state) == list(range(BATCHES)),
            f"commits/ {_commits(state)}",
        ),
    ]
    print("\n4. audit:")
    print(
        _indent(
            table(
                ["invariant", "holds", "detail"],
                [(c, "yes" if ok else "NO", d) for c, ok, d in checks],
            )
        )
    )
    ok = all(ok for _, ok, _ in checks)
    print(
        "PASS: every id exactly once in PostgreSQL and Redis; the replayed batch was a no-op; "
        "nothing left in doubt"
        if ok
        else "FAIL"
    )
    return ok


def _indent(text: str) -> str:
    return "\n".join(f"   {line}" for line in text.splitlines())


def _main(argv: list[str]) -> int:
    if argv != ["child"]:
        print("usage: python -m spark_integration.demo child  (the demo's driver; reads stdin)")
        return 2
    return run_child(json.load(sys.stdin))


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
