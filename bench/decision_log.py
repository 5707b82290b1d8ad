"""Forced decisions per second through `FileDecisionLog.log_commit`: group commit against one
write+fsync per record, at 1, 8 and 64 concurrent writer threads.

Prints a table and never asserts: the numbers depend on the disk (an fsync on a laptop SSD, a
cloud volume and tmpfs differ by orders of magnitude), so the filesystem is printed with them.
Both modes run in one process, on temporary directories on the same filesystem.

    python bench/decision_log.py [--decisions 4000] [--dir /path/on/the/disk/to/measure]

``--added-fsync-ms`` sleeps that long after every real fsync, to show what a slower disk (a
network volume: 1-10 ms per fsync) would do; the header says so whenever it is used, since the
numbers are then partly simulated.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WRITERS = (1, 8, 64)


@dataclass
class Result:
    writers: int
    group: bool
    decisions: int
    seconds: float
    cpu_seconds: float
    fsyncs: int

    @property
    def rate(self) -> float:
        return self.decisions / self.seconds

    @property
    def mode(self) -> str:
        return "group" if self.group else "one-fsync"


def slow_disk(added_seconds: float) -> Any:
    """Real I/O, plus a sleep after each fsync (None when nothing is added)."""
    if not added_seconds:
        return None
    from coordinator.journal import OsFileOps

    class SlowFsync(OsFileOps):
        def fsync(self, fd: int) -> None:
            super().fsync(fd)
            time.sleep(added_seconds)

    return SlowFsync()


def run(directory: Path, writers: int, decisions: int, group: bool, added: float) -> Result:
    """One measured run: ``decisions`` forced COMMITs spread over ``writers`` threads."""
    from coordinator.decision_log import Decision, FileDecisionLog

    log = FileDecisionLog(directory, group_commit=group, file_ops=slow_disk(added))
    per_writer = decisions // writers
    start = threading.Barrier(writers + 1)

    def work(n: int) -> None:
        start.wait()
        for i in range(per_writer):
            log.log_commit(Decision(f"bench-{n}-{i}", ("orders-pg", "cache-redis"), None, 0.0))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(writers)]
    for thread in threads:
        thread.start()
    fsyncs_before = log.stats().fsyncs
    start.wait()
    began, cpu_began = time.perf_counter(), time.process_time()
    for thread in threads:
        thread.join()
    seconds, cpu = time.perf_counter() - began, time.process_time() - cpu_began
    fsyncs = log.stats().fsyncs - fsyncs_before
    log.close()
    return Result(writers, group, per_writer * writers, seconds, cpu, fsyncs)


def filesystem(path: Path) -> str:
    """The mount a path lives on, so a reader can tell a real disk from tmpfs."""
    best = ("?", "?", "")
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                device, mount, fstype = line.split()[:3]
                if str(path).startswith(mount) and len(mount) >= len(best[2]):
                    best = (device, fstype, mount)
    except OSError:
        pass
    return f"{best[0]} ({best[1]}) mounted on {best[2] or '?'}"


def print_table(results: list[Result]) -> None:
    print(
        f"{'writers':>7}  {'mode':<9}  {'decisions/s':>11}  {'fsyncs/decision':>15}  "
        f"{'CPU us/decision':>15}"
    )
    for r in results:
        print(
            f"{r.writers:>7}  {r.mode:<9}  {r.rate:>11,.0f}  {r.fsyncs / r.decisions:>15.3f}  "
            f"{r.cpu_seconds / r.decisions * 1e6:>15.1f}"
        )
    print()
    for writers in WRITERS:
        group, single = (
            next(r for r in results if r.writers == writers and r.group is g) for g in (True, False)
        )
        print(f"{writers:>3} writers: group / one-fsync = {group.rate / single.rate:5.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--decisions", type=int, default=4000, help="per run (default 4000)")
    parser.add_argument("--dir", type=Path, default=None, help="where to create temporary logs")
    parser.add_argument("--added-fsync-ms", type=float, default=0.0, help="simulate a slower disk")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="twopc-bench-", dir=args.dir))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, logs in {root}")
    print(f"filesystem: {filesystem(root.resolve())}")
    if args.added_fsync_ms:
        print(f"SIMULATED: {args.added_fsync_ms} ms added after every real fsync")
    print(f"{args.decisions} forced decisions per run\n")
    results = []
    try:
        for writers in WRITERS:
            for group in (True, False):
                directory = root / f"{writers}-{group}"
                added = args.added_fsync_ms / 1000
                results.append(run(directory, writers, args.decisions, group, added))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(results)


if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a script: make the repository importable
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
