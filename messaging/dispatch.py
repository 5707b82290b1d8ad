"""Concurrent publishing that keeps each publisher's order (IPCOM000031305D).

JMS requires that each subscriber sees one publisher's publications in the order they were
published. When publications wait in a queue, the easy way to keep that order is one global lock
around "read, then deliver" (`GlobalLockDispatcher`), which leaves every worker but one idle.
IBM's disclosure IPCOM000031305D ("Concurrent publishing with ordering in a queued JMS
publish/subscribe environment", the MQSeries broker) keeps the order with several workers, and
`Dispatcher` follows it:

1. Reading the input queue is serialised by one *input lock* (one MQGET at a time), so the order
   in which workers take publications is the order of the queue.
2. Still holding the input lock, the worker looks the publisher up. If another worker is already
   publishing for it, the worker joins that publisher's FIFO of waiting workers; otherwise it
   records itself as that publisher's publisher. Then it releases the input lock. The input lock
   is never held while a worker delivers or waits its turn ("vitally important", says the
   disclosure), so other workers keep reading.
3. A worker that finishes delivering hands the publisher over to the first worker in its FIFO, or
   clears the publisher if the FIFO is empty, and goes back to reading.

So each publisher's publications are delivered in the order they were read, and different
publishers are delivered in parallel. The disclosure's text is truncated after "checks to see
i..."; the hand-over in step 3 is the completion the rest of the text implies.

Parked workers are the only buffer, so memory is bounded by ``workers`` and back-pressure stays in
the input queue, which is durable in a broker. The price, inherited from the disclosure: a publisher
with a backlog of ``workers`` or more publications at the head of the queue parks every worker, and
other publishers wait until its deliveries drain (head-of-line blocking). A hot publisher whose
backlog stays below ``workers`` does not hold the others up.

The publisher table has its own short *table lock* (lock order: input lock, then table lock), so
a finishing worker can hand over without waiting for a reader that is blocked in ``get``.

Failure policy (both dispatchers): a ``deliver`` that raises is retried with back-off while the
worker keeps the publisher's turn, so nothing behind it overtakes it. After ``max_attempts`` the
dispatcher fails stop: it stops reading, lets other publishers' read publications finish, and
delivers nothing more for the failed publisher; the failed publication and that publisher's
publications read after it are kept, in order, in `DispatchFailed.undelivered`, and ``stop()``
raises that error. Publications not yet read stay in the source. Nothing is lost silently and no
publication is delivered after one of its publisher's earlier ones failed.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from coordinator.backoff import Backoff, ExponentialBackoff
from coordinator.errors import ConfigurationError, ProgrammingError, TransactionError

__all__ = [
    "DispatchFailed",
    "DispatchStats",
    "Dispatcher",
    "GlobalLockDispatcher",
    "Publication",
    "PublicationSource",
]


@dataclass(frozen=True)
class Publication:
    """One publish request: ``seq`` is the publisher's own number, kept for auditing only; order
    is the order the source yields, as in the disclosure, never a re-sort by ``seq``."""

    publisher_id: str
    seq: int
    payload: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.publisher_id, str) or not self.publisher_id:
            raise ProgrammingError("publisher_id must be a non-empty str")
        if not isinstance(self.seq, int):
            raise ProgrammingError("seq must be an int")


class PublicationSource(Protocol):
    """The input queue; `queue.Queue` fits. ``get`` blocks up to ``timeout`` seconds and raises
    `queue.Empty` if nothing came, so workers can notice ``stop()``. A publication returned by
    ``get`` is the dispatcher's to deliver or to hand back in `DispatchFailed`."""

    def get(self, block: bool = True, timeout: float | None = None) -> Publication: ...


Deliver = Callable[[Publication], object]


class DispatchFailed(TransactionError):
    """Delivery failed ``max_attempts`` times, or the source raised, and the dispatcher stopped.
    ``publication`` is the one that failed (None for a source failure); ``undelivered`` holds it
    and every later publication of its publisher that was read, in read order, for the caller to
    re-deliver before anything still in the source."""

    code = "dispatch-failed"
    publication: Publication | None = None
    undelivered: tuple[Publication, ...] = ()


@dataclass(frozen=True)
class DispatchStats:
    """``max_fifo_depth`` is the most workers ever parked behind one publisher (0 for the global
    lock): how close the dispatcher came to the head-of-line limit of ``workers - 1``."""

    read: int
    delivered: int
    retries: int
    max_fifo_depth: int


class _Waiter:
    """A parked worker: its publication and the event the previous worker sets to hand over."""

    __slots__ = ("publication", "turn")

    def __init__(self, publication: Publication) -> None:
        self.publication = publication
        self.turn = threading.Event()


class _BaseDispatcher:
    """Threads, stop, stats and the retry-then-fail-stop policy shared by both dispatchers."""

    def __init__(
        self,
        source: PublicationSource,
        deliver: Deliver,
        workers: int = 4,
        *,
        max_attempts: int = 3,
        backoff: Backoff | None = None,
        poll_interval: float = 0.02,
    ) -> None:
        if workers < 1 or max_attempts < 1 or poll_interval <= 0:
            raise ConfigurationError("workers, max_attempts and poll_interval must be positive")
        self._source, self._deliver, self._workers = source, deliver, workers
        self._max_attempts, self._poll = max_attempts, poll_interval
        self._backoff: Backoff = backoff or ExponentialBackoff(base=0.01, cap=0.5)
        self._input_lock = threading.Lock()  # one reader of the source at a time (IPCOM000031305D)
        self._table_lock = threading.Lock()  # publisher table, counters, failure; after input
        self._stopping = False  # checked by each reader before it starts another get
        self._draining = False
        self._threads: list[threading.Thread] = []
        self._read = self._delivered = self._retries = self._max_depth = 0
        self._failed: set[str] = set()
        self._failure: tuple[Publication | None, BaseException] | None = None
        self._undelivered: list[Publication] = []

    def start(self) -> None:
        """Start the workers; a dispatcher runs once."""
        if self._threads:
            raise ConfigurationError("dispatcher already started")
        name = type(self).__name__
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(self._workers)
        ]
        for thread in self._threads:
            thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> DispatchStats:
        """Stop and join the workers. ``drain=True`` reads until the source reports empty;
        ``drain=False`` stops reading now. Either way every publication already read is delivered
        (it has left the source, so dropping it would lose it). Raises `DispatchFailed` if the
        dispatcher failed stop."""
        # Plain stores, not under the input lock: the global-lock baseline holds that lock across
        # deliveries and Python locks are not fair, so stop() could starve. Readers check the
        # flags before each ``get``.
        if drain:
            self._draining = True
        else:
            self._stopping = True
        for thread in self._threads:
            thread.join(timeout)
        if any(thread.is_alive() for thread in self._threads):
            raise TimeoutError("dispatcher workers did not stop in time")
        error = self.error
        if error is not None:
            raise error
        return self.stats

    @property
    def stats(self) -> DispatchStats:
        with self._table_lock:
            return DispatchStats(self._read, self._delivered, self._retries, self._max_depth)

    @property
    def error(self) -> DispatchFailed | None:
        """The fail-stop error, built from the current undelivered list; None while healthy."""
        with self._table_lock:
            if self._failure is None:
                return None
            publication, cause = self._failure
            undelivered = tuple(self._undelivered)
        error = DispatchFailed(
            f"dispatch stopped after {cause!r}", publication=publication, undelivered=undelivered
        )
        error.__cause__ = cause
        return error

    def _work(self) -> None:
        raise NotImplementedError

    def _read_one(self) -> Publication | None:
        """One ``get`` under the input lock, which the caller holds; None if nothing came."""
        try:
            publication = self._source.get(timeout=self._poll)
        except queue.Empty:
            if self._draining:
                self._stopping = True
            return None
        except Exception as exc:  # a broken source: stop rather than spin on it
            self._fail(None, exc)
            return None
        with self._table_lock:
            self._read += 1
        return publication

    def _publish(self, publication: Publication) -> None:
        """Deliver while holding the publisher's turn: retry with back-off, then fail stop."""
        with self._table_lock:
            if publication.publisher_id in self._failed:
                self._undelivered.append(publication)  # behind a failure: keep, never deliver
                return
        for attempt in range(1, self._max_attempts + 1):
            try:
                self._deliver(publication)
            except Exception as exc:
                if attempt == self._max_attempts:
                    self._fail(publication, exc)
                    return
                with self._table_lock:
                    self._retries += 1
                time.sleep(self._backoff.compute(attempt))
            else:
                with self._table_lock:
                    self._delivered += 1
                return

    def _fail(self, publication: Publication | None, exc: BaseException) -> None:
        with self._table_lock:
            if self._failure is None:
                self._failure = (publication, exc)
            if publication is not None:
                self._failed.add(publication.publisher_id)
                self._undelivered.append(publication)
        # Fail stop: no new reads. Not under the input lock, which a reader may hold in ``get``;
        # a reader checks the flag before its next ``get``, and a bool store is atomic.
        self._stopping = True


class Dispatcher(_BaseDispatcher):
    """IPCOM000031305D's dispatcher: one input lock for reading, one FIFO of waiting workers per
    publisher, hand-over on completion. ``deliver(publication)`` delivers to every subscriber and
    may block; it runs on the worker threads, several at once for different publishers, never at
    once for one publisher."""

    def __init__(
        self,
        source: PublicationSource,
        deliver: Deliver,
        workers: int = 4,
        *,
        max_attempts: int = 3,
        backoff: Backoff | None = None,
        poll_interval: float = 0.02,
    ) -> None:
        super().__init__(
            source,
            deliver,
            workers,
            max_attempts=max_attempts,
            backoff=backoff,
            poll_interval=poll_interval,
        )
        # publisher id -> FIFO of parked workers; a key present means a worker holds its turn.
        self._publishing: dict[str, deque[_Waiter]] = {}

    def _work(self) -> None:
        while True:
            with self._input_lock:
                if self._stopping:
                    return
                publication = self._read_one()
                if publication is None:
                    continue
                waiter = self._claim(publication)
            # The input lock is released before waiting or delivering (the disclosure's vital rule).
            if waiter is not None:
                waiter.turn.wait()
            self._publish(publication)
            self._hand_over(publication.publisher_id)

    def _claim(self, publication: Publication) -> _Waiter | None:
        """Take the publisher's turn, or join its FIFO. Called under the input lock, so FIFO
        order is read order."""
        with self._table_lock:
            fifo = self._publishing.get(publication.publisher_id)
            if fifo is None:
                self._publishing[publication.publisher_id] = deque()
                return None
            waiter = _Waiter(publication)
            fifo.append(waiter)
            self._max_depth = max(self._max_depth, len(fifo))
            return waiter

    def _hand_over(self, publisher_id: str) -> None:
        """Pass the turn to the first parked worker, or clear the publisher."""
        with self._table_lock:
            fifo = self._publishing[publisher_id]
            if fifo:
                fifo.popleft().turn.set()
            else:
                del self._publishing[publisher_id]


class GlobalLockDispatcher(_BaseDispatcher):
    """The baseline the disclosure improves on: one lock held across read and deliver. Order is kept
    trivially and only one delivery runs at a time, however many workers there are."""

    def _work(self) -> None:
        while True:
            with self._input_lock:
                if self._stopping:
                    return
                publication = self._read_one()
                if publication is not None:
                    self._publish(publication)
