"""PostgresResource as a logging last resource against real servers: the decision row commits
with the branch in one server commit, recovery reads and fences it, the rows are cleaned up.
Crashes with ``kill -9`` live in tests/crash (the ``llr`` scenarios of the PostgreSQL matrix)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import text

from coordinator import (
    CompletionPending,
    FileDecisionLog,
    Outcome,
    OutcomeUnknownError,
    TransactionManager,
    TransactionRolledBack,
    Xid,
)
from coordinator.decision_log import Decision
from coordinator.errors import FencedError
from resource_managers.message_log import MessageLog, MessageLogResource
from resource_managers.postgres import PostgresResource
from tests.support.flaky_resource import FlakyResource
from tests.support.managers import make_manager
from tests.support.pg import ledger_engine, move, on_driver, prepared_gids, total, transfer_ids


@dataclass
class Pair:
    """Database a (a two-phase branch) and database last (the last resource)."""

    engines: tuple[sa.Engine, sa.Engine]
    a: PostgresResource
    last: PostgresResource

    def rows(self) -> dict[str, str]:
        with self.engines[1].connect() as conn:
            found = conn.execute(text("SELECT gtrid, outcome FROM twopc_decision_row"))
            return {str(g): str(o) for g, o in found}


@pytest.fixture
def pair(make_pg_database: Callable[[], str], pg_driver: str) -> Iterator[Pair]:
    engines = tuple(ledger_engine(on_driver(make_pg_database(), pg_driver)) for _ in "ab")
    yield Pair(
        engines,
        PostgresResource(engines[0], "a"),
        PostgresResource(engines[1], "last", last_resource=True),
    )
    for engine in engines:
        engine.dispose()


def transfer(tx: object, pair: Pair, tid: str) -> None:
    move(tx.join(pair.a), tid, 1, -10)  # type: ignore[attr-defined]
    move(tx.join(pair.last), tid, 1, 10)  # type: ignore[attr-defined]


def test_the_decision_commits_with_the_branch_in_one_round_trip(
    pair: Pair, managers: list[TransactionManager], tmp_path: Path
) -> None:
    log = FileDecisionLog(tmp_path / "log")
    tm = make_manager(managers, [pair.a, pair.last], log)
    with tm.transaction() as tx:
        transfer(tx, pair, "t1")
    assert total(pair.engines[0]) + total(pair.engines[1]) == 8000
    assert "t1" in transfer_ids(pair.engines[0]) and "t1" in transfer_ids(pair.engines[1])
    assert pair.rows() == {tx.gtrid: "c"}
    stats = log.stats()
    assert stats.forced_records == stats.lazy_records == 0  # the decision log is untouched
    with tm.transaction() as tx2:  # the ended row goes with the next commit, no extra trip
        transfer(tx2, pair, "t2")
    assert pair.rows() == {tx2.gtrid: "c"}
    tm.recover()
    assert pair.rows() == {}
    assert prepared_gids(pair.engines[0]) == []


def test_a_last_resource_needs_no_prepared_transactions(
    make_pg_database: Callable[[], str], private_pg: Callable[..., object]
) -> None:
    """The last resource never prepares, so a server with max_prepared_transactions = 0 (most
    managed databases) can be one."""
    server = private_pg(max_prepared_transactions=0)  # type: ignore[call-arg]
    engine = ledger_engine(str(server.url(server.create_database())))  # type: ignore[attr-defined]
    last = PostgresResource(engine, "last", last_resource=True)
    other = PostgresResource(ledger_engine(make_pg_database()), "a")
    with pytest.raises(Exception, match="max_prepared_transactions"):
        PostgresResource(engine, "plain").start(Xid.branch_of("n0:x-1", "plain"))
    xid = Xid.branch_of("n0:x-1", "last")
    move(last.start(xid), "t", 1, 5)
    last.commit_with_decision(xid, Decision("n0:x-1", ("a",)))
    assert "t" in transfer_ids(engine)
    other.engine.dispose()
    engine.dispose()


def test_a_failed_last_commit_rolls_back_the_prepared_branch(
    pair: Pair, managers: list[TransactionManager]
) -> None:
    tm = make_manager(managers, [pair.a, pair.last])
    tx = tm.begin()
    move(tx.join(pair.a), "t1", 1, -10)
    session = tx.join(pair.last)
    session.execute(text("INSERT INTO transfers (id, amount) VALUES ('t1', 1)"))
    session.execute(text("UPDATE accounts SET balance = balance + 10 WHERE id = 1"))
    with pytest.raises(sa.exc.IntegrityError):  # a duplicate key: the branch is doomed
        session.execute(text("INSERT INTO transfers (id, amount) VALUES ('t1', 1)"))
    with pytest.raises(TransactionRolledBack):
        tx.commit()
    assert total(pair.engines[0]) == total(pair.engines[1]) == 4000
    assert prepared_gids(pair.engines[0]) == [] and pair.rows() == {}


def test_recovery_commits_from_the_row_and_fences_the_rest(
    pair: Pair, managers: list[TransactionManager]
) -> None:
    flaky_a = FlakyResource(pair.a, fail_on={"commit"})
    tm = make_manager(managers, [flaky_a, pair.last])
    tx = tm.begin()
    transfer(tx, Pair(pair.engines, flaky_a, pair.last), "t1")  # type: ignore[arg-type]
    with pytest.warns(CompletionPending):
        assert tx.commit() == Outcome.COMMIT_PENDING
    assert len(prepared_gids(pair.engines[0])) == 1
    flaky_a.fail_on.clear()
    report = tm.recover(force=True)
    assert report.committed == [tx.gtrid]
    assert total(pair.engines[0]) + total(pair.engines[1]) == 8000
    assert prepared_gids(pair.engines[0]) == []

    # an orphan of an earlier incarnation, no decision anywhere: presumed aborted and fenced
    gtrid = "node-1:old-1"
    branch = Xid.branch_of(gtrid, "a")
    move(pair.a.start(branch), "t2", 1, -10)
    pair.a.prepare(branch)
    late = Xid.branch_of(gtrid, "last")
    move(pair.last.start(late), "t2", 1, 10)
    report = tm.recover(force=True)
    assert report.rolled_back == [branch.to_gid()]
    assert pair.rows()[gtrid] == "a"
    with pytest.raises(FencedError):  # the late commit hits recovery's abort row
        pair.last.commit_with_decision(late, Decision(gtrid, ("a",)))
    assert "t2" not in transfer_ids(pair.engines[1])
    assert total(pair.engines[0]) + total(pair.engines[1]) == 8000


class LosesTheAnswer(PostgresResource):
    """Commits, then reports the connection lost (the reply never came)."""

    def commit_with_decision(self, xid: Xid, decision: Decision) -> None:
        super().commit_with_decision(xid, decision)
        raise OutcomeUnknownError("connection lost (injected after the commit)", gtrid=xid.gtrid)


def test_an_unknown_outcome_is_settled_by_reading_the_table(
    pair: Pair, managers: list[TransactionManager]
) -> None:
    last = LosesTheAnswer(pair.engines[1], "last", last_resource=True)
    tm = make_manager(managers, [pair.a, last])
    tx = tm.begin()
    move(tx.join(pair.a), "t1", 1, -10)
    move(tx.join(last), "t1", 1, 10)
    with pytest.raises(OutcomeUnknownError):
        tx.commit()
    assert len(prepared_gids(pair.engines[0])) == 1
    report = tm.recover()  # the live manager: the row decides, not a guess
    assert report.committed == [tx.gtrid]
    assert total(pair.engines[0]) + total(pair.engines[1]) == 8000


def test_recovery_defers_while_the_last_database_is_down(
    pair: Pair, managers: list[TransactionManager]
) -> None:
    gtrid = "node-1:old-2"
    branch = Xid.branch_of(gtrid, "a")
    move(pair.a.start(branch), "t3", 1, -10)
    pair.a.prepare(branch)
    broken = PostgresResource(
        sa.create_engine("postgresql+psycopg2://nobody@127.0.0.1:1/none"),
        "last",
        last_resource=True,
    )
    tm = make_manager(managers, [pair.a, broken], recover_on_start=False)
    report = tm.recover(force=True)
    assert report.failures and not report.rolled_back
    assert len(prepared_gids(pair.engines[0])) == 1  # never presumed aborted
    tm2 = make_manager(managers, [pair.a, pair.last], node_id="node-1", recover_on_start=False)
    assert tm2.recover(force=True).rolled_back == [branch.to_gid()]


# -- carried branches (coordinator.carried) ------------------------------------------------------


def test_a_message_log_branch_rides_the_commit_with_no_forced_record(
    pair: Pair, managers: list[TransactionManager], tmp_path: Path
) -> None:
    """The log's staged messages travel in the decision row; the log writes one lazy record,
    remembers the gid until the row's deletion has committed, then forgets it."""
    mlog = MessageLog(tmp_path / "mlog", lazy_delay=60.0)
    try:
        mr = MessageLogResource(mlog)
        tm = make_manager(managers, [pair.last, mr], FileDecisionLog(tmp_path / "log"))
        forced = mlog.stats().forced_records
        with tm.transaction() as tx:
            move(tx.join(pair.last), "t1", 1, 10)
            tx.join(mr).send("orders", b"m1")
        assert mlog.stats().forced_records == forced  # no prepare, no forced commit
        with pair.engines[1].connect() as conn:
            row = conn.execute(
                text("SELECT carried_names, carried FROM twopc_decision_row WHERE gtrid = :g"),
                {"g": tx.gtrid},
            ).one()
        assert list(row[0]) == ["mlog"] and b"m1" not in bytes(row[1][0])  # the body is base64
        assert mlog.pending("orders") == []  # visible once the lazy record is durable
        mr.flush_commits()
        assert [m.body for _, m in mlog.pending("orders")] == [b"m1"]
        first = Xid.branch_of(tx.gtrid, "mlog").to_gid()
        assert mr.carried_gids() == {first}
        with tm.transaction() as tx2:  # its commit deletes the first row, then the log forgets
            move(tx2.join(pair.last), "t2", 1, 10)
            tx2.join(mr).send("orders", b"m2")
        mr.flush_commits()
        assert mr.carried_gids() == {Xid.branch_of(tx2.gtrid, "mlog").to_gid()}
        assert set(pair.rows()) == {tx2.gtrid}
        assert tm.recover(force=True).clean  # nothing to restore: every gid is remembered
        assert [m.body for _, m in mlog.pending("orders")] == [b"m1", b"m2"]
        assert pair.rows() == {} and mr.carried_gids() == set()
    finally:
        tm.close()
        mlog.close()


def test_a_decision_table_from_before_carried_branches_gets_their_columns(
    make_pg_database: Callable[[], str], pg_driver: str
) -> None:
    engine = ledger_engine(on_driver(make_pg_database(), pg_driver))
    try:
        with engine.begin() as conn:  # the table as earlier versions created it
            conn.execute(
                text(
                    "CREATE TABLE twopc_decision_row (gtrid text PRIMARY KEY, node_id text NOT "
                    "NULL, outcome text NOT NULL CHECK (outcome IN ('c', 'a')), branches text[] "
                    "NOT NULL DEFAULT '{}', written_at timestamptz NOT NULL DEFAULT now())"
                )
            )
        assert PostgresResource(engine, "last", last_resource=True).carries_branches()
        with engine.connect() as conn:
            columns = conn.execute(
                text(
                    "SELECT column_name FROM information_schema.columns "
                    "WHERE table_name = 'twopc_decision_row' ORDER BY column_name"
                )
            ).scalars()
            assert {"carried", "carried_names"} <= set(columns)
            # its payloads kept out of line uncompressed, and the node epoch table made
            storage = conn.execute(
                text(
                    "SELECT attstorage FROM pg_attribute WHERE attname = 'carried' "
                    "AND attrelid = to_regclass('twopc_decision_row')"
                )
            ).scalar_one()
            assert storage == "e"
            assert conn.execute(text("SELECT to_regclass('twopc_decision_row_epoch')")).scalar()
    finally:
        engine.dispose()


def test_a_recovery_pass_with_a_stale_row_restores_nothing_twice(
    pair: Pair, managers: list[TransactionManager], tmp_path: Path
) -> None:
    """A pass read the remembered gids while X's record was still in memory, then X's row; X
    then became durable, its row went with a later commit and its forget came while the pass
    still held the row it read: the forget waits for the pass (`ForgetGate`), so the restore
    finds X remembered and applies nothing twice."""
    mlog = MessageLog(tmp_path / "mlog", lazy_delay=60.0)
    try:
        mr = MessageLogResource(mlog)
        tm = make_manager(managers, [pair.last, mr], FileDecisionLog(tmp_path / "log"))
        with tm.transaction() as tx:
            move(tx.join(pair.last), "t1", 1, 10)
            tx.join(mr).send("orders", b"x")
        x = Xid.branch_of(tx.gtrid, "mlog")
        gate = tm._runtime.forget_gate
        with gate.holding():  # the pass, from its first read to its last restore
            assert x.to_gid() not in mr.carried_gids()  # still in memory: not remembered
            [payload] = pair.last.carried_of("node-1")[tx.gtrid].values()
            mr.flush_commits()  # X durable; its row's deletion queued for the next commit
            with tm.transaction() as tx2:  # deletes X's row; X's forget now waits
                move(tx2.join(pair.last), "t2", 1, 10)
                tx2.join(mr).send("orders", b"y")
            assert tx.gtrid not in pair.rows()
            mr.restore_carried(x, payload)  # the pass acts on the row it read
        mr.flush_commits()
        assert [m.body for _, m in mlog.pending("orders")] == [b"x", b"y"]
        assert x.to_gid() not in mr.carried_gids()  # forgotten once the pass let go
    finally:
        tm.close()
        mlog.close()
