"""Idle branch connections kept for the next branch: a connection kept across transactions.

A branch checks a connection out of the engine's pool, switches it to autocommit (the driver must
never believe it owns the transaction: `_driver`), and at the end switches it back and checks it
in, where SQLAlchemy's reset-on-return runs. Per transaction that is a checkout, a check-in, a
Core `Connection` built and closed, and two autocommit switches, each of which (psycopg2's
``conn_set_session``) gives up the GIL for a mutex: cheap alone, but in a process whose other
threads want the GIL (a transfer's pump, a store's flusher) every release is a wait to get it
back. Measured on `bench/producer_instructions.py`'s ``twopc eo`` and ``twopc pg`` loops: 5-10%
of a transaction's CPU.

So a branch whose connection ends idle and healthy (the server's transaction status ``IDLE``:
committed, rolled back or prepared; the connection open) leaves it here, still in autocommit mode,
with its Core handle, and the next branch takes the newest one. At most ``count`` are kept, each
for at most ``seconds``; one older is checked in when a branch next starts or ends, and all of
them by `Spares.release` (`PostgresResource.release_idle`, which the transaction manager's close
calls). A connection is kept only while the pool has room for someone else: with a `QueuePool`
whose every connection is checked out, it goes back, so that a thread waiting on the pool never
waits on an idle connection of ours. Nothing about a branch depends on which connection it got:
the BEGIN travels with its first statement and everything it wrote ended with it.

What a kept connection skips is the pool's checkout checks (``pool_pre_ping``, ``pool_recycle``),
so `Spares.take` makes its own, without a round trip: a connection the pool has disowned since (the
engine disposed, the pool invalidated) or whose server has spoken since the branch ended (its
socket readable: a restarted or crashed server closed it) goes back to the pool instead; one whose
server closed it also starts the pool afresh, since the pool's idle connections died with it. A
server that vanished without closing the socket is not seen: the next branch's first statement
fails as a lost connection (`TransientError`: `TransactionManager.run` retries it), as on a pooled
connection without ``pool_pre_ping``; ``seconds`` bounds that window.
"""

from __future__ import annotations

import contextlib
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Engine

from ._branch import BranchConnection

#: how many idle connections a resource keeps by default, and for how long
DEFAULT_KEEP_IDLE = 2
DEFAULT_KEEP_IDLE_SECONDS = 5.0

Spare = tuple[float, Any, BranchConnection | None]  # kept at (monotonic), pooled, Core handle


class Spares:
    """The idle connections of one resource, newest last."""

    def __init__(
        self,
        engine: Engine,
        count: int,
        seconds: float,
        give_back: Callable[[Any, BranchConnection | None], None],
    ) -> None:
        self._engine = engine
        self._count = count
        self._seconds = seconds
        self._give_back = give_back
        self._lock = threading.Lock()
        self._idle: deque[Spare] = deque()

    def __len__(self) -> int:
        return len(self._idle)

    def keep(self, pooled: Any, connection: BranchConnection | None) -> bool:
        """Keep an idle, healthy connection (the caller checked both); False: give it back."""
        if self._count == 0 or not self._pool_has_room():
            return False
        if connection is not None and connection.in_transaction():
            connection.rollback()  # SQLAlchemy's own state: the server is idle, in autocommit
        with self._lock:
            if len(self._idle) >= self._count:
                return False
            self._idle.append((time.monotonic(), pooled, connection))
        self._expire()
        return True

    def take(self) -> tuple[Any, BranchConnection | None] | None:
        """The newest kept connection that has not outlived ``seconds`` and that the pool has
        not disowned since, or None."""
        if not self._idle:
            return None
        self._expire()
        while True:
            with self._lock:
                if not self._idle:
                    return None
                _, pooled, connection = self._idle.pop()
            if not self._disowned(pooled):
                if _quiet(pooled.dbapi_connection):
                    return pooled, connection
                self._server_spoke(pooled)
            self._give_back(pooled, connection)

    def _disowned(self, pooled: Any) -> bool:
        """Has the pool disowned this connection since it was kept? Once the engine was disposed
        (a new pool: recovery does that when it finds the server gone) or the pool invalidated
        after the connection was made (SQLAlchemy does that when a statement finds the server
        gone), the pool would not hand it out, and neither do we."""
        pool = self._engine.pool
        if getattr(pooled, "_pool", pool) is not pool:
            return True
        record = getattr(pooled, "_connection_record", None)
        started = getattr(record, "starttime", None)
        invalidated = getattr(pool, "_invalidate_time", 0)
        return isinstance(started, int | float) and started < invalidated

    def _server_spoke(self, pooled: Any) -> None:
        """A kept connection's server closed it (or said something unbidden): drop it, and
        start the pool afresh, as recovery does when it finds the server gone (`_pooled`): a
        restart ends every session, so the pool's idle connections are as dead, and without
        ``pool_pre_ping`` the next checkout would hand one out."""
        with contextlib.suppress(Exception):
            pooled.invalidate()
        self._engine.dispose(close=False)

    def release(self) -> None:
        """Check every kept connection in."""
        with self._lock:
            idle, self._idle = list(self._idle), deque()
        for _, pooled, connection in idle:
            self._give_back(pooled, connection)

    def _expire(self) -> None:
        """Check in the connections kept longer than ``seconds`` (the oldest are first)."""
        cutoff = time.monotonic() - self._seconds
        stale: list[Spare] = []
        with self._lock:
            while self._idle and self._idle[0][0] < cutoff:
                stale.append(self._idle.popleft())
        for _, pooled, connection in stale:
            self._give_back(pooled, connection)

    def _pool_has_room(self) -> bool:
        """Would a thread asking the pool now get a connection without waiting? (Always, for a
        pool without a limit.)"""
        pool = self._engine.pool
        size, overflow = getattr(pool, "size", None), getattr(pool, "_max_overflow", None)
        checkedout = getattr(pool, "checkedout", None)
        if not callable(size) or not callable(checkedout) or not isinstance(overflow, int):
            return True
        if overflow < 0:  # unlimited overflow
            return True
        return int(checkedout()) < int(size()) + overflow


def _quiet(dbapi: Any) -> bool:
    """Has the server said nothing since the branch ended? An idle connection's socket turns
    readable when the server closes it (a restart, a crash, ``pg_terminate_backend``: its FIN,
    or its last error message), which one ``poll`` sees without a round trip. Anything else it
    could have sent (a notice, a parameter change) also sends the connection back to the pool,
    whose checkout deals with it: the price is one reuse missed, never a branch on a dead
    connection. A server that vanished without a word (a partition) is not seen: the branch's
    first statement then fails as a lost connection (`TransientError`)."""
    try:
        poller = select.poll()
        poller.register(dbapi.fileno(), select.POLLIN)
        return not poller.poll(0)
    except (OSError, ValueError, AttributeError):  # closed, or a driver without a socket
        return False
