"""The cursor (delivery side) on its own journal: accepting through the receiver's filter and
persisting before acknowledging, receiving in transactions (commit deletes once, rollback
redelivers with the count raised, the dead-letter queue), delivery counts across a kill -9,
competing consumers, recovery by a new manager, rollover, and a corrupt segment."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from coordinator import (
    FileDecisionLog,
    IllegalStateError,
    LogCorruptionError,
    Outcome,
    ProgrammingError,
    TransactionManager,
    TransactionRolledBack,
    Vote,
    Xid,
)
from coordinator.decision_log import Decision
from coordinator.errors import LogWriteError
from resource_managers.cursor import (
    BranchRolledBack,
    ConsumerBranch,
    Cursor,
    CursorResource,
    Delivery,
)
from resource_managers.message_log import Message
from resource_managers.postgres import PostgresResource
from resource_managers.sequencing import Ack, Frame, Verdict
from tests.support.faulty_ops import FaultyOps
from tests.support.managers import make_manager
from tests.support.pg import ledger_engine, move, prepared_gids, transfer_ids
from tests.support.scripts import run_script

REPO = Path(__file__).resolve().parents[2]


def message(body: bytes, destination: str = "orders") -> Message:
    return Message(uuid.uuid4().hex, destination, body, {"h": body.decode()})


def feed(c: Cursor, *bodies: bytes, stream: str = "orders", epoch: int = 7) -> list[Message]:
    """Accept ``bodies`` as the next numbers of ``stream``, in order."""
    last = c.ack_for(stream).seq if c.ack_for(stream).epoch == epoch else 0
    out = []
    for body in bodies:
        m = message(body, stream)
        ack = c.deliver(Frame(stream, epoch, last + 1, last, m.message_id), m)
        assert ack == Ack(stream, epoch, last + 1)
        last += 1
        out.append(m)
    return out


def available(c: Cursor, queue: str = "orders") -> list[bytes]:
    return [d.body for d in c.available(queue)]


def received(tm: TransactionManager, cr: CursorResource, fail: bool = False) -> Delivery | None:
    """Receive one message of ``orders`` in a transaction; roll it back if ``fail``."""
    got: list[Delivery | None] = []
    try:
        with tm.transaction() as tx:
            branch: ConsumerBranch = tx.join(cr)
            got.append(branch.receive("orders"))
            if fail:
                raise RuntimeError("handler failed")
    except RuntimeError:
        pass
    return got[0]


# -- accepting -------------------------------------------------------------------------------------


def test_accept_in_order_drops_duplicates_and_gaps_and_survives_reopen(curdir: Path) -> None:
    with Cursor(curdir) as c:
        m1, m2, m3 = (message(b"m%d" % i) for i in (1, 2, 3))
        assert c.deliver(Frame("orders", 7, 1, 0, m1.message_id), m1) == Ack("orders", 7, 1)
        out_of_order = c.offer(Frame("orders", 7, 3, 2, m3.message_id))
        assert out_of_order.verdict is Verdict.OUT_OF_ORDER
        assert out_of_order.ack == Ack("orders", 7, 1)  # dropped and re-acked
        assert c.deliver(Frame("orders", 7, 3, 2, m3.message_id), m3) == Ack("orders", 7, 1)
        decision = c.offer(Frame("orders", 7, 2, 1, m2.message_id))
        assert c.accept(m2, decision) == Ack("orders", 7, 2)  # persisted, then acked
        assert c.deliver(Frame("orders", 7, 2, 1, m2.message_id), m2) == Ack("orders", 7, 2)
        stale = c.offer(Frame("orders", 6, 9, 0, "old"))
        assert stale.verdict is Verdict.STALE_EPOCH and stale.ack == Ack("orders", 7, 2)
        assert available(c) == [b"m1", b"m2"]
    with Cursor(curdir) as c:  # the filter state and the messages came back from the journal
        assert c.filter_state() == {"version": 1, "streams": {"orders": {"epoch": 7, "last": 2}}}
        assert c.offer(Frame("orders", 7, 2, 1, m2.message_id)).verdict is Verdict.DUPLICATE
        assert c.deliver(Frame("orders", 7, 3, 2, m3.message_id), m3) == Ack("orders", 7, 3)
        new_epoch = message(b"n1")
        assert c.deliver(Frame("orders", 8, 1, 0, new_epoch.message_id), new_epoch) == Ack(
            "orders", 8, 1
        )
        assert available(c) == [b"m1", b"m2", b"m3", b"n1"]
        assert c.available("orders")[0].headers == {"h": "m1"}


def test_accept_refuses_a_drop_a_wrong_message_and_a_stale_decision(cursor: Cursor) -> None:
    m1, m2 = message(b"m1"), message(b"m2")
    first = cursor.offer(Frame("orders", 1, 1, 0, m1.message_id))
    with pytest.raises(ProgrammingError):
        cursor.accept(m2, first)  # the frame names another message
    cursor.accept(m1, first)
    with pytest.raises(IllegalStateError):
        cursor.accept(m1, first)  # the stream moved: applying it twice would duplicate
    with pytest.raises(ProgrammingError):
        cursor.accept(m1, cursor.offer(Frame("orders", 1, 1, 0, m1.message_id)))  # a duplicate
    assert available(cursor) == [b"m1"]


def test_a_prepare_racing_a_rollback_votes_no_and_loses_nothing(cursor: Cursor) -> None:
    feed(cursor, b"a")
    gid = Xid.branch_of("node-1:race", "cursor").to_gid()
    assert cursor.take(gid, "orders") is not None
    cursor.rollback(gid)  # recovery's presumed abort, as if it ran just now
    with pytest.raises(BranchRolledBack):
        cursor.prepare(gid)
    with pytest.raises(BranchRolledBack):
        cursor.take(gid, "orders")
    [again] = cursor.available("orders")
    assert again.body == b"a" and again.delivery_count == 1


def test_receive_blocks_until_a_message_is_accepted(cursor: Cursor) -> None:
    cr = CursorResource(cursor)
    branch = cr.start(Xid.branch_of("node-1:wait", cr.name))
    assert branch.receive("orders", timeout=0.05) is None
    timer = threading.Timer(0.1, feed, (cursor, b"late"))
    timer.start()
    delivery = branch.receive("orders", timeout=5)
    timer.join()
    assert delivery is not None and delivery.body == b"late" and delivery.delivery_count == 1


def test_expired_messages_are_dropped_and_non_persistent_ones_skip_the_fsync(
    curdir: Path,
) -> None:
    clock = [1_000_000]
    with Cursor(curdir, clock_ms=lambda: clock[0]) as c:
        cr = CursorResource(c)
        soon, later, never = (
            Message(uuid.uuid4().hex, "orders", body, {}, True, expires)
            for body, expires in ((b"soon", 1_000_500), (b"later", 1_005_000), (b"never", None))
        )
        for seq, m in enumerate((soon, later, never), 1):
            c.deliver(Frame("orders", 1, seq, seq - 1, m.message_id), m)
        forced = c.stats().forced_records
        volatile = Message(uuid.uuid4().hex, "orders", b"volatile", {}, False)
        assert c.deliver(Frame("orders#np", 3, 1, 0, volatile.message_id), volatile) == Ack(
            "orders#np", 3, 1
        )
        assert c.stats().forced_records == forced  # accepted without an fsync
        clock[0] = 1_001_000
        branch = cr.start(Xid.branch_of("node-1:exp", cr.name))
        got = branch.receive("orders")
        assert got is not None and got.body == b"later"  # "soon" expired at the head
        assert available(c) == [b"never", b"volatile"]
    with Cursor(curdir, clock_ms=lambda: clock[0]) as c:  # the drop is in the journal
        back = c.available("orders")
        assert [d.body for d in back] == [b"later", b"never", b"volatile"]
        assert [d.message.persistent for d in back] == [True, True, False]  # the flag is kept


# -- consuming -------------------------------------------------------------------------------------


def test_commit_deletes_exactly_once_two_phase_and_one_phase(
    cursor: Cursor, managers: list[TransactionManager]
) -> None:
    cr = CursorResource(cursor)
    feed(cursor, b"a", b"b", b"c")
    tm = make_manager(managers, [cr])
    delivery = received(tm, cr)  # one participant: one-phase commit
    assert delivery is not None and delivery.body == b"a" and not delivery.redelivered
    xid = Xid.branch_of("node-1:two", cr.name)
    got = cr.start(xid).receive("orders")
    assert got is not None and got.body == b"b"
    assert cr.prepare(xid) == Vote.COMMIT
    assert available(cursor) == [b"c"]
    assert cr.commit(xid) is None
    assert cr.commit(xid) is None  # idempotent
    assert cr.rollback(xid) == Outcome.HEURISTIC_COMMIT
    assert available(cursor) == [b"c"] and cursor.delivery_count(got.message_id) is None
    empty = Xid.branch_of("node-1:empty", cr.name)
    assert cr.start(empty).receive("nothing-here") is None
    assert cr.prepare(empty) == Vote.READ_ONLY


def test_rollback_redelivers_in_place_with_the_count_raised(
    curdir: Path, managers: list[TransactionManager]
) -> None:
    with Cursor(curdir) as c:
        cr = CursorResource(c)
        feed(c, b"a", b"b")
        tm = make_manager(managers, [cr])
        first = received(tm, cr, fail=True)
        assert first is not None and first.delivery_count == 1 and not first.redelivered
        assert available(c) == [b"a", b"b"]  # back in its place, ahead of b
        again = received(tm, cr, fail=True)
        assert again is not None and again.body == b"a"
        assert again.redelivered and again.delivery_count == 2
    with Cursor(curdir) as c:
        cr = CursorResource(c)
        # b was pre-counted by a's receive (its forced H raised b's count ahead of delivery); the
        # clean close gave the unused pre-count back (a G record)
        assert [d.delivery_count for d in c.available("orders")] == [2, 0]
        tm = make_manager(managers, [cr])
        third = received(tm, cr)
        assert third is not None and third.body == b"a" and third.delivery_count == 3
        assert available(c) == [b"b"]


def test_the_rollback_of_a_prepared_branch_survives_a_crash(curdir: Path) -> None:
    """The coordinator forgets a rolled-back transaction once the rollback returns, so the
    cursor's ``R`` of a prepared branch must be on disk by then: a crash right after must not
    bring the branch back prepared, its message held, with no one left to ask about it."""
    with Cursor(curdir) as c:
        feed(c, b"a")
    script = textwrap.dedent(
        f"""
        import os
        from coordinator import Xid
        from resource_managers.cursor import Cursor, CursorResource
        c = Cursor({str(curdir)!r})
        cr = CursorResource(c)
        xid = Xid.branch_of("node-1:rb-1", cr.name)
        assert cr.start(xid).receive("orders", timeout=0).body == b"a"
        assert cr.prepare(xid).value == "commit"
        cr.rollback(xid)
        os._exit(0)  # no close: a crash as far as the cursor can tell
        """
    )
    subprocess.run([sys.executable, "-c", script], cwd=REPO, check=True)
    with Cursor(curdir) as c:
        assert c.prepared_gids() == [] and available(c) == [b"a"]
        assert [d.delivery_count for d in c.available("orders")] == [1]


def test_an_acknowledgment_never_runs_ahead_of_a_lazy_arrival(curdir: Path) -> None:
    """A forced delivery of duplicates acknowledges the stream's filter, which a lazy delivery
    on another connection may have advanced with an ``M`` not yet on disk (queued, its watch
    not yet set): the acknowledgment must wait for that ``M``, or the log would discard a
    message that a crash then takes from the cursor."""
    script = textwrap.dedent(
        f"""
        import os, threading, uuid
        from resource_managers.cursor import Cursor
        from resource_managers.message_log import Message
        from resource_managers.sequencing import Frame
        c = Cursor({str(curdir)!r}, lazy_delay=60.0)
        watch, queued, go = c._lazy.watch, threading.Event(), threading.Event()

        def late_watch(ticket, callback):
            queued.set()
            go.wait(10)  # the M is queued and applied; the watch comes later
            watch(ticket, callback)

        c._lazy.watch = late_watch
        m = Message(uuid.uuid4().hex, "orders", b"a", {{}})
        frame = Frame("orders", 7, 1, 0, m.message_id)
        lazy = threading.Thread(target=c.deliver_lazily, args=([(frame, m)], lambda acks: None))
        lazy.start()
        assert queued.wait(10)
        acks = c.deliver_many([(frame, m)])  # a resend on another connection: a duplicate
        print(acks[0].seq)
        os._exit(0)  # the log would now discard message 1; a crash as far as the cursor knows
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "1"
    with Cursor(curdir) as c:
        assert available(c) == [b"a"]  # acknowledged, so it must be here


def test_an_arrival_that_failed_to_write_stops_the_cursor_until_reopened(curdir: Path) -> None:
    """A lazy ``M`` is applied when queued: the message is available and the stream's filter has
    moved before the write. That write fails (no space, cut back): no acknowledgment may report
    that filter and no delivery of the message may commit, so the cursor refuses every write
    until reopened; the reopened cursor has neither the message nor its filter (the log, never
    acknowledged, sends it again)."""
    script = textwrap.dedent(
        f"""
        import errno, os, threading, uuid
        from coordinator import Xid
        from coordinator.errors import LogWriteError
        from resource_managers.cursor import Cursor, CursorResource
        from resource_managers.message_log import Message
        from resource_managers.sequencing import Frame
        from tests.support.faulty_ops import FaultyOps
        ops = FaultyOps()
        c = Cursor({str(curdir)!r}, lazy_delay=60.0, file_ops=ops)
        ops.write_errno = errno.ENOSPC  # the next write, once
        sent = []
        m = Message(uuid.uuid4().hex, "orders", b"a", {{}})
        c.deliver_lazily([(Frame("orders", 7, 1, 0, m.message_id), m)], sent.append)
        try:
            c._journal.flush()
        except LogWriteError:
            print("failed")
        n = Message(uuid.uuid4().hex, "orders", b"b", {{}})
        for attempt in ("deliver", "receive"):
            try:
                if attempt == "deliver":
                    c.deliver_many([(Frame("orders", 7, 2, 1, n.message_id), n)])
                else:
                    cr = CursorResource(c)
                    xid = Xid.branch_of("node-1:r-1", cr.name)
                    cr.start(xid).receive("orders", timeout=0)
                    cr.end(xid)
                    cr.commit(xid, one_phase=True)
                print(attempt, "returned")
            except LogWriteError as exc:
                print(attempt, "refused" if "until reopened" in str(exc) else exc)
        print("acks", len(sent), c.stats().refusing_writes)
        os._exit(0)  # no close: a crash as far as the cursor can tell
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [
        "failed",
        "deliver",
        "refused",
        "receive",
        "refused",
        "acks",
        "0",
        "True",
    ]
    with Cursor(curdir) as c:
        assert available(c) == [] and not c.stats().refusing_writes


def prepared_on_a_faulty_disk(curdir: Path, gtrid: str) -> tuple[Cursor, FaultyOps, str]:
    """A cursor whose writes fail on demand, holding one prepared branch of ``gtrid``."""
    ops = FaultyOps()
    c = Cursor(curdir, file_ops=ops, lazy_delay=60.0)
    feed(c, b"a")
    gid = Xid.branch_of(gtrid, "cursor").to_gid()
    assert c.take(gid, "orders") is not None
    c.prepare(gid)
    return c, ops, gid


def test_a_lazy_commit_that_failed_to_write_is_never_reported_committed(curdir: Path) -> None:
    """The lazy ``C`` of a prepared branch fails to write: the branch is still prepared on disk.
    Recovery's commit (and a repeated phase two) must fail rather than return, or the
    coordinator would forget a decision the cursor does not hold; the reopened cursor has the
    branch prepared, and its commit then holds."""
    c, ops, gid = prepared_on_a_faulty_disk(curdir, "node-1:lazy-1")
    ops.write_errno = errno.ENOSPC
    durable: list[int] = []
    c.commit_lazily(gid, lambda: durable.append(1))
    with pytest.raises(LogWriteError, match="No space"):  # its flush writes the C: no space
        c.commit(gid)  # recovery's, the decision being commit
    with pytest.raises(LogWriteError, match="until reopened"):
        c.commit_lazily(gid, lambda: durable.append(2))
    assert durable == [] and c.prepared_gids() == [gid]
    c.close()
    with Cursor(curdir) as c:
        assert c.prepared_gids() == [gid]
        c.commit(gid)
        assert c.prepared_gids() == [] and available(c) == []


def test_a_commit_racing_a_lazy_commit_of_the_branch_returns_only_once_durable(
    curdir: Path,
) -> None:
    """Recovery's commit and a lazy phase-two commit of one branch at once: whichever way they
    interleave, the commit returns only once a ``C`` is on disk. Here the lazy ``C`` lands
    after the commit read the branch; its own forced ``C`` then carries it, and fails with it
    (no space), so the commit raises and the reopened cursor has the branch prepared."""
    c, ops, gid = prepared_on_a_faulty_disk(curdir, "node-1:race-1")
    read, go = threading.Event(), threading.Event()

    class Blocking(dict[str, Any]):
        def get(self, key: str, default: Any = None) -> Any:  # after commit read the branch
            read.set()
            go.wait(10)
            return super().get(key, default)

    staged, c._staged = c._staged, Blocking(c._staged)
    outcome: list[str] = []

    def recovery_commit() -> None:
        try:
            c.commit(gid)
            outcome.append("returned")
        except LogWriteError:
            outcome.append("refused")

    thread = threading.Thread(target=recovery_commit)
    thread.start()
    assert read.wait(10)
    c._staged = staged
    ops.write_errno = errno.ENOSPC  # the lazy C's write, whoever makes it
    c.commit_lazily(gid, lambda: outcome.append("durable"))
    go.set()
    thread.join(10)
    assert outcome == ["refused"]
    c.close()
    with Cursor(curdir) as c:
        assert c.prepared_gids() == [gid]


def test_past_max_deliveries_the_message_moves_to_the_dead_letter_queue(
    curdir: Path, managers: list[TransactionManager]
) -> None:
    with Cursor(curdir) as c:
        cr = CursorResource(c, max_deliveries=3)
        feed(c, b"poison", b"fine")
        tm = make_manager(managers, [cr])
        deliveries = [received(tm, cr, fail=True) for _ in range(3)]
        assert [(d.body, d.delivery_count) for d in deliveries if d is not None] == [
            (b"poison", 1), (b"poison", 2), (b"poison", 3),
        ]  # fmt: skip
        assert available(c) == [b"fine"]
        [dead] = c.available("orders.DLQ")
        assert dead.body == b"poison" and dead.delivery_count == 3
        assert dead.reason is not None and "max_deliveries 3" in dead.reason
    with Cursor(curdir) as c:  # the move is durable, and the DLQ is a queue like any other
        cr = CursorResource(c, max_deliveries=3)
        tm = make_manager(managers, [cr])
        with tm.transaction() as tx:
            got = tx.join(cr).receive("orders.DLQ")
        assert got is not None and got.body == b"poison" and got.queue == "orders.DLQ"
        assert got.reason is not None and c.available("orders.DLQ") == []


def test_consume_with_postgresql_exactly_once(
    cursor: Cursor, make_pg_database: Callable[[], str], managers: list[TransactionManager]
) -> None:
    """Each message updates PostgreSQL in the consuming transaction; a failing database branch
    rolls the receipt back and the message comes again, redelivered, and commits once."""
    engine = ledger_engine(make_pg_database())
    try:
        db, cr = PostgresResource(engine, "db"), CursorResource(cursor)
        tm = make_manager(managers, [db, cr])
        feed(cursor, b"t1", b"t2")
        with engine.begin() as conn:  # t2's insert will collide once
            conn.execute(sa.text("INSERT INTO transfers VALUES ('t2', 0)"))
        seen: list[tuple[bytes, int]] = []
        for _ in range(3):
            try:
                with tm.transaction() as tx:
                    delivery = tx.join(cr).receive("orders")
                    assert delivery is not None
                    seen.append((delivery.body, delivery.delivery_count))
                    move(tx.join(db), delivery.body.decode(), 1, 10)
            except sa.exc.IntegrityError:
                with engine.begin() as conn:
                    conn.execute(sa.text("DELETE FROM transfers WHERE id = 't2'"))
        assert seen == [(b"t1", 1), (b"t2", 1), (b"t2", 2)]
        assert transfer_ids(engine) == {"t1", "t2"} and prepared_gids(engine) == []
        cursor.flush_commits()  # a lazy commit record counts as prepared until it is on disk
        assert cursor.stats().available == 0 and cursor.prepared_gids() == []
    finally:
        engine.dispose()


# -- crashes ---------------------------------------------------------------------------------------

KILLED_CONSUMER = textwrap.dedent(
    """
    import os, signal, sys
    from coordinator import Xid
    from resource_managers.cursor import Cursor, CursorResource
    cr = CursorResource(Cursor(sys.argv[1]))
    got = cr.start(Xid.branch_of(sys.argv[2], cr.name)).receive("orders")
    print(got.body.decode(), got.delivery_count, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # a poison message: the handler takes the process down
    """
)


def test_delivery_counts_survive_kill_9_and_a_poison_message_reaches_the_dlq(
    curdir: Path,
) -> None:
    with Cursor(curdir) as c:
        feed(c, b"poison")
    seen = []
    for attempt in range(5):
        done = subprocess.run(
            [sys.executable, "-c", KILLED_CONSUMER, str(curdir), f"node-1:kill-{attempt}"],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == -9, done.stderr
        seen.append(done.stdout.split())
    assert seen == [["poison", str(n)] for n in range(1, 6)]
    with Cursor(curdir) as c:  # the fifth dead branch, rolled back at this open, hit the limit
        assert c.available("orders") == []
        [dead] = c.available("orders.DLQ")
        assert dead.body == b"poison" and dead.delivery_count == 5


def test_a_prepared_branch_survives_reopen_and_recovery_finishes_it(
    curdir: Path, tmp_path: Path, managers: list[TransactionManager]
) -> None:
    with Cursor(curdir) as c:
        cr = CursorResource(c)
        feed(c, b"decided", b"orphan", b"rest")
        for gtrid in ("node-1:old-1", "node-1:old-2"):
            xid = Xid.branch_of(gtrid, cr.name)
            assert cr.start(xid).receive("orders") is not None
            assert cr.prepare(xid) == Vote.COMMIT
        assert available(c) == [b"rest"]
    with FileDecisionLog(tmp_path / "dlog") as dlog:
        dlog.log_commit(Decision("node-1:old-1", ("cursor",)))
    with Cursor(curdir) as c:
        cr = CursorResource(c)
        assert len(cr.recover()) == 2 and available(c) == [b"rest"]
        make_manager(managers, [cr], FileDecisionLog(tmp_path / "dlog"))  # recovers on start
        assert cr.recover() == []
        assert available(c) == [b"orphan", b"rest"]  # presumed abort: available again
        [orphan, _] = c.available("orders")
        assert orphan.delivery_count == 1
        late = Xid.branch_of("node-1:old-2", cr.name)  # the orphan's tombstone
        with pytest.raises(BranchRolledBack):
            cr.start(late).receive("orders")
        with pytest.raises(TransactionRolledBack):
            cr.prepare(late)
        cr.forget(late)
        assert c.stats().tombstones == 0


# -- concurrency -----------------------------------------------------------------------------------


def test_competing_consumers_never_get_the_same_message(
    cursor: Cursor, managers: list[TransactionManager]
) -> None:
    cr = CursorResource(cursor)
    tm = make_manager(managers, [cr])
    sent = feed(cursor, *(b"m%03d" % i for i in range(60)))
    got: list[list[tuple[str, bool]]] = [[] for _ in range(4)]

    def consume(me: int) -> None:
        while True:
            with tm.transaction() as tx:
                delivery = tx.join(cr).receive("orders", timeout=0.2)
                if delivery is None:
                    return
                got[me].append((delivery.message_id, delivery.redelivered))

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    everything = [mid for mine in got for mid, _ in mine]
    assert sorted(everything) == sorted(m.message_id for m in sent)  # each once, none lost
    assert not any(redelivered for mine in got for _, redelivered in mine)
    order = {m.message_id: i for i, m in enumerate(sent)}
    for mine in got:  # each consumer sees the stream in order
        assert [order[mid] for mid, _ in mine] == sorted(order[mid] for mid, _ in mine)
    assert cursor.stats().available == 0 and cursor.stats().in_flight == 0


def test_streams_accept_concurrently_each_in_order(cursor: Cursor) -> None:
    streams = [f"s{i}" for i in range(4)]
    threads = [threading.Thread(target=feed, args=(cursor, *(b"%d" % n for n in range(25))),
                                kwargs={"stream": s}) for s in streams]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for s in streams:
        assert available(cursor, s) == [b"%d" % n for n in range(25)]
        assert cursor.ack_for(s) == Ack(s, 7, 25)


# -- the journal -----------------------------------------------------------------------------------


def test_rollover_carries_messages_counts_branches_and_filter(
    curdir: Path, managers: list[TransactionManager]
) -> None:
    with Cursor(curdir, segment_bytes=4096) as c:
        cr = CursorResource(c, max_deliveries=2)
        tm = make_manager(managers, [cr])
        feed(c, *(b"x%02d" % i for i in range(40)))
        for _ in range(2):
            received(tm, cr, fail=True)  # x00 to the DLQ
        for _ in range(10):
            received(tm, cr)  # x01..x10 consumed
        received(tm, cr, fail=True)  # x11 counted once
        xid = Xid.branch_of("node-1:held", cr.name)
        assert cr.start(xid).receive("orders") is not None  # x11 again (count 2), prepared
        assert cr.prepare(xid) == Vote.COMMIT
        feed(c, *(b"y%02d" % i for i in range(20)))
        assert c.stats().rollovers > 0
    with Cursor(curdir, segment_bytes=4096) as c:
        cr = CursorResource(c, max_deliveries=2)
        assert cr.recover() == [xid]
        assert [d.body for d in c.available("orders.DLQ")] == [b"x00"]
        bodies = available(c)
        assert bodies[:2] == [b"x12", b"x13"] and len(bodies) == 28 + 20
        assert c.filter_state()["streams"]["orders"] == {"epoch": 7, "last": 60}
        assert cr.rollback(xid) is None  # its second delivery: to the DLQ, behind x00
        assert [(d.body, d.delivery_count) for d in c.available("orders.DLQ")] == [
            (b"x00", 2), (b"x11", 2),
        ]  # fmt: skip


def test_a_corrupt_segment_refuses_to_open(curdir: Path) -> None:
    with Cursor(curdir) as c:
        feed(c, b"one", b"two", b"three")
    [segment] = curdir.glob("*.seg")
    data = bytearray(segment.read_bytes())
    at = data.find(b'"k":"M"', data.find(b'"k":"M"') + 1)  # the second accepted message
    assert at > 0
    data[at] ^= 0x01
    segment.write_bytes(bytes(data))
    with pytest.raises(LogCorruptionError):
        Cursor(curdir)
    assert os.path.exists(segment)


# -- kill -9 at the consumer's commit, lazy and forced --------------------------------------------

CONSUMER_WORKER = Path(__file__).resolve().parents[1] / "crash" / "cursor_worker.py"
#: (crash point, worker flags, whether the third transaction commits). The cursor's commit
#: record is lazy unless --durable-commit: the early points lose it in the kill and recovery
#: commits the branch again from the decision (the decision log's COMMIT record, or with --llr
#: the database's decision row); the later ones die once it is on disk, before the decision ends.
#: With --llr the cursor's branch rides the database's commit unless --no-carry: these rows are
#: the prepared path; `test_cursor_carried.py` kills the carried one.
PREPARED_LLR = ("--llr", "--no-carry")
CONSUMER_KILLS = [
    ("cursor.cursor.after_prepare", (), False),
    ("cursor.cursor.after_prepare", PREPARED_LLR, False),
    ("cursor.cursor.after_commit", ("--durable-commit",), True),
    ("cursor.cursor.after_lazy_commit", (), True),
    ("cursor.cursor.after_lazy_commit", PREPARED_LLR, True),
    ("tm.end_deferred", PREPARED_LLR, True),
    ("cursor.cursor.commit_durable", (), True),
    ("cursor.cursor.commit_durable", PREPARED_LLR, True),
    ("tm.before_deferred_end", PREPARED_LLR, True),
]


def consumer_worker(
    mode: str, url: str, tmp: Path, flags: tuple[str, ...], crash_at: str = ""
) -> subprocess.CompletedProcess[str]:
    argv = ["--db", url, "--log", str(tmp / "dlog"), "--cursor", str(tmp / "cursor"), *flags]
    return run_script(CONSUMER_WORKER, [mode, *argv, "--count", "5"], crash_at=crash_at)


@pytest.mark.parametrize(
    ("point", "flags", "commits"),
    CONSUMER_KILLS,
    ids=[f"{p}{' ' + ' '.join(f) if f else ''}" for p, f, _ in CONSUMER_KILLS],
)
def test_consumed_exactly_once_after_kill_at_each_crash_point(
    point: str,
    flags: tuple[str, ...],
    commits: bool,
    make_pg_database: Callable[[], str],
    tmp_path: Path,
) -> None:
    url = make_pg_database()
    ledger_engine(url, accounts=1).dispose()
    bodies = [f"m{i}" for i in range(8)]
    with Cursor(tmp_path / "cursor") as c:
        feed(c, *(b.encode() for b in bodies))
    crashed = consumer_worker("run", url, tmp_path, flags, crash_at=f"{point}:3")
    assert crashed.returncode == -9, crashed.stderr
    acked = [line.split()[1] for line in crashed.stdout.splitlines() if line.startswith("ACK")]
    assert acked in (["m0", "m1"], ["m0", "m1", "m2"]), acked
    done = consumer_worker("recover", url, tmp_path, flags)
    assert done.returncode == 0, done.stderr
    [line] = [x for x in done.stdout.splitlines() if x.startswith("STATE ")]
    state = json.loads(line[len("STATE ") :])
    assert state["prepared"] == []  # no in-doubt residue
    consumed = ["m0", "m1", "m2"] if commits else ["m0", "m1"]
    assert state["rows"] == consumed  # exactly once, and every acknowledged one
    # the rest is still there, in order (a rolled-back m2 back at the head)
    assert state["available"] == [b for b in bodies if b not in consumed]
