"""`CountingProxy`: a TCP proxy on loopback that counts round trips (and, for PostgreSQL, the
statements that force the server's WAL), for ``bench/messaging_counts.py``.

Why a proxy and not a counter in the driver: it sees what goes on the wire, whichever code sent
it (SQLAlchemy, a raw DBAPI cursor, the transfer's framing), so a library change that merges or
pipelines statements shows up as fewer round trips without the bench knowing how it was done. A
**round trip** is a request burst: bytes from the client after the server last spoke (or after
the connection opened). Several statements sent before the client waits for an answer count
once, which is the cost a remote server charges.

With ``postgres=True`` the client's half is parsed as the PostgreSQL frontend protocol (startup,
SSL/GSS requests, then typed messages) and the SQL of each simple ``Query`` and extended-protocol
``Parse`` is classified: ``commit`` (COMMIT / END), ``prepare`` (PREPARE TRANSACTION),
``commit_prepared`` (COMMIT PREPARED), ``rollback`` (ROLLBACK, ROLLBACK PREPARED). Each of the
first three forces a WAL flush under ``synchronous_commit=on``.

`pause` holds the client-to-server direction (bytes wait in the proxy) until `resume`: a step of
a pipeline can run while the next one is held back, so counters read in between belong to one
step. Standard library only; threads and blocking sockets; for benchmarks.
"""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import threading
from collections import Counter

from loopback_proxy import LoopbackProxy  # type: ignore[import-not-found]

_CHUNK = 64 * 1024
_SSL_REQUEST, _GSS_REQUEST = 80877103, 80877104
_KINDS = (
    ("commit_prepared", re.compile(r"\bCOMMIT\s+PREPARED\b", re.I)),
    ("prepare", re.compile(r"\bPREPARE\s+TRANSACTION\b", re.I)),
    ("rollback", re.compile(r"\bROLLBACK\b", re.I)),
    ("commit", re.compile(r"\b(COMMIT|END)\b(?!\s+PREPARED)", re.I)),
)


def classify(sql: str) -> Counter[str]:
    """The transaction-control statements in ``sql`` (one query string may carry several)."""
    found: Counter[str] = Counter()
    for statement in sql.split(";"):
        for kind, pattern in _KINDS:
            if pattern.search(statement):
                found[kind] += 1
                break
    return found


class _FrontendParser:
    """Cuts the client's byte stream into PostgreSQL messages and counts their statements."""

    def __init__(self, counts: Counter[str]) -> None:
        self.counts = counts
        self.buffer = b""
        self.started = False

    def feed(self, data: bytes) -> None:
        self.buffer += data
        while True:
            if not self.started:
                if len(self.buffer) < 8:
                    return
                length, code = struct.unpack("!ii", self.buffer[:8])
                if len(self.buffer) < length:
                    return
                self.buffer = self.buffer[length:]
                self.started = code not in (_SSL_REQUEST, _GSS_REQUEST)
                continue
            if len(self.buffer) < 5:
                return
            kind = self.buffer[:1]
            (length,) = struct.unpack("!i", self.buffer[1:5])
            if len(self.buffer) < 1 + length:
                return
            body, self.buffer = self.buffer[5 : 1 + length], self.buffer[1 + length :]
            if kind == b"Q":
                self.counts.update(classify(body.split(b"\0", 1)[0].decode(errors="replace")))
            elif kind == b"P":
                sql = body.split(b"\0", 2)[1] if body.count(b"\0") >= 2 else b""
                self.counts.update(classify(sql.decode(errors="replace")))


class CountingProxy(LoopbackProxy):
    """Listens on 127.0.0.1 (``address``), forwards to ``upstream``, counts in `counts`:
    ``round_trips``, ``connections``, ``client_bytes``, ``server_bytes`` and, with ``postgres``,
    the statement kinds of `classify`."""

    def __init__(self, upstream: tuple[str, int], *, postgres: bool = False) -> None:
        super().__init__(upstream)
        self.postgres = postgres
        self.counts: Counter[str] = Counter()
        self._open = threading.Event()
        self._open.set()

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.counts)

    def pause(self) -> None:
        """Hold what clients send from now on until `resume`."""
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._open.set()  # a held client thread must see the close
        super().close()

    def _connected(self, client: socket.socket, server: socket.socket) -> None:
        with self._lock:
            self.counts["connections"] += 1
        last = ["server"]  # who spoke last on this connection
        parser = _FrontendParser(self.counts) if self.postgres else None
        for args in (
            (client, server, "client", last, parser),
            (server, client, "server", last, None),
        ):
            threading.Thread(target=self._pipe, args=args, daemon=True).start()

    def _pipe(
        self,
        src: socket.socket,
        dst: socket.socket,
        side: str,
        last: list[str],
        parser: _FrontendParser | None,
    ) -> None:
        try:
            while data := src.recv(_CHUNK):
                if side == "client":
                    self._open.wait()
                with self._lock:
                    if side == "client" and last[0] != "client":
                        self.counts["round_trips"] += 1
                    last[0] = side
                    self.counts[f"{side}_bytes"] += len(data)
                    if parser is not None:
                        parser.feed(data)
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
