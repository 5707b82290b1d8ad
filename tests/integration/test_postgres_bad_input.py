"""Bad input and bad luck for PostgresResource: injection attempts, a server without prepared
transactions, and a server that is down at join, at prepare and at commit. Each ends in a clear
error or the right outcome after recovery, never in a guess and never in lost data."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy import text

from coordinator import (
    CompletionPending,
    ConfigurationError,
    Outcome,
    TransactionRolledBack,
    TransientError,
    Vote,
    Xid,
)
from resource_managers.postgres import PostgresResource
from resource_managers.throwaway import PostgresServer
from tests.support.flaky_resource import FlakyResource
from tests.support.managers import make_manager
from tests.support.pg import ledger_engine, move, prepared_gids, total, transfer_ids


@pytest.fixture
def shared_engine(pg_url: str) -> Iterator[sa.Engine]:
    engine = ledger_engine(pg_url)
    yield engine
    engine.dispose()


@pytest.fixture
def killable(
    private_pg: Callable[..., PostgresServer],
) -> Iterator[tuple[PostgresServer, sa.Engine]]:
    server = private_pg()
    database = server.create_database()
    engine = ledger_engine(server.url(database))
    yield server, engine
    engine.dispose()


def test_a_gid_cannot_carry_sql(shared_engine: sa.Engine) -> None:
    """Names and gtrids reach SQL only base64-encoded, and foreign gids are never parsed as ours."""
    evil = PostgresResource(shared_engine, "x'; DROP TABLE accounts; --")
    xid = Xid.branch_of("node-1:'); DROP TABLE transfers; --", evil.name)
    move(evil.start(xid), "t1", 1, 5)
    assert evil.prepare(xid) == Vote.COMMIT
    assert evil.recover() == [xid]
    assert evil.commit(xid) is None
    assert transfer_ids(shared_engine) == {"t1"}
    with shared_engine.connect() as conn:  # a hostile gid in the view is skipped, not parsed
        conn.execute(text("INSERT INTO transfers VALUES ('t2', 1)"))
        conn.execute(text("PREPARE TRANSACTION '1953522480_J30=_eCc7IERST1A=''--'"))
    try:
        assert evil.recover() == []
    finally:
        with shared_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ROLLBACK PREPARED '1953522480_J30=_eCc7IERST1A=''--'"))


def test_max_prepared_transactions_zero_is_refused_at_first_use(
    private_pg: Callable[..., PostgresServer],
) -> None:
    server = private_pg(max_prepared_transactions=0)
    engine = sa.create_engine(server.url())
    try:
        with pytest.raises(ConfigurationError, match="max_prepared_transactions"):
            PostgresResource(engine, "a").start(Xid.branch_of("node-1:x-1", "a"))
    finally:
        engine.dispose()


def test_a_server_that_is_down_at_join_is_a_clear_transient_error(
    shared_engine: sa.Engine, managers: list
) -> None:
    dead = sa.create_engine("postgresql+psycopg2://postgres@127.0.0.1:9/nowhere")
    tm = make_manager(managers, [PostgresResource(shared_engine, "a"), PostgresResource(dead, "b")])
    with (
        pytest.raises(TransientError, match="b: cannot connect to PostgreSQL"),
        tm.transaction() as tx,
    ):
        move(tx.join(tm.resource("a")), "t1", 1, -1)
        tx.join(tm.resource("b"))
    assert total(shared_engine) == 4000
    assert prepared_gids(shared_engine) == []


def test_a_server_that_dies_before_prepare_rolls_the_transaction_back(
    shared_engine: sa.Engine, killable: tuple[PostgresServer, sa.Engine], managers: list
) -> None:
    server, engine = killable
    b = FlakyResource(PostgresResource(engine, "b"), before={"prepare": lambda xid: server.kill9()})
    tm = make_manager(managers, [PostgresResource(shared_engine, "a"), b])
    with pytest.raises(TransactionRolledBack), tm.transaction() as tx:
        move(tx.join(tm.resource("a")), "t1", 1, -10)
        move(tx.join(b), "t1", 1, 10)
    server.restart()
    tm.recover(force=True)
    assert (total(shared_engine), total(engine)) == (4000, 4000)
    assert prepared_gids(shared_engine) == prepared_gids(engine) == []


def test_a_connection_lost_during_prepare_ends_rolled_back(
    shared_engine: sa.Engine, managers: list
) -> None:
    a = PostgresResource(shared_engine, "a")

    def terminate_branch_backend(xid: Xid) -> None:
        with shared_engine.connect() as conn:
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                    "AND state LIKE 'idle in transaction%'"
                )
            )

    b = FlakyResource(
        PostgresResource(shared_engine, "b"), before={"prepare": terminate_branch_backend}
    )
    tm = make_manager(managers, [a, b])
    with pytest.raises(TransactionRolledBack), tm.transaction() as tx:
        move(tx.join(a), "t1", 1, -10)
        move(tx.join(b), "t2", 2, 10)
    tm.recover(force=True)
    assert total(shared_engine) == 4000
    assert prepared_gids(shared_engine) == []


def test_a_server_that_dies_before_commit_is_finished_by_recovery(
    shared_engine: sa.Engine, killable: tuple[PostgresServer, sa.Engine], managers: list
) -> None:
    """The decision is commit; one server is gone. Pending, not guessed; recovery finishes it."""
    server, engine = killable
    b = FlakyResource(PostgresResource(engine, "b"), before={"commit": lambda xid: server.kill9()})
    tm = make_manager(managers, [PostgresResource(shared_engine, "a"), b])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tx = tm.begin()
        move(tx.join(tm.resource("a")), "t1", 1, -10)
        move(tx.join(b), "t1", 1, 10)
        assert tx.commit() == Outcome.COMMIT_PENDING
    assert any(issubclass(w.category, CompletionPending) for w in caught)
    assert [d.gtrid for d in tm.log.pending()] == [tx.gtrid]
    b.before.clear()
    server.restart()
    assert len(prepared_gids(engine)) == 1  # the prepared branch survived the server's crash
    report = tm.recover(force=True)
    assert report.committed == [tx.gtrid]
    assert (total(shared_engine), total(engine)) == (3990, 4010)
    assert prepared_gids(shared_engine) == prepared_gids(engine) == []
