"""A stream keeps its messages in number order whatever order commits apply in, and pays for
that once per commit, not once per message: concurrent commits each take a block of numbers and
then write, so a later block often lands first."""

from __future__ import annotations

from resource_managers.message_log import Message
from resource_managers.message_log._state import LogState


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
