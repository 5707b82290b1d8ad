"""One SparkSession for every Spark test of a run, on loopback only, with one retry per task.

Why one: starting the JVM costs 5-8 s and the first Python Data Source write another ~4 s of
cold Python workers, so a session per test would dominate the suite. Why ``local[2,2]``: two
cores, and ``spark.task.maxFailures`` 2 (``local[N]`` ignores that setting), so a test can make
a first attempt fail and watch Spark retry it once. The environment is set at import, before any
JVM starts: workers must run this interpreter (the venv, with pyarrow and this repository
installed; test modules that ship functions or classes to executors register themselves with
``cloudpickle.register_pickle_by_value``, since pytest imports them under names the workers
cannot), and ``SPARK_LOCAL_IP`` keeps Spark off the machine's public address.

Without pyspark or java the tests skip; under ``CI=true`` they fail instead, like the servers.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def _unavailable(message: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    if importlib.util.find_spec("pyspark") is None:
        _unavailable("pyspark is not installed: pip install -e '.[spark]'")
    if not (os.environ.get("JAVA_HOME") or shutil.which("java")):
        _unavailable("no Java runtime (java on PATH or JAVA_HOME): run tools/ensure-servers.sh")
    from pyspark.sql import SparkSession

    from spark_integration import register

    session = (
        SparkSession.builder.master("local[2,2]")
        .appName("twopc-tests")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.warehouse.dir", str(tmp_path_factory.mktemp("warehouse")))
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    yield session
    session.stop()
