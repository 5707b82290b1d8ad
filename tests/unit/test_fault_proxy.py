"""The fault proxy itself: every fault does what it says, and nothing hangs."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from coordinator.errors import FrameError
from messaging.frames import HEADER, MAGIC, ErrorFrame, Frame, FrameReader, Ping, encode, send_frame
from tests.support.fault_proxy import FaultProxy, Faults

pytestmark = pytest.mark.timeout(10)

WAIT = 2.0  # no single wait in these tests may take longer


# -- a tiny frame echo server ----------------------------------------------------------------------


@dataclass
class Session:
    """What one server-side connection read, and how it ended."""

    frames: list[Frame] = field(default_factory=list)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def wait(self) -> Session:
        assert self.done.wait(WAIT), "the server connection never ended"
        return self


class EchoServer:
    """Reads frames with `FrameReader`, echoes each with `send_frame`; ``raw`` echoes bytes."""

    def __init__(self, *, raw: bool = False) -> None:
        self.raw = raw
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        self.sessions: list[Session] = []
        self.socks: list[socket.socket] = []
        self.accepted = threading.Condition()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            session = Session()
            with self.accepted:
                self.sessions.append(session)
                self.socks.append(sock)
                self.accepted.notify_all()
            threading.Thread(target=self._serve, args=(sock, session), daemon=True).start()

    def _serve(self, sock: socket.socket, session: Session) -> None:
        try:
            if self.raw:
                while data := sock.recv(65536):
                    sock.sendall(data)
            else:
                for frame in FrameReader(sock):
                    session.frames.append(frame)
                    send_frame(sock, frame)
        except (FrameError, OSError) as exc:
            session.error = exc
        finally:
            sock.close()
            session.done.set()

    def session(self, n: int = 0) -> Session:
        with self.accepted:
            assert self.accepted.wait_for(lambda: len(self.sessions) > n, WAIT)
            return self.sessions[n]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for sock in self.socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(WAIT)


@pytest.fixture
def server() -> Iterator[EchoServer]:
    srv = EchoServer()
    yield srv
    srv.close()


@pytest.fixture
def raw_server() -> Iterator[EchoServer]:
    srv = EchoServer(raw=True)
    yield srv
    srv.close()


@contextlib.contextmanager
def proxied(
    server: EchoServer, faults: Faults | None = None, *, seed: int = 0
) -> Iterator[FaultProxy]:
    with FaultProxy(server.address, faults, seed=seed) as proxy:
        yield proxy


def connect(proxy: FaultProxy) -> socket.socket:
    sock = socket.create_connection(proxy.address, timeout=WAIT)
    sock.settimeout(WAIT)
    return sock


def pings(n: int, start: int = 0) -> list[Frame]:
    return [Ping(token=i) for i in range(start, start + n)]


def send_all(
    sock: socket.socket, frames: list[Frame], *, close_write: bool = True, may_reset: bool = False
) -> None:
    """Send every frame; with ``may_reset``, a reset by the faults ends the sending quietly."""
    try:
        for frame in frames:
            send_frame(sock, frame)
        if close_write:
            sock.shutdown(socket.SHUT_WR)
    except OSError:  # EPIPE, ECONNRESET, or ENOTCONN from the shutdown
        if not may_reset:
            raise


def read_to_end(sock: socket.socket) -> tuple[list[Frame], BaseException | None]:
    """Every frame until EOF, and the error that ended the stream (None for a clean EOF)."""
    got: list[Frame] = []
    reader = FrameReader(sock)
    try:
        while (frame := reader.read()) is not None:
            got.append(frame)
    except (FrameError, ConnectionResetError) as exc:
        return got, exc
    return got, None


def read_n(sock: socket.socket, n: int) -> list[Frame]:
    reader = FrameReader(sock)
    out: list[Frame] = []
    for _ in range(n):
        frame = reader.read()
        assert frame is not None, f"EOF after {len(out)} of {n} frames"
        out.append(frame)
    return out


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never came true"
        time.sleep(0.005)


# -- no faults -------------------------------------------------------------------------------------


def test_no_faults_every_frame_arrives_intact_and_in_order(server: EchoServer) -> None:
    big = ErrorFrame("big", "x" * 300_000)  # many recv() chunks for one frame
    frames = [*pings(40), big, *pings(10, start=40)]
    with proxied(server) as proxy, connect(proxy) as sock:
        send_all(sock, frames)
        got, error = read_to_end(sock)
        assert error is None
        assert got == frames
        assert server.session().wait().frames == frames
        assert server.session().error is None
        assert proxy.stats["frames"] == 2 * len(frames)
        assert proxy.stats["connections"] == 1
        assert proxy.stats["raw_bytes"] == 0


# -- one fault at a time ---------------------------------------------------------------------------


def test_drop_everything_after_pass_first(server: EchoServer) -> None:
    frames = pings(10)
    with proxied(server, Faults(drop=1.0)) as proxy, connect(proxy) as sock:
        send_all(sock, frames)
        got, error = read_to_end(sock)
        assert error is None
        assert got == frames[:3]
        assert server.session().wait().frames == frames[:3]
        assert proxy.stats["dropped"] == 7


def test_duplicate_sends_each_frame_twice(server: EchoServer) -> None:
    frames = pings(6)
    doubled = [f for frame in frames for f in (frame, frame)]
    faults = Faults(duplicate=1.0, direction="upstream", pass_first=0)
    with proxied(server, faults) as proxy, connect(proxy) as sock:
        send_all(sock, frames)
        got, error = read_to_end(sock)
        assert error is None
        assert server.session().wait().frames == doubled
        assert got == doubled  # the server echoed both copies; downstream is untouched
        assert proxy.stats["duplicated"] == 6


def test_reorder_swaps_pairs(server: EchoServer) -> None:
    frames = pings(7)
    faults = Faults(reorder=1.0, direction="upstream", pass_first=0)
    with proxied(server, faults) as proxy, connect(proxy) as sock:
        send_all(sock, frames)
        got, _ = read_to_end(sock)
        swapped = [frames[i] for i in (1, 0, 3, 2, 5, 4, 6)]  # the last one: flushed at EOF
        assert server.session().wait().frames == swapped
        assert got == swapped
        assert proxy.stats["reordered"] == 4


def test_a_reordered_frame_with_no_partner_goes_after_50ms(server: EchoServer) -> None:
    faults = Faults(reorder=1.0, direction="upstream", pass_first=0)
    with proxied(server, faults) as proxy, connect(proxy) as sock:
        started = time.monotonic()
        send_frame(sock, Ping(token=1))
        assert read_n(sock, 1) == [Ping(token=1)]
        assert 0.045 <= time.monotonic() - started < 1.0


def test_delay_arrives_late_but_intact(server: EchoServer) -> None:
    frames = pings(5)
    faults = Faults(delay=1.0, delay_seconds=(0.03, 0.03), direction="upstream", pass_first=0)
    with proxied(server, faults) as proxy, connect(proxy) as sock:
        started = time.monotonic()
        send_all(sock, frames, close_write=False)
        assert read_n(sock, 5) == frames
        assert time.monotonic() - started >= 5 * 0.03 - 0.005  # each holds the stream behind
        assert proxy.stats["delayed"] == 5


@pytest.mark.parametrize("seed", range(4))
def test_bitflip_upstream_is_caught_by_the_server(server: EchoServer, seed: int) -> None:
    faults = Faults(bitflip=1.0, direction="upstream", pass_first=0)
    with proxied(server, faults, seed=seed) as proxy, connect(proxy) as sock:
        send_all(sock, pings(8), may_reset=True)  # the server may hang up at the first frame
        got, _ = read_to_end(sock)
        session = server.session().wait()
        assert isinstance(session.error, FrameError), session.error
        assert session.frames == []  # never a silently wrong frame
        assert got == []
        assert proxy.stats["bitflipped"] >= 1


@pytest.mark.parametrize("seed", range(4))
def test_bitflip_downstream_is_caught_by_the_client(server: EchoServer, seed: int) -> None:
    frames = pings(8)
    faults = Faults(bitflip=1.0, direction="downstream", pass_first=0)
    with proxied(server, faults, seed=seed) as proxy, connect(proxy) as sock:
        send_all(sock, frames)
        got, error = read_to_end(sock)
        assert isinstance(error, FrameError), error
        assert got == []
        assert server.session().wait().frames == frames
        wait_until(lambda: proxy.stats["bitflipped"] == 8)


@pytest.mark.parametrize("seed", range(4))
def test_truncate_cuts_a_frame_then_resets(server: EchoServer, seed: int) -> None:
    frames = pings(5)
    faults = Faults(truncate=1.0, direction="upstream", pass_first=1)
    with proxied(server, faults, seed=seed) as proxy, connect(proxy) as sock:
        send_frame(sock, frames[0])  # passes: read its echo first, or the reset may overtake it
        assert read_n(sock, 1) == frames[:1]
        send_all(sock, frames[1:], close_write=False, may_reset=True)
        session = server.session().wait()
        assert session.frames == frames[:1]
        error = session.error
        truncated = isinstance(error, FrameError) and error.what == "truncated"  # type: ignore[attr-defined]
        assert truncated or isinstance(error, ConnectionResetError), error
        got, client_error = read_to_end(sock)
        assert got == []
        assert client_error is None or isinstance(client_error, ConnectionResetError)
        assert proxy.stats["truncated"] == 1


def test_reset_fault_resets_both_sides(server: EchoServer) -> None:
    frames = pings(5)
    faults = Faults(reset=1.0, direction="upstream", pass_first=2)
    with proxied(server, faults) as proxy, connect(proxy) as sock:
        send_all(sock, frames[:2], close_write=False)  # these pass; see them back before
        assert read_n(sock, 2) == frames[:2]  # the reset, which may discard unread data
        send_all(sock, frames[2:], close_write=False, may_reset=True)
        session = server.session().wait()
        assert session.frames == frames[:2]
        assert isinstance(session.error, ConnectionResetError), session.error
        got, error = read_to_end(sock)
        assert got == []
        assert error is None or isinstance(error, ConnectionResetError)
        assert proxy.stats["resets"] == 1


def test_reset_all_resets_live_connections(server: EchoServer) -> None:
    with proxied(server) as proxy, connect(proxy) as a, connect(proxy) as b:
        for sock in (a, b):
            send_frame(sock, Ping(token=1))
            assert read_n(sock, 1) == [Ping(token=1)]
        assert proxy.reset_all() == 2
        for sock in (a, b):
            with contextlib.suppress(ConnectionResetError):  # or a plain EOF
                assert sock.recv(16) == b""
        for n in (0, 1):  # the server ends too, seeing the reset (or EOF)
            error = server.session(n).wait().error
            assert error is None or isinstance(error, ConnectionResetError), error
        assert proxy.reset_all() == 0
        assert proxy.stats["resets"] == 2


def test_pause_holds_frames_until_resume(server: EchoServer) -> None:
    with proxied(server) as proxy, connect(proxy) as sock:
        send_frame(sock, Ping(token=0))
        assert read_n(sock, 1) == [Ping(token=0)]
        proxy.pause()
        send_frame(sock, Ping(token=1))
        time.sleep(0.15)
        assert server.session().frames == [Ping(token=0)]
        proxy.resume()
        assert read_n(sock, 1) == [Ping(token=1)]


def test_set_faults_applies_to_live_connections(server: EchoServer) -> None:
    with proxied(server) as proxy, connect(proxy) as sock:
        send_frame(sock, Ping(token=0))
        assert read_n(sock, 1) == [Ping(token=0)]
        proxy.set_faults(Faults(drop=1.0, pass_first=0, direction="upstream"))
        send_frame(sock, Ping(token=1))
        wait_until(lambda: proxy.stats["dropped"] == 1)
        proxy.set_faults(Faults())
        send_frame(sock, Ping(token=2))
        assert read_n(sock, 1) == [Ping(token=2)]


# -- streams that are not frames, dead upstreams, shutdown -----------------------------------------


def test_non_frame_bytes_pass_raw(raw_server: EchoServer) -> None:
    with proxied(raw_server, Faults(drop=1.0, pass_first=0)) as proxy, connect(proxy) as sock:
        sock.sendall(b"hi")  # shorter than a header: must not wait for 16 bytes
        assert sock.recv(16) == b"hi"
        text = b"GET / HTTP/1.0\r\n" * 1000
        sock.sendall(text)
        got = b""
        while len(got) < len(text):
            got += sock.recv(65536)
        assert got == text
        assert proxy.stats["raw_bytes"] == 2 * (2 + len(text))
        assert proxy.stats["dropped"] == 0


def test_a_frame_then_an_absurd_length_goes_raw(raw_server: EchoServer) -> None:
    absurd = HEADER.pack(MAGIC, 1, 5, 0, 2**31, 0) + b"tail"
    payload = encode(Ping(token=9)) + absurd
    with proxied(raw_server, Faults(pass_first=0)) as proxy, connect(proxy) as sock:
        sock.sendall(payload)
        got = b""
        while len(got) < len(payload):
            got += sock.recv(65536)
        assert got == payload
        assert proxy.stats["frames"] == 2  # the ping, each way; then raw both ways
        assert proxy.stats["raw_bytes"] == 2 * len(absurd)


def test_upstream_refusing_closes_the_client_at_once() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        dead = probe.getsockname()[:2]  # a port nothing listens on once this closes
    with FaultProxy(dead) as proxy:
        started = time.monotonic()
        # the proxy accepts, fails to connect upstream and resets the client: the RST may even
        # beat connect() back to the caller
        with contextlib.suppress(ConnectionResetError), connect(proxy) as sock:
            assert sock.recv(16) == b""
        assert time.monotonic() - started < 1.0
        wait_until(lambda: proxy.stats["upstream_refused"] == 1)


def test_close_is_prompt_with_connections_open(server: EchoServer) -> None:
    proxy = FaultProxy(server.address).start()
    socks = [connect(proxy) for _ in range(3)]
    for sock in socks:
        send_frame(sock, Ping(token=1))
        assert read_n(sock, 1) == [Ping(token=1)]
    proxy.pause()
    send_frame(socks[0], Ping(token=2))  # stuck in a paused pump
    started = time.monotonic()
    proxy.close()
    assert time.monotonic() - started < 1.0
    proxy.close()  # idempotent
    for sock in socks:
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(16) == b""
        sock.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("fault-proxy")]
    with pytest.raises(OSError):
        socket.create_connection(proxy.address, timeout=WAIT).close()


# -- reproducibility and validation ----------------------------------------------------------------


def _run(server: EchoServer, seed: int) -> tuple[list[Frame], list[tuple[int, str, int, str]]]:
    faults = Faults(drop=0.3, duplicate=0.3, reorder=0.2, pass_first=0, direction="upstream")
    with proxied(server, faults, seed=seed) as proxy, connect(proxy) as sock:
        send_all(sock, pings(40))
        got, error = read_to_end(sock)
        assert error is None
        return got, list(proxy.events)


def test_the_same_seed_gives_the_same_faults(server: EchoServer) -> None:
    first, second, other = _run(server, 5), _run(server, 5), _run(server, 6)
    assert first == second
    assert first[1], "some faults were injected"
    assert other[1] != first[1]


def test_faults_are_validated() -> None:
    with pytest.raises(ValueError):
        Faults(drop=1.5)
    with pytest.raises(ValueError):
        Faults(direction="sideways")
    with pytest.raises(ValueError):
        Faults(delay_seconds=(0.2, 0.1))


def test_reply_fault_refuses_what_it_cannot_do() -> None:
    """Only XA requests have replies to mistreat; only delay, drop and reset are known. (What
    each does to a live reply is exercised in tests/integration/test_consumer_order.py.)"""
    from messaging.frames import FrameType
    from tests.support.fault_proxy import ReplyFault

    with pytest.raises(ValueError):
        ReplyFault(FrameType.XA_REPLY)
    with pytest.raises(ValueError):
        ReplyFault(FrameType.XA_PREPARE, "explode")
