"""One validation for every way a message enters (`check_message`): a transfer frame a log could
not have written is refused with ``NACK invalid-message`` by a real cursor server, nothing is
written, the stream's filter does not move, no traceback is logged, and the cursor reopens on its
journal with every accepted message. The local and remote producers refuse the same messages."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from coordinator import LogWriteError, MemoryDecisionLog, TransactionManager, Xid
from messaging.auth import SharedSecret
from messaging.connection import Connection, Listener, connect
from messaging.frames import (
    PACKED_VERSION,
    Ack,
    ErrorFrame,
    FrameType,
    Msg,
    Nack,
    Origin,
    Ping,
    Value,
    XaReply,
    XaRequest,
)
from messaging.remote import PRODUCER_ROLE
from messaging.remote._packed import pack
from messaging.remote.protocol import message_from_value, message_to_value
from messaging.server import CursorServer, LogServer
from messaging.transfer import TRANSFER_ROLE, LogTransfer
from resource_managers.cursor import Cursor
from resource_managers.message_log import (
    InvalidMessageError,
    Message,
    MessageLog,
    MessageLogResource,
)
from resource_managers.message_log._records import encode, message_obj
from resource_managers.message_log._refused import read_refused
from resource_managers.sequencing import DoublingBackoff, Frame

SECRET = SharedSecret(b"validation test secret, 32 bytes")

#: (name, destination, headers): messages no producer can send
REFUSED = [
    ("priority-not-a-number", "q", {"twopc-priority": "x"}),
    ("priority-out-of-range", "q", {"twopc-priority": "99"}),
    ("transactional-not-0-or-1", "q", {"twopc-transactional": "2"}),
    ("admin-queue-a-dlq", "q", {"twopc-admin-queue": "x.DLQ"}),
    ("65-headers", "q", {f"h{i}": "v" for i in range(65)}),
    ("empty-header-name", "q", {"": "v"}),
    ("destination-a-dlq", "q.DLQ", {}),
    ("destination-a-subscription-queue", "topic:prices/alice", {}),
]


@pytest.mark.parametrize(("name", "destination", "headers"), REFUSED, ids=[c[0] for c in REFUSED])
def test_a_transfer_frame_no_log_could_write_is_refused_and_the_cursor_restarts(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    name: str,
    destination: str,
    headers: dict[str, str],
) -> None:
    caplog.set_level(logging.INFO)
    with CursorServer(tmp_path / "c", SECRET, listen=("127.0.0.1", 0)) as server:
        with connect(server.address, SECRET, "log", TRANSFER_ROLE, timeout=5) as conn:
            conn.send(Origin("log-1", 1))  # version 2: which log this is, first
            conn.send(Msg("ok", 7, 1, 0, "a", "ok", b"before"))
            assert conn.recv(timeout=5) == Ack("ok", 7, 1)
            conn.send(Msg(destination, 7, 1, 0, "m", destination, b"p", headers))
            nack = conn.recv(timeout=5)
            assert isinstance(nack, Nack), nack
            assert (nack.stream, nack.epoch, nack.seq, nack.reason) == (
                destination, 7, 1, "invalid-message"
            )  # fmt: skip
            conn.send(Msg("ok", 7, 2, 1, "b", "ok", b"after"))  # the connection goes on
            assert conn.recv(timeout=5) == Ack("ok", 7, 2)
        # a refused number does not move the filter: the same number is still to come
        assert server.cursor.ack_for(destination, "log-1").seq == 0
        assert server.internal_errors == 0
        assert server.receiver.stats["refused"] == 1
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    with Cursor(tmp_path / "c") as cursor:  # the journal replays: nothing of it was written
        assert cursor.ack_for(destination, "log-1").seq == 0
        got = cursor.take_many("g", "ok", 10)
        assert [d.body for d in got] == [b"before", b"after"]


@pytest.mark.parametrize(("name", "destination", "headers"), REFUSED, ids=[c[0] for c in REFUSED])
def test_the_cursor_judges_a_whole_batch_before_writing_any_of_it(
    tmp_path: Path, name: str, destination: str, headers: dict[str, str]
) -> None:
    bad = Message("m", destination, b"p", headers)
    good = Message("g1", "ok", b"fine")
    with Cursor(tmp_path / "c") as cursor:
        before = cursor.stats().forced_records
        with pytest.raises(InvalidMessageError):
            cursor.deliver_many(
                [(Frame("ok", 1, 1, 0, "g1"), good), (Frame(bad.stream, 1, 1, 0, "m"), bad)]
            )
        assert cursor.stats().forced_records == before  # the good one was not written either
        assert cursor.ack_for("ok").seq == 0
    with Cursor(tmp_path / "c") as cursor:
        assert cursor.take_many("g", "ok", 10) == []


@pytest.mark.parametrize(("name", "destination", "headers"), REFUSED, ids=[c[0] for c in REFUSED])
def test_local_and_remote_producers_refuse_the_same_messages(
    tmp_path: Path, name: str, destination: str, headers: dict[str, str]
) -> None:
    with MessageLog(tmp_path / "log") as mlog:
        resource = MessageLogResource(mlog, "mlog")
        tm = TransactionManager("v", MemoryDecisionLog(), [resource])
        with pytest.raises(InvalidMessageError), tm.transaction() as tx:
            tx.join(resource).send(destination, b"p", headers=headers)
        value = message_to_value(Message("m", destination, b"p", headers))
        with pytest.raises(InvalidMessageError):
            message_from_value(value)
        with pytest.raises(InvalidMessageError):  # nor can a caller hand the store one
            mlog.prepare("gid", [Message("m", destination, b"p", headers)])
        assert mlog.stats().forced_records == 1  # the open record alone


def test_a_message_the_cursor_refuses_is_kept_aside_and_the_stream_moves_past_it(
    tmp_path: Path,
) -> None:
    """A log holding a message the cursor refuses (written by an older version without today's
    checks: here straight into its journal): the transfer keeps it in ``refused/``, takes it out
    of the stream, and the next message is accepted; nothing loops, nothing else is lost."""
    bad = Message("bad", "q", b"p", {"twopc-priority": "x"})
    with MessageLog(tmp_path / "log") as mlog:
        mlog._journal.append(
            encode({"k": "1", "g": "g0", "m": [message_obj(bad)], "s": [["q", 1]]})
        )
    with (
        MessageLog(tmp_path / "log") as mlog,
        CursorServer(tmp_path / "c", SECRET, listen=("127.0.0.1", 0)) as server,
    ):
        mlog.commit("g1", [Message("good", "q", b"fine")])
        dial = lambda: connect(server.address, SECRET, "log", TRANSFER_ROLE, timeout=2)  # noqa: E731
        with LogTransfer(mlog, dial, resend=DoublingBackoff(base=0.1, cap=0.5)) as transfer:
            assert transfer.wait_idle(10)
            assert transfer.stats["refused"] == 1
        assert [d.body for d in server.cursor.take_many("g", "q", 10)] == [b"fine"]
        assert mlog.pending("q") == []
    kept = list((tmp_path / "log" / "refused").rglob("*.json"))
    assert len(kept) == 1
    reason, seq, message = read_refused(kept[0])
    assert (seq, message) == (1, bad) and "priority" in reason
    with MessageLog(tmp_path / "log") as mlog:  # the drop is durable: not sent again
        assert mlog.pending("q") == []


def test_a_handler_error_reaches_the_peer_as_its_code_and_only_a_defect_is_internal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def failing(error: Exception) -> Callable[[Connection], None]:
        def handler(conn: Connection) -> None:
            conn.recv(timeout=5)
            raise error

        return handler

    cases = {
        "log-write": LogWriteError("disk full", durable=False),
        "internal-error": KeyError("a defect"),
    }
    for code, error in cases.items():
        caplog.clear()
        with Listener(("127.0.0.1", 0), SECRET, "s", {"r": failing(error)}) as listener:
            with connect(listener.address, SECRET, "c", "r", timeout=5) as conn:
                conn.send(Ping(1))
                got = conn.recv(timeout=5)
            assert isinstance(got, ErrorFrame) and got.code == code
            traced = [r for r in caplog.records if r.exc_info]
            if code == "internal-error":
                assert listener.stats["internal_errors"] == 1 and len(traced) == 1
            else:
                assert listener.stats["internal_errors"] == 0 and not traced
                assert listener.stats[f"error_{code}"] == 1


@pytest.mark.parametrize("packed", [False, True], ids=["maps", "packed"])
def test_a_remote_producer_server_refuses_the_same_messages_and_writes_nothing(
    tmp_path: Path, packed: bool
) -> None:
    """Whether the messages come as a list of maps or packed (protocol version 4), the same
    rules refuse them, after a good message of the same request, and nothing is written."""
    nowhere = ("127.0.0.1", 1)  # its transfer retries in the background; irrelevant here
    good = Message("g", "ok", b"fine")
    with LogServer(tmp_path / "log", SECRET, cursor=nowhere, listen=("127.0.0.1", 0)) as server:
        assert server.address is not None
        with connect(server.address, SECRET, "app", PRODUCER_ROLE, timeout=5) as conn:
            assert conn.version == PACKED_VERSION
            for n, (_, destination, headers) in enumerate(REFUSED, 1):
                xid = Xid.branch_of(f"node:v-{n}", "mlog")
                run = [good, Message("m", destination, b"p", headers)]
                value: Value = pack(run) if packed else [message_to_value(m) for m in run]
                conn.send(
                    XaRequest(FrameType.XA_PREPARE, n, xid, {"rm": "mlog", "messages": value})
                )
                reply = conn.recv(timeout=5)
                assert isinstance(reply, XaReply) and reply.status == "mlog-invalid-message", reply
        stats = server.mlog.stats()
        assert (stats.prepared, stats.pending, server.internal_errors) == (0, 0, 0)
    with MessageLog(tmp_path / "log") as mlog:
        assert mlog.prepared_gids() == []
