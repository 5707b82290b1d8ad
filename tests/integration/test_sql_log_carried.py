"""A `SqlDecisionLog` in a participant's database: the decision rides that participant's commit.

The participant (a `PostgresResource` on the log's own database) never prepares; its one-phase
commit holds its data and the log's COMMIT record, fenced by the node lease like every write of
the log. Recovery reads the log as always. Crashes with ``kill -9`` live in tests/crash (the
``carried`` rows of the PostgreSQL matrix).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import text

from coordinator import (
    OutcomeUnknownError,
    TransactionManager,
    TransactionRolledBack,
)
from resource_managers.postgres import PostgresResource, SqlDecisionLog
from tests.support.managers import make_manager
from tests.support.pg import ledger_engine, move, on_driver, prepared_gids, total, transfer_ids


@dataclass
class Setup:
    """Database ``home`` holds the decision log and a participant; ``away`` is another one."""

    home: sa.Engine
    away: sa.Engine
    log: SqlDecisionLog

    def decision_rows(self) -> list[str]:
        with self.home.connect() as conn:
            query = text("SELECT gtrid FROM twopc_decision WHERE node_id = :n")
            return list(conn.execute(query, {"n": self.log.node_id}).scalars())


@pytest.fixture
def setup(make_pg_database: Callable[[], str], pg_driver: str) -> Iterator[Setup]:
    home, away = (ledger_engine(on_driver(make_pg_database(), pg_driver)) for _ in "ab")
    log = SqlDecisionLog(home, f"carry-{uuid.uuid4().hex[:8]}")
    yield Setup(home, away, log)
    log.close()
    home.dispose()
    away.dispose()


def transfer(tx: Any, orders: PostgresResource, stock: PostgresResource, tid: str) -> None:
    move(tx.join(orders), tid, 1, -10)
    move(tx.join(stock), tid, 1, 10)


def manager(managers: list[TransactionManager], setup: Setup, *resources: Any) -> Any:
    return make_manager(managers, list(resources), setup.log, node_id=setup.log.node_id)


def test_the_participant_in_the_log_database_carries_the_decision(
    setup: Setup, managers: list[TransactionManager]
) -> None:
    orders = PostgresResource(setup.home, "orders")
    stock = PostgresResource(setup.away, "stock")
    tm = manager(managers, setup, orders, stock)
    with tm.transaction() as tx:
        transfer(tx, orders, stock, "t1")
    assert "t1" in transfer_ids(setup.home) and "t1" in transfer_ids(setup.away)
    assert total(setup.home) + total(setup.away) == 8000
    stats = setup.log.stats()
    assert stats.extra["carried"] == 1
    assert stats.forced_records == 0  # no batch of its own: the record rode orders' commit
    assert tm.metrics_dict()["carried_decisions"] == 1
    assert setup.decision_rows() == [tx.gtrid]  # until its END goes with the next batch
    setup.log.close()
    assert setup.decision_rows() == []
    assert prepared_gids(setup.home) == prepared_gids(setup.away) == []


def test_which_participant_carries(
    setup: Setup, managers: list[TransactionManager], make_pg_database: Callable[[], str]
) -> None:
    """Only a READ COMMITTED participant in the log's own database, and never in place of an
    explicit last resource; every other transaction takes the ordinary path."""
    orders = PostgresResource(setup.home, "orders")
    strict = PostgresResource(setup.home, "strict", isolation_level="REPEATABLE READ")
    stock = PostgresResource(setup.away, "stock")
    llr = PostgresResource(setup.away, "llr", last_resource=True)
    tm = manager(managers, setup, orders, strict, stock, llr)
    assert [r.name for r in (orders, strict, stock, llr) if setup.log.carried_by(r)] == ["orders"]
    with tm.transaction() as tx:  # an explicit last resource wins over the carrier
        transfer(tx, orders, llr, "t1")
    with tm.transaction() as tx:  # strict prepares: the log forces its own record
        transfer(tx, strict, stock, "t2")
    metrics = tm.metrics_dict()
    assert metrics["last_resource_commits"] == 1
    assert metrics.get("carried_decisions", 0) == 0
    assert setup.log.stats().forced_records == 1
    assert {"t1", "t2"} <= transfer_ids(setup.away)


def test_a_commit_after_the_lease_was_taken_over_is_fenced(
    setup: Setup, managers: list[TransactionManager]
) -> None:
    """The carried record checks the lease in the database, like the log's own writes: a node
    taken over behind this log's back commits nothing anywhere."""
    orders = PostgresResource(setup.home, "orders")
    stock = PostgresResource(setup.away, "stock")
    tm = manager(managers, setup, orders, stock)
    tx = tm.begin()
    transfer(tx, orders, stock, "t1")
    with setup.home.begin() as conn:  # another host's takeover: a new epoch, a new owner
        conn.execute(
            text("UPDATE twopc_lease SET epoch = epoch + 1, owner = 'thief' WHERE node_id = :n"),
            {"n": setup.log.node_id},
        )
    with pytest.raises(TransactionRolledBack, match="no longer ours"):
        tx.commit()
    assert "t1" not in transfer_ids(setup.home) | transfer_ids(setup.away)
    assert prepared_gids(setup.away) == [] and setup.decision_rows() == []


def test_a_lost_answer_is_settled_by_fencing_then_reading(
    setup: Setup, managers: list[TransactionManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The carrier's connection dies as its commit is sent: the outcome is unknown, the other
    branch stays prepared, and recovery settles it only after the fence (the rows say what
    happened; here the server never saw the COMMIT, so it is rolled back)."""
    orders = PostgresResource(setup.home, "orders")
    stock = PostgresResource(setup.away, "stock")
    tm = manager(managers, setup, orders, stock)
    sent = PostgresResource.commit_carrying

    def killed_first(self: PostgresResource, xid: Any, *args: Any, **kw: Any) -> None:
        dbapi = self._branch(xid).dbapi
        pid = dbapi.info.backend_pid if hasattr(dbapi, "info") else dbapi.get_backend_pid()
        with setup.home.connect() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        sent(self, xid, *args, **kw)

    monkeypatch.setattr(PostgresResource, "commit_carrying", killed_first)
    tx = tm.begin()
    transfer(tx, orders, stock, "t1")
    with pytest.raises(OutcomeUnknownError):
        tx.commit()
    monkeypatch.setattr(PostgresResource, "commit_carrying", sent)
    assert len(prepared_gids(setup.away)) == 1  # nothing guessed
    report = tm.recover()
    assert report.clean
    assert prepared_gids(setup.away) == []
    assert "t1" not in transfer_ids(setup.home) | transfer_ids(setup.away)
    assert total(setup.home) + total(setup.away) == 8000
