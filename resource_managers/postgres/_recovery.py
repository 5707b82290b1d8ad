"""What `PostgresResource` tells recovery and an operator: its prepared branches, their
outcome markers (read, forgotten, purged) and the prepared-transaction gauges."""

from __future__ import annotations

import time
from typing import Any

from coordinator import Xid
from coordinator.xid import branches_of
from resource_managers.bookkeeping import PreparedGauges

from ._base import PostgresBase


class RecoveryOps(PostgresBase, PreparedGauges):
    """`PostgresResource`'s recovery, markers and gauges."""

    # -- recovery ----------------------------------------------------------------------------------

    def recover(self) -> list[Xid]:
        """Our prepared branches (and sub-branches) in this database, owned by our role, of any
        age."""
        found = self._prepared("", None)
        self._purge_markers()
        return found

    def recover_gtrid(self, gtrid: str) -> list[Xid]:
        """`recover` narrowed to one global transaction by the statement itself (``starts_with``
        on the gid's fixed prefix), not by reading every prepared transaction of the server: a
        Spark task asks this before it writes, with every other partition's branch prepared."""
        prefix = Xid.branch_of(gtrid, "x").to_gid().rsplit("_", 1)[0] + "_"
        found = self._prepared(" AND starts_with(gid, %s)", [prefix])
        return [xid for xid in found if xid.gtrid == gtrid]

    def _prepared(self, narrower: str, params: list[Any] | None) -> list[Xid]:
        """Our prepared branches and sub-branches, the query narrowed by ``narrower`` (SQL)."""
        if self._held:
            self._release_expired()
        rows = self._pool.query(
            "SELECT gid FROM pg_prepared_xacts "
            "WHERE database = current_database() AND owner = current_user" + narrower,
            params,
        )
        return branches_of((str(gid) for (gid,) in rows), self._name, sub_branches=True)

    def forget(self, xid: Xid) -> None:
        facts = self._server_facts()
        if facts.marker_table is not None:
            self._pool.run(f"DELETE FROM {facts.marker_table} WHERE gid = %s", [xid.to_gid()])

    def prepared_stats(self) -> tuple[int, float]:
        """(count, age in seconds of the oldest) of this database's prepared transactions.

        Every prepared transaction holds its locks and the VACUUM horizon, ours or not.
        """
        rows = self._pool.query(
            "SELECT count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(prepared)), 0) "
            "FROM pg_prepared_xacts WHERE database = current_database()"
        )
        count, age = rows[0]
        return int(count), float(age)

    def _purge_markers(self) -> None:
        """Markers and abort fences past ``marker_retention``, once a minute at most."""
        facts = self._server_facts()
        now = time.monotonic()
        if now - self._last_purge < 60:
            return
        self._last_purge = now
        if facts.marker_table is not None:
            self._pool.run(
                f"DELETE FROM {facts.marker_table} "
                "WHERE committed_at < now() - make_interval(secs => %s)",
                [self._marker_retention],
            )
        if facts.decisions is not None:
            self._pool.run(*facts.decisions.purge_fences(self._marker_retention))
