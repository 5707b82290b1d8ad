"""Prepares in flight: a branch's prepare sent, and its vote read after the others' prepares.

Phase one asks each branch in turn, so a transaction over PostgreSQL and Redis waits for
PostgreSQL's PREPARE TRANSACTION and then for Redis's prepare script, each a round trip with a
forced write behind it. A resource whose prepare is one request to a server can instead send it,
let the coordinator prepare the other branches while the server works, and read the vote after:
the two waits overlap without a thread (``parallel=True`` overlaps them with the branch pool, at a
pool job and two wake-ups per branch). Nothing of the protocol moves: every vote is read before
the votes are tallied, so no decision is made on a vote not yet heard, and a no anywhere rolls
back every branch, including one whose prepare was in flight.

The contract, one optional method (found once per class, as ``commit_lazily`` is):

``send_prepare(xid) -> finish``
    Start what ``prepare(xid)`` does and return without waiting for the server's answer.
    ``finish()`` waits for it and returns what ``prepare(xid)`` would have returned, or raises
    what it would have raised (a no vote). The coordinator calls ``finish`` exactly once, on the
    same thread, before it tallies the votes or rolls the branch back; between the two it only
    prepares other branches. ``send_prepare`` raising is a no vote with nothing in flight.

Only the sequential phase one of a transaction with two or more branches uses it (with
``parallel=True`` the branch pool overlaps the prepares already); the branches that can send are
sent first, in commit order, then the others are prepared in order (stopping at a no as usual),
then every vote in flight is read, in order. ``tm.after_prepare.<n>`` fires after the n-th vote
heard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

from ._verbs import SEND, verbs_of
from .resource import Vote
from .xid import Xid

if TYPE_CHECKING:
    from .transaction import Branch


class EarlyPreparer(Protocol):
    def send_prepare(self, xid: Xid) -> Callable[[], Vote]: ...


def senders(branches: list[Branch]) -> list[Branch]:
    """The branches whose prepare can be in flight while others prepare."""
    return [b for b in branches if verbs_of(b.resource) & SEND]


def send_prepare(branch: Branch) -> Callable[[], Vote]:
    """Send ``branch``'s prepare (one of `senders`); the function returned reads its vote."""
    return cast(EarlyPreparer, branch.resource).send_prepare(branch.xid)
