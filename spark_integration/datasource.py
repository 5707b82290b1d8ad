"""The ``twopc`` Python Data Source: Spark's own write path wired to the twopc commit protocol.

Why a Data Source and not ``foreachPartition``: only a Data Source gets Spark's two-phase write
(``write`` per task attempt on executors, then one ``commit`` or ``abort`` on the driver with the
message of the attempt Spark chose per partition). That is exactly the shape of
`spark_integration.partition_writer` (prepare, never commit) and `spark_integration.driver_commit`
(decide once, roll back every other attempt by prefix), so this module is only wiring:

- Options are parsed in ``writer()``/``streamWriter()`` on the driver, so a missing option or an
  unknown target fails the job before any task runs, with the `coordinator.ConfigurationError`
  text in the error Spark shows.
- Batch: the gtrid is made once in ``writer()`` (``appId`` + ``txnVersion``, or a fresh uuid: then
  exactly once within this job, not across a manual re-run) and kept on the writer object, which
  Spark pickles once and hands unchanged to every task and to ``commit``/``abort``.
- Streaming: Spark rebuilds the stream writer per micro-batch and again in the process that runs
  ``commit``, so nothing is kept between calls: executors read the batch id from the task's local
  property ``streaming.sql.batchId`` and ``commit``/``abort`` get it as ``batchId``; the gtrid is a
  function of ``appId`` and the batch id alone, so a replayed batch is recognised.
- ``write`` never returns None (Spark fails such a task); ``abort`` never trusts its message
  list (slots may be None, other attempts are unknown to Spark) and rolls back by gtrid prefix.
- Only ``append``: ``overwrite`` would need a delete that is part of the same decision, which
  the targets do not offer, so it is refused rather than silently appended.

Rows reach the partition writer as dicts: ``RecordBatch.to_pylist()`` from a
``DataSourceArrowWriter`` (Spark then ships columnar batches to the Python worker instead of
pickled rows; `bench/spark_sink.py` measures both), or ``Row.asDict()``. A batch write takes Arrow
by default wherever both give the same values (`arrow_choice` decides from the schema and logs
why when it does not), or as the option ``arrow`` says; a stream always takes Rows (Spark has no
Arrow stream writer).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamWriter,
    DataSourceWriter,
    WriterCommitMessage,
)

from coordinator import ConfigurationError

from . import driver_commit
from .arrow_choice import use_arrow
from .ids import make_gtrid
from .partition_writer import CommitMessage, new_run, write_partition
from .targets import parse_options

if TYPE_CHECKING:
    from pyarrow import RecordBatch  # type: ignore[import-untyped]
    from pyspark.sql import Row
    from pyspark.sql.types import StructType

NAME = "twopc"
BATCH_ID_PROPERTY = "streaming.sql.batchId"


@dataclass(frozen=True)
class TwopcCommitMessage(WriterCommitMessage):
    """Spark's envelope around one task attempt's `CommitMessage` (pickled to the driver)."""

    message: CommitMessage


def _refuse_overwrite(overwrite: bool) -> None:
    if overwrite:
        raise ConfigurationError(
            "the twopc data source only appends: use mode('append') (overwrite would need a "
            "delete inside the same transaction, which it does not do)"
        )


def _task() -> TaskContext:
    context = TaskContext.get()
    if context is None:  # write() runs only inside a Spark task
        raise RuntimeError("twopc write() called outside a Spark task")
    return context


def _rows(iterator: Iterator[Row]) -> Iterator[dict[str, Any]]:
    return (row.asDict() for row in iterator)


def unwrap(messages: list[WriterCommitMessage | None]) -> list[CommitMessage | None]:
    """Spark's commit messages back to ours; a None slot (a partition Spark has no message
    for) stays None, in place."""
    unwrapped: list[CommitMessage | None] = []
    for message in messages:
        if message is None:
            unwrapped.append(None)
        elif isinstance(message, TwopcCommitMessage):
            unwrapped.append(message.message)
        else:
            raise TypeError(f"not a twopc commit message: {type(message).__name__}")
    return unwrapped


class TwopcBatchWriter(DataSourceWriter):
    """A batch write: one gtrid for the whole job, made on the driver, pickled everywhere."""

    def __init__(self, options: Mapping[str, str], gtrid: str) -> None:
        self.options = dict(options)
        self.gtrid = gtrid
        self.run = new_run()

    def write(self, iterator: Iterator[Row]) -> WriterCommitMessage:
        context = _task()
        message = write_partition(
            self.options,
            _rows(iterator),
            partition=context.partitionId(),
            attempt=context.attemptNumber(),
            task_attempt_id=context.taskAttemptId(),
            gtrid=self.gtrid,
            run=self.run,
        )
        return TwopcCommitMessage(message)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        driver_commit.commit(self.options, unwrap(messages), gtrid=self.gtrid)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        driver_commit.abort(self.options, unwrap(messages), gtrid=self.gtrid)


class TwopcArrowBatchWriter(TwopcBatchWriter, DataSourceArrowWriter):
    """The batch write fed with Arrow record batches (the default where `arrow_choice` allows,
    or option ``arrow=true``)."""

    def write(self, iterator: Iterator[RecordBatch]) -> WriterCommitMessage:
        context = _task()
        message = write_partition(
            self.options,
            (row for batch in iterator for row in batch.to_pylist()),
            partition=context.partitionId(),
            attempt=context.attemptNumber(),
            task_attempt_id=context.taskAttemptId(),
            gtrid=self.gtrid,
            run=self.run,
        )
        return TwopcCommitMessage(message)


class TwopcStreamWriter(DataSourceStreamWriter):
    """A micro-batch write: the gtrid comes from ``appId`` and the batch id, nothing is kept."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self.options = dict(options)
        self.run = new_run()

    def write(self, iterator: Iterator[Row]) -> WriterCommitMessage:
        context = _task()
        batch = context.getLocalProperty(BATCH_ID_PROPERTY)
        if batch is None:
            raise RuntimeError(f"no local property {BATCH_ID_PROPERTY!r}: not a streaming task")
        message = write_partition(
            self.options,
            _rows(iterator),
            partition=context.partitionId(),
            attempt=context.attemptNumber(),
            task_attempt_id=context.taskAttemptId(),
            batch_id=int(batch),
            run=self.run,
        )
        return TwopcCommitMessage(message)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        driver_commit.commit(self.options, unwrap(messages), batch_id=batchId)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        driver_commit.abort(self.options, unwrap(messages), batch_id=batchId)


class TwopcDataSource(DataSource):
    """``df.write.format("twopc")`` and ``df.writeStream.format("twopc")``; options in
    `spark_integration.targets`."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        _refuse_overwrite(overwrite)
        options = dict(self.options)
        config = parse_options(options)
        gtrid = make_gtrid(config.app_id, txn_version=config.txn_version, node=config.log.node)
        if use_arrow(config.arrow, schema):
            return TwopcArrowBatchWriter(options, gtrid)
        return TwopcBatchWriter(options, gtrid)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        _refuse_overwrite(overwrite)
        options = dict(self.options)
        config = parse_options(options)
        if config.txn_version is not None:
            raise ConfigurationError(
                "option 'txnVersion' is for batch writes; a streaming write is keyed by its "
                "micro-batch id (keep 'appId' stable across restarts of the query)"
            )
        if config.arrow:  # refused rather than ignored: the user asked for a path not taken
            raise ConfigurationError(
                "option 'arrow' is for batch writes; a streaming write takes Rows (remove it)"
            )
        return TwopcStreamWriter(options)
