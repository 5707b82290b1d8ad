"""docs/protocol.md's worked handshake example is what the handshake code computes.

Invariant named here: ``worked_example`` (every value the example shows, the frames as sent, both
transcripts, both proofs, the secret, appears verbatim in the document, recomputed here by the
handshake's own functions with the example's secret, ids and nonces). A change to the transcript,
the encoding or the frames fails this test until the document is updated with it.
"""

from __future__ import annotations

import hmac
import re
import zlib
from hashlib import sha256
from pathlib import Path

import pytest

from coordinator.xid import Xid
from messaging import auth
from messaging.auth import SharedSecret, answer_hello, check_auth, check_welcome, new_hello
from messaging.frames import Hello, decode_value, encode, encode_value

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
SECRET = b"example secret: 32 bytes long!!!"
SERVER_NONCE = bytes(range(0x00, 0x20))
CLIENT_NONCE = bytes(range(0x20, 0x40))
MAX = "2^64\u22121"  # as the document writes 2**64 - 1


def example() -> tuple[str, str]:
    """The worked example's prose, and its hex with every line break and space removed (the
    document wraps long hex over several lines)."""
    text = DOC.read_text()
    start = text.index("### 5.1 Worked example")
    section = text[start : text.index("\n## ", start)]
    blocks = re.findall(r"```\n(.*?)```", section, re.S)
    return section, re.sub(r"\s", "", "".join(blocks)) + "|" + section


def test_the_documents_worked_handshake_is_what_the_code_computes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nonces = iter([SERVER_NONCE, CLIENT_NONCE])
    monkeypatch.setattr(auth.secrets, "token_bytes", lambda n: next(nonces))
    secret = SharedSecret(SECRET)
    # as a server of versions 1 to 3 makes it (the example predates version 4): its nonce
    hello = new_hello("cursor-1", versions=(1, 2, 3))
    hello_on_wire = encode(hello)
    received, signed = answer_hello(secret, hello, "log-1", "transfer", "cursor-1")
    _, welcome = check_auth(secret, received, signed, roles={"transfer", "consumer"})
    peer = check_welcome(secret, received, signed, welcome)
    assert (peer.id, peer.role, peer.version) == ("cursor-1", "transfer", 3)
    assert hello.versions == (1, 2, 3) and b"versions" in hello_on_wire  # not the default: sent

    client = auth._transcript("client", received, signed)
    server = auth._transcript("server", received, signed)
    assert hmac.new(SECRET, client, sha256).digest() == signed.proof
    assert hmac.new(SECRET, server, sha256).digest() == welcome.proof

    prose, hexes = example()
    assert f"`{SECRET.decode()}`" in prose and SECRET.hex() in hexes
    assert f'transcript("client"), {len(client)} bytes' in prose
    for name, value in {
        "HELLO frame": hello_on_wire,
        "AUTH frame": encode(signed),
        "WELCOME frame": encode(welcome),
        "client transcript": client,
        "client proof": signed.proof,
        "server proof": welcome.proof,
        "server transcript": server,
    }.items():
        assert value.hex() in hexes, f"{name} {value.hex()} is not in docs/protocol.md"


def test_a_hello_that_lists_versions_changes_the_transcript_only_through_them() -> None:
    """The transcript uses HELLO's versions after the default is applied: leaving ``versions``
    out and sending ``[1]`` are the same handshake (docs/protocol.md, section 5)."""
    implicit = Hello(SERVER_NONCE, "cursor-1")
    explicit = Hello(SERVER_NONCE, "cursor-1", (1,))
    _, signed = answer_hello(SharedSecret(SECRET), implicit, "log-1", "transfer", None)
    assert auth._transcript("client", implicit, signed) == auth._transcript(
        "client", explicit, signed
    )


def test_the_documents_encoding_examples_are_what_the_codec_writes() -> None:
    """Section 3's varints and map, section 4.3's gid, section 2's CRC check value."""

    text = DOC.read_text()
    for n, shown in (
        (0, "00"),
        (127, "7f"),
        (128, "80 01"),
        (300, "ac 02"),
        (2**64 - 1, "ff " * 9 + "01"),
    ):
        assert (
            encode_value(n)[1:].hex(" ") == shown
            and f"`{n if n < 2**64 - 1 else MAX}` → `{shown}`" in text
        )
    value = {"a": [1, -2, 1.5, b"\x00", "é", None, True]}
    block = text[text.index("encodes as\n\n```\n") :].split("```")[1]
    shown = "".join(
        line.strip().split("  ")[0].replace(" ", "") for line in block.strip().splitlines()
    )
    assert shown == encode_value(value).hex() and decode_value(bytes.fromhex(shown)) == value
    assert '`[1953522480, "node-1:abc-1", "mlog"]` → `1953522480_bm9kZS0xOmFiYy0x_bWxvZw==`' in text
    assert (
        Xid(1953522480, "node-1:abc-1", "mlog").to_gid() == "1953522480_bm9kZS0xOmFiYy0x_bWxvZw=="
    )
    assert f"`0x{zlib.crc32(b'123456789'):08X}`" in text
