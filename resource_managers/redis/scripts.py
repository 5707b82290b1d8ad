"""The Lua scripts of a Redis branch, loaded once per client and run by SHA.

Each script is ``lua/common.lua`` (the write-set parser, the validating simulation, apply, lock
release) followed by its own body from ``lua/<name>.lua``. Only fixed code is concatenated here:
data reaches a script through ``KEYS`` and ``ARGV`` and nowhere else.

Scripts are registered with ``client.register_script`` and run with ``EVALSHA``; a server that
has forgotten them (a restart, ``SCRIPT FLUSH``, a failover to a replica that never saw them)
answers ``NOSCRIPT`` and the script is loaded again and rerun, which is safe because a script that
was not found did nothing. Replies are read without decoding (``NEVER_DECODE``) whatever the
client's ``decode_responses``, since keys and values in them are arbitrary bytes.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

from redis.client import NEVER_DECODE
from redis.commands.core import Script
from redis.exceptions import NoScriptError

NAMES = ("prepare", "commit", "one_phase", "rollback", "read", "watch", "forget")


@cache
def source(name: str) -> str:
    """The complete text of one script: the shared library, then the script's body."""
    if name not in NAMES:
        raise KeyError(name)
    folder = resources.files(__package__).joinpath("lua")
    common = folder.joinpath("common.lua").read_text(encoding="utf-8")
    body = folder.joinpath(f"{name}.lua").read_text(encoding="utf-8")
    return f"{common}\n{body}"


class Scripts:
    """The branch scripts registered on one client (a `redis.Redis` or `RedisCluster`)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._scripts: dict[str, Script] = {
            name: client.register_script(source(name)) for name in NAMES
        }

    def run(self, name: str, keys: list[bytes], args: list[bytes | str | int]) -> Any:
        """``EVALSHA`` the script; on ``NOSCRIPT`` load it and run it again."""
        script = self._scripts[name]
        try:
            return self._evalsha(script.sha, keys, args)
        except NoScriptError:
            script.sha = self._client.script_load(script.script)
            return self._evalsha(script.sha, keys, args)

    def _evalsha(self, sha: str, keys: list[bytes], args: list[bytes | str | int]) -> Any:
        return self._client.execute_command(
            "EVALSHA", sha, len(keys), *keys, *args, **{NEVER_DECODE: []}
        )
