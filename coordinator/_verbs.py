"""Which optional phase-two verbs a resource class offers, answered once per class.

Phase two asks this of every branch of every two-phase commit, so the answer is a dictionary
lookup by class (a missing attribute would cost an exception inside ``getattr`` each time), and
one lookup answers for every optional verb: `lazy_commit`'s ``commit_lazily`` and
`batch_commit`'s ``commit_batch``.
"""

from __future__ import annotations

LAZY = 1  # commit_lazily
BATCH = 2  # commit_batch and batch_key

#: resource class -> its optional verbs (bits); read inline on the hot path, filled by `learn`
VERBS: dict[type, int] = {}


def learn(kind: type) -> int:
    found = (LAZY if callable(getattr(kind, "commit_lazily", None)) else 0) | (
        BATCH if callable(getattr(kind, "commit_batch", None)) else 0
    )
    VERBS[kind] = found
    return found


def verbs_of(resource: object) -> int:
    kind = type(resource)
    found = VERBS.get(kind)
    return found if found is not None else learn(kind)
