"""`Session`: one JMS session's transactions, receipts and acknowledgments (see the package).

Why one module: the acknowledgment mode changes what receive, commit, recover and close each do,
so every section reads the session's one state (its transaction, its unacknowledged receipts, its
dups-ok batch); the subscriber and the types already live apart (`_subscriber`, `_types`).
"""

from __future__ import annotations

import contextvars
import logging
import time
import uuid
from collections import deque
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast, overload

from coordinator import (
    IllegalStateError,
    Outcome,
    ProgrammingError,
    Resource,
    Transaction,
    TransactionManager,
    TransactionRolledBack,
)
from coordinator.crashpoints import crash_point
from messaging.consumer import require_settled
from resource_managers.cursor import Delivery
from resource_managers.message_log import MessageOptions, SendKwargs, validate_destination

from ._subscriber import Subscriber, topic_verbs
from ._types import AckMode, ConsumerHandle, Handler, ProducerHandle, Received

if TYPE_CHECKING:  # Unpack is in typing from Python 3.11
    from typing_extensions import Unpack

log = logging.getLogger("twopc.session")

#: the longest a transaction the session begins only to wait for a message stays open: waiting
#: longer is done in several, so a long ``receive`` never runs into the manager's timeout
WAIT_SLICE = 5.0
DEFAULT_DUPS_OK_BATCH = 64


class Session:
    """Sends to ``log`` and receives from ``cursor`` (either may be None if unused) with the
    acknowledgment ``mode``; see the package docstring for what each mode promises.

    ``cursor``: a `CursorResource` or `messaging.remote.RemoteCursor`; ``log``: a
    `MessageLogResource` or `messaging.remote.RemoteMessageLog`. Both are registered with ``tm``
    so its recovery reaches their branches after a crash. ``client_id`` becomes the ``publisher``
    of every message sent (topic dispatch keeps each publisher's order). ``transaction_timeout``:
    of each transaction the session begins (None: the manager's default); a CLIENT or TRANSACTED
    session that holds its transaction longer finds it rolled back (the messages come back)."""

    def __init__(
        self,
        tm: TransactionManager,
        *,
        cursor: Resource[Any] | None = None,
        log: Resource[Any] | None = None,
        mode: AckMode | str = AckMode.AUTO,
        dups_ok_batch: int = DEFAULT_DUPS_OK_BATCH,
        client_id: str | None = None,
        transaction_timeout: float | None = None,
    ) -> None:
        if cursor is None and log is None:
            raise ProgrammingError("a session needs a cursor, a log or both")
        if isinstance(dups_ok_batch, bool) or not isinstance(dups_ok_batch, int):
            raise ProgrammingError(f"dups_ok_batch must be an int, not {dups_ok_batch!r}")
        if not 1 <= dups_ok_batch <= 10_000:
            raise ProgrammingError(f"dups_ok_batch must be 1-10000, not {dups_ok_batch}")
        if client_id is not None and not 0 < len(client_id) <= 200:
            raise ProgrammingError("client_id must be 1-200 characters")
        self.tm = tm
        try:
            self.mode = AckMode(mode)
        except ValueError:
            known = ", ".join(m.value for m in AckMode)
            raise ProgrammingError(
                f"unknown acknowledgment mode {mode!r}; one of {known}"
            ) from None
        self.dups_ok_batch = dups_ok_batch
        self.client_id = client_id
        self._tx_timeout = transaction_timeout
        self._cursor = cursor
        self._log = log
        for resource in (cursor, log):
            if resource is not None:
                tm.register(resource)
        self._tx: Transaction | None = None
        #: handed to the application in the open transaction, not yet acknowledged
        self._unacked: list[Delivery] = []
        #: DUPS_OK: taken by the open transaction, not yet handed out, per queue
        self._prefetched: dict[str, deque[Delivery]] = {}
        self._subscribers: list[Subscriber] = []
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._unacked)} unacknowledged"
        return f"<Session {self.mode.value} {state}>"

    @property
    def transacted(self) -> bool:
        """JMS's ``isTransacted``."""
        return self.mode is AckMode.TRANSACTED

    @property
    def unacknowledged(self) -> list[Received]:
        """What the session handed out that a crash now would bring back."""
        return [Received(d, self) for d in self._unacked]

    @property
    def transaction(self) -> Transaction:
        """``TRANSACTED`` only: the open transaction (begun now if none is), so the application
        can join its own resources (``session.transaction.join(pg)``) to the session's unit of
        work; `commit` then commits them with the session's receives and sends, atomically."""
        self._require(AckMode.TRANSACTED, action="have a transaction")
        return self._open()

    # -- producing -------------------------------------------------------------------------------

    @overload
    def send(
        self, destination: str, body: bytes, headers: dict[str, str] | None = None,
        **options: Unpack[MessageOptions],
    ) -> str: ...  # fmt: skip

    @overload
    def send(
        self, destination: list[str], body: bytes, headers: dict[str, str] | None = None,
        **options: Unpack[MessageOptions],
    ) -> list[str]: ...  # fmt: skip

    def send(
        self, destination: str | list[str], body: bytes, headers: dict[str, str] | None = None,
        **options: Unpack[MessageOptions],
    ) -> str | list[str]:  # fmt: skip
        """Send ``body`` to ``destination``, or one copy to each of a list (a distribution list,
        MSMQ; all copies or none); return the message id(s). ``options``: a branch's send
        options (`SendOptions`) but ``transactional`` and ``publisher``, which the session sets
        (its client id publishes).

        ``TRANSACTED``: staged in the open transaction, forwarded only if `commit` commits it.
        Otherwise a transaction of its own that has committed when this returns: for a persistent
        message the log has forced it to disk and accepted responsibility for it (JMS).
        If it fails this raises: `TransactionRolledBack`, nothing was sent; `OutcomeUnknownError`
        (a remote log that stopped answering during the commit), it may have been."""
        producer = self._producer_resource()
        sent: str | list[str]
        if self.mode is AckMode.TRANSACTED:  # a refused send stages nothing: the rest stands
            return self._stage(self._join(producer), destination, body, headers, True, options)
        tx = self._begin()
        try:
            sent = self._stage(tx.join(producer), destination, body, headers, False, options)
        except BaseException:
            tx.rollback()
            raise
        tx.commit()
        return sent

    def _stage(  # noqa: PLR0917 - a private step of `send`
        self,
        branch: ProducerHandle,
        destination: str | list[str],
        body: bytes,
        headers: dict[str, str] | None,
        transactional: bool,
        options: MessageOptions,
    ) -> str | list[str]:
        kwargs: SendKwargs = {**options, "transactional": transactional,
                              "publisher": self.client_id}  # fmt: skip
        if isinstance(destination, list):
            return branch.send_to_list(destination, body, headers, **kwargs)
        return branch.send(destination, body, headers, **kwargs)

    # -- consuming -------------------------------------------------------------------------------

    def receive(self, queue: str, timeout: float | None = 0.0) -> Received | None:
        """The next message of ``queue``, or None after ``timeout`` seconds without one (None:
        wait for ever). In ``AUTO`` this first acknowledges the message received before."""
        self._check_open()
        validate_destination(queue)
        if timeout is not None and not timeout >= 0:
            raise ProgrammingError("timeout must be >= 0 seconds or None")
        if self.mode is AckMode.AUTO:
            self._acknowledge_all()
        if self.mode is AckMode.DUPS_OK:
            return self._receive_prefetched(queue, timeout, self.dups_ok_batch)
        got = self._take(queue, 1, timeout)
        return self._hand_out(got[0]) if got else None

    def consume(
        self,
        queue: str,
        handler: Handler,
        *,
        max_messages: int | None = None,
        timeout: float | None = 0.0,
    ) -> int:
        """Receive from ``queue`` and call ``handler`` with each message until ``max_messages``
        were handled or none came within ``timeout`` seconds; return how many were handled.

        ``AUTO`` acknowledges each message when its handler returns, ``DUPS_OK`` each batch when
        the handler of its last message returns. ``CLIENT`` and ``TRANSACTED`` leave that to the
        application (`acknowledge`, `commit`), in the handler or after. A handler that raises:
        ``AUTO`` and ``DUPS_OK`` roll back what is unacknowledged (it comes back redelivered,
        and moves to the dead-letter queue after the cursor's ``max_deliveries``); in ``CLIENT``
        and ``TRANSACTED`` the application decides (`recover`, `rollback`). The error propagates.
        """
        if max_messages is not None and max_messages < 0:
            raise ProgrammingError("max_messages must be >= 0 or None")
        handled = 0
        while max_messages is None or handled < max_messages:
            left = None if max_messages is None else max_messages - handled
            received = self._next(queue, timeout, left)
            if received is None:
                break
            try:
                handler(received)
            except BaseException:
                if self.mode in (AckMode.AUTO, AckMode.DUPS_OK) and not self._closed:
                    self._roll_back("handler failed")
                raise
            crash_point(f"session.{self.mode.value}.after_handler")
            handled += 1
            if self.mode is AckMode.AUTO or (
                self.mode is AckMode.DUPS_OK and not self._prefetched_count()
            ):
                self._acknowledge_all()
        return handled

    def _next(self, queue: str, timeout: float | None, left: int | None) -> Received | None:
        """`receive`, with a DUPS_OK batch no larger than what `consume` still wants."""
        if self.mode is not AckMode.DUPS_OK:
            return self.receive(queue, timeout)
        self._check_open()
        validate_destination(queue)
        batch = self.dups_ok_batch if left is None else max(1, min(left, self.dups_ok_batch))
        return self._receive_prefetched(queue, timeout, batch)

    def _receive_prefetched(self, queue: str, timeout: float | None, batch: int) -> Received | None:
        """DUPS_OK: hand out the next prefetched message; once every one was handed out (the
        application is back for more, so it handled them), commit and take the next batch."""
        buffered = self._prefetched.get(queue)
        if not buffered:
            if not self._prefetched_count():
                self._acknowledge_all()
            got = self._take(queue, batch, timeout)
            if not got:
                return None
            buffered = self._prefetched.setdefault(queue, deque())
            buffered.extend(got)
        return self._hand_out(buffered.popleft())

    def _take(self, queue: str, n: int, timeout: float | None) -> list[Delivery]:
        """Take up to ``n`` messages into the open transaction (begun if none is). A transaction
        begun here that finds nothing in a slice of the wait is ended at once (an empty commit
        writes nothing), so waiting never holds a transaction open past `WAIT_SLICE`."""
        cursor = self._consumer_resource()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            fresh = self._tx is None
            branch = cast(ConsumerHandle, self._join(cursor))
            remaining = WAIT_SLICE if deadline is None else deadline - time.monotonic()
            try:
                got = branch.receive_many(queue, n, max(0.0, min(remaining, WAIT_SLICE)))
            except BaseException as exc:
                refused = isinstance(exc, ProgrammingError) and not isinstance(
                    exc, IllegalStateError
                )
                if refused and not fresh:  # the cursor refused the call: nothing happened
                    raise
                self._roll_back("receive failed")
                if fresh or isinstance(exc, TransactionRolledBack):
                    raise
                # the open transaction held other work (sends, receipts, joined resources): say
                # that all of it is gone, so no retry commits half of the unit of work
                raise TransactionRolledBack(
                    f"the session's transaction rolled back: a receive failed ({exc})",
                    reason="error",
                ) from exc
            if got:
                crash_point(f"session.{self.mode.value}.after_receive")
                return got
            if fresh:
                self._end(commit=True)
            if deadline is not None and time.monotonic() >= deadline:
                return []

    def _hand_out(self, delivery: Delivery) -> Received:
        self._unacked.append(delivery)
        return Received(delivery, self)

    def _prefetched_count(self) -> int:
        return sum(len(q) for q in self._prefetched.values())

    # -- topics ----------------------------------------------------------------------------------

    def subscriber(self, topic: str, name: str | None = None) -> Subscriber:
        """Subscribe to ``topic`` and attach: durable under ``name`` (the subscription keeps
        every publication while no subscriber is attached, and survives restarts, JMS), or
        non-durable without one (it lives while this subscriber is attached). Receive from it
        with `Subscriber.receive`/`consume`, acknowledged as this session's mode says."""
        self._check_open()
        verbs = topic_verbs(self._consumer_resource())
        durable = name is not None
        sub_name = name if name is not None else f"nd-{uuid.uuid4().hex[:16]}"
        subscription = verbs.subscribe(topic, sub_name, durable=durable)
        if durable:  # a non-durable subscription starts attached: its subscriber is this one
            subscription = verbs.attach(topic, sub_name)
        subscriber = Subscriber(self, verbs, subscription, self._subscribers.remove)
        self._subscribers.append(subscriber)
        return subscriber

    def unsubscribe(self, topic: str, name: str) -> int:
        """Delete the durable subscription ``name`` and the copies it holds (JMS's
        ``Session.unsubscribe``); the cursor refuses while copies of it are handed out."""
        self._check_open()
        return topic_verbs(self._consumer_resource()).unsubscribe(topic, name)

    # -- acknowledgment --------------------------------------------------------------------------

    def acknowledge(self) -> None:
        """Acknowledge every message this session handed out so far (JMS: acknowledging one
        acknowledges the session's). ``CLIENT``: commits the open transaction; if that fails the
        messages come back and this raises. ``AUTO``: acknowledges the last received message now.
        ``DUPS_OK``: lazy; acknowledges only once the whole batch was handed out."""
        self._check_open()
        if self.mode is AckMode.TRANSACTED:
            raise IllegalStateError("acknowledge in a transacted session: use commit()")
        if self.mode is AckMode.DUPS_OK and self._prefetched_count():
            return
        self._acknowledge_all()

    def recover(self) -> None:
        """Stop and restart delivery: every unacknowledged message comes back, redelivered
        (JMS's ``Session.recover``); in ``DUPS_OK`` the prefetched rest of the batch too."""
        self._check_open()
        if self.mode is AckMode.TRANSACTED:
            raise IllegalStateError("recover in a transacted session: use rollback()")
        self._roll_back("recover")

    def commit(self) -> None:
        """``TRANSACTED``: commit every receive, send and joined resource of the open transaction
        (two-phase when more than one resource joined). Raises `TransactionRolledBack` if it
        rolled back instead; either way the next operation begins a new transaction."""
        self._check_open()
        self._require(AckMode.TRANSACTED, action="commit")
        self._acknowledge_all()

    def rollback(self) -> None:
        """``TRANSACTED``: roll the open transaction back: received messages come back
        redelivered, sent ones are discarded, joined resources roll back."""
        self._check_open()
        self._require(AckMode.TRANSACTED, action="roll back")
        self._roll_back("rollback")

    def _acknowledge_all(self) -> None:
        """Commit the open transaction, if any: the acknowledgment of every mode."""
        if self._tx is None:
            return
        crash_point(f"session.{self.mode.value}.before_ack")
        self._end(commit=True)
        crash_point(f"session.{self.mode.value}.after_ack")

    def _roll_back(self, why: str) -> None:
        if self._tx is not None:
            log.debug("session %s: rolling back %s (%s)", self.mode.value, self._tx.gtrid, why)
            self._end(commit=False)

    def _end(self, *, commit: bool) -> None:
        """End the open transaction. The session forgets it first: whatever the outcome, the
        next operation must begin a new one (a failed commit has rolled back everything)."""
        tx, self._tx = self._tx, None
        self._unacked.clear()
        self._prefetched.clear()
        if tx is None:
            return
        if not tx.live:  # ended behind the session's back (the reaper, the application)
            if commit:
                _check_committed(tx)
            return
        if commit:
            tx.commit()
        else:
            tx.rollback()

    # -- transactions ----------------------------------------------------------------------------

    def _begin(self) -> Transaction:
        """A new transaction that is nobody's current one (see the package docstring). Not while
        an earlier one may still hold messages (a commit that timed out while the cursor was
        preparing, a rollback it never confirmed): receiving now would overtake them, so the
        manager settles first, or `UnsettledError` says nothing was done."""
        require_settled(self.tm)
        if self._tx_timeout is None:
            return contextvars.Context().run(self.tm.begin)
        return contextvars.Context().run(self.tm.begin, self._tx_timeout)

    def _join(self, resource: Resource[Any]) -> Any:
        """Join ``resource`` to the open transaction. A transaction that cannot take a branch
        (the reaper marked it, say) is rolled back and forgotten: the error reports it once."""
        tx = self._open()
        try:
            return tx.join(resource)
        except BaseException:
            self._roll_back("join failed")
            raise

    def _open(self) -> Transaction:
        """The open transaction, begun if there is none. One the application committed itself
        (``session.transaction.commit()``) is replaced; one that rolled back behind the session's
        back (the reaper's timeout) raises once: carrying on in a new one would let a later
        `commit` commit half of the application's unit of work."""
        self._check_open()
        tx = self._tx
        if tx is not None and not tx.live:
            self._tx = None
            self._unacked.clear()
            self._prefetched.clear()
            _check_committed(tx)
        if self._tx is None:
            self._tx = self._begin()
        return self._tx

    def _require(self, mode: AckMode, *, action: str) -> None:
        if self.mode is not mode:
            raise IllegalStateError(
                f"cannot {action} in a {self.mode.value} session: only a {mode.value} one can"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise IllegalStateError("the session is closed")

    def _consumer_resource(self) -> Resource[Any]:
        if self._cursor is None:
            raise ProgrammingError("this session has no cursor: it cannot receive")
        return self._cursor

    def _producer_resource(self) -> Resource[Any]:
        self._check_open()
        if self._log is None:
            raise ProgrammingError("this session has no message log: it cannot send")
        return self._log

    # -- closing ---------------------------------------------------------------------------------

    def close(self, *, acknowledge: bool = True) -> None:
        """End the session (idempotent). ``AUTO`` acknowledges the last message received
        (``acknowledge=False``: it comes back instead), as does ``DUPS_OK`` when its batch was
        all handed out; whatever else is unacknowledged or uncommitted (``CLIENT``, a partly
        handed-out batch, ``TRANSACTED``) rolls back and comes back redelivered. Non-durable
        subscriptions end with their subscribers; durable ones stay."""
        if self._closed:
            return
        try:
            keep = acknowledge and (
                self.mode is AckMode.AUTO
                or (self.mode is AckMode.DUPS_OK and not self._prefetched_count())
            )
            if keep:
                self._acknowledge_all()
            else:
                self._roll_back("close")
        finally:
            self._closed = True
            for subscriber in list(self._subscribers):
                try:
                    subscriber.close()
                except Exception as exc:  # the store is away: its restart detaches everyone
                    log.warning("session close: detaching %r failed: %s", subscriber, exc)

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """An exception in the block leaves the last message unacknowledged (it may not have
        been handled): it comes back, rather than be lost."""
        self.close(acknowledge=exc_type is None)


def _check_committed(tx: Transaction) -> None:
    """Raise if ``tx`` ended without committing (decided and handed off counts as committed)."""
    if tx.handed_off:
        return
    if tx.outcome is None or tx.outcome is Outcome.ROLLED_BACK:
        raise tx.rolled_back_error("the session's transaction rolled back")
