"""The cursor's XA core: the consumer branches' verbs (take, prepare, commit, rollback,
forget, recover's listing) and the delivery counts they raise.

The delivery-count scheme: a count is durably raised **before** its message is handed out, the
only scheme that keeps counts from being low when the consumer's process dies while handling a
message: counting at rollback instead would lose exactly the deliveries a poison message ends by
crashing its consumer, which would then never reach the dead-letter queue. The raise is either a
forced ``H`` record written before ``receive`` returns, or a *pre-count* (`._precount`): a forced
record the consumer side writes anyway (a branch's ``P``, a one-phase ``C``, an ``H``) raises in
its ``p`` field the counts of the next never-delivered messages of the queues that branch used,
or an arriving message's ``M`` raises its own (into a short queue); handing one of those out
consumes its in-memory credit and writes only a lazy ``H`` (``c`` 0). So a steady consumer at
one message per transaction forces one record per side, not two. A clean close gives unused
pre-counts back (a lazy ``G``); a crash leaves them reading one high. In exchange for the forced
raise an unprepared branch's rollback record is lazy (if lost, the replay has the ``H`` and the
open rolls the branch back again); a prepared branch's is forced, decided and queued under one
hold of the lock (a ``P`` is wholly before or after it), and so is a repeat of one whose write
failed: the coordinator forgets the transaction once it returns.

Commit (``C``) is forced when it is the only record of the outcome: a one-phase commit, or a
recovery's commit, after which the coordinator may forget the decision, and a lost ``C`` would
then be presumed aborted and the message delivered twice. Phase two on the coordinator's own path
writes it lazily instead (`commit_lazily`): the coordinator keeps the decision until the record is
durable, and until then the gid is listed as prepared (`coordinator.lazy_commit`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from coordinator.crashpoints import crash_point
from coordinator.errors import IllegalStateError, LogWriteError, ProgrammingError
from coordinator.journal import Ticket

from . import _precount
from ._base import CursorBase, log
from ._queues import expiry_reason
from ._state import Credit, Entry
from ._topics import is_topic
from ._values import BranchRolledBack, Delivery


@dataclass
class _Reserved:
    """A receive's messages, reserved under the lock: the forced ``H`` to wait for (None if
    every message held a credit), the keys it counts, the credits consumed (each must be durable
    before the messages go out) and the credits the ``H`` itself grants."""

    taken: list[Entry]
    ticket: Ticket | None
    counted: set[str]
    consumed: list[Credit]
    granted: Credit | None


class BranchOps(CursorBase):
    """`Cursor`'s branch verbs, keyed by gid (see the module docstring)."""

    # a carried branch's verbs (`._carried.CarriedOps`, which `Cursor` also mixes in)
    restore_carried: Callable[[str, dict[str, Any]], None]
    drop_staged: Callable[[str], bool]

    # -- the resource's verbs ------------------------------------------------------------------

    def take(self, gid: str, queue: str, timeout: float | None = 0.0) -> Delivery | None:
        """Hand the first available message of ``queue`` to branch ``gid`` (see `take_many`)."""
        got = self.take_many(gid, queue, 1, timeout)
        return got[0] if got else None

    def take_many(
        self, gid: str, queue: str, max_messages: int, timeout: float | None = 0.0
    ) -> list[Delivery]:
        """Hand up to ``max_messages`` available messages of ``queue``, in order, to branch
        ``gid``: one forced ``H`` record raises the counts of those without a credit (and
        pre-counts the next ones); those with a credit go out once the record that pre-counted
        them is durable, named in a lazy ``H``. Waits up to ``timeout`` seconds (None: forever)
        for the first; takes what is there then, without waiting for more.
        Higher priority first, arrival order within a priority. Expired messages at the head of
        the queue move to its dead-letter queue on the way (a lazy ``W`` record: one that comes
        back after a crash has expired all the same)."""
        if max_messages < 1:
            raise ProgrammingError("max_messages must be >= 1")
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            self._gate.enter_shared()
            try:
                with self._lock:
                    held = None if self._awaiting else self._reserve(gid, queue, max_messages)
                if held is not None:
                    self._await_hand_out(gid, held)
            finally:
                self._gate.exit_shared()
            if held is not None:
                if not held.counted:
                    crash_point("cursor.after_credited_take")
                self._compaction.maybe()
                return [Delivery(e.message, e.count, queue, e.reason) for e in held.taken]
            with self.changed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return []
                if self._awaiting or not self._takeable(queue, 1):
                    self.changed.wait(remaining)

    def _reserve(self, gid: str, queue: str, max_messages: int) -> _Reserved | None:
        """Under the lock: move the expired head to the dead-letter queue, reserve the next
        messages for ``gid`` (no other consumer gets them): the records queued and applied in
        journal order; what to wait for outside the lock. None: nothing available."""
        if gid in self._state.tombstones:
            raise BranchRolledBack(f"{gid} was rolled back (tombstone)")
        if gid in self._state.prepared:
            raise IllegalStateError(f"{gid} is prepared: it can no longer receive")
        if is_topic(queue):
            raise ProgrammingError(
                f"{queue!r} is a topic: receive from a subscription's queue "
                "(subscription_queue(topic, name))"
            )
        now = self._clock()
        expired = self._state.expired_head(queue, now)
        if expired:  # one record each: each reason names its message's deadline
            deadlines = [self._state.entries[key].message.expires_at or 0 for key in expired]
            self._submit_many_locked([
                {"k": "W", "i": [key], "r": expiry_reason(deadline, now)}
                for key, deadline in zip(expired, deadlines, strict=True)
            ])  # fmt: skip
        ids = self._takeable(queue, max_messages)
        if not ids:
            return None
        taken = [self._state.entries[key] for key in ids]
        consumed = [e.credit for e in taken if e.credit is not None]
        credited = [e.key for e in taken if e.credit is not None]
        counted = [e.key for e in taken if e.credit is None]
        ticket, granted = None, None
        if counted:  # first: if it cannot be queued, nothing changed
            record = {"k": "H", "g": gid, "i": counted, "c": 1}
            ticket, granted = self._submit_precounting(record, {queue: len(ids)}, ids)
        for entry in taken:
            entry.credit = None
        if credited:  # counts raised already: lazy, for the replay's and the rollover's sake
            self._submit_locked({"k": "H", "g": gid, "i": credited, "c": 0}, force=False)
        return _Reserved(taken, ticket, set(counted), consumed, granted)

    def _takeable(self, queue: str, max_messages: int) -> list[str]:
        """Under the lock: the first ``max_messages`` available keys of ``queue``, passing over
        those a carried branch pre-counted and has not committed yet (`._carried`): their count
        is raised by that commit, so handing one out now would count it twice."""
        out: list[str] = []
        for key in self._state.available.get(queue, ()):
            credit = self._state.entries[key].credit
            if credit is not None and credit.carried and credit.durable is None:
                continue
            out.append(key)
            if len(out) == max_messages:
                break
        return out

    def _await_hand_out(self, gid: str, held: _Reserved) -> None:
        """Outside the lock: the forced ``H`` durable, the credits it grants settled, and every
        consumed credit's record durable; otherwise the reservation is undone."""
        try:
            if held.ticket is not None:
                self._wait(held.ticket)
            self._settle(held.granted, True)
            self._await_credits(held.consumed)
        except BaseException:
            self._settle(held.granted, False)
            with self._lock:
                for entry in reversed(held.taken):
                    self._unhand(gid, entry, counted=entry.key in held.counted)
            raise

    def _await_credits(self, credits: list[Credit]) -> None:
        """Wait until the records behind ``credits`` are durable (normally they are: only a
        receive racing another branch's prepare finds one pending)."""
        if not credits:
            return
        if any(c.ticket is not None and _precount.durable(c) is None for c in credits):
            try:  # a lazily written arrival (`deliver_lazily`) not on disk yet: make it so
                self._journal.flush()
            except LogWriteError as exc:
                raise self._located(exc) from exc
        with self.changed:
            while any(_precount.durable(c) is None for c in credits):
                self.changed.wait()
        if not all(_precount.durable(c) for c in credits):
            raise LogWriteError(
                f"cursor {self.directory}: the record that pre-counted these messages failed",
                durable=False,
            )

    def _unhand(self, gid: str, entry: Entry, counted: bool = True) -> None:
        """Undo a reservation whose record failed (if it was written after all, the replay
        counts one delivery more than happened: a count may be high, never low). A credited
        entry keeps its (raised) count and goes back without its credit."""
        mid = entry.key
        handed = self._state.handed.get(gid, [])
        if mid in handed:
            handed.remove(mid)
            if not handed:
                del self._state.handed[gid]
        if counted:
            entry.count -= 1
        self._state._make_available(entry)
        self.changed.notify_all()

    def _submit_precounting(
        self, record: dict[str, Any], taken: dict[str, int], skip: Collection[str] = ()
    ) -> tuple[Ticket, Credit | None]:
        """Under the lock: queue a forced consumer ``record`` with the pre-counts of the
        queues in ``taken`` (queue -> messages the branch took there) in its ``p``, apply it,
        grant the credits (pending until `_settle`)."""
        keys = _precount.window(self._state, taken, self.precount, self.max_deliveries, skip)
        if keys:
            record["p"] = keys
        ticket = self._submit_locked(record, force=True)
        return ticket, _precount.grant(self._state, keys)

    def _append_precounting(self, record: dict[str, Any]) -> None:
        """`_append` of a forced ``P`` or one-phase ``C`` that pre-counts for the queues its
        branch's messages (``i``) came from."""
        self._gate.enter_shared()
        try:
            with self._lock:
                taken = Counter(self._state.entries[k].queue for k in record["i"]
                                if k in self._state.entries)  # fmt: skip
                ticket, granted = self._submit_precounting(record, dict(taken))
            durable = False
            try:
                self._wait(ticket)
                durable = True
                if granted is not None:
                    crash_point("cursor.after_precount")
            finally:  # a receive may be waiting on these credits: never leave them pending
                self._settle(granted, durable)
        finally:
            self._gate.exit_shared()

    def _give_back_credits(self) -> None:
        """At a clean close, lower again the counts pre-counted for messages never handed out
        (a lazy ``G``, written before the close's fsync), so only a crash leaves them one high.
        Only durable credits: the record that raised each is before the ``G`` in the journal."""
        with self._lock:
            keys = [k for k, e in self._state.entries.items()
                    if e.credit is not None and _precount.durable(e.credit)]  # fmt: skip
        if not keys:
            return
        try:
            self._append({"k": "G", "i": keys}, force=False)
        except LogWriteError as exc:  # a refusing journal: the counts just stay one high
            log.warning("cursor %s: unused pre-counts not given back: %s", self.directory, exc)

    def _settle(self, credit: Credit | None, durable: bool) -> None:
        if credit is None or credit.durable is not None:
            return
        with self._lock:
            _precount.settle(self._state, credit, durable)
            self.changed.notify_all()

    def is_tombstoned(self, gid: str) -> bool:
        return gid in self._state.tombstones

    def is_committed(self, gid: str) -> bool:
        return gid in self._state.committed

    def is_prepared(self, gid: str) -> bool:
        """Prepared, or committed by a lazy record not yet durable (recovery must still see it:
        `coordinator.lazy_commit`), or staged for a carried commit (`._carried`)."""
        return gid in self._state.prepared or gid in self._settling or gid in self._staged

    def branch_ids(self, gid: str) -> list[str]:
        with self._lock:
            return self._state.branch_ids(gid)

    def prepare(self, gid: str) -> bool:
        """Make the branch's deletions durable (forced ``P``); False if it holds nothing.
        Raises `BranchRolledBack` if a rollback (recovery's, say) left its tombstone first, even
        while the record was being written: replay ignores a prepare after a tombstone, and the
        rollback made the messages available to others, so voting yes would deliver them twice."""
        with self._lock:
            self._refuse_tombstoned(gid)
            ids = list(self._state.handed.get(gid, []))
        if not ids:
            return False
        self._append_precounting({"k": "P", "g": gid, "i": ids})
        with self._lock:
            self._refuse_tombstoned(gid)
        return True

    def commit_one_phase(self, gid: str) -> None:
        """Delete the messages of a branch that was never prepared (forced ``C``, pre-counting
        the next messages of its queues as a ``P`` would); nothing if it holds none."""
        with self._lock:
            ids = self._state.branch_ids(gid)
        if ids:
            self._append_precounting({"k": "C", "g": gid, "i": ids})
            self._compaction.maybe()

    def _refuse_tombstoned(self, gid: str) -> None:
        if gid in self._state.tombstones:
            raise BranchRolledBack(f"{gid} was rolled back (tombstone); it cannot prepare")

    def commit(self, gid: str) -> None:
        """Delete the branch's messages (forced ``C``), if any. One committed lazily and not yet
        durable (read with them under one hold of the lock) returns once it is (recovery's)."""
        with self._lock:
            settling, ids = gid in self._settling, self._state.branch_ids(gid)
        if settling:
            self._settled()
            return
        staged = self._staged.get(gid)
        if staged is not None:  # staged for a carried commit whose answer was lost: recovery's
            self.restore_carried(gid, staged.record)
            return
        if ids:
            self._append({"k": "C", "g": gid, "i": ids}, force=True)
            self._compaction.maybe()

    def commit_lazily(self, gid: str, on_durable: Callable[[], None]) -> None:
        """`commit` of a prepared branch with a lazy ``C`` record: the messages are deleted now,
        the record is carried to disk by the next forced record (or the `LazyWatch`'s own
        fsync), and ``on_durable`` runs once it is. Until then the gid counts as prepared, so
        recovery still re-drives it from the decision the coordinator keeps
        (`coordinator.lazy_commit`); a crash before it only leaves the branch prepared."""
        if gid in self._settling:
            self._settled()
        with self._lock:
            ids = self._state.branch_ids(gid)
        if not ids:
            on_durable()
            return
        self._gate.enter_shared()
        try:
            with self._lock:
                ticket = self._submit_locked({"k": "C", "g": gid, "i": ids}, False)
                self._settling.add(gid)
            self._wait(ticket)  # only a lazy backlog past its bound waits (an fsync)
        finally:
            self._gate.exit_shared()
        self._settle_when_durable(gid, ticket, on_durable)

    def _settle_when_durable(
        self, gid: str, ticket: Ticket, on_durable: Callable[[], None]
    ) -> None:
        """A lazy commit record of ``gid`` (in ``_settling``) was queued: once it is on disk the
        gid stops counting as prepared and ``on_durable`` runs."""

        def durable_now() -> None:
            with self._lock:
                self._settling.discard(gid)
            on_durable()

        self._lazy.watch(ticket, durable_now)
        self._compaction.maybe()
        self._lazy.settle()

    def flush_commits(self) -> None:
        """Every lazy commit record durable now, its callback run; raises if not (`_settled`)."""
        self._settled()

    def rollback(self, gid: str, max_deliveries: int | None = None) -> list[str]:
        """Make the branch's messages available again (to their dead-letter queue those delivered
        ``max_deliveries`` times), leave a tombstone ``R`` (the module docstring); the ids moved."""
        limit = self.max_deliveries if max_deliveries is None else max_deliveries
        self.drop_staged(gid)
        self._gate.enter_shared()
        try:
            with self._lock:
                back, moves = [], []
                durable = gid in self._state.prepared or gid in self._state.tombstones
                for mid in self._state.branch_ids(gid):
                    if (entry := self._state.entries.get(mid)) is None:
                        continue
                    if entry.count >= limit and entry.reason is None:
                        reason = (f"max-deliveries: delivered {entry.count} times "
                                  f"(max_deliveries {limit}), rolled back")  # fmt: skip
                        moves.append([mid, reason])
                    else:
                        back.append(mid)
                record = {"k": "R", "g": gid, "t": self._clock(), "i": back, "x": moves}
                ticket = self._submit_locked(record, durable)
                self.changed.notify_all()
            self._wait(ticket)
        finally:
            self._gate.exit_shared()
        self._compaction.maybe()
        return [mid for mid, _ in moves]

    def forget(self, gid: str) -> None:
        if gid in self._state.tombstones:
            self._append({"k": "F", "g": gid}, force=False)

    def prepared_gids(self) -> list[str]:
        """Prepared branches, those whose lazy commit record is not durable yet, and those
        staged for a carried commit (recovery settles one whose commit's answer was lost)."""
        with self._lock:
            return sorted({*self._state.prepared, *self._settling, *self._staged})
