"""A last resource's decision statements prepared on the server (`resource_managers.postgres.
_prepared`), against real servers and both drivers (psycopg 3 with its own preparation off, the
only way ours survive there): prepared on a connection's second use, used for the row, the
carried payloads and the epoch check; a connection that lost them (``DEALLOCATE ALL``, as a
pooler in transaction mode would) costs a definite rollback and the resource goes on unprepared;
``prepared_statements=False``, a pool without reuse and psycopg 3's defaults never prepare."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import text
from sqlalchemy.pool import NullPool

from coordinator import FileDecisionLog, TransactionManager, TransactionRolledBack
from resource_managers.message_log import MessageLog, MessageLogResource
from resource_managers.postgres import PostgresResource
from tests.support.managers import make_manager
from tests.support.pg import ledger_engine, move, on_driver, transfer_ids


@pytest.fixture
def url(make_pg_database: Callable[[], str], pg_driver: str) -> str:
    return on_driver(make_pg_database(), pg_driver)


def reused(url: str, **kwargs: object) -> sa.Engine:
    """A ledger engine with one connection, lent again and again (psycopg 3's own statement
    preparation off, as it must be for ours)."""
    if url.startswith("postgresql+psycopg:"):
        kwargs["connect_args"] = {"prepare_threshold": None}
    return ledger_engine(url, pool_size=1, max_overflow=0, **kwargs)


@pytest.fixture
def mlog(tmp_path: Path) -> Iterator[MessageLog]:
    with MessageLog(tmp_path / "mlog", lazy_delay=60.0) as log:
        yield log


def stack(
    engine: sa.Engine, mlog: MessageLog, managers: list[TransactionManager], tmp_path: Path
) -> tuple[PostgresResource, MessageLogResource, TransactionManager]:
    """A last resource on ``engine`` and a message log branch under one transaction manager."""
    pg = PostgresResource(engine, "pg", last_resource=True)
    mr = MessageLogResource(mlog)
    return pg, mr, make_manager(managers, [pg, mr], FileDecisionLog(tmp_path / "log"))


def held(
    tm: TransactionManager, pg: PostgresResource, tid: str, mr: MessageLogResource | None = None
) -> list[str]:
    """The names of the prepared statements the branch's connection holds, seen from inside a
    transaction that also writes ``tid`` (and sends it through ``mr``: two branches, so the
    database commits with the decision row)."""
    with tm.transaction() as tx:
        move(tx.join(pg), tid, 1, 1)
        if mr is not None:
            tx.join(mr).send("orders", tid.encode())
        with pg.dbapi_connection(tx).cursor() as cur:
            cur.execute(
                "SELECT name FROM pg_prepared_statements WHERE name LIKE 'twopc%' ORDER BY name"
            )
            return [str(r[0]) for r in cur.fetchall()]


def test_prepared_on_the_second_use_and_used_with_carried_branches(
    url: str, mlog: MessageLog, managers: list[TransactionManager], tmp_path: Path
) -> None:
    engine = reused(url)
    try:
        pg, mr, tm = stack(engine, mlog, managers, tmp_path)
        assert held(tm, pg, "t1") == []  # the first use only notes the connection
        names = held(tm, pg, "t2")
        assert len(names) == 4 and all(n.startswith("twopc_") for n in names)
        for i in range(3):  # the fence, the row with the payload, the deletion: all executed
            with tm.transaction() as tx:
                move(tx.join(pg), f"c{i}", 1, 1)
                tx.join(mr).send("orders", f"m{i}".encode())
        mr.flush_commits()
        assert [m.body for _, m in mlog.pending("orders")] == [b"m0", b"m1", b"m2"]
        assert {"t1", "t2", "c0", "c1", "c2"} <= transfer_ids(engine)
        assert tm.recover(force=True).clean
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM twopc_decision_row")).scalar() == 0
    finally:
        engine.dispose()


def test_a_fenced_commit_fails_through_the_prepared_check(
    url: str, mlog: MessageLog, managers: list[TransactionManager], tmp_path: Path
) -> None:
    """A newer process of the node fences it: the old process's next carried commit, on a
    connection holding the prepared epoch check, is refused and rolls back."""
    engine = reused(url)
    other = sa.create_engine(url)
    try:
        pg, mr, tm = stack(engine, mlog, managers, tmp_path)
        held(tm, pg, "t1")
        assert held(tm, pg, "t2")
        PostgresResource(other, "pg", last_resource=True).fence_node(tm.node_id)
        with pytest.raises(TransactionRolledBack), tm.transaction() as tx:
            move(tx.join(pg), "late", 1, 1)
            tx.join(mr).send("orders", b"late")
        assert "late" not in transfer_ids(engine)
        assert mlog.pending("orders") == []
    finally:
        other.dispose()
        engine.dispose()


def test_a_connection_that_lost_them_costs_one_rollback_then_none(
    url: str,
    mlog: MessageLog,
    managers: list[TransactionManager],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = reused(url)
    try:
        pg, mr, tm = stack(engine, mlog, managers, tmp_path)
        held(tm, pg, "t1", mr)
        assert held(tm, pg, "t2", mr)
        with (
            caplog.at_level(logging.WARNING, logger="twopc.postgres"),
            pytest.raises(TransactionRolledBack),
            tm.transaction() as tx,
        ):
            move(tx.join(pg), "lost", 1, 1)
            tx.join(mr).send("orders", b"lost")
            with pg.dbapi_connection(tx).cursor() as cur:
                cur.execute("DEALLOCATE ALL")  # what a pooler in transaction mode does
        assert "no longer prepared" in caplog.text and "prepared_statements=False" in caplog.text
        assert "lost" not in transfer_ids(engine)  # a definite rollback
        held(tm, pg, "t3", mr)
        assert held(tm, pg, "t4", mr) == []  # unprepared from then on
        assert {"t3", "t4"} <= transfer_ids(engine)
        mr.flush_commits()
        assert [m.body for _, m in mlog.pending("orders")] == [b"t1", b"t2", b"t3", b"t4"]
    finally:
        engine.dispose()


@pytest.mark.parametrize("how", ["prepared_statements=False", "NullPool"])
def test_never_prepared_when_off_or_when_no_connection_is_used_twice(
    url: str, managers: list[TransactionManager], tmp_path: Path, how: str
) -> None:
    if how == "NullPool":
        engine = ledger_engine(url, poolclass=NullPool)
        pg = PostgresResource(engine, "pg", last_resource=True)
    else:
        engine = reused(url)
        pg = PostgresResource(engine, "pg", last_resource=True, prepared_statements=False)
    try:
        tm = make_manager(managers, [pg], FileDecisionLog(tmp_path / "log"))
        assert [held(tm, pg, f"t{i}") for i in range(4)] == [[], [], [], []]
        assert {"t0", "t1", "t2", "t3"} <= transfer_ids(engine)
    finally:
        engine.dispose()


def test_psycopg3_with_its_own_preparation_on_never_gets_ours(
    make_pg_database: Callable[[], str],
    mlog: MessageLog,
    managers: list[TransactionManager],
    tmp_path: Path,
) -> None:
    """psycopg 3 prepares what runs often itself and then deallocates every statement of the
    session after a rollback: twopc's would go too, and the next commit fail. So it prepares
    none there, and a warmed-up cache followed by a rollback costs nothing."""
    engine = ledger_engine(on_driver(make_pg_database(), "psycopg"), pool_size=1, max_overflow=0)
    try:
        pg, mr, tm = stack(engine, mlog, managers, tmp_path)
        for i in range(8):  # psycopg prepares the application's statements after five runs
            assert held(tm, pg, f"t{i}", mr) == []
        with pytest.raises(RuntimeError), tm.transaction() as tx:
            move(tx.join(pg), "undone", 1, 1)
            raise RuntimeError("the application gives up: a ROLLBACK, then DEALLOCATE ALL")
        assert held(tm, pg, "after", mr) == []
        assert {"t0", "t7", "after"} <= transfer_ids(engine) and "undone" not in transfer_ids(
            engine
        )
    finally:
        engine.dispose()
