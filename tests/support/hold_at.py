"""`held_at`: hold the thread that reaches a crash point until the test lets it go.

For tests that must act at an exact protocol step in-process (cancel the task awaiting a commit
right after the decision is forced, say) without killing anything: the observer of
`coordinator.crashpoints` blocks the thread that reached the point.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from coordinator import crashpoints


@contextlib.contextmanager
def held_at(point: str, timeout: float = 10) -> Iterator[tuple[threading.Event, threading.Event]]:
    """(reached, release): ``reached`` is set when a thread arrives at ``point``, which then
    waits for ``release`` (at most ``timeout`` seconds). The observer goes away on exit."""
    reached, release = threading.Event(), threading.Event()

    def hold(name: str) -> None:
        if name == point:
            reached.set()
            release.wait(timeout)

    crashpoints.observe(hold)
    try:
        yield reached, release
    finally:
        release.set()
        crashpoints._observers.remove(hold)
