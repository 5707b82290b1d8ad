"""``twopc status``: what a node's decision log says needs an operator, read-only.

It reads the log files without the lock (or a factory-built log with ``read_only=True``), so it
works beside the running service and never writes. Its exit code is meant for monitoring (see
`cli_edge.Exit`): a live heuristic outcome, then a transaction in doubt for longer than
``--older-than``, then a warning about the log itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from . import config as config_mod
from .cli_edge import Exit, most_urgent
from .cli_output import age, emit_json, readable, table
from .decision_log import inspect_log
from .errors import ConfigurationError

#: seconds in doubt before ``status`` exits `Exit.IN_DOUBT`: a few recovery passes (30 s apart,
#: backing off to 60 s) plus the lazy END records a quiet service writes late
DEFAULT_OLDER_THAN = 300.0

Pending = dict[str, dict[str, Any]]


def cmd_status(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.config)
    if cfg.log is not None:
        require_log_directory(cfg, args.config)
        pending, heuristics, notes = summarize(inspect_log(cfg.log))
        where = str(cfg.log)
    else:
        pending, heuristics, notes = _read_log(cfg)
        where = f"the log of node {cfg.node_id} ({cfg.log_factory})"
    now = time.time()
    in_doubt = [_in_doubt_row(g, r, now, args.older_than) for g, r in pending.items()]
    held = [_heuristic_row(r, now) for r in heuristics]
    old = [r for r in in_doubt if r["old"]]
    code = most_urgent(
        *([Exit.HEURISTIC] if held else []),
        *([Exit.IN_DOUBT] if old else []),
        *([Exit.ATTENTION] if notes else []),
    )
    if args.json:
        emit_json(
            {
                "log": where,
                "older_than_seconds": args.older_than,
                "in_doubt": in_doubt,
                "heuristics": held,
                "warnings": notes,
                "exit_code": int(code),
            }
        )
        return code
    print(f"in-doubt transactions (committed, not every branch told) in {where}:")
    columns = ["gtrid", "branches", "written_at", "age"]
    print(table([*columns, "old"], [[*(r[c] for c in columns), r["old"]] for r in in_doubt]))
    print("\nheuristic outcomes (a human must look; `twopc forget` when dealt with):")
    columns = ["gtrid", "branch", "outcome", "recorded_at", "age", "detail"]
    print(table(columns, [[r[c] for c in columns] for r in held]))
    for note in notes:
        print(f"\nwarning: {note}")
    if old:
        print(f"\n{len(old)} in doubt for longer than {age(args.older_than)} (--older-than)")
    return code


def require_log_directory(cfg: config_mod.Config, config_path: str) -> None:
    """The commands never create a log: a missing directory is a wrong config (the service
    creates its log at first start), and an empty new one would report nothing to do."""
    if cfg.log is not None and not cfg.log.is_dir():
        raise ConfigurationError(
            f"no decision log directory {cfg.log} (the `log` of {config_path}; a relative "
            "path is relative to the config file's folder)"
        )


def _in_doubt_row(
    gtrid: str, record: dict[str, Any], now: float, older_than: float
) -> dict[str, Any]:
    written = record.get("written_at") or None
    seconds = None if written is None else now - written
    return {
        **readable({"gtrid": gtrid, "branches": record["branches"], "written_at": written}),
        "age": age(seconds),
        "age_seconds": None if seconds is None else round(seconds, 1),
        # a decision without a time was written by an old version: old enough to look at
        "old": seconds is None or seconds > older_than,
    }


def _heuristic_row(record: dict[str, Any], now: float) -> dict[str, Any]:
    recorded = record.get("recorded_at") or None
    seconds = None if recorded is None else now - recorded
    fields = {k: record.get(k) for k in ("gtrid", "branch", "outcome", "recorded_at")}
    return {
        **readable(fields),
        "detail": record.get("detail") or None,
        "age": age(seconds),
        "age_seconds": None if seconds is None else round(seconds, 1),
    }


def _read_log(cfg: config_mod.Config) -> tuple[Pending, list[dict[str, Any]], list[str]]:
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


def summarize(rows: list[dict[str, Any]]) -> tuple[Pending, list[dict[str, Any]], list[str]]:
    """Fold inspected records into (pending decisions, live heuristics, notes about the log)."""
    pending: Pending = {}
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
