"""The ``twopc`` data source as `twopc_demo.spark` runs it: unchanged, but every micro-batch's
``commit`` says on stderr what the tasks did and how the commit ended.

Why a module of its own: Spark pickles the stream writer into the Python worker that runs
``commit``, which must import its class by name; `twopc_demo.spark` itself imports pyspark
only when the demo runs. The lines start with `TAG` and hold one JSON object each: before the
commit, ``{"batch", "tasks", "skipped", "rows"}`` (tasks that wrote, tasks that found the batch
already committed, rows written); after it, ``{"batch", "replay", "committed", "rolled_back"}``
(gids this commit finished and gids it rolled back). The worker's stderr is the driver's.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from spark_integration import driver_commit
from spark_integration.datasource import TwopcDataSource, TwopcStreamWriter, unwrap

if TYPE_CHECKING:
    from pyspark.sql.datasource import DataSourceStreamWriter, WriterCommitMessage
    from pyspark.sql.types import StructType

TAG = "twopc-demo: "


def _tell(**event: Any) -> None:
    sys.stderr.write(TAG + json.dumps(event) + "\n")
    sys.stderr.flush()


class ReportingStreamWriter(TwopcStreamWriter):
    """`TwopcStreamWriter`, telling what each batch's tasks did and what its commit did."""

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        all_messages = unwrap(messages)
        unwrapped = [m for m in all_messages if m is not None]
        _tell(
            batch=batchId,
            tasks=sum(1 for m in unwrapped if not m.skipped),
            skipped=sum(1 for m in unwrapped if m.skipped),
            rows=sum(m.rows for m in unwrapped if not m.skipped),
        )
        report = driver_commit.commit(self.options, all_messages, batch_id=batchId)
        _tell(
            batch=batchId,
            replay=report.replay,
            committed=len(report.committed),
            rolled_back=len(report.rolled_back),
        )


class ReportingDataSource(TwopcDataSource):
    """``format("twopc")`` with `ReportingStreamWriter` (streaming only)."""

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        inner = super().streamWriter(schema, overwrite)
        assert isinstance(inner, TwopcStreamWriter)
        return ReportingStreamWriter(inner.options)
