"""Authenticated connections to one remote service, pooled: thread-safe, a few idle ones kept,
dead ones noticed before use.

Why a pool: every verb is one request on an authenticated connection, and opening one (TCP, TLS,
the shared-secret handshake) per verb would cost more than most verbs. A connection handed back
idle is checked before it is used again, because the server may have ended it meanwhile (it
restarted, or refused us): `_alive` tells.

A pool bound to an event loop (``loop``, set by the async resources of `messaging.remote.aio`)
opens `LoopLink` connections, whose bytes go through asyncio streams on that loop, whenever the
loop runs and the caller is another thread; otherwise (no loop yet, the loop ended, or a call on
the loop's own thread, such as a recovery pass at start-up) blocking ones. The two kinds are kept
idle apart: a loop's connection is no use without its loop.
"""

from __future__ import annotations

import asyncio
import ssl
import threading

from coordinator.aio import on_loop
from coordinator.errors import IllegalStateError
from messaging.auth import AuthError, SharedSecret, TlsConfig
from messaging.connection import Address, connect

from ._loop_link import Link, LoopLink, open_link
from .protocol import RemoteUnavailable


class _Pool:
    """Authenticated connections to one server: a few idle ones kept, dead ones dropped."""

    def __init__(
        self,
        address: Address,
        secret: SharedSecret | None,
        *,
        client_id: str,
        role: str,
        tls: ssl.SSLContext | TlsConfig | None,
        server_hostname: str | None,
        timeout: float,
        max_idle: int = 4,
    ) -> None:
        self.address = address
        self._secret = secret
        self._client_id = client_id
        self._role = role
        #: a `TlsConfig` is made a context once, here: its files are read once per pool
        self._tls = tls.client_context() if isinstance(tls, TlsConfig) else tls
        self._server_hostname = server_hostname
        self._timeout = timeout
        self._max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: list[Link] = []
        self._loop_idle: list[Link] = []
        self._closed = False
        #: the event loop whose streams carry the connections, when bound (module docstring)
        self.loop: asyncio.AbstractEventLoop | None = None

    def _usable_loop(self) -> asyncio.AbstractEventLoop | None:
        loop = self.loop
        if loop is None or not loop.is_running():
            return None
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        return None if running is loop else loop

    def acquire(self) -> Link:
        """An idle connection that still looks alive, or a new one. `RemoteUnavailable` if the
        server cannot be reached; an authentication failure (`AuthError`) is raised as it is:
        a wrong secret or role is a configuration error, not something to retry."""
        loop = self._usable_loop()
        idle = self._idle if loop is None else self._loop_idle
        while True:
            with self._lock:
                if self._closed:
                    raise IllegalStateError(f"connections to {self.address} are closed")
                conn = idle.pop() if idle else None
            if conn is None:
                break
            if _alive(conn):
                return conn
            conn.close()
        if loop is not None:
            return self._open_on(loop)
        try:
            return connect(
                self.address, self._secret, self._client_id, self._role, tls=self._tls,
                server_hostname=self._server_hostname, timeout=self._timeout,
            )  # fmt: skip
        except OSError as exc:
            raise RemoteUnavailable(
                f"cannot reach {self._role} service at {self.address}: {exc}"
            ) from exc

    def _open_on(self, loop: asyncio.AbstractEventLoop) -> Link:
        async def open_() -> LoopLink:
            try:
                return await open_link(
                    self.address, self._secret, self._client_id, self._role, tls=self._tls,
                    server_hostname=self._server_hostname, timeout=self._timeout,
                )  # fmt: skip
            except TimeoutError as exc:  # on_loop would take a TimeoutError for its own
                raise ConnectionError(f"connect timed out: {exc}") from exc

        try:
            return on_loop(loop, open_, None, what=f"connect to {self.address}")
        except AuthError:
            raise
        except (OSError, RuntimeError) as exc:
            raise RemoteUnavailable(
                f"cannot reach {self._role} service at {self.address}: {exc}"
            ) from exc

    def release(self, conn: Link) -> None:
        idle = self._loop_idle if isinstance(conn, LoopLink) else self._idle
        with self._lock:
            if not conn.closed and not self._closed and len(idle) < self._max_idle:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle = self._idle + self._loop_idle
            self._idle, self._loop_idle = [], []
        for conn in idle:
            conn.close()


def _alive(conn: Link) -> bool:
    """An idle connection has nothing to read; if it has (EOF, a refusal), it is dead."""
    if conn.closed:
        return False
    try:
        return not conn.readable()
    except (OSError, ValueError):
        return False
