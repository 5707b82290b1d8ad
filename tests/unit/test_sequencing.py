"""The rules of `resource_managers.sequencing`, one test per rule, each naming the seed it checks.

Seed 000 is the claim's transfer protocol (send, start a timer, resend on expiry, the cursor acks,
the log deletes on the ack: at-least-once); seed 004 is MSMQ's exactly-once in-order delivery
(sequence and previous numbers, the receiver's filter, order acknowledgments, expired messages
relinking the stream).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from coordinator.backoff import ExponentialBackoff
from coordinator.errors import FrameError, IllegalStateError
from resource_managers.sequencing import (
    MAX_KEY_CHARS,
    MAX_NUMBER,
    Ack,
    AckVerdict,
    DoublingBackoff,
    Frame,
    StreamFilter,
    StreamSender,
    StreamState,
    Verdict,
    classify,
    split_key,
    stream_key,
)

S = "orders"


def sender(**kwargs: Any) -> StreamSender:
    return StreamSender(S, backoff=DoublingBackoff(1.0, 8.0), **kwargs)


def committed(n: int, **kwargs: Any) -> StreamSender:
    out = sender(**kwargs)
    for i in range(1, n + 1):
        out.commit(f"m{i}")
    return out


def links(frames: list[Frame]) -> list[tuple[int, int]]:
    return [(f.seq, f.prev) for f in frames]


def frame(seq: int, prev: int, epoch: int = 1, stream: str = S) -> Frame:
    return Frame(stream, epoch, seq, prev, f"m{seq}")


def take(flt: StreamFilter, f: Frame) -> Verdict:
    """Offer, and for an accept do what the cursor does: persist (nothing here), then adopt."""
    decision = flt.offer(f)
    if decision.verdict.accepts:
        flt.accepted(decision)
    return decision.verdict


# -- value objects ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"seq": 0, "prev": 0},
        {"seq": 3, "prev": 3},
        {"seq": 3, "prev": 4},
        {"seq": 3, "prev": -1},
        {"epoch": 0},
        {"epoch": True},
        {"seq": MAX_NUMBER + 1},
        {"stream": ""},
        {"stream": "x" * (MAX_KEY_CHARS + 1)},  # a log's identity, "|" and 255 characters
        {"message_id": ""},
    ],
)
def test_impossible_frames_are_refused_at_the_boundary(fields: dict[str, Any]) -> None:
    """Seed 004: a previous number identifies the *preceding* message, so it is below the
    sequence number; a frame that breaks it is a bad frame, not a filter verdict."""
    values: dict[str, Any] = {"stream": S, "epoch": 1, "seq": 2, "prev": 1, "message_id": "m"}
    with pytest.raises(FrameError):
        Frame(**{**values, **fields})


def test_ack_of_nothing_yet_is_epoch_zero_sequence_zero() -> None:
    """Seed 004: "The receiver initiates this last number with a zero for each new stream"."""
    assert StreamFilter().ack_for(S) == Ack(S, 0, 0)
    with pytest.raises(FrameError):
        Ack(S, 0, -1)


# -- sender: numbering and linking --------------------------------------------------------------


def test_numbers_increase_in_commit_order_and_the_first_previous_is_zero() -> None:
    """Seed 004: "The sender tags each message with a monotonically increasing sequence number
    and links it to the previous message"; "The first message in a stream always carries a
    previous number equal to zero"."""
    s = sender()
    assert [s.commit(m) for m in ("a", "b", "c")] == [1, 2, 3]
    frames = s.due_for_resend(0.0)
    assert links(frames) == [(1, 0), (2, 1), (3, 2)]
    assert [f.message_id for f in frames] == ["a", "b", "c"]
    assert {(f.stream, f.epoch) for f in frames} == {(S, 1)}


def test_expired_message_leaves_the_stream_and_the_next_is_linked_to_the_one_before() -> None:
    """Seed 004: "A message that is discarded at the sender side (...time-out...) is removed from
    the message stream, and the next message is linked to the message preceding the removed
    message"."""
    s = sender()
    s.commit("m1")
    s.commit("m2", expires_at=5.0)
    s.commit("m3", expires_at=5.0)
    s.commit("m4")
    expired = s.expire(5.0)
    assert [(e.seq, e.message_id) for e in expired] == [(2, "m2"), (3, "m3")]
    assert s.window == (1, 4)
    assert links(s.frames()) == [(1, 0), (4, 1)]


def test_expiry_of_the_queue_head_gives_the_next_previous_zero() -> None:
    """Seed 004: an expired head leaves the next one first in the queue, hence previous zero."""
    s = sender()
    s.commit("m1", expires_at=1.0)
    s.commit("m2")
    s.expire(1.0)
    assert links(s.frames()) == [(2, 0)]


def test_queue_head_carries_previous_zero_after_an_ack() -> None:
    """Seed 004: "the sender must assign the first message in the queue a previous number of
    zero" (so a receiver that lost its state can take up the stream again)."""
    s = committed(3)
    s.due_for_resend(0.0)
    s.on_ack(1, 1)
    assert links(s.frames()) == [(2, 0), (3, 2)]


def test_sequence_numbers_never_change_only_the_link_does() -> None:
    """Seed 004: "after a sequence number has been attached to a message, it must never be
    changed"; the previous number of a resend may."""
    s = committed(3)
    s.due_for_resend(0.0)
    s.on_ack(1, 1)
    resent = s.due_for_resend(100.0)
    assert [(f.seq, f.message_id) for f in resent] == [(2, "m2"), (3, "m3")]
    assert resent[0].prev == 0


# -- sender: timers, back-off, resends -------------------------------------------------------


def test_first_send_at_once_then_resend_on_timer_with_doubling_back_off_and_a_cap() -> None:
    """Seed 000: "the message log starting a timer for the message; the message log resending the
    message if [it] fails to receive an acknowledgment ... prior to expiration of the timer"."""
    s = committed(1)
    sent_at = []
    now = 0.0
    while now <= 60.0:
        if s.due_for_resend(now):
            sent_at.append(now)
        now += 0.5
    assert sent_at == [0.0, 1.0, 3.0, 7.0, 15.0, 23.0, 31.0, 39.0, 47.0, 55.0]
    assert s.next_wakeup() == 63.0


def test_doubling_back_off_does_not_overflow() -> None:
    """Seed 000 resends forever if no ack comes; the delay stays at the cap."""
    assert DoublingBackoff(0.5, 30.0).compute(10_000) == 30.0
    assert DoublingBackoff(0.5, 30.0).compute(1) == 0.5


def test_coordinator_back_off_strategies_plug_in() -> None:
    """The strategy is a one-method object (STYLE 11): the coordinator's jittered one fits."""
    s = StreamSender(S, backoff=ExponentialBackoff(base=1.0, cap=2.0))
    s.commit("m1")
    s.due_for_resend(0.0)
    assert 0.5 <= (s.next_wakeup() or 0.0) <= 1.0


def test_nothing_is_resent_before_its_timer_and_limit_takes_the_oldest() -> None:
    """Seed 000: one timer per message; resends go out oldest first, keeping the stream order."""
    s = committed(5)
    assert links(s.due_for_resend(0.0, limit=2)) == [(1, 0), (2, 1)]
    assert links(s.due_for_resend(0.5)) == [(3, 2), (4, 3), (5, 4)]
    assert s.due_for_resend(0.9) == []
    assert links(s.due_for_resend(1.0)) == [(1, 0), (2, 1)]
    assert s.next_wakeup() == 1.5


def test_a_relinked_message_is_resent_at_once_with_its_new_previous_number() -> None:
    """Seed 004 relink + seed 000 resend: the receiver may wait at the gap the expired message
    left, so the successor goes out again now, not when its back-off ends."""
    s = committed(1)
    s.commit("m2", expires_at=0.5)
    s.commit("m3")
    s.due_for_resend(0.0)
    tick = s.tick(0.5)  # m1's and m3's timers run to 1.0
    assert [e.seq for e in tick.expired] == [2]
    assert links(list(tick.frames)) == [(3, 1)]


def test_unsent_successor_of_an_expired_message_goes_out_once_linked() -> None:
    """Seed 004: a message never sent needs no extra resend; its first send has the new link."""
    s = sender()
    s.commit("m1")
    s.due_for_resend(0.0)
    s.commit("m2", expires_at=0.5)
    s.commit("m3")
    tick = s.tick(0.5)
    assert [(e.seq, e.may_have_been_sent) for e in tick.expired] == [(2, False)]
    assert links(list(tick.frames)) == [(3, 1)]


def test_expired_reports_whether_a_frame_may_be_on_the_wire() -> None:
    """Seed 004 expiry races the ack: a sent message may have been accepted before it timed out."""
    s = sender()
    s.commit("m1", expires_at=5.0)
    s.due_for_resend(0.0)
    assert [e.may_have_been_sent for e in s.expire(5.0)] == [True]


def test_a_message_past_its_deadline_is_not_sent() -> None:
    """Seed 004: once its time is up the message is no longer part of the stream."""
    s = sender()
    s.commit("m1", expires_at=1.0)
    s.commit("m2")
    assert links(s.due_for_resend(1.0)) == [(2, 1)]  # not yet relinked: `expire` does that
    tick = s.tick(1.0)
    assert [e.seq for e in tick.expired] == [1]
    assert links(list(tick.frames)) == [(2, 0)]  # relinked, so at once again
    assert s.window == (2,)


def test_next_wakeup_covers_deadlines_and_unsent_messages() -> None:
    """Seed 000 timers and seed 004 deadlines both wake the transfer loop."""
    s = sender()
    assert s.next_wakeup() is None
    s.commit("m1", expires_at=0.5)
    assert s.next_wakeup() == -math.inf
    s.due_for_resend(0.0)
    assert s.next_wakeup() == 0.5


# -- sender: acknowledgments -----------------------------------------------------------------


def test_an_order_ack_compacts_everything_up_to_and_including_it() -> None:
    """Seed 004: "The sender can thus safely discard all messages up-to and including the
    indicated sequence number"; seed 000: "the message log deleting the message in response to
    the acknowledgement"."""
    s = committed(4)
    s.due_for_resend(0.0)
    result = s.on_ack(1, 3)
    assert result.verdict is AckVerdict.ADVANCED
    assert result.acknowledged == ((1, "m1"), (2, "m2"), (3, "m3"))
    assert s.window == (4,)
    assert s.acked == 3
    assert links(s.due_for_resend(100.0)) == [(4, 0)]


def test_an_ack_of_an_expired_number_is_valid_and_compacts_below_it() -> None:
    """Seed 004: the receiver accepted m2 before it expired here; its ack still covers m1."""
    s = sender()
    s.commit("m1")
    s.commit("m2", expires_at=1.0)
    s.commit("m3")
    s.due_for_resend(0.0)
    s.expire(1.0)
    assert s.on_ack(1, 2).acknowledged == ((1, "m1"),)
    assert s.window == (3,)


@pytest.mark.parametrize(
    ("epoch", "seq", "verdict"),
    [
        (2, 1, AckVerdict.WRONG_EPOCH),
        (0, 0, AckVerdict.WRONG_EPOCH),
        (1, 4, AckVerdict.BEYOND_SENT),
        (1, 1, AckVerdict.BEHIND),
        (1, 2, AckVerdict.REPEATED),
    ],
)
def test_stray_and_stale_acks_are_counted_and_ignored(
    epoch: int, seq: int, verdict: AckVerdict
) -> None:
    """Issue 5: "a stray or stale acknowledgment is counted and ignored" (seed 004's order ack
    says "all messages up to that number", so only a same-epoch ack within what was sent and not
    below the last one can mean anything)."""
    s = committed(4)
    s.due_for_resend(0.0, limit=3)
    s.on_ack(1, 2)
    before = (s.window, s.acked)
    assert s.on_ack(epoch, seq).verdict is verdict
    assert (s.window, s.acked) == before
    assert s.counts[verdict] == 1 + (verdict is AckVerdict.ADVANCED)


def test_an_ack_from_a_newer_epoch_fences_the_sender() -> None:
    """Epochs: a newer incarnation of the log owns the stream once the receiver acks its epoch."""
    s = committed(1)
    s.due_for_resend(0.0)
    assert not s.fenced
    s.on_ack(0, 0)
    assert not s.fenced
    s.on_ack(2, 1)
    assert s.fenced


# -- sender: epochs and recovery -------------------------------------------------------------


def test_a_new_epoch_restarts_the_stream_at_one_with_previous_zero() -> None:
    """Seed 004: a log without its sender state starts a new stream (here a newer epoch); its
    first message carries previous zero so the receiver will accept it."""
    s = StreamSender(S, epoch=7)
    s.commit("x")
    assert [(f.epoch, f.seq, f.prev) for f in s.due_for_resend(0.0)] == [(7, 1, 0)]


def test_the_sender_state_round_trips_and_resends_its_whole_window() -> None:
    """Seed 004: numbers once given never change, so a restored sender resends the same numbers
    at once; it treats every pending message as maybe sent."""
    s = committed(3)
    s.commit("m4", expires_at=9.0)
    s.due_for_resend(0.0)
    s.on_ack(1, 1)
    back = StreamSender.from_dict(s.to_dict())
    assert (back.stream, back.epoch, back.next_seq, back.acked) == (S, 1, 5, 1)
    assert back.highest_sent == 4
    assert links(back.due_for_resend(0.0)) == [(2, 0), (3, 2), (4, 3)]
    assert back.on_ack(1, 4).verdict is AckVerdict.ADVANCED
    state = committed(2).to_dict()
    state["pending"][1][2] = 1.0  # m2's deadline
    again = StreamSender.from_dict(state)
    assert [e.may_have_been_sent for e in again.expire(1.0)] == [True]


@pytest.mark.parametrize(
    "change",
    [
        {"version": 2},
        {"acked": 5},
        {"epoch": 0},
        {"pending": [[2, "b", None], [1, "a", None]]},
        {"pending": [[5, "a", None]]},
        {"pending": [[2, "", None]]},
    ],
)
def test_a_bad_sender_state_is_refused(change: dict[str, Any]) -> None:
    data = {**committed(3).to_dict(), **change}
    with pytest.raises(ValueError):
        StreamSender.from_dict(data)


# -- receiver: the filter -----------------------------------------------------------------------


def test_the_seed_rule_table() -> None:
    """Seed 004: "if(message.sequence <= last_accepted_sequence) Reject; if(message.previous >
    last_accepted_sequence) Reject; Accept", with epochs fencing restarted logs."""
    at = StreamState(epoch=2, last=5)
    assert classify(at, frame(6, 5, 2)) is Verdict.ACCEPT
    assert classify(at, frame(8, 3, 2)) is Verdict.ACCEPT  # 4..7 expired at the sender
    assert classify(at, frame(5, 4, 2)) is Verdict.DUPLICATE
    assert classify(at, frame(3, 0, 2)) is Verdict.DUPLICATE
    assert classify(at, frame(7, 6, 2)) is Verdict.OUT_OF_ORDER
    assert classify(at, frame(9, 0, 1)) is Verdict.STALE_EPOCH
    assert classify(at, frame(1, 0, 3)) is Verdict.NEW_EPOCH
    assert classify(at, frame(4, 0, 3)) is Verdict.NEW_EPOCH  # its 1..3 expired first
    assert classify(at, frame(2, 1, 3)) is Verdict.OUT_OF_ORDER


def test_the_first_message_of_a_fresh_stream_opens_its_epoch() -> None:
    """Seed 004: the receiver starts each new stream at zero; the first message has previous
    zero, so it is accepted (as the opening of the stream's first epoch)."""
    flt = StreamFilter()
    assert take(flt, frame(1, 0)) is Verdict.NEW_EPOCH
    assert flt.state(S) == StreamState(1, 1)
    assert take(flt, frame(2, 1)) is Verdict.ACCEPT


def test_an_accept_is_adopted_only_after_the_caller_persisted_it() -> None:
    """Issue 5: the cursor "persists it before acknowledging": offer changes nothing and has no
    ack; `accepted` adopts the state the caller persisted and returns the ack."""
    flt = StreamFilter({S: StreamState(1, 1)})
    decision = flt.offer(frame(2, 1))
    assert decision.verdict is Verdict.ACCEPT and decision.ack is None
    assert decision.after == StreamState(1, 2)
    assert flt.state(S) == StreamState(1, 1)
    assert flt.offer(frame(2, 1)).verdict is Verdict.ACCEPT  # a crash before persisting: no harm
    assert flt.accepted(decision) == Ack(S, 1, 2)
    assert flt.state(S) == StreamState(1, 2)


def test_a_decision_is_adopted_at_most_once_and_only_if_the_stream_did_not_move() -> None:
    """Seed 004 exactly-once: adopting twice, or after another accept, could take one twice."""
    flt = StreamFilter({S: StreamState(1, 1)})
    first, second = flt.offer(frame(2, 1)), flt.offer(frame(3, 1))
    flt.accepted(first)
    with pytest.raises(IllegalStateError):
        flt.accepted(first)
    with pytest.raises(IllegalStateError):
        flt.accepted(second)
    with pytest.raises(IllegalStateError):
        flt.accepted(flt.offer(frame(2, 1)))  # a duplicate's decision


@pytest.mark.parametrize(
    ("f", "verdict"),
    [
        (frame(3, 2, epoch=2), Verdict.DUPLICATE),
        (frame(1, 0, epoch=2), Verdict.DUPLICATE),
        (frame(5, 4, epoch=2), Verdict.OUT_OF_ORDER),
        (frame(9, 0, epoch=1), Verdict.STALE_EPOCH),
        (frame(2, 1, epoch=3), Verdict.OUT_OF_ORDER),
    ],
)
def test_drops_change_nothing_and_re_ack_the_last_accepted_number(
    f: Frame, verdict: Verdict
) -> None:
    """Seed 004: "The receiver acknowledges by sending the sequence number of the last message
    accepted" and keeps acking streams whose messages arrive "even if these messages are not
    accepted": so a duplicate stops, and a gap starts, the sender's resend."""
    flt = StreamFilter({S: StreamState(2, 3)})
    decision = flt.offer(f)
    assert decision.verdict is verdict
    assert decision.ack == Ack(S, 2, 3)
    assert decision.after == decision.before == flt.state(S) == StreamState(2, 3)
    assert flt.counts[verdict] == 1


def test_a_relinked_message_is_accepted_over_the_expired_gap() -> None:
    """Seed 004: after m2 expired at the sender, m3 links to m1 and the receiver at m1 takes it."""
    flt = StreamFilter()
    take(flt, frame(1, 0))
    assert take(flt, frame(3, 2)) is Verdict.OUT_OF_ORDER  # sent before m2 expired
    assert take(flt, frame(3, 1)) is Verdict.ACCEPT
    assert take(flt, frame(2, 1)) is Verdict.DUPLICATE  # m2's late copy is past the stream


def test_a_relink_over_a_message_the_receiver_already_took_is_accepted() -> None:
    """Seed 004's ``previous > last`` (not ``previous != last``): m2 was accepted but its ack was
    lost and it expired at the sender, which relinked m3 to m1; equality would wedge the stream."""
    flt = StreamFilter()
    take(flt, frame(1, 0))
    take(flt, frame(2, 1))
    assert take(flt, frame(3, 1)) is Verdict.ACCEPT


def test_a_newer_epoch_resets_the_stream_and_fences_the_older_one() -> None:
    """Epochs (issue 5): a restarted log's stream is accepted only if its epoch is newer, from its
    queue head (previous zero); the old log's late frames are then stale."""
    flt = StreamFilter()
    for seq in (1, 2, 3):
        take(flt, frame(seq, seq - 1, epoch=1))
    assert take(flt, frame(2, 1, epoch=2)) is Verdict.OUT_OF_ORDER
    assert take(flt, frame(1, 0, epoch=2)) is Verdict.NEW_EPOCH
    assert flt.state(S) == StreamState(2, 1)
    assert take(flt, frame(4, 3, epoch=1)) is Verdict.STALE_EPOCH
    assert take(flt, frame(2, 1, epoch=2)) is Verdict.ACCEPT
    assert flt.counts[Verdict.STALE_EPOCH] == 1


def test_streams_are_filtered_independently() -> None:
    """Seed 004: "The receiver keeps track of the last accepted message sequence number for each
    message stream"."""
    flt = StreamFilter()
    take(flt, frame(1, 0, stream="a"))
    assert take(flt, frame(1, 0, stream="b")) is Verdict.NEW_EPOCH
    assert take(flt, frame(2, 1, stream="a")) is Verdict.ACCEPT
    assert flt.ack_for("a") == Ack("a", 1, 2)
    assert flt.ack_for("b") == Ack("b", 1, 1)


def test_two_logs_on_one_stream_are_judged_each_in_its_own_numbers() -> None:
    """Issue 15 (a stream per log and destination): two logs number the same destination 1, 2,
    3 in their own epochs; keyed by log, neither fences nor duplicates the other."""
    flt = StreamFilter()
    a, b = stream_key("log-a", S), stream_key("log-b", S)
    for seq in (1, 2, 3):
        assert take(flt, frame(seq, seq - 1, epoch=5, stream=a)).accepts
        assert take(flt, frame(seq, seq - 1, epoch=9, stream=b)).accepts
    assert take(flt, frame(2, 1, epoch=5, stream=a)) is Verdict.DUPLICATE
    assert flt.state(a) == StreamState(5, 3) and flt.state(b) == StreamState(9, 3)
    assert flt.state(S) == StreamState()  # the bare stream: nobody's
    assert split_key(a) == ("log-a", S) and split_key(S) == ("", S)


def test_a_log_claims_the_bare_streams_state_of_its_own_epoch_only() -> None:
    """Issue 15 (existing journals keep working): state kept before identities is the bare
    stream's; the log whose epoch it is picks up exactly there (its acked-but-unacknowledged
    messages are duplicates, not new), and the bare state is gone once the log's own is adopted.
    Another log (another epoch) starts afresh and leaves it alone."""
    flt = StreamFilter({S: StreamState(7, 3)})
    other = stream_key("log-b", S)
    assert take(flt, frame(1, 0, epoch=8, stream=other)) is Verdict.NEW_EPOCH
    assert flt.state(S) == StreamState(7, 3)
    mine = stream_key("log-a", S)
    assert take(flt, frame(2, 0, epoch=7, stream=mine)) is Verdict.DUPLICATE  # taken before
    assert flt.ack_for(mine, 7) == Ack(mine, 7, 3)
    assert take(flt, frame(4, 3, epoch=7, stream=mine)) is Verdict.ACCEPT
    assert flt.state(mine) == StreamState(7, 4) and S not in flt.to_dict()["streams"]
    assert flt.subset([mine]).to_dict()["streams"] == {mine: {"epoch": 7, "last": 4}}


def test_the_filter_state_is_one_small_entry_per_stream_and_round_trips() -> None:
    """Seed 004: "there is no need to keep message history or a larger database"; issue 5: no
    time window, no unbounded history. The state is a small dict the cursor persists."""
    flt = StreamFilter()
    for seq in range(1, 1001):
        take(flt, frame(seq, seq - 1))
    take(flt, frame(1, 0, stream="b"))
    data = flt.to_dict()
    assert data == {
        "version": 1,
        "streams": {"b": {"epoch": 1, "last": 1}, S: {"epoch": 1, "last": 1000}},
    }
    back = StreamFilter.from_dict(data)
    assert back.state(S) == StreamState(1, 1000)
    assert back.offer(frame(1000, 999)).verdict is Verdict.DUPLICATE
    assert StreamState.from_dict(flt.state(S).to_dict()) == flt.state(S)


@pytest.mark.parametrize(
    "data",
    [
        {"version": 9, "streams": {}},
        {"version": 1, "streams": {S: {"epoch": -1, "last": 0}}},
        {"version": 1, "streams": {"": {"epoch": 1, "last": 0}}},
    ],
)
def test_a_bad_filter_state_is_refused(data: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        StreamFilter.from_dict(data)


# -- both ends ------------------------------------------------------------------------------------


def cursor(flt: StreamFilter, f: Frame, got: list[str]) -> Ack:
    """The cursor's loop body: drop and re-ack, or persist (append to ``got``), adopt and ack."""
    decision = flt.offer(f)
    if decision.ack is not None:
        return decision.ack
    got.append(f.message_id)
    return flt.accepted(decision)


def test_a_lossy_transcript_delivers_each_message_once_in_order() -> None:
    """Seeds 000 and 004 together: lose m2, duplicate m3, lose the acks; the resend fills the gap
    and the order ack empties the window."""
    s, flt, got = committed(3), StreamFilter(), list[str]()
    wire = s.due_for_resend(0.0)
    acks = [cursor(flt, f, got) for f in (wire[0], wire[2], wire[2])]  # m2 lost, m3 twice
    assert got == ["m1"]
    assert [a.seq for a in acks] == [1, 1, 1]
    acks = [cursor(flt, f, got) for f in s.due_for_resend(1.0)]  # every ack was lost: resend all
    assert got == ["m1", "m2", "m3"]
    assert [a.seq for a in acks] == [1, 2, 3]
    assert s.on_ack(acks[-1].epoch, acks[-1].seq).acknowledged == ((1, "m1"), (2, "m2"), (3, "m3"))
    assert s.window == ()


def test_a_withdrawn_message_leaves_the_stream_and_its_sent_successor_is_due_relinked() -> None:
    """A message the receiver refused (``NACK invalid-message``) leaves the window as an expired
    one would: the next is linked to the one before it and, already sent, goes out again now."""
    s = sender()
    for mid in ("m1", "m2", "m3"):
        s.commit(mid)
    assert links(s.due_for_resend(0.0)) == [(1, 0), (2, 1), (3, 2)]
    assert s.withdraw(2) and not s.withdraw(2)
    assert s.window == (1, 3)
    assert links(s.due_for_resend(0.0)) == [(3, 1)]  # due at once, not after its back-off


def test_a_full_window_waits_for_an_acknowledgment_not_a_timer() -> None:
    """Seed 000's window limit: with ``max_in_flight`` unacknowledged, the unsent messages are
    not due, so a transfer loop sleeps until an ack (or a resend timer) instead of spinning."""
    s = committed(3)
    assert links(s.due_for_resend(0.0, max_in_flight=2)) == [(1, 0), (2, 1)]
    assert s.next_wakeup() == -math.inf
    assert s.next_wakeup(max_in_flight=2) == 1.0
    s.on_ack(1, 1)
    assert s.next_wakeup(max_in_flight=2) == -math.inf
    assert links(s.due_for_resend(0.5, max_in_flight=2)) == [(3, 2)]
