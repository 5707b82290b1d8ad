"""Authenticated connections to one remote service, pooled: thread-safe, a few idle ones kept,
dead ones noticed before use.

Why a pool: every verb is one request on an authenticated connection, and opening one (TCP, TLS,
the shared-secret handshake) per verb would cost more than most verbs. A connection handed back
idle is checked before it is used again, because the server may have ended it meanwhile (it
restarted, or refused us): `_alive` tells.
"""

from __future__ import annotations

import ssl
import threading

from coordinator.errors import IllegalStateError
from messaging.auth import SharedSecret, TlsConfig
from messaging.connection import Address, Connection, connect

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
        self._idle: list[Connection] = []
        self._closed = False

    def acquire(self) -> Connection:
        """An idle connection that still looks alive, or a new one. `RemoteUnavailable` if the
        server cannot be reached; an authentication failure (`AuthError`) is raised as it is:
        a wrong secret or role is a configuration error, not something to retry."""
        while True:
            with self._lock:
                if self._closed:
                    raise IllegalStateError(f"connections to {self.address} are closed")
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                break
            if _alive(conn):
                return conn
            conn.close()
        try:
            return connect(
                self.address, self._secret, self._client_id, self._role, tls=self._tls,
                server_hostname=self._server_hostname, timeout=self._timeout,
            )  # fmt: skip
        except OSError as exc:
            raise RemoteUnavailable(
                f"cannot reach {self._role} service at {self.address}: {exc}"
            ) from exc

    def release(self, conn: Connection) -> None:
        with self._lock:
            if not conn.closed and not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _alive(conn: Connection) -> bool:
    """An idle connection has nothing to read; if it has (EOF, a refusal), it is dead."""
    if conn.closed:
        return False
    try:
        return not conn.readable()
    except (OSError, ValueError):
        return False
