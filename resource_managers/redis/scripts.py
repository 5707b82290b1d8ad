"""The Lua scripts of a Redis branch: one Redis function library, or scripts run by SHA.

The code is ``lua/common.lua`` (the write-set parser, the validating simulation, apply, lock
release) and one body per script in ``lua/<name>.lua``. Only fixed code is concatenated here:
data reaches a script through ``KEYS`` and ``ARGV`` and nowhere else.

On Redis >= 7.0 (standalone) all of it is one function library, loaded once with ``FUNCTION LOAD
REPLACE`` and run with ``FCALL``: the server compiles ``common.lua`` once, where a script would
re-run its ~50 definitions on every ``EVALSHA``. Each body becomes the callback of a function that
first points the library's ``KEYS``/``ARGV`` upvalues at its arguments, so the same body text runs
as a function and as a script. The library and its functions are named after a digest of the
code, so two twopc versions sharing a server never replace each other's code. A server that
refuses ``FUNCTION`` (older than 7.0, an ACL, a renamed command) and a cluster (where redis-py
would ask the server for an ``FCALL``'s keys on every call) run each script as
``common.lua`` + body with ``EVALSHA``.

Either way the code is registered once per client and the server may forget it (a restart without
the AOF, ``SCRIPT FLUSH``, ``FUNCTION FLUSH``, a failover to a replica that never saw it): it then
answers ``NOSCRIPT`` or "Function not found", and the code is loaded again and the call rerun,
which is safe because a call that was not found did nothing. Replies are read without decoding
(``NEVER_DECODE``) whatever the client's ``decode_responses``, since keys and values in them are
arbitrary bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import Any, Final

import redis
from redis import exceptions as rex
from redis.client import NEVER_DECODE
from redis.commands.core import Script

from ._errors import BUSY_PREFIXES

NAMES = ("prepare", "commit", "one_phase", "rollback", "read", "watch", "forget")
#: Function flags. Without flags a function is refused as a whole at ``maxmemory``, where a
#: script is refused at its first memory-growing write: so reads are ``no-writes``, and commit,
#: rollback and forget ``allow-oom`` (as scripts, their first write is a DEL, which Redis allows
#: at maxmemory, and lets a script that has written finish). Prepare and one-phase keep the
#: default: refused at maxmemory before anything runs, the same no vote as a script's.
FLAGS: Final = {
    "prepare": "",
    "commit": "'allow-oom'",
    "one_phase": "",
    "rollback": "'allow-oom'",
    "read": "'no-writes'",
    "watch": "'no-writes'",
    "forget": "'allow-oom'",
}
_MISSING_FUNCTION: Final = "Function not found"


def _text(name: str) -> str:
    folder = resources.files(__package__).joinpath("lua")
    return folder.joinpath(f"{name}.lua").read_text(encoding="utf-8")


@cache
def source(name: str) -> str:
    """The complete text of one script: the shared library, then the script's body."""
    if name not in NAMES:
        raise KeyError(name)
    return f"{_text('common')}\n{_text(name)}"


@cache
def library() -> tuple[str, str]:
    """(library name, library code): every script as a function of one library."""
    digest = hashlib.sha1(  # a name for this exact code, not a security measure
        "\0".join([_text("common"), *(_text(name) for name in NAMES), str(FLAGS)]).encode(),
        usedforsecurity=False,
    ).hexdigest()[:16]
    lib = f"twopc_{digest}"
    parts = [f"#!lua name={lib}", "local KEYS, ARGV", _text("common")]
    for name in NAMES:
        parts += [
            f"local function {name}_body()\n{_text(name)}\nend",
            f"redis.register_function{{function_name='{lib}_{name}', flags={{{FLAGS[name]}}},",
            "  callback=function(keys, args)",
            "    KEYS, ARGV = keys, args",
            f"    local reply = {name}_body()",
            "    KEYS, ARGV = nil, nil",
            "    return reply",
            "  end}",
        ]
    return lib, "\n".join(parts) + "\n"


class Scripts:
    """The branch scripts on one client (a `redis.Redis` or `RedisCluster`)."""

    def __init__(self, client: Any, cluster: bool = False) -> None:
        self._client = client
        self._scripts: dict[str, Script] = {
            name: client.register_script(source(name)) for name in NAMES
        }
        self._library, self._code = library()
        #: None: not decided yet; True: FCALL; False: EVALSHA
        self._functions: bool | None = False if cluster else None
        self._fcall = {name: f"{self._library}_{name}" for name in NAMES}
        #: a plain client without a pinned connection: calls go straight to a pooled
        #: connection (`resp_command`), with the client's own retry and disconnect-on-error.
        #: A client whose class overrides ``execute_command`` (instrumentation, say) keeps it
        self._direct = (
            not cluster
            and isinstance(client, redis.Redis)
            and type(client).execute_command is redis.Redis.execute_command
            and getattr(client, "connection", None) is None
        )

    @property
    def functions(self) -> bool | None:
        """Whether calls go through the function library (None until the first call)."""
        return self._functions

    def run(self, name: str, keys: list[bytes], args: list[bytes | str | int]) -> Any:
        """Run one script; load the code again if the server has lost it, and rerun."""
        if self._functions is None:
            self._functions = self._load_library()
        if self._functions:
            try:
                return self._call("FCALL", self._fcall[name], keys, args)
            except rex.ResponseError as exc:
                if not str(exc).startswith(_MISSING_FUNCTION):
                    raise
            self._functions = self._load_library()
            if self._functions:
                return self._call("FCALL", self._fcall[name], keys, args)
        script = self._scripts[name]
        try:
            return self._call("EVALSHA", script.sha, keys, args)
        except rex.NoScriptError:
            script.sha = self._client.script_load(script.script)
            return self._call("EVALSHA", script.sha, keys, args)

    @property
    def pool(self) -> Any:
        """The connection pool calls go through, or None when calls go through the client
        (a cluster, an instrumented client): then nothing can be pipelined on it."""
        return self._client.connection_pool if self._direct else None

    def pipelined(
        self, calls: list[tuple[str, list[bytes], list[Any]]], after_send: Callable[[], None]
    ) -> list[Any]:
        """Run ``calls`` in one round trip on one pooled connection: every call sent, then
        ``after_send()``, then every reply read. Returns one item per call, in order: its reply,
        or the exception that stands for it (an error reply: this call only; a lost connection:
        this call and every one after it, which may or may not have run). No retry and no reload
        here: the caller reruns what failed, one call at a time, through `run`."""
        packed = b"".join(self._packed(name, keys, args) for name, keys, args in calls)
        pool = self._client.connection_pool
        conn = pool.get_connection()
        replies: list[Any] = []
        try:
            conn.send_packed_command([packed])
            after_send()
            for _ in calls:
                try:
                    replies.append(conn.read_response(disable_decoding=True))
                except rex.ResponseError as exc:
                    replies.append(exc)
        except Exception as exc:  # the connection is gone: the rest are unknown
            conn.disconnect()
            replies += [exc] * (len(calls) - len(replies))
        finally:
            if conn.should_reconnect():
                conn.disconnect()
            pool.release(conn)
        return replies

    def send(self, name: str, keys: list[bytes], args: list[Any]) -> Callable[[], Any]:
        """Send one call now and return ``read()``, which waits for its reply: the reply, or
        None when nothing is known of the call (an error reply, the code lost by the server, a
        lost connection) and the caller must run it again through `run`. The connection stays
        out of the pool until ``read()``, which must be called exactly once."""
        if not self._direct:  # through the client: one call at a time, by `run`
            return _unknown
        pool = self._client.connection_pool
        try:
            packed = self._packed(name, keys, args)
            conn = pool.get_connection()
        except Exception:  # `run` will say why
            return _unknown
        try:
            conn.send_packed_command([packed])
        except Exception:
            conn.disconnect()
            pool.release(conn)
            return _unknown

        def read() -> Any:
            try:
                return conn.read_response(disable_decoding=True)
            except Exception:
                conn.disconnect()
                return None
            finally:
                if conn.should_reconnect():
                    conn.disconnect()
                pool.release(conn)

        return read

    def _packed(self, name: str, keys: list[bytes], args: list[Any]) -> bytes:
        """One call as protocol bytes, through the library if the server runs it."""
        if self._functions is None:
            self._functions = self._load_library()
        if self._functions:
            return resp_command(["FCALL", self._fcall[name], len(keys), *keys, *args])
        return resp_command(["EVALSHA", self._scripts[name].sha, len(keys), *keys, *args])

    def _load_library(self) -> bool:
        """Load the library; False if this server will not run functions (use scripts)."""
        try:
            self._client.execute_command("FUNCTION LOAD", "REPLACE", self._code)
        except (rex.AuthenticationError, rex.AuthenticationWrongNumberOfArgsError):
            raise
        except rex.ResponseError as exc:
            if str(exc).startswith(BUSY_PREFIXES):
                raise  # not now, but maybe later: decide on a later call
            return False  # an unknown command, an ACL, a renamed FUNCTION
        return True

    def _call(self, command: str, target: str, keys: list[bytes], args: list[Any]) -> Any:
        return self.command([command, target, len(keys), *keys, *args])

    def command(self, parts: list[Any]) -> Any:
        """Send one command and read its reply undecoded: straight to a pooled connection
        (`resp_command`, the client's own retry and disconnect-on-error) when the client is a
        plain one, else through the client."""
        if not self._direct:
            return self._client.execute_command(*parts, **{NEVER_DECODE: []})
        packed = resp_command(parts)
        pool = self._client.connection_pool
        conn = pool.get_connection()
        try:
            return conn.retry.call_with_retry(
                lambda: _exchange(conn, packed), lambda _error: conn.disconnect()
            )
        finally:
            if conn.should_reconnect():
                conn.disconnect()
            pool.release(conn)


def _unknown() -> None:
    return None


def _exchange(conn: Any, packed: bytes) -> Any:
    conn.send_packed_command([packed])
    return conn.read_response(disable_decoding=True)


def resp_command(parts: list[Any]) -> bytes:
    """One command in the Redis protocol, every part bytes (str as UTF-8, int in decimal).

    What redis-py's ``pack_command`` makes, in one ``join``: a script call has a dozen parts,
    and redis-py encodes, measures and copies each through several layers (about a third of the
    client's CPU for a one-phase commit, measured)."""
    return b"*%d\r\n" % len(parts) + b"".join(
        [b"$%d\r\n%b\r\n" % (len(p), p) if type(p) is bytes else _field(p) for p in parts]
    )


def _field(part: str | int | bytes) -> bytes:
    if isinstance(part, str):
        data = part.encode()
    elif isinstance(part, int):
        data = b"%d" % part
    else:  # a bytes subclass, a bytearray, a memoryview
        data = bytes(part)
    return b"$%d\r\n%b\r\n" % (len(data), data)
