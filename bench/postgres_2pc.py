"""Two-database PostgreSQL transactions per second: twopc against the ways Python does it today.

Each transaction is one INSERT into each of two databases (database A and database B, on one
throwaway cluster with fsync=on that this script starts, unless ``--url-a/--url-b`` are given).
Every row runs at 1 and 8 client threads. Each thread has its own connections. Each row is warmed
up and then measured for ``--seconds``. Rows, and why each one is here:

- ``1pc``: one INSERT and one COMMIT in one database (psycopg2). This is the floor, and the
  reference for twopc's one-phase row.
- ``2x1pc``: an INSERT and a COMMIT in A, then the same in B. This is what code without a
  coordinator does, and it is NOT atomic: a crash between the two commits keeps half.
- ``bare``: psycopg2 ``tpc_begin``/``tpc_prepare``/``tpc_commit`` on both, with no decision log.
  This is the cheapest atomic commit and THE BASELINE: every ratio is against it, at the same
  thread count. It cannot be recovered after a crash, since nothing records the decision.
- ``sa``: SQLAlchemy ``Session(twophase=True)`` with two binds. This is the usual Python answer.
  It has no log and uses random, unrelated xids per database.
- ``zope``: the ``transaction`` package with ``zope.sqlalchemy`` (two two-phase sessions,
  ``register(session)``). This is the other usual answer. It also has no log.
- ``file``/``file-par``: twopc with `FileDecisionLog` (a forced COMMIT record per transaction),
  sequential and parallel prepare/commit.
- ``sql``: twopc with `SqlDecisionLog` in a third database, when that module imports.
- ``sql-carried``: twopc with `SqlDecisionLog` in database B itself: B carries the log's COMMIT
  row in its one-phase commit (no PREPARE on B, no separate log commit); compare with ``sql``.
- ``llr``: twopc with database B as the logging last resource: A prepares, B commits in one phase
  with the decision row in the same server commit, then A commits. No PREPARE on B and no
  decision-log force (the file log is configured, and untouched).
- ``1phase``: twopc with only database A joined, so it takes the one-phase path with no log and no
  PREPARE. It is compared with ``1pc``.
- ``file-core``, ``llr-core``, ``1phase-core``: the same with the lean handle, the branch's Core
  `Connection` (``pg.connection(tx)``) instead of a `Session`.
- ``file-aio``: ``file``'s transaction through the asyncio API (`coordinator.aio`), on psycopg 3
  `AsyncSession`s. Its "threads" are tasks on ONE event loop (many concurrent transactions on a
  single thread); completions run on as many worker threads, so the log's fsync stays off the
  loop.
- ``bare-pg3``, ``llr-pg3``: ``bare`` and ``llr`` on psycopg 3 (``tpc_*`` for the bare row,
  ``postgresql+psycopg`` engines for twopc). Ratios stay against the psycopg2 ``bare``.

The session-based rows (sa, zope, twopc) all use the same INSERT statement as psycopg2 through
``Session.execute(text(...))`` (Core). ``--orm`` switches all of them to ``session.add`` of a
mapped object (ORM, as in the research's peer baseline).

Targets, printed with a verdict (`TARGETS`, at 1 and 8 threads): ``llr-core`` >= 1.2x / 0.9x
``bare``, ``llr`` >= 1.0x / 0.7x ``bare`` and >= 1.5x / 1.2x ``sa``, ``file`` >= 0.8x / 0.6x
``bare``, ``1phase-core`` >= 0.9x ``1pc``; client CPU per transaction at 1 thread: ``file`` <= 600
us, ``file-core`` <= 350 us. The ``CPU us`` column (this process, all threads, per transaction)
says how much of a gap is client CPU: on a small machine the Python work per transaction, not the
server, sets both the latency at 1 thread and, through the GIL, the ceiling at 8.

After each row the script checks that exactly the committed rows landed in each database and that
no prepared transaction is left. It raises if either check fails. The script prints one table and
checks it against the targets.

    python bench/postgres_2pc.py [--seconds 3] [--threads 1,8] [--rounds 1] [--orm] [--profile]
                                 [--rows bare,file,llr] [--json PATH]

``--rows`` measures only the rows named (``bare`` always, as the baseline); ``--json PATH``
writes one object per row and thread count, ``{"row", "threads", "tps", "cpu_us"}`` (medians
over the rounds), as a JSON array.

``--rounds N`` repeats every row N times, alternating the row order, and prints medians and the
tx/s range: one 3 s run per row is at the mercy of a shared or throttled machine.

``--profile`` runs only the twopc file-log row at 1 thread under cProfile (timeout off, so the
whole completion runs on the profiled thread) and prints where the time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import functools
import itertools
import json
import os
import platform
import pstats
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
import psycopg2
import transaction as zope_transaction  # type: ignore[import-untyped]
from sqlalchemy import BigInteger, Column, MetaData, Table, Text, create_engine, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session, registry
from zope.sqlalchemy import mark_changed, register  # type: ignore[import-untyped]

from coordinator import FileDecisionLog, TransactionManager
from coordinator.decision_log import DecisionLog
from resource_managers.postgres import PostgresResource
from resource_managers.throwaway import PostgresServer

TABLE = "bench_rows"
PAYLOAD = "twopc-bench-payload"
SQL_INSERT = f"INSERT INTO {TABLE} (payload) VALUES (%s)"  # psycopg2 rows
CORE_INSERT = text(f"INSERT INTO {TABLE} (payload) VALUES (:payload)")  # session rows
FORMAT_ID = 0x7B  # bare psycopg2 xids: anything but twopc's own format id
SKIPPED = "skipped: SqlDecisionLog not available"


class BenchError(RuntimeError):
    """A row did not leave the databases as it should: rows missing or a prepared xact left."""


class RowA:
    def __init__(self, payload: str) -> None:
        self.payload = payload


class RowB(RowA):
    pass


def _table(metadata: MetaData) -> Table:
    return Table(
        TABLE,
        metadata,
        Column("id", BigInteger, primary_key=True),
        Column("payload", Text, nullable=False),
    )


TABLE_A, TABLE_B = _table(MetaData()), _table(MetaData())
_mapper_registry = registry()
_mapper_registry.map_imperatively(RowA, TABLE_A)
_mapper_registry.map_imperatively(RowB, TABLE_B)


# -- where the databases are -----------------------------------------------------------------------


@dataclass
class Env:
    url_a: str
    url_b: str
    url_log: str | None
    orm: bool
    timeout: float | None
    log_root: Path

    @staticmethod
    def dsn(url: str) -> str:
        """The libpq URI psycopg2 takes for a SQLAlchemy URL (password kept, never printed)."""
        return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)

    def engine(self, url: str, threads: int, driver: str = "psycopg2") -> Engine:
        url = make_url(url).set(drivername=f"postgresql+{driver}").render_as_string(False)
        return create_engine(url, pool_size=threads + 2)


def insert(session: Session, side: str, orm: bool, bind: Engine | None = None) -> None:
    """One row into database ``side`` through a session: ORM add or a Core text() INSERT."""
    if orm:
        session.add(RowA(PAYLOAD) if side == "a" else RowB(PAYLOAD))
    else:
        args = {"bind": bind} if bind is not None else None
        session.execute(CORE_INSERT, {"payload": PAYLOAD}, bind_arguments=args)


# -- the rows --------------------------------------------------------------------------------------

Client = Callable[[], None]  # one transaction, run by the thread that made it


@dataclass
class Setup:
    """A row's shared state: ``client()`` is called once in each worker thread."""

    client: Callable[[], Client]
    close: Callable[[], None]
    cleanup: list[Callable[[], None]] = field(default_factory=list)
    #: a row that drives itself (the asyncio rows: tasks on one loop, not threads)
    drive: Callable[[int, float, float], Measured] | None = None

    def finish(self) -> None:
        try:
            self.close()
        finally:
            for action in self.cleanup:
                with contextlib.suppress(Exception):
                    action()


def close_all(things: Iterable[Any]) -> None:
    """Close psycopg2 connections, dispose engines."""
    for thing in things:
        (thing.close if hasattr(thing, "close") else thing.dispose)()


def plain_setup(env: Env, threads: int, two: bool) -> Setup:
    conns: list[Any] = []

    def client() -> Client:
        a, b = psycopg2.connect(env.dsn(env.url_a)), psycopg2.connect(env.dsn(env.url_b))
        conns.extend((a, b))
        cur_a, cur_b = a.cursor(), b.cursor()

        def one() -> None:
            cur_a.execute(SQL_INSERT, (PAYLOAD,))
            a.commit()
            if two:
                cur_b.execute(SQL_INSERT, (PAYLOAD,))
                b.commit()

        return one

    return Setup(client, lambda: close_all(conns))


def bare_setup(env: Env, threads: int, connect: Callable[[str], Any] = psycopg2.connect) -> Setup:
    conns: list[Any] = []

    def client() -> Client:
        a, b = connect(env.dsn(env.url_a)), connect(env.dsn(env.url_b))
        conns.extend((a, b))
        cur_a, cur_b = a.cursor(), b.cursor()
        prefix, counter = uuid.uuid4().hex[:12], itertools.count()

        def one() -> None:
            gtrid = f"bench-{prefix}-{next(counter)}"
            a.tpc_begin(a.xid(FORMAT_ID, gtrid, "a"))
            b.tpc_begin(b.xid(FORMAT_ID, gtrid, "b"))
            cur_a.execute(SQL_INSERT, (PAYLOAD,))
            cur_b.execute(SQL_INSERT, (PAYLOAD,))
            a.tpc_prepare()
            b.tpc_prepare()
            a.tpc_commit()
            b.tpc_commit()

        return one

    return Setup(client, lambda: close_all(conns))


def sa_setup(env: Env, threads: int) -> Setup:
    ea, eb = env.engine(env.url_a, threads), env.engine(env.url_b, threads)

    def client() -> Client:
        session = Session(binds={RowA: ea, RowB: eb}, twophase=True)

        def one() -> None:
            with session.begin():
                insert(session, "a", env.orm, ea)
                insert(session, "b", env.orm, eb)

        return one

    return Setup(client, lambda: close_all((ea, eb)))


def sa_plain_setup(env: Env, threads: int) -> Setup:
    """Like for like with the one-phase path: the same Session API, one database, one commit."""
    ea = env.engine(env.url_a, threads)

    def client() -> Client:
        def one() -> None:
            with Session(ea) as session, session.begin():
                insert(session, "a", env.orm)

        return one

    return Setup(client, lambda: close_all((ea,)))


def zope_setup(env: Env, threads: int) -> Setup:
    ea, eb = env.engine(env.url_a, threads), env.engine(env.url_b, threads)

    def client() -> Client:
        tm = zope_transaction.TransactionManager(explicit=True)
        sa, sb = Session(ea, twophase=True), Session(eb, twophase=True)
        register(sa, transaction_manager=tm)
        register(sb, transaction_manager=tm)

        def one() -> None:
            tm.begin()
            for session, side in ((sa, "a"), (sb, "b")):
                insert(session, side, env.orm)
                if not env.orm:  # Core writes are invisible to zope.sqlalchemy: say so
                    mark_changed(session, transaction_manager=tm)
            tm.commit()

        return one

    return Setup(client, lambda: close_all((ea, eb)))


def twopc_setup(
    env: Env,
    threads: int,
    log: Callable[[str], DecisionLog],
    *,
    parallel: bool,
    two: bool,
    last: bool = False,
    async_phase_two: bool = False,
    core: bool = False,
    driver: str = "psycopg2",
) -> Setup:
    ea, eb = env.engine(env.url_a, threads, driver), env.engine(env.url_b, threads, driver)
    ra, rb = PostgresResource(ea, "pg-a"), PostgresResource(eb, "pg-b", last_resource=last)
    node = f"bench-{uuid.uuid4().hex[:8]}"
    tm = TransactionManager(
        node,
        log(node),
        [ra, rb],
        parallel=parallel,
        recovery_interval=None,
        reaper_interval=None,
        default_timeout=env.timeout,
        async_phase_two=async_phase_two,
    )

    def client() -> Client:
        def one() -> None:
            with tm.transaction() as tx:
                insert(tx.join(ra), "a", env.orm)
                if two:
                    insert(tx.join(rb), "b", env.orm)

        def one_core() -> None:  # the lean handle: the branch's Core connection, no Session
            with tm.transaction() as tx:
                ra.connection(tx).execute(CORE_INSERT, {"payload": PAYLOAD})
                if two:
                    rb.connection(tx).execute(CORE_INSERT, {"payload": PAYLOAD})

        return one_core if core else one

    def close() -> None:
        tm.close()
        ea.dispose()
        eb.dispose()

    return Setup(client, close)


def file_log(env: Env) -> Callable[[str], DecisionLog]:
    return lambda node: FileDecisionLog(Path(tempfile.mkdtemp(dir=env.log_root)) / "log")


def sql_log_class() -> Any:
    try:
        from resource_managers.postgres.sql_log import SqlDecisionLog
    except ImportError:
        return None
    return SqlDecisionLog


def sql_setup(env: Env, threads: int) -> Setup:
    cls = sql_log_class()
    assert cls is not None and env.url_log is not None
    engine = env.engine(env.url_log, threads)
    setup = twopc_setup(env, threads, lambda node: cls(engine, node), parallel=False, two=True)
    setup.cleanup.append(engine.dispose)
    return setup


def carried_setup(env: Env, threads: int) -> Setup:
    """The SqlDecisionLog in database B: B's one-phase commit carries the log's COMMIT row."""
    cls = sql_log_class()
    assert cls is not None
    engine = env.engine(env.url_b, threads)
    setup = twopc_setup(env, threads, lambda node: cls(engine, node), parallel=False, two=True)
    setup.cleanup.append(engine.dispose)
    return setup


def aio_setup(env: Env, threads: int) -> Setup:
    """``file-core``'s transaction through `coordinator.aio`: ``threads`` tasks on one event
    loop (not threads), each an `AsyncSession` per database on psycopg 3, the completions on
    ``threads`` worker threads."""
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from coordinator.aio import AsyncTransactionManager
    from resource_managers.postgres.aio import AsyncPostgresResource

    def pair(url: str, name: str) -> tuple[Any, AsyncPostgresResource[AsyncSession], Engine]:
        async_url = make_url(url).set(drivername="postgresql+psycopg")
        engine = create_async_engine(async_url, pool_size=threads + 2)
        sync_engine = env.engine(url, 1, "psycopg")
        return engine, AsyncPostgresResource(engine, name, sync_engine=sync_engine), sync_engine

    (ea, ra, sa_), (eb, rb, sb) = pair(env.url_a, "pg-a"), pair(env.url_b, "pg-b")
    node = f"bench-{uuid.uuid4().hex[:8]}"
    tm = TransactionManager(
        node, file_log(env)(node), [ra, rb], recovery_interval=None, reaper_interval=None,
        default_timeout=env.timeout,
    )  # fmt: skip
    atm = AsyncTransactionManager(tm, max_workers=threads)

    async def one() -> None:
        async with atm.atransaction() as tx:
            await (await tx.join(ra)).execute(CORE_INSERT, {"payload": PAYLOAD})
            await (await tx.join(rb)).execute(CORE_INSERT, {"payload": PAYLOAD})

    async def measured(tasks: int, seconds: float, warmup: float) -> Measured:
        try:
            return await drive_tasks(one, tasks, seconds, warmup)
        finally:
            await ea.dispose()
            await eb.dispose()

    def unused() -> Client:
        raise AssertionError("an asyncio row drives itself")

    def close() -> None:
        atm.close()
        sa_.dispose()
        sb.dispose()

    return Setup(unused, close, drive=lambda n, s, w: asyncio.run(measured(n, s, w)))


@dataclass(frozen=True)
class RowSpec:
    key: str
    label: str
    make: Callable[[Env, int], Setup]
    writes: tuple[int, int]  # rows each transaction inserts into A and into B


ROWS = (
    RowSpec("1pc", "psycopg2 1PC, 1 INSERT, 1 db", lambda e, t: plain_setup(e, t, False), (1, 0)),
    RowSpec(
        "2x1pc",
        "psycopg2 2 plain commits (NOT atomic)",
        lambda e, t: plain_setup(e, t, True),
        (1, 1),
    ),
    RowSpec("sa1pc", "SQLAlchemy Session 1PC, 1 db", sa_plain_setup, (1, 0)),
    RowSpec("bare", "psycopg2 2PC, no log = BASELINE", bare_setup, (1, 1)),
    RowSpec("sa", "SQLAlchemy Session(twophase=True)", sa_setup, (1, 1)),
    RowSpec("zope", "transaction + zope.sqlalchemy", zope_setup, (1, 1)),
    RowSpec(
        "file",
        "twopc FileDecisionLog, sequential",
        lambda e, t: twopc_setup(e, t, file_log(e), parallel=False, two=True),
        (1, 1),
    ),
    RowSpec(
        "file-par",
        "twopc FileDecisionLog, parallel",
        lambda e, t: twopc_setup(e, t, file_log(e), parallel=True, two=True),
        (1, 1),
    ),
    RowSpec(
        "file-async",
        "twopc FileDecisionLog, async phase two",
        lambda e, t: twopc_setup(e, t, file_log(e), parallel=False, two=True, async_phase_two=True),
        (1, 1),
    ),
    RowSpec("sql", "twopc SqlDecisionLog, sequential", sql_setup, (1, 1)),
    RowSpec("sql-carried", "twopc SqlDecisionLog in B, B carries it", carried_setup, (1, 1)),
    RowSpec(
        "llr",
        "twopc B last resource, A two-phase",
        lambda e, t: twopc_setup(e, t, file_log(e), parallel=False, two=True, last=True),
        (1, 1),
    ),
    RowSpec(
        "1phase",
        "twopc one-phase, 1 db (vs 1PC)",
        lambda e, t: twopc_setup(e, t, file_log(e), parallel=False, two=False),
        (1, 0),
    ),
    RowSpec(
        "file-core",
        "twopc FileDecisionLog, Core handle",
        lambda e, t: twopc_setup(e, t, file_log(e), parallel=False, two=True, core=True),
        (1, 1),
    ),
    RowSpec(
        "llr-core",
        "twopc last resource, Core handle",
        lambda e, t: twopc_setup(e, t, file_log(e), parallel=False, two=True, last=True, core=True),
        (1, 1),
    ),
    RowSpec(
        "1phase-core",
        "twopc one-phase, Core handle",
        lambda e, t: twopc_setup(e, t, file_log(e), parallel=False, two=False, core=True),
        (1, 0),
    ),
    RowSpec(
        "bare-pg3",
        "psycopg 3 2PC (tpc_*), no log",
        lambda e, t: bare_setup(e, t, psycopg.connect),
        (1, 1),
    ),
    RowSpec(
        "llr-pg3",
        "twopc last resource, psycopg 3",
        lambda e, t: twopc_setup(
            e, t, file_log(e), parallel=False, two=True, last=True, driver="psycopg"
        ),
        (1, 1),
    ),
)

ROWS += (RowSpec("file-aio", "twopc asyncio, N tasks on one loop, psycopg 3", aio_setup, (1, 1)),)

ROW = {spec.key: spec for spec in ROWS}


# -- measuring -------------------------------------------------------------------------------------


@dataclass
class Measured:
    """One measured run of one row at one thread count."""

    tps: float
    p50_ms: float
    p99_ms: float
    cpu_us: float  # this process's CPU (all threads, user + system) per measured transaction
    measured: int
    committed: int  # warm-up included: what must have landed


Results = dict[tuple[str, int], list[Measured]]  # (row, threads): one per round


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def drive(setup: Setup, threads: int, seconds: float, warmup: float) -> Measured:
    """Warm up every thread, then all of them commit until ``seconds`` after a common start."""
    started = [0.0, 0.0]  # wall, process CPU

    def start() -> None:
        started[:] = [time.perf_counter(), time.process_time()]

    barrier = threading.Barrier(threads + 1, action=start)
    latencies: list[list[float]] = [[] for _ in range(threads)]
    committed, finished = [0] * threads, [0.0] * threads
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            one = setup.client()
            until = time.perf_counter() + warmup
            while time.perf_counter() < until:
                one()
                committed[n] += 1
            barrier.wait()
            deadline, lat = started[0] + seconds, latencies[n]
            now = time.perf_counter()
            while now < deadline and not errors:
                one()
                committed[n] += 1
                lat.append(time.perf_counter() - now)
                now = time.perf_counter()
            finished[n] = now
        except threading.BrokenBarrierError:
            return
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    pool = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(threads)]
    for thread in pool:
        thread.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait()
    for thread in pool:
        thread.join()
    cpu = time.process_time() - started[1]
    if errors:
        raise BenchError(f"a client failed: {errors[0]!r}") from errors[0]
    return summarise(latencies, max(finished) - started[0], cpu, sum(committed))


async def drive_tasks(
    one: Callable[[], Any], tasks: int, seconds: float, warmup: float
) -> Measured:
    """`drive` for an asyncio row: ``tasks`` tasks on this loop warm up, then all commit until
    ``seconds`` after a common start."""
    started = [0.0, 0.0]
    latencies: list[list[float]] = [[] for _ in range(tasks)]
    committed, finished = [0] * tasks, [0.0] * tasks
    ready, go = [0], asyncio.Event()

    async def task(n: int) -> None:
        until = time.perf_counter() + warmup
        while time.perf_counter() < until:
            await one()
            committed[n] += 1
        ready[0] += 1
        if ready[0] == tasks:
            started[:] = [time.perf_counter(), time.process_time()]
            go.set()
        await go.wait()
        deadline, lat = started[0] + seconds, latencies[n]
        now = time.perf_counter()
        while now < deadline:
            await one()
            committed[n] += 1
            lat.append(time.perf_counter() - now)
            now = time.perf_counter()
        finished[n] = now

    await asyncio.gather(*(task(n) for n in range(tasks)))
    cpu = time.process_time() - started[1]
    return summarise(latencies, max(finished) - started[0], cpu, sum(committed))


def summarise(latencies: list[list[float]], wall: float, cpu: float, committed: int) -> Measured:
    ordered = sorted(itertools.chain.from_iterable(latencies))
    n = len(ordered)
    p50, p99 = (percentile(ordered, q) * 1e3 for q in (0.50, 0.99))
    return Measured(n / wall, p50, p99, cpu / n * 1e6, n, committed)


def counts(env: Env) -> list[tuple[int, int]]:
    """(bench rows, prepared transactions) in A and in B."""
    result = []
    for url in (env.url_a, env.url_b):
        with contextlib.closing(psycopg2.connect(env.dsn(url))) as conn, conn.cursor() as cur:
            cur.execute(
                f"SELECT (SELECT count(*) FROM {TABLE}), (SELECT count(*) FROM pg_prepared_xacts "
                "WHERE database = current_database())"
            )
            row = cur.fetchone()
            assert row is not None
            result.append((int(row[0]), int(row[1])))
    return result


def run_row(env: Env, spec: RowSpec, threads: int, seconds: float, warmup: float) -> Measured:
    """Measure one row, then check what it left in the databases; raise if anything is off."""
    before = counts(env)
    setup = spec.make(env, threads)
    try:
        measured = (setup.drive or functools.partial(drive, setup))(threads, seconds, warmup)
    finally:
        setup.finish()
    after = counts(env)
    for db, (b, a, writes) in zip("AB", zip(before, after, spec.writes, strict=True), strict=True):
        landed, expected = a[0] - b[0], measured.committed * writes
        if landed != expected:
            raise BenchError(
                f"{spec.key} at {threads} threads: {landed} rows landed in database {db}, "
                f"expected {expected}"
            )
        if a[1]:
            raise BenchError(
                f"{spec.key} at {threads} threads: {a[1]} prepared transactions left in {db}"
            )
    return measured


def sql_row_skipped(env: Env) -> str | None:
    if sql_log_class() is None:
        return SKIPPED
    if env.url_log is None:
        return "skipped: no --url-log for the SqlDecisionLog"
    return None


def run_all(env: Env, args: argparse.Namespace, thread_counts: list[int]) -> Results:
    """Every row at every thread count; rounds alternate the row order to spread drift."""
    results: Results = {}
    chosen = selected(args)
    for round_ in range(args.rounds):
        for threads in thread_counts:
            specs = chosen if round_ % 2 == 0 else chosen[::-1]
            for spec in specs:
                if spec.key == "sql" and sql_row_skipped(env):
                    continue
                m = run_row(env, spec, threads, args.seconds, args.warmup)
                results.setdefault((spec.key, threads), []).append(m)
    return results


def selected(args: argparse.Namespace) -> tuple[RowSpec, ...]:
    """The rows ``--rows`` names (all by default), always with the baseline."""
    if not args.rows:
        return ROWS
    wanted = {"bare", *args.rows.split(",")}
    unknown = wanted - set(ROW)
    if unknown:
        raise SystemExit(f"--rows: unknown rows {sorted(unknown)}; rows are {', '.join(ROW)}")
    return tuple(spec for spec in ROWS if spec.key in wanted)


# -- reporting -------------------------------------------------------------------------------------


MEDIANS = ("p50_ms", "p99_ms", "cpu_us")


def tps(results: Results, key: str, threads: int) -> float:
    return median([m.tps for m in results[(key, threads)]])


def ratio(results: Results, key: str, ref: str, threads: int) -> float:
    return tps(results, key, threads) / tps(results, ref, threads)


def print_table(results: Results, thread_counts: list[int], rounds: int, env: Env) -> None:
    spread = "  tx/s min-max" if rounds > 1 else ""
    print(
        f"{'thr':>3}  {'row':<11} {'what':<38} {'tx/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'CPU us':>7} {'x bare':>7}{spread}"
    )
    for threads in thread_counts:
        for spec in ROWS:
            runs = results.get((spec.key, threads))
            if runs is None:
                if spec.key == "sql" and sql_row_skipped(env):
                    print(f"{threads:>3}  {spec.key:<11} {spec.label:<38} {sql_row_skipped(env)}")
                continue
            p50, p99, cpu = (median([getattr(m, a) for m in runs]) for a in MEDIANS)
            rate, vs_bare = (
                tps(results, spec.key, threads),
                ratio(results, spec.key, "bare", threads),
            )
            line = (
                f"{threads:>3}  {spec.key:<11} {spec.label:<38} {rate:>7,.0f} {p50:>7.2f} "
                f"{p99:>7.2f} {cpu:>7,.0f} {vs_bare:>6.2f}x"
            )
            if rounds > 1:
                line += f"  {min(m.tps for m in runs):,.0f}-{max(m.tps for m in runs):,.0f}"
            if spec.key == "1phase" and ("1pc", threads) in results:
                line += f"  ({ratio(results, '1phase', '1pc', threads):.2f}x plain 1PC)"
            if spec.key == "llr" and ("file", threads) in results:
                line += f"  ({ratio(results, 'llr', 'file', threads):.2f}x file)"
            print(line)
        print()
    print("CPU us = this process's CPU (all threads) per transaction; the servers' is not in it.")


#: (row, compared with, at least this ratio of tx/s at 1 thread, at 8 threads)
TARGETS = (
    ("llr-core", "bare", 1.2, 0.9),
    ("llr", "bare", 1.0, 0.7),
    ("file", "bare", 0.8, 0.6),
    ("llr", "sa", 1.5, 1.2),
    ("1phase-core", "1pc", 0.9, 0.9),
)
#: (row, at most this much client CPU per transaction, us)
CPU_TARGETS = (("file", 600.0), ("file-core", 350.0))


def targets(thread_counts: list[int]) -> list[tuple[str, str, int, float]]:
    """(row, compared with, threads, at least this ratio of tx/s), as the brief states them."""
    return [
        (key, ref, threads, one if threads == 1 else many)
        for threads in thread_counts
        for key, ref, one, many in TARGETS
    ]


def print_targets(results: Results, thread_counts: list[int]) -> None:
    print("targets (tx/s ratios):")
    for key, ref, threads, want in targets(thread_counts):
        if (key, threads) not in results or (ref, threads) not in results:
            continue
        got = ratio(results, key, ref, threads)
        print(
            f"  [{'met   ' if got >= want else 'MISSED'}] {key:<11} vs {ref:<5} at {threads} "
            f"thread(s): {got:5.2f}x (target >= {want:.2f}x)"
        )
    for key, most in CPU_TARGETS:
        if (key, 1) in results:
            cpu = median([m.cpu_us for m in results[(key, 1)]])
            print(
                f"  [{'met   ' if cpu <= most else 'MISSED'}] {key:<11} client CPU at 1 thread: "
                f"{cpu:,.0f} us/tx (target <= {most:,.0f})"
            )
    print("like for like (same Session API on both sides; not a target, context for the misses):")
    for threads in thread_counts:
        if not {("1phase", threads), ("sa1pc", threads), ("file", threads), ("sa", threads)} <= (
            results.keys()
        ):
            continue
        print(
            f"  1phase vs sa1pc at {threads} thread(s): "
            f"{ratio(results, '1phase', 'sa1pc', threads):5.2f}x;  file vs sa: "
            f"{ratio(results, 'file', 'sa', threads):5.2f}x"
        )


def write_json(path: Path, results: Results) -> None:
    """One object per row and thread count, medians over the rounds."""
    rows = [
        {
            "row": key,
            "threads": threads,
            "tps": round(median([m.tps for m in runs]), 1),
            "cpu_us": round(median([m.cpu_us for m in runs]), 1),
        }
        for (key, threads), runs in results.items()
    ]
    path.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


def context(env: Env) -> None:
    with contextlib.closing(psycopg2.connect(env.dsn(env.url_a))) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT version(), current_setting('fsync'), current_setting('synchronous_commit'), "
            "current_setting('wal_sync_method'), current_setting('max_prepared_transactions'), "
            "current_setting('data_directory')"
        )
        row = cur.fetchone()
    assert row is not None
    version, fsync, sync_commit, method, max_prepared, datadir = row
    print(f"python {sys.version.split()[0]}, {platform.platform()}, {os.cpu_count()} CPUs")
    print(
        f"{str(version).split(',')[0]}; fsync={fsync}, synchronous_commit={sync_commit}, "
        f"wal_sync_method={method}, max_prepared_transactions={max_prepared}"
    )
    print(f"PostgreSQL data: {filesystem(Path(str(datadir)))}")
    print(f"decision logs:   {filesystem(env.log_root)}")
    style = "ORM session.add" if env.orm else "Core Session.execute(text(INSERT))"
    print(f"session rows insert with {style}; twopc default_timeout={env.timeout}")


def filesystem(path: Path) -> str:
    """The mount a path lives on, so a reader can tell a real disk from tmpfs."""
    best = ("?", "?", "")
    with contextlib.suppress(OSError), open("/proc/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            device, mount, fstype = line.split()[:3]
            if str(path).startswith(mount) and len(mount) >= len(best[2]):
                best = (device, fstype, mount)
    return f"{path} on {best[0]} ({best[1]})"


# -- profiling -------------------------------------------------------------------------------------


def group_of(filename: str, function: str) -> str:
    """Which part of the stack a profiled function belongs to."""
    if "psycopg2" in function and "execute" in function:
        return "psycopg2 execute (waiting on the server)"
    if function in ("<built-in method posix.fsync>", "<built-in method posix.fdatasync>"):
        return "fsync (decision log)"
    for part in ("orm", "engine", "pool", "event", "sql"):
        if f"/sqlalchemy/{part}/" in filename:
            return f"sqlalchemy.{part}"
    for part in ("sqlalchemy", "coordinator", "resource_managers"):
        if f"/{part}/" in filename:
            return part
    return "other (stdlib, builtins, this script)"


def print_groups(stats: pstats.Stats, transactions: int) -> None:
    """Own (not cumulative) profiled time, summed per part of the stack."""
    groups: dict[str, float] = {}
    raw: dict[tuple[str, int, str], tuple[Any, ...]] = stats.stats  # type: ignore[attr-defined]
    for (filename, _, function), (_, _, own, *_) in raw.items():
        name = group_of(filename, function)
        groups[name] = groups.get(name, 0.0) + own
    total = sum(groups.values())
    print(f"{'part of the stack':<42} {'us/tx':>7} {'share':>6}   (own time, under cProfile)")
    for name, own in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"{name:<42} {own / transactions * 1e6:>7,.0f} {own / total:>6.0%}")
    print()


def profile(env: Env, seconds: float, warmup: float) -> None:
    """The twopc file-log row at 1 thread, unprofiled (with and without the timeout) next to
    bare 2PC, then under cProfile with the timeout off: cProfile sees only its own thread, and
    a timeout moves the completion onto a pool thread."""
    configured = env.timeout
    for key, timeout in (("file", configured), ("file", None), ("bare", None)):
        env.timeout = timeout
        m = run_row(env, ROW[key], 1, seconds, warmup)
        print(
            f"{key:<5} timeout={timeout!s:<5} 1 thread: {m.tps:>6,.0f} tx/s, p50 {m.p50_ms:.3f} ms,"
            f" CPU {m.cpu_us:,.0f} us/tx"
        )
    setup = ROW["file"].make(env, 1)
    try:
        one = setup.client()
        for _ in range(500):
            one()
        profiler, n = cProfile.Profile(), 0
        deadline = time.perf_counter() + seconds
        profiler.enable()
        while time.perf_counter() < deadline:
            one()
            n += 1
        profiler.disable()
    finally:
        setup.finish()
        env.timeout = configured
    print(f"\ncProfile: twopc file log, sequential, 1 thread, timeout=None, {n} transactions\n")
    stats = pstats.Stats(profiler)
    print_groups(stats, n)
    stats.sort_stats("cumulative").print_stats(25)
    stats.sort_stats("tottime").print_stats(15)


# -- setup and main --------------------------------------------------------------------------------


def prepare_databases(env: Env) -> None:
    ddl = (
        f"CREATE TABLE IF NOT EXISTS {TABLE} (id bigserial PRIMARY KEY, payload text NOT NULL) "
        "WITH (autovacuum_enabled = off)"
    )
    for url in (env.url_a, env.url_b):
        with contextlib.closing(psycopg2.connect(env.dsn(url))) as conn:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(ddl)


@contextlib.contextmanager
def databases(args: argparse.Namespace) -> Iterator[tuple[str, str, str | None]]:
    """URLs of A, B and the SQL log's database: given, or on a throwaway cluster."""
    if args.url_a and args.url_b:
        yield args.url_a, args.url_b, args.url_log
        return
    if args.url_a or args.url_b:
        raise SystemExit("give both --url-a and --url-b, or neither")
    server = PostgresServer().start()
    try:
        names = [server.create_database(n) for n in ("bench_a", "bench_b", "bench_log")]
        yield server.url(names[0]), server.url(names[1]), server.url(names[2])
    finally:
        server.remove()


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=3.0, help="measured per row (3)")
    parser.add_argument("--warmup", type=float, default=0.5, help="per row and thread (0.5)")
    parser.add_argument("--prime", type=float, default=3.0, help="priming a fresh cluster (3)")
    parser.add_argument("--threads", default="1,8", help="client thread counts (1,8)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat, report medians (1)")
    parser.add_argument("--orm", action="store_true", help="session rows use ORM session.add")
    parser.add_argument("--timeout", type=float, default=60.0, help="twopc default_timeout, 0=none")
    parser.add_argument("--url-a", help="SQLAlchemy URL of database A (default: throwaway)")
    parser.add_argument("--url-b", help="SQLAlchemy URL of database B")
    parser.add_argument("--url-log", help="SQLAlchemy URL for the SqlDecisionLog row")
    parser.add_argument("--profile", action="store_true", help="profile the twopc file row")
    parser.add_argument("--rows", default="", help="only these rows, e.g. bare,file,llr")
    parser.add_argument("--json", type=Path, help="write the results to PATH as JSON")
    return parser.parse_args()


def main() -> None:
    args = parse()
    thread_counts = [int(t) for t in args.threads.split(",")]
    log_root = Path(tempfile.mkdtemp(prefix="twopc-bench-"))
    try:
        with databases(args) as (url_a, url_b, url_log):
            env = Env(url_a, url_b, url_log, args.orm, args.timeout or None, log_root)
            prepare_databases(env)
            context(env)
            prime = run_row(env, ROW["bare"], max(thread_counts), args.prime, 0.0)
            print(
                f"primed with {prime.committed} bare 2PC transactions; {args.warmup} s warm-up "
                f"and {args.seconds} s measured per row, {args.rounds} round(s)\n"
            )
            if args.profile:
                profile(env, args.seconds, args.warmup)
                return
            results = run_all(env, args, thread_counts)
            print_table(results, thread_counts, args.rounds, env)
            print("verified: every committed row in A and B, no prepared transaction left\n")
            print_targets(results, thread_counts)
            if args.json:
                write_json(args.json, results)
                print(f"\nwrote {args.json}")
    finally:
        shutil.rmtree(log_root, ignore_errors=True)


if __name__ == "__main__":
    main()
