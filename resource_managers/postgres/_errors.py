"""Sorting the drivers' exceptions into what a two-phase branch must do about them.

Only three answers matter to the protocol: the server is unreachable (retry later, never guess),
the prepared transaction does not exist (ask the outcome marker what happened), and it is busy
(another session is finishing it right now; retry in a moment). Everything else is the branch's
own failure.

Both drivers are read by SQLSTATE (psycopg2's ``pgcode``, psycopg 3's ``sqlstate``), so one table
serves both; psycopg 3 is optional and only consulted when it is installed.
"""

from __future__ import annotations

import psycopg2
from sqlalchemy import exc as sa_exc

try:  # the optional driver: its connection errors carry no SQLSTATE either
    import psycopg

    _LOST: tuple[type[BaseException], ...] = (
        psycopg2.OperationalError,
        psycopg2.InterfaceError,
        psycopg.OperationalError,
        psycopg.InterfaceError,
    )
    _DRIVER_ERRORS: tuple[type[BaseException], ...] = (psycopg2.Error, psycopg.Error)
except ImportError:  # pragma: no cover - psycopg 3 not installed
    _LOST = (psycopg2.OperationalError, psycopg2.InterfaceError)
    _DRIVER_ERRORS = (psycopg2.Error,)

#: SQLSTATE classes 08 (connection exception) and 57P (operator intervention: shutdown, crash)
_UNREACHABLE_PREFIXES = ("08", "57P")
_UNDEFINED_OBJECT = "42704"
_OBJECT_IN_USE = "55006"
_FEATURE_NOT_SUPPORTED = "0A000"
_UNIQUE_VIOLATION = "23505"
_INVALID_TEXT = "22P02"
_INSUFFICIENT_PRIVILEGE = "42501"
#: serialization failure, deadlock, lock not available: the server advises a retry
_RETRYABLE = ("40001", "40P01", "55P03")


def unwrap(error: BaseException) -> BaseException:
    """The DBAPI exception behind a SQLAlchemy wrapper, or the error itself."""
    if isinstance(error, sa_exc.DBAPIError) and error.orig is not None:
        return error.orig
    return error


def sqlstate(error: BaseException) -> str | None:
    inner = unwrap(error)
    code = getattr(inner, "pgcode", None) or getattr(inner, "sqlstate", None)
    return str(code) if code else None


def is_unreachable(error: BaseException) -> bool:
    """The server or the connection went away: the statement's effect is unknown."""
    if isinstance(error, sa_exc.DBAPIError) and error.connection_invalidated:
        return True
    code = sqlstate(error)
    if code is not None:
        return code.startswith(_UNREACHABLE_PREFIXES)
    return isinstance(unwrap(error), _LOST)


def is_unknown_gid(error: BaseException) -> bool:
    """``prepared transaction with identifier ... does not exist`` (SQLSTATE 42704)."""
    return sqlstate(error) == _UNDEFINED_OBJECT


def is_busy(error: BaseException) -> bool:
    """``prepared transaction with identifier ... is busy`` (SQLSTATE 55006)."""
    return sqlstate(error) == _OBJECT_IN_USE


def is_not_preparable(error: BaseException) -> bool:
    """PREPARE refused what the branch did (temporary objects, LISTEN/NOTIFY, WITH HOLD)."""
    return sqlstate(error) == _FEATURE_NOT_SUPPORTED


def is_unique_violation(error: BaseException) -> bool:
    """A duplicate key (SQLSTATE 23505): for a last resource, recovery's abort row."""
    return sqlstate(error) == _UNIQUE_VIOLATION


def is_fenced_epoch(error: BaseException, text: str) -> bool:
    """SQLSTATE 22P02 naming ``text``: for a last resource, the node epoch check of a fenced
    incarnation (a cast of that text to an integer; a user's bad cast names its own value)."""
    return sqlstate(error) == _INVALID_TEXT and text in str(error)


def is_permission_denied(error: BaseException) -> bool:
    return sqlstate(error) == _INSUFFICIENT_PRIVILEGE


def is_retryable(error: BaseException) -> bool:
    """The server advises retrying the whole transaction, or never got to run it."""
    return sqlstate(error) in _RETRYABLE or is_unreachable(error)


def describe(error: BaseException) -> str:
    """The server's own words, without SQLAlchemy's long wrapper text."""
    inner = unwrap(error)
    text = str(inner).strip() or type(inner).__name__
    return text.splitlines()[0] if isinstance(inner, _DRIVER_ERRORS) else text
