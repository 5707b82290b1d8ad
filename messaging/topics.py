"""Topic fan-out: ordered concurrent dispatch (IPCOM000031305D) over the cursor's topic input, with
the duplicate elimination of US 7,480,918 when it recovers.

A publication (a message sent to ``topic:<name>``) waits in the cursor's *topic input* until a
`TopicDispatcher` worker copies it into every subscription queue. Two promises must survive
several workers and ``kill -9``:

- **Per-publisher order** (JMS; IPCOM000031305D, IPCOM000031305D). The workers are a
  `messaging.dispatch.Dispatcher`: reading the topic input is serialised by its input lock, so
  the order workers take publications in is the topic input's order, and its per-publisher FIFO
  of parked workers delivers one publisher's publications one at a time, in that order, while
  other publishers' run in parallel. A publisher is ``message.publisher`` (the ``publisher=``
  send option, else the destination).
- **Every copy exactly once** (US 7,480,918). Taking a publication writes it to the
  cursor's *in-doubt list* with the queues it must reach; each copy goes into its queue in one
  record with an entry in the *monitor queue* naming the thread that made it; finishing removes
  the publication from the in-doubt list. When delivery fails (the process died, or a worker gave
  up after the dispatcher's retries), a recovery pass walks the in-doubt list in take order and,
  for each publication and queue, copies only if the monitor queue has no entry, then finishes
  it. A recovery pass that fails starts over from the top of the in-doubt list (with back-off);
  the monitor check makes starting over safe.

Recovery runs while no worker runs: at start, before the first worker reads anything (a
publication left in doubt by a crash must reach its queues before a later publication of the same
publisher), and after the dispatcher fails stop, once every worker has stopped. The failed
publication and its publisher's later ones are still in the in-doubt list, in take order, so the
recovery pass delivers them in order and fresh workers carry on. Nothing here is durable of its
own: the cursor's records are the state, so a process can die anywhere (see the ``dispatch.*``
crash points in docs/crash-points.md).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, fields
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from coordinator.backoff import Backoff, ExponentialBackoff
from coordinator.crashpoints import crash_point
from coordinator.errors import ConfigurationError

from .dispatch import Dispatcher, DispatchFailed, Publication

if TYPE_CHECKING:  # annotations only: importing this module never needs more of the cursor
    from resource_managers.cursor import TopicPublication

__all__ = ["DEFAULT_DISPATCH_WORKERS", "TopicDispatcher", "TopicStats", "TopicStore"]

log = logging.getLogger("twopc.topics")

DEFAULT_DISPATCH_WORKERS = 4


class TopicStore(Protocol):
    """What the dispatcher needs of the cursor (`resource_managers.cursor.Cursor` has it): the
    topic input, the in-doubt list and the monitor queue of US 7,480,918."""

    def next_publication(
        self, worker: str, timeout: float | None = 0.0
    ) -> TopicPublication | None: ...

    def deliver_copy(self, message_id: str, queue: str, by: str) -> bool: ...

    def finish_publication(self, message_id: str) -> None: ...

    def in_doubt(self) -> list[TopicPublication]: ...

    def monitored(self, message_id: str, queue: str) -> bool: ...


@dataclass(frozen=True)
class TopicStats:
    """Counters since this dispatcher was made.

    ``copies`` are the copies workers put in subscription queues; ``skipped`` the copies
    ``deliver_copy`` refused (the monitor queue had them: a retried delivery; or the subscription
    was gone). ``recovered`` are the copies recovery put in, ``recovery_skipped`` those it found
    in the monitor queue already: each one a duplicate US 7,480,918 prevented.
    ``recovery_restarts`` counts recovery passes that failed and started over."""

    read: int = 0
    finished: int = 0
    copies: int = 0
    skipped: int = 0
    retries: int = 0
    max_fifo_depth: int = 0
    dispatch_failures: int = 0
    recovery_runs: int = 0
    recovery_restarts: int = 0
    recovered: int = 0
    recovery_skipped: int = 0
    recovery_finished: int = 0


class _Counters:
    """`TopicStats` being counted, under one lock (workers count concurrently)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = {f.name: 0 for f in fields(TopicStats)}

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def high(self, name: str, value: int) -> None:
        with self._lock:
            self._values[name] = max(self._values[name], value)

    def get(self, name: str) -> int:
        with self._lock:
            return self._values[name]

    def snapshot(self, retries: int = 0, depth: int = 0) -> TopicStats:
        with self._lock:
            values = dict(self._values)
        values["retries"] += retries
        values["max_fifo_depth"] = max(values["max_fifo_depth"], depth)
        return TopicStats(**values)


class _TopicSource:
    """The `Dispatcher`'s input queue over the cursor's topic input. ``get`` runs under the
    dispatcher's input lock, so ``seq`` (the take order) needs no lock of its own and equals the
    topic input's order; the worker named in the in-doubt record is the calling thread."""

    def __init__(self, store: TopicStore, counters: _Counters, wake: threading.Event) -> None:
        self._store, self._counters, self._wake = store, counters, wake
        self._taken = 0

    def get(self, block: bool = True, timeout: float | None = None) -> Publication:
        worker = threading.current_thread().name
        try:
            taken = self._store.next_publication(worker, timeout if block else 0.0)
        except Exception:
            self._wake.set()  # the dispatcher fails stop on a broken source: recover sooner
            raise
        if taken is None:
            raise queue.Empty
        self._taken += 1
        self._counters.add(read=1)
        return Publication(taken.publisher, self._taken, payload=taken)


class TopicDispatcher:
    """Fans the cursor's publications out to their subscription queues with ``workers`` threads,
    keeping each publisher's order and delivering every copy exactly once across failures.

    ``start`` returns at once; a control thread runs recovery, then the workers, and supervises
    them (recovery again after a fail-stop). ``stop`` lets the workers finish what they read.
    ``max_attempts`` and ``backoff`` are the dispatcher's per-delivery retries;
    ``recovery_backoff`` paces recovery passes that fail and dispatcher restarts after failures.
    """

    def __init__(
        self,
        cursor: TopicStore,
        workers: int = DEFAULT_DISPATCH_WORKERS,
        *,
        max_attempts: int = 3,
        backoff: Backoff | None = None,
        recovery_backoff: Backoff | None = None,
        poll_interval: float = 0.1,
        name: str = "topics",
    ) -> None:
        if workers < 1 or poll_interval <= 0:
            raise ConfigurationError("workers and poll_interval must be positive")
        self._store, self._workers, self._name = cursor, workers, name
        self._max_attempts, self._backoff, self._poll = max_attempts, backoff, poll_interval
        self._recovery_backoff: Backoff = recovery_backoff or ExponentialBackoff(0.05, 2.0)
        self._counters = _Counters()
        self._wake = threading.Event()  # a delivery or the source raised, or stop was called
        self._stopping = threading.Event()
        self._ready = threading.Event()  # the first recovery finished: workers are reading
        self._source = _TopicSource(cursor, self._counters, self._wake)
        self._dispatcher: Dispatcher | None = None
        self._dispatcher_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # -- life cycle ------------------------------------------------------------------------------

    def start(self) -> TopicDispatcher:
        """Start the control thread (recovery, then workers); a dispatcher runs once."""
        if self._thread is not None:
            raise ConfigurationError("topic dispatcher already started")
        self._thread = threading.Thread(target=self._run, name=f"{self._name}-control", daemon=True)
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the start-up recovery is done and the workers read; False on timeout."""
        return self._ready.wait(timeout)

    def stop(self, timeout: float | None = 30.0) -> TopicStats:
        """Stop reading, let the workers deliver what they read, and join. What is left in doubt
        (a failed delivery) stays in the cursor for the next start's recovery."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError("topic dispatcher did not stop in time")
        return self.stats

    def __enter__(self) -> TopicDispatcher:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def stats(self) -> TopicStats:
        # Under the dispatcher lock: a generation's retries are folded into the counters and the
        # generation dropped in one step, so they are counted once, never twice or not at all.
        with self._dispatcher_lock:
            if self._dispatcher is None:
                return self._counters.snapshot()
            live = self._dispatcher.stats
            return self._counters.snapshot(live.retries, live.max_fifo_depth)

    # -- the control thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._control()
        except BaseException:  # a bug here must not end topic dispatch silently
            log.exception("topic dispatch control thread died; publications wait in the cursor")
            raise

    def _control(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            if not self._recover_until_done():
                return
            self._ready.set()
            finished_before = self._counters.get("finished")
            if not self._dispatch():
                return
            # Failed stop: recover, then fresh workers. Back off only while nothing gets through,
            # so a cursor that cannot write is not hammered.
            failures = 1 if self._counters.get("finished") > finished_before else failures + 1
            if self._stopping.wait(self._recovery_backoff.compute(failures)):
                return

    def _dispatch(self) -> bool:
        """Run one generation of workers until stop (False) or a fail-stop (True)."""
        dispatcher = Dispatcher(
            self._source, self._deliver, self._workers, max_attempts=self._max_attempts,
            backoff=self._backoff, poll_interval=self._poll,
        )  # fmt: skip
        with self._dispatcher_lock:
            self._dispatcher = dispatcher
        dispatcher.start()
        while not self._stopping.is_set() and dispatcher.error is None:
            self._wake.wait(self._poll)
            self._wake.clear()
        failed = False
        try:
            dispatcher.stop(drain=False)  # every publication read is delivered (or kept in doubt)
        except DispatchFailed as exc:
            failed = True
            self._counters.add(dispatch_failures=1)
            log.warning("topic dispatch failed stop (%s); %d publication(s) left in doubt for "
                        "recovery", exc.__cause__ or exc, len(exc.undelivered))  # fmt: skip
        finally:
            with self._dispatcher_lock:
                stats = dispatcher.stats
                self._counters.add(retries=stats.retries)
                self._counters.high("max_fifo_depth", stats.max_fifo_depth)
                self._dispatcher = None
        return failed and not self._stopping.is_set()

    def _deliver(self, publication: Publication) -> None:
        """A worker's delivery: one copy per queue named when the publication was taken, each
        with its monitor entry (so a retry of this very delivery skips the copies made), then
        finish. Runs while the worker holds its publisher's turn."""
        taken: TopicPublication = publication.payload
        mid, worker = taken.message_id, threading.current_thread().name
        try:
            for i, destination in enumerate(taken.queues, 1):
                crash_point(f"dispatch.before_copy.{i}")
                copied = self._store.deliver_copy(mid, destination, by=worker)
                if copied:
                    self._counters.add(copies=1)
                else:
                    self._counters.add(skipped=1)
                crash_point(f"dispatch.after_copy.{i}")
            self._store.finish_publication(mid)
        except Exception:
            self._wake.set()  # the dispatcher retries; the control thread checks for a fail-stop
            raise
        self._counters.add(finished=1)
        crash_point("dispatch.after_finish")

    # -- recovery (US 7,480,918) -----------------------------------------------------------------

    def _recover_until_done(self) -> bool:
        """US 7,480,918's recovery thread: passes over the in-doubt list until one completes, each
        failed pass followed by back-off and a fresh start from the top. False if stopped."""
        self._counters.add(recovery_runs=1)
        by = f"recovery-{self._counters.get('recovery_runs')}"
        failures = 0
        while not self._stopping.is_set():
            try:
                self._recover_once(by)
                return True
            except Exception as exc:
                failures += 1
                self._counters.add(recovery_restarts=1)
                log.warning("topic recovery pass %d failed (%r); starting over from the top of "
                            "the in-doubt list", failures, exc)  # fmt: skip
            if self._stopping.wait(self._recovery_backoff.compute(failures)):
                break
        return False

    def _recover_once(self, by: str) -> int:
        """One pass over the in-doubt list in take order: for each publication and each of its
        queues, copy unless the monitor queue already has the copy; then finish it. Returns the
        publications finished. Only while no worker delivers: the monitor check and the copy are
        two calls, so a worker copying the same publication at once could slip in between (and
        a worker finishing a later publication of the same publisher would overtake it)."""
        done = 0
        for taken in self._store.in_doubt():
            if self._stopping.is_set():
                break
            mid = taken.message_id
            for destination in taken.queues:
                crash_point("recovery.dispatch.before_check")
                if self._store.monitored(mid, destination):
                    self._counters.add(recovery_skipped=1)
                    continue
                if self._store.deliver_copy(mid, destination, by=by):
                    self._counters.add(recovered=1)
                    crash_point("recovery.dispatch.after_redeliver")
            self._store.finish_publication(mid)
            self._counters.add(recovery_finished=1)
            done += 1
        return done
