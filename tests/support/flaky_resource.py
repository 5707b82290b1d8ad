"""`FlakyResource`: wraps any resource and makes chosen calls fail or stall.

A server that is down, one that comes back, a prepare that hangs past the transaction's timeout,
an operator who acts at just the wrong moment: each is one option here, so a test states the fault
in a line and the resource underneath stays honest.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from coordinator.resource import Outcome, Resource, Vote
from coordinator.xid import Xid

CALLS = frozenset({"start", "prepare", "commit", "rollback", "recover", "forget"})


def _unreachable(resource: str, call: str) -> Exception:
    return ConnectionRefusedError(f"{resource}: {call} failed: server unreachable (injected)")


class FlakyResource:
    """Wraps a resource; chosen calls fail, stall, or run a callback first.

    ``fail_on``: calls that raise ``error(name, call)`` without reaching the inner resource; a
    mutable set, so a test can bring the server back. ``stall``: seconds a call sleeps before it
    runs (cut short by `release`), e.g. a prepare that hangs past the transaction timeout.
    ``before``: a callback given the xid before the call runs (an operator acting at just the
    wrong moment, or a barrier). `finished` counts calls that returned or raised.
    """

    def __init__(
        self,
        inner: Resource,
        *,
        fail_on: Iterable[str] = (),
        stall: Mapping[str, float] | None = None,
        before: Mapping[str, Callable[[Xid], None]] | None = None,
        error: Callable[[str, str], Exception] = _unreachable,
    ) -> None:
        self.fail_on = set(fail_on)
        self.stall = dict(stall or {})
        self.before = dict(before or {})
        unknown = (self.fail_on | set(self.stall) | set(self.before)) - CALLS
        if unknown:
            raise ValueError(f"unknown calls {sorted(unknown)}; expected some of {sorted(CALLS)}")
        self.inner = inner
        self.error = error
        self.calls: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()
        self._released = threading.Event()
        self._changed = threading.Condition()

    @classmethod
    def down(cls, inner: Resource) -> FlakyResource:
        """A resource whose every call fails."""
        return cls(inner, fail_on=CALLS)

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def sort_key(self) -> str:
        return self.inner.sort_key

    def release(self) -> None:
        """End every stall now and from now on."""
        self._released.set()

    def wait_finished(self, call: str, count: int = 1, timeout: float = 10.0) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.finished[call] >= count, timeout)

    def _call(self, call: str, xid: Xid | None, run: Callable[[], Any]) -> Any:
        self.calls[call] += 1
        try:
            delay = self.stall.get(call)
            if delay:
                self._released.wait(delay)
            hook = self.before.get(call)
            if hook is not None and xid is not None:
                hook(xid)
            if call in self.fail_on:
                raise self.error(self.name, call)
            return run()
        finally:
            with self._changed:
                self.finished[call] += 1
                self._changed.notify_all()

    def start(self, xid: Xid) -> Any:
        return self._call("start", xid, lambda: self.inner.start(xid))

    def prepare(self, xid: Xid) -> Vote:
        result: Vote = self._call("prepare", xid, lambda: self.inner.prepare(xid))
        return result

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        result: Outcome | None = self._call(
            "commit", xid, lambda: self.inner.commit(xid, one_phase)
        )
        return result

    def rollback(self, xid: Xid) -> Outcome | None:
        result: Outcome | None = self._call("rollback", xid, lambda: self.inner.rollback(xid))
        return result

    def recover(self) -> list[Xid]:
        result: list[Xid] = self._call("recover", None, self.inner.recover)
        return result

    def forget(self, xid: Xid) -> None:
        self._call("forget", xid, lambda: self.inner.forget(xid))
