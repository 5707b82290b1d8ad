"""Partitioned destinations: the stream of a destination a message is numbered in.

A route that names N cursors (``--route 'orders.*=h1:p1,h2:p2'``, `messaging.routes`) splits
each destination it matches into N *partitions*, partition ``i`` going to the route's ``i``-th
cursor. Each partition is a stream of its own, numbered 1, 2, 3 ... by the log at commit, so
each cursor sees a gapless stream and its filter works unchanged; the cursor delivers into the
destination's queue (the message's destination), never into a queue named after the stream.

The rule, stable across processes, versions and languages:

- a message's key is its ``twopc-key`` header (``send(..., key=...)``, 1-200 characters);
- with a key, the partition is the first 8 bytes of ``blake2b(key.encode("utf-8"),
  digest_size=8)`` (BLAKE2b, RFC 7693, unkeyed, 8-byte digest) read as a big-endian unsigned
  integer, modulo N. Python's ``hash()`` is salted per process and never used. CRC-32 was the
  first choice and is refused: it is linear, so keys that differ only in a few low bits
  (``k0``..``k3``, ``customer-1``..) can all land in one partition of a power-of-two count;
  BLAKE2b mixes every bit, costs under a microsecond per key, and is in every language's
  standard crypto library;
- without a key, partition 0. Keyless messages of a log so keep the log's commit order among
  themselves (they are one stream, as on an unpartitioned destination), and a transaction's
  keyless messages stay together; spreading load is what keys are for.

The stream's name carries the partition and the count: ``<destination>#p<i>.<N>`` (``#`` never
appears in a destination; a non-persistent twin adds ``#np`` after it). An unpartitioned
destination (N = 1) keeps its bare name, so journals and cursors of before partitions read on.
Because the count is in the name, a record says under which count its message was numbered: a
log reopened with another count for a destination still holding unacknowledged messages can see
it and refuse (`MessageLog`'s ``partitions`` check), and a changed count never reuses a stream
name for a different split of the keys.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ._records import KEY_HEADER, VOLATILE_SUFFIX, Message

#: a route may name at most this many cursors
MAX_PARTITIONS = 64
#: between a destination and its partition in a stream name
PARTITION_MARK = "#p"


def partition_of(key: str | None, count: int) -> int:
    """The partition (0 .. ``count``-1) of a message with ``key``: its UTF-8 bytes' 8-byte
    BLAKE2b digest, big-endian, modulo ``count``; 0 without a key."""
    if key is None or count <= 1:
        return 0
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % count


def stream_for(message: Message, count: int) -> str:
    """The stream ``message`` is numbered in when its destination has ``count`` partitions."""
    if count <= 1:
        return message.stream
    index = partition_of(message.headers.get(KEY_HEADER), count)
    name = f"{message.destination}{PARTITION_MARK}{index}.{count}"
    return name if message.persistent else name + VOLATILE_SUFFIX


@dataclass(frozen=True)
class StreamName:
    """A stream name taken apart: its destination, persistence, partition and partition count
    (0 and 1 for an unpartitioned destination)."""

    destination: str
    persistent: bool
    index: int = 0
    count: int = 1


def parse_stream(name: str) -> StreamName | None:
    """The parts of a stream name `stream_for` could have made; None if it could not."""
    persistent = not name.endswith(VOLATILE_SUFFIX)
    base = name.removesuffix(VOLATILE_SUFFIX)
    destination, mark, part = base.rpartition(PARTITION_MARK)
    if not mark:
        return None if "#" in base else StreamName(base, persistent)
    index, dot, count = part.partition(".")
    if not (dot and index.isdigit() and count.isdigit() and index.isascii() and count.isascii()):
        return None
    i, n = int(index), int(count)
    if not 0 <= i < n or not 2 <= n <= MAX_PARTITIONS or "#" in destination or not destination:
        return None
    if f"{i}.{n}" != part:  # one spelling per partition: no "01.2"
        return None
    return StreamName(destination, persistent, i, n)


def on_its_stream(message: Message, stream: str) -> bool:
    """Whether ``message`` belongs on ``stream``: its destination, persistence and, for a
    partitioned stream, the partition its key hashes to under the stream's count (what a
    cursor checks of every transferred message)."""
    parsed = parse_stream(stream)
    return parsed is not None and stream_for(message, parsed.count) == stream
