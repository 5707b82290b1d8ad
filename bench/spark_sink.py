"""Spark rows/s into PostgreSQL: the ``twopc`` data source against plain ``foreachPartition`` sinks.

One Spark job per row writes N rows (``--rows``, default 1,000,000; ``--quick`` 100,000) of
(id bigint, name text, amount bigint), computed from ``spark.range(N)`` in ``--partitions``
partitions (default 4), into a table on a throwaway PostgreSQL cluster (fsync=on,
``max_prepared_transactions`` raised to fit every partition's branch plus the driver's ledger
branch) that this script starts, with a throwaway Redis (AOF, appendfsync always) for the last
row. Seconds are wall time of the whole job as the application sees it: ``save()`` or
``foreachPartition`` from call to return, including Spark's scheduling and, for twopc, the
driver's commit. Rows, and why each one is here:

- ``plain foreachPartition (execute_values)``: what a Spark user writes without a transactional
  sink: each partition opens a psycopg2 connection, inserts with
  ``psycopg2.extras.execute_values`` (page_size 1000) and commits. THE BASELINE: every ratio is
  against it. It is not atomic: a failed job keeps the partitions that committed, and a retried
  task writes its rows twice.
- ``plain foreachPartition (COPY)``: the same, streaming a CSV buffer through ``COPY FROM
  STDIN``: the fastest way into PostgreSQL from Python, so the ceiling of a plain sink.
- ``twopc -> PostgreSQL``: ``df.write.format("twopc")`` with a PostgreSQL target; the SQL
  decision log lives on the same server in its own database. Every row exactly once whatever
  Spark retries, nothing at all if the job fails.
- ``twopc -> PostgreSQL + Redis``: the same plus a Redis ``SET item:{id} {name}`` per row, in the
  same atomic decision (Redis branch with durability ``strict``).

Before measuring, every sink writes a small batch once, so the cost of starting Spark's Python
workers and importing the sink's modules is not measured. Between rows the table is truncated
(and Redis flushed); after each row the script checks that exactly N rows landed (and N Redis
keys), and that no prepared transaction is left, and raises if not.

Target, printed with a verdict: twopc -> PostgreSQL >= 0.8x the execute_values baseline. When it
is missed, one partition's worth of rows is written by `write_partition` outside Spark, with each
piece timed by ``time.perf_counter`` next to the same rows through ``execute_values``, to show
where the time goes (``--profile`` forces that section).

    python bench/spark_sink.py [--quick | --rows 1000000] [--partitions 4] [--cores N]
        [--rounds 1] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

import psycopg2
import psycopg2.extras
import redis
from pyspark.sql import DataFrame, SparkSession

from resource_managers.throwaway import PostgresServer, RedisServer
from spark_integration import partition_writer, register

TABLE = "items"
COLUMNS = ("id", "name", "amount")
DDL = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} (id bigint NOT NULL, name text NOT NULL, "
    "amount bigint NOT NULL) WITH (autovacuum_enabled = off)"
)
INSERT_VALUES = f"INSERT INTO {TABLE} (id, name, amount) VALUES %s"
COPY = f"COPY {TABLE} (id, name, amount) FROM STDIN WITH (FORMAT csv)"
WARMUP_ROWS = 2000
TARGET = 0.8
BASELINE = "ev"


class BenchError(RuntimeError):
    """A row did not leave the stores as it should: rows missing or extra, or a prepared xact."""


@dataclass(frozen=True)
class Env:
    spark: SparkSession
    data_dsn: str  # libpq DSN of the data database (plain sinks, checks)
    data_url: str  # SQLAlchemy URL of the same (twopc)
    log_url: str  # SQLAlchemy URL of the decision log's database
    redis_url: str
    partitions: int

    def frame(self, n: int) -> DataFrame:
        return self.spark.range(0, n, numPartitions=self.partitions).selectExpr(
            "id", "CONCAT('name-', CAST(id AS STRING)) AS name", "(id * 7919) % 100000 AS amount"
        )

    def twopc_options(self, with_redis: bool) -> dict[str, str]:
        options = {
            "appId": "bench-spark-sink",
            "log.url": self.log_url,
            "pg.url": self.data_url,
            "pg.table": TABLE,
        }
        if with_redis:
            options |= {
                "redis.url": self.redis_url,
                "redis.op": "set",
                "redis.key": "item:{id}",
                "redis.value": "{name}",
            }
        return options


# -- the sinks (functions shipped to executors by value: this script is __main__) ----------------


def execute_values_sink(dsn: str) -> Callable[[Iterator[Any]], None]:
    def write(rows: Iterator[Any]) -> None:
        conn = psycopg2.connect(dsn)
        try:
            with conn.cursor() as cur:
                psycopg2.extras.execute_values(
                    cur, INSERT_VALUES, (tuple(row) for row in rows), page_size=1000
                )
            conn.commit()
        finally:
            conn.close()

    return write


def copy_sink(dsn: str) -> Callable[[Iterator[Any]], None]:
    def write(rows: Iterator[Any]) -> None:
        buffer = io.StringIO()
        for row_id, name, amount in rows:  # names hold no comma, quote or newline
            buffer.write(f"{row_id},{name},{amount}\n")
        buffer.seek(0)
        conn = psycopg2.connect(dsn)
        try:
            with conn.cursor() as cur:
                cur.copy_expert(COPY, buffer)
            conn.commit()
        finally:
            conn.close()

    return write


@dataclass(frozen=True)
class Sink:
    key: str
    label: str
    redis: bool
    run: Callable[[Env, DataFrame], None]


def _plain(make: Callable[[str], Callable[[Iterator[Any]], None]]) -> Callable[..., None]:
    def run(env: Env, df: DataFrame) -> None:
        df.foreachPartition(make(env.data_dsn))

    return run


def _twopc(with_redis: bool, arrow: bool = False) -> Callable[..., None]:
    def run(env: Env, df: DataFrame) -> None:
        options = {**env.twopc_options(with_redis), "arrow": str(arrow).lower()}
        df.write.format("twopc").options(**options).mode("append").save()

    return run


SINKS = [
    Sink("ev", "plain foreachPartition (execute_values)", False, _plain(execute_values_sink)),
    Sink("copy", "plain foreachPartition (COPY)", False, _plain(copy_sink)),
    Sink("twopc", "twopc -> PostgreSQL", False, _twopc(False)),
    Sink("twopc-arrow", "twopc -> PostgreSQL (arrow=true)", False, _twopc(False, arrow=True)),
    Sink("twopc+r", "twopc -> PostgreSQL + Redis", True, _twopc(True)),
]
SINK = {s.key: s for s in SINKS}


# -- running and checking --------------------------------------------------------------------------


def reset(env: Env) -> None:
    with contextlib.closing(psycopg2.connect(env.data_dsn)) as conn:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"TRUNCATE {TABLE}")
            cur.execute("CHECKPOINT")  # every row starts from the same clean WAL position
    with contextlib.closing(redis.Redis.from_url(env.redis_url)) as client:
        client.flushdb()


def verify(env: Env, sink: Sink, n: int) -> None:
    with contextlib.closing(psycopg2.connect(env.data_dsn)) as conn, conn.cursor() as cur:
        cur.execute(
            f"SELECT (SELECT count(*) FROM {TABLE}), (SELECT count(DISTINCT id) FROM {TABLE}), "
            "(SELECT count(*) FROM pg_prepared_xacts)"
        )
        row = cur.fetchone()
    assert row is not None
    rows, distinct, prepared = (int(v) for v in row)
    if rows != n or distinct != n:
        raise BenchError(f"{sink.label}: {rows} rows ({distinct} distinct ids), expected {n}")
    if prepared:
        raise BenchError(f"{sink.label}: {prepared} prepared transactions left")
    if sink.redis:
        with contextlib.closing(redis.Redis.from_url(env.redis_url)) as client:
            keys = sum(1 for _ in client.scan_iter("item:*", count=10_000))
            sample = client.get(f"item:{n - 1}")
        if keys != n or sample != f"name-{n - 1}".encode():
            raise BenchError(f"{sink.label}: {keys} Redis keys (item:{n - 1}={sample!r}), want {n}")


def measure(env: Env, sink: Sink, n: int) -> float:
    """Seconds for one job of ``n`` rows, after a truncate; checked afterwards."""
    reset(env)
    df = env.frame(n)
    started = time.perf_counter()
    sink.run(env, df)
    seconds = time.perf_counter() - started
    verify(env, sink, n)
    return seconds


def warm_up(env: Env) -> None:
    for sink in SINKS:
        measure(env, sink, WARMUP_ROWS)


# -- where a twopc partition's time goes (outside Spark) -------------------------------------------


class Timers:
    """Wall seconds per piece of `write_partition`, summed over calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, label: str, seconds: float) -> None:
        self.seconds[label] = self.seconds.get(label, 0.0) + seconds

    def wrap(self, owner: Any, attribute: str, label: str) -> Callable[[], None]:
        original = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.add(label, time.perf_counter() - started)

        setattr(owner, attribute, timed)
        return lambda: setattr(owner, attribute, original)


@contextlib.contextmanager
def timed_pieces(timers: Timers) -> Iterator[None]:
    from resource_managers.postgres import PostgresResource

    original_open = getattr(partition_writer, "open_targets")  # noqa: B009 (not re-exported)

    @contextlib.contextmanager
    def open_targets(config: Any) -> Iterator[Any]:
        started = time.perf_counter()
        with original_open(config) as opened:
            timers.add("open_targets (engines; connects lazily)", time.perf_counter() - started)
            yield opened

    setattr(partition_writer, "open_targets", open_targets)  # noqa: B010
    undo = [
        lambda: setattr(partition_writer, "open_targets", original_open),
        timers.wrap(partition_writer, "committed", "committed() (decision log reads, x2)"),
        timers.wrap(PostgresResource, "start", "PostgresResource.start (connect, BEGIN)"),
        timers.wrap(partition_writer, "_write_postgres", "_write_postgres (per chunk)"),
        timers.wrap(PostgresResource, "prepare", "PostgresResource.prepare (PREPARE)"),
    ]
    try:
        yield
    finally:
        for restore in reversed(undo):
            restore()


def partition_rows(n: int) -> list[dict[str, Any]]:
    return [{"id": i, "name": f"name-{i}", "amount": (i * 7919) % 100000} for i in range(n)]


def rollback_prepared(env: Env) -> None:
    with contextlib.closing(psycopg2.connect(env.data_dsn)) as conn:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")
            for (gid,) in cur.fetchall():
                cur.execute("ROLLBACK PREPARED %s", (gid,))


def profile_partition(env: Env, n: int) -> None:
    """One partition's rows through `write_partition` (PostgreSQL only) with its pieces timed,
    next to the same rows through execute_values and COPY, all outside Spark."""
    rows = partition_rows(n)
    tuples = [(r["id"], r["name"], r["amount"]) for r in rows]
    reset(env)
    plain: dict[str, float] = {}
    for key, make in (("ev", execute_values_sink), ("copy", copy_sink)):
        started = time.perf_counter()
        make(env.data_dsn)(iter(tuples))
        plain[key] = time.perf_counter() - started
    options = env.twopc_options(with_redis=False)
    gtrid = f"bench-{uuid.uuid4().hex[:12]}"
    partition_writer.write_partition(  # once untimed: imports, first connections
        options, rows[:100], partition=0, attempt=0, task_attempt_id=0, gtrid=gtrid
    )
    rollback_prepared(env)
    timers = Timers()
    with timed_pieces(timers):
        started = time.perf_counter()
        message = partition_writer.write_partition(
            options, iter(rows), partition=1, attempt=0, task_attempt_id=1, gtrid=gtrid
        )
        total = time.perf_counter() - started
    rollback_prepared(env)
    if message.rows != n:
        raise BenchError(f"profile: write_partition wrote {message.rows} rows, expected {n}")
    print(f"\none partition outside Spark ({n:,} rows, already Python dicts/tuples):")
    print(f"  {'execute_values (plain baseline)':<48} {plain['ev']:>7.3f} s")
    print(f"  {'COPY (plain)':<48} {plain['copy']:>7.3f} s")
    print(f"  {'twopc write_partition, total':<48} {total:>7.3f} s")
    for label, seconds in timers.seconds.items():
        print(f"    {label:<46} {seconds:>7.3f} s  {seconds / total:>4.0%}")
    other = total - sum(timers.seconds.values())
    print(f"    {'rest (chunking, branch ids, bookkeeping)':<46} {other:>7.3f} s")


# -- reporting -------------------------------------------------------------------------------------


def print_table(results: dict[str, list[float]], n: int, rounds: int) -> None:
    base = n / median(results[BASELINE])
    spread = "  s min-max" if rounds > 1 else ""
    print(f"{'sink':<42} {'rows':>10} {'seconds':>8} {'rows/s':>9} {'x ev':>6}{spread}")
    for sink in SINKS:
        runs = results[sink.key]
        seconds = median(runs)
        line = (
            f"{sink.label:<42} {n:>10,} {seconds:>8.2f} {n / seconds:>9,.0f} "
            f"{n / seconds / base:>5.2f}x"
        )
        if rounds > 1:
            line += f"  {min(runs):.2f}-{max(runs):.2f}"
        print(line)


def verdict(results: dict[str, list[float]], n: int) -> bool:
    got = median(results[BASELINE]) / median(results["twopc"])
    met = got >= TARGET
    print(
        f"\n[{'MET   ' if met else 'MISSED'}] twopc -> PostgreSQL vs plain execute_values: "
        f"{got:.2f}x (target >= {TARGET:.2f}x)"
    )
    both = median(results[BASELINE]) / median(results["twopc+r"])
    copy = median(results[BASELINE]) / median(results["copy"])
    print(f"context: twopc -> PostgreSQL + Redis {both:.2f}x; plain COPY {copy:.2f}x")
    return met


def context(env: Env, cores: int) -> None:
    with contextlib.closing(psycopg2.connect(env.data_dsn)) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT version(), current_setting('fsync'), current_setting('synchronous_commit'), "
            "current_setting('max_prepared_transactions')"
        )
        row = cur.fetchone()
    assert row is not None
    version, fsync, sync_commit, max_prepared = row
    import pyspark

    print(f"python {sys.version.split()[0]}, {platform.platform()}, {os.cpu_count()} CPUs")
    print(
        f"{str(version).split(',')[0]}; fsync={fsync}, synchronous_commit={sync_commit}, "
        f"max_prepared_transactions={max_prepared}"
    )
    print(
        f"pyspark {pyspark.__version__}, master local[{cores}], {env.partitions} partitions; "
        f"twopc CHUNK_ROWS={partition_writer.CHUNK_ROWS}"
    )


# -- setup and main --------------------------------------------------------------------------------


def session(cores: int, partitions: int, warehouse: Path) -> SparkSession:
    spark = (
        SparkSession.builder.master(f"local[{cores}]")
        .appName("twopc-bench-spark-sink")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(partitions))
        .config("spark.default.parallelism", str(partitions))
        .config("spark.sql.warehouse.dir", str(warehouse))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def libpq_dsn(server: PostgresServer, database: str) -> str:
    return f"host=127.0.0.1 port={server.port} user=postgres dbname={database}"


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows per job (1,000,000)")
    parser.add_argument("--quick", action="store_true", help="100,000 rows")
    parser.add_argument("--partitions", type=int, default=4, help="Spark partitions (4)")
    parser.add_argument("--cores", type=int, default=0, help="local[N] (default: CPU count)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat, report medians (1)")
    parser.add_argument("--profile", action="store_true", help="always profile a partition")
    return parser.parse_args()


def main() -> None:
    args = parse()
    n = 100_000 if args.quick else args.rows
    cores = args.cores or os.cpu_count() or 2
    # every partition's branch may be prepared at once, plus the driver's ledger branch
    server = PostgresServer(max_prepared_transactions=max(64, 2 * args.partitions + 8)).start()
    redis_server = RedisServer().start()
    try:
        data, log = server.create_database("bench_data"), server.create_database("bench_log")
        with contextlib.closing(psycopg2.connect(libpq_dsn(server, data))) as conn:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(DDL)
        spark = session(cores, args.partitions, server.directory / "warehouse")
        try:
            env = Env(
                spark,
                libpq_dsn(server, data),
                server.url(data),
                server.url(log),
                redis_server.url(),
                args.partitions,
            )
            context(env, cores)
            warm_up(env)
            print(f"warmed up: one {WARMUP_ROWS:,}-row write per sink\n")
            results: dict[str, list[float]] = {}
            for round_ in range(args.rounds):
                for sink in SINKS if round_ % 2 == 0 else SINKS[::-1]:
                    results.setdefault(sink.key, []).append(measure(env, sink, n))
            print_table(results, n, args.rounds)
            print("verified: every row once in PostgreSQL (and Redis), no prepared transaction")
            met = verdict(results, n)
            if args.profile or not met:
                profile_partition(env, n // args.partitions)
        finally:
            spark.stop()
    finally:
        redis_server.remove()
        server.remove()
        shutil.rmtree(server.directory, ignore_errors=True)


if __name__ == "__main__":
    main()
