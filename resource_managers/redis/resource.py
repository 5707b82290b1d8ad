"""`RedisResource`: a Redis server (or one hash slot of a cluster) as a two-phase participant.

Redis has no PREPARE, so a branch makes one out of Lua scripts, each atomic on the server:

- **Work.** ``tx.join(cache)`` returns a `RedisBranch`. Writes are buffered in it as Redis
  commands; reads go to the server and see the branch's own writes (`branch` says how).
- **prepare** (one script): refuse if the branch's record says ``aborted`` (the tombstone a
  rollback leaves, so a late prepare after recovery rolled the branch back fails); check the
  watched keys (SHA-1 of a string's value, or of ``DUMP``) and the per-key locks; *validate the
  whole write set* against the current data, simulating each command's effect on types and
  values, so the commit script cannot fail half-way (a failing ``redis.call`` aborts a script
  but keeps its earlier writes); then take the locks (``<prefix>lock:<key>`` = the branch's
  gid), stage the write set in a list, mark the branch ``prepared`` and add it to the prepared
  sorted set. A lock held by another branch makes prepare retry for up to ``lock_wait``
  seconds, then vote no.
- **commit** (one script): ``committed`` already: nothing to do. Otherwise validate again (a
  writer that bypasses twopc may have broken a key since; then nothing is written, the locks are
  released and the outcome is a heuristic rollback), apply the staged commands in order, release
  the locks, and leave a ``committed`` marker for ``tombstone_ttl`` seconds so that a repeated
  commit is recognised. **rollback** releases the locks and leaves the ``aborted`` tombstone.
  **recover** reads the prepared sorted set.
- **One phase** (Redis is the only participant): one script checks and applies the write set and
  leaves a ten-minute marker, so a call that redis-py repeats after a lost reply is not applied
  twice.

Keys: everything of twopc's lives under ``<namespace>:{<tag>}:`` (``tx:<gid>`` hash,
``ws:<gid>`` list, ``prepared`` zset, ``lock:<key>``). Keys and values are bytes end to end and
reach Lua only through ``KEYS``/``ARGV``; every key a prepare touches is in ``KEYS`` (a commit of
plain SETs and a rollback read theirs from the staged set, see ``lua/common.lua``). On Redis
Cluster a branch lives in one hash slot: pass ``hash_tag`` and use keys containing ``{tag}``; a key
of another slot is refused when the branch first touches it (a cluster-aware variant, one branch
per slot, can come later).

Durability: a prepare is a promise only if Redis keeps it across a crash. On first use the
resource reads ``appendonly``, ``appendfsync`` and ``maxmemory-policy`` and refuses a server that
is not ``yes``/``always``/``noeviction`` (eviction can drop staged sets, locks and tombstones),
unless it was created with ``durability="relaxed"`` (then it warns once). Replicas are not
checked: a failover to a replica that had not received the prepare loses it (``WAITAOF``,
Redis >= 7.2, could cover replicas; this server line has 7.0).

What a branch does **not** protect against:

- Writers that bypass twopc see and change data freely: locks are cooperative, honoured only by
  twopc branches. Such a change is caught only where a branch watched the key (it then votes no)
  or where it makes the staged commands invalid (then the commit applies nothing and reports a
  heuristic rollback).
- Readers outside twopc see committed values only, but not atomically across keys: a plain
  ``MGET`` during a commit script cannot run (scripts are atomic), yet two separate reads may
  straddle it.
- Between prepare and commit the staged writes are invisible to everyone, including the branch's
  own later transactions; keys locked by a prepared branch make other branches wait or vote no
  until it is committed or rolled back (by recovery, if its coordinator died).
- A tombstone lasts ``tombstone_ttl`` seconds: a commit re-driven after that finds no record and
  reports a heuristic hazard rather than guess.

One class over one lock, written by concern: this module builds the resource and starts
branches; `._reads` answers a branch's reads, `._prepare` and `._commit` are phases one and two,
`._recovery` lists prepared branches and reads the gauges; `._base` holds the shared state and
the plumbing (key names, running a script, errors, the durability check).
"""

from __future__ import annotations

import re
from typing import Any

from redis.cluster import RedisCluster
from redis.crc import key_slot

from coordinator import ConfigurationError, Xid
from resource_managers.bookkeeping import Branches

from ._base import MAGIC, ONE_PHASE_MARKER_TTL
from ._commit import CommitOps
from ._durability import REQUIRED
from ._errors import BranchConflict, BranchFailed, DurabilityWarning
from ._reads import ReadOps
from ._recovery import RecoveryOps
from .branch import RedisBranch
from .scripts import Scripts

__all__ = [
    "MAGIC",
    "ONE_PHASE_MARKER_TTL",
    "REQUIRED",
    "BranchConflict",
    "BranchFailed",
    "DurabilityWarning",
    "RedisResource",
]


_NAMESPACE = re.compile(r"[A-Za-z0-9._:-]{1,64}\Z")


class RedisResource(ReadOps, CommitOps, RecoveryOps):
    """A redis-py client (`redis.Redis` or `redis.cluster.RedisCluster`) as a resource manager.

    ``name`` is the branch qualifier in every gid and the decision log: keep it stable.
    ``namespace`` and ``hash_tag`` place twopc's own keys (``<namespace>:{<tag>}:``; the tag
    defaults to the namespace); several resources may share a namespace. ``hash_tag`` is required
    on a cluster, where every key of a branch must contain ``{hash_tag}``; ``single_slot=True``
    applies that rule on a standalone server too (to keep code portable to a cluster).
    ``lock_wait``: how long prepare waits for a key locked by another branch before voting no.
    ``tombstone_ttl``: how long the committed marker and the aborted tombstone are kept (longer
    than recovery can take to re-drive a decision). ``blind_writes=True``: buffered writes return
    None instead of reading the server (see `RedisBranch`). ``commit_chunk``: a prepared branch
    of more plain ``SET``s than this is committed in steps of at most this many SETs (then of
    this many lock releases), one script call each, so phase two never holds the server for
    long; readers outside twopc may then see part of the branch applied while it runs (None:
    every branch in one call, all at once).
    """

    def __init__(
        self,
        client: Any,
        name: str = "redis",
        *,
        namespace: str = "twopc",
        hash_tag: str | None = None,
        durability: str = "strict",
        lock_wait: float = 2.0,
        tombstone_ttl: int = 24 * 3600,
        sort_key: str | None = None,
        blind_writes: bool = False,
        single_slot: bool | None = None,
        commit_chunk: int | None = None,
    ) -> None:
        Branches.__init__(self, name, sort_key)
        for label, value in (("namespace", namespace), ("hash_tag", hash_tag)):
            if value is not None and not _NAMESPACE.match(value):
                raise ConfigurationError(
                    f"{label} {value!r}: 1-64 characters from letters, digits, '.', '_', ':', '-'"
                )
        if durability not in ("strict", "relaxed"):
            raise ConfigurationError(
                f"durability must be 'strict' or 'relaxed', not {durability!r}"
            )
        if not lock_wait >= 0 or isinstance(tombstone_ttl, bool) or int(tombstone_ttl) < 1:
            raise ConfigurationError("lock_wait must be >= 0 and tombstone_ttl >= 1 second")
        if commit_chunk is not None and (
            isinstance(commit_chunk, bool) or not isinstance(commit_chunk, int) or commit_chunk < 1
        ):
            raise ConfigurationError(
                f"commit_chunk must be a whole number >= 1, not {commit_chunk!r}"
            )
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self.single_slot = self.cluster if single_slot is None else single_slot
        if self.single_slot and hash_tag is None:
            raise ConfigurationError(
                f"{name}: on Redis Cluster a branch lives in one hash slot: pass hash_tag='...' "
                "and use keys that contain {hash_tag}"
            )
        self.hash_tag = hash_tag or namespace
        self.prefix = f"{namespace}:{{{self.hash_tag}}}:".encode()
        self._slot = key_slot(self.hash_tag.encode())
        self.durability = durability
        self.lock_wait = float(lock_wait)
        self.tombstone_ttl = int(tombstone_ttl)
        self.blind_writes = blind_writes
        self.commit_chunk = commit_chunk
        self._staged: dict[Xid, list[bytes]] = {}
        self._scripts = Scripts(client, self.cluster)
        self._encoder = client.get_encoder()
        self._durability_checked = False

    def __repr__(self) -> str:
        return f"RedisResource({self._name!r}, {self._where()}, prefix={self.prefix!r})"

    # -- phase zero: the branch's work -----------------------------------------------------------

    def start(self, xid: Xid) -> RedisBranch:
        self._check_durability()
        return self._begin(xid, RedisBranch(self, xid))
