"""``twopc journal check`` and ``twopc journal quarantine``: an operator's way past a journal
record that its owner cannot replay (`UnreplayableRecordError` at open), without editing a file.

``--kind`` names the store the directory belongs to (``cursor``, ``log`` for a message log,
``decisions`` for a file decision log), because only the owner can say whether a record replays.
``check`` reports the first such record, read-only. ``quarantine`` moves it aside when it is
exactly the record named (``--segment``, ``--offset``, as the open's error printed them), keeps
it in ``<dir>/quarantine/``, and reports what it held. Both take the journal's lock, so they are
refused while the server runs. Errors print ``twopc: [code] message`` and exit with the code of
`coordinator.cli_edge.Exit` (2 for a journal its server holds); ``check`` exits 1 when it found a
record.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from coordinator.decision_log import journal_replay as decisions_replay
from coordinator.errors import ConfigurationError
from coordinator.journal import find_unreplayable, quarantine
from resource_managers.cursor import journal_replay as cursor_replay
from resource_managers.message_log import journal_replay as log_replay

#: the crash point between keeping a record in ``quarantine/`` and rewriting its segment
AFTER_KEEP = "journal.quarantine.after_keep"

#: the stores on a journal, by the name ``--kind`` takes
KINDS: dict[str, Callable[[], Callable[[bytes], None]]] = {
    "cursor": cursor_replay,
    "log": log_replay,
    "decisions": decisions_replay,
}


def register(sub: Any) -> None:
    group = sub.add_parser("journal", help="find and move aside journal records that cannot replay")
    cmds = group.add_subparsers(dest="journal_command", required=True)
    check = cmds.add_parser("check", help="report the first record the store cannot replay")
    _target(check)
    check.set_defaults(func=cmd_check)
    move = cmds.add_parser("quarantine", help="move that record aside (kept, reported)")
    _target(move)
    move.add_argument("--segment", type=int, required=True, help="as the open's error names it")
    move.add_argument("--offset", type=int, required=True, help="as the open's error names it")
    move.set_defaults(func=cmd_quarantine)


def _target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", required=True, help="the store's journal directory")
    p.add_argument("--kind", required=True, choices=sorted(KINDS), help="the store it belongs to")


def _journal_dir(path: str) -> str:
    """A typo must be said as one, not as a lock file that cannot be opened."""
    if not os.path.isdir(path):
        what = "is a file" if os.path.exists(path) else "does not exist"
        raise ConfigurationError(f"--dir {path} {what}: give the store's journal directory")
    return path


def cmd_check(args: argparse.Namespace) -> int:
    _journal_dir(args.dir)
    found = find_unreplayable(args.dir, KINDS[args.kind]())
    if found is None:
        print(f"every record of {args.dir} replays")
        return 0
    print(f"segment {found.segment} offset {found.offset}: {found.reason}")
    print(f"record: {found.record}")
    return 1


def cmd_quarantine(args: argparse.Namespace) -> int:
    _journal_dir(args.dir)
    moved = quarantine(
        args.dir, KINDS[args.kind](), args.segment, args.offset, after_keep=AFTER_KEEP
    )
    print(f"moved aside: segment {moved.segment} offset {moved.offset} ({moved.reason})")
    print(f"record: {moved.payload[:200].decode('ascii', 'backslashreplace')}")
    print(f"kept in: {moved.kept_in}")
    following = find_unreplayable(args.dir, KINDS[args.kind]())
    if following is not None:
        print(
            f"another record cannot replay: segment {following.segment} offset "
            f"{following.offset}: {following.reason}"
        )
        return 1
    print(f"every other record of {args.dir} replays")
    return 0
