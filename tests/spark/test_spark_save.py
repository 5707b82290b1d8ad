"""`spark_integration.save` (RDD tasks) under real Spark, PostgreSQL and Redis: the same
guarantees as the data source, through Spark's retries and a failed job."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from sqlalchemy import text

from coordinator import ConfigurationError

if importlib.util.find_spec("pyspark") is None:  # under CI a missing pyspark must not pass
    if os.environ.get("CI", "").lower() == "true":
        raise RuntimeError("pyspark is not installed: pip install -e '.[spark]'")
    pytest.skip("pyspark is not installed", allow_module_level=True)

from pyspark import cloudpickle

from spark_integration import save
from tests.spark.test_spark_datasource import PARTS, Env, N, env, items, items_failing_once

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]
__all__ = ["env"]  # the fixture, imported for this module's tests


def test_save_writes_every_row_once_into_postgres_and_redis(spark: SparkSession, env: Env) -> None:
    report = save(items(spark), env.options)
    assert (report.outcome, report.replay) == ("committed", False)
    assert len(report.committed) == 2 * PARTS + 1  # a pg and a redis branch per task, the ledger
    env.expect_exactly_once()


@pytest.mark.filterwarnings("ignore:Cannot infer the eval type")
def test_a_task_failing_while_writing_is_retried(
    spark: SparkSession, env: Env, tmp_path: Path
) -> None:
    marker = tmp_path / "failed-attempt"
    save(items_failing_once(spark, marker), env.options)
    assert marker.exists()
    env.expect_exactly_once()


def test_a_rerun_with_the_same_txn_version_writes_nothing(spark: SparkSession, env: Env) -> None:
    options = {**env.options, "txnVersion": "save-2026-11-27"}
    save(items(spark), options)
    again = save(items(spark), options)
    assert (again.outcome, again.replay) == ("committed", True)
    env.expect_exactly_once()


def test_arrow_and_bad_options_are_refused_before_any_task(env: Env) -> None:
    with pytest.raises(ConfigurationError, match="'arrow' belongs to the data source"):
        save(None, {**env.options, "arrow": "true"})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"'pg\.tabel'"):
        save(None, {**env.options, "pg.tabel": "items"})  # type: ignore[arg-type]
    assert env.rows() == [] and env.prepared() == []


def test_a_failed_job_leaves_nothing_prepared(spark: SparkSession, env: Env) -> None:
    df = spark.range(0, N, numPartitions=PARTS).selectExpr(
        "CAST(id AS INT) AS id", "IF(id = 999, -1, 1) AS qty"
    )
    with pytest.raises(Exception, match="strict_items_qty_check"):
        save(df, {**env.pg_only, "pg.table": "strict_items"})
    with env.data.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM strict_items")).scalar_one() == 0
    assert env.prepared() == []
