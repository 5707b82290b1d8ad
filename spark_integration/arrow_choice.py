"""Whether a batch write takes Spark's Arrow path: by default wherever it hands the targets the
same Python values as the `Row` path, else Rows, with the reason logged.

Why a choice at all: the Arrow writer (`DataSourceArrowWriter`) is the faster one, since Spark
ships columnar batches to the Python worker instead of pickled rows (`bench/spark_sink.py` has
the figures), but it is only a faster way to the same dicts when ``RecordBatch.to_pylist()`` and
``Row.asDict()`` agree, value for value. They do for the flat types below and arrays of them;
they do not for:

- ``TimestampType``: Arrow gives a timezone-aware `datetime` in the session time zone, a `Row` a
  naive one in the worker's local time. The instant is the same, but a Redis or message template
  renders the offset, and a `timestamp` column of PostgreSQL reads it in its own time zone. Rows
  keep the values a `Row` path user already has; ``arrow=true`` still takes Arrow.
- ``BinaryType`` (`bytes` against `bytearray`, which a template renders differently), structs
  (a dict against a nested `Row`), maps (a list of pairs against a dict), and any type not listed
  here (intervals, variants, user-defined types): not shown to agree, so not taken by default.

The schema is known on the driver (``writer(schema, ...)``), so the choice is made once, before
any task runs, and the reason is logged there (logger ``twopc.spark``). Pyarrow missing on the
driver is a reason too: Spark's Arrow path needs it on every worker.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING

from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    TimestampNTZType,
    TimestampType,
)

if TYPE_CHECKING:
    from pyspark.sql.types import StructType

log = logging.getLogger("twopc.spark")

#: types whose values reach the targets alike through Arrow and through Rows (CharType and
#: VarcharType are StringType once in a DataFrame)
_SAME: tuple[type[DataType], ...] = (
    BooleanType,
    ByteType,
    ShortType,
    IntegerType,
    LongType,
    FloatType,
    DoubleType,
    StringType,
    DecimalType,
    DateType,
    TimestampNTZType,
)


def _differs(data_type: DataType) -> str | None:
    """Why ``data_type``'s values may differ between the two paths, or None if they agree."""
    if isinstance(data_type, ArrayType):
        return _differs(data_type.elementType)
    if isinstance(data_type, _SAME):
        return None
    if isinstance(data_type, TimestampType):
        return "Arrow hands timestamps over timezone-aware, Rows naive"
    return "its values are not known to reach the targets alike through Arrow and Rows"


def arrow_refusal(schema: StructType) -> str | None:
    """Why the default must not take the Arrow path for ``schema``, or None if it may."""
    for field in schema.fields:
        why = _differs(field.dataType)
        if why is not None:
            return f"column {field.name!r} is {field.dataType.simpleString()}: {why}"
    if importlib.util.find_spec("pyarrow") is None:
        return "pyarrow is not installed"
    return None


def use_arrow(asked: bool | None, schema: StructType) -> bool:
    """The path of one batch write: what the ``arrow`` option says if given, else Arrow unless
    `arrow_refusal` has a reason, which is logged."""
    if asked is not None:
        return asked
    why = arrow_refusal(schema)
    if why is None:
        return True
    log.info("twopc: this batch write takes Spark Rows, not the faster Arrow batches: %s", why)
    return False
