"""``twopc``: the operator's command line.

``recover``, ``status``, ``forget`` and ``log inspect`` work on a decision log and the resources
named in a config file (see `config`). Other packages add commands (``demo``, ``serve``) through
the ``twopc.commands`` entry-point group, so this module never imports anything above the
coordinator. Every command, a plugin's too, runs inside `cli_edge.run_guarded`: a failure is one
line ``twopc: [code] message`` and an exit code from `cli_edge.Exit`, never a traceback (``-v``
adds it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import sys
from collections.abc import Iterator, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from . import config as config_mod
from .cli_edge import Exit, Parser, interrupted, most_urgent, pipe_closed, run_guarded, say
from .cli_output import emit_json, readable, table, when
from .cli_status import DEFAULT_OLDER_THAN, cmd_status, require_log_directory, summarize
from .decision_log import HeuristicRecord, inspect_log
from .errors import ConfigurationError, InvalidXidError, NoHeuristicError
from .manager import TransactionManager
from .recovery import RecoveryReport
from .recovery import progress as recovery_progress
from .xid import Xid

DEFAULT_CONFIG = "twopc.toml"

__all__ = ["DEFAULT_CONFIG", "build_parser", "main", "summarize", "table"]


def _manager(cfg: config_mod.Config, config_path: str) -> TransactionManager:
    """The node's manager, for one command: no background work, nothing run at start."""
    require_log_directory(cfg, config_path)
    log = cfg.build_log()
    try:
        resources = cfg.build_resources()
        return TransactionManager(
            cfg.node_id,
            log,
            resources,
            recover_on_start=False,
            recovery_interval=None,
            reaper_interval=None,
            sub_branch_grace=cfg.sub_branch_grace,
        )
    except BaseException:
        log.close()  # release the lock (or lease) now, not at exit
        raise


# -- recover --------------------------------------------------------------------------------------


def cmd_recover(args: argparse.Namespace) -> int:
    """One pass, now. Progress goes to stderr; the report to stdout; the exit code says what is
    left: a live heuristic (`Exit.HEURISTIC`), a branch not finished (`Exit.UNREACHABLE`)."""
    cfg = config_mod.load(args.config)
    with _progress_on_stderr(), _manager(cfg, args.config) as tm:
        report = tm.recover(force=True)
        heuristics = tm.heuristics()
    unfinished = [*report.failures]
    if report.deferred:
        unfinished.append(
            f"{report.deferred} branches left undecided: a last resource could not say whether "
            "they committed"
        )
    if args.json:
        emit_json(
            {
                "committed": report.committed,
                "rolled_back": [_gid_words(g) for g in report.rolled_back],
                "not_finished": unfinished,
                "heuristics": [_heuristic_dict(h) for h in heuristics],
                "left_alone": report.left_alone,
            }
        )
    else:
        _print_recovery(report, unfinished, heuristics)
    return most_urgent(
        *([Exit.HEURISTIC] if heuristics else []), *([Exit.UNREACHABLE] if unfinished else [])
    )


def _print_recovery(
    report: RecoveryReport, unfinished: list[str], heuristics: list[HeuristicRecord]
) -> None:
    print(f"committed (re-driven): {len(report.committed)}")
    print(f"rolled back (presumed abort): {len(report.rolled_back)}")
    print(f"not finished (run `twopc recover` again once it is reachable): {len(unfinished)}")
    for line in unfinished:
        print(f"  {line}")
    print(f"heuristic outcomes (a human must look; `twopc forget` when done): {len(heuristics)}")
    for h in heuristics:
        print(f"  {_heuristic_line(h)}")
    print(f"left alone (other nodes' branches, or not ours to decide): {report.left_alone}")


@contextlib.contextmanager
def _progress_on_stderr() -> Iterator[None]:
    """Recovery's progress lines on stderr, whatever ``-v`` says: a long pass shows it moves.
    The per-failure warnings (``twopc.recovery``) stay as ``-v`` sets them; the report lists
    every failure anyway. The logger is put back as it was (``main`` may run in a test)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("recover: %(message)s"))
    level, propagate = recovery_progress.level, recovery_progress.propagate
    recovery_progress.addHandler(handler)
    recovery_progress.setLevel(logging.INFO)
    recovery_progress.propagate = False
    try:
        yield
    finally:
        recovery_progress.removeHandler(handler)
        recovery_progress.setLevel(level)
        recovery_progress.propagate = propagate


def _gid_words(gid: str) -> str:
    try:
        xid = Xid.from_gid(gid)
    except InvalidXidError:
        return gid
    return f"{xid.gtrid} on {xid.bqual}"


def _heuristic_dict(h: HeuristicRecord) -> dict[str, Any]:
    """A heuristic record for JSON: ISO time, null for no detail."""
    return readable({**dataclasses.asdict(h), "detail": h.detail or None})


def _heuristic_line(h: HeuristicRecord) -> str:
    """``GTRID on BRANCH: OUTCOME (recorded TIME)``: what `twopc forget` takes, never a gid."""
    recorded = when(h.recorded_at)
    return f"{h.gtrid} on {h.branch}: {h.outcome}" + (f" (recorded {recorded})" if recorded else "")


# -- forget ---------------------------------------------------------------------------------------


def cmd_forget(args: argparse.Namespace) -> int:
    """Refuses anything but a live heuristic record of this node, so a typo writes nothing."""
    cfg = config_mod.load(args.config)
    _check_gtrid(args.gtrid, args.branch, cfg.node_id)
    with _manager(cfg, args.config) as tm:
        matching = [
            h for h in tm.heuristics()
            if h.gtrid == args.gtrid and args.branch in (None, h.branch)
        ]  # fmt: skip
        if not matching:
            which = f"{args.gtrid} on {args.branch}" if args.branch else args.gtrid
            raise NoHeuristicError(
                f"no heuristic outcome of {which} in the log of node {cfg.node_id}: nothing "
                "forgotten, nothing written (`twopc status` lists the live ones)"
            )
        tm.forget_heuristic(args.gtrid, args.branch)
    if args.json:
        emit_json({"forgotten": [_heuristic_dict(h) for h in matching]})
    else:
        for h in matching:
            print(f"forgot {_heuristic_line(h)}")
    return Exit.OK


def _check_gtrid(gtrid: str, branch: str | None, node_id: str) -> None:
    Xid.branch_of(gtrid, branch or "x")  # InvalidXidError for what no xid can hold
    if not gtrid.startswith(f"{node_id}:"):
        raise InvalidXidError(
            f"invalid gtrid {gtrid[:80]!r}: node {node_id}'s gtrids start with '{node_id}:' "
            "(copy it from `twopc status`)"
        )


# -- log inspect ----------------------------------------------------------------------------------

_INSPECT_KEYS = ("segment", "offset", "kind", "gtrid")


def cmd_log_inspect(args: argparse.Namespace) -> int:
    rows = inspect_log(_log_directory(args.directory))
    shown = [readable(row) for row in rows]
    if args.json:
        emit_json(shown)
    else:
        extra = sorted({k for row in shown for k in row} - set(_INSPECT_KEYS))
        keys = [*_INSPECT_KEYS, *extra]
        print(table(keys, [[row.get(k) for k in keys] for row in shown]))
    return Exit.ATTENTION if any(row.get("kind") == "NOTE" for row in rows) else Exit.OK


def _log_directory(path: str) -> str:
    if not Path(path).is_dir():
        what = "does not exist" if not Path(path).exists() else "is not a directory"
        raise ConfigurationError(
            f"{path} {what}: give the decision log's directory (the `log` of twopc.toml)"
        )
    return path


# -- the parser and main ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="twopc", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "-v", "--verbose", action="store_true",
        help="log at INFO level, and print the traceback of a failure",
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    recover = sub.add_parser("recover", help="finish in-doubt transactions now")
    recover.set_defaults(func=cmd_recover)
    status = sub.add_parser("status", help="list in-doubt and heuristic transactions (read-only)")
    status.add_argument(
        "--older-than", type=_seconds, default=DEFAULT_OLDER_THAN, metavar="SECONDS",
        help=f"exit {int(Exit.IN_DOUBT)} when a transaction has been in doubt longer than this "
        f"(default {DEFAULT_OLDER_THAN:g})",
    )  # fmt: skip
    status.set_defaults(func=cmd_status)
    forget = sub.add_parser("forget", help="forget a heuristic outcome an operator has dealt with")
    forget.add_argument("gtrid", help="as `twopc status` prints it")
    forget.add_argument("--branch", help="only this branch (default: every branch of the gtrid)")
    forget.set_defaults(func=cmd_forget)
    for p in (recover, status, forget):
        p.add_argument("-c", "--config", default=DEFAULT_CONFIG, help="default: ./twopc.toml")
        p.add_argument("--json", action="store_true", help="print one JSON document")
    log_cmd = sub.add_parser("log", help="decision log tools").add_subparsers(
        dest="log_command", required=True
    )
    inspect = log_cmd.add_parser(
        "inspect", help="print every record of a log directory (read-only)"
    )
    inspect.add_argument("directory")
    inspect.add_argument("--json", action="store_true", help="print one JSON document")
    inspect.set_defaults(func=cmd_log_inspect)
    _add_plugins(sub)
    return parser


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return value


def _add_plugins(sub: Any) -> None:
    """Commands of other packages; one that fails to load is reported, the others still work."""
    for plugin in entry_points(group="twopc.commands"):
        try:
            plugin.load()(sub)
        except Exception as exc:
            say(f"[plugin] commands of {plugin.value} not loaded: {type(exc).__name__}: {exc}")


def _verbose_anywhere(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``-v``/``--verbose`` wherever it is given (``twopc status -v`` as ``twopc -v status``);
    no subcommand uses the flag for anything else. Arguments after ``--`` are left alone."""
    args, verbose, rest = [], False, False
    for arg in argv:
        if not rest and arg in ("-v", "--verbose"):
            verbose = True
            continue
        rest = rest or arg == "--"
        args.append(arg)
    return args, verbose


def main(argv: Sequence[str] | None = None) -> int:
    argv, verbose = _verbose_anywhere(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        args.verbose = args.verbose or verbose
    except KeyboardInterrupt:  # while the plugins load
        return interrupted()
    except BrokenPipeError:  # `twopc --help | head -1`
        return pipe_closed()
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return run_guarded(lambda: args.func(args), verbose=args.verbose)


if __name__ == "__main__":
    raise SystemExit(main())
