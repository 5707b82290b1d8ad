"""The process the log-identity kill test kills: it opens a message log and closes it.

    python tests/crash/identity_worker.py DIR

Prints ``IDENTITY <identity>`` (flushed) once the log is open. With ``TWOPC_CRASH_AT=
mlog.after_open`` it dies inside the open, after the forced ``O`` record that holds the identity
the open chose (`coordinator.crashpoints`).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: find the repo

from resource_managers.message_log import MessageLog

if __name__ == "__main__":
    with MessageLog(sys.argv[1]) as mlog:
        print(f"IDENTITY {mlog.identity}", flush=True)
