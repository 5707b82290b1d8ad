"""What both remote resources share: the connection pool, the request loop, the idempotent verbs,
and what a broken connection means to each verb.

`RemoteMessageLog` and `RemoteCursor` implement the `Resource` protocol by speaking the XA verbs
(see `service` for the table) over authenticated framed connections. What needs care is what a
broken connection means, because the answer decides what the coordinator may conclude:

- **Nothing was sent** (the connection could not be made, or the send failed: the server cannot
  have read a whole frame): the call can be made again on a fresh connection, once.
- **Sent, no answer**: the server may have acted. Idempotent verbs (phase-two commit, rollback,
  recover, forget) are sent once more on a fresh connection, then raise `RemoteUnavailable` (a
  `TransientError`): the coordinator leaves the branch to recovery, which calls again; no outcome
  is made up. A prepare is not repeated: it raises, which votes no. A one-phase commit is not
  repeated either and raises `OutcomeUnknownError`: it may have committed.

`_exchange` tells the two apart (`_Unsent`, `_Lost`) and `_call` repeats what may be repeated;
the rest is each resource's to judge (`_remote_log`, `_remote_cursor`, whose consumer branches
pin one connection, and `_cursor_admin`).
"""

from __future__ import annotations

import itertools
import ssl
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from coordinator.crashpoints import crash_point
from coordinator.errors import FrameError, ProgrammingError
from coordinator.resource import Outcome
from coordinator.xid import Xid, branches_of
from messaging.auth import SharedSecret, TlsConfig
from messaging.connection import Address
from messaging.frames import FrameType, Value, XaReply, XaRequest
from resource_managers.bookkeeping import B, Branches

from ._commit_replies import CommitReplies
from ._loop_link import Link
from ._pool import _Pool
from ._replies import Result, _Bad, _gids, _outcome
from .protocol import RemoteUnavailable, error_from_reply

T = TypeVar("T")
_R = TypeVar("_R", bound="_RemoteResource[Any]")
#: a request's arguments besides ``rm``, or what makes them for a connection (its version)
Args = dict[str, Value] | Callable[[Link], dict[str, Value]]


class _Unsent(Exception):
    """The request never reached the server whole: nothing happened there."""


class _Lost(Exception):
    """The request was sent and no valid answer came: the server may have acted."""


class _RemoteResource(Branches[B]):
    """What both remote resources share: the pool, the request loop, the idempotent verbs."""

    _role: str

    def __init__(
        self,
        address: Address,
        secret: SharedSecret | None,
        *,
        name: str,
        client_id: str,
        tls: ssl.SSLContext | TlsConfig | None,
        server_hostname: str | None,
        timeout: float,
        sort_key: str | None,
        lazy_commit: bool,
    ) -> None:
        if not timeout > 0:
            raise ProgrammingError("timeout must be > 0 seconds")
        super().__init__(name, sort_key)
        self.timeout = timeout
        self._pool = _Pool(
            address, secret, client_id=client_id, role=self._role, tls=tls,
            server_hostname=server_hostname, timeout=timeout,
        )  # fmt: skip
        self._ids = itertools.count(1)
        self._replies = CommitReplies(
            self._name, timeout,
            read=lambda conn, request_id, left: self._answer(
                conn, request_id, "XA_COMMIT", left, _outcome
            ),
            release=self._pool.release, commit_again=self._commit_prepared,
        )  # fmt: skip
        self.lazy_commit = lazy_commit
        #: gids whose phase-two commit was issued here and not yet confirmed (answered, or seen
        #: gone by `recover`): a remote log's next prepare names them (`_remote_log`)
        self._unconfirmed: dict[str, None] = {}

    @property
    def address(self) -> Address:
        return self._pool.address

    def __repr__(self) -> str:
        host, port = self._pool.address
        return f"{type(self).__name__}({self._name!r}, '{host}:{port}')"

    def close(self) -> None:
        """Close the idle connections; branches in flight keep theirs until they end."""
        self._pool.close()

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one request -----------------------------------------------------------------------

    def _exchange(
        self,
        conn: Link,
        verb: FrameType,
        xid: Xid | None,
        args: Args,
        decode: Callable[[Result], T],
        *,
        wait: float = 0.0,
    ) -> T:
        """Send one request on ``conn`` and decode its answer. Raises `_Unsent`, `_Lost` (the
        connection is closed then: out of step, it cannot be trusted) or the server's error."""
        request_id = self._send(conn, verb, xid, args)
        return self._answer(conn, request_id, verb.name, wait + self.timeout, decode)

    def _send(self, conn: Link, verb: FrameType, xid: Xid | None, args: Args) -> int:
        """Send one request; its id. `_Unsent` (the connection closed) if it did not go. Args
        given as a function are made for ``conn`` (by its protocol version)."""
        if callable(args):
            args = args(conn)
        request = XaRequest(verb, next(self._ids), xid, {"rm": self._name, **args})
        try:
            conn.send(request)
        except OSError as exc:
            conn.close()
            raise _Unsent(str(exc)) from exc
        return request.request_id

    def _answer(
        self,
        conn: Link,
        request_id: int,
        verb: str,
        timeout: float,
        decode: Callable[[Result], T],
    ) -> T:
        """Read and decode the answer to request ``request_id``: `_Lost` (the connection closed,
        out of step) if none came, the server's error if it refused."""
        try:
            reply = conn.recv(timeout=timeout)  # TimeoutError is an OSError
        except (OSError, FrameError) as exc:
            conn.close()
            raise _Lost(f"{verb}: {exc!r}") from exc
        if not isinstance(reply, XaReply) or reply.request_id != request_id:
            conn.close()  # EOF (None), the server's refusal, or out of step
            raise _Lost(f"expected the reply to {verb}, got {reply!r}"[:300])
        if reply.status != "ok":
            raise error_from_reply(reply)  # an answer: the connection is still in step
        try:
            return decode(reply.result)
        except (_Bad, KeyError) as exc:
            conn.close()
            raise _Lost(f"malformed reply to {verb}: {exc!r}") from exc

    def _call(
        self,
        verb: FrameType,
        xid: Xid | None,
        args: Args,
        decode: Callable[[Result], T],
        *,
        idempotent: bool,
    ) -> T:
        """One request on a pooled connection. Nothing sent: one more try. Sent and lost: one
        more try if ``idempotent``, else `_Lost` for the caller to judge."""
        for attempt in (1, 2):
            conn = self._pool.acquire()
            try:
                result = self._exchange(conn, verb, xid, args, decode)
            except _Unsent as exc:
                if attempt == 2:
                    raise RemoteUnavailable(f"{self._name}: {verb.name} not sent: {exc}") from exc
                continue
            except _Lost as exc:
                if not idempotent:
                    raise
                if attempt == 2:
                    raise RemoteUnavailable(
                        f"{self._name}: no answer to {verb.name} ({exc}); recovery will ask again"
                    ) from exc
                continue
            except BaseException:
                self._pool.release(conn)
                raise
            self._pool.release(conn)
            return result
        raise AssertionError("unreachable")

    # -- the idempotent verbs --------------------------------------------------------------

    def _commit_prepared(self, xid: Xid) -> Outcome | None:
        gid = self._issued(xid)
        outcome = self._call(
            FrameType.XA_COMMIT, xid, {"one_phase": False}, _outcome, idempotent=True
        )
        self._confirmed([gid])
        return outcome

    # -- commits issued and not yet confirmed ------------------------------------------------

    def _issued(self, xid: Xid) -> str:
        """Phase two is about to ask the server to commit ``xid``: its decision is commit."""
        gid = xid.to_gid()
        with self._lock:
            self._unconfirmed[gid] = None
        return gid

    def _confirmed(self, gids: Iterable[str]) -> None:
        with self._lock:
            for gid in gids:
                self._unconfirmed.pop(gid, None)

    def _unconfirmed_commits(self) -> list[str]:
        with self._lock:
            return list(self._unconfirmed)

    def commit_lazily(self, xid: Xid, on_durable: Callable[[], None]) -> Outcome | None:
        """Phase two's commit without waiting for the answer (`coordinator.lazy_commit`): sent,
        and answered on `CommitReplies`' thread, which runs ``on_durable`` once the server said
        committed. A request that cannot be sent is made the ordinary way, here, as is every
        commit with ``lazy_commit=False`` (then a lost answer reaches the caller as
        `CompletionPending`; lazily, only the log and recovery hear of it)."""
        self._check(xid)
        if self._active(xid):
            raise ProgrammingError(f"{self._name}: commit of {xid} before it was prepared")
        if not self.lazy_commit:
            outcome = self._commit_prepared(xid)
            on_durable()
            return outcome
        gid = self._issued(xid)
        conn = self._pool.acquire()
        try:
            request_id = self._send(conn, FrameType.XA_COMMIT, xid, {"one_phase": False})
        except _Unsent:
            outcome = self._commit_prepared(xid)
            on_durable()
            return outcome

        def durable() -> None:
            self._confirmed([gid])
            on_durable()

        self._replies.expect(conn, request_id, xid, durable)
        crash_point(f"remote.{self._name}.commit_sent")
        return None

    def flush_commits(self) -> None:
        """Return once every commit answer expected so far was handled (manager close)."""
        self._replies.flush()

    def _rollback_remote(self, xid: Xid) -> Outcome | None:
        return self._call(FrameType.XA_ROLLBACK, xid, {}, _outcome, idempotent=True)

    def recover(self) -> list[Xid]:
        issued = set(self._unconfirmed_commits())  # before listing: what is not listed is done
        gids = self._call(FrameType.XA_RECOVER, None, {}, _gids, idempotent=True)
        self._confirmed(issued.difference(gids))
        return branches_of(gids, self._name, sub_branches=True)

    def forget(self, xid: Xid) -> None:
        self._call(FrameType.XA_FORGET, self._check(xid), {}, lambda r: None, idempotent=True)

    def server_stats(self) -> Value:
        """The server's metric families (the ``stats`` op, which a log's and a cursor's
        services both answer) as the frame value; `messaging.metrics.from_value` reads it."""
        return self._call(
            FrameType.XA_RECOVER, None, {"op": "stats"}, lambda r: r["families"], idempotent=True
        )
