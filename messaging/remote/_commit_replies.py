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

from coordinator.errors import TransactionError
from coordinator.resource import Outcome
from coordinator.xid import Xid

from ._loop_link import Link

#: reads the answer to one ``XA_COMMIT`` (connection, request id, seconds left): the server's
#: outcome, its refusal (`TransactionError`), or any other exception when no answer came
ReadOutcome = Callable[[Link, int, float], "Outcome | None"]

log = logging.getLogger("twopc.remote")


@dataclass
class _Pending:
    conn: Link
    request_id: int
    xid: Xid
    on_durable: Callable[[], None]
    deadline: float


class CommitReplies:
    """The commits of one remote resource whose answers are still to come, oldest first."""

    def __init__(
        self,
        name: str,
        timeout: float,
        *,
        read: ReadOutcome,
        release: Callable[[Link], None],
        commit_again: Callable[[Xid], Outcome | None],
    ) -> None:
        """``release`` gives a connection that is in step back to its pool; ``commit_again``
        asks once more, the ordinary way, when no answer came."""
        self._name = name
        self._timeout = timeout
        self._read = read
        self._release = release
        self._commit_again = commit_again
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def expect(self, conn: Link, request_id: int, xid: Xid, on_durable: Callable[[], None]) -> None:
        deadline = time.monotonic() + self._timeout
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"twopc-commit-replies-{self._name}",
                    daemon=True,
                )  # fmt: skip
                self._thread.start()
        self._queue.put(_Pending(conn, request_id, xid, on_durable, deadline))

    def flush(self) -> None:
        """Return once every answer expected so far has been handled, or after the resource's
        timeout (twice: an answer, then one more try): what is still open then stays with the
        decision for recovery."""
        deadline = time.monotonic() + 2 * self._timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("%s: %d commit answer(s) still awaited; recovery re-drives them",
                                self._name, self._queue.unfinished_tasks)  # fmt: skip
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
                log.exception("%s: handling a commit answer failed", self._name)
            finally:
                self._queue.task_done()

    def _settle(self, p: _Pending) -> None:
        try:
            outcome = self._read(p.conn, p.request_id, max(0.0, p.deadline - time.monotonic()))
        except TransactionError as exc:  # the server's own answer: the connection is in step
            self._release(p.conn)
            log.warning("%s: commit of %s refused (%s); recovery re-drives it",
                        self._name, p.xid, exc)  # fmt: skip
            return
        except Exception as exc:  # no answer: once more, the ordinary way
            p.conn.close()  # already closed when out of step; never back to the pool
            log.info("%s: no answer to the commit of %s (%r); asking again", self._name,
                     p.xid, exc)  # fmt: skip
            try:
                outcome = self._commit_again(p.xid)
            except Exception as again:
                log.warning("%s: commit of %s not confirmed (%r); recovery re-drives it",
                            self._name, p.xid, again)  # fmt: skip
                return
        else:
            self._release(p.conn)
        if outcome is not None and outcome.is_heuristic:
            log.error("%s: commit of %s answered %s; recovery records and reports it",
                      self._name, p.xid, outcome.value)  # fmt: skip
            return
        p.on_durable()
