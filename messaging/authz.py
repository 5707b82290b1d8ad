"""Per-client authorisation at a server: who a connection is, and what each of its requests may
touch, judged against the clients file (`messaging.clients`), reloaded without a restart.

**Identity** is settled once per connection. With a shared secret only (no clients file) nothing
here runs and every peer holding the secret may do everything, as before. With a clients file a
client proves its own key (``secret``) in the unchanged handshake: its AUTH ``client_id`` names
its entry and the proof is checked with that entry's key (`Authoriser.key_for`). With mutual TLS
(``require_client_cert``) the client is the entry its certificate's CN or SAN maps to
(`Authoriser.handshake_keys`); the AUTH ``client_id`` is then only a label.

**Grants** are judged on every request, against the table loaded *now*: a reload (SIGHUP, a
changed file, `Authoriser.reload`) reaches the next request of a connection already open, so a
revoked client's next request is refused. The checks are a dict lookup for the client and, per
destination or node id, a cached glob answer (`Globs`): no file is read on a request.

**Refusals** raise `UnauthorisedError` (code ``unauthorised``), counted in ``stats``
(``denied``, ``denied_<what>``) and logged at WARNING. Their messages name the caller's own
request only: a refused commit says which node the *caller's* xid names, never whose branches
exist. Recover answers with the caller's nodes' branches alone (`visible`), and counts what it
withheld (``recover_hidden``) without a refusal: a coordinator's recovery must go on.

**Reloading** keeps the old table when the new file is bad (an ERROR log line, counted in
``reload_failures``): a typo never locks every client out, nor lets everyone in.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from coordinator.errors import ConfigurationError
from coordinator.xid import Xid

from .auth import CERTIFICATE_KEY, Keys, Peer, SharedSecret
from .clients import Client, ClientTable, load_clients

log = logging.getLogger("twopc.authz")

#: the role a log delivers to a cursor with (`messaging.transfer.TRANSFER_ROLE`; named here too
#: so that this module stays below the transfer)
TRANSFER_ROLE = "transfer"
#: seconds between checks of the clients file's modification (0: only SIGHUP / `reload`)
DEFAULT_WATCH_INTERVAL = 2.0


class UnauthorisedError(ConfigurationError):
    """A client asked for what its grants in the server's clients file do not allow (a
    destination outside its globs, a branch of a node it does not act for, a role it lacks), or
    is not in the file any more. Not transient: the same request is refused again until an
    operator changes the file."""

    code = "unauthorised"


class Authoriser:
    """The clients file of one server, its current `ClientTable`, the refusal counters and the
    reload. ``stats`` may be shared with the server's listener so they show together."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        require_client_cert: bool = False,
        watch_interval: float = DEFAULT_WATCH_INTERVAL,
        stats: Counter[str] | None = None,
    ) -> None:
        self.path = Path(path)
        self.require_client_cert = require_client_cert
        self.watch_interval = watch_interval
        self.stats: Counter[str] = Counter() if stats is None else stats
        self._signature = self._stat()
        self._table = load_clients(self.path)  # a bad file at start: the server does not start
        self._reload_lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def table(self) -> ClientTable:
        return self._table

    # -- reloading -----------------------------------------------------------------------------

    def reload(self) -> bool:
        """Read the file again; True if the new table is in force. A bad file keeps the old table
        (ERROR logged, ``reload_failures`` counted)."""
        with self._reload_lock:
            self._signature = self._stat()
            try:
                table = load_clients(self.path)
            except ConfigurationError as exc:
                self.stats["reload_failures"] += 1
                log.error("%s; keeping the clients loaded before", exc.message)
                return False
            self._table = table  # one reference swap: a request sees the old or the new table
            self.stats["reloads"] += 1
            log.info("clients file %s reloaded: %d clients", self.path, len(table.clients))
            return True

    def reload_if_changed(self) -> bool:
        """`reload` when the file's modification time, size or inode moved since the last load."""
        return self._stat() != self._signature and self.reload()

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def start(self) -> Authoriser:
        """Watch the file every ``watch_interval`` seconds (0: do not watch)."""
        if self.watch_interval > 0 and self._watcher is None:
            self._watcher = threading.Thread(
                target=self._watch, name="twopc-clients-watch", daemon=True
            )
            self._watcher.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(self.watch_interval):
            try:
                self.reload_if_changed()
            except Exception:  # a defect: the watcher must not die silently
                log.exception("checking the clients file %s failed", self.path)

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(5.0)

    # -- identity at connect -------------------------------------------------------------------

    def key_for(self, client_id: str) -> SharedSecret | None:
        """`messaging.auth.Keys`: the key of the client the AUTH frame names, if it has one."""
        client = self._table.clients.get(client_id)
        if client is None or client.secret is None:
            self._count("unknown_client")  # the listener logs the refused handshake
            return None
        return client.secret

    def handshake_keys(self, sock: object) -> tuple[Keys, str | None]:
        """The keys to check this connection's handshake with, and the client name it is known
        by when its certificate names it (mutual TLS). Raises `UnauthorisedError` for a
        certificate the file does not map (or maps to two clients)."""
        if not self.require_client_cert:
            return self, None
        names = certificate_names(sock)
        client = self._table.client_for_certificate(names)
        if client is None:
            shown = ", ".join(names[:4]) or "none"
            raise self.deny(
                "unknown_certificate",
                f"the client certificate (names: {shown}) maps to no client of the server's "
                "clients file",
            )
        return (client.secret or CERTIFICATE_KEY), client.name

    def admit(self, peer: Peer) -> None:
        """A role is judged at connect: only a client with ``transfer = true`` delivers as a log."""
        if peer.role == TRANSFER_ROLE and not self.client(peer.id).transfer:
            raise self.deny("transfer", f"client {peer.id!r} may not deliver as a log (transfer)")

    # -- grants, per request ---------------------------------------------------------------------

    def client(self, name: str) -> Client:
        """The entry of a connected client as the file says it now; refused if it was removed."""
        client = self._table.clients.get(name)
        if client is None:
            raise self.deny("revoked", f"client {name!r} is not in the server's clients file")
        return client

    def check_node(self, client: Client, xid: Xid) -> None:
        node = xid.node_id
        if node is None or not client.nodes.allows(node):
            raise self.deny(
                "node",
                f"client {client.name!r} may not act for node {node or '(none)'!r} (the gtrid of "
                "its xid); it acts for the nodes listed in its 'nodes'",
            )

    def check_produce(self, client: Client, destination: str) -> None:
        if not client.produce.allows(destination):
            raise self.deny(
                "produce", f"client {client.name!r} may not produce to {destination[:200]!r}"
            )

    def check_consume(self, client: Client, queue: str) -> None:
        if not client.consume.allows(queue):
            raise self.deny("consume", f"client {client.name!r} may not consume {queue[:200]!r}")

    def check_administer(self, client: Client, queue: str) -> None:
        if not client.administer.allows(queue):
            raise self.deny(
                "administer", f"client {client.name!r} may not administer {queue[:200]!r}"
            )

    def check_subscription(self, client: Client, queue: str) -> None:
        """Subscribing, attaching and their undoing: its consumer or its administrator."""
        if not (client.consume.allows(queue) or client.administer.allows(queue)):
            raise self.deny(
                "consume", f"client {client.name!r} may not use subscription {queue[:200]!r}"
            )

    def visible(self, client: Client, xids: Iterable[Xid]) -> list[Xid]:
        """The xids among ``xids`` of nodes ``client`` acts for; the others are withheld and
        counted (``recover_hidden``), never named."""
        found = list(xids)
        shown = [x for x in found if x.node_id is not None and client.nodes.allows(x.node_id)]
        if len(shown) != len(found):
            self.stats["recover_hidden"] += len(found) - len(shown)
        return shown

    def deny(self, what: str, message: str) -> UnauthorisedError:
        """Count a refusal, log it, and return the error to raise."""
        self._count(what)
        log.warning("refused: %s", message)
        return UnauthorisedError(message)

    def _count(self, what: str) -> None:
        self.stats["denied"] += 1
        self.stats[f"denied_{what}"] += 1


def certificate_names(sock: object) -> list[str]:
    """A verified peer certificate's DNS and URI subject alternative names, then its common
    names; empty without TLS or without a certificate."""
    if not isinstance(sock, ssl.SSLSocket):
        return []
    cert = sock.getpeercert()
    if not cert:
        return []
    names: list[str] = []
    for pair in cert.get("subjectAltName", ()):
        if len(pair) == 2 and pair[0] in ("DNS", "URI"):
            names.append(str(pair[1]))
    for rdn in cert.get("subject", ()):
        names.extend(str(attr[1]) for attr in rdn if len(attr) == 2 and attr[0] == "commonName")
    return list(dict.fromkeys(names))


def authoriser_from(
    clients: str | os.PathLike[str] | Authoriser | None,
    *,
    require_client_cert: bool = False,
    watch_interval: float = DEFAULT_WATCH_INTERVAL,
) -> Authoriser | None:
    """What a server's ``clients=`` argument means: None (the shared secret alone), a path, or an
    `Authoriser` made by the caller."""
    if clients is None or isinstance(clients, Authoriser):
        return clients
    return Authoriser(
        clients, require_client_cert=require_client_cert, watch_interval=watch_interval
    )


__all__ = [
    "DEFAULT_WATCH_INTERVAL",
    "Authoriser",
    "UnauthorisedError",
    "authoriser_from",
    "certificate_names",
]
