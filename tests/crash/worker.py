"""The process the crash matrix kills: runs transactions, or recovery, over durable files.

    python tests/crash/worker.py run DIR --plan 2pc,2pc,veto [--segment-bytes N]
    python tests/crash/worker.py recover DIR
    ... [--last c]    resource c is a logging last resource (its commit carries the decision)
    ... [--lazy]      the resources write their phase-two commit records lazily
    ... [--carried]   resource a rides the last resource's commit (`coordinator.carried`)

``run`` executes one transaction per plan entry over three `FileResource`s (a, b, c) and a
`FileDecisionLog`, all under DIR, and prints (flushed, so a SIGKILL loses nothing printed)::

    BEGIN <gtrid> <kind> <resources that wrote>    before commit is called
    ACK <gtrid> <outcome>                          commit returned: the caller was told
    ABORTED <gtrid> <error code>                   commit raised TransactionRolledBack
    DONE                                           the plan ran out without a crash

``recover`` opens the same log and resources under the same node id, runs one ``tm.recover()``
and prints ``RECOVERED <json>`` (what it resolved, and how long it took).

Kinds: ``2pc`` moves one unit a -> b and counts it on c; ``veto`` does the same but c votes no;
``1pc`` writes to a alone (one-phase commit); ``ro`` moves a -> b while c only reads (read-only);
``rob`` takes one from a and counts it on c while b only reads.
The crash itself comes from ``TWOPC_CRASH_AT`` in the environment (`coordinator.crashpoints`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: find tests/

from coordinator import FileDecisionLog, TransactionManager, TransactionRolledBack
from coordinator.transaction import Transaction
from tests.support.file_resource import FileResource

NODE_ID = "crash-node"
RESOURCES = ("a", "b", "c")
KINDS = ("2pc", "veto", "1pc", "ro", "rob")


def open_manager(
    root: Path,
    segment_bytes: int | None,
    *,
    recover_on_start: bool,
    last: str | None = None,
    async_phase_two: bool = False,
    lazy: bool = False,
    carried: bool = False,
) -> TransactionManager:
    resources = [
        FileResource(
            name,
            root / name,
            last_resource=name == last,
            lazy_commit=lazy,
            carried=carried and name == "a",
        )
        for name in RESOURCES
    ]
    if segment_bytes is None:
        log = FileDecisionLog(root / "log")
    else:
        log = FileDecisionLog(root / "log", segment_bytes=segment_bytes)
    return TransactionManager(
        NODE_ID,
        log,
        resources,
        recovery_interval=None,
        reaper_interval=None,
        recover_on_start=recover_on_start,
        async_phase_two=async_phase_two,
    )


def say(*words: object) -> None:
    print(*words, flush=True)


def work(tm: TransactionManager, tx: Transaction, kind: str) -> list[str]:
    """Do ``kind``'s writes in ``tx``; returns the resources that wrote."""
    a = tx.join(tm.resource("a"))
    if kind == "1pc":
        a.set("note", tx.gtrid)
        return ["a"]
    b, c = tx.join(tm.resource("b")), tx.join(tm.resource("c"))
    if kind == "rob":
        a.add("balance", -1)
        b.get("balance")
        c.add("count", 1)
        return ["a", "c"]
    a.add("balance", -1)
    b.add("balance", 1)
    if kind == "ro":
        c.get("count")
        return ["a", "b"]
    c.add("count", 1)
    if kind == "veto":
        c.veto()
    return ["a", "b", "c"]


def run(  # noqa: PLR0917 - the command line, passed on
    root: Path,
    plan: list[str],
    segment_bytes: int | None,
    last: str | None,
    asynchronous: bool,
    lazy: bool,
    carried: bool,
) -> int:
    tm = open_manager(
        root,
        segment_bytes,
        recover_on_start=True,
        last=last,
        async_phase_two=asynchronous,
        lazy=lazy,
        carried=carried,
    )
    for kind in plan:
        tx = tm.begin()
        wrote = work(tm, tx, kind)
        say("BEGIN", tx.gtrid, kind, ",".join(wrote))
        try:
            outcome = tx.commit()
        except TransactionRolledBack as exc:
            say("ABORTED", tx.gtrid, exc.code)
        else:
            say("ACK", tx.gtrid, outcome.value)
    say("DONE")
    tm.close()
    return 0


def recover(root: Path, segment_bytes: int | None, last: str | None, carried: bool) -> int:
    tm = open_manager(root, segment_bytes, recover_on_start=False, last=last, carried=carried)
    started = time.perf_counter()
    report = tm.recover(force=True)
    elapsed_ms = (time.perf_counter() - started) * 1000
    result = {
        "committed": report.committed,
        "rolled_back": report.rolled_back,
        "heuristics": report.heuristics,
        "failures": report.failures,
        "left_alone": report.left_alone,
        "pending_after": [d.gtrid for d in tm.log.pending()],
        "recovery_ms": round(elapsed_ms, 2),
    }
    tm.close()
    say("RECOVERED", json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("run", "recover"))
    parser.add_argument("dir", type=Path)
    parser.add_argument("--plan", default="2pc,2pc,2pc")
    parser.add_argument("--segment-bytes", type=int, default=None)
    parser.add_argument("--last", choices=RESOURCES, default=None)
    parser.add_argument("--async-phase-two", action="store_true")
    parser.add_argument("--lazy", action="store_true", help="lazy commit records (a and b)")
    parser.add_argument("--carried", action="store_true", help="a rides the last resource")
    args = parser.parse_args(argv)
    if args.mode == "recover":
        return recover(args.dir, args.segment_bytes, args.last, args.carried)
    plan = args.plan.split(",")
    unknown = set(plan) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}; expected some of {KINDS}")
    return run(
        args.dir,
        plan,
        args.segment_bytes,
        args.last,
        args.async_phase_two,
        args.lazy,
        args.carried,
    )


if __name__ == "__main__":
    sys.exit(main())
