"""Coordinator CPU per transaction, with two in-memory no-op resources.

What it isolates: the coordinator's own work (state machine, votes, decision record, metrics),
not any server. Measured as process CPU time (all threads) per two-phase transaction, for the log
in memory and on disk, with and without a transaction timeout, completing on the caller's thread
(the default) or, with ``inline_completion=False``, on a pool thread so a hung resource cannot
hold the caller. Baseline named side by side: the `transaction` package (zope) driving two no-op
data managers, which has no log at all.

Run: python bench/coordinator_overhead.py [--json PATH]   (prints; asserts nothing).
Target (issue 13): file log, default timeout, at most 60 us of user CPU per transaction.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
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


def _cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def per_tx_cpu(
    tm: TransactionManager, timeout: float | None, n: int = N
) -> tuple[float, float, float]:
    """(user CPU, system CPU, wall) in us per transaction.

    User CPU is the coordinator's own work; system CPU is mostly the kernel's write+fsync of
    the decision record (and thread wake-ups), which is the disk's cost, not ours.
    """
    a, b = NoOpResource("a"), NoOpResource("b")
    for _ in range(200):  # warm-up: pools, caches
        with tm.transaction(timeout) as tx:
            tx.join(a)
            tx.join(b)
    (user, system), wall = _cpu(), time.perf_counter()
    for _ in range(n):
        with tm.transaction(timeout) as tx:
            tx.join(a)
            tx.join(b)
    user2, system2 = _cpu()
    scale = 1e6 / n
    return (user2 - user) * scale, (system2 - system) * scale, (time.perf_counter() - wall) * scale


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
    user = _cpu()[0]
    for _ in range(n):
        t = manager.begin()
        t.join(DM("a"))
        t.join(DM("b"))
        manager.commit()
    return (_cpu()[0] - user) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows: list[tuple[str, float, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for log_name, make_log in (
            ("memory", MemoryDecisionLog),
            ("file (fsync)", lambda: FileDecisionLog(Path(tmp) / "log")),
        ):
            n = N if log_name == "memory" else 2_000
            for timeout, inline in ((None, True), (60.0, True), (60.0, False)):
                tm = TransactionManager(
                    "bench", make_log(), recovery_interval=None, reaper_interval=None,
                    inline_completion=inline,
                )  # fmt: skip
                where = "" if timeout is None else (", inline" if inline else ", pool")
                rows.append(
                    (f"twopc, log {log_name}, timeout={timeout}{where}",
                     *per_tx_cpu(tm, timeout, n))
                )  # fmt: skip
                tm.close()
                shutil.rmtree(Path(tmp) / "log", ignore_errors=True)
    zope = zope_baseline()
    head = f"{'configuration':<42} {'user us/tx':>10} {'sys us/tx':>10} {'wall us/tx':>10}"
    print(f"{head} {'user vs zope':>13}")
    for name, user, system, wall in rows:
        ratio = f"{user / zope:.2f}x" if zope else "n/a"
        print(f"{name:<42} {user:>10.1f} {system:>10.1f} {wall:>10.1f} {ratio:>13}")
    if zope:
        name = "transaction (zope), no log, reference"
        print(f"{name:<42} {zope:>10.1f} {'':>10} {'':>10} {'1.00x':>13}")
    print("target: file log, default timeout: at most 60 us of user CPU per transaction")
    if args.json:
        out = [{"row": name, "user_us": u, "sys_us": s_, "wall_us": w} for name, u, s_, w in rows]
        if zope:
            out.append({"row": "zope", "user_us": zope})
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
