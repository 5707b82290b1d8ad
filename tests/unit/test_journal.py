"""The journal: framing, group commit, torn tails versus corruption, disk failures, rollover, lock.

Real files in tmp_path and real second processes; the only thing swapped is the `FileOps` strategy,
to make the disk full or failing at a chosen moment. Each test names the invariant it checks.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from coordinator.errors import LogCorruptionError, LogLockedError, LogWriteError
from coordinator.journal import Journal, SegmentHeader
from coordinator.journal._framing import FRAME_HEADER_SIZE, encode_frame
from coordinator.journal._segment import current_contents, segment_name
from tests.support.faulty_ops import FaultyOps
from tests.support.threads import run_threads

ROOT = Path(__file__).resolve().parents[2]


# -- helpers ---------------------------------------------------------------------------------


def seg(directory: Path, seq: int) -> Path:
    return directory / segment_name(seq)


def replayed(directory: Path, **kwargs: object) -> list[bytes]:
    records: list[bytes] = []
    Journal(directory, replay=records.append, **kwargs).close()  # type: ignore[arg-type]
    return records


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.name != "LOCK"}


def write_log(directory: Path, *payloads: bytes) -> None:
    with Journal(directory) as journal:
        for payload in payloads:
            journal.append(payload)


def header_frame(seq: int, first_live: int) -> bytes:
    return encode_frame(SegmentHeader(seq, first_live).encode())


def run_python(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "TWOPC_CRASH_AT"}
    full_env.update(PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=full_env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# -- appending and replay --------------------------------------------------------------------


def test_durability_records_replay_in_order_after_reopen(tmp_path: Path) -> None:
    with Journal(tmp_path) as journal:
        journal.append(b"one")
        journal.append(b"two", force=False)
        journal.append(b"three")
    assert replayed(tmp_path) == [b"one", b"two", b"three"]


def test_append_many_writes_a_batch_in_order_in_one_group(tmp_path: Path) -> None:
    """A store's batch (the cursor's M records) is one queue entry: the records replay one by
    one and in order, are counted as before (lazy ones and a forced last), cost one fsync, and a
    record over the limit queues none of them."""
    with Journal(tmp_path, max_record_bytes=10) as journal:
        journal.append(b"zero")
        before = journal.stats()
        journal.append_many([b"one", b"two", b"three"])
        journal.append_many([b"four"], force=False)
        journal.append_many([])
        after = journal.stats()
        assert after.forced_records - before.forced_records == 1
        assert after.lazy_records - before.lazy_records == 3
        assert after.fsyncs - before.fsyncs == 1
        with pytest.raises(LogWriteError):
            journal.append_many([b"five", b"x" * 11])
        ticket = journal.submit_many([b"six", b"seven"], force=False)  # the two-halves form
        journal.wait(ticket)
        assert journal.stats().lazy_records - after.lazy_records == 2
    assert replayed(tmp_path) == [b"zero", b"one", b"two", b"three", b"four", b"six", b"seven"]


def test_submit_then_wait_keeps_the_callers_order_under_concurrency(tmp_path: Path) -> None:
    """A caller that queues under its own lock and applies under the same lock sees records in
    the order a replay will, while the fsyncs are still shared by the group commit."""
    applied: list[bytes] = []
    lock = threading.Lock()

    def writer(n: int) -> None:
        for i in range(50):
            payload = f"{n}-{i}".encode()
            with lock:
                ticket = journal.submit(payload, force=i % 3 != 0)
                applied.append(payload)
            journal.wait(ticket)

    with Journal(tmp_path) as journal:
        run_threads(threading.Thread(target=writer, args=(n,)) for n in range(8))
        fsyncs = journal.stats().fsyncs
    assert replayed(tmp_path) == applied
    assert fsyncs < len(applied)


def test_fresh_directory_is_private(tmp_path: Path) -> None:
    directory = tmp_path / "new" / "log"
    write_log(directory, b"x")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for path in directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert (directory / "CURRENT").read_bytes() == current_contents(1)


def test_lazy_records_wait_for_the_next_group_or_close(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    size = seg(tmp_path, 1).stat().st_size
    journal.append(b"lazy", force=False)
    assert seg(tmp_path, 1).stat().st_size == size  # queued, not written
    journal.flush()
    assert seg(tmp_path, 1).stat().st_size == size + FRAME_HEADER_SIZE + 4
    journal.append(b"lazy-2", force=False)
    journal.close()
    assert replayed(tmp_path) == [b"lazy", b"lazy-2"]


def test_group_commit_batches_concurrent_forced_records(tmp_path: Path) -> None:
    ops = FaultyOps()
    ops.fsync_delay = 0.002  # a slow disk, so arrivals during an fsync form the next group
    journal = Journal(tmp_path, file_ops=ops)
    threads, per_thread = 32, 10
    barrier = threading.Barrier(threads)

    def writer(n: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            journal.append(f"{n}-{i}".encode())

    run_threads(threading.Thread(target=writer, args=(n,)) for n in range(threads))
    stats = journal.stats()
    journal.close()
    assert stats.forced_records == threads * per_thread
    assert stats.batches < stats.forced_records / 4, stats
    assert stats.fsyncs < stats.forced_records / 4, stats
    records = replayed(tmp_path)
    expected = [f"{n}-{i}".encode() for n in range(threads) for i in range(per_thread)]
    assert sorted(records) == sorted(expected)
    for n in range(threads):  # each writer's own records stay in its order
        mine = [r for r in records if r.startswith(f"{n}-".encode())]
        assert mine == [f"{n}-{i}".encode() for i in range(per_thread)]


def test_without_group_commit_every_forced_record_gets_its_own_fsync(tmp_path: Path) -> None:
    journal = Journal(tmp_path, group_commit=False)
    workers = [threading.Thread(target=lambda: [journal.append(b"r") for _ in range(5)])]
    workers += [threading.Thread(target=lambda: [journal.append(b"s") for _ in range(5)])]
    run_threads(workers)
    stats = journal.stats()
    journal.close()
    assert stats.batches == stats.fsyncs == stats.forced_records == 10


def test_oversized_record_is_refused_and_the_journal_goes_on(tmp_path: Path) -> None:
    with Journal(tmp_path, max_record_bytes=100) as journal:
        with pytest.raises(LogWriteError, match="exceeds") as info:
            journal.append(b"x" * 101)
        assert info.value.durable is False
        journal.append(b"y" * 100)
    assert replayed(tmp_path) == [b"y" * 100]


def test_append_after_close_is_refused(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.close()
    journal.close()  # idempotent
    with pytest.raises(LogWriteError) as info:
        journal.append(b"late")
    assert info.value.durable is False


# -- torn tails: cut, with a warning ---------------------------------------------------------


@pytest.mark.parametrize(
    "damage",
    ["chopped_record", "chopped_header", "zero_tail", "garbage_tail", "huge_length"],
)
def test_torn_tail_is_cut_with_a_warning(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    write_log(tmp_path, b"first", b"second")
    path = seg(tmp_path, 1)
    good = path.stat().st_size
    torn = {
        "chopped_record": encode_frame(b"third record")[:-3],
        "chopped_header": encode_frame(b"third")[:5],
        "zero_tail": b"\0" * 4096,
        "garbage_tail": bytes(range(1, 200)) * 3,
        "huge_length": b"\xfe\xd1" + (2**31).to_bytes(4, "little") + b"\0" * 4,
    }[damage]
    with path.open("ab") as file:
        file.write(torn)
    with caplog.at_level(logging.WARNING, logger="twopc.journal"):
        records: list[bytes] = []
        journal = Journal(tmp_path, replay=records.append)
    assert records == [b"first", b"second"]
    assert journal.truncated_bytes == len(torn)
    assert path.stat().st_size == good
    assert f"dropped a torn tail of {len(torn)} bytes" in caplog.text
    assert path.name in caplog.text and f"offset {good}" in caplog.text
    journal.append(b"after")
    journal.close()
    assert replayed(tmp_path) == [b"first", b"second", b"after"]


# -- corruption: refuse, touch nothing -------------------------------------------------------


def frame_offsets(payloads: list[bytes]) -> list[int]:
    offset, offsets = len(header_frame(1, 1)), []
    for payload in payloads:
        offsets.append(offset)
        offset += FRAME_HEADER_SIZE + len(payload)
    return offsets


@pytest.mark.parametrize("where", ["payload", "length", "magic", "crc"])
def test_bit_flip_in_the_middle_refuses_to_open_and_changes_nothing(
    tmp_path: Path, where: str
) -> None:
    payloads = [b"alpha", b"bravo-record", b"charlie"]
    write_log(tmp_path, *payloads)
    target = frame_offsets(payloads)[1] + {"magic": 0, "length": 3, "crc": 7, "payload": 12}[where]
    path = seg(tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[target] ^= 0x10
    path.write_bytes(bytes(data))
    before = snapshot(tmp_path)
    with pytest.raises(LogCorruptionError) as info:
        Journal(tmp_path)
    assert info.value.path == str(path)
    assert info.value.offset == frame_offsets(payloads)[1]
    assert "valid record follows" in str(info.value)
    assert snapshot(tmp_path) == before


def test_bit_flip_in_a_non_last_segment_refuses(tmp_path: Path) -> None:
    leave_both_segments(tmp_path, old=[b"old-1", b"old-2"], carry=[b"old-2"], new=[b"new"])
    path = seg(tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01  # inside the last record of segment 1: a "tail", but not of the log
    path.write_bytes(bytes(data))
    before = snapshot(tmp_path)
    with pytest.raises(LogCorruptionError, match="not the last segment") as info:
        Journal(tmp_path)
    assert info.value.path == str(path)
    assert snapshot(tmp_path) == before


def test_segment_deleted_under_a_live_journal(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.append(b"before")
    seg(tmp_path, 1).unlink()
    with pytest.raises(LogWriteError, match="deleted") as info:
        journal.append(b"lost")
    assert info.value.durable is False
    assert journal.poisoned
    with pytest.raises(LogWriteError):
        journal.append(b"later")
    journal.close()
    with pytest.raises(LogCorruptionError, match="CURRENT names"):
        Journal(tmp_path)


def test_missing_segment_in_the_live_range_refuses(tmp_path: Path) -> None:
    seg(tmp_path, 1).write_bytes(header_frame(1, 1) + encode_frame(b"a"))
    seg(tmp_path, 3).write_bytes(header_frame(3, 1) + encode_frame(b"c"))  # still needs 1..3
    (tmp_path / "CURRENT").write_bytes(current_contents(3))
    before = snapshot(tmp_path)
    with pytest.raises(LogCorruptionError, match="missing") as info:
        Journal(tmp_path)
    assert info.value.path == str(seg(tmp_path, 2))
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "layout",
    ["bad_file_magic", "wrong_seq", "no_current", "current_garbled", "far_future_segment"],
)
def test_layouts_we_never_write_are_refused(tmp_path: Path, layout: str) -> None:
    write_log(tmp_path, b"a", b"b")
    rest = seg(tmp_path, 1).read_bytes()[len(header_frame(1, 1)) :]
    if layout == "bad_file_magic":
        not_ours = b"NOTOURS!" + SegmentHeader(1, 1).encode()[8:]
        seg(tmp_path, 1).write_bytes(encode_frame(not_ours) + rest)
    elif layout == "wrong_seq":
        seg(tmp_path, 1).write_bytes(header_frame(7, 1) + rest)
    elif layout == "no_current":
        (tmp_path / "CURRENT").unlink()
    elif layout == "current_garbled":
        (tmp_path / "CURRENT").write_bytes(b"segment one\n")
    else:
        seg(tmp_path, 3).write_bytes(header_frame(3, 3))
    before = snapshot(tmp_path)
    with pytest.raises(LogCorruptionError):
        Journal(tmp_path)
    assert snapshot(tmp_path) == before


def test_abandoned_first_start_is_started_again(tmp_path: Path) -> None:
    seg(tmp_path, 1).write_bytes(header_frame(1, 1)[:7])  # died while creating segment 1
    write_log(tmp_path, b"a")
    assert replayed(tmp_path) == [b"a"]


# -- a failing disk --------------------------------------------------------------------------


def test_full_disk_on_write_is_not_durable_and_leaves_no_partial_record(tmp_path: Path) -> None:
    ops = FaultyOps()
    journal = Journal(tmp_path, file_ops=ops)
    journal.append(b"kept")
    size = seg(tmp_path, 1).stat().st_size
    ops.write_errno, ops.write_partial = errno.ENOSPC, FRAME_HEADER_SIZE + 3
    with pytest.raises(LogWriteError, match="No space") as info:
        journal.append(b"a whole record that will not fit")
    assert info.value.durable is False
    assert seg(tmp_path, 1).stat().st_size == size  # the partial write was cut back
    assert not journal.poisoned
    journal.append(b"after")  # still usable
    journal.close()
    assert replayed(tmp_path) == [b"kept", b"after"]


def test_a_cut_back_write_poisons_a_journal_whose_owner_applied_the_records(
    tmp_path: Path,
) -> None:
    """An owner that applies records when it queues them (the message log, the cursor) holds in
    memory what the failed write did not put on disk: nothing may be written on top of that
    until a reopen reads the state back, though the batch itself is certainly not durable."""
    ops = FaultyOps()
    journal = Journal(tmp_path, file_ops=ops, applied_when_queued=True)
    journal.append(b"kept")
    ops.write_errno = errno.ENOSPC
    with pytest.raises(LogWriteError, match="No space") as info:
        journal.append(b"applied in memory, never written", force=False)
        journal.flush()
    assert info.value.durable is False and journal.poisoned
    ops.write_errno = None
    with pytest.raises(LogWriteError, match="refuses writes until reopened") as refused:
        journal.append(b"on top of it")
    assert refused.value.durable is False
    journal.close()
    assert replayed(tmp_path) == [b"kept"]
    with Journal(tmp_path, applied_when_queued=True) as reopened:
        reopened.append(b"after a reopen")
    assert replayed(tmp_path) == [b"kept", b"after a reopen"]


def test_full_disk_fails_every_record_of_the_batch(tmp_path: Path) -> None:
    ops = FaultyOps()
    journal = Journal(tmp_path, file_ops=ops)
    journal.append(b"lazy", force=False)
    ops.write_errno, ops.write_partial = errno.ENOSPC, 30
    with pytest.raises(LogWriteError) as info:
        journal.append(b"forced")
    assert info.value.durable is False
    journal.close()
    assert replayed(tmp_path) == []


def test_fsync_error_may_be_durable_and_poisons(tmp_path: Path) -> None:
    ops = FaultyOps()
    journal = Journal(tmp_path, file_ops=ops)
    journal.append(b"kept")
    ops.fsync_errno = errno.EIO
    with pytest.raises(LogWriteError, match="may or may not be on disk") as info:
        journal.append(b"unknown")
    assert info.value.durable is None
    assert journal.poisoned
    with pytest.raises(LogWriteError, match="until reopened") as later:
        journal.append(b"refused")
    assert later.value.durable is False
    journal.close()
    assert replayed(tmp_path)[0] == b"kept"  # reopening clears the poison


def test_failed_cut_back_after_a_failed_write_poisons(tmp_path: Path) -> None:
    ops = FaultyOps()
    journal = Journal(tmp_path, file_ops=ops)
    ops.write_errno, ops.write_partial, ops.truncate_errno = errno.ENOSPC, 5, errno.EIO
    with pytest.raises(LogWriteError) as info:
        journal.append(b"record")
    assert info.value.durable is None
    assert journal.poisoned
    ops.truncate_errno = None
    journal.close()
    assert replayed(tmp_path) == []  # the 5 stray bytes are a torn tail


def test_every_waiter_of_a_failed_group_gets_the_error(tmp_path: Path) -> None:
    ops = FaultyOps()
    ops.fsync_delay = 0.2
    journal = Journal(tmp_path, file_ops=ops)
    results: list[bool | str | None] = []

    def writer() -> None:
        try:
            journal.append(b"r")
            results.append("ok")
        except LogWriteError as exc:
            results.append(exc.durable)

    first = threading.Thread(target=writer)
    first.start()
    time.sleep(0.01)  # first is now leading, inside its slow fsync
    ops.fsync_errno = errno.EIO
    rest = [threading.Thread(target=writer) for _ in range(5)]
    for thread in rest:
        thread.start()
    for thread in [first, *rest]:
        thread.join()
    journal.close()
    assert results.count("ok") == 1
    assert sorted(map(str, results)) == ["None"] * 5 + ["ok"]


# -- the directory lock ----------------------------------------------------------------------


def test_two_journals_in_one_process_conflict(tmp_path: Path) -> None:
    with Journal(tmp_path):
        with pytest.raises(LogLockedError, match=str(tmp_path)) as info:
            Journal(tmp_path)
        assert info.value.code == "log-locked"
    Journal(tmp_path).close()  # released on close


LOCK_PROBE = """
    import sys
    from coordinator.errors import LogLockedError
    from coordinator.journal import Journal
    try:
        journal = Journal(sys.argv[1])
    except LogLockedError as exc:
        print(exc)
        sys.exit(3)
    print("opened", flush=True)
    sys.stdin.readline()
    journal.close()
"""


def test_a_second_process_cannot_take_a_held_log(tmp_path: Path) -> None:
    with Journal(tmp_path):
        probe = run_python(LOCK_PROBE, str(tmp_path))
        out, _ = probe.communicate(timeout=30)
    assert probe.returncode == 3
    assert str(tmp_path) in out and f"process {os.getpid()}" in out


def test_a_log_held_by_another_process_is_refused_until_it_exits(tmp_path: Path) -> None:
    holder = run_python(LOCK_PROBE, str(tmp_path))
    assert holder.stdout is not None and holder.stdin is not None
    assert holder.stdout.readline().strip() == "opened"
    with pytest.raises(LogLockedError, match=f"process {holder.pid}"):
        Journal(tmp_path)
    holder.stdin.write("\n")
    holder.stdin.flush()
    assert holder.wait(timeout=30) == 0
    Journal(tmp_path).close()


# -- rollover --------------------------------------------------------------------------------


def test_rollover_carries_live_records_and_deletes_old_segments(tmp_path: Path) -> None:
    journal = Journal(tmp_path, segment_bytes=200)
    for i in range(10):
        journal.append(f"record-{i}".encode())
    assert journal.needs_rollover
    journal.rollover([b"record-3", b"record-7"])
    assert not journal.needs_rollover
    journal.append(b"after")
    journal.close()
    assert sorted(p.name for p in tmp_path.glob("*.seg")) == [segment_name(2)]
    assert (tmp_path / "CURRENT").read_bytes() == current_contents(2)
    assert replayed(tmp_path) == [b"record-3", b"record-7", b"after"]
    assert journal.stats().rollovers == 1


def test_rollover_that_cannot_create_its_segment_changes_nothing(tmp_path: Path) -> None:
    ops = FaultyOps()
    journal = Journal(tmp_path, file_ops=ops)
    journal.append(b"a")
    ops.write_errno = errno.ENOSPC
    with pytest.raises(LogWriteError) as info:
        journal.rollover([b"a"])
    assert info.value.durable is False
    assert not seg(tmp_path, 2).exists()
    journal.append(b"b")
    journal.close()
    assert replayed(tmp_path) == [b"a", b"b"]


def leave_both_segments(
    directory: Path, *, old: list[bytes], carry: list[bytes], new: list[bytes]
) -> None:
    """A compaction that died after CURRENT moved but before the old segment was deleted."""
    write_log(directory, *old)
    kept = seg(directory, 1).read_bytes()
    with Journal(directory) as journal:
        journal.rollover(carry)
        for payload in new:
            journal.append(payload)
    seg(directory, 1).write_bytes(kept)


def test_crash_mid_compaction_replays_old_and_new_without_loss(tmp_path: Path) -> None:
    leave_both_segments(tmp_path, old=[b"ended", b"live"], carry=[b"live"], new=[b"new"])
    assert replayed(tmp_path) == [b"ended", b"live", b"live", b"new"]  # duplicates, no loss
    assert not seg(tmp_path, 1).exists()  # the compaction was finished on open
    assert replayed(tmp_path) == [b"live", b"new"]


def test_rollover_interrupted_before_current_moved(tmp_path: Path) -> None:
    write_log(tmp_path, b"a", b"live")
    seg(tmp_path, 2).write_bytes(header_frame(2, 2) + encode_frame(b"live"))
    assert replayed(tmp_path) == [b"a", b"live"]
    assert not seg(tmp_path, 2).exists()
    write_log(tmp_path, b"b")
    assert replayed(tmp_path) == [b"a", b"live", b"b"]


@pytest.mark.crash
def test_real_crash_during_compaction_loses_nothing(tmp_path: Path) -> None:
    code = """
        import sys
        from coordinator.journal import Journal
        journal = Journal(sys.argv[1], segment_bytes=100)
        for i in range(5):
            journal.append(f"r{i}".encode())
        journal.rollover([b"r1", b"r3"])
    """
    proc = run_python(code, str(tmp_path), env={"TWOPC_CRASH_AT": "log.during_compaction"})
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -9, err
    assert "log.during_compaction" in err
    assert seg(tmp_path, 1).exists() and seg(tmp_path, 2).exists()
    records = replayed(tmp_path)
    assert records == [b"r0", b"r1", b"r2", b"r3", b"r4", b"r1", b"r3"]
    assert [p.name for p in tmp_path.glob("*.seg")] == [segment_name(2)]


@pytest.mark.crash
def test_real_torn_write_is_cut_on_reopen(tmp_path: Path) -> None:
    write_log(tmp_path, b"one", b"two")
    code = """
        import sys
        from coordinator.journal import Journal
        Journal(sys.argv[1]).append(sys.argv[2].encode())
    """
    torn = "three, torn in half by the crash"
    proc = run_python(code, str(tmp_path), torn, env={"TWOPC_CRASH_AT": "log.torn_write"})
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -9, err
    records: list[bytes] = []
    journal = Journal(tmp_path, replay=records.append)
    journal.close()
    assert records == [b"one", b"two"]
    assert journal.truncated_bytes == (FRAME_HEADER_SIZE + len(torn)) // 2


def test_stale_current_tmp_is_ignored_and_replaced(tmp_path: Path) -> None:
    """CURRENT.tmp left by a crash inside replace_file is ignored and overwritten next time."""
    write_log(tmp_path, b"a")
    (tmp_path / "CURRENT.tmp").write_bytes(b"junk")
    with Journal(tmp_path) as journal:
        journal.rollover([b"a"])
    assert replayed(tmp_path) == [b"a"]
    assert not (tmp_path / "CURRENT.tmp").exists()


def test_durability_close_during_concurrent_appends_keeps_its_word(tmp_path: Path) -> None:
    """Every acknowledged record is replayed; every record refused with durable=False is not."""
    journal = Journal(tmp_path)
    acknowledged: list[bytes] = []
    refused: list[bytes] = []

    def writer(n: int) -> None:
        for i in range(200):
            payload = f"{n}-{i}".encode()
            try:
                journal.append(payload)
            except LogWriteError as exc:
                assert exc.durable is False
                refused.append(payload)
                return
            acknowledged.append(payload)

    workers = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for worker in workers:
        worker.start()
    time.sleep(0.01)
    journal.close()
    for worker in workers:
        worker.join()
    records = set(replayed(tmp_path))
    assert set(acknowledged) <= records
    assert not set(refused) & records
