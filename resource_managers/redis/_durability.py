"""Would this Redis keep a prepared branch across a crash? Asked once per resource.

A prepare is a promise only if the server persists it before answering and never throws it away:
the AOF on (``appendonly yes``), fsynced before every reply (``appendfsync always``; ``everysec``
may lose the last second of *acknowledged* writes), and no eviction (``maxmemory-policy
noeviction``: an evicting policy can drop staged write sets, locks and tombstones). ``strict``
refuses anything else and says what to set; ``relaxed`` accepts it with one warning. A server
that will not answer ``CONFIG GET`` (managed services, ACLs, a renamed command) cannot be checked,
so strict mode asks the user to opt in explicitly. Future: ``WAITAOF`` (Redis >= 7.2) could
confirm the fsync per prepare, on replicas too.
"""

from __future__ import annotations

import warnings
from typing import Any, Final

from redis import exceptions as rex
from redis.client import NEVER_DECODE

from coordinator import ConfigurationError

from ._errors import BUSY_PREFIXES, DurabilityWarning

REQUIRED: Final = {"appendonly": "yes", "appendfsync": "always", "maxmemory-policy": "noeviction"}


class ConfigRefused(Exception):
    """CONFIG GET is not allowed here."""


def read_settings(node: Any) -> dict[str, str | None]:
    """The settings that decide durability, from the server holding the resource's slot."""
    return {name: _config(node, name) for name in REQUIRED}


def judge(name: str, server: str, mode: str, found: dict[str, str | None] | None, why: str) -> None:
    """Raise (strict) or warn (relaxed) about what ``found`` lacks; None: CONFIG was refused."""
    if found is None:
        if mode == "strict":
            raise ConfigurationError(
                f"{name}: Redis refused CONFIG GET ({why}), so twopc cannot check that a "
                "prepared branch survives a crash (appendonly yes, appendfsync always, "
                "maxmemory-policy noeviction). If the service guarantees that, or you accept the "
                'risk, pass durability="relaxed" explicitly'
            )
        _warn(f"{name}: Redis refused CONFIG GET ({why}); durability is unchecked")
        return
    bad = [
        f"{setting} is {value!r} (needs {REQUIRED[setting]!r})"
        for setting, value in found.items()
        if value != REQUIRED[setting]
    ]
    if bad and mode == "strict":
        raise ConfigurationError(
            f"{name}: Redis at {server} could lose a prepared branch in a crash: "
            f"{'; '.join(bad)}. Set them in redis.conf (and CONFIG SET), or pass "
            'durability="relaxed" to accept the risk'
        )
    if bad:
        _warn(f"{name}: a prepared branch can be lost in a crash: " + "; ".join(bad))


def _warn(message: str) -> None:
    # stacklevel: judge <- _check_durability <- start <- the caller of start
    warnings.warn(message, DurabilityWarning, stacklevel=5)


def _config(node: Any, name: str) -> str | None:
    try:
        reply = node.execute_command("CONFIG", "GET", name, **{NEVER_DECODE: []})
    except rex.AuthenticationWrongNumberOfArgsError:
        raise
    except rex.ResponseError as exc:
        if str(exc).startswith(BUSY_PREFIXES):
            raise
        raise ConfigRefused(str(exc)) from exc
    if not isinstance(reply, dict):  # redis-py parses CONFIG GET into a dict; raw is a list
        reply = dict(zip(reply[0::2], reply[1::2], strict=True))
    values = {_text(k): _text(v) for k, v in reply.items()}
    return values.get(name)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
