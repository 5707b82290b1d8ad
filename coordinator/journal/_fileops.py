"""The journal's I/O, behind one small strategy so tests can make the disk fail.

Every write, fsync and truncate of journal data and of the directory goes through a `FileOps`.
Tests swap in one that raises ENOSPC or EIO at a chosen moment; nothing else about the filesystem
is faked, so the code under test is the code that runs for users.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from pathlib import Path
from typing import Protocol

FILE_MODE = 0o600
DIR_MODE = 0o700


class FileOps(Protocol):
    """Raw I/O on file descriptors. Each call raises `OSError` on failure and never retries."""

    def write(self, fd: int, data: bytes, offset: int) -> None:
        """Write all of ``data`` at ``offset``; on error, some prefix may have been written."""

    def fsync(self, fd: int) -> None:
        """Make everything written to ``fd`` (a file or a directory) durable."""

    def truncate(self, fd: int, length: int) -> None:
        """Cut the file to ``length`` bytes."""


class OsFileOps:
    """The real thing: ``pwrite`` at explicit offsets, so a truncation never leaves a hole."""

    def write(self, fd: int, data: bytes, offset: int) -> None:
        view = memoryview(data)
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written

    def fsync(self, fd: int) -> None:
        if sys.platform == "darwin":  # pragma: no cover - fsync there does not reach the platter
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
        else:
            os.fsync(fd)

    def truncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)


def fsync_dir(ops: FileOps, directory: Path) -> None:
    """A created, renamed or deleted name is durable only once its directory is fsync'd."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        ops.fsync(fd)
    finally:
        os.close(fd)


def ensure_dir(ops: FileOps, directory: Path) -> None:
    """Create the log directory (owner-only: decisions name customers' transactions).

    One level at a time, fsyncing each parent, so no level's name can vanish in a crash.
    """
    missing: list[Path] = []
    while not directory.is_dir():
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        path.mkdir(mode=DIR_MODE, exist_ok=True)
        fsync_dir(ops, path.parent)


def create_file(ops: FileOps, path: Path, data: bytes) -> int:
    """Create ``path`` (it must not exist), write ``data``, fsync; return the fd, still open.

    The file is unlinked again on any failure, so a half-made file never outlives the error.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    try:
        ops.write(fd, data, 0)
        ops.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()
        raise
    return fd


def replace_file(ops: FileOps, path: Path, data: bytes) -> None:
    """Atomically give ``path`` new contents: write a temporary, fsync, rename, fsync the directory.

    A crash leaves either the old or the new contents, never a mix. The final directory fsync is
    left to the caller, who must know whether it failed (the rename may or may not be durable).
    """
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.close(create_file(ops, tmp, data))
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
