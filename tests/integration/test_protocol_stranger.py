"""A client written from docs/protocol.md alone talks to real servers.

Nothing here imports the project's codec or handshake: the encoding, the framing, the CRC and the
HMAC transcript below are written from the specification (sections 2, 3 and 5), with `struct`,
`zlib`, `hmac` and `hashlib`, as a client in another language would be. It then does what the
project's own clients do: authenticates as ``producer`` at a log server and sends a message in a
one-phase commit, authenticates as ``consumer`` at the cursor server the log feeds and receives it
in a branch it commits, and sees the documented answers to a request of the wrong shape and to a
frame of the wrong kind.

Invariant named here: ``spec_suffices`` (a client built from the document interoperates).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from messaging.auth import SharedSecret
from messaging.server import CursorServer, LogServer

KEY = b"stranger's shared secret, 36 bytes!"
TYPES = {
    **{"HELLO": 1, "AUTH": 2, "WELCOME": 3, "ERROR": 4, "PING": 5, "PONG": 6},
    **{"MSG": 16, "ACK": 17, "NACK": 18, "ORIGIN": 19, "MSGS": 20},
    **{"XA_START": 32, "XA_PREPARE": 33, "XA_COMMIT": 34, "XA_RECOVER": 36, "XA_REPLY": 47},
}
NAMES = {number: name for name, number in TYPES.items()}


# -- section 3: the value encoding -----------------------------------------------------------------


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def enc(v: Any) -> bytes:
    if v is None:
        return b"\x00"
    if v is True or v is False:
        return b"\x02" if v else b"\x01"
    if isinstance(v, int):
        return b"\x03" + varint(v) if v >= 0 else b"\x04" + varint(-1 - v)
    if isinstance(v, float):
        return b"\x05" + struct.pack(">d", v)
    if isinstance(v, bytes):
        return b"\x06" + varint(len(v)) + v
    if isinstance(v, str):
        raw = v.encode("utf-8")
        return b"\x07" + varint(len(raw)) + raw
    if isinstance(v, list):
        return b"\x08" + varint(len(v)) + b"".join(enc(x) for x in v)
    keys = sorted(v, key=lambda k: k.encode("utf-8"))  # ascending by UTF-8 bytes
    body = b"".join(varint(len(k.encode())) + k.encode() + enc(v[k]) for k in keys)
    return b"\x09" + varint(len(v)) + body


def dec(data: bytes, pos: int = 0) -> tuple[Any, int]:
    def number(pos: int) -> tuple[int, int]:
        n = shift = 0
        while True:
            byte = data[pos]
            n, shift, pos = n | (byte & 0x7F) << shift, shift + 7, pos + 1
            if byte < 0x80:
                return n, pos

    tag, pos = data[pos], pos + 1
    if tag <= 2:
        return (None, False, True)[tag], pos
    if tag in (3, 4):
        n, pos = number(pos)
        return (n if tag == 3 else -1 - n), pos
    if tag == 5:
        return struct.unpack_from(">d", data, pos)[0], pos + 8
    if tag in (6, 7):
        n, pos = number(pos)
        raw = data[pos : pos + n]
        return (raw if tag == 6 else raw.decode("utf-8")), pos + n
    count, pos = number(pos)
    if tag == 8:
        items = []
        for _ in range(count):
            item, pos = dec(data, pos)
            items.append(item)
        return items, pos
    out = {}
    for _ in range(count):
        n, pos = number(pos)
        key, pos = data[pos : pos + n].decode("utf-8"), pos + n
        out[key], pos = dec(data, pos)
    return out, pos


# -- section 2: frames -----------------------------------------------------------------------------


class Wire:
    """``version``: the highest version this client speaks (section 1); the handshake's frames
    carry 1, every frame after WELCOME the version AUTH chose (section 2)."""

    def __init__(self, address: tuple[str, int], version: int = 1) -> None:
        self.sock = socket.create_connection(address, timeout=10)
        self.speaks = version
        self.version = 1  # in the handshake

    def send(self, name: str, fields: dict[str, Any], payload: bytes | None = None) -> None:
        payload = enc(fields) if payload is None else payload
        head = b"TPCM" + bytes([self.version, TYPES[name]]) + b"\x00\x00"
        head += struct.pack(">I", len(payload))
        crc = zlib.crc32(head + payload)
        self.sock.sendall(head + struct.pack(">I", crc) + payload)

    def exactly(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise EOFError(f"closed after {len(out)} of {n} bytes")
            out += chunk
        return out

    def recv(self) -> tuple[str, dict[str, Any]]:
        head = self.exactly(16)
        magic, version, ftype, flags, length, crc = struct.unpack(">4sBBHII", head)
        assert (magic, version, flags) == (b"TPCM", self.version, 0)
        payload = self.exactly(length)
        assert zlib.crc32(head[:12] + payload) == crc
        fields, end = dec(payload)
        assert end == len(payload)
        return NAMES[ftype], fields

    def handshake(self, role: str) -> tuple[str, dict[str, Any]]:
        """Section 5, with the defaults of section 4.2 applied before the transcript; the
        server's answer to AUTH (a WELCOME whose proof was checked, or an ERROR)."""
        name, hello = self.recv()
        assert name == "HELLO" and len(hello["nonce"]) == 32
        versions = hello.get("versions", [1])
        chosen = max(v for v in versions if v <= self.speaks)
        auth = {"client_id": "stranger", "nonce": os.urandom(32), "role": role, "version": chosen}
        transcript = {"side": "twopc-auth-client", "server_nonce": hello["nonce"],
                      "server_id": hello["server_id"], "versions": versions,
                      "client_nonce": auth["nonce"], "client_id": "stranger", "role": role,
                      "version": chosen}  # fmt: skip
        proof = hmac.new(KEY, enc(transcript), hashlib.sha256).digest()
        self.send("AUTH", {**auth, "proof": proof})
        name, welcome = self.recv()
        if name == "WELCOME":
            transcript["side"] = "twopc-auth-server"
            expected = hmac.new(KEY, enc(transcript), hashlib.sha256).digest()
            assert hmac.compare_digest(welcome["proof"], expected)
            self.version = chosen
        return name, welcome

    def ask(self, verb: str, request_id: int, xid: list[Any] | None, args: dict[str, Any]) -> Any:
        fields: dict[str, Any] = {"request_id": request_id, "args": args}
        if xid is not None:
            fields["xid"] = xid
        self.send(verb, fields)
        name, reply = self.recv()
        assert name == "XA_REPLY" and reply["request_id"] == request_id
        return reply.get("status", "ok"), reply.get("result", {})


# -- against the servers ---------------------------------------------------------------------------


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[LogServer, CursorServer]]:
    secret = SharedSecret(KEY)
    with (
        CursorServer(tmp_path / "c", secret, listen=("127.0.0.1", 0), dispatch_workers=0) as cursor,
        LogServer(tmp_path / "l", secret, cursor=cursor.address, listen=("127.0.0.1", 0)) as log,
    ):
        yield log, cursor


def test_a_client_written_from_the_document_sends_and_receives(
    servers: tuple[LogServer, CursorServer],
) -> None:
    log, cursor = servers
    assert log.address is not None
    producer = Wire(log.address)
    assert producer.handshake("producer")[0] == "WELCOME"
    xid = [0x74706330, "stranger:1", "mlog"]
    message = {"id": "stranger-1", "destination": "orders", "body": b"hello",
               "headers": {"twopc-priority": "7"}, "persistent": True,
               "expires_at": None}  # fmt: skip
    wrong = {"rm": "mlog", "onephase": True, "messages": [message]}
    assert producer.ask("XA_COMMIT", 1, xid, wrong)[0] == "bad-request"
    status, result = producer.ask(
        "XA_COMMIT", 2, xid, {"rm": "mlog", "one_phase": True, "messages": [message]}
    )
    assert (status, result) == ("ok", {"outcome": None})
    producer.send("PING", {"token": -7})
    assert producer.recv() == ("PONG", {"token": -7})

    consumer = Wire(cursor.address)
    assert consumer.handshake("consumer")[0] == "WELCOME"
    branch = [0x74706330, "stranger:2", "cursor"]
    receive = {"rm": "cursor", "op": "receive", "destination": "orders", "max": 5, "timeout": 0.5}
    deadline = time.monotonic() + 20
    got: list[Any] = []
    while not got and time.monotonic() < deadline:
        status, result = consumer.ask("XA_START", 3, branch, receive)
        assert status == "ok"
        got = result["deliveries"]
    assert len(got) == 1
    delivery = got[0]
    assert delivery["message"] == message and delivery["count"] == 1
    assert delivery["queue"] == "orders" and delivery["reason"] is None
    commit = {"rm": "cursor", "one_phase": True, "received": 1}
    assert consumer.ask("XA_COMMIT", 4, branch, commit) == ("ok", {"outcome": None})
    assert consumer.ask("XA_RECOVER", 5, None, {"rm": "cursor"}) == ("ok", {"xids": []})
    consumer.send("XA_REPLY", {"request_id": 6})  # not a frame a consumer sends
    name, error = consumer.recv()
    assert name == "ERROR" and error["code"] == "bad-frame"


def test_handshake_refusals_get_their_documented_codes(
    servers: tuple[LogServer, CursorServer],
) -> None:
    _, cursor = servers
    name, error = Wire(cursor.address).handshake("producer")  # a right proof, a role not served
    assert (name, error["code"]) == ("ERROR", "forbidden-role")
    stranger = Wire(cursor.address)
    stranger.recv()
    stranger.send("AUTH", {"client_id": "stranger", "nonce": bytes(32), "role": "consumer",
                           "version": 1, "proof": bytes(32)})  # fmt: skip
    assert stranger.recv() == ("ERROR", {"code": "auth-failed", "message": "authentication failed"})
    refused = Wire(cursor.address)
    refused.recv()
    refused.send("AUTH", {"client_id": "stranger", "nonce": bytes(32), "role": "consumer",
                          "version": 5, "proof": bytes(32)})  # fmt: skip
    name, error = refused.recv()
    assert (name, error["code"]) == ("ERROR", "unsupported-version")


def test_a_stranger_log_speaks_version_2_to_the_cursor(
    servers: tuple[LogServer, CursorServer],
) -> None:
    """Sections 1, 2 and 7 in version 2: HELLO lists [1, 2, 3, 4]; the transfer begins with ORIGIN;
    each log's stream is its own at the cursor, and an older incarnation is fenced."""
    _, cursor = servers
    for log_id, body in (("stranger-a", b"from a"), ("stranger-b", b"from b")):
        wire = Wire(cursor.address, version=2)
        assert wire.handshake("transfer")[0] == "WELCOME" and wire.version == 2
        wire.send("ORIGIN", {"log": log_id, "incarnation": 5})
        msg = {"stream": "strange", "epoch": 3, "seq": 1, "prev": 0, "message_id": log_id,
               "destination": "strange", "body": body}  # fmt: skip
        wire.send("MSG", msg)  # the same stream, epoch and number from both logs: both taken
        assert wire.recv() == ("ACK", {"stream": "strange", "epoch": 3, "seq": 1})
    assert [d.body for d in cursor.cursor.available("strange")] == [b"from a", b"from b"]
    older = Wire(cursor.address, version=2)
    older.handshake("transfer")
    older.send("ORIGIN", {"log": "stranger-a", "incarnation": 4})
    name, error = older.recv()
    assert (name, error["code"]) == ("ERROR", "log-fenced")


def msgs_payload(messages: list[dict[str, Any]]) -> bytes:
    """Section 7.1's layout, built from the page alone."""
    out = struct.pack(">I", len(messages))
    for m in messages:
        texts = [m["stream"].encode(), m["message_id"].encode(), m["destination"].encode()]
        headers = [(k.encode(), v.encode()) for k, v in m.get("headers", {}).items()]
        out += struct.pack(">BQQQQIHHHIH", 1, m["epoch"], m["seq"], m["prev"], 0, 0,
                           *map(len, texts), len(m["body"]), len(headers))  # fmt: skip
        out += b"".join(texts) + m["body"]
        for k, v in headers:
            out += struct.pack(">HI", len(k), len(v)) + k + v
    return out


def test_a_stranger_log_sends_a_run_of_messages_as_one_msgs_in_version_3(
    servers: tuple[LogServer, CursorServer],
) -> None:
    """Section 7.1: MSGS carries MSGs in a fixed layout; the cursor judges each as a MSG and
    acknowledges the run with one ACK per stream."""
    _, cursor = servers
    wire = Wire(cursor.address, version=3)
    assert wire.handshake("transfer")[0] == "WELCOME" and wire.version == 3
    wire.send("ORIGIN", {"log": "stranger-c", "incarnation": 1})
    run = [{"stream": "batched", "epoch": 4, "seq": n, "prev": n - 1, "message_id": f"c-{n}",
            "destination": "batched", "body": b"run %d" % n, "headers": {"n": str(n)}}
           for n in (1, 2, 3)]  # fmt: skip
    wire.send("MSGS", {}, msgs_payload(run))
    assert wire.recv() == ("ACK", {"stream": "batched", "epoch": 4, "seq": 3})
    got = cursor.cursor.available("batched")
    assert [(d.body, d.headers["n"]) for d in got] == [(b"run %d" % n, str(n)) for n in (1, 2, 3)]


def packed_messages(messages: list[dict[str, Any]]) -> bytes:
    """Section 8.5's layout, built from the page alone."""
    out = struct.pack(">I", len(messages))
    for m in messages:
        mid, dest = m["id"].encode(), m["destination"].encode()
        headers = [(k.encode(), v.encode()) for k, v in m["headers"].items()]
        flags = (1 if m["persistent"] else 0) | (4 if m["expires_at"] is not None else 0)
        out += struct.pack(">BQHHIH", flags, m["expires_at"] or 0, len(mid), len(dest),
                           len(m["body"]), len(headers))  # fmt: skip
        out += mid + dest + m["body"]
        for k, v in headers:
            out += struct.pack(">HI", len(k), len(v)) + k + v
    return out


def test_a_stranger_producer_sends_packed_messages_in_version_4(
    servers: tuple[LogServer, CursorServer],
) -> None:
    """Section 8.5: from version 4 a producer's ``messages`` may be one bytes value in a fixed
    layout; the log takes them as the list of maps; on a version-3 connection, or broken, the
    request is a bad request and nothing is staged."""
    log, cursor = servers
    assert log.address is not None
    run = [{"id": f"packed-{n}", "destination": "packed", "body": b"p%d" % n,
            "headers": {"n": str(n)}, "persistent": n != 2,
            "expires_at": None if n != 3 else 4_000_000_000_000} for n in (1, 2, 3)]  # fmt: skip
    older = Wire(log.address, version=3)
    assert older.handshake("producer")[0] == "WELCOME" and older.version == 3
    xid = [0x74706330, "stranger:p", "mlog"]
    args = {"rm": "mlog", "messages": packed_messages(run)}
    assert older.ask("XA_PREPARE", 1, xid, args)[0] == "bad-request"
    producer = Wire(log.address, version=4)
    assert producer.handshake("producer")[0] == "WELCOME" and producer.version == 4
    broken = {"rm": "mlog", "messages": packed_messages(run)[:-1]}
    assert producer.ask("XA_PREPARE", 2, xid, broken)[0] == "bad-request"
    assert producer.ask("XA_RECOVER", 3, None, {"rm": "mlog"}) == ("ok", {"xids": []})
    assert producer.ask("XA_PREPARE", 4, xid, args) == ("ok", {"vote": "commit"})
    commit = {"rm": "mlog", "one_phase": False}
    assert producer.ask("XA_COMMIT", 5, xid, commit) == ("ok", {"outcome": None})
    deadline = time.monotonic() + 20
    while len(got := cursor.cursor.available("packed")) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = sorted((d.message_id, d.body, d.headers["n"], d.message.persistent,
                   d.message.expires_at) for d in got)  # fmt: skip
    assert seen == [(m["id"], m["body"], m["headers"]["n"], m["persistent"], m["expires_at"])
                    for m in run]  # fmt: skip
