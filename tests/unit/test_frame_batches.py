"""MSGS (protocol version 3): runs of messages in one frame, read back as the MSG frames they
stand for; every malformed one a bad frame; older versions never see one."""

from __future__ import annotations

import io
import socket
import struct

import pytest

from coordinator.errors import FrameError, ProgrammingError
from messaging.auth import Peer
from messaging.connection import Connection
from messaging.frames import (
    HEADER_SIZE,
    FrameReader,
    FrameType,
    Msg,
    MsgBatch,
    PackedMsg,
    Ping,
    decode,
    encode,
    encode_many,
)
from messaging.frames._batch import _FIXED, pack_msg
from messaging.transfer.wire import pack_wire, to_wire
from resource_managers.message_log import Message
from resource_managers.sequencing import Frame as SeqFrame
from tests.unit.test_frames import EDGE_MESSAGES, raw_frame

PLAIN = [
    Msg("orders", 3, n, n - 1, f"m-{n}", "orders", bytes([n]) * n, {"id": f"x{n}", "k": "é"})
    for n in range(1, 6)
]
ODD = Msg("s", 1, 9, 8, "odd", "q", b"x", headers={"n": 1})  # a header that is not text


def frames_of(data: bytes) -> list[object]:
    return list(FrameReader(io.BytesIO(data)))


def unbatched(data: bytes) -> list[object]:
    out: list[object] = []
    for frame in frames_of(data):
        out.extend(frame.messages if isinstance(frame, MsgBatch) else [frame])
    return out


def test_a_run_of_messages_is_one_frame_and_reads_back_in_order() -> None:
    sent = [*PLAIN[:3], Ping(7), *PLAIN[3:], ODD]
    data = encode_many(sent, version=3)
    kinds = [type(f).__name__ for f in frames_of(data)]
    assert kinds == ["MsgBatch", "Ping", "MsgBatch", "Msg"]  # the odd one as a MSG of its own
    assert unbatched(data) == sent


@pytest.mark.parametrize("msg", [m for m in EDGE_MESSAGES if pack_msg(m) is not None], ids=repr)
def test_edge_messages_the_layout_holds_round_trip(msg: Msg) -> None:
    assert unbatched(encode_many([msg, msg], version=3)) == [msg, msg]


def test_older_versions_get_msg_frames_and_refuse_msgs() -> None:
    assert [type(f) for f in frames_of(encode_many(PLAIN, version=2))] == [Msg] * len(PLAIN)
    batch = encode(MsgBatch(tuple(PLAIN)), version=3)
    with pytest.raises(FrameError) as caught:
        decode(batch, versions=frozenset({1, 2}))
    assert caught.value.what == "version"  # type: ignore[attr-defined]
    restamped = raw_frame(int(FrameType.MSGS), batch[HEADER_SIZE:], version=2)
    with pytest.raises(FrameError) as typed:
        decode(restamped)
    assert typed.value.what == "type"  # type: ignore[attr-defined]
    with pytest.raises(ProgrammingError):
        encode(MsgBatch(tuple(PLAIN)), version=2)


def test_packed_messages_go_as_the_msgs_they_stand_for() -> None:
    packed = [pack_msg(m) for m in PLAIN]
    assert all(isinstance(p, PackedMsg) for p in packed)
    mixed = [packed[0], PLAIN[1], Ping(7), *packed[2:]]
    assert encode_many(mixed, version=3) == encode_many(
        [*PLAIN[:2], Ping(7), *PLAIN[2:]], version=3
    )
    assert unbatched(encode_many(mixed, version=3)) == [*PLAIN[:2], Ping(7), *PLAIN[2:]]


def test_a_packed_message_is_refused_where_it_cannot_go() -> None:
    with pytest.raises(ProgrammingError, match="not a frame type"):  # no MSGS before version 3
        encode_many([pack_msg(PLAIN[0])], version=2)
    big = Msg("s", 1, 1, 0, "big", "q", b"x" * 5000)
    with pytest.raises(ProgrammingError, match="exceeds the frame limit"):
        encode_many([pack_msg(big)], version=3, max_frame=4096)


def test_the_transfer_packs_a_logs_message_as_its_msg_would_be() -> None:
    message = Message("m-1", "orders", b"body", {"id": "x", "k": "\u00e9"}, True, 1_700_000_000)
    frame = SeqFrame("orders", 4, 9, 7, "m-1")
    assert pack_wire(frame, message, limit=4096) == pack_msg(to_wire(frame, message))
    # one that packs past a MSGS frame's room goes as the MSG it stands for (a MSG can be smaller)
    assert pack_wire(frame, message, limit=10) == to_wire(frame, message)


def test_runs_are_cut_to_the_frame_limit() -> None:
    big = [Msg("s", 1, n, n - 1, f"m{n}", "q", b"z" * 3000) for n in range(1, 11)]
    data = encode_many(big, version=3, max_frame=8192)
    frames = frames_of(data)
    assert len(frames) == 5 and all(isinstance(f, MsgBatch) for f in frames)
    assert unbatched(data) == big
    with pytest.raises(ProgrammingError):  # one message over the limit: refused, as a MSG is
        encode_many([Msg("s", 1, 1, 0, "m", "q", b"z" * 9000)], version=3, max_frame=8192)


def _payload(*messages: bytes, count: int | None = None) -> bytes:
    return struct.pack(">I", len(messages) if count is None else count) + b"".join(messages)


GOOD = pack_msg(PLAIN[0])
assert GOOD is not None


def _with_fixed(**changes: int) -> bytes:
    names = ("flags", "epoch", "seq", "prev", "expires", "count", "ls", "li", "ld", "lb", "nh")
    values = dict(zip(names, _FIXED.unpack_from(GOOD), strict=True))
    values.update(changes)
    return _FIXED.pack(*values.values()) + GOOD[_FIXED.size :]


BAD = {
    "count 0": _payload(count=0),
    "count above the payload": _payload(GOOD, count=2),
    "cut inside the fixed part": _payload(GOOD[:20]),
    "cut inside the body": _payload(GOOD[:-30]),
    "trailing bytes": _payload(GOOD) + b"\x00",
    "unknown flag": _payload(_with_fixed(flags=9)),
    "expiry without its flag": _payload(_with_fixed(flags=1, expires=5)),
    "length past the end": _payload(_with_fixed(lb=10**6)),
    "header past the end": _payload(_with_fixed(nh=3)),
    "bad utf-8": _payload(GOOD.replace(b"orders", b"\xff\xfeders", 1)),
    "header name twice": _payload(
        pack_msg(Msg("s", 1, 1, 0, "m", "q", b"", {"a": "1"}))[:-7]  # type: ignore[index]
        + b"".join([struct.pack(">HI", 1, 1), b"a", b"1"]) * 2
    ),
}


def test_a_header_name_twice_is_built_as_meant() -> None:
    raw = BAD["header name twice"]
    assert _FIXED.unpack_from(raw, 4)[-1] == 1  # nh says one header; two follow


@pytest.mark.parametrize("payload", BAD.values(), ids=BAD.keys())
def test_every_malformed_msgs_is_a_bad_frame(payload: bytes) -> None:
    with pytest.raises(FrameError) as caught:
        decode(raw_frame(int(FrameType.MSGS), payload, version=3))
    assert caught.value.what == "payload"  # type: ignore[attr-defined]


def test_a_connection_sends_runs_as_msgs_and_hands_them_back_one_by_one() -> None:
    left, right = socket.socketpair()
    try:
        a = Connection(left, Peer("b", "transfer", 3))
        b = Connection(right, Peer("a", "transfer", 3))
        a.send_many([*PLAIN, Ping(1)])
        got = [b.recv(timeout=5) for _ in range(len(PLAIN) + 1)]
        assert got == [*PLAIN, Ping(1)]
        assert not b.readable()
        a.send_many(PLAIN[:2])
        assert b.recv(timeout=5) == PLAIN[0]
        assert b.readable()  # the second is held from the same frame, not in the socket
        assert b.recv(timeout=5) == PLAIN[1]
    finally:
        left.close()
        right.close()
