"""A durable file-backed account ledger that enlists as a resource manager: the demo's bank.

Small on purpose, but a real participant: prepare writes the branch's postings to their own file
and fsyncs it (and the directory) before voting, commit applies them with an atomic rename, and a
rollback leaves a tombstone so a late prepare of an aborted branch is refused. The PostgreSQL and
Redis resource managers replace it in the full demo.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from coordinator import Outcome, Vote, Xid


def _write_durably(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(data, sort_keys=True).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class Postings:
    """The branch handle: credits and debits buffered until prepare."""

    def __init__(self) -> None:
        self.changes: dict[str, int] = {}

    def credit(self, account: str, amount: int) -> None:
        self.changes[account] = self.changes.get(account, 0) + amount

    def debit(self, account: str, amount: int) -> None:
        self.credit(account, -amount)


class LedgerResource:
    def __init__(self, name: str, directory: str | Path) -> None:
        self.name = self.sort_key = name
        self.dir = Path(directory)
        (self.dir / "prepared").mkdir(parents=True, exist_ok=True)
        (self.dir / "done").mkdir(exist_ok=True)
        self._open: dict[Xid, Postings] = {}

    # -- reading ------------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        path = self.dir / "ledger.json"
        return json.loads(path.read_text()) if path.exists() else {"balances": {}, "committed": []}

    def balances(self) -> dict[str, int]:
        return dict(self._state()["balances"])

    def open_accounts(self, balances: dict[str, int]) -> None:
        _write_durably(self.dir / "ledger.json", {"balances": balances, "committed": []})

    def audit(self) -> dict[str, str]:
        """gtrid -> "committed" | "rolled-back" for every branch this ledger completed."""
        done = {p.name.rsplit(".", 1)[0]: "rolled-back" for p in (self.dir / "done").iterdir()}
        return done | {gtrid: "committed" for gtrid in self._state()["committed"]}

    # -- the resource contract ----------------------------------------------------------------

    def start(self, xid: Xid) -> Postings:
        return self._open.setdefault(xid, Postings())

    def prepare(self, xid: Xid) -> Vote:
        postings = self._open.pop(xid, Postings())
        if self._done(xid) == "rolled-back":
            raise RuntimeError(f"{xid} was rolled back by recovery; refusing a late prepare")
        if not postings.changes:
            return Vote.READ_ONLY
        balances = self.balances()
        if any(balances.get(a, 0) + d < 0 for a, d in postings.changes.items()):
            raise ValueError(f"{self.name}: insufficient funds for {postings.changes}")
        _write_durably(self._prepared(xid), postings.changes)
        return Vote.COMMIT

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        if one_phase:
            self._apply(xid, self._open.pop(xid, Postings()).changes)
            return None
        path = self._prepared(xid)
        if path.exists():
            self._apply(xid, json.loads(path.read_text()))
            path.unlink()
            return None
        return Outcome.HEURISTIC_ROLLBACK if self._done(xid) == "rolled-back" else None

    def rollback(self, xid: Xid) -> Outcome | None:
        self._open.pop(xid, None)
        if self._done(xid) == "committed":
            return Outcome.HEURISTIC_COMMIT
        self._mark(xid, "rolled-back")
        self._prepared(xid).unlink(missing_ok=True)
        return None

    def recover(self) -> list[Xid]:
        return [Xid.from_gid(p.stem) for p in (self.dir / "prepared").glob("*.json")]

    def forget(self, xid: Xid) -> None:
        """Nothing to drop: the rolled-back tombstone is the fence against a late prepare and
        stays, like every gid, used once."""

    # -- files --------------------------------------------------------------------------------

    def _apply(self, xid: Xid, changes: dict[str, int]) -> None:
        # Balances and the committed marker change in one atomic rename, so a crash can never
        # leave the money moved without the marker (which would apply it twice on recovery).
        state = self._state()
        if xid.gtrid in state["committed"]:
            return
        for account, delta in changes.items():
            state["balances"][account] = state["balances"].get(account, 0) + delta
        state["committed"].append(xid.gtrid)
        _write_durably(self.dir / "ledger.json", state)

    def _prepared(self, xid: Xid) -> Path:
        return self.dir / "prepared" / f"{xid.to_gid()}.json"

    def _done(self, xid: Xid) -> str | None:
        if xid.gtrid in self._state()["committed"]:
            return "committed"
        return "rolled-back" if (self.dir / "done" / f"{xid.gtrid}.rolled-back").exists() else None

    def _mark(self, xid: Xid, outcome: str) -> None:
        _write_durably(self.dir / "done" / f"{xid.gtrid}.{outcome}", outcome)
