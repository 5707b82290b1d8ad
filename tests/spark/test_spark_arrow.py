"""The Arrow writer by default where it is correct (`spark_integration.arrow_choice`): which
schemas take it, that the values it hands the targets are the `Row` path's for every type it is
taken for, and that a timestamp column, where they differ, falls back to Rows with the reason
logged."""

from __future__ import annotations

import datetime as dt
import importlib.util
import logging
import os
from decimal import Decimal
from typing import TYPE_CHECKING

import pytest

if importlib.util.find_spec("pyspark") is None:  # under CI a missing pyspark must not pass
    if os.environ.get("CI", "").lower() == "true":
        raise RuntimeError("pyspark is not installed: pip install -e '.[spark]'")
    pytest.skip("pyspark is not installed", allow_module_level=True)

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from spark_integration.arrow_choice import arrow_refusal
from spark_integration.datasource import TwopcArrowBatchWriter, TwopcBatchWriter, TwopcDataSource

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark

#: every type the default takes Arrow for, with a value of it (None in the second row)
SAME = [
    ("b", BooleanType(), True),
    ("i8", ByteType(), -7),
    ("i16", ShortType(), 300),
    ("i32", IntegerType(), 70000),
    ("i64", LongType(), 2**40),
    ("f32", FloatType(), 0.1),
    ("f64", DoubleType(), 1 / 3),
    ("s", StringType(), 'zoë, "quoted"\n'),
    ("dec", DecimalType(20, 4), Decimal("12345.6789")),
    ("d", DateType(), dt.date(2026, 1, 2)),
    ("ntz", TimestampNTZType(), dt.datetime(2026, 1, 2, 3, 4, 5, 6)),
    ("arr", ArrayType(LongType()), [1, None, 3]),
    ("arr_s", ArrayType(StringType()), ["x", "y"]),
]
OPTIONS = {
    "appId": "arrow-choice",
    "log.url": "postgresql+psycopg2://nobody@127.0.0.1:1/nothing",
    "pg.url": "postgresql+psycopg2://nobody@127.0.0.1:1/nothing",
    "pg.table": "items",
}


def schema(*fields: tuple[str, object]) -> StructType:
    return StructType([StructField(name, t, True) for name, t in fields])  # type: ignore[arg-type]


def writer(options: dict[str, str], s: StructType) -> object:
    return TwopcDataSource(options).writer(s, False)


def test_flat_schemas_take_arrow_by_default() -> None:
    flat = schema(*((name, t) for name, t, _ in SAME))
    assert arrow_refusal(flat) is None
    assert isinstance(writer(OPTIONS, flat), TwopcArrowBatchWriter)
    assert not isinstance(writer({**OPTIONS, "arrow": "false"}, flat), TwopcArrowBatchWriter)


@pytest.mark.parametrize(
    ("data_type", "why"),
    [
        (TimestampType(), "timezone-aware"),
        (ArrayType(TimestampType()), "timezone-aware"),
        (BinaryType(), "not known"),
        (MapType(StringType(), LongType()), "not known"),
        (schema(("x", LongType())), "not known"),
    ],
)
def test_other_types_fall_back_to_rows_saying_why(
    data_type: object, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    s = schema(("id", LongType()), ("col", data_type))
    with caplog.at_level(logging.INFO, logger="twopc.spark"):
        chosen = writer(OPTIONS, s)
    assert type(chosen) is TwopcBatchWriter
    assert "column 'col'" in caplog.text and why in caplog.text
    # asked for explicitly, Arrow it is (with the documented timestamp difference)
    assert isinstance(writer({**OPTIONS, "arrow": "true"}, s), TwopcArrowBatchWriter)


def test_arrow_values_are_the_row_values_for_every_type_taken(spark: SparkSession) -> None:
    """What each path hands the partition writer, compared on the driver through the same
    conversions (Arrow's `to_pylist`, `Row.asDict`)."""
    s = schema(*((name, t) for name, t, _ in SAME))
    df = spark.createDataFrame([tuple(v for _, _, v in SAME), (None,) * len(SAME)], s)
    from_arrow = df.toArrow().to_pylist()
    from_rows = [row.asDict() for row in df.collect()]
    assert from_arrow == from_rows
    for a, r in zip(from_arrow, from_rows, strict=True):
        assert {k: type(v) for k, v in a.items()} == {k: type(v) for k, v in r.items()}


def test_timestamps_differ_which_is_why_they_fall_back(spark: SparkSession) -> None:
    df = spark.sql("SELECT TIMESTAMP '2026-01-02 03:04:05' AS ts")
    (arrow,) = df.toArrow().to_pylist()
    (row,) = df.collect()
    assert arrow["ts"].tzinfo is not None and row["ts"].tzinfo is None
    assert arrow_refusal(df.schema) is not None
