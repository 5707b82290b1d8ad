"""`FaultProxy`: a TCP proxy that mistreats the twopc wire protocol one frame at a time.

Why: exactly-once delivery between the message log and a cursor is only worth claiming if it
survives a hostile network. Real networks lose, repeat, delay and reorder data below TCP, and TCP
hides all of that; what reaches the application is a stream that stalls, is cut off, or is reset.
A frame-aware proxy lets a test go further and do what a buggy middlebox, a flaky NIC or a
half-dead peer would: it sits between a client and an upstream server (say, a message log's
transfer connection and a cursor server), parses the stream into frames (the 16-byte header of
`messaging.frames`, then ``length`` payload bytes) and applies at most one fault to each frame, in
each direction, with a seeded random generator so a failing run can be replayed.

What each fault models:

- ``drop``: a frame that never arrives (a lost message above TCP: a peer that crashed after
  reading it, a middlebox that ate it). The sender must time out and resend.
- ``duplicate``: a frame that arrives twice (a retransmitted request, a replayed batch). The
  receiver must deduplicate: this is the heart of exactly-once.
- ``delay``: a frame held back for ``delay_seconds``; the stream behind it waits too, as TCP keeps
  order. Timeouts must not fire too early, and late replies must not be mistaken for new ones.
- ``reorder``: a frame swapped with the next one of the same direction (or sent 50 ms late if no
  next frame comes). TCP never does this; pipelined protocols must still not depend on it.
- ``truncate``: a random prefix of the frame, then a reset: the peer died mid-write. The receiver
  sees a frame cut short (``FrameError`` with ``what == "truncated"``) or ``ECONNRESET``.
- ``bitflip``: one flipped bit anywhere in the frame, header or payload (bad memory, a broken
  middlebox). The receiver's header and CRC checks must catch it; a silently wrong frame is a bug.
- ``reset``: the connection reset (RST on both sides, ``SO_LINGER`` 0) instead of this frame: a
  crashed peer or a firewall dropping state.

Reply faults (`ReplyFault`, `FaultProxy.set_reply_faults`) model the case the per-frame faults
cannot aim at: the server acted on a request, and its answer comes late, never, or with the
connection cut. Each XA request (``XA_START`` .. ``XA_FORGET``) a client sends is matched, in
order, with the ``XA_REPLY`` that answers it on the same connection; a rule names the request type
it hits (``XA_PREPARE``, say) and which of them (every n-th, or each with a seeded probability),
and what happens to the reply: ``delay`` holds it (and the stream behind it) for ``seconds``,
``drop`` never sends it, ``reset`` resets the connection instead, and ``outage`` then pauses
the whole proxy for that many seconds (the server unreachable).

`FaultProxy.pause` / `FaultProxy.resume` stop and restart forwarding without closing anything (a
partition: data queues in the proxy and the kernel buffers); `FaultProxy.reset_all` resets every
live connection at once. The first ``pass_first`` frames of each direction of each connection
pass untouched, so the authentication handshake gets through and the faults hit the protocol.

A stream that does not look like frames (wrong magic, or a length over 64 MiB) is forwarded raw
and untouched from that point on (counted in ``stats["raw_bytes"]``): the proxy never waits for a
frame that will not come. Random choices depend only on the seed, the connection number (1, 2, ...
in accept order), the direction and the frames seen, never on timing, so the same seed and the same
traffic give the same faults.

Threads and blocking sockets, stdlib only: one accept thread, two pump threads per connection.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import random
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from messaging.frames import HEADER, HEADER_SIZE, MAGIC

#: A length above this is not a frame this proxy believes in: the direction goes raw.
MAX_FRAME_LENGTH = 64 * 1024 * 1024
#: How long a reordered frame waits for a partner before it is sent alone.
REORDER_WAIT = 0.05
#: Every blocking wait wakes at least this often to look at the close and reset flags.
_POLL = 0.1
_CHUNK = 64 * 1024
_CONNECT_TIMEOUT = 2.0
_LINGER_RESET = struct.pack("ii", 1, 0)
#: Direction keys in the seed: far apart, so no two (connection, direction) pairs share a stream.
_UPSTREAM, _DOWNSTREAM = 0, 1 << 32
#: Checked in this order against one draw; if the probabilities add up past 1, earlier ones win.
_FAULT_ORDER = ("reset", "truncate", "drop", "bitflip", "duplicate", "reorder", "delay")
_STAT_OF = {
    "drop": "dropped",
    "duplicate": "duplicated",
    "delay": "delayed",
    "reorder": "reordered",
    "truncate": "truncated",
    "bitflip": "bitflipped",
    "reset": "resets",
}
_DIRECTIONS = frozenset({"both", "upstream", "downstream"})


@dataclass(frozen=True)
class Faults:
    """Per-frame fault probabilities; at most one fault is applied to a frame."""

    drop: float = 0.0  # probability a frame is silently discarded
    duplicate: float = 0.0  # the frame is sent twice
    delay: float = 0.0  # the frame (and the stream behind it) is held delay_seconds
    delay_seconds: tuple[float, float] = (0.001, 0.05)
    reorder: float = 0.0  # the frame is sent right after the next one (or after 50 ms)
    truncate: float = 0.0  # a random prefix of the frame, then a reset of both sockets
    bitflip: float = 0.0  # one random bit of the frame flipped (header or payload)
    reset: float = 0.0  # reset both sides (RST) instead of sending the frame
    direction: str = "both"  # "both", "upstream" (client->server) or "downstream"
    pass_first: int = 3  # the first N frames of each direction of each connection pass untouched

    def __post_init__(self) -> None:
        for name in _FAULT_ORDER:
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"Faults.{name} must be a probability in [0, 1], got {p!r}")
        low, high = self.delay_seconds
        if not 0.0 <= low <= high:
            raise ValueError(f"Faults.delay_seconds must be 0 <= low <= high, got {low}, {high}")
        if self.direction not in _DIRECTIONS:
            raise ValueError(f"Faults.direction must be one of {sorted(_DIRECTIONS)}")
        if self.pass_first < 0:
            raise ValueError("Faults.pass_first must be >= 0")

    def applies_to(self, direction: str) -> bool:
        return self.direction in ("both", direction)

    def choose(self, rng: random.Random) -> str | None:
        """One draw decides the fault (or none) for one frame."""
        draw = rng.random()
        total = 0.0
        for name in _FAULT_ORDER:
            p: float = getattr(self, name)
            if p > 0.0:
                total += p
                if draw < total:
                    return name
        return None


_XA_REQUESTS = frozenset(range(32, 38))  # XA_START .. XA_FORGET: each answered by one XA_REPLY
_XA_REPLY = 47
_REPLY_ACTIONS = frozenset({"delay", "drop", "reset"})


@dataclass(frozen=True)
class ReplyFault:
    """Mistreat the reply to chosen requests of type ``verb`` (a `FrameType` number).

    ``every``: the n-th, 2n-th, ... such request through this proxy (all connections counted
    together); or, if ``probability`` is set, each one with that chance (seeded by the proxy's
    seed). ``action``: ``delay`` (hold the reply ``seconds``), ``drop`` (never send it) or
    ``reset`` (reset the connection instead). ``outage``: seconds the whole proxy then stops
    forwarding, as if the server were unreachable."""

    verb: int
    action: str = "delay"
    every: int = 1
    probability: float | None = None
    seconds: float = 1.0
    outage: float = 0.0

    def __post_init__(self) -> None:
        if self.verb not in _XA_REQUESTS:
            raise ValueError(f"ReplyFault.verb must be an XA request type, not {self.verb!r}")
        if self.action not in _REPLY_ACTIONS:
            raise ValueError(f"ReplyFault.action must be one of {sorted(_REPLY_ACTIONS)}")
        if self.every < 1 or self.seconds < 0 or self.outage < 0:
            raise ValueError("ReplyFault needs every >= 1, seconds >= 0 and outage >= 0")
        if self.probability is not None and not 0.0 <= self.probability <= 1.0:
            raise ValueError("ReplyFault.probability must be in [0, 1]")


class _Killed(Exception):
    """The connection was reset or the proxy closed: the pump stops at once."""


class _Connection:
    """One client connection and its upstream; the pumps own the sockets and close them last."""

    def __init__(self, proxy: FaultProxy, number: int, client: socket.socket) -> None:
        self.proxy = proxy
        self.number = number
        self.client = client
        self.upstream: socket.socket | None = None
        self.lock = threading.Lock()
        self.dead = False  # reset: sockets get SO_LINGER 0 and are closed with an RST
        self.running = 1  # pumps alive; the first one is alive before the upstream connects
        self.finished = False
        #: one entry per XA request sent upstream and not yet answered: the fault for its reply
        self.replies: collections.deque[ReplyFault | None] = collections.deque()

    @property
    def stopped(self) -> bool:
        return self.dead or self.proxy._closing

    def kill(self) -> bool:
        """Reset both sockets. The RST leaves when the pumps, woken here, close them."""
        with self.lock:
            if self.dead or self.finished:
                return False
            self.dead = True
            for sock in (self.client, self.upstream):
                if sock is None:
                    continue
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RD)  # wakes a pump blocked on it; sends nothing
        self.proxy._wake()
        return True

    def half_close(self, dst: socket.socket) -> None:
        with self.lock:
            if not self.dead:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)

    def started_pump(self) -> None:
        with self.lock:
            self.running += 1

    def pump_done(self) -> None:
        with self.lock:
            self.running -= 1
            if self.running > 0:
                return
            self.finished = True
            for sock in (self.client, self.upstream):
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.close()
        self.proxy._forget(self)


class _Pump:
    """Copies one direction frame by frame, applying the faults."""

    def __init__(
        self,
        conn: _Connection,
        src: socket.socket,
        dst: socket.socket,
        direction: str,
    ) -> None:
        proxy = conn.proxy
        self.proxy = proxy
        self.conn = conn
        self.src = src
        self.dst = dst
        self.direction = direction
        key = _UPSTREAM if direction == "upstream" else _DOWNSTREAM
        self.rng = random.Random(proxy._seed ^ conn.number ^ key)
        self.index = 0  # frames seen in this direction
        self.held: bytes | None = None  # a reordered frame waiting for its partner
        self.held_until = 0.0
        self.raw = False

    def run(self) -> None:
        try:
            self._loop()
        except _Killed:
            pass
        except OSError:  # the peer reset or vanished: pass that on to the other side
            if not self.conn.stopped:
                self.proxy._count("peer_resets")
            self.conn.kill()
        finally:
            self.conn.pump_done()

    def _loop(self) -> None:
        buf = bytearray()
        with selectors.DefaultSelector() as selector:
            selector.register(self.src, selectors.EVENT_READ)
            while True:
                self.proxy._wait_running(self.conn)
                wait = _POLL
                if self.held is not None:
                    remaining = self.held_until - time.monotonic()
                    if remaining <= 0:
                        self._flush_held()
                        continue
                    wait = min(wait, remaining)
                if not selector.select(wait):
                    if self.conn.stopped:
                        raise _Killed
                    continue
                data = self.src.recv(_CHUNK)
                if not data:  # EOF, or the SHUT_RD of a reset
                    if self.conn.stopped:
                        raise _Killed
                    self._flush_held()
                    if buf:  # an unfinished frame: the receiver sees it cut short, as sent
                        self._send_raw(bytes(buf))
                    self.conn.half_close(self.dst)
                    return
                if self.raw:
                    self._send_raw(data)
                    continue
                buf += data
                self._frames(buf)

    def _frames(self, buf: bytearray) -> None:
        """Handle every whole frame in ``buf``; go raw at the first thing that is not one."""
        start = 0
        while not self.raw:
            rest = len(buf) - start
            if rest < HEADER_SIZE:
                if not MAGIC.startswith(bytes(buf[start : start + min(rest, len(MAGIC))])):
                    self._go_raw(buf, start)
                break
            magic, _version, _type, _flags, length, _crc = HEADER.unpack_from(buf, start)
            if magic != MAGIC or length > MAX_FRAME_LENGTH:
                self._go_raw(buf, start)
                break
            end = start + HEADER_SIZE + length
            if len(buf) < end:
                break
            frame = bytes(buf[start:end])
            start = end
            self._frame(frame)
        del buf[:start]

    def _go_raw(self, buf: bytearray, start: int) -> None:
        self._flush_held()
        self.raw = True
        self.proxy._count("raw_streams")
        self._send_raw(bytes(buf[start:]))
        del buf[start:]

    def _frame(self, frame: bytes) -> None:
        proxy = self.proxy
        proxy._count("frames")
        index = self.index
        self.index += 1
        if self._replies(frame, index):
            return
        faults = proxy._faults
        fault = None
        if index >= faults.pass_first and faults.applies_to(self.direction):
            fault = faults.choose(self.rng)
            if fault == "reorder" and self.held is not None:
                fault = None  # this frame is the partner of the one held: it goes first
        if fault is not None:
            proxy._count(_STAT_OF[fault])
            proxy._record(self.conn.number, self.direction, index, fault)
        if fault is None:
            self._send(frame)
        elif fault == "drop":
            pass
        elif fault == "duplicate":
            self._send(frame + frame)
        elif fault == "delay":
            low, high = faults.delay_seconds
            proxy._sleep(self.conn, self.rng.uniform(low, high))
            self._send(frame)
        elif fault == "reorder":
            self.held = frame
            self.held_until = time.monotonic() + REORDER_WAIT
            return
        elif fault == "bitflip":
            bit = self.rng.randrange(len(frame) * 8)
            flipped = bytearray(frame)
            flipped[bit // 8] ^= 1 << (bit % 8)
            self._send(bytes(flipped))
        elif fault == "truncate":
            self._send(frame[: self.rng.randrange(1, len(frame))])
            self.conn.kill()
            raise _Killed
        elif fault == "reset":
            self.conn.kill()
            raise _Killed
        self._flush_held()

    def _replies(self, frame: bytes, index: int) -> bool:
        """Match XA requests with their replies; True if a reply fault took this frame."""
        ftype = frame[5]  # the header's type byte
        if self.direction == "upstream" and ftype in _XA_REQUESTS:
            self.conn.replies.append(self.proxy._reply_fault(ftype))
        elif self.direction == "downstream" and ftype == _XA_REPLY and self.conn.replies:
            rule = self.conn.replies.popleft()
            if rule is not None:
                self._mistreat_reply(frame, rule, index)
                return True
        return False

    def _mistreat_reply(self, frame: bytes, rule: ReplyFault, index: int) -> None:
        proxy = self.proxy
        proxy._count(f"reply_{rule.action}")
        proxy._record(self.conn.number, self.direction, index, f"reply_{rule.action}")
        if rule.action == "delay":
            proxy._sleep(self.conn, rule.seconds)
            self._send(frame)
        elif rule.action == "reset":
            self.conn.kill()
        if rule.outage:
            proxy.pause()
            threading.Timer(rule.outage, proxy.resume).start()
        if rule.action == "reset":
            raise _Killed

    def _flush_held(self) -> None:
        if self.held is not None:
            held, self.held = self.held, None
            self._send(held)

    def _send_raw(self, data: bytes) -> None:
        self.proxy._count("raw_bytes", len(data))
        self._send(data)

    def _send(self, data: bytes) -> None:
        """sendall that gives up when the connection is reset or the proxy closes."""
        view = memoryview(data)
        sent = 0
        while sent < len(view):
            self.proxy._wait_running(self.conn)
            try:
                sent += self.dst.send(view[sent:])
            except TimeoutError:  # the socket's _POLL timeout: the peer is not reading
                continue


class FaultProxy:
    """A frame-aware TCP fault-injection proxy in front of ``upstream``; see the module docstring.

    ``address`` is bound in the constructor; `start` begins accepting. Faults can be changed at
    any time with `set_faults` and apply to the next frames of every connection. ``stats`` counts
    connections, frames, each fault, raw bytes; ``events`` lists every injected fault as
    (connection number, direction, frame index, fault), for a test to compare runs.
    """

    def __init__(
        self, upstream: tuple[str, int], faults: Faults | None = None, *, seed: int = 0
    ) -> None:
        self.upstream = upstream
        self._faults = faults if faults is not None else Faults()
        self._seed = seed
        self.stats: collections.Counter[str] = collections.Counter()
        self.events: list[tuple[int, str, int, str]] = []
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._paused = False
        self._closing = False
        self._closed = False
        self._conns: set[_Connection] = set()
        self._threads: list[threading.Thread] = []
        self._numbers = itertools.count(1)
        self._reply_faults: tuple[ReplyFault, ...] = ()
        self._reply_counts: collections.Counter[int] = collections.Counter()
        self._reply_rng = random.Random(seed ^ 0x5EED)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL)
        host, port = self._listener.getsockname()[:2]
        self.address: tuple[str, int] = (host, port)
        self._acceptor: threading.Thread | None = None

    # -- control -----------------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        with self._lock:
            if self._closing:
                raise RuntimeError("FaultProxy is closed")
            if self._acceptor is None:
                self._acceptor = threading.Thread(
                    target=self._accept_loop, name=f"fault-proxy-accept-{self.address[1]}"
                )
                self._acceptor.daemon = True
                self._acceptor.start()
        return self

    def set_faults(self, faults: Faults) -> None:
        with self._lock:
            self._faults = faults

    @property
    def faults(self) -> Faults:
        return self._faults

    def set_reply_faults(self, *rules: ReplyFault) -> None:
        """Replace the reply faults (none: replies pass); see `ReplyFault`."""
        with self._lock:
            self._reply_faults = rules
            self._reply_counts.clear()

    def _reply_fault(self, verb: int) -> ReplyFault | None:
        """The rule hitting the reply to this request, if any (first matching rule wins)."""
        with self._lock:
            self._reply_counts[verb] += 1
            n = self._reply_counts[verb]
            for rule in self._reply_faults:
                if rule.verb != verb:
                    continue
                if rule.probability is not None:
                    if self._reply_rng.random() < rule.probability:
                        return rule
                elif n % rule.every == 0:
                    return rule
            return None

    def reset_all(self) -> int:
        """Reset (RST) every live connection now; returns how many were reset."""
        with self._lock:
            conns = list(self._conns)
        count = sum(1 for conn in conns if conn.kill())
        self._count("resets", count)
        return count

    def pause(self) -> None:
        """Stop forwarding (a partition): data waits in the proxy and kernel buffers."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def close(self) -> None:
        """Stop accepting, reset every connection, join every thread. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = self._closing = True
            conns = list(self._conns)
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() at once on Linux
        for conn in conns:
            conn.kill()
        deadline = time.monotonic() + 2.0
        while (remaining := deadline - time.monotonic()) > 0:
            with self._lock:
                everyone = [*self._threads, *([self._acceptor] if self._acceptor else [])]
            alive = [t for t in everyone if t.is_alive() and t is not threading.current_thread()]
            if not alive:
                break
            alive[0].join(remaining)
        self._listener.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------------

    def _stopping(self) -> bool:
        return self._closing  # a call, so mypy does not narrow the flag across the loop

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    def _record(self, number: int, direction: str, index: int, fault: str) -> None:
        with self._lock:
            self.events.append((number, direction, index, fault))

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _wait_running(self, conn: _Connection) -> None:
        """Block while paused; raise `_Killed` once the connection is reset or the proxy closes."""
        with self._cond:
            while self._paused and not conn.stopped:
                self._cond.wait(_POLL)
        if conn.stopped:
            raise _Killed

    def _sleep(self, conn: _Connection, seconds: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: conn.stopped, timeout=seconds)
        if conn.stopped:
            raise _Killed

    def _forget(self, conn: _Connection) -> None:
        with self._lock:
            self._conns.discard(conn)
            self._threads = [t for t in self._threads if t.is_alive()]

    def _spawn(self, target: Callable[[], None], name: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=name)
        thread.daemon = True
        with self._lock:
            self._threads.append(thread)
        thread.start()
        return thread

    def _accept_loop(self) -> None:
        while not self._stopping():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping():
                    return
                time.sleep(_POLL)  # e.g. EMFILE: do not spin
                continue
            client.settimeout(_POLL)
            with self._lock:
                if self._closing:
                    client.close()
                    return
                conn = _Connection(self, next(self._numbers), client)
                self._conns.add(conn)
                self.stats["connections"] += 1
            self._spawn(functools.partial(self._serve, conn), f"fault-proxy-{conn.number}-up")

    def _serve(self, conn: _Connection) -> None:
        """Connect upstream, start the downstream pump, then pump upstream in this thread."""
        try:
            upstream = socket.create_connection(self.upstream, timeout=_CONNECT_TIMEOUT)
        except OSError:
            self._count("upstream_refused")
            with contextlib.suppress(OSError):
                conn.client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            conn.pump_done()  # closes the client at once
            return
        upstream.settimeout(_POLL)
        with conn.lock:
            conn.upstream = upstream
            dead = conn.dead
        if dead:  # reset while connecting: the RST reaches the server too
            with contextlib.suppress(OSError):
                upstream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            conn.pump_done()
            return
        down = _Pump(conn, upstream, conn.client, "downstream")
        conn.started_pump()
        try:
            self._spawn(down.run, f"fault-proxy-{conn.number}-down")
        except BaseException:
            conn.pump_done()
            raise
        _Pump(conn, conn.client, upstream, "upstream").run()
