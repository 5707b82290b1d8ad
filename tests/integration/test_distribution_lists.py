"""Transactional sends to several destinations (seed 004, MSMQ distribution lists), through a real
message log, the transfer over TCP, and a real cursor: a copy reaches each destination or, if any
copy cannot be written, the whole transaction (database work included) aborts; a copy that
reaches a non-transactional queue goes to that side's dead-letter queue and a negative
acknowledgment goes to the administration queue the message named."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coordinator import TransactionManager, TransactionRolledBack
from messaging.auth import SharedSecret
from messaging.connection import Listener, connect
from messaging.transfer import TRANSFER_ROLE, LogTransfer, TransferReceiver
from resource_managers.cursor import NACK_HEADER, Cursor
from resource_managers.message_log import (
    LIST_HEADER,
    DestinationFullError,
    InvalidMessageError,
    MessageLog,
    MessageLogResource,
)
from resource_managers.postgres import PostgresResource
from resource_managers.sequencing import DoublingBackoff
from tests.support.managers import make_manager
from tests.support.pg import ledger_engine, move, prepared_gids, transfer_ids

SECRET = SharedSecret(b"distribution list test secret 32")


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[MessageLog, Cursor, LogTransfer]]:
    """A message log transferring to a cursor over TCP."""
    with (
        MessageLog(tmp_path / "log", max_destination_messages=2) as mlog,
        Cursor(tmp_path / "cursor") as cursor,
        Listener(
            ("127.0.0.1", 0), SECRET, "cursor", {TRANSFER_ROLE: TransferReceiver(cursor)}
        ) as listener,
        LogTransfer(
            mlog,
            lambda: connect(listener.address, SECRET, "log", TRANSFER_ROLE, timeout=2.0),
            resend=DoublingBackoff(base=0.1, cap=0.5),
        ) as xfer,
    ):
        yield mlog, cursor, xfer


def wait(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_list_send_puts_one_copy_in_each_destination(
    pair: tuple[MessageLog, Cursor, LogTransfer], managers: list[TransactionManager]
) -> None:
    """Seed 004: a copy of the message is sent to each destination of the list."""
    mlog, cursor, xfer = pair
    log = MessageLogResource(mlog)
    tm = make_manager(managers, [log])
    with tm.transaction() as tx:
        ids = tx.join(log).send_to_list(["a", "b", "c"], b"hello", priority=7)
    assert xfer.wait_idle(10)
    copies = [cursor.available(q)[0] for q in ("a", "b", "c")]
    assert [c.message_id for c in copies] == ids and len(set(ids)) == 3
    assert len({c.headers[LIST_HEADER] for c in copies}) == 1
    assert all(c.body == b"hello" and c.message.priority == 7 for c in copies)


def test_one_copy_that_cannot_be_written_aborts_the_whole_transaction(
    pair: tuple[MessageLog, Cursor, LogTransfer],
    make_pg_database: Callable[[], str],
    managers: list[TransactionManager],
) -> None:
    """Seed 004: failure in sending to any destination aborts the entire transaction, here with
    a PostgreSQL branch in it, and even when the application swallowed the send's error."""
    mlog, _, _ = pair
    engine = ledger_engine(make_pg_database())
    try:
        log, db = MessageLogResource(mlog), PostgresResource(engine, "db")
        tm = make_manager(managers, [db, log])
        with pytest.raises(TransactionRolledBack) as err, tm.transaction() as tx:
            move(tx.join(db), "t1", 1, 10)
            branch = tx.join(log)
            branch.send("audit", b"kept only if all copies are")
            with pytest.raises(InvalidMessageError):
                branch.send_to_list(["a", "not a destination!"], b"x")
        assert "distribution-list send refused" in str(err.value)
        with pytest.raises(TransactionRolledBack), tm.transaction() as tx:
            move(tx.join(db), "t2", 1, 10)
            branch = tx.join(log)
            branch.send("b", b"1")
            branch.send("b", b"2")  # "b" holds at most 2: this branch fills it
            with pytest.raises(DestinationFullError):
                branch.send_to_list(["c", "b"], b"3")
        assert transfer_ids(engine) == set() and prepared_gids(engine) == []
        assert mlog.prepared_gids() == []
    finally:
        engine.dispose()


def test_a_copy_at_a_non_transactional_queue_is_dead_lettered_and_nacked(
    pair: tuple[MessageLog, Cursor, LogTransfer], managers: list[TransactionManager]
) -> None:
    """Seed 004: when the message reaches a non-transactional queue it is rejected and moved to
    the transactional dead-letter queue on the computer hosting that queue, and a negative
    acknowledgment goes to the administration queue named in the original message. The copies
    for transactional queues are delivered as usual."""
    mlog, cursor, xfer = pair
    cursor.set_transactional("legacy", False)
    log = MessageLogResource(mlog)
    tm = make_manager(managers, [log])
    with tm.transaction() as tx:
        ids = tx.join(log).send_to_list(["orders", "legacy"], b"order-1", admin_queue="admin")
        tx.join(log).send("legacy", b"plain", transactional=False)
    assert xfer.wait_idle(10)
    wait(lambda: len(cursor.available("admin")) == 1)
    assert [d.message_id for d in cursor.available("orders")] == [ids[0]]
    assert [d.body for d in cursor.available("legacy")] == [b"plain"]
    (dead,) = cursor.dead_letters("legacy")
    assert dead.message_id == ids[1] and dead.reason and dead.reason.startswith("rejected:")
    (nack,) = cursor.available("admin")
    assert nack.headers[NACK_HEADER] == "non-transactional-queue"
    assert nack.headers["twopc-original-id"] == ids[1]
    assert nack.headers["twopc-original-destination"] == "legacy"
