"""The message log's reader side (the transfer's): the log's identity, its streams, the visible
messages of a stream up to the first number still being written, acknowledgments that compact
them, expiry drops, refused messages kept, and the version a reader waits on."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ._base import LogBase
from ._records import VOLATILE_SUFFIX, Message
from ._refused import keep_refused


class ReaderOps(LogBase):
    """`MessageLog`'s reader side."""

    # -- the reader's side ---------------------------------------------------------------------

    @property
    def identity(self) -> str:
        """This log's durable identity: chosen once (a uuid4's hex) by the first open of its
        directory and kept in its journal; a cursor keeps this log's streams under it."""
        identity = self._state.identity
        assert identity is not None  # written by `_open`
        return identity

    @property
    def incarnation(self) -> int:
        """This open's incarnation (its ``O`` record): above every earlier open's."""
        return self._state.incarnation

    def streams(self) -> dict[str, int]:
        """Every stream with its epoch."""
        with self._lock:
            return {name: s.epoch for name, s in self._state.streams.items()}

    def epoch(self, stream: str) -> int:
        with self._lock:
            return self._state.stream(stream).epoch

    def pending(self, stream: str, after: int = 0) -> list[tuple[int, Message]]:
        """Committed unacknowledged messages of ``stream`` numbered above ``after``, in order, up
        to the first number still being written. Cost: the messages returned, not the backlog."""
        with self._lock:
            s = self._state.streams.get(stream)
            if s is None:
                return []
            barrier = min(self._inflight.get(stream, ()), default=s.next_seq)
            newest_first = []
            for n in reversed(s.messages):
                if n <= after:
                    break
                if n < barrier:
                    newest_first.append((n, s.messages[n]))
            return newest_first[::-1]

    def sender_state(self, stream: str) -> dict[str, Any]:
        """The state `resource_managers.sequencing.StreamSender.from_dict` takes for this stream."""
        pending = self.pending(stream)
        with self._lock:
            s = self._state.stream(stream)
            top = pending[-1][0] + 1 if pending else s.acked + 1
            window = [[n, m.message_id, m.expires_at] for n, m in pending]
            return {"version": 1, "stream": stream, "epoch": s.epoch, "next_seq": top,
                    "acked": s.acked, "pending": window}  # fmt: skip

    def acknowledge(self, stream: str, epoch: int, upto: int) -> int:
        """Compact ``stream`` up to ``upto``; how many messages left. An ack of another epoch or
        of a number not visible yet is ignored (0): it cannot be about this log's messages."""
        with self._lock:
            s = self._state.streams.get(stream)
            if s is None or s.epoch != epoch or upto <= s.acked:
                return 0
            barrier = min(self._inflight.get(stream, ()), default=s.next_seq)
            if upto >= barrier:
                return 0
            if stream.endswith(VOLATILE_SUFFIX):
                return s.ack(upto)
            gone = sum(1 for seq in s.messages if seq <= upto)
        self._append([{"k": "A", "q": stream, "e": epoch, "u": upto}], force=False)
        return gone

    def get(self, stream: str, numbers: Iterable[int]) -> dict[int, Message]:
        """The visible messages of ``stream`` among ``numbers`` (acknowledged or dropped ones are
        left out): what a transfer needs to put a frame on the wire."""
        with self._lock:
            s = self._state.streams.get(stream)
            if s is None:
                return {}
            barrier = min(self._inflight.get(stream, ()), default=s.next_seq)
            return {n: m for n in numbers if n < barrier and (m := s.messages.get(n)) is not None}

    def drop(self, stream: str, epoch: int, numbers: list[int]) -> None:
        """Remove messages the transfer expired (a lazy ``D`` record: one that comes back after
        a crash has expired all the same); numbers it no longer holds are ignored."""
        with self._lock:
            s = self._state.streams.get(stream)
            if not numbers or s is None or s.epoch != epoch:
                return
        record = {"k": "D", "q": stream, "e": epoch, "l": sorted(numbers)}
        if stream.endswith(VOLATILE_SUFFIX):
            with self._lock:
                self._state.apply(record)
        else:
            self._append([record], force=False)

    def keep_refused(self, stream: str, epoch: int, seq: int, reason: str) -> Path | None:
        """The cursor refused message ``seq`` (``NACK invalid-message``): keep it whole in
        ``refused/`` (durable when this returns), so that the caller may then `drop` it from
        its stream. Returns the kept file, or None if the log no longer holds that message."""
        message = self.get(stream, [seq]).get(seq)
        if message is None or self.epoch(stream) != epoch:
            return None
        return keep_refused(self.directory, stream, epoch, seq, message=message, reason=reason)

    def drop_expired(self, stream: str, now_ms: int | None = None) -> list[tuple[int, Message]]:
        """Remove the visible messages of ``stream`` whose ``expires_at`` has passed (a lazy
        ``D`` record: one that comes back after a crash has expired all the same) and return
        them, so the transfer side can relink the stream past them (as MSMQ does)."""
        now = self._clock() if now_ms is None else now_ms
        expired = [
            (n, m)
            for n, m in self.pending(stream)
            if m.expires_at is not None and m.expires_at <= now
        ]
        if expired:
            self.drop(stream, self.epoch(stream), [n for n, _ in expired])
        return expired

    def on_publish(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener`` each time messages become visible (``version`` moves), in the
        thread that published them, outside the log's lock; return the function that stops it.

        For a reader that sleeps on something else (the transfer's pump sleeps in ``select`` on
        its socket): a listener that pokes it costs a ``send`` per publish, where a thread parked
        in `wait` to relay the news cost two thread switches, and its GIL, per commit. It must be
        quick (a commit waits for it); an exception it raises is logged, never the commit's."""
        with self._lock:
            self._listeners = (*self._listeners, listener)

        def stop() -> None:
            with self._lock:
                self._listeners = tuple(x for x in self._listeners if x is not listener)

        return stop

    def wait(self, seen: int, timeout: float | None = None) -> int:
        """Block until ``version`` passes ``seen`` (or the timeout); return the version."""
        with self.changed:
            self.changed.wait_for(lambda: self.version != seen, timeout)
            return self.version
