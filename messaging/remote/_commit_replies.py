"""Phase-two commits of remote branches whose answers are awaited off the caller's thread.

`_RemoteResource.commit_lazily` (`coordinator.lazy_commit`) sends ``XA_COMMIT`` and returns: the
caller's transaction is decided (its decision durable), so the answer only tells the coordinator
when it may forget the decision. A thread per resource waits for each answer in turn. An answer
of "committed" runs ``on_durable`` (the server answers only once its commit record is on disk);
no answer, or a broken connection, is followed by one ordinary commit on a fresh connection (the
verb is idempotent), and if that fails too the decision simply stays: recovery re-drives it. A
heuristic answer also leaves the decision for recovery, which records and reports it (the caller,
already told "committed", hears of it only there — as with `async_phase_two`). So a remote branch
costs the caller no round trip in phase two.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coordinator.errors import TransactionError
from coordinator.resource import Outcome
from coordinator.xid import Xid
from messaging.connection import Connection

from ._replies import _outcome

if TYPE_CHECKING:
    from ._resource import _RemoteResource

log = logging.getLogger("twopc.remote")


@dataclass
class _Pending:
    conn: Connection
    request_id: int
    xid: Xid
    on_durable: Callable[[], None]
    deadline: float


class CommitReplies:
    """The commits of one remote resource whose answers are still to come, oldest first."""

    def __init__(self, resource: _RemoteResource) -> None:
        self._resource = resource
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def expect(
        self, conn: Connection, request_id: int, xid: Xid, on_durable: Callable[[], None]
    ) -> None:
        deadline = time.monotonic() + self._resource.timeout
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"twopc-commit-replies-{self._resource.name}",
                    daemon=True,
                )  # fmt: skip
                self._thread.start()
        self._queue.put(_Pending(conn, request_id, xid, on_durable, deadline))

    def flush(self) -> None:
        """Return once every answer expected so far has been handled, or after the resource's
        timeout (twice: an answer, then one more try): what is still open then stays with the
        decision for recovery."""
        deadline = time.monotonic() + 2 * self._resource.timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("%s: %d commit answer(s) still awaited; recovery re-drives them",
                                self._resource.name, self._queue.unfinished_tasks)  # fmt: skip
                    return
                self._queue.all_tasks_done.wait(left)

    def _run(self) -> None:
        while True:
            pending = self._queue.get()
            try:
                if pending is None:
                    return
                self._settle(pending)
            except Exception:
                log.exception("%s: handling a commit answer failed", self._resource.name)
            finally:
                self._queue.task_done()

    def _settle(self, p: _Pending) -> None:
        resource = self._resource
        try:
            left = max(0.0, p.deadline - time.monotonic())
            outcome: Outcome | None = resource._answer(
                p.conn, p.request_id, "XA_COMMIT", left, _outcome
            )
        except TransactionError as exc:  # the server's own answer: the connection is in step
            resource._pool.release(p.conn)
            log.warning("%s: commit of %s refused (%s); recovery re-drives it",
                        resource.name, p.xid, exc)  # fmt: skip
            return
        except Exception as exc:  # no answer: once more, the ordinary way
            p.conn.close()  # already closed when out of step; never back to the pool
            log.info("%s: no answer to the commit of %s (%r); asking again", resource.name,
                     p.xid, exc)  # fmt: skip
            try:
                outcome = resource._commit_prepared(p.xid)
            except Exception as again:
                log.warning("%s: commit of %s not confirmed (%r); recovery re-drives it",
                            resource.name, p.xid, again)  # fmt: skip
                return
        else:
            resource._pool.release(p.conn)
        if outcome is not None and outcome.is_heuristic:
            log.error("%s: commit of %s answered %s; recovery records and reports it",
                      resource.name, p.xid, outcome.value)  # fmt: skip
            return
        p.on_durable()
