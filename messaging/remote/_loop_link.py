"""`LoopLink`: an authenticated connection on asyncio streams, used from other threads as a
blocking `Connection` is.

Why a blocking face on asyncio streams: the remote resources' meaning (which verb may be repeated,
what a broken connection means, the pinned consumer connection, lazy commit answers) lives in
`_resource`, `_remote_log` and `_remote_cursor`, written against a blocking connection. The async
resources (`messaging.remote.aio`) keep that one implementation and change only where the bytes
go: every frame is written and read by ``asyncio.open_connection`` streams on the branch's event
loop, with the same codec (`messaging.frames.read_frame`/`write_frame`) and the same handshake
(`messaging.auth.client_handshake_async`). The thread that asks (completion's worker, a receive's
thread) waits with `coordinator.aio.on_loop`; the loop stays free.

A read that times out leaves its task running, and the next `recv` waits for that same task, so
no part of a frame is lost, as with a socket timeout. A loop that stopped reads as a broken
connection (`OSError`), which each verb already knows how to judge.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

from coordinator.aio import on_loop
from coordinator.errors import ConfigurationError
from messaging.auth import CERTIFICATE_KEY, SharedSecret, client_handshake_async
from messaging.connection import Address
from messaging.frames import DEFAULT_MAX_FRAME, Frame, read_frame, write_frame

T = TypeVar("T")


class Link(Protocol):
    """What the remote resources use of a connection: a `Connection`, or a `LoopLink`."""

    #: the protocol version the handshake chose
    version: int

    @property
    def closed(self) -> bool: ...

    def send(self, frame: Frame) -> None: ...

    def recv(self, timeout: float | None = None) -> Frame | None: ...

    def readable(self) -> bool: ...

    def close(self) -> None: ...


class LoopLink:
    """One authenticated connection whose streams live on ``loop`` (see the module docstring).
    One thread at a time reads it (the pool hands it to one user), as a `Connection`."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        version: int,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> None:
        self.loop = loop
        self._reader = reader
        self._writer = writer
        self.version = version
        self.max_frame = max_frame
        self._reading: asyncio.Task[Frame | None] | None = None  # a read not yet taken
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def _run(self, work: Callable[[], Coroutine[Any, Any, T]], what: str) -> T:
        """``work()`` on the loop, waited for here; a stopped loop is a broken connection."""
        if self._closed:
            raise OSError(f"{what}: the connection is closed")
        try:
            return on_loop(self.loop, work, None, what=what)
        except RuntimeError as exc:  # the loop stopped: its streams are gone with it
            self._closed = True
            raise OSError(f"{what}: {exc}") from exc

    def send(self, frame: Frame) -> None:
        async def write() -> None:
            await write_frame(self._writer, frame, version=self.version, max_frame=self.max_frame)

        self._run(write, "send")

    def _read_task(self) -> asyncio.Task[Frame | None]:
        """The read in progress, or a new one (on the loop only)."""
        if self._reading is None:
            self._reading = asyncio.ensure_future(
                read_frame(
                    self._reader, max_frame=self.max_frame, versions=frozenset({self.version})
                )
            )
        return self._reading

    def recv(self, timeout: float | None = None) -> Frame | None:
        """The next frame, None at a clean end; `TimeoutError` keeps the read going for the
        next call; a bad frame raises `FrameError`."""

        async def read() -> tuple[bool, Frame | None]:
            task = self._read_task()
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if not done:
                return False, None
            self._reading = None
            return True, task.result()

        # The timeout is raised here, not in the coroutine: `on_loop` would take a TimeoutError
        # out of the loop (concurrent.futures.TimeoutError is the same class) for its own.
        arrived, frame = self._run(read, "recv")
        if not arrived:
            raise TimeoutError(f"no frame within {timeout} s")
        return frame

    def readable(self) -> bool:
        """Has a frame (or the end) arrived already? Looks by starting the read and giving it a
        few turns of the loop: bytes already received complete it at once."""

        async def peek() -> bool:
            task = self._read_task()
            for _ in range(4):
                if task.done():
                    return True
                await asyncio.sleep(0)
            return task.done()

        return self._run(peek, "readable")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        def shut() -> None:
            if self._reading is not None:
                self._reading.cancel()
            self._writer.close()

        with contextlib.suppress(RuntimeError):  # the loop is closed: so are its transports
            self.loop.call_soon_threadsafe(shut)


async def open_link(
    address: Address,
    secret: SharedSecret | None,
    client_id: str,
    role: str,
    *,
    tls: ssl.SSLContext | None,
    server_hostname: str | None,
    timeout: float,
) -> LoopLink:
    """`messaging.connection.connect` on asyncio streams: connect, TLS if asked, authenticate
    both ways. Raises `OSError` or `AuthError`, the connection closed either way."""
    if secret is None:
        if tls is None:
            raise ConfigurationError("no secret and no TLS client certificate to connect with")
        secret = CERTIFICATE_KEY
    host, port = address
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(
            host, port, ssl=tls, server_hostname=(server_hostname or host) if tls else None
        ),
        timeout,
    )
    try:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = await client_handshake_async(
            reader, writer, secret, client_id, role, timeout=timeout
        )
    except BaseException:
        writer.close()
        raise
    return LoopLink(asyncio.get_running_loop(), reader, writer, peer.version)
