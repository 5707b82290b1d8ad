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

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from coordinator.decision_log import DecisionLog


@dataclass(frozen=True)
class Committed:
    """A committed write: its branches (bquals) and whether its decision is still pending."""

    gtrid: str
    branches: tuple[str, ...]
    pending: bool


class Ledger:
    """The ``<prefix>spark_ledger`` table of the log database."""

    def __init__(self, engine: Engine, table_prefix: str = "twopc_") -> None:
        self.engine = engine
        self.table = sa.Table(
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
