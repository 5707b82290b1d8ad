"""`RedisResource`: a Redis server (or one hash slot of a cluster) as a two-phase participant.

Redis has no PREPARE, so a branch makes one out of Lua scripts, each atomic on the server:

- **Work.** ``tx.join(cache)`` returns a `RedisBranch`. Writes are buffered in it as Redis
  commands; reads go to the server and see the branch's own writes (`branch` says how).
- **prepare** (one script): refuse if the branch's record says ``aborted`` (the tombstone a
  rollback leaves, so a late prepare after recovery rolled the branch back fails); check the
  watched keys (SHA-1 of a string's value, or of ``DUMP``) and the per-key locks; *validate the
  whole write set* against the current data, simulating each command's effect on types and
  values, so the commit script cannot fail half-way (a failing ``redis.call`` aborts a script
  but keeps its earlier writes); then take the locks (``<prefix>lock:<key>`` = the branch's
  gid), stage the write set in a list, mark the branch ``prepared`` and add it to the prepared
  sorted set. A lock held by another branch makes prepare retry for up to ``lock_wait``
  seconds, then vote no.
- **commit** (one script): ``committed`` already: nothing to do. Otherwise validate again (a
  writer that bypasses twopc may have broken a key since; then nothing is written, the locks are
  released and the outcome is a heuristic rollback), apply the staged commands in order, release
  the locks, and leave a ``committed`` marker for ``tombstone_ttl`` seconds so that a repeated
  commit is recognised. **rollback** releases the locks and leaves the ``aborted`` tombstone.
  **recover** reads the prepared sorted set.
- **One phase** (Redis is the only participant): one script checks and applies the write set and
  leaves a ten-minute marker, so a call that redis-py repeats after a lost reply is not applied
  twice.

Keys: everything of twopc's lives under ``<namespace>:{<tag>}:`` (``tx:<gid>`` hash,
``ws:<gid>`` list, ``prepared`` zset, ``lock:<key>``). Keys and values are bytes end to end and
reach Lua only through ``KEYS``/``ARGV``; every key a script touches is in ``KEYS``. On Redis
Cluster a branch lives in one hash slot: pass ``hash_tag`` and use keys containing ``{tag}``; a key
of another slot is refused when the branch first touches it (a cluster-aware variant, one branch
per slot, can come later).

Durability: a prepare is a promise only if Redis keeps it across a crash. On first use the
resource reads ``appendonly``, ``appendfsync`` and ``maxmemory-policy`` and refuses a server that
is not ``yes``/``always``/``noeviction`` (eviction can drop staged sets, locks and tombstones),
unless it was created with ``durability="relaxed"`` (then it warns once). Replicas are not
checked: a failover to a replica that had not received the prepare loses it (``WAITAOF``,
Redis >= 7.2, could cover replicas; this server line has 7.0).

What a branch does **not** protect against:

- Writers that bypass twopc see and change data freely: locks are cooperative, honoured only by
  twopc branches. Such a change is caught only where a branch watched the key (it then votes no)
  or where it makes the staged commands invalid (then the commit applies nothing and reports a
  heuristic rollback).
- Readers outside twopc see committed values only, but not atomically across keys: a plain
  ``MGET`` during a commit script cannot run (scripts are atomic), yet two separate reads may
  straddle it.
- Between prepare and commit the staged writes are invisible to everyone, including the branch's
  own later transactions; keys locked by a prepared branch make other branches wait or vote no
  until it is committed or rolled back (by recovery, if its coordinator died).
- A tombstone lasts ``tombstone_ttl`` seconds: a commit re-driven after that finds no record and
  reports a heuristic hazard rather than guess.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

from redis import exceptions as rex
from redis.client import NEVER_DECODE
from redis.cluster import RedisCluster
from redis.crc import key_slot

from coordinator import (
    ConfigurationError,
    IllegalStateError,
    InvalidXidError,
    Outcome,
    OutcomeUnknownError,
    ProgrammingError,
    TransientError,
    Vote,
    Xid,
)
from coordinator.batch_commit import Answer
from coordinator.crashpoints import crash_point
from coordinator.resource import Resource
from coordinator.xid import branches_of, validate_resource_name

from . import _durability, _errors
from . import _writeset as ws
from ._durability import REQUIRED
from ._errors import BranchConflict, BranchFailed, DurabilityWarning
from ._overlay import STRING, Base, Query
from .branch import ACTIVE, ENDED, FAILED, PREPARING, RedisBranch
from .scripts import Scripts

__all__ = [
    "MAGIC",
    "ONE_PHASE_MARKER_TTL",
    "REQUIRED",
    "BranchConflict",
    "BranchFailed",
    "DurabilityWarning",
    "RedisResource",
]

log = logging.getLogger("twopc.redis")

MAGIC: Final = b"twopc-ws-1"
ONE_PHASE_MARKER_TTL: Final = 600
_HEADER_GUESS: Final = 64  # staged keys read with the header in one LRANGE
_NAMESPACE = re.compile(r"[A-Za-z0-9._:-]{1,64}\Z")
#: commit script replies that are a final answer; anything else is run again alone
_FINAL: Final = frozenset((b"OK", b"STATE", b"BROKEN", b"LOST"))


class RedisResource:
    """A redis-py client (`redis.Redis` or `redis.cluster.RedisCluster`) as a resource manager.

    ``name`` is the branch qualifier in every gid and the decision log: keep it stable.
    ``namespace`` and ``hash_tag`` place twopc's own keys (``<namespace>:{<tag>}:``; the tag
    defaults to the namespace); several resources may share a namespace. ``hash_tag`` is required
    on a cluster, where every key of a branch must contain ``{hash_tag}``; ``single_slot=True``
    applies that rule on a standalone server too (to keep code portable to a cluster).
    ``lock_wait``: how long prepare waits for a key locked by another branch before voting no.
    ``tombstone_ttl``: how long the committed marker and the aborted tombstone are kept (longer
    than recovery can take to re-drive a decision). ``blind_writes=True``: buffered writes return
    None instead of reading the server (see `RedisBranch`).
    """

    def __init__(
        self,
        client: Any,
        name: str = "redis",
        *,
        namespace: str = "twopc",
        hash_tag: str | None = None,
        durability: str = "strict",
        lock_wait: float = 2.0,
        tombstone_ttl: int = 24 * 3600,
        sort_key: str | None = None,
        blind_writes: bool = False,
        single_slot: bool | None = None,
    ) -> None:
        self._name = validate_resource_name(name)
        for label, value in (("namespace", namespace), ("hash_tag", hash_tag)):
            if value is not None and not _NAMESPACE.match(value):
                raise ConfigurationError(
                    f"{label} {value!r}: 1-64 characters from letters, digits, '.', '_', ':', '-'"
                )
        if durability not in ("strict", "relaxed"):
            raise ConfigurationError(
                f"durability must be 'strict' or 'relaxed', not {durability!r}"
            )
        if not lock_wait >= 0 or isinstance(tombstone_ttl, bool) or int(tombstone_ttl) < 1:
            raise ConfigurationError("lock_wait must be >= 0 and tombstone_ttl >= 1 second")
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self.single_slot = self.cluster if single_slot is None else single_slot
        if self.single_slot and hash_tag is None:
            raise ConfigurationError(
                f"{name}: on Redis Cluster a branch lives in one hash slot: pass hash_tag='...' "
                "and use keys that contain {hash_tag}"
            )
        self.hash_tag = hash_tag or namespace
        self.prefix = f"{namespace}:{{{self.hash_tag}}}:".encode()
        self._slot = key_slot(self.hash_tag.encode())
        self.durability = durability
        self.lock_wait = float(lock_wait)
        self.tombstone_ttl = int(tombstone_ttl)
        self.blind_writes = blind_writes
        self._sort_key = sort_key or self._name
        self._scripts = Scripts(client, self.cluster)
        self._encoder = client.get_encoder()
        self._lock = threading.Lock()
        self._branches: dict[Xid, RedisBranch] = {}
        self._staged: dict[Xid, list[bytes]] = {}  # keys of branches this process prepared
        self._durability_checked = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def sort_key(self) -> str:
        return self._sort_key

    def __repr__(self) -> str:
        return f"RedisResource({self._name!r}, {self._where()}, prefix={self.prefix!r})"

    # -- phase zero: the branch's work -----------------------------------------------------------

    def start(self, xid: Xid) -> RedisBranch:
        self._check_durability()
        branch = RedisBranch(self, xid)
        with self._lock:
            if xid in self._branches:
                raise IllegalStateError(f"{self._name}: branch {xid} is already active")
            self._branches[xid] = branch
        return branch

    def data_key(self, name: Any) -> bytes:
        """A key a branch may touch, as bytes; the cluster rule and our namespace enforced."""
        key = ws.encode(name, "key")
        if key.startswith(self.prefix):
            raise ProgrammingError(
                f"{self._name}: keys under {self.prefix!r} are twopc's own; a branch may not use "
                "them"
            )
        if self.single_slot and key_slot(key) != self._slot:
            raise ProgrammingError(
                f"{self._name}: key {key!r} is in hash slot {key_slot(key)}, but on Redis "
                f"Cluster a branch lives in one hash slot: use keys with the hash tag "
                f"{{{self.hash_tag}}} (slot {self._slot})"
            )
        return key

    def decode(self, value: Any) -> Any:
        """As the client would return it (``decode_responses``)."""
        return self._encoder.decode(value)

    def read_now(self, key: bytes, query: Query) -> Any:
        """One plain read (GET, HGET, SISMEMBER, TTL, HGETALL, SMEMBERS, LRANGE) of a key the
        branch has not touched; whole collections and TTL come back as `_fact` shapes them."""
        kind, arg = query
        command = _PLAIN_READS[kind] + [key] + ([arg] if kind in "FM" else [])
        if kind == "R":
            command += [0, -1]
        raw = self.read_command(command)
        return _fact(query, raw) if kind in "THAR" else raw

    def read_command(self, command: list[Any]) -> Any:
        """One read-only command (MGET, HMGET, EXISTS, LRANGE...) answered by the server as is."""
        with self._errors("reading " + repr(command[1])):
            return self._scripts.command(command)

    def read_facts(self, key: bytes, queries: list[Query], fingerprint: bool) -> tuple[Base, bytes]:
        """The key's type and ``queries`` at one instant, with its fingerprint if asked.

        A string key (or a missing one) asked for its value at most, the common case of
        ``incrby``, ``get`` and ``watch``, is read with one plain ``GET``, and its fingerprint
        is the value's (`value_fingerprint`), which the scripts check with ``GET`` too. Any
        other type answers ``GET`` with ``WRONGTYPE``; it is then read by the ``read`` script,
        fingerprinted by ``DUMP``."""
        if not queries or queries == [STRING]:
            try:
                with self._errors("reading " + repr(key)):
                    value = self._scripts.command(["GET", key])
            except rex.ResponseError as exc:
                if not str(exc).startswith("WRONGTYPE"):
                    raise
            else:
                if value is None:
                    return Base("none", {STRING: None}), b""
                seen = value_fingerprint(value) if fingerprint else b""
                return Base("string", {STRING: bytes(value)}), seen
        args: list[bytes | str | int] = [b"1" if fingerprint else b"0"]
        for kind, arg in queries:
            args += [kind.encode(), arg]
        reply = self._run("read", [key], args, "reading " + repr(key))
        facts = {q: _fact(q, value) for q, value in zip(queries, reply[2:], strict=True)}
        return Base(reply[0].decode(), facts), reply[1] or b""

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
        with branch.lock:
            branch.check_active()
            if branch.doomed is not None:
                branch.phase = FAILED
                raise BranchConflict(f"{self._name}: {branch.doomed}")
            branch.phase = PREPARING
        if not branch.ops:  # nothing to promise; a watched key that changed still votes no
            self._check_watches(branch)
            return Vote.READ_ONLY
        touched, watch_args, packed = branch.plan()
        gid = branch.gid
        keys = [self._tx(gid), self._ws(gid), self._prepared, *self._locks(touched), *touched]
        args = [gid, self.prefix, len(touched), len(branch.watches), *watch_args, packed]
        crash_point(f"redis.{self._name}.after_stage")
        return branch, keys, args, touched

    def _voted(self, branch: RedisBranch, reply: list[bytes], touched: list[bytes]) -> Vote:
        """The vote the prepare script's ``reply`` gives; a refusal raises (votes no)."""
        if reply[0] != b"OK":
            self._refuse(branch, reply)
        crash_point(f"redis.{self._name}.after_prepare_marker")
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
                f"{where}: key {details[0]!r} is locked by branch {_gtrid(details[1])} "
                f"(waited {self.lock_wait:g} s)"
            )
        if status == b"INVALID":
            raise BranchFailed(
                f"{where}: the write set would fail on key {details[0]!r}: {details[1].decode()}"
            )
        raise BranchFailed(f"{where}: the script refused the write set ({reply!r}); a twopc bug")

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
        if keys is None:
            keys = self._staged_keys(gid)
        for _ in range(3):
            reply = self._run("commit", *self._commit_call(gid, keys), "commit " + gid)
            if reply[0] != b"KEYS":
                return self._committed(gid, reply)
            keys = self._staged_keys(gid)
        raise TransientError(f"{self._name}: the staged keys of {gid} kept changing; will retry")

    def _commit_call(self, gid: str, keys: list[bytes]) -> tuple[list[bytes], list[Any]]:
        """The commit script's KEYS and ARGV for a branch that staged ``keys``."""
        meta = [self._tx(gid), self._ws(gid), self._prepared]
        return [*meta, *self._locks(keys), *keys], [gid, self.prefix, self.tombstone_ttl]

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
        A call whose answer is not final (the staged keys changed, the server lost the scripts,
        an error reply, a connection lost before its reply) is run again alone through
        ``commit``, whose answer (or exception: left to recovery) stands: a pipeline that fails
        part-way ends exactly as the individual commits would have."""
        peers = [(_peer(self, resource), xid) for resource, xid in branches]
        plans: list[tuple[RedisResource, Xid, str, list[bytes]]] = []
        for peer, xid in peers:
            with peer._lock:  # a branch not prepared by this process: ``commit`` says why
                keys = None if xid in peer._branches else peer._staged.pop(xid, None)
            plans.append((peer, xid, "", []) if keys is None else (peer, xid, xid.to_gid(), keys))
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
        peer: RedisResource, xid: Xid, gid: str, keys: list[bytes], replies: Iterator[Any]
    ) -> Answer:
        reply = next(replies) if gid else None
        if isinstance(reply, list) and reply and reply[0] in _FINAL:
            return peer._committed(gid, reply)
        if gid:  # run it alone, from the keys it staged
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
        with branch.lock:
            branch.check_active()
            if branch.doomed is not None:
                branch.phase = FAILED
                raise BranchConflict(f"{self._name}: {branch.doomed}")
            branch.phase = PREPARING
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
            keys = branch.plan()[0]  # a prepare may be on its way: fence it with the tombstone
        gid = xid.to_gid()
        keys = keys or []
        args: list[bytes | str | int] = [gid, self.prefix, self.tombstone_ttl]
        for _ in range(3):
            meta = [self._tx(gid), self._ws(gid), self._prepared]
            reply = self._run("rollback", [*meta, *self._locks(keys)], args, "rollback " + gid)
            if reply[0] == b"OK":
                return None
            if reply[0] == b"STATE":
                log.error("%s: rollback of %s found it committed", self._name, gid)
                return Outcome.HEURISTIC_COMMIT
            keys = self._staged_keys(gid)
        raise TransientError(f"{self._name}: the staged keys of {gid} kept changing; will retry")

    # -- recovery ----------------------------------------------------------------------------------

    def recover(self) -> list[Xid]:
        """Our prepared branches (this resource's name as bqual, or a sub-branch of it; our format
        id), of any age."""
        with self._errors("reading the prepared set"):
            members = self.client.execute_command(
                "ZRANGE", self._prepared, 0, -1, **{NEVER_DECODE: []}
            )
        # a non-ASCII member decodes to U+FFFD, which no gid holds: skipped like any stranger
        gids = (m.decode("ascii", "replace") for m in members)
        return branches_of(gids, self._name, sub_branches=True)

    def forget(self, xid: Xid) -> None:
        """Drop the marker or tombstone of a completed branch (a prepared one is kept)."""
        gid = xid.to_gid()
        self._run("forget", [self._tx(gid)], [], "forget " + gid)

    def prepared_stats(self) -> tuple[int, float]:
        """(count, age in seconds of the oldest) of the prepared branches in this namespace."""
        with self._errors("reading the prepared set"):
            count = int(self.client.execute_command("ZCARD", self._prepared))
            oldest = self.client.zrange(self._prepared, 0, 0, withscores=True)
            seconds, micros = self.client.time()
        now_ms = seconds * 1000 + micros / 1000
        return count, max(0.0, (now_ms - float(oldest[0][1])) / 1000) if oldest else 0.0

    def gauges(self) -> dict[str, Callable[[], float]]:
        """Read by the manager's metrics; NaN while Redis is unreachable."""
        return {
            "prepared_transactions": lambda: self._gauge(0),
            "oldest_prepared_age_seconds": lambda: self._gauge(1),
        }

    def _gauge(self, index: int) -> float:
        try:
            return float(self.prepared_stats()[index])
        except TransientError:
            return math.nan

    # -- plumbing ----------------------------------------------------------------------------------

    @property
    def _prepared(self) -> bytes:
        return self.prefix + b"prepared"

    def _tx(self, gid: str) -> bytes:
        return self.prefix + b"tx:" + gid.encode("ascii")

    def _ws(self, gid: str) -> bytes:
        return self.prefix + b"ws:" + gid.encode("ascii")

    def _locks(self, keys: list[bytes]) -> list[bytes]:
        return [self.prefix + b"lock:" + key for key in keys]

    def _why(self, gid: str) -> str:
        with contextlib.suppress(TransientError, rex.RedisError):
            with self._errors("reading a tombstone"):
                reason = self.client.execute_command(
                    "HGET", self._tx(gid), "reason", **{NEVER_DECODE: []}
                )
            if reason:
                return bytes(reason).decode("utf-8", "replace")
        return "rolled back by recovery or an operator"

    def _staged_keys(self, gid: str) -> list[bytes]:
        """The keys a prepared branch locked, from its staged list's header."""
        key = self._ws(gid)
        with self._errors("reading a staged write set"):
            head = self.client.execute_command(
                "LRANGE", key, 0, _HEADER_GUESS - 1, **{NEVER_DECODE: []}
            )
            if len(head) < 2 or head[0] != MAGIC:
                return []
            count = int(head[1])
            if count + 2 > len(head):
                head = self.client.execute_command(
                    "LRANGE", key, 0, count + 1, **{NEVER_DECODE: []}
                )
        return [bytes(k) for k in head[2 : 2 + count]]

    def _branch(self, xid: Xid) -> RedisBranch:
        with self._lock:
            branch = self._branches.get(xid)
        if branch is None:
            raise ProgrammingError(f"{self._name}: no active branch {xid}")
        return branch

    def _end(self, branch: RedisBranch) -> None:
        branch.phase = ENDED
        with self._lock:
            self._branches.pop(branch.xid, None)

    def _run(self, script: str, keys: list[bytes], args: list[Any], doing: str) -> Any:
        try:
            return self._scripts.run(script, keys, args)
        except Exception:
            with self._errors(doing):  # the server's address is looked up only on an error
                raise

    def _errors(self, doing: str) -> contextlib.AbstractContextManager[None]:
        return _errors.translated(self._name, self._where(), doing)

    def _where(self) -> str:
        return _errors.where(self.client, self.cluster)

    def _node_client(self) -> Any:
        """The client of the server holding our slot (a cluster routes CONFIG nowhere itself)."""
        if not self.cluster:
            return self.client
        return self.client.get_redis_connection(self.client.get_node_from_key(self._prepared))

    def _check_durability(self) -> None:
        """Once per resource: strict refuses a server that could lose a prepare, relaxed warns."""
        if self._durability_checked:
            return
        try:
            with self._errors("checking the durability settings"):
                found: dict[str, str | None] | None = _durability.read_settings(self._node_client())
            why = ""
        except _durability.ConfigRefused as exc:
            found, why = None, str(exc)
        _durability.judge(self._name, self._where(), self.durability, found, why)
        self._durability_checked = True


def _peer(leader: RedisResource, resource: Resource[Any]) -> RedisResource:
    """A resource of ``leader``'s batch: one on the same connection pool."""
    if not isinstance(resource, RedisResource) or resource.batch_key is not leader.batch_key:
        raise ProgrammingError(f"{leader.name}: {resource.name!r} is not on its connection pool")
    return resource


#: the command that reads one fact of an untouched key (`read_now`)
_PLAIN_READS: Final[dict[str, list[Any]]] = {
    "S": ["GET"],
    "F": ["HGET"],
    "M": ["SISMEMBER"],
    "T": ["TTL"],
    "H": ["HGETALL"],
    "A": ["SMEMBERS"],
    "R": ["LRANGE"],
}


def _fact(query: Query, value: Any) -> Any:
    """A fact as the overlay keeps it: bools, numbers, bytes, and dict / set / list of bytes for
    a whole collection (a reply is a flat list, or already a dict or set through a cluster
    client's callbacks)."""
    kind = query[0]
    if kind == "M":
        return bool(value)
    if kind == "Z":
        return None if value is None else float(value)
    if kind in "LNT":
        return int(value or 0)
    if kind == "H":
        if not value:
            return {}
        items = (
            value.items() if isinstance(value, dict) else zip(value[0::2], value[1::2], strict=True)
        )
        return {bytes(f): bytes(v) for f, v in items}
    if kind in "AR":
        whole = [bytes(v) for v in value or ()]
        return set(whole) if kind == "A" else whole
    return None if value is None else bytes(value)


def value_fingerprint(value: bytes) -> bytes:
    """A watch on a string key as its value read by ``GET``: ``S`` and the value's SHA-1 (hex).
    ``unchanged`` in ``common.lua`` compares it with the key's value then; a ``DUMP``
    fingerprint is bare hex and a missing key's is empty, so the three never mix."""
    return b"S" + hashlib.sha1(value, usedforsecurity=False).hexdigest().encode()


def _gtrid(gid: bytes) -> str:
    """A lock owner as a person reads it: the gtrid, or the raw gid if it is not ours."""
    try:
        return Xid.from_gid(gid.decode("ascii")).gtrid
    except (UnicodeDecodeError, InvalidXidError):
        return repr(gid)
