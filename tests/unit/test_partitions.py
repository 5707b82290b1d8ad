"""Partitioned destinations (issue 15, point 3): a route naming several cursors splits each of its
destinations by message key.

Invariants named here: ``stable_partition`` (the partition of a key is BLAKE2b of its UTF-8
bytes modulo the count, the same in every process; no key: partition 0),
``gapless_partition_streams`` (the log numbers each partition as a stream of its own, 1, 2, 3 ...
in commit order, so each cursor sees a gapless stream), ``partition_count_checked`` (a log does
not open with a count other than the one its unacknowledged messages were numbered under,
unless told to), and ``message_on_its_partition`` (a cursor refuses a message that arrives on a
partition its key does not hash to).
"""

from __future__ import annotations

import dataclasses
import hashlib
import zlib
from pathlib import Path

import pytest

from coordinator.errors import ConfigurationError
from messaging.frames import Msg
from messaging.routes import Route, Router, parse_route
from messaging.transfer.wire import from_wire
from resource_managers.message_log import (
    KEY_HEADER,
    DestinationFullError,
    InvalidMessageError,
    Message,
    MessageLog,
    SendOptions,
    StreamName,
    on_its_stream,
    outgoing,
    parse_stream,
    partition_of,
    stream_for,
)

A, B, C, DEFAULT = ("10.0.0.1", 1), ("10.0.0.2", 2), ("10.0.0.3", 3), ("127.0.0.1", 7402)


def keyed(destination: str, key: str | None, *, persistent: bool = True) -> Message:
    return outgoing(
        [destination], body=b"x", headers=None, now_ms=0, max_bytes=1 << 20,
        options=SendOptions(persistent=persistent, key=key),
    )[0]  # fmt: skip


def test_stable_partition_is_blake2b_of_the_utf8_key() -> None:
    """``stable_partition``: pinned values, so a change of hash breaks this test, not a
    deployment (another language computes the same with any BLAKE2b)."""
    digest = hashlib.blake2b(b"a", digest_size=8).digest()
    assert int.from_bytes(digest, "big") == 4681665781835383343
    assert partition_of("a", 2) == 4681665781835383343 % 2 == 1
    assert partition_of("a", 7) == 4681665781835383343 % 7
    assert partition_of("bob", 2) == 0
    assert partition_of(None, 5) == 0  # keyless: partition 0
    assert partition_of("anything", 1) == 0


def test_keys_differing_in_low_bits_spread() -> None:
    """Why not CRC-32: it is linear, and ``k0``..``k3`` all have an odd CRC-32."""
    assert {zlib.crc32(f"k{i}".encode()) % 2 for i in range(4)} == {1}
    assert {partition_of(f"k{i}", 2) for i in range(4)} == {0, 1}
    spread = [partition_of(f"customer-{i}", 4) for i in range(1000)]
    assert all(200 < spread.count(p) < 300 for p in range(4)), spread


def test_stream_names_carry_partition_and_count() -> None:
    message = keyed("orders.created", "a")
    assert stream_for(message, 1) == "orders.created"  # unpartitioned: the bare name, as before
    assert stream_for(message, 2) == "orders.created#p1.2"
    assert stream_for(keyed("orders.created", "a", persistent=False), 2) == "orders.created#p1.2#np"
    assert stream_for(keyed("orders.created", None), 3) == "orders.created#p0.3"
    assert parse_stream("orders.created#p1.2#np") == StreamName("orders.created", False, 1, 2)
    assert parse_stream("orders.created") == StreamName("orders.created", True)
    assert parse_stream("orders.created#np") == StreamName("orders.created", False)


@pytest.mark.parametrize(
    "name", ["x#p2.2", "x#p1.1", "x#p01.2", "x#p1.", "x#p.2", "#p0.2", "x#q", "x#p1.2#p0.2",
             "x#p1.65", "x#p-1.2", "x#p\u0661.2"],
)  # fmt: skip
def test_a_name_no_partition_has_is_not_parsed(name: str) -> None:
    assert parse_stream(name) is None


def test_message_on_its_partition_only() -> None:
    message = keyed("orders", "a")  # partition 1 of 2
    assert on_its_stream(message, "orders#p1.2")
    assert not on_its_stream(message, "orders#p0.2")
    assert on_its_stream(message, "orders")  # unpartitioned: a key means nothing
    assert on_its_stream(keyed("orders", None), "orders")
    assert not on_its_stream(message, "invoices#p1.2")
    assert not on_its_stream(message, "orders#p1.2#np")


def test_the_cursor_refuses_a_message_on_another_partition() -> None:
    """``message_on_its_partition``: the transfer's one check (`from_wire`)."""
    message = keyed("orders", "a")
    frame = Msg(stream="orders#p0.2", epoch=1, seq=1, prev=0, message_id=message.message_id,
                destination="orders", body=b"x", headers=dict(message.headers),
                expires_at_ms=None, persistent=True)  # fmt: skip
    with pytest.raises(InvalidMessageError, match="arrived on stream"):
        from_wire(frame, "log1")
    ok = dataclasses.replace(frame, stream="orders#p1.2")
    got, taken = from_wire(ok, "log1")
    assert got.stream == "log1|orders#p1.2" and taken.destination == "orders"
    assert taken.key == "a"


@pytest.mark.parametrize("key", ["", "k" * 201])
def test_a_bad_key_is_refused_at_send(key: str) -> None:
    with pytest.raises(InvalidMessageError, match=KEY_HEADER):
        keyed("orders", key)


def test_a_key_that_is_not_text_is_refused_at_send() -> None:
    with pytest.raises(InvalidMessageError, match="key must be a str"):
        keyed("orders", 7)  # type: ignore[arg-type]


def test_a_route_with_several_cursors_partitions() -> None:
    assert parse_route("orders.*=10.0.0.1:1, 10.0.0.2:2") == Route("orders.*", A, B)
    router = Router(DEFAULT, [Route("orders.*", A, B, C), Route("bills", B)])
    assert router.partitions("orders.x") == 3 and router.partitions("bills") == 1
    assert router.partitions("other") == 1
    assert router.cursor_for("orders.x#p0.3") == A
    assert router.cursor_for("orders.x#p2.3#np") == C
    assert router.cursor_for("orders.x#p3.4") == A  # numbered under another count: wraps
    assert router.cursor_for("orders.x") == A  # numbered unpartitioned: partition 0's cursor
    assert router.cursors() == [DEFAULT, A, B, C]


def test_gapless_partition_streams(tmp_path: Path) -> None:
    """Each partition is numbered 1, 2, 3 ... in commit order, keyless messages in partition 0;
    the numbers survive a reopen."""
    with MessageLog(tmp_path / "log", partitions=lambda d: 2 if d == "orders" else 1) as mlog:
        for n, key in enumerate(["a", "bob", "a", None, "a", "bob"]):
            mlog.commit(f"g{n}", [keyed("orders", key)])
        mlog.commit("other", [keyed("invoices", "a")])
        assert sorted(mlog.streams()) == ["invoices", "orders#p0.2", "orders#p1.2"]
        got = {s: [(n, m.key) for n, m in mlog.pending(s)] for s in mlog.streams()}
    assert got["orders#p1.2"] == [(1, "a"), (2, "a"), (3, "a")]
    assert got["orders#p0.2"] == [(1, "bob"), (2, None), (3, "bob")]
    assert got["invoices"] == [(1, "a")]
    with MessageLog(tmp_path / "log", partitions=lambda d: 2 if d == "orders" else 1) as mlog:
        assert [n for n, _ in mlog.pending("orders#p1.2")] == [1, 2, 3]


def test_partition_count_checked_at_open(tmp_path: Path) -> None:
    """``partition_count_checked``: unacknowledged messages numbered under 2 partitions refuse
    an open with 3 (or 1) with one clear line; ``allow_repartition`` opens; once acknowledged,
    any count opens."""
    with MessageLog(tmp_path / "log", partitions=lambda _d: 2) as mlog:
        mlog.commit("g1", [keyed("orders", "a")])
        epoch = mlog.epoch("orders#p1.2")
    for count in (3, 1):
        with pytest.raises(ConfigurationError) as caught:
            MessageLog(tmp_path / "log", partitions=lambda _d, c=count: c)  # type: ignore[misc]
        text = str(caught.value)
        assert "'orders': 1 unacknowledged messages numbered in 2 partition(s)" in text
        assert "--allow-repartition" in text and "\n" not in text
    with MessageLog(tmp_path / "log", partitions=lambda _d: 3, allow_repartition=True) as mlog:
        assert [n for n, _ in mlog.pending("orders#p1.2")] == [1]  # kept, drains where routed
    with MessageLog(tmp_path / "log", partitions=lambda _d: 2) as mlog:
        mlog.acknowledge("orders#p1.2", epoch, 1)
    with MessageLog(tmp_path / "log", partitions=lambda _d: 3) as mlog:
        mlog.commit("g2", [keyed("orders", "a")])
        assert partition_of("a", 3) == 2 and [n for n, _ in mlog.pending("orders#p2.3")] == [1]


def test_a_destination_limit_counts_every_partition(tmp_path: Path) -> None:
    with MessageLog(tmp_path / "log", partitions=lambda _d: 2, max_destination_messages=2) as mlog:
        mlog.commit("g1", [keyed("orders", "a")])
        mlog.commit("g2", [keyed("orders", "bob")])
        with pytest.raises(DestinationFullError):
            mlog.check_room("orders", 1)
        mlog.check_room("invoices", 1)


def test_prepared_and_non_persistent_messages_do_not_block_a_new_count(tmp_path: Path) -> None:
    """``partition_count_checked`` counts only what is numbered and durable: a prepared branch
    is numbered at its commit, under the count of that moment; a non-persistent message does
    not survive the restart."""
    with MessageLog(tmp_path / "log", partitions=lambda _d: 2) as mlog:
        mlog.prepare("g1", [keyed("orders", "a")])
        mlog.commit("g2", [keyed("orders", "a", persistent=False)])
    with MessageLog(tmp_path / "log", partitions=lambda _d: 3) as mlog:
        mlog.commit("g1")
        assert [n for n, _ in mlog.pending("orders#p2.3")] == [1]


def test_a_route_names_one_to_64_distinct_cursors() -> None:
    with pytest.raises(ConfigurationError, match="name 1-64 cursors, not 0"):
        Route("orders.*")
    many = ",".join(f"10.0.0.1:{port}" for port in range(1, 66))
    with pytest.raises(ConfigurationError, match="not 65"):
        parse_route(f"orders.*={many}")
    with pytest.raises(ConfigurationError, match="names a cursor twice"):
        Route("orders.*", A, B, A)
    assert len(parse_route(f"orders.*={many.rsplit(',', 1)[0]}").cursors) == 64
