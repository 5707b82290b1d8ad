"""Sorting psycopg2's exceptions into what a two-phase branch must do about them.

Only three answers matter to the protocol: the server is unreachable (retry later, never guess),
the prepared transaction does not exist (ask the outcome marker what happened), and it is busy
(another session is finishing it right now; retry in a moment). Everything else is the branch's
own failure.
"""

from __future__ import annotations

import psycopg2
import psycopg2.errors
from sqlalchemy import exc as sa_exc

#: SQLSTATE classes 08 (connection exception) and 57P (operator intervention: shutdown, crash)
_UNREACHABLE_PREFIXES = ("08", "57P")


def unwrap(error: BaseException) -> BaseException:
    """The DBAPI exception behind a SQLAlchemy wrapper, or the error itself."""
    if isinstance(error, sa_exc.DBAPIError) and error.orig is not None:
        return error.orig
    return error


def is_unreachable(error: BaseException) -> bool:
    """The server or the connection went away: the statement's effect is unknown."""
    if isinstance(error, sa_exc.DBAPIError) and error.connection_invalidated:
        return True
    error = unwrap(error)
    if isinstance(error, psycopg2.errors.AdminShutdown | psycopg2.errors.CrashShutdown):
        return True
    code = getattr(error, "pgcode", None)
    if code is not None:
        return str(code).startswith(_UNREACHABLE_PREFIXES)
    return isinstance(error, psycopg2.OperationalError | psycopg2.InterfaceError)


def is_unknown_gid(error: BaseException) -> bool:
    """``prepared transaction with identifier ... does not exist`` (SQLSTATE 42704)."""
    return isinstance(unwrap(error), psycopg2.errors.UndefinedObject)


def is_busy(error: BaseException) -> bool:
    """``prepared transaction with identifier ... is busy`` (SQLSTATE 55006)."""
    return isinstance(unwrap(error), psycopg2.errors.ObjectInUse)


def is_not_preparable(error: BaseException) -> bool:
    """PREPARE refused what the branch did (temporary objects, LISTEN/NOTIFY, WITH HOLD)."""
    return isinstance(unwrap(error), psycopg2.errors.FeatureNotSupported)


def is_unique_violation(error: BaseException) -> bool:
    """A duplicate key (SQLSTATE 23505): for a last resource, recovery's abort row."""
    return isinstance(unwrap(error), psycopg2.errors.UniqueViolation)


def is_permission_denied(error: BaseException) -> bool:
    return isinstance(unwrap(error), psycopg2.errors.InsufficientPrivilege)


def is_retryable(error: BaseException) -> bool:
    """The server advises retrying the whole transaction, or never got to run it."""
    inner = unwrap(error)
    retry = psycopg2.errors.SerializationFailure | psycopg2.errors.DeadlockDetected
    return isinstance(inner, retry | psycopg2.errors.LockNotAvailable) or is_unreachable(error)


def describe(error: BaseException) -> str:
    """The server's own words, without SQLAlchemy's long wrapper text."""
    inner = unwrap(error)
    text = str(inner).strip() or type(inner).__name__
    return text.splitlines()[0] if isinstance(inner, psycopg2.Error) else text
