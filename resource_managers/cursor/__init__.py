"""The cursor: the delivery side of exactly-once messaging (the cursor of US patent 8,200,836).

`Cursor` is the durable store on the coordinator's journal: it accepts transferred messages
through `..sequencing.StreamFilter` (persisting each with its stream's filter state before
acknowledging) and keeps them per destination until consumed. `CursorResource` makes it a
two-phase participant whose branches (`ConsumerBranch`) ``receive`` messages.
"""

from ._cursor import Cursor
from ._precount import DEFAULT_PRECOUNT
from ._queues import DEAD_LETTER, DROP, QueueDepth
from ._records import DLQ_SUFFIX
from ._state import NACK_HEADER
from ._topics import (
    TOPIC_PREFIX,
    Subscription,
    TopicPublication,
    is_subscription_queue,
    is_topic,
    subscription_name,
    subscription_queue,
    validate_topic,
)
from ._values import (
    DEFAULT_MAX_DELIVERIES,
    BranchRolledBack,
    CursorStats,
    Delivery,
    LogFencedError,
    journal_replay,
)
from .resource import ConsumerBranch, CursorResource

__all__ = [
    "DEAD_LETTER",
    "DEFAULT_MAX_DELIVERIES",
    "DEFAULT_PRECOUNT",
    "DLQ_SUFFIX",
    "DROP",
    "NACK_HEADER",
    "TOPIC_PREFIX",
    "BranchRolledBack",
    "ConsumerBranch",
    "Cursor",
    "CursorResource",
    "CursorStats",
    "Delivery",
    "LogFencedError",
    "QueueDepth",
    "Subscription",
    "TopicPublication",
    "is_subscription_queue",
    "is_topic",
    "journal_replay",
    "subscription_name",
    "subscription_queue",
    "validate_topic",
]
