"""Message ids: uuid4 hex, from ``os.urandom`` read a block at a time.

``uuid.uuid4()`` reads 16 bytes with one ``getrandom`` call per id, and CPython releases the GIL
around it: a producer sending 100 messages per transaction handed the GIL to its transfer thread
100 times, and waited up to a switch interval each time to get it back. Reading 4 KiB at once
costs one call per 256 ids; the ids are the same (16 bytes from the kernel's generator, version
and variant bits set by `uuid.UUID`). A forked child must not reuse its parent's block (both would
hand out the same ids), so it starts a fresh one.
"""

from __future__ import annotations

import os
import threading
import uuid

_BLOCK = 4096


class _Ids:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._block = b""
        self._at = 0

    def forget(self) -> None:
        """In a forked child: the parent's block is the parent's."""
        self._lock = threading.Lock()
        self._block, self._at = b"", 0

    def next_hex(self) -> str:
        with self._lock:
            if self._at + 16 > len(self._block):
                self._block, self._at = os.urandom(_BLOCK), 0
            raw = self._block[self._at : self._at + 16]
            self._at += 16
        return uuid.UUID(bytes=raw, version=4).hex


_IDS = _Ids()
os.register_at_fork(after_in_child=_IDS.forget)


def new_id() -> str:
    """A fresh uuid4, as 32 hex digits."""
    return _IDS.next_hex()
