"""The transfer protocol between a real message log and a real cursor over real TCP sockets:
in-order exactly-once delivery, compaction on acknowledgment, resend after the cursor comes back,
duplicates and gaps dropped and re-acknowledged, stray acknowledgments counted and ignored,
expired messages relinked past, and every kind of bad input refused by closing one connection.
"""

from __future__ import annotations

import errno
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coordinator import MemoryDecisionLog, ProgrammingError, TransactionManager
from coordinator.errors import LogWriteError
from messaging.auth import SharedSecret, client_handshake
from messaging.connection import Connection, Listener, connect
from messaging.frames import (
    HEADER,
    MAGIC,
    Ack,
    ErrorFrame,
    FrameReader,
    Msg,
    Nack,
    Origin,
    Ping,
    encode,
)
from messaging.transfer import TRANSFER_ROLE, LogTransfer, TransferReceiver
from resource_managers.cursor import Cursor
from resource_managers.message_log import MessageLog, MessageLogResource
from resource_managers.sequencing import DoublingBackoff, Verdict
from tests.support.faulty_ops import FaultyOps

SECRET = SharedSecret(b"transfer test secret, 32 bytes!!")


@pytest.fixture
def mlog(tmp_path: Path) -> Iterator[MessageLog]:
    with MessageLog(tmp_path / "log") as log:
        yield log


@pytest.fixture
def cursor(tmp_path: Path) -> Iterator[Cursor]:
    with Cursor(tmp_path / "cursor") as c:
        yield c


@pytest.fixture
def listener(cursor: Cursor) -> Iterator[Listener]:
    with Listener(
        ("127.0.0.1", 0), SECRET, "cursor", {TRANSFER_ROLE: TransferReceiver(cursor)}
    ) as lst:
        yield lst


def dialer(address: tuple[str, int]) -> Callable[[], Connection]:
    return lambda: connect(address, SECRET, "log", TRANSFER_ROLE, timeout=2.0)


#: what a log of protocol version 2 sends first on a transfer (a made-up identity)
ORIGIN = Origin("test-log", 1)


def fast() -> DoublingBackoff:
    return DoublingBackoff(base=0.1, cap=0.5)


def produce(mlog: MessageLog, batches: list[list[tuple[str, bytes]]], **send: object) -> None:
    resource = MessageLogResource(mlog)
    tm = TransactionManager(
        "producer", MemoryDecisionLog(), [resource], recovery_interval=None, reaper_interval=None
    )
    try:
        for batch in batches:
            with tm.transaction() as tx:
                branch = tx.join(resource)
                for destination, body in batch:
                    branch.send(destination, body, **send)  # type: ignore[arg-type]
    finally:
        tm.close()


def bodies(cursor: Cursor, queue: str) -> list[bytes]:
    return [d.body for d in cursor.available(queue)]


def wait(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_messages_arrive_once_in_order_and_the_log_compacts(
    mlog: MessageLog, cursor: Cursor, listener: Listener
) -> None:
    batches = [[(f"d{i % 3}", f"{i}-{j}".encode()) for j in range(5)] for i in range(60)]
    with LogTransfer(mlog, dialer(listener.address), resend=fast()) as xfer:
        produce(mlog, batches)
        assert xfer.wait_idle(10)
    for d in range(3):
        expected = [body for i, b in enumerate(batches) if i % 3 == d for _, body in b]
        assert bodies(cursor, f"d{d}") == expected
    assert mlog.stats().pending == 0
    assert xfer.stats["acknowledged"] == 300
    assert cursor.filter_state()["streams"][f"{mlog.identity}|d0"]["last"] == 100  # its own
    assert cursor.ack_for("d0", mlog.identity).seq == 100 and cursor.ack_for("d0").seq == 0


def test_a_log_that_refuses_writes_keeps_its_transfer_alive_and_its_messages(
    tmp_path: Path, cursor: Cursor, listener: Listener
) -> None:
    """A failed write poisons the log: the cursor's acknowledgment cannot be recorded. The
    transfer says so and backs off instead of dying; the message reaches the cursor once and
    stays in the log (it is acknowledged after a restart)."""
    ops = FaultyOps()
    with MessageLog(tmp_path / "log", file_ops=ops, lazy_delay=60.0) as mlog:
        produce(mlog, [[("orders", b"m1")]])
        mlog.rollback("an-unprepared-gid")  # a lazy record, applied in memory
        ops.write_errno = errno.ENOSPC
        with pytest.raises(LogWriteError):
            mlog._journal.flush()
        assert mlog.stats().refusing_writes
        with LogTransfer(mlog, dialer(listener.address), resend=fast()) as xfer:
            wait(lambda: xfer.stats["log_errors"] >= 1)
            time.sleep(0.5)
            assert all(thread.is_alive() for thread in xfer._threads)
            assert xfer.stats["connections"] <= 3  # backing off, not reconnecting at once
        assert bodies(cursor, "orders") == [b"m1"] and mlog.stats().pending == 1


def test_a_cursor_that_refuses_writes_is_not_stormed_with_reconnections(
    tmp_path: Path, mlog: MessageLog
) -> None:
    """The cursor's journal is poisoned: it answers every batch with an error and closes. The
    transfer backs off between attempts (each would meet the same refusal)."""
    ops = FaultyOps()
    with Cursor(tmp_path / "refusing", file_ops=ops, lazy_delay=60.0) as refusing:
        ops.write_errno = errno.ENOSPC
        refusing.rollback("an-unprepared-gid")  # a lazy record, applied in memory
        with pytest.raises(LogWriteError):
            refusing._journal.flush()
        handlers = {TRANSFER_ROLE: TransferReceiver(refusing)}
        with Listener(("127.0.0.1", 0), SECRET, "cursor", handlers) as lst:
            produce(mlog, [[("orders", b"m1")]])
            with LogTransfer(mlog, dialer(lst.address), resend=fast()) as xfer:
                wait(lambda: xfer.stats["closed_by_cursor"] >= 2)
                time.sleep(1.0)
                assert xfer.stats["connections"] <= 6  # without the back-off: hundreds
        assert mlog.stats().pending == 1


def test_the_log_resends_until_the_cursor_comes_back(tmp_path: Path, mlog: MessageLog) -> None:
    port = Listener(("127.0.0.1", 0), SECRET, "x", {}).address[1]  # a free port, now closed
    address = ("127.0.0.1", port)
    with LogTransfer(mlog, dialer(address), resend=fast()) as xfer:
        produce(mlog, [[("orders", b"a"), ("orders", b"b")], [("orders", b"c")]])
        time.sleep(0.3)
        assert xfer.stats["connect_failures"] >= 1 and mlog.stats().pending == 3
        with (
            Cursor(tmp_path / "cursor") as cursor,
            Listener(address, SECRET, "cursor", {TRANSFER_ROLE: TransferReceiver(cursor)}),
        ):
            assert xfer.wait_idle(10)
            assert bodies(cursor, "orders") == [b"a", b"b", b"c"]


def test_a_log_that_lost_its_acks_resends_and_the_cursor_drops_the_copies(
    tmp_path: Path, cursor: Cursor, listener: Listener
) -> None:
    """The log crashes before its lazy acknowledgment records reach disk: after the restart it
    sends everything again, and the cursor's filter re-acknowledges instead of accepting."""
    logdir = tmp_path / "log"
    mlog = MessageLog(logdir)
    produce(mlog, [[("orders", b"1"), ("orders", b"2")]])
    mlog.close()
    shutil.copytree(logdir, tmp_path / "before-acks")  # what a crash before the acks leaves
    mlog = MessageLog(logdir)
    with LogTransfer(mlog, dialer(listener.address), resend=fast()) as xfer:
        assert xfer.wait_idle(10)
    mlog.close()
    shutil.rmtree(logdir)
    shutil.copytree(tmp_path / "before-acks", logdir)
    with MessageLog(logdir) as fresh:
        assert [m.body for _, m in fresh.pending("orders")] == [b"1", b"2"]
        produce(fresh, [[("orders", b"3")]])
        with LogTransfer(fresh, dialer(listener.address), resend=fast()) as again:
            assert again.wait_idle(10)
        assert again.stats["ack_advanced"] >= 1
        assert again.stats["resends"] >= 2  # 1 and 2 were sent before the restart: resends
    assert bodies(cursor, "orders") == [b"1", b"2", b"3"]
    assert cursor.filter_counts()[Verdict.DUPLICATE.value] == 2


def test_duplicates_and_gaps_are_dropped_and_reacknowledged(
    cursor: Cursor, listener: Listener
) -> None:
    def msg(seq: int, prev: int, body: bytes) -> Msg:
        return Msg("q", 5, seq, prev, f"m{seq}", "q", body)

    with connect(listener.address, SECRET, "log", TRANSFER_ROLE) as conn:
        conn.send(ORIGIN)  # version 2: the log says who it is first
        acks = []
        for frame in (msg(1, 0, b"a"), msg(1, 0, b"a"), msg(3, 2, b"c"), msg(2, 1, b"b")):
            conn.send(frame)
            reply = conn.recv(timeout=5)
            assert isinstance(reply, Ack)
            acks.append(reply.seq)
        assert acks == [1, 1, 1, 2]  # accept, duplicate, gap, accept
        conn.send(msg(3, 2, b"c"))
        assert conn.recv(timeout=5) == Ack("q", 5, 3)
    assert bodies(cursor, "q") == [b"a", b"b", b"c"]


def test_stray_and_stale_acknowledgments_are_counted_and_ignored(mlog: MessageLog) -> None:
    """A cursor that answers nonsense before the truth: the log compacts only on the truth."""

    def liar(conn: Connection) -> None:
        frame = conn.recv(timeout=5)
        assert isinstance(frame, Origin) and frame.log == mlog.identity  # version 2: who sends
        frame = conn.recv(timeout=5)
        assert isinstance(frame, Msg)
        conn.send_many([
            Ack(frame.stream, frame.epoch + 1, frame.seq),  # another epoch
            Ack(frame.stream, frame.epoch, frame.seq + 50),  # beyond anything sent
            Ack("nobody", 1, 1),  # a stream the log does not have
        ])  # fmt: skip
        time.sleep(0.3)
        conn.send(Ack(frame.stream, frame.epoch, frame.seq))
        while conn.recv(timeout=5) is not None:
            pass

    produce(mlog, [[("orders", b"x")]])
    lst = Listener(("127.0.0.1", 0), SECRET, "liar", {TRANSFER_ROLE: liar})
    with lst, LogTransfer(mlog, dialer(lst.address), resend=DoublingBackoff(5, 5)) as xfer:
        wait(lambda: xfer.stats["ack_advanced"] == 1)
        assert xfer.stats["ack_wrong-epoch"] == 1
        assert xfer.stats["ack_beyond-sent"] == 1
        assert xfer.stats["stray_acks"] == 1
        assert mlog.stats().pending == 0


def test_an_expired_message_leaves_the_stream_and_the_next_is_linked_past_it(
    tmp_path: Path, mlog: MessageLog
) -> None:
    port = Listener(("127.0.0.1", 0), SECRET, "x", {}).address[1]
    address = ("127.0.0.1", port)
    produce(mlog, [[("orders", b"first")]])
    produce(mlog, [[("orders", b"short-lived")]], ttl=0.2)
    produce(mlog, [[("orders", b"last")]])
    with LogTransfer(mlog, dialer(address), resend=fast()) as xfer:
        time.sleep(0.5)  # the cursor is down while the second message expires
        with (
            Cursor(tmp_path / "cursor") as cursor,
            Listener(address, SECRET, "cursor", {TRANSFER_ROLE: TransferReceiver(cursor)}),
        ):
            assert xfer.wait_idle(10)
            assert bodies(cursor, "orders") == [b"first", b"last"]
        assert xfer.stats["expired"] == 1
    assert mlog.stats().pending == 0


# -- bad input --------------------------------------------------------------------------------


def raw(listener: Listener) -> socket.socket:
    sock = socket.create_connection(listener.address, timeout=5)
    return sock


def closed_after(sock: socket.socket) -> list[object]:
    """Frames the server sent before closing (a HELLO first, then maybe an ERROR)."""
    got: list[object] = []
    try:
        got.extend(FrameReader(sock))
    except (ConnectionResetError, Exception) as exc:
        got.append(exc)
    return got


def still_serves(listener: Listener, cursor: Cursor) -> None:
    with connect(listener.address, SECRET, "log", TRANSFER_ROLE) as conn:
        conn.send(ORIGIN)  # version 2: the log says who it is first
        conn.send(Ping(9))
        assert conn.recv(timeout=5) is not None


def test_garbage_an_oversized_header_and_a_wrong_version_close_only_that_connection(
    listener: Listener, cursor: Cursor
) -> None:
    cases = [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # not our protocol at all
        HEADER.pack(MAGIC, 1, 1, 0, 0xFFFFFFF0, 0),  # claims 4 GiB: refused before allocating
        HEADER.pack(MAGIC, 99, 1, 0, 0, 0),  # a protocol version we do not speak
    ]
    for data in cases:
        with raw(listener) as sock:
            sock.sendall(data)
            seen = closed_after(sock)
            assert seen, data
        still_serves(listener, cursor)
    assert listener.stats["refused_handshake"] == len(cases)


def test_a_message_before_authentication_is_refused(listener: Listener, cursor: Cursor) -> None:
    with raw(listener) as sock:
        sock.sendall(encode(Msg("q", 1, 1, 0, "m1", "q", b"sneaky")))
        seen = closed_after(sock)
        assert any(isinstance(f, ErrorFrame) for f in seen)
    assert bodies(cursor, "q") == []


def test_a_corrupted_frame_after_authentication_closes_the_connection_and_loses_nothing(
    listener: Listener, cursor: Cursor
) -> None:
    sock = socket.create_connection(listener.address, timeout=5)
    client_handshake(sock, SECRET, "log", TRANSFER_ROLE)
    damaged = bytearray(encode(Msg("q", 1, 1, 0, "m1", "q", b"payload")))
    damaged[-3] ^= 0x04  # one bit of the body: the CRC catches it
    sock.sendall(bytes(damaged))
    seen = closed_after(sock)
    assert any(isinstance(f, ErrorFrame) and f.code == "bad-frame" for f in seen)
    sock.close()
    assert bodies(cursor, "q") == []
    with connect(listener.address, SECRET, "log", TRANSFER_ROLE) as conn:
        conn.send(ORIGIN)  # version 2: the log says who it is first
        conn.send(Msg("q", 1, 1, 0, "m1", "q", b"payload"))
        assert conn.recv(timeout=5) == Ack("q", 1, 1)
    assert bodies(cursor, "q") == [b"payload"]
    assert listener.stats["bad_frames"] == 1


def test_a_message_no_log_could_write_is_refused_with_a_nack(
    listener: Listener, cursor: Cursor
) -> None:
    with connect(listener.address, SECRET, "log", TRANSFER_ROLE) as conn:
        conn.send(ORIGIN)  # version 2: the log says who it is first
        conn.send(Msg("#bad", 1, 1, 0, "m1", "#bad", b"x"))
        nack = conn.recv(timeout=5)
        assert isinstance(nack, Nack) and nack.reason == "invalid-message"
        conn.send(Msg("q", 1, 1, 0, "m2", "q", b"fine"))  # the connection goes on
        assert conn.recv(timeout=5) == Ack("q", 1, 1)


def test_a_wrong_secret_never_reaches_the_cursor(listener: Listener, cursor: Cursor) -> None:
    wrong = SharedSecret(b"not the secret, but 32 bytes long")
    with pytest.raises(Exception):  # noqa: B017 - AuthError or a reset, both are refusals
        connect(listener.address, wrong, "log", TRANSFER_ROLE, timeout=2)
    still_serves(listener, cursor)


def test_an_oversized_frame_is_refused_by_the_sender_before_any_byte_goes(
    listener: Listener,
) -> None:
    with connect(listener.address, SECRET, "log", TRANSFER_ROLE, max_frame=1024) as conn:
        conn.send(ORIGIN)  # version 2: the log says who it is first
        with pytest.raises(ProgrammingError, match=r"max|exceed|large"):
            conn.send(Msg("q", 1, 1, 0, "m1", "q", b"x" * 2048))
        conn.send(Ping(1))
        assert conn.recv(timeout=5) is not None


def test_an_authenticated_peer_claiming_a_huge_frame_is_cut_off_before_allocation(
    listener: Listener, cursor: Cursor
) -> None:
    sock = socket.create_connection(listener.address, timeout=5)
    client_handshake(sock, SECRET, "log", TRANSFER_ROLE)
    sock.sendall(HEADER.pack(MAGIC, 1, 16, 0, 64 * 1024 * 1024, 0))  # 64 MiB > 16 MiB limit
    seen = closed_after(sock)
    sock.close()
    assert any(isinstance(f, ErrorFrame) and f.code == "bad-frame" for f in seen)
    still_serves(listener, cursor)
