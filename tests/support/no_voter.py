"""A participant that votes no: every prepare raises ``error``. Its name sorts after the others,
so the branches under test prepare first."""

from __future__ import annotations

from coordinator import Vote, Xid


class NoVoter:
    def __init__(self, error: Exception, name: str = "zz-no") -> None:
        self.name = self.sort_key = name
        self._error = error

    def start(self, xid: Xid) -> None:
        return None

    def prepare(self, xid: Xid) -> Vote:
        raise self._error

    def commit(self, xid: Xid, one_phase: bool = False) -> None:
        return None

    def rollback(self, xid: Xid) -> None:
        return None

    def recover(self) -> list[Xid]:
        return []

    def forget(self, xid: Xid) -> None:
        return None
