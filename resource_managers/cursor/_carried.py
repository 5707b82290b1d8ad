"""The cursor's carried branches (`coordinator.carried`): a consumer branch whose commit record
rides the last resource's commit as a payload, instead of a forced ``P`` before it.

``stage`` checks the branch as ``prepare`` would and returns the ``C`` record it would write (the
ids it deletes, the next messages it pre-counts); the coordinator writes those bytes into the
decision row inside the database commit that decides; ``commit_carried`` then applies them with
one lazy ``C`` that also *remembers* the gid (``v``) until the row is gone (``D``). So a consumer
at one message per transaction forces one write, the database's ``COMMIT``, as an inbox table
does.

What the cursor must add to the message log's version of this, and why:

- **No hand-out before recovery has restored.** A crash may lose the lazy ``C`` (and the lazy
  ``H`` of a credited receive) while the row says committed. The open then finds the branch
  handed out and not prepared and rolls it back: its messages are available again, and handing
  them out would deliver them twice. So the first carried branch a coordinator node stages
  forces an ``O`` record naming the node, and an open that finds nodes there (not cleared by a
  clean close) hands nothing out until each node's recovery pass has restored its rows
  (``carried_restored``, called by `coordinator.recovery` after a complete pass). Receives wait
  meanwhile as on an empty queue.
- **Pre-counts from a row.** The payload's ``p`` raises the next messages' counts, durable with
  the database's commit: their credits are settled at ``commit_carried`` (withdrawn at a
  rollback), and a message whose own arrival (a lazy ``M``) was not on disk when the branch was
  staged is not pre-counted (a lost ``M`` is sent again by the log and would arrive with its
  count at 0, below a delivery that happened). A pending credit of a branch not yet committed is
  never consumed by another branch: that receive counts the message itself.
- **Every message the payload deletes is durable here before the row can commit it**: each was
  handed out by a forced ``H`` (which carries everything before it) or on a credit whose record
  is durable, and that record comes after the message's arrival.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Collection
from typing import Any

from coordinator.crashpoints import crash_point
from coordinator.errors import IllegalStateError, LogWriteError
from coordinator.journal import Ticket

from . import _precount
from ._base import CursorBase, log
from ._records import encode
from ._state import Credit, StagedBranch
from ._values import BranchRolledBack

#: pending forgets past this many are written in a ``D`` record of their own
_FORGET_BATCH = 1000


class CarriedOps(CursorBase):
    """`Cursor`'s verbs for branches carried by a last resource's commit."""

    # `._xa.BranchOps`'s, which `Cursor` also mixes in
    _settle: Callable[[Credit | None, bool], None]
    _settle_when_durable: Callable[[str, Ticket, Callable[[], None]], None]

    def stage(self, gid: str, node: str) -> bytes | None:
        """Check branch ``gid`` as a prepare would and keep it staged; return its payload (the
        ``C`` record it would write), or None if it holds nothing. ``node``: the coordinator
        node whose decision rows carry it (forced once into ``O`` before its first payload)."""
        with self._lock:
            self._refuse_stage_locked(gid)
            ids = self._state.handed.get(gid)
            if not ids:
                return None
            entries = self._state.entries
            volatile = any(not entries[k].message.persistent for k in ids if k in entries)
        self._mark_carrier(node)
        if volatile:  # a lazily written non-persistent arrival must be on disk before the row
            self._flush_journal()
        with self._lock:
            self._refuse_stage_locked(gid)
            ids = list(self._state.handed.get(gid, ()))
            if not ids:
                return None
            record: dict[str, Any] = {"k": "C", "g": gid, "i": ids}
            taken = Counter(self._state.entries[k].queue for k in ids if k in self._state.entries)
            keys = self._carried_window(dict(taken), ids)
            if keys:
                record["p"] = keys
            payload = encode(record)
            credit = _precount.grant(self._state, keys)
            if credit is not None:
                credit.carried = True
            self._staged[gid] = StagedBranch(record, credit)
        return payload

    def _refuse_stage_locked(self, gid: str) -> None:
        if self._closing:
            raise IllegalStateError(f"cursor {self.directory} is closing")
        if gid in self._state.tombstones:
            raise BranchRolledBack(f"{gid} was rolled back (tombstone); it cannot stage")
        if gid in self._staged or gid in self._state.prepared:
            raise BranchRolledBack(f"{gid} is already staged or prepared here")

    def _carried_window(self, taken: dict[str, int], skip: Collection[str]) -> list[str]:
        """`_precount.window`, less the messages whose arrival is not known durable, the topic
        copies (their ``K`` records are lazy and not tracked) and non-persistent messages
        (their ``M`` is lazy)."""
        keys = _precount.window(self._state, taken, self.precount, self.max_deliveries, skip)
        if not keys:
            return keys
        arriving = self._arriving_locked()
        entries = self._state.entries
        return [
            k for k in keys
            if k not in arriving and "@" not in k and entries[k].message.persistent
        ]  # fmt: skip

    def _arriving_locked(self) -> set[str]:
        """Keys whose lazy ``M`` is not on disk yet."""
        return {key for _, keys in drop_durable(self._arrivals) for key in keys}

    def _mark_carrier(self, node: str) -> None:
        """Force ``O`` with ``node`` added, unless it is there already."""
        if node in self._state.carriers:
            return
        with self._carrier_lock:
            if node in self._state.carriers:
                return
            self._append({"k": "O", "d": sorted({*self._state.carriers, node})}, force=True)
        crash_point("cursor.after_carriers")

    def is_staged(self, gid: str) -> bool:
        return gid in self._staged

    def drop_staged(self, gid: str) -> bool:
        """Forget a staged branch (its transaction rolled back): its credits are withdrawn.
        True if there was one. The messages stay handed out until the rollback."""
        with self._lock:
            staged = self._staged.pop(gid, None)
        if staged is None:
            return False
        self._settle(staged.credit, False)
        return True

    def commit_carried(self, gid: str, on_durable: Callable[[], None], *, force: bool) -> None:
        """The row that carries ``gid`` committed: apply the staged ``C`` with the gid
        remembered, lazy unless ``force``; its pre-counts' credits are settled now (the row
        holds them); ``on_durable`` runs once the record is on disk."""
        self._gate.enter_shared()
        try:
            with self._lock:
                staged = self._staged.pop(gid)
                record = {**staged.record, "v": True}
                if self._forgetting:  # the forgets waiting for a record ride this one
                    record["f"] = sorted(self._forgetting)
                    self._forgetting = set()
                ticket = self._submit_locked(record, force)
                self._settling.add(gid)
            self._settle(staged.credit, True)
            self._wait(ticket)
        finally:
            self._gate.exit_shared()
        self._settle_when_durable(gid, ticket, on_durable)

    def restore_carried(self, gid: str, record: dict[str, Any]) -> None:
        """Recovery found ``gid``'s row and the cursor does not remember it: apply ``record``
        (its payload) durably, remembering the gid. One whose lazy record is still in memory is
        flushed instead; one remembered already is left alone; one still staged here (its
        commit's answer was lost) is applied from what was staged."""
        with self._lock:
            settling = gid in self._settling
            remembered = gid in self._state.remembered
            staged = self._staged.pop(gid, None)
            tombstoned = gid in self._state.tombstones
        if settling:
            self._settled()
            return
        if remembered:
            return
        if tombstoned:  # the open rolled back a branch it found handed out: the row wins
            log.warning(
                "cursor %s: %s was rolled back here but its decision row says committed; the "
                "row wins, its messages are deleted",
                self.directory,
                gid,
            )
        applied = {**(staged.record if staged is not None else record), "v": True}
        self._append(applied, force=True)
        if staged is not None:
            self._settle(staged.credit, True)

    def carried_gids(self) -> set[str]:
        """Remembered gids whose record is durable (one still in memory is not yet)."""
        with self._lock:
            return self._state.remembered - self._settling - self._forgetting

    def forget_carried(self, gids: Collection[str]) -> None:
        """Stop remembering ``gids``: the next carried commit's record carries the forget (a
        ``D`` of its own once many wait, or at `flush_forgets`). A lost forget is repeated by
        the next recovery pass."""
        with self._lock:
            self._forgetting.update(g for g in gids if g in self._state.remembered)
            due = len(self._forgetting) >= _FORGET_BATCH
        if due:
            self.flush_forgets()

    def flush_forgets(self) -> None:
        """Write the pending forgets now (a lazy ``D`` record)."""
        with self._lock:
            known, self._forgetting = sorted(self._forgetting), set()
        if known:
            self._append({"k": "D", "b": known}, force=False)

    def carried_restored(self, node: str) -> None:
        """``node``'s recovery has restored every carried commit of its rows that this cursor
        lost: hand-outs may start once no other node is awaited."""
        with self._lock:
            if node not in self._awaiting:
                return
            self._awaiting.discard(node)
            if not self._awaiting:
                log.info("cursor %s: carried commits restored; handing out again", self.directory)
                self.changed.notify_all()

    def awaiting_recovery(self) -> set[str]:
        """The nodes whose recovery this cursor waits for before it hands anything out."""
        with self._lock:
            return set(self._awaiting)

    def _clear_carriers(self) -> None:
        """At a clean close with nothing staged: every carried commit made in this open is
        applied here (the close writes the lazy records), so the next open need wait only for
        the nodes this open still awaited; no stage after this."""
        with self._lock:
            self._closing = True
            keep = sorted(self._awaiting)  # not restored yet: the next open must still wait
            if self._staged or sorted(self._state.carriers) == keep:
                return
        try:
            self.flush_forgets()
            self._append({"k": "O", "d": keep}, force=False)
        except LogWriteError as exc:  # a refusing journal: the next open just waits as well
            log.warning("cursor %s: carriers not cleared: %s", self.directory, exc)


def drop_durable(
    arrivals: deque[tuple[Ticket, list[str]]],
) -> deque[tuple[Ticket, list[str]]]:
    """``arrivals`` (lazy ``M`` batches, oldest first) less those now on disk: they complete in
    journal order, so only the head need be looked at."""
    while arrivals and arrivals[0][0].done:
        arrivals.popleft()
    return arrivals
