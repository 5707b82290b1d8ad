"""Phase two of a Redis branch: the commit script (alone or pipelined with other branches on the
same connection pool), the one-phase commit, rollback with its tombstone, and the heuristic
outcomes a reply reveals. The one-phase commit runs the prepare's waiting and refusal, hence
`CommitOps` extends `._prepare.PrepareOps`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from redis import exceptions as rex
from redis.client import NEVER_DECODE

from coordinator import Outcome, OutcomeUnknownError, ProgrammingError, TransientError, Xid
from coordinator.batch_commit import Answer
from coordinator.crashpoints import crash_point
from coordinator.resource import Resource

from ._base import FINAL_REPLIES, ONE_PHASE_MARKER_TTL, log
from ._prepare import PrepareOps
from .branch import ACTIVE, ENDED, FAILED, RedisBranch


class CommitOps(PrepareOps):
    """`CommitOps`'s commit and rollback."""

    # -- phase two ---------------------------------------------------------------------------------

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        if one_phase:
            return self._commit_one_phase(self._branch(xid))
        with self._lock:
            stray = self._branches.get(xid)
            keys = self._staged.pop(xid, None)
        if stray is not None:
            raise ProgrammingError(f"{self._name}: commit of {xid} before it was prepared")
        gid = xid.to_gid()
        if keys is None and self.cluster:
            keys = self._staged_keys(gid)  # declared on a cluster (see `_commit_call`)
        for _ in range(3):
            reply = self._run_commit(gid, keys)
            while reply[0] == b"MORE":  # a bounded step of a large branch (`commit_chunk`)
                crash_point(f"redis.{self._name}.after_commit_step")
                reply = self._run_commit(gid, keys)
            if reply[0] != b"KEYS":
                return self._committed(gid, reply)
            keys = self._staged_keys(gid)  # not plain SETs: declared, as the prepare's were
        raise TransientError(f"{self._name}: the staged keys of {gid} kept changing; will retry")

    def _commit_call(
        self, gid: str, keys: list[bytes] | None = None
    ) -> tuple[list[bytes], list[Any]]:
        """The commit script's KEYS and ARGV: the branch's own keys, and the staged keys when
        given. A write set of plain SETs on a standalone server needs none: the script reads
        them. On a cluster they are always declared: a node importing the slot would serve a
        one-key command on an undeclared key that still lives on the other node."""
        meta = [self._tx(gid), self._ws(gid), self._prepared]
        declared = meta if keys is None else [*meta, *self._locks(keys), *keys]
        return declared, [gid, self.prefix, self.tombstone_ttl, self.commit_chunk or 0]

    def _run_commit(self, gid: str, keys: list[bytes] | None) -> Any:
        """One commit call. An error reply from inside the script (a key it did not declare
        refused by an ACL) may come after the script's earlier writes: the script orders them
        so that the next call goes on safely, and the branch is left for that retry (recovery
        keeps trying), never guessed."""
        try:
            return self._run("commit", *self._commit_call(gid, keys), "commit " + gid)
        except rex.ResponseError as exc:
            raise TransientError(
                f"{self._name}: the commit of {gid} stopped part-way: {exc}. The branch stays "
                "prepared (or 'committing', with how far it got) and the next commit goes on "
                "from there"
            ) from exc

    def _committed(self, gid: str, reply: list[bytes]) -> Outcome | None:
        """What a commit script's reply (not ``KEYS``) says: None (applied now or before), or
        the heuristic outcome it found."""
        if reply[0] == b"OK":
            crash_point(f"redis.{self._name}.after_apply")
            return None
        return self._commit_outcome(gid, reply)

    @property
    def batch_key(self) -> Any:
        """`coordinator.batch_commit`: resources on one connection pool commit a transaction's
        branches in one pipelined round trip. None for a cluster or an instrumented client."""
        return self._scripts.pool

    def commit_batch(self, branches: Sequence[tuple[Resource[Any], Xid]]) -> list[Answer]:
        """Phase two of several prepared branches, this resource's and others' on the same pool,
        as one pipeline of commit scripts (`coordinator.batch_commit`).

        Each script is the one ``commit`` runs, and each reply is judged as ``commit`` judges it.
        A call whose answer is not final (the server lost the scripts, an error reply, a
        connection lost before its reply) is run again alone through ``commit``, whose answer
        (or exception: left to recovery) stands: a pipeline that fails part-way ends exactly as
        the individual commits would have."""
        peers = [(_peer(self, resource), xid) for resource, xid in branches]
        plans: list[tuple[CommitOps, Xid, str, list[bytes] | None]] = []
        for peer, xid in peers:
            with peer._lock:  # a branch still active here: ``commit`` says why
                active = xid in peer._branches
                keys = None if active else peer._staged.pop(xid, None)
            plans.append((peer, xid, "" if active else xid.to_gid(), keys))
        sent = [(peer, gid, keys) for peer, _, gid, keys in plans if gid]
        calls = [("commit", *peer._commit_call(gid, keys)) for peer, gid, keys in sent]

        def after_send() -> None:
            for peer, _, _ in sent:
                crash_point(f"redis.{peer.name}.after_batch_send")

        try:
            replies = iter(self._scripts.pipelined(calls, after_send) if calls else [])
        except Exception as exc:  # the library could not be loaded: each one alone
            replies = iter([exc] * len(calls))
        return [self._batch_answer(peer, xid, gid, keys, replies) for peer, xid, gid, keys in plans]

    @staticmethod
    def _batch_answer(
        peer: CommitOps, xid: Xid, gid: str, keys: list[bytes] | None, replies: Iterator[Any]
    ) -> Answer:
        reply = next(replies) if gid else None
        if isinstance(reply, list) and reply and reply[0] in FINAL_REPLIES:
            return peer._committed(gid, reply)
        if gid and keys is not None:  # run it alone, with the keys it staged
            with peer._lock:
                peer._staged[xid] = keys
        try:
            return peer.commit(xid)
        except Exception as exc:
            return exc

    def _commit_outcome(self, gid: str, reply: list[bytes]) -> Outcome | None:
        status, details = reply[0], reply[1:]
        if status == b"STATE" and details[0] == b"committed":
            return None  # committed before; the answer was lost
        if status == b"STATE" and details[0] == b"aborted":
            log.error("%s: commit of %s found it rolled back (%s)", self._name, gid, self._why(gid))
            return Outcome.HEURISTIC_ROLLBACK
        if status == b"BROKEN":
            log.error(
                "%s: commit of %s applied nothing: key %r was changed outside twopc and the "
                "staged command would fail: %s",
                self._name,
                gid,
                details[0],
                details[1].decode(),
            )
            return Outcome.HEURISTIC_ROLLBACK
        if status == b"STATE" and details[0] == b"":
            log.error(
                "%s: commit of %s found no record of it: its marker outlived tombstone_ttl or it "
                "was never prepared here, so the outcome cannot be known",
                self._name,
                gid,
            )
        else:
            log.error("%s: commit of %s: %r", self._name, gid, reply)
        return Outcome.HEURISTIC_HAZARD

    def _commit_one_phase(self, branch: RedisBranch) -> Outcome | None:
        self._start_vote(branch)
        if not branch.ops:
            self._check_watches(branch)
            return None
        touched, watch_args, packed = branch.plan()
        gid = branch.gid
        keys = [self._tx(gid), *self._locks(touched), *touched]
        head: list[Any] = [gid, self.prefix, len(touched), len(branch.watches)]
        args = [*head, ONE_PHASE_MARKER_TTL, *watch_args, packed]
        try:
            reply = self._run_waiting("one_phase", keys, args, branch)
        except TransientError as exc:
            self._end(branch)
            if self._one_phase_committed(gid):
                return None
            raise OutcomeUnknownError(
                f"{self._name}: lost Redis during a one-phase commit of {gid}; it may or may not "
                f"have been applied: {exc.message}",
                gtrid=branch.xid.gtrid,
            ) from exc
        if reply[0] == b"OK" or reply[1:2] == [b"committed"]:  # the latter: a retried call
            self._end(branch)
            crash_point(f"redis.{self._name}.after_apply")
            return None
        self._refuse(branch, reply)
        return None  # unreachable: _refuse raises

    def _one_phase_committed(self, gid: str) -> bool:
        """Best effort after a lost reply: only the marker's presence is an answer we trust
        (its absence may mean the script is still on its way)."""
        try:
            state = self.client.execute_command(
                "HGET", self._tx(gid), "state", **{NEVER_DECODE: []}
            )
        except Exception:
            return False
        return bool(state == b"committed")

    def rollback(self, xid: Xid) -> Outcome | None:
        with self._lock:
            branch = self._branches.pop(xid, None)
            keys = self._staged.pop(xid, None)
        if branch is not None:
            with branch.lock:
                phase, branch.phase = branch.phase, ENDED
            if phase in (ACTIVE, FAILED):
                return None  # nothing of it ever reached Redis
            # a prepare may be on its way: the tombstone the script leaves fences it
            keys = branch.plan()[0]
        gid = xid.to_gid()
        if keys is None and self.cluster:
            keys = self._staged_keys(gid)  # declared on a cluster, as the commit's
        for _ in range(3):
            reply = self._run_rollback(gid, keys)
            if reply[0] == b"OK":
                return None
            if reply[0] == b"STATE" and reply[1] == b"committing":
                return self._finish_committing(xid)
            if reply[0] == b"STATE":
                log.error("%s: rollback of %s found it committed", self._name, gid)
                return Outcome.HEURISTIC_COMMIT
            keys = self._staged_keys(gid) if self.cluster else None
        raise TransientError(f"{self._name}: the staged keys of {gid} kept changing; will retry")

    def _run_rollback(self, gid: str, keys: list[bytes] | None) -> Any:
        meta = [self._tx(gid), self._ws(gid), self._prepared]
        declared = meta if keys is None else [*meta, *self._locks(keys)]
        args: list[bytes | str | int] = [gid, self.prefix, self.tombstone_ttl]
        try:
            return self._run("rollback", declared, args, "rollback " + gid)
        except rex.ResponseError as exc:  # part-way, as a commit can (see `_run_commit`)
            raise TransientError(
                f"{self._name}: the rollback of {gid} stopped part-way: {exc}. The branch "
                "stays prepared and the next rollback goes on"
            ) from exc

    def _finish_committing(self, xid: Xid) -> Outcome | None:
        """A rollback found the branch's commit under way: only a COMMIT decision starts one,
        so the commit is finished (never undone) and the answer is the heuristic that says the
        branch did not roll back."""
        log.error(
            "%s: rollback of %s found its commit under way (the decision was commit): "
            "finishing the commit instead",
            self._name,
            xid.to_gid(),
        )
        outcome = self.commit(xid)
        return outcome if outcome is not None else Outcome.HEURISTIC_COMMIT


def _peer(leader: CommitOps, resource: Resource[Any]) -> CommitOps:
    """A resource of ``leader``'s batch: one on the same connection pool."""
    if not isinstance(resource, CommitOps) or resource.batch_key is not leader.batch_key:
        raise ProgrammingError(f"{leader.name}: {resource.name!r} is not on its connection pool")
    return resource
