"""Mutual authentication at connect with a shared secret, and optional TLS.

The handshake, before any other frame is accepted::

    server -> HELLO    nonce_s (32 random bytes), server_id, versions
    client -> AUTH     client_id, nonce_c, role, version, proof = HMAC(secret, transcript(client))
    server -> WELCOME  proof = HMAC(secret, transcript(server))       or ERROR, then close

``transcript(side)`` is the canonical `encode_value` of a map holding the side label, both
nonces, both ids, the role, the server's version list and the chosen version. The encoding is
length-prefixed, so no two transcripts share bytes ("ab" + "c" is not "a" + "bc"); the side label
keeps a server proof from being reflected back as a client proof; binding the role and versions
stops a man in the middle from raising a role or forcing a downgrade. A recorded AUTH is useless
on another connection, because the server's nonce is fresh for each; a recorded WELCOME is
useless because the client's is. Proofs are compared with `hmac.compare_digest`.

Before WELCOME a connection may send one frame of at most `PRE_AUTH_MAX_FRAME` bytes, within
one deadline for the whole handshake (not per read, so trickling bytes does not extend it): an
unauthenticated peer costs 4 KiB and a few seconds, never 16 MiB. Any failure raises `AuthError`
(a `FrameError`, code ``bad-frame``) after a best-effort ERROR frame, and the handshake closes
the socket: nothing else is touched. A peer that failed the proof is told only ``auth-failed``;
the precise reason goes to the local exception. ERROR codes sent: ``auth-failed``,
``auth-required``, ``forbidden-role``, ``unsupported-version``, ``auth-timeout``, ``bad-frame``.

TLS is optional and orthogonal: wrap the socket with a `TlsConfig` context first, then run the
handshake inside it (the secret still authenticates the peer; TLS adds secrecy and server
identity). Authentication admits a peer to the protocol; it grants no power over outcomes: a
transaction's outcome is decided by the coordinator's log, never by anything a peer sends.

Why one module: the handshake's two halves (the client's proof, the server's check) and the
transcript both sign are kept together, so that a change to one side cannot miss the other; the
TLS configuration beside them is what wraps the same socket first.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import secrets
import socket
import ssl
import time
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any, Protocol, TypeVar

from coordinator.errors import ConfigurationError, FrameError

from .frames import (
    HANDSHAKE_VERSIONS,
    SUPPORTED_VERSIONS,
    Auth,
    ErrorFrame,
    Frame,
    FrameReader,
    Hello,
    Welcome,
    encode,
    encode_value,
    read_frame,
    send_frame,
    write_frame,
)

PRE_AUTH_MAX_FRAME = 4096
NONCE_BYTES = 32
HANDSHAKE_TIMEOUT = 10.0
MIN_SECRET_BYTES = 16
_ID = re.compile(r"[\x21-\x7e]{1,64}\Z")
#: ``AuthError.what`` -> the code the peer is told in its ERROR frame; anything else: bad-frame
_PUBLIC_CODES = {
    "proof": "auth-failed",
    "sequence": "auth-required",
    "role": "forbidden-role",
    "version": "unsupported-version",
    "timeout": "auth-timeout",
}


class AuthError(FrameError):
    """The peer did not prove it holds the secret, or broke the handshake; ``what`` says how
    (``proof``, ``identity``, ``sequence``, ``role``, ``version``, ``timeout``, ``closed``,
    ``refused``)."""


class SharedSecret:
    """The key both ends hold. Never printed, never compared with ``==``: it only makes MACs."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) < MIN_SECRET_BYTES:
            raise ConfigurationError(f"a shared secret needs at least {MIN_SECRET_BYTES} bytes")
        self._key = key

    @classmethod
    def from_file(cls, path: str | Path) -> SharedSecret:
        """Read a secret file; one trailing newline (as editors write) is not part of it."""
        data = Path(path).read_bytes()
        return cls(data[:-1] if data.endswith(b"\n") else data)

    def mac(self, data: bytes) -> bytes:
        return hmac.new(self._key, data, sha256).digest()

    def key_for(self, client_id: str) -> SharedSecret:
        """`Keys`: with one shared secret every client's key is the same."""
        return self

    def __repr__(self) -> str:
        return "SharedSecret(***)"

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("a SharedSecret is not pickled: it would travel in the clear")


class Keys(Protocol):
    """Where a server finds the key a client's proof is checked with: one `SharedSecret` for
    every client, or a key per client (`messaging.authz.Authoriser`, from a clients file). None:
    no such client, refused as a wrong proof would be (the peer learns nothing of who exists)."""

    def key_for(self, client_id: str) -> SharedSecret | None: ...


#: The proof key of a client that a server identifies by its TLS certificate and that holds no
#: secret of its own: public by design. The handshake then authenticates nothing (TLS did); it
#: still binds role and version, and the frames stay the same for every kind of client.
CERTIFICATE_KEY = SharedSecret(b"twopc: identity by TLS client certificate")
#: checked against when a client is unknown, so the answer takes as long as for a known one
_NOBODY = SharedSecret(secrets.token_bytes(32))


@dataclass(frozen=True)
class Peer:
    """Who is on the other end, once proven: its id, the role it asked for, the version spoken."""

    id: str
    role: str
    version: int


def _check_id(label: str, value: str) -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise ConfigurationError(f"{label} must be 1-64 printable ASCII characters without spaces")
    return value


def _fail(what: str, message: str, got: object = None) -> AuthError:
    return AuthError(f"authentication failed ({what}): {message}", what=what, got=got)


def _transcript(side: str, hello: Hello, auth: Auth) -> bytes:
    return encode_value(
        {
            "side": f"twopc-auth-{side}",
            "server_nonce": hello.nonce,
            "server_id": hello.server_id,
            "versions": list(hello.versions),
            "client_nonce": auth.nonce,
            "client_id": auth.client_id,
            "role": auth.role,
            "version": auth.version,
        }
    )


# -- the pure protocol: no I/O, so both drivers (and tests) share it ---------------------------


def new_hello(server_id: str, versions: Collection[int] = SUPPORTED_VERSIONS) -> Hello:
    return Hello(
        secrets.token_bytes(NONCE_BYTES), _check_id("server id", server_id), tuple(sorted(versions))
    )


def answer_hello(
    secret: SharedSecret,
    frame: Frame | None,
    client_id: str,
    role: str,
    expected_server: str | None,
) -> tuple[Hello, Auth]:
    """Client: check the challenge and prove we hold the secret, in the highest common version."""
    hello = _expect(Hello, frame)
    if not _ID.match(hello.server_id):
        raise _fail("identity", "server id is not 1-64 printable ASCII characters")
    if expected_server is not None and hello.server_id != expected_server:
        raise _fail("proof", f"connected to {hello.server_id!r}, expected {expected_server!r}")
    if len(hello.nonce) != NONCE_BYTES:
        raise _fail("proof", "server nonce has the wrong size", len(hello.nonce))
    common = set(hello.versions) & SUPPORTED_VERSIONS
    if not common:
        raise _fail("version", f"server speaks {list(hello.versions)}", list(hello.versions))
    unsigned = Auth(
        _check_id("client id", client_id),
        secrets.token_bytes(NONCE_BYTES),
        _check_id("role", role),
        max(common),
        b"",
    )
    proof = secret.mac(_transcript("client", hello, unsigned))
    return hello, Auth(unsigned.client_id, unsigned.nonce, unsigned.role, unsigned.version, proof)


def check_auth(
    keys: Keys, hello: Hello, frame: Frame | None, roles: Collection[str] | None
) -> tuple[Auth, Welcome]:
    """Server: verify the client's proof with its key (``keys``: a `SharedSecret` or a key per
    client); the WELCOME proves us in turn, with the same key."""
    auth = _expect(Auth, frame)
    if not (_ID.match(auth.client_id) and _ID.match(auth.role)):  # they reach our logs
        raise _fail("identity", "client id or role is not 1-64 printable ASCII characters")
    if len(auth.nonce) != NONCE_BYTES:
        raise _fail("proof", "client nonce has the wrong size", len(auth.nonce))
    if auth.version not in hello.versions:
        raise _fail("version", f"client chose version {auth.version}", auth.version)
    secret = keys.key_for(auth.client_id)
    expected = (secret or _NOBODY).mac(_transcript("client", hello, auth))
    if secret is None:
        raise _fail("proof", f"client {auth.client_id!r} has no key here", auth.client_id)
    if not hmac.compare_digest(auth.proof, expected):
        raise _fail("proof", f"client {auth.client_id!r} does not hold the secret", auth.client_id)
    if roles is not None and auth.role not in roles:  # checked after the proof: no role oracle
        raise _fail("role", f"role {auth.role!r} is not served here", auth.role)
    return auth, Welcome(secret.mac(_transcript("server", hello, auth)))


def check_welcome(secret: SharedSecret, hello: Hello, auth: Auth, frame: Frame | None) -> Peer:
    """Client: the server must prove it holds the secret too, or we talk to an impostor."""
    welcome = _expect(Welcome, frame)
    if not hmac.compare_digest(welcome.proof, secret.mac(_transcript("server", hello, auth))):
        raise _fail("proof", f"server {hello.server_id!r} does not hold the secret")
    return Peer(hello.server_id, auth.role, auth.version)


_F = TypeVar("_F", Hello, Auth, Welcome)


def _expect(kind: type[_F], frame: Frame | None) -> _F:
    if frame is None:
        raise _fail("closed", "the peer closed the connection during the handshake")
    if isinstance(frame, ErrorFrame):
        raise _fail("refused", f"the peer refused: [{frame.code}] {frame.message}", frame.code)
    if not isinstance(frame, kind):
        raise _fail(
            "sequence",
            f"expected {kind.__name__}, got {type(frame).__name__}",
            type(frame).__name__,
        )
    return frame


def _refusal(exc: FrameError) -> ErrorFrame | None:
    """What the peer is told before we close: nothing if it closed or refused first."""
    what = getattr(exc, "what", "")
    if what in ("closed", "refused"):
        return None
    code = _PUBLIC_CODES.get(what, "bad-frame") if isinstance(exc, AuthError) else "bad-frame"
    return ErrorFrame(code, "authentication failed" if code == "auth-failed" else exc.message)


# -- drivers: blocking sockets -------------------------------------------------------------------


def server_handshake(
    sock: socket.socket,
    secret: Keys,
    server_id: str,
    *,
    roles: Collection[str] | None = None,
    timeout: float = HANDSHAKE_TIMEOUT,
) -> Peer:
    """Authenticate the client on a freshly accepted socket; returns who it is.

    On success the socket's timeout is restored; read on with a full-size `FrameReader` (the
    handshake reads no byte past the AUTH frame). On failure the socket is closed.
    """
    hello = new_hello(server_id)

    def steps() -> Peer:
        send_frame(sock, hello)
        frame = FrameReader(
            _Deadline(sock, timeout), max_frame=PRE_AUTH_MAX_FRAME, versions=HANDSHAKE_VERSIONS
        ).read()
        auth, welcome = check_auth(secret, hello, frame, roles)
        send_frame(sock, welcome)
        return Peer(auth.client_id, auth.role, auth.version)

    return _run(sock, timeout, steps)


def client_handshake(
    sock: socket.socket,
    secret: SharedSecret,
    client_id: str,
    role: str,
    *,
    server_id: str | None = None,
    timeout: float = HANDSHAKE_TIMEOUT,
) -> Peer:
    """Authenticate to the server (and it to us) on a connected socket; returns the server.

    ``server_id``, when given, must match the server's: a client that knows which server it
    wants refuses a different one holding the same secret.
    """
    _check_id("client id", client_id)
    _check_id("role", role)

    def steps() -> Peer:
        reader = FrameReader(
            _Deadline(sock, timeout), max_frame=PRE_AUTH_MAX_FRAME, versions=HANDSHAKE_VERSIONS
        )
        hello, auth = answer_hello(secret, reader.read(), client_id, role, server_id)
        send_frame(sock, auth)
        return check_welcome(secret, hello, auth, reader.read())

    return _run(sock, timeout, steps)


class _Deadline:
    """One deadline for the whole handshake, not a timeout per read: a peer trickling a byte
    at a time cannot hold an unauthenticated connection open for long."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.end = time.monotonic() + timeout

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("handshake deadline passed")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer, nbytes, flags)


def _run(sock: socket.socket, timeout: float, steps: Callable[[], Peer]) -> Peer:
    previous = sock.gettimeout()
    try:
        sock.settimeout(timeout)
        peer = steps()
        sock.settimeout(previous)
        return peer
    except FrameError as exc:
        _refuse(sock, exc)
        raise
    except TimeoutError:
        error = _fail("timeout", f"the handshake took longer than {timeout} s")
        _refuse(sock, error)
        raise error from None
    except OSError:
        sock.close()
        raise


def _refuse(sock: socket.socket, exc: FrameError) -> None:
    refusal = _refusal(exc)
    try:
        if refusal is not None:
            sock.sendall(encode(refusal))  # best effort: the peer may be gone already
    except OSError:
        pass
    finally:
        sock.close()


# -- drivers: asyncio streams --------------------------------------------------------------------


async def server_handshake_async(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    secret: Keys,
    server_id: str,
    *,
    roles: Collection[str] | None = None,
    timeout: float = HANDSHAKE_TIMEOUT,
) -> Peer:
    """`server_handshake` for asyncio streams; on failure the writer is closed."""
    hello = new_hello(server_id)

    async def steps() -> Peer:
        await write_frame(writer, hello)
        frame = await read_frame(reader, max_frame=PRE_AUTH_MAX_FRAME, versions=HANDSHAKE_VERSIONS)
        auth, welcome = check_auth(secret, hello, frame, roles)
        await write_frame(writer, welcome)
        return Peer(auth.client_id, auth.role, auth.version)

    return await _run_async(writer, timeout, steps())


async def client_handshake_async(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    secret: SharedSecret,
    client_id: str,
    role: str,
    *,
    server_id: str | None = None,
    timeout: float = HANDSHAKE_TIMEOUT,
) -> Peer:
    """`client_handshake` for asyncio streams; on failure the writer is closed."""
    _check_id("client id", client_id)
    _check_id("role", role)

    async def steps() -> Peer:
        frame = await read_frame(reader, max_frame=PRE_AUTH_MAX_FRAME, versions=HANDSHAKE_VERSIONS)
        hello, auth = answer_hello(secret, frame, client_id, role, server_id)
        await write_frame(writer, auth)
        frame = await read_frame(reader, max_frame=PRE_AUTH_MAX_FRAME, versions=HANDSHAKE_VERSIONS)
        return check_welcome(secret, hello, auth, frame)

    return await _run_async(writer, timeout, steps())


async def _run_async(
    writer: asyncio.StreamWriter, timeout: float, steps: Coroutine[Any, Any, Peer]
) -> Peer:
    try:
        return await asyncio.wait_for(steps, timeout)
    except FrameError as exc:
        await _refuse_async(writer, exc)
        raise
    except (asyncio.TimeoutError, TimeoutError):
        error = _fail("timeout", f"the handshake took longer than {timeout} s")
        await _refuse_async(writer, error)
        raise error from None
    except OSError:
        writer.close()
        raise


async def _refuse_async(writer: asyncio.StreamWriter, exc: FrameError) -> None:
    refusal = _refusal(exc)
    try:
        if refusal is not None:
            writer.write(encode(refusal))
            await asyncio.wait_for(writer.drain(), 1.0)
    except (OSError, asyncio.TimeoutError, TimeoutError):
        pass
    finally:
        writer.close()


# -- TLS -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsConfig:
    """Certificate paths for the standard `ssl` module; TLS 1.2 at least, peers verified.

    Server: ``certfile`` and ``keyfile`` (PEM) are required; with ``cafile`` and
    ``require_client_cert`` clients must show a certificate that CA signed (mutual TLS).
    Client: ``cafile`` is the CA that signed the server's certificate (None: the system's), and
    the server's host name is checked against it; ``certfile``/``keyfile`` if the server asks.
    Build a context once per process and pass it to `wrap_server`/`wrap_client` or to asyncio's
    ``start_server(ssl=...)``/``open_connection(ssl=..., server_hostname=...)``.
    """

    certfile: str | None = None
    keyfile: str | None = None
    cafile: str | None = None
    require_client_cert: bool = False

    def server_context(self) -> ssl.SSLContext:
        if self.certfile is None:
            raise ConfigurationError("a TLS server needs a certfile (and a keyfile)")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.certfile, self.keyfile)
        if self.cafile is not None:
            context.load_verify_locations(self.cafile)
        if self.require_client_cert:
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.cafile)  # verifies chain and host name
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.certfile is not None:
            context.load_cert_chain(self.certfile, self.keyfile)
        return context


def wrap_server(sock: socket.socket, context: ssl.SSLContext) -> ssl.SSLSocket:
    """TLS on an accepted socket; the TLS handshake runs now, under the socket's timeout."""
    return context.wrap_socket(sock, server_side=True)


def wrap_client(
    sock: socket.socket, context: ssl.SSLContext, server_hostname: str
) -> ssl.SSLSocket:
    return context.wrap_socket(sock, server_hostname=server_hostname)
