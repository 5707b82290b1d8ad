"""``save(df, options)``: a batch write through Spark's RDD tasks instead of a Python data source.

Why a second path: Spark gives a Python data source (and any Arrow-fed Python task) a fixed cost
per partition that an RDD task does not pay. `bench/spark_sink.py` on a 2-vCPU machine, 2,560
rows in 256 partitions, a task that reads its rows and writes nothing: the data source 16-18 s,
``mapInArrow`` 17 s, ``foreachPartition`` 7 s. The difference is Spark's (about 40 ms a
partition). It pays with many small partitions (1,000,000 rows in 256: 0.90x a plain COPY sink
against the data source's 0.70x) and not with few large ones, where the data source's Arrow
batches are cheaper per row than Rows (in 64: 0.68x against 0.82x).

The protocol is the data source's, step for step, with the same functions: each task runs
`write_partition` (write, prepare, never commit) and returns its `CommitMessage`; ``collect``
brings back one message per partition, from the attempt Spark kept (a failed attempt's result
is never returned; a speculative loser's is discarded), and the driver runs `driver_commit.commit`
with them, which commits those winners and rolls back every other prepared branch of the gtrid,
found in the targets, never trusted from the list. If the job fails, `driver_commit.abort`: a
gtrid already committed rolls forward, anything else rolls back. A driver that dies in between
leaves what a crashed data-source driver leaves, and recovery settles it the same way.

What differs from ``df.write.format("twopc")``: rows reach the writer as Spark ``Row`` objects
(the data source's ``arrow=false``), so the values are the Row path's; the option ``arrow`` is
refused rather than ignored. Only batch writes: a stream keeps the data source (its batch id
comes from Spark's streaming commit protocol, which an RDD job does not have); a
``foreachBatch`` function may call `save` with ``txnVersion`` set to the batch id.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from pyspark import TaskContext

from coordinator import ConfigurationError
from coordinator.crashpoints import crash_point

from . import driver_commit
from .driver_commit import CommitReport
from .ids import make_gtrid
from .partition_writer import CommitMessage, new_run, write_partition
from .targets import parse_options

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Row

log = logging.getLogger("twopc.spark.save")


def save(df: DataFrame, options: Mapping[str, str]) -> CommitReport:
    """Write ``df``'s rows into the targets of ``options`` (the data source's, `targets`)
    exactly once; the driver's report. Options are checked before any task runs."""
    given = {str(k): str(v) for k, v in options.items()}
    if any(k.lower() == "arrow" for k in given):
        raise ConfigurationError(
            "option 'arrow' belongs to the data source: save() always reads Rows "
            "(use df.write.format('twopc') for Arrow batches)"
        )
    config = parse_options(given)
    gtrid = make_gtrid(config.app_id, txn_version=config.txn_version, node=config.log.node)
    run = new_run()

    def task(partition: int, rows: Iterable[Row]) -> Iterator[CommitMessage]:
        context = TaskContext.get()
        if context is None:  # only inside a Spark task
            raise RuntimeError("twopc save() task outside a Spark task")
        attempt = context.attemptNumber()
        message = write_partition(
            given,
            (row.asDict() for row in rows),
            partition=context.partitionId(),
            attempt=attempt,
            task_attempt_id=context.taskAttemptId(),
            gtrid=gtrid,
            run=run,
        )
        # prepared, and Spark does not know it yet: a worker lost here leaves branches that
        # the retry retires (or the driver's commit sweeps); named per attempt so a test can
        # kill first attempts only and let their retries through
        crash_point(f"spark.save.after_prepare.{attempt}")
        yield message

    try:
        messages: list[CommitMessage] = df.rdd.mapPartitionsWithIndex(task).collect()
    except BaseException:
        try:
            driver_commit.abort(given, [], gtrid=gtrid)
        except Exception:  # the job's own error is the one to raise; recovery finishes this
            log.exception("%s: the failed job's branches were not rolled back", gtrid)
        raise
    return driver_commit.commit(given, list(messages), gtrid=gtrid)
