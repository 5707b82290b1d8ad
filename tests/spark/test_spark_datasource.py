"""The ``twopc`` data source under real Spark, PostgreSQL and Redis: Spark chooses the attempts,
retries the failed ones and calls ``commit``/``abort`` itself; the tests check what is left in
the databases: every row once, nothing prepared, nothing at all after a failed job.

One SparkSession serves the whole file (tests/spark/conftest.py); the first write pays for cold
Python workers (~4 s)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import text

from coordinator import ConfigurationError
from messaging.auth import SharedSecret
from messaging.connection import Listener
from messaging.remote import PRODUCER_ROLE, ProducerService
from resource_managers.message_log import MessageLog
from tests.support.spark_stores import SparkStores, spark_stores

if importlib.util.find_spec("pyspark") is None:  # under CI a missing pyspark must not pass
    if os.environ.get("CI", "").lower() == "true":
        raise RuntimeError("pyspark is not installed: pip install -e '.[spark]'")
    pytest.skip("pyspark is not installed", allow_module_level=True)

from pyspark import TaskContext, cloudpickle
from pyspark.sql import functions as F
from pyspark.sql.datasource import DataSourceWriter, WriterCommitMessage
from pyspark.sql.types import IntegerType, StructType

from spark_integration.datasource import (
    TwopcBatchWriter,
    TwopcCommitMessage,
    TwopcDataSource,
)
from spark_integration.foreach_batch import foreach_batch_writer

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Row, SparkSession

pytestmark = pytest.mark.spark
# executors cannot import this module by the name pytest gave it: ship its code by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]

N = 1000
PARTS = 4


class Env(SparkStores):
    def ids(self, table: str = "items") -> list[int]:
        with self.data.connect() as conn:
            return [int(i) for i in conn.execute(text(f"SELECT id FROM {table} ORDER BY id"))]

    def expect_exactly_once(self, n: int = N, redis_too: bool = True) -> None:
        assert self.rows() == [(i, f"n{i}") for i in range(n)]
        if redis_too:
            assert self.redis_items() == {f"item:{i}": f"n{i}" for i in range(n)}
        assert self.prepared() == []


@pytest.fixture
def env(make_pg_database: Callable[[], str], redis_url: str) -> Iterator[Env]:
    with spark_stores(Env, make_pg_database, redis_url, **{"log.acquire_timeout": "20"}) as e:
        yield e


def items(spark: SparkSession, n: int = N, parts: int = PARTS) -> DataFrame:
    """Ids 0..n-1 in ``parts`` partitions (partition 1 of 4 holds 250..499), named ``n{id}``."""
    return spark.range(0, n, numPartitions=parts).selectExpr(
        "CAST(id AS INT) AS id", "CONCAT('n', CAST(id AS STRING)) AS name"
    )


def items_failing_once(spark: SparkSession, marker: Path) -> DataFrame:
    """`items` whose first attempt of partition 1 fails on its last row, after the writer has
    consumed the partition's other rows, and touches ``marker`` to show that it did."""

    def fail_on_first_attempt_of_partition_1(i: int) -> int:
        context = TaskContext.get()
        if context and context.partitionId() == 1 and context.attemptNumber() == 0 and i == 499:
            marker.touch()
            raise RuntimeError("injected failure on the last row of partition 1")
        return i

    fail = F.udf(fail_on_first_attempt_of_partition_1, IntegerType())
    return items(spark).withColumn("id", fail("id"))


def save(df: DataFrame, options: dict[str, str], fmt: str = "twopc") -> None:
    df.write.format(fmt).options(**options).mode("append").save()


# -- batch ----------------------------------------------------------------------------------------


def test_batch_write_exactly_once_into_postgres_and_redis(spark: SparkSession, env: Env) -> None:
    save(items(spark), env.options)
    env.expect_exactly_once()


def test_rows_asked_for_write_the_same_rows_exactly_once(spark: SparkSession, env: Env) -> None:
    """The default above takes Arrow (a flat schema); ``arrow=false`` keeps the Row path."""
    save(items(spark), {**env.options, "arrow": "false"})
    env.expect_exactly_once()


def test_batch_write_exactly_once_into_postgres_redis_and_the_message_log(
    spark: SparkSession, env: Env, tmp_path: Path
) -> None:
    """All three targets in one transaction per task: a message log server (a real listener and
    journal) receives one message per row from the executors, committed with the rows."""
    secret = "spark test secret, 32 bytes long!"
    secret_file = tmp_path / "secret"
    secret_file.write_text(secret)
    mlog = MessageLog(tmp_path / "mlog")
    listener = Listener(
        ("127.0.0.1", 0), SharedSecret(secret.encode()), "spark-log",
        {PRODUCER_ROLE: ProducerService(mlog)},
    ).start()  # fmt: skip
    try:
        host, port = listener.address
        options = {**env.options, "mlog.address": f"{host}:{port}", "mlog.destination": "items",
                   "mlog.secret_file": str(secret_file), "mlog.value": "{id}:{name}"}  # fmt: skip
        save(items(spark), options)
        env.expect_exactly_once()
        bodies = sorted(m.body.decode() for _, m in mlog.pending("items"))
        assert bodies == sorted(f"{i}:n{i}" for i in range(N))
        assert mlog.prepared_gids() == []
    finally:
        listener.close()
        mlog.close()


class FailAfterPrepareWriter(TwopcBatchWriter):
    """Partition 1's first attempt prepares its branches, records them, then fails the task:
    Spark retries it and never tells the driver about the failed attempt."""

    def __init__(self, inner: TwopcBatchWriter, marker: str) -> None:
        super().__init__(inner.options, inner.gtrid)
        self.marker = marker

    def write(self, iterator: Iterator[Row]) -> WriterCommitMessage:
        result = super().write(iterator)
        context = TaskContext.get()
        assert context is not None and isinstance(result, TwopcCommitMessage)
        if context.partitionId() == 1 and context.attemptNumber() == 0:
            Path(self.marker).write_text(json.dumps(result.message.branches))
            raise RuntimeError("injected failure after prepare")
        return result


class FailAfterPrepare(TwopcDataSource):
    @classmethod
    def name(cls) -> str:
        return "twopc_fail_after_prepare"

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        marker = self.options.pop("test.marker")
        inner = super().writer(schema, overwrite)
        assert isinstance(inner, TwopcBatchWriter)
        return FailAfterPrepareWriter(inner, marker)


@pytest.mark.parametrize(
    "targets",
    [
        "pg",
        "pg+redis",  # the retry retires the failed attempt's branches, whose locks it would meet
    ],
)
def test_first_attempt_failing_after_prepare_is_retried_and_rolled_back(
    spark: SparkSession, env: Env, tmp_path: Path, targets: str
) -> None:
    spark.dataSource.register(FailAfterPrepare)
    marker = tmp_path / "failed-attempt.json"
    options = env.pg_only if targets == "pg" else env.options
    save(items(spark), {**options, "test.marker": str(marker)}, fmt=FailAfterPrepare.name())
    failed = json.loads(marker.read_text())
    assert len(failed) == len(targets.split("+"))  # attempt 0 of partition 1 did prepare
    env.expect_exactly_once(redis_too=targets != "pg")  # commit() rolled those branches back


@pytest.mark.filterwarnings("ignore:Cannot infer the eval type")
def test_first_attempt_failing_while_writing_is_retried(
    spark: SparkSession, env: Env, tmp_path: Path
) -> None:
    marker = tmp_path / "failed-attempt"
    save(items_failing_once(spark, marker), env.options)
    assert marker.exists()
    env.expect_exactly_once()


def test_rerun_with_the_same_txn_version_writes_nothing(spark: SparkSession, env: Env) -> None:
    options = {**env.options, "txnVersion": "2026-11-21"}
    save(items(spark), options)
    env.data.dispose()
    save(items(spark), options)  # the job re-run by hand: already committed, every task skips
    env.expect_exactly_once()
    save(items(spark, n=10), {**options, "txnVersion": "next"})  # a new version writes
    with env.data.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM items")).scalar_one() == N + 10


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda o: {k: v for k, v in o.items() if k != "appId"}, "appId"),
        (lambda o: {**o, "kafka.url": "localhost:9092"}, "kafka.url"),
        (lambda o: {**o, "pg.tabel": "items"}, "pg.tabel"),
    ],
    ids=["missing-appId", "unknown-target", "unknown-option"],
)
def test_bad_options_fail_the_job_naming_the_option(
    spark: SparkSession,
    env: Env,
    change: Callable[[dict[str, str]], dict[str, str]],
    named: str,
) -> None:
    with pytest.raises(Exception, match="ConfigurationError") as info:
        save(items(spark, n=10), change(env.options))
    assert repr(named) in str(info.value)
    assert env.rows() == [] and env.prepared() == []


def test_arrow_on_a_stream_is_refused_not_ignored(env: Env) -> None:
    """The Arrow writer is a batch path: a stream asking for it gets a clear error, on the
    driver, instead of silently taking Rows."""
    source = TwopcDataSource({**env.options, "arrow": "true"})
    with pytest.raises(ConfigurationError, match="'arrow' is for batch writes"):
        source.streamWriter(StructType([]), False)
    TwopcDataSource(env.options).streamWriter(StructType([]), False)  # without it: accepted


def test_overwrite_is_refused(spark: SparkSession, env: Env) -> None:
    with pytest.raises(Exception, match="only appends"):
        items(spark, n=10).write.format("twopc").options(**env.options).mode("overwrite").save()
    assert env.rows() == []


def test_constraint_violation_fails_the_job_and_leaves_nothing(
    spark: SparkSession, env: Env
) -> None:
    df = spark.range(0, N, numPartitions=PARTS).selectExpr(
        "CAST(id AS INT) AS id", "IF(id = 999, -1, 1) AS qty"
    )
    with pytest.raises(Exception, match="strict_items_qty_check"):
        save(df, {**env.pg_only, "pg.table": "strict_items"})
    assert env.ids("strict_items") == []
    assert env.prepared() == []


# -- Structured Streaming ---------------------------------------------------------------------


def csv_batches(directory: Path, batches: int = 3, per_batch: int = 100) -> int:
    """``batches`` CSV files of ids, one micro-batch each (maxFilesPerTrigger=1)."""
    directory.mkdir()
    for b in range(batches):
        ids = range(b * per_batch, (b + 1) * per_batch)
        (directory / f"part-{b}.csv").write_text("".join(f"{i},n{i}\n" for i in ids))
    return batches * per_batch


def run_available_now(spark: SparkSession, source: Path, start: Callable[[Any], Any]) -> None:
    stream = (
        spark.readStream.schema("id INT, name STRING")
        .option("maxFilesPerTrigger", 1)
        .csv(str(source))
    )
    query = start(stream.writeStream.trigger(availableNow=True))
    try:
        assert query.awaitTermination(120)
        assert query.exception() is None
    finally:
        query.stop()


def test_streaming_query_writes_every_id_once_and_a_replayed_batch_nothing(
    spark: SparkSession, env: Env, tmp_path: Path
) -> None:
    n = csv_batches(tmp_path / "in")
    checkpoint = tmp_path / "checkpoint"

    def start(writer: Any) -> Any:
        return (
            writer.format("twopc")
            .options(**env.pg_only)
            .option("checkpointLocation", str(checkpoint))
            .start()
        )

    run_available_now(spark, tmp_path / "in", start)
    env.expect_exactly_once(n, redis_too=False)
    commits = sorted(int(p) for p in os.listdir(checkpoint / "commits") if p.isdigit())
    assert commits == [0, 1, 2]
    # the driver died after the sink committed batch 2 but before Spark logged it: batch 2 is
    # run again with the same id on restart, and must write nothing
    for name in ("2", ".2.crc"):
        (checkpoint / "commits" / name).unlink(missing_ok=True)
    run_available_now(spark, tmp_path / "in", start)
    assert (checkpoint / "commits" / "2").exists()  # batch 2 did run again
    env.expect_exactly_once(n, redis_too=False)


def test_foreach_batch_writer_writes_every_id_once(
    spark: SparkSession, env: Env, tmp_path: Path
) -> None:
    n = csv_batches(tmp_path / "in")
    write_batch = foreach_batch_writer(env.options)

    def start(writer: Any) -> Any:
        return (
            writer.foreachBatch(write_batch)
            .option("checkpointLocation", str(tmp_path / "checkpoint"))
            .start()
        )

    run_available_now(spark, tmp_path / "in", start)
    env.expect_exactly_once(n)
    # a micro-batch function called again with a batch id already written does nothing
    write_batch(items(spark, n=100), 0)
    env.expect_exactly_once(n)
