"""Decision logs: the DecisionLog contract, shared by the file and memory logs, and what only a
file log can promise (surviving a reopen, a torn write, a rollover, a failing disk)."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coordinator.decision_log import (
    Decision,
    DecisionLog,
    FileDecisionLog,
    HeuristicRecord,
    MemoryDecisionLog,
    inspect_log,
)
from coordinator.decision_log._file import decode, encode
from coordinator.decision_log._memory import End, Forget
from coordinator.errors import FencedError, LogCorruptionError, LogWriteError
from coordinator.journal import Journal
from tests.support.faulty_ops import FaultyOps
from tests.support.threads import run_threads

ROOT = Path(__file__).resolve().parents[2]
Factory = Callable[[], DecisionLog]


def commit(gtrid: str, *branches: str, deadline: float | None = None) -> Decision:
    return Decision(gtrid, branches or ("pg", "redis"), deadline, 1000.0)


def heuristic(gtrid: str, branch: str, outcome: str = "heuristic-rollback") -> HeuristicRecord:
    return HeuristicRecord(gtrid, branch, outcome, "seen by test", 2000.0)


@pytest.fixture(params=["file", "memory"])
def make_log(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Factory]:
    opened: list[DecisionLog] = []

    def factory() -> DecisionLog:
        log: DecisionLog
        if request.param == "file":
            log = FileDecisionLog(tmp_path / "txlog")
        else:
            log = MemoryDecisionLog()
        opened.append(log)
        return log

    yield factory
    for log in opened:
        log.close()


# -- the contract, for both logs -------------------------------------------------------------


def test_both_logs_implement_the_protocol(make_log: Factory) -> None:
    assert isinstance(make_log(), DecisionLog)


def test_commit_is_pending_until_end(make_log: Factory) -> None:
    log = make_log()
    log.log_commit(commit("g1"))
    log.log_commit(commit("g2", "a"))
    assert [d.gtrid for d in log.pending()] == ["g1", "g2"]
    assert log.pending()[1] == commit("g2", "a")
    log.log_end("g1")
    assert [d.gtrid for d in log.pending()] == ["g2"]


def test_idempotence_repeated_commit_and_end_are_harmless(make_log: Factory) -> None:
    log = make_log()
    log.log_commit(commit("g1"))
    log.log_commit(commit("g1"))
    assert len(log.pending()) == 1
    log.log_end("g1")
    log.log_end("g1")
    log.log_end("never-committed")
    assert log.pending() == []


def test_heuristics_stay_until_forgotten(make_log: Factory) -> None:
    log = make_log()
    log.log_heuristic(heuristic("g1", "pg"))
    log.log_heuristic(heuristic("g1", "redis"))
    log.log_heuristic(heuristic("g2", "pg", "heuristic-mixed"))
    log.forget_heuristic("g1", "pg")
    assert [(h.gtrid, h.branch) for h in log.heuristics()] == [("g1", "redis"), ("g2", "pg")]
    log.forget_heuristic("g2")
    assert [(h.gtrid, h.branch) for h in log.heuristics()] == [("g1", "redis")]
    assert log.heuristics()[0] == heuristic("g1", "redis")


def test_fencing_a_decision_past_its_deadline_is_not_written(make_log: Factory) -> None:
    log = make_log()
    with pytest.raises(FencedError, match="past its deadline") as info:
        log.log_commit(commit("late", deadline=time.time() - 1))
    assert info.value.gtrid == "late"
    log.log_commit(commit("in-time", deadline=time.time() + 60))
    assert [d.gtrid for d in log.pending()] == ["in-time"]
    assert log.stats().forced_records == 1


def test_written_at_is_stamped_when_missing(make_log: Factory) -> None:
    log = make_log()
    before = time.time()
    log.log_commit(Decision("g1", ("a",)))
    assert log.pending()[0].written_at >= before


def test_a_closed_log_refuses_writes(make_log: Factory) -> None:
    log = make_log()
    log.close()
    with pytest.raises(LogWriteError) as info:
        log.log_commit(commit("g1"))
    assert info.value.durable is False


def test_stats_count_forced_and_lazy_records(make_log: Factory) -> None:
    log = make_log()
    log.log_commit(commit("g1"))
    log.log_end("g1")
    stats = log.stats()
    assert (stats.forced_records, stats.lazy_records) == (1, 1)


# -- the file log: durability ----------------------------------------------------------------


def test_durability_pending_and_heuristics_survive_reopen(tmp_path: Path) -> None:
    with FileDecisionLog(tmp_path) as log:
        log.log_commit(commit("g1"))
        log.log_commit(commit("g2", deadline=time.time() + 60))
        log.log_end("g1")  # lazy: written by close
        log.log_heuristic(heuristic("g3", "pg"))
        log.log_heuristic(heuristic("g4", "pg"))
        log.forget_heuristic("g4")
        pending, heuristics = log.pending(), log.heuristics()
    with FileDecisionLog(tmp_path) as reopened:
        assert reopened.pending() == pending
        assert [d.gtrid for d in pending] == ["g2"]
        assert reopened.heuristics() == heuristics == [heuristic("g3", "pg")]


def test_codec_round_trips_every_record() -> None:
    for record in [
        commit("g", "a", "b", deadline=12.5),
        Decision("ünïcode", ()),
        End("g"),
        heuristic("g", "b"),
        Forget("g", None),
        Forget("g", "b"),
    ]:
        payload = encode(record)
        assert payload.isascii()
        assert decode(payload) == record


@pytest.mark.parametrize(
    "payload",
    [b"not json", b'{"k":"Z","g":"x"}', b'{"k":"C","g":1,"b":[],"d":null,"w":0}', b"[]"],
)
def test_a_record_that_passes_its_crc_but_not_its_schema_is_corruption(
    tmp_path: Path, payload: bytes
) -> None:
    with Journal(tmp_path) as journal:
        journal.append(encode(commit("g1")))
        journal.append(payload)
    with pytest.raises(LogCorruptionError, match="cannot be replayed") as info:
        FileDecisionLog(tmp_path)
    assert info.value.offset is not None and info.value.path.endswith(".seg")


def test_group_commit_concurrent_decisions_share_fsyncs(tmp_path: Path) -> None:
    ops = FaultyOps()
    ops.fsync_delay = 0.002
    log = FileDecisionLog(tmp_path, file_ops=ops)
    threads, per_thread = 16, 25
    barrier = threading.Barrier(threads)

    def writer(n: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            log.log_commit(commit(f"g{n}-{i}"))

    run_threads(threading.Thread(target=writer, args=(n,)) for n in range(threads))
    stats = log.stats()
    log.close()
    assert stats.forced_records == threads * per_thread
    assert stats.fsyncs < stats.forced_records / 4, stats
    with FileDecisionLog(tmp_path) as reopened:
        assert len(reopened.pending()) == threads * per_thread


# -- the file log: rollover ------------------------------------------------------------------


def test_rollover_keeps_live_decisions_and_deletes_old_segments(tmp_path: Path) -> None:
    with FileDecisionLog(tmp_path, segment_bytes=1024) as log:
        log.log_heuristic(heuristic("h1", "pg"))
        for i in range(200):
            log.log_commit(commit(f"g{i}"))
            if i % 10:
                log.log_end(f"g{i}")
        pending, heuristics = log.pending(), log.heuristics()
        assert log.stats().extra["rollovers"] > 3
    segments = sorted(tmp_path.glob("*.seg"))
    assert len(segments) == 1 and segments[0].stat().st_size < 4096
    with FileDecisionLog(tmp_path, segment_bytes=1024) as reopened:
        assert reopened.pending() == pending
        assert [d.gtrid for d in pending] == [f"g{i}" for i in range(0, 200, 10)]
        assert reopened.heuristics() == heuristics


def test_concurrent_writers_across_rollovers_lose_nothing(tmp_path: Path) -> None:
    log = FileDecisionLog(tmp_path, segment_bytes=2048)
    threads, per_thread = 8, 60

    def writer(n: int) -> None:
        for i in range(per_thread):
            log.log_commit(commit(f"g{n}-{i}"))
            if i % 3:
                log.log_end(f"g{n}-{i}")

    run_threads(threading.Thread(target=writer, args=(n,)) for n in range(threads))
    assert log.stats().extra["rollovers"] > 2
    log.close()
    expected = {f"g{n}-{i}" for n in range(threads) for i in range(0, per_thread, 3)}
    with FileDecisionLog(tmp_path) as reopened:
        assert {d.gtrid for d in reopened.pending()} == expected


def test_a_failed_rollover_does_not_fail_the_commit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ops = FaultyOps()
    log = FileDecisionLog(tmp_path, segment_bytes=300, file_ops=ops)
    for i in range(3):
        log.log_commit(commit(f"g{i}"))
    ops.fail_new_files = True
    with caplog.at_level(logging.ERROR, logger="twopc.decision_log"):
        log.log_commit(commit("g-rolls"))  # durable, even though the rollover after it failed
    assert "rollover failed" in caplog.text
    assert not (tmp_path / "00000000000000000002.seg").exists()
    ops.fail_new_files = False
    log.log_commit(commit("g-next"))  # the next append retries the rollover, and it works
    assert log.stats().extra["rollovers"] == 1
    log.close()
    with FileDecisionLog(tmp_path) as reopened:
        assert len(reopened.pending()) == 5


CRASH_WRITER = """
    import sys
    from coordinator.decision_log import Decision, FileDecisionLog
    log = FileDecisionLog(sys.argv[1], segment_bytes=int(sys.argv[2]))
    for i in range(int(sys.argv[3]), int(sys.argv[3]) + 400):
        print("committing", i, flush=True)
        log.log_commit(Decision(f"g{i}", ("pg",), None, 1.0))
        print("committed", i, flush=True)
        if i % 2:
            log.log_end(f"g{i}")
"""


def run_crash_writer(directory: Path, crash_at: str, segment_bytes: int, start: int = 0) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TWOPC_CRASH_AT": crash_at}
    args = [str(directory), str(segment_bytes), str(start)]
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CRASH_WRITER), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr  # killed by SIGKILL at the crash point
    assert f"crash point {crash_at.partition(':')[0]} reached" in proc.stderr
    return proc.stdout


@pytest.mark.crash
def test_torn_write_crash_drops_only_the_torn_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with FileDecisionLog(tmp_path) as log:
        log.log_commit(commit("before-1"))
        log.log_commit(commit("before-2"))
        log.log_end("before-1")
    out = run_crash_writer(tmp_path, "log.torn_write", 1 << 20)
    assert out.splitlines() == ["committing 0"]  # never acknowledged
    with caplog.at_level(logging.WARNING, logger="twopc.journal"):
        reopened = FileDecisionLog(tmp_path)
    assert [d.gtrid for d in reopened.pending()] == ["before-2"]
    assert reopened.stats().extra["truncated_bytes"] > 0
    assert "torn tail" in caplog.text
    reopened.close()


@pytest.mark.crash
def test_atomicity_crash_mid_compaction_keeps_every_acknowledged_decision(tmp_path: Path) -> None:
    out = run_crash_writer(tmp_path, "log.during_compaction", 2048)
    assert len(list(tmp_path.glob("*.seg"))) == 2  # both segments were left behind
    acknowledged = {
        int(line.split()[1]) for line in out.splitlines() if line.startswith("committed")
    }
    attempted = {int(line.split()[1]) for line in out.splitlines()}
    with FileDecisionLog(tmp_path) as reopened:
        pending = {int(d.gtrid[1:]) for d in reopened.pending()}
    assert len(list(tmp_path.glob("*.seg"))) == 1
    assert {i for i in acknowledged if i % 2 == 0} <= pending  # never ended: must be there
    assert pending <= attempted  # nothing invented
    assert all(i % 2 == 0 for i in pending if i + 1 in acknowledged)  # old ENDs replayed too


# -- the file log: a failing disk ------------------------------------------------------------


def test_full_disk_commit_is_not_durable_and_not_pending(tmp_path: Path) -> None:
    ops = FaultyOps()
    with FileDecisionLog(tmp_path, file_ops=ops) as log:
        ops.write_errno = errno.ENOSPC
        with pytest.raises(LogWriteError) as info:
            log.log_commit(commit("g1"))
        assert info.value.durable is False
        assert log.pending() == []
        log.log_commit(commit("g2"))
    with FileDecisionLog(tmp_path) as reopened:
        assert [d.gtrid for d in reopened.pending()] == ["g2"]


def test_fsync_error_keeps_the_maybe_durable_decision_pending(tmp_path: Path) -> None:
    ops = FaultyOps()
    log = FileDecisionLog(tmp_path, file_ops=ops)
    ops.fsync_errno = errno.EIO
    with pytest.raises(LogWriteError) as info:
        log.log_commit(commit("g1"))
    assert info.value.durable is None
    assert [d.gtrid for d in log.pending()] == ["g1"]  # never presume abort for it
    assert log.stats().extra["poisoned"] is True
    with pytest.raises(LogWriteError):
        log.log_commit(commit("g2"))
    log.close()


# -- inspect_log -----------------------------------------------------------------------------


def test_inspect_reads_a_held_log_without_changing_it(tmp_path: Path) -> None:
    log = FileDecisionLog(tmp_path)
    log.log_commit(commit("g1", "pg", "redis", deadline=time.time() + 60))
    log.log_heuristic(heuristic("g1", "pg"))
    log.forget_heuristic("g1", "pg")
    rows = inspect_log(tmp_path)  # the lock is held by `log`
    log.close()
    assert [row["kind"] for row in rows] == ["SEGMENT", "COMMIT", "HEURISTIC", "FORGET"]
    assert rows[0]["first_live"] == 1
    assert rows[1]["gtrid"] == "g1" and rows[1]["branches"] == ["pg", "redis"]
    assert rows[2]["outcome"] == "heuristic-rollback" and rows[2]["branch"] == "pg"
    assert rows[3]["branch"] == "pg"
    assert all(row["segment"] == "00000000000000000001.seg" for row in rows)
    assert rows[1]["offset"] > 0


def test_inspect_reports_a_torn_tail_and_leaves_it(tmp_path: Path) -> None:
    with FileDecisionLog(tmp_path) as log:
        log.log_commit(commit("g1"))
    segment = next(tmp_path.glob("*.seg"))
    with segment.open("ab") as file:
        file.write(b"\xfe\xd1\x40\x00")
    before = segment.read_bytes()
    rows = inspect_log(tmp_path)
    assert segment.read_bytes() == before
    assert [row["kind"] for row in rows] == ["SEGMENT", "COMMIT", "NOTE"]
    assert "torn tail" in rows[2]["note"] and rows[2]["offset"] == len(before) - 4


def test_inspect_reports_corruption_instead_of_raising(tmp_path: Path) -> None:
    with FileDecisionLog(tmp_path) as log:
        log.log_commit(commit("g1"))
        log.log_commit(commit("g2"))
    segment = next(tmp_path.glob("*.seg"))
    data = bytearray(segment.read_bytes())
    rows = inspect_log(tmp_path)
    data[rows[1]["offset"] + 20] ^= 0x04
    segment.write_bytes(bytes(data))
    rows = inspect_log(tmp_path)
    assert [row["kind"] for row in rows] == ["SEGMENT", "NOTE", "COMMIT"]  # read on past it
    assert "corruption" in rows[1]["note"] and "valid record follows" in rows[1]["note"]
    assert rows[2]["gtrid"] == "g2" and rows[2]["offset"] > rows[1]["offset"]


def test_inspect_of_an_empty_or_missing_directory(tmp_path: Path) -> None:
    assert inspect_log(tmp_path) == []
    rows = inspect_log(tmp_path / "absent")
    assert [row["kind"] for row in rows] == ["NOTE"]
