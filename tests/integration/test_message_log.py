"""The message log (capture side) against a real PostgreSQL branch and its own journal: what a
commit publishes and in which order, what a rollback or a crash leaves, recovery, tombstones,
compaction by acknowledgment, non-persistent messages, and bad input."""

from __future__ import annotations

import errno
import functools
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
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
from coordinator.journal import Journal
from resource_managers.message_log import (
    BranchRolledBack,
    DestinationFullError,
    InvalidMessageError,
    Message,
    MessageLog,
    MessageLogResource,
    ProducerBranch,
)
from resource_managers.message_log._records import decode, to_message
from resource_managers.postgres import PostgresResource
from tests.support.faulty_ops import FaultyOps
from tests.support.managers import make_manager
from tests.support.pg import ledger_engine, move, prepared_gids, transfer_ids
from tests.support.scripts import run_script

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def engine(make_pg_database: Callable[[], str]) -> Iterator[sa.Engine]:
    engine = ledger_engine(make_pg_database())
    yield engine
    engine.dispose()


@pytest.fixture
def logdir(tmp_path: Path) -> Path:
    return tmp_path / "mlog"


@pytest.fixture
def mlog(logdir: Path) -> Iterator[MessageLog]:
    log = MessageLog(logdir)
    yield log
    log.close()


def bodies(log: MessageLog, stream: str) -> list[tuple[int, bytes]]:
    """The visible messages, once every lazy commit record is on disk (a transaction's messages
    become visible a moment after its commit returns: `MessageLog.commit_lazily`)."""
    log.flush_commits()
    return [(seq, m.body) for seq, m in log.pending(stream)]


def produce(tm: TransactionManager, db: PostgresResource, mr: MessageLogResource, tid: str) -> str:
    with tm.transaction() as tx:
        move(tx.join(db), tid, 1, 10)
        branch: ProducerBranch = tx.join(mr)
        return branch.send("orders", tid.encode(), headers={"tid": tid})


def prepared(resource: MessageLogResource, gtrid: str, *bodies_: bytes) -> Xid:
    xid = Xid.branch_of(gtrid, resource.name)
    branch = resource.start(xid)
    for body in bodies_:
        branch.send("orders", body)
    assert resource.prepare(xid) == Vote.COMMIT
    return xid


# -- capture inside a transaction with PostgreSQL ------------------------------------------------


def test_atomicity_commit_publishes_in_commit_order(
    engine: sa.Engine, mlog: MessageLog, managers: list[TransactionManager]
) -> None:
    db, mr = PostgresResource(engine, "db"), MessageLogResource(mlog)
    tm = make_manager(managers, [db, mr])
    ids = [produce(tm, db, mr, f"t{i}") for i in range(3)]
    assert bodies(mlog, "orders") == [(1, b"t0"), (2, b"t1"), (3, b"t2")]
    assert [m.message_id for _, m in mlog.pending("orders")] == ids
    assert len(set(ids)) == 3
    assert mlog.pending("orders")[0][1].headers == {"tid": "t0"}
    assert transfer_ids(engine) == {"t0", "t1", "t2"}
    assert prepared_gids(engine) == [] and mlog.prepared_gids() == []


def test_a_branch_over_carry_bytes_prepares_and_one_within_rides(
    engine: sa.Engine, mlog: MessageLog, managers: list[TransactionManager]
) -> None:
    """With a PostgreSQL last resource, a branch whose bodies exceed ``carry_bytes`` prepares
    (a forced ``P``; its decision row carries nothing) and a smaller one rides the row."""
    db = PostgresResource(engine, "db", last_resource=True)
    mr = MessageLogResource(mlog, carry_bytes=100)
    tm = make_manager(managers, [db, mr])
    for bodies_ in ([b"s" * 60], [b"b" * 60, b"c" * 60]):
        forced = mlog.stats().forced_records
        with tm.transaction() as tx:
            tx.join(db).execute(sa.text("INSERT INTO transfers (id, amount) VALUES (:t, 1)"),
                                {"t": bodies_[0].decode()[:1]})  # fmt: skip
            for body in bodies_:
                tx.join(mr).send("orders", body)
        with engine.connect() as conn:
            carried = conn.execute(sa.text(
                "SELECT cardinality(carried_names) FROM twopc_decision_row "
                "WHERE outcome = 'c' ORDER BY written_at DESC LIMIT 1"
            )).scalar_one()  # fmt: skip
        assert (mlog.stats().forced_records - forced, carried) == (
            (0, 1) if len(bodies_) == 1 else (1, 0)
        )
    assert [b for _, b in bodies(mlog, "orders")] == [b"s" * 60, b"b" * 60, b"c" * 60]
    assert transfer_ids(engine) == {"s", "b"} and mlog.prepared_gids() == []
    with pytest.raises(ProgrammingError):
        MessageLogResource(mlog, carry_bytes=-1)


def test_publish_listeners_hear_every_publish_and_cannot_fail_one(
    mlog: MessageLog, managers: list[TransactionManager], caplog: pytest.LogCaptureFixture
) -> None:
    """`on_publish`: called in the publishing thread once messages are visible; a listener that
    raises is logged and the commit stands; the returned function stops the calls."""
    heard: list[int] = []

    def broken() -> None:
        raise RuntimeError("a listener's own bug")

    stop = mlog.on_publish(lambda: heard.append(len(mlog.pending("orders"))))
    stop_broken = mlog.on_publish(broken)
    mr = MessageLogResource(mlog)
    tm = make_manager(managers, [mr])
    for body in (b"a", b"b"):
        with tm.transaction() as tx:
            tx.join(mr).send("orders", body)
    assert heard and heard[-1] == 2  # the last call saw both messages visible
    assert "a publish listener failed" in caplog.text
    stop()
    stop_broken()
    calls = len(heard)
    with tm.transaction() as tx:
        tx.join(mr).send("orders", b"c")
    assert len(heard) == calls
    assert bodies(mlog, "orders") == [(1, b"a"), (2, b"b"), (3, b"c")]


def test_atomicity_rollback_never_publishes(
    engine: sa.Engine, mlog: MessageLog, managers: list[TransactionManager]
) -> None:
    db, mr = PostgresResource(engine, "db"), MessageLogResource(mlog)
    tm = make_manager(managers, [db, mr])
    with pytest.raises(RuntimeError), tm.transaction() as tx:
        move(tx.join(db), "t1", 1, 10)
        tx.join(mr).send("orders", b"never")
        raise RuntimeError("the application changed its mind")
    produce(tm, db, mr, "t2")
    assert bodies(mlog, "orders") == [(1, b"t2")]
    assert transfer_ids(engine) == {"t2"}


def test_a_failing_database_branch_rolls_back_the_messages(
    engine: sa.Engine, mlog: MessageLog, managers: list[TransactionManager]
) -> None:
    db, mr = PostgresResource(engine, "db"), MessageLogResource(mlog)
    tm = make_manager(managers, [db, mr])
    with pytest.raises(sa.exc.IntegrityError), tm.transaction() as tx:
        tx.join(mr).send("orders", b"never")
        tx.join(db).execute(sa.text("INSERT INTO transfers VALUES ('dup', 1), ('dup', 2)"))
    assert mlog.pending("orders") == [] and mlog.prepared_gids() == []
    assert mlog.stats().tombstones == 1


def test_one_phase_and_read_only(mlog: MessageLog, managers: list[TransactionManager]) -> None:
    mr = MessageLogResource(mlog)
    tm = make_manager(managers, [mr])
    before = mlog.stats().forced_records
    with tm.transaction() as tx:
        branch = tx.join(mr)
        branch.send("a", b"1")
        branch.send("b", b"2")
        branch.send("a", b"3")
    assert mlog.stats().forced_records == before + 1  # prepare and commit in one forced record
    assert bodies(mlog, "a") == [(1, b"1"), (2, b"3")] and bodies(mlog, "b") == [(1, b"2")]
    xid = Xid.branch_of("node-1:ro-1", mr.name)
    mr.start(xid)
    assert mr.prepare(xid) == Vote.READ_ONLY


def test_concurrent_commits_are_numbered_without_gaps_and_in_order(
    mlog: MessageLog, managers: list[TransactionManager]
) -> None:
    mr = MessageLogResource(mlog)
    tm = make_manager(managers, [mr])
    seen: list[list[int]] = []

    def producer(n: int) -> None:
        for i in range(25):
            with tm.transaction() as tx:
                tx.join(mr).send("orders", f"{n}-{i}".encode())
            seen.append([seq for seq, _ in mlog.pending("orders")])

    threads = [threading.Thread(target=producer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [seq for seq, _ in mlog.pending("orders")] == list(range(1, 101))
    assert all(s == list(range(1, len(s) + 1)) for s in seen)  # every view is a gap-free prefix
    for n in range(4):  # each producer's order is kept within the stream
        mine = [m.body for _, m in mlog.pending("orders") if m.body.startswith(f"{n}-".encode())]
        assert mine == [f"{n}-{i}".encode() for i in range(25)]


# -- durability: reopen, recovery, tombstones ------------------------------------------------------


def test_a_reopened_log_sees_committed_unacked_and_prepared_only(logdir: Path) -> None:
    with MessageLog(logdir) as log:
        mr = MessageLogResource(log)
        committed = prepared(mr, "node-1:c-1", b"a", b"b")
        assert mr.commit(committed) is None
        open_xid = prepared(mr, "node-1:p-1", b"c")
        rolled = prepared(mr, "node-1:r-1", b"d")
        assert mr.rollback(rolled) is None
        epoch = log.epoch("orders")
    with MessageLog(logdir) as log:
        mr = MessageLogResource(log)
        assert bodies(log, "orders") == [(1, b"a"), (2, b"b")]
        assert log.epoch("orders") == epoch  # continuity proven by the journal: same epoch
        assert mr.recover() == [open_xid]
        assert mr.commit(open_xid) is None
        assert mr.commit(open_xid) is None  # idempotent
        assert bodies(log, "orders") == [(1, b"a"), (2, b"b"), (3, b"c")]
        assert mr.commit(rolled) == Outcome.HEURISTIC_ROLLBACK


def test_presumed_abort_recovery_commits_decided_and_rolls_back_orphan(
    engine: sa.Engine, tmp_path: Path, logdir: Path, managers: list[TransactionManager]
) -> None:
    db = PostgresResource(engine, "db")
    with MessageLog(logdir) as log:
        mr = MessageLogResource(log)
        for gtrid, tid in (("node-1:old-1", "t1"), ("node-1:old-2", "t2")):
            xid = Xid.branch_of(gtrid, db.name)
            move(db.start(xid), tid, 1 if tid == "t1" else 2, 10)
            assert db.prepare(xid) == Vote.COMMIT
            prepared(mr, gtrid, tid.encode())
    with FileDecisionLog(tmp_path / "dlog") as dlog:
        dlog.log_commit(Decision("node-1:old-1", ("db", "mlog")))
    log = MessageLog(logdir)
    try:
        mr = MessageLogResource(log)
        assert len(mr.recover()) == 2
        make_manager(managers, [db, mr], FileDecisionLog(tmp_path / "dlog"))  # recovers on start
        assert bodies(log, "orders") == [(1, b"t1")]
        assert mr.recover() == [] and prepared_gids(engine) == []
        assert transfer_ids(engine) == {"t1"}
        orphan = Xid.branch_of("node-1:old-2", mr.name)
        late = mr.start(orphan)  # the orphan's tombstone refuses a late prepare
        late.send("orders", b"late")
        with pytest.raises(TransactionRolledBack):
            mr.prepare(orphan)
    finally:
        log.close()


def test_a_tombstone_refuses_a_late_prepare_until_forgotten(mlog: MessageLog) -> None:
    mr = MessageLogResource(mlog)
    xid = Xid.branch_of("node-1:x-1", mr.name)
    mr.start(xid).send("orders", b"x")
    assert mr.rollback(xid) is None  # e.g. the reaper, while the application still works
    assert mr.rollback(xid) is None  # idempotent
    with pytest.raises(IllegalStateError):  # the branch is gone
        mr.prepare(xid)
    mr.start(xid).send("orders", b"x")
    with pytest.raises(TransactionRolledBack):
        mr.prepare(xid)
    assert mr.commit(xid) == Outcome.HEURISTIC_ROLLBACK
    mr.forget(xid)
    assert mr.commit(xid) is None
    committed = prepared(mr, "node-1:x-2", b"y")
    mr.commit(committed)
    assert mr.rollback(committed) == Outcome.HEURISTIC_COMMIT
    assert bodies(mlog, "orders") == [(1, b"y")]


def test_acknowledgment_compacts_and_survives_reopen(logdir: Path) -> None:
    with MessageLog(logdir, segment_bytes=4096) as log:
        mr = MessageLogResource(log)
        for i in range(1, 57):
            mr.commit(prepared(mr, f"node-1:a-{i}", b"x" * 100))
            assert log.acknowledge("orders", log.epoch("orders"), i) == 1
            assert log.acknowledge("orders", log.epoch("orders"), i) == 0  # a repeat
        assert log.stats().rollovers > 0
        epoch = log.epoch("orders")
        assert log.acknowledge("orders", epoch + 1, 100) == 0  # another epoch: ignored
        assert log.acknowledge("orders", epoch, 10_000) == 0  # beyond what is visible: ignored
        assert log.pending("orders") == []
        mr.commit(prepared(mr, "node-1:b-1", b"last"))
        assert bodies(log, "orders") == [(57, b"last")]
        files = sum(f.stat().st_size for f in logdir.iterdir())
    assert files < 3 * 4096
    with MessageLog(logdir, segment_bytes=4096) as log:
        assert bodies(log, "orders") == [(57, b"last")]
        assert log.epoch("orders") == epoch
        assert log.acknowledge("orders", epoch, 57) == 1
    with MessageLog(logdir) as log:
        assert log.pending("orders") == []
        mr = MessageLogResource(log)
        mr.commit(prepared(mr, "node-1:b-2", b"next"))
        assert bodies(log, "orders") == [(58, b"next")]  # numbers never go back


def crashed(script: str) -> str:
    """Run ``script`` (one that ends in ``os._exit``: a crash as far as the log can tell) in a
    process of its own; what it printed."""
    return subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout


def test_non_persistent_messages_skip_fsync_and_vanish_in_a_crash(logdir: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os
        from coordinator import Xid
        from resource_managers.message_log import MessageLog, MessageLogResource
        log = MessageLog({str(logdir)!r})
        mr = MessageLogResource(log)
        xid = Xid.branch_of("node-1:np-1", mr.name)
        mr.start(xid).send("news", b"gone", persistent=False)
        before = log.stats()
        assert mr.prepare(xid).value == "commit"
        assert mr.commit(xid) is None
        after = log.stats()
        assert (after.fsyncs, after.forced_records) == (before.fsyncs, before.forced_records)
        assert [m.body for _, m in log.pending("news#np")] == [b"gone"]
        print(log.epoch("news#np"))
        os._exit(0)  # no close: a crash as far as the log can tell
        """
    )
    old_epoch = int(crashed(script))
    with MessageLog(logdir) as log:
        assert log.pending("news#np") == [] and log.prepared_gids() == []
        mr = MessageLogResource(log)
        xid = Xid.branch_of("node-1:np-2", mr.name)
        mr.start(xid).send("news", b"new", persistent=False)
        mr.prepare(xid)
        mr.commit(xid)
        assert log.epoch("news#np") > old_epoch  # a new epoch: the cursor never confuses them
        assert bodies(log, "news#np") == [(1, b"new")]


def test_the_rollback_of_a_prepared_branch_survives_a_crash(logdir: Path) -> None:
    """The coordinator forgets a rolled-back transaction once the rollback returns, so the log's
    tombstone of a prepared branch must be on disk by then: a crash right after must not bring
    the branch back prepared with no one left to ask about it. An unprepared branch's may be
    lost (the crash loses the branch too)."""
    script = textwrap.dedent(
        f"""
        import os
        from coordinator import Xid
        from resource_managers.message_log import MessageLog, MessageLogResource
        log = MessageLog({str(logdir)!r})
        mr = MessageLogResource(log)
        xid = Xid.branch_of("node-1:rb-1", mr.name)
        mr.start(xid).send("orders", b"never")
        assert mr.prepare(xid).value == "commit"
        mr.rollback(xid)
        os._exit(0)  # no close: a crash as far as the log can tell
        """
    )
    crashed(script)
    with MessageLog(logdir) as log:
        assert log.prepared_gids() == [] and log.pending("orders") == []
        assert log.stats().tombstones == 1


def test_a_rollback_racing_the_prepares_fsync_is_forced_too(logdir: Path) -> None:
    """A rollback that arrives while the branch's ``P`` is being written (a remote client's,
    after its prepare timed out) must force its tombstone as well: the ``P`` may reach disk
    before the rollback is decided, and a lazy tombstone queued after it would be lost."""
    script = textwrap.dedent(
        f"""
        import os, threading
        from coordinator import Xid
        from resource_managers.message_log import Message, MessageLog
        log = MessageLog({str(logdir)!r})
        journal, append = log._journal, log._journal.append
        in_fsync, go = threading.Event(), threading.Event()

        def held_append(payload, force=True):
            append(payload, force)
            if payload.startswith(b'{{"k":"P"'):
                in_fsync.set()
                go.wait(10)  # on disk, not yet applied: the rollback comes now

        journal.append = held_append
        gid = Xid.branch_of("node-1:race-1", "mlog").to_gid()
        votes = []

        def prepare():
            try:
                log.prepare(gid, [Message("m1", "orders", b"x")])
                votes.append("commit")
            except Exception as exc:
                votes.append(type(exc).__name__)

        thread = threading.Thread(target=prepare)
        thread.start()
        assert in_fsync.wait(10)
        log.rollback(gid)
        go.set()
        thread.join()
        print(votes[0])
        os._exit(0)  # no close: a crash as far as the log can tell
        """
    )
    assert crashed(script).strip() == "BranchRolledBack"
    with MessageLog(logdir) as log:
        assert log.prepared_gids() == [] and log.stats().tombstones == 1


def test_a_tombstone_that_failed_to_write_stops_the_log_until_reopened(logdir: Path) -> None:
    """The forced ``R`` of a prepared branch fails to write (no space; the write is cut back):
    the tombstone is in memory, not on disk. Nothing may be written on top of that, and no retry
    of the coordinator's may succeed, or a crash would bring the branch back with nobody left to
    ask: the log refuses writes until reopened, and the reopened log has the branch prepared
    again (the coordinator's recovery rolls it back, presumed abort)."""
    script = textwrap.dedent(
        f"""
        import errno, os
        from coordinator import Xid
        from coordinator.errors import LogWriteError
        from resource_managers.message_log import Message, MessageLog
        from tests.support.faulty_ops import FaultyOps
        ops = FaultyOps()
        log = MessageLog({str(logdir)!r}, lazy_delay=60.0, file_ops=ops)
        gid = Xid.branch_of("node-1:full-1", "mlog").to_gid()
        log.prepare(gid, [Message("m1", "orders", b"x")])
        ops.write_errno = errno.ENOSPC  # the next write, once
        for attempt in ("first", "retry"):
            try:
                log.rollback(gid)
                print(attempt, "returned")
            except LogWriteError as exc:
                print(attempt, "refused" if "until reopened" in str(exc) else "failed")
        print(log.stats().refusing_writes)
        os._exit(0)  # no close: a crash as far as the log can tell
        """
    )
    assert crashed(script).split() == ["first", "failed", "retry", "refused", "True"]
    gid = Xid.branch_of("node-1:full-1", "mlog").to_gid()
    with MessageLog(logdir) as log:
        assert log.prepared_gids() == [gid] and log.stats().tombstones == 0
        assert not log.stats().refusing_writes
        log.rollback(gid)
        assert log.prepared_gids() == [] and log.pending("orders") == []


def test_a_lazy_commit_that_failed_to_write_is_never_reported_committed(logdir: Path) -> None:
    """The lazy ``C`` of a prepared branch fails to write: the branch is still prepared on disk.
    Recovery's commit, a repeated phase two and a restore from a decision row must fail rather
    than return, or the coordinator would forget a decision the log does not hold (and the
    other branches' messages would go out without these)."""
    ops = FaultyOps()
    log = MessageLog(logdir, file_ops=ops, lazy_delay=60.0)
    gid = Xid.branch_of("node-1:lazy-1", "mlog").to_gid()
    log.prepare(gid, [Message("m1", "orders", b"x")])
    ops.write_errno = errno.ENOSPC
    durable: list[int] = []
    log.commit_lazily(gid, lambda: durable.append(1))
    with pytest.raises(LogWriteError, match="No space"):  # its flush writes the C: no space
        log.commit(gid)
    with pytest.raises(LogWriteError, match="until reopened"):
        log.commit_lazily(gid, lambda: durable.append(2))
    assert durable == [] and log.pending("orders") == []
    log.close()
    with MessageLog(logdir) as log:
        assert log.prepared_gids() == [gid]
        log.commit(gid)
        assert bodies(log, "orders") == [(1, b"x")]


def test_a_rollback_between_a_prepares_write_and_its_return_holds_nothing_back(
    logdir: Path,
) -> None:
    """A rollback lands after the branch's ``P`` is applied and before the prepare returns (it
    then refuses): the messages held against their destination's limit are released exactly
    once, so the limit neither drifts below zero nor admits more than it should."""
    with MessageLog(logdir, max_destination_messages=2) as log:
        gid = Xid.branch_of("node-1:held-1", "mlog").to_gid()
        append = log._append

        def then_rollback(records: list[dict[str, Any]], force: bool) -> None:
            append(records, force)
            if records[0]["k"] == "P":
                log.rollback(gid)

        log._append = then_rollback  # type: ignore[method-assign,assignment]
        with pytest.raises(BranchRolledBack):
            log.prepare(gid, [Message("m1", "orders", b"x")])
        log._append = append  # type: ignore[method-assign]
        log.check_room("orders", 2)
        with pytest.raises(DestinationFullError):
            log.check_room("orders", 3)


# -- bad input -----------------------------------------------------------------------------------


def test_bad_input_is_refused_at_send_and_stages_nothing(logdir: Path) -> None:
    with MessageLog(logdir, max_message_bytes=1000, max_destination_messages=2) as log:
        mr = MessageLogResource(log)
        xid = Xid.branch_of("node-1:bad-1", mr.name)
        branch = mr.start(xid)
        with pytest.raises(InvalidMessageError, match="exceeds the limit of 1000"):
            branch.send("orders", b"x" * 1001)
        for bad in ("", "has space", "#np", "../etc", "x" * 201, 7):
            with pytest.raises(InvalidMessageError, match="invalid destination"):
                branch.send(bad, b"x")  # type: ignore[arg-type]
        with pytest.raises(InvalidMessageError):
            branch.send("orders", "text")  # type: ignore[arg-type]
        with pytest.raises(InvalidMessageError):
            branch.send("orders", b"x", headers={"k": 1})  # type: ignore[dict-item]
        with pytest.raises(InvalidMessageError):
            branch.send("orders", b"x", ttl=-1)
        branch.send("orders", b"1")
        branch.send("orders", b"2")
        with pytest.raises(DestinationFullError, match="limit is 2"):
            branch.send("orders", b"3")
        assert len(branch.messages) == 2
        assert mr.prepare(xid) == Vote.COMMIT
        other = mr.start(Xid.branch_of("node-1:bad-2", mr.name))
        with pytest.raises(DestinationFullError):
            other.send("orders", b"4")  # prepared messages count too
        mr.commit(xid)
        with pytest.raises(DestinationFullError):
            other.send("orders", b"4")
        log.acknowledge("orders", log.epoch("orders"), 1)
        other.send("orders", b"4")


def test_a_corrupt_segment_refuses_to_open(logdir: Path) -> None:
    with MessageLog(logdir) as log:
        mr = MessageLogResource(log)
        for i in range(5):
            mr.commit(prepared(mr, f"node-1:c-{i}", b"payload-%d" % i))
    [segment] = logdir.glob("*.seg")
    data = bytearray(segment.read_bytes())
    at = data.find(b'"k":"P"', data.find(b'"k":"P"') + 1)  # the second prepare record
    assert at > 0
    data[at] ^= 0x01
    segment.write_bytes(bytes(data))
    with pytest.raises(LogCorruptionError):
        MessageLog(logdir)
    assert os.path.exists(segment)


# -- kill -9 at every message log crash point ------------------------------------------------------

WORKER = REPO / "tests" / "crash" / "mlog_worker.py"


def worker(
    mode: str,
    url: str,
    tmp: Path,
    *,
    crash_at: str = "",
    start: int = 0,
    flags: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    argv = ["--db", url, "--log", str(tmp / "dlog"), "--mlog", str(tmp / "mlog"), *flags]
    return run_script(
        WORKER, [mode, *argv, "--count", "5", "--start", str(start)], crash_at=crash_at
    )


LLR = ("--llr",)  # the log's branch rides the database's commit (`coordinator.carried`)
PREPARED_LLR = ("--llr", "--no-carry")  # the log's branch prepares before that commit
FORCED = ("--durable-commit",)
#: (crash point, worker flags, whether the third transaction commits). The log's commit record
#: is lazy unless FORCED: the first rows lose it in the kill, and recovery must commit the
#: branch again from the decision (the decision log's COMMIT record, or with LLR the database's
#: decision row); the later ones die after it is on disk but before the decision is forgotten.
#: With LLR the row also holds the carried messages: a kill before the log's record is durable
#: leaves them only there (recovery restores them), one after it leaves them in both (recovery
#: must not restore them twice: the log remembers the gid).
KILLS = [
    ("mlog.mlog.after_prepare", (), False),
    ("mlog.mlog.after_prepare", PREPARED_LLR, False),
    ("mlog.mlog.after_append", FORCED, True),
    ("mlog.mlog.after_commit", FORCED, True),
    ("mlog.mlog.after_lazy_commit", (), True),
    ("mlog.mlog.after_lazy_commit", PREPARED_LLR, True),
    ("tm.end_deferred", (), True),
    ("tm.end_deferred", LLR, True),
    ("tm.end_deferred", PREPARED_LLR, True),
    ("mlog.mlog.commit_durable", (), True),
    ("mlog.mlog.commit_durable", PREPARED_LLR, True),
    ("tm.before_deferred_end", (), True),
    ("tm.before_deferred_end", LLR, True),
    ("tm.before_deferred_end", PREPARED_LLR, True),
    ("tm.carried.after_stage", LLR, False),
    ("tm.llr.before_commit", LLR, False),
    ("tm.llr.after_commit", LLR, True),
    ("mlog.mlog.after_carried_commit", LLR, True),
    ("mlog.mlog.carried_durable", LLR, True),
    ("mlog.mlog.carried_durable", (*LLR, *FORCED), True),
]


@pytest.mark.parametrize(
    ("point", "flags", "commits"),
    KILLS,
    ids=[f"{p}{' ' + ' '.join(f) if f else ''}" for p, f, _ in KILLS],
)
def test_exactly_once_after_kill_at_each_crash_point(
    point: str,
    flags: tuple[str, ...],
    commits: bool,
    make_pg_database: Callable[[], str],
    tmp_path: Path,
) -> None:
    url = make_pg_database()
    ledger_engine(url, accounts=1).dispose()
    killed = worker("run", url, tmp_path, crash_at=f"{point}:3", flags=flags)
    assert killed.returncode == -9, killed.stderr
    acked = [line.split()[1] for line in killed.stdout.splitlines() if line.startswith("ACK")]
    # a point reached after the commit returned (a durability callback) may follow m2's ACK
    assert acked in (["m0", "m1"], ["m0", "m1", "m2"]), acked
    state = recovered(url, tmp_path, flags)
    bodies_ = [body for _, body in state["pending"]]
    assert state["prepared"] == []  # no in-doubt residue
    assert bodies_ == state["rows"]  # atomicity: a message exactly where its row is, once
    assert [seq for seq, _ in state["pending"]] == list(range(1, len(bodies_) + 1))
    # the third transaction: presumed abort before the decision, committed after it
    expected = ["m0", "m1", "m2"] if commits else ["m0", "m1"]
    assert bodies_ == expected
    assert set(acked) <= set(bodies_)  # every acknowledged commit is there
    assert state["remembered"] == [] and state["decision_rows"] == 0  # nothing left behind
    again = worker("run", url, tmp_path, start=10, flags=flags)
    assert again.returncode == 0, again.stderr
    state = recovered(url, tmp_path, flags)  # the log went on numbering after the crash, no gap
    expected += [f"m{i}" for i in range(10, 15)]
    assert state["pending"] == [[seq, body] for seq, body in enumerate(expected, 1)]


@pytest.mark.parametrize("lost", [True, False], ids=["record lost", "record durable"])
def test_a_carried_branch_is_restored_once_across_a_kill_in_recovery(
    lost: bool, make_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    """The database committed m2 with the log's branch in its decision row; recovery restores
    the messages (where the log's record was lost) and is killed right after: the next recovery
    finds the gid remembered and restores nothing twice."""
    url = make_pg_database()
    ledger_engine(url, accounts=1).dispose()
    point = "tm.llr.after_commit:3" if lost else "mlog.mlog.carried_durable:3"
    killed = worker("run", url, tmp_path, crash_at=point, flags=LLR)
    assert killed.returncode == -9, killed.stderr
    killed = worker("recover", url, tmp_path, crash_at="recovery.carried.after_restore", flags=LLR)
    assert killed.returncode == (-9 if lost else 0), killed.stderr  # nothing to restore if kept
    state = recovered(url, tmp_path, LLR)
    assert state["pending"] == [[1, "m0"], [2, "m1"], [3, "m2"]]
    assert state["rows"] == ["m0", "m1", "m2"]
    assert state["remembered"] == [] and state["decision_rows"] == 0


def test_a_kill_before_the_log_forgets_a_carried_commit_leaves_nothing(
    make_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    """The decision row's deletion committed (with a later transaction's commit), the log has
    not forgotten the gid yet: recovery finds it remembered with no row, and forgets it."""
    url = make_pg_database()
    ledger_engine(url, accounts=1).dispose()
    killed = worker("run", url, tmp_path, crash_at="tm.carried.before_forget", flags=LLR)
    assert killed.returncode == -9, killed.stderr
    state = recovered(url, tmp_path, LLR)
    acked = [line.split()[1] for line in killed.stdout.splitlines() if line.startswith("ACK")]
    assert [body for _, body in state["pending"]] == state["rows"]
    assert set(acked) <= set(state["rows"]) and len(state["rows"]) == 2
    assert state["remembered"] == [] and state["decision_rows"] == 0


def recovered(url: str, tmp: Path, flags: tuple[str, ...] = ()) -> dict[str, Any]:
    done = worker("recover", url, tmp, flags=flags)
    assert done.returncode == 0, done.stderr
    [line] = [x for x in done.stdout.splitlines() if x.startswith("STATE ")]
    state: dict[str, Any] = json.loads(line[len("STATE ") :])
    return state


def test_expired_messages_leave_the_stream_for_good(logdir: Path) -> None:
    now = [1_000_000_000_000]
    with MessageLog(logdir, clock_ms=lambda: now[0]) as log:
        mr = MessageLogResource(log)
        xid = Xid.branch_of("node-1:e-1", mr.name)
        branch = mr.start(xid)
        branch.send("orders", b"short", ttl=1)
        branch.send("orders", b"long", ttl=60)
        branch.send("orders", b"never")
        mr.prepare(xid)
        mr.commit(xid)
        assert log.pending("orders")[0][1].expires_at == now[0] + 1000
        assert log.drop_expired("orders") == []
        now[0] += 2000
        assert [(n, m.body) for n, m in log.drop_expired("orders")] == [(1, b"short")]
        assert bodies(log, "orders") == [(2, b"long"), (3, b"never")]
    with MessageLog(logdir) as log:
        assert bodies(log, "orders") == [(2, b"long"), (3, b"never")]


def test_a_prepare_racing_a_rollback_votes_no(logdir: Path) -> None:
    """The tombstone lands between the resource's check and the prepare record: no yes vote."""
    with MessageLog(logdir) as log:
        mr = MessageLogResource(log)
        xid = Xid.branch_of("node-1:race-1", mr.name)
        branch = mr.start(xid)
        branch.send("orders", b"x")
        log.rollback(xid.to_gid())  # recovery's presumed abort, as if it ran just now
        with pytest.raises(BranchRolledBack):
            log.prepare(xid.to_gid(), branch.messages)
    with MessageLog(logdir) as log:
        assert log.prepared_gids() == [] and log.pending("orders") == []


def test_remembered_carried_commits_survive_compaction_until_forgotten(logdir: Path) -> None:
    """A carried commit's gid outlives every rollover (``K``) until ``forget_carried``: only
    then may recovery restore a payload without duplicating it (`coordinator.carried`)."""
    with MessageLog(logdir, segment_bytes=4096) as log:
        mr = MessageLogResource(log)
        gids = []
        for i in range(40):  # enough 1 KiB messages for several rollovers
            xid = Xid.branch_of(f"node-1:c-{i}", mr.name)
            mr.start(xid).send("orders", b"x" * 1024)
            payload = mr.stage(xid)
            assert payload is not None
            done: list[bool] = []
            mr.commit_carried(xid, payload, functools.partial(done.append, True))
            log.flush_commits()
            assert done == [True]
            gids.append(xid.to_gid())
        assert log.stats().rollovers > 0
        assert mr.carried_gids() == set(gids)
        # a repeat (the row read again) restores nothing
        mr.restore_carried(Xid.from_gid(gids[-1]), payload)
        assert len(log.pending("orders")) == 40
        mr.forget_carried(gids[:30])
    with MessageLog(logdir, segment_bytes=4096) as log:
        mr = MessageLogResource(log)
        assert mr.carried_gids() == set(gids[30:])
        assert [seq for seq, _ in log.pending("orders")] == list(range(1, 41))


def test_a_staged_branch_rolled_back_leaves_no_trace(logdir: Path) -> None:
    with MessageLog(logdir, max_destination_messages=1) as log:
        mr = MessageLogResource(log)
        xid = Xid.branch_of("node-1:s-1", mr.name)
        mr.start(xid).send("orders", b"x")
        assert mr.stage(xid) is not None
        with pytest.raises(DestinationFullError):  # the staged message counts against the limit
            mr.start(Xid.branch_of("node-1:s-2", mr.name)).send("orders", b"y")
        assert mr.rollback(xid) is None
        assert not log.is_tombstoned(xid.to_gid()) and log.prepared_gids() == []
        mr.start(Xid.branch_of("node-1:s-3", mr.name)).send("orders", b"z")  # room again


def test_a_carried_commit_record_reuses_the_payload_and_carries_forgets(logdir: Path) -> None:
    """The ``1`` record is spliced from the staged payload's bytes: it must decode to exactly
    the record the state applies, and the forgets waiting for a record ride it (``f``)."""
    with MessageLog(logdir) as log:
        mr = MessageLogResource(log)
        first = Xid.branch_of("node-1:f-1", mr.name)
        mr.start(first).send("orders", b"one", headers={"h": "\u00e9"})
        mr.commit_carried(first, mr.stage(first) or b"", lambda: None)
        log.flush_commits()
        mr.forget_carried([first.to_gid()])
        assert mr.carried_gids() == set()  # pending: not reported, written with the next record
        second = Xid.branch_of("node-1:f-2", mr.name)
        mr.start(second).send("orders", b"two")
        mr.commit_carried(second, mr.stage(second) or b"", lambda: None)
        log.flush_commits()
    payloads: list[bytes] = []
    Journal(logdir, replay=payloads.append, kind="message-log").close()  # read every record
    records = [decode(p) for p in payloads]
    ones = [r for r in records if r["k"] == "1"]
    assert [r["g"] for r in ones] == [first.to_gid(), second.to_gid()]
    assert ones[1]["f"] == [first.to_gid()] and ones[1]["r"] == 1
    assert [to_message(m).body for r in ones for m in r["m"]] == [b"one", b"two"]
    with MessageLog(logdir) as log:  # replay: the forget rode the second commit
        assert MessageLogResource(log).carried_gids() == {second.to_gid()}


def journal_records(logdir: Path) -> list[dict[str, Any]]:
    payloads: list[bytes] = []
    Journal(logdir, replay=payloads.append, kind="message-log").close()
    return [decode(p) for p in payloads]


def test_a_prepare_too_large_for_one_record_is_written_in_parts(
    logdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the part size a branch's prepare is several ``P`` records (each but the last with
    ``more``), written as one group: replay prepares the branch at its last part, in order, and
    a rollover carries it split again; parts whose last never reached the journal (a crash in
    between) prepare nothing."""
    from resource_managers.message_log import _records

    monkeypatch.setattr(_records, "PART_BYTES", 2_000)  # about four 300-byte messages a part
    payloads = [b"%03d" % i + b"p" * 300 for i in range(40)]
    with MessageLog(logdir, segment_bytes=8192) as log:
        mr = MessageLogResource(log)
        big = prepared(mr, "node-1:big-1", *payloads)
    parts = [r for r in journal_records(logdir) if r["k"] == "P"]
    assert (
        len(parts) > 5 and all(r.get("more") == 1 for r in parts[:-1]) and "more" not in parts[-1]
    )
    with MessageLog(logdir, segment_bytes=8192) as log:
        mr = MessageLogResource(log)
        assert mr.recover() == [big]
        for i in range(30):  # enough traffic for rollovers, which carry the prepared branch
            mr.commit(prepared(mr, f"node-1:o-{i}", b"o" * 400))
        assert log.stats().rollovers > 0
    with MessageLog(logdir, segment_bytes=8192) as log:
        mr = MessageLogResource(log)
        assert mr.recover() == [big]
        assert mr.commit(big) is None
        assert [body for _, body in bodies(log, "orders")][-40:] == payloads
    # a crash between parts: every part but the last is in the journal
    torn = _records.prepare_records(
        "node-1:torn-1",
        [
            _records.message_obj(m)
            for m in (
                _records.Message(f"id-{i}", "orders", body, {}) for i, body in enumerate(payloads)
            )
        ],
    )
    journal = Journal(logdir, replay=lambda _: None, kind="message-log")
    journal.append_many([_records.encode(r) for r in torn[:-1]])
    journal.close()
    with MessageLog(logdir, segment_bytes=8192) as log:
        assert MessageLogResource(log).recover() == []
        assert log.prepared_gids() == []
