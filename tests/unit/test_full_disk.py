"""A really full disk: the decision log on a 256 KiB tmpfs, filled until writes fail with ENOSPC.

The write-hook tests (tests/support/faulty_ops.py) cover every failure shape; this one checks the
same promises against the kernel's own ENOSPC, partial writes included.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator import FileDecisionLog, LogWriteError, TransactionManager, TransactionRolledBack
from coordinator.decision_log import Decision
from tests.support.file_resource import FileResource
from tests.support.managers import make_manager


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "tiny"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(path: Path, leave: int = 0) -> None:
    """Take every free byte but ``leave`` with a filler file."""
    st = os.statvfs(path.parent)
    path.write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))


def decision(n: int) -> Decision:
    return Decision(f"disk-1:x-{n}", ("a", "b"), None, 1.0)


def test_full_disk_refuses_the_decision_and_keeps_every_acknowledged_one(tiny_disk: Path) -> None:
    log = FileDecisionLog(tiny_disk / "txlog")
    acked: list[str] = []
    fill(tiny_disk / "filler", leave=8 * 1024)
    with pytest.raises(LogWriteError) as refused:
        for n in range(10_000):
            log.log_commit(decision(n))
            acked.append(decision(n).gtrid)
    assert refused.value.durable is False  # certainly not on disk: the caller may abort
    assert acked, "some decisions fitted before the disk filled"
    (tiny_disk / "filler").unlink()  # space comes back; the log goes on
    log.log_commit(decision(99_999))
    log.close()
    reopened = FileDecisionLog(tiny_disk / "txlog")
    try:
        pending = {d.gtrid for d in reopened.pending()}
    finally:
        reopened.close()
    assert pending == {*acked, decision(99_999).gtrid}  # durable_ack, and nothing torn left


def test_full_disk_rolls_the_transaction_back(tiny_disk: Path, tmp_path: Path) -> None:
    a, b = FileResource("a", tmp_path / "a"), FileResource("b", tmp_path / "b")
    managers: list[TransactionManager] = []
    tm = make_manager(managers, [a, b], log=FileDecisionLog(tiny_disk / "txlog"))
    try:
        fill(tiny_disk / "filler")
        committed = 0
        with pytest.raises(TransactionRolledBack) as rolled:  # the page's slack runs out first
            for _ in range(1000):
                with tm.transaction(timeout=None) as tx:
                    tx.join(a).add("n", 1)
                    tx.join(b).add("n", 1)
                committed += 1
        assert rolled.value.reason == "log write failed"
        assert not a.recover() and not b.recover()  # presumed abort: nothing left prepared
        assert a.state().data.get("n", 0) == b.state().data.get("n", 0) == committed
        assert tm.log.pending() == []
    finally:
        for manager in managers:
            manager.close()
