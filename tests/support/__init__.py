"""Test-only support code: resources with real durability, and resources that misbehave."""

from __future__ import annotations

from .file_resource import (
    AuditEntry,
    DurableState,
    FileResource,
    LedgerBranch,
    read_state,
)
from .flaky_resource import FlakyResource

__all__ = [
    "AuditEntry",
    "DurableState",
    "FileResource",
    "FlakyResource",
    "LedgerBranch",
    "read_state",
]
