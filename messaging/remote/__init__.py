"""Remote resources: a message log or a cursor in another process, enlisted in an application's
transactions as resource managers of their own.

The application side (`RemoteMessageLog`, `RemoteCursor`) speaks the XA verbs over authenticated
framed connections to the server side (`ProducerService`, `ConsumerService`, the listener
handlers of ``twopc serve log|cursor``); `protocol` holds the shapes and error codes both agree
on. What a broken connection means to each verb is explained in `_resource` and `service`, why a
consumer branch pins its connection in `_remote_cursor`. A cursor's administration (subscriptions,
dead letters, non-transactional queues) rides on the consumer role too: `_cursor_admin` on the
client side, `admin` on the server side; both explain why a remote subscriber's attachment lasts
exactly as long as its connection. `aio` has the same clients for asyncio transactions
(`coordinator.aio`), their connections on the branch's event loop (`_loop_link`).
"""

from ._remote_cursor import RemoteConsumerBranch, RemoteCursor
from ._remote_log import RemoteMessageLog, RemoteProducerBranch
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
