"""twopc for Spark writers: exactly-once writes of DataFrame rows into PostgreSQL, Redis and the
message log, on Spark's own two-phase write path, importable and testable without Spark.

Executors call `write_partition` (write and prepare, one branch per task attempt and target); the
driver calls `commit` or `abort` with the commit messages; `recovery_manager` finishes what a
crashed driver left. `spark_integration.datasource` wires these to Spark's ``write``/``commit``/
``abort`` (``format("twopc")``, batch and streaming), `spark_integration.foreach_batch` to
``foreachBatch``, and `spark_integration.rdd_write` (``save(df, options)``) to RDD tasks, whose
fixed cost per partition is lower; those names (``TwopcDataSource``, ``foreach_batch_writer``,
``save``) are importable from here but loaded on first use, so nothing else needs pyspark.

`register` lives here and only here (``from spark_integration import register``): one import
path for the call every job makes first.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from .driver_commit import CommitReport, abort, commit
from .ids import make_gtrid
from .partition_writer import CommitMessage, StaleAttemptError, new_run, write_partition
from .recovery import recovery_manager
from .targets import WriteConfig, parse_options

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from .rdd_write import save as save  # typed for callers; loaded on first use

__all__ = [
    "CommitMessage",
    "CommitReport",
    "StaleAttemptError",
    "WriteConfig",
    "abort",
    "commit",
    "make_gtrid",
    "new_run",
    "parse_options",
    "recovery_manager",
    "register",
    "write_partition",
]

_SPARK_ONLY = {
    "TwopcDataSource": "datasource",
    "foreach_batch_writer": "foreach_batch",
    "save": "rdd_write",
}


def register(spark: SparkSession) -> None:
    """Make ``format("twopc")`` known to ``spark``: once per session, before the first write
    (`foreach_batch_writer` registers it on the micro-batch's session itself)."""
    from .datasource import TwopcDataSource  # noqa: PLC0415 - pyspark only when Spark is there

    spark.dataSource.register(TwopcDataSource)


def __getattr__(name: str) -> object:
    """The pyspark-facing names, imported on first use so the protocol needs no pyspark."""
    module = _SPARK_ONLY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)
