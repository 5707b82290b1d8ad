"""The process the refused-message crash test kills: a message log's transfer to a cursor.

    python tests/crash/refuse_worker.py --log DIR --cursor HOST:PORT --secret-file FILE

Opens the message log, runs its `LogTransfer` to the cursor until the log holds nothing
unacknowledged (at most 30 s), prints ``IDLE <refused count>`` and exits. Crashes come from
``TWOPC_CRASH_AT`` (here ``xfer.log.after_keep_refused``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: find the code

from messaging.auth import SharedSecret
from messaging.connection import Connection, connect, parse_address
from messaging.transfer import TRANSFER_ROLE, LogTransfer
from resource_managers.message_log import MessageLog
from resource_managers.sequencing import DoublingBackoff


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log", required=True)
    parser.add_argument("--cursor", required=True)
    parser.add_argument("--secret-file", required=True)
    args = parser.parse_args(argv)
    secret = SharedSecret.from_file(args.secret_file)
    address = parse_address(args.cursor)

    def dial() -> Connection:
        return connect(address, secret, "log", TRANSFER_ROLE, timeout=2)

    with MessageLog(args.log) as mlog:
        transfer = LogTransfer(mlog, dial, resend=DoublingBackoff(base=0.1, cap=0.5))
        with transfer:
            idle = transfer.wait_idle(30)
        print(f"IDLE {transfer.stats['refused']}" if idle else "BUSY", flush=True)
    return 0 if idle else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
