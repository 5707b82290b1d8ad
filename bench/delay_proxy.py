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

import contextlib
import queue
import socket
import threading
import time
from types import TracebackType

_CHUNK = 64 * 1024


class DelayProxy:
    """Listens on 127.0.0.1 (``address``) and forwards to ``upstream`` with ``delay_ms`` each
    way."""

    def __init__(self, upstream: tuple[str, int], delay_ms: float) -> None:
        self.upstream = upstream
        self.delay = delay_ms / 1000.0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._closing = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> DelayProxy:
        threading.Thread(target=self._accept, name="delay-proxy-accept", daemon=True).start()
        return self

    def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, server]
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
