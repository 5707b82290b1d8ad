"""The Spark driver the crash tests kill: its own SparkSession, one write, then it exits.

    python tests/spark/driver_worker.py stream OPTIONS_JSON SOURCE_DIR CHECKPOINT_DIR
    python tests/spark/driver_worker.py kill-executor OPTIONS_JSON MARKER_FILE
    python tests/spark/driver_worker.py save OPTIONS_JSON

Why a separate process: a driver crash must take down a whole driver — its JVM, the Python
workers that JVM forks for ``commit`` and the tasks — and nothing of the test's own process. The
test starts this script in a new session (process group) and kills the group, or arms
``TWOPC_CRASH_AT`` (`coordinator.crashpoints`) in its environment, which every Python worker of
this driver inherits from the JVM.

``stream``: a Structured Streaming query from the CSV directory ``SOURCE_DIR`` (one file per
micro-batch, ``maxFilesPerTrigger=1``, ``availableNow``) into ``format("twopc")`` with the
options in ``OPTIONS_JSON``, on ``local[2,2]``. Prints ``STARTED``, then ``DONE <batch ids in
commits/>`` when the query ended normally; a failed query prints ``FAILED <error>`` and exits 3.

``kill-executor``: a batch write of ids 0..999 in 4 partitions on ``local-cluster[2,1,1024]``
(two executor JVMs). The first attempt of partition 1 prepares its branches, records their gids
in ``MARKER_FILE`` and then SIGKILLs its own executor JVM, as a lost executor would die: Spark
must retry the task on the other executor. Prints ``DONE``.

``save``: ids 0..999 in 4 partitions through `spark_integration.save` (RDD tasks) on
``local[2,2]``, whose commit runs in this very process. Prints ``STARTED``, then ``DONE
<outcome> <fresh|replay>``.

Output lines are flushed at once, so a SIGKILL loses nothing printed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

from pyspark import TaskContext
from pyspark.sql import SparkSession

import spark_integration
from spark_integration import register
from spark_integration.datasource import TwopcBatchWriter, TwopcCommitMessage, TwopcDataSource

if TYPE_CHECKING:
    from pyspark.sql import Row
    from pyspark.sql.datasource import DataSourceWriter, WriterCommitMessage
    from pyspark.sql.types import StructType

N = 1000
PARTS = 4


STARTED_AT = time.monotonic()


def say(line: str) -> None:
    """One line on stdout, flushed, with the seconds since this process started (on stderr)."""
    print(line, flush=True)
    print(
        f"driver_worker: {time.monotonic() - STARTED_AT:.1f}s {line}", file=sys.stderr, flush=True
    )


def session(master: str, name: str) -> SparkSession:
    spark = (
        SparkSession.builder.master(master)
        .appName(name)
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.streaming.stopTimeout", "5s")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def stream(options: dict[str, str], source: str, checkpoint: str) -> int:
    spark = session("local[2,2]", "twopc-crash-stream")
    say("STARTED")
    query = (
        spark.readStream.schema("id INT, name STRING")
        .option("maxFilesPerTrigger", 1)
        .csv(source)
        .writeStream.trigger(availableNow=True)
        .format("twopc")
        .options(**options)
        .option("checkpointLocation", checkpoint)
        .start()
    )
    try:
        query.awaitTermination()
    except Exception as exc:
        say(f"FAILED {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return 3
    commits = sorted(int(p) for p in os.listdir(Path(checkpoint) / "commits") if p.isdigit())
    say(f"DONE {' '.join(map(str, commits))}")
    spark.stop()
    return 0


# -- kill-executor --------------------------------------------------------------------------------


def executor_jvm() -> int:
    """The pid of the executor JVM above this Python worker (worker <- daemon <- java)."""
    pid = os.getppid()
    while pid > 1:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        if comm == "java":
            return pid
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4, after the "(comm)"
    raise RuntimeError("no java process above this Python worker")


class KillExecutorWriter(TwopcBatchWriter):
    """Partition 1's first attempt prepares, writes its gids to the marker, then kills the
    executor JVM it runs under: its branches stay prepared, Spark hears only 'executor lost'."""

    def __init__(self, inner: TwopcBatchWriter, marker: str) -> None:
        super().__init__(inner.options, inner.gtrid)
        self.marker = marker

    def write(self, iterator: Iterator[Row]) -> WriterCommitMessage:
        result = super().write(iterator)
        context = TaskContext.get()
        assert context is not None and isinstance(result, TwopcCommitMessage)
        if context.partitionId() == 1 and context.attemptNumber() == 0:
            jvm = executor_jvm()
            record = {"branches": result.message.branches, "jvm": jvm, "worker": os.getpid()}
            Path(self.marker).write_text(json.dumps(record))
            os.kill(jvm, signal.SIGKILL)
            time.sleep(30)  # the daemon notices its JVM is gone and ends us; never return
            os._exit(1)
        return result


class KillExecutor(TwopcDataSource):
    @classmethod
    def name(cls) -> str:
        return "twopc_kill_executor"

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        marker = self.options.pop("test.marker")
        inner = super().writer(schema, overwrite)
        assert isinstance(inner, TwopcBatchWriter)
        return KillExecutorWriter(inner, marker)


def kill_executor(options: dict[str, str], marker: str) -> int:
    spark = session("local-cluster[2,1,1024]", "twopc-crash-executor")
    spark.dataSource.register(KillExecutor)
    say("STARTED")
    df = spark.range(0, N, numPartitions=PARTS).selectExpr(
        "CAST(id AS INT) AS id", "CONCAT('n', CAST(id AS STRING)) AS name"
    )
    df.write.format(KillExecutor.name()).options(**options).option("test.marker", marker).mode(
        "append"
    ).save()
    say("DONE")
    spark.stop()
    return 0


def save(options: dict[str, str]) -> int:
    spark = session("local[2,2]", "twopc-crash-save")
    say("STARTED")
    df = spark.range(0, N, numPartitions=PARTS).selectExpr(
        "CAST(id AS INT) AS id", "CONCAT('n', CAST(id AS STRING)) AS name"
    )
    report = spark_integration.save(df, options)
    say(f"DONE {report.outcome} {'replay' if report.replay else 'fresh'}")
    spark.stop()
    return 0


def main(argv: list[str]) -> int:
    mode, options_file, *rest = argv
    options: dict[str, Any] = json.loads(Path(options_file).read_text())
    if mode == "stream":
        return stream(options, *rest)
    if mode == "kill-executor":
        return kill_executor(options, *rest)
    if mode == "save":
        return save(options)
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
