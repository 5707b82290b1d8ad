"""The message log: the capture side of exactly-once messaging (US patent 8,200,836).

`MessageLog` is the durable store on the coordinator's journal; `MessageLogResource` makes it a
two-phase participant whose branches (`ProducerBranch`) ``send`` messages; the transfer side
reads committed messages with ``pending`` and compacts them with ``acknowledge``.
"""

from ._base import (
    DEFAULT_MAX_MESSAGE_BYTES,
    BranchRolledBack,
    DestinationFullError,
    MessageLogStats,
    journal_replay,
)
from ._log import MessageLog
from ._options import MessageOptions, SendKwargs, SendOptions
from ._partition import (
    MAX_PARTITIONS,
    StreamName,
    on_its_stream,
    parse_stream,
    partition_of,
    stream_for,
)
from ._records import (
    ADMIN_QUEUE_HEADER,
    DEFAULT_PRIORITY,
    KEY_HEADER,
    LIST_HEADER,
    LOG_IDENTITY,
    PRIORITY_HEADER,
    PUBLISHER_HEADER,
    TOPIC_PREFIX,
    TRANSACTIONAL_HEADER,
    VOLATILE_SUFFIX,
    Message,
    split_by_size,
)
from ._staging import BranchDoomed, StagingBranch
from ._validation import (
    InvalidMessageError,
    check_message,
    new_message,
    outgoing,
    validate_destination,
)
from .resource import MessageLogResource, ProducerBranch

__all__ = [
    "ADMIN_QUEUE_HEADER",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_PRIORITY",
    "KEY_HEADER",
    "LIST_HEADER",
    "LOG_IDENTITY",
    "MAX_PARTITIONS",
    "PRIORITY_HEADER",
    "PUBLISHER_HEADER",
    "TOPIC_PREFIX",
    "TRANSACTIONAL_HEADER",
    "VOLATILE_SUFFIX",
    "BranchDoomed",
    "BranchRolledBack",
    "DestinationFullError",
    "InvalidMessageError",
    "Message",
    "MessageLog",
    "MessageLogResource",
    "MessageLogStats",
    "MessageOptions",
    "ProducerBranch",
    "SendKwargs",
    "SendOptions",
    "StagingBranch",
    "StreamName",
    "check_message",
    "journal_replay",
    "new_message",
    "on_its_stream",
    "outgoing",
    "parse_stream",
    "partition_of",
    "split_by_size",
    "stream_for",
    "validate_destination",
]
