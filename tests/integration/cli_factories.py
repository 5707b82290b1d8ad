"""Factories a ``twopc`` config names (``log_factory``, ``[resources]``), reading their database
from the environment as a real deployment would read its secrets."""

from __future__ import annotations

import os

import sqlalchemy as sa

from resource_managers.postgres import PostgresResource, SqlDecisionLog


def decision_log(node_id: str, read_only: bool = False) -> SqlDecisionLog:
    engine = sa.create_engine(os.environ["TWOPC_CLI_TEST_LOG_URL"])
    return SqlDecisionLog(engine, node_id, read_only=read_only, acquire_timeout=5.0)


def ledger() -> PostgresResource:
    return PostgresResource(sa.create_engine(os.environ["TWOPC_CLI_TEST_LEDGER_URL"]), "ledger")


# -- a Spark writer's resources, named as the writer names them (see docs/spark.md) --------------


def spark_pg() -> PostgresResource:
    return PostgresResource(sa.create_engine(os.environ["TWOPC_CLI_TEST_SPARK_PG_URL"]), "pg")


def spark_redis() -> object:
    import redis

    from resource_managers.redis import RedisResource

    client = redis.Redis.from_url(os.environ["TWOPC_CLI_TEST_SPARK_REDIS_URL"])
    return RedisResource(client, "redis")


def spark_ledger() -> PostgresResource:
    engine = sa.create_engine(os.environ["TWOPC_CLI_TEST_LOG_URL"])
    return PostgresResource(engine, "spark-ledger")
