"""Remote resources: a message log or a cursor in another process, enlisted in an application's
transactions as resource managers of their own.

The application side (`RemoteMessageLog`, `RemoteCursor`) speaks the XA verbs over authenticated
framed connections to the server side (`ProducerService`, `ConsumerService`, the listener
handlers of ``twopc serve log|cursor``); `protocol` holds the shapes and error codes both agree
on. Why a consumer branch pins its connection, and what a broken connection means to each verb,
is explained in `client` and `service`.
"""

from .client import RemoteConsumerBranch, RemoteCursor, RemoteMessageLog, RemoteProducerBranch
from .protocol import (
    CONSUMER_ROLE,
    PRODUCER_ROLE,
    BadRequestError,
    BranchLost,
    RemoteError,
    RemoteUnavailable,
)
from .service import ConsumerService, ProducerService

__all__ = [
    "CONSUMER_ROLE",
    "PRODUCER_ROLE",
    "BadRequestError",
    "BranchLost",
    "ConsumerService",
    "ProducerService",
    "RemoteConsumerBranch",
    "RemoteCursor",
    "RemoteError",
    "RemoteMessageLog",
    "RemoteProducerBranch",
    "RemoteUnavailable",
]
