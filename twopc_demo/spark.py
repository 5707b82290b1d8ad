"""``twopc demo --spark``: a Structured Streaming job writes CSV rows into PostgreSQL and Redis
through the ``twopc`` data source; its driver is killed right after a decision; the restarted
query replays the batch as a no-op; an audit.

The demo starts a throwaway PostgreSQL cluster (a data database ``shop`` and the decision-log
database ``txlog``; ``max_prepared_transactions`` 64) and a throwaway ``redis-server`` (``appendonly
yes``, ``appendfsync always``) from local binaries (`resource_managers.throwaway`), and writes
three CSV files of 100 known ids each. A child process (``python -m twopc_demo.spark_job``: its
own SparkSession on ``local[2,2]``, 127.0.0.1 only, workers on this interpreter) runs the query,
one file per micro-batch (``maxFilesPerTrigger=1``, ``availableNow``), with
``TWOPC_CRASH_AT=spark.driver_after_commit:2``: the crash point fires in the Python worker that
runs batch 1's ``commit``, right after its COMMIT is durable. The parent watches the child's
stderr for the crash point's line and SIGKILLs the child's whole process group (driver JVM and
Python workers) at once, as a driver crash would: batch 1 is decided, its branches are prepared,
and Spark has not recorded it in the checkpoint's ``commits/``. The parent shows that, starts the
job again on the same checkpoint (Spark re-runs batch 1 with the same id: its tasks find the
decision and write nothing, its ``commit`` finishes the recorded one), and audits the stores.

pyspark, SQLAlchemy, psycopg2 and redis-py are imported only when the demo runs (hence the
``noqa: PLC0415``). `twopc_demo.cli` imports this module only for ``--spark``, so the
bank demo never needs pyspark.
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
from pathlib import Path
from typing import Any

from coordinator import ConfigurationError
from coordinator.cli import table

from .audit import indent
from .spark_job import (
    APP_ID,
    BATCHES,
    CHILD_TIMEOUT,
    CRASH_AT,
    CRASH_POINT,
    LEASE_SECONDS,
    MASTER,
    NODE,
    PER_BATCH,
    REPLAYED,
    TABLE,
)
from .spark_stores import (
    Child,
    Run,
    Unusable,
    commits,
    item_rows,
    ledger_rows,
    pending_decisions,
    prepared_branches,
    redis_items,
    scalar,
    show_leftovers,
)


def run(args: argparse.Namespace) -> int:
    """``twopc demo --spark``; 0 only if the audit holds."""
    try:
        _check_requirements()
        with _setup(bool(getattr(args, "keep", False))) as state:
            return _demo(state)
    except Unusable as exc:  # one line with its code, as every command's failure
        raise ConfigurationError(f"twopc demo --spark: {exc}") from exc


def _check_requirements() -> None:
    import importlib.util  # noqa: PLC0415

    from resource_managers.throwaway import find_postgres_bin, find_redis_server  # noqa: PLC0415

    extras = ("pyspark", "pyarrow", "sqlalchemy", "psycopg2", "redis")
    if any(importlib.util.find_spec(name) is None for name in extras):
        raise Unusable("needs the extras: pip install 'twopc[postgres,redis,spark]'")
    if not (os.environ.get("JAVA_HOME") or shutil.which("java")):
        raise Unusable("Spark needs a Java runtime (17 or 21): java on PATH or JAVA_HOME")
    if find_postgres_bin() is None:
        raise Unusable(
            "no PostgreSQL binaries (initdb, postgres) on PATH or in "
            "/usr/lib/postgresql/<version>/bin (Debian/Ubuntu: apt-get install postgresql)"
        )
    if find_redis_server() is None:
        raise Unusable("no redis-server on PATH (Debian/Ubuntu: apt-get install redis-server)")


@contextlib.contextmanager
def _setup(keep: bool) -> Iterator[Run]:
    import redis  # noqa: PLC0415
    import sqlalchemy as sa  # noqa: PLC0415

    from resource_managers.throwaway import PostgresServer, RedisServer  # noqa: PLC0415

    state = Run(Path(tempfile.mkdtemp(prefix="twopc-spark-demo-")))
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


def _print_kept(state: Run) -> None:
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


def _demo(state: Run) -> int:
    started = time.monotonic()
    assert state.pg is not None and state.redis_server is not None
    pg_version = scalar(state, "shop", "SHOW server_version").split()[0]
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
    decision = show_leftovers(state)
    print(
        f"\n3. the same query restarted on the same checkpoint (lease wait <= {LEASE_SECONDS} s):"
    )
    restarted = _start_child(state, "restarted", None)
    if not _finish(restarted):
        return 1
    _print_events(restarted)
    print(f"   the query drained the source; Spark's commits/ now: {commits(state)}")
    ok = _audit(state, decision, restarted.events())
    print(f"   ({time.monotonic() - started:.1f} s in all)")
    return 0 if ok else 1


def _write_csv(directory: Path) -> None:
    directory.mkdir()
    for b in range(BATCHES):
        ids = range(b * PER_BATCH, (b + 1) * PER_BATCH)
        (directory / f"part-{b}.csv").write_text("".join(f"{i},n{i}\n" for i in ids))


def _start_child(state: Run, label: str, crash_at: str | None) -> Child:
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
            [sys.executable, "-m", "twopc_demo.spark_job"],
            stdin=subprocess.PIPE,
            stdout=stdout,
            stderr=stderr,
            env=env,
            start_new_session=True,
        )
    child = Child(proc, out, err)
    state.children.append(child)
    assert proc.stdin is not None
    # the options (URLs) go through stdin, never argv
    proc.stdin.write(json.dumps(spec).encode())
    proc.stdin.close()
    return child


def _kill_group(child: Child) -> None:
    proc = child.proc
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def _wait_for_crash(child: Child) -> str:
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
            raise Unusable(f"the driver {why} before the crash point:\n{tail}")
        time.sleep(0.02)


def _print_events(child: Child) -> None:
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


def _finish(child: Child) -> bool:
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


def _audit(
    state: Run, decision: tuple[str, tuple[str, ...]] | None, events: list[dict[str, Any]]
) -> bool:
    n = BATCHES * PER_BATCH
    rows, items = item_rows(state), redis_items(state)
    ledger = ledger_rows(state)
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
    prepared, pending = prepared_branches(state), pending_decisions(state)
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
            commits(state) == list(range(BATCHES)),
            f"commits/ {commits(state)}",
        ),
    ]
    print("\n4. audit:")
    print(
        indent(
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
