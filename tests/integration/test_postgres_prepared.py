"""A last resource's decision statements prepared on the server (`resource_managers.postgres.
_prepared`), against real servers and both drivers: prepared on a connection's second use, used
for the row, the carried payloads and the epoch check; a connection that lost them (``DEALLOCATE
ALL``, as a pooler in transaction mode would) costs one definite rollback and the resource goes on
unprepared; ``prepared_statements=False`` and a pool without reuse never prepare."""

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


@pytest.fixture
def mlog(tmp_path: Path) -> Iterator[MessageLog]:
    with MessageLog(tmp_path / "mlog", lazy_delay=60.0) as log:
        yield log


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
            cur.execute("SELECT name FROM pg_prepared_statements ORDER BY name")
            return [str(r[0]) for r in cur.fetchall()]


def test_prepared_on_the_second_use_and_used_with_carried_branches(
    url: str, mlog: MessageLog, managers: list[TransactionManager], tmp_path: Path
) -> None:
    engine = ledger_engine(url, pool_size=1, max_overflow=0)  # one connection, used again
    try:
        pg = PostgresResource(engine, "pg", last_resource=True)
        mr = MessageLogResource(mlog)
        tm = make_manager(managers, [pg, mr], FileDecisionLog(tmp_path / "log"))
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
    engine = ledger_engine(url, pool_size=1, max_overflow=0)
    other = sa.create_engine(url)
    try:
        pg = PostgresResource(engine, "pg", last_resource=True)
        mr = MessageLogResource(mlog)
        tm = make_manager(managers, [pg, mr], FileDecisionLog(tmp_path / "log"))
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
    engine = ledger_engine(url, pool_size=1, max_overflow=0)
    try:
        pg = PostgresResource(engine, "pg", last_resource=True)
        mr = MessageLogResource(mlog)
        tm = make_manager(managers, [pg, mr], FileDecisionLog(tmp_path / "log"))
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
        engine = ledger_engine(url, pool_size=1, max_overflow=0)
        pg = PostgresResource(engine, "pg", last_resource=True, prepared_statements=False)
    try:
        tm = make_manager(managers, [pg], FileDecisionLog(tmp_path / "log"))
        assert [held(tm, pg, f"t{i}") for i in range(4)] == [[], [], [], []]
        assert {"t0", "t1", "t2", "t3"} <= transfer_ids(engine)
    finally:
        engine.dispose()
