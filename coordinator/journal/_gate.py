"""A shared/exclusive gate, so a rollover sees its owner's state with no append half done.

A rollover carries the owner's live records into the new segment and deletes the old ones. If an
append were between "written to the old segment" and "recorded in the owner's state" at that
moment, its record would be in neither the carry nor any surviving segment: lost. So every append
holds the gate shared from before it writes until its state is updated, and the rollover holds it
exclusive. Shared holders never wait for each other (group commit keeps batching); an exclusive
waiter stops new shared entries, so a rollover cannot be starved by a busy log.
"""

from __future__ import annotations

import threading


class Gate:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    def enter_shared(self) -> None:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._shared += 1

    def exit_shared(self) -> None:
        with self._cond:
            self._shared -= 1
            if self._shared == 0 and self._waiting:
                self._cond.notify_all()

    def enter_exclusive(self) -> None:
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True

    def exit_exclusive(self) -> None:
        with self._cond:
            self._exclusive = False
            self._cond.notify_all()
