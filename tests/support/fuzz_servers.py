"""Fuzz sessions against live ``twopc serve log`` and ``twopc serve cursor`` processes, and the
checks that follow a run: the servers still answer a normal client, no traceback reached their
output, and both journals open again after a clean stop.

A session is one connection: unauthenticated (read HELLO, send one frame, read the answer) or
authenticated as a role (send a burst of that role's frames, then a PING with a fresh token, and
read every answer up to its PONG, the connection's close, or a timeout, which is a *hang*). Every
answer lands in a histogram by kind (``ACK``, ``NACK invalid-message``, ``XA_REPLY bad-request``,
``ERROR bad-frame``, ``closed``...). Failures: a server that died, a hang, ``internal-error``
anywhere (reserved for defects), a ``Traceback`` in a server's output, a journal that does not
open again.

Used by ``tests/integration/test_fuzz_servers.py`` (a few thousand frames, Hypothesis draws) and
``bench/fuzz_servers.py`` (a million, seeded random draws).
"""

from __future__ import annotations

import hmac
import re
import secrets
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path

from coordinator import MemoryDecisionLog, TransactionManager
from coordinator.errors import FrameError
from messaging.auth import PRE_AUTH_MAX_FRAME, SharedSecret
from messaging.connection import Connection, connect
from messaging.frames import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    ORIGIN_VERSION,
    Ack,
    ErrorFrame,
    FrameReader,
    FrameType,
    Hello,
    Nack,
    Origin,
    Ping,
    Pong,
    Value,
    Welcome,
    XaReply,
    decode,
    encode,
    encode_value,
)
from messaging.remote import RemoteCursor, RemoteMessageLog

from .fuzz_frames import (
    ROLES,
    Draw,
    State,
    any_frame,
    build,
    mutate,
    number,
    raw_frame,
    restamp,
    text,
)
from .msg_cluster import SECRET, SERVE, Proc, free_port

#: an answer that is a defect whatever the frame was
FAILURES = ("XA_REPLY internal-error", "ERROR internal-error", "hang")
SESSION_TIMEOUT = 45.0  # above MAX_RECEIVE_WAIT: a receive may wait its 30 s


@dataclass
class Tally:
    frames: int = 0
    sessions: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # failure kind -> a frame, hex
    states: dict[str, State] = field(default_factory=dict)  # per role, across sessions

    last_sent: bytes = b""  # the frames of the last session that failed

    def note(self, kind: str, sent: bytes = b"") -> None:
        self.answers[kind] += 1
        if kind in FAILURES:
            self.last_sent = sent
        if kind in FAILURES and kind not in self.examples:
            self.examples[kind] = sent[:2000].hex()

    @property
    def failures(self) -> int:
        return sum(self.answers[k] for k in FAILURES)


def describe(sent: bytes) -> str:
    """The frames of a session, decoded one per line as far as they decode."""
    lines, view = [], memoryview(sent)
    while len(view) >= HEADER_SIZE:
        length = HEADER.unpack_from(view)[4]
        chunk, view = view[: HEADER_SIZE + length], view[HEADER_SIZE + length :]
        try:
            lines.append(repr(decode(chunk)))
        except FrameError as exc:
            lines.append(f"{bytes(chunk[:200]).hex()} ({exc})")
    return "\n".join(lines)


def answer_kind(frame: object) -> str:
    if isinstance(frame, XaReply):
        return f"XA_REPLY {frame.status}"
    if isinstance(frame, ErrorFrame):
        return f"ERROR {frame.code}"
    if isinstance(frame, Nack):
        return f"NACK {frame.reason}"
    if isinstance(frame, Ack | Pong | Welcome):
        return type(frame).__name__.upper()
    return f"unexpected {type(frame).__name__}"


# -- sessions ------------------------------------------------------------------------------------


def transcript_proof(secret: bytes, side: str, hello: Hello, fields: dict[str, Value]) -> bytes:
    """The handshake proof as docs/protocol.md specifies it, written from the spec (not the
    server's code), so a fuzzed AUTH can carry a *valid* proof for odd roles and versions."""
    transcript = {
        "side": f"twopc-auth-{side}", "server_nonce": hello.nonce, "server_id": hello.server_id,
        "versions": list(hello.versions), "client_nonce": fields["nonce"],
        "client_id": fields["client_id"], "role": fields["role"], "version": fields["version"],
    }  # fmt: skip
    return hmac.new(secret, encode_value(transcript), sha256).digest()


def handshake_frame(d: Draw, hello: Hello, secret: bytes) -> bytes:
    """What an unauthenticated peer sends after HELLO: mostly an AUTH, some with a valid proof
    (so role and version refusals are reached), some damaged; sometimes another frame type."""
    if d.chance(0.1):
        ftype, fields = any_frame(d, State())
        return build(d, ftype, fields, mutation_rate=0.2)
    if d.chance(0.02):
        return raw_frame(int(FrameType.AUTH), b"\x09\x00" + bytes(PRE_AUTH_MAX_FRAME))
    fields: dict[str, Value] = {
        "client_id": "fuzzer" if d.chance(0.8) else text(d),
        "nonce": secrets.token_bytes(32) if d.chance(0.9) else d.raw(40),
        "role": d.choice(("transfer", "consumer", "producer", "admin", "")) if d.chance(0.9)
        else text(d),
        "version": 1 if d.chance(0.8) else number(d),
    }  # fmt: skip
    valid = d.chance(0.6) and all(isinstance(fields[k], str) for k in ("client_id", "role"))
    fields["proof"] = transcript_proof(secret, "client", hello, fields) if valid else d.raw(40)
    if d.chance(0.05):
        fields["proof"] = transcript_proof(secret, "server", hello, fields)  # reflected
    payload = encode_value(fields)
    return mutate(d, int(FrameType.AUTH), payload) if d.chance(0.1) else raw_frame(2, payload)


_GONE = object()  # what `_take` returns when the connection failed


def _take(read: Callable[[], object], sent: bytes, tally: Tally) -> object:
    """The next answer, or `_GONE` once a hang (no answer in time) or a reset is noted."""
    try:
        return read()
    except TimeoutError:
        tally.note("hang", sent)
    except (OSError, FrameError):
        tally.note("reset")
    return _GONE


def unauthenticated(address: tuple[str, int], d: Draw, secret: bytes, tally: Tally) -> None:
    with socket.create_connection(address, timeout=SESSION_TIMEOUT) as sock:
        reader = FrameReader(sock, max_frame=PRE_AUTH_MAX_FRAME)
        hello = reader.read()
        if not isinstance(hello, Hello):
            tally.note(f"unexpected first frame {type(hello).__name__}")
            return
        sent = handshake_frame(d, hello, secret)
        tally.frames += 1
        tally.sessions += 1
        try:
            sock.sendall(sent)
            if d.chance(0.05):
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            tally.note("reset")
            return
        answer = _take(reader.read, sent, tally)
        if answer is not _GONE:
            tally.note("closed" if answer is None else answer_kind(answer), sent)


def authenticated(
    address: tuple[str, int],
    role: str,
    d: Draw,
    secret: SharedSecret,
    tally: Tally,
    *,
    frames: int,
    state: State,
) -> None:
    conn = connect(address, secret, "fuzzer", role, timeout=SESSION_TIMEOUT)
    with conn:
        version = conn.version  # every frame after the handshake carries it
        sent = [restamp(ROLES[role].frame(d, state), version) for _ in range(frames)]
        if role == "transfer" and version >= ORIGIN_VERSION:  # one log: the fuzzer's own
            sent.insert(0, encode(Origin("fuzzer", 1), version=version))
        token = secrets.randbits(63) + 2**63  # fuzzed pings never use this range
        tail, close_after = encode(Ping(token), version=version), False
        if d.chance(0.02):  # a frame cut short, then our end closed: the server reads EOF in it
            tail, close_after = sent.pop()[: d.integer(1, 20)], True
        elif d.chance(0.02):  # a header claiming 2 GiB: refused before a payload byte is read
            tail, close_after = HEADER.pack(MAGIC, version, int(FrameType.MSG), 0, 2**31, 0), True
        tally.frames += len(sent) + 1
        tally.sessions += 1
        data = b"".join(sent) + tail
        try:
            conn.sock.sendall(data)
            if close_after:
                conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            tally.note("reset")
            return
        _answers(conn, token, data, tally)


def _answers(conn: Connection, token: int, sent: bytes, tally: Tally) -> None:
    """Read answers up to the PONG of ``token``, then whatever is already here: a transfer
    answers the PINGs of a batch before its ACKs, in the same write."""
    deadline = time.monotonic() + SESSION_TIMEOUT
    ponged = False
    while not ponged or conn.readable():
        left = max(0.001, deadline - time.monotonic())
        frame = _take(lambda: conn.recv(timeout=left), sent, tally)  # noqa: B023
        if frame is _GONE:
            return
        if frame is None:
            tally.note("closed")
            return
        if isinstance(frame, Pong) and frame.token == token:
            ponged = True
        elif not isinstance(frame, Ping):
            tally.note(answer_kind(frame), sent)
            if isinstance(frame, ErrorFrame):
                return


# -- the servers ---------------------------------------------------------------------------------


class Servers:
    """A cursor server and a log server feeding it, as ``twopc serve`` processes whose output
    (stdout and stderr, with the log lines) goes to files under ``workdir``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.cursor_port, self.log_port = free_port(), free_port()
        serve = [sys.executable, "-c", SERVE, "serve"]
        cursor_at, log_at = f"127.0.0.1:{self.cursor_port}", f"127.0.0.1:{self.log_port}"
        self.cursor = Proc(
            "cursor",
            [*serve, "cursor", "--dir", str(workdir / "cursor"), "--listen", cursor_at,
             "--dispatch-workers", "2"],
            workdir,
        )  # fmt: skip
        self.log = Proc(
            "log",
            [
                *serve,
                "log",
                "--dir",
                str(workdir / "log"),
                "--listen",
                log_at,
                "--cursor",
                cursor_at,
            ],
            workdir,
        )
        self.secret = SharedSecret(SECRET.encode())
        self.stops: list[str] = []  # a stop that failed: which and how

    @property
    def cursor_address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.cursor_port)

    @property
    def log_address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.log_port)

    def start(self, timeout: float = 60.0) -> None:
        """Start both (again, on the same directories) and wait until each listens; a server
        whose journal cannot be opened exits instead, which raises here."""
        for proc in (self.cursor, self.log):
            proc.start()
            deadline = time.monotonic() + timeout
            while "listening on" not in proc.outputs[-1].read_text(errors="replace"):
                assert proc.popen is not None
                if proc.popen.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{proc.name} did not start:\n{proc.text()[-3000:]}")
                time.sleep(0.05)

    def alive(self) -> list[str]:
        return [p.name for p in (self.cursor, self.log) if p.popen and p.popen.poll() is None]

    def stop(self) -> None:
        """SIGTERM both (the log first: it feeds the cursor); record any unclean exit."""
        for proc in (self.log, self.cursor):
            proc.stop(signal.SIGTERM, timeout=30)
            assert proc.popen is not None
            if proc.popen.returncode != 0 or "stopped" not in proc.outputs[-1].read_text():
                self.stops.append(f"{proc.name} exited {proc.popen.returncode}")

    def rss_kib(self) -> dict[str, int]:
        out = {}
        for proc in (self.cursor, self.log):
            assert proc.popen is not None
            status = Path(f"/proc/{proc.popen.pid}/status")
            found = re.search(r"VmRSS:\s+(\d+)", status.read_text()) if status.exists() else None
            out[proc.name] = int(found.group(1)) if found else -1
        return out

    def tracebacks(self) -> list[str]:
        """Every traceback either server printed, with the log line before it."""
        found = []
        for proc in (self.cursor, self.log):
            for path in proc.outputs:
                lines = path.read_text(errors="replace").splitlines()
                found += [
                    f"{path.name}: {lines[i - 1] if i else ''} / {' | '.join(lines[i + 1 : i + 8])}"
                    for i, line in enumerate(lines)
                    if line.startswith("Traceback")
                ]
        return found

    def round_trip(self, destination: str, timeout: float = 30.0) -> bool:
        """A normal client's exchange: send one message through the remote log in a transaction
        and receive it through the remote cursor. True if it arrived."""
        log = RemoteMessageLog(self.log_address, self.secret, name="check-log")
        cursor = RemoteCursor(self.cursor_address, self.secret, name="check-cursor")
        tm = TransactionManager("fuzz-check", MemoryDecisionLog(), [log, cursor],
                                recovery_interval=None, reaper_interval=None)  # fmt: skip
        try:
            body = secrets.token_bytes(8)
            with tm.transaction() as tx:
                tx.join(log).send(destination, body)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                with tm.transaction() as tx:
                    got = tx.join(cursor).receive_many(destination, 10, timeout=1.0)
                if got:
                    return [m.body for m in got] == [body]
            return False
        finally:
            tm.close()
            log.close()
            cursor.close()


def run_session(servers: Servers, d: Draw, tally: Tally, frames: int) -> None:
    """One session of a kind drawn from ``d``: unauthenticated at either server, or as a role."""
    kind = d.choice(("handshake", "handshake", "transfer", "transfer", "consumer", "producer"))
    if kind == "handshake":
        address = d.choice((servers.cursor_address, servers.log_address))
        unauthenticated(address, d, SECRET.encode(), tally)
    else:
        address = servers.log_address if kind == "producer" else servers.cursor_address
        state = tally.states.setdefault(kind, State())
        authenticated(address, kind, d, servers.secret, tally, frames=frames, state=state)
