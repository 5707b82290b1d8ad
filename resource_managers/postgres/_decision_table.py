"""The SQL of a PostgreSQL last resource's decision table (`coordinator.last_resource`).

One row per gtrid: ``outcome`` ``'c'`` is a commit decision, inserted inside the branch's own
transaction and committed with it; ``'a'`` is an abort fence, inserted by recovery before it
presumes a gtrid aborted. The primary key on ``gtrid`` is the whole of the synchronisation: a
commit and a fence of one gtrid cannot both be inserted, and whichever comes second either waits
for the first (still uncommitted) and then conflicts, or conflicts at once. No clock decides.

Why the fence and the read are two statements in one round trip, not one statement with a
data-modifying CTE: a statement's snapshot is taken when it starts, so a SELECT in the same
statement as ``INSERT ... ON CONFLICT DO NOTHING`` would not see a commit row that the INSERT had
to wait for, and recovery would presume abort of a committed transaction. Under READ COMMITTED
each statement of a multi-statement query takes a new snapshot; under a stricter isolation level
the wait ends in a serialization failure, which is an error, never a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: a fence waiting this long on a commit still running gives up (and recovery retries later)
LOCK_TIMEOUT_MS = 5000


@dataclass(frozen=True)
class DecisionTable:
    """Statements on one decision table; ``table`` is schema-qualified and quoted."""

    table: str

    def ddl(self) -> str:
        return (
            f"CREATE TABLE IF NOT EXISTS {self.table} (gtrid text PRIMARY KEY, "
            "node_id text NOT NULL, outcome text NOT NULL CHECK (outcome IN ('c', 'a')), "
            "branches text[] NOT NULL DEFAULT '{}', "
            "written_at timestamptz NOT NULL DEFAULT now())"
        )

    def commit(
        self, gtrid: str, node_id: str, branches: tuple[str, ...], ended: list[str]
    ) -> tuple[str, list[Any]]:
        """The decision row, the deletion of rows whose transactions ended, and the COMMIT: one
        round trip, one server commit for the branch's data and its decision."""
        sql = (
            f"INSERT INTO {self.table} (gtrid, node_id, outcome, branches) "
            "VALUES (%s, %s, 'c', %s); "
        )
        params: list[Any] = [gtrid, node_id, list(branches)]
        if ended:
            sql += f"DELETE FROM {self.table} WHERE gtrid = ANY(%s) AND outcome = 'c'; "
            params.append(ended)
        return sql + "COMMIT", params

    def fence_and_read(self, gtrids: list[str]) -> tuple[str, list[Any]]:
        """Abort rows for the gtrids without a row, then (new snapshot) the committed ones."""
        sql = (
            f"SELECT set_config('lock_timeout', '{LOCK_TIMEOUT_MS}', true); "
            f"INSERT INTO {self.table} (gtrid, node_id, outcome) "
            "SELECT g, split_part(g, ':', 1), 'a' FROM unnest(CAST(%s AS text[])) AS g "
            "ON CONFLICT (gtrid) DO NOTHING; "
            f"SELECT gtrid FROM {self.table} WHERE gtrid = ANY(%s) AND outcome = 'c'"
        )
        return sql, [gtrids, gtrids]

    def committed(self, node_id: str) -> tuple[str, list[Any]]:
        sql = f"SELECT gtrid, branches FROM {self.table} WHERE node_id = %s AND outcome = 'c'"
        return sql, [node_id]

    def drop(self, gtrids: list[str]) -> tuple[str, list[Any]]:
        sql = f"DELETE FROM {self.table} WHERE gtrid = ANY(%s) AND outcome = 'c'"
        return sql, [gtrids]

    def purge_fences(self, retention: float) -> tuple[str, list[Any]]:
        """Abort rows older than ``retention`` seconds: long past any transaction's deadline."""
        sql = (
            f"DELETE FROM {self.table} WHERE outcome = 'a' "
            "AND written_at < now() - make_interval(secs => %s)"
        )
        return sql, [retention]
