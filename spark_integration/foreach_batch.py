"""``writeStream.foreachBatch`` with the same exactly-once guarantee as ``format("twopc")``.

Why: Spark calls a ``foreachBatch`` function again with the same ``batch_id`` (and, for a
deterministic query, the same rows) when a micro-batch is replayed after a restart, and promises
only at-least-once. Writing each micro-batch as a *batch* twopc write whose ``txnVersion`` is the
batch id turns that replay into a no-op: the gtrid ``{node}:{appId}:{batch_id}`` is already
committed, so every task writes nothing. Use it when the batch needs DataFrame operations a sink
cannot express (joins against static data, several writes per batch under different ``appId``).
Keep ``appId`` stable across restarts of the query, and do not share it with another writer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pyspark.sql import DataFrame

from coordinator import ConfigurationError

from .datasource import NAME, TwopcDataSource
from .targets import parse_options


def foreach_batch_writer(options: Mapping[str, str]) -> Callable[[DataFrame, int], None]:
    """A ``foreachBatch`` function writing each micro-batch once, keyed by its batch id.

    ``options`` are the data source's (`spark_integration.targets`), without ``txnVersion``;
    they are checked here, before the query starts.
    """
    given = {str(k): str(v) for k, v in options.items()}
    if any(k.lower() == "txnversion" for k in given):
        raise ConfigurationError(
            "option 'txnVersion' is set by foreach_batch_writer from the micro-batch id; "
            "do not pass it"
        )
    parse_options({**given, "txnVersion": "0"})  # fail now, not in the first micro-batch

    def write_batch(df: DataFrame, batch_id: int) -> None:
        # the micro-batch's DataFrame may belong to a clone of the user's session; registering
        # is cheap and idempotent, so make sure "twopc" is known there
        df.sparkSession.dataSource.register(TwopcDataSource)
        (
            df.write.format(NAME)
            .options(**given)
            .option("txnVersion", str(batch_id))
            .mode("append")
            .save()
        )

    return write_batch
