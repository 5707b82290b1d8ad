"""Pre-counted deliveries: which messages a forced consumer record raises ahead of delivery.

A delivery count must be durable before its message is handed out (a consumer that dies in its
handler, a poison message, must see the count rise each time), but it may be raised early. So a
forced record a consumer branch writes anyway (its ``P``, a one-phase ``C``, a receive's own
``H``) also raises, in its ``p`` field, the counts of the next messages waiting in the queues the
branch received from; and an arriving message's ``M`` raises its own when its queue is short
(`on_arrival`: a consumer that keeps up leaves nothing waiting for a ``P`` to pre-count). Each
gets a `Credit`, and handing it out consumes the credit instead of writing a forced ``H``.
Credits live in memory only; a clean close gives the unused ones back (a lazy ``G``), and after a
crash the raised counts stay, so a message pre-counted and never handed out reads one high at
its next delivery (JMS lets a count be high, never low).

Only never-delivered messages are pre-counted (count 0, not a dead letter), so a count is high by
at most one, however often the consumer crashes: a redelivery is counted by its own forced ``H``.
And none is pre-counted when ``max_deliveries`` is 1: a credited delivery leaves no forced record
naming its branch, so a crash in its handler is not rolled back at the next open (the message is
simply available again with its count raised). A count after a pre-count is therefore at most 1,
below any ``max_deliveries`` of 2 or more, and that crash never costs the dead-letter check a
delivery it should have made: the next delivery is counted and checked as usual.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ._state import Credit, CursorState

#: How many waiting messages of a queue a forced consumer record keeps pre-counted, at least as
#: many as its branch took from that queue (its next receive most likely takes as many again).
#: 1 is all one consumer needs: each transaction pre-counts exactly the next one's messages, so
#: its receives force nothing. A larger window helps only consumers competing for one queue
#: (whose forced ``H`` records share fsyncs through group commit anyway; 4 consumers at one
#: message per transaction force 1.36 records per message with 1, 1.00 with 4:
#: ``bench/cursor_records.py``), and every pre-counted
#: message not yet handed out is one a crash leaves flagged ``redelivered``, its count one high:
#: with 1, that is the next message (or batch) per queue, close to JMS's promise that only
#: the most recent message is subject to the ambiguity.
DEFAULT_PRECOUNT = 1


def window(
    state: CursorState,
    taken: Mapping[str, int],
    precount: int,
    max_deliveries: int,
    skip: Collection[str] = (),
) -> list[str]:
    """The keys to pre-count: per queue, among the first ``max(precount, taken[queue])``
    available messages (``skip``: those a receive is taking in the same record), those never
    delivered, alive and without a credit. Nothing if ``precount`` is 0 (disabled) or
    ``max_deliveries`` is 1."""
    if precount < 1 or max_deliveries < 2:
        return []
    out: list[str] = []
    for queue, n in taken.items():
        width = max(precount, n)
        for key in state.available.get(queue, ()):
            if key in skip:
                continue
            if width == 0:
                break
            width -= 1
            entry = state.entries[key]
            if entry.count == 0 and entry.reason is None and entry.credit is None:
                out.append(key)
    return out


def durable(credit: Credit) -> bool | None:
    """Whether the record behind ``credit`` is durable (None: not known yet)."""
    if credit.ticket is not None and credit.durable is None:
        return (credit.ticket.error is None) if credit.ticket.done else None
    return credit.durable


def on_arrival(state: CursorState, queue: str, ahead: int, precount: int, limit: int) -> bool:
    """Whether an arriving message's ``M`` pre-counts it: a queue (not a topic's input) with
    fewer than ``precount`` messages waiting, ``ahead`` of them still being written, so a
    consumer that keeps up (the queue empty between messages: no ``P`` finds a next message to
    pre-count) forces no ``H`` either; the same bound on what a crash leaves one high."""
    if precount < 1 or limit < 2:
        return False
    return len(state.available.get(queue, ())) + ahead < precount


def grant(state: CursorState, keys: list[str]) -> Credit | None:
    """Give each key a credit (pending until its record is durable), right after the record
    that raised them was queued and applied."""
    if not keys:
        return None
    credit = Credit(keys)
    for key in keys:
        state.entries[key].credit = credit
    return credit


def settle(state: CursorState, credit: Credit, durable: bool) -> None:
    """The record behind ``credit`` is durable, or failed: then its credits are withdrawn (the
    counts stay raised in memory: high, never low)."""
    credit.durable = durable
    if durable:
        return
    for key in credit.keys:
        entry = state.entries.get(key)
        if entry is not None and entry.credit is credit:
            entry.credit = None
