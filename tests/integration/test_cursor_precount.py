"""Pre-counted deliveries (`resource_managers.cursor._precount`): a consumer's forced ``P``,
one-phase ``C`` or ``H`` raises the counts of the next never-delivered messages, so their
receives force nothing; a count is never low (a credit is used only once its record is
durable, and never survives a reset), high by at most one after a restart; old journals replay
unchanged."""

from __future__ import annotations

import errno
import threading
import uuid
from pathlib import Path

import pytest

from coordinator import FileDecisionLog, LogWriteError, TransactionManager
from coordinator.journal import OsFileOps
from resource_managers.cursor import Cursor, CursorResource, subscription_queue
from resource_managers.message_log import Message
from resource_managers.sequencing import Frame
from tests.integration.test_topics import TOPIC, pub, publish, run
from tests.support.file_resource import FileResource
from tests.support.managers import make_manager


def feed(c: Cursor, n: int, queue: str = "orders", **kw: object) -> list[str]:
    """Accept ``n`` messages ``1``..``n`` into ``queue``; their ids, in order."""
    ids = []
    last = c.ack_for(queue).seq
    for _ in range(n):
        m = Message(uuid.uuid4().hex, queue, str(last + 1).encode(), **kw)  # type: ignore[arg-type]
        c.deliver(Frame(queue, 1, last + 1, last, m.message_id), m)
        ids.append(m.message_id)
        last += 1
    return ids


def forced(c: Cursor) -> int:
    return c.stats().forced_records


def test_one_forced_record_per_message_one_phase(tmp_path: Path, managers: list) -> None:
    """At one message per transaction with the cursor alone each message costs only its
    one-phase ``C``: the first was pre-counted at arrival (the queue was empty), each later one
    by the commit before it."""
    with Cursor(tmp_path / "c") as c:
        feed(c, 20)
        cr = CursorResource(c)
        tm = make_manager(managers, [cr])
        before = forced(c)
        for _ in range(20):
            with tm.transaction() as tx:
                d = tx.join(cr).receive("orders")
                assert d is not None and d.delivery_count == 1 and not d.redelivered
        assert forced(c) - before == 20


@pytest.mark.parametrize("lazy_commit", [True, False])
def test_two_phase_forces_only_the_prepare_per_message(tmp_path: Path, lazy_commit: bool) -> None:
    """Two-phase (a file resource in the same transaction): the ``P`` and, unless the commit
    record is lazy, the ``C``; never an ``H`` after the first receive."""
    with Cursor(tmp_path / "c") as c:
        feed(c, 10)
        cr = CursorResource(c, lazy_commit=lazy_commit)
        files = FileResource("files", tmp_path / "files")
        tm = TransactionManager("m", FileDecisionLog(tmp_path / "log"), [cr, files],
                                recovery_interval=None, reaper_interval=None)  # fmt: skip
        try:
            before = forced(c)
            for _ in range(10):
                with tm.transaction() as tx:
                    d = tx.join(cr).receive("orders")
                    assert d is not None and d.delivery_count == 1
                    tx.join(files).add(d.body.decode(), 1)
            assert forced(c) - before == (1 if lazy_commit else 2) * 10
        finally:
            tm.close()


def test_precount_0_forces_an_h_per_receive(tmp_path: Path) -> None:
    with Cursor(tmp_path / "c", precount=0) as c:
        feed(c, 5)
        before = forced(c)
        for i in range(5):
            assert c.take(f"g{i}", "orders") is not None
            c.commit_one_phase(f"g{i}")
        assert forced(c) - before == 2 * 5


def test_max_deliveries_1_never_precounts(tmp_path: Path) -> None:
    """A credited delivery leaves no forced record naming its branch, so a crash in it would
    not be rolled back (and dead-lettered) at the next open: with one delivery allowed, every
    receive forces its ``H``."""
    with Cursor(tmp_path / "c", max_deliveries=1) as c:
        feed(c, 3)
        before = forced(c)
        for i in range(3):
            assert c.take(f"g{i}", "orders") is not None
            c.commit_one_phase(f"g{i}")
        assert forced(c) - before == 2 * 3


def test_counts_exact_while_open_and_after_a_clean_close(tmp_path: Path) -> None:
    """A clean close gives unused pre-counts back (a lazy ``G``): only a crash leaves a count
    one high (`tests/crash/test_precount.py`)."""
    with Cursor(tmp_path / "c") as c:
        first, second, third = feed(c, 3)
        d = c.take("g1", "orders")
        assert d is not None and d.message_id == first
        c.commit_one_phase("g1")  # pre-counts the second
        assert c.delivery_count(second) == 0  # pre-counted, not yet delivered
        d = c.take("g2", "orders")
        assert d is not None and d.message_id == second and d.delivery_count == 1
        c.commit_one_phase("g2")  # pre-counts the third
        assert [x.delivery_count for x in c.available("orders")] == [0]
    with Cursor(tmp_path / "c") as c:
        assert c.delivery_count(third) == 0
        before = forced(c)
        d = c.take("g3", "orders")
        assert d is not None and d.delivery_count == 1 and not d.redelivered
        assert forced(c) - before == 1  # no credit after a restart: its own forced H


def test_old_journals_replay_and_p_replays_raising_counts(tmp_path: Path) -> None:
    """A journal written without pre-counts (``H`` with ``c`` 1, as before) replays with the same
    counts; one written with them replays their raises whatever this cursor's ``precount``."""
    for precount in (0, 1):
        directory = tmp_path / f"c{precount}"
        with Cursor(directory, precount=precount) as c:
            ids = feed(c, 3)
            assert c.take("g1", "orders") is not None
            c.rollback("g1")
            assert c.take("g2", "orders") is not None
            c.prepare("g2")
        with Cursor(directory, precount=0) as c:
            counts = [c.delivery_count(i) for i in ids]
            # ids[0] delivered twice and prepared; ids[1]'s pre-count given back at the close
            assert counts == [2, 0, 0], precount
            assert c.prepared_gids() == ["g2"]


def test_a_redelivery_is_never_precounted(tmp_path: Path) -> None:
    """Only never-delivered messages are pre-counted, so a count is high by at most one however
    often a consumer crashes; a rolled-back message goes back without credit."""
    with Cursor(tmp_path / "c") as c:
        first, second = feed(c, 2)
        d = c.take("g1", "orders")
        assert d is not None and d.message_id == first
        c.rollback("g1")  # first back at the head, count 1, no credit
        d = c.take("g2", "orders")
        assert d is not None and d.message_id == first and d.delivery_count == 2
        c.rollback("g2")
        before = forced(c)
        d = c.take("g3", "orders")  # second is pre-counted, first is not: a forced H
        assert d is not None and d.delivery_count == 3 and forced(c) - before == 1
        c.commit_one_phase("g3")
        before = forced(c)
        d = c.take("g4", "orders")
        assert d is not None and d.message_id == second and d.delivery_count == 1
        assert forced(c) == before  # credited


def test_a_credited_message_rolled_back_is_counted_again(tmp_path: Path) -> None:
    with Cursor(tmp_path / "c") as c:
        _, second = feed(c, 2)
        assert c.take("g1", "orders") is not None
        c.commit_one_phase("g1")
        d = c.take("g2", "orders")
        assert d is not None and d.message_id == second and d.delivery_count == 1
        c.rollback("g2")
        before = forced(c)
        d = c.take("g3", "orders")
        assert d is not None and d.delivery_count == 2 and forced(c) - before == 1


def test_a_batch_precounts_the_next_batch(tmp_path: Path) -> None:
    """The window is at least what the branch took from the queue: a consumer taking 4 at a time
    forces no ``H`` after its first."""
    with Cursor(tmp_path / "c") as c:
        feed(c, 12)
        before = forced(c)
        for i in range(3):
            got = c.take_many(f"g{i}", "orders", 4)
            assert [d.delivery_count for d in got] == [1] * 4
            c.commit_one_phase(f"g{i}")
        assert forced(c) - before == 1 + 3


def test_replaying_a_dead_letter_drops_its_credit(tmp_path: Path) -> None:
    """A pre-counted message that expires moves to the dead-letter queue with its credit; a
    replay resets its count, and with it the credit: its next delivery is counted again."""
    now = [1_000_000]
    with Cursor(tmp_path / "c", clock_ms=lambda: now[0]) as c:
        feed(c, 1)
        (late,) = feed(c, 1, expires_at=now[0] + 1000)
        feed(c, 1)
        assert c.take("g1", "orders") is not None
        c.commit_one_phase("g1")  # pre-counts the expiring one
        now[0] += 5000
        d = c.take("g2", "orders")  # the expired head moves to the DLQ on the way
        assert d is not None and d.message_id != late
        (dead,) = c.dead_letters("orders")
        assert dead.message_id == late and dead.delivery_count == 0  # its credit went with it
        c.commit_one_phase("g2")
        assert c.replay_dead_letters("orders") == 1
        assert c.delivery_count(late) == 0  # -1 had the credit outlived the reset


class BlockingOps(OsFileOps):
    """Real I/O whose fsync, once armed, waits for ``release`` (or fails with ``fail``)."""

    def __init__(self) -> None:
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail = False

    def fsync(self, fd: int) -> None:
        if self.armed:
            self.armed = False
            self.entered.set()
            self.release.wait(10)
            if self.fail:
                raise OSError(errno.EIO, "injected")
        super().fsync(fd)


def _pending_credit(tmp_path: Path) -> tuple[Cursor, BlockingOps, list[str]]:
    """A cursor where g1's prepare is writing its ``P`` (fsync blocked) which pre-counts the
    fourth message; the first three are held by g1, g2, g3."""
    ops = BlockingOps()
    c = Cursor(tmp_path / "c", file_ops=ops)
    ids = feed(c, 4)
    assert c.take("g1", "orders") is not None  # pre-counted at arrival (an empty queue)
    assert c.take("g2", "orders") is not None  # its forced H pre-counts the third
    assert c.take("g3", "orders") is not None  # credited
    return c, ops, ids


@pytest.mark.parametrize("fail", [False, True])
def test_a_receive_waits_for_the_record_that_precounted(tmp_path: Path, fail: bool) -> None:
    """A receive that finds a credit whose record is still being written waits for it (it forces
    nothing itself); if that record fails, the receive fails too and the message is not out."""
    c, ops, ids = _pending_credit(tmp_path)
    ops.armed, ops.fail = True, fail
    errors: list[BaseException] = []

    def prepare() -> None:
        try:
            c.prepare("g1")
        except LogWriteError as exc:
            errors.append(exc)

    preparer = threading.Thread(target=prepare)
    preparer.start()
    assert ops.entered.wait(10)
    got: list[object] = []

    def receive() -> None:
        try:
            got.append(c.take("g4", "orders"))
        except LogWriteError as exc:
            got.append(exc)

    receiver = threading.Thread(target=receive)
    receiver.start()
    receiver.join(0.3)
    assert receiver.is_alive() and not got, "handed out before its count was durable"
    before = forced(c)
    ops.release.set()
    preparer.join(10)
    receiver.join(10)
    if fail:
        assert len(errors) == 1 and isinstance(got[0], LogWriteError)
        assert c.available("orders")[0].message_id == ids[3]
    else:
        d = got[0]
        assert not errors and getattr(d, "message_id", None) == ids[3]
        assert getattr(d, "delivery_count", None) == 1 and forced(c) == before
    # failed, the journal refuses writes until reopened; the close logs what it could not write
    assert c.stats().refusing_writes is fail
    c.close()


@pytest.mark.parametrize("precount", [1, 4])
def test_competing_consumers_each_message_once_counted_once(
    tmp_path: Path, managers: list, precount: int
) -> None:
    """Four consumers race for one queue, one message per transaction, their commits pre-counting
    what the others are about to take: every message is handed out once, with a count of 1 (a
    pre-count and a forced H never both raise a message), and receives forced fewer records."""
    with Cursor(tmp_path / "c", precount=precount) as c:
        feed(c, 200)
        cr = CursorResource(c)
        tm = make_manager(managers, [cr])
        seen: list[tuple[bytes, int]] = []
        lock = threading.Lock()
        before = forced(c)

        def consume() -> None:
            while True:
                with tm.transaction() as tx:
                    d = tx.join(cr).receive("orders")
                    if d is None:
                        return
                    with lock:
                        seen.append((d.body, d.delivery_count))

        threads = [threading.Thread(target=consume) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(b for b, _ in seen) == sorted(str(i).encode() for i in range(1, 201))
        assert {n for _, n in seen} == {1}
        assert forced(c) - before < 2 * 200  # without pre-counts: an H and a C each
        assert c.stats().available == 0


def test_subscription_queues_are_precounted_per_copy(tmp_path: Path) -> None:
    """A topic copy is keyed ``<id>@<subscription queue>``: pre-counting one subscriber's copies
    raises nothing in another's, and is given back at a clean close like a queue's."""
    s1, s2 = subscription_queue(TOPIC, "s1"), subscription_queue(TOPIC, "s2")
    with Cursor(tmp_path / "c") as c:
        c.subscribe(TOPIC, "s1")
        c.subscribe(TOPIC, "s2")
        publish(c, pub("p0-0"), pub("p0-1"), pub("p0-2"))
        run(c)
        assert c.take("g1", s1) is not None  # forced H, pre-counts p0-1@s1
        c.commit_one_phase("g1")  # pre-counts p0-2@s1
        before = forced(c)
        d = c.take("g2", s1)
        assert d is not None and d.message_id == "p0-1" and d.delivery_count == 1
        assert forced(c) == before
        c.commit_one_phase("g2")
    with Cursor(tmp_path / "c") as c:
        assert [x.delivery_count for x in c.available(s1)] == [0]  # pre-count given back
        assert [x.delivery_count for x in c.available(s2)] == [0, 0, 0]
