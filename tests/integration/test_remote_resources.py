"""Remote resources against real stores behind a real listener: a message log and a cursor in
"another process" (the same one, over TCP on 127.0.0.1), enlisted through `RemoteMessageLog` and
`RemoteCursor` in transactions that also write PostgreSQL. Commit and rollback, one phase,
batches, recovery of branches prepared by a client that went away, a connection killed in the
middle of a consumer's branch (no duplicate, no loss), refused peers, and malformed requests."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from coordinator import (
    CompletionPending,
    FileDecisionLog,
    IllegalStateError,
    OutcomeUnknownError,
    TransactionManager,
    TransactionRolledBack,
    TransientError,
    Vote,
    Xid,
)
from coordinator.decision_log import Decision
from messaging.auth import AuthError, SharedSecret
from messaging.connection import Connection, Listener, connect
from messaging.frames import FrameType, Value, XaReply, XaRequest
from messaging.remote import (
    CONSUMER_ROLE,
    PRODUCER_ROLE,
    BranchLost,
    ConsumerService,
    ProducerService,
    RemoteConsumerBranch,
    RemoteCursor,
    RemoteMessageLog,
    RemoteProducerBranch,
)
from messaging.remote._packed import pack
from messaging.remote.protocol import message_to_value
from resource_managers.cursor import Cursor, Delivery
from resource_managers.message_log import (
    DestinationFullError,
    InvalidMessageError,
    Message,
    MessageLog,
)
from resource_managers.postgres import PostgresResource
from resource_managers.sequencing import Frame
from tests.support.managers import make_manager
from tests.support.no_voter import NoVoter
from tests.support.pg import ledger_engine, move, prepared_gids, transfer_ids
from tests.support.scripts import run_script

SECRET_TEXT = "remote-resources-test-secret-0123"
SECRET = SharedSecret(SECRET_TEXT.encode())


@pytest.fixture
def engine(make_pg_database: Callable[[], str]) -> Iterator[sa.Engine]:
    engine = ledger_engine(make_pg_database())
    yield engine
    engine.dispose()


@pytest.fixture
def mlog(tmp_path: Path) -> Iterator[MessageLog]:
    log = MessageLog(tmp_path / "mlog")
    yield log
    log.close()


@pytest.fixture
def cursor(tmp_path: Path) -> Iterator[Cursor]:
    c = Cursor(tmp_path / "cursor")
    yield c
    c.close()


def serve(role: str, handler: Callable[[Connection], None]) -> Listener:
    return Listener(("127.0.0.1", 0), SECRET, f"test-{role}", {role: handler}).start()


@pytest.fixture
def log_server(mlog: MessageLog) -> Iterator[Listener]:
    with serve(PRODUCER_ROLE, ProducerService(mlog)) as listener:
        yield listener


@pytest.fixture
def cursor_server(cursor: Cursor) -> Iterator[Listener]:
    listener = serve(CONSUMER_ROLE, ConsumerService(cursor, max_deliveries=5))
    yield listener
    listener.close()


@pytest.fixture
def remote_log(log_server: Listener) -> Iterator[RemoteMessageLog]:
    with RemoteMessageLog(log_server.address, SECRET, timeout=5.0) as remote:
        yield remote


@pytest.fixture
def remote_cursor(cursor_server: Listener) -> Iterator[RemoteCursor]:
    with RemoteCursor(cursor_server.address, SECRET, timeout=5.0) as remote:
        yield remote


def bodies(log: MessageLog, stream: str = "orders") -> list[bytes]:
    return [m.body for _, m in log.pending(stream)]


def feed(c: Cursor, *payloads: bytes, stream: str = "orders") -> list[Message]:
    """Accept ``payloads`` into the cursor as the next messages of ``stream``."""
    ack = c.ack_for(stream)
    last, epoch = (ack.seq, ack.epoch) if ack.epoch else (0, 7)
    out = []
    for body in payloads:
        m = Message(uuid.uuid4().hex, stream, body, {"h": body.decode()})
        c.deliver(Frame(stream, epoch, last + 1, last, m.message_id), m)
        last += 1
        out.append(m)
    return out


def available(c: Cursor, queue: str = "orders") -> list[tuple[bytes, int]]:
    return [(d.body, d.delivery_count) for d in c.available(queue)]


# -- the producer ------------------------------------------------------------------------------


def test_send_commits_with_postgres(
    engine: sa.Engine,
    mlog: MessageLog,
    remote_log: RemoteMessageLog,
    managers: list[TransactionManager],
) -> None:
    db = PostgresResource(engine, "db")
    tm = make_manager(managers, [db, remote_log])
    ids = []
    for tid in ("t1", "t2"):
        with tm.transaction() as tx:
            move(tx.join(db), tid, 1, 10)
            branch: RemoteProducerBranch = tx.join(remote_log)
            ids.append(branch.send("orders", tid.encode(), headers={"tid": tid}))
            branch.send("audit", b"x", persistent=False, ttl=60)
    remote_log.flush_commits()  # phase two's commits are answered off the caller's thread
    assert bodies(mlog) == [b"t1", b"t2"]
    assert [m.message_id for _, m in mlog.pending("orders")] == ids
    assert mlog.pending("orders")[1][1].headers == {"tid": "t2"}
    assert [m.persistent for _, m in mlog.pending("audit#np")] == [False, False]
    assert mlog.pending("audit#np")[0][1].expires_at is not None
    assert transfer_ids(engine) == {"t1", "t2"}
    assert prepared_gids(engine) == [] and mlog.prepared_gids() == []


def test_send_rolls_back_with_postgres(
    engine: sa.Engine,
    mlog: MessageLog,
    remote_log: RemoteMessageLog,
    managers: list[TransactionManager],
) -> None:
    db = PostgresResource(engine, "db")
    no = NoVoter(TransientError("no"))
    tm = make_manager(managers, [db, remote_log, no])
    with pytest.raises(RuntimeError), tm.transaction() as tx:  # before prepare: never shipped
        move(tx.join(db), "t1", 1, 10)
        tx.join(remote_log).send("orders", b"never")
        raise RuntimeError("the application changed its mind")
    with pytest.raises(TransactionRolledBack), tm.transaction() as tx:  # prepared, then no
        move(tx.join(db), "t2", 1, 10)
        tx.join(remote_log).send("orders", b"prepared then rolled back")
        tx.join(no)
        gid = Xid.branch_of(tx.gtrid, remote_log.name).to_gid()
    assert mlog.is_tombstoned(gid)  # the server rolled the prepared branch back
    assert bodies(mlog) == [] and mlog.prepared_gids() == []
    assert transfer_ids(engine) == set() and prepared_gids(engine) == []


def test_one_phase_and_local_validation(
    mlog: MessageLog, remote_log: RemoteMessageLog, managers: list[TransactionManager]
) -> None:
    tm = make_manager(managers, [remote_log])
    with tm.transaction() as tx:
        branch: RemoteProducerBranch = tx.join(remote_log)
        branch.send("orders", b"a")
        branch.send("orders", b"b")
        with pytest.raises(InvalidMessageError):
            branch.send("bad destination!", b"c")
        with pytest.raises(InvalidMessageError):
            branch.send("orders", b"x" * (remote_log.max_message_bytes + 1))
    assert tm.metrics_dict()["one_phase"] == 1
    assert bodies(mlog) == [b"a", b"b"] and mlog.prepared_gids() == []
    with tm.transaction() as tx:  # nothing sent: no round trip, nothing at the server
        tx.join(remote_log)
    with pytest.raises(TransactionRolledBack), tm.transaction() as tx:
        branch = tx.join(remote_log)
        branch.send("orders", b"rolled back before it was shipped")
        tx.set_rollback_only()
    with pytest.raises(IllegalStateError):
        branch.send("orders", b"after the end")


def test_a_full_destination_is_refused_at_prepare_as_transient(
    tmp_path: Path, managers: list[TransactionManager]
) -> None:
    with (
        MessageLog(tmp_path / "small", max_destination_messages=2) as log,
        serve(PRODUCER_ROLE, ProducerService(log)) as listener,
        RemoteMessageLog(listener.address, SECRET, timeout=5.0) as remote,
    ):
        tm = make_manager(managers, [remote])
        with pytest.raises(TransactionRolledBack) as caught, tm.transaction() as tx:
            branch = tx.join(remote)
            for body in (b"1", b"2", b"3"):
                branch.send("orders", body)
        assert isinstance(caught.value.__cause__, DestinationFullError)
        assert bodies(log) == [] and log.prepared_gids() == []
        assert tm.run(lambda tx: tx.join(remote).send("orders", b"fits")) is not None
        assert bodies(log) == [b"fits"]


@pytest.mark.parametrize("version", [4, 3], ids=["packed", "maps"])
def test_a_branch_too_large_for_one_frame_goes_in_shares(  # noqa: PLR0917 - fixtures
    engine: sa.Engine,
    mlog: MessageLog,
    remote_log: RemoteMessageLog,
    managers: list[TransactionManager],
    monkeypatch: pytest.MonkeyPatch,
    version: int,
) -> None:
    """40,000 messages of 400 bytes: over 16 MiB in one prepare, which the frame limit refuses.
    They go in shares on one connection, then prepare and commit in order with PostgreSQL; a
    one-phase commit of a large branch likewise. Packed (protocol version 4) or, from a client
    that speaks version 3, as lists of maps."""
    monkeypatch.setattr("messaging.auth.SUPPORTED_VERSIONS", frozenset(range(1, version + 1)))
    db = PostgresResource(engine, "db")
    tm = make_manager(managers, [db, remote_log])
    payloads = [b"%06d" % i + b"x" * 394 for i in range(40_000)]
    with tm.transaction() as tx:
        move(tx.join(db), "t1", 1, 10)
        branch: RemoteProducerBranch = tx.join(remote_log)
        for body in payloads:
            branch.send("orders", body)
    remote_log.flush_commits()
    assert bodies(mlog) == payloads
    assert transfer_ids(engine) == {"t1"} and mlog.prepared_gids() == []
    one_phase = make_manager(managers, [remote_log], node_id="node-2")
    with one_phase.transaction() as tx:
        branch = tx.join(remote_log)
        for body in payloads[:20_000]:
            branch.send("audit", body)
    assert bodies(mlog, "audit") == payloads[:20_000]
    conn = remote_log._pool.acquire()
    assert conn.version == version  # the form the messages travelled in
    remote_log._pool.release(conn)


def test_a_connection_broken_between_shares_rolls_the_shares_back(
    engine: sa.Engine,
    mlog: MessageLog,
    managers: list[TransactionManager],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server has a share staged when the connection ends: it rolls the share back, the
    prepare votes no, and nothing of the branch is left anywhere; the next branch goes through."""
    from messaging.remote import _remote_log

    monkeypatch.setattr(_remote_log, "SHARE_BYTES", 4_000)  # a share is about ten messages
    listener = serve(PRODUCER_ROLE, ProducerService(mlog))
    remote = RemoteMessageLog(listener.address, SECRET, timeout=5.0)
    shares: list[str] = []

    def break_after_first(name: str) -> None:
        if name == "remote.mlog.after_share" and not shares:
            shares.append(name)
            listener.close()  # every server-side connection ends, as when the client dies

    monkeypatch.setattr(_remote_log, "crash_point", break_after_first)
    db = PostgresResource(engine, "db")
    tm = make_manager(managers, [db, remote])
    with pytest.raises(TransactionRolledBack), tm.transaction() as tx:
        move(tx.join(db), "t1", 1, 10)
        branch = tx.join(remote)
        for i in range(100):
            branch.send("orders", b"%03d" % i + b"y" * 200)
    assert shares and bodies(mlog) == [] and mlog.prepared_gids() == []
    assert transfer_ids(engine) == set() and prepared_gids(engine) == []
    remote.close()
    with serve(PRODUCER_ROLE, ProducerService(mlog)) as again:
        remote = RemoteMessageLog(again.address, SECRET, timeout=5.0)
        tm2 = make_manager(managers, [remote], node_id="node-2")
        with tm2.transaction() as tx:
            branch = tx.join(remote)
            for i in range(100):
                branch.send("orders", b"%03d" % i)
        remote.close()
    assert bodies(mlog) == [b"%03d" % i for i in range(100)]


CLIENT_KILLED_BETWEEN_SHARES = """
import sys
from coordinator import Xid
from messaging.auth import SharedSecret
from messaging.remote import RemoteMessageLog, _remote_log

_remote_log.SHARE_BYTES = 4_000  # about ten messages a share
host, port = sys.argv[1], int(sys.argv[2])
remote = RemoteMessageLog((host, port), SharedSecret(sys.argv[3].encode()), timeout=5.0)
xid = Xid.branch_of("node-9:killed-1", remote.name)
branch = remote.start(xid)
for i in range(100):
    branch.send("orders", b"%03d" % i + b"k" * 200)
remote.prepare(xid)  # killed at the second share: never returns
"""


def test_a_client_killed_between_shares_leaves_nothing_at_the_server(
    tmp_path: Path, mlog: MessageLog, log_server: Listener, remote_log: RemoteMessageLog
) -> None:
    """kill -9 of the client after its second share: the server sees the connection end and
    rolls the staged shares back; nothing is prepared or visible, and the log serves on."""
    script = tmp_path / "client.py"
    script.write_text(CLIENT_KILLED_BETWEEN_SHARES)
    host, port = log_server.address
    done = run_script(script, [host, str(port), SECRET_TEXT],
                      crash_at="remote.mlog.after_share:2")  # fmt: skip
    assert done.returncode == -9, done.stderr
    assert "crash point remote.mlog.after_share reached" in done.stderr
    assert bodies(mlog) == [] and mlog.prepared_gids() == []
    xid = Xid.branch_of("node-9:after-1", remote_log.name)
    remote_log.start(xid).send("orders", b"after")
    assert remote_log.prepare(xid) == Vote.COMMIT
    assert remote_log.commit(xid) is None
    remote_log.flush_commits()
    assert bodies(mlog) == [b"after"]


# -- the consumer ------------------------------------------------------------------------------


def test_receive_commit_deletes_and_rollback_redelivers(
    engine: sa.Engine,
    cursor: Cursor,
    remote_cursor: RemoteCursor,
    managers: list[TransactionManager],
) -> None:
    db = PostgresResource(engine, "db")
    tm = make_manager(managers, [db, remote_cursor])
    feed(cursor, b"m1", b"m2")
    with pytest.raises(RuntimeError), tm.transaction() as tx:
        got = tx.join(remote_cursor).receive("orders")
        assert got is not None and got.body == b"m1" and got.delivery_count == 1
        move(tx.join(db), "m1", 1, 10)
        raise RuntimeError("handler failed")
    assert available(cursor) == [(b"m1", 1), (b"m2", 0)]
    with tm.transaction() as tx:
        branch: RemoteConsumerBranch = tx.join(remote_cursor)
        again = branch.receive("orders")
        assert again is not None and again.body == b"m1"
        assert again.delivery_count == 2 and again.redelivered
        assert again.headers == {"h": "m1"} and again.queue == "orders"
        move(tx.join(db), "m1", 1, 10)
    assert available(cursor) == [(b"m2", 0)]
    assert transfer_ids(engine) == {"m1"}
    assert cursor.prepared_gids() == [] and prepared_gids(engine) == []


def test_receive_many_and_one_phase(
    cursor: Cursor, remote_cursor: RemoteCursor, managers: list[TransactionManager]
) -> None:
    tm = make_manager(managers, [remote_cursor])
    feed(cursor, *(b"m%d" % i for i in range(5)))
    with tm.transaction() as tx:
        branch: RemoteConsumerBranch = tx.join(remote_cursor)
        first = branch.receive_many("orders", 3)
        rest = branch.receive_many("orders", 10)
        assert branch.receive_many("orders", 10, timeout=0.05) == []
        assert branch.receive("other") is None
    assert [d.body for d in first + rest] == [b"m0", b"m1", b"m2", b"m3", b"m4"]
    assert tm.metrics_dict()["one_phase"] == 1
    assert available(cursor) == [] and cursor.stats().in_flight == 0
    with tm.transaction() as tx:  # received nothing: read-only, the server's branch ended
        assert tx.join(remote_cursor).receive("orders") is None
    assert cursor.stats().in_flight == 0


def test_a_receive_waits_for_a_message(
    cursor: Cursor, remote_cursor: RemoteCursor, managers: list[TransactionManager]
) -> None:
    tm = make_manager(managers, [remote_cursor])
    timer = threading.Timer(0.2, feed, (cursor, b"late"))
    timer.start()
    try:
        with tm.transaction() as tx:
            got: Delivery | None = tx.join(remote_cursor).receive("orders", timeout=5.0)
    finally:
        timer.join()
    assert got is not None and got.body == b"late"
    assert available(cursor) == []


# -- recovery ----------------------------------------------------------------------------------


def test_recovery_finishes_branches_of_a_client_that_went_away(  # noqa: PLR0917
    tmp_path: Path,
    mlog: MessageLog,
    cursor: Cursor,
    log_server: Listener,
    cursor_server: Listener,
    managers: list[TransactionManager],
) -> None:
    feed(cursor, b"c1", b"c2")
    first_log = RemoteMessageLog(log_server.address, SECRET, timeout=5.0)
    first_cursor = RemoteCursor(cursor_server.address, SECRET, timeout=5.0)
    for gtrid in ("node-1:old-1", "node-1:old-2"):
        xid = Xid.branch_of(gtrid, first_log.name)
        first_log.start(xid).send("orders", gtrid.encode())
        assert first_log.prepare(xid) == Vote.COMMIT
        cxid = Xid.branch_of(gtrid, first_cursor.name)
        assert first_cursor.start(cxid).receive("orders") is not None
        assert first_cursor.prepare(cxid) == Vote.COMMIT
    first_log.close()
    first_cursor.close()  # the connection ends: prepared branches are not the connection's
    assert cursor.stats().prepared == 2 and available(cursor) == []
    with FileDecisionLog(tmp_path / "dlog") as dlog:
        dlog.log_commit(Decision("node-1:old-1", ("cursor", "mlog")))
    remote_log = RemoteMessageLog(log_server.address, SECRET, timeout=5.0)
    remote_cursor = RemoteCursor(cursor_server.address, SECRET, timeout=5.0)
    assert len(remote_log.recover()) == 2 and len(remote_cursor.recover()) == 2
    make_manager(managers, [remote_log, remote_cursor], FileDecisionLog(tmp_path / "dlog"))
    assert bodies(mlog) == [b"node-1:old-1"]  # decided: committed; the orphan rolled back
    assert mlog.prepared_gids() == [] and cursor.prepared_gids() == []
    assert available(cursor) == [(b"c2", 1)]  # the orphan's message is back, c1 consumed
    assert remote_log.recover() == [] and remote_cursor.recover() == []
    remote_log.close()
    remote_cursor.close()


# -- broken connections ------------------------------------------------------------------------


def test_a_connection_killed_mid_branch_loses_the_branch_not_the_message(
    engine: sa.Engine, cursor: Cursor, managers: list[TransactionManager]
) -> None:
    db = PostgresResource(engine, "db")
    feed(cursor, b"m1")
    listener = serve(CONSUMER_ROLE, ConsumerService(cursor))
    remote = RemoteCursor(listener.address, SECRET, timeout=5.0)
    tm = make_manager(managers, [db, remote])
    with pytest.raises(TransactionRolledBack) as caught, tm.transaction() as tx:
        got = tx.join(remote).receive("orders")
        assert got is not None and available(cursor) == []
        move(tx.join(db), "m1", 1, 10)
        listener.close()  # every server-side connection ends: the branch is rolled back
        assert available(cursor) == [(b"m1", 1)]
    assert isinstance(caught.value.__cause__, BranchLost)
    assert caught.value.__cause__.code == "branch-lost"
    assert transfer_ids(engine) == set() and prepared_gids(engine) == []
    remote.close()
    # a new server on the same cursor: the message is there once, and consumed once
    with serve(CONSUMER_ROLE, ConsumerService(cursor)) as again:
        remote = RemoteCursor(again.address, SECRET, timeout=5.0)
        tm2 = make_manager(managers, [db, remote], node_id="node-2")
        with tm2.transaction() as tx:
            got = tx.join(remote).receive("orders")
            assert got is not None and got.body == b"m1" and got.delivery_count == 2
            move(tx.join(db), "m1", 1, 10)
        remote.close()
    assert available(cursor) == [] and transfer_ids(engine) == {"m1"}


def test_a_later_receive_on_a_lost_branch_is_refused(cursor: Cursor) -> None:
    feed(cursor, b"m1", b"m2")
    listener = serve(CONSUMER_ROLE, ConsumerService(cursor))
    remote = RemoteCursor(listener.address, SECRET, timeout=5.0)
    xid = Xid.branch_of("node-1:lost-1", remote.name)
    branch = remote.start(xid)
    assert branch.receive("orders") is not None
    listener.close()
    with pytest.raises(BranchLost):
        branch.receive("orders")
    with pytest.raises(BranchLost):
        remote.prepare(xid)
    assert available(cursor) == [(b"m1", 1), (b"m2", 0)]
    remote.close()


def test_an_unreachable_server_is_transient(cursor: Cursor) -> None:
    listener = serve(CONSUMER_ROLE, ConsumerService(cursor))
    address = listener.address
    listener.close()
    remote = RemoteCursor(address, SECRET, timeout=2.0)
    with pytest.raises(TransientError):
        remote.recover()
    with pytest.raises(TransientError):  # phase two: left to recovery, no outcome made up
        remote.commit(Xid.branch_of("node-1:x-1", remote.name))
    remote.close()


class DropReplies:
    """A server-side connection that swallows the reply to the first ``verb`` request and closes:
    the server acted, the client never hears. Duck-types the `Connection` a service uses."""

    dropped = 0

    def __init__(self, conn: Connection, verb: FrameType, limit: int = 1) -> None:
        self.conn, self.verb, self.limit = conn, verb, limit
        self.version = conn.version
        self.last: object = None

    def recv(self, timeout: float | None = None) -> object:
        self.last = self.conn.recv(timeout)
        return self.last

    def send(self, frame: object) -> None:
        last = self.last
        mine = isinstance(last, XaRequest) and last.verb == self.verb
        if mine and DropReplies.dropped < self.limit:
            DropReplies.dropped += 1
            self.conn.close()
            raise OSError("reply dropped")
        self.conn.send(frame)  # type: ignore[arg-type]


def test_a_lost_answer_never_invents_an_outcome(
    engine: sa.Engine, mlog: MessageLog, managers: list[TransactionManager]
) -> None:
    service = ProducerService(mlog)
    DropReplies.dropped = 0

    def handler(conn: Connection) -> None:
        service(DropReplies(conn, FrameType.XA_COMMIT, limit=3))  # type: ignore[arg-type]

    with serve(PRODUCER_ROLE, handler) as listener:
        remote = RemoteMessageLog(listener.address, SECRET, timeout=5.0)
        alone = make_manager(managers, [remote])
        with pytest.raises(OutcomeUnknownError), alone.transaction() as tx:  # one phase
            tx.join(remote).send("orders", b"one-phase")
        assert bodies(mlog) == [b"one-phase"]  # it did commit: unknown, not rolled back
        db = PostgresResource(engine, "db")
        forced = RemoteMessageLog(listener.address, SECRET, timeout=5.0, lazy_commit=False)
        tm = make_manager(managers, [db, forced], node_id="node-2")
        with pytest.warns(CompletionPending), tm.transaction() as tx:  # lost, and lost again
            move(tx.join(db), "t1", 1, 10)
            tx.join(forced).send("orders", b"two-phase")
        assert bodies(mlog) == [b"one-phase", b"two-phase"]
        assert mlog.prepared_gids() == [] and transfer_ids(engine) == {"t1"}
        assert tm.recover(force=True).clean  # the repeated commit is answered, END written
        # a lazy commit's answer is awaited off the caller's thread: lost, and lost again there,
        # the decision stays until recovery's repeated commit is answered
        DropReplies.dropped = 0
        lazy = make_manager(managers, [db, remote], node_id="node-3")
        with lazy.transaction() as tx:
            move(tx.join(db), "t2", 1, 10)
            tx.join(remote).send("orders", b"lazy")
        remote.flush_commits()
        assert bodies(mlog) == [b"one-phase", b"two-phase", b"lazy"]
        assert [d.gtrid for d in lazy.log.pending()] == [tx.gtrid]  # not forgotten yet
        assert lazy.recover(force=True).clean
        assert lazy.log.pending() == []
        remote.close()
        forced.close()


# -- refused peers and bad requests ------------------------------------------------------------


def test_wrong_secret_and_wrong_role_are_refused(
    log_server: Listener, cursor_server: Listener
) -> None:
    with pytest.raises(AuthError):
        connect(log_server.address, SharedSecret(b"w" * 32), "intruder", PRODUCER_ROLE)
    with pytest.raises(AuthError):
        connect(cursor_server.address, SECRET, "confused", PRODUCER_ROLE)
    with pytest.raises(AuthError):
        RemoteMessageLog(cursor_server.address, SECRET, timeout=2.0).recover()
    with pytest.raises(AuthError):
        RemoteCursor(cursor_server.address, SharedSecret(b"w" * 32), timeout=2.0).recover()


def ask(
    conn: Connection, verb: FrameType, request_id: int, xid: Xid | None, args: dict[str, Value]
) -> XaReply:
    conn.send(XaRequest(verb, request_id, xid, args))
    reply = conn.recv(timeout=5.0)
    assert isinstance(reply, XaReply) and reply.request_id == request_id
    return reply


def test_malformed_requests_get_an_error_and_the_connection_goes_on(
    cursor: Cursor, cursor_server: Listener, log_server: Listener, mlog: MessageLog
) -> None:
    feed(cursor, b"m1")
    xid = Xid.branch_of("node-1:raw-1", "cursor")
    bad: list[tuple[FrameType, Xid | None, dict[str, Any]]] = [
        (FrameType.XA_START, xid, {"rm": "cursor", "op": "receive", "destination": 5}),
        (FrameType.XA_START, xid, {"rm": "cursor", "op": "peek", "destination": "orders"}),
        (
            FrameType.XA_START,
            xid,
            {"rm": "cursor", "op": "receive", "destination": "orders", "max": 0},
        ),
        (FrameType.XA_START, xid, {"rm": "other", "op": "receive", "destination": "orders"}),
        (FrameType.XA_PREPARE, None, {"rm": "cursor", "received": 0}),
        (FrameType.XA_PREPARE, xid, {"rm": "cursor", "received": "1"}),
        (FrameType.XA_RECOVER, None, {}),
        # an argument the verb does not take is refused, never ignored: a misspelt one_phase
        # would otherwise commit a branch that was never prepared
        (FrameType.XA_COMMIT, xid, {"rm": "cursor", "onePhase": True, "received": 0}),
        (
            FrameType.XA_START,
            xid,
            {"rm": "cursor", "op": "receive", "destination": "orders", "wait": 1},
        ),
        (FrameType.XA_ROLLBACK, xid, {"rm": "cursor", "received": 0}),
        (FrameType.XA_RECOVER, None, {"rm": "cursor", "xid": "x"}),
    ]
    with connect(cursor_server.address, SECRET, "raw", CONSUMER_ROLE) as conn:
        for n, (verb, x, args) in enumerate(bad, 1):
            reply = ask(conn, verb, n, x, args)
            assert reply.status == "bad-request", (verb, args, reply)
            assert reply.message
        lost = ask(conn, FrameType.XA_PREPARE, 50, xid, {"rm": "cursor", "received": 1})
        assert lost.status == "branch-lost"
        got = ask(conn, FrameType.XA_START, 51, xid,
                  {"rm": "cursor", "op": "receive", "destination": "orders", "max": 5})  # fmt: skip
        assert got.status == "ok" and len(got.result["deliveries"]) == 1  # type: ignore[arg-type]
        short = ask(conn, FrameType.XA_PREPARE, 52, xid, {"rm": "cursor", "received": 0})
        assert short.status == "branch-lost"  # holds 1, the client says 0: rolled back
        assert available(cursor) == [(b"m1", 1)]
        recovered = ask(conn, FrameType.XA_RECOVER, 53, None, {"rm": "cursor"})
        assert recovered.status == "ok" and recovered.result == {"xids": []}
    pxid = Xid.branch_of("node-1:raw-2", "mlog")
    message: dict[str, Value] = {"id": "abc", "destination": "orders", "body": b"x", "headers": {},
               "persistent": True, "expires_at": None}  # fmt: skip
    with connect(log_server.address, SECRET, "raw", PRODUCER_ROLE) as conn:
        assert ask(conn, FrameType.XA_START, 1, pxid, {"rm": "mlog"}).status == "bad-request"
        no_body: dict[str, Value] = {**message, "body": "text"}
        reply = ask(conn, FrameType.XA_PREPARE, 2, pxid, {"rm": "mlog", "messages": [no_body]})
        assert reply.status == "mlog-invalid-message"
        reply = ask(conn, FrameType.XA_PREPARE, 3, pxid, {"rm": "mlog", "messages": [{}]})
        assert reply.status == "bad-request"
        typo: dict[str, Value] = {"rm": "mlog", "onephase": True, "messages": [message]}
        reply = ask(conn, FrameType.XA_COMMIT, 6, pxid, typo)
        assert reply.status == "bad-request" and "'onephase'" in reply.message
        assert bodies(mlog) == []
        reply = ask(conn, FrameType.XA_PREPARE, 4, pxid, {"rm": "mlog", "messages": [message]})
        assert reply.status == "ok" and reply.result == {"vote": "commit"}
        reply = ask(conn, FrameType.XA_COMMIT, 5, pxid, {"rm": "mlog", "one_phase": False})
        assert reply.status == "ok" and reply.result == {"outcome": None}
    assert bodies(mlog) == [b"x"]


@pytest.mark.parametrize("packed", [False, True], ids=["maps", "packed"])
def test_a_refused_request_rolls_back_the_shares_staged_before_it(
    log_server: Listener, mlog: MessageLog, packed: bool
) -> None:
    """A share is staged, then a request of the same branch is refused (an invalid message, a
    broken packed run): the whole branch is rolled back, the share with it, so a client that
    goes on (stages more, prepares) can never prepare the shares before the refusal without
    the rest."""

    def messages(*ms: Message) -> Value:
        return pack(list(ms)) if packed else [message_to_value(m) for m in ms]

    refusals: list[tuple[Value, str]] = [(messages(Message("bad", "q.DLQ", b"x")),
                                          "mlog-invalid-message")]  # fmt: skip
    if packed:
        refusals.append((pack([Message("cut", "orders", b"x")])[:-1], "bad-request"))
    for n, (refused, status) in enumerate(refusals):
        xid = Xid.branch_of(f"node-1:raw-3{n}", "mlog")
        with connect(log_server.address, SECRET, "raw", PRODUCER_ROLE) as conn:
            share = {
                "rm": "mlog",
                "op": "stage",
                "messages": messages(Message("m1", "orders", b"1")),
            }
            assert ask(conn, FrameType.XA_START, 1, xid, share).result == {"staged": 1}
            stage = {"rm": "mlog", "op": "stage", "messages": refused}
            assert ask(conn, FrameType.XA_START, 2, xid, stage).status == status
            more = {"rm": "mlog", "messages": messages(Message(f"m{n}", "orders", b"5"))}
            reply = ask(conn, FrameType.XA_PREPARE, 3, xid, more)
            assert reply.status != "ok", reply  # the branch is gone: its gid rolled back
        assert mlog.prepared_gids() == [] and bodies(mlog) == []


def test_a_sub_branch_dropped_by_the_server_is_rolled_back_where_it_was_started(
    mlog: MessageLog,
) -> None:
    """A sub-branch (bqual ``mlog~t``, as a Spark task's) is started on the resource ``mlog``; a
    refusal or the connection's end rolls it back there. It was rolled back on a resource of its
    bqual's name, made for it: the branch stayed active in ``mlog`` for good (the next start of
    it was refused as already active) and every such drop used up one of the server's resource
    names."""
    service = ProducerService(mlog)
    xid = Xid.branch_of("node-1:sub-1", "mlog~t")
    good = [message_to_value(Message("m1", "orders", b"1"))]
    bad = [message_to_value(Message("m2", "orders.DLQ", b"2"))]
    with serve(PRODUCER_ROLE, service) as listener:
        for refused in (True, False):
            with connect(listener.address, SECRET, "raw", PRODUCER_ROLE) as conn:
                share = {"rm": "mlog", "op": "stage", "messages": good}
                assert ask(conn, FrameType.XA_START, 1, xid, share).status == "ok"
                if refused:
                    stage = {"rm": "mlog", "op": "stage", "messages": bad}
                    reply = ask(conn, FrameType.XA_START, 2, xid, stage)
                    assert reply.status == "mlog-invalid-message"
            # refused, or the connection ended: the branch is no longer active anywhere
            deadline = time.monotonic() + 10
            while service.resource("mlog")._active(xid) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not service.resource("mlog")._active(xid)
        assert sorted(service._resources) == ["mlog"]
    assert mlog.prepared_gids() == [] and bodies(mlog) == []


def test_remote_error_codes_rebuild_the_right_exceptions() -> None:
    from messaging.remote.protocol import RemoteError, error_from_reply, error_reply

    class NewTransient(TransientError):
        code = "some-new-transient"

    rebuilt = error_from_reply(error_reply(1, DestinationFullError("full")))
    assert isinstance(rebuilt, DestinationFullError) and isinstance(rebuilt, TransientError)
    assert isinstance(error_from_reply(error_reply(1, NewTransient("x"))), TransientError)
    assert isinstance(error_from_reply(error_reply(1, OutcomeUnknownError("?"))),
                      OutcomeUnknownError)  # fmt: skip
    unknown = error_from_reply(XaReply(1, "who-knows", {}, "strange"))
    assert isinstance(unknown, RemoteError) and unknown.code == "remote-error"
    assert isinstance(error_from_reply(error_reply(1, ValueError("bug"))), RemoteError)
