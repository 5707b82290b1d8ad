"""`coordinator.aio` without servers: where each step runs (the decision off the loop, an async
branch's verbs on it), commit and rollback with file resources, a no vote, cancellation
mid-commit, `on_loop`'s refusals, and `run`'s retries."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from coordinator import (
    FileDecisionLog,
    Outcome,
    OutcomeUnknownError,
    ProgrammingError,
    TransactionRolledBack,
    TransientError,
    Vote,
    Xid,
    crashpoints,
)
from coordinator.aio import AsyncResource, AsyncTransactionManager, on_loop
from tests.support.file_resource import FileResource
from tests.support.hold_at import held_at
from tests.support.managers import make_manager
from tests.support.no_voter import NoVoter


class LoopStore:
    """An async resource over a dict: every verb runs its coroutine on the branch's loop and
    notes the thread it ran on."""

    def __init__(self, name: str = "mem") -> None:
        self.name = self.sort_key = name
        self.data: dict[str, int] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.staged: dict[Xid, dict[str, int]] = {}
        self.threads: dict[str, int] = {}

    async def open_branch(self, xid: Xid) -> None:
        self.loop = asyncio.get_running_loop()
        self.staged[xid] = {}

    async def abandon_branch(self, xid: Xid) -> None:
        self.staged.pop(xid, None)

    def start(self, xid: Xid) -> dict[str, int]:
        return self.staged[xid]

    def _on_loop(self, verb: str, result: Any) -> Any:
        async def work() -> Any:
            await asyncio.sleep(0)
            self.threads[verb] = threading.get_ident()
            return result

        assert self.loop is not None
        return on_loop(self.loop, work, 5, what=verb)

    def prepare(self, xid: Xid) -> Vote:
        return self._on_loop("prepare", Vote.COMMIT)  # type: ignore[no-any-return]

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        self._on_loop("commit", None)
        self.data.update(self.staged.pop(xid, {}))
        return None

    def rollback(self, xid: Xid) -> Outcome | None:
        self.staged.pop(xid, None)
        return None

    def recover(self) -> list[Xid]:
        return []

    def forget(self, xid: Xid) -> None:
        return None


def atm_over(managers: list[Any], tmp_path: Path, *resources: Any) -> AsyncTransactionManager:
    tm = make_manager(managers, list(resources), FileDecisionLog(tmp_path / "log"))
    return AsyncTransactionManager(tm, max_workers=2)


def test_the_decision_is_forced_off_the_loop_and_branch_io_runs_on_it(
    tmp_path: Path, managers: list[Any]
) -> None:
    store, ledger = LoopStore(), FileResource("ledger", tmp_path / "ledger")
    atm = atm_over(managers, tmp_path, store, ledger)
    assert isinstance(store, AsyncResource) and not isinstance(ledger, AsyncResource)
    decided: list[int] = []

    def note(point: str) -> None:
        if point == "tm.after_decision_fsync":
            decided.append(threading.get_ident())

    async def main() -> int:
        async with atm.atransaction() as tx:
            (await tx.join(store))["k"] = 1
            (await tx.join(ledger)).add("n", 5)
        return threading.get_ident()

    crashpoints.observe(note)
    try:
        loop_thread = asyncio.run(main())
    finally:
        crashpoints._observers.remove(note)
    assert store.data == {"k": 1} and ledger.snapshot()["n"] == 5
    assert decided and decided[0] != loop_thread
    assert store.threads == {"prepare": loop_thread, "commit": loop_thread}


def test_exception_and_no_vote_roll_back(tmp_path: Path, managers: list[Any]) -> None:
    store, ledger = LoopStore(), FileResource("ledger", tmp_path / "ledger")
    atm = atm_over(managers, tmp_path, store, ledger, NoVoter(RuntimeError("no")))

    async def main() -> None:
        with pytest.raises(KeyError):
            async with atm.atransaction() as tx:
                (await tx.join(ledger)).add("n", 1)
                raise KeyError("boom")
        with pytest.raises(TransactionRolledBack):
            async with atm.atransaction() as tx:
                (await tx.join(store))["k"] = 1
                (await tx.join(ledger)).add("n", 1)
                await tx.join(atm.manager.resource("zz-no"))

    asyncio.run(main())
    assert store.data == {} and "n" not in ledger.snapshot()


def test_cancelled_mid_commit_reaches_its_outcome(tmp_path: Path, managers: list[Any]) -> None:
    ledger, other = FileResource("a", tmp_path / "a"), FileResource("b", tmp_path / "b")
    atm = atm_over(managers, tmp_path, ledger, other)

    async def main(decided: threading.Event, go_on: threading.Event) -> None:
        async def transfer() -> None:
            async with atm.atransaction() as tx:
                (await tx.join(ledger)).add("n", -3)
                (await tx.join(other)).add("n", 3)

        task = asyncio.create_task(transfer())
        await asyncio.to_thread(decided.wait, 10)
        task.cancel()
        await asyncio.sleep(0.05)
        task.cancel()  # a second cancellation is absorbed the same way
        await asyncio.sleep(0.05)
        assert not task.done()
        go_on.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    with held_at("tm.after_decision_fsync") as (decided, go_on):
        asyncio.run(main(decided, go_on))
    assert ledger.snapshot()["n"] == -3 and other.snapshot()["n"] == 3


def test_on_loop_refuses_its_own_thread_a_stopped_loop_and_a_slow_answer() -> None:
    async def slow() -> None:
        await asyncio.sleep(5)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with pytest.raises(ProgrammingError, match="wait for itself"):
            on_loop(loop, slow, 1, what="x")
        with pytest.raises(TransientError, match="did not finish"):
            await asyncio.to_thread(on_loop, loop, slow, 0.05, what="x")

        async def times_out_itself() -> None:
            raise TimeoutError("the branch's own statement timeout")

        # the coroutine's TimeoutError is its answer, not on_loop's wait running out
        with pytest.raises(TimeoutError, match="statement timeout"):
            await asyncio.to_thread(on_loop, loop, times_out_itself, 5, what="x")

    asyncio.run(main())
    stopped = asyncio.new_event_loop()
    try:
        with pytest.raises(RuntimeError, match="not running"):
            on_loop(stopped, slow, 1, what="x")
    finally:
        stopped.close()


def test_run_retries_a_transient_failure_once_settled_and_never_an_unknown_outcome(
    tmp_path: Path, managers: list[Any]
) -> None:
    store = LoopStore()
    atm = atm_over(managers, tmp_path, store)
    attempts: list[str] = []

    async def flaky(tx: Any) -> str:
        (await tx.join(store))["k"] = len(attempts)
        attempts.append(tx.gtrid)
        if len(attempts) == 1:
            raise TransientError("a serialization conflict, say")
        return tx.gtrid

    async def unknown(tx: Any) -> None:
        attempts.append(tx.gtrid)
        raise OutcomeUnknownError("it may have committed", gtrid=tx.gtrid)

    async def main() -> None:
        assert await atm.run(flaky, tries=3) == attempts[-1]
        assert len(attempts) == 2 and attempts[0] != attempts[1]  # a new transaction each time
        attempts.clear()
        with pytest.raises(OutcomeUnknownError):
            await atm.run(unknown, tries=3)
        assert len(attempts) == 1

    asyncio.run(main())
    assert store.data == {"k": 1}  # only the second attempt committed
