"""A Hypothesis stateful model of the transfer: a `StreamSender`, a network that loses, duplicates
and reorders frames and acks at will, a `StreamFilter`, expiries, crashes and restarts with a new
epoch. On every delivery the filter is checked against `SeedFilter`, seed 004's receiver written
from its text.

What exactly-once means here, and why it is not "committed minus expired, exactly": a message can
expire at the sender after the receiver accepted it (its ack lost or late), and a frame sent before
an expiry can still arrive after it. So the invariants are:

- `exactly_once`: the receiver accepts no message twice;
- `in_order`: it accepts messages in commit order;
- `no_loss`: every committed message before the last accepted one was accepted or left the
  stream (expired, or abandoned by a log restarted without its sender state);
- `only_sent_dead`: a message that left the stream is accepted only if a frame of it may have been
  on the wire when it left (`Expired.may_have_been_sent`);
- `ack_means_accepted`: the sender compacts only what the receiver accepted;
- `link_safety`: every message strictly between a frame's previous and sequence numbers was
  acknowledged or had left the stream when the frame went out;
- `quiescence`: once the network delivers everything and timers run out, the window is empty and
  every message that did not leave the stream was accepted.

CI runs a small budget (well under 20 s). For a long run: ``TWOPC_HYPOTHESIS_PROFILE=
sequencing-long`` (or ``--hypothesis-profile NAME`` with a profile registered in a conftest).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from resource_managers.sequencing import (
    Ack,
    AckVerdict,
    DoublingBackoff,
    Frame,
    StreamFilter,
    StreamSender,
    Verdict,
)

STREAM = "s"
BACKOFF = DoublingBackoff(base=1.0, cap=8.0)


@dataclass
class SeedFilter:
    """Seed 004's receiver, literally: "The receiver initiates this last number with a zero for
    each new message stream", then::

        if(message.sequence <= last_accepted_sequence) Reject
        if(message.previous > last_accepted_sequence) Reject
        Accept; last_accepted_sequence = message.sequence

    The seed has no epochs; issue 5 adds them: a newer epoch is a new message stream (its last
    number starts at zero) and an older one is refused. Returns why it rejects, or None."""

    epoch: dict[str, int] = field(default_factory=dict)
    last_accepted: dict[str, int] = field(default_factory=dict)

    def judge(self, message: Frame) -> str | None:
        known = self.epoch.get(message.stream, 0)
        if message.epoch < known:
            return "older epoch"
        last_accepted_sequence = 0 if message.epoch > known else self.last_accepted[message.stream]
        if message.seq <= last_accepted_sequence:
            return "sequence"
        if message.prev > last_accepted_sequence:
            return "previous"
        return None

    def accept(self, message: Frame) -> None:
        self.epoch[message.stream] = message.epoch
        self.last_accepted[message.stream] = message.seq


SEED_REASON = {
    Verdict.ACCEPT: None,
    Verdict.NEW_EPOCH: None,
    Verdict.DUPLICATE: "sequence",
    Verdict.OUT_OF_ORDER: "previous",
    Verdict.STALE_EPOCH: "older epoch",
}


class TransferModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.sender = StreamSender(STREAM, 1, backoff=BACKOFF)
        self.filter = StreamFilter()
        self.persisted = self.filter.to_dict()  # what the cursor's journal holds
        self.seed = SeedFilter()
        self.committed: list[str] = []  # every epoch, in commit order
        self.order: dict[str, int] = {}
        self.ids: dict[tuple[int, int], str] = {}  # (epoch, seq) -> message id
        self.on_wire: set[str] = set()  # a frame of it was sent
        self.dead: dict[str, bool] = {}  # left the stream -> may a frame have been on the wire
        self.compacted: set[str] = set()
        self.accepted: list[str] = []
        self.frames: list[Frame] = []
        self.acks: list[Ack] = []

    # -- the log ----------------------------------------------------------------------------

    @initialize(ttls=st.lists(st.none() | st.integers(0, 30), min_size=1, max_size=6))
    def some_committed_and_sent(self, ttls: list[int | None]) -> None:
        """Start with messages on the wire, so that short runs still exercise the network."""
        for ttl in ttls:
            self.commit(ttl)
        self.tick()

    @rule(ttl=st.none() | st.integers(0, 30))
    def commit(self, ttl: int | None) -> None:
        message_id = f"m{len(self.committed)}"
        expires_at = None if ttl is None else self.now + ttl
        seq = self.sender.commit(message_id, expires_at)
        self.ids[(self.sender.epoch, seq)] = message_id
        self.order[message_id] = len(self.committed)
        self.committed.append(message_id)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 3.0, 10.0]))
    def advance_clock(self, dt: float) -> None:
        self.now += dt

    @rule()
    def tick(self) -> None:
        tick = self.sender.tick(self.now)
        for gone in tick.expired:
            event(f"expired (may have been sent: {gone.may_have_been_sent})")
            message_id = self.ids[(self.sender.epoch, gone.seq)]
            # conservative: after `recover_log` every pending message counts as maybe sent
            assert gone.may_have_been_sent or message_id not in self.on_wire
            self.dead[message_id] = gone.may_have_been_sent
        for frame in tick.frames:
            if frame.prev not in (0, frame.seq - 1):
                event("frame relinked over an expired message")
            self._check_link_safety(frame)
            self.on_wire.add(frame.message_id)
            self.frames.append(frame)

    def _check_link_safety(self, frame: Frame) -> None:
        """link_safety: accepting the frame may skip only messages nobody needs any more."""
        for seq in range(frame.prev + 1, frame.seq):
            skipped = self.ids[(frame.epoch, seq)]
            assert skipped in self.compacted or skipped in self.dead, (frame, skipped)

    @precondition(lambda self: bool(self.frames) and self.sender.epoch < 4)
    @rule()
    def restart_log_with_new_epoch(self) -> None:
        """A log restarted without its sender state: its unacknowledged messages are lost with it,
        the new stream restarts at 1 in a newer epoch. Old frames and acks stay on the wire."""
        for seq in self.sender.window:
            message_id = self.ids[(self.sender.epoch, seq)]
            self.dead[message_id] = message_id in self.on_wire
        self.sender = StreamSender(STREAM, self.sender.epoch + 1, backoff=BACKOFF)

    @precondition(lambda self: self.sender.window)
    @rule()
    def recover_log(self) -> None:
        """A log restarted with its durable sender state: same epoch and numbers, timers lost."""
        self.sender = StreamSender.from_dict(self.sender.to_dict(), backoff=BACKOFF)

    # -- the network ------------------------------------------------------------------------

    @precondition(lambda self: self.frames)
    @rule(data=st.data(), duplicate=st.booleans())
    def deliver(self, data: st.DataObject, duplicate: bool) -> None:
        """Any in-flight frame, in any order; with ``duplicate`` a copy stays on the wire."""
        frame = self._pick(self.frames, data, keep=duplicate)
        self._receive(frame, crash_before_persist=False)

    @precondition(lambda self: self.frames)
    @rule(data=st.data())
    def deliver_then_crash_cursor(self, data: st.DataObject) -> None:
        """The cursor dies after judging a frame and before persisting it, and restarts."""
        self._receive(self._pick(self.frames, data, keep=False), crash_before_persist=True)

    @precondition(lambda self: self.frames)
    @rule(data=st.data())
    def lose_frame(self, data: st.DataObject) -> None:
        self._pick(self.frames, data, keep=False)

    @precondition(lambda self: self.acks)
    @rule(data=st.data(), duplicate=st.booleans())
    def deliver_ack(self, data: st.DataObject, duplicate: bool) -> None:
        self._ack(self._pick(self.acks, data, keep=duplicate))

    @precondition(lambda self: self.acks)
    @rule(data=st.data())
    def lose_ack(self, data: st.DataObject) -> None:
        self._pick(self.acks, data, keep=False)

    @rule()
    def quiesce(self) -> None:
        """quiescence: deliver everything, oldest first, and let every timer run out."""
        for _ in range(5):
            self.now += BACKOFF.cap
            self.tick()
            while self.frames:
                self._receive(self.frames.pop(0), crash_before_persist=False)
            while self.acks:
                self._ack(self.acks.pop(0))
            if not self.sender.window:
                break
        assert self.sender.window == ()
        cursor = self.filter.state(STREAM)
        if cursor.epoch == self.sender.epoch:  # below only if the last ones expired unacked
            assert self.sender.acked <= cursor.last
        else:  # the new epoch has not sent anything yet
            assert cursor.epoch < self.sender.epoch and self.sender.acked == 0
        alive = [m for m in self.committed if m not in self.dead]
        assert [m for m in self.accepted if m not in self.dead] == alive

    def teardown(self) -> None:
        self.quiesce()

    @staticmethod
    def _pick(items: list[Ack] | list[Frame], data: st.DataObject, *, keep: bool) -> Ack | Frame:
        index = data.draw(st.integers(0, len(items) - 1))
        return items[index] if keep else items.pop(index)

    # -- the cursor -------------------------------------------------------------------------

    def _receive(self, frame: Ack | Frame, *, crash_before_persist: bool) -> None:
        assert isinstance(frame, Frame)
        decision = self.filter.offer(frame)
        event(f"frame {decision.verdict.value}")
        assert SEED_REASON[decision.verdict] == self.seed.judge(frame), (frame, decision)
        if not decision.verdict.accepts:
            assert decision.ack is not None
            self.acks.append(decision.ack)
        elif crash_before_persist:
            self.filter = StreamFilter.from_dict(self.persisted)
        else:
            self.persisted = {
                **self.filter.to_dict(),
                "streams": {STREAM: decision.after.to_dict()},
            }
            self.accepted.append(frame.message_id)
            self.seed.accept(frame)
            self.acks.append(self.filter.accepted(decision))

    def _ack(self, ack: Ack | Frame) -> None:
        assert isinstance(ack, Ack)
        result = self.sender.on_ack(ack.epoch, ack.seq)
        event(f"ack {result.verdict.value}")
        assert result.verdict is AckVerdict.ADVANCED or not result.acknowledged
        for _, message_id in result.acknowledged:
            assert message_id in self.accepted, "ack_means_accepted"
            self.compacted.add(message_id)

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def exactly_once(self) -> None:
        assert len(set(self.accepted)) == len(self.accepted)

    @invariant()
    def in_order(self) -> None:
        positions = [self.order[m] for m in self.accepted]
        assert positions == sorted(positions)

    @invariant()
    def no_loss(self) -> None:
        if self.accepted:
            last = self.order[self.accepted[-1]]
            taken = set(self.accepted)
            missing = [m for m in self.committed[:last] if m not in taken and m not in self.dead]
            assert not missing

    @invariant()
    def only_sent_dead(self) -> None:
        late = [m for m in self.accepted if m in self.dead]
        if late:
            event("accepted a message that later left the stream")
        assert all(self.dead[m] for m in late)

    @invariant()
    def state_is_one_entry_and_persisted_before_acked(self) -> None:
        assert len(self.filter.to_dict()["streams"]) <= 1
        assert self.filter.to_dict() == self.persisted


settings.register_profile("sequencing-ci", max_examples=250, stateful_step_count=100, deadline=None)
settings.register_profile(
    "sequencing-long", max_examples=3000, stateful_step_count=150, deadline=None
)


def _settings() -> settings:
    """TWOPC_HYPOTHESIS_PROFILE wins; else a profile chosen with --hypothesis-profile; else CI."""
    chosen = os.environ.get("TWOPC_HYPOTHESIS_PROFILE")
    if chosen:
        return settings.get_profile(chosen)
    if settings.get_current_profile_name() != "default":
        return settings()
    return settings.get_profile("sequencing-ci")


TransferModel.TestCase.settings = _settings()
TestTransferModel = TransferModel.TestCase
