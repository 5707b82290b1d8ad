"""Messages the cursor refused (``NACK invalid-message``), kept beside the log's journal.

A refusal means the cursor judged the message one no log could have written: it will refuse every
resend too, and later messages of its stream cannot be accepted past it (their previous number
names it). So the transfer takes it out of the stream, as an expiry would, but only after it is
kept here whole: ``refused/<stream>/<epoch>-<seq>.json`` (its stream quoted into a file name),
written to a temporary file, fsync'd, renamed and the directory fsync'd, before the log forgets
it. Writing it again (a crash before the log's ``D`` record was durable, a repeated refusal)
replaces the same file with the same contents. An operator reads them, fixes the producer or the
version skew that caused them, and sends again what should be sent.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import quote

from ._records import Message, message_obj, to_message

REFUSED_DIR = "refused"


def keep_refused(
    directory: Path, stream: str, epoch: int, seq: int, *, message: Message, reason: str
) -> Path:
    """Write the refused message durably; return its file."""
    folder = directory / REFUSED_DIR / quote(stream, safe="")
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / f"{epoch}-{seq}.json"
    record = {"stream": stream, "epoch": epoch, "seq": seq, "reason": reason,
              "message": message_obj(message)}  # fmt: skip
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(record, indent=1).encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    for d in (folder, folder.parent, directory):
        _fsync_dir(d)
    return path


def read_refused(path: Path) -> tuple[str, int, Message]:
    """(reason, seq, message) of a kept file: for operators' tools and tests."""
    record = json.loads(path.read_text())
    return record["reason"], record["seq"], to_message(record["message"])


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["REFUSED_DIR", "keep_refused", "read_refused"]
