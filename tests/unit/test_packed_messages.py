"""A remote producer's packed messages (protocol version 4): what goes in comes out, and a run
that breaks the layout is a bad request, never another exception, whatever its bytes."""

from __future__ import annotations

import contextlib
import random
import struct

import pytest

from coordinator.errors import ProgrammingError
from messaging.remote._packed import pack, packed_size, unpack
from messaging.remote.protocol import BadRequestError
from resource_managers.message_log import InvalidMessageError, Message

RUN = [
    Message("a1", "orders", b"hello", {"twopc-priority": "7", "région": "Zürich ✓"}),
    Message("a2", "topic:prices", b"", {}, persistent=False),
    Message("a3", "orders", bytes(range(256)) * 3, {"n": "3"}, expires_at=4_000_000_000_000),
    Message("a4", "orders", b"x", {}, expires_at=0),
]


def test_what_goes_in_comes_out() -> None:
    got = unpack(pack(RUN))
    assert got == RUN
    assert [type(m.body) for m in got] == [bytes] * len(RUN)


def test_the_size_estimate_is_never_low() -> None:
    for m in RUN:
        assert packed_size(m) >= len(pack([m])) - 4  # the run's count is not the message's


def test_an_empty_run_is_not_packed() -> None:
    with pytest.raises(ProgrammingError):
        pack([])


def _layout_refused(data: bytes, words: str) -> None:
    with pytest.raises(BadRequestError) as caught:
        unpack(data)
    assert words in str(caught.value)


def test_each_break_of_the_layout_is_a_bad_request() -> None:
    one = pack([RUN[0]])
    _layout_refused(b"\x00\x00", "shorter than its count")
    _layout_refused(struct.pack(">I", 0), "a count of 0")
    _layout_refused(struct.pack(">I", 2**32 - 1) + one[4:], "a count of 4294967295")
    _layout_refused(one[:-1], "past the end")
    _layout_refused(one + b"\x00", "1 bytes after the last message")
    _layout_refused(one[:4] + bytes([one[4] | 8]) + one[5:], "unknown flags")
    no_flag = bytearray(one)
    no_flag[5:13] = struct.pack(">Q", 5)  # an expiry, flag 4 not set
    _layout_refused(bytes(no_flag), "an expiry without its flag")
    twice = pack([Message("d", "q", b"", {"h": "1", "i": "2"})]).replace(b"\x00\x01i", b"\x00\x01h")
    _layout_refused(twice, "a header name twice")
    bad_text = pack([Message("é", "q", b"")]).replace("é".encode(), b"\xff\xfe")
    _layout_refused(bad_text, "not UTF-8")


def test_what_the_message_says_is_judged_as_any_message_is() -> None:
    with pytest.raises(InvalidMessageError):
        unpack(pack([RUN[0], Message("m", "q.DLQ", b"p")]))
    with pytest.raises(InvalidMessageError):
        unpack(pack([Message("m", "q", b"p", {"twopc-priority": "99"})]))


def test_damaged_runs_are_refused_cleanly() -> None:
    """Truncations and flipped bytes anywhere: a bad request or an invalid message, nothing
    else (no IndexError, struct.error or UnicodeDecodeError escapes)."""
    rng = random.Random(7)
    data = pack(RUN)
    for _ in range(3_000):
        damaged = bytearray(data)
        if rng.random() < 0.3:
            del damaged[rng.randrange(len(damaged)) :]
        for _ in range(rng.randint(1, 3)):
            if damaged:
                damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        with contextlib.suppress(BadRequestError, InvalidMessageError):
            unpack(bytes(damaged))
