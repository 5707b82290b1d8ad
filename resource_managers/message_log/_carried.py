"""The message log's carried branches (`coordinator.carried`): staged in memory, their messages
written into the last resource's decision row by the coordinator, then committed here with one
lazy ``1`` record that also *remembers* the gid (``r``), until the row is gone (``W``).

Why the log remembers: after a crash that lost the lazy record, the log has no trace of the
branch (no prepare record was ever written), so recovery restores it from the row; after a crash
that kept the record, the row may still be there (its deletion waits for a later commit), and
restoring it again would duplicate every message. The remembered gids tell the two apart, and
compaction carries them (``K``) where it would forget an ordinary commit's gid.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from ._base import BranchRolledBack, LogBase, Staged, log
from ._records import Message, encode, message_obj
from ._validation import check_message

#: how a staged branch's payload starts (`encode` writes compact JSON, keys in insertion order)
_PAYLOAD_HEAD = b'{"k":"P",'
#: pending forgets past this many are written in a ``W`` record of their own
_FORGET_BATCH = 1000


class CarriedOps(LogBase):
    """`MessageLog`'s verbs for branches carried by a last resource's commit."""

    # the numbering and publication of `._branches.BranchOps`, which `MessageLog` also mixes in
    _take_number: Callable[[str], tuple[str, int]]
    _stream_of: Callable[[Message], str]
    _publish: Callable[..., None]
    _submit_settling: Callable[..., None]
    commit: Callable[..., None]

    def stage(self, gid: str, messages: list[Message]) -> bytes:
        """Check ``messages`` as a prepare would and keep them in memory, counted against their
        destinations' limits; returns the payload the decision row carries (the ``P`` record
        this branch does not write: its persistent messages)."""
        for message in messages:
            check_message(message, max_bytes=self.max_message_bytes)
        objs = [message_obj(m) for m in messages if m.persistent]
        payload = encode({"k": "P", "g": gid, "m": objs})
        with self._lock:
            if gid in self._state.tombstones:
                raise BranchRolledBack(f"{gid} was rolled back (tombstone); it cannot stage")
            if gid in self._staged or gid in self._state.prepared:
                raise BranchRolledBack(f"{gid} is already staged or prepared here")
            self._staged[gid] = Staged(messages, objs, payload)
            self._hold_locked(messages, +1)
        return payload

    def is_staged(self, gid: str) -> bool:
        return gid in self._staged

    def staged_messages(self, gid: str) -> list[Message]:
        return self._staged[gid].messages

    def drop_staged(self, gid: str) -> bool:
        """Forget a staged branch (its transaction rolled back); True if there was one."""
        with self._lock:
            staged = self._staged.pop(gid, None)
            if staged is not None:
                self._hold_locked(staged.messages, -1)
        return staged is not None

    def commit_carried(self, gid: str, on_durable: Callable[[], None], *, force: bool) -> None:
        """Number and apply a staged branch with one ``1`` record that remembers ``gid``, lazy
        unless ``force``; its messages become visible, and ``on_durable`` runs, once the record
        is durable (as `BranchOps.commit_lazily`, whose numbering rules this follows)."""
        with self._lock:
            staged = self._staged.pop(gid)
            durable = [m for m in staged.messages if m.persistent]
            volatile = [m for m in staged.messages if not m.persistent]
            self._committing.add(gid)
            numbers = [self._take_number(self._stream_of(m)) for m in durable]
            vnumbers = [self._take_number(self._stream_of(m)) for m in volatile]
            forgets, self._forgetting = sorted(self._forgetting), set()
        self._publish(volatile, vnumbers, [], one_phase=False)
        record: dict[str, Any] = {"k": "1", "g": gid, "m": staged.objs, "s": []}
        record["s"] = [list(n) for n in numbers]
        if forgets:  # the forgets waiting for a record ride this one
            record["f"] = forgets
        record["r"] = 1
        payload = _commit_bytes(staged.payload, record)
        self._submit_settling(record, payload, numbers, durable, on_durable, force=force)

    def restore_carried(self, gid: str, messages: list[Message]) -> None:
        """Recovery found ``gid``'s row and the log does not remember it: commit ``messages``
        durably, remembering ``gid``. A gid whose lazy record is still in memory is flushed
        instead, and one remembered already is left alone (a repeat)."""
        with self._lock:
            settling = gid in self._settling
            remembered = gid in self._state.remembered
            staged = self._staged.pop(gid, None)  # the same messages, with the volatile ones
            if staged is not None:
                self._hold_locked(staged.messages, -1)
            tombstoned = gid in self._state.tombstones
        if settling:
            self._settled()
            return
        if remembered:
            return
        if tombstoned:  # only a rollback that was certain leaves one: the row says otherwise
            log.error(
                "message log %s: %s has a tombstone but its decision row says committed; the "
                "row wins, its messages are restored",
                self.directory,
                gid,
            )
        self.commit(gid, staged.messages if staged is not None else messages, remember=True)

    def carried_gids(self) -> set[str]:
        """Remembered gids whose record is durable (one still in memory is not yet: recovery's
        `restore_carried` flushes it)."""
        with self._lock:
            return self._state.remembered - self._settling - self._forgetting

    def forget_carried(self, gids: Collection[str]) -> None:
        """Stop remembering ``gids``: the next carried commit's record carries the forget (a
        ``W`` record of its own only once many wait, or at `flush_forgets`). A forget lost in a
        crash is repeated by the next recovery pass."""
        with self._lock:
            self._forgetting.update(g for g in gids if g in self._state.remembered)
            due = len(self._forgetting) >= _FORGET_BATCH
        if due:
            self.flush_forgets()

    def flush_forgets(self) -> None:
        """Write the pending forgets now (a lazy ``W`` record)."""
        with self._lock:
            known, self._forgetting = sorted(self._forgetting), set()
        if known:
            self._append([{"k": "W", "w": known}], force=False)


def _commit_bytes(staged: bytes, record: dict[str, Any]) -> bytes:
    """``record`` (a ``1`` record of the staged branch) encoded by reusing the staged payload's
    message bytes: the payload is ``{"k":"P","g":...,"m":[...]}``, the record the same keys with
    ``k`` 1 and more keys after ``m``."""
    if not staged.startswith(_PAYLOAD_HEAD):  # never for `stage`'s own payloads
        return encode(record)
    tail = {k: v for k, v in record.items() if k not in ("k", "g", "m")}
    return b'{"k":"1",' + staged[len(_PAYLOAD_HEAD) : -1] + b"," + encode(tail)[1:]
