"""What a `RedisBranch` reads through its resource: a key checked against the namespace and the
hash slot, plain reads of keys it has not touched, and a key's facts at one instant with the
fingerprint a watch compares (`value_fingerprint`)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any, Final

from redis import exceptions as rex
from redis.crc import key_slot

from coordinator import ProgrammingError

from . import _writeset as ws
from ._base import RedisBase
from ._overlay import STRING, Base, Query


class ReadOps(RedisBase):
    """`RedisResource`'s reads on behalf of its branches."""

    def data_key(self, name: Any) -> bytes:
        """A key a branch may touch, as bytes; the cluster rule and our namespace enforced."""
        key = ws.encode(name, "key")
        if key.startswith(self.prefix):
            raise ProgrammingError(
                f"{self._name}: keys under {self.prefix!r} are twopc's own; a branch may not use "
                "them"
            )
        if self.single_slot and key_slot(key) != self._slot:
            raise ProgrammingError(
                f"{self._name}: key {key!r} is in hash slot {key_slot(key)}, but on Redis "
                f"Cluster a branch lives in one hash slot: use keys with the hash tag "
                f"{{{self.hash_tag}}} (slot {self._slot})"
            )
        return key

    def data_keys(self, names: Iterable[Any]) -> list[bytes]:
        """`data_key` of each name, in one pass: an ``mset`` of a Spark chunk names a thousand
        keys, and a call per key was a third of buffering it (measured)."""
        keys = [n.encode("utf-8") if type(n) is str else ws.encode(n, "key") for n in names]
        prefix = self.prefix
        if self.single_slot or any(key.startswith(prefix) for key in keys):
            for key in keys:
                self.data_key(key)  # says which key and why
        return keys

    def decode(self, value: Any) -> Any:
        """As the client would return it (``decode_responses``)."""
        return self._encoder.decode(value)

    def read_now(self, key: bytes, query: Query) -> Any:
        """One plain read (GET, HGET, SISMEMBER, TTL, HGETALL, SMEMBERS, LRANGE) of a key the
        branch has not touched; whole collections and TTL come back as `_fact` shapes them."""
        kind, arg = query
        command = _PLAIN_READS[kind] + [key] + ([arg] if kind in "FM" else [])
        if kind == "R":
            command += [0, -1]
        raw = self.read_command(command)
        return _fact(query, raw) if kind in "THAR" else raw

    def read_command(self, command: list[Any]) -> Any:
        """One read-only command (MGET, HMGET, EXISTS, LRANGE...) answered by the server as is."""
        with self._errors("reading " + repr(command[1])):
            return self._scripts.command(command)

    def read_facts(self, key: bytes, queries: list[Query], fingerprint: bool) -> tuple[Base, bytes]:
        """The key's type and ``queries`` at one instant, with its fingerprint if asked.

        A string key (or a missing one) asked for its value at most, the common case of
        ``incrby``, ``get`` and ``watch``, is read with one plain ``GET``, and its fingerprint
        is the value's (`value_fingerprint`), which the scripts check with ``GET`` too. Any
        other type answers ``GET`` with ``WRONGTYPE``; it is then read by the ``read`` script,
        fingerprinted by ``DUMP``."""
        if not queries or queries == [STRING]:
            try:
                with self._errors("reading " + repr(key)):
                    value = self._scripts.command(["GET", key])
            except rex.ResponseError as exc:
                if not str(exc).startswith("WRONGTYPE"):
                    raise
            else:
                if value is None:
                    return Base("none", {STRING: None}), b""
                seen = value_fingerprint(value) if fingerprint else b""
                return Base("string", {STRING: bytes(value)}), seen
        args: list[bytes | str | int] = [b"1" if fingerprint else b"0"]
        for kind, arg in queries:
            args += [kind.encode(), arg]
        reply = self._run("read", [key], args, "reading " + repr(key))
        facts = {q: _fact(q, value) for q, value in zip(queries, reply[2:], strict=True)}
        return Base(reply[0].decode(), facts), reply[1] or b""


#: the command that reads one fact of an untouched key (`read_now`)
_PLAIN_READS: Final[dict[str, list[Any]]] = {
    "S": ["GET"],
    "F": ["HGET"],
    "M": ["SISMEMBER"],
    "T": ["TTL"],
    "H": ["HGETALL"],
    "A": ["SMEMBERS"],
    "R": ["LRANGE"],
}


def _fact(query: Query, value: Any) -> Any:
    """A fact as the overlay keeps it: bools, numbers, bytes, and dict / set / list of bytes for
    a whole collection (a reply is a flat list, or already a dict or set through a cluster
    client's callbacks)."""
    kind = query[0]
    if kind == "M":
        return bool(value)
    if kind == "Z":
        return None if value is None else float(value)
    if kind in "LNT":
        return int(value or 0)
    if kind == "H":
        if not value:
            return {}
        items = (
            value.items() if isinstance(value, dict) else zip(value[0::2], value[1::2], strict=True)
        )
        return {bytes(f): bytes(v) for f, v in items}
    if kind in "AR":
        whole = [bytes(v) for v in value or ()]
        return set(whole) if kind == "A" else whole
    return None if value is None else bytes(value)


def value_fingerprint(value: bytes) -> bytes:
    """A watch on a string key as its value read by ``GET``: ``S`` and the value's SHA-1 (hex).
    ``unchanged`` in ``common.lua`` compares it with the key's value then; a ``DUMP``
    fingerprint is bare hex and a missing key's is empty, so the three never mix."""
    return b"S" + hashlib.sha1(value, usedforsecurity=False).hexdigest().encode()
