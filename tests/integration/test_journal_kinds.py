"""Journals that say what they are: every segment header names its journal's kind, a store opened
on another store's directory says so (and changes nothing), older segments still read, and
``twopc log inspect`` decodes all three kinds, reading on past a damaged frame."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from coordinator import FileDecisionLog, TransactionManager, WrongJournalError
from coordinator.decision_log import Decision, inspect_log
from coordinator.journal import SegmentHeader
from coordinator.journal._framing import FRAME_HEADER_SIZE, encode_frame
from resource_managers.cursor import ConsumerBranch, Cursor, CursorResource
from resource_managers.message_log import Message, MessageLog, MessageLogResource
from resource_managers.sequencing import Frame

REPO = Path(__file__).resolve().parents[2]


def twopc(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TWOPC_SECRET": "a secret of at least 16 bytes"}
    return subprocess.run(
        [sys.executable, "-c", "import sys; from coordinator.cli import main; sys.exit(main())",
         *args],
        capture_output=True, text=True, timeout=60, env=env, cwd=REPO,
    )  # fmt: skip


def inspected(directory: Path) -> tuple[int, list[dict[str, object]]]:
    done = twopc("log", "inspect", "--json", str(directory))
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, json.loads(done.stdout)


def manager(tmp_path: Path, *resources: object) -> TransactionManager:
    return TransactionManager(
        f"n-{uuid.uuid4().hex[:6]}", FileDecisionLog(tmp_path / "txlog"), list(resources),
        recovery_interval=None, reaper_interval=None,
    )  # fmt: skip


def send_three(tmp_path: Path) -> Path:
    """A message log with an open, and three two-message transactions (two-phase: a second
    branch joins), closed."""
    log = MessageLog(tmp_path / "mlog")
    other = MessageLog(tmp_path / "other")
    a, b = MessageLogResource(log, "a"), MessageLogResource(other, "b")
    with manager(tmp_path, a, b) as tm:
        for n in range(3):
            with tm.transaction() as tx:
                tx.join(a).send("orders", b"one %d" % n)
                tx.join(a).send("orders", b"two %d" % n)
                tx.join(b).send("audit", b"n %d" % n)
    log.close()
    other.close()
    return tmp_path / "mlog"


def test_inspect_decodes_every_kind_of_journal(tmp_path: Path) -> None:
    mlog = send_three(tmp_path)
    code, rows = inspected(mlog)
    assert code == 0
    kinds = [row["kind"] for row in rows]
    assert kinds[:2] == ["SEGMENT", "OPEN"] and rows[0]["journal"] == "message-log"
    assert kinds.count("PREPARE") == 3 and kinds.count("COMMIT") == 3
    prepare = next(row for row in rows if row["kind"] == "PREPARE")
    assert prepare["branch"] == "a" and ":" in str(prepare["gtrid"])  # readable, not a gid
    assert "to orders (5 bytes)" in str(prepare["messages"])

    code, rows = inspected(tmp_path / "txlog")
    assert code == 0 and rows[0]["journal"] == "decision-log"
    assert [row["kind"] for row in rows[1:]].count("COMMIT") == 3

    with Cursor(tmp_path / "cursor") as cursor:  # a live cursor: inspect takes no lock
        m = Message(uuid.uuid4().hex, "orders", b"hello", {})
        cursor.deliver(Frame("orders", 7, 1, 0, m.message_id), m)
        with manager(tmp_path / "consumer", CursorResource(cursor)) as tm, tm.transaction() as tx:
            branch: ConsumerBranch = tx.join(tm.resource("cursor"))
            assert branch.receive("orders") is not None
        code, rows = inspected(tmp_path / "cursor")
    assert code == 0 and rows[0]["journal"] == "cursor"
    kinds = [row["kind"] for row in rows]
    assert "ACCEPTED" in kinds and "HANDED_OUT" in kinds and "COMMIT" in kinds
    accepted = next(row for row in rows if row["kind"] == "ACCEPTED")
    assert accepted["stream"] == "orders" and accepted["seq"] == 1


def test_inspect_reads_on_past_a_damaged_frame(tmp_path: Path) -> None:
    mlog = send_three(tmp_path)
    _, rows = inspected(mlog)
    second = [row for row in rows if row["kind"] == "PREPARE"][1]
    segment = mlog / str(second["segment"])
    data = bytearray(segment.read_bytes())
    data[int(str(second["offset"])) + FRAME_HEADER_SIZE + 5] ^= 0x20  # inside its payload
    segment.write_bytes(bytes(data))
    code, rows = inspected(mlog)
    assert code == 1
    note = next(row for row in rows if row["kind"] == "NOTE")
    assert note["offset"] == second["offset"] and "valid record follows" in str(note["note"])
    after = [row["kind"] for row in rows if int(str(row["offset"])) > int(str(note["offset"]))]
    assert after.count("COMMIT") >= 2 and "PREPARE" in after  # what the damage would strand


def test_a_store_opened_on_another_stores_directory_says_so(tmp_path: Path) -> None:
    Cursor(tmp_path / "cursor").close()
    before = {p.name: p.read_bytes() for p in (tmp_path / "cursor").iterdir() if p.is_file()}
    with pytest.raises(WrongJournalError, match="holds a cursor journal, not a decision-log"):
        FileDecisionLog(tmp_path / "cursor")
    with pytest.raises(WrongJournalError, match="not a message-log"):
        MessageLog(tmp_path / "cursor")
    after = {p.name: p.read_bytes() for p in (tmp_path / "cursor").iterdir() if p.is_file()}
    assert after == before  # nothing changed
    FileDecisionLog(tmp_path / "txlog").close()
    done = twopc(
        "serve", "cursor", "--dir", str(tmp_path / "txlog"), "--listen", "127.0.0.1:0"
    )
    assert done.returncode == 2, done.stderr
    assert "[journal-kind]" in done.stderr and "decision-log journal" in done.stderr
    assert "Traceback" not in done.stderr and "damaged" not in done.stderr


def test_segments_written_before_kinds_still_open_and_roll_over_to_the_new_header(
    tmp_path: Path,
) -> None:
    """A version 1 header (no kind): the log opens, keeps its decisions, and the segments it
    writes from then on name their kind."""
    directory = tmp_path / "txlog"
    with FileDecisionLog(directory) as log:
        log.log_commit(Decision("n1:g-1", ("a", "b"), None, 1000.0))
    segment = next(directory.glob("*.seg"))
    data = segment.read_bytes()
    v2 = len(encode_frame(SegmentHeader(1, 1, "decision-log").encode()))
    v1 = encode_frame(SegmentHeader(1, 1, None, version=1).encode())
    segment.write_bytes(v1 + data[v2:])
    rows = inspect_log(directory)
    assert rows[0]["version"] == 1 and rows[0]["journal"] is None
    assert [row["kind"] for row in rows] == ["SEGMENT", "COMMIT"]  # recognised as a decision log
    with FileDecisionLog(directory, segment_bytes=4096) as log:
        assert [d.gtrid for d in log.pending()] == ["n1:g-1"]
        for n in range(120):  # past segment_bytes: a rollover writes a new segment
            log.log_commit(Decision(f"n1:g-{n + 2}", ("a",), None, 1000.0))
    headers = [row for row in inspect_log(directory) if row["kind"] == "SEGMENT"]
    assert headers[-1]["version"] == 2 and headers[-1]["journal"] == "decision-log"
