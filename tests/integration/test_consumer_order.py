"""A single consumer keeps its stream's commit order when a round's two-phase commit goes wrong
after the cursor prepared: the prepare's answer comes late (the caller's timeout runs out while
the cursor holds the message in a prepared branch), never comes, or comes with the connection cut
and the cursor unreachable for a while.

Real parts: ``twopc serve log`` transferring to ``twopc serve cursor``, a PostgreSQL branch in
every round (so every round is two-phase), and a frame-aware proxy between the consumer and the
cursor that mistreats the reply to chosen ``XA_PREPARE`` frames (`ReplyFault`). Each of the three
ways of consuming is tried: the `Consumer` helper, a plain `consume_once` loop that only catches
errors (the loop the docs describe), and a transacted JMS-style `Session` whose application
carries on after a failed commit. Every run: 0 order inversions, 0 lost, 0 duplicated.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from coordinator import MemoryDecisionLog, Transaction, TransactionError, TransactionManager, Xid
from messaging.consumer import Consumer, consume_once
from messaging.frames import FrameType
from messaging.remote import RemoteCursor
from messaging.session import AckMode, Session
from resource_managers.cursor import Delivery
from resource_managers.postgres import PostgresResource
from tests.integration.cursor_stack import Stack, _stop
from tests.support.fault_proxy import FaultProxy, ReplyFault

pytestmark = pytest.mark.slow

QUEUE = "orders"
MESSAGES = 10
TX_TIMEOUT = 1.0

#: what happens to the reply of a chosen XA_PREPARE (the cursor has prepared the branch by then)
FAULTS = {
    # late: the caller's wait runs out while the completion job still waits for the answer
    "late-reply": ReplyFault(FrameType.XA_PREPARE, "delay", probability=0.3, seconds=2.0),
    # lost: the client's socket timeout ends the prepare; the branch stays prepared at the cursor
    "lost-reply": ReplyFault(FrameType.XA_PREPARE, "drop", probability=0.3),
    # cut, and the cursor unreachable for 1.5 s: the rollback cannot be confirmed at once
    "cut-and-outage": ReplyFault(FrameType.XA_PREPARE, "reset", probability=0.3, outage=1.5),
}


class _Stack(Stack):
    """The servers of `cursor_stack`, but with room for many redeliveries: a message whose round
    is rolled back several times must never reach the dead-letter queue here."""

    def start(self) -> None:
        self.start_cursor("--max-deliveries", "1000")
        self.start_log()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[_Stack]:
    s = _Stack(tmp_path, None)
    try:
        s.start()  # a server that started before another failed to is stopped too
        yield s
    finally:
        for proc in s.procs[::-1]:
            _stop(proc)


def _fill(stack: _Stack) -> None:
    """Messages 1..MESSAGES, one transaction each, then wait until the cursor holds them all (a
    backlog, so a round that overtook another would find the next message there)."""
    for n in range(1, MESSAGES + 1):
        stack.send(QUEUE, str(n).encode())
    probe = RemoteCursor(("127.0.0.1", stack.cursor_port), stack.secret, name="probe")
    try:
        deadline = time.monotonic() + 30
        while True:
            xid = Xid.branch_of(f"probe:{time.monotonic_ns()}", probe.name)
            got = probe.start(xid).receive_many(QUEUE, MESSAGES, timeout=1.0)
            probe.rollback(xid)
            if len(got) == MESSAGES:
                return
            assert time.monotonic() < deadline, f"only {len(got)} messages reached the cursor"
            time.sleep(0.1)
    finally:
        probe.close()


def _handled(pg_url: str) -> list[int]:
    engine = sa.create_engine(pg_url)
    try:
        with engine.connect() as conn:
            return [r.n for r in conn.execute(sa.text("SELECT n FROM handled ORDER BY id"))]
    finally:
        engine.dispose()


def _run_consumer(tm: TransactionManager, cursor: RemoteCursor, handle: Callable[..., None],
                  done: Callable[[], bool]) -> None:  # fmt: skip
    with Consumer(tm, cursor, QUEUE, handle, batch=1, poll=0.2):
        _wait(done)


def _run_consume_once(tm: TransactionManager, cursor: RemoteCursor, handle: Callable[..., None],
                      done: Callable[[], bool]) -> None:  # fmt: skip
    deadline = time.monotonic() + 120
    while not done():
        assert time.monotonic() < deadline, "consume_once loop made no progress"
        try:
            consume_once(tm, cursor, QUEUE, handle, batch=1, timeout=0.2)
        except TransactionError:
            continue  # rolled back (or not yet settled): the next call keeps the order


def _run_session(tm: TransactionManager, cursor: RemoteCursor, pg: PostgresResource,
                 done: Callable[[], bool]) -> None:  # fmt: skip
    session = Session(tm, cursor=cursor, mode=AckMode.TRANSACTED, transaction_timeout=TX_TIMEOUT)
    deadline = time.monotonic() + 120
    try:
        while not done():
            assert time.monotonic() < deadline, "session loop made no progress"
            try:
                got = session.receive(QUEUE, timeout=0.2)
                if got is None:
                    continue
                _insert(session.transaction.join(pg), got.body)
                session.commit()
            except TransactionError:
                continue  # the session's transaction rolled back; it begins another
    finally:
        session.close(acknowledge=False)


def _insert(db: Any, body: bytes) -> None:
    db.execute(sa.text("INSERT INTO handled (n) VALUES (:n)"), {"n": int(body)})


def _wait(done: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the consumer made no progress"
        time.sleep(0.05)


CASES = [(way, fault) for way in ("consumer", "consume_once", "session") for fault in FAULTS]


@pytest.mark.parametrize(("way", "fault"), CASES, ids=[f"{w}-{f}" for w, f in CASES])
def test_single_consumer_keeps_commit_order(stack: _Stack, pg_url: str, way: str,
                                            fault: str) -> None:  # fmt: skip
    engine = sa.create_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE handled (id bigserial PRIMARY KEY, n int NOT NULL)"))
    _fill(stack)
    seed = CASES.index((way, fault))
    with FaultProxy(("127.0.0.1", stack.cursor_port), seed=seed) as proxy:
        proxy.set_reply_faults(FAULTS[fault])
        # the reply of a late prepare still arrives; a lost one is given up after 1.5 s
        cursor = RemoteCursor(proxy.address, stack.secret, timeout=1.5 if fault != "late-reply"
                              else 10.0)  # fmt: skip
        pg = PostgresResource(engine, "pg")
        tm = TransactionManager("order-test", MemoryDecisionLog(), [pg, cursor],
                                default_timeout=TX_TIMEOUT, recovery_interval=None,
                                reaper_interval=None)  # fmt: skip

        def handle(tx: Transaction, delivery: Delivery) -> None:
            _insert(tx.join(pg), delivery.body)

        def done() -> bool:
            return len(_handled(pg_url)) >= MESSAGES

        try:
            if way == "consumer":
                _run_consumer(tm, cursor, handle, done)
            elif way == "consume_once":
                _run_consume_once(tm, cursor, handle, done)
            else:
                _run_session(tm, cursor, pg, done)
            assert tm.settle(timeout=30), f"still unsettled: {tm.unsettled()}"
        finally:
            tm.close()
            cursor.close()
        hits = sum(v for k, v in proxy.stats.items() if k.startswith("reply_"))
    engine.dispose()
    handled = _handled(pg_url)
    assert handled == list(range(1, MESSAGES + 1)), (
        f"commit order {handled}; reply faults {hits}, retries {tm.metrics.as_dict()}"
    )
    assert hits > 0, "no reply was mistreated: the test tested nothing"
