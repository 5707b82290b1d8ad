"""The message log and the cursor as running services: embedded in an application, or on their own
as ``twopc serve log`` / ``twopc serve cursor``.

- `LogServer`: a `MessageLog` on disk, one `LogTransfer` to each cursor its routes name (the
  default cursor, and every cursor of a ``routes`` entry: `messaging.routes`), and, when it
  listens, the ``producer`` service through which remote applications enlist the log
  (`messaging.remote.RemoteMessageLog`). Embedded, an application makes one without ``listen``
  and joins ``server.resource`` in its transactions directly.
- `CursorServer`: a `Cursor` on disk behind a listener that admits ``transfer`` connections (logs
  delivering) and ``consumer`` connections (remote applications receiving,
  `messaging.remote.RemoteCursor`), and a `TopicDispatcher` that fans publications out to their
  subscription queues (``dispatch_workers`` threads; 0 runs none). Embedded, ``server.resource``
  is the local resource.

Both authenticate every connection with the shared secret (and TLS if configured) or, given a
clients file (``clients=``, `messaging.authz`), each client with its own key or certificate, and
then judge each request by that client's grants. Neither owns
a transaction outcome: a remote branch is decided by its application's coordinator, and what a
server finds handed out or prepared when it starts is what its journal says (see the stores).
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections.abc import Callable, Sequence
from types import TracebackType

from coordinator.errors import ConfigurationError
from resource_managers.cursor import (
    DEFAULT_MAX_DELIVERIES,
    DEFAULT_PRECOUNT,
    Cursor,
    CursorResource,
)
from resource_managers.message_log import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MessageLog,
    MessageLogResource,
)
from resource_managers.sequencing import DoublingBackoff

from .auth import SharedSecret
from .authz import DEFAULT_WATCH_INTERVAL, Authoriser, authoriser_from
from .connection import INTERNAL_ERRORS, Address, Connection, Handler, Listener, connect
from .expiry import DEFAULT_SWEEP_INTERVAL, ExpirySweeper
from .metrics import Family, cursor_families, log_families, to_value
from .remote import CONSUMER_ROLE, PRODUCER_ROLE, ConsumerService, ProducerService
from .routes import Route, Router
from .topics import DEFAULT_DISPATCH_WORKERS, TopicDispatcher
from .transfer import TRANSFER_ROLE, LogTransfer, TransferReceiver

log = logging.getLogger("twopc.server")

#: a server's ``clients``: a clients file (`messaging.clients`), an `Authoriser`, or None for the
#: shared secret alone
Clients = str | os.PathLike[str] | Authoriser | None


def _authoriser(
    clients: Clients, tls_server: ssl.SSLContext | None, watch: float
) -> Authoriser | None:
    """A server that requires client certificates knows a client by its certificate's name."""
    by_certificate = tls_server is not None and tls_server.verify_mode == ssl.CERT_REQUIRED
    return authoriser_from(clients, require_client_cert=by_certificate, watch_interval=watch)


class LogServer:
    """A message log, its transfers and (with ``listen``) its producer service. ``cursor`` is the
    default route; ``routes`` send the destinations their patterns match to other cursors, one
    `LogTransfer` per cursor (``transfers``; ``transfer`` is the default cursor's); a route
    naming several cursors partitions its destinations by message key. ``allow_repartition``:
    open although a destination's partition count changed while it holds unacknowledged messages
    (per-key order is then not kept across the change; see `MessageLog`). ``cursor_id`` and
    ``cursor_hostname`` are checked of the default cursor only."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        secret: SharedSecret | None,
        *,
        cursor: Address,
        listen: Address | None = None,
        server_id: str = "twopc-log",
        tls_server: ssl.SSLContext | None = None,
        tls_client: ssl.SSLContext | None = None,
        cursor_hostname: str | None = None,
        cursor_id: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_destination_messages: int | None = None,
        resend: DoublingBackoff | None = None,
        streams: Callable[[str], bool] | None = None,
        resource_name: str = "mlog",
        routes: Sequence[Route] = (),
        allow_repartition: bool = False,
        clients: Clients = None,
        clients_watch: float = DEFAULT_WATCH_INTERVAL,
    ) -> None:
        if secret is None and tls_client is None:
            raise ConfigurationError(
                "a log needs a secret, or a TLS client certificate (tls_client), for its cursor"
            )
        self.router = Router(cursor, routes)
        self.authoriser = _authoriser(clients, tls_server, clients_watch)
        self.mlog = MessageLog(
            directory,
            max_message_bytes=max_message_bytes,
            max_destination_messages=max_destination_messages,
            partitions=self.router.partitions,  # the key is hashed where messages are numbered
            allow_repartition=allow_repartition,
        )
        self.resource = MessageLogResource(self.mlog, resource_name)
        wanted = streams or (lambda _stream: True)

        def dialer(address: Address) -> Callable[[], Connection]:
            default = address == cursor
            return lambda: connect(
                address, secret, server_id, TRANSFER_ROLE, tls=tls_client,
                server_hostname=cursor_hostname if default else None,
                server_id=cursor_id if default else None,
            )  # fmt: skip

        def routed(address: Address) -> Callable[[str], bool]:
            return lambda stream: self.router.cursor_for(stream) == address and wanted(stream)

        #: one transfer per cursor, the default cursor's first
        self.transfers = {
            address: LogTransfer(
                self.mlog,
                dialer(address),
                resend=resend,
                streams=routed(address),
                name="transfer" if address == cursor else f"transfer-{address[0]}:{address[1]}",
                peer=f"{address[0]}:{address[1]}",
            )
            for address in self.router.cursors()
        }
        self.transfer = self.transfers[cursor]
        self.listener: Listener | None = None
        self.service = ProducerService(self.mlog, self.authoriser)
        self.service.stats_source = lambda: to_value(self.families())
        try:
            if listen is not None:
                handlers = {PRODUCER_ROLE: self.service}
                self.listener = Listener(
                    listen, secret, server_id, handlers, tls=tls_server,
                    authoriser=self.authoriser,
                )  # fmt: skip
        except BaseException:
            self.mlog.close()
            raise

    @property
    def address(self) -> Address | None:
        return None if self.listener is None else self.listener.address

    @property
    def internal_errors(self) -> int:
        """Defects met while serving (``internal-error`` sent, traceback logged); 0 is healthy."""
        listener = 0 if self.listener is None else self.listener.stats[INTERNAL_ERRORS]
        return listener + self.service.stats[INTERNAL_ERRORS]

    def families(self) -> list[Family]:
        """The metrics of this server, read now (`messaging.metrics`)."""
        return log_families(
            self.mlog, self.transfers, self.listener, self.service.stats[INTERNAL_ERRORS]
        )

    def wait_idle(self, timeout: float) -> bool:
        """Every transfer's `LogTransfer.wait_idle`: nothing unacknowledged for any cursor."""
        deadline = time.monotonic() + timeout
        return all(  # each looks at least once, however long the ones before it took
            t.wait_idle(max(0.05, deadline - time.monotonic())) for t in self.transfers.values()
        )

    def start(self) -> LogServer:
        for transfer in self.transfers.values():
            transfer.start()
        if self.authoriser is not None:
            self.authoriser.start()
        if self.listener is not None:
            self.listener.start()
        return self

    def close(self) -> None:
        """Stop serving, stop the transfer, then close the journal (lazy records flushed)."""
        if self.listener is not None:
            self.listener.close()
        if self.authoriser is not None:
            self.authoriser.close()
        for transfer in self.transfers.values():
            transfer.close()
        self.mlog.close()

    def __enter__(self) -> LogServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class CursorServer:
    """A cursor behind a listener for logs (``transfer``) and remote consumers (``consumer``),
    with its topic dispatcher. The dispatcher lives inside the cursor's process because its
    in-doubt list and monitor queue are the cursor's records: a copy and its monitor entry are one
    record only if the same journal writes both."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        secret: SharedSecret | None,
        *,
        listen: Address,
        server_id: str = "twopc-cursor",
        tls_server: ssl.SSLContext | None = None,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        resource_name: str = "cursor",
        dispatch_workers: int = DEFAULT_DISPATCH_WORKERS,
        precount: int = DEFAULT_PRECOUNT,
        sweep_interval: float | None = DEFAULT_SWEEP_INTERVAL,
        clients: Clients = None,
        clients_watch: float = DEFAULT_WATCH_INTERVAL,
    ) -> None:
        self.authoriser = _authoriser(clients, tls_server, clients_watch)
        self.cursor = Cursor(directory, max_deliveries=max_deliveries, precount=precount)
        self.resource = CursorResource(self.cursor, resource_name, max_deliveries)
        self.receiver = TransferReceiver(self.cursor)
        try:
            if dispatch_workers < 0:
                raise ConfigurationError("dispatch_workers must be >= 0 (0: no topic dispatch)")
            self.topics = (
                TopicDispatcher(self.cursor, dispatch_workers) if dispatch_workers > 0 else None
            )
            self.service = ConsumerService(self.cursor, max_deliveries, self.authoriser)
            self.service.stats_source = lambda: to_value(self.families())
            #: the periodic expiry sweep (None: ``sweep_interval`` None or 0, receives only)
            self.sweeper = ExpirySweeper(self.cursor, sweep_interval) if sweep_interval else None
            handlers: dict[str, Handler] = {
                TRANSFER_ROLE: self.receiver,
                CONSUMER_ROLE: self.service,
            }
            self.listener = Listener(
                listen, secret, server_id, handlers, tls=tls_server, authoriser=self.authoriser
            )
        except BaseException:
            self.cursor.close()
            raise

    @property
    def address(self) -> Address:
        return self.listener.address

    @property
    def internal_errors(self) -> int:
        """Defects met while serving (``internal-error`` sent, traceback logged); 0 is healthy."""
        return self.listener.stats[INTERNAL_ERRORS] + self.service.stats[INTERNAL_ERRORS]

    def families(self) -> list[Family]:
        """The metrics of this server, read now (`messaging.metrics`)."""
        return cursor_families(
            self.cursor, self.receiver, self.listener, self.service.stats[INTERNAL_ERRORS],
            topics=self.topics, sweeper=self.sweeper,
        )  # fmt: skip

    def start(self) -> CursorServer:
        """Start the topic dispatcher (its recovery runs first, on its own thread) and the
        expiry sweep, then serve."""
        if self.topics is not None:
            self.topics.start()
        if self.sweeper is not None:
            self.sweeper.start()
        if self.authoriser is not None:
            self.authoriser.start()
        self.listener.start()
        return self

    def close(self) -> None:
        """Stop serving, let the dispatcher deliver what it took, then close the journal. A
        publication the dispatcher could not finish stays in doubt for the next start."""
        try:
            self.listener.close()
            if self.sweeper is not None:
                self.sweeper.stop()
            if self.authoriser is not None:
                self.authoriser.close()
            if self.topics is not None:
                log.info("topic dispatch stopped: %s", self.topics.stop())
        finally:
            self.cursor.close()

    def __enter__(self) -> CursorServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
