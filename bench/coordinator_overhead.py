"""Coordinator CPU per transaction, with two in-memory no-op resources.

What it isolates: the coordinator's own work (state machine, votes, decision record, metrics),
not any server. Measured as process CPU time (all threads) per two-phase transaction, for the log
in memory and on disk, with and without a transaction timeout (a timeout moves completion onto a
pool thread so a hung resource cannot hold the caller). Baseline named side by side: the
`transaction` package (zope) driving two no-op data managers, which has no log at all.

Run: python bench/coordinator_overhead.py   (prints; asserts nothing). Target: under 100 us.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator import FileDecisionLog, MemoryDecisionLog, Outcome, TransactionManager, Vote, Xid

N = 20_000


class NoOpResource:
    def __init__(self, name: str) -> None:
        self.name = self.sort_key = name

    def start(self, xid: Xid) -> None:
        return None

    def prepare(self, xid: Xid) -> Vote:
        return Vote.COMMIT

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        return None

    def rollback(self, xid: Xid) -> Outcome | None:
        return None

    def recover(self) -> list[Xid]:
        return []

    def forget(self, xid: Xid) -> None:
        return None


def per_tx_cpu(tm: TransactionManager, timeout: float | None, n: int = N) -> tuple[float, float]:
    """(CPU us per transaction, wall us per transaction)."""
    a, b = NoOpResource("a"), NoOpResource("b")
    for _ in range(200):  # warm-up: pools, caches
        with tm.transaction(timeout) as tx:
            tx.join(a)
            tx.join(b)
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        with tm.transaction(timeout) as tx:
            tx.join(a)
            tx.join(b)
    return (time.process_time() - cpu) / n * 1e6, (time.perf_counter() - wall) / n * 1e6


def zope_baseline(n: int = N) -> float | None:
    try:
        import transaction as zope_tx
    except ImportError:
        return None

    class DM:
        def __init__(self, key: str) -> None:
            self.key = key

        def sortKey(self) -> str:  # zope's interface
            return self.key

        def abort(self, t: Any) -> None: ...
        def tpc_begin(self, t: Any) -> None: ...
        def commit(self, t: Any) -> None: ...
        def tpc_vote(self, t: Any) -> None: ...
        def tpc_finish(self, t: Any) -> None: ...
        def tpc_abort(self, t: Any) -> None: ...

    manager = zope_tx.TransactionManager()
    cpu = time.process_time()
    for _ in range(n):
        t = manager.begin()
        t.join(DM("a"))
        t.join(DM("b"))
        manager.commit()
    return (time.process_time() - cpu) / n * 1e6


def main() -> None:
    rows: list[tuple[str, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for log_name, make_log in (
            ("memory", MemoryDecisionLog),
            ("file (fsync)", lambda: FileDecisionLog(Path(tmp) / "log")),
        ):
            n = N if log_name == "memory" else 2_000
            for timeout in (None, 60.0):
                tm = TransactionManager(
                    "bench", make_log(), recovery_interval=None, reaper_interval=None
                )
                cpu, wall = per_tx_cpu(tm, timeout, n)
                tm.close()
                rows.append((f"twopc, log {log_name}, timeout={timeout}", cpu, wall))
    zope = zope_baseline()
    print(f"{'configuration':<44} {'CPU us/tx':>10} {'wall us/tx':>11} {'ratio to zope':>14}")
    for name, cpu, wall in rows:
        ratio = f"{cpu / zope:.2f}x" if zope else "n/a"
        print(f"{name:<44} {cpu:>10.1f} {wall:>11.1f} {ratio:>14}")
    if zope:
        print(f"{'transaction (zope), no log, reference':<44} {zope:>10.1f} {'':>11} {'1.00x':>14}")
    print("target: under 100 us of coordinator CPU per transaction")


if __name__ == "__main__":
    main()
