"""Structure-aware frames for fuzzing the servers: drawn from the frame schema, then sometimes
broken on purpose (a field of the wrong type, one missing, one unknown; raw payload bytes flipped,
inserted, cut; a header field changed) with the CRC always recomputed, so the server's checks past
the checksum are what gets exercised, not the checksum.

The randomness is a `Draw`: `RandomDraw` (a seeded `random.Random`, fast: the long run in
``bench/fuzz_servers.py``) or `HypothesisDraw` (Hypothesis ``data.draw``, so a failure in the
suite's fuzz test shrinks to a small case). Both go through the same generator, so the two runs
fuzz the same space.

Each role has a `Role` generator that knows what its connection carries (a log's ``transfer``
sends MSG, a ``producer`` and a ``consumer`` send XA verbs, an unauthenticated peer sends its one
AUTH) and keeps a little state (stream numbers, recent xids) so that well-formed frames reach deep:
accepted messages, prepared and committed branches, admin ops, not only the first refusal.
"""

from __future__ import annotations

import random
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from messaging.frames import (
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    FrameType,
    Msg,
    Value,
    encode_value,
)
from messaging.frames._batch import batch_payload, pack_msg

T = TypeVar("T")


class Draw(Protocol):
    def integer(self, low: int, high: int) -> int: ...
    def chance(self, p: float) -> bool: ...
    def choice(self, options: Sequence[T]) -> T: ...
    def raw(self, most: int) -> bytes: ...


class RandomDraw:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]

    def raw(self, most: int) -> bytes:
        return self.rng.randbytes(self.rng.randint(0, most))


class HypothesisDraw:
    """Draws through a Hypothesis ``st.data()`` object (imported lazily: the bench needs none)."""

    def __init__(self, data: Any) -> None:
        from hypothesis import strategies as st

        self.data, self.st = data, st

    def integer(self, low: int, high: int) -> int:
        return int(self.data.draw(self.st.integers(low, high)))

    def chance(self, p: float) -> bool:
        """A band around the middle of the range: Hypothesis favours the ends (about 2% of draws
        each), which would make every rare choice common. The ends, and what shrinking goes
        towards (0), give the likelier answer, so a failing case loses its rare damage first."""
        v = int(self.data.draw(self.st.integers(0, 9999)))
        return (v + 5000) % 10000 < p * 10000

    def choice(self, options: Sequence[T]) -> T:
        return options[self.integer(0, len(options) - 1)]

    def raw(self, most: int) -> bytes:
        return bytes(self.data.draw(self.st.binary(max_size=most)))


# -- values --------------------------------------------------------------------------------------

U64 = 2**64 - 1
INTS = (0, 1, 2, 3, 7, 255, 256, 2**31 - 1, 2**31, 2**32, 2**62, 2**63, U64, -1, -(2**63), -(2**64))
NAMES = ("q", "orders", "fz.a", "fz.b", "topic:fz", "topic:fz/sub", "fz.a.DLQ", "fz.b#np")
ODD_TEXT = ("", " ", "é", "\x00", "a" * 256, "q.DLQ", "topic:", "topic:x/y", "-x", "🙂", "a b")
RESERVED = {
    "twopc-priority": ("0", "5", "9", "x", "99", "", "-1"),
    "twopc-transactional": ("0", "1", "2", "", "yes"),
    "twopc-admin-queue": ("fz.admin", "x.DLQ", "topic:fz", "", "bad name"),
    "twopc-publisher": ("p1", "", "p" * 201),
    "twopc-list": ("fz.a,fz.b", "", "l" * 201),
}


def text(d: Draw, pool: Sequence[str] = NAMES) -> str:
    if d.chance(0.8):
        return d.choice(pool)
    if d.chance(0.5):
        return d.choice(ODD_TEXT)
    return d.raw(40).decode("utf-8", "replace")


def number(d: Draw, low: int = 0) -> int:
    return d.choice([i for i in INTS if i >= low]) if d.chance(0.3) else d.integer(low, 50)


def value(d: Draw, depth: int = 0) -> Value:
    """Any value of the encoding, nested a little (deep nesting has its own case)."""
    kind = d.integer(0, 9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return d.chance(0.5)
    if kind == 2:
        return number(d) if d.chance(0.7) else -number(d)
    if kind == 3:
        return d.choice((0.0, -0.0, 1.5, float("nan"), float("inf"), -1e308))
    if kind == 4:
        return d.raw(16)
    if kind in (5, 6):
        return text(d)
    if kind == 7:
        return [value(d, depth + 1) for _ in range(d.integer(0, 3))]
    return {text(d): value(d, depth + 1) for _ in range(d.integer(0, 3))}


def nested_payload(d: Draw) -> bytes:
    """``{"token": [[...[1]...]]}`` with 12-20 lists, around the nesting limit (encoded by hand:
    the encoder refuses what is too deep)."""
    return b"\x09\x01\x05token" + b"\x08\x01" * d.integer(12, 20) + b"\x03\x01"


def headers(d: Draw) -> dict[str, Value]:
    out: dict[str, Value] = {}
    for _ in range(d.integer(0, 3)):
        if d.chance(0.6):
            name = d.choice(tuple(RESERVED))
            out[name] = d.choice(RESERVED[name])
        else:
            out[text(d, ("h", "x-trace", "x"))] = text(d, ("v", "1")) if d.chance(0.9) else value(d)
    if d.chance(0.02):
        out.update({f"h{i}": "v" for i in range(d.integer(60, 70))})
    return out


BAD_XIDS: tuple[Value, ...] = (
    *([], [1, "g"], [-1, "g", "b"], [2**31, "g", "b"], [1, "", "b"], [1, "g", "b" * 65]),
    *([1, "g\x00", "b"], [True, "g", "b"], "g", None, [1, 2, 3]),
)


def xid(d: Draw, bquals: Sequence[str], gtrids: list[str]) -> Value:
    """Mostly a valid [format_id, gtrid, bqual] from a small pool (so verbs meet their branches);
    sometimes one `Xid` refuses."""
    if d.chance(0.9):
        if not gtrids or d.chance(0.3):
            gtrids.append(f"fz:{d.integer(0, 10**6):x}")
            del gtrids[:-8]
        return [0x74706330, d.choice(gtrids), d.choice(bquals)]
    return d.choice(BAD_XIDS)


def message_map(d: Draw) -> Value:
    """A producer's message (``{id, destination, body, headers, persistent, expires_at}``)."""
    msg: dict[str, Value] = {
        "id": f"m{d.integer(0, 10**9)}" if d.chance(0.9) else text(d),
        "destination": text(d),
        "body": d.raw(64),
        "headers": headers(d),
        "persistent": d.chance(0.8),
        "expires_at": None if d.chance(0.8) else number(d),
    }
    return mangle(d, msg, rate=0.05)


def mangle(d: Draw, fields: dict[str, Value], rate: float) -> dict[str, Value]:
    """Sometimes one field of the wrong type, one missing, or one unknown."""
    if fields and d.chance(rate):
        key = d.choice(sorted(fields))
        fields[key] = value(d)
    if fields and d.chance(rate):
        del fields[d.choice(sorted(fields))]
    if d.chance(rate):
        fields[text(d, ("extra", "one_phase", "zzz"))] = value(d)
    return fields


# -- frames --------------------------------------------------------------------------------------


def raw_frame(
    ftype: int, payload: bytes, *, version: int = PROTOCOL_VERSION, flags: int = 0
) -> bytes:
    """A frame with a correct length and CRC around any payload bytes."""
    head = bytearray(HEADER.pack(MAGIC, version, ftype, flags, len(payload), 0))
    crc = zlib.crc32(payload, zlib.crc32(bytes(head[:12])))
    struct.pack_into(">I", head, 12, crc)
    return bytes(head) + payload


def restamp(frame: bytes, version: int) -> bytes:
    """A frame built for the handshake's version as a connection of ``version`` sends it: the
    header's version byte and the CRC; a frame whose version was damaged on purpose is kept."""
    if len(frame) < HEADER.size or frame[4] != PROTOCOL_VERSION or version == PROTOCOL_VERSION:
        return frame
    head = bytearray(frame[: HEADER.size])
    head[4] = version
    payload = frame[HEADER.size :]
    struct.pack_into(">I", head, 12, zlib.crc32(payload, zlib.crc32(bytes(head[:12]))))
    return bytes(head) + payload


def mutate(d: Draw, ftype: int, payload: bytes) -> bytes:
    """Raw-byte damage behind a recomputed CRC, or a header field changed."""
    data = bytearray(payload)
    how = d.integer(0, 7)
    at = d.integer(0, max(0, len(data) - 1))
    if how == 0 and data:
        data[at] ^= 1 << d.integer(0, 7)
    elif how == 1 and data:
        data[at] = d.integer(0, 255)
    elif how == 2:
        data[at:at] = d.raw(4) or b"\x00"
    elif how == 3 and data:
        del data[at : at + d.integer(1, 4)]
    elif how == 4:
        del data[d.integer(0, len(data)) :]
    elif how == 5:
        data += d.raw(3) or b"\x00"
    elif how == 6:
        return raw_frame(d.choice((0, 7, 15, 20, 31, 38, 46, 48, 255, ftype)), bytes(data))
    else:  # a version no connection speaks (versions 1 to 3 exist)
        return raw_frame(ftype, bytes(data), version=d.choice((0, 4, 255)), flags=d.choice((0, 1)))
    return raw_frame(ftype, bytes(data))


def build(d: Draw, ftype: int, fields: dict[str, Value], *, mutation_rate: float) -> bytes:
    payload = encode_value(fields)
    if d.chance(mutation_rate):
        return mutate(d, ftype, payload)
    return raw_frame(ftype, payload)


def any_frame(d: Draw, state: State) -> tuple[int, dict[str, Value]]:
    """A frame of any type with schema-shaped fields: what a role does not expect."""
    ftype = d.choice([int(t) for t in FrameType])
    fields: dict[str, Value]
    if ftype == FrameType.HELLO:
        fields = {"nonce": d.raw(40), "server_id": text(d), "versions": [number(d)]}
    elif ftype == FrameType.AUTH:
        fields = {"client_id": text(d), "nonce": d.raw(40), "role": text(d),
                  "version": number(d), "proof": d.raw(40)}  # fmt: skip
    elif ftype in (FrameType.WELCOME,):
        fields = {"proof": d.raw(40)}
    elif ftype == FrameType.ERROR:
        fields = {"code": text(d, ("bad-frame", "x")), "message": text(d)}
    elif ftype in (FrameType.PING, FrameType.PONG):
        fields = {"token": number(d)}
    elif ftype in (FrameType.ACK, FrameType.NACK):
        fields = {"stream": text(d), "epoch": number(d), "seq": number(d)}
        if ftype == FrameType.NACK:
            fields["reason"] = "invalid-message"
    elif ftype == FrameType.MSG:
        fields = state.msg(d)
    elif ftype == FrameType.XA_REPLY:
        fields = {"request_id": number(d), "status": "ok", "result": {}}
    else:
        fields = {"request_id": number(d), "xid": xid(d, ("fz",), state.gtrids), "args": {}}
    return ftype, mangle(d, fields, rate=0.1)


@dataclass
class State:
    """What a role remembers between frames so that later frames meet earlier ones."""

    streams: dict[str, tuple[int, int]] = field(default_factory=dict)  # stream -> (epoch, last)
    epoch: int = 7  # of a stream not seen yet: a fresh state per session takes a higher one
    gtrids: list[str] = field(default_factory=list)
    request_id: int = 0

    def msg(self, d: Draw) -> dict[str, Value]:
        """A MSG whose numbers mostly continue its stream (so it is accepted), sometimes repeat,
        skip or start an epoch, with a message a log may or may not have written."""
        destination = text(d, ("fz.a", "fz.b", "fz.c", "topic:fz", "fz.a.DLQ", "topic:fz/s"))
        persistent = d.chance(0.8)
        stream = destination if persistent else destination + "#np"
        if d.chance(0.02):
            stream = text(d)
        epoch, last = self.streams.get(stream, (self.epoch, 0))
        if d.chance(0.03):
            epoch = number(d, 1)
        if d.chance(0.85):
            seq = last + 1
        else:  # a duplicate, a gap, or a number at a boundary
            seq = d.integer(1, last + 3) if d.chance(0.7) else number(d, 1)
        seq = min(seq, U64)
        prev = last if d.chance(0.85) else number(d)
        if d.chance(0.99):  # else maybe prev >= seq: an impossible frame, the connection closes
            prev = min(prev, seq - 1)
        if 0 < seq <= U64 and 0 <= prev < seq and 0 < epoch <= U64:
            self.streams[stream] = (epoch, max(seq, last))
        fields: dict[str, Value] = {
            "stream": stream, "epoch": epoch, "seq": seq, "prev": prev,
            "message_id": f"m{d.integer(0, 10**9)}", "destination": destination,
            "body": d.raw(64),
        }  # fmt: skip
        if d.chance(0.6):
            fields["headers"] = headers(d)
        if d.chance(0.1):
            fields["expires_at_ms"] = None if d.chance(0.3) else number(d)
        if not persistent or d.chance(0.05):
            fields["persistent"] = persistent if d.chance(0.95) else not persistent
        if d.chance(0.05):
            fields["redelivered"] = d.chance(0.5)
        if d.chance(0.05):
            fields["delivery_count"] = number(d)
        return mangle(d, fields, rate=0.005)

    def next_id(self) -> int:
        self.request_id += 1
        return self.request_id


# -- roles ---------------------------------------------------------------------------------------

Maker = Callable[[Draw, State], tuple[int, dict[str, Value]]]
ADMIN_OPS = (
    *("subscribe", "unsubscribe", "subscriptions", "attach", "detach", "dead_letters"),
    *("replay_dead_letters", "purge_dead_letters", "set_transactional", "is_transactional"),
)


def _xa(
    d: Draw, state: State, verb: FrameType, args: dict[str, Value]
) -> tuple[int, dict[str, Value]]:
    rm = d.choice(("fz", "fz", "fz2", "other"))
    args = {"rm": rm, **args}
    args = mangle(d, args, 0.05)
    if verb == FrameType.XA_START and not isinstance(args.get("timeout", 0), str | bytes):
        # a receive waits up to its timeout (30 s when None or absent) on an empty queue: the
        # protocol's behaviour, not a hang, and too slow to fuzz (two in one burst would pass
        # the session's limit)
        timeout = args.get("timeout")
        if timeout is None or (isinstance(timeout, int | float) and timeout > 0.05):
            args["timeout"] = 0
    fields: dict[str, Value] = {"request_id": state.next_id(), "args": args}
    if verb != FrameType.XA_RECOVER or d.chance(0.05):
        fields["xid"] = xid(d, (rm, "fz", f"{rm}.sub"), state.gtrids)
    return int(verb), mangle(d, fields, rate=0.005)


def consumer_frame(d: Draw, state: State) -> tuple[int, dict[str, Value]]:
    verb = d.choice((FrameType.XA_START, FrameType.XA_START, FrameType.XA_PREPARE,
                     FrameType.XA_COMMIT, FrameType.XA_ROLLBACK, FrameType.XA_RECOVER,
                     FrameType.XA_RECOVER, FrameType.XA_FORGET))  # fmt: skip
    received = d.integer(0, 3) if d.chance(0.9) else number(d)
    if verb == FrameType.XA_START:
        # never timeout None: a receive from an empty queue would wait its full 30 s
        args = {"op": "receive" if d.chance(0.95) else text(d), "destination": text(d),
                "max": d.integer(1, 5) if d.chance(0.9) else number(d),
                "timeout": d.choice((0, 0.0, 0.01, -1, float("nan"), "x"))}  # fmt: skip
    elif verb == FrameType.XA_PREPARE:
        args = {"received": received}
    elif verb == FrameType.XA_COMMIT:
        args = {"one_phase": d.chance(0.5), "received": received}
    elif verb == FrameType.XA_RECOVER and d.chance(0.7):
        args = {"op": d.choice(ADMIN_OPS), "topic": d.choice(("topic:fz", "fz", None)),
                "name": d.choice(("s1", "s2", "")), "durable": d.chance(0.5),
                "queue": text(d), "dlq": text(d), "transactional": d.chance(0.5),
                "ids": d.choice((None, [], ["m1"], "x"))}  # fmt: skip
    else:
        args = {}
    return _xa(d, state, verb, args)


def producer_frame(d: Draw, state: State) -> tuple[int, dict[str, Value]]:
    verb = d.choice((FrameType.XA_PREPARE, FrameType.XA_COMMIT, FrameType.XA_COMMIT,
                     FrameType.XA_ROLLBACK, FrameType.XA_RECOVER, FrameType.XA_FORGET,
                     FrameType.XA_START))  # fmt: skip
    messages = [message_map(d) for _ in range(d.integer(0, 3))]
    if verb == FrameType.XA_PREPARE:
        args: dict[str, Value] = {"messages": messages}
    elif verb == FrameType.XA_COMMIT:
        one_phase = d.chance(0.6)
        args = {"one_phase": one_phase, "messages": messages} if one_phase else {}
    elif verb == FrameType.XA_RECOVER and d.chance(0.1):
        args = {"op": "subscribe"}
    else:
        args = {}
    return _xa(d, state, verb, args)


def transfer_frame(d: Draw, state: State) -> tuple[int, dict[str, Value]]:
    return int(FrameType.MSG), state.msg(d)


@dataclass(frozen=True)
class Role:
    name: str  # the role authenticated as; "" for an unauthenticated peer
    make: Maker
    #: most frames are well-formed, so a burst mostly gets through to the store behind it
    mutation_rate: float = 0.01
    stray_rate: float = 0.003  # a frame of a type this role does not carry

    def frame(self, d: Draw, state: State) -> bytes:
        if d.chance(0.005):
            return raw_frame(d.choice((int(FrameType.PING), int(FrameType.MSG))),
                             nested_payload(d))  # fmt: skip
        if d.chance(0.05):
            return raw_frame(int(FrameType.PING), encode_value({"token": number(d)}))
        ftype, fields = any_frame(d, state) if d.chance(self.stray_rate) else self.make(d, state)
        if ftype == FrameType.MSG and d.chance(0.3):
            batch = msgs_payload([fields, *(state.msg(d) for _ in range(d.integer(0, 4)))])
            if batch is not None:  # version 3's MSGS (`restamp` gives it the connection's)
                if d.chance(self.mutation_rate):
                    return mutate(d, int(FrameType.MSGS), batch)
                return raw_frame(int(FrameType.MSGS), batch)
        return build(d, ftype, fields, mutation_rate=self.mutation_rate)


def msgs_payload(many: list[dict[str, Value]]) -> bytes | None:
    """The MSGS payload of these MSG fields, or None if one of them does not fit its layout."""
    packed = []
    for fields in many:
        try:
            one = pack_msg(Msg(**fields))  # type: ignore[arg-type]
        except TypeError:
            return None
        if one is None:
            return None
        packed.append(one)
    return batch_payload(packed)


ROLES = {
    "transfer": Role("transfer", transfer_frame),
    "consumer": Role("consumer", consumer_frame),
    "producer": Role("producer", producer_frame),
}
