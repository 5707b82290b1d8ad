"""``kill -9`` at the two steps this validation added that change files in more than one write:

- ``xfer.log.after_keep_refused``: the log kept a message the cursor refused in ``refused/`` and
  has not yet dropped it from its stream. The restarted log still holds it, sends it again, is
  refused again, keeps the same file and drops it; the next message is delivered exactly once.
- ``journal.quarantine.after_keep``: ``twopc journal quarantine`` kept the record in
  ``quarantine/`` and has not yet rewritten its segment. The store still refuses to open, naming
  the same record; running the command again finishes, and every other record is intact.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator import UnreplayableRecordError
from messaging.auth import SharedSecret
from messaging.server import CursorServer
from resource_managers.cursor import Cursor
from resource_managers.message_log import Message, MessageLog
from resource_managers.message_log._records import encode, message_obj
from tests.integration.cursor_stack import twopc
from tests.integration.test_journal_quarantine import check_cursor, fill_cursor

pytestmark = pytest.mark.crash

WORKER = Path(__file__).with_name("refuse_worker.py")
SECRET = b"validation crash test secret, 32"


def _transfer(log: Path, address: tuple[str, int], secret: Path, crash: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "TWOPC_CRASH_AT"}
    if crash:
        env["TWOPC_CRASH_AT"] = crash
    proc = subprocess.run(
        [sys.executable, str(WORKER), "--log", str(log), "--secret-file", str(secret),
         "--cursor", f"{address[0]}:{address[1]}"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(proc.stdout + proc.stderr)
    return proc.returncode


def test_kill_9_after_keeping_a_refused_message(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    bad = Message("bad", "q", b"p", {"twopc-priority": "x"})
    log = tmp_path / "log"
    with MessageLog(log) as mlog:  # as a version without today's checks could have written it
        mlog._journal.append(
            encode({"k": "1", "g": "g0", "m": [message_obj(bad)], "s": [["q", 1]]})
        )
    with MessageLog(log) as mlog:
        mlog.commit("g1", [Message("good", "q", b"fine")])
    with CursorServer(tmp_path / "c", SharedSecret(SECRET), listen=("127.0.0.1", 0)) as server:
        assert _transfer(log, server.address, secret, "xfer.log.after_keep_refused") == -9
        kept = list((log / "refused").rglob("*.json"))
        assert len(kept) == 1
        assert _transfer(log, server.address, secret, None) == 0
        assert list((log / "refused").rglob("*.json")) == kept  # the same file, kept once
        assert [d.body for d in server.cursor.take_many("g", "q", 10)] == [b"fine"]
    with MessageLog(log) as mlog:
        assert mlog.pending("q") == []


def test_kill_9_between_keeping_a_quarantined_record_and_rewriting_its_segment(
    tmp_path: Path,
) -> None:
    d = tmp_path / "cursor"
    fill_cursor(d)
    with pytest.raises(UnreplayableRecordError) as info:
        Cursor(d)
    where = ["--segment", str(info.value.segment), "--offset", str(info.value.offset)]
    args = ["journal", "quarantine", "--dir", str(d), "--kind", "cursor", *where]
    killed = twopc(*args, env={"TWOPC_CRASH_AT": "journal.quarantine.after_keep"})
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert len(list((d / "quarantine").glob("*.json"))) == 1
    with pytest.raises(UnreplayableRecordError) as again:  # the segment is as it was
        Cursor(d)
    assert (again.value.segment, again.value.offset) == (info.value.segment, info.value.offset)
    finished = twopc(*args)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    check_cursor(d)
