"""The server side of the remote resources: a message log's ``producer`` service and a cursor's
``consumer`` service, each a `messaging.connection.Listener` handler.

Why the state is per connection: a remote consumer's branch holds messages (handed out, counted)
on the server while its application works, and the application may die without a word. The only
thing the server learns then is that the connection ended; so every branch a connection started
and did not end (prepare, one-phase commit, rollback) is rolled back when that connection ends,
whatever the reason, and its messages become available to other consumers. A prepared branch is
not the connection's any more: it waits for its coordinator (commit, or rollback by recovery),
like a prepared branch of any resource.

Why a producer needs no ``XA_START`` as a rule: its branch is only staged messages, so the client
keeps them and ships them with ``XA_PREPARE`` (or a one-phase ``XA_COMMIT``); the branch starts
and ends inside that one request, and an abandoned transaction costs the server nothing. A
branch too large for one frame (a Spark partition's messages) goes in pieces: ``XA_START`` with
``op: "stage"`` and a share of the messages, as often as needed, then the prepare (or one-phase
commit) with the rest, all on one connection. The staged share is the connection's until then,
and is rolled back if the connection ends first.

One request at a time per connection, answered with its ``request_id``. A request of the wrong
shape (an argument key its verb does not take included: `protocol.PRODUCER_ARGS`,
`protocol.CONSUMER_ARGS`, `protocol.ADMIN_ARGS`) gets an error reply (``bad-request``) and the
connection goes on; only a bad frame
(`FrameError`, raised out of the handler) makes the listener drop the connection. The server's
own resources (`MessageLogResource`, `CursorResource`, one per branch name, made on demand)
enforce the XA rules; this module only maps verbs to them.

With an `Authoriser` (a server's clients file, `messaging.authz`) every request is judged by the
connected client's grants once its shape is checked and before it touches anything: the xid's
node, then what the verb names (`_grants`); ``XA_RECOVER`` and the administrative listings are
filtered to what the client may see. Without one nothing is judged (the shared secret admits).

Verbs (``rm`` is the resource name and must equal the xid's bqual):

======== =========================================== =========================================
producer args                                        result
======== =========================================== =========================================
START    ``rm, op: "stage", messages: [message]``    ``staged: n`` (messages held so far)
PREPARE  ``rm, messages: [message]``                 ``vote: "commit" | "read_only"``
COMMIT   ``rm, one_phase, messages`` (one-phase)     ``outcome: None | "heuristic-..."``
ROLLBACK ``rm``                                      ``outcome``
RECOVER  ``rm`` (no xid)                             ``xids: [gid]``
FORGET   ``rm``                                      ``{}``
RECOVER  ``rm, op: "stats"`` (no xid)                ``families`` (`messaging.metrics`)
======== =========================================== =========================================

======== =========================================== =========================================
consumer args                                        result
======== =========================================== =========================================
START    ``rm, op: "receive", destination, max,      ``deliveries: [delivery]``
         timeout: seconds | None``
PREPARE  ``rm, received: n``                         ``vote``
COMMIT   ``rm, one_phase, received`` (one-phase)     ``outcome``
ROLLBACK ``rm``                                      ``outcome``
RECOVER  ``rm`` (no xid)                             ``xids: [gid]``
FORGET   ``rm``                                      ``{}``
RECOVER  ``rm, op, ...`` (no xid): administration    see `admin` (subscriptions, dead letters)
======== =========================================== =========================================

``received`` is how many messages the client holds for the branch. If the server's branch holds
a different number (it was rolled back when an earlier connection dropped, or the server
restarted), the answer is ``branch-lost``: voting yes, or read-only, for a branch whose messages
were handed to someone else would deliver them twice or drop them.

Why one module: the verb table above is the contract of both services, and the request loop,
argument checks and authorisation hooks they share are read with it; the two services differ in a
few verbs each, which a reader compares side by side here.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from coordinator.errors import (
    FrameError,
    IllegalStateError,
    ProgrammingError,
    TransactionError,
)
from coordinator.resource import Outcome, Vote
from coordinator.xid import Xid, is_sub_branch_of
from messaging.authz import Authoriser
from messaging.clients import Client
from messaging.connection import INTERNAL_ERRORS, Connection
from messaging.frames import PACKED_VERSION, FrameType, Ping, Pong, Value, XaReply, XaRequest
from resource_managers.cursor import (
    DEFAULT_MAX_DELIVERIES,
    ConsumerBranch,
    Cursor,
    CursorResource,
)
from resource_managers.message_log import (
    Message,
    MessageLog,
    MessageLogResource,
    ProducerBranch,
    check_message,
)

from ._grants import authorise_consumer, authorise_producer, filter_admin_result
from ._packed import unpack
from .admin import CursorAdmin
from .protocol import (
    ADMIN_ARGS,
    CONSUMER_ARGS,
    CONSUMER_ROLE,
    MAX_RECEIVE_BATCH,
    MAX_RECEIVE_WAIT,
    PRODUCER_ARGS,
    PRODUCER_ROLE,
    STATS_OP,
    BadRequestError,
    BranchLost,
    arg_bool,
    arg_gids,
    arg_int,
    arg_list,
    arg_str,
    arg_timeout,
    check_arg_keys,
    delivery_to_value,
    error_reply,
    message_from_value,
    outcome_to_value,
    vote_to_value,
)

log = logging.getLogger("twopc.remote")

#: distinct branch names (``rm``) one service serves; each is a resource kept for good
MAX_RESOURCE_NAMES = 256

R = TypeVar("R", MessageLogResource, CursorResource)
Result = dict[str, Value]
#: the producer verbs that carry messages (`ProducerService._decode`)
_MESSAGE_VERBS = frozenset({FrameType.XA_START, FrameType.XA_PREPARE, FrameType.XA_COMMIT})


class Open(dict[Xid, Any]):
    """What one connection started and has not ended: xid -> the server-side branch handle. It
    also carries the connection, for requests whose effect lasts as long as it does (a
    subscriber's attachment, see `admin`); ``id()`` of it names the connection meanwhile."""

    def __init__(self, conn: Connection) -> None:
        super().__init__()
        self.conn = conn
        #: the clients-file entry the current request is judged by (None: no clients file)
        self.client: Client | None = None
        #: the current producer request's messages, decoded and checked once (`_decode`)
        self.messages: list[Message] = []
        #: the resource (``rm``) each branch was started on: a sub-branch's bqual (``mlog~t``)
        #: is not its resource's name, and only that resource holds the branch
        self.rm_of: dict[Xid, str] = {}

    def end(self, xid: Xid) -> str:
        """The branch is no longer this connection's (ended, prepared, or dropped): the name of
        the resource it was started on (its bqual if this connection never started it)."""
        self.pop(xid, None)
        return self.rm_of.pop(xid, xid.bqual)


class _Service(Generic[R]):
    """The verb loop shared by both services; subclasses map verbs to their resource."""

    role: str

    def __init__(self, authoriser: Authoriser | None = None) -> None:
        #: per-client grants (a clients file); None: every authenticated peer may do anything
        self.authoriser = authoriser
        self._lock = threading.Lock()
        self._resources: dict[str, R] = {}
        #: ``internal_errors``: requests that failed with a non-twopc exception (a defect)
        self.stats: Counter[str] = Counter()
        #: the server's metric families as a frame value, for the ``stats`` op (set by the server)
        self.stats_source: Callable[[], Value] | None = None

    def _make(self, name: str) -> R:
        raise NotImplementedError

    def resource(self, name: str) -> R:
        """The resource serving branch name ``name`` (made on first use)."""
        with self._lock:
            found = self._resources.get(name)
            if found is None:
                if len(self._resources) >= MAX_RESOURCE_NAMES:  # a client cannot grow us
                    raise BadRequestError(f"more than {MAX_RESOURCE_NAMES} branch names in use")
                found = self._resources[name] = self._make(name)
            return found

    def __call__(self, conn: Connection) -> None:
        opened = Open(conn)
        try:
            while True:
                frame = conn.recv()
                if frame is None:
                    return
                if isinstance(frame, Ping):
                    conn.send(Pong(frame.token))
                    continue
                if not isinstance(frame, XaRequest):
                    raise FrameError(
                        f"{type(frame).__name__} frame on a {self.role} connection",
                        what="type",
                    )
                self._reply(conn, frame, self._answer(frame, opened), opened)
        finally:
            self._abandon(opened)

    def _answer(self, request: XaRequest, opened: Open) -> XaReply:
        try:
            handler = self._verbs().get(request.verb)
            if handler is None:
                raise BadRequestError(f"{request.verb.name} is not a {self.role} verb")
            rm = arg_str(request.args, "rm")
            if request.verb == FrameType.XA_RECOVER:
                if request.xid is not None:
                    raise BadRequestError("XA_RECOVER takes no xid")
            elif request.xid is None:
                raise BadRequestError(f"{request.verb.name} needs an xid")
            elif request.xid.bqual != rm and not is_sub_branch_of(request.xid.bqual, rm):
                raise BadRequestError(f"rm {rm!r} is not the xid's branch {request.xid.bqual!r}")
            check_arg_keys(request.verb, request.args, self._arg_keys(request))
            self._decode(request, opened)
            if self.authoriser is not None:
                opened.client = self._authorise(self.authoriser, request, opened)
            result = handler(self.resource(rm), request.xid, request.args, opened)
        except Exception as exc:
            if not isinstance(exc, TransactionError):
                self.stats[INTERNAL_ERRORS] += 1
                log.exception("%s request %s failed", self.role, request.verb.name)
            self._refused(request, opened)
            return error_reply(request.request_id, exc)
        finally:
            opened.messages = []  # a request's own: not kept past it
        return XaReply(request.request_id, "ok", result)

    def _refused(self, request: XaRequest, opened: Open) -> None:
        """A request was refused: undo what the refusal leaves half done on this connection."""

    def _arg_keys(self, request: XaRequest) -> frozenset[str]:
        """The argument keys ``request``'s verb takes besides ``rm``."""
        raise NotImplementedError

    def _decode(self, request: XaRequest, opened: Open) -> None:
        """Decode what the role's verbs and its grants both read, once (the producer's
        messages), before either looks at it."""

    def _authorise(self, authoriser: Authoriser, request: XaRequest, opened: Open) -> Client:
        """Refuse (`UnauthorisedError`) what the client's grants do not cover, before anything
        is touched: a branch of a node it does not act for, then what the verb names."""
        client = authoriser.client(opened.conn.peer.id)
        if request.xid is not None:
            authoriser.check_node(client, request.xid)
        self._authorise_args(authoriser, client, request, opened)
        return client

    def _authorise_args(
        self, authoriser: Authoriser, client: Client, request: XaRequest, opened: Open
    ) -> None:
        """The role's own checks of a request's arguments (destinations)."""

    def _reply(self, conn: Connection, request: XaRequest, reply: XaReply, opened: Open) -> None:
        try:
            conn.send(reply)  # encodes before a byte is sent: a refusal leaves the stream intact
        except ProgrammingError as exc:  # the reply cannot be encoded (too large for a frame)
            conn.send(error_reply(request.request_id, self._unsendable(request, opened, exc)))

    def _unsendable(
        self, request: XaRequest, opened: Open, exc: ProgrammingError
    ) -> TransactionError:
        """A reply could not be encoded: undo what the request did that the client cannot know,
        and return the error to answer with instead."""
        return exc

    def _abandon(self, opened: Open) -> None:
        """The connection ended: roll back every branch it started and did not end."""
        for xid in list(opened):
            self._drop(xid, opened)

    def _drop(self, xid: Xid, opened: Open) -> None:
        rm = opened.end(xid)
        try:
            self.resource(rm).rollback(xid)
        except TransactionError as exc:
            log.error("rollback of abandoned branch %s failed: %s", xid, exc)
        except Exception:
            self.stats[INTERNAL_ERRORS] += 1
            log.exception("rollback of abandoned branch %s failed", xid)

    def _verbs(self) -> Mapping[FrameType, Callable[[R, Any, Mapping[str, Value], Open], Result]]:
        raise NotImplementedError

    # -- verbs both roles share --------------------------------------------------------------

    def _rollback(self, r: R, xid: Xid, args: Mapping[str, Value], opened: Open) -> Result:
        opened.end(xid)
        return {"outcome": outcome_to_value(r.rollback(xid))}

    def _recover(self, r: R, xid: None, args: Mapping[str, Value], opened: Open) -> Result:
        if args.get("op") == STATS_OP:
            return self._stats()
        if "op" in args:
            raise BadRequestError(f"the {self.role} service has no administrative ops but stats")
        found = r.recover()
        if self.authoriser is not None and opened.client is not None:
            found = self.authoriser.visible(opened.client, found)  # never another node's
        return {"xids": [x.to_gid() for x in found]}

    def _stats(self) -> Result:
        """The ``stats`` op, which both services answer: the server's metric families."""
        if self.stats_source is None:
            raise BadRequestError(f"this {self.role} service has no stats (not a twopc server)")
        return {"families": self.stats_source()}

    def _forget(self, r: R, xid: Xid, args: Mapping[str, Value], opened: Open) -> Result:
        r.forget(xid)
        return {}


class ProducerService(_Service[MessageLogResource]):
    """A message log's ``producer`` role: remote applications' branches (`RemoteMessageLog`)."""

    role = PRODUCER_ROLE

    def __init__(self, mlog: MessageLog, authoriser: Authoriser | None = None) -> None:
        super().__init__(authoriser)
        self.mlog = mlog

    def _authorise_args(
        self, authoriser: Authoriser, client: Client, request: XaRequest, opened: Open
    ) -> None:
        authorise_producer(authoriser, client, request, opened.messages)

    def _refused(self, request: XaRequest, opened: Open) -> None:
        """A refused stage, prepare or one-phase commit (a bad or unauthorised message among
        them, a broken packed run, no room) rolls back what this connection staged of its
        branch: the whole branch goes, never the refused part alone, so a client that tried
        again could not prepare the shares before it without the rest. A two-phase commit is
        among these verbs on purpose: a branch still in `opened` was never prepared."""
        xid = request.xid
        if request.verb in _MESSAGE_VERBS and xid is not None and xid in opened:
            self._drop(xid, opened)

    def _decode(self, request: XaRequest, opened: Open) -> None:
        """The request's messages, checked as `ProducerBranch.send` checks them (but for the
        size limit and the room, `_stage`'s): a list of maps, or from protocol version
        `PACKED_VERSION` a packed run (`_packed`)."""
        opened.messages = []
        if "messages" not in request.args or request.verb not in _MESSAGE_VERBS:
            return
        value = request.args["messages"]
        if isinstance(value, bytes):
            if opened.conn.version < PACKED_VERSION:
                raise BadRequestError(
                    f"packed messages need protocol version {PACKED_VERSION}; this connection "
                    f"speaks {opened.conn.version}"
                )
            opened.messages = unpack(value)
        else:
            opened.messages = [message_from_value(v) for v in arg_list(request.args, "messages")]

    def _make(self, name: str) -> MessageLogResource:
        return MessageLogResource(self.mlog, name)

    def _arg_keys(self, request: XaRequest) -> frozenset[str]:
        if request.verb == FrameType.XA_RECOVER and request.args.get("op") == STATS_OP:
            return ADMIN_ARGS[STATS_OP] | {"op"}
        return PRODUCER_ARGS[request.verb]

    def _verbs(
        self,
    ) -> Mapping[FrameType, Callable[[MessageLogResource, Any, Mapping[str, Value], Open], Result]]:
        return {
            FrameType.XA_START: self._stage_part,
            FrameType.XA_PREPARE: self._prepare,
            FrameType.XA_COMMIT: self._commit,
            FrameType.XA_ROLLBACK: self._rollback,
            FrameType.XA_RECOVER: self._recover,
            FrameType.XA_FORGET: self._forget,
        }

    def _stage_part(
        self, r: MessageLogResource, xid: Xid, args: Mapping[str, Value], opened: Open
    ) -> Result:
        """``XA_START op=stage``: a share of a large branch's messages, held for this connection
        until its prepare or one-phase commit brings the rest."""
        op = args.get("op")
        if op != "stage":
            raise BadRequestError(f"unknown producer XA_START op {op!r} (expected 'stage')")
        branch = self._staged(r, xid, args, opened)
        return {"staged": sum(branch.staged.values())}

    def _staged(
        self, r: MessageLogResource, xid: Xid, args: Mapping[str, Value], opened: Open
    ) -> ProducerBranch:
        """Start the branch (or take the one this connection staged a share of) and stage the
        request's messages, checked as `ProducerBranch.send` checks them (the size limit, the
        destination, its room); roll the whole branch back on any refusal."""
        if "messages" not in args:
            arg_list(args, "messages")  # refuses the request, as for any missing list
        messages = opened.messages
        branch = opened.get(xid)
        if branch is None:
            gid = xid.to_gid()
            if self.mlog.is_prepared(gid) or self.mlog.is_committed(gid):
                raise IllegalStateError(f"{r.name}: {gid} is already prepared or committed")
            branch = r.start(xid)
            opened[xid] = branch
            opened.rm_of[xid] = r.name
        try:
            self._stage(branch, messages)
        except BaseException:
            self._drop(xid, opened)
            raise
        return branch

    def _stage(self, branch: ProducerBranch, messages: list[Message]) -> None:
        """Stage the request's messages, all or none: each within the size limit, and each
        destination's room checked once for all it gets (as many one-message checks would
        judge them, since a refusal drops the whole branch anyway)."""
        limit = self.mlog.max_message_bytes
        for message in messages:
            check_message(message, max_bytes=limit)
        for destination, count in Counter(m.destination for m in messages).items():
            self.mlog.check_room(destination, branch.staged[destination] + count)
        branch.add(messages)

    def _prepare(
        self, r: MessageLogResource, xid: Xid, args: Mapping[str, Value], opened: Open
    ) -> Result:
        after = arg_gids(args, "after")
        self._staged(r, xid, args, opened)
        try:
            vote = r.prepare(xid, after=after)
        except BaseException:
            self._drop(xid, opened)  # a no vote: the coordinator rolls back all the same
            raise
        opened.end(xid)
        return {"vote": vote_to_value(vote)}

    def _commit(
        self, r: MessageLogResource, xid: Xid, args: Mapping[str, Value], opened: Open
    ) -> Result:
        if not arg_bool(args, "one_phase", False):
            if "messages" in args:
                raise BadRequestError("messages travel with a one-phase commit only")
            if "after" in args:
                raise BadRequestError("earlier branches travel with a prepare only")
            return {"outcome": outcome_to_value(r.commit(xid))}
        after = arg_gids(args, "after")
        self._staged(r, xid, args, opened)
        try:
            outcome: Outcome | None = r.commit(xid, one_phase=True, after=after)
        except BaseException:
            self._drop(xid, opened)
            raise
        opened.end(xid)
        return {"outcome": outcome_to_value(outcome)}


class ConsumerService(_Service[CursorResource]):
    """The ``consumer`` role of a cursor: remote applications' branches (`RemoteCursor`)."""

    role = CONSUMER_ROLE

    def __init__(
        self,
        cursor: Cursor,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        authoriser: Authoriser | None = None,
    ) -> None:
        super().__init__(authoriser)
        self.cursor = cursor
        self.max_deliveries = max_deliveries
        self.admin = CursorAdmin(cursor)

    def _authorise_args(
        self, authoriser: Authoriser, client: Client, request: XaRequest, opened: Open
    ) -> None:
        authorise_consumer(authoriser, client, request)

    def _make(self, name: str) -> CursorResource:
        return CursorResource(self.cursor, name, self.max_deliveries)

    def _arg_keys(self, request: XaRequest) -> frozenset[str]:
        op = request.args.get("op")
        if request.verb != FrameType.XA_RECOVER or op is None:
            return CONSUMER_ARGS[request.verb]
        if isinstance(op, str) and op in ADMIN_ARGS:
            return ADMIN_ARGS[op] | {"op"}
        return frozenset(request.args)  # an unknown op: the admin refuses it by name

    def _verbs(
        self,
    ) -> Mapping[FrameType, Callable[[CursorResource, Any, Mapping[str, Value], Open], Result]]:
        return {
            FrameType.XA_START: self._start,
            FrameType.XA_PREPARE: self._prepare,
            FrameType.XA_COMMIT: self._commit,
            FrameType.XA_ROLLBACK: self._rollback,
            FrameType.XA_RECOVER: self._recover_or_admin,
            FrameType.XA_FORGET: self._forget,
        }

    def _recover_or_admin(
        self, r: CursorResource, xid: None, args: Mapping[str, Value], opened: Open
    ) -> Result:
        if "op" not in args or args["op"] == STATS_OP:
            return self._recover(r, xid, args, opened)
        op = arg_str(args, "op")
        result = self.admin.answer(op, args, id(opened), opened.conn)
        if self.authoriser is not None and opened.client is not None:
            return filter_admin_result(opened.client, op, result)
        return result

    def _abandon(self, opened: Open) -> None:
        try:
            super()._abandon(opened)
        finally:
            self.admin.release(id(opened))

    def _start(
        self, r: CursorResource, xid: Xid, args: Mapping[str, Value], opened: Open
    ) -> Result:
        op = arg_str(args, "op")
        if op != "receive":
            raise BadRequestError(f"unknown XA_START op {op!r} (expected 'receive')")
        destination = arg_str(args, "destination")
        most = arg_int(args, "max", 1, MAX_RECEIVE_BATCH, 1)
        timeout = arg_timeout(args, "timeout")
        wait = MAX_RECEIVE_WAIT if timeout is None else min(timeout, MAX_RECEIVE_WAIT)
        branch: ConsumerBranch | None = opened.get(xid)
        if branch is None:
            branch = r.start(xid)
            opened[xid] = branch
            opened.rm_of[xid] = r.name
        got = branch.receive_many(destination, most, wait)
        return {"deliveries": [delivery_to_value(d) for d in got]}

    def _unsendable(
        self, request: XaRequest, opened: Open, exc: ProgrammingError
    ) -> TransactionError:
        if request.verb == FrameType.XA_RECOVER and request.args.get("op") == "dead_letters":
            return ProgrammingError(
                f"the dead letters do not fit in one frame ({exc.message}): list one queue at a "
                "time, or purge some"
            )
        # deliveries too large for one frame were handed to a branch the client cannot see
        if request.verb != FrameType.XA_START or request.xid is None:
            return exc
        self._drop(request.xid, opened)
        return BranchLost(
            f"the messages received do not fit in one frame ({exc.message}); the branch was "
            "rolled back: receive fewer at a time"
        )

    def _settle(self, xid: Xid, received: int, opened: Open) -> bool:
        """Check the client's count against the branch this connection holds; True if there is
        one. A mismatch rolls the branch back and raises `BranchLost`."""
        branch: ConsumerBranch | None = opened.get(xid)
        held = 0 if branch is None else len(branch.deliveries)
        if branch is not None and branch.closed:  # ended behind this connection's back
            self._drop(xid, opened)
            raise BranchLost(f"{xid.bqual}: {xid.to_gid()} was rolled back")
        if held != received:
            if branch is not None:
                self._drop(xid, opened)
            raise BranchLost(
                f"{xid.bqual}: the client received {received} messages in {xid.to_gid()}, this "
                f"connection's branch holds {held}; it was rolled back (a dropped connection or "
                "a server restart)"
            )
        return branch is not None

    def _prepare(
        self, r: CursorResource, xid: Xid, args: Mapping[str, Value], opened: Open
    ) -> Result:
        received = arg_int(args, "received", 0, 2**62)
        if not self._settle(xid, received, opened):
            return {"vote": vote_to_value(Vote.READ_ONLY)}
        try:
            vote = r.prepare(xid)
            if received and vote != Vote.COMMIT:
                raise BranchLost(f"{xid.bqual}: {xid.to_gid()} holds no messages any more")
        except BaseException:
            self._drop(xid, opened)
            raise
        opened.end(xid)
        return {"vote": vote_to_value(vote)}

    def _commit(
        self, r: CursorResource, xid: Xid, args: Mapping[str, Value], opened: Open
    ) -> Result:
        if not arg_bool(args, "one_phase", False):
            return {"outcome": outcome_to_value(r.commit(xid))}
        received = arg_int(args, "received", 0, 2**62)
        if not self._settle(xid, received, opened):
            return {"outcome": None}  # nothing received, nothing to commit
        try:
            outcome = r.commit(xid, one_phase=True)
        except BaseException:
            self._drop(xid, opened)
            raise
        opened.end(xid)
        return {"outcome": outcome_to_value(outcome)}


__all__ = ["ConsumerService", "ProducerService"]
