"""PostgresResource against a real server: every protocol path, recovery, heuristics, isolation
between nodes, and the way connections are handled. Crashes with ``kill -9`` live in tests/crash."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
from sqlalchemy import text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from coordinator import (
    ConfigurationError,
    FileDecisionLog,
    HeuristicRollback,
    Outcome,
    TransactionManager,
    TransactionRolledBack,
    Vote,
    Xid,
)
from coordinator.decision_log import Decision
from coordinator.xid import sub_branch
from resource_managers.postgres import PostgresResource
from tests.support.flaky_resource import FlakyResource
from tests.support.managers import make_manager
from tests.support.pg import ledger_engine, move, on_driver, prepared_gids, total, transfer_ids


@dataclass
class Bank:
    """Two databases, each with a ledger, and a resource on each."""

    engines: tuple[sa.Engine, sa.Engine]
    a: PostgresResource
    b: PostgresResource

    def totals(self) -> tuple[int, int]:
        return total(self.engines[0]), total(self.engines[1])

    def prepared(self) -> list[str]:
        return prepared_gids(self.engines[0]) + prepared_gids(self.engines[1])


@pytest.fixture
def bank(make_pg_database: Callable[[], str], pg_driver: str) -> Iterator[Bank]:
    engines = tuple(ledger_engine(on_driver(make_pg_database(), pg_driver)) for _ in "ab")
    yield Bank(engines, PostgresResource(engines[0], "a"), PostgresResource(engines[1], "b"))
    for engine in engines:
        engine.dispose()


def transfer(tm: TransactionManager, bank: Bank, tid: str, amount: int = 10) -> None:
    with tm.transaction() as tx:
        move(tx.join(bank.a), tid, 1, -amount)
        move(tx.join(bank.b), tid, 1, amount)


# -- the protocol paths ------------------------------------------------------------------------


def test_two_phase_commit_across_two_databases(bank: Bank, managers: list) -> None:
    tm = make_manager(managers, [bank.a, bank.b])
    for i in range(3):
        transfer(tm, bank, f"t{i}")
    assert bank.totals() == (3970, 4030)
    assert transfer_ids(bank.engines[0]) == transfer_ids(bank.engines[1]) == {"t0", "t1", "t2"}
    assert bank.prepared() == []
    assert tm.metrics.as_dict()["outcome_committed"] == 3


def test_an_exception_rolls_back_both_databases(bank: Bank, managers: list) -> None:
    tm = make_manager(managers, [bank.a, bank.b])
    with pytest.raises(RuntimeError), tm.transaction() as tx:
        move(tx.join(bank.a), "t1", 1, -10)
        move(tx.join(bank.b), "t1", 1, 10)
        raise RuntimeError("the application changed its mind")
    assert bank.totals() == (4000, 4000)
    assert bank.prepared() == []


def test_a_reading_branch_votes_read_only_and_the_writer_commits_in_one_phase(
    bank: Bank, managers: list
) -> None:
    tm = make_manager(managers, [bank.a, bank.b])
    with tm.transaction() as tx:
        seen = tx.join(bank.a).execute(text("SELECT balance FROM accounts WHERE id = 1"))
        assert seen.scalar_one() == 1000
        move(tx.join(bank.b), "t1", 1, 5)
    assert bank.totals() == (4000, 4005)
    metrics = tm.metrics.as_dict()
    assert metrics.get("outcome_committed") == 1
    assert bank.prepared() == []


def test_a_read_only_function_call_is_not_mistaken_for_a_read(bank: Bank, managers: list) -> None:
    """A SELECT can write (a function, nextval): the server, not the statement text, decides."""
    with bank.engines[0].begin() as conn:
        conn.execute(text("CREATE SEQUENCE s"))
    xid = Xid.branch_of("node-1:x-1", "a")
    session = bank.a.start(xid)
    session.execute(text("SELECT nextval('s')"))
    assert bank.a.prepare(xid) == Vote.COMMIT
    bank.a.commit(xid)
    with bank.engines[0].connect() as conn:
        assert conn.execute(text("SELECT last_value FROM s")).scalar_one() == 1


def test_one_phase_commit_when_one_database_is_the_only_participant(
    bank: Bank, managers: list
) -> None:
    tm = make_manager(managers, [bank.a, bank.b])
    with tm.transaction() as tx:
        move(tx.join(bank.a), "t1", 2, 7)
    assert bank.totals() == (4007, 4000)
    assert tm.metrics.as_dict()["one_phase"] == 1
    with bank.engines[0].connect() as conn:  # no marker: a one-phase commit needs none
        assert conn.execute(text("SELECT to_regclass('twopc_outcome')")).scalar() is None or (
            conn.execute(text("SELECT count(*) FROM twopc_outcome")).scalar() == 0
        )


class Base(DeclarativeBase):
    pass


class Account(Base):
    __tablename__ = "accounts"
    id: Mapped[int] = mapped_column(primary_key=True)
    balance: Mapped[int]


def test_orm_and_core_through_the_joined_session(bank: Bank, managers: list) -> None:
    tm = make_manager(managers, [bank.a, bank.b])
    with tm.transaction() as tx:
        db = tx.join(bank.a)
        assert tx.join(bank.a) is db  # joining twice gives the same session
        account = db.get(Account, 1)
        assert account is not None
        account.balance -= 25  # ORM: flushed before prepare
        db.add(Account(id=99, balance=25))
        tx.join(bank.b).execute(sa.update(Account).where(Account.id == 2).values(balance=0))
    assert bank.totals() == (4000, 3000)
    with Session(bank.engines[0]) as check:
        assert check.get(Account, 99) is not None


def test_session_commit_inside_a_branch_only_flushes(bank: Bank, managers: list) -> None:
    tm = make_manager(managers, [bank.a, bank.b])
    with pytest.raises(RuntimeError), tm.transaction() as tx:
        db = tx.join(bank.a)
        move(db, "t1", 1, -10)
        db.commit()  # the application's habit; the branch is the transaction's, not the session's
        move(tx.join(bank.b), "t1", 1, 10)
        raise RuntimeError("abort after session.commit()")
    assert bank.totals() == (4000, 4000)


def test_session_rollback_dooms_the_branch(bank: Bank, managers: list) -> None:
    tm = make_manager(managers, [bank.a, bank.b])
    with pytest.raises(TransactionRolledBack, match="rolled back"), tm.transaction() as tx:
        db = tx.join(bank.a)
        move(db, "t1", 1, -10)
        db.rollback()
        move(tx.join(bank.b), "t1", 1, 10)
    assert bank.totals() == (4000, 4000)
    assert bank.prepared() == []


# -- the lean handles, and the BEGIN that rides with the first statement -------------------------


def test_the_core_connection_handle_commits_across_two_databases(
    bank: Bank, managers: list
) -> None:
    tm = make_manager(managers, [bank.a, bank.b])
    with tm.transaction() as tx:
        conn = bank.a.connection(tx)
        assert isinstance(conn, sa.Connection)
        assert bank.a.connection(tx) is conn  # the same branch, the same connection
        conn.execute(text("UPDATE accounts SET balance = balance - 5 WHERE id = 1"))
        raw = bank.b.dbapi_connection(tx)
        cursor = raw.cursor()
        cursor.execute("UPDATE accounts SET balance = balance + 5 WHERE id = 1")
        cursor.close()
    assert bank.totals() == (3995, 4005)
    assert bank.prepared() == []


def test_closing_the_core_handle_keeps_the_connection_with_the_branch(
    bank: Bank, managers: list
) -> None:
    """A ``with`` block around the handle must not give the branch's connection back to the pool
    (where another thread could get it) before the transaction ended."""
    tm = make_manager(managers, [bank.a, bank.b])
    pool = bank.engines[0].pool
    with tm.transaction() as tx:
        with bank.a.connection(tx) as conn:
            conn.execute(text("UPDATE accounts SET balance = balance - 5 WHERE id = 1"))
        assert pool.checkedout() == 1  # type: ignore[attr-defined]
        bank.a.connection(tx).execute(
            text("UPDATE accounts SET balance = balance - 5 WHERE id = 2")
        )
        move(tx.join(bank.b), "t1", 1, 10)
    assert bank.totals() == (3990, 4010)
    assert pool.checkedout() == 0  # type: ignore[attr-defined]


def test_handle_option_makes_join_return_the_core_connection(bank: Bank, managers: list) -> None:
    a = PostgresResource(bank.engines[0], "a", handle="connection")
    tm = make_manager(managers, [a, bank.b])
    with tm.transaction() as tx:
        conn = tx.join(a)
        assert isinstance(conn, sa.Connection)
        conn.execute(text("UPDATE accounts SET balance = 0 WHERE id = 1"))
    assert bank.totals() == (3000, 4000)


def test_a_refused_first_statement_leaves_no_later_one_outside_the_branch(
    bank: Bank, managers: list
) -> None:
    """The BEGIN rides with the first statement; if the server refused the whole message (a
    syntax error, psycopg2), the next statement carries it again and still runs inside the
    branch (psycopg 3 sends the BEGIN as a statement of its own in the same flush, so the branch
    is in error and the next statement is refused)."""
    tm = make_manager(managers, [bank.a, bank.b])
    with pytest.raises(RuntimeError), tm.transaction() as tx:
        conn = bank.a.connection(tx)
        with pytest.raises(sa.exc.ProgrammingError):
            conn.execute(text("UPDAT accounts SET balance = 0"))
        with contextlib.suppress(sa.exc.InternalError):
            conn.execute(text("UPDATE accounts SET balance = 0 WHERE id = 1"))
        raise RuntimeError("abort: the update must not have committed on its own")
    assert bank.totals() == (4000, 4000)


def test_a_commit_the_application_sent_itself_votes_no(bank: Bank, managers: list) -> None:
    tm = make_manager(managers, [bank.a, bank.b])
    ended = pytest.raises(TransactionRolledBack, match="ended by a COMMIT or ROLLBACK")
    with ended, tm.transaction() as tx:
        cursor = bank.a.dbapi_connection(tx).cursor()
        cursor.execute("UPDATE accounts SET balance = balance - 1 WHERE id = 1")
        cursor.execute("COMMIT")
        move(tx.join(bank.b), "t1", 1, 1)
    assert bank.totals() == (3999, 4000)  # what the application committed itself, no more
    assert bank.prepared() == []


def test_the_drivers_commit_and_rollback_leave_the_branch_alone(bank: Bank, managers: list) -> None:
    """atomicity: psycopg 3's commit() would send COMMIT in any mode; in a branch it must not."""
    tm = make_manager(managers, [bank.a, bank.b])
    with pytest.raises(RuntimeError), tm.transaction() as tx:
        raw = bank.a.dbapi_connection(tx)
        with raw.cursor() as cursor:
            cursor.execute("UPDATE accounts SET balance = 0 WHERE id = 1")
        raw.commit()
        raw.rollback()
        raise RuntimeError("abort after the driver's commit()")
    assert bank.totals() == (4000, 4000)


def test_a_branch_that_ran_nothing_sends_nothing(bank: Bank, managers: list) -> None:
    statements: list[str] = []
    sa.event.listen(
        bank.engines[0], "before_cursor_execute", lambda *args: statements.append(args[2])
    )
    xid = Xid.branch_of("node-1:x-1", "a")
    bank.a.start(xid)
    assert bank.a.prepare(xid) is Vote.READ_ONLY
    assert statements == []
    assert bank.engines[0].pool.checkedout() == 0  # type: ignore[attr-defined]


# -- idempotence and heuristics ------------------------------------------------------------------


def prepared_branch(resource: PostgresResource, gtrid: str, tid: str, account: int = 1) -> Xid:
    """A branch left prepared; it keeps its row lock, so concurrent ones use other accounts."""
    xid = Xid.branch_of(gtrid, resource.name)
    move(resource.start(xid), tid, account, 10)
    assert resource.prepare(xid) == Vote.COMMIT
    return xid


def test_commit_and_rollback_of_prepared_branches_are_idempotent(bank: Bank) -> None:
    one = prepared_branch(bank.a, "node-1:x-1", "t1")
    assert bank.a.commit(one) is None
    assert bank.a.commit(one) is None  # the marker says it committed
    two = prepared_branch(bank.a, "node-1:x-2", "t2")
    assert bank.a.rollback(two) is None
    assert bank.a.rollback(two) is None
    assert transfer_ids(bank.engines[0]) == {"t1"}


def test_an_operator_rollback_is_reported_as_a_heuristic_not_taken_for_a_commit(
    bank: Bank, managers: list
) -> None:
    """The decision is commit; someone ran ROLLBACK PREPARED on one branch by hand."""

    def operator_rolls_back(xid: Xid) -> None:
        with bank.engines[1].connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f"ROLLBACK PREPARED '{xid.to_gid()}'"))

    b = FlakyResource(bank.b, before={"commit": operator_rolls_back})
    tm = make_manager(managers, [bank.a, b])
    with pytest.raises(Exception) as raised, tm.transaction() as tx:
        move(tx.join(bank.a), "t1", 1, -10)
        move(tx.join(b), "t1", 1, 10)
    assert isinstance(raised.value, HeuristicRollback | Exception)
    [record] = tm.heuristics()
    assert (record.branch, record.outcome) == ("b", Outcome.HEURISTIC_ROLLBACK.value)
    assert bank.totals() == (3990, 4000)  # reported: a human must look


def test_an_operator_commit_is_reported_when_recovery_presumes_abort(bank: Bank) -> None:
    xid = prepared_branch(bank.a, "node-1:x-1", "t1")
    with bank.engines[0].connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"COMMIT PREPARED '{xid.to_gid()}'"))
    assert bank.a.rollback(xid) == Outcome.HEURISTIC_COMMIT
    bank.a.forget(xid)
    assert bank.a.rollback(xid) is None


def test_without_markers_an_unknown_gid_is_taken_as_committed(bank: Bank) -> None:
    plain = PostgresResource(bank.engines[0], "plain", outcome_markers=False)
    xid = prepared_branch(plain, "node-1:x-1", "t1")
    with bank.engines[0].connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"ROLLBACK PREPARED '{xid.to_gid()}'"))
    assert plain.commit(xid) is None  # the documented cost of turning markers off


# -- recovery ------------------------------------------------------------------------------------


def test_recovery_after_a_decision_commits_and_presumed_abort_rolls_back(
    bank: Bank, tmp_path: object, managers: list
) -> None:
    from pathlib import Path

    logdir = Path(str(tmp_path)) / "log"
    decided = [prepared_branch(r, "node-1:old-1", "t1") for r in (bank.a, bank.b)]
    orphans = [prepared_branch(r, "node-1:old-2", "t2", 2) for r in (bank.a, bank.b)]
    with FileDecisionLog(logdir) as log:
        log.log_commit(Decision("node-1:old-1", ("a", "b")))
    assert len(bank.prepared()) == 4
    tm = make_manager(managers, [bank.a, bank.b], FileDecisionLog(logdir))  # recovers on start
    assert bank.prepared() == []
    assert transfer_ids(bank.engines[0]) == transfer_ids(bank.engines[1]) == {"t1"}
    assert tm.log.pending() == []
    assert decided and orphans


def test_recover_lists_only_our_database_role_format_and_branch(
    bank: Bank, pg_server: object
) -> None:
    ours = prepared_branch(bank.a, "node-1:x-1", "t1")
    other_name = prepared_branch(PostgresResource(bank.engines[0], "other"), "node-1:x-2", "t2", 2)
    in_b = prepared_branch(bank.b, "node-1:x-3", "t3")
    with bank.engines[0].connect() as conn:  # a foreign gid, and another role's branch
        conn.execute(text("BEGIN"))
        conn.execute(text("INSERT INTO transfers VALUES ('foreign', 1)"))
        conn.execute(text("PREPARE TRANSACTION 'not-a-twopc-gid'"))
    with bank.engines[0].connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        role = f"someone_else_{bank.engines[0].url.database}"  # roles are the cluster's
        conn.execute(text(f"CREATE ROLE {role} LOGIN SUPERUSER"))
    theirs_url = bank.engines[0].url.set(username=role)
    theirs_engine = sa.create_engine(theirs_url)
    theirs = prepared_branch(PostgresResource(theirs_engine, "a"), "node-1:x-4", "t4", 3)
    try:
        assert bank.a.recover() == [ours]
    finally:
        for resource, xid in ((bank.a, ours), (bank.b, in_b)):
            resource.rollback(xid)
        PostgresResource(bank.engines[0], "other").rollback(other_name)
        PostgresResource(theirs_engine, "a").rollback(theirs)
        with bank.engines[0].connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ROLLBACK PREPARED 'not-a-twopc-gid'"))
        theirs_engine.dispose()


def test_recover_of_one_gtrid_is_narrowed_by_the_statement(bank: Bank) -> None:
    """``recover_gtrid`` lists the branches of one global transaction, sub-branches included,
    and nothing of a gtrid that merely starts the same (``x-1`` against ``x-10``)."""
    first = prepared_branch(bank.a, "node-1:x-1", "t1")
    sub = Xid.branch_of("node-1:x-1", sub_branch(bank.a.name, "p0", 0.0))
    move(bank.a.start(sub), "t2", 2, 10)
    assert bank.a.prepare(sub) == Vote.COMMIT
    longer = prepared_branch(bank.a, "node-1:x-10", "t3", 3)
    try:
        assert sorted(bank.a.recover_gtrid("node-1:x-1"), key=str) == sorted([first, sub], key=str)
        assert bank.a.recover_gtrid("node-1:x-10") == [longer]
        assert bank.a.recover_gtrid("node-1:x-2") == []
    finally:
        for xid in (first, sub, longer):
            bank.a.rollback(xid)


def test_two_nodes_on_one_database_never_touch_each_others_branches(
    bank: Bank, managers: list
) -> None:
    left = prepared_branch(bank.a, "left:1-1", "t1")
    right = make_manager(managers, [bank.a, bank.b], node_id="right")
    report = right.recover(force=True)
    assert report.rolled_back == []
    assert bank.prepared() == [left.to_gid()]
    make_manager(managers, [bank.a, bank.b], node_id="left")  # its own recovery finishes it
    assert bank.prepared() == []


# -- connections and failures ------------------------------------------------------------------


def test_a_branch_keeps_one_connection_from_its_work_through_phase_two(
    bank: Bank, managers: list
) -> None:
    """One checkout per branch: phase two runs on the connection that prepared, which then goes
    back to the pool."""
    seen: list[tuple[int, int]] = []
    pools = [e.pool for e in bank.engines]

    def look(xid: Xid) -> None:
        seen.append(tuple(p.checkedout() for p in pools))  # type: ignore[arg-type,attr-defined]

    b = FlakyResource(bank.b, before={"commit": look})
    tm = make_manager(managers, [bank.a, b])
    checkouts: list[int] = []  # from here on: the manager's start-up recovery is done
    for engine in bank.engines:
        sa.event.listen(engine, "checkout", lambda *args: checkouts.append(1))
    with tm.transaction() as tx:
        move(tx.join(bank.a), "t1", 1, -1)
        move(tx.join(b), "t1", 1, 1)
    assert seen == [(0, 1)]  # a committed and gave its connection back; b still holds its own
    assert len(checkouts) == 2
    assert [p.checkedout() for p in pools] == [0, 0]  # type: ignore[attr-defined]
    assert bank.totals() == (3999, 4001)


def test_a_prepared_branch_holds_its_connection_no_longer_than_hold_prepared(
    bank: Bank, managers: list
) -> None:
    """A phase two that does not come (the coordinator died, or waits on its log) must not keep
    connections out of the pool: past ``hold_prepared`` the next branch gives them back, and
    phase two or recovery uses a pooled connection."""
    a = PostgresResource(bank.engines[0], "a", hold_prepared=0.2)
    xid = Xid.branch_of("node-x:1", "a")
    move(a.start(xid), "t1", 1, -1)
    assert a.prepare(xid) is Vote.COMMIT
    assert bank.engines[0].pool.checkedout() == 1  # type: ignore[attr-defined]
    time.sleep(0.3)
    other = Xid.branch_of("node-x:2", "a")
    a.start(other)
    assert bank.engines[0].pool.checkedout() == 1  # type: ignore[attr-defined]
    a.rollback(other)
    assert a.commit(xid) is None
    assert bank.engines[0].pool.checkedout() == 0  # type: ignore[attr-defined]
    assert bank.totals() == (3999, 4000)
    assert bank.prepared() == []


def test_a_branch_whose_sql_fails_votes_no_with_the_servers_error(
    bank: Bank, managers: list
) -> None:
    tm = make_manager(managers, [bank.a, bank.b])
    with pytest.raises(TransactionRolledBack) as raised, tm.transaction() as tx:
        move(tx.join(bank.a), "t1", 1, -10)
        db = tx.join(bank.b)
        move(db, "t1", 1, 10)
        # the application swallows the error and carries on: the branch must still vote no
        with contextlib.suppress(sa.exc.IntegrityError):
            db.execute(text("INSERT INTO transfers VALUES ('t1', 1)"))
    assert "duplicate key" in repr(raised.value) + repr(raised.value.__cause__)
    assert bank.totals() == (4000, 4000)
    assert bank.prepared() == []


@pytest.mark.parametrize(
    "statement",
    [
        "CREATE TEMP TABLE scratch (x int)",
        "LISTEN channel",
        "DECLARE c CURSOR WITH HOLD FOR SELECT 1",
    ],
)
def test_what_postgres_cannot_prepare_is_a_clear_error(
    bank: Bank, managers: list, statement: str
) -> None:
    tm = make_manager(managers, [bank.a, bank.b])
    with pytest.raises(TransactionRolledBack) as raised, tm.transaction() as tx:
        db = tx.join(bank.a)
        move(db, "t1", 1, -10)
        db.execute(text(statement))
        move(tx.join(bank.b), "t1", 1, 10)
    cause = raised.value.__cause__
    assert "cannot prepare" in str(cause).lower() and "temporary tables" in str(cause)
    assert bank.totals() == (4000, 4000)
    assert bank.prepared() == []


def test_prepared_gauges(bank: Bank, managers: list) -> None:
    tm = make_manager(managers, [bank.a, bank.b])
    xid = prepared_branch(bank.a, "node-1:x-1", "t1")
    metrics = tm.metrics.as_dict()
    assert metrics["resource_a_prepared_transactions"] == 1
    assert metrics["resource_a_oldest_prepared_age_seconds"] >= 0
    assert metrics["resource_b_prepared_transactions"] == 0
    bank.a.rollback(xid)


def test_a_savepoint_the_application_rolled_back_does_not_doom_the_branch(
    bank: Bank, managers: list
) -> None:
    tm = make_manager(managers, [bank.a, bank.b])
    with tm.transaction() as tx:
        db = tx.join(bank.a)
        move(db, "t1", 1, -10)
        # undone on the server by ROLLBACK TO SAVEPOINT
        with contextlib.suppress(sa.exc.IntegrityError), db.begin_nested():
            db.execute(text("INSERT INTO transfers VALUES ('t1', 1)"))  # duplicate
        move(tx.join(bank.b), "t1", 1, 10)
    assert bank.totals() == (3990, 4010)


def test_serialization_failures_are_retried_by_run(bank: Bank, managers: list) -> None:
    tm = make_manager(managers, [bank.a, bank.b])
    attempts: list[int] = []

    def work(tx: object) -> None:
        attempts.append(1)
        db = tx.join(bank.a)  # type: ignore[attr-defined]
        if len(attempts) == 1:
            db.execute(text("SELECT 1/0"))  # not transient: proves the judge is selective
        move(db, "t1", 1, -10)

    with pytest.raises(sa.exc.DataError):
        tm.run(work)
    assert len(attempts) == 1

    def conflicted(tx: object) -> None:
        attempts.append(1)
        db = tx.join(bank.a)  # type: ignore[attr-defined]
        if len(attempts) == 2:
            db.execute(text("DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = '40001'; END $$"))
        move(db, "t2", 1, -10)

    tm.run(conflicted)
    assert len(attempts) == 3
    assert transfer_ids(bank.engines[0]) == {"t2"}


def test_a_role_that_may_not_create_the_marker_table_gets_the_ddl_to_run(bank: Bank) -> None:
    app = f"app_{bank.engines[0].url.database}"  # roles are the cluster's
    with bank.engines[0].connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"CREATE ROLE {app} LOGIN"))
        conn.execute(text(f"GRANT ALL ON accounts, transfers TO {app}"))
    engine = sa.create_engine(bank.engines[0].url.set(username=app))
    try:
        with pytest.raises(ConfigurationError, match="have an administrator run: CREATE TABLE"):
            PostgresResource(engine, "a").start(Xid.branch_of("node-1:x-1", "a"))
        with bank.engines[0].connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(
                text(
                    "CREATE TABLE twopc_outcome (gid text PRIMARY KEY, "
                    "committed_at timestamptz NOT NULL DEFAULT now())"
                )
            )
            conn.execute(text(f"GRANT SELECT, INSERT, DELETE ON twopc_outcome TO {app}"))
        resource = PostgresResource(engine, "a")
        xid = prepared_branch(resource, "node-1:x-2", "t2")
        assert resource.commit(xid) is None
    finally:
        engine.dispose()


def test_gauges_of_an_unreachable_database_read_nan(bank: Bank, managers: list) -> None:
    dead = sa.create_engine("postgresql+psycopg2://postgres@127.0.0.1:9/nowhere")
    tm = make_manager(managers, [bank.a, PostgresResource(dead, "dead")])
    metrics = tm.metrics.as_dict()
    assert math.isnan(metrics["resource_dead_prepared_transactions"])
    assert metrics["resource_a_prepared_transactions"] == 0


def test_writes_the_session_never_saw_are_still_prepared(bank: Bank, managers: list) -> None:
    """Core on ``session.connection()`` bypasses the session's hooks; the server still knows."""
    tm = make_manager(managers, [bank.a, bank.b])
    with tm.transaction() as tx:
        tx.join(bank.a).connection().execute(text("UPDATE accounts SET balance = 0 WHERE id = 1"))
        move(tx.join(bank.b), "t1", 1, 10)
    assert bank.totals() == (3000, 4010)
