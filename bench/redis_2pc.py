"""Redis through twopc, alone and next to PostgreSQL: transactions per second against Redis's own
atomic writes and against the non-atomic "commit PostgreSQL, then Redis" that code does today.

Every transaction makes the same small set of Redis writes: ``INCRBY a 1``, ``INCRBY b 1`` and
``SET marker <n>`` (the n-th transaction of its client). Every client thread has its own three
keys, so no two transactions contend for a key: the rows measure what each way of committing
costs, not lock waits. The PostgreSQL rows add one INSERT. The script starts a throwaway
``redis-server`` (``appendonly yes``, ``appendfsync always``, ``noeviction``: the settings a
prepare needs to survive a crash, so the reference rows pay the same fsync per write) and a
throwaway PostgreSQL cluster (``fsync=on``), unless ``--redis-url``/``--pg-url`` are given. Every
row runs at 1 and 8 client threads, is warmed up and then measured for ``--seconds``. Rows, and
why each one is here:

Redis alone (ratios against ``lua``):

- ``multi``: the three writes in one ``MULTI``/``EXEC`` pipeline (redis-py, one round trip).
  What Redis code does today when it wants the writes together.
- ``lua``: one ``EVALSHA`` of a script applying the three writes: THE REDIS BASELINE. It is what
  twopc's one-phase path is (one script applies the write set), minus the checks and the marker,
  so the ratio against it is twopc's own cost.
- ``1phase``: twopc with Redis as the only participant, so it takes the one-phase path: one
  script checks the locks, validates and applies the write set and leaves a short-lived marker.
  The branch is created with ``blind_writes=True``: ``incrby`` returns None instead of reading
  the key, as the reference rows do not read either. Targets: >= 0.9x ``lua`` at 1 thread,
  >= 0.6x at 8, and at most 120 us of client CPU per transaction.
- ``1phase-rd``: the same with the default branch, where ``incrby`` reads the key (and watches
  it) to return the new value, as redis-py does: one ``GET`` per key, then the one script.
  Target: >= 0.6x ``lua`` at 1 thread.

PostgreSQL + Redis (ratios against ``pair``):

- ``pair``: psycopg2 INSERT and COMMIT, then the Redis ``MULTI``/``EXEC``: THE PAIR BASELINE.
  It is NOT atomic: a crash (or a Redis error) between the two commits keeps half.
- ``sa-pair``: the same with a SQLAlchemy ``Session`` for the INSERT, the API twopc's
  PostgreSQL branch hands out. Not a target: it separates SQLAlchemy's cost from twopc's.
- ``2pc``/``2pc-par``: twopc over both, with `FileDecisionLog` (a forced COMMIT record per
  transaction), sequential and parallel prepare/commit: PostgreSQL PREPARE TRANSACTION, the
  Redis prepare script, the decision record, COMMIT PREPARED, the Redis commit script. Target:
  >= 0.8x ``pair``.
- ``2pc-1by1``: ``2pc`` with every Redis call waited for in turn (`OneByOne`, the resource
  without ``send_prepare`` and ``commit_batch``): what ``2pc`` cost before the Redis prepare
  script was sent ahead of PostgreSQL's PREPARE TRANSACTION and read after it
  (`coordinator.early_prepare`).

Two Redis resources on one client next to PostgreSQL (the counters in one, the marker in the
other; ratios against ``pair``, and in the context lines against each other):

- ``2pc-2r``: both prepare scripts in flight while PostgreSQL prepares, both commit scripts in one
  pipelined round trip (`coordinator.batch_commit`); ``2pc-2r-1by1``: one call waited for each.
  ``llr-2r`` and ``llr-2r-1by1``: the same with PostgreSQL as the last resource (the two
  prepares overlap each other; nothing can overlap the last resource's commit, which must wait
  for every vote).

After each row the script checks that the writes landed exactly: every client's two counters
equal the transactions it committed and its marker holds the last one; the PostgreSQL rows
inserted exactly one row per transaction; no prepared PostgreSQL transaction is left; twopc's
Redis namespace holds no prepared entry, lock or staged write set, and every branch record it
keeps says ``committed``. It raises if anything is off. ``CPU us`` is this process's CPU (all
threads) per transaction: on a small machine Python's work, not the servers, sets the latency
at 1 thread and, through the GIL, the ceiling at 8.

    python bench/redis_2pc.py [--seconds 3] [--threads 1,8] [--rounds 1] [--rows 1phase,2pc]
                              [--json PATH] [--profile]

``--rows`` runs only those rows (and their references). ``--json PATH`` also writes a list of
``{"row": id, "threads": n, "tps": ..., "cpu_us": ...}``, one per row and thread count, with the
row ids the table prints.

``--rounds N`` repeats every row N times, alternating the row order, and prints medians and the
tx/s range. ``--profile`` runs the twopc rows (``1phase`` and ``2pc``) at 1 thread under cProfile
(timeout off, so the whole completion runs on the profiled thread), next to unprofiled runs of
them and of their references, and prints the top functions and the time per package.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import platform
import pstats
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg2
import redis
from postgres_2pc import (  # the sibling benchmark (bench/ is sys.path[0] when run as a script)
    BenchError,
    Client,
    Env,
    Measured,
    Setup,
    close_all,
    drive,
    filesystem,
    group_of,
)
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from coordinator import FileDecisionLog, TransactionManager
from resource_managers.postgres import PostgresResource
from resource_managers.redis import RedisResource
from resource_managers.throwaway import PostgresServer, RedisServer

TABLE = "bench_redis_rows"
PAYLOAD = "twopc-redis-bench"
SQL_INSERT = f"INSERT INTO {TABLE} (payload) VALUES (%s)"  # psycopg2 rows
CORE_INSERT = text(f"INSERT INTO {TABLE} (payload) VALUES (:payload)")  # session rows
#: the reference script: the same three writes as every other row, data only through KEYS/ARGV
LUA_APPLY = """
redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('INCRBY', KEYS[2], ARGV[1])
redis.call('SET', KEYS[3], ARGV[2])
return 1
"""


# -- where the servers are, and whose keys are whose -----------------------------------------------


@dataclass
class Bench:
    redis_url: str
    pg_url: str
    timeout: float | None
    log_root: Path

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def engine(self, threads: int) -> Engine:
        return create_engine(self.pg_url, pool_size=threads + 2)

    def manager(self, resources: list[Any], parallel: bool = False) -> TransactionManager:
        node = f"bench-{uuid.uuid4().hex[:8]}"
        return TransactionManager(
            node,
            FileDecisionLog(Path(tempfile.mkdtemp(dir=self.log_root)) / "log"),
            resources,
            parallel=parallel,
            recovery_interval=None,
            reaper_interval=None,
            default_timeout=self.timeout,
        )


@dataclass
class Keys:
    """One client's three keys and how many transactions it committed."""

    a: bytes
    b: bytes
    marker: bytes
    done: int = 0


@dataclass
class Ledger:
    """Every client a row made, and twopc's namespace for the row (None: no twopc)."""

    row: str
    namespace: str | None = None
    clients: list[Keys] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.base = f"bench:{self.row}:{uuid.uuid4().hex[:8]}"

    def new(self) -> Keys:
        base = f"{self.base}:{len(self.clients)}:".encode()
        keys = Keys(base + b"a", base + b"b", base + b"marker")
        self.clients.append(keys)
        return keys

    def redis_resource(
        self, client: redis.Redis, blind: bool, kind: type[RedisResource] = RedisResource
    ) -> RedisResource:
        self.namespace = f"bench-{uuid.uuid4().hex[:8]}"
        return kind(client, "redis", namespace=self.namespace, blind_writes=blind)


def write_pipeline(pipe: Any, keys: Keys, n: int) -> None:
    """The three writes, into a redis-py pipeline or a twopc branch (same method names)."""
    pipe.incrby(keys.a, 1)
    pipe.incrby(keys.b, 1)
    pipe.set(keys.marker, n)


class OneByOne(RedisResource):
    """A Redis resource without the verbs that overlap round trips (``send_prepare``,
    ``commit_batch``): every prepare and commit is one call waited for, as before them. The
    coordinator looks the verbs up on the class, so hiding them here is all it takes."""

    send_prepare = None  # type: ignore[assignment]
    commit_batch = None  # type: ignore[assignment]


# -- the rows --------------------------------------------------------------------------------------


def multi_setup(bench: Bench, threads: int, ledger: Ledger) -> Setup:
    r = bench.redis()

    def client() -> Client:
        keys, pipe = ledger.new(), r.pipeline(transaction=True)

        def one() -> None:
            n = keys.done + 1
            write_pipeline(pipe, keys, n)
            pipe.execute()
            keys.done = n

        return one

    return Setup(client, r.close)


def lua_setup(bench: Bench, threads: int, ledger: Ledger) -> Setup:
    r = bench.redis()
    sha = r.script_load(LUA_APPLY)

    def client() -> Client:
        keys = ledger.new()

        def one() -> None:
            n = keys.done + 1
            r.execute_command(  # type: ignore[no-untyped-call]
                "EVALSHA", sha, 3, keys.a, keys.b, keys.marker, 1, n
            )
            keys.done = n

        return one

    return Setup(client, r.close)


def one_phase_setup(bench: Bench, threads: int, ledger: Ledger, blind: bool) -> Setup:
    r = bench.redis()
    cache = ledger.redis_resource(r, blind)
    tm = bench.manager([cache])

    def client() -> Client:
        keys = ledger.new()

        def one() -> None:
            n = keys.done + 1
            with tm.transaction() as tx:
                write_pipeline(tx.join(cache), keys, n)
            keys.done = n

        return one

    def close() -> None:
        tm.close()
        r.close()

    return Setup(client, close)


def pair_setup(bench: Bench, threads: int, ledger: Ledger) -> Setup:
    r = bench.redis()
    conns: list[Any] = []

    def client() -> Client:
        keys, pipe = ledger.new(), r.pipeline(transaction=True)
        conn = psycopg2.connect(Env.dsn(bench.pg_url))
        conns.append(conn)
        cur = conn.cursor()

        def one() -> None:
            n = keys.done + 1
            cur.execute(SQL_INSERT, (PAYLOAD,))
            conn.commit()
            write_pipeline(pipe, keys, n)
            pipe.execute()
            keys.done = n

        return one

    def close() -> None:
        close_all(conns)
        r.close()

    return Setup(client, close)


def sa_pair_setup(bench: Bench, threads: int, ledger: Ledger) -> Setup:
    r, engine = bench.redis(), bench.engine(threads)

    def client() -> Client:
        keys, pipe = ledger.new(), r.pipeline(transaction=True)

        def one() -> None:
            n = keys.done + 1
            with Session(engine) as session, session.begin():
                session.execute(CORE_INSERT, {"payload": PAYLOAD})
            write_pipeline(pipe, keys, n)
            pipe.execute()
            keys.done = n

        return one

    def close() -> None:
        engine.dispose()
        r.close()

    return Setup(client, close)


def two_phase_setup(
    bench: Bench,
    threads: int,
    ledger: Ledger,
    parallel: bool,
    *,
    last: bool = False,
    kind: type[RedisResource] = RedisResource,
) -> Setup:
    """PostgreSQL and Redis in one transaction; ``last``: PostgreSQL is the logging last
    resource (Redis prepares, PostgreSQL commits with the decision row, Redis commits)."""
    r, engine = bench.redis(), bench.engine(threads)
    db = PostgresResource(engine, "pg", last_resource=last)
    cache = ledger.redis_resource(r, blind=True, kind=kind)
    tm = bench.manager([db, cache], parallel=parallel)

    def client() -> Client:
        keys = ledger.new()

        def one() -> None:
            n = keys.done + 1
            with tm.transaction() as tx:
                tx.join(db).execute(CORE_INSERT, {"payload": PAYLOAD})
                write_pipeline(tx.join(cache), keys, n)
            keys.done = n

        return one

    def close() -> None:
        tm.close()
        engine.dispose()
        r.close()

    return Setup(client, close)


def two_redis_setup(
    bench: Bench, threads: int, ledger: Ledger, last: bool, kind: type[RedisResource]
) -> Setup:
    """PostgreSQL and two Redis resources on one client (the counters in one, the marker in
    the other) in one transaction: both prepare scripts in flight together, both commits in one
    pipelined round trip; with `OneByOne`, one call waited for each."""
    r, engine = bench.redis(), bench.engine(threads)
    db = PostgresResource(engine, "pg", last_resource=last)
    counters = ledger.redis_resource(r, blind=True, kind=kind)
    markers = kind(r, "redis2", namespace=ledger.namespace, blind_writes=True)
    tm = bench.manager([db, counters, markers])

    def client() -> Client:
        keys = ledger.new()

        def one() -> None:
            n = keys.done + 1
            with tm.transaction() as tx:
                tx.join(db).execute(CORE_INSERT, {"payload": PAYLOAD})
                branch = tx.join(counters)
                branch.incrby(keys.a, 1)
                branch.incrby(keys.b, 1)
                tx.join(markers).set(keys.marker, n)
            keys.done = n

        return one

    def close() -> None:
        tm.close()
        engine.dispose()
        r.close()

    return Setup(client, close)


@dataclass(frozen=True)
class RowSpec:
    key: str
    label: str
    make: Callable[[Bench, int, Ledger], Setup]
    ref: str  # the row its ratio is against
    pg_rows: int  # rows each transaction inserts into PostgreSQL
    redis_branches: int = 1  # twopc branch records each transaction leaves in Redis


ROWS = (
    RowSpec("multi", "Redis MULTI/EXEC pipeline", multi_setup, "lua", 0),
    RowSpec("lua", "Redis Lua script = REDIS BASELINE", lua_setup, "lua", 0),
    RowSpec(
        "1phase",
        "twopc Redis alone, one-phase (blind)",
        lambda b, t, led: one_phase_setup(b, t, led, blind=True),
        "lua",
        0,
    ),
    RowSpec(
        "1phase-rd",
        "twopc Redis alone, incrby reads",
        lambda b, t, led: one_phase_setup(b, t, led, blind=False),
        "lua",
        0,
    ),
    RowSpec("pair", "PG commit, then MULTI = PAIR (NOT atomic)", pair_setup, "pair", 1),
    RowSpec("sa-pair", "SA Session commit, then MULTI (NOT atomic)", sa_pair_setup, "pair", 1),
    RowSpec(
        "2pc",
        "twopc PG + Redis, file log, sequential",
        lambda b, t, led: two_phase_setup(b, t, led, parallel=False),
        "pair",
        1,
    ),
    RowSpec(
        "2pc-llr",
        "twopc PG (last resource) + Redis",
        lambda b, t, led: two_phase_setup(b, t, led, parallel=False, last=True),
        "pair",
        1,
    ),
    RowSpec(
        "2pc-par",
        "twopc PG + Redis, file log, parallel",
        lambda b, t, led: two_phase_setup(b, t, led, parallel=True),
        "pair",
        1,
    ),
    RowSpec(
        "2pc-1by1",
        "twopc PG + Redis, file log, one call at a time",
        partial(two_phase_setup, parallel=False, kind=OneByOne),
        "pair",
        1,
    ),
    *(
        RowSpec(key, label, partial(two_redis_setup, last=last, kind=kind), "pair", 1, 2)
        for key, label, last, kind in (
            ("2pc-2r", "twopc PG + 2 Redis, file log", False, RedisResource),
            ("2pc-2r-1by1", "twopc PG + 2 Redis, file log, 1 call at a time", False, OneByOne),
            ("llr-2r", "twopc PG (last) + 2 Redis", True, RedisResource),
            ("llr-2r-1by1", "twopc PG (last) + 2 Redis, 1 call at a time", True, OneByOne),
        )
    ),
)

ROW = {spec.key: spec for spec in ROWS}
#: (row, compared with, thread count (None: every one), at least this ratio of tx/s). A new row
#: (another way of committing, say) is one `RowSpec` above and, if it has one, a target here
TARGETS: tuple[tuple[str, str, int | None, float], ...] = (
    ("1phase", "lua", 1, 0.9),
    ("1phase", "lua", 8, 0.6),
    ("1phase-rd", "lua", 1, 0.6),
    ("2pc", "pair", None, 0.8),
    ("2pc-llr", "pair", None, 0.8),
    ("2pc-par", "pair", None, 0.8),
)
#: (row, at most this client CPU per transaction in microseconds, at every thread count)
CPU_TARGETS = (("1phase", 120.0),)


# -- checking what a row left ----------------------------------------------------------------------


def pg_counts(bench: Bench) -> tuple[int, int]:
    """(bench rows, prepared transactions) in the PostgreSQL database."""
    dsn = Env.dsn(bench.pg_url)
    with contextlib.closing(psycopg2.connect(dsn)) as conn, conn.cursor() as cur:
        cur.execute(
            f"SELECT (SELECT count(*) FROM {TABLE}), (SELECT count(*) FROM pg_prepared_xacts "
            "WHERE database = current_database())"
        )
        row = cur.fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def check_counters(r: redis.Redis, ledger: Ledger, committed: int) -> list[str]:
    """Every client's counters equal its committed transactions; its marker is the last one."""
    problems = []
    if sum(keys.done for keys in ledger.clients) != committed:
        problems.append(f"clients count {sum(k.done for k in ledger.clients)}, drive {committed}")
    for keys in ledger.clients:
        a, b, marker = r.mget([keys.a, keys.b, keys.marker])
        want = str(keys.done).encode() if keys.done else None  # a client that never committed
        if (a, b, marker) != (want, want, want):
            problems.append(f"{keys.a!r}: a={a!r} b={b!r} marker={marker!r}, expected {want!r}")
    return problems


def check_namespace(r: redis.Redis, namespace: str, committed: int) -> list[str]:
    """twopc's keys of the row: nothing prepared, locked or staged; every record committed."""
    prefix = f"{namespace}:{{{namespace}}}:"
    problems = []
    if r.zcard(prefix + "prepared"):
        problems.append(f"{r.zcard(prefix + 'prepared')} prepared entries left")
    for kind in ("lock", "ws"):
        left = sum(1 for _ in r.scan_iter(match=f"{prefix}{kind}:*", count=10_000))
        if left:
            problems.append(f"{left} {kind}:* keys left")
    states: Counter[bytes | None] = Counter()
    records = list(r.scan_iter(match=f"{prefix}tx:*", count=10_000))
    for start in range(0, len(records), 1000):
        pipe = r.pipeline(transaction=False)
        for key in records[start : start + 1000]:
            pipe.hget(key, "state")
        states.update(pipe.execute())
    if set(states) - {b"committed"} or states[b"committed"] > committed:
        problems.append(f"branch records {dict(states)}, {committed} committed")
    return problems


def run_row(bench: Bench, spec: RowSpec, threads: int, seconds: float, warmup: float) -> Measured:
    """Measure one row, then check what it left in both servers; raise if anything is off."""
    before = pg_counts(bench)
    ledger = Ledger(spec.key)
    setup = spec.make(bench, threads, ledger)
    try:
        measured = drive(setup, threads, seconds, warmup)
    finally:
        setup.finish()
    after = pg_counts(bench)
    problems = []
    landed, expected = after[0] - before[0], measured.committed * spec.pg_rows
    if landed != expected:
        problems.append(f"{landed} rows landed in PostgreSQL, expected {expected}")
    if after[1]:
        problems.append(f"{after[1]} prepared PostgreSQL transactions left")
    with contextlib.closing(bench.redis()) as r:
        problems += check_counters(r, ledger, measured.committed)
        if ledger.namespace is not None:
            branches = measured.committed * spec.redis_branches
            problems += check_namespace(r, ledger.namespace, branches)
    if problems:
        raise BenchError(f"{spec.key} at {threads} threads: " + "; ".join(problems[:5]))
    return measured


Results = dict[tuple[str, int], list[Measured]]  # (row, threads): one per round


def run_all(
    bench: Bench, args: argparse.Namespace, thread_counts: list[int], rows: list[RowSpec]
) -> Results:
    """Every row at every thread count; rounds alternate the row order to spread drift."""
    results: Results = {}
    for round_ in range(args.rounds):
        for threads in thread_counts:
            for spec in rows if round_ % 2 == 0 else rows[::-1]:
                m = run_row(bench, spec, threads, args.seconds, args.warmup)
                results.setdefault((spec.key, threads), []).append(m)
    return results


# -- reporting -------------------------------------------------------------------------------------


def tps(results: Results, key: str, threads: int) -> float:
    return median([m.tps for m in results[(key, threads)]])


def ratio(results: Results, key: str, ref: str, threads: int) -> float:
    return tps(results, key, threads) / tps(results, ref, threads)


def print_table(
    results: Results, thread_counts: list[int], rounds: int, rows: list[RowSpec]
) -> None:
    spread = "  tx/s min-max" if rounds > 1 else ""
    print(
        f"{'thr':>3}  {'row':<11} {'what':<42} {'tx/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'CPU us':>7} {'x ref':>12}{spread}"
    )
    for threads in thread_counts:
        for spec in rows:
            runs = results[(spec.key, threads)]
            p50, p99, cpu = (median([getattr(m, a) for m in runs]) for a in MEDIANS)
            rate = tps(results, spec.key, threads)
            vs = (
                f"{ratio(results, spec.key, spec.ref, threads):.2f}x {spec.ref}"
                if (spec.ref, threads) in results
                else ""
            )
            line = (
                f"{threads:>3}  {spec.key:<11} {spec.label:<42} {rate:>7,.0f}"
                f" {p50:>7.2f} {p99:>7.2f} {cpu:>7,.0f} {vs:>12}"
            )
            if rounds > 1:
                line += f"  {min(m.tps for m in runs):,.0f}-{max(m.tps for m in runs):,.0f}"
            print(line)
        print()
    print("CPU us = this process's CPU (all threads) per transaction; the servers' is not in it.")


MEDIANS = ("p50_ms", "p99_ms", "cpu_us")


def print_targets(results: Results, thread_counts: list[int]) -> None:
    print("targets (tx/s ratios; client CPU):")
    for threads in thread_counts:
        for key, ref, at, want in TARGETS:
            if at not in (None, threads) or (key, threads) not in results:
                continue
            if (ref, threads) not in results:
                continue
            got = ratio(results, key, ref, threads)
            print(
                f"  [{'met   ' if got >= want else 'MISSED'}] {key:<11} vs {ref:<5} at {threads} "
                f"thread(s): {got:5.2f}x (target >= {want:.2f}x)"
            )
        for key, most in CPU_TARGETS:
            if (key, threads) in results:
                cpu = median([m.cpu_us for m in results[(key, threads)]])
                print(
                    f"  [{'met   ' if cpu <= most else 'MISSED'}] {key:<11} CPU at {threads} "
                    f"thread(s): {cpu:,.0f} us/tx (target <= {most:,.0f} us)"
                )
    print("context (not targets):")
    for threads in thread_counts:
        pairs = (
            ("1phase", "multi"),
            ("2pc", "sa-pair"),
            # round trips overlapped (prepares in flight, commits pipelined) vs one at a time
            ("2pc", "2pc-1by1"),
            ("2pc-2r", "2pc-2r-1by1"),
            ("llr-2r", "llr-2r-1by1"),
        )
        said = [
            f"{k} vs {ref} {ratio(results, k, ref, threads):.2f}x"
            for k, ref in pairs
            if (k, threads) in results and (ref, threads) in results
        ]
        if said:
            print(f"  at {threads} thread(s): " + "; ".join(said))


def write_json(path: Path, results: Results) -> None:
    """One object per row and thread count: medians over the rounds, the row ids printed."""
    rows = [
        {
            "row": key,
            "threads": threads,
            "tps": round(tps(results, key, threads), 1),
            "cpu_us": round(median([m.cpu_us for m in runs]), 1),
        }
        for (key, threads), runs in results.items()
    ]
    path.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


def context(bench: Bench) -> None:
    with contextlib.closing(bench.redis()) as r:
        info = r.info("server")
        config = {k: r.config_get(k)[k] for k in ("appendonly", "appendfsync", "maxmemory-policy")}
        aof_dir = str(r.config_get("dir")["dir"])
    with contextlib.closing(psycopg2.connect(Env.dsn(bench.pg_url))) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT version(), current_setting('fsync'), current_setting('synchronous_commit'), "
            "current_setting('wal_sync_method'), current_setting('data_directory')"
        )
        row = cur.fetchone()
    assert row is not None
    version, fsync, sync_commit, method, datadir = row
    print(f"python {sys.version.split()[0]}, {platform.platform()}, {os.cpu_count()} CPUs")
    print(f"load average before: {load()} (other work on the machine skews every row)")
    print(
        f"redis {info['redis_version']}, redis-py {redis.__version__}; "
        + ", ".join(f"{k}={v}" for k, v in config.items())
    )
    print(
        f"{str(version).split(',')[0]}; fsync={fsync}, synchronous_commit={sync_commit}, "
        f"wal_sync_method={method}"
    )
    print(f"Redis AOF:       {filesystem(Path(aof_dir))}")
    print(f"PostgreSQL data: {filesystem(Path(str(datadir)))}")
    print(f"decision logs:   {filesystem(bench.log_root)}")
    print(f"twopc default_timeout={bench.timeout}")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# -- profiling -------------------------------------------------------------------------------------


def redis_group_of(filename: str, function: str) -> str:
    """`group_of` of the PostgreSQL benchmark, with redis-py's socket reads told apart."""
    if function in ("<method 'recv_into' of '_socket.socket' objects>",) or (
        "recv" in function and "socket" in function
    ):
        return "socket recv (waiting on Redis)"
    if function == "<method 'sendall' of '_socket.socket' objects>":
        return "socket send"
    if "/redis/" in filename and "/resource_managers/" not in filename:
        return "redis-py"
    return group_of(filename, function)


def print_groups(stats: pstats.Stats, transactions: int) -> None:
    """Own (not cumulative) profiled time, summed per part of the stack."""
    groups: dict[str, float] = {}
    raw: dict[tuple[str, int, str], tuple[Any, ...]] = stats.stats  # type: ignore[attr-defined]
    for (filename, _, function), (_, _, own, *_) in raw.items():
        name = redis_group_of(filename, function)
        groups[name] = groups.get(name, 0.0) + own
    total = sum(groups.values())
    print(f"{'part of the stack':<42} {'us/tx':>7} {'share':>6}   (own time, under cProfile)")
    for name, own in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"{name:<42} {own / transactions * 1e6:>7,.0f} {own / total:>6.0%}")
    print()


def profile_row(bench: Bench, key: str, seconds: float) -> None:
    ledger = Ledger(key)
    setup = ROW[key].make(bench, 1, ledger)
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
    print(f"\ncProfile: {key} ({ROW[key].label}), 1 thread, timeout=None, {n} transactions\n")
    stats = pstats.Stats(profiler)
    print_groups(stats, n)
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats(20)


def profile(bench: Bench, seconds: float, warmup: float) -> None:
    """The twopc rows at 1 thread, unprofiled (with and without the timeout) next to their
    references, then under cProfile with the timeout off: cProfile sees only its own thread, and
    a timeout moves the completion onto a pool thread."""
    configured = bench.timeout
    runs = [("lua", None), ("1phase", configured), ("1phase", None)]
    runs += [("pair", None), ("2pc", configured), ("2pc", None)]
    try:
        for key, timeout in runs:
            bench.timeout = timeout
            m = run_row(bench, ROW[key], 1, seconds, warmup)
            print(
                f"{key:<7} timeout={timeout!s:<5} 1 thread: {m.tps:>6,.0f} tx/s, "
                f"p50 {m.p50_ms:.3f} ms, CPU {m.cpu_us:,.0f} us/tx"
            )
        bench.timeout = None
        for key in ("1phase", "2pc"):
            profile_row(bench, key, seconds)
    finally:
        bench.timeout = configured


# -- setup and main --------------------------------------------------------------------------------


@contextlib.contextmanager
def servers(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """(Redis URL, PostgreSQL SQLAlchemy URL): given, or throwaway servers this script owns."""
    with contextlib.ExitStack() as stack:
        redis_url, pg_url = args.redis_url, args.pg_url
        if redis_url is None:
            server = RedisServer().start()
            stack.callback(server.remove)
            redis_url = server.url()
        if pg_url is None:
            pg = PostgresServer().start()
            stack.callback(pg.remove)
            pg_url = pg.url(pg.create_database("bench_redis"))
        yield redis_url, pg_url


def prepare_database(bench: Bench) -> None:
    ddl = (
        f"CREATE TABLE IF NOT EXISTS {TABLE} (id bigserial PRIMARY KEY, payload text NOT NULL) "
        "WITH (autovacuum_enabled = off)"
    )
    with contextlib.closing(psycopg2.connect(Env.dsn(bench.pg_url))) as conn:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(ddl)


def chosen_rows(wanted: str | None) -> list[RowSpec]:
    """The rows asked for and the references their ratios need, in the table's order."""
    if not wanted:
        return list(ROWS)
    keys = {key.strip() for key in wanted.split(",")}
    unknown = keys - set(ROW)
    if unknown:
        raise SystemExit(f"unknown rows {sorted(unknown)}; the rows are {', '.join(ROW)}")
    keys |= {ROW[key].ref for key in keys}
    return [spec for spec in ROWS if spec.key in keys]


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=3.0, help="measured per row (3)")
    parser.add_argument("--warmup", type=float, default=0.5, help="per row and thread (0.5)")
    parser.add_argument("--prime", type=float, default=3.0, help="priming fresh servers (3)")
    parser.add_argument("--threads", default="1,8", help="client thread counts (1,8)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat, report medians (1)")
    parser.add_argument("--timeout", type=float, default=60.0, help="twopc default_timeout, 0=none")
    parser.add_argument("--redis-url", help="redis:// URL (default: a throwaway redis-server)")
    parser.add_argument("--pg-url", help="SQLAlchemy URL of a database (default: throwaway)")
    parser.add_argument("--profile", action="store_true", help="profile the twopc rows")
    parser.add_argument(
        "--rows", help="comma-separated row ids to run (default: all); a row's reference too"
    )
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    return parser.parse_args()


def main() -> None:
    args = parse()
    thread_counts = [int(t) for t in args.threads.split(",")]
    log_root = Path(tempfile.mkdtemp(prefix="twopc-bench-"))
    try:
        with servers(args) as (redis_url, pg_url):
            bench = Bench(redis_url, pg_url, args.timeout or None, log_root)
            prepare_database(bench)
            context(bench)
            prime = run_row(bench, ROW["pair"], max(thread_counts), args.prime, 0.0)
            print(
                f"primed with {prime.committed} PostgreSQL-then-Redis transactions; "
                f"{args.warmup} s warm-up and {args.seconds} s measured per row, "
                f"{args.rounds} round(s)\n"
            )
            if args.profile:
                profile(bench, args.seconds, args.warmup)
                return
            rows = chosen_rows(args.rows)
            results = run_all(bench, args, thread_counts, rows)
            print_table(results, thread_counts, args.rounds, rows)
            if args.json is not None:
                write_json(args.json, results)
            print(f"load average after: {load()}")
            print(
                "verified: every client's counters and marker equal its committed transactions, "
                "one PostgreSQL row per transaction, nothing prepared, locked or staged left\n"
            )
            print_targets(results, thread_counts)
    finally:
        shutil.rmtree(log_root, ignore_errors=True)


if __name__ == "__main__":
    main()
