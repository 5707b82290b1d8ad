"""Redis for twopc: `RedisResource` makes a Redis server (or one hash slot of a cluster) a
two-phase-commit participant, with Lua scripts standing in for the PREPARE Redis does not have."""

from ._errors import BranchConflict, BranchFailed, DurabilityWarning, UnsupportedCommandError
from .branch import RedisBranch
from .resource import RedisResource

__all__ = [
    "BranchConflict",
    "BranchFailed",
    "DurabilityWarning",
    "RedisBranch",
    "RedisResource",
    "UnsupportedCommandError",
]
