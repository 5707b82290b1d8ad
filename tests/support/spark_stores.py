"""The stores a Spark write test writes into: a data database with ``items`` (and
``strict_items``, whose CHECK a bad row violates), a decision-log database, and Redis keys
``item:<id>``; the options that name them; and a cleanup that never leaves a prepared
transaction behind (a DROP DATABASE would hang on it).

Each test file subclasses `SparkStores` for its own idea of "exactly once" (a row count, a list
of rows) and builds it with `spark_stores`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
import sqlalchemy as sa
from sqlalchemy import text

from tests.support.pg import prepared_gids


@dataclass
class SparkStores:
    data: sa.Engine
    log: sa.Engine
    redis: Any  # redis.Redis, bytes in and out
    options: dict[str, str]  # PostgreSQL + Redis
    pg_only: dict[str, str]

    def rows(self, table: str = "items") -> list[tuple[int, str]]:
        with self.data.connect() as conn:
            query = f"SELECT id, name FROM {table} ORDER BY id, name"
            return [(int(r[0]), str(r[1])) for r in conn.execute(text(query))]

    def redis_items(self) -> dict[str, str]:
        keys = [k.decode() for k in self.redis.keys("item:*")]
        return {k: self.redis.get(k).decode() for k in keys}

    def prepared(self) -> list[str]:
        redis_prepared = [m.decode() for m in self.redis.zrange("twopc:{twopc}:prepared", 0, -1)]
        return prepared_gids(self.data) + prepared_gids(self.log) + redis_prepared


S = TypeVar("S", bound=SparkStores)


@contextmanager
def spark_stores(
    kind: type[S],
    make_pg_database: Callable[[], str],
    redis_url: str,
    **common: str,
) -> Iterator[S]:
    """Fresh databases and the options naming them; ``common`` adds options (``appId``,
    ``log.*``) to both option sets."""
    data_url, log_url = make_pg_database(), make_pg_database()
    data = sa.create_engine(data_url)
    with data.begin() as conn:
        conn.execute(text("CREATE TABLE items (id int NOT NULL, name text NOT NULL)"))
        conn.execute(
            text("CREATE TABLE strict_items (id int PRIMARY KEY, qty int CHECK (qty >= 0))")
        )
    log = sa.create_engine(log_url)
    client = redis.Redis.from_url(redis_url)
    base = {"appId": "orders", "log.url": log_url, **common}
    pg = {"pg.url": data_url, "pg.table": "items"}
    rd = {"redis.url": redis_url, "redis.op": "set", "redis.key": "item:{id}"}
    rd["redis.value"] = "{name}"
    try:
        yield kind(data, log, client, {**base, **pg, **rd}, {**base, **pg})
    finally:
        for engine in (data, log):
            with engine.connect() as conn:
                conn.execution_options(isolation_level="AUTOCOMMIT")
                for gid in prepared_gids(engine):
                    conn.exec_driver_sql("ROLLBACK PREPARED %s", (gid,))
            engine.dispose()
        client.close()
