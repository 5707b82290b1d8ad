"""Sorting redis-py's exceptions by who must act, and the errors a Redis branch raises.

Three answers matter: the server cannot be reached or is busy (`TransientError`: retry later,
never guess), it refuses our credentials or permissions (`ConfigurationError`: a person must fix
the client), and everything else, which is the caller's own mistake (a ``WRONGTYPE`` read) and is
raised as redis-py raised it. Messages name the server by host and port only: a connection URL
can carry a password.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from redis import exceptions as rex

from coordinator import (
    ConfigurationError,
    ProgrammingError,
    TransactionRolledBack,
    TransientError,
)

_ADMIN = (
    rex.AuthenticationError,
    rex.AuthenticationWrongNumberOfArgsError,
    rex.AuthorizationError,
    rex.NoPermissionError,
)
_UNREACHABLE = (rex.ConnectionError, rex.TimeoutError, rex.ClusterError, rex.ReadOnlyError)
#: replies that mean "not now": a long script, loading the AOF after a restart, no master
BUSY_PREFIXES = ("BUSY", "LOADING", "MASTERDOWN")


class BranchFailed(TransactionRolledBack):
    """The branch votes no; the message says why (a lock, a watched key, an invalid command)."""

    code = "redis-branch-failed"
    reason = "vote"


class BranchConflict(BranchFailed, TransientError):
    """Another transaction holds or changed a key the branch needs: a new attempt may succeed."""

    code = "redis-conflict"


class UnsupportedCommandError(ProgrammingError, AttributeError):
    """A redis-py command a branch does not offer (``branch.zunionstore(...)``); the message
    names it and lists those it does. An AttributeError too, so ``hasattr(branch, "zunionstore")``
    and ``getattr(branch, name, None)`` answer as for any missing attribute."""

    code = "redis-unsupported-command"


class DurabilityWarning(UserWarning):
    """``durability="relaxed"`` accepted a server that may lose a prepared branch in a crash."""


def where(client: Any, cluster: bool) -> str:
    """host:port (or the socket path) of the server, and nothing else."""
    try:
        if cluster:
            node = client.get_default_node()
            return f"cluster node {node.host}:{node.port}"
        kwargs = client.connection_pool.connection_kwargs
        if "path" in kwargs:
            return str(kwargs["path"])
        return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
    except Exception:
        return "(unknown address)"


@contextlib.contextmanager
def translated(name: str, server: str, doing: str) -> Iterator[None]:
    """Re-raise redis-py's errors as twopc's, saying which resource, which server and why."""
    try:
        yield
    except _ADMIN as exc:
        raise ConfigurationError(
            f"{name}: Redis at {server} refused authentication or permission while {doing}: "
            f"{exc}. Check the password (or ACL user and its permissions) the client was "
            "built with"
        ) from exc
    except rex.OutOfMemoryError as exc:
        raise TransientError(
            f"{name}: Redis at {server} is out of memory while {doing} (maxmemory with "
            f"noeviction): {exc}"
        ) from exc
    except _UNREACHABLE as exc:
        raise TransientError(
            f"{name}: cannot reach Redis at {server} while {doing}: {exc}"
        ) from exc
    except rex.ResponseError as exc:
        if str(exc).startswith(BUSY_PREFIXES):
            raise TransientError(f"{name}: Redis at {server} is busy while {doing}: {exc}") from exc
        raise
