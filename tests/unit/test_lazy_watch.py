"""`LazyWatch`: a lazy record's callback runs once the record is on disk, never before, never
if its write failed; a forced record carries it with no fsync of its own."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest

from coordinator.errors import LogWriteError
from coordinator.journal import Journal, LazyWatch
from tests.support.faulty_ops import FaultyOps


def _journal(path: Path, ops: FaultyOps | None = None) -> Journal:
    return Journal(path, replay=lambda payload: None, file_ops=ops)


def test_a_forced_record_carries_the_lazy_one_without_an_fsync_of_its_own(tmp_path: Path) -> None:
    journal = _journal(tmp_path / "j")
    watch = LazyWatch(journal, delay=60.0, name="test")  # the thread never fsyncs in this test
    done: list[str] = []
    ticket = journal.submit(b"lazy", force=False)
    watch.watch(ticket, lambda: done.append("lazy"))
    watch.settle()
    assert done == []  # in memory only
    before = journal.stats().fsyncs
    journal.append(b"forced", force=True)
    watch.settle()
    assert done == ["lazy"] and journal.stats().fsyncs == before + 1
    watch.close()
    journal.close()


def test_an_idle_journal_fsyncs_the_lazy_record_itself_after_the_delay(tmp_path: Path) -> None:
    journal = _journal(tmp_path / "j")
    watch = LazyWatch(journal, delay=0.01, name="test")
    ran = threading.Event()
    watch.watch(journal.submit(b"lazy", force=False), ran.set)
    assert ran.wait(5), "the callback never ran"
    watch.close()
    journal.close()
    reopened: list[bytes] = []
    Journal(tmp_path / "j", replay=reopened.append).close()
    assert reopened == [b"lazy"]  # on disk


def test_flush_runs_every_callback_in_record_order(tmp_path: Path) -> None:
    journal = _journal(tmp_path / "j")
    watch = LazyWatch(journal, delay=60.0, name="test")
    done: list[int] = []
    for n in range(5):
        watch.watch(journal.submit(b"r%d" % n, force=False), lambda n=n: done.append(n))
    watch.flush()
    assert done == [0, 1, 2, 3, 4]
    watch.close()
    journal.close()


def test_a_failed_write_never_runs_its_callback(tmp_path: Path) -> None:
    ops = FaultyOps()
    journal = _journal(tmp_path / "j", ops)
    watch = LazyWatch(journal, delay=60.0, name="test")
    done: list[str] = []
    watch.watch(journal.submit(b"lazy", force=False), lambda: done.append("lazy"))
    ops.fsync_errno = errno.EIO
    with pytest.raises(LogWriteError):
        journal.append(b"forced", force=True)
    watch.settle()
    assert done == []  # what it would announce stays undone: recovery finishes it
    watch.close()
