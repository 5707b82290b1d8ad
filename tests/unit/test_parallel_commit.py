"""Parallel phase two: with ``parallel=True`` every branch is told to commit at once."""

from __future__ import annotations

import threading

from coordinator import MemoryDecisionLog, Outcome, TransactionManager, Vote, Xid


class MeetingResource:
    """Commits only if all its peers are committing at the same moment (a barrier)."""

    def __init__(self, name: str, barrier: threading.Barrier) -> None:
        self.name = self.sort_key = name
        self.barrier = barrier
        self.committed: list[Xid] = []

    def start(self, xid: Xid) -> None:
        return None

    def prepare(self, xid: Xid) -> Vote:
        return Vote.COMMIT

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        self.barrier.wait()  # raises BrokenBarrierError if the commits ran one after another
        self.committed.append(xid)
        return None

    def rollback(self, xid: Xid) -> Outcome | None:
        return None

    def recover(self) -> list[Xid]:
        return []

    def forget(self, xid: Xid) -> None:
        return None


def test_parallel_mode_commits_every_branch_at_once() -> None:
    barrier = threading.Barrier(3, timeout=5)
    resources = [MeetingResource(name, barrier) for name in "abc"]
    tm = TransactionManager(
        "par-1", MemoryDecisionLog(), resources, parallel=True, recovery_interval=None
    )
    try:
        with tm.transaction() as tx:
            for r in resources:
                tx.join(r)
        assert tx.outcome == Outcome.COMMITTED
        assert all(len(r.committed) == 1 for r in resources)
        assert tm.log.pending() == []  # END written: every branch answered
    finally:
        tm.close()
