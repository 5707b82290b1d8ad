"""What `RedisResource` tells recovery and the metrics: its prepared branches (the prepared
sorted set), forgetting a completed one, and the prepared-branch gauges."""

from __future__ import annotations

from redis.client import NEVER_DECODE

from coordinator import Xid
from coordinator.xid import branches_of
from resource_managers.bookkeeping import PreparedGauges

from ._base import RedisBase


class RecoveryOps(RedisBase, PreparedGauges):
    """`RedisResource`'s recovery and gauges."""

    # -- recovery ----------------------------------------------------------------------------------

    def recover(self) -> list[Xid]:
        """Our prepared branches (this resource's name as bqual, or a sub-branch of it; our format
        id), of any age."""
        with self._errors("reading the prepared set"):
            members = self.client.execute_command(
                "ZRANGE", self._prepared, 0, -1, **{NEVER_DECODE: []}
            )
        # a non-ASCII member decodes to U+FFFD, which no gid holds: skipped like any stranger
        gids = (m.decode("ascii", "replace") for m in members)
        return branches_of(gids, self._name, sub_branches=True)

    def forget(self, xid: Xid) -> None:
        """Drop the marker or tombstone of a completed branch (a prepared one is kept)."""
        gid = xid.to_gid()
        self._run("forget", [self._tx(gid)], [], "forget " + gid)

    def prepared_stats(self) -> tuple[int, float]:
        """(count, age in seconds of the oldest) of the prepared branches in this namespace."""
        with self._errors("reading the prepared set"):
            count = int(self.client.execute_command("ZCARD", self._prepared))
            oldest = self.client.zrange(self._prepared, 0, 0, withscores=True)
            seconds, micros = self.client.time()
        now_ms = seconds * 1000 + micros / 1000
        return count, max(0.0, (now_ms - float(oldest[0][1])) / 1000) if oldest else 0.0
