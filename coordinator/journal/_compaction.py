"""`Compaction`: when the journal asks, carry its owner's live records into a fresh segment.

Every store on the journal (the decision log, the message log, the cursor) compacts the same way:
one rollover at a time, after an append and outside the gate, holding the gate exclusive so no
append is half done (see `Gate`), with the owner saying what is still live. A failure is logged,
not raised: the record that triggered it is already durable, and reporting its write as failed
would be a lie. The next append tries again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from ._gate import Gate
from ._journal import Journal


class Compaction:
    """``carry`` runs under the exclusive gate and returns every live record, encoded; a failure
    goes to the owner's ``log`` (operators filter by the store, not by the journal)."""

    def __init__(
        self,
        journal: Journal,
        gate: Gate,
        carry: Callable[[], Iterable[bytes]],
        what: str,
        log: logging.Logger,
    ) -> None:
        self._journal = journal
        self._gate = gate
        self._carry = carry
        self._what = what
        self._log = log
        self._rolling = threading.Lock()

    def maybe(self) -> None:
        journal = self._journal
        if journal.poisoned:  # it refuses writes until reopened, a rollover's too: no traceback
            return
        if not journal.needs_rollover or not self._rolling.acquire(blocking=False):
            return
        try:
            self._gate.enter_exclusive()
            try:
                if self._journal.needs_rollover:
                    self._journal.rollover(self._carry())
            finally:
                self._gate.exit_exclusive()
        except Exception:
            self._log.exception("%s: rollover failed, will retry", self._what)
        finally:
            self._rolling.release()
