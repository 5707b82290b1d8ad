"""JMS-style sessions (seed 003) over a real message log, transfer and cursor (`LogServer` and
`CursorServer` embedded, over loopback TCP) and a `TransactionManager` with a file decision log:
each acknowledgment mode's contract in one process (the crash side is tests/crash/
test_ack_modes.py), synchronous persistent and non-persistent sends, priority, expiry, durable
and non-durable subscribers, and the errors of calls a mode does not accept."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

from coordinator import (
    FileDecisionLog,
    IllegalStateError,
    ProgrammingError,
    TransactionManager,
    TransactionRolledBack,
)
from messaging.auth import SharedSecret
from messaging.remote import RemoteCursor, RemoteMessageLog
from messaging.server import CursorServer, LogServer
from messaging.session import AckMode, Received, Session
from resource_managers.cursor import Cursor
from resource_managers.message_log import (
    PUBLISHER_HEADER,
    TRANSACTIONAL_HEADER,
    MessageLog,
)
from resource_managers.postgres import PostgresResource
from resource_managers.sequencing import DoublingBackoff
from tests.support.managers import make_manager
from tests.support.pg import prepared_gids

REPO = Path(__file__).resolve().parents[2]
SECRET = SharedSecret(b"session test secret, 32 bytes!!!")


@dataclass
class Stores:
    """An embedded log whose transfer feeds an embedded cursor."""

    log: LogServer
    cursor_server: CursorServer

    @property
    def cursor(self) -> Cursor:
        return self.cursor_server.cursor

    def settle(self) -> None:
        """Everything committed at the log has reached the cursor."""
        assert self.log.transfer.wait_idle(10), "transfer did not go idle"

    def bodies(self, queue: str) -> list[bytes]:
        return [d.body for d in self.cursor.available(queue)]

    def in_flight(self) -> int:
        return self.cursor.stats().in_flight


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[Stores]:
    cursor = CursorServer(tmp_path / "cursor", SECRET, listen=("127.0.0.1", 0)).start()
    log = LogServer(
        tmp_path / "log", SECRET, cursor=cursor.address,
        resend=DoublingBackoff(base=0.1, cap=0.5),
    ).start()  # fmt: skip
    yield Stores(log, cursor)
    log.close()
    cursor.close()


@pytest.fixture
def tm(managers: list[TransactionManager], stores: Stores, tmp_path: Path) -> TransactionManager:
    resources = [stores.log.resource, stores.cursor_server.resource]
    return make_manager(managers, resources, FileDecisionLog(tmp_path / "tmlog"))


@pytest.fixture
def tm_factory(
    managers: list[TransactionManager], tmp_path: Path
) -> Callable[[list[object]], TransactionManager]:
    def make(resources: list[object]) -> TransactionManager:
        log = FileDecisionLog(tmp_path / f"tmlog-{len(managers)}")
        return make_manager(managers, resources, log, node_id=f"node-{len(managers)}")

    return make


@pytest.fixture
def session_of(tm: TransactionManager, stores: Stores) -> Iterator[Callable[..., Session]]:
    """Sessions over both stores, closed after the test."""
    made: list[Session] = []

    def make(mode: AckMode | str = AckMode.AUTO, **kwargs: object) -> Session:
        s = Session(tm, cursor=stores.cursor_server.resource, log=stores.log.resource,
                    mode=mode, **kwargs)  # type: ignore[arg-type]  # fmt: skip
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def fill(stores: Stores, session_of: Callable[..., Session], queue: str, n: int) -> None:
    """``n`` messages ``0``..``n-1`` in ``queue`` at the cursor, sent in one transaction."""
    producer = session_of(AckMode.TRANSACTED)
    for i in range(n):
        producer.send(queue, str(i).encode())
    producer.commit()
    stores.settle()
    assert len(stores.bodies(queue)) == n


# -- AUTO ------------------------------------------------------------------------------------------


def test_auto_acknowledges_each_message_when_its_handler_returns(stores, session_of) -> None:
    """Seed 003, AUTO_ACKNOWLEDGE: the acknowledgment is the last thing after the handler
    returns; while a handler runs only its own message is unacknowledged (so a crash can only
    bring that one back), and every handled message is gone from the cursor."""
    fill(stores, session_of, "orders", 5)
    seen: list[tuple[bytes, int, int]] = []

    def handler(m: Received) -> None:
        seen.append((m.body, stores.in_flight(), len(stores.bodies("orders"))))

    session = session_of(AckMode.AUTO)
    assert session.consume("orders", handler) == 5
    assert seen == [(str(i).encode(), 1, 4 - i) for i in range(5)]
    assert stores.in_flight() == 0 and stores.bodies("orders") == []


def test_auto_receive_acknowledges_on_the_next_call(stores, session_of) -> None:
    """Seed 003, AUTO_ACKNOWLEDGE pull-style: a received message is acknowledged when the
    application comes back (next receive, acknowledge, close), never before it had it."""
    fill(stores, session_of, "orders", 3)
    session = session_of(AckMode.AUTO)
    first = session.receive("orders")
    assert first is not None and first.body == b"0" and not first.redelivered
    assert stores.in_flight() == 1 and stores.bodies("orders") == [b"1", b"2"]
    second = session.receive("orders")
    assert second is not None and second.body == b"1"
    assert stores.in_flight() == 1 and stores.bodies("orders") == [b"2"]  # "0" acknowledged
    second.acknowledge()
    assert stores.in_flight() == 0
    assert session.receive("orders") is not None
    session.close()
    assert stores.in_flight() == 0 and stores.bodies("orders") == []


def test_auto_handler_failure_redelivers_with_flag_and_count(stores, session_of) -> None:
    """Seed 003: a message whose processing failed before the acknowledgment is redelivered,
    with JMSRedelivered set and its delivery count raised."""
    fill(stores, session_of, "orders", 2)
    session = session_of(AckMode.AUTO)

    def fail(m: Received) -> None:
        raise RuntimeError(f"cannot handle {m.body!r}")

    with pytest.raises(RuntimeError):
        session.consume("orders", fail)
    got: list[Received] = []
    assert session.consume("orders", got.append) == 2
    assert [(m.body, m.redelivered, m.delivery_count) for m in got] == [
        (b"0", True, 2),
        (b"1", False, 1),
    ]


def test_auto_exception_in_with_block_leaves_the_last_message(stores, session_of, tm) -> None:
    """Seed 003: with AUTO pull-style receive, a block that fails after receiving does not
    acknowledge what it may not have handled: the message comes back (at-least-once)."""
    fill(stores, session_of, "orders", 1)
    with pytest.raises(KeyError), Session(tm, cursor=stores.cursor_server.resource) as session:
        assert session.receive("orders") is not None
        raise KeyError("boom")
    assert stores.in_flight() == 0
    assert [d.delivery_count for d in stores.cursor.available("orders")] == [1]


# -- CLIENT ----------------------------------------------------------------------------------------


def test_client_acknowledge_acknowledges_everything_delivered_so_far(stores, session_of) -> None:
    """Seed 003, CLIENT_ACKNOWLEDGE: nothing is acknowledged until the application says so, and
    acknowledging one message acknowledges every message the session delivered before it."""
    fill(stores, session_of, "orders", 5)
    session = session_of(AckMode.CLIENT)
    got = [session.receive("orders") for _ in range(3)]
    assert all(m is not None for m in got)
    assert stores.in_flight() == 3 and len(session.unacknowledged) == 3
    got[1].acknowledge()  # type: ignore[union-attr]  # JMS: the session's, not just this one
    assert stores.in_flight() == 0 and stores.bodies("orders") == [b"3", b"4"]
    assert session.unacknowledged == []


def test_client_recover_redelivers_unacknowledged_in_order(stores, session_of) -> None:
    """Seed 003, CLIENT_ACKNOWLEDGE + recover: the unacknowledged messages come back, in their
    place ahead of the rest, with the redelivered flag and the count raised; acknowledged ones
    do not."""
    fill(stores, session_of, "orders", 4)
    session = session_of(AckMode.CLIENT)
    session.receive("orders")
    session.acknowledge()
    session.receive("orders")
    session.receive("orders")
    session.recover()
    assert stores.in_flight() == 0
    got: list[Received] = []
    assert session.consume("orders", got.append) == 3
    assert [(m.body, m.redelivered, m.delivery_count) for m in got] == [
        (b"1", True, 2),
        (b"2", True, 2),
        (b"3", False, 1),
    ]
    assert stores.in_flight() == 3  # consume does not acknowledge in CLIENT mode
    session.close()  # closing without acknowledge: they come back too
    assert stores.bodies("orders") == [b"1", b"2", b"3"]


# -- DUPS_OK ---------------------------------------------------------------------------------------


def test_dups_ok_acknowledges_in_batches_with_fewer_forced_records(stores, session_of) -> None:
    """Seed 003, DUPS_OK_ACKNOWLEDGE: lazy acknowledgment: a batch is committed in one forced
    record once all of it was handled, so the cursor forces 1 record per batch where AUTO forces
    1 per message (plus the first batch's ``H``: every later receive was pre-counted by the
    commit before it, AUTO's first message on arrival); up to one batch is unacknowledged at a
    time."""
    fill(stores, session_of, "orders", 10)
    fill(stores, session_of, "auto", 10)
    in_flight: list[int] = []
    before = stores.cursor.stats().forced_records
    session = session_of(AckMode.DUPS_OK, dups_ok_batch=4)
    assert session.consume("orders", lambda m: in_flight.append(stores.in_flight())) == 10
    dups_ok_forced = stores.cursor.stats().forced_records - before
    assert in_flight == [4, 4, 4, 4, 4, 4, 4, 4, 2, 2]
    assert stores.in_flight() == 0 and stores.bodies("orders") == []
    before = stores.cursor.stats().forced_records
    assert session_of(AckMode.AUTO).consume("auto", lambda m: None) == 10
    auto_forced = stores.cursor.stats().forced_records - before
    assert dups_ok_forced == 1 + 3 and auto_forced == 10


def test_dups_ok_handler_failure_brings_the_batch_back(stores, session_of) -> None:
    """Seed 003, DUPS_OK_ACKNOWLEDGE: duplicates are bounded by one batch: a failure in the
    middle of a batch brings back that batch (handled ones included), never an earlier one."""
    fill(stores, session_of, "orders", 6)
    session = session_of(AckMode.DUPS_OK, dups_ok_batch=3)
    handled: list[bytes] = []

    def handler(m: Received) -> None:
        if m.body == b"4" and not m.redelivered:
            raise RuntimeError("fail once")
        handled.append(m.body)

    with pytest.raises(RuntimeError):
        session.consume("orders", handler)
    assert handled == [b"0", b"1", b"2", b"3"]
    assert session.consume("orders", handler) == 3
    assert handled[4:] == [b"3", b"4", b"5"]  # the batch 3-5 again: "3" is the duplicate
    assert stores.in_flight() == 0


def test_dups_ok_pull_receive_commits_when_the_batch_was_handed_out(stores, session_of) -> None:
    """Seed 003, DUPS_OK_ACKNOWLEDGE with receive: the batch is acknowledged when the
    application comes back for more after its last message, or acknowledges, or closes."""
    fill(stores, session_of, "orders", 3)
    session = session_of(AckMode.DUPS_OK, dups_ok_batch=2)
    assert session.receive("orders").body == b"0"  # type: ignore[union-attr]
    session.acknowledge()  # lazy: "1" was not handed out yet, nothing is acknowledged
    assert stores.in_flight() == 2
    assert session.receive("orders").body == b"1"  # type: ignore[union-attr]
    assert stores.in_flight() == 2
    assert session.receive("orders").body == b"2"  # type: ignore[union-attr]
    assert stores.in_flight() == 1 and stores.bodies("orders") == []
    session.close()
    assert stores.in_flight() == 0


def test_failed_acknowledge_raises_and_the_messages_stay(stores, session_of) -> None:
    """Seed 003, CLIENT_ACKNOWLEDGE: acknowledge() throws if the acknowledgment fails, and the
    provider keeps the messages for redelivery (here: the session's transaction timed out)."""
    fill(stores, session_of, "orders", 2)
    session = session_of(AckMode.CLIENT, transaction_timeout=0.2)
    assert session.receive("orders") is not None
    time.sleep(0.3)
    with pytest.raises(TransactionRolledBack):
        session.acknowledge()
    deadline = time.monotonic() + 5  # past its deadline the rollback finishes on the pool
    while stores.in_flight():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    got = session.receive("orders")
    assert got is not None and got.body == b"0" and got.redelivered
    session.acknowledge()
    assert stores.bodies("orders") == [b"1"]


# -- TRANSACTED ------------------------------------------------------------------------------------


def test_transacted_receive_and_send_commit_or_roll_back_together(stores, session_of) -> None:
    """Seed 003, transacted sessions: a receive and the send it causes are one unit of work:
    the sent message is not forwarded before commit; a rollback discards the send and brings
    the received message back redelivered; a commit deletes it and forwards the reply."""
    fill(stores, session_of, "requests", 1)
    session = session_of(AckMode.TRANSACTED)
    request = session.receive("requests")
    assert request is not None
    session.send("replies", b"reply to " + request.body)
    stores.settle()
    assert stores.bodies("replies") == [] and stores.in_flight() == 1
    session.rollback()
    stores.settle()
    assert stores.bodies("replies") == [] and stores.in_flight() == 0
    again = session.receive("requests")
    assert again is not None and again.redelivered and again.delivery_count == 2
    session.send("replies", b"reply to " + again.body)
    session.commit()
    stores.settle()
    assert stores.bodies("requests") == [] and stores.bodies("replies") == [b"reply to 0"]
    reply = stores.cursor.available("replies")[0].message
    assert reply.transactional and TRANSACTIONAL_HEADER not in reply.headers


def test_transacted_session_with_postgresql_branch(stores, session_of, pg_url: str) -> None:
    """Seed 003, distributed transactions: the application joins its database to the session's
    transaction; the insert and the deletion of the message commit (two-phase) or roll back
    together, so processing is exactly-once."""
    engine = sa.create_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE handled (body text NOT NULL)"))
    pg = PostgresResource(engine, "pg")
    fill(stores, session_of, "orders", 2)
    session = session_of(AckMode.TRANSACTED)
    try:
        for commit in (False, True, True):
            m = session.receive("orders")
            assert m is not None
            session.transaction.join(pg).execute(
                sa.text("INSERT INTO handled VALUES (:b)"), {"b": m.body.decode()}
            )
            session.commit() if commit else session.rollback()
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT body FROM handled ORDER BY body")).scalars()
            assert list(rows) == ["0", "1"]
        assert stores.bodies("orders") == [] and stores.in_flight() == 0
        assert prepared_gids(engine) == []
    finally:
        session.close()
        engine.dispose()


def test_transacted_transaction_rolled_back_behind_the_session_s_back(stores, session_of) -> None:
    """Seed 003, transacted sessions are all-or-nothing: if the session's transaction ended
    without committing (timed out, rolled back by the application), the next call says so once
    instead of carrying on and later committing half the unit of work; one the application
    committed itself is simply followed by a new one."""
    fill(stores, session_of, "orders", 3)
    session = session_of(AckMode.TRANSACTED)
    assert session.receive("orders") is not None
    session.transaction.commit()  # committed directly: fine, the session moves on
    assert session.receive("orders") is not None
    session.transaction.rollback()
    with pytest.raises(TransactionRolledBack):
        session.send("replies", b"half a unit of work")
    again = session.receive("orders")
    assert again is not None and again.body == b"1" and again.redelivered
    session.commit()
    assert stores.bodies("orders") == [b"2"]


# -- producing -------------------------------------------------------------------------------------

_SEND_AND_DIE = textwrap.dedent(
    """
    import os, signal, sys
    from coordinator import FileDecisionLog, TransactionManager
    from messaging.session import Session
    from resource_managers.message_log import MessageLog, MessageLogResource
    log = MessageLogResource(MessageLog(sys.argv[1]))
    tm = TransactionManager("sender", FileDecisionLog(sys.argv[2]), [log],
                            recovery_interval=None, reaper_interval=None)
    session = Session(tm, log=log, client_id="app-1")
    print(session.send("orders", b"persistent", ttl=3600), flush=True)
    print(session.send("orders", b"volatile", persistent=False), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close, no flush: what a crash leaves
    """
)


def test_synchronous_send_is_durable_when_it_returns(tmp_path: Path) -> None:
    """Seed 003, the producer's perspective: send blocks until the log has accepted
    responsibility: for a persistent message it is on disk when send returns (found after a
    kill -9 right behind it); a non-persistent one may be lost in a crash."""
    done = subprocess.run(
        [sys.executable, "-c", _SEND_AND_DIE, str(tmp_path / "log"), str(tmp_path / "tmlog")],
        capture_output=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert done.returncode == -9, done.stderr.decode()
    persistent_id, volatile_id = done.stdout.decode().split()
    with MessageLog(tmp_path / "log") as mlog:
        kept = {m.message_id: m for _, m in mlog.pending("orders")}
        lost = [m for _, m in mlog.pending("orders#np")]
    assert list(kept) == [persistent_id] and volatile_id not in {m.message_id for m in lost}
    message = kept[persistent_id]
    assert message.body == b"persistent" and message.expires_at is not None
    assert not message.transactional  # a non-transacted session's send (seed 004)
    assert message.headers[PUBLISHER_HEADER] == "app-1" and message.publisher == "app-1"


def test_non_persistent_send_is_delivered(stores, session_of) -> None:
    """Seed 003: a non-persistent message is delivered like any other while nothing fails."""
    session_of(AckMode.AUTO).send("orders", b"fast", persistent=False)
    stores.settle()
    got = session_of(AckMode.AUTO).receive("orders", timeout=5)
    assert got is not None and got.body == b"fast" and not got.message.persistent


def test_list_destination_sends_one_copy_each(stores, session_of) -> None:
    """Seed 004 through a session: a list destination is a distribution list."""
    ids = session_of(AckMode.AUTO).send(["a", "b"], b"both")
    assert isinstance(ids, list) and len(ids) == 2
    stores.settle()
    assert stores.bodies("a") == [b"both"] and stores.bodies("b") == [b"both"]


def test_higher_priority_is_received_first(stores, session_of) -> None:
    """Seed 003 (JMS priority): a queue hands out higher priority first, FIFO within one."""
    producer = session_of(AckMode.TRANSACTED)
    for body, priority in [(b"low", 1), (b"high-1", 9), (b"normal", None), (b"high-2", 9)]:
        producer.send("orders", body, priority=priority)
    producer.commit()
    stores.settle()
    got: list[Received] = []
    session_of(AckMode.AUTO).consume("orders", got.append)
    assert [(m.body, m.priority) for m in got] == [
        (b"high-1", 9),
        (b"high-2", 9),
        (b"normal", 4),
        (b"low", 1),
    ]


def test_expired_message_is_not_delivered(stores, session_of) -> None:
    """Seed 003: a message stays in its queue until delivered or expired; an expired one is
    never handed out and lands in the dead-letter queue with its reason."""
    session_of(AckMode.AUTO).send("orders", b"stale", ttl=0.5)
    session_of(AckMode.AUTO).send("orders", b"fresh")
    stores.settle()
    time.sleep(0.7)
    got = session_of(AckMode.AUTO).receive("orders")
    assert got is not None and got.body == b"fresh"
    [dead] = stores.cursor.dead_letters("orders")
    assert dead.body == b"stale" and (dead.reason or "").startswith("expired:")


# -- topics ----------------------------------------------------------------------------------------


def test_durable_subscriber_gets_what_was_published_while_detached(stores, session_of) -> None:
    """Seed 003, durable subscriptions: while the subscriber is disconnected the server holds
    the messages for it, and delivers them when it comes back; a non-durable subscription ends
    with its subscriber."""
    session = session_of(AckMode.AUTO)
    durable = session.subscriber("topic:news", "reader")
    passing = session.subscriber("topic:news")
    session.send("topic:news", b"first")
    durable.close()  # disconnected: the durable subscription keeps collecting
    session.send("topic:news", b"second")
    stores.settle()
    deadline = time.monotonic() + 10
    while len(stores.bodies(durable.queue)) < 2:
        assert time.monotonic() < deadline, "topic dispatch did not deliver"
        time.sleep(0.02)
    got: list[bytes] = []
    passing.consume(lambda m: got.append(m.body), timeout=1.0)
    assert got[:1] == [b"first"]
    passing.close()
    assert [s.name for s in stores.cursor.subscriptions("topic:news")] == ["reader"]
    again = session_of(AckMode.CLIENT).subscriber("topic:news", "reader")
    assert [again.receive().body, again.receive().body] == [b"first", b"second"]  # type: ignore[union-attr]
    again.session.acknowledge()
    assert stores.bodies(again.queue) == []


# -- remote stores --------------------------------------------------------------------------------


def test_remote_cursor_and_log_behave_alike(tm_factory, stores, tmp_path: Path) -> None:
    """Seed 003 over the network: a session over `RemoteMessageLog` and `RemoteCursor` (the
    stores in another process, here over loopback) keeps the same contract: synchronous send,
    CLIENT recover redelivers, acknowledge deletes, a durable subscriber gets its copies."""
    log_server = LogServer(tmp_path / "rlog", SECRET, cursor=stores.cursor_server.address,
                           listen=("127.0.0.1", 0)).start()  # fmt: skip
    assert log_server.address is not None
    remote_log = RemoteMessageLog(log_server.address, SECRET, name="rlog", client_id="app")
    remote_cursor = RemoteCursor(stores.cursor_server.address, SECRET, name="rcursor",
                                 client_id="app")  # fmt: skip
    tm = tm_factory([remote_log, remote_cursor])
    try:
        with Session(tm, cursor=remote_cursor, log=remote_log, mode=AckMode.CLIENT) as session:
            reader = session.subscriber("topic:remote", "r1")
            session.send("orders", b"one")
            session.send("topic:remote", b"news")
            assert log_server.transfer.wait_idle(10)
            first = session.receive("orders", timeout=5)
            assert first is not None and first.body == b"one"
            session.recover()
            again = session.receive("orders", timeout=5)
            assert again is not None and again.redelivered and again.delivery_count == 2
            news = reader.receive(timeout=5)
            assert news is not None and news.body == b"news"
            session.acknowledge()
        assert stores.bodies("orders") == [] and stores.in_flight() == 0
        assert stores.bodies(reader.queue) == []
    finally:
        remote_cursor.close()
        remote_log.close()
        log_server.close()


# -- misuse ----------------------------------------------------------------------------------------


def test_wrong_mode_calls_raise_clear_errors(tm, stores, session_of) -> None:
    """Seed 003 keeps transactions and acknowledgments apart: a transacted session commits and
    never acknowledges; the others acknowledge and never commit."""
    transacted = session_of(AckMode.TRANSACTED)
    for call in (transacted.acknowledge, transacted.recover):
        with pytest.raises(IllegalStateError):
            call()
    for mode in (AckMode.AUTO, AckMode.CLIENT, AckMode.DUPS_OK):
        s = session_of(mode)
        for call in (s.commit, s.rollback, lambda s=s: s.transaction):
            with pytest.raises(IllegalStateError, match="transacted"):
                call()
    with pytest.raises(ProgrammingError, match="no cursor"):
        Session(tm, log=stores.log.resource).receive("orders")
    with pytest.raises(ProgrammingError, match="no message log"):
        Session(tm, cursor=stores.cursor_server.resource).send("orders", b"x")
    with pytest.raises(ProgrammingError):
        Session(tm, cursor=stores.cursor_server.resource, dups_ok_batch=0)
    with pytest.raises(ProgrammingError, match="acknowledgment mode"):
        Session(tm, cursor=stores.cursor_server.resource, mode="eventually")
    closed = session_of(AckMode.CLIENT)
    closed.close()
    with pytest.raises(IllegalStateError, match="closed"):
        closed.receive("orders")


def test_sessions_do_not_take_the_thread_s_transaction(tm, stores, session_of) -> None:
    """Seed 003: sessions are independent units: one holding unacknowledged messages leaves the
    thread free for another session and for the application's own transactions."""
    fill(stores, session_of, "orders", 2)
    client = session_of(AckMode.CLIENT)
    assert client.receive("orders") is not None
    session_of(AckMode.AUTO).send("other", b"meanwhile")
    with tm.transaction() as tx:
        assert tx is not client.unacknowledged[0].session._tx
    client.acknowledge()
    stores.settle()
    assert stores.bodies("orders") == [b"1"] and stores.bodies("other") == [b"meanwhile"]
