"""Batch commits: phase two of several branches on one server in one round trip.

Phase two tells each branch to commit, one call and so one round trip per branch. Several branches
of one transaction may live on the same server behind the same connection pool (two Redis
resources sharing a client, say): their commits need not wait for each other's replies, so a
resource that can pipeline them may take the whole group at once. Nothing of the protocol moves:
the decision is durable before the batch is sent, and each branch's commit is the same idempotent
call it would have been alone, so a batch that fails part-way leaves exactly what individual
commits failing at those branches would leave — branches committed, and branches left prepared
for recovery to commit again from the decision.

The contract, two optional members (`batch_committer` tells whether a resource has them):

``batch_key``
    A hashable value naming what the resource's commits can travel through together (the
    connection pool), or None when this instance cannot batch (a cluster client, say). Branches
    of one transaction whose resources answer the same key are committed as one batch, by the
    first of them in commit order; a group of one is committed alone.

``commit_batch(branches)``
    ``branches`` is a list of ``(resource, xid)`` pairs, every resource answering this one's
    ``batch_key``, each branch prepared. Returns one answer per pair, in order: what
    ``resource.commit(xid)`` would have returned (None or a heuristic `Outcome`), or the exception
    it would have raised (that branch's commit is not confirmed: recovery will commit it again).
    Raising leaves every branch of the batch to recovery. A batch is always durable: a resource
    that also commits lazily (`lazy_commit`) does not do so inside a batch.

Only phase two on the coordinator's own path batches: recovery and remote callers commit each
branch with ``commit``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ._verbs import BATCH, verbs_of
from .resource import Outcome, Resource
from .xid import Xid

if TYPE_CHECKING:
    from .transaction import Branch

Answer = Outcome | None | BaseException


class BatchCommitter(Protocol):
    @property
    def batch_key(self) -> Hashable | None: ...

    def commit_batch(self, branches: Sequence[tuple[Resource[Any], Xid]]) -> list[Answer]: ...


def batch_committer(resource: object) -> BatchCommitter | None:
    """The resource, if its class offers `commit_batch` (`_verbs`: answered once per class)."""
    return resource if verbs_of(resource) & BATCH else None  # type: ignore[return-value]


def batches(branches: list[Branch]) -> dict[str, list[Branch]] | None:
    """Branch name -> the batch it is committed in, for every branch sharing its batch key with
    another; None (the common case, nothing allocated) when no two branches share one."""
    found: dict[Hashable, list[Branch]] | None = None
    for branch in branches:
        able = batch_committer(branch.resource)
        key = able.batch_key if able is not None else None
        if key is not None:
            if found is None:
                found = {}
            found.setdefault(key, []).append(branch)
    if found is None:
        return None
    grouped = {b.resource.name: unit for unit in found.values() if len(unit) > 1 for b in unit}
    return grouped or None
