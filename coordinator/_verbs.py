"""Which optional verbs of phases one and two a resource class offers, answered once per class.

Both phases ask this of every branch of every two-phase commit, so the answer is a dictionary
lookup by class (a missing attribute would cost an exception inside ``getattr`` each time), and
one lookup answers for every optional verb: `lazy_commit`'s ``commit_lazily``, `batch_commit`'s
``commit_batch``, `early_prepare`'s ``send_prepare`` and `carried`'s ``stage``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

LAZY = 1  # commit_lazily
BATCH = 2  # commit_batch and batch_key
SEND = 4  # send_prepare
CARRY = 8  # stage (`carried`: a branch the last resource's commit carries)

#: resource class -> its optional verbs (bits); read inline on the hot path, filled by `learn`
VERBS: dict[type, int] = {}


def learn(kind: type) -> int:
    found = 0
    for bit, verb in (
        (LAZY, "commit_lazily"),
        (BATCH, "commit_batch"),
        (SEND, "send_prepare"),
        (CARRY, "stage"),
    ):
        if callable(getattr(kind, verb, None)):
            found |= bit
    VERBS[kind] = found
    return found


def verbs_of_branches(branches: Iterable[Any]) -> int:
    """The verbs any of ``branches`` (`Branch`es) offers: one inline lookup per branch."""
    verbs = 0
    for branch in branches:
        found = VERBS.get(type(branch.resource))
        verbs |= found if found is not None else learn(type(branch.resource))
    return verbs


def verbs_of(resource: object) -> int:
    kind = type(resource)
    found = VERBS.get(kind)
    return found if found is not None else learn(kind)
