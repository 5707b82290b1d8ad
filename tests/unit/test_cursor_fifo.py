"""A queue's available entries: priority first, arrival order within a priority, whatever order
entries come back in; entries put back out of order are sorted once per read, not per entry."""

from __future__ import annotations

from resource_managers.cursor._state import Fifo


def test_a_large_rollback_behind_a_backlog_comes_back_in_arrival_order() -> None:
    fifo = Fifo()
    n = 20_000  # a re-sort per entry made this quadratic
    for order in range(n, 2 * n):
        fifo.add(f"late-{order}", 4, order)
    for order in range(n):  # a rollback returns the earlier arrivals
        fifo.add(f"early-{order}", 4, order)
    assert fifo.first() == "early-0"
    keys = list(fifo)
    assert keys[0] == "early-0" and keys[n - 1] == f"early-{n - 1}" and keys[n] == f"late-{n}"
    assert len(fifo) == 2 * n


def test_priority_first_and_discard_of_a_sorted_level() -> None:
    fifo = Fifo()
    fifo.add("b", 4, 2)
    fifo.add("a", 4, 1)  # out of order: sorted at the next read
    fifo.add("urgent", 9, 3)
    fifo.add("a", 4, 0)  # already there: ignored
    assert list(fifo) == ["urgent", "a", "b"]
    assert fifo.discard("urgent") and not fifo.discard("urgent")
    assert fifo.first() == "a" and "b" in fifo
    fifo.add("c", 4, 0)
    assert fifo.discard("a") and fifo.discard("b") and fifo.discard("c")
    assert fifo.first() is None and list(fifo) == []
