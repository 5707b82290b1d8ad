"""Named crash points: every protocol step can be turned into a real ``kill -9``.

A process started with ``TWOPC_CRASH_AT=name[:nth]`` sends itself SIGKILL the nth time (default the
first) it reaches the point called ``name``; several points may be armed, separated by commas.
Unarmed, a point costs one dictionary lookup, so they stay in production code: the crash tests
exercise the very code that runs for users. ``docs/crash-points.md`` is the catalogue.

Why SIGKILL and not an exception: an exception runs ``finally`` blocks, flushes buffers and closes
files, which is exactly what a real crash does not do.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

ENV_VAR = "TWOPC_CRASH_AT"

_lock = threading.Lock()
_armed: dict[str, int] = {}
_hits: dict[str, int] = {}
_observers: list[Callable[[str], None]] = []


def parse(spec: str) -> dict[str, int]:
    """``"a,b:3"`` -> ``{"a": 1, "b": 3}``; a malformed spec is an error, never silently ignored."""
    armed: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, nth = item.partition(":")
        if not name or (nth and (not nth.isdigit() or int(nth) < 1)):
            raise ValueError(f"{ENV_VAR}: bad crash point spec {item!r}; expected name[:nth]")
        armed[name] = int(nth) if nth else 1
    return armed


def arm(spec: str) -> None:
    """Arm points in this process (tests that re-exec themselves use the environment instead)."""
    with _lock:
        _armed.clear()
        _hits.clear()
        _armed.update(parse(spec))


def observe(callback: Callable[[str], None]) -> None:
    """Call ``callback(name)`` at every point reached: the trace the model and docs share."""
    _observers.append(callback)


def crash_point(name: str) -> None:
    """Die here, by SIGKILL, if this point is armed and this is its nth hit."""
    if not _armed and not _observers:  # production: nothing armed, nobody tracing
        return
    for callback in _observers:
        callback(name)
    if not _armed:
        return
    with _lock:
        nth = _armed.get(name)
        if nth is None:
            return
        _hits[name] = hit = _hits.get(name, 0) + 1
    if hit == nth:
        die(name)


def is_armed(name: str) -> bool:
    return name in _armed


def die(name: str) -> None:
    # stderr is unbuffered; the line tells the test harness which point fired.
    sys.stderr.write(f"twopc: crash point {name} reached, killing process {os.getpid()}\n")
    os.kill(os.getpid(), signal.SIGKILL)


if os.environ.get(ENV_VAR):
    arm(os.environ[ENV_VAR])
