"""A record its store cannot replay, written on purpose through the journal's own writer (as a
version without today's checks, or a bug, could have): opening stops with
`UnreplayableRecordError` naming the segment, the offset and the record; ``twopc journal check``
finds it; ``twopc journal quarantine`` refuses any other record, moves that one aside (kept in
``quarantine/``), and the store then opens with every other record intact. For the cursor, the
message log and the file decision log."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from coordinator import FileDecisionLog, UnreplayableRecordError
from coordinator.decision_log import Decision
from resource_managers.cursor import Cursor
from resource_managers.cursor._records import encode, message_obj
from resource_managers.message_log import Message, MessageLog
from resource_managers.sequencing import Frame
from tests.integration.cursor_stack import twopc

#: an M record whose message claims priority "x": it decodes, but applying it fails
BAD = Message("m", "q", b"p", {"twopc-priority": "x"})
CURSOR_POISON = encode({"k": "M", "q": "q", "e": 7, "n": 1, "o": message_obj(BAD)})
#: a record of a kind the store does not know: it does not decode
UNKNOWN = b'{"k":"?","g":"x"}'


def fill_cursor(d: Path) -> None:
    with Cursor(d) as cursor:
        cursor.deliver(Frame("ok", 1, 1, 0, "a"), Message("a", "ok", b"one"))
        cursor._journal.append(CURSOR_POISON)  # bypassing every check, as no live path can now
        cursor.deliver(Frame("ok", 1, 2, 1, "b"), Message("b", "ok", b"two"))


def check_cursor(d: Path) -> None:
    with Cursor(d) as cursor:
        assert [x.body for x in cursor.take_many("g", "ok", 10)] == [b"one", b"two"]
        assert cursor.ack_for("q").seq == 0  # its number was never accepted: a resend is judged


def fill_log(d: Path) -> None:
    with MessageLog(d) as mlog:
        mlog.commit("g1", [Message("a", "ok", b"one")])
        mlog._journal.append(UNKNOWN)
        mlog.commit("g2", [Message("b", "ok", b"two")])


def check_log(d: Path) -> None:
    with MessageLog(d) as mlog:
        assert [m.body for _, m in mlog.pending("ok")] == [b"one", b"two"]


def fill_decisions(d: Path) -> None:
    with FileDecisionLog(d) as log:
        log.log_commit(Decision("t1", ("pg",), None, 1000.0))
        log._journal.append(UNKNOWN)
        log.log_commit(Decision("t2", ("pg",), None, 1000.0))


def check_decisions(d: Path) -> None:
    with FileDecisionLog(d) as log:
        assert sorted(x.gtrid for x in log.pending()) == ["t1", "t2"]


STORES: list[tuple[str, Callable[[Path], None], Callable[[Path], Any], Callable[[Path], None]]] = [
    ("cursor", fill_cursor, Cursor, check_cursor),
    ("log", fill_log, MessageLog, check_log),
    ("decisions", fill_decisions, FileDecisionLog, check_decisions),
]


@pytest.mark.parametrize(("kind", "fill", "opener", "verify"), STORES, ids=[s[0] for s in STORES])
def test_an_unreplayable_record_stops_the_open_and_quarantine_brings_the_store_back(
    tmp_path: Path,
    kind: str,
    fill: Callable[[Path], None],
    opener: Callable[[Path], Any],
    verify: Callable[[Path], None],
) -> None:
    d = tmp_path / kind
    fill(d)
    with pytest.raises(UnreplayableRecordError) as info:
        opener(d)
    err = info.value
    assert err.path.endswith(".seg") and err.segment == 1 and err.offset > 0
    assert err.record and err.reason and f"--segment 1 --offset {err.offset}" in err.message
    assert err.code == "log-unreplayable"

    check = twopc("journal", "check", "--dir", str(d), "--kind", kind)
    assert check.returncode == 1 and f"segment 1 offset {err.offset}" in check.stdout
    wrong = twopc("journal", "quarantine", "--dir", str(d), "--kind", kind,
                  "--segment", "1", "--offset", "0")  # fmt: skip
    assert wrong.returncode == 2 and "nothing was changed" in wrong.stderr, wrong.stderr
    with pytest.raises(UnreplayableRecordError):  # a refused quarantine changed nothing
        opener(d)

    moved = twopc("journal", "quarantine", "--dir", str(d), "--kind", kind,
                  "--segment", "1", "--offset", str(err.offset))  # fmt: skip
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert "every other record" in moved.stdout and "kept in:" in moved.stdout
    kept = json.loads((d / "quarantine" / f"{Path(err.path).stem}@{err.offset}.json").read_text())
    assert kept["segment"] == 1 and kept["offset"] == err.offset
    assert base64.b64decode(kept["record_base64"]).decode("ascii").startswith(err.record[:20])

    verify(d)  # every other record is intact
    again = twopc("journal", "check", "--dir", str(d), "--kind", kind)
    assert again.returncode == 0 and "replays" in again.stdout


def test_quarantine_is_refused_while_the_store_runs(tmp_path: Path) -> None:
    with Cursor(tmp_path / "c"):
        busy = twopc("journal", "check", "--dir", str(tmp_path / "c"), "--kind", "cursor")
    assert busy.returncode == 2 and "log-locked" in busy.stderr
