"""Was this Spark write committed? The one question both sides ask, answered from the log database.

Why a ledger as well as the decision log: the SQL decision log keeps a COMMIT only until END
(``END`` deletes the row: presumed abort keeps the log small). A Spark batch, though, can be
replayed long after it ended — a driver restart re-runs the last micro-batch, a batch job is
re-run with the same ``txnVersion`` — and must then write nothing. So the driver adds one more
branch to every commit: a row ``(gtrid, winners)`` in ``<prefix>spark_ledger``, inserted in a
prepared transaction on the log's own database and named in the decision like every other branch.
It commits exactly when the batch does (recovery finishes it with the rest), and it is there
before the END removes the decision. Hence the rule, read in this order: a pending decision for
the gtrid, else a ledger row, else not committed. (Reading the ledger first could miss both: the
ledger row not yet committed, then the decision already ended.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from coordinator.decision_log import DecisionLog
from resource_managers.postgres._log_sql import tables


@dataclass(frozen=True)
class Committed:
    """A committed write: its branches (bquals) and whether its decision is still pending."""

    gtrid: str
    branches: tuple[str, ...]
    pending: bool


@lru_cache(maxsize=16)
def _ledger_table(table_prefix: str) -> sa.Table:
    """One Table object per prefix for the process, so SQLAlchemy's compiled cache serves every
    task's statements (a Table made per call missed it: a compile per statement per task)."""
    return sa.Table(
        f"{table_prefix}spark_ledger",
        sa.MetaData(),
        sa.Column("gtrid", sa.Text, nullable=False, index=True),
        sa.Column("branches", sa.Text, nullable=False),  # JSON list of bquals
        sa.Column(
            "committed_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.func.now(),
        ),
    )


@lru_cache(maxsize=16)
def _check(table_prefix: str) -> sa.CompoundSelect[Any]:
    """`committed_at_once`'s statement for a table prefix (built once per process)."""
    decision = tables(table_prefix, None)[2]
    ledger = _ledger_table(table_prefix)
    gtrid: sa.BindParameter[str] = sa.bindparam("gtrid", type_=sa.Text())
    node: sa.BindParameter[str] = sa.bindparam("node", type_=sa.Text())
    from_decision = sa.select(sa.literal(1).label("pending"), decision.c.branches).where(
        decision.c.node_id == node, decision.c.gtrid == gtrid
    )
    from_ledger = sa.select(sa.literal(0).label("pending"), ledger.c.branches).where(
        ledger.c.gtrid == gtrid
    )
    return sa.union_all(from_decision, from_ledger)


class Ledger:
    """The ``<prefix>spark_ledger`` table of the log database."""

    def __init__(self, engine: Engine, table_prefix: str = "twopc_") -> None:
        self.engine = engine
        self.table = _ledger_table(table_prefix)

    def ensure(self) -> None:
        """Create the table if missing (the driver does, before its first ledger branch)."""
        for attempt in range(3):
            try:
                with self.engine.begin() as conn:
                    self.table.create(conn, checkfirst=True)
                return
            except sa.exc.DBAPIError:
                if attempt == 2:  # two drivers creating it at once: one loses, then sees it
                    raise

    def record(self, session: Session, gtrid: str, branches: tuple[str, ...]) -> None:
        """Insert the row inside the driver's branch (it commits with the decision)."""
        session.execute(
            sa.insert(self.table).values(gtrid=gtrid, branches=json.dumps(list(branches)))
        )

    def lookup(self, gtrid: str) -> tuple[str, ...] | None:
        """The branches of a committed ledger row of ``gtrid``, else None (also: no table yet)."""
        with self.engine.connect() as conn:
            exists = conn.execute(
                sa.text("SELECT to_regclass(:t) IS NOT NULL"), {"t": self.table.name}
            ).scalar_one()
            if not exists:
                return None
            row = conn.execute(
                sa.select(self.table.c.branches).where(self.table.c.gtrid == gtrid).limit(1)
            ).first()
        return None if row is None else tuple(json.loads(row[0]))


def committed(log: DecisionLog | None, ledger: Ledger, gtrid: str) -> Committed | None:
    """Is ``gtrid`` committed? A pending decision first, then the ledger (see the docstring).
    ``log`` None: the decision log does not exist yet, so only the ledger can know."""
    for decision in log.pending() if log is not None else ():
        if decision.gtrid == gtrid:
            return Committed(gtrid, decision.branches, pending=True)
    branches = ledger.lookup(gtrid)
    return None if branches is None else Committed(gtrid, branches, pending=False)


class TablesMissing(Exception):
    """`committed_at_once` found no decision or ledger table (no driver has made them yet)."""


def committed_at_once(engine: Engine, table_prefix: str, node: str, gtrid: str) -> Committed | None:
    """`committed` in one statement, the executors' check: a pending decision of ``node`` for
    ``gtrid``, else its ledger row, read in one round trip and from one snapshot (READ COMMITTED
    gives a statement one snapshot). One snapshot is at least as safe as the two ordered reads of
    `committed`: the ledger row commits before END deletes the decision, so a snapshot that no
    longer holds the decision holds the ledger row. Raises `TablesMissing` while either table
    does not exist; the caller then asks `committed`, which knows how to read that case."""
    try:
        with engine.connect() as conn:
            rows = conn.execute(_check(table_prefix), {"gtrid": gtrid, "node": node}).all()
    except sa.exc.ProgrammingError as exc:
        if getattr(exc.orig, "pgcode", None) == "42P01":  # undefined_table
            raise TablesMissing(str(exc.orig)) from None
        raise
    if not rows:
        return None
    pending, branches = max(rows, key=lambda r: r[0])  # a pending decision wins
    return Committed(gtrid, tuple(json.loads(branches)), pending=bool(pending))
