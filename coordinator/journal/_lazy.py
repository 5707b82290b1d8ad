"""Callbacks for lazy records, each run once its record is on disk (`coordinator.lazy_commit`).

A lazy record joins the journal's queue and is written by the next forced group. A store that
owes someone word of its durability (a commit record whose transaction may end only then) hands
the record's ticket to `LazyWatch.watch` with a callback. Nothing costs an fsync of its own while
the store is busy: its next forced record carries the lazy ones, and the owner calls `settle`
after each forced write, which runs the callbacks of what became durable. When no forced record
comes within ``delay`` seconds, a background thread fsyncs the queue itself, so an idle store
still makes its records durable promptly. A record whose write failed never runs its callback:
what it would have announced stays undone, and recovery finishes it after a restart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from coordinator.errors import LogError

from ._group_commit import Ticket
from ._journal import Journal

log = logging.getLogger("twopc.journal")

#: how long a lazy record waits for a forced record to carry it before an fsync of its own
DEFAULT_LAZY_DELAY = 0.002


class LazyWatch:
    """The lazy records of one journal that someone waits on, in queue order."""

    def __init__(self, journal: Journal, *, delay: float = DEFAULT_LAZY_DELAY, name: str) -> None:
        self._journal = journal
        self._delay = delay
        self._name = name
        self._lock = threading.Lock()
        self._serial = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._entries: deque[tuple[Ticket, Callable[[], None]]] = deque()
        self._closed = False
        self._thread: threading.Thread | None = None

    def watch(self, ticket: Ticket, callback: Callable[[], None]) -> None:
        """Run ``callback`` once ``ticket``'s record is durable (never, if its write fails)."""
        with self._lock:
            idle = not self._entries
            self._entries.append((ticket, callback))
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._run, name=f"twopc-lazy-{self._name}", daemon=True
                )
                self._thread.start()
            if idle:  # the thread sleeps until there is something to watch
                self._wake.notify()

    def settle(self) -> None:
        """Run the callbacks of every watched record already durable (cheap when none waits)."""
        if not self._entries:
            return
        with self._serial:  # callbacks in record order; a flush returns after those it made
            ready: list[Callable[[], None]] = []
            with self._lock:
                while self._entries and self._entries[0][0].done:
                    ticket, callback = self._entries.popleft()
                    if ticket.error is None:
                        ready.append(callback)
                    else:
                        log.error(
                            "%s: a lazy record was not written (%s); recovery finishes what it "
                            "announced after a restart",
                            self._name,
                            ticket.error.message,
                        )
            for callback in ready:
                try:
                    callback()
                except Exception:
                    log.exception("%s: a durability callback failed (ignored)", self._name)

    def flush(self) -> None:
        """Make every queued record durable now, then settle. The journal's flush whether or not
        anything is watched: a record may be queued and not yet handed to `watch`, and a journal
        that failed a write raises here though its failed entry has left the watch."""
        self._journal.flush()
        self.settle()

    def close(self) -> None:
        """Stop the thread; the journal's own close writes what is queued (then `settle`)."""
        with self._lock:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _stopped(self) -> bool:
        return self._closed

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._entries and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                first = self._entries[0][0]
                deadline = time.monotonic() + self._delay
                # a forced record may carry them meanwhile; only close() cuts the wait short
                while not first.done and not self._stopped():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._wake.wait(left)
                if self._stopped():
                    return
                carried = first.done
            try:
                if not carried:
                    self._journal.flush()
            except LogError as exc:  # the journal refuses writes from now on: nothing to wait for
                log.error("%s: fsync of lazy records failed: %s", self._name, exc.message)
                self.settle()
                return
            self.settle()
