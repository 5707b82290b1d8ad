"""``twopc demo``: move money between two banks atomically, crash on purpose, recover, audit.

A child process runs transfers between two durable ledgers under a file decision log and is
killed with SIGKILL at a named crash point in the middle of phase two (one bank has the money
moved, the other only prepared). The parent then shows the damage, runs recovery the way a
restarted service would, and audits that no money was created or lost and every acknowledged
transfer is on both sides.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from coordinator import FileDecisionLog, TransactionManager, TransactionRolledBack
from coordinator.cli import table

from ._demo_ledger import LedgerResource

NODE_ID = "demo-1"
ACCOUNTS = 3
OPENING = 1_000


def register(sub: Any) -> None:
    """Entry point of the ``twopc.commands`` group."""
    p = sub.add_parser("demo", help="run the end-to-end demo: transfers, a crash, recovery, audit")
    p.add_argument("--dir", help="working directory (default: a fresh temporary one)")
    p.add_argument("--transfers", type=int, default=20)
    p.add_argument("--crash-at", default="tm.after_commit.1:7", help="crash point name[:nth]")
    p.set_defaults(func=run)
    child = sub.add_parser("demo-child", help=argparse.SUPPRESS)
    child.add_argument("--dir", required=True)
    child.add_argument("--transfers", type=int, required=True)
    child.set_defaults(func=run_child)


def banks(workdir: Path) -> tuple[LedgerResource, LedgerResource]:
    return LedgerResource("bank-a", workdir / "bank-a"), LedgerResource(
        "bank-b", workdir / "bank-b"
    )


def run_child(args: argparse.Namespace) -> int:
    """The service that crashes: one transfer per transaction, printing each acknowledgment."""
    workdir = Path(args.dir)
    a, b = banks(workdir)
    rng = random.Random(7)
    with TransactionManager(NODE_ID, FileDecisionLog(workdir / "txlog"), [a, b]) as tm:
        for n in range(1, args.transfers + 1):
            amount = rng.randint(1, 50)
            src, dst = f"a{rng.randrange(ACCOUNTS)}", f"b{rng.randrange(ACCOUNTS)}"
            try:
                with tm.transaction() as tx:
                    tx.join(a).debit(src, amount)
                    tx.join(b).credit(dst, amount)
            except TransactionRolledBack as exc:
                print(f"transfer {n}: rolled back ({exc.reason})", flush=True)
                continue
            print(
                f"transfer {n}: {amount} from bank-a/{src} to bank-b/{dst} committed {tx.gtrid}",
                flush=True,
            )
    return 0


def run(args: argparse.Namespace) -> int:
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="twopc-demo-"))
    a, b = banks(workdir)
    a.open_accounts({f"a{i}": OPENING for i in range(ACCOUNTS)})
    b.open_accounts({f"b{i}": OPENING for i in range(ACCOUNTS)})
    print(
        f"twopc demo in {workdir}\n1. a service moves money from bank-a to bank-b, and is "
        f"killed at crash point {args.crash_at}"
    )
    acked = _run_crashing_child(workdir, args)
    print(f"\n2. after the crash: {len(acked)} transfers acknowledged; in doubt now:")
    print(
        table(
            ["bank", "prepared branches (in doubt)"], [(r.name, len(r.recover())) for r in (a, b)]
        )
    )
    print("\n3. the service restarts; recovery runs at start-up:")
    with TransactionManager(
        NODE_ID, FileDecisionLog(workdir / "txlog"), [a, b], recover_on_start=False
    ) as tm:
        report = tm.recover()
    print(
        f"   re-drove {len(report.committed)} committed decision(s), "
        f"presumed abort for {len(report.rolled_back)} orphan branch(es)"
    )
    return _audit(a, b, acked)


def _run_crashing_child(workdir: Path, args: argparse.Namespace) -> list[str]:
    env = dict(os.environ, TWOPC_CRASH_AT=args.crash_at)
    cmd = [
        sys.executable,
        "-m",
        "coordinator.cli",
        "demo-child",
        "--dir",
        str(workdir),
        "--transfers",
        str(args.transfers),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        print(f"   {line}")
    died = (
        "killed by SIGKILL" if proc.returncode == -signal.SIGKILL else f"exited {proc.returncode}"
    )
    print(f"   the service {died}")
    if proc.returncode not in (0, -signal.SIGKILL):
        print(proc.stderr, file=sys.stderr)
    return [line.rsplit(" ", 1)[1] for line in proc.stdout.splitlines() if " committed " in line]


def _audit(a: LedgerResource, b: LedgerResource, acked: list[str]) -> int:
    total = sum(a.balances().values()) + sum(b.balances().values())
    audit_a, audit_b = a.audit(), b.audit()
    checks = [
        ("conservation: total money unchanged", total == 2 * ACCOUNTS * OPENING, f"{total}"),
        (
            "atomicity: no transfer on one side only",
            all(audit_a.get(g) == audit_b.get(g) for g in set(audit_a) | set(audit_b)),
            "",
        ),
        (
            "durable_ack: every acknowledged transfer on both sides",
            all(audit_a.get(g) == audit_b.get(g) == "committed" for g in acked),
            f"{len(acked)} acked",
        ),
        ("no_in_doubt_residue: nothing left prepared", not a.recover() and not b.recover(), ""),
    ]
    print("\n4. audit:")
    print(
        table(
            ["invariant", "holds", "detail"], [(n, "yes" if ok else "NO", d) for n, ok, d in checks]
        )
    )
    print(table(["account", "balance"], sorted({**a.balances(), **b.balances()}.items())))
    ok = all(ok for _, ok, _ in checks)
    print("\nPASS: every participant reached the same outcome" if ok else "\nFAIL")
    return 0 if ok else 1
