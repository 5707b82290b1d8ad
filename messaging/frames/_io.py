"""Reading and writing frames on sockets and asyncio streams, every check before a payload
byte is read."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import (
    Any,
    Protocol,
    runtime_checkable,
)

from coordinator.errors import FrameError, ProgrammingError

from ._base import DEFAULT_MAX_FRAME, HEADER_SIZE, PROTOCOL_VERSION, SUPPORTED_VERSIONS, bad_frame
from ._codec import Header, decode_payload, encode, parse_header
from ._schema import Frame

# -- I/O -------------------------------------------------------------------------------------------


@runtime_checkable
class _Socket(Protocol):
    def recv_into(self, buffer: Any, nbytes: int = ..., flags: int = ...) -> int: ...


class _Stream(Protocol):
    def readinto(self, buffer: Any) -> int | None: ...


class FrameReader:
    """Frames from a blocking socket (``recv_into``) or binary stream (``readinto``).

    No read-ahead by default: it asks for exactly the rest of the current header or payload,
    never a byte of the next frame, so the handshake's small pre-auth reader can hand the socket
    on to a full-size reader with nothing lost, and a bad header costs one 16-byte read. Pass the
    socket itself: ``sock.makefile()`` reads ahead, and what it took would be lost to the next
    reader. ``read_ahead`` (bytes) is for the last reader of a socket, which nothing follows (a
    `Connection`'s): it reads up to that much at a time, so a burst of small frames costs one
    system call, not two per frame; `pending` tells how much it holds that ``select`` cannot see.
    A socket timeout keeps the part already read: call `read` again. After a `FrameError` every
    call raises it again, because the stream is out of step and must be closed.
    """

    def __init__(
        self,
        source: _Socket | _Stream,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        versions: frozenset[int] = SUPPORTED_VERSIONS,
        read_ahead: int = 0,
    ) -> None:
        if not HEADER_SIZE < max_frame <= HEADER_SIZE + 0xFFFFFFFF:
            raise ProgrammingError(
                f"max_frame {max_frame} must exceed the {HEADER_SIZE}-byte header"
            )
        self._recv = source.recv_into if isinstance(source, _Socket) else source.readinto
        self.max_frame = max_frame
        self.versions = versions
        self._head = bytearray(HEADER_SIZE)
        self._header: Header | None = None
        self._payload = bytearray()
        self._got = 0
        self._failed: FrameError | None = None
        self._ahead = memoryview(bytearray(read_ahead))  # bytes read past the current frame
        self._ahead_at = self._ahead_end = 0

    def pending(self) -> int:
        """Bytes already read from the source and not yet returned in a frame."""
        return self._ahead_end - self._ahead_at

    def _fill(self, buf: bytearray, *, boundary: bool) -> bool:
        view = memoryview(buf)
        n: int | None
        while self._got < len(buf):
            want = len(buf) - self._got
            if self._ahead_end > self._ahead_at:  # read ahead before: take from there first
                n = min(want, self._ahead_end - self._ahead_at)
                view[self._got : self._got + n] = self._ahead[self._ahead_at : self._ahead_at + n]
                self._ahead_at += n
                self._got += n
                continue
            if want < len(self._ahead):  # small: read what has come, up to the buffer's size
                n = self._recv(self._ahead)
                if n:
                    self._ahead_at, self._ahead_end = 0, n
                    continue
            else:  # large (or no read-ahead): straight into place
                n = self._recv(view[self._got :])
            if n is None:
                raise ProgrammingError("FrameReader needs a blocking stream")
            if n == 0:
                if boundary and self._got == 0:
                    return False
                where = "header" if boundary else "payload"
                raise bad_frame(
                    "truncated", f"connection closed inside a frame {where}", len(buf), self._got
                )
            self._got += n
        self._got = 0
        return True

    def read(self) -> Frame | None:
        """The next frame, or None when the peer closed cleanly between frames."""
        if self._failed is not None:
            raise self._failed
        try:
            if self._header is None:
                if not self._fill(self._head, boundary=True):
                    return None
                self._header = parse_header(
                    self._head, max_frame=self.max_frame, versions=self.versions
                )
                self._payload = bytearray(self._header.length)  # only now: the length passed
            self._fill(self._payload, boundary=False)
            header, self._header = self._header, None
            payload, self._payload = self._payload, bytearray()
            return decode_payload(self._head, header, payload)
        except FrameError as exc:
            self._failed = exc
            raise

    def __iter__(self) -> Iterator[Frame]:
        while (frame := self.read()) is not None:
            yield frame


class _Sender(Protocol):
    def sendall(self, data: bytes, /) -> None: ...


def send_frame(
    sock: _Sender,
    frame: Frame,
    *,
    version: int = PROTOCOL_VERSION,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> None:
    """Encode and send one frame; callers sharing a socket between threads hold a lock. After
    the handshake, ``version`` is the one it chose (`auth.Peer.version`)."""
    sock.sendall(encode(frame, version=version, max_frame=max_frame))


async def read_frame(
    reader: asyncio.StreamReader,
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
    versions: frozenset[int] = SUPPORTED_VERSIONS,
) -> Frame | None:
    """The asyncio twin of `FrameReader.read`. Cancelled mid-frame, the stream is out of step."""
    try:
        head = await reader.readexactly(HEADER_SIZE)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise bad_frame(
            "truncated", "connection closed inside a frame header", HEADER_SIZE, len(exc.partial)
        ) from None
    header = parse_header(head, max_frame=max_frame, versions=versions)
    try:
        payload = await reader.readexactly(header.length)
    except asyncio.IncompleteReadError as exc:
        raise bad_frame(
            "truncated", "connection closed inside a frame payload", header.length, len(exc.partial)
        ) from None
    return decode_payload(head, header, payload)


async def write_frame(
    writer: asyncio.StreamWriter,
    frame: Frame,
    *,
    version: int = PROTOCOL_VERSION,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> None:
    """The asyncio twin of `send_frame`."""
    writer.write(encode(frame, version=version, max_frame=max_frame))
    await writer.drain()
