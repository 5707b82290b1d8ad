"""A stream keeps its messages in number order whatever order commits apply in, and pays for
that once per commit, not once per message: concurrent commits each take a block of numbers and
then write, so a later block often lands first."""

from __future__ import annotations

import random

from resource_managers.message_log import Message
from resource_managers.message_log._state import LogState, Stream


def test_blocks_applied_out_of_order_end_in_number_order() -> None:
    state = LogState()
    n = 20_000  # one sort per message made this take minutes
    first = [Message(f"a{i}", "orders", b"a", {}) for i in range(n)]
    second = [Message(f"b{i}", "orders", b"b", {}) for i in range(n)]
    state.prepared = {"g-1": first, "g-2": second}
    state.apply({"k": "C", "g": "g-2", "s": [["orders", n + 1 + i] for i in range(n)]})
    state.apply({"k": "C", "g": "g-1", "s": [["orders", 1 + i] for i in range(n)]})
    stream = state.streams["orders"]
    assert list(stream.messages) == list(range(1, 2 * n + 1))
    assert [m.message_id for m in stream.messages.values()][n - 1 : n + 1] == [f"a{n - 1}", "b0"]
    assert stream.next_seq == 2 * n + 1


def test_acknowledged_and_repeated_numbers_are_not_added_again() -> None:
    state = LogState()
    stream = state.stream("orders")
    message = Message("m", "orders", b"x", {})
    stream.add_many([(1, message), (2, message), (3, message)])
    stream.ack(2)
    stream.add_many([(2, message), (3, Message("other", "orders", b"y", {})), (5, message)])
    assert list(stream.messages) == [3, 5] and stream.messages[3].message_id == "m"
    assert stream.next_seq == 6


def test_any_order_of_blocks_matches_one_sorted_stream() -> None:
    """Blocks of numbers applied in random orders, some repeated, some overlapping, some below
    the acknowledged number: the stream always holds what one sorted dict of the first message
    given for each unacknowledged number would, in that order (the merge moves only the tail
    above a late block, so this checks it against the plain definition)."""
    rng = random.Random(11)
    for _ in range(300):
        stream, reference, acked = Stream("orders", 1), {}, 0
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.15 and reference:
                acked = rng.randint(acked, max(reference))
                stream.ack(acked)
                reference = {s: m for s, m in reference.items() if s > acked}
                continue
            start = rng.randint(1, 60)
            block = [(seq, Message(f"m{seq}-{rng.random()}", "orders", b"x", {}))
                     for seq in range(start, start + rng.randint(1, 15))]  # fmt: skip
            rng.shuffle(block) if rng.random() < 0.2 else None
            if rng.random() < 0.2:
                block += block[: rng.randint(1, len(block))]  # a number twice: the first counts
            stream.add_many(block)
            for seq, message in block:
                if seq > acked:
                    reference.setdefault(seq, message)
        expected = dict(sorted(reference.items()))
        assert list(stream.messages.items()) == list(expected.items())
