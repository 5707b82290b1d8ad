"""Stream rows into PostgreSQL, Redis and (optionally) the message log, exactly once, with Spark.

A Structured Streaming query reads CSV files (``id,name`` lines) dropped into a directory, or
Spark's ``rate`` source, and writes every micro-batch through the ``twopc`` data source: each
task prepares one branch per target, the driver decides once per micro-batch in the SQL decision
log, and a micro-batch replayed after a crash writes nothing. Kill the job at any moment and
start it again with the same ``--app-id`` and ``--checkpoint``: every row ends up in every target
once. See docs/spark.md.

    .venv/bin/python examples/spark_stream_job.py \\
        --log-url postgresql+psycopg2://u:p@127.0.0.1/twopc_log \\
        --pg-url postgresql+psycopg2://u:p@127.0.0.1/shop \\
        --redis-url redis://127.0.0.1:6379/0 \\
        --app-id items-stream --checkpoint /tmp/items-ckpt --csv-dir /tmp/items-in

PostgreSQL needs ``max_prepared_transactions`` >= partitions x concurrent micro-batches (plus
one per commit for the ledger branch); Redis needs ``appendonly yes`` and ``appendfsync always``
(or pass ``--redis-relaxed`` on a laptop). The table is created if missing (``id`` is its
primary key only with ``--pg-mode upsert``: see docs/spark.md on unique keys after a driver
crash), and the job ends by printing its row count next to its distinct ids. With
``--mlog-address`` the rows are also sent to a ``twopc serve log`` server (secret from
``--mlog-secret-file`` or ``TWOPC_SECRET``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import sqlalchemy as sa
from pyspark.sql import DataFrame, SparkSession

from spark_integration import recovery_manager, register

SCHEMA = "id INT, name STRING"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Stream CSV files (or the rate source) into PostgreSQL + Redis "
        "(+ the message log) exactly once through the twopc data source.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--csv-dir", help="directory of CSV files with lines 'id,name'")
    source.add_argument("--rate", type=int, metavar="ROWS_PER_SECOND", help="use the rate source")
    parser.add_argument(
        "--app-id", required=True, help="stable writer name, 1-24 of [A-Za-z0-9._-]"
    )
    parser.add_argument("--checkpoint", required=True, help="Spark checkpoint directory")
    parser.add_argument("--log-url", required=True, help="SQLAlchemy URL of the decision-log DB")
    parser.add_argument("--log-node", help="decision-log node (default 'spark'; use one per app)")
    parser.add_argument("--grace-seconds", type=float, default=900.0, help="log.grace_seconds")
    parser.add_argument("--pg-url", required=True, help="SQLAlchemy URL of the target database")
    parser.add_argument("--pg-table", default="stream_items", help="target table (created)")
    parser.add_argument("--pg-mode", choices=("insert", "upsert"), default="insert")
    parser.add_argument("--redis-url", required=True, help="redis:// URL")
    parser.add_argument("--redis-prefix", default="item", help="keys are PREFIX:{id}")
    parser.add_argument("--redis-relaxed", action="store_true", help="redis.durability=relaxed")
    parser.add_argument("--mlog-address", help="HOST:PORT of a 'twopc serve log' server")
    parser.add_argument("--mlog-destination", default="items", help="message log destination")
    parser.add_argument("--mlog-secret-file", help="shared secret file (else $TWOPC_SECRET)")
    parser.add_argument("--master", default="local[2,2]", help="Spark master")
    parser.add_argument("--partitions", type=int, default=2, help="rate source partitions")
    parser.add_argument("--trigger-seconds", type=float, default=5.0, help="micro-batch interval")
    parser.add_argument(
        "--available-now",
        action="store_true",
        help="CSV only: process the files present, one per micro-batch, then stop",
    )
    parser.add_argument(
        "--run-seconds", type=float, help="stop the query after this long (default: run on)"
    )
    parser.add_argument(
        "--no-recover",
        action="store_true",
        help="skip the recovery pass at start-up (finishes what a crashed driver left)",
    )
    args = parser.parse_args(argv)
    if args.available_now and args.csv_dir is None:
        parser.error("--available-now needs --csv-dir")
    return args


def writer_options(args: argparse.Namespace) -> dict[str, str]:
    """The twopc data source's options (docs/spark.md#options): strings only, no secrets."""
    options = {
        "appId": args.app_id,
        "log.url": args.log_url,
        "log.grace_seconds": str(args.grace_seconds),
        "pg.url": args.pg_url,
        "pg.table": args.pg_table,
        "pg.mode": args.pg_mode,
        "pg.columns": "id,name",
        "redis.url": args.redis_url,
        "redis.op": "set",
        "redis.key": args.redis_prefix + ":{id}",
        "redis.value": "{name}",
    }
    if args.pg_mode == "upsert":
        options["pg.key"] = "id"
    if args.log_node:
        options["log.node"] = args.log_node
    if args.redis_relaxed:
        options["redis.durability"] = "relaxed"
    if args.mlog_address:
        options["mlog.address"] = args.mlog_address
        options["mlog.destination"] = args.mlog_destination
        options["mlog.value"] = "{id}:{name}"
        if args.mlog_secret_file:
            options["mlog.secret_file"] = args.mlog_secret_file
    return options


def _table(name: str, *columns: Any) -> sa.Table:
    schema, _, table = name.rpartition(".")
    return sa.Table(table, sa.MetaData(), *columns, schema=schema or None)


def create_table(url: str, table: str, unique_id: bool) -> None:
    engine = sa.create_engine(url)
    try:
        _table(
            table,
            sa.Column("id", sa.Integer, primary_key=unique_id, nullable=False),
            sa.Column("name", sa.Text, nullable=False),
        ).create(engine, checkfirst=True)
    finally:
        engine.dispose()


def spark_session(master: str) -> SparkSession:
    # executors must run this interpreter (it has pyarrow and twopc installed)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    spark = (
        SparkSession.builder.master(master)
        .appName("twopc-stream-example")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")
    register(spark)
    return spark


def source(spark: SparkSession, args: argparse.Namespace) -> DataFrame:
    if args.csv_dir is not None:
        return (
            spark.readStream.schema(SCHEMA)
            .option("maxFilesPerTrigger", 1)
            .csv(args.csv_dir)
            .where("id IS NOT NULL AND name IS NOT NULL")
        )
    rate = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", args.rate)
        .option("numPartitions", args.partitions)
        .load()
    )
    return rate.selectExpr("CAST(value AS INT) AS id", "CONCAT('n', CAST(value AS STRING)) AS name")


def start(df: DataFrame, args: argparse.Namespace, options: dict[str, str]) -> Any:
    writer = (
        df.writeStream.format("twopc")
        .options(**options)
        .option("checkpointLocation", args.checkpoint)
        .outputMode("append")
    )
    if args.available_now:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{args.trigger_seconds} seconds")
    return writer.start()


def summary(url: str, table: str) -> str:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            ids = _table(table, sa.Column("id")).c.id
            count = sa.select(sa.func.count(), sa.func.count(sa.distinct(ids)))
            rows, distinct = conn.execute(count).one()
            prepared = conn.execute(sa.text("SELECT count(*) FROM pg_prepared_xacts")).scalar_one()
    finally:
        engine.dispose()
    return (
        f"{table}: {rows} rows, {distinct} distinct ids; "
        f"prepared transactions left in its database: {prepared}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    options = writer_options(args)
    create_table(args.pg_url, args.pg_table, unique_id=args.pg_mode == "upsert")
    if not args.no_recover:
        # finish what a killed driver left: roll forward a logged COMMIT, roll back orphans
        # older than the grace; closed (lease released) before the query needs the lease
        with recovery_manager(options) as tm:
            report = tm.recover(force=True)
        print(
            f"recovery: {len(report.committed)} re-committed, {len(report.rolled_back)} rolled back"
        )
    spark = spark_session(args.master)
    try:
        query = start(source(spark, args), args, options)
        timeout = args.run_seconds
        finished = query.awaitTermination(timeout) if timeout else query.awaitTermination()
        if not finished:
            query.stop()
        if query.exception() is not None:
            print(f"query failed: {query.exception()}", file=sys.stderr)
            return 1
    finally:
        spark.stop()
    print(summary(args.pg_url, args.pg_table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
