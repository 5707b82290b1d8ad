"""The remote XA verbs' argument and result shapes, and the error codes, in one place.

Client (`client`) and server (`service`) must agree on every key and every code, and a mismatch
is not a cosmetic bug: an error that arrives as the wrong kind makes the coordinator do the wrong
thing (retry what it should abandon, or call rolled back what may have committed). So both sides
encode and decode through this module only, and decoding is strict: a value of the wrong shape is
a `BadRequestError` (server side; the connection goes on) or a broken reply (client side).

Errors travel as an `XaReply` whose ``status`` is the exception's ``code`` and whose result holds
``kinds``, the codes of its `TransactionError` ancestors, most specific first. The client rebuilds
the first code it knows (`error_from_reply`), so a server-side error this client has never heard of
still arrives as a `TransientError` or a `TransactionRolledBack` if it is one; only an error with no
known ancestor becomes a `RemoteError` (code ``remote-error``).

Wire shapes (maps of `messaging.frames.Value`):

- message: ``{id, destination, body, headers, persistent, expires_at}``
- delivery: ``{message, count, queue, reason}`` (``count`` 0 only for a dead letter never handed
  out: one a non-transactional queue rejected)
- subscription: ``{topic, name, durable, queue, connected, available, in_flight}``
- vote: ``"commit"`` | ``"read_only"`` | ``"rollback"``; outcome: None or an `Outcome` value

Why one module: it is the remote verbs' contract as code (the argument tables, their checks, the
error codes both ways and the value shapes above), which the client and the server both import;
kept whole so that a change to a verb's arguments and to their checking is one edit in one place.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

from coordinator.errors import (
    ConfigurationError,
    IllegalStateError,
    InvalidXidError,
    LogCorruptionError,
    LogError,
    LogWriteError,
    NoTransactionError,
    OutcomeUnknownError,
    ProgrammingError,
    TransactionError,
    TransactionRolledBack,
    TransactionTimedOut,
    TransientError,
)
from coordinator.resource import Outcome, Vote
from messaging.authz import UnauthorisedError
from messaging.frames import FrameType, Value, XaReply
from resource_managers.cursor import BranchRolledBack as CursorBranchRolledBack
from resource_managers.cursor import Delivery, Subscription
from resource_managers.message_log import (
    BranchRolledBack as LogBranchRolledBack,
)
from resource_managers.message_log import (
    DestinationFullError,
    InvalidMessageError,
    Message,
    check_message,
    new_message,
)

PRODUCER_ROLE = "producer"
CONSUMER_ROLE = "consumer"
#: the longest a consumer's receive waits on the server; a client wanting longer asks again
MAX_RECEIVE_WAIT = 30.0
#: the most messages one receive hands out
MAX_RECEIVE_BATCH = 10_000
#: the most message ids one replay or purge of dead letters names
MAX_ADMIN_IDS = 100_000

_NONE: frozenset[str] = frozenset()
#: the argument keys each verb takes besides ``rm``. Any other key is refused, as an unknown
#: frame field is: ignoring one (a misspelt ``one_phase``) could change what a request does.
PRODUCER_ARGS: dict[FrameType, frozenset[str]] = {
    FrameType.XA_START: frozenset({"op", "messages"}),  # op "stage": a share of a large branch
    FrameType.XA_PREPARE: frozenset({"messages", "after"}),
    FrameType.XA_COMMIT: frozenset({"one_phase", "messages", "after"}),
    FrameType.XA_ROLLBACK: _NONE,
    FrameType.XA_RECOVER: _NONE,
    FrameType.XA_FORGET: _NONE,
}
CONSUMER_ARGS: dict[FrameType, frozenset[str]] = {
    FrameType.XA_START: frozenset({"op", "destination", "max", "timeout"}),
    FrameType.XA_PREPARE: frozenset({"received"}),
    FrameType.XA_COMMIT: frozenset({"one_phase", "received"}),
    FrameType.XA_ROLLBACK: _NONE,
    FrameType.XA_RECOVER: _NONE,
    FrameType.XA_FORGET: _NONE,
}
#: the keys of each administrative op (an ``XA_RECOVER`` with ``op``), besides ``rm`` and ``op``
ADMIN_ARGS: dict[str, frozenset[str]] = {
    "subscribe": frozenset({"topic", "name", "durable"}),
    "unsubscribe": frozenset({"topic", "name"}),
    "subscriptions": frozenset({"topic"}),
    "attach": frozenset({"topic", "name"}),
    "detach": frozenset({"topic", "name"}),
    "dead_letters": frozenset({"queue"}),
    "replay_dead_letters": frozenset({"dlq", "ids"}),
    "purge_dead_letters": frozenset({"dlq", "ids"}),
    "set_transactional": frozenset({"queue", "transactional"}),
    "is_transactional": frozenset({"queue"}),
    "queues": frozenset(),
    "remove_message": frozenset({"queue", "id", "action", "why"}),
    "stats": frozenset(),
}
#: the op both services answer (the log's producer service has no other): the server's metrics
STATS_OP = "stats"


def check_arg_keys(verb: FrameType, args: Mapping[str, Value], allowed: frozenset[str]) -> None:
    """`BadRequestError` for a key of ``args`` that is neither ``rm`` nor in ``allowed``."""
    unknown = sorted(k for k in args if k != "rm" and k not in allowed)
    if unknown:
        raise BadRequestError(
            f"{verb.name} takes no argument {unknown[0][:80]!r} (it takes "
            f"{', '.join(sorted({'rm', *allowed}))})"
        )


class RemoteError(TransactionError):
    """The server answered with an error this client does not know (``remote_code`` says which),
    or broke the protocol. Not transient: nothing says a retry would help."""

    code = "remote-error"
    remote_code: str = ""


class BadRequestError(ProgrammingError):
    """The server refused a request's shape (bad argument types, unknown verb, wrong ``rm``)."""

    code = "bad-request"


class RemoteUnavailable(TransientError):
    """The server could not be reached, or the connection broke where nothing can have changed
    (or where what changed is undone by the server: a verb that is idempotent is safe to call
    again). The coordinator leaves a commit or rollback that raises this to recovery."""

    code = "remote-unavailable"


class BranchLost(TransactionRolledBack):
    """A consumer branch's connection broke (or the server restarted): the server rolled the
    branch back, so its messages are available again. Safe to retry the whole transaction."""

    code = "branch-lost"
    reason = "branch-lost"


#: every code a client rebuilds as its own class; anything else is a `RemoteError`
ERRORS: dict[str, type[TransactionError]] = {
    cls.code: cls
    for cls in (
        ProgrammingError,
        IllegalStateError,
        InvalidXidError,
        NoTransactionError,
        ConfigurationError,
        TransientError,
        TransactionRolledBack,
        TransactionTimedOut,
        OutcomeUnknownError,
        LogError,
        LogWriteError,
        LogCorruptionError,
        LogBranchRolledBack,
        DestinationFullError,
        InvalidMessageError,
        CursorBranchRolledBack,
        BadRequestError,
        RemoteUnavailable,
        BranchLost,
        RemoteError,
        UnauthorisedError,
    )
}


def error_reply(request_id: int, exc: BaseException) -> XaReply:
    """The reply that tells the client ``exc`` happened. Non-twopc exceptions are server bugs:
    ``internal-error`` with the exception's type, so the client learns nothing it should act on."""
    if not isinstance(exc, TransactionError):
        return XaReply(request_id, "internal-error", {}, f"{type(exc).__name__}: {exc}"[:2000])
    kinds = []
    for cls in type(exc).__mro__:
        code = getattr(cls, "code", None) if issubclass(cls, TransactionError) else None
        if isinstance(code, str) and code not in kinds:
            kinds.append(code)
    result: dict[str, Value] = {"kinds": kinds}
    if isinstance(exc, LogWriteError):
        result["durable"] = exc.durable
    reason = getattr(exc, "reason", None)
    if isinstance(exc, TransactionRolledBack) and isinstance(reason, str):
        result["reason"] = reason
    return XaReply(request_id, exc.code, result, (exc.message or str(exc))[:2000])


def error_from_reply(reply: XaReply) -> TransactionError:
    """The exception an error reply stands for (see the module docstring)."""
    kinds = reply.result.get("kinds")
    codes = (
        [reply.status, *(k for k in kinds if isinstance(k, str))]
        if isinstance(kinds, list)
        else [reply.status]
    )
    message = f"remote: {reply.message}" if reply.message else "remote error"
    details: dict[str, Any] = {"remote_code": reply.status}
    cls: type[TransactionError] = RemoteError
    for code in codes:
        if code in ERRORS:
            cls = ERRORS[code]
            break
    if issubclass(cls, LogWriteError):
        durable = reply.result.get("durable")
        details["durable"] = durable if isinstance(durable, bool) else None
    reason = reply.result.get("reason")
    if issubclass(cls, TransactionRolledBack) and isinstance(reason, str):
        details["reason"] = reason
    return cls(message, **details)


# -- argument checks (server side: a failure is a bad request, the connection goes on) ---------


def _bad(message: str) -> BadRequestError:
    return BadRequestError(message)


def arg_str(args: Mapping[str, Value], key: str) -> str:
    value = args.get(key)
    if not isinstance(value, str):
        raise _bad(f"argument {key!r} must be a string, not {type(value).__name__}")
    return value


def arg_bool(args: Mapping[str, Value], key: str, default: bool | None = None) -> bool:
    value = args.get(key, default)
    if not isinstance(value, bool):
        raise _bad(f"argument {key!r} must be a bool, not {type(value).__name__}")
    return value


def arg_int(
    args: Mapping[str, Value], key: str, low: int, high: int, default: int | None = None
) -> int:
    value = args.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _bad(f"argument {key!r} must be an integer in {low}..{high}, not {value!r}")
    return value


def arg_timeout(args: Mapping[str, Value], key: str) -> float | None:
    """A wait in seconds: a non-negative finite number, or None (no limit)."""
    value = args.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"argument {key!r} must be a number of seconds or None, not {value!r}")
    if not math.isfinite(value) or value < 0:
        raise _bad(f"argument {key!r} must be finite and >= 0, not {value!r}")
    return float(value)


def arg_list(args: Mapping[str, Value], key: str) -> Sequence[Value]:
    value = args.get(key)
    if not isinstance(value, list):
        raise _bad(f"argument {key!r} must be a list, not {type(value).__name__}")
    return value


def arg_opt_str(args: Mapping[str, Value], key: str) -> str | None:
    """A string, or None when absent or None."""
    return None if args.get(key) is None else arg_str(args, key)


def arg_ids(args: Mapping[str, Value], key: str) -> list[str] | None:
    """Message ids: a list of strings, or None (all of them). Bounded, since a client could
    otherwise make the server check millions of ids against a queue under its lock."""
    if args.get(key) is None:
        return None
    ids = arg_list(args, key)
    if len(ids) > MAX_ADMIN_IDS or not all(isinstance(i, str) for i in ids):
        raise _bad(f"argument {key!r} must be a list of at most {MAX_ADMIN_IDS} strings")
    return [i for i in ids if isinstance(i, str)]


def arg_gids(args: Mapping[str, Value], key: str) -> list[str]:
    """Branch ids (``Xid.to_gid`` form): a list of strings, empty when absent. Bounded like
    `arg_ids`; each is parsed where it is used."""
    if args.get(key) is None:
        return []
    gids = arg_list(args, key)
    if len(gids) > MAX_ADMIN_IDS or not all(isinstance(g, str) for g in gids):
        raise _bad(f"argument {key!r} must be a list of at most {MAX_ADMIN_IDS} branch ids")
    return [g for g in gids if isinstance(g, str)]


# -- messages and deliveries -------------------------------------------------------------------


def message_to_value(m: Message) -> dict[str, Value]:
    return {
        "id": m.message_id,
        "destination": m.destination,
        "body": m.body,
        "headers": dict(m.headers),
        "persistent": m.persistent,
        "expires_at": m.expires_at,
    }


def message_from_value(v: Value) -> Message:
    """A message, checked as `new_message` checks one (`InvalidMessageError` for bad content,
    `BadRequestError` for a wrong shape). The size limit is the receiver's to check."""
    if not isinstance(v, Mapping):
        raise _bad(f"a message must be a map, not {type(v).__name__}")
    if set(v) != {"id", "destination", "body", "headers", "persistent", "expires_at"}:
        raise _bad(f"a message has the keys id, destination, body, headers, persistent, "
                   f"expires_at; got {sorted(v)}")  # fmt: skip
    mid = v["id"]
    if not isinstance(mid, str):
        raise _bad("message id must be a string")
    expires = v["expires_at"]
    if expires is not None and (isinstance(expires, bool) or not isinstance(expires, int)):
        raise _bad("message expires_at must be an integer (ms) or None")
    persistent = v["persistent"]
    if not isinstance(persistent, bool):
        raise _bad("message persistent must be a bool")
    checked = new_message(
        v["destination"], body=v["body"], headers=v["headers"], persistent=persistent,
        ttl=None, now_ms=0,
    )  # fmt: skip
    return check_message(dataclasses.replace(checked, message_id=mid, expires_at=expires))


def delivery_to_value(d: Delivery) -> dict[str, Value]:
    return {
        "message": message_to_value(d.message),
        "count": d.delivery_count,
        "queue": d.queue,
        "reason": d.reason,
    }


def delivery_from_value(v: Value, *, least: int = 1) -> Delivery:
    """A delivery; ``least`` is the lowest count that makes sense (1 for a receive: this one
    counts; 0 for a dead letter, which may never have been handed out)."""
    if not isinstance(v, Mapping) or set(v) != {"message", "count", "queue", "reason"}:
        raise _bad("a delivery is a map of message, count, queue, reason")
    count, queue, reason = v["count"], v["queue"], v["reason"]
    if isinstance(count, bool) or not isinstance(count, int) or count < least:
        raise _bad(f"delivery count must be an integer >= {least}, not {count!r}")
    if not isinstance(queue, str) or not (reason is None or isinstance(reason, str)):
        raise _bad("delivery queue must be a string and reason a string or None")
    return Delivery(message_from_value(v["message"]), count, queue, reason)


# -- subscriptions -----------------------------------------------------------------------------

_SUBSCRIPTION_KEYS = {"topic", "name", "durable", "queue", "connected", "available", "in_flight"}


def subscription_to_value(s: Subscription) -> dict[str, Value]:
    return {
        "topic": s.topic,
        "name": s.name,
        "durable": s.durable,
        "queue": s.queue,
        "connected": s.connected,
        "available": s.available,
        "in_flight": s.in_flight,
    }


def subscription_from_value(v: Value) -> Subscription:
    if not isinstance(v, Mapping) or set(v) != _SUBSCRIPTION_KEYS:
        raise _bad(f"a subscription is a map of {', '.join(sorted(_SUBSCRIPTION_KEYS))}")
    topic, name, queue = v["topic"], v["name"], v["queue"]
    durable, connected = v["durable"], v["connected"]
    available, in_flight = v["available"], v["in_flight"]
    if not (isinstance(topic, str) and isinstance(name, str) and isinstance(queue, str)):
        raise _bad("a subscription's topic, name and queue must be strings")
    if not (isinstance(durable, bool) and isinstance(connected, bool)):
        raise _bad("a subscription's durable and connected must be bools")
    if not _count(available) or not _count(in_flight):
        raise _bad("a subscription's available and in_flight must be integers >= 0")
    return Subscription(
        topic=topic, name=name, durable=durable, queue=queue, connected=connected,
        available=available, in_flight=in_flight,
    )  # fmt: skip


def _count(v: Value) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# -- votes and outcomes ------------------------------------------------------------------------

_VOTES = {Vote.COMMIT: "commit", Vote.READ_ONLY: "read_only", Vote.ROLLBACK: "rollback"}
_VOTES_BACK = {text: vote for vote, text in _VOTES.items()}


def vote_to_value(vote: Vote) -> str:
    return _VOTES[vote]


def vote_from_value(v: Value) -> Vote:
    if not isinstance(v, str) or v not in _VOTES_BACK:
        raise _bad(f"not a vote: {v!r}")
    return _VOTES_BACK[v]


def outcome_to_value(outcome: Outcome | None) -> str | None:
    return None if outcome is None else outcome.value


def outcome_from_value(v: Value) -> Outcome | None:
    if v is None:
        return None
    if not isinstance(v, str):
        raise _bad(f"not an outcome: {v!r}")
    try:
        return Outcome(v)
    except ValueError:
        raise _bad(f"not an outcome: {v!r}") from None
