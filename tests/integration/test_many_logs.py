"""Many logs, one destination, one cursor (issue 15, point 1: a stream per log and destination).

Invariants named here: ``exactly_once_per_log`` (every message of every log arrives once, in its
log's commit order, merged into the destination's one queue), ``identity_fencing`` (a second
process claiming a log's identity, a copy of its directory, is refused with ``ERROR log-fenced``
whichever connects first, and the older one's live connection is cut at its next batch),
``compatible_replay`` (journals written before log identities: the log chooses its identity at
its next open and keeps it; the cursor's stream state of that time is claimed by the log whose
epoch it is, so messages accepted before the upgrade whose acknowledgment was lost are dropped as
duplicates, not delivered twice), and ``version_1_peers`` (a log that speaks only version 1 still
feeds the cursor, under the bare stream name, as before).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coordinator import MemoryDecisionLog, TransactionManager
from coordinator.journal import Journal
from messaging.auth import SharedSecret
from messaging.connection import Connection, connect
from messaging.frames import ErrorFrame, Msg, Origin, Ping, Pong
from messaging.remote import RemoteCursor
from messaging.server import CursorServer, LogServer
from messaging.transfer import TRANSFER_ROLE, LogTransfer
from resource_managers.cursor import Cursor
from resource_managers.message_log import Message, MessageLog, MessageLogResource
from resource_managers.message_log._records import encode as log_encode
from resource_managers.message_log._records import message_obj
from resource_managers.sequencing import DoublingBackoff
from tests.support.msg_cluster import free_port
from tests.support.scripts import run_script

SECRET_TEXT = "many-logs-test-secret-0123456789"
SECRET = SharedSecret(SECRET_TEXT.encode())
IDENTITY_WORKER = Path(__file__).resolve().parents[1] / "crash" / "identity_worker.py"


def fast() -> DoublingBackoff:
    return DoublingBackoff(base=0.1, cap=0.5)


def wait(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def produce(mlog: MessageLog, destination: str, bodies: list[bytes]) -> None:
    """One transaction per body, so each is its own commit (the log's order is commit order)."""
    resource = MessageLogResource(mlog)
    tm = TransactionManager(
        "producer", MemoryDecisionLog(), [resource], recovery_interval=None, reaper_interval=None
    )
    try:
        for body in bodies:
            with tm.transaction() as tx:
                tx.join(resource).send(destination, body)
    finally:
        tm.close()


def bodies(cursor: Cursor, queue: str) -> list[bytes]:
    return [d.body for d in cursor.available(queue)]


def per_log(received: list[bytes], prefix: bytes) -> list[bytes]:
    return [b for b in received if b.startswith(prefix)]


@pytest.fixture
def cursor_server(tmp_path: Path) -> Iterator[CursorServer]:
    with CursorServer(
        tmp_path / "cursor", SECRET, listen=("127.0.0.1", 0), dispatch_workers=0
    ) as server:
        yield server


def log_server(path: Path, cursor: CursorServer, server_id: str = "twopc-log") -> LogServer:
    return LogServer(path, SECRET, cursor=cursor.address, resend=fast(), server_id=server_id)


def test_two_logs_feed_one_destination_each_once_and_in_its_own_order(
    tmp_path: Path, cursor_server: CursorServer
) -> None:
    """``exactly_once_per_log``: both logs number "orders" from 1 in their own epochs; before
    issue 15 the second fenced the first. The same client id for both: a log is its identity,
    not its name or address."""
    with (
        log_server(tmp_path / "a", cursor_server) as a,
        log_server(tmp_path / "b", cursor_server) as b,
    ):
        assert a.mlog.identity != b.mlog.identity
        for i in range(4):  # interleaved commits, so the queue mixes the two logs
            produce(a.mlog, "orders", [f"a-{i}-{j}".encode() for j in range(10)])
            produce(b.mlog, "orders", [f"b-{i}-{j}".encode() for j in range(10)])
        assert a.transfer.wait_idle(20) and b.transfer.wait_idle(20)
        for server in (a, b):
            assert server.transfer.stats["fenced"] == 0
            assert server.transfer.stats["ack_wrong-epoch"] == 0
    cursor = cursor_server.cursor
    received = bodies(cursor, "orders")
    assert len(received) == len(set(received)) == 80
    for name in (b"a", b"b"):
        expected = [f"{name.decode()}-{i}-{j}".encode() for i in range(4) for j in range(10)]
        assert per_log(received, name + b"-") == expected
    for server in (a, b):
        assert cursor.ack_for("orders", server.mlog.identity).seq == 40
    assert cursor.ack_for("orders").seq == 0  # no state without a log
    assert cursor_server.receiver.stats["origins"] >= 2


def test_a_copy_of_a_log_directory_is_fenced_whichever_connects_first(
    tmp_path: Path, cursor_server: CursorServer
) -> None:
    """``identity_fencing``: a copied directory has the same identity; the newer open (higher
    incarnation) wins. The older one is refused at the handshake's ORIGIN, and if it was
    connected first, its next batch is refused and nothing of it written."""
    original = MessageLog(tmp_path / "orig")
    produce(original, "orders", [b"o-1"])
    original.close()
    shutil.copytree(tmp_path / "orig", tmp_path / "copy")
    first = MessageLog(tmp_path / "orig")
    second = MessageLog(tmp_path / "copy")
    # the higher incarnation wins: normally the later open, but two opens in one millisecond
    # are ordered by the incarnation's random low bits; they always differ
    older, newer = sorted((first, second), key=lambda m: m.incarnation)
    try:
        assert older.identity == newer.identity and older.incarnation < newer.incarnation

        def dial() -> Connection:
            return connect(cursor_server.address, SECRET, "log", TRANSFER_ROLE, timeout=2.0)

        with LogTransfer(older, dial, resend=fast()) as old_xfer:
            assert old_xfer.wait_idle(10)  # the older one alone: served
            with LogTransfer(newer, dial, resend=fast()) as new_xfer:
                produce(newer, "orders", [b"n-2"])
                assert new_xfer.wait_idle(10)
                produce(older, "orders", [b"o-2"])  # its live connection: refused now
                wait(lambda: old_xfer.stats["fenced"] >= 1)
                assert not old_xfer.wait_idle(1.0)
        received = bodies(cursor_server.cursor, "orders")
        assert received == [b"o-1", b"n-2"]  # the copy's o-1 was a duplicate of the original's
        stats = cursor_server.listener.stats
        assert stats["error_log-fenced"] >= 1 and stats["internal_errors"] == 0
        assert cursor_server.cursor.log_incarnations() == {newer.identity: newer.incarnation}
    finally:
        older.close()
        newer.close()


def test_an_older_incarnation_is_refused_at_origin_and_told_why(
    cursor_server: CursorServer,
) -> None:
    """``identity_fencing`` on the wire: ORIGIN of an older incarnation gets ``ERROR
    log-fenced`` with a one-line reason, and the connection is closed."""
    with connect(cursor_server.address, SECRET, "log", TRANSFER_ROLE) as conn:
        assert conn.version >= 2
        conn.send_many([Origin("log-x", 20), Ping(1)])
        assert conn.recv(timeout=5) == Pong(1)  # the ORIGIN was taken before the PING
    with connect(cursor_server.address, SECRET, "log", TRANSFER_ROLE) as conn:
        conn.send(Origin("log-x", 19))
        answer = conn.recv(timeout=5)
        assert isinstance(answer, ErrorFrame) and answer.code == "log-fenced"
        assert "incarnation 19 is fenced" in answer.message and "\n" not in answer.message
        assert conn.recv(timeout=5) is None


@pytest.mark.parametrize(
    "first",
    [Msg("orders", 1, 1, 0, "m-1", "orders", b"x"), Origin("log-x", 0), Origin("no|bar", 1)],
    ids=["msg-before-origin", "incarnation-0", "not-an-identity"],
)
def test_a_version_2_transfer_must_begin_with_a_valid_origin(
    cursor_server: CursorServer, first: Msg | Origin
) -> None:
    with connect(cursor_server.address, SECRET, "log", TRANSFER_ROLE) as conn:
        conn.send(first)
        answer = conn.recv(timeout=5)
        assert isinstance(answer, ErrorFrame) and answer.code == "bad-frame"
    assert cursor_server.cursor.ack_for("orders").seq == 0


def test_a_version_1_log_is_served_under_the_bare_stream(
    tmp_path: Path, cursor_server: CursorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``version_1_peers``: a log that speaks only version 1 sends no ORIGIN; the cursor keeps
    its streams under their bare names, as every cursor did before version 2."""
    monkeypatch.setattr("messaging.auth.SUPPORTED_VERSIONS", frozenset({1}))
    with log_server(tmp_path / "old", cursor_server) as old:
        produce(old.mlog, "orders", [b"v1-1", b"v1-2"])
        assert old.transfer.wait_idle(10)
    assert bodies(cursor_server.cursor, "orders") == [b"v1-1", b"v1-2"]
    assert cursor_server.cursor.ack_for("orders").seq == 2


# -- journals written before log identities -------------------------------------------------------


def write_journal(directory: Path, records: list[dict[str, object]]) -> None:
    """Records as the code before identities wrote them (the formats of that time, documented in
    the stores' ``_records`` modules), forced, through the journal they share."""
    journal = Journal(directory, replay=lambda _payload: None)
    try:
        for record in records:
            journal.append(log_encode(record), True)
    finally:
        journal.close()


def old_journals(tmp_path: Path, epoch: int, accepted: int, total: int) -> list[Message]:
    """A log that committed ``total`` messages to "orders" in ``epoch`` (its first open's
    incarnation), none acknowledged, and a cursor that accepted the first ``accepted`` of them
    from it under the bare stream name (their acknowledgments lost in a crash)."""
    messages = [Message(f"old-{n}", "orders", f"old-{n}".encode()) for n in range(1, total + 1)]
    log_records: list[dict[str, object]] = [{"k": "O", "n": epoch}]
    for n, m in enumerate(messages, 1):
        log_records.append({"k": "1", "g": f"gid-{n}", "m": [message_obj(m)], "s": [["orders", n]]})
    write_journal(tmp_path / "log", log_records)
    cursor_records: list[dict[str, object]] = [
        {"k": "M", "q": "orders", "e": epoch, "n": n, "o": message_obj(m)}
        for n, m in enumerate(messages[:accepted], 1)
    ]
    write_journal(tmp_path / "cursor", cursor_records)
    return messages


def test_journals_from_before_identities_keep_working_without_duplicates(tmp_path: Path) -> None:
    """``compatible_replay``: no migration step. The old log journal replays; its next open
    chooses an identity and writes it in its forced open record, and keeps it at every open
    after. The old cursor journal replays its bare-stream state; the upgraded log, whose epoch
    it is, claims it: the three messages the cursor had are dropped as duplicates, the other
    two delivered, and the state is the log's from then on (the bare one gone, also on replay)."""
    epoch = 1_700_000_000_000
    messages = old_journals(tmp_path, epoch, accepted=3, total=5)
    with MessageLog(tmp_path / "log") as mlog:
        identity = mlog.identity
        assert mlog.streams() == {"orders": epoch} and len(mlog.pending("orders")) == 5
    with MessageLog(tmp_path / "log") as mlog:
        assert mlog.identity == identity  # chosen once
    cursor = CursorServer(tmp_path / "cursor", SECRET, listen=("127.0.0.1", 0), dispatch_workers=0)
    with cursor:
        assert cursor.cursor.ack_for("orders").seq == 3
        with log_server(tmp_path / "log", cursor) as log:
            assert log.mlog.identity == identity
            assert log.transfer.wait_idle(10)
            assert log.transfer.stats["fenced"] == 0
        assert bodies(cursor.cursor, "orders") == [m.body for m in messages]
        assert cursor.cursor.filter_state()["streams"] == {
            f"{identity}|orders": {"epoch": epoch, "last": 5}
        }
        counts = cursor.cursor.filter_counts()
        assert counts["duplicate"] == 3 and counts["accept"] == 2
    with Cursor(tmp_path / "cursor") as reopened:  # the claim replays the same way
        assert reopened.filter_state()["streams"] == {
            f"{identity}|orders": {"epoch": epoch, "last": 5}
        }


def test_a_bare_stream_of_another_epoch_is_not_claimed(tmp_path: Path) -> None:
    """``compatible_replay``: the cursor's old state belongs to a log of another epoch (another
    log, say, that never upgraded): a new log's stream starts afresh and leaves it alone."""
    old_journals(tmp_path, 1_700_000_000_000, accepted=2, total=2)
    shutil.rmtree(tmp_path / "log")  # a fresh log: a new identity, a new epoch
    with CursorServer(
        tmp_path / "cursor", SECRET, listen=("127.0.0.1", 0), dispatch_workers=0
    ) as cursor:
        with log_server(tmp_path / "new", cursor) as log:
            produce(log.mlog, "orders", [b"new-1"])
            assert log.transfer.wait_idle(10)
        assert bodies(cursor.cursor, "orders") == [b"old-1", b"old-2", b"new-1"]
        assert cursor.cursor.ack_for("orders").seq == 2


def open_records(directory: Path) -> list[dict[str, object]]:
    """The ``O`` records of a message log's journal, in order."""
    found: list[dict[str, object]] = []

    def keep(payload: bytes) -> None:
        record = json.loads(payload)
        if record["k"] == "O":
            found.append(record)

    Journal(directory, replay=keep).close()
    return found


@pytest.mark.parametrize("journal", ["new", "before-identities"])
def test_a_kill_9_after_the_identity_is_chosen_keeps_it(tmp_path: Path, journal: str) -> None:
    """``compatible_replay``, crash point ``mlog.after_open``: the process choosing the identity
    (a new directory, or the first open of a journal from before identities) dies right after
    its forced ``O`` record; the next open keeps the identity that record holds, and so does
    every open after it."""
    if journal == "before-identities":
        old_journals(tmp_path, 1_700_000_000_000, accepted=0, total=2)
    killed = run_script(IDENTITY_WORKER, [str(tmp_path / "log")], crash_at="mlog.after_open")
    assert killed.returncode == -9 and "IDENTITY" not in killed.stdout, killed.stderr
    chosen = [r["i"] for r in open_records(tmp_path / "log") if "i" in r]
    assert len(chosen) == 1  # durable before the kill
    again = run_script(IDENTITY_WORKER, [str(tmp_path / "log")])
    assert again.returncode == 0 and again.stdout.split() == ["IDENTITY", chosen[0]]
    with MessageLog(tmp_path / "log") as mlog:
        assert mlog.identity == chosen[0]
        assert len(mlog.pending("orders")) == (2 if journal == "before-identities" else 0)
    assert {r["i"] for r in open_records(tmp_path / "log") if "i" in r} == {chosen[0]}


SERVE = "import sys; from coordinator.cli import main; sys.exit(main())"


def serve(*args: str, crash_at: str = "") -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "TWOPC_CRASH_AT"}
    env["TWOPC_SECRET"] = SECRET_TEXT
    if crash_at:
        env["TWOPC_CRASH_AT"] = crash_at
    return subprocess.Popen(
        [sys.executable, "-c", SERVE, "serve", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip


@contextlib.contextmanager
def remote_receiver(port: int) -> Iterator[Callable[..., list[bytes]]]:
    """``receive(queue, n, timeout=30)``: receive and commit from the cursor server at ``port``
    until ``n`` messages came or the time is up."""
    cursor = RemoteCursor(("127.0.0.1", port), SECRET)
    tm = TransactionManager("consumer", MemoryDecisionLog(), [cursor],
                            recovery_interval=None, reaper_interval=None)  # fmt: skip

    def receive(queue: str, n: int, timeout: float = 30.0) -> list[bytes]:
        got: list[bytes] = []
        deadline = time.monotonic() + timeout
        while len(got) < n and time.monotonic() < deadline:
            with tm.transaction() as tx:
                got += [d.body for d in tx.join(cursor).receive_many(queue, 50, timeout=0.5)]
        return got

    try:
        yield receive
    finally:
        tm.close()
        cursor.close()


@pytest.mark.parametrize("point", ["xfer.cursor.after_persist:1", "xfer.cursor.after_announce:1"])
def test_a_kill_9_of_the_cursor_while_a_log_claims_its_old_state(
    tmp_path: Path, point: str
) -> None:
    """``compatible_replay`` under ``kill -9``: the cursor server dies at the log's first
    announcement, or right after the batch whose ``M`` records claim the bare stream's state;
    restarted, it replays the claim (or the bare state) the same way, and the old journals' five
    messages are there once each, none of the three it had twice."""
    epoch = 1_700_000_000_000
    messages = old_journals(tmp_path, epoch, accepted=3, total=5)
    port = free_port()
    cursor_args = ("cursor", "--dir", str(tmp_path / "cursor"), "--listen", f"127.0.0.1:{port}")
    dying = serve(*cursor_args, crash_at=point)
    log = serve("log", "--dir", str(tmp_path / "log"), "--listen", "127.0.0.1:0",
                "--cursor", f"127.0.0.1:{port}")  # fmt: skip
    try:
        assert dying.wait(30) == -9, dying.communicate()[0]
        cursor = serve(*cursor_args)
        try:
            assert cursor.stdout is not None
            assert cursor.stdout.readline().startswith("listening on")
            with remote_receiver(port) as receive:
                assert receive("orders", 5) == [m.body for m in messages]
                assert receive("orders", 1, timeout=2) == []
        finally:
            cursor.send_signal(signal.SIGTERM)
            assert cursor.wait(30) == 0
    finally:
        log.send_signal(signal.SIGTERM)
        log.wait(30)
    with Cursor(tmp_path / "cursor") as reopened:
        streams = reopened.filter_state()["streams"]
        assert list(streams.values()) == [{"epoch": epoch, "last": 5}] and "orders" not in streams
