"""The state and plumbing shared by the parts of `RedisResource` (`.resource`). Its name, sort
key and the lock over its branches are every resource's
(`resource_managers.bookkeeping.Branches`)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Final

from redis import exceptions as rex
from redis.client import NEVER_DECODE

from coordinator import InvalidXidError, TransientError, Xid
from resource_managers.bookkeeping import Branches

from . import _durability, _errors
from .branch import ENDED, RedisBranch
from .scripts import Scripts

log = logging.getLogger("twopc.redis")

MAGIC: Final = b"twopc-ws-1"
HEADER_GUESS: Final = 64  # staged keys read with the header in one LRANGE
ONE_PHASE_MARKER_TTL: Final = 600
#: commit script replies that are a final answer; anything else is run again alone
#: (``MORE``, a bounded step of a large commit, and ``KEYS``, declare the staged keys, are not:
#: the rest runs alone)
FINAL_REPLIES: Final = frozenset((b"OK", b"STATE", b"BROKEN", b"LOST"))


class RedisBase(Branches[RedisBranch]):
    """What every part of `RedisResource` shares: its settings, one lock (`Branches`') over the
    active branches (``_branches``), and the plumbing (twopc's key names, running a script,
    translating errors, the durability check).
    ``RedisResource.__init__`` sets every attribute; the reads (`._reads`), the phases
    (`._prepare`, `._commit`) and recovery (`._recovery`) are mixins of this class."""

    client: Any
    cluster: bool
    single_slot: bool
    hash_tag: str
    prefix: bytes
    _slot: int
    durability: str
    lock_wait: float
    tombstone_ttl: int
    blind_writes: bool
    #: the keys of branches prepared here whose commit declares them (not plain SETs, or on a
    #: cluster): sent with it, not read back
    _staged: dict[Xid, list[bytes]]
    commit_chunk: int | None
    _scripts: Scripts
    _encoder: Any
    _durability_checked: bool

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
                "LRANGE", key, 0, HEADER_GUESS - 1, **{NEVER_DECODE: []}
            )
            if len(head) < 2 or head[0] != MAGIC:
                return []
            count = int(head[1])
            if count + 2 > len(head):
                head = self.client.execute_command(
                    "LRANGE", key, 0, count + 1, **{NEVER_DECODE: []}
                )
        return [bytes(k) for k in head[2 : 2 + count]]

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


def gtrid_of(gid: bytes) -> str:
    """A lock owner as a person reads it: the gtrid, or the raw gid if it is not ours."""
    try:
        return Xid.from_gid(gid.decode("ascii")).gtrid
    except (UnicodeDecodeError, InvalidXidError):
        return repr(gid)
