"""Global ids and branch ids of Spark writes: stable where Spark retries, unique where it races.

Why the global id (gtrid) looks as it does: Spark calls ``commit`` again for the same micro-batch
after a driver restart, and a batch job re-run with the same ``txnVersion`` must not write twice,
so the gtrid is a pure function of what survives a restart: ``{node}:{appId}:{batchId}``
(streaming), ``{node}:{appId}:{txnVersion}`` (batch with a caller-given version) or
``{node}:{appId}:{uuid}`` (batch without: exactly once within one job run, not across re-runs).
``node`` is the coordinator node id the decision log is kept under (``spark`` by default), so
`coordinator.xid.Xid.node_id` of every Spark xid is that node and recovery of that node, and only
it, touches Spark branches.

Why the branch id (bqual) looks as it does: every task attempt prepares its own branch on every
resource, so one gtrid holds many branches of one resource. The bqual is therefore a
*sub-branch* of the resource (`coordinator.xid.sub_branch`): ``{resource}~p{partition}.a{attempt}
.t{taskAttemptId}.{nonce}@{born}``. The resource name before ``~`` lets the resource's
``recover()`` and the coordinator's recovery find the owner; partition, attempt and task attempt
id say which task wrote it (for people); the random nonce keeps it unique when a restarted driver
reuses task attempt ids under the same gtrid (a gid is never used twice: Redis and the message
log keep a tombstone of a rolled-back xid and refuse to prepare it again); ``born`` (hex unix
seconds) lets recovery leave it alone for a grace period, since no coordinator knows it is alive.

Length math (checked, not assumed): XA caps gtrid and bqual at 64 bytes each; a gid is
``{format_id}_{base64(gtrid)}_{base64(bqual)}``, 10 + 1 + 4*ceil(g/3) + 1 + 4*ceil(b/3) bytes,
at most 10 + 2 + 88 + 88 = 188 for two 64-byte parts, under PostgreSQL's 200 (199 usable). So the
binding limits are the two 64s: an appId is at most 24 characters (``spark:`` 6 + 24 + ``:`` 1 +
a 32-character uuid = 63), and a resource name at most 24, leaving 40 bytes of tag for partition,
attempt, task attempt id, nonce and birth stamp. Whatever is configured, `branch_xid` checks the
final gid and refuses with the option to shorten.
"""

from __future__ import annotations

import re
import secrets
import time
import uuid
from dataclasses import dataclass

from coordinator import ConfigurationError, Xid
from coordinator.xid import (
    MAX_GID_BYTES,
    MAX_PART_BYTES,
    SUB_BRANCH_SEP,
    sub_branch,
    validate_node_id,
)

DEFAULT_NODE = "spark"
MAX_APP_ID = 24
MAX_RESOURCE_NAME = 24
_APP_ID = re.compile(r"[A-Za-z0-9._-]+\Z")
_VERSION = re.compile(r"[A-Za-z0-9._-]{1,32}\Z")
_RESOURCE_NAME = re.compile(r"[A-Za-z0-9._-]{1,24}\Z")
_TAG = re.compile(r"p(\d+)\.a(\d+)\.t(\d+)\.([0-9a-f]+)@([0-9a-f]+)\Z")


def validate_app_id(app_id: str) -> str:
    """``appId``: 1-24 characters from letters, digits, ``.``, ``_``, ``-`` (it is in every gid)."""
    if not isinstance(app_id, str) or not app_id:
        raise ConfigurationError("option 'appId' is required: a stable name of this writer")
    if len(app_id) > MAX_APP_ID or not _APP_ID.match(app_id):
        raise ConfigurationError(
            f"option 'appId' {app_id[:80]!r}: 1-{MAX_APP_ID} characters from letters, digits, "
            "'.', '_', '-' (it becomes part of every transaction id, which XA caps at 64 bytes)"
        )
    return app_id


def validate_resource_label(name: str, option: str) -> str:
    """A target's resource name: short and free of ``~`` so its sub-branches parse back."""
    if not isinstance(name, str) or not _RESOURCE_NAME.match(name):
        raise ConfigurationError(
            f"option {option!r} {str(name)[:80]!r}: 1-{MAX_RESOURCE_NAME} characters from "
            "letters, digits, '.', '_', '-' (it prefixes every branch id)"
        )
    return name


def make_gtrid(
    app_id: str,
    *,
    batch_id: int | None = None,
    txn_version: str | None = None,
    node: str = DEFAULT_NODE,
) -> str:
    """The global id of one write: by streaming ``batch_id``, by ``txn_version``, else fresh.

    A fresh one (a uuid) must be made once, on the driver, and handed to every task and to
    ``commit``: each call without ``batch_id`` or ``txn_version`` returns a new id.
    """
    validate_app_id(app_id)
    try:
        validate_node_id(node)
    except ValueError as exc:
        raise ConfigurationError(f"option 'log.node': {exc}") from None
    if batch_id is not None and txn_version is not None:
        raise ConfigurationError("give a streaming batch id or option 'txnVersion', not both")
    if batch_id is not None:
        if isinstance(batch_id, bool) or not isinstance(batch_id, int) or batch_id < 0:
            raise ConfigurationError(f"batch id {batch_id!r} must be an int >= 0")
        suffix = str(batch_id)
    elif txn_version is not None:
        if not _VERSION.match(str(txn_version)):
            raise ConfigurationError(
                f"option 'txnVersion' {str(txn_version)[:80]!r}: 1-32 characters from letters, "
                "digits, '.', '_', '-'"
            )
        suffix = str(txn_version)
    else:
        suffix = uuid.uuid4().hex
    gtrid = f"{node}:{app_id}:{suffix}"
    if len(gtrid) > MAX_PART_BYTES:
        raise ConfigurationError(
            f"transaction id {gtrid!r} is {len(gtrid)} bytes, over XA's {MAX_PART_BYTES}: shorten "
            f"option 'appId' (or 'log.node', or 'txnVersion') by {len(gtrid) - MAX_PART_BYTES}"
        )
    return gtrid


def gtrid_prefix(app_id: str, node: str = DEFAULT_NODE) -> str:
    """What every gtrid of ``app_id`` starts with."""
    return f"{node}:{validate_app_id(app_id)}:"


def gid_length(gtrid: str, bqual: str) -> int:
    """Bytes of the PostgreSQL gid of ``(gtrid, bqual)``, without building an `Xid`."""

    def b64(n: int) -> int:
        return 4 * ((n + 2) // 3)

    return len(str(Xid.branch_of("x", "x").format_id)) + 2 + b64(len(gtrid)) + b64(len(bqual))


def branch_xid(
    gtrid: str,
    resource: str,
    *,
    partition: int,
    attempt: int,
    task_attempt_id: int,
    born: float | None = None,
    nonce: str | None = None,
) -> Xid:
    """The xid of one task attempt's branch on ``resource`` (see the module docstring)."""
    for label, value in (
        ("partition", partition),
        ("attempt", attempt),
        ("task_attempt_id", task_attempt_id),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigurationError(f"{label} {value!r} must be an int >= 0")
    nonce = nonce or secrets.token_hex(2)
    tag = f"p{partition}.a{attempt}.t{task_attempt_id}.{nonce}"
    born = time.time() if born is None else born
    full = f"{resource}{SUB_BRANCH_SEP}{tag}@{int(born):x}"
    if len(full) > MAX_PART_BYTES:
        raise ConfigurationError(
            f"branch id {full!r} is {len(full)} bytes, over XA's {MAX_PART_BYTES}: shorten the "
            f"target's resource name (option '*.name') by {len(full) - MAX_PART_BYTES}"
        )
    xid = Xid.branch_of(gtrid, sub_branch(resource, tag, born))
    if len(xid.to_gid()) > MAX_GID_BYTES:  # cannot happen with two 64-byte parts; kept honest
        raise ConfigurationError(f"gid of {gtrid!r}/{full!r} exceeds {MAX_GID_BYTES} bytes")
    return xid


def driver_xid(gtrid: str, resource: str, born: float | None = None) -> Xid:
    """The xid of the driver's own branch (the ledger row) of one commit attempt."""
    born = time.time() if born is None else born
    return Xid.branch_of(gtrid, sub_branch(resource, f"driver.{secrets.token_hex(3)}", born))


@dataclass(frozen=True)
class BranchInfo:
    """What a Spark branch id says, parsed back (for reports and tests)."""

    resource: str
    partition: int
    attempt: int
    task_attempt_id: int
    nonce: str
    born: float


def parse_branch(bqual: str) -> BranchInfo | None:
    """The parts of a task attempt's bqual, or None for any other bqual."""
    resource, sep, tag = bqual.rpartition(SUB_BRANCH_SEP)
    match = _TAG.match(tag) if sep else None
    if match is None:
        return None
    part, att, tid, nonce, born = match.groups()
    return BranchInfo(resource, int(part), int(att), int(tid), nonce, float(int(born, 16)))
