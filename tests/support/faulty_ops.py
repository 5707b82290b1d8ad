"""`FaultyOps`: real file I/O that fails on demand, the way a full or dying disk does.

The journal and the decision logs take a `FileOps` strategy; a test hands them this one and sets
the fault it wants just before the call it means to break. Every fault is off until a test sets it.
"""

from __future__ import annotations

import errno
import os
import time

from coordinator.journal import OsFileOps


class FaultyOps(OsFileOps):
    """Real I/O that fails once, on demand.

    ``write_errno``: the next write raises it (once), after writing the first ``write_partial``
    bytes of its data, as a disk that fills up mid-write does. ``fsync_errno``: the next fsync
    raises it (once). ``truncate_errno``: every truncate raises it, until it is set back to None.
    ``fsync_delay``: seconds each fsync sleeps first, a slow disk. ``fail_new_files``: every write
    at offset 0 (only a new file is written there) raises ENOSPC, until it is set back to False.
    """

    def __init__(self) -> None:
        self.write_errno: int | None = None
        self.write_partial = 0
        self.fsync_errno: int | None = None
        self.truncate_errno: int | None = None
        self.fsync_delay = 0.0
        self.fail_new_files = False

    def write(self, fd: int, data: bytes, offset: int) -> None:
        if self.fail_new_files and offset == 0:  # only a new file is written at offset 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self.write_errno is not None:
            err, self.write_errno = self.write_errno, None
            super().write(fd, data[: self.write_partial], offset)
            raise OSError(err, os.strerror(err))
        super().write(fd, data, offset)

    def fsync(self, fd: int) -> None:
        if self.fsync_errno is not None:
            err, self.fsync_errno = self.fsync_errno, None
            raise OSError(err, os.strerror(err))
        time.sleep(self.fsync_delay)
        super().fsync(fd)

    def truncate(self, fd: int, length: int) -> None:
        if self.truncate_errno is not None:
            raise OSError(self.truncate_errno, os.strerror(self.truncate_errno))
        super().truncate(fd, length)
