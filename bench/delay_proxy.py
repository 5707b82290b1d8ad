"""`DelayProxy`: a TCP proxy on loopback that adds a fixed one-way delay in each direction.

Why: on one machine every round trip to PostgreSQL takes tens of microseconds, so a design that
saves round trips or overlaps them (parallel prepare and commit, asynchronous phase two) cannot
show what it is worth. Behind this proxy each database sits ``delay_ms`` away, as a database in
another rack or zone would. Data is delayed, not throttled: a reader thread stamps each chunk with
its due time and a writer thread sends it then, so pipelined traffic keeps flowing.

Standard library only; threads and blocking sockets; for benchmarks, not for tests of faults
(``tests/support/fault_proxy.py`` does those).
"""

from __future__ import annotations

import queue
import socket
import threading
import time

from loopback_proxy import LoopbackProxy  # type: ignore[import-not-found]

_CHUNK = 64 * 1024


class DelayProxy(LoopbackProxy):
    """Listens on 127.0.0.1 (``address``) and forwards to ``upstream`` with ``delay_ms`` each
    way."""

    def __init__(self, upstream: tuple[str, int], delay_ms: float) -> None:
        super().__init__(upstream)
        self.delay = delay_ms / 1000.0

    def _connected(self, client: socket.socket, server: socket.socket) -> None:
        self._pipe(client, server)
        self._pipe(server, client)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        due: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

        def read() -> None:
            try:
                while data := src.recv(_CHUNK):
                    due.put((time.monotonic() + self.delay, data))
            except OSError:
                pass
            due.put((0.0, b""))  # end of stream

        def write() -> None:
            try:
                while True:
                    when, data = due.get()
                    if not data:
                        break
                    wait = when - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    dst.sendall(data)
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        threading.Thread(target=read, name="delay-proxy-read", daemon=True).start()
        threading.Thread(target=write, name="delay-proxy-write", daemon=True).start()
