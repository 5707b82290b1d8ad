"""Which messages a consumer's forced record pre-counts (`resource_managers.cursor._precount`),
and how the state replays the ``p`` field: pure code, no journal."""

from __future__ import annotations

from resource_managers.cursor._precount import grant, on_arrival, settle, window
from resource_managers.cursor._records import message_obj
from resource_managers.cursor._state import CursorState, Entry
from resource_managers.message_log import Message


def state_with(*counts: int, queue: str = "q") -> CursorState:
    """A state whose ``queue`` holds messages ``m0``, ``m1``, ... with these counts."""
    state = CursorState()
    for i, count in enumerate(counts):
        state._add(Entry(Message(f"m{i}", queue, b"x"), i, count))
    return state


def test_the_window_is_the_larger_of_precount_and_what_the_branch_took() -> None:
    state = state_with(0, 0, 0, 0, 0)
    assert window(state, {"q": 1}, 2, 5) == ["m0", "m1"]
    assert window(state, {"q": 3}, 2, 5) == ["m0", "m1", "m2"]
    assert window(state, {"q": 1}, 2, 5, skip={"m0"}) == ["m1", "m2"]  # skipped: not counted


def test_only_never_delivered_messages_without_credit_are_precounted() -> None:
    state = state_with(0, 1, 0, 0)
    grant(state, ["m2"])
    assert window(state, {"q": 1}, 4, 5) == ["m0", "m3"]  # m1 redelivered, m2 credited
    state.entries["m0"].reason = "expired: ..."
    assert window(state, {"q": 1}, 4, 5) == ["m3"]


def test_nothing_when_disabled_or_with_one_delivery_allowed() -> None:
    state = state_with(0, 0)
    assert window(state, {"q": 1}, 0, 5) == []
    assert window(state, {"q": 1}, 4, 1) == []
    assert window(state, {"other": 1}, 4, 5) == []


def test_a_failed_record_withdraws_its_credits_and_only_its_own() -> None:
    state = state_with(0, 0, 0)
    first, second = grant(state, ["m0", "m1"]), grant(state, ["m2"])
    assert first is not None and second is not None
    state.entries["m1"].credit = None  # consumed by a receive meanwhile
    settle(state, first, durable=False)
    assert first.durable is False
    assert [state.entries[k].credit for k in ("m0", "m1")] == [None, None]
    assert state.entries["m2"].credit is second
    settle(state, second, durable=True)
    assert second.durable and state.entries["m2"].credit is second


def test_replaying_p_raises_counts_whatever_the_records_own_verdict() -> None:
    """``p`` applies even to a ``P`` that changes nothing else (after a tombstone): the live
    cursor granted credits for it, so the replay must count them."""
    state = state_with(0, 0, 0)
    state.apply({"k": "R", "g": "g1", "t": 0, "i": [], "x": []})
    state.apply({"k": "P", "g": "g1", "i": [], "p": ["m1", "m2"]})
    state.apply({"k": "H", "g": "g2", "i": ["m0"], "c": 1, "p": ["m1"]})
    state.apply({"k": "H", "g": "g3", "i": ["m1"], "c": 0})
    state.apply({"k": "C", "g": "g2", "i": ["m0"], "p": ["gone"]})
    assert {k: e.count for k, e in state.entries.items()} == {"m1": 2, "m2": 1}
    assert state.handed == {"g3": ["m1"]}


def test_an_arrival_precounts_itself_only_into_a_short_queue() -> None:
    state = state_with(0)
    assert on_arrival(state, "q", 0, 2, 5) and not on_arrival(state, "q", 1, 2, 5)
    assert not on_arrival(state, "q", 0, 1, 5)  # one waiting already fills a window of 1
    assert on_arrival(state, "empty", 0, 1, 5) and not on_arrival(state, "empty", 0, 1, 1)
    state.apply({"k": "M", "q": "q", "e": 1, "n": 1, "p": ["a"],
                 "o": message_obj(Message("a", "q", b""))})  # fmt: skip
    assert state.entries["a"].count == 1


def test_a_clean_close_gives_unused_precounts_back() -> None:
    state = state_with(1, 1, 0)
    state.apply({"k": "G", "i": ["m0", "m2", "gone"]})
    assert [state.entries[k].count for k in ("m0", "m1", "m2")] == [0, 1, 0]
