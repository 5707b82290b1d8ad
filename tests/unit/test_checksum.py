"""`coordinator.checksum.crc32` is the CRC-32 of `binascii`, whatever the size and the buffer type
(it only feeds large buffers in pieces, so the GIL is kept), and a frame or a journal record
checked with it reads back as before."""

from __future__ import annotations

import binascii
import os

import pytest

from coordinator.checksum import crc32
from coordinator.journal._framing import encode_frame, payload_problem


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 8192, 50_000, 123_457])
def test_the_same_crc_as_binascii_at_every_size_and_buffer_type(size: int) -> None:
    data = os.urandom(size)
    for buffer in (data, bytearray(data), memoryview(data)):
        assert crc32(buffer) == binascii.crc32(data)
        assert crc32(buffer, 12345) == binascii.crc32(data, 12345)


def test_a_large_record_frames_and_checks_as_before() -> None:
    payload = os.urandom(60_000)
    frame = encode_frame(payload)
    header, body = frame[: len(frame) - len(payload)], frame[len(frame) - len(payload) :]
    assert payload_problem(header, body) is None
    damaged = bytearray(body)
    damaged[50_000] ^= 1
    assert payload_problem(header, bytes(damaged)) == "checksum mismatch"
