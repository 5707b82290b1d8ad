"""Authenticated framed connections over TCP, and the listener that accepts them.

Both servers (`twopc serve log|cursor`) and both kinds of client (a log's transfer to a cursor, an
application's remote resource) speak through these two classes, so every connection gets the same
handling: optional TLS first, then the shared-secret handshake (`auth`; per client with a
clients file, `authz`), then frames of at most
``max_frame`` bytes, checked header first (`frames`). Any bad frame closes *that* connection and
nothing else; the listener goes on accepting.

Threads, not asyncio: what sits behind a connection (the journal's fsync, a PostgreSQL commit in a
consumer's handler) blocks, and the number of connections a log or cursor serves is small (its
transfer peers and the applications' resource clients).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import select
import socket
import ssl
import threading
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING

from coordinator.errors import ConfigurationError, FrameError, TransactionError

from .auth import (
    CERTIFICATE_KEY,
    HANDSHAKE_TIMEOUT,
    Keys,
    Peer,
    SharedSecret,
    client_handshake,
    server_handshake,
)
from .frames import DEFAULT_MAX_FRAME, ErrorFrame, Frame, FrameReader, MsgBatch, encode, encode_many

if TYPE_CHECKING:
    from .authz import Authoriser
    from .frames import PackedMsg

log = logging.getLogger("twopc.connection")

#: the stats key counting defects (``internal-error``: a non-twopc exception in a handler)
INTERNAL_ERRORS = "internal_errors"

Address = tuple[str, int]

#: how much a connection reads at a time once a frame is due: a burst of MSG frames then costs
#: a system call per 64 KiB instead of two per frame (plus a ``select`` in `readable`)
READ_AHEAD = 64 * 1024


def parse_address(text: str, default_host: str = "127.0.0.1") -> Address:
    """``host:port``, ``:port`` or ``port``; IPv6 as ``[::1]:port``."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host.strip("[]") or default_host
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise ConfigurationError(f"bad address {text!r}: expected HOST:PORT")
    return host, number


class Connection:
    """One authenticated connection. ``send`` may be called from any thread (frames never
    interleave); ``recv`` from one reader thread only."""

    def __init__(
        self, sock: socket.socket, peer: Peer, *, max_frame: int = DEFAULT_MAX_FRAME
    ) -> None:
        self.sock = sock
        self.peer = peer
        self.max_frame = max_frame
        #: every frame after the handshake carries the version AUTH chose, both ways
        self.version = peer.version
        # The connection is the socket's last reader, so it may read ahead (see `readable`).
        self._reader = FrameReader(
            sock, max_frame=max_frame, versions=frozenset({peer.version}), read_ahead=READ_AHEAD
        )
        self._send_lock = threading.Lock()
        #: the messages of a MSGS frame not yet returned by `recv` (version 3)
        self._unbatched: deque[Frame] = deque()
        self._closed = threading.Event()
        self._timeout: float | object | None = object()  # what the socket has now

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def send(self, frame: Frame) -> None:
        self.send_many((frame,))

    def send_many(self, frames: Iterable[Frame | PackedMsg]) -> None:
        """Encode first, then one ``sendall``: a batch costs one system call, and a frame too
        large is refused (`ProgrammingError`) before any byte of the batch is sent. From version
        3, consecutive Msgs (or packed ones) go as MSGS frames (`frames.encode_many`)."""
        data = encode_many(frames, version=self.version, max_frame=self.max_frame)
        if not data:
            return
        with self._send_lock:
            self.sock.sendall(data)

    def readable(self) -> bool:
        """Is a frame's byte here already, so `recv` will not wait for the peer to start one?
        Bytes the reader read ahead, or that a TLS socket decrypted, are invisible to ``select``
        on the socket: they count too."""
        if self._unbatched or self._reader.pending():
            return True
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending() > 0:
            return True
        return bool(select.select([self.sock], [], [], 0)[0])

    def recv(self, timeout: float | None = None) -> Frame | None:
        """The next frame; None when the peer closed cleanly. ``timeout`` raises `TimeoutError`
        with the partial frame kept (call again). A bad frame raises `FrameError`: close.
        MSGS comes out as its Msgs, one per call."""
        if self._unbatched:
            return self._unbatched.popleft()
        if self._timeout != timeout:
            self.sock.settimeout(timeout)
            self._timeout = timeout
        frame = self._reader.read()
        if type(frame) is MsgBatch:
            self._unbatched.extend(frame.messages)
            return self._unbatched.popleft()
        return frame

    def refuse(self, code: str, message: str) -> None:
        """Best effort: tell the peer why we close (it may be gone already), then close."""
        with contextlib.suppress(OSError, FrameError):
            self.sock.settimeout(1.0)
            self._timeout = 1.0
            self.send(ErrorFrame(code, message[:500]))
        self.close()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def connect(
    address: Address,
    secret: SharedSecret | None,
    client_id: str,
    role: str,
    *,
    tls: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    server_id: str | None = None,
    timeout: float = HANDSHAKE_TIMEOUT,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> Connection:
    """Connect, wrap in TLS if asked, authenticate both ways. Raises `OSError` (refused,
    unreachable, reset) or `AuthError`; a half-made socket is closed either way.

    ``secret`` None: this client is known by its TLS client certificate alone (``tls`` must
    carry one; the server maps it in its clients file) and proves `CERTIFICATE_KEY`."""
    if secret is None:
        if tls is None:
            raise ConfigurationError("no secret and no TLS client certificate to connect with")
        secret = CERTIFICATE_KEY
    sock = socket.create_connection(address, timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=server_hostname or address[0])
        peer = client_handshake(sock, secret, client_id, role, server_id=server_id, timeout=timeout)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return Connection(sock, peer, max_frame=max_frame)


Handler = Callable[[Connection], None]


class Listener:
    """Accepts connections on ``address`` and serves each in its own thread: TLS, handshake
    (only the roles in ``handlers`` are admitted), then ``handlers[role](connection)``, which
    owns the connection until it returns. A handler's `FrameError` or `OSError` closes that
    connection (counted in ``stats``); another twopc error is sent as its code (``error_<code>``
    counted) and closes it; anything else is a defect: ``internal-error``, its traceback logged,
    counted as ``internal_errors``.

    With an ``authoriser`` (a clients file, `messaging.authz`) the handshake checks each client
    with its own key, or knows it by its certificate, and ``stats`` is the authoriser's, so the
    refusals it counts (``denied_*``) show here too; ``secret`` then admits nobody."""

    def __init__(
        self,
        address: Address,
        secret: SharedSecret | None,
        server_id: str,
        handlers: Mapping[str, Handler],
        *,
        tls: ssl.SSLContext | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_connections: int = 256,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        authoriser: Authoriser | None = None,
    ) -> None:
        if secret is None and authoriser is None:
            raise ConfigurationError("a listener needs a shared secret or a clients file")
        self.secret = secret
        #: per-client keys and grants (a clients file); None: the shared secret admits everyone
        self.authoriser = authoriser
        self.server_id = server_id
        self.handlers = dict(handlers)
        self.tls = tls
        self.max_frame = max_frame
        self.max_connections = max_connections
        self.handshake_timeout = handshake_timeout
        self.stats: Counter[str] = Counter() if authoriser is None else authoriser.stats
        self._sock = socket.create_server(address, reuse_port=False)
        self.address: Address = self._sock.getsockname()[:2]
        self._lock = threading.Lock()
        self._live: dict[int, socket.socket] = {}  # by accept number: TLS replaces the socket
        self._threads: set[threading.Thread] = set()
        self._closing = threading.Event()
        self._acceptor: threading.Thread | None = None

    @property
    def roles(self) -> Collection[str]:
        return self.handlers.keys()

    @property
    def open_connections(self) -> int:
        """Connections accepted and not yet ended (handshakes in progress included)."""
        with self._lock:
            return len(self._live)

    def start(self) -> Listener:
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"twopc-accept-{self.address[1]}", daemon=True
        )
        self._acceptor.start()
        return self

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                sock, peer_address = self._sock.accept()
            except OSError:
                if self._closing.is_set():
                    return
                log.exception("accept failed on %s", self.address)
                continue
            with self._lock:
                if len(self._live) >= self.max_connections:
                    self.stats["refused_full"] += 1
                    sock.close()
                    continue
                token = self.stats["accepted"] = self.stats["accepted"] + 1
                self._live[token] = sock
                thread = threading.Thread(
                    target=self._serve,
                    args=(token, sock, peer_address),
                    name=f"twopc-conn-{peer_address[1]}",
                    daemon=True,
                )
                self._threads.add(thread)
            thread.start()

    def _serve(self, token: int, sock: socket.socket, peer_address: object) -> None:
        conn: Connection | None = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.handshake_timeout)
            if self.tls is not None:
                sock = self._wrap(sock)
                with self._lock:
                    self._live[token] = sock
            peer = self._handshake(sock)
            sock.settimeout(None)
            conn = Connection(sock, peer, max_frame=self.max_frame)
            self.stats["authenticated"] += 1
            if self.authoriser is not None:
                self.authoriser.admit(peer)
            self.handlers[peer.role](conn)
        except FrameError as exc:
            self.stats["bad_frames" if conn is not None else "refused_handshake"] += 1
            log.warning("closing connection from %s: %s", peer_address, exc)
            if conn is not None:
                conn.refuse("bad-frame", str(exc))
        except (OSError, ssl.SSLError) as exc:
            self.stats["connection_errors"] += 1
            log.info("connection from %s ended: %s", peer_address, exc)
        except TransactionError as exc:  # a documented refusal (a journal that cannot write...)
            self.stats[f"error_{exc.code}"] += 1
            log.error("closing connection from %s: %s", peer_address, exc)
            _refuse(conn, sock, exc.code, exc.message[:500])
        except Exception:  # a defect: the one place a traceback is logged, and counted
            self.stats[INTERNAL_ERRORS] += 1
            log.exception("handler failed for %s", peer_address)
            if conn is not None:
                conn.refuse("internal-error", "the server failed; see its log")
        finally:
            if conn is not None:
                conn.close()
            else:
                sock.close()
            with self._lock:
                self._live.pop(token, None)
                self._threads.discard(threading.current_thread())

    def _wrap(self, sock: socket.socket) -> socket.socket:
        """TLS first; a peer TLS refuses (no client certificate, or one no trusted CA signed,
        when client certificates are required) is counted as ``refused_tls``."""
        assert self.tls is not None
        try:
            return self.tls.wrap_socket(sock, server_side=True)
        except ssl.SSLError:
            self.stats["refused_tls"] += 1
            raise

    def _handshake(self, sock: socket.socket) -> Peer:
        """The shared-secret handshake, with the clients file's keys when there is one; a client
        known by its certificate is known by its entry's name, whatever AUTH called it."""
        keys: Keys = self.secret if self.secret is not None else _NO_KEYS
        known_as = None
        if self.authoriser is not None:
            keys, known_as = self.authoriser.handshake_keys(sock)
        peer = server_handshake(
            sock, keys, self.server_id, roles=self.roles, timeout=self.handshake_timeout
        )
        return peer if known_as is None else dataclasses.replace(peer, id=known_as)

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, shut every connection (their handlers see EOF or an error), and wait
        for the handlers to return."""
        self._closing.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            live, threads = list(self._live.values()), list(self._threads)
        for sock in live:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._acceptor is not None:
            self._acceptor.join(timeout)
        for thread in threads:
            thread.join(timeout)

    def __enter__(self) -> Listener:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _NoKeys:
    """`Keys` of a listener with neither secret nor clients file (refused at construction)."""

    def key_for(self, client_id: str) -> SharedSecret | None:
        return None


_NO_KEYS = _NoKeys()


def _refuse(conn: Connection | None, sock: socket.socket, code: str, message: str) -> None:
    """Tell the peer why it is closed: on its connection, or, refused before the handshake
    (a client certificate no client maps to), on the bare socket. Best effort either way."""
    if conn is not None:
        conn.refuse(code, message)
        return
    with contextlib.suppress(OSError):
        sock.settimeout(1.0)
        sock.sendall(encode(ErrorFrame(code, message)))
