"""Idle branch connections kept for the next branch (`resource_managers.postgres._spares`), on a
real server: reused across transactions with every handle, bounded in number and age, given back
when the pool has no room or the manager closes, dropped when the server restarts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import text

from coordinator import ConfigurationError
from resource_managers.postgres import PostgresResource
from resource_managers.throwaway import PostgresServer
from tests.support.managers import make_manager
from tests.support.pg import ledger_engine, on_driver, total


@pytest.fixture
def engine(make_pg_database: Callable[[], str], pg_driver: str) -> Iterator[sa.Engine]:
    engine = ledger_engine(on_driver(make_pg_database(), pg_driver))
    yield engine
    engine.dispose()


def checkouts(engine: sa.Engine) -> list[int]:
    """A list that grows by one at every checkout from ``engine``'s pool."""
    seen: list[int] = []
    sa.event.listen(engine, "checkout", lambda *args: seen.append(1))
    return seen


def checked_out(engine: sa.Engine) -> int:
    return int(engine.pool.checkedout())  # type: ignore[attr-defined]


@pytest.mark.parametrize("handle", ["session", "connection", "dbapi"])
def test_the_next_branch_runs_on_the_connection_the_last_one_kept(
    engine: sa.Engine, managers: list, handle: str
) -> None:
    pg: PostgresResource[Any] = PostgresResource(engine, "pg", handle=handle)  # type: ignore[call-overload]
    tm = make_manager(managers, [pg])
    seen = checkouts(engine)
    drivers = []
    for i in range(3):
        with tm.transaction() as tx:
            joined = tx.join(pg)
            if handle == "dbapi":
                with joined.cursor() as cur:
                    cur.execute("UPDATE accounts SET balance = balance - 1 WHERE id = 1")
                drivers.append(joined)
            else:
                joined.execute(text("UPDATE accounts SET balance = balance - 1 WHERE id = 1"))
                drivers.append(pg.dbapi_connection(tx))
        assert checked_out(engine) == 1  # idle, kept: still in autocommit mode
        assert drivers[-1].autocommit is True, i
    assert len(seen) == 1
    assert drivers[0] is drivers[1] is drivers[2]
    assert total(engine) == 3997
    tm.close()  # the manager's close gives the kept connections back
    assert checked_out(engine) == 0
    with engine.connect() as conn:  # as the pool lent it: not in autocommit mode
        assert conn.connection.dbapi_connection.autocommit is False  # type: ignore[union-attr]


def test_a_handle_used_after_its_transaction_raises_and_writes_nothing(
    engine: sa.Engine, managers: list
) -> None:
    """The connection is kept, its handles are not: a Core connection or a session kept past
    the end of its transaction is closed, so its statements can neither autocommit nor run
    inside the next branch on the same connection."""
    pg = PostgresResource(engine, "pg")
    tm = make_manager(managers, [pg])
    with tm.transaction() as tx:
        session = tx.join(pg)
        core = pg.connection(tx)
        core.execute(text("UPDATE accounts SET balance = balance - 1 WHERE id = 1"))
    with tm.transaction() as tx:  # on the kept connection
        pg.connection(tx).execute(text("UPDATE accounts SET balance = balance + 1 WHERE id = 2"))
        with pytest.raises(sa.exc.ResourceClosedError):
            core.execute(text("UPDATE accounts SET balance = 0 WHERE id = 3"))
        with pytest.raises(sa.exc.ResourceClosedError):
            session.execute(text("UPDATE accounts SET balance = 0 WHERE id = 4"))
    with pytest.raises(sa.exc.ResourceClosedError):
        core.execute(text("UPDATE accounts SET balance = 0 WHERE id = 3"))
    assert total(engine) == 4000
    with engine.connect() as conn:
        balances = conn.execute(text("SELECT balance FROM accounts ORDER BY id")).scalars()
        assert list(balances) == [999, 1001, 1000, 1000]


def test_options_set_on_a_handle_stay_with_its_branch(engine: sa.Engine, managers: list) -> None:
    pg = PostgresResource(engine, "pg", handle="connection")
    tm = make_manager(managers, [pg])
    with tm.transaction() as tx:
        conn = pg.connection(tx)
        conn.execution_options(logging_token="first")
        conn.execute(text("SELECT 1"))
    with tm.transaction() as tx:
        assert "logging_token" not in pg.connection(tx).get_execution_options()


def test_an_idle_resource_gives_its_kept_connections_back_in_time(
    engine: sa.Engine, managers: list
) -> None:
    pg = PostgresResource(engine, "pg", handle="connection", keep_idle_seconds=0.2)
    tm = make_manager(managers, [pg])
    with tm.transaction() as tx:
        pg.connection(tx).execute(text("SELECT 1"))
    assert checked_out(engine) == 1
    deadline = time.monotonic() + 5
    while checked_out(engine) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert checked_out(engine) == 0  # the sweeper, with no branch to do it


def test_the_resources_own_statements_never_wait_on_its_kept_connections(
    make_pg_database: Callable[[], str], pg_driver: str, managers: list
) -> None:
    """A pool filled by someone else after a connection was kept: recovery (which borrows a
    pooled connection) gives the kept ones back first instead of timing out."""
    engine = ledger_engine(
        on_driver(make_pg_database(), pg_driver), pool_size=2, max_overflow=0, pool_timeout=1
    )
    try:
        pg = PostgresResource(engine, "pg", handle="connection")
        tm = make_manager(managers, [pg])
        with tm.transaction() as tx:
            pg.connection(tx).execute(text("SELECT 1"))
        assert checked_out(engine) == 1  # kept: one slot left for others
        with engine.connect():  # someone takes it: the pool is full
            assert checked_out(engine) == 2
            assert pg.recover() == []  # would time out after 1 s on a full pool
    finally:
        engine.dispose()


def test_concurrent_branches_keep_at_most_keep_idle(engine: sa.Engine, managers: list) -> None:
    pg = PostgresResource(engine, "pg", handle="connection", keep_idle=2)
    tm = make_manager(managers, [pg])
    working, done = threading.Barrier(5), threading.Barrier(5)

    def branch(account: int) -> None:  # a row each: no branch waits on another's lock
        with tm.transaction() as tx:
            pg.connection(tx).execute(
                text("UPDATE accounts SET balance = balance + 1 WHERE id = :i"), {"i": account}
            )
            working.wait(10)
            done.wait(10)

    threads = [threading.Thread(target=branch, args=(i,)) for i in range(1, 5)]
    for thread in threads:
        thread.start()
    working.wait(10)
    assert checked_out(engine) == 4
    done.wait(10)
    for thread in threads:
        thread.join(10)
    assert checked_out(engine) == 2
    tm.close()
    assert checked_out(engine) == 0
    assert total(engine) == 4004


def test_keep_idle_zero_gives_every_connection_back(engine: sa.Engine, managers: list) -> None:
    pg = PostgresResource(engine, "pg", handle="connection", keep_idle=0)
    tm = make_manager(managers, [pg])
    seen = checkouts(engine)
    for _ in range(2):
        with tm.transaction() as tx:
            pg.connection(tx).execute(text("SELECT 1"))
        assert checked_out(engine) == 0
    assert len(seen) == 2


def test_a_connection_kept_too_long_goes_back_to_the_pool(
    engine: sa.Engine, managers: list
) -> None:
    pg = PostgresResource(engine, "pg", handle="connection", keep_idle_seconds=0.05)
    tm = make_manager(managers, [pg])
    seen = checkouts(engine)
    with tm.transaction() as tx:
        pg.connection(tx).execute(text("SELECT 1"))
    time.sleep(0.1)
    with tm.transaction() as tx:  # the stale one is checked in, a fresh checkout serves
        pg.connection(tx).execute(text("SELECT 1"))
        assert checked_out(engine) == 1
    assert len(seen) == 2


def test_the_last_connection_of_a_full_pool_is_never_kept(
    make_pg_database: Callable[[], str], pg_driver: str, managers: list
) -> None:
    """A thread waiting on the pool must never wait on an idle connection of ours."""
    engine = ledger_engine(
        on_driver(make_pg_database(), pg_driver), pool_size=1, max_overflow=0, pool_timeout=1
    )
    try:
        pg = PostgresResource(engine, "pg", handle="connection")
        tm = make_manager(managers, [pg])
        with tm.transaction() as tx:
            pg.connection(tx).execute(text("UPDATE accounts SET balance = 0 WHERE id = 3"))
        assert checked_out(engine) == 0
        with engine.connect() as conn:  # would time out after 1 s if we had kept it
            assert conn.execute(text("SELECT balance FROM accounts WHERE id = 3")).scalar() == 0
    finally:
        engine.dispose()


def test_a_failed_branch_leaves_a_usable_connection(engine: sa.Engine, managers: list) -> None:
    pg = PostgresResource(engine, "pg", handle="connection")
    tm = make_manager(managers, [pg])
    with pytest.raises(sa.exc.ProgrammingError), tm.transaction() as tx:
        pg.connection(tx).execute(text("SELECT * FROM no_such_table"))
    with tm.transaction() as tx:
        pg.connection(tx).execute(text("UPDATE accounts SET balance = balance + 5 WHERE id = 4"))
    assert total(engine) == 4005


@pytest.mark.parametrize("restart", ["clean", "kill9"])
def test_a_connection_the_server_closed_is_not_reused(managers: list, restart: str) -> None:
    """A restarted (or crashed) server closes the kept connection's socket: the next branch sees
    it readable without a round trip and takes a fresh connection, so its first statement does
    not fail."""
    server = PostgresServer().start()
    try:
        engine = ledger_engine(server.url(server.create_database("kept")))
        pg = PostgresResource(engine, "pg", handle="connection")
        tm = make_manager(managers, [pg])
        seen = checkouts(engine)

        def transfer() -> None:
            with tm.transaction() as tx:
                pg.connection(tx).execute(
                    text("UPDATE accounts SET balance = balance - 1 WHERE id = 1")
                )

        transfer()
        assert checked_out(engine) == 1
        if restart == "kill9":
            server.kill9()
        server.restart()
        transfer()  # no retry needed: the dead kept connection went back to the pool
        assert len(seen) == 2
        assert total(engine) == 3998
        engine.dispose()
    finally:
        server.remove()


@pytest.mark.parametrize(
    "options",
    [{"keep_idle": -1}, {"keep_idle": "2"}, {"keep_idle": True}, {"keep_idle_seconds": 0}],
    ids=["negative", "text", "bool", "zero-seconds"],
)
def test_bad_keep_options_are_refused(engine: sa.Engine, options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match="keep_idle"):
        PostgresResource(engine, "pg", **options)
