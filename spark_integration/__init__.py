"""twopc for Spark writers: exactly-once writes of DataFrame rows into PostgreSQL, Redis and the
message log, on Spark's own two-phase write path, importable and testable without Spark.

Executors call `write_partition` (write and prepare, one branch per task attempt and target); the
driver calls `commit` or `abort` with the commit messages; `recovery_manager` finishes what a
crashed driver left. A ``pyspark.sql.datasource.DataSource`` only has to wire these to Spark's
``write``/``commit``/``abort`` (see docs in each module).
"""

from .driver_commit import CommitReport, abort, commit
from .ids import make_gtrid
from .partition_writer import CommitMessage, write_partition
from .recovery import recovery_manager
from .targets import WriteConfig, parse_options

__all__ = [
    "CommitMessage",
    "CommitReport",
    "WriteConfig",
    "abort",
    "commit",
    "make_gtrid",
    "parse_options",
    "recovery_manager",
    "write_partition",
]
