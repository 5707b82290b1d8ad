"""`StagingBranch`: what a producer branch does before prepare, wherever its log is: check each
message as it is sent and stage it, so that a refusal is raised at the send that caused it and
never reaches prepare. `ProducerBranch` (a local log) and `messaging.remote.RemoteProducerBranch`
(a served one) differ only in their clock, their size limit and where the room is checked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from coordinator import IllegalStateError, TransactionRolledBack, Xid, tracing

from ._base import DestinationFullError
from ._options import SendKwargs, SendOptions
from ._records import Message
from ._validation import InvalidMessageError, copies_with_bodies, outgoing

if TYPE_CHECKING:  # Unpack is in typing from Python 3.11
    from typing_extensions import Unpack


class BranchDoomed(TransactionRolledBack):
    """A distribution-list send of this branch was refused: the whole transaction rolls back."""

    code = "mlog-list-refused"
    reason = "vote"


class StagingBranch:
    """What a producer branch does before prepare, local (`ProducerBranch`) or remote
    (`messaging.remote.RemoteProducerBranch`): check and stage messages. Not thread-safe (one
    transaction).

    A send that is refused raises at once and stages nothing. A refused distribution-list send also
    *dooms* the branch: MSMQ's documentation says a failure to send to any destination of the list
    aborts the whole transaction, so prepare then votes no even if the application caught the
    error."""

    name: str

    def __init__(self, xid: Xid) -> None:
        self.xid = xid
        self.messages: list[Message] = []
        self.staged: Counter[str] = Counter()  # destination -> messages in ``messages``
        self.closed = False
        self.doomed: str | None = None

    def _now_ms(self) -> int:
        raise NotImplementedError

    def _max_bytes(self) -> int:
        raise NotImplementedError

    def _check_room(self, destination: str, count: int) -> None:
        """Raise `DestinationFullError` if ``count`` more messages would not fit (a remote log
        checks at prepare instead)."""

    def send(
        self, destination: str, body: bytes, headers: dict[str, str] | None = None,
        **options: Unpack[SendKwargs],
    ) -> str:  # fmt: skip
        """Stage a message; return its id. ``options``: `SendOptions` (priority, ttl, key, …).
        Refusals stage nothing: `InvalidMessageError` (bad destination, headers, body, option,
        or larger than the log's ``max_message_bytes``), `DestinationFullError` (a
        `TransientError`: the destination is at its limit)."""
        return self._stage([destination], body, headers, SendOptions.of(options))[0]

    def send_to_list(
        self, destinations: list[str], body: bytes, headers: dict[str, str] | None = None,
        **options: Unpack[SendKwargs],
    ) -> list[str]:  # fmt: skip
        """Stage one copy of the message per destination (a distribution list, MSMQ); return
        their ids. All copies commit or none: a refused copy stages nothing and dooms the
        branch, so the transaction rolls back."""
        try:
            return self._stage(destinations, body, headers, SendOptions.of(options))
        except (InvalidMessageError, DestinationFullError) as exc:
            self.doomed = f"distribution-list send refused: {exc}"
            raise

    def send_many(
        self, destination: str, bodies: Iterable[bytes], headers: dict[str, str] | None = None,
        **options: Unpack[SendKwargs],
    ) -> list[str]:  # fmt: skip
        """Stage one message per body, all to ``destination`` with the same headers and
        options; return their ids, in order. The same as a `send` per body, checked once where
        the messages agree (destination, headers, options) and per message where they differ
        (body, size): a writer of thousands of rows pays for its bodies, not for the checks.
        All or nothing: a refused body (`InvalidMessageError`) or a destination without room
        for them all (`DestinationFullError`) stages none of them."""
        self._refuse_if_closed()
        bodies = list(bodies)
        if not bodies:
            return []
        first = self._outgoing([destination], bodies[0], headers, SendOptions.of(options))
        messages = copies_with_bodies(first[0], bodies[1:], max_bytes=self._max_bytes())
        self._check_room(destination, self.staged[destination] + len(messages))
        self.add(messages)
        return [m.message_id for m in messages]

    def _stage(
        self,
        destinations: list[str],
        body: bytes,
        headers: dict[str, str] | None,
        options: SendOptions,
    ) -> list[str]:
        messages = self._outgoing(destinations, body, headers, options)
        for message in messages:  # a list's destinations differ: one more each
            self._check_room(message.destination, self.staged[message.destination] + 1)
        self.add(messages)
        return [m.message_id for m in messages]

    def _refuse_if_closed(self) -> None:
        if self.closed:
            raise IllegalStateError(f"{self.name}: send after the branch ended")

    def _outgoing(
        self,
        destinations: list[str],
        body: bytes,
        headers: dict[str, str] | None,
        options: SendOptions,
    ) -> list[Message]:
        """The checked messages of one send (`outgoing`), the sending transaction's trace in
        their headers; nothing staged yet."""
        self._refuse_if_closed()
        if tracing.installed() is not None:  # the sending transaction's trace travels along
            headers = {**(headers or {}), **tracing.message_headers(self.xid.gtrid)}
        return outgoing(
            destinations, body=body, headers=headers, options=options, now_ms=self._now_ms(),
            max_bytes=self._max_bytes(),
        )  # fmt: skip

    def add(self, messages: list[Message]) -> None:
        """Stage checked messages (the count per destination kept, not recounted per send)."""
        self.messages += messages
        self.staged.update(m.destination for m in messages)
