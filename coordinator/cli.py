"""``twopc``: the operator's command line.

``recover``, ``status``, ``forget`` and ``log inspect`` work on a decision log and the resources
named in a config file (see `config`). Other packages add commands (``demo``, ``serve``) through
the ``twopc.commands`` entry-point group, so this module never imports anything above the
coordinator.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any

from . import config as config_mod
from .decision_log import inspect_log
from .errors import TransactionError
from .manager import TransactionManager

DEFAULT_CONFIG = "twopc.toml"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table; empty tables say so rather than print a bare header."""
    if not rows:
        return "(none)"
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _manager(cfg: config_mod.Config) -> TransactionManager:
    return TransactionManager(
        cfg.node_id,
        cfg.build_log(),
        cfg.build_resources(),
        recover_on_start=False,
        recovery_interval=None,
        reaper_interval=None,
        sub_branch_grace=cfg.sub_branch_grace,
    )


def cmd_recover(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.config)
    with _manager(cfg) as tm:
        report = tm.recover(force=True)
    print(f"committed (re-driven): {len(report.committed)}")
    print(f"rolled back (presumed abort): {len(report.rolled_back)}")
    print(f"heuristic outcomes: {len(report.heuristics)}")
    for line in [*report.heuristics, *report.failures]:
        print(f"  {line}")
    print(f"left alone (other nodes' branches): {report.left_alone}")
    return 0 if report.clean else 1


def cmd_status(args: argparse.Namespace) -> int:
    """Read-only: works while the application holds the log, and never changes it."""
    cfg = config_mod.load(args.config)
    if cfg.log is not None:
        pending, heuristics, notes = summarize(inspect_log(cfg.log))
        where = str(cfg.log)
    else:
        pending, heuristics, notes = _read_log(cfg)
        where = f"the log of node {cfg.node_id} ({cfg.log_factory})"
    now = time.time()
    print(f"in-doubt transactions (committed, not every branch told) in {where}:")
    print(
        table(
            ["gtrid", "branches", "age_s"],
            [
                (g, ",".join(r["branches"]), f"{now - r['written_at']:.1f}")
                for g, r in pending.items()
            ],
        )
    )
    print("\nheuristic outcomes (a human must look; `twopc forget` when dealt with):")
    print(
        table(
            ["gtrid", "branch", "outcome", "age_s", "detail"],
            [
                (
                    r["gtrid"],
                    r["branch"],
                    r["outcome"],
                    f"{now - r['recorded_at']:.1f}",
                    r["detail"],
                )
                for r in heuristics
            ],
        )
    )
    for note in notes:
        print(f"\nwarning: {note}")
    return 1 if notes else 0


def _read_log(
    cfg: config_mod.Config,
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]], list[str]]:
    """Pending decisions and heuristics of a factory-built log, opened read-only."""
    log = cfg.build_log(read_only=True)
    try:
        pending = {
            d.gtrid: {"branches": d.branches, "written_at": d.written_at} for d in log.pending()
        }
        heuristics = [dataclasses.asdict(h) for h in log.heuristics()]
    finally:
        log.close()
    return pending, heuristics, []


def summarize(
    rows: list[dict[str, Any]],
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]], list[str]]:
    """Fold inspected records into (pending decisions, live heuristics, notes about the log)."""
    pending: dict[str, dict[str, Any]] = {}
    heuristics: dict[tuple[str, str], dict[str, Any]] = {}
    notes: list[str] = []
    for row in rows:
        kind = row.get("kind")
        if kind == "COMMIT":
            pending[row["gtrid"]] = row
        elif kind == "END":
            pending.pop(row["gtrid"], None)
        elif kind == "HEURISTIC":
            heuristics[(row["gtrid"], row["branch"])] = row
        elif kind == "FORGET":
            for key in [k for k in heuristics if k[0] == row["gtrid"]]:
                if row.get("branch") in (None, key[1]):
                    del heuristics[key]
        elif kind == "NOTE":
            notes.append(str(row.get("note")))
    return pending, list(heuristics.values()), notes


def cmd_forget(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.config)
    with _manager(cfg) as tm:
        tm.forget_heuristic(args.gtrid, args.branch)
    print(
        f"forgot heuristic outcome of {args.gtrid}" + (f" on {args.branch}" if args.branch else "")
    )
    return 0


def cmd_log_inspect(args: argparse.Namespace) -> int:
    rows = inspect_log(args.directory)
    keys = ["segment", "offset", "kind", "gtrid"]
    extra = sorted({k for row in rows for k in row} - set(keys))
    print(table([*keys, *extra], [[row.get(k, "") for k in (*keys, *extra)] for row in rows]))
    return 1 if any(row.get("kind") == "NOTE" for row in rows) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="twopc", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, help_ in (
        ("recover", cmd_recover, "finish in-doubt transactions now"),
        ("status", cmd_status, "list in-doubt and heuristic transactions (read-only)"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("-c", "--config", default=DEFAULT_CONFIG)
        p.set_defaults(func=func)
    forget = sub.add_parser("forget", help="forget a heuristic outcome an operator has dealt with")
    forget.add_argument("gtrid")
    forget.add_argument("--branch")
    forget.add_argument("-c", "--config", default=DEFAULT_CONFIG)
    forget.set_defaults(func=cmd_forget)
    log_cmd = sub.add_parser("log", help="decision log tools").add_subparsers(
        dest="log_command", required=True
    )
    inspect = log_cmd.add_parser(
        "inspect", help="print every record of a log directory (read-only)"
    )
    inspect.add_argument("directory")
    inspect.set_defaults(func=cmd_log_inspect)
    for plugin in entry_points(group="twopc.commands"):
        plugin.load()(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except TransactionError as exc:
        print(f"twopc: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
