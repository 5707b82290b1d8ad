"""Transaction identifiers: X/Open XA triples, validated once at the boundary.

A global transaction id (gtrid) starts with the coordinator's node id, so recovery touches only
branches its own node created (several coordinators may share one database). The branch qualifier
(bqual) is the resource's name. The text form is the one psycopg2 and the PostgreSQL JDBC driver
use for a gid, ``formatid_base64(gtrid)_base64(bqual)``, so tools reading ``pg_prepared_xacts``
understand ours and ours parse back.

Limits, and why: XA caps gtrid and bqual at 64 bytes each (MAXGTRIDSIZE/MAXBQUALSIZE); psycopg2
refuses anything outside printable ASCII 0x20..0x7e and a format id outside 0..2**31-1; PostgreSQL
caps a gid below 200 bytes (the encoded form of two 64-byte parts stays under it). Node ids are
stricter still (letters, digits, ``._-``; no ``:``) because they are a prefix we match on.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import InvalidXidError

#: Our XA format id, "tpc0" in ASCII. Recovery ignores prepared branches with any other format id.
FORMAT_ID = 0x74706330
MAX_PART_BYTES = 64
MAX_GID_BYTES = 199
_NODE_ID = re.compile(r"[A-Za-z0-9._-]{1,32}\Z")
_PRINTABLE = re.compile(r"[\x20-\x7e]+\Z")
_SEP = ":"


def validate_node_id(node_id: str) -> str:
    if not isinstance(node_id, str) or not _NODE_ID.match(node_id):
        raise InvalidXidError(
            f"invalid node id {node_id!r}: 1-32 characters from letters, digits, '.', '_', '-'"
        )
    return node_id


def _check_part(label: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidXidError(f"{label} must be a str, not {type(value).__name__}")
    if not value or len(value) > MAX_PART_BYTES or not _PRINTABLE.match(value):
        raise InvalidXidError(
            f"invalid {label} {value[:80]!r}: 1-{MAX_PART_BYTES} printable ASCII characters"
        )
    return value


def validate_resource_name(name: str) -> str:
    """Resource names become bquals, so they obey the same limits."""
    return _check_part("resource name", name)


class GtridFactory:
    """Makes this manager's gtrids: ``node:incarnation-seq``, never reused.

    The incarnation is fresh for every process (start time and 24 random bits); the sequence
    counts up within it. Together they let recovery's in-flight guard be exact without clocks:
    a branch of an earlier incarnation can have no live owner (we hold the log), and within ours a
    sequence number below a snapshot was begun before that snapshot.
    """

    def __init__(self, node_id: str) -> None:
        self.node_id = validate_node_id(node_id)
        self.incarnation = f"{int(time.time()):x}{os.urandom(3).hex()}"
        self._seq = itertools.count(1)
        self._last = 0

    def next(self) -> tuple[str, int]:
        self._last = seq = next(self._seq)  # itertools.count is atomic under the GIL
        return f"{self.node_id}{_SEP}{self.incarnation}-{seq:x}", seq

    @property
    def high_water(self) -> int:
        """Every sequence number handed out so far is at most this."""
        return self._last

    def own_seq(self, gtrid: str) -> int | None:
        """The sequence number if ``gtrid`` was made by this factory's incarnation, else None."""
        prefix = f"{self.node_id}{_SEP}{self.incarnation}-"
        if not gtrid.startswith(prefix):
            return None
        tail = gtrid[len(prefix) :]
        return int(tail, 16) if tail and all(c in "0123456789abcdef" for c in tail) else None


def custom_gtrid(node_id: str, suffix: str) -> str:
    """A caller-chosen gtrid (a Spark batch id, say), still prefixed with our node id."""
    return _check_part("gtrid", f"{validate_node_id(node_id)}{_SEP}{suffix}")


@dataclass(frozen=True)
class Xid:
    """An XA transaction id ``(format_id, gtrid, bqual)``; construction validates it."""

    format_id: int
    gtrid: str
    bqual: str

    def __post_init__(self) -> None:
        fid = self.format_id
        if type(fid) is not int or not 0 <= fid < 2**31:  # bool is an int, and not a format id
            raise InvalidXidError(f"format id {self.format_id!r} must be an int in 0..2**31-1")
        _check_part("gtrid", self.gtrid)
        _check_part("bqual", self.bqual)

    @classmethod
    def branch_of(cls, gtrid: str, bqual: str) -> Xid:
        return cls(FORMAT_ID, gtrid, bqual)

    @classmethod
    def _checked_parts(cls, gtrid: str, bqual: str) -> Xid:
        """`branch_of` for parts already validated: a gtrid this manager made (or checked with
        `custom_gtrid`) and a registered resource's name. Every join builds one, and the two
        regular-expression checks were a visible share of a transaction's CPU."""
        xid = object.__new__(cls)
        object.__setattr__(xid, "format_id", FORMAT_ID)
        object.__setattr__(xid, "gtrid", gtrid)
        object.__setattr__(xid, "bqual", bqual)
        return xid

    @property
    def node_id(self) -> str | None:
        """The node prefix of the gtrid, or None for an xid that is not in our form."""
        head, sep, _ = self.gtrid.partition(_SEP)
        return head if sep and _NODE_ID.match(head) else None

    def belongs_to(self, node_id: str) -> bool:
        return self.format_id == FORMAT_ID and self.node_id == node_id

    def with_bqual(self, bqual: str) -> Xid:
        return Xid(self.format_id, self.gtrid, bqual)

    def to_gid(self) -> str:
        """The psycopg2/JDBC text form; only base64 and digits, so it is safe to quote."""
        g = base64.b64encode(self.gtrid.encode("ascii")).decode("ascii")
        b = base64.b64encode(self.bqual.encode("ascii")).decode("ascii")
        return f"{self.format_id}_{g}_{b}"

    @classmethod
    def from_gid(cls, gid: str) -> Xid:
        """Parse the text form; anything else (a foreign gid, an injection attempt) is refused."""
        if not isinstance(gid, str) or len(gid) > MAX_GID_BYTES or "\x00" in gid:
            raise InvalidXidError(f"not a twopc gid: {str(gid)[:80]!r}")
        parts = gid.split("_")
        if len(parts) != 3 or not (parts[0].isascii() and parts[0].isdigit()):
            raise InvalidXidError(f"not a twopc gid: {gid[:80]!r}")
        try:
            gtrid = base64.b64decode(parts[1], validate=True).decode("ascii")
            bqual = base64.b64decode(parts[2], validate=True).decode("ascii")
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise InvalidXidError(f"not a twopc gid: {gid[:80]!r} ({exc})") from None
        return cls(int(parts[0]), gtrid, bqual)

    def __str__(self) -> str:
        return self.to_gid()


def branches_of(gids: Iterable[str], bqual: str, *, sub_branches: bool = False) -> list[Xid]:
    """The xids among ``gids`` that are twopc's (our format id) and branch ``bqual``, in order.

    Every resource's ``recover`` lists what its store holds and must keep only its own branches:
    a foreign or hostile gid is skipped, never parsed into something we would then finish.
    ``sub_branches=True`` (a resource that opts in) also keeps ``bqual``'s sub-branches.
    """
    found: list[Xid] = []
    for gid in gids:
        try:
            xid = Xid.from_gid(gid)
        except InvalidXidError:
            continue
        if xid.format_id != FORMAT_ID:
            continue
        if xid.bqual == bqual or (sub_branches and is_sub_branch_of(xid.bqual, bqual)):
            found.append(xid)
    return found


# -- sub-branches --------------------------------------------------------------------------------
#
# A transaction begun by this manager has one branch per resource, whose bqual is the resource's
# name. A writer that runs in many processes under one gtrid (Spark: one branch per task attempt
# on every resource) needs several branches of one resource in one gtrid, so its bqual is
# ``<resource name>~<tag>``. Recovery finds the resource by the name before the separator, and a
# tag ending in ``@<hex unix seconds>`` says when the branch was begun: such a branch was begun by
# a process this manager does not know about, so recovery presumes it aborted only once it is
# older than the manager's ``sub_branch_grace`` (the in-flight guard cannot know it).

SUB_BRANCH_SEP = "~"
_BORN = re.compile(r"@([0-9a-f]{1,12})\Z")


def is_sub_branch_of(bqual: str, name: str) -> bool:
    return bqual.startswith(name + SUB_BRANCH_SEP) and len(bqual) > len(name) + 1


def sub_branch(name: str, tag: str, born: float | None = None) -> str:
    """The bqual of a sub-branch of resource ``name``; ``born`` (unix seconds) is stamped in."""
    stamp = "" if born is None else f"@{int(born):x}"
    return _check_part("bqual", f"{name}{SUB_BRANCH_SEP}{tag}{stamp}")


def sub_branch_born(bqual: str) -> float | None:
    """When a stamped sub-branch was begun (unix seconds), else None."""
    if SUB_BRANCH_SEP not in bqual:
        return None
    match = _BORN.search(bqual)
    return float(int(match.group(1), 16)) if match else None


def resource_of(bqual: str, names: Iterable[str]) -> str | None:
    """The name among ``names`` that owns branch ``bqual``: the exact name, else the longest name
    of which it is a sub-branch (a name may itself contain the separator), else None."""
    candidates = list(names)
    if bqual in candidates:
        return bqual
    owners = [n for n in candidates if is_sub_branch_of(bqual, n)]
    return max(owners, key=len) if owners else None
