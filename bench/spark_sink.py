"""Spark rows/s: the ``twopc`` data source against the sinks a user would write by hand.

One Spark job per row writes N rows (``--rows``, default 1,000,000; ``--quick`` 100,000) of
(id bigint, name text, amount bigint), computed from ``spark.range(N)`` in each of
``--partitions`` partition counts (default 4 and 64), to throwaway servers this script starts: a
PostgreSQL cluster (fsync=on, ``max_prepared_transactions`` raised to fit every partition's branch
plus the driver's ledger branch), a Redis (AOF, appendfsync always), a twopc message log served
over the network, and NATS JetStream (the server at $TWOPC_BENCH_NATS_URL or 127.0.0.1:4222, else
a private ``nats-server -js``; without one its row is skipped). Seconds are wall time of the whole
job as the application sees it: ``save()`` or ``foreachPartition`` from call to return, including
Spark's scheduling and, for twopc, the driver's commit. Rows (``--json`` ids), and why each is here:

- ``copy``: plain ``foreachPartition``, each partition streaming a CSV buffer through psycopg2's
  ``COPY FROM STDIN`` and committing: the fastest way into PostgreSQL from Python, so the ceiling
  of a plain sink, and the baseline of ``twopc-pg``. Not atomic: a failed job keeps the partitions
  that committed, and a retried task writes its rows twice.
- ``ev``: the same with ``psycopg2.extras.execute_values`` (page_size 1000).
- ``copy+redis``: ``copy`` plus a pipelined redis-py writer (``SET item:{id} {name}``, 10,000 per
  round trip): the baseline of ``twopc-pg-redis``; neither atomic nor exactly once.
- ``jetstream``: ``foreachPartition`` publishing each row to a JetStream file stream, 1000
  publishes in flight, every PubAck awaited: at-least-once, the baseline of ``twopc-mlog``.
- ``noop-ds``: a Python data source whose writer reads its Arrow batches and writes nothing:
  Spark's own cost per partition on the data source path (a write task, Arrow batches to a Python
  worker, commit messages, the driver's commit call), the floor under every ``twopc-*`` row.
- ``twopc-pg``: ``df.write.format("twopc")`` to PostgreSQL with default options (the Arrow writer
  wherever it is correct, `spark_integration.arrow_choice`); the SQL decision log lives on the
  same server in its own database. Every row exactly once whatever Spark retries.
- ``twopc-pg-arrow``: the same with ``arrow=true``; ``twopc-pg-rows``: with ``arrow=false`` (the
  Row path, the default before the Arrow writer was).
- ``twopc-pg-save``: ``spark_integration.save(df, options)``, the same write through RDD tasks
  (Rows, like ``twopc-pg-rows``), whose fixed cost per partition Spark keeps lower.
- ``twopc-pg-redis``: ``twopc-pg`` plus a Redis ``SET item:{id} {name}`` per row, in the same
  atomic decision (Redis branch with durability ``strict``).
- ``twopc-mlog``: a message-log target only (body ``{id},{name},{amount}``, as ``jetstream``'s).

Before measuring, every sink writes a small batch once, so the cost of starting Spark's Python
workers and importing the sink's modules is not measured. Before each row the stores are emptied
(a fresh stream or destination for the message sinks); after it the script checks that exactly N
rows landed in every store the sink writes, and that no prepared transaction is left, and raises
if not.

Targets (issue 21), printed per partition count as MET or MISSED: ``twopc-pg`` >= 1.0x ``copy``;
``twopc-pg-redis`` >= 0.7x ``copy+redis``; ``twopc-mlog`` >= 1.0x ``jetstream``. ``--profile``
writes one partition's worth of rows by `write_partition` outside Spark, each piece timed by
``time.perf_counter``, next to the same rows through ``execute_values`` and ``COPY``.

    python bench/spark_sink.py [--quick | --rows 1000000] [--partitions 4,64] [--cores N]
        [--rounds 1] [--sinks copy,twopc-pg,...] [--nats-url URL] [--profile] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

import messaging_baselines as nats_base  # type: ignore[import-not-found]
import psycopg2
import psycopg2.extras
import redis
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage

import spark_integration
from messaging.auth import SharedSecret
from messaging.connection import Listener
from messaging.remote import PRODUCER_ROLE, ProducerService
from resource_managers.message_log import MessageLog
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
REDIS_PIPELINE = 10_000  # SETs per round trip of the plain Redis writer
JS_WINDOW = 1000  # JetStream publishes in flight per partition
SECRET = b"spark sink bench secret, 32 bytes"
#: issue 21's targets: (sink, baseline, minimum ratio of rows/s), at every partition count
TARGETS = (("twopc-pg", "copy", 1.0), ("twopc-pg-redis", "copy+redis", 0.7),
           ("twopc-mlog", "jetstream", 1.0))  # fmt: skip


class BenchError(RuntimeError):
    """A row did not leave the stores as it should: rows missing or extra, or a prepared xact."""


@dataclass(frozen=True)
class Env:
    spark: SparkSession
    data_dsn: str  # libpq DSN of the data database (plain sinks, checks)
    data_url: str  # SQLAlchemy URL of the same (twopc)
    log_url: str  # SQLAlchemy URL of the decision log's database
    redis_url: str
    mlog: MessageLog  # served to the executors at mlog_address
    mlog_address: str
    secret_file: str
    nats_url: str | None  # None: no JetStream server, its row is skipped

    def frame(self, n: int, partitions: int) -> DataFrame:
        return self.spark.range(0, n, numPartitions=partitions).selectExpr(
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

    def mlog_options(self, destination: str) -> dict[str, str]:
        return {
            "appId": "bench-spark-sink",
            "log.url": self.log_url,
            "mlog.address": self.mlog_address,
            "mlog.destination": destination,
            "mlog.secret_file": self.secret_file,
            "mlog.value": "{id},{name},{amount}",
        }


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


def _copy(dsn: str, buffer: io.StringIO) -> None:
    buffer.seek(0)
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.copy_expert(COPY, buffer)
        conn.commit()
    finally:
        conn.close()


def copy_sink(dsn: str) -> Callable[[Iterator[Any]], None]:
    def write(rows: Iterator[Any]) -> None:
        buffer = io.StringIO()
        for row_id, name, amount in rows:  # names hold no comma, quote or newline
            buffer.write(f"{row_id},{name},{amount}\n")
        _copy(dsn, buffer)

    return write


def copy_redis_sink(dsn: str, redis_url: str) -> Callable[[Iterator[Any]], None]:
    def write(rows: Iterator[Any]) -> None:
        buffer = io.StringIO()
        client = redis.Redis.from_url(redis_url)
        try:
            pipe = client.pipeline(transaction=False)
            for row_id, name, amount in rows:
                buffer.write(f"{row_id},{name},{amount}\n")
                pipe.set(f"item:{row_id}", name)
                if len(pipe) >= REDIS_PIPELINE:
                    pipe.execute()
            pipe.execute()
        finally:
            client.close()
        _copy(dsn, buffer)

    return write


def jetstream_sink(url: str, subject: str) -> Callable[[Iterator[Any]], None]:
    def write(rows: Iterator[Any]) -> None:
        import nats

        async def publish() -> None:
            nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
            try:
                js = nc.jetstream(timeout=30.0)
                window: list[Any] = []
                for row_id, name, amount in rows:
                    window.append(js.publish(subject, f"{row_id},{name},{amount}".encode()))
                    if len(window) >= JS_WINDOW:
                        await asyncio.gather(*window)
                        window.clear()
                await asyncio.gather(*window)
            finally:
                await nc.close()

        asyncio.run(publish())

    return write


@dataclass(frozen=True)
class Sink:
    key: str  # the id in --json
    label: str
    stores: frozenset[str]  # what `verify` checks: pg, redis, nats, mlog
    run: Callable[[Env, DataFrame, str], None]  # the str: this run's stream/destination tag


def _plain(make: Callable[[str], Callable[[Iterator[Any]], None]]) -> Callable[..., None]:
    def run(env: Env, df: DataFrame, tag: str) -> None:
        df.foreachPartition(make(env.data_dsn))

    return run


def _copy_redis(env: Env, df: DataFrame, tag: str) -> None:
    df.foreachPartition(copy_redis_sink(env.data_dsn, env.redis_url))


def _jetstream(env: Env, df: DataFrame, tag: str) -> None:
    assert env.nats_url is not None
    df.foreachPartition(jetstream_sink(env.nats_url, f"bench.items.{tag}"))


def _twopc(with_redis: bool, arrow: str | None = None) -> Callable[..., None]:
    def run(env: Env, df: DataFrame, tag: str) -> None:
        options = env.twopc_options(with_redis)
        if arrow is not None:
            options["arrow"] = arrow
        df.write.format("twopc").options(**options).mode("append").save()

    return run


def _twopc_save(with_redis: bool) -> Callable[..., None]:
    def run(env: Env, df: DataFrame, tag: str) -> None:
        spark_integration.save(df, env.twopc_options(with_redis))

    return run


class _NoopWriter(DataSourceArrowWriter):
    """Reads every Arrow batch of its partition and writes nothing."""

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        for _ in iterator:
            pass
        return WriterCommitMessage()

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        pass

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        pass


class NoopSource(DataSource):
    """``noop-ds``: Spark's Python data source path with nothing behind it, the floor under
    ``twopc-pg``: a write task per partition, Arrow batches to a Python worker, commit messages
    to the driver and its commit call; what that costs per partition is Spark's, not twopc's."""

    @classmethod
    def name(cls) -> str:
        return "bench_noop"

    def writer(self, schema: Any, overwrite: bool) -> _NoopWriter:
        return _NoopWriter()


def _noop(env: Env, df: DataFrame, tag: str) -> None:
    df.write.format(NoopSource.name()).mode("append").save()


def _twopc_mlog(env: Env, df: DataFrame, tag: str) -> None:
    df.write.format("twopc").options(**env.mlog_options(f"items-{tag}")).mode("append").save()


PG, PG_REDIS = frozenset({"pg"}), frozenset({"pg", "redis"})
SINKS = [
    Sink("copy", "plain foreachPartition (COPY)", PG, _plain(copy_sink)),
    Sink("ev", "plain foreachPartition (execute_values)", PG, _plain(execute_values_sink)),
    Sink("copy+redis", "plain COPY + pipelined Redis", PG_REDIS, _copy_redis),
    Sink("jetstream", "plain JetStream publish, acked", frozenset({"nats"}), _jetstream),
    Sink("noop-ds", "Python data source writing nothing", frozenset(), _noop),
    Sink("twopc-pg", "twopc -> PostgreSQL (defaults)", PG, _twopc(False)),
    Sink("twopc-pg-arrow", "twopc -> PostgreSQL (arrow=true)", PG, _twopc(False, "true")),
    Sink("twopc-pg-rows", "twopc -> PostgreSQL (arrow=false)", PG, _twopc(False, "false")),
    Sink("twopc-pg-save", "twopc -> PostgreSQL, save() (RDD tasks)", PG, _twopc_save(False)),
    Sink("twopc-pg-redis", "twopc -> PostgreSQL + Redis", PG_REDIS, _twopc(True)),
    Sink("twopc-mlog", "twopc -> message log", frozenset({"mlog"}), _twopc_mlog),
]
SINK = {s.key: s for s in SINKS}


# -- running and checking --------------------------------------------------------------------------


def reset(env: Env, sink: Sink, tag: str) -> None:
    with contextlib.closing(psycopg2.connect(env.data_dsn)) as conn:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"TRUNCATE {TABLE}")
            cur.execute("CHECKPOINT")  # every row starts from the same clean WAL position
    with contextlib.closing(redis.Redis.from_url(env.redis_url)) as client:
        client.flushdb()
    if "nats" in sink.stores:
        assert env.nats_url is not None
        asyncio.run(_js_stream(env.nats_url, tag, create=True))


async def _js_stream(url: str, tag: str, *, create: bool) -> int:
    """Create this run's file stream, or count its messages and delete it."""
    from nats.js import api

    nc = await nats_base._nats_connect(url)
    try:
        js, name = nc.jetstream(), f"BENCH_ITEMS_{tag}"
        if create:
            await js.add_stream(
                api.StreamConfig(
                    name=name,
                    subjects=[f"bench.items.{tag}"],
                    storage=api.StorageType.FILE,
                    num_replicas=1,
                )
            )
            return 0
        count = int((await js.stream_info(name)).state.messages)
        await js.delete_stream(name)
        return count
    finally:
        await nc.close()


def verify(env: Env, sink: Sink, n: int, tag: str) -> None:
    with contextlib.closing(psycopg2.connect(env.data_dsn)) as conn, conn.cursor() as cur:
        cur.execute(
            f"SELECT (SELECT count(*) FROM {TABLE}), (SELECT count(DISTINCT id) FROM {TABLE}), "
            "(SELECT count(*) FROM pg_prepared_xacts)"
        )
        row = cur.fetchone()
    assert row is not None
    rows, distinct, prepared = (int(v) for v in row)
    want = n if "pg" in sink.stores else 0
    if rows != want or distinct != want:
        raise BenchError(f"{sink.label}: {rows} rows ({distinct} distinct ids), expected {want}")
    if prepared:
        raise BenchError(f"{sink.label}: {prepared} prepared transactions left")
    if "redis" in sink.stores:
        with contextlib.closing(redis.Redis.from_url(env.redis_url)) as client:
            keys = sum(1 for _ in client.scan_iter("item:*", count=10_000))
            sample = client.get(f"item:{n - 1}")
        if keys != n or sample != f"name-{n - 1}".encode():
            raise BenchError(f"{sink.label}: {keys} Redis keys (item:{n - 1}={sample!r}), want {n}")
    if "nats" in sink.stores:
        assert env.nats_url is not None
        count = asyncio.run(_js_stream(env.nats_url, tag, create=False))
        if count != n:
            raise BenchError(f"{sink.label}: {count} messages in the stream, expected {n}")
    if "mlog" in sink.stores:
        count = env.mlog.pending_counts().get(f"items-{tag}", 0)
        if count != n or env.mlog.prepared_gids():
            raise BenchError(f"{sink.label}: {count} messages (want {n}) or prepared ones left")


def measure(env: Env, sink: Sink, n: int, partitions: int) -> float:
    """Seconds for one job of ``n`` rows, after emptying the stores; checked afterwards."""
    tag = uuid.uuid4().hex[:12]
    reset(env, sink, tag)
    df = env.frame(n, partitions)
    started = time.perf_counter()
    sink.run(env, df, tag)
    seconds = time.perf_counter() - started
    verify(env, sink, n, tag)
    return seconds


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
    reset(env, SINK["copy"], "profile")
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

Results = dict[tuple[str, int], list[float]]  # (sink id, partitions) -> seconds per round


def rows_s(results: Results, key: str, partitions: int, n: int) -> float | None:
    runs = results.get((key, partitions))
    return n / median(runs) if runs else None


def print_table(results: Results, sinks: list[Sink], skipped: dict[str, str], *, n: int,
                partitions: int, rounds: int) -> None:  # fmt: skip
    base = rows_s(results, "copy", partitions, n)
    spread = "  s min-max" if rounds > 1 else ""
    print(f"\n{partitions} partitions, {n:,} rows")
    print(f"{'sink':<16} {'':<40} {'seconds':>8} {'rows/s':>9} {'x copy':>7}{spread}")
    for sink in sinks:
        if sink.key in skipped:
            print(f"{sink.key:<16} {sink.label:<40} skipped: {skipped[sink.key]}")
            continue
        runs = results[(sink.key, partitions)]
        rate = n / median(runs)
        ratio = f"{rate / base:>6.2f}x" if base else f"{'-':>7}"
        line = f"{sink.key:<16} {sink.label:<40} {median(runs):>8.2f} {rate:>9,.0f} {ratio}"
        if rounds > 1:
            line += f"  {min(runs):.2f}-{max(runs):.2f}"
        print(line)


def verdicts(results: Results, n: int, partition_counts: list[int]) -> list[str]:
    """One line per target of issue 21 whose two rows ran: the ratio and MET or MISSED."""
    out = []
    for partitions in partition_counts:
        for num, den, floor in TARGETS:
            a, b = rows_s(results, num, partitions, n), rows_s(results, den, partitions, n)
            if a is None or b is None:
                continue
            ok = a / b >= floor
            out.append(f"{'MET' if ok else 'MISSED':<6} {num} / {den} at {partitions} "
                       f"partitions: {a / b:.2f}x (target >= {floor:.1f}x)")  # fmt: skip
    return out


def as_json(results: Results, sinks: list[Sink], skipped: dict[str, str], n: int,
            partition_counts: list[int]) -> list[dict[str, Any]]:  # fmt: skip
    """One object per row, in ``--json``'s format (a skipped row carries ``skipped``)."""
    out: list[dict[str, Any]] = []
    for partitions in partition_counts:
        for sink in sinks:
            row: dict[str, Any] = {"sink": sink.key, "partitions": partitions, "rows": n}
            if sink.key in skipped:
                row |= {"rows_s": None, "skipped": skipped[sink.key]}
            else:
                row["rows_s"] = round(rows_s(results, sink.key, partitions, n) or 0.0, 1)
            out.append(row)
    return out


def context(env: Env, cores: int, partition_counts: list[int]) -> None:
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
        f"pyspark {pyspark.__version__}, master local[{cores}], partitions "
        f"{', '.join(map(str, partition_counts))}; twopc CHUNK_ROWS={partition_writer.CHUNK_ROWS}"
    )
    if env.nats_url:
        print(nats_base.jetstream_context(env.nats_url))


# -- setup and main --------------------------------------------------------------------------------


def session(cores: int, warehouse: Path) -> SparkSession:
    spark = (
        SparkSession.builder.master(f"local[{cores}]")
        .appName("twopc-bench-spark-sink")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.warehouse.dir", str(warehouse))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    spark.dataSource.register(NoopSource)
    return spark


def libpq_dsn(server: PostgresServer, database: str) -> str:
    return f"host=127.0.0.1 port={server.port} user=postgres dbname={database}"


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows per job (1,000,000)")
    parser.add_argument("--quick", action="store_true", help="100,000 rows")
    parser.add_argument("--partitions", default="4,64", help="Spark partition counts (4,64)")
    parser.add_argument("--cores", type=int, default=0, help="local[N] (default: CPU count)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat, report medians (1)")
    parser.add_argument("--sinks", help=f"comma-separated ids (default all: {','.join(SINK)})")
    parser.add_argument("--nats-url", help="JetStream server (default the local one, else private)")
    parser.add_argument("--profile", action="store_true", help="profile a partition outside Spark")
    parser.add_argument("--json", type=Path, help="write one object per row here")
    return parser.parse_args()


def start(stack: contextlib.ExitStack, args: argparse.Namespace, cores: int, partitions: int,
          skipped: dict[str, str]) -> Env:  # fmt: skip
    """The throwaway servers, the served message log and Spark, all undone by ``stack``."""
    # every partition's branch may be prepared at once, plus the driver's ledger branch
    server = PostgresServer(max_prepared_transactions=max(64, 2 * partitions + 8)).start()
    stack.callback(shutil.rmtree, server.directory, ignore_errors=True)
    stack.callback(server.remove)
    redis_server = RedisServer().start()
    stack.callback(redis_server.remove)
    nats_url = None
    if "jetstream" in (args.sinks or "jetstream"):
        try:
            nats_url = stack.enter_context(nats_base.jetstream_server(args.nats_url))
        except nats_base.BrokerUnavailable as exc:
            skipped["jetstream"] = str(exc)
    scratch = Path(tempfile.mkdtemp(prefix="twopc-spark-bench-"))
    stack.callback(shutil.rmtree, scratch, ignore_errors=True)
    (scratch / "secret").write_bytes(SECRET)
    mlog = MessageLog(scratch / "mlog")
    stack.callback(mlog.close)
    listener = Listener(("127.0.0.1", 0), SharedSecret(SECRET), "spark-bench-log",
                        {PRODUCER_ROLE: ProducerService(mlog)}).start()  # fmt: skip
    stack.callback(listener.close)
    data, log = server.create_database("bench_data"), server.create_database("bench_log")
    with contextlib.closing(psycopg2.connect(libpq_dsn(server, data))) as conn:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(DDL)
    spark = session(cores, server.directory / "warehouse")
    stack.callback(spark.stop)
    host, port = listener.address
    return Env(spark, libpq_dsn(server, data), server.url(data), server.url(log),
               redis_server.url(), mlog, f"{host}:{port}", str(scratch / "secret"),
               nats_url)  # fmt: skip


def main() -> None:
    args = parse()
    n = 100_000 if args.quick else args.rows
    cores = args.cores or os.cpu_count() or 2
    partition_counts = [int(p) for p in args.partitions.split(",")]
    sinks = [SINK[key] for key in args.sinks.split(",")] if args.sinks else SINKS
    skipped: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        env = start(stack, args, cores, max(partition_counts), skipped)
        context(env, cores, partition_counts)
        runnable = [s for s in sinks if s.key not in skipped]
        for sink in runnable:
            measure(env, sink, WARMUP_ROWS, partition_counts[0])
        print(f"warmed up: one {WARMUP_ROWS:,}-row write per sink")
        results: Results = {}
        for partitions in partition_counts:
            for round_ in range(args.rounds):
                for sink in runnable if round_ % 2 == 0 else runnable[::-1]:
                    seconds = measure(env, sink, n, partitions)
                    results.setdefault((sink.key, partitions), []).append(seconds)
            print_table(results, sinks, skipped, n=n, partitions=partitions, rounds=args.rounds)
        print("\nverified: every row once in each store, no prepared transaction")
        lines = verdicts(results, n, partition_counts)
        print("\n" + "\n".join(lines) if lines else "\n(no target has both its rows)")
        if args.json:
            args.json.write_text(
                json.dumps(as_json(results, sinks, skipped, n, partition_counts), indent=1) + "\n"
            )
            print(f"wrote {args.json}")
        if args.profile:
            profile_partition(env, n // partition_counts[0])


if __name__ == "__main__":
    main()
