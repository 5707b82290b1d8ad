"""The wire codec: every frame round-trips, every bad frame is a `FrameError` saying which check.

Invariants named here: ``round_trip`` (decode(encode(f)) == f for every frame type, and the payload
encoding is canonical), ``bad_frame`` (each failed check raises FrameError with its ``what``),
``size_before_allocation`` (an oversized length is refused after reading the 16-byte header and
before reading or allocating a payload byte), ``no_silent_corruption`` (a bit flip or truncation
of a valid frame is always an error, never a different frame) and ``only_frame_error`` (no input
makes the decoder raise anything else).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import math
import pickle
import socket
import struct
import threading
import tracemalloc
import zlib
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from coordinator.errors import FrameError, ProgrammingError
from coordinator.xid import Xid
from messaging.frames import (
    DEFAULT_MAX_FRAME,
    HEADER_SIZE,
    MAGIC,
    MAX_DEPTH,
    Ack,
    Auth,
    ErrorFrame,
    Frame,
    FrameReader,
    FrameType,
    Hello,
    Msg,
    Nack,
    Origin,
    Ping,
    Pong,
    Value,
    Welcome,
    XaReply,
    XaRequest,
    decode,
    decode_value,
    encode,
    encode_value,
    parse_header,
    read_frame,
    send_frame,
    write_frame,
)
from messaging.frames._codec import _decode_generic, _decode_msg, _encode_generic, _encode_msg

XID = Xid.branch_of("node-1:abc-1", "mlog")
U64_MAX = 2**64 - 1

EXAMPLES: list[Frame] = [
    Hello(b"\x01" * 32, "log-server", (1,)),
    Auth("producer-7", b"\x02" * 32, "producer", 1, b"\x03" * 32),
    Welcome(b"\x04" * 32),
    ErrorFrame("bad-frame", "checksum mismatch"),
    Ping(),
    Pong(U64_MAX),
    Msg("log-1:orders", 3, 42, 41, "m-42", "orders", b"payload"),
    Ack("log-1:orders", 3, 42),
    Nack("log-1:orders", 3, 43, "full", "destination holds 10000 messages"),
    Origin("3f2a9c0e5b7d4e1f8a6c2b9d0e4f7a1c", 1_764_000_000_000),
    XaRequest(FrameType.XA_START, 1, XID),
    XaRequest(FrameType.XA_PREPARE, 2, XID),
    XaRequest(FrameType.XA_COMMIT, 3, XID, {"one_phase": True}),
    XaRequest(FrameType.XA_ROLLBACK, 4, XID),
    XaRequest(FrameType.XA_RECOVER, 5),
    XaRequest(FrameType.XA_FORGET, 6, XID),
    XaReply(2, result={"vote": "commit"}),
    XaReply(5, result={"xids": [[XID.format_id, XID.gtrid, XID.bqual]]}),
    XaReply(7, "transient", message="server unreachable"),
]

EDGE_MESSAGES: list[Msg] = [
    Msg("s", 0, 1, 0, "empty", "q", b""),
    Msg("s", 0, 1, 0, "binary", "q", bytes(range(256)) * 3),
    Msg("流/🚀", 0, 1, 0, "ユニコード", "заказы/订单/🚀", "é".encode()),
    Msg("s", U64_MAX, U64_MAX, U64_MAX - 1, "max", "q", b"x", delivery_count=U64_MAX),
    Msg(
        "s",
        1,
        2,
        1,
        "all-fields",
        "q",
        b"\x00\xff",
        headers={
            "neg": -(2**64),
            "float": -0.5,
            "inf": math.inf,
            "none": None,
            "nested": {"list": [1, "two", b"3", [True, False]]},
            "": "empty key",
        },
        expires_at_ms=1_700_000_000_000,
        persistent=False,
        redelivered=True,
        delivery_count=3,
    ),
]


def raw_frame(
    ftype: int,
    payload: bytes,
    *,
    magic: bytes = MAGIC,
    version: int = 1,
    flags: int = 0,
    length: int | None = None,
    crc: int | None = None,
) -> bytes:
    """A frame built by hand, with a correct CRC unless one is given."""
    length = len(payload) if length is None else length
    head = struct.pack(">4sBBHI", magic, version, ftype, flags, length)
    crc = zlib.crc32(payload, zlib.crc32(head)) if crc is None else crc
    return head + struct.pack(">I", crc) + payload


def read_all(data: bytes) -> list[Frame]:
    return list(FrameReader(io.BytesIO(data)))


async def read_async(data: bytes, **kwargs: Any) -> list[Frame | None]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    frames: list[Frame | None] = []
    while (frame := await read_frame(reader, **kwargs)) is not None:
        frames.append(frame)
    return frames


# -- round_trip ------------------------------------------------------------------------------------


def test_examples_cover_every_frame_type() -> None:
    covered = {frame.TYPE for frame in EXAMPLES}
    assert covered | {FrameType.MSGS} == set(FrameType)  # MSGS: test_frame_batches.py


@pytest.mark.parametrize("frame", [*EXAMPLES, *EDGE_MESSAGES], ids=repr)
def test_round_trip_every_frame_type(frame: Frame) -> None:
    data = encode(frame)
    assert data[:4] == MAGIC and data[5] == frame.TYPE
    assert decode(data) == frame
    assert type(decode(data)) is type(frame)
    assert read_all(data + data) == [frame, frame]
    assert asyncio.run(read_async(data)) == [frame]


def test_round_trip_a_body_at_the_size_limit_and_refuse_one_byte_more() -> None:
    small = Msg("s", 1, 1, 0, "big", "q", b"")
    overhead = len(encode(small)) + 3  # the body's length varint grows from 1 to 4 bytes
    body = bytes(range(256)) * ((DEFAULT_MAX_FRAME - overhead) // 256)
    body += b"\xee" * (DEFAULT_MAX_FRAME - overhead - len(body))
    frame = Msg("s", 1, 1, 0, "big", "q", body)
    data = encode(frame)
    assert len(data) == DEFAULT_MAX_FRAME
    assert read_all(data) == [frame]
    with pytest.raises(ProgrammingError, match="exceed the frame limit"):
        encode(Msg("s", 1, 1, 0, "big", "q", body + b"!"))


def test_optional_fields_at_their_default_stay_off_the_wire() -> None:
    bare = encode(Msg("s", 1, 2, 1, "m", "q", b"b"))
    assert b"headers" not in bare and b"redelivered" not in bare and b"expires" not in bare
    assert len(bare) < len(encode(Msg("s", 1, 2, 1, "m", "q", b"b", redelivered=True)))


def test_floats_keep_nan_and_the_sign_of_zero() -> None:
    nan = decode_value(encode_value(math.nan))
    assert isinstance(nan, float) and math.isnan(nan)
    assert math.copysign(1.0, decode_value(encode_value(-0.0))) == -1.0  # type: ignore[arg-type]


def leaves() -> st.SearchStrategy[Value]:
    return (
        st.none()
        | st.booleans()
        | st.integers(-(2**64), U64_MAX)
        | st.floats(allow_nan=False)
        | st.text()
        | st.binary()
    )


values: st.SearchStrategy[Value] = st.recursive(
    leaves(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4)
    ),
    max_leaves=12,
)


def depth(value: Value) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(values)
def test_any_value_round_trips_canonically(value: Value) -> None:
    assume(depth(value) <= MAX_DEPTH)
    data = encode_value(value)
    assert decode_value(data) == value
    assert encode_value(decode_value(data)) == data  # one encoding per value


messages = st.builds(
    Msg,
    stream=st.text(max_size=30),
    epoch=st.integers(0, U64_MAX),
    seq=st.integers(0, U64_MAX),
    prev=st.integers(0, U64_MAX),
    message_id=st.text(max_size=40),
    destination=st.text(max_size=40),
    body=st.binary(max_size=3000),
    headers=st.dictionaries(st.text(max_size=12), leaves(), max_size=5),
    expires_at_ms=st.none() | st.integers(0, U64_MAX),
    persistent=st.booleans(),
    redelivered=st.booleans(),
    delivery_count=st.integers(0, U64_MAX),
)
frames = st.sampled_from(EXAMPLES) | messages


@settings(max_examples=200, deadline=None)
@given(messages)
def test_any_message_round_trips(msg: Msg) -> None:
    assert decode(encode(msg)) == msg


text_messages = messages.map(lambda m: dataclasses.replace(m, headers={
    k: str(v) for k, v in m.headers.items()}))  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(messages | text_messages)
def test_the_msg_fast_path_writes_the_generic_encoding_byte_for_byte(msg: Msg) -> None:
    """The transfer's MSG frames are written field by field (`_encode_msg`): what goes on the
    wire must be what the schema walk writes, or the doc and old peers would disagree."""
    fast = _encode_msg(msg)
    generic = _encode_generic(msg)
    assert fast is None or fast == generic
    if all(type(v) is str for v in msg.headers.values()) and not any(
        0xD800 <= ord(c) <= 0xDFFF for t in (msg.stream, msg.message_id, msg.destination,
                                              *msg.headers, *msg.headers.values()) for c in t
    ):  # fmt: skip
        assert fast is not None  # the everyday message takes the fast path


def _generic_or_error(payload: bytes) -> Frame | str:
    try:
        return _decode_generic(FrameType.MSG, payload)
    except FrameError as exc:
        return f"refused: {exc}"


@settings(max_examples=300, deadline=None)
@given(messages | text_messages, st.data())
def test_the_msg_fast_reader_accepts_only_what_the_generic_one_does(
    msg: Msg, data: st.DataObject
) -> None:
    """`_decode_msg` reads the everyday layout or declines (None); a payload it reads, however
    damaged, must give the frame the generic reader gives, never one the generic reader refuses."""
    payload = bytes(_encode_generic(msg)[HEADER_SIZE:])
    fast = _decode_msg(memoryview(payload))
    assert fast is None or fast == msg
    if _encode_msg(msg) is not None:
        assert fast == msg
    damaged = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(damaged) - 1))
        damaged[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(damaged)))
    for candidate in (bytes(damaged), payload[:cut], payload + b"\x00"):
        fast = _decode_msg(memoryview(candidate))
        if fast is not None:
            assert fast == _generic_or_error(candidate)


# -- encoding misuse is the caller's bug, not a bad frame ------------------------------------------


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (Msg("s", 1, 2**64, 0, "m", "q", b""), "outside"),
        (Msg("s", 1, "2", 0, "m", "q", b""), "seq: expected int, got str"),  # type: ignore[arg-type]
        (Msg("s", 1, True, 0, "m", "q", b""), "seq: expected int, got bool"),
        (Msg("s", 1, 2, 0, "m", "q", "text"), "body: expected bytes"),  # type: ignore[arg-type]
        (Msg("s", 1, 2, 0, "m", "q", b"", headers={1: "x"}), "keys must be str"),  # type: ignore[dict-item]
        (Msg("s", 1, 2, 0, "m", "q", b"", headers={"s": {1, 2}}), "no wire encoding for set"),  # type: ignore[dict-item]
        (Msg("s", 1, 2, 0, "m", "\ud800", b""), "not encodable as UTF-8"),
        (XaRequest(FrameType.XA_PREPARE, 1, "gid"), "expected Xid"),  # type: ignore[arg-type]
        (Hello(b"n", "s", ("1",)), "versions: expected int"),  # type: ignore[arg-type]
    ],
)
def test_encoding_refuses_bad_values(frame: Frame, match: str) -> None:
    with pytest.raises(ProgrammingError, match=match):
        encode(frame)


def test_encoding_refuses_deep_nesting_non_frames_and_wrong_verbs() -> None:
    deep: Value = []
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(ProgrammingError, match="nested deeper"):
        encode(Msg("s", 1, 2, 0, "m", "q", b"", headers={"d": deep}))
    with pytest.raises(ProgrammingError, match="not a frame type"):
        encode(object())  # type: ignore[arg-type]
    with pytest.raises(ProgrammingError, match="not an XA verb"):
        XaRequest(FrameType.MSG, 1)


# -- bad_frame -------------------------------------------------------------------------------------

GOOD = encode(Ack("s", 1, 2))
PING = int(FrameType.PING)


def payload(value: Value) -> bytes:
    return raw_frame(PING, encode_value(value))


def ack_with(**fields: Value) -> bytes:
    return raw_frame(
        int(FrameType.ACK), encode_value({"stream": "s", "epoch": 1, "seq": 2, **fields})
    )


def xa_with(xid: Value) -> bytes:
    return raw_frame(int(FrameType.XA_COMMIT), encode_value({"request_id": 1, "xid": xid}))


def flip(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


BAD_FRAMES = {
    "http": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "magic"),
    "magic": (raw_frame(PING, b"\x09\x00", magic=b"TPCX"), "magic"),
    "version-0": (raw_frame(PING, b"\x09\x00", version=0), "version"),
    "version-5": (raw_frame(PING, b"\x09\x00", version=5), "version"),
    "flags": (raw_frame(PING, b"\x09\x00", flags=0x8000), "flags"),
    "unknown-type": (raw_frame(99, b"\x09\x00"), "type"),
    "type-zero": (raw_frame(0, b"\x09\x00"), "type"),
    "oversized": (raw_frame(PING, b"", length=DEFAULT_MAX_FRAME), "length"),
    "crc-payload": (GOOD[:-1] + bytes([GOOD[-1] ^ 1]), "crc"),
    "crc-field": (flip(GOOD, 12 * 8), "crc"),
    "crc-covers-type": (flip(GOOD, 5 * 8), "crc"),  # ACK (17) -> MSG (16): a valid type
    "crc-covers-length": (flip(GOOD + b"\x00" * 4, 11 * 8 + 2), "crc"),
    "header-cut": (GOOD[:10], "truncated"),
    "payload-cut": (GOOD[:-1], "truncated"),
    "not-a-map": (payload([1, 2]), "payload"),
    "unknown-tag": (raw_frame(PING, b"\x0a"), "payload"),
    "empty-payload": (raw_frame(PING, b""), "payload"),
    "long-varint": (raw_frame(PING, b"\x03" + b"\xff" * 10 + b"\x01"), "payload"),
    "varint-over-u64": (
        raw_frame(PING, b"\x09\x01\x05token\x03" + b"\xff" * 9 + b"\x02"),
        "payload",
    ),
    "non-minimal-varint": (raw_frame(PING, b"\x09\x01\x05token\x03\x81\x00"), "payload"),
    "varint-cut": (raw_frame(PING, b"\x09\x01\x05token\x03\x81"), "payload"),
    "keys-unsorted": (raw_frame(PING, b"\x09\x02\x01b\x00\x01a\x00"), "payload"),
    "keys-duplicated": (raw_frame(PING, b"\x09\x02\x01a\x00\x01a\x00"), "payload"),
    "count-too-big": (raw_frame(PING, b"\x08\xff\xff\xff\x0f"), "payload"),
    "length-past-end": (raw_frame(PING, b"\x07\x05abc"), "payload"),
    "float-cut": (raw_frame(PING, b"\x05\x00\x00"), "payload"),
    "bad-utf8": (raw_frame(PING, b"\x07\x02\xc3\x28"), "payload"),
    "bad-utf8-key": (raw_frame(PING, b"\x09\x01\x01\xff\x00"), "payload"),
    "too-deep": (raw_frame(PING, b"\x08\x01" * (MAX_DEPTH + 1) + b"\x00"), "payload"),
    "bytes-after-map": (raw_frame(PING, b"\x09\x00\x00"), "payload"),
    "missing-field": (raw_frame(int(FrameType.ACK), encode_value({"stream": "s"})), "payload"),
    "unknown-field": (ack_with(one_phase=True), "payload"),
    "wrong-type": (ack_with(seq="2"), "payload"),
    "bool-for-int": (ack_with(seq=True), "payload"),
    "int-for-str": (ack_with(stream=7), "payload"),
    "xid-not-a-list": (xa_with("1_abc_def"), "payload"),
    "xid-invalid": (xa_with([1, "g" * 65, "b"]), "payload"),
    "xid-wrong-size": (xa_with([1, "g"]), "payload"),
    "xa-verb-as-field": (
        raw_frame(int(FrameType.XA_COMMIT), encode_value({"request_id": 1, "verb": 34})),
        "payload",
    ),
    "trailing": (GOOD + b"\x00", "trailing"),
}


@pytest.mark.parametrize("name", sorted(BAD_FRAMES))
def test_every_bad_frame_raises_frame_error_naming_the_check(name: str) -> None:
    data, what = BAD_FRAMES[name]
    with pytest.raises(FrameError) as caught:
        decode(data)
    assert caught.value.what == what  # type: ignore[attr-defined]
    assert caught.value.code == "bad-frame"
    if what != "trailing":  # a stream reader would read the frame and meet the junk next
        with pytest.raises(FrameError) as streamed:
            read_all(data)
        assert streamed.value.what == what  # type: ignore[attr-defined]
        with pytest.raises(FrameError) as awaited:
            asyncio.run(read_async(data))
        assert awaited.value.what == what  # type: ignore[attr-defined]


def test_frame_errors_carry_expected_and_got_and_pickle() -> None:
    with pytest.raises(FrameError) as caught:
        decode(raw_frame(PING, b"", version=9))
    error = caught.value
    assert (error.what, error.expected, error.got) == ("version", [1, 2, 3, 4], 9)  # type: ignore[attr-defined]
    assert "unsupported protocol version" in str(error) and str(error).startswith("[bad-frame]")
    copy = pickle.loads(pickle.dumps(error))
    assert copy.__dict__ == error.__dict__ and str(copy) == str(error)
    with pytest.raises(FrameError) as crc:
        decode(GOOD[:-1] + bytes([GOOD[-1] ^ 1]))
    header = parse_header(GOOD)
    assert crc.value.expected == header.crc and crc.value.got != header.crc  # type: ignore[attr-defined]


def test_a_smaller_per_connection_limit_and_other_versions_are_honoured() -> None:
    data = encode(Msg("s", 1, 2, 1, "m", "q", b"x" * 100))
    with pytest.raises(FrameError) as caught:
        FrameReader(io.BytesIO(data), max_frame=100).read()
    assert caught.value.expected == 100 - HEADER_SIZE  # type: ignore[attr-defined]
    v2 = encode(Ping(1), version=2)
    assert decode(v2, versions=frozenset({1, 2})) == Ping(1)
    with pytest.raises(ProgrammingError):
        FrameReader(io.BytesIO(b""), max_frame=HEADER_SIZE)


# -- the stream reader ---------------------------------------------------------------------------


class Trickle:
    """A source that hands out one byte per read, as a slow network might."""

    def __init__(self, data: bytes) -> None:
        self.data = io.BytesIO(data)

    def readinto(self, buffer: Any) -> int:
        return self.data.readinto(memoryview(buffer)[:1])


def test_short_reads_assemble_whole_frames_and_eof_between_frames_is_a_clean_close() -> None:
    data = b"".join(encode(frame) for frame in EXAMPLES)
    reader = FrameReader(Trickle(data))
    assert list(reader) == EXAMPLES
    assert reader.read() is None


@pytest.mark.parametrize("cut", [1, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 3])
def test_eof_inside_a_frame_is_truncated_and_the_reader_stays_failed(cut: int) -> None:
    data = encode(Ping(5)) + encode(Msg("s", 1, 2, 1, "m", "q", b"body"))[:cut]
    reader = FrameReader(Trickle(data))
    assert reader.read() == Ping(5)
    with pytest.raises(FrameError) as caught:
        reader.read()
    assert caught.value.what == "truncated"  # type: ignore[attr-defined]
    with pytest.raises(FrameError) as again:
        reader.read()
    assert again.value is caught.value  # out of step for good: the caller must close


def test_a_socket_timeout_mid_frame_loses_nothing() -> None:
    left, right = socket.socketpair()
    with left, right:
        right.settimeout(0.05)
        reader = FrameReader(right)
        data = encode(Msg("s", 1, 2, 1, "m", "q", b"body"))
        for part in (data[:7], data[7:20]):  # inside the header, then inside the payload
            left.sendall(part)
            with pytest.raises(TimeoutError):
                reader.read()
        left.sendall(data[20:])
        assert reader.read() == Msg("s", 1, 2, 1, "m", "q", b"body")


# -- size_before_allocation ------------------------------------------------------------------------


class SpySocket:
    """Records how many bytes each recv asked for."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.asked: list[int] = []

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        self.asked.append(nbytes or len(buffer))
        return self.sock.recv_into(buffer, nbytes, flags)


def test_a_2_gib_length_is_refused_after_the_header_without_reading_or_allocating() -> None:
    left, right = socket.socketpair()
    with left, right:
        header = raw_frame(int(FrameType.MSG), b"", length=2**31)
        left.sendall(header + b"\x00" * 1000)  # some payload bytes wait in the socket
        spy = SpySocket(right)
        tracemalloc.start()
        try:
            with pytest.raises(FrameError) as caught:
                FrameReader(spy).read()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert caught.value.what == "length" and caught.value.got == 2**31  # type: ignore[attr-defined]
        assert sum(spy.asked) == HEADER_SIZE and max(spy.asked) <= HEADER_SIZE
        assert peak < 64 * 1024
        assert right.recv(2000, socket.MSG_DONTWAIT) == b"\x00" * 1000  # the payload was not read


def test_asyncio_reader_refuses_a_2_gib_length_before_reading_it() -> None:
    async def scenario() -> tuple[str, int]:
        reader = asyncio.StreamReader()
        reader.feed_data(raw_frame(int(FrameType.MSG), b"", length=2**31) + b"\x00" * 100)
        with pytest.raises(FrameError) as caught:
            await read_frame(reader)
        return caught.value.what, len(await reader.read(1000))  # type: ignore[attr-defined]

    assert asyncio.run(scenario()) == ("length", 100)


def test_asyncio_frames_cross_a_real_socket() -> None:
    async def scenario() -> list[Frame | None]:
        left, right = socket.socketpair()
        _, writer = await asyncio.open_connection(sock=left)
        reader, other = await asyncio.open_connection(sock=right)
        for frame in EXAMPLES:
            await write_frame(writer, frame)
        writer.close()
        got: list[Frame | None] = [await read_frame(reader) for _ in range(len(EXAMPLES) + 1)]
        other.close()
        return got

    assert asyncio.run(scenario()) == [*EXAMPLES, None]


def test_send_frame_writes_one_whole_frame() -> None:
    left, right = socket.socketpair()
    with left, right:
        sent = threading.Thread(target=send_frame, args=(left, EDGE_MESSAGES[1]))
        sent.start()
        assert FrameReader(right).read() == EDGE_MESSAGES[1]
        sent.join()


# -- no_silent_corruption, only_frame_error --------------------------------------------------------

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_frame_error(data: bytes) -> None:
    with contextlib.suppress(FrameError):
        decode(data)
    with contextlib.suppress(FrameError):
        read_all(data)


@FUZZ
@given(st.binary(max_size=120))
def test_random_payloads_behind_a_valid_header_raise_only_frame_error(body: bytes) -> None:
    for ftype in (FrameType.MSG, FrameType.XA_COMMIT, FrameType.HELLO):
        try:
            decode(raw_frame(int(ftype), body))
        except FrameError as exc:
            assert exc.what == "payload"  # type: ignore[attr-defined]


@FUZZ
@given(frames, st.data())
def test_a_single_bit_flip_never_decodes(frame: Frame, data: st.DataObject) -> None:
    good = encode(frame)
    bit = data.draw(st.integers(0, len(good) * 8 - 1), label="bit")
    with pytest.raises(FrameError):
        decode(flip(good, bit))


@FUZZ
@given(frames, frames, st.data())
def test_a_damaged_stream_never_yields_a_frame_that_was_not_sent(
    first: Frame, second: Frame, data: st.DataObject
) -> None:
    sent = [first, second]
    stream = encode(first) + encode(second)
    bit = data.draw(st.integers(0, len(stream) * 8 - 1), label="bit")
    reader = FrameReader(io.BytesIO(flip(stream, bit)))
    got: list[Frame] = []
    with pytest.raises(FrameError):
        while (frame := reader.read()) is not None:
            got.append(frame)
    assert got == sent[: len(got)] and len(got) < 2


@FUZZ
@given(frames, st.data())
def test_every_truncation_is_truncated(frame: Frame, data: st.DataObject) -> None:
    good = encode(frame)
    cut = data.draw(st.integers(1, len(good) - 1), label="cut")
    for attempt in (lambda: decode(good[:cut]), lambda: read_all(good[:cut])):
        with pytest.raises(FrameError) as caught:
            attempt()
        assert caught.value.what == "truncated"  # type: ignore[attr-defined]


@pytest.mark.parametrize("read_ahead", [0, 20, 64 * 1024])
def test_a_reading_ahead_reader_returns_the_same_frames_and_keeps_a_partial_one(
    read_ahead: int,
) -> None:
    """A `Connection`'s reader reads ahead: several frames per system call, what it holds shown
    by `pending` (``select`` cannot see it), a frame cut by a timeout finished by the next read,
    a frame larger than the buffer read straight into place, and a clean close still None."""
    a, b = socket.socketpair()
    with a, b:
        frames = [Ping(1), Msg("s", 1, 1, 0, "m1", "q", b"x" * 100), Ping(2)]
        big = Msg("s", 1, 2, 1, "m2", "q", bytes(range(256)) * 300)
        data = b"".join(encode(f) for f in [*frames, big])
        last = encode(Pong(3))
        a.sendall(data + last[:5])
        reader = FrameReader(b, read_ahead=read_ahead)
        assert [reader.read() for _ in range(4)] == [*frames, big]
        b.settimeout(0.05)
        with pytest.raises(TimeoutError):
            reader.read()
        b.settimeout(None)
        a.sendall(last[5:])
        assert reader.read() == Pong(3)
        assert reader.pending() == 0
        a.sendall(encode(Ping(4)) + encode(Ping(5)))
        assert reader.read() == Ping(4)
        assert (reader.pending() > 0) == (read_ahead > 0)  # part of Ping(5), read with Ping(4)
        assert reader.read() == Ping(5)
        a.close()
        assert reader.read() is None
