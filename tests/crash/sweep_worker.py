"""The process the expiry-sweep crash tests kill: it opens a cursor, sweeps its expired messages
to their dead-letter queues, takes one message out as an operator would, and closes.

    python tests/crash/sweep_worker.py --cursor DIR [--remove MSGID --action drop|dead-letter]

Prints ``SWEPT <n>`` after the sweep, ``REMOVED`` after the removal, ``DONE`` after the close
(flushed: a SIGKILL loses nothing printed). Crashes come from ``TWOPC_CRASH_AT``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: find tests/

from resource_managers.cursor import Cursor


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cursor", required=True)
    parser.add_argument("--remove")
    parser.add_argument("--action", default="drop")
    args = parser.parse_args(argv)
    # lazy records stay queued until the close writes them, so a kill at the sweep's point
    # loses them for sure (the worst case), and a kill in the close's write/fsync finds them
    # written or not
    with Cursor(args.cursor, lazy_delay=60.0) as cursor:
        print(f"SWEPT {cursor.sweep_expired()}", flush=True)
        if args.remove:
            cursor.remove_message("orders", args.remove, args.action, "poison")
            print("REMOVED", flush=True)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
