"""The message log: the capture side of exactly-once messaging (seed 000's message log).

`MessageLog` is the durable store on the coordinator's journal; `MessageLogResource` makes it a
two-phase participant whose branches (`ProducerBranch`) ``send`` messages; the transfer side
reads committed messages with ``pending`` and compacts them with ``acknowledge``.
"""

from ._log import (
    DEFAULT_MAX_MESSAGE_BYTES,
    BranchRolledBack,
    DestinationFullError,
    MessageLog,
    MessageLogStats,
)
from ._records import (
    VOLATILE_SUFFIX,
    InvalidMessageError,
    Message,
    new_message,
    validate_destination,
)
from .resource import MessageLogResource, ProducerBranch

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "VOLATILE_SUFFIX",
    "BranchRolledBack",
    "DestinationFullError",
    "InvalidMessageError",
    "Message",
    "MessageLog",
    "MessageLogResource",
    "MessageLogStats",
    "ProducerBranch",
    "new_message",
    "validate_destination",
]
