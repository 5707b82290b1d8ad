"""Phase one of a Redis branch: the prepare script (sent and read at once, or sent early and read
later), the watches of a branch without writes, the wait for keys locked by another branch, and
the no vote a refusal becomes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from coordinator import TransientError, Vote, Xid
from coordinator.crashpoints import crash_point

from ._base import RedisBase, gtrid_of
from ._errors import BranchConflict, BranchFailed
from .branch import ENDED, FAILED, PREPARING, RedisBranch


class PrepareOps(RedisBase):
    """`RedisResource`'s prepare (see the `.resource` docstring for what the script does)."""

    # -- phase one ---------------------------------------------------------------------------------

    def prepare(self, xid: Xid) -> Vote:
        staged = self._stage(xid)
        if isinstance(staged, Vote):
            return staged
        branch, keys, args, touched = staged
        return self._voted(branch, self._run_waiting("prepare", keys, args, branch), touched)

    def send_prepare(self, xid: Xid) -> Callable[[], Vote]:
        """``prepare(xid)`` with the script sent now and its reply read by the function returned
        (`coordinator.early_prepare`), so the coordinator can prepare other branches meanwhile.

        The script is the one ``prepare`` runs. A reply that is not final (a key locked by another
        branch, the server's lost code, an error reply, a lost connection) makes the function run
        the script again as ``prepare`` would (waiting for locks, reloading the code; a rerun of a
        script that did run answers OK, as a repeated prepare does), so the vote is the one
        ``prepare`` gives."""
        staged = self._stage(xid)
        if isinstance(staged, Vote):
            vote = staged
            return lambda: vote
        branch, keys, args, touched = staged
        read = self._scripts.send("prepare", keys, args)
        crash_point(f"redis.{self._name}.after_prepare_send")

        def finish() -> Vote:
            reply = read()
            if not isinstance(reply, list) or not reply or reply[0] == b"LOCKED":
                reply = self._run_waiting("prepare", keys, args, branch)
            return self._voted(branch, reply, touched)

        return finish

    def _stage(self, xid: Xid) -> Vote | tuple[RedisBranch, list[bytes], list[Any], list[bytes]]:
        """Phase one up to the script: the branch's checks, then (branch, the prepare script's
        KEYS and ARGV, the keys it locks); or the vote of a branch with nothing to promise."""
        branch = self._branch(xid)
        self._start_vote(branch)
        if not branch.ops:  # nothing to promise; a watched key that changed still votes no
            self._check_watches(branch)
            return Vote.READ_ONLY
        touched, watch_args, packed = branch.plan()
        gid = branch.gid
        keys = [self._tx(gid), self._ws(gid), self._prepared, *self._locks(touched), *touched]
        args = [gid, self.prefix, len(touched), len(branch.watches), *watch_args, packed]
        crash_point(f"redis.{self._name}.after_stage")
        return branch, keys, args, touched

    def _start_vote(self, branch: RedisBranch) -> None:
        """Phase one (or a one-phase commit) begins: a doomed branch votes no, and no more
        commands are taken."""
        with branch.lock:
            branch.check_active()
            if branch.doomed is not None:
                branch.phase = FAILED
                raise BranchConflict(f"{self._name}: {branch.doomed}")
            branch.phase = PREPARING

    def _voted(self, branch: RedisBranch, reply: list[bytes], touched: list[bytes]) -> Vote:
        """The vote the prepare script's ``reply`` gives; a refusal raises (votes no)."""
        if reply[0] != b"OK":
            self._refuse(branch, reply)
        crash_point(f"redis.{self._name}.after_prepare_marker")
        if self.cluster or not branch.plain():  # their commit declares the keys: keep them
            with self._lock:
                self._staged[branch.xid] = touched
        self._end(branch)
        return Vote.COMMIT

    def _check_watches(self, branch: RedisBranch) -> None:
        """The vote of a branch without writes: no if a watched key changed, else it ends."""
        if branch.watches:
            keys = list(branch.watches)
            args: list[bytes | str | int] = list(branch.watches.values())
            try:
                reply = self._run("watch", keys, args, f"checking the watches of {branch.gid}")
            except TransientError:
                branch.phase = FAILED  # the script writes nothing: a local rollback will do
                raise
            if reply[0] != b"OK":
                self._refuse(branch, reply)
        self._end(branch)

    def _run_waiting(
        self, script: str, keys: list[bytes], args: list[Any], branch: RedisBranch
    ) -> Any:
        """Run a prepare or one-phase script, retrying while a key is locked by another branch."""
        deadline = time.monotonic() + self.lock_wait
        delay = 0.002
        while True:
            reply = self._run(script, keys, args, f"{script} of {branch.gid}")
            left = deadline - time.monotonic()
            if reply[0] != b"LOCKED" or left <= 0 or branch.phase != PREPARING:
                return reply
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.05)

    def _refuse(self, branch: RedisBranch, reply: list[bytes]) -> None:
        """Turn a script's refusal into the no vote; nothing of the branch was written."""
        with branch.lock:
            rolled_back = branch.phase == ENDED
            branch.phase = ENDED if rolled_back else FAILED
        status, details = reply[0], reply[1:]
        where = f"{self._name}: branch {branch.xid.gtrid}"
        if rolled_back:
            raise BranchFailed(f"{where} was rolled back while its prepare was running")
        if status == b"STATE":
            raise BranchFailed(
                f"{where} is already {details[0].decode()} in Redis; a late prepare is refused"
            )
        if status == b"CHANGED":
            raise BranchConflict(f"{where}: watched key {details[0]!r} changed since it was read")
        if status == b"LOCKED":
            raise BranchConflict(
                f"{where}: key {details[0]!r} is locked by branch {gtrid_of(details[1])} "
                f"(waited {self.lock_wait:g} s)"
            )
        if status == b"INVALID":
            raise BranchFailed(
                f"{where}: the write set would fail on key {details[0]!r}: {details[1].decode()}"
            )
        raise BranchFailed(f"{where}: the script refused the write set ({reply!r}); a twopc bug")
