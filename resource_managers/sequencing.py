"""Exactly-once, in-order transfer as pure code: the numbers a message log puts on each message and
the filter a cursor applies to them (MSMQ's exactly-once in-order delivery, carried by the
at-least-once transfer protocol of US patent 8,200,836). No I/O: the caller owns sockets, clocks,
journals.

Sender, per (stream, epoch), `StreamSender`:

- Commit gives each message the next sequence number, 1, 2, 3, ... in commit order, never changed.
- Its previous number is the number of the message before it *still in the sender's queue* (the
  committed messages neither acknowledged nor expired), or 0 when it is first in the queue. That
  one rule is MSMQ's four: link each message to the previous one; 0 when there is none; an
  expired message "is removed from the message stream, and the next message is linked to the
  message preceding the removed message"; "the sender must assign the first message in the queue a
  previous number of zero". It is computed at each transmission, so a resend may carry another
  previous number than the first send did (MSMQ forbids changing only the sequence number).
- Why it is safe: every message strictly between a frame's previous and sequence numbers was
  acknowledged (the receiver has it) or expired (it may be skipped), so accepting the frame never
  skips a live message. The queue head's 0 also lets a receiver that lost its state take up the
  stream again, as MSMQ intends, instead of waiting for numbers the sender has deleted.
- Timers: a committed message is due at once; after its n-th transmission it is due again after
  ``backoff.compute(n)``. When a message expires, the next message in the queue, if it was sent, is
  due at once, so that it goes out with its new previous number: the receiver may be stuck at the
  gap the expired one left. Compaction by an acknowledgment triggers no resend: a frame whose
  previous message was acknowledged stays acceptable.
- ``on_ack(epoch, seq)`` ("order acknowledgment") compacts everything up to and including ``seq``.
  An ack of another epoch, beyond the highest number sent, or below the last one is counted and
  ignored; one equal to the last is a harmless repeat. An ack of a newer epoch marks the sender
  `fenced`: a newer incarnation of its log owns the stream.

Receiver, `StreamFilter`: per stream only (epoch, last accepted number), fresh (0, 0); see
`classify` for the rule. A receiver fed by several logs keys its streams by log and stream
(`stream_key`: ``<log identity>|<stream>``), so each log's numbers are judged on their own; a
stream key without a log (a log that sent no identity, or state kept before identities existed)
is *claimed* by the first log that sends that stream in the same epoch (`StreamFilter.state`).
``offer`` judges without changing anything; the caller persists the message with
``decision.after`` atomically, then calls ``accepted`` and only then sends the ack it returns
(persist before acknowledging). Drops carry their re-acknowledgment in ``decision.ack``.

Why one module: the sender's numbering and the filter's rule are the two halves of one invariant
(an accepted frame never skips a live message), pure code with no I/O; they are checked side by
side.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from coordinator.errors import FrameError, IllegalStateError

#: sequence numbers and epochs travel as unsigned 64-bit integers
MAX_NUMBER = 2**64 - 1
MAX_NAME_CHARS = 255
_STATE_VERSION = 1
#: joins a log's identity to a stream name in a receiver's stream key (in neither of them)
KEY_SEPARATOR = "|"
#: a stream key: a log identity (at most 40 characters), the separator, a stream name
MAX_KEY_CHARS = 40 + 1 + MAX_NAME_CHARS


def _number(name: str, value: object, low: int, error: type[Exception] = FrameError) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_NUMBER:
        raise error(f"{name} must be an integer in {low}..2**64-1, not {value!r}")
    return value


def _name(
    name: str, value: object, error: type[Exception] = FrameError, limit: int = MAX_NAME_CHARS
) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        raise error(f"{name} must be a string of 1-{limit} characters")
    return value


def stream_key(log: str, stream: str) -> str:
    """The receiver's key of ``stream`` as sent by the log ``log``; the stream itself for a log
    without an identity ("")."""
    return f"{log}{KEY_SEPARATOR}{stream}" if log else stream


def split_key(key: str) -> tuple[str, str]:
    """(log identity or "", stream) of a receiver's stream key."""
    log, sep, stream = key.rpartition(KEY_SEPARATOR)
    return (log, stream) if sep else ("", key)


@dataclass(frozen=True)
class Frame:
    """One message as the transfer numbers it. Impossible numbers are refused here, so a decoder
    that builds a `Frame` from the wire turns them into `FrameError` (that connection is dropped)
    and the filter behind it can trust the value."""

    stream: str
    epoch: int
    seq: int
    prev: int
    message_id: str

    def __post_init__(self) -> None:
        _name("stream", self.stream, limit=MAX_KEY_CHARS)
        _name("message id", self.message_id)
        _number("epoch", self.epoch, 1)
        _number("sequence number", self.seq, 1)
        if _number("previous number", self.prev, 0) >= self.seq:
            raise FrameError(f"previous number {self.prev} is not below sequence {self.seq}")


@dataclass(frozen=True)
class Ack:
    """Order acknowledgment: the receiver accepted, in order and once, every message of ``stream``
    up to ``seq`` in ``epoch`` (0 and 0 before it accepted anything)."""

    stream: str
    epoch: int
    seq: int

    def __post_init__(self) -> None:
        _name("stream", self.stream, limit=MAX_KEY_CHARS)
        _number("epoch", self.epoch, 0)
        _number("sequence number", self.seq, 0)


class Verdict(enum.Enum):
    #: the next message of the stream: persist it, then `StreamFilter.accepted`
    ACCEPT = "accept"
    #: the queue head of a newer epoch: persist it, then `accepted`; the stream restarts there
    NEW_EPOCH = "new-epoch"
    #: at or below the last accepted number (a copy, or a number the stream skipped): drop, re-ack
    DUPLICATE = "duplicate"
    #: its previous message has not been accepted (a gap): drop, re-ack so the sender resends
    OUT_OF_ORDER = "out-of-order"
    #: from an older epoch than the stream's: drop, re-ack, count
    STALE_EPOCH = "stale-epoch"

    @property
    def accepts(self) -> bool:
        return self in (Verdict.ACCEPT, Verdict.NEW_EPOCH)


@dataclass(frozen=True)
class StreamState:
    """All a receiver keeps of a stream (MSMQ: "there is no need to keep message history")."""

    epoch: int = 0
    last: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "last": self.last}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StreamState:
        return cls(
            _number("epoch", data["epoch"], 0, ValueError),
            _number("last", data["last"], 0, ValueError),
        )


def classify(state: StreamState, frame: Frame) -> Verdict:
    """MSMQ's receiver: reject ``sequence <= last_accepted``, reject ``previous >
    last_accepted``, else accept; ``previous`` may be *below* the last accepted number when the
    messages between expired. Requiring equality would wedge the stream: a message the receiver
    accepted, whose acknowledgment was lost, can still expire at the sender, which then relinks
    its successor past it. Epochs fence restarted logs: an older epoch is refused, and a newer one
    is a new message stream whose last number starts at 0, so only its queue head opens it."""
    if frame.epoch < state.epoch:
        return Verdict.STALE_EPOCH
    if frame.epoch > state.epoch:
        return Verdict.NEW_EPOCH if frame.prev == 0 else Verdict.OUT_OF_ORDER
    if frame.seq <= state.last:
        return Verdict.DUPLICATE
    if frame.prev > state.last:
        return Verdict.OUT_OF_ORDER
    return Verdict.ACCEPT


@dataclass(frozen=True)
class Decision:
    """What `StreamFilter.offer` made of a frame. ``before`` is the state it was judged against;
    ``after`` the state to persist with the message (equal to ``before`` for a drop)."""

    verdict: Verdict
    frame: Frame
    before: StreamState
    after: StreamState
    #: the re-acknowledgment to send now for a drop; None for an accept, which acks once persisted
    ack: Ack | None


class StreamFilter:
    """The cursor's filter: the last accepted number (and epoch) per stream, nothing else."""

    def __init__(self, streams: Mapping[str, StreamState] | None = None) -> None:
        self._streams: dict[str, StreamState] = dict(streams or {})
        #: verdicts seen since this object was made (metrics; not part of the durable state)
        self.counts: dict[Verdict, int] = dict.fromkeys(Verdict, 0)

    def state(self, stream: str, epoch: int | None = None) -> StreamState:
        """``stream``'s state; for a log's stream key with no state of its own and a frame of
        ``epoch``, the state of the same stream without a log if it is in that epoch (a claim:
        the log that numbered those messages sends them again under its identity, and its
        epoch, the moment its log first numbered the stream, is that history's name)."""
        state = self._streams.get(stream)
        if state is not None:
            return state
        bare = split_key(stream)[1]
        if epoch is not None and bare != stream:
            legacy = self._streams.get(bare)
            if legacy is not None and legacy.epoch == epoch:
                return legacy
        return StreamState()

    def ack_for(self, stream: str, epoch: int | None = None) -> Ack:
        """The order acknowledgment for ``stream`` now, e.g. for a periodic re-ack (``epoch``:
        the sender's, for a claim; see `state`)."""
        state = self.state(stream, epoch)
        return Ack(stream, state.epoch, state.last)

    def subset(self, streams: Iterable[str]) -> StreamFilter:
        """A copy of ``streams``' states and of the states they may claim, for a trial."""
        names = {name for s in streams for name in (s, split_key(s)[1])}
        return StreamFilter({n: self._streams[n] for n in names if n in self._streams})

    def offer(self, frame: Frame) -> Decision:
        """Judge ``frame``; changes nothing but the counts."""
        before = self.state(frame.stream, frame.epoch)
        verdict = classify(before, frame)
        self.counts[verdict] += 1
        if verdict.accepts:
            return Decision(verdict, frame, before, StreamState(frame.epoch, frame.seq), None)
        ack = Ack(frame.stream, before.epoch, before.last)
        return Decision(verdict, frame, before, before, ack)

    def accepted(self, decision: Decision) -> Ack:
        """Adopt an accepting decision once its message and ``decision.after`` are durable; returns
        the ack to send. Refused if the stream moved since the offer (a second transfer thread on
        the stream, or the same decision applied twice): its message may now be a duplicate."""
        self.adopt(decision)
        return self.ack_for(decision.frame.stream)

    def adopt(self, decision: Decision) -> None:
        """`accepted` without building its acknowledgment, for a batch that sends one per
        stream once every message of it is adopted."""
        stream = decision.frame.stream
        if (
            not decision.verdict.accepts
            or self.state(stream, decision.frame.epoch) != decision.before
        ):
            raise IllegalStateError(
                f"decision {decision.verdict.value} on stream {stream!r} cannot be adopted now",
                stream=stream,
            )
        self._streams[stream] = decision.after
        claim(self._streams, stream, decision.after.epoch)

    def to_dict(self) -> dict[str, Any]:
        streams = {name: state.to_dict() for name, state in sorted(self._streams.items())}
        return {"version": _STATE_VERSION, "streams": streams}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StreamFilter:
        if data.get("version") != _STATE_VERSION:
            raise ValueError(f"unknown filter state version {data.get('version')!r}")
        streams = data["streams"]
        return cls(
            {
                _name("stream", k, ValueError, MAX_KEY_CHARS): StreamState.from_dict(v)
                for k, v in streams.items()
            }
        )


def claim(streams: dict[str, StreamState], key: str, epoch: int) -> None:
    """A log's stream key now has state of its own in ``epoch``: its twin without a log, if in
    that epoch, was its history and is dropped (the receiver's journal replays the same rule)."""
    bare = split_key(key)[1]
    legacy = streams.get(bare)
    if bare != key and legacy is not None and legacy.epoch == epoch:
        del streams[bare]


# -- sender ------------------------------------------------------------------------------------


class Backoff(Protocol):
    """`coordinator.backoff.Backoff`'s shape, so its strategies (with jitter) plug in as well."""

    def compute(self, failures: int) -> float: ...


@dataclass(frozen=True)
class DoublingBackoff:
    """``base * 2**(n-1)`` seconds after the n-th transmission, capped; deterministic."""

    base: float = 0.5
    cap: float = 30.0

    def compute(self, failures: int) -> float:
        return min(self.cap, self.base * 2.0 ** min(max(0, failures - 1), 64))


@dataclass(slots=True)
class _Pending:
    message_id: str
    expires_at: float | None
    #: may a frame of it be on the wire (True for every message restored by `from_dict`)
    sent: bool = False
    sends: int = 0
    due_at: float = -math.inf
    #: the number of the message before it in the window (0: it is the head), kept as it changes
    prev: int = 0


@dataclass(frozen=True)
class Expired:
    """A message that left the stream unacknowledged. If ``may_have_been_sent``, the receiver may
    have accepted it before its time ran out (its ack lost or late): its fate is unknown here."""

    seq: int
    message_id: str
    may_have_been_sent: bool


class AckVerdict(enum.Enum):
    ADVANCED = "advanced"
    #: equal to the last acknowledged number: the receiver re-acking after a drop
    REPEATED = "repeated"
    WRONG_EPOCH = "wrong-epoch"
    BEYOND_SENT = "beyond-sent"
    BEHIND = "behind"


@dataclass(frozen=True)
class AckResult:
    verdict: AckVerdict
    #: (sequence number, message id) of each message this ack compacted, in order
    acknowledged: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class Tick:
    expired: tuple[Expired, ...]
    frames: tuple[Frame, ...]


class StreamSender:
    """The log's side of one stream in one epoch: numbering, the unacknowledged window, timers.

    A log restarted or recovered *without* this state starts a new `StreamSender` with a higher
    epoch; its numbers restart at 1 and the receiver takes its queue head as a new stream."""

    def __init__(
        self,
        stream: str,
        epoch: int = 1,
        *,
        backoff: Backoff | None = None,
        next_seq: int = 1,
        acked: int = 0,
    ) -> None:
        self.stream = _name("stream", stream, ValueError)
        self.epoch = _number("epoch", epoch, 1, ValueError)
        self.backoff: Backoff = backoff or DoublingBackoff()
        self.next_seq = _number("next sequence number", next_seq, 1, ValueError)
        if _number("acked", acked, 0, ValueError) >= next_seq:
            raise ValueError(f"acked {acked} must be below next_seq {next_seq}")
        self.acked = acked
        #: acks above this were never sent in this epoch; after a restore, all assigned numbers
        self.highest_sent = next_seq - 1
        #: the newest epoch seen in an ack; above ``epoch`` means a newer log owns the stream
        self.newest_epoch_seen = self.epoch
        self.counts: dict[AckVerdict, int] = dict.fromkeys(AckVerdict, 0)
        self._window: dict[int, _Pending] = {}  # sequence number -> message, ascending
        # Bookkeeping so that a tick costs what it sends, not the window's size (a backlog of
        # thousands is normal): the first-send candidates in order, how many are in flight, and
        # lower bounds of every resend timer and deadline. A bound may be early (an acknowledged
        # message leaves it behind): a tick that reaches it scans the window and makes it exact.
        self._unsent: dict[int, None] = {}  # numbers with sends == 0 (due at once), ascending
        self._in_flight = 0  # entries with sends > 0
        self._timer_floor = math.inf  # <= due_at of every entry with sends > 0
        self._expiry_floor = math.inf  # <= expires_at of every entry

    @property
    def fenced(self) -> bool:
        return self.newest_epoch_seen > self.epoch

    @property
    def window(self) -> tuple[int, ...]:
        """Sequence numbers committed and neither acknowledged nor expired, ascending."""
        return tuple(self._window)

    def commit(self, message_id: str, expires_at: float | None = None) -> int:
        """Number a committed message; call in commit order. ``expires_at`` is on the caller's
        clock (a wall clock if the deadline must survive a restart)."""
        seq = self.next_seq
        if seq > MAX_NUMBER:
            raise IllegalStateError("sequence numbers exhausted: start a new epoch")
        self._append(seq, _Pending(_name("message id", message_id, ValueError), expires_at))
        self.next_seq = seq + 1
        return seq

    def adopt(self, seq: int, message_id: str, expires_at: float | None = None) -> None:
        """Take a message numbered elsewhere (by the message log, at commit) into the window.
        Numbers must rise; a skipped number (a commit whose record failed) is a gap the
        previous-number links cover."""
        if _number("sequence number", seq, 1, ValueError) < self.next_seq:
            raise ValueError(f"{self.stream}: adopt {seq} below next number {self.next_seq}")
        self._append(seq, _Pending(_name("message id", message_id, ValueError), expires_at))
        self.next_seq = seq + 1

    def _append(self, seq: int, pending: _Pending) -> None:
        """``seq`` is above every number in the window."""
        window = self._window
        pending.prev = next(reversed(window), 0) if window else 0
        window[seq] = pending
        if pending.sends:
            self._in_flight += 1
            self._timer_floor = min(self._timer_floor, pending.due_at)
        else:
            self._unsent[seq] = None
        if pending.expires_at is not None:
            self._expiry_floor = min(self._expiry_floor, pending.expires_at)

    @property
    def in_flight(self) -> int:
        """Messages this object sent that are not acknowledged, for a window limit (those
        restored by `from_dict` are not counted until sent again)."""
        return self._in_flight

    def resend_all(self) -> None:
        """Make every sent message due now, as after a reconnect: what was on the old
        connection may never have arrived."""
        for pending in self._window.values():
            if pending.sent:
                pending.due_at = -math.inf
                pending.sends = 0
        self._recount()

    def _recount(self) -> None:
        """Rebuild the bookkeeping from the window (after a change to many entries)."""
        self._unsent = {seq: None for seq, p in self._window.items() if not p.sends}
        self._in_flight = len(self._window) - len(self._unsent)
        self._timer_floor = min((p.due_at for p in self._window.values() if p.sends),
                                default=math.inf)  # fmt: skip
        self._expiry_floor = min((p.expires_at for p in self._window.values()
                                  if p.expires_at is not None), default=math.inf)  # fmt: skip

    def frames(self) -> list[Frame]:
        """The window as it would go out now, with current previous numbers (for inspection)."""
        return [self._frame(seq, p.prev, p) for seq, p in self._window.items()]

    def _frame(self, seq: int, prev: int, pending: _Pending) -> Frame:
        return Frame(self.stream, self.epoch, seq, prev, pending.message_id)

    def _remove(self, seq: int) -> _Pending:
        """Take ``seq`` out of the window; its successor is linked to its predecessor."""
        pending = self._window.pop(seq)
        if pending.sends:
            self._in_flight -= 1
        else:
            self._unsent.pop(seq, None)
        return pending

    def expire(self, now: float) -> list[Expired]:
        """Remove unacknowledged messages whose deadline passed; the message after each run of
        removed ones is relinked to the one before the run and, if it was sent, is due at once."""
        if now < self._expiry_floor:
            return []
        gone: list[Expired] = []
        relinked = False
        prev = 0
        for seq, pending in list(self._window.items()):
            if pending.expires_at is not None and now >= pending.expires_at:
                self._remove(seq)
                gone.append(Expired(seq, pending.message_id, pending.sent))
                relinked = True
                continue
            pending.prev = prev
            prev = seq
            if relinked:
                if pending.sent:
                    pending.due_at = -math.inf
                relinked = False
        self._recount()
        return gone

    def withdraw(self, seq: int) -> bool:
        """Take message ``seq`` out of the window unacknowledged (the receiver refused it), as
        `expire` would: the message after it is relinked to the one before and, if it was sent,
        is due at once. False if ``seq`` is not in the window."""
        if seq not in self._window:
            return False
        removed = self._remove(seq)
        following = next((p for s, p in self._window.items() if s > seq), None)
        if following is not None:
            following.prev = removed.prev
            if following.sent:
                following.due_at = -math.inf
                self._timer_floor = -math.inf
        return True

    def due_for_resend(
        self, now: float, limit: int | None = None, max_in_flight: int | None = None
    ) -> list[Frame]:
        """Frames to put on the wire now, oldest first: first sends and expired timers. Each one's
        timer restarts. A message past its deadline is not sent (`expire` removes it). At most
        ``limit`` frames; a first send only while fewer than ``max_in_flight`` are unacknowledged
        (resends always go: holding them back could wedge a full window)."""
        room = math.inf if max_in_flight is None else max_in_flight - self._in_flight
        if now < self._timer_floor:  # no resend is due: only first sends, never a window scan
            candidates: Iterable[int] = self._unsent
        else:
            candidates = self._window
        out: list[Frame] = []
        chosen: list[tuple[int, _Pending]] = []
        window = self._window
        for seq in candidates:
            if limit is not None and len(out) >= limit:
                break
            pending = window[seq]
            late = pending.expires_at is not None and now >= pending.expires_at
            if pending.due_at <= now and not late:
                if not pending.sends:
                    if room <= 0:
                        break
                    room -= 1
                out.append(Frame(self.stream, self.epoch, seq, pending.prev, pending.message_id))
                chosen.append((seq, pending))
        for seq, pending in chosen:
            if not pending.sends:
                del self._unsent[seq]
                self._in_flight += 1
            pending.sent, pending.sends = True, pending.sends + 1
            pending.due_at = now + self.backoff.compute(pending.sends)
            self._timer_floor = min(self._timer_floor, pending.due_at)
        if chosen:
            self.highest_sent = max(self.highest_sent, chosen[-1][0])
        if candidates is window:  # the scan's bound is exact again
            self._timer_floor = min((p.due_at for p in window.values() if p.sends),
                                    default=math.inf)  # fmt: skip
        return out

    def tick(self, now: float, limit: int | None = None, max_in_flight: int | None = None) -> Tick:
        """`expire`, then `due_for_resend`: the usual step of a transfer loop."""
        expired = self.expire(now)
        return Tick(tuple(expired), tuple(self.due_for_resend(now, limit, max_in_flight)))

    def next_wakeup(self, max_in_flight: int | None = None) -> float | None:
        """When the next timer or deadline falls due (-inf: something is due now; None: idle).
        With ``max_in_flight``, a first send waiting for room is not due: an acknowledgment makes
        room, and the caller hears that without a timer. May be early (never late): a timer of a
        message acknowledged since is still counted until the next tick that reaches it."""
        if not self._window:
            return None
        waiting = max_in_flight is not None and self._in_flight >= max_in_flight
        if self._unsent and not waiting:
            return -math.inf
        return min(self._timer_floor, self._expiry_floor)

    def on_ack(self, epoch: int, seq: int) -> AckResult:
        """An order acknowledgment: everything up to and including ``seq`` arrived, in order."""
        verdict = self._judge_ack(epoch, seq)
        self.counts[verdict] += 1
        if verdict is not AckVerdict.ADVANCED:
            return AckResult(verdict)
        done: list[tuple[int, str]] = []
        window = self._window
        while window and (first := next(iter(window))) <= seq:
            done.append((first, self._remove(first).message_id))
        if window:
            window[next(iter(window))].prev = 0
        if not self._in_flight:
            self._timer_floor = math.inf
        if not window:
            self._expiry_floor = math.inf
        self.acked = seq
        return AckResult(verdict, tuple(done))

    def _judge_ack(self, epoch: int, seq: int) -> AckVerdict:
        if epoch != self.epoch:
            self.newest_epoch_seen = max(self.newest_epoch_seen, epoch)
            return AckVerdict.WRONG_EPOCH
        if seq > self.highest_sent:
            return AckVerdict.BEYOND_SENT
        if seq < self.acked:
            return AckVerdict.BEHIND
        return AckVerdict.REPEATED if seq == self.acked else AckVerdict.ADVANCED

    def to_dict(self) -> dict[str, Any]:
        """The durable part: numbering and the window. Timers are not kept: a restored sender
        sends its whole window at once, and treats every message in it as maybe sent."""
        pending = [[seq, p.message_id, p.expires_at] for seq, p in self._window.items()]
        numbers = {"epoch": self.epoch, "next_seq": self.next_seq, "acked": self.acked}
        return {"version": _STATE_VERSION, "stream": self.stream, **numbers, "pending": pending}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, backoff: Backoff | None = None) -> StreamSender:
        if data.get("version") != _STATE_VERSION:
            raise ValueError(f"unknown sender state version {data.get('version')!r}")
        sender = cls(
            data["stream"], data["epoch"], backoff=backoff,
            next_seq=data["next_seq"], acked=data["acked"],
        )  # fmt: skip
        for seq, message_id, expires_at in data["pending"]:
            last = next(reversed(sender._window), sender.acked)
            if not last < _number("sequence number", seq, 1, ValueError) < sender.next_seq:
                raise ValueError(f"pending {seq} out of order or outside {last}..{sender.next_seq}")
            name = _name("message id", message_id, ValueError)
            sender._append(seq, _Pending(name, expires_at, sent=True))
        return sender
