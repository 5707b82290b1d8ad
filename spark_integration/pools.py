"""Connection pools kept for the life of one process: SQLAlchemy engines and redis-py clients,
one per URL, shared by every call of `spark_integration.connect.open_targets` in the process.

Why: Spark reuses a Python worker for task after task (``spark.python.worker.reuse``, on by
default), and each task used to build its own engines and close them at the end. Two fresh
PostgreSQL connections per task (the data database and the decision log's), with their
authentication and SQLAlchemy's first-connect dialect checks, were about 14 ms of a small
partition's 40 ms fixed cost (bench/spark_sink.py at 64 partitions). A pool outlives the task;
a branch never does.

Why it is safe to share:

- A branch holds a connection only while it works. A prepared PostgreSQL branch of an executor
  gives its connection back at once (``hold_prepared=0``); ``PREPARE TRANSACTION`` leaves the
  session outside any transaction, and the pool's reset on return rolls back whatever a failed
  call left open. Redis commands carry no session state between calls.
- Spark runs one task at a time in a Python worker; the pools are locked all the same (the
  driver's commit runs phase two on a few threads).
- A fork (Spark's worker daemon forks workers) must not use its parent's sockets: a process that
  finds pools made by another pid forgets them without closing (SQLAlchemy's
  ``dispose(close=False)``), and builds its own.
- A connection the server closed meanwhile (a restart, ``DROP DATABASE .. WITH (FORCE)``) is
  replaced on checkout (``pool_pre_ping``); redis-py reconnects on its own.

At most `MAX_POOLS` URLs are kept; the least recently used beyond that is closed. Each engine
keeps at most ``pool_size`` idle connections, so an idle worker holds two per database it wrote
to; `close_pools` closes them all (tests, or an application that wants them gone).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

MAX_POOLS = 8


class Pools:
    """Engines and Redis clients by URL, for this process (see the module docstring)."""

    def __init__(self, limit: int = MAX_POOLS) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._items: OrderedDict[tuple[str, str], tuple[Any, Callable[[bool], None]]] = (
            OrderedDict()
        )

    def engine(self, url: str) -> Engine:
        """The process's engine for ``url``."""
        engine: Engine = self._get("sql", url, _make_engine)
        return engine

    def redis(self, url: str) -> redis.Redis:
        """The process's Redis client (and its connection pool) for ``url``."""
        client: redis.Redis = self._get("redis", url, _make_redis)
        return client

    def close(self) -> None:
        """Close every pool of this process (a forked child only forgets its parent's)."""
        with self._lock:
            self._forget_parents_locked()
            items, self._items = list(self._items.values()), OrderedDict()
        for _, close in items:
            close(True)

    def _forget_parents_locked(self) -> None:
        """In a forked child: forget the parent's pools without closing (not our sockets)."""
        if self._pid != os.getpid():
            for _, close in self._items.values():
                close(False)
            self._items = OrderedDict()
            self._pid = os.getpid()

    def _get(
        self, kind: str, url: str, make: Callable[[str], tuple[Any, Callable[[bool], None]]]
    ) -> Any:
        evicted: list[Callable[[bool], None]] = []
        with self._lock:
            self._forget_parents_locked()
            key = (kind, url)
            item = self._items.get(key)
            if item is None:
                item = make(url)
                self._items[key] = item
                while len(self._items) > self._limit:
                    evicted.append(self._items.popitem(last=False)[1][1])
            else:
                self._items.move_to_end(key)
        for close in evicted:
            close(True)
        return item[0]


def _make_engine(url: str) -> tuple[Engine, Callable[[bool], None]]:
    # two kept idle; the overflow (closed on return) serves concurrent calls of one process, such
    # as a driver finishing two writes at once, which had an engine each before they shared one
    engine = sa.create_engine(url, pool_size=2, max_overflow=16, pool_pre_ping=True)
    return engine, lambda mine: engine.dispose(close=mine)


#: seconds a Redis reply may take (redis-py's default is 5): a branch's prepare and commit are
#: each one script over the whole partition's keys, which runs for seconds at a quarter of a
#: million keys and queues behind the other partitions' scripts; a shorter wait turned a busy
#: server into failed prepares and retried commits (bench/spark_sink.py, 1M rows, 4 partitions).
#: A ``socket_timeout`` in the URL's query wins.
REDIS_REPLY_SECONDS = 120.0


def _make_redis(url: str) -> tuple[redis.Redis, Callable[[bool], None]]:
    client = redis.Redis.from_url(url, socket_timeout=REDIS_REPLY_SECONDS)

    def close(mine: bool) -> None:
        if mine:
            client.close()

    return client, close


#: the process's pools
POOLS = Pools()


def close_pools() -> None:
    """Close this process's pooled connections (they are opened again on next use)."""
    POOLS.close()
