"""A message log served by ``twopc serve log``, enlisted in a local transaction as a resource
manager of its own (role ``producer``).

A producer branch stages its messages here, validated as `ProducerBranch.send` validates them
(the destination's room is the server's to check, at prepare), and ships them with the prepare:
one round trip per transaction, and an abandoned transaction costs the server nothing. A branch
whose messages would not fit one frame (a Spark partition of a quarter million rows made a 33 MB
prepare against the 16 MiB limit, and failed) ships them in shares of about `SHARE_BYTES`, each
an ``XA_START op=stage`` on the connection that then carries the prepare with the last share;
if that connection breaks first, the server rolls the staged shares back and the prepare votes
no. Expiry times (``ttl``) are computed on this machine's clock. What a broken connection means
to each verb is explained in `_resource`.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from typing import TypeVar

from coordinator.crashpoints import crash_point
from coordinator.errors import OutcomeUnknownError, ProgrammingError
from coordinator.resource import Outcome, Vote
from coordinator.xid import Xid
from messaging.auth import SharedSecret, TlsConfig
from messaging.connection import Address
from messaging.frames import PACKED_VERSION, FrameType, Value
from resource_managers.message_log import (
    DEFAULT_MAX_MESSAGE_BYTES,
    BranchDoomed,
    Message,
    StagingBranch,
    split_by_size,
)

from ._loop_link import Link
from ._packed import pack, packed_size
from ._replies import Result, _outcome, _staged, _vote
from ._resource import _Lost, _RemoteResource, _Unsent
from .protocol import PRODUCER_ROLE, RemoteUnavailable, message_to_value

T = TypeVar("T")

#: a branch's messages go in shares of about this many encoded bytes (estimated by
#: `_share_size`, which errs high whichever form the connection reads): a quarter of the default
#: frame limit
SHARE_BYTES = 4 * 1024 * 1024


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _share_size(m: Message) -> int:
    """``m``'s bytes in a request, estimated high for either form: packed (`packed_size`) or a
    map (its strings plus a fixed allowance for the field names, tags and lengths: about 100
    bytes measured for a small message). The shares are cut before a connection is chosen,
    and a connection to an older server reads maps."""
    as_map = 160 + len(m.body) + 4 * (len(m.destination) + len(m.message_id))
    as_map += sum(4 * (len(k) + len(v)) + 16 for k, v in m.headers.items())
    return max(as_map, packed_size(m))


def _with(args: dict[str, Value], messages: list[Message]) -> Callable[[Link], dict[str, Value]]:
    """``args`` plus ``messages`` as the connection reads them: packed from protocol version
    `PACKED_VERSION` (`_packed`: one `struct` call per message each way, where the list of maps
    cost about 55 µs per message between the two ends), a list of maps before."""

    def made(conn: Link) -> dict[str, Value]:
        if conn.version >= PACKED_VERSION:
            return {**args, "messages": pack(messages)}
        return {**args, "messages": [message_to_value(m) for m in messages]}

    return made


class RemoteProducerBranch(StagingBranch):
    """One transaction's messages for a remote log, staged here until prepare; the server checks
    the destination's limit (`DestinationFullError`) at prepare."""

    def __init__(self, resource: RemoteMessageLog, xid: Xid) -> None:
        super().__init__(xid)
        self.name = resource.name
        self._limit = resource.max_message_bytes

    def _now_ms(self) -> int:
        return _now_ms()

    def _max_bytes(self) -> int:
        return self._limit


class RemoteMessageLog(_RemoteResource[RemoteProducerBranch]):
    """A message log served by ``twopc serve log``, as a resource manager (role ``producer``).

    ``name`` is the bqual (the server keeps one resource per name): keep it stable, and unique
    among the clients of one log unless they share a coordinator node id. ``max_message_bytes``
    is checked at ``send``; the server checks its own limit again.

    ``secret`` is the shared secret, or this client's own key when the server has a clients file
    (``client_id`` names its entry there); None for a client known by its TLS certificate alone
    (``tls``: a context or a `TlsConfig` with ``certfile``/``keyfile``)."""

    _role = PRODUCER_ROLE

    def __init__(
        self,
        address: Address,
        secret: SharedSecret | None,
        *,
        name: str = "mlog",
        client_id: str = "twopc-client",
        tls: ssl.SSLContext | TlsConfig | None = None,
        server_hostname: str | None = None,
        timeout: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        sort_key: str | None = None,
        lazy_commit: bool = True,
    ) -> None:
        super().__init__(
            address, secret, name=name, client_id=client_id, tls=tls,
            server_hostname=server_hostname, timeout=timeout, sort_key=sort_key,
            lazy_commit=lazy_commit,
        )  # fmt: skip
        if max_message_bytes < 1:
            raise ProgrammingError("max_message_bytes must be >= 1")
        self.max_message_bytes = max_message_bytes

    def start(self, xid: Xid) -> RemoteProducerBranch:
        return self._begin(xid, RemoteProducerBranch(self, self._check(xid)))

    def prepare(self, xid: Xid) -> Vote:
        branch = self._take(xid)
        if branch.doomed is not None:
            raise BranchDoomed(f"{self._name}: {xid}: {branch.doomed}")
        if not branch.messages:
            return Vote.READ_ONLY
        args: dict[str, Value] = {}
        after = self._with_predecessors(args)
        try:
            vote = self._ship(FrameType.XA_PREPARE, xid, args, branch.messages, _vote)
        except _Lost as exc:  # the server may have prepared: voting no makes it roll back
            raise RemoteUnavailable(
                f"{self._name}: no answer to the prepare of {xid} ({exc}); it rolls back"
            ) from exc
        self._confirmed(after)
        return vote

    def _ship(
        self,
        verb: FrameType,
        xid: Xid,
        args: dict[str, Value],
        messages: list[Message],
        decode: Callable[[Result], T],
    ) -> T:
        """``verb`` (a prepare or one-phase commit) with the branch's messages: in one request,
        or, past `SHARE_BYTES`, staged in shares first on the connection that then carries the
        verb with the last share (see the module docstring). `_Lost` when the verb's answer is
        not known; the server's error (it rolled the branch back) when it refused a share."""
        shares = split_by_size(messages, _share_size, SHARE_BYTES)
        if len(shares) == 1:
            return self._call(verb, xid, _with(args, shares[0]), decode, idempotent=False)
        conn = self._pool.acquire()
        try:
            for share in shares[:-1]:
                self._exchange(conn, FrameType.XA_START, xid, _with({"op": "stage"}, share),
                               _staged)  # fmt: skip
                crash_point("remote.mlog.after_share")
            result = self._exchange(conn, verb, xid, _with(args, shares[-1]), decode)
        except (_Unsent, _Lost) as exc:  # the connection is closed: the server drops the shares
            conn.close()
            raise _Lost(f"{verb.name} of a branch in {len(shares)} shares: {exc}") from exc
        except BaseException:
            self._pool.release(conn)  # an answer (a refusal): the connection is in step
            raise
        self._pool.release(conn)
        return result

    def _with_predecessors(self, args: dict[str, Value]) -> list[str]:
        """Name, in ``args["after"]``, the branches whose commit this client issued and has not
        seen confirmed, so the server commits any it still holds prepared before it takes this
        branch's messages: their decision is commit, and was made before this branch's
        transaction could begin. Without it, a commit lost with a log crash (or a broken
        connection) would be applied by recovery only after this branch's, and a producer's
        second transaction would be numbered before its first."""
        after = self._unconfirmed_commits()
        if after:
            args["after"] = list(after)
        return after

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        if not one_phase:
            if self._active(xid):
                raise ProgrammingError(f"{self._name}: commit of {xid} before it was prepared")
            return self._commit_prepared(self._check(xid))
        branch = self._take(xid)
        if branch.doomed is not None:
            raise BranchDoomed(f"{self._name}: {xid}: {branch.doomed}")
        if not branch.messages:
            return None
        args: dict[str, Value] = {"one_phase": True}
        after = self._with_predecessors(args)
        try:
            outcome = self._ship(FrameType.XA_COMMIT, xid, args, branch.messages, _outcome)
        except _Lost as exc:
            raise OutcomeUnknownError(
                f"{self._name}: no answer to the one-phase commit of {xid} ({exc}); it may have "
                "committed",
                gtrid=xid.gtrid,
            ) from exc
        self._confirmed(after)
        return outcome

    def rollback(self, xid: Xid) -> Outcome | None:
        if self._drop(xid) is not None:  # never shipped: the server has never heard of it
            return None
        return self._rollback_remote(xid)
