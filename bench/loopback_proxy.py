"""`LoopbackProxy`: what the benchmarks' TCP proxies share — a listener on 127.0.0.1, one
upstream connection per client (``TCP_NODELAY`` both ways), start, close and the context
manager. A subclass says what to do with each connected pair (`_connected`): `DelayProxy` delays
the bytes, `CountingProxy` counts them. Standard library only; threads and blocking sockets.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType
from typing import TypeVar

_P = TypeVar("_P", bound="LoopbackProxy")


class LoopbackProxy:
    """Listens on 127.0.0.1 (``address``) and connects each client to ``upstream``."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._closing = threading.Event()
        self._sockets: list[socket.socket] = []

    def start(self: _P) -> _P:
        name = f"{type(self).__name__}-accept"
        threading.Thread(target=self._accept, name=name, daemon=True).start()
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

    def __enter__(self: _P) -> _P:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _connected(self, client: socket.socket, server: socket.socket) -> None:
        """A client and its upstream connection: start moving bytes between them."""
        raise NotImplementedError

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
            self._connected(client, server)
