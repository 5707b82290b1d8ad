"""Idle branch connections kept for the next branch: a connection kept across transactions.

A branch checks a connection out of the engine's pool, switches it to autocommit (the driver must
never believe it owns the transaction: `_driver`), and at the end switches it back and checks it
in, where SQLAlchemy's reset-on-return runs. Per transaction that is a checkout, a check-in and
two autocommit switches, each of which (psycopg2's ``conn_set_session``) gives up the GIL for a
mutex: cheap alone, but in a process whose other threads want the GIL (a transfer's pump, a
store's flusher) every release is a wait to get it back. Measured on
`bench/producer_instructions.py`'s ``twopc eo`` and ``twopc pg`` loops: 5-10% of a
transaction's CPU.

So a branch whose connection ends idle and healthy (the server's transaction status ``IDLE``:
committed, rolled back or prepared; the connection open) leaves the pooled connection here, still
in autocommit mode, and the next branch takes the newest one. The branch's handles do not come
along: its Core `Connection` is retired (`BranchConnection.retire`), so a handle or a `Session`
used after its transaction ended raises `ResourceClosedError` instead of running on the next
branch, and each branch gets fresh ones (nothing set on a handle leaks into another branch).
Nothing about a branch depends on which connection it got: the BEGIN travels with its first
statement and everything it wrote ended with it.

Bounds: at most ``count`` connections, each for at most ``seconds`` (one older is checked in when
a branch starts or ends, or by a sweeper thread while the resource is idle), and only while the
pool has room for someone else, so that a `QueuePool` with every connection checked out never has
one of them idle here; the resource's own pooled statements (recovery, phase two without a held
connection) give the kept ones back first when the pool is full (`Spares.make_room`). Another
thread that fills the pool after a connection was kept waits at most ``seconds`` for it. All go
back on `Spares.release` (`PostgresResource.release_idle`, which the transaction manager's close
calls). The pool's events (checkout, checkin, reset) do not run between two branches on a kept
connection: ``keep_idle=0`` for code that relies on them.

What a kept connection also skips is the pool's checkout checks (``pool_pre_ping``,
``pool_recycle``), so `Spares.take` makes its own, without a round trip: a connection the pool has
disowned since (the engine disposed, the pool invalidated) goes back; one whose socket turned
readable (the server closed it: a restart, a crash, ``pg_terminate_backend``) is dropped and the
pool started afresh, since the pool's idle connections died with it. A server that vanished
without closing the socket is not seen: the next branch's first statement fails as a lost
connection (`TransientError`: `TransactionManager.run` retries it), as on a pooled connection
without ``pool_pre_ping``; ``seconds`` bounds that window.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Engine

from ._branch import BranchConnection

#: how many idle connections a resource keeps by default, and for how long
DEFAULT_KEEP_IDLE = 2
DEFAULT_KEEP_IDLE_SECONDS = 5.0

Spare = tuple[float, Any]  # kept at (monotonic), the pooled connection


class Spares:
    """The idle connections of one resource, newest last."""

    def __init__(
        self, engine: Engine, count: int, seconds: float, give_back: Callable[[Any], None]
    ) -> None:
        self._engine = engine
        self._count = count
        self.seconds = seconds
        self._give_back = give_back
        self._lock = threading.Lock()
        self._idle: deque[Spare] = deque()

    def __len__(self) -> int:
        return len(self._idle)

    def keep(self, pooled: Any, connection: BranchConnection | None) -> bool:
        """Keep an idle, healthy connection (the caller checked both), retiring the branch's
        Core handle; False: the caller gives it back."""
        if self._count == 0 or not self._pool_has_room():
            return False
        with self._lock:
            if len(self._idle) >= self._count:
                return False
        if connection is not None:
            connection.retire()
        with self._lock:
            self._idle.append((time.monotonic(), pooled))
        _SWEEPER.watch(self)
        self.expire()
        return True

    def take(self) -> Any | None:
        """The newest kept connection that has not outlived ``seconds``, that the pool has not
        disowned since, and whose server has said nothing since; or None."""
        if not self._idle:
            return None
        self.expire()
        while True:
            with self._lock:
                if not self._idle:
                    return None
                _, pooled = self._idle.pop()
            if not self._disowned(pooled):
                quiet = _quiet(pooled.dbapi_connection)
                if quiet:
                    return pooled
                if quiet is False:
                    self._server_spoke(pooled)
            self._give_back(pooled)

    def make_room(self) -> None:
        """Give every kept connection back if the pool is full: the resource's own pooled
        statements are about to ask it for one."""
        if self._idle and not self._pool_has_room():
            self.release()

    def release(self) -> None:
        """Check every kept connection in."""
        with self._lock:
            idle, self._idle = list(self._idle), deque()
        for _, pooled in idle:
            self._give_back(pooled)

    def expire(self) -> None:
        """Check in the connections kept longer than ``seconds`` (the oldest are first)."""
        cutoff = time.monotonic() - self.seconds
        stale: list[Spare] = []
        with self._lock:
            while self._idle and self._idle[0][0] < cutoff:
                stale.append(self._idle.popleft())
        for _, pooled in stale:
            self._give_back(pooled)

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


def _quiet(dbapi: Any) -> bool | None:
    """Has the server said nothing since the branch ended? An idle connection's socket turns
    readable when the server closes it (a restart, a crash, ``pg_terminate_backend``: its FIN,
    or its last error message), which one ``poll`` sees without a round trip (False). Anything
    else it could have sent (a notice, a notification) reads the same: the price is one reuse
    missed and a pool started afresh, never a branch on a dead connection. None: cannot tell
    (no socket to poll), so the connection goes back to the pool, which checks it."""
    try:
        poller = select.poll()
        poller.register(dbapi.fileno(), select.POLLIN)
        return not poller.poll(0)
    except (OSError, ValueError, AttributeError):  # closed, or a driver without a socket
        return None


class _Sweeper:
    """One daemon thread for every resource's kept connections, which checks in those past their
    time while their resource is idle (a busy resource expires them itself). It sleeps half the
    shortest ``seconds`` between rounds; it starts with the first connection kept, and again in
    a child process after a fork."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: weakref.WeakSet[Spares] = weakref.WeakSet()
        self._thread: threading.Thread | None = None

    def watch(self, spares: Spares) -> None:
        if spares in self._watched and self._thread is not None:
            return
        with self._lock:
            self._watched.add(spares)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="twopc-pg-kept-connections", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                watched = list(self._watched)
            time.sleep(min((s.seconds for s in watched), default=DEFAULT_KEEP_IDLE_SECONDS) / 2)
            for spares in watched:
                try:
                    spares.expire()
                except Exception:  # a connection that cannot go back is the pool's to drop
                    continue

    def forked(self) -> None:
        self._lock = threading.Lock()
        self._thread = None


_SWEEPER = _Sweeper()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_SWEEPER.forked)
