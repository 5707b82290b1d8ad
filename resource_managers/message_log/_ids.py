"""Message ids: uuid4 hex, from ``os.urandom`` read a block at a time.

``uuid.uuid4()`` reads 16 bytes with one ``getrandom`` call per id, and CPython releases the GIL
around it: a producer sending 100 messages per transaction handed the GIL to its transfer thread
100 times, and waited up to a switch interval each time to get it back. Reading 4 KiB at once
costs one call per 256 ids; the ids are the same (16 bytes from the kernel's generator, version
and variant bits set as `uuid.UUID` sets them). A forked child must not reuse its parent's block
(both would hand out the same ids), so it starts a fresh one.
"""

from __future__ import annotations

import os
import threading

_BLOCK = 4096


#: the hex digit that starts the clock-sequence field, by the random one it replaces: the
#: variant bits 10 (RFC 4122), as `uuid.UUID(..., version=4)` sets them
_VARIANT = {d: "89ab"[int(d, 16) & 3] for d in "0123456789abcdef"}


class _Ids:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hex = ""
        self._at = 0

    def forget(self) -> None:
        """In a forked child: the parent's block is the parent's."""
        self._lock = threading.Lock()
        self._hex, self._at = "", 0

    def next_hex(self) -> str:
        """``uuid.UUID(bytes=<16 random bytes>, version=4).hex``, cut from a block already in
        hex: the version digit and the variant bits set by hand (a `uuid.UUID` per id was a
        tenth of a producer's time at 100 messages per transaction)."""
        with self._lock:
            if self._at + 32 > len(self._hex):
                self._hex, self._at = os.urandom(_BLOCK).hex(), 0
            h = self._hex[self._at : self._at + 32]
            self._at += 32
        return h[:12] + "4" + h[13:16] + _VARIANT[h[16]] + h[17:]


_IDS = _Ids()
os.register_at_fork(after_in_child=_IDS.forget)


def new_id() -> str:
    """A fresh uuid4, as 32 hex digits."""
    return _IDS.next_hex()
