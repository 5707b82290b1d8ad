"""Authentication at connect: only a peer holding the secret gets past HELLO, in both directions.

Invariants named here: ``mutual_auth`` (each side proves it holds the secret; an impostor on either
side is refused), ``no_replay`` (a recorded AUTH is useless on another connection),
``pre_auth_limits`` (before WELCOME: one frame, at most 4 KiB, within a timeout) and
``one_connection_only`` (a bad frame drops its own connection; the server and its other
connections carry on).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import pickle
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.errors import ConfigurationError, FrameError
from messaging.auth import (
    NONCE_BYTES,
    PRE_AUTH_MAX_FRAME,
    AuthError,
    Peer,
    SharedSecret,
    TlsConfig,
    answer_hello,
    check_auth,
    check_welcome,
    client_handshake,
    client_handshake_async,
    new_hello,
    server_handshake,
    server_handshake_async,
    wrap_client,
    wrap_server,
)
from messaging.frames import (
    MAGIC,
    ErrorFrame,
    Frame,
    FrameReader,
    FrameType,
    Hello,
    Ping,
    Pong,
    Welcome,
    encode,
    send_frame,
)
from tests.support.tls import make_certificate

SECRET = SharedSecret(b"correct horse battery staple")
OTHER = SharedSecret(b"a different secret, 32 bytes ..")


class Background:
    """Run a function in a thread; `result` re-raises what it raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.value = fn()
        except BaseException as exc:
            self.error = exc

    def result(self) -> Any:
        self.thread.join(10)
        assert not self.thread.is_alive()
        if self.error is not None:
            raise self.error
        return self.value


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    client, server = socket.socketpair()
    with client, server:
        yield client, server


def remaining(sock: socket.socket) -> list[Frame]:
    """What the peer said before closing: frames, up to EOF or a reset."""
    got: list[Frame] = []
    with contextlib.suppress(ConnectionResetError):
        got.extend(FrameReader(sock))
    return got


# -- mutual_auth -----------------------------------------------------------------------------------


def test_handshake_identifies_both_sides_and_frames_flow_after(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = pair
    served = Background(lambda: server_handshake(server, SECRET, "log-1", roles={"cursor"}))
    assert client_handshake(client, SECRET, "cursor-9", "cursor", server_id="log-1") == Peer(
        "log-1", "cursor", 4
    )  # the highest version both speak
    assert served.result() == Peer("cursor-9", "cursor", 4)
    assert server.gettimeout() is None  # restored after the handshake
    send_frame(client, Ping(7))
    assert FrameReader(server).read() == Ping(7)


def test_wrong_secret_is_refused_and_both_ends_close(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = pair
    served = Background(lambda: server_handshake(server, SECRET, "log-1"))
    with pytest.raises(AuthError) as refused:
        client_handshake(client, OTHER, "cursor-9", "cursor")
    assert (refused.value.what, refused.value.got) == ("refused", "auth-failed")  # type: ignore[attr-defined]
    with pytest.raises(AuthError) as caught:
        served.result()
    assert caught.value.what == "proof" and "cursor-9" in str(caught.value)  # type: ignore[attr-defined]
    assert "correct horse" not in str(caught.value)
    assert server.fileno() == -1 and client.fileno() == -1


def test_an_impostor_server_is_refused_by_the_client(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = pair

    def impostor() -> list[Frame]:
        send_frame(server, new_hello("log-1"))
        FrameReader(server).read()  # the client's AUTH, which it cannot check
        send_frame(server, Welcome(b"\x00" * 32))
        return remaining(server)

    fake = Background(impostor)
    with pytest.raises(AuthError) as caught:
        client_handshake(client, SECRET, "cursor-9", "cursor")
    assert caught.value.what == "proof"  # type: ignore[attr-defined]
    assert fake.result() == [ErrorFrame("auth-failed", "authentication failed")]


def test_the_client_refuses_a_server_with_another_id(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = pair
    served = Background(lambda: server_handshake(server, SECRET, "log-2"))
    with pytest.raises(AuthError, match="expected 'log-1'"):
        client_handshake(client, SECRET, "cursor-9", "cursor", server_id="log-1")
    with pytest.raises(AuthError):
        served.result()


def test_proofs_are_bound_to_side_role_and_nonces() -> None:
    hello = new_hello("log-1")
    _, auth = answer_hello(SECRET, hello, "cursor-9", "cursor", None)
    _, welcome = check_auth(SECRET, hello, auth, None)
    assert welcome.proof != auth.proof  # a client proof cannot be reflected as a server proof
    assert check_welcome(SECRET, hello, auth, welcome) == Peer("log-1", "cursor", 4)
    for forged in (
        auth.__class__(auth.client_id, auth.nonce, "admin", auth.version, auth.proof),
        auth.__class__("other", auth.nonce, auth.role, auth.version, auth.proof),
        auth.__class__(auth.client_id, b"\x00" * NONCE_BYTES, auth.role, auth.version, auth.proof),
    ):
        with pytest.raises(AuthError) as caught:
            check_auth(SECRET, hello, forged, None)
        assert caught.value.what == "proof"  # type: ignore[attr-defined]
    with pytest.raises(AuthError):
        check_welcome(SECRET, hello, auth, Welcome(auth.proof))


# -- no_replay -------------------------------------------------------------------------------------


def test_a_recorded_auth_is_refused_on_a_new_connection() -> None:
    recorded = []
    for attempt in range(2):
        client, server = socket.socketpair()
        with client, server:
            served = Background(functools.partial(server_handshake, server, SECRET, "log-1"))
            reader = FrameReader(client)
            hello = reader.read()
            if attempt == 0:
                _, auth = answer_hello(SECRET, hello, "cursor-9", "cursor", None)
                recorded.append(auth)
            send_frame(client, recorded[0])
            if attempt == 0:
                assert served.result() == Peer("cursor-9", "cursor", 4)
                assert isinstance(reader.read(), Welcome)
            else:
                with pytest.raises(AuthError) as caught:
                    served.result()
                assert caught.value.what == "proof"  # type: ignore[attr-defined]
                assert remaining(client) == [ErrorFrame("auth-failed", "authentication failed")]


# -- pre_auth_limits -------------------------------------------------------------------------------


def oversized_header() -> bytes:
    return (
        MAGIC
        + bytes([1, FrameType.AUTH, 0, 0])
        + (PRE_AUTH_MAX_FRAME).to_bytes(4, "big")
        + b"\0" * 4
    )


@pytest.mark.parametrize(
    ("sent", "error", "what", "told"),
    [
        (b"GET / HTTP/1.1\r\nHost: log\r\n\r\n", FrameError, "magic", "bad-frame"),
        (oversized_header() + b"\0" * 64, FrameError, "length", "bad-frame"),
        (encode(Ping(1)), AuthError, "sequence", "auth-required"),
        (encode(Hello(b"\0" * 32, "me")), AuthError, "sequence", "auth-required"),
        (b"", AuthError, "closed", None),
    ],
    ids=["http", "oversized", "ping-first", "hello-back", "closed"],
)
def test_anything_but_auth_first_closes_the_connection(
    pair: tuple[socket.socket, socket.socket],
    sent: bytes,
    error: type[FrameError],
    what: str,
    told: str | None,
) -> None:
    client, server = pair
    served = Background(lambda: server_handshake(server, SECRET, "log-1"))
    assert isinstance(FrameReader(client).read(), Hello)
    client.sendall(sent)
    if not sent:
        client.shutdown(socket.SHUT_WR)
    with pytest.raises(error) as caught:
        served.result()
    assert caught.value.what == what  # type: ignore[attr-defined]
    assert server.fileno() == -1
    frames = remaining(client)
    if told is not None and frames:  # unread junk may turn the close into a reset
        assert isinstance(frames[0], ErrorFrame) and frames[0].code == told
    assert len(frames) <= 1


def test_a_silent_client_times_out(pair: tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    start = time.monotonic()
    served = Background(lambda: server_handshake(server, SECRET, "log-1", timeout=0.2))
    with pytest.raises(AuthError) as caught:
        served.result()
    assert caught.value.what == "timeout" and time.monotonic() - start < 5  # type: ignore[attr-defined]
    assert [type(f) for f in remaining(client)] == [Hello, ErrorFrame]


def test_a_client_trickling_bytes_meets_one_deadline_for_the_whole_handshake(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = pair
    start = time.monotonic()
    served = Background(lambda: server_handshake(server, SECRET, "log-1", timeout=0.5))
    _, auth = answer_hello(SECRET, FrameReader(client).read(), "cursor-9", "cursor", None)
    with contextlib.suppress(OSError):
        for byte in encode(auth):  # each byte well inside a per-read timeout of 0.5 s
            client.sendall(bytes([byte]))
            time.sleep(0.05)
    with pytest.raises(AuthError) as caught:
        served.result()
    assert caught.value.what == "timeout"  # type: ignore[attr-defined]
    assert time.monotonic() - start < 3


def test_a_role_the_server_does_not_serve_is_refused_after_the_proof(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = pair
    served = Background(lambda: server_handshake(server, SECRET, "log-1", roles={"cursor"}))
    with pytest.raises(AuthError) as refused:
        client_handshake(client, SECRET, "app-1", "admin")
    assert refused.value.got == "forbidden-role"  # type: ignore[attr-defined]
    with pytest.raises(AuthError, match="role 'admin'"):
        served.result()


def test_no_common_version_is_refused_by_the_client(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = pair
    send_frame(server, Hello(b"\0" * NONCE_BYTES, "future", (5, 6)))
    with pytest.raises(AuthError) as caught:
        client_handshake(client, SECRET, "cursor-9", "cursor")
    assert caught.value.what == "version"  # type: ignore[attr-defined]
    assert remaining(server) == [ErrorFrame("unsupported-version", str(caught.value.message))]


# -- the secret and the errors ---------------------------------------------------------------------


def test_secrets_never_print_never_pickle_and_must_be_long(tmp_path: Path) -> None:
    assert "horse" not in repr(SECRET) and "horse" not in str(SECRET)
    with pytest.raises(TypeError):
        pickle.dumps(SECRET)
    with pytest.raises(ConfigurationError):
        SharedSecret(b"short")
    path = tmp_path / "secret"
    path.write_bytes(b"correct horse battery staple\n")
    loaded = SharedSecret.from_file(path)
    assert loaded.mac(b"x") == SECRET.mac(b"x")


def test_the_environment_secret_is_the_variables_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/protocol.md: TWOPC_SECRET's bytes are the key; one that is not UTF-8 is a key too,
    not a crash at start."""
    import argparse

    from messaging.cli import secret_from

    args = argparse.Namespace(secret_file=None)
    monkeypatch.setitem(os.environb, b"TWOPC_SECRET", b"\xff\xfe not utf-8 at all \x80")
    key = b"\xff\xfe not utf-8 at all \x80"
    assert secret_from(args).mac(b"x") == SharedSecret(key).mac(b"x")
    monkeypatch.setenv("TWOPC_SECRET", "clé secrète de seize octets")
    assert secret_from(args).mac(b"x") == SharedSecret("clé secrète de seize octets".encode()).mac(
        b"x"
    )
    monkeypatch.delenv("TWOPC_SECRET")
    with pytest.raises(ConfigurationError, match="no shared secret"):
        secret_from(args)


def test_auth_errors_pickle_with_their_attributes() -> None:
    error = AuthError("authentication failed (proof): no", what="proof", got="c-1")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is AuthError and copy.__dict__ == error.__dict__
    assert copy.code == "bad-frame" and isinstance(copy, FrameError)


def test_bad_ids_are_a_configuration_error(pair: tuple[socket.socket, socket.socket]) -> None:
    client, _ = pair
    with pytest.raises(ConfigurationError):
        client_handshake(client, SECRET, "has space", "cursor")
    with pytest.raises(ConfigurationError):
        new_hello("x" * 65)


# -- asyncio ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("client_secret", [SECRET, OTHER], ids=["right", "wrong"])
def test_asyncio_handshake(client_secret: SharedSecret) -> None:
    async def scenario() -> tuple[Any, Any]:
        results: list[Any] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                results.append(await server_handshake_async(reader, writer, SECRET, "log-a"))
            except AuthError as exc:
                results.append(exc)
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            mine: Any = await client_handshake_async(reader, writer, client_secret, "c-1", "cursor")
        except AuthError as exc:
            mine = exc
        writer.close()
        while not results:
            await asyncio.sleep(0.01)
        server.close()
        await server.wait_closed()
        return mine, results[0]

    mine, theirs = asyncio.run(scenario())
    if client_secret is SECRET:
        assert (mine, theirs) == (Peer("log-a", "cursor", 4), Peer("c-1", "cursor", 4))
    else:
        assert (mine.what, mine.got, theirs.what) == ("refused", "auth-failed", "proof")


# -- one_connection_only: a tiny real TCP server ---------------------------------------------------


class TinyServer:
    """Accept, authenticate, answer PING with PONG; a bad frame ends only its connection."""

    def __init__(self, context: Any = None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.context = context
        self.errors: list[FrameError] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self.context is not None:
                conn = wrap_server(conn, self.context)
            server_handshake(conn, SECRET, "tiny")
            for frame in FrameReader(conn):
                if isinstance(frame, Ping):
                    send_frame(conn, Pong(frame.token))
        except FrameError as exc:
            self.errors.append(exc)
            with contextlib.suppress(OSError):
                send_frame(conn, ErrorFrame("bad-frame", exc.message))
        except OSError:  # a refused TLS handshake, a reset: this connection only
            pass
        finally:
            conn.close()

    def connect(self, context: Any = None) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        if context is not None:
            sock = wrap_client(sock, context, "localhost")
        client_handshake(sock, SECRET, "tester", "cursor", server_id="tiny")
        return sock

    def close(self) -> None:
        self.listener.close()


def ping(sock: socket.socket, token: int) -> Frame | None:
    send_frame(sock, Ping(token))
    return FrameReader(sock).read()


def test_a_bad_frame_closes_only_its_own_connection() -> None:
    server = TinyServer()
    try:
        good, bad = server.connect(), server.connect()
        with good, bad:
            assert ping(good, 1) == Pong(1) and ping(bad, 2) == Pong(2)
            damaged = bytearray(encode(Ping(3)))
            damaged[-1] ^= 0x10
            bad.sendall(bytes(damaged))
            reader = FrameReader(bad)
            refusal = reader.read()
            assert isinstance(refusal, ErrorFrame) and refusal.code == "bad-frame"
            assert reader.read() is None  # closed by the server
            assert ping(good, 4) == Pong(4)  # the other connection never noticed
            with server.connect() as fresh:  # and the server still accepts
                assert ping(fresh, 5) == Pong(5)
        assert [e.what for e in server.errors] == ["crc"]  # type: ignore[attr-defined]
    finally:
        server.close()


# -- TLS -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    return make_certificate(tmp_path_factory.mktemp("tls"))


def test_tls_carries_the_handshake_and_frames(certificate: TlsConfig) -> None:
    server = TinyServer(certificate.server_context())
    try:
        client_context = TlsConfig(cafile=certificate.cafile).client_context()
        with server.connect(client_context) as sock:
            assert isinstance(sock, ssl.SSLSocket) and sock.version() in ("TLSv1.2", "TLSv1.3")
            assert ping(sock, 9) == Pong(9)
    finally:
        server.close()


def test_tls_refuses_a_server_the_ca_did_not_sign(certificate: TlsConfig) -> None:
    server = TinyServer(certificate.server_context())
    try:
        with pytest.raises(ssl.SSLCertVerificationError):
            server.connect(TlsConfig().client_context())  # system CAs: our cert is unknown
    finally:
        server.close()
    with pytest.raises(ConfigurationError):
        TlsConfig(cafile=certificate.cafile).server_context()
