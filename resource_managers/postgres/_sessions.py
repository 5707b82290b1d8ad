"""The `Session` a branch hands out, and the one hook it needs.

Registered once per Session class, never per engine or per session: an engine-level listener
slows every statement of every connection of the engine (the application's own too), and a
per-session one slows that session's every call. A branch finds itself in ``session.info``;
statements are seen by the branch's cursors (`_branch`), not by session hooks.
"""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from ._branch import Branch

BRANCH = "twopc.postgres.branch"
_watched: set[type[Session]] = set()
_watched_lock = threading.Lock()


class TwopcSession(Session):
    """The session a branch hands out by default: a `Session` whose class carries the hook."""


def default_session(connection: Connection) -> Session:
    return TwopcSession(bind=connection)


def watch(cls: type[Session]) -> None:
    if cls in _watched:
        return
    with _watched_lock:
        if cls not in _watched:
            event.listen(cls, "after_soft_rollback", _on_soft_rollback)
            _watched.add(cls)


def _on_soft_rollback(session: Session, previous: Any) -> None:
    # session.rollback() cannot undo our BEGIN's work (the connection is in autocommit mode as
    # far as SQLAlchemy knows), so a rollback of the session dooms the branch instead. Rolling
    # back to a savepoint (a nested transaction) undoes its work on the server.
    branch: Branch | None = session.info.get(BRANCH)
    if branch is None or getattr(previous, "nested", False) or branch.failure is not None:
        return
    branch.failure = "the session was rolled back"
    if branch.last_error:
        branch.failure += f" after: {branch.last_error}"
