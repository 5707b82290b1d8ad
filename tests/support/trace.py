"""`traced`: the crash points a block of code reaches, in order (`coordinator.crashpoints.observe`).

Tests that check the order of protocol steps read it; nothing is armed, so nothing dies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from coordinator import crashpoints


@contextlib.contextmanager
def traced() -> Iterator[list[str]]:
    """Yield the list the points reached inside the block are appended to."""
    seen: list[str] = []
    crashpoints.observe(seen.append)
    try:
        yield seen
    finally:
        crashpoints._observers.remove(seen.append)
