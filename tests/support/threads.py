"""`run_threads`: run threads side by side and wait for all of them."""

from __future__ import annotations

import threading
from collections.abc import Iterable


def run_threads(threads: Iterable[threading.Thread]) -> None:
    """Start every thread, then join every one; each is started before any is waited for."""
    workers = list(threads)
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
