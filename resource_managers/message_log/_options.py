"""How a message is sent, defined once: every producer path (a local or remote branch's
``send``/``send_to_list``, a session's ``send``) takes these keywords and hands one frozen
`SendOptions` down to `outgoing`, which turns them into the message's reserved headers.

``persistent``
    False: kept in memory only, lost in a crash or close (JMS's non-persistent delivery).
``ttl``
    seconds until the message expires (None: never), counted from the send on this machine's clock.
``priority``
    0-9 (None: JMS's default 4); a higher priority overtakes lower ones in a queue.
``admin_queue``
    a plain queue that receives a negative acknowledgment if a destination refuses the message.
``transactional``
    False marks a message a non-transactional queue accepts (MSMQ).
``publisher``
    whose order topic dispatch keeps (a session sets its client id).
``key``
    1-200 characters picking the partition of a destination whose route names several cursors:
    one key, one partition, so its messages keep their order.
"""

from __future__ import annotations

from typing import NamedTuple, TypedDict


class MessageOptions(TypedDict, total=False):
    """The keywords of a session's ``send`` (it sets ``transactional`` and ``publisher``)."""

    persistent: bool
    ttl: float | None
    priority: int | None
    admin_queue: str | None
    key: str | None


class SendKwargs(MessageOptions, total=False):
    """The keywords of a branch's ``send`` and ``send_to_list``."""

    transactional: bool
    publisher: str | None


class SendOptions(NamedTuple):
    """One send's options, frozen (a named tuple: built once per send on the hot path, so as
    cheap as a tuple). `of` builds it from the keywords, sharing one default value."""

    persistent: bool = True
    ttl: float | None = None
    priority: int | None = None
    admin_queue: str | None = None
    transactional: bool = True
    publisher: str | None = None
    key: str | None = None

    @classmethod
    def of(cls, options: SendKwargs) -> SendOptions:
        """The options of a call's keywords; a `TypeError` names one that does not exist."""
        return cls(**options) if options else DEFAULT


DEFAULT = SendOptions()
