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

import functools
import hashlib
from dataclasses import dataclass
from typing import Any

#: a fence waiting this long on a commit still running gives up (and recovery retries later)
LOCK_TIMEOUT_MS = 5000
#: the text of the error a commit of a fenced node incarnation fails with
FENCED_EPOCH = "twopc: a newer process fenced this node epoch"


@dataclass(frozen=True)
class DecisionTable:
    """Statements on one decision table; ``table`` is schema-qualified and quoted."""

    table: str
    #: this process may commit carried branches (`coordinator.carried`): the table has their
    #: columns and ``epochs`` exists, usable by the role (the fence their commits check)
    carries: bool = False
    #: the table of node incarnations (``<table>_epoch``), schema-qualified and quoted
    epochs: str = ""
    #: the table has the carried columns, so rows may hold payloads (of an earlier process,
    #: even where this one may not commit them: recovery must still read and keep them)
    columns: bool = False

    def ddl(self) -> str:
        return (
            f"CREATE TABLE IF NOT EXISTS {self.table} (gtrid text PRIMARY KEY, "
            "node_id text NOT NULL, outcome text NOT NULL CHECK (outcome IN ('c', 'a')), "
            "branches text[] NOT NULL DEFAULT '{}', "
            "written_at timestamptz NOT NULL DEFAULT now(), "
            "carried_names text[] NOT NULL DEFAULT '{}', carried bytea[] NOT NULL DEFAULT '{}'); "
            f"{self.store_payloads_plainly()}"
        )

    def store_payloads_plainly(self) -> str:
        """Payloads kept out of line without compression: a row lives for a moment (deleted by
        a later commit), and compressing kilobytes of base64 on every commit cost the server
        more than it saved (a 43 KB payload's commit took about a third longer compressed)."""
        return f"ALTER TABLE {self.table} ALTER COLUMN carried SET STORAGE EXTERNAL"

    def epochs_ddl(self) -> str:
        return (
            f"CREATE TABLE IF NOT EXISTS {self.epochs} (node_id text NOT NULL, "
            "resource text NOT NULL, epoch bigint NOT NULL, PRIMARY KEY (node_id, resource))"
        )

    def fence_node(self, node_id: str, resource: str) -> tuple[str, list[Any]]:
        """A new incarnation of ``node_id``'s commits through ``resource``: the update waits for
        every commit that checked the old epoch (its ``FOR SHARE`` lock, held to its end), and
        any commit that checks it afterwards fails (see `commit`). Returns the new epoch."""
        sql = (
            f"SELECT set_config('lock_timeout', '{LOCK_TIMEOUT_MS}', true); "
            f"INSERT INTO {self.epochs} AS e (node_id, resource, epoch) VALUES (%s, %s, 1) "
            "ON CONFLICT (node_id, resource) DO UPDATE SET epoch = e.epoch + 1 RETURNING epoch"
        )
        return sql, [node_id, resource]

    def add_carried_columns(self) -> str:
        """What a table made before carried branches needs."""
        return (
            f"ALTER TABLE {self.table} "
            "ADD COLUMN IF NOT EXISTS carried_names text[] NOT NULL DEFAULT '{}', "
            "ADD COLUMN IF NOT EXISTS carried bytea[] NOT NULL DEFAULT '{}'"
        )

    def prepared_statements(self) -> dict[str, str]:
        """The commit's statements as server-side prepared statements, name -> ``PREPARE``.

        Parsing and planning them is most of what the decision row costs the server: about 70
        us of its CPU per commit on a 2-core machine, against the 190 us of an ``INSERT`` and a
        ``COMMIT`` (`._prepared` says when a connection gets them). Each name is a hash of its
        statement's text, so a statement of another table or another version of this code
        never passes for it."""
        return {name: f"PREPARE {name}{body}" for name, body in self._bodies.values()}

    @functools.cached_property
    def _bodies(self) -> dict[str, tuple[str, str]]:
        """kind -> (name, what follows the name in its ``PREPARE``); worked out once."""
        bodies = {
            "decide": (
                f"(text, text, text[]) AS INSERT INTO {self.table} "
                "(gtrid, node_id, outcome, branches) VALUES ($1, $2, 'c', $3)"
            ),
            "drop": (
                f"(text[]) AS DELETE FROM {self.table} WHERE gtrid = ANY($1) AND outcome = 'c'"
            ),
        }
        if self.carries:
            bodies["fence"] = f"(text, text, bigint) AS {self._fence_sql('$1', '$2', '$3')}"
            bodies["carry"] = (
                f"(text, text, text[], text[], bytea[]) AS INSERT INTO {self.table} "
                "(gtrid, node_id, outcome, branches, carried_names, carried) "
                "VALUES ($1, $2, 'c', $3, $4, $5)"
            )
        return {
            kind: (f"twopc_{hashlib.sha1(body.encode()).hexdigest()[:20]}", body)
            for kind, body in bodies.items()
        }

    @functools.cached_property
    def _names(self) -> dict[str, str]:
        return {kind: name for kind, (name, _) in self._bodies.items()}

    def _fence_sql(self, node: str, resource: str, epoch: str) -> str:
        return (
            f"SELECT CASE WHEN count(*) = 1 THEN 1 ELSE CAST('{FENCED_EPOCH} ' || count(*) "
            f"AS int) END FROM (SELECT 1 FROM {self.epochs} WHERE node_id = {node} "
            f"AND resource = {resource} AND epoch = {epoch} FOR SHARE) AS fence"
        )

    def commit(
        self,
        gtrid: str,
        node_id: str,
        branches: tuple[str, ...],
        ended: list[str],
        carried: tuple[tuple[str, bytes], ...] = (),
        *,
        fence: tuple[str, int] | None = None,
        prepared: bool = False,
    ) -> tuple[str, list[Any]]:
        """The decision row (with the payloads of the branches it carries), the deletion of rows
        whose transactions ended, and the COMMIT: one round trip, one server commit for the
        branch's data and its decision.

        A row with payloads first checks ``fence`` (the resource's name and this process's
        epoch of the node) under a ``FOR SHARE`` lock, so a recovery that fenced the node (a
        restarted process, `fence_node`) either waits for this commit to end before it reads
        the rows, or makes it fail (no row of this epoch: a cast of ``FENCED_EPOCH`` to an
        integer, an error whose text says so; the cast depends on the count, so the planner
        cannot fold it into an error of every commit). Without it a
        commit the server was still running for a process that had died could land after the
        restarted process read the rows: no prepared branch names it, so no abort row fences
        it, and a store that cannot see the commit (the cursor, which then hands the messages
        out again) would act on a row it never read.

        ``prepared``: the connection holds `prepared_statements`, so the same statements go as
        ``EXECUTE``s of them."""
        params: list[Any] = [gtrid, node_id, list(branches)]
        names = self._names if prepared else {}
        if carried:
            if fence is None:
                raise ValueError("a commit with carried branches needs its node's fence")
            if prepared:
                sql = (
                    f"EXECUTE {names['fence']}(%s, %s, %s); "
                    f"EXECUTE {names['carry']}(%s, %s, %s, %s, %s); "
                )
            else:
                sql = (
                    f"{self._fence_sql('%s', '%s', '%s')}; "
                    f"INSERT INTO {self.table} (gtrid, node_id, outcome, branches, carried_names, "
                    "carried) VALUES (%s, %s, 'c', %s, %s, %s); "
                )
            params = [node_id, *fence, *params]
            params += [[name for name, _ in carried], [payload for _, payload in carried]]
        elif prepared:
            sql = f"EXECUTE {names['decide']}(%s, %s, %s); "
        else:
            sql = (
                f"INSERT INTO {self.table} (gtrid, node_id, outcome, branches) "
                "VALUES (%s, %s, 'c', %s); "
            )
        if ended:
            sql += (
                f"EXECUTE {names['drop']}(%s); "
                if prepared
                else f"DELETE FROM {self.table} WHERE gtrid = ANY(%s) AND outcome = 'c'; "
            )
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

    def carried_rows(self, node_id: str) -> tuple[str, list[Any]]:
        sql = (
            f"SELECT gtrid, carried_names, carried FROM {self.table} "
            "WHERE node_id = %s AND outcome = 'c' AND cardinality(carried_names) > 0"
        )
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
