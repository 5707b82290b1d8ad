"""The directory lock: one live writer per journal.

``flock`` rather than a pid file: the kernel drops it when the holder dies, however it dies, so a
crashed manager never leaves a stale lock for an operator to clear by hand (and never tempts
one to clear a live one). It is taken on a separate open file description each time, so two
journals in one process conflict just as two processes do. The LOCK file itself is never
deleted: deleting a lock file races with the next process opening it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from coordinator.errors import LogError, LogLockedError

from ._fileops import FILE_MODE, FileOps, fsync_dir
from ._segment import LOCK


def acquire_lock(directory: Path, ops: FileOps) -> int:
    """Take the lock or raise `LogLockedError`; return the fd whose closing releases it."""
    path = directory / LOCK
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise LogLockedError(
            f"log directory {directory} is held by another live manager{holder}; "
            "two managers must never write one log",
            directory=str(directory),
        ) from None
    except OSError as exc:
        os.close(fd)
        raise LogError(f"cannot lock log directory {directory}: {exc}") from exc
    _note_holder(fd)
    if created:
        fsync_dir(ops, directory)
    return fd


def _note_holder(fd: int) -> None:
    # Diagnostic only (never trusted for exclusion): tells the next contender who holds the lock.
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        pid = int(os.pread(fd, 32, 0).decode("ascii").strip())
        return f" (process {pid})"
    return ""
