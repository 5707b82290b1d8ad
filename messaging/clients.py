"""The clients file: who may connect to a server, as whom, and what each client may do.

``twopc serve log|cursor --clients FILE`` (or ``LogServer(..., clients=FILE)``) reads a TOML file
of one table per client::

    [clients.billing-app]
    secret_file = "billing-app.secret"      # its own handshake key (or: secret = "...")
    certificate = ["billing-app.internal"]  # mutual TLS: a CN or SAN its certificate carries
    produce = ["billing.*"]                 # destination globs it may send to
    consume = ["orders.created", "topic:prices/billing"]
    administer = ["billing.*"]              # dead letters, queue flags (cursor)
    nodes = ["billing-1", "billing-2"]      # coordinator node ids it may act for
    transfer = false                        # may deliver as a log (a cursor's ``transfer`` role)

Why a file of grants and not the shared secret alone: with one secret every holder can drive the
XA verbs on every branch of every application (commit another application's prepared branch, or
list them all by recover). A client's own key says who it is; its grants say what it may touch.

Why the checks are globs over names and node ids over gtrids: a destination is the unit a
producer and a consumer agree on, and a gtrid begins with the node id of the coordinator that made
it (`coordinator.xid`), so "acts for node N" is exactly "may finish the branches N's recovery
would finish". Globs are `fnmatch`'s, case-sensitive, as routes are (`messaging.routes`).

This module is pure: text in, a `ClientTable` out, or one `ConfigurationError` that names the
file, the client and the key. Nothing here reads a file on a request: the table is built once per
(re)load and `Globs` caches its answer per name (see `messaging.authz` for reloading).
"""

from __future__ import annotations

import fnmatch
import json
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.errors import ConfigurationError

from .auth import SharedSecret

#: answers a `Globs` keeps; past this the cache starts again (a client naming millions of
#: destinations costs a regex match each, never unbounded memory)
GLOB_CACHE_SIZE = 4096
_ID = re.compile(r"[\x21-\x7e]{1,64}\Z")
_KEYS = {
    "secret", "secret_file", "certificate", "produce", "consume", "administer", "nodes",
    "transfer",
}  # fmt: skip


class Globs:
    """A list of globs, matched as one regular expression, with each name's answer cached: the
    per-request check is a dict lookup once a destination has been seen."""

    __slots__ = ("_cache", "_regex", "patterns")

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns = tuple(patterns)
        joined = "|".join(f"(?:{fnmatch.translate(p)})" for p in self.patterns)
        self._regex = re.compile(joined) if self.patterns else None
        self._cache: dict[str, bool] = {}

    def allows(self, name: str) -> bool:
        hit = self._cache.get(name)
        if hit is None:
            hit = self._regex is not None and self._regex.match(name) is not None
            if len(self._cache) >= GLOB_CACHE_SIZE:
                self._cache = {}  # a fresh dict, not clear(): another thread may be reading
            self._cache[name] = hit
        return hit

    def __repr__(self) -> str:
        return f"Globs({list(self.patterns)!r})"


@dataclass(frozen=True, eq=False)
class Client:
    """One client's identity and grants, as the file says them. ``secret`` never prints."""

    name: str
    secret: SharedSecret | None
    certificate: tuple[str, ...]
    produce: Globs
    consume: Globs
    administer: Globs
    nodes: Globs
    transfer: bool = False


@dataclass(frozen=True)
class ClientTable:
    """Every client of one clients file: by name, and by certificate name (each name maps to one
    client at most; the loader refuses a file that maps one name twice)."""

    path: Path
    clients: Mapping[str, Client]
    by_certificate: Mapping[str, Client]

    def client_for_certificate(self, names: Iterable[str]) -> Client | None:
        """The client one of ``names`` (a certificate's CN and SANs) maps to; None when none
        does, or when they map to two different clients (an ambiguous certificate)."""
        found = {self.by_certificate[n].name: self.by_certificate[n] for n in names
                 if n in self.by_certificate}  # fmt: skip
        return next(iter(found.values())) if len(found) == 1 else None


def load_clients(path: str | Path) -> ClientTable:
    """Read and check a clients file; `ConfigurationError` (one line) for anything wrong."""
    where = Path(path)
    try:
        data = _decode(where)
    except OSError as exc:
        raise ConfigurationError(f"clients file {where}: cannot read it: {exc.strerror}") from None
    except ValueError as exc:  # TOMLDecodeError, JSONDecodeError, UnicodeDecodeError
        raise ConfigurationError(f"clients file {where}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigurationError(f"clients file {where}: the top level must be a table")
    return parse_clients(data, where)


def _decode(where: Path) -> object:
    """TOML (Python 3.11+), or JSON of the same shape for a ``.json`` file (any Python)."""
    text = where.read_text(encoding="utf-8")
    if where.suffix == ".json":
        return json.loads(text)
    if sys.version_info >= (3, 11):
        import tomllib  # noqa: PLC0415 - 3.11+ only

        return tomllib.loads(text)
    raise ValueError("TOML needs Python 3.11+; write the clients file as .json on Python 3.10")


def parse_clients(data: Mapping[str, Any], where: Path) -> ClientTable:
    """The table of an already decoded file (``where`` names it in errors and anchors relative
    ``secret_file`` paths)."""
    extra = sorted(set(data) - {"clients"})
    if extra:
        raise ConfigurationError(f"clients file {where}: unknown top-level key {extra[0]!r}")
    table = data.get("clients", {})
    if not isinstance(table, dict):
        raise ConfigurationError(f"clients file {where}: 'clients' must be a table")
    clients = {name: _client(where, name, entry) for name, entry in table.items()}
    by_certificate: dict[str, Client] = {}
    for client in clients.values():
        for cert_name in client.certificate:
            other = by_certificate.setdefault(cert_name, client)
            if other is not client:
                raise ConfigurationError(
                    f"clients file {where}: certificate name {cert_name!r} maps to both "
                    f"{other.name!r} and {client.name!r}"
                )
    return ClientTable(where, clients, by_certificate)


def _client(where: Path, name: str, entry: object) -> Client:
    def bad(message: str) -> ConfigurationError:
        return ConfigurationError(f"clients file {where}: client {name!r}: {message}")

    if not _ID.match(name):
        raise bad("a client name is 1-64 printable ASCII characters without spaces")
    if not isinstance(entry, dict):
        raise bad("must be a table ([clients.NAME])")
    unknown = sorted(set(entry) - _KEYS)
    if unknown:
        raise bad(f"unknown key {unknown[0]!r} (known: {', '.join(sorted(_KEYS))})")
    secret = _secret(where, entry, bad)
    certificate = _strings(entry, "certificate", bad)
    if secret is None and not certificate:
        raise bad("needs a secret (secret or secret_file) or a certificate name, or both")
    transfer = entry.get("transfer", False)
    if not isinstance(transfer, bool):
        raise bad("'transfer' must be true or false")
    return Client(
        name=name, secret=secret, certificate=tuple(certificate),
        produce=Globs(_strings(entry, "produce", bad)),
        consume=Globs(_strings(entry, "consume", bad)),
        administer=Globs(_strings(entry, "administer", bad)),
        nodes=Globs(_strings(entry, "nodes", bad)), transfer=transfer,
    )  # fmt: skip


def _strings(entry: Mapping[str, Any], key: str, bad: Any) -> list[str]:
    value = entry.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise bad(f"{key!r} must be a list of non-empty strings")
    return value


def _secret(where: Path, entry: Mapping[str, Any], bad: Any) -> SharedSecret | None:
    if "secret" in entry and "secret_file" in entry:
        raise bad("give 'secret' or 'secret_file', not both")
    try:
        if "secret" in entry:
            if not isinstance(entry["secret"], str):
                raise bad("'secret' must be a string")
            return SharedSecret(entry["secret"].encode("utf-8"))
        if "secret_file" in entry:
            if not isinstance(entry["secret_file"], str):
                raise bad("'secret_file' must be a path string")
            return SharedSecret.from_file(where.parent / entry["secret_file"])
    except OSError as exc:
        raise bad(f"cannot read its secret_file: {exc.strerror}") from None
    except ConfigurationError as exc:
        if exc.message.startswith(f"clients file {where}"):
            raise
        raise bad(exc.message) from None
    return None
