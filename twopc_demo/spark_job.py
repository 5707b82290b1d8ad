"""The Spark demo's driver, the process the demo kills (``python -m twopc_demo.spark_job``, its spec
on stdin), and the facts it shares with the parent."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

APP_ID = "demo"
NODE = "spark"  # log.node's default: the gtrids are spark:demo:<batch id>
TABLE = "items"
BATCHES, PER_BATCH = 3, 100
CRASH_POINT = "spark.driver_after_commit"
# the point counts hits per process and Spark reuses the idle commit worker for the next
# micro-batch, so the second hit is batch 1's commit
CRASH_AT = f"{CRASH_POINT}:2"
REPLAYED = 1
LEASE_SECONDS = 3  # a killed commit worker holds the node's lease this long
CHILD_TIMEOUT = 90.0
MASTER = "local[2,2]"


# -- the driver that crashes (child process) ---------------------------------------------------


def _say(line: str) -> None:
    print(line, flush=True)


def run_child(spec: dict[str, Any]) -> int:
    """One streaming query over the CSV directory, until it has drained it (``availableNow``)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession  # noqa: PLC0415

    from twopc_demo.spark_source import ReportingDataSource  # noqa: PLC0415

    spark = (
        SparkSession.builder.master(MASTER)
        .appName("twopc-demo")
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
    # format("twopc"), each commit telling on stderr what it did (twopc_demo.spark_source)
    spark.dataSource.register(ReportingDataSource)
    _say("STARTED")
    query = (
        spark.readStream.schema("id INT, name STRING")
        .option("maxFilesPerTrigger", 1)
        .csv(spec["source"])
        .writeStream.trigger(availableNow=True)
        .format("twopc")
        .options(**spec["options"])
        .option("checkpointLocation", spec["checkpoint"])
        .start()
    )
    try:
        query.awaitTermination()
    except Exception as exc:
        _say(f"FAILED {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return 3
    finally:
        spark.stop()
    _say("DONE")
    return 0


def main() -> int:
    return run_child(json.load(sys.stdin))


if __name__ == "__main__":
    raise SystemExit(main())
