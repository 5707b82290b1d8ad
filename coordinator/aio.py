"""asyncio transactions over the one coordinator: `AsyncTransactionManager`.

    atm = AsyncTransactionManager(tm)            # tm: the usual TransactionManager
    async with atm.atransaction() as tx:
        session = await tx.join(pg)               # an AsyncSession
        branch = await tx.join(cache)             # an async Redis branch
        ...                                       # commit on a clean exit, rollback on an error

Why a wrapper and not a second coordinator: the protocol, the decision log, the crash points and
recovery stay one implementation. An async transaction *is* a `Transaction` begun by the wrapped
manager; only completion moves. ``commit`` and ``rollback`` run `Transaction.commit` /
`Transaction.rollback` (the same `_completion` code the threaded API runs) on a worker thread of
a small executor this object owns, so the decision log's fsync and every blocking wait stay off
the event loop. A branch's I/O still happens on the loop: an async resource's synchronous
``prepare``/``commit``/``rollback``, called by completion on that worker thread, hands its
coroutine to the loop with `on_loop` and waits for it there. The loop is free meanwhile, since
the task that committed only awaits the worker.

Why a wrapper and not ``TransactionManager.atransaction``: the wrapper owns the worker threads
(their number bounds how many commits run at once) and their shutdown, and the manager module
stays free of asyncio.

Cancellation: a task cancelled while its commit runs does not stop the commit. The completion is
shielded and awaited to its end (a further cancellation is absorbed the same way), then the
`asyncio.CancelledError` is raised again; the outcome itself is logged, since nobody is left to
hear it. A process that dies meanwhile leaves what any crash leaves, and recovery settles it:
there is no half-applied outcome to be had by cancelling.

Contexts: `TransactionManager.begin` keeps the current transaction in a context variable, which
asyncio copies into every task, so concurrent tasks each run their own transaction. A task
started *inside* a transaction block inherits that transaction as current and cannot begin one
of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, Protocol, TypeVar, runtime_checkable

from .backoff import ExponentialBackoff
from .errors import ProgrammingError, TransientError
from .manager import _UNSET, TransactionManager, _current
from .recovery import RecoveryReport
from .resource import Outcome, Resource
from .transaction import Transaction
from .xid import Xid, validate_resource_name

log = logging.getLogger("twopc.aio")

__all__ = ["AsyncResource", "AsyncTransaction", "AsyncTransactionManager", "on_loop"]

T = TypeVar("T")
H = TypeVar("H")
H_co = TypeVar("H_co", covariant=True)


@runtime_checkable
class AsyncResource(Resource[H_co], Protocol[H_co]):
    """A resource whose branches do their I/O on an event loop.

    ``open_branch`` runs on the loop before the transaction's ``join`` (which then calls the
    resource's ordinary ``start`` for the handle): it is where the branch's connection is taken,
    awaited rather than blocking. ``abandon_branch`` gives back what it took when the join
    fails after it. Every other verb is the synchronous `Resource` contract, called by completion
    on a worker thread; use `on_loop` there to run the branch's coroutines on its loop.
    """

    async def open_branch(self, xid: Xid) -> None: ...

    async def abandon_branch(self, xid: Xid) -> None: ...


def on_loop(
    loop: asyncio.AbstractEventLoop,
    work: Callable[[], Coroutine[Any, Any, T]],
    timeout: float | None,
    *,
    what: str,
) -> T:
    """Run ``work()`` on ``loop`` from another thread and wait for its result.

    For an async resource's synchronous verbs. Called on the loop's own thread it would wait
    for itself forever, so that is refused (`ProgrammingError`: use the async API). A loop that
    is closed raises `RuntimeError` before anything ran, so the caller may fall back to a
    synchronous connection. Past ``timeout`` the coroutine is cancelled and `TransientError`
    raised: the statement's effect is unknown, which every verb's caller (completion, recovery)
    already handles.
    """
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        raise ProgrammingError(
            f"{what} was called on the event loop's own thread, where it would wait for itself; "
            "complete async transactions through coordinator.aio (await tx.commit())"
        )
    if loop.is_closed() or not loop.is_running():
        raise RuntimeError(f"{what}: the event loop of the branch is not running")
    future = asyncio.run_coroutine_threadsafe(work(), loop)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError as exc:
        if future.done():  # the coroutine's own TimeoutError (the same class since 3.11)
            raise
        future.cancel()
        raise TransientError(f"{what} did not finish within {timeout} s on the event loop") from exc


class AsyncTransaction:
    """One transaction of an `AsyncTransactionManager`: the `Transaction` it wraps (``tx``)
    with awaitable ``join``, ``commit`` and ``rollback``."""

    def __init__(self, tx: Transaction, manager: AsyncTransactionManager) -> None:
        self.tx = tx
        self._manager = manager
        self._joining = asyncio.Lock()

    def __repr__(self) -> str:
        return f"<AsyncTransaction {self.tx!r}>"

    @property
    def gtrid(self) -> str:
        return self.tx.gtrid

    async def join(self, resource: Resource[H]) -> H:
        """Enlist ``resource`` and return its handle; joining twice returns the same handle.

        An `AsyncResource` opens its branch on the loop first. A synchronous resource joins on a
        worker thread (its ``start`` may block); its handle is then the blocking one it always
        was, and its prepare and commit run with the others on the completion's thread.
        """
        async with self._joining:  # two concurrent joins of one resource open one branch
            tx = self.tx
            if resource.name in tx.branches:
                return tx.join(resource)  # the same handle, or the error for a namesake
            opener = resource if isinstance(resource, AsyncResource) else None
            if opener is None:
                return await self._manager.off_loop(tx.join, resource)
            xid = Xid.branch_of(tx.gtrid, validate_resource_name(resource.name))
            await opener.open_branch(xid)
            try:
                return tx.join(resource)
            except BaseException:
                await opener.abandon_branch(xid)
                raise

    def set_rollback_only(self, reason: str = "application") -> None:
        self.tx.set_rollback_only(reason)

    async def commit(self) -> Outcome:
        """`Transaction.commit` on a worker thread; raises what it raises."""
        return await self._manager.complete(self.tx.commit)

    async def rollback(self) -> None:
        await self._manager.complete(self.tx.rollback)


class _AsyncBlock:
    """What `AsyncTransactionManager.atransaction` returns: an async context manager that
    commits on a clean exit and rolls back on any exception (cancellation included), which
    then propagates, as ``with tm.transaction()`` does."""

    __slots__ = ("_atx", "_kwargs", "_manager", "_timeout")

    def __init__(
        self, manager: AsyncTransactionManager, timeout: Any, kwargs: dict[str, Any]
    ) -> None:
        self._manager, self._timeout, self._kwargs = manager, timeout, kwargs
        self._atx: AsyncTransaction | None = None

    async def __aenter__(self) -> AsyncTransaction:
        self._atx = self._manager.begin(self._timeout, **self._kwargs)
        return self._atx

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        atx = self._atx
        assert atx is not None
        tx = atx.tx
        try:
            if exc_type is not None:
                if tx.live:
                    await atx.rollback()
                return  # the exception propagates
            if tx.reaped:
                raise tx.rolled_back_error("transaction rolled back by the reaper")
            if tx.live:
                await atx.commit()
        finally:
            if _current.get() is tx:
                _current.set(None)


class AsyncTransactionManager:
    """The asyncio face of a `TransactionManager` (see the module docstring).

    ``max_workers`` bounds the commits and rollbacks running at once: each holds a worker thread
    until its outcome, most of that time waiting for branch I/O on the loop. `aclose` stops the
    workers and closes the wrapped manager.
    """

    def __init__(self, manager: TransactionManager, *, max_workers: int = 32) -> None:
        if max_workers < 1:
            raise ProgrammingError("max_workers must be at least 1")
        self.manager = manager
        self._executor = ThreadPoolExecutor(max_workers, "twopc-aio")

    def begin(self, timeout: float | None = _UNSET, **kwargs: Any) -> AsyncTransaction:
        """Begin a transaction (no I/O: safe on the loop) and make it this task's current one."""
        return AsyncTransaction(self.manager.begin(timeout, **kwargs), self)

    def atransaction(self, timeout: float | None = _UNSET, **kwargs: Any) -> _AsyncBlock:
        """``async with atm.atransaction() as tx:`` commits on a clean exit, rolls back on an
        exception (re-raised). Keyword arguments are `TransactionManager.begin`'s."""
        return _AsyncBlock(self, timeout, kwargs)

    async def run(
        self,
        work: Callable[[AsyncTransaction], Awaitable[T]],
        *,
        tries: int = 3,
        timeout: float | None = _UNSET,
    ) -> T:
        """`TransactionManager.run` for coroutines: ``await work(tx)`` in a transaction, the
        whole of it retried on a transient error, each retry only once the failed attempt
        settled (waited for on a worker thread), never after an `OutcomeUnknownError`."""
        manager = self.manager
        backoff = ExponentialBackoff(base=0.05, cap=2.0)
        for attempt in range(1, tries + 1):
            atx: AsyncTransaction | None = None
            try:
                async with self.atransaction(timeout) as atx:
                    return await work(atx)
            except Exception as exc:
                tx = None if atx is None else atx.tx
                if attempt == tries or not manager._is_transient(exc, tx):
                    raise
                if tx is not None and not await self.off_loop(
                    manager.await_settled, tx, manager.settle_timeout
                ):
                    log.warning("%s did not settle in %.1fs; not retried", tx.gtrid,
                                manager.settle_timeout)  # fmt: skip
                    raise
                manager.metrics.incr("retries")
                await asyncio.sleep(backoff.compute(attempt))
        raise AssertionError("unreachable")

    async def recover(self, *, force: bool = False) -> RecoveryReport:
        """One recovery pass of the wrapped manager, on a worker thread."""
        return await self.off_loop(functools.partial(self.manager.recover, force=force))

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread, in a copy of this task's context."""
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        return await loop.run_in_executor(self._executor, context.run, fn, *args)

    async def complete(self, fn: Callable[[], T]) -> T:
        """``fn()`` (a commit or rollback) on a worker thread, to its end even if this task is
        cancelled meanwhile: the cancellation is re-raised once the outcome is known."""
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        future = loop.run_in_executor(self._executor, context.run, fn)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.done():
                await _outlast(future)
            raise

    async def aclose(self) -> None:
        """Wait for running completions, stop the workers, close the wrapped manager."""
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self) -> None:
        """`aclose` for a caller without a loop (never call it on the loop: it blocks)."""
        self._executor.shutdown(wait=True)
        self.manager.close()


async def _outlast(future: asyncio.Future[Any]) -> None:
    """Wait for ``future`` however often this task is cancelled; log how it ended."""
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            continue
        except BaseException:
            break
    error = future.exception() if not future.cancelled() else None
    if error is not None:
        log.warning("completion of a cancelled task ended with %r", error)
    else:
        log.info("completion of a cancelled task ended: %s", future.result())
